"""The helpers CANN's ``v2/llm_utils.py`` and ``v2/config.py`` define (hicann/hixl,
``src/python/llm_datadist/llm_datadist/v2/``), pinned to what CANN's source does with them:
values, exceptions and status codes. ``llm_utils``' layer-wise job runs here with a recording
``transfer_cache_func`` (CANN's native ``transfer_cache_v2`` there). ``test_v2_paths.py`` checks
that each name is where CANN's modules have it."""

from __future__ import annotations

import json
import os
import threading
from unittest import mock

import pytest

import llm_datadist as ld
from llm_datadist import (
    BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType, LayerSynchronizer, LLMException,
    LLMRole, LLMStatusCode, MemInfo, Memtype, Placement, TransferConfig, TransferWithCacheKeyConfig,
)
from llm_datadist.v2 import config as v2_config
from llm_datadist.v2 import llm_utils as u

PARAM_INVALID = LLMStatusCode.LLM_PARAM_INVALID
SUCCESS = LLMStatusCode.LLM_SUCCESS
NONE_ID = 2**64 - 1


def raises_llm(fn, *args, status=PARAM_INVALID, **kwargs) -> str:
    with pytest.raises(LLMException) as info:
        fn(*args, **kwargs)
    assert info.value.status_code == status
    return info.value.args[0]


# -- CacheDesc helpers -----------------------------------------------------------------------------

def test_clone_cache_desc_copies_every_field_and_the_shape():
    desc = CacheDesc(4, [2, 8], DataType.DT_BF16, Placement.HOST, 0, 1, "ND")
    clone = u.clone_cache_desc(desc)
    assert clone is not desc and clone.shape == [2, 8] and clone.shape is not desc.shape
    assert (clone.num_tensors, clone.data_type, clone.placement, clone.batch_dim, clone.seq_len_dim_index,
            clone.kv_tensor_format) == (4, DataType.DT_BF16, Placement.HOST, 0, 1, "ND")


def test_verify_cache_shape():
    assert u.verify_cache_shape([2, -1, 8]) is None
    assert raises_llm(u.verify_cache_shape, []) == "scalar is not supported"
    assert raises_llm(u.verify_cache_shape, [2, 0]) == "empty dimension is not supported, shape = [2, 0]"
    # CANN raises this one without a status code: LLM_SUCCESS
    assert raises_llm(u.verify_cache_shape, [2, -2], status=SUCCESS) == "dim -2 is not supported, shape = [2, -2]"


def test_to_data_type_reads_the_number_as_text():
    assert u.to_data_type("27") is DataType.DT_BF16 and u.to_data_type("0") is DataType.DT_FLOAT
    assert raises_llm(u.to_data_type, "5") == "unsupported dtype: 5"
    assert raises_llm(u.to_data_type, 27) == "unsupported dtype: 27"  # compared as text


@pytest.mark.parametrize("shape, data_type, size", [
    ([2, 3], DataType.DT_FLOAT16, 12), ([4], DataType.DT_STRING, 64), ([], DataType.DT_FLOAT, 4),
    ((3, 5), DataType.DT_BOOL, 15), ([2**31, 2], DataType.DT_INT64, 2**35),
])
def test_calc_tensor_size(shape, data_type, size):
    assert u.calc_tensor_size(shape, data_type) == size
    if shape:
        assert CacheDesc(1, list(shape), data_type).size == size


@pytest.mark.parametrize("shape", [[2, -1], [0], [2**62, 4]])  # a dynamic dim, an empty one, past int64
def test_calc_tensor_size_refusals_are_cann_s(shape):
    assert raises_llm(u.calc_tensor_size, shape, DataType.DT_FLOAT) == \
        f"Failed to calc tensor size, shape = {shape}, data_type = DataType.DT_FLOAT"


@pytest.mark.parametrize("shape, data_type", [([2], 1), ([2], None), ("2", DataType.DT_FLOAT),
                                              ([2.0], DataType.DT_FLOAT)])
def test_calc_tensor_size_type_errors(shape, data_type):
    with pytest.raises(TypeError):
        u.calc_tensor_size(shape, data_type)


def test_cache_desc_parser_reads_the_ref_input_options():
    desc = u.CacheDescParser.parse_by_options({"llm.RefInputShapes": "4,-1,8;4,-1,8", "llm.RefInputDtypes": "1;1"})
    assert (desc.num_tensors, desc.shape, desc.data_type, desc.placement) == (2, [4, -1, 8], DataType.DT_FLOAT16,
                                                                              Placement.DEVICE)
    assert (desc.batch_dim, desc.seq_len_dim_index, desc.kv_tensor_format) == (0, 1, None)
    desc = u.CacheDescParser.parse_by_options({"llm.RefInputShapes": "4,8", "llm.RefInputDtypes": "27",
                                               "llm.RefInputSeqLenDimIndex": "1", "llm.kvTensorFormat": "ND"})
    assert (desc.num_tensors, desc.data_type, desc.seq_len_dim_index, desc.kv_tensor_format) == (
        1, DataType.DT_BF16, 1, "ND")
    assert u.CacheDescParser.parse_by_options({"llm.RefInputShapes": "4,8",
                                               "llm.RefInputDtypes": "3"}).seq_len_dim_index == -1


@pytest.mark.parametrize("options, message", [
    ({}, "llm.RefInputShapes not set"),
    ({"llm.RefInputShapes": "4,8;4,9"},
     "zero or multiple different shapes is not supported, llm.RefInputShapes = ['4,8', '4,9']"),
    ({"llm.RefInputShapes": "4,8"}, "llm.RefInputDtypes not set"),
    ({"llm.RefInputShapes": "4,8", "llm.RefInputDtypes": "1;3"},
     "zero or multiple different data types is not supported, llm.RefInputDtypes = ['1', '3']"),
    ({"llm.RefInputShapes": "4,8;4,8", "llm.RefInputDtypes": "1"},
     "kv_shapes num (2) mismatches that of kv_data_type (1)"),
    ({"llm.RefInputShapes": "4,-1,-1", "llm.RefInputDtypes": "1"},
     "can only have one dynamic dim apart from batch_dim(0), but got 2, shape = [4, -1, -1]"),
    ({"llm.RefInputShapes": "4,8", "llm.RefInputDtypes": "1", "llm.RefInputSeqLenDimIndex": "2"},
     "seq_len_dim_index (2) out of range, kv_shape = [4, 8]"),
    ({"llm.RefInputShapes": "4,0", "llm.RefInputDtypes": "1"}, "empty dimension is not supported, shape = [4, 0]"),
    ({"llm.RefInputShapes": "4,8", "llm.RefInputDtypes": "5"}, "unsupported dtype: 5"),
])
def test_cache_desc_parser_refusals(options, message):
    assert raises_llm(u.CacheDescParser.parse_by_options, options) == message


# -- pack_* ------------------------------------------------------------------------------------------

def test_pack_keys_and_mem_info():
    assert u.pack_cache_key(CacheKey(1, 2, 3)) == (1, -1, 0, 2, NONE_ID, 3, False)
    assert u.pack_cache_key(CacheKey(1, 2, prefix_id=5)) == (1, -1, 0, 2, 5, 0, False)
    assert u.pack_cache_key_by_id(CacheKeyByIdAndIndex(1, 7, 2)) == (1, 7, 2, NONE_ID, NONE_ID, 0, False)
    assert u.pack_block_cache_key(BlocksCacheKey(4, 9)) == (4, -1, 0, NONE_ID, NONE_ID, 9, True)
    assert u.pack_mem_info(MemInfo(Memtype.MEM_TYPE_DEVICE, 0x1000, 64)) == (Memtype.MEM_TYPE_DEVICE.value, 0x1000, 64)


def test_pack_cache_desc_is_blocks_once_a_blocks_cache_was_made_of_it(py_api):
    shape = [4, 8]
    desc = CacheDesc(2, shape, DataType.DT_FLOAT16, Placement.DEVICE, seq_len_dim_index=1)
    packed = u.pack_cache_desc(desc)
    assert packed == (2, DataType.DT_FLOAT16.value, 1, [4, 8], Placement.DEVICE.value, False)
    assert packed[3] is shape  # the shape itself, as CANN's
    contiguous = py_api.cm.allocate_cache(desc)
    assert u.pack_cache_desc(desc)[5] is False
    blocks = py_api.cm.allocate_blocks_cache(desc)
    assert u.pack_cache_desc(desc)[5] is True
    py_api.cm.deallocate_blocks_cache(blocks)
    py_api.cm.deallocate_cache(contiguous)


# -- layer_range_to_tensor_indices -------------------------------------------------------------------

def test_layer_range_to_tensor_indices():
    f = u.layer_range_to_tensor_indices
    assert f(range(1, 3), range(0, 2)) == ([2, 3, 4, 5], [0, 1, 2, 3])
    assert f(range(1, 2), None, 3) == ([3, 4, 5], [])
    assert f(None, None) == ([], []) and f(range(2, 2), range(0, 1)) == ([], [0, 1])
    assert raises_llm(f, range(0, 4, 2), None) == "param check failed, src_layer_range step must be 1."
    assert raises_llm(f, None, range(0, 4, 2)) == "param check failed, dst_layer_range step must be 1."
    assert raises_llm(f, range(-1, 1), None) == "src_layer_range is invalid, the start value:-1 is < 0"
    assert raises_llm(f, None, range(-2, 1)) == "dst_layer_range is invalid, the start value:-2 is < 0"
    with pytest.raises(ValueError, match="src_layer_range's value is out of range"):
        f(range(2**32 - 1, 2**32 + 1), None)
    with pytest.raises(TypeError, match=r"dst_layer_range only support \['range'\]"):
        f(None, [0, 1])


# -- the layer-wise job ------------------------------------------------------------------------------

class Sync(LayerSynchronizer):
    def __init__(self, ok: bool = True) -> None:
        self.ok, self.layers = ok, []

    def synchronize_layer(self, layer_index, timeout_in_millis):
        self.layers.append((layer_index, timeout_in_millis))
        return self.ok


class Recorder:
    def __init__(self, ret=0, gate: threading.Event = None) -> None:
        self.ret, self.gate, self.calls = ret, gate, []

    def __call__(self, task_id, packed, blocks):
        if self.gate is not None:
            self.gate.wait(10)
        self.calls.append((task_id, packed, blocks))
        return self.ret


def src_cache(num_tensors=4, cache_id=5):
    return Cache(cache_id, CacheDesc(num_tensors, [2, 8], DataType.DT_FLOAT16, Placement.DEVICE), [])


def start(configs, func, remote=False, sync=None, **kwargs):
    params = u.TransferCacheParameters(src_cache(), configs, **kwargs)
    return u.transfer_cache_async(params, sync or Sync(), func, enable_remote_cache=remote)


def test_transfer_cache_parameters_defaults():
    params = u.TransferCacheParameters(src_cache(), [])
    assert (params.src_block_indices, params.dst_block_indices, params.dst_block_memory_size) == (None, None, None)


def test_transfer_cache_async_packs_each_layer_of_a_transfer_config():
    func, sync = Recorder(), Sync()
    config = TransferConfig(3, [11, 12, 13, 14])  # no range: every layer, filled in on the config
    task = start([config], func, sync=sync)
    assert isinstance(task, ld.CacheTask)
    assert task.synchronize() is SUCCESS and task.get_results(1000) == [SUCCESS]
    assert config.src_layer_range == range(0, 2) and sync.layers == [(0, None), (1, None)]
    first = func.calls[0][0]
    assert func.calls == [
        (first, (5, 0, 0, [11, 12], 3, 0, 0, 0, 0, 2), (0, [], [])),
        (first + 1, (5, 0, 1, [13, 14], 3, 0, 0, 0, 1, 2), (0, [], [])),
    ]
    assert u.TransferCacheJob.task_id == first + 2


def test_transfer_cache_async_packs_keyed_configs():
    func = Recorder()
    by_id = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(4, 7, 1), range(0, 1), range(1, 2), src_batch_index=1)
    blocks = TransferWithCacheKeyConfig(BlocksCacheKey(6, 9), range(0, 2), range(2, 4))
    task = start([by_id, blocks], func, remote=True, dst_block_indices=[1, 2], dst_block_memory_size=64)
    assert task.get_results() == [SUCCESS, SUCCESS]
    assert [call[1] for call in func.calls] == [
        (5, 1, 0, [], 4, 7, 1, 2, 1, 2),  # CACHE_KEY_BY_ID: cluster, cache_id, batch_index
        (5, 0, 0, [], 6, 9, 0, 1, 2, 2),  # BLOCKS_CACHE_KEY: cluster, model_id
        (5, 0, 1, [], 6, 9, 0, 1, 3, 2),
    ]
    assert all(call[2] == (64, [], [1, 2]) for call in func.calls)


def test_the_destination_layer_is_indexed_by_the_source_layer_s_position_as_in_cann():
    func = Recorder()
    config = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(4, 7), range(1, 2), range(4, 5))
    config.dst_layer_range = range(4, 6)  # the setter does not compare the spans
    assert start([config], func, remote=True).synchronize() is SUCCESS
    assert [call[1][8] for call in func.calls] == [5]  # list(range(4, 6))[1]: layer 1's position


def test_a_failed_call_or_synchronization_is_the_config_s_result():
    task = start([TransferConfig(3, [1, 2, 3, 4])], Recorder(ret=0x5010B01A))
    assert task.get_results() == [LLMStatusCode.LLM_TIMEOUT] and task.synchronize() is LLMStatusCode.LLM_TIMEOUT
    task = start([TransferConfig(3, [1, 2, 3, 4])], Recorder(ret=12345))
    assert task.synchronize() is LLMStatusCode.LLM_FAILED
    task = start([TransferConfig(3, [1, 2, 3, 4])], Recorder(), sync=Sync(ok=False))
    assert task.get_results() == [PARAM_INVALID]  # CANN's code for a failed synchronization


def test_configs_to_one_cluster_share_a_result_as_in_cann():
    func = Recorder()
    task = start([TransferConfig(3, [1, 2], range(0, 1)), TransferConfig(3, [5, 6], range(1, 2))], func)
    assert task.get_results() == [SUCCESS, SUCCESS] and len(func.calls) == 2
    task = start([TransferConfig(3, [1, 2], range(1, 2)), TransferConfig(4, [5, 6], range(0, 1))], Recorder())
    assert task.get_results() == [SUCCESS, SUCCESS]


def test_a_running_task_reports_the_default_code_on_timeout():
    gate = threading.Event()
    task = start([TransferConfig(3, [1, 2, 3, 4])], Recorder(gate=gate))
    try:
        assert task.get_results(10) == [LLMStatusCode.LLM_TIMEOUT]
        assert task.synchronize(10) is LLMStatusCode.LLM_TIMEOUT
    finally:
        gate.set()
    assert task.synchronize() is SUCCESS


@pytest.mark.parametrize("kwargs, message", [
    ({"src_block_indices": [1]}, "transfer from blocks to cache is not supported"),
    ({"src_block_indices": [1, 2], "dst_block_indices": [3]}, "num_block_indices mismatches, src_num = 2, dst_num = 1"),
    ({"dst_block_indices": [3]}, "dst_block_memory_size must be set when transfer from cache to blocks"),
    ({"dst_block_memory_size": 5}, "dst_block_memory_size (5) is neither None nor 0 while dst is not blocks"),
])
def test_transfer_cache_async_argument_refusals(kwargs, message):
    assert raises_llm(start, [TransferConfig(3, [1, 2, 3, 4])], Recorder(), **kwargs) == message


def test_transfer_cache_async_config_refusals():
    func = Recorder()
    assert raises_llm(start, [TransferConfig(3, [1, 2])], func) == \
        "expect 4 dst_addrs, but len(dst_addrs) = 2, range = range(0, 2)"
    assert raises_llm(start, [TransferConfig(3, [1] * 6, range(0, 3))], func) == \
        "src_layer_range: range(0, 3) out of range, src_layer_num = 2"
    params = u.TransferCacheParameters(src_cache(num_tensors=3), [TransferConfig(3, [1, 2])])
    assert raises_llm(u.transfer_cache_async, params, Sync(), func) == "cache_desc.num_tensors (3) is not even"
    blocks = TransferConfig(3, [1, 2, 3, 4], src_batch_index=1)
    assert raises_llm(start, [blocks], func, src_block_indices=[0], dst_block_indices=[1]) == \
        "Invalid TransferConfig, src_batch_index (1) != 0 while src is blocks"
    assert func.calls == []


def test_transfer_cache_async_type_and_value_errors():
    config = TransferConfig(3, [1, 2, 3, 4])
    with pytest.raises(TypeError, match=r"^While enable_remote_cache_accessible is True, transfer_configs only"):
        start(config, Recorder(), remote=True)
    with pytest.raises(TypeError, match=r"^transfer_configs inner type only support \[<class '\S+"
                                        r"TransferWithCacheKeyConfig'>\]"):  # CANN's: no prefix here
        start([config], Recorder(), remote=True)
    with pytest.raises(TypeError, match=r"transfer_configs inner type only support"):
        start([TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), range(0, 1), range(0, 1))], Recorder())
    with pytest.raises(TypeError, match="layer_synchronizer only support"):
        u.transfer_cache_async(u.TransferCacheParameters(src_cache(), [config]), None, Recorder())
    with pytest.raises(TypeError, match="dst_block_indices"):
        start([config], Recorder(), dst_block_indices=[1.0], dst_block_memory_size=8)
    with pytest.raises(ValueError, match="src_block_indices's value is out of range"):
        start([config], Recorder(), src_block_indices=[-1], dst_block_indices=[1])
    with pytest.raises(ValueError, match="dst_block_memory_size's value is out of range"):
        start([config], Recorder(), dst_block_memory_size=-1)


def test_cache_task_takes_cann_s_one_argument_form():
    class Task:
        def get(self, timeout):
            return ("get", timeout)

        def get_results(self, timeout):
            return ["results", timeout]

    task = ld.CacheTask(Task())
    assert task.synchronize() == ("get", None) and task.synchronize(1500) == ("get", 1.5)
    assert task.get_results(20) == ["results", 0.02]


# -- v2/config.py: ClusterConfig, EngineConfig ------------------------------------------------------

def test_gen_numa_config():
    config = json.loads(v2_config.EngineConfig.gen_numa_config("0;3", None))
    node = config["cluster"][0]["cluster_nodes"][0]
    assert node["is_local"] is True and "deploy_res_path" not in node
    assert node["item_list"] == [{"item_id": 0, "device_id": 0, "ipaddr": "192.168.0.1"},
                                 {"item_id": 3, "device_id": 3, "ipaddr": "192.168.0.1"}]
    assert config["node_def"][0]["node_type"] == node["node_type"] == "FakeNodeType"
    assert config["item_def"][0]["item_type"] == config["node_def"][0]["item_type"] == "FakeItemType"
    config = json.loads(v2_config.EngineConfig.gen_numa_config("1", "/opt/res"))
    assert config["cluster"][0]["cluster_nodes"][0]["deploy_res_path"] == "/opt/res"
    with pytest.raises(TypeError, match=r"llm.deployResPath only support \['str'\]"):
        v2_config.EngineConfig.gen_numa_config("1", 5)


def test_gen_cluster_info_then_from_engine_options(monkeypatch):
    monkeypatch.delenv("RESOURCE_CONFIG_PATH", raising=False)
    options = {"ge.exec.deviceId": "6;7", "llm.listenIpInfo": "127.0.0.1:26000;127.0.0.2:26001"}
    path = "/tmp/stub_numa_config_prompt_6_7.json"
    try:
        v2_config.EngineConfig.gen_cluster_info_if_not_exist(11, LLMRole.PROMPT, options)
        assert options["ge.resourceConfigPath"] == path and os.path.exists(path)
        assert json.loads(options["llm.ClusterInfo"]) == {
            "cluster_id": 11, "logic_device_id": ["0:0:0:0", "0:0:1:0"],
            "listen_ip_info": [{"ip": 0x0100007F, "port": 26000}, {"ip": 0x0200007F, "port": 26001}]}
        engine = v2_config.EngineConfig.from_engine_options(True, options)
        assert engine.is_prompt is True and engine.cluster_config.rank_id_to_device_id == {0: 6, 1: 7}
        options["ge.exec.rankId"] = "1"
        assert v2_config.ClusterConfig.from_engine_options(options).rank_id_to_device_id == {1: 6}
        options["ge.exec.rankId"] = "5"  # with ge.exec.deviceId: the rank of the first logical device
        assert v2_config.ClusterConfig.from_engine_options(options).rank_id_to_device_id == {5: 6}
        before = dict(options)
        v2_config.EngineConfig.gen_cluster_info_if_not_exist(11, LLMRole.PROMPT, options)  # set: unchanged
        assert options == before
    finally:
        if os.path.exists(path):
            os.remove(path)


def test_gen_cluster_info_takes_the_resource_path_from_the_environment(monkeypatch):
    monkeypatch.setenv("RESOURCE_CONFIG_PATH", "/somewhere/numa.json")
    options = {"ge.exec.deviceId": "0"}
    v2_config.EngineConfig.gen_cluster_info_if_not_exist(2, LLMRole.DECODER, options)
    assert options["ge.resourceConfigPath"] == "/somewhere/numa.json"
    assert json.loads(options["llm.ClusterInfo"]) == {"cluster_id": 2, "logic_device_id": ["0:0:0:0"]}


@pytest.mark.parametrize("role, options, message", [
    (LLMRole.PROMPT, {"ge.exec.deviceId": "0"}, "neither llm.ClusterInfo nor llm.listenIp was specified"),
    (LLMRole.PROMPT, {"ge.exec.deviceId": "0;1", "llm.listenIpInfo": "1.1.1.1:1"},
     "listen ip info num:1 in llm.listenIpInfo is not equal to device num:2."),
    (LLMRole.PROMPT, {"ge.exec.deviceId": "0", "llm.listenIpInfo": "1.1.1.1"},
     "llm.listenIpInfo \"['1.1.1.1']\" is invalid, format should be \"ip:port\""),
    (LLMRole.DECODER, {"ge.exec.deviceId": "0;x"},
     'ge.exec.deviceId is invalid, value="0;x", it should be composed of numbers, separated by semicolons.'),
])
def test_gen_cluster_info_refusals(monkeypatch, role, options, message):
    monkeypatch.delenv("RESOURCE_CONFIG_PATH", raising=False)
    assert raises_llm(v2_config.EngineConfig.gen_cluster_info_if_not_exist, 1, role, options) == message


def test_cluster_config_without_a_local_device_is_refused(tmp_path):
    numa = tmp_path / "numa.json"
    numa.write_text(json.dumps({"cluster": [{"cluster_nodes": [{"is_local": False, "item_list": [{"item_id": 1}]}]}]}))
    options = {"llm.ClusterInfo": '{"logic_device_id": ["0:0:0:0"]}', "ge.resourceConfigPath": str(numa)}
    assert raises_llm(v2_config.ClusterConfig.from_engine_options, options) == (
        "rank_id_to_device_id is empty, logical_device_id_to_rank_id = {'0:0:0:0': 0}, "
        "logical_device_id_to_device_id = {}")


def test_cluster_config_needs_its_options():
    assert raises_llm(v2_config.ClusterConfig.from_engine_options, {}) == "option 'llm.ClusterInfo' is not defined"
    assert raises_llm(v2_config.ClusterConfig.from_engine_options, {"llm.ClusterInfo": '{"logic_device_id": []}'}) \
        == "option 'ge.resourceConfigPath' is not defined"


def test_engine_config_parse_listen_ip_info_packs_the_ip():
    parse = v2_config.EngineConfig.parse_listen_ip_info
    assert parse("127.0.0.1:26000") == (0x0100007F, 26000)
    assert raises_llm(parse, "127.0.0.1") == 'llm.listenIpInfo "127.0.0.1" is invalid, format should be "ip:port"'
    with pytest.raises(RuntimeError, match="Can not parse ip str:x"):
        parse("x:1")
    with pytest.raises(ValueError):
        parse("1.1.1.1:p")
    with pytest.raises(TypeError):
        parse(5)


def test_engine_config_can_be_patched_where_cann_s_test_patches_it():
    with mock.patch("llm_datadist.v2.llm_datadist.EngineConfig") as patched:
        from llm_datadist.v2 import llm_datadist as v2_llm_datadist
        assert v2_llm_datadist.EngineConfig is patched
    assert v2_llm_datadist.EngineConfig is v2_config.EngineConfig


# -- parse_listen_ip_info: CANN's helper as CANN has it ------------------------------------------------

def test_parse_listen_ip_info_is_cann_s():
    assert u.parse_listen_ip_info("10.0.0.1:26000") == ("10.0.0.1", 26000)
    assert u.parse_listen_ip_info(":5") == ("", 5)
    assert u.parse_listen_ip_info("host:7") == ("host", 7)
    for bad in ("10.0.0.1", "a:b:c", "[::1]:5"):
        assert raises_llm(u.parse_listen_ip_info, bad) == \
            f'llm.listenIpInfo "{bad}" is invalid, format should be "ip:port"'
    with pytest.raises(ValueError):
        u.parse_listen_ip_info("1.1.1.1:x")
    with pytest.raises(TypeError, match=r"listen_ip_info only support \['str'\]"):
        u.parse_listen_ip_info(5)
    with pytest.raises(AttributeError):  # CANN's check lets None through to None.split
        u.parse_listen_ip_info(None)


def test_init_still_refuses_an_empty_listen_ip():
    dd = ld.LLMDataDist(LLMRole.PROMPT, 1)
    cfg = ld.LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.listen_ip_info = ":5"
    message = raises_llm(dd.init, cfg.generate_options())
    assert message.startswith('llm.listenIpInfo ":5" is invalid, format should be "ip:port"')
