"""The two reference examples the project started from (spec §16), between two real clusters.

§16.1: C++ ``PushKvBlocks`` of a DT_INT32 ``{4, 16}`` cache with 4 tensors, blocks
``{0, 1, 2, 3} -> {3, 2, 1, 0}``, layer range ``(3, 3)``, one tensor per layer, into
``CacheIndex{cluster_id 0, cache_id 1}``.

§16.2: Python ``push_cache`` of row 1 of layer 0 (``range(0, 1)``), addressed by a
``CacheKeyByIdAndIndex`` and, as CANN's example writes it, by the second of two ``CacheKey``s
bound on the destination.
"""

from __future__ import annotations

import numpy as np
import pytest

from llm_datadist import CacheKey, CacheKeyByIdAndIndex
from llm_datadist.testing import link

import cluster_ops as ops
from kv_model import assert_same

SENTINEL = -0x5A5A0000
SOURCE = 7_000_000


@pytest.mark.parametrize("decoder_cache", ["RegisterKvCache", "AllocateCache"])
def test_push_kv_blocks_example(clusters, decoder_cache):
    decoder = clusters.start(0, "kDecoder", listen=True, api="cpp")
    prompt = clusters.start(1, "kPrompt", api="cpp")
    create = ops.cpp_register if decoder_cache == "RegisterKvCache" else ops.cpp_allocate
    assert decoder.call(create, "kv", 4, (4, 16)) == 1, "the decoder's first cache must get cache_id 1"
    prompt.call(ops.cpp_allocate, "kv", 4, (4, 16))
    assert link(prompt, decoder) == (0, [0])

    source = prompt.call(ops.fill_pattern, "kv", SOURCE)
    before = decoder.call(ops.fill_pattern, "kv", SENTINEL)
    ext = dict(src_layer_range=(3, 3), dst_layer_range=(3, 3), tensor_num_per_layer=1)
    status = prompt.call(ops.cpp_op, "PushKvBlocks", (0, 1, 0), "kv", [0, 1, 2, 3], [3, 2, 1, 0], ext=ext)
    assert status == 0

    after = decoder.call(ops.snapshot, "kv")
    assert np.array_equal(after[3], source[3][::-1]), "tensor 3 must hold the source blocks reversed"
    for t in range(3):
        assert np.array_equal(after[t], before[t]), f"tensor {t} is outside layer 3 and must not change"
    assert_same(prompt.call(ops.snapshot, "kv"), source, "source")


def _push_cache_example(clusters):
    destination = clusters.start(1, "DECODER", listen=True)
    source = clusters.start(2, "PROMPT")
    keys = [CacheKey(1, req_id=1), CacheKey(1, req_id=2)]
    dst_id = destination.call(ops.register, "kv", 4, (2, 16), "DEVICE", False, keys)
    source.call(ops.register, "kv", 4, (2, 16))
    assert link(source, destination) == (0, [0])
    return destination, source, dst_id


def _expect_row1_of_layer0(src, before, after, dst_row):
    expected = [t.copy() for t in before]
    for t in (0, 1):
        expected[t][dst_row] = src[t][1]
    assert_same(after, expected, "destination")
    changed = {(t, r) for t in range(4) for r in range(2) if not np.array_equal(after[t][r], before[t][r])}
    assert changed == {(0, dst_row), (1, dst_row)}


def test_push_cache_example_by_id_and_index(clusters):
    destination, source, dst_id = _push_cache_example(clusters)
    src = source.call(ops.fill_pattern, "kv", SOURCE)
    before = destination.call(ops.fill_pattern, "kv", SENTINEL)
    source.call(ops.py, "push_cache", CacheKeyByIdAndIndex(1, dst_id, 0), "kv", 1,
                src_layer_range=range(0, 1), dst_layer_range=range(0, 1))
    _expect_row1_of_layer0(src, before, destination.call(ops.snapshot, "kv"), dst_row=0)
    assert_same(source.call(ops.snapshot, "kv"), src, "source")


def test_push_cache_example_by_cache_key(clusters):
    """CANN's example: keys CacheKey(1, req_id=1) and CacheKey(1, req_id=2) on the destination;
    the push names the second key, so it lands in row 1."""
    destination, source, _ = _push_cache_example(clusters)
    src = source.call(ops.fill_pattern, "kv", SOURCE)
    before = destination.call(ops.fill_pattern, "kv", SENTINEL)
    source.call(ops.py, "push_cache", CacheKey(1, req_id=2), "kv", 1, src_layer_range=range(0, 1),
                dst_layer_range=range(0, 1))
    _expect_row1_of_layer0(src, before, destination.call(ops.snapshot, "kv"), dst_row=1)
