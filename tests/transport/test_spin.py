"""The receive spin of link sockets (``_io.set_spin_us``, ``LLM_DATADIST_SPIN_US``): its bounds,
its setting from the environment, and that a spinning receive still takes data that comes late,
honours a deadline shorter than the spin, and reports a closed peer."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from llm_datadist import _io


@pytest.fixture
def spin():
    before = _io.get_spin_us()
    yield _io.set_spin_us
    _io.set_spin_us(before)


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("us", [-1, 10_001, 1 << 30])
def test_a_spin_out_of_range_is_refused(spin, us):
    before = _io.get_spin_us()
    with pytest.raises(ValueError, match="0 to 10000 microseconds"):
        spin(us)
    assert _io.get_spin_us() == before


@pytest.mark.parametrize("us", [0, 1, 50, 10_000])
def test_a_spin_in_range_is_kept(spin, us):
    spin(us)
    assert _io.get_spin_us() == us


@pytest.mark.parametrize("us", [0, 200, 10_000])
def test_data_that_comes_during_or_after_the_spin_is_received(spin, pair, us):
    """Data sent 1 ms (inside a 10 ms spin, after a 0.2 ms one) and 50 ms later arrives whole."""
    spin(us)
    a, b = pair
    for delay in (0.001, 0.05):
        sender = threading.Timer(delay, lambda: b.sendall(b"x" * 4096))
        sender.start()
        buf = bytearray(4096)
        status, err, got = _io.recv_into(a.fileno(), buf, 5000)
        sender.join()
        assert (status, err, got) == (_io.SUCCESS, 0, 4096) and buf == b"x" * 4096


def test_a_deadline_shorter_than_the_spin_times_out_on_time(spin, pair):
    spin(10_000)
    a, _ = pair
    started = time.monotonic()
    status, _, got = _io.recv_into(a.fileno(), bytearray(8), 2)
    assert status == _io.TIMEOUT and got == 0
    assert time.monotonic() - started < 0.5


def test_a_peer_that_closes_during_the_spin_fails_the_receive(spin, pair):
    spin(10_000)
    a, b = pair
    threading.Timer(0.002, b.close).start()
    status, _, _ = _io.recv_into(a.fileno(), bytearray(8), 5000)
    assert status == _io.LINK_FAILED


@pytest.mark.parametrize("value, expected", [("", 50), ("0", 0), ("120", 120), ("10000", 10000),
                                             ("-5", 50), ("10001", 50), ("lots", 50)])
def test_the_environment_sets_the_spin_of_a_process(value, expected):
    """``LLM_DATADIST_SPIN_US`` as a process sees it at import; an unusable value keeps the default
    (and is warned about)."""
    env = dict(os.environ, LLM_DATADIST_SPIN_US=value)
    out = subprocess.run([sys.executable, "-c", "import llm_datadist.transport.links; from llm_datadist import _io; "
                          "print(_io.get_spin_us())"], env=env, capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) == expected
    assert ("LLM_DATADIST_SPIN_US" in out.stderr) == (value not in ("", "0", "120", "10000"))


def test_spinning_stops_where_it_does_not_pay_and_resumes_where_it_does(spin, pair):
    """Waits whose data comes long after the spin (misses) turn spinning off: later waits block at
    once (skipped) but for an occasional probe; data that comes within the spin turns it back on."""
    a, b = pair
    spin(200)
    buf = bytearray(1)

    def wait_for_byte(delay: float) -> None:
        sender = threading.Timer(delay, lambda: b.send(b"x"))
        sender.start()
        assert _io.recv_into(a.fileno(), buf, 5000)[0] == _io.SUCCESS
        sender.join()

    for _ in range(8):  # data 20 ms later: every spin ends empty
        wait_for_byte(0.02)
    hits, misses, skipped = _io.spin_stats()
    for _ in range(8):
        wait_for_byte(0.02)
    hits2, misses2, skipped2 = _io.spin_stats()
    assert skipped2 - skipped >= 6 and misses2 - misses <= 2, (hits2 - hits, misses2 - misses, skipped2 - skipped)
    spin(10_000)  # data 1 ms later, inside a 10 ms spin: a probe catches it, and spinning is back
    for _ in range(200):
        wait_for_byte(0.001)
        if _io.spin_stats()[0] > hits2:
            break
    resumed = _io.spin_stats()
    wait_for_byte(0.001)
    # The next wait spins again (a hit, or a miss where a loaded machine ran the sender late), it is
    # not skipped.
    hits3, misses3, skipped3 = _io.spin_stats()
    after = (hits3, misses3, skipped3)
    assert (hits3 + misses3, skipped3) == (resumed[0] + resumed[1] + 1, resumed[2]), (resumed, after)


def _spinning_again(a, b, buf, kind=_io.SPIN_REPLY) -> None:
    """Drive the spin of waits of ``kind`` back on: waits for data 1 ms away inside a 10 ms spin
    until one catches it."""
    _io.set_spin_us(10_000)
    for _ in range(400):
        threading.Timer(0.001, lambda: b.send(b"x")).start()
        hits = _io.spin_stats()[0]
        assert _io.recv_into(a.fileno(), buf, 5000, kind)[0] == _io.SUCCESS
        if _io.spin_stats()[0] > hits:
            return
    pytest.skip("no spin caught data 1 ms away in 400 tries (an overloaded machine)")


def test_an_idle_peer_turns_off_the_spins_of_waits_for_requests_not_of_waits_for_replies(spin, pair):
    """A serving connection's wait for the peer's next request (SPIN_REQUEST) ends empty for as
    long as the peer is idle: such misses turn the spins of request waits off (an idle link burns
    no core) but say nothing of how fast the host answers, so a wait for a reply (SPIN_REPLY)
    right after them still spins."""
    a, b = pair
    buf = bytearray(1)
    _spinning_again(a, b, buf)
    _spinning_again(a, b, buf, _io.SPIN_REQUEST)  # (earlier tests of this process may have turned it off)
    spin(200)
    before = _io.spin_stats()
    for _ in range(8):  # the next request comes 20 ms later: a spin ends empty
        sender = threading.Timer(0.02, lambda: b.send(b"x"))
        sender.start()
        assert _io.recv_into(a.fileno(), buf, 5000, _io.SPIN_REQUEST)[0] == _io.SUCCESS
        sender.join()
    after = _io.spin_stats()
    spun, skipped = after[0] + after[1] - before[0] - before[1], after[2] - before[2]
    assert after[1] > before[1] and skipped >= 5 and spun + skipped == 8, (before, after)  # off after a few
    spin(10_000)
    sender = threading.Timer(0.001, lambda: b.send(b"x"))
    sender.start()
    assert _io.recv_into(a.fileno(), buf, 5000)[0] == _io.SUCCESS
    sender.join()
    last = _io.spin_stats()
    assert last[2] == after[2] and last[0] + last[1] == after[0] + after[1] + 1, (after, last)  # it spun


def test_a_wait_that_must_not_spin_neither_spins_nor_counts(spin, pair):
    """SPIN_OFF (the handshake's waits) blocks at once: no spin, and no hit, miss or skip."""
    a, b = pair
    spin(10_000)
    before = _io.spin_stats()
    threading.Timer(0.02, lambda: b.send(b"x")).start()
    started = time.monotonic()
    assert _io.recv_into(a.fileno(), bytearray(1), 5000, _io.SPIN_OFF)[0] == _io.SUCCESS
    assert _io.spin_stats() == before
    cpu_before = time.process_time()
    threading.Timer(0.02, lambda: b.send(b"x")).start()
    assert _io.recv_into(a.fileno(), bytearray(1), 5000, _io.SPIN_OFF)[0] == _io.SUCCESS
    assert time.process_time() - cpu_before < 0.01 and time.monotonic() - started < 5  # slept, did not spin


@pytest.mark.parametrize("kind", [-1, 3])
def test_an_unknown_spin_kind_is_refused(pair, kind):
    with pytest.raises(ValueError, match="SPIN_OFF, SPIN_REPLY or SPIN_REQUEST"):
        _io.recv_into(pair[0].fileno(), bytearray(1), 10, kind)


def _spin_stats(state):
    return _io.spin_stats()


def _register_and_push(state, owner: bool, push_to=None):
    import numpy as np

    import llm_datadist as ld
    if push_to is None:
        arr = np.zeros((2, 4096), np.uint8)
        state.arrays["cache"] = arr
        desc = ld.CacheDesc(1, [2, 4096], ld.DataType.DT_UINT8, ld.Placement.HOST)
        key = ld.BlocksCacheKey(state.cluster_id, 9) if owner else None
        state.caches["cache"] = state.cm.register_blocks_cache(desc, [arr.ctypes.data], key)
        return None
    state.cm.push_blocks(ld.BlocksCacheKey(push_to, 9), state.caches["cache"], [0], [1])
    return _io.spin_stats()


def test_a_new_link_leaves_spinning_on_for_its_first_transfers(tmp_path):
    """Linking (handshakes answered from Python, serving threads that wait for requests that do
    not come) does not turn a process's spinning off: the first pushes over the new link spin on
    their replies, none is skipped."""
    from llm_datadist.testing import Cluster, link
    os.environ.setdefault("LLM_DATADIST_DEVICE", "cpu")
    with Cluster(1, "PROMPT", listen=True, plane="tcp") as server, Cluster(2, "DECODER", plane="tcp") as client:
        server.call(_register_and_push, True)
        client.call(_register_and_push, False)
        assert link(client, server)[0] == 0
        linked = client.call(_spin_stats)
        assert linked[2] == 0, linked  # nothing skipped while linking
        first = client.call(_register_and_push, False, 1)
        second = client.call(_register_and_push, False, 1)
        assert second[2] == 0, (linked, first, second)
