"""Link protection (``llm.LinkProtection``): records sealed with keys of each connection's own
handshake. Unit tests of the records, then real clusters linked through a man in the middle on
loopback that records what crosses and flips one byte of a push: unprotected, the flip lands
silently in the destination block; under ``integrity`` and ``encrypt`` the push fails, the link
closes, nothing outside the asked-for blocks changes and the failure is counted."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from contextlib import ExitStack
from typing import List, Optional

import pytest

from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.testing import Cluster
from llm_datadist.transport import auth, handshake, protection, wire
from llm_datadist.transport import deadline as dl

from cluster_ops import resources, settle_to, wait_for
from rawpeer import read_exact
from test_security import (BLOCK, CLIENT_ID, SECRET, SERVER_ID, block_bytes, lost, pull, push, register_guarded,
                           stats, untouched)

S = LLMStatusCode
MODES = [protection.INTEGRITY, protection.ENCRYPT]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (auth.SECRET_ENV, protection.ENV, "LLM_DATADIST_DATA_PLANE"):
        monkeypatch.delenv(name, raising=False)


# -- records -----------------------------------------------------------------------------------------

SUITES = [protection.GCM, protection.GMAC, protection.HMAC]


def pair(suite: str):
    keys = protection.derive_keys(b"k" * 16, suite, "11" * 32, "22" * 32, 1, 2)
    return protection.Sealer(suite, keys[0]), protection.Sealer(suite, keys[0])


def sealed(sealer: protection.Sealer, message: bytes) -> bytes:
    return b"".join(bytes(part) for part in sealer.seal(memoryview(message)))


def opened(opener: protection.Sealer, record: bytes):
    size = protection.RECORD_HEADER.size
    result = opener.open(record[:size], memoryview(bytearray(record[size:])))
    return None if result is None else bytes(result)


@pytest.mark.parametrize("suite", SUITES)
def test_records_open_in_order_and_hide_their_plaintext_when_encrypted(suite):
    sealer, opener = pair(suite)
    messages = [os.urandom(n) for n in (1, 4096, protection.MAX_RECORD)]
    records = [sealed(sealer, m) for m in messages]
    for message, record in zip(messages, records):
        assert len(record) == protection.RECORD_HEADER.size + len(message) + opener.tag_bytes
        if len(message) >= 16:  # (a 1-byte message turns up in a random record one time in ten)
            assert (message in record) == (suite != protection.GCM)
        assert opened(opener, record) == message


@pytest.mark.parametrize("suite", SUITES)
def test_every_flipped_bit_replayed_or_reordered_record_fails(suite):
    sealer, _ = pair(suite)
    first, second = sealed(sealer, b"A" * 100), sealed(sealer, b"B" * 100)
    for position in range(0, len(first), 7):
        for bit in (0, 7):
            forged = bytearray(first)
            forged[position] ^= 1 << bit
            _, opener = pair(suite)
            assert opened(opener, bytes(forged)) is None, (position, bit)
    _, opener = pair(suite)
    assert opened(opener, second) is None          # out of order
    _, opener = pair(suite)
    assert opened(opener, first) == b"A" * 100
    assert opened(opener, first) is None           # replayed


@pytest.mark.parametrize("suite", SUITES)
def test_keys_differ_per_direction_connection_and_suite(suite):
    base = protection.derive_keys(b"secret", suite, "11" * 32, "22" * 32, 1, 2)
    assert base[0] != base[1]
    assert base != protection.derive_keys(b"secret", suite, "11" * 32, "33" * 32, 1, 2)
    assert base != protection.derive_keys(b"secret", suite, "11" * 32, "22" * 32, 1, 3)
    assert base != protection.derive_keys(b"other", suite, "11" * 32, "22" * 32, 1, 2)
    for other in SUITES:
        if other != suite:
            assert base != protection.derive_keys(b"secret", other, "11" * 32, "22" * 32, 1, 2)


def test_the_suite_is_the_modes_first_that_both_sides_run(monkeypatch):
    assert protection.choose(protection.INTEGRITY, SUITES) == protection.GMAC
    assert protection.choose(protection.INTEGRITY, [protection.HMAC]) == protection.HMAC  # a client without AES
    assert protection.choose(protection.ENCRYPT, SUITES) == protection.GCM
    assert protection.choose(protection.ENCRYPT, [protection.HMAC]) is None
    assert protection.choose(protection.INTEGRITY, ["rot13"]) is None
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)  # not installed
    assert protection.suites_here() == [protection.HMAC]
    assert protection.choose(protection.INTEGRITY, SUITES) == protection.HMAC


@pytest.mark.parametrize("suite", SUITES)
def test_two_relays_carry_a_stream_both_ways_and_close_like_tcp(suite):
    """Two relays over a loopback TCP connection: what one side's link writes, the other's reads,
    in order, in both directions; closing one inner end reaches the other as an end of stream
    after everything sent before it."""
    from llm_datadist.transport.threads import Threads
    listener = socket.create_server(("127.0.0.1", 0))
    client_sock = socket.create_connection(listener.getsockname())
    server_sock, _ = listener.accept()
    listener.close()
    keys = protection.derive_keys(b"s", suite, "11" * 32, "22" * 32, 1, 2)
    threads, failures = Threads("llm_datadist-seal"), []
    client = protection.Relay(client_sock, suite, keys, True, "client", threads, failures.append)
    server = protection.Relay(server_sock, suite, keys, False, "server", threads, failures.append)
    client.start()
    server.start()
    assert not client.inner.getblocking()  # as the link's own sockets; blocking for this test's reads
    for relay in (client, server):
        relay.inner.setblocking(True)
    payload = os.urandom(3 * protection.MAX_RECORD + 12345)
    got = bytearray()

    def read_all():
        while True:
            chunk = server.inner.recv(1 << 20)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=read_all)
    reader.start()
    client.inner.sendall(payload)
    server.inner.sendall(b"answer")
    client.inner.shutdown(socket.SHUT_WR)
    reader.join(20)
    assert bytes(got) == payload and not failures
    assert client.inner.recv(16) == b"answer"
    server.inner.close()
    assert client.inner.recv(16) == b""  # the end of stream came through
    client.inner.close()
    threads.join(10)
    assert not any(t.is_alive() for t in threading.enumerate() if t.name == "llm_datadist-seal")


def test_the_setting_is_checked_when_the_engine_starts(monkeypatch):
    assert protection.resolve({}, None) == protection.OFF
    assert protection.resolve({protection.OPTION: "Integrity"}, b"s") == protection.INTEGRITY
    monkeypatch.setenv(protection.ENV, "encrypt")
    assert protection.resolve({}, b"s") == protection.ENCRYPT
    assert protection.resolve({protection.OPTION: "off"}, b"s") == protection.OFF  # the option wins
    for options, secret, words in (({protection.OPTION: "tls"}, b"s", "expected one of"),
                                   ({protection.OPTION: "integrity"}, None, "needs a link secret")):
        with pytest.raises(LLMException, match=words) as caught:
            protection.resolve(options, secret)
        assert caught.value.status_code == S.LLM_PARAM_INVALID
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)  # not installed
    with pytest.raises(LLMException, match="cryptography") as caught:
        protection.resolve({protection.OPTION: "encrypt"}, b"s")
    assert caught.value.status_code == S.LLM_PARAM_INVALID
    assert protection.resolve({protection.OPTION: "integrity"}, b"s") == protection.INTEGRITY


def test_a_reply_granting_less_than_asked_fails_the_link():
    """A server (or a man in the middle) answering ``off`` to a request for integrity."""
    ours, theirs = socket.socketpair()
    granted: List[dict] = []

    def serve():
        admission = handshake.accept_hello(theirs, 1, b"s", dl.after(5000))
        granted.append(admission.request)
        reply = handshake.link_reply(1, "PROMPT", ["tcp"], False, "t" * 32, None, protection.OFF)
        handshake.send_reply(theirs, handshake.signed_reply(b"s", admission, reply), 0, dl.after(5000))

    server = threading.Thread(target=serve)
    server.start()
    try:
        with pytest.raises(LLMException, match="granted protection off, this side asked for integrity"):
            handshake.request_link(ours, 2, b"s", 1, "DECODER", ["tcp"], False, False, dl.after(5000),
                                   protect=protection.INTEGRITY)
    finally:
        server.join(10)
        ours.close()
        theirs.close()
    assert granted[0]["protection"] == protection.INTEGRITY
    assert handshake.read_link_request(dict(granted[0])).protection == protection.INTEGRITY
    with pytest.raises(wire.ProtocolError):
        handshake.read_link_request(dict(granted[0], protection="tls"))


# -- a man in the middle ----------------------------------------------------------------------------

class Middle:
    """A TCP relay on 127.0.0.1 in front of ``target``: keeps what each connection sent towards
    the server and, when ``flip_at`` is set, flips the byte at that offset of the first
    client-to-server stream that gets that far."""

    def __init__(self, target, flip_at: Optional[int] = None) -> None:
        self.target = target
        self.flip_at = flip_at
        self.flipped = 0
        self.seen: List[bytearray] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()
        self._sockets: List[socket.socket] = [self._listener]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            seen = bytearray()
            with self._lock:
                self._sockets += [client, server]
                self.seen.append(seen)
            for args in ((client, server, seen), (server, client, None)):
                thread = threading.Thread(target=self._pump, args=args, daemon=True)
                thread.start()
                self._threads.append(thread)

    def _pump(self, source: socket.socket, sink: socket.socket, seen: Optional[bytearray]) -> None:
        try:
            while True:
                data = bytearray(source.recv(1 << 16))
                if not data:
                    break
                if seen is not None:
                    start = len(seen)
                    with self._lock:
                        if self.flip_at is not None and not self.flipped and start <= self.flip_at < start + len(data):
                            data[self.flip_at - start] ^= 0x40
                            self.flipped += 1
                    seen += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for thread in self._threads:
            thread.join(5)


def start(stack: ExitStack, cluster_id: int, mode: Optional[str], listen: bool = False,
          secret: Optional[str] = SECRET) -> Cluster:
    options = {}
    if secret is not None:
        options["llm.LinkSecret"] = secret
    if mode is not None:
        options[protection.OPTION] = mode
    return stack.enter_context(Cluster(cluster_id, "PROMPT" if listen else "DECODER", listen=listen, plane="tcp",
                                       options=options, timeout=60.0))


def link_through(client: Cluster, server: Cluster, middle: Middle):
    from llm_datadist.testing import _link
    return client.call(_link, server.cluster_id, *middle.address, 5000)


def link_protection(state, remote_id: int) -> str:
    return state.dd.engine.links._peers[remote_id].protection


@pytest.mark.parametrize("mode", [None, *MODES])
def test_a_byte_flipped_on_the_way_is_caught_only_with_protection(mode):
    """Eight blocks of 4 KiB in each of two tensors make a 64 KiB push; the byte at 40,000 of the
    client's first data connection lies in its payload whatever the handshake's length."""
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, mode, listen=True)
        client = start(stack, CLIENT_ID, None)  # the server alone insists: the link takes its setting
        server.call(register_guarded, 1)
        client.call(register_guarded, 2)
        middle = Middle(server.address, flip_at=40_000)
        stack.callback(middle.close)
        assert link_through(client, server, middle) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert client.call(link_protection, SERVER_ID) == (mode or protection.OFF)
        status = client.call(push, SERVER_ID, list(range(8)), list(range(8)))
        assert middle.flipped == 1
        if mode is None:  # the threat: the flipped byte lands and nobody knows
            assert status == 0
            differs = [b for b in range(8) if server.call(block_bytes, 0, b) != client.call(block_bytes, 0, b)
                       or server.call(block_bytes, 1, b) != client.call(block_bytes, 1, b)]
            assert len(differs) == 1
            return
        assert status == S.LLM_LINK_FAILED
        assert wait_for(lambda: SERVER_ID in client.call(lost) and CLIENT_ID in server.call(lost))
        assert server.call(stats)["protection_failures"] == 1
        assert server.call(untouched, list(range(8)))  # guards and the secret buffer as they were


@pytest.mark.parametrize("mode", [None, *MODES])
def test_protected_links_move_exact_bytes_and_encrypt_hides_them(mode):
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, None, listen=True)
        client = start(stack, CLIENT_ID, mode)  # the client alone insists
        server.call(register_guarded, 1)
        client.call(register_guarded, 2)
        middle = Middle(server.address)
        stack.callback(middle.close)
        baselines = client.call(resources), server.call(resources)
        assert link_through(client, server, middle) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert server.call(link_protection, CLIENT_ID) == (mode or protection.OFF)
        relays = 8 if mode else 0  # two relay threads a connection
        assert client.call(resources)["threads"] >= baselines[0]["threads"] + relays
        assert client.call(push, SERVER_ID, [0, 1, 2], [5, 6, 7]) == 0
        assert client.call(pull, SERVER_ID, [3], [4]) == 0
        for src, dst in ((0, 5), (1, 6), (2, 7)):
            assert server.call(block_bytes, 0, dst) == client.call(block_bytes, 0, src)
            assert server.call(block_bytes, 1, dst) == client.call(block_bytes, 1, src)
        assert client.call(block_bytes, 1, 4) == server.call(block_bytes, 1, 3)
        assert server.call(untouched, [5, 6, 7]) and client.call(untouched, [4])
        pushed = client.call(block_bytes, 0, 0)
        assert len(pushed) == BLOCK
        crossed = b"".join(bytes(s) for s in middle.seen)
        assert (pushed[:64] in crossed) == (mode != protection.ENCRYPT)
        # unlinking releases the relays: threads and descriptors back where they were, both sides
        assert client.call(_unlink, SERVER_ID) == 0
        assert client.call(settle_to, baselines[0]) == baselines[0]
        assert server.call(settle_to, baselines[1]) == baselines[1]


def _unlink(state, remote_id: int) -> int:
    return int(state.dd.engine.links.unlink(remote_id, 2000, force=False))


def test_protection_needs_the_secret_on_both_sides_and_a_refused_mode_says_why():
    with ExitStack() as stack:
        with pytest.raises(Exception, match="needs a link secret"):
            start(stack, SERVER_ID, protection.INTEGRITY, listen=True, secret=None)


def test_llm_config_sets_the_option():
    from llm_datadist import LLMConfig
    config = LLMConfig()
    assert protection.OPTION not in config.generate_options()
    config.link_protection = "encrypt"
    assert config.generate_options()[protection.OPTION] == "encrypt"
    with pytest.raises(TypeError):
        config.link_protection = 1


def _relay_and_raw_peer(suite: str = protection.GMAC, failures: Optional[list] = None):
    """A client relay over loopback TCP whose other end is a raw socket (the test is the peer)."""
    from llm_datadist.transport.threads import Threads
    listener = socket.create_server(("127.0.0.1", 0))
    ours = socket.create_connection(listener.getsockname())
    theirs, _ = listener.accept()
    listener.close()
    keys = protection.derive_keys(b"s", suite, "11" * 32, "22" * 32, 1, 2)
    threads = Threads("llm_datadist-seal")
    relay = protection.Relay(ours, suite, keys, True, "relay", threads,
                             (failures if failures is not None else []).append)
    relay.start()
    return relay, theirs, threads


def _relay_threads() -> int:
    return sum(t.name == "llm_datadist-seal" for t in threading.enumerate())


def test_a_peer_that_stops_reading_holds_the_relay_no_longer_than_the_linger(monkeypatch):
    """The relay's sends never block for good: once the link closed its end, a peer that takes
    nothing (a full window) has LINGER_S, then the relay ends and lets everything go."""
    monkeypatch.setattr(protection, "LINGER_S", 1.0)
    before = _relay_threads()
    relay, theirs, threads = _relay_and_raw_peer()
    try:
        chunk, written = b"x" * (1 << 20), 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # fill the pair, the relay's buffers and the TCP window
            try:
                written += relay.inner.send(chunk)
            except BlockingIOError:
                time.sleep(0.2)
                try:
                    written += relay.inner.send(chunk)
                except BlockingIOError:
                    break
        assert written > (1 << 20)
        relay.inner.close()  # the link is done with the connection; the peer still reads nothing
        started = time.monotonic()
        assert wait_for(lambda: _relay_threads() == before, 10)
        assert time.monotonic() - started < 1.0 + 3.0
        threads.join(1)
    finally:
        theirs.close()


def test_frames_sent_unsealed_to_a_protected_connection_are_refused_by_name():
    failures: list = []
    relay, theirs, threads = _relay_and_raw_peer(failures=failures)
    try:
        theirs.sendall(wire.pack_header(wire.OP_TABLE_GET, 1, 2) + b"{}")
        assert wait_for(lambda: failures != [], 5)
        assert "unsealed" in failures[0]
        relay.inner.setblocking(True)
        relay.inner.settimeout(5)
        assert relay.inner.recv(100) == b""  # nothing of it reached the link
    finally:
        relay.inner.close()
        theirs.close()
        threads.join(5)


def test_an_old_cryptography_without_encrypt_into_cannot_encrypt(monkeypatch):
    import types
    old = types.ModuleType("aead")
    old.AESGCM = type("AESGCM", (), {"encrypt": None, "decrypt": None})
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", old)
    assert protection.suites_here() == [protection.HMAC]
    with pytest.raises(LLMException, match="encrypt_into"):
        protection.resolve({protection.OPTION: "encrypt"}, b"s")


def test_a_thread_that_cannot_start_is_not_left_to_join(monkeypatch):
    from llm_datadist.transport.threads import Threads
    group = Threads("llm_datadist-test")

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError):
        group.spawn(lambda: None)
    monkeypatch.undo()
    group.join(1)  # nothing unstarted to join (joining one raises)


class RewritingMiddle(Middle):
    """A ``Middle`` that rewrites the JSON of the first connection's AUTH frame (the link request)
    with ``rewrite`` before passing it on, its header's length fixed to match."""

    def __init__(self, target, rewrite) -> None:
        self.rewrite = rewrite
        self.rewritten = 0
        super().__init__(target)

    def _pump(self, source: socket.socket, sink: socket.socket, seen: Optional[bytearray]) -> None:
        if seen is not None and not self.rewritten:
            self.rewritten = 1
            try:
                for _ in range(2):  # HELLO as it is, then AUTH rewritten
                    header = read_exact(source, wire.HEADER_BYTES)
                    magic, version, op, status, req_id, length = wire.HEADER.unpack(header)
                    body = read_exact(source, length)
                    if op == wire.OP_AUTH:
                        body = wire.encode_json(self.rewrite(wire.decode_json(body)))
                    sink.sendall(wire.HEADER.pack(magic, version, op, status, req_id, len(body)) + body)
            except (OSError, EOFError):
                return
        super()._pump(source, sink, seen)


@pytest.mark.parametrize("field, value", [("suites", ["hmac-sha256"]), ("planes", ["tcp", "cma"])])
def test_a_link_request_changed_on_the_way_is_refused_at_the_handshake(field, value):
    """The link request travels unsealed, before any key exists, but signed (protocol 8: its MAC
    under the secret), so a man in the middle that changes it -- here talking an integrity link
    down from GMAC to HMAC, or changing the planes offered -- is refused before any connection of
    the link opens (counted as a failed authentication), never given a link that works on what it
    chose. (Before protocol 8 the keys' ``link_digest`` caught it at the first record.)"""
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, protection.INTEGRITY, listen=True)
        client = start(stack, CLIENT_ID, protection.INTEGRITY)
        middle = RewritingMiddle(server.address, lambda request: dict(request, **{field: value}))
        stack.callback(middle.close)
        status = link_through(client, server, middle)
        assert middle.rewritten == 1
        assert status != (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert wait_for(lambda: server.call(stats)["auth_failures"] >= 1)
        assert CLIENT_ID not in server.call(linked_ids)


def linked_ids(state):
    return state.dd.engine.links.linked_clusters()


# -- a same-host relay that points the link's Unix connections at itself (issue 32, defect 1) -------

RELAY_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "relay_child.py")


def start_relay(stack: ExitStack, server_port: int, uid: Optional[int], folder) -> int:
    """``relay_child.py`` in front of the server's TCP port, as ``uid`` (None: this user, this
    Python; another uid runs a copy in ``folder`` with the system's python3), capturing into
    ``folder / "capture"``; its port."""
    import select
    import shutil
    import subprocess
    script, python = RELAY_CHILD, sys.executable
    if uid is not None:
        script, python = str(folder / "relay_child.py"), shutil.which("python3", path="/usr/bin:/bin")
        shutil.copy(RELAY_CHILD, script)
        os.chmod(script, 0o644)
        os.chown(folder / "capture", uid, -1)
    process = subprocess.Popen([python, script, str(server_port), str(folder / "capture")], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, user=uid, cwd="/", env={"PATH": "/usr/bin:/bin"})

    def stop() -> None:
        process.kill()
        process.wait(10)
        process.stdout.close()
    stack.callback(stop)
    ready, _, _ = select.select([process.stdout], [], [], 20)
    assert ready, "the relay did not start"
    return int(process.stdout.readline())


def unix_link(state, remote_id: int) -> bool:
    return state.dd.engine.links._peers[remote_id].unix


@pytest.mark.parametrize("uid", [None, 65534], ids=["relay of the same user", "relay as uid 65534"])
@pytest.mark.parametrize("mode", MODES)
def test_a_relay_cannot_point_a_protected_links_unix_connections_at_itself(mode, uid):
    """Seen at protocol 7: a relay on the link's TCP path rewrote the reply's Unix socket name to a
    socket of its own relayed to the real one; the link came up over Unix connections, unsealed,
    and the relay read every pulled block. Now the reply is signed: the link fails before any data
    connection is opened, nothing crosses the relay's socket, and a direct link still works."""
    import shutil
    if uid is not None and (os.geteuid() != 0 or shutil.which("python3", path="/usr/bin:/bin") is None):
        pytest.skip("running the relay as another uid needs root and a system python3")
    import pathlib
    import tempfile
    with ExitStack() as stack:
        folder = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory()))  # (pytest's tmp_path is 0700)
        os.chmod(folder, 0o755)
        capture = folder / "capture"
        capture.touch()
        options = {"llm.LinkSecret": SECRET, protection.OPTION: mode}
        server = stack.enter_context(Cluster(SERVER_ID, "PROMPT", listen=True, options=options, timeout=60.0))
        client = stack.enter_context(Cluster(CLIENT_ID, "DECODER", options=options, timeout=60.0))
        server.call(register_guarded, 1)
        client.call(register_guarded, 2)
        port = start_relay(stack, server.address[1], uid, folder)
        from llm_datadist.testing import _link
        status = client.call(_link, SERVER_ID, "127.0.0.1", port, 5000)
        if status == (S.LLM_SUCCESS, [S.LLM_SUCCESS]):  # (protocol 7) show what the relay got
            client.call(pull, SERVER_ID, [0, 1], [0, 1])
        seen = capture.read_bytes()
        secret_block = server.call(block_bytes, 0, 1)
        read_in_clear = secret_block in seen
        assert not read_in_clear, "the relay read a pulled block in the clear"
        assert status != (S.LLM_SUCCESS, [S.LLM_SUCCESS]) and seen == b""
        assert wait_for(lambda: SERVER_ID not in client.call(linked_ids))
        # The same clusters link directly, over their Unix socket, and move exact bytes.
        assert client.call(_link, SERVER_ID, *server.address, 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert client.call(unix_link, SERVER_ID)
        assert client.call(pull, SERVER_ID, [1], [5]) == 0
        assert client.call(block_bytes, 0, 5) == secret_block
