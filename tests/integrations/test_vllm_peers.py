"""The decode side's prefill peers (issue 22, item 4) with the connector's halves in this process
(no engine): lease renewals for requests parked in vLLM's queue, batched per peer and bound to
their lease tokens; a dead peer that costs about one link timeout in all and holds up no other
peer's pulls; idle links evicted; links made by address alone (no ``remote_cluster_id``).

Prefill and decode workers are real ``Worker`` objects over real links on 127.0.0.1 (port 0);
a "dead" peer is a socket that accepts TCP connections but never answers (a hung or blackholed
host: every link attempt waits the whole link timeout).

Needs vLLM (``pip install '.[vllm]'``); skipped without it.
"""

from __future__ import annotations

import contextlib
import socket
import time
from types import SimpleNamespace

import pytest
from test_vllm import PRODUCER, needs_vllm

pytestmark = needs_vllm

CONSUMER = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_producer=False, is_kv_consumer=True))
BLOCKS, BLOCK_FLOATS = 8, 64


@contextlib.contextmanager
def worker(config, **extra):
    import torch

    from llm_datadist.integrations.vllm.options import Options as _Options
    from llm_datadist.integrations.vllm.worker import Worker as _Worker

    made = _Worker(config, "engine", _Options.parse(extra), None)
    try:
        cache = torch.arange(BLOCKS * BLOCK_FLOATS, dtype=torch.float32).reshape(BLOCKS, BLOCK_FLOATS)
        if config is CONSUMER:
            cache.zero_()
        made.register({"layer.0": cache})
        made.kv = cache
        yield made
    finally:
        made.close()


class PrefillChild:
    """A prefill ``Worker`` in a child process (one ``LLMDataDist`` per process), driven over a
    pipe: ``call(op, *args)`` runs ``prefill_child.OPS[op]`` there and returns its result."""

    def __init__(self, **extra) -> None:
        import forked
        import prefill_child

        context = forked.context()
        self.conn, child_end = context.Pipe()
        self.proc = context.Process(target=prefill_child.serve, args=(child_end, extra), daemon=True)
        self.proc.start()
        child_end.close()

    def call(self, op: str, *args, timeout: float = 120):
        self.conn.send((op, args))
        if not self.conn.poll(timeout):
            raise AssertionError(f"the prefill child did not answer {op} within {timeout} s")
        ok, value = self.conn.recv()
        if not ok:
            raise AssertionError(f"the prefill child failed {op}:\n{value}")
        return value

    def close(self) -> None:
        try:
            self.call("exit", timeout=60)
        except (AssertionError, OSError, EOFError):
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(30)
        self.conn.close()


@contextlib.contextmanager
def prefill_child(**extra):
    child = PrefillChild(**extra)
    try:
        child.call("ready", timeout=240)
        yield child
    finally:
        child.close()


def prefill_child_ops(prefill):
    """``prefill_child``'s operations on a prefill worker of this process."""
    import prefill_child as ops

    there = ops._Prefill.__new__(ops._Prefill)
    there.worker, there.kv, there.batches = prefill, prefill.kv, []
    return there


def step(decode, parked=None, recv=None) -> None:
    from llm_datadist.integrations.vllm import LLMDataDistConnectorMetadata

    meta = LLMDataDistConnectorMetadata()
    meta.reqs_parked, meta.reqs_to_recv = dict(parked or {}), dict(recv or {})
    decode.start(meta)


def spec_of(params: dict, local=(), awaiting: bool = False):
    from dataclasses import replace

    from llm_datadist.integrations.vllm.meta import recv_spec

    return replace(recv_spec(params), local_block_ids=list(local), awaiting=awaiting)


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_renewal_needs_the_lease_token_and_keeps_no_record():
    from llm_datadist.integrations.vllm.leases import MAX_RELEASE_ID_BYTES, MAX_RENEW_IDS, lease_request_id

    with worker(PRODUCER, kv_lease_s=60) as prefill:
        params = prefill_child_ops(prefill).hand_out(["req-a", "req-b", "req-c"], 60)
        book = prefill.leases
        book.held = dict.fromkeys(book.held, time.monotonic() + 1)  # every lease about to end
        mine = params["req-a"]["remote_request_id"]
        token_of_b = params["req-b"]["remote_request_id"].rpartition(".")[2]
        kept = book.record_bytes
        answer = book.on_message(3, {"op": "renew", "request_ids": [
            mine, "req-b", "req-b." + token_of_b[:-1] + "A", "req-c." + token_of_b,
            lease_request_id(prefill.leases.key, "not-yet-leased"), "r" * (MAX_RELEASE_ID_BYTES + 1), 42]})
        assert answer == {"renewed": 2, "lease_s": 60, "refused": [[1, "bad_token"], [2, "bad_token"],
                                                                   [3, "bad_token"], [5, "too_long"], [6, "too_long"]]}
        # only req-a's lease now runs a whole lease from now; req-b's and req-c's still end soon
        assert book.held["req-a"] > time.monotonic() + 59
        assert book.held["req-b"] < time.monotonic() + 2 and book.held["req-c"] < time.monotonic() + 2
        assert book.record_bytes == kept and not book.released  # a renewal records nothing
        assert book.stats["lease_renewed"] == 2 and book.stats["renewal_refused"] == 5
        assert book.stats["refused"] == 0 and book.stats["bad_token"] == 0  # (those count releases)
        # a released lease is not renewed back to life
        assert book.on_release(3, {"op": "release", "request_id": mine})["released"] is True
        assert book.on_message(3, {"op": "renew", "request_ids": [mine]})["refused"] == [[0, "freed"]]
        # malformed renewals are answered, without effect
        for bad in ({"op": "renew"}, {"op": "renew", "request_ids": "req-b"},
                    {"op": "renew", "request_ids": [mine] * (MAX_RENEW_IDS + 1)}):
            reply = book.on_message(3, bad)
            assert reply["renewed"] == 0 and "error" in reply, bad
        # anything else is still no release
        assert book.on_message(3, {"op": "free all"}) == {"released": False, "why": "not a block release"}


def test_parked_requests_keep_their_leases_through_batched_renewals():
    """Leases of 2 s, requests parked for 3.5 s: renewed over the link, none expires; 200 ids of
    about 250 bytes go out in several notifications, each within the batch budget; once their
    pulls start (``reqs_to_recv``) they are no longer renewed, and the pulls find their blocks."""
    from llm_datadist.integrations.vllm.peers import RENEW_BATCH_BYTES

    lease_s = 2.0
    with prefill_child(kv_lease_s=lease_s) as prefill, worker(CONSUMER, kv_lease_s=30) as decode:
        ids = [f"cmpl-{i:04d}-" + "x" * 200 for i in range(200)]
        params = prefill.call("hand_out", ids, lease_s)
        prefill.call("count_batches")
        # the router forwards no cluster id: the decode side links by address
        routed = {r: {k: v for k, v in p.items() if k != "remote_cluster_id"} for r, p in params.items()}
        step(decode, parked={r: spec_of(p) for r, p in routed.items()})
        time.sleep(lease_s * 1.75)
        assert prefill.call("finished") == []  # nothing expired
        stats = prefill.call("stats")
        assert stats["expired"] == 0 and stats["renewal_refused"] == 0
        assert stats["lease_renewed"] >= 2 * len(ids)  # at once, then every third of 2 s
        assert decode.stats["renewed"] == stats["lease_renewed"] and decode.stats["links"] == 1
        batches = prefill.call("take_batches")
        assert len(batches) >= 2 * 4 and max(batches) <= RENEW_BATCH_BYTES
        # their pulls start: no more renewals, and each pull is confirmed by its release
        step(decode, recv={r: spec_of(p, local=[1], awaiting=True) for r, p in routed.items()})
        wait_for(lambda: decode.stats["pulled_requests"] + decode.stats["failed_requests"] == len(ids), 60,
                 "the pulls did not finish")
        assert decode.stats["pulled_requests"] == len(ids) and prefill.call("stats")["refused"] == 0
        assert decode.peers.parked == 0
        prefill.call("take_batches")
        time.sleep(1.0)
        assert prefill.call("take_batches") == []


def test_a_dead_peer_costs_one_link_timeout_and_holds_up_no_other_peer(caplog):
    """Six requests of a prefill engine that accepts connections but never answers, and four of a
    live one, all at once: the live ones are pulled while the dead peer's first link attempt is
    still waiting; the dead ones are all settled (failed, as vLLM's ``kv_load_failure_policy``
    then decides) within about one link timeout in all; a request for the dead peer that comes
    just after fails at once. The live peer's link, idle, is evicted."""
    link_timeout_ms = 2000
    with prefill_child(kv_lease_s=60) as prefill, \
            worker(CONSUMER, link_timeout_ms=link_timeout_ms, link_idle_s=3) as decode, \
            socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        live = prefill.call("hand_out", [f"live-{i}" for i in range(4)], 60)
        gone = prefill.call("hand_out", [f"gone-{i}" for i in range(6)], 60)
        dead = {f"dead-{i}": dict(p, remote_port=silent.getsockname()[1], remote_request_id=f"dead-{i}.token")
                for i, p in enumerate(gone.values())}
        recv = {f"d-{r}": spec_of(p, local=[i + 1], awaiting=True) for i, (r, p) in enumerate(dead.items())}
        recv.update({f"d-{r}": spec_of(p, local=[i + 1], awaiting=True) for i, (r, p) in enumerate(live.items())})
        done = {}

        def collect() -> bool:
            results = decode.results()
            now = time.monotonic()
            for req_id in results.finished_recving:
                done[req_id] = (now - start, req_id in results.failed_recving)
            return len(done) == len(recv)

        start = time.monotonic()
        step(decode, recv=recv)
        wait_for(collect, 30, "not every request was settled")
        dead_times = [done[f"d-{r}"] for r in dead]
        live_times = [done[f"d-{r}"] for r in live]
        assert all(failed for _, failed in dead_times) and not any(failed for _, failed in live_times)
        assert max(t for t, _ in live_times) < link_timeout_ms / 1000, live_times  # not behind the dead peer
        # one link timeout for all six, not six (nor three: two threads) of them
        assert link_timeout_ms / 1000 * 0.9 <= max(t for t, _ in dead_times) < 2 * link_timeout_ms / 1000, dead_times
        assert decode.kv[1:5].tolist() == prefill.call("kv_rows", 0, 4)  # the live pulls really landed
        # within the retry window, a new request for the dead peer fails at once, saying why
        again = {"d-again": spec_of(dict(next(iter(dead.values())), remote_request_id="dead-9.token"), local=[6],
                                    awaiting=True)}
        start = time.monotonic()
        with caplog.at_level("ERROR", logger="llm_datadist.integrations.vllm"):
            step(decode, recv=again)
            wait_for(lambda: "d-again" in decode.results().failed_recving, 5, "the new request was not settled")
        assert time.monotonic() - start < 0.5
        assert "not tried again" in caplog.text and "unreachable" in caplog.text
        # the live peer's link, idle, goes
        assert prefill.call("linked") == [decode.cluster_id] and decode.stats["links_evicted"] == 0
        wait_for(lambda: decode.stats["links_evicted"] == 1, 10, "the idle link was not evicted")
        wait_for(lambda: prefill.call("linked") == [], 5, "the prefill side kept the link")


@pytest.mark.parametrize("bad", [None, "x", 5, {"renewed": True, "refused": []},
                                 {"renewed": 3, "refused": [[0, "x" * 500], ["1", 1], [9, "far"]], "lease_s": -1}])
def test_a_renewal_answer_from_a_peer_is_read_defensively(bad):
    from llm_datadist.integrations.vllm.peers import read_renew_reply

    if isinstance(bad, dict) and bad.get("renewed") == 3:
        assert read_renew_reply(bad, 2) == (2, {0: "x" * 64}, None)
    else:
        with pytest.raises(ValueError):
            read_renew_reply(bad, 2)


def test_vllms_toy_proxy_with_only_nixls_fields_reaches_the_prefill_engine(tmp_path):
    """vLLM's own proxy, handed a prefill answer cut to the fields vLLM's NIXL connector sends (no
    ``remote_cluster_id``, as a router that forwards only those passes on): the decode worker
    links to the address, learns the cluster there, pulls the block and releases the lease."""

    from test_vllm_leases import NIXL_FIELDS, require_toy_proxy, through_toy_proxy

    proxy = require_toy_proxy()
    with prefill_child(kv_lease_s=60) as prefill, worker(CONSUMER) as decode:
        decoded = []

        def prefill_answer(body):
            params = prefill.call("hand_out", ["cmpl-5.0-b2"], 60)["cmpl-5.0-b2"]
            return {"choices": [{"text": "x"}], "kv_transfer_params": {k: v for k, v in params.items()
                                                                       if k in NIXL_FIELDS}}

        def decode_answer(body):
            decoded.append(body["kv_transfer_params"])
            return {"choices": [{"text": "decoded"}]}

        reply = through_toy_proxy(proxy, prefill_answer, decode_answer, tmp_path)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "decoded"
        assert "remote_cluster_id" not in decoded[0]
        step(decode, recv={"d-1": spec_of(decoded[0], local=[5], awaiting=True)})
        wait_for(lambda: decode.stats["pulled_requests"] + decode.stats["failed_requests"] == 1, 30,
                 "the pull did not finish")
        assert decode.stats["pulled_requests"] == 1 and decode.stats["links"] == 1
        assert decode.kv[5].tolist() == prefill.call("kv_rows", 0, 1)[0]
        assert prefill.call("finished") == ["cmpl-5.0-b2"]
        assert prefill.call("stats")["released"] == 1


def test_the_decode_scheduler_parks_remote_prefills_on_arrival():
    """vLLM calls ``on_new_request`` for every request it queues (and skips the connector for
    waiting requests while its slots are full): those that will load from a prefill engine are
    handed to the worker as parked once, unless their pull (or release) starts in that same step."""
    from llm_datadist.integrations.vllm.options import Options as _Options
    from llm_datadist.integrations.vllm.scheduler import Scheduler as _Scheduler

    good = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_host": "127.0.0.1", "remote_port": 9,
            "remote_request_id": "p-1.token"}
    scheduler = _Scheduler("decode", _Options.parse({}), 32, producer=False)

    def arrive(req_id, params):
        scheduler.on_new_request(SimpleNamespace(request_id=req_id, kv_transfer_params=params,
                                                 prompt_token_ids=list(range(40))))

    arrive("a", dict(good))
    arrive("b", dict(good, remote_request_id="p-2.token"))
    arrive("plain", None)
    arrive("local", {"do_remote_decode": True})
    arrive("broken", dict(good, remote_port="x"))
    # "b" is aborted in the same step, before any slot: only its release goes out
    scheduler.request_finished(SimpleNamespace(request_id="b", kv_transfer_params=dict(good)), [])
    meta = scheduler.build_connector_meta()
    assert set(meta.reqs_parked) == {"a"} and meta.reqs_parked["a"].cluster_id is None
    assert set(meta.reqs_to_recv) == {"b"}
    assert scheduler.build_connector_meta().reqs_parked == {}  # handed over once
    for name, bad in (("kv_lease_s", 0), ("link_idle_s", "soon"), ("kv_lease_s", True)):
        with pytest.raises(ValueError, match=name):
            _Options.parse({name: bad})
    assert _Options.parse({}).kv_lease_s == 30.0


def test_each_decode_rank_renews_the_leases_of_the_prefill_ranks_it_reads():
    """With tensor parallelism, decode rank r renews at prefill rank r (same TP size), not at
    rank 0 for everyone: each prefill rank holds its own lease."""
    from llm_datadist.integrations.vllm.meta import recv_spec

    ranks = [{"host": "127.0.0.1", "port": 7000 + r, "cluster_id": 50 + r, "request_id": f"req.token{r}"}
             for r in range(2)]
    params = {"remote_block_ids": [1, 2], "remote_engine_id": "p", "remote_request_id": "req.token0",
              "remote_host": "127.0.0.1", "remote_port": 7000, "remote_cluster_id": 50, "tp_size": 2,
              "remote_ranks": ranks, "readers_counted": True, "do_remote_prefill": True}
    with worker(CONSUMER) as decode:
        parked = []
        decode.peers.park = lambda req_id, specs: parked.append((req_id, list(specs)))
        for rank in (0, 1):
            decode.tp_rank, decode.tp_size = rank, 2
            step(decode, parked={"ours": recv_spec(params)})
        assert [(req, [(s.port, s.cluster_id, s.remote_request_id) for s in specs]) for req, specs in parked] == [
            ("ours", [(7000, 50, "req.token0")]), ("ours", [(7001, 51, "req.token1")])]
