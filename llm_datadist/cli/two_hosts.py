"""What the two-host modes of ``demo`` and ``bench`` (``--role``) share.

* ``--listen HOST:PORT`` / ``--peer HOST:PORT`` (``parse_address``, ``resolve``) and the link
  secret read from a file (``read_secret_file``): each side runs one engine, and the link between
  them is authenticated with that secret;
* ``link_to``: link to the peer's listener, retried while nothing answers there, until a deadline;
* ``PeerChannel``: the messages the peer sends over the link (``LLMDataDist.engine.notify``: JSON
  objects within the notification budget, 64 KiB), handed to the main thread, which waits for the
  one it expects -- and fails if the link ends or the peer stays silent for too long;
* ``Heartbeat``: a message every second or so while this side works, so that the peer's silence
  limit measures the peer's absence, not the length of a step;
* ``check_fields`` and its kin: strict checks of a message's fields. Everything a peer sends is
  untrusted: a message is refused unless it has exactly the fields expected, of the types and in
  the ranges expected.

Errors are ``TwoHostError``: one line for the user, exit status 2.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from llm_datadist.status import LLMException
from llm_datadist.transport import auth

#: Default of ``--timeout``: how long a side waits for its peer to link, to answer, or to speak
#: again, and the deadline of one transfer call.
DEFAULT_TIMEOUT_S = 60.0
#: How often a working side tells its peer that it is still there (at most; see ``heartbeat_interval``).
HEARTBEAT_S = 1.0
#: Pause between two attempts to link to a peer that does not answer yet.
RELINK_PAUSE_S = 0.2
#: How long the side that answers last waits for the other to end the link, before closing anyway.
CLOSING_WAIT_S = 5.0
#: The largest integer a message may carry (a signed 64-bit value).
MAX_INT = (1 << 63) - 1
#: Longest text a peer may send in a message (a reason, a plane name, a version).
MAX_TEXT = 200
#: Messages of the peer waiting for the main thread, at most (it expects a few at a time).
MAX_QUEUED = 256


class TwoHostError(Exception):
    """A two-host run cannot go on (bad address or secret file, no peer, a peer that left or sent
    something malformed): a one-line message, exit status 2."""


class PeerAborted(TwoHostError):
    """The peer stopped and said why (its ``abort`` message)."""


class PeerClosed(TwoHostError):
    """The peer ended the link itself (an unlink, not a broken connection)."""


# -- flags ------------------------------------------------------------------------------------------

def parse_address(text: str, listening: bool) -> Tuple[str, int]:
    """``HOST:PORT`` -> ``(host, port)``; ``ValueError`` naming what is wrong. Port 0 (any free
    port) only for a listener. The host is not resolved here (``resolve``)."""
    host, colon, port_text = text.strip().rpartition(":")
    if not colon or not host or not port_text.isdigit():
        raise ValueError(f"not HOST:PORT: {text!r}")
    port = int(port_text)
    low = 0 if listening else 1
    if not low <= port <= 65535:
        raise ValueError(f"port {port} is not in {low}..65535")
    return host, port


def check_role_flags(args, listening: str, linking: str, listening_first: bool = False) -> Optional[str]:
    """What is wrong with ``args``' ``--role``, ``--listen``, ``--peer``, ``--secret-file`` and
    ``--timeout`` together, or None: a role ``listening`` (takes ``--listen``) or ``linking`` (takes
    ``--peer``), each with ``--secret-file``; without a role, none of the others (the refusal names
    the roles in the command's own order: ``listening_first``)."""
    given = [flag for flag, value in (("--listen", args.listen), ("--peer", args.peer),
                                      ("--secret-file", args.secret_file), ("--timeout", args.timeout))
             if value is not None]
    if args.role is None:
        first, second = (listening, linking) if listening_first else (linking, listening)
        return f"{given[0]} needs --role {first} or --role {second}" if given else None
    needed, refused = ("--listen", "--peer") if args.role == listening else ("--peer", "--listen")
    if needed not in given:
        return f"--role {args.role} needs {needed} HOST:PORT"
    if refused in given:
        return f"--role {args.role} takes {needed}, not {refused}"
    if args.secret_file is None:
        return f"--role {args.role} needs --secret-file PATH (the link secret both sides share)"
    return None


def resolve(host: str) -> str:
    """The IPv4 address of ``host`` (a name or an address); ``TwoHostError`` if it has none."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError, IndexError) as exc:
        raise TwoHostError(f"cannot resolve {host!r} to an IPv4 address: {exc}") from None


def read_secret_file(path: str) -> str:
    """The link secret in ``path`` (``auth.read_secret_file``: a key's rules); its refusal as a
    ``TwoHostError``."""
    try:
        return auth.read_secret_file(path)
    except LLMException as exc:
        raise TwoHostError(exc.args[0]) from None


def heartbeat_interval(timeout_s: float) -> float:
    """A heartbeat often enough for a silence limit of ``timeout_s``."""
    return max(0.05, min(HEARTBEAT_S, timeout_s / 4))


# -- messages ---------------------------------------------------------------------------------------

def is_int(value: Any, low: int = 0, high: int = MAX_INT) -> bool:
    """An integer (not a bool) in ``[low, high]``."""
    return type(value) is int and low <= value <= high


def check_fields(message: Any, what: str, checks: Dict[str, Callable[[Any], bool]]) -> dict:
    """``message`` if it is a JSON object with exactly the fields of ``checks``, each passing its
    check; else ``TwoHostError`` naming the first problem (``what`` names the message)."""
    if not isinstance(message, dict):
        raise TwoHostError(f"{what} is not a JSON object")
    missing = sorted(set(checks) - set(message))
    extra = sorted(set(message) - set(checks))
    if missing or extra:
        parts = ([f"lacks {', '.join(missing)}"] if missing else []) + \
                ([f"has unknown fields {', '.join(_short(k) for k in extra[:5])}"] if extra else [])
        raise TwoHostError(f"{what} {' and '.join(parts)}")
    for name, check in checks.items():
        if not check(message[name]):
            raise TwoHostError(f"{what}: field {name} has a bad value {_short(message[name])}")
    return message


def text_field(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_TEXT and value.isprintable()


def int_list(values: Any, max_items: int, low: int = 0, high: int = MAX_INT) -> bool:
    return isinstance(values, list) and len(values) <= max_items and all(is_int(v, low, high) for v in values)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- linking ----------------------------------------------------------------------------------------

class _FailedAttempts(logging.Filter):
    """Keeps the engine's log line of each failed link attempt (the reason, for the final
    message) and drops it from the log: retrying while the peer starts is expected."""

    def __init__(self) -> None:
        super().__init__()
        self.last: Optional[str] = None

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str) or not record.msg.startswith("link "):
            return True
        message = record.getMessage()
        if " failed: " in message:
            self.last = message.split(" failed: ", 1)[1].split(" (status_code=")[0]
            return False
        return True


def link_to(engine, ip: str, port: int, timeout_s: float, expected_id: int, peer_name: str) -> None:
    """Link ``engine`` to the listener at ``ip:port``, which must be cluster ``expected_id`` (the
    ``peer_name`` side), retrying every ``RELINK_PAUSE_S`` while nothing answers, until
    ``timeout_s`` have passed. A peer that refuses the link secret, or any peer that answers and
    still fails the link, ends the attempts at once."""
    deadline = time.monotonic() + timeout_s
    attempts = _FailedAttempts()
    logger = logging.getLogger("llm_datadist")
    logger.addFilter(attempts)
    try:
        while True:
            auth_failures = engine.link_stats().get("auth_failures", 0)
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            status, peer_id = engine.link_address(ip, port, left_ms)
            if int(status) == 0:
                break
            if engine.link_stats().get("auth_failures", 0) > auth_failures:
                raise TwoHostError(f"the {peer_name} at {ip}:{port} refused the link: {attempts.last or status.name} "
                                   f"(is the secret file the same on both sides?)")
            if peer_id is not None:  # a cluster answered there, and the link failed all the same
                raise TwoHostError(f"the link to the {peer_name} at {ip}:{port} failed: "
                                   f"{attempts.last or getattr(status, 'name', status)}")
            if time.monotonic() + RELINK_PAUSE_S >= deadline:
                why = attempts.last or getattr(status, "name", str(status))
                raise TwoHostError(f"no {peer_name} linked at {ip}:{port} within {timeout_s:g} s (last attempt: {why})")
            time.sleep(RELINK_PAUSE_S)
    finally:
        logger.removeFilter(attempts)
    if peer_id != expected_id:
        raise TwoHostError(f"the cluster listening at {ip}:{port} is cluster {peer_id}, not the {peer_name} "
                           f"(cluster {expected_id}): is it a {peer_name} of this command?")


# -- the peer's messages ----------------------------------------------------------------------------

class PeerChannel:
    """The peer's messages, as the engine's notification handler (``handler``).

    A message is a JSON object whose field ``key`` names its kind. ``alive`` (a heartbeat) is
    answered and dropped, ``answers[kind](message)`` gives the reply of a kind that wants one
    (run on the link's thread: it must be quick; a ``TwoHostError`` it raises for a malformed
    message goes back to the peer as the reply's ``error`` and is raised by ``wait``), any other
    known kind is answered with ``{}``; every known message goes to the queue the main thread
    reads with ``wait``. A message from a cluster not in ``peers`` (when given) is refused; one of
    an unknown kind, or beyond ``MAX_QUEUED`` waiting ones, is refused and remembered as a
    protocol error, which ``wait`` raises."""

    def __init__(self, engine, key: str, kinds: Iterable[str], peer_name: str,
                 answers: Optional[Dict[str, Callable[[dict], dict]]] = None,
                 peers: Iterable[int] = ()) -> None:
        self.engine = engine
        self.key = key
        self.kinds = set(kinds) | {"alive", "abort"}
        self.peer_name = peer_name
        self.answers = dict(answers or {})
        self.peers = set(peers)
        self.linked: set = set()  # peers seen linked: their link ending is the peer leaving
        self.last_heard = time.monotonic()
        self._queue: "queue.Queue[Tuple[int, dict]]" = queue.Queue(MAX_QUEUED)
        self._problem: Optional[str] = None

    def handler(self, peer_id: int, message: Any) -> dict:
        if self.peers and peer_id not in self.peers:
            return {"error": f"cluster {peer_id} is not this run's {self.peer_name}"}
        kind = message.get(self.key) if isinstance(message, dict) else None
        if not isinstance(kind, str) or kind not in self.kinds:
            self._problem = self._problem or f"the {self.peer_name} sent a message of unknown kind {_short(kind)}"
            return {"error": "unknown message"}
        self.last_heard = time.monotonic()
        if kind == "alive":
            return {}
        if self._queue.full():  # before the answer runs: a flood gets nothing done
            self._problem = self._problem or f"the {self.peer_name} sent more than {MAX_QUEUED} messages unasked"
            return {"error": "too many messages"}
        answer = self.answers.get(kind)
        try:
            reply = answer(message) if answer is not None else {}
        except TwoHostError as exc:  # a malformed message: the peer is told, the main thread stops
            self._problem = self._problem or str(exc)
            return {"error": str(exc)[:MAX_TEXT]}
        try:
            self._queue.put_nowait((peer_id, message))
        except queue.Full:
            self._problem = self._problem or f"the {self.peer_name} sent more than {MAX_QUEUED} messages unasked"
            return {"error": "too many messages"}
        return reply

    def heard_from(self, peer_id: int) -> None:
        """``peer_id`` is linked: from now on its link ending means it left."""
        self.linked.add(peer_id)
        self.last_heard = time.monotonic()

    def wait(self, kind, silence_s: float, doing: str) -> dict:
        """The next message, which must be of ``kind`` (a kind or a tuple of kinds);
        ``TwoHostError`` if the peer sends another kind or a malformed ``abort``, its link ends,
        or it stays silent for ``silence_s`` (``doing`` says what was awaited); ``PeerAborted``
        with its reason if it stopped."""
        kinds = (kind,) if isinstance(kind, str) else tuple(kind)
        while True:
            try:
                peer_id, message = self._queue.get(timeout=0.05)
            except queue.Empty:
                self._check_peer(silence_s, doing)
                continue
            self.linked.add(peer_id)
            got = message[self.key]
            if got == "abort":
                raise self._aborted(message)
            if got not in kinds:
                raise TwoHostError(f"the {self.peer_name} sent {_short(got)} while this side waited for "
                                   f"{' or '.join(kinds)}")
            return message

    def _check_peer(self, silence_s: float, doing: str) -> None:
        if self._problem is not None:
            raise TwoHostError(self._problem)
        lost = self.engine.lost_links()
        for peer_id in self.linked:
            if peer_id in lost:
                raise TwoHostError(f"the link to the {self.peer_name} ended ({lost[peer_id]})")
        if self.linked and not self.linked & set(self.engine.linked_clusters()):
            raise PeerClosed(f"the {self.peer_name} closed the link")
        if time.monotonic() - self.last_heard > silence_s:
            raise TwoHostError(f"no word from the {self.peer_name} for {silence_s:g} s (--timeout) while {doing}")

    def send(self, peer_id: int, message: dict, timeout_s: float) -> dict:
        """``send`` to the peer; if that fails because the peer stopped, its ``abort`` (or the end
        of its link) is the error rather than the failed delivery."""
        try:
            return send(self.engine, peer_id, message, timeout_s, self.peer_name)
        except TwoHostError as exc:
            raise self.peer_failure() or exc from None

    def peer_failure(self) -> Optional[TwoHostError]:
        """Why the peer is not there (its ``abort``, a link that ended), or None: what explains a
        failed call better than the call's own error."""
        try:
            self._raise_abort()
            self._check_peer(float("inf"), "")
        except TwoHostError as exc:
            return exc
        return None

    def _aborted(self, message: dict) -> TwoHostError:
        reason = message.get("why")
        if not text_field(reason) or set(message) != {self.key, "why"}:
            return TwoHostError(f"the {self.peer_name} stopped (its message was malformed)")
        return PeerAborted(f"the {self.peer_name} stopped: {reason}")

    def _raise_abort(self) -> None:
        """Raise the peer's ``abort`` if one comes within a moment (other queued messages are
        dropped: this side is failing anyway)."""
        deadline = time.monotonic() + 0.2  # the abort may still be on its way
        while time.monotonic() < deadline:
            try:
                _, message = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            if message[self.key] == "abort":
                raise self._aborted(message)

    def abort(self, peer_id: Optional[int], why: str) -> None:
        """Tell the peer (if ``peer_id`` is linked) why this side stops: best effort, quickly."""
        if peer_id is None or peer_id not in self.engine.linked_clusters():
            return
        try:
            self.engine.notify(peer_id, {self.key: "abort", "why": why[:MAX_TEXT]}, 1000)
        except Exception:  # the peer may be gone already: it learns from the link ending instead
            pass

    def wait_gone(self, peer_id: int, limit_s: float) -> None:
        """Wait up to ``limit_s`` for the link to ``peer_id`` to end (the peer closing it)."""
        deadline = time.monotonic() + limit_s
        while peer_id in self.engine.linked_clusters() and time.monotonic() < deadline:
            time.sleep(0.02)


def send(engine, peer_id: int, message: dict, timeout_s: float, peer_name: str) -> dict:
    """Send ``message`` to the peer and return its reply; ``TwoHostError`` if it cannot be
    delivered or the peer answers with an error."""
    from llm_datadist import LLMException
    try:
        reply = engine.notify(peer_id, message, max(1, int(timeout_s * 1000)))
    except LLMException as exc:
        raise TwoHostError(f"the {peer_name} did not take a message: {str(exc).split(' (status_code')[0]}") from None
    if isinstance(reply, dict) and "error" in reply:
        why = reply["error"]
        raise TwoHostError(f"the {peer_name} refused a message: {why if text_field(why) else '(malformed reason)'}")
    return reply


class Heartbeat:
    """Sends ``{key: "alive"}`` to ``peer_id`` every ``interval_s`` from a thread of its own, from
    ``start`` to ``stop``; a failure (the link is gone) ends it quietly: the main thread learns of
    the loss from ``PeerChannel``."""

    def __init__(self, engine, peer_id: int, key: str, interval_s: float, timeout_s: float) -> None:
        self._notify, self._peer, self._key = engine.notify, peer_id, key
        self._interval, self._timeout_ms = interval_s, max(1, int(timeout_s * 1000))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llm_datadist-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._notify(self._peer, {self._key: "alive"}, self._timeout_ms)
            except Exception:
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self._timeout_ms / 1000 + 1)

    def __enter__(self) -> "Heartbeat":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def send_ints(channel: PeerChannel, peer_id: int, kind: str, values: List[int], timeout_s: float,
              chunk: int = 2000) -> None:
    """Send a list of integers in messages of ``chunk`` values (``{key: kind, "first": index,
    "values": [...]}``), within the notification budget whatever their number."""
    for first in range(0, len(values), chunk):
        channel.send(peer_id, {channel.key: kind, "first": first, "values": values[first:first + chunk]}, timeout_s)


def receive_ints(channel: PeerChannel, kind: str, count: int, silence_s: float, doing: str,
                 chunk: int = 2000) -> List[int]:
    """The ``count`` integers ``send_ints`` sends, checked chunk by chunk."""
    values: List[int] = []
    while len(values) < count:
        have, room = len(values), min(chunk, count - len(values))
        message = check_fields(channel.wait(kind, silence_s, doing), f"the {channel.peer_name}'s {kind} message",
                               {channel.key: lambda v: True, "first": lambda v, have=have: is_int(v) and v == have,
                                "values": lambda v, room=room: int_list(v, room) and len(v) > 0})
        values += message["values"]
    return values
