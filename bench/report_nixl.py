#!/usr/bin/env python
"""The nixl plane against raw NIXL, and the tcp plane against NIXL's UCX TCP and a memcpy, measured
without pytest and printed as the markdown table of ``bench/README.md``.

    python bench/report_nixl.py                        # loopback, and two namespaces where root
    python bench/report_nixl.py --where loopback --rounds 10 --json out.json

Same processes and kinds as ``test_bench_nixl.py`` (see ``nixl_rig.py``). Per case the kinds are
interleaved: each runs one batch in turn until every kind has its repetitions, so that all of
them share the same stretches of a noisy machine. Ratios are of medians: ``x memcpy`` = memcpy's
median time / the kind's (1.0 = as fast as one thread copying the same descriptors in one
process); ``plane / raw`` = raw NIXL's median time / the plane's on the same blocks (target >= 0.95
at 2 MiB and 16 KiB: at most 5% overhead), against raw ``createXferReq`` with N x 3 lists and
against raw prepared lists by index (what the plane's block route posts). The 4 KiB row gives
medians in µs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent))

from nixl_rig import CASES, KINDS, LABELS, NixlRig, unavailable  # noqa: E402

OVERHEAD_TARGET = 0.95


def measure(rig: NixlRig, rounds: int) -> dict:
    """``{case label: {kind label: [ns, ...]}}``, interleaved per case."""
    results = {}
    for case in CASES:
        rig.use(case)
        reps = rounds if case.moved > 1 else rounds * 100
        durations = {LABELS[kind]: [] for kind in KINDS}
        while any(len(v) < reps for v in durations.values()):
            for process, op in KINDS:
                values = durations[LABELS[(process, op)]]
                if len(values) < reps:
                    values += rig.measure(process, op, min(case.batch, reps - len(values)))
        results[case.label] = durations
        rig.clear()
    return results


def table(where: str, results: dict) -> list:
    lines = []
    for case in CASES:
        median = {label: statistics.median(values) for label, values in results[case.label].items()}
        if case.moved == 1:
            us = {label: value / 1e3 for label, value in median.items()}
            lines.append(f"| {where} | 4 KiB x 1 (µs, completion included) | {us['memcpy']:.1f} | "
                         f"{us['tcp push']:.1f} / {us['tcp pull']:.1f} | "
                         f"{us['raw NIXL write']:.1f} / {us['raw NIXL read']:.1f} | "
                         f"{us['raw prepped write']:.1f} / {us['raw prepped read']:.1f} | "
                         f"{us['nixl push']:.1f} / {us['nixl pull']:.1f} | "
                         f"{median['raw NIXL write'] / median['nixl push']:.2f} / "
                         f"{median['raw NIXL read'] / median['nixl pull']:.2f} | "
                         f"{median['raw prepped write'] / median['nixl push']:.2f} / "
                         f"{median['raw prepped read'] / median['nixl pull']:.2f} |")
            continue

        def ratio(label: str, median: dict = median) -> str:
            return f"{median['memcpy'] / median[label]:.3f}"
        gbps = case.bytes_per_transfer / median["memcpy"]
        def over(raw: str, plane: str, median: dict = median) -> float:
            return median[raw] / median[plane]
        push, pull = over("raw NIXL write", "nixl push"), over("raw NIXL read", "nixl pull")
        prep_push, prep_pull = over("raw prepped write", "nixl push"), over("raw prepped read", "nixl pull")
        flag = "" if min(push, pull) >= OVERHEAD_TARGET else " (below 0.95)"
        prep_flag = "" if min(prep_push, prep_pull) >= OVERHEAD_TARGET else " (below 0.95)"
        lines.append(f"| {where} | {case.label} x {case.moved} ({case.bytes_per_transfer >> 20} MiB) | "
                     f"1.0 ({gbps:.2f} GB/s) | {ratio('tcp push')} / {ratio('tcp pull')} | "
                     f"{ratio('raw NIXL write')} / {ratio('raw NIXL read')} | "
                     f"{ratio('raw prepped write')} / {ratio('raw prepped read')} | {ratio('nixl push')} / "
                     f"{ratio('nixl pull')} | {push:.2f} / {pull:.2f}{flag} | {prep_push:.2f} / {prep_pull:.2f}"
                     f"{prep_flag} |")
    return lines


HEADER = ["| where | blocks per call | memcpy | tcp plane push / pull | raw NIXL (UCX TCP) write / read "
          "| raw NIXL prepped write / read | nixl plane push / pull | plane / raw NIXL, push / pull "
          "| plane / raw prepped, push / pull |",
          "|---|---|---|---|---|---|---|---|---|"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--where", choices=["loopback", "netns", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=10, help="repetitions per bulk kind (x100 at 4 KiB)")
    parser.add_argument("--json", help="write every duration here")
    args = parser.parse_args(argv)
    lines, everything = list(HEADER), {}
    for where in (["loopback", "netns"] if args.where == "both" else [args.where]):
        why = unavailable(where)
        if why is not None:
            print(f"{where}: skipped ({why})", file=sys.stderr)
            continue
        with tempfile.TemporaryDirectory() as logs, NixlRig(where, Path(logs)) as rig:
            everything[where] = results = measure(rig, args.rounds)
        lines += table(where, results)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(everything))
    return 0


if __name__ == "__main__":
    sys.exit(main())
