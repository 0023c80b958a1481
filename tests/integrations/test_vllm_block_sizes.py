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
def test_another_block_size_is_refused_with_both_sizes_until_the_layout_is_known(engines):
    """``block_sizes.ENABLED`` is off (vLLM's CPU attention transposes each block's keys): a decode
    engine of 64 refuses a prefill's blocks of 32, and one of 32 a prefill's of 64, each with one
    line naming both sizes, nothing pulled; the prefill's blocks are released."""
    from llm_datadist.integrations.vllm import block_sizes

    assert not block_sizes.ENABLED
    small, large = engines
    for prefill_engine, decode_engine, prompts, sizes in ((small, large, SMALL_TO_LARGE[:1], (32, 64)),
                                                          (large, small, LARGE_TO_SMALL[:1], (64, 32))):
        params = prefill(prefill_engine, prompts)
        assert params[0]["remote_block_size"] == sizes[0]
        stats = decode_engine.stats()["stats"]
        outputs = decode_engine.generate(prompts, MAX_TOKENS, params)
        assert len(outputs[0]["token_ids"]) < MAX_TOKENS
        moved = delta(decode_engine.stats()["stats"], stats)
        assert moved["failed_requests"] == 1 and moved.get("pulled_other_block_size", 0) == 0
        assert f"its block size is {sizes[0]} tokens, this engine's {sizes[1]}: KV of another block size is not " \
               "supported yet" in decode_engine.log.read_text()


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
    from llm_datadist.integrations.vllm.block_sizes import refusal, token_runs
    from llm_datadist.integrations.vllm.groups import Group

    full, window, mamba = Group(0, "full", 0, 64), Group(1, "sliding_window", 128, 64), Group(1, "mamba", 0, 64)
    for remote in (16, 32, 128, 256):
        assert refusal(remote, 64, (full,), False).startswith("KV of another block size is not supported yet")
    assert refusal(32, 64, (), False).startswith("KV of another block size")  # no config: one full group
    for remote in (0, -32, 48, 96, 2**70 + 1):
        assert refusal(remote, 64, (full,), False).startswith("neither is a whole multiple of the other")
    assert "sliding-window or state-space" in refusal(32, 64, (full, window), False)
    assert "sliding-window or state-space" in refusal(32, 64, (full, mamba), False)
    assert "tensor parallel" in refusal(32, 64, (full,), True)
    # runs: each head's keys, then its values (LBHNC: 2 x heads); MLA: one
    assert token_runs((10, 4, 64, 128), 64) == 8 and token_runs((10, 64, 576), 64) == 1
    for shape in ((10, 2, 4, 32, 128), (10, 64, 4, 128), (10, 64), (10, 4, 64, 127)):  # kernel blocks, others
        with pytest.raises(ValueError, match="kernel blocks"):
            token_runs(shape, 64)


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
    assert spec.refused.startswith("its block size is 32 tokens, this engine's 64: KV of another block size is not "
                                   "supported yet")  # (block_sizes.ENABLED off)
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
