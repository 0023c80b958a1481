"""A link's state on this side (``Link``): its connections (``Channel``, the peer's ``incoming``
ones), what the kernel proved about the peer, the data planes chosen and their per-link state
objects (``Link.plane_state``), its shares of the process's budgets (``Link.shares``), the one
frame reader every part of the transport uses (and ``receive_steadily`` for bodies that hold a
budget), and the link's worker threads for striped transfers.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from llm_datadist import _io
from llm_datadist.status import LLMException
from llm_datadist.transport import deadline as dl
from llm_datadist.transport import budgets, wire
from llm_datadist.transport.errors import S, ProtocolError, StaleTable, fail, status_of
from llm_datadist.transport.table import RemoteTable

#: How long a started frame may take to arrive whole (and a reply to be sent), on the serving
#: side; also how long closing a connection waits for the transfer using it.
FRAME_TIMEOUT_MS = 30000
#: Connections per direction of a link (the first also carries control messages).
CONNECTIONS_PER_DIRECTION = 2
#: Most data connections a client may ask for, per direction.
MAX_CONNECTIONS = 4
#: Most threads one striped transfer runs on (the calling one included).
MAX_STRIPES = MAX_CONNECTIONS


# -- the frame reader ---------------------------------------------------------------------------
def read_header(fd: int, header: bytearray, timeout_ms: int, spin: int = _io.SPIN_REPLY) -> int:
    """Receive one frame header into ``header`` (``wire.HEADER_BYTES``); the receive status (0:
    all of it; ``timeout_ms`` < 0 waits for ever). ``wire.unpack_header(header)`` reads it.
    ``spin``: what the frame is (``_io.recv_into``), a reply by default."""
    return _io.recv_into(fd, header, timeout_ms, spin)[0]


def read_body(fd: int, length: int, timeout_ms: int, spin: int = _io.SPIN_REPLY) -> Tuple[int, bytearray]:
    """Receive the ``length`` bytes of a frame body: ``(status, body)``. The caller checks
    ``length`` against its limit first."""
    body = bytearray(length)
    if length:
        st = _io.recv_into(fd, body, timeout_ms, spin)[0]
        if st != 0:
            return st, body
    return 0, body


def receive_steadily(receive: Callable[[int, int], Tuple[int, int, int]], deadline: float) -> Tuple[int, int, int]:
    """Receive a body that holds a budget and so must keep arriving (``budgets.stall_ms``):
    ``receive(done, timeout_ms)`` receives the rest of it after its first ``done`` bytes and
    returns ``(status, errno, got)`` as ``_io``'s receives do; it is called once per stall window
    (never past ``deadline``). A window that brings neither the rest nor
    ``budgets.least_per_window`` bytes ends the body with ``LLM_TIMEOUT``, as ``deadline`` does:
    ``(status, errno, received)``."""
    window_ms = budgets.stall_ms()
    least = budgets.least_per_window(window_ms)
    done = 0
    while True:
        st, err, got = receive(done, min(window_ms, dl.left_ms(deadline)))
        done += got
        if st != S.LLM_TIMEOUT or got < least or dl.expired(deadline):
            return st, err, done


def read_body_steadily(fd: int, length: int, deadline: float) -> Tuple[int, bytearray]:
    """``read_body`` for a body that holds a budget (``receive_steadily``): ``(status, body)``,
    ``LLM_TIMEOUT`` for one that stalled or ran past ``deadline``."""
    body = bytearray(length)
    if not length:
        return 0, body
    view = memoryview(body)
    try:
        st, _, _ = receive_steadily(lambda done, timeout_ms: _io.recv_into(fd, view[done:], timeout_ms), deadline)
    finally:
        view.release()
    return st, body


def discard_steadily(fd: int, length: int, deadline: float) -> int:
    """Read and drop a body that must keep arriving as ``receive_steadily`` says (a refused
    control request): the status."""
    return receive_steadily(lambda done, timeout_ms: _io.recv_discard(fd, length - done, timeout_ms), deadline)[0]


class Workers:
    """The threads of one link that run the extra shares of its striped transfers: started on
    the first striped transfer, reused by the next ones, gone with the link."""

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        self._closed = False

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> List[Any]:
        """``fn(item)`` for every item, the first on the calling thread and the others on the
        link's workers; the results in order, an exception standing as the result of its item."""
        futures = []
        pool = self._get()
        for item in items[1:]:
            try:
                futures.append(pool.submit(fn, item) if pool is not None else None)
            except RuntimeError:  # closed meanwhile: run it here
                futures.append(None)
        results: List[Any] = [_call(fn, items[0])]
        for item, future in zip(items[1:], futures):
            if future is None:
                results.append(_call(fn, item))
                continue
            try:
                results.append(future.result())
            except BaseException as exc:  # noqa: BLE001 - the share's failure is its result
                results.append(exc)
        return results

    def _get(self) -> Optional[ThreadPoolExecutor]:
        with self._lock:
            if self._pool is None and not self._closed:
                self._pool = ThreadPoolExecutor(max_workers=MAX_STRIPES - 1,
                                                thread_name_prefix="llm_datadist-stripe")
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=False)


def _call(fn: Callable[[Any], Any], item: Any) -> Any:
    try:
        return fn(item)
    except BaseException as exc:  # noqa: BLE001 - returned to Workers.map's caller
        return exc


class Channel:
    """One connection on which this side sends requests and reads replies, one at a time;
    ``shares``: its link's shares of the process's budgets (``Link.shares``), which the replies
    it reads and the staged payloads it moves count against."""

    def __init__(self, sock: socket.socket, peer_name: str, shares: Optional[budgets.LinkShares] = None) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.peer_name = peer_name
        self.shares = shares if shares is not None else budgets.LinkShares()
        self.lock = threading.Lock()
        self.broken: Optional[str] = None
        self._next_id = 1
        self.header = bytearray(wire.HEADER_BYTES)

    def close(self) -> None:
        if self.broken is None:
            self.broken = "closed"
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a transfer waiting on it
        except OSError:
            pass
        # Close the descriptor only once no transfer is using it, so that its number is not
        # reused under a thread still polling it.
        if self.lock.acquire(timeout=FRAME_TIMEOUT_MS / 1000):
            try:
                self.sock.close()
            finally:
                self.lock.release()

    def fault(self, code: int, what: str) -> LLMException:
        """The connection failed in the middle of a frame: the stream is out of step, so it is
        dropped; the exception to raise."""
        self.broken = what
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if code == S.LLM_TIMEOUT:
            return fail(code, f"{what}: no answer from {self.peer_name} in time (the link must be "
                              f"rebuilt: unlink, then link again)")
        return fail(S.LLM_LINK_FAILED if code != S.LLM_PARAM_INVALID else code,
                    f"{what}: connection to {self.peer_name} failed (status {status_of(code).name})")

    def next_request_id(self) -> int:
        """The id of a new request (lock held); LLMException if the connection is broken."""
        if self.broken is not None:
            raise LLMException(f"the link to {self.peer_name} is broken ({self.broken}); unlink and "
                               f"link again", status_code=S.LLM_LINK_FAILED)
        req_id = self._next_id
        self._next_id += 1
        return req_id

    def read_reply(self, expect: int, req_id: int, deadline: float, what: str,
                   spin: int = _io.SPIN_REPLY) -> Tuple[int, int]:
        """``(status, payload length)`` of the reply ``expect`` to request ``req_id`` (lock held);
        ``spin``: the kind of wait (``_io.recv_into``)."""
        st = read_header(self.fd, self.header, dl.left_ms(deadline), spin)
        if st != 0:
            raise self.fault(st, what)
        return self.check_reply(expect, req_id, what)

    def check_reply(self, expect: int, req_id: int, what: str) -> Tuple[int, int]:
        """``(status, payload length)`` of the reply header in ``self.header``, which must be
        ``expect`` to request ``req_id`` (lock held); else the connection is dropped and the
        exception raised (``fault``)."""
        try:
            op, status, rid, length = wire.unpack_header(self.header)
        except ProtocolError as exc:
            raise self.fault(S.LLM_LINK_FAILED, f"{what}: {exc}") from None
        if op != expect or rid != req_id:
            raise self.fault(S.LLM_LINK_FAILED, f"{what}: unexpected reply {wire.OP_NAMES[op]}")
        return status, length

    def control(self, op: int, reply_op: int, message: Dict[str, Any], timeout_ms: int, what: str,
                limit: int = wire.MAX_CONTROL_BYTES,
                on_oversized: Optional[Callable[[], Any]] = None) -> Tuple[int, Dict[str, Any]]:
        """Send a JSON request, return ``(status, reply JSON)``. A reply longer than ``limit``
        is not read: the connection is dropped (``on_oversized()`` is called first) and
        ``LLM_LINK_FAILED`` raised. The reply is read and parsed within the process's parsing
        budget and the link's share of it (``budgets.parsing``, ``shares``), waiting for room
        until the deadline; a reply that stalls (``receive_steadily``) gives its bytes back at
        once, the connection is dropped and ``LLM_TIMEOUT`` raised."""
        payload = wire.encode_json(message)
        deadline = dl.after(timeout_ms)
        share = self.shares.parsing
        with self.lock:
            req_id = self.next_request_id()
            st, _ = _io.send_bytes(self.fd, wire.pack_header(op, req_id, len(payload)) + payload,
                                       dl.left_ms(deadline))
            if st != 0:
                raise self.fault(st, what)
            # (no receive spin: the peer answers a JSON request from Python, as a handshake, and
            # misses there would turn spinning off for the link's transfers: ``_io.SPIN_OFF``)
            status, length = self.read_reply(reply_op, req_id, deadline, what, _io.SPIN_OFF)
            if length > limit:
                if on_oversized is not None:
                    on_oversized()
                raise self.fault(S.LLM_LINK_FAILED, f"{what}: oversized reply of {length} bytes (at most {limit})")
            budget = budgets.parsing()
            blocked = budget.take(length, max(0.0, dl.left_ms(deadline) / 1000), share)
            if blocked is not None:
                raise self.fault(S.LLM_TIMEOUT, f"{what}: no room to parse the reply in time (the {blocked}'s "
                                                f"bound of the parsing budget, {budgets.MAX_PARSING_BYTES_ENV})")
            try:
                st, body = read_body_steadily(self.fd, length, deadline)
                if st != 0:
                    if st == S.LLM_TIMEOUT and not dl.expired(deadline):
                        budget.note_stall(f"a reply of {length} bytes ({what})", self.peer_name)
                    raise self.fault(st, what)
            except BaseException:
                budget.release(length, share)
                raise
        try:
            return status, wire.decode_json(body) if body else {}
        except ProtocolError as exc:
            raise self.fault(S.LLM_LINK_FAILED, f"{what}: {exc}") from None
        finally:
            del body
            budget.release(length, share)

    def refused(self, status: int, what: str, side: str) -> None:
        """Raise for the peer's refusal of a transfer (StaleTable for a stale table)."""
        if status == wire.STATUS_STALE_TABLE:
            raise StaleTable()
        if status != 0:
            raise fail(status, f"{what} refused by {self.peer_name}: {status_of(status).name} (a "
                               f"{side} range is not registered there"
                               f"{', or its read guard does not let this pull read it' if what == 'pull' else ''})")


@dataclass(eq=False)
class Link:
    """A link as this side holds it: the state of this cluster's link to one other cluster (or one
    being made), whichever side asked for it."""

    cluster_id: int
    role: str
    is_client: bool
    address: Tuple[str, int]
    planes: List[str]    # the planes the peer named in its link request or reply
    unix: bool = False   # the data connections are Unix-domain sockets (this host, this netns)
    pid: int = 0         # proven by SO_PEERCRED on the Unix connections; 0 = not proven
    uid: int = -1
    # The (pid, uid) the peer stated in its link request or reply (signed with a secret): its
    # Unix connections must come from exactly that process (``handshake.check_process``).
    stated: Tuple[int, int] = (0, -1)
    # Server side: the linking process shares this host and wants Unix sockets (as its own
    # ``handshake.request_link`` decides), so every data connection of the link must be one.
    expect_unix: bool = False
    # The link was authenticated with a secret: this side has one (so the handshake of every
    # connection of the link required the peer's proof of it and verified it). Set at link time
    # from this side's own configuration, never from anything the peer sends.
    authenticated: bool = False
    # The link's protection (``protection``: "off", "integrity", "encrypt"), agreed at link time;
    # its TCP connections are sealed by relays (``channels``/``incoming`` hold their inner ends).
    protection: str = "off"
    protection_suite: Optional[str] = None  # its record suite ("aes-256-gmac", ...), None when off
    link_digest: bytes = b""  # ``protection.link_digest`` of its link request and reply, as this side holds them
    token: str = ""
    want: Tuple[int, int] = (CONNECTIONS_PER_DIRECTION, CONNECTIONS_PER_DIRECTION)  # forward, reverse
    ready: bool = False
    plane: Any = None    # the DataPlane of this side's transfers, chosen with the first table
    table: Optional[RemoteTable] = None
    # The entries of the peer's last table reply the planes read (``DataPlane.facts_keys``), by
    # key, each as its plane parsed it (``DataPlane.parse_facts``: typed, bounded, checked).
    facts: Dict[str, Any] = field(default_factory=dict)
    # The device planes of this side's transfers with device memory on either side, by
    # (local side is device memory, remote side is device memory), chosen on first use; and the
    # planes accepted for them besides ``plane`` (closed with the link).
    device_planes: Dict[Tuple[bool, bool], Any] = field(default_factory=dict)
    extra_planes: List[Any] = field(default_factory=list)
    channels: List[Channel] = field(default_factory=list)        # this side's requests
    incoming: List[socket.socket] = field(default_factory=list)  # the peer's requests
    # Each plane's state for this link, by plane name (``DataPlane.link_state``): made just
    # before the plane's accept, dropped (``release_plane``) when it refuses and when the link
    # ends -- by whoever closes the plane last, so that a plane still accepting while the link
    # closes finds its state to release.
    plane_state: Dict[str, Any] = field(default_factory=dict)
    closed: bool = False
    unlinking: bool = False  # this side is unlinking it: its connections closing is no loss
    unlinked_by_peer: bool = False  # the peer unlinked it (its own unlink then succeeds too)
    comm: Optional[Tuple[str, str]] = None  # the two-sided link (name, digest) it was made for
    source: Any = None   # server side: where its link request came from (``sockets.source_of``)
    # Its shares of the process's parsing and staging budgets, under its source (server side) or
    # the address it was made to (client side); set by the link manager as the link is made.
    shares: budgets.LinkShares = field(default_factory=budgets.LinkShares)
    table_lock: threading.Lock = field(default_factory=threading.Lock)
    settle_lock: threading.Lock = field(default_factory=threading.Lock)
    workers: Workers = field(default_factory=Workers)

    @property
    def outgoing(self) -> Optional[Channel]:
        return self.channels[0] if self.channels else None

    @property
    def plane_name(self) -> Optional[str]:
        return None if self.plane is None else self.plane.name

    def broken(self) -> Optional[str]:
        for channel in self.channels:
            if channel.broken is not None:
                return channel.broken
        return None

    def hung_up(self) -> bool:
        """Whether any connection of the link has been closed or reset by the other end (or
        by us): such a link is dead and may be replaced."""
        if self.closed or self.broken() is not None:
            return True
        socks = [c.sock for c in self.channels] + list(self.incoming)
        flags = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0x2000)
        poller = select.poll()
        try:
            for sock in socks:
                poller.register(sock.fileno(), flags)
        except (OSError, ValueError):
            return True
        return any(event & flags for _, event in poller.poll(0))

    def release_plane(self, plane: Any) -> None:
        """Let ``plane`` release what it holds for this link, then drop its state object."""
        plane.close(self)
        self.plane_state.pop(plane.name, None)

    def close(self) -> None:
        self.closed = True
        if self.plane is not None:
            self.release_plane(self.plane)
        for plane in list(self.extra_planes):
            self.release_plane(plane)
        self.workers.close()
        for channel in list(self.channels):
            channel.close()
        for sock in list(self.incoming):
            try:
                sock.shutdown(socket.SHUT_RDWR)  # its serving thread closes it
            except OSError:
                pass


_UCRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> Tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of a Unix socket, as the kernel has them."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, _ = _UCRED.unpack(data)
    return pid, uid
