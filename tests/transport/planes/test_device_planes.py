"""The device-plane mechanism of the link manager: a transfer whose local or remote side is device
memory that the host cannot address goes to a plane with ``device_memory`` (chosen per link and per
combination, kept, closed with the link); every other transfer keeps the link's plane; a plane
without ``device_memory`` never sees a device plan; a plan mixing the peer's host and device memory
is refused.

The client runs in this process with the cpu runtime (its memory is host memory), the server is an
ordinary cluster process. Which side is "device memory" is what the mechanism is told: the engine's
``device_only`` for the local cache, the table's ``device_ranges`` for the peer's; the test plane
moves the bytes as tcp frames, which the server (host memory too) serves. The real device paths,
on the stub runtime posing as cuda, are in ``test_staging.py``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Tuple

import numpy as np
import pytest

from llm_datadist import (BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig, LLMDataDist, LLMRole,
                          Placement, _core, _io)
from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.testing import Cluster
from llm_datadist.transport import planes
from llm_datadist.transport.planes.tcp import TcpPlane
from llm_datadist.transport.table import RemoteTable

SERVER_ID, CLIENT_ID = 81, 82
MODEL_ID = 6
BLOCKS, BLOCK_BYTES, TENSORS = 8, 4096, 2


class DevicePlane(TcpPlane):
    """A device plane for the test: tcp frames, recording every call."""

    name = "devtest"
    summary = "tcp frames posing as a device plane (a test plane)"
    auto_rank = 1
    fallback = False
    device_memory = True
    #: combinations this plane refuses to carry
    refused: Tuple[Tuple[bool, bool], ...] = ()

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.device_transfers: List[Tuple[bool, bool, bool, int]] = []
        self.host_transfers: List[Tuple[bool, int]] = []
        self.accepted: List[int] = []
        self.closed: List[int] = []

    def accept(self, session, peer_facts, deadline):
        self.accepted.append(session.cluster_id)
        return None

    def carries(self, session, local_device, remote_device):
        return (local_device, remote_device) not in self.refused

    def transfer(self, session, table, plan, write, deadline):
        self.host_transfers.append((write, plan.total_bytes))
        super().transfer(session, table, plan, write, deadline)

    def transfer_device(self, session, table, plan, write, deadline, local_device, remote_device):
        self.device_transfers.append((write, local_device, remote_device, plan.total_bytes))
        super().transfer(session, table, plan, write, deadline)

    def close(self, session):
        self.closed.append(session.cluster_id)


class RefusingDevicePlane(DevicePlane):
    name = "devrefusing"
    auto_rank = 0

    def accept(self, session, peer_facts, deadline):
        self.accepted.append(session.cluster_id)
        return "it never accepts a link"


@pytest.fixture
def device_planes() -> Iterator[None]:
    """Only the test's device planes are registered with ``device_memory`` meanwhile."""
    others = [planes.get(name) for name in planes.names() if planes.get(name).device_memory]
    for plane in others:
        planes.unregister(plane.name)
    planes.register(DevicePlane)
    planes.register(RefusingDevicePlane)
    try:
        yield
    finally:
        planes.unregister(DevicePlane.name)
        planes.unregister(RefusingDevicePlane.name)
        for plane in others:
            planes.register(plane)


def _register_blocks(state, fill: int) -> None:
    state.arrays = [np.full(BLOCKS * BLOCK_BYTES, fill + t, dtype=np.uint8) for t in range(TENSORS)]
    desc = CacheDesc(TENSORS, [BLOCKS, BLOCK_BYTES], DataType.DT_UINT8, Placement.HOST)
    cache = state.cm.register_blocks_cache(desc, [a.ctypes.data for a in state.arrays],
                                           BlocksCacheKey(SERVER_ID, MODEL_ID))
    return cache.tensor_addrs


def _blocks_of(state) -> List[np.ndarray]:
    return [a.reshape(BLOCKS, BLOCK_BYTES).copy() for a in state.arrays]


@contextlib.contextmanager
def _linked(plane: str = "tcp"):
    """(client LLMDataDist in this process forcing ``plane``, its local arrays and cache, the
    server cluster, the server's tensor addresses)."""
    with contextlib.ExitStack() as stack:
        server = Cluster(SERVER_ID, "PROMPT", listen=True)
        stack.callback(server.close)
        remote_addrs = server.call(_register_blocks, 0x10)
        dd = LLMDataDist(LLMRole.DECODER, CLIENT_ID)
        config = LLMConfig()
        config.device_id = 0
        config.enable_cache_manager = True
        config.enable_remote_cache_accessible = True
        options = config.generate_options()
        options["llm.DataPlane"] = plane
        dd.init(options)
        stack.callback(dd.finalize)
        arrays = [np.full(BLOCKS * BLOCK_BYTES, 0x80 + t, dtype=np.uint8) for t in range(TENSORS)]
        desc = CacheDesc(TENSORS, [BLOCKS, BLOCK_BYTES], DataType.DT_UINT8, Placement.HOST)
        local = dd.cache_manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays])
        ip, port = server.address
        info = LLMClusterInfo()
        info.remote_cluster_id = SERVER_ID
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info(ip, port)
        _, rets = dd.link_clusters([info], 5000)
        assert rets[0] == LLMStatusCode.LLM_SUCCESS
        yield dd, arrays, local, server, remote_addrs


def _spy_host_planes(dd) -> List[Tuple[str, int]]:
    """Record every plan the planes without ``device_memory`` are handed."""
    seen: List[Tuple[str, int]] = []
    for plane in dd.engine.links.planes.values():
        if plane.device_memory:
            continue
        original = plane.transfer

        def spy(session, table, plan, write, deadline, _plane=plane, _original=original):
            seen.append((_plane.name, plan.total_bytes))
            return _original(session, table, plan, write, deadline)
        plane.transfer = spy
    return seen


def test_transfers_with_device_memory_take_the_device_plane(device_planes):
    with _linked("tcp") as (dd, arrays, local, server, remote_addrs):
        engine, links = dd.engine, dd.engine.links
        host_seen = _spy_host_planes(dd)
        device = links.planes["devtest"]
        key = BlocksCacheKey(SERVER_ID, MODEL_ID)

        # Host on both sides: the link's plane, as always.
        dd.cache_manager.push_blocks(key, local, [0], [0])
        assert host_seen == [("tcp", TENSORS * BLOCK_BYTES)] and device.device_transfers == []
        assert links.data_plane(SERVER_ID) == "tcp"

        # The local cache is device memory: the first device plane of the auto order that
        # accepts the link and carries the combination (the refusing one is closed again).
        engine.device_only = lambda record: record.cache_id == local.cache_id
        # (A record's memory never changes kind; this test flips it, so the block route the
        # first push made for it as host memory goes too.)
        engine.routes.clear()
        dd.cache_manager.push_blocks(key, local, [1, 2], [3, 4])
        dd.cache_manager.pull_blocks(key, local, [5], [6])
        assert device.device_transfers == [(True, True, False, 2 * TENSORS * BLOCK_BYTES),
                                           (False, True, False, TENSORS * BLOCK_BYTES)]
        refusing = links.planes["devrefusing"]
        assert refusing.accepted == [SERVER_ID] and refusing.closed == [SERVER_ID]
        assert device.accepted == [SERVER_ID]  # once per link, not per transfer
        assert links.data_plane(SERVER_ID, local_device=True) == "devtest"
        assert engine.routes == {}  # no same-host route for device memory
        remote = server.call(_blocks_of)
        for t in range(TENSORS):
            assert (remote[t][3:5] == 0x80 + t).all() and (remote[t][[1, 2, 5, 6, 7]] == 0x10 + t).all()
            assert (arrays[t].reshape(BLOCKS, BLOCK_BYTES)[6] == 0x10 + t).all()

        # The remote cache is device memory (its table says so): the device plane again.
        del engine.device_only
        peer = links.peer(SERVER_ID)
        peer.table.device_ranges = _io.RangeSet((a, BLOCKS * BLOCK_BYTES) for a in remote_addrs)
        dd.cache_manager.push_blocks(key, local, [7], [7])
        assert device.device_transfers[-1] == (True, False, True, TENSORS * BLOCK_BYTES)
        assert sorted(peer.device_planes) == [(False, True), (True, False)]
        assert host_seen == [("tcp", TENSORS * BLOCK_BYTES)]  # tcp never saw a device plan

        dd.unlink_clusters([_info()], 3000)
        assert SERVER_ID in device.closed  # the device plane ends with the link


def test_a_plane_that_does_not_carry_a_combination_is_passed_over(device_planes, monkeypatch):
    monkeypatch.setattr(DevicePlane, "refused", ((True, False),))
    with _linked("tcp") as (dd, arrays, local, server, remote_addrs):
        dd.engine.device_only = lambda record: True
        with pytest.raises(LLMException) as raised:
            dd.cache_manager.push_blocks(BlocksCacheKey(SERVER_ID, MODEL_ID), local, [0], [0])
        assert raised.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
        message = str(raised.value)
        assert "devtest does not carry it" in message and "devrefusing: it never accepts a link" in message
        assert dd.engine.links.linked_clusters() == [SERVER_ID]  # the transfer failed, not the link
        assert (server.call(_blocks_of)[0][0] == 0x10).all()


def test_a_forced_device_plane_carries_host_and_device_transfers(device_planes):
    with _linked("devtest") as (dd, arrays, local, server, remote_addrs):
        links = dd.engine.links
        host_seen = _spy_host_planes(dd)
        device = links.planes["devtest"]
        key = BlocksCacheKey(SERVER_ID, MODEL_ID)
        dd.cache_manager.push_blocks(key, local, [0], [1])
        assert device.host_transfers == [(True, TENSORS * BLOCK_BYTES)] and device.device_transfers == []
        dd.engine.device_only = lambda record: True
        dd.cache_manager.pull_blocks(key, local, [2], [3])
        assert device.device_transfers == [(False, True, False, TENSORS * BLOCK_BYTES)]
        assert links.planes["devrefusing"].accepted == []  # forced: no other plane is tried
        assert device.accepted == [SERVER_ID] and host_seen == []


def test_without_a_device_plane_a_device_transfer_fails_and_the_link_stays(device_planes):
    planes.unregister(DevicePlane.name)
    planes.unregister(RefusingDevicePlane.name)
    with _linked("tcp") as (dd, arrays, local, server, remote_addrs):
        dd.engine.device_only = lambda record: True
        with pytest.raises(LLMException) as raised:
            dd.cache_manager.push_blocks(BlocksCacheKey(SERVER_ID, MODEL_ID), local, [0], [0])
        assert raised.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
        assert "none has device_memory" in str(raised.value)
        del dd.engine.device_only
        dd.cache_manager.push_blocks(BlocksCacheKey(SERVER_ID, MODEL_ID), local, [0], [0])


def test_under_auto_a_device_plane_is_never_the_link_plane(device_planes):
    with _linked("auto") as (dd, arrays, local, server, remote_addrs):
        links = dd.engine.links
        assert not links.planes[links.data_plane(SERVER_ID)].device_memory
        assert links.planes["devtest"].accepted == []  # not asked until a device transfer comes
        dd.engine.device_only = lambda record: True
        dd.cache_manager.push_blocks(BlocksCacheKey(SERVER_ID, MODEL_ID), local, [0], [0])
        assert links.data_plane(SERVER_ID, local_device=True) == "devtest"


def _info() -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = SERVER_ID
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", 1)
    return info


# -- the peer's side of a plan: RemoteTable.device_side ----------------------------------------------

def _table(host_addrs, device_addrs, tensor_bytes=4096) -> RemoteTable:
    caches = [[1, "blocks", 0, len(host_addrs), 1, tensor_bytes, list(host_addrs), True],
              [2, "blocks", 1, len(device_addrs), 1, tensor_bytes, list(device_addrs), False]]
    return RemoteTable({"generation": 1, "caches": caches, "blocks": [], "keys": []})


def _plan(*descs) -> _core.CopyPlan:
    return _io.plan_from_wire(np.array(descs, dtype="<u8").tobytes())


def test_the_peer_side_of_a_plan_is_host_device_or_refused():
    table = _table([0x10000, 0x20000], [0x30000])
    assert table.ranges.spans() == [(0x10000, 0x11000), (0x20000, 0x21000), (0x30000, 0x31000)]
    assert table.device_ranges.spans() == [(0x30000, 0x31000)]
    # (src, dst, nbytes): the peer's side is dst for a push, src for a pull.
    assert table.device_side(_plan((0x1, 0x10000, 4096), (0x2, 0x20000, 16)), True) is False
    assert table.device_side(_plan((0x1, 0x30000, 4096)), True) is True
    assert table.device_side(_plan((0x30010, 0x1, 16)), False) is True
    assert table.device_side(_plan((0x30010, 0x1, 16)), True) is False  # its dst is ours, not a peer range
    assert table.device_side(_plan(), True) is False
    for mixed, side in [(_plan((0x1, 0x10000, 16), (0x2, 0x30000, 16)), True),
                        (_plan((0x30000, 0x1, 16), (0x10000, 0x2, 16)), False),
                        (_plan((0x1, 0x30ff0, 32)), True)]:  # one descriptor running out of the device cache
        with pytest.raises(LLMException) as raised:
            table.device_side(mixed, side)
        assert raised.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert len(_table([0x10000], [0x20000]).device_ranges) == 1
