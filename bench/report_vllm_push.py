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

First it prints what one ``push_blocks`` per layer costs against one for all layers (``--calls-only``:
only that), over ``tcp`` between two llm_datadist processes, at the bench's KV size per layer and at
one 4 KiB block per layer (the per-call cost alone).
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
    if mode == "push":  # (the pipelined order registers without a lease token: matched by request id)
        extra["push_match_by_request_id"] = True
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
        ttfts, after = [], []  # (after: from the prefill's answer to the decode's)
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
                t1 = time.perf_counter()
                got = decode.generate([prompt], 1, [out[0]["kv_transfer_params"]], timeout=600)
                ttft = time.perf_counter() - t0
                if i:
                    after.append(time.perf_counter() - t1)
            if mode.startswith("push"):
                prefill.call(op="step")  # (frees the held blocks, as a served engine's loop would)
            assert got[0].get("token_ids"), got
            if i:
                ttfts.append(ttft)
            print(f"  {mode} request {i}: TTFT {ttft * 1000:.0f} ms", file=sys.stderr)
        stats = prefill.stats()["stats"]
        return ttfts, stats, after
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


# -- per-call cost: one push_blocks per layer against one for all layers ---------------------------

def _c_register(state, layers: int, blocks: int, block_bytes: int) -> None:
    import numpy as np

    from llm_datadist import BlocksCacheKey, CacheDesc, DataType, Placement
    state.arrays = [np.zeros((blocks, block_bytes), dtype=np.uint8) for _ in range(layers)]
    desc = CacheDesc(layers, [blocks, block_bytes], DataType.DT_UINT8, Placement.HOST)
    state.cache = state.cm.register_blocks_cache(desc, [a.ctypes.data for a in state.arrays],
                                                 BlocksCacheKey(state.cluster_id, 0))


def _c_time_pushes(state, owner: int, layers: int, blocks: int, rounds: int) -> dict:
    from llm_datadist import BlocksCacheKey
    key, ids = BlocksCacheKey(owner, 0), list(range(blocks))
    per_layer, at_once = [], []
    for _ in range(rounds + 1):  # (the first round learns the routes)
        t = time.perf_counter()
        for layer in range(layers):
            state.cm.push_blocks(key, state.cache, ids, ids, range(layer, layer + 1), range(layer, layer + 1), 1)
        per_layer.append(time.perf_counter() - t)
        t = time.perf_counter()
        state.cm.push_blocks(key, state.cache, ids, ids)
        at_once.append(time.perf_counter() - t)
    return {"per_layer_ms": statistics.median(per_layer[1:]) * 1000,
            "at_once_ms": statistics.median(at_once[1:]) * 1000}


def per_call_cost(rounds: int) -> list:
    """``push_blocks`` once per layer (what ``save_kv_layer`` does) against once for all layers
    (a late push), over ``tcp`` between two processes, for the bench's 8 layers: 64 blocks of 128 KiB
    per layer (a 2040-token prompt) and 1 block of 4 KiB per layer (the per-call cost alone)."""
    from llm_datadist.testing import Cluster, link
    rows = []
    for blocks, block_bytes in ((64, 128 << 10), (1, 4 << 10)):
        with Cluster(61, "DECODER", plane="tcp") as owner, Cluster(62, "PROMPT", listen=True, plane="tcp") as writer:
            owner.call(_c_register, GEOMETRY["layers"], blocks, block_bytes)
            writer.call(_c_register, GEOMETRY["layers"], blocks, block_bytes)
            link(owner, writer)
            got = writer.call(_c_time_pushes, 61, GEOMETRY["layers"], blocks, rounds, timeout=600)
            rows.append((blocks, block_bytes, got))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2040)  # (the model takes 2048 positions)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--modes", nargs="+", default=["pull", "push-order", "push-pipelined"])
    parser.add_argument("--calls-only", action="store_true", help="only the per-call cost of push_blocks")
    parser.add_argument("--rounds", type=int, default=20, help="rounds of the per-call cost")
    args = parser.parse_args()
    os.environ.setdefault("LLM_DATADIST_REQUIRE_VLLM", "1")
    import numpy as np

    from test_vllm import write_model

    print("| push_blocks over tcp, 8 layers | one call per layer | one call, all layers | ratio |")
    print("|---|---|---|---|")
    for blocks, block_bytes, got in per_call_cost(args.rounds):
        print(f"| {blocks} x {block_bytes >> 10} KiB per layer | {got['per_layer_ms']:.2f} ms | "
              f"{got['at_once_ms']:.2f} ms | {got['per_layer_ms'] / got['at_once_ms']:.2f} |")
    if args.calls_only:
        return 0
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, GEOMETRY["vocab"], size=args.tokens).tolist() for _ in range(args.requests)]
    results = {}
    with tempfile.TemporaryDirectory(prefix="push-bench-") as tmp:
        work = Path(os.environ.get("PUSH_BENCH_DIR") or tmp)
        write_model(work / "model", geometry=GEOMETRY)
        for mode in args.modes:
            warm = rng.integers(3, GEOMETRY["vocab"], size=args.tokens).tolist()
            ttfts, stats, after = run_mode(work / "model", work, mode, prompts, warm)
            results[mode] = {"ttft_ms": [t * 1000 for t in ttfts], "stats": stats,
                             "after_prefill_ms": [t * 1000 for t in after]}
            if mode == "push-pipelined":
                timings = push_timings(work, mode)
                results[mode]["timings"] = timings
    pull = statistics.median(results["pull"]["ttft_ms"]) if "pull" in results else float("nan")
    print(f"\n{args.tokens}-token prompts, {GEOMETRY['layers']} layers, hidden {GEOMETRY['hidden']}, "
          f"{args.requests} requests (medians; load {open('/proc/loadavg').read().split()[0]})\n")
    print("| mode | TTFT ms | x pull | decode part after the prefill's answer, ms |")
    print("|---|---|---|---|")
    for mode in args.modes:
        med = statistics.median(results[mode]["ttft_ms"])
        after = results[mode]["after_prefill_ms"]
        print(f"| {mode} | {med:.0f} | {med / pull:.2f} | {statistics.median(after):.0f} |" if after else
              f"| {mode} | {med:.0f} | {med / pull:.2f} | (sent at once) |")
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
