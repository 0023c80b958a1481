"""Ascend NPU memory between processes: the ``staging`` plane with the acl runtime, on the stub
library posing as ``libascendcl.so`` (its aclrtMalloc memory is host memory that the acl binding
reports as not host-addressable, so every byte goes through ACL's copies).

ACL has no IPC binding: every acl DEVICE transfer takes ``staging``, whose bounce buffers come from
``aclrtMallocHost``; the owner and the asker each copy their side with the runtime.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_staging import (CLIENT_ID, MODEL_ID, SERVER_ID, TENSORS, _blocks, c_allocate, c_fill, c_link, c_op,
                          c_read, c_stub_calls, c_stub_reset)

import llm_datadist as ld
from llm_datadist.status import LLMStatusCode
from llm_datadist.testing import Cluster

H2D, D2H = 1, 2


@pytest.fixture
def acl_env(stub_libraries, monkeypatch) -> str:
    path = str(stub_libraries["full"])
    monkeypatch.setenv("LLM_DATADIST_DEVICE", "acl")
    monkeypatch.setenv("LLM_DATADIST_ACL_LIBRARY", path)
    return path


def c_plane_of(state, remote_id: int) -> str:
    return state.dd._engine.data_plane(remote_id, 5000, True, True)


def test_acl_device_caches_move_through_staging_with_acl_copies(acl_env):
    options = {"llm.MemPoolConfig": '{"memory_size": 104857600}'}
    with Cluster(SERVER_ID, "PROMPT", listen=True, options=options, timeout=60) as server, \
            Cluster(CLIENT_ID, "DECODER", options=options, timeout=60) as client:
        assert client.call(c_allocate, "blocks", "DEVICE", True)[2]
        assert server.call(c_allocate, "blocks", "DEVICE", True)[2]
        assert client.call(c_link, SERVER_ID, *server.address) == LLMStatusCode.LLM_SUCCESS
        assert client.call(c_plane_of, SERVER_ID) == "staging"
        c_blocks = _blocks(client.call(c_fill, "blocks", 21))
        s_blocks = _blocks(server.call(c_fill, "blocks", 22))
        for cluster in (client, server):
            cluster.call(c_stub_reset, acl_env)
        key = ld.BlocksCacheKey(SERVER_ID, MODEL_ID)
        client.call(c_op, "push_blocks", key, "blocks", [1, 2, 3], [4, 6, 0])
        for t in range(TENSORS):
            s_blocks[t][[4, 6, 0]] = c_blocks[t][[1, 2, 3]]
        client.call(c_op, "pull_blocks", key, "blocks", [7, 5], [0, 1])
        for t in range(TENSORS):
            c_blocks[t][[0, 1]] = s_blocks[t][[7, 5]]
        mine, theirs = client.call(c_stub_calls, acl_env), server.call(c_stub_calls, acl_env)
        for got, want in zip(_blocks(client.call(c_read, "blocks")) + _blocks(server.call(c_read, "blocks")),
                             c_blocks + s_blocks):
            assert np.array_equal(got, want)
        # Both sides staged through aclrtMallocHost buffers with ACL's own copies: the asker
        # copied device -> host for its push and host -> device for its pull, the owner the reverse.
        for log, first, second in ((mine, D2H, H2D), (theirs, H2D, D2H)):
            assert any(call[0] == "aclrtMallocHost" for call in log)
            kinds = [call[1] for call in log if call[0] == "aclrtMemcpy"]
            assert first in kinds and second in kinds
            assert not [call for call in log if call[0].startswith("cuda")]
