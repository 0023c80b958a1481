"""The ``cuda_ipc`` plane against fakes: what it believes of a peer's exports, and what it maps.

A peer's table reply is untrusted: its exports must be well formed, and every tensor must lie
inside the allocation that *this* process's runtime says it mapped, whatever the peer claims.
Mappings are opened once per handle and closed when the peer stops listing them or the link ends.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from llm_datadist import _core
from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.transport.planes import cuda_ipc
from llm_datadist.transport.table import RemoteTable

H1, H2 = bytes([1]) * 64, bytes([2]) * 64


class FakeRuntime:
    """Maps handles at fixed bases with fixed sizes; counts opens and closes."""

    host_addressable = False
    ipc = True

    def __init__(self, sizes):
        self.sizes = sizes  # handle -> mapped size
        self.bases = {h: 0x7000_0000_0000 + i * 0x1000_0000 for i, h in enumerate(sizes)}
        self.opened, self.closed = [], []

    def ipc_open(self, handle):
        self.opened.append(handle)
        return self.bases[handle]

    def ipc_size(self, base):
        return next(self.sizes[h] for h, b in self.bases.items() if b == base)

    def ipc_close(self, base):
        self.closed.append(base)


def _table(caches, generation=1):
    """A peer table of device caches: ``[(cache_id, [addrs], rows, row_bytes)]``."""
    return RemoteTable({"generation": generation, "blocks": [], "keys": [],
                        "caches": [[cid, "blocks", 1, len(addrs), rows, row, addrs, False]
                                   for cid, addrs, rows, row in caches]})


def _plane(runtime):
    engine = SimpleNamespace(runtime=runtime, bind_thread=lambda: None)
    return cuda_ipc.CudaIpcPlane(engine)


def _session(exports):
    """A link whose cuda_ipc state was made at link time (the counter is left unmapped)."""
    session = SimpleNamespace(cluster_id=7, facts={"cuda_ipc": {"generation_fd": 3, "exports": exports}},
                              plane_state={})
    session.plane_state["cuda_ipc"] = cuda_ipc.IpcLink()
    return session


def _maps(session):
    return session.plane_state["cuda_ipc"].maps


def test_spans_map_each_allocation_once_at_the_offsets_the_peer_gave():
    runtime = FakeRuntime({H1: 1 << 20, H2: 1 << 20})
    plane = _plane(runtime)
    table = _table([(5, [0x1000, 0x9000], 4, 1024)])
    session = _session([[5, 1, [[H1.hex(), 0], [H1.hex(), 8192]]]])
    spans = plane._spans(session, table, runtime)
    base = runtime.bases[H1]
    assert spans == [(0x1000, 4096, base), (0x9000, 4096, base + 8192)]
    assert runtime.opened == [H1]  # one allocation holds both tensors: opened once
    assert plane._spans(session, table, runtime) is spans  # same table and facts: nothing new


@pytest.mark.parametrize("offset", [(1 << 20) - 4095, 1 << 20, (1 << 20) + 1, 2**63 - 1])
def test_a_tensor_beyond_the_mapped_allocation_fails_the_link_whatever_the_peer_claims(offset):
    runtime = FakeRuntime({H1: 1 << 20})
    plane = _plane(runtime)
    table = _table([(5, [0x1000], 4, 1024)])
    with pytest.raises(LLMException) as info:
        plane._spans(_session([[5, 1, [[H1.hex(), offset]]]]), table, runtime)
    assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    assert "beyond its GPU allocation" in str(info.value)


@pytest.mark.parametrize("exports", [
    [[5, 1, [["zz" * 64, 0]]]],              # not hex
    [[5, 1, [[H1.hex()[:-2], 0]]]],          # 63 bytes
    [[5, 1, [[H1.hex(), -1]]]],              # negative offset
    [[5, 1, [[H1.hex(), True]]]],            # bool is not an offset
    [[0, 1, [[H1.hex(), 0]]]],               # cache id 0
    [[5, 1, "not a list"]],
    [[5, 1]],                             # no tensors entry
    [[5, [[H1.hex(), 0]]]],               # no export id
    [[5, -1, [[H1.hex(), 0]]]],           # negative export id
    ["garbage"],
    [[5, 1, [[H1.hex()]]]],                  # no offset
])
def test_malformed_exports_fail_the_link_and_map_nothing(exports):
    runtime = FakeRuntime({H1: 1 << 20})
    plane = _plane(runtime)
    with pytest.raises(LLMException) as info:
        plane._spans(_session(exports), _table([(5, [0x1000], 4, 1024)]), runtime)
    assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    assert runtime.opened == []


def test_a_cache_the_peer_did_not_export_gets_no_span_and_its_transfer_finds_none():
    runtime = FakeRuntime({H1: 1 << 20})
    plane = _plane(runtime)
    table = _table([(5, [0x1000], 4, 1024), (6, [0x100000], 4, 1024)])
    session = _session([[5, 1, [[H1.hex(), 0]]]])
    assert plane._spans(session, table, runtime) == [(0x1000, 4096, runtime.bases[H1])]
    plan = _core.plan_rows(_core.CacheLayout([0x100000], 4, 1024), _core.CacheLayout([0x200000], 4, 1024),
                           None, None, 0, 0, 0, 0, -1)
    with pytest.raises(LLMException) as info:
        _core.translate_plan(plan, False, plane._spans(session, table, runtime))
    assert info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


class FakeStaging:
    def __init__(self):
        self.calls = []

    def transfer_device(self, session, table, plan, write, deadline, local_device, remote_device):
        self.calls.append((plan_rows(plan), write))


def plan_rows(plan):
    return [tuple(int(v) for v in row) for row in plan.descriptors()]


def test_a_transfer_touching_a_cache_the_peer_could_not_export_goes_through_staging():
    """VMM memory (torch's expandable segments) has no cudaIpcGetMemHandle: the owner lists no
    export for it, and the transfer is staged through host memory instead of failing."""
    runtime = FakeRuntime({H1: 1 << 20})
    plane = _plane(runtime)
    staging = FakeStaging()
    plane.sibling = {"staging": staging}.get  # the engine's staging plane, as its plane set gives it
    table = _table([(5, [0x1000], 4, 1024), (6, [0x100000], 4, 1024)])
    session = _session([[5, 1, [[H1.hex(), 0]]]])  # cache 6 is not exported
    local = _core.CacheLayout([0x200000], 4, 1024)
    plan = _core.plan_rows(_core.CacheLayout([0x100000], 4, 1024), local, None, None, 0, 0, 0, 0, -1)
    plane.transfer_device(session, table, plan, False, 0.0, True, True)
    assert staging.calls == [(plan_rows(plan), False)]
    assert runtime.opened == [H1]  # the exported cache is mapped as before, nothing else
    # Memory outside every registered range still fails, staged or not.
    stray = _core.plan_rows(_core.CacheLayout([0x900000], 4, 1024), local, None, None, 0, 0, 0, 0, -1)
    with pytest.raises(LLMException) as info:
        plane.transfer_device(session, table, stray, False, 0.0, True, True)
    assert info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert len(staging.calls) == 1


def test_mappings_the_peer_no_longer_lists_are_closed_and_close_releases_the_rest():
    runtime = FakeRuntime({H1: 1 << 20, H2: 1 << 20})
    plane = _plane(runtime)
    session = _session([[5, 1, [[H1.hex(), 0]]], [6, 2, [[H2.hex(), 0]]]])
    plane._spans(session, _table([(5, [0x1000], 4, 1024), (6, [0x100000], 4, 1024)]), runtime)
    assert sorted(runtime.opened) == sorted([H1, H2])
    # The peer unregistered cache 6: its new table and exports no longer list it.
    session.facts = {"cuda_ipc": {"generation_fd": 3, "exports": [[5, 1, [[H1.hex(), 0]]]]}}
    plane._spans(session, _table([(5, [0x1000], 4, 1024)], generation=2), runtime)
    assert runtime.closed == [runtime.bases[H2]]
    assert list(_maps(session)) == [(H1, 1)]
    plane.close(session)
    assert sorted(runtime.closed) == sorted([runtime.bases[H1], runtime.bases[H2]])
    assert _maps(session) == {}
    plane.close(session)  # idempotent
    assert len(runtime.closed) == 2


def test_a_new_registration_is_mapped_afresh_even_with_the_same_handle_bytes():
    """A runtime may hand out the same handle bytes for a new allocation where a freed one was:
    the export id of the registration tells them apart, so the old mapping is not written."""
    runtime = FakeRuntime({H1: 1 << 20})
    plane = _plane(runtime)
    session = _session([[5, 1, [[H1.hex(), 0]]]])
    plane._spans(session, _table([(5, [0x1000], 4, 1024)]), runtime)
    session.facts = {"cuda_ipc": {"generation_fd": 3, "exports": [[5, 7, [[H1.hex(), 0]]]]}}
    plane.on_table(session, None)
    assert runtime.closed == [runtime.bases[H1]] and _maps(session) == {}
    plane._spans(session, _table([(5, [0x1000], 4, 1024)], generation=2), runtime)
    assert runtime.opened == [H1, H1] and list(_maps(session)) == [(H1, 7)]


def test_the_plane_carries_only_device_memory_on_both_sides():
    plane = _plane(FakeRuntime({}))
    assert plane.carries(None, True, True)
    assert not plane.carries(None, True, False)
    assert not plane.carries(None, False, True)
    assert not plane.carries(None, False, False)


def test_a_process_without_ipc_offers_and_accepts_nothing():
    runtime = SimpleNamespace(host_addressable=True, ipc=False)
    plane = _plane(runtime)
    session = SimpleNamespace(unix=True, planes=("cuda_ipc",), pid=1, uid=0, cluster_id=3)
    assert plane.offer(session) == {}
    assert "cannot map" in plane.accept(session, {}, 0.0)


def test_translate_moves_only_the_peer_side():
    src = np.arange(64, dtype=np.uint8)
    plan = _core.plan_rows(_core.CacheLayout([src.ctypes.data], 4, 16), _core.CacheLayout([0x5000], 4, 16),
                           None, None, 1, 2, 0, 0, -1)
    moved = _core.translate_plan(plan, True, [(0x5000, 64, 0x9000)])
    assert moved.descriptors().tolist() == [[src.ctypes.data + 16, 0x9000 + 32, 16]]
