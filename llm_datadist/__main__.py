"""Command line: ``python -m llm_datadist {demo,info,bench}``."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np

PENDING_TRANSPORT = ("the two-process prefill -> decode demo arrives with the transport layer; "
                     "this build runs the local part of it")


def _info(args: argparse.Namespace) -> int:
    import llm_datadist
    from llm_datadist import _core, _device

    facts = {
        "version": llm_datadist.__version__,
        "python": platform.python_version(),
        "build": "debug" if _core.DEBUG_BUILD else "release",
        "cython": _core.CYTHON_VERSION,
    }
    try:
        runtime, reason = _device.select_runtime()
        facts["device_runtime"] = f"{runtime.name} ({reason})"
    except llm_datadist.LLMException as exc:
        facts["device_runtime"] = f"unusable: {exc}"
    facts["runtimes"] = {name: ("available: " if ok else "not available: ") + why
                         for name, (ok, why) in ((n, _device.probe(n)) for n in ("cpu", "acl", "cuda"))}
    facts["data_planes"] = {"local": "available", "same-host / tcp": "not in this build (transport layer)"}
    if args.json:
        print(json.dumps(facts, indent=2))
    else:
        for key, value in facts.items():
            if isinstance(value, dict):
                print(f"{key}:")
                for sub, text in value.items():
                    print(f"  {sub:8s} {text}")
            else:
                print(f"{key}: {value}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Local demo: a paged KV cache on the device runtime, blocks swapped out to host and back."""
    import llm_datadist as ld

    print(f"note: {PENDING_TRANSPORT}.")
    layers, block_tokens, kv_heads, head_dim = args.layers, args.block_size, 8, 128
    block_bytes = block_tokens * kv_heads * head_dim * 2
    print(f"geometry: {layers} layers x K/V, {args.blocks} blocks of {block_tokens} tokens x "
          f"{kv_heads} KV heads x {head_dim} head dim (fp16) = {block_bytes // 1024} KiB per block")
    cfg = ld.LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    pool = json.dumps({"memory_size": 2 * layers * args.blocks * block_bytes + (1 << 20)})
    cfg.mem_pool_cfg = pool
    cfg.host_mem_pool_cfg = pool
    dd = ld.LLMDataDist(ld.LLMRole.PROMPT, 0)
    dd.init(cfg.generate_options())
    try:
        cm = dd.cache_manager
        shape = [args.blocks, block_tokens, kv_heads, head_dim]
        device = cm.allocate_blocks_cache(ld.CacheDesc(2 * layers, shape, ld.DataType.DT_FLOAT16))
        host = cm.allocate_blocks_cache(ld.CacheDesc(2 * layers, shape, ld.DataType.DT_FLOAT16, ld.Placement.HOST))
        rng = np.random.default_rng(0)
        device_views = device.as_numpy()
        for view in device_views:
            view.view(np.uint16)[...] = rng.integers(0, 2**16, size=view.shape, dtype=np.uint16)
        blocks = rng.permutation(args.blocks)[: args.blocks // 2].tolist()
        start = time.perf_counter()
        cm.swap_blocks(device, host, {b: b for b in blocks})
        elapsed = time.perf_counter() - start
        moved = len(blocks) * 2 * layers * block_bytes
        host_views = host.as_numpy()
        ok = all(np.array_equal(h.view(np.uint16)[blocks], d.view(np.uint16)[blocks])
                 for h, d in zip(host_views, device_views))
        print(f"swap-out: {len(blocks)} blocks x {2 * layers} tensors, {moved / 2**20:.1f} MiB in "
              f"{elapsed * 1e3:.2f} ms ({moved / elapsed / 1e9:.2f} GB/s), runtime {dd._engine.runtime.name}")
        print("verified" if ok else "VERIFICATION FAILED")
        return 0 if ok else 1
    finally:
        dd.finalize()


def _bench(args: argparse.Namespace) -> int:
    print("python -m llm_datadist bench: the plane sweep arrives with the transport layer; "
          "for local copy benchmarks run: python -m pytest bench/ --benchmark-only")
    return 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llm_datadist",
                                     description="KV-cache transfer for disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the demo on built-in defaults")
    demo.add_argument("--layers", type=int, default=32, help="model layers (each has K and V)")
    demo.add_argument("--blocks", type=int, default=64, help="blocks in the paged cache")
    demo.add_argument("--block-size", type=int, default=16, help="tokens per block")
    demo.set_defaults(func=_demo)
    info = sub.add_parser("info", help="version, build, device runtime, data planes")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=_info)
    bench = sub.add_parser("bench", help="throughput sweep (arrives with the transport layer)")
    bench.set_defaults(func=_bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
