"""Pure-Python reference planner: the plain loops behind the copy plans of ``llm_datadist._core``.

This module is the oracle of the tests and nothing else; the library never imports it. Each
function computes, in the most obvious way, what its namesake in the Cython core computes:

* ``plan_blocks``, ``plan_sub_blocks``, ``plan_strided_blocks``, ``plan_rows`` and ``plan_row_to_blocks``
  return the **unmerged** list of ``(src, dst, nbytes)`` copies, in the order the core must perform them;
* ``layer_range_to_tensor_indices``, ``inclusive_layer_range_to_tensor_indices`` and
  ``resolve_layer_ranges`` return tensor index lists (tensor ``t`` belongs to layer ``t // N``);
* ``apply`` performs descriptors one after the other on a model of memory.

A cache is given as its geometry: the tensor base addresses, the number of rows (or blocks) per
tensor and the bytes of one row (the stride). Wherever the core raises
``LLMException(LLM_PARAM_INVALID)`` this module raises :class:`InvalidInput`, a ``ValueError``.
The checks run in the core's order, so ``InvalidInput.value`` is the value that the core's
message must name. Speed is a non-goal.
"""

from __future__ import annotations

__all__ = [
    "InvalidInput", "plan_blocks", "plan_sub_blocks", "plan_strided_blocks", "plan_rows", "plan_row_to_blocks",
    "layer_range_to_tensor_indices", "inclusive_layer_range_to_tensor_indices",
    "resolve_layer_ranges", "apply",
]


class InvalidInput(ValueError):
    """Invalid planner or layer-range input; ``value`` is the offending value (None: no one value)."""

    def __init__(self, message: str, value=None):
        super().__init__(message)
        self.value = value


# ------------------------------------------------------------------------------------------------
# Copy plans
# ------------------------------------------------------------------------------------------------

def _check_geometry(addrs, rows, row_bytes, side):
    if len(addrs) == 0:
        raise InvalidInput(f"the {side} cache has no tensor address")
    if rows < 0 or row_bytes < 0:
        raise InvalidInput(f"the {side} cache has {rows} rows of {row_bytes} bytes", min(rows, row_bytes))


def _check_unsigned(**values):
    """The arguments the core takes as uint64 must be in [0, 2**64)."""
    for name, value in values.items():
        if not 0 <= value < 2**64:
            raise InvalidInput(f"{name} {value} is not in [0, 2**64)", value)


def _indices(values, limit, name):
    """``values`` as a list of ints, each in ``[0, limit)``; None means all of ``range(limit)``."""
    if values is None:
        return list(range(limit))
    result = []
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidInput(f"{name}[{i}] = {value!r} is not an integer", value)
        if not 0 <= value < limit:
            raise InvalidInput(f"{name}[{i}] = {value} is out of range [0, {limit})", value)
        result.append(value)
    return result


def _tensor_pairs(src_addrs, dst_addrs, src_tensors, dst_tensors):
    """Selected source tensor #k goes to selected destination tensor #k."""
    src = _indices(src_tensors, len(src_addrs), "src tensor index")
    dst = _indices(dst_tensors, len(dst_addrs), "dst tensor index")
    if len(src) != len(dst):
        raise InvalidInput(f"source selects {len(src)} tensors, destination {len(dst)}", len(src))
    if len(src) == 0:
        raise InvalidInput("no tensor selected")
    return list(zip(src, dst))


def plan_blocks(src_addrs, src_rows, src_row_bytes, dst_addrs, dst_rows, dst_row_bytes,
                src_tensors, dst_tensors, src_blocks, dst_blocks, nbytes=-1, src_offset=0, dst_offset=0):
    """For each tensor pair ``(s, d)`` and each ``k``: ``nbytes`` from ``src_offset`` bytes into
    block ``src_blocks[k]`` of tensor ``s`` to ``dst_offset`` bytes into block ``dst_blocks[k]`` of
    tensor ``d`` (``nbytes`` -1 = the rest of a source block); both ranges must fit their blocks."""
    _check_unsigned(src_offset=src_offset, dst_offset=dst_offset)
    _check_geometry(src_addrs, src_rows, src_row_bytes, "source")
    _check_geometry(dst_addrs, dst_rows, dst_row_bytes, "destination")
    pairs = _tensor_pairs(src_addrs, dst_addrs, src_tensors, dst_tensors)
    src_blocks = _indices(src_blocks, src_rows, "src_blocks")
    dst_blocks = _indices(dst_blocks, dst_rows, "dst_blocks")
    if len(src_blocks) != len(dst_blocks):
        raise InvalidInput(f"{len(src_blocks)} source blocks, {len(dst_blocks)} destination blocks",
                           len(src_blocks))
    if src_offset >= src_row_bytes:
        raise InvalidInput(f"source offset {src_offset} is outside the block", src_offset)
    if dst_offset >= dst_row_bytes:
        raise InvalidInput(f"destination offset {dst_offset} is outside the block", dst_offset)
    if nbytes == -1:
        nbytes = src_row_bytes - src_offset
    if not 1 <= nbytes <= min(src_row_bytes - src_offset, dst_row_bytes - dst_offset):
        raise InvalidInput(f"block copy size {nbytes} does not fit the blocks", nbytes)
    copies = []
    for s, d in pairs:
        for src_block, dst_block in zip(src_blocks, dst_blocks):
            copies.append((src_addrs[s] + src_block * src_row_bytes + src_offset,
                           dst_addrs[d] + dst_block * dst_row_bytes + dst_offset, nbytes))
    return copies


def _regions(regions, small):
    """``regions`` as ``(offset, nbytes, runs)`` triples inside a small block of ``small`` bytes, in
    order and disjoint, each ``nbytes`` a whole multiple of ``runs``."""
    if not isinstance(regions, (list, tuple)):
        raise InvalidInput("regions is no sequence", None)
    if not regions:
        raise InvalidInput("no region", None)
    checked, end = [], 0
    for k, item in enumerate(regions):
        if not isinstance(item, (tuple, list)) or len(item) != 3:
            raise InvalidInput(f"regions[{k}] is not a triple", None)
        offset, nbytes, runs = item
        _check_unsigned(offset=offset, nbytes=nbytes, runs=runs)
        if offset < end:
            raise InvalidInput(f"regions[{k}] offset {offset} overlaps", offset)
        if nbytes == 0 or offset + nbytes > small:
            raise InvalidInput(f"regions[{k}] nbytes {nbytes} is outside the block", nbytes)
        if runs == 0 or nbytes % runs:
            raise InvalidInput(f"regions[{k}] runs {runs} must divide its bytes", runs)
        checked.append((offset, nbytes, runs))
        end = offset + nbytes
    return checked


def plan_sub_blocks(src_addrs, src_rows, src_row_bytes, dst_addrs, dst_rows, dst_row_bytes,
                    src_tensors, dst_tensors, src_blocks, dst_blocks, regions, first=0):
    """Blocks of ``ratio`` times the bytes on one side (the large one): for each tensor pair, small
    block ``i`` of its list is, region by region (``(offset, nbytes, runs)`` of a small block; at
    ``ratio * offset`` in a large one, its runs ``ratio`` times as long) and run by run, sub-block
    ``(first + i) % ratio`` of large block ``(first + i) // ratio`` of the other list."""
    _check_unsigned(first=first)
    _check_geometry(src_addrs, src_rows, src_row_bytes, "source")
    _check_geometry(dst_addrs, dst_rows, dst_row_bytes, "destination")
    src_large = src_row_bytes > dst_row_bytes
    large, small = max(src_row_bytes, dst_row_bytes), min(src_row_bytes, dst_row_bytes)
    pairs = _tensor_pairs(src_addrs, dst_addrs, src_tensors, dst_tensors)
    if small == 0 or large % small:
        raise InvalidInput(f"blocks of {src_row_bytes} and {dst_row_bytes} bytes are no multiples", small)
    ratio = large // small
    regions = _regions(regions, small)
    if first >= ratio:
        raise InvalidInput(f"first sub-block {first} is out of range", first)
    src_blocks = _indices(src_blocks, src_rows, "src_blocks")
    dst_blocks = _indices(dst_blocks, dst_rows, "dst_blocks")
    small_list, large_list = (dst_blocks, src_blocks) if src_large else (src_blocks, dst_blocks)
    wanted = -(-(first + len(small_list)) // ratio) if small_list else 0
    if len(large_list) != wanted:
        raise InvalidInput(f"{len(large_list)} large blocks for {len(small_list)} small ones", len(large_list))
    copies = []
    for s, d in pairs:
        small_base, large_base = (dst_addrs[d], src_addrs[s]) if src_large else (src_addrs[s], dst_addrs[d])
        for i, block in enumerate(small_list):
            at = first + i
            for offset, nbytes, runs in regions:
                piece = nbytes // runs
                for r in range(runs):
                    small_at = small_base + block * small + offset + r * piece
                    large_at = (large_base + large_list[at // ratio] * large + ratio * offset + r * piece * ratio
                                + (at % ratio) * piece)
                    copies.append((large_at, small_at, piece) if src_large else (small_at, large_at, piece))
    return copies


def plan_strided_blocks(src_addrs, src_rows, src_row_bytes, dst_addrs, dst_rows, dst_row_bytes,
                        src_tensors, dst_tensors, src_blocks, dst_blocks, regions):
    """For each tensor pair, block pair and region ``(src_offset, src_stride, dst_offset,
    dst_stride, piece, count)``: ``count`` runs of ``piece`` bytes, run ``r`` at ``offset + r *
    stride`` of each side's block; every run inside its block."""
    _check_geometry(src_addrs, src_rows, src_row_bytes, "source")
    _check_geometry(dst_addrs, dst_rows, dst_row_bytes, "destination")
    pairs = _tensor_pairs(src_addrs, dst_addrs, src_tensors, dst_tensors)
    checked = []
    if not hasattr(regions, "__iter__"):
        raise InvalidInput(f"regions is a {type(regions).__name__}, not a sequence", type(regions).__name__)
    for k, item in enumerate(regions):
        if not hasattr(item, "__len__") or len(item) != 6:
            raise InvalidInput(f"regions[{k}] is not six values", item)
        _check_unsigned(**dict(zip(("src_offset", "src_stride", "dst_offset", "dst_stride", "piece", "count"), item)))
        src_offset, src_stride, dst_offset, dst_stride, piece, count = item
        if piece == 0 or count == 0:
            raise InvalidInput(f"regions[{k}] piece {piece} and count {count} must be > 0", piece or count)
        if src_offset + (count - 1) * src_stride + piece > src_row_bytes:
            raise InvalidInput(f"regions[{k}] ends outside the source block", src_offset)
        if dst_offset + (count - 1) * dst_stride + piece > dst_row_bytes:
            raise InvalidInput(f"regions[{k}] ends outside the destination block", dst_offset)
        checked.append(item)
    if not checked:
        raise InvalidInput("no region")
    src_blocks = _indices(src_blocks, src_rows, "src_blocks")
    dst_blocks = _indices(dst_blocks, dst_rows, "dst_blocks")
    if len(src_blocks) != len(dst_blocks):
        raise InvalidInput(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destination ones", len(src_blocks))
    copies = []
    for s, d in pairs:
        for sb, db in zip(src_blocks, dst_blocks):
            for src_offset, src_stride, dst_offset, dst_stride, piece, count in checked:
                for r in range(count):
                    copies.append((src_addrs[s] + sb * src_row_bytes + src_offset + r * src_stride,
                                   dst_addrs[d] + db * dst_row_bytes + dst_offset + r * dst_stride, piece))
    return copies


def plan_rows(src_addrs, src_rows, src_row_bytes, dst_addrs, dst_rows, dst_row_bytes,
              src_tensors, dst_tensors, src_row, dst_row, src_offset=0, dst_offset=0, size=-1):
    """For each tensor pair: ``size`` bytes from ``src_row`` at ``src_offset`` to ``dst_row`` at
    ``dst_offset`` (``size`` -1 = the rest of the source row); both ranges must fit their rows."""
    _check_unsigned(src_row=src_row, dst_row=dst_row, src_offset=src_offset, dst_offset=dst_offset)
    _check_geometry(src_addrs, src_rows, src_row_bytes, "source")
    _check_geometry(dst_addrs, dst_rows, dst_row_bytes, "destination")
    pairs = _tensor_pairs(src_addrs, dst_addrs, src_tensors, dst_tensors)
    if src_row >= src_rows:
        raise InvalidInput(f"source row {src_row} does not exist", src_row)
    if dst_row >= dst_rows:
        raise InvalidInput(f"destination row {dst_row} does not exist", dst_row)
    if src_offset >= src_row_bytes:
        raise InvalidInput(f"source offset {src_offset} is outside the row", src_offset)
    if size == -1:
        size = src_row_bytes - src_offset
    if size <= 0:
        raise InvalidInput(f"size {size} must be -1 or > 0", size)
    if src_offset + size > src_row_bytes:
        raise InvalidInput(f"source offset {src_offset} + size {size} exceeds the row", size)
    if dst_offset >= dst_row_bytes:
        raise InvalidInput(f"destination offset {dst_offset} is outside the row", dst_offset)
    if dst_offset + size > dst_row_bytes:
        raise InvalidInput(f"destination offset {dst_offset} + size {size} exceeds the row", size)
    return [(src_addrs[s] + src_row * src_row_bytes + src_offset,
             dst_addrs[d] + dst_row * dst_row_bytes + dst_offset, size) for s, d in pairs]


def plan_row_to_blocks(src_addrs, src_rows, src_row_bytes, dst_addrs, dst_rows, dst_row_bytes,
                       src_tensors, dst_tensors, src_row, dst_blocks):
    """For each tensor pair: chunk ``k`` of source row ``src_row`` (one destination block long,
    the last one possibly shorter) to block ``dst_blocks[k]``; every chunk must start in the row."""
    _check_unsigned(src_row=src_row)
    _check_geometry(src_addrs, src_rows, src_row_bytes, "source")
    _check_geometry(dst_addrs, dst_rows, dst_row_bytes, "destination")
    pairs = _tensor_pairs(src_addrs, dst_addrs, src_tensors, dst_tensors)
    if src_row >= src_rows:
        raise InvalidInput(f"source row {src_row} does not exist", src_row)
    dst_blocks = _indices(dst_blocks, dst_rows, "dst_blocks")
    row, block = src_row_bytes, dst_row_bytes
    if block == 0 or len(dst_blocks) * block >= row + block:  # some chunk would start past the row
        raise InvalidInput(f"{len(dst_blocks)} blocks of {block} bytes do not fit a row of {row}",
                           len(dst_blocks))
    copies = []
    for s, d in pairs:
        row_start = src_addrs[s] + src_row * row
        for k, dst_block in enumerate(dst_blocks):
            copies.append((row_start + k * block, dst_addrs[d] + dst_block * block,
                           min(block, row - k * block)))
    return copies


def apply(descriptors, memory):
    """Perform ``descriptors`` in list order on ``memory`` and return it.

    ``memory`` maps an address to a byte: a ``bytearray`` (addresses are indices) or a ``dict``.
    Each copy reads all its source bytes before writing any (memmove semantics)."""
    for src, dst, nbytes in descriptors:
        src, dst, nbytes = int(src), int(dst), int(nbytes)
        data = [memory[src + i] for i in range(nbytes)]
        for i, byte in enumerate(data):
            memory[dst + i] = byte
    return memory


# ------------------------------------------------------------------------------------------------
# Layer ranges
# ------------------------------------------------------------------------------------------------

def _check_tensor_num_per_layer(n, num_tensors):
    if isinstance(n, bool) or not isinstance(n, int):
        raise InvalidInput(f"tensor_num_per_layer must be an int, got {n!r}", n)
    if not 1 <= n <= num_tensors:
        raise InvalidInput(f"tensor_num_per_layer {n} is not in [1, {num_tensors}]", n)
    if n != 2 and num_tensors % n != 0:  # only the default may leave tensors out of every layer
        raise InvalidInput(f"tensor_num_per_layer {n} does not divide {num_tensors}", n)


def layer_range_to_tensor_indices(layer_range, num_tensors, tensor_num_per_layer=2):
    """The tensors whose layer lies in the Python ``range`` (step 1, ``0 <= start < stop <=
    number of layers``; None = all layers)."""
    n = tensor_num_per_layer
    _check_unsigned(num_tensors=num_tensors)
    _check_tensor_num_per_layer(n, num_tensors)
    num_layers = num_tensors // n
    if layer_range is None:
        layer_range = range(num_layers)
    elif not isinstance(layer_range, range):
        kind = type(layer_range).__name__
        raise InvalidInput(f"layer range must be a range, got a {kind}: {layer_range!r}", kind)
    elif layer_range.step != 1 or not 0 <= layer_range.start < layer_range.stop <= num_layers:
        raise InvalidInput(f"layer range {layer_range} is invalid for {num_layers} layers", layer_range)
    return [t for t in range(num_tensors) if t // n in layer_range]


def inclusive_layer_range_to_tensor_indices(layer_range, num_tensors, tensor_num_per_layer=2):
    """The tensors whose layer lies in the C++ inclusive pair ``(first, second)``: ``0 <= first <=
    second <= max_layer``, or ``(-1, -1)`` = all layers."""
    n = tensor_num_per_layer
    _check_unsigned(num_tensors=num_tensors)
    _check_tensor_num_per_layer(n, num_tensors)
    max_layer = num_tensors // n - 1
    try:
        first, second = layer_range
        first, second = int(first), int(second)
    except (TypeError, ValueError):
        raise InvalidInput(f"layer range must be a pair of ints, got {layer_range!r}",
                           layer_range) from None
    if (first, second) == (-1, -1):
        first, second = 0, max_layer
    elif not 0 <= first <= second <= max_layer:
        raise InvalidInput(f"layer range ({first}, {second}) is invalid for layers 0..{max_layer}",
                           (first, second))
    return [t for t in range(num_tensors) if first <= t // n <= second]


def resolve_layer_ranges(src_range, dst_range, src_num_tensors, dst_num_tensors,
                         tensor_num_per_layer=2, inclusive=False):
    """Source and destination tensor index lists of two layer ranges spanning as many layers
    (Python ranges, None = all; or, with ``inclusive``, C++ pairs, None = ``(-1, -1)``)."""
    if inclusive:
        convert = inclusive_layer_range_to_tensor_indices
        src_range = (-1, -1) if src_range is None else src_range
        dst_range = (-1, -1) if dst_range is None else dst_range
    else:
        convert = layer_range_to_tensor_indices
    src = convert(src_range, src_num_tensors, tensor_num_per_layer)
    dst = convert(dst_range, dst_num_tensors, tensor_num_per_layer)
    if len(src) != len(dst):
        raise InvalidInput(f"layer ranges {src_range} and {dst_range} span different numbers of "
                           f"layers", src_range)
    return src, dst
