"""``plan_sub_blocks``: blocks of different token counts on the two sides (a vLLM prefill engine
of block size 32 and a decode engine of 64, or the reverse). A block is ``runs`` runs (KV heads),
each its tokens in order, so a small block is, run by run, one strided sub-block of a large one.

The core is checked against the pure-Python reference (``_reference.plan_sub_blocks``) on real
memory framed by guard bytes, through ``test_plans_property.check``: the same bytes move, nothing
outside the asked-for ranges is written, hostile block ids, sizes, counts and offsets are refused
by both, naming the value, with nothing written. One more oracle speaks in tensors: numpy's view
of a ``[blocks, heads, tokens, bytes]`` cache."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from refusals import assert_both_refuse
from test_plans_property import (GUARD, H2H, HOST, HUGE, PROPERTY, Cache, check, pattern_bytes, random_bytes,
                                 tensor_selections)

from llm_datadist import _core
from llm_datadist import _reference as ref


@st.composite
def sub_block_cases(draw):
    """Caches whose block sizes differ by a whole ratio (either side the larger), block lists of
    the lengths that fit, and now and then one hostile value."""
    runs, piece, ratio = draw(st.integers(1, 4)), draw(st.integers(1, 8)), draw(st.integers(1, 4))
    small_bytes = runs * piece
    src_large = draw(st.booleans())
    packed = draw(st.booleans())
    nt = draw(st.integers(1, 3))
    small_rows, large_rows = draw(st.integers(1, 10)), draw(st.integers(1, 6))
    fill_src, fill_dst = random_bytes(draw(st.integers(0, 2**32))), pattern_bytes
    large = Cache(nt, large_rows, small_bytes * ratio, fill_src if src_large else fill_dst, packed)
    small = Cache(draw(st.integers(1, 3)) if draw(st.booleans()) else nt, small_rows, small_bytes,
                  fill_dst if src_large else fill_src, packed)
    src, dst = (large, small) if src_large else (small, large)
    tensors = draw(tensor_selections(len(src.addrs), len(dst.addrs)))
    first = draw(st.integers(0, ratio - 1))
    small_list = draw(st.lists(st.integers(0, small_rows - 1), max_size=8, unique=True))
    wanted = -(-(first + len(small_list)) // ratio) if small_list else 0
    large_list = draw(st.lists(st.integers(0, large_rows - 1), min_size=wanted, max_size=wanted))
    how = draw(st.sampled_from([None] * 8 + ["id", "count", "runs", "first", "size"]))
    if how == "id" and small_list:
        small_list[draw(st.integers(0, len(small_list) - 1))] = draw(st.sampled_from([-1, small_rows, HUGE]))
    elif how == "count":
        large_list = large_list[:-1] if large_list and draw(st.booleans()) else large_list + [0]
    elif how == "runs":
        runs = draw(st.sampled_from([0, -1, small_bytes + 1, HUGE]))
    elif how == "first":
        first = draw(st.sampled_from([ratio, ratio + 1, -1, 2**64]))
    elif how == "size" and small_bytes > 1:
        # a large side that is no whole multiple of the small one
        odd = Cache(nt, large_rows, small_bytes * ratio + 1, pattern_bytes, packed)
        src, dst = (odd, small) if src_large else (small, odd)
    src_blocks, dst_blocks = (large_list, small_list) if src is not small else (small_list, large_list)
    return src, dst, tensors, src_blocks, dst_blocks, runs, first


@PROPERTY
@given(sub_block_cases())
def test_plan_sub_blocks_matches_reference(case):
    src, dst, (src_tensors, dst_tensors), src_blocks, dst_blocks, runs, first = case
    check(lambda: _core.plan_sub_blocks(src.layout, dst.layout, src_tensors, dst_tensors, src_blocks, dst_blocks,
                                        runs, first),
          lambda: ref.plan_sub_blocks(*src.geometry, *dst.geometry, src_tensors, dst_tensors, src_blocks,
                                      dst_blocks, runs, first),
          src, dst)


def views(cache, heads, tokens):
    """Each tensor of ``cache`` as numpy's ``[blocks, heads, tokens, bytes]`` (vLLM's LBHNC layer view)."""
    rows, row_bytes = cache.geometry[1], cache.geometry[2]
    return [b[GUARD:-GUARD].reshape(rows, heads, tokens, row_bytes // (heads * tokens)) for b in cache.buffers]


@pytest.mark.parametrize("src_tokens, dst_tokens", [(32, 64), (64, 32), (16, 64)])
def test_blocks_of_other_token_counts_hold_the_same_tokens(src_tokens, dst_tokens):
    """Prompt KV of 70 tokens (3 blocks of 32, 2 of 64, 5 of 16): after the pull, the tokens of the
    prompt at each head are the source's, in the destination's blocks in the destination's order; the
    destination's other blocks, and the guards, are untouched."""
    heads, token_bytes, prompt = 2, 4, 70
    src = Cache(2, 8, heads * src_tokens * token_bytes, random_bytes(31))
    dst = Cache(2, 8, heads * dst_tokens * token_bytes, pattern_bytes)
    before = [b.copy() for b in dst.buffers]
    src_list = [5, 1, 7, 0, 3][:-(-prompt // src_tokens)]
    dst_list = [6, 2, 4, 0, 7][:-(-prompt // dst_tokens)]
    plan = _core.plan_sub_blocks(src.layout, dst.layout, None, None, src_list, dst_list, heads)
    _core.execute(plan, HOST, H2H)
    covered = min(len(src_list) * src_tokens, len(dst_list) * dst_tokens)
    for had, got, old in zip(views(src, heads, src_tokens), views(dst, heads, dst_tokens),
                             views_of(before, dst, heads, dst_tokens)):
        # [heads, tokens, bytes] of the prompt on each side
        sent = np.concatenate([had[b] for b in src_list], axis=1)[:, :covered]
        landed = np.concatenate([got[b] for b in dst_list], axis=1)[:, :covered]
        assert np.array_equal(sent, landed)
        for b in set(range(8)) - set(dst_list):
            assert np.array_equal(got[b], old[b])
        tail = len(dst_list) * dst_tokens - covered  # a last block's tokens no source block has
        if tail:
            assert np.array_equal(got[dst_list[-1]][:, dst_tokens - tail:], old[dst_list[-1]][:, dst_tokens - tail:])
    assert src.guards_intact() and dst.guards_intact()


def views_of(buffers, cache, heads, tokens):
    rows, row_bytes = cache.geometry[1], cache.geometry[2]
    return [b[GUARD:-GUARD].reshape(rows, heads, tokens, row_bytes // (heads * tokens)) for b in buffers]


def test_a_list_that_starts_inside_a_large_block():
    """``first``: small blocks pulled after a prefix that ends inside a large block (a decode engine of
    smaller blocks with a prefix hit of an odd count) start at that sub-block."""
    src = Cache(1, 4, 2 * 8 * 2, random_bytes(32))  # 2 heads, 8 tokens, 2 bytes
    dst = Cache(1, 4, 2 * 4 * 2, pattern_bytes)  # 2 heads, 4 tokens
    plan = _core.plan_sub_blocks(src.layout, dst.layout, None, None, [2, 3], [1, 0, 3], 2, 1)
    _core.execute(plan, HOST, H2H)
    had, got = views(src, 2, 8)[0], views(dst, 2, 4)[0]
    assert np.array_equal(got[1], had[2][:, 4:]) and np.array_equal(got[0], had[3][:, :4])
    assert np.array_equal(got[3], had[3][:, 4:])
    assert len(plan) == 6  # one copy per block and head


@pytest.mark.parametrize("src_blocks, dst_blocks, runs, first, bad", [
    ([0, 1, 2], [0], 2, 0, 1),                  # 3 small blocks fill 2 large ones, not 1
    ([0, 1], [0, 1], 2, 0, 2),                  # nor 2 small ones 2 large ones
    ([0, 4], [0], 2, 0, 4),                     # a block the cache does not have
    ([0, -1], [0], 2, 0, -1),
    ([0, 2**64 - 1], [0], 2, 0, 2**64 - 1),
    ([0, 1], [0], 3, 0, 3),                     # runs that do not divide a block
    ([0, 1], [0], 0, 0, 0),
    ([0, 1], [0], -1, 0, -1),
    ([0], [0], 2, 2, 2),                        # a sub-block a large block does not have
    ([0], [0], 2, 2**64, 2**64),
])
def test_hostile_lists_and_sizes_are_refused_by_name(src_blocks, dst_blocks, runs, first, bad):
    src = Cache(2, 4, 16, random_bytes(33))
    dst = Cache(2, 4, 32, pattern_bytes)
    before = [b.copy() for b in dst.buffers]
    assert_both_refuse(
        lambda: _core.plan_sub_blocks(src.layout, dst.layout, None, None, src_blocks, dst_blocks, runs, first),
        lambda: ref.plan_sub_blocks(*src.geometry, *dst.geometry, None, None, src_blocks, dst_blocks, runs, first),
        bad)
    assert all(np.array_equal(b, a) for b, a in zip(dst.buffers, before))


def test_sizes_that_are_no_multiple_are_refused():
    src = Cache(1, 4, 24, random_bytes(34))
    dst = Cache(1, 4, 32, pattern_bytes)
    assert_both_refuse(lambda: _core.plan_sub_blocks(src.layout, dst.layout, None, None, [0], [0], 1),
                       lambda: ref.plan_sub_blocks(*src.geometry, *dst.geometry, None, None, [0], [0], 1), 24)
