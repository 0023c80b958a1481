"""The CANN Python API surface: types, defaults and the error classes of spec §3 and §8."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import optional_deps
import pytest

import llm_datadist as ld
from llm_datadist import (
    BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType, LLMConfig,
    LLMDataDist, LLMException, LLMRole, LLMStatusCode, Placement,
)

PARAM_INVALID = LLMStatusCode.LLM_PARAM_INVALID


def status(fn, *args, **kwargs):
    with pytest.raises(LLMException) as info:
        fn(*args, **kwargs)
    return info.value.status_code


# -- enums and module surface ------------------------------------------------------------------

def test_enum_values_follow_the_spec():
    assert [int(r) for r in (LLMRole.PROMPT, LLMRole.DECODER, LLMRole.MIX)] == [1, 2, 3]
    assert str(LLMRole.PROMPT) == "LLMRole.PROMPT"
    assert (Placement.HOST.value, Placement.DEVICE.value) == (0, 1)
    assert (ld.Memtype.MEM_TYPE_DEVICE.value, ld.Memtype.MEM_TYPE_HOST.value) == (0, 1)
    assert ld.RegisterMemStatus(1) is ld.RegisterMemStatus.PREPARING
    with pytest.raises(ValueError):  # CANN maps unknown native values in query_register_mem_status only
        ld.RegisterMemStatus(99)
    assert DataType.DT_BF16.value == 27 and DataType.DT_INT16.value == 6


def test_public_names_are_exported():
    for name in ["LLMDataDist", "LLMConfig", "LlmConfig", "LLMClusterInfo", "LLMRole", "LLMStatusCode",
                 "LLMException", "Status", "DataType", "CacheDesc", "Cache", "KvCache", "CacheKey",
                 "CacheKeyByIdAndIndex", "BlocksCacheKey", "Placement", "RegisterMemStatus",
                 "LayerSynchronizer", "TransferConfig", "TransferWithCacheKeyConfig", "CacheTask",
                 "Memtype", "MemInfo"]:
        assert name in ld.__all__ and hasattr(ld, name)
    assert ld.LlmConfig is ld.LLMConfig


# -- LLMConfig ------------------------------------------------------------------------------------

def test_generate_options_matches_the_spec_example():
    cfg = LLMConfig()
    cfg.device_id = 3
    cfg.sync_kv_timeout = 20000
    cfg.enable_switch_role = True
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    options = cfg.generate_options()
    assert options == {"ge.exec.deviceId": "3", "ge.session_device_id": "3",
                       "llm.SyncKvCacheWaitTime": "20000", "llm.EnableCacheManager": "1",
                       "llm.EnableRemoteCacheAccessible": "1", "llm.EnableSwitchRole": "1",
                       "llm.MemoryUtilization": "0.95"}
    cfg.listen_ip_info = "127.0.0.1:26000"
    again = cfg.generate_options()
    assert again is options and options["llm.listenIpInfo"] == "127.0.0.1:26000"
    assert cfg.gen_options() is options


def test_generate_options_emits_only_what_was_set():
    cfg = LLMConfig()
    assert cfg.generate_options() == {"llm.MemoryUtilization": "0.95"}
    cfg.local_comm_res = ""
    cfg.link_retry_count = 3
    cfg.mem_pool_cfg = '{"memory_size": 1024}'
    options = cfg.generate_options()
    assert options["llm.LocalCommRes"] == "" and options["llm.LinkRetryCount"] == "3"
    assert json.loads(options["llm.MemPoolConfig"]) == {"memory_size": 1024}


def test_legacy_cluster_info_packs_ips():
    cfg = LLMConfig()
    cfg.cluster_info = json.dumps({"cluster_id": 1, "listen_ip_info": [{"ip": "1.0.0.127", "port": 26000}]})
    packed = json.loads(cfg.generate_options()["llm.ClusterInfo"])
    assert packed == {"cluster_id": 1, "listen_ip_info": [{"ip": 0x7F000001, "port": 26000}]}


def test_cluster_info_packs_ips_little_endian():
    info = ld.LLMClusterInfo()
    info.remote_cluster_id = 2
    info.append_remote_ip_info("127.0.0.1", 26000)
    info.append_local_ip_info(16777343, 0)
    assert info.remote_ip_info_list == [(0x0100007F, 26000)] and info.local_ip_info_list == [(16777343, 0)]
    with pytest.raises(ValueError):
        info.append_remote_ip_info("300.1.1.1", 1)
    with pytest.raises(ValueError):
        info.append_remote_ip_info("127.0.0.1", 70000)
    with pytest.raises(ValueError):
        info.remote_cluster_id = -1


@pytest.mark.parametrize("name,value,error", [
    ("device_id", "0", TypeError), ("device_id", -1, LLMException), ("device_id", 2**31, ValueError),
    ("sync_kv_timeout", 0, LLMException),
    ("sync_kv_timeout", 2**31, ValueError), ("sync_kv_timeout", "12a", LLMException),
    ("enable_cache_manager", 1, TypeError), ("mem_utilization", 1.5, LLMException),
    ("link_retry_count", 0, LLMException), ("mem_pool_cfg", "{not json", LLMException),
    ("mem_pool_cfg", '{"memory_size": 1, "page_shift": 5}', LLMException), ("listen_ip_info", 5, TypeError),
])
def test_config_setters_validate(name, value, error):
    with pytest.raises(error):
        setattr(LLMConfig(), name, value)


# -- keys ----------------------------------------------------------------------------------------

def test_cache_key_forms():
    key = CacheKey(1, 2)
    assert (key.cluster_id, key.req_id, key.model_id, key.prefix_id) == (1, 2, 0, 2**64 - 1)
    assert CacheKey(prompt_cluster_id=1, req_id=2, model_id=3).model_id == 3
    assert CacheKey(1, req_id=2) == CacheKey(1, 2)
    assert status(CacheKey, 1, 2, 3, 4, 5) == PARAM_INVALID
    assert status(CacheKey, 1, bogus=2) == PARAM_INVALID
    with pytest.raises(ValueError):
        CacheKey(-1, 2)
    with pytest.raises(TypeError):
        CacheKey("1", 2)


def test_blocks_cache_key_forms():
    assert BlocksCacheKey(5).model_id == 0
    assert BlocksCacheKey(cluster_id=5, model_id=1).model_id == 1
    assert "prompt_cluster_id=5" in repr(BlocksCacheKey(prompt_cluster_id=5))
    assert "cluster_id=5" in repr(BlocksCacheKey(cluster_id=5))
    assert status(BlocksCacheKey, 1, 2, 3) == PARAM_INVALID
    assert status(BlocksCacheKey, 1, unknown=2) == PARAM_INVALID


def test_cache_key_by_id_and_index_ranges():
    key = CacheKeyByIdAndIndex(1, 2, 3)
    assert (key.cluster_id, key.cache_id, key.batch_index) == (1, 2, 3)
    with pytest.raises(ValueError):
        CacheKeyByIdAndIndex(1, 2, -1)
    with pytest.raises(ValueError):
        CacheKeyByIdAndIndex(1, 2, 2**32)


# -- CacheDesc -----------------------------------------------------------------------------------

def test_cache_desc_properties_and_shape_by_reference():
    shape = [4, 16, 8]
    desc = CacheDesc(2, shape, DataType.DT_FLOAT16)
    assert desc.placement == Placement.DEVICE and desc.batch_size == 4 and desc.size == 4 * 16 * 8 * 2
    desc.update_dim(0, 6)
    assert shape[0] == 6 and desc.size == 6 * 16 * 8 * 2
    with pytest.raises(TypeError):
        CacheDesc(2, [1.0], DataType.DT_FLOAT)
    with pytest.raises(TypeError):
        CacheDesc(2, [1], "DT_FLOAT")
    with pytest.raises(ValueError):
        CacheDesc(-1, [1], DataType.DT_FLOAT)
    assert status(CacheDesc, 1, [4], DataType.DT_FLOAT, Placement.HOST, 1) == PARAM_INVALID


# -- LLMDataDist life cycle --------------------------------------------------------------------------

def test_constructor_checks_types():
    with pytest.raises(TypeError):
        LLMDataDist(1, 1)
    with pytest.raises(ValueError):
        LLMDataDist(LLMRole.PROMPT, -1)
    with pytest.raises(TypeError):
        LLMDataDist(LLMRole.PROMPT, "1")


def test_cache_manager_needs_init_and_v2_mode():
    dd = LLMDataDist(LLMRole.DECODER, 2)
    with pytest.raises(RuntimeError, match="not initialized"):
        _ = dd.cache_manager
    dd.init({"ge.exec.deviceId": "0"})
    try:
        assert status(lambda: dd.cache_manager) == PARAM_INVALID
        assert status(lambda: dd.kv_cache_manager) == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    finally:
        dd.finalize()


def test_one_initialized_instance_per_process(py_api):
    other = LLMDataDist(LLMRole.DECODER, 9)
    assert status(other.init, {"llm.EnableCacheManager": "1"}) == LLMStatusCode.LLM_FAILED
    py_api.dd.init({})  # already initialized: no-op


@pytest.mark.parametrize("options", [
    {"llm.EnableCacheManager": "1", "llm.listenIpInfo": "127.0.0.1"},
    {"llm.EnableCacheManager": "1", "ge.exec.deviceId": "0;1"},
    {"llm.EnableCacheManager": "1", "llm.SyncKvCacheWaitTime": "-5"},
    {"llm.LocalCommRes": "", "llm.EnableCacheManager": "0"},
    {"llm.EnableCacheManager": "1", "llm.TransferBackend": "hixl"},
    {"llm.EnableCacheManager": "1", "ge.flowGraphMemMaxSize": "1,2"},
])
def test_init_rejects_bad_options(options):
    dd = LLMDataDist(LLMRole.PROMPT, 3)
    assert status(dd.init, options) == PARAM_INVALID
    dd.finalize()


def test_init_option_types():
    dd = LLMDataDist(LLMRole.PROMPT, 3)
    with pytest.raises(TypeError):
        dd.init({"ge.exec.deviceId": 0})


def test_finalize_then_reinit_and_stale_manager():
    dd = LLMDataDist(LLMRole.PROMPT, 4)
    dd.init({"llm.EnableCacheManager": "1"})
    cm = dd.cache_manager
    dd.finalize()
    assert status(cm.unregister_cache, 1) == LLMStatusCode.LLM_ENGINE_FINALIZED
    dd.finalize()  # twice is fine
    dd.init({"llm.EnableCacheManager": "1"})
    assert dd.cache_manager is not cm
    dd.finalize()


def test_atexit_finalizes_the_initialized_instance():
    code = textwrap.dedent("""
        import logging, llm_datadist as ld
        dd = ld.LLMDataDist(ld.LLMRole.PROMPT, 1)
        dd.init({"llm.EnableCacheManager": "1"})
        import llm_datadist.llm_datadist as m
        real = m.LLMDataDist.finalize
        def traced(self):
            print("finalized", self.cluster_id, flush=True)
            real(self)
        m.LLMDataDist.finalize = traced
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "finalized 1" in out.stdout


# -- registration --------------------------------------------------------------------------------

def test_register_cache_argument_errors(py_api):
    cm = py_api.cm
    desc = CacheDesc(2, [4, 8], DataType.DT_INT32)
    arrays = [np.zeros((4, 8), np.int32) for _ in range(2)]
    with pytest.raises(TypeError):
        cm.register_cache(desc, tuple(a.ctypes.data for a in arrays))
    with pytest.raises(TypeError):
        cm.register_cache(desc, ["0x10", "0x20"])
    with pytest.raises(AttributeError):
        cm.register_cache(None, [a.ctypes.data for a in arrays])
    assert status(cm.register_cache, desc, [arrays[0].ctypes.data]) == PARAM_INVALID
    assert status(cm.register_cache, desc, []) == PARAM_INVALID
    assert status(cm.register_cache, desc, [arrays[0].ctypes.data, 0]) == PARAM_INVALID
    small = [np.zeros((2, 8), np.int32) for _ in range(2)]
    assert status(cm.register_blocks_cache, desc, small) == PARAM_INVALID
    with pytest.raises(TypeError):
        cm.register_cache(desc, [a.ctypes.data for a in arrays], remote_accessible=1)


def test_registered_numpy_arrays_are_kept_alive(py_api):
    desc = CacheDesc(2, [4, 8], DataType.DT_INT32)
    cache = py_api.cm.register_blocks_cache(desc, [np.full((4, 8), i, np.int32) for i in range(2)],
                                            BlocksCacheKey(7, 0))
    py_api.cm.copy_blocks(cache, {0: [1]})
    views = cache.as_numpy()
    assert (views[1] == 1).all() and cache.is_blocks_cache and cache.is_registered
    py_api.cm.unregister_cache(cache.cache_id)
    py_api.cm.unregister_cache(12345)  # unknown id: success


def test_register_torch_tensors(py_api):
    torch = optional_deps.importorskip("torch")
    tensors = [torch.arange(32, dtype=torch.int32).reshape(4, 8) for _ in range(2)]
    cache = py_api.cm.register_blocks_cache(CacheDesc(2, [4, 8], DataType.DT_INT32), tensors)
    py_api.cm.copy_blocks(cache, {3: [0]})
    assert tensors[1][0].tolist() == list(range(24, 32))
    assert status(py_api.cm.register_blocks_cache, CacheDesc(2, [4, 8], DataType.DT_INT32),
                  [t.t() for t in tensors]) == PARAM_INVALID  # not contiguous


# -- allocation ----------------------------------------------------------------------------------

def test_allocate_needs_a_matching_pool():
    dd = LLMDataDist(LLMRole.PROMPT, 5)
    cfg = LLMConfig()
    cfg.enable_cache_manager = True
    cfg.mem_pool_cfg = '{"memory_size": 3000}'
    dd.init(cfg.generate_options())
    try:
        cm = dd.cache_manager
        assert status(cm.allocate_cache, CacheDesc(1, [4], DataType.DT_INT8, Placement.HOST)) == PARAM_INVALID
        assert status(cm.allocate_cache, CacheDesc(0, [4], DataType.DT_INT8)) == PARAM_INVALID
        big = CacheDesc(2, [1024], DataType.DT_INT8)
        first = cm.allocate_cache(big)
        assert status(cm.allocate_cache, big) == LLMStatusCode.LLM_OUT_OF_MEMORY
        cm.deallocate_cache(first)
        assert first.tensor_addrs == []
        cm.allocate_cache(big)  # the pool got the bytes back
    finally:
        dd.finalize()


def test_cache_keys_bind_rows_and_defer_release(py_api):
    cm = py_api.cm
    desc = CacheDesc(1, [3, 4], DataType.DT_INT32, Placement.HOST)
    keys = [CacheKey(7, 1), CacheKey(7, 2**64 - 1), CacheKey(7, 3)]
    cache = cm.allocate_cache(desc, keys)
    engine = py_api.dd.engine
    assert engine.find_key(keys[0].owner_key())[1] == 0
    assert engine.find_key(keys[2].owner_key())[1] == 2
    assert status(cm.allocate_cache, desc, [CacheKey(7, 1)]) == PARAM_INVALID  # already bound
    assert status(cm.allocate_cache, desc, [CacheKey(7, 9), CacheKey(7, 9)]) == PARAM_INVALID
    assert status(cm.allocate_cache, desc, [CacheKey(7, i) for i in range(10, 14)]) == PARAM_INVALID
    used = engine.pools[0].used
    cm.deallocate_cache(cache)
    assert engine.pools[0].used == used  # keys still hold the memory
    cm.remove_cache_key(keys[0])
    cm.remove_cache_key(keys[0])  # unknown now: no-op
    cm.remove_cache_key(keys[2])
    assert engine.pools[0].used == used - desc.size


def test_deallocate_checks_the_cache_kind(py_api):
    blocks = py_api.allocate(1, [2, 4])
    rows = py_api.allocate(1, [2, 4], blocks=False)
    assert status(py_api.cm.deallocate_cache, blocks) == PARAM_INVALID
    assert status(py_api.cm.deallocate_blocks_cache, rows) == PARAM_INVALID


def test_views_outlive_deallocation_safely(py_api):
    cache = py_api.allocate(1, [2, 4])
    view = cache.as_numpy(0)
    view[:] = 5
    py_api.cm.deallocate_blocks_cache(cache)
    assert (view == 5).all()  # the view keeps the memory alive
    assert status(cache.as_numpy) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


# -- local copies ---------------------------------------------------------------------------------

def test_copy_cache_errors(py_api):
    cm = py_api.cm
    rows = py_api.allocate(2, [3, 4], blocks=False)
    blocks = py_api.allocate(2, [3, 4])
    assert status(cm.copy_cache, blocks, rows) == PARAM_INVALID
    assert status(cm.copy_cache, rows, rows, size=0) == PARAM_INVALID
    with pytest.raises(ValueError):
        cm.copy_cache(rows, rows, dst_batch_index=-1)
    with pytest.raises(TypeError):
        cm.copy_cache(rows, rows, offset="1")
    with pytest.raises(TypeError):
        cm.copy_cache(rows, None)


def test_copy_blocks_errors(py_api):
    cm = py_api.cm
    rows = py_api.allocate(2, [3, 4], blocks=False)
    blocks = py_api.allocate(2, [3, 4])
    assert status(cm.copy_blocks, rows, {0: [1]}) == PARAM_INVALID
    with pytest.raises(TypeError):
        cm.copy_blocks(blocks, {0: 1})
    with pytest.raises(TypeError):
        cm.copy_blocks(blocks, [(0, [1])])
    assert status(cm.copy_blocks, blocks, {-1: [1]}) == PARAM_INVALID


def test_swap_blocks_in_and_out_with_a_cpu_cache(py_api):
    cm = py_api.cm
    device = py_api.allocate(2, [6, 4])
    dev_views = device.as_numpy()
    for i, view in enumerate(dev_views):
        view[:] = np.arange(24, dtype=np.int32).reshape(6, 4) + 100 * i
    host_memory = np.zeros((2, 3, 4), np.int32)
    host = Cache.create_cpu_cache(CacheDesc(2, [3, 4], DataType.DT_INT32, Placement.HOST),
                                  [host_memory[0], host_memory[1]])
    assert host.cache_id == -1 and host.is_blocks_cache
    cm.swap_blocks(device, host, {5: 0, 1: 2})  # swap out
    np.testing.assert_array_equal(host_memory[1][0], dev_views[1][5])
    np.testing.assert_array_equal(host_memory[0][2], dev_views[0][1])
    host_memory[:, 1] = -7
    cm.swap_blocks(host, device, {1: 3})  # swap in
    assert (dev_views[0][3] == -7).all() and (dev_views[1][3] == -7).all()


def test_swap_blocks_errors_write_nothing(py_api):
    cm = py_api.cm
    device = py_api.allocate(2, [6, 4])
    host_a = py_api.allocate(2, [6, 4], device=False)
    odd = py_api.allocate(2, [6, 8], device=False)
    views = device.as_numpy()
    views[0][:] = 3
    assert status(cm.swap_blocks, host_a, host_a, {0: 1}) == PARAM_INVALID
    assert status(cm.swap_blocks, device, odd, {0: 1}) == PARAM_INVALID
    assert status(cm.swap_blocks, host_a, device, {0: 1, 1: 6}) == PARAM_INVALID
    assert (views[0] == 3).all() and not views[1].any()
    with pytest.raises(AttributeError):
        cm.swap_blocks(None, device, {0: 0})
    with pytest.raises(TypeError):
        cm.swap_blocks(device, host_a, {0: "1"})


def test_create_cpu_cache_needs_host_placement():
    addrs = [np.zeros(4, np.int32) for _ in range(2)]
    assert status(Cache.create_cpu_cache, CacheDesc(2, [4], DataType.DT_INT32), addrs) == PARAM_INVALID
    assert status(Cache.create_cpu_cache, CacheDesc(3, [4], DataType.DT_INT32, Placement.HOST),
                  addrs) == PARAM_INVALID


def test_transfers_without_a_link_say_not_yet_linked(py_api):
    cache = py_api.allocate(2, [4, 4])
    peer = py_api.dd.cluster_id + 1
    assert status(py_api.cm.pull_blocks, BlocksCacheKey(peer), cache, [0], [0]) == \
        LLMStatusCode.LLM_NOT_YET_LINK
    # A cluster info without remote_cluster_id is refused before any connection is tried.
    assert status(py_api.dd.link_clusters, [ld.LLMClusterInfo()]) == PARAM_INVALID
    # One's own cluster id is a peer like any other (CANN lets a cluster link to its own
    # listener): not linked yet.
    assert status(py_api.cm.pull_blocks, BlocksCacheKey(py_api.dd.cluster_id), cache, [0], [0]) == \
        LLMStatusCode.LLM_NOT_YET_LINK
