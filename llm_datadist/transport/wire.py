"""Frame format of the link protocol.

Every frame is a fixed 28-byte header followed by ``payload_len`` bytes::

    magic   4s   b"LLDD"
    version u16  PROTOCOL_VERSION
    op      u16  one of the OP_* codes
    status  u32  a status code (replies), 0 in requests
    req_id  u64  echoed by the reply
    length  u64  payload bytes that follow

Every connection starts with a handshake of four JSON frames (protocol version 8): HELLO from the
connecting side (``cluster_id``, ``nonce``, ``auth``), CHALLENGE from the accepting side (its
``cluster_id``, ``nonce``, ``auth`` and, with a secret, its ``proof``), AUTH from the connecting side
(its ``proof`` and what the connection is for: ``purpose`` "link" with the link's parameters, or
"forward"/"reverse" with the link's ``token``; a link to this cluster's own listener also carries
``self_proof``, since version 4), and HELLO_REPLY (a status; for a link the server's role, planes,
token and Unix socket name). A hello of another protocol version is answered with one refused
CHALLENGE in that version whose error names both versions (``handshake.refuse_version``). See ``auth`` for the proofs.

Control payloads (handshake, tables, unlink, key release, notifications) are UTF-8 JSON of at most
``MAX_CONTROL_BYTES``. A PUSH payload is ``u64 table generation`` + ``u64 descriptor bytes`` +
descriptors (``src, dst, nbytes`` as little-endian uint64; the receiver uses ``dst``) + the data of
every descriptor in order. A PULL payload is ``u64 table generation`` + ``u64 tag bytes`` + the tag
(opaque, at most ``budgets.MAX_PULL_TAG_BYTES``, checked by the owner's read guard:
``read_guard``; since version 5) + the descriptors (the owner uses ``src``); its reply, PULL_DATA,
carries the data. The generation is that of the owner's cache table the sender planned against;
the owner refuses a different one with ``STATUS_STALE_TABLE``. All integers are little-endian.

The TABLE reply is the owner's cache table (``transport.table``) plus what each data plane tells
the peer (``DataPlane.offer``). Version 6 added the ``nixl`` entry there: the owner's NIXL agent
name and metadata (base64), the address of its registry generation word and the GPU of its VRAM
registrations (``planes/nixl/``), sent only on links authenticated with a secret; a version 5
peer, which would take a table without it for one of its own, is refused at the handshake.

Version 7 added link protection (``protection``): the link request and its reply carry
``protection`` ("off", "integrity" or "encrypt"), and on a protected link every TCP data
connection carries, after its HELLO_REPLY, only sealed records in which the frames above travel.
A version 6 peer would read records as frames, so it is refused at the handshake.

Version 8 signs the handshake: with a secret, the AUTH message and the HELLO_REPLY carry ``mac``
(``auth.message_mac``: HMAC under the secret of all they say, the reply's over the request too,
bound to the connection's nonces and ids), and the link request and reply state the sender's
``pid`` and ``uid``, from which the link's Unix connections must come (``SO_PEERCRED``). A version
7 peer would take an unsigned reply, so it is refused at the handshake.

Version 9 added the ``shm`` plane (``planes/shm/``): the TABLE reply's ``shm`` entry lists the
owner's caches in memfds of their own (``{"caches": [[cache id, export id], ...], "proof_addr":
address}``, sent only to a proven same-host process of the owner's user), and OP_SHM_GET
(``{"caches": [cache id, ...], "proof": the word read at proof_addr}``, at most 200) is answered
by OP_SHM (``{"caches": [[cache id, export id, base address, bytes], ...]}``) whose first byte
carries one descriptor per listed cache (``SCM_RIGHTS``, Unix connections only).
A version 8 peer does not know OP_SHM_GET, so it is refused at the handshake.
"""

from __future__ import annotations

import json
import struct
import sys
from typing import Any, Optional, Tuple

MAGIC = b"LLDD"
PROTOCOL_VERSION = 9
HEADER = struct.Struct("<4sHHIQQ")
HEADER_BYTES = HEADER.size
U64 = struct.Struct("<Q")
U64x2 = struct.Struct("<QQ")

#: Reply status (not an LLM status code) refusing a PUSH or PULL planned against an older cache
#: table than the owner's registry: the sender refreshes its table and plans again.
STATUS_STALE_TABLE = 1

OP_HELLO = 1
OP_HELLO_REPLY = 2
OP_TABLE_GET = 3
OP_TABLE = 4
OP_PUSH = 5
OP_PUSH_DONE = 6
OP_PULL = 7
OP_PULL_DATA = 8
OP_UNLINK = 9
OP_UNLINK_DONE = 10
OP_KEY_DONE = 11
OP_KEY_DONE_REPLY = 12
OP_NOTIFY = 13
OP_NOTIFY_REPLY = 14
OP_CHALLENGE = 15
OP_AUTH = 16
OP_SHM_GET = 17
OP_SHM = 18

OP_NAMES = {value: name for name, value in globals().items() if name.startswith("OP_")}
REQUEST_OPS = (OP_HELLO, OP_TABLE_GET, OP_PUSH, OP_PULL, OP_UNLINK, OP_KEY_DONE, OP_NOTIFY, OP_SHM_GET)

#: Largest JSON payload accepted (cache tables included).
MAX_CONTROL_BYTES = 16 << 20
#: Largest descriptor list accepted in one PUSH or PULL (24 bytes a descriptor).
MAX_DESCRIPTOR_BYTES = 64 << 20

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("the llm_datadist wire format assumes a little-endian host")


class ProtocolError(Exception):
    """A frame that breaks the protocol: the connection it came on is closed."""


class VersionMismatch(ProtocolError):
    """A frame of this protocol (right magic) but of another version: ``version``. Its message is
    the one line naming both versions."""

    def __init__(self, version: int) -> None:
        super().__init__(f"protocol version {version}, this side speaks {PROTOCOL_VERSION}")
        self.version = version


def pack_header(op: int, req_id: int, length: int, status: int = 0, version: Optional[int] = None) -> bytes:
    """A frame's header, of ``PROTOCOL_VERSION`` unless ``version`` says otherwise (only to answer a
    peer of another version in its own: ``handshake.refuse_version``)."""
    return HEADER.pack(MAGIC, PROTOCOL_VERSION if version is None else version, op, status, req_id, length)


def unpack_header(data) -> Tuple[int, int, int, int]:
    """``(op, status, req_id, length)``; ProtocolError for a foreign magic, VersionMismatch for
    another version."""
    magic, version, op, status, req_id, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(version)
    if op not in OP_NAMES:
        raise ProtocolError(f"unknown op {op}")
    return op, status, req_id, length


def encode_json(obj: Any) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_CONTROL_BYTES:
        raise ProtocolError(f"control message of {len(data)} bytes exceeds {MAX_CONTROL_BYTES}")
    return data


def decode_json(data) -> Any:
    try:
        obj = json.loads(bytes(data).decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise ProtocolError(f"control payload is not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("control payload must be a JSON object")
    return obj
