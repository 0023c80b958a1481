"""The core's copy planners and host executor against the pure-Python reference planner.

Every case runs on real memory: each cache is numpy buffers whose tensor regions are framed by
GUARD sentinel bytes. A valid case is planned by ``_core``, executed with the host runtime and
compared byte for byte with the reference descriptors applied, in order, to a model of the same
memory; the merged core descriptors must be runs of the reference's. An invalid case must be
refused by both (LLMException(LLM_PARAM_INVALID) naming the bad value / ValueError) with nothing
written.
"""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from llm_datadist import _core
from llm_datadist import _reference as ref
from llm_datadist.status import LLMException, LLMStatusCode
from refusals import assert_both_refuse, names

GUARD = 64
SENTINEL = np.resize(np.array([0xDE, 0xAD, 0xBE, 0xEF], dtype=np.uint8), GUARD)
HOST = _core.load_runtime("host")
H2H = _core.MEMCPY_HOST_TO_HOST
HUGE = 2**63 - 1

PROPERTY = settings(max_examples=400, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ------------------------------------------------------------------------------------------------
# Memory
# ------------------------------------------------------------------------------------------------

def random_bytes(seed):
    rng = np.random.default_rng(seed)
    return lambda size: rng.integers(0, 256, size, dtype=np.uint8)


def pattern_bytes(size):
    return ((np.arange(size) * 7 + 3) % 251).astype(np.uint8)


class Cache:
    """``num_tensors`` tensors of ``rows * row_bytes`` bytes in numpy buffers framed by GUARD
    sentinel bytes: one buffer per tensor, or (``packed``) all tensors back to back in one."""

    def __init__(self, num_tensors, rows, row_bytes, fill, packed=False):
        tensor_bytes = rows * row_bytes
        sizes = [num_tensors * tensor_bytes] if packed else [tensor_bytes] * num_tensors
        self.buffers, self.regions = [], []
        for size in sizes:
            buf = np.empty(size + 2 * GUARD, dtype=np.uint8)
            buf[:GUARD] = SENTINEL
            buf[GUARD + size:] = SENTINEL
            buf[GUARD:GUARD + size] = fill(size)
            self.buffers.append(buf)
            self.regions.append(buf.ctypes.data + GUARD)
        if packed:
            self.addrs = [self.regions[0] + t * tensor_bytes for t in range(num_tensors)]
        else:
            self.addrs = list(self.regions)
        self.geometry = (self.addrs, rows, row_bytes)
        self.layout = _core.CacheLayout(self.addrs, rows, row_bytes)
        self.packed = packed

    def __repr__(self):
        return f"Cache({len(self.addrs)} tensors, {self.geometry[1]} rows of {self.geometry[2]} " \
               f"bytes{', packed' if self.packed else ''})"

    def guards_intact(self):
        return all(np.array_equal(b[:GUARD], SENTINEL) and np.array_equal(b[-GUARD:], SENTINEL)
                   for b in self.buffers)


def memory_model(buffers):
    """A dict address -> byte holding every byte of ``buffers`` (guards included)."""
    model = {}
    for buf in buffers:
        model.update(zip(range(buf.ctypes.data, buf.ctypes.data + buf.size), buf.tobytes()))
    return model


def model_bytes(model, buf):
    base = buf.ctypes.data
    return np.array([model[a] for a in range(base, base + buf.size)], dtype=np.uint8)


# ------------------------------------------------------------------------------------------------
# Checking one case
# ------------------------------------------------------------------------------------------------

def assert_bytes(actual, expected, what):
    """Byte-for-byte equality of two buffers; the message gives the first differing offset."""
    diff = np.flatnonzero(actual != expected)
    assert diff.size == 0, (f"{what}: {diff.size} bytes differ, first at buffer offset {diff[0]} "
                            f"(guard is {GUARD} bytes): {actual[diff[0]]} != {expected[diff[0]]}")


def as_tuples(plan):
    return [tuple(int(x) for x in row) for row in plan.descriptors()]


def assert_merged_from(merged, unmerged):
    """Each merged descriptor is a run of consecutive unmerged ones, each continuing the previous
    on both sides, whose merged source and destination ranges do not overlap; and two neighbours
    are kept apart only when merging them would make the ranges overlap."""
    k = 0
    for i, (src, dst, nbytes) in enumerate(merged):
        first, covered = k, 0
        while covered < nbytes:
            assert k < len(unmerged), f"merged descriptor {i} covers more than the reference"
            assert unmerged[k][:2] == (src + covered, dst + covered), \
                f"merged descriptor {i} {merged[i]} does not continue with reference {unmerged[k]}"
            covered += unmerged[k][2]
            k += 1
        assert covered == nbytes, f"merged descriptor {i} ends inside reference {unmerged[k - 1]}"
        if k - first > 1:
            assert src + nbytes <= dst or dst + nbytes <= src, \
                f"descriptor {i} {merged[i]} merges copies whose ranges overlap"
        if i + 1 < len(merged) and merged[i + 1][:2] == (src + nbytes, dst + nbytes):
            total = nbytes + unmerged[k][2]
            assert not (src + total <= dst or dst + total <= src), \
                f"descriptors {i} and {i + 1} continue each other without overlap but were not merged"
    assert k == len(unmerged), "merged descriptors cover less than the reference"


def note_event(name):
    """Count case kinds in hypothesis' statistics (pytest --hypothesis-show-statistics)."""
    if currently_in_test_context():
        event(name)


def check(core_plan, ref_plan, src, dst):
    """Run one case; return the core descriptors (None when the input is invalid)."""
    buffers = list({id(b): b for b in src.buffers + dst.buffers}.values())
    before = [b.copy() for b in buffers]
    try:
        expected = ref_plan()
    except ref.InvalidInput as refusal:
        note_event("refused: " + " ".join(str(refusal).split()[:2]))
        with pytest.raises(LLMException) as info:
            _core.execute(core_plan(), HOST, H2H)
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        if refusal.value is not None:
            assert names(info.value.args[0], refusal.value), (info.value.args[0], refusal.value)
        for buf, old in zip(buffers, before):
            assert_bytes(buf, old, "a refused plan wrote memory")
        return None

    plan = core_plan()
    descs = as_tuples(plan)
    note_event("valid, merged" if len(descs) < len(expected) else "valid, not merged")
    assert plan.total_bytes == sum(n for _, _, n in expected)
    assert_merged_from(descs, expected)
    model = ref.apply(expected, memory_model(buffers))
    _core.execute(plan, HOST, H2H)
    for buf in buffers:
        assert_bytes(buf, model_bytes(model, buf), "memory after execute != reference")
    assert src.guards_intact() and dst.guards_intact()
    if src is not dst:
        for buf, old in zip(buffers, before):
            if any(buf is b for b in src.buffers):
                assert_bytes(buf, old, "the source was written")
    return descs


# ------------------------------------------------------------------------------------------------
# Strategies
# ------------------------------------------------------------------------------------------------

MODES = ["separate", "packed", "same"]


@st.composite
def caches(draw, src_row_bytes=None, dst_row_bytes=None):
    """Source and destination caches: separate buffers, packed buffers or, when the row sizes are
    not imposed, one cache for both (src is dst)."""
    mode = draw(st.sampled_from(MODES if src_row_bytes is None else MODES[:2]))
    nt, rows = draw(st.integers(1, 6)), draw(st.integers(1, 12))
    row_bytes = src_row_bytes or draw(st.integers(1, 64))
    src = Cache(nt, rows, row_bytes, random_bytes(draw(st.integers(0, 2**32))), mode == "packed")
    if mode == "same":
        return src, src
    if draw(st.booleans()):  # the same geometry on both sides
        dst = Cache(nt, rows, dst_row_bytes or row_bytes, pattern_bytes, mode == "packed")
        return src, dst
    if dst_row_bytes is None:
        dst_row_bytes = row_bytes if draw(st.booleans()) else draw(st.integers(1, 64))
    dst = Cache(draw(st.integers(1, 6)), draw(st.integers(1, 12)), dst_row_bytes, pattern_bytes,
                mode == "packed")
    return src, dst


def bad_index(limit):
    return st.sampled_from([-1, -(2**63), limit, limit + 1, HUGE])


@st.composite
def corrupt(draw, values, limit):
    """``values`` with one entry replaced (or appended) by an out-of-range index."""
    values = list(values)
    bad = draw(bad_index(limit))
    if values and draw(st.booleans()):
        values[draw(st.integers(0, len(values) - 1))] = bad
    else:
        values.insert(draw(st.integers(0, len(values))), bad)
    return values


@st.composite
def tensor_selections(draw, src_tensors, dst_tensors):
    """Source/destination tensor index lists (None = all), mostly valid, with repeats."""
    kind = draw(st.sampled_from(["all", "list", "list", "list", "bad"]))
    if kind == "all":
        return None, None
    n = draw(st.integers(1, 6))
    src = draw(st.lists(st.integers(0, src_tensors - 1), min_size=n, max_size=n))
    dst = draw(st.lists(st.integers(0, dst_tensors - 1), min_size=n, max_size=n))
    if kind == "list":
        return src, dst
    how = draw(st.sampled_from(["src", "dst", "length", "empty", "half"]))
    if how == "src":
        return draw(corrupt(src, src_tensors)), dst
    if how == "dst":
        return src, draw(corrupt(dst, dst_tensors))
    if how == "length":
        return src, dst + [0]
    if how == "empty":
        return [], []
    return None, dst


@st.composite
def block_selections(draw, src_rows, dst_rows):
    """Block lists made of runs (consecutive on both sides, so they merge), sometimes invalid."""
    src, dst = [], []
    for _ in range(draw(st.integers(0, 4))):
        s, d = draw(st.integers(0, src_rows - 1)), draw(st.integers(0, dst_rows - 1))
        length = draw(st.integers(1, min(4, src_rows - s, dst_rows - d)))
        src += range(s, s + length)
        dst += range(d, d + length)
    how = draw(st.sampled_from([None] * 6 + ["src", "dst", "length"]))
    if how == "src":
        src = draw(corrupt(src, src_rows))
    elif how == "dst":
        dst = draw(corrupt(dst, dst_rows))
    elif how == "length":
        dst = dst[:-1] if dst and draw(st.booleans()) else dst + [0]
    return src, dst


def with_invalid(valid, *invalid):
    """Mostly ``valid``, sometimes one of the ``invalid`` values."""
    return st.sampled_from([True] * 7 + [False]).flatmap(
        lambda ok: valid if ok else st.sampled_from(invalid))


# ------------------------------------------------------------------------------------------------
# plan_blocks
# ------------------------------------------------------------------------------------------------

@st.composite
def block_cases(draw):
    src, dst = draw(caches())
    (_, src_rows, src_rb), (_, dst_rows, dst_rb) = src.geometry, dst.geometry
    tensors = draw(tensor_selections(len(src.addrs), len(dst.addrs)))
    blocks = draw(block_selections(src_rows, dst_rows))
    fit = min(src_rb, dst_rb)
    nbytes = draw(with_invalid(st.sampled_from([-1, fit]) | st.integers(1, fit),
                               0, -2, fit + 1, max(src_rb, dst_rb) + 1, HUGE))
    return src, dst, tensors, blocks, nbytes


@PROPERTY
@given(block_cases())
def test_plan_blocks_matches_reference(case):
    src, dst, (src_tensors, dst_tensors), (src_blocks, dst_blocks), nbytes = case
    check(lambda: _core.plan_blocks(src.layout, dst.layout, src_tensors, dst_tensors,
                                    src_blocks, dst_blocks, nbytes),
          lambda: ref.plan_blocks(*src.geometry, *dst.geometry, src_tensors, dst_tensors,
                                  src_blocks, dst_blocks, nbytes),
          src, dst)


@st.composite
def block_range_cases(draw):
    """Block copies of a byte range inside each block (a tensor parallel rank's heads): offsets and
    length on each side, mostly valid, sometimes hostile (negative, past the block, overflowing)."""
    src, dst, tensors, blocks, _ = draw(block_cases())
    src_rb, dst_rb = src.geometry[2], dst.geometry[2]
    src_offset = draw(with_invalid(st.integers(0, src_rb - 1), -1, src_rb, src_rb + 1, 2**64 - 1, 2**64, HUGE))
    dst_offset = draw(with_invalid(st.integers(0, dst_rb - 1), -1, dst_rb, 2**64 - 1, -(2**63)))
    fit = max(1, min(src_rb - min(src_offset, src_rb), dst_rb - min(dst_offset, dst_rb)))
    nbytes = draw(with_invalid(st.sampled_from([-1, fit]) | st.integers(1, fit),
                               0, -2, fit + 1, HUGE))
    return src, dst, tensors, blocks, nbytes, src_offset, dst_offset


@PROPERTY
@given(block_range_cases())
def test_plan_blocks_with_offsets_matches_reference(case):
    """A range inside each block goes where the reference says, and no byte outside it moves
    (the guard bytes and the rest of every block included); hostile offsets are refused by name."""
    src, dst, (src_tensors, dst_tensors), (src_blocks, dst_blocks), nbytes, src_offset, dst_offset = case
    check(lambda: _core.plan_blocks(src.layout, dst.layout, src_tensors, dst_tensors,
                                    src_blocks, dst_blocks, nbytes, src_offset, dst_offset),
          lambda: ref.plan_blocks(*src.geometry, *dst.geometry, src_tensors, dst_tensors,
                                  src_blocks, dst_blocks, nbytes, src_offset, dst_offset),
          src, dst)


def test_a_head_range_moves_between_blocks_of_other_sizes():
    """Two heads per source block, one per destination block: the second head of each source block
    lands in its destination block, whose other bytes and the guards stay."""
    src = Cache(2, 3, 16, random_bytes(21))
    dst = Cache(2, 3, 8, pattern_bytes)
    before = [b.copy() for b in dst.buffers]
    plan = _core.plan_blocks(src.layout, dst.layout, None, None, [0, 2], [1, 0], 8, 8, 0)
    assert len(plan) == 4 and plan.total_bytes == 32
    _core.execute(plan, HOST, H2H)
    for t in range(2):
        got = dst.buffers[t][GUARD:-GUARD].reshape(3, 8)
        had = src.buffers[t][GUARD:-GUARD].reshape(3, 16)
        assert got[1].tolist() == had[0, 8:].tolist() and got[0].tolist() == had[2, 8:].tolist()
        assert got[2].tolist() == before[t][GUARD:-GUARD].reshape(3, 8)[2].tolist()
    assert src.guards_intact() and dst.guards_intact()


@pytest.mark.parametrize("args, bad", [
    ((8, -1, 0), -1), ((8, 0, -1), -1), ((8, 16, 0), 16), ((1, 0, 8), 8), ((8, 9, 0), 8),
    ((8, 0, 1), 8), ((-1, 2**64 - 1, 0), 2**64 - 1), ((8, 2**64, 0), 2**64), ((2**63 - 1, 1, 0), 2**63 - 1),
])
def test_plan_blocks_offset_refusals_name_the_value(args, bad):
    src = Cache(2, 4, 16, random_bytes(22))
    dst = Cache(2, 4, 8, pattern_bytes)
    assert_both_refuse(lambda: _core.plan_blocks(src.layout, dst.layout, None, None, [0], [0], *args),
                       lambda: ref.plan_blocks(*src.geometry, *dst.geometry, None, None, [0], [0], *args), bad)


@PROPERTY
@given(st.data())
def test_plan_blocks_all_blocks(data):
    """``None`` block lists select every block (the layouts must then have as many)."""
    src, dst = data.draw(caches())
    check(lambda: _core.plan_blocks(src.layout, dst.layout, None, None, None, None),
          lambda: ref.plan_blocks(*src.geometry, *dst.geometry, None, None, None, None),
          src, dst)


@PROPERTY
@given(st.data())
def test_copy_within_one_cache_is_sequential(data):
    """Chains such as {1->2, 2->3} inside one cache run in list order and are never merged into
    one overlapping copy; runs moved by at least their length do merge."""
    rows = data.draw(st.integers(3, 12))
    cache = Cache(data.draw(st.integers(1, 3)), rows, data.draw(st.integers(1, 16)),
                  random_bytes(data.draw(st.integers(0, 2**32))), packed=data.draw(st.booleans()))
    delta = data.draw(st.integers(1, rows - 1)) * data.draw(st.sampled_from([1, -1]))
    first, last = max(0, -delta), rows - 1 - max(0, delta)  # source blocks whose target exists
    start = data.draw(st.integers(first, last))
    src_blocks = list(range(start, start + data.draw(st.integers(1, last - start + 1))))
    if data.draw(st.booleans()):
        src_blocks.reverse()
    dst_blocks = [b + delta for b in src_blocks]
    descs = check(lambda: _core.plan_blocks(cache.layout, cache.layout, None, None,
                                            src_blocks, dst_blocks),
                  lambda: ref.plan_blocks(*cache.geometry, *cache.geometry, None, None,
                                          src_blocks, dst_blocks),
                  cache, cache)
    assert descs is not None


def test_consecutive_blocks_merge_into_one_descriptor():
    src = Cache(1, 4, 16, random_bytes(1))
    dst = Cache(1, 8, 16, pattern_bytes)
    plan = _core.plan_blocks(src.layout, dst.layout, [0], [0], [0, 1, 2], [5, 6, 7])
    assert as_tuples(plan) == [(src.addrs[0], dst.addrs[0] + 5 * 16, 3 * 16)]
    assert plan.total_bytes == 48
    descs = check(lambda: plan, lambda: ref.plan_blocks(*src.geometry, *dst.geometry, [0], [0],
                                                        [0, 1, 2], [5, 6, 7]), src, dst)
    assert len(descs) == 1


def test_packed_tensors_merge_across_tensors():
    src = Cache(3, 4, 8, random_bytes(2), packed=True)
    dst = Cache(3, 4, 8, pattern_bytes, packed=True)
    plan = _core.plan_blocks(src.layout, dst.layout, None, None, None, None)
    assert as_tuples(plan) == [(src.addrs[0], dst.addrs[0], 3 * 4 * 8)]


def test_partial_blocks_do_not_merge():
    src = Cache(1, 4, 16, random_bytes(3))
    dst = Cache(1, 4, 16, pattern_bytes)
    descs = check(lambda: _core.plan_blocks(src.layout, dst.layout, None, None, [0, 1], [0, 1], 8),
                  lambda: ref.plan_blocks(*src.geometry, *dst.geometry, None, None,
                                          [0, 1], [0, 1], 8), src, dst)
    assert len(descs) == 2


def test_overlapping_chain_is_not_merged():
    cache = Cache(1, 4, 4, lambda size: np.arange(size, dtype=np.uint8))
    plan = _core.plan_blocks(cache.layout, cache.layout, None, None, [1, 2], [2, 3])
    assert len(plan) == 2
    _core.execute(plan, HOST, H2H)
    region = cache.buffers[0][GUARD:-GUARD].reshape(4, 4)
    block1 = [4, 5, 6, 7]
    assert region.tolist() == [[0, 1, 2, 3], block1, block1, block1]
    assert cache.guards_intact()


def test_swap_chain_within_one_cache():
    cache = Cache(2, 3, 8, random_bytes(4))
    check(lambda: _core.plan_blocks(cache.layout, cache.layout, None, None, [0, 1, 2], [1, 2, 0]),
          lambda: ref.plan_blocks(*cache.geometry, *cache.geometry, None, None,
                                  [0, 1, 2], [1, 2, 0]), cache, cache)


@pytest.mark.parametrize("blocks, bad", [
    (([0, 4], [0, 1]), 4), (([0, 1], [-1, 0]), -1), (([HUGE], [0]), HUGE),
    (([0], [0, 1]), 1), (([0, 1], [0, 2**63 - 1]), 2**63 - 1),
])
def test_plan_blocks_refusals_name_the_value(blocks, bad):
    src = Cache(2, 4, 8, random_bytes(5))
    dst = Cache(2, 4, 8, pattern_bytes)
    assert_both_refuse(lambda: _core.plan_blocks(src.layout, dst.layout, None, None, *blocks),
                       lambda: ref.plan_blocks(*src.geometry, *dst.geometry, None, None, *blocks), bad)


# ------------------------------------------------------------------------------------------------
# plan_rows
# ------------------------------------------------------------------------------------------------

@st.composite
def row_cases(draw):
    src, dst = draw(caches())
    (_, src_rows, src_rb), (_, dst_rows, dst_rb) = src.geometry, dst.geometry
    tensors = draw(tensor_selections(len(src.addrs), len(dst.addrs)))
    src_row = draw(with_invalid(st.integers(0, src_rows - 1), src_rows, HUGE, 2**64 - 1))
    dst_row = draw(with_invalid(st.integers(0, dst_rows - 1), dst_rows, HUGE, 2**64 - 1))
    src_offset = draw(with_invalid(st.integers(0, src_rb - 1) | st.just(0), src_rb, 2**64 - 1))
    dst_offset = draw(st.sampled_from([src_offset, 0]) | st.integers(0, dst_rb + 1))
    size = draw(with_invalid(st.just(-1) | st.integers(1, max(1, src_rb - min(src_offset, src_rb))),
                             0, -2, src_rb + 1, HUGE))
    return src, dst, tensors, (src_row, dst_row, src_offset, dst_offset, size)


@PROPERTY
@given(row_cases())
def test_plan_rows_matches_reference(case):
    src, dst, (src_tensors, dst_tensors), args = case
    check(lambda: _core.plan_rows(src.layout, dst.layout, src_tensors, dst_tensors, *args),
          lambda: ref.plan_rows(*src.geometry, *dst.geometry, src_tensors, dst_tensors, *args),
          src, dst)


def test_plan_rows_with_offsets():
    src = Cache(2, 3, 16, random_bytes(6))
    dst = Cache(2, 5, 20, pattern_bytes)
    descs = check(lambda: _core.plan_rows(src.layout, dst.layout, None, None, 2, 4, 3, 7, 10),
                  lambda: ref.plan_rows(*src.geometry, *dst.geometry, None, None, 2, 4, 3, 7, 10),
                  src, dst)
    assert descs == [(src.addrs[t] + 2 * 16 + 3, dst.addrs[t] + 4 * 20 + 7, 10) for t in (0, 1)]


def test_plan_rows_default_size_is_rest_of_source_row():
    src = Cache(1, 2, 16, random_bytes(7))
    dst = Cache(1, 2, 16, pattern_bytes)
    plan = _core.plan_rows(src.layout, dst.layout, None, None, 1, 0, 5, 5)
    assert as_tuples(plan) == [(src.addrs[0] + 16 + 5, dst.addrs[0] + 5, 11)]


@pytest.mark.parametrize("args, bad", [
    ((2, 0), 2), ((0, 3), 3), ((0, 0, 16), 16), ((0, 0, 0, 0, 0), 0), ((0, 0, 0, 0, -5), -5),
    ((0, 0, 8, 8, 9), 9), ((0, 0, 0, 12, 8), 12), ((2**64 - 1, 0), 2**64 - 1),
])
def test_plan_rows_refusals_name_the_value(args, bad):
    src = Cache(1, 2, 16, random_bytes(8))
    dst = Cache(1, 3, 16, pattern_bytes)
    assert_both_refuse(lambda: _core.plan_rows(src.layout, dst.layout, None, None, *args),
                       lambda: ref.plan_rows(*src.geometry, *dst.geometry, None, None, *args), bad)


# ------------------------------------------------------------------------------------------------
# plan_row_to_blocks
# ------------------------------------------------------------------------------------------------

@st.composite
def row_to_block_cases(draw):
    row_bytes = draw(st.integers(1, 64))
    block = draw(st.integers(1, row_bytes) | st.integers(1, 64))
    src, dst = draw(caches(row_bytes, block))
    (_, src_rows, _), (_, dst_rows, _) = src.geometry, dst.geometry
    tensors = draw(tensor_selections(len(src.addrs), len(dst.addrs)))
    src_row = draw(with_invalid(st.integers(0, src_rows - 1), src_rows, HUGE, 2**64 - 1))
    chunks = -(-row_bytes // block)
    n = draw(with_invalid(st.integers(0, chunks) | st.just(chunks), chunks + 1, chunks + 2))
    dst_blocks = draw(st.lists(st.integers(0, dst_rows - 1), min_size=n, max_size=n))
    if draw(st.integers(0, 7)) == 0:
        dst_blocks = draw(corrupt(dst_blocks, dst_rows))
    return src, dst, tensors, src_row, dst_blocks


@PROPERTY
@given(row_to_block_cases())
def test_plan_row_to_blocks_matches_reference(case):
    src, dst, (src_tensors, dst_tensors), src_row, dst_blocks = case
    check(lambda: _core.plan_row_to_blocks(src.layout, dst.layout, src_tensors, dst_tensors,
                                           src_row, dst_blocks),
          lambda: ref.plan_row_to_blocks(*src.geometry, *dst.geometry, src_tensors, dst_tensors,
                                         src_row, dst_blocks),
          src, dst)


def test_plan_row_to_blocks_last_chunk_is_shorter():
    src = Cache(2, 2, 10, random_bytes(10))
    dst = Cache(2, 4, 4, pattern_bytes)
    descs = check(lambda: _core.plan_row_to_blocks(src.layout, dst.layout, None, None, 1, [2, 0, 3]),
                  lambda: ref.plan_row_to_blocks(*src.geometry, *dst.geometry, None, None, 1,
                                                 [2, 0, 3]), src, dst)
    assert descs == [d for t in (0, 1) for d in [
        (src.addrs[t] + 10, dst.addrs[t] + 8, 4), (src.addrs[t] + 14, dst.addrs[t], 4),
        (src.addrs[t] + 18, dst.addrs[t] + 12, 2)]]
    for t in (0, 1):
        region = dst.buffers[t][GUARD:-GUARD]
        assert region[14:16].tolist() == pattern_bytes(16)[14:16].tolist()  # block 3's tail
        assert region[4:8].tolist() == pattern_bytes(16)[4:8].tolist()  # block 1, not selected


def test_plan_row_to_blocks_consecutive_blocks_merge():
    src = Cache(1, 2, 12, random_bytes(11))
    dst = Cache(1, 6, 4, pattern_bytes)
    plan = _core.plan_row_to_blocks(src.layout, dst.layout, None, None, 0, [3, 4, 5])
    assert as_tuples(plan) == [(src.addrs[0], dst.addrs[0] + 12, 12)]


def test_plan_row_to_blocks_too_many_blocks():
    src = Cache(1, 2, 10, random_bytes(12))
    dst = Cache(1, 8, 4, pattern_bytes)
    with pytest.raises(LLMException) as info:
        _core.plan_row_to_blocks(src.layout, dst.layout, None, None, 0, [0, 1, 2, 3])
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert names(info.value.args[0], 4)
    with pytest.raises(ValueError):
        ref.plan_row_to_blocks(*src.geometry, *dst.geometry, None, None, 0, [0, 1, 2, 3])


# ------------------------------------------------------------------------------------------------
# Argument types the planners must refuse (found by this suite, fixed in the core)
# ------------------------------------------------------------------------------------------------

_SMALL = Cache(1, 2, 16, random_bytes(13))
_ARGS = (_SMALL.layout, _SMALL.layout, None, None)
_GEOMETRY = (*_SMALL.geometry, *_SMALL.geometry, None, None)


@pytest.mark.parametrize("planner, args, bad", [
    ("plan_rows", (-1, 0), -1), ("plan_rows", (0, -1), -1), ("plan_rows", (0, 0, -1), -1),
    ("plan_rows", (0, 0, 0, -1), -1), ("plan_rows", (0, 0, 0, 0, 2**63), 2**63),
    ("plan_row_to_blocks", (-1, [0]), -1), ("plan_blocks", ([0], [0], 2**63), 2**63),
])
def test_out_of_type_arguments_are_refused(planner, args, bad):
    with pytest.raises(ValueError):
        getattr(ref, planner)(*_GEOMETRY, *args)
    with pytest.raises(LLMException) as info:
        getattr(_core, planner)(*_ARGS, *args)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert names(info.value.args[0], bad)


@pytest.mark.parametrize("bad", [1.5, "1", True])
def test_non_integer_indices_are_refused(bad):
    with pytest.raises(ValueError):
        ref.plan_blocks(*_GEOMETRY, [bad], [0])
    with pytest.raises(LLMException) as info:
        _core.plan_blocks(*_ARGS, [bad], [0])
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_index_outside_int64_is_named():
    with pytest.raises(LLMException) as info:
        _core.plan_blocks(*_ARGS, [0, 2**64], [0, 1])
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert names(info.value.args[0], 2**64)


# ------------------------------------------------------------------------------------------------
# The reference itself
# ------------------------------------------------------------------------------------------------

def test_reference_apply_is_sequential_and_memmove_like():
    memory = bytearray(range(8))
    ref.apply([(0, 2, 2), (2, 4, 2)], memory)
    assert list(memory) == [0, 1, 0, 1, 0, 1, 6, 7]
    memory = bytearray(range(8))
    ref.apply([(0, 1, 4)], memory)
    assert list(memory) == [0, 0, 1, 2, 3, 5, 6, 7]
    assert ref.apply([(10, 20, 1)], {10: 7, 20: 0}) == {10: 7, 20: 7}
