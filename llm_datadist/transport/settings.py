"""What one cluster's links are held to (``LinkSettings``), read once from its options and the
environment when its link manager is made, and shared by the manager's parts.

The data plane (``llm.DataPlane``, ``planes.resolve``), the link secret (``auth``), the link
protection (``protection``), whether remote cache access is on, the link caps
(``LLM_DATADIST_MAX_LINKS``, ``LLM_DATADIST_MAX_LINKS_PER_SOURCE``), the handshake timeout
(``LLM_DATADIST_HANDSHAKE_TIMEOUT_MS``) and the largest table reply taken
(``LLM_DATADIST_MAX_TABLE_BYTES``); the handshake slots' caps are the listener's (``slots``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from llm_datadist.transport import auth, budgets, protection
from llm_datadist.transport import planes as plane_registry
from llm_datadist.transport.sockets import env_int, is_loopback, warn_once

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


@dataclass
class LinkSettings:
    """One cluster's link settings (module docstring). The parts of its link manager hold the one
    object and read it when they need a setting (a test may change ``secret`` or
    ``handshake_ms`` between links)."""

    cluster_id: int
    plane: str  # ``auto`` or the plane ``llm.DataPlane`` forces
    secret: Optional[bytes]
    protection: str  # this side's ``llm.LinkProtection``: what it asks for and insists on
    remote_accessible: bool
    handshake_ms: int = DEFAULT_HANDSHAKE_TIMEOUT_MS
    max_links: int = DEFAULT_MAX_LINKS
    max_links_per_source: int = DEFAULT_MAX_LINKS_PER_SOURCE
    max_table_bytes: int = budgets.DEFAULT_MAX_TABLE_BYTES
    #: Proves this process's own self-links: a connection claiming this cluster's id without a
    #: proof made with it is refused (``refused_self``).
    self_key: bytes = field(default_factory=auth.new_self_key, repr=False)

    @classmethod
    def resolve(cls, cluster_id: int, options: Dict[str, str]) -> "LinkSettings":
        """The settings of the cluster ``cluster_id`` with ``options``; ``LLMException
        (LLM_PARAM_INVALID)`` for a plane, secret or protection it refuses."""
        plane = plane_registry.resolve(options)
        secret = auth.resolve_secret(options)
        protect = protection.resolve(options, secret)
        # Every link asks which suites this process runs (handshake.request_link); the first answer
        # imports cryptography (~11 ms on the development VM), paid here rather than by the first link.
        protection.suites_here()
        return cls(cluster_id, plane, secret, protect, options.get("llm.EnableRemoteCacheAccessible", "0") == "1",
                   env_int(HANDSHAKE_TIMEOUT_ENV, DEFAULT_HANDSHAKE_TIMEOUT_MS),
                   env_int(MAX_LINKS_ENV, DEFAULT_MAX_LINKS),
                   env_int(MAX_LINKS_PER_SOURCE_ENV, DEFAULT_MAX_LINKS_PER_SOURCE), budgets.max_table_bytes())

    def warn_if_open(self, ip: str, port: int) -> None:
        """Warn (once) of listening on ``ip:port`` beyond loopback without a link secret."""
        if self.secret is None and not is_loopback(ip):
            warn_once(f"cluster {self.cluster_id} listens on {ip}:{port} without a link secret: "
                      f"any process that reaches this address can link, read and write the registered "
                      f"caches (set {auth.SECRET_OPTION} / {auth.SECRET_ENV} on every cluster)")
