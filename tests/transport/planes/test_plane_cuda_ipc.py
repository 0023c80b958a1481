"""The ``cuda_ipc`` plane end to end: two cluster processes whose cuda runtime is the stub library
(its cudaMalloc memory is a memfd that cudaIpcOpenMemHandle in the other process maps, so the
peer's GPU memory really is written through the mapping), DEVICE caches on both sides.

What is checked: the plane is chosen for device-to-device transfers only (staging for the other
combinations), every byte and the guard blocks, the copies run in the process that asked (one
kernel launch per transfer, no staging buffers, nothing in the owner's log), a mapping is opened
once per allocation and closed when the owner unregisters the cache or the link ends, and a stale
table is never written through (also where the link's host plane is tcp, so only cuda_ipc's own
generation check stands between a transfer and freed memory).

Who gets the owner's handles (``CudaIpcPlane.export_refusal``): a proven process of the owner's
user on a link with a secret, or without one where the owner opted in; never a process of
another user (a stdlib peer run as ``nobody`` asks for the table), never the owner itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_staging import (BLOCKS, CLIENT_ID, MODEL_ID, SERVER_ID, TENSORS, _blocks, c_allocate, c_fill, c_link,
                          c_op, c_planes, c_read, c_seen, c_spy, push_and_pull_blocks)

import llm_datadist as ld
from llm_datadist.status import LLMStatusCode
from llm_datadist.testing import ChildError, Cluster
from llm_datadist.transport import auth, wire
from llm_datadist.transport.planes import cuda_ipc

SECRET = "cuda-ipc-tests-link-secret"
#: The stdlib peer that asks for a table (run as another user too).
IPC_PEER = Path(__file__).with_name("ipc_peer.py")
#: The system interpreter: one that a process of another user can run (this one may live in
#: root's home).
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


@pytest.fixture(autouse=True)
def _no_inherited_trust(monkeypatch):
    """Secrets and opt-ins come only from each test."""
    for name in (auth.SECRET_ENV, cuda_ipc.WITHOUT_SECRET_ENV, "LLM_DATADIST_DATA_PLANE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def cuda_env(stub_libraries, monkeypatch) -> str:
    """Cluster processes started meanwhile run the stub library as their cuda runtime."""
    path = str(stub_libraries["full"])
    for name, value in (("LLM_DATADIST_DEVICE", "cuda"), ("LLM_DATADIST_CUDA_LIBRARY", path),
                        ("LLM_DATADIST_CUDA_DRIVER_LIBRARY", path)):
        monkeypatch.setenv(name, value)
    return path


def c_plane_of(state, remote_id: int, local_device: bool, remote_device: bool) -> str:
    return state.dd.engine.data_plane(remote_id, 5000, local_device, remote_device)


def c_mapped(state) -> int:
    return state.dd.engine.runtime.ipc_mapped


def c_drop(state, name: str) -> None:
    state.cm.deallocate_blocks_cache(state.caches.pop(name))


def c_unlink(state, remote_id: int) -> None:
    info = ld.LLMClusterInfo()
    info.remote_cluster_id = remote_id
    info.append_local_ip_info("127.0.0.1", 0)
    state.dd.unlink_clusters([info], 5000, force=True)


def c_facts(state, remote_id: int):
    """The cuda_ipc part of a fresh table reply of ``remote_id``, as the link keeps it
    (``cuda_ipc.IpcFacts``; None: no exports offered)."""
    _, facts = state.dd.engine.links.plane_choice.fetch_table(state.dd.engine.links.peer(remote_id), 5000)
    return facts.get("cuda_ipc")


def c_no_cma(state) -> None:
    """This process has no cma plane (as a host where process_vm_* is not allowed): its links'
    host plane is tcp, which leaves the peer's generation check to the device plane."""
    from llm_datadist.transport import planes
    planes.unregister("cma")


def c_exports_of(state, name: str):
    """``(offset, allocation bytes, tensor bytes)`` of each tensor of a cache as cuda_ipc exports
    it, and the plane's count of registrations inside larger allocations."""
    engine = state.dd.engine
    record = engine.lookup(state.caches[name].cache_id)
    return ([tuple(engine.runtime.ipc_export(addr)[1:]) + (record.tensor_bytes,) for addr in record.addrs],
            engine.link_stats()["partial_registrations"])


def c_register_inside(state, name: str) -> int:
    """Register, as a DEVICE blocks cache, the second half of each of TENSORS allocations of twice
    its size (as a tensor of a caching allocator's segment): cuda_ipc counts it."""
    from llm_datadist import _core
    engine = state.dd.engine
    nbytes = BLOCKS * 4096
    allocations = [_core.Allocation(engine.runtime, 2 * nbytes, True) for _ in range(TENSORS)]
    state.scratch["inside"] = allocations
    desc = ld.CacheDesc(TENSORS, [BLOCKS, 4096], ld.DataType.DT_UINT8, ld.Placement.DEVICE)
    cache = state.cm.register_blocks_cache(desc, [a.addr + nbytes for a in allocations],
                                           ld.BlocksCacheKey(state.cluster_id, MODEL_ID + 1))
    state.caches[name] = cache
    return engine.link_stats()["partial_registrations"]


def _options(secret=SECRET, **extra) -> dict:
    options = {"llm.MemPoolConfig": '{"memory_size": 104857600}',
               "llm.HostMemPoolConfig": '{"memory_size": 104857600}', **extra}
    if secret is not None:
        options["llm.LinkSecret"] = secret
    return options


@contextlib.contextmanager
def _pair(client_place="DEVICE", server_place="DEVICE", secret=SECRET, server_options=None, before_link=None):
    """A server and a client linked over a link with ``secret`` (None: none), each with a blocks
    cache; ``before_link(client)`` runs in between."""
    with Cluster(SERVER_ID, "PROMPT", listen=True, options=_options(secret, **(server_options or {})),
                 timeout=60) as server, \
            Cluster(CLIENT_ID, "DECODER", options=_options(secret), timeout=60) as client:
        if before_link is not None:
            before_link(client)
        caches = {"c": client.call(c_allocate, "blocks", client_place, True),
                  "s": server.call(c_allocate, "blocks", server_place, True)}
        assert client.call(c_link, SERVER_ID, *server.address) == LLMStatusCode.LLM_SUCCESS
        yield client, server, caches


def test_device_to_device_transfers_take_cuda_ipc_and_move_every_byte(cuda_env):
    with _pair() as (client, server, caches):
        assert caches["c"][2] and caches["s"][2]  # both are device memory the host cannot address
        assert client.call(c_plane_of, SERVER_ID, True, True) == "cuda_ipc"
        assert client.call(c_plane_of, SERVER_ID, True, False) == "staging"
        assert client.call(c_plane_of, SERVER_ID, False, True) == "staging"
        client.call(c_spy)
        mine, theirs = push_and_pull_blocks(client, server, cuda_env, 11)
        assert client.call(c_seen) == [("cuda_ipc", "device")] * 2
        # The asking process mapped the owner's allocations (one per tensor) once and copied on
        # the device: one kernel launch per transfer, no page-locked staging buffer.
        fns = [c[0] for c in mine]
        assert fns.count("cudaIpcOpenMemHandle") == TENSORS
        assert fns.count("cuLaunchKernel") == 2
        assert "cudaMallocHost" not in fns and "cudaMemcpyBatchAsync" not in fns
        # The owner's runtime did nothing for them.
        assert not {"cuLaunchKernel", "cudaMemcpyAsync", "cudaMemcpyBatchAsync"} & {c[0] for c in theirs}
        assert client.call(c_mapped) == TENSORS


def test_an_unregistered_cache_is_unmapped_and_never_written_through(cuda_env):
    with _pair() as (client, server, _):
        client.call(c_fill, "blocks", 1)
        key = ld.BlocksCacheKey(SERVER_ID, MODEL_ID)
        client.call(c_op, "push_blocks", key, "blocks", [0], [0])
        assert client.call(c_mapped) == TENSORS
        server.call(c_drop, "blocks")
        with pytest.raises(ChildError) as info:
            client.call(c_op, "push_blocks", key, "blocks", [0], [0])
        assert "LLM_KV_CACHE_NOT_EXIST" in str(info.value)
        assert client.call(c_mapped) == 0  # the refreshed table no longer lists it: closed
        # A new cache under the same key is mapped afresh and written.
        server.call(c_allocate, "blocks", "DEVICE", True)
        want = _blocks(client.call(c_fill, "blocks", 2))
        client.call(c_op, "push_blocks", key, "blocks", [3], [5])
        got = _blocks(server.call(c_read, "blocks"))
        assert all(np.array_equal(got[t][5], want[t][3]) for t in range(TENSORS))
        assert client.call(c_mapped) == TENSORS


def test_unlink_closes_every_mapping(cuda_env):
    with _pair() as (client, server, _):
        client.call(c_fill, "blocks", 1)
        client.call(c_op, "pull_blocks", ld.BlocksCacheKey(SERVER_ID, MODEL_ID), "blocks", [0, 1], [2, 3])
        assert client.call(c_mapped) == TENSORS
        client.call(c_unlink, SERVER_ID)
        assert client.call(c_mapped) == 0


def test_forced_cuda_ipc_carries_device_transfers_and_leaves_host_memory_to_auto(cuda_env, monkeypatch):
    monkeypatch.setenv("LLM_DATADIST_DATA_PLANE", "cuda_ipc")
    with _pair("HOST", "DEVICE") as (client, server, _):
        assert client.call(c_plane_of, SERVER_ID, False, False) in ("cma", "tcp")
        assert client.call(c_plane_of, SERVER_ID, False, True) == "staging"  # cuda_ipc does not carry it
        want = _blocks(client.call(c_fill, "blocks", 3))
        client.call(c_op, "push_blocks", ld.BlocksCacheKey(SERVER_ID, MODEL_ID), "blocks", [1], [2])
        got = _blocks(server.call(c_read, "blocks"))
        assert all(np.array_equal(got[t][2], want[t][1]) for t in range(TENSORS))
        assert BLOCKS > 2


def test_a_stale_table_is_refreshed_when_the_host_plane_is_tcp(cuda_env):
    """Where cma carries the link's host memory its generation check refuses a stale table first;
    with tcp as the host plane only cuda_ipc's own comparison (``table_is_current``) stands
    between a table planned before an unregister and the old mapping of freed GPU memory. An
    owner whose generation moved past the table's (not just equal) must make the peer refresh."""
    with _pair(before_link=lambda client: client.call(c_no_cma)) as (client, server, _):
        assert client.call(c_planes, SERVER_ID)["link"] == "tcp"
        assert client.call(c_plane_of, SERVER_ID, True, True) == "cuda_ipc"
        client.call(c_fill, "blocks", 1)
        key = ld.BlocksCacheKey(SERVER_ID, MODEL_ID)
        client.call(c_op, "push_blocks", key, "blocks", [0], [0])
        assert client.call(c_mapped) == TENSORS
        server.call(c_drop, "blocks")  # the owner's generation moves on; the client's table is old
        with pytest.raises(ChildError) as info:
            client.call(c_op, "push_blocks", key, "blocks", [0], [0])
        assert "LLM_KV_CACHE_NOT_EXIST" in str(info.value)
        assert client.call(c_mapped) == 0  # refreshed: the old mapping is closed, not written


def test_without_a_secret_no_handle_is_offered_and_device_transfers_take_staging(cuda_env):
    with _pair(secret=None) as (client, server, _):
        assert client.call(c_facts, SERVER_ID) is None
        assert server.call(c_facts, CLIENT_ID) is None
        assert client.call(c_plane_of, SERVER_ID, True, True) == "staging"
        want = _blocks(client.call(c_fill, "blocks", 4))
        client.call(c_op, "push_blocks", ld.BlocksCacheKey(SERVER_ID, MODEL_ID), "blocks", [1], [2])
        got = _blocks(server.call(c_read, "blocks"))
        assert all(np.array_equal(got[t][2], want[t][1]) for t in range(TENSORS))
        assert client.call(c_mapped) == 0


@pytest.mark.parametrize("how", ["option", "environment"])
def test_the_opt_in_offers_handles_on_links_without_a_secret(cuda_env, monkeypatch, how):
    """The owner (the server) opts in; the client's device transfers then take cuda_ipc."""
    server_options = {}
    if how == "option":
        server_options[cuda_ipc.WITHOUT_SECRET_OPTION] = "true"
    else:
        monkeypatch.setenv(cuda_ipc.WITHOUT_SECRET_ENV, "1")
    with _pair(secret=None, server_options=server_options) as (client, server, _):
        offered = client.call(c_facts, SERVER_ID)
        assert offered is not None and len(offered.exports.cache_ids()) == 1
        assert (server.call(c_facts, CLIENT_ID) is None) == (how == "option")  # the client did not opt in
        assert client.call(c_plane_of, SERVER_ID, True, True) == "cuda_ipc"


def test_with_a_secret_a_proven_peer_of_this_user_gets_handles(cuda_env):
    with _pair() as (client, server, _):
        offered = client.call(c_facts, SERVER_ID)
        assert offered is not None and offered.exports.cache_ids() == [server.call(c_cache_id, "blocks")]
        assert server.call(c_facts, CLIENT_ID) is not None


def c_cache_id(state, name: str) -> int:
    return state.caches[name].cache_id


def test_a_link_to_this_very_process_gets_no_handles(cuda_env):
    with Cluster(SERVER_ID, "PROMPT", listen=True, options=_options(**{cuda_ipc.WITHOUT_SECRET_OPTION: "1"}),
                 timeout=60) as server:
        server.call(c_allocate, "blocks", "DEVICE", True)
        assert server.call(c_link, SERVER_ID, *server.address) == LLMStatusCode.LLM_SUCCESS
        assert server.call(c_facts, SERVER_ID) is None


def test_allocated_caches_have_allocations_of_their_own_and_registered_parts_are_counted(cuda_env):
    with Cluster(SERVER_ID, "PROMPT", listen=True, options=_options(), timeout=60) as server:
        server.call(c_allocate, "blocks", "DEVICE", True)
        exports, partial = server.call(c_exports_of, "blocks")
        assert partial == 0 and all(offset == 0 and size == nbytes for offset, size, nbytes in exports)
        assert server.call(c_register_inside, "inside") == 1
        exports, partial = server.call(c_exports_of, "inside")
        assert partial == 1 and all(offset == size // 2 == nbytes for offset, size, nbytes in exports)


# -- a raw peer of this host, of this user or of another ---------------------------------------------

def _ask_table(port: int, secret, cluster_id: int, as_nobody: bool) -> dict:
    """Run ``ipc_peer.py`` (as ``nobody`` with ``as_nobody``): what the table reply says of cuda_ipc."""
    config = {"port": port, "secret": secret, "cluster_id": cluster_id, "header": wire.HEADER.format,
              "magic": wire.MAGIC.decode(), "version": wire.PROTOCOL_VERSION,
              "labels": {side: label.hex() for side, label in auth._LABELS.items()},
              "ops": {name: getattr(wire, f"OP_{name}") for name in ("HELLO", "HELLO_REPLY", "TABLE_GET", "TABLE",
                                                                      "CHALLENGE", "AUTH")}}
    command = [SYSTEM_PYTHON, str(IPC_PEER), json.dumps(config)]
    if as_nobody:
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd="/", env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _needs_system_python():
    if SYSTEM_PYTHON is None:
        pytest.skip("no system python3 in /usr/bin or /bin for the raw peer")


def _needs_other_user():
    _needs_system_python()
    if os.geteuid() != 0:
        pytest.skip("needs root, to run the raw peer as another user (nobody, uid 65534)")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to run the raw peer as another user")
    if not os.access(IPC_PEER, os.R_OK) or os.stat(IPC_PEER).st_mode & 0o004 == 0:
        pytest.skip(f"{IPC_PEER} is not readable by other users")


@pytest.mark.parametrize("opt_in", [False, True], ids=["secret", "secret-and-opt-in"])
def test_a_peer_of_another_user_gets_no_handles(cuda_env, opt_in):
    """The stdlib peer knows the secret and links over the abstract Unix socket: as this user it
    gets the exports (the setup is honest), as nobody it gets none, opt-in or not."""
    _needs_other_user()
    extra = {cuda_ipc.WITHOUT_SECRET_OPTION: "1"} if opt_in else {}
    with Cluster(SERVER_ID, "PROMPT", listen=True, options=_options(**extra), timeout=60) as server:
        server.call(c_allocate, "blocks", "DEVICE", True)
        port = server.address[1]
        mine = _ask_table(port, SECRET, 88, as_nobody=False)
        assert mine["uid"] == os.geteuid() and mine["cuda_ipc"] is not None
        assert len(mine["cuda_ipc"]["exports"]) == 1
        theirs = _ask_table(port, SECRET, 89, as_nobody=True)
        assert theirs["uid"] == 65534 and theirs["caches"] == 1  # linked, and sees the table...
        assert theirs["cuda_ipc"] is None  # ...but no handle


@pytest.mark.parametrize("opt_in", [False, True], ids=["no-secret", "no-secret-opt-in"])
def test_a_raw_peer_of_this_user_without_a_secret_gets_handles_only_with_the_opt_in(cuda_env, opt_in):
    _needs_system_python()
    extra = {cuda_ipc.WITHOUT_SECRET_OPTION: "1"} if opt_in else {}
    with Cluster(SERVER_ID, "PROMPT", listen=True, options=_options(None, **extra), timeout=60) as server:
        server.call(c_allocate, "blocks", "DEVICE", True)
        reply = _ask_table(server.address[1], None, 88, as_nobody=False)
        assert reply["caches"] == 1
        assert (reply["cuda_ipc"] is not None) == opt_in
