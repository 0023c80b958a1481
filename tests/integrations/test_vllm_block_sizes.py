"""Engines of different block sizes (``--block-size``): a decode engine pulls a prefill engine's
blocks of another token count, each small block one strided sub-block (head by head) of a large one
(``integrations/vllm/block_sizes.py``, ``_core.plan_sub_blocks``), prefill 32 -> decode 64 and
64 -> 32 (vLLM's CPU attention takes multiples of 32 only).

Two ``kv_both`` engines, one of block size 32 and one of 64, each the other's prefill engine, are
started once for the module, on ``test_vllm_tp``'s model whose prompt KV the tokens cannot fail to
notice. Prefix caching is off, so a prompt's baseline (computed by the decode engine itself, the
plain engine of its block size) and its pull do not meet in the cache."""

from __future__ import annotations

import pytest

from test_vllm import CALL_TIMEOUT_S, LINK_SECRET, Engine, close_all, delta, needs_vllm, prompts_of
from test_vllm_tp import write_loud_model

MAX_TOKENS = 6
START_S = 300
SMALL_TO_LARGE = prompts_of([40, 70, 100], seed=41)
LARGE_TO_SMALL = prompts_of([45, 64, 97], seed=42)
LYING = prompts_of([50], seed=43)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """``(engine of block size 32, engine of block size 64)``, both ``kv_both``."""
    work = tmp_path_factory.mktemp("vllm_block_sizes")
    write_loud_model(work / "model")
    extra = {"kv_lease_s": 300, "link_secret": LINK_SECRET}
    started = []
    try:
        for size in (32, 64):
            started.append(Engine(work / "model", "both", work / f"engine{size}.log", extra,
                                  {"block_size": size, "enable_prefix_caching": False}))
        for engine in started:
            assert engine._read(START_S) == {"ready": True}
        yield tuple(started)
    finally:
        close_all(started)


def prefill(engine: Engine, prompts) -> list:
    outputs = engine.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts), timeout=2 * CALL_TIMEOUT_S)
    return [o["kv_transfer_params"] for o in outputs]


def pulled_equals_baseline(prefill_engine: Engine, decode_engine: Engine, prompts, prefill_size: int) -> None:
    """The decode engine's greedy tokens from the pulled KV are the ones it computes alone, every prompt
    token came from the prefill engine, and the pulls went through the sub-block path."""
    baseline = [o["token_ids"] for o in decode_engine.generate(prompts, MAX_TOKENS)]
    params = prefill(prefill_engine, prompts)
    assert [p["remote_block_size"] for p in params] == [prefill_size] * len(prompts)
    assert [len(p["remote_block_ids"]) for p in params] == [-(-len(q) // prefill_size) for q in prompts]
    tokens, stats = decode_engine.prompt_tokens(), decode_engine.stats()["stats"]

    outputs = decode_engine.generate(prompts, MAX_TOKENS, params, timeout=2 * CALL_TIMEOUT_S)

    for prompt, out, expected in zip(prompts, outputs, baseline):
        assert out["token_ids"] == expected, f"prompt of {len(prompt)} tokens"
    sources = delta(decode_engine.prompt_tokens(), tokens)
    assert sources["local_compute"] == 0 and sources["external_kv_transfer"] == sum(map(len, prompts))
    moved = delta(decode_engine.stats()["stats"], stats)
    assert moved["pulled_requests"] == len(prompts) and moved["failed_requests"] == 0
    assert moved["pulled_other_block_size"] == len(prompts)


@needs_vllm
def test_a_prefill_of_block_size_32_feeds_a_decode_of_64(engines):
    small, large = engines
    pulled_equals_baseline(small, large, SMALL_TO_LARGE, 32)


@needs_vllm
def test_a_prefill_of_block_size_64_feeds_a_decode_of_32(engines):
    small, large = engines
    pulled_equals_baseline(large, small, LARGE_TO_SMALL, 64)


@needs_vllm
def test_a_block_size_that_is_no_multiple_is_refused_with_both_sizes(engines):
    """Params that claim a block size the decode engine's is no multiple of (a lying or foreign
    prefill engine): nothing is pulled, the load fails (vLLM's default ``kv_load_failure_policy``),
    one line names both sizes, and the engine serves on."""
    small, large = engines
    params = prefill(small, LYING)
    stats = large.stats()["stats"]
    outputs = large.generate(LYING, MAX_TOKENS, [dict(params[0], remote_block_size=48)])
    assert len(outputs[0]["token_ids"]) < MAX_TOKENS
    moved = delta(large.stats()["stats"], stats)
    assert moved["failed_requests"] == 1 and moved["pulled_requests"] == 0
    assert moved.get("pulled_other_block_size", 0) == 0
    log = large.log.read_text()
    assert "its block size is 48 tokens, this engine's 64: neither is a whole multiple of the other" in log
    again = large.generate(LYING, MAX_TOKENS, prefill(small, LYING), timeout=2 * CALL_TIMEOUT_S)
    assert again[0]["token_ids"] == large.generate(LYING, MAX_TOKENS)[0]["token_ids"]
