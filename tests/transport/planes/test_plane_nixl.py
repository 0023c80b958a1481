"""The ``nixl`` plane (NIXL's UCX backend, here over UCX TCP on loopback).

Unit tests (no NIXL needed): the metadata reader refuses every blob that is not as the plane makes
it, the agent names, UCX's settings and who may use the plane. Live tests (NIXL installed; skipped
with the install line otherwise): clusters in their own processes on 127.0.0.1, each with a
secret, ``LLM_DATADIST_NIXL_TCP=1`` and UCX held to ``lo`` (``UCX_TLS=tcp``,
``UCX_NET_DEVICES=lo``) before any agent exists:

* push and pull of blocks and of layer ranges, 2 MiB and 16 KiB blocks, and a byte range inside
  blocks, byte-exact, every other byte of both caches (the guards around every range) unchanged;
  no process holds a socket on an address other than 127.0.0.1;
* without a secret nixl is never offered and forcing it fails the link naming why; metadata naming
  another agent, cut short or too large is refused before NIXL sees it, and the server goes on
  serving (a relink of the same agent with its honest metadata works, which a blob NIXL had half
  loaded would prevent);
* a peer SIGKILLed mid-transfer fails the transfer within the deadline and leaves another link
  alone; a peer stopped mid-transfer (SIGSTOP: a silent partition) fails it with LLM_TIMEOUT within
  the deadline, and once it runs again the link is made anew and moves bytes.

The processes exit with status 0 after finalize.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import re
import signal
import struct
import time
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

import numpy as np
import optional_deps
import pytest

from llm_datadist import BlocksCacheKey, CacheDesc, DataType, Placement
from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.testing import Cluster, link
from llm_datadist.transport.errors import ProtocolError
from llm_datadist.transport.planes import nixl
from proc_sockets import foreign_sockets

S = LLMStatusCode
SECRET = {"llm.LinkSecret": "nixl-test-secret-0123456789"}
SYNC_MS = 3000  # each transfer's deadline (llm.SyncKvCacheWaitTime)
TENSORS = 4     # two layers of K and V
MODEL_ID = 0
UCX_LOOPBACK = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_MODULES": "^efa", nixl.TCP_ENV: "1"}

#: Set by .ci/run, which installs NIXL: its tests must run there, a missing NIXL fails them.
REQUIRE_ENV = optional_deps.require_env("nixl")


def need_nixl() -> None:
    """Skip (fail where ``LLM_DATADIST_REQUIRE_NIXL=1``) without NIXL."""
    if not nixl.installed():
        optional_deps.skip_without("nixl", f"NIXL is not installed ({nixl.INSTALL})")



# -- a reference writer of NIXL metadata (the layout parse_metadata reads) ----------------------------
def _field(tag: bytes, value: bytes) -> bytes:
    return tag + struct.pack("<Q", len(value)) + value + b"|"


def metadata_blob(name: str, regions=((0, 0x10000, 4096, 0),), conns=((b"UCX", b"\x01" * 48),),
                  backend: bytes = b"UCX", meta: bytes = b"rkey") -> bytes:
    """NIXL 1.5's ``getLocalMD`` layout: the agent, its connections, one section per memory type."""
    blob = b"nixlSerDes|" + _field(b"Agent", name.encode()) + _field(b"Conns", struct.pack("<Q", len(conns)))
    for kind, conn in conns:
        blob += _field(b"t", kind) + _field(b"c", conn)
    blob += _field(b"", b"MemSection")
    by_type: Dict[int, list] = {}
    for mem, addr, nbytes, device in regions:
        by_type.setdefault(mem, []).append((addr, nbytes, device))
    blob += _field(b"nixlSecElms", struct.pack("<Q", len(by_type)))
    for mem, rows in by_type.items():
        blob += _field(b"bknd", backend) + _field(b"nixlDList", b"nixlSDList") + _field(b"t", struct.pack("<I", mem))
        blob += _field(b"n", struct.pack("<Q", len(rows)))
        for addr, nbytes, device in rows:
            blob += _field(b"", struct.pack("<QQQ", addr, nbytes, device) + meta)
    return blob


NAME = "llmdd-7-0123456789abcdef"


def test_metadata_as_the_plane_makes_it_is_read_region_by_region():
    blob = metadata_blob(NAME, regions=[(0, 0x1000, 64, 0), (0, 0x9000, 8, 0), (1, 0x7f0000, 1 << 20, 3)])
    assert nixl.parse_metadata(blob, NAME) == [nixl.Region(0, 0x1000, 64, 0), nixl.Region(0, 0x9000, 8, 0),
                                              nixl.Region(1, 0x7f0000, 1 << 20, 3)]


@pytest.mark.parametrize("blob, said", [
    (metadata_blob(NAME)[:-1], "cut short"),
    (metadata_blob(NAME)[:40], "cut short"),
    (metadata_blob(NAME) + b"x", "1 bytes after the last field"),
    (b"", "does not start as NIXL metadata"),
    (metadata_blob("llmdd-7-fedcba9876543210"), "names agent"),
    (metadata_blob(NAME, conns=()), "exactly one connection"),
    (metadata_blob(NAME, conns=((b"UCX", b"a"), (b"UCX", b"b"))), "exactly one connection"),
    (metadata_blob(NAME, conns=((b"GDS", b"a"),)), "not UCX's"),
    (metadata_blob(NAME, conns=((b"UCX", b""),)), "connection is empty"),
    (metadata_blob(NAME, backend=b"POSIX"), "another backend"),
    (metadata_blob(NAME, regions=[(2, 0x1000, 64, 0)]), "memory type 2"),
    (metadata_blob(NAME, regions=[(0, 0x1000, 0, 0)]), "region 0x1000+0"),
    (metadata_blob(NAME, regions=[(0, 2**64 - 8, 16, 0)]), "region"),
    (metadata_blob(NAME, meta=b"x" * (nixl.MAX_REGION_META_BYTES + 1)), "field (untagged) of"),
    (metadata_blob(NAME, conns=((b"UCX", b"c" * (nixl.MAX_CONNECTION_BYTES + 1)),)), "field c of"),
    (metadata_blob(NAME) + b"\0" * nixl.MAX_METADATA_BYTES, "at most"),
], ids=["cut by one byte", "cut to 40 bytes", "a byte after it", "empty", "another agent", "no connection",
        "two connections", "a connection of another backend", "an empty connection", "a section of another backend",
        "memory type 2", "an empty region", "a region past 2**64", "oversized region meta", "oversized connection",
        "oversized"])
def test_metadata_not_as_the_plane_makes_it_is_refused_naming_why(blob, said):
    with pytest.raises(ValueError, match=re.escape(said)):
        nixl.parse_metadata(blob, NAME)


def test_a_length_field_claiming_more_than_the_blob_is_refused():
    blob = bytearray(metadata_blob(NAME))
    at = blob.index(b"Agent") + len(b"Agent")
    blob[at:at + 8] = struct.pack("<Q", 2**63)
    with pytest.raises(ValueError, match="Agent of"):
        nixl.parse_metadata(bytes(blob), NAME)


def test_agent_names_carry_the_cluster_id_and_16_random_hex_digits():
    first, second = nixl.agent_name(42), nixl.agent_name(42)
    assert first != second
    assert nixl._AGENT_NAME.fullmatch(first).group(1) == "42"


def test_ucx_settings_hold_ucx_to_one_interface_or_to_the_rdma_ports():
    assert nixl.ucx_settings("tcp", "lo") == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_MODULES": "^efa"}
    assert nixl.ucx_settings("tcp", "eth1", cuda=True)["UCX_TLS"] == "tcp,cuda_copy"
    assert nixl.ucx_settings("rdma", devices=["mlx5_0:1", "mlx5_1:1"]) == {
        "UCX_TLS": "^tcp", "UCX_NET_DEVICES": "mlx5_0:1,mlx5_1:1", "UCX_MODULES": "^efa"}
    assert "UCX_MODULES" not in nixl.ucx_settings("rdma", devices=["efa0:1"])


def test_ucx_settings_are_fixed_at_the_first_agent_and_a_link_needing_others_is_told(monkeypatch):
    monkeypatch.setattr(nixl.environment, "_ucx_fixed", None)
    monkeypatch.setattr(nixl.environment, "_ucx_mode", None)
    for key in ("UCX_TLS", "UCX_NET_DEVICES", "UCX_MODULES"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("UCX_MODULES", "^efa,^ib")  # set by the user: left alone, never compared
    assert nixl.fix_ucx("tcp", nixl.ucx_settings("tcp", "lo")) is None
    in_force = tuple(os.environ[key] for key in ("UCX_TLS", "UCX_NET_DEVICES", "UCX_MODULES"))
    assert in_force == ("tcp", "lo", "^efa,^ib")
    assert nixl.fix_ucx("tcp", nixl.ucx_settings("tcp", "lo")) is None
    why = nixl.fix_ucx("tcp", nixl.ucx_settings("tcp", "eth0"))
    assert "UCX_NET_DEVICES=lo" in why and "UCX_NET_DEVICES=eth0" in why and "process-wide" in why
    assert "tcp mode" in nixl.fix_ucx("rdma", nixl.ucx_settings("rdma", devices=["mlx5_0:1"]))


def test_the_interface_of_loopback_is_lo_and_loopback_is_this_host():
    assert nixl.interface_of("127.0.0.1") == "lo"
    assert nixl.is_this_host("127.0.0.1") and nixl.is_this_host("::ffff:127.0.0.1")
    assert not nixl.is_this_host("192.0.2.77")  # TEST-NET-1: no host has it


class _Engine(SimpleNamespace):
    pass


def _plane(options: Dict[str, str]) -> nixl.NixlPlane:
    engine = _Engine(cluster_id=1, options=options, runtime=None, device_id=0,
                     generation_word=SimpleNamespace(addr=0, value=1, fd=-1))
    return nixl.NixlPlane(engine)


def _session(authenticated=True, unix=False, planes=("nixl", "tcp"), peer_ip="192.0.2.77"):
    class _Sock:
        def getsockname(self):
            return ("127.0.0.1", 1)

        def getpeername(self):
            return (peer_ip, 2)
    return SimpleNamespace(cluster_id=2, authenticated=authenticated, unix=unix, planes=list(planes),
                           channels=[SimpleNamespace(sock=_Sock())], incoming=[], plane_state={}, facts={})


def test_without_a_secret_nixl_is_neither_offered_nor_accepted():
    plane = _plane({"llm.DataPlane": "nixl"})
    session = _session(authenticated=False)
    assert plane.offer(session) == {}
    assert plane.accept(session, {}, time.monotonic() + 1) == nixl.NO_SECRET
    assert "secret" in nixl.NO_SECRET and "all of this process's memory" in nixl.NO_SECRET


def test_auto_keeps_nixl_off_links_to_this_host_and_forcing_it_allows_them(monkeypatch):
    monkeypatch.setenv(nixl.TCP_ENV, "1")
    auto, forced = _plane(dict(SECRET)), _plane(dict(SECRET, **{"llm.DataPlane": "nixl"}))
    same_host = _session(peer_ip="127.0.0.1")
    assert "the peer is on this host" in auto._refusal(same_host)
    assert auto._refusal(same_host, accepting=False) == forced._refusal(same_host)  # offered to a peer that forced it
    assert auto._refusal(_session(unix=True)).startswith("the link's connections are Unix sockets")
    assert auto._refusal(_session(planes=("tcp",))) == "the peer does not offer it"
    if nixl.installed():
        assert forced._refusal(same_host) is None and auto._refusal(_session()) is None
    else:
        assert nixl.INSTALL in forced._refusal(same_host)
    tcp_side = _plane(dict(SECRET, **{"llm.DataPlane": "tcp"}))
    assert "llm.DataPlane is tcp" in tcp_side._refusal(_session())


def test_without_rdma_and_without_tcp_mode_nixl_says_how_to_run_it(monkeypatch):
    monkeypatch.delenv(nixl.TCP_ENV, raising=False)
    monkeypatch.setattr(nixl.environment, "rdma_ports", lambda root="": [])
    why = _plane(dict(SECRET, **{"llm.DataPlane": "nixl"}))._refusal(_session())
    if nixl.installed():
        assert "no active RDMA port" in why and f"{nixl.TCP_ENV}=1" in why
    else:
        assert nixl.INSTALL in why


def test_a_protected_link_gets_no_nixl_offered_or_accepted(monkeypatch):
    """NIXL's transfers bypass the link's sealed connections (``llm.LinkProtection``)."""
    monkeypatch.setenv(nixl.TCP_ENV, "1")
    forced = _plane(dict(SECRET, **{"llm.DataPlane": "nixl"}))
    for mode in ("integrity", "encrypt"):
        session = _session()
        session.protection = mode
        assert f"the link is protected ({mode}" in forced._refusal(session)
        assert forced.offer(session) == {}
        assert forced.accept(session, {}, time.monotonic() + 1).startswith("the link is protected")
    session = _session()
    session.protection = "off"
    assert forced._refusal(session) is None or nixl.INSTALL in forced._refusal(session)


def _entry(name: str = "llmdd-2-00112233445566ff", generation: int = 0x5000, **changes) -> Dict:
    """A ``nixl`` entry of a table reply as ``offer`` writes it, for agent ``name``."""
    blob = metadata_blob(name, regions=[(0, 0x5000, 4096, 0)])
    entry = {"agent": name, "md": base64.b64encode(blob).decode(), "generation": generation, "vram": None}
    entry.update(changes)
    return entry


def _facts(**changes) -> Dict:
    """A link's facts holding the parsed ``nixl`` entry."""
    return {"nixl": nixl.NixlPlane.parse_facts("nixl", _entry(**changes))}


@pytest.mark.parametrize("entry, said", [
    ("not a dict", "malformed nixl entry"),
    (_entry(agent="llmdd-2-XYZ"), "is not llmdd-<cluster id>-<16 hex>"),
    (_entry(agent="llmdd-2-00112233445566ff" + "0" * 100_000), "is not llmdd-"),
    (_entry(md="!!!"), "not base64"),
    (_entry(md="A" * (nixl.MAX_METADATA_BYTES * 2)), "more than"),
    (_entry(generation=True), "malformed"),
    (_entry(generation=0), "malformed"),
    (_entry(vram=-1), "malformed"),
    (_entry(md=[[]] * 1000), "malformed"),
], ids=["not a dict", "agent name", "long agent name", "not base64", "oversized", "bool generation",
        "zero generation", "negative vram", "md a list"])
def test_a_malformed_nixl_entry_is_refused_when_the_reply_is_read(entry, said):
    """``parse_facts`` runs as the table reply arrives (``LinkManager._fetch_table``): a malformed
    entry fails the link there, and nothing of it is kept."""
    with pytest.raises(ProtocolError, match=re.escape(said)):
        nixl.NixlPlane.parse_facts("nixl", entry)


def test_the_kept_nixl_entry_is_typed_and_bounded():
    facts = nixl.NixlPlane.parse_facts("nixl", _entry(vram=3, pad=[[]] * 10_000))  # unknown fields are dropped
    assert facts == nixl.NixlFacts("llmdd-2-00112233445566ff", 2, metadata_blob(
        "llmdd-2-00112233445566ff", regions=[(0, 0x5000, 4096, 0)]), 0x5000, 3)


def test_hostile_facts_are_refused_before_any_agent_exists(monkeypatch):
    monkeypatch.setenv(nixl.TCP_ENV, "1")
    plane = _plane(dict(SECRET))
    session = _session()
    assert plane._read_facts(session, _facts())[0] == "llmdd-2-00112233445566ff"
    assert plane._read_facts(session, _facts(vram=1))[3] == 1
    for facts, said in [(_facts(generation=0x9000), "generation word"),
                        (_facts(md=base64.b64encode(metadata_blob("llmdd-2-00112233445566ff")[:-3]).decode()),
                         "cut short"),
                        (_facts(md=_entry(name="llmdd-2-ffeeddccbbaa9988")["md"]), "names agent"),
                        ({}, "sent no NIXL metadata")]:
        with pytest.raises(ValueError, match=said):
            plane._read_facts(session, facts)
    assert plane._agent is None
    if nixl.installed():
        refused = plane.accept(session, _facts(name="llmdd-9-00112233445566ff"), time.monotonic() + 1)
        assert refused.startswith("refused the peer's NIXL metadata before loading it")
        assert plane.counters()["nixl_refused_metadata"] == 1 and plane._agent is None


def test_metadata_of_an_agent_of_another_cluster_is_refused_however_well_formed():
    """The agent's name, the name inside its metadata and the generation word agree: only the
    cluster id in the name (3) is not the link's (2), and that alone refuses it."""
    session = _session()
    assert session.cluster_id == 2
    facts = _facts(name="llmdd-3-00112233445566ff")
    assert nixl.parse_metadata(facts["nixl"].blob, "llmdd-3-00112233445566ff")  # well formed for cluster 3
    with pytest.raises(ValueError, match="llmdd-3-00112233445566ff is not one of cluster 2"):
        _plane(dict(SECRET))._read_facts(session, facts)


class _FakeAgent:
    """Stands in for NIXL's agent at accept: ``load`` reports the name ``loads_as``; what is
    loaded, prepared and removed is recorded."""

    errors = ()
    name = "llmdd-1-0000000000000001"

    def __init__(self, loads_as: str) -> None:
        self.loads_as, self.loaded, self.prepared, self.removed = loads_as, [], [], []

    def load(self, blob: bytes) -> str:
        self.loaded.append(blob)
        return self.loads_as

    def prepare(self, peer: str, mem: int, rows) -> int:
        self.prepared.append(peer)
        return 7

    def remove(self, name: str) -> None:
        self.removed.append(name)

    def release_list(self, handle: int) -> None:
        pass


@pytest.mark.parametrize("loads_as, reserved", [("llmdd-2-ffeeddccbbaa9988", False),
                                                ("llmdd-2-ffeeddccbbaa9988", True)],
                         ids=["another name", "another link's name"])
def test_metadata_nixl_loads_under_another_name_than_announced_is_refused_and_unloaded(monkeypatch, loads_as,
                                                                                      reserved):
    """Whatever the checks before it passed, metadata NIXL reports loading under another agent
    name than the one announced is refused: the link gets no plane, the counter says so, the
    announced name is free again, and the name NIXL used is unloaded unless another link holds it."""
    plane = _plane(dict(SECRET))
    session = _session()
    agent = _FakeAgent(loads_as)
    monkeypatch.setattr(plane, "_refusal", lambda session, accepting=True: None)
    monkeypatch.setattr(plane, "_ensure_agent", lambda session: (agent, None))
    other_link = nixl.NixlLink()
    if reserved:
        plane._loaded[loads_as] = other_link
    session.plane_state["nixl"] = plane.link_state(session)
    why = plane.accept(session, _facts(), time.monotonic() + 1)
    assert why is not None and f"NIXL loaded it as '{loads_as}'" in why
    assert len(agent.loaded) == 1 and agent.prepared == []
    assert plane.counters()["nixl_refused_metadata"] == 1
    assert "llmdd-2-00112233445566ff" not in plane._loaded
    assert session.plane_state["nixl"].remote is None
    if reserved:
        assert agent.removed == ["llmdd-2-00112233445566ff"] and plane._loaded[loads_as] is other_link
    else:
        assert agent.removed == ["llmdd-2-00112233445566ff", loads_as]


# -- live: clusters in processes ----------------------------------------------------------------
def _content(seed: int, tensor: int, block: int, block_bytes: int) -> np.ndarray:
    return np.random.default_rng((seed, tensor, block)).integers(0, 256, block_bytes, dtype=np.uint8)


def _register(state, name: str, seed: int, blocks: int, block_bytes: int) -> None:
    arrays = [np.concatenate([_content(seed, t, b, block_bytes) for b in range(blocks)]) for t in range(TENSORS)]
    desc = CacheDesc(TENSORS, [blocks, block_bytes], DataType.DT_UINT8, Placement.HOST)
    key = BlocksCacheKey(state.cluster_id, MODEL_ID) if name == "main" else None
    state.caches[name] = state.cm.register_blocks_cache(desc, [a.ctypes.data for a in arrays], key)
    state.arrays[name] = arrays


def _reregister(state, name: str, seed: int, blocks: int, block_bytes: int) -> None:
    state.cm.unregister_cache(state.caches.pop(name).cache_id)
    _register(state, name, seed, blocks, block_bytes)


def _digests(state, name: str, block_bytes: int) -> List[List[str]]:
    return [[hashlib.sha1(block).hexdigest() for block in array.reshape(-1, block_bytes)]
            for array in state.arrays[name]]


def _move(state, op: str, remote_id: int, name: str, src, dst, layers: Optional[int] = None) -> None:
    kwargs = {} if layers is None else dict(src_layer_range=range(layers, layers + 1),
                                            dst_layer_range=range(layers, layers + 1), tensor_num_per_layer=2)
    fn = state.cm.push_blocks if op == "push" else state.cm.pull_blocks
    fn(BlocksCacheKey(remote_id, MODEL_ID), state.caches[name], list(src), list(dst), **kwargs)


def _pull_range(state, remote_id: int, name: str, src, dst, src_offset: int, dst_offset: int, nbytes: int) -> None:
    state.dd.engine.pull_block_range(remote_id, MODEL_ID, state.caches[name].cache_id, src, dst, src_offset,
                                     dst_offset, nbytes)


def _plane_of(state, remote_id: int) -> str:
    return state.dd.engine.links.data_plane(remote_id)


def _stats(state) -> Dict[str, int]:
    return state.dd.engine.link_stats()


def _facts_of(state, remote_id: int) -> Dict:
    return dict(state.dd.engine.links.peer(remote_id).facts)


def _capture_logs(state) -> None:
    records = state.scratch.setdefault("logs", [])
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("llm_datadist").addHandler(handler)


def _logs(state) -> List[str]:
    return list(state.scratch.get("logs", []))


def _link_status(state, remote_id: int, ip: str, port: int, timeout_ms: int = 20000) -> int:
    return int(state.dd.engine.links.link(remote_id, ip, port, timeout_ms))


def _unlink(state, remote_id: int) -> int:
    return int(state.dd.engine.links.unlink(remote_id, 2000, False))


def _timed_move(state, op: str, remote_id: int, name: str, src, dst) -> Tuple[int, float, float]:
    started = time.monotonic()
    try:
        _move(state, op, remote_id, name, src, dst)
        status = 0
    except LLMException as exc:
        status = int(exc.status_code)
        state.scratch["why"] = str(exc)
    return status, started, time.monotonic()


def _why(state) -> str:
    return state.scratch.get("why", "")


def _loop(state, op: str, remote_id: int, name: str, blocks, seconds: float) -> Tuple[int, float, float, int]:
    """Move ``blocks`` -> ``blocks`` until a transfer fails: ``(status, its start, its end, done)``."""
    done, stop = 0, time.monotonic() + seconds
    while time.monotonic() < stop:
        status, started, ended = _timed_move(state, op, remote_id, name, blocks, blocks)
        if status:
            return status, started, ended, done
        done += 1
    return 0, 0.0, 0.0, done


@pytest.fixture
def loopback_env(monkeypatch) -> None:
    """UCX held to lo (and nixl allowed over TCP) in this process's environment, which the cluster
    processes inherit: set before any agent exists, so no UCX socket leaves loopback."""
    need_nixl()
    for key, value in UCX_LOOPBACK.items():
        monkeypatch.setenv(key, value)


def _cluster(stack: contextlib.ExitStack, cluster_id: int, listen: bool = False, plane: Optional[str] = "nixl",
             secret: bool = True) -> Cluster:
    options = dict(SECRET) if secret else {}
    options["llm.SyncKvCacheWaitTime"] = str(SYNC_MS)
    cluster = Cluster(cluster_id, "PROMPT" if listen else "DECODER", listen=listen, plane=plane, options=options)
    stack.callback(cluster.close)
    return cluster


class Expected:
    """What a cluster's cache ``name`` must hold, block by block: the (seed, tensor, block) whose
    content each block has."""

    def __init__(self, seed: int, blocks: int, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.origin = [[(seed, t, b) for b in range(blocks)] for t in range(TENSORS)]

    def copy(self, source: "Expected", src, dst, tensors=range(TENSORS)) -> None:
        for t in tensors:
            for s, d in zip(src, dst):
                self.origin[t][d] = source.origin[t][s]

    def digests(self) -> List[List[str]]:
        return [[hashlib.sha1(_content(*origin, self.block_bytes)).hexdigest() for origin in tensor]
                for tensor in self.origin]


def test_push_and_pull_blocks_and_layer_ranges_byte_exact_over_loopback(loopback_env):
    """Both sides force nixl with a secret; 2 MiB and 16 KiB blocks in random order, all tensors
    and one layer (two of four tensors), then a byte range inside blocks; every block of both
    caches is compared (an untouched one is a guard), and neither process holds a socket off
    127.0.0.1. Both processes exit with status 0."""
    with contextlib.ExitStack() as stack:
        server = _cluster(stack, 1, listen=True)
        client = _cluster(stack, 2)
        rng = np.random.default_rng(5)
        sizes = [(2 << 20, 6), (16 << 10, 48)]
        for block_bytes, blocks in sizes:
            server.call(_register, f"c{block_bytes}", 10, blocks, block_bytes)
            client.call(_register, f"c{block_bytes}", 20, blocks, block_bytes)
        server.call(_register, "main", 11, 4, 4096)  # the keyed one: the model_id the pushes name
        assert link(client, server, 30000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert client.call(_plane_of, 1) == "nixl" and server.call(_plane_of, 2) == "nixl"

        # The blocks keys name one cache per side: re-register each size under the model id in turn.
        for block_bytes, blocks in sizes:
            name = f"c{block_bytes}"
            server.call(_reregister, "main", 10, blocks, block_bytes)
            client.call(_reregister, name, 20, blocks, block_bytes)
            on_server, on_client = Expected(10, blocks, block_bytes), Expected(20, blocks, block_bytes)
            half = blocks // 2
            moves = [("push", None), ("pull", None), ("push", 1), ("pull", 0)]
            for op, layer in moves:
                src = rng.permutation(blocks)[:half].tolist()
                dst = rng.permutation(blocks)[:half].tolist()
                client.call(_move, op, 1, name, src, dst, layer)
                tensors = range(TENSORS) if layer is None else range(2 * layer, 2 * layer + 2)
                if op == "push":
                    on_server.copy(on_client, src, dst, tensors)
                else:
                    on_client.copy(on_server, src, dst, tensors)
                assert server.call(_digests, "main", block_bytes) == on_server.digests(), (op, layer, block_bytes)
                assert client.call(_digests, name, block_bytes) == on_client.digests(), (op, layer, block_bytes)
            if block_bytes == 16 << 10:  # a byte range inside two blocks: the bytes around it stay
                before = client.call(_snapshot, name)
                client.call(_pull_range, 1, name, [3, 5], [0, 1], 100, 200, 1000)
                after = client.call(_snapshot, name)
                remote = server.call(_snapshot, "main")
                for t in range(TENSORS):
                    want = before[t].reshape(blocks, block_bytes).copy()
                    src_blocks = remote[t].reshape(blocks, block_bytes)
                    want[0, 200:1200] = src_blocks[3, 100:1100]
                    want[1, 200:1200] = src_blocks[5, 100:1100]
                    assert np.array_equal(after[t].reshape(blocks, block_bytes), want)

        stats = client.call(_stats)
        assert (stats["nixl_failures"], stats["nixl_timeouts"], stats["nixl_refused_metadata"]) == (0, 0, 0)
        for who in (server, client):
            assert foreign_sockets(who.pid, {"127.0.0.1"}) == []
        processes = [server.process, client.process]
    assert [p.exitcode for p in processes] == [0, 0]


def _snapshot(state, name: str) -> List[np.ndarray]:
    return [a.copy() for a in state.arrays[name]]


def test_without_a_secret_nixl_is_not_offered_and_forcing_it_fails_the_link_naming_why(loopback_env):
    with contextlib.ExitStack() as stack:
        server = _cluster(stack, 1, listen=True, plane=None, secret=False)
        forced = _cluster(stack, 2, secret=False)
        forced.call(_capture_logs)
        assert link(forced, server, 20000)[1] == [S.LLM_LINK_FAILED]
        assert any("llm.DataPlane=nixl but the link has no secret" in line for line in forced.call(_logs))
        auto = _cluster(stack, 3, plane=None, secret=False)
        assert link(auto, server, 20000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert auto.call(_plane_of, 1) != "nixl" and "nixl" not in auto.call(_facts_of, 1)
        # No offer without an agent: the server never made one, though a peer asked for nixl.
        assert server.call(_agent_made) is False and forced.call(_agent_made) is False
        assert server.call(_stats)["nixl_refused_metadata"] == 0


def _agent_made(state) -> bool:
    plane = state.dd.engine.links.planes["nixl"]
    return plane._agent is not None or plane._offered is not None


def _tamper(state, how: str) -> None:
    """Make this cluster's NIXL offers hostile (``how``), or honest again ("honest")."""
    from llm_datadist.transport.planes.nixl import NixlPlane
    plane = state.dd.engine.links.planes["nixl"]
    honest = NixlPlane.offer.__get__(plane)
    if how == "honest":
        plane.__dict__.pop("offer", None)
        return

    def offer(session):
        facts = honest(session)
        info = dict(facts.get("nixl") or {})
        if not info:
            return facts
        blob = base64.b64decode(info["md"])
        if how == "other agent":  # the blob names another agent than the one announced
            other = info["agent"][:-1] + ("0" if info["agent"][-1] != "0" else "1")
            blob = blob.replace(info["agent"].encode(), other.encode(), 1)
        elif how == "other cluster":  # announced and loaded under another cluster's name
            other = "llmdd-77-" + info["agent"].rsplit("-", 1)[1]
            blob = blob.replace(info["agent"].encode(), other.encode(), 1)
            info["agent"] = other
        elif how == "truncated":
            blob = blob[:-7]
        elif how == "oversized":
            blob = blob + b"\0" * nixl.MAX_METADATA_BYTES
        info["md"] = base64.b64encode(blob).decode()
        return {"nixl": info}
    plane.offer = offer


def test_hostile_metadata_is_refused_before_nixl_sees_it_and_the_server_goes_on(loopback_env):
    """A peer with the secret offers metadata naming another agent, cut short or too large: the
    server refuses it before loading (its counters say so: too large, as the table reply is
    read, ``malformed_tables``; the rest at accept, ``nixl_refused_metadata``), the link fails,
    and the server serves on: the same peer, honest again, links and moves bytes -- which NIXL
    1.5.1 would not allow had it half-loaded the cut blob under that agent's name."""
    with contextlib.ExitStack() as stack:
        server = _cluster(stack, 1, listen=True)
        server.call(_register, "main", 10, 8, 4096)
        hostile = _cluster(stack, 2)
        hostile.call(_register, "c", 20, 8, 4096)
        refused = {"nixl_refused_metadata": 0, "malformed_tables": 0}
        for how, counter in (("other agent", "nixl_refused_metadata"), ("other cluster", "nixl_refused_metadata"),
                             ("truncated", "nixl_refused_metadata"), ("oversized", "malformed_tables")):
            hostile.call(_tamper, how)
            hostile.call(_link_status, 1, *server.address)
            refused[counter] += 1
            deadline = time.monotonic() + 10
            while _refusals(server) != refused and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _refusals(server) == refused, how
            deadline = time.monotonic() + 10
            while 2 in server.call(_linked) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert 2 not in server.call(_linked), how
            hostile.call(_unlink, 1)
        hostile.call(_tamper, "honest")
        assert hostile.call(_link_status, 1, *server.address) == S.LLM_SUCCESS
        hostile.call(_move, "push", 1, "c", [0, 1], [6, 7])
        assert server.call(_digests, "main", 4096)[0][6:] == hostile.call(_digests, "c", 4096)[0][:2]
        assert server.call(_plane_of, 2) == "nixl"


def _refusals(cluster) -> Dict[str, int]:
    stats = cluster.call(_stats)
    return {name: stats[name] for name in ("nixl_refused_metadata", "malformed_tables")}


def _linked(state) -> List[int]:
    return state.dd.engine.links.linked_clusters()


def test_a_peer_killed_mid_transfer_fails_it_in_time_and_another_link_goes_on(loopback_env):
    with contextlib.ExitStack() as stack:
        doomed = _cluster(stack, 1, listen=True)
        other = _cluster(stack, 3, listen=True)
        client = _cluster(stack, 2)
        for who, seed in ((doomed, 10), (other, 30)):
            who.call(_register, "main", seed, 16, 1 << 20)
        client.call(_register, "main", 20, 16, 1 << 20)
        assert link(client, doomed, 30000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert link(client, other, 30000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        client.send(_loop, "push", 1, "main", list(range(16)), 30)
        time.sleep(0.5)
        killed_at = time.monotonic()
        os.kill(doomed.pid, signal.SIGKILL)
        status, started, ended, done = client.result(60)
        assert status in (S.LLM_LINK_FAILED, S.LLM_TIMEOUT) and done >= 1
        assert ended - started <= SYNC_MS / 1000 + 1.0
        assert ended - killed_at <= SYNC_MS / 1000 + 1.0
        client.call(_move, "push", 3, "main", [0, 1], [4, 5])
        client.call(_move, "pull", 3, "main", [9], [10])
        assert other.call(_digests, "main", 1 << 20)[0][4:6] == [hashlib.sha1(_content(20, 0, b, 1 << 20)).hexdigest()
                                                                 for b in (0, 1)]
        assert client.call(_plane_of, 3) == "nixl"


def test_a_silent_peer_fails_the_transfer_with_timeout_in_time_and_a_new_link_works(loopback_env):
    """SIGSTOP stands in for a partition (the veth case is in test_netns.py): NIXL would wait for
    ever; our deadline cancels the request, removes the peer's agent and ends the link."""
    with contextlib.ExitStack() as stack:
        server = _cluster(stack, 1, listen=True)
        client = _cluster(stack, 2)
        server.call(_register, "main", 10, 16, 1 << 20)
        client.call(_register, "main", 20, 16, 1 << 20)
        assert link(client, server, 30000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        client.send(_loop, "pull", 1, "main", list(range(14)), 30)
        time.sleep(0.5)
        stopped_at = time.monotonic()
        os.kill(server.pid, signal.SIGSTOP)
        try:
            status, started, ended, done = client.result(60)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert status == S.LLM_TIMEOUT and done >= 1, client.call(_why)
        assert ended - started <= SYNC_MS / 1000 + 1.0 and ended - stopped_at <= SYNC_MS / 1000 + 1.0
        assert client.call(_stats)["nixl_timeouts"] == 1
        client.call(_unlink, 1)
        deadline = time.monotonic() + 20
        status = None
        while time.monotonic() < deadline:
            status = client.call(_link_status, 1, *server.address)
            if status == S.LLM_SUCCESS:
                break
            time.sleep(0.2)
        assert status == S.LLM_SUCCESS
        assert client.call(_plane_of, 1) == "nixl"
        client.call(_move, "push", 1, "main", [14, 15], [0, 1])
        assert server.call(_digests, "main", 1 << 20)[2][:2] == client.call(_digests, "main", 1 << 20)[2][14:]


def test_the_install_line_is_the_readmes_and_ci_runs_it():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    with open(os.path.join(root, "docs", "planes.md")) as f:  # the nixl plane's section, once the README's
        assert f"\n{nixl.INSTALL}\n" in f.read()
    with open(os.path.join(root, ".ci", "run")) as f:
        ci = f.read()
    assert nixl.INSTALL in ci and f"export {REQUIRE_ENV}=1" in ci


def test_info_says_whether_nixl_imports_its_version_and_the_ucx_transports(monkeypatch):
    """``python -m llm_datadist info`` prints the plane's probe: NIXL's and UCX's versions and the
    transports UCX lists in a child process (TCP on lo only, where the TCP mode is on), or the
    install line."""
    monkeypatch.setenv(nixl.TCP_ENV, "1")
    usable, why = nixl.NixlPlane.probe()
    if not nixl.installed():
        assert not usable and nixl.INSTALL in why
        return
    assert why.startswith(f"NIXL {nixl.nixl_version()} (UCX 1.") and "UCX transports without TCP: " in why
    assert "tcp/lo on lo" in why and usable
    assert "links with a secret only" in why


# -- block routes: prepared lists reused between calls --------------------------------------------
GUARD = 4096  # guard bytes before and after each tensor of a guarded cache
GUARD_BYTE = 0xA5


def _register_guarded(state, name: str, seed: int, blocks: int, block_bytes: int, keyed: bool) -> None:
    """Cache ``name``: each tensor a slice of a buffer with ``GUARD`` guard bytes on both sides; the
    buffers (guards included) are kept, also after the cache is unregistered (``old_<name>``)."""
    if name in state.caches:
        state.cm.unregister_cache(state.caches.pop(name).cache_id)
        state.scratch[f"old_{name}"] = state.scratch.pop(f"buf_{name}")
    buffers, views = [], []
    for t in range(TENSORS):
        buf = np.full(blocks * block_bytes + 2 * GUARD, GUARD_BYTE, dtype=np.uint8)
        buf[GUARD:-GUARD] = np.concatenate([_content(seed, t, b, block_bytes) for b in range(blocks)])
        buffers.append(buf)
        views.append(buf[GUARD:-GUARD])
    desc = CacheDesc(TENSORS, [blocks, block_bytes], DataType.DT_UINT8, Placement.HOST)
    key = BlocksCacheKey(state.cluster_id, MODEL_ID) if keyed else None
    state.caches[name] = state.cm.register_blocks_cache(desc, [v.ctypes.data for v in views], key)
    state.arrays[name] = views
    state.scratch[f"buf_{name}"] = buffers


def _buffers(state, which: str) -> List[np.ndarray]:
    """Copies of the whole buffers (guards included) of ``buf_<name>`` or ``old_<name>``."""
    return [b.copy() for b in state.scratch[which]]


def _scribble(state, which: str) -> None:
    """The owner reuses unregistered memory: new bytes in every buffer of ``old_<name>``."""
    for b in state.scratch[which]:
        b[:] = 0x3C


def _count_routes(state) -> None:
    """Count the calls that the nixl block routes completed (``scratch["route_runs"]``)."""
    plane = state.dd.engine.links.planes["nixl"]
    original = plane._route_run
    state.scratch["route_runs"] = 0

    def counted(route, local_indices, remote_indices):
        done = original(route, local_indices, remote_indices)
        state.scratch["route_runs"] += bool(done)
        return done
    plane._route_run = counted


def _route_runs(state) -> int:
    return state.scratch["route_runs"]


def _routes(state) -> List[str]:
    return sorted(type(route).__name__ + ("" if route.current else " (closed)")
                  for route in state.dd.engine.routes.values())


def _open_lists(state) -> int:
    """Prepared lists held by the nixl routes of every link (0 once they all closed)."""
    plane = state.dd.engine.links.planes["nixl"]
    return sum(len(r.lists) for link in set(plane._loaded.values()) for r in link.routes if r.lists is not None)


def _guards_intact(buffers: List[np.ndarray]) -> bool:
    return all((b[:GUARD] == GUARD_BYTE).all() and (b[-GUARD:] == GUARD_BYTE).all() for b in buffers)


def _tensors_of(buffers: List[np.ndarray], blocks: int, block_bytes: int) -> List[np.ndarray]:
    return [b[GUARD:-GUARD].reshape(blocks, block_bytes) for b in buffers]


def test_block_routes_reuse_prepared_lists_byte_exact_and_never_write_what_the_peer_reregistered(loopback_env):
    """Repeated pushes and pulls of the same shape take the nixl block route (prepared strided lists)
    and move exactly the named blocks: every other byte of both caches and the guard bytes around
    each tensor stay. Then the peer re-registers its cache elsewhere between two calls: the stale
    route declines, the call lands in the new cache, and not one byte lands in the memory the peer
    let go (checked after a push, and a pull does not return the bytes the owner put there since);
    an unregistered cache is refused; a local unregister and an unlink close the routes and release
    their lists, and after a relink the route comes back."""
    blocks, block_bytes = 16, 4096
    with contextlib.ExitStack() as stack:
        server = _cluster(stack, 1, listen=True)
        client = _cluster(stack, 2)
        server.call(_register_guarded, "main", 10, blocks, block_bytes, True)
        client.call(_register_guarded, "c", 20, blocks, block_bytes, False)
        client.call(_count_routes)
        assert link(client, server, 30000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert client.call(_plane_of, 1) == "nixl"
        on_server, on_client = Expected(10, blocks, block_bytes), Expected(20, blocks, block_bytes)

        def check(where: str) -> None:
            server_bufs, client_bufs = server.call(_buffers, "buf_main"), client.call(_buffers, "buf_c")
            assert _guards_intact(server_bufs) and _guards_intact(client_bufs), where
            assert server.call(_digests, "main", block_bytes) == on_server.digests(), where
            assert client.call(_digests, "c", block_bytes) == on_client.digests(), where

        rng = np.random.default_rng(9)
        for round_ in range(4):
            for op, layer in (("push", None), ("pull", None), ("push", 1), ("pull", 0)):
                src = rng.permutation(blocks)[:5].tolist()
                dst = rng.permutation(blocks)[:5].tolist()
                client.call(_move, op, 1, "c", src, dst, layer)
                tensors = range(TENSORS) if layer is None else range(2 * layer, 2 * layer + 2)
                if op == "push":
                    on_server.copy(on_client, src, dst, tensors)
                else:
                    on_client.copy(on_server, src, dst, tensors)
                check(f"round {round_} {op} layer {layer}")
        # The first call of each shape is checked (it builds or teaches the route); the rest ran on it.
        assert client.call(_route_runs) == 12
        assert client.call(_routes) == ["NixlRoute", "NixlRoute"]

        # The peer re-registers: the same model id, new memory. The old memory stays allocated.
        server.call(_register_guarded, "main", 30, blocks, block_bytes, True)
        on_server = Expected(30, blocks, block_bytes)
        old = server.call(_buffers, "old_main")
        runs = client.call(_route_runs)
        client.call(_move, "push", 1, "c", [1, 2], [3, 4])
        on_server.copy(on_client, [1, 2], [3, 4])
        assert [np.array_equal(a, b) for a, b in zip(server.call(_buffers, "old_main"), old)] == [True] * TENSORS
        check("push after the peer re-registered")
        server.call(_scribble, "old_main")  # the owner reuses the memory it let go
        server.call(_register_guarded, "main", 40, blocks, block_bytes, True)
        on_server = Expected(40, blocks, block_bytes)
        client.call(_move, "pull", 1, "c", [5, 6], [7, 8])
        on_client.copy(on_server, [5, 6], [7, 8])
        check("pull after the peer re-registered again")
        assert client.call(_route_runs) == runs  # both calls went the checked way
        for _ in range(2):  # the push route was made before the second re-registration: stale once more
            client.call(_move, "push", 1, "c", [9], [10])
            client.call(_move, "pull", 1, "c", [11], [12])
            on_server.copy(on_client, [9], [10])
            on_client.copy(on_server, [11], [12])
        check("routes rebuilt against the new cache")
        assert client.call(_route_runs) == runs + 3

        # The peer unregisters its cache: refused, and its memory is left alone.
        server.call(_unregister, "main")
        gone = server.call(_buffers, "old_main")
        for op in ("push", "pull"):
            assert client.call(_timed_move, op, 1, "c", [0], [0])[0] == S.LLM_KV_CACHE_NOT_EXIST, op
        assert [np.array_equal(a, b) for a, b in zip(server.call(_buffers, "old_main"), gone)] == [True] * TENSORS
        server.call(_register_guarded, "main", 50, blocks, block_bytes, True)
        on_server = Expected(50, blocks, block_bytes)
        for _ in range(2):
            client.call(_move, "push", 1, "c", [0, 1], [2, 3])
            on_server.copy(on_client, [0, 1], [2, 3])
        check("after the peer registered again")

        # A local unregister closes that cache's routes (their lists released).
        assert client.call(_open_lists) == 2
        client.call(_register_guarded, "c", 60, blocks, block_bytes, False)
        on_client = Expected(60, blocks, block_bytes)
        assert client.call(_open_lists) == 0 and client.call(_routes) == []
        for _ in range(2):
            client.call(_move, "pull", 1, "c", [4, 5], [6, 7])
            on_client.copy(on_server, [4, 5], [6, 7])
        check("after the local cache was registered again")

        # Unlink: the routes close; linking again brings them back.
        assert client.call(_unlink, 1) == 0
        assert client.call(_routes) == ["NixlRoute (closed)"]
        assert client.call(_timed_move, "pull", 1, "c", [4, 5], [6, 7])[0] != 0
        assert link(client, server, 30000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        runs = client.call(_route_runs)
        for _ in range(3):
            client.call(_move, "pull", 1, "c", [8, 9], [10, 11])
            on_client.copy(on_server, [8, 9], [10, 11])
        check("after a relink")
        assert client.call(_route_runs) == runs + 2
        stats = client.call(_stats)
        assert (stats["nixl_failures"], stats["nixl_timeouts"]) == (0, 0)
        processes = [server.process, client.process]
    assert [p.exitcode for p in processes] == [0, 0]


def _unregister(state, name: str) -> None:
    state.cm.unregister_cache(state.caches.pop(name).cache_id)
    state.scratch[f"old_{name}"] = state.scratch.pop(f"buf_{name}")


def test_block_indices_take_exact_ints_inside_the_caches_only():
    """``_io.block_indices``: tensor-major indices; anything but a list/tuple of exact in-range ints
    (bools, floats, numpy ints, negatives, ids past the cache, unequal lengths) says -1."""
    from llm_datadist import _io
    lb, rb = np.array([0, 20], dtype=np.int64), np.array([5, 105], dtype=np.int64)
    out_l, out_r = np.zeros(6, dtype=np.int32), np.zeros(6, dtype=np.int32)
    assert _io.block_indices([1, 3, 9], (0, 99, 4), lb, rb, 10, 100, out_l, out_r) == 6
    assert out_l.tolist() == [1, 3, 9, 21, 23, 29] and out_r.tolist() == [5, 104, 9, 105, 204, 109]
    for local, remote in (([1, 10], [0, 0]), ([1, -1], [0, 0]), ([True], [0]), ([1.0], [0]),
                          ([np.int64(1)], [0]), ([1], [100]), ([1, 2], [0]), ([], []), (range(2), [0, 1]),
                          ([1, 2, 3, 4], [0, 1, 2, 3])):
        assert _io.block_indices(local, remote, lb, rb, 10, 100, out_l, out_r) == -1, (local, remote)
