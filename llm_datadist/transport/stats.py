"""The counters of one engine's links (``LinkStats``), which every part counts into
(``CountCallback``) and ``LinkManager.link_stats`` reports.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, Iterable

from llm_datadist.transport import budgets

#: ``count(counter)``: add one to a counter of the link statistics, return its new value.
CountCallback = Callable[[str], int]

#: The counters of refused or failed connections: ``refused_busy`` and ``refused_source``,
#: connections closed by the handshake caps (global, per source) when no slot came free within
#: ``LLM_DATADIST_PREAUTH_GRACE_MS``; ``preauth_evicted``, unauthenticated connections that gave
#: their slot to a newcomer after that grace, and ``preauth_waited``, newcomers that waited for a
#: slot (``slots``); ``refused_links`` and ``refused_source_links``, link requests refused by the
#: link caps (global, per source); ``refused_self``, link requests claiming this cluster's id
#: without proving that they come from this process. The byte budgets (``budgets``):
#: ``refused_oversized``, control requests over ``LLM_DATADIST_MAX_MESSAGE_BYTES``;
#: ``refused_parsing``, control requests that found no room in the parsing budget (or their
#: link's or source's share of it); ``refused_tables``, table replies over
#: ``LLM_DATADIST_MAX_TABLE_BYTES`` (the link failed); ``refused_reads``, pulls the read guard
#: refused (``read_guard``); ``refused_writes``, pushes the write guard refused;
#: ``protection_failures``, records of a protected link that failed their check (``protection``;
#: the link closed); ``malformed_tables``, table replies whose table or plane entries were
#: malformed (the link failed).
COUNTERS = ("accept_errors", "refused_busy", "refused_source", "preauth_evicted", "preauth_waited", "refused_links",
            "refused_source_links", "refused_self", "auth_failures", "handshake_failures", "links_lost",
            "refused_oversized", "refused_parsing", "refused_tables", "refused_reads", "refused_writes",
            "protection_failures", "malformed_tables")


class LinkStats:
    """The counters (``COUNTERS``) of one engine's links, in ``values``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # (taken last: nothing is called under it)
        self.values: Dict[str, int] = dict.fromkeys(COUNTERS, 0)

    def count(self, counter: str) -> int:
        """Add one to ``counter``; its new value."""
        with self._lock:
            self.values[counter] += 1
            return self.values[counter]

    def snapshot(self, planes: Iterable) -> Dict[str, int]:
        """The counters, and the process's budgets (``budgets``): ``refused_staging``, staged
        transfers that found no room in ``LLM_DATADIST_MAX_STAGING_BYTES`` (or their link's or
        source's share of it) in time; ``stalled_parsing`` and ``stalled_staging``, control bodies
        and staged payloads that stalled while they held some of a budget (their links dropped);
        and the bytes each process budget holds now and held at most (``parsing_bytes``,
        ``parsing_bytes_peak``, ``staging_bytes``, ``staging_bytes_peak``); and each of
        ``planes``' own counters (``DataPlane.counters``: cuda_ipc's ``partial_registrations``).
        The process budgets are shared by every engine of the process."""
        with self._lock:
            snapshot = dict(self.values)
        for plane in planes:
            snapshot.update(plane.counters())
        parsing, staging = budgets.parsing(), budgets.staging()
        snapshot.update(refused_staging=staging.refused, stalled_parsing=parsing.stalled,
                        stalled_staging=staging.stalled, parsing_bytes=parsing.in_use,
                        parsing_bytes_peak=parsing.peak, staging_bytes=staging.in_use,
                        staging_bytes_peak=staging.peak)
        return snapshot
