"""Pipeline parallelism: every prefill worker (stage and tensor parallel rank) in ``kv_transfer_params``,
decode stage s pulling the layers of prefill stage s only, engines of different pipeline parallel
sizes refused per request (every prefill worker still released), and a prefill worker taken for
another stage refused on its link.

The live test runs vLLM CPU engines with ``pipeline_parallel_size=2`` (``distributed_executor_backend
="mp"``) on the tiny model of ``test_vllm`` (two layers: one per stage). vLLM 0.32's CPU build runs
them only with ``enforce_eager`` off: its CPU model runner skips the warm-up that allocates a later
stage's buffer of intermediate tensors when the compilation mode is NONE (``warming_up_model``), and
stage 1's first step then fails (``assert self.intermediate_tensors is not None`` in
``sync_and_gather_intermediate_tensors``). ``PP2`` compiles with torch's ``eager`` backend instead,
which costs nothing."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from test_vllm import LINK_SECRET, Engine, close_all, delta, needs_vllm, prompts_of, write_model
from test_vllm_tp import assert_released_by_decode, nixl_only, prefill, start

PP2 = {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp", "enforce_eager": False,
       "compilation_config": {"mode": 1, "backend": "eager"}}
MAX_TOKENS = 6
#: The same-PP pair; params cut to NIXL's fields; params whose ranks are swapped (each decode stage
#: sent to the other prefill stage); params claiming another pipeline parallel size.
SAME_PP = prompts_of([40, 70], seed=31)
NIXL_ONLY = prompts_of([50], seed=32)
SWAPPED = prompts_of([45], seed=33)
OTHER_PP = prompts_of([55], seed=34)
TIMEOUT_S = 240


@needs_vllm
def test_pp2_prefill_to_pp2_decode_pulls_stage_by_stage(tmp_path, plain_engine):
    """P PP 2 -> D PP 2: the tokens are the plain engine's, no prompt token was computed on the decode
    engine and both prefill workers were released by their decode stage; the same through a router
    that forwards only NIXL's fields (rank 0 asked for every worker); a decode stage sent to the
    other prefill stage is refused on the link (``pp_rank`` differs: the load fails, vLLM's default
    ``kv_load_failure_policy``), and params that claim another pipeline parallel size are refused
    in one line, the prompt computed, every prefill worker released."""
    everything = SAME_PP + NIXL_ONLY + SWAPPED + OTHER_PP
    outputs = plain_engine.engine().generate(everything, MAX_TOKENS)
    baseline = {tuple(p): o["token_ids"] for p, o in zip(everything, outputs)}
    write_model(tmp_path / "model")
    producer = Engine(tmp_path / "model", "producer", tmp_path / "prefill.log",
                      {"kv_lease_s": 300, "link_secret": LINK_SECRET}, PP2)
    consumer = Engine(tmp_path / "model", "consumer", tmp_path / "decode.log", {"link_secret": LINK_SECRET}, PP2)
    try:
        start(producer, consumer)
        params = prefill(producer, everything)
        for p in params:
            assert p["pp_size"] == 2 and p["tp_size"] == 1 and len(p["remote_ranks"]) == 2
            assert p["remote_ranks"][0]["port"] == p["remote_port"]
            assert len({r["port"] for r in p["remote_ranks"]}) == 2  # one listener per stage
        same, cut, swapped, other = params[:2], params[2], params[3], params[4]

        before = consumer.prompt_tokens()
        got = consumer.generate(SAME_PP + NIXL_ONLY, MAX_TOKENS, same + [nixl_only(cut)], timeout=TIMEOUT_S)
        for prompt, out in zip(SAME_PP + NIXL_ONLY, got):
            assert out["token_ids"] == baseline[tuple(prompt)], f"prompt of {len(prompt)} tokens"
        sources = delta(consumer.prompt_tokens(), before)
        assert sources["local_compute"] == 0
        assert sources["external_kv_transfer"] == sum(map(len, SAME_PP + NIXL_ONLY))
        for p in same + [cut]:  # each prefill stage was released by the decode stage that read it
            assert_released_by_decode(p, [0, 1])
        assert "computing the prompt locally" not in consumer.tail(400)

        # a router (or a liar) that sends each decode stage to the other prefill stage
        lying = dict(swapped, remote_ranks=swapped["remote_ranks"][::-1])
        lying.update(remote_host=lying["remote_ranks"][0]["host"], remote_port=lying["remote_ranks"][0]["port"],
                     remote_cluster_id=lying["remote_ranks"][0]["cluster_id"],
                     remote_request_id=lying["remote_ranks"][0]["request_id"])
        out = consumer.generate(SWAPPED, MAX_TOKENS, [lying], timeout=TIMEOUT_S)[0]
        assert len(out["token_ids"]) < MAX_TOKENS  # never decoded from another stage's layers
        # each stage's line (logged after its release; vLLM may fail the request at the first one)
        lines = ("pp_rank 1 there, 0 here", "pp_rank 0 there, 1 here")
        deadline = time.monotonic() + 30
        while not all(line in consumer.tail(400) for line in lines) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert all(line in consumer.tail(400) for line in lines), consumer.tail(20)
        assert_released_by_decode(swapped, [0, 1])  # (released all the same: the link works)

        # params claiming pipeline parallel size 1 (two tensor parallel ranks): refused, computed here
        claimed = dict(other, pp_size=1, tp_size=2)
        before = consumer.prompt_tokens()
        out = consumer.generate(OTHER_PP, MAX_TOKENS, [claimed], timeout=TIMEOUT_S)[0]
        assert out["token_ids"] == baseline[tuple(OTHER_PP[0])]
        assert delta(consumer.prompt_tokens(), before)["local_compute"] == len(OTHER_PP[0])
        assert "runs with pipeline_parallel_size 1 and this one with 2" in consumer.tail(400)
        assert_released_by_decode(other, [0, 1])
    finally:
        close_all([producer, consumer])


# -- without engines ------------------------------------------------------------------------------------------

def _params(tp: int, pp: int, **extra) -> dict:
    ranks = [{"host": "127.0.0.1", "port": 7000 + r, "cluster_id": 10 + r, "request_id": f"req.t{r}"}
             for r in range(tp * pp)]
    return dict({"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_host": "127.0.0.1",
                 "remote_port": 7000, "remote_cluster_id": 10, "remote_request_id": "req.t0", "tp_size": tp,
                 "pp_size": pp, "remote_ranks": ranks, "readers_counted": True}, **extra)


@needs_vllm
def test_each_decode_worker_maps_to_the_prefill_workers_of_its_stage():
    from dataclasses import replace

    from llm_datadist.integrations.vllm.meta import recv_spec

    # TP 1 x PP 2: stage s pulls from prefill worker s, whole blocks
    spec = replace(recv_spec(_params(1, 2)), local_block_ids=[5, 6], awaiting=True)
    assert spec.tp_size == 1 and spec.remote_pp_size == 2
    for stage in (0, 1):
        [peer] = spec.peers(0, 1, stage, 2)
        assert (peer.port, peer.remote_request_id, peer.awaiting, peer.heads) == \
            (7000 + stage, f"req.t{stage}", True, 0)
    # TP 2 x PP 2: worker (s, r) pulls from prefill worker s * 2 + r
    spec = replace(recv_spec(_params(2, 2)), local_block_ids=[5, 6], awaiting=True)
    assert spec.tp_size == 2
    for stage in (0, 1):
        for rank in (0, 1):
            assert [p.port for p in spec.peers(rank, 2, stage, 2)] == [7000 + stage * 2 + rank]
    # P TP 2 x PP 2 -> D TP 1 x PP 2 (heads split evenly): the decode stage reads both ranks of its stage
    heads = replace(spec, kv_heads=2)
    for stage in (0, 1):
        peers = heads.peers(0, 1, stage, 2)
        assert [(p.port, p.src_head, p.dst_head, p.heads, p.readers) for p in peers] == \
            [(7000 + stage * 2, 0, 0, 1, 1), (7001 + stage * 2, 0, 1, 1, 1)]
    # another pipeline parallel size: nothing awaited, every prefill worker released exactly once
    for tp, pp in ((1, 1), (2, 1), (1, 4)):
        released = [p.port for stage in range(pp) for rank in range(tp) for p in spec.peers(rank, tp, stage, pp)]
        assert sorted(released) == [7000, 7001, 7002, 7003], (tp, pp)
        assert not any(p.awaiting or p.local_block_ids for s in range(pp) for p in spec.peers(0, tp, s, pp))


@needs_vllm
def test_params_naming_another_count_of_workers_are_malformed():
    from llm_datadist.integrations.vllm.meta import recv_spec

    assert recv_spec(_params(1, 2)) is not None
    ranks = _params(1, 2)["remote_ranks"]
    for bad in ({"pp_size": 3}, {"pp_size": 0}, {"pp_size": True}, {"pp_size": "2"}, {"pp_size": 10 ** 6},
                {"remote_ranks": ranks[:1]}, {"remote_ranks": ranks * 2}):
        assert recv_spec(_params(1, 2, **bad)) is None, bad
    # NIXL's fields only (no remote_ranks): the decode side asks prefill rank 0 for its workers
    cut = {k: v for k, v in _params(1, 2).items() if k not in ("remote_ranks", "readers_counted")}
    assert recv_spec(cut).ranks_unknown


@needs_vllm
def test_params_naming_more_workers_than_a_tp_size_may_are_malformed():
    # (a decode engine of another pipeline parallel size releases every worker listed, each a link
    # and a thread: a router's 256 x 64 forged workers would be 16384 of them for one request)
    from llm_datadist.integrations.vllm.meta import MAX_TP_SIZE, recv_spec

    assert recv_spec(_params(MAX_TP_SIZE // 4, 4)) is not None
    assert recv_spec(_params(MAX_TP_SIZE // 4, 8)) is None
    assert recv_spec(_params(MAX_TP_SIZE, 64)) is None
    cut = {k: v for k, v in _params(MAX_TP_SIZE, 2).items() if k not in ("remote_ranks", "readers_counted")}
    assert recv_spec(cut) is None


@needs_vllm
def test_a_pp2_prefill_hands_out_every_worker_and_a_decode_of_another_pp_size_refuses():
    from vllm.v1.request import RequestStatus

    from llm_datadist.integrations.vllm import stages
    from llm_datadist.integrations.vllm.leases import LeaseBook
    from llm_datadist.integrations.vllm.meta import LLMDataDistHandshakeMetadata
    from llm_datadist.integrations.vllm.options import Options
    from llm_datadist.integrations.vllm.scheduler import Scheduler

    options = Options.parse({"kv_lease_s": 60})
    books = [LeaseBook(options) for _ in range(2)]
    scheduler = Scheduler("prefill", options, 32, producer=False, pp_size=2)
    handshakes = {(s, 0): LLMDataDistHandshakeMetadata("prefill", 10 + s, "127.0.0.1", 7000 + s, books[s].key.hex(),
                                                        0, 1, pp_rank=s, pp_size=2) for s in range(2)}
    scheduler.set_workers(stages.by_flat_rank(handshakes, 1))
    request = SimpleNamespace(request_id="req-1", kv_transfer_params={"do_remote_decode": True},
                              status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=40)
    keep, params = scheduler.request_finished(request, [[1, 2]])
    assert keep and params["pp_size"] == 2 and [r["port"] for r in params["remote_ranks"]] == [7000, 7001]
    for book in books:  # each stage's worker holds its own lease, released with its own token
        book.take_leases({"req-1": 60.0}, stopping=False)
    assert books[1].on_release(9, {"op": "release", "request_id": params["remote_ranks"][0]["request_id"]}
                               )["released"] is False
    # a decode engine without pipeline parallelism computes the prompt and releases both stages
    decode = Scheduler("decode", options, 32, producer=False)
    incoming = SimpleNamespace(request_id="d-1", kv_transfer_params=dict(params), prompt_token_ids=list(range(40)))
    assert decode.get_num_new_matched_tokens(incoming, 0) == (0, False)
    assert incoming.kv_transfer_params["do_remote_prefill"] is False
    sent = decode.build_connector_meta().reqs_to_recv["d-1"]
    assert not sent.awaiting and [p.port for p in sent.peers(0, 1)] == [7000, 7001]
    # a handshake that says another stage than the key vLLM gave it
    wrong = dict(handshakes)
    wrong[(1, 0)] = LLMDataDistHandshakeMetadata("prefill", 11, "127.0.0.1", 7001, books[1].key.hex(), 0, 1,
                                                 pp_rank=0, pp_size=2)
    with pytest.raises(ValueError, match="says it is pipeline stage 0"):
        scheduler.set_workers(stages.by_flat_rank(wrong, 1))


@needs_vllm
def test_a_peer_of_another_stage_or_pipeline_size_is_refused_on_its_link():
    from llm_datadist.integrations.vllm import compat, stages

    mine = dict(kv_format=compat.KV_FORMAT, model="m", layers=1, **stages.compat_fields(0, 2))
    assert compat.verdict(mine, dict(mine)) is None
    assert "pp_rank 1 there, 0 here" in compat.verdict(mine, dict(mine, pp_rank=1))
    assert "pp_size 1 there, 2 here" in compat.verdict(mine, dict(mine, **stages.compat_fields(0, 1)))
    assert "layers 2 there, 1 here" in compat.verdict(mine, dict(mine, layers=2))


@needs_vllm
def test_pipeline_parallelism_refuses_what_it_cannot_move_at_start():
    from llm_datadist.integrations.vllm import connector

    parallel = SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1)
    connector._check_pipeline(parallel, ())  # one KV cache group: supported
    with pytest.raises(NotImplementedError, match="one KV cache group only"):
        connector._check_pipeline(parallel, tuple(SimpleNamespace(name=f"g{i}", layers=("a",), window=0)
                                                  for i in range(2)))
    transfer = SimpleNamespace(is_kv_producer=True, is_kv_consumer=False)
    with pytest.raises(NotImplementedError, match="without pipeline parallelism"):
        connector._check_push(transfer, parallel, ())


@needs_vllm
def test_a_tp2_pp2_engine_collects_its_four_workers_by_stage_and_rank():
    """The scheduler half of a TP 2 x PP 2 engine takes vLLM's handshakes keyed ``(pp_rank,
    tp_rank)`` (``set_xfer_handshake_metadata_pp_aware``, as its engine core and MultiConnector
    call it) and hands out the four workers by flat rank; another connector's metadata is ignored."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.v1.request import RequestStatus

    from llm_datadist.integrations.vllm import LLMDataDistConnector, LLMDataDistHandshakeMetadata

    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="e", kv_connector_extra_config={}, is_kv_producer=True,
                                           is_kv_consumer=False),
        parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=2),
        cache_config=SimpleNamespace(block_size=32))
    connector = LLMDataDistConnector(config, KVConnectorRole.SCHEDULER)
    try:
        multi = SimpleNamespace(_connectors=[connector])
        shakes = {(pp, tp): LLMDataDistHandshakeMetadata("e", 20 + pp * 2 + tp, "127.0.0.1", 6000 + pp * 2 + tp,
                                                         lease_key="ab" * 32, tp_rank=tp, tp_size=2, pp_rank=pp,
                                                         pp_size=2)
                  for pp in (0, 1) for tp in (0, 1)}
        MultiConnector.set_xfer_handshake_metadata_pp_aware(multi, {(0, 0): SimpleNamespace()})  # not ours
        assert connector._scheduler.worker is None
        MultiConnector.set_xfer_handshake_metadata_pp_aware(multi, {k: shakes[k] for k in [(0, 0), (0, 1), (1, 0)]})
        assert connector._scheduler.worker is None  # not every worker yet: nothing handed out
        MultiConnector.set_xfer_handshake_metadata_pp_aware(multi, shakes)
        request = SimpleNamespace(request_id="r", kv_transfer_params={"do_remote_decode": True},
                                  status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=40)
        _, params = connector.request_finished_all_groups(request, ([1, 2],))
        assert (params["tp_size"], params["pp_size"]) == (2, 2)
        assert [r["port"] for r in params["remote_ranks"]] == [6000, 6001, 6002, 6003]
    finally:
        connector.shutdown()
