"""A numpy model of what a transfer does to the destination's bytes (spec §6.2, §6.6).

Caches are lists of tensors (numpy arrays, first dimension = rows or blocks). The model works on
byte views, so it is independent of the dtype, and returns a new list: the destination as it
must look after the transfer, every byte outside the written ranges unchanged.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np


def _rows(tensor: np.ndarray) -> np.ndarray:
    """The tensor as a (rows, row_bytes) uint8 view."""
    return tensor.view(np.uint8).reshape(tensor.shape[0], -1)


def layer_tensors(layer_range: Optional[range], num_tensors: int, per_layer: int = 2) -> List[int]:
    """Tensor indices of a Python layer range (None = every whole layer)."""
    if layer_range is None:
        return list(range((num_tensors // per_layer) * per_layer))
    return list(range(layer_range.start * per_layer, layer_range.stop * per_layer))


def inclusive_tensors(pair: Tuple[int, int], num_tensors: int, per_layer: int = 2) -> List[int]:
    """Tensor indices of a C++ inclusive layer pair ((-1, -1) = every whole layer)."""
    if tuple(pair) == (-1, -1):
        return layer_tensors(None, num_tensors, per_layer)
    return list(range(pair[0] * per_layer, (pair[1] + 1) * per_layer))


def copy_rows(src: Sequence[np.ndarray], dst: Sequence[np.ndarray], src_tensors: Sequence[int],
              dst_tensors: Sequence[int], src_row: int, dst_row: int, nbytes: int,
              src_offset: int = 0, dst_offset: int = 0) -> List[np.ndarray]:
    """``nbytes`` of row ``src_row`` (from ``src_offset``) -> row ``dst_row`` (at ``dst_offset``)."""
    out = [t.copy() for t in dst]
    assert len(src_tensors) == len(dst_tensors)
    for s, d in zip(src_tensors, dst_tensors):
        chunk = _rows(src[s])[src_row, src_offset:src_offset + nbytes]
        assert chunk.size == nbytes, "the model was asked for bytes outside the source row"
        _rows(out[d])[dst_row, dst_offset:dst_offset + nbytes] = chunk
    return out


def copy_blocks(src: Sequence[np.ndarray], dst: Sequence[np.ndarray], src_tensors: Sequence[int],
                dst_tensors: Sequence[int], src_blocks: Sequence[int],
                dst_blocks: Sequence[int]) -> List[np.ndarray]:
    """Block ``src_blocks[k]`` -> block ``dst_blocks[k]`` (the source block size, which must fit)."""
    out = [t.copy() for t in dst]
    for s, d in zip(src_tensors, dst_tensors):
        src_view, dst_view = _rows(src[s]), _rows(out[d])
        size = src_view.shape[1]
        for sb, db in zip(src_blocks, dst_blocks):
            dst_view[db, :size] = src_view[sb]
    return out


def copy_row_to_blocks(src: Sequence[np.ndarray], dst: Sequence[np.ndarray], src_tensors: Sequence[int],
                       dst_tensors: Sequence[int], src_row: int,
                       dst_blocks: Sequence[int]) -> List[np.ndarray]:
    """Row ``src_row`` cut into destination-block-sized chunks; chunk ``k`` -> ``dst_blocks[k]``
    (a short last chunk fills the start of its block)."""
    out = [t.copy() for t in dst]
    for s, d in zip(src_tensors, dst_tensors):
        row, dst_view = _rows(src[s])[src_row], _rows(out[d])
        block = dst_view.shape[1]
        for k, db in enumerate(dst_blocks):
            chunk = row[k * block:(k + 1) * block]
            dst_view[db, :chunk.size] = chunk
    return out


def describe_difference(actual: Sequence[np.ndarray], expected: Sequence[np.ndarray]) -> str:
    """Where two caches first differ (empty if they are equal)."""
    if len(actual) != len(expected):
        return f"{len(actual)} tensors, expected {len(expected)}"
    for t, (a, e) in enumerate(zip(actual, expected)):
        if a.shape != e.shape:
            return f"tensor {t}: shape {a.shape}, expected {e.shape}"
        ab, eb = _rows(a), _rows(e)
        bad = np.argwhere(ab != eb)
        if bad.size:
            row, col = bad[0]
            return (f"tensor {t}: {len(bad)} bytes differ, first at row {row} byte {col} "
                    f"(got {ab[row, col]}, expected {eb[row, col]}); differing rows "
                    f"{sorted(set(int(r) for r in bad[:, 0]))}")
    return ""


def assert_same(actual: Sequence[np.ndarray], expected: Sequence[np.ndarray], what: str = "cache") -> None:
    difference = describe_difference(actual, expected)
    assert not difference, f"{what}: {difference}"
