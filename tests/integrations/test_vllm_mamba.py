"""State-space (Mamba) hybrid models (issue 25, part 1): a Mamba group's running-state block moves
beside the attention groups' blocks, and the prefill engine stops one token short of the prompt,
which the decode engine computes from the state before it (``state.py``).

The live test starts one engine pair (and a plain engine for the baseline) on a tiny NemotronH
(Mamba2 hybrid: Mamba, attention, Mamba, MLP layers) with seeded random weights of real magnitude,
the hybrid KV cache manager on and prefix caching off (vLLM 0.32's CPU build fails a Mamba prefill
with prefix caching on: ``IndexError`` in ``mamba_mixer2.conv_ssm_forward``). The unit tests below
it need vLLM but start no engine.

Needs vLLM (``pip install '.[vllm]'``, the CPU build 0.32.0); skipped without it.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from test_vllm import (BLOCK, MAX_TOKENS, Engine, close_all, delta, needs_vllm, params_of_a_gone_prefill,
                       prefill_for_remote_decode, prompts_of)

#: the hybrid manager on, no prefix caching (mamba_cache_mode "none")
ENGINE_ARGS = {"disable_hybrid_kv_cache_manager": False, "enable_prefix_caching": False}
GEOMETRY = dict(hidden=128, heads=4, kv_heads=2, head_dim=32, vocab=1000, inter=256, pattern="M*M-",
                mamba_heads=4, mamba_head_dim=32, state=16, groups=1, conv=4)
#: shorter than a block, several blocks, more than one Mamba chunk (64 tokens)
PROMPTS = prompts_of([20, 100, 257], seed=31)
FAILING = prompts_of([90], seed=32)


def write_nemotron_h(path, seed: int = 0) -> None:
    """A NemotronH checkpoint (vLLM's ``NemotronHForCausalLM``) with seeded random weights: unit
    embeddings, projections scaled by 1/sqrt(fan-in), decays and time steps in their usual ranges,
    so that outputs depend on both the attention KV and the Mamba states."""
    import torch
    from safetensors.torch import save_file

    g = GEOMETRY
    path.mkdir(parents=True, exist_ok=True)
    kinds = {"M": "mamba", "*": "attention", "-": "mlp"}
    config = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": g["vocab"],
              "hidden_size": g["hidden"], "layers_block_type": [kinds[c] for c in g["pattern"]],
              "num_attention_heads": g["heads"], "num_key_value_heads": g["kv_heads"], "head_dim": g["head_dim"],
              "intermediate_size": g["inter"], "mlp_hidden_act": "relu2", "attention_bias": False, "mlp_bias": False,
              "ssm_state_size": g["state"], "mamba_num_heads": g["mamba_heads"], "mamba_head_dim": g["mamba_head_dim"],
              "n_groups": g["groups"], "conv_kernel": g["conv"], "expand": 1, "chunk_size": 64, "use_conv_bias": True,
              "mamba_proj_bias": False, "mamba_hidden_act": "silu", "time_step_limit": [0.0, 1e30],
              "layer_norm_epsilon": 1e-5, "residual_in_fp32": False, "max_position_embeddings": 2048,
              "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
              "pad_token_id": 0, "num_nextn_predict_layers": 0}
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)

    def weight(rows: int, cols: int) -> "torch.Tensor":
        return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

    hidden, heads = g["hidden"], g["mamba_heads"]
    inner = heads * g["mamba_head_dim"]
    conv_dim = inner + 2 * g["groups"] * g["state"]
    tensors = {"model.embeddings.weight": torch.randn(g["vocab"], hidden, generator=gen),
               "model.norm_f.weight": torch.ones(hidden), "lm_head.weight": weight(g["vocab"], hidden)}
    for i, kind in enumerate(g["pattern"]):
        p = f"model.layers.{i}."
        tensors[p + "norm.weight"] = torch.ones(hidden)
        if kind == "M":
            dt = torch.exp(torch.rand(heads, generator=gen) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
            tensors.update({
                p + "mixer.in_proj.weight": weight(2 * inner + 2 * g["groups"] * g["state"] + heads, hidden),
                p + "mixer.conv1d.weight": torch.randn(conv_dim, 1, g["conv"], generator=gen) / math.sqrt(g["conv"]),
                p + "mixer.conv1d.bias": torch.zeros(conv_dim),
                p + "mixer.dt_bias": dt + torch.log(-torch.expm1(-dt)),  # softplus(dt_bias) = dt
                p + "mixer.A_log": torch.log(torch.rand(heads, generator=gen) * 15 + 1),
                p + "mixer.D": torch.ones(heads),
                p + "mixer.norm.weight": torch.ones(inner),
                p + "mixer.out_proj.weight": weight(hidden, inner)})
        elif kind == "*":
            q, kv = g["heads"] * g["head_dim"], g["kv_heads"] * g["head_dim"]
            tensors.update({p + "mixer.q_proj.weight": weight(q, hidden),
                            p + "mixer.k_proj.weight": weight(kv, hidden),
                            p + "mixer.v_proj.weight": weight(kv, hidden),
                            p + "mixer.o_proj.weight": weight(hidden, q)})
        else:
            tensors.update({p + "mixer.up_proj.weight": weight(g["inter"], hidden),
                            p + "mixer.down_proj.weight": weight(hidden, g["inter"])})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def mamba(tmp_path_factory):
    """``(baseline tokens by prompt, prefill engine, decode engine)`` of the NemotronH model."""
    work = tmp_path_factory.mktemp("vllm-mamba")
    model = work / "model"
    write_nemotron_h(model)
    started = []
    try:
        plain = Engine(model, "plain", work / "plain.log", engine_args=ENGINE_ARGS)
        started.append(plain)
        plain.wait_ready()
        everything = PROMPTS + FAILING
        # (the first token of a prompt with its first token changed: the states carry the prompt's start)
        changed = [[p[0] % 997 + 3] + p[1:] for p in PROMPTS]
        outputs = plain.generate(everything + changed, MAX_TOKENS)
        baseline = {tuple(p): o["token_ids"] for p, o in zip(everything + changed, outputs)}
        plain.close()
        prefill = Engine(model, "producer", work / "prefill.log", engine_args=ENGINE_ARGS)
        started.append(prefill)
        decode = Engine(model, "consumer", work / "decode.log", engine_args=ENGINE_ARGS)
        started.append(decode)
        prefill.wait_ready()
        decode.wait_ready()
        yield baseline, prefill, decode
    finally:
        close_all(started)


@needs_vllm
def test_a_mamba_hybrid_decodes_from_the_running_state_and_the_attention_blocks(mamba):
    baseline, prefill, decode = mamba
    # the weights make outputs depend on the prompt's start, which only the states and the KV carry
    changed = [baseline[tuple(p)] != baseline[tuple([p[0] % 997 + 3] + p[1:])] for p in PROMPTS]
    assert any(changed), changed
    params = prefill_for_remote_decode(prefill, PROMPTS)
    for p, prompt in zip(params, PROMPTS):
        groups = p["remote_block_ids"]
        assert [len(g) for g in groups] == [1, 1, math.ceil((len(prompt) - 1) / BLOCK)], groups
        assert p["remote_num_tokens"] == len(prompt) - 1  # the prefill stopped one token short
    before = decode.stats()["stats"]

    outputs = decode.generate(PROMPTS, MAX_TOKENS, params)

    for prompt, out in zip(PROMPTS, outputs):
        assert out["token_ids"] == baseline[tuple(prompt)], f"prompt of {len(prompt)} tokens"
    moved = delta(decode.stats()["stats"], before)
    assert moved["pulled_requests"] == len(PROMPTS) and moved["failed_requests"] == 0
    attention = sum(math.ceil((len(p) - 1) / BLOCK) for p in PROMPTS)
    # groups 0 and 1 are the two Mamba layers' (one running-state block per request), 2 the attention layer's
    assert (moved["pulled_blocks_group0"], moved["pulled_blocks_group1"], moved["pulled_blocks_group2"]) == \
        (len(PROMPTS), len(PROMPTS), attention), moved
    # of each state page only the states (conv 3x160, SSM 4x32x16 float32), not its padding to 16 KiB
    state_bytes = (3 * 160 + 4 * 32 * 16) * 4
    assert moved["pulled_state_bytes_group0"] == moved["pulled_state_bytes_group1"] == len(PROMPTS) * state_bytes


@needs_vllm
def test_a_failed_pull_of_a_mamba_hybrid_is_reported_per_request(mamba):
    baseline, prefill, decode = mamba
    params = prefill_for_remote_decode(prefill, FAILING)
    before = decode.stats()["stats"]
    outputs = decode.generate(FAILING, MAX_TOKENS, params_of_a_gone_prefill(params))
    assert delta(decode.stats()["stats"], before)["failed_requests"] == 1
    assert len(outputs[0]["token_ids"]) < MAX_TOKENS  # never decoded from a state that did not arrive
    again = decode.generate(FAILING, MAX_TOKENS, params)
    assert again[0]["token_ids"] == baseline[tuple(FAILING[0])]


# -- unit tests (no engine) ------------------------------------------------------------------------

PAGE = 16384  # the page the tiny model's groups share (an attention block: 32 tokens x 2 heads x 64 x 4 bytes)
CONV, SSM = (3, 160), (4, 32, 16)


def _mamba_spec(mode: str = "none", spec_blocks: int = 0, shapes=(CONV, SSM)):
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=1024, shapes=shapes, dtypes=(torch.float32,) * len(shapes), page_size_padded=PAGE,
                     mamba_cache_mode=mode, num_speculative_blocks=spec_blocks)


def _config(*specs, num_blocks: int = 8):
    """vLLM's config of the tiny model: one layer per group, all overlaying one backing buffer."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
    tensors = [KVCacheTensor(size=num_blocks * PAGE, layers=[f"layer{i}"], layer_stride=num_blocks * PAGE,
                             block_stride=PAGE) for i in range(len(specs))]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


def _attention():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)


@needs_vllm
@pytest.mark.parametrize("blocks, spec_blocks, expected", [
    ([7], 0, [7]),  # mamba_cache_mode "none": the request's one state block
    ([7, 8, 9], 2, [7]),  # two scratch blocks of speculative decoding after it
    ([7], 2, [7]),  # before the scratch blocks are allocated
    ([0, 0, 7], 0, [7]),  # null blocks before it
    ([0], 0, []),  # only the null block: nothing to move
    ([], 0, []),
])
def test_only_the_running_state_block_of_a_state_space_group_moves(blocks, spec_blocks, expected):
    from llm_datadist.integrations.vllm import groups as kv_groups
    from llm_datadist.integrations.vllm.state import running_state_block

    assert running_state_block(blocks, spec_blocks) == expected
    found = kv_groups.transfer_groups(_config(_mamba_spec(spec_blocks=spec_blocks), _attention()))
    assert [(g.kind, g.spec_blocks) for g in found] == [("mamba", spec_blocks), ("full", 0)]
    assert kv_groups.clip(found, (blocks, [1, 2, 3]), 2) == (expected, [1, 2, 3])
    assert kv_groups.expected_blocks(found, 100, BLOCK) == [(1, 1), (4, 4)]
    assert kv_groups.state_backoff(found) == 1 and kv_groups.describe(found) == "mamba:1;full:1"


@needs_vllm
def test_state_space_groups_the_connector_cannot_move_are_refused_at_start():
    from llm_datadist.integrations.vllm import groups as kv_groups

    with pytest.raises(NotImplementedError, match="mamba_cache_mode 'none' only; this engine's group 0 has 'align'"):
        kv_groups.transfer_groups(_config(_mamba_spec("align"), _attention()))
    with pytest.raises(NotImplementedError, match="state-space layers only"):
        kv_groups.transfer_groups(_config(_mamba_spec(), _mamba_spec()))
    assert kv_groups.state_backoff(kv_groups.transfer_groups(_config(_attention()))) == 0


@needs_vllm
def test_a_state_space_layers_pages_are_registered_where_vllm_put_them():
    """vLLM 0.32 hands the connector each Mamba layer as an int8 view of its pages (made here by
    vLLM's own ``create_kv_cache_views``, two layers in one buffer): the pages are registered where
    they are, and the bytes that move are the states' (conv + SSM, adjacent: one range)."""
    import torch
    from vllm.v1.kv_cache_interface import KVCacheLayout, KVCacheTensor, create_kv_cache_views

    from llm_datadist.integrations.vllm import groups as kv_groups
    from llm_datadist.integrations.vllm import state

    spec = _mamba_spec()
    buf = torch.zeros(2 * 8 * PAGE, dtype=torch.int8)
    layers = KVCacheTensor(size=buf.numel(), layers=["layer0", "layerB"], layer_stride=8 * PAGE, block_stride=PAGE)
    views = create_kv_cache_views(buf, spec, 8, KVCacheLayout.LBHNC, layers)
    config = _config(spec, _attention())
    config.kv_cache_groups[0].layer_names.append("layerB")
    group = kv_groups.transfer_groups(config)[0]
    pages, found = state.group_pages(group, {"layer0": views[0], "layerB": views[1]}, config, 8)
    assert [(p.shape, p.data_ptr() - buf.data_ptr()) for p in pages] == [((8, PAGE), 0), ((8, PAGE), 8 * PAGE)]
    conv_bytes, ssm_bytes = 3 * 160 * 4, 4 * 32 * 16 * 4
    assert found.ranges == ((0, conv_bytes + ssm_bytes),) and found.state_bytes == conv_bytes + ssm_bytes
    assert found.describe() == f"page{PAGE}:0+{conv_bytes}=[3, 160]float32,{conv_bytes}+{ssm_bytes}=[4, 32, 16]float32"
    # the layer's own per-state views (MambaBase.bind_kv_cache's) are the same bytes: layer B, block 5's SSM state
    own = [views[1].squeeze(1).squeeze(1)[:, :conv_bytes].view(torch.float32).view(8, *CONV),
           views[1].squeeze(1).squeeze(1)[:, conv_bytes:].view(torch.float32).view(8, *SSM)]
    own[1][5].fill_(2.5)
    assert pages[1][5, conv_bytes:conv_bytes + 4].view(torch.float32).item() == 2.5
    assert float(pages[0].view(torch.float32).abs().sum()) == 0.0  # (and nothing of layer 0's)
    # a layer handed over as such per-state views gives the same pages
    same = state.state_pages("layerB", own, found, 8)
    assert same.data_ptr() == pages[1].data_ptr() and same.shape == pages[1].shape
    # views that are not where the spec says, too few blocks, pages of another layout: refused
    with pytest.raises(NotImplementedError, match="its spec says"):
        state.state_pages("layerB", own[::-1], found, 8)
    with pytest.raises(NotImplementedError, match="not one contiguous range of each of 9 pages"):
        state.state_pages("layerB", views[1], found, 9)
    with pytest.raises(NotImplementedError, match="hold 1920 bytes of state"):
        state.state_pages("layerB", views[1][..., :conv_bytes], found, 8)
    packed = KVCacheTensor(size=buf.numel(), layers=["layer0", "layerB"], layer_stride=PAGE, block_stride=2 * PAGE)
    block_outermost = create_kv_cache_views(buf, spec, 8, KVCacheLayout.BLHNC, packed)
    assert state.state_pages("layer0", block_outermost[0], found, 8).shape == (8, 2 * PAGE)
    with pytest.raises(NotImplementedError, match="as whole rows"):
        state.state_pages("layerB", block_outermost[1], found, 8)
    with pytest.raises(NotImplementedError, match="a view of its pages or a tuple"):
        state.state_pages("layerB", {"conv": own[0]}, found, 8)


@needs_vllm
def test_a_prefill_stops_one_token_short_and_the_decode_side_computes_it(caplog):
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    from llm_datadist.integrations.vllm import groups as kv_groups
    from llm_datadist.integrations.vllm.meta import LLMDataDistHandshakeMetadata
    from llm_datadist.integrations.vllm.options import Options
    from llm_datadist.integrations.vllm.scheduler import Scheduler

    found = kv_groups.transfer_groups(_config(_mamba_spec(spec_blocks=1), _attention()))
    prefill = Scheduler("p", Options.parse({"lease_tokens": False}), BLOCK, producer=False, groups=found,
                        num_groups=2)
    prefill.set_worker(LLMDataDistHandshakeMetadata("p", 7, "127.0.0.1", 4000))
    request = Request("req", list(range(3, 103)), SamplingParams(max_tokens=16, extra_args={
        "kv_transfer_params": {"do_remote_decode": True}}), None)
    prefill.on_new_request(request)
    prefill.on_new_request(request)  # (preempted and scheduled again: cut once)
    assert request.num_prompt_tokens == 99 and request.prompt_token_ids == list(range(3, 102))
    assert len(request.all_token_ids) == 99 and request.max_tokens == 1
    request.num_computed_tokens = 99
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    # the state block, then a scratch block of speculative decoding; the attention group's 4 blocks
    delay, params = prefill.request_finished(request, ([9, 10], [1, 2, 3, 4]))
    assert delay and params["remote_block_ids"] == [[9], [1, 2, 3, 4]] and params["remote_num_tokens"] == 99
    assert prefill.build_connector_meta().blocks_to_send == {"req": [9, 1, 2, 3, 4]}

    decode = Scheduler("d", Options.parse({}), BLOCK, producer=False, groups=found, num_groups=2)
    incoming = SimpleNamespace(request_id="d-req", kv_transfer_params=dict(params), num_prompt_tokens=100)
    assert decode.get_num_new_matched_tokens(incoming, 0) == (99, True)  # token 100 is computed here
    blocks = SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: [[21, 22], [31, 32, 33, 34]])
    decode.update_state_after_alloc(incoming, blocks, 99)
    spec = decode.build_connector_meta().reqs_to_recv["d-req"]
    assert spec.local_groups == ([21], [31, 32, 33, 34])
    # a peer naming two state blocks (or none), or the state of another position (a prefill that
    # computed the whole prompt), or not saying which, is refused before anything moves
    wrong = [dict(params, remote_block_ids=[[9, 11], [1, 2, 3, 4]]), dict(params, remote_block_ids=[[], [1, 2, 3, 4]]),
             dict(params, remote_num_tokens=100), dict(params, remote_num_tokens=True),
             {k: v for k, v in params.items() if k != "remote_num_tokens"}]
    reasons = ["they name 2 blocks of KV cache group 0, 1 wanted", "they name 0 blocks of KV cache group 0, 1 wanted",
               "the prefill computed 100 tokens, 99 wanted", "do not say how many tokens the prefill computed",
               "do not say how many tokens the prefill computed"]
    for forged_params, reason in zip(wrong, reasons):
        forged = SimpleNamespace(request_id="f", kv_transfer_params=forged_params, num_prompt_tokens=100)
        caplog.clear()
        assert decode.get_num_new_matched_tokens(forged, 0) == (0, False)
        assert forged.kv_transfer_params["do_remote_prefill"] is False and reason in caplog.text
    # a one-token prompt has nothing to load: computed here, the prefill side still released
    short = SimpleNamespace(request_id="s", kv_transfer_params=dict(params), num_prompt_tokens=1)
    assert decode.get_num_new_matched_tokens(short, 0) == (0, False)
    assert "s" in decode.build_connector_meta().reqs_to_recv


@needs_vllm
def test_a_peer_with_other_state_shapes_is_refused_and_nothing_is_written():
    """A prefill engine whose description (its hello answer, from the network) says other state
    shapes: the request fails (``failed_recving``), no pull is made, the state pages are untouched."""
    import torch
    from test_vllm_leases import CONSUMER

    from llm_datadist.integrations.vllm import groups as kv_groups
    from llm_datadist.integrations.vllm.meta import Recv
    from llm_datadist.integrations.vllm.options import Options
    from llm_datadist.integrations.vllm.worker import Worker

    from vllm.v1.kv_cache_interface import KVCacheLayout, create_kv_cache_views

    config = _config(_mamba_spec(), _attention())
    worker = Worker(CONSUMER, "decode", Options.parse({}), config, kv_groups.transfer_groups(config))
    try:
        buf = torch.zeros(8 * PAGE, dtype=torch.int8)
        # (one buffer: the groups overlay it, as vLLM lays them out)
        pages = create_kv_cache_views(buf, config.kv_cache_groups[0].kv_cache_spec, 8, KVCacheLayout.LBHNC,
                                      config.kv_cache_tensors[0])[0]
        attention = buf.view(torch.float32).view(8, 2, 32, 64)  # (LBHNC: heads outermost in a block)
        worker.register({"layer0": pages, "layer1": attention})
        mine = worker.compat
        assert mine["kv_states"].startswith(f"0:page{PAGE}:0+1920=[3, 160]float32,1920+8192=[4, 32, 16]float32")
        assert [c.block_bytes for c in worker._classes] == [1920 + 8192, PAGE]  # (bytes a pull moves a block)
        forged = dict(mine, kv_states=mine["kv_states"].replace("[4, 32, 16]", "[4, 32, 8]"))
        replies = [{"kv_compat": forged}, {"request_id": "req-p", "released": True}]
        worker._links_api = SimpleNamespace(notify=lambda cluster, message, timeout: replies.pop(0))
        why = worker._hello(5, "127.0.0.1:1")
        assert "kv_states" in why and "[4, 32, 8]" in why
        pulls = []
        engine = SimpleNamespace(pull_block_range=lambda *a: pulls.append(a), read_tag=worker.dd.engine.read_tag)
        worker.dd = SimpleNamespace(engine=engine, finalize=worker.dd.finalize)
        worker.cm = SimpleNamespace(pull_blocks=lambda *a: pulls.append(a))
        worker.peers.on_link = lambda spec, action: action(spec.cluster_id)
        worker.peers.peer = lambda spec: SimpleNamespace(incompatible=why)
        buf.fill_(7)
        spec = Recv([], [], "127.0.0.1", 1, 5, "req-p", awaiting=True, remote_groups=([3], [4, 5]))
        worker._pull("req-d", spec.with_local(([6], [1, 2])))
        results = worker.results()
        assert results.failed_recving == {"req-d"} and results.finished_recving == {"req-d"}
        assert pulls == [] and bool((buf == 7).all()) and not replies  # refused, and the prefill side released
    finally:
        worker.close()
