"""The link handshake, both sides, as plain functions of a connected socket and what this side is
(its cluster id, its link secret, the planes it offers); each returns what was agreed, or raises.

Every connection starts ``HELLO -> CHALLENGE -> AUTH -> HELLO_REPLY``: both sides prove knowledge
of the link secret when one is set (``auth``), and the ``AUTH`` message says what the connection
is for. A *link* connection (to the server's TCP listener) carries the link request: the server
answers with a one-time token and the abstract name of its Unix socket. The client then opens
the link's *forward* connections (its requests, served by server threads) and *reverse* ones
(the server's requests, served by client threads), each authenticated the same way and bound to
the link by the token. On this host (same kernel, PID and network namespace) they are Unix
sockets when a plane wants them (``DataPlane.local_sockets``), so that the kernel tells each side
the other's pid and uid (``SO_PEERCRED``); otherwise TCP.

The accepting side: ``accept_hello`` (up to the ``AUTH`` message: an ``Admission``),
``read_link_request`` (a link request, checked: a ``LinkRequest``), ``link_reply`` and
``send_reply``. The connecting side: ``client_handshake`` (one connection), ``request_link`` (the
link connection: a ``LinkAgreement``) and ``open_connections`` (the link's data connections:
``LinkConnections``). What to do with a request -- the link table, the caps -- is the link
manager's (``links``). Nothing about this process is sent before the peer has authenticated.

With a secret, the ``AUTH`` message and the ``HELLO_REPLY`` are signed (``auth.message_mac``; the
reply's MAC covers the request it answers too), so nothing that steers where a link's bytes go --
the Unix socket name, the planes, the host identity, the pid and uid each side states, the
protection -- can be changed on the way: a changed request is refused, a changed reply fails the
link. Each side states its pid and uid in the link request or reply, and a link's Unix connections
must come from exactly that process (``SO_PEERCRED``): a relay between them is refused on both
sides, with or without protection.

Failures: ``ProtocolError`` for a malformed frame or message; ``LLMException`` for a closed,
silent or slow connection and for a refusal (``AuthRefused`` when the peer's proof is wrong,
``errors.MutualLink`` when the peer is linking to this cluster at the same moment).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from llm_datadist import _io
from llm_datadist.status import LLMException
from llm_datadist.transport import auth, budgets, protection, wire
from llm_datadist.transport import deadline as dl
from llm_datadist.transport.errors import S, MutualLink, ProtocolError, brief, fail, is_int, status_of
from llm_datadist.transport.host import host_identity, same_host
from llm_datadist.transport.sockets import close_socket, tune
from llm_datadist.transport.session import (CONNECTIONS_PER_DIRECTION, MAX_CONNECTIONS, peer_credentials, read_body,
                                            read_header)

logger = logging.getLogger("llm_datadist")

#: Largest handshake message (hello, challenge, authentication, reply).
MAX_HANDSHAKE_BYTES = budgets.MAX_HANDSHAKE_BYTES
#: The first protocol version whose handshake had a CHALLENGE (``refuse_version``).
FIRST_CHALLENGE_VERSION = 3
#: Largest rank a two-sided link request may claim.
MAX_RANK = 1 << 31
#: Longest plane name kept from a peer's link request or reply (every plane's name is shorter).
MAX_PLANE_NAME = 32


class AuthRefused(LLMException):
    """The peer failed to prove that it knows the link secret (``LLM_LINK_FAILED``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status_code=S.LLM_LINK_FAILED)


# -- frames of the handshake ------------------------------------------------------------------------
def send_frame(fd: int, op: int, message: Dict[str, Any], deadline: float, status: int = 0) -> bool:
    """Send a JSON handshake frame; whether it went out whole before ``deadline``."""
    payload = wire.encode_json(message)
    st, _ = _io.send_bytes(fd, wire.pack_header(op, 1, len(payload), status) + payload, max(1, dl.left_ms(deadline)))
    return st == 0


def receive_frame(fd: int, expect: int, deadline: float, what: str) -> Tuple[int, Dict[str, Any]]:
    """``(status, JSON object)`` of the next frame, which must be ``expect``. ProtocolError for a
    malformed frame (a wrong magic or protocol version included); LLMException for a closed,
    silent or slow connection."""
    header = bytearray(wire.HEADER_BYTES)
    # (no receive spin: the peer answers a handshake from Python, and misses there would turn
    # spinning off for the link's transfers: ``_io.SPIN_OFF``)
    st = read_header(fd, header, max(1, dl.left_ms(deadline)), _io.SPIN_OFF)
    if st != 0:
        raise fail(S.LLM_LINK_FAILED, f"no {what} ({status_of(st).name})")
    op, status, _, length = wire.unpack_header(header)
    if op != expect or length > MAX_HANDSHAKE_BYTES:
        raise ProtocolError(f"{wire.OP_NAMES[op]} of {length} bytes instead of a {what}")
    st, body = read_body(fd, length, max(1, dl.left_ms(deadline)), _io.SPIN_OFF)
    if st != 0:
        raise fail(S.LLM_LINK_FAILED, f"{what} truncated ({status_of(st).name})")
    return status, wire.decode_json(body)


# -- the accepting side -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Admission:
    """The outcome of ``accept_hello``: the cluster the peer claims to be (proved when a secret is
    set) and its ``AUTH`` message, or why it was refused (the refusal was sent when it could be;
    ``auth_failure``: the refusal is a failed authentication); ``nonces``: the connection's
    (client nonce, server nonce), to check a self-link's proof (``auth.verify_self``)."""

    peer_id: int
    request: Dict[str, Any] = field(default_factory=dict)
    refused: Optional[str] = None
    auth_failure: bool = False
    nonces: Tuple[str, str] = ("", "")
    #: the accepting cluster's own id (the reply's MAC binds it)
    server_id: int = 0

    @property
    def purpose(self) -> Any:
        return self.request.get("purpose")


def refuse_version(fd: int, mismatch: wire.VersionMismatch, deadline: float) -> None:
    """Answer a hello of another protocol version with a refused ``CHALLENGE`` in the peer's own
    version, carrying the one line that names both versions: every client since version 3 reads a
    challenge's refusal as ``refused: <error>`` and fails its link with it (LLM_LINK_FAILED), so the
    peer's log says why instead of showing a closed connection. Versions before 3 had no
    challenge, and no version 0 ever was: those get nothing. Best effort: the caller closes."""
    if mismatch.version < FIRST_CHALLENGE_VERSION:
        return
    payload = wire.encode_json({"error": str(mismatch)})
    header = wire.pack_header(wire.OP_CHALLENGE, 1, len(payload), S.LLM_LINK_FAILED, version=mismatch.version)
    _io.send_bytes(fd, header + payload, max(1, dl.left_ms(deadline)))


def _ignore_failure(peer_id: int, why: str) -> None:
    pass


def accept_hello(sock: socket.socket, cluster_id: int, secret: Optional[bytes], deadline: float,
                 on_auth_failure: Callable[[int, str], None] = _ignore_failure) -> Admission:
    """HELLO -> CHALLENGE -> AUTH on an accepted connection of the cluster ``cluster_id``.

    ``on_auth_failure(peer_id, why)`` runs for a failed authentication *before* the refusal is
    sent, so that whoever counts failures has counted this one by the time the peer holds it."""
    fd = sock.fileno()
    try:
        _, hello = receive_frame(fd, wire.OP_HELLO, deadline, "hello")
    except wire.VersionMismatch as exc:
        refuse_version(fd, exc, deadline)
        raise
    peer_id, client_nonce = hello.get("cluster_id"), hello.get("nonce")
    if not is_int(peer_id) or not auth.is_nonce(client_nonce) or not isinstance(hello.get("auth"), bool):
        raise ProtocolError(f"malformed hello {brief(hello)}")
    server_nonce = auth.new_nonce()
    challenge: Dict[str, Any] = {"cluster_id": cluster_id, "nonce": server_nonce, "auth": secret is not None}
    if hello["auth"] != (secret is not None):
        why = "this cluster requires a link secret" if secret else "this cluster has no link secret"
        on_auth_failure(peer_id, why)
        send_frame(fd, wire.OP_CHALLENGE, dict(challenge, error=why), deadline, S.LLM_LINK_FAILED)
        return Admission(peer_id, refused=why, auth_failure=True)
    if secret is not None:
        challenge["proof"] = auth.proof(secret, "server", client_nonce, server_nonce, peer_id, cluster_id)
    if not send_frame(fd, wire.OP_CHALLENGE, challenge, deadline):
        return Admission(peer_id, refused="the challenge could not be sent")
    _, message = receive_frame(fd, wire.OP_AUTH, deadline, "authentication")
    if secret is not None:
        why = None
        if not auth.verify(secret, "client", client_nonce, server_nonce, peer_id, cluster_id, message.get("proof")):
            why = "wrong link secret"
        elif not auth.verify_mac(secret, "request", client_nonce, server_nonce, peer_id, cluster_id,
                                 message.get("mac"), message):
            why = "its authentication message was changed on the way (its MAC does not verify)"
        if why is not None:
            on_auth_failure(peer_id, why)
            send_frame(fd, wire.OP_HELLO_REPLY, {"error": "authentication failed"}, deadline, S.LLM_LINK_FAILED)
            return Admission(peer_id, refused=why, auth_failure=True)
    return Admission(peer_id, message, nonces=(client_nonce, server_nonce), server_id=cluster_id)


def signed_reply(secret: Optional[bytes], admission: Admission, reply: Dict[str, Any]) -> Dict[str, Any]:
    """``reply`` to the ``AUTH`` message of ``admission``, with a secret signed (``mac``: over the
    reply and the request it answers, bound to the connection); as it is without one."""
    if secret is None:
        return reply
    client_nonce, server_nonce = admission.nonces
    return dict(reply, mac=auth.message_mac(secret, "reply", client_nonce, server_nonce, admission.peer_id,
                                            admission.server_id, reply, admission.request))


@dataclass(frozen=True)
class LinkRequest:
    """A link request, checked: the peer's role, the planes it offers, the connections it will
    open (forward, reverse), the two-sided link it is for (its name and the digest of its rank
    table and rank map, ``comms.digest``), its remote-cache-access option, with a two-sided
    link the rank the peer claims in it, the protection it asks for and the record suites it can
    run (``protection``), and the pid and uid of the process it says it is (its Unix connections
    must come from that process)."""

    role: str
    planes: List[str]
    want: Tuple[int, int]
    comm: Optional[Tuple[str, str]]
    remote_accessible: bool
    rank: Optional[int] = None
    protection: str = protection.OFF
    suites: Tuple[str, ...] = ()
    pid: int = 0
    uid: int = -1
    #: the host identity it states is this one's (``host.same_host``)
    same_host: bool = False


def read_link_request(message: Dict[str, Any]) -> LinkRequest:
    """The link request of an ``AUTH`` message whose purpose is ``link``; ProtocolError if it is
    malformed. The role is cut to 64 characters and the planes to 8 of ``MAX_PLANE_NAME``."""
    want = message.get("connections")
    planes = message.get("planes")
    if not (isinstance(want, list) and len(want) == 2 and all(is_int(n, 1, MAX_CONNECTIONS) for n in want)):
        raise ProtocolError(f"link request: connections {brief(want)}")
    if not (isinstance(planes, list) and all(isinstance(p, str) for p in planes)):
        raise ProtocolError(f"link request: planes {brief(planes)}")
    if not isinstance(message.get("role"), str) or not isinstance(message.get("host"), dict):
        raise ProtocolError("link request: role or host malformed")
    comm, rank = message.get("comm"), message.get("rank")
    if comm is not None:
        if not (isinstance(comm, list) and len(comm) == 2 and all(isinstance(x, str) for x in comm)):
            raise ProtocolError(f"link request: comm {brief(comm)}")
        if not is_int(rank, 0, MAX_RANK):
            raise ProtocolError(f"link request: rank {brief(rank)} in comm {brief(comm[0])}")
        comm = (comm[0], comm[1])
    else:
        rank = None
    asked, suites = message.get("protection", protection.OFF), message.get("suites", [])
    if asked not in protection.MODES:
        raise ProtocolError(f"link request: protection {brief(asked)}")
    if not (isinstance(suites, list) and all(isinstance(x, str) for x in suites)):
        raise ProtocolError(f"link request: suites {brief(suites)}")
    pid, uid = stated_process(message, "link request")
    return LinkRequest(message["role"][:64], [p[:MAX_PLANE_NAME] for p in planes[:8]], (want[0], want[1]), comm,
                       bool(message.get("remote_cache_accessible")), rank, asked, tuple(suites[:8]), pid, uid,
                       same_host(host_identity(), message["host"]))


def this_process() -> Dict[str, int]:
    """The pid and uid a link request or reply states for this side."""
    return {"pid": os.getpid(), "uid": os.getuid()}


def stated_process(message: Dict[str, Any], what: str) -> Tuple[int, int]:
    """The ``(pid, uid)`` a link request or reply states; ProtocolError if malformed."""
    pid, uid = message.get("pid"), message.get("uid")
    if not (is_int(pid, 1, (1 << 31) - 1) and is_int(uid, 0, (1 << 32) - 1)):
        raise ProtocolError(f"{what}: pid {brief(pid)} or uid {brief(uid)}")
    return pid, uid


def check_process(sock: socket.socket, stated: Tuple[int, int], whose: str) -> Tuple[int, int]:
    """The ``(pid, uid)`` the kernel has for the Unix connection ``sock`` (``SO_PEERCRED``), which
    must be ``stated`` (what the peer said, signed with a secret): otherwise something other than
    the peer's own process serves or opened it -- a relay -- and the link fails."""
    pid, uid = peer_credentials(sock)
    if (pid, uid) != tuple(stated):
        raise fail(S.LLM_LINK_FAILED, f"{whose} Unix connection comes from pid {pid} (uid {uid}), not from the "
                                      f"peer's own process (pid {stated[0]}, uid {stated[1]}): refused")
    return pid, uid


def link_reply(cluster_id: int, role: str, planes: Sequence[str], remote_accessible: bool, token: str,
               unix_name: Optional[str], protected: str = protection.OFF,
               suite: Optional[str] = None) -> Dict[str, Any]:
    """The reply that grants a link request (``protected``: the link's protection, in ``suite``)."""
    return {"cluster_id": cluster_id, "role": role, "planes": list(planes), "host": host_identity(),
            "remote_cache_accessible": remote_accessible, "token": token, "unix": unix_name,
            "protection": protected, "suite": suite, **this_process()}


def send_reply(sock: socket.socket, reply: Dict[str, Any], status: int, deadline: float) -> bool:
    """The ``HELLO_REPLY`` that ends the handshake (``status`` 0: granted)."""
    return send_frame(sock.fileno(), wire.OP_HELLO_REPLY, reply, deadline, status)


# -- the connecting side ----------------------------------------------------------------------------
def client_handshake(sock: socket.socket, cluster_id: int, secret: Optional[bytes], remote_id: Optional[int],
                     request: Dict[str, Any], deadline: float, self_key: Optional[bytes] = None,
                     on_peer: Optional[Callable[[int], None]] = None,
                     nonces: Optional[List[Tuple[str, str]]] = None) -> Dict[str, Any]:
    """HELLO -> CHALLENGE -> AUTH (carrying ``request``, and with ``self_key`` the proof that
    this is a self-link of this process) -> HELLO_REPLY with the cluster ``remote_id``; the
    reply, or LLMException.

    ``remote_id`` None: whichever cluster listens there; its id is the one its challenge names,
    and with a link secret the proofs bind both sides to it as to a given one. ``on_peer(id)``
    runs with the peer's id before anything about this side's purpose is sent (it may raise
    to go no further). ``nonces`` gets (this side's nonce, the server's) once both are known."""
    steps = ClientHandshake(sock, cluster_id, secret, remote_id, request, deadline, self_key, on_peer, nonces)
    steps.hello()
    steps.answer()
    return steps.reply()


class ClientHandshake:
    """``client_handshake`` in its three steps (send the hello; take the challenge and send the
    authentication; take the reply), so that the handshakes of several connections can be made
    side by side, each step on all of them before the next (``open_connections``): one round trip
    for all, where one after another pays one per connection."""

    def __init__(self, sock: socket.socket, cluster_id: int, secret: Optional[bytes], remote_id: Optional[int],
                 request: Dict[str, Any], deadline: float, self_key: Optional[bytes] = None,
                 on_peer: Optional[Callable[[int], None]] = None,
                 nonces: Optional[List[Tuple[str, str]]] = None) -> None:
        self.fd = sock.fileno()
        self.cluster_id, self.secret, self.remote_id = cluster_id, secret, remote_id
        self.request, self.deadline, self.self_key = request, deadline, self_key
        self.on_peer, self.nonces = on_peer, nonces
        self.nonce = auth.new_nonce()
        self.server_nonce: Optional[str] = None
        self.message: Dict[str, Any] = {}

    def hello(self) -> None:
        if not send_frame(self.fd, wire.OP_HELLO, {"cluster_id": self.cluster_id, "nonce": self.nonce,
                                                   "auth": self.secret is not None}, self.deadline):
            raise fail(S.LLM_LINK_FAILED, "the hello could not be sent")

    def answer(self) -> None:
        secret, cluster_id, nonce = self.secret, self.cluster_id, self.nonce
        status, challenge = receive_frame(self.fd, wire.OP_CHALLENGE, self.deadline, "challenge")
        if status != 0:
            raise fail(status, f"refused: {challenge.get('error', '')}")
        claimed = challenge.get("cluster_id")
        if self.remote_id is None:
            if not is_int(claimed):
                raise ProtocolError(f"malformed challenge {brief(challenge)}")
            self.remote_id = claimed
        elif claimed != self.remote_id:
            raise fail(S.LLM_LINK_FAILED, f"expected cluster {self.remote_id}, found cluster {brief(claimed)}")
        remote_id = self.remote_id
        server_nonce, wants_auth = challenge.get("nonce"), challenge.get("auth")
        if not auth.is_nonce(server_nonce) or not isinstance(wants_auth, bool):
            raise ProtocolError(f"malformed challenge {brief(challenge)}")
        if wants_auth != (secret is not None):
            raise fail(S.LLM_LINK_FAILED, "the peer requires a link secret" if wants_auth
                       else "the peer has no link secret, and this cluster requires one")
        self.server_nonce = server_nonce
        message = dict(self.request)
        if secret is not None:
            if not auth.verify(secret, "server", nonce, server_nonce, cluster_id, remote_id, challenge.get("proof")):
                raise AuthRefused("the peer does not know the link secret")
            message["proof"] = auth.proof(secret, "client", nonce, server_nonce, cluster_id, remote_id)
            message["mac"] = auth.message_mac(secret, "request", nonce, server_nonce, cluster_id, remote_id, message)
        if self.self_key is not None:
            message["self_proof"] = auth.self_proof(self.self_key, nonce, server_nonce)
        if self.nonces is not None:
            self.nonces.append((nonce, server_nonce))
        if self.on_peer is not None:
            self.on_peer(remote_id)
        self.message = message
        if not send_frame(self.fd, wire.OP_AUTH, message, self.deadline):
            raise fail(S.LLM_LINK_FAILED, "the authentication could not be sent")

    def reply(self) -> Dict[str, Any]:
        secret = self.secret
        status, reply = receive_frame(self.fd, wire.OP_HELLO_REPLY, self.deadline, "hello reply")
        mutual = status == S.LLM_ALREADY_LINK and reply.get("mutual") is True
        if secret is not None and (status == 0 or mutual) and not auth.verify_mac(
                secret, "reply", self.nonce, self.server_nonce, self.cluster_id, self.remote_id, reply.get("mac"),
                reply, self.message):
            # Only a refusal may come unsigned: it ends the link, which anyone on the path can do anyway.
            raise AuthRefused("the peer's reply was changed on the way (its MAC does not verify)")
        if mutual:
            raise MutualLink()
        if status != 0:
            raise fail(status, f"refused: {reply.get('error', '')}")
        return reply


@dataclass(frozen=True)
class LinkAgreement:
    """What a granted link request agreed: the link's one-time token, the server's role (cut to
    64 characters) and offered planes (cut to 8), and the abstract name of its Unix socket when
    the link's connections go there (the server is on this host and a plane of ours wants Unix
    sockets), else None."""

    token: str
    role: str
    planes: List[str]
    unix_name: Optional[str]
    #: the cluster that granted it (the one asked for, or the one the handshake found there)
    cluster_id: Optional[int] = None
    #: the link's protection (``protection``): what this side asked for or stronger, and its suite
    protection: str = protection.OFF
    suite: Optional[str] = None
    #: ``protection.link_digest`` of the request and reply, as this side holds them
    digest: bytes = b""
    #: the pid and uid the server stated (its Unix connections must come from that process)
    process: Tuple[int, int] = (0, -1)


def request_link(sock: socket.socket, cluster_id: int, secret: Optional[bytes], remote_id: Optional[int], role: str,
                 planes: Sequence[str], remote_accessible: bool, local_sockets: bool, deadline: float,
                 comm: Optional[Tuple[str, str]] = None, self_key: Optional[bytes] = None,
                 rank: Optional[int] = None, on_peer: Optional[Callable[[int], None]] = None,
                 protect: str = protection.OFF) -> LinkAgreement:
    """Ask the cluster ``remote_id`` at the other end of ``sock`` for a link (``planes``: those
    this side offers; ``local_sockets``: one of them wants Unix sockets on this host;
    ``self_key``: a link to this cluster's own listener, proven with this process's key;
    ``comm``: the two-sided link (name, digest) it is for, in which this side has ``rank``).
    ``remote_id`` None: whichever cluster listens there (``client_handshake``, which also says
    what ``on_peer`` is); the agreement names it. ``protect``: the protection this side asks for
    (and insists on: a reply granting less fails the link)."""
    request = dict(purpose="link", role=role, planes=list(planes), host=host_identity(),
                   remote_cache_accessible=remote_accessible,
                   connections=[CONNECTIONS_PER_DIRECTION, CONNECTIONS_PER_DIRECTION], force_link=True,
                   protection=protect, suites=protection.suites_here(), **this_process())
    if comm is not None:
        request["comm"], request["rank"] = list(comm), rank
    found: List[int] = []

    def peer_is(peer_id: int) -> None:
        found.append(peer_id)
        if on_peer is not None:
            on_peer(peer_id)

    reply = client_handshake(sock, cluster_id, secret, remote_id, request, deadline, self_key, peer_is)
    token, unix_name = reply.get("token"), reply.get("unix")
    offered, their_role = reply.get("planes"), reply.get("role")
    if not isinstance(token, str) or not isinstance(their_role, str) or not (
            isinstance(offered, list) and all(isinstance(p, str) for p in offered)):
        raise ProtocolError(f"link reply lacks token, role or planes: {brief(reply)}")
    granted = reply.get("protection", protection.OFF)
    if granted not in protection.MODES:
        raise ProtocolError(f"link reply: protection {brief(granted)}")
    if not protection.at_least(granted, protect):
        raise fail(S.LLM_LINK_FAILED, f"the peer granted protection {granted}, this side asked for {protect} "
                                      f"({protection.OPTION})")
    why = protection.unavailable(granted)
    if why is not None:
        raise fail(S.LLM_LINK_FAILED, f"the peer protects its links with {granted}: {why}")
    suite = reply.get("suite")
    if granted != protection.OFF and (suite not in protection.SUITES[granted] or suite not in protection.suites_here()):
        raise ProtocolError(f"link reply: suite {brief(suite)} for protection {granted}")
    host = reply.get("host") if isinstance(reply.get("host"), dict) else {}
    local = isinstance(unix_name, str) and local_sockets and same_host(host_identity(), host)
    return LinkAgreement(token, their_role[:64], [p[:MAX_PLANE_NAME] for p in offered[:8]],
                         unix_name if local else None, found[0],
                         granted, suite if granted != protection.OFF else None, protection.link_digest(request, reply),
                         stated_process(reply, "link reply"))


@dataclass
class LinkConnections:
    """The data connections of a link, made: this side's requests (``forward``), the peer's
    (``reverse``), whether they are Unix sockets, and then the peer's pid and uid as the kernel
    has them (0 and -1 over TCP)."""

    forward: List[socket.socket] = field(default_factory=list)
    reverse: List[socket.socket] = field(default_factory=list)
    unix: bool = False
    pid: int = 0
    uid: int = -1


def open_connections(ip: str, port: int, cluster_id: int, secret: Optional[bytes], remote_id: int,
                     agreement: LinkAgreement, deadline: float, sockets: List[socket.socket],
                     seal: Optional[Callable[[socket.socket, Tuple[str, str]], socket.socket]] = None
                     ) -> LinkConnections:
    """Open and authenticate the data connections of the link ``agreement`` granted: to its Unix
    socket if it names one (never TCP then: the server refuses those, and a Unix socket that does
    not take a connection before the deadline fails the link), else TCP. Every
    socket opened goes to ``sockets`` too (the caller closes them if this raises). On a
    protected link each TCP connection is handed, once authenticated, to ``seal(sock, (this
    side's nonce, the server's))``, which returns the socket the link uses instead."""
    made = LinkConnections()
    unix = agreement.unix_name is not None
    purposes = ["forward"] * CONNECTIONS_PER_DIRECTION + ["reverse"] * CONNECTIONS_PER_DIRECTION
    opened: List[Tuple[str, socket.socket, List[Tuple[str, str]]]] = []
    steps: List[ClientHandshake] = []
    # The connections' handshakes side by side, a step on every connection before the next: each
    # is its own connection, handshake and server thread as before, but the link waits for one
    # round trip per step rather than one per step and connection.
    for purpose in purposes:
        sock = connect_unix(agreement.unix_name, deadline) if unix else connect_tcp(ip, port, deadline)
        sockets.append(sock)
        nonces: List[Tuple[str, str]] = []
        opened.append((purpose, sock, nonces))
        steps.append(ClientHandshake(sock, cluster_id, secret, remote_id,
                                     {"purpose": purpose, "token": agreement.token}, deadline, nonces=nonces))
        steps[-1].hello()
    for step in steps:
        step.answer()
    for step in steps:
        step.reply()
    for purpose, sock, nonces in opened:
        if not unix and agreement.protection != protection.OFF:
            if seal is None:
                raise fail(S.LLM_LINK_FAILED, "a protected link without the means to seal it")
            sock = seal(sock, nonces[0])
            sockets.append(sock)
        if unix:
            made.pid, made.uid = check_process(sock, agreement.process, f"cluster {remote_id}'s")
            made.unix = True
        (made.forward if purpose == "forward" else made.reverse).append(sock)
    return made


def connect_tcp(ip: str, port: int, deadline: float) -> socket.socket:
    """A tuned, non-blocking TCP connection to ``ip:port``."""
    remaining = dl.left_s(deadline)
    if remaining <= 0:
        raise LLMException("link timed out", status_code=S.LLM_LINK_FAILED)
    # An address as bytes: getaddrinfo encodes a str host with the IDNA codec, whose first import
    # (~2 ms) the first link would pay; an IP address or a plain host name is ASCII either way.
    sock = socket.create_connection((ip.encode("ascii") if ip.isascii() else ip, port), timeout=remaining)
    try:
        tune(sock)
        sock.setblocking(False)
    except BaseException:
        close_socket(sock)
        raise
    return sock


def connect_unix(unix_name: str, deadline: float) -> socket.socket:
    """A tuned, non-blocking connection to the abstract Unix socket ``unix_name``. A full
    backlog (``EAGAIN``: a Unix socket does not wait for room, and anyone can fill it, its name
    being in ``/proc/net/unix``) is tried again until ``deadline``; then LLM_LINK_FAILED."""
    pause = 0.001
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(0.001, dl.left_s(deadline)))
            sock.connect("\0" + unix_name)
            tune(sock)
            sock.setblocking(False)
            return sock
        except BlockingIOError:
            sock.close()
            if dl.left_s(deadline) <= pause:
                raise fail(S.LLM_LINK_FAILED,
                           f"the peer's Unix socket took no connection in time ({unix_name})") from None
            time.sleep(pause)
            pause = min(0.05, pause * 2)
        except BaseException:
            sock.close()
            raise
