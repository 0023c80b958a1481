"""Links between clusters: the listeners, the handshake, per-peer state and the data planes.

A link between a client (the side calling ``link_clusters``) and a server (the side with
``listen_ip_info``) is made of connections that the client opens:

* a *link* connection to the server's TCP listener, used for the handshake only: both sides
  prove knowledge of the link secret when one is set (``auth``), then the server answers with a
  one-time token and the abstract name of its Unix socket;
* *forward* connections (the client's requests, served by server threads) and *reverse*
  connections (the server's requests, served by client threads), each authenticated the same way
  and bound to the link by the token. On this host (same kernel, PID and network namespace) they
  are Unix-domain sockets, so that the kernel tells each side the other's pid and uid
  (``SO_PEERCRED``); otherwise TCP.

Nothing about this process (pid, tables, addresses) is sent before the peer has authenticated,
and nothing the peer claims about itself is trusted: each side fetches the other's cache table
over its own connections of the link and picks the plane of its own transfers:

* ``cma`` (same host): the peer's memory is read or written directly with
  ``process_vm_readv``/``process_vm_writev``, planned and range-checked against the table the
  peer sent over a Unix connection. Chosen only towards a pid the kernel proved, that is not this
  process, of this user, offering ``cma``, and whose memory a probe read reaches;
* ``tcp`` (every other case): frames on the connections, the payload scatter/gathered straight
  from and into cache memory; the side that owns the memory checks every range against its own
  registry before a byte moves.

The option ``llm.DataPlane`` (or the environment variable ``LLM_DATADIST_DATA_PLANE``) forces
``cma`` or ``tcp`` (``tcp`` also keeps the connections on TCP); ``auto`` is the default.

A connection that closes or breaks ends its whole link on both sides (``lost_links`` says why);
a new link from a cluster that is still linked is refused unless the old link's connections
are already closed. The listeners survive transient ``accept()`` failures, and handshakes,
links and threads are bounded (``LLM_DATADIST_MAX_PENDING_HANDSHAKES``,
``LLM_DATADIST_MAX_LINKS``, ``LLM_DATADIST_HANDSHAKE_TIMEOUT_MS``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from llm_datadist import _core, _planes
from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.transport import auth, wire
from llm_datadist.transport.comms import Comm
from llm_datadist.transport.host import host_identity, same_host
from llm_datadist.transport.shm import PeerCounter
from llm_datadist.transport.table import RemoteTable
from llm_datadist.transport.wire import ProtocolError

logger = logging.getLogger("llm_datadist")

PLANES = ("auto", "cma", "tcp")
DATA_PLANE_OPTION = "llm.DataPlane"
DATA_PLANE_ENV = "LLM_DATADIST_DATA_PLANE"
#: How long an accepted connection may take over its whole handshake (idle or unauthenticated
#: connections are closed then), and a started frame to arrive whole.
DEFAULT_HANDSHAKE_TIMEOUT_MS = 5000
HANDSHAKE_TIMEOUT_ENV = "LLM_DATADIST_HANDSHAKE_TIMEOUT_MS"
FRAME_TIMEOUT_MS = 30000
#: Connections accepted but not yet through their handshake; more are closed at once.
DEFAULT_MAX_PENDING = 64
MAX_PENDING_ENV = "LLM_DATADIST_MAX_PENDING_HANDSHAKES"
#: Links a cluster holds (each costs a thread per incoming connection, two by default).
DEFAULT_MAX_LINKS = 256
MAX_LINKS_ENV = "LLM_DATADIST_MAX_LINKS"
#: Largest handshake message (hello, challenge, authentication, reply).
MAX_HANDSHAKE_BYTES = 64 << 10
#: Most data connections a client may ask for, per direction.
MAX_CONNECTIONS = 4
#: How long ``close`` (finalize) waits for each peer to acknowledge its unlink.
FINALIZE_UNLINK_MS = 500
#: Lost links remembered for ``lost_links``.
MAX_LOST_RECORDS = 1024
#: Transfers of at least this many bytes on the same-host plane are split over two threads.
PARALLEL_CMA_BYTES = 8 << 20
#: TCP transfers of at least this many bytes are split over the link's data connections.
PARALLEL_TCP_BYTES = 8 << 20
#: Connections per direction of a link (the first also carries control messages).
CONNECTIONS_PER_DIRECTION = 2

S = LLMStatusCode


def _status(code: int) -> LLMStatusCode:
    try:
        return LLMStatusCode(code)
    except ValueError:
        return S.LLM_FAILED


def _fail(code: int, message: str) -> LLMException:
    return LLMException(message, status_code=_status(code))


def resolve_plane(options: Dict[str, str]) -> str:
    value = options.get(DATA_PLANE_OPTION) or os.environ.get(DATA_PLANE_ENV) or "auto"
    value = value.strip().lower()
    if value not in PLANES:
        raise LLMException(f"{DATA_PLANE_OPTION} must be one of {', '.join(PLANES)}, got {value!r}",
                           status_code=S.LLM_PARAM_INVALID)
    return value


class _MutualLink(Exception):
    """The peer is linking to this cluster at the same time, and its link is the one kept."""


class _StaleTable(Exception):
    """The peer's registry changed since its table was fetched: refresh and plan again."""


class Channel:
    """One connection on which this side sends requests and reads replies, one at a time."""

    def __init__(self, sock: socket.socket, peer_name: str) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.peer_name = peer_name
        self.lock = threading.Lock()
        self.broken: Optional[str] = None
        self._next_id = 1
        self._header = bytearray(wire.HEADER_BYTES)

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

    def _break(self, code: int, what: str) -> LLMException:
        # A failure in the middle of a frame leaves the stream out of step: drop the connection.
        self.broken = what
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if code == S.LLM_TIMEOUT:
            return _fail(code, f"{what}: no answer from {self.peer_name} in time (the link must be "
                               f"rebuilt: unlink, then link again)")
        return _fail(S.LLM_LINK_FAILED if code != S.LLM_PARAM_INVALID else code,
                     f"{what}: connection to {self.peer_name} failed (status {_status(code).name})")

    def _check(self) -> None:
        if self.broken is not None:
            raise LLMException(f"the link to {self.peer_name} is broken ({self.broken}); unlink and "
                               f"link again", status_code=S.LLM_LINK_FAILED)

    def _remaining(self, deadline: float) -> int:
        return max(0, int((deadline - time.monotonic()) * 1000))

    def _read_reply(self, expect: int, req_id: int, deadline: float, what: str) -> Tuple[int, int]:
        st, _, got = _planes.recv_into(self.fd, self._header, self._remaining(deadline))
        if st != 0:
            raise self._break(st, what)
        try:
            op, status, rid, length = wire.unpack_header(self._header)
        except ProtocolError as exc:
            raise self._break(S.LLM_LINK_FAILED, f"{what}: {exc}") from None
        if op != expect or rid != req_id:
            raise self._break(S.LLM_LINK_FAILED, f"{what}: unexpected reply {wire.OP_NAMES[op]}")
        return status, length

    def _read_payload(self, length: int, deadline: float, what: str) -> bytearray:
        if length > wire.MAX_CONTROL_BYTES:
            raise self._break(S.LLM_LINK_FAILED, f"{what}: oversized reply of {length} bytes")
        buf = bytearray(length)
        st, _, _ = _planes.recv_into(self.fd, buf, self._remaining(deadline))
        if st != 0:
            raise self._break(st, what)
        return buf

    def control(self, op: int, reply_op: int, message: Dict[str, Any], timeout_ms: int,
                what: str) -> Tuple[int, Dict[str, Any]]:
        """Send a JSON request, return ``(status, reply JSON)``."""
        payload = wire.encode_json(message)
        deadline = time.monotonic() + timeout_ms / 1000
        with self.lock:
            req_id = self._request_id()
            st, _ = _planes.send_bytes(self.fd, wire.pack_header(op, req_id, len(payload)) + payload,
                                       self._remaining(deadline))
            if st != 0:
                raise self._break(st, what)
            status, length = self._read_reply(reply_op, req_id, deadline, what)
            body = self._read_payload(length, deadline, what)
        try:
            return status, wire.decode_json(body) if body else {}
        except ProtocolError as exc:
            raise self._break(S.LLM_LINK_FAILED, f"{what}: {exc}") from None

    def _request_id(self) -> int:
        self._check()
        req_id = self._next_id
        self._next_id += 1
        return req_id

    def _refused(self, status: int, what: str, side: str) -> None:
        if status == wire.STATUS_STALE_TABLE:
            raise _StaleTable()
        if status != 0:
            raise _fail(status, f"{what} refused by {self.peer_name}: {_status(status).name} (a "
                                f"{side} range is not registered there)")

    def push(self, plan, generation: int, timeout_ms: int) -> None:
        """Send the plan's source bytes for the peer to write at the descriptors' destinations
        (planned against the peer's table of ``generation``)."""
        descs = _planes.plan_to_wire(plan)
        deadline = time.monotonic() + timeout_ms / 1000
        with self.lock:
            req_id = self._request_id()
            head = (wire.pack_header(wire.OP_PUSH, req_id, 16 + len(descs) + plan.total_bytes)
                    + wire.U64x2.pack(generation, len(descs)) + descs)
            st, _ = _planes.send_plan(self.fd, head, plan, False, self._remaining(deadline))
            if st != 0:
                raise self._break(st, "push")
            status, length = self._read_reply(wire.OP_PUSH_DONE, req_id, deadline, "push")
            if length:
                raise self._break(S.LLM_LINK_FAILED, "push: reply with a payload")
        self._refused(status, "push", "destination")

    def pull(self, plan, generation: int, timeout_ms: int) -> None:
        """Ask the peer for the plan's source ranges and receive them into the destinations."""
        descs = _planes.plan_to_wire(plan)
        deadline = time.monotonic() + timeout_ms / 1000
        with self.lock:
            req_id = self._request_id()
            st, _ = _planes.send_bytes(self.fd, wire.pack_header(wire.OP_PULL, req_id, 8 + len(descs))
                                       + wire.U64.pack(generation) + descs, self._remaining(deadline))
            if st != 0:
                raise self._break(st, "pull")
            status, length = self._read_reply(wire.OP_PULL_DATA, req_id, deadline, "pull")
            if status == 0 and length != plan.total_bytes:
                raise self._break(S.LLM_LINK_FAILED, f"pull: {length} bytes announced, "
                                                     f"{plan.total_bytes} asked")
            if status == 0:
                st, _, _ = _planes.recv_plan(self.fd, plan, False, self._remaining(deadline))
                if st != 0:
                    raise self._break(st, "pull")
            elif length:
                raise self._break(S.LLM_LINK_FAILED, "pull: refusal with a payload")
        self._refused(status, "pull", "source")


@dataclass(eq=False)
class Peer:
    """This side's state for one linked cluster (or one being linked)."""

    cluster_id: int
    role: str
    is_client: bool
    address: Tuple[str, int]
    planes: List[str]
    unix: bool = False  # the data connections are Unix-domain sockets (this host, this netns)
    pid: int = 0        # proven by SO_PEERCRED on the Unix connections; 0 = not proven
    uid: int = -1
    token: str = ""
    want: Tuple[int, int] = (CONNECTIONS_PER_DIRECTION, CONNECTIONS_PER_DIRECTION)  # forward, reverse
    ready: bool = False
    plane: Optional[str] = None  # chosen with the first table fetched over the link
    table: Optional[RemoteTable] = None
    channels: List[Channel] = field(default_factory=list)        # this side's requests
    incoming: List[socket.socket] = field(default_factory=list)  # the peer's requests
    generation: Optional[PeerCounter] = None
    generation_addr: int = 0
    pidfd: int = -1
    closed: bool = False
    unlinking: bool = False  # this side is unlinking it: its connections closing is no loss
    unlinked_by_peer: bool = False  # the peer unlinked it (its own unlink then succeeds too)
    comm: Optional[Tuple[str, str]] = None  # the two-sided link (name, digest) it was made for
    table_lock: threading.Lock = field(default_factory=threading.Lock)
    settle_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def outgoing(self) -> Optional[Channel]:
        return self.channels[0] if self.channels else None

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

    def release_same_host(self) -> None:
        """Close the pidfd and unmap the generation counter of the peer."""
        pidfd, self.pidfd = self.pidfd, -1
        if pidfd >= 0:
            try:
                os.close(pidfd)
            except OSError:
                pass
        counter, self.generation = self.generation, None
        if counter is not None:
            counter.close()

    def close(self) -> None:
        self.closed = True
        self.release_same_host()
        for channel in list(self.channels):
            channel.close()
        for sock in list(self.incoming):
            try:
                sock.shutdown(socket.SHUT_RDWR)  # its serving thread closes it
            except OSError:
                pass


def _peer_credentials(sock: socket.socket) -> Tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of a Unix socket, as the kernel has them."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, _ = _UCRED.unpack(data)
    return pid, uid


_UCRED = struct.Struct("3i")


def _is_int(value: Any, lo: int = 0, hi: int = 2**64 - 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _env_int(name: str, default: int, lo: int = 1) -> int:
    try:
        return max(lo, int(os.environ.get(name, str(default))))
    except ValueError:
        return default


class LinkManager:
    """The link table of one engine, its listeners and its connection threads."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.plane = resolve_plane(engine.options)
        self.remote_accessible = engine.options.get("llm.EnableRemoteCacheAccessible", "0") == "1"
        self.secret = auth.resolve_secret(engine.options)
        self.cookie = _planes.Word(int.from_bytes(os.urandom(8), "little") | 1)
        self.max_links = _env_int(MAX_LINKS_ENV, DEFAULT_MAX_LINKS)
        self.max_pending = _env_int(MAX_PENDING_ENV, DEFAULT_MAX_PENDING)
        self.handshake_ms = _env_int(HANDSHAKE_TIMEOUT_ENV, DEFAULT_HANDSHAKE_TIMEOUT_MS)
        self._lock = threading.RLock()
        self._peers: Dict[int, Peer] = {}
        self._pending: Dict[str, Peer] = {}   # server side: token -> a link waiting for its connections
        self._linking: set = set()            # client side: cluster ids being linked now
        self._lost: Dict[int, str] = {}       # cluster id -> why its link ended without an unlink
        self._unlinked_by_peer: set = set()   # cluster ids whose link the peer ended with an unlink
        self._self_peers: List[Peer] = []     # server side of links this cluster made to its own listener
        self._joining: Dict[Tuple[str, str], set] = {}  # two-sided links being made -> ids expected to link here
        self._comm_listeners: Dict[Tuple[str, int], List[Any]] = {}  # (ip, port) -> [socket, users]
        self._comm_unix_name: Optional[str] = None  # the Unix socket of the comm listeners
        self.comms: Dict[int, Comm] = {}
        self._next_comm_id = 1
        self._listeners: List[socket.socket] = []
        self._listen_threads: List[threading.Thread] = []
        self.unix_name: Optional[str] = None
        self._threads: List[threading.Thread] = []
        self._incoming: set = set()  # accepted connections still in their handshake
        self._handshakes = 0
        self._closed = False
        self._notify_handler: Optional[Callable[[int, Dict[str, Any]], Dict[str, Any]]] = None
        #: Counters of refused or failed connections (``link_stats``).
        self.stats = {"accept_errors": 0, "refused_busy": 0, "auth_failures": 0, "handshake_failures": 0,
                      "links_lost": 0}

    # -- listener ---------------------------------------------------------------------------------
    @property
    def listen_address(self) -> Optional[Tuple[str, int]]:
        for sock in self._listeners:
            if sock.family != socket.AF_UNIX:
                host, port = sock.getsockname()[:2]
                return host, port
        return None

    def start_listener(self, ip: str, port: int) -> None:
        """Listen on ``ip:port`` (port 0 = any free port; see ``listen_address``), and on a Unix
        socket of a random abstract name that same-host peers learn after authenticating."""
        self.stop_listener()
        try:
            sock = _tcp_listener(ip, port)
        except OSError as exc:
            raise LLMException(f"cannot listen on {ip}:{port}: {exc}", status_code=S.LLM_PARAM_INVALID) from None
        listeners = [sock]
        local, unix_name = _unix_listener()
        if local is not None:
            listeners.append(local)
        self._listeners, self.unix_name = listeners, unix_name
        self._listen_threads = []
        for listener in listeners:
            listener.settimeout(0.2)
            thread = threading.Thread(target=self._accept_loop, args=(listener,), daemon=True,
                                      name=f"llm_datadist-listen-{port}")
            self._listen_threads.append(thread)
            thread.start()
        host, bound = self.listen_address
        logger.info("cluster %d listening on %s:%d", self.engine.cluster_id, host, bound)
        if self.secret is None and not _is_loopback(ip):
            _warn_once(f"cluster {self.engine.cluster_id} listens on {ip}:{bound} without a link secret: "
                       f"any process that reaches this address can link, read and write the registered "
                       f"caches (set {auth.SECRET_OPTION} / {auth.SECRET_ENV} on every cluster)")

    def stop_listener(self) -> None:
        listeners, threads = self._listeners, self._listen_threads
        self._listeners, self._listen_threads, self.unix_name = [], [], None
        for sock in listeners:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=2)

    def _accept_loop(self, listener: socket.socket) -> None:
        failures = 0
        while self._listening(listener):
            try:
                conn, addr = listener.accept()
            except socket.timeout:
                continue
            except OSError as exc:
                if not self._listening(listener):
                    break
                # Out of descriptors or buffers, or a connection reset before it was accepted: a
                # transient state; back off (up to a second) and go on listening.
                failures += 1
                with self._lock:
                    self.stats["accept_errors"] += 1
                delay = min(1.0, 0.01 * (2 ** min(failures, 7)))
                if failures == 1 or failures % 100 == 0:
                    logger.warning("cluster %d: accept() failed (%s, %d so far); retrying in %.2f s",
                                   self.engine.cluster_id, exc, self.stats["accept_errors"], delay)
                time.sleep(delay)
                continue
            failures = 0
            name = "local" if conn.family == socket.AF_UNIX else f"{addr[0]}:{addr[1]}"
            with self._lock:
                busy = self._handshakes >= self.max_pending or self._closed
                if not busy:
                    self._handshakes += 1
                    self._incoming.add(conn)
                else:
                    self.stats["refused_busy"] += 1
            if busy:
                if self.stats["refused_busy"] in (1, 10, 100) or self.stats["refused_busy"] % 1000 == 0:
                    logger.warning("cluster %d: %d connections refused: %d handshakes already pending "
                                   "(%s)", self.engine.cluster_id, self.stats["refused_busy"], self.max_pending,
                                   MAX_PENDING_ENV)
                _close(conn)
                continue
            try:
                _tune(conn)
                conn.setblocking(False)
                self._spawn(self._serve_accepted, conn, name)
            except (OSError, RuntimeError) as exc:  # no thread could be started
                logger.warning("cluster %d: dropping a connection from %s: %s", self.engine.cluster_id, name, exc)
                self._handshake_done(conn)
                _close(conn)

    def _listening(self, listener: socket.socket) -> bool:
        with self._lock:
            return listener in self._listeners or any(entry[0] is listener
                                                      for entry in self._comm_listeners.values())

    def _spawn(self, target: Callable, *args) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, daemon=True, name="llm_datadist-conn")
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()
        return thread

    def _handshake_done(self, conn: socket.socket) -> None:
        with self._lock:
            if conn in self._incoming:
                self._incoming.discard(conn)
                self._handshakes -= 1

    # -- frames of the handshake ------------------------------------------------------------------
    @staticmethod
    def _send(fd: int, op: int, message: Dict[str, Any], deadline: float, status: int = 0) -> bool:
        payload = wire.encode_json(message)
        st, _ = _planes.send_bytes(fd, wire.pack_header(op, 1, len(payload), status) + payload,
                                   max(1, _left(deadline)))
        return st == 0

    @staticmethod
    def _receive(fd: int, expect: int, deadline: float, what: str) -> Tuple[int, Dict[str, Any]]:
        """``(status, JSON object)`` of the next frame, which must be ``expect``. ProtocolError for
        a malformed frame; LLMException for a closed, silent or slow connection."""
        header = bytearray(wire.HEADER_BYTES)
        st, _, _ = _planes.recv_into(fd, header, max(1, _left(deadline)))
        if st != 0:
            raise _fail(S.LLM_LINK_FAILED, f"no {what} ({_status(st).name})")
        op, status, _, length = wire.unpack_header(header)
        if op != expect or length > MAX_HANDSHAKE_BYTES:
            raise ProtocolError(f"{wire.OP_NAMES[op]} of {length} bytes instead of a {what}")
        body = bytearray(length)
        st, _, _ = _planes.recv_into(fd, body, max(1, _left(deadline)))
        if st != 0:
            raise _fail(S.LLM_LINK_FAILED, f"{what} truncated ({_status(st).name})")
        return status, wire.decode_json(body)

    # -- server side ------------------------------------------------------------------------------
    def _serve_accepted(self, conn: socket.socket, name: str) -> None:
        """Handshake on an accepted connection, then serve it (or hand it to a Channel). The
        socket is closed on every other way out."""
        handed_over = False
        try:
            handed_over = self._handshake_accepted(conn, name)
        except ProtocolError as exc:
            logger.warning("closing connection from %s: %s", name, exc)
            self.engine.count_protocol_error()
        except LLMException as exc:  # closed, silent or too slow
            with self._lock:
                self.stats["handshake_failures"] += 1
            logger.info("closing connection from %s: %s", name, exc)
        finally:
            self._handshake_done(conn)
            if not handed_over:
                _close(conn)

    def _handshake_accepted(self, conn: socket.socket, name: str) -> bool:
        """hello -> challenge -> auth -> reply; then what the connection is for. True if the
        socket now belongs to a link."""
        fd = conn.fileno()
        deadline = time.monotonic() + self.handshake_ms / 1000
        _, hello = self._receive(fd, wire.OP_HELLO, deadline, "hello")
        peer_id, client_nonce = hello.get("cluster_id"), hello.get("nonce")
        if not _is_int(peer_id) or not auth.is_nonce(client_nonce) or not isinstance(hello.get("auth"), bool):
            raise ProtocolError(f"malformed hello {_brief(hello)}")
        mine = self.engine.cluster_id
        server_nonce = auth.new_nonce()
        challenge: Dict[str, Any] = {"cluster_id": mine, "nonce": server_nonce, "auth": self.secret is not None}
        if hello["auth"] != (self.secret is not None):
            with self._lock:
                self.stats["auth_failures"] += 1
            why = "this cluster requires a link secret" if self.secret else "this cluster has no link secret"
            logger.warning("cluster %d refused a link from %s: %s", mine, name, why)
            self._send(fd, wire.OP_CHALLENGE, dict(challenge, error=why), deadline, S.LLM_LINK_FAILED)
            return False
        if self.secret is not None:
            challenge["proof"] = auth.proof(self.secret, "server", client_nonce, server_nonce, peer_id, mine)
        if not self._send(fd, wire.OP_CHALLENGE, challenge, deadline):
            return False
        _, message = self._receive(fd, wire.OP_AUTH, deadline, "authentication")
        if self.secret is not None and not auth.verify(self.secret, "client", client_nonce, server_nonce, peer_id,
                                                       mine, message.get("proof")):
            with self._lock:
                self.stats["auth_failures"] += 1
            logger.warning("cluster %d refused a connection from %s claiming cluster %d: wrong link secret",
                           mine, name, peer_id)
            self._send(fd, wire.OP_HELLO_REPLY, {"error": "authentication failed"}, deadline, S.LLM_LINK_FAILED)
            return False
        purpose = message.get("purpose")
        if purpose == "link":
            status, reply, peer = self._accept_link(peer_id, message, name)
            sent = self._send(fd, wire.OP_HELLO_REPLY, reply, deadline, status)
            if status != 0:
                return False
            self._handshake_done(conn)
            # The client opens the link's data connections, then closes this one: wait for that
            # (or the deadline); a link whose connections did not all arrive is dropped.
            if sent:
                _planes.recv_discard(fd, 1, max(1, _left(deadline)))
            with self._lock:
                complete = peer.ready
            if not complete:
                self._lose(peer, "its connections did not arrive", quiet=True)
                return False
            try:  # choose this side's plane now rather than on the first transfer
                self._settle(peer, time.monotonic() + self.handshake_ms / 1000)
            except LLMException as exc:
                self._lose(peer, f"no data plane: {exc}")
            return False
        if purpose in ("forward", "reverse"):
            status, reply, peer = self._accept_data(peer_id, purpose, message, conn)
            if not self._send(fd, wire.OP_HELLO_REPLY, reply, deadline, status) or status != 0:
                if peer is not None:
                    self._lose(peer, f"its {purpose} connection failed", quiet=True)
                return False
            self._handshake_done(conn)
            if purpose == "forward":
                self._serve(conn, name, peer)
            return True  # _serve closed it, or a Channel holds it
        raise ProtocolError(f"unknown purpose {_brief(purpose)}")

    def _accept_link(self, peer_id: int, message: Dict[str, Any], name: str):
        """Decide on an authenticated link request: ``(status, reply, pending Peer or None)``."""
        reply: Dict[str, Any] = {"cluster_id": self.engine.cluster_id}

        def refuse(status: int, why: str):
            logger.warning("cluster %d refused a link from %s (cluster %d): %s", self.engine.cluster_id, name,
                           peer_id, why)
            return status, dict(reply, error=why), None

        want = message.get("connections")
        planes = message.get("planes")
        if not (isinstance(want, list) and len(want) == 2 and all(_is_int(n, 1, MAX_CONNECTIONS) for n in want)):
            raise ProtocolError(f"link request: connections {_brief(want)}")
        if not (isinstance(planes, list) and all(isinstance(p, str) for p in planes)):
            raise ProtocolError(f"link request: planes {_brief(planes)}")
        if not isinstance(message.get("role"), str) or not isinstance(message.get("host"), dict):
            raise ProtocolError("link request: role or host malformed")
        comm = message.get("comm")
        if comm is not None:
            if not (isinstance(comm, list) and len(comm) == 2 and all(isinstance(x, str) for x in comm)):
                raise ProtocolError(f"link request: comm {_brief(comm)}")
            comm = (comm[0], comm[1])
        elif bool(message.get("remote_cache_accessible")) != self.remote_accessible:
            return refuse(S.LLM_PARAM_INVALID, "enable_remote_cache_accessible differs between the two clusters")
        mine = self.engine.cluster_id
        peer = Peer(peer_id, message["role"][:64], False, (name, 0), list(planes)[:8], token=os.urandom(16).hex(),
                    want=(want[0], want[1]), comm=comm)
        if peer_id == mine:  # a link to our own listener: its server side is kept apart from the client side
            with self._lock:
                if len(self._self_peers) >= MAX_CONNECTIONS:
                    return refuse(S.LLM_LINK_FAILED, "too many links to itself")
                self._self_peers.append(peer)
                self._pending[peer.token] = peer
            return S.LLM_SUCCESS, self._link_reply(reply, peer), peer
        with self._lock:
            if comm is not None and peer_id not in self._joining.get(comm, ()):
                return S.LLM_NOT_YET_LINK, dict(reply, error="this cluster is not making that link now"), None
            old = self._peers.get(peer_id)
            mutual = "this cluster is linking to you at the same time; one link serves both"
            if old is None and peer_id in self._linking and peer_id > mine:
                # Both sides link to each other at once: the link of the lower cluster id is kept.
                return S.LLM_ALREADY_LINK, dict(reply, error=mutual, mutual=True), None
            if old is not None and old.ready and old.is_client and not old.hung_up():
                return S.LLM_ALREADY_LINK, dict(reply, error=mutual, mutual=True), None
            if old is not None and (not old.ready or not old.hung_up()):
                # A live link is never replaced; one whose connections are gone is (force_link).
                return refuse(S.LLM_ALREADY_LINK, f"cluster {peer_id} is already linked")
            if len(self._peers) - (old is not None) >= self.max_links:
                return refuse(S.LLM_LINK_FAILED, f"this cluster holds {self.max_links} links ({MAX_LINKS_ENV})")
            if old is not None:
                self._forget(old, "replaced by a new link: its connections were closed")
            self._peers[peer_id] = peer
            self._pending[peer.token] = peer
        if old is not None:
            old.close()
        return S.LLM_SUCCESS, self._link_reply(reply, peer), peer

    def _link_reply(self, reply: Dict[str, Any], peer: Peer) -> Dict[str, Any]:
        return dict(reply, role=self.engine.role, planes=self._offered_planes(), host=host_identity(),
                    remote_cache_accessible=self.remote_accessible, token=peer.token,
                    unix=self.unix_name or self._comm_unix_name)

    def _accept_data(self, peer_id: int, purpose: str, message: Dict[str, Any], conn: socket.socket):
        """A data connection of a link being made: ``(status, reply, Peer or None)``."""
        refused = S.LLM_LINK_FAILED, {"error": "no pending link for this connection"}, None
        token = message.get("token")
        unix = conn.family == socket.AF_UNIX
        pid, uid = _peer_credentials(conn) if unix else (0, -1)
        with self._lock:
            peer = self._pending.get(token) if isinstance(token, str) else None
            if peer is None or peer.cluster_id != peer_id or not self._holds(peer):
                return refused
            first = not peer.channels and not peer.incoming
            if first:
                peer.unix, peer.pid, peer.uid = unix, pid, uid
            elif (peer.unix, peer.pid, peer.uid) != (unix, pid, uid):
                # Every connection of a link comes from one process, over one kind of socket.
                return S.LLM_LINK_FAILED, {"error": "connections of one link from different processes"}, peer
            if purpose == "forward":
                if len(peer.incoming) >= peer.want[0]:
                    return refused
                peer.incoming.append(conn)
            else:
                if len(peer.channels) >= peer.want[1]:
                    return refused
                peer.channels.append(Channel(conn, f"cluster {peer_id} ({peer.address[0]})"))
            if len(peer.incoming) == peer.want[0] and len(peer.channels) == peer.want[1]:
                peer.ready = True
                del self._pending[token]
                logger.info("cluster %d: cluster %d linked from %s", self.engine.cluster_id, peer_id,
                            "this host" if unix else peer.address[0])
        return S.LLM_SUCCESS, {"cluster_id": self.engine.cluster_id}, peer

    def _holds(self, peer: Peer) -> bool:
        return self._peers.get(peer.cluster_id) is peer or any(p is peer for p in self._self_peers)

    def _offered_planes(self) -> List[str]:
        return ["cma", "tcp"] if self.plane != "tcp" else ["tcp"]

    # -- serving requests -------------------------------------------------------------------------
    def _serve(self, conn: socket.socket, name: str, peer: Peer) -> None:
        """Serve the peer's requests on ``conn`` until it closes or breaks the protocol; then the
        whole link is gone (its other connections are closed too)."""
        peer_id = peer.cluster_id
        fd = conn.fileno()
        header = bytearray(wire.HEADER_BYTES)
        why = "the connection was closed"
        try:
            while not self._closed:
                st, _, got = _planes.recv_into(fd, header, -1)
                if st != 0:
                    break
                op, _, req_id, length = wire.unpack_header(header)
                if op not in wire.REQUEST_OPS or op == wire.OP_HELLO:
                    raise ProtocolError(f"{wire.OP_NAMES[op]} is not a request")
                if not self._handle(fd, op, req_id, length, peer):
                    why = "unlinked, or a reply could not be sent"
                    break
        except ProtocolError as exc:
            logger.warning("closing connection from %s (cluster %s): %s", name, peer_id, exc)
            self.engine.count_protocol_error()
            why = f"protocol error: {exc}"
        finally:
            _close(conn)
            if not self._closed:
                self._lose(peer, why)

    def _recv_exact(self, fd: int, length: int, limit: int, what: str) -> bytearray:
        if length > limit:
            raise ProtocolError(f"{what} of {length} bytes exceeds {limit}")
        buf = bytearray(length)
        st, _, _ = _planes.recv_into(fd, buf, FRAME_TIMEOUT_MS)
        if st != 0:
            raise ProtocolError(f"{what} truncated ({_status(st).name})")
        return buf

    def _reply(self, fd: int, op: int, req_id: int, status: int, payload: bytes = b"") -> bool:
        st, _ = _planes.send_bytes(fd, wire.pack_header(op, req_id, len(payload), status) + payload,
                                   FRAME_TIMEOUT_MS)
        return st == 0

    def _handle(self, fd: int, op: int, req_id: int, length: int, peer: Peer) -> bool:
        engine = self.engine
        peer_id = peer.cluster_id
        if op == wire.OP_TABLE_GET:
            self._recv_exact(fd, length, wire.MAX_CONTROL_BYTES, "table request")
            table = engine.export_table()
            if peer.unix:
                # Only a peer whose pid the kernel proved may use the same-host plane: tell it
                # where to probe and where our registry generation lives.
                table["same_host"] = {"probe": [self.cookie.addr, self.cookie.value],
                                      "generation_addr": engine.generation_word.addr,
                                      "generation_fd": engine.generation_word.fd}
            return self._reply(fd, wire.OP_TABLE, req_id, 0, wire.encode_json(table))
        if op == wire.OP_KEY_DONE:
            message = wire.decode_json(self._recv_exact(fd, length, wire.MAX_CONTROL_BYTES, "key release"))
            try:
                kind, ident, model_id = message["key"]
                released = engine.consume_key((str(kind), int(ident), int(model_id)),
                                              [int(t) for t in message["tensors"]])
            except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int(1e400)
                raise ProtocolError(f"malformed key release: {exc!r}") from None
            return self._reply(fd, wire.OP_KEY_DONE_REPLY, req_id, 0, wire.encode_json({"released": released}))
        if op == wire.OP_NOTIFY:
            message = wire.decode_json(self._recv_exact(fd, length, wire.MAX_CONTROL_BYTES, "notification"))
            status, answer = self._answer_notification(peer_id, message)
            return self._reply(fd, wire.OP_NOTIFY_REPLY, req_id, status, wire.encode_json(answer))
        if op == wire.OP_UNLINK:
            self._recv_exact(fd, length, wire.MAX_CONTROL_BYTES, "unlink")
            # Forget the link before answering, so that a relink right after the answer is not
            # mistaken for this one; close the connections after answering.
            with self._lock:
                peer.unlinked_by_peer = True
                if self._peers.get(peer_id) is peer:
                    del self._peers[peer_id]
                    if not peer.unlinking:
                        self._unlinked_by_peer.add(peer_id)
                        while len(self._unlinked_by_peer) > MAX_LOST_RECORDS:
                            self._unlinked_by_peer.pop()
                self._self_peers = [p for p in self._self_peers if p is not peer]
            self._reply(fd, wire.OP_UNLINK_DONE, req_id, 0)
            peer.close()
            logger.info("cluster %d: cluster %d unlinked", engine.cluster_id, peer_id)
            return False
        if op == wire.OP_PUSH:
            if length < 16:
                raise ProtocolError(f"push frame of {length} bytes")
            generation, desc_len = wire.U64x2.unpack(self._recv_exact(fd, 16, 16, "push"))
            if desc_len > length - 16 or desc_len % _planes.WIRE_DESC_BYTES:
                raise ProtocolError(f"push: descriptor length {desc_len} in a frame of {length}")
            plan = self._wire_plan(self._recv_exact(fd, desc_len, wire.MAX_DESCRIPTOR_BYTES, "descriptors"))
            data_len = length - 16 - desc_len
            if plan.total_bytes != data_len:
                raise ProtocolError(f"push: descriptors cover {plan.total_bytes} bytes, frame carries {data_len}")
            with engine.pinned(plan, True) as (ranges, current):
                refusal = self._refusal(plan, True, generation, ranges, current, peer_id, "push")
                if refusal == 0:
                    st, _, _ = _planes.recv_plan(fd, plan, False, FRAME_TIMEOUT_MS)
                    if st != 0:
                        raise ProtocolError(f"push payload truncated ({_status(st).name})")
            if refusal:
                st, _, _ = _planes.recv_discard(fd, data_len, FRAME_TIMEOUT_MS)
                if st != 0:
                    raise ProtocolError("push payload truncated")
            return self._reply(fd, wire.OP_PUSH_DONE, req_id, refusal)
        if op == wire.OP_PULL:
            if length < 8 or (length - 8) % _planes.WIRE_DESC_BYTES:
                raise ProtocolError(f"pull: frame length {length}")
            (generation,) = wire.U64.unpack(self._recv_exact(fd, 8, 8, "pull"))
            plan = self._wire_plan(self._recv_exact(fd, length - 8, wire.MAX_DESCRIPTOR_BYTES, "descriptors"))
            with engine.pinned(plan, False) as (ranges, current):
                refusal = self._refusal(plan, False, generation, ranges, current, peer_id, "pull")
                if refusal == 0:
                    head = wire.pack_header(wire.OP_PULL_DATA, req_id, plan.total_bytes, 0)
                    st, _ = _planes.send_plan(fd, head, plan, False, FRAME_TIMEOUT_MS)
                    return st == 0
            return self._reply(fd, wire.OP_PULL_DATA, req_id, refusal)
        raise ProtocolError(f"unexpected {wire.OP_NAMES[op]}")

    def _answer_notification(self, peer_id: int, message: Dict[str, Any]) -> Tuple[int, Dict[str, Any]]:
        handler = self._notify_handler
        if handler is None:
            return S.LLM_FEATURE_NOT_ENABLED, {"error": "this cluster takes no notifications"}
        try:
            answer = handler(peer_id, message)
            if not isinstance(answer, dict):
                raise TypeError(f"the notification handler returned {type(answer).__name__}, not a dict")
            return S.LLM_SUCCESS, answer
        except Exception:  # the application's handler: its failure is the peer's answer, not ours
            logger.exception("cluster %d: the handler of a notification from cluster %d failed",
                             self.engine.cluster_id, peer_id)
            return S.LLM_FAILED, {"error": "the handler failed"}

    def _refusal(self, plan, dst_side: bool, generation: int, ranges, current: int, peer_id: int,
                 what: str) -> int:
        """0 to accept a transfer; the stale-table status if the peer planned against an older
        registry; ``LLM_KV_CACHE_NOT_EXIST`` if a range is not registered memory here."""
        if generation != current:
            return wire.STATUS_STALE_TABLE
        bad = ranges.first_outside(plan, dst_side)
        if bad < 0:
            return 0
        logger.warning("cluster %d refused a %s from %d: range %d is not registered memory",
                       self.engine.cluster_id, what, peer_id, bad)
        return S.LLM_KV_CACHE_NOT_EXIST

    @staticmethod
    def _wire_plan(data: bytearray):
        try:
            return _planes.plan_from_wire(data)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None

    # -- client side ------------------------------------------------------------------------------
    def link(self, remote_cluster_id: int, ip: str, port: int, timeout_ms: int,
             comm: Optional[Tuple[str, str]] = None, quiet: bool = False) -> LLMStatusCode:
        """Link to the cluster listening on ``ip:port``; returns a status, never raises.

        A cluster that has linked to this one already is linked (``LLM_SUCCESS``: that link
        serves both); so is one that links to this one at the same moment (the link made by the
        lower cluster id is kept). ``comm`` names the two-sided link this one is part of.
        """
        deadline = time.monotonic() + timeout_ms / 1000
        with self._lock:
            old = self._peers.get(remote_cluster_id)
            if remote_cluster_id in self._linking:
                return S.LLM_ALREADY_LINK
            live = old is not None and not old.hung_up()
            if live and old.is_client:
                return S.LLM_ALREADY_LINK if comm is None else S.LLM_SUCCESS
            if live and old.ready:
                return S.LLM_SUCCESS  # the peer linked to this cluster: that link serves both
        if live:  # the peer's link to this cluster is being made right now: it will serve both
            return self._await_mutual(remote_cluster_id, deadline)
        with self._lock:
            old = self._peers.get(remote_cluster_id)
            if remote_cluster_id in self._linking or (old is not None and not old.hung_up()):
                return S.LLM_ALREADY_LINK
            if old is not None:
                self._forget(old, "its connections were closed")
            self._linking.add(remote_cluster_id)
            self._unlinked_by_peer.discard(remote_cluster_id)
        if old is not None:
            old.close()
        sockets: List[socket.socket] = []
        log = logger.debug if quiet else logger.error
        try:
            return self._link(remote_cluster_id, ip, port, deadline, sockets, comm)
        except _MutualLink:
            status = self._await_mutual(remote_cluster_id, deadline)
        except LLMException as exc:
            log("link %d -> %d (%s:%d) failed: %s", self.engine.cluster_id, remote_cluster_id, ip, port, exc)
            status = exc.status_code
        except Exception as exc:  # a refused connection, a malformed reply: the link fails, never raises
            log("link %d -> %d (%s:%d) failed: %s: %s", self.engine.cluster_id, remote_cluster_id,
                ip, port, type(exc).__name__, exc)
            status = S.LLM_LINK_FAILED
        finally:
            with self._lock:
                self._linking.discard(remote_cluster_id)
        for sock in sockets:
            _close(sock)
        return status

    def _await_mutual(self, remote_cluster_id: int, deadline: float) -> LLMStatusCode:
        """The peer is linking to this cluster at the same time and its link is the one kept:
        wait for it to arrive."""
        while time.monotonic() < deadline:
            with self._lock:
                peer = self._peers.get(remote_cluster_id)
                if peer is not None and peer.ready and not peer.is_client:
                    return S.LLM_SUCCESS
            time.sleep(0.005)
        logger.error("link %d -> %d: the peer's own link to this cluster did not arrive in time",
                     self.engine.cluster_id, remote_cluster_id)
        return S.LLM_LINK_FAILED

    def _link(self, remote_cluster_id: int, ip: str, port: int, deadline: float,
              sockets: List[socket.socket], comm: Optional[Tuple[str, str]] = None) -> LLMStatusCode:
        """The steps of ``link``; every socket it opens goes to ``sockets`` (closed by the caller
        unless the link is made, in which case ``sockets`` is emptied)."""
        first = self._connect_tcp(ip, port, deadline)
        sockets.append(first)
        request = dict(purpose="link", role=self.engine.role, planes=self._offered_planes(), host=host_identity(),
                       remote_cache_accessible=self.remote_accessible,
                       connections=[CONNECTIONS_PER_DIRECTION, CONNECTIONS_PER_DIRECTION], force_link=True)
        if comm is not None:
            request["comm"] = list(comm)
        reply = self._client_handshake(first, remote_cluster_id, request, deadline)
        token, unix_name = reply.get("token"), reply.get("unix")
        planes, role = reply.get("planes"), reply.get("role")
        if not isinstance(token, str) or not isinstance(role, str) or not (
                isinstance(planes, list) and all(isinstance(p, str) for p in planes)):
            raise ProtocolError(f"link reply lacks token, role or planes: {_brief(reply)}")
        unix = (isinstance(unix_name, str) and self.plane != "tcp"
                and same_host(host_identity(), reply.get("host") if isinstance(reply.get("host"), dict) else {}))
        name = f"cluster {remote_cluster_id} ({ip}:{port})"
        peer = Peer(remote_cluster_id, role[:64], True, (ip, port), list(planes)[:8], comm=comm)
        reverse: List[socket.socket] = []
        for purpose in ["forward"] * CONNECTIONS_PER_DIRECTION + ["reverse"] * CONNECTIONS_PER_DIRECTION:
            sock = None
            if unix:
                try:
                    sock = self._connect_unix(unix_name, deadline)
                except OSError as exc:
                    if peer.channels or reverse:
                        raise
                    logger.info("link %d -> %d: its Unix socket is not reachable (%s); using TCP",
                                self.engine.cluster_id, remote_cluster_id, exc)
                    unix = False
            if sock is None:
                sock = self._connect_tcp(ip, port, deadline)
            sockets.append(sock)
            self._client_handshake(sock, remote_cluster_id, {"purpose": purpose, "token": token}, deadline)
            if unix:
                pid, uid = _peer_credentials(sock)
                if peer.pid and (pid, uid) != (peer.pid, peer.uid):
                    raise _fail(S.LLM_LINK_FAILED, "the link's connections reach different processes")
                peer.unix, peer.pid, peer.uid = True, pid, uid
            if purpose == "forward":
                peer.channels.append(Channel(sock, name))
            else:
                reverse.append(sock)
        peer.incoming = reverse
        peer.ready = True
        sockets.remove(first)
        _close(first)  # the server now holds the link as made
        self._settle(peer, deadline)
        with self._lock:
            if self._closed:
                raise _fail(S.LLM_LINK_FAILED, "finalized while linking")
            self._peers[remote_cluster_id] = peer
            self._lost.pop(remote_cluster_id, None)
        sockets.clear()  # they belong to the link now
        for sock in reverse:
            self._spawn(self._serve, sock, f"{ip}:{port}", peer)
        logger.info("cluster %d linked to %d at %s:%d (data plane %s)", self.engine.cluster_id,
                    remote_cluster_id, ip, port, peer.plane)
        return S.LLM_SUCCESS

    @staticmethod
    def _connect_tcp(ip: str, port: int, deadline: float) -> socket.socket:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise LLMException("link timed out", status_code=S.LLM_LINK_FAILED)
        sock = socket.create_connection((ip, port), timeout=remaining)
        try:
            _tune(sock)
            sock.setblocking(False)
        except BaseException:
            _close(sock)
            raise
        return sock

    @staticmethod
    def _connect_unix(unix_name: str, deadline: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.connect("\0" + unix_name)
            _tune(sock)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    def _client_handshake(self, sock: socket.socket, remote_id: int, request: Dict[str, Any],
                          deadline: float) -> Dict[str, Any]:
        """hello -> challenge -> auth -> reply on a fresh connection; the reply, or LLMException."""
        fd = sock.fileno()
        mine = self.engine.cluster_id
        nonce = auth.new_nonce()
        if not self._send(fd, wire.OP_HELLO, {"cluster_id": mine, "nonce": nonce, "auth": self.secret is not None},
                          deadline):
            raise _fail(S.LLM_LINK_FAILED, "the hello could not be sent")
        status, challenge = self._receive(fd, wire.OP_CHALLENGE, deadline, "challenge")
        if status != 0:
            raise _fail(status, f"refused: {challenge.get('error', '')}")
        if challenge.get("cluster_id") != remote_id:
            raise _fail(S.LLM_LINK_FAILED, f"expected cluster {remote_id}, found cluster "
                                           f"{_brief(challenge.get('cluster_id'))}")
        server_nonce, wants_auth = challenge.get("nonce"), challenge.get("auth")
        if not auth.is_nonce(server_nonce) or not isinstance(wants_auth, bool):
            raise ProtocolError(f"malformed challenge {_brief(challenge)}")
        if wants_auth != (self.secret is not None):
            raise _fail(S.LLM_LINK_FAILED, "the peer requires a link secret" if wants_auth
                        else "the peer has no link secret, and this cluster requires one")
        message = dict(request)
        if self.secret is not None:
            if not auth.verify(self.secret, "server", nonce, server_nonce, mine, remote_id, challenge.get("proof")):
                with self._lock:
                    self.stats["auth_failures"] += 1
                raise _fail(S.LLM_LINK_FAILED, "the peer does not know the link secret")
            message["proof"] = auth.proof(self.secret, "client", nonce, server_nonce, mine, remote_id)
        if not self._send(fd, wire.OP_AUTH, message, deadline):
            raise _fail(S.LLM_LINK_FAILED, "the authentication could not be sent")
        status, reply = self._receive(fd, wire.OP_HELLO_REPLY, deadline, "hello reply")
        if status == S.LLM_ALREADY_LINK and reply.get("mutual") is True:
            raise _MutualLink()
        if status != 0:
            raise _fail(status, f"refused: {reply.get('error', '')}")
        return reply

    # -- choosing the data plane ------------------------------------------------------------------
    def _settle(self, peer: Peer, deadline: float) -> None:
        """Fetch the peer's table and choose the plane of this side's transfers (once)."""
        if peer.plane is not None:
            return
        with peer.settle_lock:
            if peer.plane is not None:
                return
            table, same_host_info = self._fetch_table(peer, _left(deadline))
            plane = self._choose_plane(peer, same_host_info)
            if plane == "cma":
                self._attach_same_host(peer, same_host_info)
                if peer.closed:  # unlinked or lost meanwhile: close() may have run before the attach
                    peer.release_same_host()
            peer.table = table
            peer.plane = plane

    def data_plane(self, remote_cluster_id: int, timeout_ms: int = 5000) -> str:
        """The plane of this side's transfers to a linked cluster (chosen now if not yet)."""
        peer = self.peer(remote_cluster_id)
        self._settle(peer, time.monotonic() + timeout_ms / 1000)
        return peer.plane

    def _choose_plane(self, peer: Peer, info: Any) -> str:
        """``cma`` only towards a process the kernel named (SO_PEERCRED on the link's Unix
        connections), other than this one, of this user, that offers it and whose memory a
        probe read reaches; otherwise ``tcp``."""
        if self.plane == "tcp" or (peer.unix and peer.pid == os.getpid()):
            return "tcp"  # a link to this very process: frames, checked by the owner (ourselves)
        reason = None
        if not peer.unix:
            reason = ("the link's connections are TCP: the peer is on another host or in another network "
                      "namespace, or it uses tcp only")
        elif "cma" not in peer.planes:
            reason = "the peer does not offer it"
        elif peer.pid <= 0 or peer.pid == os.getpid():
            reason = "the peer is this process"
        elif peer.uid != os.geteuid():
            reason = f"the peer runs as another user (uid {peer.uid})"
        elif not (isinstance(info, dict) and isinstance(info.get("probe"), list) and len(info["probe"]) == 2
                  and all(_is_int(x) for x in info["probe"]) and _is_int(info.get("generation_addr"))
                  and _is_int(info.get("generation_fd"), -1, 2**31 - 1)):
            reason = "the peer sent no usable same-host details"
        else:
            addr, value = info["probe"]
            st, err, data = _planes.cma_read_bytes(peer.pid, addr, 8)
            if st != 0 or int.from_bytes(data, "little") != value:
                reason = f"a probe read of the peer failed ({os.strerror(err) if err else 'mismatch'})"
        if reason is None:
            return "cma"
        if self.plane == "cma":
            raise _fail(S.LLM_LINK_FAILED, f"llm.DataPlane=cma but {reason}")
        logger.warning("cluster %d -> %d: same-host plane not usable (%s); using tcp",
                       self.engine.cluster_id, peer.cluster_id, reason)
        return "tcp"

    @staticmethod
    def _attach_same_host(peer: Peer, info: Dict[str, Any]) -> None:
        """Map the peer's generation counter and hold a pidfd of it (same-host plane only)."""
        peer.generation_addr = info["generation_addr"]
        peer.generation = PeerCounter.open(peer.pid, info["generation_fd"])
        try:
            peer.pidfd = os.pidfd_open(peer.pid)
        except (AttributeError, OSError):
            peer.pidfd = -1

    # -- unlink, loss ------------------------------------------------------------------------------
    def link_many(self, targets: List[Tuple[int, str, int]], timeout_ms: int) -> List[LLMStatusCode]:
        """Link to every ``(cluster_id, ip, port)`` in parallel (at most 16 at a time)."""
        return _parallel(lambda t: self.link(t[0], t[1], t[2], timeout_ms), targets)

    def unlink_many(self, cluster_ids: List[int], timeout_ms: int, force: bool) -> List[LLMStatusCode]:
        return _parallel(lambda cid: self.unlink(cid, timeout_ms, force), cluster_ids)

    def unlink(self, remote_cluster_id: int, timeout_ms: int, force: bool) -> LLMStatusCode:
        """Drop the link; unless ``force``, tell the peer first. Local state goes either way."""
        with self._lock:
            peer = self._peers.get(remote_cluster_id)
            lost = self._lost.pop(remote_cluster_id, None)
            by_peer = remote_cluster_id in self._unlinked_by_peer
            self._unlinked_by_peer.discard(remote_cluster_id)
        if peer is None:
            if by_peer:  # the peer unlinked first (both sides may unlink): done
                return S.LLM_SUCCESS
            if lost is not None:  # the peer went away: nobody left to tell
                return S.LLM_SUCCESS if force else S.LLM_UNLINK_FAILED
            return S.LLM_NOT_YET_LINK if not force else S.LLM_SUCCESS
        status = S.LLM_SUCCESS
        peer.unlinking = True
        if not force and peer.outgoing is not None and peer.ready:
            try:
                peer.outgoing.control(wire.OP_UNLINK, wire.OP_UNLINK_DONE, {"cluster_id": self.engine.cluster_id,
                                                                            "timeout": timeout_ms},
                                      timeout_ms, "unlink")
            except LLMException as exc:
                if not peer.unlinked_by_peer:  # else the peer unlinked at the same moment: fine
                    logger.error("unlink %d -> %d: the peer was not told (%s); local state dropped",
                                 self.engine.cluster_id, remote_cluster_id, exc)
                    status = S.LLM_UNLINK_FAILED
        self._drop_peer(remote_cluster_id)
        return status

    def _drop_peer(self, remote_cluster_id: int, expected: Optional[Peer] = None) -> None:
        """Forget the link to a cluster (only if it is still ``expected``, when given)."""
        with self._lock:
            peer = self._peers.get(remote_cluster_id)
            if peer is None or (expected is not None and peer is not expected):
                return
            del self._peers[remote_cluster_id]
            self._pending.pop(peer.token, None)
        peer.close()

    def _forget(self, peer: Peer, why: str) -> bool:
        """The table part of losing a link (lock held or not): whether ``peer`` was the current
        link to its cluster."""
        with self._lock:
            if self._pending.get(peer.token) is peer:
                del self._pending[peer.token]
            if any(p is peer for p in self._self_peers):
                self._self_peers = [p for p in self._self_peers if p is not peer]
                return False
            if self._peers.get(peer.cluster_id) is not peer:
                return False
            del self._peers[peer.cluster_id]
            if peer.ready and not peer.unlinking:
                self._lost[peer.cluster_id] = why
                while len(self._lost) > MAX_LOST_RECORDS:
                    self._lost.pop(next(iter(self._lost)))
                self.stats["links_lost"] += 1
            return True

    def _lose(self, peer: Peer, why: str, quiet: bool = False) -> None:
        """A connection of the link ended without an unlink: forget the link, close the rest of
        its connections, and remember why (``lost_links``). Not called with the lock held."""
        current = self._forget(peer, why)
        if peer.closed:
            return
        peer.close()
        if current and peer.ready and not quiet and not peer.unlinking:
            logger.warning("cluster %d: the link to cluster %d is gone (%s)", self.engine.cluster_id,
                           peer.cluster_id, why)

    def lost_links(self) -> Dict[int, str]:
        """Clusters whose link ended without an unlink (their connections closed or broke), with
        the reason; an entry goes with ``unlink`` or a new link to that cluster."""
        with self._lock:
            return dict(self._lost)

    def has_links(self) -> bool:
        with self._lock:
            return bool(self._peers)

    def linked_clusters(self) -> List[int]:
        with self._lock:
            return sorted(cid for cid, peer in self._peers.items() if peer.ready)

    def peer(self, remote_cluster_id: int) -> Peer:
        with self._lock:
            peer = self._peers.get(remote_cluster_id)
            lost = self._lost.get(remote_cluster_id)
        if peer is None and lost is not None:
            raise LLMException(f"the link to cluster {remote_cluster_id} is gone ({lost}); link again",
                               status_code=S.LLM_LINK_FAILED)
        if peer is None:
            raise LLMException(f"cluster {self.engine.cluster_id} has no link to cluster "
                               f"{remote_cluster_id}", status_code=S.LLM_NOT_YET_LINK)
        if not peer.ready or peer.outgoing is None:
            raise LLMException(f"the link to cluster {remote_cluster_id} is still being set up",
                               status_code=S.LLM_NOT_YET_LINK)
        return peer

    # -- transfers --------------------------------------------------------------------------------
    def _fetch_table(self, peer: Peer, timeout_ms: int) -> Tuple[RemoteTable, Any]:
        status, body = peer.outgoing.control(wire.OP_TABLE_GET, wire.OP_TABLE, {}, timeout_ms, "cache table")
        try:
            return RemoteTable(body), body.get("same_host")
        except ProtocolError as exc:
            raise LLMException(f"cluster {peer.cluster_id} sent a bad cache table: {exc}",
                               status_code=S.LLM_LINK_FAILED) from None

    def refresh_table(self, peer: Peer, timeout_ms: int) -> RemoteTable:
        table, _ = self._fetch_table(peer, timeout_ms)
        peer.table = table
        return table

    def transfer(self, remote_cluster_id: int, make_plan: Callable[[RemoteTable], Any], write: bool,
                 timeout_ms: int) -> Any:
        """Plan against the peer's table and move the bytes (``write``: local -> peer).

        A plan that names a cache the table lacks (``LLM_KV_CACHE_NOT_EXIST``), or a same-host
        transfer that finds the peer's registry changed, refreshes the table once and plans
        again. Returns the plan that ran.
        """
        peer = self.peer(remote_cluster_id)
        deadline = time.monotonic() + timeout_ms / 1000
        try:
            return self._transfer(peer, make_plan, write, deadline)
        except BaseException:
            why = peer.broken()
            if why is not None:  # out of step: the link cannot carry another request
                self._lose(peer, why)
            raise

    def _transfer(self, peer: Peer, make_plan, write: bool, deadline: float):
        if peer.plane is None:
            self._settle(peer, deadline)
        refreshed = False
        while True:
            try:
                table = peer.table
                if peer.plane == "cma" and self._generation(peer) != table.generation:
                    raise _StaleTable()
                plan = make_plan(table)
                if peer.plane == "cma":
                    self._cma(peer, plan, write, deadline)
                else:
                    self._tcp(peer, plan, write, table.generation, deadline)
                return plan
            except _StaleTable:
                pass
            except LLMException as exc:
                # An unknown cache, or an index outside the geometry we hold, may just be an old
                # table: refresh once before reporting it.
                if refreshed or exc.status_code not in (S.LLM_KV_CACHE_NOT_EXIST, S.LLM_PARAM_INVALID):
                    raise
            if refreshed:
                raise LLMException(f"the cache table of cluster {peer.cluster_id} keeps changing",
                                   status_code=S.LLM_KV_CACHE_NOT_EXIST)
            refreshed = True
            with peer.table_lock:
                self.refresh_table(peer, _left(deadline))

    @staticmethod
    def _generation(peer: Peer) -> int:
        """The peer's registry generation now (same-host plane)."""
        counter = peer.generation
        if counter is not None:
            value = counter.value
            if value is not None:
                return value
            raise _fail(S.LLM_LINK_FAILED, f"the link to cluster {peer.cluster_id} is closed")
        st, err, generation = _planes.cma_read_u64(peer.pid, peer.generation_addr)
        if st != 0:
            raise _fail(S.LLM_LINK_FAILED, f"cluster {peer.cluster_id} (pid {peer.pid}) is not "
                                           f"reachable: {os.strerror(err) if err else _status(st).name}")
        return generation

    def _tcp(self, peer: Peer, plan, write: bool, generation: int, deadline: float) -> None:
        channels = [c for c in peer.channels if c.broken is None] or peer.channels[:1]
        if plan.total_bytes < PARALLEL_TCP_BYTES or len(channels) < 2 or len(plan) < 2:
            (channels[0].push if write else channels[0].pull)(plan, generation, _left(deadline))
            return
        # Large transfers: one share per connection, each on its own thread.
        shares = _core.split_plan(plan, len(channels))
        errors: List[BaseException] = []

        def run(channel: Channel, share) -> None:
            try:
                (channel.push if write else channel.pull)(share, generation, _left(deadline))
            except BaseException as exc:  # re-raised in the calling thread below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(c, p), daemon=True) for c, p in zip(channels[1:], shares[1:])]
        for thread in threads:
            thread.start()
        run(channels[0], shares[0])
        for thread in threads:
            thread.join()
        for exc in errors:
            if not isinstance(exc, _StaleTable):
                raise exc
        if errors:
            raise errors[0]

    def _cma(self, peer: Peer, plan, write: bool, deadline: float) -> None:
        bad = peer.table.ranges.first_outside(plan, write)
        if bad >= 0:
            raise _fail(S.LLM_KV_CACHE_NOT_EXIST, f"descriptor {bad} names memory that cluster "
                                                  f"{peer.cluster_id} has not registered")
        if plan.total_bytes >= PARALLEL_CMA_BYTES and len(plan) > 1:
            st, err = self._cma_parallel(peer, plan, write, _left(deadline))
        else:
            st, err = _planes.cma_copy(peer.pid, plan, write, _left(deadline), peer.pidfd)
        if st != 0:
            what = os.strerror(err) if err else _status(st).name
            code = st if st in (S.LLM_TIMEOUT, S.LLM_LINK_FAILED) else S.LLM_LINK_FAILED
            raise _fail(code, f"same-host {'write to' if write else 'read from'} cluster "
                              f"{peer.cluster_id} failed: {what}")

    def _cma_parallel(self, peer: Peer, plan, write: bool, timeout_ms: int) -> Tuple[int, int]:
        # Large transfers: two halves on two threads (the kernel copy is CPU-bound per thread).
        halves = _core.split_plan(plan, 2)
        result: List[Tuple[int, int]] = [(0, 0)]

        def other() -> None:
            result[0] = _planes.cma_copy(peer.pid, halves[1], write, timeout_ms, peer.pidfd)

        thread = threading.Thread(target=other, daemon=True)
        thread.start()
        mine = _planes.cma_copy(peer.pid, halves[0], write, timeout_ms, peer.pidfd)
        thread.join()
        return mine if mine[0] != 0 else result[0]

    def release_key(self, remote_cluster_id: int, owner_key: tuple, tensors: List[int], timeout_ms: int) -> bool:
        """Tell the owner which tensors of a keyed row were pulled; True if it released the key."""
        peer = self.peer(remote_cluster_id)
        _, reply = peer.outgoing.control(wire.OP_KEY_DONE, wire.OP_KEY_DONE_REPLY,
                                         {"key": list(owner_key), "tensors": tensors}, timeout_ms, "key release")
        return bool(reply.get("released"))

    # -- two-sided links ---------------------------------------------------------------------------
    def new_comm(self, name: str, key: Tuple[str, str], members, me) -> Comm:
        with self._lock:
            comm = Comm(self._next_comm_id, name, key, list(members), me)
            self._next_comm_id += 1
        return comm

    def join_comm(self, comm: Comm, timeout_ms: int) -> None:
        """Make the links of a two-sided link: listen for the members of higher rank, link to those
        of lower rank (retrying while they are not listening yet), and wait for every link; then
        fetch the tables in the background (``comm.status`` PREPARING -> OK or FAILED).
        ``LLMException(LLM_LINK_FAILED)`` if not every link is made within ``timeout_ms``."""
        deadline = time.monotonic() + timeout_ms / 1000
        higher = [m for m in comm.others if m.rank > comm.me.rank]
        lower = [m for m in comm.others if m.rank < comm.me.rank]
        listen_at = (comm.me.device_ip, comm.me.port) if higher else None
        if listen_at is not None:
            self._open_comm_listener(*listen_at)
        with self._lock:
            self._joining[comm.key] = {m.cluster_id for m in higher}
        try:
            for member in lower:
                status = S.LLM_LINK_FAILED
                while time.monotonic() < deadline:
                    status = self.link(member.cluster_id, member.device_ip, member.port, max(1, _left(deadline)),
                                       comm=comm.key, quiet=True)
                    if status not in (S.LLM_LINK_FAILED, S.LLM_NOT_YET_LINK, S.LLM_ALREADY_LINK):
                        break
                    time.sleep(0.05)
                if status != S.LLM_SUCCESS:
                    raise _fail(S.LLM_LINK_FAILED, f"cluster {member.cluster_id} (rank {member.rank}) at "
                                                   f"{member.device_ip}:{member.port} was not linked in time "
                                                   f"({_status(status).name})")
            for member in higher:
                while not self._linked_now(member.cluster_id):
                    if time.monotonic() >= deadline:
                        raise _fail(S.LLM_LINK_FAILED, f"cluster {member.cluster_id} (rank {member.rank}) did not "
                                                       f"link to {comm.me.device_ip}:{comm.me.port} in time")
                    time.sleep(0.01)
        except BaseException:
            with self._lock:
                self._joining.pop(comm.key, None)
            for member in comm.others:  # links made for this comm go with it
                self._drop_comm_link(member.cluster_id, comm.key)
            raise
        finally:
            with self._lock:
                self._joining.pop(comm.key, None)
            if listen_at is not None:
                self._close_comm_listener(listen_at)
        with self._lock:
            self.comms[comm.comm_id] = comm
        self._spawn(self._prepare_comm, comm)

    def _linked_now(self, cluster_id: int) -> bool:
        with self._lock:
            peer = self._peers.get(cluster_id)
            return peer is not None and peer.ready

    def _prepare_comm(self, comm: Comm) -> None:
        deadline = time.monotonic() + self.handshake_ms / 1000
        try:
            for member in comm.others:
                self._settle(self.peer(member.cluster_id), deadline)
            comm.status = "OK"
        except LLMException as exc:
            logger.error("cluster %d: link %r failed while exchanging cache tables: %s", self.engine.cluster_id,
                         comm.name, exc)
            comm.status = "FAILED"

    def comm(self, comm_id: int) -> Comm:
        with self._lock:
            comm = self.comms.get(comm_id)
        if comm is None:
            raise LLMException(f"comm_id {comm_id} is not a link of this cluster", status_code=S.LLM_NOT_YET_LINK)
        return comm

    def leave_comm(self, comm_id: int, timeout_ms: int) -> None:
        """Drop a two-sided link: its links (those made for it) are unlinked."""
        comm = self.comm(comm_id)
        with self._lock:
            self.comms.pop(comm_id, None)
        for member in comm.others:
            self._drop_comm_link(member.cluster_id, comm.key, timeout_ms)

    def _drop_comm_link(self, cluster_id: int, key: Tuple[str, str], timeout_ms: int = 1000) -> None:
        with self._lock:
            peer = self._peers.get(cluster_id)
            shared = any(c.key != key and any(m.cluster_id == cluster_id for m in c.others)
                         for c in self.comms.values())
        if peer is not None and peer.comm == key and not shared:
            self.unlink(cluster_id, timeout_ms, force=False)
        with self._lock:
            self._unlinked_by_peer.discard(cluster_id)
            self._lost.pop(cluster_id, None)

    def _open_comm_listener(self, ip: str, port: int) -> None:
        with self._lock:
            entry = self._comm_listeners.get((ip, port))
            if entry is not None:
                entry[1] += 1
                return
        try:
            sock = _tcp_listener(ip, port)
        except OSError as exc:
            raise _fail(S.LLM_LINK_FAILED, f"cannot listen on {ip}:{port}, this member's rank-table address "
                                           f"(device_ip, port base + 16 x device_id + rank_id): {exc}") from None
        sock.settimeout(0.2)
        unix = None
        with self._lock:
            self._comm_listeners[(ip, port)] = [sock, 1]
            if self.unix_name is None and self._comm_unix_name is None:
                unix, self._comm_unix_name = _unix_listener()
                if unix is not None:
                    self._comm_listeners[("", 0)] = [unix, 1]
        for listener in [sock] + ([unix] if unix is not None else []):
            listener.settimeout(0.2)
            threading.Thread(target=self._accept_loop, args=(listener,), daemon=True,
                             name=f"llm_datadist-listen-{port}").start()
        if self.secret is None and not _is_loopback(ip):
            _warn_once(f"cluster {self.engine.cluster_id} listens on {ip}:{port} without a link secret: any "
                       f"process that reaches this address can link, read and write the registered caches "
                       f"(set {auth.SECRET_OPTION} / {auth.SECRET_ENV} on every cluster)")

    def _close_comm_listener(self, key: Tuple[str, int]) -> None:
        with self._lock:
            entry = self._comm_listeners.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._comm_listeners[key]
            closing = [entry[0]]
            if list(self._comm_listeners) == [("", 0)]:  # the last one: its Unix socket goes too
                closing.append(self._comm_listeners.pop(("", 0))[0])
                self._comm_unix_name = None
        for sock in closing:
            _close(sock)

    # -- notifications --------------------------------------------------------------------------
    def set_notify_handler(self, handler: Optional[Callable[[int, Dict[str, Any]], Dict[str, Any]]]) -> None:
        """Answer the linked peers' notifications with ``handler(peer_cluster_id, message) -> reply``
        (JSON objects; it runs on the connection's thread, so it must be quick). None: refuse them
        with ``LLM_FEATURE_NOT_ENABLED``."""
        self._notify_handler = handler

    def notify(self, remote_cluster_id: int, message: Dict[str, Any], timeout_ms: int) -> Dict[str, Any]:
        """Send a JSON object to a linked peer over the link (authenticated like it) and return
        its handler's reply; ``LLMException`` with the peer's status if it refused or failed."""
        peer = self.peer(remote_cluster_id)
        try:
            status, reply = peer.outgoing.control(wire.OP_NOTIFY, wire.OP_NOTIFY_REPLY, message, timeout_ms,
                                                  "notification")
        finally:
            why = peer.broken()
            if why is not None:
                self._lose(peer, why)
        if status != 0:
            raise _fail(status, f"cluster {remote_cluster_id} did not take the notification: "
                                f"{_status(status).name} ({reply.get('error', '')})")
        return reply

    # -- life cycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Tell every linked peer that its link ends (as CANN's finalize unlinks everything, so
        that the peers see an unlink rather than a lost link), stop listening, drop every link
        and join the connection threads."""
        with self._lock:
            linked = [cid for cid, peer in self._peers.items() if peer.ready and not peer.hung_up()]
        _parallel(lambda cid: self.unlink(cid, FINALIZE_UNLINK_MS, force=False), linked)
        self._closed = True
        self.stop_listener()
        with self._lock:
            peers = list(self._peers.values()) + self._self_peers
            self._peers.clear()
            self._self_peers = []
            self._pending.clear()
            comm_listeners = [entry[0] for entry in self._comm_listeners.values()]
            self._comm_listeners.clear()
        for sock in comm_listeners:
            _close(sock)
        with self._lock:
            threads = list(self._threads)
            incoming = list(self._incoming)
        for peer in peers:
            peer.close()
        for sock in incoming:  # connections still in their handshake
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=2)


def _tcp_listener(ip: str, port: int) -> socket.socket:
    """A listening TCP socket on ``ip:port``; OSError if it cannot be had."""
    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def _unix_listener() -> Tuple[Optional[socket.socket], Optional[str]]:
    """A listening Unix socket of a random abstract name (per network namespace), or Nones."""
    name = f"llm_datadist.{os.getpid()}.{os.urandom(12).hex()}"
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except (OSError, AttributeError):
        return None, None
    try:
        sock.bind("\0" + name)
        sock.listen(128)
    except OSError:
        sock.close()
        return None, None
    return sock, name


def _is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return ip == "localhost"


_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _parallel(fn: Callable[[Any], LLMStatusCode], items: List[Any]) -> List[LLMStatusCode]:
    if len(items) <= 1:
        return [fn(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=min(16, len(items)), thread_name_prefix="llm_datadist-link") as pool:
        return list(pool.map(fn, items))


def _left(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000))


def _env_bytes(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, str(default)))
    except ValueError:
        return default


def _buffer_bytes() -> int:
    return _env_bytes("LLM_DATADIST_TCP_BUFFER", 4 << 20)


def _tune(sock: socket.socket) -> None:
    """No Nagle delay for the small control frames; large socket buffers for the data
    (``LLM_DATADIST_TCP_BUFFER`` bytes, default 4 MiB; 0 leaves the system's autotuning). A
    receiver waiting for a large payload is woken once 1 MiB (a quarter of the buffer at most) is
    queued rather than for every segment: on loopback that is a third more throughput."""
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A peer whose host vanished without closing its connections is noticed (and its link
        # dropped) within about a minute.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 6)):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    size = _buffer_bytes()
    if size > 0:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, size)
            except OSError:
                pass


def _recv_lowat() -> int:
    """``LLM_DATADIST_TCP_LOWAT`` bytes (0 = off), default 1 MiB, at most a quarter of the buffer."""
    cap = max(0, _buffer_bytes()) // 4 or 1 << 20
    return max(0, min(_env_bytes("LLM_DATADIST_TCP_LOWAT", 1 << 20), cap))


_planes.set_recv_lowat(_recv_lowat())


def _close(sock: Optional[socket.socket]) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
