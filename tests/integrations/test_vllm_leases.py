"""Leases bound to the decode side they were handed to, and bounded release records (issue 21).

A prefill engine hands out ``remote_request_id = "<request id>.<lease token>"``; only a release
that names it with that token frees the request's blocks. The release records a prefill worker
keeps (freed requests, releases that came before their lease) stay within
``release_records_bytes`` and age out. These tests drive the connector's halves in this process
(no engine): the scheduler's ``request_finished`` and the worker's notification handler, as the
link's thread calls it.

Needs vLLM (``pip install '.[vllm]'``); skipped without it (``tests/integrations/conftest.py``
turns that skip into a failure where ``LLM_DATADIST_REQUIRE_VLLM=1``, as in ``.ci/run``).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_vllm import PRODUCER, needs_vllm

pytestmark = needs_vllm

LEASE_S = 60.0
CONSUMER = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_producer=False, is_kv_consumer=True))

#: The kv_transfer_params fields vLLM's NIXL connector hands out (``nixl/pull_scheduler.py``,
#: ``request_finished``): what a router that forwards only known fields passes on (not our
#: ``remote_cluster_id``: the decode side learns it when it links).
NIXL_FIELDS = ("do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
               "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
               "remote_blocks_expiry_time", "transfer_mode")


@contextlib.contextmanager
def prefill_worker(**extra):
    from llm_datadist.integrations.vllm.options import Options as _Options
    from llm_datadist.integrations.vllm.worker import Worker as _Worker

    worker = _Worker(PRODUCER, "prefill", _Options.parse(dict({"kv_lease_s": LEASE_S}, **extra)), None)
    try:
        yield worker
    finally:
        worker.close()


def lease(worker, *req_ids: str) -> set:
    """One scheduler step that hands the worker leases of ``req_ids``; what it reports freed."""
    from llm_datadist.integrations.vllm import LLMDataDistConnectorMetadata

    meta = LLMDataDistConnectorMetadata()
    meta.reqs_to_send = {r: LEASE_S for r in req_ids}
    worker.start(meta)
    return worker.results().finished_sending


def release(worker, remote_id) -> dict:
    return worker.leases.on_release(7, {"op": "release", "request_id": remote_id})


def finished_prefill(scheduler, req_id: str, blocks=(1, 2)):
    """``request_finished`` of a prefill that ran to its one token; its kv_transfer_params."""
    from vllm.v1.request import RequestStatus

    request = SimpleNamespace(request_id=req_id, kv_transfer_params={"do_remote_decode": True},
                              status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=40)
    keep, params = scheduler.request_finished(request, [list(blocks)])
    return params if keep else None


def prefill_scheduler(worker, **extra):
    from llm_datadist.integrations.vllm.options import Options as _Options
    from llm_datadist.integrations.vllm.scheduler import Scheduler as _Scheduler

    scheduler = _Scheduler("prefill", _Options.parse(dict({"kv_lease_s": LEASE_S}, **extra)), 32, producer=False)
    scheduler.set_worker(worker.handshake())
    return scheduler


def test_a_release_without_the_token_is_refused_and_the_lease_stays():
    with prefill_worker() as worker:
        scheduler = prefill_scheduler(worker)
        params = finished_prefill(scheduler, "req-1")
        remote_id = params["remote_request_id"]
        assert remote_id.startswith("req-1.") and len(remote_id) > len("req-1.") + 20
        assert lease(worker, *scheduler.build_connector_meta().reqs_to_send) == set()
        # the bare request id (what any linked peer could guess, or read from a log)
        assert release(worker, "req-1") == {"request_id": "req-1", "released": False,
                                            "why": "no valid lease token for this request"}
        assert worker.stats["refused"] == 1 and worker.stats["bad_token"] == 1 and worker.stats["released"] == 0
        assert "req-1" in worker.leases.held and worker.results().finished_sending == set()
        # the decode side the proxy handed the params to
        assert release(worker, remote_id) == {"request_id": remote_id, "released": True, "why": ""}
        assert worker.results().finished_sending == {"req-1"} and worker.stats["released"] == 1
        # a release before the lease arrives is checked just the same, and keeps no record
        kept = worker.leases.record_bytes
        assert release(worker, "req-2")["released"] is False
        assert worker.leases.record_bytes == kept and "req-2" not in worker.leases.released


def test_a_release_with_another_requests_token_is_refused():
    from llm_datadist.integrations.vllm.leases import lease_request_id

    with prefill_worker() as worker:
        scheduler = prefill_scheduler(worker)
        mine, theirs = (finished_prefill(scheduler, r)["remote_request_id"] for r in ("req-a", "req-b"))
        lease(worker, "req-a", "req-b")
        token_of_b = theirs.rpartition(".")[2]
        forged = [
            "req-a." + token_of_b,  # another request's token (a decode side that was handed req-b)
            lease_request_id(os.urandom(32), "req-a"),  # another prefill engine's token for this id
            mine[:-1] + ("A" if mine[-1] != "A" else "B"),  # one character off
            mine + "=",  # not a token's length
            "req-a." + "*" * (len(token_of_b)),  # not base64url
            lease_request_id(worker.leases.key, "req-a") + ".x",  # a token, then more
        ]
        for remote_id in forged:
            answer = release(worker, remote_id)
            assert answer["released"] is False and answer["why"] == "no valid lease token for this request", remote_id
        assert worker.stats["bad_token"] == len(forged) and worker.stats["released"] == 0
        assert set(worker.leases.held) == {"req-a", "req-b"} and worker.results().finished_sending == set()
        assert release(worker, theirs)["released"] is True
        assert release(worker, mine)["released"] is True
        assert worker.results().finished_sending == {"req-a", "req-b"}


def test_a_release_reply_naming_another_request_is_not_trusted():
    """The decode side counts its pull as loaded only when the prefill side confirms *this*
    request's release; a reply about another request (a confused or hostile peer) is not that."""
    from llm_datadist.integrations.vllm.meta import Recv as _Recv
    from llm_datadist.integrations.vllm.options import Options as _Options
    from llm_datadist.integrations.vllm.worker import Worker as _Worker

    worker = _Worker(CONSUMER, "decode", _Options.parse({}), None)
    try:
        replies = []
        worker.peers.on_link = lambda spec, action: action(spec.cluster_id)  # a link in place
        worker.cm = SimpleNamespace(pull_blocks=lambda *args: None)  # the pull itself succeeds
        worker._links_api = SimpleNamespace(notify=lambda cluster, message, timeout: replies.pop(0))

        def pull(reply: dict) -> tuple:
            replies.append(reply)
            spec = _Recv([3, 4], [7, 8], "127.0.0.1", 1, 5, "req-p.token", awaiting=True)
            worker._pull("req-d", spec)
            results = worker.results()
            return results.finished_recving, results.failed_recving, worker.take_load_errors()

        # the control: the reply names the request
        assert pull({"request_id": "req-p.token", "released": True, "why": ""}) == ({"req-d"}, set(), set())
        assert worker.stats["notified"] == 1 and worker.stats["pulled_requests"] == 1
        for other in ("req-q.token", "req-p", None):
            assert pull({"request_id": other, "released": True, "why": ""}) == ({"req-d"}, {"req-d"}, {3, 4}), other
        assert worker.stats["notified"] == 1 and worker.stats["failed_requests"] == 3
    finally:
        worker.close()


def test_a_release_flood_keeps_the_records_within_their_budget():
    """Without tokens (old peers) every release of an unknown id is kept until its lease could
    come: a flood of long ids fills the budget, then is refused; memory stays flat. With tokens
    such releases are refused before anything is kept."""
    from llm_datadist.integrations.vllm.leases import MAX_REQUEST_ID_BYTES

    budget = 1 << 20
    flood = 20000  # 20,000 ids of 256 bytes: about 5 MB of ids alone
    with prefill_worker(lease_tokens=False, release_records_bytes=budget) as worker:
        prefix = os.urandom(8).hex()
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            for i in range(flood):
                release(worker, f"{prefix}-{i:08d}".ljust(MAX_REQUEST_ID_BYTES, "x"))
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        stats = worker.stats
        assert 0 < worker.leases.record_bytes <= budget
        assert stats["released"] + stats["over_budget"] == flood and stats["over_budget"] > flood // 2
        assert stats["refused"] == stats["over_budget"]
        assert grown < 2 * budget, grown  # what the records really take (not the 5 MB of ids sent)
        # the records age out: a lease later, room again
        worker.leases.age(time.monotonic() + LEASE_S + 1)
        assert worker.leases.record_bytes == 0 and not worker.leases.released
        # freed requests' records (to refuse late releases) stay within the budget too: the
        # oldest make room, and are counted
        many = [f"{prefix}-lease-{i:08d}".ljust(MAX_REQUEST_ID_BYTES, "y") for i in range(8000)]
        lease(worker, *many)
        worker.leases.held = dict.fromkeys(worker.leases.held, 0.0)  # every lease runs out now
        assert worker.results().finished_sending == set(many)
        assert worker.leases.record_bytes <= budget and worker.stats["records_dropped"] > 0
        assert len(worker.leases.gone) + worker.stats["records_dropped"] == len(many)
    with prefill_worker(release_records_bytes=budget) as worker:
        for i in range(2000):
            release(worker, f"{i:08d}".ljust(MAX_REQUEST_ID_BYTES, "x"))
        assert worker.leases.record_bytes == 0 and worker.stats["bad_token"] == 2000


def test_an_over_long_request_id_is_refused():
    from llm_datadist.integrations.vllm.leases import MAX_RELEASE_ID_BYTES, MAX_REQUEST_ID_BYTES
    from llm_datadist.integrations.vllm.meta import recv_spec as _recv_spec

    for tokens in (True, False):
        with prefill_worker(lease_tokens=tokens) as worker:
            for remote_id in ("r" * (MAX_RELEASE_ID_BYTES + 1),
                              "é" * (MAX_RELEASE_ID_BYTES // 2 + 1),  # short in characters, long in bytes
                              "r" * (16 << 20)):
                answer = release(worker, remote_id)
                assert answer == {"released": False, "why": f"request id longer than {MAX_RELEASE_ID_BYTES} bytes"}
            assert worker.stats["too_long"] == 3 and worker.stats["refused"] == 3 and worker.leases.record_bytes == 0
            # the longest that may be named is accepted (without tokens: kept until its lease comes)
            if not tokens:
                assert release(worker, "r" * MAX_RELEASE_ID_BYTES)["released"] is True
            # a prefill request whose id is too long to be released is not handed out
            scheduler = prefill_scheduler(worker, lease_tokens=tokens)
            assert finished_prefill(scheduler, "q" * (MAX_REQUEST_ID_BYTES + 1)) is None
            assert finished_prefill(scheduler, "q" * MAX_REQUEST_ID_BYTES) is not None
    # a decode side does not pull what it could not release
    spec = dict(remote_block_ids=[1], remote_host="h", remote_port=1, remote_cluster_id=1)
    assert _recv_spec(dict(spec, remote_request_id="r" * (MAX_RELEASE_ID_BYTES + 1))) is None
    assert _recv_spec(dict(spec, remote_request_id="r" * MAX_RELEASE_ID_BYTES)) is not None


def test_lease_tokens_false_accepts_token_less_releases():
    from llm_datadist.integrations.vllm.options import Options as _Options

    with pytest.raises(ValueError, match="lease_tokens"):
        _Options.parse({"lease_tokens": "no"})
    with pytest.raises(ValueError, match="release_records_bytes"):
        _Options.parse({"release_records_bytes": -1})
    with prefill_worker(lease_tokens=False) as worker:
        scheduler = prefill_scheduler(worker, lease_tokens=False)
        assert finished_prefill(scheduler, "req-1")["remote_request_id"] == "req-1"  # as before tokens
        lease(worker, "req-1")
        assert release(worker, "req-1") == {"request_id": "req-1", "released": True, "why": ""}
        assert worker.results().finished_sending == {"req-1"} and worker.stats["bad_token"] == 0


def test_the_token_reaches_the_decode_side_through_a_router_of_nixl_fields():
    """A router that forwards only NIXL's fields passes the token on: it rides in
    ``remote_request_id``; the decode side releases with it as given (and links by address)."""
    from llm_datadist.integrations.vllm.meta import recv_spec as _recv_spec

    with prefill_worker() as worker:
        scheduler = prefill_scheduler(worker)
        params = finished_prefill(scheduler, "cmpl-7f3a.0-2b9c")  # vLLM's ids have dots and dashes
        lease(worker, *scheduler.build_connector_meta().reqs_to_send)
        routed = {k: v for k, v in params.items() if k in NIXL_FIELDS}
        spec = _recv_spec(routed)
        assert spec is not None and spec.remote_request_id == params["remote_request_id"]
        assert spec.cluster_id is None and (spec.host, spec.port) == (params["remote_host"], params["remote_port"])
        assert release(worker, spec.remote_request_id)["released"] is True
        assert worker.results().finished_sending == {"cmpl-7f3a.0-2b9c"}


# -- vLLM's toy proxy, unchanged ----------------------------------------------------------------


def toy_proxy_path():
    """vLLM's ``toy_proxy_server.py`` (``tests/v1/kv_connector/nixl_integration/``), where this
    machine has it: ``LLM_DATADIST_TOY_PROXY`` names it, or the installed vllm package ships it."""
    named = os.environ.get("LLM_DATADIST_TOY_PROXY")
    if named:
        return Path(named)
    from importlib.util import find_spec

    root = Path(find_spec("vllm").origin).parent
    for found in sorted(root.parent.glob("**/nixl_integration/toy_proxy_server.py")):
        return found
    return None


def require_toy_proxy() -> Path:
    """vLLM's proxy, or the test skips (fails where ``LLM_DATADIST_REQUIRE_VLLM=1``, as in CI)."""
    proxy = toy_proxy_path()
    if proxy is not None and proxy.is_file():
        return proxy
    if os.environ.get("LLM_DATADIST_REQUIRE_VLLM") == "1":
        pytest.fail("LLM_DATADIST_REQUIRE_VLLM=1 but vLLM's toy_proxy_server.py is not here: "
                    "python tools/fetch_vllm_proxy.py --out DIR, then LLM_DATADIST_TOY_PROXY=DIR/toy_proxy_server.py")
    pytest.skip("vLLM's tests/v1/kv_connector/nixl_integration/toy_proxy_server.py is not on this machine "
                "(the vllm package does not ship its tests); tools/fetch_vllm_proxy.py fetches it, then set "
                "LLM_DATADIST_TOY_PROXY to it")


class _FakeServer(http.server.BaseHTTPRequestHandler):
    """A prefill or decode server's ``/v1/completions``: answers with ``server.answer(body)``."""

    def do_POST(self):  # noqa: N802 - the base class's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        out = json.dumps(self.server.answer(body)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        return


@contextlib.contextmanager
def fake_server(answer):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    server.answer = answer
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def through_toy_proxy(proxy: Path, prefill_answer, decode_answer, tmp_path: Path):
    """Run vLLM's ``proxy`` in front of a fake prefill and a fake decode server (``*_answer(body)``
    make their replies) and send it one completion request; its reply."""
    import httpx

    with fake_server(prefill_answer) as p_port, fake_server(decode_answer) as d_port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with open(tmp_path / "proxy.log", "w") as log:
            proc = subprocess.Popen([sys.executable, str(proxy), "--port", str(port), "--prefiller-host", "127.0.0.1",
                                     "--prefiller-port", str(p_port), "--decoder-host", "127.0.0.1",
                                     "--decoder-port", str(d_port)], stdout=log, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 60
                while True:
                    try:
                        return httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                                          json={"model": "m", "prompt": "hello", "max_tokens": 4}, timeout=60)
                    except httpx.TransportError:
                        assert time.monotonic() < deadline and proc.poll() is None, \
                            (tmp_path / "proxy.log").read_text()
                        time.sleep(0.2)
            finally:
                proc.terminate()
                proc.wait(timeout=30)


def test_the_token_passes_vllms_toy_proxy_unchanged(tmp_path):
    """vLLM's own proxy between a prefill server whose answer our scheduler makes and a decode
    server whose request our decode side reads: the release it sends frees the lease."""
    from llm_datadist.integrations.vllm.meta import recv_spec as _recv_spec

    proxy = require_toy_proxy()
    with prefill_worker() as worker:
        scheduler = prefill_scheduler(worker)
        decoded = []

        def prefill_answer(body):
            assert body["kv_transfer_params"]["do_remote_decode"] is True and body["max_tokens"] == 1
            return {"choices": [{"text": "x"}], "kv_transfer_params": finished_prefill(scheduler, "cmpl-9.0-a1")}

        def decode_answer(body):
            decoded.append(body["kv_transfer_params"])
            return {"choices": [{"text": "decoded"}]}

        reply = through_toy_proxy(proxy, prefill_answer, decode_answer, tmp_path)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "decoded"
        lease(worker, *scheduler.build_connector_meta().reqs_to_send)
        spec = _recv_spec(decoded[0])
        assert spec is not None and "." in spec.remote_request_id
        assert release(worker, spec.remote_request_id)["released"] is True
        assert worker.results().finished_sending == {"cmpl-9.0-a1"}


# -- reads guarded by the lease token (tcp: the prefill engine's server serves every pull) -----------

GUARD_BLOCKS, GUARD_BLOCK_FLOATS = 8, 256
FILL = 0xAB


def c_decode_cache(state, prefill_id: int, ip: str, port: int) -> None:
    """What a decode worker has: a blocks cache shaped like the prefill engine's (two tensors),
    full of FILL, linked to the prefill engine."""
    import numpy as np

    import llm_datadist as ld

    state.arrays = [np.full((GUARD_BLOCKS, GUARD_BLOCK_FLOATS * 4), FILL, dtype=np.uint8) for _ in range(2)]
    desc = ld.CacheDesc(2, [GUARD_BLOCKS, GUARD_BLOCK_FLOATS * 4], ld.DataType.DT_UINT8, ld.Placement.HOST)
    state.cache = state.cm.register_blocks_cache(desc, [a.ctypes.data for a in state.arrays],
                                                 ld.BlocksCacheKey(state.cluster_id, 0))
    info = ld.LLMClusterInfo()
    info.remote_cluster_id = prefill_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info(ip, port)
    _, rets = state.dd.link_clusters([info], 5000)
    assert rets[0] == ld.LLMStatusCode.LLM_SUCCESS, rets


def c_pull(state, prefill_id: int, src, dst, tag) -> str:
    """The decode worker's pull (``Worker._pull_blocks``): tagged with ``remote_request_id``."""
    import llm_datadist as ld

    try:
        if tag is None:
            state.cm.pull_blocks(ld.BlocksCacheKey(prefill_id, 0), state.cache, list(src), list(dst))
        else:
            with state.dd.engine.read_tag(tag):
                state.cm.pull_blocks(ld.BlocksCacheKey(prefill_id, 0), state.cache, list(src), list(dst))
    except ld.LLMException as exc:
        return exc.status_code.name
    return "ok"


def c_arrays(state) -> list:
    return [a.copy() for a in state.arrays]


def test_over_tcp_only_the_token_holder_reads_its_requests_blocks():
    import torch

    from llm_datadist.testing import Cluster

    with prefill_worker(data_plane="tcp") as worker, contextlib.ExitStack() as stack:
        kv = {f"layer{i}": torch.rand(GUARD_BLOCKS, GUARD_BLOCK_FLOATS) for i in range(2)}
        worker.register(kv)
        assert worker.dd.engine.links.read_guard.installed
        scheduler = prefill_scheduler(worker)
        token_a = finished_prefill(scheduler, "req-a", blocks=(1, 2))["remote_request_id"]
        token_b = finished_prefill(scheduler, "req-b", blocks=(5,))["remote_request_id"]
        worker.start(scheduler.build_connector_meta())  # the scheduler's step: the leases and their blocks
        assert worker.leases.blocks == {"req-a": [1, 2], "req-b": [5]}

        ip, port = worker.dd.listen_ip_info.rsplit(":", 1)
        decode, other = (stack.enter_context(Cluster(cid, "DECODER", plane="tcp", timeout=30.0)) for cid in (91, 92))
        for peer in (decode, other):
            peer.call(c_decode_cache, worker.cluster_id, ip, int(port))

        # Another linked peer: no token, the bare request id, a forged token, another request's
        # token, and the right token reaching past its request's blocks: all refused.
        forged = token_a[:-4] + ("AAAA" if not token_a.endswith("AAAA") else "BBBB")
        for peer, src, tag in [(other, [1, 2], None), (other, [1, 2], "req-a"), (other, [1, 2], forged),
                               (other, [1, 2], token_b), (decode, [1, 2, 3], token_a), (decode, [0], token_a)]:
            assert peer.call(c_pull, worker.cluster_id, src, list(range(len(src))), tag) == \
                "LLM_KV_CACHE_NOT_EXIST", (src, tag)
        for peer in (decode, other):
            for array in peer.call(c_arrays):
                assert (array == FILL).all(), "a refused pull wrote into the puller's cache"
        assert worker.stats["refused_reads"] >= 4

        # The decode side with its token reads exactly its blocks; so does B's with its own.
        assert decode.call(c_pull, worker.cluster_id, [1, 2], [3, 4], token_a) == "ok"
        assert other.call(c_pull, worker.cluster_id, [5], [0], token_b) == "ok"
        want = [t.view(torch.uint8).numpy() for t in kv.values()]
        for got, mine in zip(decode.call(c_arrays), want):
            assert (got[3:5] == mine[1:3]).all() and (got[:3] == FILL).all() and (got[5:] == FILL).all()
        for got, mine in zip(other.call(c_arrays), want):
            assert (got[0] == mine[5]).all()

        # Released: A's blocks go from the guard (the same token reads nothing more).
        assert release(worker, token_a)["released"] is True
        assert "req-a" not in worker.leases.blocks
        assert decode.call(c_pull, worker.cluster_id, [1], [0], token_a) == "LLM_KV_CACHE_NOT_EXIST"
        assert worker.dd.engine.links.linked_clusters() and worker.dd.engine.links.lost_links() == {}


def test_lease_tokens_false_installs_no_read_guard():
    import torch

    with prefill_worker(data_plane="tcp", lease_tokens=False) as worker:
        worker.register({"layer0": torch.rand(GUARD_BLOCKS, GUARD_BLOCK_FLOATS)})
        assert not worker.dd.engine.links.read_guard.installed


def test_a_read_with_a_valid_token_waits_briefly_for_its_lease(monkeypatch):
    """The decode side may ask before the scheduler's next step hands the lease to the worker:
    a valid token waits for it (up to LEASE_WAIT_S); one whose lease never comes reads nothing."""
    from llm_datadist.integrations.vllm import leases as _leases
    from llm_datadist.integrations.vllm.options import Options as _Options

    monkeypatch.setattr(_leases, "LEASE_WAIT_S", 0.5)
    book = _leases.LeaseBook(_Options.parse({"kv_lease_s": LEASE_S}))
    book.set_layout([1000, 50000], 100)
    late = _leases.lease_request_id(book.key, "req-late")
    timer = threading.Timer(0.1, book.take_leases, ({"req-late": LEASE_S}, False, {"req-late": [2, 7]}))
    timer.start()
    try:
        assert book.read_guard(7, late.encode()) == [(1200, 100), (1700, 100), (50200, 100), (50700, 100)]
    finally:
        timer.join()
    started = time.monotonic()
    assert book.read_guard(7, _leases.lease_request_id(book.key, "req-never").encode()) is None
    assert 0.4 < time.monotonic() - started < 5
    assert book.read_guard(7, b"req-late") is None and book.read_guard(7, b"\xff" * 40) is None
    assert book.stats["refused_reads"] == 3
