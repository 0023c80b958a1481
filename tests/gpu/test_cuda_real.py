"""The cuda paths on a real NVIDIA GPU: the copy kernel, batch copies, page-locked memory, IPC
between processes, the cuda_ipc and staging planes through the public API.

These run only where the cuda runtime (``libcudart.so``, or ``LLM_DATADIST_CUDA_LIBRARY``) loads
and reports a GPU, or against the stub library where ``tools/gpu_check.py --stub`` asks for it
(``gpu_runtime.py``); elsewhere every test skips, saying why. The same paths are covered on every
machine against the stub runtime (tests/core/test_device_copies.py, tests/transport/); here they
meet the real driver. Device memory is only ever read back through the runtime's copies.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import optional_deps
import pytest
from gpu_runtime import cuda_runtime

import llm_datadist as ld
from llm_datadist import _core
from llm_datadist.status import LLMStatusCode
from llm_datadist.testing import Cluster

H2D, D2H, D2D = _core.MEMCPY_HOST_TO_DEVICE, _core.MEMCPY_DEVICE_TO_HOST, _core.MEMCPY_DEVICE_TO_DEVICE

RUNTIME, WHY_NOT = cuda_runtime()
pytestmark = pytest.mark.skipif(RUNTIME is None, reason=WHY_NOT or "no GPU")


@pytest.fixture
def rt():
    RUNTIME.set_device(0)
    return RUNTIME


def _from(triples):
    from llm_datadist import _io
    return _io.plan_from_wire(np.array(triples, dtype="<u8").reshape(-1, 3).tobytes())


def _upload(rt, data: np.ndarray):
    mem = _core.Allocation(rt, data.nbytes, True)
    rt.memcpy(mem.addr, data.ctypes.data, data.nbytes, H2D)
    return mem


def _download(rt, mem, nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, np.uint8)
    rt.memcpy(out.ctypes.data, mem.addr, nbytes, D2H)
    return out


def _random_descriptors(rng, size: int, count: int):
    """Non-overlapping destination ranges with random alignments and lengths, inside ``size``."""
    triples, cursor = [], 0
    for _ in range(count):
        cursor += int(rng.integers(0, 64))
        n = int(rng.choice([0, 1, 3, 15, 16, 17, 4096, 16384, 65536 + 5, 300_000]))
        if cursor + n > size:
            break
        src = int(rng.integers(0, size - n + 1))
        triples.append((src, cursor, n))
        cursor += n
    return triples


def test_the_runtime_has_the_batched_paths(rt):
    assert rt.async_copy and rt.batched_copy, "neither the copy kernel nor cudaMemcpyBatchAsync is usable"
    assert not rt.host_addressable


@pytest.mark.parametrize("seed", range(4))
def test_device_to_device_lists_copy_every_byte_and_nothing_else(rt, seed):
    rng = np.random.default_rng(seed)
    size = 8 << 20
    src_host = rng.integers(0, 256, size, dtype=np.uint8)
    dst_host = rng.integers(0, 256, size, dtype=np.uint8)
    src, dst = _upload(rt, src_host), _upload(rt, dst_host)
    triples = _random_descriptors(rng, size, 400)
    plan = _from([(src.addr + s, dst.addr + d, n) for s, d, n in triples])
    _core.execute(plan, rt, D2D)
    want = dst_host.copy()
    for s, d, n in triples:
        want[d:d + n] = src_host[s:s + n]
    assert np.array_equal(_download(rt, dst, size), want)


@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
def test_host_device_lists_both_ways(rt, pinned):
    rng = np.random.default_rng(7)
    size = 4 << 20
    host = _core.Allocation(rt, size, False, pinned=pinned)
    assert host.pinned == pinned
    view = _core.HostRegion(host.addr, size, host).as_array(np.uint8, (size,))
    view[:] = rng.integers(0, 256, size, dtype=np.uint8)
    dev = _upload(rt, np.zeros(size, np.uint8))
    triples = _random_descriptors(rng, size, 200)
    _core.execute(_from([(host.addr + s, dev.addr + d, n) for s, d, n in triples]), rt, H2D)
    want = np.zeros(size, np.uint8)
    for s, d, n in triples:
        want[d:d + n] = view[s:s + n]
    assert np.array_equal(_download(rt, dev, size), want)
    back = np.zeros(size, np.uint8)
    _core.execute(_from([(dev.addr + d, back.ctypes.data + d, n) for _, d, n in triples]), rt, D2H)
    for _, d, n in triples:
        assert np.array_equal(back[d:d + n], want[d:d + n])


def test_queued_copies_are_done_after_synchronize(rt):
    size = 64 << 20
    data = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    src, dst = _upload(rt, data), _upload(rt, np.zeros(size, np.uint8))
    plan = _from([(src.addr + k * (1 << 20), dst.addr + k * (1 << 20), 1 << 20) for k in range(64)])
    _core.execute(plan, rt, D2D, wait=False)
    rt.synchronize()
    assert np.array_equal(_download(rt, dst, size), data)


_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    from llm_datadist import _core, runtimes
    rt = runtimes.load("cuda")
    rt.set_device(0)
    handle, offset, size = bytes.fromhex(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    base = rt.ipc_open(handle)
    assert rt.ipc_size(base) >= offset + size
    seen = np.empty(size, np.uint8)
    rt.memcpy(seen.ctypes.data, base + offset, size, _core.MEMCPY_DEVICE_TO_HOST)
    mine = (seen.astype(np.uint16) + 1).astype(np.uint8)
    rt.memcpy(base + offset, mine.ctypes.data, size, _core.MEMCPY_HOST_TO_DEVICE)
    rt.ipc_close(base)
    print("SUM", int(seen.astype(np.int64).sum()))
""")


def test_ipc_export_is_mapped_by_another_process(rt):
    if not rt.ipc:
        pytest.skip("this cuda runtime has no IPC (no driver API)")
    size = 1 << 20
    data = np.random.default_rng(5).integers(0, 256, 2 * size, dtype=np.uint8)
    mem = _upload(rt, data)
    handle, offset, alloc = rt.ipc_export(mem.addr + size)
    assert offset >= size and alloc >= 2 * size
    done = subprocess.run([sys.executable, "-c", _CHILD, handle.hex(), str(offset), str(size)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"SUM {int(data[size:].astype(np.int64).sum())}" in done.stdout
    got = _download(rt, mem, 2 * size)
    assert np.array_equal(got[:size], data[:size])
    assert np.array_equal(got[size:], (data[size:].astype(np.uint16) + 1).astype(np.uint8))


def test_an_allocation_of_the_library_is_exported_whole_at_its_own_size(rt):
    """What docs/security.md and cuda_ipc's warning rely on: a DEVICE tensor of allocate_cache is
    one cudaMalloc, which ipc_export reports as starting at the tensor and as exactly its bytes
    (an odd size, to see whether the driver reports a rounded one)."""
    if not rt.ipc:
        pytest.skip("this cuda runtime has no IPC (no driver API)")
    nbytes = 3 * 4096 + 24
    mem = _core.Allocation(rt, nbytes, True)
    _, offset, size = rt.ipc_export(mem.addr)
    assert (offset, size) == (0, nbytes)


# -- the public API between two processes on this GPU ----------------------------------------------

BLOCKS, BLOCK = 16, 2 << 20


def c_cache(state, seed: int):
    desc = ld.CacheDesc(2, [BLOCKS, BLOCK], ld.DataType.DT_UINT8, ld.Placement.DEVICE)
    state.caches["dev"] = cache = state.cm.allocate_blocks_cache(desc, ld.BlocksCacheKey(state.cluster_id, 1))
    rng = np.random.default_rng(seed)
    state.arrays["host"] = [rng.integers(0, 256, (BLOCKS, BLOCK), dtype=np.uint8) for _ in range(2)]
    host = ld.Cache.create_cpu_cache(ld.CacheDesc(2, [BLOCKS, BLOCK], ld.DataType.DT_UINT8, ld.Placement.HOST),
                                     [a.ctypes.data for a in state.arrays["host"]])
    state.cm.swap_blocks(host, cache, {b: b for b in range(BLOCKS)})
    return [a.copy() for a in state.arrays["host"]]


def c_read(state):
    out = [np.zeros((BLOCKS, BLOCK), np.uint8) for _ in range(2)]
    host = ld.Cache.create_cpu_cache(ld.CacheDesc(2, [BLOCKS, BLOCK], ld.DataType.DT_UINT8, ld.Placement.HOST),
                                     [a.ctypes.data for a in out])
    state.cm.swap_blocks(state.caches["dev"], host, {b: b for b in range(BLOCKS)})
    return out


def c_link(state, server_id: int, ip: str, port: int) -> int:
    info = ld.LLMClusterInfo()
    info.remote_cluster_id = server_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info(ip, port)
    return int(state.dd.link_clusters([info], 5000)[1][0])


def c_move(state, server_id: int, push, pull) -> str:
    key = ld.BlocksCacheKey(server_id, 1)
    state.cm.push_blocks(key, state.caches["dev"], *push)
    state.cm.pull_blocks(key, state.caches["dev"], *pull)
    return state.dd.engine.data_plane(server_id, 5000, True, True)


@pytest.mark.parametrize("plane", [None, "staging"], ids=["auto-cuda_ipc", "staging"])
def test_gpu_caches_move_between_processes(rt, monkeypatch, plane):
    monkeypatch.setenv("LLM_DATADIST_DEVICE", "cuda")
    # A secret: cuda_ipc hands GPU memory only to a peer on an authenticated link.
    options = {"llm.MemPoolConfig": '{"memory_size": 268435456}', "llm.LinkSecret": "gpu-tests-link-secret"}
    with Cluster(11, "PROMPT", listen=True, plane=plane, options=options, timeout=120) as server, \
            Cluster(12, "DECODER", plane=plane, options=options, timeout=120) as client:
        s = server.call(c_cache, 1)
        c = client.call(c_cache, 2)
        assert client.call(c_link, 11, *server.address) == LLMStatusCode.LLM_SUCCESS
        push, pull = ([1, 3, 5], [10, 0, 7]), ([2, 4], [6, 8])
        used = client.call(c_move, 11, push, pull)
        assert used == (plane or ("cuda_ipc" if rt.ipc else "staging"))
        for t in range(2):
            s[t][push[1]] = c[t][push[0]]
            c[t][pull[1]] = s[t][pull[0]]
        got_s, got_c = server.call(c_read), client.call(c_read)
        for t in range(2):
            assert np.array_equal(got_s[t], s[t]) and np.array_equal(got_c[t], c[t])


def test_torch_cuda_tensors_as_a_device_cache(rt, monkeypatch):
    torch = optional_deps.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    monkeypatch.setenv("LLM_DATADIST_DEVICE", "cuda")
    dd = ld.LLMDataDist(ld.LLMRole.PROMPT, 31)
    config = ld.LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    dd.init(config.generate_options())
    try:
        kv = [torch.randint(0, 255, (BLOCKS, 4096), dtype=torch.uint8, device="cuda:0") for _ in range(2)]
        torch.cuda.synchronize()
        want = [t.clone() for t in kv]
        desc = ld.CacheDesc(2, [BLOCKS, 4096], ld.DataType.DT_UINT8, ld.Placement.DEVICE)
        cache = dd.cache_manager.register_blocks_cache(desc, [t.data_ptr() for t in kv])
        dd.cache_manager.copy_blocks(cache, {0: [5, 6], 1: [7]})
        for t in want:
            t[[5, 6, 7]] = t[[0, 0, 1]]
        torch.cuda.synchronize()
        for got, expected in zip(kv, want):
            assert torch.equal(got, expected)
    finally:
        dd.finalize()
