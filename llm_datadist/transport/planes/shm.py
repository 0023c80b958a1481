"""``shm``: caches the peer allocated (``allocate_cache`` / ``allocate_blocks_cache``) mapped into
this process, moved with memcpy on the caller's thread; everything else of the link as ``cma``.

The owner allocates each such cache in a memfd of its own (``engine.shared_memory``: one sealed
file per cache, never shared by two caches or reused by a later allocation) and lists those
caches in its table reply, with an export id new for every registration, only to a peer that
``local_peer_refusal`` passes: a process of this host whose pid and uid the kernel proved
(``SO_PEERCRED``), of this user, not this one, offering the plane. The peer asks for the files it
needs (``OP_SHM_GET``, on its own Unix connection of the link); the owner checks the asker again
on that very connection (``SO_PEERCRED``, and ``local_peer_refusal``) and passes the files in the
reply (``SCM_RIGHTS``; never over TCP: a TCP connection carries no descriptors and is refused).
The peer checks each file (a memfd sealed against shrinking, as large as the owner says, every
tensor of the table inside it), maps it once, and keeps the mapping per (cache, export id) in its
link state; a table that no longer lists it (the cache left the owner's registry: unregistered,
deallocated) or the end of the link drops the mapping.

The registry generation rules are cma's (this plane accepts a link only where cma does, and uses
cma's mapped generation counter): before each transfer the peer's generation is compared with the
table's, and a changed registry makes the manager refresh the table and plan again. A transfer
whose remote side lies in a mapped cache is range-checked against the table and translated into
the mapping, then copied with memcpy; any other (memory the peer registered from numpy or torch)
goes through cma. A peer that keeps a mapping after the owner dropped the cache reaches only that
cache's old file: the owner's later allocations are new files.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import select
import socket
import stat
import threading
import time
import weakref
from array import array
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from llm_datadist import _core, _io
from llm_datadist.status import LLMException
from llm_datadist.transport import deadline as dl
from llm_datadist.transport import session as _session
from llm_datadist.transport import server, wire
from llm_datadist.transport.errors import S, ProtocolError, fail, is_int
from llm_datadist.transport.planes import register
from llm_datadist.transport.planes.base import DataPlane

_FACTS = "shm"
#: The plane whose checks, generation counter and copies this one uses for the rest of a link.
CMA = "cma"
#: At most this many caches are read from a peer's ``shm`` entry.
MAX_SHARED_CACHES = 1 << 16
#: At most this many files are asked for (and passed) in one ``OP_SHM_GET`` (the kernel passes at
#: most 253 descriptors in one message).
MAX_FDS_PER_REQUEST = 200
#: The seal a mapped file must carry: a file the owner could shrink would fault our loads (SIGBUS).
_SEALS_NEEDED = fcntl.F_SEAL_SHRINK if hasattr(fcntl, "F_SEAL_SHRINK") else 0


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

    def counters(self) -> Dict[str, int]:
        return {"shm_files_passed": self.files_passed, "shm_requests_refused": self.files_refused}

    @classmethod
    def probe(cls) -> Tuple[bool, str]:
        from llm_datadist.transport.planes.cma import probe_same_host  # the same reach as cma
        if not hasattr(os, "memfd_create") or not _SEALS_NEEDED:
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
        return {_FACTS: {"caches": caches}}

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
        refusal = self.local_peer_refusal(peer) or _connection_refusal(fd, peer)
        if refusal is not None:
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
        sent = _send_with_files(fd, data, [shared.fd for shared in files])
        self.files_passed += len(files) if sent else 0
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
            listed = _facts_of(session).caches
            wanted = [cache_id for cache_id, serial in listed.items()
                      if (cache_id, serial) not in state.maps and table.caches.get(cache_id) is not None]
            for at in range(0, len(wanted) if state.refusal is None else 0, MAX_FDS_PER_REQUEST):
                try:
                    files = fetch_files(session, wanted[at:at + MAX_FDS_PER_REQUEST], deadline)
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
    export id."""

    caches: Dict[int, int]

    @classmethod
    def parse(cls, value: Any) -> "ShmFacts":
        """ProtocolError unless ``value`` is ``{"caches": [[cache id, export id], ...]}`` of at
        most ``MAX_SHARED_CACHES`` positive cache ids, each listed once, and 63-bit export ids."""
        entries = value.get("caches") if isinstance(value, dict) else None
        if not isinstance(entries, list) or len(entries) > MAX_SHARED_CACHES:
            raise ProtocolError("malformed shm entry")
        caches: Dict[int, int] = {}
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 2 and is_int(entry[0], 1, 2**63 - 1)
                    and is_int(entry[1], 0, 2**63 - 1)) or entry[0] in caches:
                raise ProtocolError("malformed shm cache entry")
            caches[entry[0]] = entry[1]
        return cls(caches)


_NO_FACTS = ShmFacts({})


def _facts_of(session) -> ShmFacts:
    facts = getattr(session, "facts", None)
    info = facts.get(_FACTS) if isinstance(facts, dict) else None
    return info if isinstance(info, ShmFacts) else _NO_FACTS


class MappedCache:
    """One file of the peer mapped here: ``cache_id``, ``serial`` (export id), ``base`` (where
    the owner maps it), ``size``, ``local`` (where it is mapped here). The mapping goes when the
    last reference does."""

    __slots__ = ("cache_id", "serial", "base", "size", "local", "_view")

    def __init__(self, cache_id: int, serial: int, base: int, size: int, fd: int) -> None:
        self.cache_id, self.serial, self.base, self.size = cache_id, serial, base, size
        self._view = np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8)
        self.local = int(self._view.ctypes.data)


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


# -- the request and its descriptors ----------------------------------------------------------------

def _connection_refusal(fd: int, peer) -> Optional[str]:
    """Why the connection ``fd`` is not the peer's proven Unix connection (None if it is)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError as exc:
        return f"the connection is gone ({exc})"
    try:
        if sock.family != socket.AF_UNIX:
            return "the request came over TCP"
        pid, uid = _session.peer_credentials(sock)
    except OSError as exc:
        return f"the connection's credentials cannot be read ({exc})"
    finally:
        sock.close()
    if (pid, uid) != (peer.pid, peer.uid) or uid != os.geteuid():
        return f"the connection is of pid {pid}, uid {uid}"
    return None


def _send_with_files(fd: int, data: bytes, files: List[int]) -> bool:
    """Send ``data`` on ``fd`` with ``files`` attached to its first byte; whether all went out."""
    sock = socket.socket(fileno=os.dup(fd))
    deadline = time.monotonic() + _session.FRAME_TIMEOUT_MS / 1000
    try:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", files))] if files else []
        while True:
            try:
                sent = sock.sendmsg([data], ancillary, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
                break
            except (BlockingIOError, InterruptedError):
                if not _wait(sock, select.POLLOUT, deadline):
                    return False
    except OSError:
        return False
    finally:
        sock.close()
    if sent < len(data):
        st, _ = _io_send(fd, data[sent:])
        return st == 0
    return True


def _io_send(fd: int, data: bytes):
    return _io.send_bytes(fd, data, _session.FRAME_TIMEOUT_MS)


def _wait(sock: socket.socket, events: int, deadline: float) -> bool:
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    poller = select.poll()
    poller.register(sock, events)
    poller.poll(max(1, int(left * 1000)))
    return True


def fetch_files(session, cache_ids: List[int], deadline: float) -> List[MappedCache]:
    """Ask the peer of ``session`` for the files of ``cache_ids`` on the link's outgoing Unix
    connection and map each; what the peer left out is not returned. ``LLM_LINK_FAILED`` for a
    reply that breaks the protocol (the connection is dropped), ``LLM_FEATURE_NOT_ENABLED`` when
    the peer refuses."""
    channel = session.outgoing
    if channel is None:
        raise fail(S.LLM_LINK_FAILED, f"the link to cluster {session.cluster_id} is closed")
    what = "shared memory request"
    payload = wire.encode_json({"caches": list(cache_ids)})
    files: List[int] = []
    try:
        with channel.lock:
            req_id = channel.next_request_id()
            st, _ = _io.send_bytes(channel.fd, wire.pack_header(wire.OP_SHM_GET, req_id, len(payload)) + payload,
                                   dl.left_ms(deadline))
            if st != 0:
                raise channel.fault(st, what)
            header = _recv_with_files(channel, wire.HEADER_BYTES, len(cache_ids), files, deadline, what)
            channel.header[:] = header
            status, length = channel.check_reply(wire.OP_SHM, req_id, what)
            if length > wire.MAX_CONTROL_BYTES:
                raise channel.fault(S.LLM_LINK_FAILED, f"{what}: oversized reply of {length} bytes")
            st, body = _session.read_body(channel.fd, length, dl.left_ms(deadline))
            if st != 0:
                raise channel.fault(st, what)
        try:
            reply = wire.decode_json(body) if body else {}
        except ProtocolError as exc:
            raise fail(S.LLM_LINK_FAILED, f"{what}: {exc}") from None
        if status != 0:
            raise fail(status, f"cluster {session.cluster_id} refused the {what}: "
                               f"{str(reply.get('error', ''))[:200]}")
        listed = reply.get("caches")
        if not isinstance(listed, list) or len(listed) != len(files) or not all(
                isinstance(e, list) and len(e) == 4 and e[0] in cache_ids and all(is_int(x, 0, 2**64 - 1) for x in e)
                for e in listed):
            raise fail(S.LLM_LINK_FAILED, f"cluster {session.cluster_id} sent a malformed {what} reply")
        return [_map_file(session, entry, fd) for entry, fd in zip(listed, files)]
    finally:
        for fd in files:
            os.close(fd)


def _map_file(session, entry: List[int], fd: int) -> MappedCache:
    """Map one file the peer passed, after checking it is a memfd sealed against shrinking that
    holds the bytes it says."""
    cache_id, serial, base, size = entry
    try:
        info = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise fail(S.LLM_LINK_FAILED,
                   f"cluster {session.cluster_id} passed a file that is not a memfd ({exc})") from None
    if not stat.S_ISREG(info.st_mode) or info.st_size != size or size <= 0 or not seals & _SEALS_NEEDED:
        raise fail(S.LLM_LINK_FAILED, f"cluster {session.cluster_id} passed a file for cache {cache_id} that "
                                      f"is not a sealed memfd of {size} bytes")
    try:
        return MappedCache(cache_id, serial, base, size, fd)
    except (OSError, ValueError) as exc:
        raise fail(S.LLM_LINK_FAILED,
                   f"mapping cache {cache_id} of cluster {session.cluster_id} failed: {exc}") from None


def _recv_with_files(channel, nbytes: int, max_files: int, files: List[int], deadline: float, what: str) -> bytes:
    """Receive exactly ``nbytes`` on the channel, collecting the descriptors that come with them
    into ``files`` (the caller closes them); at most ``max_files`` are accepted."""
    sock = socket.socket(fileno=os.dup(channel.fd))
    got = bytearray()
    room = socket.CMSG_SPACE(max(1, max_files) * array("i").itemsize)
    try:
        while len(got) < nbytes:
            try:
                data, ancillary, flags, _ = sock.recvmsg(nbytes - len(got), room,
                                                         socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
            except (BlockingIOError, InterruptedError):
                if not _wait(sock, select.POLLIN, deadline):
                    raise channel.fault(S.LLM_TIMEOUT, what) from None
                continue
            except OSError:
                raise channel.fault(S.LLM_LINK_FAILED, what) from None
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    passed = array("i")
                    passed.frombytes(payload[:len(payload) - len(payload) % passed.itemsize])
                    files.extend(passed)
            if flags & socket.MSG_CTRUNC or len(files) > max_files:
                raise channel.fault(S.LLM_LINK_FAILED, f"{what}: more descriptors than asked for")
            if not data:
                raise channel.fault(S.LLM_LINK_FAILED, what)
            got += data
    finally:
        sock.close()
    return bytes(got)
