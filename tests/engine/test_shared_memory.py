"""Allocated host caches live in a sealed memfd each (``engine/shared_memory.py``), which the shm
plane passes to proven peers: one file per cache, never shared, never resized by whoever holds it;
and the peer's side refuses a file that is not such a memfd (``planes/shm/files.map_file``)."""

from __future__ import annotations

import fcntl
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

import llm_datadist as ld
from llm_datadist.engine import shared_memory
from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.transport.planes import shm

pytestmark = pytest.mark.skipif(not shared_memory.available(), reason="no sealed memfds here")
POOL = json.dumps({"memory_size": 16 * 1024 * 1024})


@pytest.fixture
def dd():
    dd = ld.LLMDataDist(ld.LLMRole.PROMPT, 11)
    cfg = ld.LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.mem_pool_cfg = POOL
    cfg.host_mem_pool_cfg = POOL
    dd.init(cfg.generate_options())
    try:
        yield dd
    finally:
        dd.finalize()


def test_each_allocated_cache_is_a_sealed_memfd_of_its_own_starting_zeroed(dd):
    cm = dd.cache_manager
    desc = ld.CacheDesc(3, [4, 1000], ld.DataType.DT_UINT8, ld.Placement.HOST)
    first, second = cm.allocate_cache(desc), cm.allocate_blocks_cache(desc)
    records = [dd.engine.lookup(c.cache_id) for c in (first, second)]
    files = [r.shared for r in records]
    assert all(f is not None for f in files)
    assert os.fstat(files[0].fd).st_ino != os.fstat(files[1].fd).st_ino
    for record, shared in zip(records, files):
        assert record.addrs == [shared.base + i * shared.stride for i in range(3)]
        assert shared.stride % shared_memory.PAGE_BYTES == 0 and shared.size == 3 * shared.stride
        seals = fcntl.fcntl(shared.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.ftruncate(shared.fd, 0)  # what a peer holding the file cannot do either
    assert all(np.all(t == 0) for t in first.as_numpy())


def test_registered_user_memory_is_never_in_a_memfd(dd):
    arrays = [np.zeros((4, 1000), np.uint8) for _ in range(2)]
    desc = ld.CacheDesc(2, [4, 1000], ld.DataType.DT_UINT8, ld.Placement.HOST)
    cache = dd.cache_manager.register_cache(desc, [a.ctypes.data for a in arrays])
    assert dd.engine.lookup(cache.cache_id).shared is None


def _session():
    return SimpleNamespace(cluster_id=5)


def test_the_peer_refuses_a_file_that_is_not_a_sealed_memfd_of_the_stated_size():
    unsealed = os.memfd_create("t", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, 8192)
    good = shared_memory.SharedCache(4096, 2)
    try:
        for entry, fd in (([1, 1, 0, 8192], unsealed), ([1, 1, 0, good.size + 4096], good.fd),
                          ([1, 1, 0, 0], good.fd)):
            with pytest.raises(LLMException) as refused:
                shm.map_file(_session(), entry, fd)
            assert refused.value.status_code == LLMStatusCode.LLM_LINK_FAILED
        mapped = shm.map_file(_session(), [1, 1, good.base, good.size], good.fd)
        assert (mapped.size, mapped.base) == (good.size, good.base) and mapped.local != good.base
    finally:
        os.close(unsealed)


def test_a_dropped_cache_frees_its_memory_though_a_peer_still_maps_its_file():
    # A peer keeps its mapping of a cache until its next table (a hostile one for ever): the
    # owner's deallocation must still give the pages back, not leave them to the peer's mapping,
    # and at once (no wait for a garbage collection), though not while a tensor is still held.
    import gc
    cache = shared_memory.SharedCache(1 << 20, 2)
    tensors = list(cache.tensors)  # what the engine keeps as the cache's allocations
    cache._view[:] = 7
    peer_fd = os.dup(cache.fd)  # what the peer was passed
    gc.disable()
    try:
        mapped = shm.map_file(_session(), [1, 1, cache.base, cache.size], peer_fd)
        size = cache.size
        assert os.fstat(peer_fd).st_blocks * 512 >= size
        del cache
        assert os.fstat(peer_fd).st_blocks * 512 >= size  # a tensor still holds it
        del tensors
        assert os.fstat(peer_fd).st_blocks == 0
        assert not np.any(mapped._view)  # the peer reads zeros, never a fault
    finally:
        gc.enable()
        os.close(peer_fd)
