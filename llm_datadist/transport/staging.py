"""Staged payloads: device memory that the host cannot address (cuda, acl), sent and received on a
link's connections through pinned host bounce buffers.

``send_staged`` sends a frame's head and then the source bytes of a plan, copying them device ->
host chunk by chunk (``STAGING_CHUNK_BYTES``) into two bounce buffers: the copy of chunk k+1 is
queued on the device before chunk k goes to the socket, so copy and send overlap.
``recv_staged`` receives chunk k into one bounce buffer while the host -> device copy of chunk k-1
runs from the other. Both use the plan's own descriptors (``_core.stage_plan``), so no byte is
copied outside the plan; the plan was checked against the owner's registry before (the owner's
server) or made by this side from its own cache (the client).

Used by both ends of a staged transfer: the ``staging`` plane on the side that asks (its local
cache) and the server on the side that owns the memory (``transport.server``), both through the
staging plane's payload mover (``planes.staging.StagedPayload``) and bounce pool (one per engine,
freed at finalize). The caller binds its thread to the engine's device first
(``EngineView.bind_thread``).

The bounce buffers count against the process's staging budget and the link's share of it
(``budgets``; ``BouncePool.acquire``); the server receives a peer's staged push ``steady``: a
payload that stalls gives its buffers back at once (``session.receive_steadily``).

A copy that fails raises ``CopyFailed``; ``in_step`` says whether the connection is still in step
with the frame: a send that failed before its first byte went out, or a receive that read (and
dropped) the rest of the frame. Otherwise the frame is cut short and the connection must go (as
for a truncated payload). Socket failures are returned as statuses, as ``_io.send_plan`` /
``recv_plan`` return them.
"""

from __future__ import annotations

import struct
import threading
from typing import Any, List, Optional, Tuple

from llm_datadist import _core, _io
from llm_datadist.status import LLMException
from llm_datadist.transport import budgets
from llm_datadist.transport import deadline as dl
from llm_datadist.transport.errors import S, fail
from llm_datadist.transport.errors import CopyFailed
from llm_datadist.transport.session import receive_steadily

__all__ = ["STAGING_CHUNK_BYTES", "POOL_KEEP", "BouncePool", "send_staged", "recv_staged", "drain_after_failure",
           "CopyFailed"]

#: Bytes per bounce buffer: the unit of one device copy and one socket send or receive.
STAGING_CHUNK_BYTES = 4 << 20
#: Most idle bounce buffers a pool keeps (each transfer in flight holds two).
POOL_KEEP = 8

_DESC = struct.Struct("<3Q")


class BouncePool:
    """Pinned host buffers of ``chunk_bytes`` (``_core.Allocation(runtime, n, on_device=False,
    pinned=True)``: page-locked where the runtime has it), made on demand, kept for the next
    transfer (at most ``keep`` idle ones), freed with the pool.

    The buffers a transfer holds count against the process's staging budget
    (``budgets.staging()``, ``LLM_DATADIST_MAX_STAGING_BYTES``) and its link's share of it (a
    ``budgets.Share``: the link's and its source's bounds) from ``acquire`` to ``release``: a
    transfer that would exceed one of them waits for room until its deadline, then fails
    (``LLM_TIMEOUT``) before it has moved a byte."""

    def __init__(self, runtime: Any, chunk_bytes: int = STAGING_CHUNK_BYTES, keep: int = POOL_KEEP) -> None:
        self.runtime = runtime
        self.chunk_bytes = chunk_bytes
        self.keep = keep
        self._free: List[Any] = []
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self, count: int = 2, timeout_ms: int = 0, share: Optional[budgets.Share] = None) -> List[Any]:
        nbytes = count * self.chunk_bytes
        budget = budgets.staging()
        blocked = budget.take(nbytes, timeout_ms / 1000, share)
        if blocked == "process":
            raise fail(S.LLM_TIMEOUT, f"no room for {nbytes} bytes of staging buffers in time: staged "
                                      f"transfers in flight hold {budget.in_use} of {budget.limit} "
                                      f"({budgets.MAX_STAGING_BYTES_ENV})")
        if blocked is not None:
            bound = (f"{budget.per_source} of its source ({budgets.MAX_STAGING_PER_SOURCE_ENV})" if blocked == "source"
                     else f"{budget.per_link} of one link")
            raise fail(S.LLM_TIMEOUT, f"no room for {nbytes} bytes of staging buffers in time: the link's "
                                      f"transfers hold the most they may, {bound}")
        try:
            return self._take(count)
        except BaseException:
            budget.release(nbytes, share)
            raise

    def _take(self, count: int) -> List[Any]:
        with self._lock:
            taken, self._free = self._free[:count], self._free[count:]
        while len(taken) < count:
            taken.append(_core.Allocation(self.runtime, self.chunk_bytes, on_device=False, pinned=True))
        return taken

    def release(self, buffers: List[Any], share: Optional[budgets.Share] = None) -> None:
        """Give buffers back (no copy may be queued on them any more), to ``share`` too if they
        were taken for one."""
        budgets.staging().release(len(buffers) * self.chunk_bytes, share)
        with self._lock:
            if not self._closed:
                self._free.extend(buffers[:max(0, self.keep - len(self._free))])

    @property
    def closed(self) -> bool:
        return self._closed

    def idle(self) -> int:
        with self._lock:
            return len(self._free)

    def close(self) -> None:
        """Free the idle buffers; buffers in use are freed when given back."""
        with self._lock:
            self._closed = True
            self._free = []


def _bounce_plan(buffer: Any, nbytes: int, skip: int = 0) -> Any:
    """A one-descriptor plan of the first ``nbytes`` of a bounce buffer, less their first ``skip``
    (as source and destination, for ``send_plan`` and ``recv_plan``)."""
    return _io.plan_from_wire(_DESC.pack(buffer.addr + skip, buffer.addr + skip, nbytes - skip))


def _settle(runtime: Any) -> None:
    """Wait for queued copies after a failure, so that no copy still uses a buffer given back."""
    try:
        runtime.synchronize()
    except LLMException:
        pass


def send_staged(fd: int, head: bytes, plan: Any, runtime: Any, pool: BouncePool,
                timeout_ms: int, share: Optional[budgets.Share] = None) -> Tuple[int, int]:
    """Send ``head`` then the source bytes of ``plan`` (device memory of ``runtime``), staged
    through two bounce buffers of ``pool`` (taken for the link's ``share`` of the staging
    budget): ``(status, errno)`` of the socket; ``CopyFailed`` for a device copy that failed."""
    deadline = dl.after(timeout_ms)
    total = plan.total_bytes
    if total == 0:
        return _io.send_bytes(fd, head, dl.left_ms(deadline)) if head else (0, 0)
    chunk = pool.chunk_bytes
    try:
        buffers = pool.acquire(2, dl.left_ms(deadline), share)
    except LLMException as exc:  # no page-locked memory (or no room in the budget): nothing sent
        raise CopyFailed(exc, True) from exc
    pending = False  # copies queued and not yet waited for
    sent = False     # some of the frame went out
    try:
        try:
            _core.execute(_core.stage_plan(plan, 0, min(chunk, total), buffers[0].addr, True), runtime,
                          _core.MEMCPY_DEVICE_TO_HOST, wait=False)
            pending = True
            runtime.synchronize()
            pending = False
        except LLMException as exc:
            raise CopyFailed(exc, True) from exc
        start, k = 0, 0
        while start < total:
            nbytes = min(chunk, total - start)
            following = start + nbytes
            if following < total:  # the next chunk's copy runs while this one is sent
                try:
                    _core.execute(_core.stage_plan(plan, following, min(chunk, total - following),
                                                   buffers[(k + 1) % 2].addr, True),
                                  runtime, _core.MEMCPY_DEVICE_TO_HOST, wait=False)
                    pending = True
                except LLMException as exc:
                    raise CopyFailed(exc, not sent) from exc
            st, err = _io.send_plan(fd, b"" if sent else head, _bounce_plan(buffers[k % 2], nbytes), False,
                                        dl.left_ms(deadline))
            sent = True
            if st != 0:
                return st, err
            if pending:
                try:
                    runtime.synchronize()
                    pending = False
                except LLMException as exc:
                    raise CopyFailed(exc, False) from exc
            start, k = following, k + 1
        return 0, 0
    finally:
        if pending:
            _settle(runtime)
        pool.release(buffers, share)


def recv_staged(fd: int, plan: Any, runtime: Any, pool: BouncePool, timeout_ms: int,
                share: Optional[budgets.Share] = None, steady: bool = False) -> Tuple[int, int, int]:
    """Receive ``plan.total_bytes`` and copy them to the destinations of ``plan`` (device memory
    of ``runtime``) through two bounce buffers of ``pool`` (taken for the link's ``share`` of the
    staging budget): ``(status, errno, received)`` of the socket. With ``steady`` the payload must
    keep arriving (``session.receive_steadily``): one that stalls ends with ``LLM_TIMEOUT`` and
    its buffers are given back at once. A device copy that fails stops the copies; the rest of
    the payload is read and dropped, then ``CopyFailed`` (in step) is raised."""
    deadline = dl.after(timeout_ms)
    total = plan.total_bytes
    if total == 0:
        return 0, 0, 0
    chunk = pool.chunk_bytes
    try:
        buffers = pool.acquire(2, dl.left_ms(deadline), share)
    except LLMException as exc:  # no page-locked memory (or no room in the budget): read the payload, drop it
        return drain_after_failure(fd, total, deadline, exc)
    pending = False
    failure = None
    start, k = 0, 0
    try:
        while start < total:
            nbytes = min(chunk, total - start)
            buffer = buffers[k % 2]
            if steady:
                st, err, got = receive_steadily(
                    lambda done, ms, _buffer=buffer, _nbytes=nbytes: _io.recv_plan(
                        fd, _bounce_plan(_buffer, _nbytes, done), False, ms), deadline)
            else:
                st, err, got = _io.recv_plan(fd, _bounce_plan(buffer, nbytes), False, dl.left_ms(deadline))
            if st != 0:
                return st, err, start + got
            try:
                if pending:  # chunk k-1 is on the device: its buffer takes chunk k+1
                    runtime.synchronize()
                    pending = False
                _core.execute(_core.stage_plan(plan, start, nbytes, buffer.addr, False), runtime,
                              _core.MEMCPY_HOST_TO_DEVICE, wait=False)
                pending = True
            except LLMException as exc:
                failure = exc
            start, k = start + nbytes, k + 1
            if failure is not None:
                break
        if failure is None and pending:
            try:
                runtime.synchronize()
                pending = False
            except LLMException as exc:
                failure = exc
    finally:
        if pending:
            _settle(runtime)
        pool.release(buffers, share)
    if failure is not None:
        st, err, got = drain_after_failure(fd, total - start, deadline, failure)  # raises once in step
        return st, err, start + got
    return 0, 0, total


def drain_after_failure(fd: int, nbytes: int, deadline: float, failure: LLMException) -> Tuple[int, int, int]:
    """After a failure, keep the connection in step: read the rest of the frame (``nbytes``) and
    drop it, then raise ``CopyFailed`` (in step); the socket status if that read fails."""
    if nbytes:
        st, err, got = _io.recv_discard(fd, nbytes, dl.left_ms(deadline))
        if st != 0:
            return st, err, got
    raise CopyFailed(failure, True) from failure
