"""Links between real clusters (spec §7, §10, §12.2): link/unlink in both API styles, listening on
port 0, refusals and their timing, role switches, table refresh, key release, layer-wise async
transfers and traffic in the reverse direction (the listening side pushing and pulling)."""

from __future__ import annotations

import itertools
import json
import socket
from typing import List, Optional, Tuple

import numpy as np
import pytest

from llm_datadist import (
    BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex, LLMStatusCode, TransferConfig, TransferWithCacheKeyConfig,
)
from llm_datadist.testing import ChildError, Cluster

import cluster_ops as ops
from kv_model import assert_same, copy_blocks, copy_row_to_blocks, copy_rows

pytestmark = pytest.mark.usefixtures("plane")

S = LLMStatusCode
API = ["python", "cpp"]
SEEDS = itertools.count(100_001, 2)
ROLES = {"python": {"PROMPT": "PROMPT", "DECODER": "DECODER", "MIX": "MIX"},
         "cpp": {"PROMPT": "kPrompt", "DECODER": "kDecoder", "MIX": "kMix"}}
POOL = json.dumps({"memory_size": 1 << 20})


# -- helpers ----------------------------------------------------------------------------------------

def add_blocks(cluster: Cluster, api: str, name: str = "blocks", model_id: int = 0) -> int:
    """A 4-tensor blocks cache of 6 blocks of 32 bytes (C++: a MIX cache); returns its cache_id."""
    if api == "python":
        return cluster.call(ops.register, name, 4, (6, 8), "DEVICE", True, (), model_id)
    return cluster.call(ops.cpp_register, name, 4, (6, 8))


def start_pair(clusters, api: str, server_role: str = "PROMPT", client_role: str = "DECODER",
               server_id: int = 1, client_id: int = 2, options=None) -> Tuple[Cluster, Cluster]:
    """A listening server and a client, each with a "blocks" cache (cache_id 1), not linked."""
    server = clusters.start(server_id, server_role, listen=True, api=api, options=options)
    client = clusters.start(client_id, client_role, api=api, options=options)
    for cluster in (server, client):
        assert add_blocks(cluster, api) == 1
    return server, client


def target(cluster: Cluster, port: Optional[int] = None, cluster_id: Optional[int] = None) -> tuple:
    ip, bound = cluster.address
    return (cluster.cluster_id if cluster_id is None else cluster_id, ip, bound if port is None else port)


def link_to(client: Cluster, targets: List[tuple], api: str, timeout_ms: int = 3000):
    return client.call(ops.py_link if api == "python" else ops.cpp_link, targets, timeout_ms)


def unlink_from(client: Cluster, targets: List[tuple], api: str, force: bool = False):
    return client.call(ops.py_unlink if api == "python" else ops.cpp_unlink, targets, 3000, force)


def transfer_status(caller: Cluster, peer_id: int, api: str, push: bool = False, cache: str = "blocks",
                    peer_cache_id: int = 1, model_id: int = 0, peer: Optional[Cluster] = None) -> int:
    """Move blocks [0, 5] -> [5, 0] between the caller's ``cache`` and the peer's cache (a pull
    or a push) and return the status. Checks the destination's bytes when it can reach it (pass
    ``peer`` for pushes and for the source of pulls): moved on success, untouched on failure."""
    blocks = ([0, 5], [5, 0])
    src, dst = (caller, peer) if push else (peer, caller)
    src_data = src.call(ops.fill, cache, next(SEEDS)) if src is not None else None
    dst_data = dst.call(ops.fill, cache, next(SEEDS)) if dst is not None else None
    if api == "python":
        method = "push_blocks" if push else "pull_blocks"
        try:
            caller.call(ops.py, method, BlocksCacheKey(peer_id, model_id), cache, *blocks)
            status = 0
        except ChildError as exc:
            assert exc.kind == "LLMException", exc
            status = exc.status_code
    else:
        method = "PushKvBlocks" if push else "PullKvBlocks"
        status = caller.call(ops.cpp_op, method, (peer_id, peer_cache_id, 0), cache, *blocks)
    if dst is not None and status != 0:
        assert_same(dst.call(ops.snapshot, cache), dst_data, "destination of a failed transfer")
    elif dst is not None and src is not None:
        expected = copy_blocks(src_data, dst_data, range(4), range(4), *blocks)
        assert_same(dst.call(ops.snapshot, cache), expected, "destination")
    return status


def role_status(cluster: Cluster, api: str, role: str, listen: Optional[str] = None) -> int:
    """switch_role / SetRole; returns the status (Python: 0, or the code of the LLMException)."""
    if api == "cpp":
        return cluster.call(ops.cpp_set_role, ROLES["cpp"][role], listen)
    try:
        cluster.call(ops.py_switch_role, role, listen)
    except ChildError as exc:
        assert exc.kind == "LLMException", exc
        return exc.status_code
    return 0


def free_port() -> int:
    """A port nobody listens on (bound, read, released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ==================================================================================================
# link / unlink
# ==================================================================================================

@pytest.mark.parametrize("api", API)
def test_link_then_already_link(clusters, api):
    server, client = start_pair(clusters, api)
    assert link_to(client, [target(server)], api) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert transfer_status(client, server.cluster_id, api, peer=server) == 0
    assert transfer_status(server, client.cluster_id, api, peer=client) == 0
    assert link_to(client, [target(server)], api) == (S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK])
    assert transfer_status(client, server.cluster_id, api, peer=server) == 0, "ALREADY_LINK broke the link"


def _modules(state) -> List[str]:
    import sys
    return sorted(sys.modules)


def test_the_first_link_of_a_process_imports_nothing(clusters):
    """What every link needs once per process (the protection suites this process runs: the
    cryptography package; the IDNA codec of a host name) is loaded at init, not by the first link
    (issue 36: ~13 ms of the first link here)."""
    server, client = start_pair(clusters, "python")
    before = client.call(_modules)
    assert link_to(client, [target(server)], "python") == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert sorted(set(client.call(_modules)) - set(before)) == []
    assert transfer_status(client, server.cluster_id, "python", peer=server) == 0


@pytest.mark.parametrize("api", API)
def test_link_reports_each_cluster(clusters, api):
    server_a = clusters.start(1, "PROMPT", listen=True, api=api)
    server_b = clusters.start(3, "PROMPT", listen=True, api=api)
    client = clusters.start(2, "DECODER", api=api)
    for cluster in (server_a, server_b, client):
        add_blocks(cluster, api)
    assert link_to(client, [target(server_a)], api) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    status, rets = link_to(client, [target(server_a), target(server_b)], api)
    assert rets == [S.LLM_ALREADY_LINK, S.LLM_SUCCESS]
    assert status != S.LLM_SUCCESS, "the overall status is a failure unless every link was made"
    assert transfer_status(client, server_b.cluster_id, api, peer=server_b) == 0
    status, rets = link_to(client, [target(server_b, port=free_port(), cluster_id=4), target(server_a)], api, 1000)
    assert rets == [S.LLM_LINK_FAILED, S.LLM_ALREADY_LINK] and status != S.LLM_SUCCESS


@pytest.mark.parametrize("api", API)
def test_listen_on_port_zero(clusters, api):
    first = clusters.start(1, "PROMPT", listen=True, api=api)
    second = clusters.start(3, "PROMPT", listen=True, api=api)
    client = clusters.start(2, "DECODER", api=api)
    assert first.address[1] > 0 and second.address[1] > 0 and first.address[1] != second.address[1]
    assert first.call(ops.listen_ip_info) == first.listen_ip_info == f"127.0.0.1:{first.address[1]}"
    assert client.call(ops.listen_ip_info) == ""
    with socket.create_connection(first.address, timeout=5):
        pass  # the bound port really accepts connections


@pytest.mark.parametrize("api", API)
def test_link_to_a_closed_port_fails_within_the_timeout(clusters, api):
    client = clusters.start(2, "DECODER", api=api)
    fn = ops.py_link if api == "python" else ops.cpp_link
    (status, rets), seconds = client.call(ops.timed, fn, [(1, "127.0.0.1", free_port())], 1000)
    assert (status, rets) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    assert seconds < 2.0


@pytest.mark.parametrize("api", API)
def test_link_to_a_silent_listener_fails_within_the_timeout(clusters, api):
    """A socket that accepts TCP connections (backlog) but never answers the handshake."""
    client = clusters.start(2, "DECODER", api=api)
    fn = ops.py_link if api == "python" else ops.cpp_link
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        (status, rets), seconds = client.call(ops.timed, fn, [(1, *silent.getsockname())], 1000)
    assert (status, rets) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    assert seconds < 2.0


@pytest.mark.parametrize("api", API)
def test_link_to_the_wrong_cluster_id_leaves_no_link(clusters, api):
    """The listener is cluster 1 but the client asks for cluster 9: the link fails and neither
    side keeps a link (so both may still switch role)."""
    server, client = start_pair(clusters, api)
    assert link_to(client, [target(server, cluster_id=9)], api) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    assert transfer_status(client, 9, api) == S.LLM_NOT_YET_LINK
    assert transfer_status(client, server.cluster_id, api) == S.LLM_NOT_YET_LINK
    assert role_status(client, api, "DECODER") == 0
    assert role_status(server, api, "PROMPT", server.listen_ip_info) == 0, "the server kept a failed link"


def test_a_link_to_an_address_learns_the_cluster_there(clusters):
    """A client that knows only an address (a router that forwards no cluster id) links to the
    cluster the handshake finds there, under that id: transfers and an unlink by it work, a second
    call answers ALREADY_LINK with the same id; a closed port or a silent listener fails within
    the timeout without an id; this cluster's own listener is refused."""
    server, client = start_pair(clusters, "python", server_id=7)
    assert client.call(ops.link_address, *server.address) == (S.LLM_SUCCESS, 7)
    assert transfer_status(client, 7, "python", peer=server) == 0
    assert client.call(ops.link_address, *server.address) == (S.LLM_ALREADY_LINK, 7)
    assert transfer_status(client, 7, "python", peer=server) == 0
    assert unlink_from(client, [target(server)], "python") == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert client.call(ops.link_address, *server.address) == (S.LLM_SUCCESS, 7)  # linked again
    assert client.call(ops.link_address, "127.0.0.1", free_port(), 1000) == (S.LLM_LINK_FAILED, None)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        (status, found), seconds = client.call(ops.timed, ops.link_address, *silent.getsockname(), 1000)
    assert (status, found) == (S.LLM_LINK_FAILED, None) and seconds < 2.0
    assert server.call(ops.link_address, *server.address) == (S.LLM_LINK_FAILED, 7)


@pytest.mark.parametrize("api", API)
def test_link_to_the_wrong_own_cluster_id_fails(clusters, api):
    """Naming this cluster's own id as the remote id of another cluster's address: the server
    answers with its real id, so the link fails and nothing stays."""
    server, client = start_pair(clusters, api, client_id=1, server_id=5)
    status, rets = link_to(client, [target(server, cluster_id=1)], api)
    assert rets == [S.LLM_LINK_FAILED] and status == S.LLM_LINK_FAILED
    assert transfer_status(client, 1, api) == S.LLM_NOT_YET_LINK


@pytest.mark.parametrize("api", API)
def test_a_cluster_links_to_its_own_listener(clusters, api):
    """As in CANN, a cluster may link to its own listener and address transfers to its own id
    over that link (the bytes move inside the process, checked like any peer's)."""
    server = clusters.start(1, "MIX", listen=True, api=api)
    assert add_blocks(server, api) == 1
    assert link_to(server, [target(server)], api) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert link_to(server, [target(server)], api) == (S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK])
    if api == "python":
        data = server.call(ops.fill, "blocks", next(SEEDS))
        server.call(ops.py, "pull_blocks", BlocksCacheKey(1, 0), "blocks", [0, 1], [4, 5])
        server.call(ops.py, "push_blocks", BlocksCacheKey(1, 0), "blocks", [2], [3])
        expected = copy_blocks(data, data, range(4), range(4), [0, 1, 2], [4, 5, 3])
        assert_same(server.call(ops.snapshot, "blocks"), expected, "blocks moved inside one cluster")
    else:
        assert server.call(ops.cpp_op, "PullKvBlocks", (1, 1, 0), "blocks", [0], [4]) == 0
    assert unlink_from(server, [target(server)], api) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert transfer_status(server, 1, api) == S.LLM_NOT_YET_LINK


@pytest.mark.parametrize("api", API)
def test_unlink_then_link_again(clusters, api):
    server, client = start_pair(clusters, api, client_role="MIX")
    assert link_to(client, [target(server)], api) == (0, [0])
    assert unlink_from(client, [target(server)], api) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert transfer_status(client, server.cluster_id, api) == S.LLM_NOT_YET_LINK
    assert transfer_status(client, server.cluster_id, api, push=True) == S.LLM_NOT_YET_LINK
    assert transfer_status(server, client.cluster_id, api) == S.LLM_NOT_YET_LINK, "the server kept the link"
    status, rets = unlink_from(client, [target(server)], api)
    assert status != S.LLM_SUCCESS and rets[0] != S.LLM_SUCCESS, "unlinking a cluster that is not linked"

    assert link_to(client, [target(server)], api) == (0, [0])
    assert transfer_status(client, server.cluster_id, api, peer=server) == 0
    assert transfer_status(client, server.cluster_id, api, push=True, peer=server) == 0
    assert transfer_status(server, client.cluster_id, api, peer=client) == 0
    assert transfer_status(server, client.cluster_id, api, push=True, peer=client) == 0


@pytest.mark.parametrize("api", API)
def test_repeated_unlink_and_link(clusters, api):
    """Unlink and relink back to back: the server must not drop the new link while it finishes
    handling the old link's unlink."""
    server, client = start_pair(clusters, api)
    for _ in range(25):
        assert link_to(client, [target(server)], api) == (0, [0])
        assert transfer_status(server, client.cluster_id, api) == 0
        assert unlink_from(client, [target(server)], api) == (0, [0])


@pytest.mark.parametrize("api", API)
def test_forced_unlink_drops_only_local_state(clusters, api):
    server, client = start_pair(clusters, api, client_role="MIX")
    assert link_to(client, [target(server)], api) == (0, [0])
    assert unlink_from(client, [target(server)], api, force=True) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert transfer_status(client, server.cluster_id, api) == S.LLM_NOT_YET_LINK
    # A forced unlink sends nothing, but its connections close: the peer notices and drops the
    # link as lost (it does not stay linked to a cluster that is gone).
    assert ops.wait_for(lambda: server.call(ops.lost_links) == {client.cluster_id: "the connection was closed"})
    assert transfer_status(server, client.cluster_id, api) == S.LLM_LINK_FAILED

    assert link_to(client, [target(server)], api) == (0, [0]), "relinking replaces the peer's stale link"
    assert transfer_status(client, server.cluster_id, api, peer=server) == 0
    assert transfer_status(client, server.cluster_id, api, push=True, peer=server) == 0
    assert transfer_status(server, client.cluster_id, api, peer=client) == 0

    assert unlink_from(server, [(client.cluster_id, "127.0.0.1", 0)], api, force=True) == (0, [0])
    assert unlink_from(client, [target(server)], api, force=True) == (0, [0])
    assert transfer_status(server, client.cluster_id, api) == S.LLM_NOT_YET_LINK
    assert transfer_status(client, server.cluster_id, api) == S.LLM_NOT_YET_LINK
    assert link_to(client, [target(server)], api) == (0, [0])
    assert transfer_status(server, client.cluster_id, api, push=True, peer=client) == 0


# ==================================================================================================
# switch_role / SetRole
# ==================================================================================================

@pytest.mark.parametrize("api", API)
def test_switch_role_refused_while_linked(clusters, api):
    server, client = start_pair(clusters, api)
    assert link_to(client, [target(server)], api) == (0, [0])
    assert role_status(server, api, "DECODER") == S.LLM_EXIST_LINK
    assert role_status(client, api, "PROMPT") == S.LLM_EXIST_LINK
    assert server.call(ops.role) == ROLES[api]["PROMPT"] and client.call(ops.role) == ROLES[api]["DECODER"]
    assert server.call(ops.listen_ip_info) == server.listen_ip_info, "a refused switch moved the listener"
    assert transfer_status(client, server.cluster_id, api, peer=server) == 0

    assert unlink_from(client, [target(server)], api) == (0, [0])
    assert role_status(client, api, "PROMPT") == 0
    assert client.call(ops.role) == ROLES[api]["PROMPT"]
    assert role_status(server, api, "DECODER", server.listen_ip_info) == 0
    assert server.call(ops.role) == ROLES[api]["DECODER"]


@pytest.mark.parametrize("api", API)
def test_switch_role_moves_the_listener(clusters, api):
    server, client = start_pair(clusters, api)
    old = target(server)
    port = free_port()
    assert role_status(server, api, "MIX", f"127.0.0.1:{port}") == 0
    assert server.call(ops.listen_ip_info) == f"127.0.0.1:{port}"
    assert link_to(client, [old], api, 1000) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    assert link_to(client, [target(server, port=port)], api) == (0, [0])
    assert transfer_status(client, server.cluster_id, api, peer=server) == 0
    assert unlink_from(client, [target(server, port=port)], api) == (0, [0])

    assert role_status(server, api, "DECODER") == 0, "no listen option: stop listening"
    assert server.call(ops.listen_ip_info) == ""
    assert link_to(client, [target(server, port=port)], api, 1000) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])

    # The roles swap: the former client listens, the former server links to it.
    assert role_status(client, api, "PROMPT", "127.0.0.1:0") == 0
    new_ip, _, new_port = client.call(ops.listen_ip_info).rpartition(":")
    assert new_ip == "127.0.0.1" and int(new_port) > 0
    assert link_to(server, [(client.cluster_id, new_ip, int(new_port))], api) == (0, [0])
    assert transfer_status(server, client.cluster_id, api, peer=client) == 0
    assert transfer_status(client, server.cluster_id, api, push=True, peer=server) == 0


@pytest.mark.parametrize("api", API)
def test_switch_role_with_bad_listen_info(clusters, api):
    server, _ = start_pair(clusters, api)
    assert role_status(server, api, "PROMPT", "no-port-here") == S.LLM_PARAM_INVALID
    assert server.call(ops.listen_ip_info) == server.listen_ip_info


# ==================================================================================================
# remote-cache-accessible must match
# ==================================================================================================

@pytest.mark.parametrize("server_api,server_access,client_access", [
    ("python", "1", "0"), ("python", "0", "1"), ("cpp", None, "0")],
    ids=["server-on-client-off", "server-off-client-on", "cpp-server-python-client-off"])
def test_remote_access_mismatch_fails_the_link(clusters, server_api, server_access, client_access):
    server_options = None if server_access is None else {"remote_cache_accessible": server_access}
    server = clusters.start(1, "PROMPT", listen=True, api=server_api, options=server_options)
    client = clusters.start(2, "DECODER", options={"remote_cache_accessible": client_access})
    add_blocks(server, server_api)
    add_blocks(client, "python")
    assert link_to(client, [target(server)], "python") == (S.LLM_PARAM_INVALID, [S.LLM_PARAM_INVALID])
    assert transfer_status(client, server.cluster_id, "python") == S.LLM_NOT_YET_LINK
    assert role_status(server, server_api, "PROMPT", server.listen_ip_info) == 0, "the server kept a link"


def test_python_and_cpp_clusters_link(clusters):
    """Both styles speak the same protocol (remote-cache-accessible on on both sides)."""
    server = clusters.start(1, "PROMPT", listen=True, api="cpp")
    client = clusters.start(2, "DECODER")
    add_blocks(server, "cpp")
    add_blocks(client, "python")
    assert link_to(client, [target(server)], "python") == (0, [0])
    assert transfer_status(server, client.cluster_id, "cpp", push=True, peer=client) == 0
    src = server.call(ops.fill, "blocks", next(SEEDS))
    dst = client.call(ops.fill, "blocks", next(SEEDS))
    client.call(ops.py, "pull_blocks", CacheKeyByIdAndIndex(1, 1, 2), "blocks", [], [4])
    assert_same(client.call(ops.snapshot, "blocks"), copy_row_to_blocks(src, dst, range(4), range(4), 2, [4]))


# ==================================================================================================
# the peer's cache table
# ==================================================================================================

@pytest.mark.parametrize("api", API)
def test_caches_registered_after_the_link_are_found(clusters, api):
    server, client = start_pair(clusters, api, client_role="MIX")
    assert link_to(client, [target(server)], api) == (0, [0])
    assert transfer_status(client, server.cluster_id, api, peer=server) == 0  # the table is in use now
    late_server = add_blocks(server, api, "late", model_id=5)
    late_client = add_blocks(client, api, "late", model_id=6)
    assert transfer_status(client, server.cluster_id, api, cache="late", peer_cache_id=late_server, model_id=5,
                           peer=server) == 0
    assert transfer_status(server, client.cluster_id, api, cache="late", peer_cache_id=late_client, model_id=6,
                           peer=client) == 0
    later = add_blocks(server, api, "later", model_id=7)
    add_blocks(client, api, "later", model_id=8)
    assert transfer_status(client, server.cluster_id, api, push=True, cache="later", peer_cache_id=later,
                           model_id=7, peer=server) == 0


def test_rows_registered_after_the_link_are_found(clusters):
    server, client = start_pair(clusters, "python")
    assert link_to(client, [target(server)], "python") == (0, [0])
    assert transfer_status(client, server.cluster_id, "python", peer=server) == 0
    rows_id = server.call(ops.register, "rows", 4, (3, 16), "HOST", False, [CacheKey(1, req_id=7)])
    client.call(ops.register, "rows", 4, (3, 16))
    src = server.call(ops.fill, "rows", next(SEEDS))
    dst = client.call(ops.fill, "rows", next(SEEDS))
    client.call(ops.py, "pull_cache", CacheKeyByIdAndIndex(1, rows_id, 2), "rows", 0)
    assert_same(client.call(ops.snapshot, "rows"), copy_rows(src, dst, range(4), range(4), 2, 0, 64))
    dst = server.call(ops.fill, "rows", next(SEEDS))
    client.call(ops.py, "push_cache", CacheKey(1, req_id=7), "rows", 1)
    src = client.call(ops.snapshot, "rows")
    assert_same(server.call(ops.snapshot, "rows"), copy_rows(src, dst, range(4), range(4), 1, 0, 64))


@pytest.mark.parametrize("api", API)
def test_unregistered_cache_is_no_longer_reached(clusters, api):
    server, client = start_pair(clusters, api, client_role="MIX")
    assert link_to(client, [target(server)], api) == (0, [0])
    assert transfer_status(client, server.cluster_id, api, peer=server) == 0
    if api == "python":
        server.call(ops.unregister, "blocks")
    else:
        assert server.call(ops.cpp_unregister, "blocks") == 0
    kept = server.call(ops.fill, "blocks", next(SEEDS))  # the memory is still the test's
    assert transfer_status(client, server.cluster_id, api) == S.LLM_KV_CACHE_NOT_EXIST
    assert transfer_status(client, server.cluster_id, api, push=True) == S.LLM_KV_CACHE_NOT_EXIST
    assert_same(server.call(ops.snapshot, "blocks"), kept, "unregistered memory")


# ==================================================================================================
# keys of allocated caches are released by pulls (remote-cache-accessible off)
# ==================================================================================================

def start_keyed_pair(clusters, accessible: str) -> Tuple[Cluster, Cluster, int, int]:
    """Server 1 with an allocated cache (rows 0, 1 bound to req_id 1, 2) and a registered one
    (req_id 3, 4); client 2 with a rows cache and a blocks cache. Linked."""
    options = {"remote_cache_accessible": accessible, "llm.MemPoolConfig": POOL, "llm.HostMemPoolConfig": POOL}
    server = clusters.start(1, "PROMPT", listen=True, options=options)
    client = clusters.start(2, "DECODER", options=options)
    alloc_id = server.call(ops.allocate, "alloc", 4, (2, 16), "DEVICE", False, [CacheKey(1, req_id=1),
                                                                                CacheKey(1, req_id=2)])
    reg_id = server.call(ops.register, "reg", 4, (2, 16), "HOST", False, [CacheKey(1, req_id=3),
                                                                          CacheKey(1, req_id=4)])
    client.call(ops.register, "rows", 4, (2, 16))
    client.call(ops.register, "blocks", 4, (4, 8), "DEVICE", True)
    assert link_to(client, [target(server)], "python") == (0, [0])
    return server, client, alloc_id, reg_id


def pull_row(client: Cluster, server: Cluster, key, src: str, src_row: int, dst_row: int = 0,
             layer: Optional[int] = None) -> None:
    """pull_cache ``key`` (all layers, or only ``layer`` into the same layer) into the client's row
    ``dst_row`` and check the bytes."""
    kwargs = {} if layer is None else dict(src_layer_range=range(layer, layer + 1),
                                          dst_layer_range=range(layer, layer + 1))
    tensors = range(4) if layer is None else [2 * layer, 2 * layer + 1]
    src_data = server.call(ops.fill, src, next(SEEDS))
    dst_data = client.call(ops.fill, "rows", next(SEEDS))
    client.call(ops.py, "pull_cache", key, "rows", dst_row, **kwargs)
    expected = copy_rows(src_data, dst_data, tensors, tensors, src_row, dst_row, 64)
    assert_same(client.call(ops.snapshot, "rows"), expected, "destination")


def pull_fails(client: Cluster, key, expected=S.LLM_KV_CACHE_NOT_EXIST, method="pull_cache", cache="rows",
               args=(0,)) -> None:
    before = client.call(ops.fill, cache, next(SEEDS))
    with pytest.raises(ChildError) as info:
        client.call(ops.py, method, key, cache, *args)
    assert (info.value.kind, info.value.status_code) == ("LLMException", expected), info.value
    assert_same(client.call(ops.snapshot, cache), before, "destination of a failed pull")


def key_is_bound(server: Cluster, req_id: int) -> bool:
    """Whether the owner still has ``req_id`` bound (asked last in a test: a free key is bound
    and released again by the probe, which changes the owner's registry)."""
    return server.call(ops.key_is_bound, req_id)


def test_pull_by_cache_key_releases_the_key_of_an_allocated_cache(clusters):
    server, client, _, _ = start_keyed_pair(clusters, "0")
    assert key_is_bound(server, 1) and key_is_bound(server, 2)
    pull_row(client, server, CacheKey(1, req_id=1), "alloc", 0, dst_row=1)
    pull_fails(client, CacheKey(1, req_id=1))
    assert key_is_bound(server, 2), "pulling key 1 released key 2"
    pull_row(client, server, CacheKey(1, req_id=2), "alloc", 1)
    pull_fails(client, CacheKey(1, req_id=2))
    for _ in range(2):  # registered caches never release their keys
        pull_row(client, server, CacheKey(1, req_id=4), "reg", 1)
    assert key_is_bound(server, 3) and key_is_bound(server, 4)
    assert not key_is_bound(server, 1) and not key_is_bound(server, 2), "the owner must release pulled keys"


def test_layer_wise_pulls_release_the_key_once_every_tensor_arrived(clusters):
    server, client, _, _ = start_keyed_pair(clusters, "0")
    pull_row(client, server, CacheKey(1, req_id=2), "alloc", 1, layer=0)
    pull_row(client, server, CacheKey(1, req_id=2), "alloc", 1, layer=0)
    assert key_is_bound(server, 2), "half of the row was pulled; the key must stay"
    pull_row(client, server, CacheKey(1, req_id=2), "alloc", 1, layer=1)
    pull_fails(client, CacheKey(1, req_id=2))
    assert not key_is_bound(server, 2)


def test_pulls_by_index_and_into_blocks_release_bound_keys(clusters):
    server, client, alloc_id, _ = start_keyed_pair(clusters, "0")
    pull_row(client, server, CacheKeyByIdAndIndex(1, alloc_id, 0), "alloc", 0)
    pull_fails(client, CacheKey(1, req_id=1))
    src = server.call(ops.fill, "alloc", next(SEEDS))
    dst = client.call(ops.fill, "blocks", next(SEEDS))
    client.call(ops.py, "pull_blocks", CacheKey(1, req_id=2), "blocks", [], [3, 1])
    assert_same(client.call(ops.snapshot, "blocks"), copy_row_to_blocks(src, dst, range(4), range(4), 1, [3, 1]))
    pull_fails(client, CacheKey(1, req_id=2), method="pull_blocks", cache="blocks", args=([], [0]))
    assert not key_is_bound(server, 1) and not key_is_bound(server, 2)


def test_pulls_do_not_release_keys_with_remote_access_on(clusters):
    """With remote-cache-accessible on, peers read one-sidedly: the owner's keys stay bound."""
    server, client, alloc_id, _ = start_keyed_pair(clusters, "1")
    for _ in range(2):
        pull_row(client, server, CacheKeyByIdAndIndex(1, alloc_id, 0), "alloc", 0)
    dst = server.call(ops.fill, "alloc", next(SEEDS))
    src = client.call(ops.fill, "rows", next(SEEDS))
    client.call(ops.py, "push_cache", CacheKey(1, req_id=1), "rows", 1)
    assert_same(server.call(ops.snapshot, "alloc"), copy_rows(src, dst, range(4), range(4), 1, 0, 64))
    assert key_is_bound(server, 1), "a pull released a key although remote-cache-accessible is on"


# ==================================================================================================
# transfer_cache_async
# ==================================================================================================

def _async_pair(pool, accessible: str) -> Tuple[Cluster, Cluster, dict]:
    options = {"remote_cache_accessible": accessible}
    server = pool.start(1, "DECODER", listen=True, options=options)
    client = pool.start(2, "PROMPT", options=options)
    ids = {"rows": server.call(ops.register, "rows", 4, (2, 16)),
           "blocks": server.call(ops.register, "blocks", 4, (6, 8), "DEVICE", True, (), 0)}
    client.call(ops.register, "src_rows", 4, (2, 16))
    client.call(ops.register, "src_blocks", 4, (6, 8), "DEVICE", True)
    client.call(ops.register, "src_host", 4, (2, 16), "HOST")
    client.call(ops.register, "src_odd", 3, (2, 16))
    assert link_to(client, [target(server)], "python") == (0, [0])
    return server, client, ids


@pytest.fixture(scope="module")
def async_pair(module_clusters):
    return _async_pair(module_clusters, "1")


@pytest.fixture(scope="module")
def async_off_pair(module_clusters):
    return _async_pair(module_clusters, "0")


def produced(shape: Tuple[int, ...], layers) -> dict:
    """Per layer, the K and V tensors the synchronizer writes into the source just in time."""
    rng = np.random.default_rng(next(SEEDS))
    return {layer: [rng.integers(-2**31, 2**31, size=shape, dtype=np.int64).astype(np.int32) for _ in range(2)]
            for layer in layers}


def source_after(produce: dict, num_layers: int, shape) -> list:
    return [produce[t // 2][t % 2] if t // 2 in produce else np.zeros(shape, np.int32)
            for t in range(2 * num_layers)]


def test_transfer_cache_async_sends_each_layer_when_it_is_ready(async_pair):
    server, client, ids = async_pair
    client.call(ops.fill_value, "src_rows", 0)
    before = server.call(ops.fill, "rows", next(SEEDS))
    produce = produced((2, 16), [0, 1])
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, ids["rows"], 1), range(0, 2), range(0, 2),
                                     src_batch_index=0)
    client.call(ops.start_async, "src_rows", [cfg], produce)
    assert client.call(ops.task_synchronize) == S.LLM_SUCCESS
    assert client.call(ops.task_results) == [S.LLM_SUCCESS]
    assert client.call(ops.sync_calls) == [(0, None), (1, None)]
    source = source_after(produce, 2, (2, 16))
    # Layer 0 was sent before synchronize_layer(1) overwrote it in the source.
    assert client.call(ops.snapshot, "src_rows")[0].min() == -7 == client.call(ops.snapshot, "src_rows")[1].max()
    assert_same(server.call(ops.snapshot, "rows"), copy_rows(source, before, range(4), range(4), 0, 1, 64))


def test_transfer_cache_async_blocks_to_blocks(async_pair):
    server, client, _ = async_pair
    client.call(ops.fill_value, "src_blocks", 0)
    before = server.call(ops.fill, "blocks", next(SEEDS))
    produce = produced((6, 8), [0, 1])
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), range(0, 2), range(0, 2))
    client.call(ops.start_async, "src_blocks", [cfg], produce, src_block_indices=[0, 3], dst_block_indices=[5, 1])
    assert client.call(ops.task_synchronize) == S.LLM_SUCCESS
    source = source_after(produce, 2, (6, 8))
    assert_same(server.call(ops.snapshot, "blocks"), copy_blocks(source, before, range(4), range(4), [0, 3], [5, 1]))


def test_transfer_cache_async_row_to_blocks(async_pair):
    server, client, _ = async_pair
    client.call(ops.fill_value, "src_rows", 0)
    before = server.call(ops.fill, "blocks", next(SEEDS))
    produce = produced((2, 16), [0, 1])
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), range(0, 2), range(0, 2))
    client.call(ops.start_async, "src_rows", [cfg], produce, dst_block_indices=[4, 2], dst_block_memory_size=32)
    assert client.call(ops.task_synchronize) == S.LLM_SUCCESS
    source = source_after(produce, 2, (2, 16))
    assert_same(server.call(ops.snapshot, "blocks"),
                copy_row_to_blocks(source, before, range(4), range(4), 0, [4, 2]))


def test_transfer_cache_async_shifted_layers(async_pair):
    """Source layer 1 goes to destination layer 0; layer 0 is never asked for."""
    server, client, ids = async_pair
    client.call(ops.fill_value, "src_rows", 0)
    before = server.call(ops.fill, "rows", next(SEEDS))
    produce = produced((2, 16), [1])
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, ids["rows"], 0), range(1, 2), range(0, 1),
                                     src_batch_index=1)
    client.call(ops.start_async, "src_rows", [cfg], produce)
    assert client.call(ops.task_synchronize) == S.LLM_SUCCESS
    assert client.call(ops.sync_calls) == [(1, None)]
    source = source_after(produce, 2, (2, 16))
    assert_same(server.call(ops.snapshot, "rows"), copy_rows(source, before, [2, 3], [0, 1], 1, 0, 64))


@pytest.mark.parametrize("refused_layer", [0, 1])
def test_transfer_cache_async_synchronizer_refusal(async_pair, refused_layer):
    server, client, ids = async_pair
    client.call(ops.fill_value, "src_rows", 0)
    before = server.call(ops.fill, "rows", next(SEEDS))
    produce = produced((2, 16), [0, 1])
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, ids["rows"], 0), range(0, 2), range(0, 2))
    client.call(ops.start_async, "src_rows", [cfg], produce, answers={refused_layer: False})
    assert client.call(ops.task_synchronize) == S.LLM_PARAM_INVALID
    assert client.call(ops.task_results) == [S.LLM_PARAM_INVALID]
    assert [layer for layer, _ in client.call(ops.sync_calls)] == list(range(refused_layer + 1))
    sent = [t for t in range(4) if t // 2 < refused_layer]
    source = source_after(produce, 2, (2, 16))
    assert_same(server.call(ops.snapshot, "rows"), copy_rows(source, before, sent, sent, 0, 0, 64))


def test_transfer_cache_async_results_per_config(async_pair):
    server, client, ids = async_pair
    client.call(ops.fill_value, "src_rows", 0)
    before = server.call(ops.fill, "rows", next(SEEDS))
    produce = produced((2, 16), [0, 1])
    bad = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, 999, 0), range(0, 2), range(0, 2))
    good = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, ids["rows"], 1), range(0, 2), range(0, 2))
    beyond = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, ids["rows"], 0), range(0, 2), range(1, 3))
    unlinked = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(77, 1, 0), range(0, 1), range(0, 1))
    client.call(ops.start_async, "src_rows", [bad, good, beyond, unlinked], produce)
    assert client.call(ops.task_results) == [S.LLM_KV_CACHE_NOT_EXIST, S.LLM_SUCCESS, S.LLM_PARAM_INVALID,
                                             S.LLM_NOT_YET_LINK]
    assert client.call(ops.task_synchronize) == S.LLM_KV_CACHE_NOT_EXIST
    after = server.call(ops.snapshot, "rows")
    source = source_after(produce, 2, (2, 16))
    assert_same([t[1] for t in after], [s[0] for s in source], "row 1, written by the good config")
    assert_same([t[0] for t in after[:2]], [t[0] for t in before[:2]], "row 0 of layer 0, named by no config")


def test_transfer_cache_async_wait_timeout(async_pair):
    server, client, ids = async_pair
    produce = produced((2, 16), [0])
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, ids["rows"], 0), range(0, 1), range(0, 1))
    client.call(ops.start_async, "src_rows", [cfg], produce, gated=True)
    try:
        assert client.call(ops.task_synchronize, 100) == S.LLM_TIMEOUT
        assert client.call(ops.task_results, 100) == [S.LLM_TIMEOUT]
    finally:
        client.call(ops.open_gate)
    assert client.call(ops.task_synchronize) == S.LLM_SUCCESS
    assert client.call(ops.task_results) == [S.LLM_SUCCESS]


ASYNC_ERRORS = [
    ("transfer-config-with-remote-access", "src_rows",
     lambda ids, addrs: [TransferConfig(1, addrs[:4], range(0, 2))], {}, ("TypeError", None)),
    ("host-source", "src_host",
     lambda ids, addrs: [TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, ids["rows"], 0), range(0, 2),
                                                    range(0, 2))], {}, ("LLMException", S.LLM_PARAM_INVALID)),
    ("odd-tensor-count", "src_odd",
     lambda ids, addrs: [TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, ids["rows"], 0), range(0, 1),
                                                    range(0, 1))], {}, ("LLMException", S.LLM_PARAM_INVALID)),
    ("no-configs", "src_rows", lambda ids, addrs: [], {}, ("LLMException", S.LLM_PARAM_INVALID)),
    ("block-memory-size-for-a-row-destination", "src_rows",
     lambda ids, addrs: [TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, ids["rows"], 0), range(0, 1),
                                                    range(0, 1))], dict(dst_block_memory_size=32),
     ("LLMException", S.LLM_PARAM_INVALID)),
    ("src-indices-without-dst-indices", "src_blocks",
     lambda ids, addrs: [TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), range(0, 1), range(0, 1))],
     dict(src_block_indices=[0]), ("LLMException", S.LLM_PARAM_INVALID)),
]


@pytest.mark.parametrize("src,configs,kwargs,expected", [c[1:] for c in ASYNC_ERRORS],
                         ids=[c[0] for c in ASYNC_ERRORS])
def test_transfer_cache_async_refused(async_pair, src, configs, kwargs, expected):
    server, client, ids = async_pair
    before = server.call(ops.fill, "rows", next(SEEDS))
    addrs = server.call(ops.tensor_addrs, "rows")
    with pytest.raises(ChildError) as info:
        client.call(ops.transfer_async, src, configs(ids, addrs), **kwargs)
    assert (info.value.kind, info.value.status_code) == expected, info.value
    assert_same(server.call(ops.snapshot, "rows"), before, "destination")


def test_transfer_cache_async_raw_addresses_without_remote_access(async_off_pair):
    server, client, ids = async_off_pair
    client.call(ops.fill_value, "src_rows", 0)
    before = server.call(ops.fill, "rows", next(SEEDS))
    row1 = [addr + 64 for addr in server.call(ops.tensor_addrs, "rows")]  # pre-offset to row 1
    produce = produced((2, 16), [0, 1])
    client.call(ops.start_async, "src_rows", [TransferConfig(1, row1, range(0, 2), src_batch_index=1)], produce)
    assert client.call(ops.task_synchronize) == S.LLM_SUCCESS
    source = source_after(produce, 2, (2, 16))
    assert_same(server.call(ops.snapshot, "rows"), copy_rows(source, before, range(4), range(4), 1, 1, 64))
    with pytest.raises(ChildError) as info:
        client.call(ops.transfer_async, "src_rows", [TransferWithCacheKeyConfig(
            CacheKeyByIdAndIndex(1, ids["rows"], 0), range(0, 1), range(0, 1))])
    assert info.value.kind == "TypeError"


# ==================================================================================================
# the listening side uses the link too
# ==================================================================================================

@pytest.mark.parametrize("api", API)
def test_server_pushes_and_pulls_over_the_reverse_direction(clusters, api):
    server, client = start_pair(clusters, api, server_role="PROMPT", client_role="DECODER")
    assert link_to(client, [target(server)], api) == (0, [0])
    for _ in range(3):
        assert transfer_status(server, client.cluster_id, api, push=True, peer=client) == 0
        assert transfer_status(server, client.cluster_id, api, peer=client) == 0
        assert transfer_status(client, server.cluster_id, api, peer=server) == 0


def test_a_re_registered_model_with_more_blocks_is_reached_after_a_refresh(clusters):
    """The peer's table is stale (model 7 had 4 blocks at link time, 16 now): the block index
    is outside the old geometry, so the table is refreshed once and the push lands."""
    server, client = start_pair(clusters, "python", client_role="MIX")
    server.call(ops.register, "old", 1, (4, 16), "HOST", True, model_id=7)
    client.call(ops.register, "src", 1, (16, 16), "HOST", True)
    assert link_to(client, [target(server)], "python") == (0, [0])
    server.call(ops.unregister, "old")
    server.call(ops.register, "new", 1, (16, 16), "HOST", True, model_id=7)
    src = client.call(ops.fill, "src", next(SEEDS))
    dst = server.call(ops.fill, "new", next(SEEDS))
    client.call(ops.py, "push_blocks", BlocksCacheKey(1, 7), "src", [0], [10])
    assert_same(server.call(ops.snapshot, "new"), copy_blocks(src, dst, [0], [0], [0], [10]))


def test_a_push_to_a_dropped_model_never_lands_in_the_memory_now_registered_there(clusters):
    """Model 7 is unregistered and the same memory registered again as model 8: a push planned
    against the old table must not write into model 8's cache."""
    server, client = start_pair(clusters, "python", client_role="MIX")
    server.call(ops.register, "seven", 1, (4, 16), "HOST", True, model_id=7)
    client.call(ops.register, "src", 1, (4, 16), "HOST", True)
    assert link_to(client, [target(server)], "python") == (0, [0])
    server.call(ops.reregister_as, "seven", 8)
    client.call(ops.fill, "src", next(SEEDS))
    before = server.call(ops.fill, "seven", next(SEEDS))
    with pytest.raises(ChildError) as info:
        client.call(ops.py, "push_blocks", BlocksCacheKey(1, 7), "src", [0], [3])
    assert (info.value.kind, info.value.status_code) == ("LLMException", S.LLM_KV_CACHE_NOT_EXIST)
    assert_same(server.call(ops.snapshot, "seven"), before, "memory re-registered under another model")


def test_notifications_travel_over_the_link_both_ways(clusters):
    server, client = start_pair(clusters, "python")
    assert link_to(client, [target(server)], "python") == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    # Nobody answers yet: the peer refuses rather than dropping the link.
    assert client.call(ops.notify, 1, {"what": "early"}) == ["error", "LLM_FEATURE_NOT_ENABLED"]
    server.call(ops.answer_notifications, "boom")
    client.call(ops.answer_notifications)
    assert client.call(ops.notify, 1, {"what": "release", "ids": [1, 2]}) == {
        "echo": {"what": "release", "ids": [1, 2]}, "from": 2}
    assert server.call(ops.notify, 2, {"what": "back"}) == {"echo": {"what": "back"}, "from": 1}
    # A failing handler is the peer's answer; the link keeps working.
    assert client.call(ops.notify, 1, {"what": "boom"}) == ["error", "LLM_FAILED"]
    assert client.call(ops.notify, 1, {"what": "again"})["from"] == 2
    assert server.call(ops.notes) == [[2, {"what": "release", "ids": [1, 2]}], [2, {"what": "again"}]]
    assert client.call(ops.notify, 9, {"what": "nobody"}) == ["error", "LLM_NOT_YET_LINK"]
