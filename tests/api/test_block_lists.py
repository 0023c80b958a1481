"""Block lists of both API styles: the API checks the container, the core reads every element once.

The Python style raises CANN's classes and messages for a bad element (``check_isinstance``:
TypeError for a non-integer or a bool, ``check_uint64``: ValueError outside uint64); the C++
style returns LLM_PARAM_INVALID. Lists, tuples and integer numpy arrays (and numpy integer
elements) are accepted. Transfers here go to a cluster nobody linked (LLM_NOT_YET_LINK), so a
call that gets that far has accepted its block lists.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from llm_datadist import (
    BlocksCacheKey, CacheDesc, DataType, LayerSynchronizer, LLMConfig, LLMDataDist,
    LLMException, LLMRole, LLMStatusCode, TransferWithCacheKeyConfig, cpp,
)

PEER = 8  # a cluster id nobody links to
NOT_YET_LINK = LLMStatusCode.LLM_NOT_YET_LINK
INNER = "{name} inner type only support [<class 'int'>], but got {kind}."
RANGE = "{name}'s value is out of range,{value} is not a uint64 value."

# (element, exception class, message template) of CANN's checks.
BAD_ELEMENTS = [
    (1.0, TypeError, INNER.format(name="{name}", kind="<class 'float'>")),
    (True, TypeError, INNER.format(name="{name}", kind="<class 'bool'>")),
    ("1", TypeError, INNER.format(name="{name}", kind="<class 'str'>")),
    (np.array([1]), TypeError, INNER.format(name="{name}", kind="<class 'numpy.ndarray'>")),
    (None, TypeError, INNER.format(name="{name}", kind="<class 'NoneType'>")),
    (-1, ValueError, RANGE.format(name="{name}", value=-1)),
    (2**64, ValueError, RANGE.format(name="{name}", value=2**64)),
]
BAD_IDS = ["float", "bool", "str", "ndarray", "None", "negative", "2**64"]


class Ready(LayerSynchronizer):
    def synchronize_layer(self, layer_index, timeout_in_millis):
        return True


def push_mode_datadist(num_tensors: int) -> LLMDataDist:
    """An initialized push-mode LLMDataDist with a registered blocks cache of ``num_tensors``
    int32 tensors of 4 x 8 (``dd.blocks``, its memory ``dd.memory``)."""
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    dd = LLMDataDist(LLMRole.PROMPT, 7)
    dd.init(cfg.generate_options())
    dd.memory = [np.zeros((4, 8), np.int32) for _ in range(num_tensors)]
    dd.blocks = dd.cache_manager.register_blocks_cache(CacheDesc(num_tensors, [4, 8], DataType.DT_INT32),
                                                       [a.ctypes.data for a in dd.memory])
    return dd


@pytest.fixture
def cluster():
    dd = push_mode_datadist(2)
    yield dd
    dd.finalize()


def _calls(dd):
    """name of the block-list argument -> a call with that argument (the other list valid)."""
    cm, key, blocks = dd.cache_manager, BlocksCacheKey(PEER, 0), dd.blocks
    cfg = [TransferWithCacheKeyConfig(BlocksCacheKey(PEER, 0), range(0, 1), range(0, 1))]
    return {
        ("push_blocks", "src_blocks"): lambda v: cm.push_blocks(key, blocks, v, [0]),
        ("push_blocks", "dst_blocks"): lambda v: cm.push_blocks(key, blocks, [0], v),
        ("pull_blocks", "src_blocks"): lambda v: cm.pull_blocks(key, blocks, v, [0]),
        ("pull_blocks", "dst_blocks"): lambda v: cm.pull_blocks(key, blocks, [0], v),
        ("transfer_cache_async", "src_block_indices"):
            lambda v: cm.transfer_cache_async(blocks, Ready(), cfg, v, [0]).get_results(5000),
        ("transfer_cache_async", "dst_block_indices"):
            lambda v: cm.transfer_cache_async(blocks, Ready(), cfg, [0], v).get_results(5000),
    }


CALLS = [("push_blocks", "src_blocks"), ("push_blocks", "dst_blocks"), ("pull_blocks", "src_blocks"),
         ("pull_blocks", "dst_blocks"), ("transfer_cache_async", "src_block_indices"),
         ("transfer_cache_async", "dst_block_indices")]


@pytest.mark.parametrize("element, error, message", BAD_ELEMENTS, ids=BAD_IDS)
@pytest.mark.parametrize("call", CALLS, ids=["-".join(c) for c in CALLS])
def test_a_bad_element_raises_cann_s_class_and_message(cluster, call, element, error, message):
    with pytest.raises(error) as info:
        _calls(cluster)[call]([0, element])
    assert info.value.args[0] == message.format(name=call[1])


@pytest.mark.parametrize("call", CALLS, ids=["-".join(c) for c in CALLS])
def test_type_errors_come_before_range_errors_as_in_cann(cluster, call):
    """CANN checks every element's type, then each value: a negative before a str is a TypeError."""
    with pytest.raises(TypeError):
        _calls(cluster)[call]([-1, "x"])


@pytest.mark.parametrize("container", [None, 5, {0: 1}, "01", range(2)], ids=["None", "int", "dict", "str", "range"])
@pytest.mark.parametrize("call", CALLS[:4], ids=["-".join(c) for c in CALLS[:4]])
def test_a_container_other_than_list_tuple_or_array_is_a_type_error(cluster, call, container):
    with pytest.raises(TypeError) as info:
        _calls(cluster)[call](container)
    assert info.value.args[0] == f"{call[1]} only support ['list', 'tuple'], but got {type(container)}."


@pytest.mark.parametrize("blocks", [[0, 1], (0, 1), np.array([0, 1]), np.array([0, 1], np.uint32),
                                    [np.int64(0), np.uint64(1)]],
                         ids=["list", "tuple", "int64-array", "uint32-array", "numpy-elements"])
@pytest.mark.parametrize("call", CALLS, ids=["-".join(c) for c in CALLS])
def test_lists_tuples_and_integer_arrays_are_accepted(cluster, call, blocks):
    other = [0, 1]
    name = call[1]
    cm, key = cluster.cache_manager, BlocksCacheKey(PEER, 0)
    if call[0] == "transfer_cache_async":
        cfg = [TransferWithCacheKeyConfig(BlocksCacheKey(PEER, 0), range(0, 1), range(0, 1))]
        src, dst = (blocks, other) if name.startswith("src") else (other, blocks)
        results = cm.transfer_cache_async(cluster.blocks, Ready(), cfg, src, dst).get_results(5000)
        assert results == [NOT_YET_LINK]
        return
    method = getattr(cm, call[0])
    src, dst = (blocks, other) if name.startswith("src") else (other, blocks)
    with pytest.raises(LLMException) as info:
        method(key, cluster.blocks, src, dst)
    assert info.value.status_code == NOT_YET_LINK


def test_a_float_array_is_a_type_error(cluster):
    with pytest.raises(TypeError):
        cluster.cache_manager.push_blocks(BlocksCacheKey(PEER, 0), cluster.blocks, np.array([0.0]), [0])


def test_copy_blocks_from_a_large_dict_copies_every_block(cluster):
    """The dict is flattened by the core; the result matches the element-by-element copy."""
    cm = cluster.cache_manager
    desc = CacheDesc(2, [512, 4], DataType.DT_INT32)
    memory = [np.arange(512 * 4, dtype=np.int32).reshape(512, 4) + 10000 * t for t in range(2)]
    cache = cm.register_blocks_cache(desc, [a.ctypes.data for a in memory])
    expected = [m.copy() for m in memory]
    info = {s: [256 + s] for s in range(256)}
    cm.copy_blocks(cache, info)
    for want in expected:
        want[256:] = want[:256]
    for got, want in zip(memory, expected):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("info, error", [({0: [1.0]}, TypeError), ({True: [1]}, TypeError),
                                         ({0: (1,)}, TypeError), ({0: [-1]}, LLMException),
                                         ({0: [2**64]}, LLMException), ({-1: [1]}, LLMException)],
                         ids=["float", "bool-key", "tuple-value", "negative", "2**64", "negative-key"])
def test_copy_blocks_refuses_bad_dicts_as_before(cluster, info, error):
    with pytest.raises(error) as raised:
        cluster.cache_manager.copy_blocks(cluster.blocks, info)
    if error is LLMException:
        assert raised.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


# -- the C++ style: every bad block list is LLM_PARAM_INVALID ------------------------------------------

@pytest.fixture
def cpp_dd():
    dd = cpp.LlmDataDist(7, cpp.LlmRole.kPrompt)
    assert dd.Initialize({cpp.OPTION_DEVICE_ID: "0"}) == cpp.LLM_SUCCESS
    desc = cpp.CacheDesc(placement=cpp.CachePlacement.kDevice, num_tensors=2, data_type=cpp.DT_INT32,
                         shape=[4, 8])
    dd.src, dd.dst = cpp.Cache(), cpp.Cache()
    assert dd.AllocateCache(desc, dd.src) == cpp.LLM_SUCCESS
    assert dd.AllocateCache(desc, dd.dst) == cpp.LLM_SUCCESS
    yield dd
    dd.Finalize()


def _cpp_calls(dd):
    index = cpp.CacheIndex(cluster_id=PEER, cache_id=1, batch_index=0)
    return {
        "PushKvBlocks-src": lambda v: dd.PushKvBlocks(dd.src, index, v, [0]),
        "PushKvBlocks-dst": lambda v: dd.PushKvBlocks(dd.src, index, [0], v),
        "PullKvBlocks-src": lambda v: dd.PullKvBlocks(index, dd.dst, v, [0]),
        "PullKvBlocks-dst": lambda v: dd.PullKvBlocks(index, dd.dst, [0], v),
        "CopyKvBlocks-src": lambda v: dd.CopyKvBlocks(dd.src, dd.dst, v, [[0]]),
        "CopyKvBlocks-dst": lambda v: dd.CopyKvBlocks(dd.src, dd.dst, [0], [v]),
    }


CPP_CALLS = ["PushKvBlocks-src", "PushKvBlocks-dst", "PullKvBlocks-src", "PullKvBlocks-dst",
             "CopyKvBlocks-src", "CopyKvBlocks-dst"]


@pytest.mark.parametrize("element", [e for e, _, _ in BAD_ELEMENTS], ids=BAD_IDS)
@pytest.mark.parametrize("call", CPP_CALLS)
def test_cpp_bad_element_returns_param_invalid(cpp_dd, call, element):
    assert _cpp_calls(cpp_dd)[call]([element]) == cpp.LLM_PARAM_INVALID


@pytest.mark.parametrize("call", CPP_CALLS)
def test_cpp_block_list_that_is_not_a_list_returns_param_invalid(cpp_dd, call):
    assert _cpp_calls(cpp_dd)[call]({0: 1}) == cpp.LLM_PARAM_INVALID


def test_cpp_copy_kv_blocks_takes_arrays_and_copies_every_list(cpp_dd):
    desc = cpp.CacheDesc(placement=cpp.CachePlacement.kHost, num_tensors=1, data_type=cpp.DT_INT32, shape=[6, 2])
    memory = [np.arange(12, dtype=np.int32).reshape(6, 2), np.zeros((6, 2), np.int32)]
    ids = [cpp.Ref(), cpp.Ref()]
    for array, ref in zip(memory, ids):
        assert cpp_dd.RegisterKvCache(desc, [array.ctypes.data], cpp.RegisterCfg(), ref) == cpp.LLM_SUCCESS
    src = cpp.Cache(cache_id=ids[0].value, tensor_addrs=[memory[0].ctypes.data], cache_desc=desc)
    dst = cpp.Cache(cache_id=ids[1].value, tensor_addrs=[memory[1].ctypes.data], cache_desc=desc)
    dst_desc = cpp.CacheDesc(placement=cpp.CachePlacement.kDevice, num_tensors=1, data_type=cpp.DT_INT32,
                             shape=[6, 2])
    device = cpp.Cache()
    assert cpp_dd.AllocateCache(dst_desc, device) == cpp.LLM_SUCCESS
    # host -> device (arrays), then device -> host: block k of every dst list gets src block k.
    assert cpp_dd.CopyKvBlocks(src, device, np.array([1, 2]), [np.array([0, 3]), [4, 5]]) == cpp.LLM_SUCCESS
    assert cpp_dd.CopyKvBlocks(device, dst, [0, 3, 4, 5], [[0, 1, 2, 3]]) == cpp.LLM_SUCCESS
    np.testing.assert_array_equal(memory[1][:4], memory[0][[1, 2, 1, 2]])


# -- finalize and transfer_cache_async ----------------------------------------------------------------

class Slow(LayerSynchronizer):
    """Blocks in every layer until released (or ``delay_s`` passed)."""

    def __init__(self, delay_s: float) -> None:
        self.entered = threading.Event()
        self.delay_s = delay_s
        self.calls = 0

    def synchronize_layer(self, layer_index, timeout_in_millis):
        self.calls += 1
        self.entered.set()
        time.sleep(self.delay_s)
        return True


def _transfer_threads():
    return [t for t in threading.enumerate() if t.name == "llm_datadist-transfer" and t.is_alive()]


def test_finalize_waits_for_a_blocked_transfer_cache_async_and_stops_it():
    dd = push_mode_datadist(8)
    cache = dd.blocks
    sync = Slow(0.3)
    config = TransferWithCacheKeyConfig(BlocksCacheKey(PEER, 0), range(0, 4), range(0, 4))
    task = dd.cache_manager.transfer_cache_async(cache, sync, [config], [0], [0])
    assert sync.entered.wait(5)
    assert _transfer_threads()
    dd.finalize()
    # Nothing runs after finalize: the thread is gone and did not go on to the next layers.
    assert not task._thread.is_alive()
    assert not _transfer_threads()
    calls = sync.calls
    time.sleep(0.4)
    assert sync.calls == calls < 4
    assert task.get_results(0) == [LLMStatusCode.LLM_ENGINE_FINALIZED]
