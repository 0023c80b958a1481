"""vLLM's per-layer KV views on the GPU: built as vLLM 0.32 builds them, registered through the
connector's registration code, copied in place, pushed and pulled between two processes over
``cuda_ipc``, every byte compared with a reference computed with torch.

The views: one backing buffer (``torch.zeros(size, dtype=int8, device="cuda:0")``, as vLLM's
``allocate_kv_cache``), one ``as_strided`` 5-D view ``[L, B, H, N, C bytes]`` strided as the
layout says, one per-layer view of the KV dtype each (``create_kv_cache_views``): ``LBHNC``
without and with a kernel-block split (2 and 4 kernel blocks per block), MLA (one head) under
``LBNHC`` without and with a split, and ``LBNHC`` with several heads, which the connector refuses in
one line. ``kv_views`` below computes those strides itself, because the GPU machine has torch but
no vLLM; ``test_kv_views_are_vllms`` proves them equal to vLLM's own wherever vLLM is installed
(CI). Registration: ``caches.plan``, ``layout.cache_desc``, ``layout.check_device`` and
``register_blocks_cache(..., True)`` by address, what ``Worker.register`` does for a model of one
KV cache group (those modules need torch only: they are loaded without the package's vLLM
import, ``connector_modules``).

Where: a real GPU (torch with CUDA, the cuda runtime found as the package finds it), or the stub
library posing as the GPU under ``tools/gpu_check.py --stub`` (``gpu_runtime.py``): there the
buffer is stub device memory (host memory the library reads only through the runtime's copies),
seen by torch as a CPU tensor that says it is on ``cuda:0``. That proves the test and the
registration path; the GPU run proves them on real device memory.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
import types
from importlib.util import find_spec

import numpy as np
import optional_deps
import pytest
from gpu_runtime import cuda_runtime, on_stub

import llm_datadist as ld

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE = 3, 8, 16
PREFILL_ID, DECODE_ID, MODEL_ID = 61, 62, 0
SECRET = "gpu-vllm-views-link-secret"  # cuda_ipc hands GPU memory only to a peer on a link with a secret
#: (layout, kernel block size, MLA): registered and moved block for block.
#: (Several heads under LBNHC are registered as the token-major blocks they hold and move as whole
#: blocks between engines of that layout: integrations/vllm/kv_layouts.py.)
REGISTERED = [("LBHNC", None, False), ("LBHNC", 8, False), ("LBHNC", 4, False), ("LBNHC", None, True),
              ("LBNHC", 8, True), ("LBNHC", None, False), ("LBNHC", 8, False)]
#: Physical order of the logical axes [L, B, H, N, C] (vLLM's KVCacheLayout values).
STRIDE_ORDER = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4)}
COPIES = {0: [2], 3: [5]}  # local copy_blocks: block -> blocks
PUSHED = ([1, 4], [0, 3])  # decode's blocks -> prefill's
PULLED = ([2, 6], [1, 7])  # prefill's blocks -> decode's


class Geometry:
    """A layer's KV as vLLM 0.32 describes it: ``FullAttentionSpec(block_size 16, 4 KV heads,
    head size 64, fp16)`` (K and V side by side: 256 content bytes per head and token), or MLA's
    one latent head of 576 fp16 values."""

    def __init__(self, mla: bool) -> None:
        self.heads = 1 if mla else 4
        self.content_bytes = 576 * 2 if mla else 2 * 64 * 2
        self.page_bytes = BLOCK_SIZE * self.heads * self.content_bytes
        self.nbytes = NUM_LAYERS * NUM_BLOCKS * self.page_bytes


def kv_views(raw, geometry: Geometry, layout_name: str, kernel_block_size=None) -> dict:
    """``{layer name: view}`` as ``create_kv_cache_views`` makes them from the flat int8 buffer
    ``raw`` (one KV cache tensor holding every layer, offset 0): the 5-D ``[L, B*k, H, N/k, C]``
    byte view with dense strides in the layout's physical order, then each layer's as fp16."""
    import torch
    split = 1 if kernel_block_size is None else BLOCK_SIZE // kernel_block_size
    shape = (NUM_LAYERS, NUM_BLOCKS * split, geometry.heads, BLOCK_SIZE // split, geometry.content_bytes)
    strides = [0] * 5
    step = 1
    for dim in reversed(STRIDE_ORDER[layout_name]):
        strides[dim] = step
        step *= shape[dim]
    view = torch.as_strided(raw, shape, strides, raw.storage_offset())
    return {f"model.layers.{i}.self_attn.attn": view[i].view(torch.float16) for i in range(NUM_LAYERS)}


def blocks_of(view) -> list:
    """One uint8 numpy row per vLLM block (kernel blocks of a block grouped, as vLLM's
    ``group_kernel_blocks``), copied to the host by torch."""
    import torch
    grouped = view if view.shape[0] == NUM_BLOCKS else view.unflatten(0, (NUM_BLOCKS, -1))
    if grouped.is_cuda:
        torch.cuda.synchronize()
    return [grouped[b].contiguous().view(torch.uint8).flatten().cpu().numpy().copy() for b in range(NUM_BLOCKS)]


def connector_modules():
    """The connector's ``layout`` and ``caches`` modules (torch and llm_datadist are all they
    import). Unless the connector is loaded already, they are loaded under a bare package module
    that skips the package's ``__init__`` (its vLLM import: the GPU machine has no vLLM, and
    loading vLLM costs each process seconds), which leaves ``sys.modules`` again afterwards."""
    name = "llm_datadist.integrations.vllm"
    if name in sys.modules:
        return importlib.import_module(name + ".layout"), importlib.import_module(name + ".caches")
    import llm_datadist.integrations
    package = types.ModuleType(name)
    package.__path__ = [os.path.join(os.path.dirname(llm_datadist.integrations.__file__), "vllm")]
    sys.modules[name] = package
    try:
        return importlib.import_module(name + ".layout"), importlib.import_module(name + ".caches")
    finally:
        del sys.modules[name]  # a later import of the connector runs its __init__ (finding these two)


_STUB_TENSOR = []


def device_buffer(runtime, nbytes: int, keep: list):
    """The backing buffer: vLLM's ``torch.zeros(size, dtype=int8, device)`` on the GPU; on the
    stub, stub device memory of the runtime, zeroed, as a CPU tensor whose ``device`` says
    ``cuda:0`` (views of it say so too)."""
    import torch
    if not on_stub():
        return torch.zeros(nbytes, dtype=torch.int8, device="cuda:0")
    from llm_datadist import _core
    if not _STUB_TENSOR:
        class StubCudaTensor(torch.Tensor):
            @property
            def device(self):
                return torch.device("cuda:0")
        _STUB_TENSOR.append(StubCudaTensor)
    memory = _core.Allocation(runtime, nbytes, True)
    keep.append(memory)
    host = torch.frombuffer((ctypes.c_int8 * nbytes).from_address(memory.addr), dtype=torch.int8)
    host.zero_()
    return _STUB_TENSOR[0]._make_subclass(_STUB_TENSOR[0], host)


def register_views(dd, kv: dict, layout_name: str, cluster_id: int):
    """What ``Worker.register`` does with one KV cache group's views: its caches (one here), the
    device check, the registration by address under ``(cluster_id, MODEL_ID)``."""
    layout, caches = connector_modules()
    [cls] = caches.plan(kv, [], NUM_BLOCKS, layout_name)
    desc = layout.cache_desc(cls.tensors)
    assert desc.placement == ld.Placement.DEVICE
    layout.check_device(dd, cls.tensors[0].device, 0)
    return dd.cache_manager.register_blocks_cache(desc, [t.data_ptr() for t in cls.tensors],
                                                  ld.BlocksCacheKey(cluster_id, MODEL_ID), True)


def fill(kv: dict, seed: int) -> None:
    """Seeded bytes in every layer's view, written by torch."""
    import torch
    generator = torch.Generator().manual_seed(seed)
    for view in kv.values():
        raw = view.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, tuple(raw.shape), dtype=torch.uint8, generator=generator))
    if not on_stub():
        torch.cuda.synchronize()


# -- the prefill engine's process ------------------------------------------------------------------

def prefill_views(state, layout_name: str, kernel_block_size, mla: bool, seed: int) -> dict:
    """vLLM's views with seeded bytes, registered in place of the previous case's; returns each
    layer's blocks."""
    if "kv" in state.caches:
        state.cm.unregister_cache(state.caches.pop("kv").cache_id)
    state.scratch.clear()
    runtime = state.dd.engine.runtime
    runtime.set_device(0)
    keep: list = []
    geometry = Geometry(mla)
    kv = kv_views(device_buffer(runtime, geometry.nbytes, keep), geometry, layout_name, kernel_block_size)
    fill(kv, seed)
    state.caches["kv"] = register_views(state.dd, kv, layout_name, state.cluster_id)
    state.scratch.update(kv=kv, keep=keep)  # alive while registered
    return {name: blocks_of(view) for name, view in kv.items()}


def prefill_blocks(state) -> dict:
    return {name: blocks_of(view) for name, view in state.scratch["kv"].items()}


# -- the tests --------------------------------------------------------------------------------------

RUNTIME, WHY_NOT = cuda_runtime()
needs_gpu = pytest.mark.skipif(RUNTIME is None, reason=WHY_NOT or "no GPU")


@pytest.fixture(scope="module")
def torch_on_device():
    torch = optional_deps.importorskip("torch")
    if not on_stub() and not torch.cuda.is_available():
        pytest.fail(f"the cuda runtime reports a GPU ({RUNTIME.library}) but torch {torch.__version__} has no "
                    f"CUDA: install torch for this CUDA")
    return torch


@pytest.fixture(scope="module")
def engines(torch_on_device):
    """The prefill engine (a cluster process, listening) and the decode engine (this process),
    linked with a secret, both on the cuda runtime."""
    from llm_datadist.testing import Cluster
    saved = os.environ.get("LLM_DATADIST_DEVICE")
    os.environ["LLM_DATADIST_DEVICE"] = "cuda"  # this process's engine, and the cluster's
    options = {"llm.LinkSecret": SECRET}
    try:
        with Cluster(PREFILL_ID, role="PROMPT", listen=True, options=dict(options), timeout=180) as prefill:
            dd = ld.LLMDataDist(ld.LLMRole.DECODER, DECODE_ID)
            config = ld.LLMConfig()
            config.device_id = 0
            config.enable_cache_manager = True
            config.enable_remote_cache_accessible = True  # as the cluster's (llm_datadist.testing)
            dd.init({**config.generate_options(), **options})
            try:
                info = ld.LLMClusterInfo()
                info.remote_cluster_id = PREFILL_ID
                info.append_local_ip_info("127.0.0.1", 0)
                info.append_remote_ip_info(*prefill.address)
                _, rets = dd.link_clusters([info], 10000)
                assert rets[0] == ld.LLMStatusCode.LLM_SUCCESS, rets
                yield prefill, dd
            finally:
                dd.finalize()
    finally:
        if saved is None:
            os.environ.pop("LLM_DATADIST_DEVICE", None)
        else:
            os.environ["LLM_DATADIST_DEVICE"] = saved


@needs_gpu
@pytest.mark.parametrize("layout_name, kernel_block_size, mla", REGISTERED)
def test_vllm_views_copy_push_and_pull_byte_exact(engines, layout_name, kernel_block_size, mla):
    prefill, dd = engines
    keep: list = []
    geometry = Geometry(mla)
    remote = prefill.call(prefill_views, layout_name, kernel_block_size, mla, 11)
    kv = kv_views(device_buffer(RUNTIME, geometry.nbytes, keep), geometry, layout_name, kernel_block_size)
    split = 1 if kernel_block_size is None else BLOCK_SIZE // kernel_block_size
    assert all(view.shape[0] == NUM_BLOCKS * split and view.device.type == "cuda" for view in kv.values())
    fill(kv, 12)
    want = {name: blocks_of(view) for name, view in kv.items()}
    cache = register_views(dd, kv, layout_name, DECODE_ID)
    try:
        assert cache.tensor_addrs == [view.data_ptr() for view in kv.values()]  # in place, no copy
        assert dd.engine.data_plane(PREFILL_ID, 5000, True, True) == "cuda_ipc"
        dd.cache_manager.copy_blocks(cache, COPIES)
        for rows in want.values():
            for src, dsts in COPIES.items():
                for dst in dsts:
                    rows[dst] = rows[src].copy()
        got = {name: blocks_of(view) for name, view in kv.items()}
        for name in kv:
            for b in range(NUM_BLOCKS):
                assert np.array_equal(got[name][b], want[name][b]), ("copy_blocks", name, b)
        key = ld.BlocksCacheKey(PREFILL_ID, MODEL_ID)
        dd.cache_manager.push_blocks(key, cache, *PUSHED)
        dd.cache_manager.pull_blocks(key, cache, *PULLED)
        for name in kv:
            for src, dst in zip(*PUSHED):
                remote[name][dst] = want[name][src]
            for src, dst in zip(*PULLED):
                want[name][dst] = remote[name][src]
        got, got_remote = {name: blocks_of(view) for name, view in kv.items()}, prefill.call(prefill_blocks)
        for name in kv:
            for b in range(NUM_BLOCKS):
                assert np.array_equal(got[name][b], want[name][b]), ("pull", name, b)
                assert np.array_equal(got_remote[name][b], remote[name][b]), ("push", name, b)
    finally:
        dd.cache_manager.unregister_cache(cache.cache_id)


@pytest.mark.parametrize("layout_name, kernel_block_size, mla", REGISTERED)
def test_kv_views_are_vllms(layout_name, kernel_block_size, mla):
    """``kv_views`` against vLLM 0.32's ``create_kv_cache_views`` over the same buffer: shapes,
    strides, offsets and dtypes equal. Needs vLLM, no GPU."""
    if find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install '.[vllm]'): kv_views is checked against it in CI")
    import torch
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor, MLAAttentionSpec,
                                            compute_layout_strides, create_kv_cache_views)
    from vllm.v1.kv_cache_layout import KVCacheLayout

    geometry = Geometry(mla)
    if mla:
        spec = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=576, dtype=torch.float16)
    else:
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=4, head_size=64, dtype=torch.float16)
    assert spec.page_size_bytes == geometry.page_bytes
    layout = KVCacheLayout[layout_name]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, NUM_LAYERS, layout)
    tensor = KVCacheTensor(size=geometry.nbytes, layers=names, layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(geometry.nbytes, dtype=torch.int8)
    theirs = create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor, kernel_block_size=kernel_block_size)
    ours = kv_views(raw, geometry, layout_name, kernel_block_size)
    assert list(ours) == names
    for mine, vllms in zip(ours.values(), theirs):
        assert (mine.shape, mine.stride(), mine.storage_offset(), mine.dtype) == \
            (vllms.shape, vllms.stride(), vllms.storage_offset(), vllms.dtype)
