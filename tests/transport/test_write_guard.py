"""The engine's write guard (``read_guard.WriteGuard``) with real processes on 127.0.0.1, port 0.

The owner of a cache (a decode engine: it links to the writers, which listen) installs
``guard(peer) -> allowed ranges or None``; writers push over the link the owner made. Over
``tcp`` a push inside what the guard allows that peer lands; one from a peer without a grant,
or with any one descriptor outside its grant, is refused with ``LLM_KV_CACHE_NOT_EXIST`` before
a byte lands (every block outside the grant keeps its guard bytes) and the link stays."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Dict, List, Optional, Sequence

import numpy as np
import pytest

import llm_datadist as ld
from llm_datadist import BlocksCacheKey, CacheDesc, DataType, Placement
from llm_datadist.testing import Cluster, link

OWNER_ID, WRITER_ID, OTHER_ID = 51, 52, 53
BLOCK, BLOCKS, TENSORS = 4096, 8, 2
FILL = 0xAB


def c_register(state, seed: Optional[int]) -> None:
    rng = np.random.default_rng(seed)
    state.arrays = [rng.integers(0, 256, (BLOCKS, BLOCK), dtype=np.uint8) if seed is not None
                    else np.full((BLOCKS, BLOCK), FILL, dtype=np.uint8) for _ in range(TENSORS)]
    desc = CacheDesc(TENSORS, [BLOCKS, BLOCK], DataType.DT_UINT8, Placement.HOST)
    state.cache = state.cm.register_blocks_cache(desc, [a.ctypes.data for a in state.arrays],
                                                 BlocksCacheKey(state.cluster_id, 0))


def c_grant(state, grants: Optional[Dict[int, List[int]]]) -> None:
    """Allow each peer (cluster id) the blocks listed for it, in every tensor; None: no guard."""
    if grants is None:
        state.dd.engine.set_write_guard(None)
        return
    ranges = {peer: [(a.ctypes.data + b * BLOCK, BLOCK) for a in state.arrays for b in blocks]
              for peer, blocks in grants.items()}
    state.dd.engine.set_write_guard(lambda peer: ranges.get(peer))


def c_raising_guard(state) -> None:
    def guard(peer):
        raise RuntimeError("the guard failed")
    state.dd.engine.set_write_guard(guard)


def c_push(state, src: Sequence[int], dst: Sequence[int], layers: Optional[Sequence[int]] = None) -> str:
    """Push blocks ``src`` here into the owner's ``dst`` (of layer range ``layers``, one tensor
    per layer); "ok" or the status's name."""
    key = BlocksCacheKey(OWNER_ID, 0)
    try:
        if layers is None:
            state.cm.push_blocks(key, state.cache, list(src), list(dst))
        else:
            lr = range(*layers)
            state.cm.push_blocks(key, state.cache, list(src), list(dst), lr, lr, 1)
    except ld.LLMException as exc:
        return exc.status_code.name
    return "ok"


def c_arrays(state) -> List[np.ndarray]:
    return [a.copy() for a in state.arrays]


def c_links(state) -> dict:
    links = state.dd.engine.links
    return {"linked": sorted(links.linked_clusters()), "lost": links.lost_links(),
            "refused_writes": links.stats["refused_writes"]}


@pytest.fixture
def trio():
    """An owner whose cache holds FILL, linked to two writers with random blocks (tcp)."""
    with ExitStack() as stack:
        owner = stack.enter_context(Cluster(OWNER_ID, "DECODER", plane="tcp", timeout=30.0))
        writer = stack.enter_context(Cluster(WRITER_ID, "PROMPT", listen=True, plane="tcp", timeout=30.0))
        other = stack.enter_context(Cluster(OTHER_ID, "PROMPT", listen=True, plane="tcp", timeout=30.0))
        owner.call(c_register, None)
        writer.call(c_register, 7)
        other.call(c_register, 8)
        link(owner, writer)
        link(owner, other)
        yield owner, writer, other


def _only(owner, changed: Dict[int, np.ndarray]) -> None:
    """The owner's blocks ``changed`` hold what is given, every other block FILL."""
    got = owner.call(c_arrays)
    for t in range(TENSORS):
        for b in range(BLOCKS):
            if b in changed:
                assert (got[t][b] == changed[b][t]).all(), (t, b)
            else:
                assert (got[t][b] == FILL).all(), f"block {b} of tensor {t} outside the grants changed"


def test_without_a_guard_a_writer_writes_over_the_owners_link(trio):
    owner, writer, _ = trio
    assert writer.call(c_push, [3], [5]) == "ok"
    src = writer.call(c_arrays)
    _only(owner, {5: [src[t][3] for t in range(TENSORS)]})


def test_pushes_outside_a_grant_are_refused_and_change_nothing(trio):
    owner, writer, other = trio
    owner.call(c_grant, {WRITER_ID: [1, 2, 6]})
    # refused: a block of no grant, a run past the grant (one descriptor 2..3), a peer without a
    # grant writing granted blocks, one layer of a block outside the grant
    assert writer.call(c_push, [0], [0]) == "LLM_KV_CACHE_NOT_EXIST"
    assert writer.call(c_push, [0, 1], [2, 3]) == "LLM_KV_CACHE_NOT_EXIST"
    assert writer.call(c_push, [4, 5], [1, 7]) == "LLM_KV_CACHE_NOT_EXIST"
    assert other.call(c_push, [1], [1]) == "LLM_KV_CACHE_NOT_EXIST"
    assert writer.call(c_push, [0], [4], [1, 2]) == "LLM_KV_CACHE_NOT_EXIST"
    _only(owner, {})
    state = owner.call(c_links)
    assert state["linked"] == [WRITER_ID, OTHER_ID] and state["lost"] == {}
    assert state["refused_writes"] >= 5  # (a refused push is retried once, on a fresh table)
    # allowed: inside the grant, whole blocks and one layer at a time; the right bytes land
    assert writer.call(c_push, [4, 5], [1, 2]) == "ok"
    assert writer.call(c_push, [0], [6], [1, 2]) == "ok"
    src = writer.call(c_arrays)
    _only(owner, {1: [src[t][4] for t in range(TENSORS)], 2: [src[t][5] for t in range(TENSORS)],
                  6: [np.full(BLOCK, FILL, np.uint8), src[1][0]]})
    # a grant withdrawn (the guard now allows nothing to that peer) refuses again
    owner.call(c_grant, {OTHER_ID: [0]})
    assert writer.call(c_push, [4], [1]) == "LLM_KV_CACHE_NOT_EXIST"
    assert other.call(c_push, [2], [0]) == "ok"


def test_a_guard_that_raises_refuses_and_the_link_stays(trio):
    owner, writer, _ = trio
    owner.call(c_raising_guard)
    assert writer.call(c_push, [0], [0]) == "LLM_KV_CACHE_NOT_EXIST"
    _only(owner, {})
    owner.call(c_grant, {WRITER_ID: [0]})
    assert writer.call(c_push, [0], [0]) == "ok"


# -- a push that passed the guard before the owner narrowed it ----------------------------------------

def c_mutable_grant(state, blocks: Sequence[int]) -> None:
    """Allow WRITER_ID ``blocks`` in every tensor, through a guard whose grant ``c_narrow`` ends."""
    state.allowed = {WRITER_ID: [(a.ctypes.data + b * BLOCK, BLOCK) for a in state.arrays for b in blocks]}
    state.dd.engine.set_write_guard(lambda peer: state.allowed.get(peer))


def c_narrow_and_quiesce(state, timeout_s: float) -> dict:
    """End WRITER_ID's grant, then wait for its pushes that passed before (``quiesce_writes``)."""
    import time

    state.allowed = {}
    start = time.monotonic()
    quiet = state.dd.engine.quiesce_writes(WRITER_ID, timeout_s)
    return {"quiet": quiet, "seconds": time.monotonic() - start, "arrays": c_arrays(state)}


def c_slow_push(state, src: Sequence[int], dst: Sequence[int], pause_s: float) -> str:
    """``c_push`` over the frames path, the payload sent ``pause_s`` after the descriptors."""
    import time

    from llm_datadist import _io
    from llm_datadist.transport.planes import tcp

    tcp.TcpPlane.block_route = lambda self, *args, **kwargs: None  # (this child process only)

    def send(fd, head, plan, timeout_ms, share=None):
        st, err = _io.send_bytes(fd, head, timeout_ms)
        if st:
            return st, err
        time.sleep(pause_s)
        return _io.send_plan(fd, b"", plan, False, timeout_ms)

    tcp.HOST_PAYLOAD.send = send
    return c_push(state, src, dst)


@pytest.mark.parametrize("pause_s, timeout_s, quiet", [(3.0, 0.5, False), (0.5, 20.0, True)])
def test_a_push_that_passed_the_guard_lands_before_quiesce_returns_or_never(pause_s, timeout_s, quiet):
    """The owner narrows the guard while a checked push's payload is still to come, then calls
    ``quiesce_writes``: either the push ends within the wait (it lands, the link stays, True) or
    its connection is shut down at the deadline (False): not one byte of it lands afterwards, the
    push fails and the link ends. Without the wait, the late payload landed in blocks the owner had
    already given back (the review's finding)."""
    import threading
    import time

    with ExitStack() as stack:
        owner = stack.enter_context(Cluster(OWNER_ID, "DECODER", plane="tcp", timeout=60.0))
        writer = stack.enter_context(Cluster(WRITER_ID, "PROMPT", listen=True, plane="tcp", timeout=60.0))
        owner.call(c_register, None)
        writer.call(c_register, 7)
        sent = writer.call(c_arrays)
        link(owner, writer)
        owner.call(c_mutable_grant, [2])
        result: dict = {}
        pusher = threading.Thread(target=lambda: result.setdefault("push", writer.call(c_slow_push, [3], [2],
                                                                                        pause_s)))
        pusher.start()
        time.sleep(0.3)  # its descriptors passed the guard; its payload comes pause_s after them
        done = owner.call(c_narrow_and_quiesce, timeout_s)
        pusher.join(60)
        assert done["quiet"] is quiet
        landed = [bool((done["arrays"][k][2] == sent[k][3]).all()) for k in range(TENSORS)]
        time.sleep(pause_s)  # (the payload's time has passed: nothing more can come)
        later = owner.call(c_arrays)
        for k in range(TENSORS):
            assert all((later[k][b] == FILL).all() for b in range(BLOCKS) if b != 2)
        if quiet:
            assert result["push"] == "ok" and landed == [True] * TENSORS  # landed before quiesce returned
            assert WRITER_ID in owner.call(c_links)["linked"]
        else:
            assert result["push"] != "ok"
            assert all((later[k][2] == FILL).all() for k in range(TENSORS)), "a byte landed after the deadline"
            assert WRITER_ID not in owner.call(c_links)["linked"]


def test_a_guards_tuple_answer_is_converted_once_and_a_list_every_time():
    """``WriteGuard`` keeps the ``RangeSet`` of a peer's last tuple answer (an owner answers with
    one tuple until that peer's grants change), and converts a list every time: an owner that
    narrows a list in place is seen at the next push."""
    import struct

    from llm_datadist import _io
    from llm_datadist.transport.read_guard import WriteGuard

    plan = _io.plan_from_wire(struct.pack("<QQQ", 0, 4096, BLOCK))  # writes [4096, 4096 + BLOCK)
    guard = WriteGuard(OWNER_ID)
    answer = ((4096, BLOCK),)
    guard.set(lambda peer: answer)
    assert guard.refusal(WRITER_ID, plan) == 0
    first = guard._converted[WRITER_ID][1]
    assert guard.refusal(WRITER_ID, plan) == 0 and guard._converted[WRITER_ID][1] is first
    answer = ((8192, BLOCK),)  # the peer's grants changed: a new tuple, converted anew
    assert guard.refusal(WRITER_ID, plan) != 0
    allowed = [(4096, BLOCK)]
    guard.set(lambda peer: allowed)
    assert guard.refusal(WRITER_ID, plan) == 0
    allowed.clear()  # narrowed in place
    assert guard.refusal(WRITER_ID, plan) != 0


@pytest.mark.parametrize("plane", ["tcp", "cma"])
def test_a_guard_sees_the_pushes_of_tcp_and_not_those_of_cma(plane):
    """The limit of a write guard (docs/security.md): it checks what this side's server
    receives. A guard that grants nothing refuses a push over ``tcp``; over ``cma`` the peer
    writes this process's memory itself (``process_vm_writev``) and the push lands unseen."""
    with ExitStack() as stack:
        owner = stack.enter_context(Cluster(OWNER_ID, "DECODER", plane=plane, timeout=30.0))
        writer = stack.enter_context(Cluster(WRITER_ID, "PROMPT", listen=True, plane=plane, timeout=30.0))
        owner.call(c_register, None)
        writer.call(c_register, 7)
        link(owner, writer)
        assert writer.call(c_plane, OWNER_ID) == plane
        owner.call(c_grant, {})
        if plane == "tcp":
            assert writer.call(c_push, [3], [5]) == "LLM_KV_CACHE_NOT_EXIST"
            _only(owner, {})
            return
        assert writer.call(c_push, [3], [5]) == "ok"
        src = writer.call(c_arrays)
        _only(owner, {5: [src[t][3] for t in range(TENSORS)]})


def c_plane(state, remote_id: int) -> str:
    return state.dd.engine.links.data_plane(remote_id)
