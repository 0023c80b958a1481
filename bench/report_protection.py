#!/usr/bin/env python
"""What link protection (``llm.LinkProtection``) costs: block pushes and pulls over the ``tcp``
plane between two processes on loopback, unprotected, ``integrity`` and ``encrypt``, in one run.

    python bench/report_protection.py                # 3 rounds
    python bench/report_protection.py --rounds 5 --json out.json

One server and one client process per setting (both with the same link secret; the server sets
the protection, the client follows it), each with a one-tensor HOST blocks cache. Cases: one
4 KiB block a call (latency, completion included), 64 blocks of 16 KiB a call (1 MiB) and 8
blocks of 2 MiB a call (16 MiB), random block ids. The settings are measured in turn, a batch
each per round, so that they share the same stretches of a noisy machine; reported per case and
direction: the median per call, GB/s, and the ratio of the unprotected median to the setting's
(1.0x = free). ``encrypt`` needs the cryptography package; without it its rows are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the checkout's package (the Cython core is built in place)
    sys.path.insert(0, str(REPO_ROOT))

#: (label, block bytes, blocks in the cache, blocks a call, calls a batch)
CASES = [("4KiB", 4096, 64, 1, 400), ("16KiB", 16 << 10, 256, 64, 40), ("2MiB", 2 << 20, 16, 8, 4)]
SERVER_ID, FIRST_CLIENT_ID = 1, 10
MODEL_ID = 0


def _register(state, block_bytes: int, blocks: int, seed: int) -> None:
    import numpy as np

    import llm_datadist as ld
    if getattr(state, "bench_cache", None) is not None:
        state.cm.unregister_cache(state.bench_cache.cache_id)
    state.bench_array = np.random.default_rng(seed).integers(0, 256, (blocks, block_bytes), dtype=np.uint8)
    desc = ld.CacheDesc(1, [blocks, block_bytes], ld.DataType.DT_UINT8, ld.Placement.HOST)
    state.bench_cache = state.cm.register_blocks_cache(desc, [state.bench_array.ctypes.data],
                                                       ld.BlocksCacheKey(state.cluster_id, MODEL_ID))


def _copy_of(state) -> bytes:
    return state.bench_array.tobytes()


def _time(state, remote_id: int, pull: bool, per_call: int, calls: int, blocks: int, seed: int) -> list:
    """Durations (ns) of ``calls`` pushes (pulls) of ``per_call`` random blocks each."""
    import random

    import llm_datadist as ld
    rng = random.Random(seed)
    key = ld.BlocksCacheKey(remote_id, MODEL_ID)
    move = state.cm.pull_blocks if pull else state.cm.push_blocks
    durations = []
    for _ in range(calls):
        src, dst = rng.sample(range(blocks), per_call), rng.sample(range(blocks), per_call)
        started = time.perf_counter_ns()
        move(key, state.bench_cache, src, dst)
        durations.append(time.perf_counter_ns() - started)
    return durations


def _pull_all(state, remote_id: int, blocks: int) -> None:
    import llm_datadist as ld
    state.cm.pull_blocks(ld.BlocksCacheKey(remote_id, MODEL_ID), state.bench_cache, list(range(blocks)),
                         list(range(blocks)))


def _protection(state, remote_id: int) -> str:
    return state.dd.engine.links.peer(remote_id).protection


def main(argv=None) -> int:
    from llm_datadist.testing import Cluster, link
    from llm_datadist.transport import protection

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="batches per setting, case and direction (default 3)")
    parser.add_argument("--json", type=Path, help="write every duration and the table here")
    args = parser.parse_args(argv)
    modes = [mode for mode in protection.MODES if protection.unavailable(mode) is None]
    skipped = [mode for mode in protection.MODES if mode not in modes]
    os.environ.setdefault("LLM_DATADIST_DEVICE", "cpu")
    secret = os.urandom(16).hex()
    print(f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at start; "
          f"settings {', '.join(modes)}" + (f" ({', '.join(skipped)} unavailable here)" if skipped else ""),
          flush=True)
    durations = {}
    with ExitStack() as stack:
        pairs = {}
        for i, mode in enumerate(modes):
            options = {"llm.LinkSecret": secret, "llm.SyncKvCacheWaitTime": "60000"}
            server = stack.enter_context(Cluster(SERVER_ID, "PROMPT", listen=True, plane="tcp",
                                                 options={**options, protection.OPTION: mode}))
            client = stack.enter_context(Cluster(FIRST_CLIENT_ID + i, "DECODER", plane="tcp", options=options))
            status = link(client, server)
            if status[0] != 0 or client.call(_protection, SERVER_ID) != mode:
                raise SystemExit(f"the {mode} pair did not link as asked: {status}")
            pairs[mode] = server, client
        for label, block_bytes, blocks, per_call, calls in CASES:
            for mode, (server, client) in pairs.items():
                server.call(_register, block_bytes, blocks, 1)
                client.call(_register, block_bytes, blocks, 2)
                # every byte right, once, before the timing: a pull of every block
                client.call(_pull_all, SERVER_ID, blocks)
                if client.call(_copy_of) != server.call(_copy_of):
                    raise SystemExit(f"{mode} {label}: a pull of every block did not copy them exactly")
            for _ in range(args.rounds):
                for pull in (False, True):
                    for mode, (_, client) in pairs.items():
                        got = client.call(_time, SERVER_ID, pull, per_call, calls, blocks, len(durations),
                                          timeout=600)
                        durations.setdefault((label, "pull" if pull else "push", mode), []).extend(got)
    rows = []
    for (label, direction, mode), values in durations.items():
        case = next(c for c in CASES if c[0] == label)
        base = statistics.median(durations[(label, direction, protection.OFF)])
        median = statistics.median(values)
        rows.append(dict(case=label, direction=direction, protection=mode, median_us=median / 1e3,
                         gbps=case[1] * case[3] / median, ratio=base / median, n=len(values)))
    print(f"\n{'case':6} {'dir':4} {'protection':10} {'median us':>10} {'GB/s':>7} {'vs off':>7}")
    for row in rows:
        print(f"{row['case']:6} {row['direction']:4} {row['protection']:10} {row['median_us']:10.1f} "
              f"{row['gbps']:7.3f} {row['ratio']:6.2f}x")
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps(dict(rows=rows, durations_ns={" ".join(k): v for k, v in durations.items()}),
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
