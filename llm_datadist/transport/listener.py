"""The listeners of a cluster: its TCP listener (``listen_ip_info``, and those of two-sided links)
and an abstract Unix socket that same-host peers learn after authenticating; the accept loop,
which survives transient ``accept()`` failures (backing off up to a second), bounds the
connections still in their handshake (``LLM_DATADIST_MAX_PENDING_HANDSHAKES``) and hands each
accepted connection to its own thread (``handshake.Handshakes._serve_accepted``).

``Listeners`` is a part of ``links.LinkManager``: it uses the manager's lock, counters and
threads (set up in ``LinkManager.__init__``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from llm_datadist import _io
from llm_datadist.status import LLMException
from llm_datadist.transport import auth
from llm_datadist.transport.errors import S, fail

logger = logging.getLogger("llm_datadist")

#: How long an accepted connection may take over its whole handshake (idle or unauthenticated
#: connections are closed then).
DEFAULT_HANDSHAKE_TIMEOUT_MS = 5000
HANDSHAKE_TIMEOUT_ENV = "LLM_DATADIST_HANDSHAKE_TIMEOUT_MS"
#: Connections accepted but not yet through their handshake; more are closed at once.
DEFAULT_MAX_PENDING = 64
MAX_PENDING_ENV = "LLM_DATADIST_MAX_PENDING_HANDSHAKES"
#: Links a cluster holds (each costs a thread per incoming connection, two by default).
DEFAULT_MAX_LINKS = 256
MAX_LINKS_ENV = "LLM_DATADIST_MAX_LINKS"


def env_int(name: str, default: int, lo: int = 1) -> int:
    try:
        return max(lo, int(os.environ.get(name, str(default))))
    except ValueError:
        return default


class Listeners:
    """Listening and accepting, as part of ``LinkManager``."""

    engine: Any
    secret: Optional[bytes]
    max_pending: int
    stats: Dict[str, int]
    unix_name: Optional[str]
    _lock: Any
    _listeners: List[socket.socket]
    _listen_threads: List[threading.Thread]
    _comm_listeners: Dict[Tuple[str, int], List[Any]]
    _comm_unix_name: Optional[str]
    _threads: List[threading.Thread]
    _incoming: set
    _handshakes: int
    _closed: bool
    _serve_accepted: Callable[[socket.socket, str], None]

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
            sock = tcp_listener(ip, port)
        except OSError as exc:
            raise LLMException(f"cannot listen on {ip}:{port}: {exc}", status_code=S.LLM_PARAM_INVALID) from None
        listeners = [sock]
        local, unix_name = unix_listener()
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
        if self.secret is None and not is_loopback(ip):
            warn_once(f"cluster {self.engine.cluster_id} listens on {ip}:{bound} without a link secret: "
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
                close_socket(conn)
                continue
            try:
                tune(conn)
                conn.setblocking(False)
                self._spawn(self._serve_accepted, conn, name)
            except (OSError, RuntimeError) as exc:  # no thread could be started
                logger.warning("cluster %d: dropping a connection from %s: %s", self.engine.cluster_id, name, exc)
                self._handshake_done(conn)
                close_socket(conn)

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

    def _open_comm_listener(self, ip: str, port: int) -> None:
        with self._lock:
            entry = self._comm_listeners.get((ip, port))
            if entry is not None:
                entry[1] += 1
                return
        try:
            sock = tcp_listener(ip, port)
        except OSError as exc:
            raise fail(S.LLM_LINK_FAILED, f"cannot listen on {ip}:{port}, this member's rank-table address "
                                           f"(device_ip, port base + 16 x device_id + rank_id): {exc}") from None
        sock.settimeout(0.2)
        unix = None
        with self._lock:
            self._comm_listeners[(ip, port)] = [sock, 1]
            if self.unix_name is None and self._comm_unix_name is None:
                unix, self._comm_unix_name = unix_listener()
                if unix is not None:
                    self._comm_listeners[("", 0)] = [unix, 1]
        for listener in [sock] + ([unix] if unix is not None else []):
            listener.settimeout(0.2)
            threading.Thread(target=self._accept_loop, args=(listener,), daemon=True,
                             name=f"llm_datadist-listen-{port}").start()
        if self.secret is None and not is_loopback(ip):
            warn_once(f"cluster {self.engine.cluster_id} listens on {ip}:{port} without a link secret: any "
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
            close_socket(sock)


def tcp_listener(ip: str, port: int) -> socket.socket:
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


def unix_listener() -> Tuple[Optional[socket.socket], Optional[str]]:
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


def is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return ip == "localhost"


_warned: set = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)


def _env_bytes(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, str(default)))
    except ValueError:
        return default


def _buffer_bytes() -> int:
    return _env_bytes("LLM_DATADIST_TCP_BUFFER", 4 << 20)


def tune(sock: socket.socket) -> None:
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


_io.set_recv_lowat(_recv_lowat())


def close_socket(sock: Optional[socket.socket]) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()

