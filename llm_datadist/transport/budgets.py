"""Byte budgets on the memory a peer can make this process hold, per link, per source and per
process, and the pace at which a body holding them must arrive.

- ``LLM_DATADIST_MAX_TABLE_BYTES`` (default 1 MiB): the largest cache table reply taken from a
  peer, checked on the frame's length before a byte of it is read; a larger one fails the link.
  A real table lists the peer's tensors (an address, and with cuda_ipc an IPC handle: about
  160 bytes a tensor) and its keyed rows (about 30 bytes a key): vLLM with 128 layers of two
  caches needs about 40 KiB; 1 MiB holds 6,000 tensors or 30,000 keys.
- ``LLM_DATADIST_MAX_MESSAGE_BYTES`` (default 64 KiB): the largest notification, key release,
  unlink or table request (and their replies) taken from a peer, checked on the frame's length
  before parsing; a larger request is read, dropped and refused with ``LLM_PARAM_INVALID``, the
  link goes on (the vLLM connector's release notification is under 400 bytes).
- ``LLM_DATADIST_MAX_PARSING_BYTES`` (default 16 MiB): the bytes of control messages (requests
  and table replies) read and parsed at once in this process. It is shared out: one link holds
  at most a table reply and a message of it (``parsing_per_link``), the links of one source
  (``sockets.source_of``: an IP address over TCP, a uid over a Unix socket; for a link this side
  made, the address it linked to) at most ``LLM_DATADIST_MAX_PARSING_PER_SOURCE`` (default a
  quarter). A request that would exceed any of the three waits up to ``PARSING_WAIT_S`` and is
  then read, dropped and refused with ``LLM_LINK_BUSY``.
- ``LLM_DATADIST_MAX_STAGING_BYTES`` (default 256 MiB): the page-locked bounce buffers held by
  staged transfers in flight in this process (two 4 MiB buffers each), shared out the same way:
  one link at most ``STAGING_PER_LINK_BYTES`` (a striped transfer on each of its connections), one
  source at most ``LLM_DATADIST_MAX_STAGING_PER_SOURCE`` (default a quarter). A transfer that
  would exceed any of them waits up to its deadline and then fails (``LLM_TIMEOUT`` on the side
  that asked, ``LLM_FAILED`` from the owner), in step with its frame.
- ``LLM_DATADIST_STALL_MS`` (default 2000): a body that holds a budget -- a control message or
  reply, a staged payload the server receives -- must keep arriving: a window of this many
  milliseconds that brings neither the rest of it nor ``MIN_BYTES_PER_S`` (256 KiB/s) of it ends
  it at once. What it held is given back, its connection (so its link) is dropped, and the
  stall is counted (``stalled_parsing``, ``stalled_staging``) and logged, rate-limited. A peer
  announcing a body and then sending a byte now and then holds its share for one window, not
  for the frame's 30 s.
- ``MAX_PULL_TAG_BYTES`` (512): the longest tag a PULL frame may carry (``read_guard``), read
  before the descriptors and held only while the pull is checked; a longer one breaks the
  protocol (the link goes). A vLLM tag, a ``remote_request_id``, is at most 285 bytes.
- ``MAX_HANDSHAKE_BYTES`` (64 KiB): the largest handshake message (hello, challenge,
  authentication, reply) read from a peer, checked on the frame's length; a larger one breaks the
  protocol (that connection closes unread, ``protocol_errors``).
- ``MAX_REASON_CHARS`` (256): the longest reason kept for a lost link (``lost_links``); with
  ``MAX_LOST_RECORDS`` (1,024) records this bounds them in bytes.

``in_force()`` lists them with the values this process uses (``python -m llm_datadist info``
prints it); the refusals are counted in ``LinkManager.link_stats()`` (``refused_*``, ``stalled_*``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

logger = logging.getLogger("llm_datadist")

MAX_TABLE_BYTES_ENV = "LLM_DATADIST_MAX_TABLE_BYTES"
DEFAULT_MAX_TABLE_BYTES = 1 << 20
MAX_MESSAGE_BYTES_ENV = "LLM_DATADIST_MAX_MESSAGE_BYTES"
DEFAULT_MAX_MESSAGE_BYTES = 64 << 10
MAX_PARSING_BYTES_ENV = "LLM_DATADIST_MAX_PARSING_BYTES"
DEFAULT_MAX_PARSING_BYTES = 16 << 20
MAX_STAGING_BYTES_ENV = "LLM_DATADIST_MAX_STAGING_BYTES"
DEFAULT_MAX_STAGING_BYTES = 256 << 20
#: What the links of one source may hold of the parsing and the staging budget (default: a
#: quarter of each, ``SOURCE_SHARE_DIVISOR``).
MAX_PARSING_PER_SOURCE_ENV = "LLM_DATADIST_MAX_PARSING_PER_SOURCE"
MAX_STAGING_PER_SOURCE_ENV = "LLM_DATADIST_MAX_STAGING_PER_SOURCE"
SOURCE_SHARE_DIVISOR = 4
#: What one link may hold of the staging budget: two 4 MiB bounce buffers
#: (``staging.STAGING_CHUNK_BYTES``) for a transfer on each of its 4 connections
#: (``session.MAX_CONNECTIONS``).
STAGING_PER_LINK_BYTES = 4 * 2 * (4 << 20)
#: The window in which a body holding a budget must bring ``MIN_BYTES_PER_S`` (or its rest).
STALL_MS_ENV = "LLM_DATADIST_STALL_MS"
DEFAULT_STALL_MS = 2000
#: The slowest a body holding a budget may arrive, on average over each window.
MIN_BYTES_PER_S = 256 << 10
#: How long a control request waits for room in the parsing budget before it is refused.
PARSING_WAIT_S = 1.0
#: Longest tag of a PULL frame (``read_guard``).
MAX_PULL_TAG_BYTES = 512
#: Largest handshake message (hello, challenge, authentication, reply) read from a peer.
MAX_HANDSHAKE_BYTES = 64 << 10
#: Longest reason kept for a lost link (longer ones are cut, ``...`` appended).
MAX_REASON_CHARS = 256
#: Lost links (and links the peer ended) remembered for ``lost_links``.
MAX_LOST_RECORDS = 1024


def env_bytes(name: str, default: int) -> int:
    """A positive byte count from the environment (suffixes ``k``, ``m``, ``g``: KiB, MiB, GiB);
    ``default`` when unset or not a positive count."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(raw[-1], 1)
    try:
        value = int(raw[:-1] if scale != 1 else raw) * scale
    except ValueError:
        return default
    return value if value > 0 else default


def stall_ms() -> int:
    """The stall window in milliseconds (``LLM_DATADIST_STALL_MS``; default when unset or not a
    positive count)."""
    raw = os.environ.get(STALL_MS_ENV, "").strip()
    try:
        value = int(raw) if raw else DEFAULT_STALL_MS
    except ValueError:
        return DEFAULT_STALL_MS
    return value if value > 0 else DEFAULT_STALL_MS


def least_per_window(window_ms: int) -> int:
    """The fewest bytes a window of ``window_ms`` must bring (``MIN_BYTES_PER_S``)."""
    return max(1, MIN_BYTES_PER_S * window_ms // 1000)


def worth_logging(count: Optional[int]) -> bool:
    """Whether the ``count``-th event of a kind a peer can repeat at will is logged: the 1st, 10th,
    100th and every 1000th (every one when not counted)."""
    return count is None or count in (1, 10, 100) or count % 1000 == 0


def truncate_reason(why: str) -> str:
    """``why`` cut to ``MAX_REASON_CHARS`` (it may quote what a peer sent)."""
    why = str(why)
    return why if len(why) <= MAX_REASON_CHARS else why[:MAX_REASON_CHARS - 3] + "..."


@dataclass(eq=False)
class Share:
    """One link's account in one ``ByteBudget``: the link's source (``sockets.source_of``; None:
    not known) and the bytes the link holds of the budget now (changed under the budget's lock)."""

    source: Any = None
    held: int = 0


@dataclass(eq=False)
class LinkShares:
    """A link's accounts in the process's parsing and staging budgets (``Link.shares``)."""

    source: Any = None
    parsing: Share = field(init=False)
    staging: Share = field(init=False)

    def __post_init__(self) -> None:
        self.parsing, self.staging = Share(self.source), Share(self.source)


class ByteBudget:
    """A semaphore of bytes: ``acquire(n)`` takes ``n`` of ``limit`` bytes (waiting up to
    ``timeout`` seconds for room), ``release(n)`` gives them back. Taken for a link's ``Share``,
    the bytes also count against the link's ``per_link`` and its source's ``per_source``: a
    request that would exceed any of the three waits. A request larger than one of them is
    admitted only when nothing else is held under it (so that it cannot wait for ever)."""

    def __init__(self, limit: int, per_source: Optional[int] = None, per_link: Optional[int] = None) -> None:
        self.limit = limit
        self.per_source = min(limit, per_source or limit)
        self.per_link = min(limit, per_link or limit)
        self.in_use = 0
        self.peak = 0
        self.refused = 0  # acquires that found no room in time
        self.stalled = 0  # bodies that held some of it and stalled (``note_stall``)
        self._by_source: Dict[Any, int] = {}
        self._cond = threading.Condition()

    def blocker(self, nbytes: int, share: Optional[Share] = None) -> Optional[str]:
        """What keeps ``nbytes`` out now: ``"process"``, ``"source"`` or ``"link"``; None if they
        fit (lock held, or for a report)."""
        if self.in_use and self.in_use + nbytes > self.limit:
            return "process"
        if share is None:
            return None
        held = self._by_source.get(share.source, 0)
        if held and held + nbytes > self.per_source:
            return "source"
        if share.held and share.held + nbytes > self.per_link:
            return "link"
        return None

    def acquire(self, nbytes: int, timeout: Optional[float] = 0.0, share: Optional[Share] = None) -> bool:
        return self.take(nbytes, timeout, share) is None

    def take(self, nbytes: int, timeout: Optional[float] = 0.0, share: Optional[Share] = None) -> Optional[str]:
        """``acquire``, saying why not: None once taken, else the bound that kept it out until
        ``timeout`` (``blocker``)."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with self._cond:
            while True:
                blocked = self.blocker(nbytes, share)
                if blocked is None:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self.refused += 1
                    return blocked
                self._cond.wait(left)
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
            if share is not None:
                share.held += nbytes
                self._by_source[share.source] = self._by_source.get(share.source, 0) + nbytes
            return None

    def release(self, nbytes: int, share: Optional[Share] = None) -> None:
        with self._cond:
            self.in_use -= nbytes
            if share is not None:
                share.held -= nbytes
                held = self._by_source.pop(share.source, 0) - nbytes
                if held > 0:
                    self._by_source[share.source] = held
            self._cond.notify_all()

    def held_by(self, source: Any) -> int:
        """The bytes the links of ``source`` hold now."""
        with self._cond:
            return self._by_source.get(source, 0)

    def note_stall(self, what: str, who: str) -> None:
        """Count a body holding some of this budget that stalled (its link is dropped); logged at
        the 1st, 10th, 100th and every 1000th."""
        with self._cond:
            self.stalled += 1
            stalled = self.stalled
        if worth_logging(stalled):
            logger.warning("dropped the link of %s: %s stalled (less than %d bytes in %d ms, %s); %d stalled "
                           "bodies so far", who, what, least_per_window(stall_ms()), stall_ms(), STALL_MS_ENV,
                           stalled)


_lock = threading.Lock()
_process_budgets: Dict[str, ByteBudget] = {}


def _process_budget(env: str, default: int, source_env: str, per_link: int) -> ByteBudget:
    """This process's one ``ByteBudget`` sized by ``env``, shared out per source by ``source_env``
    and per link by ``per_link`` (made on first use)."""
    with _lock:
        budget = _process_budgets.get(env)
        if budget is None:
            limit = env_bytes(env, default)
            budget = _process_budgets[env] = ByteBudget(
                limit, env_bytes(source_env, max(1, limit // SOURCE_SHARE_DIVISOR)), per_link)
        return budget


def parsing() -> ByteBudget:
    """This process's budget of control-message bytes being read and parsed."""
    return _process_budget(MAX_PARSING_BYTES_ENV, DEFAULT_MAX_PARSING_BYTES, MAX_PARSING_PER_SOURCE_ENV,
                           max_table_bytes() + max_message_bytes())


def staging() -> ByteBudget:
    """This process's budget of page-locked bounce memory held by staged transfers."""
    return _process_budget(MAX_STAGING_BYTES_ENV, DEFAULT_MAX_STAGING_BYTES, MAX_STAGING_PER_SOURCE_ENV,
                           STAGING_PER_LINK_BYTES)


def max_table_bytes() -> int:
    return env_bytes(MAX_TABLE_BYTES_ENV, DEFAULT_MAX_TABLE_BYTES)


def max_message_bytes() -> int:
    return env_bytes(MAX_MESSAGE_BYTES_ENV, DEFAULT_MAX_MESSAGE_BYTES)


@dataclass(frozen=True)
class Budget:
    """One bound on what peers can make this process hold, as ``in_force`` reports it."""

    name: str
    value: int
    unit: str  # "bytes", "records", "characters" or "ms"
    scope: str  # what one budget covers: "link", "source", "message", "process", "window", "engine" or "record"
    env: Optional[str]  # the environment variable that sets it (None: fixed)
    default: int
    refusal: str  # what happens beyond it, and the counter of ``LinkManager.link_stats`` that counts it


def in_force() -> List[Budget]:
    """The byte budgets, record limits and stall window this process applies: the per-link and
    per-message budgets and the window as the environment says now, the process budgets and their
    shares as they were sized on first use."""
    parsing_budget, staging_budget = parsing(), staging()
    window = stall_ms()
    return [
        Budget("table", max_table_bytes(), "bytes", "link", MAX_TABLE_BYTES_ENV, DEFAULT_MAX_TABLE_BYTES,
               "the link fails, the reply unread (refused_tables)"),
        Budget("message", max_message_bytes(), "bytes", "message", MAX_MESSAGE_BYTES_ENV,
               DEFAULT_MAX_MESSAGE_BYTES, "the request is read, dropped unparsed and refused with LLM_PARAM_INVALID "
               "(refused_oversized)"),
        Budget("parsing", parsing_budget.limit, "bytes", "process", MAX_PARSING_BYTES_ENV, DEFAULT_MAX_PARSING_BYTES,
               f"a request waits up to {PARSING_WAIT_S:g} s, then is refused with LLM_LINK_BUSY (refused_parsing)"),
        Budget("parsing_per_source", parsing_budget.per_source, "bytes", "source", MAX_PARSING_PER_SOURCE_ENV,
               max(1, parsing_budget.limit // SOURCE_SHARE_DIVISOR),
               "as for parsing: the links of one source hold no more of it (refused_parsing)"),
        Budget("parsing_per_link", parsing_budget.per_link, "bytes", "link", None, parsing_budget.per_link,
               "as for parsing: one link (a table reply and a message) holds no more of it (refused_parsing)"),
        Budget("staging", staging_budget.limit, "bytes", "process", MAX_STAGING_BYTES_ENV, DEFAULT_MAX_STAGING_BYTES,
               "a staged transfer waits, then fails at its deadline (refused_staging)"),
        Budget("staging_per_source", staging_budget.per_source, "bytes", "source", MAX_STAGING_PER_SOURCE_ENV,
               max(1, staging_budget.limit // SOURCE_SHARE_DIVISOR),
               "as for staging: the links of one source hold no more of it (refused_staging)"),
        Budget("staging_per_link", staging_budget.per_link, "bytes", "link", None, STAGING_PER_LINK_BYTES,
               "as for staging: one link's transfers hold no more of it (refused_staging)"),
        Budget("stall", window, "ms", "window", STALL_MS_ENV, DEFAULT_STALL_MS,
               f"a control body or staged push bringing less than {MIN_BYTES_PER_S >> 10} KiB/s (or its rest) "
               f"in a window gives back what it held at once, and its link is dropped (stalled_parsing, "
               f"stalled_staging)"),
        Budget("handshake", MAX_HANDSHAKE_BYTES, "bytes", "message", None, MAX_HANDSHAKE_BYTES,
               "a protocol error: that connection closes unread (protocol_errors)"),
        Budget("pull_tag", MAX_PULL_TAG_BYTES, "bytes", "pull", None, MAX_PULL_TAG_BYTES,
               "a protocol error: the link's connection closes (protocol_errors)"),
        Budget("lost_links", MAX_LOST_RECORDS, "records", "engine", None, MAX_LOST_RECORDS,
               "the oldest record is dropped"),
        Budget("lost_reason", MAX_REASON_CHARS, "characters", "record", None, MAX_REASON_CHARS,
               "the reason is cut, '...' appended"),
    ]
