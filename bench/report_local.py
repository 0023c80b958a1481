#!/usr/bin/env python
"""Throughput of the local copy API relative to its baselines, per operation and block size.

    python bench/report_local.py                     # run bench/test_bench_local.py, then report
    python bench/report_local.py a.json [b.json ...] # report on saved --benchmark-json files
    python bench/report_local.py --runs 3            # run the suite 3 times, report each and all
    python bench/report_local.py --save-dir DIR      # keep the JSON of fresh runs in DIR
    python bench/report_local.py --pytest-args="--benchmark-disable-gc"

Ratios are of throughput (= baseline median time / API median time), so 1.0x means as fast as
the baseline and 2.0x twice as fast. Targets: API >= 0.9x the C loop and >= 2x numpy. With
several runs, the combined lines give the median of the per-run ratios (each run compares
measurements taken minutes apart at most) and of the per-run GB/s. Each line also gives
the ratios of the best rounds (min times), which a noisy neighbour disturbs least, and flags
measurements whose interquartile range exceeds NOISY_IQR of their median.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SUITE = "bench/test_bench_local.py"
TARGETS = {"c_loop": 0.9, "numpy": 2.0}
LABELS = {"api": "API", "c_loop": "C loop", "numpy": "numpy"}
NOISY_IQR = 0.15


def run_suite(json_path: Path, extra_args) -> None:
    cmd = [sys.executable, "-m", "pytest", SUITE, "--benchmark-only", "-q",
           f"--benchmark-json={json_path}", *extra_args]
    print("$", shlex.join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        print(done.stdout, end="")
        raise SystemExit(f"the benchmark run failed with exit status {done.returncode}")


def load(json_path: Path) -> dict:
    """``{(op, block, block_bytes): {impl: stats}}`` from one pytest-benchmark JSON file."""
    data = json.loads(Path(json_path).read_text())
    table: dict = {}
    for bench in data["benchmarks"]:
        info = bench.get("extra_info", {})
        if not {"op", "impl", "block", "bytes"} <= info.keys():
            continue
        stats = bench["stats"]
        key = (info["op"], info["block"], info.get("block_bytes", 0))
        table.setdefault(key, {})[info["impl"]] = {
            "bytes": info["bytes"], "median": stats["median"], "min": stats["min"],
            "iqr": stats["iqr"] / stats["median"]}
    return table


def report(runs) -> bool:
    """Print the lines for one or more runs (tables from ``load``; ratios and GB/s are medians
    over the runs); True when every target is met."""
    all_met = True
    keys = sorted({key for table in runs for key in table}, key=lambda k: (k[0], k[2]))
    for key in keys:
        op, block, _ = key
        groups = [table[key] for table in runs if "api" in table.get(key, {})]
        if not groups:
            continue
        nbytes = groups[0]["api"]["bytes"]
        impls = [impl for impl in LABELS if all(impl in group for group in groups)]
        rates = [f"{LABELS[impl]} "
                 f"{statistics.median(nbytes / g[impl]['median'] for g in groups) / 1e9:.2f}"
                 for impl in impls]
        ratios, best_ratios, misses = [], [], []
        for impl in impls:
            if impl == "api":
                continue
            ratio = statistics.median(g[impl]["median"] / g["api"]["median"] for g in groups)
            best = min(g[impl]["min"] for g in groups) / min(g["api"]["min"] for g in groups)
            ratios.append(f"{ratio:.2f}x {LABELS[impl]}")
            best_ratios.append(f"{best:.2f}x {LABELS[impl]}")
            if ratio < TARGETS[impl]:
                misses.append(f"< {TARGETS[impl]}x {LABELS[impl]}")
        noisy = []
        for impl in impls:
            worst = max(g[impl]["iqr"] for g in groups)
            if worst > NOISY_IQR:
                noisy.append(f"{LABELS[impl]} IQR {worst:.0%} of median")
        all_met &= not misses
        verdict = "MISSED " + ", ".join(misses) if misses else "targets met"
        print(f"{op} {block}: {', '.join(ratios)}  {verdict}")
        print(f"    median GB/s: {', '.join(rates)}  ({nbytes / 2**20:.0f} MiB/call); "
              f"best rounds: {', '.join(best_ratios)}")
        if noisy:
            print(f"    noisy: {', '.join(noisy)}")
    return all_met


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="*", type=Path, help="existing --benchmark-json files to read")
    parser.add_argument("--runs", type=int, default=1, help="fresh runs of the suite (default 1)")
    parser.add_argument("--save-dir", type=Path, help="where to keep the JSON of fresh runs")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments for fresh runs")
    args = parser.parse_args(argv)
    paths = list(args.json)
    if not paths:
        out_dir = args.save_dir or Path(tempfile.mkdtemp(prefix="llm_datadist_bench_"))
        out_dir.mkdir(parents=True, exist_ok=True)
        for run in range(1, args.runs + 1):
            path = out_dir.resolve() / f"bench_local_{run}.json"
            run_suite(path, shlex.split(args.pytest_args))
            paths.append(path)
    tables = [load(path) for path in paths]
    if not any(tables):
        print(f"no local-copy benchmarks found in {', '.join(map(str, paths))}", file=sys.stderr)
        return 2
    for path, table in zip(paths, tables):
        print(f"\n== {path}")
        report([table])
    if len(tables) > 1:
        print(f"\n== combined: {len(tables)} runs, median of the per-run ratios")
        report(tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
