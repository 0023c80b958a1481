"""Serving a peer's requests: ``Server`` reads request frames on a link's incoming connections,
one thread per connection, and dispatches them by opcode through the dispatch table it was given;
``Requests`` holds the handlers that only the engine answers (the cache table, key release, push,
pull). A frame that breaks the protocol closes the connection, and with it the whole link (the
server tells its owner, ``on_end``); a transfer whose ranges are not registered here, or that
was planned against an older registry, is refused with a status and the link goes on.

With a read guard installed (``read_guard``), a pull is first checked against the ranges the
guard allows for the tag its frame carries; a refused one is answered with a status before a byte
moves, and the link goes on. With a write guard installed, a push is first checked the same way
against the ranges the guard allows its authenticated peer; a refused one's payload is drained
unwritten.

A push or pull whose ranges lie wholly in registered host memory moves straight between the
socket and that memory; one wholly in registered device memory that the host cannot address is
staged through pinned bounce buffers (the ``device_payload`` a plane provides: the staging
plane's, ``transport.staging``) on a thread bound to the engine's device, within the link's share
of the staging budget (a staged push's payload must keep arriving); one with both kinds is
refused like unregistered memory. A device copy that fails is answered ``LLM_FAILED`` when the
connection is still in step with the frame, else the link goes.

A push or pull holds its memory in the registry (``EngineView.pinned``) until its frame's
deadline at the latest: unregistering that memory waits for it until then and then shuts its
connection down (the transfer fails, the link ends) before the memory is released.

Control requests (table request, key release, and the manager's notification and unlink) are
read within the byte budgets of ``budgets``: one larger than ``LLM_DATADIST_MAX_MESSAGE_BYTES``, or
one finding no room in the process's parsing budget or its link's or source's share of it in
time, is read and dropped unparsed and refused with a status (``read_control``); the link goes
on. A body must keep arriving while it is read (``session.receive_steadily``): one that stalls
gives its bytes back at once and its connection, so its link, is dropped.

A handler is ``handler(fd, req_id, length, peer) -> bool``: it reads the ``length`` bytes of the
request's body (``recv_exact``), answers (``reply``), and returns whether the connection goes on.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

from llm_datadist import _io
from llm_datadist.transport import budgets
from llm_datadist.transport import session as _session
from llm_datadist.transport import wire
from llm_datadist.transport.engine_view import EngineView
from llm_datadist.transport.errors import S, CopyFailed, ProtocolError, Stalled, status_of
from llm_datadist.transport.sockets import close_socket
from llm_datadist.transport.read_guard import ReadGuard, WriteGuard
from llm_datadist.transport.session import Link, read_body, read_header
from llm_datadist.transport.threads import Threads

logger = logging.getLogger("llm_datadist")

#: ``handler(fd, req_id, length, peer) -> whether the connection goes on``.
Handler = Callable[[int, int, int, Link], bool]


def recv_exact(fd: int, length: int, limit: int, what: str) -> bytearray:
    """The ``length`` bytes of a request's body; ProtocolError if more than ``limit`` or cut short."""
    if length > limit:
        raise ProtocolError(f"{what} of {length} bytes exceeds {limit}")
    st, body = read_body(fd, length, _session.FRAME_TIMEOUT_MS)
    if st != 0:
        raise ProtocolError(f"{what} truncated ({status_of(st).name})")
    return body


def read_control(fd: int, req_id: int, length: int, reply_op: int, what: str, count: Callable[[str], Any],
                 peer: Link, parse: bool = True) -> Tuple[Optional[Dict[str, Any]], bool]:
    """Read a control request of ``peer``'s link within the budgets (``budgets``) and, with
    ``parse``, decode it: ``(message, True)`` (``{}`` without ``parse``), the body's bytes of the
    parsing budget (and of the link's share of it, ``Link.shares``) held only while it was read
    and decoded; ``(None, goes_on)`` when the request was refused: its body read and dropped, the
    peer answered ``LLM_PARAM_INVALID`` (larger than ``LLM_DATADIST_MAX_MESSAGE_BYTES``, counted
    ``refused_oversized``) or ``LLM_LINK_BUSY`` (no room in the parsing budget or the link's or
    its source's share of it in time, ``refused_parsing``), the link going on. ProtocolError for
    a body longer than ``wire.MAX_CONTROL_BYTES``, cut short, stalled (``stalled_parsing``: what
    it held is given back first) or not a JSON object."""
    if length > wire.MAX_CONTROL_BYTES:  # no control message is that long: not drained, the connection goes
        raise ProtocolError(f"{what} of {length} bytes exceeds the protocol's {wire.MAX_CONTROL_BYTES}")
    limit = budgets.max_message_bytes()
    if length > limit:
        refused = count("refused_oversized")
        return None, _refuse_control(fd, req_id, length, reply_op, S.LLM_PARAM_INVALID,
                                     f"{what} of {length} bytes exceeds {limit} ({budgets.MAX_MESSAGE_BYTES_ENV})",
                                     what, peer, refused)
    budget, share = budgets.parsing(), peer.shares.parsing
    blocked = budget.take(length, budgets.PARSING_WAIT_S, share)
    if blocked is not None:
        refused = count("refused_parsing")
        return None, _refuse_control(fd, req_id, length, reply_op, S.LLM_LINK_BUSY,
                                     f"too many control messages are being parsed (no room in the "
                                     f"{_BOUND_NAMES[blocked]}); try again", what, peer, refused)
    try:
        st, body = _session.read_body_steadily(fd, length, time.monotonic() + _session.FRAME_TIMEOUT_MS / 1000)
        if st != 0:
            _truncated(budget, st, what, length, peer)
        return (wire.decode_json(body) if parse else {}), True
    finally:
        budget.release(length, share)


#: The bounds of the parsing budget, as a refusal names them (``ByteBudget.blocker``).
_BOUND_NAMES = {"process": f"process's budget, {budgets.MAX_PARSING_BYTES_ENV}",
                "source": f"share of this link's source, {budgets.MAX_PARSING_PER_SOURCE_ENV}",
                "link": "share of this link"}


def _truncated(budget: budgets.ByteBudget, st: int, what: str, length: int, peer: Link) -> None:
    """Raise ProtocolError for a control body that did not arrive whole (status ``st``); Stalled,
    counted first, for one that stalled (``LLM_TIMEOUT`` within the frame's time:
    ``receive_steadily``)."""
    if st == S.LLM_TIMEOUT:
        budget.note_stall(f"a {what} of {length} bytes", f"cluster {peer.cluster_id}")
        raise Stalled(f"{what} of {length} bytes stalled ({budgets.STALL_MS_ENV})")
    raise ProtocolError(f"{what} truncated ({status_of(st).name})")


def _refuse_control(fd: int, req_id: int, length: int, reply_op: int, status: int, why: str, what: str,
                    peer: Link, refused: Optional[int]) -> bool:
    """Read and drop a refused request's body (which must keep arriving, as one read would),
    answer ``status`` with ``{"error": why}``; logged when ``budgets.worth_logging(refused)``
    (``refused``: how many such refusals so far, None if not counted)."""
    if budgets.worth_logging(refused):
        logger.warning("refused a control message from cluster %d: %s (%s such so far)", peer.cluster_id, why,
                       "?" if refused is None else refused)
    st = _session.discard_steadily(fd, length, time.monotonic() + _session.FRAME_TIMEOUT_MS / 1000)
    if st != 0:
        _truncated(budgets.parsing(), st, f"refused {what}", length, peer)
    return reply(fd, reply_op, req_id, status, wire.encode_json({"error": why}))


def _push_problem(problem: int, length: int, value: int, generation: int, desc_len: int) -> str:
    """What ``_io.read_push`` found wrong with a PUSH frame, in the words of the protocol errors."""
    if problem == _io.PUSH_TRUNCATED:
        return f"push truncated ({status_of(value).name})"
    if problem == _io.PUSH_BAD_LENGTH:
        return f"push: descriptor length {desc_len} in a frame of {length}"
    if problem == _io.PUSH_TOO_MANY:
        return f"descriptors of {desc_len} bytes exceeds {wire.MAX_DESCRIPTOR_BYTES}"
    if problem == _io.PUSH_DESCS_TRUNCATED:
        return f"descriptors truncated ({status_of(value).name})"
    if problem == _io.PUSH_WRAPS:
        return f"descriptor {value} wraps around the address space"
    return f"push: descriptors cover {value} bytes, frame carries {length - 16 - desc_len}"


def _pin_terms(fd: int) -> Tuple[float, Callable[[], None]]:
    """The deadline of a transfer that starts now on ``fd`` (its frame's, ``FRAME_TIMEOUT_MS``)
    and how to cancel it: shut its connection down, which fails the transfer (and ends the link)
    before another byte of it moves. Called with the transfer's pin held, so ``fd`` is still its
    connection."""

    def cancel() -> None:
        sock = socket.socket(fileno=os.dup(fd))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()

    return time.monotonic() + _session.FRAME_TIMEOUT_MS / 1000, cancel


def reply(fd: int, op: int, req_id: int, status: int, payload: bytes = b"") -> bool:
    """Send a reply frame; whether it went out whole."""
    st, _ = _io.send_bytes(fd, wire.pack_header(op, req_id, len(payload), status) + payload,
                           _session.FRAME_TIMEOUT_MS)
    return st == 0


class Server:
    """Serves the requests of linked peers on their incoming connections.

    ``handlers``: the dispatch table, opcode -> ``Handler``; ``on_end(peer, why)``: a connection
    of the link of ``peer`` ended (closed, broken, or a protocol error) while the server runs."""

    def __init__(self, engine: EngineView, handlers: Mapping[int, Handler],
                 on_end: Callable[[Link, str], None]) -> None:
        self.engine = engine
        self._handlers = dict(handlers)
        self._on_end = on_end
        self._stopped = False
        self._threads = Threads("llm_datadist-conn")

    def serve_in_thread(self, conn: socket.socket, name: str, peer: Link) -> None:
        """``serve`` on a thread of the server's own."""
        self._threads.spawn(self.serve, conn, name, peer)

    def serve(self, conn: socket.socket, name: str, peer: Link) -> None:
        """Serve the peer's requests on ``conn`` until it closes or breaks the protocol; then the
        whole link is gone (``on_end``: its other connections are closed too). Closes ``conn``."""
        peer_id = peer.cluster_id
        fd = conn.fileno()
        header = bytearray(wire.HEADER_BYTES)
        handlers = self._handlers
        why = "the connection was closed"
        try:
            while not self._stopped:
                st = read_header(fd, header, -1, _io.SPIN_REQUEST)  # (the peer's next request, if any)
                if st != 0:
                    break
                op, _, req_id, length = wire.unpack_header(header)
                if op not in wire.REQUEST_OPS or op == wire.OP_HELLO:
                    raise ProtocolError(f"{wire.OP_NAMES[op]} is not a request")
                handler = handlers.get(op)
                if handler is None:
                    raise ProtocolError(f"unexpected {wire.OP_NAMES[op]}")
                if not handler(fd, req_id, length, peer):
                    why = "unlinked, or a reply could not be sent"
                    break
        except ProtocolError as exc:
            # (a stall was logged, rate-limited, where it was found: ``ByteBudget.note_stall``)
            (logger.debug if isinstance(exc, Stalled) else logger.warning)(
                "closing connection from %s (cluster %s): %s", name, peer_id, exc)
            self.engine.count_protocol_error()
            why = f"protocol error: {exc}"
        finally:
            close_socket(conn)
            if not self._stopped:
                self._on_end(peer, why)

    def stop(self) -> None:
        """Serve no more requests; ended connections no longer end their links (finalize)."""
        self._stopped = True

    def join(self) -> None:
        self._threads.join()


class Requests:
    """The handlers of the requests that the engine answers: ``OP_TABLE_GET`` (the engine's table
    and what each plane tells the peer, ``DataPlane.offer``), ``OP_KEY_DONE``, ``OP_PUSH`` and
    ``OP_PULL``.

    ``planes()``: the engine's plane instances now; ``device_payload``: the payload that moves a
    transfer's bytes into and out of this engine's device memory (None: such transfers are
    refused like unregistered memory); ``guard``: the engine's read guard, which every pull
    passes first (``read_guard.ReadGuard``; none installed by default); ``write_guard``: the same
    for every push (``read_guard.WriteGuard``)."""

    def __init__(self, engine: EngineView, planes: Callable[[], Iterable[Any]], device_payload: Optional[Any],
                 count: Callable[[str], Any] = lambda counter: None, guard: Optional[ReadGuard] = None,
                 write_guard: Optional[WriteGuard] = None) -> None:
        self.engine = engine
        self._planes = planes
        self._device = device_payload
        self._count = count  # counts a refusal by a budget (``LinkManager.stats``)
        self._read_guard = guard if guard is not None else ReadGuard(engine.cluster_id)
        self._write_guard = write_guard if write_guard is not None else WriteGuard(engine.cluster_id)

    def handlers(self) -> Dict[int, Handler]:
        return {wire.OP_TABLE_GET: self.table, wire.OP_KEY_DONE: self.key_done, wire.OP_PUSH: self.push,
                wire.OP_PULL: self.pull}

    def table(self, fd: int, req_id: int, length: int, peer: Link) -> bool:
        message, goes_on = read_control(fd, req_id, length, wire.OP_TABLE, "table request", self._count, peer,
                                        parse=False)
        if message is None:
            return goes_on
        table = self.engine.export_table()
        for plane in self._planes():  # what each plane tells this peer (DataPlane.offer)
            table.update(plane.offer(peer))
        return reply(fd, wire.OP_TABLE, req_id, 0, wire.encode_json(table))

    def key_done(self, fd: int, req_id: int, length: int, peer: Link) -> bool:
        message, goes_on = read_control(fd, req_id, length, wire.OP_KEY_DONE_REPLY, "key release", self._count, peer)
        if message is None:
            return goes_on
        try:
            kind, ident, model_id = message["key"]
            released = self.engine.consume_key((str(kind), int(ident), int(model_id)),
                                               [int(t) for t in message["tensors"]])
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int(1e400)
            raise ProtocolError(f"malformed key release: {exc!r}") from None
        return reply(fd, wire.OP_KEY_DONE_REPLY, req_id, 0, wire.encode_json({"released": released}))

    def push(self, fd: int, req_id: int, length: int, peer: Link) -> bool:
        peer_id = peer.cluster_id
        if length < 16:
            raise ProtocolError(f"push frame of {length} bytes")
        # The generation, descriptor length and descriptors, read and checked in one call.
        problem, *values = _io.read_push(fd, length, _session.FRAME_TIMEOUT_MS, wire.MAX_DESCRIPTOR_BYTES)
        if problem != _io.PUSH_OK:
            raise ProtocolError(_push_problem(problem, length, *values))
        # (counted from before its check to its last byte: an owner that narrows the guard waits for
        # the pushes that passed it, ``WriteGuard.quiesce``)
        with self._write_guard.writing(peer_id, fd):
            return self._push(fd, req_id, length, peer, *values)

    def _push(self, fd: int, req_id: int, length: int, peer: Link, generation: int, desc_len: int, plan) -> bool:
        engine = self.engine
        peer_id = peer.cluster_id
        data_len = length - 16 - desc_len
        drained = False
        # (the write guard first: a refused push pins nothing, its payload is drained below)
        guarded = self._write_guard.refusal(peer_id, plan)
        if guarded:
            st, _, _ = _io.recv_discard(fd, data_len, _session.FRAME_TIMEOUT_MS)
            if st != 0:
                raise ProtocolError("push payload truncated")
            return reply(fd, wire.OP_PUSH_DONE, req_id, guarded)
        with engine.pinned(plan, True, *_pin_terms(fd)) as (ranges, current, device_ranges):
            refusal, device = self._refusal(plan, True, generation, ranges, device_ranges, current, peer_id, "push")
            if refusal == 0 and device:
                try:
                    # (staged: the payload must keep arriving while it holds the link's buffers)
                    st, _, _ = self._device.recv(fd, plan, _session.FRAME_TIMEOUT_MS, peer.shares.staging, True)
                except CopyFailed as exc:  # the payload was read whole: the link goes on
                    logger.error("cluster %d: a push from %d into device memory failed: %s",
                                 engine.cluster_id, peer_id, exc)
                    refusal, drained, st = S.LLM_FAILED, True, 0
                if st == S.LLM_TIMEOUT:
                    budgets.staging().note_stall(f"a staged push of {plan.total_bytes} bytes", f"cluster {peer_id}")
                    raise Stalled(f"staged push payload stalled ({budgets.STALL_MS_ENV})")
            elif refusal == 0:
                # Straight into memory, and the reply in the same call.
                st, sent = _io.recv_plan_reply(fd, plan, wire.pack_header(wire.OP_PUSH_DONE, req_id, 0),
                                               _session.FRAME_TIMEOUT_MS)
                if st == 0:
                    return sent == 0
            if refusal == 0 and st != 0:
                raise ProtocolError(f"push payload truncated ({status_of(st).name})")
        if refusal and not drained:
            st, _, _ = _io.recv_discard(fd, data_len, _session.FRAME_TIMEOUT_MS)
            if st != 0:
                raise ProtocolError("push payload truncated")
        return reply(fd, wire.OP_PUSH_DONE, req_id, refusal)

    def pull(self, fd: int, req_id: int, length: int, peer: Link) -> bool:
        engine = self.engine
        peer_id = peer.cluster_id
        if length < 16:
            raise ProtocolError(f"pull: frame length {length}")
        generation, tag_len = wire.U64x2.unpack(recv_exact(fd, 16, 16, "pull"))
        if tag_len > budgets.MAX_PULL_TAG_BYTES or tag_len > length - 16 \
                or (length - 16 - tag_len) % _io.WIRE_DESC_BYTES:
            raise ProtocolError(f"pull: a tag of {tag_len} bytes in a frame of {length}")
        tag = recv_exact(fd, tag_len, budgets.MAX_PULL_TAG_BYTES, "pull tag") if tag_len else b""
        plan = self._wire_plan(recv_exact(fd, length - 16 - tag_len, wire.MAX_DESCRIPTOR_BYTES, "descriptors"))
        refusal = self._read_guard.refusal(peer_id, tag, plan)
        if refusal:
            return reply(fd, wire.OP_PULL_DATA, req_id, refusal)
        with engine.pinned(plan, False, *_pin_terms(fd)) as (ranges, current, device_ranges):
            refusal, device = self._refusal(plan, False, generation, ranges, device_ranges, current, peer_id, "pull")
            if refusal == 0:
                head = wire.pack_header(wire.OP_PULL_DATA, req_id, plan.total_bytes, 0)
                if not device:
                    st, _ = _io.send_plan(fd, head, plan, False, _session.FRAME_TIMEOUT_MS)
                    return st == 0
                try:
                    st, _ = self._device.send(fd, head, plan, _session.FRAME_TIMEOUT_MS, peer.shares.staging)
                    return st == 0
                except CopyFailed as exc:
                    logger.error("cluster %d: a pull by %d from device memory failed: %s", engine.cluster_id,
                                 peer_id, exc)
                    if not exc.in_step:
                        return False  # the reply went out cut short: the link goes
                    refusal = S.LLM_FAILED
        return reply(fd, wire.OP_PULL_DATA, req_id, refusal)

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
        if len(device_ranges) and self._device is not None and device_ranges.first_outside(plan, dst_side) < 0:
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

