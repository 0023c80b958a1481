"""Read guards: which registered memory a linked peer may read through this engine's server.

A pull over a server-mediated plane (``tcp``, and ``staging``, whose frames are tcp's) reaches
``server.Requests.pull``, which checks it against the registry; an engine owner may narrow that
further with a guard, ``fn(peer_cluster_id, tag) -> allowed ranges or None`` (``ReadGuard.set``).
The tag is opaque bytes (at most ``budgets.MAX_PULL_TAG_BYTES``) that the puller sends in its
``OP_PULL`` frame: the pulls a thread makes inside ``tagged(tag)`` carry it. With a guard
installed, a pull without a tag, with a tag the guard refuses (None) or with a range outside the
ranges the guard allows for its tag is refused with ``LLM_KV_CACHE_NOT_EXIST`` (what a pull of
unregistered memory gets) before a byte moves, and the link goes on.

Reads over one-sided planes (``cma``, ``cuda_ipc``) never reach the server, so no guard sees them:
an authenticated peer on such a plane can read every registered cache.

Write guards (``WriteGuard``) are the same for pushes: a push through the server
(``server.Requests.push``) with a guard installed, ``fn(peer_cluster_id) -> allowed ranges or
None``, is refused with ``LLM_KV_CACHE_NOT_EXIST`` before a byte lands unless every one of its
descriptors' destination ranges lies inside the ranges the guard allows that authenticated peer
now (a push carries no tag: grants are keyed by the peer, so the wire is unchanged). The refused
payload is read and dropped and the link goes on. Writes over one-sided planes are not seen.
A push that passed the guard goes on writing while its payload streams in: the guard counts such
pushes per peer (``WriteGuard.writing``), so that an owner that narrowed what a peer may write can
wait until none that passed before is left (``WriteGuard.quiesce``); past its deadline the
connections carrying them are shut down, so no further byte of theirs lands (the link ends).
"""

from __future__ import annotations

import contextvars
import logging
import os
import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Tuple, Union

from llm_datadist import _io
from llm_datadist.transport.budgets import MAX_PULL_TAG_BYTES
from llm_datadist.transport.errors import S

logger = logging.getLogger("llm_datadist")

#: ``guard(peer_cluster_id, tag) -> allowed ranges or None``: the ranges as an ``_io.RangeSet`` or
#: ``(address, nbytes)`` pairs; None refuses every pull carrying ``tag``.
Guard = Callable[[int, bytes], Optional[Union[Any, Iterable[Tuple[int, int]]]]]

#: The status a guard's refusal answers.
REFUSED = S.LLM_KV_CACHE_NOT_EXIST

#: A refusal is logged the first time and then every this many (a peer may retry in a loop).
LOG_EVERY = 1000

_tag: "contextvars.ContextVar[bytes]" = contextvars.ContextVar("llm_datadist_pull_tag", default=b"")


def check_tag(tag: Any) -> bytes:
    """``tag`` as bytes; ValueError if it is not bytes-like or longer than ``MAX_PULL_TAG_BYTES``."""
    if isinstance(tag, str):
        tag = tag.encode("utf-8", "surrogatepass")
    if not isinstance(tag, (bytes, bytearray, memoryview)):
        raise ValueError(f"a pull tag is bytes, not {type(tag).__name__}")
    tag = bytes(tag)
    if len(tag) > MAX_PULL_TAG_BYTES:
        raise ValueError(f"a pull tag of {len(tag)} bytes exceeds {MAX_PULL_TAG_BYTES}")
    return tag


@contextmanager
def tagged(tag: Any) -> Iterator[bytes]:
    """The pulls this thread (or task) makes inside carry ``tag`` (bytes, or str as UTF-8)."""
    token = _tag.set(check_tag(tag))
    try:
        yield _tag.get()
    finally:
        _tag.reset(token)


def current_tag() -> bytes:
    """The tag of the pulls the calling thread makes now (``b""``: none)."""
    return _tag.get()


class ReadGuard:
    """The owner's side: the guard in force (none by default) and its refusals."""

    def __init__(self, cluster_id: int, count: Callable[[str], Any] = lambda counter: 0) -> None:
        self.cluster_id = cluster_id
        self._guard: Optional[Guard] = None
        self._count = count  # counts a refusal (``LinkManager.stats["refused_reads"]``)
        self._lock = threading.Lock()
        self._refusals = 0

    @property
    def installed(self) -> bool:
        return self._guard is not None

    def set(self, guard: Optional[Guard]) -> None:
        """Check every pull with ``guard`` from now on (None: no guard, the registry alone)."""
        if guard is not None and not callable(guard):
            raise TypeError("a read guard is a callable guard(peer_cluster_id, tag)")
        self._guard = guard

    def refusal(self, peer_id: int, tag: bytes, plan) -> int:
        """0 if the source ranges of ``plan`` may be read by ``peer_id`` with ``tag``, else the
        status to answer (the refusal counted and logged, rate-limited)."""
        guard = self._guard
        if guard is None:
            return 0
        if not tag:
            return self._refuse(peer_id, "a pull without a tag")
        try:
            allowed = guard(peer_id, bytes(tag))
            if allowed is None:
                return self._refuse(peer_id, "a pull whose tag the read guard refuses")
            if not isinstance(allowed, _io.RangeSet):
                allowed = _io.RangeSet(allowed)
        except Exception as exc:  # noqa: BLE001 - a failing guard refuses; the link goes on
            return self._refuse(peer_id, f"a pull the read guard failed on ({type(exc).__name__}: {exc})")
        bad = allowed.first_outside(plan, False)
        if bad >= 0:
            return self._refuse(peer_id, f"a pull whose range {bad} lies outside what its tag allows")
        return 0

    def _refuse(self, peer_id: int, what: str) -> int:
        self._count("refused_reads")
        with self._lock:
            self._refusals += 1
            refusals = self._refusals
        if refusals % LOG_EVERY == 1:
            logger.warning("cluster %d refused %s from cluster %d (%d refused reads so far; the link stays)",
                           self.cluster_id, what, peer_id, refusals)
        return REFUSED


#: ``guard(peer_cluster_id) -> allowed ranges or None``: what that peer may write now.
WriteGuardFn = Callable[[int], Optional[Union[Any, Iterable[Tuple[int, int]]]]]


class WriteGuard:
    """The owner's side of pushes: the guard in force (none by default) and its refusals
    (``refused_writes``)."""

    def __init__(self, cluster_id: int, count: Callable[[str], Any] = lambda counter: 0) -> None:
        self.cluster_id = cluster_id
        self._guard: Optional[WriteGuardFn] = None
        self._count = count
        self._lock = threading.Lock()
        self._refusals = 0
        #: pushes checked and still writing: peer -> connection fd -> how many (``writing``)
        self._writing: Dict[int, Dict[int, int]] = {}
        self._done = threading.Condition(self._lock)
        #: per peer, the guard's last answer if a tuple, and its ``RangeSet``: an owner that answers
        #: with the same tuple of ``(address, nbytes)`` tuples until what the peer may write changes
        #: has it converted once (a list is converted every time: it may change in place)
        self._converted: Dict[int, Tuple[Any, Any]] = {}

    @property
    def installed(self) -> bool:
        return self._guard is not None

    @contextmanager
    def writing(self, peer_id: int, fd: int) -> Iterator[None]:
        """Around one push of ``peer_id`` on connection ``fd``, from before its check until its
        last byte landed or it was refused (``Requests.push``). Counted only while a guard is
        installed: without one nothing is ever narrowed, so nothing is waited for."""
        if self._guard is None:
            yield
            return
        with self._lock:
            fds = self._writing.setdefault(peer_id, {})
            fds[fd] = fds.get(fd, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                fds = self._writing.get(peer_id, {})
                if fds.get(fd, 1) > 1:
                    fds[fd] -= 1
                else:
                    fds.pop(fd, None)
                if not fds:
                    self._writing.pop(peer_id, None)
                self._done.notify_all()

    def quiesce(self, peer_id: int, timeout_s: float) -> bool:
        """Wait until no push of ``peer_id`` that passed the guard is still writing; True if none
        was left within ``timeout_s``. Else the connections carrying them are shut down (those
        pushes fail, the link ends, no further byte of theirs lands), the wait goes on at most a
        second more for them to stop, and False is returned. For an owner that narrowed what the
        guard allows that peer (a grant ended): pushes checked from then on see the narrower ranges."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            while self._writing.get(peer_id):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._done.wait(left)
            else:
                return True
            fds = list(self._writing.get(peer_id, {}))
        for fd in fds:
            _shutdown(fd)
        logger.warning("cluster %d: %d connection(s) of cluster %d still wrote a push %.1f s after what it may "
                       "write was narrowed; shut down (the link ends)", self.cluster_id, len(fds), peer_id, timeout_s)
        with self._lock:
            self._done.wait_for(lambda: not self._writing.get(peer_id), 1.0)
        return False

    def set(self, guard: Optional[WriteGuardFn]) -> None:
        """Check every push with ``guard`` from now on (None: no guard, the registry alone)."""
        if guard is not None and not callable(guard):
            raise TypeError("a write guard is a callable guard(peer_cluster_id)")
        self._guard = guard

    def refusal(self, peer_id: int, plan) -> int:
        """0 if every destination range of ``plan`` may be written by ``peer_id``, else the
        status to answer (counted, and logged rate-limited)."""
        guard = self._guard
        if guard is None:
            return 0
        try:
            allowed = guard(peer_id)
            if allowed is None:
                return self._refuse(peer_id, "a push from a peer that holds no write grant")
            if not isinstance(allowed, _io.RangeSet):
                last = self._converted.get(peer_id) if type(allowed) is tuple else None
                if last is not None and last[0] is allowed:
                    allowed = last[1]
                elif type(allowed) is tuple:
                    answer, allowed = allowed, _io.RangeSet(allowed)
                    self._converted[peer_id] = (answer, allowed)  # (holds the answer: its id stays its own)
                else:
                    allowed = _io.RangeSet(allowed)  # (a list may change in place: converted every time)
        except Exception as exc:  # noqa: BLE001 - a failing guard refuses; the link goes on
            return self._refuse(peer_id, f"a push the write guard failed on ({type(exc).__name__}: {exc})")
        bad = allowed.first_outside(plan, True)
        if bad >= 0:
            return self._refuse(peer_id, f"a push whose range {bad} lies outside what its grants allow")
        return 0

    def _refuse(self, peer_id: int, what: str) -> int:
        self._count("refused_writes")
        with self._lock:
            self._refusals += 1
            refusals = self._refusals
        if refusals % LOG_EVERY == 1:
            logger.warning("cluster %d refused %s from cluster %d (%d refused writes so far; the link stays)",
                           self.cluster_id, what, peer_id, refusals)
        return REFUSED


def _shutdown(fd: int) -> None:
    """Shut the socket of ``fd`` down both ways, through a duplicate (``fd`` stays its owner's)."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        dup.close()
