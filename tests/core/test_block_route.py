"""``_io.BlockRoute``: the same-host latency path must move exactly the bytes the checked
path (``_core.plan_blocks`` + ``_io.cma_copy``) moves, and must decline — without writing a
byte — every call it cannot prove valid: a stale peer generation, a closed link, a dead peer, an
unlearnt selection, a block id that is not an exact int inside its cache, too many descriptors.

The peer is a forked child whose caches live in a ``MAP_SHARED`` mapping made before the fork:
the same addresses in both processes, so the parent reads what it wrote into the child, and every
byte outside the addressed blocks is a guard that must keep its value.
"""

from __future__ import annotations

import mmap
import os
import signal
import sys
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_datadist import _core, _io

TENSORS = 4
BLOCKS = 16
BLOCK = 256
GUARD = 0xA5


class Link:
    closed = False


class Peer:
    """A child process holding the 'remote' cache (and a local twin) in shared memory."""

    def __init__(self) -> None:
        nbytes = 2 * TENSORS * BLOCKS * BLOCK
        self._map = mmap.mmap(-1, nbytes + 4096, flags=mmap.MAP_SHARED)
        whole = np.frombuffer(self._map, dtype=np.uint8)
        self.generation = np.frombuffer(self._map, dtype=np.uint64, count=1, offset=nbytes)
        self.generation[0] = 3
        caches = whole[:nbytes].reshape(2, TENSORS, BLOCKS, BLOCK)
        self.local, self.remote = caches[0], caches[1]
        self.pid = os.fork()
        if self.pid == 0:  # the peer: only waits
            try:
                signal.pause()
            finally:
                os._exit(0)
        self.pidfd = os.pidfd_open(self.pid) if hasattr(os, "pidfd_open") else -1

    def layout(self, cache: np.ndarray) -> _core.CacheLayout:
        return _core.CacheLayout([cache[t].ctypes.data for t in range(TENSORS)], BLOCKS, BLOCK)

    def fill(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.local[...] = rng.integers(0, 255, self.local.shape, dtype=np.uint8)
        self.remote[...] = GUARD

    def route(self, write: bool, link: Link = None, generation: int = 3) -> _io.BlockRoute:
        pidfd = os.dup(self.pidfd) if self.pidfd >= 0 else -1  # the route takes it over
        route = _io.BlockRoute(link or Link(), self.pid, pidfd, self.generation, generation,
                                   self.layout(self.local), self.layout(self.remote), write)
        route.learn((None, None, 2), None, None)
        return route

    def close(self) -> None:
        if self.pid > 0:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.pid = -1
        if self.pidfd >= 0:
            os.close(self.pidfd)


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.close()


def expected_push(peer: Peer, src_blocks, dst_blocks, pairs) -> np.ndarray:
    """The remote cache after the checked path's plan (applied in this process, in order)."""
    out = np.full_like(peer.remote, GUARD)
    for s_t, d_t in pairs:
        for s, d in zip(src_blocks, dst_blocks):
            out[d_t, d] = peer.local[s_t, s]
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_push_moves_what_the_checked_plan_moves(peer, data):
    n = data.draw(st.integers(1, 12))
    src = data.draw(st.lists(st.integers(0, BLOCKS - 1), min_size=n, max_size=n))
    dst = data.draw(st.lists(st.integers(0, BLOCKS - 1), min_size=n, max_size=n, unique=True))
    first = data.draw(st.integers(0, TENSORS // 2 - 1))
    layers = range(first, first + 1)
    peer.fill(data.draw(st.integers(0, 2**32)))
    route = peer.route(True)
    route.learn((layers, layers, 2), [2 * first, 2 * first + 1], [2 * first, 2 * first + 1])
    use_layers = data.draw(st.booleans())
    args = (layers, layers, 2) if use_layers else (None, None, 2)
    assert route.run(src if data.draw(st.booleans()) else tuple(src), dst, *args)
    pairs = [(2 * first, 2 * first), (2 * first + 1, 2 * first + 1)] if use_layers else \
        [(t, t) for t in range(TENSORS)]
    np.testing.assert_array_equal(peer.remote, expected_push(peer, src, dst, pairs))
    # The same call through the checked path gives the same bytes.
    got = peer.remote.copy()
    peer.remote[...] = GUARD
    st_, dt_ = [p[0] for p in pairs], [p[1] for p in pairs]
    plan = _core.plan_blocks(peer.layout(peer.local), peer.layout(peer.remote), st_, dt_, src, dst)
    assert _io.cma_copy(peer.pid, plan, True, 1000, peer.pidfd) == (0, 0)
    np.testing.assert_array_equal(peer.remote, got)


def test_pull_reads_remote_blocks_into_local_ones(peer):
    peer.fill(1)
    peer.remote[...] = np.arange(peer.remote.size, dtype=np.uint64).astype(np.uint8).reshape(peer.remote.shape)
    before = peer.local.copy()
    route = peer.route(False)
    assert route.run([3, 4, 9], [0, 1, 15], None, None, 2)
    expected = before.copy()
    for s, d in zip([3, 4, 9], [0, 1, 15]):
        expected[:, d] = peer.remote[:, s]
    np.testing.assert_array_equal(peer.local, expected)


@pytest.mark.parametrize("src, dst", [
    ([BLOCKS], [0]), ([0], [BLOCKS]), ([-1], [0]), ([0], [-1]), ([True], [0]), ([0], [False]),
    ([1.0], [0]), ([np.int64(1)], [0]), (["1"], [0]), ([2**64], [0]), ([0, 1], [0]), ([], []),
    (np.array([1]), [0]), ([0], np.array([1])), (range(1), [0]), ("0", "0"), (None, [0]),
    ([0, BLOCKS], [1, 2]),
])
def test_block_ids_it_cannot_prove_valid_are_declined_untouched(peer, src, dst):
    peer.fill(2)
    route = peer.route(True)
    assert route.run(src, dst, None, None, 2) is False
    assert (peer.remote == GUARD).all()


@pytest.mark.parametrize("args", [
    (range(0, 1), range(0, 1), 2),   # never learnt
    (None, None, 1), (None, None, True), (None, None, 2.0), ([0], None, 2), (None, (0, 1), 2),
])
def test_selections_it_has_not_learnt_are_declined(peer, args):
    peer.fill(3)
    assert peer.route(True).run([0], [0], *args) is False
    assert (peer.remote == GUARD).all()


def test_a_learnt_selection_is_keyed_by_exact_arguments(peer):
    peer.fill(4)
    route = peer.route(True)
    route.learn((range(1, 2), range(0, 1), 2), [2, 3], [0, 1])
    src_range, dst_range = range(1, 2), range(0, 1)
    assert route.run([5], [6], src_range, dst_range, 2)
    expected = np.full_like(peer.remote, GUARD)
    expected[0, 6], expected[1, 6] = peer.local[2, 5], peer.local[3, 5]
    np.testing.assert_array_equal(peer.remote, expected)
    assert route.run([5], [6], range(0, 1), range(1, 2), 2) is False
    # The same objects again (the route remembers the last ones) and with a bool count.
    assert route.run([5], [6], src_range, dst_range, 2)
    assert route.run([5], [6], src_range, dst_range, True) is False
    assert route.run([5], [6], src_range, range(0, 5, 10), 2) is False
    np.testing.assert_array_equal(peer.remote, expected)


def test_stale_generation_closed_link_and_too_many_descriptors_are_declined(peer):
    peer.fill(5)
    assert peer.route(True, generation=2).run([0], [0], None, None, 2) is False
    link = Link()
    route = peer.route(True, link=link)
    assert route.current
    peer.generation[0] = 4
    assert not route.current and route.run([0], [0], None, None, 2) is False
    peer.generation[0] = 3
    link.closed = True
    assert not route.current and route.run([0], [0], None, None, 2) is False
    link.closed = False
    many = list(range(BLOCKS)) * (_io.ROUTE_MAX_DESCRIPTORS // (TENSORS * BLOCKS) + 1)
    assert route.run(many, many, None, None, 2) is False
    assert (peer.remote == GUARD).all()
    assert route.run([0], [0], None, None, 2)


def test_selections_and_block_sizes_are_checked_when_built(peer):
    route = peer.route(True)
    with pytest.raises(ValueError):
        route.learn((range(0, 1), None, 2), [0, 1], [0])
    with pytest.raises(ValueError):
        route.learn((range(0, 1), None, 2), [0, TENSORS], [0, 1])
    small = _core.CacheLayout([peer.remote[t].ctypes.data for t in range(TENSORS)], BLOCKS, BLOCK // 2)
    with pytest.raises(ValueError):
        _io.BlockRoute(Link(), peer.pid, -1, peer.generation, 3, peer.layout(peer.local), small, True)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open")
def test_a_dead_peer_is_declined():
    p = Peer()
    try:
        p.fill(6)
        route = p.route(True)
        os.kill(p.pid, signal.SIGKILL)
        os.waitpid(p.pid, 0)
        p.pid = -1
        assert route.run([0], [0], None, None, 2) is False
    finally:
        p.close()


def test_close_releases_the_pidfd_and_the_page_and_declines_afterwards(peer):
    peer.fill(7)
    route = peer.route(True)
    before = len(os.listdir("/proc/self/fd"))
    route.close()
    assert len(os.listdir("/proc/self/fd")) == before - (1 if peer.pidfd >= 0 else 0)
    assert not route.current
    assert route.run([0], [0], None, None, 2) is False
    route.close()  # idempotent
    assert (peer.remote == GUARD).all()


def _pidfd_of_an_exited_process() -> int:
    child = os.fork()
    if child == 0:
        os._exit(0)
    pidfd = os.pidfd_open(child)
    os.waitpid(child, 0)
    return pidfd


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open")
def test_a_close_racing_a_run_never_skips_the_liveness_check(peer):
    """The route's pidfd says the peer has exited, so every run must decline; a close() from
    another thread in the middle of the run (it releases the GIL) must not make it skip the check
    and write to the pid."""
    dead = _pidfd_of_an_exited_process()
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    wrote = 0
    try:
        src, dst = [0] * 32, [k % BLOCKS for k in range(32)]
        for _ in range(1000):
            route = _io.BlockRoute(Link(), peer.pid, os.dup(dead), peer.generation, 3,
                                       peer.layout(peer.local), peer.layout(peer.remote), True)
            route.learn((None, None, 2), None, None)
            go = threading.Event()
            closer = threading.Thread(target=lambda r=route, g=go: (g.wait(), r.close()))
            closer.start()
            peer.remote[...] = GUARD
            go.set()
            wrote += bool(route.run(src, dst, None, None, 2))
            closer.join()
    finally:
        sys.setswitchinterval(old_interval)
        os.close(dead)
    assert wrote == 0
    assert (peer.remote == GUARD).all()


@pytest.mark.parametrize("blocks", [1, 16])  # 4 x 2 = 8 descriptors (stack), 4 x 32 = 128 (heap)
def test_runs_on_a_thread_with_the_smallest_stack(peer, blocks):
    """Routes plan on the stack only for small calls: a thread made with the smallest stack
    Python allows (32 KiB) runs both kinds, and the bytes are those of the checked plan."""
    peer.fill(8)
    route = peer.route(True)
    src = list(range(blocks)) * 2
    dst = [(BLOCKS - 1 - k) % BLOCKS for k in range(len(src))]
    results = []
    old = threading.stack_size(32 * 1024)
    try:
        worker = threading.Thread(target=lambda: results.append(route.run(src, dst, None, None, 2)))
        worker.start()
        worker.join()
    finally:
        threading.stack_size(old)
    assert results == [True]
    np.testing.assert_array_equal(peer.remote, expected_push(peer, src, dst, [(t, t) for t in range(TENSORS)]))


def test_a_refused_construction_closes_the_taken_pidfd_and_nothing_else(peer):
    before = sorted(os.listdir("/proc/self/fd"))
    fd = os.dup(0)
    with pytest.raises(OverflowError):  # a generation outside uint64: the dup is the route's, closed
        _io.BlockRoute(Link(), peer.pid, fd, peer.generation, -1, peer.layout(peer.local),
                           peer.layout(peer.remote), True)
    with pytest.raises(TypeError):      # no descriptor taken: none closed (descriptor 0 included)
        _io.BlockRoute(Link(), peer.pid, "0", peer.generation, 3, peer.layout(peer.local),
                           peer.layout(peer.remote), True)
    os.fstat(0)
    assert sorted(os.listdir("/proc/self/fd")) == before
