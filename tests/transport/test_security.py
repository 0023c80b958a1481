"""Link security with real processes: authentication by a shared secret, identity proven by the
kernel rather than claimed, no link hijack, a listener that survives descriptor exhaustion and
floods of idle connections, and links reaped when their peers vanish.

The hostile peer is ``rawpeer`` (a hand-written client of the protocol) running in the test
process; the servers are real clusters in their own processes."""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import socket
import threading
import time
from contextlib import ExitStack
from typing import Dict, List

import numpy as np
import pytest

from llm_datadist import BlocksCacheKey, CacheDesc, DataType, Placement
from llm_datadist.status import LLMStatusCode
from llm_datadist.testing import Cluster, link
from llm_datadist.transport import auth, wire

import rawpeer
from cluster_ops import resources, settle_to, wait_for

S = LLMStatusCode
SECRET = "correct horse battery staple"
SERVER_ID, CLIENT_ID, RAW_ID = 1, 2, 77
BLOCK = 4096
BLOCKS = 8
GUARD = 4096
SHORT_HANDSHAKE_MS = 600


# -- helpers that run inside the cluster processes -------------------------------------------------

def register_guarded(state, seed: int) -> Dict[str, int]:
    """A blocks cache (model 0) of 2 tensors x BLOCKS x BLOCK bytes, filled from ``seed``, with a
    GUARD of 0xEE before and after each tensor in the same allocation, and a SECRET buffer that
    is never registered. Returns the addresses a hostile peer would aim at."""
    backing = [np.full(GUARD + BLOCKS * BLOCK + GUARD, 0xEE, dtype=np.uint8) for _ in range(2)]
    rng = np.random.default_rng(seed)
    for array in backing:
        array[GUARD:GUARD + BLOCKS * BLOCK] = rng.integers(0, 256, BLOCKS * BLOCK, dtype=np.uint8)
    state.backing = backing
    state.expected = [array.copy() for array in backing]
    state.secret = np.frombuffer(b"TOP-SECRET-" * 372, dtype=np.uint8).copy()
    desc = CacheDesc(2, [BLOCKS, BLOCK], DataType.DT_UINT8, Placement.HOST)
    addrs = [array.ctypes.data + GUARD for array in backing]
    cache = state.cm.register_blocks_cache(desc, addrs, BlocksCacheKey(state.cluster_id, 0))
    state.cache = cache
    return {"tensors": addrs, "guard": backing[0].ctypes.data, "secret": state.secret.ctypes.data,
            "generation": state.dd.engine.generation_word.addr,
            "probe": state.dd.engine.links.planes["cma"].cookie.addr}


def untouched(state, blocks_changed: List[int] = ()) -> bool:
    """Guards and the secret are as they were; so is every block not in ``blocks_changed``."""
    if bytes(state.secret[:11]) != b"TOP-SECRET-":
        return False
    for array, expected in zip(state.backing, state.expected):
        if not (np.array_equal(array[:GUARD], expected[:GUARD]) and np.array_equal(array[-GUARD:], expected[-GUARD:])):
            return False
        for block in range(BLOCKS):
            if block in blocks_changed:
                continue
            span = slice(GUARD + block * BLOCK, GUARD + (block + 1) * BLOCK)
            if not np.array_equal(array[span], expected[span]):
                return False
    return True


def block_bytes(state, tensor: int, block: int) -> bytes:
    return bytes(state.backing[tensor][GUARD + block * BLOCK:GUARD + (block + 1) * BLOCK])


def push(state, remote_id: int, src: List[int], dst: List[int]) -> int:
    try:
        state.cm.push_blocks(BlocksCacheKey(remote_id, 0), state.cache, src, dst)
    except Exception as exc:  # the status is what the test looks at
        return int(getattr(exc, "status_code", -1))
    return 0


def pull(state, remote_id: int, src: List[int], dst: List[int]) -> int:
    try:
        state.cm.pull_blocks(BlocksCacheKey(remote_id, 0), state.cache, src, dst)
    except Exception as exc:
        return int(getattr(exc, "status_code", -1))
    return 0


def linked(state) -> List[int]:
    return state.dd.engine.links.linked_clusters()


def lost(state) -> Dict[int, str]:
    return state.dd.lost_links()


def data_plane(state, remote_id: int) -> str:
    return state.dd.engine.links.data_plane(remote_id)


def stats(state) -> Dict[str, int]:
    return dict(state.dd.engine.links.stats)


def pending_count(state) -> int:
    """Connections in their handshake at the listener."""
    return len(state.dd.engine.links.listener.pending())


def limit_descriptors(state, headroom: int) -> int:
    """Lower this process's descriptor limit to what it uses now plus ``headroom``."""
    used = len(os.listdir("/proc/self/fd"))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + headroom, hard))
    return used + headroom


def start(stack: ExitStack, cluster_id: int, listen: bool = False, secret=None, plane=None) -> Cluster:
    options = {} if secret is None else {"llm.LinkSecret": secret}
    return stack.enter_context(Cluster(cluster_id, "PROMPT" if listen else "DECODER", listen=listen, plane=plane,
                                       options=options, timeout=60.0))


@pytest.fixture(autouse=True)
def _no_inherited_secret(monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv("LLM_DATADIST_DATA_PLANE", raising=False)


# ==================================================================================================
# authentication
# ==================================================================================================

@pytest.mark.parametrize("plane", ["cma", "tcp"])
def test_same_secret_links_and_transfers(plane):
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True, secret=SECRET, plane=plane)
        client = start(stack, CLIENT_ID, secret=SECRET, plane=plane)
        server.call(register_guarded, 1)
        client.call(register_guarded, 2)
        assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert client.call(data_plane, SERVER_ID) == plane
        assert client.call(push, SERVER_ID, [0, 1], [4, 5]) == 0
        assert server.call(block_bytes, 0, 4) == client.call(block_bytes, 0, 0)
        assert client.call(pull, SERVER_ID, [2], [7]) == 0
        assert client.call(block_bytes, 1, 7) == server.call(block_bytes, 1, 2)
        assert server.call(untouched, [4, 5])


@pytest.mark.parametrize("server_secret, client_secret", [
    (SECRET, None), (None, SECRET), (SECRET, "another link secret"), ("another link secret", SECRET)])
def test_secret_mismatch_fails_the_link(server_secret, client_secret):
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True, secret=server_secret)
        client = start(stack, CLIENT_ID, secret=client_secret)
        server.call(register_guarded, 1)
        client.call(register_guarded, 2)
        assert link(client, server, 3000) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
        assert server.call(linked) == [] and client.call(linked) == []
        assert client.call(push, SERVER_ID, [0], [1]) == S.LLM_NOT_YET_LINK
        assert server.call(untouched)


def test_secret_from_the_environment(monkeypatch):
    monkeypatch.setenv(auth.SECRET_ENV, SECRET)
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        client = start(stack, CLIENT_ID)
        assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        # The option wins over the environment.
        other = start(stack, 3, secret="not the one, another secret")
        assert link(other, server, 3000) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])


def test_cpp_style_option_authenticates():
    from llm_datadist import cpp
    with ExitStack() as stack:
        server = stack.enter_context(Cluster(SERVER_ID, "PROMPT", listen=True, api="cpp",
                                             options={cpp.OPTION_LINK_SECRET: SECRET}))
        good = stack.enter_context(Cluster(CLIENT_ID, "DECODER", api="cpp", options={cpp.OPTION_LINK_SECRET: SECRET}))
        bad = stack.enter_context(Cluster(3, "DECODER", api="cpp"))
        assert link(good, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert link(bad, server, 3000) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])


@pytest.mark.parametrize("api", ["python", "cpp"])
@pytest.mark.parametrize("source", ["option", "environment"])
def test_a_short_secret_is_refused_at_init(api, source, monkeypatch):
    """A link secret is a key: one shorter than 16 bytes is refused at init (LLM_PARAM_INVALID,
    saying how to make a good one, never quoting it) in both API styles, from the option or the
    environment; the engine slot stays free, and 16 bytes are taken."""
    from llm_datadist import LLMConfig, LLMDataDist, LLMException, LLMRole, cpp

    def init(secret: str):
        if source == "environment":
            monkeypatch.setenv(auth.SECRET_ENV, secret)
        if api == "python":
            config = LLMConfig()
            config.device_id = 0
            if source == "option":
                config.link_secret = secret
            dd = LLMDataDist(LLMRole.PROMPT, 1)
            try:
                dd.init(config.generate_options())
            except LLMException as exc:
                return exc.status_code, str(exc), dd.finalize
            return S.LLM_SUCCESS, "", dd.finalize
        options = {cpp.OPTION_DEVICE_ID: "0"}
        if source == "option":
            options[cpp.OPTION_LINK_SECRET] = secret
        dd = cpp.LlmDataDist(1, cpp.LlmRole.kPrompt)
        return dd.Initialize(options), "", dd.Finalize  # (the C++ style answers a status only)

    for short in ("Q", "QUIXOTIC-PROOF!"):  # 1 and 15 bytes
        status, message, finalize = init(short)
        finalize()
        assert status == S.LLM_PARAM_INVALID, short
        if api == "python":
            assert "fewer than the 16" in message and "openssl rand -hex 32" in message, message
            assert short not in message
    status, _, finalize = init("sixteen bytes!!!")
    try:
        assert status == S.LLM_SUCCESS
    finally:
        finalize()


def _challenge(address, claim_auth: bool):
    sock = rawpeer.connect(address)
    nonce = os.urandom(auth.NONCE_BYTES).hex()
    sock.sendall(rawpeer.json_frame(wire.OP_HELLO, {"cluster_id": RAW_ID, "nonce": nonce, "auth": claim_auth}))
    op, status, _, payload = rawpeer.read_frame(sock)
    return sock, nonce, op, status, json.loads(payload)


def test_an_unauthenticated_peer_learns_nothing():
    """Without the secret a peer gets LLM_LINK_FAILED and no pid, host, table, cookie or token;
    a made-up proof, a proof replayed from another connection and the server's own proof
    reflected back are all refused; the server counts them and keeps serving."""
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True, secret=SECRET)
        server.call(register_guarded, 1)
        secret = SECRET.encode()
        # No secret at all: refused at the challenge, which says nothing about the process.
        sock, _, op, status, challenge = _challenge(server.address, False)
        assert (op, status) == (wire.OP_CHALLENGE, S.LLM_LINK_FAILED)
        assert set(challenge) <= {"cluster_id", "nonce", "auth", "error"}
        sock.settimeout(5)
        assert sock.recv(1) == b""  # closed after the refusal
        sock.close()
        # Claims to have one, sends garbage.
        with pytest.raises(rawpeer.Refused) as refused:
            rawpeer.handshake(rawpeer.connect(server.address), RAW_ID, rawpeer.link_request(), claim_auth=True,
                              proof="00" * 32)
        assert refused.value.status == S.LLM_LINK_FAILED
        assert set(refused.value.message) == {"error"}
        # A valid proof from one connection, replayed on another (fresh server nonce).
        sock, nonce, _, _, challenge = _challenge(server.address, True)
        old_proof = auth.proof(secret, "client", nonce, challenge["nonce"], RAW_ID, SERVER_ID)
        sock.close()
        sock2, _, _, _, _ = _challenge(server.address, True)
        sock2.sendall(rawpeer.json_frame(wire.OP_AUTH, dict(rawpeer.link_request(), proof=old_proof)))
        op, status, _, payload = rawpeer.read_frame(sock2)
        assert (op, status, set(json.loads(payload))) == (wire.OP_HELLO_REPLY, S.LLM_LINK_FAILED, {"error"})
        sock2.close()
        # The server's own proof reflected back as the client's.
        sock3, _, _, _, challenge = _challenge(server.address, True)
        sock3.sendall(rawpeer.json_frame(wire.OP_AUTH, dict(rawpeer.link_request(), proof=challenge["proof"])))
        op, status, _, _ = rawpeer.read_frame(sock3)
        assert status == S.LLM_LINK_FAILED
        sock3.close()
        assert server.call(stats)["auth_failures"] >= 4
        assert server.call(linked) == []
        # The real secret works (the raw peer computes the proof itself).
        peer = rawpeer.RawLink(server.address, RAW_ID, secret=secret)
        table = peer.table()
        assert "same_host" not in table  # a TCP peer never learns where our private words are
        peer.close()
        assert server.call(untouched)


def test_a_stranger_can_check_guesses_of_the_secret_against_the_servers_proof():
    """The limit of a secret (docs/security.md): the CHALLENGE carries the server's proof, an
    HMAC of the secret over what the stranger sees (both nonces, both cluster ids), before the
    stranger has proved anything. So whoever reaches the listener can test guesses of the secret
    offline against one answer; only a random secret holds."""
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True, secret=SECRET)
        sock, nonce, op, status, challenge = _challenge(server.address, True)  # claims a secret
        sock.close()  # and goes, having proved nothing
        assert (op, status) == (wire.OP_CHALLENGE, S.LLM_SUCCESS)

        def guessed(guess: str) -> bool:
            return auth.verify(guess.encode(), "server", nonce, challenge["nonce"], RAW_ID, SERVER_ID,
                               challenge.get("proof"))

        guesses = ["password", "correct horse battery", SECRET, "correct horse battery staples"]
        assert [g for g in guesses if guessed(g)] == [SECRET]


def test_server_proves_itself_to_the_client():
    """A listener that does not know the secret but answers with a made-up proof is refused by
    the client before it sends anything about itself."""
    listener = socket.create_server(("127.0.0.1", 0))
    received: List[bytes] = []

    def fake_server() -> None:
        conn, _ = listener.accept()
        with conn:
            op, _, _, payload = rawpeer.read_frame(conn)
            hello = json.loads(payload)
            conn.sendall(rawpeer.json_frame(wire.OP_CHALLENGE, {"cluster_id": SERVER_ID, "nonce": "ab" * 32,
                                                                "auth": True, "proof": "cd" * 32}))
            conn.settimeout(3)
            try:
                while True:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    received.append(chunk)
            except OSError:
                pass
            assert hello["auth"] is True

    thread = threading.Thread(target=fake_server, daemon=True)
    thread.start()
    try:
        with ExitStack() as stack:
            client = start(stack, CLIENT_ID, secret=SECRET)
            client.call(register_guarded, 2)
            status = client.call(_link_to, SERVER_ID, *listener.getsockname()[:2])
            assert status == S.LLM_LINK_FAILED
        thread.join(5)
        assert received == [], "the client sent its authentication to a server that failed to prove itself"
    finally:
        listener.close()


def _link_stats(state) -> Dict[str, int]:
    return state.dd.engine.link_stats()


def _link_as_version(state, version: int, remote_id: int, ip: str, port: int):
    """Link as a peer speaking protocol ``version`` (this process's frames say so from now on;
    its handshake is the same as every version's since 3): the status and what it logged."""
    import logging
    records: List[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("llm_datadist").addHandler(handler)
    wire.PROTOCOL_VERSION = version
    try:
        return _link_to(state, remote_id, ip, port), records
    finally:
        logging.getLogger("llm_datadist").removeHandler(handler)


def test_a_peer_of_another_protocol_version_is_told_both_versions():
    """A peer of an older or newer protocol version is refused at the handshake, and both sides
    say why in one line naming both versions: the server logs it, and the peer -- answered in its
    own version -- fails its link (LLM_LINK_FAILED) with it. The server keeps serving others."""
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        for version, cluster_id in ((4, 61), (wire.PROTOCOL_VERSION + 1, 62)):
            peer = start(stack, cluster_id)
            status, said = peer.call(_link_as_version, version, SERVER_ID, *server.address)
            assert status == S.LLM_LINK_FAILED
            line = f"refused: protocol version {version}, this side speaks {wire.PROTOCOL_VERSION}"
            assert [m for m in said if line in m], said
            assert server.call(_link_stats)["protocol_errors"] >= 1
        assert link(start(stack, 63), server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])


def _link_to(state, remote_id: int, ip: str, port: int) -> int:
    return int(state.dd.engine.links.link(remote_id, ip, port, 3000))


def test_warning_for_a_non_loopback_listener_without_secret(caplog):
    """Listening beyond loopback without a secret is logged (once); on loopback, or with a
    secret, it is not."""
    from llm_datadist import LLMConfig, LLMDataDist, LLMRole
    from llm_datadist.transport import sockets
    caplog.set_level("WARNING", logger="llm_datadist")
    sockets._warned.clear()
    for ip, secret, warned in [("127.0.0.1", None, False), ("0.0.0.0", SECRET, False), ("0.0.0.0", None, True)]:
        caplog.clear()
        config = LLMConfig()
        config.device_id = 0
        config.enable_cache_manager = True
        config.listen_ip_info = f"{ip}:0"
        config.link_secret = secret
        dd = LLMDataDist(LLMRole.PROMPT, 1)
        dd.init(config.generate_options())
        try:
            assert ("without a link secret" in caplog.text) == warned, (ip, secret, caplog.text)
        finally:
            dd.finalize()


# ==================================================================================================
# identity proven by the kernel
# ==================================================================================================

class ForgingPeer:
    """A raw link over the server's Unix socket whose reverse connection answers the server's
    requests: its table lists the server's own guard, secret and generation word, and replays
    the server's own probe cookie; the bytes of every PUSH it receives are recorded."""

    def __init__(self, address, server_addrs: Dict[str, int], server_table: bool = True) -> None:
        self.link = rawpeer.RawLink(address, RAW_ID, unix=True, planes=["cma", "tcp"],
                                    host={})  # a host identity claim is not needed, nor trusted
        mine = self.link.table()
        self.server_same_host = mine.get("same_host")
        forged_addrs = [server_addrs["guard"], server_addrs["secret"]]
        self.forged_table = {"generation": 1, "blocks": [[0, 1]], "keys": [],
                             "caches": [[1, "blocks", 0, 2, BLOCKS, BLOCK, forged_addrs, True]],
                             "same_host": dict(self.server_same_host or {})}
        self.pushed: List[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        sock = self.link.reverse
        try:
            while True:
                op, _, req_id, payload = rawpeer.read_frame(sock, timeout=30)
                if op == wire.OP_TABLE_GET:
                    body = json.dumps(self.forged_table).encode()
                    sock.sendall(rawpeer.frame(wire.OP_TABLE, body, req_id=req_id))
                elif op == wire.OP_PUSH:
                    self.pushed.append(payload)
                    sock.sendall(rawpeer.frame(wire.OP_PUSH_DONE, req_id=req_id))
                elif op == wire.OP_PULL:
                    # Send bytes of our choosing: they may only land where the server asked.
                    _, tag_len = wire.U64x2.unpack(payload[:16])
                    descs = payload[16 + tag_len:]
                    total = sum(wire.U64.unpack(descs[i + 16:i + 24])[0] for i in range(0, len(descs), 24))
                    sock.sendall(rawpeer.frame(wire.OP_PULL_DATA, b"\x66" * total, req_id=req_id))
                else:
                    return
        except (OSError, EOFError, ValueError):
            return

    def close(self) -> None:
        self.link.close()


def test_forged_table_and_replayed_identity_never_reach_unregistered_memory():
    """The finding: a peer replaying the server's own pid, cookie and generation fd, with a table
    of the server's own unregistered addresses, made the server write to and read from memory
    it never registered. Now the server learns the peer's pid from the kernel (the test
    process, not itself), so its probe of the replayed cookie fails, it uses TCP towards that
    peer, and its pushes and pulls touch only its own registered blocks."""
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        addrs = server.call(register_guarded, 1)
        peer = ForgingPeer(server.address, addrs)
        stack.callback(peer.close)
        assert peer.server_same_host is not None, "a Unix peer of this host gets the same-host details"
        assert server.call(data_plane, RAW_ID) == "tcp"
        assert server.call(push, RAW_ID, [0, 1], [2, 3]) == 0
        assert len(peer.pushed) == 1 and b"TOP-SECRET" not in peer.pushed[0]
        assert server.call(pull, RAW_ID, [0], [6]) == 0
        assert server.call(block_bytes, 0, 6) == b"\x66" * BLOCK  # only where it asked
        assert server.call(untouched, [6])


def test_same_host_plane_only_towards_the_proven_pid():
    """Between two real clusters on this host the plane is the same-host one (shm, which moves
    user memory through cma), and each side's proven peer pid is the other process (not a
    claim)."""
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        client = start(stack, CLIENT_ID)
        assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert client.call(_peer_pid, SERVER_ID) == server.pid
        assert server.call(_peer_pid, CLIENT_ID) == client.pid
        assert client.call(data_plane, SERVER_ID) == "shm" and server.call(data_plane, CLIENT_ID) == "shm"


def _peer_pid(state, remote_id: int) -> int:
    return state.dd.engine.links.peer(remote_id).pid


def test_connections_of_one_link_from_two_processes_are_refused():
    """The token binds a link's connections: one presented from another process (over the Unix
    socket, where the kernel names it) is refused and the half-made link dropped."""
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        first = rawpeer.connect(server.address)
        reply = rawpeer.handshake(first, RAW_ID, rawpeer.link_request(planes=["cma", "tcp"]))
        sock = rawpeer.connect(None, reply["unix"])
        rawpeer.handshake(sock, RAW_ID, {"purpose": "forward", "token": reply["token"]})
        other = stack.enter_context(Cluster(5, "DECODER"))
        status = other.call(_present_token, reply["unix"], reply["token"])
        assert status == S.LLM_LINK_FAILED
        first.close()
        assert wait_for(lambda: server.call(linked) == [])
        sock.close()


def _present_token(state, unix_name: str, token: str) -> int:
    sock = rawpeer.connect(None, unix_name)
    try:
        rawpeer.handshake(sock, RAW_ID, {"purpose": "reverse", "token": token})
    except rawpeer.Refused as exc:
        return exc.status
    finally:
        sock.close()
    return 0


# ==================================================================================================
# hijack
# ==================================================================================================

def test_a_second_hello_for_a_linked_cluster_cannot_hijack_it():
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        client = start(stack, CLIENT_ID)
        server.call(register_guarded, 1)
        client.call(register_guarded, 2)
        assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        for unix in (False, True):
            with pytest.raises(rawpeer.Refused) as refused:
                rawpeer.RawLink(server.address, CLIENT_ID, unix=unix, force_link=True)
            assert refused.value.status == S.LLM_ALREADY_LINK
        assert client.call(push, SERVER_ID, [0], [3]) == 0
        assert client.call(pull, SERVER_ID, [1], [4]) == 0
        # Once the legitimate client is gone (killed), its id may link again.
        client.kill()
        assert wait_for(lambda: server.call(linked) == [])
        assert CLIENT_ID in server.call(lost)
        peer = rawpeer.RawLink(server.address, CLIENT_ID)
        assert server.call(linked) == [CLIENT_ID]
        peer.close()


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no secret", "secret"])
def test_a_stranger_that_links_first_under_a_peers_id_keeps_it_out_only_without_a_secret(secret):
    """Deny by name: a raw peer links under the real client's cluster id before the client does.
    Without a secret it gets the link, and the real client's link fails with LLM_ALREADY_LINK for
    as long as the impostor's link lives; with one the impostor is refused (LLM_LINK_FAILED) and
    the real client links."""
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True, secret=secret)
        client = start(stack, CLIENT_ID, secret=secret)
        if secret is not None:
            with pytest.raises(rawpeer.Refused) as refused:
                rawpeer.RawLink(server.address, CLIENT_ID)
            assert refused.value.status == S.LLM_LINK_FAILED
            assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
            return
        answerer = rawpeer.ReverseAnswerer(json.dumps({"generation": 1, "caches": [], "blocks": [],
                                                       "keys": []}).encode())
        stack.callback(answerer.close)
        impostor = answerer.add(rawpeer.RawLink(server.address, CLIENT_ID, unix=True))
        stack.callback(impostor.close)
        assert server.call(linked) == [CLIENT_ID] and server.call(_peer_pid, CLIENT_ID) == os.getpid()
        for _ in range(2):
            assert link(client, server, 3000) == (S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK])
        assert server.call(_peer_pid, CLIENT_ID) == os.getpid()  # still the impostor's link
        impostor.close()
        assert wait_for(lambda: CLIENT_ID not in server.call(linked))
        assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert server.call(_peer_pid, CLIENT_ID) == client.pid


# ==================================================================================================
# the listener survives; handshakes, links and threads are bounded
# ==================================================================================================

def test_listener_survives_descriptor_exhaustion(monkeypatch):
    """With the server out of descriptors, accept() fails (EMFILE) for a while: the listener
    backs off and keeps going, and links again once the descriptors are back."""
    monkeypatch.setenv("LLM_DATADIST_HANDSHAKE_TIMEOUT_MS", str(SHORT_HANDSHAKE_MS))
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        server.call(limit_descriptors, 12)
        idle = []
        try:
            for _ in range(40):
                idle.append(socket.create_connection(server.address, timeout=2))
            assert wait_for(lambda: server.call(stats)["accept_errors"] > 0, 5)
        finally:
            for sock in idle:
                sock.close()
        # The idle ones time out of their handshake; the backlog drains; a real client links.
        client = start(stack, CLIENT_ID)
        assert wait_for(lambda: link(client, server, 2000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS]), 15)
        assert server.call(linked) == [CLIENT_ID]


def test_idle_and_unauthenticated_connections_time_out_and_are_capped(monkeypatch):
    """30 idle connections against 8 handshake slots: at most 8 are pending at once and 8 more wait
    for a slot (the waiting room is as large as the pool); the waiters take the slots of the oldest
    after the grace (250 ms), newcomers finding no room are closed at once, and the last 8 at the
    handshake deadline (600 ms), each without a byte; nothing is left behind."""
    monkeypatch.setenv("LLM_DATADIST_HANDSHAKE_TIMEOUT_MS", str(SHORT_HANDSHAKE_MS))
    monkeypatch.setenv("LLM_DATADIST_MAX_PENDING_HANDSHAKES", "8")
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        baseline = server.call(resources)
        started = time.monotonic()
        idle = [socket.create_connection(server.address, timeout=2) for _ in range(30)]
        try:
            most = 0
            def given_up() -> int:
                counted = server.call(stats)
                return counted["preauth_evicted"] + counted["refused_busy"]
            while given_up() < 22 and time.monotonic() - started < 10:
                most = max(most, server.call(pending_count))
            counted = server.call(stats)
            assert given_up() == 22 and counted["preauth_evicted"] >= 8 and 0 < most <= 8, counted
            for sock in idle:
                sock.settimeout(5)
                assert sock.recv(1) == b""
            assert time.monotonic() - started < 6
        finally:
            for sock in idle:
                sock.close()
        assert server.call(settle_to, baseline) == baseline
        client = start(stack, CLIENT_ID)
        assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])


def test_link_cap(monkeypatch):
    monkeypatch.setenv("LLM_DATADIST_MAX_LINKS", "3")
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        peers = [rawpeer.RawLink(server.address, 100 + i) for i in range(3)]
        with pytest.raises(rawpeer.Refused) as refused:
            rawpeer.RawLink(server.address, 200)
        assert refused.value.status == S.LLM_LINK_FAILED
        peers.pop().close()
        assert wait_for(lambda: len(server.call(linked)) == 2)
        peers.append(rawpeer.RawLink(server.address, 200))
        for peer in peers:
            peer.close()


def test_one_source_cannot_hold_every_pending_handshake(monkeypatch):
    """A stranger opening 70 connections from one address (127.0.0.2) that never say a word gets
    LLM_DATADIST_MAX_PENDING_PER_SOURCE (32) of the 64 pending-handshake places and as many places
    to wait for one: each waiter takes the place of an older one that has had the grace, the
    newcomers beyond are closed at once, so 38 are closed, without a byte, and counted; a client
    from another address (127.0.0.1) links meanwhile."""
    monkeypatch.setenv("LLM_DATADIST_HANDSHAKE_TIMEOUT_MS", "20000")  # the stranger's places stay held
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        client = start(stack, CLIENT_ID)
        idle = [rawpeer.connect(server.address, source="127.0.0.2") for _ in range(70)]
        try:
            assert link(client, server, 3000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
            def given_up() -> int:
                counted = server.call(stats)
                return counted["preauth_evicted"] + counted["refused_source"]
            assert wait_for(lambda: given_up() >= 70 - 32, 5), server.call(stats)
            readable, _, _ = select.select(idle, [], [], 0.5)  # the ones given up: closed, without a byte
            assert len(readable) == 70 - 32 and all(sock.recv(1) == b"" for sock in readable)
            assert idle[0] in readable  # the oldest gave its place up
            counted = server.call(stats)
            assert given_up() == 70 - 32 and counted["preauth_evicted"] >= 32 and counted["refused_busy"] == 0
        finally:
            for sock in idle:
                sock.close()


@pytest.mark.parametrize("over", ["tcp", "unix"])
def test_one_source_cannot_hold_every_link(monkeypatch, over):
    """Links are capped per source too (LLM_DATADIST_MAX_LINKS_PER_SOURCE, here 3 of 8): the
    fourth link request from one address (127.0.0.2), or from one uid over the Unix socket, is
    refused (LLM_LINK_FAILED, counted), while another source still links; a source whose link
    ends may link again."""
    monkeypatch.setenv("LLM_DATADIST_MAX_LINKS", "8")
    monkeypatch.setenv("LLM_DATADIST_MAX_LINKS_PER_SOURCE", "3")
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        other = rawpeer.RawLink(server.address, 99, source="127.0.0.3")  # learns the Unix socket's name
        stack.callback(other.close)
        unix_name = other.reply["unix"]
        extra = {"source": "127.0.0.2"} if over == "tcp" else {"first_unix": unix_name}
        flood = [rawpeer.RawLink(server.address, 100 + i, **extra) for i in range(3)]
        with pytest.raises(rawpeer.Refused) as refused:
            rawpeer.RawLink(server.address, 200, **extra)
        assert refused.value.status == S.LLM_LINK_FAILED and "per_source" in refused.value.message["error"].lower()
        assert server.call(stats)["refused_source_links"] == 1
        # Another source (the TCP address 127.0.0.1, or a TCP address for the uid's flood) links.
        stranger = rawpeer.RawLink(server.address, 201, source="127.0.0.1")
        stack.callback(stranger.close)
        flood.pop().close()
        assert wait_for(lambda: 102 not in server.call(linked))
        flood.append(rawpeer.RawLink(server.address, 202, **extra))
        for peer in flood:
            peer.close()


@pytest.mark.parametrize("secret", [None, SECRET])
def test_impostor_self_links_cannot_deny_the_real_one(secret):
    """Connections claiming the server's own cluster id (six, more than the four self-links a
    cluster may hold; with or without the link secret, with a forged proof) are refused and
    counted; the server's own link to its own listener still succeeds afterwards."""
    key = None if secret is None else secret.encode()
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True, secret=secret)
        impostors = []
        for i in range(6):
            changes = {"self_proof": "ab" * 32} if i % 2 else {}
            try:
                impostors.append(rawpeer.RawLink(server.address, SERVER_ID, secret=key, **changes))
            except rawpeer.Refused as exc:
                assert exc.status == S.LLM_LINK_FAILED
        try:
            assert impostors == [], "a connection of another process made a self-link"
            assert server.call(stats)["refused_self"] == 6
            assert link(server, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
            assert SERVER_ID in server.call(linked)
        finally:
            for peer in impostors:
                peer.close()


# ==================================================================================================
# reaping
# ==================================================================================================

def test_a_thousand_peers_come_and_go_and_nothing_grows():
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        server.call(register_guarded, 1)
        baseline = server.call(resources)
        for i in range(1000):
            peer = rawpeer.RawLink(server.address, 1000 + i, unix=bool(i % 2))
            if i % 100 == 0:
                assert 1000 + i in server.call(linked)
            peer.close()
        assert wait_for(lambda: server.call(linked) == [], 20)
        assert server.call(settle_to, baseline) == baseline
        assert len(server.call(lost)) == 1000
        assert server.call(untouched)


def test_killed_clients_are_reaped_on_both_planes():
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        server.call(register_guarded, 1)
        baseline = server.call(resources)
        clients = []
        for i, plane in enumerate(["cma", "tcp"] * 3):
            client = start(stack, 10 + i, plane=plane)
            client.call(register_guarded, 20 + i)
            assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
            assert client.call(push, SERVER_ID, [0], [1]) == 0
            clients.append(client)
        assert sorted(server.call(linked)) == [10 + i for i in range(6)]
        for client in clients:
            os.kill(client.pid, signal.SIGKILL)
        assert wait_for(lambda: server.call(linked) == [], 10)
        assert sorted(server.call(lost)) == [10 + i for i in range(6)]
        assert server.call(push, 10, [0], [1]) == S.LLM_LINK_FAILED
        assert server.call(settle_to, baseline) == baseline


def test_a_server_that_goes_away_is_reaped_by_its_client():
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        client = start(stack, CLIENT_ID)
        client.call(register_guarded, 2)
        server.call(register_guarded, 1)
        baseline = client.call(resources)
        assert link(client, server) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        server.kill()
        assert wait_for(lambda: client.call(linked) == [], 10)
        assert SERVER_ID in client.call(lost)
        assert client.call(push, SERVER_ID, [0], [1]) == S.LLM_LINK_FAILED
        assert client.call(settle_to, baseline) == baseline


# ==================================================================================================
# every refusal reaches the caller
# ==================================================================================================

def _refusing_server(status: int) -> rawpeer.RawServer:
    table = {"generation": 1, "blocks": [[0, 1]], "keys": [],
             "caches": [[1, "blocks", 0, 2, BLOCKS, BLOCK, [0x10000000, 0x20000000], True]]}

    def answer(op: int, payload: bytes):
        return (wire.OP_PUSH_DONE if op == wire.OP_PUSH else wire.OP_PULL_DATA), status, b""

    return rawpeer.RawServer(SERVER_ID, table, answer)


@pytest.mark.parametrize("refusal, expected", [
    (S.LLM_KV_CACHE_NOT_EXIST, S.LLM_KV_CACHE_NOT_EXIST), (S.LLM_PARAM_INVALID, S.LLM_PARAM_INVALID),
    (S.LLM_FAILED, S.LLM_FAILED), (S.LLM_TIMEOUT, S.LLM_TIMEOUT), (7777, S.LLM_FAILED),
    (wire.STATUS_STALE_TABLE, S.LLM_KV_CACHE_NOT_EXIST)])
def test_every_refusal_of_a_tcp_push_or_pull_reaches_the_caller(refusal, expected):
    """A server that refuses a push or pull, whatever the status, makes the call fail with it
    (an unknown status as LLM_FAILED; a table that stays stale as LLM_KV_CACHE_NOT_EXIST) --
    never a silent success; and the caller's own bytes are untouched."""
    server = _refusing_server(refusal)
    try:
        with ExitStack() as stack:
            client = start(stack, CLIENT_ID, plane="tcp")
            client.call(register_guarded, 2)
            assert client.call(_link_to, SERVER_ID, *server.address) == S.LLM_SUCCESS
            assert client.call(push, SERVER_ID, [0], [1]) == expected
            assert client.call(pull, SERVER_ID, [0], [1]) == expected
            assert client.call(untouched)
            ops = [op for op, _ in server.requests]
            assert wire.OP_PUSH in ops and wire.OP_PULL in ops
    finally:
        server.close()


# ==================================================================================================
# a peer of another user never gets the same-host plane
# ==================================================================================================

#: A raw peer in plain standard-library Python (it runs as another user, who cannot read this
#: checkout's interpreter or package): links over the server's Unix socket, answers the server's
#: table request with an honest table whose probe cookie really is its own memory, then waits.
OTHER_USER_PEER = r"""
import ctypes, json, os, socket, struct, sys
HEADER = struct.Struct("<4sHHIQQ")
MAGIC, VERSION = b"LLDD", int(sys.argv[3])
OP = dict(HELLO=1, HELLO_REPLY=2, TABLE_GET=3, TABLE=4, CHALLENGE=15, AUTH=16)
def send(sock, op, obj, req_id=1):
    body = json.dumps(obj).encode()
    sock.sendall(HEADER.pack(MAGIC, VERSION, op, 0, req_id, len(body)) + body)
def recv(sock):
    head = b""
    while len(head) < HEADER.size:
        chunk = sock.recv(HEADER.size - len(head))
        if not chunk:
            raise EOFError
        head += chunk
    _, _, op, status, req_id, length = HEADER.unpack(head)
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return op, status, req_id, json.loads(body) if body else {}
def handshake(sock, request):
    send(sock, OP["HELLO"], {"cluster_id": 88, "nonce": os.urandom(32).hex(), "auth": False})
    assert recv(sock)[1] == 0
    send(sock, OP["AUTH"], request)
    op, status, _, reply = recv(sock)
    assert status == 0, reply
    return reply
first = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
reply = handshake(first, {"purpose": "link", "role": "DECODER", "planes": ["cma", "tcp"], "host": {},
                          "remote_cache_accessible": True, "connections": [1, 1], "pid": os.getpid(),
                          "uid": os.getuid()})
conns = []
for purpose in ("forward", "reverse"):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + reply["unix"])
    handshake(sock, {"purpose": purpose, "token": reply["token"]})
    conns.append(sock)
first.close()
cookie = ctypes.c_uint64(0x1234567890ABCDEF)
counter = ctypes.c_uint64(1)
print("ready", flush=True)
reverse = conns[1]
while True:
    try:
        op, _, req_id, _ = recv(reverse)
    except (EOFError, OSError):
        break
    table = {"generation": 1, "caches": [], "blocks": [], "keys": [],
             "same_host": {"probe": [ctypes.addressof(cookie), cookie.value],
                           "generation_addr": ctypes.addressof(counter), "generation_fd": -1}}
    send(reverse, OP["TABLE"], table, req_id)
"""


def test_a_peer_of_another_user_gets_tcp():
    import pwd
    import shutil
    import subprocess
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or python is None:
        pytest.skip("needs root (to start a process as another user) and a system python3")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user")
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        proc = subprocess.Popen([python, "-c", OTHER_USER_PEER, str(server.address[1]), "unused",
                                 str(wire.PROTOCOL_VERSION)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd="/", env={"PATH": "/usr/bin:/bin"},
                                preexec_fn=lambda: (os.setgid(nobody.pw_gid), os.setuid(nobody.pw_uid)))
        stack.callback(lambda: (proc.kill(), proc.wait(5)))
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        assert server.call(_peer_uid, 88) == nobody.pw_uid
        assert server.call(data_plane, 88) == "tcp"
        # The same peer as this user would get cma: the probe is honest, only the user differs.
        assert server.call(_plane_if_same_user, 88) == "cma"


def _peer_uid(state, remote_id: int) -> int:
    return state.dd.engine.links.peer(remote_id).uid


def _plane_if_same_user(state, remote_id: int) -> str:
    links = state.dd.engine.links
    peer = links.peer(remote_id)
    _, info = links.plane_choice.fetch_table(peer, 3000)
    peer.uid = os.geteuid()
    return links.plane_choice.choose(peer, info).name


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no secret", "secret"])
def test_a_unix_connection_from_another_process_than_the_link_request_stated_is_refused(secret):
    """Protocol 8: a link request states the pid and uid of its process (signed with a secret), and
    the server takes the link's Unix connections only from that process (``SO_PEERCRED``) -- a
    relay that opens them on the real client's behalf is refused and the link is dropped. Here a
    raw client states its parent's pid and then opens the Unix connections itself."""
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True, secret=secret)
        key = None if secret is None else secret.encode()
        with pytest.raises(rawpeer.Refused) as refused:
            rawpeer.RawLink(server.address, 71, key, unix=True, pid=os.getppid())
        assert refused.value.status == S.LLM_LINK_FAILED
        assert refused.value.message["error"] == "a Unix connection from another process than the link's"
        assert wait_for(lambda: 71 not in server.call(linked))
        # Stating its own pid, the same raw client's Unix connections are taken.
        honest = rawpeer.RawLink(server.address, 72, key, unix=True)
        stack.callback(honest.close)
        assert [sock.family for sock in honest.sockets] == [socket.AF_UNIX] * 2
