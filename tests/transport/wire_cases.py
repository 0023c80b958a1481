"""Inputs of the wire fuzzer: one connection's worth of bytes per case, from a seeded
``random.Random`` (case ``i`` of seed ``s`` is the same input on every run, up to the addresses
of the server's buffers).

A case is a list of segments (a hello, an authentication, then request frames, or a forged
linked connection's frames only), each built valid or deliberately wrong at the protocol level
(descriptors inside, straddling or outside the registered ranges, a right or wrong table
generation, JSON that is not an object, too deep, too large a number, of the wrong types), and
then, for most cases, mutated at the byte level: bits flipped, header fields (magic, version,
op, length) and descriptor-list lengths overwritten, segments cut, dropped, repeated, swapped
or spliced with garbage, the whole stream truncated.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from llm_datadist.transport import auth, budgets, wire

U64_MAX = 2**64 - 1
HEADER = wire.HEADER_BYTES
#: Descriptor data a generated PUSH carries at most (bigger ones announce bytes they lack).
MAX_PUSH_DATA = 16 << 10
REPLY_OPS = (wire.OP_HELLO_REPLY, wire.OP_TABLE, wire.OP_PUSH_DONE, wire.OP_PULL_DATA, wire.OP_UNLINK_DONE,
             wire.OP_KEY_DONE_REPLY, wire.OP_NOTIFY_REPLY, wire.OP_CHALLENGE)
UNKNOWN_OPS = (0, 17, 18, 255, 256, 999, 0x7FFF, 0xFFFF)
INTERESTING_LENGTHS = (0, 1, 7, 8, 15, 16, 23, 24, 25, 40, 64 << 10, (64 << 10) + 1, 16 << 20, (16 << 20) + 1,
                       64 << 20, 2**31 - 1, 2**31, 2**32, 2**40, 2**63, U64_MAX - 15, U64_MAX - 7, U64_MAX)


#: The fuzzed server's read guard (``transport.read_guard``; ``wire_harness`` installs it, the
#: oracle models it): WIDE_TAG allows every buffer, guard bytes included (so that the registry's
#: own check still refuses what lies outside the tensors), NARROW_TAG the first half of each
#: tensor, any other tag (and no tag) nothing.
WIDE_TAG, NARROW_TAG = b"fuzz:wide", b"fuzz:narrow"


def guard_spans(tag: bytes, tensors: List[Tuple[int, int]], buffers: List[Tuple[int, int]]
                ) -> Optional[List[Tuple[int, int]]]:
    """The ``(addr, nbytes)`` ranges the fuzzed server's guard allows ``tag``, or None."""
    if tag == WIDE_TAG:
        return list(buffers)
    if tag == NARROW_TAG:
        return [(addr, nbytes // 2) for addr, nbytes in tensors]
    return None


def pull_payload(generation: int, tag: bytes, packed: bytes) -> bytes:
    """A PULL frame's payload (version 5): generation, tag length, tag, descriptors."""
    return wire.U64x2.pack(generation, len(tag)) + tag + packed


def notify_handler(peer_id: int, message: Dict[str, Any]) -> Any:
    """The application's notification handler while the fuzzer runs (the oracle calls it too)."""
    if "raise" in message:
        raise RuntimeError("the fuzzer's handler refuses this one")
    if "list" in message:
        return [peer_id]
    return {"peer": peer_id, "keys": sorted(message)[:4]}


@dataclass
class Target:
    """What a peer could know or guess about the server: its id, its table generation, the
    registered tensors (from its table), and, for aiming, the memory it must never reach."""

    cluster_id: int
    generation: int
    linked: List[int]                # clusters linked to it (a new link claiming one is a hijack)
    remote_accessible: bool
    tensors: List[Tuple[int, int]]   # registered (addr, nbytes)
    buffers: List[Tuple[int, int]]   # every buffer holding them, guards included
    secret: Tuple[int, int]          # a buffer never registered
    private: List[int]               # addresses of the server's own words (generation, probe cookie)
    server_nonce: str                # the challenge nonce the server uses during the fuzz
    link_secret: bytes


@dataclass
class Segment:
    kind: str
    data: bytes


@dataclass
class Case:
    index: int
    mode: str                 # "forward", "link", "reverse", "handshake" (other purposes), "direct"
    secret: bool              # the server requires the link secret
    notify: bool              # the server has a notification handler
    unix: bool                # direct mode: the forged link's peer is a proven Unix peer
    clean: bool               # a well-behaved session: only requests a real peer sends, unmutated
    peer_id: int              # the cluster id of the staged (or directly linked) peer
    token: str                # the staged link's token
    segments: List[Segment]
    mutations: List[str] = field(default_factory=list)

    @property
    def data(self) -> bytes:
        return b"".join(s.data for s in self.segments)

    def describe(self, limit: int = 512) -> str:
        data = self.data
        parts = ", ".join(f"{s.kind}[{len(s.data)}]" for s in self.segments[:40])
        shown = data[:limit].hex()
        return (f"case {self.index}: mode={self.mode} secret={self.secret} notify={self.notify} unix={self.unix} "
                f"clean={self.clean} "
                f"peer={self.peer_id} segments=[{parts}] mutations={self.mutations}\n"
                f"  {len(data)} bytes: {shown}{'...' if len(data) > limit else ''}")


def frame(op: int, payload: bytes, req_id: int = 1, status: int = 0) -> bytes:
    return wire.HEADER.pack(wire.MAGIC, wire.PROTOCOL_VERSION, op, status, req_id, len(payload)) + payload


class CaseGenerator:
    def __init__(self, target: Target, seed: int) -> None:
        self.target = target
        self.seed = seed

    def case(self, index: int) -> Case:
        rng = random.Random(f"llm_datadist wire fuzz {self.seed}:{index}")
        roll = rng.random()
        mode = ("forward" if roll < 0.55 else "link" if roll < 0.66 else "reverse" if roll < 0.69
                else "handshake" if roll < 0.75 else "direct")
        case = Case(index, mode, secret=mode != "direct" and rng.random() < 0.35, notify=rng.random() < 0.5,
                    unix=rng.random() < 0.5, clean=False, peer_id=1000 + rng.randrange(1000),
                    token=rng.randbytes(16).hex(), segments=[])
        if mode != "direct":
            self._handshake(rng, case, clean=False)
        if mode in ("forward", "direct") and rng.random() < 0.15:
            # A well-behaved session: requests a real peer could send, nothing mutated.
            if mode != "direct":
                case.segments.clear()
                self._handshake(rng, case, clean=True)
            for _ in range(rng.randint(3, 10)):
                case.segments.append(self._valid_request(rng))
            case.clean = True
            return case
        if mode in ("forward", "direct") or rng.random() < 0.1:
            for _ in range(rng.choice((1, 1, 2, 2, 3, 3, 4, 5, 6, 8))):
                case.segments.append(self._request(rng))
        if rng.random() < 0.65:
            for _ in range(rng.choice((1, 1, 1, 2, 2, 3))):
                self._mutate(rng, case)
        return case

    # -- handshake ------------------------------------------------------------------------------
    def _handshake(self, rng: random.Random, case: Case, clean: bool) -> None:
        t = self.target
        hello: Dict[str, Any] = {"cluster_id": case.peer_id, "nonce": rng.randbytes(auth.NONCE_BYTES).hex(),
                                 "auth": case.secret}
        if case.mode == "link":
            hello["cluster_id"] = rng.choice([rng.randrange(2000, 3000)] * 6 + [case.peer_id, t.cluster_id] + t.linked)
        if not clean and rng.random() < 0.12:
            key = rng.choice(["cluster_id", "nonce", "auth"])
            if rng.random() < 0.25:
                del hello[key]
            else:
                hello[key] = rng.choice([
                    -1, 2**64, U64_MAX, 0, 1.0, True, None, "1", [1], {}, "ab" * 31, "zz" * 32, "AB" * 32,
                    not case.secret, "ab" * 32 + "\n"])
        if not clean and rng.random() < 0.05:
            hello[rng.choice(["extra", "pid", "x" * 100])] = self._json_value(rng, 2)
        if case.mode == "link":
            message: Dict[str, Any] = {"purpose": "link", "role": "DECODER", "planes": ["tcp"], "host": {},
                                       "remote_cache_accessible": t.remote_accessible, "connections": [1, 1],
                                       "force_link": True, "pid": os.getpid(), "uid": os.getuid()}
            if rng.random() < 0.08:  # a member of a two-sided link, or a malformed claim to be one
                message["comm"] = rng.choice([["link", "ab" * 16], ["pd_comm_x", ""], [], ["a"], ["a", 1],
                                              "link", None, {"name": "a"}, [["a"], "b"]])
                if rng.random() < 0.8:  # the rank it claims, or a malformed one
                    message["rank"] = rng.choice([0, 1, 3, 2**31, 2**31 + 1, -1, True, "1", None, 1.0])
            if rng.random() < 0.1:  # link protection (v7), asked for as a client would, or malformed
                message["protection"] = rng.choice(["integrity", "encrypt", "off", "INTEGRITY", "tls", None, 1])
                message["suites"] = rng.choice([["aes-256-gmac", "hmac-sha256"], ["aes-256-gcm"], ["hmac-sha256"],
                                                [], ["rot13"], "aes-256-gcm", [1], None])
            if rng.random() < 0.4:
                key = rng.choice(["role", "planes", "host", "remote_cache_accessible", "connections", "pid", "uid"])
                message[key] = rng.choice([
                    None, 0, 1, 5, True, "x", [], [1], [0, 1], [1, 5], [4, 4], [1.0, 1], [True, 1], ["1", 1],
                    {}, {"boot_id": "x"}, ["cma", "tcp"], ["cma", 1], "DECODER" * 40, not t.remote_accessible])
        elif case.mode == "handshake":
            message = {"purpose": rng.choice([None, "", "LINK", "forward ", "data", 1, ["link"], {"p": 1}]),
                       "token": case.token}
        else:
            message = {"purpose": case.mode, "token": case.token}
            if not clean and rng.random() < 0.1:
                message["token"] = rng.choice([case.token.upper(), case.token[:-1], "", None, 1, [case.token],
                                               rng.randbytes(16).hex()])
        if case.secret or (not clean and rng.random() < 0.05):
            secret = t.link_secret if clean or rng.random() < 0.9 else b"not the secret"
            try:
                args = (hello["nonce"], t.server_nonce, hello["cluster_id"], t.cluster_id)
                proof, reflected = auth.proof(secret, "client", *args), auth.proof(secret, "server", *args)
            except (KeyError, TypeError, ValueError, AttributeError):  # a hello perturbed beyond proving
                proof = reflected = "00" * 32
            message["proof"] = proof if clean else rng.choice([proof] * 8 + [proof.upper(), proof[:-2], "", None, 0,
                                                                             [proof], reflected])
            try:  # protocol 8: the AUTH message's MAC over what it says
                mac = auth.message_mac(secret, "request", *args, message)
            except (TypeError, ValueError, NameError):  # (args of a hello perturbed beyond proving)
                mac = "00" * 32
            message["mac"] = mac if clean else rng.choice([mac] * 12 + [mac.upper(), "", None, [mac], proof])
            if not clean and rng.random() < 0.05:  # a field changed after signing (a man in the middle)
                message[rng.choice(["planes", "pid", "role", "token", "purpose"])] = self._json_value(rng, 1)
        if not clean and rng.random() < 0.05:
            message[rng.choice(["extra", "pid", "unix"])] = self._json_value(rng, 2)
        weird = 0.0 if clean else 0.04
        case.segments.append(Segment("hello", frame(wire.OP_HELLO, self._control(rng, hello, weird),
                                                     req_id=rng.choice([1, 1, 0, U64_MAX]))))
        case.segments.append(Segment("auth", frame(wire.OP_AUTH, self._control(rng, message, weird))))

    # -- requests -------------------------------------------------------------------------------
    def _valid_request(self, rng: random.Random) -> Segment:
        req_id = rng.randrange(2, 1 << 32)
        roll = rng.random()
        if roll < 0.7:
            op = rng.choice((wire.OP_PUSH, wire.OP_PULL))
            descs = []
            # Now and then more descriptors than one sendmsg/recvmsg takes (IOV_MAX), moving up
            # to half a megabyte: more than the socket buffers hold.
            many = rng.random() < 0.005
            small = many and rng.random() < 0.5
            for _ in range(rng.randint(1000, 2100) if many else rng.choice((0, 1, 1, 2, 3, 4, 8, 16))):
                addr, size = rng.choice(self.target.tensors)
                offset = rng.randrange(size)
                nbytes = rng.randint(0, min(size - offset, 4 if small else 256))
                descs.append((rng.getrandbits(40), addr + offset, nbytes) if op == wire.OP_PUSH
                             else (addr + offset, rng.getrandbits(40), nbytes))
            packed = b"".join(wire.U64.pack(v) for d in descs for v in d)
            generation = self.target.generation
            if op == wire.OP_PUSH:
                data = rng.randbytes(sum(n for _, _, n in descs))
                return Segment("PUSH", frame(op, wire.U64x2.pack(generation, len(packed)) + packed + data, req_id))
            return Segment("PULL", frame(op, pull_payload(generation, self._tag(rng, valid=True), packed), req_id))
        if roll < 0.8:
            return Segment("TABLE_GET", frame(wire.OP_TABLE_GET, b"{}", req_id))
        if roll < 0.82:  # over the message budget (budgets.DEFAULT_MAX_MESSAGE_BYTES): refused, the link goes on
            op = rng.choice([wire.OP_NOTIFY, wire.OP_KEY_DONE])
            body = json.dumps({"pad": "x" * rng.randrange(64 << 10, 80 << 10)}).encode()
            return Segment(wire.OP_NAMES[op][3:], frame(op, body, req_id))
        if roll < 0.9:
            message = {"request": rng.randrange(1000), "blocks": [rng.randrange(64) for _ in range(rng.randrange(5))]}
            return Segment("NOTIFY", frame(wire.OP_NOTIFY, json.dumps(message).encode(), req_id))
        key = [rng.choice(["blocks", "prefix", "cache"]), rng.randrange(100), rng.randrange(4)]
        body = json.dumps({"key": key, "tensors": [rng.randrange(4) for _ in range(rng.randrange(4))]}).encode()
        return Segment("KEY_DONE", frame(wire.OP_KEY_DONE, body, req_id))

    def _request(self, rng: random.Random) -> Segment:
        req_id = rng.choice([rng.randrange(2, 1000), 0, U64_MAX, rng.getrandbits(64)])
        status = 0 if rng.random() < 0.9 else rng.getrandbits(32)
        roll = rng.random()
        if roll < 0.30:
            return Segment("PUSH", frame(wire.OP_PUSH, self._push(rng), req_id, status))
        if roll < 0.55:
            return Segment("PULL", frame(wire.OP_PULL, self._pull(rng), req_id, status))
        if roll < 0.63:
            body = rng.choice([b"{}", b"", b"{}", self._weird_json(rng), rng.randbytes(rng.randrange(64))])
            return Segment("TABLE_GET", frame(wire.OP_TABLE_GET, body, req_id, status))
        if roll < 0.72:
            return Segment("KEY_DONE", frame(wire.OP_KEY_DONE, self._key_release(rng), req_id, status))
        if roll < 0.83:
            return Segment("NOTIFY", frame(wire.OP_NOTIFY, self._notification(rng), req_id, status))
        if roll < 0.86:
            body = rng.choice([b'{"cluster_id":1,"timeout":1000}', b"", self._weird_json(rng)])
            return Segment("UNLINK", frame(wire.OP_UNLINK, body, req_id, status))
        if roll < 0.92:
            op = rng.choice(REPLY_OPS)
            body = rng.choice([b"", b"{}", wire.U64.pack(0), rng.randbytes(rng.randrange(48))])
            return Segment(wire.OP_NAMES[op], frame(op, body, req_id, status))
        if roll < 0.95:
            op = rng.choice((wire.OP_HELLO, wire.OP_AUTH))
            return Segment(wire.OP_NAMES[op], frame(op, b'{"cluster_id":5,"purpose":"link"}', req_id, status))
        if roll < 0.98:
            op = rng.choice(UNKNOWN_OPS)
            return Segment(f"op {op}", frame(op, rng.randbytes(rng.randrange(32)), req_id, status))
        return Segment("garbage", rng.randbytes(rng.randrange(1, 80)))

    def _generation(self, rng: random.Random) -> int:
        g = self.target.generation
        if rng.random() < 0.88:
            return g
        return rng.choice([g + 1, g - 1, 0, U64_MAX, g + 2**32, rng.getrandbits(64)]) % 2**64

    def _range(self, rng: random.Random) -> Tuple[int, int]:
        """``(address, nbytes)`` of one side of a descriptor: inside a registered tensor most
        often, else straddling one, beside one, in a guard, in the secret, in the server's own
        words, in the null page, anywhere, or wrapping around the address space."""
        t = self.target
        addr, size = rng.choice(t.tensors)
        roll = rng.random()
        if roll < 0.50:
            offset = rng.randrange(size)
            return addr + offset, rng.randint(0, min(size - offset, 200))
        if roll < 0.55:
            return addr, size
        if roll < 0.58:
            return rng.choice([(addr, 0), (addr + size, 0), (addr + size - 1, 1), (addr - 1, 1)])
        if roll < 0.63:
            k = rng.randint(1, 48)
            return addr - k, k + rng.randint(1, 64)
        if roll < 0.68:
            k = rng.randint(0, 48)
            return addr + size - k, k + rng.randint(1, 48)
        if roll < 0.71:
            return addr - rng.randint(1, 64), rng.randint(1, size + 128)
        if roll < 0.76:
            base, bsize = rng.choice(t.buffers)
            offset = rng.randrange(bsize)
            return base + offset, rng.randint(1, min(bsize - offset, 256))
        if roll < 0.80:
            base, ssize = t.secret
            offset = rng.randrange(ssize)
            return base + offset, rng.randint(1, min(ssize - offset, 256))
        if roll < 0.83:
            return rng.choice(t.private), 8
        if roll < 0.85:
            # From one registered tensor into the next one of the same buffer, over the guard.
            (a, n), (b, m) = sorted(rng.sample(t.tensors, 2))
            return a + n - 8, (b - (a + n - 8)) + 8
        if roll < 0.87:
            return rng.randrange(4096), rng.randint(1, 64)
        if roll < 0.90:
            return rng.getrandbits(64), rng.randint(0, 64)
        if roll < 0.94:
            start = rng.choice([addr, U64_MAX - rng.randint(0, 64), rng.getrandbits(64)])
            return start, rng.choice([U64_MAX - start, U64_MAX - start + 1, 2**63, U64_MAX, 1 << 40])
        return addr + rng.randrange(size), rng.choice([size + 1, 1 << 20, 2**32 + 8])

    def _descriptors(self, rng: random.Random, checked_side: str) -> List[Tuple[int, int, int]]:
        descs = []
        for _ in range(rng.choice((0, 1, 1, 1, 2, 2, 3, 4, 6, 12))):
            addr, nbytes = self._range(rng)
            other = rng.choice([0, rng.getrandbits(40), U64_MAX if rng.random() < 0.1 else 4096])
            if checked_side == "dst":
                descs.append((other, addr, nbytes))
            else:
                descs.append((addr, other, nbytes))
        return descs

    def _push(self, rng: random.Random) -> bytes:
        descs = self._descriptors(rng, "dst")
        packed = b"".join(wire.U64.pack(v) for d in descs for v in d)
        total = sum(n for _, _, n in descs)
        data = rng.randbytes(total) if total <= MAX_PUSH_DATA else rng.randbytes(rng.randrange(64))
        return wire.U64x2.pack(self._generation(rng), len(packed)) + packed + data

    def _pull(self, rng: random.Random) -> bytes:
        descs = self._descriptors(rng, "src")
        packed = b"".join(wire.U64.pack(v) for d in descs for v in d)
        if rng.random() < 0.05:  # a tag length that lies (past the frame, or over the budget)
            tag = self._tag(rng, valid=False)
            told = rng.choice([len(tag) + rng.randint(1, 64), budgets.MAX_PULL_TAG_BYTES + 1, U64_MAX,
                               len(tag) + len(packed) + 1, max(0, len(tag) - 1)])
            return wire.U64x2.pack(self._generation(rng), told) + tag + packed
        return pull_payload(self._generation(rng), self._tag(rng, valid=False), packed)

    @staticmethod
    def _tag(rng: random.Random, valid: bool) -> bytes:
        """A PULL's tag: mostly one the guard allows, else none, a wrong one, the longest allowed,
        or (``valid`` False) one over the budget."""
        roll = rng.random()
        if roll < 0.6:
            return WIDE_TAG
        if roll < 0.75:
            return NARROW_TAG
        if roll < 0.85:
            return b""
        if roll < 0.95:
            return rng.choice([WIDE_TAG[:-1], WIDE_TAG + b"\0", rng.randbytes(rng.randrange(1, 32)),
                               NARROW_TAG.upper()])
        if valid or rng.random() < 0.5:
            return b"x" * budgets.MAX_PULL_TAG_BYTES
        return b"x" * (budgets.MAX_PULL_TAG_BYTES + rng.randint(1, 16))

    # -- control payloads -----------------------------------------------------------------------
    def _json_value(self, rng: random.Random, depth: int) -> Any:
        roll = rng.random()
        if depth <= 0 or roll < 0.5:
            return rng.choice([0, 1, -1, 2**64, 1.5, True, False, None, "", "x", "blocks", "prefix", 3, 2**70])
        if roll < 0.75:
            return [self._json_value(rng, depth - 1) for _ in range(rng.randrange(4))]
        return {rng.choice(["a", "key", "tensors", "n", "raise", "list", ""]): self._json_value(rng, depth - 1)
                for _ in range(rng.randrange(4))}

    def _control(self, rng: random.Random, message: Dict[str, Any], weird: float) -> bytes:
        """``message`` as JSON, or (with probability ``weird``) something else entirely."""
        if rng.random() < weird:
            return self._weird_json(rng)
        return json.dumps(message).encode()

    def _weird_json(self, rng: random.Random) -> bytes:
        roll = rng.randrange(16)
        if roll == 0:
            return rng.choice([b"[]", b'"object"', b"1", b"null", b"true", b"[{}]", b"1e400"])
        if roll == 1:  # deeper than any recursion limit, within the 64 KiB of a handshake message
            depth = rng.randint(20000, 30000)
            return rng.choice([b"[" * depth + b"]" * depth, b'{"a":' + b"[" * depth + b"]" * depth + b"}"])
        if roll == 2:  # nested, but not deeply
            depth = rng.randint(2, 40)
            return b'{"a":' + b"[" * depth + b"]" * depth + b"}"
        if roll == 3:
            return rng.choice([b'{"n":1e400}', b'{"n":-1e400}', b'{"n":NaN}', b'{"n":Infinity}', b'{"n":1e308}',
                               b'{"n":' + b"9" * rng.choice([100, 4300, 4301, 6000]) + b"}",
                               b'{"n":-0.0}', b'{"n":123456789012345678901234567890}'])
        if roll == 4:
            return rng.choice([b'{"a":"\xff"}', b"\xef\xbb\xbf{}", b"\xff\xfe{\x00}\x00", b'{"s":"\\ud800"}',
                               b'{"s":"\x00"}', b'{"a":1,"a":2}', b"{} {}", b"", b" ", b"{", b"{}\x00",
                               b'{"a":1,}', b"{'a':1}"])
        if roll == 5:
            return b'{"s":"' + b"a" * rng.randint(1000, 30000) + b'"}'
        if roll == 6:
            return rng.randbytes(rng.randrange(64))
        return json.dumps({rng.choice(["a", "key", "tensors", "n", "x"]): self._json_value(rng, 3)
                           for _ in range(rng.randrange(5))}).encode()

    def _key_release(self, rng: random.Random) -> bytes:
        roll = rng.random()
        if roll < 0.45:
            key = [rng.choice(["blocks", "prefix", "cache"]), rng.randrange(100), rng.randrange(4)]
            return json.dumps({"key": key, "tensors": [rng.randrange(4) for _ in range(rng.randrange(4))]}).encode()
        if roll < 0.75:
            key: Any = rng.choice([
                ["blocks", 1], ["blocks", 1, 2, 3], "abc", "a1", {"a": 0, "1": 0, "2": 0}, 7, None,
                ["blocks", "12", " 3 "], ["blocks", 1.5, 0], ["blocks", True, False], ["blocks", "x", 0],
                ["blocks", 2**70, -5], ["blocks", [1], 0], [[], {}, None]])
            tensors: Any = rng.choice([[0, 1], "123", {"0": 1}, 5, None, [1.9, "2"], ["x"], [[0]], [2**80]])
            message = {"key": key, "tensors": tensors}
            if rng.random() < 0.2:
                del message[rng.choice(["key", "tensors"])]
            return json.dumps(message).encode()
        if roll < 0.80:  # numbers JSON accepts and Python cannot make an int of
            return rng.choice([b'{"key":["blocks",1e400,0],"tensors":[]}', b'{"key":["blocks",NaN,0],"tensors":[]}',
                               b'{"key":["blocks",1,0],"tensors":[-Infinity]}'])
        return self._weird_json(rng)

    def _notification(self, rng: random.Random) -> bytes:
        if rng.random() < 0.6:
            message: Dict[str, Any] = {"request": rng.randrange(1000), "blocks": [rng.randrange(64)
                                                                                  for _ in range(rng.randrange(5))]}
            if rng.random() < 0.2:
                message[rng.choice(["raise", "list"])] = True
            if rng.random() < 0.2:
                message["extra"] = self._json_value(rng, 3)
            return json.dumps(message).encode()
        return self._weird_json(rng)

    # -- mutations ------------------------------------------------------------------------------
    def _mutate(self, rng: random.Random, case: Case) -> None:
        segments = case.segments
        if not segments:
            return
        i = rng.randrange(len(segments))
        seg = segments[i]
        data = bytearray(seg.data)
        is_frame = len(data) >= HEADER and data[:4] == wire.MAGIC
        kind = rng.choice(["bits", "bits", "bits", "byte", "length", "length", "magic", "version", "op",
                           "desc_len", "ragged", "truncate", "cut", "insert", "delete", "drop", "dup", "swap",
                           "splice", "concat"])
        what: Optional[str] = None
        if kind == "bits" and data:
            head = is_frame and rng.random() < 0.5
            for _ in range(rng.randint(1, 4)):
                pos = rng.randrange(HEADER if head else len(data))
                data[pos] ^= 1 << rng.randrange(8)
            what = "bits in header" if head else "bits"
        elif kind == "byte" and data:
            pos = rng.randrange(len(data))
            data[pos] = rng.choice([0, 0xFF, 0x7F, 0x80, 0x01, rng.randrange(256)])
            what = f"byte {pos}"
        elif kind == "length" and is_frame:
            length = rng.choice(INTERESTING_LENGTHS + (len(data) - HEADER - 1, len(data) - HEADER + 1,
                                                       len(data) - HEADER + 24, rng.getrandbits(64)))
            data[20:28] = wire.U64.pack(max(0, length) % 2**64)
            what = f"length {length}"
        elif kind == "magic" and is_frame:
            data[0:4] = rng.choice([b"LLDE", b"\0\0\0\0", b"DDLL", b"lldd", b"LLD\0"])
            what = "magic"
        elif kind == "version" and is_frame:
            version = rng.choice([0, 1, 2, 4, 0x0300, 0xFFFF])
            data[4:6] = version.to_bytes(2, "little")
            what = f"version {version}"
        elif kind == "op" and is_frame:
            op = rng.choice(list(wire.OP_NAMES) + list(UNKNOWN_OPS))
            data[6:8] = op.to_bytes(2, "little")
            what = f"op {op}"
        elif kind == "desc_len" and is_frame and seg.kind == "PUSH" and len(data) >= HEADER + 16:
            value = rng.choice([1, 12, 23, 25, 47, 24 * 1000, 2**32, U64_MAX, U64_MAX - 23,
                                int.from_bytes(data[36:44], "little") + rng.choice([-24, -1, 1, 24])]) % 2**64
            data[36:44] = wire.U64.pack(value)
            what = f"descriptor length {value}"
        elif kind == "ragged" and is_frame and seg.kind in ("PUSH", "PULL"):
            extra = rng.randint(1, 23)
            if rng.random() < 0.5 or len(data) - HEADER < extra + 8:
                data += rng.randbytes(extra)
            else:
                del data[-extra:]
            data[20:28] = wire.U64.pack(len(data) - HEADER)
            what = f"ragged by {extra}"
        elif kind == "truncate":
            cut = rng.randrange(len(data) + 1)
            del data[cut:]
            del segments[i + 1:]
            what = f"stream cut at {cut} of {seg.kind}"
        elif kind == "cut" and data:
            cut = rng.randrange(len(data))
            del data[cut:]
            what = f"{seg.kind} cut at {cut}"
        elif kind == "insert":
            pos = rng.randrange(len(data) + 1)
            data[pos:pos] = rng.randbytes(rng.randint(1, 40))
            what = f"bytes inserted at {pos}"
        elif kind == "delete" and data:
            pos = rng.randrange(len(data))
            del data[pos:pos + rng.randint(1, 40)]
            what = f"bytes deleted at {pos}"
        elif kind == "drop":
            del segments[i]
            case.mutations.append(f"dropped {seg.kind}")
            return
        elif kind == "dup":
            segments.insert(i, Segment(seg.kind, seg.data))
            case.mutations.append(f"repeated {seg.kind}")
            return
        elif kind == "swap" and len(segments) > 1:
            j = rng.randrange(len(segments))
            segments[i], segments[j] = segments[j], segments[i]
            case.mutations.append(f"swapped {segments[j].kind} and {segments[i].kind}")
            return
        elif kind == "splice":
            segments.insert(rng.randrange(len(segments) + 1), Segment("garbage", rng.randbytes(rng.randint(1, 64))))
            case.mutations.append("garbage spliced in")
            return
        elif kind == "concat" and len(segments) > 1 and i + 1 < len(segments):
            # Two frames announced as one: the first one's length covers the second.
            if is_frame:
                data[20:28] = wire.U64.pack(len(data) - HEADER + len(segments[i + 1].data))
                what = "length covers the next frame"
        if what is not None:
            segments[i] = Segment(seg.kind, bytes(data))
            case.mutations.append(f"{seg.kind}: {what}")

