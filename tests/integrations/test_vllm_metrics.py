"""vLLM-native observability and the peers' compatibility check (issue 22, items 3 and 5).

The stats a worker hands vLLM (``get_kv_connector_stats``) cross process boundaries, are summed
over workers and intervals, logged and fed to Prometheus; here they are driven without an engine.
Two workers in this process, linked for real over 127.0.0.1, exchange their KV descriptions once
per link: a decode worker of another model refuses the prefill worker's blocks (nothing pulled,
the blocks released), one of the same model pulls them. The live engines' side (the log line,
``/metrics``) is in ``test_vllm.py``.

Needs vLLM (``pip install '.[vllm]'``); skipped without it.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
from types import SimpleNamespace

import pytest
from test_vllm import needs_vllm

pytestmark = needs_vllm

BLOCKS = 8
BLOCK_SIZE = 16
LOGGER = "llm_datadist.integrations.vllm"


def stats_of(**data):
    from llm_datadist.integrations.vllm.metrics import LLMDataDistKVConnectorStats

    return LLMDataDistKVConnectorStats(data=data)


def test_stats_aggregate_reduce_and_cross_processes():
    from llm_datadist.integrations.vllm import LLMDataDistConnector
    from llm_datadist.integrations.vllm.metrics import COUNTERS

    one = stats_of(pull_seconds=[0.01, 0.03], pull_bytes=[1000, 3000], pull_blocks=[1, 3], failed_pulls=1)
    two = stats_of(pull_seconds=[0.02], pull_bytes=[2000], pull_blocks=[2], expired_leases=2, link_failures=1)
    # what vLLM does with them: pickled from the worker, to_dict() in the scheduler's stats,
    # built again by the connector class in the front end, aggregated per interval
    back = pickle.loads(pickle.dumps(one))
    assert back.data == one.data
    rebuilt = LLMDataDistConnector.build_kv_connector_stats(back.to_dict())
    total = rebuilt.aggregate(LLMDataDistConnector.build_kv_connector_stats(pickle.loads(pickle.dumps(two)).to_dict()))
    assert total.data["pull_seconds"] == [0.01, 0.03, 0.02] and total.data["pull_blocks"] == [1, 3, 2]
    summary = total.reduce()
    assert summary["pulls"] == 3 and summary["pulled_blocks"] == 6 and summary["pulled_MB"] == 0.006
    assert summary["avg_pull_ms"] == 20.0 and summary["max_pull_ms"] == 30.0
    assert summary["throughput_MB_s"] == 0.1
    assert summary["p90_pull_ms"] == 28.0  # (interpolated between the nearest ranks, as numpy's default)
    # the older counters: failed_pulls always, the others when not zero
    assert {k: summary.get(k, 0) for k in COUNTERS} == {"failed_pulls": 1, "refused_releases": 0, "expired_leases": 2,
                                                         "link_failures": 1, "incompatible_peers": 0}
    assert "refused_releases" not in summary and "pushes" not in summary  # (compact: nothing pushed)
    assert not total.is_empty()
    total.reset()
    assert total.is_empty() and LLMDataDistConnector.build_kv_connector_stats(None).is_empty()
    assert stats_of(incompatible_peers=1).reduce()["pulls"] == 0  # counts alone are not empty
    assert not stats_of(incompatible_peers=1).is_empty()


def test_the_recorder_hands_each_event_over_once():
    from llm_datadist.integrations.vllm.metrics import MAX_SAMPLES, Recorder

    recorder = Recorder()
    assert recorder.take({"refused": 0, "expired": 0}) is None  # nothing happened: vLLM gets None
    recorder.pull(0.5, 2, 4096)
    recorder.count("link_failures")
    taken = recorder.take({"refused": 3, "expired": 1})  # the lease book's counters since the last take
    assert taken.data["pull_seconds"] == [0.5] and taken.data["pull_bytes"] == [4096]
    assert taken.data["refused_releases"] == 3 and taken.data["expired_leases"] == 1
    assert taken.data["link_failures"] == 1
    assert recorder.take({"refused": 3, "expired": 1}) is None
    assert recorder.take({"refused": 4, "expired": 1}).data["refused_releases"] == 1
    # an engine that takes no stats for a long time: the counts go on, the samples stop
    for _ in range(MAX_SAMPLES + 10):
        recorder.pull(0.001, 1, 1)
    flood = recorder.take()
    assert len(flood.data["pull_seconds"]) == MAX_SAMPLES and flood.data["samples_dropped"] == 10


def test_each_direction_and_each_failure_kind_reach_the_log_line():
    from llm_datadist.integrations.vllm.metrics import KINDS, Recorder

    recorder = Recorder()
    recorder.transfer("push", 0.002, 4, 4 << 20)
    recorder.transfer("push", 0.004, 2, 2 << 20)
    recorder.pull(0.010, 1, 1 << 20)
    for kind, n in zip(KINDS, range(1, 7)):
        recorder.fail(kind, n)
    for bad in ("sideways", "PULL", ""):
        with pytest.raises(ValueError, match="direction"):
            recorder.transfer(bad, 0.1, 1, 1)
    with pytest.raises(ValueError, match="kind"):
        recorder.fail("failed_pulls")  # (a counter, not a kind)
    summary = recorder.take().reduce()
    assert summary["pulls"] == 1 and summary["pulled_MB"] == 1.049 and summary["max_pull_ms"] == 10.0
    assert summary["pushes"] == 2 and summary["pushed_blocks"] == 6 and summary["pushed_MB"] == 6.291
    assert summary["avg_push_ms"] == 3.0 and summary["p90_push_ms"] == 3.8 and summary["max_push_ms"] == 4.0
    assert "bidirectional" not in summary  # (none recorded here: a direction without samples is left out)
    assert {k: summary[k] for k in KINDS} == dict(zip(KINDS, range(1, 7)))
    # vLLM's line: "k=v, ..." of this dict, compact
    line = ", ".join(f"{k}={v}" for k, v in summary.items())
    assert "peer_unreachable=1, transfer_failed=2, lease_expired=3, incompatible_peer=4, guard_refused=5, " \
           "timed_out=6" in line and len(summary) < 30, line
    bidirectional = stats_of(bidirectional_seconds=[0.5], bidirectional_bytes=[10 ** 6], bidirectional_blocks=[3])
    assert bidirectional.reduce()["bidirectional"] == 1 and bidirectional.reduce()["avg_bidirectional_ms"] == 500.0


def test_the_recorder_takes_the_lease_books_and_the_guards_counts_as_kinds():
    from llm_datadist.integrations.vllm.metrics import Recorder

    recorder = Recorder()
    assert recorder.take({"expired": 0, "link.refused_reads": 0}) is None
    taken = recorder.take({"expired": 2, "refused": 5, "bad_token": 1, "too_long": 1, "bad_readers": 0,
                           "over_budget": 1, "link.refused_reads": 4, "link.refused_writes": 1})
    assert taken.data["expired_leases"] == 2 and taken.data["lease_expired"] == 2
    assert taken.data["refused_releases"] == 5
    # releases refused for their token, form or budget, and reads or writes a guard refused
    assert taken.data["guard_refused"] == 1 + 1 + 1 + 4 + 1
    # a source that went back (a book made anew) adds nothing, and is counted from there on
    assert recorder.take({"expired": 0}) is None
    assert recorder.take({"expired": 1}).data["lease_expired"] == 1


def test_stats_of_another_release_or_of_garbage_never_raise():
    """A worker of an older or newer release, or a broken one, sends what it sends: known keys are
    taken when they hold counts or samples, anything else is dropped and counted."""
    import json
    import math

    from llm_datadist.integrations.vllm import LLMDataDistConnector
    from llm_datadist.integrations.vllm.metrics import KINDS, MAX_INTERVAL_SAMPLES, clean

    older = {"pull_seconds": [0.01], "pull_bytes": [100], "pull_blocks": [1], "failed_pulls": 2,
             "refused_releases": 1, "expired_leases": 0, "link_failures": 0, "incompatible_peers": 0,
             "samples_dropped": 0}
    newer = dict(older, push_seconds=[0.02], push_bytes=[200], push_blocks=[2], timed_out=3,
                 some_future_kind=9, another_direction_seconds=[1.0])
    total = LLMDataDistConnector.build_kv_connector_stats(older).aggregate(
        LLMDataDistConnector.build_kv_connector_stats(newer))
    assert total.data["pull_seconds"] == [0.01, 0.01] and total.data["push_blocks"] == [2]
    assert total.data["failed_pulls"] == 4 and total.data["timed_out"] == 3
    assert "some_future_kind" not in total.data and total.data["values_ignored"] == 0
    garbage = [None, [], "x", 7, {"pull_seconds": "abc"}, {"pull_seconds": {"a": 1}},
               {"pull_seconds": [1, "x", None, math.nan, math.inf, -1, True, [2], 2.5]},
               {"failed_pulls": "7"}, {"failed_pulls": -3}, {"failed_pulls": 2 ** 70}, {"failed_pulls": 1.5},
               {"failed_pulls": True}, {"timed_out": None}, {1: 2, None: [3]}]
    for data in garbage:
        stats = LLMDataDistConnector.build_kv_connector_stats(data)
        stats.reduce()  # (never raises)
        json.dumps(stats.data)  # (plain lists and ints)
        total.aggregate(stats)
        total.aggregate(type("Foreign", (), {"data": data})())  # another class, its data unchecked
    assert clean({"pull_seconds": [1, "x", None, math.nan, math.inf, -1, True, [2], 2.5]})["pull_seconds"] == [1, 2.5]
    assert clean({"pull_seconds": [1, "x", None, math.nan, math.inf, -1, True, [2], 2.5]})["values_ignored"] == 7
    assert clean({"failed_pulls": "7"})["values_ignored"] == 1 and clean(7)["values_ignored"] == 1
    assert total.data["failed_pulls"] == 4 and all(total.data[k] >= 0 for k in KINDS)
    total.aggregate(object())  # (no data at all)
    # a flood: one interval keeps a bounded number of samples per direction, the rest is counted
    flood = stats_of(pull_seconds=[0.001] * (MAX_INTERVAL_SAMPLES + 5))
    assert len(flood.data["pull_seconds"]) == MAX_INTERVAL_SAMPLES and flood.data["samples_dropped"] == 5
    flood.aggregate(stats_of(pull_seconds=[0.001] * 3))
    assert len(flood.data["pull_seconds"]) == MAX_INTERVAL_SAMPLES and flood.data["samples_dropped"] == 8
    assert flood.reduce()["samples_dropped"] == 8
    # a transfer dropped is one sample dropped, though it is in three lists
    many = [1] * (MAX_INTERVAL_SAMPLES + 2)
    assert stats_of(pull_seconds=many, pull_bytes=many, pull_blocks=many).data["samples_dropped"] == 2


def test_failure_kinds_of_what_was_raised():
    import llm_datadist as ld
    from llm_datadist.integrations.vllm.compat import Incompatible
    from llm_datadist.integrations.vllm.metrics import failure_kind
    from llm_datadist.integrations.vllm.peers import Unreachable

    S = ld.LLMStatusCode
    assert failure_kind(Unreachable("linking failed: LLM_LINK_FAILED")) == "peer_unreachable"
    assert failure_kind(Unreachable("the link failed: LLM_TIMEOUT", timed_out=True)) == "timed_out"
    assert failure_kind(Incompatible("another model")) == "incompatible_peer"
    assert failure_kind(ld.LLMException("x", status_code=S.LLM_TIMEOUT)) == "timed_out"
    assert failure_kind(ld.LLMException("x", status_code=S.LLM_LINK_FAILED)) == "peer_unreachable"
    assert failure_kind(ld.LLMException("x", status_code=S.LLM_KV_CACHE_NOT_EXIST)) == "guard_refused"
    assert failure_kind(ld.LLMException("x", status_code=S.LLM_FAILED)) == "transfer_failed"
    assert failure_kind(ValueError("2 remote blocks for 3 local ones")) == "transfer_failed"


def test_prometheus_series_are_observed_per_engine():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from llm_datadist.integrations.vllm import LLMDataDistConnector

    registry = CollectorRegistry()

    def bound(cls):
        class Bound(cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, registry=registry, **kwargs)
        return Bound

    types = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    prom = LLMDataDistConnector.build_prom_metrics(config, types, ["model_name", "engine"],
                                                   {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe(stats_of(pull_seconds=[0.004, 0.2], pull_bytes=[8192, 65536], pull_blocks=[1, 8],
                          failed_pulls=2, incompatible_peers=1).data, engine_idx=1)
    prom.observe(stats_of(refused_releases=1, expired_leases=4).data, engine_idx=0)

    def value(name, engine, **labels):
        return registry.get_sample_value(name, dict(model_name="m", engine=engine, **labels))

    assert value("vllm:llm_datadist_pull_seconds_count", "1") == 2
    assert value("vllm:llm_datadist_pull_seconds_bucket", "1", le="0.005") == 1
    assert value("vllm:llm_datadist_pull_bytes_sum", "1") == 8192 + 65536
    assert value("vllm:llm_datadist_pull_blocks_bucket", "1", le="8.0") == 2
    assert value("vllm:llm_datadist_failed_pulls_total", "1") == 2
    assert value("vllm:llm_datadist_incompatible_peers_total", "1") == 1
    assert value("vllm:llm_datadist_refused_releases_total", "0") == 1
    assert value("vllm:llm_datadist_expired_leases_total", "0") == 4
    assert value("vllm:llm_datadist_link_failures_total", "0") == 0
    assert value("vllm:llm_datadist_pull_seconds_count", "0") == 0
    # per direction, and per failure kind
    prom.observe(stats_of(push_seconds=[0.03], push_bytes=[1 << 20], push_blocks=[4], bidirectional_seconds=[0.2],
                          timed_out=2, peer_unreachable=1, guard_refused=3).data, engine_idx=0)
    assert value("vllm:llm_datadist_push_seconds_count", "0") == 1
    assert value("vllm:llm_datadist_push_bytes_sum", "0") == 1 << 20
    assert value("vllm:llm_datadist_push_blocks_bucket", "0", le="4.0") == 1
    assert value("vllm:llm_datadist_bidirectional_seconds_count", "0") == 1
    assert value("vllm:llm_datadist_push_seconds_count", "1") == 0
    assert value("vllm:llm_datadist_failures_timed_out_total", "0") == 2
    assert value("vllm:llm_datadist_failures_peer_unreachable_total", "0") == 1
    assert value("vllm:llm_datadist_failures_guard_refused_total", "0") == 3
    assert value("vllm:llm_datadist_failures_lease_expired_total", "0") == 0
    # what reaches observe is vLLM's summed dict: garbage in it is skipped, never raised on
    prom.observe({"push_seconds": ["x", None, -1, 0.5], "timed_out": "9", "guard_refused": -2}, engine_idx=0)
    prom.observe(None, engine_idx=0)
    assert value("vllm:llm_datadist_push_seconds_count", "0") == 2
    assert value("vllm:llm_datadist_failures_timed_out_total", "0") == 2


def test_cache_hits_are_labelled_p2p():
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from llm_datadist.integrations.vllm import LLMDataDistConnector

    connector = object.__new__(LLMDataDistConnector)  # the base class's method reads only the class label
    assert connector.get_external_cache_hit_sources(SimpleNamespace(), 64) == {CacheHitSource.P2P: 64}


# -- compatibility -------------------------------------------------------------------------------


class ModelConfig:
    """What the compatibility description reads of vLLM's ``ModelConfig``."""

    def __init__(self, model: str, revision=None, dtype="torch.float32", kv_heads=2, head_size=32, layers=2):
        self.model, self.revision, self.dtype = model, revision, dtype
        self._kv_heads, self._head_size, self._layers = kv_heads, head_size, layers

    def get_total_num_kv_heads(self):
        return self._kv_heads

    def get_head_size(self):
        return self._head_size

    def get_num_layers(self, parallel_config):
        return self._layers


def vllm_config(producer: bool, model: str = "/models/a", block_size: int = BLOCK_SIZE, **model_args):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(is_kv_producer=producer, is_kv_consumer=not producer),
        model_config=ModelConfig(model, **model_args), parallel_config=SimpleNamespace(),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=block_size), speculative_config=None)


def test_the_description_and_its_differences():
    from llm_datadist.integrations.vllm import compat

    mine = compat.fields(vllm_config(True))
    assert mine == {"kv_format": compat.KV_FORMAT, "model": "/models/a", "dtype": "float32", "kv_heads": 2,
                    "head_size": 32, "layers": 2, "cache_dtype": "auto", "block_size": BLOCK_SIZE,
                    "speculative": None}
    assert compat.fields(vllm_config(True, revision="abc"))["model"] == "/models/a@abc"
    assert compat.fields(vllm_config(True), model_id="llama-3-8b")["model"] == "llama-3-8b"
    assert compat.verdict(mine, dict(mine)) is None
    # a newer peer's extra field is not compared; kv_format is what a change of meaning bumps
    assert compat.verdict(mine, dict(mine, new_field=1)) is None
    assert compat.verdict(mine, dict(mine, kv_format=compat.KV_FORMAT + 1)) == (
        f"it serves another model or KV layout: kv_format {compat.KV_FORMAT + 1} there, {compat.KV_FORMAT} here")
    two = compat.verdict(mine, dict(mine, model="/models/b", block_size=24))
    assert two == ("it serves another model or KV layout: model '/models/b' there, '/models/a' here; "
                   f"block_size 24 there, {BLOCK_SIZE} here")
    # a whole multiple is no difference (its blocks are sub-blocks of ours, or ours of its):
    # layouts and caches are then compared without the token dimension
    layout = dict(mine, layout=f"2x[2, {BLOCK_SIZE}, 64]:DT_FLOAT",
                  caches=f"g0:2x[2, {BLOCK_SIZE}, 64]:float32:2L:{'0' * 16}")
    assert compat.verdict(layout, dict(layout, block_size=2 * BLOCK_SIZE, layout="2x[2, 32, 64]:DT_FLOAT",
                                       caches=f"g0:2x[2, 32, 64]:float32:2L:{'0' * 16}")) is None
    assert compat.verdict(layout, dict(layout, block_size=2 * BLOCK_SIZE, layout="2x[4, 32, 32]:DT_FLOAT",
                                       caches=f"g0:2x[2, 32, 64]:float32:2L:{'0' * 16}")) == (
        f"it serves another model or KV layout: layout '2x[4, 32, 32]:DT_FLOAT' there, "
        f"'2x[2, {BLOCK_SIZE}, 64]:DT_FLOAT' here")
    assert "caches: KV cache 0: block shape [2, 'N', 32] there, [2, 'N', 64] here" in compat.verdict(
        layout, dict(layout, block_size=2 * BLOCK_SIZE, layout="2x[2, 32, 64]:DT_FLOAT",
                     caches=f"g0:2x[2, 32, 32]:float32:2L:{'0' * 16}"))
    # what a hostile or broken peer may send: refused with a reason, never an exception
    hostile = [None, [], "x", {}, dict(mine, kv_format=None) | {"x" * 100: 1},
               {f"f{i}": i for i in range(100)}, dict(mine, model={"nested": 1}), dict(mine, model="m" * 5000)]
    for description in hostile:
        assert compat.verdict(mine, description) is not None, description
    long = compat.verdict(mine, dict(mine, model="m" * 1000))
    assert len(long) < 400  # a log line shows a bounded part of the value


def test_a_block_size_mismatch_is_refused_not_computed_silently():
    """The prefill engine's params carry its block size; a decode engine whose block size is no
    whole multiple of it (nor it of ours: ``block_sizes.refusal``) loads nothing and reports the
    request as not loaded (vLLM then recomputes or fails it per kv_load_failure_policy) with a
    reason, instead of quietly computing the prompt."""
    from llm_datadist.integrations.vllm.options import Options as _Options
    from llm_datadist.integrations.vllm.scheduler import Scheduler as _Scheduler

    scheduler = _Scheduler("decode", _Options.parse({}), 32, producer=False)
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3, 4], "remote_host": "127.0.0.1",
              "remote_port": 1, "remote_cluster_id": 5, "remote_request_id": "p.t", "remote_block_size": 24}
    request = SimpleNamespace(request_id="d", kv_transfer_params=params, prompt_token_ids=list(range(60)))
    assert scheduler.get_num_new_matched_tokens(request, 0) == (60, True)
    scheduler.update_state_after_alloc(request, SimpleNamespace(get_unhashed_block_ids=lambda: [7, 8]), 60)
    spec = scheduler.build_connector_meta().reqs_to_recv["d"]
    assert spec.awaiting and spec.local_block_ids == [7, 8]
    assert spec.refused == ("its block size is 24 tokens, this engine's 32: neither is a whole multiple of the "
                            "other (the engines must share --block-size)")
    # the same block size: no refusal; a block size that is not a number: unusable params
    same = dict(params, do_remote_prefill=True, remote_block_ids=[1, 2], remote_block_size=32)
    request = SimpleNamespace(request_id="e", kv_transfer_params=same, prompt_token_ids=list(range(60)))
    assert scheduler.get_num_new_matched_tokens(request, 0) == (60, True)
    scheduler.update_state_after_alloc(request, SimpleNamespace(get_unhashed_block_ids=lambda: [7, 8]), 60)
    assert scheduler.build_connector_meta().reqs_to_recv["e"].refused == ""
    from llm_datadist.integrations.vllm.meta import recv_spec
    assert recv_spec(dict(params, remote_block_size="16")) is None
    assert recv_spec(dict(params, remote_block_size=True)) is None


@contextlib.contextmanager
def worker(producer: bool, config, **extra):
    """A worker of ``config`` with a registered CPU KV cache of ``BLOCKS`` blocks (block ``b``
    filled with ``b + 1`` on the prefill side, zeros on the decode side)."""
    import torch

    from llm_datadist.integrations.vllm.options import Options as _Options
    from llm_datadist.integrations.vllm.worker import Worker as _Worker

    w = _Worker(config, "prefill" if producer else "decode", _Options.parse(extra), SimpleNamespace(num_blocks=BLOCKS))
    try:
        caches = {f"layer.{i}": torch.zeros(BLOCKS, BLOCK_SIZE, 2, 32) for i in range(2)}
        if producer:
            for t in caches.values():
                for b in range(BLOCKS):
                    t[b] = b + 1
        w.register(caches)
        w.kv_caches = caches
        yield w
    finally:
        w.close()


class PrefillProcess:
    """A prefill worker in a child process (one llm_datadist engine per process), driven over a pipe."""

    def __init__(self, model: str, describes_itself: bool = True):
        import forked

        ctx = forked.context()  # (forked from a server that imported torch and vLLM once)
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_prefill_main, args=(child, model, describes_itself), daemon=True)
        self.proc.start()
        child.close()
        self.port, self.cluster_id = self.call("address")

    def call(self, *request):
        if request != ("address",):
            self._conn.send(request)
        if not self._conn.poll(60):
            raise AssertionError(f"the prefill process gave no answer to {request} (exit code {self.proc.exitcode})")
        answer = self._conn.recv()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(("exit",))
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self._conn.close()


def _prefill_main(conn, model: str, describes_itself: bool) -> None:
    from llm_datadist.integrations.vllm import LLMDataDistConnectorMetadata
    from llm_datadist.integrations.vllm.leases import lease_request_id

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger(LOGGER).addHandler(handler)
    logging.getLogger(LOGGER).setLevel(logging.INFO)
    with worker(True, vllm_config(True, model)) as prefill:
        if not describes_itself:
            prefill._links_api.set_notify_handler(prefill.leases.on_release)  # as before this check
        conn.send((prefill.handshake().port, prefill.cluster_id))
        while conn.poll(120):
            op, *args = conn.recv()
            try:
                if op == "exit":
                    break
                if op == "lease":
                    meta = LLMDataDistConnectorMetadata()
                    meta.reqs_to_send = {args[0]: 60.0}
                    prefill.start(meta)
                    conn.send(lease_request_id(prefill.leases.key, args[0]))
                elif op == "finished":
                    conn.send(prefill.results().finished_sending)
                elif op == "stats":
                    taken = prefill.take_stats()
                    conn.send(taken.data if taken is not None else {})
                elif op == "said":
                    conn.send(list(said))
            except Exception as exc:  # noqa: BLE001 - the test's assertion shows it
                conn.send(exc)


@contextlib.contextmanager
def prefill_process(model: str, describes_itself: bool = True):
    proc = PrefillProcess(model, describes_itself)
    try:
        yield proc
    finally:
        proc.close()


def pull(decode, prefill: PrefillProcess, req_id: str, remote, local, refused: str = ""):
    """Lease ``req_id``'s blocks on the prefill worker, have the decode worker pull them; vLLM's
    view of the request: (finished, failed, blocks with load errors)."""
    from llm_datadist.integrations.vllm.meta import Recv as _Recv

    remote_id = prefill.call("lease", req_id)
    spec = _Recv(list(local), list(remote), "127.0.0.1", prefill.port, prefill.cluster_id, remote_id, awaiting=True,
                 refused=refused)
    decode._pull("d-" + req_id, spec)
    results = decode.results()
    return results.finished_recving, results.failed_recving, decode.take_load_errors()


def test_a_peer_of_another_model_is_refused_once_per_link_and_its_blocks_released(caplog):
    from llm_datadist.integrations.vllm.meta import Recv as _Recv
    from llm_datadist.integrations.vllm.metrics import KINDS

    with prefill_process("/models/a") as prefill:
        with worker(False, vllm_config(False, "/models/b")) as other, caplog.at_level(logging.INFO, logger=LOGGER):
            assert other.compat["layout"] == "2x[16, 2, 32]:DT_FLOAT"
            for n in range(2):
                caplog.clear()
                req = f"d-r{n}"
                assert pull(other, prefill, f"r{n}", [2, 3], [0, 1]) == ({req}, {req}, {0, 1})
                lines = [r.getMessage() for r in caplog.records]
                mine = [line for line in lines if req in line]
                assert len(mine) == 1, lines
                assert "refused: it serves another model or KV layout: model '/models/a' there, '/models/b' " \
                       "here" in mine[0] and "it was told to free them" in mine[0], mine[0]
            assert not other.kv_caches["layer.0"].any()  # nothing pulled
            assert other.stats["links"] == 1 and other.stats["failed_requests"] == 2
            taken = other.take_stats().data
            assert taken["incompatible_peers"] == 1 and taken["failed_pulls"] == 2 and taken["pull_seconds"] == []
            assert taken["incompatible_peer"] == 2  # (one link refused, two requests)
            assert sum(taken[k] for k in KINDS) == 2
        # released, not held for a lease; the prefill worker said so once (one link)
        assert prefill.call("finished") == {"r0", "r1"}
        theirs = [line for line in prefill.call("said") if "cannot use this engine's KV" in line]
        assert len(theirs) == 1 and "model '/models/b' there, '/models/a' here" in theirs[0], theirs
        assert prefill.call("stats")["incompatible_peers"] == 1
        # the positive control: the same model pulls, and its pull is in vLLM's stats
        with worker(False, vllm_config(False, "/models/a")) as same:
            assert pull(same, prefill, "r2", [2, 3], [0, 1]) == ({"d-r2"}, set(), set())
            assert (same.kv_caches["layer.1"][0] == 3).all() and (same.kv_caches["layer.1"][1] == 4).all()
            taken = same.take_stats().data
            assert taken["pull_blocks"] == [2] and taken["pull_bytes"] == [2 * 2 * BLOCK_SIZE * 2 * 32 * 4]
            assert len(taken["pull_seconds"]) == 1 and taken["failed_pulls"] == 0
            assert taken["incompatible_peers"] == 0
            # a request its scheduler refused (another block size): nothing pulled, the blocks released
            with caplog.at_level(logging.INFO, logger=LOGGER):
                caplog.clear()
                why = "its block size is 16 tokens, this engine's 32 (the engines must share --block-size)"
                assert pull(same, prefill, "r3", [4, 5], [6, 7], refused=why) == ({"d-r3"}, {"d-r3"}, {6, 7})
                lines = [r.getMessage() for r in caplog.records if "d-r3" in r.getMessage()]
                assert len(lines) == 1 and f"refused: {why}" in lines[0] and "told to free them" in lines[0], lines
            assert not same.kv_caches["layer.0"][6:8].any()
            taken = same.take_stats().data
            assert taken["failed_pulls"] == 1 and taken["incompatible_peer"] == 1
            # a lying peer's claim: a lease token it was not given. Nothing of another request is
            # read (the read guard or the release refuses it): a guard refusal on both sides
            forged = prefill.call("lease", "r4")[:-4] + "AAAA"
            spec = _Recv([2], [5], "127.0.0.1", prefill.port, prefill.cluster_id, forged, awaiting=True)
            same._pull("d-r4", spec)
            assert same.results().failed_recving == {"d-r4"}
            taken = same.take_stats().data
            assert taken["failed_pulls"] == 1 and taken["guard_refused"] == 1 and sum(taken[k] for k in KINDS) == 1
            assert prefill.call("stats")["guard_refused"] >= 1
        assert prefill.call("finished") == {"r2", "r3"}


def test_a_peer_that_does_not_describe_itself_is_served_and_said_so(caplog):
    """An older prefill engine answers the description like any non-release ("not a block
    release"): the link is used unchecked, with one warning per link."""
    with prefill_process("/models/a", describes_itself=False) as prefill, \
            worker(False, vllm_config(False)) as decode, caplog.at_level(logging.WARNING, logger=LOGGER):
        assert pull(decode, prefill, "r0", [4], [5]) == ({"d-r0"}, set(), set())
        assert pull(decode, prefill, "r1", [6], [7]) == ({"d-r1"}, set(), set())
        unchecked = [r.getMessage() for r in caplog.records if "is not checked" in r.getMessage()]
        assert len(unchecked) == 1 and "does not describe its KV" in unchecked[0]
        assert (decode.kv_caches["layer.0"][5] == 5).all() and (decode.kv_caches["layer.0"][7] == 7).all()


def test_hostile_descriptions_never_crash_the_prefill_worker():
    from llm_datadist.integrations.vllm import compat

    with worker(True, vllm_config(True)) as prefill:
        for message in ({"op": "hello"}, {"op": "hello", "kv_compat": [1] * 10},
                        {"op": "hello", "kv_compat": {"kv_format": {"a": [1]}}},
                        {"op": "hello", "kv_compat": {str(i): "x" * 2000 for i in range(10)}}):
            answer = prefill._on_notify(9, message)
            assert answer == {"kv_compat": prefill.compat, "compatible": False}
        assert prefill._on_notify(9, {"op": "hello", "kv_compat": dict(prefill.compat)})["compatible"] is True
        assert prefill.take_stats().data["incompatible_peers"] == 4
        assert compat.KV_FORMAT == prefill.compat["kv_format"]


def test_model_id_is_checked():
    from llm_datadist.integrations.vllm.options import Options as _Options

    assert _Options.parse({"model_id": "llama"}).model_id == "llama"
    for bad in ("", 3):
        with pytest.raises(ValueError, match="model_id must be a non-empty string"):
            _Options.parse({"model_id": bad})
