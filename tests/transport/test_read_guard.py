"""The engine's read guard (``transport.read_guard``) with real processes on 127.0.0.1, port 0.

The owner installs ``guard(peer, tag) -> allowed ranges or None`` through the engine seam; the
puller tags its pulls with ``engine.read_tag(tag)``. Over ``tcp`` a pull with the right tag
inside its ranges moves the right bytes; one without a tag, with a wrong tag, or reaching outside
its tag's ranges (in any one descriptor) is refused with ``LLM_KV_CACHE_NOT_EXIST`` before a byte
moves (the puller's destination keeps its guard bytes) and the link stays. The same through the
staging plane: ``tests/transport/planes/test_staging.py``."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Dict, List, Optional, Sequence

import numpy as np
import pytest

import llm_datadist as ld
from llm_datadist import BlocksCacheKey, CacheDesc, DataType, Placement
from llm_datadist.status import LLMStatusCode
from llm_datadist.testing import Cluster, link
from llm_datadist.transport import budgets

S = LLMStatusCode
SERVER_ID, CLIENT_ID, OTHER_ID = 41, 42, 43
BLOCK, BLOCKS, TENSORS = 4096, 8, 2
FILL = 0xAB


# -- in the cluster processes ------------------------------------------------------------------------

def c_register(state, seed: Optional[int]) -> List[int]:
    """A blocks cache (model 0) of TENSORS x BLOCKS x BLOCK bytes: random from ``seed``, or FILL."""
    rng = np.random.default_rng(seed)
    state.arrays = [rng.integers(0, 256, (BLOCKS, BLOCK), dtype=np.uint8) if seed is not None
                    else np.full((BLOCKS, BLOCK), FILL, dtype=np.uint8) for _ in range(TENSORS)]
    desc = CacheDesc(TENSORS, [BLOCKS, BLOCK], DataType.DT_UINT8, Placement.HOST)
    state.cache = state.cm.register_blocks_cache(desc, [a.ctypes.data for a in state.arrays],
                                                 BlocksCacheKey(state.cluster_id, 0))
    return [a.ctypes.data for a in state.arrays]


def c_guard(state, allowed: Optional[Dict[str, List[int]]]) -> None:
    """Allow each tag (str) the blocks listed for it, in every tensor; None: no guard."""
    if allowed is None:
        state.dd.engine.set_read_guard(None)
        return
    ranges = {tag.encode(): [(a.ctypes.data + b * BLOCK, BLOCK) for a in state.arrays for b in blocks]
              for tag, blocks in allowed.items()}
    state.guard_calls = []

    def guard(peer: int, tag: bytes):
        state.guard_calls.append((peer, tag))
        return ranges.get(tag)
    state.dd.engine.set_read_guard(guard)


def c_guard_calls(state) -> list:
    return [[peer, tag.decode()] for peer, tag in getattr(state, "guard_calls", [])]


def c_pull(state, src: Sequence[int], dst: Sequence[int], tag: Optional[str]) -> str:
    """Pull blocks ``src`` of the server into ``dst`` here, tagged; "ok" or the status's name."""
    key = BlocksCacheKey(SERVER_ID, 0)
    try:
        if tag is None:
            state.cm.pull_blocks(key, state.cache, list(src), list(dst))
        else:
            with state.dd.engine.read_tag(tag):
                state.cm.pull_blocks(key, state.cache, list(src), list(dst))
    except ld.LLMException as exc:
        return exc.status_code.name
    return "ok"


def c_pull_range(state, src: Sequence[int], dst: Sequence[int], offsets: Sequence[int], tag: str) -> str:
    """Pull bytes ``[src_offset, src_offset + nbytes)`` of the server's blocks ``src`` to
    ``dst_offset`` in blocks ``dst`` here (``offsets``: src_offset, dst_offset, nbytes), through
    the engine seam, tagged; "ok" or the status's name."""
    try:
        with state.dd.engine.read_tag(tag):
            state.dd.engine.pull_block_range(SERVER_ID, 0, state.cache.cache_id, list(src), list(dst), *offsets)
    except ld.LLMException as exc:
        return exc.status_code.name
    return "ok"


def c_arrays(state) -> List[np.ndarray]:
    return [a.copy() for a in state.arrays]


def c_link_state(state) -> dict:
    links = state.dd.engine.links
    return {"linked": links.linked_clusters(), "lost": links.lost_links(),
            "refused_reads": links.stats["refused_reads"]}


def c_bad_tag(state, tag) -> str:
    try:
        with state.dd.engine.read_tag(tag):
            return "entered"
    except ld.LLMException as exc:
        return exc.status_code.name


# -- the tests -----------------------------------------------------------------------------------

@pytest.fixture
def trio():
    """An owner with random blocks, and two linked pullers whose caches hold FILL (tcp)."""
    with ExitStack() as stack:
        server = stack.enter_context(Cluster(SERVER_ID, "PROMPT", listen=True, plane="tcp", timeout=30.0))
        client = stack.enter_context(Cluster(CLIENT_ID, "DECODER", plane="tcp", timeout=30.0))
        other = stack.enter_context(Cluster(OTHER_ID, "DECODER", plane="tcp", timeout=30.0))
        server.call(c_register, 7)
        for puller in (client, other):
            puller.call(c_register, None)
            link(puller, server)
        yield server, client, other


def _untouched(puller) -> None:
    for array in puller.call(c_arrays):
        assert (array == FILL).all(), "a refused pull wrote into the puller's cache"


def test_without_a_guard_every_pull_passes(trio):
    server, client, _ = trio
    assert client.call(c_pull, [3], [0], None) == "ok"
    assert client.call(c_pull, [4], [1], "any tag") == "ok"
    want = server.call(c_arrays)
    got = client.call(c_arrays)
    for t in range(TENSORS):
        assert (got[t][0] == want[t][3]).all() and (got[t][1] == want[t][4]).all()


def test_a_guarded_pull_needs_its_tag_and_stays_in_its_ranges(trio):
    server, client, other = trio
    server.call(c_guard, {"req-a.token": [1, 2, 5], "req-b.token": [6]})
    want = server.call(c_arrays)

    # Refused: no tag, a wrong tag, another request's tag, blocks 1 and 2 with block 3 outside
    # the tag's (one merged descriptor running past the allowed ranges), blocks 5 and 6 (allowed
    # to different tags), a block of no tag.
    for puller, src, tag in [(client, [1], None), (client, [1], "req-a.wrong"), (other, [1], "req-b.token"),
                             (client, [1, 2, 3], "req-a.token"), (client, [5, 6], "req-a.token"),
                             (other, [0], "req-a.token")]:
        assert puller.call(c_pull, src, list(range(len(src))), tag) == "LLM_KV_CACHE_NOT_EXIST", (src, tag)
    _untouched(client)
    _untouched(other)
    # The guard saw the tags (the untagged pull never reached it) and the links stayed.
    calls = server.call(c_guard_calls)
    assert [CLIENT_ID, "req-a.wrong"] in calls and [OTHER_ID, "req-b.token"] in calls
    state = server.call(c_link_state)
    assert sorted(state["linked"]) == [CLIENT_ID, OTHER_ID] and state["lost"] == {}
    assert state["refused_reads"] >= 6

    # Allowed: the right tag, inside its ranges, by either peer; the right bytes land.
    assert client.call(c_pull, [5, 1, 2], [0, 3, 7], "req-a.token") == "ok"
    assert other.call(c_pull, [6], [2], "req-b.token") == "ok"
    assert other.call(c_pull, [1, 2], [4, 5], "req-a.token") == "ok"  # one descriptor over two blocks
    got, got_other = client.call(c_arrays), other.call(c_arrays)
    for t in range(TENSORS):
        for s, d in [(5, 0), (1, 3), (2, 7)]:
            assert (got[t][d] == want[t][s]).all()
        assert (got_other[t][2] == want[t][6]).all() and (got_other[t][4:6] == want[t][1:3]).all()
        for d in (1, 2, 4, 5, 6):
            assert (got[t][d] == FILL).all()

    # The guard removed: untagged pulls pass again.
    server.call(c_guard, None)
    assert other.call(c_pull, [0], [0], None) == "ok"


def test_a_guard_that_raises_refuses_and_the_link_stays(trio):
    server, client, _ = trio
    server.call(c_guard, {"t": [0]})
    server.call(_raising_guard)
    assert client.call(c_pull, [0], [0], "t") == "LLM_KV_CACHE_NOT_EXIST"
    _untouched(client)
    server.call(c_guard, {"t": [0]})
    assert client.call(c_pull, [0], [0], "t") == "ok"


def _raising_guard(state) -> None:
    def guard(peer, tag):
        raise RuntimeError("the guard failed")
    state.dd.engine.set_read_guard(guard)


def test_a_tag_longer_than_the_budget_is_refused_before_it_is_sent(trio):
    _, client, _ = trio
    assert client.call(c_bad_tag, b"x" * budgets.MAX_PULL_TAG_BYTES) == "entered"
    assert client.call(c_bad_tag, b"x" * (budgets.MAX_PULL_TAG_BYTES + 1)) == "LLM_PARAM_INVALID"
    assert client.call(c_bad_tag, 17) == "LLM_PARAM_INVALID"


def test_a_byte_range_of_each_block_passes_the_guard_and_lands_where_asked(trio):
    """The engine seam's ranged pull (a tensor parallel rank's heads): ranges inside the leased
    blocks pass the guard over tcp, and land at their offset; the rest of the block keeps its
    bytes; a range past its block is refused before anything moves."""
    server, client, _ = trio
    server.call(c_guard, {"req-a.token": [1, 2]})
    want = server.call(c_arrays)
    half = BLOCK // 2
    assert client.call(c_pull_range, [2, 1], [0, 5], (half, 0, half), "req-a.token") == "ok"
    assert client.call(c_pull_range, [1], [3], (0, half, half), "req-a.token") == "ok"
    assert client.call(c_pull_range, [1], [4], (half, 0, half + 1), "req-a.token") == "LLM_PARAM_INVALID"
    assert client.call(c_pull_range, [3], [4], (0, 0, half), "req-a.token") == "LLM_KV_CACHE_NOT_EXIST"
    got = client.call(c_arrays)
    for t in range(TENSORS):
        assert (got[t][0][:half] == want[t][2][half:]).all() and (got[t][0][half:] == FILL).all()
        assert (got[t][5][:half] == want[t][1][half:]).all() and (got[t][5][half:] == FILL).all()
        assert (got[t][3][:half] == FILL).all() and (got[t][3][half:] == want[t][1][:half]).all()
        assert (got[t][4] == FILL).all()


@pytest.mark.parametrize("plane", ["tcp", "cma"])
def test_a_guard_sees_the_pulls_of_tcp_and_not_those_of_cma(plane):
    """The limit of a read guard (docs/security.md): it checks what this side's server answers.
    A guard that allows nothing refuses a pull over ``tcp``; over ``cma`` the peer reads this
    process's memory itself (``process_vm_readv``) and the pull passes unseen."""
    with ExitStack() as stack:
        server = stack.enter_context(Cluster(SERVER_ID, "PROMPT", listen=True, plane=plane, timeout=30.0))
        client = stack.enter_context(Cluster(CLIENT_ID, "DECODER", plane=plane, timeout=30.0))
        server.call(c_register, 7)
        client.call(c_register, None)
        link(client, server)
        assert client.call(c_plane, SERVER_ID) == plane
        server.call(c_guard, {})
        if plane == "tcp":
            assert client.call(c_pull, [3], [0], "any tag") == "LLM_KV_CACHE_NOT_EXIST"
            _untouched(client)
            return
        assert client.call(c_pull, [3], [0], "any tag") == "ok"
        assert server.call(c_guard_calls) == []
        want, got = server.call(c_arrays), client.call(c_arrays)
        assert all((got[t][0] == want[t][3]).all() for t in range(TENSORS))


def c_plane(state, remote_id: int) -> str:
    return state.dd.engine.links.data_plane(remote_id)
