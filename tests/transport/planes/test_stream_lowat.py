"""The TCP stream loop's receive low-watermark: a waiting receiver asks the kernel to gather up to
``set_recv_lowat`` bytes before waking it. The tail of a stream shorter than that must still
arrive, a closing peer must still be seen, and the socket must be left at the default (1) so the
next small read is never held back."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from llm_datadist import _core, _io

MIB = 1 << 20


@pytest.fixture
def tcp_pair():
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname(), timeout=5)
    server, _ = listener.accept()
    listener.close()
    for sock in (client, server):
        sock.setblocking(False)
    saved = _io.get_recv_lowat()
    _io.set_recv_lowat(MIB)
    yield client, server
    _io.set_recv_lowat(saved)
    client.close()
    server.close()


def plan_for(buffer: np.ndarray, pieces: int) -> _core.CopyPlan:
    """A plan whose destination side is ``buffer`` cut into ``pieces`` equal runs."""
    layout = _core.CacheLayout([buffer.ctypes.data], pieces, buffer.nbytes // pieces)
    ids = list(range(pieces))[::-1]
    return _core.plan_blocks(layout, layout, None, None, ids, ids)


def trickle(sock: socket.socket, data: bytes, chunk: int, pause: float, close: bool = False):
    sock.setblocking(True)
    for start in range(0, len(data), chunk):
        sock.sendall(data[start:start + chunk])
        time.sleep(pause)
    if close:
        sock.shutdown(socket.SHUT_WR)


def lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


def test_stream_with_a_tail_shorter_than_the_watermark_arrives_whole(tcp_pair):
    client, server = tcp_pair
    dst = np.zeros(3 * MIB + 4096, np.uint8)
    payload = np.random.default_rng(1).integers(0, 256, dst.nbytes, dtype=np.uint8)
    plan = plan_for(dst, 4)
    # the sender writes the runs in plan order: reversed quarters of dst
    quarter = dst.nbytes // 4
    stream = b"".join(payload[i * quarter:(i + 1) * quarter].tobytes() for i in range(3, -1, -1))
    sender = threading.Thread(target=trickle, args=(client, stream, 300 * 1024, 0.01))
    sender.start()
    status, err, received = _io.recv_plan(server.fileno(), plan, False, 5000)
    sender.join(5)
    assert (status, err, received) == (_io.SUCCESS, 0, dst.nbytes)
    assert np.array_equal(dst, payload)
    assert lowat(server) == 1


def test_a_small_rest_after_a_raised_watermark_is_not_held_back(tcp_pair):
    """The receiver raises the watermark for a large rest, reads all that came, and is left
    waiting for a rest below the floor: it must lower the watermark, not wait for the deadline."""
    client, server = tcp_pair
    dst = np.zeros(MIB + 200 * 1024 + 10 * 1024, np.uint8)
    stream = np.random.default_rng(2).integers(0, 256, dst.nbytes, dtype=np.uint8)

    def send():
        client.setblocking(True)
        time.sleep(0.1)  # the receiver is waiting with the watermark raised
        client.sendall(stream[:-10 * 1024].tobytes())
        time.sleep(0.3)  # the receiver has read all that came and waits for the last 10 KiB
        client.sendall(stream[-10 * 1024:].tobytes())

    sender = threading.Thread(target=send)
    sender.start()
    started = time.monotonic()
    layout = _core.CacheLayout([dst.ctypes.data], 1, dst.nbytes)
    status, _, received = _io.recv_plan(server.fileno(), _core.plan_blocks(layout, layout, None, None, [0], [0]),
                                            False, 5000)
    sender.join(5)
    assert (status, received) == (_io.SUCCESS, dst.nbytes)
    assert time.monotonic() - started < 3  # not held to the 5 s deadline
    assert np.array_equal(dst, stream)
    assert lowat(server) == 1


def test_small_read_after_a_large_one_is_not_held_back(tcp_pair):
    client, server = tcp_pair
    big = np.zeros(2 * MIB, np.uint8)
    sender = threading.Thread(target=trickle, args=(client, b"\x07" * big.nbytes, 256 * 1024, 0.005))
    sender.start()
    assert _io.recv_plan(server.fileno(), plan_for(big, 2), False, 5000)[0] == _io.SUCCESS
    sender.join(5)
    assert (big == 7).all()
    later = threading.Timer(0.2, lambda: client.sendall(b"h" * 28))
    later.start()
    head = bytearray(28)
    started = time.monotonic()
    status, _, got = _io.recv_into(server.fileno(), head, 3000)
    later.join()
    assert (status, got, bytes(head)) == (_io.SUCCESS, 28, b"h" * 28)
    assert time.monotonic() - started < 2.5  # woke for the 28 bytes, not at the deadline


def test_peer_closing_mid_stream_is_seen_while_waiting_for_the_watermark(tcp_pair):
    client, server = tcp_pair
    dst = np.zeros(4 * MIB, np.uint8)
    sender = threading.Thread(target=trickle, args=(client, b"\x01" * (MIB + 5000), 200 * 1024, 0.01, True))
    sender.start()
    started = time.monotonic()
    status, _, received = _io.recv_plan(server.fileno(), plan_for(dst, 4), False, 10000)
    sender.join(5)
    assert status == _io.LINK_FAILED and received == MIB + 5000
    assert time.monotonic() - started < 5
    assert lowat(server) == 1


def test_timeout_while_waiting_restores_the_watermark(tcp_pair):
    client, server = tcp_pair
    dst = np.zeros(2 * MIB, np.uint8)
    client.setblocking(True)
    client.sendall(b"\x02" * 100_000)
    status, _, received = _io.recv_plan(server.fileno(), plan_for(dst, 2), False, 300)
    assert status == _io.TIMEOUT and received == 100_000
    assert lowat(server) == 1


def test_negative_watermark_is_refused():
    with pytest.raises(ValueError):
        _io.set_recv_lowat(-1)
