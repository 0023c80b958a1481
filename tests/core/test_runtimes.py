"""The device-runtime loader, allocations, executors and runtime selection against a stub
ACL/CUDA runtime (tests/core/stub_runtime.c, built by the fixtures in conftest.py).

The stub implements the vendor entry points over host memory and records every call, so these
tests check what the library asks the runtime to do (which function, in what order, with which
kind, sizes and addresses) as well as the bytes that end up moved.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import optional_deps
import pytest

import llm_datadist
from llm_datadist import _core, runtimes
from llm_datadist.status import LLMException, LLMStatusCode

# the folder holding the package under test (src/ of a checkout, or site-packages), for children
PACKAGE_ROOT = Path(llm_datadist.__file__).resolve().parents[1]

# Per runtime: the names of its entry points in the stub's log.
API = {
    "acl": {"set_device": "aclrtSetDevice", "malloc": "aclrtMalloc", "free": "aclrtFree",
            "memcpy": "aclrtMemcpy"},
    "cuda": {"set_device": "cudaSetDevice", "malloc": "cudaMalloc", "free": "cudaFree",
             "memcpy": "cudaMemcpy"},
}
RUNTIMES = sorted(API)
# What loading the cuda binding calls: the runtime version (which cudaMemcpyBatchAsync signature)
# and the driver API's initialisation (the copy kernel, IPC address ranges).
CUDA_LOAD_CALLS = ("cudaRuntimeGetVersion", "cuInit")
EXPORT_CALLS = ("cudaIpcGetMemHandle", "cuMemGetAddressRange_v2")
# Log entries that are copies, and the calls that say how a list of copies was made.
COPY_CALLS = ("cudaMemcpy", "aclrtMemcpy", "aclrtMemcpyAsync", "(queued copy)")
WAYS = {"cuda": ("cudaMemcpy", "cudaMemcpyAsync", "cudaMemcpyBatchAsync", "cuLaunchKernel", "cudaStreamSynchronize"),
        "acl": ("aclrtMemcpy", "aclrtMemcpyAsync", "aclrtSynchronizeStream")}
DEVICE_KINDS = {
    "host-to-device": _core.MEMCPY_HOST_TO_DEVICE,
    "device-to-host": _core.MEMCPY_DEVICE_TO_HOST,
    "device-to-device": _core.MEMCPY_DEVICE_TO_DEVICE,
}
ACL_ERROR_REPEAT_INITIALIZE = 100002
CUDA_ERROR_INVALID_DEVICE = 101


def _loaded(stub, name):
    """Runtime ``name`` loaded from ``stub``, bound to device 0, with the log emptied."""
    rt = _core.load_runtime(name, stub.path)
    rt.set_device(0)
    stub.reset_log()
    return rt


# ------------------------------------------------------------------------------------------------
# Plan geometry shared by the executor tests
# ------------------------------------------------------------------------------------------------

NUM_TENSORS = 2
NUM_BLOCKS = 4
BLOCK = 32
TENSOR_BYTES = NUM_BLOCKS * BLOCK
SPACING = 256  # tensors sit 256 bytes apart, so no descriptor can continue into the next tensor
SRC_BLOCKS = [0, 1, 3]
DST_BLOCKS = [2, 3, 0]


class Buffers:
    """Source and destination tensors carved from one numpy buffer at fixed offsets: source
    tensor t at ``t * SPACING``, destination tensor t at ``(NUM_TENSORS + t) * SPACING``."""

    def __init__(self):
        self.backing = np.zeros(2 * NUM_TENSORS * SPACING, dtype=np.uint8)
        base = self.backing.ctypes.data
        self.src_addrs = [base + t * SPACING for t in range(NUM_TENSORS)]
        self.dst_addrs = [base + (NUM_TENSORS + t) * SPACING for t in range(NUM_TENSORS)]
        rng = np.random.default_rng(1234)
        for t in range(NUM_TENSORS):
            self.src(t)[:] = rng.integers(0, 256, size=(NUM_BLOCKS, BLOCK), dtype=np.uint8)
            self.dst(t)[:] = 0xEE
        self.src_before = [self.src(t).copy() for t in range(NUM_TENSORS)]
        self.dst_before = [self.dst(t).copy() for t in range(NUM_TENSORS)]

    def _view(self, offset):
        return self.backing[offset:offset + TENSOR_BYTES].reshape(NUM_BLOCKS, BLOCK)

    def src(self, t):
        return self._view(t * SPACING)

    def dst(self, t):
        return self._view((NUM_TENSORS + t) * SPACING)

    def plan(self):
        src = _core.CacheLayout(self.src_addrs, NUM_BLOCKS, BLOCK)
        dst = _core.CacheLayout(self.dst_addrs, NUM_BLOCKS, BLOCK)
        return _core.plan_blocks(src, dst, None, None, SRC_BLOCKS, DST_BLOCKS)

    def expected_descriptors(self):
        """(src, dst, nbytes) in plan order: blocks 0,1 -> 2,3 merge into one 64-byte copy, then
        block 3 -> 0; tensor by tensor."""
        out = []
        for s, d in zip(self.src_addrs, self.dst_addrs):
            out.append((s + 0 * BLOCK, d + 2 * BLOCK, 2 * BLOCK))
            out.append((s + 3 * BLOCK, d + 0 * BLOCK, BLOCK))
        return out

    def assert_copied(self, tensors):
        """Tensors in ``tensors`` hold the planned blocks; the others are untouched."""
        for t in range(NUM_TENSORS):
            np.testing.assert_array_equal(self.src(t), self.src_before[t])
            expected = self.dst_before[t].copy()
            if t in tensors:
                for s, d in zip(SRC_BLOCKS, DST_BLOCKS):
                    expected[d] = self.src_before[t][s]
            np.testing.assert_array_equal(self.dst(t), expected)


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------

def test_ctypes_and_core_share_one_loaded_copy(stub):
    """The core's dlopen(RTLD_LOCAL) and ctypes.CDLL of one path share the stub's globals, in both
    directions: calls made by the core show in the log read through ctypes, and a failure armed
    through ctypes is seen by the core."""
    rt = _core.load_runtime("acl", stub.path)
    assert stub.names() == ["aclInit"]
    rt.set_device(7)
    assert stub.calls()[-1] == stub.calls("aclrtSetDevice")[0]
    assert stub.calls("aclrtSetDevice")[0].device == 7
    stub.fail("aclrtSetDevice", 4242)
    with pytest.raises(LLMException, match="error 4242"):
        rt.set_device(1)


def test_acl_load_calls_aclinit_once_and_set_device(stub):
    rt = _core.load_runtime("acl", library=stub.path)
    assert (rt.name, rt.library, rt.host_addressable) == ("acl", stub.path, False)
    assert stub.path in repr(rt)
    init = stub.calls()
    assert [(c.fn, c.rc) for c in init] == [("aclInit", 0)]
    # The runtime is cached per (name, library): a second load neither re-opens nor re-inits.
    assert _core.load_runtime("acl", library=stub.path) is rt
    assert _core.load_runtime("acl", library=Path(stub.path)) is rt
    rt.set_device(3)
    assert [(c.fn, c.device, c.rc) for c in stub.calls()] == [("aclInit", -1, 0),
                                                               ("aclrtSetDevice", 3, 0)]
    assert rt.device_count() == 1


def test_acl_load_accepts_an_already_initialised_acl(stub):
    """Another framework may have called aclInit first: ACL_ERROR_REPEAT_INITIALIZE is fine."""
    assert stub.lib.aclInit(None) == 0
    rt = _core.load_runtime("acl", stub.path)
    assert [(c.fn, c.rc) for c in stub.calls()] == [("aclInit", 0),
                                                    ("aclInit", ACL_ERROR_REPEAT_INITIALIZE)]
    rt.set_device(0)


def test_acl_load_fails_when_aclinit_fails_and_is_not_cached(stub):
    stub.fail("aclInit", 500001)
    with pytest.raises(LLMException, match="aclInit failed with error 500001") as info:
        _core.load_runtime("acl", stub.path)
    assert info.value.status_code == LLMStatusCode.LLM_FAILED
    # The failed load was not cached: the next attempt initialises again and succeeds.
    rt = _core.load_runtime("acl", stub.path)
    assert [(c.fn, c.rc) for c in stub.calls()] == [("aclInit", 500001), ("aclInit", 0)]
    assert rt.name == "acl"


def test_acl_set_device_error_raises_llm_failed(stub):
    rt = _core.load_runtime("acl", stub.path)
    stub.fail("aclrtSetDevice", 107001)
    with pytest.raises(LLMException, match=r"acl: set device 5 failed with error 107001") as info:
        rt.set_device(5)
    assert info.value.status_code == LLMStatusCode.LLM_FAILED


def test_cuda_load_device_count_and_set_device(stub):
    stub.set_device_count(3)
    rt = _core.load_runtime("cuda", library=stub.path)
    assert (rt.name, rt.library, rt.host_addressable) == ("cuda", stub.path, False)
    # Loading resolves symbols, asks the runtime's version (which cudaMemcpyBatchAsync signature)
    # and initialises the driver API (for the copy kernel and IPC address ranges).
    assert stub.names() == list(CUDA_LOAD_CALLS)
    stub.reset_log()
    assert rt.device_count() == 3
    assert [(c.fn, c.size) for c in stub.calls()] == [("cudaGetDeviceCount", 3)]
    stub.set_device_count(5)
    assert rt.device_count() == 5
    rt.set_device(2)
    assert [(c.fn, c.device, c.rc) for c in stub.calls("cudaSetDevice")] == [("cudaSetDevice", 2, 0)]
    with pytest.raises(LLMException, match=rf"cuda: set device 9 failed with error "
                                           rf"{CUDA_ERROR_INVALID_DEVICE}") as info:
        rt.set_device(9)
    assert info.value.status_code == LLMStatusCode.LLM_FAILED


def test_cuda_device_count_is_zero_when_the_query_fails(stub):
    rt = _core.load_runtime("cuda", stub.path)
    stub.fail("cudaGetDeviceCount", 35)  # cudaErrorInsufficientDriver
    assert rt.device_count() == 0
    assert rt.device_count() == 1  # the switch fired once; the default stub reports one GPU


@pytest.mark.parametrize("name, default", [("acl", "libascendcl.so"), ("cuda", "libcudart.so")])
def test_missing_library_names_the_path(name, default):
    path = f"/nonexistent/{default}"
    with pytest.raises(LLMException) as info:
        _core.load_runtime(name, library=path)
    assert info.value.status_code == LLMStatusCode.LLM_FAILED
    message = str(info.value)
    assert path in message and f"cannot load the {name} runtime library" in message


@pytest.mark.parametrize("name, symbol", [("acl", "aclrtMemcpy"), ("cuda", "cudaMemcpy")])
def test_missing_symbol_names_the_symbol(make_stub, name, symbol):
    incomplete = make_stub("omit_memcpy")
    assert not hasattr(incomplete.lib, symbol)
    with pytest.raises(LLMException) as info:
        _core.load_runtime(name, library=incomplete.path)
    assert info.value.status_code == LLMStatusCode.LLM_FAILED
    assert f"{incomplete.path} does not export {symbol}" in str(info.value)
    # Every symbol is resolved before anything is called: aclInit never ran.
    assert incomplete.calls() == []


@pytest.mark.parametrize("name", ["rocm", "ACL", "", "gpu"])
def test_unknown_runtime_name_is_param_invalid(name):
    with pytest.raises(LLMException, match="unknown device runtime") as info:
        _core.load_runtime(name)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


# ------------------------------------------------------------------------------------------------
# Allocations
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", RUNTIMES)
@pytest.mark.parametrize("nbytes", [4096, 1])
def test_device_allocation_mallocs_and_frees_on_collection(stub, name, nbytes):
    api = API[name]
    rt = _loaded(stub, name)
    alloc = _core.Allocation(rt, nbytes, True)
    addr = alloc.addr
    (malloc,) = stub.calls()
    assert (malloc.fn, malloc.size, malloc.rc, malloc.dst) == (api["malloc"], nbytes, 0, addr)
    if name == "acl":
        assert malloc.kind == 0  # ACL_MEM_MALLOC_HUGE_FIRST
    assert (alloc.nbytes, alloc.on_device, alloc.runtime, alloc.host_addressable) == (
        nbytes, True, rt, False)
    assert stub.live_allocations() == 1
    del alloc
    gc.collect()
    assert [(c.fn, c.dst, c.rc) for c in stub.calls()[1:]] == [(api["free"], addr, 0)]
    assert stub.live_allocations() == 0


def test_zero_byte_acl_allocation_asks_for_one_byte(stub):
    """aclrtMalloc rejects size 0, so the core asks for one byte."""
    rt = _loaded(stub, "acl")
    alloc = _core.Allocation(rt, 0, True)
    (malloc,) = stub.calls()
    assert (malloc.fn, malloc.size, malloc.rc, malloc.dst) == ("aclrtMalloc", 1, 0, alloc.addr)
    assert alloc.nbytes == 0


@pytest.mark.parametrize("name", RUNTIMES)
def test_host_allocation_does_not_touch_the_runtime(stub, name):
    rt = _loaded(stub, name)
    alloc = _core.Allocation(rt, 256, False)
    assert alloc.addr != 0 and not alloc.on_device and alloc.host_addressable
    view = _core.HostRegion(alloc.addr, alloc.nbytes, alloc).as_array(np.uint8, (256,))
    assert not view.any()  # library-owned host memory starts zeroed
    view[:] = 7
    del view, alloc
    gc.collect()
    assert stub.calls() == []
    assert stub.live_allocations() == 0


@pytest.mark.parametrize("name, code", [("acl", 207001), ("cuda", 2)])
def test_device_allocation_failure_is_device_out_of_memory(stub, name, code):
    rt = _loaded(stub, name)
    stub.fail(API[name]["malloc"], code)
    with pytest.raises(LLMException, match=rf"{name}: allocating 1024 bytes failed \(error {code}\)") as info:
        _core.Allocation(rt, 1024, True)
    assert info.value.status_code == LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY
    assert [(c.fn, c.rc) for c in stub.calls()] == [(API[name]["malloc"], code)]
    assert stub.live_allocations() == 0


# ------------------------------------------------------------------------------------------------
# Executors
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", RUNTIMES)
@pytest.mark.parametrize("kind_name", list(DEVICE_KINDS))
def test_ordered_execute_queues_one_copy_per_descriptor_in_order(stub, name, kind_name):
    """ordered=True on a runtime with async copies: each descriptor is its own queued copy on the
    device's one stream (which runs them in list order), then the stream is waited for; never the
    synchronous memcpy, which on CUDA may return before the copy is done."""
    kind = DEVICE_KINDS[kind_name]
    rt = _loaded(stub, name)
    buffers = Buffers()
    plan = buffers.plan()
    expected = buffers.expected_descriptors()
    assert [tuple(int(v) for v in row) for row in plan.descriptors()] == expected
    assert plan.total_bytes == NUM_TENSORS * len(SRC_BLOCKS) * BLOCK

    _core.execute(plan, rt, kind, ordered=True)

    calls = stub.calls()
    copies = [c for c in calls if c.fn in COPY_CALLS]
    if name == "cuda":  # (acl's host<->device copies are synchronous aclrtMemcpy calls)
        assert API[name]["memcpy"] not in [c.fn for c in calls]
    assert [(c.src, c.dst, c.size) for c in copies] == expected
    assert all(c.rc == 0 and c.device == 0 for c in calls)
    assert stub.pending_copies() == 0
    buffers.assert_copied(tensors=range(NUM_TENSORS))


def test_memcpy_kind_numbers_match_acl_and_cuda():
    """The core passes its kind straight to aclrtMemcpy/cudaMemcpy: the numbers must agree."""
    assert (_core.MEMCPY_HOST_TO_HOST, _core.MEMCPY_HOST_TO_DEVICE, _core.MEMCPY_DEVICE_TO_HOST,
            _core.MEMCPY_DEVICE_TO_DEVICE) == (0, 1, 2, 3)


@pytest.mark.parametrize("name", RUNTIMES)
def test_execute_host_to_host_does_not_call_the_runtime(stub, name):
    rt = _loaded(stub, name)
    buffers = Buffers()
    _core.execute(buffers.plan(), rt, _core.MEMCPY_HOST_TO_HOST)
    assert stub.calls() == []
    buffers.assert_copied(tensors=range(NUM_TENSORS))


@pytest.mark.parametrize("name", RUNTIMES)
@pytest.mark.parametrize("kind", [-1, 4, 99])
def test_execute_rejects_unknown_kind_before_any_copy(stub, name, kind):
    rt = _loaded(stub, name)
    buffers = Buffers()
    with pytest.raises(LLMException, match=f"memcpy kind {kind} is not one of 0..3") as info:
        _core.execute(buffers.plan(), rt, kind)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert stub.calls() == []
    buffers.assert_copied(tensors=())


@pytest.mark.parametrize("name", RUNTIMES)
def test_ordered_execute_failure_names_runtime_and_descriptor_and_stops(stub, name):
    stub.set_runtime_version(12040)  # cuda: no batch call, one cudaMemcpyAsync per descriptor
    rt = _loaded(stub, name)
    buffers = Buffers()
    plan = buffers.plan()
    assert len(plan) == 4
    queue = "aclrtMemcpy" if name == "acl" else "cudaMemcpyAsync"
    stub.fail(queue, 507899, skip=2)  # descriptor 2 = first copy of tensor 1
    with pytest.raises(LLMException) as info:
        _core.execute(plan, rt, _core.MEMCPY_DEVICE_TO_HOST, ordered=True)
    assert info.value.status_code == LLMStatusCode.LLM_FAILED
    message = str(info.value)
    assert message.startswith(f"{name}: device-to-host copy failed with error 507899")
    assert "at descriptor 2 of 4" in message
    calls = [c for c in stub.calls() if c.fn == queue]
    assert [c.rc for c in calls] == [0, 0, 507899]  # descriptor 3 was never attempted
    assert [(c.src, c.dst, c.size) for c in calls] == buffers.expected_descriptors()[:3]
    assert stub.pending_copies() == 0  # what was queued before the error ran before the raise
    buffers.assert_copied(tensors=(0,))  # tensor 0 done; tensor 1 untouched


@pytest.mark.parametrize("name", RUNTIMES)
def test_runtime_memcpy_single_range(stub, name):
    rt = _loaded(stub, name)
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    rt.memcpy(dst.ctypes.data + 8, src.ctypes.data, 40, _core.MEMCPY_DEVICE_TO_DEVICE)
    (call,) = stub.calls()
    assert (call.fn, call.dst, call.src, call.size, call.kind) == (
        API[name]["memcpy"], dst.ctypes.data + 8, src.ctypes.data, 40, 3)
    np.testing.assert_array_equal(dst[8:48], src[:40])
    assert not dst[:8].any() and not dst[48:].any()
    stub.fail(API[name]["memcpy"], 17)
    with pytest.raises(LLMException, match=rf"{name}: memcpy host-to-device of 40 bytes failed "
                                           rf"with error 17") as info:
        rt.memcpy(dst.ctypes.data, src.ctypes.data, 40, _core.MEMCPY_HOST_TO_DEVICE)
    assert info.value.status_code == LLMStatusCode.LLM_FAILED
    with pytest.raises(LLMException, match="memcpy kind 5 is not one of 0..3"):
        rt.memcpy(dst.ctypes.data, src.ctypes.data, 40, 5)
    assert len(stub.calls()) == 2


def test_stub_acl_memcpy_checks_dest_max(stub):
    """Sanity check of the stub itself: aclrtMemcpy refuses destMax < count and copies nothing."""
    memcpy = stub.lib.aclrtMemcpy
    memcpy.restype = ctypes.c_int
    memcpy.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert stub.lib.aclrtSetDevice(0) == 0
    src = np.full(16, 9, dtype=np.uint8)
    dst = np.zeros(16, dtype=np.uint8)
    assert memcpy(dst.ctypes.data, 15, src.ctypes.data, 16, 1) == 100000  # ACL_ERROR_INVALID_PARAM
    assert not dst.any()
    assert memcpy(dst.ctypes.data, 16, src.ctypes.data, 16, 1) == 0
    assert (dst == 9).all()
    assert [(c.dest_max, c.size, c.rc) for c in stub.calls("aclrtMemcpy")] == [(15, 16, 100000),
                                                                              (16, 16, 0)]


# ------------------------------------------------------------------------------------------------
# Selection (llm_datadist.runtimes)
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def device_env(monkeypatch):
    """A clean selection state: no LLM_DATADIST_* variables, an empty per-configuration cache."""
    for var in ("LLM_DATADIST_DEVICE", "LLM_DATADIST_ACL_LIBRARY", "LLM_DATADIST_CUDA_LIBRARY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(runtimes, "_chosen", {})
    return monkeypatch


@pytest.mark.parametrize("value", ["acl", "ascend", " NPU "])
def test_select_acl_from_env(device_env, stub, value):
    device_env.setenv("LLM_DATADIST_DEVICE", value)
    device_env.setenv("LLM_DATADIST_ACL_LIBRARY", stub.path)
    runtime, reason = runtimes.select_runtime()
    assert (runtime.name, runtime.library) == ("acl", stub.path)
    assert reason == f"LLM_DATADIST_DEVICE={value.strip().lower()}: {stub.path} loaded"
    assert stub.names() == ["aclInit"]
    # Cached per configuration: the same answer, no second load.
    assert runtimes.select_runtime() == (runtime, reason)
    assert stub.names() == ["aclInit"]


def test_select_cuda_with_a_gpu(device_env, stub):
    stub.set_device_count(2)
    device_env.setenv("LLM_DATADIST_DEVICE", "gpu")
    device_env.setenv("LLM_DATADIST_CUDA_LIBRARY", stub.path)
    runtime, reason = runtimes.select_runtime()
    assert (runtime.name, runtime.library) == ("cuda", stub.path)
    assert reason == f"LLM_DATADIST_DEVICE=gpu: {stub.path} loaded"


def test_select_cuda_without_gpu_raises(device_env, stub):
    stub.set_device_count(0)
    device_env.setenv("LLM_DATADIST_DEVICE", "cuda")
    device_env.setenv("LLM_DATADIST_CUDA_LIBRARY", stub.path)
    with pytest.raises(LLMException) as info:
        runtimes.select_runtime()
    assert info.value.status_code == LLMStatusCode.LLM_FAILED
    assert (f"LLM_DATADIST_DEVICE=cuda but the runtime is not usable: {stub.path} loaded but "
            f"reports no GPU") in str(info.value)
    assert stub.names() == [*CUDA_LOAD_CALLS, "cudaGetDeviceCount"]
    assert runtimes._chosen == {}


def test_select_acl_with_missing_library_raises(device_env):
    device_env.setenv("LLM_DATADIST_DEVICE", "acl")
    device_env.setenv("LLM_DATADIST_ACL_LIBRARY", "/nonexistent/libascendcl.so")
    with pytest.raises(LLMException, match="/nonexistent/libascendcl.so") as info:
        runtimes.select_runtime()
    assert info.value.status_code == LLMStatusCode.LLM_FAILED


def test_select_auto_falls_back_to_cpu(device_env, stub):
    stub.set_device_count(0)
    device_env.setenv("LLM_DATADIST_DEVICE", "auto")
    device_env.setenv("LLM_DATADIST_ACL_LIBRARY", "/nonexistent/libascendcl.so")
    device_env.setenv("LLM_DATADIST_CUDA_LIBRARY", stub.path)
    runtime, reason = runtimes.select_runtime()
    assert runtime.name == "cpu" and runtime.host_addressable
    assert reason.startswith("auto-detected: always available")
    assert stub.names() == [*CUDA_LOAD_CALLS, "cudaGetDeviceCount"]  # cuda was probed and refused


@pytest.mark.parametrize("acl_present, gpus, expected", [
    (True, 1, "acl"),    # acl wins over an available cuda
    (False, 1, "cuda"),
    (True, 0, "acl"),
])
def test_select_auto_order(device_env, make_stub, acl_present, gpus, expected):
    acl_stub, cuda_stub = make_stub(), make_stub()
    cuda_stub.set_device_count(gpus)
    device_env.setenv("LLM_DATADIST_ACL_LIBRARY",
                      acl_stub.path if acl_present else "/nonexistent/libascendcl.so")
    device_env.setenv("LLM_DATADIST_CUDA_LIBRARY", cuda_stub.path)
    runtime, reason = runtimes.select_runtime()  # LLM_DATADIST_DEVICE unset = auto
    chosen = {"acl": acl_stub, "cuda": cuda_stub}[expected]
    assert (runtime.name, runtime.library) == (expected, chosen.path)
    assert reason == f"auto-detected: {chosen.path} loaded"
    if expected == "acl":
        assert cuda_stub.calls() == []  # not probed once acl was usable


def test_select_cache_is_per_configuration(device_env, make_stub):
    """The choice is cached per (device, acl library, cuda library): changing the library
    variable selects again, returning to the first configuration returns the first choice."""
    first, second = make_stub(), make_stub()
    device_env.setenv("LLM_DATADIST_DEVICE", "acl")
    device_env.setenv("LLM_DATADIST_ACL_LIBRARY", first.path)
    chosen_first = runtimes.select_runtime()
    device_env.setenv("LLM_DATADIST_ACL_LIBRARY", second.path)
    chosen_second = runtimes.select_runtime()
    assert chosen_first[0].library == first.path
    assert chosen_second[0].library == second.path
    device_env.setenv("LLM_DATADIST_ACL_LIBRARY", first.path)
    again = runtimes.select_runtime()
    assert again == chosen_first and again[0] is chosen_first[0]
    assert first.names() == ["aclInit"] and second.names() == ["aclInit"]
    # The cpu choice does not depend on the library variables being valid.
    device_env.setenv("LLM_DATADIST_DEVICE", "cpu")
    runtime, reason = runtimes.select_runtime()
    assert runtime.name == "cpu" and reason.startswith("LLM_DATADIST_DEVICE=cpu: always available")


@pytest.mark.parametrize("value", ["bogus", "rocm", "acl,cuda"])
def test_select_unknown_device_is_param_invalid(device_env, value):
    device_env.setenv("LLM_DATADIST_DEVICE", value)
    with pytest.raises(LLMException, match="is not one of auto, cpu, acl, cuda") as info:
        runtimes.select_runtime()
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


# ------------------------------------------------------------------------------------------------
# The registry (llm_datadist.runtimes): names, capabilities, and a runtime added with no other edit
# ------------------------------------------------------------------------------------------------

def _capability_bits(spec) -> int:
    bits = 0
    for name in spec.capabilities:
        bits |= _core.CAPABILITIES[name]
    return bits


def test_registry_names_aliases_and_auto_order():
    assert runtimes.names() == ("cpu", "acl", "cuda")
    assert runtimes.names(selectable_only=False) == ("host", "cpu", "acl", "cuda")
    assert runtimes.choices() == ("auto", "cpu", "acl", "cuda")
    assert runtimes.aliases() == {"cpu": "cpu", "acl": "acl", "ascend": "acl", "npu": "acl",
                                  "cuda": "cuda", "gpu": "cuda"}
    assert runtimes.auto_order() == ("acl", "cuda", "cpu")
    assert runtimes.get(" NPU ").name == "acl" and runtimes.get("host").binding == "host"
    assert (runtimes.get("acl").library, runtimes.get("acl").library_env) == (
        "libascendcl.so", "LLM_DATADIST_ACL_LIBRARY")
    assert (runtimes.get("cuda").library, runtimes.get("cuda").library_env) == (
        "libcudart.so", "LLM_DATADIST_CUDA_LIBRARY")
    assert runtimes.CAPABILITY_NAMES == ("host_addressable", "async_copy", "batched_copy", "ipc")
    for bad in ("rocm", "auto", "", None, ["cpu"]):
        with pytest.raises(LLMException, match=re.escape(f"unknown device runtime {bad!r}")) as info:
            runtimes.get(bad)
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_every_library_runtime_is_covered_by_the_stub():
    """The stub tests above run over API's runtimes: a new vendor runtime brings its stub entries."""
    assert {name for name in runtimes.names(False) if runtimes.get(name).library} == set(API)


@pytest.mark.parametrize("name", runtimes.names(selectable_only=False))
def test_declared_capabilities_are_what_the_binding_reports(make_stub, name):
    spec = runtimes.get(name)
    rt = runtimes.load(name, make_stub().path if spec.library else None)
    assert (rt.name, rt.binding) == (spec.name, spec.binding)
    assert rt.capabilities == _capability_bits(spec)
    assert rt.host_addressable == spec.host_addressable == ("host_addressable" in spec.capabilities)
    assert spec.capability_flags() == {cap: cap in spec.capabilities for cap in runtimes.CAPABILITY_NAMES}


def test_core_refuses_an_unknown_binding_and_a_library_binding_without_a_library():
    assert set(_core.bindings()) == {"host", "acl", "cuda"}
    for kwargs in ({"binding": "hip"}, {"binding": 3}):
        with pytest.raises(LLMException, match="unknown device runtime 'x'") as info:
            _core.load_runtime("x", **kwargs)
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException, match="needs the path of its shared library") as info:
        _core.load_runtime("cuda")
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException, match="contains a NUL byte") as info:
        _core.load_runtime("cuda", "/lib/libcudart.so\0.1")
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_register_refuses_taken_names_unknown_capabilities_and_bindings():
    spec = runtimes.RuntimeSpec
    for bad, match in [
        (spec(name="gpu", binding="host", description="x"), "reserved or taken"),
        (spec(name="auto", binding="host", description="x"), "reserved or taken"),
        (spec(name="extra", binding="host", description="x", aliases=("npu",)), "reserved or taken"),
        (spec(name="Extra", binding="host", description="x"), "reserved or taken"),
        (spec(name="extra", binding="host", description="x", capabilities=frozenset({"fast"})),
         "unknown capabilities"),
        (spec(name="extra", binding="hip", description="x"), "no binding 'hip'"),
    ]:
        with pytest.raises(ValueError, match=match):
            runtimes.register(bad)
    assert "extra" not in runtimes.aliases() and runtimes.aliases()["npu"] == "acl"


@pytest.fixture
def test_runtime(device_env):
    """A test-only runtime registered like a vendor module would be: ``testrt`` (alias ``trt``)
    over the cuda binding, its library named by LLM_DATADIST_TESTRT_LIBRARY, first in auto order."""
    spec = runtimes.register(runtimes.RuntimeSpec(
        name="testrt", binding="cuda", description="test-only runtime over the stub library",
        aliases=("trt",), library="/nonexistent/libtestrt.so", library_env="LLM_DATADIST_TESTRT_LIBRARY",
        auto_priority=5))
    try:
        yield spec
    finally:
        runtimes.unregister("testrt")


def test_a_registered_runtime_is_selected_listed_and_offered(test_runtime, device_env, stub):
    """Selection, `info` and the CLI pick a new runtime up from its registration alone."""
    from llm_datadist.cli import info as _sysinfo
    from llm_datadist.cli.main import build_parser

    assert runtimes.choices() == ("auto", "cpu", "acl", "cuda", "testrt")
    assert runtimes.auto_order()[0] == "testrt"
    # Unusable until its library variable names a loadable library.
    assert runtimes.probe("testrt") == (False, "cannot load the testrt runtime library "
                                               "/nonexistent/libtestrt.so: /nonexistent/libtestrt.so: "
                                               "cannot open shared object file: No such file or directory")
    device_env.setenv("LLM_DATADIST_TESTRT_LIBRARY", stub.path)
    device_env.setenv("LLM_DATADIST_DEVICE", "TRT")
    runtime, reason = runtimes.select_runtime()
    assert (runtime.name, runtime.binding, runtime.library) == ("testrt", "cuda", stub.path)
    assert reason == f"LLM_DATADIST_DEVICE=trt: {stub.path} loaded"
    device_env.delenv("LLM_DATADIST_DEVICE")
    assert runtimes.select_runtime() == (runtime, f"auto-detected: {stub.path} loaded")

    facts = _sysinfo.runtime_facts()
    assert facts["device_runtime"] == f"testrt (auto-detected: {stub.path} loaded)"
    assert facts["runtimes"]["testrt"] == f"available: {stub.path} loaded"
    # As the loaded library reports them (acl and cuda depend on what this machine has).
    assert facts["runtime_capabilities"]["testrt"] == "async_copy, batched_copy, ipc (reported by the loaded library)"
    assert facts["runtime_capabilities"]["cpu"].startswith("host_addressable")
    assert build_parser().parse_args(["demo", "--device", "testrt"]).device == "testrt"

    runtimes.unregister("testrt")
    try:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["demo", "--device", "testrt"])
        device_env.setenv("LLM_DATADIST_DEVICE", "testrt")
        with pytest.raises(LLMException) as info:
            runtimes.select_runtime()
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        message = str(info.value)
        assert "LLM_DATADIST_DEVICE='testrt' is not one of auto, cpu, acl, cuda" in message
        assert "testrt" not in message.split("is not one of")[1]
    finally:
        runtimes.register(test_runtime)


def test_a_registered_runtime_backs_device_caches(test_runtime, device_env, stub):
    """The engine allocates DEVICE memory through the new runtime and, since its memory is not
    host-addressable, refuses host views of it (as for acl and cuda)."""
    from llm_datadist import CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole, Placement

    device_env.setenv("LLM_DATADIST_TESTRT_LIBRARY", stub.path)
    device_env.setenv("LLM_DATADIST_DEVICE", "testrt")
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.mem_pool_cfg = '{"memory_size": 10000000}'
    dd.init(config.generate_options())
    try:
        cache = dd.cache_manager.allocate_blocks_cache(CacheDesc(1, [4, 8], DataType.DT_INT32, Placement.DEVICE))
        # The device memory is allocated, then exported for the cuda_ipc plane's peers.
        assert stub.names() == [*CUDA_LOAD_CALLS, "cudaSetDevice", "cudaMalloc", "cuMemGetAddressRange_v2",
                                "cudaIpcGetMemHandle"]
        assert stub.calls("cudaMalloc")[0].dst == cache.tensor_addrs[0]
        with pytest.raises(LLMException) as info:
            cache.as_numpy()
        assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    finally:
        dd.finalize()
    del cache, info  # the traceback's as_numpy frame holds the cache too
    gc.collect()
    assert stub.names()[-1] == "cudaFree" and stub.live_allocations() == 0


def test_torch_devices_accepted_come_from_the_runtime(test_runtime):
    torch = optional_deps.importorskip("torch")
    from llm_datadist._memory import resolve_address

    meta = torch.empty(4, dtype=torch.int32, device="meta")
    with pytest.raises(LLMException, match="a torch tensor on meta cannot be used with the cuda runtime"):
        resolve_address(meta, 16, "cuda", "addrs[0]", runtimes.tensor_devices("cuda"))
    runtimes.unregister("testrt")
    try:
        runtimes.register(dataclasses.replace(test_runtime, tensor_devices=("meta",)))
        # the engine asks the registry (the base helper _memory does not import it)
        assert runtimes.tensor_devices("testrt") == ("meta",)
        assert resolve_address(meta, 16, "testrt", "addrs[0]", runtimes.tensor_devices("testrt"))[1] is meta
    finally:
        runtimes.unregister("testrt")
        runtimes.register(test_runtime)


# ------------------------------------------------------------------------------------------------
# End to end through the public API, in a child process
# ------------------------------------------------------------------------------------------------

# Both child programs start the same way: one initialized LLMDataDist on the stub runtime.
_CHILD_INIT = textwrap.dedent("""
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.mem_pool_cfg = '{"memory_size": 10000000}'
    dd.init(config.generate_options())
    cm = dd.cache_manager
""")

_CHILD = textwrap.dedent("""
    import ctypes, gc, json, sys

    import numpy as np

    from llm_datadist import (Cache, CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole,
                              Placement)

    stub = ctypes.CDLL(sys.argv[1])

    class Entry(ctypes.Structure):
        _fields_ = [("fn", ctypes.c_int32), ("kind", ctypes.c_int32), ("device", ctypes.c_int32),
                    ("rc", ctypes.c_int32), ("size", ctypes.c_uint64), ("dest_max", ctypes.c_uint64),
                    ("dst", ctypes.c_uint64), ("src", ctypes.c_uint64)]

    stub.stub_fn_name.restype = ctypes.c_char_p
    stub.stub_log_entry.argtypes = [ctypes.c_int, ctypes.POINTER(Entry)]
    stub.stub_live_allocations.restype = ctypes.c_int64

    def log():
        out = []
        for i in range(stub.stub_log_count()):
            e = Entry()
            assert stub.stub_log_entry(i, ctypes.byref(e)) == 0
            out.append({"fn": stub.stub_fn_name(e.fn).decode(), "kind": e.kind, "device": e.device,
                        "rc": e.rc, "size": e.size, "dest_max": e.dest_max, "dst": e.dst,
                        "src": e.src})
        return out

""") + _CHILD_INIT + textwrap.dedent("""
    dev = cm.allocate_blocks_cache(CacheDesc(2, [4, 8], DataType.DT_INT32, Placement.DEVICE))
    host_desc = CacheDesc(2, [4, 8], DataType.DT_INT32, Placement.HOST)
    h_in = [np.arange(32, dtype=np.int32).reshape(4, 8) + 1000 * (t + 1) for t in range(2)]
    h_out = [np.full((4, 8), -1, dtype=np.int32) for _ in range(2)]
    cache_in = Cache.create_cpu_cache(host_desc, h_in)
    cache_out = Cache.create_cpu_cache(host_desc, h_out)
    marks = {"allocated": stub.stub_log_count()}
    cm.swap_blocks(cache_in, dev, {0: 0, 1: 1})          # swap in: blocks 0,1 host -> device
    marks["swapped_in"] = stub.stub_log_count()
    cm.copy_blocks(dev, {0: [2], 1: [3]})                # device blocks 0,1 -> 2,3
    marks["copied"] = stub.stub_log_count()
    cm.swap_blocks(dev, cache_out, {2: 0, 3: 1, 0: 3})   # swap out: device -> host blocks 0,1,3
    marks["swapped_out"] = stub.stub_log_count()
    result = {
        "marks": marks,
        "dev_addrs": list(dev.tensor_addrs),
        "in_addrs": [int(a.ctypes.data) for a in h_in],
        "out_addrs": [int(a.ctypes.data) for a in h_out],
        "h_in": [a.tolist() for a in h_in],
        "h_out": [a.tolist() for a in h_out],
        "live_before_finalize": stub.stub_live_allocations(),
    }
    dd.finalize()
    del dev
    gc.collect()
    result["log"] = log()
    result["live_after_finalize"] = stub.stub_live_allocations()
    print("RESULT " + json.dumps(result))
""")


@pytest.mark.parametrize("name", RUNTIMES)
def test_public_api_end_to_end_on_the_stub(stub, tmp_path, name):
    api = API[name]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_DATADIST_")}
    env["LLM_DATADIST_DEVICE"] = name
    env[runtimes.get(name).library_env] = stub.path
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", _CHILD, stub.path], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout
    result = json.loads(lines[0][len("RESULT "):])
    log, marks = result["log"], result["marks"]
    tensor = 4 * 8 * 4  # [4, 8] int32
    block = 8 * 4

    # Start-up and allocation.
    prefix = ["aclInit"] if name == "acl" else [*CUDA_LOAD_CALLS, "cudaGetDeviceCount"]
    start = prefix + [api["set_device"], api["malloc"], api["malloc"]]
    # cuda: each allocated tensor is also exported for the cuda_ipc plane's peers.
    allocating = [c for c in log[:marks["allocated"]] if c["fn"] not in EXPORT_CALLS]
    assert [c["fn"] for c in allocating] == start
    exports = [c for c in log[:marks["allocated"]] if c["fn"] == "cudaIpcGetMemHandle"]
    assert [c["src"] for c in exports] == (result["dev_addrs"] if name == "cuda" else [])
    set_device = allocating[len(prefix)]
    assert (set_device["device"], set_device["rc"]) == (0, 0)
    mallocs = allocating[len(prefix) + 1:]
    assert [m["size"] for m in mallocs] == [tensor, tensor]
    assert [m["dst"] for m in mallocs] == result["dev_addrs"]
    if name == "acl":
        assert all(m["kind"] == 0 for m in mallocs)

    # Copies: every copy the runtime made, (src, dst, nbytes) in order (a batch copy and a kernel
    # launch are followed in the stub's log by one entry per copy they queued); adjacent blocks
    # merge into one descriptor.
    dev, h_in, h_out = result["dev_addrs"], result["in_addrs"], result["out_addrs"]
    copy_calls = log[marks["allocated"]:marks["swapped_out"]]
    assert all(c["rc"] == 0 and c["device"] == 0 for c in copy_calls)

    def phase(begin, end):
        return log[marks[begin]:marks[end]]

    def copies(begin, end):
        return [(c["src"], c["dst"], c["size"]) for c in phase(begin, end) if c["fn"] in COPY_CALLS]

    assert copies("allocated", "swapped_in") == [(h_in[t], dev[t], 2 * block) for t in range(2)]
    assert copies("swapped_in", "copied") == [(dev[t], dev[t] + 2 * block, 2 * block) for t in range(2)]
    assert copies("copied", "swapped_out") == [c for t in range(2) for c in (
        (dev[t] + 2 * block, h_out[t], 2 * block),
        (dev[t], h_out[t] + 3 * block, block))]
    # How: cuda swaps are one cudaMemcpyBatchAsync and the device copy one launch of the copy
    # kernel, each waited for once; acl swaps are synchronous aclrtMemcpy calls (its async copies
    # need aclrtMallocHost memory) and its device copies aclrtMemcpyAsync on a stream.
    for begin, end, kind in (("allocated", "swapped_in", 1), ("swapped_in", "copied", 3),
                             ("copied", "swapped_out", 2)):
        calls = [c["fn"] for c in phase(begin, end) if c["fn"] in WAYS[name]]
        if name == "cuda" and kind == 3:
            # The first launch waits for the stream, then makes the buffer of its pieces.
            assert calls == ["cudaStreamSynchronize", "cudaMemcpyAsync", "cuLaunchKernel",
                             "cudaStreamSynchronize"]
        elif name == "cuda":
            assert calls == ["cudaMemcpyBatchAsync", "cudaStreamSynchronize"]
        else:
            n = len(copies(begin, end))
            assert calls == (["aclrtMemcpyAsync"] * n + ["aclrtSynchronizeStream"] if kind == 3
                             else ["aclrtSynchronizeStream"] + ["aclrtMemcpy"] * n + ["aclrtSynchronizeStream"])
            assert all(c["kind"] == kind and c["dest_max"] == c["size"]
                       for c in phase(begin, end) if c["fn"] in ("aclrtMemcpy", "aclrtMemcpyAsync"))

    # The bytes: host blocks 0,1 went to device blocks 0,1 and on to 2,3; out-blocks 0,1 come
    # from device blocks 2,3, out-block 3 from device block 0; out-block 2 keeps its -1s.
    for t in range(2):
        src, out = np.array(result["h_in"][t]), np.array(result["h_out"][t])
        np.testing.assert_array_equal(out[0], src[0])
        np.testing.assert_array_equal(out[1], src[1])
        np.testing.assert_array_equal(out[3], src[0])
        np.testing.assert_array_equal(out[2], np.full(8, -1))

    # finalize releases the device memory through the runtime.
    assert result["live_before_finalize"] == 2 + (name == "cuda")  # cuda: the piece buffer
    frees = [c for c in log[marks["swapped_out"]:] if c["fn"] == api["free"]]
    assert sorted(c["dst"] for c in frees) == sorted(dev)
    # cuda keeps one allocation for the life of the runtime: the copy kernel's piece buffer.
    assert result["live_after_finalize"] == (name == "cuda")


_CHILD_THREADS = textwrap.dedent("""
    import sys, threading
    import numpy as np
    from llm_datadist import Cache, CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole, Placement

""") + _CHILD_INIT + textwrap.dedent("""
    dev = cm.allocate_blocks_cache(CacheDesc(1, [4, 8], DataType.DT_INT32, Placement.DEVICE))
    host = np.arange(32, dtype=np.int32).reshape(4, 8)
    out = np.zeros((4, 8), np.int32)
    desc = CacheDesc(1, [4, 8], DataType.DT_INT32, Placement.HOST)
    errors = []

    def worker():
        try:
            cm.swap_blocks(Cache.create_cpu_cache(desc, [host]), dev, {2: 1})
            cm.swap_blocks(dev, Cache.create_cpu_cache(desc, [out]), {1: 0})
        except Exception as exc:
            errors.append(repr(exc))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(30)
    assert not errors, errors
    assert (out[0] == host[2]).all(), out
    dd.finalize()
    print("THREADS OK")
""")


@pytest.mark.parametrize("name", RUNTIMES)
def test_worker_threads_are_bound_to_the_device(stub, tmp_path, name):
    """ACL contexts and the CUDA current device are per thread: copies issued from a thread other
    than the one that called init must still run on the configured device."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_DATADIST_")}
    env["LLM_DATADIST_DEVICE"] = name
    env[runtimes.get(name).library_env] = stub.path
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", _CHILD_THREADS], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "THREADS OK" in proc.stdout


# ------------------------------------------------------------------------------------------------
# HOST caches of a device runtime are page-locked (swaps and staging copy them at full speed)
# ------------------------------------------------------------------------------------------------

def test_host_caches_of_cuda_are_page_locked_and_released(device_env, stub):
    from llm_datadist import CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole, Placement

    device_env.setenv("LLM_DATADIST_DEVICE", "cuda")
    device_env.setenv("LLM_DATADIST_CUDA_LIBRARY", stub.path)
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.host_mem_pool_cfg = '{"memory_size": 10000000}'
    dd.init(config.generate_options())
    try:
        arrays = [np.arange(32, dtype=np.int32).reshape(4, 8) for _ in range(2)]
        desc = CacheDesc(2, [4, 8], DataType.DT_INT32, Placement.HOST)
        registered = dd.cache_manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays])
        pinned = stub.calls("cudaHostRegister")
        assert [(c.dst, c.size, c.kind) for c in pinned] == [(a.ctypes.data, a.nbytes, 1) for a in arrays]
        assert stub.live_host_allocations() == 2
        allocated = dd.cache_manager.allocate_blocks_cache(desc)
        assert [c.size for c in stub.calls("cudaMallocHost")] == [128, 128]
        assert allocated.as_numpy()[0].sum() == 0  # zeroed, as host memory the library allocates is
        assert stub.live_host_allocations() == 4
        dd.cache_manager.unregister_cache(registered.cache_id)
        assert sorted(c.dst for c in stub.calls("cudaHostUnregister")) == sorted(a.ctypes.data for a in arrays)
        assert stub.live_host_allocations() == 2
        # A range the runtime refuses to lock (already page-locked, say) stays usable, unlocked.
        stub.fail("cudaHostRegister", 712)
        other = dd.cache_manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays])
        assert stub.live_host_allocations() == 3
        del other
    finally:
        dd.finalize()
    del allocated
    gc.collect()
    assert stub.live_host_allocations() == 0  # finalize unregistered the rest, the allocations are freed
