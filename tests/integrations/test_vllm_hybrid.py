"""Hybrid models (issue 25, part 1): the connector declares ``SupportsHMA``, so vLLM keeps its hybrid
KV cache manager on, and each KV cache group's blocks move, a sliding-window group's only inside
its window.

The live test starts one engine pair (and a plain engine for the baseline) on a tiny model of the
Gemma2 pattern: local (sliding window of 32 tokens) and global attention layers alternate. It is a
Llama checkpoint with ``layer_types`` (vLLM's Llama honours them): the seeded weights of
``test_vllm.write_model``, whose outputs depend on the KV cache, where a Gemma2 checkpoint's tied
embeddings make random weights repeat the last prompt token. The unit tests below it need vLLM
but start no engine.

Needs vLLM (``pip install '.[vllm]'``, the CPU build 0.32.0); skipped without it.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from test_vllm import (BLOCK, MAX_TOKENS, Engine, close_all, delta, needs_vllm, params_of_a_gone_prefill,
                       prefill_for_remote_decode, prompts_of, write_model)

WINDOW = 32
#: vLLM's own switch; None (its default) would turn the manager off for a connector without SupportsHMA
HYBRID = {"disable_hybrid_kv_cache_manager": False}
#: one prompt shorter than the window and a block, the rest of 100+ tokens
PROMPTS = prompts_of([40, 100, 130, 257], seed=21)
FAILING = prompts_of([150], seed=22)


def window_blocks(tokens: int) -> int:
    """The blocks a decode engine holds of a sliding-window group for a prompt of ``tokens``: vLLM
    skips the tokens before the window of the next one (``tokens - WINDOW + 1``)."""
    skipped = max(0, tokens - WINDOW + 1) // BLOCK
    return math.ceil(tokens / BLOCK) - skipped


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """``(baseline tokens by prompt, prefill engine, decode engine)`` of the hybrid model."""
    work = tmp_path_factory.mktemp("vllm-hybrid")
    model = work / "model"
    write_model(model)
    config = json.loads((model / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)
    (model / "config.json").write_text(json.dumps(config))
    started = []
    try:
        plain = Engine(model, "plain", work / "plain.log", engine_args=HYBRID)
        started.append(plain)
        plain.wait_ready()
        everything = PROMPTS + FAILING
        baseline = {tuple(p): o["token_ids"] for p, o in zip(everything, plain.generate(everything, MAX_TOKENS))}
        plain.close()
        prefill = Engine(model, "producer", work / "prefill.log", engine_args=HYBRID)
        started.append(prefill)
        decode = Engine(model, "consumer", work / "decode.log", engine_args=HYBRID)
        started.append(decode)
        prefill.wait_ready()
        decode.wait_ready()
        yield baseline, prefill, decode
    finally:
        close_all(started)


@needs_vllm
def test_a_hybrid_model_decodes_from_its_groups_and_only_the_window_moves(hybrid):
    baseline, prefill, decode = hybrid
    registration = decode.stats()["registration"]
    assert registration["num_tensors"] == 1  # the first group's (one layer); the other group has its own cache
    params = prefill_for_remote_decode(prefill, PROMPTS)
    for p, prompt in zip(params, PROMPTS):
        groups = p["remote_block_ids"]
        assert len(groups) == 2 and all(isinstance(g, list) for g in groups), groups
        lengths = sorted(len(g) for g in groups)
        # the full group names every block, the sliding-window one at most its window's
        assert lengths[1] == math.ceil(len(prompt) / BLOCK)
        assert lengths[0] <= WINDOW // BLOCK + 1 and 0 not in groups[0] + groups[1]
    before = decode.stats()["stats"]

    outputs = decode.generate(PROMPTS, MAX_TOKENS, params)

    for prompt, out in zip(PROMPTS, outputs):
        assert out["token_ids"] == baseline[tuple(prompt)], f"prompt of {len(prompt)} tokens"
    moved = delta(decode.stats()["stats"], before)
    assert moved["pulled_requests"] == len(PROMPTS) and moved["failed_requests"] == 0
    full = sum(math.ceil(len(p) / BLOCK) for p in PROMPTS)
    windowed = sum(window_blocks(len(p)) for p in PROMPTS)
    by_group = sorted(moved[k] for k in moved if k.startswith("pulled_blocks_group"))
    assert by_group == sorted([full, windowed]), moved
    assert moved["pulled_blocks"] == full + windowed < 2 * full


@needs_vllm
def test_a_failed_pull_of_a_hybrid_model_is_reported_per_request(hybrid):
    """vLLM raises on block-level load errors where there are several KV cache groups: the
    connector reports the request as failed instead, and vLLM fails it (its default policy)."""
    baseline, prefill, decode = hybrid
    params = prefill_for_remote_decode(prefill, FAILING)
    broken = params_of_a_gone_prefill(params)
    before = decode.stats()["stats"]
    outputs = decode.generate(FAILING, MAX_TOKENS, broken)
    assert delta(decode.stats()["stats"], before)["failed_requests"] == 1
    assert len(outputs[0]["token_ids"]) < MAX_TOKENS  # never decoded from blocks that did not arrive
    # the engine goes on serving, and the real params still pull
    again = decode.generate(FAILING, MAX_TOKENS, params)
    assert again[0]["token_ids"] == baseline[tuple(FAILING[0])]


# -- unit tests (no engine) ------------------------------------------------------------------------

def _specs():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    import torch

    common = dict(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return FullAttentionSpec(**common), SlidingWindowSpec(sliding_window=WINDOW, **common)


def _config(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


@needs_vllm
def test_groups_of_a_hybrid_model_and_their_windows():
    from llm_datadist.integrations.vllm import groups as kv_groups

    full, sliding = _specs()
    found = kv_groups.transfer_groups(_config(sliding, full))
    assert [(g.index, g.kind, g.window, g.layers) for g in found] == [
        (0, "sliding_window", WINDOW, ("layer0",)), (1, "full", 0, ("layer1",))]
    assert found[0].window_blocks == WINDOW // BLOCK + 1 and found[1].window_blocks == 0
    assert kv_groups.describe(found) == f"sliding_window({WINDOW}):1;full:1"
    assert kv_groups.describe(kv_groups.transfer_groups(_config(full))) is None
    assert kv_groups.transfer_groups(None) == ()


@needs_vllm
def test_state_space_groups_and_unknown_groups_are_refused_with_the_reason():
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec

    from llm_datadist.integrations.vllm import groups as kv_groups

    full, _ = _specs()
    # (state-space groups move with mamba_cache_mode "none": test_vllm_mamba.py)
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,), mamba_cache_mode="all")
    with pytest.raises(NotImplementedError, match="state-space \\(Mamba\\).*'all'.*--no-enable-prefix-caching"):
        kv_groups.transfer_groups(_config(full, mamba))
    chunked = ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32,
                                        attention_chunk_size=64)
    with pytest.raises(NotImplementedError, match="group 1 is ChunkedLocalAttentionSpec"):
        kv_groups.transfer_groups(_config(full, chunked))


@needs_vllm
@pytest.mark.parametrize("block_ids, expected", [
    # vLLM's list after request_finished: null blocks (0) before the window, then its blocks
    (([0, 0, 0, 7, 8], [1, 2, 3, 4, 5]), ([7, 8], [1, 2, 3, 4, 5])),
    (([0, 7], [1, 2]), ([7], [1, 2])),  # the window's first block was skipped: only the null before it
    (([7, 8], [1, 2]), ([7, 8], [1, 2])),  # a prompt inside the window
    (([0, 0, 6, 7, 8], [1, 2, 3, 4, 5]), ([7, 8], [1, 2, 3, 4, 5])),  # never more than window_blocks
    (([], []), ([], [])),
])
def test_a_sliding_window_group_is_cut_to_its_window(block_ids, expected):
    from llm_datadist.integrations.vllm import groups as kv_groups

    full, sliding = _specs()
    found = kv_groups.transfer_groups(_config(sliding, full))
    assert kv_groups.clip(found, block_ids, 2) == expected
    with pytest.raises(ValueError, match="expected 2 KV cache groups, got 1"):
        kv_groups.clip(found, block_ids[:1], 2)


@needs_vllm
@pytest.mark.parametrize("blocks, why", [
    ([[1, 2], [3, 4, 5, 6]], "they name 4 blocks of KV cache group 1, 5 wanted"),  # (130 tokens: 5 blocks)
    ([[1, 2], [3, 4, 5, 6, 7]], ""),
    ([[1], [3, 4, 5, 6, 7]], ""),
    ([[1, 2, 3], [3, 4, 5, 6, 7]], "they name 3 blocks of KV cache group 0, 1 to 2 wanted"),
    ([[], [3, 4, 5, 6, 7]], "they name 0 blocks of KV cache group 0, 1 to 2 wanted"),
    ([[1, 2], [3, 4, 5, 6, 7], [8]], "they name blocks of 3 KV cache group(s), this engine has 2"),
    ([3, 4, 5, 6, 7], "they name blocks of 1 KV cache group(s), this engine has 2"),
])
def test_a_decode_scheduler_checks_the_blocks_of_every_group(blocks, why):
    """A peer's block lists (they come through the proxy) are counted per group before use."""
    from llm_datadist.integrations.vllm import groups as kv_groups
    from llm_datadist.integrations.vllm.meta import recv_spec
    from llm_datadist.integrations.vllm.options import Options
    from llm_datadist.integrations.vllm.scheduler import Scheduler

    full, sliding = _specs()
    found = kv_groups.transfer_groups(_config(sliding, full))
    scheduler = Scheduler("d", Options.parse({}), BLOCK, producer=False, groups=found, num_groups=2)
    spec = recv_spec({"remote_block_ids": blocks, "remote_host": "h", "remote_port": 1, "remote_request_id": "r"})
    said = scheduler._blocks_refusal(spec, 130)
    assert said.startswith(why) if why else said == ""


@needs_vllm
@pytest.mark.parametrize("blocks", [
    [[1, 2]] * 65,  # more groups than any model has
    [[1, 2], [3, True]],  # a bool is no block id
    [[1, 2], [3, -1]],
    [[1, 2], "34"],
    [[1, 2], [3, 4.0]],
    [[1, 2], 3],
])
def test_hostile_per_group_block_ids_are_unusable(blocks):
    from llm_datadist.integrations.vllm.meta import recv_spec

    params = {"remote_block_ids": blocks, "remote_host": "h", "remote_port": 1, "remote_request_id": "r"}
    assert recv_spec(params) is None


@needs_vllm
def test_the_prefill_side_hands_out_each_group_clipped_and_the_decode_side_pairs_their_tails():
    from vllm.v1.request import RequestStatus

    from llm_datadist.integrations.vllm import groups as kv_groups
    from llm_datadist.integrations.vllm.meta import LLMDataDistHandshakeMetadata, recv_spec
    from llm_datadist.integrations.vllm.options import Options
    from llm_datadist.integrations.vllm.scheduler import Scheduler
    from llm_datadist.integrations.vllm.worker import pair_blocks

    full, sliding = _specs()
    found = kv_groups.transfer_groups(_config(sliding, full))
    prefill = Scheduler("p", Options.parse({"lease_tokens": False}), BLOCK, producer=False, groups=found,
                        num_groups=2)
    prefill.set_worker(LLMDataDistHandshakeMetadata("p", 7, "127.0.0.1", 4000))
    request = SimpleNamespace(request_id="req", kv_transfer_params={"do_remote_decode": True},
                              status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=130)
    delay, params = prefill.request_finished(request, ([0, 0, 0, 9, 10], [1, 2, 3, 4, 5]))
    assert delay and params["remote_block_ids"] == [[9, 10], [1, 2, 3, 4, 5]]
    assert prefill.build_connector_meta().blocks_to_send == {"req": [9, 10, 1, 2, 3, 4, 5]}

    decode = Scheduler("d", Options.parse({}), BLOCK, producer=False, groups=found, num_groups=2)
    incoming = SimpleNamespace(request_id="d-req", kv_transfer_params=dict(params), num_prompt_tokens=130)
    assert decode.get_num_new_matched_tokens(incoming, 64) == (66, True)  # a local prefix hit of 64 tokens
    # vLLM's blocks after the hit: the window's last one, the full group's last three
    blocks = SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: [[21], [31, 32, 33]])
    decode.update_state_after_alloc(incoming, blocks, 66)
    spec = decode.build_connector_meta().reqs_to_recv["d-req"]
    assert spec.awaiting and spec.local_groups == ([21], [31, 32, 33]) and spec.local_block_ids == [21, 31, 32, 33]
    assert pair_blocks(spec, 2) == [(0, [10], [21]), (1, [3, 4, 5], [31, 32, 33])]
    with pytest.raises(ValueError, match="2 remote blocks of KV cache group 0 for 3 local ones"):
        pair_blocks(spec.with_local(([21, 22, 23], [31])), 2)
    with pytest.raises(ValueError, match="this engine moves 1 group"):
        pair_blocks(spec, 1)
    assert recv_spec(params).remote_groups == ([9, 10], [1, 2, 3, 4, 5])


@needs_vllm
def test_a_hybrid_worker_reports_failed_loads_per_request_only():
    """vLLM 0.32 raises on ``invalid_block_ids`` with several KV cache groups: a hybrid decode
    worker's failed pull is ``failed_recving`` only."""
    from test_vllm_leases import CONSUMER

    from llm_datadist.integrations.vllm import groups as kv_groups
    from llm_datadist.integrations.vllm.meta import Recv
    from llm_datadist.integrations.vllm.options import Options
    from llm_datadist.integrations.vllm.worker import Worker

    full, sliding = _specs()
    config = _config(sliding, full)
    worker = Worker(CONSUMER, "decode", Options.parse({}), config, kv_groups.transfer_groups(config))
    try:
        worker.peers.on_link = lambda spec, action: action(spec.cluster_id)
        spec = Recv([], [], "127.0.0.1", 1, 5, "req-p", awaiting=True, remote_groups=([1], [2, 3]))
        # more local blocks than the peer named: refused before anything moves
        worker._links_api = SimpleNamespace(notify=lambda cluster, message, timeout: {"request_id": "req-p",
                                                                                      "released": True})
        worker._pull("req-d", spec.with_local(([4, 5], [6, 7])))
        results = worker.results()
        assert results.failed_recving == {"req-d"} and results.finished_recving == {"req-d"}
        assert worker.take_load_errors() == set()
    finally:
        worker.close()


@needs_vllm
@pytest.mark.parametrize("blocks, why", [
    ([7, 8], ""),
    ([8], ""),
    ([4, 5, 6, 7, 8], "they name 5 blocks, 1 to 2 wanted"),  # every block: a prefill engine without the manager
    ([[7, 8]], ""),  # NIXL's per-group form of one group
])
def test_a_model_of_sliding_window_layers_only_moves_its_window(blocks, why):
    """All layers sliding (one group, the manager on): the list stays flat, cut to the window."""
    from vllm.v1.request import RequestStatus

    from llm_datadist.integrations.vllm import groups as kv_groups
    from llm_datadist.integrations.vllm.meta import LLMDataDistHandshakeMetadata, recv_spec
    from llm_datadist.integrations.vllm.options import Options
    from llm_datadist.integrations.vllm.scheduler import Scheduler

    _, sliding = _specs()
    found = kv_groups.transfer_groups(_config(sliding))
    assert kv_groups.describe(found) == f"sliding_window({WINDOW}):1"
    scheduler = Scheduler("p", Options.parse({"lease_tokens": False}), BLOCK, producer=False, groups=found)
    spec = recv_spec({"remote_block_ids": blocks, "remote_host": "h", "remote_port": 1, "remote_request_id": "r"})
    assert scheduler._blocks_refusal(spec, 130) == why
    scheduler.set_worker(LLMDataDistHandshakeMetadata("p", 7, "127.0.0.1", 4000))
    request = SimpleNamespace(request_id="req", kv_transfer_params={"do_remote_decode": True},
                              status=RequestStatus.FINISHED_STOPPED, num_computed_tokens=130)
    assert scheduler.request_finished(request, ([0, 0, 0, 7, 8],))[1]["remote_block_ids"] == [7, 8]
