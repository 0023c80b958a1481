"""``plan_sub_blocks``: blocks of different token counts on the two sides (a vLLM prefill engine
of block size 32 and a decode engine of 64, or the reverse). A small block is regions ``(offset,
nbytes, runs)``, each ``runs`` runs of its tokens in order (a KV head's values; one dimension of its
keys where vLLM's CPU attention keeps them transposed); in a large block each region lies at ``ratio``
times its offset, ``ratio`` times as long, so a small block is, run by run, one strided sub-block of a
large one.

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
    ratio = draw(st.integers(1, 4))
    # regions: gaps and lengths in units, each region's runs dividing its length
    regions, at = [], 0
    for _ in range(draw(st.integers(1, 4))):
        at += draw(st.integers(0, 3))
        runs, piece = draw(st.integers(1, 4)), draw(st.integers(1, 4))
        regions.append((at, runs * piece, runs))
        at += runs * piece
    small_bytes = at + draw(st.integers(0, 3))
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
    how = draw(st.sampled_from([None] * 8 + ["id", "count", "runs", "region", "first", "size"]))
    if how == "id" and small_list:
        small_list[draw(st.integers(0, len(small_list) - 1))] = draw(st.sampled_from([-1, small_rows, HUGE]))
    elif how == "count":
        large_list = large_list[:-1] if large_list and draw(st.booleans()) else large_list + [0]
    elif how == "runs":
        k = draw(st.integers(0, len(regions) - 1))
        regions[k] = (regions[k][0], regions[k][1], draw(st.sampled_from([0, -1, regions[k][1] + 1, HUGE])))
    elif how == "region":
        # past the block's end, overlapping the one before, empty, negative
        k = draw(st.integers(0, len(regions) - 1))
        offset, nbytes, runs = regions[k]
        regions[k] = draw(st.sampled_from([(small_bytes, 1, 1), (offset, small_bytes - offset + 1, 1),
                                           (offset, 0, 1), (-1, nbytes, runs), (HUGE, 1, 1)]
                                          + ([(regions[k - 1][0], nbytes, runs)] if k else [])))
    elif how == "first":
        first = draw(st.sampled_from([ratio, ratio + 1, -1, 2**64]))
    elif how == "size" and small_bytes > 1:
        # a large side that is no whole multiple of the small one
        odd = Cache(nt, large_rows, small_bytes * ratio + 1, pattern_bytes, packed)
        src, dst = (odd, small) if src_large else (small, odd)
    src_blocks, dst_blocks = (large_list, small_list) if src is not small else (small_list, large_list)
    return src, dst, tensors, src_blocks, dst_blocks, regions, first


@PROPERTY
@given(sub_block_cases())
def test_plan_sub_blocks_matches_reference(case):
    src, dst, (src_tensors, dst_tensors), src_blocks, dst_blocks, regions, first = case
    check(lambda: _core.plan_sub_blocks(src.layout, dst.layout, src_tensors, dst_tensors, src_blocks, dst_blocks,
                                        regions, first),
          lambda: ref.plan_sub_blocks(*src.geometry, *dst.geometry, src_tensors, dst_tensors, src_blocks,
                                      dst_blocks, regions, first),
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
    small = heads * min(src_tokens, dst_tokens) * token_bytes
    plan = _core.plan_sub_blocks(src.layout, dst.layout, None, None, src_list, dst_list, [(0, small, heads)])
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
    plan = _core.plan_sub_blocks(src.layout, dst.layout, None, None, [2, 3], [1, 0, 3], [(0, 16, 2)], 1)
    _core.execute(plan, HOST, H2H)
    had, got = views(src, 2, 8)[0], views(dst, 2, 4)[0]
    assert np.array_equal(got[1], had[2][:, 4:]) and np.array_equal(got[0], had[3][:, :4])
    assert np.array_equal(got[3], had[3][:, 4:])
    assert len(plan) == 6  # one copy per block and head


@pytest.mark.parametrize("src_blocks, dst_blocks, regions, first, bad", [
    ([0, 1, 2], [0], [(0, 16, 2)], 0, 1),       # 3 small blocks fill 2 large ones, not 1
    ([0, 1], [0, 1], [(0, 16, 2)], 0, 2),       # nor 2 small ones 2 large ones
    ([0, 4], [0], [(0, 16, 2)], 0, 4),          # a block the cache does not have
    ([0, -1], [0], [(0, 16, 2)], 0, -1),
    ([0, 2**64 - 1], [0], [(0, 16, 2)], 0, 2**64 - 1),
    ([0, 1], [0], [(0, 16, 3)], 0, 3),          # runs that do not divide a region
    ([0, 1], [0], [(0, 16, 0)], 0, 0),
    ([0, 1], [0], [(0, 16, -1)], 0, -1),
    ([0, 1], [0], [(0, 8, 1), (8, 9, 1)], 0, 9),   # a region past the small block's end
    ([0, 1], [0], [(16, 1, 1)], 0, 16),
    ([0, 1], [0], [(2**64 - 1, 2, 1)], 0, 2**64 - 1),  # (offset + nbytes overflows 64 bits)
    ([0, 1], [0], [(0, 8, 1), (4, 4, 1)], 0, 4),   # overlapping regions
    ([0, 1], [0], [(8, 8, 1), (0, 8, 1)], 0, 0),   # (out of order)
    ([0, 1], [0], [(0, 0, 1)], 0, 0),           # an empty region
    ([0, 1], [0], [(0, 8)], 0, "(0, 8)"),       # no triple
    ([0, 1], [0], [], 0, "at least one"),
    ([0, 1], [0], 7, 0, "int"),                 # no sequence
    ([0], [0], [(0, 16, 2)], 2, 2),             # a sub-block a large block does not have
    ([0], [0], [(0, 16, 2)], 2**64, 2**64),
])
def test_hostile_lists_sizes_and_regions_are_refused_by_name(src_blocks, dst_blocks, regions, first, bad):
    src = Cache(2, 4, 16, random_bytes(33))
    dst = Cache(2, 4, 32, pattern_bytes)
    before = [b.copy() for b in dst.buffers]
    assert_both_refuse(
        lambda: _core.plan_sub_blocks(src.layout, dst.layout, None, None, src_blocks, dst_blocks, regions, first),
        lambda: ref.plan_sub_blocks(*src.geometry, *dst.geometry, None, None, src_blocks, dst_blocks, regions, first),
        bad)
    assert all(np.array_equal(b, a) for b, a in zip(dst.buffers, before))


def test_sizes_that_are_no_multiple_are_refused():
    src = Cache(1, 4, 24, random_bytes(34))
    dst = Cache(1, 4, 32, pattern_bytes)
    assert_both_refuse(lambda: _core.plan_sub_blocks(src.layout, dst.layout, None, None, [0], [0], [(0, 24, 1)]),
                       lambda: ref.plan_sub_blocks(*src.geometry, *dst.geometry, None, None, [0], [0], [(0, 24, 1)]),
                       24)


def cpu_regions(heads, tokens, head_size, element):
    """vLLM's CPU attention ("vec"/"vec16" ISA) in a block of ``tokens``: per head, its keys as
    ``[head_size, tokens]`` (one run per dimension), then its values as ``[tokens, head_size]``."""
    half = tokens * head_size * element
    return [r for h in range(heads) for r in ((2 * h * half, half, head_size), (2 * h * half + half, half, 1))]


@pytest.mark.parametrize("src_tokens, dst_tokens", [(32, 64), (64, 32), (32, 128)])
def test_keys_kept_transposed_move_token_by_token(src_tokens, dst_tokens):
    """A cache laid out as vLLM's CPU attention keeps it (each head's keys transposed): after the
    pull, every head's key of every prompt token at every dimension, and its value, is the
    source's, in the destination's blocks; the rest of the destination and the guards are untouched."""
    heads, head_size, element, prompt = 2, 4, 2, 100
    def block_bytes(tokens):
        return heads * 2 * tokens * head_size * element
    src = Cache(2, 6, block_bytes(src_tokens), random_bytes(35))
    dst = Cache(2, 6, block_bytes(dst_tokens), pattern_bytes)
    before = [b.copy() for b in dst.buffers]
    src_list, dst_list = [4, 0, 5, 2][:-(-prompt // src_tokens)], [1, 3, 5, 0][:-(-prompt // dst_tokens)]
    regions = cpu_regions(heads, min(src_tokens, dst_tokens), head_size, element)
    _core.execute(_core.plan_sub_blocks(src.layout, dst.layout, None, None, src_list, dst_list, regions), HOST, H2H)

    def kv(buffer, tokens, blocks):
        """(keys [heads, prompt tokens, dims], values the same) of ``blocks``, element bytes last."""
        rows = buffer[GUARD:-GUARD].reshape(6, heads, 2, tokens * head_size, element)
        keys = rows[:, :, 0].reshape(6, heads, head_size, tokens, element).transpose(0, 1, 3, 2, 4)
        values = rows[:, :, 1].reshape(6, heads, tokens, head_size, element)
        return tuple(np.concatenate([part[b] for b in blocks], axis=1)[:, :prompt] for part in (keys, values))
    for had, got, old in zip(src.buffers, dst.buffers, before):
        for sent, landed in zip(kv(had, src_tokens, src_list), kv(got, dst_tokens, dst_list)):
            assert np.array_equal(sent, landed)
        untouched = sorted(set(range(6)) - set(dst_list))
        rows, was = got[GUARD:-GUARD].reshape(6, -1), old[GUARD:-GUARD].reshape(6, -1)
        assert np.array_equal(rows[untouched], was[untouched])
    assert src.guards_intact() and dst.guards_intact()
