"""``plan_strided_blocks``: blocks that hold the same bytes in another order (a vLLM engine whose KV
cache layout is LBNHC, each block ``[tokens, heads, C]``, and one whose is LBHNC, ``[heads, tokens,
C]``). Each region ``(src_offset, src_stride, dst_offset, dst_stride, piece, count)`` is ``count``
strided runs on each side (a KV head of a block: ``tokens`` runs of ``C`` bytes, ``heads * C`` apart
on the token-major side, adjacent on the head-major side).

The core is checked against the pure-Python reference on real memory framed by guard bytes
(``test_plans_property.check``): the same bytes move, nothing outside the asked-for runs is
written, hostile regions and block lists are refused by both, naming the value, with nothing
written. One more oracle speaks in tensors: numpy's transpose of a block."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from refusals import assert_both_refuse
from test_plans_property import GUARD, H2H, HOST, HUGE, PROPERTY, Cache, check, pattern_bytes, random_bytes

from llm_datadist import _core
from llm_datadist import _reference as ref


@st.composite
def strided_cases(draw):
    """Caches of any two block sizes, regions whose runs fit them, block lists of one length, and now
    and then one hostile value."""
    src_bytes, dst_bytes = draw(st.integers(1, 48)), draw(st.integers(1, 48))
    regions = []
    for _ in range(draw(st.integers(1, 3))):
        piece = draw(st.integers(1, min(src_bytes, dst_bytes)))
        count = draw(st.integers(1, 4))
        stride = [draw(st.integers(0, max(0, (size - piece) // max(1, count - 1)))) if count > 1 else 0
                  for size in (src_bytes, dst_bytes)]
        offset = [draw(st.integers(0, size - piece - (count - 1) * s)) for size, s in zip((src_bytes, dst_bytes),
                                                                                          stride)]
        regions.append((offset[0], stride[0], offset[1], stride[1], piece, count))
    nt = draw(st.integers(1, 3))
    src = Cache(nt, draw(st.integers(1, 6)), src_bytes, random_bytes(draw(st.integers(0, 2**32))))
    dst = Cache(nt, draw(st.integers(1, 6)), dst_bytes, pattern_bytes)
    n = draw(st.integers(0, dst.geometry[1]))
    src_blocks = draw(st.lists(st.integers(0, src.geometry[1] - 1), min_size=n, max_size=n))
    dst_blocks = draw(st.lists(st.integers(0, dst.geometry[1] - 1), min_size=n, max_size=n, unique=True))
    how = draw(st.sampled_from([None] * 6 + ["id", "length", "region", "empty"]))
    if how == "id" and dst_blocks:
        dst_blocks[0] = draw(st.sampled_from([-1, dst.geometry[1], HUGE]))
    elif how == "length":
        src_blocks = src_blocks + [0]
    elif how == "region":
        k = draw(st.integers(0, len(regions) - 1))
        a, b, c, d, piece, count = regions[k]
        regions[k] = draw(st.sampled_from([(a, b, dst_bytes, d, piece, count), (src_bytes, b, c, d, piece, count),
                                           (a, b, c, d, 0, count), (a, b, c, d, piece, 0), (a, HUGE, c, d, piece, 2),
                                           (a, b, c, d, piece, -1), (a, b, c, HUGE, piece, 2)]))
    elif how == "empty":
        regions = []
    return src, dst, src_blocks, dst_blocks, regions


@PROPERTY
@given(strided_cases())
def test_plan_strided_blocks_matches_reference(case):
    src, dst, src_blocks, dst_blocks, regions = case
    check(lambda: _core.plan_strided_blocks(src.layout, dst.layout, None, None, src_blocks, dst_blocks, regions),
          lambda: ref.plan_strided_blocks(*src.geometry, *dst.geometry, None, None, src_blocks, dst_blocks, regions),
          src, dst)


def head_regions(heads, tokens, c, src_token_major):
    """Per head: ``tokens`` runs of ``c`` bytes, ``heads * c`` apart where tokens are outermost."""
    token_major = [(h * c, heads * c) for h in range(heads)]
    head_major = [(h * tokens * c, c) for h in range(heads)]
    src, dst = (token_major, head_major) if src_token_major else (head_major, token_major)
    return [(s[0], s[1], d[0], d[1], c, tokens) for s, d in zip(src, dst)]


@pytest.mark.parametrize("src_token_major", [True, False])
def test_token_major_blocks_land_head_major_and_back(src_token_major):
    """Three blocks of a ``[tokens, heads, C]`` cache land as ``[heads, tokens, C]`` (numpy's
    transpose of each block), or the reverse; the other blocks and the guards are untouched."""
    heads, tokens, c, rows = 3, 5, 4, 6
    src = Cache(2, rows, heads * tokens * c, random_bytes(41))
    dst = Cache(2, rows, heads * tokens * c, pattern_bytes)
    before = [b.copy() for b in dst.buffers]
    pairs = {4: 0, 1: 3, 5: 5}
    plan = _core.plan_strided_blocks(src.layout, dst.layout, None, None, list(pairs), list(pairs.values()),
                                     head_regions(heads, tokens, c, src_token_major))
    _core.execute(plan, HOST, H2H)
    src_shape, dst_shape = ((tokens, heads, c), (heads, tokens, c))[::1 if src_token_major else -1]
    for had, got, old in zip(src.buffers, dst.buffers, before):
        had, got, old = (b[GUARD:-GUARD].reshape(rows, -1) for b in (had, got, old))
        for s, d in pairs.items():
            assert np.array_equal(got[d].reshape(dst_shape), had[s].reshape(src_shape).transpose(1, 0, 2))
        for d in set(range(rows)) - set(pairs.values()):
            assert np.array_equal(got[d], old[d])
    assert src.guards_intact() and dst.guards_intact()


@pytest.mark.parametrize("regions, bad", [
    ([(0, 4, 0, 12, 4, 6)], 6),                  # 6 runs of a head where the block holds 5 tokens
    ([(0, 4, 60, 12, 4, 1)], 60),                # a run past the destination block's end
    ([(2**64 - 1, 4, 0, 12, 4, 1)], 2**64 - 1),  # (offset + piece overflows 64 bits)
    ([(0, 2**64 - 1, 0, 12, 4, 5)], 2**64 - 1),  # (a stride that wraps)
    ([(0, 4, 0, 12, 0, 5)], 0),                  # an empty run
    ([(0, 4, 0, 12, -4, 5)], -4),
    ([(0, 4, 0, 12, 4)], "(0, 4, 0, 12, 4)"),    # five values
    ([], "at least one"),
    (3, "int"),
])
def test_hostile_regions_are_refused_by_name(regions, bad):
    src = Cache(1, 4, 60, random_bytes(42))
    dst = Cache(1, 4, 60, pattern_bytes)
    before = [b.copy() for b in dst.buffers]
    assert_both_refuse(
        lambda: _core.plan_strided_blocks(src.layout, dst.layout, None, None, [0, 1], [2, 3], regions),
        lambda: ref.plan_strided_blocks(*src.geometry, *dst.geometry, None, None, [0, 1], [2, 3], regions), bad)
    assert all(np.array_equal(b, a) for b, a in zip(dst.buffers, before))
