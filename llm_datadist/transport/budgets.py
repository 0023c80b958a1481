"""Byte budgets on the memory a peer can make this process hold, per link and per process.

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
  and table replies) read and parsed at once in this process; a request that would exceed it
  waits up to ``PARSING_WAIT_S`` and is then read, dropped and refused with ``LLM_LINK_BUSY``.
- ``LLM_DATADIST_MAX_STAGING_BYTES`` (default 256 MiB): the page-locked bounce buffers held by
  staged transfers in flight in this process (two 4 MiB buffers each); a transfer that would
  exceed it waits up to its deadline and then fails (``LLM_TIMEOUT`` on the side that asked,
  ``LLM_FAILED`` from the owner), in step with its frame.
- ``MAX_PULL_TAG_BYTES`` (512): the longest tag a PULL frame may carry (``read_guard``), read
  before the descriptors and held only while the pull is checked; a longer one breaks the
  protocol (the link goes). A vLLM tag, a ``remote_request_id``, is at most 285 bytes.
- ``MAX_HANDSHAKE_BYTES`` (64 KiB): the largest handshake message (hello, challenge,
  authentication, reply) read from a peer, checked on the frame's length; a larger one breaks the
  protocol (that connection closes unread, ``protocol_errors``).
- ``MAX_REASON_CHARS`` (256): the longest reason kept for a lost link (``lost_links``); with
  ``MAX_LOST_RECORDS`` (1,024) records this bounds them in bytes.

``in_force()`` lists them with the values this process uses (``python -m llm_datadist info``
prints it); the refusals are counted in ``LinkManager.link_stats()`` (``refused_*``).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

MAX_TABLE_BYTES_ENV = "LLM_DATADIST_MAX_TABLE_BYTES"
DEFAULT_MAX_TABLE_BYTES = 1 << 20
MAX_MESSAGE_BYTES_ENV = "LLM_DATADIST_MAX_MESSAGE_BYTES"
DEFAULT_MAX_MESSAGE_BYTES = 64 << 10
MAX_PARSING_BYTES_ENV = "LLM_DATADIST_MAX_PARSING_BYTES"
DEFAULT_MAX_PARSING_BYTES = 16 << 20
MAX_STAGING_BYTES_ENV = "LLM_DATADIST_MAX_STAGING_BYTES"
DEFAULT_MAX_STAGING_BYTES = 256 << 20
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


def truncate_reason(why: str) -> str:
    """``why`` cut to ``MAX_REASON_CHARS`` (it may quote what a peer sent)."""
    why = str(why)
    return why if len(why) <= MAX_REASON_CHARS else why[:MAX_REASON_CHARS - 3] + "..."


class ByteBudget:
    """A semaphore of bytes: ``acquire(n)`` takes ``n`` of ``limit`` bytes (waiting up to
    ``timeout`` seconds for room), ``release(n)`` gives them back. A request larger than the
    whole limit is admitted only when nothing else is held (so that it cannot wait for ever)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        self.peak = 0
        self.refused = 0  # acquires that found no room in time
        self._cond = threading.Condition()

    def acquire(self, nbytes: int, timeout: Optional[float] = 0.0) -> bool:
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with self._cond:
            while self.in_use and self.in_use + nbytes > self.limit:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self.refused += 1
                    return False
                self._cond.wait(left)
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
            return True

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.in_use -= nbytes
            self._cond.notify_all()


_lock = threading.Lock()
_process_budgets: Dict[str, ByteBudget] = {}


def _process_budget(env: str, default: int) -> ByteBudget:
    """This process's one ``ByteBudget`` sized by ``env`` (made on first use)."""
    with _lock:
        budget = _process_budgets.get(env)
        if budget is None:
            budget = _process_budgets[env] = ByteBudget(env_bytes(env, default))
        return budget


def parsing() -> ByteBudget:
    """This process's budget of control-message bytes being read and parsed."""
    return _process_budget(MAX_PARSING_BYTES_ENV, DEFAULT_MAX_PARSING_BYTES)


def staging() -> ByteBudget:
    """This process's budget of page-locked bounce memory held by staged transfers."""
    return _process_budget(MAX_STAGING_BYTES_ENV, DEFAULT_MAX_STAGING_BYTES)


def max_table_bytes() -> int:
    return env_bytes(MAX_TABLE_BYTES_ENV, DEFAULT_MAX_TABLE_BYTES)


def max_message_bytes() -> int:
    return env_bytes(MAX_MESSAGE_BYTES_ENV, DEFAULT_MAX_MESSAGE_BYTES)


@dataclass(frozen=True)
class Budget:
    """One bound on what peers can make this process hold, as ``in_force`` reports it."""

    name: str
    value: int
    unit: str  # "bytes", "records" or "characters"
    scope: str  # what one budget covers: "link", "message", "process", "engine" or "record"
    env: Optional[str]  # the environment variable that sets it (None: fixed)
    default: int
    refusal: str  # what happens beyond it, and the counter of ``LinkManager.link_stats`` that counts it


def in_force() -> List[Budget]:
    """The byte budgets and record limits this process applies: the per-link and per-message
    budgets as the environment says now, the process budgets as they were sized on first use."""
    return [
        Budget("table", max_table_bytes(), "bytes", "link", MAX_TABLE_BYTES_ENV, DEFAULT_MAX_TABLE_BYTES,
               "the link fails, the reply unread (refused_tables)"),
        Budget("message", max_message_bytes(), "bytes", "message", MAX_MESSAGE_BYTES_ENV,
               DEFAULT_MAX_MESSAGE_BYTES, "the request is read, dropped unparsed and refused with LLM_PARAM_INVALID "
               "(refused_oversized)"),
        Budget("parsing", parsing().limit, "bytes", "process", MAX_PARSING_BYTES_ENV, DEFAULT_MAX_PARSING_BYTES,
               f"a request waits up to {PARSING_WAIT_S:g} s, then is refused with LLM_LINK_BUSY (refused_parsing)"),
        Budget("staging", staging().limit, "bytes", "process", MAX_STAGING_BYTES_ENV, DEFAULT_MAX_STAGING_BYTES,
               "a staged transfer waits, then fails at its deadline (refused_staging)"),
        Budget("handshake", MAX_HANDSHAKE_BYTES, "bytes", "message", None, MAX_HANDSHAKE_BYTES,
               "a protocol error: that connection closes unread (protocol_errors)"),
        Budget("pull_tag", MAX_PULL_TAG_BYTES, "bytes", "pull", None, MAX_PULL_TAG_BYTES,
               "a protocol error: the link's connection closes (protocol_errors)"),
        Budget("lost_links", MAX_LOST_RECORDS, "records", "engine", None, MAX_LOST_RECORDS,
               "the oldest record is dropped"),
        Budget("lost_reason", MAX_REASON_CHARS, "characters", "record", None, MAX_REASON_CHARS,
               "the reason is cut, '...' appended"),
    ]
