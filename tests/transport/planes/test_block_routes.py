"""Block routes (``_io.BlockRoute``), the latency path of repeated ``push_blocks`` /
``pull_blocks`` calls, seen through the public API on every data plane: a plane that builds
routes (cma, tcp and staging's host frames) must give exactly the results and errors of the checked
path, and a route must never outlive what it was built from — the peer's registry generation, the
link, the local cache, the engine. A plane without routes runs the same tests and must simply never
hold one.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import pytest

from llm_datadist import BlocksCacheKey, LLMStatusCode
from llm_datadist.testing import ChildError, link
from llm_datadist.transport import planes
from llm_datadist.transport.planes.base import DataPlane

import cluster_ops as ops

pytestmark = pytest.mark.usefixtures("plane")

S = LLMStatusCode
SERVER, CLIENT = 31, 32
MODEL = 7
TENSORS, BLOCKS, WORDS = 4, 8, 16  # int32 words per block: 64-byte blocks


# -- run in the cluster processes ---------------------------------------------------------------

def routes(state) -> List[tuple]:
    """The engine's route keys: (remote cluster, model_id, local cache_id, push?)."""
    return sorted(state.dd.engine.routes)


def forget_routes(state) -> None:
    state.dd.engine.routes.clear()


def outcome(state, method: str, key_args: tuple, cache: str, *args, **kwargs) -> Optional[tuple]:
    """None if the call went through, else (exception class name, status code or None)."""
    try:
        ops.py(state, method, BlocksCacheKey(*key_args), cache, *args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the point is to report any exception
        code = getattr(exc, "status_code", None)
        return type(exc).__name__, None if code is None else int(code)
    return None


def reregister_elsewhere(state, name: str) -> int:
    """Unregister cache ``name`` (keeping its arrays alive and readable as ``name + '_old'``) and
    register fresh memory under the same model_id; returns the new cache_id."""
    state.arrays[name + "_old"] = state.arrays[name]
    ops.unregister(state, name)
    return ops.register(state, name, TENSORS, (BLOCKS, WORDS), "HOST", True, (), MODEL)


def finalize(state) -> int:
    engine = state.dd.engine
    state.dd.finalize()
    state.dd = None
    return len(engine.routes)


# -- fixtures ---------------------------------------------------------------------------------------

@pytest.fixture
def pair(clusters):
    options = {"remote_cache_accessible": "1"}
    server = clusters.start(SERVER, "PROMPT", listen=True, options=options)
    client = clusters.start(CLIENT, "DECODER", options=options)
    server.call(ops.register, "remote", TENSORS, (BLOCKS, WORDS), "HOST", True, (), MODEL)
    client.call(ops.register, "local", TENSORS, (BLOCKS, WORDS), "HOST", True)
    assert link(client, server) == (0, [0])
    return server, client


def builds_routes(plane: str) -> bool:
    """Whether the plane makes block routes (it overrides ``DataPlane.block_route``)."""
    return planes.get(plane).block_route is not DataPlane.block_route


def expected_blocks(src: List[np.ndarray], dst: List[np.ndarray], pairs, src_blocks, dst_blocks):
    out = [t.copy() for t in dst]
    for s_t, d_t in pairs:
        for s, d in zip(src_blocks, dst_blocks):
            out[d_t][d] = src[s_t][s]
    return out


def same(got, want) -> bool:
    return all(np.array_equal(g, w) for g, w in zip(got, want)) and len(got) == len(want)


# -- tests ----------------------------------------------------------------------------------------

def test_repeated_pushes_and_pulls_move_exactly_the_checked_bytes(pair, plane):
    server, client = pair
    key = (SERVER, MODEL)
    calls = [  # (method, src blocks, dst blocks, layer kwargs, tensor pairs)
        ("push_blocks", [0], [1], {}, [(t, t) for t in range(TENSORS)]),
        ("push_blocks", [2, 3], [5, 4], {}, [(t, t) for t in range(TENSORS)]),
        ("push_blocks", (6,), (7,), dict(src_layer_range=range(1, 2), dst_layer_range=range(0, 1)),
         [(2, 0), (3, 1)]),
        ("push_blocks", [1], [0], dict(src_layer_range=range(0, 1), dst_layer_range=range(1, 2),
                                       tensor_num_per_layer=2), [(0, 2), (1, 3)]),
        ("pull_blocks", [3], [2], {}, [(t, t) for t in range(TENSORS)]),
        ("pull_blocks", [4, 0], [6, 7], dict(tensor_num_per_layer=1, src_layer_range=range(3, 4),
                                             dst_layer_range=range(0, 1)), [(3, 0)]),
    ]
    for round_ in range(3):  # the first round learns the routes, the others use them
        for i, (method, sb, db, kwargs, pairs) in enumerate(calls):
            local = client.call(ops.fill, "local", 100 * round_ + 2 * i)
            remote = server.call(ops.fill, "remote", 100 * round_ + 2 * i + 1)
            client.call(ops.py, method, BlocksCacheKey(*key), "local", sb, db, **kwargs)
            if method == "push_blocks":
                want_local, want_remote = local, expected_blocks(local, remote, pairs, sb, db)
            else:
                want_local, want_remote = expected_blocks(remote, local, pairs, sb, db), remote
            assert same(client.call(ops.snapshot, "local"), want_local), (round_, method, sb, db, kwargs)
            assert same(server.call(ops.snapshot, "remote"), want_remote), (round_, method, sb, db, kwargs)
    local_id = client.call(cache_id_of, "local")
    expected = [(SERVER, MODEL, local_id, False), (SERVER, MODEL, local_id, True)] if builds_routes(plane) else []
    assert client.call(routes) == expected


def cache_id_of(state, name: str) -> int:
    return state.caches[name].cache_id


BAD_CALLS = [
    ("push_blocks", ([BLOCKS], [0]), {}),
    ("push_blocks", ([0], [BLOCKS]), {}),
    ("push_blocks", ([-1], [0]), {}),
    ("push_blocks", ([True], [0]), {}),
    ("push_blocks", ([0.0], [0]), {}),
    ("push_blocks", ([0, 1], [0]), {}),
    ("push_blocks", ([], []), {}),
    ("push_blocks", ([0], [1]), dict(src_layer_range=range(0, 3))),
    ("push_blocks", ([0], [1]), dict(src_layer_range=range(0, 1))),
    ("push_blocks", ([0], [1]), dict(tensor_num_per_layer=0)),
    ("push_blocks", ([0], [1]), dict(tensor_num_per_layer=True)),
    ("push_blocks", ([0], [1]), dict(src_layer_range=[0])),
    ("pull_blocks", ([BLOCKS], [0]), {}),
    ("pull_blocks", ([0], [-1]), {}),
    ("pull_blocks", ([0], [1]), dict(src_layer_range=range(0, 1), dst_layer_range=range(0, 2))),
    ("pull_blocks", ([0], [1]), dict(unknown=1)),
]


def test_bad_calls_after_a_route_exists_fail_as_without_one(pair):
    """Every bad call is made twice: with no route (the reference) and with a route learnt from
    a good call of the same method; the exception and status must be the same, and nothing
    may have moved."""
    server, client = pair
    key = (SERVER, MODEL)
    for method, args, kwargs in BAD_CALLS:
        client.call(forget_routes)
        local = client.call(ops.fill, "local", 1)
        remote = server.call(ops.fill, "remote", 2)
        reference = client.call(outcome, method, key, "local", *args, **kwargs)
        assert reference is not None, (method, args, kwargs)
        assert client.call(outcome, method, key, "local", [0], [1]) is None  # learns a route
        local = client.call(ops.snapshot, "local")
        remote = server.call(ops.snapshot, "remote")
        assert client.call(outcome, method, key, "local", *args, **kwargs) == reference, (method, args, kwargs)
        assert same(client.call(ops.snapshot, "local"), local) and same(server.call(ops.snapshot, "remote"), remote)


@pytest.mark.parametrize("method", ["push_blocks", "pull_blocks"])
@pytest.mark.parametrize("stepped", [range(0, 5, 10), range(0, -1, -1), range(0, 2, 2)])
def test_a_range_equal_to_a_learnt_one_but_of_another_step_is_refused(pair, method, stepped):
    """``range(0, 5, 10) == range(0, 1)`` in Python, but only step 1 is a layer range: the call
    must be refused as it is without a route, and move nothing."""
    server, client = pair
    key = (SERVER, MODEL)
    learnt = dict(src_layer_range=range(0, 1), dst_layer_range=range(0, 1))
    bad = dict(src_layer_range=stepped, dst_layer_range=range(0, 1))
    client.call(forget_routes)
    reference = client.call(outcome, method, key, "local", [0], [1], **bad)
    assert reference is not None
    assert client.call(outcome, method, key, "local", [0], [1], **learnt) is None
    local, remote = client.call(ops.fill, "local", 9), server.call(ops.fill, "remote", 10)
    assert client.call(outcome, method, key, "local", [0], [1], **bad) == reference
    assert same(client.call(ops.snapshot, "local"), local) and same(server.call(ops.snapshot, "remote"), remote)


def test_a_route_follows_the_peer_re_registering_its_cache(pair):
    """The peer unregisters the cache and registers other memory under the same model_id: the
    next push must land in the new memory (the route saw the generation change), and the old
    memory must stay as it was."""
    server, client = pair
    local = client.call(ops.fill, "local", 3)
    client.call(ops.py, "push_blocks", BlocksCacheKey(SERVER, MODEL), "local", [0], [1])
    client.call(ops.py, "push_blocks", BlocksCacheKey(SERVER, MODEL), "local", [0], [1])
    old = server.call(ops.fill, "remote", 4)
    server.call(reregister_elsewhere, "remote")
    fresh = server.call(ops.snapshot, "remote")
    client.call(ops.py, "push_blocks", BlocksCacheKey(SERVER, MODEL), "local", [2], [3])
    assert same(server.call(ops.snapshot, "remote_old"), old)
    assert same(server.call(ops.snapshot, "remote"),
                expected_blocks(local, fresh, [(t, t) for t in range(TENSORS)], [2], [3]))


def test_a_dropped_local_cache_drops_its_routes_and_fails_as_before(pair, plane):
    server, client = pair
    client.call(ops.py, "push_blocks", BlocksCacheKey(SERVER, MODEL), "local", [0], [1])
    cache_id = client.call(cache_id_of, "local")
    stale_cache = client.call(stash_cache, "local")
    client.call(ops.unregister, "local")
    assert client.call(routes) == []
    result = client.call(outcome, "push_blocks", (SERVER, MODEL), stale_cache, [0], [1])
    assert result == ("LLMException", int(S.LLM_KV_CACHE_NOT_EXIST)), (cache_id, result)


def stash_cache(state, name: str) -> str:
    state.caches[name + "_stale"] = state.caches[name]
    return name + "_stale"


def test_unlink_relink_and_a_dead_peer(pair, plane):
    server, client = pair
    key = BlocksCacheKey(SERVER, MODEL)
    client.call(ops.py, "push_blocks", key, "local", [0], [1])
    client.call(ops.py, "push_blocks", key, "local", [0], [1])
    assert client.call(ops.py_unlink, [(SERVER, *server.address)]) == (0, [0])
    assert client.call(outcome, "push_blocks", (SERVER, MODEL), "local", [0], [1]) == \
        ("LLMException", int(S.LLM_NOT_YET_LINK))
    assert link(client, server) == (0, [0])
    local = client.call(ops.fill, "local", 5)
    remote = server.call(ops.fill, "remote", 6)
    client.call(ops.py, "push_blocks", key, "local", [4], [5])
    client.call(ops.py, "push_blocks", key, "local", [4], [5])
    assert same(server.call(ops.snapshot, "remote"),
                expected_blocks(local, remote, [(t, t) for t in range(TENSORS)], [4], [5]))
    server.process.kill()
    server.process.join(10)
    with pytest.raises(ChildError) as info:
        client.call(ops.py, "push_blocks", key, "local", [0], [1], timeout=30)
    assert info.value.status_code in (S.LLM_LINK_FAILED, S.LLM_NOT_YET_LINK, S.LLM_TIMEOUT)


def test_finalize_drops_every_route(pair):
    server, client = pair
    client.call(ops.py, "push_blocks", BlocksCacheKey(SERVER, MODEL), "local", [0], [1])
    assert client.call(finalize) == 0


def test_without_remote_access_pushes_are_refused_every_time(clusters):
    """Without remote-cache-accessible mode push_blocks is refused (LLM_PARAM_INVALID), the
    second time as the first: no route is ever learnt from a refused call."""
    server = clusters.start(SERVER, "PROMPT", listen=True, options={"remote_cache_accessible": "0"})
    client = clusters.start(CLIENT, "DECODER", options={"remote_cache_accessible": "0"})
    server.call(ops.register, "remote", TENSORS, (BLOCKS, WORDS), "HOST", True, (), MODEL)
    client.call(ops.register, "local", TENSORS, (BLOCKS, WORDS), "HOST", True)
    assert link(client, server) == (0, [0])
    for _ in range(2):
        assert client.call(outcome, "push_blocks", (SERVER, MODEL), "local", [0], [1]) == \
            ("LLMException", int(S.LLM_PARAM_INVALID))
    assert client.call(routes) == []

