"""``cma``: the same-host plane. The peer's memory is read or written directly with
``process_vm_readv``/``process_vm_writev``, planned and range-checked against the table the peer
sent over a Unix connection of the link.

Chosen only towards a pid the kernel proved (``SO_PEERCRED``), that is not this process, of this
user, that offers ``cma``, and whose memory a probe read reaches. Before each transfer the
peer's registry generation is read from its counter, mapped read-only at accept: a registry
that changed since the table was fetched makes the manager refresh the table and plan again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from llm_datadist import _core, _io
from llm_datadist.transport import deadline as dl
from llm_datadist.transport.errors import S, ProtocolError, fail, is_int, status_of
from llm_datadist.transport.planes import register
from llm_datadist.transport.planes.base import DataPlane
from llm_datadist.transport.shm import PeerCounter

#: Transfers of at least this many bytes are split over two threads (the kernel copy is
#: CPU-bound per thread).
PARALLEL_CMA_BYTES = 8 << 20
#: How long ``probe`` waits for its probing process.
PROBE_TIMEOUT_S = 30.0


@register
class CmaPlane(DataPlane):
    name = "cma"
    facts_keys = ("same_host",)
    summary = "same-host process_vm_writev/readv (needs ptrace permission between the processes)"
    aliases = ("same-host", "samehost")
    auto_rank = 10
    local_sockets = True
    stripe_bytes = PARALLEL_CMA_BYTES
    stripes = 2

    def __init__(self, engine) -> None:
        super().__init__(engine)
        #: A word of this process that a peer reads to prove it reaches our memory.
        self.cookie = _io.Word(int.from_bytes(os.urandom(8), "little") | 1)

    @classmethod
    def probe(cls) -> Tuple[bool, str]:
        return probe_same_host()

    def offer(self, session) -> Dict[str, Any]:
        if not session.unix:
            return {}
        # Only a peer whose pid the kernel proved may use this plane: tell it where to probe
        # and where our registry generation lives.
        word = self.engine.generation_word
        return {"same_host": {"probe": [self.cookie.addr, self.cookie.value], "generation_addr": word.addr,
                              "generation_fd": word.fd}}

    @classmethod
    def parse_facts(cls, key: str, value: Any) -> "SameHostFacts":
        return SameHostFacts.parse(value)

    def link_state(self, session) -> "CmaLink":
        return CmaLink()

    def accept(self, session, peer_facts: Dict[str, Any], deadline: float) -> Optional[str]:
        refusal = self.local_peer_refusal(session)
        if refusal is not None:
            return refusal
        info = peer_facts.get("same_host") if isinstance(peer_facts, dict) else None
        if not isinstance(info, SameHostFacts):
            return "the peer sent no same-host details"
        st, err, data = _io.cma_read_bytes(session.pid, info.probe_addr, 8)
        if st != 0 or int.from_bytes(data, "little") != info.probe_value:
            return f"a probe read of the peer failed ({os.strerror(err) if err else 'mismatch'})"
        state = self.state(session)
        if state is None:
            return "the link is closed"
        # Map the peer's generation counter and hold a pidfd of it.
        state.generation_addr = info.generation_addr
        state.generation = PeerCounter.open(session.pid, info.generation_fd)
        try:
            state.pidfd = os.pidfd_open(session.pid)
        except (AttributeError, OSError):
            state.pidfd = -1
        return None

    def _live_state(self, session) -> "CmaLink":
        state = session.plane_state.get(self.name)
        if state is None:
            raise fail(S.LLM_LINK_FAILED, f"the link to cluster {session.cluster_id} is closed")
        return state

    def table_is_current(self, session, table) -> bool:
        state = self._live_state(session)
        counter = state.generation
        if counter is not None:
            value = counter.value
            if value is None:
                raise fail(S.LLM_LINK_FAILED, f"the link to cluster {session.cluster_id} is closed")
            return value == table.generation
        st, err, generation = _io.cma_read_u64(session.pid, state.generation_addr)
        if st != 0:
            raise fail(S.LLM_LINK_FAILED, f"cluster {session.cluster_id} (pid {session.pid}) is not "
                                          f"reachable: {os.strerror(err) if err else status_of(st).name}")
        return generation == table.generation

    def transfer(self, session, table, plan, write: bool, deadline: float) -> None:
        bad = table.ranges.first_outside(plan, write)
        if bad >= 0:
            raise fail(S.LLM_KV_CACHE_NOT_EXIST, f"descriptor {bad} names memory that cluster "
                                                 f"{session.cluster_id} has not registered")
        pidfd = self._live_state(session).pidfd
        if plan.total_bytes >= PARALLEL_CMA_BYTES and len(plan) > 1:
            timeout_ms = dl.left_ms(deadline)
            pid = session.pid
            results = session.workers.map(lambda half: _io.cma_copy(pid, half, write, timeout_ms, pidfd),
                                          _core.split_plan(plan, 2))
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            st, err = next((r for r in results if r[0] != 0), results[0])
        else:
            st, err = _io.cma_copy(session.pid, plan, write, dl.left_ms(deadline), pidfd)
        if st != 0:
            what = os.strerror(err) if err else status_of(st).name
            code = st if st in (S.LLM_TIMEOUT, S.LLM_LINK_FAILED) else S.LLM_LINK_FAILED
            raise fail(code, f"same-host {'write to' if write else 'read from'} cluster "
                             f"{session.cluster_id} failed: {what}")

    def block_route(self, session, table, remote_layout, local_layout, write: bool, timeout_ms: int = -1,
                    on_broken=None):
        """A route that checks the link, the peer's mapped generation and its pidfd per call
        (a same-host copy has no timeout and leaves no connection out of step)."""
        state = self.state(session)
        if state is None:
            return None  # the link ended
        counter = state.generation
        view = None if counter is None else counter.view
        pidfd = state.pidfd  # read once: a concurrent close sets it to -1 and closes it
        if view is None or pidfd < 0 or session.closed or session.table is not table:
            return None  # no mapped generation (checked through a system call) or going away
        try:
            pidfd = os.dup(pidfd)
        except OSError:  # closed meanwhile (the link is ending)
            return None
        # The route owns the dup from its first line on (closed with it, even if it refuses).
        route = _io.BlockRoute(session, session.pid, pidfd, view, table.generation,
                                   local_layout, remote_layout, write)
        with state.lock:
            state.routes.add(route)
        if session.closed:  # the link ended meanwhile: its close may have run before the add
            state.release()
            return None
        return route

    def close(self, session) -> None:
        """Close the pidfd and unmap the generation counter of the peer, and release the same of
        every block route of the link that still exists."""
        state = self.state(session)
        if state is not None:
            state.release()


@dataclass(frozen=True)
class SameHostFacts:
    """The peer's ``same_host`` entry (``CmaPlane.offer``), checked: where to read its probe
    cookie and the value to find there, the address of its registry generation word and the
    descriptor number of that word's shared page in the peer (-1: none)."""

    probe_addr: int
    probe_value: int
    generation_addr: int
    generation_fd: int

    @classmethod
    def parse(cls, value: Any) -> "SameHostFacts":
        """ProtocolError unless ``value`` is ``{"probe": [addr, value], "generation_addr": addr,
        "generation_fd": fd}`` of 64-bit numbers (an fd of -1 to 2**31-1)."""
        probe = value.get("probe") if isinstance(value, dict) else None
        if not (isinstance(probe, list) and len(probe) == 2 and all(is_int(x) for x in probe)
                and is_int(value.get("generation_addr")) and is_int(value.get("generation_fd"), -1, 2**31 - 1)):
            raise ProtocolError("malformed same_host entry")
        return cls(probe[0], probe[1], value["generation_addr"], value["generation_fd"])


@dataclass(eq=False)
class CmaLink:
    """cma's state for one link: the peer's registry generation counter mapped read-only (or,
    where it cannot be mapped, its address, read with ``process_vm_readv``), a pidfd of the peer
    (-1: none), and the block routes made for the link (closed with it)."""

    generation: Optional[PeerCounter] = None
    generation_addr: int = 0
    pidfd: int = -1
    routes: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def release(self) -> None:
        """Close the routes, the pidfd and the counter (idempotent)."""
        with self.lock:
            routes, self.routes = list(self.routes), weakref.WeakSet()
        for route in routes:
            route.close()
        pidfd, self.pidfd = self.pidfd, -1
        if pidfd >= 0:
            try:
                os.close(pidfd)
            except OSError:
                pass
        counter, self.generation = self.generation, None
        if counter is not None:
            counter.close()


def ptrace_scope() -> Tuple[Optional[int], str]:
    """Yama's ``ptrace_scope`` (None where Yama is absent) and what it means for sibling processes."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read().strip())
    except (OSError, ValueError):
        return None, "Yama not present: no restriction beyond same user"
    meaning = {0: "classic: any process of the same user",
               1: "restricted: only descendants (sibling clusters are refused)",
               2: "admin-only: needs CAP_SYS_PTRACE",
               3: "no attach: process_vm_readv/writev refused between processes"}
    return scope, f"Yama ptrace_scope={scope} ({meaning.get(scope, 'unknown')})"


_PROBE_CHILD = """
import sys
from llm_datadist import _io
status, err, data = _io.cma_read_bytes(int(sys.argv[1]), int(sys.argv[2]), 8)
print(status, err, data.hex())
"""


def probe_same_host() -> Tuple[bool, str]:
    """Whether another process of this user may read this one's memory with
    ``process_vm_readv``: a child process (not an ancestor of ours, like a sibling cluster) reads
    a word of ours, as a peer's link-time probe does."""
    _, scope_text = ptrace_scope()
    word = _io.Word(int.from_bytes(os.urandom(8), "little") | 1)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(_io.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE_CHILD, str(os.getpid()), str(word.addr)],
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"the probe process did not run ({exc}); {scope_text}"
    try:
        status, err, data = done.stdout.split()
        status, err = int(status), int(err)
    except ValueError:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return False, f"the probe process failed ({last}); {scope_text}"
    if status == 0 and int.from_bytes(bytes.fromhex(data), "little") == word.value:
        return True, f"another process read this one's memory with process_vm_readv; {scope_text}"
    why = os.strerror(err) if err else f"status {status}, wrong bytes"
    return False, (f"process_vm_readv of this process by another failed ({why}); {scope_text}; "
                   f"links between processes of this host use tcp")
