"""What the application hooks into its links (``Hooks``): the handler that answers the peers'
notifications (``notify`` sends one over a link; the server's ``OP_NOTIFY`` handler,
``on_notify``, answers with the handler), and the read and write guards of the peers' pulls and
pushes through the server (``read_guard``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Tuple

from llm_datadist.transport import budgets, server, wire
from llm_datadist.transport.errors import S, fail, status_of
from llm_datadist.transport.read_guard import ReadGuard, WriteGuard
from llm_datadist.transport.session import Link
from llm_datadist.transport.stats import CountCallback

logger = logging.getLogger("llm_datadist")

#: ``handler(peer_cluster_id, message) -> reply``: the application's answer to a notification.
NotifyHandler = Callable[[int, Dict[str, Any]], Dict[str, Any]]


class Hooks:
    """The notification handler and the guards of one engine's links. ``count`` counts the
    refusals (``refused_reads``, ``refused_writes``, the budgets' on a notification); ``lose``
    ends a link that a notification left out of step."""

    def __init__(self, cluster_id: int, count: CountCallback, lose: Callable[[Link, str], None]) -> None:
        self.cluster_id = cluster_id
        self._count = count
        self._lose = lose
        self._notify_handler: Optional[NotifyHandler] = None
        #: Which registered memory a peer may pull through the server (none installed: all of it).
        self.read_guard = ReadGuard(cluster_id, count)
        #: Which registered memory a peer may push into through the server (none installed: all of it).
        self.write_guard = WriteGuard(cluster_id, count)

    def set_notify_handler(self, handler: Optional[NotifyHandler]) -> None:
        """Answer the linked peers' notifications with ``handler(peer_cluster_id, message) -> reply``
        (JSON objects; it runs on the connection's thread, so it must be quick). None: refuse them
        with ``LLM_FEATURE_NOT_ENABLED``."""
        self._notify_handler = handler

    def set_read_guard(self, guard: Optional[Callable[[int, bytes], Any]]) -> None:
        """Check every peer's pull through the server with ``guard(peer_cluster_id, tag) ->
        allowed ranges or None`` (``read_guard``); None: no guard."""
        self.read_guard.set(guard)

    def set_write_guard(self, guard: Optional[Callable[[int], Any]]) -> None:
        """Check every peer's push through the server with ``guard(peer_cluster_id) -> allowed
        ranges or None`` (``read_guard.WriteGuard``); None: no guard."""
        self.write_guard.set(guard)

    def quiesce_writes(self, peer_cluster_id: int, timeout_s: float) -> bool:
        """Wait for the peer's pushes that passed the write guard to end (``WriteGuard.quiesce``)."""
        return self.write_guard.quiesce(peer_cluster_id, timeout_s)

    def notify(self, peer: Link, message: Dict[str, Any], timeout_ms: int) -> Dict[str, Any]:
        """Send a JSON object to the peer of a link (authenticated like it) and return its
        handler's reply; ``LLMException`` with the peer's status if it refused or failed."""
        try:
            status, reply = peer.outgoing.control(wire.OP_NOTIFY, wire.OP_NOTIFY_REPLY, message, timeout_ms,
                                                  "notification", limit=budgets.max_message_bytes())
        finally:
            why = peer.broken()
            if why is not None:
                self._lose(peer, why)
        if status != 0:
            raise fail(status, f"cluster {peer.cluster_id} did not take the notification: "
                                f"{status_of(status).name} ({reply.get('error', '')})")
        return reply

    def on_notify(self, fd: int, req_id: int, length: int, peer: Link) -> bool:
        """The server's handler of ``OP_NOTIFY`` (within the budgets: ``server.read_control``)."""
        message, goes_on = server.read_control(fd, req_id, length, wire.OP_NOTIFY_REPLY, "notification",
                                               self._count, peer)
        if message is None:
            return goes_on
        status, answer = self._answer(peer.cluster_id, message)
        return server.reply(fd, wire.OP_NOTIFY_REPLY, req_id, status, wire.encode_json(answer))

    def _answer(self, peer_id: int, message: Dict[str, Any]) -> Tuple[int, Dict[str, Any]]:
        handler = self._notify_handler
        if handler is None:
            return S.LLM_FEATURE_NOT_ENABLED, {"error": "this cluster takes no notifications"}
        try:
            answer = handler(peer_id, message)
            if not isinstance(answer, dict):
                raise TypeError(f"the notification handler returned {type(answer).__name__}, not a dict")
            return S.LLM_SUCCESS, answer
        except Exception:  # the application's handler: its failure is the peer's answer, not ours
            logger.exception("cluster %d: the handler of a notification from cluster %d failed",
                             self.cluster_id, peer_id)
            return S.LLM_FAILED, {"error": "the handler failed"}
