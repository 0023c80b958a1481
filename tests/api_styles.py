"""The API contract fixtures: one adapter per API style over the same engine.

Each adapter exposes the same small vocabulary (allocate, register, copy, views, status_of) so
that tests/api/test_contract.py, and the engine tests that run through both styles
(tests/engine/), run unchanged against the Python-style and the C++-style API. The conftest.py of
tests/api/ and tests/engine/ import the fixtures from here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import llm_datadist as ld
from llm_datadist import _core, cpp
from llm_datadist.data_type import element_size, numpy_dtype

POOL = json.dumps({"memory_size": 256 * 1024 * 1024})


class PythonStyle:
    name = "python"

    def __init__(self, cluster_id: int = 7) -> None:
        self.dd = ld.LLMDataDist(ld.LLMRole.PROMPT, cluster_id)
        cfg = ld.LLMConfig()
        cfg.device_id = 0
        cfg.enable_cache_manager = True
        cfg.mem_pool_cfg = POOL
        cfg.host_mem_pool_cfg = POOL
        self.dd.init(cfg.generate_options())
        self.cm = self.dd.cache_manager

    def close(self) -> None:
        self.dd.finalize()

    @staticmethod
    def status_of(fn, *args, **kwargs) -> int:
        try:
            fn(*args, **kwargs)
        except ld.LLMException as exc:
            return int(exc.status_code)
        return 0

    def allocate(self, num_tensors, shape, dtype=ld.DataType.DT_INT32, device=True, blocks=True):
        placement = ld.Placement.DEVICE if device else ld.Placement.HOST
        desc = ld.CacheDesc(num_tensors, list(shape), dtype, placement)
        if blocks:
            return self.cm.allocate_blocks_cache(desc)
        return self.cm.allocate_cache(desc)

    def register(self, arrays, dtype=ld.DataType.DT_INT32, device=True, blocks=True):
        placement = ld.Placement.DEVICE if device else ld.Placement.HOST
        desc = ld.CacheDesc(len(arrays), list(arrays[0].shape), dtype, placement)
        addrs = [a.ctypes.data for a in arrays]
        if blocks:
            return self.cm.register_blocks_cache(desc, addrs)
        return self.cm.register_cache(desc, addrs)

    @staticmethod
    def cache_id(handle) -> int:
        return handle.cache_id

    @staticmethod
    def views(handle):
        return handle.as_numpy()

    def copy_blocks(self, handle, src_blocks, dst_blocks):
        info = {}
        for s, d in zip(src_blocks, dst_blocks):
            info.setdefault(s, []).append(d)
        return self.status_of(self.cm.copy_blocks, handle, info)

    def copy_rows(self, dst, src, dst_row=0, src_row=0, offset=0, size=-1):
        return self.status_of(self.cm.copy_cache, dst, src, dst_row, src_row, offset, size)

    def release(self, handle):
        if handle.is_registered:
            return self.status_of(self.cm.unregister_cache, handle.cache_id)
        if handle.is_blocks_cache:
            return self.status_of(self.cm.deallocate_blocks_cache, handle)
        return self.status_of(self.cm.deallocate_cache, handle)


class CppStyle:
    name = "cpp"

    def __init__(self, cluster_id: int = 7) -> None:
        self.dd = cpp.LlmDataDist(cluster_id, cpp.LlmRole.kPrompt)
        assert self.dd.Initialize({cpp.OPTION_DEVICE_ID: "0"}) == cpp.LLM_SUCCESS

    def close(self) -> None:
        self.dd.Finalize()

    @staticmethod
    def status_of(fn, *args, **kwargs) -> int:
        return int(fn(*args, **kwargs))

    def allocate(self, num_tensors, shape, dtype=ld.DataType.DT_INT32, device=True, blocks=True):
        placement = cpp.CachePlacement.kDevice if device else cpp.CachePlacement.kHost
        desc = cpp.CacheDesc(placement=placement, num_tensors=num_tensors, data_type=dtype, shape=list(shape))
        cache = cpp.Cache()
        status = self.dd.AllocateCache(desc, cache)
        if status != cpp.LLM_SUCCESS:
            raise ld.LLMException("AllocateCache failed", status_code=int(status))
        return cache

    def register(self, arrays, dtype=ld.DataType.DT_INT32, device=True, blocks=True):
        placement = cpp.CachePlacement.kDevice if device else cpp.CachePlacement.kHost
        desc = cpp.CacheDesc(placement=placement, num_tensors=len(arrays), data_type=dtype,
                             shape=list(arrays[0].shape))
        cache_id = cpp.Ref()
        status = self.dd.RegisterKvCache(desc, [a.ctypes.data for a in arrays], cpp.RegisterCfg(), cache_id)
        if status != cpp.LLM_SUCCESS:
            raise ld.LLMException("RegisterKvCache failed", status_code=int(status))
        return cpp.Cache(cache_id=cache_id.value, tensor_addrs=[a.ctypes.data for a in arrays],
                         cache_desc=desc)

    @staticmethod
    def cache_id(handle) -> int:
        return handle.cache_id

    def views(self, handle):
        desc = handle.cache_desc
        # The C++-style API has no tensor views; this adapter reads the memory in place, which only
        # works where the host can address it (as CacheManager's as_numpy refuses otherwise).
        if desc.placement == cpp.CachePlacement.kDevice and not self.dd.engine.runtime.host_addressable:
            raise ld.LLMException(f"{self.dd.engine.runtime.name} device memory is not host-addressable",
                                  status_code=ld.LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        dtype = numpy_dtype(desc.data_type)
        nbytes = int(np.prod(desc.shape)) * element_size(desc.data_type)
        return [_core.HostRegion(addr, nbytes).as_array(dtype, tuple(desc.shape))
                for addr in handle.tensor_addrs]

    def copy_blocks(self, handle, src_blocks, dst_blocks):
        return int(self.dd.CopyKvBlocks(handle, handle, list(src_blocks), [list(dst_blocks)]))

    def copy_rows(self, dst, src, dst_row=0, src_row=0, offset=0, size=-1):
        return int(self.dd.CopyKvCache(src, dst, src_row, dst_row, offset, size))

    def release(self, handle):
        first = self.dd.DeallocateCache(handle.cache_id)
        if first == cpp.LLM_PARAM_INVALID:  # registered memory
            return int(self.dd.UnregisterKvCache(handle.cache_id))
        return int(first)


@pytest.fixture(autouse=True)
def host_addressable_device(monkeypatch):
    """The contract reads DEVICE caches through host views: pin the emulated cpu runtime, so the
    suite means the same on a host where auto would pick acl or cuda."""
    monkeypatch.setenv("LLM_DATADIST_DEVICE", "cpu")


@pytest.fixture(params=["python", "cpp"])
def api(request):
    adapter = PythonStyle() if request.param == "python" else CppStyle()
    try:
        yield adapter
    finally:
        adapter.close()


@pytest.fixture
def py_api():
    adapter = PythonStyle()
    try:
        yield adapter
    finally:
        adapter.close()


@pytest.fixture
def dd():
    """An initialized C++-style ``LlmDataDist`` (prompt, cluster 0), finalized afterwards."""
    instance = cpp.LlmDataDist(0, cpp.LlmRole.kPrompt)
    assert instance.Initialize({cpp.OPTION_DEVICE_ID: "0"}) == cpp.LLM_SUCCESS
    try:
        yield instance
    finally:
        instance.Finalize()
