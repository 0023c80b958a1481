"""``cuda_ipc``: GPU memory of a process on this host, mapped into ours with CUDA IPC; the copies
run on the GPU (the runtime's batched device-to-device path: one kernel launch per transfer).

The owner exports every DEVICE cache it registers (``cudaIpcGetMemHandle`` of the allocation that
holds each tensor, and the tensor's offset in it) and lists the exports in its table reply to a
peer whose pid the kernel proved. The peer maps each allocation once (``cudaIpcOpenMemHandle``),
checks every tensor against the size *its own* runtime reports for the mapping, and moves a plan
only after checking it against the owner's table, exactly as the same-host plane does; the owner's
registry generation, mapped read-only at accept, is compared before every transfer, so a registry
that changed (a cache unregistered, its memory about to be freed) makes the manager refresh the
table and plan again. Mappings no longer listed after a refresh are closed; the rest close with
the link.

Carries transfers whose local and remote sides are both device memory (a cuda DEVICE cache on
each side, same GPU or peer GPUs); other combinations go to the next device plane (staging).
Memory the runtime cannot export (allocated with the VMM API, e.g. torch's expandable segments:
``cudaIpcGetMemHandle`` takes only ``cudaMalloc`` memory) is not listed; a transfer touching such a
cache of the peer goes through the staging plane instead (the peer stages its own side, as it
does for every link).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from llm_datadist import _core, runtimes
from llm_datadist._memory import Place
from llm_datadist.status import LLMException
from llm_datadist.transport.errors import S, fail, is_int
from llm_datadist.transport.planes import register
from llm_datadist.transport.planes.base import DataPlane
from llm_datadist.transport.shm import PeerCounter

_FACTS = "cuda_ipc"
#: The plane that moves transfers touching caches the peer could not export.
STAGING = "staging"
#: At most this many exported tensors are read from a peer's table reply.
MAX_EXPORTS = 1 << 16


@register
class CudaIpcPlane(DataPlane):
    name = "cuda_ipc"
    summary = "same-host GPU memory mapped with CUDA IPC, copied on the GPU"
    aliases = ("cuda-ipc", "ipc")
    auto_rank = 20
    local_sockets = True
    device_memory = True
    host_memory = False

    def __init__(self, engine) -> None:
        super().__init__(engine)
        # cache_id -> (export id, [(handle, offset), ...] per tensor), or None where a tensor
        # cannot be exported. The export id is new for every registration: a peer never takes a
        # new registration for an old one, even where the runtime hands out the same handle bytes
        # for a new allocation at a freed one's place.
        self._exports: Dict[int, Optional[Tuple[int, List[Tuple[bytes, int]]]]] = {}
        self._serial = 0
        self._lock = threading.Lock()

    @classmethod
    def probe(cls) -> Tuple[bool, str]:
        ok, why = runtimes.probe("cuda")
        if not ok:
            return False, f"no usable cuda runtime ({why})"
        runtime = runtimes.load("cuda")
        if not runtime.ipc:
            return False, f"the cuda runtime has no IPC here ({runtime.library}: no driver API)"
        return True, f"cuda runtime {runtime.library} with IPC and {runtime.device_count()} GPU(s)"

    def _runtime(self):
        """The engine's runtime if its device memory can be exported, else None."""
        runtime = getattr(self.engine, "runtime", None)
        if runtime is None or runtime.host_addressable or not runtime.ipc:
            return None
        return runtime

    # -- the owner's side ----------------------------------------------------------------------
    def on_register(self, record) -> None:
        runtime = self._runtime()
        if runtime is None or record.placement != Place.DEVICE:
            return
        try:
            tensors = [runtime.ipc_export(addr)[:2] for addr in record.addrs]
        except LLMException:  # not exportable this way (VMM memory): not offered
            tensors = None
        with self._lock:
            self._serial += 1
            self._exports[record.cache_id] = None if tensors is None else (self._serial, tensors)

    def on_unregister(self, record) -> None:
        with self._lock:
            self._exports.pop(record.cache_id, None)

    def offer(self, session) -> Dict[str, Any]:
        if not session.unix or self._runtime() is None:
            return {}
        with self._lock:
            exports = [[cache_id, serial, [[handle.hex(), offset] for handle, offset in tensors]]
                       for cache_id, (serial, tensors) in ((c, e) for c, e in self._exports.items()
                                                           if e is not None)]
        word = self.engine.generation_word
        return {_FACTS: {"generation_fd": word.fd, "exports": exports}}

    # -- the peer's side -----------------------------------------------------------------------
    def link_state(self, session) -> "IpcLink":
        return IpcLink()

    def accept(self, session, peer_facts: Dict[str, Any], deadline: float) -> Optional[str]:
        refusal = self.local_peer_refusal(session)
        if refusal is not None:
            return refusal
        if self._runtime() is None:
            return "this process's device runtime cannot map other processes' memory"
        info = peer_facts.get(_FACTS) if isinstance(peer_facts, dict) else None
        if not (isinstance(info, dict) and is_int(info.get("generation_fd"), 0, 2**31 - 1)
                and isinstance(info.get("exports"), list)):
            return "the peer exports no GPU memory"
        state = self.state(session)
        if state is None:
            return "the link is closed"
        counter = PeerCounter.open(session.pid, info["generation_fd"])
        if counter is None:
            return "the peer's registry generation cannot be mapped"
        with state.lock:
            state.generation = counter
        return None

    def table_is_current(self, session, table) -> bool:
        state = session.plane_state.get(self.name)
        counter = None if state is None else state.generation
        value = None if counter is None else counter.value
        if value is None:
            raise fail(S.LLM_LINK_FAILED, f"the link to cluster {session.cluster_id} is closed")
        return value == table.generation

    def on_table(self, session, table) -> None:
        """Close the mappings of allocations the peer no longer exports (it unregistered them)."""
        state = self.state(session)
        if state is None:
            return
        facts = getattr(session, "facts", None)
        info = facts.get(_FACTS) if isinstance(facts, dict) else None
        listed = {handle for tensors in _parse_exports(info, session.cluster_id).values()
                  for handle, _ in tensors}
        runtime = self._runtime()
        with state.lock:
            stale = [h for h in state.maps if h not in listed]
            for handle in stale:
                base, _ = state.maps.pop(handle)
                if runtime is not None:
                    runtime.ipc_close(base)
            state.spans = None

    def carries(self, session, local_device: bool, remote_device: bool) -> bool:
        return local_device and remote_device

    def transfer_device(self, session, table, plan, write: bool, deadline: float, local_device: bool,
                        remote_device: bool) -> None:
        bad = table.device_ranges.first_outside(plan, write)
        if bad >= 0:
            raise fail(S.LLM_KV_CACHE_NOT_EXIST, f"descriptor {bad} names memory that cluster "
                                                 f"{session.cluster_id} has not registered")
        runtime = self._runtime()
        spans = self._spans(session, table, runtime)
        try:
            moved = _core.translate_plan(plan, write, spans)
        except LLMException as exc:
            # Inside the peer's registered device ranges but in no mapped span: a cache the peer
            # could not export (VMM memory). Staged through host memory instead.
            if exc.status_code != S.LLM_KV_CACHE_NOT_EXIST or not self._unexported(session, table):
                raise
            staging = self.sibling(STAGING)  # this engine's staging plane, from its plane set
            if staging is None:
                raise
            staging.transfer_device(session, table, plan, write, deadline, local_device, remote_device)
            return
        self.engine.bind_thread()
        _core.execute(moved, runtime, _core.MEMCPY_DEVICE_TO_DEVICE)

    @staticmethod
    def _unexported(session, table) -> bool:
        """Whether the peer's table has a device cache its exports do not cover."""
        facts = getattr(session, "facts", None)
        info = facts.get(_FACTS) if isinstance(facts, dict) else None
        exports = _parse_exports(info, session.cluster_id)
        return any(not cache.host_addressable and len(exports.get(cache.cache_id) or ()) != cache.num_tensors
                   for cache in table.caches.values())

    def _spans(self, session, table, runtime) -> List[Tuple[int, int, int]]:
        """``(peer address, bytes, address here)`` of every exported device tensor of ``table``,
        mapping what is new and closing what the peer no longer lists."""
        state = self.state(session)
        if state is None:
            raise fail(S.LLM_LINK_FAILED, f"the link to cluster {session.cluster_id} is closed")
        with state.lock:
            facts = getattr(session, "facts", None)
            cached = state.spans
            if cached is not None and cached[0] is table and cached[1] is facts:
                return cached[2]
            info = facts.get(_FACTS) if isinstance(facts, dict) else None
            exports = _parse_exports(info, session.cluster_id)
            spans, used = [], set()
            for cache in table.caches.values():
                if cache.host_addressable:
                    continue
                tensors = exports.get(cache.cache_id)
                if tensors is None or len(tensors) != cache.num_tensors:
                    continue  # not exported: a transfer touching it finds no span
                for addr, (handle, offset) in zip(cache.addrs, tensors):
                    base, size = self._map(state, runtime, handle)
                    used.add(handle)
                    if offset > size or cache.tensor_bytes > size - offset:
                        raise fail(S.LLM_LINK_FAILED, f"cluster {session.cluster_id} exported cache "
                                                      f"{cache.cache_id} beyond its GPU allocation")
                    spans.append((addr, cache.tensor_bytes, base + offset))
            for handle in [h for h in state.maps if h not in used]:
                base, _ = state.maps.pop(handle)
                runtime.ipc_close(base)
            state.spans = (table, facts, spans)
            return spans

    @staticmethod
    def _map(state: "IpcLink", runtime, key: Tuple[bytes, int]) -> Tuple[int, int]:
        mapped = state.maps.get(key)
        if mapped is None:
            base = runtime.ipc_open(key[0])
            mapped = state.maps[key] = (base, runtime.ipc_size(base))
        return mapped

    def close(self, session) -> None:
        state = self.state(session)
        if state is None:
            return
        with state.lock:
            maps, state.maps = state.maps, {}
            state.spans = None
            counter, state.generation = state.generation, None
        runtime = self._runtime()
        for base, _ in maps.values():
            if runtime is not None:
                runtime.ipc_close(base)
        if counter is not None:
            counter.close()


@dataclass(eq=False)
class IpcLink:
    """cuda_ipc's state for one link: the peer's registry generation counter mapped read-only
    (set by ``accept``), the peer's allocations mapped here, and the spans of the last transfer;
    ``lock`` guards all three."""

    generation: Optional[PeerCounter] = None
    #: (handle, export id) -> (base here, mapped bytes)
    maps: Dict[Tuple[bytes, int], Tuple[int, int]] = field(default_factory=dict)
    #: (table, facts, spans) of the last transfer, or None
    spans: Optional[Tuple[Any, Any, List[Tuple[int, int, int]]]] = None
    lock: threading.Lock = field(default_factory=threading.Lock)


def _parse_exports(info: Any, cluster_id: int) -> Dict[int, List[Tuple[Tuple[bytes, int], int]]]:
    """The peer's exports, checked: cache id -> [((64-byte handle, export id), offset), ...]; the
    pair names one mapping (one registration's view of one allocation)."""
    if not isinstance(info, dict) or not isinstance(info.get("exports"), list):
        return {}
    out: Dict[int, List[Tuple[bytes, int]]] = {}
    count = 0
    try:
        for cache_id, serial, tensors in info["exports"]:
            if (not is_int(cache_id, 1, 2**63 - 1) or not is_int(serial, 0, 2**63 - 1)
                    or not isinstance(tensors, list)):
                raise ValueError(f"cache {cache_id!r}")
            parsed = []
            for handle, offset in tensors:
                raw = bytes.fromhex(handle) if isinstance(handle, str) else b""
                if len(raw) != 64 or not is_int(offset, 0, 2**63 - 1):
                    raise ValueError(f"tensor export of cache {cache_id}")
                parsed.append(((raw, serial), offset))
                count += 1
            if count > MAX_EXPORTS:
                raise ValueError(f"more than {MAX_EXPORTS} tensors")
            out[cache_id] = parsed
    except (TypeError, ValueError) as exc:
        raise fail(S.LLM_LINK_FAILED, f"cluster {cluster_id} sent malformed GPU exports: {exc}") from None
    return out
