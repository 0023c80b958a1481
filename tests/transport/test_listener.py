"""The listener part alone (``transport.listener.Listener``): each accepted connection reaches the
accept callback on a thread of its own, connections beyond the pending-handshake cap are closed
at once and counted, a finished handshake frees its place, and a closed listener accepts nothing.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Dict, List, Tuple

import pytest

from llm_datadist.transport.listener import Listener


class Accepting:
    """An accept callback that holds each connection until told to let it go."""

    def __init__(self) -> None:
        self.got: List[Tuple[socket.socket, str]] = []
        self.arrived = threading.Semaphore(0)
        self.release = threading.Event()

    def __call__(self, conn: socket.socket, name: str) -> None:
        self.got.append((conn, name))
        self.arrived.release()
        self.release.wait(10)


@pytest.fixture
def listening():
    counts: Dict[str, int] = {}

    def count(name: str) -> int:
        counts[name] = counts.get(name, 0) + 1
        return counts[name]

    accepting = Accepting()
    listener = Listener(3, accepting, 1, count)
    listener.start("127.0.0.1", 0)
    try:
        yield listener, accepting, counts
    finally:
        accepting.release.set()
        listener.close()
        listener.drain()


def connect(listener: Listener) -> socket.socket:
    return socket.create_connection(listener.listen_address, timeout=5)


def test_a_connection_reaches_the_callback_and_counts_as_pending_until_its_handshake_ends(listening):
    listener, accepting, counts = listening
    assert listener.listen_address[0] == "127.0.0.1" and listener.unix_name.startswith("llm_datadist.")
    client = connect(listener)
    assert accepting.arrived.acquire(timeout=5)
    conn, name = accepting.got[0]
    assert name == "%s:%d" % client.getsockname()[:2]
    assert conn.gettimeout() == 0.0  # handed over non-blocking
    assert listener.pending() == {conn}
    listener.handshake_done(conn)
    assert listener.pending() == set() and counts == {}
    client.close()


def test_connections_beyond_the_cap_are_closed_at_once_and_counted(listening):
    listener, accepting, counts = listening
    first = connect(listener)
    assert accepting.arrived.acquire(timeout=5)
    second = connect(listener)  # max_pending is 1: the first is still in its handshake
    second.settimeout(5)
    assert second.recv(1) == b""
    assert counts == {"refused_busy": 1} and len(accepting.got) == 1
    accepting.release.set()  # the first handshake ends: its place is free again
    deadline = time.monotonic() + 5
    while listener.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert listener.pending() == set()
    third = connect(listener)
    assert accepting.arrived.acquire(timeout=5) and len(accepting.got) == 2
    for sock in (first, second, third):
        sock.close()


def test_a_closed_listener_accepts_nothing(listening):
    listener, accepting, _ = listening
    address = listener.listen_address
    listener.close()
    assert listener.listen_address is None and listener.unix_name is None
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=1).recv(1)
    assert accepting.got == []


def test_an_extra_listener_lives_as_long_as_its_users(listening):
    listener, accepting, _ = listening
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    listener.open_extra("127.0.0.1", port)
    listener.open_extra("127.0.0.1", port)  # a second user of the same address
    listener.close_extra(("127.0.0.1", port))
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    assert accepting.arrived.acquire(timeout=5)
    listener.close_extra(("127.0.0.1", port))
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).recv(1)
    client.close()
