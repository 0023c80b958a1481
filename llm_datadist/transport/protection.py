"""Protected links: the TCP connections of a link sealed with keys derived from its handshake.

``llm.LinkProtection`` (``LLMConfig`` option; the environment variable
``LLM_DATADIST_LINK_PROTECTION`` when the option is absent) is ``off`` (the default),
``integrity`` or ``encrypt``. It needs a link secret (``auth``): the keys come from it. A link
is protected at the stronger of its two sides' settings, agreed in the link request and reply;
each side also insists on its own, so a peer or a man in the middle that drops the request's
field gets a link that fails at its first record rather than an unprotected one.

Each TCP data connection of a protected link carries, after its handshake, only *records*::

    length  u32  plaintext bytes in the record, 1 .. MAX_RECORD
    body         the plaintext (integrity) or its ciphertext (encrypt)
    tag          the record's authentication tag (16 or 32 bytes, by suite)

in one of three *suites*, the request naming those the client can run and the reply the one
chosen (the first of the mode's that both sides can run; ``suites_here``):

    aes-256-gcm    encrypt    AES-256-GCM; nonce 0^4 | sequence; the length as associated data
    aes-256-gmac   integrity  GCM's tag with the body as associated data and nothing encrypted;
                              nonce length | sequence (the sequence alone keeps it unique)
    hmac-sha256    integrity  HMAC-SHA256(sequence | length | body), where cryptography is absent

The AES suites need the cryptography package; GMAC runs about ten times faster than HMAC-SHA256
here, hence first. The sequence number counts the records of one direction of one connection
from 0 and is never sent: a record dropped, repeated, reordered or moved from another connection
fails its check. Each direction of each connection has its own key, ``HMAC-SHA256(secret, label
| suite | client nonce | server nonce | client id | server id | direction)`` of that connection's
own handshake, and the digest of the link's request and reply (``link_digest``), so keys are
fresh per connection, a nonce (the sequence number) is never reused under a key, and anything of
the link request or reply changed on the way (the suites offered, the setting, the planes) gives
the two sides different keys. A record
that fails its check closes the connection, hence the link (counted as ``protection_failures``
and logged); nothing of it reaches the link's frames.

How: the link's code reads and writes one end of a local socket pair as it would the TCP
socket; a ``Relay`` seals what it reads from the other end onto the TCP connection (one thread)
and opens what arrives there back into the pair (another thread). Every frame after the
handshake is protected this way -- the ``tcp`` and ``staging`` planes' payloads, descriptors and
control messages alike -- without a second implementation of the frame paths. Same-host Unix
connections are not sealed (nothing crosses a network): since protocol version 8 they are used only
where the kernel proves (``SO_PEERCRED``) that the other end is the process the peer stated in its
signed link request or reply, so a relay cannot sit between them (``handshake.check_process``);
``nixl``, whose transfers bypass the link's connections, is refused on protected links. What it
costs: ``bench/report_protection.py``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from llm_datadist.status import LLMException
from llm_datadist.transport import auth
from llm_datadist.transport.errors import S
from llm_datadist.transport.threads import Threads

logger = logging.getLogger("llm_datadist")

OPTION = "llm.LinkProtection"
ENV = "LLM_DATADIST_LINK_PROTECTION"
OFF, INTEGRITY, ENCRYPT = "off", "integrity", "encrypt"
#: The settings, weakest first.
MODES = (OFF, INTEGRITY, ENCRYPT)
#: Most plaintext bytes in one record.
MAX_RECORD = 256 << 10
#: How long a relay whose link closed its end waits for the peer to close the connection too.
LINGER_S = 5.0
RECORD_HEADER = struct.Struct("<I")
_SEQUENCE = struct.Struct("<Q")
_KEY_LABEL = b"llm_datadist v7 record key"
_FRAME_MAGIC = b"LLDD"  # what an unsealed frame starts with (``wire.MAGIC``), read as a record's length
CRYPTOGRAPHY_MISSING = ("encryption needs a recent cryptography package, whose AESGCM has encrypt_into "
                        "(pip install -U cryptography)")
GCM, GMAC, HMAC = "aes-256-gcm", "aes-256-gmac", "hmac-sha256"
#: The suites of each mode, preferred first.
SUITES = {ENCRYPT: (GCM,), INTEGRITY: (GMAC, HMAC)}
_TAG_BYTES = {GCM: 16, GMAC: 16, HMAC: 32}


def resolve(options: Dict[str, str], secret: Optional[bytes]) -> str:
    """This side's setting; ``LLM_PARAM_INVALID`` for an unknown value, for protection without a
    link secret and for ``encrypt`` without the cryptography package."""
    value = options.get(OPTION)
    if value is None:
        value = os.environ.get(ENV, "")
    mode = str(value).strip().lower() or OFF
    if mode not in MODES:
        raise LLMException(f"{OPTION}={value!r}: expected one of {', '.join(MODES)}",
                           status_code=S.LLM_PARAM_INVALID)
    if mode != OFF and secret is None:
        raise LLMException(f"{OPTION}={mode} needs a link secret (llm.LinkSecret or LLM_DATADIST_LINK_SECRET): the "
                           f"record keys are derived from it", status_code=S.LLM_PARAM_INVALID)
    why = unavailable(mode)
    if why is not None:
        raise LLMException(f"{OPTION}={mode}: {why}", status_code=S.LLM_PARAM_INVALID)
    return mode


def _has_aes() -> bool:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        return False
    return hasattr(AESGCM, "encrypt_into") and hasattr(AESGCM, "decrypt_into")


def suites_here() -> List[str]:
    """The suites this process can run."""
    return [GCM, GMAC, HMAC] if _has_aes() else [HMAC]


def unavailable(mode: str) -> Optional[str]:
    """Why this process cannot protect a link with ``mode``, or None."""
    if mode == ENCRYPT and not _has_aes():
        return CRYPTOGRAPHY_MISSING
    return None


def choose(mode: str, theirs: Sequence[Any]) -> Optional[str]:
    """The suite of a link protected with ``mode`` whose client runs ``theirs`` (None: no common one)."""
    here = suites_here()
    return next((suite for suite in SUITES.get(mode, ()) if suite in here and suite in theirs), None)


def stronger(a: str, b: str) -> str:
    return a if MODES.index(a) >= MODES.index(b) else b


def at_least(mode: str, floor: str) -> bool:
    return MODES.index(mode) >= MODES.index(floor)


def link_digest(request: Dict[str, Any], reply: Dict[str, Any]) -> bytes:
    """SHA-256 of a link's request and reply (less their proofs and MACs) as each side holds them: the same
    on both sides unless something changed them on the way, which then gives the link's
    connections keys that do not match (their first record fails)."""
    text = json.dumps([auth.signed_part(request), auth.signed_part(reply)], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).digest()


def derive_keys(secret: bytes, suite: str, client_nonce: str, server_nonce: str, client_id: int,
                server_id: int, digest: bytes = b"") -> Tuple[bytes, bytes]:
    """(client-to-server key, server-to-client key) of one connection's handshake, on the link
    whose request and reply gave ``digest`` (``link_digest``)."""
    base = b"|".join([_KEY_LABEL, suite.encode(), bytes.fromhex(client_nonce), bytes.fromhex(server_nonce),
                      str(client_id).encode(), str(server_id).encode(), digest.hex().encode()])
    return (hmac.new(secret, base + b"|client to server", hashlib.sha256).digest(),
            hmac.new(secret, base + b"|server to client", hashlib.sha256).digest())


class Sealer:
    """Seals and opens the records of one direction of one connection in ``suite``, counting
    them. What ``seal`` and ``open`` return lives in the sealer's own buffer until the next call."""

    def __init__(self, suite: str, key: bytes) -> None:
        self.suite = suite
        self.sequence = 0
        self.tag_bytes = _TAG_BYTES[suite]
        if suite in (GCM, GMAC):
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
            self._aead = AESGCM(key)
        else:
            self._mac = hmac.new(key, digestmod=hashlib.sha256)
        # GCM's ciphertext, sealed or opened (the other suites send and hand on the plaintext as is)
        self._out = bytearray(MAX_RECORD + self.tag_bytes if suite == GCM else 0)

    def _nonce(self) -> bytes:
        sequence = _SEQUENCE.pack(self.sequence)
        self.sequence += 1
        return sequence

    def seal(self, plaintext: memoryview) -> List[Any]:
        """The record carrying ``plaintext`` (1 .. MAX_RECORD bytes), as buffers to send in order."""
        n = len(plaintext)
        header = RECORD_HEADER.pack(n)
        sequence = self._nonce()
        if self.suite == GCM:
            out = memoryview(self._out)[:n + self.tag_bytes]
            self._aead.encrypt_into(bytes(4) + sequence, plaintext, header, out)
            return [header, out]
        if self.suite == GMAC:
            return [header, plaintext, self._aead.encrypt(header + sequence, b"", plaintext)]
        mac = self._mac.copy()
        mac.update(sequence + header)
        mac.update(plaintext)
        return [header, plaintext, mac.digest()]

    def open(self, header: bytes, sealed: memoryview) -> Optional[memoryview]:
        """The plaintext of the record ``header`` + ``sealed`` (body and tag), or None if it
        fails its check."""
        sequence = self._nonce()
        n = len(sealed) - self.tag_bytes
        if self.suite == GCM:
            from cryptography.exceptions import InvalidTag
            out = memoryview(self._out)[:n]
            try:
                self._aead.decrypt_into(bytes(4) + sequence, sealed, header, out)
            except InvalidTag:
                return None
            return out
        body, tag = sealed[:n], sealed[n:]
        if self.suite == GMAC:
            expected = self._aead.encrypt(header + sequence, b"", body)
        else:
            mac = self._mac.copy()
            mac.update(sequence + header)
            mac.update(body)
            expected = mac.digest()
        return body if hmac.compare_digest(expected, tag) else None


class Relay:
    """One sealed TCP connection: ``inner`` is the socket the link uses in its place.

    Made before anything is sent under protection, started (``start``) once the handshake's last
    plaintext frame went out; until then what the link writes waits in the socket pair. Each
    direction ends on its own, as a TCP half-close: when the link closes ``inner``, what it wrote
    is sealed and sent, then the connection's write side is shut (the peer's relay hands that end
    on to its link, which closes too) and the relay waits ``LINGER_S`` for the peer's end; when
    the peer's end arrives first, the link reads what came before it, then the end. A peer that
    stops reading holds the relay no longer than ``LINGER_S`` after the link closed ``inner``
    (sends never block: they wait in ``poll`` for room or for the link's end). A record that fails
    its check, a peer sending frames unsealed, or an error closes everything at once
    (``on_failure(why)`` is called first). The sockets are closed when both directions are done.
    ``inner`` is non-blocking, as the link's own sockets are, so its deadlines apply."""

    def __init__(self, sock: socket.socket, suite: str, keys: Tuple[bytes, bytes], is_client: bool, name: str,
                 threads: Threads, on_failure: Callable[[str], None]) -> None:
        send_key, recv_key = keys if is_client else keys[::-1]
        self._sealer, self._opener = Sealer(suite, send_key), Sealer(suite, recv_key)
        self._sock = sock
        self.inner, self._outer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.inner.setblocking(False)
        self._name = name
        self._threads = threads
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._inbound_done = threading.Event()
        self._running = 0
        self._closed = False

    def start(self) -> None:
        self._sock.settimeout(None)
        self._outer.settimeout(None)
        with self._lock:
            self._running = 2
        for target in (self._outbound, self._inbound):
            try:
                self._threads.spawn(target)
            except RuntimeError as exc:  # no thread could start: the connection cannot work
                logger.warning("%s: the protected connection's relay could not start (%s)", self._name, exc)
                self._shutdown()
                if target == self._inbound:
                    self._inbound_done.set()
                self._done()

    def close(self) -> None:
        """Close it (a relay never started, or one whose link failed before it started)."""
        self._shutdown()
        for sock in (self.inner, self._outer, self._sock):
            sock.close()

    def _outbound(self) -> None:
        buffer = bytearray(MAX_RECORD)
        view = memoryview(buffer)
        try:
            while True:
                n = self._outer.recv_into(buffer)
                if n == 0:
                    break  # the link closed its end
                self._send_all(self._sealer.seal(view[:n]))
        except OSError:
            self._shutdown()
        except Exception as exc:  # noqa: BLE001 - a fault of this side's sealing: the connection ends
            self._fail(f"sealing failed: {type(exc).__name__}: {exc}")
        finally:
            _shut(self._sock, socket.SHUT_WR)  # after what was sent: the peer reads the end
            _shut(self._outer, socket.SHUT_RD)
            if not self._inbound_done.wait(LINGER_S):
                self._shutdown()  # a peer that does not close its end in time
            self._done()

    def _inbound(self) -> None:
        header = bytearray(RECORD_HEADER.size)
        body = bytearray(MAX_RECORD + self._opener.tag_bytes)
        view = memoryview(body)
        try:
            while _read_exact(self._sock, memoryview(header)):
                (length,) = RECORD_HEADER.unpack(header)
                if header == _FRAME_MAGIC:
                    self._fail("the peer sends frames unsealed (its side of the link is not protected)")
                    break
                if not 0 < length <= MAX_RECORD:
                    self._fail(f"a record of {length} bytes (at most {MAX_RECORD})")
                    break
                sealed = view[:length + self._opener.tag_bytes]
                if not _read_exact(self._sock, sealed):
                    break  # the connection ended part-way through a record
                plaintext = self._opener.open(bytes(header), sealed)
                if plaintext is None:
                    self._fail(f"record {self._opener.sequence - 1} failed its {self._opener.suite} check")
                    break
                self._outer.sendall(plaintext)
        except OSError:
            self._shutdown()
        except Exception as exc:  # noqa: BLE001 - a fault of this side's opening: the connection ends
            self._fail(f"opening failed: {type(exc).__name__}: {exc}")
        finally:
            self._inbound_done.set()
            _shut(self._outer, socket.SHUT_WR)  # after what arrived: the link reads the end
            _shut(self._sock, socket.SHUT_RD)
            self._done()

    def _send_all(self, buffers: List[Any]) -> None:
        """Send every byte of ``buffers`` in order on the TCP connection, waiting in ``poll`` for
        room or for the link to close ``inner``, after which the peer has ``LINGER_S`` to take
        the rest (OSError then)."""
        views = [memoryview(b).cast("B") for b in buffers]
        poller = select.poll()
        poller.register(self._sock, select.POLLOUT)
        poller.register(self._outer, 0)  # POLLHUP: the link closed inner
        until = None
        while views:
            try:
                sent = self._sock.sendmsg(views, [], socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            while views and sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            if views and sent:
                views[0] = views[0][sent:]
                continue
            if not views:
                return
            wait_ms = None if until is None else max(0, int((until - time.monotonic()) * 1000))
            if until is not None and wait_ms == 0:
                raise OSError(f"the peer took nothing for {LINGER_S} s after the link closed the connection")
            for fd, events in poller.poll(wait_ms):
                if fd == self._outer.fileno() and events & (select.POLLHUP | select.POLLERR) and until is None:
                    until = time.monotonic() + LINGER_S
                    poller.unregister(self._outer)

    def _fail(self, why: str) -> None:
        logger.warning("%s: %s; the connection (and its link) is closed", self._name, why)
        self._on_failure(why)
        self._shutdown()

    def _shutdown(self) -> None:
        for sock in (self._outer, self._sock):
            _shut(sock, socket.SHUT_RDWR)

    def _done(self) -> None:
        with self._lock:
            self._running -= 1
            last = self._running <= 0 and not self._closed
            if last:
                self._closed = True
        if last:
            self._outer.close()
            self._sock.close()


def _shut(sock: socket.socket, how: int) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass


def _read_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False if the stream ends first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True
