"""The C++ style's data types: the 41 ``DT_*`` that CANN's ``include/llm_datadist/llm_datadist.h``
re-exports from GE (``using ge::DT_*``), with GE's numbers (hicann/metadef,
``inc/external/graph/c_types.h``) and element sizes (``GetSizeByDataType`` in
``inc/external/graph/types.h``; DT_STRING and DT_STRING_REF as CANN's ``LLMUtils`` sizes them), and
the constants of CANN's ``include/llm_datadist/llm_engine_types.h``."""

from __future__ import annotations

import numpy as np
import pytest

from llm_datadist import DataType, cpp
from llm_datadist._memory import tensor_bytes
from llm_datadist.data_type import element_size, numpy_dtype

# name: (ge::DataType number, GE's size: bytes, or 1000 + bits for the types packed below a byte;
# -1 for none). Written out from GE's headers, not derived from the package's table.
GE = {
    "DT_FLOAT": (0, 4), "DT_FLOAT16": (1, 2), "DT_INT8": (2, 1), "DT_INT32": (3, 4), "DT_UINT8": (4, 1),
    "DT_INT16": (6, 2), "DT_UINT16": (7, 2), "DT_UINT32": (8, 4), "DT_INT64": (9, 8), "DT_UINT64": (10, 8),
    "DT_DOUBLE": (11, 8), "DT_BOOL": (12, 1), "DT_STRING": (13, 16), "DT_DUAL_SUB_INT8": (14, 1),
    "DT_DUAL_SUB_UINT8": (15, 1), "DT_COMPLEX64": (16, 8), "DT_COMPLEX128": (17, 16), "DT_QINT8": (18, 1),
    "DT_QINT16": (19, 2), "DT_QINT32": (20, 4), "DT_QUINT8": (21, 1), "DT_QUINT16": (22, 2),
    "DT_RESOURCE": (23, 8), "DT_STRING_REF": (24, 16), "DT_DUAL": (25, 5), "DT_VARIANT": (26, 8),
    "DT_BF16": (27, 2), "DT_UNDEFINED": (28, -1), "DT_INT4": (29, 1004), "DT_UINT1": (30, 1001),
    "DT_INT2": (31, 1002), "DT_UINT2": (32, 1002), "DT_COMPLEX32": (33, 4), "DT_HIFLOAT8": (34, 1),
    "DT_FLOAT8_E5M2": (35, 1), "DT_FLOAT8_E4M3FN": (36, 1), "DT_FLOAT8_E8M0": (37, 1),
    "DT_FLOAT6_E3M2": (38, 1006), "DT_FLOAT6_E2M3": (39, 1006), "DT_FLOAT4_E2M1": (40, 1004),
    "DT_FLOAT4_E1M2": (41, 1004),
}
SIZED = [name for name, (_, size) in GE.items() if size != -1]


def expected_bytes(name: str, elements: int) -> int:
    size = GE[name][1]
    return elements * size if size < 1000 else -(-elements * (size - 1000) // 8)


def test_every_dt_of_the_header_with_ge_s_number():
    assert len(GE) == 41
    assert {member.name: int(member) for member in cpp.DataType} == {name: number for name, (number, _) in GE.items()}
    for name, (number, _) in GE.items():
        assert getattr(cpp, name) is cpp.DataType[name] and getattr(cpp, name) == number
    assert str(cpp.DT_FLOAT8_E4M3FN) == "DataType.DT_FLOAT8_E4M3FN"


def test_the_python_data_types_are_ge_s():
    for member in DataType:
        assert GE[member.name][0] == member.value
        assert element_size(member) == element_size(cpp.DataType[member.name])


@pytest.mark.parametrize("name", SIZED)
def test_tensor_bytes_are_ge_s(name):
    for shape in ([2, 8], [3, 3], [1], [5, 7, 3]):
        assert tensor_bytes(shape, cpp.DataType[name]) == expected_bytes(name, int(np.prod(shape))), shape


@pytest.mark.parametrize("name", SIZED)
def test_a_cache_of_every_sized_type_registers(dd, name):
    desc = cpp.CacheDesc(placement=cpp.CachePlacement.kHost, num_tensors=2, data_type=getattr(cpp, name),
                         shape=[4, 16])
    memory = [np.zeros(expected_bytes(name, 64), np.uint8) for _ in range(2)]
    cache_id = cpp.Ref()
    assert dd.RegisterKvCache(desc, [a.ctypes.data for a in memory], cpp.RegisterCfg(), cache_id) == cpp.LLM_SUCCESS
    assert dd.UnregisterKvCache(cache_id.value) == cpp.LLM_SUCCESS


@pytest.mark.parametrize("data_type", [cpp.DT_UNDEFINED, 28, 5, 42, -1, "DT_FLOAT", 1.0, True])
def test_types_without_a_size_are_param_invalid(dd, data_type):
    desc = cpp.CacheDesc(placement=cpp.CachePlacement.kHost, num_tensors=1, data_type=data_type, shape=[4])
    memory = np.zeros(64, np.uint8)
    assert dd.RegisterKvCache(desc, [memory.ctypes.data], cpp.RegisterCfg(), cpp.Ref()) == cpp.LLM_PARAM_INVALID
    assert dd.AllocateCache(desc, cpp.Cache()) == cpp.LLM_PARAM_INVALID


def test_numbers_and_python_data_types_are_taken_too(dd):
    for data_type in (36, DataType.DT_FLOAT16):
        desc = cpp.CacheDesc(num_tensors=1, data_type=data_type, shape=[4, 8])
        cache = cpp.Cache()
        assert dd.AllocateCache(desc, cache) == cpp.LLM_SUCCESS
        assert dd.DeallocateCache(cache.cache_id) == cpp.LLM_SUCCESS


def test_an_fp8_kv_cache_copies_its_blocks(dd):
    """A C++-style FP8 (E4M3FN) KV cache: 4 blocks of 16 one-byte elements per tensor (DEVICE memory
    of the cpu runtime, which the host addresses: CopyKvBlocks does not copy host to host)."""
    desc = cpp.CacheDesc(placement=cpp.CachePlacement.kDevice, num_tensors=2, data_type=cpp.DT_FLOAT8_E4M3FN,
                         shape=[4, 16])
    kv = [np.arange(64, dtype=np.uint8).reshape(4, 16) + 100 * i for i in range(2)]
    cache_id = cpp.Ref()
    assert dd.RegisterKvCache(desc, [t.ctypes.data for t in kv], cpp.RegisterCfg(), cache_id) == cpp.LLM_SUCCESS
    cache = cpp.Cache(cache_id=cache_id.value, tensor_addrs=[t.ctypes.data for t in kv], cache_desc=desc)
    assert dd.CopyKvBlocks(cache, cache, [1], [[3]]) == cpp.LLM_SUCCESS
    for i, tensor in enumerate(kv):
        assert (tensor[3] == np.arange(16, 32) + 100 * i).all() and (tensor[1] == tensor[3]).all()
    assert dd.UnregisterKvCache(cache_id.value) == cpp.LLM_SUCCESS


def test_an_int4_cache_packs_two_elements_a_byte(dd):
    """DT_INT4, 4 blocks of 16 elements: 32 bytes a tensor, 8 a block."""
    desc = cpp.CacheDesc(placement=cpp.CachePlacement.kDevice, num_tensors=1, data_type=cpp.DT_INT4, shape=[4, 16])
    tensor = np.arange(32, dtype=np.uint8)
    cache_id = cpp.Ref()
    assert dd.RegisterKvCache(desc, [tensor.ctypes.data], cpp.RegisterCfg(), cache_id) == cpp.LLM_SUCCESS
    cache = cpp.Cache(cache_id=cache_id.value, tensor_addrs=[tensor.ctypes.data], cache_desc=desc)
    assert dd.CopyKvBlocks(cache, cache, [0], [[2]]) == cpp.LLM_SUCCESS
    assert (tensor[16:24] == np.arange(8)).all() and (tensor[24:] == np.arange(24, 32)).all()
    assert dd.UnregisterKvCache(cache_id.value) == cpp.LLM_SUCCESS


def test_a_packed_row_that_ends_inside_a_byte_has_cann_s_rounded_down_stride(dd):
    """DT_INT4 [3, 3]: 36 bits, 5 bytes; CANN's stride is tensor_size / num_blocks = 1 byte."""
    desc = cpp.CacheDesc(placement=cpp.CachePlacement.kDevice, num_tensors=1, data_type=cpp.DT_INT4, shape=[3, 3])
    tensor = np.array([1, 2, 3, 4, 5], np.uint8)
    cache_id = cpp.Ref()
    assert dd.RegisterKvCache(desc, [tensor.ctypes.data], cpp.RegisterCfg(), cache_id) == cpp.LLM_SUCCESS
    cache = cpp.Cache(cache_id=cache_id.value, tensor_addrs=[tensor.ctypes.data], cache_desc=desc)
    assert dd.CopyKvBlocks(cache, cache, [0], [[2]]) == cpp.LLM_SUCCESS
    assert tensor.tolist() == [1, 2, 1, 4, 5]
    assert dd.UnregisterKvCache(cache_id.value) == cpp.LLM_SUCCESS


def test_numpy_views_of_the_ge_types():
    assert numpy_dtype(cpp.DT_FLOAT8_E4M3FN) == np.dtype(np.uint8)
    assert numpy_dtype(cpp.DT_BF16) == np.dtype(np.uint16) == numpy_dtype(DataType.DT_BF16)
    assert numpy_dtype(cpp.DT_COMPLEX64) == np.dtype(np.complex64)
    assert numpy_dtype(cpp.DT_QINT8) == np.dtype(np.int8)
    assert numpy_dtype(cpp.DT_STRING).itemsize == 16 and numpy_dtype(cpp.DT_DUAL).itemsize == 5
    for packed in (cpp.DT_INT4, cpp.DT_UINT1, cpp.DT_FLOAT6_E3M2, cpp.DT_UNDEFINED):
        with pytest.raises(Exception) as info:
            numpy_dtype(packed)
        assert "no numpy view" in str(info.value)


def test_llm_engine_types_constants_are_cann_s():
    assert (cpp.llm.kPrompt, cpp.llm.kDecoder) == ("Prompt", "Decoder")
    assert cpp.llm.LLM_OPTION_CLUSTER_INFO == "llm.ClusterInfo"
    assert cpp.llm.LLM_OPTION_ROLE == "llm.Role"
    assert cpp.llm.LLM_OPTION_SYNC_KV_CACHE_WAIT_TIME == "llm.SyncKvCacheWaitTime" == cpp.OPTION_SYNC_CACHE_WAIT_TIME
    assert cpp.llm.LLM_OPTION_OUTPUT_MAX_SIZE == "llm.OutputMaxSize"
    assert cpp.llm.LLM_OPTION_ENABLE_SWITCH_ROLE == "llm.EnableSwitchRole" == cpp.OPTION_ENABLE_SET_ROLE
    assert cpp.llm.LLM_OPTION_BUF_POOL_CFG == "llm.BufPoolCfg" == cpp.OPTION_BUF_POOL_CFG
