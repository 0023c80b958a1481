"""Smaller parts of CANN's Python surface (hicann/hixl, ``src/python/llm_datadist/``), each
pinned to what CANN's source does: the members and numpy tables of ``data_type.py``,
``status.code_2_status`` / ``handle_llm_status``, ``LLMException.status_code``,
``LLMDataDist.llm_engine_instance`` and ``_shutdown_handler`` (``v2/llm_datadist.py``),
``KvCache.create_cpu_cache`` and ``CacheDesc.update_dim`` (``v2/llm_types.py``),
``CacheManager.check_cache_key`` (``v2/cache_manager.py``) and CANN's keyword names. ``LLMConfig``
and ``LLMClusterInfo`` (``configs.py``) are in ``test_cann_config.py``."""

from __future__ import annotations

import numpy as np
import pytest

from llm_datadist import (
    CacheDesc, CacheKey, DataType, KvCache, LLMDataDist, LLMException, LLMRole, LLMStatusCode, Placement, Status,
)
from llm_datadist import data_type, status as status_module
from llm_datadist.cache_manager import CacheManager
from llm_datadist.llm_datadist import _shutdown_handler

PARAM_INVALID = LLMStatusCode.LLM_PARAM_INVALID
UNSET = 2**64 - 1


def raises_llm(fn, *args, status=PARAM_INVALID, **kwargs) -> str:
    with pytest.raises(LLMException) as info:
        fn(*args, **kwargs)
    assert info.value.status_code == status
    return info.value.args[0]


# -- data_type: CANN's members and numpy tables ----------------------------------------------------

def test_data_type_members_are_in_cann_s_order():
    assert [(member.name, member.value) for member in DataType] == [
        ("DT_FLOAT", 0), ("DT_FLOAT16", 1), ("DT_BF16", 27), ("DT_INT8", 2), ("DT_INT16", 6), ("DT_UINT16", 7),
        ("DT_UINT8", 4), ("DT_INT32", 3), ("DT_INT64", 9), ("DT_UINT32", 8), ("DT_UINT64", 10), ("DT_BOOL", 12),
        ("DT_DOUBLE", 11), ("DT_STRING", 13)]


def test_numpy_tables_are_cann_s():
    assert data_type.dtype_to_np_dtype == {
        DataType.DT_FLOAT: np.float32, DataType.DT_FLOAT16: np.float16, DataType.DT_BF16: np.float16,
        DataType.DT_INT8: np.int8, DataType.DT_INT16: np.int16, DataType.DT_UINT16: np.uint16,
        DataType.DT_UINT8: np.uint8, DataType.DT_INT32: np.int32, DataType.DT_INT64: np.int64,
        DataType.DT_UINT32: np.uint32, DataType.DT_UINT64: np.uint64, DataType.DT_BOOL: np.bool_,
        DataType.DT_DOUBLE: np.double, DataType.DT_STRING: np.bytes_}
    assert data_type.valid_np_dtypes == list(data_type.dtype_to_np_dtype.values())
    assert data_type.valid_np_dtypes.count(np.float16) == 2
    assert data_type.np_dtype_to_dtype[np.dtype(np.float16)] is DataType.DT_FLOAT16
    assert DataType.DT_BF16 not in data_type.np_dtype_to_dtype.values()
    assert data_type.np_dtype_to_dtype[np.dtype(np.bytes_)] is DataType.DT_STRING
    assert len(data_type.np_dtype_to_dtype) == 13
    # Our own views keep BF16 as its bit patterns: the tables above are CANN's, not the views'.
    assert data_type.numpy_dtype(DataType.DT_BF16) == np.dtype(np.uint16)


# -- status ---------------------------------------------------------------------------------------

def test_code_2_status_is_cann_s_table_lookup():
    assert status_module.code_2_status(0) is LLMStatusCode.LLM_SUCCESS
    assert status_module.code_2_status(0x5010B005) is PARAM_INVALID
    assert status_module.code_2_status(LLMStatusCode.LLM_TIMEOUT) is LLMStatusCode.LLM_TIMEOUT
    assert status_module.code_2_status(507053) is LLMStatusCode.LLM_DEVICE_MEM_ERROR
    for other in (-1, 0x5010B014, 12345, None, "0"):  # -1 and the C++-only codes are not in CANN's table
        assert status_module.code_2_status(other) is LLMStatusCode.LLM_FAILED


def test_handle_llm_status_raises_with_cann_s_message():
    status_module.handle_llm_status(0, "[f]", "nothing")
    with pytest.raises(LLMException) as info:
        status_module.handle_llm_status(0x5010B01A, "[pull_cache]", "cache_key = k")
    assert info.value.status_code is LLMStatusCode.LLM_TIMEOUT
    assert info.value.args[0] == "[pull_cache] failed, error code is LLMStatusCode.LLM_TIMEOUT, cache_key = k."
    with pytest.raises(LLMException) as info:
        status_module.handle_llm_status(-1, "[f]", "x")
    assert info.value.status_code is LLMStatusCode.LLM_FAILED


def test_llm_exception_keeps_the_status_code_it_was_given():
    assert LLMException("m", status_code=12345).status_code == 12345
    assert LLMException("m", status_code=None).status_code is None
    assert LLMException("m", status_code=PARAM_INVALID).status_code is PARAM_INVALID
    assert LLMException("m", status_code=0x5010B005).status_code == PARAM_INVALID
    assert LLMException("m").status_code is LLMStatusCode.LLM_SUCCESS
    assert str(LLMException("m", status_code=12345)) == "m (status_code=12345)"
    assert str(LLMException(status_code=None)) == "None"


def test_update_dim_changes_the_shape_in_place_and_a_tuple_shape_raises_as_in_cann():
    shape = [4, 8]
    desc = CacheDesc(1, shape, DataType.DT_INT32, Placement.HOST)
    desc.update_dim(1, 2)
    assert shape == [4, 2] and desc.size == 32
    frozen = CacheDesc(1, (4, 8), DataType.DT_INT32, Placement.HOST)
    with pytest.raises(TypeError, match="'tuple' object does not support item assignment"):
        frozen.update_dim(0, 6)
    assert frozen.shape == (4, 8)


def test_cann_keyword_names():
    assert Status(status=LLMStatusCode.LLM_SUCCESS).is_ok()
    assert Status(status=0x5010B005).status_code is PARAM_INVALID
    desc = CacheDesc(1, [4, 8], DataType.DT_INT32, Placement.HOST)
    desc.update_dim(dim_index=0, dim_value=6)
    assert desc.shape == [6, 8]


# -- LLMDataDist.llm_engine_instance ---------------------------------------------------------------

def test_llm_engine_instance_is_the_initialized_instance():
    assert LLMDataDist.llm_engine_instance is None
    dd = LLMDataDist(LLMRole.PROMPT, 11)
    assert LLMDataDist.llm_engine_instance is None  # set by init, as in CANN
    dd.init({"llm.EnableCacheManager": "1"})
    try:
        assert LLMDataDist.llm_engine_instance is dd and dd.llm_engine_instance is dd
        other = LLMDataDist(LLMRole.DECODER, 12)
        assert raises_llm(other.init, {"llm.EnableCacheManager": "1"},
                          status=LLMStatusCode.LLM_FAILED) == "Cannot init multiple LLMDataDists"
        assert LLMDataDist.llm_engine_instance is dd
    finally:
        dd.finalize()
    assert LLMDataDist.llm_engine_instance is None


def test_shutdown_handler_finalizes_the_instance():
    dd = LLMDataDist(LLMRole.PROMPT, 13)
    dd.init({"llm.EnableCacheManager": "1"})
    _shutdown_handler()
    assert LLMDataDist.llm_engine_instance is None
    with pytest.raises(RuntimeError, match="not initialized"):
        dd.cache_manager.allocate_cache(CacheDesc(1, [1], DataType.DT_INT8))
    _shutdown_handler()  # nothing to finalize: a no-op


# -- KvCache.create_cpu_cache ----------------------------------------------------------------------

HOST_DESC = CacheDesc(2, [4, 8], DataType.DT_INT32, Placement.HOST)


def test_kv_cache_create_cpu_cache_one_device():
    cache = KvCache.create_cpu_cache(HOST_DESC, [0x1000, 0x2000])
    assert isinstance(cache, KvCache) and cache.cache_id == -1 and cache.is_blocks_cache
    assert cache.per_device_tensor_addrs == [[0x1000, 0x2000]]
    assert cache.tensor_addrs == [0x1000, 0x2000] and cache.cache_desc is HOST_DESC


def test_kv_cache_create_cpu_cache_list_of_lists():
    cache = KvCache.create_cpu_cache(HOST_DESC, [[0x1000, 0x2000], [0x3000, 0x4000]])
    assert cache.per_device_tensor_addrs == [[0x1000, 0x2000], [0x3000, 0x4000]]
    assert cache.tensor_addrs == [0x1000, 0x2000]


def test_kv_cache_views_what_it_was_given():
    arrays = [np.arange(32, dtype=np.int32).reshape(4, 8) for _ in range(2)]
    cache = KvCache.create_cpu_cache(HOST_DESC, [[a.ctypes.data for a in arrays]])
    assert (cache.as_numpy(1) == arrays[1]).all()


@pytest.mark.parametrize("desc, addrs, message", [
    (CacheDesc(2, [4, 8], DataType.DT_INT32, Placement.DEVICE), [1, 2], "cache_desc placement must be HOST"),
    (HOST_DESC, [], "addrs length should be bigger than zero."),
    (HOST_DESC, [1, 2, 3], "cache_desc num_tensors:2 should be equal to size of addrs:3"),
    (HOST_DESC, [[1, 2], [3]], "cache_desc num_tensors:2 should be equal to size of the internal element of addrs:1"),
    (HOST_DESC, [[1, 2], 3], "the type of the internal element of addrs should be consistent."),
    (HOST_DESC, [1, [2, 3]], "the type of the internal element of addrs should be consistent."),
])
def test_kv_cache_create_cpu_cache_refusals(desc, addrs, message):
    assert raises_llm(KvCache.create_cpu_cache, desc, addrs) == message


@pytest.mark.parametrize("addrs", [(1, 2), [1, "2"], [[1, "2"]], [1.0, 2.0], None])
def test_kv_cache_create_cpu_cache_type_errors(addrs):
    with pytest.raises(TypeError):
        KvCache.create_cpu_cache(HOST_DESC, addrs)


# -- CacheManager.check_cache_key ------------------------------------------------------------------

def test_check_cache_key_is_cann_s():
    assert CacheManager.check_cache_key(CacheKey(1, 2)) is None
    assert CacheManager.check_cache_key(CacheKey(1, UNSET, prefix_id=3)) is None
    assert raises_llm(CacheManager.check_cache_key, CacheKey(1, UNSET)) == (
        f"one of req id and prefix id should contain valid value:[0, 2**64-1), req id:{UNSET},prefix id:{UNSET}.")
    assert raises_llm(CacheManager.check_cache_key, CacheKey(1, 2, prefix_id=3)) == (
        "only one of req id and prefix id should contain valid value:[0, 2**64-1), req id:2, prefix id:3.")


def test_pull_with_a_key_naming_no_row_is_refused_by_check_cache_key():
    dd = LLMDataDist(LLMRole.DECODER, 14)
    dd.init({"llm.EnableCacheManager": "1"})
    try:
        memory = [np.zeros((4, 8), np.int32) for _ in range(2)]
        cache = dd.cache_manager.register_cache(HOST_DESC, [a.ctypes.data for a in memory])
        assert raises_llm(dd.cache_manager.pull_cache, CacheKey(1, UNSET), cache).startswith(
            "one of req id and prefix id should contain valid value")
    finally:
        dd.finalize()


# -- DataType.DT_STRING: sized as CANN's code sizes it ---------------------------------------------

def test_a_string_cache_has_cann_s_sixteen_byte_elements(py_api):
    """CANN's CacheDesc.size asks LLMUtils::CalcTensorMemSize, which sizes DT_STRING as 16 bytes
    (GE's StringHead: address and length); GE's own GetSizeByDataType gives it no size."""
    desc = CacheDesc(1, [4, 2], DataType.DT_STRING, Placement.HOST)
    assert desc.size == 4 * 2 * 16
    memory = np.zeros(desc.size, np.uint8)
    cache = py_api.cm.register_cache(desc, [memory.ctypes.data])
    view = cache.as_numpy(0)
    assert view.shape == (4, 2) and view.dtype.itemsize == 16
    py_api.cm.unregister_cache(cache.cache_id)
