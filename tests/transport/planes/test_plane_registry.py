"""The data plane registry: a plane defined and registered by this test module alone (no other
file of the library knows it) is listed everywhere planes are listed, chosen when forced, moves
the bytes of every transfer through its own ``transfer``, and hears of registry changes; a
forced plane that refuses a link fails the link with ``LLM_LINK_FAILED``.

The client runs in this process, so that it sees the test's registrations; the server is an
ordinary cluster in its own process, which knows nothing of them (the test planes move bytes with
the frames every cluster serves).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Tuple

import numpy as np
import pytest

from llm_datadist import (BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig, LLMDataDist, LLMRole,
                          Placement)
from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.testing import Cluster
from llm_datadist.transport import planes
from llm_datadist.transport.planes.tcp import TcpPlane

SERVER_ID, CLIENT_ID = 71, 72
MODEL_ID = 5
BLOCKS, BLOCK_BYTES, TENSORS = 8, 4096, 2


class CountingPlane(TcpPlane):
    """The tcp plane under another name, counting what passes through it."""

    name = "counted"
    summary = "tcp frames, counted (a test plane)"
    aliases = ("counting",)
    auto = False
    fallback = False

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.transfers: List[Tuple[bool, int]] = []
        self.registered: List[int] = []
        self.unregistered: List[int] = []
        self.accepted: List[int] = []
        self.closed: List[int] = []

    def accept(self, session, peer_facts, deadline):
        self.accepted.append(session.cluster_id)
        return None  # the peer serves the frames of tcp whatever it offers

    def transfer(self, session, table, plan, write, deadline):
        self.transfers.append((write, plan.total_bytes))
        super().transfer(session, table, plan, write, deadline)

    def on_register(self, record):
        self.registered.append(record.cache_id)

    def on_unregister(self, record):
        self.unregistered.append(record.cache_id)

    def close(self, session):
        self.closed.append(session.cluster_id)


class RefusingPlane(TcpPlane):
    name = "refusing"
    auto = False
    fallback = False

    def accept(self, session, peer_facts, deadline):
        return "it never accepts a link"


@pytest.fixture
def test_planes() -> Iterator[None]:
    planes.register(CountingPlane)
    planes.register(RefusingPlane)
    try:
        yield
    finally:
        planes.unregister(CountingPlane.name)
        planes.unregister(RefusingPlane.name)


def _client(stack: contextlib.ExitStack, plane: str) -> LLMDataDist:
    dd = LLMDataDist(LLMRole.DECODER, CLIENT_ID)
    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    options = config.generate_options()
    options["llm.DataPlane"] = plane
    dd.init(options)
    stack.callback(dd.finalize)
    return dd


def _server(stack: contextlib.ExitStack) -> Cluster:
    server = Cluster(SERVER_ID, "PROMPT", listen=True)
    stack.callback(server.close)
    return server


def _register_blocks(state, fill: int) -> None:
    """(In the server) a keyed blocks cache of known bytes."""
    state.arrays = [np.full(BLOCKS * BLOCK_BYTES, fill + t, dtype=np.uint8) for t in range(TENSORS)]
    desc = CacheDesc(TENSORS, [BLOCKS, BLOCK_BYTES], DataType.DT_UINT8, Placement.HOST)
    state.cm.register_blocks_cache(desc, [a.ctypes.data for a in state.arrays], BlocksCacheKey(SERVER_ID, MODEL_ID))


def _blocks_of(state) -> List[np.ndarray]:
    return [a.reshape(BLOCKS, BLOCK_BYTES).copy() for a in state.arrays]


def _link(client: LLMDataDist, server: Cluster) -> int:
    ip, port = server.address
    info = LLMClusterInfo()
    info.remote_cluster_id = SERVER_ID
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info(ip, port)
    _, rets = client.link_clusters([info], 5000)
    return int(rets[0])


def test_a_registered_plane_is_listed_everywhere(test_planes):
    from llm_datadist.cli import bench as _bench
    from llm_datadist.cli import info as _sysinfo
    from llm_datadist.cli.main import build_parser
    assert "counted" in planes.names() and "counted" in planes.choices()
    assert "counted" not in planes.auto_order()  # auto=False: only reachable by forcing it
    assert planes.offered("counted") == ("counted", "tcp")  # the forced plane and the fallback
    assert planes.resolve({"llm.DataPlane": "Counted"}) == "counted"
    with pytest.raises(LLMException) as raised:
        planes.resolve({"llm.DataPlane": "uncounted"})
    assert raised.value.status_code == LLMStatusCode.LLM_PARAM_INVALID and "counted" in str(raised.value)
    parser = build_parser()
    assert parser.parse_args(["demo", "--plane", "counted"]).plane == "counted"
    assert parser.parse_args(["bench", "--planes", "counting,tcp"]).planes == ["counted", "tcp"]
    assert "counted" in _bench.all_planes()
    assert _sysinfo.plane_facts()["counted"].startswith("available: ")


def test_a_forced_plane_carries_every_transfer_and_hears_registry_changes(test_planes):
    with contextlib.ExitStack() as stack:
        server = _server(stack)
        server.call(_register_blocks, 0x10)
        client = _client(stack, "counted")
        plane = client.engine.links.planes["counted"]
        arrays = [np.full(BLOCKS * BLOCK_BYTES, 0x80 + t, dtype=np.uint8) for t in range(TENSORS)]
        desc = CacheDesc(TENSORS, [BLOCKS, BLOCK_BYTES], DataType.DT_UINT8, Placement.HOST)
        local = client.cache_manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays])
        assert plane.registered == [local.cache_id]

        assert _link(client, server) == LLMStatusCode.LLM_SUCCESS
        links = client.engine.links
        assert links.data_plane(SERVER_ID) == "counted" and links.peer(SERVER_ID).plane is plane
        assert plane.accepted == [SERVER_ID]

        client.cache_manager.push_blocks(BlocksCacheKey(SERVER_ID, MODEL_ID), local, [0, 1], [2, 3])
        client.cache_manager.pull_blocks(BlocksCacheKey(SERVER_ID, MODEL_ID), local, [5], [6])
        assert plane.transfers == [(True, 2 * TENSORS * BLOCK_BYTES), (False, TENSORS * BLOCK_BYTES)]
        remote = server.call(_blocks_of)
        for t in range(TENSORS):
            assert (remote[t][2:4] == 0x80 + t).all() and (remote[t][[0, 1, 4, 5, 6, 7]] == 0x10 + t).all()
            assert (arrays[t].reshape(BLOCKS, BLOCK_BYTES)[6] == 0x10 + t).all()

        client.cache_manager.unregister_cache(local.cache_id)
        assert plane.unregistered == [local.cache_id]
        client.unlink_clusters([_info(SERVER_ID)], 3000)
        assert SERVER_ID in plane.closed


def _info(cluster_id: int) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", 1)
    return info


def test_a_forced_plane_that_refuses_fails_the_link(test_planes):
    with contextlib.ExitStack() as stack:
        server = _server(stack)
        client = _client(stack, "refusing")
        assert _link(client, server) == LLMStatusCode.LLM_LINK_FAILED
        assert client.engine.links.linked_clusters() == []
