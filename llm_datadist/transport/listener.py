"""The listening part of a cluster's links: ``Listener`` owns its listening sockets (the TCP one of
``listen_ip_info``, those of two-sided links, and an abstract Unix socket that same-host peers
are named in the signed link reply -- though any local user can read its name in
``/proc/net/unix``), their accept loops, the threads it starts for accepted connections
and the accounting of the connections still in their handshake.

The accept loop survives transient ``accept()`` failures (backing off up to a second) and hands
each accepted connection to the accept callback it was given, on a thread of its own; the
callback says when the peer has authenticated (``authenticated``) and when the handshake is over
(``handshake_done``). The listener knows nothing of links: the link manager (``links``) gives it
the callback and a counter of refused connections.

Handshake slots: a connection starts in the *pre-authentication pool* (``admit``), which holds
at most ``LLM_DATADIST_MAX_PENDING_HANDSHAKES`` connections, ``LLM_DATADIST_MAX_PENDING_PER_SOURCE``
of them from one source (``source_of``: the peer's IP address over TCP, its uid over the Unix
socket); once the peer has proved the secret (or, without one, sent its ``AUTH``) it moves to a
pool of its own, bounded by the first cap again, that strangers without the secret cannot reach.
When a newcomer finds the pool (or its source's share) full, the oldest connection that has had
``LLM_DATADIST_PREAUTH_GRACE_MS`` without authenticating loses its slot to it -- of the newcomer's
own source when that one is at its cap, else of the sources holding at least as many as the
newcomer's, the one holding the most first; while none has had that long, the newcomer waits on
a thread of its own until one has or a slot frees -- at most as many waiting as the pool holds,
of one source as many as its share; in a full waiting room a newcomer takes the place of the
oldest waiter of the source with the most waiting, if that source has more than its own (so many
addresses cannot keep a source with few out), and a slot that comes free goes to a waiter of the
source holding the fewest; a newcomer left without a place is closed at once, so the accept loop
keeps draining the kernel's backlog and a source flooding it (the Unix socket's name is readable
by every local user) keeps no other source's connections queued behind its own. Closing the
newcomer instead would lose to a stranger that reconnects at once: it, not the peer with the
secret, would take every slot that frees. So a stranger holds a slot at most that long once
another connection needs it, and an honest peer, which answers the challenge in a round trip,
keeps its own (docs/design.md section 6).

Also the socket helpers every part uses (``tune``, ``close_socket``, the listening sockets).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from llm_datadist import _io
from llm_datadist.status import LLMException
from llm_datadist.transport.errors import S, fail
from llm_datadist.transport.session import peer_credentials
from llm_datadist.transport.threads import Threads

logger = logging.getLogger("llm_datadist")

#: How long an accepted connection may take over its whole handshake (idle or unauthenticated
#: connections are closed then).
DEFAULT_HANDSHAKE_TIMEOUT_MS = 5000
HANDSHAKE_TIMEOUT_ENV = "LLM_DATADIST_HANDSHAKE_TIMEOUT_MS"
#: Connections accepted but not yet through their handshake; more are closed at once.
DEFAULT_MAX_PENDING = 64
MAX_PENDING_ENV = "LLM_DATADIST_MAX_PENDING_HANDSHAKES"
#: Of those, the most from one source (one IP address over TCP, one uid over the Unix socket), so
#: that one stranger cannot hold every pending slot.
DEFAULT_MAX_PENDING_PER_SOURCE = 32
MAX_PENDING_PER_SOURCE_ENV = "LLM_DATADIST_MAX_PENDING_PER_SOURCE"
#: Under pressure (a newcomer finds no slot), how long a connection may stay unauthenticated before
#: it gives its slot up: well above a handshake's round trips, well below the handshake timeout.
DEFAULT_PREAUTH_GRACE_MS = 250
PREAUTH_GRACE_ENV = "LLM_DATADIST_PREAUTH_GRACE_MS"
#: Links a cluster holds (each costs a thread per incoming connection, two by default).
DEFAULT_MAX_LINKS = 256
MAX_LINKS_ENV = "LLM_DATADIST_MAX_LINKS"
#: Of those, the most that one source may hold (links it asked for; see ``source_of``): room for
#: every rank of several engines on one host, and still room for others.
DEFAULT_MAX_LINKS_PER_SOURCE = 128
MAX_LINKS_PER_SOURCE_ENV = "LLM_DATADIST_MAX_LINKS_PER_SOURCE"


def env_int(name: str, default: int, lo: int = 1) -> int:
    try:
        return max(lo, int(os.environ.get(name, str(default))))
    except ValueError:
        return default


#: ``on_accept(connection, name)``: run the handshake of an accepted connection (and whatever
#: follows on it); called on a thread of the listener. ``name`` is the peer's address. It calls
#: ``Listener.authenticated`` once the peer has authenticated, and ``Listener.handshake_done``
#: before it closes the connection (the listener may shut down one it still counts).
AcceptCallback = Callable[[socket.socket, str], None]
#: Where a connection comes from, for the per-source caps: ``("ip", address)`` over TCP (every
#: peer on this host is a loopback address), ``("uid", uid)`` over a Unix socket (as the kernel
#: has it).
Source = Tuple[str, Any]


def source_of(conn: socket.socket, address: Any = None) -> Source:
    """The source of an accepted connection (``address``: what ``accept()`` returned)."""
    if conn.family == socket.AF_UNIX:
        try:
            return "uid", peer_credentials(conn)[1]
        except OSError:
            return "uid", -1
    if address is None:
        try:
            address = conn.getpeername()
        except OSError:
            return "ip", "?"
    return "ip", str(address[0])


def describe(source: Source) -> str:
    return f"uid {source[1]}" if source[0] == "uid" else str(source[1])


#: ``count(counter)``: add one to a counter of the link statistics, return its new value.
CountCallback = Callable[[str], int]


class Listener:
    """The listening sockets of one cluster and the connections accepted on them until their
    handshake is over.

    ``on_accept`` gets each accepted connection; ``max_pending`` bounds the unauthenticated
    connections in their handshake, and apart from them the authenticated ones;
    ``max_pending_per_source`` bounds the unauthenticated ones of one source; ``grace_ms`` is how
    long one may stay unauthenticated once a newcomer needs its slot (module docstring).
    ``count`` is told of ``accept_errors``, ``preauth_evicted`` (a connection that gave its slot
    up), ``preauth_waited`` (a newcomer held until a slot was free), ``refused_busy`` (no slot of
    the pool within the grace, or the authenticated pool full, or the listener closed) and
    ``refused_source`` (no slot of its source's share within the grace)."""

    def __init__(self, cluster_id: int, on_accept: AcceptCallback, max_pending: int, count: CountCallback,
                 max_pending_per_source: Optional[int] = None, grace_ms: int = DEFAULT_PREAUTH_GRACE_MS) -> None:
        self.cluster_id = cluster_id
        self.max_pending = max_pending
        self.max_pending_per_source = max_pending if max_pending_per_source is None else max_pending_per_source
        self.grace_s = grace_ms / 1000
        self._on_accept = on_accept
        self._count = count
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a slot freed, or the listener closed
        self._sockets: List[socket.socket] = []      # listen_ip_info's, and its Unix socket
        self._loops: List[threading.Thread] = []     # their accept loops
        self._unix_name: Optional[str] = None
        self._extra: Dict[Tuple[str, int], List[Any]] = {}  # (ip, port) -> [socket, users]
        self._extra_unix_name: Optional[str] = None  # the Unix socket of the extra listeners
        self._extra_loops = Threads("llm_datadist-listen")
        # Accepted connections not yet authenticated: their source and when they were admitted.
        self._preauth: Dict[socket.socket, Tuple[Source, float]] = {}
        self._by_source: Dict[Source, int] = {}  # how many of them from each source
        self._authenticated: Set[socket.socket] = set()  # authenticated, still in their handshake
        # Newcomers that found no slot and wait for one on a thread of their own, by source, oldest
        # first; and those whose place a newcomer of a source with fewer waiting took (``_may_wait``).
        self._waiters: Dict[Source, List[socket.socket]] = {}
        self._waiting_total = 0
        self._bumped: Set[socket.socket] = set()
        self._on_rank_port: Set[socket.socket] = set()  # those in their handshake accepted by an extra listener
        self._closed = False
        self._threads = Threads("llm_datadist-conn")

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
            why = self.admit(conn, source, extra)
            if why is None:
                self._start(self._run, conn, name)
            elif self._may_wait(conn, source):
                # No slot now: it waits for one on a thread of its own (``_wait_then_run``), so that
                # the accept loop goes on taking the backlog -- and refusing at once the newcomers
                # of a source whose waiting room is full -- rather than leave every other source's
                # connections queued behind one that waits.
                if not self._start(self._wait_then_run, conn, name, source, extra):
                    self._stop_waiting(conn, source)
            else:
                self._refuse(conn, why, source)

    def _start(self, target: Callable[..., None], conn: socket.socket, *args: Any) -> bool:
        """``target(conn, *args)`` on a thread of its own; whether one started (if not, the
        connection is dropped)."""
        try:
            self._threads.spawn(target, conn, *args)
            return True
        except (OSError, RuntimeError) as exc:  # no thread could be started
            logger.warning("cluster %d: dropping a connection: %s", self.cluster_id, exc)
            self.handshake_done(conn)
            close_socket(conn)
            return False

    def _refuse(self, conn: socket.socket, why: str, source: Source) -> None:
        """Close ``conn`` without a byte, counted (before the peer can see it) as ``why``."""
        refused = self._count(why)
        close_socket(conn)
        if refused in (1, 10, 100) or refused % 1000 == 0:  # rate-limited
            if why == "refused_busy":
                logger.warning("cluster %d: %d connections refused: %d handshakes already pending "
                               "(%s), none unauthenticated for %d ms (%s)", self.cluster_id, refused,
                               self.max_pending, MAX_PENDING_ENV, self.grace_s * 1000, PREAUTH_GRACE_ENV)
            else:
                logger.warning("cluster %d: %d connections refused: %d handshakes already pending "
                               "from %s (%s), none unauthenticated for %d ms (%s)", self.cluster_id,
                               refused, self.max_pending_per_source, describe(source),
                               MAX_PENDING_PER_SOURCE_ENV, self.grace_s * 1000, PREAUTH_GRACE_ENV)

    def _may_wait(self, conn: socket.socket, source: Source) -> bool:
        """Whether ``conn``, a newcomer from ``source`` that found no slot, may wait for one (its
        place taken here if so): at most as many wait as the pool holds, and of one source as
        many as its share. When the room is full, the newcomer takes the place of the oldest
        waiter of the source with the most waiting, if that one has more waiting than its own
        (that waiter is refused): sources with many addresses cannot keep a source with few out."""
        with self._changed:
            mine = self._waiters.get(source, [])
            if self._closed or len(mine) >= self.max_pending_per_source:
                return False
            if self._waiting_total >= self.max_pending:
                most = max(self._waiters, key=lambda s: len(self._waiters[s]))
                if len(self._waiters[most]) <= len(mine):
                    return False
                self._bumped.add(self._drop_waiter(self._waiters[most][0], most))
                self._changed.notify_all()
            self._waiters.setdefault(source, []).append(conn)
            self._waiting_total += 1
            return True

    def _poorer_waits(self, source: Source) -> bool:
        """Under the lock: whether a newcomer of a source holding fewer slots than ``source`` waits."""
        held = self._by_source.get(source, 0)
        return any(self._by_source.get(other, 0) < held for other in self._waiters if other != source)

    def _drop_waiter(self, conn: socket.socket, source: Source) -> socket.socket:
        """Under the lock: ``conn`` waits no longer."""
        waiters = self._waiters[source]
        waiters.remove(conn)
        if not waiters:
            del self._waiters[source]
        self._waiting_total -= 1
        return conn

    def _stop_waiting(self, conn: socket.socket, source: Source) -> None:
        with self._changed:
            if conn in self._bumped:  # (its place was taken, and counted off, then)
                self._bumped.discard(conn)
            else:
                self._drop_waiter(conn, source)
            self._changed.notify_all()  # the waiters that let it go first look again (``_poorer_waits``)

    def _wait_then_run(self, conn: socket.socket, name: str, source: Source, extra: bool) -> None:
        """A newcomer that found no slot: wait up to the grace for one (``admit``), then its
        handshake, or close it counted."""
        try:
            why = self.admit(conn, source, extra, wait=True)
        finally:
            self._stop_waiting(conn, source)
        if why is not None:
            self._refuse(conn, why, source)
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
            self.handshake_done(conn)

    def _listening(self, listener: socket.socket) -> bool:
        with self._lock:
            return listener in self._sockets or any(entry[0] is listener for entry in self._extra.values())

    def admit(self, conn: socket.socket, source: Optional[Source] = None, extra: bool = False,
              wait: bool = False) -> Optional[str]:
        """Count ``conn`` (from ``source``, ``source_of(conn)`` if not given) as an unauthenticated
        connection in its handshake, in the place of one that has had the grace when the pool or
        its source's share is full (that one is shut down; module docstring); or, not counted,
        the counter of why not: ``refused_busy`` when the pool is full or the listener closed,
        ``refused_source`` when its source's share is. ``wait``: rather than refuse at once,
        wait up to the grace for a slot (the accept loop does). ``extra``: it came through an
        extra listener (``on_rank_port``)."""
        if source is None:
            source = source_of(conn)
        until = time.monotonic() + (self.grace_s if wait else 0.0)
        waited = evicted_one = False
        why: Optional[str] = "refused_busy"
        with self._changed:
            while not self._closed:
                if conn in self._bumped:  # its place in the waiting room went to another source's
                    why = "refused_busy"
                    break
                now = time.monotonic()
                why, evict, ready_at = self._slot_for(source, now)
                if evict is not None and wait and self._poorer_waits(source):
                    # Another waiter's source holds fewer slots: the slot that came free is its
                    # (so a source with many waiting cannot win every slot by numbers).
                    evict, ready_at = None, None
                if evict is not None:
                    self._evict(evict)
                    why, evicted_one = None, True
                if why is None or now >= until:
                    break
                waited = True
                self._changed.wait(min(until, ready_at if ready_at is not None else until) - now)
            if self._closed:
                why = "refused_busy"
            elif why is None:
                self._preauth[conn] = (source, time.monotonic())
                self._by_source[source] = self._by_source.get(source, 0) + 1
                if extra:
                    self._on_rank_port.add(conn)
        if waited:
            self._count("preauth_waited")
        if evicted_one:
            evicted = self._count("preauth_evicted")
            if evicted in (1, 10, 100) or evicted % 1000 == 0:  # rate-limited
                logger.warning("cluster %d: %d unauthenticated connections closed to make room for new ones: the "
                               "handshake slots were full and they had not authenticated within %d ms (%s)",
                               self.cluster_id, evicted, self.grace_s * 1000, PREAUTH_GRACE_ENV)
        return why

    def _slot_for(self, source: Source, now: float
                  ) -> Tuple[Optional[str], Optional[socket.socket], Optional[float]]:
        """Under the lock: whether a newcomer from ``source`` finds a slot: ``(None, None, None)``
        if one is free; else ``(why not, the connection to evict for it or None, when the first
        that could be evicted will have had the grace or None)``. The one evicted is the oldest
        that has had the grace, of the newcomer's source when that one is at its cap, else of the
        sources holding at least as many as the newcomer's (its own included), the source holding
        the most first: no source loses a slot to one that holds more."""
        held = self._by_source.get(source, 0)
        if held >= self.max_pending_per_source:
            why, rivals = "refused_source", [(c, t) for c, (s, t) in self._preauth.items() if s == source]
        elif len(self._preauth) >= self.max_pending:
            why, rivals = "refused_busy", [(c, t) for c, (s, t) in self._preauth.items()
                                           if self._by_source[s] >= held]
        else:
            return None, None, None
        graced = [(c, t) for c, t in rivals if now - t >= self.grace_s]
        if graced:
            evict = max(graced, key=lambda item: (self._by_source[self._preauth[item[0]][0]], -item[1]))[0]
            return why, evict, None
        return why, None, min((t + self.grace_s for _, t in rivals), default=None)

    def _evict(self, conn: socket.socket) -> None:
        """Under the lock: ``conn`` gives its slot up; shut down (its handshake thread ends it).
        Only a connection still counted here is shut down: its thread calls ``handshake_done``
        (which takes the lock) before it closes the socket, so the descriptor is still its own."""
        self._forget(conn)
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _forget(self, conn: socket.socket) -> bool:
        """Under the lock: ``conn`` no longer counts as unauthenticated; whether it did."""
        entry = self._preauth.pop(conn, None)
        if entry is None:
            return False
        left = self._by_source[entry[0]] - 1
        if left:
            self._by_source[entry[0]] = left
        else:
            del self._by_source[entry[0]]
        self._changed.notify_all()
        return True

    def authenticated(self, conn: socket.socket) -> bool:
        """The peer of ``conn`` has proved the secret (without one: sent its ``AUTH``): it leaves
        the pre-authentication pool for the authenticated one. False if it no longer held a slot
        (it gave it up: the caller ends it) or the authenticated pool is full (``refused_busy``,
        counted here)."""
        with self._lock:
            if conn not in self._preauth:
                return False
            self._forget(conn)
            if len(self._authenticated) < self.max_pending:
                self._authenticated.add(conn)
                return True
        self._count("refused_busy")
        return False

    def on_rank_port(self, conn: socket.socket) -> bool:
        """Whether ``conn``, still in its handshake, came through an extra listener (a two-sided
        link's rank-table port, or the Unix socket opened with it)."""
        with self._lock:
            return conn in self._on_rank_port

    def handshake_done(self, conn: socket.socket) -> None:
        """``conn`` is through its handshake (or gone): it no longer counts as pending."""
        with self._lock:
            self._forget(conn)
            self._authenticated.discard(conn)
            self._on_rank_port.discard(conn)

    def pending(self) -> Set[socket.socket]:
        """The accepted connections still in their handshake, authenticated or not."""
        with self._lock:
            return set(self._preauth) | self._authenticated

    def pending_from(self, source: Source) -> int:
        """How many unauthenticated connections from ``source`` are in their handshake."""
        with self._lock:
            return self._by_source.get(source, 0)

    # -- the end ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Accept nothing more: stop every listening socket (new connections are refused)."""
        with self._lock:
            self._closed = True
            self._changed.notify_all()
            extra = [entry[0] for entry in self._extra.values()]
            self._extra.clear()
            self._extra_unix_name = None
        self.stop()
        for sock in extra:
            close_socket(sock)

    def drain(self) -> None:
        """After ``close``: end the connections still in their handshake and join the threads."""
        with self._lock:  # (under the lock: each is still its thread's, see ``_evict``)
            for sock in set(self._preauth) | self._authenticated:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._threads.join()
        self._extra_loops.join()


#: Connections the kernel queues for ``accept()`` (capped by ``net.core.somaxconn``): while the
#: accept loop holds a newcomer (``Listener.admit``) the rest wait there, first come first served,
#: rather than have their SYNs dropped (a second or more of retransmission for a peer among them).
LISTEN_BACKLOG = 1024


def tcp_listener(ip: str, port: int) -> socket.socket:
    """A listening TCP socket on ``ip:port``; OSError if it cannot be had."""
    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
        sock.listen(LISTEN_BACKLOG)
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
        sock.listen(LISTEN_BACKLOG)
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

#: Default ``LLM_DATADIST_SPIN_US``: how long a link's receive polls before it sleeps.
DEFAULT_SPIN_US = 50


def _spin_us() -> int:
    """``LLM_DATADIST_SPIN_US`` microseconds (0 = off, at most 10,000), default ``DEFAULT_SPIN_US``;
    an unusable value is warned about and the default kept."""
    raw = os.environ.get("LLM_DATADIST_SPIN_US", "").strip()
    if not raw:
        return DEFAULT_SPIN_US
    try:
        value = int(raw)
        if not 0 <= value <= 10_000:
            raise ValueError
    except ValueError:
        logger.warning("LLM_DATADIST_SPIN_US=%r is not 0 to 10000 microseconds; using %d", raw, DEFAULT_SPIN_US)
        return DEFAULT_SPIN_US
    return value


_io.set_spin_us(_spin_us())


def close_socket(sock: Optional[socket.socket]) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()

