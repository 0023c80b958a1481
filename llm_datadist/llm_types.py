"""Data model of the CANN Python API: placements, cache descriptions, caches and keys."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from enum import Enum, IntEnum
from typing import List, NamedTuple, Optional, Tuple, Union

from llm_datadist._validate import (
    UINT64_MAX,
    check_int32,
    check_int64,
    check_isinstance,
    check_uint32,
    check_uint64,
    param_invalid,
    raise_if_false,
)
from llm_datadist._memory import MAX_SHAPE_DIMS, host_view, resolve_addresses, tensor_bytes  # noqa: F401 (re-exported)
from llm_datadist.data_type import DataType
from llm_datadist.status import LLMException, LLMStatusCode

__all__ = [
    "Placement", "Memtype", "RegisterMemStatus", "CacheDesc", "Cache", "KvCache", "CacheKey",
    "CacheKeyByIdAndIndex", "BlocksCacheKey", "MemInfo", "LayerSynchronizer", "TransferConfig",
    "TransferWithCacheKeyConfig", "CacheTask",
]

INVALID_ID = UINT64_MAX


def is_invalid_id(req_id_or_prefix_id: int) -> bool:
    """CANN's test of a request or prefix id: negative or ``2**64 - 1`` means "not set"."""
    return req_id_or_prefix_id < 0 or req_id_or_prefix_id == INVALID_ID


def is_valid_id(req_id_or_prefix_id: int) -> bool:
    return not is_invalid_id(req_id_or_prefix_id)


class PushType(Enum):
    """CANN's kinds of push destination (the value its native transfer call is given); kept for
    programs that import it from ``llm_datadist.v2.llm_types``, nothing here reads it."""

    NO_CACHE_KEY = 0
    BLOCKS_CACHE_KEY = 1
    CACHE_KEY_BY_ID = 2


class Placement(IntEnum):
    HOST = 0
    DEVICE = 1

    def __str__(self) -> str:  # "Placement.DEVICE" on every Python version, as in CANN
        return f"{type(self).__name__}.{self.name}"


class Memtype(Enum):
    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


class RegisterMemStatus(Enum):
    OK = 0
    PREPARING = 1
    FAILED = 2


# query_register_mem_status maps the native status through this table; other values are FAILED
# (RegisterMemStatus itself refuses unknown values, as CANN's does).
int_to_mem_status_dict = {0: RegisterMemStatus.OK, 1: RegisterMemStatus.PREPARING, 2: RegisterMemStatus.FAILED}


class CacheDesc:
    """Describes a cache: ``num_tensors`` tensors of one ``shape`` and ``data_type``.

    ``shape`` is stored by reference (``update_dim`` changes it in place); ``size`` is the bytes of
    one tensor.
    """

    def __init__(self, num_tensors: int, shape, data_type: DataType,
                 placement: Placement = Placement.DEVICE, batch_dim_index: int = 0,
                 seq_len_dim_index: int = -1, kv_tensor_format: Optional[str] = None) -> None:
        check_uint32("num_tensors", num_tensors)
        self._check_shape(shape)
        check_isinstance("data_type", data_type, DataType, allow_none=False)
        check_isinstance("placement", placement, Placement, allow_none=False)
        check_int32("batch_dim_index", batch_dim_index)
        raise_if_false(0 <= batch_dim_index < max(len(shape), 1),
                       f"batch_dim_index {batch_dim_index} must be in [0, {len(shape)})")
        check_int32("seq_len_dim_index", seq_len_dim_index)
        raise_if_false(seq_len_dim_index == -1 or 0 <= seq_len_dim_index < len(shape),
                       f"seq_len_dim_index {seq_len_dim_index} must be -1 or in [0, {len(shape)})")
        check_isinstance("kv_tensor_format", kv_tensor_format, str)
        self._num_tensors = num_tensors
        self._shape = shape
        self._data_type = data_type
        self._placement = placement
        self._batch_dim_index = batch_dim_index
        self._seq_len_dim_index = seq_len_dim_index
        self._kv_tensor_format = kv_tensor_format
        # CANN's flag, set by register_blocks_cache / allocate_blocks_cache (pack_cache_desc reads it)
        self._is_blocks = False

    @staticmethod
    def _check_shape(shape) -> None:
        check_isinstance("shape", shape, [list, tuple], int, allow_none=False)
        for dim in shape:
            check_int64("shape dim", dim)

    @property
    def num_tensors(self) -> int:
        return self._num_tensors

    @property
    def shape(self):
        return self._shape

    @property
    def data_type(self) -> DataType:
        return self._data_type

    @property
    def placement(self) -> Placement:
        return self._placement

    @property
    def batch_dim(self) -> int:
        return self._batch_dim_index

    batch_dim_index = batch_dim

    @property
    def batch_size(self) -> int:
        return self._shape[self._batch_dim_index]

    @property
    def seq_len_dim_index(self) -> int:
        return self._seq_len_dim_index

    @property
    def kv_tensor_format(self) -> Optional[str]:
        return self._kv_tensor_format

    @property
    def size(self) -> int:
        """Bytes of one tensor: prod(shape) * element size."""
        return tensor_bytes(self._shape, self._data_type)

    def update_dim(self, dim_index: int, dim_value: int) -> None:
        check_int32("dim_index", dim_index)
        check_int64("dim_value", dim_value)
        raise_if_false(0 <= dim_index < len(self._shape),
                       f"dim_index {dim_index} must be in [0, {len(self._shape)})")
        # In place, as CANN's does: a shape given as a tuple raises TypeError here, as in CANN.
        self._shape[dim_index] = dim_value

    def __repr__(self) -> str:
        return (f"CacheDesc(num_tensors={self._num_tensors}, shape={list(self._shape)}, "
                f"data_type={self._data_type}, placement={self._placement}, "
                f"batch_dim_index={self._batch_dim_index}, seq_len_dim_index={self._seq_len_dim_index})")


class CacheGeometry(NamedTuple):
    """A CacheDesc's geometry as it was when a cache was made (the desc itself stays the
    caller's: ``update_dim`` and list shapes change it in place)."""

    num_tensors: int
    shape: Tuple[int, ...]
    data_type: DataType
    placement: Placement
    batch_dim: int


def _geometry_of(desc) -> Optional[CacheGeometry]:
    if not isinstance(desc, CacheDesc):
        return None
    return CacheGeometry(desc.num_tensors, tuple(desc.shape), desc.data_type, desc.placement,
                         desc.batch_dim_index)


class Cache:
    """A registered or allocated cache: ``num_tensors`` tensors at ``tensor_addrs``.

    Built by the CacheManager (or ``create_cpu_cache``), not by users. ``as_numpy()`` returns
    zero-copy numpy views of the tensors when their memory is host-addressable. Operations use
    the geometry and addresses recorded when the cache was made, not ``cache_desc`` as it may
    have been changed since; ``tensor_addrs`` returns a copy.
    """

    def __init__(self, cache_id: int, cache_desc: CacheDesc, tensor_addrs: List[int],
                 cache_manager=None, is_registered: bool = False, is_blocks_cache: bool = False) -> None:
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._tensor_addrs = list(tensor_addrs)
        self._geometry = _geometry_of(cache_desc)
        self._cache_manager = cache_manager
        self._is_registered = is_registered
        self._is_blocks_cache = is_blocks_cache
        self._valid = True
        self._keepalive = None

    @property
    def cache_id(self) -> int:
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        return self._cache_desc

    @property
    def tensor_addrs(self) -> List[int]:
        return list(self._tensor_addrs)

    @property
    def is_blocks_cache(self) -> bool:
        return self._is_blocks_cache

    @property
    def is_registered(self) -> bool:
        return self._is_registered

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs) -> "Cache":
        """A host staging cache over caller-owned memory (cache_id -1, a blocks cache), e.g. for
        ``swap_blocks``. ``addrs``: a list of addresses (or numpy arrays / torch tensors)."""
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        geometry = _geometry_of(cache_desc)  # read once: what the addresses are checked against
        raise_if_false(geometry.placement == Placement.HOST,
                       "create_cpu_cache needs a cache_desc with placement HOST")
        check_isinstance("addrs", addrs, list, allow_none=False)
        raise_if_false(len(addrs) == geometry.num_tensors,
                       f"{len(addrs)} addresses given for {geometry.num_tensors} tensors")
        resolved, keepalive = resolve_addresses(addrs, tensor_bytes(geometry.shape, geometry.data_type), "cpu")
        cache = cls(-1, cache_desc, resolved, None, True, True)
        cache._geometry = geometry
        cache._keepalive = keepalive
        return cache

    def as_numpy(self, index: Optional[int] = None):
        """Zero-copy numpy view(s) of the tensors: a list, or tensor ``index`` alone.

        Raises ``LLMException(LLM_KV_CACHE_NOT_EXIST)`` after deallocation and
        ``LLMException(LLM_FEATURE_NOT_ENABLED)`` for device memory the host cannot address.
        """
        if not self._valid or not self._tensor_addrs:
            raise LLMException(f"cache {self._cache_id} was released", status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
        if self._cache_manager is not None:
            views = self._cache_manager._tensor_views(self)
        else:
            geometry = self._geometry
            if geometry is None:
                raise param_invalid("the cache has no CacheDesc to view its tensors with")
            nbytes = tensor_bytes(geometry.shape, geometry.data_type)
            views = [host_view(addr, nbytes, self._keepalive, geometry.data_type, geometry.shape)
                     for addr in self._tensor_addrs]
        return views if index is None else views[index]

    def __repr__(self) -> str:
        return (f"Cache(cache_id={self._cache_id}, is_blocks_cache={self._is_blocks_cache}, "
                f"num_tensors={len(self._tensor_addrs)}, desc={self._cache_desc})")


class KvCache(Cache):
    """The v1 (KvCacheManager mode) cache type; v1 mode is not implemented, the type is kept for
    programs that only name it. ``per_device_tensor_addrs`` holds one address list per device;
    ``tensor_addrs`` is the first device's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._per_device_tensor_addrs = [list(self._tensor_addrs)]

    @property
    def per_device_tensor_addrs(self) -> List[List[int]]:
        return [list(addrs) for addrs in self._per_device_tensor_addrs]

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs) -> "KvCache":
        """CANN's ``KvCache.create_cpu_cache``: ``addrs`` is a list of integer addresses (one
        device) or a list of such lists (one per device), each of ``num_tensors`` addresses.
        Unlike ``Cache.create_cpu_cache`` it takes ints only, as CANN's does; the addresses are
        checked when an operation uses the cache."""
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        geometry = _geometry_of(cache_desc)
        raise_if_false(geometry.placement == Placement.HOST, "cache_desc placement must be HOST")
        check_isinstance("addrs", addrs, list, allow_none=False)
        raise_if_false(len(addrs) > 0, "addrs length should be bigger than zero.")
        # CANN's checks, in its order and with its messages: every element a list or an int, all
        # of one kind, each list of num_tensors ints.
        first_type = type(addrs[0])
        for addr in addrs:
            check_isinstance("the internal element of addrs", addr, [list, int], allow_none=False)
            if isinstance(addr, list):
                check_isinstance("the internal element of addrs", addr, list, int)
                raise_if_false(geometry.num_tensors == len(addr),
                               f"cache_desc num_tensors:{geometry.num_tensors} should be equal to size of "
                               f"the internal element of addrs:{len(addr)}")
            raise_if_false(isinstance(addr, first_type),
                           "the type of the internal element of addrs should be consistent.")
        one_device = not isinstance(addrs[0], list)
        if one_device:
            raise_if_false(geometry.num_tensors == len(addrs), f"cache_desc num_tensors:{geometry.num_tensors} "
                           f"should be equal to size of addrs:{len(addrs)}")
        per_device = [list(addrs)] if one_device else [list(device) for device in addrs]
        cache = cls(-1, cache_desc, per_device[0], None, True, True)
        cache._geometry = geometry
        cache._per_device_tensor_addrs = per_device
        return cache


def _parse_key_args(args, kwargs, positional: List[str], required: List[str], max_params: int) -> dict:
    """CANN's key argument parsing: positional arguments fill ``positional`` in order (and win
    over a keyword of the same name), ``prompt_cluster_id`` stands for ``cluster_id``; the
    messages are CANN's."""
    raise_if_false(len(args) + len(kwargs) <= max_params, "Param num is over limit")
    values = dict(kwargs)
    values.update(zip(positional, args))
    raise_if_false("prompt_cluster_id" in values or "cluster_id" in values,
                   "Param prompt_cluster_id or cluster_id is required")
    for name in required:
        raise_if_false(name in values, f"Param {name} is required")
    for name in values:
        raise_if_false(name in positional or name == "prompt_cluster_id", f"Unsupported param:{name}")
    return values


class CacheKey:
    """Binds one row of a contiguous cache: ``CacheKey(cluster_id, req_id, model_id=0,
    prefix_id=2**64-1)``; ``prompt_cluster_id`` is accepted instead of ``cluster_id``. Raises
    ``LLMException(LLM_PARAM_INVALID)`` when ``req_id`` or the cluster id is missing or a
    keyword is unknown, ``TypeError``/``ValueError`` for values that are not uint64."""

    def __init__(self, *args, **kwargs) -> None:
        values = _parse_key_args(args, kwargs, ["cluster_id", "req_id", "model_id", "prefix_id"], ["req_id"], 4)
        self._cluster_id = check_uint64("cluster_id", values.get("cluster_id", values.get("prompt_cluster_id")))
        self._req_id = check_uint64("req_id", values["req_id"])
        self._model_id = check_uint64("model_id", values.get("model_id", 0))
        self._prefix_id = check_uint64("prefix_id", values.get("prefix_id", INVALID_ID))

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    prompt_cluster_id = cluster_id

    @property
    def req_id(self) -> int:
        return self._req_id

    @property
    def model_id(self) -> int:
        return self._model_id

    @property
    def prefix_id(self) -> int:
        return self._prefix_id

    def owner_key(self):
        """The key as its owner indexes it: (prefix_id or req_id, model_id); None for a placeholder."""
        if self._prefix_id != INVALID_ID:
            return ("prefix", self._prefix_id, self._model_id)
        if self._req_id != INVALID_ID:
            return ("req", self._req_id, self._model_id)
        return None

    def _fields(self):
        return (self._cluster_id, self._req_id, self._model_id, self._prefix_id)

    def __eq__(self, other) -> bool:
        return isinstance(other, CacheKey) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(("CacheKey",) + self._fields())

    def __repr__(self) -> str:
        return (f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, "
                f"prefix_id={self._prefix_id}, model_id={self._model_id})")


class CacheKeyByIdAndIndex:
    """Addresses a row of a peer's cache by cache_id: ``(cluster_id, cache_id, batch_index=0)``."""

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        self._cluster_id = check_uint64("cluster_id", cluster_id)
        self._cache_id = check_int64("cache_id", cache_id)
        self._batch_index = check_uint32("batch_index", batch_index)

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def cache_id(self) -> int:
        return self._cache_id

    @property
    def batch_index(self) -> int:
        return self._batch_index

    def __eq__(self, other) -> bool:
        return (isinstance(other, CacheKeyByIdAndIndex)
                and (self._cluster_id, self._cache_id, self._batch_index)
                == (other._cluster_id, other._cache_id, other._batch_index))

    def __hash__(self) -> int:
        return hash(("CacheKeyByIdAndIndex", self._cluster_id, self._cache_id, self._batch_index))

    def __repr__(self) -> str:
        return (f"CacheKeyByIdAndIndex(cluster_id={self._cluster_id}, cache_id={self._cache_id}, "
                f"batch_index={self._batch_index})")


class BlocksCacheKey:
    """Names a blocks cache: ``BlocksCacheKey(cluster_id, model_id=0)`` (keyword ``cluster_id``
    or ``prompt_cluster_id``). Its owner knows it by ``model_id`` alone."""

    def __init__(self, *args, **kwargs) -> None:
        values = _parse_key_args(args, kwargs, ["cluster_id", "model_id"], [], 2)
        self._cluster_id_name = "cluster_id" if "cluster_id" in values else "prompt_cluster_id"
        cluster_id, model_id = values[self._cluster_id_name], values.get("model_id", 0)
        check_isinstance("cluster_id", cluster_id, int, extra_fmt="The first param ")
        check_isinstance("model_id", model_id, int, extra_fmt="The second param ")
        self._cluster_id = check_uint64("cluster_id", cluster_id)
        self._model_id = check_uint64("model_id", model_id)

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    prompt_cluster_id = cluster_id

    @property
    def model_id(self) -> int:
        return self._model_id

    def __eq__(self, other) -> bool:
        return (isinstance(other, BlocksCacheKey)
                and (self._cluster_id, self._model_id) == (other._cluster_id, other._model_id))

    def __hash__(self) -> int:
        return hash(("BlocksCacheKey", self._cluster_id, self._model_id))

    def __repr__(self) -> str:
        return f"BlocksCacheKey({self._cluster_id_name}={self._cluster_id}, model_id={self._model_id})"


class MemInfo:
    """A memory range for ``remap_registered_memory``. The constructor checks types only, as
    CANN's does; the values are checked by ``remap_registered_memory``."""

    def __init__(self, mem_type: Memtype, addr: int, size: int) -> None:
        check_isinstance("mem_type", mem_type, Memtype)
        check_isinstance("addr", addr, int)
        check_isinstance("size", size, int)
        self._mem_type = mem_type
        self._addr = addr
        self._size = size

    @property
    def mem_type(self) -> Memtype:
        return self._mem_type

    @property
    def addr(self) -> int:
        return self._addr

    @property
    def size(self) -> int:
        return self._size

    def __str__(self) -> str:
        return f"MemInfo(mem_type={self._mem_type}, addr={self._addr}, size={self._size})"

    __repr__ = __str__


class LayerSynchronizer(ABC):
    """Tells ``transfer_cache_async`` when a layer's KV is ready to be sent."""

    @abstractmethod
    def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        """Wait until layer ``layer_index`` is computed; False aborts the transfer."""


def check_layer_range(name: str, layer_range: Optional[range], allow_none: bool = True) -> None:
    """CANN's ``check_layer_range``: a ``range`` with step 1 and ``0 <= start < stop``."""
    if layer_range is None and allow_none:
        return
    check_isinstance(name, layer_range, range, allow_none=allow_none)
    raise_if_false(layer_range.step == 1, f"check {name}.step == 1 failed")
    raise_if_false(0 <= layer_range.start < layer_range.stop,
                   f"check 0 <= range.start < range.stop failed, {name} = {layer_range}")


class TransferConfig:
    """Layer-wise transfer to raw destination addresses (K, V per layer, in order).

    Every setter checks its value as the constructor does (``TypeError``/``ValueError``, or
    ``LLMException(LLM_PARAM_INVALID)`` for a bad range); that ``dst_addrs`` holds two
    addresses per layer is checked by ``transfer_cache_async``."""

    def __init__(self, dst_cluster_id: int, dst_addrs: List[int], src_layer_range: Optional[range] = None,
                 src_batch_index: int = 0) -> None:
        check_uint64("dst_cluster_id", dst_cluster_id)
        self._check_dst_addrs(dst_addrs)
        check_layer_range("src_layer_range", src_layer_range)
        check_uint32("src_batch_index", src_batch_index)
        self._dst_cluster_id = dst_cluster_id
        self._dst_addrs = dst_addrs
        self._src_layer_range = src_layer_range
        self._src_batch_index = src_batch_index
        self.dst_layer_range = None

    @staticmethod
    def _check_dst_addrs(dst_addrs) -> None:
        check_isinstance("dst_addrs", dst_addrs, [list, tuple], int, allow_none=False)
        for addr in dst_addrs:
            check_uint64("dst_addrs", addr)

    @property
    def dst_cluster_id(self) -> int:
        return self._dst_cluster_id

    @dst_cluster_id.setter
    def dst_cluster_id(self, cluster_id: int) -> None:
        check_uint64("dst_cluster_id", cluster_id)
        self._dst_cluster_id = cluster_id

    @property
    def dst_addrs(self) -> List[int]:
        return self._dst_addrs

    @dst_addrs.setter
    def dst_addrs(self, dst_addrs: List[int]) -> None:
        self._check_dst_addrs(dst_addrs)
        self._dst_addrs = dst_addrs

    @property
    def src_layer_range(self) -> Optional[range]:
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, layer_range: Optional[range]) -> None:
        check_layer_range("src_layer_range", layer_range)
        self._src_layer_range = layer_range

    @property
    def src_batch_index(self) -> int:
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, batch_index: int) -> None:
        check_uint32("src_batch_index", batch_index)
        self._src_batch_index = batch_index

    def __repr__(self) -> str:
        return (f"TransferConfig(dst_cluster_id={self._dst_cluster_id}, dst_addrs={self._dst_addrs}, "
                f"src_layer_range={self._src_layer_range}, src_batch_index={self._src_batch_index})")


class TransferWithCacheKeyConfig:
    """Layer-wise transfer into a peer cache named by a key.

    The constructor needs both ranges, of equal span; the setters check as CANN's do (a range
    may then be set to None: all source layers, each into the same destination layer).
    ``dst_cluster_id`` is the key's cluster id at construction."""

    def __init__(self, cache_key: Union[BlocksCacheKey, CacheKeyByIdAndIndex], src_layer_range: range = None,
                 dst_layer_range: range = None, src_batch_index: int = 0) -> None:
        check_isinstance("cache_key", cache_key, [BlocksCacheKey, CacheKeyByIdAndIndex], allow_none=False)
        self._cache_key = cache_key
        check_layer_range("src_layer_range", src_layer_range, allow_none=False)
        self._src_layer_range = src_layer_range
        check_layer_range("dst_layer_range", dst_layer_range, allow_none=False)
        self._dst_layer_range = dst_layer_range
        raise_if_false(len(src_layer_range) == len(dst_layer_range),
                       "src_layer_range size should be equal to dst_layer_range size")
        check_uint32("src_batch_index", src_batch_index)
        raise_if_false(not isinstance(cache_key, BlocksCacheKey) or src_batch_index == 0,
                       "src_batch_index should be 0 when cache_key is BlocksCacheKey.")
        self._src_batch_index = src_batch_index
        self.dst_cluster_id = cache_key.cluster_id

    @property
    def cache_key(self) -> Union[BlocksCacheKey, CacheKeyByIdAndIndex]:
        return self._cache_key

    @cache_key.setter
    def cache_key(self, cache_key: Union[BlocksCacheKey, CacheKeyByIdAndIndex]) -> None:
        check_isinstance("cache_key", cache_key, [BlocksCacheKey, CacheKeyByIdAndIndex])
        self._cache_key = cache_key

    @property
    def src_layer_range(self) -> Optional[range]:
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, layer_range: Optional[range]) -> None:
        check_layer_range("src_layer_range", layer_range)
        self._src_layer_range = layer_range

    @property
    def dst_layer_range(self) -> Optional[range]:
        return self._dst_layer_range

    @dst_layer_range.setter
    def dst_layer_range(self, layer_range: Optional[range]) -> None:
        check_layer_range("dst_layer_range", layer_range)
        self._dst_layer_range = layer_range

    @property
    def src_batch_index(self) -> int:
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, src_batch_index: int) -> None:
        raise_if_false(not isinstance(self._cache_key, BlocksCacheKey) or src_batch_index == 0,
                       "src_batch_index should be 0 when cache_key is BlocksCacheKey.")
        check_uint32("src_batch_index", src_batch_index)
        self._src_batch_index = src_batch_index

    def __repr__(self) -> str:
        return (f"TransferWithCacheKeyConfig(cache_key={self._cache_key}, src_layer_range={self._src_layer_range}, "
                f"dst_layer_range={self._dst_layer_range}, src_batch_index={self._src_batch_index})")


class CacheTask:
    """Handle of a background layer-wise transfer (``transfer_cache_async``).

    ``CacheManager.transfer_cache_async`` makes it as ``CacheTask(thread, results)``. CANN's
    form, ``CacheTask(transfer_async_task)``, is taken too: the task is then any object with
    CANN's ``get(timeout)`` and ``get_results(timeout)`` (timeouts in seconds, None: no limit),
    such as ``llm_datadist.v2.llm_utils.TransferAsyncThread``, and both methods ask it."""

    def __init__(self, thread: threading.Thread, results: Optional[list] = None) -> None:
        self._thread = thread
        self._results = results

    @staticmethod
    def _seconds(timeout_in_millis: Optional[int]) -> Optional[float]:
        if timeout_in_millis is None:
            return None
        check_int32("timeout_in_millis", timeout_in_millis)
        return timeout_in_millis / 1000.0

    def _join(self, timeout_in_millis: Optional[int]) -> bool:
        self._thread.join(self._seconds(timeout_in_millis))
        return not self._thread.is_alive()

    def synchronize(self, timeout_in_millis: Optional[int] = None) -> LLMStatusCode:
        if self._results is None:  # CANN's form
            return self._thread.get(self._seconds(timeout_in_millis))
        if not self._join(timeout_in_millis):
            return LLMStatusCode.LLM_TIMEOUT
        for result in self._results:
            if result is not None and result != LLMStatusCode.LLM_SUCCESS:
                return result
        return LLMStatusCode.LLM_SUCCESS

    def get_results(self, timeout_in_millis: Optional[int] = None) -> List[Optional[LLMStatusCode]]:
        if self._results is None:  # CANN's form
            return self._thread.get_results(self._seconds(timeout_in_millis))
        if not self._join(timeout_in_millis):
            return [LLMStatusCode.LLM_TIMEOUT] * len(self._results)
        return list(self._results)
