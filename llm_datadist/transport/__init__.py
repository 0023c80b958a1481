"""The transport layer: links between clusters and the data planes that move their bytes.

``links.LinkManager`` is the facade the engine uses (it sees the engine through
``engine_view.EngineView``): it holds the link table and the transfers, and is composed of parts
that own their state -- ``listener`` (with its handshake ``slots``), ``accept`` and ``connect``
(the two sides of ``handshake``), ``server``, ``planes.choice``, ``two_sided``, ``hooks``,
``relays``, ``stats`` -- over a link's state (``session``) and its ``settings``; ``planes`` is
the registry of data planes, one module each; ``wire`` holds the frame format, ``host`` the host
identity that decides whether two clusters may share a host's planes.
"""
