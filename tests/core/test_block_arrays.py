"""The core's block-list converter (``as_block_array`` / ``block_array``) and dict flattener
(``block_map_arrays``): the one place block lists are read element by element."""

from __future__ import annotations

import numpy as np
import pytest

from llm_datadist import _core
from llm_datadist.status import LLMException, LLMStatusCode

from refusals import names

STATUS, CANN = _core.BLOCK_ERRORS_STATUS, _core.BLOCK_ERRORS_CANN


@pytest.mark.parametrize("values", [[0, 5, 2**64 - 1], (0, 5, 2**64 - 1), [np.uint64(0), np.int8(5), 2**64 - 1],
                                    np.array([0, 5, 2**64 - 1], dtype=np.uint64)])
def test_converts_to_a_contiguous_uint64_array(values):
    arr = _core.as_block_array(values)
    assert arr.dtype == np.uint64 and arr.ndim == 1 and arr.flags.c_contiguous
    assert arr.tolist() == [0, 5, 2**64 - 1]


def test_a_block_array_is_taken_as_it_is_and_other_arrays_are_copied():
    arr = np.array([3, 1], dtype=np.uint64)
    assert _core.as_block_array(arr) is arr
    signed = np.array([3, 1], dtype=np.int32)
    assert _core.as_block_array(signed).tolist() == [3, 1]
    strided = np.arange(6, dtype=np.uint64)[::2]
    assert _core.as_block_array(strided).tolist() == [0, 2, 4]


@pytest.mark.parametrize("bad", [1.5, True, np.bool_(True), "1", None, -1, 2**64, np.int64(-3), [1]],
                         ids=["float", "bool", "np-bool", "str", "None", "-1", "2**64", "np-negative", "list"])
def test_a_bad_element_is_param_invalid_naming_it(bad):
    with pytest.raises(LLMException) as info:
        _core.as_block_array([0, bad], "dst_blocks", STATUS)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert "dst_blocks[1]" in info.value.args[0] and names(info.value.args[0], bad), info.value.args[0]


@pytest.mark.parametrize("bad, error", [(1.5, TypeError), (True, TypeError), ("1", TypeError),
                                        (-1, ValueError), (2**64, ValueError)])
def test_cann_errors_raise_the_python_api_s_classes(bad, error):
    with pytest.raises(error):
        _core.as_block_array([0, bad], "src_blocks", CANN)


@pytest.mark.parametrize("values", [np.array([-1, 2]), np.array([1.0]), np.array([[1, 2]]), 7, object()],
                         ids=["negative-array", "float-array", "2-d", "int", "object"])
def test_bad_arrays_and_non_sequences_are_refused(values):
    with pytest.raises(LLMException) as info:
        _core.as_block_array(values, "blocks", STATUS)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_other_iterables_convert_in_the_core_s_own_mode():
    assert _core.as_block_array(range(3)).tolist() == [0, 1, 2]
    with pytest.raises(TypeError):
        _core.as_block_array(range(3), "blocks", CANN)


def test_block_map_arrays_flattens_in_dict_order():
    src, dst = _core.block_map_arrays({3: [1, 2], 0: [], 5: [4]}, True)
    assert (src.tolist(), dst.tolist()) == ([3, 3, 5], [1, 2, 4])
    src, dst = _core.block_map_arrays({3: 1, 0: 2})
    assert (src.tolist(), dst.tolist()) == ([3, 0], [1, 2])
    assert src.dtype == dst.dtype == np.uint64


@pytest.mark.parametrize("mapping, many", [({1: 1.0}, False), ({True: 1}, False), ({-1: 1}, False),
                                           ({1: [2**64]}, True), ({1: (2,)}, True), ({1: [np.int64(1)]}, True),
                                           ([(1, 2)], False)])
def test_block_map_arrays_leaves_anything_else_to_the_caller(mapping, many):
    assert _core.block_map_arrays(mapping, many) is None


def test_planners_range_check_converted_blocks_against_the_geometry():
    src = _core.CacheLayout([4096], 4, 16)
    dst = _core.CacheLayout([8192], 4, 16)
    blocks = _core.as_block_array([0, 3])
    plan = _core.plan_blocks(src, dst, None, None, blocks, blocks)
    assert plan.descriptors()[:, 2].sum() == 32
    for bad in (4, 2**63, 2**64 - 1):
        with pytest.raises(LLMException) as info:
            _core.plan_blocks(src, dst, None, None, _core.as_block_array([0, bad]), blocks)
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert names(info.value.args[0], bad)
    with pytest.raises(LLMException):
        _core.plan_row_to_blocks(src, dst, None, None, 0, _core.as_block_array([9]))
