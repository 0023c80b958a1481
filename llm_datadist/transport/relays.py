"""The relays of one engine's protected connections (``Relays``): each TCP connection of a
protected link, on either side, is sealed by a ``protection.Relay`` with the keys of its own
handshake and of its link; this part makes them and owns their threads.
"""

from __future__ import annotations

import socket
from typing import Tuple

from llm_datadist.transport import protection
from llm_datadist.transport.settings import LinkSettings
from llm_datadist.transport.stats import CountCallback
from llm_datadist.transport.threads import Threads


class Relays:
    """Makes the relays of protected connections with the secret of ``settings``; ``count`` is
    told of ``protection_failures`` (a record that failed its check: its connection closed)."""

    def __init__(self, settings: LinkSettings, count: CountCallback) -> None:
        self._settings = settings
        self._count = count
        self._threads = Threads("llm_datadist-seal")

    def make(self, sock: socket.socket, suite: str, nonces: Tuple[str, str], client_id: int, server_id: int,
             is_client: bool, name: str, digest: bytes) -> protection.Relay:
        """The relay sealing one TCP connection of a protected link in ``suite`` (keys of the
        connection's own handshake and the link's ``digest``), not started."""
        secret = self._settings.secret
        assert secret is not None  # a protected link is an authenticated one
        keys = protection.derive_keys(secret, suite, nonces[0], nonces[1], client_id, server_id, digest)

        def failed(why: str) -> None:
            self._count("protection_failures")

        return protection.Relay(sock, suite, keys, is_client, name, self._threads, failed)

    def join(self) -> None:
        """Join the relays' threads."""
        self._threads.join()
