"""The listening part of a cluster's links: ``Listener`` owns its listening sockets (the TCP one of
``listen_ip_info``, those of two-sided links, and an abstract Unix socket that same-host peers
are named in the signed link reply -- though any local user can read its name in
``/proc/net/unix``), their accept loops and the threads it starts for accepted connections; the
connections still in their handshake are counted by its ``slots`` (``slots.HandshakeSlots``:
the pre-authentication pool, the grace, the authenticated pool and the waiting room).

The accept loop survives transient ``accept()`` failures (backing off up to a second) and hands
each accepted connection that found a slot to the accept callback it was given, on a thread of
its own (a newcomer that found none waits for one on a thread of its own, or is closed); the
callback says when the peer has authenticated (``authenticated``) and when the handshake is over
(``handshake_done``). The listener knows nothing of links: the link manager (``links``) gives it
the callback and a counter of refused connections.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from llm_datadist.status import LLMException
from llm_datadist.transport.errors import S, fail
from llm_datadist.transport.slots import (DEFAULT_MAX_PENDING, DEFAULT_MAX_PENDING_PER_SOURCE, DEFAULT_PREAUTH_GRACE_MS,
                                          MAX_PENDING_ENV, MAX_PENDING_PER_SOURCE_ENV, PREAUTH_GRACE_ENV,
                                          HandshakeSlots)
from llm_datadist.transport.sockets import Source, close_socket, env_int, source_of, tcp_listener, tune, unix_listener
from llm_datadist.transport.stats import CountCallback
from llm_datadist.transport.threads import Threads
# (re-exported: the planes import it from here)
from llm_datadist.transport.sockets import is_loopback  # noqa: F401

logger = logging.getLogger("llm_datadist")

#: ``on_accept(connection, name)``: run the handshake of an accepted connection (and whatever
#: follows on it); called on a thread of the listener. ``name`` is the peer's address. It calls
#: ``Listener.authenticated`` once the peer has authenticated, and ``Listener.handshake_done``
#: before it closes the connection (the listener may shut down one it still counts).
AcceptCallback = Callable[[socket.socket, str], None]


class Listener:
    """The listening sockets of one cluster and the connections accepted on them until their
    handshake is over.

    ``on_accept`` gets each accepted connection; ``max_pending``, ``max_pending_per_source`` and
    ``grace_ms`` are the caps of its handshake slots (``slots.HandshakeSlots``, which ``count``
    is told of refusals and evictions); ``count`` is told of ``accept_errors`` too."""

    def __init__(self, cluster_id: int, on_accept: AcceptCallback, max_pending: int, count: CountCallback,
                 max_pending_per_source: Optional[int] = None, grace_ms: int = DEFAULT_PREAUTH_GRACE_MS) -> None:
        self.cluster_id = cluster_id
        #: The accepted connections in their handshake, and those waiting for a slot.
        self.slots = HandshakeSlots(cluster_id, max_pending, count, max_pending_per_source, grace_ms)
        self._on_accept = on_accept
        self._count = count
        self._lock = threading.Lock()
        self._sockets: List[socket.socket] = []      # listen_ip_info's, and its Unix socket
        self._loops: List[threading.Thread] = []     # their accept loops
        self._unix_name: Optional[str] = None
        self._extra: Dict[Tuple[str, int], List[Any]] = {}  # (ip, port) -> [socket, users]
        self._extra_unix_name: Optional[str] = None  # the Unix socket of the extra listeners
        self._extra_loops = Threads("llm_datadist-listen")
        self._threads = Threads("llm_datadist-conn")

    @classmethod
    def from_env(cls, cluster_id: int, on_accept: AcceptCallback, count: CountCallback) -> "Listener":
        """A listener whose handshake slots have the caps the environment sets
        (``LLM_DATADIST_MAX_PENDING_HANDSHAKES``, ``LLM_DATADIST_MAX_PENDING_PER_SOURCE``,
        ``LLM_DATADIST_PREAUTH_GRACE_MS``)."""
        return cls(cluster_id, on_accept, env_int(MAX_PENDING_ENV, DEFAULT_MAX_PENDING), count,
                   env_int(MAX_PENDING_PER_SOURCE_ENV, DEFAULT_MAX_PENDING_PER_SOURCE),
                   env_int(PREAUTH_GRACE_ENV, DEFAULT_PREAUTH_GRACE_MS))

    # -- what it listens on ---------------------------------------------------------------------
    @property
    def listen_address(self) -> Optional[Tuple[str, int]]:
        for sock in self._sockets:
            if sock.family != socket.AF_UNIX:
                host, port = sock.getsockname()[:2]
                return host, port
        return None

    @property
    def unix_name(self) -> Optional[str]:
        """The abstract name of the Unix socket that same-host peers connect to, or None."""
        return self._unix_name or self._extra_unix_name

    def start(self, ip: str, port: int) -> None:
        """Listen on ``ip:port`` (port 0 = any free port; see ``listen_address``), and on a Unix
        socket of a random abstract name. ``LLMException(LLM_PARAM_INVALID)`` if it cannot."""
        self.stop()
        try:
            sock = tcp_listener(ip, port)
        except OSError as exc:
            raise LLMException(f"cannot listen on {ip}:{port}: {exc}", status_code=S.LLM_PARAM_INVALID) from None
        sockets = [sock]
        local, unix_name = unix_listener()
        if local is not None:
            sockets.append(local)
        loops = []
        for listener in sockets:
            listener.settimeout(0.2)
            loops.append(threading.Thread(target=self._accept_loop, args=(listener,), daemon=True,
                                          name=f"llm_datadist-listen-{port}"))
        with self._lock:
            self._sockets, self._unix_name, self._loops = sockets, unix_name, loops
        for thread in loops:
            thread.start()

    def stop(self) -> None:
        """Stop listening on ``listen_ip_info`` (the extra listeners stay)."""
        with self._lock:
            sockets, loops = self._sockets, self._loops
            self._sockets, self._loops, self._unix_name = [], [], None
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for thread in loops:
            if thread is not threading.current_thread():
                thread.join(timeout=2)

    def open_extra(self, ip: str, port: int) -> None:
        """Listen on ``ip:port`` too (a two-sided link's address), or count one more user of it;
        with a Unix socket if there is none yet. ``LLMException(LLM_LINK_FAILED)`` if it cannot."""
        with self._lock:
            entry = self._extra.get((ip, port))
            if entry is not None:
                entry[1] += 1
                return
        try:
            sock = tcp_listener(ip, port)
        except OSError as exc:
            raise fail(S.LLM_LINK_FAILED, f"cannot listen on {ip}:{port}, this member's rank-table address "
                                           f"(device_ip, port base + 16 x device_id + rank_id): {exc}") from None
        unix = None
        with self._lock:
            self._extra[(ip, port)] = [sock, 1]
            if self._unix_name is None and self._extra_unix_name is None:
                unix, self._extra_unix_name = unix_listener()
                if unix is not None:
                    self._extra[("", 0)] = [unix, 1]
        for listener in [sock] + ([unix] if unix is not None else []):
            listener.settimeout(0.2)
            self._extra_loops.spawn(self._accept_loop, listener, True)

    def close_extra(self, key: Tuple[str, int]) -> None:
        """One user less of the extra listener ``(ip, port)``; closed with its last user (and the
        extra Unix socket with the last extra listener)."""
        with self._lock:
            entry = self._extra.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._extra[key]
            closing = [entry[0]]
            if list(self._extra) == [("", 0)]:  # the last one: its Unix socket goes too
                closing.append(self._extra.pop(("", 0))[0])
                self._extra_unix_name = None
        for sock in closing:
            close_socket(sock)

    # -- accepting ------------------------------------------------------------------------------
    def _accept_loop(self, listener: socket.socket, extra: bool = False) -> None:
        """Accept on ``listener`` (``extra``: a two-sided link's listener or its Unix socket)."""
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
                errors = self._count("accept_errors")
                delay = min(1.0, 0.01 * (2 ** min(failures, 7)))
                if failures == 1 or failures % 100 == 0:
                    logger.warning("cluster %d: accept() failed (%s, %d so far); retrying in %.2f s",
                                   self.cluster_id, exc, errors, delay)
                time.sleep(delay)
                continue
            failures = 0
            name = "local" if conn.family == socket.AF_UNIX else f"{addr[0]}:{addr[1]}"
            source = source_of(conn, addr)
            why = self.slots.admit(conn, source, extra)
            if why is None:
                self._start(self._run, conn, name)
            elif self.slots.may_wait(conn, source):
                # No slot now: it waits for one on a thread of its own (``_wait_then_run``), so that
                # the accept loop goes on taking the backlog -- and refusing at once the newcomers
                # of a source whose waiting room is full -- rather than leave every other source's
                # connections queued behind one that waits.
                if not self._start(self._wait_then_run, conn, name, source, extra):
                    self.slots.stop_waiting(conn, source)
            else:
                self.slots.refuse(conn, why, source)

    def _start(self, target: Callable[..., None], conn: socket.socket, *args: Any) -> bool:
        """``target(conn, *args)`` on a thread of its own; whether one started (if not, the
        connection is dropped)."""
        try:
            self._threads.spawn(target, conn, *args)
            return True
        except (OSError, RuntimeError) as exc:  # no thread could be started
            logger.warning("cluster %d: dropping a connection: %s", self.cluster_id, exc)
            self.slots.handshake_done(conn)
            close_socket(conn)
            return False

    def _wait_then_run(self, conn: socket.socket, name: str, source: Source, extra: bool) -> None:
        """A newcomer that found no slot: wait up to the grace for one (``admit``), then its
        handshake, or close it counted."""
        try:
            why = self.slots.admit(conn, source, extra, wait=True)
        finally:
            self.slots.stop_waiting(conn, source)
        if why is not None:
            self.slots.refuse(conn, why, source)
            return
        self._run(conn, name)

    def _run(self, conn: socket.socket, name: str) -> None:
        try:
            try:
                tune(conn)
                conn.setblocking(False)
            except OSError as exc:  # the peer went already
                logger.info("cluster %d: dropping a connection from %s: %s", self.cluster_id, name, exc)
                return
            self._on_accept(conn, name)
        finally:
            self.slots.handshake_done(conn)

    def _listening(self, listener: socket.socket) -> bool:
        with self._lock:
            return listener in self._sockets or any(entry[0] is listener for entry in self._extra.values())

    # -- the handshake slots (``slots``), for the accept callback ---------------------------------
    def admit(self, conn: socket.socket, source: Optional[Source] = None, extra: bool = False,
              wait: bool = False) -> Optional[str]:
        """``HandshakeSlots.admit``: count ``conn`` as a connection in its handshake, or say why not."""
        return self.slots.admit(conn, source, extra, wait)

    def authenticated(self, conn: socket.socket) -> bool:
        """``HandshakeSlots.authenticated``: the peer of ``conn`` has authenticated; whether it
        holds a slot of the authenticated pool."""
        return self.slots.authenticated(conn)

    def on_rank_port(self, conn: socket.socket) -> bool:
        """Whether ``conn``, still in its handshake, came through an extra listener."""
        return self.slots.on_rank_port(conn)

    def handshake_done(self, conn: socket.socket) -> None:
        """``conn`` is through its handshake (or gone): it no longer counts as pending."""
        self.slots.handshake_done(conn)

    def pending(self) -> Set[socket.socket]:
        """The accepted connections still in their handshake, authenticated or not."""
        return self.slots.pending()

    def pending_from(self, source: Source) -> int:
        """How many unauthenticated connections from ``source`` are in their handshake."""
        return self.slots.pending_from(source)

    # -- the end ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Accept nothing more: stop every listening socket (new connections are refused)."""
        self.slots.close()
        with self._lock:
            extra = [entry[0] for entry in self._extra.values()]
            self._extra.clear()
            self._extra_unix_name = None
        self.stop()
        for sock in extra:
            close_socket(sock)

    def drain(self) -> None:
        """After ``close``: end the connections still in their handshake and join the threads."""
        self.slots.shut_down_pending()
        self._threads.join()
        self._extra_loops.join()
