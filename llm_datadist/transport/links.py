"""Links between clusters: ``LinkManager``, the facade the engine uses. It holds the link table
(links made, pending, being made, ended) and moves the bytes of transfers over the links; the
rest is done by parts that own their state, each handed what it needs as arguments or callbacks
(design.md section 10): ``settings``, ``listener`` (with its handshake ``slots``), ``acceptor``
(``accept``: the accepting side of the handshake), ``connector`` (``connect``: the linking side),
``server``, ``plane_choice`` (``planes.choice``) over the engine's ``planes``, ``two_sided``
(the comms, under the table's lock), ``hooks`` (notifications, read and write guards),
``relays`` (of protected connections) and ``counters`` (``stats``). What a part asks of the
table, the table answers under its lock (``_take_accepted``, ``_attach``, ``_reserve``, ...).

A connection that closes or breaks ends its whole link on both sides (``lost_links`` says why);
a new link from a cluster that is still linked is refused unless the old link's connections are
already closed. Links are bounded, in all and per source (``LLM_DATADIST_MAX_LINKS``,
``LLM_DATADIST_MAX_LINKS_PER_SOURCE``).
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.transport import budgets, wire
from llm_datadist.transport import deadline as dl
from llm_datadist.transport import planes as plane_registry
from llm_datadist.transport import server
from llm_datadist.transport.accept import Acceptor, Refusal, over_link_caps
from llm_datadist.transport.comms import Comm
from llm_datadist.transport.connect import Connector, Known
from llm_datadist.transport.engine_view import EngineView
from llm_datadist.transport.errors import S, StaleTable, fail
from llm_datadist.transport.hooks import Hooks, NotifyHandler
from llm_datadist.transport.listener import Listener
from llm_datadist.transport.planes import DATA_PLANE_ENV, DATA_PLANE_OPTION, PlaneSet
from llm_datadist.transport.planes.choice import PlaneChoice
from llm_datadist.transport.relays import Relays
from llm_datadist.transport.server import Requests, Server
from llm_datadist.transport.session import MAX_CONNECTIONS, Link
from llm_datadist.transport.settings import LinkSettings
from llm_datadist.transport.stats import LinkStats
from llm_datadist.transport.table import RemoteTable
from llm_datadist.transport.two_sided import TwoSidedLinks

__all__ = ["LinkManager", "resolve_plane", "DATA_PLANE_OPTION", "DATA_PLANE_ENV"]

logger = logging.getLogger("llm_datadist")

#: How long ``close`` (finalize) waits for each peer to acknowledge its unlink.
FINALIZE_UNLINK_MS = 500
#: The answer to a link request from a cluster this one is linking to at the same moment.
_MUTUAL = Refusal(S.LLM_ALREADY_LINK, "this cluster is linking to you at the same time; one link serves both",
                  logged=False, mutual=True)


def resolve_plane(options: Dict[str, str]) -> str:
    """``auto`` or the registered plane that ``llm.DataPlane`` names (``LLM_PARAM_INVALID`` else)."""
    return plane_registry.resolve(options)


class LinkManager:
    """The link table of one engine, and the facade over the parts of its links (module docstring)."""

    def __init__(self, engine: EngineView) -> None:
        self.engine = engine
        #: What the links are held to (the plane, the secret, the protection, the caps).
        self.settings = LinkSettings.resolve(engine.cluster_id, engine.options)
        #: One instance of every registered plane, for this engine (a mapping by name).
        self.planes = PlaneSet(engine)
        #: The counters of refused or failed connections (``stats.COUNTERS``; ``link_stats``).
        self.counters = LinkStats()
        self.stats = self.counters.values
        count = self.counters.count
        #: The peer's table on each link, and the planes chosen by it.
        self.plane_choice = PlaneChoice(engine.cluster_id, self.settings, self.planes, count)
        self._lock = threading.RLock()  # the link table's
        self._peers: Dict[int, Link] = {}
        self._pending: Dict[str, Link] = {}   # server side: token -> a link waiting for its connections
        self._linking: set = set()            # client side: cluster ids being linked now
        self._lost: Dict[int, str] = {}       # cluster id -> why its link ended without an unlink
        self._unlinked_by_peer: set = set()   # cluster ids whose link the peer ended with an unlink
        self._self_peers: List[Link] = []     # server side of links this cluster made to its own listener
        self._closed = False
        #: The listening sockets; each accepted connection comes to ``_serve_accepted``.
        self.listener = Listener.from_env(engine.cluster_id, self._serve_accepted, count)
        device_payload = next((p.device_payload for p in self.planes.all if p.device_payload is not None), None)
        #: The notification handler and the read and write guards.
        self.hooks = Hooks(engine.cluster_id, count, self._lose)
        self.read_guard, self.write_guard = self.hooks.read_guard, self.hooks.write_guard
        handlers = Requests(engine, lambda: self.planes.all, device_payload, count, self.read_guard,
                            self.write_guard).handlers()
        for plane in self.planes.all:  # a plane's own requests (DataPlane.requests)
            handlers.update(plane.requests())
        handlers[wire.OP_NOTIFY] = self.hooks.on_notify
        handlers[wire.OP_UNLINK] = self._on_unlink
        #: Serves the peers' requests on the links' incoming connections.
        self.server = Server(engine, handlers, self._lose)
        #: The relays of protected connections.
        self.relays = Relays(self.settings, count)
        #: The accepting side: the handshake of each accepted connection.
        self.acceptor = Acceptor(engine, self.settings, self.listener, self.server, self.plane_choice, self.relays,
                                 count, self._take_accepted, self._attach, self._arrived, self._lose)
        #: The linking side: the links this cluster makes.
        self.connector = Connector(engine, self.settings, self.plane_choice, self.relays, self.server, count,
                                   self._reserve, self._release, self._install, self._peer_linked_here)
        #: The two-sided links (``LLMDataDist.link``), under the table's lock.
        self.two_sided = TwoSidedLinks(engine.cluster_id, self._lock, self.settings, self.listener, self.link,
                                       self.unlink, self._current, self._forget_ended, self._settle_link)

    # (settings that callers read, and tests change, here)
    @property
    def secret(self) -> Optional[bytes]:
        return self.settings.secret

    @secret.setter
    def secret(self, value: Optional[bytes]) -> None:
        self.settings.secret = value

    @property
    def handshake_ms(self) -> int:
        return self.settings.handshake_ms

    @handshake_ms.setter
    def handshake_ms(self, value: int) -> None:
        self.settings.handshake_ms = value

    @property
    def remote_accessible(self) -> bool:
        return self.settings.remote_accessible

    def link_stats(self) -> Dict[str, int]:
        """A snapshot of ``stats``, of the process's budgets and of each plane's own counters
        (``LinkStats.snapshot``)."""
        return self.counters.snapshot(self.planes.all)

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

    # -- making links (``connect``) ---------------------------------------------------------------
    def link(self, remote_cluster_id: int, ip: str, port: int, timeout_ms: int,
             comm: Optional[Tuple[str, str]] = None, quiet: bool = False, rank: Optional[int] = None) -> LLMStatusCode:
        """Link to the cluster listening on ``ip:port``; returns a status, never raises
        (``Connector.link``)."""
        return self.connector.link(remote_cluster_id, ip, port, timeout_ms, comm, quiet, rank)

    def link_address(self, ip: str, port: int, timeout_ms: int) -> Tuple[LLMStatusCode, Optional[int]]:
        """Link to whichever cluster listens on ``ip:port``: ``(status, its cluster id)``; never
        raises (``Connector.link_address``)."""
        return self.connector.link_address(ip, port, timeout_ms)

    def link_many(self, targets: List[Tuple[int, str, int]], timeout_ms: int) -> List[LLMStatusCode]:
        """Link to every ``(cluster_id, ip, port)`` in parallel (at most 16 at a time)."""
        return _parallel(lambda t: self.link(t[0], t[1], t[2], timeout_ms), targets)

    def _reserve(self, cluster_id: int, comm: Optional[Tuple[str, str]] = None,
                 look: bool = False) -> Tuple[Optional[Known], Optional[Link]]:
        """Reserve ``cluster_id`` for a link this side makes (``look``: only look): ``(None, the old
        link, forgotten for the caller to close, or None)``, or ``(Known, None)`` if the cluster is
        linked or being linked (``Connector``)."""
        with self._lock:
            old = self._peers.get(cluster_id)
            if cluster_id in self._linking:
                return Known(S.LLM_ALREADY_LINK), None
            if old is not None and not old.hung_up():
                if comm is not None:
                    return Known(S.LLM_SUCCESS if old.is_client and old.comm == comm else S.LLM_ALREADY_LINK), None
                # (the peer's link to this cluster, made or being made, serves both)
                return Known(S.LLM_ALREADY_LINK if old.is_client else S.LLM_SUCCESS if old.ready else None), None
            if look:
                return None, None
            if old is not None:
                self._forget(old, "its connections were closed")
            self._linking.add(cluster_id)
            self._unlinked_by_peer.discard(cluster_id)
        return None, old

    def _release(self, cluster_id: int) -> None:
        with self._lock:
            self._linking.discard(cluster_id)

    def _install(self, peer: Link) -> None:
        """A link this side made joins the table (``LLM_LINK_FAILED`` once finalized)."""
        with self._lock:
            if self._closed:
                raise fail(S.LLM_LINK_FAILED, "finalized while linking")
            self._peers[peer.cluster_id] = peer
            self._lost.pop(peer.cluster_id, None)

    def _peer_linked_here(self, cluster_id: int) -> bool:
        """Whether the peer's own link to this cluster is in the table, ready."""
        with self._lock:
            peer = self._peers.get(cluster_id)
            return peer is not None and peer.ready and not peer.is_client

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
                self.counters.count("links_lost")
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
                self.plane_choice.refresh_table(peer, dl.left_ms(deadline))

    def release_key(self, remote_cluster_id: int, owner_key: tuple, tensors: List[int], timeout_ms: int) -> bool:
        """Tell the owner which tensors of a keyed row were pulled; True if it released the key."""
        peer = self.peer(remote_cluster_id)
        _, reply = peer.outgoing.control(wire.OP_KEY_DONE, wire.OP_KEY_DONE_REPLY,
                                         {"key": list(owner_key), "tensors": tensors}, timeout_ms, "key release",
                                         limit=budgets.max_message_bytes())
        return bool(reply.get("released"))

    # -- two-sided links (``two_sided.TwoSidedLinks``, where they are documented) ------------------
    @property
    def comms(self) -> Dict[int, Comm]:
        """The two-sided links made, by comm id."""
        return self.two_sided.comms

    def new_comm(self, name: str, key: Tuple[str, str], members, me) -> Comm:
        return self.two_sided.new_comm(name, key, members, me)

    def join_comm(self, comm: Comm, timeout_ms: int) -> None:
        self.two_sided.join(comm, timeout_ms)

    def comm(self, comm_id: int) -> Comm:
        return self.two_sided.comm(comm_id)

    def leave_comm(self, comm_id: int, timeout_ms: int) -> None:
        self.two_sided.leave(comm_id, timeout_ms)

    def _current(self, cluster_id: int) -> Optional[Link]:
        """The link to ``cluster_id`` in the table, or None."""
        with self._lock:
            return self._peers.get(cluster_id)

    def _settle_link(self, cluster_id: int, deadline: float) -> None:
        """Fetch the table of a linked peer and choose this side's plane on its link."""
        self.plane_choice.settle(self.peer(cluster_id), deadline)

    def _forget_ended(self, cluster_id: int) -> None:
        """Forget why the link to ``cluster_id`` ended, if it did (``lost_links``)."""
        with self._lock:
            self._unlinked_by_peer.discard(cluster_id)
            self._lost.pop(cluster_id, None)

    # -- the application's hooks (``hooks.Hooks``, where they are documented) ---------------------
    def set_notify_handler(self, handler: Optional[NotifyHandler]) -> None:
        self.hooks.set_notify_handler(handler)

    def set_read_guard(self, guard: Optional[Callable[[int, bytes], Any]]) -> None:
        self.hooks.set_read_guard(guard)

    def set_write_guard(self, guard: Optional[Callable[[int], Any]]) -> None:
        self.hooks.set_write_guard(guard)

    def quiesce_writes(self, peer_cluster_id: int, timeout_s: float) -> bool:
        return self.hooks.quiesce_writes(peer_cluster_id, timeout_s)

    def notify(self, remote_cluster_id: int, message: Dict[str, Any], timeout_ms: int) -> Dict[str, Any]:
        """Send a JSON object to a linked peer over the link and return its handler's reply
        (``Hooks.notify``); ``LLMException`` with the peer's status if it refused or failed."""
        return self.hooks.notify(self.peer(remote_cluster_id), message, timeout_ms)

    def _on_unlink(self, fd: int, req_id: int, length: int, peer: Link) -> bool:
        """The server's handler of ``OP_UNLINK``: the peer ends the link."""
        peer_id = peer.cluster_id
        message, goes_on = server.read_control(fd, req_id, length, wire.OP_UNLINK_DONE, "unlink", self.counters.count,
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

    # -- the table's side of accepted links (``accept``) ------------------------------------------
    def _serve_accepted(self, conn: socket.socket, name: str) -> None:
        """The listener's accept callback (``Acceptor.serve``)."""
        self.acceptor.serve(conn, name)

    def _take_accepted(self, peer: Link, rank: Optional[int]) -> Optional[Refusal]:
        """Take an accepted link request into the table, where ``peer`` waits for its data
        connections; or why not. A link to this cluster's own listener (its proof checked) is kept
        apart; one for a two-sided link being made claims its rank at the same moment."""
        peer_id, mine = peer.cluster_id, self.engine.cluster_id
        if peer_id == mine and peer.comm is None:  # a link to our own listener: its server side is kept apart
            with self._lock:
                if len(self._self_peers) >= MAX_CONNECTIONS:
                    return Refusal(S.LLM_LINK_FAILED, "too many links to itself")
                self._self_peers.append(peer)
                self._pending[peer.token] = peer
            return None
        with self._lock:
            join = None if peer.comm is None else self.two_sided.joining(peer.comm)
            if peer.comm is not None and join is None:
                return Refusal(S.LLM_NOT_YET_LINK, "this cluster is not making that link now", logged=False)
            why = None if join is None else self.two_sided.admit_member(join, peer_id, rank)
            if why is not None:
                return Refusal(S.LLM_LINK_FAILED, why)
            old = self._peers.get(peer_id)
            if old is None and peer_id in self._linking and peer_id > mine:
                # Both sides link to each other at once: the link of the lower cluster id is kept.
                return _MUTUAL
            if old is not None and old.ready and old.is_client and not old.hung_up():
                return _MUTUAL
            if old is not None and (not old.ready or not old.hung_up()):
                # A live link is never replaced; one whose connections are gone is (force_link).
                return Refusal(S.LLM_ALREADY_LINK, f"cluster {peer_id} is already linked")
            refusal = over_link_caps(list(self._peers.values()), peer, old, self.settings, self.counters.count)
            if refusal is not None:
                return refusal
            if old is not None:
                self._forget(old, "replaced by a new link: its connections were closed")
            if join is not None:
                join.claimed[peer_id] = peer
            self._peers[peer_id] = peer
            self._pending[peer.token] = peer
        if old is not None:
            old.close()
        return None

    def _attach(self, token: Any, peer_id: int, join: Callable[[Link], Any]) -> Any:
        """Under the table's lock: ``join(link)`` for the link of ``peer_id`` waiting for its data
        connections under ``token``, or None without one; a link ``join`` made ready waits no
        more."""
        with self._lock:
            peer = self._pending.get(token) if isinstance(token, str) else None
            if peer is None or peer.cluster_id != peer_id or not self._holds(peer):
                return None
            outcome = join(peer)
            if peer.ready:
                del self._pending[token]
            return outcome

    def _arrived(self, peer: Link) -> bool:
        """Whether every data connection of an accepted link arrived; the link is dropped if not."""
        with self._lock:
            complete = peer.ready
        if not complete:
            self._lose(peer, "its connections did not arrive", quiet=True)
        return complete

    def _holds(self, peer: Link) -> bool:
        return self._peers.get(peer.cluster_id) is peer or any(p is peer for p in self._self_peers)

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
        self.relays.join()
        for plane in self.planes.all:
            plane.shutdown()


def _parallel(fn: Callable[[Any], LLMStatusCode], items: List[Any]) -> List[LLMStatusCode]:
    if len(items) <= 1:
        return [fn(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=min(16, len(items)), thread_name_prefix="llm_datadist-link") as pool:
        return list(pool.map(fn, items))


