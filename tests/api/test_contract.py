"""One contract, two API styles: every test here runs against the Python-style API and the
C++-style API (see conftest.py), which share one engine."""

from __future__ import annotations

import numpy as np
import pytest

from llm_datadist import LLMStatusCode

SUCCESS = int(LLMStatusCode.LLM_SUCCESS)
PARAM_INVALID = int(LLMStatusCode.LLM_PARAM_INVALID)
NOT_EXIST = int(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)


def fill(views, seed=0):
    rng = np.random.default_rng(seed)
    for view in views:
        view[...] = rng.integers(-(2**31), 2**31 - 1, size=view.shape, dtype=np.int64).astype(view.dtype)
    return [v.copy() for v in views]


def test_cache_ids_count_from_one_across_allocate_and_register(api):
    first = api.allocate(2, [4, 8])
    arrays = [np.zeros((4, 8), np.int32) for _ in range(2)]
    second = api.register(arrays)
    third = api.allocate(2, [4, 8])
    assert [api.cache_id(c) for c in (first, second, third)] == [1, 2, 3]
    assert api.release(first) == SUCCESS
    assert api.cache_id(api.allocate(2, [4, 8])) == 4  # never reused


def test_allocated_memory_is_zeroed_and_viewable(api):
    cache = api.allocate(3, [5, 7])
    views = api.views(cache)
    assert len(views) == 3
    for view in views:
        assert view.shape == (5, 7) and view.dtype == np.int32
        assert not view.any()


def test_copy_blocks_moves_exactly_the_requested_blocks(api):
    cache = api.allocate(4, [8, 16])
    views = api.views(cache)
    before = fill(views)
    src, dst = [0, 1, 2, 6], [3, 4, 7, 5]
    assert api.copy_blocks(cache, src, dst) == SUCCESS
    for t in range(4):
        expected = before[t].copy()
        for s, d in zip(src, dst):
            expected[d] = before[t][s]
        np.testing.assert_array_equal(views[t], expected)


def test_copy_blocks_rejects_bad_block_ids_and_writes_nothing(api):
    cache = api.allocate(2, [4, 8])
    views = api.views(cache)
    before = fill(views, seed=1)
    assert api.copy_blocks(cache, [0, 1], [2, 4]) == PARAM_INVALID
    assert api.copy_blocks(cache, [4], [0]) == PARAM_INVALID
    for view, old in zip(views, before):
        np.testing.assert_array_equal(view, old)


def test_copy_rows_with_offset_and_size(api):
    src = api.allocate(2, [3, 10], blocks=False)
    dst = api.allocate(2, [3, 10], blocks=False)
    src_views, dst_views = api.views(src), api.views(dst)
    src_before = fill(src_views, seed=2)
    assert api.copy_rows(dst, src, dst_row=2, src_row=1, offset=8, size=12) == SUCCESS
    for s, d in zip(src_before, dst_views):
        expected = np.zeros((3, 10), np.int32)
        expected[2, 2:5] = s[1, 2:5]  # 8 bytes in = element 2, 12 bytes = 3 elements
        np.testing.assert_array_equal(d, expected)
    # size -1: the rest of the row after the offset
    assert api.copy_rows(dst, src, dst_row=0, src_row=0, offset=4) == SUCCESS
    np.testing.assert_array_equal(dst_views[0][0, 1:], src_before[0][0, 1:])
    assert dst_views[0][0, 0] == 0


@pytest.mark.parametrize("kwargs", [
    dict(dst_row=3), dict(src_row=3), dict(offset=40), dict(offset=36, size=8), dict(size=41),
])
def test_copy_rows_out_of_range_is_param_invalid(api, kwargs):
    src = api.allocate(2, [3, 10], blocks=False)
    dst = api.allocate(2, [3, 10], blocks=False)
    views = api.views(dst)
    before = fill(views, seed=3)
    assert api.copy_rows(dst, src, **kwargs) == PARAM_INVALID
    for view, old in zip(views, before):
        np.testing.assert_array_equal(view, old)


def test_released_cache_no_longer_exists(api):
    cache = api.allocate(2, [4, 8])
    assert api.release(cache) == SUCCESS
    assert api.copy_blocks(cache, [0], [1]) == NOT_EXIST
    assert api.release(cache) == SUCCESS  # releasing an unknown id is not an error


def test_registered_memory_is_the_callers(api):
    arrays = [np.arange(32, dtype=np.int32).reshape(4, 8) + 100 * i for i in range(2)]
    cache = api.register(arrays)
    assert api.copy_blocks(cache, [0], [3]) == SUCCESS
    for i, array in enumerate(arrays):
        np.testing.assert_array_equal(array[3], np.arange(8) + 100 * i)
        np.testing.assert_array_equal(array[0], array[3])
    assert api.release(cache) == SUCCESS
    np.testing.assert_array_equal(arrays[1][3], np.arange(8) + 100)  # memory untouched by release


def test_mismatched_tensor_counts_are_rejected(api):
    src = api.allocate(2, [3, 10], blocks=False)
    dst = api.allocate(3, [3, 10], blocks=False)
    assert api.copy_rows(dst, src) == PARAM_INVALID
