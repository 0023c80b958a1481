"""The accepting side of a link (``Acceptor``): the handshake of each connection the listener
accepted, and what is done with what it asks for -- a link request, or a data connection of a
link being made.

Nothing here holds links: whether a link request is taken is the link table's decision (``take``,
with the caps, the mutual links and the two-sided link being made), and a data connection joins
its pending link under the table's lock (``attach``). What this part decides is all about the
connection and the request: the protection both sides run, whether a link of two processes of
one host must come over Unix sockets (and from the process that asked), and the link reply.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, TypeVar

from llm_datadist import _io
from llm_datadist.status import LLMException
from llm_datadist.transport import auth, budgets, handshake, protection
from llm_datadist.transport import deadline as dl
from llm_datadist.transport import planes as plane_registry
from llm_datadist.transport.engine_view import EngineView
from llm_datadist.transport.errors import S, ProtocolError, brief
from llm_datadist.transport.listener import Listener
from llm_datadist.transport.planes.choice import PlaneChoice
from llm_datadist.transport.relays import Relays
from llm_datadist.transport.server import Server
from llm_datadist.transport.session import Channel, Link, peer_credentials
from llm_datadist.transport.settings import MAX_LINKS_ENV, MAX_LINKS_PER_SOURCE_ENV, LinkSettings
from llm_datadist.transport.stats import CountCallback
from llm_datadist.transport.sockets import close_socket, describe, source_of

logger = logging.getLogger("llm_datadist")

T = TypeVar("T")


class Refusal(NamedTuple):
    """Why the link table did not take a link request: the status, the error the reply carries,
    whether it is logged as a refusal, and whether it is a mutual link (the peer is linking here
    at the same moment: one link serves both)."""

    status: int
    why: str
    logged: bool = True
    mutual: bool = False


def over_link_caps(links: List[Link], peer: Link, old: Optional[Link], settings: LinkSettings,
                   count: CountCallback) -> Optional[Refusal]:
    """Whether taking ``peer`` into a link table holding ``links`` (``old``, the link it would
    replace, among them) goes over the link caps: in all, or of ``peer``'s source
    (``refused_links``, ``refused_source_links``, counted here)."""
    source = peer.source
    if len(links) - (old is not None) >= settings.max_links:
        count("refused_links")
        return Refusal(S.LLM_LINK_FAILED, f"this cluster holds {settings.max_links} links ({MAX_LINKS_ENV})")
    if source is not None and sum(p.source == source and p is not old for p in links) >= settings.max_links_per_source:
        count("refused_source_links")
        return Refusal(S.LLM_LINK_FAILED, f"this cluster holds {settings.max_links_per_source} links from "
                                          f"{describe(source)} ({MAX_LINKS_PER_SOURCE_ENV})")
    return None


#: ``take(link, rank)``: the link table takes an accepted link request (``link`` then waits in the
#: table for its data connections) or says why not.
TakeLink = Callable[[Link, Optional[int]], Optional[Refusal]]
#: ``attach(token, peer_id, join)``: under the table's lock, ``join(link)`` for the link of
#: ``peer_id`` pending under ``token`` (None without one); a link ``join`` made ready waits no more.
AttachConnection = Callable[[Any, int, Callable[[Link], T]], Optional[T]]


class Acceptor:
    """The accepting side of one engine's links; ``serve`` is the listener's accept callback.

    It is handed the parts a connection meets (``listener``, ``server``, ``plane_choice``,
    ``relays``), ``count`` for the link statistics, and the link table's ``take``, ``attach``,
    ``arrived(link)`` (whether every connection of a link just made came; the table drops it if
    not) and ``lose(link, why, quiet)``."""

    def __init__(self, engine: EngineView, settings: LinkSettings, listener: Listener, server: Server,
                 plane_choice: PlaneChoice, relays: Relays, count: CountCallback, take: TakeLink,
                 attach: AttachConnection, arrived: Callable[[Link], bool],
                 lose: Callable[..., None]) -> None:
        self.engine = engine
        self._settings = settings
        self._listener = listener
        self._server = server
        self._plane_choice = plane_choice
        self._relays = relays
        self._count = count
        self._take = take
        self._attach = attach
        self._arrived = arrived
        self._lose = lose

    def serve(self, conn: socket.socket, name: str) -> None:
        """The handshake of an accepted connection, then serve it (or hand it to a Channel). The
        socket is closed on every other way out."""
        handed_over = False
        try:
            handed_over = self._handshake(conn, name)
        except ProtocolError as exc:
            logger.warning("closing connection from %s: %s", name, exc)
            self.engine.count_protocol_error()
        except LLMException as exc:  # closed, silent or too slow
            self._count("handshake_failures")
            logger.info("closing connection from %s: %s", name, exc)
        finally:
            self._listener.handshake_done(conn)
            if not handed_over:
                close_socket(conn)

    def _handshake(self, conn: socket.socket, name: str) -> bool:
        """hello -> challenge -> auth -> reply; then what the connection is for. True if the
        socket now belongs to a link."""
        fd = conn.fileno()
        deadline = dl.after(self._settings.handshake_ms)
        mine = self.engine.cluster_id
        def auth_failed(peer_id: int, why: str) -> None:  # counted before the peer is told
            self._count("auth_failures")
            logger.warning("cluster %d refused a connection from %s claiming cluster %d: %s", mine, name,
                           peer_id, why)

        admission = handshake.accept_hello(conn, mine, self._settings.secret, deadline, auth_failed)
        peer_id = admission.peer_id
        if admission.refused is not None or not self._listener.authenticated(conn):
            return False  # (not authenticated: it gave its slot up, or every authenticated slot is taken)
        purpose = admission.purpose
        if purpose == "link":
            proven_self = peer_id == mine and auth.verify_self(self._settings.self_key, *admission.nonces,
                                                               admission.request.get("self_proof"))
            status, reply, peer = self._accept_link(peer_id, handshake.read_link_request(admission.request), name,
                                                    source_of(conn), proven_self, self._listener.on_rank_port(conn))
            reply = handshake.signed_reply(self._settings.secret, admission, reply)
            if peer is not None:  # (set before the reply goes: the data connections come after it)
                peer.link_digest = protection.link_digest(admission.request, reply)
            sent = handshake.send_reply(conn, reply, status, deadline)
            if status != 0:
                return False
            self._listener.handshake_done(conn)
            # The client opens the link's data connections, then closes this one: wait for that
            # (or the deadline); a link whose connections did not all arrive is dropped.
            if sent:
                _io.recv_discard(fd, 1, max(1, dl.left_ms(deadline)))
            if not self._arrived(peer):
                return False
            try:  # choose this side's plane now rather than on the first transfer
                self._plane_choice.settle(peer, dl.after(self._settings.handshake_ms))
            except LLMException as exc:
                self._lose(peer, f"no data plane: {exc}")
            return False
        if purpose in ("forward", "reverse"):
            status, reply, peer, relay = self._accept_data(peer_id, purpose, admission.request.get("token"), conn,
                                                           admission.nonces)
            reply = handshake.signed_reply(self._settings.secret, admission, reply)
            if not handshake.send_reply(conn, reply, status, deadline) or status != 0:
                if peer is not None:
                    self._lose(peer, f"its {purpose} connection failed", quiet=True)
                if relay is not None:
                    relay.close()
                return False
            self._listener.handshake_done(conn)
            if relay is not None:  # what the link sends from now on is sealed
                relay.start()
            if purpose == "forward":
                self._server.serve(conn if relay is None else relay.inner, name, peer)
            return True  # serve closed it, or a Channel holds it (and a relay the TCP socket)
        raise ProtocolError(f"unknown purpose {brief(purpose)}")

    def _accept_link(self, peer_id: int, request: handshake.LinkRequest, name: str, source: Any = None,
                     proven_self: bool = False, rank_port: bool = False):
        """Decide on an authenticated link request from ``source`` (``sockets.source_of``;
        ``proven_self``: it carries this process's self-link proof; ``rank_port``: it came through
        a two-sided link's listener, where only members of a comm being made may link, see
        ``comms``): ``(status, reply, pending Link or None)``."""
        mine = self.engine.cluster_id
        settings = self._settings
        reply: Dict[str, Any] = {"cluster_id": mine}

        def refuse(status: int, why: str):
            logger.warning("cluster %d refused a link from %s (cluster %d): %s", mine, name, peer_id, why)
            return status, dict(reply, error=why), None

        comm = request.comm
        if comm is None and rank_port:
            return refuse(S.LLM_LINK_FAILED, "a link on a rank-table port must name its comm, the digest of its rank "
                                             "table and rank map, and its rank")
        if comm is None and request.remote_accessible != settings.remote_accessible:
            return refuse(S.LLM_PARAM_INVALID, "enable_remote_cache_accessible differs between the two clusters")
        protected = protection.stronger(request.protection, settings.protection)
        if protected != protection.OFF and settings.secret is None:
            return refuse(S.LLM_LINK_FAILED, f"protection {protected} needs a link secret on both sides")
        suite = None if protected == protection.OFF else protection.choose(protected, request.suites)
        if protected != protection.OFF and suite is None:
            return refuse(S.LLM_LINK_FAILED, f"protection {protected}: no record suite both sides run (cluster "
                                             f"{mine} runs {', '.join(protection.suites_here())}, "
                                             f"the linking side offered {', '.join(request.suites) or 'none'}; "
                                             f"{protection.CRYPTOGRAPHY_MISSING})")
        expect_unix = self._listener.unix_name is not None and request.same_host and any(
            name in plane_registry.names() and plane_registry.get(name).local_sockets for name in request.planes)
        if expect_unix:
            # Its connections will be Unix sockets from the uid it states (``_accept_data`` holds
            # them to it): that uid, not the loopback address every local process shares, is its
            # source for the link caps and the budgets' shares from the start.
            source = ("uid", request.uid)
        peer = Link(peer_id, request.role, False, (name, 0), request.planes, token=os.urandom(16).hex(),
                    want=request.want, comm=comm, source=source, shares=budgets.LinkShares(source),
                    authenticated=settings.secret is not None, protection=protected, protection_suite=suite,
                    stated=(request.pid, request.uid), expect_unix=expect_unix)
        if peer_id == mine and comm is None and not proven_self:
            # Only this very process may link to its own listener under its own id.
            refused = self._count("refused_self")
            if refused in (1, 10, 100) or refused % 1000 == 0:  # rate-limited
                logger.warning("cluster %d refused %d link request(s) claiming its own cluster id without "
                               "proof that they come from this process (the last from %s)", mine, refused, name)
            return S.LLM_LINK_FAILED, dict(reply, error="a self-link of another process"), None
        refusal = self._take(peer, request.rank)
        if refusal is None:
            return S.LLM_SUCCESS, self._link_reply(peer), peer
        if refusal.logged:
            return refuse(refusal.status, refusal.why)
        answer = dict(reply, error=refusal.why)
        if refusal.mutual:
            answer["mutual"] = True
        return refusal.status, answer, None

    def _link_reply(self, peer: Link) -> Dict[str, Any]:
        return handshake.link_reply(self.engine.cluster_id, self.engine.role, self._plane_choice.offered(),
                                    self._settings.remote_accessible, peer.token, self._listener.unix_name,
                                    peer.protection, peer.protection_suite)

    def _accept_data(self, peer_id: int, purpose: str, token: Any, conn: socket.socket, nonces: Tuple[str, str]):
        """A data connection of a link being made: ``(status, reply, Link or None, Relay or None)``;
        on a protected link a TCP connection gets a ``protection.Relay`` (not started), whose
        inner socket the link holds in its place."""
        refused = S.LLM_LINK_FAILED, {"error": "no pending link for this connection"}, None, None
        unix = conn.family == socket.AF_UNIX
        pid, uid = peer_credentials(conn) if unix else (0, -1)
        mine = self.engine.cluster_id

        def join(peer: Link):  # (under the table's lock)
            if unix and peer_id == mine and pid != os.getpid():
                return refused  # a self-link's connections come from this process (the kernel says so)
            if not unix and peer.expect_unix:
                # The two processes share this host and a plane of the linking side wants Unix
                # sockets, so its connections come over this side's Unix socket, never TCP: a TCP
                # data connection here comes through something else (a relay) or a side that was
                # made to fall back (its Unix connect refused under a flood): refused.
                logger.warning("cluster %d refused a TCP connection of cluster %d's link: the link is between two "
                               "processes of this host, whose connections are Unix sockets", mine, peer_id)
                refusal = {"error": "a TCP connection for a link of two processes of one host"}
                return S.LLM_LINK_FAILED, refusal, peer, None
            if unix and (pid, uid) != peer.stated:
                # Not the process that asked for the link (a relay between it and this socket).
                logger.warning("cluster %d refused a Unix connection of cluster %d's link from pid %d (uid %d): the "
                               "link was asked for by pid %d (uid %d)", mine, peer_id, pid, uid, *peer.stated)
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
                    relay = self._relays.make(conn, peer.protection_suite, nonces, peer_id, mine, False,
                                              f"cluster {peer_id} ({peer.address[0]})", peer.link_digest)
                except OSError as exc:  # no socket pair (out of descriptors)
                    return S.LLM_LINK_FAILED, {"error": f"no relay for a protected connection: {exc}"}, peer, None
            sock = conn if relay is None else relay.inner
            if purpose == "forward":
                peer.incoming.append(sock)
            else:
                peer.channels.append(Channel(sock, f"cluster {peer_id} ({peer.address[0]})", peer.shares))
            if len(peer.incoming) == peer.want[0] and len(peer.channels) == peer.want[1]:
                peer.ready = True  # (the table lets it wait no more)
                logger.info("cluster %d: cluster %d linked from %s%s", mine, peer_id,
                            "this host" if unix else peer.address[0],
                            "" if peer.protection == protection.OFF else
                            f" (protection {peer.protection}, {peer.protection_suite})")
            return S.LLM_SUCCESS, {"cluster_id": mine}, peer, relay

        outcome = self._attach(token, peer_id, join)
        return refused if outcome is None else outcome
