"""The C++-style API (llm_datadist.cpp): Status returns, output parameters, structs, defaults."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from llm_datadist import _core, cpp



def test_struct_defaults_follow_the_header():
    assert cpp.KvCacheExtParam().src_layer_range == (-1, -1)
    assert cpp.KvCacheExtParam().dst_layer_range == (-1, -1)
    assert cpp.KvCacheExtParam().tensor_num_per_layer == 2
    desc = cpp.CacheDesc()
    assert (desc.placement, desc.num_tensors, desc.data_type, desc.shape) == \
        (cpp.CachePlacement.kDevice, 0, cpp.DT_UNDEFINED, [])
    cache = cpp.Cache()
    assert cache.cache_id == -1 and cache.tensor_addrs == [] and isinstance(cache.cache_desc, cpp.CacheDesc)
    assert cpp.IpInfo().port == 0 and cpp.ClusterInfo().remote_cluster_id == 0
    assert cpp.Cache().tensor_addrs is not cpp.Cache().tensor_addrs  # no shared mutable defaults
    assert [int(r) for r in cpp.LlmRole] == [1, 2, 3, 4]
    with pytest.raises(TypeError):
        cpp.CacheDesc(bogus=1)


def test_every_method_fails_before_initialize():
    dd = cpp.LlmDataDist(1, cpp.LlmRole.kDecoder)
    desc = cpp.CacheDesc(num_tensors=1, data_type=cpp.DT_INT32, shape=[2])
    assert dd.AllocateCache(desc, cpp.Cache()) == cpp.LLM_FAILED
    assert dd.DeallocateCache(1) == cpp.LLM_FAILED
    assert dd.RegisterKvCache(desc, [1], cpp.RegisterCfg(), cpp.Ref()) == cpp.LLM_FAILED
    assert dd.UnregisterKvCache(1) == cpp.LLM_FAILED
    assert dd.CopyKvBlocks(cpp.Cache(), cpp.Cache(), [0], [[0]]) == cpp.LLM_FAILED
    assert dd.CopyKvCache(cpp.Cache(), cpp.Cache()) == cpp.LLM_FAILED
    assert dd.SetRole(cpp.LlmRole.kPrompt) == cpp.LLM_FAILED
    assert dd.LinkLlmClusters([], []) == cpp.LLM_FAILED
    assert dd.PushKvBlocks(cpp.Cache(), cpp.CacheIndex(), [0], [0]) == cpp.LLM_FAILED


@pytest.mark.parametrize("options", [
    {}, {cpp.OPTION_DEVICE_ID: "0;1"}, {cpp.OPTION_DEVICE_ID: "0", cpp.OPTION_SYNC_CACHE_WAIT_TIME: "0"},
    {cpp.OPTION_DEVICE_ID: "0", cpp.OPTION_LISTEN_IP_INFO: "127.0.0.1:port"}, {cpp.OPTION_DEVICE_ID: 0},
])
def test_initialize_rejects_bad_options(options):
    dd = cpp.LlmDataDist(1, cpp.LlmRole.kPrompt)
    assert dd.Initialize(options) == cpp.LLM_PARAM_INVALID
    assert dd.AllocateCache(cpp.CacheDesc(), cpp.Cache()) == cpp.LLM_FAILED


def test_initialize_twice_and_second_instance(dd):
    assert dd.Initialize({cpp.OPTION_DEVICE_ID: "0"}) == cpp.LLM_SUCCESS
    other = cpp.LlmDataDist(2, cpp.LlmRole.kDecoder)
    assert other.Initialize({cpp.OPTION_DEVICE_ID: "0"}) == cpp.LLM_FAILED


def test_push_kv_blocks_example_setup(dd):
    """Spec §16.1: DT_INT32 cache of shape {4, 16}, num_tensors 4, allocated with AllocateCache."""
    cache_desc = cpp.CacheDesc()
    cache_desc.num_tensors = 4
    cache_desc.data_type = cpp.DT_INT32
    cache_desc.shape = [4, 16]
    cache = cpp.Cache()
    assert dd.AllocateCache(cache_desc, cache) == cpp.LLM_SUCCESS
    assert cache.cache_id == 1 and len(cache.tensor_addrs) == 4 and cache.cache_desc is cache_desc
    ext = cpp.KvCacheExtParam()
    ext.src_layer_range = (3, 3)
    ext.dst_layer_range = (3, 3)
    ext.tensor_num_per_layer = 1
    # The layer range selects exactly tensor 3 under the core's C++ rules.
    assert _core.resolve_layer_ranges(ext.src_layer_range, ext.dst_layer_range, 4, 4,
                                      ext.tensor_num_per_layer, True) == ([3], [3])
    # Cluster 0 is this cluster itself: like any peer, it must be linked first (to its own
    # listener, as CANN allows). To an unlinked peer: NOT_YET_LINK.
    # (tests/transport runs this example between two processes.)
    assert dd.PushKvBlocks(cache, cpp.CacheIndex(cluster_id=0, cache_id=1), [0, 1, 2, 3], [3, 2, 1, 0],
                           ext) == cpp.LLM_NOT_YET_LINK
    assert dd.PushKvBlocks(cache, cpp.CacheIndex(cluster_id=7, cache_id=1), [0, 1, 2, 3], [3, 2, 1, 0],
                           ext) == cpp.LLM_NOT_YET_LINK


@pytest.mark.parametrize("make_holder,read", [
    (cpp.Ref, lambda h: h.value), (ctypes.c_int64, lambda h: h.value), (list, lambda h: h[0]),
])
def test_register_kv_cache_fills_the_output_parameter(dd, make_holder, read):
    arrays = [np.zeros((4, 8), np.float16) for _ in range(2)]
    desc = cpp.CacheDesc(num_tensors=2, data_type=cpp.DT_FLOAT16, shape=[4, 8])
    holder = make_holder()
    assert dd.RegisterKvCache(desc, [a.ctypes.data for a in arrays], cpp.RegisterCfg(), holder) == cpp.LLM_SUCCESS
    assert read(holder) == 1
    assert dd.UnregisterKvCache(read(holder)) == cpp.LLM_SUCCESS
    assert dd.UnregisterKvCache(read(holder)) == cpp.LLM_SUCCESS  # unknown id: success


def test_register_kv_cache_errors(dd):
    array = np.zeros((4, 8), np.int32)
    desc = cpp.CacheDesc(num_tensors=2, data_type=cpp.DT_INT32, shape=[4, 8])
    out = cpp.Ref(-1)
    assert dd.RegisterKvCache(desc, [], cpp.RegisterCfg(), out) == cpp.LLM_PARAM_INVALID
    assert dd.RegisterKvCache(desc, [array.ctypes.data], cpp.RegisterCfg(), out) == cpp.LLM_PARAM_INVALID
    assert dd.RegisterKvCache(desc, [array.ctypes.data, 0], cpp.RegisterCfg(), out) == cpp.LLM_PARAM_INVALID
    assert dd.RegisterKvCache(desc, [array.ctypes.data] * 2, cpp.RegisterCfg(), object()) == cpp.LLM_PARAM_INVALID
    assert out.value == -1


def test_allocate_cache_errors(dd):
    cache = cpp.Cache()
    assert dd.AllocateCache(cpp.CacheDesc(num_tensors=0, data_type=cpp.DT_INT32, shape=[4]), cache) == \
        cpp.LLM_PARAM_INVALID
    assert dd.AllocateCache(cpp.CacheDesc(num_tensors=1, data_type=cpp.DT_UNDEFINED, shape=[4]), cache) == \
        cpp.LLM_PARAM_INVALID
    assert dd.AllocateCache(cpp.CacheDesc(num_tensors=1, data_type=cpp.DT_INT32, shape=[]), cache) == \
        cpp.LLM_PARAM_INVALID
    assert dd.AllocateCache(cpp.CacheDesc(num_tensors=1, data_type=cpp.DT_INT32, shape=[4], placement=7),
                            cache) == cpp.LLM_PARAM_INVALID
    assert cache.cache_id == -1


def _allocate(dd, placement=cpp.CachePlacement.kDevice, shape=(4, 16), num_tensors=2):
    cache = cpp.Cache()
    desc = cpp.CacheDesc(placement=placement, num_tensors=num_tensors, data_type=cpp.DT_INT32, shape=list(shape))
    assert dd.AllocateCache(desc, cache) == cpp.LLM_SUCCESS
    views = [_core.HostRegion(a, int(np.prod(shape)) * 4).as_array(np.int32, shape) for a in cache.tensor_addrs]
    return cache, views


def test_copy_kv_blocks_to_several_destination_lists(dd):
    src, src_views = _allocate(dd)
    dst, dst_views = _allocate(dd, placement=cpp.CachePlacement.kHost)
    for i, view in enumerate(src_views):
        view[:] = np.arange(64, dtype=np.int32).reshape(4, 16) + 1000 * i
    assert dd.CopyKvBlocks(src, dst, [0, 1], [[3, 2], [1, 0]]) == cpp.LLM_SUCCESS
    for s, d in zip(src_views, dst_views):
        np.testing.assert_array_equal(d[[3, 2, 1, 0]], s[[0, 1, 0, 1]])
    assert dd.CopyKvBlocks(src, dst, [0, 1], [[3]]) == cpp.LLM_PARAM_INVALID
    assert dd.CopyKvBlocks(src, dst, [], [[]]) == cpp.LLM_PARAM_INVALID
    assert dd.CopyKvBlocks(src, dst, [0], [[-1]]) == cpp.LLM_PARAM_INVALID
    assert dd.CopyKvBlocks(dst, dst, [0], [[1]]) == cpp.LLM_PARAM_INVALID  # host to host


def test_copy_kv_cache_device_to_host(dd):
    src, src_views = _allocate(dd, shape=(2, 8))
    dst, dst_views = _allocate(dd, placement=cpp.CachePlacement.kHost, shape=(2, 8))
    src_views[0][:] = 9
    assert dd.CopyKvCache(src, dst, 1, 0) == cpp.LLM_SUCCESS
    assert (dst_views[0][0] == 9).all() and not dst_views[0][1].any()
    assert dd.CopyKvCache(dst, src) == cpp.LLM_PARAM_INVALID  # from host
    assert dd.CopyKvCache(src, dst, 2, 0) == cpp.LLM_PARAM_INVALID
    assert dd.CopyKvCache(src, dst, 0, 0, 0, 0) == cpp.LLM_PARAM_INVALID
    assert dd.CopyKvCache(src, cpp.Cache(cache_id=99)) == cpp.LLM_KV_CACHE_NOT_EXIST


def test_set_role(dd):
    assert dd.SetRole(cpp.LlmRole.kDecoder) == cpp.LLM_SUCCESS
    assert dd.SetRole(cpp.LlmRole.kEnd) == cpp.LLM_PARAM_INVALID
    assert dd.SetRole(cpp.LlmRole.kPrompt, {cpp.OPTION_LISTEN_IP_INFO: "bad"}) == cpp.LLM_PARAM_INVALID
    assert dd.SetRole(cpp.LlmRole.kPrompt, {cpp.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"}) == cpp.LLM_SUCCESS


def test_status_prints_its_name():
    assert repr(cpp.LLM_PARAM_INVALID) == "LLM_PARAM_INVALID"
    assert cpp.LLM_PARAM_INVALID == 0x5010B005 and cpp.LLM_SUCCESS.is_ok()
