"""What the connector tells vLLM's stat loggers: a worker collects its pulls and failures in a
``Recorder``; once a step vLLM takes them (``get_kv_connector_stats``) as an
``LLMDataDistKVConnectorStats``, sums the workers' and the interval's (``aggregate``), logs the
interval's summary (``reduce``: "KV Transfer metrics: ...") and feeds Prometheus
(``LLMDataDistPromMetrics``: the ``vllm:llm_datadist_*`` series on ``/metrics``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

#: One sample per pulled request: seconds the pull took, bytes and blocks it moved.
SAMPLES = ("pull_seconds", "pull_bytes", "pull_blocks")

#: Events counted: requests whose KV was not loaded (``failed_pulls``, decode side), releases the
#: prefill side refused (``refused_releases``) and leases that ran out (``expired_leases``), links
#: that could not be made or broke (``link_failures``, decode side), and links to a peer of another
#: model or KV layout (``incompatible_peers``, both sides).
COUNTERS = ("failed_pulls", "refused_releases", "expired_leases", "link_failures", "incompatible_peers")

#: Samples one worker keeps between two of vLLM's steps (an idle engine takes none): beyond them
#: only the counts go on (``samples_dropped``).
MAX_SAMPLES = 4096

#: The lease book's counters that are also the connector's (lease book name -> counter).
LEASE_COUNTERS = {"refused": "refused_releases", "expired": "expired_leases"}


def _empty() -> Dict[str, Any]:
    data: Dict[str, Any] = {name: [] for name in SAMPLES}
    data.update({name: 0 for name in COUNTERS})
    data["samples_dropped"] = 0
    return data


@dataclass
class LLMDataDistKVConnectorStats(KVConnectorStats):
    """Samples and counts of one interval, from one worker or summed over several. ``data`` holds
    plain lists and ints: it crosses process boundaries (pickle, msgpack) and comes back through
    ``LLMDataDistConnector.build_kv_connector_stats``."""

    def __post_init__(self) -> None:
        base = _empty()
        if self.data:
            for name in SAMPLES:
                base[name] = list(self.data.get(name) or ())
            for name in COUNTERS + ("samples_dropped",):
                base[name] = int(self.data.get(name) or 0)
        self.data = base

    def reset(self) -> None:
        self.data = _empty()

    def is_empty(self) -> bool:
        return not self.data["pull_seconds"] and not any(self.data[name] for name in COUNTERS)

    def aggregate(self, other: KVConnectorStats) -> "LLMDataDistKVConnectorStats":
        if not other.is_empty():
            for name in SAMPLES:
                self.data[name].extend(other.data.get(name, ()))
            for name in COUNTERS + ("samples_dropped",):
                self.data[name] += other.data.get(name, 0)
        return self

    def reduce(self) -> Dict[str, Any]:
        """What vLLM logs for the interval: pulls and their totals, mean and slowest pull, the counts."""
        seconds, moved = self.data["pull_seconds"], self.data["pull_bytes"]
        out: Dict[str, Any] = {"pulls": len(seconds), "pulled_blocks": sum(self.data["pull_blocks"]),
                               "pulled_MB": round(sum(moved) / 1e6, 3)}
        if seconds:
            total = sum(seconds)
            out["avg_pull_ms"] = round(1e3 * total / len(seconds), 3)
            out["max_pull_ms"] = round(1e3 * max(seconds), 3)
            out["throughput_MB_s"] = round(sum(moved) / 1e6 / total, 3) if total > 0 else 0.0
        out.update((name, self.data[name]) for name in COUNTERS)
        return out


class Recorder:
    """A worker's pulls and failures since vLLM last took them; thread-safe (pulls finish on the
    pool's threads, vLLM takes the stats on its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = _empty()
        self._lease_seen: Dict[str, int] = {}

    def pull(self, seconds: float, blocks: int, nbytes: int) -> None:
        with self._lock:
            if len(self._data["pull_seconds"]) >= MAX_SAMPLES:
                self._data["samples_dropped"] += 1
                return
            self._data["pull_seconds"].append(float(seconds))
            self._data["pull_blocks"].append(int(blocks))
            self._data["pull_bytes"].append(int(nbytes))

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._data[name] += n

    def take(self, lease_stats: Optional[Dict[str, int]] = None) -> Optional[LLMDataDistKVConnectorStats]:
        """What was recorded since the last call (with what the lease book counted since then),
        or None if nothing was."""
        with self._lock:
            for source, name in LEASE_COUNTERS.items():
                now = (lease_stats or {}).get(source, 0)
                self._data[name] += now - self._lease_seen.get(source, 0)
                self._lease_seen[source] = now
            data, self._data = self._data, _empty()
        stats = LLMDataDistKVConnectorStats(data=data)
        return None if stats.is_empty() else stats


#: Bucket bounds: pull seconds (1 ms .. 10 s), bytes (4 KiB .. 16 GiB), blocks (1 .. 8192).
SECONDS_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
BYTES_BUCKETS = [float(1 << n) for n in range(12, 35, 2)]
BLOCKS_BUCKETS = [float(1 << n) for n in range(0, 14)]

#: Prometheus series (counters get ``_total`` on ``/metrics``) and what each says.
HISTOGRAMS = {
    "pull_seconds": ("vllm:llm_datadist_pull_seconds", SECONDS_BUCKETS,
                     "Seconds one request's KV blocks took to pull from its prefill engine (llm_datadist)."),
    "pull_bytes": ("vllm:llm_datadist_pull_bytes", BYTES_BUCKETS,
                   "Bytes of KV pulled for one request from its prefill engine (llm_datadist)."),
    "pull_blocks": ("vllm:llm_datadist_pull_blocks", BLOCKS_BUCKETS,
                    "KV blocks pulled for one request from its prefill engine (llm_datadist)."),
}
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
        for key, per_engine in self._histograms.items():
            for value in transfer_stats_data.get(key, ()):
                per_engine[engine_idx].observe(value)
        for key, per_engine in self._counters.items():
            count = transfer_stats_data.get(key, 0)
            if count:
                per_engine[engine_idx].inc(count)
