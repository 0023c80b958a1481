"""Block transfers between two processes: ``push_blocks`` / ``pull_blocks`` on the same-host
(``cma``) and TCP planes, against a single-process memcpy of the same descriptors.

The workload, the processes and the baselines are described in ``llm_datadist/cli/workload.py``
(shared with ``report_transport.py`` and ``python -m llm_datadist bench``). Groups, so that
``--benchmark-only`` compares like with like:

* ``transport 2MiB`` and ``transport 16KiB``: 256 MiB a transfer (128 blocks of 2 MiB, 16384
  of 16 KiB, random non-adjacent ids, one tensor): ``memcpy`` (``_core.memcpy_baseline`` in the
  client process), ``cma push``, ``cma pull``, ``tcp push``, ``tcp pull``;
* ``transport latency 4KiB``: one 4 KiB block a transfer, the same five plus ``copy_blocks``
  (the public local copy of one block).

Every duration is measured inside the client process, around the call alone. pytest-benchmark
gets those durations through a clock that advances only by them (``ChildClock``): a round runs
one transfer's worth of that clock, and the calls into the child process (pipe and pickling, a
batch of transfers at a time) never count. The statistics are therefore per transfer, exactly as
the child measured them.

Run: ``python -m pytest bench/test_bench_transport.py --benchmark-only -q``;
``python bench/report_transport.py`` prints GB/s, ratios and targets without pytest.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import pytest

pytest.importorskip("pytest_benchmark")

from llm_datadist.cli.workload import (  # noqa: E402
    BULK_CASES,
    LATENCY_CASE,
    Case,
    TransportRig,
    kind_label,
    kinds,
)


class ChildClock:
    """A benchmark target and the clock to time it with.

    Each call of the target consumes one duration measured in the cluster process (fetching a
    batch of ``case.batch`` transfers when none is left) and advances the clock by exactly that
    much, so pytest-benchmark records the child's duration of one transfer per round.
    """

    def __init__(self, rig: TransportRig, plane: Optional[str], op: str) -> None:
        self.rig, self.plane, self.op = rig, plane, op
        self.elapsed_ns = 0
        self.pending: deque = deque()
        self.calls = 0

    def child_clock(self) -> float:
        return self.elapsed_ns / 1e9

    def one_transfer(self) -> None:
        if not self.pending:
            self.pending.extend(self.rig.measure(self.plane, self.op, self.rig.case.batch))
            self.calls += 1
        self.elapsed_ns += self.pending.popleft()


@pytest.fixture(scope="module")
def rig():
    with TransportRig() as transport_rig:
        yield transport_rig


@pytest.fixture(scope="module", params=BULK_CASES, ids=[case.label for case in BULK_CASES])
def bulk_case(request) -> Case:
    return request.param


@pytest.fixture
def bulk(rig, bulk_case):
    rig.use(bulk_case)  # set up once per case: tests of one case run together
    return rig


@pytest.fixture
def latency(rig):
    rig.use(LATENCY_CASE)
    return rig


def _run(benchmark, rig: TransportRig, plane: Optional[str], op: str, group: str) -> None:
    case = rig.case
    if not hasattr(benchmark, "_timer"):
        raise RuntimeError("this pytest-benchmark keeps its timer elsewhere: the child-measured "
                           "clock cannot be installed (see ChildClock)")
    timing = ChildClock(rig, plane, op)
    # The clock every round of this benchmark reads (pytest-benchmark's runner takes
    # ``self._timer`` when pedantic builds it); the global --benchmark-timer stays as it is.
    benchmark._timer = timing.child_clock
    benchmark.group = group
    benchmark.extra_info.update(plane=plane or "local", op=op, impl=kind_label(plane, op),
                                block=case.label, block_bytes=case.block_bytes,
                                blocks_moved=case.moved, tensors=1,
                                bytes=case.bytes_per_transfer, timed_in="client process")
    benchmark.pedantic(timing.one_transfer, rounds=case.rounds, iterations=1, warmup_rounds=1)
    benchmark.extra_info["calls_into_child"] = timing.calls


BULK_KINDS = kinds(BULK_CASES[0])
LATENCY_KINDS = kinds(LATENCY_CASE)


@pytest.mark.parametrize("plane,op", BULK_KINDS, ids=[kind_label(*k).replace(" ", "-") for k in BULK_KINDS])
def test_transfer_256MiB(benchmark, bulk, plane, op):
    _run(benchmark, bulk, plane, op, f"transport {bulk.case.label}")


@pytest.mark.parametrize("plane,op", LATENCY_KINDS,
                         ids=[kind_label(*k).replace(" ", "-") for k in LATENCY_KINDS])
def test_latency_4KiB(benchmark, latency, plane, op):
    _run(benchmark, latency, plane, op, f"transport latency {latency.case.label}")
