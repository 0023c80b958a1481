"""The ``shm`` plane (``transport/planes/shm/``): caches the peer allocated, mapped here through
the memfd it passes over its Unix connection, moved with memcpy; user memory still through cma.
Real cluster processes, forced onto ``shm``."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

from llm_datadist import BlocksCacheKey, LLMStatusCode
from llm_datadist.testing import ChildError, Cluster, link
from llm_datadist.transport import planes

import cluster_ops as ops

S = LLMStatusCode
SERVER, CLIENT = 41, 42
MODEL = 9
TENSORS, BLOCKS, WORDS = 4, 8, 1024  # int32 words per block: 4 KiB blocks
POOL = '{"memory_size": 67108864}'

pytestmark = pytest.mark.skipif(not planes.get("shm").probe()[0], reason="no shm plane on this host")


# -- run in the cluster processes ---------------------------------------------------------------

def shm_state(state) -> dict:
    """What the shm plane of this cluster did: files passed and refused (owner), the link's
    host plane and mapped files (peer)."""
    links = state.dd.engine.links
    plane = links.planes.instance("shm")
    out = {"passed": plane.files_passed, "refused": plane.files_refused, "planes": {}, "mapped": {}}
    for peer in list(links._peers.values()):
        out["planes"][peer.cluster_id] = peer.plane_name
        shm = peer.plane_state.get("shm")
        out["mapped"][peer.cluster_id] = sorted(k[0] for k in shm.maps) if shm is not None else None
    return out


def guard_check(state, name: str, touched_blocks, value: int) -> bool:
    """Every block of cache ``name`` outside ``touched_blocks`` still holds ``value`` (the guard)."""
    for tensor in state.arrays[name]:
        for block in range(tensor.shape[0]):
            if block not in touched_blocks and not np.all(tensor[block] == value):
                return False
    return True


def set_all(state, name: str, value: int) -> None:
    for tensor in state.arrays[name]:
        tensor[...] = value


def blocks_of(state, name: str, blocks):
    return [tensor[list(blocks)].copy() for tensor in state.arrays[name]]


def set_blocks(state, name: str, blocks, base: int) -> None:
    for t, tensor in enumerate(state.arrays[name]):
        for i, block in enumerate(blocks):
            tensor[block] = base + 1000 * t + i


# -- fixtures ---------------------------------------------------------------------------------------

@pytest.fixture
def pair():
    options = {"remote_cache_accessible": "1", "llm.MemPoolConfig": POOL, "llm.HostMemPoolConfig": POOL}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(Cluster(SERVER, "PROMPT", listen=True, plane="shm", options=options, timeout=30))
        client = stack.enter_context(Cluster(CLIENT, "DECODER", plane="shm", options=options, timeout=30))
        yield server, client


# -- tests ----------------------------------------------------------------------------------------

def test_pushes_and_pulls_into_an_allocated_cache_go_through_the_mapped_file(pair):
    server, client = pair
    server.call(ops.allocate, "remote", TENSORS, (BLOCKS, WORDS), "HOST", True, (), MODEL)
    client.call(ops.allocate, "local", TENSORS, (BLOCKS, WORDS), "HOST", True)
    server.call(set_all, "remote", -7)
    assert link(client, server) == (0, [0])
    key = BlocksCacheKey(SERVER, MODEL)
    client.call(set_blocks, "local", [0, 1, 2], 11)
    client.call(ops.py, "push_blocks", key, "local", [0, 1, 2], [5, 1, 6])
    assert server.call(guard_check, "remote", {5, 1, 6}, -7)
    got = server.call(blocks_of, "remote", [5, 1, 6])
    want = client.call(blocks_of, "local", [0, 1, 2])
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    server.call(set_blocks, "remote", [3, 4], 500)
    client.call(set_all, "local", -1)
    client.call(ops.py, "pull_blocks", key, "local", [3, 4], [7, 0])
    assert client.call(guard_check, "local", {7, 0}, -1)
    got = client.call(blocks_of, "local", [7, 0])
    want = server.call(blocks_of, "remote", [3, 4])
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    owner, peer = server.call(shm_state), client.call(shm_state)
    assert owner["passed"] == 1 and owner["refused"] == 0
    assert peer["planes"][SERVER] == "shm" and len(peer["mapped"][SERVER]) == 1


def route_kinds(state) -> list:
    return sorted(type(route).__name__ for route in state.dd.engine.routes.values())


def expected_blocks(src, dst, pairs, src_blocks, dst_blocks):
    out = [t.copy() for t in dst]
    for s_t, d_t in pairs:
        for s, d in zip(src_blocks, dst_blocks):
            out[d_t][d] = src[s_t][s]
    return out


def same(got, want) -> bool:
    return len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))


def test_repeated_block_calls_take_a_mapped_route_that_a_new_allocation_retires(pair):
    """Repeated pushes and pulls (with layer arguments) between allocated caches run on
    ``_io.MappedRoute`` after the first checked call and move exactly the checked bytes; after
    the owner drops the cache and allocates another under the same model, the old route is no
    longer current and the next call lands in the new cache."""
    server, client = pair
    server.call(ops.allocate, "remote", TENSORS, (BLOCKS, WORDS), "HOST", True, (), MODEL)
    client.call(ops.allocate, "local", TENSORS, (BLOCKS, WORDS), "HOST", True)
    assert link(client, server) == (0, [0])
    key = BlocksCacheKey(SERVER, MODEL)
    everything = [(t, t) for t in range(TENSORS)]
    calls = [("push_blocks", [0], [1], {}, everything),
             ("push_blocks", [2, 3], [5, 4], {}, everything),
             ("push_blocks", (6,), (7,), dict(src_layer_range=range(1, 2), dst_layer_range=range(0, 1)),
              [(2, 0), (3, 1)]),
             ("pull_blocks", [3], [2], {}, everything),
             ("pull_blocks", [4, 0], [6, 7], dict(tensor_num_per_layer=1, src_layer_range=range(3, 4),
                                                  dst_layer_range=range(0, 1)), [(3, 0)])]
    for round_ in range(3):  # the first round learns the routes, the others use them
        for i, (method, sb, db, kwargs, pairs) in enumerate(calls):
            local = client.call(ops.fill, "local", 100 * round_ + 2 * i)
            remote = server.call(ops.fill, "remote", 100 * round_ + 2 * i + 1)
            client.call(ops.py, method, key, "local", sb, db, **kwargs)
            if method == "push_blocks":
                want_local, want_remote = local, expected_blocks(local, remote, pairs, sb, db)
            else:
                want_local, want_remote = expected_blocks(remote, local, pairs, sb, db), remote
            assert same(client.call(ops.snapshot, "local"), want_local), (round_, method)
            assert same(server.call(ops.snapshot, "remote"), want_remote), (round_, method)
    assert client.call(route_kinds) == ["MappedRoute", "MappedRoute"]
    server.call(deallocate, "remote")
    server.call(ops.allocate, "remote", TENSORS, (BLOCKS, WORDS), "HOST", True, (), MODEL)
    for _ in range(2):
        local = client.call(ops.fill, "local", 7)
        remote = server.call(ops.fill, "remote", 8)
        client.call(ops.py, "push_blocks", key, "local", [0], [1])
        assert same(server.call(ops.snapshot, "remote"), expected_blocks(local, remote, everything, [0], [1]))
    assert client.call(shm_state)["mapped"][SERVER] == [server.call(lambda_cache_id, "remote")]


def deallocate(state, name: str) -> None:
    cache = state.caches.pop(name)
    state.arrays.pop(name)
    state.cm.deallocate_blocks_cache(cache)


def keep_mapping(state, remote_id: int) -> int:
    """Keep (as a test's hostile peer would) the one file of ``remote_id`` mapped now; its cache id."""
    maps = state.dd.engine.links._peers[remote_id].plane_state["shm"].maps
    (key, mapped), = maps.items()
    state.kept = mapped
    return key[0]


def kept_view(state) -> np.ndarray:
    from llm_datadist import _core
    mapped = state.kept
    return np.frombuffer(_core.HostRegion(mapped.local, mapped.size, mapped), dtype=np.int32)


def write_kept(state, value: int) -> None:
    kept_view(state)[...] = value


def kept_holds_only(state, value: int) -> bool:
    return bool(np.all(kept_view(state) == value))


def test_a_mapping_kept_after_the_cache_is_dropped_reaches_no_later_allocation(pair):
    """A peer that keeps its mapping of a cache the owner dropped maps that cache's old file: the
    owner's next allocation is a new file, which the peer maps anew (the table refresh after the
    generation changed drops the old mapping from the link)."""
    server, client = pair
    server.call(ops.allocate, "old", TENSORS, (BLOCKS, WORDS), "HOST", True, (), MODEL)
    client.call(ops.allocate, "local", TENSORS, (BLOCKS, WORDS), "HOST", True)
    assert link(client, server) == (0, [0])
    key = BlocksCacheKey(SERVER, MODEL)
    client.call(set_all, "local", 3)
    client.call(ops.py, "push_blocks", key, "local", [0], [0])
    old_id = client.call(keep_mapping, SERVER)
    server.call(deallocate, "old")
    new_id = server.call(ops.allocate, "new", TENSORS, (BLOCKS, WORDS), "HOST", True, (), MODEL)
    assert new_id != old_id
    server.call(set_all, "new", 77)
    client.call(write_kept, -5)  # scribbling over the old file...
    assert server.call(guard_check, "new", set(), 77)  # ...touches nothing of the new cache
    client.call(ops.py, "push_blocks", key, "local", [1], [2])  # stale table: refreshed, new file mapped
    assert client.call(kept_holds_only, -5)  # the new cache's bytes never show in the old file
    assert server.call(guard_check, "new", {2}, 77)
    assert client.call(shm_state)["mapped"][SERVER] == [new_id]
    assert server.call(shm_state)["passed"] == 2


def plane_transfer(state, remote_id: int, cache_id: int, tensor: int, offset: int, nbytes: int, write: bool):
    """Move ``nbytes`` at ``offset`` from the start of tensor ``tensor`` of the peer's cache through the
    link's plane directly (below the API's checks); None or the status code it raised."""
    from llm_datadist import _io
    from llm_datadist.transport import deadline as dl
    peer = state.dd.engine.links._peers[remote_id]
    table = peer.table
    here = np.zeros(nbytes, dtype=np.uint8)
    remote = (table.caches[cache_id].addrs[tensor] + offset) % (1 << 64)
    desc = (here.ctypes.data, remote, nbytes) if write else (remote, here.ctypes.data, nbytes)
    plan = _io.plan_from_wire(np.array(desc, dtype="<u8").tobytes())
    try:
        peer.plane.transfer(peer, table, plan, write, dl.after(5000))
    except Exception as exc:  # noqa: BLE001 - the status is the point
        return int(getattr(exc, "status_code", -1))
    return None


def test_descriptors_outside_a_shared_cache_are_refused_below_the_api(pair):
    """The plane's own check (a peer's plan reaching past the cache) refuses what cma refuses:
    ``LLM_KV_CACHE_NOT_EXIST``, nothing moved; inside, the same call goes through."""
    server, client = pair
    cache_id = server.call(ops.allocate, "remote", TENSORS, (BLOCKS, WORDS), "HOST", True, (), MODEL)
    client.call(ops.allocate, "local", TENSORS, (BLOCKS, WORDS), "HOST", True)
    server.call(set_all, "remote", 9)
    assert link(client, server) == (0, [0])
    client.call(ops.py, "pull_blocks", BlocksCacheKey(SERVER, MODEL), "local", [0], [0])  # settles the plane
    tensor = BLOCKS * WORDS * 4
    for write in (True, False):
        for at, offset in ((-1, tensor - 8), (0, -8), (0, 1 << 40), (0, -(1 << 40))):
            assert client.call(plane_transfer, SERVER, cache_id, at, offset, 16, write) == S.LLM_KV_CACHE_NOT_EXIST
    assert server.call(guard_check, "remote", set(), 9)
    assert client.call(plane_transfer, SERVER, cache_id, -1, tensor - 16, 16, True) is None
    assert not server.call(guard_check, "remote", set(), 9)


@pytest.mark.parametrize("blocks", [([0], [BLOCKS]), ([BLOCKS], [0])], ids=["dst past", "src past"])
def test_block_ids_outside_an_allocated_cache_are_refused_as_on_cma(pair, blocks):
    server, client = pair
    server.call(ops.allocate, "remote", TENSORS, (BLOCKS, WORDS), "HOST", True, (), MODEL)
    client.call(ops.allocate, "local", TENSORS, (BLOCKS, WORDS), "HOST", True)
    server.call(set_all, "remote", 9)
    assert link(client, server) == (0, [0])
    for method in ("push_blocks", "pull_blocks"):
        with pytest.raises(ChildError) as refused:
            client.call(ops.py, method, BlocksCacheKey(SERVER, MODEL), "local", *blocks)
        assert refused.value.status_code == S.LLM_PARAM_INVALID
    assert server.call(guard_check, "remote", set(), 9)


# -- a raw peer asking for files ------------------------------------------------------------------

RAW_PEER = r"""
import array, json, os, socket, struct, sys
HEADER = struct.Struct("<4sHHIQQ")
MAGIC, VERSION = b"LLDD", int(sys.argv[2])
OP = dict(HELLO=1, TABLE_GET=3, TABLE=4, AUTH=16, SHM_GET=17, SHM=18)
def send(sock, op, obj, req_id=1):
    body = json.dumps(obj).encode()
    sock.sendall(HEADER.pack(MAGIC, VERSION, op, 0, req_id, len(body)) + body)
def recv(sock, files=None):
    head = b""
    while len(head) < HEADER.size:
        data, anc, _, _ = sock.recvmsg(HEADER.size - len(head), socket.CMSG_SPACE(64 * 4))
        if not data:
            raise EOFError
        for level, kind, payload in anc:
            got = array.array("i")
            got.frombytes(payload[:len(payload) - len(payload) % 4])
            if files is not None:
                files.extend(got)
        head += data
    _, _, op, status, req_id, length = HEADER.unpack(head)
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return op, status, req_id, json.loads(body) if body else {}
def handshake(sock, request):
    send(sock, OP["HELLO"], {"cluster_id": 88, "nonce": os.urandom(32).hex(), "auth": False})
    assert recv(sock)[1] == 0
    send(sock, OP["AUTH"], request)
    op, status, _, reply = recv(sock)
    assert status == 0, reply
    return reply
first = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
reply = handshake(first, {"purpose": "link", "role": "DECODER", "planes": ["shm", "cma", "tcp"], "host": {},
                          "remote_cache_accessible": True, "connections": [1, 1], "pid": os.getpid(),
                          "uid": os.getuid()})
conns = []
for purpose in ("forward", "reverse"):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + reply["unix"])
    handshake(sock, {"purpose": purpose, "token": reply["token"]})
    conns.append(sock)
first.close()
forward = conns[0]
send(forward, OP["TABLE_GET"], {}, 2)
_, _, _, table = recv(forward)
def proof(entry, pid):
    # What a process that may ptrace the owner reads at the address its shm entry names.
    if sys.argv[5] == "none" or not isinstance(entry, dict) or "proof_addr" not in entry:
        return None
    with open("/proc/%d/mem" % pid, "rb", buffering=0) as mem:
        mem.seek(entry["proof_addr"])
        value = int.from_bytes(mem.read(8), "little")
    return value ^ 1 if sys.argv[5] == "wrong" else value
files = []
send(forward, OP["SHM_GET"], {"caches": json.loads(sys.argv[3]), "proof": proof(table.get("shm"), reply["pid"])}, 3)
op, status, _, answer = recv(forward, files)
print(json.dumps({"shm_entry": table.get("shm"), "status": status, "answer": answer, "files": len(files),
                  "sizes": [os.fstat(f).st_size for f in files]}), flush=True)
try:  # a malformed request ends the connection
    send(forward, OP["SHM_GET"], {"caches": json.loads(sys.argv[4]), "proof": proof(table.get("shm"), reply["pid"])}, 4)
    print(json.dumps({"after_malformed": recv(forward)[1]}), flush=True)
except (EOFError, OSError) as exc:
    print(json.dumps({"after_malformed": "closed"}), flush=True)
"""


def raw_peer(server: Cluster, ask, malformed, as_user=None, proof="read") -> list:
    import json
    import shutil
    import subprocess
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("needs a system python3")
    kwargs = {}
    if as_user is not None:
        kwargs["preexec_fn"] = lambda: (os.setgid(as_user.pw_gid), os.setuid(as_user.pw_uid))
    from llm_datadist.transport import wire
    done = subprocess.run([python, "-c", RAW_PEER, str(server.address[1]), str(wire.PROTOCOL_VERSION),
                           json.dumps(ask), json.dumps(malformed), proof], capture_output=True, text=True, cwd="/",
                          env={"PATH": "/usr/bin:/bin"}, timeout=60, **kwargs)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.fixture
def owner():
    options = {"llm.HostMemPoolConfig": POOL}
    with Cluster(SERVER, "PROMPT", listen=True, options=options, timeout=30) as server:
        yield server


def test_a_peer_of_this_user_gets_one_file_per_shared_cache_and_nothing_else(owner):
    cache_id = owner.call(ops.allocate, "remote", TENSORS, (BLOCKS, WORDS), "HOST", True, (), MODEL)
    owner.call(ops.register, "user", 1, (BLOCKS, WORDS), "HOST", True)  # numpy memory: not shared
    user_id = owner.call(lambda_cache_id, "user")
    got, after = raw_peer(owner, [cache_id, user_id, 999999], [-1])
    assert got["shm_entry"]["caches"] == [[cache_id, got["shm_entry"]["caches"][0][1]]]
    assert got["status"] == 0 and got["files"] == 1 and [c[0] for c in got["answer"]["caches"]] == [cache_id]
    assert got["sizes"] == [TENSORS * BLOCKS * WORDS * 4]
    assert after == {"after_malformed": "closed"}


@pytest.mark.parametrize("proof", ["none", "wrong"])
def test_a_peer_of_this_user_that_did_not_read_this_process_gets_no_file(owner, proof):
    # The owner's memory is what the kernel's ptrace rule guards (cma: process_vm_readv): a
    # process of this user that it keeps out (Yama ptrace_scope, a non-dumpable owner) must not
    # get the caches' files by asking. The request carries the word read at the entry's proof_addr.
    cache_id = owner.call(ops.allocate, "remote", TENSORS, (BLOCKS, WORDS), "HOST", True, (), MODEL)
    got, _ = raw_peer(owner, [cache_id], [cache_id], proof=proof)
    assert got["status"] == S.LLM_FEATURE_NOT_ENABLED and got["files"] == 0
    assert "read" in got["answer"]["error"]
    assert owner.call(shm_state)["passed"] == 0


@pytest.mark.parametrize("malformed", [["x"], [0], list(range(1, 202)), {"caches": 1}],
                         ids=["not an id", "zero", "too many", "not a list"])
def test_a_malformed_file_request_ends_the_connection(owner, malformed):
    cache_id = owner.call(ops.allocate, "remote", TENSORS, (BLOCKS, WORDS), "HOST", True, (), MODEL)
    got, after = raw_peer(owner, [cache_id], malformed)
    assert got["files"] == 1 and after == {"after_malformed": "closed"}


def test_a_peer_of_another_user_gets_no_file():
    import pwd
    if os.geteuid() != 0:
        pytest.skip("needs root (to start a process as another user)")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user")
    options = {"llm.HostMemPoolConfig": POOL}
    with Cluster(SERVER, "PROMPT", listen=True, options=options, timeout=30) as server:
        cache_id = server.call(ops.allocate, "remote", TENSORS, (BLOCKS, WORDS), "HOST", True, (), MODEL)
        got, _ = raw_peer(server, [cache_id], [cache_id], as_user=nobody)
        assert got["shm_entry"] is None
        assert got["status"] == S.LLM_FEATURE_NOT_ENABLED and got["files"] == 0
        assert "another user" in got["answer"]["error"]
        assert server.call(shm_state)["refused"] == 2 and server.call(shm_state)["passed"] == 0  # asked twice


def lambda_cache_id(state, name: str) -> int:
    return state.caches[name].cache_id
