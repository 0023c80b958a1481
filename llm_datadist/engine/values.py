"""The engine's values and option parsers: pure data and checks, no threads, no engine state.

What the API styles hand the engine (remote references ``CacheRowRef`` / ``KeyRef`` /
``BlocksRef``, block lists as ``BlockSpec``, layer-wise destinations as ``LayerTarget``, tensor
selections from ``layer_tensors`` / ``whole_caches``), what the registry keeps (``CacheRecord``,
``MemoryPool``), remote references resolved in a peer's table and what a transfer planned
there (``PlannedTransfer``), and the parsers and checks of the engine's options and geometry.
Every other engine module builds on this one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from llm_datadist import _core
from llm_datadist._memory import ADDRESS_SPACE, Place, check_address_range, tensor_bytes
from llm_datadist._validate import INT32_MAX, is_instance_strict, param_invalid
from llm_datadist.data_type import DataType
from llm_datadist.status import LLMException, LLMStatusCode

DEFAULT_SYNC_KV_TIMEOUT_MS = 1000

# Cache kinds: a contiguous cache (rows = batch), a blocks cache (rows = blocks), or MIX (the
# C++ RegisterKvCache kind, usable both ways).
CONTIGUOUS = "cache"
BLOCKS = "blocks"
MIX = "mix"


# -- what the API styles hand the engine --------------------------------------------------------
@dataclass(frozen=True)
class CacheRowRef:
    """A peer's cache row by cache id (``CacheKeyByIdAndIndex``, ``cpp.CacheIndex``)."""

    cache_id: int
    row: int = 0


@dataclass(frozen=True)
class KeyRef:
    """A peer's cache row bound to an owner key (``CacheKey.owner_key()``)."""

    owner_key: tuple


@dataclass(frozen=True)
class BlocksRef:
    """A peer's blocks cache by the model id it was registered under (``BlocksCacheKey``)."""

    model_id: int


RemoteRef = Union[CacheRowRef, KeyRef, BlocksRef]


@dataclass(frozen=True)
class BlockSpec:
    """The block lists of one transfer, converted and element-checked once by the core
    (``block_array``: 1-D uint64 arrays); the planners check them against the geometry.
    ``src_blocks`` None: a row cut into ``block_bytes`` chunks, chunk k -> ``dst_blocks[k]``.
    ``block_bytes`` -1: the source block size. ``src_offset``/``dst_offset``: where in each block
    the bytes start (a byte range of every block: a tensor parallel rank's KV heads)."""

    src_blocks: Any
    dst_blocks: Any
    block_bytes: int = -1
    src_offset: int = 0
    dst_offset: int = 0

    @property
    def row_to_blocks(self) -> bool:
        return self.src_blocks is None


@dataclass(frozen=True)
class LayerTarget:
    """One destination of ``transfer_cache_async`` (one ``TransferConfig``): source layers
    ``src_layers`` of row ``src_row`` go to ``ref`` from layer ``dst_layer_start`` on, or to the
    raw tensor addresses ``dst_addrs`` (two per layer)."""

    remote_id: int
    src_layers: range
    src_row: int
    ref: Optional[RemoteRef] = None
    dst_layer_start: Optional[int] = None
    dst_addrs: Optional[Tuple[int, ...]] = None


def block_array(values: Any, name: str, cann_errors: bool = False) -> Any:
    """A block list as a checked uint64 array (see ``_core.as_block_array``): errors are
    LLM_PARAM_INVALID, or with ``cann_errors`` the CANN Python API's TypeError/ValueError."""
    return _core.as_block_array(values, name, _core.BLOCK_ERRORS_CANN if cann_errors
                                else _core.BLOCK_ERRORS_STATUS)


def block_map_arrays(mapping: Any, one_to_many: bool = False) -> Optional[Tuple[Any, Any]]:
    """``(src, dst)`` block arrays of a ``{src: dst}`` / ``{src: [dst, ...]}`` dict of plain ints,
    or None when the dict holds anything else (see ``_core.block_map_arrays``)."""
    return _core.block_map_arrays(mapping, one_to_many)


def layer_tensors(src_range: Any, dst_range: Any, tensor_num_per_layer: int, inclusive: bool = False):
    """The tensor selection of a pair of layer ranges, as ``tensors(src_n, dst_n)``: Python ranges
    (None = all layers) or, ``inclusive``, C++ inclusive pairs (``(-1, -1)`` = all layers)."""
    def tensors(src_n: int, dst_n: int):
        return _core.resolve_layer_ranges(src_range, dst_range, src_n, dst_n, tensor_num_per_layer,
                                          inclusive)
    return tensors


def _all_tensors(src_n: int, dst_n: int):
    return None, None


def whole_caches(tensor_num_per_layer: int):
    """The tensor selection of a transfer without layer ranges: every tensor, positionally. A
    ``tensor_num_per_layer`` other than the default must still lie in [1, num_tensors] of both
    caches (the default is accepted whatever the tensor count, e.g. for one-tensor caches)."""
    if tensor_num_per_layer == 2:
        return _all_tensors

    def tensors(src_n: int, dst_n: int):
        for side, count in (("source", src_n), ("destination", dst_n)):
            if not 1 <= tensor_num_per_layer <= count:
                raise param_invalid(f"tensor_num_per_layer {tensor_num_per_layer} must be in [1, {count}] "
                                    f"(the number of tensors of the {side} cache)")
        return None, None
    return tensors


# -- what the registry keeps -----------------------------------------------------------------------
def not_exist(message: str) -> LLMException:
    return LLMException(message, status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)


@dataclass(eq=False)
class CacheRecord:
    """One cache known to the engine (or a transient one, cache_id -1, for staging buffers)."""

    cache_id: int
    num_tensors: int
    shape: Tuple[int, ...]
    data_type: DataType
    placement: Place
    kind: str
    addrs: List[int]
    tensor_bytes: int
    layout: Any  # _core.CacheLayout: rows = shape[0], row bytes = tensor_bytes // shape[0]
    registered: bool
    batch_dim: int = 0  # the CacheDesc's batch_dim_index: swap_blocks' blocks are shape[batch_dim]
    allocations: List[Any] = field(default_factory=list)
    #: The memfd of an allocated cache (``shared_memory.SharedCache``), or None.
    shared: Any = None
    keepalive: List[Any] = field(default_factory=list)
    #: Tensors of a registered HOST cache page-locked for the device (``Engine._pin_host``).
    pinned_addrs: List[int] = field(default_factory=list)
    owner_keys: set = field(default_factory=set)
    pool_bytes: int = 0
    id_released: bool = False
    delivered: dict = field(default_factory=dict)  # owner key -> tensor indices pulled by peers

    @property
    def row_bytes(self) -> int:
        return self.layout.row_bytes

    @property
    def num_rows(self) -> int:
        return self.layout.num_rows


def is_blocks(record: CacheRecord) -> bool:
    """Whether the cache was registered or allocated as a blocks cache (or MIX)."""
    return record.kind != CONTIGUOUS


def is_rows(record: CacheRecord) -> bool:
    """Whether the cache was registered or allocated as a contiguous cache (or MIX)."""
    return record.kind != BLOCKS


def new_record(num_tensors: int, shape: Tuple[int, ...], nbytes: int, data_type: DataType,
               placement: Place, kind: str, addrs: List[int], registered: bool,
               cache_id: int, batch_dim: int = 0) -> CacheRecord:
    """A record over ``addrs`` with the geometry of ``cache_geometry`` (checked here: every
    tensor is a valid range of the address space). Every later operation on the cache plans
    against this record, never against the caller's objects."""
    if len(addrs) != num_tensors:
        raise param_invalid(f"{len(addrs)} addresses given for {num_tensors} tensors")
    if not is_instance_strict(batch_dim, int) or not 0 <= batch_dim < len(shape):
        raise param_invalid(f"batch_dim_index {batch_dim!r} must be in [0, {len(shape)})")
    for i, addr in enumerate(addrs):
        check_address_range(addr, nbytes, f"addrs[{i}]")
    # The row (block) stride is the tensor's bytes over shape[0], rounded down as CANN's stride
    # (tensor_size / num_blocks) is: a row of a type packed below a byte may not end on a byte.
    layout = _core.CacheLayout(addrs, shape[0], nbytes // shape[0])
    return CacheRecord(cache_id, num_tensors, shape, data_type, Place(placement), kind,
                       list(addrs), nbytes, layout, registered, batch_dim)


def swap_geometry(record: CacheRecord) -> Tuple[int, int]:
    """``(blocks, block bytes)`` of a cache as swap_blocks sees it: the blocks are
    ``shape[batch_dim]`` and one block is ``tensor bytes // blocks``, as recorded."""
    blocks = record.shape[record.batch_dim]
    return blocks, record.tensor_bytes // blocks


@dataclass
class MemoryPool:
    """Byte accounting for a configured pool (``llm.MemPoolConfig`` / ``llm.HostMemPoolConfig``)."""

    capacity: int
    used: int = 0


# -- a peer's table -----------------------------------------------------------------------------------
def resolve_remote(table, remote_id: int, ref: RemoteRef):
    """Resolve a remote reference in a peer's ``table`` -> ``(RemoteCache, row)``."""
    kind = type(ref)
    if kind is BlocksRef:
        cache = table.blocks_cache(ref.model_id)
        if cache is None:
            raise not_exist(f"cluster {remote_id} has no blocks cache with model_id {ref.model_id}")
        return cache, 0
    if kind is CacheRowRef:
        cache = table.cache(ref.cache_id)
        if cache is None:
            raise not_exist(f"cache_id {ref.cache_id} is not registered in cluster {remote_id}")
        return cache, ref.row
    if kind is KeyRef:
        entry = table.key(ref.owner_key)
        if entry is None:
            raise not_exist(f"no cache of cluster {remote_id} is bound to key {ref.owner_key}")
        return entry
    raise param_invalid(f"{ref!r} is not a remote cache reference")


def check_row_in_range(cache, row: int, remote_id: int) -> None:
    """LLM_KV_CACHE_NOT_EXIST unless ``row`` is a row of the remote ``cache``."""
    if row >= cache.num_rows:
        raise not_exist(f"batch index {row} is out of range: cache {cache.cache_id} of "
                        f"cluster {remote_id} has {cache.num_rows} rows")


class PlannedTransfer(NamedTuple):
    """What a transfer to a linked cluster planned against the peer's table: the ``plan`` that
    ran, the ``table`` (``transport.table.RemoteTable``) it was made against, the remote
    ``cache`` (``RemoteCache``) and ``row`` the reference resolved to, and the tensor indices
    of both sides (``src_tensors`` / ``dst_tensors``, None = all). Made by a transfer's planner
    for every plan it makes (the links may plan twice, against a refreshed table); the engine
    reads it after the transfer to learn a block route or release a pulled key. A NamedTuple:
    it is made on the per-call path of every checked transfer."""

    plan: Any
    table: Any
    cache: Any
    row: int
    src_tensors: Optional[Sequence[int]]
    dst_tensors: Optional[Sequence[int]]


# -- options and geometry ---------------------------------------------------------------------------
def parse_listen_ip_info(value: str) -> Tuple[str, int]:
    """``"ip:port"`` (or ``"[ipv6]:port"``) as (ip, port); LLM_PARAM_INVALID if malformed."""
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise param_invalid(f"listen ip info {value!r} must look like 'ip:port'")
    return host, int(port)


def cache_geometry(shape: Sequence[int], data_type: DataType) -> Tuple[Tuple[int, ...], int]:
    """``(shape as a tuple, bytes of one tensor)``, the shape read exactly once: a caller's list
    may change after (or while) it is checked, so the engine keeps and uses only this copy. A
    tensor must fit the 64-bit address space."""
    dims = tuple(shape)
    for dim in dims:
        if not is_instance_strict(dim, int):
            raise TypeError(f"shape {list(dims)} must hold ints, got {type(dim).__name__}")
    nbytes = tensor_bytes(dims, data_type)
    if nbytes >= ADDRESS_SPACE:
        raise param_invalid(f"a tensor of shape {list(dims)} ({nbytes} bytes) does not fit the "
                            f"64-bit address space")
    return dims, nbytes


def parse_pool(options: Dict[str, str], key: str) -> Optional[MemoryPool]:
    """The pool configured by option ``key`` (JSON with a ``memory_size``), None if not set."""
    text = options.get(key, "")
    if not text:
        return None
    try:
        cfg = json.loads(text)
        size = int(cfg["memory_size"])
    except (ValueError, KeyError, TypeError):
        raise param_invalid(f"option {key} must be JSON with a memory_size, got {text!r}") from None
    if size <= 0:
        raise param_invalid(f"option {key}: memory_size must be > 0, got {size}")
    return MemoryPool(size)


def check_device_id(text: str) -> int:
    """Device id option (``"0"``); llm_datadist binds exactly one device per process."""
    parts = [p for p in text.split(";") if p != ""]
    if len(parts) != 1 or not parts[0].isdigit() or int(parts[0]) > INT32_MAX:
        raise param_invalid(f"device id option {text!r} must name exactly one device id")
    return int(parts[0])


def check_sync_timeout(text: str) -> int:
    """``llm.SyncKvCacheWaitTime``: a positive int32 of milliseconds."""
    if not text.isdigit() or not 0 < int(text) <= INT32_MAX:
        raise param_invalid(f"llm.SyncKvCacheWaitTime must be a positive int32 in ms, got {text!r}")
    return int(text)
