"""GPU rows: device copies, swaps and transfers against a baseline of the same bytes.

The workload, processes, baselines and fences are those of ``python -m llm_datadist bench``'s GPU
rows (``llm_datadist/cli/device_workload.py``): a 256 MiB-class paged cache (one tensor, twice
the moved blocks, random block ids), 128 MiB a call at 2 MiB and 16 KiB blocks. One
pytest-benchmark group per (row, block size) holds the measurement and its baseline:

* ``gpu copy_blocks D2D <size>``: ``copy_blocks`` / one ``Runtime.memcpy`` device-to-device;
* ``gpu swap_blocks D2H|H2D <size>``: ``swap_blocks`` / one memcpy with pinned host memory;
* ``gpu cuda_ipc push|pull <size>``: ``push_blocks`` / ``pull_blocks`` between two processes on
  one GPU over cuda_ipc, completion included / one D2D memcpy;
* ``gpu staging push|pull <size>``: the same over the staging plane (cuda caches, TCP on
  loopback) / the tcp plane with HOST caches.

Every duration is one call's share of a batch of calls closed by a device fence, measured in the
process that makes the calls; pytest-benchmark reads a clock that advances only by those
(``BatchClock``). Without a usable runtime whose memory the host cannot address (a GPU), every
test is skipped with the reason; a row whose plane is not registered is skipped with that.

Run (on a GPU machine)::

    python -m pytest bench/test_bench_device.py --benchmark-only -q --benchmark-group-by=group

``LLM_DATADIST_GPU_BENCH_TOTAL=<bytes>`` makes the calls smaller (a quick check of the paths).
"""

from __future__ import annotations

import os
from collections import deque

import pytest

pytest.importorskip("pytest_benchmark")

from llm_datadist.cli import device_workload as device  # noqa: E402

ROUNDS = 30
MIN_CALLS = 3
RUNTIME, WHY = device.device_runtime()
#: Bytes a call (``LLM_DATADIST_GPU_BENCH_TOTAL`` overrides the default for quick checks).
TOTAL = int(os.environ.get("LLM_DATADIST_GPU_BENCH_TOTAL") or device.DEFAULT_TOTAL)
CASES = [device.make_case(size, TOTAL) for size in device.DEFAULT_SIZES]


class BatchClock:
    """Each round consumes one per-call duration measured in the cluster process (a batch closed
    by a fence) and advances the clock by exactly that much."""

    def __init__(self, rig: device.DeviceRig, kind, calls: int) -> None:
        self.rig, self.kind, self.calls = rig, kind, calls
        self.elapsed_ns = 0.0
        self.pending: deque = deque()

    def clock(self) -> float:
        return self.elapsed_ns / 1e9

    def one_call(self) -> None:
        if not self.pending:
            self.pending.extend(self.rig.measure(self.kind, 10, self.calls))
        self.elapsed_ns += self.pending.popleft()


@pytest.fixture(scope="module")
def rig():
    if RUNTIME is None:
        pytest.skip(f"GPU rows: {WHY}")
    with device.DeviceRig(RUNTIME) as device_rig:
        yield device_rig


@pytest.fixture(scope="module", params=CASES, ids=[case.label for case in CASES])
def case(request, rig):
    rig.use(request.param)
    return request.param


@pytest.mark.parametrize("role", ["measured", "baseline"])
@pytest.mark.parametrize("comparison", device.COMPARISONS, ids=[c.name.replace(" ", "-") for c in device.COMPARISONS])
def test_gpu_row(benchmark, rig, case, comparison, role):
    if not (rig.measurable(comparison.kind) and rig.measurable(comparison.baseline)):
        missing = [k[0] for k in (comparison.kind, comparison.baseline) if not rig.measurable(k)]
        pytest.skip("; ".join(rig.notes.get(plane, f"no {plane} client") for plane in missing))
    if not hasattr(benchmark, "_timer"):
        raise RuntimeError("this pytest-benchmark keeps its timer elsewhere: the batch clock cannot be installed")
    rig.use(case)
    kind = comparison.kind if role == "measured" else comparison.baseline
    first = rig.measure(kind, 1, 1)[0]
    calls = max(MIN_CALLS, min(device.MAX_BATCH, int(device.BATCH_SECONDS * 1e9 / max(1.0, first))))
    timing = BatchClock(rig, kind, calls)
    benchmark._timer = timing.clock
    benchmark.group = f"gpu {comparison.name} {case.label}"
    target = comparison.target_at(case.block_bytes)
    benchmark.extra_info.update(operation=comparison.name, role=role, kind=f"{kind[0] or 'local'} {kind[1]}",
                                baseline=comparison.baseline_name, target=target, block=case.label,
                                block_bytes=case.block_bytes, blocks_moved=case.moved, bytes=case.bytes_per_call,
                                calls_per_batch=calls, runtime=RUNTIME, pinned=rig.facts.get("pinned"))
    benchmark.pedantic(timing.one_call, rounds=ROUNDS, iterations=1, warmup_rounds=1)
