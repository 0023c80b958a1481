"""The per-link state hook (``DataPlane.link_state``): a plane's state for a link is made at link
time, before its ``accept``, kept by the link (``Link.plane_state``), read by the plane on every
transfer, and dropped when the plane refuses or the link ends. And the engine's plane set: a
plane reaches another plane's instance through it instead of making its own.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Iterator, List

import numpy as np
import pytest

from llm_datadist import BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig, LLMDataDist, LLMRole, Placement
from llm_datadist.status import LLMStatusCode
from llm_datadist.testing import Cluster
from llm_datadist.transport import deadline as dl
from llm_datadist.transport import planes
from llm_datadist.transport.planes.choice import accept_plane
from llm_datadist.transport.planes.cuda_ipc import CudaIpcPlane
from llm_datadist.transport.planes.tcp import TcpPlane
from llm_datadist.transport.session import Link

SERVER_ID, CLIENT_ID = 91, 92
MODEL_ID, BLOCKS, BLOCK_BYTES, TENSORS = 3, 4, 1024, 2


class LinkNote:
    """The test plane's state for one link."""

    def __init__(self, cluster_id: int) -> None:
        self.cluster_id = cluster_id
        self.accepted = False
        self.transfers = 0
        self.closed = 0


class StatefulPlane(TcpPlane):
    """tcp frames, keeping a ``LinkNote`` per link and checking it is handed back every time."""

    name = "stateful"
    summary = "tcp frames with per-link state (a test plane)"
    auto = False
    fallback = False
    refuse = False

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.made: List[LinkNote] = []
        self.closed_without_state = 0

    def link_state(self, session) -> LinkNote:
        note = LinkNote(session.cluster_id)
        self.made.append(note)
        return note

    def accept(self, session, peer_facts, deadline):
        note = self.state(session)
        assert note is self.made[-1]  # made just before, kept by the link
        note.accepted = True
        return "it refuses (test)" if self.refuse else None

    def transfer(self, session, table, plan, write, deadline):
        self.state(session).transfers += 1
        super().transfer(session, table, plan, write, deadline)

    def close(self, session):
        note = self.state(session)
        if note is None:
            self.closed_without_state += 1
        else:
            note.closed += 1


class RefusingStatefulPlane(StatefulPlane):
    name = "stateful-refusing"
    refuse = True


@pytest.fixture
def stateful_planes() -> Iterator[None]:
    planes.register(StatefulPlane)
    planes.register(RefusingStatefulPlane)
    try:
        yield
    finally:
        planes.unregister(StatefulPlane.name)
        planes.unregister(RefusingStatefulPlane.name)


def _register_blocks(state) -> None:
    state.arrays = [np.full(BLOCKS * BLOCK_BYTES, 0x30 + t, dtype=np.uint8) for t in range(TENSORS)]
    desc = CacheDesc(TENSORS, [BLOCKS, BLOCK_BYTES], DataType.DT_UINT8, Placement.HOST)
    state.cm.register_blocks_cache(desc, [a.ctypes.data for a in state.arrays], BlocksCacheKey(SERVER_ID, MODEL_ID))


def _info(ip: str, port: int) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = SERVER_ID
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info(ip, port)
    return info


def test_a_planes_state_is_made_at_link_time_kept_by_the_link_and_dropped_at_unlink(stateful_planes):
    with contextlib.ExitStack() as stack:
        server = Cluster(SERVER_ID, "PROMPT", listen=True)
        stack.callback(server.close)
        server.call(_register_blocks)
        client = LLMDataDist(LLMRole.DECODER, CLIENT_ID)
        config = LLMConfig()
        config.device_id = 0
        config.enable_cache_manager = True
        config.enable_remote_cache_accessible = True
        options = config.generate_options()
        options["llm.DataPlane"] = StatefulPlane.name
        client.init(options)
        stack.callback(client.finalize)
        plane = client.engine.links.planes[StatefulPlane.name]

        ip, port = server.address
        _, rets = client.link_clusters([_info(ip, port)], 5000)
        assert int(rets[0]) == LLMStatusCode.LLM_SUCCESS
        peer = client.engine.links.peer(SERVER_ID)
        assert len(plane.made) == 1
        note = plane.made[0]
        assert peer.plane is plane and peer.plane_state == {StatefulPlane.name: note}
        assert note.cluster_id == SERVER_ID and note.accepted and note.closed == 0

        arrays = [np.zeros(BLOCKS * BLOCK_BYTES, dtype=np.uint8) for _ in range(TENSORS)]
        desc = CacheDesc(TENSORS, [BLOCKS, BLOCK_BYTES], DataType.DT_UINT8, Placement.HOST)
        local = client.cache_manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays])
        client.cache_manager.pull_blocks(BlocksCacheKey(SERVER_ID, MODEL_ID), local, [1], [2])
        assert note.transfers == 1
        assert all((a.reshape(BLOCKS, BLOCK_BYTES)[2] == 0x30 + t).all() for t, a in enumerate(arrays))

        client.unlink_clusters([_info(ip, port)], 3000)
        assert note.closed == 1  # released by close while the link still held it ...
        assert peer.plane_state == {}  # ... then dropped with the link
        plane.close(peer)  # a second close finds no state: nothing to release twice
        assert note.closed == 1 and plane.closed_without_state == 1


def _lone_peer() -> Link:
    return Link(7, "PROMPT", True, ("127.0.0.1", 1), ["tcp"])


def test_a_plane_that_refuses_the_link_has_its_state_released_and_dropped():
    plane = RefusingStatefulPlane(SimpleNamespace(cluster_id=1))
    peer = _lone_peer()
    reason = accept_plane(peer, plane, {}, dl.after(1000))
    assert reason == "it refuses (test)"
    (note,) = plane.made
    assert note.accepted and note.closed == 1 and peer.plane_state == {}


def test_a_plane_without_state_leaves_the_link_untouched():
    plane = TcpPlane(SimpleNamespace(cluster_id=1))
    peer = _lone_peer()
    assert plane.link_state(peer) is None
    assert accept_plane(peer, plane, {}, dl.after(1000)) is None
    assert peer.plane_state == {} and plane.state(peer) is None


def test_cuda_ipc_keeps_its_link_state_in_one_declared_object():
    plane = CudaIpcPlane(SimpleNamespace(runtime=None))
    state = plane.link_state(_lone_peer())
    assert (state.generation, state.maps, state.spans) == (None, {}, None)
    with pytest.raises(AttributeError):  # declared fields only: no attribute goes on the session
        _lone_peer().ipc_maps  # noqa: B018


def test_a_plane_reaches_another_through_the_engines_plane_set():
    engine = SimpleNamespace(runtime=None, cluster_id=1)
    plane_set = planes.PlaneSet(engine)
    cuda_ipc, staging = plane_set["cuda_ipc"], plane_set["staging"]
    assert cuda_ipc.sibling("staging") is staging  # the set's instance, not one of its own
    assert cuda_ipc.sibling("no-such-plane") is None
    lone = CudaIpcPlane(engine)  # made alone: a set of its own, made once
    assert lone.sibling("staging") is lone.sibling("staging") is not staging
