"""The ``shm`` plane (``transport/planes/shm.py``): caches the peer allocated, mapped here through
the memfd it passes over its Unix connection, moved with memcpy; user memory still through cma.
Real cluster processes, forced onto ``shm``."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

from llm_datadist import BlocksCacheKey, LLMStatusCode
from llm_datadist.testing import ChildError, Cluster, link
from llm_datadist.transport import planes

import cluster_ops as ops

S = LLMStatusCode
SERVER, CLIENT = 41, 42
MODEL = 9
TENSORS, BLOCKS, WORDS = 4, 8, 1024  # int32 words per block: 4 KiB blocks
POOL = '{"memory_size": 67108864}'

pytestmark = pytest.mark.skipif(not planes.get("shm").probe()[0], reason="no shm plane on this host")


# -- run in the cluster processes ---------------------------------------------------------------

def shm_state(state) -> dict:
    """What the shm plane of this cluster did: files passed and refused (owner), the link's
    host plane and mapped files (peer)."""
    links = state.dd.engine.links
    plane = links.planes.instance("shm")
    out = {"passed": plane.files_passed, "refused": plane.files_refused, "planes": {}, "mapped": {}}
    for peer in list(links._peers.values()):
        out["planes"][peer.cluster_id] = peer.plane_name
        shm = peer.plane_state.get("shm")
        out["mapped"][peer.cluster_id] = sorted(k[0] for k in shm.maps) if shm is not None else None
    return out


def guard_check(state, name: str, touched_blocks, value: int) -> bool:
    """Every block of cache ``name`` outside ``touched_blocks`` still holds ``value`` (the guard)."""
    for tensor in state.arrays[name]:
        for block in range(tensor.shape[0]):
            if block not in touched_blocks and not np.all(tensor[block] == value):
                return False
    return True


def set_all(state, name: str, value: int) -> None:
    for tensor in state.arrays[name]:
        tensor[...] = value


def blocks_of(state, name: str, blocks):
    return [tensor[list(blocks)].copy() for tensor in state.arrays[name]]


def set_blocks(state, name: str, blocks, base: int) -> None:
    for t, tensor in enumerate(state.arrays[name]):
        for i, block in enumerate(blocks):
            tensor[block] = base + 1000 * t + i


# -- fixtures ---------------------------------------------------------------------------------------

@pytest.fixture
def pair():
    options = {"remote_cache_accessible": "1", "llm.MemPoolConfig": POOL, "llm.HostMemPoolConfig": POOL}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(Cluster(SERVER, "PROMPT", listen=True, plane="shm", options=options, timeout=30))
        client = stack.enter_context(Cluster(CLIENT, "DECODER", plane="shm", options=options, timeout=30))
        yield server, client


# -- tests ----------------------------------------------------------------------------------------

def test_pushes_and_pulls_into_an_allocated_cache_go_through_the_mapped_file(pair):
    server, client = pair
    server.call(ops.allocate, "remote", TENSORS, (BLOCKS, WORDS), "HOST", True, (), MODEL)
    client.call(ops.allocate, "local", TENSORS, (BLOCKS, WORDS), "HOST", True)
    server.call(set_all, "remote", -7)
    assert link(client, server) == (0, [0])
    key = BlocksCacheKey(SERVER, MODEL)
    client.call(set_blocks, "local", [0, 1, 2], 11)
    client.call(ops.py, "push_blocks", key, "local", [0, 1, 2], [5, 1, 6])
    assert server.call(guard_check, "remote", {5, 1, 6}, -7)
    got = server.call(blocks_of, "remote", [5, 1, 6])
    want = client.call(blocks_of, "local", [0, 1, 2])
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    server.call(set_blocks, "remote", [3, 4], 500)
    client.call(set_all, "local", -1)
    client.call(ops.py, "pull_blocks", key, "local", [3, 4], [7, 0])
    assert client.call(guard_check, "local", {7, 0}, -1)
    got = client.call(blocks_of, "local", [7, 0])
    want = server.call(blocks_of, "remote", [3, 4])
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    owner, peer = server.call(shm_state), client.call(shm_state)
    assert owner["passed"] == 1 and owner["refused"] == 0
    assert peer["planes"][SERVER] == "shm" and len(peer["mapped"][SERVER]) == 1
