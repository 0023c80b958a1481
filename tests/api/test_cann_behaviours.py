"""Behaviours copied from CANN's Python package (hicann/hixl, ``src/python/llm_datadist/``):
exception classes and messages of its checks (``utils/utils.py`` ``check_isinstance`` /
``check_uint32``, ``status.py`` ``raise_if_false``), the lazy v1 names of its ``__init__.py``, its
enum base classes and the setters of its transfer configs. Where the C++ API has the call, the
C++ style returns the status instead of raising.

Transfers between two processes (``transfer_cache_async`` from a blocks cache) are in
``tests/transport/test_cann_async.py``.
"""

from __future__ import annotations

import enum
import sys
import types

import numpy as np
import pytest

import llm_datadist as ld
from llm_datadist import (
    BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType, LayerSynchronizer, LLMConfig,
    LLMDataDist, LLMException, LLMRole, LLMStatusCode, MemInfo, Memtype, Placement, TransferConfig,
    TransferWithCacheKeyConfig, cpp,
)

PARAM_INVALID = LLMStatusCode.LLM_PARAM_INVALID
PEER = 8  # a cluster id nobody links to


def message_of(info) -> str:
    """The message an exception was raised with (LLMException's str() adds the status)."""
    return info.value.args[0]


def raises_llm(fn, *args, status=PARAM_INVALID, **kwargs) -> str:
    with pytest.raises(LLMException) as info:
        fn(*args, **kwargs)
    assert info.value.status_code == status
    return message_of(info)


class Ready(LayerSynchronizer):
    def synchronize_layer(self, layer_index, timeout_in_millis):
        return True


class Local:
    """One initialized Python-style cluster with a 2-tensor row cache and a blocks cache."""

    def __init__(self, remote_accessible: bool) -> None:
        cfg = LLMConfig()
        cfg.device_id = 0
        cfg.enable_cache_manager = True
        cfg.enable_remote_cache_accessible = remote_accessible
        self.dd = LLMDataDist(LLMRole.PROMPT, 7)
        self.dd.init(cfg.generate_options())
        self.cm = self.dd.cache_manager
        self.memory = [np.zeros((4, 8), np.int32) for _ in range(4)]
        addrs = [a.ctypes.data for a in self.memory]
        self.rows = self.cm.register_cache(CacheDesc(2, [4, 8], DataType.DT_INT32), addrs[:2])
        self.blocks = self.cm.register_blocks_cache(CacheDesc(2, [4, 8], DataType.DT_INT32), addrs[2:])


@pytest.fixture(params=[True, False], ids=["remote-accessible", "not-remote-accessible"])
def local(request):
    cluster = Local(request.param)
    yield cluster
    cluster.dd.finalize()


@pytest.fixture
def accessible():
    cluster = Local(True)
    yield cluster
    cluster.dd.finalize()


@pytest.fixture
def cpp_dd():
    dd = cpp.LlmDataDist(7, cpp.LlmRole.kPrompt)
    assert dd.Initialize({cpp.OPTION_DEVICE_ID: "0"}) == cpp.LLM_SUCCESS
    memory = [np.zeros((4, 8), np.int32) for _ in range(2)]
    desc = cpp.CacheDesc(placement=cpp.CachePlacement.kDevice, num_tensors=2, data_type=cpp.DT_INT32, shape=[4, 8])
    cache_id = cpp.Ref()
    assert dd.RegisterKvCache(desc, [a.ctypes.data for a in memory], cpp.RegisterCfg(), cache_id) == cpp.LLM_SUCCESS
    dd.cache = cpp.Cache(cache_id=cache_id.value, tensor_addrs=[a.ctypes.data for a in memory], cache_desc=desc)
    dd.memory = memory
    yield dd
    dd.Finalize()


# -- transfer_cache_async with a blocks source and no src_block_indices ----------------------------

def test_transfer_cache_async_from_blocks_without_indices_takes_the_cache_path(accessible):
    """Not refused (CANN's sample does this): the task runs and fails only for want of a link."""
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(PEER, 0), range(0, 1), range(0, 1))
    task = accessible.cm.transfer_cache_async(accessible.blocks, Ready(), [cfg])
    assert task.get_results(5000) == [LLMStatusCode.LLM_NOT_YET_LINK]


def test_transfer_cache_async_empty_src_block_indices_mean_none(accessible):
    """CANN tests the index lists for truth: [] is "no indices", not an empty block transfer."""
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(PEER, 1), range(0, 1), range(0, 1))
    task = accessible.cm.transfer_cache_async(accessible.rows, Ready(), [cfg], src_block_indices=[],
                                              dst_block_indices=[])
    assert task.get_results(5000) == [LLMStatusCode.LLM_NOT_YET_LINK]


def test_transfer_with_cache_key_config_without_ranges_sends_every_layer(accessible):
    """Ranges set to None through the setters: every source layer, into the same layer (CANN
    also writes the default range back into the config)."""
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(PEER, 1), range(0, 1), range(0, 1))
    cfg.src_layer_range, cfg.dst_layer_range = None, None
    task = accessible.cm.transfer_cache_async(accessible.rows, Ready(), [cfg])
    assert task.get_results(5000) == [LLMStatusCode.LLM_NOT_YET_LINK]
    assert cfg.src_layer_range == range(0, 1)


def test_transfer_cache_async_none_source_is_a_type_error(local):
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(PEER, 0), range(0, 1), range(0, 1))
    with pytest.raises(TypeError) as info:
        local.cm.transfer_cache_async(None, Ready(), [cfg])
    assert message_of(info) == "src_cache only support ['Cache'], but got <class 'NoneType'>."


# -- None where CANN's check refuses None: TypeError -------------------------------------------------

def test_push_cache_none_source_is_a_type_error(accessible):
    with pytest.raises(TypeError) as info:
        accessible.cm.push_cache(CacheKeyByIdAndIndex(PEER, 1), None)
    assert message_of(info) == "src_cache only support ['Cache'], but got <class 'NoneType'>."
    with pytest.raises(TypeError):
        accessible.cm.push_cache(None, accessible.rows)


def test_push_cache_checks_the_mode_first():
    """CANN checks enable_remote_cache_accessible before the arguments."""
    cluster = Local(False)
    try:
        message = raises_llm(cluster.cm.push_cache, CacheKeyByIdAndIndex(PEER, 1), None)
        assert message == "push_cache is only supported while enable_remote_cache_accessible is True"
        message = raises_llm(cluster.cm.push_blocks, BlocksCacheKey(PEER), None, [0], [0])
        assert message == "push_blocks is only supported while enable_remote_cache_accessible is True"
    finally:
        cluster.dd.finalize()


def test_cache_type_error_wording():
    with pytest.raises(TypeError) as info:
        Cache.create_cpu_cache(CacheDesc(1, [1], DataType.DT_INT32, Placement.HOST), (1,))
    assert message_of(info) == "addrs only support ['list'], but got <class 'tuple'>."


def test_cpp_push_kv_cache_of_none_returns_the_status(cpp_dd):
    status = cpp_dd.PushKvCache(None, cpp.CacheIndex(cluster_id=PEER, cache_id=1, batch_index=0))
    assert status == cpp.LLM_PARAM_INVALID


# -- tensor_num_per_layer=-1: ValueError (not a uint32); 0: LLM_PARAM_INVALID --------------------------

def _transfers(cluster: Local):
    return {
        "pull_cache": lambda **kw: cluster.cm.pull_cache(CacheKeyByIdAndIndex(PEER, 1), cluster.rows, **kw),
        "pull_blocks": lambda **kw: cluster.cm.pull_blocks(BlocksCacheKey(PEER), cluster.blocks, [0], [0], **kw),
        "push_cache": lambda **kw: cluster.cm.push_cache(CacheKeyByIdAndIndex(PEER, 1), cluster.rows, **kw),
        "push_blocks": lambda **kw: cluster.cm.push_blocks(BlocksCacheKey(PEER), cluster.blocks, [0], [0], **kw),
    }


@pytest.mark.parametrize("method", ["pull_cache", "pull_blocks", "push_cache", "push_blocks"])
def test_tensor_num_per_layer_minus_one_is_a_value_error(accessible, method):
    with pytest.raises(ValueError) as info:
        _transfers(accessible)[method](tensor_num_per_layer=-1)
    assert message_of(info) == "tensor_num_per_layer's value is out of range,-1 is not a uint32 value."


@pytest.mark.parametrize("method", ["pull_cache", "pull_blocks", "push_cache", "push_blocks"])
def test_tensor_num_per_layer_zero_is_param_invalid(accessible, method):
    message = raises_llm(_transfers(accessible)[method], tensor_num_per_layer=0)
    assert message == f"[{method}] param check failed, tensor_num_per_layer (0) is invalid, should [1, 2]"


@pytest.mark.parametrize("value", [-1, 0])
@pytest.mark.parametrize("method", ["PullKvCache", "PullKvBlocks", "PushKvCache", "PushKvBlocks"])
def test_cpp_bad_tensor_num_per_layer_returns_param_invalid(cpp_dd, method, value):
    index = cpp.CacheIndex(cluster_id=PEER, cache_id=1, batch_index=0)
    ext = cpp.KvCacheExtParam(tensor_num_per_layer=value)
    call = {
        "PullKvCache": lambda: cpp_dd.PullKvCache(index, cpp_dd.cache, 0, -1, ext),
        "PullKvBlocks": lambda: cpp_dd.PullKvBlocks(index, cpp_dd.cache, [0], [0], ext),
        "PushKvCache": lambda: cpp_dd.PushKvCache(cpp_dd.cache, index, 0, -1, ext),
        "PushKvBlocks": lambda: cpp_dd.PushKvBlocks(cpp_dd.cache, index, [0], [0], ext),
    }[method]
    assert call() == cpp.LLM_PARAM_INVALID


# -- MemInfo and remap_registered_memory ------------------------------------------------------------

def test_mem_info_checks_types_only_and_remap_checks_values(accessible):
    info = MemInfo(Memtype.MEM_TYPE_DEVICE, 0x1000, -1)
    assert (info.mem_type, info.addr, info.size) == (Memtype.MEM_TYPE_DEVICE, 0x1000, -1)
    assert str(info) == "MemInfo(mem_type=Memtype.MEM_TYPE_DEVICE, addr=4096, size=-1)"
    with pytest.raises(AttributeError):
        info.size = 1  # read-only properties, as in CANN
    assert raises_llm(accessible.cm.remap_registered_memory, info) == \
        "check mem_info.size failed, size must be > 0, index=0."
    good = MemInfo(Memtype.MEM_TYPE_DEVICE, 0x1000, 64)
    assert raises_llm(accessible.cm.remap_registered_memory, [good, MemInfo(Memtype.MEM_TYPE_DEVICE, 0, 64)]) == \
        "check mem_info.addr failed, addr can not be zero, index=1."
    assert raises_llm(accessible.cm.remap_registered_memory, [MemInfo(Memtype.MEM_TYPE_HOST, 1, 1)]) == \
        "check mem_info.mem_type failed, only support Memtype.MEM_TYPE_DEVICE, index=0."
    assert raises_llm(accessible.cm.remap_registered_memory, [good, "x"]) == \
        "mem_infos[1] type only support MemInfo, but got <class 'str'>."
    assert raises_llm(accessible.cm.remap_registered_memory, (good,)) == \
        "mem_infos type only support list of MemInfo or MemInfo, but got <class 'tuple'>."
    accessible.cm.remap_registered_memory([good])
    with pytest.raises(TypeError):
        MemInfo(Memtype.MEM_TYPE_DEVICE, "0x1000", 1)


# -- CacheKey / BlocksCacheKey arguments ------------------------------------------------------------

def test_cache_key_requires_req_id():
    assert raises_llm(CacheKey, 1) == "Param req_id is required"
    assert raises_llm(CacheKey, cluster_id=1, model_id=0) == "Param req_id is required"
    assert CacheKey(1, 0).req_id == 0


@pytest.mark.parametrize("make,message", [
    (lambda: CacheKey(req_id=1), "Param prompt_cluster_id or cluster_id is required"),
    (lambda: CacheKey(1, 2, foo=3), "Unsupported param:foo"),
    (lambda: CacheKey(1, 2, 0, 5, model=1), "Param num is over limit"),
    (lambda: BlocksCacheKey(model_id=1), "Param prompt_cluster_id or cluster_id is required"),
    (lambda: BlocksCacheKey(1, foo=3), "Unsupported param:foo"),
    (lambda: BlocksCacheKey(1, 2, 3), "Param num is over limit"),
])
def test_key_argument_messages(make, message):
    assert raises_llm(make) == message


def test_key_arguments_resolve_as_cann_resolves_them():
    assert CacheKey(prompt_cluster_id=3, req_id=4).cluster_id == 3
    assert CacheKey(1, 2, cluster_id=9).cluster_id == 1  # the positional value wins
    assert repr(CacheKey(1, 2)) == f"CacheKey(cluster_id=1, req_id=2, prefix_id={2**64 - 1}, model_id=0)"
    assert repr(BlocksCacheKey(prompt_cluster_id=3)) == "BlocksCacheKey(prompt_cluster_id=3, model_id=0)"
    with pytest.raises(TypeError) as info:
        BlocksCacheKey("1")
    assert message_of(info) == "The first param cluster_id only support ['int'], but got <class 'str'>."
    with pytest.raises(TypeError) as info:
        BlocksCacheKey(1, "0")
    assert message_of(info) == "The second param model_id only support ['int'], but got <class 'str'>."


# -- the v1-only names ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["TensorDesc", "Tensor", "KvCacheManager"])
def test_v1_names_are_imported_lazily_from_llm_datadist_v1(monkeypatch, name):
    monkeypatch.setitem(sys.modules, "llm_datadist_v1", None)  # not installed
    with pytest.raises(ImportError):
        getattr(ld, name)
    fake = types.ModuleType("llm_datadist_v1")
    setattr(fake, name, object())
    monkeypatch.setitem(sys.modules, "llm_datadist_v1", fake)
    assert getattr(ld, name) is getattr(fake, name)


def test_other_missing_names_are_attribute_errors():
    with pytest.raises(AttributeError) as info:
        ld.NoSuchName  # noqa: B018
    assert message_of(info) == "Module 'llm_datadist' has no attribute 'NoSuchName'"
    assert not hasattr(ld, "NoSuchName")


# -- enum base classes ------------------------------------------------------------------------------

def test_enum_base_classes_are_cann_s():
    int_enums = [Placement, LLMRole, LLMStatusCode]
    plain_enums = [ld.Memtype, ld.RegisterMemStatus, DataType]
    assert all(issubclass(e, enum.IntEnum) for e in int_enums)
    assert not any(issubclass(e, int) for e in plain_enums) and all(issubclass(e, enum.Enum) for e in plain_enums)
    assert Placement.DEVICE == 1 and Placement(0) is Placement.HOST
    assert str(Placement.DEVICE) == "Placement.DEVICE"
    with pytest.raises(TypeError):  # still only a Placement is a placement
        CacheDesc(1, [1], DataType.DT_INT32, 1)


# -- TransferConfig / TransferWithCacheKeyConfig setters --------------------------------------------

def test_transfer_config_setters_validate():
    cfg = TransferConfig(1, (0x1000, 0x2000))  # a tuple is accepted; the count is checked at transfer
    assert cfg.dst_layer_range is None and cfg.src_layer_range is None
    cfg.dst_addrs = [1, 2, 3]
    assert cfg.dst_addrs == [1, 2, 3]
    for attr, value, error in [("dst_cluster_id", -1, ValueError), ("dst_cluster_id", "1", TypeError),
                               ("dst_addrs", [-1], ValueError), ("dst_addrs", None, TypeError),
                               ("dst_addrs", ["1"], TypeError), ("src_batch_index", -1, ValueError),
                               ("src_layer_range", [0, 1], TypeError)]:
        with pytest.raises(error):
            setattr(cfg, attr, value)
    assert raises_llm(setattr, cfg, "src_layer_range", range(0, 4, 2)) == "check src_layer_range.step == 1 failed"
    assert raises_llm(setattr, cfg, "src_layer_range", range(2, 1)) == \
        "check 0 <= range.start < range.stop failed, src_layer_range = range(2, 1)"
    cfg.src_layer_range = None
    cfg.src_layer_range = range(1, 2)
    cfg.dst_cluster_id, cfg.src_batch_index = 5, 3
    assert (cfg.dst_cluster_id, cfg.src_layer_range, cfg.src_batch_index) == (5, range(1, 2), 3)


def test_transfer_config_address_count_is_checked_by_transfer_cache_async():
    cluster = Local(False)
    try:
        cfg = TransferConfig(PEER, [0x1000], range(0, 1))
        assert raises_llm(cluster.cm.transfer_cache_async, cluster.rows, Ready(), [cfg])
    finally:
        cluster.dd.finalize()


def test_transfer_with_cache_key_config_setters_validate():
    key = CacheKeyByIdAndIndex(PEER, 1)
    cfg = TransferWithCacheKeyConfig(key, range(0, 1), range(1, 2), 2)
    assert cfg.dst_cluster_id == PEER
    with pytest.raises(TypeError):
        cfg.cache_key = "key"
    with pytest.raises(ValueError):
        cfg.src_batch_index = -1
    assert raises_llm(setattr, cfg, "dst_layer_range", range(0, 2, 2)) == "check dst_layer_range.step == 1 failed"
    cfg.src_layer_range, cfg.dst_layer_range = None, None  # the setters allow None, as CANN's do
    cfg.cache_key = BlocksCacheKey(PEER)
    assert raises_llm(setattr, cfg, "src_batch_index", 1) == \
        "src_batch_index should be 0 when cache_key is BlocksCacheKey."
    cfg.src_batch_index = 0
    assert (cfg.src_layer_range, cfg.dst_layer_range, cfg.src_batch_index) == (None, None, 0)


def test_transfer_with_cache_key_config_constructor_messages():
    key = BlocksCacheKey(PEER)
    with pytest.raises(TypeError) as info:
        TransferWithCacheKeyConfig(key, range(0, 1))
    assert message_of(info) == "dst_layer_range only support ['range'], but got <class 'NoneType'>."
    assert raises_llm(TransferWithCacheKeyConfig, key, range(0, 1), range(0, 2)) == \
        "src_layer_range size should be equal to dst_layer_range size"
    assert raises_llm(TransferWithCacheKeyConfig, key, range(0, 1), range(0, 1), 1) == \
        "src_batch_index should be 0 when cache_key is BlocksCacheKey."


# -- messages naming the option keys ----------------------------------------------------------------

def _init(options, role=LLMRole.PROMPT):
    dd = LLMDataDist(role, 7)
    try:
        dd.init(dict({"ge.exec.deviceId": "0"}, **options))
    finally:
        dd.finalize()


@pytest.mark.parametrize("options,message", [
    ({"llm.LocalCommRes": "", "llm.EnableCacheManager": "0"},
     "llm.LocalCommRes is not supported when llm.EnableCacheManager is not configured."),
    ({"llm.TransferBackend": "hixl"},
     "llm.TransferBackend is not supported when llm.EnableCacheManager is not configured."),
    ({"llm.TransferBackend": "hixl", "llm.EnableCacheManager": "1", "llm.EnableRemoteCacheAccessible": "0"},
     "llm.TransferBackend is not supported when llm.EnableRemoteCacheAccessible is not enable."),
    ({"llm.TransferBackend": "hixl", "llm.EnableCacheManager": "1"},
     "llm.TransferBackend is not supported when llm.listenIpInfo is not configured."),
    ({"llm.EnableCacheManager": "1", "llm.listenIpInfo": "127.0.0.1"},
     'llm.listenIpInfo "127.0.0.1" is invalid, format should be "ip:port"'),
    ({"ge.flowGraphMemMaxSize": "1,2"}, "ge.flowGraphMemMaxSize only support one mem pool in llm datadist"),
    ({"ge.flowGraphMemMaxSize": "1g"}, "ge.flowGraphMemMaxSize must be digit, config value=1g"),
])
def test_init_messages_name_the_option_keys(options, message):
    assert raises_llm(_init, options) == message


def test_listen_port_that_is_not_a_number_is_a_value_error():
    with pytest.raises(ValueError):
        _init({"llm.EnableCacheManager": "1", "llm.listenIpInfo": "127.0.0.1:http"})


def test_mode_messages_name_llm_enable_cache_manager():
    v1 = LLMDataDist(LLMRole.PROMPT, 7)
    v1.init({"ge.exec.deviceId": "0"})
    try:
        assert raises_llm(getattr, v1, "cache_manager") == \
            "cache_manager is not supported when llm.EnableCacheManager is not configured."
    finally:
        v1.finalize()
    cluster = Local(False)
    try:
        assert raises_llm(getattr, cluster.dd, "kv_cache_manager") == \
            "kv_cache_manager is not supported when llm.EnableCacheManager is configured."
        assert raises_llm(cluster.dd.check_link_status, 1) == \
            "check_link_status is not supported when llm.EnableCacheManager is configured."
        second = LLMDataDist(LLMRole.DECODER, 8)
        assert raises_llm(second.init, {}, status=LLMStatusCode.LLM_FAILED) == "Cannot init multiple LLMDataDists"
        assert raises_llm(cluster.dd.switch_role, LLMRole.DECODER, {"llm.listenIpInfo": "a:b:c"}) == \
            'llm.listenIpInfo "a:b:c" is invalid, format should be "ip:port"'
    finally:
        cluster.dd.finalize()
