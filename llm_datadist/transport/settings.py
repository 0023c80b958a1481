"""What one cluster's links are held to, read once from its options and the environment.

The link caps (``LLM_DATADIST_MAX_LINKS``, ``LLM_DATADIST_MAX_LINKS_PER_SOURCE``) and the
handshake timeout (``LLM_DATADIST_HANDSHAKE_TIMEOUT_MS``); the handshake slots' caps are the
listener's (``slots``).
"""

from __future__ import annotations

#: How long an accepted connection may take over its whole handshake (idle or unauthenticated
#: connections are closed then).
DEFAULT_HANDSHAKE_TIMEOUT_MS = 5000
HANDSHAKE_TIMEOUT_ENV = "LLM_DATADIST_HANDSHAKE_TIMEOUT_MS"
#: Links a cluster holds (each costs a thread per incoming connection, two by default).
DEFAULT_MAX_LINKS = 256
MAX_LINKS_ENV = "LLM_DATADIST_MAX_LINKS"
#: Of those, the most that one source may hold (links it asked for; see ``sockets.source_of``):
#: room for every rank of several engines on one host, and still room for others.
DEFAULT_MAX_LINKS_PER_SOURCE = 128
MAX_LINKS_PER_SOURCE_ENV = "LLM_DATADIST_MAX_LINKS_PER_SOURCE"
