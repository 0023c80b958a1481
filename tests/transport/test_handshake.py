"""The link handshake's functions (``transport.handshake``) over a socket pair, without processes:
what two sides agree on, and the precise refusal of a wrong or missing secret, a wrong protocol
version, a malformed hello or link request, a wrong cluster and a link made at the same moment.
"""

from __future__ import annotations

import dataclasses
import os
import select
import socket
import threading
from typing import Any, Callable, Dict, Optional, Tuple

import pytest

from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.transport import auth, handshake, protection, wire
from llm_datadist.transport import deadline as dl
from llm_datadist.transport.errors import MutualLink, ProtocolError

from rawpeer import read_exact

SERVER, CLIENT = 5, 9
SECRET, OTHER_SECRET = b"the link secret of the tests", b"another link secret"


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setblocking(False)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


def soon() -> float:
    return dl.after(3000)


def in_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Run ``fn`` on a thread; the returned call gives its result (or raises its exception)."""
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result() -> Any:
        thread.join(10)
        assert not thread.is_alive()
        if "error" in box:
            raise box["error"]
        return box["result"]
    return result


def grant(sock: socket.socket, secret: Optional[bytes], planes=("tcp",), unix: Optional[str] = None
          ) -> Tuple[handshake.Admission, Optional[handshake.LinkRequest]]:
    """The server side: admit the connection and, for a link request, grant it."""
    admission = handshake.accept_hello(sock, SERVER, secret, soon())
    if admission.refused is not None:
        return admission, None
    request = handshake.read_link_request(admission.request)
    reply = handshake.signed_reply(secret, admission, handshake.link_reply(SERVER, "PROMPT", planes, True, "t0ken",
                                                                           unix))
    assert handshake.send_reply(sock, reply, 0, soon())
    return admission, request


def ask(sock: socket.socket, secret: Optional[bytes], planes=("cma", "tcp"), local_sockets: bool = False,
        remote_id: int = SERVER, comm=None, rank=None) -> handshake.LinkAgreement:
    return handshake.request_link(sock, CLIENT, secret, remote_id, "DECODER", planes, True, local_sockets, soon(),
                                  comm, rank=rank)


@pytest.mark.parametrize("secret", [None, SECRET])
def test_both_sides_agree_on_the_link_and_learn_each_others_planes(pair, secret):
    server_end, client_end = pair
    served = in_thread(lambda: grant(server_end, secret, planes=("tcp",)))
    agreement = ask(client_end, secret, planes=("cma", "tcp"), comm=("comm", "digest"), rank=3)
    admission, request = served()
    assert (admission.peer_id, admission.purpose, admission.refused) == (CLIENT, "link", None)
    me = (os.getpid(), os.getuid())
    assert request == handshake.LinkRequest("DECODER", ["cma", "tcp"], (2, 2), ("comm", "digest"), True, 3,
                                            "off", tuple(protection.suites_here()), *me, same_host=True)
    # Over TCP-only planes (no local_sockets wanted) no Unix socket is named even if offered.
    assert dataclasses.replace(agreement, digest=b"") == handshake.LinkAgreement("t0ken", "PROMPT", ["tcp"], None,
                                                                                  SERVER, process=me)
    # Both sides hold the same request and reply: the same digest (a protected link's keys use it).
    sent = handshake.link_reply(SERVER, "PROMPT", ("tcp",), True, "t0ken", None)
    assert agreement.digest == protection.link_digest(admission.request, sent)
    assert agreement.digest != protection.link_digest(dict(admission.request, suites=[]), sent)


@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_client_that_names_no_cluster_learns_the_one_the_handshake_proves(pair, secret):
    """A link to an address only (a router that forwards no cluster id): the agreement names the
    cluster whose challenge (and, with a secret, proof) the client accepted; ``on_peer`` hears of
    it before the link request is sent, and may stop there."""
    server_end, client_end = pair
    served = in_thread(lambda: grant(server_end, secret))
    heard = []
    agreement = handshake.request_link(client_end, CLIENT, secret, None, "DECODER", ("tcp",), True, False, soon(),
                                       on_peer=heard.append)
    assert served()[0].purpose == "link"
    assert agreement.cluster_id == SERVER and heard == [SERVER]


def test_a_client_that_names_no_cluster_may_stop_before_its_request(pair):
    server_end, client_end = pair
    served = in_thread(lambda: grant(server_end, SECRET))

    def stop(peer_id: int) -> None:
        raise LLMException(f"not {peer_id}", status_code=LLMStatusCode.LLM_ALREADY_LINK)

    with pytest.raises(LLMException, match="not 5"):
        handshake.request_link(client_end, CLIENT, SECRET, None, "DECODER", ("tcp",), True, False, soon(),
                               on_peer=stop)
    client_end.shutdown(socket.SHUT_RDWR)
    with pytest.raises(LLMException, match="no authentication"):  # the server heard nothing more
        served()


def test_a_learnt_cluster_is_still_bound_by_the_secret(pair):
    """Whoever answers must still prove the secret for the id it claims."""
    server_end, client_end = pair
    served = in_thread(lambda: grant(server_end, OTHER_SECRET))
    with pytest.raises(handshake.AuthRefused):
        handshake.request_link(client_end, CLIENT, SECRET, None, "DECODER", ("tcp",), True, False, soon())
    client_end.shutdown(socket.SHUT_RDWR)
    with pytest.raises(LLMException):
        served()


def test_a_same_host_peer_names_its_unix_socket_when_a_plane_wants_one(pair):
    server_end, client_end = pair
    served = in_thread(lambda: grant(server_end, None, planes=("cma", "tcp"), unix="llm_datadist.test"))
    agreement = ask(client_end, None, local_sockets=True)
    served()
    assert agreement.unix_name == "llm_datadist.test" and agreement.planes == ["cma", "tcp"]


def test_a_wrong_secret_is_refused_by_the_client_before_it_says_anything(pair):
    server_end, client_end = pair
    served = in_thread(lambda: grant(server_end, SECRET))
    with pytest.raises(handshake.AuthRefused) as refused:
        ask(client_end, OTHER_SECRET)
    assert refused.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    assert refused.value.args[0] == "the peer does not know the link secret"
    client_end.shutdown(socket.SHUT_RDWR)  # what the client does next: close the connection
    with pytest.raises(LLMException) as silent:
        served()
    assert silent.value.status_code == LLMStatusCode.LLM_LINK_FAILED and "no authentication" in str(silent.value)


def test_a_wrong_proof_is_refused_by_the_server(pair):
    server_end, client_end = pair
    served = in_thread(lambda: grant(server_end, SECRET))
    fd = client_end.fileno()
    nonce = auth.new_nonce()
    assert handshake.send_frame(fd, wire.OP_HELLO, {"cluster_id": CLIENT, "nonce": nonce, "auth": True}, soon())
    status, challenge = handshake.receive_frame(fd, wire.OP_CHALLENGE, soon(), "challenge")
    assert status == 0 and challenge["cluster_id"] == SERVER
    proof = auth.proof(OTHER_SECRET, "client", nonce, challenge["nonce"], CLIENT, SERVER)
    assert handshake.send_frame(fd, wire.OP_AUTH, {"purpose": "link", "proof": proof}, soon())
    status, reply = handshake.receive_frame(fd, wire.OP_HELLO_REPLY, soon(), "reply")
    assert (status, reply) == (LLMStatusCode.LLM_LINK_FAILED, {"error": "authentication failed"})
    admission, request = served()
    assert admission == handshake.Admission(CLIENT, refused="wrong link secret", auth_failure=True)
    assert request is None


@pytest.mark.parametrize("server_secret, client_secret, said", [
    (SECRET, None, "this cluster requires a link secret"),
    (None, SECRET, "this cluster has no link secret"),
])
def test_a_secret_on_one_side_only_is_refused_by_both(pair, server_secret, client_secret, said):
    server_end, client_end = pair
    served = in_thread(lambda: grant(server_end, server_secret))
    with pytest.raises(LLMException) as refused:
        ask(client_end, client_secret)
    assert refused.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    assert refused.value.args[0] == f"refused: {said}"
    admission, request = served()
    assert admission == handshake.Admission(CLIENT, refused=said, auth_failure=True) and request is None


@pytest.mark.parametrize("version", [4, 5, 6, 7, 8, wire.PROTOCOL_VERSION + 1],
                         ids=["v4 (before pull tags)", "v5 (before the nixl table entry)",
                              "v6 (before link protection)", "v7 (before the signed handshake)",
                              "v8 (before the shm plane)", "newer"])
def test_a_hello_of_another_protocol_version_is_refused_in_the_peers_own_version(pair, version):
    """The server raises the one line naming both versions (the caller logs it and closes), and
    first answers with a refused CHALLENGE in the peer's version carrying that line, which a
    client of any version since 3 reports as ``refused: <line>``."""
    assert wire.PROTOCOL_VERSION == 9
    server_end, client_end = pair
    served = in_thread(lambda: handshake.accept_hello(server_end, SERVER, None, soon()))
    payload = wire.encode_json({"cluster_id": CLIENT, "nonce": auth.new_nonce(), "auth": False})
    head = wire.HEADER.pack(wire.MAGIC, version, wire.OP_HELLO, 0, 1, len(payload))
    client_end.sendall(head + payload)
    with pytest.raises(wire.VersionMismatch) as bad:
        served()
    line = f"protocol version {version}, this side speaks 9"
    assert str(bad.value) == line and bad.value.version == version
    select.select([client_end], [], [], 3)
    answer = client_end.recv(1 << 16)
    magic, their_version, op, status, _, length = wire.HEADER.unpack(answer[:wire.HEADER_BYTES])
    assert (magic, their_version, op, status) == (wire.MAGIC, version, wire.OP_CHALLENGE,
                                                  LLMStatusCode.LLM_LINK_FAILED.value)
    assert wire.decode_json(answer[wire.HEADER_BYTES:wire.HEADER_BYTES + length]) == {"error": line}


def test_a_client_answered_in_another_version_fails_with_the_line_naming_both(pair):
    """Our client, answered by a server of another version that answers as this one does: the
    frame itself is refused with the one line (the link logs it and fails)."""
    server_end, client_end = pair
    done = in_thread(lambda: handshake.client_handshake(client_end, CLIENT, None, SERVER, {"purpose": "link"},
                                                        soon()))
    select.select([server_end], [], [], 3)
    server_end.recv(1 << 16)
    payload = wire.encode_json({"error": "protocol version 9, this side speaks 10"})
    server_end.sendall(wire.HEADER.pack(wire.MAGIC, 10, wire.OP_CHALLENGE, 0, 1, len(payload)) + payload)
    with pytest.raises(wire.VersionMismatch, match="^protocol version 10, this side speaks 9$"):
        done()


@pytest.mark.parametrize("hello", [
    {"nonce": "00" * 16, "auth": False},                     # no cluster id
    {"cluster_id": "9", "nonce": "00" * 16, "auth": False},  # not an int
    {"cluster_id": CLIENT, "nonce": "short", "auth": False},
    {"cluster_id": CLIENT, "nonce": "00" * 16, "auth": 1},   # auth must be a bool
])
def test_a_malformed_hello_is_a_protocol_error_and_nothing_is_answered(pair, hello):
    server_end, client_end = pair
    if "nonce" in hello and hello["nonce"] == "00" * 16:
        hello = dict(hello, nonce=auth.new_nonce())
    served = in_thread(lambda: handshake.accept_hello(server_end, SERVER, None, soon()))
    assert handshake.send_frame(client_end.fileno(), wire.OP_HELLO, hello, soon())
    with pytest.raises(ProtocolError) as bad:
        served()
    assert str(bad.value).startswith("malformed hello")


@pytest.mark.parametrize("change, what", [
    ({"connections": [2]}, "connections"),
    ({"connections": [2, 5]}, "connections"),
    ({"planes": "tcp"}, "planes"),
    ({"planes": ["tcp", 3]}, "planes"),
    ({"role": 7}, "role or host"),
    ({"host": None}, "role or host"),
    ({"comm": ["only one"]}, "comm"),
    ({"comm": ["c", "digest"]}, "rank"),  # a link request for a comm claims a rank in it
    ({"comm": ["c", "digest"], "rank": -1}, "rank"),
    ({"comm": ["c", "digest"], "rank": True}, "rank"),
    ({"comm": ["c", "digest"], "rank": "1"}, "rank"),
    ({"pid": 0}, "pid"),
    ({"pid": "7"}, "pid"),
    ({"uid": -1}, "pid 7 or uid"),
    ({"uid": None}, "pid 7 or uid"),
])
def test_a_malformed_link_request_is_a_protocol_error(change, what):
    request = {"purpose": "link", "role": "DECODER", "planes": ["tcp"], "host": {}, "connections": [2, 2],
               "pid": 7, "uid": 0}
    with pytest.raises(ProtocolError) as bad:
        handshake.read_link_request(dict(request, **change))
    assert str(bad.value).startswith(f"link request: {what}")


def test_a_link_request_is_cut_to_size():
    request = handshake.read_link_request({"role": "R" * 100, "planes": [f"p{i}" * 30 for i in range(20)],
                                           "host": {}, "connections": [1, 4], "pid": 7, "uid": 1000})
    assert request == handshake.LinkRequest("R" * 64, [(f"p{i}" * 30)[:32] for i in range(8)], (1, 4), None, False,
                                            pid=7, uid=1000)


def test_the_client_refuses_a_server_of_another_cluster_id(pair):
    server_end, client_end = pair
    served = in_thread(lambda: grant(server_end, None))
    with pytest.raises(LLMException) as wrong:
        ask(client_end, None, remote_id=SERVER + 1)
    assert wrong.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    assert wrong.value.args[0] == f"expected cluster {SERVER + 1}, found cluster {SERVER}"
    client_end.shutdown(socket.SHUT_RDWR)
    with pytest.raises(LLMException):
        served()


def test_a_mutual_link_reply_raises_mutual_link_and_a_refusal_its_status(pair):
    server_end, client_end = pair

    def refuse(status: int, reply: Dict[str, Any]) -> None:
        admission = handshake.accept_hello(server_end, SERVER, None, soon())
        assert admission.purpose == "link"
        handshake.send_reply(server_end, reply, status, soon())

    served = in_thread(lambda: refuse(LLMStatusCode.LLM_ALREADY_LINK, {"error": "both", "mutual": True}))
    with pytest.raises(MutualLink):
        ask(client_end, None)
    served()


def test_a_refused_link_request_raises_the_servers_status(pair):
    server_end, client_end = pair

    def refuse() -> None:
        handshake.accept_hello(server_end, SERVER, None, soon())
        handshake.send_reply(server_end, {"error": "already linked"}, LLMStatusCode.LLM_ALREADY_LINK, soon())

    served = in_thread(refuse)
    with pytest.raises(LLMException) as refused:
        ask(client_end, None)
    assert refused.value.status_code == LLMStatusCode.LLM_ALREADY_LINK
    assert refused.value.args[0] == "refused: already linked"
    served()


def test_a_reply_without_a_token_is_a_protocol_error(pair):
    server_end, client_end = pair

    def bad_reply() -> None:
        handshake.accept_hello(server_end, SERVER, None, soon())
        handshake.send_reply(server_end, {"cluster_id": SERVER, "role": "PROMPT", "planes": ["tcp"]}, 0, soon())

    served = in_thread(bad_reply)
    with pytest.raises(ProtocolError) as bad:
        ask(client_end, None)
    assert "lacks token" in str(bad.value)
    served()


@pytest.mark.parametrize("proof_secret", [OTHER_SECRET, None])
def test_a_failed_authentication_is_reported_before_the_peer_holds_the_refusal(pair, proof_secret):
    """Whoever counts failures (the link manager's ``auth_failures``) has counted one by the time the
    peer can read its refusal: the callback runs before the refusal is sent, not after. The peer
    reads nothing until the callback has looked at its socket."""
    server_end, client_end = pair
    calls = []
    looked = threading.Event()

    def on_failure(peer_id: int, why: str) -> None:  # has the refusal reached the peer's socket yet?
        calls.append((peer_id, why, bool(select.select([client_end], [], [], 0)[0])))
        looked.set()

    served = in_thread(lambda: handshake.accept_hello(server_end, SERVER, SECRET, soon(), on_failure))
    fd = client_end.fileno()
    nonce = auth.new_nonce()
    hello = {"cluster_id": CLIENT, "nonce": nonce, "auth": proof_secret is not None}
    assert handshake.send_frame(fd, wire.OP_HELLO, hello, soon())
    if proof_secret is None:  # refused at the challenge: the hello says it has no secret
        assert looked.wait(5)
        status, _ = handshake.receive_frame(fd, wire.OP_CHALLENGE, soon(), "challenge")
        why = "this cluster requires a link secret"
    else:
        status, challenge = handshake.receive_frame(fd, wire.OP_CHALLENGE, soon(), "challenge")
        assert status == 0
        proof = auth.proof(proof_secret, "client", nonce, challenge["nonce"], CLIENT, SERVER)
        assert handshake.send_frame(fd, wire.OP_AUTH, {"purpose": "link", "proof": proof}, soon())
        assert looked.wait(5)
        status, _ = handshake.receive_frame(fd, wire.OP_HELLO_REPLY, soon(), "reply")
        why = "wrong link secret"
    assert status == LLMStatusCode.LLM_LINK_FAILED
    assert served().refused == why
    assert calls == [(CLIENT, why, False)]


# -- protocol 8: the signed request and reply, and the process each side states --------------------
class Rewriter:
    """A man in the middle between two socket pairs: it passes every frame on, changing the JSON
    body of the first frame of ``op`` with ``change`` (a dict update) — what a relay on the link's
    TCP path can do to the handshake, which travels in the clear."""

    def __init__(self, op: int, change: Dict[str, Any]) -> None:
        self.client_end, self._near = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._far, self.server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.client_end.setblocking(False)
        self.server_end.setblocking(False)
        self.op, self.change, self.changed = op, change, 0
        for source, sink in ((self._near, self._far), (self._far, self._near)):
            threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                head = read_exact(source, wire.HEADER_BYTES)
                magic, version, op, status, req_id, length = wire.HEADER.unpack(head)
                body = read_exact(source, length)
                if op == self.op and not self.changed:
                    self.changed += 1
                    body = wire.encode_json(dict(wire.decode_json(body), **self.change))
                    head = wire.HEADER.pack(magic, version, op, status, req_id, len(body))
                sink.sendall(head + body)
        except (EOFError, OSError):
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        for sock in (self.client_end, self._near, self._far, self.server_end):
            sock.close()


@pytest.mark.parametrize("change", [
    {"unix": "llm_datadist.relay"},   # the attack: the link's connections to the relay's own socket
    {"planes": ["tcp", "cma"]},
    {"host": {"boot_id": "x", "pid_ns": "y", "net_ns": "z"}},
    {"pid": 4242},
    {"role": "DECODER"},
    {"mac": "00" * 32},
], ids=["unix", "planes", "host", "pid", "role", "mac"])
def test_with_a_secret_a_reply_changed_on_the_way_fails_the_link(change):
    """Defect 1 of issue 32: the reply's Unix socket name travelled unsigned, so a relay on the TCP
    path pointed the link's connections at a socket of its own. Now any field changed fails."""
    middle = Rewriter(wire.OP_HELLO_REPLY, change)
    try:
        served = in_thread(lambda: grant(middle.server_end, SECRET, planes=("cma", "tcp"), unix="llm_datadist.real"))
        with pytest.raises(handshake.AuthRefused, match="reply was changed on the way"):
            ask(middle.client_end, SECRET, local_sockets=True)
        assert middle.changed == 1
        served()
    finally:
        middle.close()


@pytest.mark.parametrize("change", [{"planes": ["cma"]}, {"pid": 4242}, {"protection": "integrity"},
                                    {"host": {}}, {"token": "t0ken"}], ids=["planes", "pid", "protection", "host",
                                                                            "extra field"])
def test_with_a_secret_a_request_changed_on_the_way_is_refused(change):
    middle = Rewriter(wire.OP_AUTH, change)
    try:
        served = in_thread(lambda: grant(middle.server_end, SECRET))
        with pytest.raises(LLMException, match="refused: authentication failed"):
            ask(middle.client_end, SECRET)
        admission, request = served()
        assert admission.auth_failure and "changed on the way" in admission.refused and request is None
    finally:
        middle.close()


def test_without_a_secret_nothing_is_signed_and_a_changed_reply_is_taken():
    """What a secret buys: without one the handshake is not signed (documented in docs/security.md)."""
    middle = Rewriter(wire.OP_HELLO_REPLY, {"unix": "llm_datadist.relay"})
    try:
        served = in_thread(lambda: grant(middle.server_end, None, planes=("cma", "tcp"), unix="llm_datadist.real"))
        assert ask(middle.client_end, None, local_sockets=True).unix_name == "llm_datadist.relay"
        served()
    finally:
        middle.close()


def test_a_signed_reply_is_bound_to_its_connection(pair):
    """A reply signed for one connection (its nonces) does not verify on another."""
    first_server, first_client = pair
    served = in_thread(lambda: grant(first_server, SECRET))
    ask(first_client, SECRET)
    admission, _ = served()
    reply = handshake.signed_reply(SECRET, admission, handshake.link_reply(SERVER, "PROMPT", ("tcp",), True, "t", None))
    server_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server_end.setblocking(False)
        client_end.setblocking(False)

        def replay():
            admitted = handshake.accept_hello(server_end, SERVER, SECRET, soon())
            handshake.send_reply(server_end, reply, 0, soon())
            return admitted

        replayed = in_thread(replay)
        with pytest.raises(handshake.AuthRefused, match="reply was changed on the way"):
            ask(client_end, SECRET)
        assert replayed().refused is None
    finally:
        server_end.close()
        client_end.close()


def test_a_unix_connection_must_come_from_the_process_the_peer_stated(pair):
    """``check_process``: the kernel's pid and uid of the connection against the stated ones."""
    server_end, client_end = pair
    me = (os.getpid(), os.getuid())
    assert handshake.check_process(client_end, me, "the peer's") == me
    with pytest.raises(LLMException, match=rf"comes from pid {me[0]} .*not from the peer's own process \(pid 1,"):
        handshake.check_process(client_end, (1, me[1]), "cluster 5's")
    with pytest.raises(LLMException, match="not from the peer's own process"):
        handshake.check_process(client_end, (me[0], me[1] + 1), "cluster 5's")


@pytest.mark.parametrize("secret", [None, SECRET])
def test_the_data_connections_handshakes_run_side_by_side(secret):
    """``open_connections`` opens all four data connections and sends their HELLOs before it
    waits for any challenge (one round trip per step for all of them: issue 36's first link):
    a server that answers nothing until it has accepted all four, each with its HELLO waiting,
    still makes the link, with two forward and two reverse connections presenting the token."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)

    def serve():
        conns = [listener.accept()[0] for _ in range(handshake.CONNECTIONS_PER_DIRECTION * 2)]
        for conn in conns:
            assert select.select([conn], [], [], 5)[0], "a HELLO did not come before any challenge"
        admissions = []
        for conn in conns:
            conn.setblocking(False)
            admission = handshake.accept_hello(conn, SERVER, secret, soon())
            assert admission.refused is None
            admissions.append(admission)
            assert handshake.send_reply(conn, handshake.signed_reply(secret, admission, {"cluster_id": SERVER}),
                                        0, soon())
        return conns, admissions

    served = in_thread(serve)
    agreement = handshake.LinkAgreement("t0ken", "PROMPT", ["tcp"], None, SERVER)
    sockets = []
    try:
        made = handshake.open_connections(*listener.getsockname(), CLIENT, secret, SERVER, agreement, soon(),
                                          sockets)
        conns, admissions = served()
        assert (len(made.forward), len(made.reverse), made.unix) == (2, 2, False)
        assert [a.purpose for a in admissions] == ["forward", "forward", "reverse", "reverse"]
        assert {a.request.get("token") for a in admissions} == {"t0ken"}
        for conn in conns:
            conn.close()
    finally:
        for sock in sockets:
            sock.close()
        listener.close()
