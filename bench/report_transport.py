#!/usr/bin/env python
"""Cross-process block transfers against their targets, measured without pytest.

    python bench/report_transport.py                  # one run: table + 4 KiB latency
    python bench/report_transport.py --runs 3         # 3 runs (same processes), each + combined
    python bench/report_transport.py --json out.json  # also write every duration measured
    python bench/report_transport.py --profile        # plus cProfile of the 4 KiB cma push
    python bench/report_transport.py --planes shm,cma # only these planes' clients

Same workload, processes and timing as ``test_bench_transport.py`` (see
``llm_datadist/cli/workload.py``). Per case, the measurements are interleaved: every kind (memcpy
baseline, cma push/pull, tcp push/pull) runs one batch in turn until each has its repetitions, so
the baseline and the transfers share the same stretches of a noisy machine.

Throughput ratio = median time of the memcpy baseline / median time of the transfer (1.0x = as
fast as a single-threaded memcpy of the same descriptors in one process); ``best`` uses the
fastest repetitions instead. Targets: cma >= 0.9x (2 MiB) and >= 0.8x (16 KiB), tcp >= 0.3x
and >= 0.15x, both directions; one 4 KiB cma push, completion included: median <= 4 us, plain
(``push``) and with every layer argument (``push_layers``), printed beside NIXL/UCX's figure for
one 4 KiB write on the development VM. With several runs the combined lines give the median of
the per-run ratios and GB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the checkout's package (the Cython core is built in place)
    sys.path.insert(0, str(REPO_ROOT))

from llm_datadist.cli.workload import (  # noqa: E402
    BULK_CASES,
    CPU_REFERENCE,
    LATENCY_CASE,
    LATENCY_TARGET_KINDS,
    LATENCY_TARGET_NS,
    NIXL_4KIB_WRITE_US,
    MEMCPY,
    PUSH,
    THROUGHPUT_TARGETS,
    Case,
    TransportRig,
    kind_label,
    kinds,
)

#: A transfer whose interquartile range exceeds this fraction of its median is flagged as noisy.
NOISY_IQR = 0.15


def measure_case(rig: TransportRig, case: Case, repetitions: int) -> dict:
    """``{kind label: [ns, ...]}`` for every kind of ``case``, measured interleaved (plus the
    CPU reference loop for the latency case)."""
    rig.use(case)
    measured = kinds(case, list(rig.clients)) + ([(None, CPU_REFERENCE)] if case == LATENCY_CASE else [])
    durations = {kind_label(*kind): [] for kind in measured}
    while any(len(d) < repetitions for d in durations.values()):
        for plane, op in measured:
            got = durations[kind_label(plane, op)]
            if len(got) < repetitions:
                got += rig.measure(plane, op, min(case.batch, repetitions - len(got)))
    return durations


def percentile(values, fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def bulk_rows(case: Case, durations: dict) -> list:
    """One row per transfer kind: throughput, per block and relative to the memcpy baseline."""
    base = durations[MEMCPY]
    base_median, base_min = statistics.median(base), min(base)
    rows = []
    for label, values in durations.items():
        if label == MEMCPY:
            continue
        plane, direction = label.split()
        median = statistics.median(values)
        target = THROUGHPUT_TARGETS.get((plane, case.label), 0.0)  # a plane without a target of the issue
        ratio = base_median / median
        rows.append(dict(plane=plane, direction=direction, block=case.label,
                         gbps=case.bytes_per_transfer / median, us_per_block=median / 1e3 / case.moved,
                         baseline_gbps=case.bytes_per_transfer / base_median, ratio=ratio,
                         best_ratio=base_min / min(values), target=target, passed=ratio >= target,
                         median_ms=median / 1e6, min_ms=min(values) / 1e6, baseline_min_ms=base_min / 1e6,
                         iqr=(percentile(values, 0.75) - percentile(values, 0.25)) / median))
    return rows


TARGET_LABELS = {kind_label(*kind) for kind in LATENCY_TARGET_KINDS}


def latency_rows(durations: dict) -> list:
    rows = []
    for label, values in durations.items():
        row = dict(kind=label, median_us=statistics.median(values) / 1e3,
                   p99_us=percentile(values, 0.99) / 1e3, min_us=min(values) / 1e3, n=len(values))
        if label in TARGET_LABELS:
            row.update(target_us=LATENCY_TARGET_NS / 1e3, passed=row["median_us"] * 1e3 <= LATENCY_TARGET_NS)
        rows.append(row)
    return rows


def print_bulk(rows: list) -> None:
    print(f"{'plane':5} {'direction':9} {'block':>5} {'GB/s':>7} {'us/block':>9} {'base GB/s':>9} "
          f"{'ratio':>6} {'best':>6} {'target':>7}  result")
    for r in rows:
        noisy = f"  (noisy: IQR {r['iqr']:.0%} of the median)" if r["iqr"] > NOISY_IQR else ""
        print(f"{r['plane']:5} {r['direction']:9} {r['block']:>5} {r['gbps']:7.2f} {r['us_per_block']:9.2f} "
              f"{r['baseline_gbps']:9.2f} {r['ratio']:5.2f}x {r['best_ratio']:5.2f}x {r['target']:6.2f}x  "
              f"{'pass' if r['passed'] else 'MISS'}{noisy}")


def print_latency(rows: list) -> None:
    print(f"{LATENCY_CASE.label}, one block a call (us): {'kind':16} {'median':>8} {'p99':>8} {'min':>8}")
    for r in rows:
        verdict = ""
        if "target_us" in r:
            verdict = f"  target median <= {r['target_us']:.0f} us: {'pass' if r['passed'] else 'MISS'}"
        if r["kind"] == CPU_REFERENCE:
            verdict = "  (CPU reference, not a transfer: 200 Python additions)"
        print(f"{'':33}{r['kind']:16} {r['median_us']:8.2f} {r['p99_us']:8.2f} {r['min_us']:8.2f}{verdict}")
    low, high = NIXL_4KIB_WRITE_US
    print(f"{'':33}{'NIXL (UCX)':16} {low:.1f}-{high:.1f} us: one 4 KiB write on the development VM, "
          f"not measured in this run")


def combine(runs: list) -> tuple:
    """Median over runs of each bulk row's numbers and of each latency row's numbers."""
    bulk = []
    for rows in zip(*(run["bulk"] for run in runs)):
        row = dict(rows[0])
        for field in ("gbps", "us_per_block", "baseline_gbps", "ratio", "median_ms"):
            row[field] = statistics.median(r[field] for r in rows)
        row["min_ms"] = min(r["min_ms"] for r in rows)
        row["baseline_min_ms"] = min(r["baseline_min_ms"] for r in rows)
        row["best_ratio"] = row["baseline_min_ms"] / row["min_ms"]
        row["iqr"] = max(r["iqr"] for r in rows)
        row["passed"] = row["ratio"] >= row["target"]
        bulk.append(row)
    latency = []
    for rows in zip(*(run["latency"] for run in runs)):
        row = dict(rows[0])
        for field in ("median_us", "p99_us"):
            row[field] = statistics.median(r[field] for r in rows)
        row["min_us"] = min(r["min_us"] for r in rows)
        if "target_us" in row:
            row["passed"] = row["median_us"] <= row["target_us"]
        latency.append(row)
    return bulk, latency


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="measurement runs (default 1)")
    parser.add_argument("--repetitions", type=int, default=30,
                        help="256 MiB transfers per kind and run (default 30)")
    parser.add_argument("--latency-repetitions", type=int, default=5000,
                        help="4 KiB transfers per kind and run (default 5000)")
    parser.add_argument("--json", type=Path, help="write every duration and the tables here")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of 20000 4 KiB cma pushes")
    parser.add_argument("--planes", help="comma-separated planes to measure (default: every one that runs here)")
    args = parser.parse_args(argv)

    meta = dict(python=platform.python_version(), machine=platform.machine(), cpus=os.cpu_count(),
                kernel=platform.release(), started=time.strftime("%Y-%m-%d %H:%M:%S"),
                loadavg_start=os.getloadavg())
    print(f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at start",
          flush=True)
    runs = []
    with TransportRig(args.planes.split(",") if args.planes else None) as rig:
        for run in range(1, args.runs + 1):
            raw = {case.label: measure_case(rig, case, args.repetitions) for case in BULK_CASES}
            raw[LATENCY_CASE.label] = measure_case(rig, LATENCY_CASE, args.latency_repetitions)
            result = dict(bulk=[row for case in BULK_CASES for row in bulk_rows(case, raw[case.label])],
                          latency=latency_rows(raw[LATENCY_CASE.label]), durations_ns=raw,
                          loadavg_end=os.getloadavg())
            runs.append(result)
            print(f"\n== run {run} of {args.runs} (load average at its end "
                  f"{' '.join(f'{x:.2f}' for x in result['loadavg_end'])})")
            print_bulk(result["bulk"])
            print()
            print_latency(result["latency"])
        profile = rig.profile("cma", PUSH, 20000) if args.profile else None
    combined = combine(runs) if len(runs) > 1 else (runs[0]["bulk"], runs[0]["latency"])
    if len(runs) > 1:
        print(f"\n== combined: {len(runs)} runs, median of the per-run values (best: fastest repetitions "
              f"of all runs; noisy: the noisiest run)")
        print_bulk(combined[0])
        print()
        print_latency(combined[1])
    if profile:
        print(f"\n== cProfile of 20000 {LATENCY_CASE.label} cma pushes (in the client process)\n{profile}")
    if args.json:
        meta["loadavg_end"] = os.getloadavg()
        payload = dict(meta=meta, cases={c.label: dict(block_bytes=c.block_bytes, blocks_moved=c.moved,
                                                       bytes=c.bytes_per_transfer)
                                         for c in [*BULK_CASES, LATENCY_CASE]},
                       runs=runs, combined=dict(bulk=combined[0], latency=combined[1]))
        args.json.write_text(json.dumps(payload, indent=1))
        print(f"\nraw results written to {args.json}")
    met = all(r["passed"] for r in combined[0]) and all(r.get("passed", True) for r in combined[1])
    print(f"\n{'all targets met' if met else 'some targets missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
