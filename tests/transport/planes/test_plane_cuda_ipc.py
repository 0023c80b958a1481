"""The ``cuda_ipc`` plane end to end: two cluster processes whose cuda runtime is the stub library
(its cudaMalloc memory is a memfd that cudaIpcOpenMemHandle in the other process maps, so the
peer's GPU memory really is written through the mapping), DEVICE caches on both sides.

What is checked: the plane is chosen for device-to-device transfers only (staging for the other
combinations), every byte and the guard blocks, the copies run in the process that asked (one
kernel launch per transfer, no staging buffers, nothing in the owner's log), a mapping is opened
once per allocation and closed when the owner unregisters the cache or the link ends, and a stale
table is never written through.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from test_staging import (BLOCKS, CLIENT_ID, MODEL_ID, SERVER_ID, TENSORS, _blocks, c_allocate, c_fill, c_link,
                          c_op, c_read, c_seen, c_spy, push_and_pull_blocks)

import llm_datadist as ld
from llm_datadist.status import LLMStatusCode
from llm_datadist.testing import ChildError, Cluster


@pytest.fixture
def cuda_env(stub_libraries, monkeypatch) -> str:
    """Cluster processes started meanwhile run the stub library as their cuda runtime."""
    path = str(stub_libraries["full"])
    for name, value in (("LLM_DATADIST_DEVICE", "cuda"), ("LLM_DATADIST_CUDA_LIBRARY", path),
                        ("LLM_DATADIST_CUDA_DRIVER_LIBRARY", path)):
        monkeypatch.setenv(name, value)
    return path


def c_plane_of(state, remote_id: int, local_device: bool, remote_device: bool) -> str:
    return state.dd.engine.data_plane(remote_id, 5000, local_device, remote_device)


def c_mapped(state) -> int:
    return state.dd.engine.runtime.ipc_mapped


def c_drop(state, name: str) -> None:
    state.cm.deallocate_blocks_cache(state.caches.pop(name))


def c_unlink(state, remote_id: int) -> None:
    info = ld.LLMClusterInfo()
    info.remote_cluster_id = remote_id
    info.append_local_ip_info("127.0.0.1", 0)
    state.dd.unlink_clusters([info], 5000, force=True)


@contextlib.contextmanager
def _pair(client_place="DEVICE", server_place="DEVICE"):
    options = {"llm.MemPoolConfig": '{"memory_size": 104857600}',
               "llm.HostMemPoolConfig": '{"memory_size": 104857600}'}
    with Cluster(SERVER_ID, "PROMPT", listen=True, options=options, timeout=60) as server, \
            Cluster(CLIENT_ID, "DECODER", options=options, timeout=60) as client:
        caches = {"c": client.call(c_allocate, "blocks", client_place, True),
                  "s": server.call(c_allocate, "blocks", server_place, True)}
        assert client.call(c_link, SERVER_ID, *server.address) == LLMStatusCode.LLM_SUCCESS
        yield client, server, caches


def test_device_to_device_transfers_take_cuda_ipc_and_move_every_byte(cuda_env):
    with _pair() as (client, server, caches):
        assert caches["c"][2] and caches["s"][2]  # both are device memory the host cannot address
        assert client.call(c_plane_of, SERVER_ID, True, True) == "cuda_ipc"
        assert client.call(c_plane_of, SERVER_ID, True, False) == "staging"
        assert client.call(c_plane_of, SERVER_ID, False, True) == "staging"
        client.call(c_spy)
        mine, theirs = push_and_pull_blocks(client, server, cuda_env, 11)
        assert client.call(c_seen) == [("cuda_ipc", "device")] * 2
        # The asking process mapped the owner's allocations (one per tensor) once and copied on
        # the device: one kernel launch per transfer, no page-locked staging buffer.
        fns = [c[0] for c in mine]
        assert fns.count("cudaIpcOpenMemHandle") == TENSORS
        assert fns.count("cuLaunchKernel") == 2
        assert "cudaMallocHost" not in fns and "cudaMemcpyBatchAsync" not in fns
        # The owner's runtime did nothing for them.
        assert not {"cuLaunchKernel", "cudaMemcpyAsync", "cudaMemcpyBatchAsync"} & {c[0] for c in theirs}
        assert client.call(c_mapped) == TENSORS


def test_an_unregistered_cache_is_unmapped_and_never_written_through(cuda_env):
    with _pair() as (client, server, _):
        client.call(c_fill, "blocks", 1)
        key = ld.BlocksCacheKey(SERVER_ID, MODEL_ID)
        client.call(c_op, "push_blocks", key, "blocks", [0], [0])
        assert client.call(c_mapped) == TENSORS
        server.call(c_drop, "blocks")
        with pytest.raises(ChildError) as info:
            client.call(c_op, "push_blocks", key, "blocks", [0], [0])
        assert "LLM_KV_CACHE_NOT_EXIST" in str(info.value)
        assert client.call(c_mapped) == 0  # the refreshed table no longer lists it: closed
        # A new cache under the same key is mapped afresh and written.
        server.call(c_allocate, "blocks", "DEVICE", True)
        want = _blocks(client.call(c_fill, "blocks", 2))
        client.call(c_op, "push_blocks", key, "blocks", [3], [5])
        got = _blocks(server.call(c_read, "blocks"))
        assert all(np.array_equal(got[t][5], want[t][3]) for t in range(TENSORS))
        assert client.call(c_mapped) == TENSORS


def test_unlink_closes_every_mapping(cuda_env):
    with _pair() as (client, server, _):
        client.call(c_fill, "blocks", 1)
        client.call(c_op, "pull_blocks", ld.BlocksCacheKey(SERVER_ID, MODEL_ID), "blocks", [0, 1], [2, 3])
        assert client.call(c_mapped) == TENSORS
        client.call(c_unlink, SERVER_ID)
        assert client.call(c_mapped) == 0


def test_forced_cuda_ipc_carries_device_transfers_and_leaves_host_memory_to_auto(cuda_env, monkeypatch):
    monkeypatch.setenv("LLM_DATADIST_DATA_PLANE", "cuda_ipc")
    with _pair("HOST", "DEVICE") as (client, server, _):
        assert client.call(c_plane_of, SERVER_ID, False, False) in ("cma", "tcp")
        assert client.call(c_plane_of, SERVER_ID, False, True) == "staging"  # cuda_ipc does not carry it
        want = _blocks(client.call(c_fill, "blocks", 3))
        client.call(c_op, "push_blocks", ld.BlocksCacheKey(SERVER_ID, MODEL_ID), "blocks", [1], [2])
        got = _blocks(server.call(c_read, "blocks"))
        assert all(np.array_equal(got[t][2], want[t][1]) for t in range(TENSORS))
        assert BLOCKS > 2
