"""The two-sided rank-table link (``link`` / ``query_register_mem_status`` / ``unlink``, spec §7,
§10.2, §14.4), CANN's simultaneous one-sided links (its hixl backend sample) and the malformed
cluster infos of ``link_clusters`` / ``unlink_clusters``, between real processes."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import traceback
from contextlib import ExitStack
from typing import Dict, List

import numpy as np
import pytest

from llm_datadist import BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, Placement, RegisterMemStatus
from llm_datadist.status import LLMStatusCode
from llm_datadist.testing import ChildError, Cluster
from llm_datadist.transport import planes

from cluster_ops import resources, settle_to

S = LLMStatusCode
P_ID, D_ID = 1, 2
BLOCKS, BLOCK = 8, 1024
LINK_TIMEOUT_S = 60
#: The planes these clusters (which have no secret) can be forced onto.
NO_SECRET_PLANES = [name for name in planes.host_names() if not planes.get(name).requires_secret]


def free_base() -> int:
    """A port base whose first 64 ports look free (the rank-table ports are base + 16 x device + rank)."""
    import socket
    for _ in range(50):
        base = 20000 + int.from_bytes(os.urandom(2), "little") % 30000
        try:
            for port in (base, base + 1, base + 16, base + 17):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range")


def rank_table(shape: str, device_ids=(0, 0), ip: str = "127.0.0.1") -> str:
    """Spec §14.4: one server entry holding both devices ("one"), or one entry each ("two")."""
    devices = [{"device_id": str(device_ids[rank]), "device_ip": ip, "rank_id": str(rank)} for rank in (0, 1)]
    if shape == "one":
        servers = [{"device": devices, "server_id": ip}]
    else:
        servers = [{"device": [devices[0]], "server_id": ip}, {"device": [devices[1]], "server_id": ip}]
    return json.dumps({"version": "1.2", "server_count": str(len(servers)), "status": "completed",
                       "server_list": servers})


# -- run inside the cluster processes ----------------------------------------------------------------

def register(state, seed: int) -> None:
    rng = np.random.default_rng(seed)
    state.kv = [rng.integers(0, 2**31, (BLOCKS, BLOCK // 4), dtype=np.int32) for _ in range(2)]
    desc = CacheDesc(2, [BLOCKS, BLOCK // 4], DataType.DT_INT32, Placement.DEVICE)
    state.cache = state.cm.register_blocks_cache(desc, [t.ctypes.data for t in state.kv],
                                                 BlocksCacheKey(state.cluster_id, 0))


def blocks(state, ids: List[int]) -> List[bytes]:
    return [b"".join(t[i].tobytes() for t in state.kv) for i in ids]


def link(state, name: str, ranks: Dict[int, int], table: str) -> int:
    return state.dd.link(name, ranks, table)


def wait_ok(state, comm_id: int, timeout: float = 10.0) -> List[str]:
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = state.dd.query_register_mem_status(comm_id=comm_id)
        if not seen or seen[-1] != status.name:
            seen.append(status.name)
        if status != RegisterMemStatus.PREPARING:
            return seen
        time.sleep(0.01)
    return seen


def pull(state, remote: int, src: List[int], dst: List[int]) -> None:
    state.cm.pull_blocks(BlocksCacheKey(remote, 0), state.cache, src, dst)


def push(state, remote: int, src: List[int], dst: List[int]) -> None:
    state.cm.push_blocks(BlocksCacheKey(remote, 0), state.cache, src, dst)


def unlink(state, comm_id: int) -> None:
    state.dd.unlink(comm_id)


def query(state, comm_id: int) -> str:
    return state.dd.query_register_mem_status(comm_id).name


def plane(state, remote: int) -> str:
    return state.dd.engine.links.data_plane(remote)


def linked(state) -> List[int]:
    return state.dd.engine.links.linked_clusters()


def register_remote_accessible_after_link(state) -> str:
    desc = CacheDesc(1, [2, 4], DataType.DT_INT32, Placement.DEVICE)
    keep = np.zeros((2, 4), np.int32)
    state.keep = keep
    try:
        state.cm.register_blocks_cache(desc, [keep.ctypes.data], None, True)
    except Exception as exc:  # the type and status are what the test checks
        return f"{type(exc).__name__}:{int(getattr(exc, 'status_code', -1))}"
    return "registered"


def start(stack: ExitStack, cluster_id: int, plane_name=None, options=None) -> Cluster:
    return stack.enter_context(Cluster(cluster_id, "PROMPT" if cluster_id == P_ID else "DECODER", plane=plane_name,
                                       options=dict(options or {}), timeout=60.0))


@pytest.fixture(autouse=True)
def _port_base(monkeypatch):
    monkeypatch.setenv("LLM_DATADIST_RANK_PORT_BASE", str(free_base()))
    monkeypatch.delenv("LLM_DATADIST_DATA_PLANE", raising=False)


# ==================================================================================================

@pytest.mark.parametrize("shape", ["one", "two"])
@pytest.mark.parametrize("plane_name", NO_SECRET_PLANES)
def test_two_sided_link_moves_blocks(plane_name, shape):
    """Both members call link() at once with the same arguments (same device_ip and device_id,
    different ranks); the status goes PREPARING -> OK; the decoder pulls and pushes; both unlink."""
    table = rank_table(shape)
    ranks = {P_ID: 0, D_ID: 1}
    with ExitStack() as stack:
        p = start(stack, P_ID, plane_name)
        d = start(stack, D_ID, plane_name, {"remote_cache_accessible": "0"})
        p.call(register, 11)
        d.call(register, 22)
        p.send(link, "link", ranks, table)
        d.send(link, "link", ranks, table)
        p_comm, d_comm = p.result(LINK_TIMEOUT_S), d.result(LINK_TIMEOUT_S)
        assert p_comm == 1 and d_comm == 1
        assert d.call(wait_ok, d_comm)[-1] == "OK" and p.call(wait_ok, p_comm)[-1] == "OK"
        assert d.call(plane, P_ID) == plane_name
        d.call(pull, P_ID, [0, 1, 5], [7, 6, 2])
        assert d.call(blocks, [7, 6, 2]) == p.call(blocks, [0, 1, 5])
        assert d.call(register_remote_accessible_after_link) == f"LLMException:{int(S.LLM_PARAM_INVALID)}"
        d.call(unlink, d_comm)
        p.call(unlink, p_comm)
        with pytest.raises(ChildError) as unknown:
            d.call(query, d_comm)
        assert unknown.value.status_code == S.LLM_NOT_YET_LINK
        assert d.call(linked) == [] and p.call(linked) == []


def test_three_members_link_in_a_mesh():
    ranks = {1: 0, 2: 1, 3: 2}
    devices = [{"device_id": "0", "device_ip": "127.0.0.1", "rank_id": str(r)} for r in range(3)]
    table = json.dumps({"version": "1.2", "server_count": "1", "status": "completed",
                        "server_list": [{"device": devices, "server_id": "1"}]})
    with ExitStack() as stack:
        members = [start(stack, cid) for cid in ranks]
        for cluster in members:
            cluster.call(register, cluster.cluster_id)
        for cluster in members:
            cluster.send(link, "mesh", ranks, table)
        comm_ids = [cluster.result(LINK_TIMEOUT_S) for cluster in members]
        for cluster, comm_id in zip(members, comm_ids):
            assert cluster.call(wait_ok, comm_id)[-1] == "OK"
            assert sorted(cluster.call(linked)) == sorted(set(ranks) - {cluster.cluster_id})
        members[2].call(pull, 1, [3], [4])
        assert members[2].call(blocks, [4]) == members[0].call(blocks, [3])
        members[0].call(pull, 2, [5], [6])
        assert members[0].call(blocks, [6]) == members[1].call(blocks, [5])


def test_a_member_that_never_arrives_fails_the_link_in_time():
    with ExitStack() as stack:
        for cluster_id, ranks in ((P_ID, {P_ID: 0, D_ID: 1}), (D_ID, {P_ID: 0, D_ID: 1})):
            lonely = start(stack, cluster_id, options={"llm.LinkTotalTime": "2"})
            baseline = lonely.call(resources)
            started = time.monotonic()
            with pytest.raises(ChildError) as failed:
                lonely.call(link, "alone", ranks, rank_table("one"), timeout=30)
            took = time.monotonic() - started
            assert failed.value.kind == "LLMException" and failed.value.status_code == S.LLM_LINK_FAILED
            assert 1.5 < took < 6, took
            assert lonely.call(settle_to, baseline) == baseline
            assert lonely.call(linked) == []


# -- the vllm-ascend connector's calls (spec §14.2-§14.5), in their order and argument forms --------

def _vllm_ascend_worker(role_name: str, cluster_id: int, peer_id: int, table: str, kv_seed: int, plane_name: str,
                        conn) -> None:
    os.environ["LLM_DATADIST_DATA_PLANE"] = plane_name
    try:
        from llm_datadist import LLMConfig, LLMDataDist, LLMException, LLMRole  # noqa: F401
        import llm_datadist
        role = LLMRole.PROMPT if role_name == "kv_producer" else LLMRole.DECODER
        dd = LLMDataDist(role, cluster_id)
        cfg = LLMConfig()
        cfg.device_id = 0
        cfg.sync_kv_timeout = 33064
        cfg.enable_switch_role = True
        cfg.enable_cache_manager = True
        cfg.enable_remote_cache_accessible = True
        opts = cfg.generate_options()
        dd.init(opts)
        cm = dd.cache_manager
        rng = np.random.default_rng(kv_seed)
        kv = [rng.standard_normal((BLOCKS, 4, 2, 16)).astype(np.float16) for _ in range(4)]  # 2 layers x K/V
        desc = CacheDesc(4, [BLOCKS, 4, 2, 16], llm_datadist.DataType.DT_FLOAT16)
        cache = cm.register_blocks_cache(desc, [t.ctypes.data for t in kv], BlocksCacheKey(cluster_id=cluster_id))
        p_id, d_id = (cluster_id, peer_id) if role_name == "kv_producer" else (peer_id, cluster_id)
        comm_id = dd.link("pd_comm_127.0.0.1_127.0.0.1", {p_id: 0, d_id: 1}, table)
        while True:
            status = dd.query_register_mem_status(comm_id=comm_id)
            if status == llm_datadist.RegisterMemStatus.OK:
                break
            if status == llm_datadist.RegisterMemStatus.FAILED:
                raise RuntimeError("link failed")
            time.sleep(0.05)
        if role_name == "kv_consumer":
            remote_ids, local_ids = [3, 4, 5], [0, 6, 7]
            cm.pull_blocks(BlocksCacheKey(cluster_id=peer_id), cache, remote_ids, local_ids)
            conn.send(("plane", dd.engine.links.data_plane(peer_id)))
            conn.send(("blocks", [b"".join(t[i].tobytes() for t in kv) for i in local_ids]))
        else:
            conn.send(("blocks", [b"".join(t[i].tobytes() for t in kv) for i in (3, 4, 5)]))
        conn.recv()  # the parent says when both are done
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


@pytest.mark.parametrize("shape", ["one", "two"])
@pytest.mark.parametrize("plane_name", NO_SECRET_PLANES)
def test_vllm_ascend_call_sequence(plane_name, shape):
    ctx = multiprocessing.get_context("spawn")
    table = rank_table(shape)
    procs, conns = [], []
    try:
        for role, cid, peer, seed in (("kv_producer", P_ID, D_ID, 5), ("kv_consumer", D_ID, P_ID, 6)):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_vllm_ascend_worker, args=(role, cid, peer, table, seed, plane_name, child),
                               daemon=True)
            proc.start()
            procs.append(proc)
            conns.append(parent)
        results = []
        assert conns[1].poll(LINK_TIMEOUT_S), "the decoder did not answer"
        assert conns[1].recv() == ("plane", plane_name)
        for conn in conns:
            assert conn.poll(LINK_TIMEOUT_S), "a worker did not answer"
            kind, value = conn.recv()
            assert kind == "blocks", value
            results.append(value)
        assert results[1] == results[0], "the decoder's blocks differ from the prefill's"
        for conn in conns:
            conn.send("done")
        for conn in conns:
            assert conn.poll(30)
            assert conn.recv() == ("ok", None)
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


# ==================================================================================================
# one-sided links as CANN's hixl backend makes them
# ==================================================================================================

def _info(remote_id: int, remote_port=None, local=True, extra_remote=False) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = remote_id
    if local:
        info.append_local_ip_info("127.0.0.1", 0)
    if remote_port is not None:
        info.append_remote_ip_info("127.0.0.1", remote_port)
        if extra_remote:
            info.append_remote_ip_info("127.0.0.1", remote_port)
    return info


def link_clusters(state, infos) -> list:
    status, rets = state.dd.link_clusters(infos, 5000)
    return [int(status), [int(r) for r in rets]]


def unlink_clusters(state, infos, force: bool = False) -> list:
    status, rets = state.dd.unlink_clusters(infos, 5000, force)
    return [int(status), [int(r) for r in rets]]


def mutual(state, remote_id: int, remote_port: int, barrier_file: str) -> list:
    while not os.path.exists(barrier_file):
        time.sleep(0.001)
    return link_clusters(state, [_info(remote_id, remote_port)])


@pytest.mark.parametrize("rounds", [range(8)])
def test_simultaneous_mutual_links_both_succeed(tmp_path, rounds):
    """Both clusters call link_clusters to each other at the same moment (CANN's hixl backend
    sample): both get LLM_SUCCESS, each pulls and pushes, and each unlinks with a cluster info
    holding only remote_cluster_id."""
    for i in rounds:
        with ExitStack() as stack:
            p = stack.enter_context(Cluster(0, "PROMPT", listen=True, timeout=60.0))
            d = stack.enter_context(Cluster(1, "DECODER", listen=True, timeout=60.0))
            p.call(register, 1)
            d.call(register, 2)
            go = str(tmp_path / f"go{i}")
            p.send(mutual, 1, d.address[1], go)
            d.send(mutual, 0, p.address[1], go)
            open(go, "w").close()
            assert p.result(30) == [0, [0]] and d.result(30) == [0, [0]]
            p.call(pull, 1, [2], [2])
            d.call(push, 0, [0, 1], [0, 1])
            assert p.call(blocks, [2, 0, 1]) == d.call(blocks, [2, 0, 1])
            p.send(unlink_clusters, [_info(1, local=False)])
            d.send(unlink_clusters, [_info(0, local=False)])
            assert p.result(30) == [0, [0]] and d.result(30) == [0, [0]]
            assert p.call(linked) == [] and d.call(linked) == []


def test_linking_back_to_a_cluster_that_linked_here_succeeds():
    with ExitStack() as stack:
        p = stack.enter_context(Cluster(0, "PROMPT", listen=True, timeout=60.0))
        d = stack.enter_context(Cluster(1, "DECODER", listen=True, timeout=60.0))
        p.call(register, 1)
        d.call(register, 2)
        assert d.call(link_clusters, [_info(0, p.address[1])]) == [0, [0]]
        assert p.call(link_clusters, [_info(1, d.address[1])]) == [0, [0]]
        p.call(push, 1, [3], [4])
        assert d.call(blocks, [4]) == p.call(blocks, [3])
        # the same client linking again is still ALREADY_LINK
        assert d.call(link_clusters, [_info(0, p.address[1])]) == [S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK]]


def test_malformed_cluster_infos_are_reported_per_cluster():
    with ExitStack() as stack:
        p = stack.enter_context(Cluster(0, "PROMPT", listen=True, timeout=60.0))
        d = stack.enter_context(Cluster(1, "DECODER", timeout=60.0))
        infos = [_info(0, None), _info(0, p.address[1], extra_remote=True), _info(0, p.address[1])]
        status, rets = d.call(link_clusters, infos)
        assert rets == [S.LLM_PARAM_INVALID, S.LLM_PARAM_INVALID, S.LLM_SUCCESS] and status == S.LLM_PARAM_INVALID
        status, rets = d.call(unlink_clusters, [_info(0, p.address[1], extra_remote=True), _info(0, local=False)])
        assert rets == [S.LLM_PARAM_INVALID, S.LLM_SUCCESS]
        # CANN's own checks still raise: no local ip info, no remote cluster id.
        with pytest.raises(ChildError) as raised:
            d.call(link_clusters, [_info(0, p.address[1], local=False)])
        assert raised.value.status_code == S.LLM_PARAM_INVALID


# -- CANN's pull_cache / pull_from_cache_to_blocks samples: link first, then allocate keyed caches --

POOL = '{"memory_size": 67108864}'
SAMPLE_OPTIONS = {"llm.MemPoolConfig": POOL, "remote_cache_accessible": "0"}  # as CANN's samples configure it


def allocate_keyed(state, req_ids: List[int], seed: int) -> List[bytes]:
    """The prompt side: allocate a 4-tensor cache bound to CacheKey(1, req_id) rows, filled."""
    from llm_datadist import CacheKey
    desc = CacheDesc(4, [len(req_ids), 256], DataType.DT_FLOAT16, Placement.DEVICE)
    keys = [CacheKey(prompt_cluster_id=1, req_id=r, model_id=0) for r in req_ids]
    state.keyed = state.cm.allocate_cache(desc, keys)
    views = state.keyed.as_numpy()
    rng = np.random.default_rng(seed)
    for view in views:
        view[...] = rng.standard_normal(view.shape).astype(np.float16)
    return [b"".join(v[row].tobytes() for v in views) for row in range(len(req_ids))]


def pull_keyed(state, req_ids: List[int]) -> List[bytes]:
    """The decoder side: allocate a cache and pull_cache each request's row into its batch index."""
    from llm_datadist import CacheKey
    desc = CacheDesc(4, [len(req_ids), 256], DataType.DT_FLOAT16, Placement.DEVICE)
    cache = state.cm.allocate_cache(desc)
    for index, req in enumerate(req_ids):
        state.cm.pull_cache(CacheKey(prompt_cluster_id=1, req_id=req, model_id=0), cache, batch_index=index)
    views = cache.as_numpy()
    return [b"".join(v[row].tobytes() for v in views) for row in range(len(req_ids))]


def pull_row_into_blocks(state, req: int) -> bytes:
    from llm_datadist import CacheKey
    desc = CacheDesc(4, [4, 64], DataType.DT_FLOAT16, Placement.DEVICE)
    state.backing = [np.zeros((4, 64), np.float16) for _ in range(4)]
    cache = state.cm.register_blocks_cache(desc, [t.ctypes.data for t in state.backing])
    state.cm.pull_blocks(CacheKey(prompt_cluster_id=1, req_id=req, model_id=0), cache, src_blocks=[], dst_blocks=[0])
    return b"".join(t[0].tobytes() for t in state.backing)


def test_keyed_caches_allocated_after_the_link_are_pulled():
    table = rank_table("two")
    ranks = {P_ID: 0, D_ID: 1}
    with ExitStack() as stack:
        p = start(stack, P_ID, options=SAMPLE_OPTIONS)
        d = start(stack, D_ID, options=SAMPLE_OPTIONS)
        p.send(link, "link", ranks, table)
        d.send(link, "link", ranks, table)
        p_comm, d_comm = p.result(LINK_TIMEOUT_S), d.result(LINK_TIMEOUT_S)
        assert p.call(wait_ok, p_comm)[-1] == "OK" and d.call(wait_ok, d_comm)[-1] == "OK"
        rows = p.call(allocate_keyed, [0, 1], 9)
        assert d.call(pull_keyed, [0, 1]) == rows
        d.call(unlink, d_comm)
        p.call(unlink, p_comm)
    with ExitStack() as stack:
        p = start(stack, P_ID, options=SAMPLE_OPTIONS)
        d = start(stack, D_ID, options=SAMPLE_OPTIONS)
        p.send(link, "link", ranks, table)
        d.send(link, "link", ranks, table)
        p_comm, d_comm = p.result(LINK_TIMEOUT_S), d.result(LINK_TIMEOUT_S)
        assert d.call(wait_ok, d_comm)[-1] == "OK"
        rows = p.call(allocate_keyed, [0], 10)
        # The remote row (256 fp16 a tensor) is cut into blocks of 64 fp16; chunk 0 -> block 0.
        expected = b"".join(rows[0][t * 512:t * 512 + 128] for t in range(4))
        assert d.call(pull_row_into_blocks, 0) == expected


# ==================================================================================================
# who may join a two-sided link: impostors on the rank-table port (issue 21, defect 3)
# ==================================================================================================

MESH = {1: 0, 2: 1, 3: 2}


def mesh_table(members: int) -> str:
    """Every rank on 127.0.0.1, device 0: on one host an address proves nothing."""
    devices = [{"device_id": "0", "device_ip": "127.0.0.1", "rank_id": str(r)} for r in range(members)]
    return json.dumps({"version": "1.2", "server_count": "1", "status": "completed",
                       "server_list": [{"device": devices, "server_id": "1"}]})


def rank_port(rank: int) -> int:
    return int(os.environ["LLM_DATADIST_RANK_PORT_BASE"]) + rank  # device 0


def serve_table(raw) -> None:
    """Answer the member's table requests (an empty table) and its unlink on the raw link's
    reverse connection, as a real member would, so that the link it made stays up."""
    import threading

    import rawpeer
    from llm_datadist.transport import wire

    def run() -> None:
        try:
            while True:
                op, _, req_id, _ = rawpeer.read_frame(raw.reverse, timeout=60)
                if op == wire.OP_TABLE_GET:
                    table = {"generation": 1, "caches": [], "blocks": [], "keys": []}
                    raw.reverse.sendall(rawpeer.json_frame(wire.OP_TABLE, table, req_id=req_id))
                elif op == wire.OP_UNLINK:
                    raw.reverse.sendall(rawpeer.frame(wire.OP_UNLINK_DONE, req_id=req_id))
        except (OSError, EOFError, ValueError):
            return

    threading.Thread(target=run, daemon=True).start()


def claim(at_rank: int, cluster_id: int, timeout: float = 10.0, **request):
    """Link by hand to the rank-table port of the member of ``at_rank`` as ``cluster_id`` with the
    link request changed by ``request`` (retrying while nobody listens there yet): the raw link,
    or ``rawpeer.Refused``, or the error that closed the connection."""
    import rawpeer
    deadline = time.monotonic() + timeout
    while True:
        try:
            raw = rawpeer.RawLink(("127.0.0.1", rank_port(at_rank)), cluster_id, **request)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        except (rawpeer.Refused, EOFError, OSError) as exc:
            return exc
        serve_table(raw)
        return raw


def comm_request(name: str, table: str, ranks: Dict[int, int], rank: int) -> dict:
    from llm_datadist.transport import comms
    return {"comm": [name, comms.digest(name, table, ranks)], "rank": rank}


def test_the_rank_table_port_refuses_all_but_an_expected_higher_rank():
    """The member of rank 1 (cluster 2) of a three-member comm listens for rank 2 (cluster 3).
    On its rank-table port it refuses a link request without a comm, with a wrong digest, with
    the digest of a rank map in which clusters 2 and 3 have swapped ranks (members that disagree
    on who has which rank must not meet), from the lower rank 0, from a cluster outside the comm,
    and from cluster 3 claiming another rank; none of these fails the comm: cluster 3 claiming
    rank 2 is then accepted."""
    import rawpeer
    table = mesh_table(3)
    swapped = {1: 0, 2: 2, 3: 1}
    probes = {
        "no comm": (3, {}),
        "wrong digest": (3, {"comm": ["mesh", "0" * 32], "rank": 2}),
        "swapped rank map": (3, comm_request("mesh", table, swapped, 2)),
        "another comm name": (3, comm_request("other", table, MESH, 2)),
        "lower rank": (1, comm_request("mesh", table, MESH, 0)),
        "outside cluster": (9, comm_request("mesh", table, MESH, 2)),
        "another rank": (3, comm_request("mesh", table, MESH, 1)),
        "its own id": (2, comm_request("mesh", table, MESH, 2)),
    }
    with ExitStack() as stack:
        member = start(stack, 2, options={"llm.LinkTotalTime": "10"})
        member.send(link, "mesh", MESH, table)  # rank 0 never comes: it fails in the end
        outcomes = {what: claim(1, cluster_id, **request) for what, (cluster_id, request) in probes.items()}
        accepted = {what for what, outcome in outcomes.items() if isinstance(outcome, rawpeer.RawLink)}
        for outcome in outcomes.values():
            if isinstance(outcome, rawpeer.RawLink):
                stack.callback(outcome.close)
        assert not accepted, f"accepted on the rank-table port: {sorted(accepted)}"
        for what, outcome in outcomes.items():
            # LLM_NOT_YET_LINK: not a comm this member is making (a real member would retry)
            assert isinstance(outcome, rawpeer.Refused) and outcome.status in (S.LLM_LINK_FAILED,
                                                                               S.LLM_NOT_YET_LINK), (what, outcome)
        real = claim(1, 3, **comm_request("mesh", table, MESH, 2))
        assert isinstance(real, rawpeer.RawLink), real
        stack.callback(real.close)
        with pytest.raises(ChildError) as failed:
            member.result(30)
        assert failed.value.status_code == S.LLM_LINK_FAILED and "rank 0" in str(failed.value), failed.value


def test_two_links_claiming_one_rank_fail_the_comm_on_every_member():
    """Members 1 (rank 0) and 2 (rank 1) link, and wait for 3 (rank 2); a raw peer claims rank 1
    at member 1 a second time. Member 1 fails and drops the comm's links, member 2 sees its link
    end and fails, and member 3, arriving afterwards, finds nobody: no member reports success
    (whichever of the two claims came first)."""
    import rawpeer
    table = mesh_table(3)
    with ExitStack() as stack:
        members = {cid: start(stack, cid, options={"llm.LinkTotalTime": "8"}) for cid in MESH}
        for cid in (1, 2):
            members[cid].send(link, "mesh", MESH, table)
        time.sleep(1.5)  # member 2 links to member 1 meanwhile
        second = claim(0, 2, **comm_request("mesh", table, MESH, 1))
        if isinstance(second, rawpeer.RawLink):
            stack.callback(second.close)
        else:
            assert isinstance(second, rawpeer.Refused), second
        members[3].send(link, "mesh", MESH, table)
        for cid, member in members.items():
            with pytest.raises(ChildError) as failed:
                member.result(30)
            assert failed.value.status_code == S.LLM_LINK_FAILED, (cid, failed.value)
        for member in members.values():
            assert member.call(linked) == []


@pytest.mark.parametrize("secret", [None, "the comm's link secret, 32 bytes"], ids=["no secret", "secret"])
def test_an_impostor_that_claims_a_rank_first_takes_the_members_place_only_without_a_secret(secret):
    """A two-member comm: member 1 (rank 0) waits for rank 1 (cluster 2). A raw peer that knows
    the rank table claims rank 1 as cluster 2 first. Without a secret its claim completes the
    join: member 1's comm is made with the impostor, and the real member 2, arriving later,
    fails with LLM_LINK_FAILED. With a secret the impostor is refused at the handshake and the
    real members make the comm."""
    import rawpeer
    table = mesh_table(2)
    ranks = {1: 0, 2: 1}
    options = {"llm.LinkTotalTime": "6"}
    if secret is not None:
        options["llm.LinkSecret"] = secret
    with ExitStack() as stack:
        members = {cid: start(stack, cid, options=options) for cid in ranks}
        members[1].send(link, "pair", ranks, table)
        impostor = claim(0, 2, **comm_request("pair", table, ranks, 1))
        if isinstance(impostor, rawpeer.RawLink):
            stack.callback(impostor.close)
        if secret is not None:
            assert isinstance(impostor, rawpeer.Refused) and impostor.status == S.LLM_LINK_FAILED, impostor
            members[2].send(link, "pair", ranks, table)
            comm_ids = {cid: member.result(LINK_TIMEOUT_S) for cid, member in members.items()}
            for cid, member in members.items():
                assert member.call(wait_ok, comm_ids[cid])[-1] == "OK"
            return
        assert isinstance(impostor, rawpeer.RawLink), impostor
        comm_id = members[1].result(LINK_TIMEOUT_S)
        assert members[1].call(wait_ok, comm_id)[-1] == "OK"
        with pytest.raises(ChildError) as failed:
            members[2].call(link, "pair", ranks, table, timeout=30)
        assert failed.value.status_code == S.LLM_LINK_FAILED, failed.value
        # Member 1's link to "cluster 2" is the impostor's: the real member 2 holds none.
        assert members[2].call(linked) == [] and members[1].call(linked) == [2]
        assert members[1].call(query, comm_id) == "OK"


def test_unlink_ends_the_accepted_and_initiated_links_of_the_comm():
    """In a three-member mesh the member of rank 1 accepted the link of rank 2 and made the one
    to rank 0; its unlink ends both: nothing of the comm is linked on any member afterwards, the
    others' pushes to it fail, and their comm has FAILED (a member is gone)."""
    table = mesh_table(3)
    with ExitStack() as stack:
        members = {cid: start(stack, cid) for cid in MESH}
        for member in members.values():
            member.call(register, member.cluster_id)
        for member in members.values():
            member.send(link, "mesh", MESH, table)
        comm_ids = {cid: member.result(LINK_TIMEOUT_S) for cid, member in members.items()}
        for cid, member in members.items():
            assert member.call(wait_ok, comm_ids[cid])[-1] == "OK"
        members[2].call(unlink, comm_ids[2])
        assert members[2].call(linked) == []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(2 in members[cid].call(linked) for cid in (1, 3)):
            time.sleep(0.05)
        for cid in (1, 3):
            assert members[cid].call(linked) == [4 - cid]
            with pytest.raises(ChildError):
                members[cid].call(push, 2, [0], [1])
            assert members[cid].call(query, comm_ids[cid]) == "FAILED"


def test_a_link_serves_one_comm_only():
    """Two comms between the same two clusters: the second link() fails at once (the first
    comm's link proves no membership of the second), and unlinking the first comm leaves no link
    behind that a push could still use."""
    table = rank_table("one")
    ranks = {P_ID: 0, D_ID: 1}
    with ExitStack() as stack:
        p, d = start(stack, P_ID), start(stack, D_ID)
        p.call(register, 1)
        d.call(register, 2)
        p.send(link, "first", ranks, table)
        d.send(link, "first", ranks, table)
        p_comm, d_comm = p.result(LINK_TIMEOUT_S), d.result(LINK_TIMEOUT_S)
        started = time.monotonic()
        for cluster in (p, d):
            with pytest.raises(ChildError) as failed:
                cluster.call(link, "second", ranks, table, timeout=30)
            assert failed.value.status_code == S.LLM_LINK_FAILED, failed.value
        assert time.monotonic() - started < 10
        d.call(unlink, d_comm)
        p.call(unlink, p_comm)
        assert d.call(linked) == [] and p.call(linked) == []
        with pytest.raises(ChildError):
            d.call(push, P_ID, [0], [1])


def test_the_comm_digest_binds_the_rank_map():
    """Members with the same ids but swapped ranks compute different digests (their links are
    refused on the rank-table port: test_the_rank_table_port_refuses_all_but_an_expected_higher_rank)."""
    from llm_datadist.transport import comms
    table = mesh_table(2)
    assert comms.digest("c", table, {1: 0, 2: 1}) != comms.digest("c", table, {1: 1, 2: 0})
    assert comms.digest("c", table, {1: 0, 2: 1}) == comms.digest("c", table, {2: 1, 1: 0})
