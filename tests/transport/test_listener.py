"""The listener part alone (``transport.listener.Listener``): each accepted connection reaches the
accept callback on a thread of its own, a newcomer beyond the pending-handshake cap takes the slot
of a connection that has not authenticated within the grace (or waits for one, or is refused), an
authenticated connection leaves that pool for its own, a finished handshake frees its place, and a
closed listener accepts nothing.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Dict, List, Optional, Tuple

import pytest

from llm_datadist.transport import slots as slots_module
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


def test_a_newcomer_takes_the_slot_of_a_connection_unauthenticated_past_the_grace(listening):
    """max_pending is 1: a second connection is held until the first has had the grace (250 ms)
    without authenticating; then the first is shut down (its peer sees it closed, without a
    byte) and the second takes its slot."""
    listener, accepting, counts = listening
    first = connect(listener)
    assert accepting.arrived.acquire(timeout=5)
    started = time.monotonic()
    second = connect(listener)
    assert accepting.arrived.acquire(timeout=5)
    held = time.monotonic() - started
    first.settimeout(5)
    assert first.recv(1) == b""
    assert 0.2 <= held < 2, held
    assert counts == {"preauth_evicted": 1, "preauth_waited": 1}
    assert listener.pending() == {accepting.got[1][0]}
    for sock in (first, second):
        sock.close()


def test_an_authenticated_connection_leaves_the_pool_for_a_pool_of_its_own(listening):
    """Once authenticated, a connection no longer holds an unauthenticated slot: a newcomer is
    admitted at once and never takes the authenticated one's place; the authenticated pool has
    its own cap (max_pending, here 1)."""
    listener, accepting, counts = listening
    first = connect(listener)
    assert accepting.arrived.acquire(timeout=5)
    proved = accepting.got[0][0]
    assert listener.authenticated(proved)
    second = connect(listener)
    assert accepting.arrived.acquire(timeout=1) and counts == {}
    assert not listener.authenticated(accepting.got[1][0])  # the authenticated pool is full
    assert counts == {"refused_busy": 1} and listener.pending() == {proved}
    time.sleep(0.3)  # past the grace: still not given up, even to a newcomer
    third = connect(listener)
    assert accepting.arrived.acquire(timeout=1)
    first.settimeout(0.2)
    with pytest.raises(socket.timeout):
        first.recv(1)
    assert listener.pending() == {proved, accepting.got[2][0]}
    for sock in (first, second, third):
        sock.close()


class Clock:
    """A ``time`` for the listener module whose ``monotonic()`` the test sets."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_which_slot_is_given_up_and_when_a_newcomer_is_refused(monkeypatch):
    """The policy of ``admit`` (not waiting), on socket pairs from named sources and a clock the
    test sets: nothing is given up before the grace (the newcomer is refused); then the oldest
    of the newcomer's own source when that one is at its cap, else of the sources holding at least
    as many as the newcomer's, the one holding the most first; nothing while a slot is free."""
    clock = Clock()
    monkeypatch.setattr(slots_module, "time", clock)
    counts: Dict[str, int] = {}

    def count(name: str) -> int:
        counts[name] = counts.get(name, 0) + 1
        return counts[name]

    listener = Listener(3, lambda conn, name: None, 4, count, max_pending_per_source=3, grace_ms=100)
    pairs = [socket.socketpair() for _ in range(10)]
    ours = [pair[0] for pair in pairs]
    a, b, c = ("ip", "a"), ("ip", "b"), ("ip", "c")

    def admit_at(ms: float, i: int, source) -> Optional[str]:
        clock.now = 1000.0 + ms / 1000
        return listener.admit(ours[i], source)

    def given_up() -> List[int]:
        gone = []
        for i, (_, theirs) in enumerate(pairs):
            theirs.settimeout(0)
            try:
                if theirs.recv(1) == b"":
                    gone.append(i)
            except BlockingIOError:
                pass
        return gone

    try:
        for i, (ms, source) in enumerate([(0, a), (10, a), (20, a), (30, b)]):
            assert admit_at(ms, i, source) is None
        assert admit_at(99, 4, c) == "refused_busy"  # full, and none has had the grace
        assert admit_at(99, 4, a) == "refused_source"  # a is at its cap
        assert admit_at(105, 4, c) is None and given_up() == [0]  # the one past the grace
        # a holds 2, b and c 1: a newcomer of a takes a's oldest (the others hold fewer) ...
        assert admit_at(200, 5, a) is None and given_up() == [0, 1]
        # ... one of c takes a's (holding the most) before b's, though b's is past the grace too
        assert admit_at(200, 6, c) is None and given_up() == [0, 1, 2]
        # ... one of b takes its own, c's being short of the grace
        assert admit_at(200, 7, b) is None and given_up() == [0, 1, 2, 3]
        assert admit_at(200, 8, a) == "refused_busy"  # all four short of the grace
        assert admit_at(250, 8, a) is None and given_up() == [0, 1, 2, 3, 4]  # c's oldest (c holds 2)
        assert (listener.pending_from(a), listener.pending_from(b), listener.pending_from(c)) == (2, 1, 1)
        listener.handshake_done(ours[7])
        assert admit_at(250, 9, b) is None and given_up() == [0, 1, 2, 3, 4]  # a slot was free
        assert listener.pending() == {ours[5], ours[6], ours[8], ours[9]}
        assert counts == {"preauth_evicted": 5}
    finally:
        listener.close()
        listener.drain()
        for pair in pairs:
            for sock in pair:
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


def test_an_accepted_tcp_connection_notices_a_vanished_peer_within_a_minute(listening):
    """docs/security.md: TCP connections use keepalive, so a peer whose host vanished (no FIN,
    no RST) is dropped within about a minute: idle + interval x probes <= 60 s."""
    listener, accepting, _ = listening
    client = connect(listener)
    try:
        assert accepting.arrived.acquire(timeout=5)
        conn, _ = accepting.got[0]
        assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        idle, interval, probes = (conn.getsockopt(socket.IPPROTO_TCP, getattr(socket, name))
                                  for name in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"))
        assert idle + interval * probes <= 60, (idle, interval, probes)
    finally:
        client.close()
