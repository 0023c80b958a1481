"""Live engines under load (issue 22, item 4): lease renewal for requests parked in a decode
engine's queue, and a prefill engine killed with SIGKILL while a decode engine pulls from it and
from another one.

Two prefill engines (``kv_lease_s`` 2 s) and one decode engine (``max_num_seqs`` 1,
``kv_lease_s`` 2 s, ``link_timeout_ms`` 3 s, ``kv_load_failure_policy`` ``recompute``), each in its
own process (``vllm_engine.py``), driven as in ``test_vllm.py``; a plain engine (the session's,
``conftest.py``) gives the baseline tokens first.

Needs vLLM (``pip install '.[vllm]'``, the CPU build 0.32.0); skipped without it.
"""

from __future__ import annotations

import json
import math
import time

import pytest
from test_vllm import LINK_SECRET, Engine, close_all, delta, needs_vllm, prompts_of, write_model

pytestmark = needs_vllm

LEASE_S = 2.0
LINK_TIMEOUT_MS = 3000
# The request that holds the decode engine's one slot meanwhile: it may decode up to BLOCKER_TOKENS
# (more than any machine here decodes in HOLD_S) and is aborted once it has run HOLD_S, so that the
# queue outlasts two leases however fast the machine is.
BLOCKER_TOKENS = 2000
HOLD_S = 3 * LEASE_S
MAX_TOKENS = 8
# Six prompts of 200 tokens queued behind a request that holds the one slot (max_num_seqs 1).
QUEUED = prompts_of([200] * 6, seed=21)
BLOCKER = prompts_of([10], seed=20)
# What keeps the prefill engine stepping (so that its leases run out if nobody renews them).
BUSY = prompts_of([10], seed=22)
# Pulled from the prefill engine that lives, before and after the other one is killed.
REFERENCE, LIVE = prompts_of([60, 90, 120, 150], seed=23), prompts_of([60, 90, 120, 150], seed=24)
# Pulled from the prefill engine that is killed; their shape-twins computed locally first.
DEAD, LOCAL = prompts_of([70, 80, 100, 130], seed=25), prompts_of([70, 80, 100, 130], seed=26)
WARM = prompts_of([40], seed=27)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, plain_engine):
    """``(baseline tokens by prompt, prefill engine 1, prefill engine 2, decode engine)``; the baseline
    is the session's plain engine's (``conftest.py``)."""
    work = tmp_path_factory.mktemp("vllm-load")
    write_model(work / "model")
    started = []
    try:
        everything = QUEUED + REFERENCE + LIVE + DEAD + LOCAL + WARM
        outputs = plain_engine.engine().generate(everything, MAX_TOKENS)
        baseline = {tuple(p): o["token_ids"] for p, o in zip(everything, outputs)}
        prefill_extra = {"kv_lease_s": LEASE_S, "link_secret": LINK_SECRET}
        first = Engine(work / "model", "producer", work / "prefill-1.log", prefill_extra)
        started.append(first)
        second = Engine(work / "model", "producer", work / "prefill-2.log", prefill_extra)
        started.append(second)
        decode = Engine(work / "model", "consumer", work / "decode.log",
                        {"kv_lease_s": LEASE_S, "link_timeout_ms": LINK_TIMEOUT_MS, "link_secret": LINK_SECRET},
                        {"max_num_seqs": 1, "max_model_len": 2048,
                         "kv_transfer": {"kv_load_failure_policy": "recompute"}})
        started.append(decode)
        for engine in (first, second, decode):
            engine.wait_ready()
        yield baseline, first, second, decode
    finally:
        close_all(started)


def prefill_for_remote_decode(prefill: Engine, prompts) -> list:
    outputs = prefill.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    return [o["kv_transfer_params"] for o in outputs]


def send(engine: Engine, **request) -> None:
    engine.proc.stdin.write(json.dumps(request) + "\n")
    engine.proc.stdin.flush()


@needs_vllm
def test_requests_queued_longer_than_the_lease_still_pull(cluster):
    """Six prompts queue on the decode engine behind a request that holds its one slot
    (``max_num_seqs`` 1: vLLM asks the connector about a waiting request only when a slot is
    free; it is aborted after ``HOLD_S``) for longer than the prefill engine's 2 s lease, while
    the prefill engine keeps stepping (so that leases nobody renews run out): every one is pulled
    and confirmed, none is refused, no lease expires, and the leases were renewed."""
    baseline, prefill, _, decode = cluster
    params = prefill_for_remote_decode(prefill, QUEUED)
    prefill_before, decode_before = prefill.stats()["stats"], decode.stats()["stats"]
    start = time.monotonic()
    send(decode, op="generate", prompts=BLOCKER + QUEUED, max_tokens=[BLOCKER_TOKENS] + [MAX_TOKENS] * len(QUEUED),
         params=[None] + params, hold_first_s=HOLD_S)
    send(prefill, op="generate", prompts=BUSY, max_tokens=1000, params=None)
    outputs = decode._read(600)["outputs"][1:]
    queued_s = time.monotonic() - start
    prefill._read(600)
    prefill.generate(prompts_of([8], seed=28), 1)  # a step that would expire what ran out meanwhile
    assert queued_s > 2 * LEASE_S, f"the queue lasted {queued_s:.1f} s: too short to need a renewal"
    for prompt, out in zip(QUEUED, outputs):
        assert out["token_ids"] == baseline[tuple(prompt)]
    on_prefill = delta(prefill.stats()["stats"], prefill_before)
    on_decode = delta(decode.stats()["stats"], decode_before)
    assert on_decode["pulled_requests"] == len(QUEUED) and on_decode["failed_requests"] == 0
    assert on_decode["pulled_blocks"] == sum(math.ceil(len(p) / 32) for p in QUEUED)
    assert on_prefill["refused"] == 0 and on_prefill["expired"] == 0 and on_prefill["released"] == len(QUEUED)
    assert on_prefill["lease_renewed"] > 0 and on_decode["renewed"] == on_prefill["lease_renewed"]
    assert on_prefill["renewal_refused"] == 0 and on_decode["renew_failed"] == 0


@needs_vllm
def test_a_killed_prefill_engine_costs_about_one_link_timeout_and_not_the_other_ones_latency(cluster):
    """The decode engine has pulled from both prefill engines (linked to both); the second is
    killed with SIGKILL; then one batch asks for four prompts of each. The second's are
    recomputed (``kv_load_failure_policy`` recompute: the baseline's tokens), after one link
    attempt in all (the rest are settled by the unreachable memory); the first's are pulled; and
    the batch takes less than a batch of the same shape took before the kill (four pulled, four
    computed) plus one link timeout per dead request. (A killed engine's port refuses at once, so
    here the one attempt is quick; ``test_vllm_peers`` times a peer that never answers, where the
    one attempt costs a whole link timeout. The bound is loose because this machine's load makes
    CPU engines' step times vary tenfold.)"""
    baseline, live, doomed, decode = cluster
    warm = decode.generate(WARM, MAX_TOKENS, prefill_for_remote_decode(doomed, WARM))
    assert warm[0]["token_ids"] == baseline[tuple(WARM[0])]
    assert decode.stats()["stats"]["links"] == 2
    # the reference: four pulled from the live engine, four computed locally
    reference = prefill_for_remote_decode(live, REFERENCE)
    start = time.monotonic()
    outputs = decode.generate(REFERENCE + LOCAL, MAX_TOKENS, reference + [None] * len(LOCAL))
    reference_s = time.monotonic() - start
    assert all(o["token_ids"] == baseline[tuple(p)] for p, o in zip(REFERENCE + LOCAL, outputs))

    live_params, dead_params = prefill_for_remote_decode(live, LIVE), prefill_for_remote_decode(doomed, DEAD)
    dead_port = dead_params[0]["remote_port"]
    doomed.proc.kill()
    doomed.proc.wait(timeout=30)
    before, tokens_before = decode.stats()["stats"], decode.prompt_tokens()
    logged = decode.log.stat().st_size
    start = time.monotonic()
    outputs = decode.generate(LIVE + DEAD, MAX_TOKENS, live_params + dead_params)
    mixed_s = time.monotonic() - start

    for prompt, out in zip(LIVE + DEAD, outputs):
        assert out["token_ids"] == baseline[tuple(prompt)], f"prompt of {len(prompt)} tokens"
    moved = delta(decode.stats()["stats"], before)
    assert moved["pulled_requests"] == len(LIVE) and moved["failed_requests"] == len(DEAD)
    sources = delta(decode.prompt_tokens(), tokens_before)
    assert sources["external_kv_transfer"] == sum(len(p) for p in LIVE)
    assert sources["local_compute"] >= sum(len(p) for p in DEAD) - 32 * len(DEAD)  # recomputed
    with open(decode.log, "rb") as log:
        log.seek(logged)
        new = log.read().decode(errors="replace").splitlines()
    dead_lines = [line for line in new if "nothing pulled" in line and f":{dead_port}" in line]
    assert len(dead_lines) == len(DEAD), "\n".join(new)
    # one link attempt for the dead engine; every other request found it remembered
    assert sum("not tried again" not in line for line in dead_lines) == 1, "\n".join(dead_lines)
    assert mixed_s < reference_s + len(DEAD) * LINK_TIMEOUT_MS / 1000, (mixed_s, reference_s)
