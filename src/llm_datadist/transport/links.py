"""Links between clusters: the listener, the handshake, per-peer state and the data planes.

A link between a client (the side calling ``link_clusters``) and a server (the side with
``listen_ip_info``) is two TCP connections, both opened by the client:

* the *forward* connection carries the client's requests; a server thread serves it;
* the *reverse* connection carries the server's requests; a client thread serves it.

So either side can push to or pull from the other. The handshake (first frame on each
connection) exchanges magic, protocol version, cluster ids, roles, pids, host identity, the
offered data planes, the remote-cache-accessible setting and each side's cache table. Each side
then picks the plane for its own outgoing transfers:

* ``cma`` (same host): the peer's memory is read or written directly with
  ``process_vm_readv``/``process_vm_writev``, planned against the peer's published table;
* ``tcp``: frames on the connection, the payload scatter/gathered straight from and into cache
  memory; the side that owns the memory checks every range against its own registry.

``cma`` is chosen when both sides share a host identity and a probe read of the peer succeeds;
otherwise ``tcp`` (and the fallback is logged). The option ``llm.DataPlane`` (or the environment
variable ``LLM_DATADIST_DATA_PLANE``) forces ``cma`` or ``tcp``; ``auto`` is the default.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from llm_datadist import _core, _planes
from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.transport import wire
from llm_datadist.transport.host import host_identity, same_host
from llm_datadist.transport.shm import PeerCounter
from llm_datadist.transport.table import RemoteTable
from llm_datadist.transport.wire import ProtocolError

logger = logging.getLogger("llm_datadist")

PLANES = ("auto", "cma", "tcp")
DATA_PLANE_OPTION = "llm.DataPlane"
DATA_PLANE_ENV = "LLM_DATADIST_DATA_PLANE"
#: How long a fresh connection may take to send its hello, and a started frame to arrive whole.
HANDSHAKE_TIMEOUT_MS = 10000
FRAME_TIMEOUT_MS = 30000
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
    """This side's state for one linked cluster."""

    cluster_id: int
    role: str
    pid: int
    host: Dict[str, str]
    plane: str
    outgoing: Optional[Channel]  # None on the server until the reverse connection arrives
    table: RemoteTable
    generation_addr: int
    is_client: bool
    address: Tuple[str, int]
    incoming: Optional[socket.socket] = None
    generation: Optional[PeerCounter] = None
    pidfd: int = -1
    extra: List[Channel] = field(default_factory=list)  # more outgoing data connections
    extra_incoming: List[socket.socket] = field(default_factory=list)
    table_lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        for channel in [self.outgoing] + self.extra:
            if channel is not None:
                channel.close()
        for sock in [self.incoming] + self.extra_incoming:
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class LinkManager:
    """The link table of one engine, its listener and its connection threads."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.plane = resolve_plane(engine.options)
        self.remote_accessible = engine.options.get("llm.EnableRemoteCacheAccessible", "0") == "1"
        self.cookie = _planes.Word(int.from_bytes(os.urandom(8), "little") | 1)
        self._lock = threading.RLock()
        self._peers: Dict[int, Peer] = {}
        self._listener: Optional[socket.socket] = None
        self._listen_thread: Optional[threading.Thread] = None
        self._threads: List[threading.Thread] = []
        self._incoming: set = set()  # accepted connections still served by a thread of ours
        self._closed = False
        self._notify_handler: Optional[Callable[[int, Dict[str, Any]], Dict[str, Any]]] = None

    # -- listener ---------------------------------------------------------------------------------
    @property
    def listen_address(self) -> Optional[Tuple[str, int]]:
        if self._listener is None:
            return None
        host, port = self._listener.getsockname()[:2]
        return host, port

    def start_listener(self, ip: str, port: int) -> None:
        """Listen on ``ip:port`` (port 0 = any free port; see ``listen_address``)."""
        self.stop_listener()
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((ip, port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise LLMException(f"cannot listen on {ip}:{port}: {exc}", status_code=S.LLM_PARAM_INVALID) from None
        sock.settimeout(0.2)
        self._listener = sock
        thread = threading.Thread(target=self._accept_loop, args=(sock,), daemon=True,
                                  name=f"llm_datadist-listen-{port}")
        self._listen_thread = thread
        thread.start()
        logger.info("cluster %d listening on %s:%d", self.engine.cluster_id, *self.listen_address)

    def stop_listener(self) -> None:
        sock, thread = self._listener, self._listen_thread
        self._listener = self._listen_thread = None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2)

    def _accept_loop(self, listener: socket.socket) -> None:
        while self._listener is listener:
            try:
                conn, addr = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            _tune(conn)
            conn.setblocking(False)
            with self._lock:
                self._incoming.add(conn)
            self._spawn(self._serve_accepted, conn, f"{addr[0]}:{addr[1]}")

    def _spawn(self, target: Callable, *args) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, daemon=True, name="llm_datadist-conn")
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()
        return thread

    # -- handshake --------------------------------------------------------------------------------
    def _hello(self, purpose: str, **extra) -> Dict[str, Any]:
        engine = self.engine
        return dict(purpose=purpose, cluster_id=engine.cluster_id, role=engine.role, pid=os.getpid(),
                    host=host_identity(), planes=["cma", "tcp"] if self.plane != "tcp" else ["tcp"],
                    remote_cache_accessible=self.remote_accessible,
                    probe=[self.cookie.addr, self.cookie.value],
                    generation_addr=engine.generation_word.addr, generation_fd=engine.generation_word.fd,
                    table=engine.export_table(), **extra)

    def _choose_plane(self, hello: Dict[str, Any]) -> str:
        """The plane for this side's transfers to the peer that sent ``hello``."""
        offered = hello.get("planes") or ["tcp"]
        if self.plane == "tcp" or "cma" not in offered:
            if self.plane == "cma":
                raise _fail(S.LLM_LINK_FAILED, "llm.DataPlane=cma but the peer does not offer it")
            return "tcp"
        reason = None
        if not same_host(host_identity(), hello.get("host") or {}):
            reason = "the peer is on another host (boot id / pid or network namespace differ)"
        else:
            addr, value = hello["probe"]
            st, err, data = _planes.cma_read_bytes(int(hello["pid"]), int(addr), 8)
            if st != 0 or int.from_bytes(data, "little") != value:
                reason = f"a probe read of the peer failed ({os.strerror(err) if err else 'mismatch'})"
        if reason is None:
            return "cma"
        if self.plane == "cma":
            raise _fail(S.LLM_LINK_FAILED, f"llm.DataPlane=cma but {reason}")
        logger.warning("cluster %d -> %d: same-host plane not usable (%s); using tcp",
                       self.engine.cluster_id, hello.get("cluster_id"), reason)
        return "tcp"

    @staticmethod
    def _attach_same_host(peer: Peer, hello: Dict[str, Any]) -> None:
        """Map the peer's generation counter and hold a pidfd of it (same-host plane only)."""
        peer.generation = PeerCounter.open(peer.pid, int(hello.get("generation_fd", -1)))
        try:
            peer.pidfd = os.pidfd_open(peer.pid)
        except (AttributeError, OSError):
            peer.pidfd = -1

    @staticmethod
    def _check_hello(hello: Dict[str, Any]) -> None:
        """Every field a hello (or hello reply) must carry, with its type."""
        def is_int(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        checks = {
            "purpose": lambda v: isinstance(v, str),
            "cluster_id": lambda v: is_int(v) and 0 <= v < 2**64,
            "role": lambda v: isinstance(v, str),
            "pid": lambda v: is_int(v) and 0 < v < 2**31,
            "host": lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
            "planes": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
            "probe": lambda v: isinstance(v, list) and len(v) == 2 and all(is_int(x) and 0 <= x < 2**64 for x in v),
            "generation_addr": lambda v: is_int(v) and 0 <= v < 2**64,
            "generation_fd": lambda v: is_int(v) and -1 <= v < 2**31,
            "table": lambda v: isinstance(v, dict),
        }
        for key, ok in checks.items():
            if key not in hello:
                raise ProtocolError(f"hello lacks {key!r}")
            if not ok(hello[key]):
                raise ProtocolError(f"hello: {key} = {hello[key]!r} is malformed")
        if "token" in hello and not is_int(hello["token"]):
            raise ProtocolError("hello: token must be an integer")

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
        finally:
            with self._lock:
                self._incoming.discard(conn)
            if not handed_over:
                _close(conn)

    def _handshake_accepted(self, conn: socket.socket, name: str) -> bool:
        fd = conn.fileno()
        header = bytearray(wire.HEADER_BYTES)
        st, _, _ = _planes.recv_into(fd, header, HANDSHAKE_TIMEOUT_MS)
        if st != 0:
            return False  # closed or silent before a hello
        op, _, req_id, length = wire.unpack_header(header)
        if op != wire.OP_HELLO or length > wire.MAX_CONTROL_BYTES:
            raise ProtocolError(f"first frame is {wire.OP_NAMES[op]} of {length} bytes, not a hello")
        body = bytearray(length)
        st, _, _ = _planes.recv_into(fd, body, HANDSHAKE_TIMEOUT_MS)
        if st != 0:
            raise ProtocolError(f"hello truncated ({_status(st).name})")
        hello = wire.decode_json(body)
        self._check_hello(hello)
        status, reply, keep = self._accept_hello(hello, conn, name)
        payload = wire.encode_json(reply)
        st, _ = _planes.send_bytes(fd, wire.pack_header(wire.OP_HELLO_REPLY, req_id, len(payload), status)
                                   + payload, HANDSHAKE_TIMEOUT_MS)
        if status != 0 or st != 0:
            if status == 0 and isinstance(keep, Peer):
                self._drop_peer(keep.cluster_id, keep)
            return False
        if isinstance(keep, Peer):
            self._serve(conn, name, keep)
            if keep.outgoing is None:
                # The client gave up before its reverse connection arrived: no half-made link stays.
                self._drop_peer(keep.cluster_id, keep)
            return True  # _serve closed it
        return True  # the socket now belongs to the peer's outgoing Channel

    def _accept_hello(self, hello: Dict[str, Any], conn: socket.socket, name: str):
        """Decide on a hello: ``(status, reply, keep)``; ``keep`` is the new Peer whose requests
        this connection carries, "channel" for a reverse connection, or None."""
        peer_id = hello["cluster_id"]
        reply: Dict[str, Any] = {"cluster_id": self.engine.cluster_id}
        if hello["purpose"] in ("reverse", "forward"):
            # A further connection of a link being made: the token names the pending Peer.
            with self._lock:
                peer = self._peers.get(peer_id)
                if peer is None or hello.get("token") != id(peer):
                    return S.LLM_LINK_FAILED, dict(reply, error="no pending link for this connection"), None
                if hello["purpose"] == "forward":
                    peer.extra_incoming.append(conn)
                    return S.LLM_SUCCESS, reply, peer
                channel = Channel(conn, f"cluster {peer_id} ({name})")
                if peer.outgoing is None:
                    peer.outgoing = channel
                else:
                    peer.extra.append(channel)
            return S.LLM_SUCCESS, reply, "channel"
        if hello["purpose"] != "link":
            return S.LLM_PARAM_INVALID, dict(reply, error=f"unknown purpose {hello['purpose']!r}"), None
        if peer_id == self.engine.cluster_id:
            return S.LLM_PARAM_INVALID, dict(reply, error="a cluster cannot link to its own id"), None
        if bool(hello.get("remote_cache_accessible")) != self.remote_accessible:
            return S.LLM_PARAM_INVALID, dict(reply, error="enable_remote_cache_accessible differs "
                                                          "between the two clusters"), None
        try:
            table = RemoteTable(hello["table"])
            plane = self._choose_plane(hello)
        except ProtocolError as exc:
            return S.LLM_PARAM_INVALID, dict(reply, error=str(exc)), None
        except LLMException as exc:
            return int(exc.status_code), dict(reply, error=str(exc)), None
        with self._lock:
            old = self._peers.get(peer_id)
            if old is not None and not hello.get("force_link"):
                return S.LLM_ALREADY_LINK, dict(reply, error=f"cluster {peer_id} is already linked"), None
            if old is not None:
                self._peers.pop(peer_id)
                old.close()
            peer = Peer(peer_id, str(hello["role"]), hello["pid"], hello["host"], plane, None, table,
                        int(hello["generation_addr"]), False, (name, 0), incoming=conn)
            if plane == "cma":
                self._attach_same_host(peer, hello)
            self._peers[peer_id] = peer
        reply.update(self._hello("link-reply", token=id(peer)))
        return S.LLM_SUCCESS, reply, peer

    # -- serving requests -------------------------------------------------------------------------
    def _serve(self, conn: socket.socket, name: str, peer: Peer) -> None:
        """Serve the peer's requests on ``conn`` until it closes or breaks the protocol."""
        peer_id = peer.cluster_id
        fd = conn.fileno()
        header = bytearray(wire.HEADER_BYTES)
        try:
            while not self._closed:
                st, _, got = _planes.recv_into(fd, header, -1)
                if st != 0:
                    break
                op, _, req_id, length = wire.unpack_header(header)
                if op not in wire.REQUEST_OPS or op == wire.OP_HELLO:
                    raise ProtocolError(f"{wire.OP_NAMES[op]} is not a request")
                if not self._handle(fd, op, req_id, length, peer):
                    break
        except ProtocolError as exc:
            logger.warning("closing connection from %s (cluster %s): %s", name, peer_id, exc)
            self.engine.count_protocol_error()
        finally:
            _close(conn)

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
            return self._reply(fd, wire.OP_TABLE, req_id, 0, wire.encode_json(engine.export_table()))
        if op == wire.OP_KEY_DONE:
            message = wire.decode_json(self._recv_exact(fd, length, wire.MAX_CONTROL_BYTES, "key release"))
            try:
                kind, ident, model_id = message["key"]
                released = engine.consume_key((str(kind), int(ident), int(model_id)),
                                              [int(t) for t in message["tensors"]])
            except (KeyError, TypeError, ValueError) as exc:
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
                if self._peers.get(peer_id) is peer:
                    del self._peers[peer_id]
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
    def link(self, remote_cluster_id: int, ip: str, port: int, timeout_ms: int) -> LLMStatusCode:
        """Link to the cluster listening on ``ip:port``; returns a status, never raises."""
        deadline = time.monotonic() + timeout_ms / 1000
        with self._lock:
            if remote_cluster_id in self._peers:
                return S.LLM_ALREADY_LINK
        if remote_cluster_id == self.engine.cluster_id:
            logger.error("cluster %d cannot link to itself", remote_cluster_id)
            return S.LLM_PARAM_INVALID
        sockets: List[Tuple[str, socket.socket]] = []
        try:
            return self._link(remote_cluster_id, ip, port, deadline, sockets)
        except LLMException as exc:
            logger.error("link %d -> %d failed: %s", self.engine.cluster_id, remote_cluster_id, exc)
            status = exc.status_code
        except Exception as exc:  # a refused connection, a malformed reply: the link fails, never raises
            logger.error("link %d -> %d (%s:%d) failed: %s: %s", self.engine.cluster_id, remote_cluster_id,
                         ip, port, type(exc).__name__, exc)
            status = S.LLM_LINK_FAILED
        for _, sock in sockets:
            _close(sock)
        return status

    def _link(self, remote_cluster_id: int, ip: str, port: int, deadline: float,
              sockets: List[Tuple[str, socket.socket]]) -> LLMStatusCode:
        """The steps of ``link``; every socket it opens goes to ``sockets`` (closed by the caller
        unless the link is made, in which case ``sockets`` is emptied)."""
        forward, status, reply = self._handshake(ip, port, self._hello("link", force_link=True), deadline)
        sockets.append(("link", forward))
        if status != 0:
            logger.error("link %d -> %d refused: %s (%s)", self.engine.cluster_id, remote_cluster_id,
                         _status(status).name, reply.get("error", ""))
            return _status(status)
        if reply.get("cluster_id") != remote_cluster_id:
            logger.error("link to %s:%d: expected cluster %d, found cluster %s", ip, port,
                         remote_cluster_id, reply.get("cluster_id"))
            return S.LLM_LINK_FAILED
        self._check_hello(reply)
        if "token" not in reply:
            raise ProtocolError("hello reply lacks 'token'")
        table = RemoteTable(reply["table"])
        plane = self._choose_plane(reply)
        # The reverse connection (the server's requests), then the extra data connections of each
        # direction.
        for purpose in ["reverse"] + ["forward", "reverse"] * (CONNECTIONS_PER_DIRECTION - 1):
            sock, status, rreply = self._handshake(ip, port, self._hello(purpose, token=reply["token"]), deadline)
            sockets.append((purpose, sock))
            if status != 0:
                logger.error("link %d -> %d: %s connection refused: %s", self.engine.cluster_id,
                             remote_cluster_id, purpose, rreply.get("error", ""))
                return S.LLM_LINK_FAILED
        name = f"cluster {remote_cluster_id} ({ip}:{port})"
        peer = Peer(remote_cluster_id, reply["role"], reply["pid"], reply["host"], plane,
                    Channel(forward, name), table, reply["generation_addr"], True, (ip, port),
                    incoming=sockets[1][1])
        for purpose, sock in sockets[2:]:
            if purpose == "forward":
                peer.extra.append(Channel(sock, name))
            else:
                peer.extra_incoming.append(sock)
        if plane == "cma":
            self._attach_same_host(peer, reply)
        with self._lock:
            if remote_cluster_id in self._peers:
                peer.close()
                return S.LLM_ALREADY_LINK
            self._peers[remote_cluster_id] = peer
        reverse = [sock for purpose, sock in sockets if purpose == "reverse"]
        sockets.clear()  # they belong to the link now
        for sock in reverse:
            self._spawn(self._serve, sock, f"{ip}:{port}", peer)
        logger.info("cluster %d linked to %d at %s:%d (data plane %s)", self.engine.cluster_id,
                    remote_cluster_id, ip, port, plane)
        return S.LLM_SUCCESS

    def _handshake(self, ip: str, port: int, hello: Dict[str, Any], deadline: float):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise LLMException("link timed out", status_code=S.LLM_LINK_FAILED)
        sock = socket.create_connection((ip, port), timeout=remaining)
        try:
            _tune(sock)
            sock.setblocking(False)
            fd = sock.fileno()
            payload = wire.encode_json(hello)
            ms = max(1, int((deadline - time.monotonic()) * 1000))
            st, _ = _planes.send_bytes(fd, wire.pack_header(wire.OP_HELLO, 1, len(payload)) + payload, ms)
            if st != 0:
                raise LLMException(f"hello to {ip}:{port} failed", status_code=S.LLM_LINK_FAILED)
            header = bytearray(wire.HEADER_BYTES)
            ms = max(1, int((deadline - time.monotonic()) * 1000))
            st, _, _ = _planes.recv_into(fd, header, ms)
            if st != 0:
                raise LLMException(f"no hello reply from {ip}:{port} ({_status(st).name})",
                                   status_code=S.LLM_LINK_FAILED)
            op, status, _, length = wire.unpack_header(header)
            if op != wire.OP_HELLO_REPLY or length > wire.MAX_CONTROL_BYTES:
                raise ProtocolError(f"unexpected {wire.OP_NAMES[op]} in reply to a hello")
            body = bytearray(length)
            ms = max(1, int((deadline - time.monotonic()) * 1000))
            st, _, _ = _planes.recv_into(fd, body, ms)
            if st != 0:
                raise LLMException(f"hello reply from {ip}:{port} truncated", status_code=S.LLM_LINK_FAILED)
            return sock, status, wire.decode_json(body) if body else {}
        except BaseException:
            _close(sock)
            raise

    def link_many(self, targets: List[Tuple[int, str, int]], timeout_ms: int) -> List[LLMStatusCode]:
        """Link to every ``(cluster_id, ip, port)`` in parallel (at most 16 at a time)."""
        return _parallel(lambda t: self.link(t[0], t[1], t[2], timeout_ms), targets)

    def unlink_many(self, cluster_ids: List[int], timeout_ms: int, force: bool) -> List[LLMStatusCode]:
        return _parallel(lambda cid: self.unlink(cid, timeout_ms, force), cluster_ids)

    def unlink(self, remote_cluster_id: int, timeout_ms: int, force: bool) -> LLMStatusCode:
        """Drop the link; unless ``force``, tell the peer first. Local state goes either way."""
        with self._lock:
            peer = self._peers.get(remote_cluster_id)
        if peer is None:
            return S.LLM_NOT_YET_LINK if not force else S.LLM_SUCCESS
        status = S.LLM_SUCCESS
        if not force and peer.outgoing is not None:
            try:
                peer.outgoing.control(wire.OP_UNLINK, wire.OP_UNLINK_DONE, {"cluster_id": self.engine.cluster_id,
                                                                            "timeout": timeout_ms},
                                      timeout_ms, "unlink")
            except LLMException as exc:
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
        peer.close()

    def has_links(self) -> bool:
        with self._lock:
            return bool(self._peers)

    def linked_clusters(self) -> List[int]:
        with self._lock:
            return sorted(self._peers)

    def peer(self, remote_cluster_id: int) -> Peer:
        with self._lock:
            peer = self._peers.get(remote_cluster_id)
        if peer is None:
            raise LLMException(f"cluster {self.engine.cluster_id} has no link to cluster "
                               f"{remote_cluster_id}", status_code=S.LLM_NOT_YET_LINK)
        if peer.outgoing is None:
            raise LLMException(f"the link to cluster {remote_cluster_id} is still being set up",
                               status_code=S.LLM_NOT_YET_LINK)
        return peer

    # -- transfers --------------------------------------------------------------------------------
    def refresh_table(self, peer: Peer, timeout_ms: int) -> RemoteTable:
        status, body = peer.outgoing.control(wire.OP_TABLE_GET, wire.OP_TABLE, {}, timeout_ms, "cache table")
        try:
            table = RemoteTable(body)
        except ProtocolError as exc:
            raise LLMException(f"cluster {peer.cluster_id} sent a bad cache table: {exc}",
                               status_code=S.LLM_LINK_FAILED) from None
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
                raise LLMException(f"the cache table of cluster {remote_cluster_id} keeps changing",
                                   status_code=S.LLM_KV_CACHE_NOT_EXIST)
            refreshed = True
            with peer.table_lock:
                self.refresh_table(peer, _left(deadline))

    @staticmethod
    def _generation(peer: Peer) -> int:
        """The peer's registry generation now (same-host plane)."""
        if peer.generation is not None:
            return peer.generation.value
        st, err, generation = _planes.cma_read_u64(peer.pid, peer.generation_addr)
        if st != 0:
            raise _fail(S.LLM_LINK_FAILED, f"cluster {peer.cluster_id} (pid {peer.pid}) is not "
                                           f"reachable: {os.strerror(err) if err else _status(st).name}")
        return generation

    def _tcp(self, peer: Peer, plan, write: bool, generation: int, deadline: float) -> None:
        channels = [peer.outgoing] + [c for c in peer.extra if c.broken is None]
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
        status, reply = peer.outgoing.control(wire.OP_NOTIFY, wire.OP_NOTIFY_REPLY, message, timeout_ms,
                                              "notification")
        if status != 0:
            raise _fail(status, f"cluster {remote_cluster_id} did not take the notification: "
                                f"{_status(status).name} ({reply.get('error', '')})")
        return reply

    # -- life cycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop listening, drop every link and join the connection threads."""
        self._closed = True
        self.stop_listener()
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
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
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
