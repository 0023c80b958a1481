"""Engines of different block sizes (``--block-size``): a decode engine pulls a prefill engine's
blocks of another token count, each small block one strided sub-block (head by head) of a large one
(``integrations/vllm/block_sizes.py``, ``_core.plan_sub_blocks``; each head's keys kept transposed
by vLLM's CPU attention move one dimension at a time), prefill 32 -> decode 64 and 64 -> 32 (vLLM's
CPU attention takes multiples of 32 only).

Two ``kv_both`` engines, one of block size 32 and one of 64, each the other's prefill engine, are
started once for the module, on ``test_vllm_tp``'s model whose prompt KV the tokens cannot fail to
notice. Prefix caching is off, so a prompt's baseline (computed by the decode engine itself, the
plain engine of its block size) and its pull do not meet in the cache."""

from __future__ import annotations

import re

import pytest

from test_vllm import CALL_TIMEOUT_S, LINK_SECRET, Engine, close_all, delta, needs_vllm, prompts_of
from test_vllm_tp import write_loud_model

MAX_TOKENS = 6
START_S = 300
SMALL_TO_LARGE = prompts_of([40, 70, 100], seed=41)
LARGE_TO_SMALL = prompts_of([45, 64, 97], seed=42)
LYING = prompts_of([50], seed=43)
SHORT = prompts_of([30], seed=44)


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
def test_prefill_32_decode_64_equals_the_baseline(engines):
    """A decode engine of block size 64 pulls a prefill engine's blocks of 32 (each of its blocks two
    of the prefill's, keys transposed per head: vLLM's CPU attention): its greedy tokens are the
    ones it computes alone."""
    small, large = engines
    pulled_equals_baseline(small, large, SMALL_TO_LARGE, 32)


@needs_vllm
def test_prefill_64_decode_32_equals_the_baseline(engines):
    """The reverse: a decode engine of block size 32 pulls half blocks of a prefill engine's 64."""
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
    assert len(large.generate(LYING, MAX_TOKENS)[0]["token_ids"]) == MAX_TOKENS  # it serves on


def test_params_without_the_block_size_are_checked_against_the_links(engines):
    """A router that drops ``remote_block_size``, and a prompt short enough (one block on either
    side) that the block lists fit: the request would read a 32-token block as a 64-token one; the
    block size the prefill engine said on the link refuses it in one line, and nothing moves."""
    small, large = engines
    params = prefill(small, SHORT)
    stats = large.stats()["stats"]
    dropped = {k: v for k, v in params[0].items() if k != "remote_block_size"}
    outputs = large.generate(SHORT, MAX_TOKENS, [dropped])
    assert len(outputs[0]["token_ids"]) < MAX_TOKENS
    moved = delta(large.stats()["stats"], stats)
    assert moved["failed_requests"] == 1 and moved["pulled_requests"] == 0
    assert "its request says blocks of 64 tokens, the prefill engine's link says 32" in large.log.read_text()


# -- without engines: the pairing and the refusals -------------------------------------------------

def recv(remote, local, remote_size, first_block=0):
    from llm_datadist.integrations.vllm.meta import Recv

    return Recv(list(local), list(remote), "127.0.0.1", 1, None, "p.t", remote_block_size=remote_size,
                local_first_block=first_block)


@pytest.mark.parametrize("remote, local, remote_size, first_block, expected", [
    # prefill 32 -> decode 64: each local block holds two remote ones, the last maybe one
    ([10, 11, 12], [5, 6], 32, 0, ([10, 11, 12], [5, 6], 0)),
    ([10, 11, 12, 13], [5, 6], 32, 0, ([10, 11, 12, 13], [5, 6], 0)),
    # (a decode engine that loads fewer tokens than the prefill has: the blocks its list holds)
    ([10, 11, 12], [5], 32, 0, ([10, 11], [5], 0)),
    # ... after a local prefix hit of one 64-token block: from the third remote block on
    ([10, 11, 12, 13, 14], [6, 7], 32, 1, ([12, 13, 14], [6, 7], 0)),
    # prefill 64 -> decode 32: each remote block holds two local ones
    ([10, 11], [5, 6, 7], 64, 0, ([10, 11], [5, 6, 7], 0)),
    # ... after a prefix hit of three 32-token blocks: from the second half of the second remote block
    ([10, 11, 12], [5, 6, 7], 64, 3, ([11, 12], [5, 6, 7], 1)),
    ([10, 11, 12, 13], [5], 128, 2, ([10], [5], 2)),
    ([], [], 64, 0, ([], [], 0)),
])
def test_blocks_pair_by_their_place_in_the_prompt(remote, local, remote_size, first_block, expected):
    from llm_datadist.integrations.vllm.block_sizes import sub_block_pairs

    assert sub_block_pairs(recv(remote, local, remote_size, first_block), 32 if remote_size >= 64 else 64) == expected


@pytest.mark.parametrize("remote, local, remote_size, first_block", [
    ([10], [5, 6], 32, 0),            # too few remote blocks (they come from outside)
    ([10, 11], [5, 6], 32, 1),        # a prefix hit past what the list holds
    ([10], [5, 6, 7], 64, 0),
    ([10, 11], [5, 6], 64, 3),
    ([], [5], 64, 0),
])
def test_remote_lists_that_do_not_hold_the_local_blocks_are_refused(remote, local, remote_size, first_block):
    from llm_datadist.integrations.vllm.block_sizes import sub_block_pairs

    with pytest.raises(ValueError, match="do not hold"):
        sub_block_pairs(recv(remote, local, remote_size, first_block), 32 if remote_size >= 64 else 64)


def test_what_moves_between_block_sizes_and_what_is_refused():
    from llm_datadist.integrations.vllm.block_sizes import refusal
    from llm_datadist.integrations.vllm.groups import Group

    full, window, mamba = Group(0, "full", 0, 64), Group(1, "sliding_window", 128, 64), Group(1, "mamba", 0, 64)
    for remote in (16, 32, 128, 256):
        assert refusal(remote, 64, (full,), False) == ""
    assert refusal(32, 64, (), False) == ""  # no config: one full group
    for remote in (0, -32, 48, 96, 2**70 + 1):
        assert refusal(remote, 64, (full,), False).startswith("neither is a whole multiple of the other")
    assert "sliding-window or state-space" in refusal(32, 64, (full, window), False)
    assert "sliding-window or state-space" in refusal(32, 64, (full, mamba), False)
    assert "tensor parallel" in refusal(32, 64, (full,), True)


def test_regions_follow_the_cpu_attention_layout_and_others_are_refused_by_name():
    """vLLM's CPU attention ("vec", "vec16"): per head, ``head_size`` runs of keys (transposed), then one
    run of values, in a block of the smaller size; the token dimension of the view must be the engine's
    block size. Other backends and ISAs (not verified) and other shapes are refused naming them."""
    from llm_datadist.integrations.vllm.block_sizes import regions

    # [blocks, 2 heads, 64 tokens, 2 x head size 8], float32, regions of a 32-token block
    half = 32 * 8 * 4
    expected = [(0, half, 8), (half, half, 1), (2 * half, half, 8), (3 * half, half, 1)]
    for isa in ("vec", "vec16"):
        assert regions((10, 2, 64, 16), 64, 32, 4, f"CPU_ATTN:{isa}") == expected
    for attention in ("CPU_ATTN:amx", "CPU_ATTN:neon", "FLASH_ATTN", "unknown", "CPU_ATTN:amx,CPU_ATTN:vec"):
        with pytest.raises(ValueError, match=re.escape(f"vLLM's attention {attention} (backend:ISA) is not verified")):
            regions((10, 2, 64, 16), 64, 32, 4, attention)
    for shape in ((10, 2, 4, 32, 16), (10, 64, 2, 16), (10, 64), (10, 2, 64, 15), (10, 0, 64, 16)):
        with pytest.raises(ValueError, match="kernel blocks"):
            regions(shape, 64, 32, 4, "CPU_ATTN:vec")


def test_the_layout_inside_a_block_is_asked_of_vllms_layers():
    """``Attention`` reads each layer's backend and ISA from vLLM's forward context; engines of other
    block sizes compare the verified layout (``block_layout``), engines of one block size do not."""
    from types import SimpleNamespace

    from llm_datadist.integrations.vllm import compat
    from llm_datadist.integrations.vllm.block_sizes import Attention

    def layer(name, isa=None):
        return SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: name), **({"isa": isa} if isa else {}))
    context = {"a": layer("CPU_ATTN", "vec"), "b": layer("CPU_ATTN", "vec16"), "c": layer("CPU_ATTN", "amx"),
               "d": layer("FLASH_ATTN"), "e": object()}
    config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=context),
                             cache_config=SimpleNamespace(block_size=64))
    attention = Attention(config)
    assert attention.block_size == 64
    assert attention.of(["a"]) == "CPU_ATTN:vec" and attention.of(["d"]) == "FLASH_ATTN"
    assert attention.of(["e", "zz"]) == "unknown" and attention.of(["a", "c"]) == "CPU_ATTN:amx,CPU_ATTN:vec"

    def classes(*layers):
        return [SimpleNamespace(layers=list(names)) for names in layers]
    assert attention.layout(classes(["a"], ["b"])) == "heads[keys^T,values]"
    assert attention.layout(classes(["a"], ["c"])) == "unverified CPU_ATTN:amx,CPU_ATTN:vec"
    mine = {"kv_format": compat.KV_FORMAT, "block_size": 64, "block_layout": "heads[keys^T,values]"}
    assert compat.verdict(mine, dict(mine, block_size=32)) is None
    assert "block_layout 'unverified CPU_ATTN:amx' there" in compat.verdict(
        mine, dict(mine, block_size=32, block_layout="unverified CPU_ATTN:amx"))
    assert "does not say how its KV blocks are laid out" in compat.verdict(
        mine, {"kv_format": compat.KV_FORMAT, "block_size": 32})
    assert compat.verdict(mine, dict(mine, block_layout="unverified FLASH_ATTN")) is None  # one block size


def test_the_scheduler_hands_the_worker_where_the_local_list_starts():
    """A decode scheduler of block size 64 loading a 32-token prefill's blocks: the prefill's list is
    counted in its own blocks, and the worker learns the first local block (a prefix hit's count);
    push mode refuses another block size with one line and frees the prefill's blocks."""
    from types import SimpleNamespace

    from llm_datadist.integrations.vllm.options import Options
    from llm_datadist.integrations.vllm.scheduler import Scheduler

    scheduler = Scheduler("decode", Options.parse({}), 64, producer=False)
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3, 4, 5], "remote_host": "127.0.0.1",
              "remote_port": 1, "remote_cluster_id": 5, "remote_request_id": "p.t", "remote_block_size": 32}
    request = SimpleNamespace(request_id="d", kv_transfer_params=params, prompt_token_ids=list(range(150)))
    assert scheduler.get_num_new_matched_tokens(request, 64) == (86, True)
    scheduler.update_state_after_alloc(request, SimpleNamespace(get_unhashed_block_ids=lambda: [8, 9]), 86)
    spec = scheduler.build_connector_meta().reqs_to_recv["d"]
    assert spec.refused == ""
    assert spec.local_first_block == 1 and spec.local_block_ids == [8, 9]
    # four 32-token blocks do not hold a prompt of 150 tokens: computed here, said why
    short = dict(params, remote_block_ids=[1, 2, 3, 4])
    request = SimpleNamespace(request_id="e", kv_transfer_params=short, prompt_token_ids=list(range(150)))
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False) and not short["do_remote_prefill"]

    push = Scheduler("decode", Options.parse({"transfer_mode": "push"}), 64, producer=False)
    request = SimpleNamespace(request_id="f", kv_transfer_params=dict(params, do_remote_prefill=True),
                              prompt_token_ids=list(range(150)))
    assert push.get_num_new_matched_tokens(request, 0) == (0, False)
    assert not request.kv_transfer_params["do_remote_prefill"]
    reg = push.build_connector_meta().push_regs["f"]
    assert reg.local_block_ids == [] and not reg.awaiting  # a bare registration: the prefill frees its blocks
