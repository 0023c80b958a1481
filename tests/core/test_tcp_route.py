"""``_io.TcpRoute``: the tcp plane's latency path must send exactly the frame the checked path
(``planes/tcp.py``'s ``push`` / ``pull`` over ``_core.plan_blocks``) sends, must decline without
sending a byte every call it cannot take (a broken connection, a closed link, a replaced table,
bad block ids, too many bytes), and once its frame is out must fail as the tcp plane fails: a
refusal (stale table, unregistered range) declines and leaves the connection in step, anything
out of step (a peer gone mid-call, no answer in time, a wrong reply) breaks the connection,
raises the plane's ``LLMException`` and tells ``on_broken``.

The peer is the other end of a socketpair, scripted per test on a thread: it reads one frame
whole and answers what the test says.
"""

from __future__ import annotations

import socket
import threading
from typing import Callable, List, Optional

import numpy as np
import pytest

from llm_datadist import LLMException, LLMStatusCode, _core, _io
from llm_datadist.transport import wire
from llm_datadist.transport.errors import StaleTable
from llm_datadist.transport.planes import tcp
from llm_datadist.transport.read_guard import tagged
from llm_datadist.transport.session import Channel

S = LLMStatusCode
TENSORS, BLOCKS, BLOCK = 4, 16, 64
GENERATION = 7


class Table:
    generation = GENERATION


class Owner:
    """The link as the route sees it."""

    def __init__(self, channel: Channel) -> None:
        self.closed = False
        self.table = Table()
        self.channel = channel

    def broken(self) -> Optional[str]:
        return self.channel.broken


def read_frame(sock: socket.socket) -> bytes:
    """One whole request frame (header and body) from the peer's end."""
    head = _exactly(sock, wire.HEADER_BYTES)
    _, _, _, length = wire.unpack_header(head)
    return head + _exactly(sock, length)


def _exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


class Rig:
    """Caches, a channel over a socketpair, and the peer's scripted end."""

    def __init__(self) -> None:
        rng = np.random.default_rng(5)
        self.local = rng.integers(0, 255, (TENSORS, BLOCKS, BLOCK), dtype=np.uint8)
        self.remote = np.zeros((TENSORS, BLOCKS, BLOCK), dtype=np.uint8)  # never touched here: addresses only
        mine, theirs = socket.socketpair()
        self.peer = theirs
        self.peer.settimeout(10)
        self.channel = Channel(mine, "peer 9")
        self.owner = Owner(self.channel)
        self.broken: List[str] = []
        self.frames: List[bytes] = []
        self.thread: Optional[threading.Thread] = None

    def layout(self, cache: np.ndarray) -> _core.CacheLayout:
        return _core.CacheLayout([cache[t].ctypes.data for t in range(TENSORS)], BLOCKS, BLOCK)

    def route(self, write: bool, timeout_ms: int = 5000, stripe_bytes: int = 2**64 - 1) -> _io.TcpRoute:
        request, reply = (wire.OP_PUSH, wire.OP_PUSH_DONE) if write else (wire.OP_PULL, wire.OP_PULL_DATA)
        route = _io.TcpRoute(self.owner, self.owner.table, self.channel, wire.pack_header(request, 0, 0),
                             wire.pack_header(reply, 0, 0), self.layout(self.local), self.layout(self.remote), write,
                             timeout_ms, stripe_bytes, self.broken.append, tcp.current_tag)
        route.learn((None, None, 2), None, None)
        return route

    def answer(self, respond: Callable[[bytes], Optional[bytes]]) -> None:
        """On the peer's thread: read one frame, send ``respond(frame)`` (None: close instead)."""

        def serve() -> None:
            try:
                frame = read_frame(self.peer)
            except (ConnectionError, OSError):
                return
            self.frames.append(frame)
            out = respond(frame)
            if out is None:
                self.peer.close()
            elif out:
                self.peer.sendall(out)

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join(10)
            assert not self.thread.is_alive()

    def nothing_sent(self) -> bool:
        self.peer.setblocking(False)
        try:
            return self.peer.recv(1) == b""
        except BlockingIOError:
            return True
        finally:
            self.peer.settimeout(10)

    def close(self) -> None:
        self.channel.close()
        self.peer.close()


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def req_id_of(frame: bytes) -> int:
    return wire.unpack_header(frame[:wire.HEADER_BYTES])[2]


def done(frame: bytes, status: int = 0, length: int = 0) -> bytes:
    op = wire.OP_PUSH_DONE if wire.unpack_header(frame[:wire.HEADER_BYTES])[0] == wire.OP_PUSH else wire.OP_PULL_DATA
    return wire.pack_header(op, req_id_of(frame), length, status)


def checked_frame(rig: Rig, write: bool, src, dst, req_id: int, tag: bytes = b"") -> bytes:
    """The frame ``planes/tcp.py`` sends for the same call (captured from its own socketpair)."""
    a, b = socket.socketpair()
    channel = Channel(a, "peer 9")
    channel._next_id = req_id
    local, remote = rig.layout(rig.local), rig.layout(rig.remote)
    plan = _core.plan_blocks(local, remote, None, None, src, dst) if write else \
        _core.plan_blocks(remote, local, None, None, src, dst)
    out: List[bytes] = []
    peer = threading.Thread(target=lambda: (out.append(read_frame(b)), b.sendall(
        wire.pack_header(wire.OP_PUSH_DONE if write else wire.OP_PULL_DATA, req_id, 0, 1))))
    peer.start()
    try:
        with pytest.raises(StaleTable):  # answered "stale": the frame is all this wants
            (tcp.push(channel, plan, GENERATION, 5000) if write else
             tcp.pull(channel, plan, GENERATION, 5000, tag=tag))
    finally:
        peer.join(10)
        channel.close()
        b.close()
    return out[0]


@pytest.mark.parametrize("src, dst", [([0], [1]), ([3, 4, 5], [7, 8, 9]), ([15, 0, 2], [0, 15, 3])])
def test_a_push_sends_the_checked_paths_frame_byte_for_byte(rig, src, dst):
    route = rig.route(True)
    rig.answer(done)
    assert route.run(src, dst, None, None, 2) is True
    rig.join()
    assert rig.frames[0] == checked_frame(rig, True, src, dst, req_id_of(rig.frames[0]))
    assert rig.channel.broken is None and route.current and rig.broken == []


def test_a_pull_sends_the_checked_paths_frame_and_lands_the_payload_in_the_local_blocks(rig):
    route = rig.route(False)
    before = rig.local.copy()
    payload = np.arange(TENSORS * 2 * BLOCK, dtype=np.uint16).astype(np.uint8).tobytes()
    rig.answer(lambda frame: done(frame, 0, len(payload)) + payload)
    with tagged(b"lease-1"):
        assert route.run([3, 4], [10, 2], None, None, 2) is True
    rig.join()
    assert rig.frames[0] == checked_frame(rig, False, [3, 4], [10, 2], req_id_of(rig.frames[0]), b"lease-1")
    want = before.copy()
    chunks = np.frombuffer(payload, dtype=np.uint8).reshape(TENSORS, 2, BLOCK)
    for t in range(TENSORS):
        want[t, 10], want[t, 2] = chunks[t, 0], chunks[t, 1]
    np.testing.assert_array_equal(rig.local, want)  # and every other byte (the guards) as it was


def test_request_ids_are_the_channels(rig):
    route = rig.route(True)
    for expected in (1, 2):
        rig.answer(done)
        assert route.run([0], [0], None, None, 2)
        rig.join()
        assert req_id_of(rig.frames[-1]) == expected
    assert rig.channel.next_request_id() == 3


@pytest.mark.parametrize("status", [wire.STATUS_STALE_TABLE, int(S.LLM_KV_CACHE_NOT_EXIST)])
def test_a_refusal_declines_and_leaves_the_connection_in_step(rig, status):
    route = rig.route(True)
    rig.answer(lambda frame: done(frame, status))
    assert route.run([0], [1], None, None, 2) is False
    rig.join()
    assert not route.current and rig.channel.broken is None and rig.broken == []
    assert route.run([0], [1], None, None, 2) is False  # a refused route stays declined
    assert rig.nothing_sent()
    rig.answer(done)  # the connection still carries the checked path's next request
    plan = _core.plan_blocks(rig.layout(rig.local), rig.layout(rig.remote), None, None, [0], [1])
    tcp.push(rig.channel, plan, GENERATION, 5000)
    rig.join()


def test_a_pull_refusal_declines(rig):
    route = rig.route(False)
    rig.answer(lambda frame: done(frame, int(S.LLM_KV_CACHE_NOT_EXIST)))
    before = rig.local.copy()
    assert route.run([0], [1], None, None, 2) is False
    rig.join()
    np.testing.assert_array_equal(rig.local, before)
    assert rig.channel.broken is None


def _faults(rig: Rig, route: _io.TcpRoute, code: int, words: str) -> None:
    with pytest.raises(LLMException) as info:
        route.run([0], [1], None, None, 2)
    rig.join()
    assert info.value.status_code == code, info.value
    assert words in str(info.value)
    assert rig.channel.broken is not None and rig.broken == [rig.channel.broken]
    assert not route.current
    assert route.run([0], [1], None, None, 2) is False  # broken: declined from now on


@pytest.mark.parametrize("write", [True, False])
def test_a_peer_gone_mid_call_breaks_the_link(rig, write):
    route = rig.route(write)
    rig.answer(lambda frame: None)
    _faults(rig, route, S.LLM_LINK_FAILED, "failed")


@pytest.mark.parametrize("write", [True, False])
def test_no_answer_in_time_is_a_timeout_and_breaks_the_link(rig, write):
    route = rig.route(write, timeout_ms=200)
    rig.answer(lambda frame: b"")
    _faults(rig, route, S.LLM_TIMEOUT, "no answer")


@pytest.mark.parametrize("reply, words", [
    (lambda f: wire.pack_header(wire.OP_PULL_DATA, req_id_of(f), 0), "unexpected reply"),
    (lambda f: wire.pack_header(wire.OP_PUSH_DONE, req_id_of(f) + 1, 0), "unexpected reply"),
    (lambda f: b"XXDD" + wire.pack_header(wire.OP_PUSH_DONE, req_id_of(f), 0)[4:], "bad magic"),
    (lambda f: wire.pack_header(wire.OP_PUSH_DONE, req_id_of(f), 0, version=wire.PROTOCOL_VERSION + 1),
     "protocol version"),
    (lambda f: wire.pack_header(wire.OP_PUSH_DONE, req_id_of(f), 8) + b"x" * 8, "reply with a payload"),
    (lambda f: wire.pack_header(wire.OP_PUSH_DONE, req_id_of(f), 0)[:20], "failed"),  # cut short, then closed
])
def test_a_wrong_push_reply_breaks_the_link(rig, reply, words):
    route = rig.route(True)
    rig.answer(lambda frame: (rig.peer.sendall(reply(frame)), None)[1])
    _faults(rig, route, S.LLM_LINK_FAILED, words)


@pytest.mark.parametrize("reply, words", [
    (lambda f: done(f, 0, TENSORS * BLOCK - 1), "bytes announced"),
    (lambda f: done(f, int(S.LLM_KV_CACHE_NOT_EXIST), 4), "refusal with a payload"),
    (lambda f: done(f, 0, TENSORS * BLOCK) + b"y" * 10, "failed"),  # payload cut short, then closed
])
def test_a_wrong_pull_reply_breaks_the_link(rig, reply, words):
    route = rig.route(False)
    before = rig.local.copy()
    rig.answer(lambda frame: (rig.peer.sendall(reply(frame)), None)[1])
    _faults(rig, route, S.LLM_LINK_FAILED, words)
    if words != "failed":
        np.testing.assert_array_equal(rig.local, before)


def test_what_it_cannot_take_is_declined_before_a_byte_is_sent(rig):
    route = rig.route(True, stripe_bytes=3 * TENSORS * BLOCK)
    for src, dst in [([BLOCKS], [0]), ([0], [-1]), ([True], [0]), ([0.0], [0]), ([0, 1], [0]), ([], []),
                     (np.array([0]), [0])]:
        assert route.run(src, dst, None, None, 2) is False, (src, dst)
    assert route.run([0], [0], range(0, 1), range(0, 1), 2) is False   # not learnt
    assert route.run([0, 1, 2], [0, 1, 2], None, None, 2) is False   # striped by the checked path
    many = list(range(BLOCKS)) * (_io.ROUTE_MAX_DESCRIPTORS // (TENSORS * BLOCKS) + 1)
    assert route.run(many, many, None, None, 2) is False
    rig.owner.closed = True
    assert route.run([0], [0], None, None, 2) is False
    rig.owner.closed = False
    rig.owner.table = Table()  # refreshed: the route's table is gone
    assert not route.current and route.run([0], [0], None, None, 2) is False
    route = rig.route(True)
    route.close()
    assert route.run([0], [0], None, None, 2) is False
    route = rig.route(True)
    rig.channel.broken = "an earlier fault"
    assert route.run([0], [0], None, None, 2) is False
    assert rig.nothing_sent()
    assert rig.channel._next_id == 1  # no request id taken


def test_a_pull_tag_that_is_not_bytes_is_declined(rig):
    route = _io.TcpRoute(rig.owner, rig.owner.table, rig.channel, wire.pack_header(wire.OP_PULL, 0, 0),
                         wire.pack_header(wire.OP_PULL_DATA, 0, 0), rig.layout(rig.local), rig.layout(rig.remote),
                         False, 5000, 2**64 - 1, None, lambda: "text")
    route.learn((None, None, 2), None, None)
    assert route.run([0], [0], None, None, 2) is False
    assert rig.nothing_sent()


def test_construction_checks(rig):
    local, remote = rig.layout(rig.local), rig.layout(rig.remote)
    head = wire.pack_header(wire.OP_PUSH, 0, 0)
    with pytest.raises(ValueError):
        _io.TcpRoute(rig.owner, rig.owner.table, rig.channel, head[:20], head, local, remote, True, 1, 1)
    with pytest.raises(ValueError):  # a pull needs its tag
        _io.TcpRoute(rig.owner, rig.owner.table, rig.channel, head, head, local, remote, False, 1, 1)
    small = _core.CacheLayout([rig.remote[t].ctypes.data for t in range(TENSORS)], BLOCKS, BLOCK // 2)
    with pytest.raises(ValueError):
        _io.TcpRoute(rig.owner, rig.owner.table, rig.channel, head, head, local, small, True, 1, 1)


# -- the serving side of a push: _io.read_push and recv_plan_reply ----------------------------------

def _body(generation: int, descs: List[tuple], payload: bytes = b"") -> bytes:
    raw = b"".join(wire.U64x2.pack(s, d) + wire.U64.pack(n) for s, d, n in descs)
    return wire.U64x2.pack(generation, len(raw)) + raw + payload


@pytest.mark.parametrize("body, length, want", [
    (_body(3, [(1, 2, 4)], b"abcd"), None, (_io.PUSH_OK, 3, 24)),
    (_body(3, [], b""), None, (_io.PUSH_OK, 3, 0)),
    (wire.U64x2.pack(3, 25) + bytes(25), None, (_io.PUSH_BAD_LENGTH, 0, 3, 25)),        # not whole descriptors
    (wire.U64x2.pack(3, 48) + bytes(24), None, (_io.PUSH_BAD_LENGTH, 0, 3, 48)),        # more than the frame
    (_body(3, [(1, 2 ** 64 - 2, 4)], b"abcd"), None, (_io.PUSH_WRAPS, 0, 3, 24)),
    (_body(3, [(1, 2, 4), (5, 6, 2 ** 64 - 1)], b""), None, (_io.PUSH_WRAPS, 1, 3, 48)),
    (_body(3, [(1, 2, 4)], b"abc"), None, (_io.PUSH_SIZE_MISMATCH, 4, 3, 24)),
    (_body(3, [(1, 2, 4)], b"abcd")[:10], 16 + 24 + 4, (_io.PUSH_TRUNCATED, int(S.LLM_LINK_FAILED), 0, 0)),
    (_body(3, [(1, 2, 4)], b"abcd")[:30], 16 + 24 + 4, (_io.PUSH_DESCS_TRUNCATED, int(S.LLM_LINK_FAILED), 3, 24)),
])
def test_read_push_checks_a_frame_as_the_server_did(body, length, want):
    a, b = socket.socketpair()
    with a, b:
        b.sendall(body)
        b.shutdown(socket.SHUT_WR)
        a.setblocking(False)
        got = _io.read_push(a.fileno(), len(body) if length is None else length, 2000, 48)
        if want[0] == _io.PUSH_OK:
            assert got[:3] == want and got[3].total_bytes == len(body) - 16 - want[2]
            assert _io.plan_to_wire(got[3]) == body[16:16 + want[2]]
            assert a.recv(100) == body[16 + want[2]:]  # the payload is left for the payload's receive
        else:
            assert got == want


def test_read_push_refuses_more_descriptors_than_its_limit_before_reading_them():
    a, b = socket.socketpair()
    with a, b:
        body = _body(3, [(1, 2, 1)] * 3, b"xyz")
        b.sendall(body)
        a.setblocking(False)
        assert _io.read_push(a.fileno(), len(body), 2000, 48) == (_io.PUSH_TOO_MANY, 0, 3, 72)
        assert a.recv(1000) == body[16:]


def test_recv_plan_reply_lands_the_payload_then_replies():
    dst = np.full(64, 0xA5, dtype=np.uint8)
    a, b = socket.socketpair()
    with a, b:
        plan = _io.plan_from_wire(wire.U64x2.pack(0, dst.ctypes.data + 8) + wire.U64.pack(4)
                                  + wire.U64x2.pack(0, dst.ctypes.data + 20) + wire.U64.pack(2))
        b.sendall(b"abcdef")
        a.setblocking(False)
        assert _io.recv_plan_reply(a.fileno(), plan, b"done", 2000) == (0, 0)
        assert b.recv(10) == b"done"
        want = np.full(64, 0xA5, dtype=np.uint8)
        want[8:12] = list(b"abcd")
        want[20:22] = list(b"ef")
        np.testing.assert_array_equal(dst, want)
        b.sendall(b"ab")
        b.shutdown(socket.SHUT_WR)  # cut short: no reply
        assert _io.recv_plan_reply(a.fileno(), plan, b"done", 2000)[0] == int(S.LLM_LINK_FAILED)
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(10)
