"""Caches of several shapes (issue 25, part 2): a KV cache group whose layers have different cache
shapes (an EAGLE drafter's beside the target's, MLA and indexer caches) registers one llm_datadist
cache per shape, both sides check that they registered the same caches before a pull writes, and
a pull moves the group's blocks in each of them. Also the prompt backoff of MTP drafters.

The views are vLLM's own: the group spec ``UniformTypeKVCacheSpecs`` vLLM builds for such a model,
placed by ``get_kv_cache_config_from_groups`` and viewed by ``allocate_kv_cache`` (what its workers
hand the connector). A prefill cluster in another process registers them the way the connector's
worker does and answers its ``hello`` with a description the test chooses (forged ones included).

Needs vLLM (``pip install '.[vllm]'``); no engine is started.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from test_vllm import needs_vllm

pytestmark = needs_vllm

NUM_BLOCKS, BLOCK_SIZE = 6, 16
TARGET = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
DRAFTER = ["draft_model.model.layers.2.self_attn.attn"]
PULLED = {3: 0, 1: 4, 5: 5}  # remote block -> local block


def vllm_views(drafter_heads: int = 4):
    """``(kv_caches, kv_cache_config)`` of a target of two layers (2 KV heads) and a drafter of one
    (``drafter_heads`` KV heads), as vLLM's worker makes them (one group: ``UniformTypeKVCacheSpecs``)."""
    import torch
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, UniformTypeKVCacheSpecs
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    specs = {name: FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.float16)
             for name in TARGET}
    specs.update({name: FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=drafter_heads, head_size=8,
                                          dtype=torch.float16) for name in DRAFTER})
    group = UniformTypeKVCacheSpecs.from_specs(specs)
    assert group is not None  # vLLM keeps such a model in one group
    layout = KVCacheLayout["LBHNC"]
    vllm_config = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None),
                                  cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout,
                                                               prefix_cache_retention_interval=None,
                                                               num_gpu_blocks_override=NUM_BLOCKS))
    config = get_kv_cache_config_from_groups(vllm_config, [KVCacheGroupSpec(list(specs), group)],
                                             group.page_size_bytes * NUM_BLOCKS)
    config.kv_cache_layout = layout.name
    return allocate_kv_cache(config, torch.device("cpu"), layout, None), config


def _worker(config):
    from llm_datadist.integrations.vllm.options import Options
    from llm_datadist.integrations.vllm.worker import Worker

    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_producer=False, is_kv_consumer=True))
    return Worker(vllm_config, "decode", Options.parse({}), config)


def prefill_side(state, described: dict, only_first: bool, seed: int) -> dict:
    """In the prefill cluster's process: vLLM's views with seeded bytes, registered as the
    connector's worker registers them (one cache per shape, model_id k; with ``only_first``, the
    first cache alone: a peer that says more than it registered), a ``hello`` answered with
    ``described``, releases granted. Returns each layer's blocks."""
    import torch

    import llm_datadist as ld
    from llm_datadist.integrations.vllm import caches, layout

    kv, config = vllm_views()
    generator = torch.Generator().manual_seed(seed)
    for view in kv.values():
        raw = view.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    for key in list(state.caches):
        state.cm.unregister_cache(state.caches.pop(key).cache_id)
    classes = caches.plan(kv, [], config.num_blocks, config.kv_cache_layout)
    for k, cls in enumerate(classes[:1] if only_first else classes):
        state.caches[k] = state.cm.register_blocks_cache(layout.cache_desc(cls.tensors),
                                                         [t.data_ptr() for t in cls.tensors],
                                                         ld.BlocksCacheKey(state.cluster_id, k), True)
    state.scratch["kv"] = kv

    def on_notify(peer, message):
        if isinstance(message, dict) and message.get("op") == "hello":
            return {"kv_compat": described, "compatible": True}
        return {"request_id": message.get("request_id"), "released": True, "why": ""}

    state.dd.engine.set_notify_handler(on_notify)
    return {name: [view[b].contiguous().view(torch.uint8).flatten().numpy() for b in range(NUM_BLOCKS)]
            for name, view in kv.items()}


@pytest.fixture(scope="module")
def prefill_engine():
    from llm_datadist.testing import Cluster

    with Cluster(61, role="PROMPT", listen=True, timeout=180) as cluster:
        yield cluster


def _blocks(view):
    import torch

    return [view[b].contiguous().view(torch.uint8).flatten().numpy() for b in range(NUM_BLOCKS)]


def test_layers_of_two_shapes_in_one_group_are_two_caches():
    from llm_datadist.integrations.vllm import caches

    kv, config = vllm_views()
    classes = caches.plan(kv, [], config.num_blocks, config.kv_cache_layout)
    assert [(c.group, c.shape, c.layers, len(c.tensors)) for c in classes] == [
        (0, (NUM_BLOCKS, 2, BLOCK_SIZE, 16), TARGET, 2), (0, (NUM_BLOCKS, 4, BLOCK_SIZE, 16), DRAFTER, 1)]
    assert [t.data_ptr() for c in classes for t in c.tensors] == [kv[n].data_ptr() for n in TARGET + DRAFTER]
    described = caches.describe(classes)
    assert described.startswith("g0:2x[2, 16, 16]:float16:2L:") and ";g0:1x[4, 16, 16]:float16:1L:" in described
    assert caches.mismatch(described, described) is None
    # one shape: one cache, as before
    same, config = vllm_views(drafter_heads=2)
    assert [c.layers for c in caches.plan(same, [], config.num_blocks)] == [TARGET + DRAFTER]
    # a layer that shares another's cache (vLLM's KV sharing) is listed, its memory registered once
    shared = dict(kv, **{"model.layers.9.self_attn.attn": kv[TARGET[0]]})
    first = caches.plan(shared, [], config.num_blocks)[0]
    assert len(first.tensors) == 2 and first.layers == TARGET + ["model.layers.9.self_attn.attn"]


def test_groups_of_uniform_type_are_full_attention_groups():
    """vLLM's group spec for full-attention layers of several shapes moves as a full group, also
    beside other groups."""
    import torch
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                            SlidingWindowSpec, UniformTypeKVCacheSpecs)

    from llm_datadist.integrations.vllm import groups as kv_groups

    uniform = UniformTypeKVCacheSpecs.from_specs({
        "a": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16),
        "b": FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=8, dtype=torch.float16)})
    sliding = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16, sliding_window=32)
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a", "b"], uniform), KVCacheGroupSpec(["c"], sliding)])
    found = kv_groups.transfer_groups(config)
    assert [(g.kind, g.layers) for g in found] == [("full", ("a", "b")), ("sliding_window", ("c",))]


def test_a_pull_moves_every_cache_of_the_group(prefill_engine):
    """Both sides describe the same caches: the request's blocks move in the target's cache and in
    the drafter's, block for block; no other block changes."""
    import numpy as np

    from llm_datadist.integrations.vllm.meta import Recv

    decode_kv, config = vllm_views()
    decode = _worker(config)
    try:
        decode.register(decode_kv)
        assert [(c["shape"][1], c["layers"]) for c in decode.registered_caches()] == [(2, TARGET), (4, DRAFTER)]
        sent = prefill_engine.call(prefill_side, decode.compat, False, 5)
        host, port = prefill_engine.address
        decode._pull("d1", Recv(list(PULLED.values()), list(PULLED), host, port, prefill_engine.cluster_id, "p1",
                                awaiting=True))
        results = decode.results()
        assert results.finished_recving == {"d1"} and results.failed_recving == set(), decode.stats
        assert decode.stats["pulled_blocks"] == len(PULLED)
        for name, view in decode_kv.items():
            got = _blocks(view)
            for remote, local in PULLED.items():
                assert np.array_equal(got[local], sent[name][remote]), (name, remote, local)
            for local in set(range(NUM_BLOCKS)) - set(PULLED.values()):
                assert not got[local].any(), (name, local)
    finally:
        decode.close()


def _forged(compat: dict, how: str) -> dict:
    """``compat`` with its ``caches`` changed as a hostile or mismatched peer would say them."""
    first, second = compat["caches"].split(";")
    out = dict(compat)
    if how == "missing":
        del out["caches"]
    elif how == "count":
        out["caches"] = first
    elif how == "extra":
        out["caches"] = ";".join([first, second, second])
    elif how == "shape":
        out["caches"] = ";".join([first, second.replace("[4, 16, 16]", "[4, 16, 8]")])
    elif how == "dtype":
        out["caches"] = ";".join([first, second.replace("float16", "bfloat16")])
    elif how == "names":
        digest = second.rsplit(":", 1)[1]
        out["caches"] = ";".join([first, second.replace(digest, "0" * len(digest))])
    elif how == "order":
        out["caches"] = ";".join([second, first])
    elif how == "group":
        out["caches"] = ";".join([first, "g1" + second[2:]])
    elif how == "garbage":
        out["caches"] = "g0:2x[2, 16, 16]:float16:2L:nothex;" + "x" * 3000
    elif how == "not a string":
        out["caches"] = 7
    return out


FORGED = {
    "missing": "does not describe its KV caches (an older release), this engine registers 2",
    "count": "it registers 1 KV caches, this engine 2",
    "extra": "it registers 3 KV caches, this engine 2",
    "shape": "KV cache 1: block shape [4, 16, 8] there, [4, 16, 16] here",
    "dtype": "KV cache 1: dtype bfloat16 there, float16 here",
    "names": "KV cache 1: its layers have other names",
    "order": "KV cache 0: tensors 1 there, 2 here, block shape [4, 16, 16] there, [2, 16, 16] here, layers 1 there",
    "group": "KV cache 1: KV cache group 1 there, 0 here",
    "garbage": "its cache description is malformed",
    "not a string": "its cache description is malformed",
}


def test_forged_cache_descriptions_are_refused_naming_the_difference():
    from llm_datadist.integrations.vllm import compat

    kv, config = vllm_views()
    worker = _worker(config)
    try:
        worker.register(kv)
        mine = worker.compat
    finally:
        worker.close()
    assert compat.verdict(mine, dict(mine)) is None
    for how, why in FORGED.items():
        said = compat.verdict(mine, _forged(mine, how))
        assert said is not None and why in said, (how, said)
    # one cache: an older release (no description) is not refused for it
    one = dict(mine, caches=mine["caches"].split(";")[0])
    assert compat.verdict(one, {k: v for k, v in one.items() if k != "caches"}) is None
    # between engines of different TP sizes the per-rank caches are not compared (the heads are)
    other_tp = dict(_forged(mine, "shape"), tp_size=2)
    assert "caches" not in (compat.verdict(dict(mine, tp_size=1), other_tp) or "")


@pytest.mark.parametrize("how", ["count", "shape", "names", "missing"])
def test_a_peer_with_other_caches_is_refused_before_anything_is_written(prefill_engine, how, caplog):
    """The prefill side registered the same caches, but says other ones (or none): the request is
    reported failed, one line says why, and not a byte of the decode side's caches changes."""
    import torch

    from llm_datadist.integrations.vllm.meta import Recv

    decode_kv, config = vllm_views()
    decode = _worker(config)
    try:
        decode.register(decode_kv)
        prefill_engine.call(prefill_side, _forged(decode.compat, how), False, 6)
        host, port = prefill_engine.address
        with caplog.at_level(logging.ERROR, logger="llm_datadist.integrations.vllm"):
            decode._pull("d2", Recv(list(PULLED.values()), list(PULLED), host, port, prefill_engine.cluster_id,
                                    "p2", awaiting=True))
        results = decode.results()
        assert results.finished_recving == {"d2"} and results.failed_recving == {"d2"}
        assert decode.stats["failed_requests"] == 1 and decode.stats["pulled_blocks"] == 0
        assert any(FORGED[how] in r.getMessage() and "refused" in r.getMessage() for r in caplog.records), \
            [r.getMessage() for r in caplog.records]
        assert not any(view.view(torch.uint8).any() for view in decode_kv.values())
    finally:
        decode.close()


def test_a_peer_that_registered_fewer_caches_than_it_says_fails_the_request(prefill_engine):
    """A lying peer (its description matches, its registration lacks the drafter's cache): the pull of
    the missing cache fails in the transfer, and the request is reported failed."""
    import torch

    from llm_datadist.integrations.vllm.meta import Recv

    decode_kv, config = vllm_views()
    decode = _worker(config)
    try:
        decode.register(decode_kv)
        prefill_engine.call(prefill_side, decode.compat, True, 7)
        host, port = prefill_engine.address
        decode._pull("d3", Recv(list(PULLED.values()), list(PULLED), host, port, prefill_engine.cluster_id, "p3",
                                awaiting=True))
        results = decode.results()
        assert results.failed_recving == {"d3"}
        assert not decode_kv[DRAFTER[0]].view(torch.uint8).any()  # the missing cache: untouched
    finally:
        decode.close()


# -- the prompt backoff of MTP drafters ------------------------------------------------------------

@pytest.mark.parametrize("lookahead, expected", [(0, 0), (1, 0), (3, 2)])
def test_the_backoff_is_the_drafters_lookahead_less_one(lookahead, expected):
    from llm_datadist.integrations.vllm.backoff import drafter_backoff
    from llm_datadist.integrations.vllm.options import Options
    from llm_datadist.integrations.vllm.scheduler import Scheduler

    assert drafter_backoff(SimpleNamespace(num_prefill_lookahead_tokens=lookahead)) == expected
    assert drafter_backoff(SimpleNamespace()) == 0
    assert Scheduler("d", Options.parse({}), BLOCK_SIZE, producer=False, backoff=expected).backoff == expected


def test_vllms_lookahead_of_speculative_methods():
    """What vLLM's config says for the methods of the live tests: ngram reads none, EAGLE one token."""
    from vllm.config import VllmConfig

    def lookahead(method, mtp=False, k=3):
        spec = SimpleNamespace(use_eagle=lambda: method in ("eagle", "mtp"), use_multi_module_mtp=lambda: mtp)
        config = SimpleNamespace(speculative_config=spec, num_speculative_tokens=k)
        return VllmConfig.num_prefill_lookahead_tokens.fget(config)

    assert (lookahead("ngram"), lookahead("eagle"), lookahead("mtp", mtp=True)) == (0, 1, 3)


def _request(prompt, params, request_id="r"):
    """A vLLM request of ``prompt`` whose ``kv_transfer_params`` are ``params`` (as the proxy sends them)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id, list(prompt), SamplingParams(max_tokens=16, extra_args={"kv_transfer_params": params}),
                   None)


def test_a_prefill_stops_short_by_the_backoff_and_its_decode_engine_loads_as_much():
    from vllm.v1.request import RequestStatus

    from llm_datadist.integrations.vllm.meta import LLMDataDistHandshakeMetadata
    from llm_datadist.integrations.vllm.options import Options
    from llm_datadist.integrations.vllm.scheduler import Scheduler

    prefill = Scheduler("p", Options.parse({"lease_tokens": False}), BLOCK_SIZE, producer=False, backoff=2)
    prefill.set_worker(LLMDataDistHandshakeMetadata("p", 7, "127.0.0.1", 4000))
    request = _request(range(3, 53), {"do_remote_decode": True})
    prefill.on_new_request(request)
    prefill.on_new_request(request)  # (once only)
    assert request.num_prompt_tokens == 48 and request.prompt_token_ids == list(range(3, 51))
    assert len(request.all_token_ids) == 48 and request.max_tokens == 1
    short = _request(range(3, 5), {"do_remote_decode": True}, "short")
    prefill.on_new_request(short)
    assert short.num_prompt_tokens == 2  # no longer than the backoff: computed whole
    request.status, request.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 48
    delay, params = prefill.request_finished(request, ([1, 2, 3],))
    assert delay and params["remote_block_ids"] == [1, 2, 3] and params["remote_num_tokens"] == 48

    decode = Scheduler("d", Options.parse({}), BLOCK_SIZE, producer=False, backoff=2)
    incoming = _request(range(3, 53), dict(params), "d-req")
    decode.on_new_request(incoming)
    assert incoming.num_prompt_tokens == 50  # a decode request is never cut
    assert decode.get_num_new_matched_tokens(incoming, 0) == (48, True)  # the last 2 are computed here
    assert decode.get_num_new_matched_tokens(incoming, 32) == (16, True)
    # blocks for the whole prompt (a prefill engine without the backoff) do not fit: computed here
    wrong = _request(range(3, 53), dict(params, remote_block_ids=[1, 2, 3, 4]), "d-wrong")
    assert decode.get_num_new_matched_tokens(wrong, 0) == (0, False)
    assert wrong.kv_transfer_params["do_remote_prefill"] is False


def test_only_a_drafter_that_keeps_kv_is_compared():
    """ngram decoding on the decode engine alone changes nothing that moves; an EAGLE drafter's
    config must be the same on both engines."""
    from llm_datadist.integrations.vllm import compat

    def described(spec):
        return compat.fields(SimpleNamespace(speculative_config=spec))["speculative"]

    ngram = SimpleNamespace(method="ngram", model=None, num_speculative_tokens=3, uses_draft_kv_cache=lambda: False)
    eagle = SimpleNamespace(method="eagle", model="/d", num_speculative_tokens=2, uses_draft_kv_cache=lambda: True)
    assert described(None) is None and described(ngram) is None
    assert described(eagle) == "eagle:/d:2"


@pytest.mark.parametrize("producer", [True, False])
def test_push_mode_refuses_a_model_of_several_caches(producer):
    """Push mode moves one cache's layers (``push/``): layers of two shapes are refused when they
    register, on both sides, naming both caches, instead of leaving the drafter's KV behind."""
    from llm_datadist.integrations.vllm.options import Options
    from llm_datadist.integrations.vllm.worker import Worker

    kv, config = vllm_views()
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_producer=producer,
                                                                     is_kv_consumer=not producer))
    worker = Worker(vllm_config, "push", Options.parse({"transfer_mode": "push"}), config)
    try:
        with pytest.raises(NotImplementedError, match=r"push mode .* 2 caches .*\(6, 2, 16, 16\).*\(6, 4, 16, 16\)"):
            worker.register(kv)
        assert worker.caches == []
        # one shape registers in push mode as before
        same, config = vllm_views(drafter_heads=2)
        worker.register(same)
        assert len(worker.caches) == 1
    finally:
        worker.close()
