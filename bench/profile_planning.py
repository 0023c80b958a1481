#!/usr/bin/env python
"""Where the time of planning + validating a large block transfer goes, and proof that no Python
code runs per block.

    python bench/profile_planning.py            # timings + cProfile of both measurements

Geometry: 64 tensors (32 layers x K/V) of 8192 blocks of 16 bytes; 4096 random, never adjacent
block ids per call, so every plan has 64 x 4096 = 262,144 descriptors and nothing merges.

* ``validate + plan``: what ``push_blocks``/``pull_blocks`` do before any byte moves: the API's
  container check of both block lists (``CacheManager._block_list``) and the core planner
  (``_core.plan_blocks``, which converts and range-checks every id in C);
* ``copy_blocks``: the public ``CacheManager.copy_blocks`` with a 4096-entry ``{src: [dst]}``
  dict, end to end (host memory, so the copies themselves are small: 16 bytes each).

For each, cProfile counts the Python function calls of 20 calls: a per-block Python loop would
show up as ~4096 calls (or more) per call. The script fails if there are more than
``MAX_CALLS_PER_CALL`` per call.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the checkout's package (the Cython core is built in place)
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402

import llm_datadist as ld  # noqa: E402
from llm_datadist import _core  # noqa: E402
from llm_datadist.cache_manager import CacheManager  # noqa: E402

TENSORS, BLOCKS, BLOCK_BYTES, MOVED = 64, 8192, 16, 4096
PROFILED_CALLS = 20
MAX_CALLS_PER_CALL = 64  # Python function calls per API call; a per-block loop makes thousands


def median_us(fn, repetitions: int) -> float:
    times = []
    for _ in range(repetitions):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1000


def profile(name: str, fn) -> int:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(PROFILED_CALLS):
        fn()
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    calls = stats.total_calls  # type: ignore[attr-defined]
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("ncalls").print_stats(12)
    print(f"--- cProfile of {PROFILED_CALLS} calls of {name}: {calls} Python function calls "
          f"({calls / PROFILED_CALLS:.0f} per call) ---")
    print(out.getvalue().strip().split("\n", 2)[-1])
    return calls // PROFILED_CALLS


def main() -> int:
    os.environ.setdefault("LLM_DATADIST_DEVICE", "cpu")
    rng = np.random.default_rng(7)
    src = [int(b) * 2 for b in rng.permutation(BLOCKS // 2)[:MOVED]]
    dst = [int(b) * 2 + 1 for b in rng.permutation(BLOCKS // 2)[:MOVED]]

    config = ld.LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    dd = ld.LLMDataDist(ld.LLMRole.PROMPT, 1)
    dd.init(config.generate_options())
    try:
        memory = [np.zeros((BLOCKS, BLOCK_BYTES), np.uint8) for _ in range(TENSORS)]
        desc = ld.CacheDesc(TENSORS, [BLOCKS, BLOCK_BYTES], ld.DataType.DT_UINT8, ld.Placement.HOST)
        cache = dd.cache_manager.register_blocks_cache(desc, [m.ctypes.data for m in memory])
        layout = _core.CacheLayout([m.ctypes.data for m in memory], BLOCKS, BLOCK_BYTES)
        mapping = {s: [d] for s, d in zip(src, dst)}

        def validate_and_plan():
            s = CacheManager._block_list("src_blocks", src)
            d = CacheManager._block_list("dst_blocks", dst)
            plan = _core.plan_blocks(layout, layout, None, None, s, d)
            assert len(plan) == TENSORS * MOVED
            return plan

        def copy_blocks():
            dd.cache_manager.copy_blocks(cache, mapping)

        print(f"{TENSORS} tensors x {MOVED} blocks = {TENSORS * MOVED} descriptors a call")
        print(f"validate + plan: median {median_us(validate_and_plan, 200):9.1f} us")
        print(f"copy_blocks:     median {median_us(copy_blocks, 50):9.1f} us (validation, planning and the copies)")
        worst = max(profile("validate + plan", validate_and_plan), profile("copy_blocks", copy_blocks))
    finally:
        dd.finalize()
    if worst > MAX_CALLS_PER_CALL:
        print(f"FAIL: {worst} Python calls per call (> {MAX_CALLS_PER_CALL}): a per-block Python loop is back")
        return 1
    print(f"no per-block Python code: at most {worst} Python calls per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
