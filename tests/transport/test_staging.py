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

import socket
import threading
from types import SimpleNamespace
from typing import Any, List, Optional, Tuple

import numpy as np
import pytest

from llm_datadist import _core, _planes
from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.transport import staging
from llm_datadist.transport.errors import CopyFailed

CHUNK = 4096
D2H, H2D = _core.MEMCPY_DEVICE_TO_HOST, _core.MEMCPY_HOST_TO_DEVICE


# ------------------------------------------------------------------------------------------------
# A model of an asynchronous runtime and of the core's staging calls
# ------------------------------------------------------------------------------------------------

def plan_of(descs) -> Any:
    return _planes.plan_from_wire(np.array(list(descs), dtype="<u8").reshape(-1, 3).tobytes())


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
    (1-based) of ``execute`` or ``synchronize`` can be made to fail."""

    def __init__(self, fail_execute: Optional[int] = None, fail_sync: Optional[int] = None) -> None:
        self.queued: List[Any] = []
        self.log: List[Tuple[str, int]] = []
        self.executes = self.syncs = 0
        self.fail_execute, self.fail_sync = fail_execute, fail_sync
        self.allocations: List[Buffer] = []

    def execute(self, plan, kind: int, wait: bool) -> None:
        self.executes += 1
        if self.executes == self.fail_execute:
            raise LLMException("model: copy refused", status_code=LLMStatusCode.LLM_FAILED)
        self.log.append(("d2h" if kind == D2H else "h2d", plan.total_bytes))
        self.queued.append(plan)
        if wait:
            self.synchronize()

    def synchronize(self) -> None:
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
        return _planes.send_plan(fd, head, plan, from_dst, timeout_ms)

    def recv_plan(fd, plan, into_src=False, timeout_ms=-1):
        runtime.log.append(("recv", plan.total_bytes))
        return _planes.recv_plan(fd, plan, into_src, timeout_ms)

    planes = SimpleNamespace(send_plan=send_plan, recv_plan=recv_plan, send_bytes=_planes.send_bytes,
                             recv_discard=_planes.recv_discard, plan_from_wire=_planes.plan_from_wire)
    monkeypatch.setattr(staging, "_core", core)
    monkeypatch.setattr(staging, "_planes", planes)
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
    st, _, got = _planes.recv_into(sock.fileno(), buf, 5000)
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
        self.descs, self.expected = [], self.dst.copy()
        s_off, d_off = 0, gap
        for n in sizes:
            self.descs.append((self.src.ctypes.data + s_off, self.dst.ctypes.data + d_off, n))
            self.expected[d_off:d_off + n] = self.src[s_off:s_off + n]
            s_off, d_off = s_off + n + gap, d_off + n + gap
        self.plan = plan_of(self.descs)


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
    thread, _ = _send_in_thread(a.fileno(), b"", data.plan, model, pool)
    staging.recv_staged(b.fileno(), data.plan, model, pool, 5000)
    thread.join(10)
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
    payload = data.src[:data.plan.total_bytes].tobytes()
    a.setblocking(True)
    a.sendall(payload + b"NEXT")
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


def test_an_engine_has_one_pool_per_runtime(model):
    class Engine:
        runtime = model
    engine = Engine()
    pool = staging.pool_of(engine)
    assert staging.pool_of(engine) is pool and pool.runtime is model
    engine.runtime = AsyncRuntime()
    assert staging.pool_of(engine) is not pool
    staging.drop_pool(engine)
    assert staging.pool_of(engine) is not pool


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
