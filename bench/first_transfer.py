#!/usr/bin/env python
"""What the first transfer of a link costs against the ones after it (issue 36, item 5).

    python bench/first_transfer.py                          # N = 64 and 4096, planes auto and tcp, 3 runs
    python bench/first_transfer.py --blocks 4096 --planes tcp --runs 5
    python bench/first_transfer.py --profile 4096           # plus cProfile of the first push, both sides

A decode server (its own process, ``llm.DataPlane=auto``) registers a HOST blocks cache of 64
tensors x N blocks of 16 KiB (numpy zeros, never touched: what a freshly allocated cache is); a
prefill process with a cache of 64 tensors x 4 blocks, forcing the plane under test, links to it
and pushes 4 blocks (every tensor) three times. Each run starts both processes afresh; the
link, the first push and the later pushes are timed in the prefill process around the public
calls. ``--profile N`` also runs cProfile over the link and the first push in the prefill process.

The script imports only what every version of the package has, so ``PYTHONPATH=<another
checkout> python bench/first_transfer.py`` measures another commit the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if "PYTHONPATH" not in os.environ:  # the checkout's package (the Cython core is built in place)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SERVER, CLIENT, MODEL = 1, 2, 9
TENSORS, BLOCK_BYTES, PUSHED, PUSHES = 64, 16 << 10, 4, 3


def register(state, blocks: int, owner: bool, touched: bool = False) -> None:
    """A HOST blocks cache of TENSORS x ``blocks`` blocks of BLOCK_BYTES, numpy zeros (untouched:
    its pages are mapped by the first write; ``touched``: written once before)."""
    import llm_datadist as ld
    arrays = [(np.ones if touched else np.zeros)((blocks, BLOCK_BYTES), np.uint8) for _ in range(TENSORS)]
    state.arrays["cache"] = arrays
    desc = ld.CacheDesc(TENSORS, [blocks, BLOCK_BYTES], ld.DataType.DT_UINT8, ld.Placement.HOST)
    key = ld.BlocksCacheKey(state.cluster_id, MODEL) if owner else None
    state.caches["cache"] = state.cm.register_blocks_cache(desc, [a.ctypes.data for a in arrays], key)


def link(state, server_id: int, ip: str, port: int, profile: bool) -> tuple:
    """Link to the server: (seconds, cProfile text or "")."""
    import llm_datadist as ld
    info = ld.LLMClusterInfo()
    info.remote_cluster_id = server_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info(ip, port)
    profiler = _profiler(profile)
    start = time.perf_counter()
    status, rets = state.dd.link_clusters([info], 10000)
    linked = time.perf_counter() - start
    text = _stats(profiler)
    if int(status) != 0 or any(int(r) != 0 for r in rets):
        raise RuntimeError(f"link failed: {status} {rets}")
    return linked, text


def push(state, server_id: int, blocks: int, profile: bool) -> tuple:
    """Push PUSHED blocks (every tensor) to the far end of the server's cache: (seconds, cProfile text)."""
    import llm_datadist as ld
    key, cache = ld.BlocksCacheKey(server_id, MODEL), state.caches["cache"]
    dst = [blocks - 1 - i for i in range(PUSHED)]
    profiler = _profiler(profile)
    faulted = faults(state)[0]
    start = time.perf_counter()
    state.cm.push_blocks(key, cache, list(range(PUSHED)), dst)
    took = time.perf_counter() - start
    return took, _stats(profiler), faults(state)[0] - faulted


def faults(state) -> tuple:
    """This process's (minor, major) page faults so far."""
    import resource
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt, usage.ru_majflt


def _profiler(on: bool):
    if not on:
        return None
    import cProfile
    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _stats(profiler) -> str:
    import io
    import pstats
    if profiler is None:
        return ""
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(30)
    return out.getvalue()


def one_run(plane: str, blocks: int, profile: bool, touched: bool = False) -> dict:
    """Fresh processes: link, then PUSHES pushes; seconds of each, the server's page faults during
    the first push and during the later ones, and the profiles."""
    from llm_datadist.testing import Cluster
    server_options = {"remote_cache_accessible": "1", "llm.DataPlane": "auto"}
    client_options = {"remote_cache_accessible": "1", "llm.DataPlane": plane}
    with Cluster(SERVER, "DECODER", listen=True, options=server_options) as server, \
            Cluster(CLIENT, "PROMPT", options=client_options) as client:
        server.call(register, blocks, True, touched)
        client.call(register, PUSHED, False)
        linked, link_profile = client.call(link, SERVER, *server.address, profile)
        before = server.call(faults)
        first, push_profile, first_faults = client.call(push, SERVER, blocks, profile)
        after_first = server.call(faults)
        later = [client.call(push, SERVER, blocks, False) for _ in range(PUSHES - 1)]
        after = server.call(faults)
    return dict(link=linked, pushes=[first, *(took for took, _, _ in later)], profile=(link_profile, push_profile),
                first_faults=first_faults + after_first[0] - before[0],
                later_faults=sum(f for _, _, f in later) + after[0] - after_first[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", default="64,4096", help="the server's blocks per tensor (default 64,4096)")
    parser.add_argument("--planes", default="auto,tcp", help="the prefill side's llm.DataPlane (default auto,tcp)")
    parser.add_argument("--runs", type=int, default=3, help="runs per case, interleaved (default 3)")
    parser.add_argument("--profile", type=int, default=0, help="cProfile the first push at this N (one run a plane)")
    parser.add_argument("--touched", action="store_true",
                        help="the server writes its cache before the link (no page faults in the first push)")
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args()
    os.environ.setdefault("LLM_DATADIST_DEVICE", "cpu")
    sizes = [int(b) for b in args.blocks.split(",")]
    planes = args.planes.split(",")
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    if args.profile:
        for plane in planes:
            result = one_run(plane, args.profile, True)
            print(f"== {plane}, N = {args.profile}: link {result['link'] * 1e3:.1f} ms; cProfile of the link "
                  f"(prefill side)\n{result['profile'][0]}")
            print(f"== {plane}, N = {args.profile}: first push {result['pushes'][0] * 1e3:.1f} ms; cProfile of the "
                  f"first push (prefill side)\n{result['profile'][1]}")
    rows = {(plane, n): [] for plane in planes for n in sizes}
    for _ in range(args.runs):
        for n in sizes:
            for plane in planes:
                rows[(plane, n)].append(one_run(plane, n, False, args.touched))
    print("faults: minor page faults of both processes during the first push / the later ones")
    print(f"{'plane':6} {'N':>6} {'descriptors':>11} {'link ms':>16} {'first push ms':>16} "
          f"{'link+first ms':>16} {'next pushes ms':>16} {'faults, first / next':>28}")
    for (plane, n), runs in rows.items():
        link = [r["link"] * 1e3 for r in runs]
        first = [r["pushes"][0] * 1e3 for r in runs]
        both = [a + b for a, b in zip(link, first)]
        later = [p * 1e3 for r in runs for p in r["pushes"][1:]]

        def span(values):
            return f"{min(values):6.1f}-{max(values):<7.1f}"
        print(f"{plane:6} {n:6} {n * TENSORS:11} {span(link):>16} {span(first):>16} {span(both):>16} "
              f"{span(later):>16} {statistics.median(r['first_faults'] for r in runs):>14.0f} / "
              f"{statistics.median(r['later_faults'] for r in runs):<11.0f}  (median link+first "
              f"{statistics.median(both):.1f})")
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{p} {n}": v for (p, n), v in rows.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
