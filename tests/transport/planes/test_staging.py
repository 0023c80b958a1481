"""The ``staging`` plane and its staged payloads (``transport.staging``).

First, ``send_staged`` / ``recv_staged`` over a socket pair against a model of an asynchronous
device runtime: copies queued with ``execute(..., wait=False)`` happen only at
``runtime.synchronize()``, so a payload that reads a bounce buffer before waiting for its copy,
or that reuses a buffer under a queued copy, sends or writes wrong bytes. The model's
``stage_plan`` is the contract's, written out in Python.

Then end to end (``test_e2e_*``): two cluster processes whose DEVICE runtime is the stub library
posing as cuda (its device memory is real host memory that the cuda binding reports as not
host-addressable, so every byte must go through the runtime's copies), DEVICE caches on both
sides and on one side, every transfer of the API, chunk boundaries, guard bytes, forged plans.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest
import rawpeer

import llm_datadist as ld
from llm_datadist import _core, _io
from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.testing import ChildError, Cluster
from llm_datadist.transport import staging, wire
from llm_datadist.transport.errors import CopyFailed
from llm_datadist.transport.planes.staging import StagingPlane

CHUNK = 4096
D2H, H2D = _core.MEMCPY_DEVICE_TO_HOST, _core.MEMCPY_HOST_TO_DEVICE


# ------------------------------------------------------------------------------------------------
# A model of an asynchronous runtime and of the core's staging calls
# ------------------------------------------------------------------------------------------------

def plan_of(descs) -> Any:
    return _io.plan_from_wire(np.array(list(descs), dtype="<u8").reshape(-1, 3).tobytes())


def model_stage_plan(plan, start: int, nbytes: int, bounce: int, to_bounce: bool):
    """The contract's ``stage_plan``: the part of ``plan`` covering bytes [start, start + nbytes)
    of its stream, one side replaced by the contiguous bounce buffer."""
    out, pos = [], 0
    for src, dst, n in plan.descriptors().tolist():
        lo, hi = max(start, pos), min(start + nbytes, pos + n)
        if lo < hi:
            off, at = lo - pos, bounce + lo - start
            out.append((src + off, at, hi - lo) if to_bounce else (at, dst + off, hi - lo))
        pos += n
    return plan_of(out)


class Buffer:
    """A host buffer standing for a pinned allocation."""

    def __init__(self, nbytes: int) -> None:
        self.array = np.zeros(nbytes, dtype=np.uint8)
        self.addr = self.array.ctypes.data
        self.nbytes = nbytes
        self.pinned = True


class AsyncRuntime:
    """Copies are queued by ``execute(wait=False)`` and done at ``synchronize``; the n-th call
    (1-based) of ``execute`` or ``synchronize`` can be made to fail. One queue for every thread,
    as the device's one stream of the cuda binding: a synchronize waits for every queued copy."""

    def __init__(self, fail_execute: Optional[int] = None, fail_sync: Optional[int] = None) -> None:
        self.lock = threading.RLock()
        self.queued: List[Any] = []
        self.log: List[Tuple[str, int]] = []
        self.executes = self.syncs = 0
        self.fail_execute, self.fail_sync = fail_execute, fail_sync
        self.allocations: List[Buffer] = []

    def execute(self, plan, kind: int, wait: bool) -> None:
        with self.lock:
            self.executes += 1
            if self.executes == self.fail_execute:
                raise LLMException("model: copy refused", status_code=LLMStatusCode.LLM_FAILED)
            self.log.append(("d2h" if kind == D2H else "h2d", plan.total_bytes))
            self.queued.append(plan)
        if wait:
            self.synchronize()

    def synchronize(self) -> None:
        with self.lock:
            self.syncs += 1
            if self.syncs == self.fail_sync:
                self.queued.clear()  # the queued copies are lost
                raise LLMException("model: synchronize failed", status_code=LLMStatusCode.LLM_FAILED)
            self.log.append(("sync", len(self.queued)))
            for plan in self.queued:
                _core.memcpy_baseline(plan)
            self.queued.clear()


@pytest.fixture
def model(monkeypatch):
    """``staging``'s core and socket calls go to the model; socket sends/receives are logged."""
    runtime = AsyncRuntime()

    def allocation(rt, nbytes, on_device=False, pinned=True):
        assert rt is runtime and not on_device and pinned
        buffer = Buffer(nbytes)
        runtime.allocations.append(buffer)
        return buffer

    core = SimpleNamespace(MEMCPY_DEVICE_TO_HOST=D2H, MEMCPY_HOST_TO_DEVICE=H2D, Allocation=allocation,
                           stage_plan=model_stage_plan,
                           execute=lambda plan, rt, kind, wait=True: rt.execute(plan, kind, wait))

    def send_plan(fd, head, plan, from_dst=False, timeout_ms=-1):
        runtime.log.append(("send", plan.total_bytes))
        return _io.send_plan(fd, head, plan, from_dst, timeout_ms)

    def recv_plan(fd, plan, into_src=False, timeout_ms=-1):
        runtime.log.append(("recv", plan.total_bytes))
        return _io.recv_plan(fd, plan, into_src, timeout_ms)

    planes = SimpleNamespace(send_plan=send_plan, recv_plan=recv_plan, send_bytes=_io.send_bytes,
                             recv_discard=_io.recv_discard, plan_from_wire=_io.plan_from_wire)
    monkeypatch.setattr(staging, "_core", core)
    monkeypatch.setattr(staging, "_io", planes)
    return runtime


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    for s in (a, b):
        s.setblocking(False)
    yield a, b
    a.close()
    b.close()


def _recv_all(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    st, _, got = _io.recv_into(sock.fileno(), buf, 5000)
    assert st == 0 and got == n
    return bytes(buf)


def _pending(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1 << 20)
    except BlockingIOError:
        return b""


class Scatter:
    """A source and a destination array (with guard bytes around every destination range) and
    the plan pieces of ``sizes`` between them: a plan's stream crosses chunk boundaries at odd
    places."""

    def __init__(self, sizes: List[int], gap: int = 64) -> None:
        total = sum(sizes)
        self.src = np.frombuffer(np.random.default_rng(len(sizes) + total).bytes(total + gap * len(sizes)),
                                 dtype=np.uint8).copy()
        self.dst = np.full(total + gap * (len(sizes) + 1), 0xEE, dtype=np.uint8)
        self.descs, self.expected, pieces = [], self.dst.copy(), []
        s_off, d_off = 0, gap
        for n in sizes:
            self.descs.append((self.src.ctypes.data + s_off, self.dst.ctypes.data + d_off, n))
            self.expected[d_off:d_off + n] = self.src[s_off:s_off + n]
            pieces.append(self.src[s_off:s_off + n].tobytes())
            s_off, d_off = s_off + n + gap, d_off + n + gap
        self.plan = plan_of(self.descs)
        #: The plan's byte stream (its source ranges in order), as a frame's payload carries it.
        self.stream = b"".join(pieces)


def _send_in_thread(fd, head, plan, runtime, pool):
    result = {}

    def run():
        try:
            result["value"] = staging.send_staged(fd, head, plan, runtime, pool, 5000)
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            result["error"] = exc
    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


SIZES = {"one byte": [1], "under a chunk": [100, 200, 3000], "exactly one chunk": [CHUNK],
         "crossing chunks": [5000, 1, 4095, 4097, 10000, 7], "many small": [16] * 700}


@pytest.mark.parametrize("sizes", list(SIZES.values()), ids=list(SIZES))
def test_a_staged_payload_arrives_whole_through_two_bounce_buffers(model, pair, sizes):
    a, b = pair
    data = Scatter(sizes)
    pool = staging.BouncePool(model, chunk_bytes=CHUNK)
    thread, result = _send_in_thread(a.fileno(), b"HEAD", data.plan, model, pool)
    assert _recv_all(b, 4) == b"HEAD"
    assert staging.recv_staged(b.fileno(), data.plan, model, pool, 5000) == (0, 0, data.plan.total_bytes)
    thread.join(10)
    assert result == {"value": (0, 0)}
    assert (data.dst == data.expected).all()  # every byte, guards around every range untouched
    # Two buffers per side at most (the receiver reuses the sender's if it is done), all kept.
    assert model.queued == [] and pool.idle() == len(model.allocations) in (2, 4)
    chunks = -(-data.plan.total_bytes // CHUNK)
    assert [e for e in model.log if e[0] == "send"] == [("send", min(CHUNK, data.plan.total_bytes - k * CHUNK))
                                                        for k in range(chunks)]


def test_the_next_chunk_is_copied_while_this_one_is_sent(model, pair):
    a, b = pair
    data = Scatter([3 * CHUNK])
    pool = staging.BouncePool(model, chunk_bytes=CHUNK)
    thread, result = _send_in_thread(a.fileno(), b"", data.plan, model, pool)
    staging.recv_staged(b.fileno(), data.plan, model, pool, 5000)
    thread.join(10)
    sender = [e for e in model.log if e[0] in ("d2h", "send")]
    assert sender == [("d2h", CHUNK), ("d2h", CHUNK), ("send", CHUNK), ("d2h", CHUNK), ("send", CHUNK),
                      ("send", CHUNK)]
    receiver = [e for e in model.log if e[0] in ("h2d", "recv")]
    assert receiver == [("recv", CHUNK), ("h2d", CHUNK), ("recv", CHUNK), ("h2d", CHUNK), ("recv", CHUNK),
                        ("h2d", CHUNK)]
    assert (data.dst == data.expected).all()


def test_a_buffer_is_reused_only_after_its_copy(model, pair):
    """With a single buffer position reused every other chunk, a receive that did not wait for
    the queued copy out of it would lose chunk k-2 (the model copies only at synchronize)."""
    a, b = pair
    data = Scatter([CHUNK] * 5 + [17])
    pool = staging.BouncePool(model, chunk_bytes=CHUNK)
    sender = threading.Thread(target=lambda: (a.setblocking(True), a.sendall(data.stream)))  # no model calls
    sender.start()
    staging.recv_staged(b.fileno(), data.plan, model, pool, 5000)
    sender.join(10)
    assert (data.dst == data.expected).all()
    # The receiver never has more than one copy queued when a receive starts.
    depth = 0
    for what, _ in model.log:
        if what == "h2d":
            depth += 1
        elif what == "sync":
            depth = 0
        elif what == "recv":
            assert depth <= 1


def test_an_empty_plan_sends_only_the_head(model, pair):
    a, b = pair
    pool = staging.BouncePool(model, chunk_bytes=CHUNK)
    assert staging.send_staged(a.fileno(), b"HEAD", plan_of([]), model, pool, 1000) == (0, 0)
    assert _recv_all(b, 4) == b"HEAD"
    assert staging.recv_staged(b.fileno(), plan_of([]), model, pool, 1000) == (0, 0, 0)
    assert model.log == [] and model.allocations == []


@pytest.mark.parametrize("fail_execute, fail_sync, in_step", [
    (1, None, True),     # the first chunk's copy: nothing sent
    (2, None, True),     # the second chunk's copy, queued before the first send: still nothing sent
    (None, 1, True),     # waiting for the first chunk
    (3, None, False),    # the third chunk's copy, after the first chunk went out
    (None, 2, False),    # waiting for the second chunk, after the first went out
])
def test_a_failed_source_copy_says_whether_the_frame_started(model, pair, fail_execute, fail_sync, in_step):
    a, b = pair
    model.fail_execute, model.fail_sync = fail_execute, fail_sync
    data = Scatter([CHUNK * 3 + 5])
    pool = staging.BouncePool(model, chunk_bytes=CHUNK)
    with pytest.raises(CopyFailed) as raised:
        staging.send_staged(a.fileno(), b"HEAD", data.plan, model, pool, 2000)
    assert raised.value.in_step is in_step
    assert raised.value.cause.status_code == LLMStatusCode.LLM_FAILED
    sent = _pending(b)
    assert (sent == b"") is in_step
    assert model.queued == [] and pool.idle() == 2  # no copy left queued on a buffer given back


@pytest.mark.parametrize("fail_execute, fail_sync", [(1, None), (2, None), (4, None), (None, 1), (None, 3)])
def test_a_failed_destination_copy_drains_the_frame(model, pair, fail_execute, fail_sync):
    a, b = pair
    data = Scatter([CHUNK * 3 + 5])
    a.setblocking(True)
    a.sendall(data.stream + b"NEXT")
    model.fail_execute, model.fail_sync = fail_execute, fail_sync
    pool = staging.BouncePool(model, chunk_bytes=CHUNK)
    with pytest.raises(CopyFailed) as raised:
        staging.recv_staged(b.fileno(), data.plan, model, pool, 2000)
    assert raised.value.in_step
    assert _recv_all(b, 4) == b"NEXT"  # the connection is in step with the next frame
    # Nothing outside the plan's ranges was written.
    guards = data.expected == 0xEE
    assert (data.dst[guards] == 0xEE).all()
    assert model.queued == [] and pool.idle() == 2


def test_no_page_locked_memory_is_refused_in_step(model, pair, monkeypatch):
    a, b = pair

    def refuse(*args, **kwargs):
        raise LLMException("model: no page-locked memory", status_code=LLMStatusCode.LLM_OUT_OF_MEMORY)
    monkeypatch.setattr(staging._core, "Allocation", refuse)
    data = Scatter([CHUNK + 1])
    pool = staging.BouncePool(model, chunk_bytes=CHUNK)
    with pytest.raises(CopyFailed) as raised:
        staging.send_staged(a.fileno(), b"HEAD", data.plan, model, pool, 1000)
    assert raised.value.in_step and _pending(b) == b""
    a.setblocking(True)
    a.sendall(b"y" * data.plan.total_bytes + b"NEXT")
    with pytest.raises(CopyFailed) as raised:
        staging.recv_staged(b.fileno(), data.plan, model, pool, 1000)
    assert raised.value.in_step and _recv_all(b, 4) == b"NEXT"
    assert (data.dst == 0xEE).all()


def test_a_truncated_payload_is_a_socket_status(model, pair):
    a, b = pair
    data = Scatter([CHUNK * 2])
    a.setblocking(True)
    a.sendall(b"x" * (CHUNK + 10))
    a.shutdown(socket.SHUT_WR)
    pool = staging.BouncePool(model, chunk_bytes=CHUNK)
    st, _, got = staging.recv_staged(b.fileno(), data.plan, model, pool, 2000)
    assert st == LLMStatusCode.LLM_LINK_FAILED and got == CHUNK + 10
    assert model.queued == [] and pool.idle() == 2


def test_the_pool_keeps_few_idle_buffers_and_frees_them_at_close(model):
    pool = staging.BouncePool(model, chunk_bytes=CHUNK, keep=3)
    taken = pool.acquire(2) + pool.acquire(2)
    assert len({id(b) for b in taken}) == 4
    pool.release(taken)
    assert pool.idle() == 3
    again = pool.acquire(2)
    assert all(any(b is t for t in taken) for b in again)
    pool.close()
    assert pool.idle() == 0
    pool.release(again)
    assert pool.idle() == 0


def test_an_engine_has_one_pool_per_runtime_held_by_its_staging_plane(model):
    class Engine:
        runtime = model
    engine = Engine()
    plane = StagingPlane(engine)
    pool = plane.pool()
    assert plane.pool() is pool and pool.runtime is model
    assert plane.device_payload is plane.staged and plane.staged.pool() is pool  # the server's too
    pool.release(pool.acquire(2))
    assert pool.idle() == 2
    plane.shutdown()  # finalize: the idle buffers go
    assert pool.closed and pool.idle() == 0
    again = plane.pool()
    assert again is not pool and not again.closed
    engine.runtime = AsyncRuntime()
    assert plane.pool() is not again and plane.pool().runtime is engine.runtime


def test_the_model_stage_plan_cuts_the_stream():
    plan = plan_of([(100, 1000, 10), (200, 2000, 5), (300, 3000, 20)])
    assert model_stage_plan(plan, 8, 10, 9000, True).descriptors().tolist() == [
        [108, 9000, 2], [200, 9002, 5], [300, 9007, 3]]
    assert model_stage_plan(plan, 8, 10, 9000, False).descriptors().tolist() == [
        [9000, 1008, 2], [9002, 2000, 5], [9007, 3000, 3]]
    if hasattr(_core, "stage_plan"):  # the core's own, once it exists, agrees with the model
        for start, n in [(0, 35), (8, 10), (15, 1), (34, 1), (0, 1), (10, 20)]:
            for to_bounce in (True, False):
                assert (_core.stage_plan(plan, start, n, 9000, to_bounce).descriptors().tolist()
                        == model_stage_plan(plan, start, n, 9000, to_bounce).descriptors().tolist())


# ------------------------------------------------------------------------------------------------
# End to end: cluster processes on the stub runtime posing as cuda
# ------------------------------------------------------------------------------------------------

SERVER_ID, CLIENT_ID, RAW_ID = 131, 132, 133
MODEL_ID = 9
TENSORS, BLOCKS = 2, 8
BLOCK = (1 << 20) + 24      # blocks that cut 4 MiB chunks at odd places
ROWS, ROW = 4, 1000         # a small row cache
U8 = ld.DataType.DT_UINT8

needs_core = pytest.mark.skipif(not hasattr(_core, "stage_plan"),
                                reason="the core's staging API (stage_plan, execute(wait=False), pinned "
                                       "Allocation) is not in this build yet")


@pytest.fixture
def stub_path(stub_libraries) -> str:
    return str(stub_libraries["full"])


@pytest.fixture
def cuda_env(stub_path, monkeypatch) -> str:
    """Cluster processes started meanwhile run the stub library as their cuda runtime."""
    monkeypatch.setenv("LLM_DATADIST_DEVICE", "cuda")
    monkeypatch.setenv("LLM_DATADIST_CUDA_LIBRARY", stub_path)
    monkeypatch.setenv("LLM_DATADIST_CUDA_DRIVER_LIBRARY", stub_path)
    return stub_path


# -- in the cluster processes ----------------------------------------------------------------------

def c_allocate(state, name: str, placement: str, blocks: bool) -> Tuple[int, List[int], bool]:
    """A blocks cache (keyed by MODEL_ID) or a row cache; ``(cache_id, tensor addresses, whether
    the engine calls it device memory the host cannot address)``."""
    shape = [BLOCKS, BLOCK] if blocks else [ROWS, ROW]
    desc = ld.CacheDesc(TENSORS, shape, U8, getattr(ld.Placement, placement))
    if blocks:
        cache = state.cm.allocate_blocks_cache(desc, ld.BlocksCacheKey(state.cluster_id, MODEL_ID))
    else:
        cache = state.cm.allocate_cache(desc)
    state.caches[name] = cache
    engine = state.dd.engine
    return cache.cache_id, list(cache.tensor_addrs), engine.device_only(engine.lookup(cache.cache_id))


def _is_device(state, name: str) -> bool:
    engine = state.dd.engine
    return engine.device_only(engine.lookup(state.caches[name].cache_id))


def c_fill(state, name: str, seed: int) -> List[np.ndarray]:
    """Random bytes into every tensor, through the runtime's copies for device memory."""
    cache, engine = state.caches[name], state.dd.engine
    rng = np.random.default_rng(seed)
    out = []
    for addr in cache.tensor_addrs:
        data = np.frombuffer(rng.bytes(engine.lookup(cache.cache_id).tensor_bytes), dtype=np.uint8).copy()
        if _is_device(state, name):
            engine.runtime.memcpy(addr, data.ctypes.data, data.nbytes, _core.MEMCPY_HOST_TO_DEVICE)
        else:
            _core.HostRegion(addr, data.nbytes).as_array(np.uint8, (data.nbytes,))[...] = data
        out.append(data)
    return out


def c_read(state, name: str) -> List[np.ndarray]:
    cache, engine = state.caches[name], state.dd.engine
    nbytes = engine.lookup(cache.cache_id).tensor_bytes
    out = []
    for addr in cache.tensor_addrs:
        data = np.empty(nbytes, dtype=np.uint8)
        if _is_device(state, name):
            engine.runtime.memcpy(data.ctypes.data, addr, nbytes, _core.MEMCPY_DEVICE_TO_HOST)
        else:
            data[...] = _core.HostRegion(addr, nbytes).as_array(np.uint8, (nbytes,))
        out.append(data)
    return out


def c_op(state, method: str, key, name: str, *args, **kwargs) -> None:
    getattr(state.cm, method)(key, state.caches[name], *args, **kwargs)


def c_link(state, server_id: int, ip: str, port: int) -> int:
    info = ld.LLMClusterInfo()
    info.remote_cluster_id = server_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info(ip, port)
    _, rets = state.dd.link_clusters([info], 5000)
    return int(rets[0])


def c_spy(state) -> None:
    """Record what every plane of this cluster is handed: ``(plane, device plan?)`` per call."""
    state.scratch["seen"] = seen = []
    for plane in state.dd.engine.links.planes.values():
        def host(session, table, plan, write, deadline, _p=plane, _f=plane.transfer):
            seen.append((_p.name, "host"))
            return _f(session, table, plan, write, deadline)

        def device(session, table, plan, write, deadline, local_device, remote_device, _p=plane,
                   _f=plane.transfer_device):
            seen.append((_p.name, "device"))
            return _f(session, table, plan, write, deadline, local_device, remote_device)
        plane.transfer, plane.transfer_device = host, device


def c_seen(state) -> List[Tuple[str, str]]:
    return list(state.scratch.get("seen", []))


def c_planes(state, remote_id: int) -> Dict[str, Any]:
    links = state.dd.engine.links
    return {"link": links.data_plane(remote_id),
            "device": {f"{a}{b}": links.data_plane(remote_id, local_device=a, remote_device=b)
                       for a, b in [(True, True), (True, False), (False, True)]},
            "device_memory": {name: plane.device_memory for name, plane in links.planes.items()}}


def _stub(path: str):
    from runtime_stub import StubRuntime  # tests/ is on the path of the cluster processes too
    return StubRuntime(Path(path))


def c_stub_reset(state, path: str) -> None:
    _stub(path).reset_log()


def c_stub_calls(state, path: str) -> List[Tuple[str, int, int, int, int]]:
    """``(function, kind, size, dst, src)`` of every call the stub recorded in this process."""
    return [(c.fn, c.kind, c.size, c.dst, c.src) for c in _stub(path).calls()]


def c_stub_fail(state, path: str, fn: str, code: int, skip: int = 0) -> None:
    _stub(path).fail(fn, code, skip)


def c_linked(state) -> List[int]:
    return state.dd.engine.links.linked_clusters()


# -- in the test process ---------------------------------------------------------------------------

@contextlib.contextmanager
def _pair(client_place: str, server_place: str, plane: Optional[str] = "staging"):
    """A server and a client (linked), each with a blocks cache and a row cache in the given
    placements: ``(client, server, {name: (cache_id, addrs, device?)})``."""
    with contextlib.ExitStack() as stack:
        options = {"llm.MemPoolConfig": '{"memory_size": 104857600}',
                   "llm.HostMemPoolConfig": '{"memory_size": 104857600}'}
        server = stack.enter_context(Cluster(SERVER_ID, "PROMPT", listen=True, plane=plane, options=options,
                                             timeout=60))
        client = stack.enter_context(Cluster(CLIENT_ID, "DECODER", plane=plane, options=options, timeout=60))
        caches = {}
        for side, cluster, place in (("c", client, client_place), ("s", server, server_place)):
            caches[f"{side}_blocks"] = cluster.call(c_allocate, "blocks", place, True)
            caches[f"{side}_rows"] = cluster.call(c_allocate, "rows", place, False)
        assert client.call(c_link, SERVER_ID, *server.address) == LLMStatusCode.LLM_SUCCESS
        yield client, server, caches


def _blocks(arrays: List[np.ndarray]) -> List[np.ndarray]:
    return [a.reshape(BLOCKS, BLOCK) for a in arrays]


def push_and_pull_blocks(client, server, stub: str, seed: int):
    """Fill both blocks caches, push blocks 1, 2, 3 to the server's 4, 6, 0 and pull its 7, 5 into
    0, 1; check every byte of both caches (the moved blocks and the untouched others). Returns
    the stub's log of each side for the transfers: ``(client's, server's)``."""
    c_blocks = _blocks(client.call(c_fill, "blocks", seed))
    s_blocks = _blocks(server.call(c_fill, "blocks", seed + 1))
    for cluster in (client, server):
        cluster.call(c_stub_reset, stub)
    key = ld.BlocksCacheKey(SERVER_ID, MODEL_ID)
    client.call(c_op, "push_blocks", key, "blocks", [1, 2, 3], [4, 6, 0])
    for t in range(TENSORS):
        s_blocks[t][[4, 6, 0]] = c_blocks[t][[1, 2, 3]]
    client.call(c_op, "pull_blocks", key, "blocks", [7, 5], [0, 1])
    for t in range(TENSORS):
        c_blocks[t][[0, 1]] = s_blocks[t][[7, 5]]
    logs = client.call(c_stub_calls, stub), server.call(c_stub_calls, stub)
    for got, want in zip(_blocks(client.call(c_read, "blocks")) + _blocks(server.call(c_read, "blocks")),
                         c_blocks + s_blocks):
        assert np.array_equal(got, want)
    return logs


PLACES = [("DEVICE", "DEVICE"), ("DEVICE", "HOST"), ("HOST", "DEVICE")]


@needs_core
@pytest.mark.parametrize("client_place, server_place", PLACES, ids=[f"{a}-{b}".lower() for a, b in PLACES])
def test_e2e_device_caches_move_through_staging(cuda_env, client_place, server_place):
    with _pair(client_place, server_place) as (client, server, caches):
        assert caches["c_blocks"][2] == (client_place == "DEVICE")
        assert caches["s_blocks"][2] == (server_place == "DEVICE")
        client.call(c_spy)
        c_blocks = _blocks(client.call(c_fill, "blocks", 1))
        s_blocks = _blocks(server.call(c_fill, "blocks", 2))
        key = ld.BlocksCacheKey(SERVER_ID, MODEL_ID)

        # A push of 3 blocks of 2 tensors (6 MiB: crosses a 4 MiB chunk, one connection).
        client.call(c_op, "push_blocks", key, "blocks", [1, 2, 3], [4, 6, 0])
        for t in range(TENSORS):
            s_blocks[t][[4, 6, 0]] = c_blocks[t][[1, 2, 3]]
        # A pull of 5 blocks (10 MiB: split over the link's two connections).
        client.call(c_op, "pull_blocks", key, "blocks", [7, 6, 5, 4, 3], [0, 1, 2, 3, 4])
        for t in range(TENSORS):
            c_blocks[t][[0, 1, 2, 3, 4]] = s_blocks[t][[7, 6, 5, 4, 3]]
        # Every byte of both caches: the blocks written, and the others (guards) untouched.
        for got, want in zip(_blocks(client.call(c_read, "blocks")) + _blocks(server.call(c_read, "blocks")),
                             c_blocks + s_blocks):
            assert (got == want).all()

        # Rows: push_cache and pull_cache (small transfers, under one chunk).
        c_rows = [a.reshape(ROWS, ROW) for a in client.call(c_fill, "rows", 3)]
        s_rows = [a.reshape(ROWS, ROW) for a in server.call(c_fill, "rows", 4)]
        rows_id = caches["s_rows"][0]
        client.call(c_op, "push_cache", ld.CacheKeyByIdAndIndex(SERVER_ID, rows_id, 2), "rows", 1)
        client.call(c_op, "pull_cache", ld.CacheKeyByIdAndIndex(SERVER_ID, rows_id, 3), "rows", 0)
        for t in range(TENSORS):
            s_rows[t][2] = c_rows[t][1]
            c_rows[t][0] = s_rows[t][3]
        for got, want in zip([a.reshape(ROWS, ROW) for a in client.call(c_read, "rows") + server.call(c_read, "rows")],
                             c_rows + s_rows):
            assert (got == want).all()

        # Every transfer went to the staging plane as a device transfer; no host plane saw one.
        assert set(client.call(c_seen)) == {("staging", "device")}


@needs_core
def test_e2e_under_auto_device_transfers_never_reach_a_host_plane(cuda_env):
    with _pair("DEVICE", "DEVICE", plane=None) as (client, server, caches):
        planes = client.call(c_planes, SERVER_ID)
        assert not planes["device_memory"][planes["link"]]  # cma or tcp carries host memory
        assert all(planes["device_memory"][p] for p in planes["device"].values())
        client.call(c_spy)
        c_blocks = _blocks(client.call(c_fill, "blocks", 5))
        s_blocks = _blocks(server.call(c_fill, "blocks", 6))
        key = ld.BlocksCacheKey(SERVER_ID, MODEL_ID)
        client.call(c_op, "push_blocks", key, "blocks", [0], [1])
        client.call(c_op, "pull_blocks", key, "blocks", [2], [3])
        seen = client.call(c_seen)
        assert seen and all(kind == "device" and planes["device_memory"][name] for name, kind in seen)
        got_c, got_s = _blocks(client.call(c_read, "blocks")), _blocks(server.call(c_read, "blocks"))
        for t in range(TENSORS):
            assert (got_s[t][1] == c_blocks[t][0]).all() and (got_c[t][3] == s_blocks[t][2]).all()
            assert (got_s[t][[0, 2, 3, 4, 5, 6, 7]] == s_blocks[t][[0, 2, 3, 4, 5, 6, 7]]).all()


def _copies(calls) -> List[Tuple[int, int, int]]:
    """``(size, dst, src)`` of every device copy queued: one ``cudaMemcpyAsync`` each, or the
    copies of a ``cudaMemcpyBatchAsync`` (recorded one by one after it)."""
    return [(c[2], c[3], c[4]) for c in calls if c[0] in ("cudaMemcpyAsync", "(queued copy)")]


def _inside(addr: int, size: int, spans) -> bool:
    return any(start <= addr and addr + size <= start + n for start, n in spans)


@needs_core
def test_e2e_the_stub_log_shows_pinned_buffers_and_chunked_copies(cuda_env):
    with _pair("DEVICE", "DEVICE") as (client, server, caches):
        client.call(c_fill, "blocks", 7)
        for cluster in (client, server):
            cluster.call(c_stub_reset, cuda_env)
        client.call(c_op, "push_blocks", ld.BlocksCacheKey(SERVER_ID, MODEL_ID), "blocks", [1, 2, 3], [0, 1, 2])
        sent, received = client.call(c_stub_calls, cuda_env), server.call(c_stub_calls, cuda_env)
        total = 3 * TENSORS * BLOCK
        for log, cache, to_bounce in ((sent, caches["c_blocks"], True), (received, caches["s_blocks"], False)):
            # Page-locked bounce buffers of one chunk (the first use of the engine's pool) ...
            bounce = [(c[3], c[2]) for c in log if c[0] == "cudaMallocHost"]
            assert bounce and all(n == staging.STAGING_CHUNK_BYTES for _, n in bounce)
            # ... device -> bounce copies on the sender, bounce -> device on the owner, no more
            # than a chunk each, every byte once, waited for on the stream; nothing else copied.
            device = [(a, BLOCKS * BLOCK) for a in cache[1]]
            copies = _copies(log)
            assert sum(n for n, _, _ in copies) == total
            for n, dst, src in copies:
                host, dev = (dst, src) if to_bounce else (src, dst)
                assert n <= staging.STAGING_CHUNK_BYTES and _inside(host, n, bounce) and _inside(dev, n, device)
            assert "cudaStreamSynchronize" in [c[0] for c in log]
            assert "cudaMemcpy" not in [c[0] for c in log]
        # The bounce buffers stay for the next transfer.
        for cluster in (client, server):
            cluster.call(c_stub_reset, cuda_env)
        client.call(c_op, "push_blocks", ld.BlocksCacheKey(SERVER_ID, MODEL_ID), "blocks", [4], [5])
        for cluster in (client, server):
            log = cluster.call(c_stub_calls, cuda_env)
            assert _copies(log) and "cudaMallocHost" not in [c[0] for c in log]


@needs_core
def test_e2e_a_failed_device_copy_fails_the_transfer_not_the_link(cuda_env):
    with _pair("DEVICE", "DEVICE") as (client, server, caches):
        c_blocks = _blocks(client.call(c_fill, "blocks", 8))
        s_blocks = _blocks(server.call(c_fill, "blocks", 9))
        key = ld.BlocksCacheKey(SERVER_ID, MODEL_ID)
        # The owner's wait for its host -> device copies fails (the payload was read whole).
        server.call(c_stub_fail, cuda_env, "cudaStreamSynchronize", 1)
        with pytest.raises(ChildError) as raised:
            client.call(c_op, "push_blocks", key, "blocks", [0], [0])
        assert raised.value.status_code == LLMStatusCode.LLM_FAILED
        # The client's own device -> host copy fails before the frame starts.
        client.call(c_stub_fail, cuda_env, "cudaStreamSynchronize", 1)
        with pytest.raises(ChildError) as raised:
            client.call(c_op, "push_blocks", key, "blocks", [2], [2])
        assert raised.value.status_code == LLMStatusCode.LLM_FAILED
        assert client.call(c_linked) == [SERVER_ID]
        client.call(c_op, "push_blocks", key, "blocks", [1], [1])  # the link goes on
        got = _blocks(server.call(c_read, "blocks"))
        for t in range(TENSORS):
            assert (got[t][1] == c_blocks[t][1]).all()
            assert (got[t][2:] == s_blocks[t][2:]).all()


@needs_core
def test_e2e_a_device_copy_failing_mid_frame_ends_the_link(cuda_env):
    with _pair("DEVICE", "DEVICE") as (client, server, caches):
        client.call(c_fill, "blocks", 10)
        server.call(c_fill, "blocks", 11)
        # A pull of 3 blocks (2 chunks): the owner's second wait fails after the first chunk went.
        server.call(c_stub_fail, cuda_env, "cudaStreamSynchronize", 1, 1)
        with pytest.raises(ChildError) as raised:
            client.call(c_op, "pull_blocks", ld.BlocksCacheKey(SERVER_ID, MODEL_ID), "blocks", [1, 2, 3], [1, 2, 3])
        assert raised.value.status_code in (LLMStatusCode.LLM_LINK_FAILED, LLMStatusCode.LLM_TIMEOUT)
        assert client.call(c_linked) == []


# -- a raw peer against a server with device memory -------------------------------------------------

def _descs(*triples) -> bytes:
    return b"".join(wire.U64.pack(v) for t in triples for v in t)


def _raw_push(link, generation: int, triples, data: bytes) -> int:
    descs = _descs(*triples)
    req_id = link.request(wire.OP_PUSH, wire.U64x2.pack(generation, len(descs)) + descs + data)
    op, status, rid, payload = rawpeer.read_frame(link.sock, timeout=30)
    assert (op, rid, payload) == (wire.OP_PUSH_DONE, req_id, b"")
    return status


def _raw_pull(link, generation: int, triples) -> Tuple[int, bytes]:
    req_id = link.request(wire.OP_PULL, wire.U64x2.pack(generation, 0) + _descs(*triples))  # no tag
    op, status, rid, payload = rawpeer.read_frame(link.sock, timeout=30)
    assert (op, rid) == (wire.OP_PULL_DATA, req_id)
    return status, payload


@needs_core
def test_e2e_a_raw_peer_reaches_device_memory_only_inside_it(cuda_env):
    options = {"llm.MemPoolConfig": '{"memory_size": 104857600}',
               "llm.HostMemPoolConfig": '{"memory_size": 104857600}'}
    with Cluster(SERVER_ID, "PROMPT", listen=True, options=options, timeout=60) as server:
        _, dev_addrs, dev = server.call(c_allocate, "blocks", "DEVICE", True)
        _, host_addrs, host_dev = server.call(c_allocate, "rows", "HOST", False)
        assert dev and not host_dev
        before = server.call(c_fill, "blocks", 11)
        host_before = server.call(c_fill, "rows", 12)
        link = rawpeer.RawLink(server.address, RAW_ID)
        try:
            table = link.table()
            entries = {c[0]: c for c in table["caches"]}
            assert [e[7] for e in sorted(entries.values())] == [False, True]  # host_addressable per cache
            generation = table["generation"]
            tensor = BLOCKS * BLOCK
            top = dev_addrs[0] + tensor

            # Inside the device cache: staged in and out (crossing a chunk boundary).
            data = bytes(range(256)) * (5 << 12)  # 5 MiB
            assert _raw_push(link, generation, [(0, dev_addrs[1] + 100, len(data))], data) == 0
            status, payload = _raw_pull(link, generation, [(dev_addrs[1] + 100, 0, len(data))])
            assert status == 0 and payload == data
            expected = before[1].copy()
            expected[100:100 + len(data)] = np.frombuffer(data, dtype=np.uint8)

            # Forged: reaching past the end of a device tensor, or before it; mixing host and
            # device memory in one plan. Refused, nothing written, the link in step.
            refused = LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
            for triples in ([(0, top - 16, 32)], [(0, dev_addrs[0] - 8, 16)],
                            [(0, dev_addrs[0], 16), (0, host_addrs[0], 16)],
                            [(0, host_addrs[0], 16), (0, dev_addrs[0], 16)]):
                n = sum(t[2] for t in triples)
                assert _raw_push(link, generation, triples, b"\xAB" * n) == refused
                pulled = [(t[1], 0, t[2]) for t in triples]
                assert _raw_pull(link, generation, pulled) == (refused, b"")
            after = server.call(c_read, "blocks")
            assert (after[0] == before[0]).all() and (after[1] == expected).all()
            assert all((a == b).all() for a, b in zip(server.call(c_read, "rows"), host_before))
        finally:
            link.close()


def c_guard_blocks(state, name: str, allowed: Dict[str, List[int]]) -> None:
    """A read guard allowing each tag the listed blocks of every tensor of cache ``name``."""
    addrs = state.caches[name].tensor_addrs
    ranges = {tag.encode(): [(a + b * BLOCK, BLOCK) for a in addrs for b in blocks] for tag, blocks in allowed.items()}
    state.dd.engine.set_read_guard(lambda peer, tag: ranges.get(tag))


def c_pull_tagged(state, key, name: str, src: List[int], dst: List[int], tag: Optional[str]) -> str:
    try:
        if tag is None:
            state.cm.pull_blocks(key, state.caches[name], src, dst)
        else:
            with state.dd.engine.read_tag(tag):
                state.cm.pull_blocks(key, state.caches[name], src, dst)
    except ld.LLMException as exc:
        return exc.status_code.name
    return "ok"


@needs_core
@pytest.mark.parametrize("client_place", ["HOST", "DEVICE"])
def test_e2e_the_owners_read_guard_checks_staged_pulls(cuda_env, client_place):
    """Pulls from the owner's device memory (staged on its side) pass its read guard only with
    their tag and inside its ranges; a refused one writes nothing and the link stays."""
    with _pair(client_place, "DEVICE") as (client, server, caches):
        c_blocks = _blocks(client.call(c_fill, "blocks", 5))
        s_blocks = _blocks(server.call(c_fill, "blocks", 6))
        server.call(c_guard_blocks, "blocks", {"req.token": [3, 4, 5, 6, 7]})
        key = ld.BlocksCacheKey(SERVER_ID, MODEL_ID)
        for src, tag in [([3], None), ([3], "req.other"), ([2, 3], "req.token"), ([7, 0], "req.token")]:
            assert client.call(c_pull_tagged, key, "blocks", src, list(range(len(src))), tag) == \
                "LLM_KV_CACHE_NOT_EXIST", (src, tag)
        for got, want in zip(_blocks(client.call(c_read, "blocks")), c_blocks):
            assert (got == want).all(), "a refused pull wrote into the puller's cache"
        # Five blocks (10 MiB: split over the link's two connections, each share tagged).
        assert client.call(c_pull_tagged, key, "blocks", [7, 6, 5, 4, 3], [0, 1, 2, 3, 4], "req.token") == "ok"
        for t in range(TENSORS):
            c_blocks[t][[0, 1, 2, 3, 4]] = s_blocks[t][[7, 6, 5, 4, 3]]
        for got, want in zip(_blocks(client.call(c_read, "blocks")), c_blocks):
            assert (got == want).all()
        assert client.call(c_linked) == [SERVER_ID]


def c_pull_range(state, name: str, src: List[int], dst: List[int], ranges: Tuple[int, int, int], tag: str) -> str:
    """The engine seam's pull of a byte range of each block (``ranges``: src_offset, dst_offset, nbytes)."""
    try:
        with state.dd.engine.read_tag(tag):
            state.dd.engine.pull_block_range(SERVER_ID, MODEL_ID, state.caches[name].cache_id, src, dst, *ranges)
    except ld.LLMException as exc:
        return exc.status_code.name
    return "ok"


@needs_core
def test_e2e_a_byte_range_of_each_block_moves_through_staging(cuda_env):
    """A tensor parallel rank's heads: a range inside each of the owner's device blocks, staged on
    its side, lands at its offset in the puller's device blocks, past the guard (inside the leased
    blocks); the rest of each block keeps its bytes."""
    with _pair("DEVICE", "DEVICE") as (client, server, _):
        c_blocks = _blocks(client.call(c_fill, "blocks", 7))
        s_blocks = _blocks(server.call(c_fill, "blocks", 8))
        server.call(c_guard_blocks, "blocks", {"req.token": [2, 5]})
        half = BLOCK // 2
        assert client.call(c_pull_range, "blocks", [5, 2], [1, 6], (half, 8, half - 8), "req.token") == "ok"
        assert client.call(c_pull_range, "blocks", [3], [0], (0, 0, 8), "req.token") == "LLM_KV_CACHE_NOT_EXIST"
        for t in range(TENSORS):
            for s, d in ((5, 1), (2, 6)):
                c_blocks[t][d][8:half] = s_blocks[t][s][half:-8]
        for got, want in zip(_blocks(client.call(c_read, "blocks")), c_blocks):
            assert (got == want).all()
