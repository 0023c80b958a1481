"""Tensor parallelism: every prefill rank's address and lease token in ``kv_transfer_params``,
decode rank r pulling from prefill rank r, the listen-port rule, engines of different TP sizes
moving KV head by head (each decode rank pulls its heads' byte range of each block from the prefill
ranks holding them, and each prefill rank frees its blocks after the last of its readers' releases),
and a decode engine that got only NIXL's fields (no ``remote_ranks``) asking prefill rank 0 for them.

The live tests run vLLM CPU engines with ``tensor_parallel_size=2`` (``distributed_executor_backend
="mp"``, gloo) on the tiny model of ``test_vllm``, one P/D pair at a time."""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from test_vllm import (BLOCK, CALL_TIMEOUT_S, GEOMETRY, LINK_SECRET, PRODUCER, Engine, close_all, delta, needs_vllm,
                       prompts_of, release_over_link, write_model)

TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
MAX_TOKENS = 6
#: Prompts for the same-TP pair, the mismatches, and the prefills with other weights.
SAME_TP = prompts_of([40, 70], seed=21)
TP1_TO_TP2 = prompts_of([45], seed=22)
TP2_TO_TP1 = prompts_of([50], seed=23)
OTHER_WEIGHTS = prompts_of([60], seed=24)
OTHER_WEIGHTS_TP1 = prompts_of([55], seed=25)
#: Prompts whose kv_transfer_params reach the decode engine cut to NIXL's fields (no remote_ranks):
#: P TP 2 -> D TP 2, and P TP 2 -> D TP 1.
NIXL_ONLY = prompts_of([60, 35], seed=26)
NIXL_ONLY_TP1 = prompts_of([48], seed=27)
#: Prompts for the model with one KV head (replicated over a TP 2 engine's ranks): P TP 1 -> D TP 2
#: and P TP 2 -> D TP 1.
ONE_HEAD_TP1_TO_TP2 = prompts_of([45, 70], seed=28)
ONE_HEAD_TP2_TO_TP1 = prompts_of([50, 33], seed=29)
START_S = 480  # TP 2 engines on two shared cores start slowly


def rank_params(params: dict, rank: int) -> dict:
    """``params`` as if prefill rank ``rank`` were the only one (for ``release_over_link``)."""
    entry = params["remote_ranks"][rank]
    return dict(params, remote_host=entry["host"], remote_port=entry["port"], remote_cluster_id=entry["cluster_id"],
                remote_request_id=entry["request_id"])


def assert_released_by_decode(params: dict, ranks) -> None:
    """Each of the prefill ``ranks`` has had the request released by its decode side: another release
    with the same token is refused as a repeat (before the prefill engine's next step hands its
    workers the lease, the release waits for it; after it, the blocks are freed)."""
    for rank in ranks:
        answer = release_over_link(rank_params(params, rank))
        assert answer["released"] is False, (rank, answer)
        assert answer["why"] in ("its blocks were already released", "its blocks were already freed (released)"), \
            (rank, answer)


def write_loud_model(path, geometry: dict = None) -> None:
    """The model with other weights whose prompt KV the decode engine cannot fail to notice: with
    ``test_vllm``'s weights a token's attention output is small next to its embedding (flat attention
    over random keys averages random values away), so a decode engine's tokens depend little on its
    prompt's KV; here keys and values are 4 and 16 times as large. ``geometry``: ``write_model``'s."""
    from safetensors.torch import load_file, save_file

    write_model(path, seed=5, geometry=geometry)
    tensors = load_file(str(path / "model.safetensors"))
    for name in tensors:
        if name.endswith("k_proj.weight"):
            tensors[name] = tensors[name] * 4
        elif name.endswith("v_proj.weight"):
            tensors[name] = tensors[name] * 16
    save_file(tensors, str(path / "model.safetensors"))


def start(*engines: Engine) -> None:
    for engine in engines:
        assert engine._read(START_S) == {"ready": True}


@pytest.fixture(scope="module")
def tp_engines(tmp_path_factory, plain_engine):
    """``(work dir, baseline tokens by prompt, prefill TP 2, decode TP 2)``; a test may start more. The
    baseline is the session's plain engine's (``conftest.py``)."""
    work = tmp_path_factory.mktemp("vllm_tp")
    write_model(work / "model")
    write_loud_model(work / "other")
    started = []
    try:
        everything = SAME_TP + TP1_TO_TP2 + TP2_TO_TP1 + OTHER_WEIGHTS + OTHER_WEIGHTS_TP1 + NIXL_ONLY + NIXL_ONLY_TP1
        outputs = plain_engine.engine().generate(everything, MAX_TOKENS)
        baseline = {tuple(p): o["token_ids"] for p, o in zip(everything, outputs)}
        prefill = Engine(work / "model", "producer", work / "prefill2.log",
                         {"kv_lease_s": 300, "link_secret": LINK_SECRET}, TP2)
        started.append(prefill)
        decode = Engine(work / "model", "consumer", work / "decode2.log", {"link_secret": LINK_SECRET}, TP2)
        started.append(decode)
        start(prefill, decode)
        yield work, baseline, prefill, decode
    finally:
        close_all(started)


def prefill(engine: Engine, prompts) -> list:
    outputs = engine.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts), timeout=2 * CALL_TIMEOUT_S)
    return [o["kv_transfer_params"] for o in outputs]


def nixl_only(params: dict) -> dict:
    """``params`` as a router that forwards only NIXL's fields passes them on."""
    from test_vllm_leases import NIXL_FIELDS

    cut = {k: v for k, v in params.items() if k in NIXL_FIELDS}
    assert "remote_ranks" not in cut and "remote_cluster_id" not in cut and "readers_counted" not in cut
    return cut


@needs_vllm
def test_tp2_prefill_to_tp2_decode_pulls_rank_by_rank(tp_engines):
    _, baseline, prefill2, decode2 = tp_engines
    params = prefill(prefill2, SAME_TP)
    for p, prompt in zip(params, SAME_TP):
        assert p["tp_size"] == 2 and len(p["remote_ranks"]) == 2
        ports = [r["port"] for r in p["remote_ranks"]]
        assert len(set(ports)) == 2 and ports[0] == p["remote_port"]  # one listener per rank, rank 0 on top
        assert len({r["cluster_id"] for r in p["remote_ranks"]}) == 2
        ids = [r["request_id"] for r in p["remote_ranks"]]
        assert ids[0] == p["remote_request_id"] and ids[0] != ids[1]  # a lease token per rank
        assert len(p["remote_block_ids"]) == math.ceil(len(prompt) / BLOCK)
    before = decode2.prompt_tokens()

    outputs = decode2.generate(SAME_TP, MAX_TOKENS, params, timeout=2 * CALL_TIMEOUT_S)

    for prompt, out in zip(SAME_TP, outputs):
        assert out["token_ids"] == baseline[tuple(prompt)], f"prompt of {len(prompt)} tokens"
    sources = delta(decode2.prompt_tokens(), before)
    assert sources["local_compute"] == 0 and sources["external_kv_transfer"] == sum(map(len, SAME_TP))
    for p in params:  # each decode rank released its prefill rank
        assert_released_by_decode(p, [0, 1])


@needs_vllm
def test_a_router_of_nixls_fields_only_still_reaches_every_prefill_rank(tp_engines):
    """P TP 2 -> D TP 2 with kv_transfer_params cut to NIXL's fields: the decode engine asks prefill
    rank 0 for the ranks, then pulls rank by rank (the baseline's tokens, no prompt token computed)
    and releases every prefill rank (no lease left to run out)."""
    _, baseline, prefill2, decode2 = tp_engines
    params = prefill(prefill2, NIXL_ONLY)
    before = decode2.prompt_tokens()

    outputs = decode2.generate(NIXL_ONLY, MAX_TOKENS, [nixl_only(p) for p in params], timeout=2 * CALL_TIMEOUT_S)

    for prompt, out in zip(NIXL_ONLY, outputs):
        assert out["token_ids"] == baseline[tuple(prompt)], f"prompt of {len(prompt)} tokens"
    sources = delta(decode2.prompt_tokens(), before)
    assert sources["local_compute"] == 0 and sources["external_kv_transfer"] == sum(map(len, NIXL_ONLY))
    for p in params:
        assert_released_by_decode(p, [0, 1])
    assert "computing the prompt locally" not in decode2.tail(400)


@needs_vllm
def test_different_tp_sizes_move_kv_head_by_head_and_release_every_prefill_rank(tp_engines):
    """P TP 1 -> D TP 2 and P TP 2 -> D TP 1: each decode rank pulls its KV heads' byte range of
    each block from every prefill rank holding some of them; the tokens are the baseline's, no
    prompt token was computed on the decode engine, every prefill rank has been released by each
    of its readers (P TP 1: by both decode ranks, counted) and a TP 1 prefill with other weights
    changes the TP 2 decode's tokens."""
    work, baseline, prefill2, decode2 = tp_engines
    for model, prompts in (("model", TP1_TO_TP2), ("other", OTHER_WEIGHTS_TP1)):
        # (the other weights claim the model's name, which is all the compatibility check knows it by)
        prefill1 = Engine(work / model, "producer", work / f"prefill1_{model}.log",
                          {"kv_lease_s": 300, "link_secret": LINK_SECRET, "model_id": str(work / "model")})
        try:
            start(prefill1)
            params = prefill(prefill1, prompts)
            assert params[0]["tp_size"] == 1 and len(params[0]["remote_ranks"]) == 1
            assert params[0]["readers_counted"] is True
            before = decode2.prompt_tokens()
            outputs = decode2.generate(prompts, MAX_TOKENS, params, timeout=2 * CALL_TIMEOUT_S)
            sources = delta(decode2.prompt_tokens(), before)
            assert sources["local_compute"] == 0 and sources["external_kv_transfer"] == len(prompts[0]), model
            if model == "model":
                assert outputs[0]["token_ids"] == baseline[tuple(prompts[0])]
            else:
                assert outputs[0]["token_ids"] != baseline[tuple(prompts[0])]
            # both decode ranks read prefill rank 0 and released it (readers 2): a third release is refused
            assert_released_by_decode(params[0], [0])
        finally:
            prefill1.close()
    assert "computing the prompt locally" not in decode2.tail(400)
    decode1 = Engine(work / "model", "consumer", work / "decode1.log", {"link_secret": LINK_SECRET})
    try:
        start(decode1)
        params = prefill(prefill2, TP2_TO_TP1)
        before = decode1.prompt_tokens()
        outputs = decode1.generate(TP2_TO_TP1, MAX_TOKENS, params, timeout=2 * CALL_TIMEOUT_S)
        assert outputs[0]["token_ids"] == baseline[tuple(TP2_TO_TP1[0])]
        sources = delta(decode1.prompt_tokens(), before)
        assert sources["local_compute"] == 0 and sources["external_kv_transfer"] == len(TP2_TO_TP1[0])
        assert "computing the prompt locally" not in decode1.tail(200)
        assert_released_by_decode(params[0], [0, 1])  # both by the one decode rank, which read both
        # the same through a router of NIXL's fields only: the decode engine asks rank 0 for the ranks
        params = prefill(prefill2, NIXL_ONLY_TP1)
        before = decode1.prompt_tokens()
        outputs = decode1.generate(NIXL_ONLY_TP1, MAX_TOKENS, [nixl_only(params[0])], timeout=2 * CALL_TIMEOUT_S)
        assert outputs[0]["token_ids"] == baseline[tuple(NIXL_ONLY_TP1[0])]
        sources = delta(decode1.prompt_tokens(), before)
        assert sources["local_compute"] == 0 and sources["external_kv_transfer"] == len(NIXL_ONLY_TP1[0])
        assert "computing the prompt locally" not in decode1.tail(200)
        assert_released_by_decode(params[0], [0, 1])
    finally:
        decode1.close()


@needs_vllm
def test_a_tp2_prefill_with_other_weights_changes_the_tp2_decode(tp_engines):
    """The decode engine continues from what it pulled: KV of other weights gives other tokens."""
    work, baseline, _, decode2 = tp_engines
    other = Engine(work / "other", "producer", work / "prefill_other.log",  # (claiming the model's name)
                   {"kv_lease_s": 300, "link_secret": LINK_SECRET, "model_id": str(work / "model")}, TP2)
    try:
        start(other)
        params = prefill(other, OTHER_WEIGHTS)
        before = decode2.prompt_tokens()
        outputs = decode2.generate(OTHER_WEIGHTS, MAX_TOKENS, params, timeout=2 * CALL_TIMEOUT_S)
        assert delta(decode2.prompt_tokens(), before)["external_kv_transfer"] == len(OTHER_WEIGHTS[0])
        assert outputs[0]["token_ids"] != baseline[tuple(OTHER_WEIGHTS[0])]
        assert_released_by_decode(params[0], [0, 1])
    finally:
        other.close()


@needs_vllm
def test_one_kv_head_replicated_over_tp2_moves_between_tp1_and_tp2(tmp_path):
    """A model with one KV head, which vLLM replicates over a TP 2 engine's ranks, between a TP 1 and
    a TP 2 engine (both ``kv_both``, each the other's prefill engine, prefix caching off): P TP 1 ->
    D TP 2 (both decode ranks read prefill rank 0's head) and P TP 2 -> D TP 1 (the decode rank reads
    prefill rank 0's copy, and releases rank 1's unread one) give the tokens the TP 1 engine computes
    alone (the plain engine of that model: no KV moves for requests without ``kv_transfer_params``),
    compute no prompt token on the decode engine and leave every prefill rank released (P TP 1's at
    the second of its two readers' releases)."""
    write_loud_model(tmp_path / "model", dict(GEOMETRY, kv_heads=1))
    extra, args = {"kv_lease_s": 300, "link_secret": LINK_SECRET}, {"enable_prefix_caching": False}
    tp1 = Engine(tmp_path / "model", "both", tmp_path / "one_head_tp1.log", extra, args)
    tp2 = Engine(tmp_path / "model", "both", tmp_path / "one_head_tp2.log", extra, dict(TP2, **args))
    try:
        start(tp1, tp2)
        prompts = ONE_HEAD_TP1_TO_TP2 + ONE_HEAD_TP2_TO_TP1
        baseline = {tuple(p): o["token_ids"] for p, o in zip(prompts, tp1.generate(prompts, MAX_TOKENS))}
        for prefill_engine, decode_engine, prompts, ranks in ((tp1, tp2, ONE_HEAD_TP1_TO_TP2, [0]),
                                                              (tp2, tp1, ONE_HEAD_TP2_TO_TP1, [0, 1])):
            params = prefill(prefill_engine, prompts)
            assert [(p["tp_size"], p["readers_counted"]) for p in params] == [(len(ranks), True)] * len(prompts)
            before = decode_engine.prompt_tokens()
            outputs = decode_engine.generate(prompts, MAX_TOKENS, params, timeout=2 * CALL_TIMEOUT_S)
            for prompt, out in zip(prompts, outputs):
                assert out["token_ids"] == baseline[tuple(prompt)], (len(ranks), len(prompt))
            sources = delta(decode_engine.prompt_tokens(), before)
            assert sources["local_compute"] == 0 and sources["external_kv_transfer"] == sum(map(len, prompts))
            assert "computing the prompt locally" not in decode_engine.tail(400)
            for p in params:
                assert_released_by_decode(p, ranks)
    finally:
        close_all([tp1, tp2])


# -- without engines ------------------------------------------------------------------------------

def _answers(answers: dict):
    """A step's worker output carrying the answers of prefill engines asked about ranks."""
    from vllm.v1.outputs import KVConnectorOutput

    from llm_datadist.integrations.vllm.meta import LLMDataDistWorkerMetadata

    return KVConnectorOutput(kv_connector_worker_meta=LLMDataDistWorkerMetadata(answers))


def _params(**changes) -> dict:
    ranks = [{"host": "127.0.0.1", "port": 7000 + r, "cluster_id": 10 + r, "request_id": f"req.t{r}"} for r in range(2)]
    params = {"remote_block_ids": [4, 5], "remote_host": "127.0.0.1", "remote_port": 7000, "remote_cluster_id": 10,
              "remote_request_id": "req.t0", "tp_size": 2, "remote_ranks": ranks}
    params.update(changes)
    return params


@needs_vllm
def test_kv_transfer_params_name_every_rank_and_hostile_ones_are_unusable():
    from llm_datadist.integrations.vllm.meta import MAX_TP_SIZE, recv_spec

    spec = recv_spec(_params())
    assert spec.tp_size == 2
    # same TP: decode rank r pulls from (and releases) prefill rank r only
    for rank in (0, 1):
        peers = spec.peers(rank, 2)
        assert [(p.port, p.cluster_id, p.remote_request_id) for p in peers] == [
            (7000 + rank, 10 + rank, f"req.t{rank}")]
    waiting = replace(spec, local_block_ids=[1, 2], awaiting=True)
    assert all(p.awaiting and p.local_block_ids == [1, 2] for p in waiting.peers(1, 2))
    # other TP sizes: nothing is pulled; decode rank r releases prefill ranks p % size == r
    assert [(p.port, p.awaiting, p.local_block_ids) for p in waiting.peers(0, 1)] == [(7000, False, []),
                                                                                     (7001, False, [])]
    assert waiting.peers(3, 4) == []  # a decode rank with no prefill rank of its own
    four = replace(waiting, ranks=waiting.ranks * 2)
    assert [p.port for p in four.peers(1, 2)] == [7001, 7001]
    # rank 0 is where the NIXL-style fields say, should a router rewrite them
    moved = recv_spec(_params(remote_port=8000, remote_request_id="req.moved"))
    assert [(p.port, p.remote_request_id) for p in moved.peers(0, 2)] == [(8000, "req.moved")]
    assert [p.port for p in moved.peers(1, 2)] == [7001]
    # a prefill without remote_ranks or tp_size is TP 1
    plain = recv_spec({k: v for k, v in _params().items() if k not in ("remote_ranks", "tp_size")})
    assert plain.tp_size == 1 and not plain.ranks_unknown
    assert [p.port for p in plain.peers(0, 2)] == [7000] and plain.peers(1, 2) == []
    # tp_size without remote_ranks (a router that forwards only NIXL's fields): rank 0 is known,
    # the others are to be asked for; meanwhile rank 0 is all a decode rank may release
    for stripped in (recv_spec({k: v for k, v in _params().items() if k != "remote_ranks"}),
                     recv_spec(_params(remote_ranks=None))):
        assert stripped.tp_size == 2 and stripped.ranks_unknown and stripped.ranks == ()
        assert [(p.port, p.remote_request_id) for p in stripped.peers(0, 2)] == [(7000, "req.t0")]
        assert stripped.peers(1, 2) == [] and [p.port for p in stripped.peers(0, 1)] == [7000]
    assert not recv_spec(_params()).ranks_unknown
    hostile = [
        _params(tp_size=3), _params(tp_size=True), _params(tp_size=0), _params(tp_size=MAX_TP_SIZE + 1),
        _params(tp_size="2"), _params(tp_size=MAX_TP_SIZE + 1, remote_ranks=None), _params(remote_ranks="ranks"),
        _params(remote_ranks=[{"host": "h", "port": 1, "cluster_id": 1, "request_id": "r"}, 5]),
        _params(remote_ranks=[{"host": "h", "port": 0, "cluster_id": 1, "request_id": "r"}] * 2),
        _params(remote_ranks=[{"host": "h", "port": 1 << 16, "cluster_id": 1, "request_id": "r"}] * 2),
        _params(remote_ranks=[{"host": "h", "port": 1, "cluster_id": -1, "request_id": "r"}] * 2),
        _params(remote_ranks=[{"host": "h", "port": 1, "cluster_id": 1 << 64, "request_id": "r"}] * 2),
        _params(remote_ranks=[{"host": "h", "port": 1, "cluster_id": 1, "request_id": "r" * 10_000}] * 2),
        _params(remote_ranks=[{"host": 5, "port": 1, "cluster_id": 1, "request_id": "r"}] * 2),
        _params(remote_ranks=[{"port": 1, "cluster_id": 1, "request_id": "r"}] * 2),
        _params(remote_ranks=[{"host": "h", "port": "x", "cluster_id": 1, "request_id": "r"}] * 2),
        _params(remote_ranks=[{"host": "h", "port": True, "cluster_id": 1, "request_id": "r"}] * 2),
        _params(remote_ranks=[{"host": "h", "port": 1, "cluster_id": 1, "request_id": None}] * 2),
        _params(remote_ranks=[{}] * MAX_TP_SIZE, tp_size=MAX_TP_SIZE),
    ]
    for params in hostile:
        assert recv_spec(params) is None, params


@needs_vllm
def test_every_rank_gets_its_own_lease_token_and_accepts_only_its_own():
    from llm_datadist.integrations.vllm.options import Options as _Options
    from llm_datadist.integrations.vllm.scheduler import Scheduler as _Scheduler
    from llm_datadist.integrations.vllm.leases import LeaseBook
    from llm_datadist.integrations.vllm.meta import LLMDataDistHandshakeMetadata, recv_spec
    from vllm.v1.request import RequestStatus

    options = _Options.parse({})
    books = [LeaseBook(options) for _ in range(2)]
    scheduler = _Scheduler("prefill", options, 32, producer=False, tp_size=2)
    handshakes = {r: LLMDataDistHandshakeMetadata("prefill", 10 + r, "127.0.0.1", 7000 + r, books[r].key.hex(), r, 2)
                  for r in range(2)}
    request = SimpleNamespace(request_id="req-1", kv_transfer_params={"do_remote_decode": True},
                              status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=40)
    scheduler.set_workers({0: handshakes[0]})  # not every rank yet: nothing is handed out
    assert scheduler.request_finished(request, [[1, 2]]) == (False, None)
    scheduler.set_workers(handshakes)
    keep, params = scheduler.request_finished(request, [[1, 2]])
    assert keep and params["tp_size"] == 2 and recv_spec(params).tp_size == 2
    assert [(r["port"], r["cluster_id"]) for r in params["remote_ranks"]] == [(7000, 10), (7001, 11)]
    for book in books:
        book.take_leases({"req-1": 60.0}, stopping=False)
    ids = [r["request_id"] for r in params["remote_ranks"]]
    # rank 1 refuses rank 0's token and the bare id; each accepts its own once
    assert books[1].on_release(9, {"op": "release", "request_id": ids[0]})["released"] is False
    assert books[1].on_release(9, {"op": "release", "request_id": "req-1"})["released"] is False
    for book, remote_id in zip(books, ids):
        assert book.on_release(9, {"op": "release", "request_id": remote_id})["released"] is True
        assert book.take_finished() == {"req-1"}
    # a decode engine of another TP size computes the prompt and releases every rank
    decode = _Scheduler("decode", options, 32, producer=False, tp_size=1)
    incoming = SimpleNamespace(request_id="d-1", kv_transfer_params=dict(params), prompt_token_ids=list(range(40)))
    assert decode.get_num_new_matched_tokens(incoming, 0) == (0, False)
    sent = decode.build_connector_meta().reqs_to_recv["d-1"]
    assert not sent.awaiting and [p.remote_request_id for p in sent.peers(0, 1)] == ids
    with pytest.raises(ValueError, match="rank 1 carries no lease key"):
        scheduler.set_workers({0: handshakes[0], 1: LLMDataDistHandshakeMetadata("prefill", 11, "h", 1)})


@needs_vllm
def test_a_prefill_engine_frees_blocks_only_when_every_rank_was_released():
    """The lease books of two prefill ranks (what each rank's worker reports as ``finished_sending``)
    behind one scheduler, their step results aggregated the way vLLM aggregates its workers'
    (``KVOutputAggregator``, one report per rank). (One process holds one llm_datadist engine, so
    the ranks' books stand in for their workers here; the live tests run whole ones.)"""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    from llm_datadist.integrations.vllm.leases import LeaseBook
    from llm_datadist.integrations.vllm.meta import LLMDataDistHandshakeMetadata
    from llm_datadist.integrations.vllm.options import Options as _Options
    from llm_datadist.integrations.vllm.scheduler import Scheduler as _Scheduler

    options = _Options.parse({"kv_lease_s": 60})
    books = [LeaseBook(options) for _ in range(2)]
    scheduler = _Scheduler("prefill", options, 32, producer=False, tp_size=2)
    scheduler.set_workers({r: LLMDataDistHandshakeMetadata("prefill", 10 + r, "127.0.0.1", 7000 + r,
                                                           books[r].key.hex(), r, 2) for r in range(2)})
    request = SimpleNamespace(request_id="req-1", kv_transfer_params={"do_remote_decode": True},
                              status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=40)
    _, params = scheduler.request_finished(request, [[1, 2]])
    aggregator = KVOutputAggregator(expected_finished_count=2)

    def step() -> set:
        meta = scheduler.build_connector_meta()
        outputs = []
        for book in books:
            book.take_leases(meta.reqs_to_send, meta.stopping)
            sent = KVConnectorOutput(finished_sending=book.take_finished() or None)
            outputs.append(ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=sent))
        return aggregator.aggregate(outputs).kv_connector_output.finished_sending or set()

    assert step() == set()  # both ranks hold the lease
    for rank, book in enumerate(books):
        answer = book.on_release(9, {"op": "release", "request_id": params["remote_ranks"][rank]["request_id"]})
        assert answer["released"] is True
        # rank 0 released: not freed yet; rank 1 too: freed
        assert step() == (set() if rank == 0 else {"req-1"})
    assert step() == set()


# -- rank queries (a router that forwards only NIXL's fields), without engines -------------------------

def _tp2_prefill(**extra):
    """A prefill scheduler of TP size 2 and its ranks' lease books (what each rank's worker holds)."""
    from llm_datadist.integrations.vllm.leases import LeaseBook
    from llm_datadist.integrations.vllm.meta import LLMDataDistHandshakeMetadata
    from llm_datadist.integrations.vllm.options import Options as _Options
    from llm_datadist.integrations.vllm.scheduler import Scheduler as _Scheduler

    options = _Options.parse(dict({"kv_lease_s": 60}, **extra))
    books = [LeaseBook(options) for _ in range(2)]
    scheduler = _Scheduler("prefill", options, 32, producer=False, tp_size=2)
    scheduler.set_workers({r: LLMDataDistHandshakeMetadata("prefill", 10 + r, "127.0.0.1", 7000 + r,
                                                           books[r].key.hex(), r, 2) for r in range(2)})
    return scheduler, books


def _finish(scheduler, req_id: str) -> dict:
    from vllm.v1.request import RequestStatus

    request = SimpleNamespace(request_id=req_id, kv_transfer_params={"do_remote_decode": True},
                              status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=40)
    return scheduler.request_finished(request, [[1, 2]])[1]


def _lease_step(scheduler, books):
    """One prefill step: each rank's worker takes the leases, rank 0 the table of ranks (once)."""
    meta = scheduler.build_connector_meta()
    for rank, book in enumerate(books):
        book.take_leases(meta.reqs_to_send, meta.stopping, meta.blocks_to_send)
        if rank == 0 and meta.rank_table:
            book.set_rank_table(meta.rank_table)
    return meta


def _ask(book, remote_id) -> dict:
    return book.on_message(9, {"op": "ranks", "request_id": remote_id})


def _forged(remote_id: str) -> str:
    """``remote_id`` with the last character of its token changed."""
    return remote_id[:-1] + ("B" if remote_id[-1] == "A" else "A")


@needs_vllm
def test_rank_0_answers_a_rank_query_with_that_requests_ranks_and_nothing_else():
    """A query names the request with rank 0's lease token and gets that request's
    ``remote_ranks``, exactly as handed out, whether its lease has reached the worker yet or not
    (the prefill's next step hands it over). A bare id, a forged token, another request's token on
    this id, another rank's token, an id over the limit, a query to a rank other than 0: refused
    (counted), never another request's ranks; no release is made or refused by a query."""
    from llm_datadist.integrations.vllm.leases import lease_request_id

    scheduler, books = _tp2_prefill()
    first = scheduler.build_connector_meta()  # the step before any request finished
    assert [r["cluster_id"] for r in first.rank_table] == [10, 11]
    assert first.rank_table[1]["lease_key"] == books[1].key.hex()
    books[0].set_rank_table(first.rank_table)
    assert scheduler.build_connector_meta().rank_table is None  # handed over once
    params = {r: _finish(scheduler, r) for r in ("req-1", "req-2")}
    for p in params.values():  # (before the step that hands the leases over)
        assert _ask(books[0], p["remote_request_id"]) == {"request_id": p["remote_request_id"],
                                                          "ranks": p["remote_ranks"], "readers_counted": True}
    _lease_step(scheduler, books)
    for p in params.values():
        assert _ask(books[0], p["remote_request_id"])["ranks"] == p["remote_ranks"]
    one, two = params["req-1"], params["req-2"]
    refusals = [
        (books[0], "req-1", "bad_token"),
        (books[0], _forged(one["remote_request_id"]), "bad_token"),
        (books[0], "req-1." + two["remote_request_id"].rpartition(".")[2], "bad_token"),
        (books[0], one["remote_ranks"][1]["request_id"], "bad_token"),  # rank 1's token: not rank 0's
        (books[0], lease_request_id(os.urandom(32), "req-1"), "bad_token"),  # another engine's
        (books[1], one["remote_ranks"][1]["request_id"], "unknown"),  # rank 1 knows no table
        (books[0], "r" * 10_000, "too_long"),
        (books[0], 12, "malformed"),
    ]
    for book, remote_id, reason in refusals:
        answer = _ask(book, remote_id)
        assert answer["ranks"] is None and answer["refused"] == reason, (remote_id, answer)
        assert set(answer) == {"request_id", "ranks", "refused", "why"}
    assert books[0].stats["ranks_refused"] == 7 and books[1].stats["ranks_refused"] == 1
    assert books[0].stats["ranks_answered"] == 4
    assert books[0].stats["refused"] == books[0].stats["released"] == 0 and set(books[0].held) == {"req-1", "req-2"}


@needs_vllm
def test_a_rank_query_keeps_nothing_and_ends_with_its_lease(monkeypatch):
    """Rank 0 keeps no record per request (its answer is made from the table and the token's issue
    time), so its memory does not grow with queries or leases; a query for a lease that was
    released, expired or freed at shutdown is refused, and so is one whose token is older than a
    lease and its slack (its record gone); an answer over ``MAX_RANKS_ANSWER_BYTES`` is refused; an
    engine without tensor parallelism answers with its own address, and without lease tokens by the
    plain request id."""
    import tracemalloc

    from llm_datadist.integrations.vllm import leases
    from llm_datadist.integrations.vllm.leases import MAX_RANKS_ANSWER_BYTES, LeaseBook, lease_request_id
    from llm_datadist.integrations.vllm.options import Options as _Options

    scheduler, books = _tp2_prefill()
    params = {r: _finish(scheduler, r) for r in ("a", "b", "c", "d")}
    _lease_step(scheduler, books)
    book = books[0]
    assert book.on_release(9, {"op": "release", "request_id": params["a"]["remote_request_id"]})["released"]
    book.held["b"] = time.monotonic() - 1  # its lease ran out
    assert book.take_finished() == {"a", "b"}
    assert book.take_leases({}, stopping=True) == 2  # c and d: freed at shutdown
    for name, why in (("a", "released"), ("b", "lease ended"), ("c", "the engine is shutting down")):
        answer = _ask(book, params[name]["remote_request_id"])
        assert answer["refused"] == "freed" and why in answer["why"], (name, answer)
    # a token older than a lease and the records' slack: refused without a record
    old = lease_request_id(book.key, "e", int(time.time() - 60 - leases._RECORD_SLACK_S - 5))
    assert _ask(book, old)["refused"] == "ended"

    # queries keep nothing: thousands of them leave the book as it was
    scheduler, books = _tp2_prefill()
    params = [_finish(scheduler, f"r{i}") for i in range(50)]
    _lease_step(scheduler, books)
    book = books[0]
    before = (len(book.held), len(book.blocks), len(book.gone), len(book.released), book.record_bytes)
    tracemalloc.start()
    try:
        for i in range(4000):
            assert _ask(book, params[i % 50]["remote_request_id"])["ranks"] is not None
            assert _ask(book, _forged(params[i % 50]["remote_request_id"]))["ranks"] is None
        size = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert size < 64 << 10, size
    assert (len(book.held), len(book.blocks), len(book.gone), len(book.released), book.record_bytes) == before

    # an answer too long for a notification reply
    book = LeaseBook(_Options.parse({"kv_lease_s": 60}))
    book.set_rank_table([{"host": "h" * 200, "port": 7000 + r, "cluster_id": r, "lease_key": os.urandom(32).hex()}
                         for r in range(128)])
    answer = _ask(book, lease_request_id(book.key, "x" * 250))
    assert answer["refused"] == "too_large" and str(MAX_RANKS_ANSWER_BYTES) in answer["why"]

    # TP 1: no table; the worker answers with its own address
    solo = LeaseBook(_Options.parse({"kv_lease_s": 60}))
    solo.own_rank = {"host": "10.0.0.1", "port": 7100, "cluster_id": 33}
    remote_id = lease_request_id(solo.key, "s-1")
    assert _ask(solo, remote_id) == {
        "request_id": remote_id, "readers_counted": True,
        "ranks": [{"host": "10.0.0.1", "port": 7100, "cluster_id": 33, "request_id": remote_id}]}
    # without lease tokens any linked peer may ask, by the plain request id (as it may release)
    scheduler, books = _tp2_prefill(lease_tokens=False)
    plain = _finish(scheduler, "s-2")
    _lease_step(scheduler, books)
    assert plain["remote_request_id"] == "s-2" and _ask(books[0], "s-2")["ranks"] == plain["remote_ranks"]


def _decode_request(params: dict, req_id: str = "d-1"):
    return SimpleNamespace(request_id=req_id, kv_transfer_params=dict(params, do_remote_prefill=True),
                           prompt_token_ids=list(range(40)))


@needs_vllm
def test_a_decode_scheduler_asks_prefill_rank_0_for_the_ranks_a_router_dropped(caplog):
    """kv_transfer_params cut to NIXL's fields (no ``remote_ranks``, ``remote_cluster_id`` or
    ``readers_counted``): the decode scheduler says "not yet" (None) and has its rank 0 worker ask,
    once; with the answer it loads exactly as if the ranks had come (same TP size: rank by rank;
    TP 1: head by head), rank 0 still linked by address. An answer that says nothing usable (an
    older release, a refusal, a malformed list, none in time) makes it compute the prompt, with one
    line, and release prefill rank 0 (the rank it knows); a request aborted while asking releases
    it too."""
    from test_vllm_leases import NIXL_FIELDS

    from llm_datadist.integrations.vllm.options import Options as _Options
    from llm_datadist.integrations.vllm.scheduler import Scheduler as _Scheduler
    from llm_datadist.integrations.vllm.worker import read_ranks_reply

    prefill, books = _tp2_prefill()
    full = _finish(prefill, "p-1")
    _lease_step(prefill, books)
    stripped = {k: v for k, v in full.items() if k in NIXL_FIELDS}
    assert "remote_ranks" not in stripped and "readers_counted" not in stripped and stripped["tp_size"] == 2

    def asked(decode, request) -> object:
        """Ask until the scheduler hands its worker the question; the spec it asks with."""
        assert decode.get_num_new_matched_tokens(request, 0) == (None, False)
        assert decode.get_num_new_matched_tokens(request, 0) == (None, False)  # asked once
        meta = decode.build_connector_meta()
        assert list(meta.reqs_to_ask) == [request.request_id]
        assert decode.build_connector_meta().reqs_to_ask == {}
        return meta.reqs_to_ask[request.request_id]

    for tp_size in (2, 1):
        decode = _Scheduler("decode", _Options.parse({}), 32, producer=False, tp_size=tp_size, kv_heads=4)
        request = _decode_request(stripped)
        spec = asked(decode, request)
        assert spec.ranks_unknown and spec.cluster_id is None
        # (the worker's question, answered here by rank 0's book; the answer comes back with a step)
        answer = read_ranks_reply(_ask(books[0], spec.remote_request_id), spec.remote_request_id)
        decode.update_connector_output(_answers({"d-1": answer, "no-such": answer}))
        assert decode.get_num_new_matched_tokens(request, 0) == (40, True)
        decode.update_state_after_alloc(request, SimpleNamespace(get_unhashed_block_ids=lambda: [7, 8]), 40)
        got = decode.build_connector_meta().reqs_to_recv["d-1"]
        assert got.awaiting and got.readers_counted and not got.ranks_unknown and got.tp_size == 2
        assert request.kv_transfer_params["remote_ranks"] == full["remote_ranks"]
        if tp_size == 2:
            assert [(p.port, p.cluster_id, p.remote_request_id, p.heads) for p in got.peers(1, 2)] == [
                (7001, 11, full["remote_ranks"][1]["request_id"], 0)]
            assert [(p.port, p.cluster_id) for p in got.peers(0, 2)] == [(7000, None)]  # by address
        else:
            assert got.kv_heads == 4
            assert [(p.port, p.heads, p.dst_head) for p in got.peers(0, 1)] == [(7000, 2, 0), (7001, 2, 2)]
        assert decode._asking == {} and decode._answers == {}

    bad_answers = {
        "older": {"why": "it does not answer rank queries (an older release?)"},
        "refused": read_ranks_reply(_ask(books[0], "p-1"), "p-1"),
        "short": {"ranks": full["remote_ranks"][:1], "readers_counted": True},
        "hostile": {"ranks": [{"host": "h", "port": 0, "cluster_id": 1, "request_id": "r"}] * 2},
        "late": None,
    }
    assert "refused" in bad_answers["refused"]["why"]
    for name, answer in bad_answers.items():
        decode = _Scheduler("decode", _Options.parse({}), 32, producer=False, tp_size=2, kv_heads=4)
        request = _decode_request(stripped)
        asked(decode, request)
        if answer is None:
            decode.ask_s = 0.0
        else:
            decode.update_connector_output(_answers({"d-1": answer}))
        caplog.clear()
        assert decode.get_num_new_matched_tokens(request, 0) == (0, False), name
        lines = [r.getMessage() for r in caplog.records if "computing the prompt locally" in r.getMessage()]
        assert len(lines) == 1 and "tensor parallel ranks" in lines[0], (name, lines)
        assert request.kv_transfer_params["do_remote_prefill"] is False
        sent = decode.build_connector_meta().reqs_to_recv["d-1"]
        assert not sent.awaiting
        assert [(p.port, p.remote_request_id) for p in sent.peers(0, 2)] == [(7000, full["remote_request_id"])]
        assert sent.peers(1, 2) == []

    # aborted while asking: rank 0 is released, and the answer that comes later is dropped
    decode = _Scheduler("decode", _Options.parse({}), 32, producer=False, tp_size=2, kv_heads=4)
    request = _decode_request(stripped)
    asked(decode, request)
    assert decode.request_finished(request, []) == (False, None)
    assert [p.port for p in decode.build_connector_meta().reqs_to_recv["d-1"].peers(0, 2)] == [7000]
    decode.update_connector_output(_answers({"d-1": {"why": "late"}}))
    assert decode._asking == {} and decode._answers == {}


@needs_vllm
def test_a_queued_request_is_asked_about_on_arrival_and_renewed_at_every_rank():
    """A request cut to NIXL's fields that waits in the decode engine's queue is asked about when it
    arrives (``on_new_request``), not when a slot frees; with the answer it is parked again with
    every rank, so decode rank 1 renews prefill rank 1's lease too. Rank 0 answers for a lease it
    still holds however old its token (its decode side has been renewing it)."""
    from test_vllm_leases import NIXL_FIELDS

    from llm_datadist.integrations.vllm.options import Options as _Options
    from llm_datadist.integrations.vllm.scheduler import Scheduler as _Scheduler
    from llm_datadist.integrations.vllm.worker import read_ranks_reply

    prefill, books = _tp2_prefill()
    full = _finish(prefill, "p-1")
    _lease_step(prefill, books)
    stripped = {k: v for k, v in full.items() if k in NIXL_FIELDS}
    decode = _Scheduler("decode", _Options.parse({}), 32, producer=False, tp_size=2, kv_heads=4)
    request = _decode_request(stripped)
    decode.on_new_request(request)
    meta = decode.build_connector_meta()
    assert list(meta.reqs_to_ask) == ["d-1"] and list(meta.reqs_parked) == ["d-1"]
    assert [p.port for p in meta.reqs_parked["d-1"].peers(0, 2)] == [7000] and \
        meta.reqs_parked["d-1"].peers(1, 2) == []  # only rank 0 is known yet
    # the lease is held and renewed past the token's age limit: rank 0 still answers
    monkey_time = time.time() + 3600
    real_time = time.time
    try:
        time.time = lambda: monkey_time
        answer = read_ranks_reply(_ask(books[0], full["remote_request_id"]), full["remote_request_id"])
    finally:
        time.time = real_time
    assert "ranks" in answer, answer
    decode.update_connector_output(_answers({"d-1": answer}))
    parked = decode.build_connector_meta().reqs_parked["d-1"]
    assert [(p.port, p.remote_request_id) for p in parked.peers(1, 2)] == [
        (7001, full["remote_ranks"][1]["request_id"])]
    # when a slot frees, it loads with the answer it already has
    assert decode.get_num_new_matched_tokens(request, 0) == (40, True)
    assert request.kv_transfer_params["remote_ranks"] == full["remote_ranks"]


@needs_vllm
def test_a_decode_worker_asks_prefill_rank_0_over_its_link():
    """Real links (the prefill worker in a child process, standing for rank 0 of a TP 2 engine):
    the decode worker links by address, asks with rank 0's release id, and hands the scheduler
    the ranks; a forged id is refused, and a prefill engine of the release before rank queries says
    nothing usable."""
    from test_vllm_leases import NIXL_FIELDS
    from test_vllm_peers import CONSUMER, prefill_child, wait_for, worker

    from llm_datadist.integrations.vllm import LLMDataDistConnectorMetadata
    from llm_datadist.integrations.vllm.meta import recv_spec

    def ask(decode, specs: dict) -> dict:
        meta = LLMDataDistConnectorMetadata()
        meta.reqs_to_ask = specs
        decode.start(meta)
        answers = {}

        def answered() -> bool:
            taken = decode.take_worker_meta()
            answers.update(taken.answers if taken is not None else {})
            return len(answers) == len(specs)

        wait_for(answered, 60, "no answer")
        return answers

    with prefill_child(kv_lease_s=60) as prefill, worker(CONSUMER) as decode:
        full = prefill.call("hand_out_tp", ["p-1", "p-2"], 60)
        assert all(p["tp_size"] == 2 and len(p["remote_ranks"]) == 2 for p in full.values())
        stripped = recv_spec({k: v for k, v in full["p-1"].items() if k in NIXL_FIELDS})
        forged = replace(stripped, remote_request_id=_forged(full["p-2"]["remote_request_id"]))
        answers = ask(decode, {"d-1": stripped, "d-2": forged})
        assert answers["d-1"] == {"ranks": full["p-1"]["remote_ranks"], "readers_counted": True}
        assert answers["d-2"]["why"].startswith("it refused: no valid lease token")
        prefill.call("act_older")
        answers = ask(decode, {"d-3": recv_spec({k: v for k, v in full["p-2"].items() if k in NIXL_FIELDS})})
        assert answers["d-3"] == {"why": "it does not answer rank queries (an older release?)"}
        stats = prefill.call("stats")
        assert (stats["ranks_answered"], stats["ranks_refused"], stats["released"]) == (1, 1, 0)
        assert decode.stats["links"] == 1 and decode.stats["ranks_asked"] == 3
        assert decode.stats["ranks_unanswered"] == 2 and decode.take_worker_meta() is None


def _free_port_run(count: int) -> int:
    """A port p with p .. p + count - 1 free now (for the fixed-port rule)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count >= 65536:
            continue
        try:
            socks = [socket.socket() for _ in range(count)]
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no run of free ports")


@needs_vllm
def test_a_fixed_listen_port_is_offset_by_dp_and_tp_rank(monkeypatch):
    """Rank (dp, tp) listens on listen_port + dp * tp_size + tp; a fixed cluster id is offset alike;
    with pipeline parallelism worker (dp, pp, tp) on listen_port + dp * pp_size * tp_size + pp *
    tp_size + tp."""
    from llm_datadist.integrations.vllm import stages
    from llm_datadist.integrations.vllm import worker as worker_module
    from llm_datadist.integrations.vllm.options import Options as _Options

    base = _free_port_run(12)
    for dp, pp, tp, pp_size in ((0, 0, 0, 1), (0, 0, 1, 1), (2, 0, 1, 1), (0, 1, 0, 2), (1, 1, 1, 2)):
        monkeypatch.setattr(worker_module, "parallel_ranks", lambda config, tp=tp, dp=dp: (tp, 2, dp))
        monkeypatch.setattr(stages, "pipeline_ranks", lambda config, pp=pp, pp_size=pp_size: (pp, pp_size))
        worker = worker_module.Worker(PRODUCER, "e", _Options.parse({"listen_port": base, "cluster_id": 100}), None)
        try:
            shake = worker.handshake()
            offset = dp * 2 * pp_size + pp * 2 + tp
            assert (shake.port, shake.cluster_id, shake.tp_rank, shake.tp_size, shake.pp_rank, shake.pp_size) == \
                (base + offset, 100 + offset, tp, 2, pp, pp_size)
        finally:
            worker.close()
    monkeypatch.setattr(stages, "pipeline_ranks", lambda config: (0, 1))
    monkeypatch.setattr(worker_module, "parallel_ranks", lambda config: (1, 2, 3))
    worker = worker_module.Worker(PRODUCER, "e", _Options.parse({}), None)  # port 0: any free port
    try:
        assert worker.handshake().port > 0
    finally:
        worker.close()


# -- different TP sizes, without engines ------------------------------------------------------------

@needs_vllm
@pytest.mark.parametrize("prefill_tp, decode_tp, expected", [
    # decode rank -> [(prefill rank, first head there, first head here, heads, readers)], 4 KV heads
    (1, 2, [[(0, 0, 0, 2, 2)], [(0, 2, 0, 2, 2)]]),
    (2, 1, [[(0, 0, 0, 2, 1), (1, 0, 2, 2, 1)]]),
    (2, 4, [[(0, 0, 0, 1, 2)], [(0, 1, 0, 1, 2)], [(1, 0, 0, 1, 2)], [(1, 1, 0, 1, 2)]]),
    (4, 2, [[(0, 0, 0, 1, 1), (1, 0, 1, 1, 1)], [(2, 0, 0, 1, 1), (3, 0, 1, 1, 1)]]),
])
def test_each_decode_rank_pulls_its_heads_from_the_prefill_ranks_holding_them(prefill_tp, decode_tp, expected):
    """The head ranges (and, with 64-byte heads, the byte offsets and lengths in each block) of
    every decode rank; together they cover every head once, and each prefill rank's readers are the
    decode ranks that read it."""
    from llm_datadist.integrations.vllm.meta import head_overlaps, recv_spec

    heads = 4
    got = [head_overlaps(heads, prefill_tp, decode_tp, r) for r in range(decode_tp)]
    assert got == expected
    covered = sorted(p * heads // prefill_tp + src + k for rank in got for p, src, _, count, _ in rank
                     for k in range(count))
    assert covered == list(range(heads))
    for p in range(prefill_tp):
        readers = [r for r, rank in enumerate(got) if any(o[0] == p for o in rank)]
        assert all(o[4] == len(readers) for rank in got for o in rank if o[0] == p)
    # the specs the worker pulls with: addressed to the prefill rank, awaiting, in bytes of a 64-byte head
    ranks = [{"host": "127.0.0.1", "port": 7000 + r, "cluster_id": 10 + r, "request_id": f"req.t{r}"}
             for r in range(prefill_tp)]
    spec = recv_spec(_params(tp_size=prefill_tp, remote_ranks=ranks, remote_port=7000, remote_request_id="req.t0",
                             readers_counted=True))
    assert spec.readers_counted
    waiting = replace(spec, local_block_ids=[1, 2], awaiting=True, kv_heads=heads)
    for rank in range(decode_tp):
        peers = waiting.peers(rank, decode_tp)
        assert [(p.port, p.remote_request_id) for p in peers] == [(7000 + o[0], f"req.t{o[0]}") for o in expected[rank]]
        assert all(p.awaiting and p.local_block_ids == [1, 2] for p in peers)
        assert [(p.src_head * 64, p.dst_head * 64, p.heads * 64, p.readers) for p in peers] == \
            [(src * 64, dst * 64, count * 64, readers) for _, src, dst, count, readers in expected[rank]]
    # not awaiting (nothing to load), or no head split (kv_heads 0): releases only, p % size == rank
    for other in (replace(waiting, awaiting=False), replace(waiting, kv_heads=0)):
        for rank in range(decode_tp):
            assert [(p.port, p.awaiting, p.heads, p.readers) for p in other.peers(rank, decode_tp)] == \
                [(7000 + p, False, 0, 1) for p in range(prefill_tp) if p % decode_tp == rank]


def _shardable(kv_heads: int, most: int = 16) -> list:
    """The TP sizes up to ``most`` vLLM can shard ``kv_heads`` KV heads over (``meta.split_refusal``)."""
    return [tp for tp in range(1, most + 1) if kv_heads % tp == 0 or tp % kv_heads == 0]


@needs_vllm
def test_every_decode_head_is_read_once_and_every_prefill_rank_released_as_often_as_it_expects():
    """Every pair of different TP sizes over 1..8 KV heads that vLLM can shard, replicated heads
    included (vLLM's ``QKVParallelLinear``: a rank of TP t > H holds head ``r // (t / H)``): each
    decode rank's blocks, filled by its pulls' byte ranges from blocks whose heads are their head
    numbers, hold exactly its heads, each read once from one prefill rank holding it; every prefill
    rank is addressed by at least one decode rank, and by exactly as many as the ``readers`` each of
    their releases carries (it frees its blocks at that many releases); a replica nobody reads is
    released once, by a decode rank that pulls nothing from it; decode replicas spread over the
    prefill replicas of their head."""
    import numpy as np

    from llm_datadist.integrations.vllm.meta import held_heads, recv_spec, split_refusal

    cases = 0
    for heads in range(1, 9):
        for prefill_tp in _shardable(heads):
            ranks = [{"host": "127.0.0.1", "port": 7000 + r, "cluster_id": 10 + r, "request_id": f"req.t{r}"}
                     for r in range(prefill_tp)]
            spec = recv_spec(_params(tp_size=prefill_tp, remote_ranks=ranks, remote_port=7000,
                                     remote_request_id="req.t0", readers_counted=True))
            waiting = replace(spec, local_block_ids=[1], awaiting=True, kv_heads=heads)
            blocks = [np.array(held_heads(heads, prefill_tp, p)) for p in range(prefill_tp)]
            for decode_tp in _shardable(heads):
                if decode_tp == prefill_tp:
                    continue
                cases += 1
                assert split_refusal(heads, prefill_tp, decode_tp) == ""
                releases, reads = {}, {}  # prefill rank -> the readers each release says; its readers
                for rank in range(decode_tp):
                    mine = held_heads(heads, decode_tp, rank)
                    block = np.full(len(mine), -1)
                    for peer in waiting.peers(rank, decode_tp):
                        p = peer.port - 7000
                        releases.setdefault(p, []).append(peer.readers)
                        reads.setdefault(p, [])
                        if not peer.awaiting:  # a replica nobody reads: released only
                            assert peer.heads == 0 and peer.local_block_ids == [] and peer.readers == 1
                            continue
                        assert peer.heads > 0 and 0 <= peer.src_head and peer.src_head + peer.heads <= len(blocks[p])
                        assert (block[peer.dst_head:peer.dst_head + peer.heads] == -1).all()  # read once
                        reads[p].append(rank)
                        block[peer.dst_head:peer.dst_head + peer.heads] = \
                            blocks[p][peer.src_head:peer.src_head + peer.heads]
                    assert block.tolist() == list(mine), (heads, prefill_tp, decode_tp, rank)
                assert sorted(releases) == list(range(prefill_tp)), (heads, prefill_tp, decode_tp)
                for p, told in releases.items():
                    assert told == [len(told)] * len(told), (heads, prefill_tp, decode_tp, p)
                # the readers of a head spread over its prefill replicas: their counts differ by one at most
                for head in range(heads):
                    read = [len(reads[p]) for p in range(prefill_tp) if held_heads(heads, prefill_tp, p) == range(
                        head, head + 1)]
                    assert not read or max(read) - min(read) <= 1, (heads, prefill_tp, decode_tp, head, read)
    assert cases > 60


@needs_vllm
def test_a_decode_engine_of_another_tp_size_pulls_only_when_vllm_can_shard_the_heads():
    """The scheduler's choice: pull head by head (kv_heads set on the request's spec; replicated
    heads too), or compute the prompt locally with a line saying why (an older prefill engine that
    frees at the first release; KV heads and a TP size neither of which divides the other, which
    vLLM cannot shard)."""
    from llm_datadist.integrations.vllm.meta import split_refusal
    from llm_datadist.integrations.vllm.options import Options as _Options
    from llm_datadist.integrations.vllm.scheduler import Scheduler as _Scheduler

    assert split_refusal(4, 1, 2) == "" and split_refusal(4, 4, 2) == ""
    assert split_refusal(2, 1, 4) == split_refusal(1, 2, 1) == split_refusal(2, 8, 4) == ""  # replicated heads
    assert "4 KV heads and tensor parallel size 3 do not divide one another" in split_refusal(4, 3, 1)
    assert "tensor parallel size 3 do not divide" in split_refusal(2, 1, 3)
    assert "does not know" in split_refusal(0, 1, 2)

    def ask(kv_heads: int, prefill_tp: int = 1, **changes):
        decode = _Scheduler("decode", _Options.parse({}), 32, producer=False, tp_size=2, kv_heads=kv_heads)
        ranks = [{"host": "127.0.0.1", "port": 7000 + r, "cluster_id": 10 + r, "request_id": f"req.t{r}"}
                 for r in range(prefill_tp)]
        params = _params(tp_size=prefill_tp, remote_ranks=ranks, remote_block_ids=[4, 5], do_remote_prefill=True,
                         **changes)
        request = SimpleNamespace(request_id="d-1", kv_transfer_params=params, prompt_token_ids=list(range(40)))
        matched = decode.get_num_new_matched_tokens(request, 0)
        if matched[0] is None:
            # no readers_counted: the prefill engine is asked whether it counts them; here it is
            # an older release, which does not answer that
            assert set(decode.build_connector_meta().reqs_to_ask) == {"d-1"}
            decode.update_connector_output(_answers({"d-1": {"why": "an older release"}}))
            matched = decode.get_num_new_matched_tokens(request, 0)
        if matched[1]:
            blocks = SimpleNamespace(get_unhashed_block_ids=lambda: [7, 8])
            decode.update_state_after_alloc(request, blocks, matched[0])
        return matched, decode.build_connector_meta().reqs_to_recv["d-1"]

    matched, spec = ask(4, readers_counted=True)
    assert matched == (40, True) and spec.awaiting and spec.kv_heads == 4
    assert [(p.src_head, p.heads, p.readers) for p in spec.peers(1, 2)] == [(2, 2, 2)]
    # one KV head, which each decode rank holds (replicated): both read it from prefill rank 0
    matched, spec = ask(1, readers_counted=True)
    assert matched == (40, True) and spec.awaiting and spec.kv_heads == 1
    assert [(p.port, p.src_head, p.dst_head, p.heads, p.readers) for r in (0, 1) for p in spec.peers(r, 2)] == \
        [(7000, 0, 0, 1, 2)] * 2
    for kv_heads, changes in ((4, {}), (3, {"readers_counted": True})):
        matched, spec = ask(kv_heads, **changes)
        assert matched == (0, False) and not spec.awaiting and spec.kv_heads == 0
        assert [p.heads for p in spec.peers(0, 2)] == [0] and spec.peers(1, 2) == []
    # a prefill engine claiming a TP size vLLM cannot shard the model's 2 KV heads over (3: a lie, or
    # another model): refused, the prompt computed, each of its ranks released once (p mod 2)
    matched, spec = ask(2, prefill_tp=3, readers_counted=True)
    assert matched == (0, False) and not spec.awaiting and spec.kv_heads == 0
    assert [[(p.port, p.heads, p.readers) for p in spec.peers(r, 2)] for r in (0, 1)] == \
        [[(7000, 0, 1), (7002, 0, 1)], [(7001, 0, 1)]]


@needs_vllm
def test_a_prefill_rank_read_by_several_decode_ranks_is_freed_at_the_last_release():
    """``readers`` k: the lease stays until the k-th release with a valid token, is freed then,
    and a release beyond k is refused; the same when releases come before the lease; hostile
    ``readers`` are refused and the lease stays; no ``readers`` (older decode sides) means 1."""
    from llm_datadist.integrations.vllm.leases import MAX_READERS, LeaseBook, lease_request_id
    from llm_datadist.integrations.vllm.options import Options as _Options

    book = LeaseBook(_Options.parse({"kv_lease_s": 60}))
    remote = {r: lease_request_id(book.key, r) for r in ("a", "b", "c", "d")}

    def release(req_id: str, readers=None) -> dict:
        message = {"op": "release", "request_id": remote[req_id]}
        if readers is not None:
            message["readers"] = readers
        return book.on_release(9, message)

    book.take_leases({"a": 60.0, "b": 60.0, "d": 60.0}, stopping=False, blocks={"a": [1], "b": [2], "d": [4]})
    for hostile in (0, -1, MAX_READERS + 1, True, "2", 2.0, None, [2]):
        answer = release("a", hostile) if hostile is not None else book.on_release(
            9, {"op": "release", "request_id": remote["a"], "readers": None})
        assert answer["released"] is False and "readers" in answer["why"], hostile
    assert book.stats["bad_readers"] == 8 and "a" in book.held
    for k in range(3):
        assert release("a", 3)["released"] is True
        assert ("a" in book.held) == (k < 2) and book.take_finished() == ({"a"} if k == 2 else set())
    assert release("a", 3) == {"request_id": remote["a"], "released": False,
                               "why": "its blocks were already freed (released)"}
    assert release("b")["released"] is True and book.take_finished() == {"b"}  # no readers: 1
    assert release("b")["released"] is False
    # releases before the lease: counted, the lease taken then held until the last one
    assert release("c", 2)["released"] is True
    book.take_leases({"c": 60.0}, stopping=False, blocks={"c": [3]})
    assert "c" in book.held and book.take_finished() == set()
    assert book.read_guard(9, remote["c"].encode()) is not None  # still readable by the other reader
    assert release("c", 2)["released"] is True and book.take_finished() == {"c"}
    assert release("c", 2)["released"] is False
    # a held lease with readers outstanding is freed at shutdown all the same
    assert release("d", 2)["released"] is True
    assert book.take_leases({}, stopping=True) == 1 and book.take_finished() == {"d"} and book.reads == {}


@needs_vllm
def test_engines_of_different_tp_sizes_compare_the_layout_of_all_heads():
    """A rank's own layout is compared only between engines of one TP size; between others, the
    block of all heads together — equal for P TP 1 / D TP 2 of one model, not for other heads."""
    import llm_datadist as ld
    from llm_datadist.integrations.vllm import compat

    def describe(tp_size: int, heads_here: int, **changes) -> dict:
        desc = ld.CacheDesc(2, [10, heads_here, 32, 128], ld.DataType.DT_UINT8, ld.Placement.HOST)
        fields = {"kv_format": compat.KV_FORMAT, "kv_heads": 2, "layout": compat.layout(desc), "tp_size": tp_size,
                  "layout_all_heads": compat.layout(desc, tp_size)}
        return dict(fields, **changes)

    assert describe(1, 2)["layout_all_heads"] == describe(2, 1)["layout_all_heads"] == "2x[2, 32, 128]:DT_UINT8"
    assert compat.verdict(describe(2, 1), describe(1, 2)) is None
    assert compat.verdict(describe(1, 2), describe(2, 1)) is None
    assert "layout_all_heads" in compat.verdict(describe(2, 1), describe(1, 2, layout_all_heads="2x[4, 32, 128]"))
    assert "layout " in compat.verdict(describe(2, 1), describe(2, 2))  # one TP size: the rank's own layout
    older = {k: v for k, v in describe(1, 2).items() if k not in ("tp_size", "layout_all_heads")}
    assert "layout " in compat.verdict(describe(2, 1), older)  # a peer that does not say its TP size
    assert compat.layout(ld.CacheDesc(1, [4, 2, 8], ld.DataType.DT_UINT8, ld.Placement.HOST), 0) == ""


@needs_vllm
def test_a_rank_of_replicated_kv_heads_moves_its_one_head_and_compares_the_models_heads():
    """A rank of TP 2 of a model with one KV head holds that head (vLLM replicates it): its blocks
    split into one head's bytes, and the layout of all heads it describes is the TP 1 engine's;
    heads and a TP size neither of which divides the other are refused in one line."""
    import torch

    from llm_datadist.integrations.vllm import compat, layout

    blocks = torch.zeros(4, 1, 32, 128, dtype=torch.uint8)
    assert layout.head_split(blocks, 1, 2) == layout.head_split(blocks, 2, 4) == (32 * 128, "")
    assert layout.head_split(blocks, 1, 1) == (32 * 128, "")
    assert layout.head_split(blocks, 4, 3)[1] == \
        "the model's 4 KV heads and this engine's 3 ranks do not divide one another"
    assert "do not hold this rank's 2 KV heads" in layout.head_split(blocks, 4, 2)[1]
    desc = layout.cache_desc([blocks])
    # (the worker describes the block of min(TP, heads) ranks: the distinct heads)
    assert compat.layout(desc, min(2, 1)) == compat.layout(desc, min(1, 1)) == "1x[1, 32, 128]:DT_UINT8"
