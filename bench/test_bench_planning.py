"""Planning cost: ``_core.plan_blocks`` against the pure-Python reference planner, per descriptor.

Planning turns (cache layouts, tensor selection, block lists) into ``(src, dst, nbytes)``
descriptors, with every index checked against the geometry; every block transfer (local copy,
swap, push, pull) plans once per call. The geometry is a 7B-class paged cache: 32 layers x K/V =
64 tensors, 256 blocks per tensor of 16 tokens x 32 KV heads x 128 dims x fp16 = 128 KiB. Planning
reads no cache memory, so the tensor addresses are made up and nothing is allocated.

Block ids are random and never adjacent (sources even, destinations odd), so nothing merges: the
plan has tensors x blocks descriptors, the same list as the reference's (checked in setup). Both
planners get what the engine passes: Python lists of ints, layouts built beforehand (the engine
keeps a cache's ``CacheLayout``; the reference takes the same numbers as arguments).

One group per plan size (``planning 64 descriptors``: one block over every layer;
``planning 4096 descriptors``: 64 blocks), each with ``core`` and ``reference`` measured in the
same run. ``extra_info["ns_per_descriptor"]`` gives the median per descriptor.

Run: ``python -m pytest bench/test_bench_planning.py --benchmark-only -q``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip("pytest_benchmark")

from llm_datadist import _core, _reference  # noqa: E402

NUM_TENSORS = 64  # 32 layers x K/V
NUM_BLOCKS = 256
BLOCK_BYTES = 16 * 32 * 128 * 2
SEED = 0x91A7


@dataclass(frozen=True)
class Case:
    blocks: int  # blocks per call (every tensor)
    rounds: int  # core; the reference, ~10-20x slower, gets a tenth

    @property
    def descriptors(self) -> int:
        return NUM_TENSORS * self.blocks


CASES = [Case(1, rounds=20000), Case(64, rounds=2000)]


def _layout_args(base: int):
    tensor_bytes = NUM_BLOCKS * BLOCK_BYTES
    # Made-up, distinct, 4 KiB-aligned tensor addresses with a gap between tensors.
    return [base + t * (tensor_bytes + (1 << 20)) for t in range(NUM_TENSORS)], NUM_BLOCKS, BLOCK_BYTES


@pytest.fixture(scope="module", params=CASES, ids=[f"{case.descriptors}desc" for case in CASES])
def planning(request):
    case: Case = request.param
    rng = np.random.default_rng(SEED + case.blocks)
    src_blocks = [int(b) for b in rng.choice(np.arange(0, NUM_BLOCKS, 2), case.blocks, replace=False)]
    dst_blocks = [int(b) for b in rng.choice(np.arange(1, NUM_BLOCKS, 2), case.blocks, replace=False)]
    src_args, dst_args = _layout_args(1 << 40), _layout_args(1 << 44)
    src_layout, dst_layout = _core.CacheLayout(*src_args), _core.CacheLayout(*dst_args)
    core = functools.partial(_core.plan_blocks, src_layout, dst_layout, None, None, src_blocks, dst_blocks)
    reference = functools.partial(_reference.plan_blocks, *src_args, *dst_args, None, None, src_blocks, dst_blocks)
    plan = core()
    assert len(plan) == case.descriptors, "adjacent blocks were merged"
    assert plan.descriptors().tolist() == [list(d) for d in reference()], "core and reference disagree"
    return case, {"core": core, "reference": reference}


@pytest.mark.parametrize("impl", ["core", "reference"])
def test_plan_blocks(benchmark, planning, impl):
    case, planners = planning
    benchmark.group = f"planning {case.descriptors} descriptors"
    benchmark.extra_info.update(op="plan_blocks", impl=impl, tensors=NUM_TENSORS, blocks=case.blocks,
                                descriptors=case.descriptors)
    rounds = case.rounds if impl == "core" else case.rounds // 10
    benchmark.pedantic(planners[impl], rounds=rounds, iterations=1, warmup_rounds=10)
    benchmark.extra_info["ns_per_descriptor"] = benchmark.stats.stats.median * 1e9 / case.descriptors
