"""Ascend NPU memory between processes: the ``staging`` plane with the acl runtime, on the stub
library posing as ``libascendcl.so`` (its aclrtMalloc memory is host memory that the acl binding
reports as not host-addressable, so every byte goes through ACL's copies).

ACL has no IPC binding: every acl DEVICE transfer takes ``staging``, whose bounce buffers come from
``aclrtMallocHost``; the owner and the asker each copy their side with the runtime.
"""

from __future__ import annotations

import pytest
from test_staging import CLIENT_ID, SERVER_ID, c_allocate, c_link, push_and_pull_blocks

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
    return state.dd.engine.data_plane(remote_id, 5000, True, True)


def test_acl_device_caches_move_through_staging_with_acl_copies(acl_env):
    options = {"llm.MemPoolConfig": '{"memory_size": 104857600}'}
    with Cluster(SERVER_ID, "PROMPT", listen=True, options=options, timeout=60) as server, \
            Cluster(CLIENT_ID, "DECODER", options=options, timeout=60) as client:
        assert client.call(c_allocate, "blocks", "DEVICE", True)[2]
        assert server.call(c_allocate, "blocks", "DEVICE", True)[2]
        assert client.call(c_link, SERVER_ID, *server.address) == LLMStatusCode.LLM_SUCCESS
        assert client.call(c_plane_of, SERVER_ID) == "staging"
        mine, theirs = push_and_pull_blocks(client, server, acl_env, 21)
        # Both sides staged through aclrtMallocHost buffers with ACL's own copies: the asker
        # copied device -> host for its push and host -> device for its pull, the owner the reverse.
        for log, first, second in ((mine, D2H, H2D), (theirs, H2D, D2H)):
            assert any(call[0] == "aclrtMallocHost" for call in log)
            kinds = [call[1] for call in log if call[0] == "aclrtMemcpy"]
            assert first in kinds and second in kinds
            assert not [call for call in log if call[0].startswith("cuda")]
