"""What the connector tells vLLM's stat loggers: a worker collects its transfers (per direction)
and failures (per kind, ``failure_kind``) in a ``Recorder``; once a step vLLM takes them
(``get_kv_connector_stats``) as an ``LLMDataDistKVConnectorStats``, sums the workers' and the
interval's (``aggregate``), logs the interval's summary (``reduce``: "KV Transfer metrics: ...")
and feeds Prometheus (``LLMDataDistPromMetrics``: the ``vllm:llm_datadist_*`` series on
``/metrics``). docs/vllm.md ("Metrics") says what each kind means and what an operator does."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

import llm_datadist as ld
from llm_datadist.integrations.vllm.compat import Incompatible
from llm_datadist.integrations.vllm.peers import Unreachable

#: Directions of a transfer: ``pull`` (a decode worker reads a prefill worker's blocks),
#: ``push`` (a prefill worker writes into a decode worker's granted blocks) and ``bidirectional``
#: (a prefill worker reads the prefix a decode worker held for the next turn: ``bidirectional``).
#: Each is sampled on the side that moves the bytes.
DIRECTIONS = ("pull", "push", "bidirectional")

#: One sample per request and direction: seconds its transfer took, bytes and blocks it moved.
SAMPLES = tuple(f"{direction}_{what}" for direction in DIRECTIONS for what in ("seconds", "bytes", "blocks"))

#: Failure kinds (docs/vllm.md, "Failure kinds"): each failed request or transfer counts one, on the
#: side that sees it; a network problem (``peer_unreachable``, ``transfer_failed``, ``timed_out``)
#: reads apart from a capacity one (``lease_expired``) and from a refusal (``incompatible_peer``,
#: ``guard_refused``).
KINDS = ("peer_unreachable", "transfer_failed", "lease_expired", "incompatible_peer", "guard_refused", "timed_out")

#: Events counted before the kinds existed (kept: they are documented series): requests whose KV was
#: not loaded (``failed_pulls``, decode side), releases the prefill side refused
#: (``refused_releases``) and leases that ran out (``expired_leases``), links that could not be made
#: or broke (``link_failures``, decode side), and links to a peer of another model or KV layout
#: (``incompatible_peers``, both sides).
COUNTERS = ("failed_pulls", "refused_releases", "expired_leases", "link_failures", "incompatible_peers")

#: Counts besides: samples a worker dropped past ``MAX_SAMPLES`` (and an interval past
#: ``MAX_INTERVAL_SAMPLES``), values a peer's stats carried that were not counts or samples.
OVERFLOW = ("samples_dropped", "values_ignored")

#: Samples one worker keeps per direction between two of vLLM's steps (an idle engine takes none):
#: beyond them only the counts go on (``samples_dropped``).
MAX_SAMPLES = 4096

#: Samples per direction one interval's summed stats keep (vLLM sums the steps of a logging
#: interval; workers and steps beyond it add to ``samples_dropped``).
MAX_INTERVAL_SAMPLES = 16 * MAX_SAMPLES

#: The cumulative counters a worker's sources keep (the lease book's, and the link manager's as
#: ``link.<name>``) -> the counters their increase adds to.
SOURCE_COUNTERS = {
    "refused": ("refused_releases",),
    "expired": ("expired_leases", "lease_expired"),
    # releases refused for what they claim (no valid lease token, too long, bad readers) or past
    # the release records' budget
    "bad_token": ("guard_refused",), "too_long": ("guard_refused",), "bad_readers": ("guard_refused",),
    "over_budget": ("guard_refused",),
    # pulls the read guard refused (prefill side), pushes the write guard refused (decode side)
    "link.refused_reads": ("guard_refused",), "link.refused_writes": ("guard_refused",),
}

_COUNTS = COUNTERS + KINDS + OVERFLOW

#: What a transfer's or notification's status says about its failure (any other: ``transfer_failed``).
_STATUS_KINDS = {ld.LLMStatusCode.LLM_TIMEOUT: "timed_out", ld.LLMStatusCode.LLM_LINK_FAILED: "peer_unreachable",
                 ld.LLMStatusCode.LLM_NOT_YET_LINK: "peer_unreachable",
                 # the status a read or write guard's refusal answers (transport/read_guard.py)
                 ld.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST: "guard_refused"}


def failure_kind(exc: BaseException) -> str:
    """The kind (``KINDS``) of a failed request or transfer, from what was raised."""
    if isinstance(exc, Unreachable):
        return "timed_out" if exc.timed_out else "peer_unreachable"
    if isinstance(exc, Incompatible):
        return "incompatible_peer"
    if isinstance(exc, ld.LLMException):
        return _STATUS_KINDS.get(exc.status_code, "transfer_failed")
    return "transfer_failed"


def _empty() -> Dict[str, Any]:
    data: Dict[str, Any] = {name: [] for name in SAMPLES}
    data.update({name: 0 for name in _COUNTS})
    return data


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 62


def _is_sample(value: Any) -> bool:
    return type(value) in (int, float) and 0 <= value < 1e18  # (NaN fails both comparisons)


def clean(data: Any) -> Dict[str, Any]:
    """Stats data as this release keeps it, from whatever a worker of another release (or a broken
    one) sent: known keys only, samples that are non-negative numbers, counts that are
    non-negative ints; anything else is dropped and counted in ``values_ignored``. Never raises."""
    out = _empty()
    if not isinstance(data, dict):
        out["values_ignored"] += data is not None
        return out
    ignored = 0
    for name in SAMPLES:
        values = data.get(name)
        if values is None:
            continue
        if not isinstance(values, (list, tuple)):
            ignored += 1
            continue
        kept = [v for v in values[:MAX_INTERVAL_SAMPLES] if _is_sample(v)]
        ignored += min(len(values), MAX_INTERVAL_SAMPLES) - len(kept)
        if name.endswith("_seconds"):  # (one transfer: one sample in each of its direction's three lists)
            out["samples_dropped"] += max(0, len(values) - MAX_INTERVAL_SAMPLES)
        out[name] = kept
    for name in _COUNTS:
        value = data.get(name)
        if value is None:
            continue
        if _is_count(value):
            out[name] += value
        else:
            ignored += 1
    out["values_ignored"] += ignored
    return out


def _p90(values: List[float]) -> float:
    """The 90th percentile, interpolated between the nearest ranks (as numpy's default)."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * 0.9
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


#: Per direction, the log line's words: (transfers, moved, the direction in ``avg_<..>_ms``).
_WORDS = {"pull": ("pulls", "pulled", "pull"), "push": ("pushes", "pushed", "push"),
          "bidirectional": ("bidirectional", "bidirectional", "bidirectional")}


@dataclass
class LLMDataDistKVConnectorStats(KVConnectorStats):
    """Samples and counts of one interval, from one worker or summed over several. ``data`` holds
    plain lists and ints: it crosses process boundaries (pickle, msgpack) and comes back through
    ``LLMDataDistConnector.build_kv_connector_stats``; what another release's worker sends is
    cleaned (``clean``), never trusted."""

    def __post_init__(self) -> None:
        self.data = clean(self.data)

    def reset(self) -> None:
        self.data = _empty()

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in SAMPLES + _COUNTS)

    def aggregate(self, other: KVConnectorStats) -> "LLMDataDistKVConnectorStats":
        theirs = clean(getattr(other, "data", None))
        for name in SAMPLES:
            mine = self.data[name]
            room = max(0, MAX_INTERVAL_SAMPLES - len(mine))
            mine.extend(theirs[name][:room])
            if name.endswith("_seconds"):
                self.data["samples_dropped"] += max(0, len(theirs[name]) - room)
        for name in _COUNTS:
            self.data[name] += theirs[name]
        return self

    def reduce(self) -> Dict[str, Any]:
        """What vLLM logs for the interval: per direction that moved anything (pulls always) the
        transfers, blocks and MB moved, mean, 90th percentile and slowest ms (and the pulls'
        throughput); then the failure kinds, and the older counters that are not zero."""
        out: Dict[str, Any] = {}
        for direction in DIRECTIONS:
            seconds, moved = self.data[f"{direction}_seconds"], self.data[f"{direction}_bytes"]
            if not seconds and direction != "pull":
                continue
            count, done, stem = _WORDS[direction]
            out[count] = len(seconds)
            out[f"{done}_blocks"] = sum(self.data[f"{direction}_blocks"])
            out[f"{done}_MB"] = round(sum(moved) / 1e6, 3)
            if seconds:
                total = sum(seconds)
                out[f"avg_{stem}_ms"] = round(1e3 * total / len(seconds), 3)
                out[f"p90_{stem}_ms"] = round(1e3 * _p90(seconds), 3)
                out[f"max_{stem}_ms"] = round(1e3 * max(seconds), 3)
                if direction == "pull":
                    out["throughput_MB_s"] = round(sum(moved) / 1e6 / total, 3) if total > 0 else 0.0
        out["failed_pulls"] = self.data["failed_pulls"]
        out.update((name, self.data[name]) for name in KINDS)
        out.update((name, self.data[name]) for name in COUNTERS[1:] + OVERFLOW if self.data[name])
        return out


class Recorder:
    """A worker's transfers and failures since vLLM last took them; thread-safe (pulls finish on
    the peers' threads, pushes on the push thread, vLLM takes the stats on its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = _empty()
        self._seen: Dict[str, int] = {}

    def transfer(self, direction: str, seconds: float, blocks: int, nbytes: int) -> None:
        """One request's transfer in ``direction`` (``DIRECTIONS``)."""
        if direction not in _WORDS:
            raise ValueError(f"a transfer's direction is one of {DIRECTIONS}, not {direction!r}")
        with self._lock:
            if len(self._data[f"{direction}_seconds"]) >= MAX_SAMPLES:
                self._data["samples_dropped"] += 1
                return
            self._data[f"{direction}_seconds"].append(float(seconds))
            self._data[f"{direction}_blocks"].append(int(blocks))
            self._data[f"{direction}_bytes"].append(int(nbytes))

    def pull(self, seconds: float, blocks: int, nbytes: int) -> None:
        self.transfer("pull", seconds, blocks, nbytes)

    def fail(self, kind: str, n: int = 1) -> None:
        """A failed request or transfer of ``kind`` (``KINDS``)."""
        if kind not in KINDS:
            raise ValueError(f"a failure's kind is one of {KINDS}, not {kind!r}")
        self.count(kind, n)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._data[name] += n

    def take(self, sources: Optional[Dict[str, int]] = None) -> Optional[LLMDataDistKVConnectorStats]:
        """What was recorded since the last call, with the increase of the cumulative counters of
        ``sources`` (``SOURCE_COUNTERS``) since then; None if nothing was."""
        with self._lock:
            for source, names in SOURCE_COUNTERS.items():
                now = (sources or {}).get(source, self._seen.get(source, 0))
                for name in names:
                    self._data[name] += max(0, now - self._seen.get(source, 0))
                self._seen[source] = now
            data, self._data = self._data, _empty()
        stats = LLMDataDistKVConnectorStats(data=data)
        return None if stats.is_empty() else stats


#: Bucket bounds: seconds (1 ms .. 10 s), bytes (4 KiB .. 16 GiB), blocks (1 .. 8192).
SECONDS_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
BYTES_BUCKETS = [float(1 << n) for n in range(12, 35, 2)]
BLOCKS_BUCKETS = [float(1 << n) for n in range(0, 14)]

_WHO = {"pull": "pulled from its prefill engine (decode side)",
        "push": "pushed into its decode engine's blocks (prefill side)",
        "bidirectional": "pulled back from the decode engine that held them for the next turn (prefill side)"}

#: Prometheus series (counters get ``_total`` on ``/metrics``) and what each says.
HISTOGRAMS = {}
for _direction in DIRECTIONS:
    HISTOGRAMS.update({
        f"{_direction}_seconds": (f"vllm:llm_datadist_{_direction}_seconds", SECONDS_BUCKETS,
                                  f"Seconds one request's KV blocks took to be {_WHO[_direction]} (llm_datadist)."),
        f"{_direction}_bytes": (f"vllm:llm_datadist_{_direction}_bytes", BYTES_BUCKETS,
                                f"Bytes of KV of one request {_WHO[_direction]} (llm_datadist)."),
        f"{_direction}_blocks": (f"vllm:llm_datadist_{_direction}_blocks", BLOCKS_BUCKETS,
                                 f"KV blocks of one request {_WHO[_direction]} (llm_datadist)."),
    })
COUNTER_SERIES = {
    "failed_pulls": ("vllm:llm_datadist_failed_pulls",
                     "Requests whose KV was not loaded from their prefill engine (llm_datadist, decode side)."),
    "refused_releases": ("vllm:llm_datadist_refused_releases",
                         "Block releases the prefill engine refused: too late, no valid lease token, over "
                         "budget (llm_datadist, prefill side)."),
    "expired_leases": ("vllm:llm_datadist_expired_leases",
                       "Finished requests whose blocks no decode engine released within kv_lease_s "
                       "(llm_datadist, prefill side)."),
    "link_failures": ("vllm:llm_datadist_link_failures",
                      "Links to a prefill engine that could not be made or broke (llm_datadist, decode side)."),
    "incompatible_peers": ("vllm:llm_datadist_incompatible_peers",
                           "Links whose peer serves another model or KV layout; their KV is refused "
                           "(llm_datadist)."),
    "peer_unreachable": ("vllm:llm_datadist_failures_peer_unreachable",
                         "Requests or transfers failed because the peer could not be linked or its link broke "
                         "(llm_datadist; network: firewall, address, link secret, peer alive?)."),
    "transfer_failed": ("vllm:llm_datadist_failures_transfer_failed",
                        "Requests or transfers that failed mid-way over a working link (llm_datadist)."),
    "lease_expired": ("vllm:llm_datadist_failures_lease_expired",
                      "Leases that ran out (prefill side) and requests whose blocks were freed before their "
                      "release (decode side) (llm_datadist; capacity: kv_lease_s, decode capacity)."),
    "incompatible_peer": ("vllm:llm_datadist_failures_incompatible_peer",
                          "Requests whose KV was refused as incompatible: another model, KV layout, block size "
                          "or tensor parallel split (llm_datadist, decode side)."),
    "guard_refused": ("vllm:llm_datadist_failures_guard_refused",
                      "Reads, writes, releases or push registrations a guard or grant refused (llm_datadist)."),
    "timed_out": ("vllm:llm_datadist_failures_timed_out",
                  "Requests or transfers whose wait ran past its bound (llm_datadist)."),
    "samples_dropped": ("vllm:llm_datadist_samples_dropped",
                        "Transfer samples dropped past the per-step or per-interval bound; their counts "
                        "are kept (llm_datadist)."),
}


class LLMDataDistPromMetrics(KVConnectorPromMetrics):
    """The connector's Prometheus series, one child per engine index; ``observe`` takes the
    ``data`` of an ``LLMDataDistKVConnectorStats``."""

    def __init__(self, vllm_config, metric_types, labelnames: List[str],
                 per_engine_labelvalues: Dict[int, List[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._histograms = {
            key: create_metric_per_engine(self._histogram_cls(name=name, documentation=doc, buckets=buckets,
                                                              labelnames=labelnames), per_engine_labelvalues)
            for key, (name, buckets, doc) in HISTOGRAMS.items()}
        self._counters = {
            key: create_metric_per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                                          per_engine_labelvalues)
            for key, (name, doc) in COUNTER_SERIES.items()}

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        if not isinstance(transfer_stats_data, dict):
            return
        for key, per_engine in self._histograms.items():
            values = transfer_stats_data.get(key, ())
            for value in values if isinstance(values, (list, tuple)) else ():
                if _is_sample(value):
                    per_engine[engine_idx].observe(value)
        for key, per_engine in self._counters.items():
            count = transfer_stats_data.get(key, 0)
            if _is_count(count) and count:
                per_engine[engine_idx].inc(count)
