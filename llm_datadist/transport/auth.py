"""Link authentication: an optional shared secret, proven by HMAC challenge–response.

Both ends of every connection of a link send a fresh random nonce; each side then proves that it
knows the secret with ``HMAC-SHA256(secret, label | client nonce | server nonce | client id |
server id)``, where the label differs between the two directions (so a proof cannot be reflected
back) and both nonces are fresh (so a recorded proof cannot be replayed). The secret itself never
crosses the wire. Proofs are compared in constant time.

With a secret, what the two sides then say is signed too (protocol version 8): the ``AUTH``
message carries ``mac``, an HMAC under the secret of everything else it says (its purpose, and for a
link the planes, host, pid and uid, protection...), and the ``HELLO_REPLY`` carries ``mac`` over
everything it says *and* the request it answers (``message_mac``). Both are bound to the
connection's nonces and ids like the proofs, so a relay that changes any field of either (the Unix
socket name that steers where the link's connections go, a plane offer, a host identity) fails the
link, and a signed message cannot be moved to another connection.

A link of a cluster to its own listener (a *self-link*) is proven otherwise: the process keeps a
random key in memory only (``new_self_key``) and its link request carries
``HMAC-SHA256(key, self label | client nonce | server nonce)`` (``self_proof``), so that only this
very process can claim this cluster's own id, with or without a secret.

The secret comes from the option ``llm.LinkSecret`` (``LLMConfig.link_secret``) or, when the
option is absent, the environment variable ``LLM_DATADIST_LINK_SECRET``. Without one, links are
not authenticated (CANN's behaviour): any process that reaches the listener may link. A secret is
a key (its proofs let anyone who reaches a listener test guesses offline): one shorter than
``MIN_SECRET_BYTES`` is refused wherever it comes from (``secret_refusal``), and a secret file is
read as OpenSSH reads a private key (``read_secret_file``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from typing import Any, Dict, Optional, Union

from llm_datadist.status import LLMException, LLMStatusCode

SECRET_OPTION = "llm.LinkSecret"
SECRET_ENV = "LLM_DATADIST_LINK_SECRET"
NONCE_BYTES = 32
_LABELS = {"client": b"llm_datadist link v5 client proof", "server": b"llm_datadist link v5 server proof",
           "self": b"llm_datadist link v5 self proof", "request": b"llm_datadist link v8 request mac",
           "reply": b"llm_datadist link v8 reply mac"}
#: Fields of a handshake message that are not part of what its MAC covers (proofs are checked on
#: their own; the MAC does not cover itself).
UNSIGNED_FIELDS = ("proof", "self_proof", "mac")


#: The shortest link secret taken, in bytes (of its UTF-8 text).
MIN_SECRET_BYTES = 16
#: What every refusal of a weak secret or secret file says.
HOW_TO_MAKE = "make a good one with: (umask 077; openssl rand -hex 32 > FILE)"
#: A secret file larger than this is refused (a secret is a line of text).
MAX_SECRET_FILE_BYTES = 4096


def secret_refusal(secret: Union[str, bytes], source: str) -> Optional[str]:
    """Why the secret from ``source`` (an option, a variable, a file) is refused, or None. It only
    counts bytes: whether they are random is the maker's business. Never quotes the secret."""
    size = len(secret.encode() if isinstance(secret, str) else secret)
    if size >= MIN_SECRET_BYTES:
        return None
    return (f"the link secret ({source}) has {size} byte(s), fewer than the {MIN_SECRET_BYTES} a secret "
            f"needs; {HOW_TO_MAKE}")


def resolve_secret(options: Dict[str, str]) -> Optional[bytes]:
    """The link secret of a cluster (None: links are not authenticated); ``LLM_PARAM_INVALID`` for
    one shorter than ``MIN_SECRET_BYTES``."""
    value, source = options.get(SECRET_OPTION), SECRET_OPTION
    if value is None:
        value, source = os.environ.get(SECRET_ENV), SECRET_ENV
    if not value:
        return None
    secret = value.encode() if isinstance(value, str) else bytes(value)
    why = secret_refusal(secret, source)
    if why is not None:
        raise LLMException(why, status_code=LLMStatusCode.LLM_PARAM_INVALID)
    return secret


def read_secret_file(path: str) -> str:
    """The link secret in the file ``path``: its text without the white space around it.

    The file is treated as a key, as OpenSSH treats a private key. After following links, it must
    be a regular file owned by this process's effective user, with no permission for group or
    others, of at most ``MAX_SECRET_FILE_BYTES`` of UTF-8 text holding a secret of at least
    ``MIN_SECRET_BYTES``. The owner and mode are those of the descriptor read (``fstat``), so the
    file checked is the file read. Anything else is refused with ``LLM_PARAM_INVALID``; the
    message never quotes the file's content."""
    def refuse(why: str) -> LLMException:
        return LLMException(f"the secret file {path} {why}", status_code=LLMStatusCode.LLM_PARAM_INVALID)

    try:
        # O_NONBLOCK: a FIFO or device opens at once and is refused below as not a regular file
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise LLMException(f"cannot read the secret file {path}: {exc.strerror}",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise refuse("is not a regular file")
        if info.st_uid != os.geteuid():
            raise refuse(f"belongs to user {info.st_uid}, not to this one ({os.geteuid()}); {HOW_TO_MAKE}")
        if info.st_mode & 0o077:
            raise refuse(f"is open to group or others (mode {stat.S_IMODE(info.st_mode):04o}); make it "
                         f"private: chmod 600 {path}")
        if info.st_size > MAX_SECRET_FILE_BYTES:
            raise refuse(f"has {info.st_size} bytes, more than the {MAX_SECRET_FILE_BYTES} a secret may have")
        data = os.read(fd, MAX_SECRET_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise refuse(f"has more than the {MAX_SECRET_FILE_BYTES} bytes a secret may have")
    try:
        secret = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise refuse("is not UTF-8 text") from None
    if not secret:
        raise refuse(f"is empty; {HOW_TO_MAKE}")
    why = secret_refusal(secret, f"the file {path}")
    if why is not None:
        raise LLMException(why, status_code=LLMStatusCode.LLM_PARAM_INVALID)
    return secret


def new_nonce() -> str:
    return os.urandom(NONCE_BYTES).hex()


def is_nonce(value: Any) -> bool:
    if not isinstance(value, str) or len(value) != 2 * NONCE_BYTES:
        return False
    try:
        bytes.fromhex(value)
    except ValueError:
        return False
    return True


def proof(secret: bytes, side: str, client_nonce: str, server_nonce: str, client_id: int, server_id: int) -> str:
    """What ``side`` ("client" or "server") sends to prove that it knows ``secret``."""
    message = b"|".join([_LABELS[side], bytes.fromhex(client_nonce), bytes.fromhex(server_nonce),
                         str(client_id).encode(), str(server_id).encode()])
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def verify(secret: bytes, side: str, client_nonce: str, server_nonce: str, client_id: int, server_id: int,
           received: Any) -> bool:
    """Whether ``received`` is ``side``'s proof (constant-time comparison)."""
    if not isinstance(received, str):
        return False
    expected = proof(secret, side, client_nonce, server_nonce, client_id, server_id)
    return hmac.compare_digest(expected.encode(), received.encode("utf-8", "replace"))


def signed_part(message: Dict[str, Any]) -> Dict[str, Any]:
    """What of a handshake message its MAC covers: all but ``UNSIGNED_FIELDS``."""
    return {key: value for key, value in message.items() if key not in UNSIGNED_FIELDS}


def _canonical(messages) -> bytes:
    """One byte string for a list of JSON values, the same on both sides of the wire for the same
    values (keys sorted, no spaces, ASCII escapes): what was decoded is encoded again, so a
    duplicate key or a re-spelled number that changes the decoded value changes the MAC input."""
    return json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def message_mac(secret: bytes, side: str, client_nonce: str, server_nonce: str, client_id: int, server_id: int,
                *messages: Dict[str, Any]) -> str:
    """The MAC ``side`` ("request": the ``AUTH`` message; "reply": the ``HELLO_REPLY``, over the
    reply and the request it answers) puts in ``mac``: HMAC-SHA256 under the secret of the label,
    the connection's nonces and ids and the signed part of ``messages``."""
    body = _canonical([signed_part(message) for message in messages])
    head = b"|".join([_LABELS[side], bytes.fromhex(client_nonce), bytes.fromhex(server_nonce),
                      str(client_id).encode(), str(server_id).encode()])
    return hmac.new(secret, head + b"|" + hashlib.sha256(body).digest(), hashlib.sha256).hexdigest()


def verify_mac(secret: bytes, side: str, client_nonce: str, server_nonce: str, client_id: int, server_id: int,
               received: Any, *messages: Dict[str, Any]) -> bool:
    """Whether ``received`` is ``side``'s MAC of ``messages`` (constant-time comparison)."""
    if not isinstance(received, str):
        return False
    expected = message_mac(secret, side, client_nonce, server_nonce, client_id, server_id, *messages)
    return hmac.compare_digest(expected.encode(), received.encode("utf-8", "replace"))


def new_self_key() -> bytes:
    """A key that never leaves this process: it proves that a self-link comes from it."""
    return os.urandom(32)


def self_proof(key: bytes, client_nonce: str, server_nonce: str) -> str:
    """What a self-link request carries to prove that it comes from the process holding ``key``."""
    message = b"|".join([_LABELS["self"], bytes.fromhex(client_nonce), bytes.fromhex(server_nonce)])
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def verify_self(key: bytes, client_nonce: str, server_nonce: str, received: Any) -> bool:
    """Whether ``received`` is the self-link proof of the process holding ``key`` (constant time)."""
    if not isinstance(received, str) or not (is_nonce(client_nonce) and is_nonce(server_nonce)):
        return False
    expected = self_proof(key, client_nonce, server_nonce)
    return hmac.compare_digest(expected.encode(), received.encode("utf-8", "replace"))
