"""The linking side of a link (``Connector``): ``link`` to a cluster at an address (or
``link_address``, to whichever cluster listens there), as ``link_clusters`` and two-sided links
make them.

It runs the handshake on a link connection (``handshake.request_link``), opens the link's data
connections (``handshake.open_connections``; on a protected link each TCP one sealed by a relay,
``relays``), chooses the link's plane (``planes.choice``) and hands the link made to the link
table. Whether a cluster may be linked now is the table's: it says whether the cluster is linked
already or being linked (``reserve``), and a link the peer is making to this cluster
at the same moment is waited for rather than made twice (the link made by the lower cluster id
is kept).
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Callable, List, Optional, Tuple

from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.transport import budgets, handshake
from llm_datadist.transport import deadline as dl
from llm_datadist.transport.engine_view import EngineView
from llm_datadist.transport.errors import S, MutualLink, fail
from llm_datadist.transport.planes.choice import PlaneChoice
from llm_datadist.transport.relays import Relays
from llm_datadist.transport.server import Server
from llm_datadist.transport.session import Channel, Link
from llm_datadist.transport.settings import LinkSettings
from llm_datadist.transport.stats import CountCallback
from llm_datadist.transport.sockets import close_socket, source_of

logger = logging.getLogger("llm_datadist")


class Known(Exception):
    """The link table found the cluster linked already, or being linked: the status to answer
    (None: the peer's own link to this cluster is being made, to be waited for)."""

    def __init__(self, status: Optional[LLMStatusCode]) -> None:
        super().__init__(status)
        self.status = status


class Connector:
    """The linking side of one engine's links. It is handed the parts a link meets as it is made
    (``plane_choice``, ``relays``, ``server``), ``count`` for the link statistics, and the link
    table's ``reserve(cluster_id, comm=None, look=False)`` (``(Known, None)`` if the cluster is
    linked or being linked, else ``(None, old link or None)``: the cluster is reserved for this
    side's link -- unless ``look`` -- and its old link, whose connections are gone, forgotten for
    the caller to close), ``release(cluster_id)`` (the reservation ends), ``install(link)`` (the
    link made joins the table; ``LLM_LINK_FAILED`` once the engine is finalized) and
    ``arrived(cluster_id)`` (whether the peer's own link to this cluster is in the table, ready)."""

    def __init__(self, engine: EngineView, settings: LinkSettings, plane_choice: PlaneChoice, relays: Relays,
                 server: Server, count: CountCallback, reserve: Callable[..., Tuple[Optional[Known], Optional[Link]]],
                 release: Callable[[int], None], install: Callable[[Link], None],
                 arrived: Callable[[int], bool]) -> None:
        self.engine = engine
        self._settings = settings
        self._plane_choice = plane_choice
        self._relays = relays
        self._server = server
        self._count = count
        self._reserve = reserve
        self._release = release
        self._install = install
        self._arrived = arrived

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
        known, _ = self._reserve(remote_cluster_id, comm, look=True)
        if known is not None:
            if known.status is not None:
                return known.status
            # the peer's link to this cluster is being made right now: it will serve both
            return self._await_mutual(remote_cluster_id, deadline)
        known, old = self._reserve(remote_cluster_id)
        if known is not None:
            return S.LLM_ALREADY_LINK
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
            self._release(remote_cluster_id)
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
            known, old = self._reserve(peer_id)
            if known is not None:
                raise known
            reserved.append(peer_id)
            if old is not None:
                old.close()

        sockets: List[socket.socket] = []
        try:
            first = handshake.connect_tcp(ip, port, deadline)
            sockets.append(first)
            agreement = handshake.request_link(first, mine, self._settings.secret, None, self.engine.role,
                                               self._plane_choice.offered(), self._settings.remote_accessible,
                                               self._plane_choice.wants_local_sockets(), deadline, on_peer=reserve,
                                               protect=self._settings.protection)
            status = self._finish(agreement.cluster_id, ip, port, deadline, sockets, first, agreement)
        except Known as known:
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
            for peer_id in reserved:
                self._release(peer_id)
        for sock in sockets:
            close_socket(sock)
        return status, (found[0] if found else None)

    def _await_mutual(self, remote_cluster_id: int, deadline: float) -> LLMStatusCode:
        """The peer is linking to this cluster at the same time and its link is the one kept:
        wait for it to arrive."""
        while not dl.expired(deadline):
            if self._arrived(remote_cluster_id):
                return S.LLM_SUCCESS
            time.sleep(0.005)
        logger.error("link %d -> %d: the peer's own link to this cluster did not arrive in time",
                     self.engine.cluster_id, remote_cluster_id)
        return S.LLM_LINK_FAILED

    def _link(self, remote_cluster_id: int, ip: str, port: int, deadline: float,
              sockets: List[socket.socket], comm: Optional[Tuple[str, str]] = None,
              rank: Optional[int] = None) -> LLMStatusCode:
        """The steps of ``link``; every socket it opens goes to ``sockets`` (closed by the caller
        unless the link is made, in which case ``sockets`` is emptied)."""
        mine = self.engine.cluster_id
        settings = self._settings
        first = handshake.connect_tcp(ip, port, deadline)
        sockets.append(first)
        agreement = handshake.request_link(first, mine, settings.secret, remote_cluster_id, self.engine.role,
                                           self._plane_choice.offered(), settings.remote_accessible,
                                           self._plane_choice.wants_local_sockets(), deadline, comm,
                                           settings.self_key if remote_cluster_id == mine else None, rank,
                                           protect=settings.protection)
        return self._finish(remote_cluster_id, ip, port, deadline, sockets, first, agreement, comm)

    def _finish(self, remote_cluster_id: int, ip: str, port: int, deadline: float,
                sockets: List[socket.socket], first: socket.socket, agreement: handshake.LinkAgreement,
                comm: Optional[Tuple[str, str]] = None) -> LLMStatusCode:
        """The rest of ``_link`` once the link request on ``first`` was granted."""
        mine = self.engine.cluster_id
        name = f"cluster {remote_cluster_id} ({ip}:{port})"

        def seal(sock: socket.socket, nonces: Tuple[str, str]) -> socket.socket:
            relay = self._relays.make(sock, agreement.suite, nonces, mine, remote_cluster_id, True, name,
                                      agreement.digest)
            relay.start()
            return relay.inner

        made = handshake.open_connections(ip, port, mine, self._settings.secret, remote_cluster_id, agreement,
                                          deadline, sockets, seal)
        # (its shares of the budgets: under the address it was made to, or the uid it runs as)
        shares = budgets.LinkShares(("uid", made.uid) if made.unix else source_of(first))
        peer = Link(remote_cluster_id, agreement.role, True, (ip, port), agreement.planes, comm=comm,
                    authenticated=self._settings.secret is not None, protection=agreement.protection,
                    protection_suite=agreement.suite, stated=agreement.process, shares=shares)
        peer.unix, peer.pid, peer.uid = made.unix, made.pid, made.uid
        peer.channels = [Channel(sock, name, shares) for sock in made.forward]
        peer.incoming = made.reverse
        peer.ready = True
        sockets.remove(first)
        close_socket(first)  # the server now holds the link as made
        self._plane_choice.settle(peer, deadline)
        self._install(peer)
        sockets.clear()  # they belong to the link now
        for sock in made.reverse:
            self._server.serve_in_thread(sock, f"{ip}:{port}", peer)
        logger.info("cluster %d linked to %d at %s:%d (data plane %s)", self.engine.cluster_id,
                    remote_cluster_id, ip, port, peer.plane_name)
        return S.LLM_SUCCESS
