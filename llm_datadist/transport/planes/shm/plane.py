"""The shm plane itself (``ShmPlane``): what the owner offers and serves, what the peer accepts,
maps and moves; its per-link state (``ShmLink``) and the peer's table entry (``ShmFacts``). See the
package's docstring."""

from __future__ import annotations

import hmac
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from llm_datadist import _core, _io
from llm_datadist.status import LLMException
from llm_datadist.transport import deadline as dl
from llm_datadist.transport import server, wire
from llm_datadist.transport.errors import S, ProtocolError, fail, is_int
from llm_datadist.transport.planes import register
from llm_datadist.transport.planes.base import DataPlane
from llm_datadist.transport.planes.shm.files import (MAX_FDS_PER_REQUEST, SEALS_NEEDED, MappedCache,
                                                       connection_refusal, fetch_files, send_with_files)

_FACTS = "shm"
#: The plane whose checks, generation counter and copies this one uses for the rest of a link.
CMA = "cma"
#: At most this many caches are read from a peer's ``shm`` entry.
MAX_SHARED_CACHES = 1 << 16


def _no_count(counter: str) -> None:
    return None


@register
class ShmPlane(DataPlane):
    name = "shm"
    facts_keys = (_FACTS,)
    summary = ("same-host: caches the peer allocated mapped here (memfd passed over the Unix socket), "
               "memcpy; other memory as cma")
    aliases = ("memfd",)
    auto_rank = 5
    local_sockets = True
    uses = (CMA,)

    def __init__(self, engine) -> None:
        super().__init__(engine)
        # cache_id -> (export id, engine.shared_memory.SharedCache) of every shared cache registered.
        self._exports: Dict[int, Tuple[int, Any]] = {}
        self._serial = 0
        self._lock = threading.Lock()
        #: Files passed to peers, and requests refused (``counters``).
        self.files_passed = 0
        self.files_refused = 0
        #: A word only a process that may ptrace this one can read (its address is in ``offer``):
        #: a file request must carry it, as cma's reach is the kernel's rule, not the uid alone.
        self._proof = _io.Word(int.from_bytes(os.urandom(8), "little") | 1)

    def counters(self) -> Dict[str, int]:
        return {"shm_files_passed": self.files_passed, "shm_requests_refused": self.files_refused}

    @classmethod
    def probe(cls) -> Tuple[bool, str]:
        from llm_datadist.transport.planes.cma import probe_same_host  # the same reach as cma
        if not hasattr(os, "memfd_create") or not SEALS_NEEDED:
            return False, "no sealed memfds on this host"
        return probe_same_host()

    @classmethod
    def trust(cls) -> str:
        return ("the memfd of each cache this process allocates goes only to a process of this host whose pid "
                "and uid the kernel proved (SO_PEERCRED), of this user, not this one, over that process's own "
                "Unix connection (SCM_RIGHTS); it reaches that one cache and nothing else")

    def _cma(self):
        return self.sibling(CMA)

    # -- the owner's side ----------------------------------------------------------------------
    def on_register(self, record) -> None:
        shared = getattr(record, "shared", None)
        if shared is None:
            return
        with self._lock:
            self._serial += 1
            self._exports[record.cache_id] = (self._serial, shared)

    def on_unregister(self, record) -> None:
        with self._lock:
            self._exports.pop(record.cache_id, None)

    def offer(self, session) -> Dict[str, Any]:
        if self.local_peer_refusal(session) is not None:
            return {}
        with self._lock:
            caches = [[cache_id, serial] for cache_id, (serial, _) in self._exports.items()]
        return {_FACTS: {"caches": caches, "proof_addr": self._proof.addr}}

    def requests(self) -> Dict[int, Any]:
        return {wire.OP_SHM_GET: self.serve_files}

    def serve_files(self, fd: int, req_id: int, length: int, peer) -> bool:
        """The server's handler of ``OP_SHM_GET`` ``{"caches": [cache id, ...]}``: the reply
        ``{"caches": [[cache id, export id, base address, file bytes], ...]}`` carries one file per
        listed cache that is shared now (others are left out), in that order; a peer that is not
        a proven process of this user on a Unix connection gets ``LLM_FEATURE_NOT_ENABLED`` and
        no file."""
        message, goes_on = server.read_control(fd, req_id, length, wire.OP_SHM, "shm request", _no_count, peer)
        if message is None:
            return goes_on
        wanted = message.get("caches")
        if not isinstance(wanted, list) or len(wanted) > MAX_FDS_PER_REQUEST \
                or not all(is_int(c, 1, 2**63 - 1) for c in wanted):
            raise ProtocolError("malformed shm request")
        refusal = self.local_peer_refusal(peer) or connection_refusal(fd, peer)
        proof = message.get("proof")
        if refusal is None and not (is_int(proof) and hmac.compare_digest(
                proof.to_bytes(8, "little"), self._proof.value.to_bytes(8, "little"))):
            refusal = "it did not read this process's memory (the kernel's ptrace rule keeps it out)"
        if refusal is not None:
            with self._lock:
                self.files_refused += 1
            return server.reply(fd, wire.OP_SHM, req_id, S.LLM_FEATURE_NOT_ENABLED,
                                wire.encode_json({"error": f"no shared memory for this peer: {refusal}"}))
        listed, files = [], []
        with self._lock:
            for cache_id in dict.fromkeys(wanted):
                export = self._exports.get(cache_id)
                if export is not None:
                    serial, shared = export
                    listed.append([cache_id, serial, shared.base, shared.size])
                    files.append(shared)  # held (its fd stays open) until sent
        payload = wire.encode_json({"caches": listed})
        data = wire.pack_header(wire.OP_SHM, req_id, len(payload), 0) + payload
        sent = send_with_files(fd, data, [shared.fd for shared in files])
        if sent:
            with self._lock:
                self.files_passed += len(files)
        return sent

    # -- the peer's side -----------------------------------------------------------------------
    @classmethod
    def parse_facts(cls, key: str, value: Any) -> "ShmFacts":
        return ShmFacts.parse(value)

    def link_state(self, session) -> "ShmLink":
        return ShmLink()

    def accept(self, session, peer_facts: Dict[str, Any], deadline: float) -> Optional[str]:
        refusal = self.local_peer_refusal(session)
        if refusal is not None:
            return refusal
        info = peer_facts.get(_FACTS) if isinstance(peer_facts, dict) else None
        if not isinstance(info, ShmFacts):
            return "the peer shares no memory with this process"
        cma = self._cma()
        if cma is None:
            return "no cma plane here"
        # cma's state for the link lives beside ours; this plane closes it.
        if session.plane_state.get(CMA) is None:
            state = cma.link_state(session)
            if state is not None:
                session.plane_state[CMA] = state
            reason = cma.accept(session, peer_facts, deadline)
            if reason is not None:
                session.release_plane(cma)
                return f"cma does not accept the link ({reason})"
        return None

    def table_is_current(self, session, table) -> bool:
        return self._cma().table_is_current(session, table)

    def on_table(self, session, table) -> None:
        """Drop the mappings of caches the peer no longer lists (or lists under a new export id)."""
        state = self.state(session)
        if state is None:
            return
        listed = _facts_of(session).caches
        with state.lock:
            for key in [k for k in state.maps if listed.get(k[0]) != k[1]]:
                del state.maps[key]
            state.spans = None

    def transfer(self, session, table, plan, write: bool, deadline: float) -> None:
        bad = table.ranges.first_outside(plan, write)
        if bad >= 0:
            raise fail(S.LLM_KV_CACHE_NOT_EXIST, f"descriptor {bad} names memory that cluster "
                                                 f"{session.cluster_id} has not registered")
        spans = self._spans(session, table, deadline)
        if spans[2]:
            try:
                moved = _core.translate_plan(plan, write, spans[2])
            except LLMException as exc:
                if exc.status_code != S.LLM_KV_CACHE_NOT_EXIST:
                    raise
                moved = None  # not wholly in mapped caches: cma moves it
            if moved is not None:
                # ``spans`` (held here) keeps the mappings alive until the copy is done, whatever
                # a concurrent close or refresh drops meanwhile.
                _core.execute(moved, self.engine.runtime, _core.MEMCPY_HOST_TO_HOST)
                return
        self._cma().transfer(session, table, plan, write, deadline)

    def _spans(self, session, table, deadline: float) -> Tuple[Any, Any, List[Tuple[int, int, int]], List[Any]]:
        """``(table, facts, spans, mappings)``: ``(peer address, bytes, address here)`` of every
        tensor of the caches of ``table`` that the peer shares, mapping what is not mapped yet."""
        state = self.state(session)
        if state is None:
            raise fail(S.LLM_LINK_FAILED, f"the link to cluster {session.cluster_id} is closed")
        facts = getattr(session, "facts", None)
        cached = state.spans
        if cached is not None and cached[0] is table and cached[1] is facts:
            return cached
        with state.lock:
            cached = state.spans
            if cached is not None and cached[0] is table and cached[1] is facts:
                return cached
            facts_here = _facts_of(session)
            listed = facts_here.caches
            wanted = [cache_id for cache_id, serial in listed.items()
                      if (cache_id, serial) not in state.maps and table.caches.get(cache_id) is not None]
            proof = 0
            if wanted and state.refusal is None:
                # What the owner asks for: the word at its proof address, which only a process that
                # may ptrace it can read.
                st, err, data = _io.cma_read_bytes(session.pid, facts_here.proof_addr, 8)
                if st != 0:
                    state.refusal = f"the owner's memory cannot be read ({os.strerror(err) if err else 'failed'})"
                proof = int.from_bytes(data, "little") if st == 0 else 0
            for at in range(0, len(wanted) if state.refusal is None else 0, MAX_FDS_PER_REQUEST):
                try:
                    files = fetch_files(session, wanted[at:at + MAX_FDS_PER_REQUEST], deadline, proof)
                except LLMException as exc:
                    if exc.status_code != S.LLM_FEATURE_NOT_ENABLED:
                        raise
                    state.refusal = str(exc)  # the owner passes this link no files: all through cma
                    break
                for mapped in files:
                    if listed.get(mapped.cache_id) == mapped.serial:
                        state.maps[(mapped.cache_id, mapped.serial)] = mapped
            spans, held = [], []
            for (cache_id, serial), mapped in state.maps.items():
                cache = table.caches.get(cache_id)
                if cache is None or listed.get(cache_id) != serial or not cache.host_addressable:
                    continue
                size = cache.tensor_bytes
                inside = [addr - mapped.base for addr in cache.addrs]
                if any(offset < 0 or offset + size > mapped.size for offset in inside):
                    raise fail(S.LLM_LINK_FAILED, f"cluster {session.cluster_id} listed cache {cache_id} "
                                                  f"outside the memory it shared")
                spans.extend((addr, size, mapped.local + offset) for addr, offset in zip(cache.addrs, inside))
                held.append(mapped)
            state.spans = (table, facts, spans, held)
            return state.spans

    def block_route(self, session, table, remote_layout, local_layout, write: bool, timeout_ms: int = -1,
                    on_broken=None):
        """A ``_io.MappedRoute`` (memcpy into the mapped file) towards a cache the peer shares;
        cma's route towards any other."""
        state = self.state(session)
        cma_state = session.plane_state.get(CMA)
        counter = None if cma_state is None else cma_state.generation
        view = None if counter is None else counter.view
        if state is None or view is None or session.closed or session.table is not table:
            return None
        try:
            _, _, _, held = self._spans(session, table, dl.after(timeout_ms if timeout_ms > 0 else 5000))
        except LLMException:
            return None
        for mapped in held:
            cache = table.caches.get(mapped.cache_id)
            if cache is not None and cache.layout is remote_layout:
                try:
                    route = _io.MappedRoute(session, view, table.generation, local_layout, remote_layout, write,
                                            mapped, mapped.base, mapped.local, mapped.size)
                except ValueError:
                    return None
                with state.lock:
                    state.routes.add(route)
                if session.closed:  # the link ended meanwhile: its close may have run before the add
                    route.close()
                    return None
                return route
        return self._cma().block_route(session, table, remote_layout, local_layout, write, timeout_ms, on_broken)

    def close(self, session) -> None:
        """Drop the mappings (a copy still running keeps the ones it uses until it is done), close
        the link's routes and cma's state for the link."""
        state = self.state(session)
        if state is not None:
            with state.lock:
                state.maps = {}
                state.spans = None
                routes, state.routes = list(state.routes), weakref.WeakSet()
            for route in routes:
                route.close()
        cma = self._cma()
        if cma is not None and session.plane_state.get(CMA) is not None:
            session.release_plane(cma)


@dataclass(frozen=True)
class ShmFacts:
    """The peer's ``shm`` entry (``ShmPlane.offer``), checked: its shared caches, cache id ->
    export id; ``proof_addr``: where in the peer the word its file requests must carry lies."""

    caches: Dict[int, int]
    proof_addr: int = 0

    @classmethod
    def parse(cls, value: Any) -> "ShmFacts":
        """ProtocolError unless ``value`` is ``{"caches": [[cache id, export id], ...],
        "proof_addr": address}`` of at most ``MAX_SHARED_CACHES`` positive cache ids, each listed
        once, and 63-bit export ids."""
        entries = value.get("caches") if isinstance(value, dict) else None
        if not isinstance(entries, list) or len(entries) > MAX_SHARED_CACHES or not is_int(value.get("proof_addr"), 1):
            raise ProtocolError("malformed shm entry")
        caches: Dict[int, int] = {}
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 2 and is_int(entry[0], 1, 2**63 - 1)
                    and is_int(entry[1], 0, 2**63 - 1)) or entry[0] in caches:
                raise ProtocolError("malformed shm cache entry")
            caches[entry[0]] = entry[1]
        return cls(caches, value["proof_addr"])


_NO_FACTS = ShmFacts({})


def _facts_of(session) -> ShmFacts:
    facts = getattr(session, "facts", None)
    info = facts.get(_FACTS) if isinstance(facts, dict) else None
    return info if isinstance(info, ShmFacts) else _NO_FACTS


@dataclass(eq=False)
class ShmLink:
    """shm's state for one link: the peer's files mapped here by (cache id, export id), the
    spans of the current table (``(table, facts, spans, mappings)`` or None) and the block routes
    made for the link (closed with it); ``lock`` guards them."""

    maps: Dict[Tuple[int, int], MappedCache] = field(default_factory=dict)
    spans: Optional[Tuple[Any, Any, List[Tuple[int, int, int]], List[MappedCache]]] = None
    routes: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)
    #: Why the owner refused to pass files on this link (its transfers then all take cma), or None.
    refusal: Optional[str] = None
    lock: threading.Lock = field(default_factory=threading.Lock)
