"""``staging``: device memory of any runtime between processes, through pinned host memory.

The frames are tcp's (``PUSH`` / ``PULL`` on the link's connections, large transfers split over
them); a side whose memory is device memory the host cannot address stages it through pinned
bounce buffers, chunk by chunk, the device copy of one chunk overlapping the socket transfer of
the other (``transport.staging``): this side stages its local cache, the owner stages its own
(``transport.server``: a plan wholly in its device ranges). The owner checks every range against
its registry as for tcp, so the plane accepts every link; it is the device plane of links where
no same-host device plane applies (acl everywhere, cuda across hosts or namespaces). Forced
(``llm.DataPlane=staging``), it carries host memory too, as plain tcp frames.

It keeps no per-link state; its per-engine state is the bounce-buffer pool (made on first use for
the engine's current runtime, freed at ``shutdown``) and the payload that stages through it, which
the engine's server uses too (``device_payload``) for peers' frames into its device memory.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Optional, Tuple

from llm_datadist.status import LLMException
from llm_datadist.transport import budgets
from llm_datadist.transport import deadline as dl
from llm_datadist.transport.errors import CopyFailed
from llm_datadist.transport.planes import register
from llm_datadist.transport.planes.tcp import HOST_PAYLOAD, HostPayload, TcpPlane, probe_loopback
from llm_datadist.transport.staging import (
    STAGING_CHUNK_BYTES, BouncePool, drain_after_failure, recv_staged, send_staged,
)


class StagedPayload(HostPayload):
    """A frame's payload from and into device memory of an engine's runtime, staged through the
    bounce pool that ``pool()`` returns (``transport.staging.send_staged`` / ``recv_staged``: the
    staging plane's, for the engine's current runtime) on a thread bound to its device."""

    def __init__(self, engine: Any, pool: Callable[[], BouncePool]) -> None:
        self.engine = engine
        self.pool = pool

    def send(self, fd: int, head: bytes, plan: Any, timeout_ms: int,
             share: Optional[budgets.Share] = None) -> Tuple[int, int]:
        """``send_staged``, its buffers taken for the link's ``share`` of the staging budget."""
        try:
            self.engine.bind_thread()
        except LLMException as exc:  # nothing sent
            raise CopyFailed(exc, True) from exc
        return send_staged(fd, head, plan, self.engine.runtime, self.pool(), timeout_ms, share)

    def recv(self, fd: int, plan: Any, timeout_ms: int, share: Optional[budgets.Share] = None,
             steady: bool = False) -> Tuple[int, int, int]:
        """``recv_staged``, its buffers taken for ``share``; with ``steady`` the payload must keep
        arriving."""
        try:
            self.engine.bind_thread()
        except LLMException as exc:
            return drain_after_failure(fd, plan.total_bytes, dl.after(timeout_ms), exc)
        return recv_staged(fd, plan, self.engine.runtime, self.pool(), timeout_ms, share, steady)


@register
class StagingPlane(TcpPlane):
    name = "staging"
    summary = (f"device memory through pinned host buffers ({STAGING_CHUNK_BYTES >> 20} MiB chunks, copies "
               f"overlapping the transfer) in tcp frames")
    auto_rank = 90
    fallback = False
    device_memory = True

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self._pool: Optional[BouncePool] = None
        self._pool_lock = threading.Lock()
        #: Device memory of this engine staged through ``pool()``: this side's transfers and its
        #: server's (``device_payload``).
        self.staged = self.device_payload = StagedPayload(engine, self.pool)

    def pool(self) -> BouncePool:
        """The bounce buffers of this engine's current runtime, made on first use (and anew when
        the runtime changed or the pool was freed)."""
        with self._pool_lock:
            pool = self._pool
            if pool is None or pool.runtime is not self.engine.runtime or pool.closed:
                pool = self._pool = BouncePool(self.engine.runtime)
            return pool

    def shutdown(self) -> None:
        """Free the bounce buffers (the engine's links are closing)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    @classmethod
    def probe(cls) -> Tuple[bool, str]:
        usable, why = probe_loopback()
        return usable, (f"{why}; device memory is staged through pinned host buffers of the device runtime"
                        if usable else why)

    def accept(self, session, peer_facts: Dict[str, Any], deadline: float) -> Optional[str]:
        return None  # the peer serves tcp frames on every link and stages its own side

    def transfer_device(self, session, table, plan, write: bool, deadline: float, local_device: bool,
                        remote_device: bool) -> None:
        self.frames(session, table, plan, write, deadline, self.staged if local_device else HOST_PAYLOAD)
