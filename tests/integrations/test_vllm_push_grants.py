"""Push mode's grants and checks, without vLLM engines (``push/``).

The decode side's ``GrantBook`` as the engine's write guard, between real processes over ``tcp``:
a writer pushes only into the blocks granted to it, while the grant lives; a push outside it, by
another peer, after the grant ended or ran out is refused and changes no byte. The decode side's
``Receiver`` takes a ``push_done`` only from the peer holding the grant, with its token. The
prefill side's ``Pusher`` refuses registrations that are malformed, carry a forged lease token or
name blocks that do not fit the request, pushing nothing; a fitting one is pushed layer by layer
(or all at once when it came late) and reported. Needs vLLM (its connector package imports it)."""

from __future__ import annotations

import time
from contextlib import ExitStack
from types import SimpleNamespace
from typing import List

import numpy as np
import pytest
from test_vllm import needs_vllm

from llm_datadist.testing import Cluster, link
from tests.transport.test_write_guard import (BLOCK, FILL, OWNER_ID, TENSORS, WRITER_ID, OTHER_ID, c_arrays,
                                              c_push, c_register)

pytestmark = needs_vllm


# -- the grant book as the write guard, between processes -----------------------------------------------

def c_grants(state) -> None:
    from llm_datadist.integrations.vllm.push import GrantBook
    state.book = GrantBook()
    state.dd.engine.set_write_guard(state.book.guard)


def c_grant(state, req_id: str, peer: int, blocks: List[int], seconds: float) -> str:
    ranges = [(a.ctypes.data + b * BLOCK, BLOCK) for a in state.arrays for b in blocks]
    return state.book.grant(req_id, peer, ranges, seconds)


def c_revoke(state, req_id: str) -> bool:
    return state.book.revoke(req_id) is not None


@pytest.fixture
def trio():
    with ExitStack() as stack:
        owner = stack.enter_context(Cluster(OWNER_ID, "DECODER", plane="tcp", timeout=30.0))
        writer = stack.enter_context(Cluster(WRITER_ID, "PROMPT", listen=True, plane="tcp", timeout=30.0))
        other = stack.enter_context(Cluster(OTHER_ID, "PROMPT", listen=True, plane="tcp", timeout=30.0))
        owner.call(c_register, None)
        writer.call(c_register, 7)
        other.call(c_register, 8)
        link(owner, writer)
        link(owner, other)
        owner.call(c_grants)
        yield owner, writer, other


def _changed(owner) -> List[int]:
    got = owner.call(c_arrays)
    return sorted({b for t in range(TENSORS) for b in range(len(got[t])) if not (got[t][b] == FILL).all()})


def test_writes_land_only_inside_a_live_grant_of_the_writer(trio):
    owner, writer, other = trio
    refused = "LLM_KV_CACHE_NOT_EXIST"
    assert writer.call(c_push, [0], [1]) == refused  # no grant at all
    owner.call(c_grant, "req-a", WRITER_ID, [1, 2], 30.0)
    owner.call(c_grant, "req-b", OTHER_ID, [5], 30.0)
    assert writer.call(c_push, [0], [5]) == refused  # another peer's grant (another request's)
    assert writer.call(c_push, [0, 1], [2, 3]) == refused  # one descriptor running past its grant
    assert other.call(c_push, [0], [1]) == refused  # req-a's blocks, by a peer that does not hold it
    assert _changed(owner) == []
    assert writer.call(c_push, [3], [2]) == "ok"
    assert writer.call(c_push, [4], [1], [1, 2]) == "ok"  # one layer of a granted block
    assert other.call(c_push, [6], [5]) == "ok"
    assert _changed(owner) == [1, 2, 5]
    src = writer.call(c_arrays)
    got = owner.call(c_arrays)
    assert (got[0][2] == src[0][3]).all() and (got[1][1] == src[1][4]).all() and (got[0][1] == FILL).all()
    # ended: refused again
    assert owner.call(c_revoke, "req-a")
    assert writer.call(c_push, [0], [1]) == refused
    # ran out: refused once its time passed (no step needed: the guard expires it)
    owner.call(c_grant, "req-c", WRITER_ID, [6], 0.3)
    assert writer.call(c_push, [0], [6]) == "ok"
    time.sleep(0.5)
    before = owner.call(c_arrays)
    assert writer.call(c_push, [1], [6]) == refused
    assert all((a == b).all() for a, b in zip(before, owner.call(c_arrays)))


def test_grant_book_in_this_process():
    from llm_datadist.integrations.vllm.push import GrantBook

    book = GrantBook()
    token = book.grant("r1", 7, [(4096, 4096), (8192, 4096)], 30.0)
    # (one immutable answer per change of the peer's grants, which the write guard converts once)
    assert book.guard(7) == ((4096, 4096), (8192, 4096)) and book.guard(7) is book.guard(7)
    assert book.guard(8) is None
    assert book.finish(8, "r1", token) is None  # another peer
    assert book.finish(7, "r1", token[:-1] + ("A" if token[-1] != "A" else "B")) is None  # forged
    assert book.finish(7, "r2", token) is None  # another request
    assert book.finish(7, "r1", None) is None
    assert book.finish(7, "r1", token) is not None and book.guard(7) is None
    book.grant("r3", 7, [(0, 64)], 0.01)
    time.sleep(0.05)
    assert book.guard(7) is None and book.grants == {}


# -- the decode side's Receiver and the prefill side's Pusher, with stand-ins for the engine --------------

class FakeLinks:
    def __init__(self) -> None:
        self.notes: list = []
        self.quiesced: list = []
        self.unlinked: list = []

    def set_write_guard(self, guard) -> None:
        self.guard = guard

    def set_notify_handler(self, handler) -> None:
        self.handler = handler

    def notify(self, cluster_id, message, timeout_ms):
        self.notes.append((cluster_id, message))
        return {"ok": True}

    def quiesce_writes(self, peer_cluster_id, timeout_s):
        self.quiesced.append(peer_cluster_id)
        return True

    def unlink_many(self, cluster_ids, timeout_ms, force):
        self.unlinked.extend(cluster_ids)


class FakeCM:
    def __init__(self) -> None:
        self.pushes: list = []

    def push_blocks(self, key, cache, src, dst, src_layers=None, dst_layers=None, per_layer=2):
        self.pushes.append((key.cluster_id, list(src), list(dst), None if src_layers is None else list(src_layers)))


def _worker(producer: bool, **extra):
    from llm_datadist.integrations.vllm.leases import LeaseBook
    from llm_datadist.integrations.vllm.metrics import Recorder
    from llm_datadist.integrations.vllm.options import Options

    options = Options(**dict({"kv_lease_s": 30.0, "listen_host": "127.0.0.1"}, **extra))
    return SimpleNamespace(options=options, _links_api=FakeLinks(), cm=FakeCM(), caches=["cache"],
                           _keep=[np.zeros((8, 16))] * 4, block_size=16, leases=LeaseBook(options),
                           recorder=Recorder(), _block_bytes=64, peers=None)


def test_receiver_takes_push_done_only_with_the_grant():
    from llm_datadist.integrations.vllm.push import PushReg, Receiver

    w = _worker(False)
    rx = Receiver(w)
    rx._awaiting["dreq"] = PushReg([3, 4], 0, "127.0.0.1", 1, None, "", awaiting=True)
    token = rx.grants.grant("dreq", 7, [(0, 64)], 30.0)
    for peer, message in [(7, {"op": "push_done", "decode_request_id": "dreq", "grant": "forged", "ok": True}),
                          (8, {"op": "push_done", "decode_request_id": "dreq", "grant": token, "ok": True}),
                          (7, {"op": "push_done", "decode_request_id": "other", "grant": token, "ok": True}),
                          (7, {"op": "release", "request_id": "dreq"}), (7, ["not", "a", "dict"])]:
        assert rx.on_notify(peer, message)["ok"] is False
    assert rx.take() == (set(), set()) and rx.grants.guard(7) is not None
    assert rx.on_notify(7, {"op": "push_done", "decode_request_id": "dreq", "grant": token, "ok": True}) == {"ok": True}
    assert rx.take() == ({"dreq"}, set()) and rx.grants.guard(7) is None
    # a failed push fails the request
    rx._awaiting["d2"] = PushReg([5], 0, "127.0.0.1", 1, None, "", awaiting=True)
    t2 = rx.grants.grant("d2", 7, [(0, 64)], 30.0)
    rx.on_notify(7, {"op": "push_done", "decode_request_id": "d2", "grant": t2, "ok": False, "why": "x"})
    assert rx.take() == ({"d2"}, {"d2"})
    # vLLM's counts: the three push_done claims without the grant refused (the two other messages are
    # not push_done: answered, not counted), the failed push of the kind the prefill side names (an
    # older one names none, a lying one names garbage: transfer_failed)
    taken = w.recorder.take().data
    assert taken["guard_refused"] == 3 and taken["transfer_failed"] == 1 and taken["failed_pulls"] == 1
    assert taken["pull_seconds"] == [] and taken["push_seconds"] == []  # (the pushing side samples pushes)
    for n, kind in enumerate(["lease_expired", "bogus", ["timed_out"], None]):
        rx._awaiting[f"k{n}"] = PushReg([5], 0, "127.0.0.1", 1, None, "", awaiting=True)
        token = rx.grants.grant(f"k{n}", 7, [(0, 64)], 30.0)
        rx.on_notify(7, {"op": "push_done", "decode_request_id": f"k{n}", "grant": token, "ok": False, "kind": kind})
    taken = w.recorder.take().data
    assert taken["lease_expired"] == 1 and taken["transfer_failed"] == 3 and taken["failed_pulls"] == 4


def _step(req_id: str, blocks, start: int, end: int, prompt: int, held=()):
    from llm_datadist.integrations.vllm.push import PushStep
    return SimpleNamespace(push_forget=set(), push_steps={req_id: PushStep(list(blocks), start, end, prompt)}
                           if end > start or blocks else {}, reqs_to_send={r: 30.0 for r in held})


def _reg(pusher, peer: int, d_id: str, r_id: str, blocks, first: int = 0, grant: str = "g" * 22) -> dict:
    return pusher.on_reg(peer, {"op": "push_reg", "decode_request_id": d_id, "request_id": r_id, "blocks": blocks,
                                "first_block": first, "grant": grant})


def _settle(pusher) -> None:
    pusher._queue.join()
    pusher._notes.join()


def test_pusher_refuses_bad_registrations_and_pushes_nothing():
    from llm_datadist.integrations.vllm.leases import lease_request_id
    from llm_datadist.integrations.vllm.push import Pusher

    w = _worker(True, push_match_by_request_id=True)  # (registrations by base id)
    pusher = Pusher(w)
    pusher.set_layout({"l0": 0, "l1": 1, "l2": 2, "l3": 3}, SimpleNamespace(type="cpu"))
    try:
        # malformed: refused at once
        for bad in [{"blocks": "x"}, {"blocks": [-1]}, {"first_block": -2}, {"grant": 5}, {"blocks": [True]},
                    {"decode_request_id": None}, {"grant": ""}]:
            message = dict({"op": "push_reg", "decode_request_id": "d", "request_id": "", "blocks": [1],
                            "first_block": 0, "grant": "g"}, **bad)
            assert pusher.on_reg(9, message)["accepted"] is False, bad
        # a 40-token prompt (3 blocks of 16) computed and held
        pusher.begin(_step("p-1-abcdef01", [10, 11, 12], 0, 40, 40))
        pusher.wait()
        pusher.begin(_step("p-1-abcdef01", [], 0, 0, 40, held=["p-1-abcdef01"]))
        forged = lease_request_id(b"k" * 32, "p-1-abcdef01")  # another engine's key
        assert _reg(pusher, 9, "d-1", forged, [1, 2, 3])["accepted"] is True  # (checked when matched)
        _settle(pusher)
        assert _reg(pusher, 9, "p-1-12345678", "", [1, 2])["accepted"] is True  # 2 blocks for 3
        _settle(pusher)
        assert w.cm.pushes == []
        refusals = [m for _, m in w._links_api.notes if m["op"] == "push_done"]
        assert len(refusals) == 2 and not any(m["ok"] for m in refusals)
        assert pusher.stats["push_regs_refused"] == 7 + 2
        assert all(m["kind"] == "guard_refused" for m in refusals)
        assert w.recorder.take().data["guard_refused"] == 7 + 2
        # the right registration (by its lease token) came late: all layers at once, then done
        good = lease_request_id(w.leases.key, "p-1-abcdef01")
        _reg(pusher, 9, "d-3", good, [4, 5, 6])
        _settle(pusher)
        assert w.cm.pushes == [(9, [10, 11, 12], [4, 5, 6], None)]
        assert w._links_api.notes[-1][1] == {"op": "push_done", "decode_request_id": "d-3", "grant": "g" * 22,
                                             "ok": True, "why": ""}
        assert pusher.stats["pushed_late"] == 1 and pusher.stats["pushed_tokens"] == 4 * 40
        # vLLM's push sample, on this side: its blocks, the bytes of every layer (4 x 16 per block)
        pushed = w.recorder.take().data
        assert pushed["push_blocks"] == [3] and pushed["push_bytes"] == [3 * 64] and len(pushed["push_seconds"]) == 1
        assert pushed["pull_seconds"] == [] and pushed["guard_refused"] == 0
        # a second registration of the same request is refused
        _reg(pusher, 9, "d-4", good, [4, 5, 6])
        pusher.begin(_step("x", [], 0, 0, 1))
        _settle(pusher)
        assert len(w.cm.pushes) == 1
    finally:
        pusher.close()


def test_pusher_pushes_each_layer_of_each_step_once():
    from llm_datadist.integrations.vllm.push import Pusher

    w = _worker(True, push_match_by_request_id=True)  # (registrations by base id)
    pusher = Pusher(w)
    pusher.set_layout({"l0": 0, "l1": 1}, SimpleNamespace(type="cpu"))
    try:
        # registered before the request reaches this engine (by its base id), 2 blocks cached there
        _reg(pusher, 9, "q-7-00000001", "", [20, 21], first=2)
        _settle(pusher)
        pusher.begin(_step("q-7-0000abcd", [30, 31, 32, 33], 0, 50, 60))  # chunk 1: tokens 0..49
        for layer in ("l0", "l1"):
            pusher.save_layer(layer)
        pusher.wait()
        assert w.cm.pushes == [(9, [32, 33], [20, 21], [0]), (9, [32, 33], [20, 21], [1])]
        pusher.begin(_step("q-7-0000abcd", [30, 31, 32, 33], 50, 60, 60))  # chunk 2: tokens 50..59
        for layer in ("l0", "l1"):
            pusher.save_layer(layer)
        pusher.wait()
        _settle(pusher)
        assert w.cm.pushes[2:] == [(9, [33], [21], [0]), (9, [33], [21], [1])]
        assert pusher.stats["pushed_tokens"] == 2 * (60 - 32) and pusher.stats["pushed_late"] == 0
        assert w._links_api.notes[-1][1]["ok"] is True and w._links_api.notes[-1][1]["decode_request_id"] == \
            "q-7-00000001"
        # one sample for the request: its 2 blocks; bytes of each layer pushed (the second chunk's
        # block again: 6 block-layers of 16 bytes)
        pushed = w.recorder.take().data
        assert pushed["push_blocks"] == [2] and pushed["push_bytes"] == [6 * 16]
    finally:
        pusher.close()


def test_a_decode_request_that_ends_first_revokes_its_grant_and_stops_the_pusher():
    from llm_datadist.integrations.vllm.push import PushReg, Pusher, Receiver

    w = _worker(False)
    w.peers = SimpleNamespace(submit=lambda spec, task: (task(), True)[1], notify_timeout_ms=1000)
    rx = Receiver(w)
    rx._awaiting["dreq"] = PushReg([3, 4], 0, "127.0.0.1", 1, None, "", awaiting=True)
    token = rx.grants.grant("dreq", 7, [(0, 64)], 30.0)
    rx.on_step({}, {"dreq"})
    assert rx.grants.guard(7) is None  # writes through the server are refused from now on
    assert w._links_api.notes == [(7, {"op": "push_cancel", "decode_request_id": "dreq", "grant": token})]
    assert rx.take() == ({"dreq"}, {"dreq"})  # reported, so vLLM frees its blocks
    # the prefill side, told so, pushes no more of it
    wp = _worker(True, push_match_by_request_id=True)
    pusher = Pusher(wp)
    pusher.set_layout({"l0": 0}, SimpleNamespace(type="cpu"))
    try:
        _reg(pusher, 7, "dreq", "", [3, 4], grant=token)
        pusher.begin(_step("dreq", [1, 2], 0, 20, 32))
        assert pusher.on_cancel(7, {"op": "push_cancel", "decode_request_id": "dreq", "grant": "forged"}) == \
            {"cancelled": False, "ok": True}
        assert pusher.on_cancel(7, {"op": "push_cancel", "decode_request_id": "dreq", "grant": token}) == \
            {"cancelled": True, "ok": True}
        pusher.save_layer("l0")
        pusher.wait()
        _settle(pusher)
        assert wp.cm.pushes == []
    finally:
        pusher.close()


def test_transfer_mode_is_checked_and_push_refuses_what_it_does_not_support():
    from llm_datadist.integrations.vllm.connector import LLMDataDistConnector, _check_push
    from llm_datadist.integrations.vllm.options import Options

    assert Options.parse({}).transfer_mode == "pull"
    assert Options.parse({"transfer_mode": "push"}).transfer_mode == "push"
    for bad in ("PUSH", "write", 1, None):
        with pytest.raises(ValueError, match="transfer_mode must be 'pull' or 'push'"):
            Options.parse({"transfer_mode": bad})
    producer = SimpleNamespace(is_kv_producer=True, is_kv_consumer=False)
    one = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
    _check_push(producer, one, ())
    with pytest.raises(NotImplementedError, match="without tensor parallelism"):
        _check_push(producer, SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1), ())
    with pytest.raises(NotImplementedError, match="without pipeline parallelism"):
        _check_push(producer, SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=2), ())
    with pytest.raises(NotImplementedError, match="kv_both"):
        _check_push(SimpleNamespace(is_kv_producer=True, is_kv_consumer=True), one, ())
    from llm_datadist.integrations.vllm.groups import Group
    groups = (Group(0, "full", layers=("a",)), Group(1, "sliding_window", 32, 16, ("b",)))
    with pytest.raises(NotImplementedError, match="one KV cache group"):
        _check_push(producer, one, groups)
    # a prompt backoff (an MTP drafter's lookahead) would leave tokens no push brings: refused
    from llm_datadist.integrations.vllm.scheduler import Scheduler
    push = Options.parse({"transfer_mode": "push"})
    with pytest.raises(NotImplementedError, match="push mode does not support a prompt backoff .* last 2 prompt"):
        Scheduler("p", push, 16, producer=True, backoff=2)
    Scheduler("p", push, 16, producer=True, backoff=0).close()
    assert LLMDataDistConnector.requires_piecewise_for_cudagraph({"transfer_mode": "push"}) is True
    assert LLMDataDistConnector.requires_piecewise_for_cudagraph({}) is False


def test_a_registration_between_chunks_pushes_the_computed_chunk_then_layer_by_layer():
    """The decode side's registration comes after the prefill computed a first chunk: that chunk
    goes at the next step, all layers in one call, then the rest layer by layer."""
    from llm_datadist.integrations.vllm.push import Pusher

    w = _worker(True, push_match_by_request_id=True)  # (registrations by base id)
    w._keep = w._keep[:2]  # (two layers, one tensor each)
    pusher = Pusher(w)
    pusher.set_layout({"l0": 0, "l1": 1}, SimpleNamespace(type="cpu"))
    try:
        pusher.begin(_step("r-2-0000abcd", [40, 41], 0, 20, 40))  # chunk 1, nobody registered yet
        pusher.save_layer("l0")
        pusher.save_layer("l1")
        pusher.wait()
        assert w.cm.pushes == []
        _reg(pusher, 9, "r-2-00000001", "", [50, 51, 52])  # the whole 40-token prompt: 3 blocks
        _settle(pusher)
        assert w.cm.pushes == []  # (not finished: the next step pushes it)
        pusher.begin(_step("r-2-0000abcd", [40, 41, 42], 20, 40, 40))
        pusher.save_layer("l0")
        pusher.save_layer("l1")
        pusher.wait()
        _settle(pusher)
        assert w.cm.pushes == [(9, [40, 41], [50, 51], None),  # tokens 0..19, every layer at once
                               (9, [41, 42], [51, 52], [0]), (9, [41, 42], [51, 52], [1])]
        assert pusher.stats["pushed_tokens"] == 2 * 20 + 2 * 20 and pusher.stats["pushed_late"] == 1
        assert [m["ok"] for _, m in w._links_api.notes if m["op"] == "push_done"] == [True]
    finally:
        pusher.close()


def test_blocks_freed_before_the_push_ended_fail_the_request_on_the_decode_side():
    from llm_datadist.integrations.vllm.push import Pusher

    w = _worker(True, push_match_by_request_id=True)  # (registrations by base id)
    pusher = Pusher(w)
    pusher.set_layout({"l0": 0}, SimpleNamespace(type="cpu"))
    try:
        _reg(pusher, 9, "s-3-00000001", "", [50, 51])
        _settle(pusher)
        pusher.begin(_step("s-3-0000abcd", [40, 41], 0, 16, 32))  # half the prompt this step
        pusher.save_layer("l0")
        pusher.wait()
        pusher.forget({"s-3-0000abcd"})  # its lease ran out (or the engine began to stop)
        _settle(pusher)
        assert [(m["op"], m["ok"]) for _, m in w._links_api.notes] == [("push_done", False)]
        assert "freed" in w._links_api.notes[0][1]["why"] and pusher.jobs == {}
        assert w._links_api.notes[0][1]["kind"] == "lease_expired"
        taken = w.recorder.take().data
        assert taken["lease_expired"] == 1 and taken["push_seconds"] == []
    finally:
        pusher.close()


def test_an_aborted_prefill_tells_its_decode_side():
    from llm_datadist.integrations.vllm.push import Pusher

    w = _worker(True, push_match_by_request_id=True)  # (registrations by base id)
    pusher = Pusher(w)
    pusher.set_layout({"l0": 0}, SimpleNamespace(type="cpu"))
    try:
        _reg(pusher, 9, "a-1-00000001", "", [50, 51])
        _settle(pusher)
        pusher.begin(_step("a-1-0000abcd", [40, 41], 0, 16, 32))
        pusher.save_layer("l0")
        pusher.wait()
        pusher.begin(SimpleNamespace(push_forget={"a-1-0000abcd"}, push_steps={}, reqs_to_send={}))
        _settle(pusher)
        assert [(m["op"], m["ok"], m["why"]) for _, m in w._links_api.notes] == \
            [("push_done", False, "the prefill request was aborted")]
        assert len(w.cm.pushes) == 1 and pusher.jobs == {}
    finally:
        pusher.close()


def test_the_schedulers_hand_each_step_and_each_allocation_to_their_workers():
    from llm_datadist.integrations.vllm.meta import LLMDataDistConnectorMetadata
    from llm_datadist.integrations.vllm.push import PushScheduling

    # prefill side: a new request's blocks and tokens, then its next chunk's, capped at the prompt
    sched = PushScheduling(16, producer=True)
    req = SimpleNamespace(request_id="p1", kv_transfer_params={"do_remote_decode": True})
    sched.prefill_allocated(req, 40)
    meta = LLMDataDistConnectorMetadata()
    sched.fill(meta, SimpleNamespace(num_scheduled_tokens={"p1": 32, "other": 5},
                                     scheduled_new_reqs=[SimpleNamespace(req_id="p1", block_ids=([7, 8],),
                                                                         num_computed_tokens=0)],
                                     scheduled_cached_reqs=None))
    assert (meta.push_steps["p1"].block_ids, meta.push_steps["p1"].start, meta.push_steps["p1"].end) == \
        ([7, 8], 0, 32)
    meta = LLMDataDistConnectorMetadata()
    sched.fill(meta, SimpleNamespace(num_scheduled_tokens={"p1": 32}, scheduled_new_reqs=[],
                                     scheduled_cached_reqs=SimpleNamespace(req_ids=["p1"], new_block_ids=[([9],)],
                                                                           num_computed_tokens=[32],
                                                                           resumed_req_ids=set())))
    assert (meta.push_steps["p1"].block_ids, meta.push_steps["p1"].start, meta.push_steps["p1"].end) == \
        ([7, 8, 9], 32, 40)
    sched.prefill_finished(req, held=True)
    assert sched.pending()
    sched.output(SimpleNamespace(finished_sending={"p1"}, finished_recving=None))
    assert not sched.pending()
    # decode side: an allocation becomes a registration (after a 32-token local hit: from block 2);
    # a request that ends while waiting is cancelled; unusable params compute the prompt here
    sched = PushScheduling(16, producer=False)
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5000}
    d = SimpleNamespace(request_id="d1", kv_transfer_params=params)
    assert sched.matched_tokens(d, 32, 70) == (38, True)
    sched.allocated(d, [3, 4, 5], 38, 70)
    assert params["do_remote_prefill"] is False
    meta = LLMDataDistConnectorMetadata()
    sched.fill(meta, None)
    reg = meta.push_regs["d1"]
    assert (reg.local_block_ids, reg.first_block, reg.awaiting, reg.remote_request_id) == ([3, 4, 5], 2, True, "")
    sched.decode_finished(d)
    meta = LLMDataDistConnectorMetadata()
    sched.fill(meta, None)
    assert meta.push_cancel == {"d1"}
    bad = SimpleNamespace(request_id="d2", kv_transfer_params={"do_remote_prefill": True, "remote_port": "x"})
    assert sched.matched_tokens(bad, 0, 70) == (0, False) and bad.kv_transfer_params["do_remote_prefill"] is False


# -- what a hostile or unlucky peer cannot do (review findings) -------------------------------------------

def _held(pusher, req_id: str, blocks, prompt: int) -> None:
    """A prefill request computed whole and finished: its blocks held for its decode side."""
    pusher.begin(_step(req_id, blocks, 0, prompt, prompt))
    pusher.wait()
    pusher.begin(_step(req_id, [], 0, 0, prompt, held=[req_id]))


def test_a_registration_without_a_lease_token_gets_nothing_unless_matching_by_id_is_on():
    """lease_tokens on (the default): a peer that names the victim's base id as its own decode
    request id, with no lease token, gets no push and cannot free the victim's blocks; the
    registration with the lease token still gets it. With ``push_match_by_request_id`` (the opt-in
    for the pipelined order) a registration without blocks still frees nothing."""
    from llm_datadist.integrations.vllm.leases import lease_request_id
    from llm_datadist.integrations.vllm.push import Pusher

    for opt_in in (False, True):
        w = _worker(True, push_match_by_request_id=opt_in)
        assert w.options.lease_tokens
        pusher = Pusher(w)
        pusher.set_layout({"l0": 0}, SimpleNamespace(type="cpu"))
        try:
            _held(pusher, "victim-1-abcdef01", [10, 11, 12], 40)
            _reg(pusher, 66, "victim-1-99999999", "", [])  # attacker: drop the victim's job
            _settle(pusher)
            assert "victim-1-abcdef01" in pusher.jobs and w.cm.pushes == []
            if not opt_in:
                _reg(pusher, 66, "victim-1-99999999", "", [1, 2, 3])  # attacker: take its KV
                _settle(pusher)
                assert w.cm.pushes == [], f"pushed the victim's KV to an untokened peer: {w.cm.pushes}"
                assert "push_match_by_request_id is off" in w._links_api.notes[-1][1]["why"]
            _reg(pusher, 9, "d-1", lease_request_id(w.leases.key, "victim-1-abcdef01"), [4, 5, 6])
            _settle(pusher)
            assert w.cm.pushes == [(9, [10, 11, 12], [4, 5, 6], None)]
        finally:
            pusher.close()


def test_two_live_requests_of_one_base_id_are_matched_to_neither():
    """Client-chosen ids that collide (vLLM appends -<8 hex> to X-Request-Id): a registration by
    base id is ambiguous, refused, and neither request is touched."""
    from llm_datadist.integrations.vllm.push import Pusher

    w = _worker(True, push_match_by_request_id=True)
    pusher = Pusher(w)
    pusher.set_layout({"l0": 0}, SimpleNamespace(type="cpu"))
    try:
        a, b = "cmpl-x-0-aaaaaaaa", "cmpl-x-0-bbbbbbbb"
        meta = _step(a, [10, 11], 0, 32, 32, held=[a, b])
        meta.push_steps.update(_step(b, [20, 21], 0, 32, 32).push_steps)
        pusher.begin(meta)
        pusher.wait()
        pusher.begin(_step("none", [], 0, 0, 1, held=[a, b]))
        _reg(pusher, 9, "cmpl-x-0-11111111", "", [1, 2])  # the decode side of a (or of b)
        _settle(pusher)
        assert w.cm.pushes == [] and pusher.jobs[a].reg is None and pusher.jobs[b].reg is None
        assert "2 requests here have its base id" in w._links_api.notes[-1][1]["why"]
        # one of them gone: the other is matched again
        pusher.forget({b})
        _reg(pusher, 9, "cmpl-x-0-22222222", "", [1, 2])
        _settle(pusher)
        assert w.cm.pushes == [(9, [10, 11], [1, 2], None)]
    finally:
        pusher.close()


def test_push_cancel_answers_after_the_push_in_flight_ended(monkeypatch):
    """``push_cancel`` is answered only once the request's running push_blocks returned (the
    decode side frees the blocks then); one still running after CANCEL_WAIT_S is answered
    ``ok: false``, and the decode side then ends the link before it reports the request."""
    import threading

    from llm_datadist.integrations.vllm.push import pusher as push_mod
    from llm_datadist.integrations.vllm.push import Grant, PushReg, Pusher, Receiver

    w = _worker(True, push_match_by_request_id=True)
    in_push, release = threading.Event(), threading.Event()
    writing = []

    def slow_push(key, cache, src, dst, *rest):
        writing.append(True)
        in_push.set()
        release.wait(10)
        writing.pop()
    w.cm.push_blocks = slow_push
    pusher = Pusher(w)
    pusher.set_layout({"l0": 0}, SimpleNamespace(type="cpu"))
    try:
        _held(pusher, "r-1-abcdef01", [10, 11], 32)
        _reg(pusher, 9, "r-1-00000001", "", [1, 2], grant="g" * 22)
        assert in_push.wait(5)
        threading.Timer(0.3, release.set).start()
        answer = pusher.on_cancel(9, {"op": "push_cancel", "decode_request_id": "r-1-00000001", "grant": "g" * 22})
        assert not writing, "push_cancel answered while the push still wrote"
        assert answer == {"cancelled": True, "ok": True}
        _settle(pusher)
        # a push that does not end in time: ok false
        monkeypatch.setattr(push_mod, "CANCEL_WAIT_S", 0.2)
        in_push.clear()
        release.clear()
        _held(pusher, "r-2-abcdef02", [12, 13], 32)
        _reg(pusher, 9, "r-2-00000002", "", [3, 4], grant="h" * 22)
        assert in_push.wait(5)
        answer = pusher.on_cancel(9, {"op": "push_cancel", "decode_request_id": "r-2-00000002", "grant": "h" * 22})
        assert answer["cancelled"] and answer["ok"] is False and writing
        release.set()
        _settle(pusher)
    finally:
        release.set()
        pusher.close()
    # the decode side, answered ok false: the link ends, then the request is reported
    wd = _worker(False)
    wd.peers = SimpleNamespace(submit=lambda spec, task: (task(), True)[1], notify_timeout_ms=1000)
    wd._links_api.notify = lambda cluster_id, message, timeout_ms: {"cancelled": True, "ok": False, "why": "busy"}
    rx = Receiver(wd)
    rx._cancelling["d"] = PushReg([3, 4], 0, "127.0.0.1", 1, 7, "", awaiting=True)
    rx._cancel("d", Grant(7, [(0, 64)], "t", 0.0), "the request ended", True)
    assert wd._links_api.unlinked == [7] and rx.take() == ({"d"}, {"d"})


def test_an_expired_grant_tells_the_prefill_side_which_stops_pushing():
    """A grant that runs out ends the request on the decode side (vLLM frees its blocks) and the
    prefill worker is told (``push_cancel`` with the grant), also when the write guard ended it
    first on a link's thread; the prefill side's job has its own deadline past which it pushes
    nothing and reports failure."""
    from llm_datadist.integrations.vllm.push import PushReg, Pusher, Receiver

    w = _worker(False)
    w.peers = SimpleNamespace(submit=lambda spec, task: (task(), True)[1], notify_timeout_ms=1000)
    rx = Receiver(w)
    for req_id in ("d", "e"):
        rx._awaiting[req_id] = PushReg([3, 4], 0, "127.0.0.1", 1, 7, "", awaiting=True)
    token = rx.grants.grant("d", 7, [(0, 64)], 0.01)
    other = rx.grants.grant("e", 7, [(64, 64)], 0.01)
    time.sleep(0.05)
    assert rx.grants.guard(7) is None  # (a push's check on a link's thread ended both)
    rx.on_step({}, set())
    assert rx.take() == ({"d", "e"}, {"d", "e"})  # reported failed: vLLM frees their blocks now
    cancels = sorted((m["decode_request_id"], m["grant"]) for _, m in w._links_api.notes if m["op"] == "push_cancel")
    assert cancels == [("d", token), ("e", other)], "the prefill side was never told"
    assert w._links_api.quiesced == [7, 7]
    assert w.recorder.take().data["timed_out"] == 2  # (docs/vllm.md, "Failures and bounds")
    # ran out in the guard, then the request ended before the next step: still cancelled there
    rx._awaiting["f"] = PushReg([5], 0, "127.0.0.1", 1, 7, "", awaiting=True)
    third = rx.grants.grant("f", 7, [(0, 64)], 0.01)
    time.sleep(0.05)
    assert rx.grants.guard(7) is None
    rx.on_step({}, {"f"})
    assert w._links_api.notes[-1][1] == {"op": "push_cancel", "decode_request_id": "f", "grant": third}
    assert rx.take() == ({"f"}, {"f"}) and rx.grants.take_expired(time.monotonic()) == {}
    # the prefill side: nothing pushed after its job's deadline
    wp = _worker(True, push_match_by_request_id=True, kv_lease_s=1.0)
    wp._keep = wp._keep[:1]
    pusher = Pusher(wp)
    pusher.set_layout({"l0": 0}, SimpleNamespace(type="cpu"))
    try:
        _reg(pusher, 9, "x-1-00000001", "", [1, 2])
        pusher.begin(_step("x-1-0000abcd", [10, 11], 0, 16, 32))
        pusher.save_layer("l0")
        pusher.wait()
        assert len(wp.cm.pushes) == 1
        time.sleep(1.1)
        pusher.begin(_step("x-1-0000abcd", [10, 11], 16, 32, 32))
        pusher.save_layer("l0")
        pusher.wait()
        _settle(pusher)
        assert len(wp.cm.pushes) == 1
        assert [(m["op"], m["ok"]) for _, m in wp._links_api.notes] == [("push_done", False)]
        assert "kv_lease_s" in wp._links_api.notes[0][1]["why"]
    finally:
        pusher.close()


def test_a_decode_request_whose_prefill_engine_died_ends_at_its_grants_bound():
    """Push mode's wait for ``push_done`` when the prefill engine is gone (killed, or stopped so
    that it answers nothing): the grant runs out at ``kv_lease_s``, the ``push_cancel`` fails, the
    link is ended so that no push of it can start after, and the request is reported failed
    (``timed_out``) in that step, its grant gone (vLLM frees its blocks)."""
    import llm_datadist as ld
    from llm_datadist.integrations.vllm.push import PushReg, Receiver

    w = _worker(False)
    w.peers = SimpleNamespace(submit=lambda spec, task: (task(), True)[1], notify_timeout_ms=1000)

    def dead(cluster_id, message, timeout_ms):
        raise ld.LLMException("no answer", status_code=ld.LLMStatusCode.LLM_TIMEOUT)

    w._links_api.notify = dead
    rx = Receiver(w)
    rx._awaiting["d"] = PushReg([3, 4], 0, "127.0.0.1", 1, 7, "", awaiting=True)
    rx.grants.grant("d", 7, [(0, 64)], 0.05)
    rx.on_step({}, set())
    assert rx.take() == (set(), set())  # (within its bound: still waiting)
    time.sleep(0.1)
    start = time.monotonic()
    rx.on_step({}, set())
    assert time.monotonic() - start < 2.0
    assert rx.take() == ({"d"}, {"d"}) and rx.grants.grants == {}
    assert w._links_api.unlinked == [7]
    taken = w.recorder.take().data
    assert taken["timed_out"] == 1 and taken["failed_pulls"] == 1


def test_refusals_and_notifications_never_hold_up_a_step():
    """Refusals (and push_done) are sent on the notifier's thread, which ``wait_for_save`` does
    not wait for; a peer that answers slowly has at most MAX_NOTES_PER_PEER of them waiting, the
    rest dropped and counted."""
    import threading

    from llm_datadist.integrations.vllm.push import MAX_NOTES_PER_PEER, Pusher

    w = _worker(True)
    gate = threading.Event()

    def notify(cluster_id, message, timeout_ms):
        gate.wait(0.3)  # a peer that answers slowly (stands in for the 5 s timeout of one that never does)
        return {"ok": True}
    w._links_api.notify = notify
    pusher = Pusher(w)
    pusher.set_layout({"l0": 0}, SimpleNamespace(type="cpu"))
    try:
        n = MAX_NOTES_PER_PEER + 10
        for i in range(n):
            _reg(pusher, 66, f"x-{i}", f"forged-{i}", [1])  # refused when matched: a bad lease token
        t = time.monotonic()
        pusher.begin(_step("honest-1-abcdef01", [10], 0, 8, 8))  # an unrelated step of this engine
        pusher.save_layer("l0")
        pusher.wait()  # wait_for_save
        spent = time.monotonic() - t
        assert spent < 3, f"one step waited {spent:.1f} s for another peer's refusals"
        assert pusher.stats["push_regs_refused"] == n
        assert pusher.stats["push_notes_dropped"] >= n - MAX_NOTES_PER_PEER
    finally:
        gate.set()
        pusher.close()


def test_one_peer_cannot_take_every_pending_registration_slot():
    """Registrations of requests not here yet wait (kv_lease_s); one peer may hold at most
    MAX_PENDING_REGS_PER_PEER of them, so other decode engines still register."""
    from llm_datadist.integrations.vllm.push import MAX_PENDING_REGS_PER_PEER, Pusher

    w = _worker(True, push_match_by_request_id=True)
    pusher = Pusher(w)
    pusher.set_layout({"l0": 0}, SimpleNamespace(type="cpu"))
    try:
        taken = [_reg(pusher, 66, f"junk-{i}-00000000", "", [1])["accepted"]
                 for i in range(MAX_PENDING_REGS_PER_PEER + 5)]
        _settle(pusher)
        assert taken.count(True) == MAX_PENDING_REGS_PER_PEER and not any(taken[MAX_PENDING_REGS_PER_PEER:])
        assert _reg(pusher, 9, "legit-1-00000001", "", [1])["accepted"] is True, "another peer is locked out"
        _settle(pusher)
        # the legitimate one still finds its request when it comes
        pusher.begin(_step("legit-1-abcdef01", [10], 0, 8, 8))
        pusher.save_layer("l0")
        pusher.wait()
        assert w.cm.pushes == [(9, [10], [1], [0])]
    finally:
        pusher.close()


def test_a_replaced_grant_leaves_its_old_peer_no_write_access():
    from llm_datadist.integrations.vllm.push import GrantBook

    book = GrantBook()
    book.grant("r", 7, [(4096, 4096)], 30.0)
    book.grant("r", 8, [(8192, 4096)], 30.0)
    assert book.guard(7) is None, "peer 7 may still write its replaced grant's range"
    assert book.guard(8) is not None


def test_a_closed_receiver_leaves_a_guard_that_refuses_every_peer():
    """Closing the decode side installs a deny-all write guard (no guard at all would let every
    linked peer write all KV until the engine is finalized)."""
    from llm_datadist.integrations.vllm.push import Receiver

    w = _worker(False)
    rx = Receiver(w)
    rx.install()
    rx.grants.grant("r", 7, [(0, 64)], 30.0)
    assert w._links_api.guard(7) is not None
    rx.close()
    assert w._links_api.guard is not None and w._links_api.guard(7) is None and w._links_api.guard(8) is None


def test_a_request_is_reported_only_after_its_peers_writes_quiesced():
    """Each ending of a grant (push_done, cancel, expiry) waits for the peer's writes through the
    server (``engine.quiesce_writes``) after the grant is gone and before vLLM hears of it; writes
    that do not quiesce fail the request."""
    from llm_datadist.integrations.vllm.push import PushReg, Receiver

    w = _worker(False)
    rx = Receiver(w)
    seen = []

    def quiesce(peer, timeout_s):
        seen.append((peer, rx.grants.guard(peer), set(rx._recved)))
        return len(seen) == 1
    w._links_api.quiesce_writes = quiesce
    for req_id in ("a", "b"):
        rx._awaiting[req_id] = PushReg([3], 0, "127.0.0.1", 1, 7, "", awaiting=True)
    ta = rx.grants.grant("a", 7, [(0, 64)], 30.0)
    tb = rx.grants.grant("b", 7, [(64, 64)], 30.0)
    rx.on_notify(7, {"op": "push_done", "decode_request_id": "a", "grant": ta, "ok": True})
    assert seen[0][0] == 7 and seen[0][2] == set() and rx.take() == ({"a"}, set())
    rx.on_notify(7, {"op": "push_done", "decode_request_id": "b", "grant": tb, "ok": True})
    assert seen[1] == (7, None, set()) and rx.take() == ({"b"}, {"b"})  # did not quiesce: failed
