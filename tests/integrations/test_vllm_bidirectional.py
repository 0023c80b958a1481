"""Multi-turn KV (``bidirectional_kv_xfer``, issue 35): a decode engine holds a finished request's
blocks for the conversation's next turn under its own lease token, for ``decoder_kv_blocks_ttl``;
the next turn's prefill engine pulls the prefix they hold when it is at least
``kv_recompute_threshold`` tokens and computes only the rest.

The unit tests drive the connector's halves in this process (no engine); the one live test runs a
two-turn conversation through a prefill and a decode engine and compares it with the plain engine.

Needs vLLM (``pip install '.[vllm]'``); skipped without it (``tests/integrations/conftest.py``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from types import SimpleNamespace

import pytest
from test_vllm import BLOCK, LINK_SECRET, Engine, close_all, delta, needs_vllm, prompts_of, write_model

pytestmark = needs_vllm

TTL_S = 600.0
CONSUMER = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_producer=False, is_kv_consumer=True))


def options(**extra):
    from llm_datadist.integrations.vllm.options import Options

    return Options.parse(dict({"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": TTL_S}, **extra))


@contextlib.contextmanager
def decode_worker(**extra):
    from llm_datadist.integrations.vllm.worker import Worker

    worker = Worker(CONSUMER, "decode", options(**extra), None)
    try:
        yield worker
    finally:
        worker.close()


def scheduler_of(worker, name: str, **extra):
    from llm_datadist.integrations.vllm.scheduler import Scheduler

    scheduler = Scheduler(name, options(**extra), BLOCK, producer=True)
    scheduler.set_worker(worker.handshake())
    return scheduler


def finished_decode(scheduler, req_id: str, tokens: list, blocks: list, status=None):
    """``request_finished`` of a decode request that generated up to ``tokens`` (its last one's KV
    not computed, as vLLM leaves it): ``(keep, params)``."""
    from vllm.v1.request import RequestStatus

    request = SimpleNamespace(request_id=req_id, kv_transfer_params={"do_remote_prefill": False, "remote_port": 1},
                              status=status or RequestStatus.FINISHED_STOPPED, all_token_ids=list(tokens),
                              num_computed_tokens=len(tokens) - 1)
    return scheduler.request_finished(request, [list(blocks)])


def next_turn_request(req_id: str, params: dict, prompt: list, scheduler=None):
    request = SimpleNamespace(request_id=req_id, kv_transfer_params=dict(params), prompt_token_ids=list(prompt),
                              num_prompt_tokens=len(prompt))
    if scheduler is not None:
        scheduler.on_new_request(request)
    return request


def confirmed(scheduler, request, answer=None):
    """Ask the decode engine (first call: asked, None) and hand the scheduler its ``answer``
    (default: the held ranks); the second call's result."""
    from llm_datadist.integrations.vllm.meta import LLMDataDistWorkerMetadata

    assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    asked = scheduler.build_connector_meta().reqs_to_ask
    assert list(asked) == [request.request_id]
    params = request.kv_transfer_params
    answer = answer or {"ranks": params["remote_ranks"], "readers_counted": True}
    scheduler.update_connector_output(SimpleNamespace(kv_connector_worker_meta=LLMDataDistWorkerMetadata(
        {request.request_id: answer})))
    return scheduler.get_num_new_matched_tokens(request, 0)


TURN1 = prompts_of([90], seed=40)[0]  # prompt and answer of turn 1: 89 tokens computed, 3 blocks


def test_options_take_nixls_names_and_defaults():
    from llm_datadist.integrations.vllm.options import Options

    plain = Options.parse({})
    assert (plain.bidirectional_kv_xfer, plain.kv_recompute_threshold, plain.decoder_kv_blocks_ttl) == (False, 64, 480)
    for bad in ({"bidirectional_kv_xfer": "yes"}, {"kv_recompute_threshold": -1}, {"kv_recompute_threshold": 1.5},
                {"decoder_kv_blocks_ttl": 0}, {"decoder_kv_blocks_ttl": True}):
        with pytest.raises(ValueError):
            Options.parse(bad)
    with pytest.raises(NotImplementedError, match="push mode"):
        Options.parse({"bidirectional_kv_xfer": True, "transfer_mode": "push"})


def test_a_decode_engine_holds_a_finished_request_under_its_token_until_released():
    from llm_datadist.integrations.vllm import LLMDataDistConnectorMetadata

    with decode_worker() as worker:
        assert worker.producer and worker._listening_port() > 0  # it serves pulls
        scheduler = scheduler_of(worker, "decode")
        before = time.time()
        keep, params = finished_decode(scheduler, "turn1", TURN1, [7, 8, 9, 10])
        assert keep is True
        assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
        assert params["remote_block_ids"] == [7, 8, 9]  # the blocks of its 89 computed tokens
        assert params["remote_num_tokens"] == 89 and len(params["remote_block_hashes"]) == 3
        assert before + TTL_S <= params["remote_blocks_expiry_time"] <= time.time() + TTL_S
        remote_id = params["remote_request_id"]
        assert remote_id.startswith("turn1.") and len(remote_id) > len("turn1.") + 20
        meta = scheduler.build_connector_meta()
        assert meta.reqs_to_send == {"turn1": TTL_S} and meta.blocks_to_send == {"turn1": [7, 8, 9]}
        worker.start(meta)
        # a forged token, another request's id with this token: refused, counted, still held
        for forged in ("turn1", "turn2." + remote_id.rpartition(".")[2], remote_id[:-1] + "x"):
            answer = worker.leases.on_ranks(5, {"op": "ranks", "request_id": forged})
            assert answer["ranks"] is None
            assert worker.leases.on_release(5, {"op": "release", "request_id": forged})["released"] is False
            assert worker.leases.read_guard(5, forged.encode()) is None
        stats = worker.stats
        assert stats["ranks_refused"] == 3 and stats["bad_token"] == 3 and stats["refused_reads"] == 3
        assert stats["leases_held"] == 1 and worker.results().finished_sending == set()
        # the holder of the token: asked, read, released
        assert worker.leases.on_ranks(5, {"op": "ranks", "request_id": remote_id})["ranks"][0]["request_id"] == \
            remote_id
        assert worker.leases.on_release(5, {"op": "release", "request_id": remote_id})["released"] is True
        assert worker.results().finished_sending == {"turn1"} and worker.stats["leases_held"] == 0
        # an aborted request, and an engine without the option, hold nothing
        from vllm.v1.request import RequestStatus
        assert finished_decode(scheduler, "aborted", TURN1, [1, 2, 3], RequestStatus.FINISHED_ABORTED) == \
            (False, None)
        worker.start(LLMDataDistConnectorMetadata())
        plain = scheduler_of(worker, "decode", bidirectional_kv_xfer=False)
        assert finished_decode(plain, "plain", TURN1, [1, 2, 3]) == (False, None)


def test_held_blocks_are_freed_at_the_ttl():
    with decode_worker(decoder_kv_blocks_ttl=0.3) as worker:
        scheduler = scheduler_of(worker, "decode", decoder_kv_blocks_ttl=0.3)
        _, params = finished_decode(scheduler, "turn1", TURN1, [4, 5, 6])
        worker.start(scheduler.build_connector_meta())
        assert worker.leases.read_guard(5, params["remote_request_id"].encode()) is not None  # (no tensors: [])
        deadline = time.monotonic() + 5
        freed = set()
        while not freed and time.monotonic() < deadline:
            time.sleep(0.1)
            freed = worker.results().finished_sending
        assert freed == {"turn1"} and worker.stats["expired"] == 1 and worker.stats["leases_held"] == 0
        # the next turn comes too late: refused at the decode engine, never read
        assert worker.leases.read_guard(5, params["remote_request_id"].encode()) is None
        assert worker.leases.on_ranks(5, {"op": "ranks", "request_id": params["remote_request_id"]})["ranks"] is None
        # and the prefill engine does not even ask once the params say it is (nearly) over
        prefill = scheduler_of(worker, "prefill", decoder_kv_blocks_ttl=0.3)
        request = next_turn_request("turn2", params, TURN1[:89] + [5] * 40)
        assert prefill.get_num_new_matched_tokens(request, 0) == (0, False)
        assert prefill.build_connector_meta().reqs_to_ask == {}


def test_the_next_turns_prefill_pulls_only_a_confirmed_prefix_over_the_threshold():
    with decode_worker() as worker:
        decode = scheduler_of(worker, "decode")
        _, params = finished_decode(decode, "turn1", TURN1, [7, 8, 9])
        prefill = scheduler_of(worker, "prefill", kv_recompute_threshold=16)
        prompt = TURN1 + [11] * 20  # the answer's last token, then the new ones: 110 tokens

        request = next_turn_request("turn2", params, prompt, prefill)
        assert confirmed(prefill, request) == (89, True)
        blocks = SimpleNamespace(get_unhashed_block_ids=lambda: [20, 21, 22])
        prefill.update_state_after_alloc(request, blocks, 89)
        spec = prefill.build_connector_meta().reqs_to_recv["turn2"]
        assert spec.next_turn and spec.awaiting and spec.local_block_ids == [20, 21, 22]
        assert spec.remote_block_ids == [7, 8, 9] and spec.remote_request_id == params["remote_request_id"]
        # asked once: vLLM asking again (a failed allocation, a preemption) pulls nothing twice
        assert prefill.get_num_new_matched_tokens(request, 0) == (0, False)

        # a local prefix hit of one block leaves 57 tokens to pull, into the blocks after it
        request = next_turn_request("hit", params, prompt)
        assert confirmed(prefill, request) == (89, True)
        assert prefill.get_num_new_matched_tokens(request, BLOCK) == (89 - BLOCK, True)
        prefill.update_state_after_alloc(request, SimpleNamespace(get_unhashed_block_ids=lambda: [31, 32]), 57)
        spec = prefill.build_connector_meta().reqs_to_recv["hit"]
        assert spec.local_block_ids == [31, 32] and spec.remote_block_ids == [7, 8, 9]  # paired by their tails

        # fewer than kv_recompute_threshold tokens to pull: computed, and released at once
        request = next_turn_request("short", params, prompt)
        assert prefill.get_num_new_matched_tokens(request, 80) == (0, False)
        spec = prefill.build_connector_meta().reqs_to_recv["short"]
        assert not spec.awaiting and spec.local_block_ids == [] and spec.next_turn

        # the decode engine refuses (a forged or foreign token, freed blocks): computed, released
        request = next_turn_request("refused", params, prompt)
        assert confirmed(prefill, request, {"why": "it refused: no valid lease token"}) == (0, False)
        assert not prefill.build_connector_meta().reqs_to_recv["refused"].awaiting
        assert prefill.get_num_new_matched_tokens(request, 0) == (0, False)

        # aborted while its question is on its way: the question forgotten, the prefix released
        from vllm.v1.request import RequestStatus
        request = next_turn_request("aborted", params, prompt, prefill)
        assert prefill.get_num_new_matched_tokens(request, 0) == (None, False)
        request.status = RequestStatus.FINISHED_ABORTED
        assert prefill.request_finished(request, [[]]) == (False, None)
        meta = prefill.build_connector_meta()
        assert meta.reqs_to_ask == {} and not meta.reqs_to_recv["aborted"].awaiting


def test_a_prompt_takes_only_the_blocks_whose_tokens_it_repeats():
    from llm_datadist.integrations.vllm import bidirectional

    with decode_worker() as worker:
        _, params = finished_decode(scheduler_of(worker, "decode"), "turn1", TURN1, [7, 8, 9])
    edited = TURN1[:40] + [1] + TURN1[41:89] + [2] * 30  # the history edited in its second block
    assert bidirectional.held_prefix(params, edited, BLOCK) == (BLOCK, "")
    assert bidirectional.held_prefix(params, TURN1[:50], BLOCK) == (BLOCK, "")  # a shorter prompt
    assert bidirectional.held_prefix(params, TURN1[:89], BLOCK) == (89, "")
    other = [(t + 1) % 1000 for t in TURN1]
    assert bidirectional.held_prefix(params, other, BLOCK)[0] == 0
    # lies and garbage: nothing taken, never an exception
    lies = [dict(params, remote_num_tokens=10_000), dict(params, remote_num_tokens=True),
            dict(params, remote_num_tokens=-5), dict(params, remote_block_ids=[7, 8]),
            dict(params, remote_block_ids=[7, 8, -9]), dict(params, remote_block_ids="7,8,9"),
            dict(params, remote_block_hashes=None), dict(params, remote_block_hashes=params["remote_block_hashes"][:2]),
            dict(params, remote_block_hashes=[1, 2, 3]), dict(params, remote_block_size=16),
            dict(params, tp_size=2), dict(params, remote_blocks_expiry_time=time.time())]
    for lie in lies:
        taken, why = bidirectional.held_prefix(lie, TURN1, BLOCK)
        assert taken == 0 and why
    assert bidirectional.held_prefix(params, None, BLOCK)[0] == 0  # prompt embeddings
    with decode_worker() as worker:
        prefill = scheduler_of(worker, "prefill")
        for n, lie in enumerate(lies + [dict(params, remote_host=None)]):
            request = next_turn_request(f"lie{n}", dict(lie, _llm_datadist_next_turn=True), TURN1)
            assert prefill.get_num_new_matched_tokens(request, 0) == (0, False)
        assert prefill.build_connector_meta().reqs_to_ask == {}
        # a router that copies our marks into the params does not skip the decode engine's check
        marked = dict(params, _llm_datadist_next_turn=True, _llm_datadist_next_turn_tokens=89)
        request = next_turn_request("marked", marked, TURN1, prefill)
        assert prefill.get_num_new_matched_tokens(request, 0) == (None, False)
        assert list(prefill.build_connector_meta().reqs_to_ask) == ["marked"]


def test_a_prefix_held_by_an_engine_of_another_pipeline_parallel_size_is_computed_not_failed():
    # (a decode engine of pipeline_parallel_size 2, or a router that says so: this engine's worker
    # could pull none of it and would report the load failed, which fails the request)
    with decode_worker() as worker:
        _, params = finished_decode(scheduler_of(worker, "decode"), "turn1", TURN1, [7, 8, 9])
        prefill = scheduler_of(worker, "prefill", kv_recompute_threshold=16)
        pp2 = dict(params, pp_size=2, remote_ranks=params["remote_ranks"] * 2)
        request = next_turn_request("pp2", pp2, TURN1 + [11] * 20, prefill)
        assert prefill.get_num_new_matched_tokens(request, 0) == (0, False)
        meta = prefill.build_connector_meta()
        assert meta.reqs_to_ask == {}
        spec = meta.reqs_to_recv["pp2"]  # released: every worker of the decode engine frees it now
        assert not spec.awaiting and spec.next_turn and len(spec.peers(0, 1)) == 2


def test_kv_not_given_by_the_tokens_alone_is_neither_held_nor_pulled():
    # (a LoRA adapter's KV, an image's: placeholder tokens alike, other KV; a prompt given as
    # embeddings: its token ids are zeros) the block hashes would match another KV of those tokens
    from vllm.v1.request import RequestStatus

    lora = SimpleNamespace(lora_name="adapter", lora_path="/adapters/a")
    image = SimpleNamespace(identifier="img-1", mm_position=SimpleNamespace(offset=3, length=20))
    with decode_worker() as worker:
        decode = scheduler_of(worker, "decode")
        plain = {"lora_request": None, "mm_features": [], "prompt_token_ids": TURN1[:60]}
        for n, extra in enumerate(({"lora_request": lora}, {"mm_features": [image]}, {"prompt_token_ids": None})):
            request = SimpleNamespace(request_id=f"turn1-{n}", kv_transfer_params={"do_remote_prefill": False},
                                      status=RequestStatus.FINISHED_STOPPED, all_token_ids=list(TURN1),
                                      num_computed_tokens=len(TURN1) - 1, **dict(plain, **extra))
            assert decode.request_finished(request, [[7, 8, 9]]) == (False, None)
        assert decode.build_connector_meta().reqs_to_send == {}
        _, params = finished_decode(decode, "turn1", TURN1, [7, 8, 9])
        prefill = scheduler_of(worker, "prefill", kv_recompute_threshold=16)
        for n, extra in enumerate(({"lora_request": lora}, {"mm_features": [image]})):
            request = next_turn_request(f"turn2-{n}", params, TURN1 + [11] * 20, prefill)
            for name, value in extra.items():
                setattr(request, name, value)
            assert prefill.get_num_new_matched_tokens(request, 0) == (0, False)
            meta = prefill.build_connector_meta()
            assert meta.reqs_to_ask == {} and not meta.reqs_to_recv[f"turn2-{n}"].awaiting  # released


def test_a_token_count_too_large_for_a_float_is_refused_not_raised():
    # (JSON carries integers of any size: an exception here would end the prefill engine's step)
    with decode_worker() as worker:
        _, params = finished_decode(scheduler_of(worker, "decode"), "turn1", TURN1, [7, 8, 9])
        prefill = scheduler_of(worker, "prefill")
        for n, huge in enumerate((10 ** 400, 2 ** 1030)):
            request = next_turn_request(f"huge{n}", dict(params, remote_num_tokens=huge), TURN1 + [5] * 80, prefill)
            assert prefill.get_num_new_matched_tokens(request, 0) == (0, False)
            assert not prefill.build_connector_meta().reqs_to_recv[f"huge{n}"].awaiting  # released


def test_unsupported_engines_say_so_at_start():
    from llm_datadist.integrations.vllm.scheduler import Scheduler

    with pytest.raises(NotImplementedError, match="bidirectional_kv_xfer"):
        Scheduler("p", options(), BLOCK, producer=True, tp_size=2)
    with pytest.raises(NotImplementedError, match="bidirectional_kv_xfer"):
        Scheduler("p", options(), BLOCK, producer=True, backoff=1)


# -- live: a prefill and a decode engine, both with bidirectional_kv_xfer ---------------------------------------

THRESHOLD = 16
LIVE_TTL_S = 20.0
ANSWER_TOKENS = 30  # turn 1's answer
NEW_TOKENS = 10  # what turn 2 adds
MAX_TOKENS = 8
#: The prefill engine's lease on a finished request's blocks (short: the killed decode engine's
#: turn is freed at it, and the test waits that long)
PREFILL_LEASE_S = 10.0
#: The bound of a next turn's question to a decode engine (docs/vllm.md, "Failures and bounds":
#: link_timeout_ms + sync_kv_timeout_ms + 10 s with the defaults, and given up 5 s before the
#: prefix's remote_blocks_expiry_time, LIVE_TTL_S after its turn 1), plus room for the CPU engines' steps
ASK_BOUND_S = min((10000 + 30000) / 1000 + 10.0, LIVE_TTL_S - 5.0) + 20.0


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-bidirectional")
    write_model(work / "model")
    extra = {"link_secret": LINK_SECRET, "bidirectional_kv_xfer": True, "kv_recompute_threshold": THRESHOLD,
             "decoder_kv_blocks_ttl": LIVE_TTL_S, "listen_host": "127.0.0.1"}
    started = []
    try:
        prefill = Engine(work / "model", "producer", work / "prefill.log", dict(extra, kv_lease_s=PREFILL_LEASE_S))
        started.append(prefill)
        decode = Engine(work / "model", "consumer", work / "decode.log", extra)
        started.append(decode)
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode
    finally:
        close_all(started)


def test_a_two_turn_conversation_pulls_turn_ones_prefix_back_from_the_decode_engine(two_engines, plain_engine):
    """Turn 1 goes prefill -> decode; the decode engine holds its blocks under its token, and turn 2's
    prefill pulls the prefix they hold (turn 1's prompt and answer) and computes only the new tokens
    (vLLM's own counters), then decodes: the plain engine's greedy tokens both turns. Then: a turn 2
    of a prefix shorter than the threshold is computed and its blocks released; one with a forged
    token is refused by the decode engine and computed; a turn 2 that never comes is freed at the TTL.
    Last, the decode engine that holds a turn 1 is stopped (SIGSTOP) before its turn 2, then,
    continued, killed (SIGKILL) before another's: the prefill engine's question ends unanswered
    within its bound (``ASK_BOUND_S``) each time, the prompt is computed there with the plain
    engine's token, and its own blocks are freed at its lease's end: nothing stays held."""
    prefill, decode = two_engines
    plain = plain_engine.engine()
    first, short, abandoned = prompts_of([50, 6, 60], seed=41)

    def turn(prompt, max_tokens, params=None):
        """Prefill (with ``params``: a next turn's), then decode; (tokens, the decode's params, the
        prefill's prompt-token sources)."""
        before = prefill.prompt_tokens()
        handed = prefill.generate([prompt], 1, [dict(params or {}, do_remote_decode=True)])[0]["kv_transfer_params"]
        sources = delta(prefill.prompt_tokens(), before)
        out = decode.generate([prompt], max_tokens, [handed])[0]
        return out["token_ids"], out["kv_transfer_params"], sources

    # turn 1, and one that never gets a turn 2
    answer, held, _ = turn(first, ANSWER_TOKENS)
    assert answer == plain.generate([first], ANSWER_TOKENS)[0]["token_ids"]
    assert held["do_remote_decode"] is True and held["do_remote_prefill"] is False
    assert held["remote_num_tokens"] == len(first) + ANSWER_TOKENS - 1
    never_answer, never, _ = turn(abandoned, MAX_TOKENS)
    decode_before = decode.stats()["stats"]
    assert decode_before["leases_held"] == 2 and decode_before["expired"] == 0

    # turn 2: only the new tokens (and turn 1's last answer token, whose KV the decode engine never
    # computed) are computed on the prefill engine; the rest came from its own prefix cache and the decode engine
    second = first + answer + prompts_of([NEW_TOKENS], seed=42)[0]
    metrics_before = prefill.metrics()
    tokens, _, sources = turn(second, MAX_TOKENS, held)
    assert tokens == plain.generate([second], MAX_TOKENS)[0]["token_ids"]
    assert sources["local_compute"] == len(second) - held["remote_num_tokens"] == NEW_TOKENS + 1
    assert sources["external_kv_transfer"] > 0
    assert sources["external_kv_transfer"] + sources.get("local_cache_hit", 0) == held["remote_num_tokens"]
    moved = delta(decode.stats()["stats"], decode_before)
    assert moved["released"] == 1 and moved["ranks_answered"] == 1  # turn 1's blocks: asked, read, released
    pulled = delta(prefill.metrics(), metrics_before)
    assert pulled.get("vllm:llm_datadist_bidirectional_blocks", 0) == 1  # one pull recorded as bidirectional

    # a turn 2 with a held prefix of fewer tokens than kv_recompute_threshold: computed, blocks released
    short_answer, short_held, _ = turn(short, 5)
    assert short_held["remote_num_tokens"] == len(short) + 4 < THRESHOLD
    before = decode.stats()["stats"]
    tokens, _, sources = turn(short + short_answer + [7, 8], MAX_TOKENS, short_held)
    assert tokens == plain.generate([short + short_answer + [7, 8]], MAX_TOKENS)[0]["token_ids"]
    assert sources["external_kv_transfer"] == 0
    assert delta(decode.stats()["stats"], before)["released"] == 1

    # a forged token (another request's id with this one's token): refused by the decode engine,
    # counted, and the prompt is computed
    forged = dict(never, remote_request_id="other-request." + never["remote_request_id"].rpartition(".")[2])
    forged["remote_ranks"] = [dict(r, request_id=forged["remote_request_id"]) for r in never["remote_ranks"]]
    third = abandoned + never_answer + [3] * 10  # (35 tokens to pull: over the threshold)
    before = decode.stats()["stats"]
    tokens, _, sources = turn(third, MAX_TOKENS, forged)
    assert tokens == plain.generate([third], MAX_TOKENS)[0]["token_ids"]
    assert sources["external_kv_transfer"] == 0
    refused = delta(decode.stats()["stats"], before)
    assert refused["ranks_refused"] == 1 and refused["released"] == 0

    # the abandoned conversation's blocks (and every other held turn's) are freed within the TTL
    deadline = time.monotonic() + LIVE_TTL_S + 20
    while True:
        decode.generate([[5, 6, 7]], 1)  # (a step: leases expire at steps)
        stats = decode.stats()["stats"]
        if stats["leases_held"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert stats["leases_held"] == 0 and stats["expired"] - decode_before["expired"] >= 1
    assert decode.metrics()["vllm:llm_datadist_expired_leases"] >= 1

    # the decode engine holding a turn 1 is stopped (SIGSTOP) before its turn 2; continued, it
    # holds another and is killed (SIGKILL) before that one's turn 2: each turn 2 asks, gets no
    # answer within its bound, and its prompt is computed on the prefill engine (the turn 1 prompt's
    # blocks from its own cache, the rest computed: nothing pulled) with the plain engine's token.
    # (Each turn 2 comes at once: one within 5 s of the TTL's end would not even ask, and a question
    # to the stopped engine is given up then, 15 s on, before its own 50 s bound.)
    leases_before = prefill.stats()["stats"]

    def lost_turn_two(prompt: list, seed: int, stop, answered: int) -> None:
        answer, held, _ = turn(prompt, ANSWER_TOKENS)
        second = prompt + answer + prompts_of([NEW_TOKENS], seed=seed)[0]
        before, asked = prefill.prompt_tokens(), prefill.stats()["stats"]
        stop()
        start = time.monotonic()
        out = prefill.generate([second], 1, [dict(held, do_remote_decode=True)], timeout=ASK_BOUND_S)[0]
        took = time.monotonic() - start
        print(f"turn 2 after its decode engine was {stop.__name__}: {took:.1f} s")
        assert took < ASK_BOUND_S
        moved = delta(prefill.stats()["stats"], asked)
        # (asked; a stopped engine's non-answer may come after the request gave up on it)
        assert moved["ranks_asked"] == 1 and moved["ranks_unanswered"] >= answered, moved
        assert out["token_ids"] == plain.generate([second], 1)[0]["token_ids"]
        sources = delta(prefill.prompt_tokens(), before)
        assert sources["external_kv_transfer"] == 0
        assert sources["local_compute"] + sources.get("local_cache_hit", 0) == len(second)
        assert sources["local_compute"] > len(second) - len(prompt)  # (the answer, its new tokens)

    def stopped():
        os.kill(decode.proc.pid, signal.SIGSTOP)

    def killed():
        os.kill(decode.proc.pid, signal.SIGKILL)
        decode.proc.wait(timeout=30)

    lost = prompts_of([50, 55], seed=43)
    try:
        lost_turn_two(lost[0], 44, stopped, 0)
    finally:
        os.kill(decode.proc.pid, signal.SIGCONT)
    try:
        lost_turn_two(lost[1], 45, killed, 1)
    finally:
        if decode.proc.poll() is None:
            killed()
    ended = time.monotonic()
    # held on the prefill side: only the two turn 2s' own blocks, for a decode engine that is
    # gone, freed at their lease's end (a step: leases end at steps; the first's may have ended)
    moved = delta(prefill.stats()["stats"], leases_before)
    assert moved["leases_held"] + moved["expired"] == 2, moved
    time.sleep(max(0.0, PREFILL_LEASE_S + 0.5 - (time.monotonic() - ended)))
    prefill.generate([[5, 6, 7]], 1)
    stats = prefill.stats()["stats"]
    assert stats["leases_held"] == 0 and stats["expired"] - leases_before["expired"] == 2
    assert prefill.call(op="kv_usage") == {"usage": 0.0, "requests": 0}
