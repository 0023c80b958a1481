"""``transfer_cache_async`` from a blocks cache without ``src_block_indices``, as CANN's
``transfer_cache_async_sample.py`` calls it.

CANN takes its cache paths then (``llm_utils.transfer_cache_async``: only non-empty
``src_block_indices`` mean blocks) and its native layer job reads the blocks cache as rows: a
blocks cache has batch size 1 and a stride of one block (``CacheManager::CreateCacheEntry``), so a
row transfer sends block 0 of each tensor of the layer (``GenerateCacheToCacheTask``), and with
``dst_block_indices`` the whole tensor is cut into ``dst_block_memory_size`` chunks
(``GenerateCacheToBlocksTask``). Real processes, both data planes.
"""

from __future__ import annotations

import itertools
from typing import Tuple

import numpy as np
import pytest

from llm_datadist import BlocksCacheKey, CacheKeyByIdAndIndex, LLMStatusCode, TransferConfig, TransferWithCacheKeyConfig
from llm_datadist.testing import Cluster

import cluster_ops as ops
from kv_model import assert_same, copy_row_to_blocks, copy_rows

pytestmark = pytest.mark.usefixtures("plane")

S = LLMStatusCode
SEEDS = itertools.count(700_001, 2)
BLOCK_BYTES = 32  # a block of the (6, 8) int32 caches below


def _pair(pool, accessible: str) -> Tuple[Cluster, Cluster, dict]:
    """A listening server with a row cache and a blocks cache (model 0), and a linked client with
    a 4-tensor blocks source ``src_blocks`` of 6 blocks."""
    options = {"remote_cache_accessible": accessible}
    server = pool.start(1, "DECODER", listen=True, options=options)
    client = pool.start(2, "PROMPT", options=options)
    ids = {"rows": server.call(ops.register, "rows", 4, (2, 16)),
           "blocks": server.call(ops.register, "blocks", 4, (6, 8), "DEVICE", True, (), 0)}
    client.call(ops.register, "src_blocks", 4, (6, 8), "DEVICE", True)
    ip, port = server.address
    assert client.call(ops.py_link, [(1, ip, port)]) == (0, [0])
    return server, client, ids


@pytest.fixture(scope="module")
def keyed_pair(module_clusters):
    return _pair(module_clusters, "1")


@pytest.fixture(scope="module")
def raw_pair(module_clusters):
    return _pair(module_clusters, "0")


def produce_blocks(layers) -> dict:
    """Per layer, the K and V tensors the synchronizer writes into ``src_blocks`` just in time."""
    rng = np.random.default_rng(next(SEEDS))
    return {layer: [rng.integers(-2**31, 2**31, size=(6, 8), dtype=np.int64).astype(np.int32) for _ in range(2)]
            for layer in layers}


def source_after(produce: dict) -> list:
    return [produce[t // 2][t % 2] if t // 2 in produce else np.zeros((6, 8), np.int32) for t in range(4)]


@pytest.mark.parametrize("layers", [range(0, 1), range(0, 2)], ids=["sample-layer-0", "both-layers"])
def test_blocks_source_sends_block_0_of_each_layer_into_the_peer_blocks_cache(keyed_pair, layers):
    """CANN's sample: TransferWithCacheKeyConfig(BlocksCacheKey(peer, 0), range(0, 1), range(0, 1))
    and no block indices. Block 0 of each tensor of the layers lands in block 0; nothing else."""
    server, client, _ = keyed_pair
    client.call(ops.fill_value, "src_blocks", 0)
    before = server.call(ops.fill, "blocks", next(SEEDS))
    produce = produce_blocks(layers)
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), layers, layers)
    client.call(ops.start_async, "src_blocks", [cfg], produce)
    assert client.call(ops.task_synchronize) == S.LLM_SUCCESS
    assert client.call(ops.task_results) == [S.LLM_SUCCESS]
    assert [layer for layer, _ in client.call(ops.sync_calls)] == list(layers)
    tensors = range(2 * layers.start, 2 * layers.stop)
    expected = copy_rows(source_after(produce), before, tensors, tensors, 0, 0, BLOCK_BYTES)
    assert_same(server.call(ops.snapshot, "blocks"), expected)


def test_blocks_source_sends_block_0_into_a_row_of_a_contiguous_cache(keyed_pair):
    """The destination row is the key's batch index; one source block (32 of the row's 64 bytes)."""
    server, client, ids = keyed_pair
    client.call(ops.fill_value, "src_blocks", 0)
    before = server.call(ops.fill, "rows", next(SEEDS))
    produce = produce_blocks([0, 1])
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, ids["rows"], 1), range(0, 2), range(0, 2))
    client.call(ops.start_async, "src_blocks", [cfg], produce)
    assert client.call(ops.task_results) == [S.LLM_SUCCESS]
    expected = copy_rows(source_after(produce), before, range(4), range(4), 0, 1, BLOCK_BYTES)
    assert_same(server.call(ops.snapshot, "rows"), expected)


def test_blocks_source_has_one_row_only(keyed_pair):
    """src_batch_index 1 is beyond the one row of a blocks cache: the layer fails with
    LLM_PARAM_INVALID (a native check in CANN, so a task result, not an exception)."""
    server, client, ids = keyed_pair
    before = server.call(ops.fill, "rows", next(SEEDS))
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, ids["rows"], 0), range(0, 1), range(0, 1),
                                     src_batch_index=1)
    client.call(ops.start_async, "src_blocks", [cfg], produce_blocks([0]))
    assert client.call(ops.task_synchronize) == S.LLM_PARAM_INVALID
    assert client.call(ops.task_results) == [S.LLM_PARAM_INVALID]
    assert_same(server.call(ops.snapshot, "rows"), before, "destination")


def test_blocks_source_with_dst_block_indices_is_cut_into_blocks(keyed_pair):
    """No src_block_indices but dst_block_indices: the whole tensor (the one row) is cut into
    dst_block_memory_size chunks, chunk k -> dst_block_indices[k]."""
    server, client, _ = keyed_pair
    client.call(ops.fill_value, "src_blocks", 0)
    before = server.call(ops.fill, "blocks", next(SEEDS))
    produce = produce_blocks([0, 1])
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), range(0, 2), range(0, 2))
    client.call(ops.start_async, "src_blocks", [cfg], produce, dst_block_indices=[4, 2, 5],
                dst_block_memory_size=BLOCK_BYTES)
    assert client.call(ops.task_results) == [S.LLM_SUCCESS]
    whole_tensors = [t.reshape(1, -1) for t in source_after(produce)]
    expected = copy_row_to_blocks(whole_tensors, before, range(4), range(4), 0, [4, 2, 5])
    assert_same(server.call(ops.snapshot, "blocks"), expected)


def test_blocks_source_to_raw_addresses_without_remote_access(raw_pair):
    """TransferConfig (remote-cache-accessible off): block 0 of each layer's K and V goes to the
    given addresses, here row 1 of the peer's row cache."""
    server, client, _ = raw_pair
    client.call(ops.fill_value, "src_blocks", 0)
    before = server.call(ops.fill, "rows", next(SEEDS))
    row1 = [addr + 64 for addr in server.call(ops.tensor_addrs, "rows")]
    produce = produce_blocks([0, 1])
    client.call(ops.start_async, "src_blocks", [TransferConfig(1, row1, range(0, 2))], produce)
    assert client.call(ops.task_results) == [S.LLM_SUCCESS]
    expected = copy_rows(source_after(produce), before, range(4), range(4), 0, 1, BLOCK_BYTES)
    assert_same(server.call(ops.snapshot, "rows"), expected)
