"""The transport layer: link protocol (server thread, handshake, frames) and data planes.

``links.LinkManager`` is what the engine uses; ``wire`` holds the frame format, ``host`` the
host identity that decides whether two clusters may use the same-host plane.
"""
