"""Adversity tests for links and data planes: peers killed or stopped in the middle of a
transfer (on either side of it), malformed, truncated and oversized frames from raw sockets and
from a hand-made peer past the handshake, long runs of small transfers and of links (no leaks),
three processes moving bytes at once, and links to listeners that are absent, silent or broken.
The last section holds the tests that found library bugs; their docstrings say what was found.

Every cluster lives in its own process (``llm_datadist.testing.Cluster``). What a cluster must
observe about itself -- how long a failing call took, its threads, descriptors and memory, the
bytes of its caches -- is measured inside that process by the module-level functions below,
which run there as ``fn(state, *args)``. Cache contents are a pattern computed from a seed, so
either side can check bytes without shipping them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing
from typing import Dict, List, Optional, Sequence

import numpy as np
import pytest

from llm_datadist import BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMException, Placement
from llm_datadist.status import LLMStatusCode
from llm_datadist.testing import ChildError, Cluster, link
from llm_datadist.transport import planes, wire
from llm_datadist.transport.host import host_identity

import rawpeer

S = LLMStatusCode
PLANES = [name for name in planes.host_names() if not planes.get(name).requires_secret]  # no secret here
SYNC_TIMEOUT_MS = 2000
OPTIONS = {"llm.SyncKvCacheWaitTime": str(SYNC_TIMEOUT_MS)}
#: What a failing call may take beyond its deadline.
MARGIN_S = 1.0
DEADLINE_S = SYNC_TIMEOUT_MS / 1000 + MARGIN_S
SERVER_ID, CLIENT_ID, OTHER_CLIENT_ID = 1, 2, 3
TENSORS = 2
MIB = 1 << 20


# ------------------------------------------------------------------------------------------------
# Run inside the cluster processes
# ------------------------------------------------------------------------------------------------

def _mix(values: np.ndarray) -> np.ndarray:
    values = (values + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    return values ^ (values >> np.uint64(29))


def _pattern_parts(seed: int, tensor: int, blocks: Sequence[int], block_bytes: int):
    salt = np.uint64((seed << 24) + (tensor << 8))
    within = _mix(np.arange(block_bytes // 8, dtype=np.uint64) + salt)
    per_block = _mix(np.asarray(list(blocks), dtype=np.uint64) * np.uint64(0x100000001) + ~salt)
    return per_block, within


def pattern(seed: int, tensor: int, blocks: Sequence[int], block_bytes: int) -> np.ndarray:
    """The bytes that blocks ``blocks`` of tensor ``tensor`` hold in a cache filled from ``seed``
    (one row per block): word ``w`` of block ``b`` is ``h(seed, tensor, b) ^ h(seed, tensor, w)``,
    so every block and every word position within a block looks different."""
    per_block, within = _pattern_parts(seed, tensor, blocks, block_bytes)
    return (per_block[:, None] ^ within[None, :]).view(np.uint8)


def register_cache(state, name: str, model_id: int, num_blocks: int, block_bytes: int, seed: int) -> List[int]:
    """Register a host blocks cache of ``TENSORS`` tensors filled from ``seed`` under
    ``BlocksCacheKey(this cluster, model_id)``; returns the tensor addresses."""
    arrays = [pattern(seed, t, range(num_blocks), block_bytes) for t in range(TENSORS)]
    desc = CacheDesc(TENSORS, [num_blocks, block_bytes], DataType.DT_UINT8, Placement.HOST)
    cache = state.cm.register_blocks_cache(desc, [a.ctypes.data for a in arrays],
                                           BlocksCacheKey(state.cluster_id, model_id))
    state.arrays[name] = arrays
    state.caches[name] = cache
    return [a.ctypes.data for a in arrays]


def blocks_hold(state, name: str, seed: int, blocks: Sequence[int], pattern_blocks: Optional[Sequence[int]] = None
                ) -> bool:
    """Whether ``blocks`` of every tensor of cache ``name`` hold the pattern of ``seed`` at
    ``pattern_blocks`` (default: the same block indices). Compared block by block."""
    blocks = list(blocks)
    pattern_blocks = blocks if pattern_blocks is None else list(pattern_blocks)
    for t, array in enumerate(state.arrays[name]):
        words = array.view(np.uint64)
        per_block, within = _pattern_parts(seed, t, pattern_blocks, array.shape[1])
        if not all(np.array_equal(words[b], per_block[i] ^ within) for i, b in enumerate(blocks)):
            return False
    return True


def fill_blocks(state, name: str, seed: int, blocks: Sequence[int]) -> None:
    arrays = state.arrays[name]
    for t, array in enumerate(arrays):
        array[list(blocks)] = pattern(seed, t, blocks, array.shape[1])


def resources(state) -> Dict[str, object]:
    """Open descriptors, live threads (ident, name) and resident memory of this process."""
    with open("/proc/self/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"fds": len(os.listdir("/proc/self/fd")), "rss_kb": rss_kb,
            "threads": sorted([t.ident or 0, t.name] for t in threading.enumerate())}


def settle(state, baseline: Dict[str, object], timeout: float = 5.0, fds: bool = True) -> Dict[str, object]:
    """Wait until this process is back to ``baseline`` threads (and descriptors, with ``fds``);
    the state then, or at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        now = resources(state)
        back = now["threads"] == baseline["threads"] and (not fds or now["fds"] == baseline["fds"])
        if back or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def quiet_resources(state, timeout: float = 3.0) -> Dict[str, object]:
    """``resources`` once no connection thread is left (they end a moment after an unlink)."""
    deadline = time.monotonic() + timeout
    while any(t.name == "llm_datadist-conn" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return resources(state)


def steady(state, links: int, timeout: float = 5.0) -> None:
    """Wait until the connection threads are those of ``links`` made links (each serves its
    peer's two forward connections; the thread that made a link here ends a moment after)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(t.name == "llm_datadist-conn" for t in threading.enumerate()) == 2 * links:
            return
        time.sleep(0.01)


def read_bytes(state, name: str, tensor: int, start: int, nbytes: int) -> bytes:
    """``nbytes`` of tensor ``tensor`` of cache ``name`` from byte ``start`` on."""
    return state.arrays[name][tensor].reshape(-1)[start:start + nbytes].tobytes()


def status_of(fn, *args, **kwargs) -> int:
    try:
        fn(*args, **kwargs)
    except LLMException as exc:
        return int(exc.status_code)
    return 0


def transfer(state, op: str, remote_id: int, name: str, src_blocks: Sequence[int], dst_blocks: Sequence[int],
             model_id: int = 0) -> int:
    """``push``: local ``src_blocks`` -> remote ``dst_blocks``; ``pull``: remote ``src_blocks`` ->
    local ``dst_blocks``. Returns the status (0 on success)."""
    key = BlocksCacheKey(remote_id, model_id)
    fn = state.cm.push_blocks if op == "push" else state.cm.pull_blocks
    return status_of(fn, key, state.caches[name], list(src_blocks), list(dst_blocks))


def transfer_until_failure(state, op: str, remote_id: int, name: str, blocks: Sequence[int], marker: str,
                           max_seconds: float) -> Dict[str, object]:
    """Repeat one large transfer back to back until it fails, so that a peer killed or stopped
    from outside catches one in flight. ``marker`` is created after the first success. Returns
    the failing status and when (``time.monotonic``) the failing call started and returned."""
    blocks = list(blocks)
    key = BlocksCacheKey(remote_id, 0)
    fn = state.cm.push_blocks if op == "push" else state.cm.pull_blocks
    done = 0
    stop = time.monotonic() + max_seconds
    while time.monotonic() < stop:
        started = time.monotonic()
        try:
            fn(key, state.caches[name], blocks, blocks)
        except LLMException as exc:
            return {"status": int(exc.status_code), "started": started, "failed": time.monotonic(), "done": done}
        done += 1
        if done == 1:
            with open(marker, "w") as f:
                f.write("started")
    return {"status": 0, "started": 0.0, "failed": 0.0, "done": done}


def cluster_info(remote_id: int, ip: str = "127.0.0.1", port: int = 0) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = remote_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info(ip, port)
    return info


def timed_link(state, remote_id: int, ip: str, port: int, timeout_ms: int) -> Dict[str, object]:
    """``link_clusters`` to ``ip:port``: the statuses and the seconds the call took."""
    started = time.monotonic()
    status, rets = state.dd.link_clusters([cluster_info(remote_id, ip, port)], timeout_ms)
    return {"status": int(status), "rets": [int(r) for r in rets], "seconds": time.monotonic() - started}


def unlink(state, remote_id: int, ip: str = "127.0.0.1", port: int = 0, force: bool = False) -> int:
    status, _ = state.dd.unlink_clusters([cluster_info(remote_id, ip, port)], 2000, force=force)
    return int(status)


def linked(state) -> List[int]:
    return state.dd.engine.links.linked_clusters()


def peer_plane(state, remote_id: int) -> str:
    return state.dd.engine.links.data_plane(remote_id)


def protocol_errors(state) -> int:
    return state.dd.engine.protocol_errors


def record_thread_exceptions(state) -> None:
    """From now on, an exception escaping a thread of this process is recorded (see
    ``thread_exceptions``) besides being printed."""
    errors = state.scratch.setdefault("thread_exceptions", [])
    previous = threading.excepthook

    def hook(args) -> None:
        errors.append(f"{args.exc_type.__name__}: {args.exc_value} (thread {args.thread.name})")
        previous(args)

    threading.excepthook = hook


def thread_exceptions(state) -> List[str]:
    return list(state.scratch.get("thread_exceptions", []))


# ------------------------------------------------------------------------------------------------
# Helpers of the test process
# ------------------------------------------------------------------------------------------------

def start_clusters(stack: ExitStack, *specs: Dict[str, object]) -> List[Cluster]:
    """Start one cluster per spec (``Cluster`` keyword arguments) at once -- each spends about
    half a second importing -- and have ``stack`` close them."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(Cluster, **spec) for spec in specs]
    clusters, failure = [], None
    for future in futures:
        try:
            clusters.append(stack.enter_context(future.result()))
        except BaseException as exc:  # start-up failed: the others are closed by the stack
            failure = failure or exc
    if failure is not None:
        raise failure
    return clusters


def server_spec(plane: Optional[str], cluster_id: int = SERVER_ID) -> Dict[str, object]:
    return {"cluster_id": cluster_id, "listen": True, "plane": plane, "options": OPTIONS}


def client_spec(plane: Optional[str], cluster_id: int = CLIENT_ID) -> Dict[str, object]:
    return {"cluster_id": cluster_id, "plane": plane, "options": OPTIONS}


def wait_for_file(path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)


def name_of(code: int) -> str:
    try:
        return LLMStatusCode(code).name
    except ValueError:
        return str(code)


def assert_threads_and_fds_back(now: Dict[str, object], baseline: Dict[str, object], who: str) -> None:
    assert now["threads"] == baseline["threads"], f"{who}: threads {baseline['threads']} -> {now['threads']}"
    assert now["fds"] == baseline["fds"], f"{who}: {now['fds']} descriptors open, {baseline['fds']} before"


# ------------------------------------------------------------------------------------------------
# A peer killed or stopped in the middle of a large transfer
# ------------------------------------------------------------------------------------------------

BIG_BLOCK = 2 * MIB
BIG_BLOCKS = 64  # x 2 tensors x 2 MiB = 256 MiB a transfer
SENTINEL_BLOCKS = 4  # after the transferred blocks on the survivor: never to be touched
SURVIVOR_SEED, VICTIM_SEED, FRESH_SEED = 11, 22, 33


@pytest.mark.parametrize("victim", ["server", "client"])
@pytest.mark.parametrize("op", ["push", "pull"])
@pytest.mark.parametrize("plane", PLANES)
def test_peer_killed_mid_transfer(plane, op, victim, tmp_path):
    """SIGKILL the peer while a 256 MiB push or pull runs: the caller gets LINK_FAILED or TIMEOUT
    within sync_kv_timeout + 1 s, keeps its source bytes and untouched blocks, leaves no thread
    or descriptor behind after unlink, and links to a fresh peer with the same id."""
    marker = tmp_path / "started"
    with ExitStack() as stack:
        server, client = start_clusters(stack, server_spec(plane), client_spec(plane))
        survivor, dead = (client, server) if victim == "server" else (server, client)
        survivor.call(register_cache, "big", 0, BIG_BLOCKS + SENTINEL_BLOCKS, BIG_BLOCK, SURVIVOR_SEED)
        dead.call(register_cache, "big", 0, BIG_BLOCKS, BIG_BLOCK, VICTIM_SEED)
        baseline = survivor.call(resources)
        assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert survivor.call(peer_plane, dead.cluster_id) == plane

        survivor.send(transfer_until_failure, op, dead.cluster_id, "big", range(BIG_BLOCKS), str(marker), 60.0)
        wait_for_file(marker, 30)
        time.sleep(0.05)
        killed_at = time.monotonic()
        os.kill(dead.pid, signal.SIGKILL)
        outcome = survivor.result(timeout=60)
        dead.process.join(10)

        assert outcome["done"] >= 1
        assert outcome["status"] in (S.LLM_LINK_FAILED, S.LLM_TIMEOUT), name_of(outcome["status"])
        assert outcome["failed"] >= killed_at, "a transfer failed before the peer was killed"
        assert outcome["failed"] - outcome["started"] <= DEADLINE_S
        assert outcome["failed"] - killed_at <= DEADLINE_S

        if survivor is client:  # the peer cannot be told; local state goes anyway
            assert survivor.call(unlink, SERVER_ID, *server.address) == S.LLM_UNLINK_FAILED
        else:
            assert survivor.call(unlink, CLIENT_ID, force=True) == S.LLM_SUCCESS
        assert survivor.call(linked) == []
        assert_threads_and_fds_back(survivor.call(settle, baseline), baseline, "survivor")
        everything = range(BIG_BLOCKS + SENTINEL_BLOCKS)
        if op == "push":
            assert survivor.call(blocks_hold, "big", SURVIVOR_SEED, everything), "the pushed source changed"
        sentinels = range(BIG_BLOCKS, BIG_BLOCKS + SENTINEL_BLOCKS)
        assert survivor.call(blocks_hold, "big", SURVIVOR_SEED, sentinels), "blocks outside the transfer changed"

        fresh = stack.enter_context(Cluster(dead.cluster_id, listen=dead is server, plane=plane, options=OPTIONS))
        fresh.call(register_cache, "big", 0, SENTINEL_BLOCKS, BIG_BLOCK, FRESH_SEED)
        status = link(survivor, fresh) if victim == "server" else link(fresh, survivor)
        assert status == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        fresh_blocks = range(SENTINEL_BLOCKS)
        if op == "push":
            assert survivor.call(transfer, "push", fresh.cluster_id, "big", sentinels, fresh_blocks) == 0
            assert fresh.call(blocks_hold, "big", SURVIVOR_SEED, fresh_blocks, sentinels)
        else:
            assert survivor.call(transfer, "pull", fresh.cluster_id, "big", fresh_blocks, fresh_blocks) == 0
            assert survivor.call(blocks_hold, "big", FRESH_SEED, fresh_blocks)


@pytest.mark.parametrize("stopped", ["server", "client"])
@pytest.mark.parametrize("op", ["push", "pull"])
def test_peer_stopped_mid_tcp_transfer(op, stopped, tmp_path):
    """SIGSTOP the peer during a TCP transfer: LLM_TIMEOUT within sync_kv_timeout + 1 s; after
    SIGCONT the link is rebuilt (unlink, link) and moves bytes again."""
    marker = tmp_path / "started"
    with ExitStack() as stack:
        server, client = start_clusters(stack, server_spec("tcp"), client_spec("tcp"))
        caller, peer = (client, server) if stopped == "server" else (server, client)
        caller.call(register_cache, "big", 0, BIG_BLOCKS // 2, BIG_BLOCK, SURVIVOR_SEED)
        peer.call(register_cache, "big", 0, BIG_BLOCKS // 2, BIG_BLOCK, VICTIM_SEED)
        baseline = caller.call(resources)
        assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])

        caller.send(transfer_until_failure, op, peer.cluster_id, "big", range(BIG_BLOCKS // 2), str(marker), 60.0)
        wait_for_file(marker, 30)
        time.sleep(0.05)
        stopped_at = time.monotonic()
        os.kill(peer.pid, signal.SIGSTOP)
        try:
            outcome = caller.result(timeout=60)
        finally:
            os.kill(peer.pid, signal.SIGCONT)

        assert outcome["status"] == S.LLM_TIMEOUT, name_of(outcome["status"])
        assert outcome["failed"] >= stopped_at, "a transfer failed before the peer was stopped"
        assert outcome["failed"] - outcome["started"] <= DEADLINE_S
        assert outcome["failed"] - stopped_at <= DEADLINE_S
        if op == "push":
            assert caller.call(blocks_hold, "big", SURVIVOR_SEED, range(BIG_BLOCKS // 2))

        if caller is client:
            assert caller.call(unlink, SERVER_ID, *server.address) in (S.LLM_SUCCESS, S.LLM_UNLINK_FAILED)
        else:
            assert caller.call(unlink, CLIENT_ID, force=True) == S.LLM_SUCCESS
            assert client.call(unlink, SERVER_ID, force=True) == S.LLM_SUCCESS
        assert caller.call(linked) == []
        assert_threads_and_fds_back(caller.call(settle, baseline), baseline, "caller")

        assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert caller.call(transfer, op, peer.cluster_id, "big", [0, 1], [2, 3]) == 0
        if op == "push":
            assert peer.call(blocks_hold, "big", SURVIVOR_SEED, [2, 3], [0, 1])
        else:
            assert caller.call(blocks_hold, "big", VICTIM_SEED, [2, 3], [0, 1])


def timed_unregister(state, name: str, wait: float) -> Optional[float]:
    """Unregister cache ``name`` on a helper thread: the seconds it took, or None if it had not
    returned after ``wait`` seconds (it then finishes in the background)."""
    took: List[float] = []

    def run() -> None:
        started = time.monotonic()
        state.cm.unregister_cache(state.caches[name].cache_id)
        took.append(time.monotonic() - started)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(wait)
    return took[0] if took else None


@pytest.mark.parametrize("op", ["push", "pull"])
@pytest.mark.parametrize("plane", PLANES)
def test_transferring_side_killed_leaves_the_owner_serving(plane, op, tmp_path):
    """SIGKILL the client while it pushes into or pulls from the server (the owner of the
    memory): the server's connection threads end, nothing keeps its registry pinned (an
    unregister returns at once), its other bytes are intact, and a new client with the same id
    links and transfers."""
    marker = tmp_path / "started"
    with ExitStack() as stack:
        server, client = start_clusters(stack, server_spec(plane), client_spec(plane))
        server.call(register_cache, "big", 0, BIG_BLOCKS + SENTINEL_BLOCKS, BIG_BLOCK, SURVIVOR_SEED)
        server.call(register_cache, "spare", 1, SENTINEL_BLOCKS, BIG_BLOCK, FRESH_SEED)
        client.call(register_cache, "big", 0, BIG_BLOCKS, BIG_BLOCK, VICTIM_SEED)
        baseline = server.call(resources)
        assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])

        client.send(transfer_until_failure, op, SERVER_ID, "big", range(BIG_BLOCKS), str(marker), 60.0)
        wait_for_file(marker, 30)
        time.sleep(0.05)
        os.kill(client.pid, signal.SIGKILL)
        client.process.join(10)

        assert server.call(settle, baseline, 5.0, False)["threads"] == baseline["threads"], \
            "the server's threads for the dead client did not end"
        assert server.call(timed_unregister, "spare", 2.0) is not None, "unregister blocked by the dead client"
        sentinels = range(BIG_BLOCKS, BIG_BLOCKS + SENTINEL_BLOCKS)
        assert server.call(blocks_hold, "big", SURVIVOR_SEED, sentinels)
        if op == "pull":
            assert server.call(blocks_hold, "big", SURVIVOR_SEED, range(BIG_BLOCKS))
        assert server.call(unlink, CLIENT_ID, force=True) == S.LLM_SUCCESS
        assert_threads_and_fds_back(server.call(settle, baseline), baseline, "server")

        fresh = stack.enter_context(Cluster(CLIENT_ID, plane=plane, options=OPTIONS))
        fresh.call(register_cache, "big", 0, SENTINEL_BLOCKS, BIG_BLOCK, FRESH_SEED)
        assert link(fresh, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert fresh.call(transfer, "pull", SERVER_ID, "big", sentinels, range(SENTINEL_BLOCKS)) == 0
        assert fresh.call(blocks_hold, "big", SURVIVOR_SEED, range(SENTINEL_BLOCKS), sentinels)


# ------------------------------------------------------------------------------------------------
# Malformed, truncated and oversized frames from a raw socket
# ------------------------------------------------------------------------------------------------

SMALL_BLOCK = 64 << 10
SMALL_BLOCKS = 8
SERVER_SEED, CLIENT_SEED, GUARDED_SEED = 5, 6, 7
EOF_WAIT_S = 5.0  # well under the server's 10 s handshake timeout: a close must come from the error


frame = rawpeer.frame  # a frame as the wire module would pack it, with any field overridable


def raw_connect(address) -> socket.socket:
    return socket.create_connection(address, timeout=EOF_WAIT_S)


def read_until_closed(sock: socket.socket, timeout: float = EOF_WAIT_S) -> bytes:
    """Everything the server sends until it closes the connection; TimeoutError if it does
    not close within ``timeout``."""
    sock.settimeout(timeout)
    received = b""
    deadline = time.monotonic() + timeout
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received
        except socket.timeout:
            raise TimeoutError(f"the server kept the connection open for {timeout} s "
                               f"(received {len(received)} bytes)") from None
        if not chunk:
            return received
        received += chunk
        if time.monotonic() > deadline:
            raise TimeoutError("the server keeps sending")


def read_frame(sock: socket.socket, timeout: float = EOF_WAIT_S):
    """One reply frame: ``(op, status, req_id, payload)``."""
    return rawpeer.read_frame(sock, timeout)


GOOD_HELLO_BODY = b'{"purpose":"link"}'

#: Frames that must make the server close the connection without an answer.
MALFORMED = {
    "bad magic": frame(wire.OP_HELLO, GOOD_HELLO_BODY, magic=b"XXXX"),
    "bad version": frame(wire.OP_HELLO, GOOD_HELLO_BODY, version=wire.PROTOCOL_VERSION + 1),
    "version zero": frame(wire.OP_HELLO, GOOD_HELLO_BODY, version=0),
    "unknown op": frame(999, GOOD_HELLO_BODY),
    "push before hello": frame(wire.OP_PUSH, bytes(32)),
    "table request before hello": frame(wire.OP_TABLE_GET),
    "hello reply as first frame": frame(wire.OP_HELLO_REPLY, b"{}"),
    "hello not json": frame(wire.OP_HELLO, b"\xff\xfe not json at all"),
    "hello json array": frame(wire.OP_HELLO, b"[1, 2, 3]"),
    "hello json lacking fields": frame(wire.OP_HELLO, GOOD_HELLO_BODY),
    "hello with non-integer ids": frame(wire.OP_HELLO, json.dumps(
        {"purpose": "link", "cluster_id": "9", "role": "PROMPT", "pid": "x", "host": {}, "probe": [0, 0],
         "generation_addr": 0, "table": {}}).encode()),
    "hello announcing 1 TiB": frame(wire.OP_HELLO, length=1 << 40),
    "hello announcing 2**64-1 bytes": frame(wire.OP_HELLO, length=2**64 - 1),
    "hello announcing 1 TiB with some payload": frame(wire.OP_HELLO, b"{" * 1000, length=1 << 40),
}

#: Connections that end in the middle of a frame (nothing to read back: we close first).
TRUNCATED = {
    "nothing": b"",
    "half a header": frame(wire.OP_HELLO, GOOD_HELLO_BODY)[:wire.HEADER_BYTES // 2],
    "header without its payload": frame(wire.OP_HELLO, GOOD_HELLO_BODY)[:wire.HEADER_BYTES],
    "half a hello payload": frame(wire.OP_HELLO, b'{"purpose":"link","cluster_id":9}')[:wire.HEADER_BYTES + 10],
}


@pytest.fixture(params=PLANES)
def linked_pair(request):
    """A listening server with two caches (``main``, used by the client; ``guarded``, never a
    destination) and a client linked to it over ``plane``."""
    plane = request.param
    with ExitStack() as stack:
        server, client = start_clusters(stack, server_spec(plane), client_spec(plane))
        server.call(register_cache, "main", 0, SMALL_BLOCKS, SMALL_BLOCK, SERVER_SEED)
        server.call(register_cache, "guarded", 1, SMALL_BLOCKS, SMALL_BLOCK, GUARDED_SEED)
        client.call(register_cache, "main", 0, SMALL_BLOCKS, SMALL_BLOCK, CLIENT_SEED)
        assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        server.call(steady, 1)
        server.call(record_thread_exceptions)
        yield server, client


def check_still_serving(server: Cluster, client: Cluster) -> None:
    """The linked client pushes and pulls through the server; bytes land exactly."""
    assert client.call(transfer, "push", SERVER_ID, "main", [0, 1], [2, 3]) == 0
    assert server.call(blocks_hold, "main", CLIENT_SEED, [2, 3], [0, 1])
    assert client.call(transfer, "pull", SERVER_ID, "main", [4, 5], [6, 7]) == 0
    assert client.call(blocks_hold, "main", SERVER_SEED, [6, 7], [4, 5])


def check_server_bytes(server: Cluster) -> None:
    """``guarded`` is untouched; ``main`` holds its own pattern except blocks 2, 3 (pushed)."""
    assert server.call(blocks_hold, "guarded", GUARDED_SEED, range(SMALL_BLOCKS))
    assert server.call(blocks_hold, "main", SERVER_SEED, [0, 1, 4, 5, 6, 7])
    assert server.call(blocks_hold, "main", CLIENT_SEED, [2, 3], [0, 1])


def answer_to(case: str) -> bytes:
    """What the server answers to the malformed first frame ``case`` before it closes: nothing,
    but to a hello of another version (since 3) a refused challenge in that version naming both."""
    if case != "bad version":
        return b""
    line = f"protocol version {wire.PROTOCOL_VERSION + 1}, this side speaks {wire.PROTOCOL_VERSION}"
    payload = json.dumps({"error": line}, separators=(",", ":")).encode()
    return wire.HEADER.pack(wire.MAGIC, wire.PROTOCOL_VERSION + 1, wire.OP_CHALLENGE, S.LLM_LINK_FAILED, 1,
                            len(payload)) + payload


def test_malformed_first_frames_close_only_that_connection(linked_pair):
    """Bad magic, bad version, an unknown op, a first frame that is not a hello, a hello that is
    not a JSON object or lacks fields, a hello announcing 1 TiB: the server closes that
    connection at once without answering (a hello of another version since 3 only after one
    refused challenge in that version, naming both), and keeps serving the linked client."""
    server, client = linked_pair
    baseline = server.call(resources)
    for case, data in MALFORMED.items():
        with closing(raw_connect(server.address)) as sock:
            sock.sendall(data)
            started = time.monotonic()
            try:
                answer = read_until_closed(sock)
            except TimeoutError as exc:
                pytest.fail(f"{case}: {exc}")
            assert answer == answer_to(case), f"{case}: the server answered {answer[:64]!r}"
            assert time.monotonic() - started < EOF_WAIT_S
        check_still_serving(server, client)
    assert_threads_and_fds_back(server.call(settle, baseline), baseline, f"server after {len(MALFORMED)} bad frames")
    check_server_bytes(server)
    assert server.call(linked) == [CLIENT_ID]
    assert server.call(thread_exceptions) == []


def test_connections_cut_mid_frame_leave_no_thread_behind(linked_pair):
    """Connections that close before a frame is whole (nothing sent, half a header, a header
    without its payload, half a hello): the server's thread for each ends, and the server keeps
    serving. (Their descriptors: see test_connection_cut_mid_frame_is_closed_by_the_server.)"""
    server, client = linked_pair
    baseline = server.call(resources)
    for data in TRUNCATED.values():
        with closing(raw_connect(server.address)) as sock:
            if data:
                sock.sendall(data)
        check_still_serving(server, client)
    now = server.call(settle, baseline, 5.0, False)
    assert now["threads"] == baseline["threads"]
    check_server_bytes(server)


def test_stalled_raw_connections_do_not_block_others(linked_pair):
    """Raw connections that send nothing, or a header and then nothing, occupy only themselves:
    while they hang, a new client links and transfers promptly."""
    server, client = linked_pair
    with ExitStack() as stack:
        stack.enter_context(closing(raw_connect(server.address)))  # silent
        stalled = stack.enter_context(closing(raw_connect(server.address)))
        stalled.sendall(frame(wire.OP_HELLO, length=wire.MAX_CONTROL_BYTES))
        with Cluster(OTHER_CLIENT_ID, plane=None, options=OPTIONS) as other:
            other.call(register_cache, "main", 0, SMALL_BLOCKS, SMALL_BLOCK, CLIENT_SEED)
            outcome = other.call(timed_link, SERVER_ID, *server.address, 2000)
            assert outcome["status"] == S.LLM_SUCCESS
            assert outcome["seconds"] < 2.0
            assert other.call(transfer, "pull", SERVER_ID, "main", [4], [4]) == 0
            assert other.call(blocks_hold, "main", SERVER_SEED, [4])
        check_still_serving(server, client)
    check_server_bytes(server)
    assert server.call(thread_exceptions) == []


# ------------------------------------------------------------------------------------------------
# Bad frames after a valid handshake, from a hand-made peer
# ------------------------------------------------------------------------------------------------

RAW_ID = 99
SCRATCH_SEED = 8
#: Whether PUSH and PULL payloads start with the generation of the owner's table the sender
#: planned against (the wire format grew that field; see transport/wire.py).
GENERATION_IN_TRANSFERS = hasattr(wire, "STATUS_STALE_TABLE")


def transfer_prefix(generation: int) -> bytes:
    return wire.U64.pack(generation) if GENERATION_IN_TRANSFERS else b""


def push_frame(descriptors, data: bytes, generation: int, length: Optional[int] = None,
               desc_len: Optional[int] = None) -> bytes:
    """A PUSH frame (request id 2) with any length field overridable."""
    descs = b"".join(wire.U64.pack(v) for d in descriptors for v in d)
    body = transfer_prefix(generation) + wire.U64.pack(len(descs) if desc_len is None else desc_len) + descs + data
    return frame(wire.OP_PUSH, body, length, req_id=2)


def push_length(desc_bytes: int, data_bytes: int) -> int:
    """The payload length of a PUSH with ``desc_bytes`` of descriptors and ``data_bytes`` of data."""
    return len(transfer_prefix(0)) + 8 + desc_bytes + data_bytes


def pull_prefix(generation: int, tag: bytes = b"") -> bytes:
    """What a PULL payload starts with: the generation, the tag's length and the tag (version 5)."""
    return transfer_prefix(generation) + wire.U64.pack(len(tag)) + tag


def pull_frame(descriptors, generation: int, length: Optional[int] = None, req_id: int = 2) -> bytes:
    descs = b"".join(wire.U64.pack(v) for d in descriptors for v in d)
    return frame(wire.OP_PULL, pull_prefix(generation) + descs, length, req_id=req_id)


class RawPeer:
    """A hand-made client: a valid link (cluster ``RAW_ID``, over TCP, so the tcp plane), then
    whatever frames a test writes on its forward connection."""

    def __init__(self, address) -> None:
        self.link = rawpeer.RawLink(address, RAW_ID)
        self.sock = self.link.sock
        self.table = self.link.table()
        self.generation = self.table["generation"]
        self.next_id = 100

    def cache(self, model_id: int):
        """``(tensor addresses, tensor bytes)`` of the server's blocks cache ``model_id``."""
        table = self.table
        cache_id = dict(table["blocks"])[model_id]
        entry = next(c for c in table["caches"] if c[0] == cache_id)
        return entry[6], entry[4] * entry[5]

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, op: int, payload: bytes = b"", length: Optional[int] = None) -> int:
        req_id = self.next_id
        self.next_id += 1
        self.sock.sendall(frame(op, payload, length, req_id=req_id))
        return req_id

    def push(self, descriptors, data: bytes, generation: Optional[int] = None):
        """A whole PUSH frame (planned against ``generation``, default the server's); the reply
        ``(op, status, req_id, payload)``."""
        descs = b"".join(wire.U64.pack(v) for d in descriptors for v in d)
        prefix = transfer_prefix(self.generation if generation is None else generation)
        req_id = self.request(wire.OP_PUSH, prefix + wire.U64.pack(len(descs)) + descs + data)
        reply = read_frame(self.sock)
        assert reply[2] == req_id
        return reply

    def pull(self, descriptors, generation: Optional[int] = None):
        descs = b"".join(wire.U64.pack(v) for d in descriptors for v in d)
        req_id = self.request(wire.OP_PULL, pull_prefix(self.generation if generation is None else generation)
                              + descs)
        reply = read_frame(self.sock)
        assert reply[2] == req_id
        return reply

    def close(self) -> None:
        self.link.close()


@pytest.fixture
def tcp_server_with_client():
    """A tcp server with caches ``main`` (model 0), ``guarded`` (model 1) and ``scratch`` (model
    2, the hand-made peer's own destination), and a real tcp client linked to it."""
    with ExitStack() as stack:
        server, client = start_clusters(stack, server_spec("tcp"), client_spec("tcp"))
        server.call(register_cache, "main", 0, SMALL_BLOCKS, SMALL_BLOCK, SERVER_SEED)
        server.call(register_cache, "guarded", 1, SMALL_BLOCKS, SMALL_BLOCK, GUARDED_SEED)
        server.call(register_cache, "scratch", 2, SMALL_BLOCKS, SMALL_BLOCK, SCRATCH_SEED)
        client.call(register_cache, "main", 0, SMALL_BLOCKS, SMALL_BLOCK, CLIENT_SEED)
        assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        server.call(steady, 1)
        server.call(record_thread_exceptions)
        yield server, client


def private_addresses(state) -> Dict[str, int]:
    """Addresses of this process's own words that no peer may touch (its registry generation and
    its same-host probe cookie)."""
    engine = state.dd.engine
    return {"generation": engine.generation_word.addr, "probe": engine.links.planes["cma"].cookie.addr}


def test_raw_peer_requests_outside_registered_memory_are_refused(tcp_server_with_client):
    """After a valid handshake, pushes and pulls naming memory the server did not register (past
    the end of a tensor, its generation word, its probe cookie, the null page) are refused with
    LLM_KV_CACHE_NOT_EXIST, change nothing, and leave the connection usable; a push and a pull
    inside registered memory work byte-exactly on the same connection."""
    server, client = tcp_server_with_client
    peer = RawPeer(server.address)
    try:
        addrs, tensor_bytes = peer.cache(2)
        outside = [
            (0, addrs[0] + tensor_bytes - 8, 16),  # straddles the end of a tensor
            (0, addrs[0] + tensor_bytes - 15, 16),  # ends one byte past it
            (0, addrs[0] - 1, 16),  # starts one byte before a tensor
            (0, addrs[1] + tensor_bytes, 8),  # just past it
            (0, server.call(private_addresses)["generation"], 8),
            (0, server.call(private_addresses)["probe"], 8),
            (0, 4096, 8),
        ]
        for desc in outside:
            op, status, _, payload = peer.push([desc], b"\x5a" * desc[2])
            assert (op, status, payload) == (wire.OP_PUSH_DONE, S.LLM_KV_CACHE_NOT_EXIST, b""), hex(desc[1])
            # One refused descriptor spoils the whole request, even after a good one.
            op, status, _, _ = peer.push([(0, addrs[0], 8), desc], b"\x5a" * (8 + desc[2]))
            assert status == S.LLM_KV_CACHE_NOT_EXIST
            op, status, _, payload = peer.pull([(desc[1], 0, desc[2])])
            assert (op, status, payload) == (wire.OP_PULL_DATA, S.LLM_KV_CACHE_NOT_EXIST, b""), hex(desc[1])
        assert server.call(blocks_hold, "scratch", SCRATCH_SEED, range(SMALL_BLOCKS))

        if GENERATION_IN_TRANSFERS:  # planned against another table: refused, nothing moves
            inside = (0, addrs[0], 64)
            op, status, _, payload = peer.push([inside], b"\x5a" * 64, generation=peer.generation + 1)
            assert (op, status, payload) == (wire.OP_PUSH_DONE, wire.STATUS_STALE_TABLE, b"")
            op, status, _, payload = peer.pull([(addrs[0], 0, 64)], generation=peer.generation + 1)
            assert (op, status, payload) == (wire.OP_PULL_DATA, wire.STATUS_STALE_TABLE, b"")
            assert server.call(blocks_hold, "scratch", SCRATCH_SEED, range(SMALL_BLOCKS))

        data = bytes(range(256)) * 4
        op, status, _, _ = peer.push([(0, addrs[1] + SMALL_BLOCK, len(data))], data)
        assert (op, status) == (wire.OP_PUSH_DONE, 0)
        assert server.call(read_bytes, "scratch", 1, SMALL_BLOCK, len(data)) == data
        op, status, _, payload = peer.pull([(addrs[0] + 3 * SMALL_BLOCK, 0, 4096)])
        assert (op, status) == (wire.OP_PULL_DATA, 0)
        assert payload == server.call(read_bytes, "scratch", 0, 3 * SMALL_BLOCK, 4096)
    finally:
        peer.close()
    check_still_serving(server, client)
    check_server_bytes(server)
    assert server.call(thread_exceptions) == []


def _bad_after_handshake(addrs, generation: int) -> Dict[str, bytes]:
    """Frames that must close a linked connection (each is sent on a fresh hand-made link)."""
    inside = (0, addrs[0], 16)
    return {
        "unknown op": frame(999, req_id=2),
        "a second hello": frame(wire.OP_HELLO, b"{}", req_id=2),
        "a reply op as a request": frame(wire.OP_PUSH_DONE, req_id=2),
        "push shorter than its fixed fields": frame(wire.OP_PUSH, bytes(4), req_id=2),
        "push announcing 1 TiB": push_frame([inside], b"", generation, length=1 << 40),
        "push whose descriptors exceed the frame": push_frame([inside], bytes(16), generation, desc_len=1 << 30),
        "push with a ragged descriptor list": push_frame([inside], bytes(16), generation, desc_len=20),
        "push descriptors covering more than the data": push_frame([(0, addrs[0], 1 << 20)], bytes(16), generation),
        "push wrapping the address space": push_frame([(0, 2**64 - 8, 16)], bytes(16), generation),
        "pull with a ragged descriptor list": frame(wire.OP_PULL, pull_prefix(generation) + bytes(30), req_id=2),
        "pull announcing 120 MiB of descriptors": pull_frame(
            [], generation, length=len(pull_prefix(0)) + 24 * (5 << 20)),
        "pull with a tag over the budget": frame(wire.OP_PULL, pull_prefix(generation, bytes(513)), req_id=2),
        "pull whose tag runs past the frame": frame(wire.OP_PULL, transfer_prefix(generation) + wire.U64.pack(64)
                                                    + bytes(40), req_id=2),
        "pull wrapping the address space": pull_frame([(2**64 - 8, 0, 16)], generation),
        "table request announcing 1 TiB": frame(wire.OP_TABLE_GET, length=1 << 40, req_id=2),
        "key release that is not JSON": frame(wire.OP_KEY_DONE, b"\x00\x01garbage", req_id=2),
        "key release without a key": frame(wire.OP_KEY_DONE, b'{"tensors":[0]}', req_id=2),
    }


def test_raw_peer_bad_frames_close_only_that_link(tcp_server_with_client):
    """After a valid handshake, unknown or misplaced ops, PUSH/PULL frames whose lengths and
    descriptors disagree, 1 TiB announcements, address-space wraps and garbage control payloads
    each close that connection without an answer and count one protocol error; the linked
    client keeps working and no registered byte changes."""
    server, client = tcp_server_with_client
    baseline = server.call(resources)
    errors = server.call(protocol_errors)
    first = RawPeer(server.address)
    addrs, _ = first.cache(2)
    first.close()
    for number, (case, data) in enumerate(_bad_after_handshake(addrs, first.generation).items(), 1):
        peer = RawPeer(server.address)
        try:
            peer.send(data)
            try:
                answer = read_until_closed(peer.sock)
            except TimeoutError as exc:
                pytest.fail(f"{case}: {exc}")
            assert answer == b"", f"{case}: answered {answer[:64]!r}"
        finally:
            peer.close()
        check_still_serving(server, client)
        assert server.call(protocol_errors) == errors + number, case
    assert server.call(blocks_hold, "scratch", SCRATCH_SEED, range(SMALL_BLOCKS))
    check_server_bytes(server)
    assert server.call(thread_exceptions) == []
    assert CLIENT_ID in server.call(linked)
    assert server.call(unlink, RAW_ID, force=True) == S.LLM_SUCCESS
    assert server.call(settle, baseline, 5.0, False)["threads"] == baseline["threads"]


def wait_until_linked(state, expected: List[int], timeout: float) -> List[int]:
    deadline = time.monotonic() + timeout
    while linked(state) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return linked(state)


def test_half_made_link_does_not_stay(tcp_server_with_client):
    """A client that completes the forward handshake but never opens its reverse connection,
    then goes away, leaves no link behind on the server (a half-made link would block
    switch_role with LLM_EXIST_LINK and keep a Peer forever)."""
    server, client = tcp_server_with_client
    peer = RawPeer(server.address)
    assert server.call(linked) == [CLIENT_ID, RAW_ID]
    peer.close()
    assert server.call(wait_until_linked, [CLIENT_ID], 2.0) == [CLIENT_ID]
    check_still_serving(server, client)


def test_raw_peer_truncated_push_writes_only_its_destination(tcp_server_with_client):
    """A PUSH whose payload stops half way (the peer closes) or whose descriptor list stops
    half way: the server drops the connection and counts it; bytes may have reached the named
    destination blocks but nowhere else."""
    server, client = tcp_server_with_client
    errors = server.call(protocol_errors)
    peer = RawPeer(server.address)
    addrs, _ = peer.cache(2)
    head = push_frame([(0, addrs[0] + SMALL_BLOCK, 2 * SMALL_BLOCK)], b"", peer.generation,
                      length=push_length(24, 2 * SMALL_BLOCK))
    peer.send(head + b"\x77" * SMALL_BLOCK)  # half of the payload
    peer.close()
    peer = RawPeer(server.address)
    peer.send(push_frame([(0, addrs[1], 16)], b"", peer.generation, length=push_length(48, 16), desc_len=48))
    peer.close()
    deadline = time.monotonic() + 5
    while server.call(protocol_errors) < errors + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.call(protocol_errors) == errors + 2
    outside = [0] + list(range(3, SMALL_BLOCKS))
    assert server.call(blocks_hold, "scratch", SCRATCH_SEED, outside)
    check_still_serving(server, client)
    check_server_bytes(server)
    assert server.call(thread_exceptions) == []


# ------------------------------------------------------------------------------------------------
# Long runs: no growth in descriptors, threads or memory
# ------------------------------------------------------------------------------------------------

TINY_BLOCK = 4096
TINY_BLOCKS = 16  # blocks 0-7: own pattern, sent; blocks 8-15: received
WARM_UP, RUN = 100, 1000
RSS_TOLERANCE_KB = 2048


def small_transfers(state, remote_id: int, count: int) -> Dict[str, object]:
    """``count`` rounds of one one-block push and one one-block pull; resources after."""
    failures = []
    half = TINY_BLOCKS // 2
    for i in range(count):
        block = i % half
        for op, src, dst in (("push", block, half + block), ("pull", block, half + block)):
            status = transfer(state, op, remote_id, "tiny", [src], [dst])
            if status:
                failures.append((i, op, name_of(status)))
    return {"failures": failures[:5], "failed": len(failures), **resources(state)}


def link_cycles(state, remote_id: int, ip: str, port: int, count: int) -> Dict[str, object]:
    """``count`` rounds of link, a one-block push, non-forced unlink, back to back; resources
    after."""
    failures = []
    for i in range(count):
        outcome = timed_link(state, remote_id, ip, port, 2000)
        pushed = transfer(state, "push", remote_id, "tiny", [i % 8], [8 + i % 8]) if outcome["status"] == 0 else -1
        unlinked = unlink(state, remote_id, ip, port)
        if (outcome["status"], pushed, unlinked) != (0, 0, 0):
            failures.append((i, name_of(outcome["status"]), name_of(pushed), name_of(unlinked)))
    return {"failures": failures[:5], "failed": len(failures), **quiet_resources(state)}


def assert_no_growth(before: Dict[str, object], after: Dict[str, object], who: str) -> None:
    assert after["fds"] == before["fds"], f"{who}: descriptors {before['fds']} -> {after['fds']}"
    assert len(after["threads"]) == len(before["threads"]), f"{who}: threads {before['threads']} -> {after['threads']}"
    grown = after["rss_kb"] - before["rss_kb"]
    assert grown <= RSS_TOLERANCE_KB, f"{who}: resident memory grew by {grown} KiB"


@pytest.mark.parametrize("plane", PLANES)
def test_thousand_small_transfers_leak_nothing(plane):
    """1,000 rounds of a one-block push and a one-block pull after 100 rounds of warm-up: every
    transfer succeeds, bytes are exact, and neither side gains descriptors, threads or (beyond
    a small tolerance) resident memory."""
    with ExitStack() as stack:
        server, client = start_clusters(stack, server_spec(plane), client_spec(plane))
        server.call(register_cache, "tiny", 0, TINY_BLOCKS, TINY_BLOCK, SERVER_SEED)
        client.call(register_cache, "tiny", 0, TINY_BLOCKS, TINY_BLOCK, CLIENT_SEED)
        assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        warm = client.call(small_transfers, SERVER_ID, WARM_UP)
        server_before = server.call(resources)
        done = client.call(small_transfers, SERVER_ID, RUN, timeout=120)
        server_after = server.call(resources)
        assert (warm["failed"], done["failed"]) == (0, 0), done["failures"] or warm["failures"]
        assert_no_growth(warm, done, "client")
        assert_no_growth(server_before, server_after, "server")
        half = range(TINY_BLOCKS // 2)
        assert server.call(blocks_hold, "tiny", CLIENT_SEED, range(8, 16), half)
        assert client.call(blocks_hold, "tiny", SERVER_SEED, range(8, 16), half)
        assert server.call(blocks_hold, "tiny", SERVER_SEED, half)


@pytest.mark.parametrize("plane", PLANES)
def test_link_unlink_cycles_leak_nothing(plane):
    """300 rounds of link, push, unlink, back to back, after 10 of warm-up: all succeed and
    neither side gains descriptors, threads or resident memory."""
    with ExitStack() as stack:
        server, client = start_clusters(stack, server_spec(plane), client_spec(plane))
        server.call(register_cache, "tiny", 0, TINY_BLOCKS, TINY_BLOCK, SERVER_SEED)
        client.call(register_cache, "tiny", 0, TINY_BLOCKS, TINY_BLOCK, CLIENT_SEED)
        warm = client.call(link_cycles, SERVER_ID, *server.address, 10)
        server_before = server.call(quiet_resources)
        done = client.call(link_cycles, SERVER_ID, *server.address, 300, timeout=120)
        server_after = server.call(quiet_resources)
        assert (warm["failed"], done["failed"]) == (0, 0), done["failures"] or warm["failures"]
        assert_no_growth(warm, done, "client")
        assert_no_growth(server_before, server_after, "server")
        assert server.call(linked) == [] and client.call(linked) == []
        assert server.call(blocks_hold, "tiny", CLIENT_SEED, range(8, 16), range(8))


# ------------------------------------------------------------------------------------------------
# Three processes, several threads each, all at once
# ------------------------------------------------------------------------------------------------

HUB_BLOCK = 16 << 10
HUB_BLOCKS = 128
SPOKE_BLOCKS = 64
WORKERS = 4
ROUNDS = 30
CLIENT_IDS = (CLIENT_ID, OTHER_CLIENT_ID)


def _run_workers(work, count: int) -> List[str]:
    """Run ``work(worker, barrier, errors)`` on ``count`` threads started together."""
    barrier = threading.Barrier(count)
    errors: List[str] = []
    threads = [threading.Thread(target=work, args=(w, barrier, errors)) for w in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return errors + [f"{t.name} still running" for t in threads if t.is_alive()]


def spoke_traffic(state, slot: int) -> List[str]:
    """A client's workers: each pushes fresh bytes to its own hub blocks, reads them back, and
    pulls its own slice of the hub's fixed blocks -- ROUNDS times, all workers at once."""
    def work(worker: int, barrier, errors: List[str]) -> None:
        own = list(range(4 * worker, 4 * worker + 4))
        landing = [16 + b for b in own]
        hub_rw = [16 * slot + b for b in own]
        hub_fixed = [32 + 16 * slot + b for b in own]
        barrier.wait()
        for i in range(ROUNDS):
            seed = (state.cluster_id << 16) | (worker << 8) | i
            fill_blocks(state, "spoke", seed, own)
            for op, src, dst, check in (("push", own, hub_rw, None), ("pull", hub_rw, landing, (seed, own)),
                                        ("pull", hub_fixed, landing, (SERVER_SEED, hub_fixed))):
                status = transfer(state, op, SERVER_ID, "spoke", src, dst)
                if status:
                    errors.append(f"worker {worker} round {i}: {op} failed with {name_of(status)}")
                elif check and not blocks_hold(state, "spoke", check[0], landing, check[1]):
                    errors.append(f"worker {worker} round {i}: {op} of {src} brought wrong bytes")
    return _run_workers(work, WORKERS)


def hub_traffic(state) -> List[str]:
    """The server's workers: for each client, each pushes fresh bytes to its own blocks of the
    client and pulls them back into the hub -- ROUNDS times, all at once."""
    def work(worker: int, barrier, errors: List[str]) -> None:
        slot, lane = divmod(worker, WORKERS)
        remote = CLIENT_IDS[slot]
        source = [96 + 16 * slot + 4 * lane + b for b in range(4)]
        back = [64 + 16 * slot + 4 * lane + b for b in range(4)]
        spoke = [32 + 4 * lane + b for b in range(4)]
        barrier.wait()
        for i in range(ROUNDS):
            seed = (0xAB << 16) | (worker << 8) | i
            fill_blocks(state, "hub", seed, source)
            for op, src, dst in (("push", source, spoke), ("pull", spoke, back)):
                status = transfer(state, op, remote, "hub", src, dst)
                if status:
                    errors.append(f"worker {worker} round {i}: {op} to {remote} failed with {name_of(status)}")
            if not blocks_hold(state, "hub", seed, back, source):
                errors.append(f"worker {worker} round {i}: cluster {remote} did not hold what was pushed")
    return _run_workers(work, WORKERS * len(CLIENT_IDS))


@pytest.mark.parametrize("plane", PLANES)
def test_three_processes_concurrent_transfers(plane):
    """One server and two clients; four threads in each client push to and pull from the server
    while eight threads in the server push to and pull from both clients. Every transfer
    succeeds, every byte read back is exact, and blocks nobody wrote keep their bytes."""
    with ExitStack() as stack:
        hub, *spokes = start_clusters(stack, server_spec(plane), *(client_spec(plane, cid) for cid in CLIENT_IDS))
        hub.call(register_cache, "hub", 0, HUB_BLOCKS, HUB_BLOCK, SERVER_SEED)
        for spoke in spokes:
            spoke.call(register_cache, "spoke", 0, SPOKE_BLOCKS, HUB_BLOCK, spoke.cluster_id)
            assert link(spoke, hub) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        for slot, spoke in enumerate(spokes):
            spoke.send(spoke_traffic, slot)
        hub.send(hub_traffic)
        errors = [hub.result(timeout=150)] + [spoke.result(timeout=150) for spoke in spokes]
        assert errors == [[], [], []]

        assert hub.call(blocks_hold, "hub", SERVER_SEED, range(32, 64))
        for slot, spoke in enumerate(spokes):
            assert spoke.call(blocks_hold, "spoke", spoke.cluster_id, range(48, SPOKE_BLOCKS))
            last = ROUNDS - 1
            for worker in range(WORKERS):
                own = range(4 * worker, 4 * worker + 4)
                seed = (spoke.cluster_id << 16) | (worker << 8) | last
                assert hub.call(blocks_hold, "hub", seed, [16 * slot + b for b in own], own)
                hub_seed = (0xAB << 16) | ((slot * WORKERS + worker) << 8) | last
                source = [96 + 16 * slot + 4 * worker + b for b in range(4)]
                assert spoke.call(blocks_hold, "spoke", hub_seed, [32 + b for b in own], source)


# ------------------------------------------------------------------------------------------------
# Links to listeners that are not there or never answer
# ------------------------------------------------------------------------------------------------

LINK_TIMEOUT_MS = 1000


def _read_hello(conn: socket.socket) -> dict:
    _, _, _, payload = read_frame(conn)
    return json.loads(payload)


class FakeListener:
    """A listening socket in the test process that treats link attempts in one broken way."""

    def __init__(self, behaviour: str, reply=None) -> None:
        self.behaviour = behaviour
        self.reply = reply
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: List[socket.socket] = []
        self.stopped = threading.Event()
        self.thread = None
        if behaviour != "never accepts":
            self.thread = threading.Thread(target=self._accept, daemon=True)
            self.thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.conns.append(conn)
            try:
                self._treat(conn)
            except OSError:
                pass

    def _treat(self, conn: socket.socket) -> None:
        if self.behaviour == "closes at once":
            conn.close()
        elif self.behaviour == "answers garbage":
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        elif self.behaviour == "announces a 1 TiB reply":
            _read_hello(conn)
            conn.sendall(wire.pack_header(wire.OP_HELLO_REPLY, 1, 1 << 40))
        elif self.behaviour == "stops half way through its reply":
            _read_hello(conn)
            conn.sendall(wire.pack_header(wire.OP_HELLO_REPLY, 1, 100) + b'{"cluster_id":')
        elif self.behaviour == "replies with another op":
            _read_hello(conn)
            conn.sendall(wire.pack_header(wire.OP_TABLE, 1, 2) + b"{}")
        elif self.behaviour == "crafted reply":
            hello = _read_hello(conn)
            payload = json.dumps(self.reply(hello)).encode()
            conn.sendall(wire.pack_header(wire.OP_HELLO_REPLY, 1, len(payload)) + payload)
        # "accepts and stays silent": hold the connection

    def close(self) -> None:
        self.stopped.set()
        self.sock.close()
        if self.thread is not None:
            self.thread.join(5)
        for conn in self.conns:
            conn.close()


def free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def lonely_client():
    """A client with no links and a real server for it to link to after each failure."""
    with ExitStack() as stack:
        server, client = start_clusters(stack, server_spec("tcp"), client_spec("tcp"))
        client.call(register_cache, "tiny", 0, TINY_BLOCKS, TINY_BLOCK, CLIENT_SEED)
        server.call(register_cache, "tiny", 0, TINY_BLOCKS, TINY_BLOCK, SERVER_SEED)
        yield client, server


def check_links_again(client: Cluster, server: Cluster, baseline: Dict[str, object]) -> None:
    """After a failed link: nothing is left behind and a real link still works."""
    assert client.call(linked) == []
    assert_threads_and_fds_back(client.call(settle, baseline), baseline, "client after a failed link")
    assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert client.call(transfer, "pull", SERVER_ID, "tiny", [0], [9]) == 0
    assert client.call(blocks_hold, "tiny", SERVER_SEED, [9], [0])
    assert client.call(unlink, SERVER_ID, *server.address) == S.LLM_SUCCESS
    assert_threads_and_fds_back(client.call(settle, baseline), baseline, "client after unlink")


BROKEN_LISTENERS = ["nobody listens", "never accepts", "accepts and stays silent", "closes at once",
                    "answers garbage", "announces a 1 TiB reply", "stops half way through its reply",
                    "replies with another op"]


@pytest.mark.parametrize("behaviour", BROKEN_LISTENERS)
def test_link_to_a_broken_listener_fails_in_time(lonely_client, behaviour):
    """link_clusters to a port nobody listens on, or to a listener that never accepts, never
    answers, closes, answers garbage, announces a 1 TiB reply, stops half way or answers with the
    wrong op: LLM_LINK_FAILED (returned, not raised) within the link timeout + 1 s, nothing
    left behind, and a real link works right after."""
    client, server = lonely_client
    baseline = client.call(resources)
    listener = None if behaviour == "nobody listens" else FakeListener(behaviour)
    try:
        port = free_port() if listener is None else listener.port
        outcome = client.call(timed_link, SERVER_ID, "127.0.0.1", port, LINK_TIMEOUT_MS)
    finally:
        if listener is not None:
            listener.close()
    assert (outcome["status"], outcome["rets"]) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    assert outcome["seconds"] <= LINK_TIMEOUT_MS / 1000 + MARGIN_S
    check_links_again(client, server, baseline)


# ------------------------------------------------------------------------------------------------
# Library bugs found by these tests: each docstring says what was found and why it happened
# ------------------------------------------------------------------------------------------------

def delay_unlink_drops(state, seconds: float) -> None:
    """Fault injection: a connection thread that drops a peer first sleeps ``seconds`` (as a
    thread descheduled at that point on a busy machine would)."""
    links = state.dd.engine.links
    drop = links._drop_peer

    def slow_drop(*args, **kwargs) -> None:
        if threading.current_thread().name == "llm_datadist-conn":
            time.sleep(seconds)
        drop(*args, **kwargs)

    links._drop_peer = slow_drop


@pytest.mark.parametrize("plane", PLANES)
def test_relink_right_after_unlink_is_not_torn_down(plane):
    """Link, unlink (non-forced), link again at once: the new link works, also when the server's
    thread that handled the unlink runs late (a 300 ms delay injected before it drops the peer).

    Found (commit 262b779): the server answered OP_UNLINK *before* it dropped the peer, and
    dropped it by cluster id (LinkManager._handle: ``self._reply(fd, OP_UNLINK_DONE, ...)`` then
    ``self._drop_peer(peer_id)``). A client linking again at once got its new link registered
    in between; the old connection's thread then dropped the *new* link: the client's reverse
    connection was refused ("no pending link for this reverse connection", LLM_LINK_FAILED) or,
    as here, the link it had just been given died under it. Without the injected delay this
    happened in up to about 1 of 100 back-to-back rounds on a 2-core machine."""
    with ExitStack() as stack:
        server, client = start_clusters(stack, server_spec(plane), client_spec(plane))
        server.call(register_cache, "tiny", 0, TINY_BLOCKS, TINY_BLOCK, SERVER_SEED)
        client.call(register_cache, "tiny", 0, TINY_BLOCKS, TINY_BLOCK, CLIENT_SEED)
        server.call(delay_unlink_drops, 0.3)
        assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert client.call(unlink, SERVER_ID, *server.address) == S.LLM_SUCCESS
        assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        time.sleep(0.6)
        assert server.call(linked) == [CLIENT_ID]
        assert client.call(transfer, "push", SERVER_ID, "tiny", [1], [9]) == 0
        assert server.call(blocks_hold, "tiny", CLIENT_SEED, [9], [1])
        assert server.call(transfer, "push", CLIENT_ID, "tiny", [2], [10]) == 0
        assert client.call(blocks_hold, "tiny", SERVER_SEED, [10], [2])


def take_thread_exceptions(state) -> List[str]:
    """The exceptions recorded so far (see record_thread_exceptions), forgetting them."""
    errors = state.scratch.setdefault("thread_exceptions", [])
    taken = list(errors)
    errors.clear()
    return taken


@pytest.fixture(scope="module")
def bare_server():
    """A listening server (data plane ``auto``) that records exceptions escaping its threads,
    and a client to check that it still links."""
    with ExitStack() as stack:
        server, client = start_clusters(stack, server_spec(None), client_spec(None))
        server.call(record_thread_exceptions)
        yield server, client


def close_politely(server: Cluster) -> None:
    """A connection the server closes itself (bad magic): afterwards no earlier connection is
    held by the server's accept loop."""
    with closing(raw_connect(server.address)) as sock:
        sock.sendall(MALFORMED["bad magic"])
        read_until_closed(sock)


@pytest.mark.parametrize("case", list(TRUNCATED))
def test_connection_cut_mid_frame_is_closed_by_the_server(bare_server, case):
    """A connection that ends before its hello is whole is closed by the server at once: the
    server's descriptor count is back where it was.

    Found (commit 262b779): LinkManager._serve_accepted returns without closing the socket when
    the first frame cannot be read whole (``if st != 0: return``), leaving it to the garbage
    collector; the accept loop's local ``conn`` still references the last accepted socket, so
    that one stays open (CLOSE_WAIT) until the next connection arrives -- and a peer that stays
    silent past the handshake timeout is not disconnected until then either."""
    server, _ = bare_server
    close_politely(server)
    baseline = server.call(quiet_resources)  # the previous case's connection thread may still be ending
    with closing(raw_connect(server.address)) as sock:
        if TRUNCATED[case]:
            sock.sendall(TRUNCATED[case])
    now = server.call(settle, baseline, 1.5)
    assert now["threads"] == baseline["threads"]
    assert now["fds"] == baseline["fds"], f"{now['fds'] - baseline['fds']} descriptor(s) still open"


def test_malformed_first_frames_are_counted(bare_server):
    """design.md section 6: "A malformed or oversized frame closes that connection, is logged and
    counted". Each malformed first frame adds one to the engine's protocol_errors.

    Found (commit 262b779): LinkManager._serve_accepted catches the ProtocolError of a bad
    first frame, logs and closes, but never calls engine.count_protocol_error() (only _serve
    does)."""
    server, _ = bare_server
    errors = server.call(protocol_errors)
    for case, data in MALFORMED.items():
        with closing(raw_connect(server.address)) as sock:
            sock.sendall(data)
            assert read_until_closed(sock) == answer_to(case)
    assert server.call(protocol_errors) - errors == len(MALFORMED)


def _hello(**changes) -> bytes:
    hello = {"purpose": "link", "cluster_id": RAW_ID, "role": "DECODER", "pid": 1, "host": host_identity(),
             "planes": ["cma", "tcp"], "remote_cache_accessible": True, "probe": [0, 0], "generation_addr": 0,
             "generation_fd": -1, "force_link": True,
             "table": {"generation": 1, "caches": [], "blocks": [], "keys": []}}
    hello.update(changes)
    return frame(wire.OP_HELLO, json.dumps(hello).encode())


#: Hellos with every field present but of the wrong type.
MISTYPED_HELLOS = {
    "host is a string": _hello(host="another host"),
    "probe is a string": _hello(probe="ab"),
    "probe has one item": _hello(probe=[1]),
    "probe is null": _hello(probe=None),
    "planes is a number": _hello(planes=5),
    "generation_addr is a string": _hello(generation_addr="abc", host={}),
    "generation_addr is null": _hello(generation_addr=None, host={}),
}


@pytest.mark.parametrize("case", list(MISTYPED_HELLOS))
def test_mistyped_hello_fails_with_a_status(bare_server, case):
    """design.md section 6: a bad handshake "fails the link with a status, not an exception in a
    thread". A hello whose fields have the wrong types gets a refusing HELLO_REPLY or a closed
    connection, promptly; no exception escapes a server thread; the server keeps serving.

    Found (commit 262b779): LinkManager._accept_hello / _choose_plane use hello fields
    unchecked (``same_host(..., hello["host"])``, ``addr, value = hello["probe"]``, ``"cma" in
    hello["planes"]``, ``int(hello["generation_addr"])``); the exception kills the connection
    thread (printed by threading.excepthook, not counted) and the socket is left open, so the
    peer waits for its own timeout."""
    server, client = bare_server
    assert server.call(take_thread_exceptions) == []
    with closing(raw_connect(server.address)) as sock:
        sock.sendall(MISTYPED_HELLOS[case])
        try:
            answer = read_until_closed(sock, 1.5)
        except TimeoutError as exc:
            answer, kept_open = None, str(exc)
    escaped = server.call(take_thread_exceptions)
    assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert client.call(unlink, SERVER_ID, *server.address) == S.LLM_SUCCESS
    assert escaped == [], f"exceptions escaped server threads: {escaped}"
    assert answer is not None, kept_open
    if answer:
        op, status, _, _ = wire.unpack_header(answer[:wire.HEADER_BYTES])
        assert op == wire.OP_HELLO_REPLY and status != 0


def _reply_without_token(hello: dict) -> dict:
    return {"cluster_id": SERVER_ID, "purpose": "link-reply", "role": "PROMPT", "pid": 1, "host": {},
            "probe": [0, 0], "generation_addr": 0, "remote_cache_accessible": True, "planes": ["tcp"],
            "table": {"generation": 1, "caches": [], "blocks": [], "keys": []}}


def _reply_with_bad_generation_addr(hello: dict) -> dict:
    if hello.get("purpose") == "reverse":
        return {"cluster_id": SERVER_ID}
    return dict(_reply_without_token(hello), token=1, generation_addr="abc")


def _reply_with_bad_host(hello: dict) -> dict:
    return dict(_reply_without_token(hello), token=1, host="another host", planes=["cma", "tcp"])


#: Hello replies a foreign or broken server might send, and the plane the client is forced to.
BAD_HELLO_REPLIES = {
    "no token": (_reply_without_token, "tcp"),
    "generation_addr is a string": (_reply_with_bad_generation_addr, "tcp"),
    "host is a string": (_reply_with_bad_host, None),
}


@pytest.mark.parametrize("case", list(BAD_HELLO_REPLIES))
def test_link_to_a_server_with_a_malformed_hello_reply_returns_link_failed(case):
    """Spec section 7: link_clusters "does not raise on link failure". A listener whose hello reply
    has the right header and status 0 but a field missing or of the wrong type: link_clusters
    returns LLM_LINK_FAILED and leaves no descriptor behind.

    Found (commit 262b779): LinkManager.link reads reply fields outside its try block or
    unchecked -- ``reply["token"]`` (KeyError), ``int(reply["generation_addr"])`` when building
    the Peer (ValueError; the forward and reverse sockets are then leaked), ``same_host(...,
    reply["host"])`` in _choose_plane (AttributeError) -- so the exception propagates out of
    link_clusters."""
    reply, plane = BAD_HELLO_REPLIES[case]
    with Cluster(CLIENT_ID, plane=plane, options=OPTIONS) as client:
        baseline = client.call(resources)
        listener = FakeListener("crafted reply", reply)
        try:
            outcome = client.call(timed_link, SERVER_ID, "127.0.0.1", listener.port, LINK_TIMEOUT_MS)
        except ChildError as exc:
            pytest.fail(f"link_clusters raised {exc.kind}: {exc.message}")
        finally:
            listener.close()
        assert (outcome["status"], outcome["rets"]) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
        assert client.call(linked) == []
        assert_threads_and_fds_back(client.call(settle, baseline), baseline, "client")


def accepted(state, count: int, timeout: float = 10.0) -> int:
    """Wait until the listener holds ``count`` accepted connections in their handshake (or the
    timeout passes); how many it holds."""
    deadline = time.monotonic() + timeout
    while len(state.dd.engine.links.listener.pending()) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(state.dd.engine.links.listener.pending())


def timed_finalize(state) -> Dict[str, object]:
    """Finalize this cluster: how long it took and which llm_datadist threads outlived it."""
    started = time.monotonic()
    state.dd.finalize()
    seconds = time.monotonic() - started
    left = [t.name for t in threading.enumerate() if t.name.startswith("llm_datadist")]
    return {"seconds": seconds, "threads_left": left}


def test_finalize_does_not_wait_for_silent_connections():
    """design.md section 8: background threads are "stopped and joined by finalize()". With three
    raw connections that never finish their hello, finalize returns promptly (under 1.5 s) and
    no llm_datadist thread outlives it.

    Found (commit 262b779): LinkManager.close() shuts down the sockets of linked peers only; a
    connection still in its handshake is not tracked (``self._incoming`` is declared and never
    used), so close() joins each such thread for its full 2 s timeout and leaves it blocked in
    recv for up to the 10 s handshake timeout after finalize has returned."""
    with ExitStack() as stack:
        (server,) = start_clusters(stack, server_spec("tcp"))
        silent = [stack.enter_context(closing(raw_connect(server.address))) for _ in range(3)]
        silent[0].sendall(frame(wire.OP_HELLO, GOOD_HELLO_BODY)[:wire.HEADER_BYTES // 2])
        assert server.call(accepted, 3) == 3  # the server holds them, in their handshake
        outcome = server.call(timed_finalize)
        assert outcome["threads_left"] == [] and outcome["seconds"] < 1.5, outcome


def unregister_in_background(state, name: str) -> None:
    """Start unregistering cache ``name`` on a thread; ``unregister_took`` tells when it returned."""
    state.unregistered = []

    def run() -> None:
        started = time.monotonic()
        state.cm.unregister_cache(state.caches[name].cache_id)
        state.unregistered.append(time.monotonic() - started)

    threading.Thread(target=run, daemon=True).start()


def unregister_took(state) -> Optional[float]:
    return state.unregistered[0] if state.unregistered else None


def test_unregister_waits_for_a_push_in_flight_into_that_cache(tcp_server_with_client):
    """While a peer's push into ``scratch`` is half way through its payload, unregistering
    ``scratch`` does not return (the memory is still being written); once the payload is in,
    the push succeeds byte-exactly and the unregister returns."""
    server, client = tcp_server_with_client
    peer = RawPeer(server.address)
    try:
        addrs, _ = peer.cache(2)
        data = bytes(range(256)) * (2 * SMALL_BLOCK // 256)
        head = push_frame([(0, addrs[0], 2 * SMALL_BLOCK)], b"", peer.generation,
                          length=push_length(24, 2 * SMALL_BLOCK))
        peer.send(head + data[:SMALL_BLOCK])
        time.sleep(0.2)
        server.call(unregister_in_background, "scratch")
        time.sleep(0.5)
        assert server.call(unregister_took) is None, "unregister returned while a push was writing into the cache"
        peer.send(data[SMALL_BLOCK:])
        op, status, _, _ = read_frame(peer.sock)
        assert (op, status) == (wire.OP_PUSH_DONE, 0)
        deadline = time.monotonic() + 5
        while server.call(unregister_took) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.call(unregister_took) is not None
        assert server.call(read_bytes, "scratch", 0, 0, 2 * SMALL_BLOCK) == data
    finally:
        peer.close()
    check_still_serving(server, client)


def test_stalled_push_does_not_block_unregistering_another_cache(tcp_server_with_client):
    """A peer that stops half way through a push into one cache (``scratch``) does not block the
    owner from unregistering another cache (``guarded``): unregister returns within 1 s.

    Found (commit 8a65b61): every TCP receive holds ``Engine.pinned()`` -- one pin count for
    all shared memory -- until the frame's payload is in, and unregister / deallocate /
    remove_key wait for the count to reach zero (``_wait_unpinned``, up to 60 s). A peer that
    stalls mid-payload therefore blocks every registry removal on the owner, for any cache,
    until FRAME_TIMEOUT_MS (30 s) ends the frame; peers pushing back to back can keep the count
    above zero for the whole 60 s, after which the removal proceeds while pinned anyway."""
    server, client = tcp_server_with_client
    peer = RawPeer(server.address)
    try:
        stall_a_push(peer)
        took = server.call(timed_unregister, "guarded", 1.0)
    finally:
        peer.close()
    assert took is not None, "unregistering an unrelated cache waited for the stalled push"
    check_still_serving(server, client)


def stall_a_push(peer: RawPeer) -> None:
    """The raw peer starts a push of two blocks into the server's first cache, sends half of the
    payload, then nothing (the server's receive now holds its pin)."""
    addrs, _ = peer.cache(2)
    head = push_frame([(0, addrs[0], 2 * SMALL_BLOCK)], b"", peer.generation,
                      length=push_length(24, 2 * SMALL_BLOCK))
    peer.send(head + b"\x77" * SMALL_BLOCK)  # half of the payload, then nothing
    time.sleep(0.2)


def shorten_transfer_deadlines(state, seconds: float) -> None:
    """Fault injection: the server's pushes and pulls get a deadline of ``seconds`` for their pin
    (``server._pin_terms``) while their receives keep the 30 s frame timeout -- a stalled
    transfer then outlives its own deadline unless unregistering cancels it."""
    from llm_datadist.transport import server as _server
    terms = _server._pin_terms

    def shorter(fd: int):
        _, cancel = terms(fd)
        return time.monotonic() + seconds, cancel

    _server._pin_terms = shorter


def test_unregister_behind_a_stalled_push_waits_at_most_its_deadline_and_fails_it(tcp_server_with_client):
    """A peer stops half way through a push into ``scratch``; unregistering ``scratch`` returns
    soon after the push's deadline (1 s here, see ``shorten_transfer_deadlines``), not when the
    receive would have given up by itself (30 s), nor when the raw peer's link is dropped for
    never answering the server's table request (about 5 s after linking): the push is failed first (its connection is
    shut down, the peer sees it closed, the rest of its bytes never land) and the server goes on
    serving its other link."""
    server, client = tcp_server_with_client
    server.call(shorten_transfer_deadlines, 1.0)
    peer = RawPeer(server.address)
    try:
        stall_a_push(peer)
        took = server.call(timed_unregister, "scratch", 8.0)
        assert took is not None and 0.5 < took < 2.5, took
        peer.sock.settimeout(5)
        try:
            closed = peer.sock.recv(1) == b""
        except ConnectionError:
            closed = True
        assert closed, "the stalled push's connection was not shut down"
    finally:
        peer.close()
    check_still_serving(server, client)
