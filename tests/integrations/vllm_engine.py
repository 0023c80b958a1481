"""One vLLM engine in its own process, driven over stdin/stdout with one JSON object a line.

    python vllm_engine.py MODEL_DIR ROLE [EXTRA_CONFIG_JSON [ENGINE_ARGS_JSON]]

(or forked from the tests' server with those arguments: ``forked``).

ROLE is ``plain`` (no connector), ``producer``, ``consumer`` or ``both`` (LLMDataDistConnector); ENGINE_ARGS
are more keyword arguments of ``LLM`` (``shutdown_timeout``, ``max_num_seqs``...; ``kv_transfer``:
more fields of ``KVTransferConfig``, such as ``kv_load_failure_policy``). Requests:
``{"op": "generate", "prompts": [[ids]], "max_tokens": n (or one per prompt), "params": [kv_transfer_params
or null], "names": [request ids] (optional)}``
-> ``{"outputs": [{"token_ids", "kv_transfer_params", "num_cached_tokens"}]}`` (with ``"hold_first_s": s``
the first prompt is aborted once it has run ``s`` seconds, if it has not finished by then: a request that
holds a slot for a set time whatever this machine's speed; its output is then ``{"aborted": true}``);
``{"op": "prompt_tokens"}`` -> vLLM's prompt-token counts by source; ``{"op": "metrics"}`` -> the
connector's Prometheus series (counter values, histogram counts); ``{"op": "vllm_metrics", "prefix": p}``
-> vLLM's own counters whose names begin with ``p``; ``{"op": "kv_blocks", "blocks": [ids], "path": p}``
-> every layer's KV blocks ``ids`` as registered, saved to ``p`` (numpy ``.npz``; in-process engines with
the connector);
``{"op": "stats"}`` -> the worker connector's counters (in-process engines only);
``{"op": "kv_usage"}`` -> vLLM's KV cache usage (0.0 to 1.0: blocks held by requests, its scheduler's
``kv_cache_manager.usage``) and the requests its scheduler still keeps (in-process engines only);
``{"op": "shutdown", "grace_s": s}`` shuts the engine down the way ``vllm serve`` does (its engine core
process gets SIGTERM and ``s`` seconds before it is killed; needs ``VLLM_ENABLE_V1_MULTIPROCESSING=1``)
-> ``{"seconds", "exitcodes"}``; ``{"op": "step"}`` steps the engine once; ``{"op": "exit"}``.
The first line written is ``{"ready": true}`` once the engine is up.
"""

from __future__ import annotations

import json
import os
import sys

#: The engines' environment where the test sets no other.
DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
for key, value in DEFAULTS.items():
    os.environ.setdefault(key, value)

BLOCK_SIZE = 32


def generate_holding_first(llm, prompts, sampling, hold_s: float, names=None) -> list:
    """``llm.generate``'s results, in order, from vLLM's engine stepped here, where the first request is
    aborted (its result None) once it has run ``hold_s`` seconds unfinished (``names``: the requests' ids)."""
    import time
    import uuid

    engine = llm.llm_engine
    tag = uuid.uuid4().hex[:8]
    names = names or [f"hold-{tag}-{i}" for i in range(len(prompts))]
    for name, prompt, params in zip(names, prompts, sampling):
        engine.add_request(name, prompt, params)
    done, start, holding = {}, time.monotonic(), True
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if holding and time.monotonic() - start >= hold_s:
            holding = False
            if names[0] not in done:
                engine.abort_request([names[0]])
    return [done.get(name) for name in names]


def main() -> int:
    model, role = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    engine_args = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    # vLLM's prints, its engine core process's included, must not mix with the replies: they get
    # descriptor 1 pointed at stderr, the replies a (non-inheritable) copy of the original.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs = dict(engine_args)
    transfer = kwargs.pop("kv_transfer", {})
    kwargs.setdefault("max_num_seqs", 8)
    if role != "plain":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LLMDataDistConnector", kv_connector_module_path="llm_datadist.integrations.vllm",
            kv_role={"producer": "kv_producer", "both": "kv_both"}.get(role, "kv_consumer"),
            kv_connector_extra_config=extra,
            **transfer)
    kwargs.setdefault("max_model_len", 1024)
    kwargs.setdefault("block_size", BLOCK_SIZE)
    kwargs.setdefault("enforce_eager", True)  # (pipeline parallelism needs False: test_vllm_pp.PP2)
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", seed=0, disable_log_stats=False, **kwargs)

    def reply(obj) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "exit":
            break
        if request["op"] == "shutdown":
            import time

            client = llm.llm_engine.engine_core
            processes = client.resources.engine_manager.processes
            start = time.monotonic()
            client.shutdown(timeout=request["grace_s"])
            reply({"seconds": time.monotonic() - start, "exitcodes": [p.exitcode for p in processes]})
            continue
        if request["op"] == "step":  # one engine step (a served engine's busy loop steps on its own)
            llm.llm_engine.step()
            reply({"stepped": True})
            continue
        if request["op"] == "prompt_tokens":
            # vLLM's own count of where prompt tokens came from: local_compute, local_cache_hit,
            # external_kv_transfer
            counts = {}
            for metric in llm.get_metrics():
                if metric.name == "vllm:prompt_tokens_by_source":
                    counts[metric.labels.get("source", "")] = int(metric.value)
            reply({"prompt_tokens": counts})
            continue
        if request["op"] == "metrics":
            # the connector's Prometheus series (what /metrics shows): counters' values, histograms' counts
            values = {}
            for metric in llm.get_metrics():
                if metric.name.startswith("vllm:llm_datadist_"):
                    values[metric.name] = int(getattr(metric, "value", getattr(metric, "count", 0)))
            reply({"metrics": values})
            continue
        if request["op"] == "vllm_metrics":
            # vLLM's own counters whose names begin with ``prefix`` (speculative decoding's drafts...)
            values = {}
            for metric in llm.get_metrics():
                if metric.name.startswith(request["prefix"]) and hasattr(metric, "value"):
                    values[metric.name] = values.get(metric.name, 0) + int(metric.value)
            reply({"metrics": values})
            continue
        if request["op"] == "stats":
            from vllm.distributed.kv_transfer import get_kv_transfer_group
            connector = get_kv_transfer_group()
            reply({"stats": connector.stats, "registration": connector.registration})
            continue
        if request["op"] == "kv_usage":
            scheduler = llm.llm_engine.engine_core.engine_core.scheduler
            reply({"usage": scheduler.kv_cache_manager.usage, "requests": len(scheduler.requests)})
            continue
        if request["op"] == "kv_blocks":
            # (in-process engines with the connector) the bytes of KV blocks ``blocks`` of every
            # layer's view as the connector registered it, saved with numpy to ``path`` as
            # {layer name: [blocks, ...] uint8}: what a test compares between engines
            import numpy as np
            import torch
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            arrays = {}
            for cache in get_kv_transfer_group()._worker._classes:
                for name, view in zip(cache.layers, cache.tensors):
                    arrays[name] = np.stack([view[b].contiguous().view(torch.uint8).flatten().numpy()
                                             for b in request["blocks"]])
            np.savez(request["path"], **arrays)
            reply({"layers": sorted(arrays)})
            continue
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
        params = request.get("params") or [None] * len(prompts)
        limits = request["max_tokens"]
        limits = limits if isinstance(limits, list) else [limits] * len(prompts)
        sampling = [SamplingParams(max_tokens=n, temperature=0.0, detokenize=False,
                                   extra_args={"kv_transfer_params": p} if p is not None else None)
                    for p, n in zip(params, limits)]
        if request.get("hold_first_s") is not None or request.get("names"):
            hold = request.get("hold_first_s")
            results = generate_holding_first(llm, prompts, sampling, float("inf") if hold is None else hold,
                                             request.get("names"))
        else:
            results = llm.generate(prompts, sampling, use_tqdm=False)
        if role in ("producer", "both") or extra.get("bidirectional_kv_xfer"):
            # As a served engine's busy loop does after its last request finished: one more step,
            # whose connector metadata hands the finished requests' leases to the workers (their
            # read guards admit tcp/staging pulls of those blocks only from then on). LLM.generate
            # stops stepping when no request is left unfinished. (A decode engine with
            # bidirectional_kv_xfer holds its finished requests' blocks the same way.)
            llm.llm_engine.step()
        reply({"outputs": [{"aborted": True} if r is None else
                           {"token_ids": list(r.outputs[0].token_ids), "kv_transfer_params": r.kv_transfer_params,
                            "num_cached_tokens": r.num_cached_tokens} for r in results]})
    return 0


def forked(argv, env: dict, log: str, channel) -> None:
    """``main`` in a process forked from the tests' server, which has imported vLLM already
    (``forked.py``): first the arguments, the environment and the descriptors it would have been
    started with (``channel`` its stdin and stdout, ``log`` its stderr), and at the end what the
    interpreter runs at exit (vLLM's finalizers: the engine's and the connector's shutdown)."""
    import atexit
    import traceback

    sys.argv = list(argv)
    os.environ.clear()
    os.environ.update(env)
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    os.close(fd)
    os.dup2(channel.fileno(), 0)
    os.dup2(channel.fileno(), 1)
    channel.close()
    sys.stdin = open(0, closefd=False)
    code = 1
    try:
        code = main()
    except BaseException:  # as an uncaught exception ends a script: its traceback, exit status 1
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
