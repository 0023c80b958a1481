"""The transport layer: links between clusters and the data planes that move their bytes.

``links.LinkManager`` is the facade the engine uses (it sees the engine through
``engine_view.EngineView``); ``listener``, ``handshake``, ``session`` and ``server`` are its parts;
``planes`` is the registry of data planes, one module each; ``wire`` holds the frame format,
``host`` the host identity that decides whether two clusters may share a host's planes.
"""
