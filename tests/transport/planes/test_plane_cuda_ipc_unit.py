"""The ``cuda_ipc`` plane against fakes: what it believes of a peer's exports, and what it maps.

A peer's table reply is untrusted: its exports must be well formed, and every tensor must lie
inside the allocation that *this* process's runtime says it mapped, whatever the peer claims.
Mappings are opened once per handle and closed when the peer stops listing them or the link ends.

The owner's handles name whole allocations of its process: ``offer`` lists them only to a peer
``export_refusal`` lets through (a proven process of this user, not this one, offering the plane,
on a link with a secret or with the opt-in), and ``accept`` takes a link only towards such a peer,
each refusal saying why.
"""

from __future__ import annotations

import logging
import os
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest

from llm_datadist import _core
from llm_datadist._memory import Place
from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.transport.errors import ProtocolError
from llm_datadist.transport.planes import cuda_ipc
from llm_datadist.transport.shm import SharedCounter
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

    def ipc_export(self, addr):
        """``(handle, offset, allocation bytes)``: every address lies in H1, an allocation of
        ``sizes[H1]`` bytes at 0x1000."""
        return H1, addr - 0x1000, self.sizes[H1]


def _table(caches, generation=1):
    """A peer table of device caches: ``[(cache_id, [addrs], rows, row_bytes)]``."""
    return RemoteTable({"generation": generation, "blocks": [], "keys": [],
                        "caches": [[cid, "blocks", 1, len(addrs), rows, row, addrs, False]
                                   for cid, addrs, rows, row in caches]})


def _plane(runtime, **options):
    engine = SimpleNamespace(runtime=runtime, bind_thread=lambda: None, options=options, cluster_id=3,
                             generation_word=SimpleNamespace(fd=5, addr=0, value=1))
    return cuda_ipc.CudaIpcPlane(engine)


def _facts(exports, generation_fd=3):
    """A link's facts: the ``cuda_ipc`` entry of a table reply as the link keeps it (parsed)."""
    return {"cuda_ipc": cuda_ipc.CudaIpcPlane.parse_facts("cuda_ipc", {"generation_fd": generation_fd,
                                                                       "exports": exports})}


def _session(exports):
    """A link whose cuda_ipc state was made at link time (the counter is left unmapped)."""
    session = SimpleNamespace(cluster_id=7, facts=_facts(exports), plane_state={})
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
    [[5, 1, []]],                            # a cache of no tensor
    [[5, 1, [[H1.hex(), 0]]], [5, 2, [[H2.hex(), 0]]]],  # cache 5 twice
    [[5, 1, [[H1.hex(), 0]], "x"]],          # four fields
    [[5, 1, [[H1.hex(), 0, 0]]]],            # three fields
    [[5, 1, [[" " + H1.hex()[1:], 0]]]],     # 128 characters, but not 64 bytes of hex
    [[5, 1, [[[[]] * 64, 0]]]],              # a list for a handle
    [[5, 1, [[H1.hex(), 0]] * (cuda_ipc.MAX_EXPORTS + 1)]],
])
def test_malformed_exports_are_refused_when_the_reply_is_read(exports):
    """``parse_facts`` runs as the table reply arrives (``LinkManager._fetch_table``): malformed
    exports fail the link there, before anything could be mapped."""
    with pytest.raises(ProtocolError):
        _facts(exports)


@pytest.mark.parametrize("entry", ["x", [], {"exports": []}, {"generation_fd": -1, "exports": []},
                                   {"generation_fd": 2**31, "exports": []}, {"generation_fd": 3, "exports": {}},
                                   {"generation_fd": True, "exports": []}])
def test_a_malformed_cuda_ipc_entry_is_refused(entry):
    with pytest.raises(ProtocolError, match="malformed cuda_ipc entry"):
        cuda_ipc.CudaIpcPlane.parse_facts("cuda_ipc", entry)


def test_exports_are_kept_packed_and_read_back_as_sent():
    exports = [[9, 4, [[H2.hex(), 4096]]], [5, 1, [[H1.hex(), 0], [H2.hex(), 2**63 - 1]]]]
    facts = cuda_ipc.CudaIpcPlane.parse_facts("cuda_ipc", {"generation_fd": 3, "exports": exports, "pad": [[]] * 99})
    assert facts.generation_fd == 3
    kept = facts.exports
    assert kept.tensors(5) == [((H1, 1), 0), ((H2, 1), 2**63 - 1)] and kept.tensors(9) == [((H2, 4), 4096)]
    assert kept.tensors(6) is None and kept.tensor_count(6) == 0 and kept.tensor_count(5) == 2
    assert kept.mappings() == {(H1, 1), (H2, 1), (H2, 4)} and kept.cache_ids() == [5, 9]


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
    session.facts = _facts([[5, 1, [[H1.hex(), 0]]]])
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
    session.facts = _facts([[5, 7, [[H1.hex(), 0]]]])
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


# -- who gets the owner's handles ---------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _no_opt_in_from_outside(monkeypatch):
    monkeypatch.delenv(cuda_ipc.WITHOUT_SECRET_ENV, raising=False)


def _peer(**changes):
    """A link to a proven process of this user (not this one) offering cuda_ipc, with a secret."""
    fields = dict(unix=True, planes=["cuda_ipc", "tcp"], pid=os.getpid() + 1, uid=os.geteuid(), authenticated=True,
                  cluster_id=9, plane_state={})
    fields.update(changes)
    return SimpleNamespace(**fields)


def _record(cache_id=5, tensor_bytes=4096, addrs=(0x1000,)):
    return SimpleNamespace(cache_id=cache_id, addrs=list(addrs), tensor_bytes=tensor_bytes, placement=Place.DEVICE)


def _exporting(**options):
    plane = _plane(FakeRuntime({H1: 4096}), **options)
    plane.on_register(_record())
    return plane


REFUSED_PEERS = {
    "tcp": (dict(unix=False, pid=0, uid=-1), "TCP"),
    "not offered": (dict(planes=["cma", "tcp"]), "does not offer it"),
    "itself": (dict(pid=os.getpid()), "this process"),
    "unproven": (dict(pid=0), "this process"),
    "other user": (dict(uid=os.geteuid() + 1), "another user"),
    "no secret": (dict(authenticated=False), "no secret"),
}


@pytest.mark.parametrize("case", list(REFUSED_PEERS))
def test_the_owner_offers_no_handle_to_a_peer_it_does_not_trust(case):
    changes, why = REFUSED_PEERS[case]
    plane = _exporting()
    peer = _peer(**changes)
    assert why in plane.export_refusal(peer)
    assert plane.offer(peer) == {}


def test_the_owner_offers_its_handles_to_a_proven_peer_of_this_user_on_a_link_with_a_secret():
    plane = _exporting()
    assert plane.export_refusal(_peer()) is None
    assert plane.offer(_peer()) == {"cuda_ipc": {"generation_fd": 5, "exports": [[5, 1, [[H1.hex(), 0]]]]}}


@pytest.mark.parametrize("value, env, exports", [
    ("1", None, True), ("true", None, True), ("True", None, True), ("0", None, False), ("yes", None, False),
    (None, "1", True), (None, "true", True), (None, "0", False), (None, None, False),
    ("0", "1", False),  # the option, where given, decides
])
def test_the_opt_in_extends_exports_to_links_without_a_secret_and_to_nothing_else(monkeypatch, value, env, exports):
    if env is not None:
        monkeypatch.setenv(cuda_ipc.WITHOUT_SECRET_ENV, env)
    options = {} if value is None else {cuda_ipc.WITHOUT_SECRET_OPTION: value}
    plane = _exporting(**options)
    assert (plane.offer(_peer(authenticated=False)) != {}) == exports
    for case in ("tcp", "not offered", "itself", "other user"):  # never another process's, opt-in or not
        assert plane.offer(_peer(**REFUSED_PEERS[case][0])) == {}


def test_info_says_who_gets_handles_and_that_a_handle_is_a_whole_allocation(monkeypatch):
    text = cuda_ipc.CudaIpcPlane.trust()
    assert "of this user" in text and "SO_PEERCRED" in text and "whole cudaMalloc allocation" in text
    assert "links authenticated with a secret" in text and "allocate_cache" in text
    monkeypatch.setenv(cuda_ipc.WITHOUT_SECRET_ENV, "1")
    assert "is on" in cuda_ipc.CudaIpcPlane.trust()


def test_a_tensor_in_a_larger_allocation_is_logged_once_per_registration_and_counted(caplog):
    plane = _plane(FakeRuntime({H1: 1 << 20}))
    with caplog.at_level(logging.WARNING, logger="llm_datadist"):
        plane.on_register(_record(5, 4096, (0x1000, 0x2000)))
        plane.on_register(_record(6, 1 << 20))          # the whole allocation: nothing to say
        plane.on_register(_record(7, 4096, (0x1000,)))  # at the base, but smaller than the allocation
    warnings = [r.getMessage() for r in caplog.records if "larger GPU allocations" in r.getMessage()]
    assert len(warnings) == 2 and plane.partial_registrations == 2
    assert "2 of the 2 tensors of DEVICE cache 5" in warnings[0] and "cache 7" in warnings[1]


# -- whom the peer maps (accept) -----------------------------------------------------------------------

@pytest.fixture
def other_process():
    """A process of this user holding a registry generation counter at a descriptor number of its
    own, as an owner does: ``(pid, fd)``."""
    counter = SharedCounter(1)
    proc = subprocess.Popen(["sleep", "60"], pass_fds=[counter.fd])
    try:
        yield proc.pid, counter.fd
    finally:
        proc.kill()
        proc.wait()
        counter.close()


def _accepting(session):
    plane = _plane(FakeRuntime({H1: 1 << 20}))
    session.plane_state["cuda_ipc"] = plane.link_state(session)
    return plane


@pytest.mark.parametrize("case, why", [("tcp", "TCP"), ("not offered", "does not offer it"),
                                       ("itself", "this process"), ("other user", "another user")])
def test_the_peer_maps_nothing_of_a_process_the_kernel_did_not_prove_to_be_another_one_of_this_user(
        other_process, case, why):
    """Every fact the owner sent is usable (its counter maps): only who the peer is refuses it."""
    pid, fd = other_process
    facts = _facts([], generation_fd=fd)
    changes = dict(REFUSED_PEERS[case][0])
    if case != "itself":
        changes["pid"] = pid  # a pid whose counter maps: nothing but the refusal stops the accept
    session = _peer(**changes)
    plane = _accepting(session)
    reason = plane.accept(session, facts, 0.0)
    assert reason is not None and why in reason
    assert session.plane_state["cuda_ipc"].generation is None
    # The same facts from a proven process of this user are taken.
    honest = _peer(pid=pid)
    plane = _accepting(honest)
    assert plane.accept(honest, facts, 0.0) is None
    assert honest.plane_state["cuda_ipc"].generation.value == 1
    plane.close(honest)


def test_the_peer_says_why_it_has_no_exports_to_map(other_process):
    session = _peer(pid=other_process[0])
    plane = _accepting(session)
    assert "exports no GPU memory to this process" in plane.accept(session, {}, 0.0)
