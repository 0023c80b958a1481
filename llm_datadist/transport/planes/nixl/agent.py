"""NIXL itself: whether it is installed and which version, its bindings (imported only once the
plane is about to be used) and ``Agent``, one NIXL agent with its UCX backend, through which the
plane registers memory, loads peers' metadata and posts requests.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import threading
import time
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from llm_datadist.transport.planes.nixl.metadata import DRAM, VRAM

#: How to install NIXL (its metadata declares torch, which it does not need: hence ``--no-deps``).
INSTALL = "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1"
#: The oldest NIXL this plane takes (compact strided descriptor lists came with 1.5).
MIN_VERSION = (1, 5)
#: How long (µs) NIXL's progress thread sleeps in poll() between wake-ups. 0 makes it spin: a
#: core busy for ever (measured here: 2.1 s of CPU per 3 s idle), for about 40 µs less latency.
PROGRESS_ENV = "LLM_DATADIST_NIXL_PROGRESS_US"
DEFAULT_PROGRESS_US = 1000
#: How long a request is polled without a pause: a one-block request completes within it (a
#: loopback round trip takes 30-100 µs here). Pausing sooner made the next request's post wait
#: for NIXL's progress thread (about 1 ms, its poll() period) on this machine.
SPIN_S = 2e-3


def installed() -> bool:
    return importlib.util.find_spec("nixl") is not None


def nixl_version() -> str:
    try:
        from importlib import metadata
        return metadata.version("nixl")
    except Exception:  # noqa: BLE001 - any failure: unknown
        return "unknown"


def _version_tuple(version: str) -> Tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


_bindings_lock = threading.Lock()


def bindings() -> Any:
    """NIXL's Python bindings (``nixl._bindings``), imported now if not yet; ImportError, with the
    install line, where NIXL is missing or too old."""
    with _bindings_lock:
        if not installed():
            raise ImportError(f"NIXL is not installed ({INSTALL})")
        version = nixl_version()
        if version != "unknown" and _version_tuple(version) < MIN_VERSION:
            raise ImportError(f"NIXL {version} is older than {'.'.join(map(str, MIN_VERSION))} ({INSTALL})")
        module = importlib.import_module("nixl")
        return module._bindings


class Agent:
    """One NIXL agent with its UCX backend, used through NIXL's bindings (``nixl._bindings``; the
    ``nixl_agent`` wrapper fixes the progress thread's delay at 0, a spinning thread). Every
    method may raise one of NIXL's errors (``self.errors``)."""

    def __init__(self, name: str, progress_us: int) -> None:
        b = self.b = bindings()
        config = b.nixlAgentConfig()
        config.useProgThread = True  # the target side of UCX TCP and software RMA needs progress
        config.useListenThread = False  # metadata travels over our link: no NIXL port
        config.pthrDelay = progress_us
        config.syncMode = b.NIXL_THREAD_SYNC_RW
        config.captureTelemetry = False
        self.name = name
        self.errors = tuple(getattr(b, n) for n in dir(b) if n.startswith("nixl") and n.endswith("Error"))
        self.agent = b.nixlAgent(name, config)
        self.backends = [self.agent.createBackend("UCX", {})]
        self.memory = {DRAM: b.DRAM_SEG, VRAM: b.VRAM_SEG}
        if (int(b.DRAM_SEG), int(b.VRAM_SEG)) != (DRAM, VRAM):
            raise ImportError("this NIXL numbers its memory types differently from 1.5")
        self.ops = (b.NIXL_READ, b.NIXL_WRITE)
        self.done, self.in_progress = b.NIXL_SUCCESS, b.NIXL_IN_PROG
        self.not_found = getattr(b, "nixlNotFoundError", None)

    def register(self, mem: int, rows: np.ndarray) -> Any:
        descs = self.b.nixlRegDList(self.memory[mem], rows)
        self.agent.registerMem(descs, self.backends)
        return descs

    def deregister(self, descs: Any) -> None:
        self.agent.deregisterMem(descs, self.backends)

    def metadata(self) -> bytes:
        return self.agent.getLocalMD()

    def load(self, blob: bytes) -> str:
        loaded = self.agent.loadRemoteMD(blob)
        return loaded.decode("utf-8", "replace") if isinstance(loaded, bytes) else str(loaded)

    def remove(self, name: str) -> None:
        try:
            self.agent.invalidateRemoteMD(name)
        except self.errors:
            pass  # not loaded (any more)

    def request(self, write: bool, local_mem: int, local: np.ndarray, remote_mem: int, remote: np.ndarray,
                peer: str) -> int:
        return self.agent.createXferReq(self.ops[write], self.b.nixlXferDList(self.memory[local_mem], local),
                                        self.b.nixlXferDList(self.memory[remote_mem], remote), peer, "",
                                        self.backends)

    def prepare(self, peer: str, mem: int, rows: np.ndarray) -> int:
        """A prepared descriptor list of ``peer``'s memory (``peer`` "": this agent's)."""
        return self.agent.prepXferDlist(peer or self.b.NIXL_INIT_AGENT, self.b.nixlXferDList(self.memory[mem], rows),
                                        self.backends)

    def prepare_strided(self, peer: str, mem: int, rows: np.ndarray) -> int:
        """A prepared list of ``peer``'s memory (``peer`` "": this agent's) from NIXL's compact
        strided rows ``(address, bytes, device, stride, count)``, N x 5 uint64: row ``r`` stands
        for ``count`` descriptors, ``stride`` bytes apart, indexed one after the other."""
        return self.agent.prepXferDlist(peer or self.b.NIXL_INIT_AGENT, self.memory[mem], rows, self.backends)

    def prepared_request(self, write: bool, local: int, local_indices: Any, remote: int, remote_indices: Any) -> int:
        return self.agent.makeXferReq(self.ops[write], local, local_indices, remote, remote_indices, "",
                                      self.backends, False)

    def release_list(self, handle: int) -> None:
        try:
            self.agent.releasedDlistH(handle)
        except self.errors:
            pass

    def post(self, handle: int) -> Any:
        return self.agent.postXferReq(handle, "")

    def status(self, handle: int) -> Any:
        return self.agent.getXferStatus(handle)

    def wait(self, handle: int, deadline: float) -> Tuple[Any, Optional[str]]:
        """Post request ``handle`` and poll it (pausing as ``poll_pause`` says) until it is no
        longer in progress or ``deadline`` passes: ``(status, None)`` with status ``done``, or
        ``in_progress`` at the deadline; ``(status or None, why)`` where it failed. The request
        is left for the caller to release."""
        started = time.monotonic()
        try:
            status = self.post(handle)
            while status == self.in_progress:
                now = time.monotonic()
                if now >= deadline:
                    break
                pause = poll_pause(now - started)
                if pause:
                    time.sleep(min(pause, max(deadline - now, 0.0)))
                status = self.status(handle)
        except self.errors as exc:
            return None, str(exc) or type(exc).__name__
        if status != self.done and status != self.in_progress:
            return status, f"status {status}"
        return status, None

    def release(self, handle: int) -> bool:
        """Free a request, cancelling it if it is still going; False where NIXL cannot."""
        try:
            self.agent.releaseXferReq(handle)
            return True
        except self.errors:
            return False

    def close(self) -> None:
        """Drop the agent (its progress thread, UCX worker and context go with it)."""
        self.backends = []
        self.agent = None


def poll_pause(waited: float) -> float:
    """How long to sleep before checking a request again, ``waited`` seconds after posting it: not
    at all for ``SPIN_S``, then about 1/32 of the time spent (between 20 µs and 1 ms), so that a
    long request costs little CPU (NIXL's progress thread moves it meanwhile) and ends at most ~3%
    late."""
    return 0.0 if waited <= SPIN_S else min(max(waited / 32, 20e-6), 1e-3)


def rows(addrs: Sequence[int], nbytes: int, device: int) -> np.ndarray:
    """N x 3 uint64 rows ``(address, nbytes, device)``, one per address."""
    table = np.empty((len(addrs), 3), dtype=np.uint64)
    table[:, 0] = np.asarray(addrs, dtype=np.uint64)
    table[:, 1] = nbytes
    table[:, 2] = device
    return table


def request_rows(descriptors: np.ndarray, write: bool, local_device: int, remote_device: int,
                 extra: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """The local and remote N x 3 rows of a plan's ``(src, dst, nbytes)`` descriptors (column copies:
    no loop per descriptor), and one row more each, left for the caller, with ``extra``. A write
    reads the local sources; a read fills the local destinations."""
    n = len(descriptors)
    local = np.empty((n + extra, 3), dtype=np.uint64)
    remote = np.empty((n + extra, 3), dtype=np.uint64)
    local_column, remote_column = (0, 1) if write else (1, 0)
    local[:n, 0] = descriptors[:, local_column]
    remote[:n, 0] = descriptors[:, remote_column]
    local[:n, 1] = remote[:n, 1] = descriptors[:, 2]
    local[:n, 2] = local_device
    remote[:n, 2] = remote_device
    return local, remote


def progress_us() -> int:
    """The progress thread's delay: ``LLM_DATADIST_NIXL_PROGRESS_US``, else ``DEFAULT_PROGRESS_US``."""
    try:
        value = int(os.environ.get(PROGRESS_ENV, DEFAULT_PROGRESS_US))
    except ValueError:
        return DEFAULT_PROGRESS_US
    return value if value >= 0 else DEFAULT_PROGRESS_US


def import_quietly() -> None:
    """Import NIXL now (about 2 s of loading libraries), where a link would otherwise wait for it;
    a failure is left for the link that needs NIXL to report."""
    try:
        bindings()
    except Exception:  # noqa: BLE001 - the link that needs it says why
        pass
