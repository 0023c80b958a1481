#!/usr/bin/env python
"""Push mode's layer-wise pipelining against pull mode, with live vLLM CPU engines.

    python bench/report_vllm_push.py                    # 8 layers, hidden 1024, 2040-token prompts
    python bench/report_vllm_push.py --requests 3 --tokens 1024 --json out.json

A random-weight Llama checkpoint (8 layers, hidden 1024, 16 heads, 8 KV heads, fp32) is written to
a temporary directory. Three prefill/decode pairs run one after the other in this one run, each
over ``tcp`` with a link secret, the prefill engine pinned to CPU 0 and the decode engine to CPU 1
(one thread each: two hosts' worth of isolation on a 2-core box):

* ``pull``: the toy proxy's order, prefill (``max_tokens=1``) then decode, which pulls.
* ``push, proxy order``: the same order in push mode: the decode engine registers its blocks
  when it gets the request and the prefill engine pushes them, all layers at once.
* ``push, pipelined``: the decode engine gets the request first, immediately followed by the
  prefill engine (as a proxy that sends to both at once); the prefill worker pushes each layer
  from ``save_kv_layer`` while the next layers compute.

TTFT is from the first send until the decode engine's reply with its first token (``max_tokens=1``);
each request has a fresh random prompt. From the push timings the workers record
(``LLM_DATADIST_PUSH_TRACE``): for each layer, when its compute ended (``save_kv_layer``) and when its
push ended; the share of layers ``i`` whose push ended before layer ``i+1``'s compute did (the last
layer excluded), and how long after the last layer's compute the decode worker was told it had
everything (``push_done``). Medians over the requests; ratios against pull in the same run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(ROOT / "tests" / "integrations"))
sys.path.insert(0, str(ROOT))

GEOMETRY = dict(hidden=1024, layers=8, heads=16, kv_heads=8, head_dim=64, vocab=1000, inter=2816)
SECRET = "bench-" + os.urandom(8).hex()


def engines(model: Path, work: Path, mode: str, tag: str):
    from test_vllm import Engine

    extra = {"transfer_mode": mode, "data_plane": "tcp", "link_secret": SECRET, "kv_lease_s": 120.0}
    args = {"max_model_len": 2048, "max_num_batched_tokens": 2048}
    env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
           "LLM_DATADIST_PUSH_TRACE": str(work / f"trace-{tag}")}
    prefill = Engine(model, "producer", work / f"prefill-{tag}.log", extra, args, env=env, enter=("taskset", "-c", "0"))
    decode = Engine(model, "consumer", work / f"decode-{tag}.log", extra, args, env=env, enter=("taskset", "-c", "1"))
    prefill.wait_ready()
    decode.wait_ready()
    return prefill, decode


def send(engine, **request) -> None:
    engine.proc.stdin.write(json.dumps(request) + "\n")
    engine.proc.stdin.flush()


def run_mode(model: Path, work: Path, mode: str, prompts, warm) -> list:
    """TTFT per prompt (seconds) in ``mode``: ``pull``, ``push-order`` or ``push-pipelined``."""
    prefill, decode = engines(model, work, "push" if mode.startswith("push") else "pull", mode)
    try:
        ttfts = []
        for i, prompt in enumerate([warm] + prompts):
            name = f"cmpl-{mode}-{i}"
            t0 = time.perf_counter()
            if mode == "push-pipelined":
                if i == 0:  # (the first request links the engines: the proxy order)
                    out = prefill.generate([prompt], 1, [{"do_remote_decode": True}])
                    where = {k: out[0]["kv_transfer_params"][k] for k in ("remote_host", "remote_port",
                                                                           "remote_cluster_id")}
                    decode.generate([prompt], 1, [out[0]["kv_transfer_params"]])
                    continue
                print(json.dumps({"event": "sent", "t": time.time()}), file=open(work / f"trace-{mode}.0", "a"))
                send(decode, op="generate", prompts=[prompt], max_tokens=1, names=[name],
                     params=[dict(where, do_remote_prefill=True, transfer_mode="push")])
                send(prefill, op="generate", prompts=[prompt], max_tokens=1, names=[name],
                     params=[{"do_remote_decode": True}])
                got = decode._read(600)["outputs"]
                ttft = time.perf_counter() - t0
                print(json.dumps({"event": "answered", "t": time.time()}), file=open(work / f"trace-{mode}.0", "a"))
                prefill._read(600)
            else:
                out = prefill.generate([prompt], 1, [{"do_remote_decode": True}], timeout=600)
                got = decode.generate([prompt], 1, [out[0]["kv_transfer_params"]], timeout=600)
                ttft = time.perf_counter() - t0
            if mode.startswith("push"):
                prefill.call(op="step")  # (frees the held blocks, as a served engine's loop would)
            assert got[0].get("token_ids"), got
            if i:
                ttfts.append(ttft)
            print(f"  {mode} request {i}: TTFT {ttft * 1000:.0f} ms", file=sys.stderr)
        stats = prefill.stats()["stats"]
        return ttfts, stats
    finally:
        prefill.close()
        decode.close()


def push_timings(work: Path, mode: str) -> list:
    """Per request: (share of layers pushed before the next layer's compute ended, ms from the
    last layer's compute to the decode worker's ``push_done``, layers)."""
    records = []
    for path in glob.glob(str(work / f"trace-{mode}.*")):
        records += [json.loads(line) for line in Path(path).read_text().splitlines()]
    layers = {}
    for r in records:
        if r["event"] == "layer":
            layers.setdefault(r["request"], []).append(r)
    ready = {r["request"]: r["t"] for r in records if r["event"] == "ready"}
    out = []
    for req, rows in layers.items():
        rows.sort(key=lambda r: r["computed"])
        before = [rows[i]["pushed"] <= rows[i + 1]["computed"] for i in range(len(rows) - 1)]
        done = [t for d_id, t in ready.items() if d_id.rsplit("-", 1)[0] == req.rsplit("-", 1)[0]]
        after_ms = (min(done) - rows[-1]["computed"]) * 1000 if done else float("nan")
        push_ms = statistics.median([(r["pushed"] - r["computed"]) * 1000 for r in rows])
        out.append((sum(before) / max(1, len(before)), after_ms, len(rows), push_ms))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2040)  # (the model takes 2048 positions)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--modes", nargs="+", default=["pull", "push-order", "push-pipelined"])
    args = parser.parse_args()
    os.environ.setdefault("LLM_DATADIST_REQUIRE_VLLM", "1")
    import numpy as np

    from test_vllm import write_model

    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, GEOMETRY["vocab"], size=args.tokens).tolist() for _ in range(args.requests)]
    results = {}
    with tempfile.TemporaryDirectory(prefix="push-bench-") as tmp:
        work = Path(os.environ.get("PUSH_BENCH_DIR") or tmp)
        write_model(work / "model", geometry=GEOMETRY)
        for mode in args.modes:
            warm = rng.integers(3, GEOMETRY["vocab"], size=args.tokens).tolist()
            ttfts, stats = run_mode(work / "model", work, mode, prompts, warm)
            results[mode] = {"ttft_ms": [t * 1000 for t in ttfts], "stats": stats}
            if mode == "push-pipelined":
                timings = push_timings(work, mode)
                results[mode]["timings"] = timings
    pull = statistics.median(results["pull"]["ttft_ms"]) if "pull" in results else float("nan")
    print(f"\n{args.tokens}-token prompts, {GEOMETRY['layers']} layers, hidden {GEOMETRY['hidden']}, "
          f"{args.requests} requests (medians; load {open('/proc/loadavg').read().split()[0]})\n")
    print("| mode | TTFT ms | x pull |")
    print("|---|---|---|")
    for mode in args.modes:
        med = statistics.median(results[mode]["ttft_ms"])
        print(f"| {mode} | {med:.0f} | {med / pull:.2f} |")
    timings = results.get("push-pipelined", {}).get("timings") or []
    if timings:
        print(f"\npipelined: layer pushes per request {statistics.median([t[2] for t in timings]):.0f}; "
              f"share of layers whose push ended before the next layer's compute: "
              f"{statistics.median([t[0] for t in timings]):.2f}; one layer's push after its compute "
              f"{statistics.median([t[3] for t in timings]):.1f} ms; decode told it has everything "
              f"{statistics.median([t[1] for t in timings]):.1f} ms after the last layer's compute")
    stats = results.get("push-pipelined", {}).get("stats")
    if stats:
            print(f"pipelined run's prefill counters: pushed_layers {stats['pushed_layers']}, pushed_late "
              f"{stats['pushed_late']}, pushed_requests {stats['pushed_requests']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
