"""The ``nixl`` plane against raw NIXL on the same descriptor lists, and the ``tcp`` plane against
NIXL's UCX TCP and a memcpy, on loopback and between two network namespaces (root).

The processes, caches and kinds are ``nixl_rig.py``'s. One pytest-benchmark group per place and
block size, ``nixl <where> <block>``, holds every kind of it: ``memcpy``, ``tcp push``/``pull``,
``raw NIXL write``/``read`` and ``nixl push``/``pull``. Every duration is measured inside the
client process around the call alone and reaches pytest-benchmark through a clock that advances
only by it (``ChildClock``, as in ``test_bench_transport.py``), so the statistics are per
transfer. Skipped without NIXL (and the namespaces without root).

Run: ``python -m pytest bench/test_bench_nixl.py --benchmark-only -q``; ``python
bench/report_nixl.py`` prints the ratios (plane / raw NIXL, x memcpy) as a markdown table.
"""

from __future__ import annotations

import sys
from collections import deque
from pathlib import Path

import pytest

pytest.importorskip("pytest_benchmark")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nixl_rig import CASES, KINDS, LABELS, NixlRig, unavailable  # noqa: E402


class ChildClock:
    """A benchmark target and the clock to time it with: each call consumes one duration measured
    in the client process (fetching ``case.batch`` at a time) and advances the clock by it."""

    def __init__(self, rig: NixlRig, process: str, op: str) -> None:
        self.rig, self.process, self.op = rig, process, op
        self.elapsed_ns = 0
        self.pending: deque = deque()

    def child_clock(self) -> float:
        return self.elapsed_ns / 1e9

    def one_transfer(self) -> None:
        if not self.pending:
            self.pending.extend(self.rig.measure(self.process, self.op, self.rig.case.batch))
        self.elapsed_ns += self.pending.popleft()


@pytest.fixture(scope="module", params=["loopback", "netns"])
def rig(request, tmp_path_factory):
    why = unavailable(request.param)
    if why is not None:
        pytest.skip(why)
    with NixlRig(request.param, tmp_path_factory.mktemp(f"nixl-{request.param}")) as nixl_rig:
        yield nixl_rig


@pytest.fixture(scope="module", params=CASES, ids=[case.label for case in CASES])
def case_rig(rig, request):
    rig.use(request.param)
    return rig


@pytest.mark.parametrize("process,op", KINDS, ids=[LABELS[kind].replace(" ", "-") for kind in KINDS])
def test_nixl(benchmark, case_rig, process, op):
    rig, case = case_rig, case_rig.case
    if not hasattr(benchmark, "_timer"):
        raise RuntimeError("this pytest-benchmark keeps its timer elsewhere: the child-measured clock cannot be "
                           "installed (see ChildClock)")
    timing = ChildClock(rig, process, op)
    benchmark._timer = timing.child_clock
    benchmark.group = f"nixl {rig.where} {case.label}"
    benchmark.extra_info.update(kind=LABELS[(process, op)], where=rig.where, block_bytes=case.block_bytes,
                                blocks_moved=case.moved, bytes=case.bytes_per_transfer, timed_in="client process")
    benchmark.pedantic(timing.one_transfer, rounds=case.rounds, iterations=1, warmup_rounds=1)
