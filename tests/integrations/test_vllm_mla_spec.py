"""MLA and speculative decoding with live CPU engines (issue 25, part 2).

* MLA: a tiny DeepseekV2 checkpoint (random weights of real magnitude, made here with transformers'
  DeepseekV2 classes) on vLLM's CPU MLA backend (one latent cache of 576 values per token, blocks of
  16 tokens). The decode engine's KV after a pull is compared byte for byte with the prefill
  engine's, and its greedy output with a plain engine's.
* ngram speculative decoding on the decode engine only (the prefill engine has none).
* EAGLE: a random EAGLE head made here (one Llama layer with 4 KV heads where the target has 2),
  on both engines: the drafter's layer is a cache of its own shape, registered and moved as such.

Greedy outputs are compared one prompt at a time: vLLM 0.32's CPU MLA backend gives other tokens
for one prompt depending on the batch it is in (a plain engine, no connector), so only a lone
request has one right answer.

Needs vLLM (the CPU build 0.32.0); skipped without it. Heavy: each case runs its engines once.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_vllm import (GEOMETRY, MAX_TOKENS, Engine, close_all, needs_vllm, prefill_for_remote_decode, prompts_of,
                       write_model)

pytestmark = needs_vllm

MLA_BLOCK = 16  # vLLM's CPU MLA backend forces it
#: vLLM's reference CPU MLA backend, which takes the checkpoint's float32 weights; on a CPU with AMX
#: tiles vLLM 0.32 picks its AMX MLA backend instead, which refuses them ("expect weight to be
#: bfloat16, float16, int8, fp8_e4m3 or uint8") before the connector does anything.
MLA_ENGINE_ARGS = {"attention_config": {"backend": "CPU_MLA"}}
LLAMA_BLOCK = 32
#: blocks of a fresh engine a test reads back (a request's blocks are among the first ones)
DUMPED = list(range(1, 24))
#: (n - 1) % block != 0: the last prompt token shares its block with the one before
MLA_PROMPTS = prompts_of([20, 45, 90], seed=41)
SPEC_EAGLE = {"method": "eagle", "num_speculative_tokens": 2}
SPEC_NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def repeating_prompts(seed: int) -> list:
    """Prompts that repeat a phrase (ngram decoding proposes tokens from such a prompt)."""
    rng = np.random.default_rng(seed)
    out = []
    for phrase, times, tail in ((9, 5, 7), (13, 6, 3), (6, 4, 10)):
        words = rng.integers(3, GEOMETRY["vocab"], size=phrase).tolist()
        out.append(words * times + rng.integers(3, GEOMETRY["vocab"], size=tail).tolist())
    return out


SPEC_PROMPTS = repeating_prompts(seed=42)


def write_deepseek(path: Path, seed: int = 0) -> None:
    """A tiny DeepseekV2 checkpoint (MLA: kv_lora_rank 512 and a rotary part of 64, what the CPU
    decode kernel takes; dense MLP layers) with seeded random weights of real magnitude."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=GEOMETRY["vocab"], hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=2, max_position_embeddings=2048, tie_word_embeddings=False,
        rope_theta=10000.0, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                scale = 1.0 if "embed" in name else math.sqrt(param.shape[1])
                param.copy_(torch.randn(param.shape, generator=gen) / scale)
            else:
                param.fill_(1.0)
    model.save_pretrained(path, safe_serialization=True)


def write_eagle(path: Path, seed: int = 5) -> None:
    """A random EAGLE head for ``write_model``'s target: one Llama layer (no input norm), ``fc`` over
    the token embedding and the target's hidden state; 4 KV heads where the target has 2, so its
    KV cache has a shape of its own."""
    import torch
    from safetensors.torch import save_file

    g, heads, head_dim = GEOMETRY, 4, 32
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": g["hidden"],
              "intermediate_size": g["inter"], "num_hidden_layers": 1, "num_attention_heads": heads,
              "num_key_value_heads": heads, "head_dim": head_dim, "vocab_size": g["vocab"],
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
              "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)

    def weight(rows: int, cols: int) -> "torch.Tensor":
        return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

    hidden, p = g["hidden"], "layers.0."
    save_file({"fc.weight": weight(hidden, 2 * hidden),
               "embed_tokens.weight": torch.randn(g["vocab"], hidden, generator=gen),
               p + "self_attn.q_proj.weight": weight(heads * head_dim, hidden),
               p + "self_attn.k_proj.weight": weight(heads * head_dim, hidden),
               p + "self_attn.v_proj.weight": weight(heads * head_dim, hidden),
               p + "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
               p + "mlp.gate_proj.weight": weight(g["inter"], hidden),
               p + "mlp.up_proj.weight": weight(g["inter"], hidden),
               p + "mlp.down_proj.weight": weight(hidden, g["inter"]),
               p + "post_attention_layernorm.weight": torch.ones(hidden)}, str(path / "model.safetensors"))


def block_shapes(engine: Engine) -> dict:
    """``{layer: (heads, tokens, values)}``: the shape of one block of each layer's registered cache."""
    return {name: tuple(cache["shape"][1:]) for cache in engine.stats()["registration"]["caches"]
            for name in cache["layers"]}


def kv_rows(engine: Engine, path: Path) -> dict:
    """Every layer's KV of the engine's first blocks, ``{layer: [blocks, heads, tokens, values]}`` (float32)."""
    shapes = block_shapes(engine)
    engine.call(op="kv_blocks", blocks=DUMPED, path=str(path))
    with np.load(path) as saved:
        return {name: saved[name].view(np.float32).reshape(len(DUMPED), *shapes[name]) for name in saved.files}


def find_prompt_kv(prefill: dict, decode: dict, remote_blocks: list, tokens: int, by_token: bool) -> dict:
    """Where the decode engine holds the prompt's KV the prefill engine computed: for each layer and
    each of the request's prefill blocks before its last prompt token (which the decode engine
    computes itself), the decode block that holds the same bytes. ``by_token``: a block's token
    slots are its rows (MLA: ``[1, tokens, values]``), so a block's slots up to that token count
    too; else (vLLM's CPU attention keeps a block in a layout of its own) whole blocks only. Asserts
    each one is found; returns ``{layer: [decode block index per prefill block compared]}``."""
    found = {}
    for name, rows in prefill.items():
        block = rows.shape[2]
        mine = []
        for k, remote in enumerate(remote_blocks):
            valid = min(block, tokens - 1 - k * block)
            if valid < block and not by_token:
                break
            want = rows[DUMPED.index(remote), :, :valid]
            hits = [i for i in range(len(DUMPED)) if np.array_equal(decode[name][i, :, :valid], want)]
            assert hits, f"{name}: the prompt's block {k} (prefill block {remote}) is not on the decode engine"
            mine.append(hits[0])
        found[name] = mine
    return found


def single(engine: Engine, prompts, params=None) -> list:
    """Greedy tokens of each prompt, one request at a time."""
    params = params or [None] * len(prompts)
    return [engine.generate([prompt], MAX_TOKENS, [p] if p is not None else None)[0]["token_ids"]
            for prompt, p in zip(prompts, params)]


# -- MLA -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    if not hasattr(pytest.importorskip("transformers"), "DeepseekV2ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV2 classes to write the checkpoint with")
    work = tmp_path_factory.mktemp("vllm-mla")
    model = work / "model"
    write_deepseek(model)
    started = []
    try:
        plain = Engine(model, "plain", work / "plain.log", engine_args=MLA_ENGINE_ARGS)
        started.append(plain)
        plain.wait_ready()
        baseline = single(plain, MLA_PROMPTS)
        plain.close()
        prefill = Engine(model, "producer", work / "prefill.log", engine_args=MLA_ENGINE_ARGS)
        started.append(prefill)
        decode = Engine(model, "consumer", work / "decode.log", engine_args=MLA_ENGINE_ARGS)
        started.append(decode)
        prefill.wait_ready()
        decode.wait_ready()
        yield work, baseline, prefill, decode
    finally:
        close_all(started)


def test_an_mla_model_moves_its_latent_cache_exactly(mla):
    """The MLA cache registers as one cache of 576 values a token; each prompt's KV arrives bit for
    bit; greedy output equals a plain engine's where vLLM computes the token the decode engine
    recomputes at its right position (see the xfail below)."""
    work, baseline, prefill, decode = mla
    caches = decode.stats()["registration"]["caches"]
    assert [(c["shape"][1:], c["dtype"], len(c["layers"])) for c in caches] == [([1, MLA_BLOCK, 576], "float32", 2)]
    wrong_position = []
    for n, (prompt, expected) in enumerate(zip(MLA_PROMPTS, baseline)):
        params = prefill_for_remote_decode(prefill, [prompt])[0]
        sent = kv_rows(prefill, work / f"p{n}.npz")
        out = decode.generate([prompt], MAX_TOKENS, [params])[0]["token_ids"]
        got = kv_rows(decode, work / f"d{n}.npz")
        where = find_prompt_kv(sent, got, params["remote_block_ids"], len(prompt), by_token=True)
        # the last prompt token, which the decode engine computes: its latent part (512 values) in the
        # first layer depends on the token alone, its rotary part (64) on its position too
        last, row = (len(prompt) - 1) // MLA_BLOCK, (len(prompt) - 1) % MLA_BLOCK
        first = sorted(sent)[0]
        theirs = sent[first][DUMPED.index(params["remote_block_ids"][last]), 0, row]
        mine = got[first][where[first][last], 0, row]
        assert np.allclose(mine[:512], theirs[:512], rtol=1e-5, atol=1e-5)
        if np.allclose(mine[512:], theirs[512:], rtol=1e-4, atol=1e-4):
            assert out == expected, f"prompt of {len(prompt)} tokens"
        else:
            wrong_position.append(len(prompt))
    if wrong_position:
        pytest.xfail(f"vLLM 0.32's CPU MLA backend rotates the last prompt token, which a decode engine computes "
                     f"after a pull, at another position than the prefill did (prompts of {wrong_position} tokens); "
                     "the pulled KV itself arrived bit for bit")


# -- speculative decoding (a Llama target) ---------------------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory, plain_engine):
    """``(work dir, target model, EAGLE head, baseline tokens of SPEC_PROMPTS)``: a plain engine
    without speculative decoding (the session's, on the same weights: ``conftest.py``) gives the
    baseline."""
    work = tmp_path_factory.mktemp("vllm-spec")
    write_model(work / "target")
    write_eagle(work / "eagle")
    baseline = single(plain_engine.engine(), SPEC_PROMPTS)
    return work, work / "target", work / "eagle", baseline


def pair(work: Path, model: Path, name: str, prefill_args: dict, decode_args: dict):
    prefill = Engine(model, "producer", work / f"{name}-prefill.log", engine_args=prefill_args)
    decode = Engine(model, "consumer", work / f"{name}-decode.log", engine_args=decode_args)
    try:
        prefill.wait_ready()
        decode.wait_ready()
    except BaseException:
        close_all([prefill, decode])
        raise
    return prefill, decode


def drafts(engine: Engine) -> int:
    return engine.call(op="vllm_metrics", prefix="vllm:spec_decode_num_draft_tokens")["metrics"].get(
        "vllm:spec_decode_num_draft_tokens", 0)


def test_ngram_speculative_decoding_on_the_decode_engine_gives_the_baseline(llama):
    work, model, _, baseline = llama
    prefill, decode = pair(work, model, "ngram", {}, {"speculative_config": SPEC_NGRAM})
    try:
        params = [prefill_for_remote_decode(prefill, [p])[0] for p in SPEC_PROMPTS]
        assert single(decode, SPEC_PROMPTS, params) == baseline
        stats = decode.stats()["stats"]
        assert stats["pulled_requests"] == len(SPEC_PROMPTS) and stats["failed_requests"] == 0
        assert stats["pulled_blocks"] == sum(math.ceil(len(p) / LLAMA_BLOCK) for p in SPEC_PROMPTS)
        assert drafts(decode) > 0  # the decode engine did speculate
    finally:
        close_all([prefill, decode])


def test_an_eagle_drafters_cache_of_its_own_shape_moves_and_the_output_is_the_baseline(llama):
    work, model, eagle, baseline = llama
    spec = {"speculative_config": dict(SPEC_EAGLE, model=str(eagle))}
    prefill, decode = pair(work, model, "eagle", spec, spec)
    try:
        caches = decode.stats()["registration"]["caches"]
        heads = GEOMETRY["kv_heads"]
        drafter = f"model.layers.{GEOMETRY['layers']}.self_attn.attn"  # (after the target's layers)
        assert [(c["group"], c["shape"][1], c["layers"]) for c in caches] == [
            (0, heads, [f"model.layers.{i}.self_attn.attn" for i in range(GEOMETRY["layers"])]), (0, 4, [drafter])]
        assert caches == prefill.stats()["registration"]["caches"]
        before = decode.stats()["stats"]
        outputs = []
        for n, prompt in enumerate(SPEC_PROMPTS):
            params = prefill_for_remote_decode(prefill, [prompt])[0]
            sent = kv_rows(prefill, work / f"eagle-p{n}.npz")
            outputs.append(single(decode, [prompt], [params])[0])
            got = kv_rows(decode, work / f"eagle-d{n}.npz")
            # every layer's prompt KV arrived, the drafter's included (the blocks before the last token)
            where = find_prompt_kv(sent, got, params["remote_block_ids"], len(prompt), by_token=False)
            assert drafter in where and all(len(found) == (len(prompt) - 1) // LLAMA_BLOCK for found in where.values())
        assert outputs == baseline
        stats = decode.stats()["stats"]
        blocks = sum(math.ceil(len(p) / LLAMA_BLOCK) for p in SPEC_PROMPTS)
        moved = {k: stats.get(k, 0) - before.get(k, 0) for k in ("pulled_blocks", "pulled_blocks_cache0",
                                                                   "pulled_blocks_cache1", "failed_requests")}
        assert moved == {"pulled_blocks": blocks, "pulled_blocks_cache0": blocks, "pulled_blocks_cache1": blocks,
                         "failed_requests": 0}
        assert drafts(decode) > 0
    finally:
        close_all([prefill, decode])


def test_a_decode_engine_without_the_drafter_refuses_an_eagle_prefill(llama):
    """Engines that disagree on the caches (the prefill engine has the drafter's, the decode engine
    not): refused in one line, the request computed again by vLLM, never decoded from half the KV."""
    work, model, eagle, _ = llama
    spec = {"speculative_config": dict(SPEC_EAGLE, model=str(eagle))}
    prefill, decode = pair(work, model, "mismatch", spec, {})
    try:
        params = prefill_for_remote_decode(prefill, SPEC_PROMPTS[:1])
        out = decode.generate(SPEC_PROMPTS[:1], MAX_TOKENS, params)
        stats = decode.stats()["stats"]
        assert stats["failed_requests"] == 1 and stats["pulled_blocks"] == 0
        # kv_load_failure_policy "fail" (vLLM's default): the request ends without decoded tokens
        assert len(out[0]["token_ids"]) < MAX_TOKENS
        assert "caches: it registers 2 KV caches, this engine 1" in decode.tail(200)
    finally:
        close_all([prefill, decode])
