"""Every transfer call of both API styles between two real clusters, byte-exact against a numpy
model (spec §6.2, §6.6, §8.2, §8.3, §12.1, §12.2).

Clusters live for the whole module (once per data plane):

* Python, remote-cache-accessible on: server 1 (PROMPT, listening) and client 2 (DECODER);
* Python, remote-cache-accessible off: server 3 and client 4 (pulls by ``CacheKey``);
* C++: decoder 6 (kDecoder, listening) and prompt 5 (kPrompt).

Each side registers the same set of caches (the servers one extra first, so cache ids differ
between the sides). A valid call is checked against ``kv_model`` on the whole destination (bytes
outside the written ranges unchanged) and on the source (untouched). An invalid call must fail as
documented and leave the destination as it was.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import pytest

import llm_datadist as ld
from llm_datadist import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex, LLMStatusCode
from llm_datadist.testing import ChildError, Cluster, link

import cluster_ops as ops
from kv_model import assert_same, copy_blocks, copy_row_to_blocks, copy_rows, inclusive_tensors, layer_tensors

pytestmark = pytest.mark.usefixtures("plane")

S = LLMStatusCode
PI = ("LLMException", S.LLM_PARAM_INVALID)
NOT_EXIST = ("LLMException", S.LLM_KV_CACHE_NOT_EXIST)
NOT_LINKED = ("LLMException", S.LLM_NOT_YET_LINK)
TYPE = ("TypeError", None)
VALUE = ("ValueError", None)

UNLINKED = 77
SEEDS = itertools.count(1, 2)

# name: (num_tensors, shape, placement, blocks cache?, blocks model_id). int32 everywhere.
CACHES = {
    "rows_dev": (4, (3, 16), "DEVICE", False, None),      # 3 rows of 64 bytes
    "rows_host": (4, (3, 16), "HOST", False, None),
    "rows_wide": (4, (2, 32), "DEVICE", False, None),     # 2 rows of 128 bytes
    "rows_odd": (4, (2, 12), "DEVICE", False, None),      # 2 rows of 48 bytes
    "rows_2t": (2, (3, 16), "DEVICE", False, None),       # one layer of K, V
    "blocks_dev": (4, (6, 8), "DEVICE", True, 0),         # 6 blocks of 32 bytes
    "blocks_host": (4, (6, 8), "HOST", True, 1),
    "blocks_big": (4, (3, 16), "DEVICE", True, 2),        # 3 blocks of 64 bytes
    "blocks_2t": (2, (6, 8), "DEVICE", True, 3),
}
# Row r of these caches is bound to CacheKey(owner, req_id=base + r).
KEY_BASE = {"rows_dev": 10, "rows_host": 20}

CPP_CACHES = {
    "rows_dev": (4, (3, 16), "kDevice"),
    "rows_host": (4, (3, 16), "kHost"),
    "wide": (4, (2, 32), "kDevice"),
    "blocks_dev": (4, (6, 8), "kDevice"),
    "blocks_host": (4, (6, 8), "kHost"),
}


@dataclass
class Side:
    cluster: Cluster
    ids: Dict[str, int]

    @property
    def cluster_id(self) -> int:
        return self.cluster.cluster_id

    def call(self, fn, *args, **kwargs):
        return self.cluster.call(fn, *args, **kwargs)


@dataclass
class Pair:
    server: Side
    client: Side


def _register_all(cluster: Cluster, pad: bool) -> Dict[str, int]:
    ids = {}
    if pad:
        ids["pad"] = cluster.call(ops.register, "pad", 2, (1, 4))
    for name, (num_tensors, shape, placement, blocks, model_id) in CACHES.items():
        keys = [CacheKey(cluster.cluster_id, req_id=KEY_BASE[name] + row) for row in range(shape[0])] \
            if name in KEY_BASE else []
        ids[name] = cluster.call(ops.register, name, num_tensors, shape, placement, blocks, keys, model_id)
    return ids


def _python_pair(pool, server_id: int, client_id: int, accessible: str) -> Pair:
    options = {"remote_cache_accessible": accessible}
    server = pool.start(server_id, "PROMPT", listen=True, options=options)
    client = pool.start(client_id, "DECODER", options=options)
    pair = Pair(Side(server, _register_all(server, pad=True)), Side(client, _register_all(client, pad=False)))
    assert pair.server.ids["rows_dev"] != pair.client.ids["rows_dev"]
    assert link(client, server) == (0, [0])
    return pair


@pytest.fixture(scope="module")
def py_pair(module_clusters) -> Pair:
    return _python_pair(module_clusters, 1, 2, "1")


@pytest.fixture(scope="module")
def off_pair(module_clusters) -> Pair:
    return _python_pair(module_clusters, 3, 4, "0")


@dataclass
class CppPair:
    prompt: Side
    decoder: Side

    def sides(self, caller: str):
        """(caller, peer) for ``caller`` in {"prompt", "decoder"}."""
        return (self.prompt, self.decoder) if caller == "prompt" else (self.decoder, self.prompt)


@pytest.fixture(scope="module")
def cpp_pair(module_clusters) -> CppPair:
    decoder = module_clusters.start(6, "kDecoder", listen=True, api="cpp")
    prompt = module_clusters.start(5, "kPrompt", api="cpp")
    sides = []
    for cluster, pad in ((prompt, False), (decoder, True)):
        ids = {}
        if pad:
            ids["pad"] = cluster.call(ops.cpp_register, "pad", 2, (1, 4))
        for name, (num_tensors, shape, placement) in CPP_CACHES.items():
            ids[name] = cluster.call(ops.cpp_register, name, num_tensors, shape, placement)
        ids["alloc"] = cluster.call(ops.cpp_allocate, "alloc", 4, (6, 8))
        sides.append(Side(cluster, ids))
    assert link(prompt, decoder) == (0, [0])
    return CppPair(*sides)


# -- helpers ----------------------------------------------------------------------------------------

def expect_failure(expected, fn, *args, **kwargs) -> ChildError:
    kind, code = expected
    with pytest.raises(ChildError) as info:
        fn(*args, **kwargs)
    assert info.value.kind == kind, f"expected {kind}, got {info.value}"
    if code is not None:
        assert info.value.status_code == int(code), f"expected {code.name}, got {info.value}"
    return info.value


def tensors_for(kwargs: Dict[str, Any], src_n: int, dst_n: int):
    """Source and destination tensor lists selected by Python layer kwargs."""
    per_layer = kwargs.get("tensor_num_per_layer", 2)
    src_range, dst_range = kwargs.get("src_layer_range"), kwargs.get("dst_layer_range")
    if src_range is None and dst_range is None:
        return list(range(src_n)), list(range(dst_n))
    return layer_tensors(src_range, src_n, per_layer), layer_tensors(dst_range, dst_n, per_layer)


def cpp_tensors(ext: Optional[Dict[str, Any]], src_n: int, dst_n: int):
    """Source and destination tensor lists selected by a KvCacheExtParam (as a dict)."""
    ext = ext or {}
    per_layer = ext.get("tensor_num_per_layer", 2)
    src_range, dst_range = ext.get("src_layer_range", (-1, -1)), ext.get("dst_layer_range", (-1, -1))
    if tuple(src_range) == (-1, -1) and tuple(dst_range) == (-1, -1):
        return list(range(src_n)), list(range(dst_n))
    return inclusive_tensors(src_range, src_n, per_layer), inclusive_tensors(dst_range, dst_n, per_layer)


def row_bytes(cache) -> int:
    return cache[0].nbytes // cache[0].shape[0]


def by_index(name: str, row: int) -> Callable:
    return lambda cluster_id, ids: CacheKeyByIdAndIndex(cluster_id, ids[name], row)


def by_key(req_id: int, **fields) -> Callable:
    return lambda cluster_id, ids: CacheKey(cluster_id, req_id=req_id, **fields)


def by_model(model_id: int) -> Callable:
    return lambda cluster_id, ids: BlocksCacheKey(cluster_id, model_id)


def raw(value: Any) -> Callable:
    return lambda cluster_id, ids: value


# ==================================================================================================
# Python style: valid calls
# ==================================================================================================

PULL_CACHE_OK = [
    # id, src (server), src row, dst (client), dst row, size, kwargs
    ("dev-to-dev", "rows_dev", 2, "rows_dev", 1, -1, {}),
    ("host-to-dev", "rows_host", 0, "rows_dev", 2, -1, {}),
    ("dev-to-host", "rows_dev", 1, "rows_host", 0, -1, {}),
    ("host-to-host", "rows_host", 2, "rows_host", 2, -1, {}),
    ("layer1-to-layer1", "rows_dev", 0, "rows_dev", 1, -1,
     dict(src_layer_range=range(1, 2), dst_layer_range=range(1, 2))),
    ("layer0-to-layer1", "rows_dev", 1, "rows_dev", 1, -1,
     dict(src_layer_range=range(0, 1), dst_layer_range=range(1, 2))),
    ("n1-tensor3-to-tensor0", "rows_dev", 2, "rows_dev", 0, -1,
     dict(src_layer_range=range(3, 4), dst_layer_range=range(0, 1), tensor_num_per_layer=1)),
    ("n1-two-layers-shifted", "rows_dev", 0, "rows_host", 2, -1,
     dict(src_layer_range=range(0, 2), dst_layer_range=range(2, 4), tensor_num_per_layer=1)),
    ("n4-one-layer", "rows_host", 1, "rows_dev", 1, -1,
     dict(src_layer_range=range(0, 1), dst_layer_range=range(0, 1), tensor_num_per_layer=4)),
    ("n2-all-layers-explicit", "rows_dev", 1, "rows_dev", 0, -1,
     dict(src_layer_range=range(0, 2), dst_layer_range=range(0, 2), tensor_num_per_layer=2)),
    ("n1-without-ranges", "rows_dev", 0, "rows_dev", 2, -1, dict(tensor_num_per_layer=1)),
    ("n3-without-ranges", "rows_dev", 0, "rows_dev", 2, -1, dict(tensor_num_per_layer=3)),
    ("src-range-only", "rows_dev", 1, "rows_2t", 0, -1, dict(src_layer_range=range(1, 2))),
    ("dst-range-only", "rows_2t", 1, "rows_dev", 2, -1, dict(dst_layer_range=range(1, 2))),
    ("size-and-offsets", "rows_dev", 1, "rows_dev", 1, 16, dict(src_cache_offset=8, dst_cache_offset=32)),
    ("dst-offset-rest-of-row", "rows_dev", 2, "rows_dev", 0, -1, dict(dst_cache_offset=16)),
    ("src-offset-with-size", "rows_host", 0, "rows_dev", 1, 32, dict(src_cache_offset=32)),
    ("size-one-byte", "rows_dev", 0, "rows_host", 1, 1, dict(dst_cache_offset=63)),
    ("size-whole-row", "rows_dev", 2, "rows_dev", 2, 64, {}),
    ("offsets-unset", "rows_dev", 0, "rows_dev", 0, -1, dict(src_cache_offset=-1, dst_cache_offset=-1)),
    ("wide-row-into-narrow", "rows_wide", 1, "rows_dev", 0, -1, {}),
    ("wide-row-second-half", "rows_wide", 0, "rows_dev", 2, -1, dict(src_cache_offset=64)),
    ("narrow-row-into-wide", "rows_dev", 2, "rows_wide", 1, 64, dict(dst_cache_offset=32)),
    ("layers-offsets-size", "rows_dev", 1, "rows_host", 2, 8,
     dict(src_layer_range=range(1, 3), dst_layer_range=range(2, 4), tensor_num_per_layer=1,
          src_cache_offset=4, dst_cache_offset=56)),
]


@pytest.mark.parametrize("src,src_row,dst,dst_row,size,kwargs", [c[1:] for c in PULL_CACHE_OK],
                         ids=[c[0] for c in PULL_CACHE_OK])
def test_pull_cache(py_pair, src, src_row, dst, dst_row, size, kwargs):
    client, server = py_pair.client, py_pair.server
    src_data = server.call(ops.fill, src, next(SEEDS))
    dst_data = client.call(ops.fill, dst, next(SEEDS))
    key = CacheKeyByIdAndIndex(server.cluster_id, server.ids[src], src_row)
    client.call(ops.py, "pull_cache", key, dst, dst_row, size, **kwargs)
    st, dt = tensors_for(kwargs, len(src_data), len(dst_data))
    src_off = max(kwargs.get("src_cache_offset", -1), 0)
    dst_off = max(kwargs.get("dst_cache_offset", -1), 0)
    nbytes = size if size > 0 else row_bytes(dst_data) - dst_off
    expected = copy_rows(src_data, dst_data, st, dt, src_row, dst_row, nbytes, src_off, dst_off)
    assert_same(client.call(ops.snapshot, dst), expected, "destination")
    assert_same(server.call(ops.snapshot, src), src_data, "source")


@pytest.mark.parametrize("src,dst", [("rows_dev", "rows_host"), ("rows_host", "rows_dev")])
def test_pull_cache_by_the_listening_side(py_pair, src, dst):
    """The server pulls from its client over the reverse connection."""
    client, server = py_pair.client, py_pair.server
    src_data = client.call(ops.fill, src, next(SEEDS))
    dst_data = server.call(ops.fill, dst, next(SEEDS))
    server.call(ops.py, "pull_cache", CacheKeyByIdAndIndex(client.cluster_id, client.ids[src], 0), dst, 2)
    expected = copy_rows(src_data, dst_data, range(4), range(4), 0, 2, 64)
    assert_same(server.call(ops.snapshot, dst), expected, "destination")


PULL_BLOCKS_OK = [
    # id, src (server), src blocks, dst (client), dst blocks, kwargs
    ("dev-to-dev", "blocks_dev", [0, 1, 2, 5], "blocks_dev", [5, 4, 0, 1], {}),
    ("host-to-dev", "blocks_host", [3], "blocks_dev", [3], {}),
    ("dev-to-host", "blocks_dev", [5, 0], "blocks_host", [0, 5], {}),
    ("host-to-host", "blocks_host", [2, 4], "blocks_host", [1, 3], {}),
    ("consecutive-runs", "blocks_dev", [1, 2, 3], "blocks_dev", [2, 3, 4], {}),
    ("tuples", "blocks_dev", (4, 0), "blocks_dev", (0, 4), {}),
    ("layer1-to-layer0", "blocks_dev", [0, 1], "blocks_dev", [2, 3],
     dict(src_layer_range=range(1, 2), dst_layer_range=range(0, 1))),
    ("n1-tensors-2-3-to-0-1", "blocks_host", [5], "blocks_dev", [0],
     dict(src_layer_range=range(2, 4), dst_layer_range=range(0, 2), tensor_num_per_layer=1)),
    ("n4-one-layer", "blocks_dev", [1], "blocks_dev", [1],
     dict(src_layer_range=range(0, 1), dst_layer_range=range(0, 1), tensor_num_per_layer=4)),
    ("src-range-only", "blocks_dev", [0, 3], "blocks_2t", [1, 2], dict(src_layer_range=range(1, 2))),
    ("dst-range-only", "blocks_2t", [4], "blocks_dev", [5], dict(dst_layer_range=range(1, 2))),
]


@pytest.mark.parametrize("src,src_blocks,dst,dst_blocks,kwargs", [c[1:] for c in PULL_BLOCKS_OK],
                         ids=[c[0] for c in PULL_BLOCKS_OK])
def test_pull_blocks(py_pair, src, src_blocks, dst, dst_blocks, kwargs):
    client, server = py_pair.client, py_pair.server
    src_data = server.call(ops.fill, src, next(SEEDS))
    dst_data = client.call(ops.fill, dst, next(SEEDS))
    model_id = CACHES[src][4]
    client.call(ops.py, "pull_blocks", BlocksCacheKey(server.cluster_id, model_id), dst, src_blocks, dst_blocks,
                **kwargs)
    st, dt = tensors_for(kwargs, len(src_data), len(dst_data))
    expected = copy_blocks(src_data, dst_data, st, dt, src_blocks, dst_blocks)
    assert_same(client.call(ops.snapshot, dst), expected, "destination")
    assert_same(server.call(ops.snapshot, src), src_data, "source")


ROW_TO_BLOCKS_OK = [
    # id, src (server, contiguous), src row, dst (client, blocks), dst blocks, kwargs
    ("row-into-two-blocks", "rows_dev", 1, "blocks_dev", [4, 1], {}),
    ("first-chunk-only", "rows_dev", 0, "blocks_dev", [3], {}),
    ("wide-row-four-blocks", "rows_wide", 1, "blocks_dev", [0, 2, 4, 5], {}),
    ("short-last-chunk", "rows_odd", 1, "blocks_dev", [2, 5], {}),
    ("host-to-host", "rows_host", 2, "blocks_host", [5, 0], {}),
    ("dev-to-host", "rows_dev", 2, "blocks_host", [1, 2], {}),
    ("layer1-to-layer0", "rows_dev", 2, "blocks_dev", [0, 1],
     dict(src_layer_range=range(1, 2), dst_layer_range=range(0, 1))),
    ("n1-tensor0-to-tensor3", "rows_host", 1, "blocks_dev", [3, 2],
     dict(src_layer_range=range(0, 1), dst_layer_range=range(3, 4), tensor_num_per_layer=1)),
    ("dst-range-only", "rows_2t", 0, "blocks_dev", [1, 0], dict(dst_layer_range=range(1, 2))),
]


@pytest.mark.parametrize("src,src_row,dst,dst_blocks,kwargs", [c[1:] for c in ROW_TO_BLOCKS_OK],
                         ids=[c[0] for c in ROW_TO_BLOCKS_OK])
def test_pull_blocks_from_a_row(py_pair, src, src_row, dst, dst_blocks, kwargs):
    """pull_blocks with a CacheKeyByIdAndIndex: the remote row cut into the local blocks."""
    client, server = py_pair.client, py_pair.server
    src_data = server.call(ops.fill, src, next(SEEDS))
    dst_data = client.call(ops.fill, dst, next(SEEDS))
    key = CacheKeyByIdAndIndex(server.cluster_id, server.ids[src], src_row)
    client.call(ops.py, "pull_blocks", key, dst, [], dst_blocks, **kwargs)
    st, dt = tensors_for(kwargs, len(src_data), len(dst_data))
    expected = copy_row_to_blocks(src_data, dst_data, st, dt, src_row, dst_blocks)
    assert_same(client.call(ops.snapshot, dst), expected, "destination")
    assert_same(server.call(ops.snapshot, src), src_data, "source")


PUSH_CACHE_OK = [
    # id, src (client), src row, dst (server), key (row of dst), kwargs
    ("dev-to-dev", "rows_dev", 1, "rows_dev", by_index("rows_dev", 2), {}),
    ("host-to-dev", "rows_host", 2, "rows_dev", by_index("rows_dev", 0), {}),
    ("dev-to-host", "rows_dev", 0, "rows_host", by_index("rows_host", 1), {}),
    ("host-to-host", "rows_host", 0, "rows_host", by_index("rows_host", 0), {}),
    ("cache-key-row1", "rows_dev", 2, "rows_dev", by_key(11), {}),
    ("cache-key-host-row2", "rows_dev", 1, "rows_host", by_key(22), {}),
    ("size-minus-one", "rows_dev", 0, "rows_dev", by_index("rows_dev", 1), dict(size=-1)),
    ("layer1-to-layer1", "rows_dev", 1, "rows_dev", by_index("rows_dev", 1),
     dict(src_layer_range=range(1, 2), dst_layer_range=range(1, 2))),
    ("layer0-to-layer1", "rows_dev", 2, "rows_dev", by_index("rows_dev", 0),
     dict(src_layer_range=range(0, 1), dst_layer_range=range(1, 2))),
    ("n1-tensors-1-2-to-0-1", "rows_host", 1, "rows_dev", by_index("rows_dev", 2),
     dict(src_layer_range=range(1, 3), dst_layer_range=range(0, 2), tensor_num_per_layer=1)),
    ("n4-one-layer", "rows_dev", 1, "rows_host", by_index("rows_host", 2),
     dict(src_layer_range=range(0, 1), dst_layer_range=range(0, 1), tensor_num_per_layer=4)),
    ("n3-without-ranges", "rows_dev", 0, "rows_dev", by_index("rows_dev", 0), dict(tensor_num_per_layer=3)),
    ("src-range-only", "rows_dev", 2, "rows_2t", by_index("rows_2t", 1), dict(src_layer_range=range(0, 1))),
    ("dst-range-only", "rows_2t", 0, "rows_dev", by_index("rows_dev", 1), dict(dst_layer_range=range(1, 2))),
    ("narrow-row-into-wide", "rows_dev", 1, "rows_wide", by_index("rows_wide", 1), {}),
]


@pytest.mark.parametrize("src,src_row,dst,key,kwargs", [c[1:] for c in PUSH_CACHE_OK],
                         ids=[c[0] for c in PUSH_CACHE_OK])
def test_push_cache(py_pair, src, src_row, dst, key, kwargs):
    client, server = py_pair.client, py_pair.server
    src_data = client.call(ops.fill, src, next(SEEDS))
    dst_data = server.call(ops.fill, dst, next(SEEDS))
    dst_key = key(server.cluster_id, server.ids)
    dst_row = dst_key.batch_index if isinstance(dst_key, CacheKeyByIdAndIndex) else dst_key.req_id - KEY_BASE[dst]
    client.call(ops.py, "push_cache", dst_key, src, src_row, **kwargs)
    st, dt = tensors_for(kwargs, len(src_data), len(dst_data))
    expected = copy_rows(src_data, dst_data, st, dt, src_row, dst_row, row_bytes(src_data))
    assert_same(server.call(ops.snapshot, dst), expected, "destination")
    assert_same(client.call(ops.snapshot, src), src_data, "source")


PUSH_BLOCKS_OK = [
    # id, src (client), src blocks, dst (server), dst blocks, kwargs
    ("dev-to-dev", "blocks_dev", [0, 1, 2, 3], "blocks_dev", [3, 2, 1, 0], {}),
    ("host-to-dev", "blocks_host", [5], "blocks_dev", [0], {}),
    ("dev-to-host", "blocks_dev", [1, 4], "blocks_host", [4, 1], {}),
    ("host-to-host", "blocks_host", [0, 1, 2], "blocks_host", [3, 4, 5], {}),
    ("layer1-to-layer0", "blocks_dev", [2], "blocks_dev", [5],
     dict(src_layer_range=range(1, 2), dst_layer_range=range(0, 1))),
    ("n1-tensor3-to-tensor3", "blocks_dev", [0, 5], "blocks_host", [2, 3],
     dict(src_layer_range=range(3, 4), dst_layer_range=range(3, 4), tensor_num_per_layer=1)),
    ("n4-one-layer", "blocks_host", [1], "blocks_dev", [4],
     dict(src_layer_range=range(0, 1), dst_layer_range=range(0, 1), tensor_num_per_layer=4)),
    ("src-range-only", "blocks_dev", [3], "blocks_2t", [0], dict(src_layer_range=range(0, 1))),
    ("dst-range-only", "blocks_2t", [2, 3], "blocks_dev", [0, 1], dict(dst_layer_range=range(1, 2))),
    ("small-blocks-into-big", "blocks_dev", [1, 2], "blocks_big", [2, 0], {}),
]


@pytest.mark.parametrize("src,src_blocks,dst,dst_blocks,kwargs", [c[1:] for c in PUSH_BLOCKS_OK],
                         ids=[c[0] for c in PUSH_BLOCKS_OK])
def test_push_blocks(py_pair, src, src_blocks, dst, dst_blocks, kwargs):
    client, server = py_pair.client, py_pair.server
    src_data = client.call(ops.fill, src, next(SEEDS))
    dst_data = server.call(ops.fill, dst, next(SEEDS))
    client.call(ops.py, "push_blocks", BlocksCacheKey(server.cluster_id, CACHES[dst][4]), src,
                src_blocks, dst_blocks, **kwargs)
    st, dt = tensors_for(kwargs, len(src_data), len(dst_data))
    expected = copy_blocks(src_data, dst_data, st, dt, src_blocks, dst_blocks)
    assert_same(server.call(ops.snapshot, dst), expected, "destination")
    assert_same(client.call(ops.snapshot, src), src_data, "source")


def test_push_by_the_listening_side(py_pair):
    """The server pushes into its client (reverse connection), rows and blocks."""
    client, server = py_pair.client, py_pair.server
    src_rows = server.call(ops.fill, "rows_host", next(SEEDS))
    dst_rows = client.call(ops.fill, "rows_dev", next(SEEDS))
    server.call(ops.py, "push_cache", CacheKeyByIdAndIndex(client.cluster_id, client.ids["rows_dev"], 2),
                "rows_host", 0)
    assert_same(client.call(ops.snapshot, "rows_dev"),
                copy_rows(src_rows, dst_rows, range(4), range(4), 0, 2, 64), "rows destination")
    src_blocks = server.call(ops.fill, "blocks_dev", next(SEEDS))
    dst_blocks = client.call(ops.fill, "blocks_host", next(SEEDS))
    server.call(ops.py, "push_blocks", BlocksCacheKey(client.cluster_id, 1), "blocks_dev", [0, 5], [5, 0])
    assert_same(client.call(ops.snapshot, "blocks_host"),
                copy_blocks(src_blocks, dst_blocks, range(4), range(4), [0, 5], [5, 0]), "blocks destination")


# -- remote-cache-accessible off: pulls by CacheKey -------------------------------------------------------

@pytest.mark.parametrize("src,req_id,dst,dst_row", [
    ("rows_dev", 12, "rows_dev", 0), ("rows_host", 20, "rows_dev", 1), ("rows_dev", 11, "rows_host", 2)])
def test_pull_cache_by_cache_key(off_pair, src, req_id, dst, dst_row):
    """A CacheKey names the row bound to it on the owner; registered caches keep their keys, so
    the same key can be pulled again."""
    client, server = off_pair.client, off_pair.server
    for _ in range(2):
        src_data = server.call(ops.fill, src, next(SEEDS))
        dst_data = client.call(ops.fill, dst, next(SEEDS))
        client.call(ops.py, "pull_cache", CacheKey(server.cluster_id, req_id=req_id), dst, dst_row)
        expected = copy_rows(src_data, dst_data, range(4), range(4), req_id - KEY_BASE[src], dst_row, 64)
        assert_same(client.call(ops.snapshot, dst), expected, "destination")


def test_pull_blocks_by_cache_key(off_pair):
    client, server = off_pair.client, off_pair.server
    src_data = server.call(ops.fill, "rows_dev", next(SEEDS))
    dst_data = client.call(ops.fill, "blocks_dev", next(SEEDS))
    client.call(ops.py, "pull_blocks", CacheKey(server.cluster_id, req_id=11), "blocks_dev", [], [5, 2],
                src_layer_range=range(0, 1), dst_layer_range=range(1, 2))
    expected = copy_row_to_blocks(src_data, dst_data, [0, 1], [2, 3], 1, [5, 2])
    assert_same(client.call(ops.snapshot, "blocks_dev"), expected, "destination")


def test_pulls_by_index_work_without_remote_access(off_pair):
    client, server = off_pair.client, off_pair.server
    src_data = server.call(ops.fill, "blocks_host", next(SEEDS))
    dst_data = client.call(ops.fill, "blocks_dev", next(SEEDS))
    client.call(ops.py, "pull_blocks", BlocksCacheKey(server.cluster_id, 1), "blocks_dev", [0, 1], [1, 0])
    assert_same(client.call(ops.snapshot, "blocks_dev"),
                copy_blocks(src_data, dst_data, range(4), range(4), [0, 1], [1, 0]), "destination")
    src_data = server.call(ops.fill, "rows_wide", next(SEEDS))
    dst_data = client.call(ops.fill, "rows_dev", next(SEEDS))
    client.call(ops.py, "pull_cache", CacheKeyByIdAndIndex(server.cluster_id, server.ids["rows_wide"], 1),
                "rows_dev", 0, 32, src_cache_offset=96)
    assert_same(client.call(ops.snapshot, "rows_dev"),
                copy_rows(src_data, dst_data, range(4), range(4), 1, 0, 32, 96), "destination")


OFF_REFUSED = [
    ("pull-cache-unknown-key", "pull_cache", CacheKey, dict(req_id=99), "rows_dev", (0,), NOT_EXIST),
    ("pull-cache-placeholder-key", "pull_cache", CacheKey, dict(req_id=2**64 - 1), "rows_dev", (0,), PI),
    ("pull-cache-req-and-prefix", "pull_cache", CacheKey, dict(req_id=10, model_id=0, prefix_id=5), "rows_dev",
     (0,), PI),
    ("pull-blocks-unknown-key", "pull_blocks", CacheKey, dict(req_id=98), "blocks_dev", ([], [0]), NOT_EXIST),
    ("pull-blocks-key-with-src-blocks", "pull_blocks", CacheKey, dict(req_id=10), "blocks_dev", ([0], [0]), PI),
    ("push-cache-needs-remote-access", "push_cache", CacheKeyByIdAndIndex, dict(cache_id=None, batch_index=0),
     "rows_dev", (0,), PI),
    ("push-blocks-needs-remote-access", "push_blocks", BlocksCacheKey, dict(model_id=0), "blocks_dev",
     ([0], [0]), PI),
]


@pytest.mark.parametrize("method,key_type,fields,cache,args,expected", [c[1:] for c in OFF_REFUSED],
                         ids=[c[0] for c in OFF_REFUSED])
def test_refused_without_remote_access(off_pair, method, key_type, fields, cache, args, expected):
    client, server = off_pair.client, off_pair.server
    if "cache_id" in fields:
        fields = dict(fields, cache_id=server.ids[cache])
    key = key_type(server.cluster_id, **fields)
    pushes = method.startswith("push")
    holder = server if pushes else client
    client.call(ops.fill, cache, next(SEEDS))
    before = holder.call(ops.fill, cache, next(SEEDS))
    expect_failure(expected, client.call, ops.py, method, key, cache, *args)
    assert_same(holder.call(ops.snapshot, cache), before, "destination after a refused call")


# ==================================================================================================
# Python style: invalid calls
# ==================================================================================================

@dataclass
class PyCall:
    """One call made by the client: ``method(key(cluster_id, server ids), cache, *args, **kwargs)``;
    ``src``/``dst`` name the source and destination caches (the destination is the client's
    for pulls, the server's for pushes)."""

    method: str
    key: Callable
    cache: Any
    args: tuple
    src: str
    dst: str
    kwargs: dict = field(default_factory=dict)

    @property
    def pushes(self) -> bool:
        return self.method.startswith("push")


BASE = {
    "pull_cache": PyCall("pull_cache", by_index("rows_dev", 1), "rows_dev", (0,), "rows_dev", "rows_dev"),
    "pull_blocks": PyCall("pull_blocks", by_model(0), "blocks_dev", ([0, 1], [2, 3]), "blocks_dev", "blocks_dev"),
    "pull_blocks_row": PyCall("pull_blocks", by_index("rows_dev", 1), "blocks_dev", ([], [2, 3]), "rows_dev",
                              "blocks_dev"),
    "push_cache": PyCall("push_cache", by_index("rows_dev", 1), "rows_dev", (0,), "rows_dev", "rows_dev"),
    "push_blocks": PyCall("push_blocks", by_model(0), "blocks_dev", ([0, 1], [2, 3]), "blocks_dev", "blocks_dev"),
}


def check_refused(pair: Pair, call: PyCall, expected, target: str = "peer") -> None:
    """Make ``call`` (to the server, this cluster itself or an unlinked id) and check it fails
    with ``expected`` without touching the destination."""
    client, server = pair.client, pair.server
    holder, source = (server, client) if call.pushes else (client, server)
    source.call(ops.fill, call.src, next(SEEDS))
    before = holder.call(ops.fill, call.dst, next(SEEDS))
    cluster_id = {"peer": server.cluster_id, "self": client.cluster_id, "unlinked": UNLINKED}[target]
    key = call.key(cluster_id, server.ids)
    expect_failure(expected, client.call, ops.py, call.method, key, call.cache, *call.args, **call.kwargs)
    assert_same(holder.call(ops.snapshot, call.dst), before, "destination after a refused call")


def _with(base: str, **changes) -> PyCall:
    call = BASE[base]
    return PyCall(**{**call.__dict__, "kwargs": dict(call.kwargs), **changes})


LAYER_ERRORS = [
    ("src-range-list", dict(src_layer_range=[0, 1]), TYPE),
    ("dst-range-tuple", dict(dst_layer_range=(0, 1)), TYPE),
    ("step-2", dict(src_layer_range=range(0, 2, 2), dst_layer_range=range(0, 2, 2)), PI),
    ("empty-range", dict(src_layer_range=range(1, 1), dst_layer_range=range(1, 1)), PI),
    ("negative-start", dict(src_layer_range=range(-1, 1), dst_layer_range=range(-1, 1)), PI),
    ("beyond-the-layers", dict(src_layer_range=range(1, 3), dst_layer_range=range(1, 3)), PI),
    ("unequal-spans", dict(src_layer_range=range(0, 1), dst_layer_range=range(0, 2)), PI),
    ("src-only-selects-too-few", dict(src_layer_range=range(0, 1)), PI),
    ("dst-only-selects-too-few", dict(dst_layer_range=range(1, 2)), PI),
    ("n3-does-not-divide", dict(src_layer_range=range(0, 1), dst_layer_range=range(0, 1),
                                tensor_num_per_layer=3), PI),
    ("n5-above-tensor-count", dict(src_layer_range=range(0, 1), dst_layer_range=range(0, 1),
                                   tensor_num_per_layer=5), PI),
    ("n0", dict(tensor_num_per_layer=0), PI),
    ("n-negative", dict(tensor_num_per_layer=-2), VALUE),  # not a uint32: CANN's check_uint32
    ("n-str", dict(tensor_num_per_layer="2"), TYPE),
    ("n-bool", dict(tensor_num_per_layer=True), TYPE),
]


@pytest.mark.parametrize("changes,expected", [c[1:] for c in LAYER_ERRORS], ids=[c[0] for c in LAYER_ERRORS])
@pytest.mark.parametrize("base", list(BASE))
def test_layer_arguments_refused(py_pair, base, changes, expected):
    call = BASE[base]
    check_refused(py_pair, _with(base, kwargs={**call.kwargs, **changes}), expected)


@pytest.mark.parametrize("base", list(BASE))
def test_tensor_num_per_layer_above_the_tensor_count(py_pair, base):
    """Spec §16.2: tensor_num_per_layer lies in [1, total tensors] whether or not layer ranges
    are given (only the divisibility rule depends on the ranges)."""
    call = BASE[base]
    check_refused(py_pair, _with(base, kwargs={**call.kwargs, "tensor_num_per_layer": 5}), PI)


@pytest.mark.parametrize("target,expected", [("self", NOT_LINKED), ("unlinked", NOT_LINKED)],
                         ids=["own-id", "not-linked"])
@pytest.mark.parametrize("base", list(BASE))
def test_wrong_peer_refused(py_pair, base, target, expected):
    check_refused(py_pair, BASE[base], expected, target)


@pytest.mark.parametrize("base", ["pull_cache", "pull_blocks_row", "push_cache"])
def test_unknown_remote_cache_id(py_pair, base):
    check_refused(py_pair, _with(base, key=lambda cid, ids: CacheKeyByIdAndIndex(cid, 999, 0)), NOT_EXIST)


@pytest.mark.parametrize("base", ["pull_blocks", "push_blocks"])
def test_unknown_remote_model_id(py_pair, base):
    check_refused(py_pair, _with(base, key=by_model(9)), NOT_EXIST)


PULL_CACHE_ERRORS = [
    ("blocks-key", dict(key=by_model(0)), TYPE),
    ("cache-key-in-remote-access-mode", dict(key=by_key(11)), TYPE),
    ("key-none", dict(key=raw(None)), TYPE),
    ("cache-none", dict(cache=None), ("AttributeError", None)),
    ("cache-not-a-cache", dict(cache=5), TYPE),
    ("batch-index-str", dict(args=("1",)), TYPE),
    ("batch-index-negative", dict(args=(-1,)), VALUE),
    ("batch-index-above-uint32", dict(args=(2**32,)), VALUE),
    ("batch-index-out-of-rows", dict(args=(3,)), PI),
    ("remote-row-out-of-range", dict(key=by_index("rows_dev", 3)), NOT_EXIST),
    ("size-zero", dict(args=(0, 0)), PI),
    ("size-minus-two", dict(args=(0, -2)), PI),
    ("size-above-row", dict(args=(0, 65)), PI),
    ("size-above-int64", dict(args=(0, 2**63)), VALUE),
    ("size-float", dict(args=(0, 16.0)), TYPE),
    ("destination-is-blocks", dict(cache="blocks_dev", dst="blocks_dev"), PI),
    ("unknown-kwarg", dict(kwargs=dict(layer_range=range(0, 1))), TYPE),
    ("src-offset-minus-two", dict(kwargs=dict(src_cache_offset=-2)), PI),
    ("src-offset-str", dict(kwargs=dict(src_cache_offset="8")), TYPE),
    ("src-offset-outside-row", dict(args=(0, 8), kwargs=dict(src_cache_offset=64)), PI),
    ("src-offset-plus-size-beyond-row", dict(args=(0, 32), kwargs=dict(src_cache_offset=48)), PI),
    ("dst-offset-outside-row", dict(kwargs=dict(dst_cache_offset=64)), PI),
    ("dst-offset-plus-size-beyond-row", dict(args=(0, 48), kwargs=dict(dst_cache_offset=32)), PI),
    ("narrow-row-cannot-fill-wide", dict(cache="rows_wide", dst="rows_wide"), PI),
    ("two-tensors-into-four", dict(key=by_index("rows_2t", 0), src="rows_2t"), PI),
]


@pytest.mark.parametrize("changes,expected", [c[1:] for c in PULL_CACHE_ERRORS],
                         ids=[c[0] for c in PULL_CACHE_ERRORS])
def test_pull_cache_refused(py_pair, changes, expected):
    check_refused(py_pair, _with("pull_cache", **changes), expected)


PULL_BLOCKS_ERRORS = [
    ("dst-blocks-empty", "pull_blocks", dict(args=([], [])), PI),
    ("src-blocks-empty", "pull_blocks", dict(args=([], [1])), PI),
    ("lengths-differ", "pull_blocks", dict(args=([0, 1], [1])), PI),
    ("dst-block-out-of-range", "pull_blocks", dict(args=([0, 1], [2, 6])), PI),
    ("src-block-out-of-range", "pull_blocks", dict(args=([6, 1], [2, 3])), PI),
    ("block-negative", "pull_blocks", dict(args=([-1], [0])), VALUE),
    ("block-above-uint64", "pull_blocks", dict(args=([0], [2**64])), VALUE),
    ("block-str", "pull_blocks", dict(args=(["0"], [1])), TYPE),
    ("block-bool", "pull_blocks", dict(args=([True], [1])), TYPE),
    ("blocks-as-set", "pull_blocks", dict(args=({0}, [1])), TYPE),
    ("block-sizes-differ", "pull_blocks", dict(key=by_model(2), src="blocks_big"), PI),
    ("destination-not-blocks", "pull_blocks", dict(cache="rows_dev", dst="rows_dev"), PI),
    ("cache-key-in-remote-access-mode", "pull_blocks", dict(key=by_key(11)), TYPE),
    ("key-wrong-type", "pull_blocks", dict(key=raw(0)), TYPE),
    ("offset-kwarg-not-accepted", "pull_blocks", dict(kwargs=dict(src_cache_offset=0)), TYPE),
    ("row-with-src-blocks", "pull_blocks_row", dict(args=([1], [2])), PI),
    ("row-dst-blocks-empty", "pull_blocks_row", dict(args=([], [])), PI),
    ("row-more-blocks-than-chunks", "pull_blocks_row", dict(args=([], [0, 1, 2])), PI),
    ("row-dst-block-out-of-range", "pull_blocks_row", dict(args=([], [0, 6])), PI),
    ("row-remote-row-out-of-range", "pull_blocks_row", dict(key=by_index("rows_dev", 3)), NOT_EXIST),
    ("row-destination-not-blocks", "pull_blocks_row", dict(cache="rows_host", dst="rows_host"), PI),
]


@pytest.mark.parametrize("base,changes,expected", [c[1:] for c in PULL_BLOCKS_ERRORS],
                         ids=[c[0] for c in PULL_BLOCKS_ERRORS])
def test_pull_blocks_refused(py_pair, base, changes, expected):
    check_refused(py_pair, _with(base, **changes), expected)


PUSH_CACHE_ERRORS = [
    ("size-not-minus-one", dict(kwargs=dict(size=16)), PI),
    ("size-zero", dict(kwargs=dict(size=0)), PI),
    ("size-whole-row-given", dict(kwargs=dict(size=64)), PI),
    ("size-above-int64", dict(kwargs=dict(size=2**63)), VALUE),
    ("size-str", dict(kwargs=dict(size="-1")), TYPE),
    ("src-row-out-of-range", dict(args=(3,)), PI),
    ("src-row-negative", dict(args=(-1,)), VALUE),
    ("src-row-str", dict(args=("0",)), TYPE),
    ("dst-row-out-of-range", dict(key=by_index("rows_dev", 3)), NOT_EXIST),
    ("unknown-cache-key", dict(key=by_key(99)), NOT_EXIST),
    ("source-is-blocks", dict(cache="blocks_dev", src="blocks_dev"), PI),
    ("blocks-key", dict(key=by_model(0)), TYPE),
    ("key-none", dict(key=raw(None)), TYPE),
    ("wide-row-into-narrow", dict(cache="rows_wide", src="rows_wide"), PI),
    ("four-tensors-into-two", dict(key=by_index("rows_2t", 0), dst="rows_2t"), PI),
]


@pytest.mark.parametrize("changes,expected", [c[1:] for c in PUSH_CACHE_ERRORS],
                         ids=[c[0] for c in PUSH_CACHE_ERRORS])
def test_push_cache_refused(py_pair, changes, expected):
    check_refused(py_pair, _with("push_cache", **changes), expected)


PUSH_BLOCKS_ERRORS = [
    ("dst-blocks-empty", dict(args=([], [])), PI),
    ("src-blocks-empty", dict(args=([], [1])), PI),
    ("lengths-differ", dict(args=([0], [1, 2])), PI),
    ("src-block-out-of-range", dict(args=([0, 6], [1, 2])), PI),
    ("dst-block-out-of-range", dict(args=([0, 1], [1, 6])), PI),
    ("block-negative", dict(args=([0], [-1])), VALUE),
    ("block-str", dict(args=([0], ["1"])), TYPE),
    ("source-not-blocks", dict(cache="rows_dev", src="rows_dev"), PI),
    ("big-blocks-into-small", dict(cache="blocks_big", src="blocks_big", args=([0], [1])), PI),
    ("index-key", dict(key=by_index("blocks_dev", 0)), TYPE),
    ("cache-key", dict(key=by_key(10)), TYPE),
    ("four-tensors-into-two", dict(key=by_model(3), dst="blocks_2t"), PI),
]


@pytest.mark.parametrize("changes,expected", [c[1:] for c in PUSH_BLOCKS_ERRORS],
                         ids=[c[0] for c in PUSH_BLOCKS_ERRORS])
def test_push_blocks_refused(py_pair, changes, expected):
    check_refused(py_pair, _with("push_blocks", **changes), expected)


# ==================================================================================================
# C++ style
# ==================================================================================================

PULL_KV_CACHE_OK = [
    # id, caller, src (peer), src row, dst (caller), dst row, size, ext
    ("dev-to-dev", "decoder", "rows_dev", 2, "rows_dev", 1, -1, None),
    ("host-to-dev", "decoder", "rows_host", 0, "rows_dev", 0, -1, None),
    ("dev-to-host", "decoder", "rows_dev", 1, "rows_host", 2, -1, None),
    ("host-to-host", "decoder", "rows_host", 1, "rows_host", 1, -1, None),
    ("prompt-pulls-too", "prompt", "rows_dev", 0, "rows_host", 0, -1, None),
    ("default-ext-explicit", "decoder", "rows_dev", 1, "rows_dev", 0, -1,
     dict(src_layer_range=(-1, -1), dst_layer_range=(-1, -1), tensor_num_per_layer=2)),
    ("layer1-to-layer0", "decoder", "rows_dev", 0, "rows_dev", 2, -1,
     dict(src_layer_range=(1, 1), dst_layer_range=(0, 0))),
    ("n1-tensor3-to-tensor1", "decoder", "rows_host", 2, "rows_dev", 1, -1,
     dict(src_layer_range=(3, 3), dst_layer_range=(1, 1), tensor_num_per_layer=1)),
    ("n1-two-layers-shifted", "decoder", "rows_dev", 1, "rows_dev", 1, -1,
     dict(src_layer_range=(0, 1), dst_layer_range=(2, 3), tensor_num_per_layer=1)),
    ("n4-one-layer", "decoder", "rows_dev", 2, "rows_host", 0, -1,
     dict(src_layer_range=(0, 0), dst_layer_range=(0, 0), tensor_num_per_layer=4)),
    ("size-16", "decoder", "rows_dev", 1, "rows_dev", 2, 16, None),
    ("size-whole-row", "decoder", "rows_host", 0, "rows_dev", 0, 64, None),
    ("wide-row-into-narrow", "decoder", "wide", 1, "rows_dev", 1, -1, None),
    ("allocated-source", "decoder", "alloc", 5, "blocks_dev", 0, -1, None),
    ("into-allocated", "prompt", "blocks_host", 3, "alloc", 4, -1, dict(src_layer_range=(0, 0),
                                                                        dst_layer_range=(1, 1))),
]


@pytest.mark.parametrize("caller,src,src_row,dst,dst_row,size,ext", [c[1:] for c in PULL_KV_CACHE_OK],
                         ids=[c[0] for c in PULL_KV_CACHE_OK])
def test_pull_kv_cache(cpp_pair, caller, src, src_row, dst, dst_row, size, ext):
    me, peer = cpp_pair.sides(caller)
    src_data = peer.call(ops.fill, src, next(SEEDS))
    dst_data = me.call(ops.fill, dst, next(SEEDS))
    status = me.call(ops.cpp_op, "PullKvCache", (peer.cluster_id, peer.ids[src], src_row), dst, dst_row, size,
                     ext=ext)
    assert status == S.LLM_SUCCESS
    st, dt = cpp_tensors(ext, len(src_data), len(dst_data))
    nbytes = size if size > 0 else row_bytes(dst_data)
    assert_same(me.call(ops.snapshot, dst), copy_rows(src_data, dst_data, st, dt, src_row, dst_row, nbytes),
                "destination")
    assert_same(peer.call(ops.snapshot, src), src_data, "source")


PULL_KV_BLOCKS_OK = [
    # id, caller, src (peer), src blocks, dst (caller), dst blocks, ext
    ("dev-to-dev", "decoder", "blocks_dev", [0, 1, 2, 5], "blocks_dev", [5, 4, 0, 1], None),
    ("host-to-dev", "decoder", "blocks_host", [4], "blocks_dev", [2], None),
    ("dev-to-host", "decoder", "blocks_dev", [3, 2], "blocks_host", [0, 1], None),
    ("host-to-host", "prompt", "blocks_host", [5, 0], "blocks_host", [0, 5], None),
    ("consecutive-runs", "decoder", "blocks_dev", [0, 1, 2], "blocks_dev", [3, 4, 5], None),
    ("layer1-to-layer0", "decoder", "blocks_dev", [1], "blocks_dev", [1],
     dict(src_layer_range=(1, 1), dst_layer_range=(0, 0))),
    ("n1-tensors-0-1-to-2-3", "decoder", "blocks_host", [0, 2], "blocks_dev", [4, 3],
     dict(src_layer_range=(0, 1), dst_layer_range=(2, 3), tensor_num_per_layer=1)),
    ("n4-one-layer", "prompt", "blocks_dev", [5], "blocks_dev", [0],
     dict(src_layer_range=(0, 0), dst_layer_range=(0, 0), tensor_num_per_layer=4)),
    ("allocated-source", "decoder", "alloc", [0, 5], "blocks_dev", [1, 2], None),
    ("rows-cache-as-blocks", "decoder", "rows_dev", [2, 0], "rows_host", [0, 1], None),
]


@pytest.mark.parametrize("caller,src,src_blocks,dst,dst_blocks,ext", [c[1:] for c in PULL_KV_BLOCKS_OK],
                         ids=[c[0] for c in PULL_KV_BLOCKS_OK])
def test_pull_kv_blocks(cpp_pair, caller, src, src_blocks, dst, dst_blocks, ext):
    me, peer = cpp_pair.sides(caller)
    src_data = peer.call(ops.fill, src, next(SEEDS))
    dst_data = me.call(ops.fill, dst, next(SEEDS))
    status = me.call(ops.cpp_op, "PullKvBlocks", (peer.cluster_id, peer.ids[src], 0), dst, src_blocks,
                     dst_blocks, ext=ext)
    assert status == S.LLM_SUCCESS
    st, dt = cpp_tensors(ext, len(src_data), len(dst_data))
    assert_same(me.call(ops.snapshot, dst), copy_blocks(src_data, dst_data, st, dt, src_blocks, dst_blocks),
                "destination")
    assert_same(peer.call(ops.snapshot, src), src_data, "source")


PUSH_KV_CACHE_OK = [
    # id, src (prompt), src row, dst (decoder), dst row, ext
    ("dev-to-dev", "rows_dev", 0, "rows_dev", 2, None),
    ("host-to-dev", "rows_host", 1, "rows_dev", 1, None),
    ("dev-to-host", "rows_dev", 2, "rows_host", 0, None),
    ("host-to-host", "rows_host", 2, "rows_host", 2, None),
    ("layer0-to-layer1", "rows_dev", 1, "rows_dev", 0, dict(src_layer_range=(0, 0), dst_layer_range=(1, 1))),
    ("n1-tensors-2-3-to-0-1", "rows_dev", 0, "rows_host", 1,
     dict(src_layer_range=(2, 3), dst_layer_range=(0, 1), tensor_num_per_layer=1)),
    ("n4-one-layer", "rows_host", 0, "rows_dev", 0,
     dict(src_layer_range=(0, 0), dst_layer_range=(0, 0), tensor_num_per_layer=4)),
    ("allocated-source", "alloc", 3, "blocks_host", 4, None),
    ("narrow-row-into-wide", "rows_dev", 1, "wide", 0, None),
]


@pytest.mark.parametrize("src,src_row,dst,dst_row,ext", [c[1:] for c in PUSH_KV_CACHE_OK],
                         ids=[c[0] for c in PUSH_KV_CACHE_OK])
def test_push_kv_cache(cpp_pair, src, src_row, dst, dst_row, ext):
    me, peer = cpp_pair.prompt, cpp_pair.decoder
    src_data = me.call(ops.fill, src, next(SEEDS))
    dst_data = peer.call(ops.fill, dst, next(SEEDS))
    status = me.call(ops.cpp_op, "PushKvCache", (peer.cluster_id, peer.ids[dst], dst_row), src, src_row, -1,
                     ext=ext)
    assert status == S.LLM_SUCCESS
    st, dt = cpp_tensors(ext, len(src_data), len(dst_data))
    expected = copy_rows(src_data, dst_data, st, dt, src_row, dst_row, row_bytes(src_data))
    assert_same(peer.call(ops.snapshot, dst), expected, "destination")
    assert_same(me.call(ops.snapshot, src), src_data, "source")


PUSH_KV_BLOCKS_OK = [
    # id, src (prompt), src blocks, dst (decoder), dst blocks, ext
    ("dev-to-dev", "blocks_dev", [0, 1, 2, 3], "blocks_dev", [3, 2, 1, 0], None),
    ("host-to-dev", "blocks_host", [5], "blocks_dev", [5], None),
    ("dev-to-host", "blocks_dev", [4, 5], "blocks_host", [0, 1], None),
    ("host-to-host", "blocks_host", [1], "blocks_host", [2], None),
    ("layer1-to-layer0", "blocks_dev", [2, 3], "blocks_host", [3, 2],
     dict(src_layer_range=(1, 1), dst_layer_range=(0, 0))),
    ("n1-tensor0-to-tensor3", "blocks_dev", [0], "blocks_dev", [0],
     dict(src_layer_range=(0, 0), dst_layer_range=(3, 3), tensor_num_per_layer=1)),
    ("allocated-source", "alloc", [5, 4], "blocks_dev", [0, 1], None),
    ("small-blocks-into-big", "blocks_dev", [1], "rows_dev", [2], None),
]


@pytest.mark.parametrize("src,src_blocks,dst,dst_blocks,ext", [c[1:] for c in PUSH_KV_BLOCKS_OK],
                         ids=[c[0] for c in PUSH_KV_BLOCKS_OK])
def test_push_kv_blocks(cpp_pair, src, src_blocks, dst, dst_blocks, ext):
    me, peer = cpp_pair.prompt, cpp_pair.decoder
    src_data = me.call(ops.fill, src, next(SEEDS))
    dst_data = peer.call(ops.fill, dst, next(SEEDS))
    status = me.call(ops.cpp_op, "PushKvBlocks", (peer.cluster_id, peer.ids[dst], 0), src, src_blocks,
                     dst_blocks, ext=ext)
    assert status == S.LLM_SUCCESS
    st, dt = cpp_tensors(ext, len(src_data), len(dst_data))
    assert_same(peer.call(ops.snapshot, dst), copy_blocks(src_data, dst_data, st, dt, src_blocks, dst_blocks),
                "destination")
    assert_same(me.call(ops.snapshot, src), src_data, "source")


@dataclass
class CppCall:
    """A C++ call by ``caller``: ``method`` with ``index`` = (peer cluster, peer cache, row) built
    from ``peer_cache``/``row`` (or given raw), the caller's ``cache`` and ``args``."""

    method: str
    caller: str
    peer_cache: str
    row: int
    cache: Any
    args: tuple
    src: str
    dst: str
    ext: Any = None
    index: Any = None

    @property
    def pushes(self) -> bool:
        return self.method.startswith("Push")


CPP_BASE = {
    "PullKvCache": CppCall("PullKvCache", "decoder", "rows_dev", 1, "rows_dev", (0, -1), "rows_dev", "rows_dev"),
    "PullKvBlocks": CppCall("PullKvBlocks", "decoder", "blocks_dev", 0, "blocks_dev", ([0, 1], [2, 3]),
                            "blocks_dev", "blocks_dev"),
    "PushKvCache": CppCall("PushKvCache", "prompt", "rows_dev", 1, "rows_dev", (0, -1), "rows_dev", "rows_dev"),
    "PushKvBlocks": CppCall("PushKvBlocks", "prompt", "blocks_dev", 0, "blocks_dev", ([0, 1], [2, 3]),
                            "blocks_dev", "blocks_dev"),
}


def _cpp_with(base: str, **changes) -> CppCall:
    return CppCall(**{**CPP_BASE[base].__dict__, **changes})


def check_cpp_refused(pair: CppPair, call: CppCall, expected: S, target: str = "peer") -> None:
    me, peer = pair.sides(call.caller)
    holder, source = (peer, me) if call.pushes else (me, peer)
    source.call(ops.fill, call.src, next(SEEDS))
    before = holder.call(ops.fill, call.dst, next(SEEDS))
    cluster_id = {"peer": peer.cluster_id, "self": me.cluster_id, "unlinked": UNLINKED}[target]
    index = call.index if call.index is not None else (cluster_id, peer.ids.get(call.peer_cache, 999), call.row)
    status = me.call(ops.cpp_op, call.method, index, call.cache, *call.args, ext=call.ext)
    assert status == int(expected), f"{call.method} returned {ld.cpp.Status(status)}, expected {expected.name}"
    assert_same(holder.call(ops.snapshot, call.dst), before, "destination after a refused call")


CPP_EXT_ERRORS = [
    ("range-beyond-layers", dict(src_layer_range=(0, 2), dst_layer_range=(0, 2))),
    ("first-after-second", dict(src_layer_range=(1, 0), dst_layer_range=(1, 0))),
    ("half-default", dict(src_layer_range=(-1, 0), dst_layer_range=(-1, 0))),
    ("below-minus-one", dict(src_layer_range=(-2, -2), dst_layer_range=(-2, -2))),
    ("unequal-spans", dict(src_layer_range=(0, 0), dst_layer_range=(0, 1))),
    ("src-only-selects-too-few", dict(src_layer_range=(1, 1))),
    ("n3-does-not-divide", dict(src_layer_range=(0, 0), dst_layer_range=(0, 0), tensor_num_per_layer=3)),
    ("n5-above-tensor-count", dict(src_layer_range=(0, 0), dst_layer_range=(0, 0), tensor_num_per_layer=5)),
    ("n0", dict(tensor_num_per_layer=0)),
    ("n256-beyond-uint8", dict(tensor_num_per_layer=256)),
    ("range-not-a-pair", dict(src_layer_range=(0,), dst_layer_range=(0,))),
    ("range-of-floats", dict(src_layer_range=(0.0, 0.0), dst_layer_range=(0.0, 0.0))),
    ("ext-not-a-struct", "not an ext"),
]


@pytest.mark.parametrize("ext", [c[1] for c in CPP_EXT_ERRORS], ids=[c[0] for c in CPP_EXT_ERRORS])
@pytest.mark.parametrize("base", list(CPP_BASE))
def test_cpp_layer_arguments_refused(cpp_pair, base, ext):
    check_cpp_refused(cpp_pair, _cpp_with(base, ext=ext), S.LLM_PARAM_INVALID)


@pytest.mark.parametrize("base", list(CPP_BASE))
def test_cpp_tensor_num_per_layer_above_the_tensor_count(cpp_pair, base):
    """Spec §16.1: tensor_num_per_layer lies in [1, total tensors of the cache], with or without
    layer ranges."""
    check_cpp_refused(cpp_pair, _cpp_with(base, ext=dict(tensor_num_per_layer=5)), S.LLM_PARAM_INVALID)


@pytest.mark.parametrize("target,expected", [("self", S.LLM_NOT_YET_LINK), ("unlinked", S.LLM_NOT_YET_LINK)],
                         ids=["own-id", "not-linked"])
@pytest.mark.parametrize("base", list(CPP_BASE))
def test_cpp_wrong_peer_refused(cpp_pair, base, target, expected):
    check_cpp_refused(cpp_pair, CPP_BASE[base], expected, target)


@pytest.mark.parametrize("base", list(CPP_BASE))
def test_cpp_unknown_caches(cpp_pair, base):
    """An unknown remote cache id, and a local Cache whose id is not registered here."""
    check_cpp_refused(cpp_pair, _cpp_with(base, peer_cache="nonexistent"), S.LLM_KV_CACHE_NOT_EXIST)
    check_cpp_refused(cpp_pair, _cpp_with(base, cache=ld.cpp.Cache(cache_id=999)), S.LLM_KV_CACHE_NOT_EXIST)


CPP_ERRORS = [
    ("pull-cache-size-zero", "PullKvCache", dict(args=(0, 0))),
    ("pull-cache-size-above-row", "PullKvCache", dict(args=(0, 65))),
    ("pull-cache-size-minus-two", "PullKvCache", dict(args=(0, -2))),
    ("pull-cache-size-str", "PullKvCache", dict(args=(0, "16"))),
    ("pull-cache-batch-out-of-rows", "PullKvCache", dict(args=(3, -1))),
    ("pull-cache-batch-negative", "PullKvCache", dict(args=(-1, -1))),
    ("pull-cache-batch-above-uint32", "PullKvCache", dict(args=(2**32, -1))),
    ("pull-cache-narrow-row-cannot-fill-wide", "PullKvCache", dict(cache="wide", dst="wide")),
    ("pull-cache-index-not-a-struct", "PullKvCache", dict(index=[1, 2, 0])),
    ("pull-cache-index-batch-negative", "PullKvCache", dict(row=-1)),
    ("pull-cache-cache-not-a-struct", "PullKvCache", dict(cache=7)),
    ("pull-blocks-src-empty", "PullKvBlocks", dict(args=([], []))),
    ("pull-blocks-lengths-differ", "PullKvBlocks", dict(args=([0, 1], [2]))),
    ("pull-blocks-src-out-of-range", "PullKvBlocks", dict(args=([6], [2]))),
    ("pull-blocks-dst-out-of-range", "PullKvBlocks", dict(args=([0], [6]))),
    ("pull-blocks-negative", "PullKvBlocks", dict(args=([-1], [2]))),
    ("pull-blocks-str", "PullKvBlocks", dict(args=(["0"], [2]))),
    ("pull-blocks-not-a-list", "PullKvBlocks", dict(args=(0, 2))),
    ("pull-blocks-index-batch-not-zero", "PullKvBlocks", dict(row=1)),
    ("pull-blocks-block-sizes-differ", "PullKvBlocks", dict(peer_cache="rows_dev", src="rows_dev")),
    ("push-cache-size-not-minus-one", "PushKvCache", dict(args=(0, 16))),
    ("push-cache-size-whole-row-given", "PushKvCache", dict(args=(0, 64))),
    ("push-cache-src-row-out-of-range", "PushKvCache", dict(args=(3, -1))),
    ("push-cache-src-row-negative", "PushKvCache", dict(args=(-1, -1))),
    ("push-cache-wide-row-into-narrow", "PushKvCache", dict(cache="wide", src="wide")),
    ("push-blocks-src-empty", "PushKvBlocks", dict(args=([], []))),
    ("push-blocks-lengths-differ", "PushKvBlocks", dict(args=([0], [1, 2]))),
    ("push-blocks-src-out-of-range", "PushKvBlocks", dict(args=([6], [1]))),
    ("push-blocks-dst-out-of-range", "PushKvBlocks", dict(args=([0], [6]))),
    ("push-blocks-index-batch-not-zero", "PushKvBlocks", dict(row=1)),
    ("push-blocks-big-blocks-into-small", "PushKvBlocks", dict(cache="rows_dev", src="rows_dev")),
    ("push-blocks-by-decoder", "PushKvBlocks", dict(caller="decoder")),
    ("push-cache-by-decoder", "PushKvCache", dict(caller="decoder")),
]


@pytest.mark.parametrize("base,changes", [c[1:] for c in CPP_ERRORS], ids=[c[0] for c in CPP_ERRORS])
def test_cpp_refused(cpp_pair, base, changes):
    check_cpp_refused(cpp_pair, _cpp_with(base, **changes), S.LLM_PARAM_INVALID)


@pytest.mark.parametrize("base,row", [("PullKvCache", 3), ("PushKvCache", 3)])
def test_cpp_remote_row_out_of_range(cpp_pair, base, row):
    check_cpp_refused(cpp_pair, _cpp_with(base, row=row), S.LLM_KV_CACHE_NOT_EXIST)


def test_mix_role_may_push(clusters, cpp_pair):
    """kMix pushes like kPrompt (spec §16.1: Prompt only in V1; the v2 library accepts Mix too)."""
    mix = clusters.start(8, "kMix", api="cpp")
    mix.call(ops.cpp_register, "blocks_dev", 4, (6, 8))
    assert link(mix, cpp_pair.decoder.cluster) == (0, [0])
    src_data = mix.call(ops.fill, "blocks_dev", next(SEEDS))
    dst_data = cpp_pair.decoder.call(ops.fill, "blocks_host", next(SEEDS))
    index = (cpp_pair.decoder.cluster_id, cpp_pair.decoder.ids["blocks_host"], 0)
    assert mix.call(ops.cpp_op, "PushKvBlocks", index, "blocks_dev", [3], [1]) == S.LLM_SUCCESS
    assert_same(cpp_pair.decoder.call(ops.snapshot, "blocks_host"),
                copy_blocks(src_data, dst_data, range(4), range(4), [3], [1]), "destination")
