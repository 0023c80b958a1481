"""``cuda_ipc``: GPU memory of a process on this host, mapped into ours with CUDA IPC; the copies
run on the GPU (the runtime's batched device-to-device path: one kernel launch per transfer).

The owner exports every DEVICE cache it registers (``cudaIpcGetMemHandle`` of the allocation that
holds each tensor, and the tensor's offset in it) and lists the exports in its table reply only to
a peer it trusts with them (``export_refusal``): a process of this host whose pid and uid the
kernel proved (``SO_PEERCRED``), of this user, not this process, that offers the plane, on a link
authenticated with a secret -- or, where the user opted in (``llm.CudaIpcWithoutSecret`` /
``LLM_DATADIST_CUDA_IPC_WITHOUT_SECRET``), on an unauthenticated one. A handle names the *whole*
allocation, not the registered range: a cache registered inside a larger allocation (a tensor of
torch's caching allocator) exposes all of it to such a peer, which the owner logs once per
registration; a cache from ``allocate_cache`` / ``allocate_blocks_cache`` has one allocation of
its own per tensor. The peer maps each allocation once (``cudaIpcOpenMemHandle``),
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

import logging
import os
import threading
from array import array
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from llm_datadist import _core, runtimes
from llm_datadist._memory import Place
from llm_datadist.status import LLMException
from llm_datadist.transport import auth
from llm_datadist.transport.errors import S, ProtocolError, brief, fail, is_int
from llm_datadist.transport.planes import register
from llm_datadist.transport.planes.base import DataPlane
from llm_datadist.transport.shm import PeerCounter

_FACTS = "cuda_ipc"
#: The plane that moves transfers touching caches the peer could not export.
STAGING = "staging"
#: At most this many exported tensors are read from a peer's table reply.
MAX_EXPORTS = 1 << 16
#: The bytes of a CUDA IPC memory handle (``cudaIpcMemHandle_t``).
HANDLE_BYTES = 64
#: The option (``"1"`` / ``"true"``) that lets this side export its GPU memory on links without a
#: secret (still only to a proven process of this user); the environment variable is read where
#: the option is absent.
WITHOUT_SECRET_OPTION = "llm.CudaIpcWithoutSecret"
WITHOUT_SECRET_ENV = "LLM_DATADIST_CUDA_IPC_WITHOUT_SECRET"

#: Why a proven peer of this user gets no handles on a link without a secret.
NO_SECRET = (f"the link has no secret ({auth.SECRET_OPTION}), and {WITHOUT_SECRET_OPTION} / "
             f"{WITHOUT_SECRET_ENV} does not allow exports without one")

logger = logging.getLogger("llm_datadist")
_told_no_secret = False


def exports_without_secret(options: Any) -> bool:
    """Whether ``options`` (or, where they do not say, the environment) opt in to exports on
    links without a secret."""
    value = options.get(WITHOUT_SECRET_OPTION) if hasattr(options, "get") else None
    if value is None:
        value = os.environ.get(WITHOUT_SECRET_ENV)
    return str(value or "").strip().lower() in ("1", "true")


def trust_summary() -> str:
    """Who receives this process's CUDA IPC handles, for ``python -m llm_datadist info``."""
    who = ("only to a process of this host whose pid and uid the kernel proved (SO_PEERCRED), of this "
           "user, not this one")
    if exports_without_secret({}):
        links = f"on every link: {WITHOUT_SECRET_ENV} is on, so links without a secret get them too"
    else:
        links = (f"on links authenticated with a secret ({auth.SECRET_OPTION}); {WITHOUT_SECRET_OPTION} / "
                 f"{WITHOUT_SECRET_ENV}=1 extends that to links without one")
    return (f"exports go {who}, {links}; a handle names the whole cudaMalloc allocation, so a registered "
            f"range that is only part of an allocation exposes all of it (allocate_cache / "
            f"allocate_blocks_cache give each tensor an allocation of its own)")


@register
class CudaIpcPlane(DataPlane):
    name = "cuda_ipc"
    facts_keys = (_FACTS,)
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
        #: Export on links without a secret too (``WITHOUT_SECRET_OPTION``).
        self.without_secret = exports_without_secret(getattr(engine, "options", None))
        #: Registrations with a tensor in a larger allocation than its own bytes (logged once each).
        self.partial_registrations = 0

    def counters(self) -> Dict[str, int]:
        return {"partial_registrations": self.partial_registrations}

    @classmethod
    def probe(cls) -> Tuple[bool, str]:
        ok, why = runtimes.probe("cuda")
        if not ok:
            return False, f"no usable cuda runtime ({why})"
        runtime = runtimes.load("cuda")
        if not runtime.ipc:
            return False, f"the cuda runtime has no IPC here ({runtime.library}: no driver API)"
        return True, f"cuda runtime {runtime.library} with IPC and {runtime.device_count()} GPU(s)"

    @classmethod
    def trust(cls) -> str:
        return trust_summary()

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
            exported = [runtime.ipc_export(addr) for addr in record.addrs]
        except LLMException:  # not exportable this way (VMM memory): not offered
            exported = None
        tensors = None if exported is None else [(handle, offset) for handle, offset, _ in exported]
        if exported is not None:
            self._check_whole(record, exported)
        with self._lock:
            self._serial += 1
            self._exports[record.cache_id] = None if tensors is None else (self._serial, tensors)

    def _check_whole(self, record, exported: List[Tuple[bytes, int, int]]) -> None:
        """Log (once for this registration) and count a cache with a tensor that is only part of
        its allocation: a handle names the whole allocation, so a peer given it reaches more
        than was registered."""
        partial = [size for _, offset, size in exported if offset != 0 or size > record.tensor_bytes]
        if not partial:
            return
        with self._lock:
            self.partial_registrations += 1
        logger.warning("cluster %s: %d of the %d tensors of DEVICE cache %d (%d bytes each) lie in larger "
                       "GPU allocations (up to %d bytes); a peer given their CUDA IPC handles can reach the "
                       "whole allocations (allocate_cache / allocate_blocks_cache give each tensor an "
                       "allocation of its own)", getattr(self.engine, "cluster_id", "?"), len(partial),
                       len(exported), record.cache_id, record.tensor_bytes, max(partial))

    def on_unregister(self, record) -> None:
        with self._lock:
            self._exports.pop(record.cache_id, None)

    def export_refusal(self, session) -> Optional[str]:
        """Why the peer of ``session`` gets none of this side's CUDA IPC handles, or None if it
        may have them: a handle names a whole allocation of this process, so only a process the
        kernel proved to be another one of this user, offering the plane, on a link authenticated
        with a secret (or where the user opted in to exports without one) gets them."""
        refusal = self.local_peer_refusal(session)
        if refusal is not None:
            return refusal
        if not session.authenticated and not self.without_secret:
            return NO_SECRET
        return None

    def offer(self, session) -> Dict[str, Any]:
        if self._runtime() is None:
            return {}
        refusal = self.export_refusal(session)
        if refusal is not None:
            if refusal == NO_SECRET:
                self._tell_no_secret(session)
            return {}
        with self._lock:
            exports = [[cache_id, serial, [[handle.hex(), offset] for handle, offset in tensors]]
                       for cache_id, (serial, tensors) in ((c, e) for c, e in self._exports.items()
                                                           if e is not None)]
        word = self.engine.generation_word
        return {_FACTS: {"generation_fd": word.fd, "exports": exports}}

    @staticmethod
    def _tell_no_secret(session) -> None:
        """Say once per process that a peer this side would otherwise export to (of this user,
        proven) gets no handles because the link has no secret: its device transfers go through
        staging, which is slower."""
        global _told_no_secret
        if _told_no_secret:
            return
        _told_no_secret = True
        logger.warning("cuda_ipc: no CUDA IPC handles for cluster %s (pid %s): %s; its device transfers "
                       "with this cluster go through staging", session.cluster_id, session.pid, NO_SECRET)

    # -- the peer's side -----------------------------------------------------------------------
    @classmethod
    def parse_facts(cls, key: str, value: Any) -> "IpcFacts":
        return IpcFacts.parse(value)

    def link_state(self, session) -> "IpcLink":
        return IpcLink()

    def accept(self, session, peer_facts: Dict[str, Any], deadline: float) -> Optional[str]:
        refusal = self.local_peer_refusal(session)
        if refusal is not None:
            return refusal
        if self._runtime() is None:
            return "this process's device runtime cannot map other processes' memory"
        info = peer_facts.get(_FACTS) if isinstance(peer_facts, dict) else None
        if not isinstance(info, IpcFacts):
            return ("the peer exports no GPU memory to this process (an owner exports only to a proven "
                    "process of its own user, on links with a secret unless it allows "
                    f"{WITHOUT_SECRET_OPTION})")
        state = self.state(session)
        if state is None:
            return "the link is closed"
        counter = PeerCounter.open(session.pid, info.generation_fd)
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
        listed = _exports_of(getattr(session, "facts", None)).mappings()
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
        exports = _exports_of(getattr(session, "facts", None))
        return any(not cache.host_addressable and exports.tensor_count(cache.cache_id) != cache.num_tensors
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
            exports = _exports_of(facts)
            spans, used = [], set()
            for cache in table.caches.values():
                if cache.host_addressable:
                    continue
                tensors = exports.tensors(cache.cache_id)
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


class Exports:
    """The GPU memory a peer exported, checked and packed (72 bytes a tensor, 20 a cache): per
    cache id (sorted), the export id of its registration, and per tensor the handle of the
    allocation holding it and its offset there. One pair (handle, export id) names one mapping
    (one registration's view of one allocation)."""

    __slots__ = ("_cache_ids", "_serials", "_starts", "_handles", "_offsets")

    def __init__(self, caches: List[Tuple[int, int, List[Tuple[bytes, int]]]] = ()) -> None:
        """``caches``: ``(cache id, export id, [(handle, offset), ...])``, unique cache ids."""
        caches = sorted(caches)
        self._cache_ids = array("Q", (c[0] for c in caches))
        self._serials = array("Q", (c[1] for c in caches))
        self._starts = array("I", [0])
        for _, _, tensors in caches:
            self._starts.append(self._starts[-1] + len(tensors))
        self._handles = b"".join(handle for c in caches for handle, _ in c[2])
        self._offsets = array("Q", (offset for c in caches for _, offset in c[2]))

    def _index(self, cache_id: int) -> int:
        at = bisect_left(self._cache_ids, cache_id)
        return at if at < len(self._cache_ids) and self._cache_ids[at] == cache_id else -1

    def cache_ids(self) -> List[int]:
        """The caches exported, in order."""
        return list(self._cache_ids)

    def tensor_count(self, cache_id: int) -> int:
        """How many tensors of ``cache_id`` the peer exported (0: none)."""
        at = self._index(cache_id)
        return 0 if at < 0 else self._starts[at + 1] - self._starts[at]

    def tensors(self, cache_id: int) -> Optional[List[Tuple[Tuple[bytes, int], int]]]:
        """``[((handle, export id), offset), ...]`` of ``cache_id``'s tensors, or None."""
        at = self._index(cache_id)
        if at < 0:
            return None
        serial = self._serials[at]
        return [((self._handle(j), serial), self._offsets[j]) for j in range(self._starts[at], self._starts[at + 1])]

    def mappings(self) -> Set[Tuple[bytes, int]]:
        """Every ``(handle, export id)`` listed."""
        return {(self._handle(j), self._serials[at]) for at in range(len(self._cache_ids))
                for j in range(self._starts[at], self._starts[at + 1])}

    def _handle(self, j: int) -> bytes:
        return self._handles[j * HANDLE_BYTES:(j + 1) * HANDLE_BYTES]


@dataclass(frozen=True)
class IpcFacts:
    """The peer's ``cuda_ipc`` entry (``CudaIpcPlane.offer``), checked: the descriptor number of
    its registry generation word's shared page in the peer, and its exports."""

    generation_fd: int
    exports: Exports

    @classmethod
    def parse(cls, value: Any) -> "IpcFacts":
        """ProtocolError unless ``value`` is ``{"generation_fd": fd, "exports": [[cache id, export
        id, [[handle hex, offset], ...]], ...]}``: an fd of 0 to 2**31-1, positive cache ids listed
        once, each with at least one tensor, at most ``MAX_EXPORTS`` tensors in all, 64-byte
        handles, 63-bit export ids and offsets."""
        if not isinstance(value, dict) or not is_int(value.get("generation_fd"), 0, 2**31 - 1) \
                or not isinstance(value.get("exports"), list):
            raise ProtocolError("malformed cuda_ipc entry")
        caches, seen, count = [], set(), 0
        for entry in value["exports"]:
            if not (isinstance(entry, list) and len(entry) == 3):
                raise ProtocolError(f"cuda_ipc export {_what(entry)}")
            cache_id, serial, tensors = entry
            if (not is_int(cache_id, 1, 2**63 - 1) or cache_id in seen or not is_int(serial, 0, 2**63 - 1)
                    or not isinstance(tensors, list) or not tensors):
                raise ProtocolError(f"cuda_ipc export of cache {_what(cache_id)}")
            count += len(tensors)
            if count > MAX_EXPORTS:
                raise ProtocolError(f"cuda_ipc exports of more than {MAX_EXPORTS} tensors")
            seen.add(cache_id)
            caches.append((cache_id, serial, [_tensor_export(cache_id, tensor) for tensor in tensors]))
        return cls(value["generation_fd"], Exports(caches))


def _tensor_export(cache_id: int, tensor: Any) -> Tuple[bytes, int]:
    """``(handle, offset)`` of one ``[handle hex, offset]``; ProtocolError if it is not one."""
    if isinstance(tensor, list) and len(tensor) == 2 and isinstance(tensor[0], str) \
            and len(tensor[0]) == 2 * HANDLE_BYTES and is_int(tensor[1], 0, 2**63 - 1):
        try:
            handle = bytes.fromhex(tensor[0])
        except ValueError:
            handle = b""
        if len(handle) == HANDLE_BYTES:
            return handle, tensor[1]
    raise ProtocolError(f"cuda_ipc tensor export of cache {cache_id}: {_what(tensor)}")


def _what(value: Any) -> str:
    """A peer's value for a message: a number as it is, anything else by its type (a peer's list
    may nest as deep as the JSON decoder allows, too deep to ``repr``)."""
    return brief(value) if isinstance(value, (int, float)) else f"a {type(value).__name__}"


_NO_EXPORTS = Exports()


def _exports_of(facts: Any) -> Exports:
    """The exports in a link's facts (none where the peer sent no ``cuda_ipc`` entry)."""
    info = facts.get(_FACTS) if isinstance(facts, dict) else None
    return info.exports if isinstance(info, IpcFacts) else _NO_EXPORTS
