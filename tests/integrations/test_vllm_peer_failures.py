"""No request waits forever (issue 35, item 6): a decode request whose prefill engine is stopped
(SIGSTOP) or killed (SIGKILL) before or during its pull ends within its bound (docs/vllm.md,
"Failures and bounds"), recomputed with the baseline's tokens under ``kv_load_failure_policy``
``recompute`` and ended without them under ``fail``; a prefill engine whose decode engine was
killed frees the blocks at its lease's end; every case counts its failure kind and leaves no
block held on either side.

One prefill engine (``kv_lease_s`` 3 s) and two decode engines (``link_timeout_ms`` 2 s,
``sync_kv_timeout_ms`` 3 s; one ``recompute`` on the default data plane, which on one host reads
the prefill engine's memory without it, one ``fail`` on ``tcp``, whose reads the prefill engine's
server answers, so that a stopped prefill engine stalls them), each in its own process
(``vllm_engine.py``); the session's plain engine (``conftest.py``) gives the baseline tokens. The
prefill engine is stopped, continued and at last killed; the ``fail`` decode engine is killed.

Needs vLLM (``pip install '.[vllm]'``, the CPU build 0.32.0); skipped without it.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from test_vllm import LINK_SECRET, Engine, close_all, delta, needs_vllm, prompts_of, write_model

pytestmark = needs_vllm

LEASE_S = 3.0
LINK_TIMEOUT_MS = 2000
SYNC_KV_TIMEOUT_MS = 3000
MAX_TOKENS = 8
#: The most a decode request may wait on a stopped or dead prefill engine once its pull starts
#: (docs/vllm.md, "Failures and bounds": two transfers' bounds, a new link's and a notification's),
#: plus room for the CPU engines' own steps on a loaded machine.
BOUND_S = (2 * SYNC_KV_TIMEOUT_MS + 2 * LINK_TIMEOUT_MS) / 1000 + 20.0

WARM = prompts_of([40, 40], seed=60)
STOPPED = prompts_of([70, 100], seed=61)  # pulled while the prefill engine is stopped
ABANDONED = prompts_of([90], seed=62)  # handed to the decode engine that is killed
KILLED = prompts_of([60, 120], seed=63)  # pulled after the prefill engine was killed


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, plain_engine):
    """``(baseline tokens by prompt, prefill engine, decode engine (recompute), decode engine (fail))``."""
    work = tmp_path_factory.mktemp("vllm-peer-failures")
    write_model(work / "model")
    started = []
    try:
        everything = WARM + STOPPED + ABANDONED + KILLED
        outputs = plain_engine.engine().generate(everything, MAX_TOKENS)
        baseline = {tuple(p): o["token_ids"] for p, o in zip(everything, outputs)}
        prefill = Engine(work / "model", "producer", work / "prefill.log",
                         {"kv_lease_s": LEASE_S, "link_secret": LINK_SECRET})
        started.append(prefill)
        decode_extra = {"link_timeout_ms": LINK_TIMEOUT_MS, "sync_kv_timeout_ms": SYNC_KV_TIMEOUT_MS,
                        "link_secret": LINK_SECRET}
        recompute = Engine(work / "model", "consumer", work / "decode-recompute.log", decode_extra,
                           {"kv_transfer": {"kv_load_failure_policy": "recompute"}})
        started.append(recompute)
        fail = Engine(work / "model", "consumer", work / "decode-fail.log", dict(decode_extra, data_plane="tcp"),
                      {"kv_transfer": {"kv_load_failure_policy": "fail"}})
        started.append(fail)
        for engine in started:
            engine.wait_ready()
        # each decode engine links to the prefill engine and pulls once: the later pulls find a link
        for engine, prompt in zip((recompute, fail), WARM):
            out = engine.generate([prompt], MAX_TOKENS, prefill_for_remote_decode(prefill, [prompt]))
            assert out[0]["token_ids"] == baseline[tuple(prompt)]
        yield baseline, prefill, recompute, fail
    finally:
        for engine in started:  # (a stopped engine cannot exit)
            signal_engine(engine, signal.SIGCONT)
        close_all(started)


def signal_engine(engine: Engine, signum: int) -> None:
    if engine.proc.poll() is None:
        os.kill(engine.proc.pid, signum)


def prefill_for_remote_decode(prefill: Engine, prompts) -> list:
    outputs = prefill.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    return [o["kv_transfer_params"] for o in outputs]


def send_generate(engine: Engine, prompts, params) -> None:
    engine.proc.stdin.write(json.dumps({"op": "generate", "prompts": prompts, "max_tokens": MAX_TOKENS,
                                        "params": params}) + "\n")
    engine.proc.stdin.flush()


def kinds(engine: Engine) -> dict:
    """The engine's failure kinds as its /metrics series count them."""
    prefix = "vllm:llm_datadist_failures_"
    return {name[len(prefix):]: value for name, value in engine.metrics().items() if name.startswith(prefix)}


def assert_no_blocks_held(engine: Engine) -> None:
    """vLLM's own count: no KV block of this engine is held by a request, and no request is kept."""
    usage = engine.call(op="kv_usage")
    assert usage == {"usage": 0.0, "requests": 0}, usage


@needs_vllm
def test_a_stopped_prefill_engine_ends_the_pulls_within_their_bound(cluster):
    """The prefill engine hands out two requests to each decode engine and is stopped (SIGSTOP)
    before they pull over the links they already have (the ``fail`` engine's reads stall on the
    stopped server until ``sync_kv_timeout_ms``). Each decode engine's requests end within
    ``BOUND_S``: recomputed with the baseline's tokens under ``recompute``, ended without them under
    ``fail``; each counts a ``timed_out`` or ``peer_unreachable`` failure (the transfer or the
    release did not answer in time, or the new link did not). The prefill engine, continued
    afterwards, frees every block at its lease's end at the latest; nothing stays held anywhere."""
    baseline, prefill, recompute, fail = cluster
    to_recompute = prefill_for_remote_decode(prefill, STOPPED)
    to_fail = prefill_for_remote_decode(prefill, STOPPED)
    kinds_before = {id(e): kinds(e) for e in (recompute, fail)}
    leases_before = prefill.stats()["stats"]
    signal_engine(prefill, signal.SIGSTOP)
    try:
        start = time.monotonic()
        send_generate(recompute, STOPPED, to_recompute)
        send_generate(fail, STOPPED, to_fail)
        recomputed = recompute._read(BOUND_S)["outputs"]
        failed = fail._read(max(1.0, BOUND_S - (time.monotonic() - start)))["outputs"]
        took = time.monotonic() - start
    finally:
        signal_engine(prefill, signal.SIGCONT)
    assert took < BOUND_S
    for prompt, out in zip(STOPPED, recomputed):
        assert out["token_ids"] == baseline[tuple(prompt)]
    for out in failed:  # kv_load_failure_policy "fail": never decoded from blocks that did not arrive
        assert len(out["token_ids"]) < MAX_TOKENS
    for engine in (recompute, fail):
        counted = delta(kinds(engine), kinds_before[id(engine)])
        assert counted["timed_out"] + counted["peer_unreachable"] == len(STOPPED), counted
        assert_no_blocks_held(engine)
    # the prefill engine: each lease ends by release (one that arrived after SIGCONT) or expiry
    time.sleep(LEASE_S + 0.5)
    prefill.generate(prompts_of([8], seed=64), 1)
    moved = delta(prefill.stats()["stats"], leases_before)
    assert moved["released"] + moved["expired"] == 2 * len(STOPPED), moved
    assert prefill.stats()["stats"]["leases_held"] == 0
    assert_no_blocks_held(prefill)


@needs_vllm
def test_a_killed_decode_engine_leaves_no_block_held_past_the_lease(cluster):
    """The ``fail`` decode engine is killed (SIGKILL) right after it was handed a finished
    request, its pull under way or not begun: the prefill engine frees the request's blocks when
    its lease ends (``expired_leases``, ``lease_expired`` on its side) unless the pull released
    them first, and holds no block afterwards."""
    _, prefill, _, fail = cluster
    params = prefill_for_remote_decode(prefill, ABANDONED)
    before = prefill.stats()["stats"]
    send_generate(fail, ABANDONED, params)
    signal_engine(fail, signal.SIGKILL)
    fail.proc.wait(timeout=30)
    time.sleep(LEASE_S + 0.5)
    prefill.generate(prompts_of([8], seed=65), 1)
    moved = delta(prefill.stats()["stats"], before)
    assert moved["released"] + moved["expired"] == 1, moved
    assert prefill.stats()["stats"]["leases_held"] == 0
    assert prefill.metrics()["vllm:llm_datadist_failures_lease_expired"] == prefill.stats()["stats"]["expired"]
    assert_no_blocks_held(prefill)


@needs_vllm
def test_a_killed_prefill_engine_costs_its_requests_one_bound_and_they_are_recomputed(cluster):
    """The prefill engine hands out two requests and is killed (SIGKILL) before the pulls: the
    ``recompute`` decode engine's requests end within ``BOUND_S`` with the baseline's tokens, each
    counting ``peer_unreachable``; no block stays held."""
    baseline, prefill, recompute, _ = cluster
    params = prefill_for_remote_decode(prefill, KILLED)
    signal_engine(prefill, signal.SIGKILL)
    prefill.proc.wait(timeout=30)
    before = kinds(recompute)
    start = time.monotonic()
    outputs = recompute.generate(KILLED, MAX_TOKENS, params, timeout=BOUND_S)
    assert time.monotonic() - start < BOUND_S
    for prompt, out in zip(KILLED, outputs):
        assert out["token_ids"] == baseline[tuple(prompt)]
    counted = delta(kinds(recompute), before)
    assert counted["peer_unreachable"] == len(KILLED), counted
    assert_no_blocks_held(recompute)
