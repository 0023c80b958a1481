"""Both sides of the link handshake, and the making of a link's connections.

Every connection starts ``HELLO -> CHALLENGE -> AUTH -> HELLO_REPLY``: both sides prove knowledge
of the link secret when one is set (``auth``), and the ``AUTH`` message says what the connection
is for. A *link* connection (to the server's TCP listener) carries the link request: the server
answers with a one-time token and the abstract name of its Unix socket. The client then opens
the link's *forward* connections (its requests, served by server threads) and *reverse* ones
(the server's requests, served by client threads), each authenticated the same way and bound to
the link by the token. On this host (same kernel, PID and network namespace) they are Unix
sockets when a plane wants them (``DataPlane.local_sockets``), so that the kernel tells each side
the other's pid and uid (``SO_PEERCRED``); otherwise TCP.

Nothing about this process is sent before the peer has authenticated. ``Handshakes`` is a part
of ``links.LinkManager``.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Dict, List, Optional, Tuple

from llm_datadist import _io
from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.transport import auth, wire
from llm_datadist.transport import planes as plane_registry
from llm_datadist.transport import deadline as dl
from llm_datadist.transport.errors import S, MutualLink, ProtocolError, brief, fail, is_int, status_of
from llm_datadist.transport.host import host_identity, same_host
from llm_datadist.transport.listener import MAX_LINKS_ENV, close_socket, tune
from llm_datadist.transport.session import (CONNECTIONS_PER_DIRECTION, MAX_CONNECTIONS, Channel, Peer, peer_credentials,
                                            read_body, read_header)

logger = logging.getLogger("llm_datadist")

#: Largest handshake message (hello, challenge, authentication, reply).
MAX_HANDSHAKE_BYTES = 64 << 10


class Handshakes:
    """The handshake of accepted connections and of the client's connections, as part of
    ``LinkManager``."""

    # -- frames of the handshake ------------------------------------------------------------------
    @staticmethod
    def _send(fd: int, op: int, message: Dict[str, Any], deadline: float, status: int = 0) -> bool:
        payload = wire.encode_json(message)
        st, _ = _io.send_bytes(fd, wire.pack_header(op, 1, len(payload), status) + payload,
                                   max(1, dl.left_ms(deadline)))
        return st == 0

    @staticmethod
    def _receive(fd: int, expect: int, deadline: float, what: str) -> Tuple[int, Dict[str, Any]]:
        """``(status, JSON object)`` of the next frame, which must be ``expect``. ProtocolError for
        a malformed frame; LLMException for a closed, silent or slow connection."""
        header = bytearray(wire.HEADER_BYTES)
        st = read_header(fd, header, max(1, dl.left_ms(deadline)))
        if st != 0:
            raise fail(S.LLM_LINK_FAILED, f"no {what} ({status_of(st).name})")
        op, status, _, length = wire.unpack_header(header)
        if op != expect or length > MAX_HANDSHAKE_BYTES:
            raise ProtocolError(f"{wire.OP_NAMES[op]} of {length} bytes instead of a {what}")
        st, body = read_body(fd, length, max(1, dl.left_ms(deadline)))
        if st != 0:
            raise fail(S.LLM_LINK_FAILED, f"{what} truncated ({status_of(st).name})")
        return status, wire.decode_json(body)

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
        except LLMException as exc:  # closed, silent or too slow
            with self._lock:
                self.stats["handshake_failures"] += 1
            logger.info("closing connection from %s: %s", name, exc)
        finally:
            self._handshake_done(conn)
            if not handed_over:
                close_socket(conn)

    def _handshake_accepted(self, conn: socket.socket, name: str) -> bool:
        """hello -> challenge -> auth -> reply; then what the connection is for. True if the
        socket now belongs to a link."""
        fd = conn.fileno()
        deadline = dl.after(self.handshake_ms)
        _, hello = self._receive(fd, wire.OP_HELLO, deadline, "hello")
        peer_id, client_nonce = hello.get("cluster_id"), hello.get("nonce")
        if not is_int(peer_id) or not auth.is_nonce(client_nonce) or not isinstance(hello.get("auth"), bool):
            raise ProtocolError(f"malformed hello {brief(hello)}")
        mine = self.engine.cluster_id
        server_nonce = auth.new_nonce()
        challenge: Dict[str, Any] = {"cluster_id": mine, "nonce": server_nonce, "auth": self.secret is not None}
        if hello["auth"] != (self.secret is not None):
            with self._lock:
                self.stats["auth_failures"] += 1
            why = "this cluster requires a link secret" if self.secret else "this cluster has no link secret"
            logger.warning("cluster %d refused a link from %s: %s", mine, name, why)
            self._send(fd, wire.OP_CHALLENGE, dict(challenge, error=why), deadline, S.LLM_LINK_FAILED)
            return False
        if self.secret is not None:
            challenge["proof"] = auth.proof(self.secret, "server", client_nonce, server_nonce, peer_id, mine)
        if not self._send(fd, wire.OP_CHALLENGE, challenge, deadline):
            return False
        _, message = self._receive(fd, wire.OP_AUTH, deadline, "authentication")
        if self.secret is not None and not auth.verify(self.secret, "client", client_nonce, server_nonce, peer_id,
                                                       mine, message.get("proof")):
            with self._lock:
                self.stats["auth_failures"] += 1
            logger.warning("cluster %d refused a connection from %s claiming cluster %d: wrong link secret",
                           mine, name, peer_id)
            self._send(fd, wire.OP_HELLO_REPLY, {"error": "authentication failed"}, deadline, S.LLM_LINK_FAILED)
            return False
        purpose = message.get("purpose")
        if purpose == "link":
            status, reply, peer = self._accept_link(peer_id, message, name)
            sent = self._send(fd, wire.OP_HELLO_REPLY, reply, deadline, status)
            if status != 0:
                return False
            self._handshake_done(conn)
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
                self._settle(peer, dl.after(self.handshake_ms))
            except LLMException as exc:
                self._lose(peer, f"no data plane: {exc}")
            return False
        if purpose in ("forward", "reverse"):
            status, reply, peer = self._accept_data(peer_id, purpose, message, conn)
            if not self._send(fd, wire.OP_HELLO_REPLY, reply, deadline, status) or status != 0:
                if peer is not None:
                    self._lose(peer, f"its {purpose} connection failed", quiet=True)
                return False
            self._handshake_done(conn)
            if purpose == "forward":
                self._serve(conn, name, peer)
            return True  # _serve closed it, or a Channel holds it
        raise ProtocolError(f"unknown purpose {brief(purpose)}")

    def _accept_link(self, peer_id: int, message: Dict[str, Any], name: str):
        """Decide on an authenticated link request: ``(status, reply, pending Peer or None)``."""
        reply: Dict[str, Any] = {"cluster_id": self.engine.cluster_id}

        def refuse(status: int, why: str):
            logger.warning("cluster %d refused a link from %s (cluster %d): %s", self.engine.cluster_id, name,
                           peer_id, why)
            return status, dict(reply, error=why), None

        want = message.get("connections")
        planes = message.get("planes")
        if not (isinstance(want, list) and len(want) == 2 and all(is_int(n, 1, MAX_CONNECTIONS) for n in want)):
            raise ProtocolError(f"link request: connections {brief(want)}")
        if not (isinstance(planes, list) and all(isinstance(p, str) for p in planes)):
            raise ProtocolError(f"link request: planes {brief(planes)}")
        if not isinstance(message.get("role"), str) or not isinstance(message.get("host"), dict):
            raise ProtocolError("link request: role or host malformed")
        comm = message.get("comm")
        if comm is not None:
            if not (isinstance(comm, list) and len(comm) == 2 and all(isinstance(x, str) for x in comm)):
                raise ProtocolError(f"link request: comm {brief(comm)}")
            comm = (comm[0], comm[1])
        elif bool(message.get("remote_cache_accessible")) != self.remote_accessible:
            return refuse(S.LLM_PARAM_INVALID, "enable_remote_cache_accessible differs between the two clusters")
        mine = self.engine.cluster_id
        peer = Peer(peer_id, message["role"][:64], False, (name, 0), list(planes)[:8], token=os.urandom(16).hex(),
                    want=(want[0], want[1]), comm=comm)
        if peer_id == mine:  # a link to our own listener: its server side is kept apart from the client side
            with self._lock:
                if len(self._self_peers) >= MAX_CONNECTIONS:
                    return refuse(S.LLM_LINK_FAILED, "too many links to itself")
                self._self_peers.append(peer)
                self._pending[peer.token] = peer
            return S.LLM_SUCCESS, self._link_reply(reply, peer), peer
        with self._lock:
            if comm is not None and peer_id not in self._joining.get(comm, ()):
                return S.LLM_NOT_YET_LINK, dict(reply, error="this cluster is not making that link now"), None
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
            if len(self._peers) - (old is not None) >= self.max_links:
                return refuse(S.LLM_LINK_FAILED, f"this cluster holds {self.max_links} links ({MAX_LINKS_ENV})")
            if old is not None:
                self._forget(old, "replaced by a new link: its connections were closed")
            self._peers[peer_id] = peer
            self._pending[peer.token] = peer
        if old is not None:
            old.close()
        return S.LLM_SUCCESS, self._link_reply(reply, peer), peer

    def _link_reply(self, reply: Dict[str, Any], peer: Peer) -> Dict[str, Any]:
        return dict(reply, role=self.engine.role, planes=self._offered_planes(), host=host_identity(),
                    remote_cache_accessible=self.remote_accessible, token=peer.token,
                    unix=self.unix_name or self._comm_unix_name)

    def _accept_data(self, peer_id: int, purpose: str, message: Dict[str, Any], conn: socket.socket):
        """A data connection of a link being made: ``(status, reply, Peer or None)``."""
        refused = S.LLM_LINK_FAILED, {"error": "no pending link for this connection"}, None
        token = message.get("token")
        unix = conn.family == socket.AF_UNIX
        pid, uid = peer_credentials(conn) if unix else (0, -1)
        with self._lock:
            peer = self._pending.get(token) if isinstance(token, str) else None
            if peer is None or peer.cluster_id != peer_id or not self._holds(peer):
                return refused
            first = not peer.channels and not peer.incoming
            if first:
                peer.unix, peer.pid, peer.uid = unix, pid, uid
            elif (peer.unix, peer.pid, peer.uid) != (unix, pid, uid):
                # Every connection of a link comes from one process, over one kind of socket.
                return S.LLM_LINK_FAILED, {"error": "connections of one link from different processes"}, peer
            if purpose == "forward":
                if len(peer.incoming) >= peer.want[0]:
                    return refused
                peer.incoming.append(conn)
            else:
                if len(peer.channels) >= peer.want[1]:
                    return refused
                peer.channels.append(Channel(conn, f"cluster {peer_id} ({peer.address[0]})"))
            if len(peer.incoming) == peer.want[0] and len(peer.channels) == peer.want[1]:
                peer.ready = True
                del self._pending[token]
                logger.info("cluster %d: cluster %d linked from %s", self.engine.cluster_id, peer_id,
                            "this host" if unix else peer.address[0])
        return S.LLM_SUCCESS, {"cluster_id": self.engine.cluster_id}, peer

    def _holds(self, peer: Peer) -> bool:
        return self._peers.get(peer.cluster_id) is peer or any(p is peer for p in self._self_peers)

    def _offered_planes(self) -> List[str]:
        """The planes this side names in its link request or reply."""
        return list(plane_registry.offered(self.plane))

    def _wants_local_sockets(self) -> bool:
        """Whether a plane this side may use wants the link's connections on Unix sockets."""
        return any(plane_registry.get(name).local_sockets for name in plane_registry.offered(self.plane))

    def _link(self, remote_cluster_id: int, ip: str, port: int, deadline: float,
              sockets: List[socket.socket], comm: Optional[Tuple[str, str]] = None) -> LLMStatusCode:
        """The steps of ``link``; every socket it opens goes to ``sockets`` (closed by the caller
        unless the link is made, in which case ``sockets`` is emptied)."""
        first = self._connect_tcp(ip, port, deadline)
        sockets.append(first)
        request = dict(purpose="link", role=self.engine.role, planes=self._offered_planes(), host=host_identity(),
                       remote_cache_accessible=self.remote_accessible,
                       connections=[CONNECTIONS_PER_DIRECTION, CONNECTIONS_PER_DIRECTION], force_link=True)
        if comm is not None:
            request["comm"] = list(comm)
        reply = self._client_handshake(first, remote_cluster_id, request, deadline)
        token, unix_name = reply.get("token"), reply.get("unix")
        planes, role = reply.get("planes"), reply.get("role")
        if not isinstance(token, str) or not isinstance(role, str) or not (
                isinstance(planes, list) and all(isinstance(p, str) for p in planes)):
            raise ProtocolError(f"link reply lacks token, role or planes: {brief(reply)}")
        unix = (isinstance(unix_name, str) and self._wants_local_sockets()
                and same_host(host_identity(), reply.get("host") if isinstance(reply.get("host"), dict) else {}))
        name = f"cluster {remote_cluster_id} ({ip}:{port})"
        peer = Peer(remote_cluster_id, role[:64], True, (ip, port), list(planes)[:8], comm=comm)
        reverse: List[socket.socket] = []
        for purpose in ["forward"] * CONNECTIONS_PER_DIRECTION + ["reverse"] * CONNECTIONS_PER_DIRECTION:
            sock = None
            if unix:
                try:
                    sock = self._connect_unix(unix_name, deadline)
                except OSError as exc:
                    if peer.channels or reverse:
                        raise
                    logger.info("link %d -> %d: its Unix socket is not reachable (%s); using TCP",
                                self.engine.cluster_id, remote_cluster_id, exc)
                    unix = False
            if sock is None:
                sock = self._connect_tcp(ip, port, deadline)
            sockets.append(sock)
            self._client_handshake(sock, remote_cluster_id, {"purpose": purpose, "token": token}, deadline)
            if unix:
                pid, uid = peer_credentials(sock)
                if peer.pid and (pid, uid) != (peer.pid, peer.uid):
                    raise fail(S.LLM_LINK_FAILED, "the link's connections reach different processes")
                peer.unix, peer.pid, peer.uid = True, pid, uid
            if purpose == "forward":
                peer.channels.append(Channel(sock, name))
            else:
                reverse.append(sock)
        peer.incoming = reverse
        peer.ready = True
        sockets.remove(first)
        close_socket(first)  # the server now holds the link as made
        self._settle(peer, deadline)
        with self._lock:
            if self._closed:
                raise fail(S.LLM_LINK_FAILED, "finalized while linking")
            self._peers[remote_cluster_id] = peer
            self._lost.pop(remote_cluster_id, None)
        sockets.clear()  # they belong to the link now
        for sock in reverse:
            self._spawn(self._serve, sock, f"{ip}:{port}", peer)
        logger.info("cluster %d linked to %d at %s:%d (data plane %s)", self.engine.cluster_id,
                    remote_cluster_id, ip, port, peer.plane_name)
        return S.LLM_SUCCESS

    @staticmethod
    def _connect_tcp(ip: str, port: int, deadline: float) -> socket.socket:
        remaining = dl.left_s(deadline)
        if remaining <= 0:
            raise LLMException("link timed out", status_code=S.LLM_LINK_FAILED)
        sock = socket.create_connection((ip, port), timeout=remaining)
        try:
            tune(sock)
            sock.setblocking(False)
        except BaseException:
            close_socket(sock)
            raise
        return sock

    @staticmethod
    def _connect_unix(unix_name: str, deadline: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(0.001, dl.left_s(deadline)))
            sock.connect("\0" + unix_name)
            tune(sock)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    def _client_handshake(self, sock: socket.socket, remote_id: int, request: Dict[str, Any],
                          deadline: float) -> Dict[str, Any]:
        """hello -> challenge -> auth -> reply on a fresh connection; the reply, or LLMException."""
        fd = sock.fileno()
        mine = self.engine.cluster_id
        nonce = auth.new_nonce()
        if not self._send(fd, wire.OP_HELLO, {"cluster_id": mine, "nonce": nonce, "auth": self.secret is not None},
                          deadline):
            raise fail(S.LLM_LINK_FAILED, "the hello could not be sent")
        status, challenge = self._receive(fd, wire.OP_CHALLENGE, deadline, "challenge")
        if status != 0:
            raise fail(status, f"refused: {challenge.get('error', '')}")
        if challenge.get("cluster_id") != remote_id:
            raise fail(S.LLM_LINK_FAILED, f"expected cluster {remote_id}, found cluster "
                                           f"{brief(challenge.get('cluster_id'))}")
        server_nonce, wants_auth = challenge.get("nonce"), challenge.get("auth")
        if not auth.is_nonce(server_nonce) or not isinstance(wants_auth, bool):
            raise ProtocolError(f"malformed challenge {brief(challenge)}")
        if wants_auth != (self.secret is not None):
            raise fail(S.LLM_LINK_FAILED, "the peer requires a link secret" if wants_auth
                        else "the peer has no link secret, and this cluster requires one")
        message = dict(request)
        if self.secret is not None:
            if not auth.verify(self.secret, "server", nonce, server_nonce, mine, remote_id, challenge.get("proof")):
                with self._lock:
                    self.stats["auth_failures"] += 1
                raise fail(S.LLM_LINK_FAILED, "the peer does not know the link secret")
            message["proof"] = auth.proof(self.secret, "client", nonce, server_nonce, mine, remote_id)
        if not self._send(fd, wire.OP_AUTH, message, deadline):
            raise fail(S.LLM_LINK_FAILED, "the authentication could not be sent")
        status, reply = self._receive(fd, wire.OP_HELLO_REPLY, deadline, "hello reply")
        if status == S.LLM_ALREADY_LINK and reply.get("mutual") is True:
            raise MutualLink()
        if status != 0:
            raise fail(status, f"refused: {reply.get('error', '')}")
        return reply

