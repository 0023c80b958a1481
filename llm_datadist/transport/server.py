"""Serving a peer's requests: one thread per incoming connection of a link reads request frames
and dispatches them by opcode (table, key release, notification, unlink, push, pull). A frame
that breaks the protocol closes the connection, and with it the whole link; a transfer whose
ranges are not registered here, or that was planned against an older registry, is refused with
a status and the link goes on.

A push or pull whose ranges lie wholly in registered host memory moves straight between the
socket and that memory; one wholly in registered device memory that the host cannot address is
staged through pinned bounce buffers (``transport.staging``) on a thread bound to the engine's
device; one with both kinds is refused like unregistered memory. A device copy that fails is
answered ``LLM_FAILED`` when the connection is still in step with the frame, else the link goes.

``Server`` is a part of ``links.LinkManager``.
"""

from __future__ import annotations

import logging
import socket
from typing import Any, Dict, Tuple

from llm_datadist import _io
from llm_datadist.transport import session as _session
from llm_datadist.transport import wire
from llm_datadist.transport.errors import S, CopyFailed, ProtocolError, status_of
from llm_datadist.transport.listener import close_socket
from llm_datadist.transport.session import MAX_LOST_RECORDS, Peer, read_body, read_header

logger = logging.getLogger("llm_datadist")


class Server:
    """Opcode dispatch of a peer's requests, as part of ``LinkManager``."""

    # -- serving requests -------------------------------------------------------------------------
    def _serve(self, conn: socket.socket, name: str, peer: Peer) -> None:
        """Serve the peer's requests on ``conn`` until it closes or breaks the protocol; then the
        whole link is gone (its other connections are closed too)."""
        peer_id = peer.cluster_id
        fd = conn.fileno()
        header = bytearray(wire.HEADER_BYTES)
        why = "the connection was closed"
        try:
            while not self._closed:
                st = read_header(fd, header, -1)
                if st != 0:
                    break
                op, _, req_id, length = wire.unpack_header(header)
                if op not in wire.REQUEST_OPS or op == wire.OP_HELLO:
                    raise ProtocolError(f"{wire.OP_NAMES[op]} is not a request")
                if not self._handle(fd, op, req_id, length, peer):
                    why = "unlinked, or a reply could not be sent"
                    break
        except ProtocolError as exc:
            logger.warning("closing connection from %s (cluster %s): %s", name, peer_id, exc)
            self.engine.count_protocol_error()
            why = f"protocol error: {exc}"
        finally:
            close_socket(conn)
            if not self._closed:
                self._lose(peer, why)

    def _recv_exact(self, fd: int, length: int, limit: int, what: str) -> bytearray:
        if length > limit:
            raise ProtocolError(f"{what} of {length} bytes exceeds {limit}")
        st, body = read_body(fd, length, _session.FRAME_TIMEOUT_MS)
        if st != 0:
            raise ProtocolError(f"{what} truncated ({status_of(st).name})")
        return body

    def _reply(self, fd: int, op: int, req_id: int, status: int, payload: bytes = b"") -> bool:
        st, _ = _io.send_bytes(fd, wire.pack_header(op, req_id, len(payload), status) + payload,
                                   _session.FRAME_TIMEOUT_MS)
        return st == 0

    def _handle(self, fd: int, op: int, req_id: int, length: int, peer: Peer) -> bool:
        engine = self.engine
        peer_id = peer.cluster_id
        if op == wire.OP_TABLE_GET:
            self._recv_exact(fd, length, wire.MAX_CONTROL_BYTES, "table request")
            table = engine.export_table()
            for plane in self.plane_objects:  # what each plane tells this peer (DataPlane.offer)
                table.update(plane.offer(peer))
            return self._reply(fd, wire.OP_TABLE, req_id, 0, wire.encode_json(table))
        if op == wire.OP_KEY_DONE:
            message = wire.decode_json(self._recv_exact(fd, length, wire.MAX_CONTROL_BYTES, "key release"))
            try:
                kind, ident, model_id = message["key"]
                released = engine.consume_key((str(kind), int(ident), int(model_id)),
                                              [int(t) for t in message["tensors"]])
            except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int(1e400)
                raise ProtocolError(f"malformed key release: {exc!r}") from None
            return self._reply(fd, wire.OP_KEY_DONE_REPLY, req_id, 0, wire.encode_json({"released": released}))
        if op == wire.OP_NOTIFY:
            message = wire.decode_json(self._recv_exact(fd, length, wire.MAX_CONTROL_BYTES, "notification"))
            status, answer = self._answer_notification(peer_id, message)
            return self._reply(fd, wire.OP_NOTIFY_REPLY, req_id, status, wire.encode_json(answer))
        if op == wire.OP_UNLINK:
            self._recv_exact(fd, length, wire.MAX_CONTROL_BYTES, "unlink")
            # Forget the link before answering, so that a relink right after the answer is not
            # mistaken for this one; close the connections after answering.
            with self._lock:
                peer.unlinked_by_peer = True
                if self._peers.get(peer_id) is peer:
                    del self._peers[peer_id]
                    if not peer.unlinking:
                        self._unlinked_by_peer.add(peer_id)
                        while len(self._unlinked_by_peer) > MAX_LOST_RECORDS:
                            self._unlinked_by_peer.pop()
                self._self_peers = [p for p in self._self_peers if p is not peer]
            self._reply(fd, wire.OP_UNLINK_DONE, req_id, 0)
            peer.close()
            logger.info("cluster %d: cluster %d unlinked", engine.cluster_id, peer_id)
            return False
        if op == wire.OP_PUSH:
            if length < 16:
                raise ProtocolError(f"push frame of {length} bytes")
            generation, desc_len = wire.U64x2.unpack(self._recv_exact(fd, 16, 16, "push"))
            if desc_len > length - 16 or desc_len % _io.WIRE_DESC_BYTES:
                raise ProtocolError(f"push: descriptor length {desc_len} in a frame of {length}")
            plan = self._wire_plan(self._recv_exact(fd, desc_len, wire.MAX_DESCRIPTOR_BYTES, "descriptors"))
            data_len = length - 16 - desc_len
            if plan.total_bytes != data_len:
                raise ProtocolError(f"push: descriptors cover {plan.total_bytes} bytes, frame carries {data_len}")
            drained = False
            with engine.pinned(plan, True) as (ranges, current, device_ranges):
                refusal, device = self._refusal(plan, True, generation, ranges, device_ranges, current, peer_id,
                                                "push")
                if refusal == 0 and device:
                    try:
                        st, _, _ = self._staged.recv(fd, plan, _session.FRAME_TIMEOUT_MS)
                    except CopyFailed as exc:  # the payload was read whole: the link goes on
                        logger.error("cluster %d: a push from %d into device memory failed: %s",
                                     engine.cluster_id, peer_id, exc)
                        refusal, drained, st = S.LLM_FAILED, True, 0
                elif refusal == 0:
                    st, _, _ = _io.recv_plan(fd, plan, False, _session.FRAME_TIMEOUT_MS)
                if refusal == 0 and st != 0:
                    raise ProtocolError(f"push payload truncated ({status_of(st).name})")
            if refusal and not drained:
                st, _, _ = _io.recv_discard(fd, data_len, _session.FRAME_TIMEOUT_MS)
                if st != 0:
                    raise ProtocolError("push payload truncated")
            return self._reply(fd, wire.OP_PUSH_DONE, req_id, refusal)
        if op == wire.OP_PULL:
            if length < 8 or (length - 8) % _io.WIRE_DESC_BYTES:
                raise ProtocolError(f"pull: frame length {length}")
            (generation,) = wire.U64.unpack(self._recv_exact(fd, 8, 8, "pull"))
            plan = self._wire_plan(self._recv_exact(fd, length - 8, wire.MAX_DESCRIPTOR_BYTES, "descriptors"))
            with engine.pinned(plan, False) as (ranges, current, device_ranges):
                refusal, device = self._refusal(plan, False, generation, ranges, device_ranges, current, peer_id,
                                                "pull")
                if refusal == 0:
                    head = wire.pack_header(wire.OP_PULL_DATA, req_id, plan.total_bytes, 0)
                    if not device:
                        st, _ = _io.send_plan(fd, head, plan, False, _session.FRAME_TIMEOUT_MS)
                        return st == 0
                    try:
                        st, _ = self._staged.send(fd, head, plan, _session.FRAME_TIMEOUT_MS)
                        return st == 0
                    except CopyFailed as exc:
                        logger.error("cluster %d: a pull by %d from device memory failed: %s", engine.cluster_id,
                                     peer_id, exc)
                        if not exc.in_step:
                            return False  # the reply went out cut short: the link goes
                        refusal = S.LLM_FAILED
            return self._reply(fd, wire.OP_PULL_DATA, req_id, refusal)
        raise ProtocolError(f"unexpected {wire.OP_NAMES[op]}")

    def _answer_notification(self, peer_id: int, message: Dict[str, Any]) -> Tuple[int, Dict[str, Any]]:
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
                             self.engine.cluster_id, peer_id)
            return S.LLM_FAILED, {"error": "the handler failed"}

    def _refusal(self, plan, dst_side: bool, generation: int, ranges, device_ranges, current: int, peer_id: int,
                 what: str) -> Tuple[int, bool]:
        """``(0, device)`` to accept a transfer, whose ``dst_side`` (or source) ranges lie wholly
        in registered host memory (``device`` False) or wholly in registered device memory
        (True); the stale-table status if the peer planned against an older registry;
        ``LLM_KV_CACHE_NOT_EXIST`` if a range is not registered memory here, or if the plan
        mixes both kinds."""
        if generation != current:
            return wire.STATUS_STALE_TABLE, False
        bad = ranges.first_outside(plan, dst_side)
        if bad < 0:
            return 0, False
        if len(device_ranges) and device_ranges.first_outside(plan, dst_side) < 0:
            return 0, True
        logger.warning("cluster %d refused a %s from %d: range %d is not registered memory%s",
                       self.engine.cluster_id, what, peer_id, bad,
                       " (or the transfer mixes host and device memory)" if len(device_ranges) else "")
        return S.LLM_KV_CACHE_NOT_EXIST, False

    @staticmethod
    def _wire_plan(data: bytearray):
        try:
            return _io.plan_from_wire(data)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None

