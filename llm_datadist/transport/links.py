"""Links between clusters: ``LinkManager``, the facade the engine uses, and the link table.

``LinkManager`` is composed of parts that own their state: a ``listener.Listener`` (its sockets,
accept loops, pending-handshake accounting), handed ``_serve_accepted`` as its accept callback; the
handshake's plain functions (``handshake``), which say what a connection agreed and leave the
decision to the manager; a ``server.Server`` (its connection threads), handed the dispatch table
(``server.Requests`` for what the engine answers, the manager's own handlers for notifications and
unlinks) and the ``EngineView``; and the engine's ``planes.PlaneSet``. The manager keeps the link
table (links made, pending, lost) and the choice of each link's planes; each plane's per-link
state lives in the link (``Link.plane_state``, made by ``DataPlane.link_state`` before the plane's
``accept`` and dropped when it refuses or the link ends).

A link between a client (the side calling ``link_clusters``) and a server (the side with
``listen_ip_info``) is made of connections that the client opens (``handshake``): a *link*
connection for the handshake, then *forward* connections (the client's requests, served by
server threads, ``server``) and *reverse* ones (the server's requests), Unix sockets on this host
when a plane wants them, TCP otherwise. The listeners are ``listener``'s; a link's state on this
side is a ``session.Link``.

Nothing the peer claims about itself is trusted: each side fetches the other's cache table over
its own connections of the link and picks the data plane of its own transfers (``planes``): the
one the option ``llm.DataPlane`` (or the environment variable ``LLM_DATADIST_DATA_PLANE``)
forces, or under ``auto`` the first of ``planes.auto_order()`` that accepts the link -- the
same-host plane towards a process the kernel proved, frames otherwise. A transfer with device
memory that the host cannot address on either side (the engine says so of its own cache, the
peer's table of the peer's) goes to a plane with ``device_memory`` instead, chosen per link and
per combination on first use (``DataPlane`` in ``planes.base``).

A connection that closes or breaks ends its whole link on both sides (``lost_links`` says why);
a new link from a cluster that is still linked is refused unless the old link's connections
are already closed. The listeners survive transient ``accept()`` failures, and handshakes,
links and threads are bounded, in all and per source -- one IP address over TCP, one uid over
the Unix socket (``LLM_DATADIST_MAX_PENDING_HANDSHAKES``, ``LLM_DATADIST_MAX_PENDING_PER_SOURCE``,
``LLM_DATADIST_MAX_LINKS``, ``LLM_DATADIST_MAX_LINKS_PER_SOURCE``,
``LLM_DATADIST_HANDSHAKE_TIMEOUT_MS``); an unauthenticated connection gives its handshake slot
to a newcomer once it has had ``LLM_DATADIST_PREAUTH_GRACE_MS`` (``listener``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from llm_datadist import _io
from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.transport import auth, budgets, handshake, protection, server, wire
from llm_datadist.transport import deadline as dl
from llm_datadist.transport import planes as plane_registry
from llm_datadist.transport.comms import Comm
from llm_datadist.transport.engine_view import EngineView
from llm_datadist.transport.errors import S, MutualLink, ProtocolError, StaleTable, brief, fail
from llm_datadist.transport.listener import Listener
from llm_datadist.transport.settings import MAX_LINKS_ENV, MAX_LINKS_PER_SOURCE_ENV, LinkSettings
from llm_datadist.transport.slots import (DEFAULT_MAX_PENDING, DEFAULT_MAX_PENDING_PER_SOURCE, DEFAULT_PREAUTH_GRACE_MS,
                                          MAX_PENDING_ENV, MAX_PENDING_PER_SOURCE_ENV, PREAUTH_GRACE_ENV)
from llm_datadist.transport.sockets import close_socket, describe, env_int, source_of
from llm_datadist.transport.planes import DATA_PLANE_ENV, DATA_PLANE_OPTION, PlaneSet
from llm_datadist.transport.planes.choice import PlaneChoice, plane_facts
from llm_datadist.transport.hooks import Hooks, NotifyHandler
from llm_datadist.transport.server import Requests, Server
from llm_datadist.transport.session import MAX_CONNECTIONS, Channel, Link, peer_credentials
from llm_datadist.transport.table import RemoteTable
from llm_datadist.transport.threads import Threads
from llm_datadist.transport.two_sided import TwoSidedLinks

__all__ = ["LinkManager", "resolve_plane", "DATA_PLANE_OPTION", "DATA_PLANE_ENV"]

logger = logging.getLogger("llm_datadist")

#: How long ``close`` (finalize) waits for each peer to acknowledge its unlink.
FINALIZE_UNLINK_MS = 500


def resolve_plane(options: Dict[str, str]) -> str:
    """``auto`` or the registered plane that ``llm.DataPlane`` names (``LLM_PARAM_INVALID`` else)."""
    return plane_registry.resolve(options)


class LinkManager:
    """The link table of one engine, and the facade over its listener, server and planes."""

    def __init__(self, engine: EngineView) -> None:
        self.engine = engine
        #: What the links are held to (the plane, the secret, the protection, the caps).
        self.settings = LinkSettings.resolve(engine.cluster_id, engine.options)
        #: One instance of every registered plane, for this engine (a mapping by name).
        self.planes = PlaneSet(engine)
        #: Which planes carry this side's transfers on each link.
        self.plane_choice = PlaneChoice(engine.cluster_id, self.settings, self.planes, self._fetch_table)
        self._lock = threading.RLock()
        self._peers: Dict[int, Link] = {}
        self._pending: Dict[str, Link] = {}   # server side: token -> a link waiting for its connections
        self._linking: set = set()            # client side: cluster ids being linked now
        self._lost: Dict[int, str] = {}       # cluster id -> why its link ended without an unlink
        self._unlinked_by_peer: set = set()   # cluster ids whose link the peer ended with an unlink
        self._self_peers: List[Link] = []     # server side of links this cluster made to its own listener
        self._closed = False
        #: Counters of refused or failed connections (``link_stats()``): ``refused_busy`` and
        #: ``refused_source``, connections closed by the handshake caps (global, per source) when
        #: no slot came free within ``LLM_DATADIST_PREAUTH_GRACE_MS``; ``preauth_evicted``,
        #: unauthenticated connections that gave their slot to a newcomer after that grace, and
        #: ``preauth_waited``, newcomers that waited for a slot (``listener``); ``refused_links``
        #: and ``refused_source_links``, link requests refused by the link caps (global, per
        #: source); ``refused_self``, link requests claiming this cluster's id without proving that
        #: they come from this process. The byte budgets
        #: (``budgets``): ``refused_oversized``, control requests over ``LLM_DATADIST_MAX_MESSAGE_BYTES``;
        #: ``refused_parsing``, control requests that found no room in the parsing budget (or their
        #: link's or source's share of it);
        #: ``refused_tables``, table replies over ``LLM_DATADIST_MAX_TABLE_BYTES`` (the link failed);
        #: ``refused_reads``, pulls the read guard refused (``read_guard``); ``refused_writes``, pushes
        #: the write guard refused; ``protection_failures``,
        #: records of a protected link that failed their check (``protection``; the link closed);
        #: ``malformed_tables``, table replies whose table or plane entries were malformed (the
        #: link failed).
        self.stats = {"accept_errors": 0, "refused_busy": 0, "refused_source": 0, "preauth_evicted": 0,
                      "preauth_waited": 0, "refused_links": 0, "refused_source_links": 0, "refused_self": 0,
                      "auth_failures": 0, "handshake_failures": 0, "links_lost": 0, "refused_oversized": 0,
                      "refused_parsing": 0, "refused_tables": 0,
                      "refused_reads": 0, "refused_writes": 0, "protection_failures": 0, "malformed_tables": 0}
        #: The listening sockets; each accepted connection comes to ``_serve_accepted``.
        self.listener = Listener(engine.cluster_id, self._serve_accepted,
                                 env_int(MAX_PENDING_ENV, DEFAULT_MAX_PENDING), self._count,
                                 env_int(MAX_PENDING_PER_SOURCE_ENV, DEFAULT_MAX_PENDING_PER_SOURCE),
                                 env_int(PREAUTH_GRACE_ENV, DEFAULT_PREAUTH_GRACE_MS))
        device_payload = next((p.device_payload for p in self.planes.all if p.device_payload is not None), None)
        #: The notification handler and the read and write guards.
        self.hooks = Hooks(engine.cluster_id, self._count, self._lose)
        self.read_guard, self.write_guard = self.hooks.read_guard, self.hooks.write_guard
        handlers = Requests(engine, lambda: self.planes.all, device_payload, self._count, self.read_guard,
                            self.write_guard).handlers()
        handlers[wire.OP_NOTIFY] = self.hooks.on_notify
        handlers[wire.OP_UNLINK] = self._on_unlink
        #: Serves the peers' requests on the links' incoming connections.
        self.server = Server(engine, handlers, self._lose)
        #: The two-sided links (``LLMDataDist.link``), under the table's lock.
        self.two_sided = TwoSidedLinks(engine.cluster_id, self._lock, self.settings, self.listener, self.link,
                                       self._current, self._drop_comm_link, self._settle_link)
        self._relays = Threads("llm_datadist-seal")   # the relays of protected connections

    def _count(self, counter: str) -> int:
        with self._lock:
            self.stats[counter] += 1
            return self.stats[counter]

    @property
    def secret(self) -> Optional[bytes]:
        """The link secret (``settings.secret``; None: links are not authenticated)."""
        return self.settings.secret

    @secret.setter
    def secret(self, value: Optional[bytes]) -> None:
        self.settings.secret = value

    @property
    def handshake_ms(self) -> int:
        """How long a handshake may take (``settings.handshake_ms``)."""
        return self.settings.handshake_ms

    @handshake_ms.setter
    def handshake_ms(self, value: int) -> None:
        self.settings.handshake_ms = value

    @property
    def remote_accessible(self) -> bool:
        """``llm.EnableRemoteCacheAccessible`` (``settings.remote_accessible``)."""
        return self.settings.remote_accessible

    def link_stats(self) -> Dict[str, int]:
        """A snapshot of ``stats``, and of the process's budgets (``budgets``): ``refused_staging``,
        staged transfers that found no room in ``LLM_DATADIST_MAX_STAGING_BYTES`` (or their link's
        or source's share of it) in time; ``stalled_parsing`` and ``stalled_staging``, control
        bodies and staged payloads that stalled while they held some of a budget (their links
        dropped); and the bytes each process budget holds now and held at most (``parsing_bytes``,
        ``parsing_bytes_peak``, ``staging_bytes``, ``staging_bytes_peak``); and each plane's own
        counters (``DataPlane.counters``: cuda_ipc's ``partial_registrations``). The process
        budgets are shared by every engine of the process."""
        with self._lock:
            snapshot = dict(self.stats)
        for plane in self.planes.all:
            snapshot.update(plane.counters())
        parsing, staging = budgets.parsing(), budgets.staging()
        snapshot.update(refused_staging=staging.refused, stalled_parsing=parsing.stalled,
                        stalled_staging=staging.stalled, parsing_bytes=parsing.in_use,
                        parsing_bytes_peak=parsing.peak, staging_bytes=staging.in_use,
                        staging_bytes_peak=staging.peak)
        return snapshot

    # -- listening --------------------------------------------------------------------------------
    @property
    def listen_address(self) -> Optional[Tuple[str, int]]:
        return self.listener.listen_address

    @property
    def unix_name(self) -> Optional[str]:
        """The abstract name of this cluster's Unix socket (learnt by authenticated peers)."""
        return self.listener.unix_name

    def start_listener(self, ip: str, port: int) -> None:
        """Listen on ``ip:port`` (port 0 = any free port; see ``listen_address``), and on a Unix
        socket of a random abstract name that same-host peers learn after authenticating."""
        self.listener.start(ip, port)
        host, bound = self.listen_address
        logger.info("cluster %d listening on %s:%d", self.engine.cluster_id, host, bound)
        self.settings.warn_if_open(ip, bound)

    def stop_listener(self) -> None:
        self.listener.stop()

    # -- client side ------------------------------------------------------------------------------
    def link(self, remote_cluster_id: int, ip: str, port: int, timeout_ms: int,
             comm: Optional[Tuple[str, str]] = None, quiet: bool = False, rank: Optional[int] = None) -> LLMStatusCode:
        """Link to the cluster listening on ``ip:port``; returns a status, never raises.

        A cluster that has linked to this one already is linked (``LLM_SUCCESS``: that link
        serves both); so is one that links to this one at the same moment (the link made by the
        lower cluster id is kept). ``comm`` names the two-sided link this one is part of, in
        which this cluster has ``rank``; a link made for another purpose does not serve it
        (``LLM_ALREADY_LINK``).
        """
        deadline = dl.after(timeout_ms)
        with self._lock:
            old = self._peers.get(remote_cluster_id)
            if remote_cluster_id in self._linking:
                return S.LLM_ALREADY_LINK
            live = old is not None and not old.hung_up()
            if live and comm is not None:
                return S.LLM_SUCCESS if old.is_client and old.comm == comm else S.LLM_ALREADY_LINK
            if live and old.is_client:
                return S.LLM_ALREADY_LINK
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
            return self._link(remote_cluster_id, ip, port, deadline, sockets, comm, rank)
        except MutualLink:
            status = self._await_mutual(remote_cluster_id, deadline)
        except LLMException as exc:
            if isinstance(exc, handshake.AuthRefused):
                self._count("auth_failures")
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
            close_socket(sock)
        return status

    def link_address(self, ip: str, port: int, timeout_ms: int) -> Tuple[LLMStatusCode, Optional[int]]:
        """Link to whichever cluster listens on ``ip:port``: ``(status, its cluster id)``, the id
        None when no handshake got that far; never raises. The id is the one the peer's challenge
        names (with a link secret, proven by it like a given one: ``handshake.client_handshake``)
        and the link is made to that id, as ``link`` would. A cluster already linked answers
        ``LLM_ALREADY_LINK`` (this side's link) or ``LLM_SUCCESS`` (the peer's, which serves both);
        this cluster's own listener is refused (``LLM_LINK_FAILED``)."""
        deadline = dl.after(timeout_ms)
        mine = self.engine.cluster_id
        found: List[int] = []
        reserved: List[int] = []

        def reserve(peer_id: int) -> None:  # as ``link`` does before it connects
            found.append(peer_id)
            if peer_id == mine:
                raise fail(S.LLM_LINK_FAILED, "that address is this cluster's own listener")
            with self._lock:
                old = self._peers.get(peer_id)
                if peer_id in self._linking:
                    raise _Known(S.LLM_ALREADY_LINK)
                if old is not None and not old.hung_up():
                    raise _Known(S.LLM_ALREADY_LINK if old.is_client else S.LLM_SUCCESS if old.ready else None)
                if old is not None:
                    self._forget(old, "its connections were closed")
                self._linking.add(peer_id)
                self._unlinked_by_peer.discard(peer_id)
                reserved.append(peer_id)
            if old is not None:
                old.close()

        sockets: List[socket.socket] = []
        try:
            first = handshake.connect_tcp(ip, port, deadline)
            sockets.append(first)
            agreement = handshake.request_link(first, mine, self.settings.secret, None, self.engine.role,
                                               self.plane_choice.offered(), self.settings.remote_accessible,
                                               self.plane_choice.wants_local_sockets(), deadline, on_peer=reserve,
                                               protect=self.settings.protection)
            status = self._finish_link(agreement.cluster_id, ip, port, deadline, sockets, first, agreement)
        except _Known as known:
            status = known.status if known.status is not None else self._await_mutual(found[0], deadline)
        except MutualLink:
            status = self._await_mutual(found[0], deadline)
        except LLMException as exc:
            if isinstance(exc, handshake.AuthRefused):
                self._count("auth_failures")
            logger.error("link %d -> %s:%d failed: %s", mine, ip, port, exc)
            status = exc.status_code
        except Exception as exc:  # a refused connection, a malformed reply: the link fails, never raises
            logger.error("link %d -> %s:%d failed: %s: %s", mine, ip, port, type(exc).__name__, exc)
            status = S.LLM_LINK_FAILED
        finally:
            with self._lock:
                for peer_id in reserved:
                    self._linking.discard(peer_id)
        for sock in sockets:
            close_socket(sock)
        return status, (found[0] if found else None)

    def _await_mutual(self, remote_cluster_id: int, deadline: float) -> LLMStatusCode:
        """The peer is linking to this cluster at the same time and its link is the one kept:
        wait for it to arrive."""
        while not dl.expired(deadline):
            with self._lock:
                peer = self._peers.get(remote_cluster_id)
                if peer is not None and peer.ready and not peer.is_client:
                    return S.LLM_SUCCESS
            time.sleep(0.005)
        logger.error("link %d -> %d: the peer's own link to this cluster did not arrive in time",
                     self.engine.cluster_id, remote_cluster_id)
        return S.LLM_LINK_FAILED

    # -- the planes ---------------------------------------------------------------------------------
    def data_plane(self, remote_cluster_id: int, timeout_ms: int = 5000, local_device: bool = False,
                   remote_device: bool = False) -> str:
        """The plane of this side's transfers to a linked cluster (chosen now if not yet): the
        link's plane, or with device memory on either side the device plane of that combination."""
        return self.plane_choice.data_plane(self.peer(remote_cluster_id), timeout_ms, local_device, remote_device)

    # -- registry changes ---------------------------------------------------------------------------
    def registered(self, record: Any) -> None:
        """The engine registered (or allocated) a cache: every plane hears of it."""
        for plane in self.planes.all:
            plane.on_register(record)

    def unregistered(self, record: Any) -> None:
        """A cache left the engine's registry: every plane hears of it."""
        for plane in self.planes.all:
            plane.on_unregister(record)

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
        self._drop_peer(remote_cluster_id, peer)
        if not peer.closed:  # a connection's end came first and _lose left the closing to this
            peer.close()
        return status

    def _drop_peer(self, remote_cluster_id: int, expected: Optional[Link] = None) -> None:
        """Forget the link to a cluster (only if it is still ``expected``, when given)."""
        with self._lock:
            peer = self._peers.get(remote_cluster_id)
            if peer is None or (expected is not None and peer is not expected):
                return
            del self._peers[remote_cluster_id]
            self._pending.pop(peer.token, None)
        peer.close()

    def _forget(self, peer: Link, why: str) -> bool:
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
            if not peer.unlinking:
                self.two_sided.link_ended(peer, why)
            if peer.ready and not peer.unlinking:
                self._lost[peer.cluster_id] = budgets.truncate_reason(why)
                while len(self._lost) > budgets.MAX_LOST_RECORDS:
                    self._lost.pop(next(iter(self._lost)))
                self.stats["links_lost"] += 1
            return True

    def _lose(self, peer: Link, why: str, quiet: bool = False) -> None:
        """A connection of the link ended without an unlink: forget the link, close the rest of
        its connections, and remember why (``lost_links``). Not called with the lock held."""
        current = self._forget(peer, why)
        if peer.closed or peer.unlinking:
            # This side's unlink closes it once the peer answered (the peer closes the link's
            # other connections right after answering, and their ends may arrive first).
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

    def peer(self, remote_cluster_id: int) -> Link:
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
    def _fetch_table(self, peer: Link, timeout_ms: int) -> Tuple[RemoteTable, Dict[str, Any]]:
        """The peer's cache table, and what its planes told us (``_plane_facts``); a reply that
        is malformed in either fails with ``LLM_LINK_FAILED`` (counted ``malformed_tables``)."""
        status, body = peer.outgoing.control(wire.OP_TABLE_GET, wire.OP_TABLE, {}, timeout_ms, "cache table",
                                             limit=self.settings.max_table_bytes,
                                             on_oversized=lambda: self._count("refused_tables"))
        try:
            return RemoteTable(body), plane_facts(body)
        except ProtocolError as exc:
            self._count("malformed_tables")
            raise LLMException(f"cluster {peer.cluster_id} sent a bad cache table: {exc}",
                               status_code=S.LLM_LINK_FAILED) from None

    def refresh_table(self, peer: Link, timeout_ms: int) -> RemoteTable:
        table, facts = self._fetch_table(peer, timeout_ms)
        peer.table, peer.facts = table, facts
        for plane in [peer.plane, *peer.extra_planes]:
            if plane is not None:
                plane.on_table(peer, table)
        return table

    def transfer(self, remote_cluster_id: int, make_plan: Callable[[RemoteTable], Any], write: bool,
                 timeout_ms: int, local_device: bool = False) -> Any:
        """Plan against the peer's table and move the bytes (``write``: local -> peer).

        ``local_device``: the plan's local side is device memory that the host cannot address.
        Whether its remote side is, the peer's table says (``RemoteTable.device_side``); either
        takes the link's device plane for that combination instead of the link's plane.

        A plan that names a cache the table lacks (``LLM_KV_CACHE_NOT_EXIST``), or a transfer
        that finds the peer's registry changed, refreshes the table once and plans again.
        Returns the plan that ran.
        """
        peer = self.peer(remote_cluster_id)
        deadline = dl.after(timeout_ms)
        try:
            return self._transfer(peer, make_plan, write, deadline, local_device)
        except BaseException:
            why = peer.broken()
            if why is not None:  # out of step: the link cannot carry another request
                self._lose(peer, why)
            raise

    def block_route(self, remote_cluster_id: int, table: RemoteTable, remote_layout, local_layout,
                    write: bool, timeout_ms: int):
        """The plane's route for repeated block transfers against ``remote_layout`` of ``table``
        (see ``DataPlane.block_route``), or None. ``timeout_ms``: each of its calls' limit; a call
        that leaves the link out of step ends the link, as a failed ``transfer`` does."""
        peer = self._peers.get(remote_cluster_id)
        if peer is None or peer.closed or peer.plane is None or peer.table is not table:
            return None
        return peer.plane.block_route(peer, table, remote_layout, local_layout, write, timeout_ms,
                                      lambda why: self._lose(peer, why))

    def _transfer(self, peer: Link, make_plan, write: bool, deadline: float, local_device: bool = False):
        plane = peer.plane
        if plane is None:
            self.plane_choice.settle(peer, deadline)
            plane = peer.plane
        refreshed = False
        while True:
            try:
                table = peer.table
                if not plane.table_is_current(peer, table):
                    raise StaleTable()
                plan = make_plan(table)
                remote_device = table.device_side(plan, write)
                if local_device or remote_device:
                    device_plane = self.plane_choice.device_plane(peer, local_device, remote_device, deadline)
                    if device_plane is not plane and not device_plane.table_is_current(peer, table):
                        raise StaleTable()
                    device_plane.transfer_device(peer, table, plan, write, deadline, local_device, remote_device)
                else:
                    plane.transfer(peer, table, plan, write, deadline)
                return plan
            except StaleTable:
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
                self.refresh_table(peer, dl.left_ms(deadline))

    def release_key(self, remote_cluster_id: int, owner_key: tuple, tensors: List[int], timeout_ms: int) -> bool:
        """Tell the owner which tensors of a keyed row were pulled; True if it released the key."""
        peer = self.peer(remote_cluster_id)
        _, reply = peer.outgoing.control(wire.OP_KEY_DONE, wire.OP_KEY_DONE_REPLY,
                                         {"key": list(owner_key), "tensors": tensors}, timeout_ms, "key release",
                                         limit=budgets.max_message_bytes())
        return bool(reply.get("released"))

    # -- two-sided links (``two_sided``) ----------------------------------------------------------
    @property
    def comms(self) -> Dict[int, Comm]:
        """The two-sided links made, by comm id (``TwoSidedLinks.comms``)."""
        return self.two_sided.comms

    def new_comm(self, name: str, key: Tuple[str, str], members, me) -> Comm:
        return self.two_sided.new_comm(name, key, members, me)

    def join_comm(self, comm: Comm, timeout_ms: int) -> None:
        """Make the links of a two-sided link (``TwoSidedLinks.join``)."""
        self.two_sided.join(comm, timeout_ms)

    def comm(self, comm_id: int) -> Comm:
        return self.two_sided.comm(comm_id)

    def leave_comm(self, comm_id: int, timeout_ms: int) -> None:
        """Drop a two-sided link: its links (made for it, accepted or initiated) are unlinked."""
        self.two_sided.leave(comm_id, timeout_ms)

    def _current(self, cluster_id: int) -> Optional[Link]:
        """The link to ``cluster_id`` in the table, or None."""
        with self._lock:
            return self._peers.get(cluster_id)

    def _settle_link(self, cluster_id: int, deadline: float) -> None:
        """Fetch the table of a linked peer and choose this side's plane on its link."""
        self.plane_choice.settle(self.peer(cluster_id), deadline)

    def _drop_comm_link(self, cluster_id: int, key: Tuple[str, str], timeout_ms: int = 1000) -> None:
        """Unlink the link to ``cluster_id`` if it was made for the comm ``key`` (a link belongs to
        the one comm it was made for: ``link`` does not let another comm use it)."""
        with self._lock:
            peer = self._peers.get(cluster_id)
        if peer is not None and peer.comm == key:
            self.unlink(cluster_id, timeout_ms, force=False)
        with self._lock:
            self._unlinked_by_peer.discard(cluster_id)
            self._lost.pop(cluster_id, None)

    # -- the application's hooks (``hooks``) -------------------------------------------------------
    def set_notify_handler(self, handler: Optional[NotifyHandler]) -> None:
        """``Hooks.set_notify_handler``: answer the peers' notifications with ``handler``."""
        self.hooks.set_notify_handler(handler)

    def set_read_guard(self, guard: Optional[Callable[[int, bytes], Any]]) -> None:
        """``Hooks.set_read_guard``: check every peer's pull through the server with ``guard``."""
        self.hooks.set_read_guard(guard)

    def set_write_guard(self, guard: Optional[Callable[[int], Any]]) -> None:
        """``Hooks.set_write_guard``: check every peer's push through the server with ``guard``."""
        self.hooks.set_write_guard(guard)

    def quiesce_writes(self, peer_cluster_id: int, timeout_s: float) -> bool:
        """``Hooks.quiesce_writes``: wait for the peer's pushes that passed the write guard to end."""
        return self.hooks.quiesce_writes(peer_cluster_id, timeout_s)

    def notify(self, remote_cluster_id: int, message: Dict[str, Any], timeout_ms: int) -> Dict[str, Any]:
        """Send a JSON object to a linked peer over the link and return its handler's reply
        (``Hooks.notify``); ``LLMException`` with the peer's status if it refused or failed."""
        return self.hooks.notify(self.peer(remote_cluster_id), message, timeout_ms)

    def _on_unlink(self, fd: int, req_id: int, length: int, peer: Link) -> bool:
        """The server's handler of ``OP_UNLINK``: the peer ends the link."""
        peer_id = peer.cluster_id
        message, goes_on = server.read_control(fd, req_id, length, wire.OP_UNLINK_DONE, "unlink", self._count,
                                               peer, parse=False)
        if message is None:
            return goes_on
        # Forget the link before answering, so that a relink right after the answer is not
        # mistaken for this one; close the connections after answering.
        with self._lock:
            peer.unlinked_by_peer = True
            if self._peers.get(peer_id) is peer:
                del self._peers[peer_id]
                if not peer.unlinking:
                    self.two_sided.link_ended(peer, "the peer unlinked")
                    self._unlinked_by_peer.add(peer_id)
                    while len(self._unlinked_by_peer) > budgets.MAX_LOST_RECORDS:
                        self._unlinked_by_peer.pop()
            self._self_peers = [p for p in self._self_peers if p is not peer]
        server.reply(fd, wire.OP_UNLINK_DONE, req_id, 0)
        peer.close()
        logger.info("cluster %d: cluster %d unlinked", self.engine.cluster_id, peer_id)
        return False

    # -- the handshake of accepted connections ------------------------------------------------------
    def _serve_accepted(self, conn: socket.socket, name: str) -> None:
        """The listener's accept callback: the handshake of an accepted connection, then serve it
        (or hand it to a Channel). The socket is closed on every other way out."""
        handed_over = False
        try:
            handed_over = self._handshake_accepted(conn, name)
        except ProtocolError as exc:
            logger.warning("closing connection from %s: %s", name, exc)
            self.engine.count_protocol_error()
        except LLMException as exc:  # closed, silent or too slow
            self._count("handshake_failures")
            logger.info("closing connection from %s: %s", name, exc)
        finally:
            self.listener.handshake_done(conn)
            if not handed_over:
                close_socket(conn)

    def _handshake_accepted(self, conn: socket.socket, name: str) -> bool:
        """hello -> challenge -> auth -> reply; then what the connection is for. True if the
        socket now belongs to a link."""
        fd = conn.fileno()
        deadline = dl.after(self.settings.handshake_ms)
        mine = self.engine.cluster_id
        def auth_failed(peer_id: int, why: str) -> None:  # counted before the peer is told
            self._count("auth_failures")
            logger.warning("cluster %d refused a connection from %s claiming cluster %d: %s", mine, name,
                           peer_id, why)

        admission = handshake.accept_hello(conn, mine, self.settings.secret, deadline, auth_failed)
        peer_id = admission.peer_id
        if admission.refused is not None or not self.listener.authenticated(conn):
            return False  # (not authenticated: it gave its slot up, or every authenticated slot is taken)
        purpose = admission.purpose
        if purpose == "link":
            proven_self = peer_id == mine and auth.verify_self(self.settings.self_key, *admission.nonces,
                                                               admission.request.get("self_proof"))
            status, reply, peer = self._accept_link(peer_id, handshake.read_link_request(admission.request), name,
                                                    source_of(conn), proven_self, self.listener.on_rank_port(conn))
            reply = handshake.signed_reply(self.settings.secret, admission, reply)
            if peer is not None:  # (set before the reply goes: the data connections come after it)
                peer.link_digest = protection.link_digest(admission.request, reply)
            sent = handshake.send_reply(conn, reply, status, deadline)
            if status != 0:
                return False
            self.listener.handshake_done(conn)
            # The client opens the link's data connections, then closes this one: wait for that
            # (or the deadline); a link whose connections did not all arrive is dropped.
            if sent:
                _io.recv_discard(fd, 1, max(1, dl.left_ms(deadline)))
            with self._lock:
                complete = peer.ready
            if not complete:
                self._lose(peer, "its connections did not arrive", quiet=True)
                return False
            try:  # choose this side's plane now rather than on the first transfer
                self.plane_choice.settle(peer, dl.after(self.settings.handshake_ms))
            except LLMException as exc:
                self._lose(peer, f"no data plane: {exc}")
            return False
        if purpose in ("forward", "reverse"):
            status, reply, peer, relay = self._accept_data(peer_id, purpose, admission.request.get("token"), conn,
                                                           admission.nonces)
            reply = handshake.signed_reply(self.settings.secret, admission, reply)
            if not handshake.send_reply(conn, reply, status, deadline) or status != 0:
                if peer is not None:
                    self._lose(peer, f"its {purpose} connection failed", quiet=True)
                if relay is not None:
                    relay.close()
                return False
            self.listener.handshake_done(conn)
            if relay is not None:  # what the link sends from now on is sealed
                relay.start()
            if purpose == "forward":
                self.server.serve(conn if relay is None else relay.inner, name, peer)
            return True  # serve closed it, or a Channel holds it (and a relay the TCP socket)
        raise ProtocolError(f"unknown purpose {brief(purpose)}")

    def _accept_link(self, peer_id: int, request: handshake.LinkRequest, name: str, source: Any = None,
                     proven_self: bool = False, rank_port: bool = False):
        """Decide on an authenticated link request from ``source`` (``listener.source_of``;
        ``proven_self``: it carries this process's self-link proof; ``rank_port``: it came through
        a two-sided link's listener, where only members of a comm being made may link, see
        ``comms``): ``(status, reply, pending Link or None)``."""
        mine = self.engine.cluster_id
        reply: Dict[str, Any] = {"cluster_id": mine}

        def refuse(status: int, why: str):
            logger.warning("cluster %d refused a link from %s (cluster %d): %s", mine, name, peer_id, why)
            return status, dict(reply, error=why), None

        comm = request.comm
        if comm is None and rank_port:
            return refuse(S.LLM_LINK_FAILED, "a link on a rank-table port must name its comm, the digest of its rank "
                                             "table and rank map, and its rank")
        if comm is None and request.remote_accessible != self.settings.remote_accessible:
            return refuse(S.LLM_PARAM_INVALID, "enable_remote_cache_accessible differs between the two clusters")
        protected = protection.stronger(request.protection, self.settings.protection)
        if protected != protection.OFF and self.settings.secret is None:
            return refuse(S.LLM_LINK_FAILED, f"protection {protected} needs a link secret on both sides")
        suite = None if protected == protection.OFF else protection.choose(protected, request.suites)
        if protected != protection.OFF and suite is None:
            return refuse(S.LLM_LINK_FAILED, f"protection {protected}: no record suite both sides run (cluster "
                                             f"{self.engine.cluster_id} runs {', '.join(protection.suites_here())}, "
                                             f"the linking side offered {', '.join(request.suites) or 'none'}; "
                                             f"{protection.CRYPTOGRAPHY_MISSING})")
        expect_unix = self.listener.unix_name is not None and request.same_host and any(
            name in plane_registry.names() and plane_registry.get(name).local_sockets for name in request.planes)
        if expect_unix:
            # Its connections will be Unix sockets from the uid it states (``_accept_data`` holds
            # them to it): that uid, not the loopback address every local process shares, is its
            # source for the link caps and the budgets' shares from the start.
            source = ("uid", request.uid)
        peer = Link(peer_id, request.role, False, (name, 0), request.planes, token=os.urandom(16).hex(),
                    want=request.want, comm=comm, source=source, shares=budgets.LinkShares(source),
                    authenticated=self.settings.secret is not None, protection=protected, protection_suite=suite,
                    stated=(request.pid, request.uid), expect_unix=expect_unix)
        if peer_id == mine and comm is None:  # a link to our own listener: its server side is kept apart
            if not proven_self:  # only this very process may link to its own listener under its own id
                refused = self._count("refused_self")
                if refused in (1, 10, 100) or refused % 1000 == 0:  # rate-limited
                    logger.warning("cluster %d refused %d link request(s) claiming its own cluster id without "
                                   "proof that they come from this process (the last from %s)", mine, refused, name)
                return S.LLM_LINK_FAILED, dict(reply, error="a self-link of another process"), None
            with self._lock:
                if len(self._self_peers) >= MAX_CONNECTIONS:
                    return refuse(S.LLM_LINK_FAILED, "too many links to itself")
                self._self_peers.append(peer)
                self._pending[peer.token] = peer
            return S.LLM_SUCCESS, self._link_reply(peer), peer
        with self._lock:
            join = None if comm is None else self.two_sided.joining(comm)
            if comm is not None and join is None:
                return S.LLM_NOT_YET_LINK, dict(reply, error="this cluster is not making that link now"), None
            why = None if join is None else self.two_sided.admit_member(join, peer_id, request.rank)
            if why is not None:
                return refuse(S.LLM_LINK_FAILED, why)
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
            if len(self._peers) - (old is not None) >= self.settings.max_links:
                self.stats["refused_links"] += 1
                return refuse(S.LLM_LINK_FAILED,
                              f"this cluster holds {self.settings.max_links} links ({MAX_LINKS_ENV})")
            if source is not None and sum(p.source == source and p is not old for p in self._peers.values()) \
                    >= self.settings.max_links_per_source:
                self.stats["refused_source_links"] += 1
                return refuse(S.LLM_LINK_FAILED, f"this cluster holds {self.settings.max_links_per_source} links from "
                                                 f"{describe(source)} ({MAX_LINKS_PER_SOURCE_ENV})")
            if old is not None:
                self._forget(old, "replaced by a new link: its connections were closed")
            if join is not None:
                join.claimed[peer_id] = peer
            self._peers[peer_id] = peer
            self._pending[peer.token] = peer
        if old is not None:
            old.close()
        return S.LLM_SUCCESS, self._link_reply(peer), peer

    def _link_reply(self, peer: Link) -> Dict[str, Any]:
        return handshake.link_reply(self.engine.cluster_id, self.engine.role, self.plane_choice.offered(),
                                    self.settings.remote_accessible, peer.token, self.listener.unix_name,
                                    peer.protection, peer.protection_suite)

    def _accept_data(self, peer_id: int, purpose: str, token: Any, conn: socket.socket, nonces: Tuple[str, str]):
        """A data connection of a link being made: ``(status, reply, Link or None, Relay or None)``;
        on a protected link a TCP connection gets a ``protection.Relay`` (not started), whose
        inner socket the link holds in its place."""
        refused = S.LLM_LINK_FAILED, {"error": "no pending link for this connection"}, None, None
        unix = conn.family == socket.AF_UNIX
        pid, uid = peer_credentials(conn) if unix else (0, -1)
        with self._lock:
            peer = self._pending.get(token) if isinstance(token, str) else None
            if peer is None or peer.cluster_id != peer_id or not self._holds(peer):
                return refused
            if unix and peer_id == self.engine.cluster_id and pid != os.getpid():
                return refused  # a self-link's connections come from this process (the kernel says so)
            if not unix and peer.expect_unix:
                # The two processes share this host and a plane of the linking side wants Unix
                # sockets, so its connections come over this side's Unix socket, never TCP: a TCP
                # data connection here comes through something else (a relay) or a side that was
                # made to fall back (its Unix connect refused under a flood): refused.
                logger.warning("cluster %d refused a TCP connection of cluster %d's link: the link is between two "
                               "processes of this host, whose connections are Unix sockets", self.engine.cluster_id,
                               peer_id)
                refusal = {"error": "a TCP connection for a link of two processes of one host"}
                return S.LLM_LINK_FAILED, refusal, peer, None
            if unix and (pid, uid) != peer.stated:
                # Not the process that asked for the link (a relay between it and this socket).
                logger.warning("cluster %d refused a Unix connection of cluster %d's link from pid %d (uid %d): the "
                               "link was asked for by pid %d (uid %d)", self.engine.cluster_id, peer_id, pid, uid,
                               *peer.stated)
                refusal = {"error": "a Unix connection from another process than the link's"}
                return S.LLM_LINK_FAILED, refusal, peer, None
            first = not peer.channels and not peer.incoming
            if first:
                peer.unix, peer.pid, peer.uid = unix, pid, uid
            elif (peer.unix, peer.pid, peer.uid) != (unix, pid, uid):
                # Every connection of a link comes from one process, over one kind of socket.
                return S.LLM_LINK_FAILED, {"error": "connections of one link from different processes"}, peer, None
            if len(peer.incoming if purpose == "forward" else peer.channels) >= peer.want[purpose != "forward"]:
                return refused
            relay = None
            if not unix and peer.protection != protection.OFF:
                try:
                    relay = self._relay(conn, peer.protection_suite, nonces, peer_id, self.engine.cluster_id, False,
                                        f"cluster {peer_id} ({peer.address[0]})", peer.link_digest)
                except OSError as exc:  # no socket pair (out of descriptors)
                    return S.LLM_LINK_FAILED, {"error": f"no relay for a protected connection: {exc}"}, peer, None
            sock = conn if relay is None else relay.inner
            if purpose == "forward":
                peer.incoming.append(sock)
            else:
                peer.channels.append(Channel(sock, f"cluster {peer_id} ({peer.address[0]})", peer.shares))
            if len(peer.incoming) == peer.want[0] and len(peer.channels) == peer.want[1]:
                peer.ready = True
                del self._pending[token]
                logger.info("cluster %d: cluster %d linked from %s%s", self.engine.cluster_id, peer_id,
                            "this host" if unix else peer.address[0],
                            "" if peer.protection == protection.OFF else
                            f" (protection {peer.protection}, {peer.protection_suite})")
        return S.LLM_SUCCESS, {"cluster_id": self.engine.cluster_id}, peer, relay

    def _relay(self, sock: socket.socket, suite: str, nonces: Tuple[str, str], client_id: int, server_id: int,
               is_client: bool, name: str, digest: bytes) -> protection.Relay:
        """The relay sealing one TCP connection of a protected link in ``suite`` (keys of the
        connection's own handshake and the link's ``digest``)."""
        assert self.settings.secret is not None  # a protected link is an authenticated one
        keys = protection.derive_keys(self.settings.secret, suite, nonces[0], nonces[1], client_id, server_id, digest)

        def failed(why: str) -> None:
            self._count("protection_failures")

        return protection.Relay(sock, suite, keys, is_client, name, self._relays, failed)

    def _holds(self, peer: Link) -> bool:
        return self._peers.get(peer.cluster_id) is peer or any(p is peer for p in self._self_peers)

    # -- the client's side of a link ----------------------------------------------------------------
    def _link(self, remote_cluster_id: int, ip: str, port: int, deadline: float,
              sockets: List[socket.socket], comm: Optional[Tuple[str, str]] = None,
              rank: Optional[int] = None) -> LLMStatusCode:
        """The steps of ``link``; every socket it opens goes to ``sockets`` (closed by the caller
        unless the link is made, in which case ``sockets`` is emptied)."""
        mine = self.engine.cluster_id
        first = handshake.connect_tcp(ip, port, deadline)
        sockets.append(first)
        agreement = handshake.request_link(first, mine, self.settings.secret, remote_cluster_id, self.engine.role,
                                           self.plane_choice.offered(), self.settings.remote_accessible,
                                           self.plane_choice.wants_local_sockets(), deadline, comm,
                                           self.settings.self_key if remote_cluster_id == mine else None, rank,
                                           protect=self.settings.protection)
        return self._finish_link(remote_cluster_id, ip, port, deadline, sockets, first, agreement, comm)

    def _finish_link(self, remote_cluster_id: int, ip: str, port: int, deadline: float,
                     sockets: List[socket.socket], first: socket.socket, agreement: handshake.LinkAgreement,
                     comm: Optional[Tuple[str, str]] = None) -> LLMStatusCode:
        """The rest of ``_link`` once the link request on ``first`` was granted."""
        mine = self.engine.cluster_id
        name = f"cluster {remote_cluster_id} ({ip}:{port})"

        def seal(sock: socket.socket, nonces: Tuple[str, str]) -> socket.socket:
            relay = self._relay(sock, agreement.suite, nonces, mine, remote_cluster_id, True, name, agreement.digest)
            relay.start()
            return relay.inner

        made = handshake.open_connections(ip, port, mine, self.settings.secret, remote_cluster_id, agreement, deadline,
                                          sockets, seal)
        # (its shares of the budgets: under the address it was made to, or the uid it runs as)
        shares = budgets.LinkShares(("uid", made.uid) if made.unix else source_of(first))
        peer = Link(remote_cluster_id, agreement.role, True, (ip, port), agreement.planes, comm=comm,
                    authenticated=self.settings.secret is not None, protection=agreement.protection,
                    protection_suite=agreement.suite, stated=agreement.process, shares=shares)
        peer.unix, peer.pid, peer.uid = made.unix, made.pid, made.uid
        peer.channels = [Channel(sock, name, shares) for sock in made.forward]
        peer.incoming = made.reverse
        peer.ready = True
        sockets.remove(first)
        close_socket(first)  # the server now holds the link as made
        self.plane_choice.settle(peer, deadline)
        with self._lock:
            if self._closed:
                raise fail(S.LLM_LINK_FAILED, "finalized while linking")
            self._peers[remote_cluster_id] = peer
            self._lost.pop(remote_cluster_id, None)
        sockets.clear()  # they belong to the link now
        for sock in made.reverse:
            self.server.serve_in_thread(sock, f"{ip}:{port}", peer)
        logger.info("cluster %d linked to %d at %s:%d (data plane %s)", self.engine.cluster_id,
                    remote_cluster_id, ip, port, peer.plane_name)
        return S.LLM_SUCCESS

    # -- life cycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Tell every linked peer that its link ends (as CANN's finalize unlinks everything, so
        that the peers see an unlink rather than a lost link), stop listening, drop every link
        and join the connection threads; the planes release their per-engine state last."""
        with self._lock:
            linked = [cid for cid, peer in self._peers.items() if peer.ready and not peer.hung_up()]
        _parallel(lambda cid: self.unlink(cid, FINALIZE_UNLINK_MS, force=False), linked)
        with self._lock:
            self._closed = True
        self.server.stop()
        self.listener.close()
        with self._lock:
            peers = list(self._peers.values()) + self._self_peers
            self._peers.clear()
            self._self_peers = []
            self._pending.clear()
        for peer in peers:
            peer.close()
        self.listener.drain()  # connections still in their handshake, and its threads
        self.server.join()
        self.two_sided.join_threads()
        self._relays.join()
        for plane in self.planes.all:
            plane.shutdown()


class _Known(Exception):
    """``link_address`` found the cluster already linked (``status``; None: the peer's own link
    to this cluster is being made, to be waited for)."""

    def __init__(self, status: Optional[LLMStatusCode]) -> None:
        super().__init__(status)
        self.status = status


def _parallel(fn: Callable[[Any], LLMStatusCode], items: List[Any]) -> List[LLMStatusCode]:
    if len(items) <= 1:
        return [fn(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=min(16, len(items)), thread_name_prefix="llm_datadist-link") as pool:
        return list(pool.map(fn, items))


