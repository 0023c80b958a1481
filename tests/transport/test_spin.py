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
