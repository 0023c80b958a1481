"""The handshake slots of a cluster's listener: how many accepted connections may be in their
handshake at once, in all and per source, and who waits for a slot (``HandshakeSlots``).

A connection starts in the *pre-authentication pool* (``admit``), which holds at most
``LLM_DATADIST_MAX_PENDING_HANDSHAKES`` connections, ``LLM_DATADIST_MAX_PENDING_PER_SOURCE`` of
them from one source (``sockets.source_of``: the peer's IP address over TCP, its uid over the Unix
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
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Dict, List, Optional, Set, Tuple

from llm_datadist.transport.sockets import Source, close_socket, describe, source_of
from llm_datadist.transport.stats import CountCallback

logger = logging.getLogger("llm_datadist")

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

class HandshakeSlots:
    """The accepted connections of one cluster still in their handshake, and the newcomers waiting
    for a slot (module docstring).

    ``max_pending`` bounds the unauthenticated connections in their handshake, and apart from them
    the authenticated ones; ``max_pending_per_source`` bounds the unauthenticated ones of one
    source; ``grace_s`` is how long one may stay unauthenticated once a newcomer needs its slot.
    ``count`` is told of ``preauth_evicted`` (a connection that gave its slot up),
    ``preauth_waited`` (a newcomer held until a slot was free), ``refused_busy`` (no slot of the
    pool within the grace, or the authenticated pool full, or the slots closed) and
    ``refused_source`` (no slot of its source's share within the grace)."""

    def __init__(self, cluster_id: int, max_pending: int, count: CountCallback,
                 max_pending_per_source: Optional[int] = None, grace_ms: int = DEFAULT_PREAUTH_GRACE_MS) -> None:
        self.cluster_id = cluster_id
        self.max_pending = max_pending
        self.max_pending_per_source = max_pending if max_pending_per_source is None else max_pending_per_source
        self.grace_s = grace_ms / 1000
        self._count = count
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a slot freed, or the slots closed
        # Accepted connections not yet authenticated: their source and when they were admitted.
        self._preauth: Dict[socket.socket, Tuple[Source, float]] = {}
        self._by_source: Dict[Source, int] = {}  # how many of them from each source
        self._authenticated: Set[socket.socket] = set()  # authenticated, still in their handshake
        # Newcomers that found no slot and wait for one on a thread of their own, by source, oldest
        # first; and those whose place a newcomer of a source with fewer waiting took (``may_wait``).
        self._waiters: Dict[Source, List[socket.socket]] = {}
        self._waiting_total = 0
        self._bumped: Set[socket.socket] = set()
        self._on_rank_port: Set[socket.socket] = set()  # those in their handshake accepted by an extra listener
        self._closed = False

    # -- taking a slot ----------------------------------------------------------------------------
    def admit(self, conn: socket.socket, source: Optional[Source] = None, extra: bool = False,
              wait: bool = False) -> Optional[str]:
        """Count ``conn`` (from ``source``, ``source_of(conn)`` if not given) as an unauthenticated
        connection in its handshake, in the place of one that has had the grace when the pool or
        its source's share is full (that one is shut down; module docstring); or, not counted,
        the counter of why not: ``refused_busy`` when the pool is full or the slots closed,
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

    # -- the waiting room -------------------------------------------------------------------------
    def may_wait(self, conn: socket.socket, source: Source) -> bool:
        """Whether ``conn``, a newcomer from ``source`` that found no slot, may wait for one (its
        place taken here if so; ``stop_waiting`` gives it back): at most as many wait as the pool
        holds, and of one source as many as its share. When the room is full, the newcomer takes
        the place of the oldest waiter of the source with the most waiting, if that one has more
        waiting than its own (that waiter is refused): sources with many addresses cannot keep a
        source with few out."""
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

    def stop_waiting(self, conn: socket.socket, source: Source) -> None:
        """``conn`` gives its place in the waiting room back (``may_wait``)."""
        with self._changed:
            if conn in self._bumped:  # (its place was taken, and counted off, then)
                self._bumped.discard(conn)
            else:
                self._drop_waiter(conn, source)
            self._changed.notify_all()  # the waiters that let it go first look again (``_poorer_waits``)

    def refuse(self, conn: socket.socket, why: str, source: Source) -> None:
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

    # -- through the handshake --------------------------------------------------------------------
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
        """No slot for anyone from now on; the waiters give up."""
        with self._lock:
            self._closed = True
            self._changed.notify_all()

    def shut_down_pending(self) -> None:
        """Shut down the connections still in their handshake (their threads end them)."""
        with self._lock:  # (under the lock: each is still its thread's, see ``_evict``)
            for sock in set(self._preauth) | self._authenticated:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
