"""A hand-written client of the link protocol (version 9), for tests that play a hostile or
broken peer: it speaks the handshake with plain blocking sockets and lets the test send any
frame afterwards. It shares no code with ``llm_datadist.transport.links`` (only the frame
constants and the HMAC proof and MAC functions), so a test built on it checks the server against the
protocol, not against itself.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import threading
from typing import Any, Dict, List, Optional, Tuple

from llm_datadist.transport import auth, wire

TIMEOUT_S = 5.0


def frame(op: int, payload: bytes = b"", length: Optional[int] = None, magic: bytes = wire.MAGIC,
          version: int = wire.PROTOCOL_VERSION, req_id: int = 1, status: int = 0) -> bytes:
    """A frame as the wire module would pack it, with any field overridable."""
    return wire.HEADER.pack(magic, version, op, status, req_id, len(payload) if length is None else length) + payload


def json_frame(op: int, message: Any, **kwargs) -> bytes:
    return frame(op, json.dumps(message).encode(), **kwargs)


def read_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError(f"connection closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def read_frame(sock: socket.socket, timeout: float = TIMEOUT_S) -> Tuple[int, int, int, bytes]:
    """One frame: ``(op, status, req_id, payload)``."""
    sock.settimeout(timeout)
    op, status, req_id, length = wire.unpack_header(read_exact(sock, wire.HEADER_BYTES))
    return op, status, req_id, read_exact(sock, length)


def connect(address, unix_name: Optional[str] = None, source: Optional[str] = None) -> socket.socket:
    """A TCP connection to ``address`` (from the local address ``source``, e.g. another loopback
    address such as 127.0.0.2), or one to the abstract Unix socket ``unix_name``."""
    if unix_name is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(TIMEOUT_S)
        sock.connect("\0" + unix_name)
        return sock
    return socket.create_connection(address, timeout=TIMEOUT_S,
                                    source_address=None if source is None else (source, 0))


class Refused(Exception):
    def __init__(self, stage: str, status: int, message: Dict[str, Any]) -> None:
        super().__init__(f"{stage} refused with status {status}: {message}")
        self.stage, self.status, self.message = stage, status, message


def handshake(sock: socket.socket, cluster_id: int, request: Dict[str, Any], secret: Optional[bytes] = None,
              claim_auth: Optional[bool] = None, proof: Optional[str] = None) -> Dict[str, Any]:
    """hello -> challenge -> auth -> reply; the reply, or ``Refused``. ``claim_auth`` and
    ``proof`` override what an honest client would send."""
    nonce = os.urandom(auth.NONCE_BYTES).hex()
    sock.sendall(json_frame(wire.OP_HELLO, {"cluster_id": cluster_id, "nonce": nonce,
                                            "auth": secret is not None if claim_auth is None else claim_auth}))
    op, status, _, payload = read_frame(sock)
    challenge = json.loads(payload)
    assert op == wire.OP_CHALLENGE, op
    if status != 0:
        raise Refused("hello", status, challenge)
    message = dict(request)
    if proof is not None:
        message["proof"] = proof
    elif secret is not None:
        message["proof"] = auth.proof(secret, "client", nonce, challenge["nonce"], cluster_id, challenge["cluster_id"])
    if secret is not None and "mac" not in message:  # protocol 8 signs what the AUTH message says
        message["mac"] = auth.message_mac(secret, "request", nonce, challenge["nonce"], cluster_id,
                                          challenge["cluster_id"], message)
    sock.sendall(json_frame(wire.OP_AUTH, message))
    op, status, _, payload = read_frame(sock)
    reply = json.loads(payload)
    assert op == wire.OP_HELLO_REPLY, op
    if status != 0:
        raise Refused("authentication", status, reply)
    reply["_challenge"] = challenge
    return reply


def link_request(**changes) -> Dict[str, Any]:
    request = {"purpose": "link", "role": "DECODER", "planes": ["tcp"], "host": {}, "remote_cache_accessible": True,
               "connections": [1, 1], "force_link": True, "pid": os.getpid(), "uid": os.getuid()}
    request.update(changes)
    return request


class RawLink:
    """A link made by hand: ``forward`` connections (this side's requests; ``sock`` is the first,
    ``forwards`` all of them) and one reverse connection (never served: the server's own requests
    would wait on it)."""

    def __init__(self, address, cluster_id: int, secret: Optional[bytes] = None, unix: bool = False,
                 source: Optional[str] = None, first_unix: Optional[str] = None, forward: int = 1,
                 **changes) -> None:
        """``source``: the local address of its TCP connections; ``first_unix``: send the link
        request over this abstract Unix socket rather than TCP."""
        self.cluster_id = cluster_id
        first = connect(address, first_unix, source)
        self.sockets: List[socket.socket] = []
        try:
            self.reply = handshake(first, cluster_id, link_request(**dict({"connections": [forward, 1]}, **changes)),
                                   secret)
            unix_name = self.reply.get("unix") if unix else None
            for purpose in ["forward"] * forward + ["reverse"]:
                sock = connect(address, unix_name, source)
                self.sockets.append(sock)
                handshake(sock, cluster_id, {"purpose": purpose, "token": self.reply["token"]}, secret)
        except BaseException:
            self.close()
            raise
        finally:
            first.close()
        self.forwards, self.reverse = self.sockets[:-1], self.sockets[-1]
        self.sock = self.forwards[0]
        self.next_id = 2

    def request(self, op: int, payload: bytes = b"", length: Optional[int] = None) -> int:
        req_id = self.next_id
        self.next_id += 1
        self.sock.sendall(frame(op, payload, length, req_id=req_id))
        return req_id

    def table(self) -> Dict[str, Any]:
        req_id = self.request(wire.OP_TABLE_GET, b"{}")
        op, status, rid, payload = read_frame(self.sock)
        assert (op, status, rid) == (wire.OP_TABLE, 0, req_id)
        return json.loads(payload)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


class ReverseAnswerer:
    """One thread answering the server's requests on the reverse connections of raw links (each
    added with ``add`` as soon as it is made: the server asks for the peer's table right after
    the link), as each link's peer would: a table request with ``table`` (JSON bytes, encoded
    once), an unlink with UNLINK_DONE. ``answered`` counts the table replies; ``close()`` stops
    it."""

    def __init__(self, table: bytes) -> None:
        self.table, self.answered = table, 0
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def add(self, link: RawLink) -> RawLink:
        self._selector.register(link.reverse, selectors.EVENT_READ)
        return link

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.05):
                sock = key.fileobj
                try:
                    op, _, req_id, _ = read_frame(sock)
                    if op == wire.OP_TABLE_GET:
                        sock.sendall(frame(wire.OP_TABLE, self.table, req_id=req_id))
                        self.answered += 1
                    elif op == wire.OP_UNLINK:
                        sock.sendall(frame(wire.OP_UNLINK_DONE, req_id=req_id))
                except (OSError, EOFError, ValueError):
                    self._selector.unregister(sock)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._selector.close()


class RawServer:
    """A hand-made server: it completes the handshake (no secret, TCP only) for cluster
    ``cluster_id``, answers table requests with ``table`` and every other request on a forward
    connection with ``answer(op, payload) -> (reply op, status, reply payload)``."""

    def __init__(self, cluster_id: int, table: Dict[str, Any], answer) -> None:
        self.cluster_id, self.table, self.answer = cluster_id, table, answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.requests: List[Tuple[int, bytes]] = []
        self._socks: List[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self._socks.append(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            _, _, _, payload = read_frame(conn)
            conn.sendall(json_frame(wire.OP_CHALLENGE, {"cluster_id": self.cluster_id, "nonce": "ab" * 32,
                                                        "auth": False}))
            _, _, _, payload = read_frame(conn)
            request = json.loads(payload)
            reply: Dict[str, Any] = {"cluster_id": self.cluster_id}
            if request["purpose"] == "link":
                reply.update(role="PROMPT", planes=["tcp"], host={}, remote_cache_accessible=True, token="t" * 32,
                             unix=None, pid=os.getpid(), uid=os.getuid())
            conn.sendall(json_frame(wire.OP_HELLO_REPLY, reply))
            if request["purpose"] != "forward":
                conn.settimeout(None)
                while conn.recv(65536):  # hold it open until the client closes it
                    pass
                return
            while True:
                op, _, req_id, payload = read_frame(conn, timeout=60)
                self.requests.append((op, payload))
                if op == wire.OP_TABLE_GET:
                    conn.sendall(json_frame(wire.OP_TABLE, self.table, req_id=req_id))
                    continue
                reply_op, status, body = self.answer(op, payload)
                conn.sendall(frame(reply_op, body, req_id=req_id, status=status))
        except (OSError, EOFError, ValueError, KeyError):
            return
        finally:
            conn.close()

    def close(self) -> None:
        self._stop = True
        self.listener.close()
        for sock in self._socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
