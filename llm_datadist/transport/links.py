"""Links between clusters: ``LinkManager``, the facade the engine uses.

A link between a client (the side calling ``link_clusters``) and a server (the side with
``listen_ip_info``) is made of connections that the client opens (``handshake``): a *link*
connection for the handshake, then *forward* connections (the client's requests, served by
server threads, ``server``) and *reverse* ones (the server's requests), Unix sockets on this host
when a plane wants them, TCP otherwise. The listeners are ``listener``'s; a link's state on this
side is a ``session.Peer``.

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
links and threads are bounded (``LLM_DATADIST_MAX_PENDING_HANDSHAKES``,
``LLM_DATADIST_MAX_LINKS``, ``LLM_DATADIST_HANDSHAKE_TIMEOUT_MS``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.transport import auth, wire
from llm_datadist.transport import deadline as dl
from llm_datadist.transport import planes as plane_registry
from llm_datadist.transport.comms import Comm
from llm_datadist.transport.engine_view import EngineView
from llm_datadist.transport.errors import S, MutualLink, ProtocolError, StaleTable, fail, status_of
from llm_datadist.transport.handshake import Handshakes
from llm_datadist.transport.listener import (DEFAULT_HANDSHAKE_TIMEOUT_MS, DEFAULT_MAX_LINKS, DEFAULT_MAX_PENDING,
                                             HANDSHAKE_TIMEOUT_ENV, MAX_LINKS_ENV, MAX_PENDING_ENV, Listeners,
                                             close_socket, env_int)
from llm_datadist.transport.planes import DATA_PLANE_ENV, DATA_PLANE_OPTION, DataPlane
from llm_datadist.transport.server import Server
from llm_datadist.transport.session import MAX_LOST_RECORDS, Peer
from llm_datadist.transport.staging import StagedPayload, drop_pool
from llm_datadist.transport.table import RemoteTable

__all__ = ["LinkManager", "Peer", "resolve_plane", "DATA_PLANE_OPTION", "DATA_PLANE_ENV"]

logger = logging.getLogger("llm_datadist")

#: How long ``close`` (finalize) waits for each peer to acknowledge its unlink.
FINALIZE_UNLINK_MS = 500


def resolve_plane(options: Dict[str, str]) -> str:
    """``auto`` or the registered plane that ``llm.DataPlane`` names (``LLM_PARAM_INVALID`` else)."""
    return plane_registry.resolve(options)


class LinkManager(Listeners, Handshakes, Server):
    """The link table of one engine, its listeners and its connection threads."""

    def __init__(self, engine: EngineView) -> None:
        self.engine = engine
        #: ``auto`` or the plane ``llm.DataPlane`` forces.
        self.plane = resolve_plane(engine.options)
        #: One instance of every registered plane, for this engine.
        self.planes: Dict[str, DataPlane] = {name: plane_registry.get(name)(engine)
                                             for name in plane_registry.names()}
        self.plane_objects: Tuple[DataPlane, ...] = tuple(self.planes.values())
        #: The payload of peers' transfers into and out of this engine's device memory (server).
        self._staged = StagedPayload(engine)
        self.remote_accessible = engine.options.get("llm.EnableRemoteCacheAccessible", "0") == "1"
        self.secret = auth.resolve_secret(engine.options)
        self.max_links = env_int(MAX_LINKS_ENV, DEFAULT_MAX_LINKS)
        self.max_pending = env_int(MAX_PENDING_ENV, DEFAULT_MAX_PENDING)
        self.handshake_ms = env_int(HANDSHAKE_TIMEOUT_ENV, DEFAULT_HANDSHAKE_TIMEOUT_MS)
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

    # -- client side ------------------------------------------------------------------------------
    def link(self, remote_cluster_id: int, ip: str, port: int, timeout_ms: int,
             comm: Optional[Tuple[str, str]] = None, quiet: bool = False) -> LLMStatusCode:
        """Link to the cluster listening on ``ip:port``; returns a status, never raises.

        A cluster that has linked to this one already is linked (``LLM_SUCCESS``: that link
        serves both); so is one that links to this one at the same moment (the link made by the
        lower cluster id is kept). ``comm`` names the two-sided link this one is part of.
        """
        deadline = dl.after(timeout_ms)
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
        except MutualLink:
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
            close_socket(sock)
        return status

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

    # -- choosing the data plane ------------------------------------------------------------------
    def _settle(self, peer: Peer, deadline: float) -> None:
        """Fetch the peer's table and choose the plane of this side's transfers (once)."""
        if peer.plane is not None:
            return
        with peer.settle_lock:
            if peer.plane is not None:
                return
            table, facts = self._fetch_table(peer, dl.left_ms(deadline))
            plane = self._choose_plane(peer, facts, deadline)
            peer.table, peer.facts = table, facts
            peer.plane = plane
            if peer.closed:  # unlinked or lost meanwhile: close() may have run before the accept
                plane.close(peer)

    def data_plane(self, remote_cluster_id: int, timeout_ms: int = 5000, local_device: bool = False,
                   remote_device: bool = False) -> str:
        """The plane of this side's transfers to a linked cluster (chosen now if not yet): the
        link's plane, or with device memory on either side the device plane of that combination."""
        peer = self.peer(remote_cluster_id)
        deadline = dl.after(timeout_ms)
        self._settle(peer, deadline)
        if local_device or remote_device:
            return self._device_plane(peer, local_device, remote_device, deadline).name
        return peer.plane.name

    def _plane(self, name: str) -> DataPlane:
        plane = self.planes.get(name)
        if plane is None:  # registered after this manager was made
            plane = self.planes[name] = plane_registry.get(name)(self.engine)
            self.plane_objects = tuple(self.planes.values())
        return plane

    def _choose_plane(self, peer: Peer, facts: Any, deadline: Optional[float] = None) -> DataPlane:
        """The forced plane, or under ``auto`` the first of ``planes.auto_order()`` without
        ``device_memory`` whose ``accept`` takes the link (the fallback plane always does). A
        link to this very process uses the fallback: frames, checked by the owner (ourselves). A
        forced plane that refuses fails the link (``LLM_LINK_FAILED``)."""
        if deadline is None:
            deadline = dl.after(self.handshake_ms)
        if not isinstance(facts, dict):
            facts = {}
        if peer.unix and peer.pid == os.getpid():
            names = plane_registry.fallbacks()
        elif self.plane == plane_registry.AUTO or not plane_registry.get(self.plane).host_memory:
            # Device planes are chosen per transfer (_device_plane); a forced plane that moves no
            # host memory applies to those only.
            names = tuple(n for n in plane_registry.auto_order() if not plane_registry.get(n).device_memory)
        else:
            names = (self.plane,)
        for name in names:
            plane = self._plane(name)
            reason = plane.accept(peer, facts, deadline)
            if reason is None:
                return plane
            plane.close(peer)
            if name == self.plane:
                raise fail(S.LLM_LINK_FAILED, f"{DATA_PLANE_OPTION}={name} but {reason}")
            logger.warning("cluster %d -> %d: data plane %s not usable (%s); trying the next one",
                           self.engine.cluster_id, peer.cluster_id, name, reason)
        raise fail(S.LLM_LINK_FAILED, f"no data plane of {', '.join(names)} accepts the link to cluster "
                                      f"{peer.cluster_id}")

    def _device_plane(self, peer: Peer, local_device: bool, remote_device: bool, deadline: float) -> DataPlane:
        """The plane of the link's transfers whose local side (``local_device``) or remote side
        (``remote_device``) is device memory the host cannot address: chosen on the first such
        transfer and kept for the link (``Peer.device_planes``)."""
        combination = (local_device, remote_device)
        plane = peer.device_planes.get(combination)
        if plane is not None:
            return plane
        with peer.settle_lock:
            plane = peer.device_planes.get(combination)
            if plane is None:
                plane = self._choose_device_plane(peer, local_device, remote_device, deadline)
                peer.device_planes[combination] = plane
        if peer.closed:  # unlinked or lost meanwhile: close() may have run before the accept
            plane.close(peer)
        return plane

    def _choose_device_plane(self, peer: Peer, local_device: bool, remote_device: bool,
                             deadline: float) -> DataPlane:
        """The forced plane if it has ``device_memory`` and carries this combination, else the
        first plane of the ``auto``
        order with ``device_memory`` that accepts the link and carries this combination (a
        plane accepted here is closed with the link). ``LLM_FEATURE_NOT_ENABLED`` if none does:
        the transfer fails, the link stays."""
        forced = None if self.plane == plane_registry.AUTO else self._plane(self.plane)
        if forced is not None and forced.device_memory and forced.carries(peer, local_device, remote_device):
            candidates = [forced]
        else:
            candidates = [self._plane(name) for name in plane_registry.auto_order()
                          if plane_registry.get(name).device_memory]
        reasons = []
        for plane in candidates:
            if plane is not peer.plane and not any(p is plane for p in peer.extra_planes):
                reason = plane.accept(peer, peer.facts, deadline)
                if reason is not None:
                    plane.close(peer)
                    reasons.append(f"{plane.name}: {reason}")
                    continue
                peer.extra_planes.append(plane)
            if plane.carries(peer, local_device, remote_device):
                return plane
            reasons.append(f"{plane.name} does not carry it")
        sides = " and ".join(side for side, device in (("local", local_device), ("remote", remote_device)) if device)
        why = "; ".join(reasons) or "none has device_memory"
        raise fail(S.LLM_FEATURE_NOT_ENABLED, f"no data plane moves device memory ({sides} side) on the link to "
                                              f"cluster {peer.cluster_id}: {why}")

    # -- registry changes ---------------------------------------------------------------------------
    def registered(self, record: Any) -> None:
        """The engine registered (or allocated) a cache: every plane hears of it."""
        for plane in self.plane_objects:
            plane.on_register(record)

    def unregistered(self, record: Any) -> None:
        """A cache left the engine's registry: every plane hears of it."""
        for plane in self.plane_objects:
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
    def _fetch_table(self, peer: Peer, timeout_ms: int) -> Tuple[RemoteTable, Dict[str, Any]]:
        """The peer's cache table, and the whole reply (what its planes told us, untrusted)."""
        status, body = peer.outgoing.control(wire.OP_TABLE_GET, wire.OP_TABLE, {}, timeout_ms, "cache table")
        try:
            return RemoteTable(body), body
        except ProtocolError as exc:
            raise LLMException(f"cluster {peer.cluster_id} sent a bad cache table: {exc}",
                               status_code=S.LLM_LINK_FAILED) from None

    def refresh_table(self, peer: Peer, timeout_ms: int) -> RemoteTable:
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
                    write: bool):
        """The plane's route for repeated block transfers against ``remote_layout`` of ``table``
        (see ``DataPlane.block_route``), or None."""
        peer = self._peers.get(remote_cluster_id)
        if peer is None or peer.closed or peer.plane is None or peer.table is not table:
            return None
        return peer.plane.block_route(peer, table, remote_layout, local_layout, write)

    def _transfer(self, peer: Peer, make_plan, write: bool, deadline: float, local_device: bool = False):
        plane = peer.plane
        if plane is None:
            self._settle(peer, deadline)
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
                    device_plane = self._device_plane(peer, local_device, remote_device, deadline)
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
        deadline = dl.after(timeout_ms)
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
                while not dl.expired(deadline):
                    status = self.link(member.cluster_id, member.device_ip, member.port, max(1, dl.left_ms(deadline)),
                                       comm=comm.key, quiet=True)
                    if status not in (S.LLM_LINK_FAILED, S.LLM_NOT_YET_LINK, S.LLM_ALREADY_LINK):
                        break
                    time.sleep(0.05)
                if status != S.LLM_SUCCESS:
                    raise fail(S.LLM_LINK_FAILED, f"cluster {member.cluster_id} (rank {member.rank}) at "
                                                   f"{member.device_ip}:{member.port} was not linked in time "
                                                   f"({status_of(status).name})")
            for member in higher:
                while not self._linked_now(member.cluster_id):
                    if dl.expired(deadline):
                        raise fail(S.LLM_LINK_FAILED, f"cluster {member.cluster_id} (rank {member.rank}) did not "
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
        deadline = dl.after(self.handshake_ms)
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
            raise fail(status, f"cluster {remote_cluster_id} did not take the notification: "
                                f"{status_of(status).name} ({reply.get('error', '')})")
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
            close_socket(sock)
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
        drop_pool(self.engine)


def _parallel(fn: Callable[[Any], LLMStatusCode], items: List[Any]) -> List[LLMStatusCode]:
    if len(items) <= 1:
        return [fn(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=min(16, len(items)), thread_name_prefix="llm_datadist-link") as pool:
        return list(pool.map(fn, items))


