"""Local block copies on a paged KV layout: ``copy_blocks`` and ``swap_blocks`` vs two baselines.

Layout: 64 layers x (K, V) = 128 tensors, each tensor a ``[num_blocks, block_bytes]`` uint8 blocks
cache allocated by the library on the ``cpu`` runtime (DEVICE memory emulated in host RAM, one
allocation per tensor). Block ids are random but never adjacent within a selection, so the
planner cannot merge neighbouring blocks into longer runs: every call is
``tensors x blocks_moved`` separate copies (checked in setup).

One pytest-benchmark group per (operation, block size), each measured in the same run:

* ``api``    - the public call as a user makes it (validation, planning, execution);
* ``c_loop`` - ``_core.memcpy_baseline`` over a plan built once in setup with ``_core.plan_blocks``
  from the same caches' layouts and the same block lists: the same descriptors the API produces,
  copied by a bare memcpy loop (no validation, no planning, no per-descriptor dispatch);
* ``numpy``  - fancy indexing ``dst[:, d] = src[:, s]`` over a ``(tensors, blocks, block_bytes)``
  array.

Run: ``python -m pytest bench/ --benchmark-only -q``; ``python bench/report_local.py`` prints
the API / baseline throughput ratios.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("pytest_benchmark")

from llm_datadist import Cache, CacheDesc, DataType, Placement, _core  # noqa: E402

NUM_LAYERS = 64
NUM_TENSORS = 2 * NUM_LAYERS  # K and V of every layer
SEED = 0x5EED


@dataclass(frozen=True)
class Case:
    label: str
    block_bytes: int
    device_blocks: int  # blocks per tensor of the DEVICE cache (source of both operations)
    host_blocks: int  # blocks per tensor of the HOST cache (swap_blocks destination)
    moved: int  # blocks moved per tensor and call
    rounds: int  # rounds of the api and c_loop benchmarks; numpy (slower, coarser) gets half

    @property
    def bytes_per_call(self) -> int:
        return NUM_TENSORS * self.moved * self.block_bytes


# Bytes per call: 16 KiB: 128 x 48 x 16 KiB = 96 MiB. 2 MiB: 128 tensors x 1 block is already
# 256 MiB, the least a call over every tensor can move at that block size.
# Rounds: each api / c_loop benchmark lasts ~2 s, so that the median survives the bursts of a
# shared machine that last a second or so; the suite takes ~40 s on a 2-core VM.
# Memory per case: 16 KiB: DEVICE cache 256 MiB + HOST cache 256 MiB + numpy twin 256 MiB;
# 2 MiB: 1 GiB + 512 MiB + 1 GiB (plus numpy's 256 MiB temporary). The cases run one after the
# other and each frees its memory in teardown, so the peak stays under 3 GiB.
CASES = [
    Case("16KiB", 16 << 10, device_blocks=128, host_blocks=128, moved=48, rounds=300),
    Case("2MiB", 2 << 20, device_blocks=4, host_blocks=2, moved=1, rounds=150),
]


def _spread_sample(rng: np.random.Generator, first: int, stop: int, count: int) -> np.ndarray:
    """``count`` distinct ids from ``first, first + 2, ... < stop`` in random order: no two ids
    of the result are adjacent."""
    candidates = np.arange(first, stop, 2)
    return rng.choice(candidates, size=count, replace=False).astype(np.intp)


def _pick_blocks(case: Case):
    """Random block selections ``(copy_src, copy_dst, swap_src, swap_dst)``.

    Within each selection ids are at least 2 apart, so no two consecutive copies continue each
    other on both sides. copy_blocks takes its sources from the even blocks and its destinations
    from the odd ones, so no destination is also a source (the result does not depend on order).
    """
    rng = np.random.default_rng(SEED + case.block_bytes)
    if case.moved > 1:
        copy_src = _spread_sample(rng, 0, case.device_blocks, case.moved)
        copy_dst = _spread_sample(rng, 1, case.device_blocks, case.moved)
        swap_src = _spread_sample(rng, 0, case.device_blocks, case.moved)
        swap_dst = _spread_sample(rng, int(rng.integers(2)), case.host_blocks, case.moved)
    else:
        # A single block per tensor: keep source and destination at least 2 blocks apart.
        s = int(rng.integers(case.device_blocks))
        far = [b for b in range(case.device_blocks) if abs(b - s) >= 2]
        copy_src = np.array([s], np.intp)
        copy_dst = np.array([rng.choice(far)], np.intp)
        swap_src = np.array([rng.integers(case.device_blocks)], np.intp)
        swap_dst = np.array([rng.integers(case.host_blocks)], np.intp)
    return copy_src, copy_dst, swap_src, swap_dst


def _pattern(tensor: int, num_blocks: int) -> np.ndarray:
    """A per-block byte value, distinct for every block of a tensor and never 0."""
    return ((tensor * num_blocks + np.arange(num_blocks)) % 251 + 1).astype(np.uint8)


@pytest.fixture(scope="module", params=CASES, ids=[case.label for case in CASES])
def local(request, datadist):
    case: Case = request.param
    cm = datadist.cache_manager
    nb, hb, bb = case.device_blocks, case.host_blocks, case.block_bytes

    # DEVICE blocks cache allocated by the library: 128 separate allocations. Writing a distinct
    # byte into every block faults all pages in (whatever the runtime did at allocation) and lets
    # the checks below see real moves.
    dev = cm.allocate_blocks_cache(CacheDesc(NUM_TENSORS, [nb, bb], DataType.DT_UINT8, Placement.DEVICE))
    dev_views = dev.as_numpy()
    for t, view in enumerate(dev_views):
        view[:] = _pattern(t, nb)[:, None]

    # HOST blocks cache: a staging cache over one numpy array, tensor t = host_np[t]. Filling it
    # faults its pages in before anything is timed.
    host_np = np.empty((NUM_TENSORS, hb, bb), np.uint8)
    host_np.fill(0)
    host = Cache.create_cpu_cache(CacheDesc(NUM_TENSORS, [hb, bb], DataType.DT_UINT8, Placement.HOST),
                                  [host_np[t] for t in range(NUM_TENSORS)])

    # Numpy baseline layout. The library gives each DEVICE tensor its own allocation, so the
    # DEVICE cache is not one array that fancy indexing can address. The baseline therefore
    # indexes a numpy twin of the same size and shape, (tensors, blocks, block_bytes) in one
    # allocation, filled (= faulted in) like the cache; its swap destination is host_np, the very
    # memory behind the HOST cache. numpy madvises its large arrays for transparent huge pages
    # (THP is "madvise" here), including the temporary that ``src[:, s]`` allocates on every
    # call, while the library's posix_memalign memory gets 4 KiB pages: page-size effects favour
    # the numpy baseline (measured here: a memcpy loop is ~2% faster on THP memory, and without
    # THP the per-call temporary's page faults would make numpy ~4x slower).
    np_dev = np.empty((NUM_TENSORS, nb, bb), np.uint8)
    for t in range(NUM_TENSORS):
        np_dev[t] = _pattern(t, nb)[:, None]

    copy_src, copy_dst, swap_src, swap_dst = _pick_blocks(case)
    copy_info = {int(s): [int(d)] for s, d in zip(copy_src, copy_dst)}
    swap_map = {int(s): int(d) for s, d in zip(swap_src, swap_dst)}

    # C-loop plans: the descriptors the API builds for the same call (same layouts, same lists in
    # the same order), planned once here so that the baseline times the copies alone.
    dev_layout = _core.CacheLayout(dev.tensor_addrs, nb, bb)
    host_layout = _core.CacheLayout(host.tensor_addrs, hb, bb)
    copy_plan = _core.plan_blocks(dev_layout, dev_layout, None, None, copy_src, copy_dst)
    swap_plan = _core.plan_blocks(dev_layout, host_layout, None, None, swap_src, swap_dst)
    for plan in (copy_plan, swap_plan):
        assert len(plan) == NUM_TENSORS * case.moved, "adjacent blocks were merged"
        assert plan.total_bytes == case.bytes_per_call

    # The API moves what we think it moves (checked once, before any timing).
    cm.copy_blocks(dev, copy_info)
    cm.swap_blocks(dev, host, swap_map)
    for t, view in enumerate(dev_views):
        assert np.array_equal(view[copy_dst], view[copy_src])
        assert np.array_equal(host_np[t, swap_dst], view[swap_src])
    del dev_views, view  # the views keep the allocations alive

    # Settle: run every timed path a few times so that the first benchmark of a case does not
    # absorb the after-effects of the allocation and filling above (TLB, caches, page state).
    for _ in range(3):
        cm.copy_blocks(dev, copy_info)
        _core.memcpy_baseline(copy_plan)
        np_dev[:, copy_dst] = np_dev[:, copy_src]
        cm.swap_blocks(dev, host, swap_map)
        _core.memcpy_baseline(swap_plan)
        host_np[:, swap_dst] = np_dev[:, swap_src]

    state = SimpleNamespace(case=case, cm=cm, dev=dev, host=host, host_np=host_np, np_dev=np_dev,
                            copy_src=copy_src, copy_dst=copy_dst, swap_src=swap_src,
                            swap_dst=swap_dst, copy_info=copy_info, swap_map=swap_map,
                            copy_plan=copy_plan, swap_plan=swap_plan)
    yield state
    cm.deallocate_blocks_cache(dev)
    state.__dict__.clear()  # drop plans, arrays and caches now, before the next case allocates


OP_GROUPS = {"copy_blocks": "copy_blocks", "swap_blocks": "swap_blocks D2H"}


def _run(benchmark, state, op: str, impl: str, fn) -> None:
    case = state.case
    benchmark.group = f"{OP_GROUPS[op]} {case.label}"
    benchmark.extra_info.update(op=op, impl=impl, block=case.label, block_bytes=case.block_bytes,
                                tensors=NUM_TENSORS, blocks_moved=case.moved,
                                bytes=case.bytes_per_call)
    rounds = case.rounds // 2 if impl == "numpy" else case.rounds
    benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1)


# -- copy_blocks: DEVICE -> same DEVICE cache ----------------------------------------------------

def test_copy_blocks_api(benchmark, local):
    _run(benchmark, local, "copy_blocks", "api",
         functools.partial(local.cm.copy_blocks, local.dev, local.copy_info))


def test_copy_blocks_c_loop(benchmark, local):
    _run(benchmark, local, "copy_blocks", "c_loop",
         functools.partial(_core.memcpy_baseline, local.copy_plan))


def test_copy_blocks_numpy(benchmark, local):
    arr, src, dst = local.np_dev, local.copy_src, local.copy_dst

    def fancy_copy():
        arr[:, dst] = arr[:, src]

    _run(benchmark, local, "copy_blocks", "numpy", fancy_copy)


# -- swap_blocks: DEVICE -> HOST -----------------------------------------------------------------

def test_swap_blocks_api(benchmark, local):
    _run(benchmark, local, "swap_blocks", "api",
         functools.partial(local.cm.swap_blocks, local.dev, local.host, local.swap_map))


def test_swap_blocks_c_loop(benchmark, local):
    _run(benchmark, local, "swap_blocks", "c_loop",
         functools.partial(_core.memcpy_baseline, local.swap_plan))


def test_swap_blocks_numpy(benchmark, local):
    src_arr, dst_arr, src, dst = local.np_dev, local.host_np, local.swap_src, local.swap_dst

    def fancy_swap():
        dst_arr[:, dst] = src_arr[:, src]

    _run(benchmark, local, "swap_blocks", "numpy", fancy_swap)
