"""The device-copy core against the stub runtime (tests/core/stub_runtime.c): ``execute`` on the
cuda and acl bindings (the copy kernel, cudaMemcpyBatchAsync, cudaMemcpyAsync, aclrtMemcpyAsync,
their fallbacks and errors), ``wait=False`` and ``Runtime.synchronize``, ordered copies, page-locked
host memory, host registration, CUDA IPC between two processes, ``stage_plan`` and
``translate_plan``, and concurrent copies from several threads.

The stub runs streams late (a queued copy happens at the next synchronize), so a missing wait
shows as stale bytes; its "device" memory is host memory, so every test reads the bytes back
directly, and checks the stub's call log for how the binding asked for them to be moved.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llm_datadist
from llm_datadist import _core, _io
from llm_datadist.status import LLMException, LLMStatusCode
from runtime_stub import _StubCall

PACKAGE_ROOT = Path(llm_datadist.__file__).resolve().parents[1]
TESTS_ROOT = Path(__file__).resolve().parents[1]

H2H, H2D, D2H, D2D = (_core.MEMCPY_HOST_TO_HOST, _core.MEMCPY_HOST_TO_DEVICE,
                      _core.MEMCPY_DEVICE_TO_HOST, _core.MEMCPY_DEVICE_TO_DEVICE)
KIND_NAMES = {H2D: "host-to-device", D2H: "device-to-host", D2D: "device-to-device"}
PIECE = 256 * 1024  # DD_COPY_KERNEL_PIECE_BYTES
THREADS = 256  # DD_COPY_KERNEL_THREADS
MAX_GRID = 65535
GUARD = 64
GUARD_BYTE = 0x5C
# The sizes the kernel test cuts: nothing, one byte, one piece, one piece and a byte, 4 pieces + 17.
PIECE_SIZES = [0, 1, PIECE, PIECE + 1, 4 * PIECE + 17]
# Log entries that say how a list of copies was made.
CUDA_WAYS = ("cudaMemcpy", "cudaMemcpyAsync", "cudaMemcpyBatchAsync", "cuLaunchKernel",
             "cudaStreamSynchronize")
ACL_WAYS = ("aclrtMemcpy", "aclrtMemcpyAsync", "aclrtSynchronizeStream")
CUDA_ERROR = 719  # cudaErrorLaunchFailure, an arbitrary runtime error code to inject
PROPERTY = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------

def make_plan(descs):
    """A plan holding exactly ``descs`` (src, dst, nbytes), unmerged."""
    return _io.plan_from_wire(b"".join(struct.pack("<QQQ", *d) for d in descs))


def plan_descs(plan):
    return [tuple(int(v) for v in row) for row in plan.descriptors()]


def view(addr, nbytes):
    """A writable numpy view of memory at ``addr`` (stub device memory is host memory)."""
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(addr))


def loaded(stub, name="cuda"):
    """Runtime ``name`` from ``stub``, bound to device 0, with the stub's log emptied."""
    rt = _core.load_runtime(name, stub.path)
    rt.set_device(0)
    stub.reset_log()
    return rt


def copies(calls):
    """(src, dst, nbytes) of the copies in a log: queued pieces/batch entries and plain copies."""
    return [(c.src, c.dst, c.size) for c in calls
            if c.fn in ("(queued copy)", "cudaMemcpy", "cudaMemcpyAsync", "aclrtMemcpy",
                        "aclrtMemcpyAsync")]


class Layout:
    """Source and destination regions for a list of descriptor sizes: every source filled with
    random bytes, every destination framed by GUARD guard bytes on both sides and filled with a
    stale pattern. ``src_device``/``dst_device``: the side lives in runtime device memory
    (an Allocation of ``rt``), True; in a numpy buffer, False; in the runtime's page-locked host
    memory, "pinned"."""

    def __init__(self, rt, sizes, src_device=True, dst_device=True, seed=7):
        self.sizes = list(sizes)
        self.keep = []
        rng = np.random.default_rng(seed)
        src_total = sum(s + GUARD for s in self.sizes) + GUARD
        dst_total = sum(s + 2 * GUARD for s in self.sizes) + GUARD
        self.src_base, self.src = self._region(rt, src_total, src_device)
        self.dst_base, self.dst = self._region(rt, dst_total, dst_device)
        self.src[:] = rng.integers(0, 256, src_total, dtype=np.uint8)
        self.dst[:] = GUARD_BYTE
        self.descs = []
        s_off, d_off = GUARD, GUARD
        for k, n in enumerate(self.sizes):
            self.dst[d_off:d_off + n] = (k * 37 + 11) % 251  # stale bytes, not the guard
            self.descs.append((self.src_base + s_off, self.dst_base + d_off, n))
            s_off += n + GUARD
            d_off += n + 2 * GUARD
        self.src_before = self.src.copy()
        self.dst_before = self.dst.copy()

    def _region(self, rt, nbytes, device):
        if device:
            pinned = device == "pinned"
            alloc = _core.Allocation(rt, nbytes, on_device=not pinned, pinned=pinned)
            assert alloc.pinned == pinned
            self.keep.append(alloc)
            return alloc.addr, view(alloc.addr, nbytes)
        buf = np.zeros(nbytes, dtype=np.uint8)
        self.keep.append(buf)
        return buf.ctypes.data, buf

    def plan(self):
        return make_plan(self.descs)

    def expected(self):
        out = self.dst_before.copy()
        for src, dst, n in self.descs:
            so, do = src - self.src_base, dst - self.dst_base
            out[do:do + n] = self.src_before[so:so + n]
        return out

    def assert_copied(self):
        """Every destination holds its source's bytes; guard bytes and sources are untouched."""
        np.testing.assert_array_equal(self.src, self.src_before)
        np.testing.assert_array_equal(self.dst, self.expected())

    def assert_untouched(self):
        np.testing.assert_array_equal(self.src, self.src_before)
        np.testing.assert_array_equal(self.dst, self.dst_before)

    def nonempty(self):
        return [d for d in self.descs if d[2]]


def kernel_pieces(descs):
    """The pieces the binding cuts a D2D list into (DD_COPY_KERNEL_PIECE_BYTES each)."""
    out = []
    for src, dst, n in descs:
        for off in range(0, n, PIECE):
            out.append((src + off, dst + off, min(PIECE, n - off)))
    return out


def warm_kernel(stub, rt):
    """Run one D2D list so the stream, the kernel and its piece buffer exist (the first launch
    also waits for the stream and allocates), then empty the log."""
    layout = Layout(rt, [PIECE * 5])
    _core.execute(layout.plan(), rt, D2D)
    layout.assert_copied()
    stub.reset_log()


def raises_failed(match=None):
    return pytest.raises(LLMException, match=match)


# ------------------------------------------------------------------------------------------------
# 1. cuda device-to-device: one launch of the copy kernel
# ------------------------------------------------------------------------------------------------

def test_cuda_d2d_is_one_kernel_launch_over_256k_pieces(stub):
    rt = loaded(stub)
    assert rt.async_copy and rt.batched_copy and rt.ipc
    layout = Layout(rt, PIECE_SIZES)
    stub.reset_log()
    _core.execute(layout.plan(), rt, D2D)
    layout.assert_copied()
    calls = stub.calls()
    names = [c.fn for c in calls]
    pieces = kernel_pieces(layout.descs)
    assert len(pieces) == 1 + 1 + 2 + 5
    (launch,) = [c for c in calls if c.fn == "cuLaunchKernel"]
    assert (launch.rc, launch.size, launch.kind, launch.dest_max) == (0, len(pieces), len(pieces),
                                                                      THREADS)
    at = names.index("cuLaunchKernel")
    # The launch's pieces, in order, right after it; then the one wait.
    assert [(c.src, c.dst, c.size) for c in calls[at + 1:at + 1 + len(pieces)]] == pieces
    assert all(c.kind == 3 for c in calls[at + 1:at + 1 + len(pieces)])
    assert [n for n in names[at + 1 + len(pieces):] if n in CUDA_WAYS] == ["cudaStreamSynchronize"]
    # Before it: the first launch waits for the stream, makes the piece buffer and uploads the
    # pieces (24 bytes each) with one async copy into that buffer.
    assert [n for n in names[:at] if n in CUDA_WAYS] == ["cudaStreamSynchronize", "cudaMemcpyAsync"]
    (malloc,) = [c for c in calls if c.fn == "cudaMalloc"]
    (upload,) = [c for c in calls if c.fn == "cudaMemcpyAsync"]
    assert (upload.kind, upload.dst, upload.size) == (H2D, malloc.dst, 24 * len(pieces))
    assert launch.src == malloc.dst and malloc.size >= 24 * len(pieces)
    assert "cudaMemcpyBatchAsync" not in names and "cudaMemcpy" not in names
    assert stub.pending_copies() == 0

    # A second list reuses the stream, the kernel and the buffer: upload, launch, wait.
    layout2 = Layout(rt, PIECE_SIZES[::-1], seed=8)
    stub.reset_log()
    _core.execute(layout2.plan(), rt, D2D)
    layout2.assert_copied()
    calls = stub.calls()
    assert [c.fn for c in calls if c.fn in CUDA_WAYS] == [
        "cudaMemcpyAsync", "cuLaunchKernel", "cudaStreamSynchronize"]
    assert copies(c for c in calls if c.fn == "(queued copy)") == kernel_pieces(layout2.descs)
    assert [c.fn for c in calls if c.fn in ("cuModuleLoadData", "cudaMalloc", "cudaStreamCreate")] == []


def test_cuda_d2d_grid_is_capped_at_65535_blocks(stub):
    rt = loaded(stub)
    warm_kernel(stub, rt)
    n = MAX_GRID + 1000
    src = np.arange(2 * n, dtype=np.uint64).astype(np.uint8)
    dst = np.zeros(2 * n, dtype=np.uint8)
    # One byte every other byte: nothing merges, every descriptor is one piece.
    plan = make_plan([(src.ctypes.data + 2 * i, dst.ctypes.data + 2 * i, 1) for i in range(n)])
    _core.execute(plan, rt, D2D)
    np.testing.assert_array_equal(dst[::2], src[::2])
    assert not dst[1::2].any()
    # The log overflows with the queued pieces; the launch is among the first entries.
    launches = []
    raw = _StubCall()
    for i in range(min(stub.lib.stub_log_count(), 16)):
        assert stub.lib.stub_log_entry(i, ctypes.byref(raw)) == 0
        if raw.fn == stub._ids["cuLaunchKernel"]:
            launches.append((raw.size, raw.kind, raw.dest_max))
    assert launches == [(n, MAX_GRID, THREADS)]
    stub.reset_log()


@pytest.mark.parametrize("sizes", [[], [0], [0, 0, 0]])
def test_cuda_d2d_of_nothing_launches_nothing(stub, sizes):
    rt = loaded(stub)
    warm_kernel(stub, rt)
    layout = Layout(rt, sizes)
    stub.reset_log()
    _core.execute(layout.plan(), rt, D2D)
    layout.assert_copied()
    names = stub.names()
    assert not {"cuLaunchKernel", "cudaMemcpyBatchAsync", "cudaMemcpyAsync", "cudaMemcpy",
                "(queued copy)"} & set(names)


# ------------------------------------------------------------------------------------------------
# 2. cuda host<->device: one cudaMemcpyBatchAsync, or cudaMemcpyAsync per descriptor
# ------------------------------------------------------------------------------------------------

HOST_DEVICE = [pytest.param(H2D, False, True, id="h2d"), pytest.param(D2H, True, False, id="d2h")]
# The same with the host side in cudaMallocHost memory.
HOST_DEVICE_PINNED = HOST_DEVICE + [pytest.param(H2D, "pinned", True, id="h2d-pinned"),
                                    pytest.param(D2H, True, "pinned", id="d2h-pinned")]


@pytest.mark.parametrize("kind,src_device,dst_device", HOST_DEVICE_PINNED)
def test_cuda_host_device_is_one_batch_call_then_one_wait(stub, kind, src_device, dst_device):
    rt = loaded(stub)
    layout = Layout(rt, PIECE_SIZES + [0, 33], src_device, dst_device)
    assert stub.live_host_allocations() == ("pinned" in (src_device, dst_device))
    stub.reset_log()
    _core.execute(layout.plan(), rt, kind)
    layout.assert_copied()
    calls = stub.calls()
    assert [c.fn for c in calls if c.fn in CUDA_WAYS] == ["cudaMemcpyBatchAsync",
                                                          "cudaStreamSynchronize"]
    (batch,) = [c for c in calls if c.fn == "cudaMemcpyBatchAsync"]
    wanted = layout.nonempty()
    assert (batch.rc, batch.size, batch.kind) == (0, len(wanted), 1)  # kind: one attribute
    assert (batch.src, batch.dst) == wanted[0][:2]
    assert copies(calls) == wanted  # the batch's copies, zero-length ones left out
    assert "cuLaunchKernel" not in [c.fn for c in calls]
    assert stub.pending_copies() == 0


@pytest.mark.parametrize("kind,src_device,dst_device", HOST_DEVICE)
def test_cuda_12_0_has_no_batch_call_one_async_copy_per_descriptor(make_stub, kind, src_device,
                                                                   dst_device):
    stub = make_stub()
    stub.set_runtime_version(12000)
    rt = loaded(stub)
    assert rt.batched_copy  # the kernel still batches device-to-device lists
    layout = Layout(rt, PIECE_SIZES + [0, 33], src_device, dst_device)
    stub.reset_log()
    _core.execute(layout.plan(), rt, kind)
    layout.assert_copied()
    calls = stub.calls()
    wanted = layout.nonempty()
    assert [c.fn for c in calls if c.fn in CUDA_WAYS] == (["cudaMemcpyAsync"] * len(wanted)
                                                          + ["cudaStreamSynchronize"])
    assert copies(calls) == wanted
    assert all(c.kind == kind and c.rc == 0 for c in calls if c.fn == "cudaMemcpyAsync")
    # Device-to-device still takes the kernel.
    d2d = Layout(rt, [100, 200], seed=3)
    stub.reset_log()
    _core.execute(d2d.plan(), rt, D2D)
    d2d.assert_copied()
    assert "cuLaunchKernel" in stub.names() and "cudaMemcpyBatchAsync" not in stub.names()


@pytest.fixture
def no_driver(make_stub, monkeypatch):
    """The stub without the driver API; libcuda.so.1 (present on a GPU machine) must not be
    picked up instead."""
    monkeypatch.setenv("LLM_DATADIST_CUDA_DRIVER_LIBRARY", "/nonexistent/libcuda.so.1")
    return make_stub("no_driver")


def test_cuda_without_driver_has_no_ipc_and_d2d_goes_to_the_batch_call(no_driver):
    stub = no_driver
    rt = loaded(stub)
    assert (rt.async_copy, rt.batched_copy, rt.ipc) == (True, True, False)
    assert rt.capabilities == _core.RUNTIME_ASYNC_COPY | _core.RUNTIME_BATCHED_COPY
    layout = Layout(rt, PIECE_SIZES)
    stub.reset_log()
    _core.execute(layout.plan(), rt, D2D)
    layout.assert_copied()
    calls = stub.calls()
    assert [c.fn for c in calls if c.fn in CUDA_WAYS] == ["cudaMemcpyBatchAsync",
                                                          "cudaStreamSynchronize"]
    assert copies(calls) == layout.nonempty()
    with pytest.raises(LLMException) as info:
        rt.ipc_export(layout.src_base)
    assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED


def test_cuda_without_driver_and_batch_api_is_async_copies_only(make_stub, monkeypatch):
    monkeypatch.setenv("LLM_DATADIST_CUDA_DRIVER_LIBRARY", "/nonexistent/libcuda.so.1")
    stub = make_stub("no_driver")
    stub.set_runtime_version(12000)
    rt = loaded(stub)
    assert rt.capabilities == _core.RUNTIME_ASYNC_COPY
    layout = Layout(rt, [5, 0, 7])
    stub.reset_log()
    _core.execute(layout.plan(), rt, D2D)
    layout.assert_copied()
    assert [c.fn for c in stub.calls() if c.fn in CUDA_WAYS] == [
        "cudaMemcpyAsync", "cudaMemcpyAsync", "cudaStreamSynchronize"]


# ------------------------------------------------------------------------------------------------
# 3. wait=False: copies are queued until Runtime.synchronize(); wait=True leaves nothing queued
# ------------------------------------------------------------------------------------------------

WAIT_CASES = [pytest.param(D2D, True, True, id="d2d-kernel"),
              pytest.param(H2D, False, True, id="h2d-batch"),
              pytest.param(D2H, True, "pinned", id="d2h-batch-into-pinned-memory"),
              pytest.param(D2H, True, True, id="d2h-batch-into-device-memory")]


@pytest.mark.parametrize("kind,src_device,dst_device", WAIT_CASES)
def test_wait_false_leaves_old_bytes_until_synchronize(stub, kind, src_device, dst_device):
    rt = loaded(stub)
    warm_kernel(stub, rt)
    layout = Layout(rt, [PIECE + 3, 0, 9], src_device, dst_device)
    stub.reset_log()
    _core.execute(layout.plan(), rt, kind, wait=False)
    assert "cudaStreamSynchronize" not in stub.names()
    assert stub.pending_copies() == len(stub.calls("(queued copy)")) > 0
    layout.assert_untouched()
    rt.synchronize()
    assert stub.pending_copies() == 0
    layout.assert_copied()
    assert [c.fn for c in stub.calls()][-1] == "cudaStreamSynchronize"


@pytest.mark.parametrize("name", ["cuda", "acl"])
@pytest.mark.parametrize("kind", [H2D, D2H, D2D])
@pytest.mark.parametrize("sizes", [[1], PIECE_SIZES, [0] * 3 + [17] * 40])
def test_wait_true_never_leaves_pending_copies(stub, name, kind, sizes):
    rt = loaded(stub, name)
    layout = Layout(rt, sizes, src_device=kind != H2D, dst_device=kind != D2H)
    _core.execute(layout.plan(), rt, kind)
    assert stub.pending_copies() == 0
    layout.assert_copied()


def test_synchronize_is_a_no_op_for_the_host_runtime():
    rt = _core.load_runtime("host")
    assert not rt.async_copy
    rt.synchronize()
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    _core.execute(make_plan([(src.ctypes.data, dst.ctypes.data, 64)]), rt, H2D, wait=False)
    np.testing.assert_array_equal(dst, src)  # no async copies: wait=False waits


# ------------------------------------------------------------------------------------------------
# 4. Fallbacks and errors
# ------------------------------------------------------------------------------------------------

def test_refused_kernel_launch_falls_back_to_the_batch_call_for_good(stub):
    rt = loaded(stub)
    warm_kernel(stub, rt)
    layout = Layout(rt, PIECE_SIZES)
    stub.fail("cuLaunchKernel", CUDA_ERROR)
    _core.execute(layout.plan(), rt, D2D)
    layout.assert_copied()
    calls = stub.calls()
    assert [(c.fn, c.rc) for c in calls if c.fn in CUDA_WAYS] == [
        ("cudaMemcpyAsync", 0), ("cuLaunchKernel", CUDA_ERROR), ("cudaMemcpyBatchAsync", 0),
        ("cudaStreamSynchronize", 0)]
    assert copies(c for c in calls if c.fn == "(queued copy)") == layout.nonempty()
    assert stub.pending_copies() == 0
    # The kernel is not tried again: the next lists go straight to the batch call.
    for seed in (1, 2):
        again = Layout(rt, [PIECE + 5, 3], seed=seed)
        stub.reset_log()
        _core.execute(again.plan(), rt, D2D)
        again.assert_copied()
        assert [c.fn for c in stub.calls() if c.fn in CUDA_WAYS] == [
            "cudaMemcpyBatchAsync", "cudaStreamSynchronize"]


@pytest.mark.parametrize("kind,src_device,dst_device", HOST_DEVICE)
def test_refused_batch_call_falls_back_to_async_copies_for_good(stub, kind, src_device,
                                                                dst_device):
    rt = loaded(stub)
    layout = Layout(rt, [10, 0, PIECE, 3], src_device, dst_device)
    stub.fail("cudaMemcpyBatchAsync", CUDA_ERROR)
    _core.execute(layout.plan(), rt, kind)
    layout.assert_copied()
    calls = stub.calls()
    wanted = layout.nonempty()
    assert [(c.fn, c.rc) for c in calls if c.fn in CUDA_WAYS] == (
        [("cudaMemcpyBatchAsync", CUDA_ERROR)] + [("cudaMemcpyAsync", 0)] * len(wanted)
        + [("cudaStreamSynchronize", 0)])
    assert copies(calls) == wanted
    again = Layout(rt, [4, 5], src_device, dst_device, seed=2)
    stub.reset_log()
    _core.execute(again.plan(), rt, kind)
    again.assert_copied()
    assert [c.fn for c in stub.calls() if c.fn in CUDA_WAYS] == [
        "cudaMemcpyAsync", "cudaMemcpyAsync", "cudaStreamSynchronize"]


@pytest.mark.parametrize("wait", [True, False])
@pytest.mark.parametrize("kind,src_device,dst_device", HOST_DEVICE)
def test_failed_async_copy_names_runtime_kind_and_descriptor(make_stub, kind, src_device,
                                                             dst_device, wait):
    stub = make_stub()
    stub.set_runtime_version(12000)  # no batch call: one cudaMemcpyAsync per descriptor
    rt = loaded(stub)
    layout = Layout(rt, [5, 0, 7, 9, 11], src_device, dst_device)
    # The third async copy fails: descriptor 3 of the plan (descriptor 1 copies nothing).
    stub.fail("cudaMemcpyAsync", CUDA_ERROR, skip=2)
    with pytest.raises(LLMException) as info:
        _core.execute(layout.plan(), rt, kind, wait=wait)
    assert info.value.status_code == LLMStatusCode.LLM_FAILED
    assert info.value.args[0] == (f"cuda: {KIND_NAMES[kind]} copy failed with error {CUDA_ERROR} at "
                               f"descriptor 3 of 5")
    assert [(c.rc, c.size) for c in stub.calls("cudaMemcpyAsync")] == [(0, 5), (0, 7),
                                                                      (CUDA_ERROR, 9)]
    # The copies queued before the failure are done when the error is raised: nothing is left
    # on the stream to write the destination (or read the source) behind the caller's back.
    assert stub.pending_copies() == 0
    expected = layout.dst_before.copy()
    for src, dst, n in layout.descs[:3]:
        so, do = src - layout.src_base, dst - layout.dst_base
        expected[do:do + n] = layout.src_before[so:so + n]
    np.testing.assert_array_equal(layout.dst, expected)


@pytest.mark.parametrize("kind,src_device,dst_device", WAIT_CASES)
def test_failed_wait_raises_without_a_descriptor_index(stub, kind, src_device, dst_device):
    rt = loaded(stub)
    warm_kernel(stub, rt)
    layout = Layout(rt, [8, 0, 16], src_device, dst_device)
    stub.fail("cudaStreamSynchronize", CUDA_ERROR)
    with pytest.raises(LLMException) as info:
        _core.execute(layout.plan(), rt, kind)
    assert info.value.status_code == LLMStatusCode.LLM_FAILED
    message = info.value.args[0]
    assert message == (f"cuda: {KIND_NAMES[kind]} copy failed with error {CUDA_ERROR} "
                       f"(a list of 3 descriptors)")
    assert "at descriptor" not in message
    # The same error met by Runtime.synchronize after wait=False.
    stub.fail("cudaStreamSynchronize", CUDA_ERROR)
    _core.execute(layout.plan(), rt, kind, wait=False)
    with pytest.raises(LLMException) as info:
        rt.synchronize()
    assert info.value.status_code == LLMStatusCode.LLM_FAILED
    assert info.value.args[0] == f"cuda: waiting for queued copies failed with error {CUDA_ERROR}"
    # The stream works again afterwards.
    fresh = Layout(rt, [8, 0, 16], src_device, dst_device, seed=3)
    _core.execute(fresh.plan(), rt, kind)
    fresh.assert_copied()


def test_an_earlier_copy_error_met_growing_the_piece_buffer_is_reported_not_swallowed(stub):
    """The first list too big for the kernel's piece buffer waits for the stream before growing
    it; an error met there belongs to copies queued earlier: it is raised (not taken for a
    refusal of the kernel, which would be given up for good and the error lost)."""
    rt = loaded(stub)
    warm_kernel(stub, rt)
    earlier = Layout(rt, [20], seed=2)
    _core.execute(earlier.plan(), rt, D2D, wait=False)
    stub.reset_log()
    stub.fail("cudaStreamSynchronize", CUDA_ERROR)  # the queued copy fails
    big = Layout(rt, [PIECE * 40], seed=3)  # 40 pieces: more than the buffer holds
    with pytest.raises(LLMException) as info:
        _core.execute(big.plan(), rt, D2D)
    assert info.value.status_code == LLMStatusCode.LLM_FAILED
    assert info.value.args[0] == (f"cuda: device-to-device copy failed with error {CUDA_ERROR} "
                                  f"(a list of 1 descriptors)")
    assert [(c.fn, c.rc) for c in stub.calls() if c.fn in CUDA_WAYS] == [
        ("cudaStreamSynchronize", CUDA_ERROR), ("cudaStreamSynchronize", 0)]
    big.assert_untouched()
    # The kernel is still used: the same list goes through once retried.
    stub.reset_log()
    _core.execute(big.plan(), rt, D2D)
    big.assert_copied()
    assert [c.fn for c in stub.calls() if c.fn in CUDA_WAYS] == [
        "cudaStreamSynchronize", "cudaMemcpyAsync", "cuLaunchKernel", "cudaStreamSynchronize"]
    assert stub.pending_copies() == 0


def test_failed_acl_async_copy_names_descriptor_and_leaves_nothing_queued(stub):
    rt = loaded(stub, "acl")
    layout = Layout(rt, [5, 0, 7, 9])
    stub.fail("aclrtMemcpyAsync", 507011, skip=1)
    with pytest.raises(LLMException) as info:
        _core.execute(layout.plan(), rt, D2D)
    assert info.value.status_code == LLMStatusCode.LLM_FAILED
    assert info.value.args[0] == ("acl: device-to-device copy failed with error 507011 at "
                               "descriptor 2 of 4")
    assert stub.pending_copies() == 0


# ------------------------------------------------------------------------------------------------
# 5. ordered=True: one queued copy per descriptor, in list order on the device's one stream
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,copy,wait_fn", [("cuda", "cuLaunchKernel", "cudaStreamSynchronize"),
                                               ("acl", "aclrtMemcpyAsync", "aclrtSynchronizeStream")])
def test_ordered_chain_is_queued_one_descriptor_at_a_time_then_waited_for(stub, name, copy, wait_fn):
    """Not synchronous copies: on CUDA, cudaMemcpy returns before a device-to-device copy (or one
    from pageable memory) has completed, so the list would not be done when execute returns."""
    rt = loaded(stub, name)
    block = 4096
    alloc = _core.Allocation(rt, 4 * block, on_device=True)
    mem = view(alloc.addr, 4 * block)
    for b in range(4):
        mem[b * block:(b + 1) * block] = b + 1
    chain = [(alloc.addr + 1 * block, alloc.addr + 2 * block, block),
             (alloc.addr + 2 * block, alloc.addr + 3 * block, block)]
    stub.reset_log()
    _core.execute(make_plan(chain), rt, D2D, ordered=True)
    fns = [c.fn for c in stub.calls()]
    assert fns.count(copy) == len(chain)
    assert "cudaMemcpy" not in fns and "aclrtMemcpy" not in fns
    assert fns[-1] == wait_fn
    # Block 1 -> 2, then the new block 2 -> 3: block 3 holds block 1's bytes.
    assert [int(mem[b * block]) for b in range(4)] == [1, 2, 2, 2]
    assert all((mem[b * block:(b + 1) * block] == mem[b * block]).all() for b in range(4))
    assert stub.pending_copies() == 0


@pytest.mark.parametrize("name", ["cuda", "acl"])
def test_ordered_chain_without_wait_is_only_queued_and_in_order_once_waited_for(stub, name):
    rt = loaded(stub, name)
    block = 4096
    alloc = _core.Allocation(rt, 4 * block, on_device=True)
    mem = view(alloc.addr, 4 * block)
    for b in range(4):
        mem[b * block:(b + 1) * block] = b + 1
    chain = [(alloc.addr + 1 * block, alloc.addr + 2 * block, block),
             (alloc.addr + 2 * block, alloc.addr + 3 * block, block)]
    _core.execute(make_plan(chain[:1]), rt, D2D, ordered=True)  # the kernel is loaded, its buffer grown
    mem[2 * block:3 * block] = 3
    _core.execute(make_plan(chain), rt, D2D, wait=False, ordered=True)
    assert stub.pending_copies() > 0  # the last copy at least waits for the stream
    rt.synchronize()
    assert [int(mem[b * block]) for b in range(4)] == [1, 2, 2, 2]


_CHILD_ORDERED = textwrap.dedent("""
    import json, sys
    import numpy as np
    from llm_datadist import Cache, CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole, Placement
    from runtime_stub import StubRuntime

    stub = StubRuntime(sys.argv[1])
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.mem_pool_cfg = '{"memory_size": 10000000}'
    dd.init(config.generate_options())
    cm = dd.cache_manager
    desc = CacheDesc(2, [4, 8], DataType.DT_INT32, Placement.HOST)
    dev = cm.allocate_blocks_cache(CacheDesc(2, [4, 8], DataType.DT_INT32, Placement.DEVICE))
    h_in = [np.arange(32, dtype=np.int32).reshape(4, 8) + 100 * t for t in range(2)]
    cm.swap_blocks(Cache.create_cpu_cache(desc, h_in), dev, {b: b for b in range(4)})
    out = {}

    def step(name, info):
        stub.reset_log()
        cm.copy_blocks(dev, info)
        calls = [(c.fn, c.src, c.dst, c.size) for c in stub.calls()
                 if c.fn in ("cudaMemcpy", "cuLaunchKernel", "(queued copy)",
                             "cudaMemcpyBatchAsync")]
        h_out = [np.full((4, 8), -1, dtype=np.int32) for _ in range(2)]
        cm.swap_blocks(dev, Cache.create_cpu_cache(desc, h_out), {b: b for b in range(4)})
        out[name] = {"calls": calls, "blocks": [a[:, 0].tolist() for a in h_out]}

    step("intersecting", {1: [2], 2: [3]})
    step("disjoint", {0: [2, 3]})
    out["dev"] = list(dev.tensor_addrs)
    dd.finalize()
    print("RESULT " + json.dumps(out))
""")


def test_copy_blocks_in_one_cache_keeps_order_only_when_blocks_intersect(stub, tmp_path):
    """Through the public CacheManager API on the cuda stub: a copy list that reads blocks it also
    writes runs as one kernel launch per copy, in list order on the stream; disjoint block sets
    run as one kernel launch."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_DATADIST_")}
    env["LLM_DATADIST_DEVICE"] = "cuda"
    env["LLM_DATADIST_CUDA_LIBRARY"] = stub.path
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PACKAGE_ROOT), str(TESTS_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", _CHILD_ORDERED, stub.path], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line[len("RESULT "):])
    block = 8 * 4
    dev = result["dev"]
    ordered = result["intersecting"]
    assert [c[0] for c in ordered["calls"]] == ["cuLaunchKernel", "(queued copy)"] * 4
    assert [tuple(c[1:]) for c in ordered["calls"][1::2]] == [
        c for t in range(2) for c in ((dev[t] + block, dev[t] + 2 * block, block),
                                      (dev[t] + 2 * block, dev[t] + 3 * block, block))]
    # Sequential result: block 3 got the new block 2, which is block 1.
    assert ordered["blocks"] == [[100 * t + 8 * b for b in (0, 1, 1, 1)] for t in range(2)]
    parallel = result["disjoint"]
    assert [c[0] for c in parallel["calls"]] == ["cuLaunchKernel"] + ["(queued copy)"] * 4
    assert [tuple(c[1:]) for c in parallel["calls"][1:]] == [
        c for t in range(2) for c in ((dev[t], dev[t] + 2 * block, block),
                                      (dev[t], dev[t] + 3 * block, block))]
    assert parallel["blocks"] == [[100 * t + 8 * b for b in (0, 1, 0, 0)] for t in range(2)]


# ------------------------------------------------------------------------------------------------
# 6. Page-locked host memory and host registration
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,malloc_host,free_host", [("cuda", "cudaMallocHost", "cudaFreeHost"),
                                                        ("acl", "aclrtMallocHost", "aclrtFreeHost")])
@pytest.mark.parametrize("nbytes", [0, 1, 3 * 4096 + 5])
def test_pinned_allocation_comes_from_the_runtime_and_goes_back_to_it(stub, name, malloc_host,
                                                                      free_host, nbytes):
    rt = loaded(stub, name)
    assert rt.pinned_host
    alloc = _core.Allocation(rt, nbytes, on_device=False, pinned=True)
    assert alloc.pinned and alloc.host_addressable and not alloc.on_device
    addr = alloc.addr
    (call,) = stub.calls()
    assert (call.fn, call.rc, call.dst, call.size) == (malloc_host, 0, addr, max(nbytes, 1))
    assert stub.live_host_allocations() == 1
    assert not view(addr, nbytes).any()  # zero-filled, as plain host memory is
    view(addr, nbytes)[:] = 0xFF  # writable from the host
    assert "pinned host" in repr(alloc)
    stub.reset_log()
    del alloc
    gc.collect()
    (call,) = stub.calls()
    assert (call.fn, call.rc, call.dst) == (free_host, 0, addr)
    assert stub.live_host_allocations() == 0


def test_pinned_allocation_failure_is_out_of_memory(stub):
    rt = loaded(stub)
    stub.fail("cudaMallocHost", 2)
    with pytest.raises(LLMException, match="allocating 64 bytes failed") as info:
        _core.Allocation(rt, 64, on_device=False, pinned=True)
    assert info.value.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY
    assert stub.live_host_allocations() == 0


def test_pinned_is_plain_host_memory_where_the_runtime_has_none(stub):
    host = _core.load_runtime("host")
    assert not host.pinned_host
    alloc = _core.Allocation(host, 128, on_device=False, pinned=True)
    assert not alloc.pinned and alloc.host_addressable
    assert not view(alloc.addr, 128).any()
    # Device memory is never "pinned"; a host allocation without pinned=True is plain.
    rt = loaded(stub)
    device = _core.Allocation(rt, 64, on_device=True, pinned=True)
    assert not device.pinned and not device.host_addressable
    plain = _core.Allocation(rt, 64, on_device=False)
    assert not plain.pinned
    assert [c.fn for c in stub.calls()] == ["cudaMalloc"]


def test_host_register_is_portable_cuda_host_register(stub):
    rt = loaded(stub)
    buf = np.zeros(8192, dtype=np.uint8)
    addr = buf.ctypes.data
    assert rt.host_register(addr, 8192) is True
    (call,) = stub.calls()
    assert (call.fn, call.dst, call.size, call.kind, call.rc) == ("cudaHostRegister", addr, 8192,
                                                                   1, 0)
    assert stub.live_host_allocations() == 1
    # A second registration of the same range is refused by the runtime: False, no exception.
    assert rt.host_register(addr, 8192) is False
    assert stub.calls()[-1].rc == 712
    stub.reset_log()
    rt.host_unregister(addr)
    (call,) = stub.calls()
    assert (call.fn, call.dst, call.rc) == ("cudaHostUnregister", addr, 0)
    assert stub.live_host_allocations() == 0
    # An injected refusal, and nothing to register, answer False.
    stub.fail("cudaHostRegister", 1)
    assert rt.host_register(addr, 8192) is False
    stub.reset_log()
    assert rt.host_register(0, 8192) is False and rt.host_register(addr, 0) is False
    rt.host_unregister(0)
    assert stub.calls() == []
    assert stub.live_host_allocations() == 0


@pytest.mark.parametrize("name", ["acl", "host"])
def test_host_register_is_false_where_the_runtime_has_none(stub, name):
    rt = loaded(stub, name) if name == "acl" else _core.load_runtime("host")
    buf = np.zeros(64, dtype=np.uint8)
    assert rt.host_register(buf.ctypes.data, 64) is False
    rt.host_unregister(buf.ctypes.data)
    if name == "acl":
        assert stub.calls() == []


def test_registered_host_memory_is_read_when_the_queued_copy_runs(stub):
    """What registration changes on the stub (as on CUDA): a queued copy from page-locked memory
    reads it when it runs, so the source must stay untouched until the wait."""
    rt = loaded(stub)
    src = np.full(4096, 1, dtype=np.uint8)
    assert rt.host_register(src.ctypes.data, 4096)
    dst = _core.Allocation(rt, 4096, on_device=True)
    _core.execute(make_plan([(src.ctypes.data, dst.addr, 4096)]), rt, H2D, wait=False)
    src[:] = 2
    rt.synchronize()
    assert (view(dst.addr, 4096) == 2).all()
    rt.host_unregister(src.ctypes.data)
    # From pageable memory the bytes are taken when the copy is queued.
    _core.execute(make_plan([(src.ctypes.data, dst.addr, 4096)]), rt, H2D, wait=False)
    src[:] = 3
    rt.synchronize()
    assert (view(dst.addr, 4096) == 2).all()


# ------------------------------------------------------------------------------------------------
# 7. CUDA IPC
# ------------------------------------------------------------------------------------------------

def test_ipc_export_names_the_allocation_and_the_offset(stub):
    rt = loaded(stub)
    size = 3 * 4096 + 8
    alloc = _core.Allocation(rt, size, on_device=True)
    stub.reset_log()
    handle, offset, total = rt.ipc_export(alloc.addr + 1000)
    assert (len(handle), offset, total) == (64, 1000, size)
    # The stub's handle: magic, pid, the memfd, the size.
    magic, pid, _fd, hsize = struct.unpack_from("<8siiQ", handle)
    assert (magic, pid, hsize) == (b"DDSTUBIP", os.getpid(), size)
    calls = stub.calls()
    # cudaIpcGetMemHandle takes the allocation's base (the stub refuses an interior pointer, as
    # CUDA documents): the base is looked up first.
    assert [(c.fn, c.rc) for c in calls] == [("cuMemGetAddressRange_v2", 0),
                                             ("cudaIpcGetMemHandle", 0)]
    assert calls[0].src == alloc.addr + 1000
    assert (calls[0].dst, calls[0].size) == (alloc.addr, size)
    assert calls[1].src == alloc.addr
    assert rt.ipc_export(alloc.addr) == (handle, 0, size)
    assert rt.ipc_export(alloc.addr + size - 1) == (handle, size - 1, size)


def test_ipc_export_of_memory_the_runtime_did_not_allocate_fails(stub):
    rt = loaded(stub)
    buf = np.zeros(64, dtype=np.uint8)
    with pytest.raises(LLMException, match="exporting device memory at") as info:
        rt.ipc_export(buf.ctypes.data)
    assert info.value.status_code == LLMStatusCode.LLM_FAILED


def test_ipc_open_in_the_exporting_process_fails(stub):
    rt = loaded(stub)
    alloc = _core.Allocation(rt, 4096, on_device=True)
    handle, _, _ = rt.ipc_export(alloc.addr)
    with pytest.raises(LLMException, match="mapping a peer's device memory failed") as info:
        rt.ipc_open(handle)
    assert info.value.status_code == LLMStatusCode.LLM_FAILED
    assert rt.ipc_mapped == 0 and stub.live_mappings() == 0


@pytest.mark.parametrize("handle", [b"", b"x" * 63, b"x" * 65])
def test_ipc_open_refuses_a_handle_of_the_wrong_length(stub, handle):
    rt = loaded(stub)
    with pytest.raises(LLMException) as info:
        rt.ipc_open(handle)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert stub.calls() == []


@pytest.mark.parametrize("name", ["acl", "host"])
def test_ipc_is_not_enabled_without_the_runtime_support(stub, name):
    rt = loaded(stub, name) if name == "acl" else _core.load_runtime("host")
    assert not rt.ipc
    for call in (lambda: rt.ipc_export(0x1000), lambda: rt.ipc_open(b"\0" * 64)):
        with pytest.raises(LLMException) as info:
            call()
        assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    rt.ipc_close(0x1000)  # nothing mapped: a no-op
    assert rt.ipc_mapped == 0


_CHILD_IPC = textwrap.dedent("""
    import json, sys
    import numpy as np
    from llm_datadist import _core, _io
    from runtime_stub import StubRuntime
    import struct

    stub = StubRuntime(sys.argv[1])
    handle, offset, total = bytes.fromhex(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rt = _core.load_runtime("cuda", stub.path)
    rt.set_device(0)
    stub.reset_log()
    base = rt.ipc_open(handle)
    again = rt.ipc_open(handle)
    mapped = rt.ipc_mapped
    # Read what the parent wrote, then write our bytes after it, through the runtime's copies.
    seen = np.zeros(64, dtype=np.uint8)
    plan = _io.plan_from_wire(struct.pack("<QQQ", base + offset, seen.ctypes.data, 64))
    _core.execute(plan, rt, _core.MEMCPY_DEVICE_TO_HOST)
    mine = (np.arange(256) * 3 % 256).astype(np.uint8)
    plan = _io.plan_from_wire(struct.pack("<QQQ", mine.ctypes.data, base + offset + 64, 256))
    _core.execute(plan, rt, _core.MEMCPY_HOST_TO_DEVICE)
    rt.ipc_close(base)
    live_after_one_close = stub.live_mappings()
    rt.ipc_close(base)
    rt.ipc_close(base)  # not mapped any more: a no-op
    print("RESULT " + json.dumps({
        "base": base, "again": again, "mapped": mapped, "seen": seen.tolist(),
        "live_after_one_close": live_after_one_close, "live": stub.live_mappings(),
        "mapped_after": rt.ipc_mapped,
        "calls": [(c.fn, c.rc, c.dst, c.size) for c in stub.calls()
                  if c.fn.startswith("cudaIpc")]}))
""")


def test_ipc_handle_opened_by_another_process_shares_the_bytes(stub, tmp_path):
    rt = loaded(stub)
    size = 8192
    alloc = _core.Allocation(rt, size, on_device=True)
    mem = view(alloc.addr, size)
    mem[:] = 0xA5
    offset = 4096 + 8
    mem[offset:offset + 64] = np.arange(64, dtype=np.uint8)
    handle, got_offset, total = rt.ipc_export(alloc.addr + offset)
    assert (got_offset, total) == (offset, size)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_DATADIST_")}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PACKAGE_ROOT), str(TESTS_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", _CHILD_IPC, stub.path, handle.hex(), str(offset),
                           str(total)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line[len("RESULT "):])
    assert result["base"] == result["again"] and result["mapped"] == 1
    assert result["seen"] == list(range(64))
    # Opened once, closed once, after two opens and three closes.
    assert [(fn, rc) for fn, rc, _, _ in result["calls"]] == [("cudaIpcOpenMemHandle", 0),
                                                              ("cudaIpcCloseMemHandle", 0)]
    opened, closed = result["calls"]
    assert opened[2] == closed[2] == result["base"] and opened[3] == size
    assert result["live_after_one_close"] == 1
    assert result["live"] == 0 and result["mapped_after"] == 0
    # The child's bytes are in our allocation; nothing else changed.
    expected = np.full(size, 0xA5, dtype=np.uint8)
    expected[offset:offset + 64] = np.arange(64, dtype=np.uint8)
    expected[offset + 64:offset + 320] = (np.arange(256) * 3 % 256).astype(np.uint8)
    np.testing.assert_array_equal(mem, expected)


# ------------------------------------------------------------------------------------------------
# 8. ACL: aclrtMemcpyAsync device-to-device; host<->device synchronous after a stream wait
# ------------------------------------------------------------------------------------------------

def test_acl_d2d_is_async_copies_then_one_stream_wait(stub):
    rt = loaded(stub, "acl")
    assert (rt.async_copy, rt.batched_copy, rt.ipc) == (True, False, False)
    layout = Layout(rt, [0, 1, PIECE + 1, 0, 33])
    stub.reset_log()
    _core.execute(layout.plan(), rt, D2D)
    layout.assert_copied()
    calls = stub.calls()
    wanted = layout.nonempty()
    assert [c.fn for c in calls if c.fn in ACL_WAYS] == (["aclrtMemcpyAsync"] * len(wanted)
                                                         + ["aclrtSynchronizeStream"])
    asyncs = stub.calls("aclrtMemcpyAsync")
    assert [(c.src, c.dst, c.size) for c in asyncs] == wanted
    assert all(c.dest_max == c.size and c.kind == D2D and c.rc == 0 for c in asyncs)
    (wait,) = stub.calls("aclrtSynchronizeStream")
    assert wait.size == len(wanted)  # the stream held every copy when it was waited for
    # wait=False: queued until synchronize.
    layout2 = Layout(rt, [7, 9], seed=4)
    stub.reset_log()
    _core.execute(layout2.plan(), rt, D2D, wait=False)
    assert stub.pending_copies() == 2
    layout2.assert_untouched()
    rt.synchronize()
    layout2.assert_copied()
    assert stub.names()[-1] == "aclrtSynchronizeStream" and stub.pending_copies() == 0


@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("kind,src_device,dst_device", HOST_DEVICE)
def test_acl_host_device_is_synchronous_copies_after_a_stream_wait(stub, kind, src_device,
                                                                   dst_device, pinned):
    """ACL refuses aclrtMemcpyAsync with host memory not from aclrtMallocHost: the binding never
    asks, for user memory or page-locked memory alike, and orders after queued device copies."""
    rt = loaded(stub, "acl")
    # A device copy queued first must land before the host<->device copies run.
    queued = Layout(rt, [16], seed=9)
    _core.execute(queued.plan(), rt, D2D, wait=False)
    if pinned:  # the host side in aclrtMallocHost memory instead of a numpy buffer
        src_device, dst_device = src_device or "pinned", dst_device or "pinned"
    layout = Layout(rt, [3, 0, PIECE, 5], src_device, dst_device)
    assert len(stub.calls("aclrtMallocHost")) == pinned
    stub.reset_log()
    _core.execute(layout.plan(), rt, kind)
    layout.assert_copied()
    queued.assert_copied()
    calls = stub.calls()
    wanted = layout.nonempty()
    assert [c.fn for c in calls if c.fn in ACL_WAYS] == (
        ["aclrtSynchronizeStream"] + ["aclrtMemcpy"] * len(wanted) + ["aclrtSynchronizeStream"])
    assert stub.calls("aclrtSynchronizeStream")[0].size == 1  # it waited for the queued copy
    memcpys = stub.calls("aclrtMemcpy")
    assert [(c.src, c.dst, c.size) for c in memcpys] == wanted
    assert all(c.dest_max == c.size and c.kind == kind and c.rc == 0 for c in memcpys)
    assert stub.calls("aclrtMemcpyAsync") == []
    assert all(c.rc == 0 for c in calls)


# ------------------------------------------------------------------------------------------------
# 9. stage_plan and translate_plan
# ------------------------------------------------------------------------------------------------

HOST = _core.load_runtime("host")
ARENA = 4096  # bytes of the source and of the destination buffer of a random plan


@st.composite
def plans_and_chunks(draw):
    """Random descriptors (src offset, dst offset, nbytes) inside two ARENA-byte buffers and a
    random cut of the plan's byte stream into consecutive chunks."""
    descs = []
    for _ in range(draw(st.integers(0, 12))):
        n = draw(st.sampled_from([0, 1, 2, 7, 64, 100, 255, 512]))
        descs.append((draw(st.integers(0, ARENA - n)), draw(st.integers(0, ARENA - n)), n))
    total = sum(n for _, _, n in descs)
    cuts = sorted(set(draw(st.lists(st.integers(0, total), max_size=8))) | {0, total})
    return descs, list(zip(cuts[:-1], cuts[1:])) or [(0, 0)], draw(st.integers(0, 2**32))


@PROPERTY
@given(plans_and_chunks())
def test_staged_chunks_reproduce_the_plan(case):
    descs, chunks, seed = case
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, ARENA, dtype=np.uint8)
    start_dst = rng.integers(0, 256, ARENA, dtype=np.uint8)
    s0 = src.ctypes.data
    src_before = src.copy()
    direct, staged = start_dst.copy(), start_dst.copy()
    plan = make_plan([(s0 + s, direct.ctypes.data + d, n) for s, d, n in descs])
    _core.execute(plan, HOST, H2H)
    d0 = staged.ctypes.data
    plan = make_plan([(s0 + s, d0 + d, n) for s, d, n in descs])
    stream = np.concatenate([src[s:s + n] for s, _, n in descs] or [np.zeros(0, np.uint8)])
    bounce = np.full(ARENA * 12 + 1, 0xEE, dtype=np.uint8)
    b0 = bounce.ctypes.data
    for start, end in chunks:
        n = end - start
        out = _core.stage_plan(plan, start, n, b0, True)
        back = _core.stage_plan(plan, start, n, b0, False)
        assert out.total_bytes == back.total_bytes == n
        # The bounce side is contiguous from the bounce buffer's start, in stream order.
        for staged_plan, side in ((out, 1), (back, 0)):
            pos = b0
            for row in plan_descs(staged_plan):
                assert row[side] == pos
                pos += row[2]
            assert pos == b0 + n
        _core.execute(out, HOST, H2H)
        np.testing.assert_array_equal(bounce[:n], stream[start:end])
        _core.execute(back, HOST, H2H)
    np.testing.assert_array_equal(staged, direct)
    np.testing.assert_array_equal(src, src_before)


@PROPERTY
@given(st.lists(st.integers(0, 300), max_size=5), st.integers(0, 2**64 - 1),
       st.integers(0, 2**64 - 1), st.booleans())
def test_stage_plan_refuses_bytes_outside_the_plan(sizes, start, nbytes, to_bounce):
    plan = make_plan([(0x10000 + 1000 * k, 0x900000 + 1000 * k, n) for k, n in enumerate(sizes)])
    total = sum(sizes)
    if start + nbytes <= total:
        assert _core.stage_plan(plan, start, nbytes, 0x5000000, to_bounce).total_bytes == nbytes
        return
    with pytest.raises(LLMException, match=r"are not inside a plan of") as info:
        _core.stage_plan(plan, start, nbytes, 0x5000000, to_bounce)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


@pytest.mark.parametrize("start,nbytes", [(0, 11), (11, 0), (1, 10), (12, 0), (2**64 - 1, 1),
                                          (1, 2**64 - 1), (2**64 - 1, 0)])
def test_stage_plan_edges(start, nbytes):
    plan = make_plan([(0x1000, 0x9000, 4), (0x2000, 0xA000, 0), (0x3000, 0xB000, 7)])
    if start + nbytes <= 11:
        staged = _core.stage_plan(plan, start, nbytes, 0x50000, True)
        assert staged.total_bytes == nbytes
        return
    with pytest.raises(LLMException) as info:
        _core.stage_plan(plan, start, nbytes, 0x50000, True)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


@st.composite
def spans_and_descriptors(draw):
    """Non-overlapping peer spans (some adjacent, some with gaps) with random local starts, and
    descriptors of which some lie inside a span and some not. Each descriptor's other side is far
    apart from the others', so translated descriptors never merge."""
    spans, at = [], draw(st.integers(0x1000, 0x100000))
    for _ in range(draw(st.integers(1, 6))):
        at += draw(st.sampled_from([0, 0, 1, 64, 4096]))  # adjacent or a gap
        size = draw(st.integers(1, 5000))
        spans.append((at, size, draw(st.integers(0x10_0000_0000, 0x20_0000_0000))))
        at += size
    descs = []
    for i in range(draw(st.integers(0, 10))):
        how = draw(st.sampled_from(["inside", "inside", "inside", "cross", "below", "gap", "above"]))
        peer, size, _ = spans[draw(st.integers(0, len(spans) - 1))]
        if how == "inside":
            off = draw(st.integers(0, size - 1))
            n = draw(st.integers(1, size - off))
            addr = peer + off
        elif how == "cross":  # starts inside, ends past the span's end
            off = draw(st.integers(0, size - 1))
            addr, n = peer + off, size - off + draw(st.integers(1, 100))
        elif how == "below":
            n = draw(st.integers(1, 100))
            addr = spans[0][0] - draw(st.integers(1, 100)) - n + draw(st.integers(0, n - 1))
        elif how == "gap":
            addr, n = peer + size, draw(st.integers(1, 100))
        else:
            addr, n = spans[-1][0] + spans[-1][1] + draw(st.integers(0, 100)), draw(st.integers(1, 9))
        descs.append((addr, 0x7000_0000_0000 + i * 0x100_0000, n))
    return spans, descs, draw(st.booleans()), draw(st.randoms(use_true_random=False))


def _inside(spans, addr, n):
    """The span that holds [addr, addr + n) wholly, or None."""
    for peer, size, local in spans:
        if peer <= addr and addr + n <= peer + size:
            return peer, size, local
    return None


@PROPERTY
@given(spans_and_descriptors())
def test_translate_plan_moves_one_side_by_its_span_or_names_the_bad_descriptor(case):
    spans, descs, dst_side, rnd = case
    shuffled = list(spans)
    rnd.shuffle(shuffled)  # spans may come in any order
    # The peer side is dst (dst_side) or src; the other side stays as it is.
    plan_rows = [(o, a, n) if dst_side else (a, o, n) for a, o, n in descs]
    plan = make_plan(plan_rows)
    bad = [i for i, (a, _, n) in enumerate(descs) if _inside(spans, a, n) is None]
    if bad:
        with pytest.raises(LLMException, match=rf"^descriptor {bad[0]} \(") as info:
            _core.translate_plan(plan, dst_side, shuffled)
        assert info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        return
    out = _core.translate_plan(plan, dst_side, shuffled)
    expected = []
    for (a, o, n) in descs:
        peer, _, local = _inside(spans, a, n)
        moved = local + (a - peer)
        expected.append((o, moved, n) if dst_side else (moved, o, n))
    assert plan_descs(out) == expected
    assert out.total_bytes == plan.total_bytes
    assert plan_descs(plan) == plan_rows  # the input plan is not changed


def test_translate_plan_span_edges():
    spans = [(0x1000, 0x100, 0xA000), (0x1100, 0x100, 0xB000), (0x1300, 0x10, 0xC000)]
    ok = make_plan([(0x50, 0x1000, 0x100), (0x60, 0x1100, 1), (0x70, 0x11FF, 1),
                    (0x80, 0x1300, 0x10)])
    assert plan_descs(_core.translate_plan(ok, True, spans[::-1])) == [
        (0x50, 0xA000, 0x100), (0x60, 0xB000, 1), (0x70, 0xB0FF, 1), (0x80, 0xC000, 0x10)]
    # Source side: the destinations stay.
    src_side = make_plan([(0x1100, 0x50, 4)])
    assert plan_descs(_core.translate_plan(src_side, False, spans)) == [(0xB000, 0x50, 4)]
    for desc in ((0x50, 0x10FF, 2),  # crosses into the adjacent span
                 (0x50, 0x11FF, 2),  # runs into the gap
                 (0x50, 0x1200, 1),  # in the gap
                 (0x50, 0x0FFF, 1),  # below the first span
                 (0x50, 0x1310, 1)):  # past the last span
        plan = make_plan([desc])
        with pytest.raises(LLMException, match=r"^descriptor 0 ") as info:
            _core.translate_plan(plan, True, spans)
        assert info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    plan = make_plan([(0x40, 0x1000, 1), (0x41, 0x1001, 1), (0x50, 0x1200, 1)])
    with pytest.raises(LLMException, match=r"^descriptor 2 \(1 bytes at 0x1200\)"):
        _core.translate_plan(plan, True, spans)
    with pytest.raises(LLMException, match=r"^descriptor 0 "):
        _core.translate_plan(plan, True, [])


# ------------------------------------------------------------------------------------------------
# 10. Threads
# ------------------------------------------------------------------------------------------------

def test_concurrent_device_copies_on_one_runtime(stub):
    """Four threads copy device to device on the same runtime (one stream per device, the
    binding's lock around queueing, the kernel's piece buffer shared) and check every result."""
    rt = loaded(stub)
    iterations = 200
    errors = []
    start = threading.Barrier(4)

    def worker(seed):
        try:
            rt.set_device(0)
            rng = np.random.default_rng(seed)
            layout = Layout(rt, [0, 100, PIECE + 7, 3000][seed % 4:] + [17 * seed + 1], seed=seed)
            plan = layout.plan()
            start.wait()
            for it in range(iterations):
                layout.src[:] = rng.integers(0, 256, len(layout.src), dtype=np.uint8)
                layout.src_before = layout.src.copy()
                _core.execute(plan, rt, D2D, wait=bool(it % 3))
                if not it % 3:
                    rt.synchronize()
                layout.assert_copied()
        except BaseException as exc:  # reported by the main thread
            errors.append(f"thread {seed}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert stub.pending_copies() == 0
