"""Push mode (``transfer_mode: push``) with two live vLLM engines over ``LLMDataDistConnector``.

A plain engine gives the baseline; then a prefill and a decode engine in push mode over ``tcp``
(writes pass the decode engine's write guard) and a link secret:

* NIXL's order (what the toy proxy does): the prompt goes to the prefill engine first, its params
  to the decode engine, which registers its blocks; the prefill worker then pushes every layer.
* The pipelined order: the decode engine gets the request first (params naming only the prefill
  worker), registers its blocks before the prefill engine has seen the request, and the prefill
  worker pushes each layer from ``save_kv_layer`` while the next ones compute.

Both give the baseline's greedy tokens, with every layer of every request pushed exactly once
(``pushed_tokens``), and the decode engine computing nothing of the prompt. Then two engines under
vLLM's OpenAI server behind vLLM's toy proxy, unchanged. Needs vLLM (and the toy proxy:
``LLM_DATADIST_TOY_PROXY``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from test_vllm import GEOMETRY, LINK_SECRET, Engine, close_all, delta, needs_vllm, prompts_of, write_model

pytestmark = needs_vllm

MAX_TOKENS = 6
# NIXL's order: shorter than a block, several blocks; pipelined: several blocks, one prompt
# computed in two chunks on the prefill side (max_num_batched_tokens below)
ORDERED = prompts_of([20, 150], seed=31)
PIPELINED = prompts_of([90, 200], seed=32)
CACHED = prompts_of([96], seed=33)
SERVED = prompts_of([130], seed=34)
ORPHANED = prompts_of([80], seed=36)  # registered with a prefill engine that is then killed
LEASE_S = 20.0
#: A decode request's wait for ``push_done``: ``kv_lease_s`` from its grant (docs/vllm.md,
#: "Failures and bounds"), then ``push_cancel`` (notify, 5 s), plus room for the CPU engines' steps
PUSH_BOUND_S = LEASE_S + 5.0 + 15.0
# (the pipelined order registers without a lease token: the prefill engine opts in to matching it
# by request id; the decode engine ignores the option)
PUSH = {"transfer_mode": "push", "data_plane": "tcp", "link_secret": LINK_SECRET, "kv_lease_s": LEASE_S,
        "push_match_by_request_id": True}


@pytest.fixture(scope="module")
def push_engines(tmp_path_factory, plain_engine):
    """``(baseline tokens by prompt, prefill engine, decode engine)``; the baseline is the session's
    plain engine's (``conftest.py``)."""
    work = tmp_path_factory.mktemp("vllm-push")
    write_model(work / "model")
    started = []
    try:
        everything = ORDERED + PIPELINED + CACHED + SERVED + ORPHANED
        outputs = plain_engine.engine().generate(everything, MAX_TOKENS)
        baseline = {tuple(p): o["token_ids"] for p, o in zip(everything, outputs)}
        # chunked prefill on the prefill side: a 200-token prompt takes two steps
        prefill = Engine(work / "model", "producer", work / "prefill.log", PUSH,
                         {"max_num_batched_tokens": 128, "enable_chunked_prefill": True})
        started.append(prefill)
        # (recompute: a request whose push never comes is computed here, the test's last case)
        decode = Engine(work / "model", "consumer", work / "decode.log", PUSH,
                        {"kv_transfer": {"kv_load_failure_policy": "recompute"}})
        started.append(decode)
        prefill.wait_ready()
        decode.wait_ready()
        yield baseline, prefill, decode
    finally:
        close_all(started)


def _send(engine: Engine, **request) -> None:
    engine.proc.stdin.write(json.dumps(request) + "\n")
    engine.proc.stdin.flush()


def test_push_in_nixl_order_and_pipelined_gives_the_baseline(push_engines):
    from llm_datadist.integrations.vllm.metrics import KINDS

    baseline, prefill, decode = push_engines
    layers = GEOMETRY["layers"]
    p0, d0, t0 = prefill.stats()["stats"], decode.stats()["stats"], decode.prompt_tokens()

    # NIXL's order: prefill first; its params (transfer_mode push, remote_request_id with its
    # lease token) go to the decode engine, whose registration is pushed all layers at once
    outs = prefill.generate(ORDERED, 1, [{"do_remote_decode": True}] * len(ORDERED))
    params = [o["kv_transfer_params"] for o in outs]
    assert all(p["transfer_mode"] == "push" and p["do_remote_prefill"] for p in params)
    got = decode.generate(ORDERED, MAX_TOKENS, params)
    assert [o["token_ids"] for o in got] == [baseline[tuple(p)] for p in ORDERED]
    t1 = decode.prompt_tokens()  # the decode engine computed none of the prompts
    assert delta(t1, t0) == {"local_compute": 0, "local_cache_hit": 0,
                             "external_kv_transfer": sum(map(len, ORDERED))}
    prefill.call(op="step")  # (a step: the held blocks are freed)
    p1, d1 = prefill.stats()["stats"], decode.stats()["stats"]
    moved = delta(p1, p0)
    assert moved["pushed_requests"] == len(ORDERED) and moved["push_failures"] == 0
    assert moved["pushed_layers"] == layers * len(ORDERED)  # every layer exactly once...
    assert moved["pushed_tokens"] == layers * sum(map(len, ORDERED))  # ...of every token
    assert moved["pushed_late"] == len(ORDERED)  # (computed before the decode side registered)
    assert delta(d1, d0)["push_received"] == len(ORDERED) and delta(d1, d0)["push_failed"] == 0

    # pipelined: the decode engine first, naming only the prefill worker; the prefill engine
    # matches its registration by the request's base id and pushes layer by layer
    where = {k: params[0][k] for k in ("remote_host", "remote_port", "remote_cluster_id")}
    names = [f"cmpl-pipelined-{i}" for i in range(len(PIPELINED))]  # (vLLM adds "-<8 hex>" on each side)
    d_params = [dict(where, do_remote_prefill=True, transfer_mode="push")] * len(PIPELINED)
    _send(decode, op="generate", prompts=PIPELINED, max_tokens=MAX_TOKENS, params=d_params,
          names=names)
    deadline = time.monotonic() + 120
    while prefill.stats()["stats"]["push_regs"] < p1["push_regs"] + len(PIPELINED):  # registered first
        assert time.monotonic() < deadline, "the decode engine's registrations did not reach the prefill engine"
        time.sleep(0.1)
    p_outs = prefill.call(op="generate", prompts=PIPELINED, max_tokens=1, params=[{"do_remote_decode": True}] * 2,
                          names=names)
    got = decode._read(240)["outputs"]
    assert [o["token_ids"] for o in got] == [baseline[tuple(p)] for p in PIPELINED]
    assert delta(decode.prompt_tokens(), t1) == {"local_compute": 0, "local_cache_hit": 0,
                                                 "external_kv_transfer": sum(map(len, PIPELINED))}
    assert all(o["kv_transfer_params"]["transfer_mode"] == "push" for o in p_outs["outputs"])
    prefill.call(op="step")
    p2, d2 = prefill.stats()["stats"], decode.stats()["stats"]
    moved = delta(p2, p1)
    assert moved["pushed_requests"] == len(PIPELINED) and moved["push_failures"] == 0
    # layer by layer, each layer of each token once (the 200-token prompt computes in chunks:
    # each step pushes every layer of its tokens)
    assert moved["pushed_late"] == 0 and moved["pushed_tokens"] == layers * sum(map(len, PIPELINED))
    assert moved["pushed_layers"] % layers == 0 and moved["pushed_layers"] > layers * len(PIPELINED)
    assert delta(d2, d1)["push_received"] == len(PIPELINED)
    # nothing was refused by the decode engine's write guard
    assert decode.stats()["stats"].get("push_refused_done", 0) == 0

    # a prompt partly cached on the decode side (its first 64 tokens: two blocks, computed there
    # by a request of its own): only the third block is pushed
    prompt = CACHED[0]
    decode.generate([prompt[:70]], 1)
    p3, t3 = prefill.stats()["stats"], decode.prompt_tokens()
    params = [o["kv_transfer_params"] for o in prefill.generate([prompt], 1, [{"do_remote_decode": True}])]
    assert [o["token_ids"] for o in decode.generate([prompt], MAX_TOKENS, params)] == [baseline[tuple(prompt)]]
    assert delta(decode.prompt_tokens(), t3) == {"local_compute": 0, "local_cache_hit": 64,
                                                 "external_kv_transfer": len(prompt) - 64}
    prefill.call(op="step")
    moved = delta(prefill.stats()["stats"], p3)
    assert moved["pushed_requests"] == 1 and moved["pushed_tokens"] == layers * (len(prompt) - 64)

    # vLLM's series: a push sample per request on the side that pushed (its last ones reach vLLM
    # with a later step), none on the decode side, and no failure of any kind on either
    pushed = len(ORDERED) + len(PIPELINED) + len(CACHED)
    deadline = time.monotonic() + 60
    while True:
        series = prefill.metrics()
        if series.get("vllm:llm_datadist_push_seconds", 0) >= pushed or time.monotonic() > deadline:
            break
        prefill.call(op="step")
    assert series["vllm:llm_datadist_push_seconds"] == pushed, series
    assert series["vllm:llm_datadist_push_blocks"] == pushed and series["vllm:llm_datadist_push_bytes"] == pushed
    decode.generate(prompts_of([8], seed=35), 1)  # (a step takes the decode worker's stats to vLLM's)
    theirs = decode.metrics()
    assert theirs["vllm:llm_datadist_push_seconds"] == 0 and theirs["vllm:llm_datadist_pull_seconds"] == 0
    for kind in KINDS:
        assert series[f"vllm:llm_datadist_failures_{kind}"] == 0 and theirs[f"vllm:llm_datadist_failures_{kind}"] == 0


def test_served_engines_push_behind_vllms_toy_proxy(push_engines, tmp_path):
    """``vllm serve``-style engines (vLLM's OpenAI server) in push mode behind vLLM's own toy proxy,
    unchanged: the prefill engine's loop keeps stepping while it holds the blocks
    (``has_pending_push_work``) and pushes when the decode engine registers; the decode engine's
    greedy tokens equal the baseline's and it computes none of the prompt."""
    import httpx
    from test_vllm import free_port, metric_samples, served_decode_engine
    from test_vllm_leases import require_toy_proxy

    baseline, prefill, _ = push_engines
    proxy = require_toy_proxy()
    model = prefill.log.parent / "model"
    with served_decode_engine(model, tmp_path / "served-prefill.log", PUSH, role="kv_producer") as p_url, \
            served_decode_engine(model, tmp_path / "served-decode.log", PUSH) as d_url:
        port = free_port()
        p_port, d_port = (int(url.rsplit(":", 1)[1]) for url in (p_url, d_url))
        with open(tmp_path / "proxy.log", "w") as log:
            proc = subprocess.Popen([sys.executable, str(proxy), "--port", str(port), "--prefiller-host", "127.0.0.1",
                                     "--prefiller-port", str(p_port), "--decoder-host", "127.0.0.1",
                                     "--decoder-port", str(d_port)], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=240,
                                       json={"model": str(model), "prompt": SERVED[0], "max_tokens": MAX_TOKENS,
                                             "temperature": 0, "return_token_ids": True})
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "proxy.log").read_text()
                    time.sleep(0.5)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["token_ids"] == baseline[tuple(SERVED[0])]
            samples = metric_samples(httpx.get(d_url + "/metrics", timeout=30).text)
            by_source = {dict(labels).get("source"): value for (name, labels), value in samples.items()
                         if name == "vllm:prompt_tokens_by_source_total"}
            assert by_source.get("external_kv_transfer") == len(SERVED[0]) and not by_source.get("local_compute")
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def test_a_killed_prefill_engine_ends_the_wait_for_its_push_within_the_lease(push_engines):
    """(Last in this module: it kills the prefill engine.) The decode engine gets a request first
    (the pipelined order) and registers its blocks with the prefill engine, which is killed
    (SIGKILL) before it has seen the request, so before it pushes: the decode request ends within
    ``PUSH_BOUND_S`` of the kill (its grant ends ``kv_lease_s`` after it was made), is recomputed
    (``kv_load_failure_policy`` ``recompute``) with the baseline's tokens, counts one ``timed_out``,
    and no block stays granted or held on the decode side."""
    baseline, prefill, decode = push_engines
    params = prefill.generate(prompts_of([20], seed=37), 1, [{"do_remote_decode": True}])[0]["kv_transfer_params"]
    where = {k: params[k] for k in ("remote_host", "remote_port", "remote_cluster_id")}
    p0, d0 = prefill.stats()["stats"], decode.stats()["stats"]
    failures = decode.metrics()["vllm:llm_datadist_failures_timed_out"]
    prompt = ORPHANED[0]
    _send(decode, op="generate", prompts=[prompt], max_tokens=MAX_TOKENS,
          params=[dict(where, do_remote_prefill=True, transfer_mode="push")], names=["cmpl-orphaned-0"])
    deadline = time.monotonic() + 120
    while prefill.stats()["stats"]["push_regs"] < p0["push_regs"] + 1:  # registered, never pushed
        assert time.monotonic() < deadline, "the decode engine's registration did not reach the prefill engine"
        time.sleep(0.1)
    os.kill(prefill.proc.pid, signal.SIGKILL)
    prefill.proc.wait(timeout=30)
    start = time.monotonic()
    got = decode._read(PUSH_BOUND_S + 30)["outputs"]
    took = time.monotonic() - start
    print(f"the decode request ended {took:.1f} s after its prefill engine was killed")
    assert took < PUSH_BOUND_S
    assert got[0]["token_ids"] == baseline[tuple(prompt)]
    moved = delta(decode.stats()["stats"], d0)
    assert moved["push_registered"] == 1 and moved["push_failed"] == 1 and moved["push_received"] == 0, moved
    assert decode.metrics()["vllm:llm_datadist_failures_timed_out"] == failures + 1
    assert decode.call(op="kv_usage") == {"usage": 0.0, "requests": 0}
