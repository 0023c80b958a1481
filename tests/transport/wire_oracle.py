"""A reference reading of the link protocol (version 6) by a server: given every byte a peer
sends on one connection, which frames the server must answer and how, how the connection must
end, which counters move, and which bytes of registered memory the peer may have written.

It is the oracle of the wire fuzzer (``test_fuzz_wire.py``). It is written from the frame format
(``transport/wire.py``) and the server's documented behaviour, and shares no code with
``transport/links.py``: only the frame constants, the status codes and the HMAC proof function
(what a peer computes anyway). The memory it reasons about is a ``Shadow`` copy of the server's
buffers, written only by pushes that the protocol lets through: every descriptor wholly inside
one registered tensor, planned against the current table generation.

The server reads a connection whose peer has already sent everything and shut down its side, so
there is no timing in this model: a frame that stops short is a truncated frame.
"""

from __future__ import annotations

import bisect
import hmac
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from llm_datadist.status import LLMStatusCode
from llm_datadist.transport import auth, budgets, wire
from llm_datadist.transport.protection import suites_here

S = LLMStatusCode
U64_MAX = 2**64 - 1
DESC = struct.Struct("<QQQ")
#: Largest handshake message a server reads (hello, authentication).
MAX_HANDSHAKE_BYTES = 64 << 10
#: A link request may ask for 1 to this many data connections per direction.
MAX_CONNECTIONS = 4


class Closed(Exception):
    """The server ends the connection here."""

    def __init__(self, end: str, detail: str = "") -> None:
        super().__init__(f"{end}: {detail}")
        self.end, self.detail = end, detail


def protocol_error(detail: str) -> Closed:
    return Closed("protocol_error", detail)


@dataclass
class ExpectedReply:
    op: int
    status: int
    req_id: int
    kind: str  # "empty", "json", "link" (json whose token is random), "bytes"
    value: Any = None
    #: the frame's protocol version: this one's, but for the refusal of a hello of another
    version: int = wire.PROTOCOL_VERSION
    #: with a secret, the reply carries ``mac`` over itself and the request it answers (protocol
    #: 8): (secret, client nonce, server nonce, client id, server id, request), else None
    signed: Optional[Tuple[bytes, str, str, int, int, Dict[str, Any]]] = None


@dataclass
class Expected:
    replies: List[ExpectedReply] = field(default_factory=list)
    end: str = "eof"
    detail: str = ""
    #: The exception type by which the server is known to deviate here (``KNOWN_BUGS``): the
    #: oracle says how the protocol should end, the harness tolerates that deviation.
    known_bug: Optional[str] = None
    protocol_errors: int = 0
    auth_failures: int = 0
    handshake_failures: int = 0
    links_lost: int = 0
    #: Per request op name: how many frames of it the server read a header of, and what became
    #: of them ("accepted", "refused", "stale", "closed").
    frames: List[Tuple[str, str]] = field(default_factory=list)
    written: int = 0  # bytes of registered memory that accepted pushes wrote
    refused_reads: int = 0  # pulls the read guard refused
    notes: List[str] = field(default_factory=list)


class Shadow:
    """Copies of the server's buffers (registered tensors, guards and secret alike), addressed
    by the addresses of the real ones."""

    def __init__(self, buffers: Sequence[Tuple[int, np.ndarray]]) -> None:
        self.buffers = [(addr, array.copy()) for addr, array in buffers]

    def _locate(self, addr: int, nbytes: int) -> Tuple[np.ndarray, int]:
        for start, array in self.buffers:
            if start <= addr and addr + nbytes <= start + array.size:
                return array, addr - start
        raise AssertionError(f"the oracle touched {nbytes} bytes at {addr:#x}, outside every buffer")

    def read(self, addr: int, nbytes: int) -> bytes:
        array, offset = self._locate(addr, nbytes)
        return bytes(array[offset:offset + nbytes])

    def write(self, addr: int, data: bytes) -> None:
        array, offset = self._locate(addr, len(data))
        array[offset:offset + len(data)] = np.frombuffer(data, dtype=np.uint8)


class Ranges:
    """The registered tensors as ``[start, end)`` ranges, merged where they touch."""

    def __init__(self, spans: Sequence[Tuple[int, int]]) -> None:
        merged: List[List[int]] = []
        for start, end in sorted((a, a + n) for a, n in spans if n > 0):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self.spans = [(a, b) for a, b in merged]
        self._starts = [a for a, _ in self.spans]

    def contains(self, addr: int, nbytes: int) -> bool:
        """Whether ``[addr, addr + nbytes)`` lies in one range (a zero-byte range must start
        inside one)."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return False
        end = self.spans[i][1]
        return addr < end and nbytes <= end - addr


class Stream:
    """The bytes the peer sent, read front to back."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> Optional[bytes]:
        """``n`` bytes, or None if the stream ends first (all that is left is then consumed)."""
        if self.pos + n > len(self.data):
            self.pos = len(self.data)
            return None
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def peek(self, n: int) -> Optional[bytes]:
        """The next ``n`` bytes without taking them, or None if fewer are left."""
        return self.data[self.pos:self.pos + n] if self.pos + n <= len(self.data) else None

    def take_prefix(self, n: int) -> bytes:
        chunk = self.data[self.pos:self.pos + n]
        self.pos += len(chunk)
        return chunk


@dataclass
class Session:
    """What the server knows before the connection's first byte."""

    secret: Optional[bytes]
    notify: Optional[Callable[[int, Dict[str, Any]], Any]]
    #: Clusters linked to the server (live links).
    linked: Tuple[int, ...] = ()
    #: Handshake connections: the link waiting for its data connections (cluster id, token).
    staged: Optional[Tuple[int, str]] = None
    #: Connections served directly as a link's forward connection: (cluster id, proven Unix peer).
    direct: Optional[Tuple[int, bool]] = None


class ServerModel:
    """The server side of one cluster, as the protocol describes it."""

    def __init__(self, cluster_id: int, generation: int, ranges: Ranges, shadow: Shadow, table: Dict[str, Any],
                 same_host: Dict[str, Any], server_nonce: str, remote_accessible: bool, role: str,
                 planes: List[str], host: Dict[str, str], unix_name: Optional[str],
                 guard: Optional[Callable[[bytes], Optional[Ranges]]] = None) -> None:
        self.cluster_id = cluster_id
        self.guard = guard  # the server's read guard: tag -> the ranges it allows, or None
        self.generation = generation
        self.ranges = ranges
        self.shadow = shadow
        self.table = table
        self.same_host = same_host
        self.server_nonce = server_nonce
        self.remote_accessible = remote_accessible
        self.role = role
        self.planes = planes
        self.host = host
        self.unix_name = unix_name

    # -- one connection -----------------------------------------------------------------------------
    def expect(self, data: bytes, session: Session) -> Expected:
        """What the server must do with a connection on which the peer sent ``data`` and then
        shut down its side. Applies accepted pushes to the shadow."""
        out = self._out = Expected()
        stream = Stream(data)
        try:
            if session.direct is not None:
                cluster_id, unix = session.direct
                self._serve(stream, out, session, cluster_id, unix, ready=True)
            else:
                self._handshake(stream, out, session)
        except Closed as closed:
            out.end, out.detail = closed.end, closed.detail
            if closed.end == "protocol_error":
                out.protocol_errors += 1
            elif closed.end == "link_failure":
                out.handshake_failures += 1
        return out

    # -- handshake -------------------------------------------------------------------------------
    def _receive(self, stream: Stream, expect: int, what: str) -> Dict[str, Any]:
        head = stream.take(wire.HEADER_BYTES)
        if head is None:
            raise Closed("link_failure", f"no {what}")
        op, _, _, length = self._header(head)
        if op != expect or length > MAX_HANDSHAKE_BYTES:
            raise protocol_error(f"op {op} of {length} bytes instead of a {what}")
        body = stream.take(length)
        if body is None:
            raise Closed("link_failure", f"{what} truncated")
        return self._json(body, what)

    def _handshake(self, stream: Stream, out: Expected, session: Session) -> None:
        head = stream.peek(wire.HEADER_BYTES)
        if head is not None:
            magic, version = head[:4], int.from_bytes(head[4:6], "little")
            if magic == wire.MAGIC and version != wire.PROTOCOL_VERSION:
                # A first frame of another version (since 3, the first with a challenge) is
                # answered once in that version, naming both, before the connection closes.
                if version >= 3:
                    line = f"protocol version {version}, this side speaks {wire.PROTOCOL_VERSION}"
                    out.replies.append(ExpectedReply(wire.OP_CHALLENGE, S.LLM_LINK_FAILED, 1, "json",
                                                     {"error": line}, version))
                raise protocol_error("another protocol version")
        hello = self._receive(stream, wire.OP_HELLO, "hello")
        peer_id, client_nonce = hello.get("cluster_id"), hello.get("nonce")
        if not _is_u64(peer_id) or not auth.is_nonce(client_nonce) or not isinstance(hello.get("auth"), bool):
            raise protocol_error("malformed hello")
        secret = session.secret
        challenge: Dict[str, Any] = {"cluster_id": self.cluster_id, "nonce": self.server_nonce,
                                     "auth": secret is not None}
        if hello["auth"] != (secret is not None):
            out.auth_failures += 1
            why = "this cluster requires a link secret" if secret else "this cluster has no link secret"
            out.replies.append(ExpectedReply(wire.OP_CHALLENGE, S.LLM_LINK_FAILED, 1, "json",
                                             dict(challenge, error=why)))
            raise Closed("auth_refused")
        if secret is not None:
            challenge["proof"] = auth.proof(secret, "server", client_nonce, self.server_nonce, peer_id,
                                            self.cluster_id)
        out.replies.append(ExpectedReply(wire.OP_CHALLENGE, 0, 1, "json", challenge))
        message = self._receive(stream, wire.OP_AUTH, "authentication")
        self._signed = None
        if secret is not None:
            expected = auth.proof(secret, "client", client_nonce, self.server_nonce, peer_id, self.cluster_id)
            received = message.get("proof")
            mac = auth.message_mac(secret, "request", client_nonce, self.server_nonce, peer_id, self.cluster_id,
                                   message)  # (protocol 8: what the AUTH message says is signed)
            received_mac = message.get("mac")
            if not (isinstance(received, str)
                    and hmac.compare_digest(expected.encode(), received.encode("utf-8", "replace"))
                    and isinstance(received_mac, str)
                    and hmac.compare_digest(mac.encode(), received_mac.encode("utf-8", "replace"))):
                out.auth_failures += 1
                out.replies.append(ExpectedReply(wire.OP_HELLO_REPLY, S.LLM_LINK_FAILED, 1, "json",
                                                 {"error": "authentication failed"}))
                raise Closed("auth_refused")
            self._signed = (secret, client_nonce, self.server_nonce, peer_id, self.cluster_id, message)
        purpose = message.get("purpose")
        if purpose == "link":
            self._link_request(out, session, peer_id, message)
        if purpose in ("forward", "reverse"):
            staged = session.staged
            token = message.get("token")
            if staged is None or not isinstance(token, str) or token != staged[1] or peer_id != staged[0]:
                out.replies.append(ExpectedReply(wire.OP_HELLO_REPLY, S.LLM_LINK_FAILED, 1, "json",
                                                 {"error": "no pending link for this connection"},
                                                 signed=self._signed))
                raise Closed("refused")
            out.replies.append(ExpectedReply(wire.OP_HELLO_REPLY, 0, 1, "json", {"cluster_id": self.cluster_id},
                                             signed=self._signed))
            if purpose == "reverse":
                raise Closed("handed_over")  # the server now sends requests on it; it reads nothing
            self._serve(stream, out, session, peer_id, True, ready=False)
        raise protocol_error("unknown purpose")

    def _link_request(self, out: Expected, session: Session, peer_id: int, message: Dict[str, Any]) -> None:
        want, planes = message.get("connections"), message.get("planes")
        if not (isinstance(want, list) and len(want) == 2 and all(_is_u64(n, 1, MAX_CONNECTIONS) for n in want)):
            raise protocol_error("link request: connections")
        if not (isinstance(planes, list) and all(isinstance(p, str) for p in planes)):
            raise protocol_error("link request: planes")
        if not isinstance(message.get("role"), str) or not isinstance(message.get("host"), dict):
            raise protocol_error("link request: role or host")
        refusal = None
        comm = message.get("comm")
        if comm is not None and not (isinstance(comm, list) and len(comm) == 2
                                     and all(isinstance(x, str) for x in comm)):
            raise protocol_error("link request: comm")
        if comm is not None and not _is_u64(message.get("rank"), 0, 1 << 31):  # the rank claimed in it
            raise protocol_error("link request: rank")
        # Link protection (v7): the fuzzed server's own setting is off, so the link takes the client's.
        asked, suites = message.get("protection", "off"), message.get("suites", [])
        if asked not in ("off", "integrity", "encrypt"):
            raise protocol_error("link request: protection")
        if not (isinstance(suites, list) and all(isinstance(x, str) for x in suites)):
            raise protocol_error("link request: suites")
        pid, uid = message.get("pid"), message.get("uid")  # (protocol 8) the process it says it is
        if not (_is_u64(pid, 1, (1 << 31) - 1) and _is_u64(uid, 0, (1 << 32) - 1)):
            raise protocol_error("link request: pid or uid")
        preferred = {"off": [], "integrity": ["aes-256-gmac", "hmac-sha256"], "encrypt": ["aes-256-gcm"]}[asked]
        suite = next((x for x in preferred if x in suites[:8] and x in suites_here()), None)
        if comm is None and bool(message.get("remote_cache_accessible")) != self.remote_accessible:
            refusal = S.LLM_PARAM_INVALID, "enable_remote_cache_accessible differs between the two clusters"
        elif asked != "off" and session.secret is None:
            refusal = S.LLM_LINK_FAILED, f"protection {asked} needs a link secret on both sides"
        elif asked != "off" and suite is None:
            refusal = S.LLM_LINK_FAILED, (f"protection {asked}: no record suite both sides run (cluster "
                                          f"{self.cluster_id} runs {', '.join(suites_here())}, the linking side "
                                          f"offered {', '.join(suites[:8]) or 'none'}; encryption needs a recent "
                                          f"cryptography package, whose AESGCM has encrypt_into (pip install -U "
                                          f"cryptography))")
        elif comm is None and peer_id == self.cluster_id:  # only the server's own process may link to itself
            refusal = S.LLM_LINK_FAILED, "a self-link of another process"
        elif comm is not None:  # this server makes no two-sided link while it is fuzzed
            refusal = S.LLM_NOT_YET_LINK, "this cluster is not making that link now"
        elif session.staged is not None and session.staged[0] == peer_id:  # still being linked
            refusal = S.LLM_ALREADY_LINK, f"cluster {peer_id} is already linked"
        elif peer_id in session.linked:  # a live link is never replaced
            refusal = S.LLM_ALREADY_LINK, f"cluster {peer_id} is already linked"
            out.notes.append("hijack attempts")
        if refusal is not None:
            out.replies.append(ExpectedReply(wire.OP_HELLO_REPLY, refusal[0], 1, "json",
                                             {"cluster_id": self.cluster_id, "error": refusal[1]}, signed=self._signed))
            raise Closed("refused")
        out.replies.append(ExpectedReply(wire.OP_HELLO_REPLY, 0, 1, "link", {
            "cluster_id": self.cluster_id, "role": self.role, "planes": self.planes, "host": self.host,
            "remote_cache_accessible": self.remote_accessible, "unix": self.unix_name, "protection": asked,
            "suite": suite, "pid": os.getpid(), "uid": os.getuid()}, signed=self._signed))
        # The server waits for the link's data connections, which never come: the half-made
        # link is dropped when this connection ends.
        raise Closed("link_abandoned")

    # -- requests on a linked connection ----------------------------------------------------------
    def _serve(self, stream: Stream, out: Expected, session: Session, peer_id: int, unix: bool,
               ready: bool) -> None:
        try:
            while True:
                head = stream.take(wire.HEADER_BYTES)
                if head is None:
                    raise Closed("eof")
                op, _, req_id, length = self._header(head)
                if op not in wire.REQUEST_OPS or op == wire.OP_HELLO:
                    raise protocol_error(f"{wire.OP_NAMES[op]} is not a request")
                self._request(stream, out, session, peer_id, unix, op, req_id, length)
        except Closed as closed:
            if ready and closed.end != "unlinked":
                out.links_lost += 1
            raise

    def _request(self, stream: Stream, out: Expected, session: Session, peer_id: int, unix: bool, op: int,
                 req_id: int, length: int) -> None:
        name = wire.OP_NAMES[op]
        out.frames.append((name, "closed"))

        def done(result: str) -> None:
            out.frames[-1] = (name, result)

        control = {wire.OP_TABLE_GET: (wire.OP_TABLE, "table request"),
                   wire.OP_KEY_DONE: (wire.OP_KEY_DONE_REPLY, "key release"),
                   wire.OP_NOTIFY: (wire.OP_NOTIFY_REPLY, "notification"),
                   wire.OP_UNLINK: (wire.OP_UNLINK_DONE, "unlink")}.get(op)
        limit = budgets.max_message_bytes()
        if control is not None and length > wire.MAX_CONTROL_BYTES:  # longer than any control message
            raise protocol_error(f"{control[1]} of {length} bytes exceeds the protocol's {wire.MAX_CONTROL_BYTES}")
        if control is not None and length > limit:  # over the message budget: read, dropped, refused
            if stream.take(length) is None:
                raise protocol_error("refused control message truncated")
            reply_op, what = control
            out.replies.append(ExpectedReply(reply_op, S.LLM_PARAM_INVALID, req_id, "json", {
                "error": f"{what} of {length} bytes exceeds {limit} ({budgets.MAX_MESSAGE_BYTES_ENV})"}))
            done("refused")
        elif op == wire.OP_TABLE_GET:
            self._body(stream, length, wire.MAX_CONTROL_BYTES, "table request")
            table = dict(self.table)
            if unix:
                table["same_host"] = self.same_host
            out.replies.append(ExpectedReply(wire.OP_TABLE, 0, req_id, "json", table))
            done("accepted")
        elif op == wire.OP_KEY_DONE:
            message = self._json(self._body(stream, length, wire.MAX_CONTROL_BYTES, "key release"), "key release")
            try:
                kind, ident, model_id = message["key"]
                key = (str(kind), int(ident), int(model_id))
                tensors = [int(t) for t in message["tensors"]]
            except (KeyError, TypeError, ValueError):
                raise protocol_error("malformed key release") from None
            except OverflowError:  # an infinite number (1e400): no int either
                self._out.known_bug = "OverflowError"
                raise protocol_error("malformed key release: an infinite number") from None
            del key, tensors  # no key of this server is bound to an allocated cache: none is released
            out.replies.append(ExpectedReply(wire.OP_KEY_DONE_REPLY, 0, req_id, "json", {"released": False}))
            done("accepted")
        elif op == wire.OP_NOTIFY:
            message = self._json(self._body(stream, length, wire.MAX_CONTROL_BYTES, "notification"), "notification")
            status, answer = self._notification(session, peer_id, message)
            out.replies.append(ExpectedReply(wire.OP_NOTIFY_REPLY, status, req_id, "json", answer))
            done("accepted" if status == 0 else "refused")
        elif op == wire.OP_UNLINK:
            self._body(stream, length, wire.MAX_CONTROL_BYTES, "unlink")
            out.replies.append(ExpectedReply(wire.OP_UNLINK_DONE, 0, req_id, "empty"))
            done("accepted")
            raise Closed("unlinked")
        elif op == wire.OP_PUSH:
            done(self._push(stream, out, req_id, length))
        elif op == wire.OP_PULL:
            done(self._pull(stream, out, req_id, length))
        else:  # pragma: no cover - REQUEST_OPS is what _serve lets through
            raise protocol_error(f"unexpected {name}")

    def _push(self, stream: Stream, out: Expected, req_id: int, length: int) -> str:
        if length < 16:
            raise protocol_error(f"push frame of {length} bytes")
        fixed = self._body(stream, 16, 16, "push")
        generation, desc_len = wire.U64x2.unpack(fixed)
        if desc_len > length - 16 or desc_len % DESC.size:
            raise protocol_error(f"push: descriptor length {desc_len} in a frame of {length}")
        descs = self._descriptors(self._body(stream, desc_len, wire.MAX_DESCRIPTOR_BYTES, "descriptors"))
        data_len = length - 16 - desc_len
        if sum(n for _, _, n in descs) % 2**64 != data_len:
            raise protocol_error("push: descriptors and payload disagree")
        status = self._refusal(descs, generation, dst_side=True)
        if status == 0:
            data = stream.take_prefix(data_len)
            offset = 0
            for _, dst, nbytes in descs:  # bytes land in plan order, as far as they arrived
                part = data[offset:offset + nbytes]
                if part:
                    self.shadow.write(dst, part)
                    out.written += len(part)
                offset += nbytes
            if len(data) < data_len:
                raise protocol_error("push payload truncated")
        elif stream.take(data_len) is None:
            raise protocol_error("refused push payload truncated")
        out.replies.append(ExpectedReply(wire.OP_PUSH_DONE, status, req_id, "empty"))
        return _result(status)

    def _pull(self, stream: Stream, out: Expected, req_id: int, length: int) -> str:
        if length < 16:
            raise protocol_error(f"pull: frame length {length}")
        generation, tag_len = wire.U64x2.unpack(self._body(stream, 16, 16, "pull"))
        if tag_len > budgets.MAX_PULL_TAG_BYTES or tag_len > length - 16 or (length - 16 - tag_len) % DESC.size:
            raise protocol_error(f"pull: a tag of {tag_len} bytes in a frame of {length}")
        tag = self._body(stream, tag_len, budgets.MAX_PULL_TAG_BYTES, "pull tag")
        descs = self._descriptors(self._body(stream, length - 16 - tag_len, wire.MAX_DESCRIPTOR_BYTES,
                                             "descriptors"))
        status = self._guard_refusal(tag, descs)
        if status == 0:
            status = self._refusal(descs, generation, dst_side=False)
        if status == 0:
            data = b"".join(self.shadow.read(src, nbytes) for src, _, nbytes in descs if nbytes)
            out.replies.append(ExpectedReply(wire.OP_PULL_DATA, 0, req_id, "bytes", data))
        else:
            out.replies.append(ExpectedReply(wire.OP_PULL_DATA, status, req_id, "empty"))
        return _result(status)

    def _guard_refusal(self, tag: bytes, descs: List[Tuple[int, int, int]]) -> int:
        """The read guard's answer to a pull, checked before the generation and the registry: no
        tag, a tag it refuses or a source outside what it allows for the tag is refused."""
        if self.guard is None:
            return 0
        allowed = self.guard(tag) if tag else None
        if allowed is None or not all(allowed.contains(src, nbytes) for src, _, nbytes in descs):
            self._out.refused_reads += 1
            return S.LLM_KV_CACHE_NOT_EXIST
        return 0

    def _refusal(self, descs: List[Tuple[int, int, int]], generation: int, dst_side: bool) -> int:
        if generation != self.generation:
            return wire.STATUS_STALE_TABLE
        for src, dst, nbytes in descs:
            if not self.ranges.contains(dst if dst_side else src, nbytes):
                return S.LLM_KV_CACHE_NOT_EXIST
        return 0

    @staticmethod
    def _descriptors(data: bytes) -> List[Tuple[int, int, int]]:
        descs = [DESC.unpack_from(data, i) for i in range(0, len(data), DESC.size)]
        for src, dst, nbytes in descs:
            if nbytes > U64_MAX - src or nbytes > U64_MAX - dst:
                raise protocol_error("a descriptor wraps around the address space")
        return descs

    @staticmethod
    def _notification(session: Session, peer_id: int, message: Dict[str, Any]) -> Tuple[int, Dict[str, Any]]:
        handler = session.notify
        if handler is None:
            return S.LLM_FEATURE_NOT_ENABLED, {"error": "this cluster takes no notifications"}
        try:
            answer = handler(peer_id, message)
        except Exception:
            return S.LLM_FAILED, {"error": "the handler failed"}
        if not isinstance(answer, dict):
            return S.LLM_FAILED, {"error": "the handler failed"}
        return S.LLM_SUCCESS, answer

    # -- pieces -------------------------------------------------------------------------------------
    @staticmethod
    def _header(head: bytes) -> Tuple[int, int, int, int]:
        magic, version, op, status, req_id, length = wire.HEADER.unpack(head)
        if magic != wire.MAGIC or version != wire.PROTOCOL_VERSION or op not in wire.OP_NAMES:
            raise protocol_error("bad header")
        return op, status, req_id, length

    @staticmethod
    def _body(stream: Stream, length: int, limit: int, what: str) -> bytes:
        if length > limit:
            raise protocol_error(f"{what} of {length} bytes exceeds {limit}")
        body = stream.take(length)
        if body is None:
            raise protocol_error(f"{what} truncated")
        return body

    def _json(self, body: bytes, what: str) -> Dict[str, Any]:
        try:
            obj = json.loads(body.decode())
        except (UnicodeDecodeError, ValueError):
            raise protocol_error(f"{what} is not JSON") from None
        except RecursionError:  # nested deeper than a parser goes: not a message either
            self._out.known_bug = "RecursionError"
            raise protocol_error(f"{what} nested too deeply") from None
        if not isinstance(obj, dict):
            raise protocol_error(f"{what} is not a JSON object")
        return obj


def _is_u64(value: Any, lo: int = 0, hi: int = U64_MAX) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _result(status: int) -> str:
    if status == 0:
        return "accepted"
    return "stale" if status == wire.STATUS_STALE_TABLE else "refused"
