"""``CacheManager``: the CANN v2 cache API (registration, allocation, local copies, transfers)."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

import numpy as np

from llm_datadist.engine import values
from llm_datadist.engine.engine import Engine
from llm_datadist._memory import Place
from llm_datadist._validate import (
    check_int64,
    check_isinstance,
    check_uint32,
    check_uint64,
    param_invalid,
    raise_if_false,
)
from llm_datadist.llm_types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    CacheTask,
    LayerSynchronizer,
    MemInfo,
    Memtype,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
    is_invalid_id,
    is_valid_id,
)
from llm_datadist.status import LLMException, LLMStatusCode

__all__ = ["CacheManager"]

_LAYER_KWARGS = frozenset({"src_layer_range", "dst_layer_range", "tensor_num_per_layer"})

# The API's Placement as the engine spells it (converted here, at the boundary).
_PLACEMENT = {Placement.HOST: Place.HOST, Placement.DEVICE: Place.DEVICE}


class CacheManager:
    """Cache operations of one initialized ``LLMDataDist`` (obtain it from ``cache_manager``).

    Errors: ``TypeError``/``ValueError`` for wrong argument types or C ranges,
    ``LLMException(LLM_PARAM_INVALID)`` for semantic checks, ``LLMException(<status>)`` for
    failures (e.g. ``LLM_KV_CACHE_NOT_EXIST`` for an unknown cache).
    """

    def __init__(self, llm_datadist, engine: "Engine", options: Dict[str, str]) -> None:
        self._llm_datadist = llm_datadist
        self._engine = engine
        self._initialized = True
        self._is_call_linked = False
        self._enabled_mem_pool = bool(options.get("llm.MemPoolConfig"))
        self._enable_host_mem_pool = bool(options.get("llm.HostMemPoolConfig"))
        self._enable_remote_cache_accessible = options.get("llm.EnableRemoteCacheAccessible", "0") == "1"
        # The engine's same-host block routes (``engine.routes.BlockRoutes``): push_blocks and
        # pull_blocks calls shaped like one that went through every check before take them;
        # anything else, and every error, takes the checked path below them.
        self._routes = engine.routes

    @staticmethod
    def check_cache_key(cache_key: CacheKey) -> None:
        """CANN's check of a ``CacheKey`` that names a peer's row: exactly one of ``req_id`` and
        ``prefix_id`` is set, else ``LLMException(LLM_PARAM_INVALID)`` with CANN's messages."""
        req_id, prefix_id = cache_key.req_id, cache_key.prefix_id
        raise_if_false(not (is_invalid_id(req_id) and is_invalid_id(prefix_id)),
                       f"one of req id and prefix id should contain valid value:[0, 2**64-1), "
                       f"req id:{req_id},prefix id:{prefix_id}.")
        raise_if_false(not (is_valid_id(req_id) and is_valid_id(prefix_id)),
                       f"only one of req id and prefix id should contain valid value:[0, 2**64-1), "
                       f"req id:{req_id}, prefix id:{prefix_id}.")

    # -- helpers ---------------------------------------------------------------------------------
    def _check_is_inited(self) -> None:
        if not self._initialized:
            raise LLMException("CacheManager is no longer initialized; obtain a new one after "
                               "LLMDataDist.init", status_code=LLMStatusCode.LLM_ENGINE_FINALIZED)

    def _mark_finalized(self) -> None:
        self._initialized = False
        self._routes = None

    def _record(self, cache: Cache):
        """The engine record behind ``cache``: what was recorded at registration or allocation,
        whatever the caller did to ``cache`` or its ``cache_desc`` since. A ``create_cpu_cache``
        cache gets a transient record from the geometry and addresses it was created with."""
        if cache.cache_id == -1:
            geometry = cache._geometry
            raise_if_false(geometry is not None and bool(cache._tensor_addrs),
                           "the cache has no tensors (was it released?)")
            return self._engine.transient(geometry.num_tensors, geometry.shape, geometry.data_type,
                                          _PLACEMENT[geometry.placement], cache._tensor_addrs,
                                          values.BLOCKS if cache.is_blocks_cache else values.CONTIGUOUS,
                                          geometry.batch_dim)
        return self._engine.lookup(cache.cache_id)

    @staticmethod
    def _is_kind(cache: Cache, record, blocks: bool) -> bool:
        """Whether ``cache`` is a blocks cache (``blocks``) or a contiguous one, as the caller's
        object says and as the engine recorded it: both must agree."""
        recorded = values.is_blocks(record) if blocks else values.is_rows(record)
        return cache.is_blocks_cache == blocks and recorded

    def _tensor_views(self, cache: Cache) -> list:
        self._check_is_inited()
        return self._engine.tensor_views(self._record(cache))

    def _remote_accessible(self, desc: CacheDesc, remote_accessible: Optional[bool]) -> bool:
        check_isinstance("remote_accessible", remote_accessible, bool)
        if remote_accessible is None:
            return desc.placement == Placement.DEVICE and not self._is_call_linked
        raise_if_false(not (remote_accessible and self._is_call_linked),
                       "remote_accessible=True is not allowed after link()")
        return remote_accessible

    @staticmethod
    def _check_register_args(cache_desc: CacheDesc, addrs) -> None:
        if cache_desc is None:
            raise AttributeError("cache_desc is None")
        check_isinstance("cache_desc", cache_desc, CacheDesc)
        check_isinstance("addrs", addrs, list, allow_none=False)
        raise_if_false(len(addrs) > 0, "addrs must not be empty")
        raise_if_false(len(addrs) == cache_desc.num_tensors,
                       f"{len(addrs)} addresses given but cache_desc.num_tensors is {cache_desc.num_tensors}")

    def _check_pool(self, cache_desc: CacheDesc) -> None:
        raise_if_false(cache_desc.num_tensors > 0, "num_tensors should be bigger than zero.")
        raise_if_false((self._enabled_mem_pool and cache_desc.placement == Placement.DEVICE)
                       or (self._enable_host_mem_pool and cache_desc.placement == Placement.HOST),
                       "configure a memory pool (mem_pool_cfg for DEVICE, host_mem_pool_cfg for "
                       "HOST) matching the cache placement before allocating")

    # -- registration ----------------------------------------------------------------------------
    def register_cache(self, cache_desc: CacheDesc, addrs: List[int],
                       cache_keys: Union[Tuple[CacheKey, ...], List[CacheKey]] = (),
                       remote_accessible: Optional[bool] = None) -> Cache:
        """Register caller-owned memory as a contiguous cache (row ``k`` bound to ``cache_keys[k]``).

        ``addrs`` is a list of tensor base addresses; numpy arrays and torch tensors are accepted
        too (their data pointers are used and they are kept alive while registered).
        """
        self._check_is_inited()
        self._check_register_args(cache_desc, addrs)
        check_isinstance("cache_keys", cache_keys, [list, tuple], CacheKey, allow_none=False)
        self._remote_accessible(cache_desc, remote_accessible)
        record = self._engine.register(cache_desc.num_tensors, cache_desc.shape, cache_desc.data_type,
                                       _PLACEMENT[cache_desc.placement], addrs, values.CONTIGUOUS,
                                       [key.owner_key() for key in cache_keys],
                                       batch_dim=cache_desc.batch_dim_index)
        return Cache(record.cache_id, cache_desc, record.addrs, self, True, False)

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: List[int],
                              blocks_cache_key: Optional[BlocksCacheKey] = None,
                              remote_accessible: Optional[bool] = None) -> Cache:
        """Register caller-owned memory as a blocks cache (``shape[0]`` = number of blocks); the
        key makes it reachable by peers as ``(this cluster, model_id)``."""
        self._check_is_inited()
        self._check_register_args(cache_desc, addrs)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        self._remote_accessible(cache_desc, remote_accessible)
        model_id = blocks_cache_key.model_id if blocks_cache_key is not None else None
        cache_desc._is_blocks = True  # as CANN marks it (v2.llm_utils.pack_cache_desc reads it)
        record = self._engine.register(cache_desc.num_tensors, cache_desc.shape, cache_desc.data_type,
                                       _PLACEMENT[cache_desc.placement], addrs, values.BLOCKS,
                                       blocks_model_id=model_id, batch_dim=cache_desc.batch_dim_index)
        return Cache(record.cache_id, cache_desc, record.addrs, self, True, True)

    def unregister_cache(self, cache_id: int) -> None:
        """Forget a registered cache (unknown ids succeed); the memory stays the caller's."""
        self._check_is_inited()
        check_isinstance("cache_id", cache_id, int, allow_none=False)
        check_int64("cache_id", cache_id)
        self._engine.unregister(cache_id)

    def remap_registered_memory(self, mem_infos: Union[MemInfo, List[MemInfo]]) -> None:
        """Re-map NIC registrations after an HBM fault: nothing to re-map without NIC registration
        here; the arguments are checked as CANN checks them."""
        self._check_is_inited()
        raise_if_false(isinstance(mem_infos, (list, MemInfo)),
                       f"mem_infos type only support list of MemInfo or MemInfo, but got {type(mem_infos)}.")
        for i, info in enumerate(mem_infos if isinstance(mem_infos, list) else [mem_infos]):
            raise_if_false(isinstance(info, MemInfo),
                           f"mem_infos[{i}] type only support MemInfo, but got {type(info)}.")
            raise_if_false(info.mem_type == Memtype.MEM_TYPE_DEVICE,
                           f"check mem_info.mem_type failed, only support Memtype.MEM_TYPE_DEVICE, index={i}.")
            raise_if_false(info.addr != 0, f"check mem_info.addr failed, addr can not be zero, index={i}.")
            raise_if_false(info.size > 0, f"check mem_info.size failed, size must be > 0, index={i}.")

    # -- allocation (deprecated in CANN, still supported) ----------------------------------------
    def allocate_cache(self, cache_desc: CacheDesc,
                       cache_keys: Union[Tuple[CacheKey, ...], List[CacheKey]] = ()) -> Cache:
        """Allocate a contiguous cache from the configured pool; row ``k`` is bound to
        ``cache_keys[k]`` (``req_id = 2**64-1`` leaves a row unbound)."""
        self._check_is_inited()
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("cache_keys", cache_keys, [list, tuple], CacheKey, allow_none=False)
        self._check_pool(cache_desc)
        record = self._engine.allocate(cache_desc.num_tensors, cache_desc.shape, cache_desc.data_type,
                                       _PLACEMENT[cache_desc.placement], values.CONTIGUOUS,
                                       [key.owner_key() for key in cache_keys],
                                       batch_dim=cache_desc.batch_dim_index)
        return Cache(record.cache_id, cache_desc, record.addrs, self, False, False)

    def allocate_blocks_cache(self, cache_desc: CacheDesc,
                              blocks_cache_key: Optional[BlocksCacheKey] = None) -> Cache:
        """Allocate a blocks cache from the configured pool."""
        self._check_is_inited()
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        self._check_pool(cache_desc)
        model_id = blocks_cache_key.model_id if blocks_cache_key is not None else None
        cache_desc._is_blocks = True  # as CANN marks it (v2.llm_utils.pack_cache_desc reads it)
        record = self._engine.allocate(cache_desc.num_tensors, cache_desc.shape, cache_desc.data_type,
                                       _PLACEMENT[cache_desc.placement], values.BLOCKS,
                                       blocks_model_id=model_id, batch_dim=cache_desc.batch_dim_index)
        return Cache(record.cache_id, cache_desc, record.addrs, self, False, True)

    def _release(self, cache: Cache, blocks: bool) -> None:
        self._engine.deallocate(cache.cache_id, blocks)
        cache._tensor_addrs = []
        cache._valid = False

    def deallocate_cache(self, cache: Cache) -> None:
        """Release an allocated contiguous cache (memory goes once no key is bound to it)."""
        self._check_is_inited()
        check_isinstance("cache", cache, Cache, allow_none=False)
        raise_if_false(not cache.is_blocks_cache, "deallocate_cache takes a contiguous cache; "
                       "use deallocate_blocks_cache for blocks caches")
        self._release(cache, False)

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        """Release an allocated blocks cache."""
        self._check_is_inited()
        check_isinstance("cache", cache, Cache, allow_none=False)
        raise_if_false(cache.is_blocks_cache, "deallocate_blocks_cache takes a blocks cache")
        self._release(cache, True)

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Unbind a key (no-op if unknown or bound to registered memory)."""
        self._check_is_inited()
        check_isinstance("cache_key", cache_key, CacheKey, allow_none=False)
        self._engine.remove_key(cache_key.owner_key())

    # -- local copies ------------------------------------------------------------------------------
    def copy_cache(self, dst: Cache, src: Cache, dst_batch_index: int = 0, src_batch_index: int = 0,
                   offset: int = 0, size: int = -1, req_id: Optional[int] = None) -> None:
        """Copy row ``src_batch_index`` of each tensor of ``src`` into row ``dst_batch_index`` of
        ``dst``, starting ``offset`` bytes into the rows, ``size`` bytes (-1 = rest of the row)."""
        self._check_is_inited()
        check_isinstance("dst", dst, Cache, allow_none=False)
        check_isinstance("src", src, Cache, allow_none=False)
        check_uint32("dst_batch_index", dst_batch_index)
        check_uint32("src_batch_index", src_batch_index)
        check_uint64("offset", offset)
        check_int64("size", size)
        raise_if_false(not src.is_blocks_cache, "copy_cache: src cache can not be a blocks cache")
        raise_if_false(not dst.is_blocks_cache, "copy_cache: dst cache can not be a blocks cache")
        raise_if_false(size == -1 or size > 0, f"copy_cache: size ({size}) must be -1 or > 0")
        if req_id is not None:
            check_uint64("req_id", req_id)
        dst_record, src_record = self._record(dst), self._record(src)
        raise_if_false(self._is_kind(src, src_record, False), "copy_cache: src cache can not be a blocks cache")
        raise_if_false(self._is_kind(dst, dst_record, False), "copy_cache: dst cache can not be a blocks cache")
        self._engine.copy_rows(dst_record, src_record, dst_batch_index, src_batch_index, offset, size)

    def copy_blocks(self, cache: Cache, copy_block_info: Dict[int, List[int]]) -> None:
        """Inside one blocks cache, copy block ``s`` to each block of ``copy_block_info[s]``."""
        self._check_is_inited()
        check_isinstance("cache", cache, Cache, allow_none=False)
        check_isinstance("copy_block_info", copy_block_info, dict, allow_none=False)
        # The core flattens a dict of plain ints in one pass; anything else is checked here, as
        # CANN checks it (the core then refuses what is out of range).
        arrays = values.block_map_arrays(copy_block_info, one_to_many=True)
        if arrays is None:
            for src_block, dst_blocks in copy_block_info.items():
                check_isinstance("copy_block_info key", src_block, int, allow_none=False)
                check_isinstance("copy_block_info value", dst_blocks, list, int, allow_none=False)
            arrays = ([s for s, dsts in copy_block_info.items() for _ in dsts],
                      [d for dsts in copy_block_info.values() for d in dsts])
        raise_if_false(cache.is_blocks_cache, "copy_blocks: cache should be a blocks cache")
        src_blocks, dst_blocks = arrays
        record = self._record(cache)
        raise_if_false(self._is_kind(cache, record, True), "copy_blocks: cache should be a blocks cache")
        self._engine.copy_blocks(record, record, src_blocks, dst_blocks)

    def swap_blocks(self, src_cache: Cache, dst_cache: Cache, src_to_dst: Dict[int, int]) -> None:
        """Copy blocks between a HOST and a DEVICE blocks cache (swap-in H->D, swap-out D->H).
        Works with ``Cache.create_cpu_cache`` staging caches."""
        self._check_is_inited()
        for name, cache in (("src_cache", src_cache), ("dst_cache", dst_cache)):
            if cache is None:
                raise AttributeError(f"{name} is None")
            check_isinstance(name, cache, Cache)
            raise_if_false(cache.is_blocks_cache, f"swap_blocks: {name} should be a blocks cache")
        arrays = values.block_map_arrays(src_to_dst)
        if arrays is None:
            check_isinstance("src_to_dst", src_to_dst, dict, int, allow_none=False)
            arrays = (list(src_to_dst.keys()), list(src_to_dst.values()))
        # Block size, block counts, tensor counts and placements all come from the records: the
        # geometry recorded when each cache was registered, allocated or created.
        src, dst = self._record(src_cache), self._record(dst_cache)
        for name, cache, record in (("src_cache", src_cache, src), ("dst_cache", dst_cache, dst)):
            raise_if_false(self._is_kind(cache, record, True), f"swap_blocks: {name} should be a blocks cache")
        self._engine.swap_blocks(src, dst, *arrays)

    # -- transfers between clusters ----------------------------------------------------------------
    @staticmethod
    def _remote_id(cluster_id: int) -> int:
        # This cluster's own id is a peer like any other once it has linked to its own listener
        # (as in CANN); until then the transfer fails with LLM_NOT_YET_LINK.
        return cluster_id

    @staticmethod
    def _layer_kwargs(kwargs: Dict) -> Tuple[Optional[range], Optional[range], int, Dict]:
        known = {"src_layer_range", "dst_layer_range", "tensor_num_per_layer"}
        rest = {k: v for k, v in kwargs.items() if k not in known}
        return (kwargs.get("src_layer_range"), kwargs.get("dst_layer_range"),
                kwargs.get("tensor_num_per_layer", 2), rest)

    @staticmethod
    def _check_tensor_num_per_layer(method: str, tensor_num_per_layer, num_tensors: int) -> None:
        """CANN's check: a uint32 (ValueError for -1), then > 0 (LLM_PARAM_INVALID)."""
        if type(tensor_num_per_layer) is int and 0 < tensor_num_per_layer <= 0xFFFFFFFF:
            return  # the common case, checked without the generic helpers (hot path)
        check_uint32("tensor_num_per_layer", tensor_num_per_layer)
        raise_if_false(tensor_num_per_layer > 0, f"[{method}] param check failed, tensor_num_per_layer "
                       f"({tensor_num_per_layer}) is invalid, should [1, {num_tensors}]")

    @staticmethod
    def _tensors(src_layer_range, dst_layer_range, tensor_num_per_layer):
        """Checks the layer arguments now; returns ``tensors(src_n, dst_n)`` for the engine."""
        if src_layer_range is None and dst_layer_range is None and type(tensor_num_per_layer) is int \
                and tensor_num_per_layer > 0:
            return values.whole_caches(tensor_num_per_layer)
        for name, value in (("src_layer_range", src_layer_range), ("dst_layer_range", dst_layer_range)):
            check_isinstance(name, value, range)
            if value is not None:
                raise_if_false(value.step == 1, f"{name} {value} must have step 1")
                raise_if_false(0 <= value.start < value.stop, f"{name} {value} must satisfy 0 <= start < stop")
        check_isinstance("tensor_num_per_layer", tensor_num_per_layer, int, allow_none=False)
        raise_if_false(tensor_num_per_layer > 0, f"tensor_num_per_layer must be > 0, got {tensor_num_per_layer}")
        if src_layer_range is None and dst_layer_range is None:
            return values.whole_caches(tensor_num_per_layer)

        return values.layer_tensors(src_layer_range, dst_layer_range, tensor_num_per_layer)

    @staticmethod
    def _block_list(name: str, blocks) -> np.ndarray:
        """A block list as the core's checked uint64 array. Only the container is checked here
        (a list, a tuple or an integer numpy array); the core reads every element once, with
        CANN's errors (TypeError for a non-integer or a bool, ValueError outside uint64)."""
        if type(blocks) is not list and type(blocks) is not tuple and not isinstance(blocks, np.ndarray):
            check_isinstance(name, blocks, [list, tuple], allow_none=False)
        return values.block_array(blocks, name, cann_errors=True)

    @staticmethod
    def _row_ref(key) -> "values.RemoteRef":
        """A remote row reference from a CacheKeyByIdAndIndex or a CacheKey."""
        if isinstance(key, CacheKeyByIdAndIndex):
            return values.CacheRowRef(key.cache_id, key.batch_index)
        CacheManager.check_cache_key(key)
        return values.KeyRef(key.owner_key())

    @staticmethod
    def _layer_target(cfg, src_layers: range) -> "values.LayerTarget":
        """A ``TransferConfig`` / ``TransferWithCacheKeyConfig`` as the engine's LayerTarget."""
        if isinstance(cfg, TransferConfig):
            return values.LayerTarget(cfg.dst_cluster_id, src_layers, cfg.src_batch_index,
                                       dst_addrs=tuple(cfg.dst_addrs))
        key = cfg.cache_key
        ref = (values.BlocksRef(key.model_id) if isinstance(key, BlocksCacheKey)
               else values.CacheRowRef(key.cache_id, key.batch_index))
        dst_start = None if cfg.dst_layer_range is None else cfg.dst_layer_range.start
        return values.LayerTarget(key.cluster_id, src_layers, cfg.src_batch_index, ref=ref,
                                   dst_layer_start=dst_start)

    def _local(self, cache: Cache, name: str):
        if cache is None:
            raise AttributeError(f"{name} is None")
        if type(cache) is not Cache:
            check_isinstance(name, cache, Cache, allow_none=False)
        return self._record(cache)

    def pull_cache(self, cache_key: Union[CacheKey, CacheKeyByIdAndIndex], cache: Cache,
                   batch_index: int = 0, size: int = -1, **kwargs) -> None:
        """Copy a peer's cache row into row ``batch_index`` of the local contiguous ``cache``.

        ``cache_key``: ``CacheKeyByIdAndIndex`` (remote cache id and row) or ``CacheKey`` (the
        row bound to that key; only without remote-cache-accessible mode, and pulling the whole
        row of an allocated cache releases the key). ``size``: bytes per tensor, -1 = one local
        row. Keyword arguments: ``src_layer_range``, ``dst_layer_range`` (ranges of layers),
        ``tensor_num_per_layer`` (default 2), ``src_cache_offset``/``dst_cache_offset`` (byte
        offsets inside the rows, -1 = 0). Raises ``LLMException`` with ``LLM_PARAM_INVALID``,
        ``LLM_NOT_YET_LINK``, ``LLM_KV_CACHE_NOT_EXIST``, ``LLM_TIMEOUT`` or ``LLM_LINK_FAILED``.
        """
        self._check_is_inited()
        check_isinstance("cache_key", cache_key, [CacheKey, CacheKeyByIdAndIndex], allow_none=False)
        if isinstance(cache_key, CacheKey) and self._enable_remote_cache_accessible:
            raise TypeError("pull_cache takes a CacheKeyByIdAndIndex when enable_remote_cache_accessible "
                            "is on, not a CacheKey")
        dst = self._local(cache, "cache")
        check_uint32("batch_index", batch_index)
        check_int64("size", size)
        src_range, dst_range, n, rest = self._layer_kwargs(kwargs)
        src_off = rest.pop("src_cache_offset", -1)
        dst_off = rest.pop("dst_cache_offset", -1)
        if rest:
            raise TypeError(f"pull_cache() got unexpected keyword arguments {sorted(rest)}")
        for name, value in (("src_cache_offset", src_off), ("dst_cache_offset", dst_off)):
            check_int64(name, value)
            raise_if_false(value >= -1, f"{name} must be -1 (unset) or >= 0, got {value}")
        raise_if_false(self._is_kind(cache, dst, False), "pull_cache: the destination must not be a blocks cache")
        raise_if_false(size == -1 or size > 0, f"pull_cache: size ({size}) must be -1 or > 0")
        self._check_tensor_num_per_layer("pull_cache", n, dst.num_tensors)
        raise_if_false(batch_index < dst.num_rows,
                       f"batch_index {batch_index} is out of range for a batch of {dst.num_rows}")
        raise_if_false(size <= dst.row_bytes, f"size {size} exceeds the row of {dst.row_bytes} bytes")
        tensors = self._tensors(src_range, dst_range, n)
        self._engine.pull_rows(self._remote_id(cache_key.cluster_id), self._row_ref(cache_key), dst,
                               batch_index, size, tensors, max(src_off, 0), max(dst_off, 0))

    def pull_blocks(self, src_cache_key: Union[BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex],
                    dst_cache: Cache, src_blocks: Union[List[int], Tuple[int, ...]] = (),
                    dst_blocks: Union[List[int], Tuple[int, ...]] = (), **kwargs) -> None:
        """Pull a peer's blocks into local blocks ``dst_blocks`` of the blocks cache ``dst_cache``.

        ``BlocksCacheKey(cluster_id, model_id)``: remote blocks ``src_blocks[k]`` ->
        ``dst_blocks[k]`` (equal lengths, equal block sizes). ``CacheKey`` or
        ``CacheKeyByIdAndIndex``: a remote contiguous row is cut into block-sized chunks, chunk
        ``k`` -> ``dst_blocks[k]`` (``src_blocks`` must be empty). Keyword arguments as in
        ``pull_cache``; errors as in ``pull_cache``.
        """
        routes = self._routes  # the latency path: a call like one that went through before
        if routes is not None and type(src_cache_key) is BlocksCacheKey and type(dst_cache) is Cache \
                and (not kwargs or kwargs.keys() <= _LAYER_KWARGS):
            route = routes.find(src_cache_key._cluster_id, src_cache_key._model_id, dst_cache._cache_id, False)
            if route is not None and dst_cache._is_blocks_cache and route.run(
                    src_blocks, dst_blocks, kwargs.get("src_layer_range"), kwargs.get("dst_layer_range"),
                    kwargs.get("tensor_num_per_layer", 2)):
                return
        self._check_is_inited()
        check_isinstance("src_cache_key", src_cache_key, [BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex],
                         allow_none=False)
        if isinstance(src_cache_key, CacheKey) and self._enable_remote_cache_accessible:
            raise TypeError("pull_blocks takes a BlocksCacheKey or CacheKeyByIdAndIndex when "
                            "enable_remote_cache_accessible is on, not a CacheKey")
        dst = self._local(dst_cache, "dst_cache")
        src_list = self._block_list("src_blocks", src_blocks)
        dst_list = self._block_list("dst_blocks", dst_blocks)
        src_range, dst_range, n, rest = self._layer_kwargs(kwargs)
        if rest:
            raise TypeError(f"pull_blocks() got unexpected keyword arguments {sorted(rest)}")
        raise_if_false(self._is_kind(dst_cache, dst, True), "pull_blocks: dst_cache must be a blocks cache")
        raise_if_false(len(dst_list) > 0, "pull_blocks: dst_blocks must not be empty")
        self._check_tensor_num_per_layer("pull_blocks", n, dst.num_tensors)
        tensors = self._tensors(src_range, dst_range, n)
        remote = self._remote_id(src_cache_key.cluster_id)
        if isinstance(src_cache_key, BlocksCacheKey):
            raise_if_false(len(src_list) > 0, "pull_blocks: src_blocks must not be empty")
            if len(src_list) != len(dst_list):
                raise param_invalid(f"pull_blocks: src_blocks has {len(src_list)} entries, "
                                    f"dst_blocks {len(dst_list)}")
            self._engine.pull_blocks(remote, values.BlocksRef(src_cache_key.model_id), dst,
                                     values.BlockSpec(src_list, dst_list), tensors, (src_range, dst_range, n))
        else:
            raise_if_false(len(src_list) == 0, "pull_blocks: src_blocks must be empty when pulling a "
                           "contiguous cache row into blocks")
            self._engine.pull_blocks(remote, self._row_ref(src_cache_key), dst, values.BlockSpec(None, dst_list),
                                     tensors)

    def _check_push_mode(self, method: str) -> None:
        if not self._enable_remote_cache_accessible:
            raise param_invalid(f"{method} is only supported while enable_remote_cache_accessible is True")

    def push_cache(self, dst_cache_key: Union[CacheKeyByIdAndIndex, CacheKey], src_cache: Cache,
                   src_batch_index: int = 0, src_layer_range: range = None, dst_layer_range: range = None,
                   size: int = -1, tensor_num_per_layer: int = 2) -> None:
        """Write row ``src_batch_index`` of the local contiguous ``src_cache`` into a peer's row:
        ``CacheKeyByIdAndIndex`` (remote cache id and row) or, as CANN's example writes it, a
        ``CacheKey`` resolved by the peer's table to the row bound to it. Layer ranges select the
        tensors (default all); ``size`` must be -1 (one row). Needs remote-cache-accessible mode.
        Raises like ``pull_cache``.
        """
        self._check_is_inited()
        self._check_push_mode("push_cache")
        check_isinstance("dst_cache_key", dst_cache_key, [CacheKeyByIdAndIndex, CacheKey], allow_none=False)
        check_isinstance("src_cache", src_cache, Cache, allow_none=False)
        src = self._local(src_cache, "src_cache")
        check_uint32("src_batch_index", src_batch_index)
        raise_if_false(self._is_kind(src_cache, src, False), "push_cache: src_cache must not be a blocks cache")
        self._check_tensor_num_per_layer("push_cache", tensor_num_per_layer, src.num_tensors)
        if src_layer_range is not None and dst_layer_range is not None:
            raise_if_false(len(src_layer_range) == len(dst_layer_range),
                           f"src_layer_range {src_layer_range} and dst_layer_range {dst_layer_range} "
                           f"must span the same number of layers")
        check_int64("size", size)
        raise_if_false(size == -1, f"push_cache: size must be -1 (one row), got {size}")
        raise_if_false(src_batch_index < src.num_rows,
                       f"src_batch_index {src_batch_index} is out of range for a batch of {src.num_rows}")
        tensors = self._tensors(src_layer_range, dst_layer_range, tensor_num_per_layer)
        self._engine.push_rows(self._remote_id(dst_cache_key.cluster_id), self._row_ref(dst_cache_key),
                               src, src_batch_index, tensors)

    def push_blocks(self, dst_cache_key: BlocksCacheKey, src_cache: Cache,
                    src_blocks: Union[List[int], Tuple[int, ...]] = (),
                    dst_blocks: Union[List[int], Tuple[int, ...]] = (), src_layer_range: range = None,
                    dst_layer_range: range = None, tensor_num_per_layer: int = 2) -> None:
        """Write local blocks ``src_blocks[k]`` of the blocks cache ``src_cache`` into blocks
        ``dst_blocks[k]`` of the peer's blocks cache registered under ``dst_cache_key.model_id``.
        Layer ranges select the tensors (default all). Needs remote-cache-accessible mode.
        Raises like ``pull_cache``."""
        routes = self._routes  # the latency path: a call like one that went through before
        if routes is not None and type(dst_cache_key) is BlocksCacheKey and type(src_cache) is Cache:
            route = routes.find(dst_cache_key._cluster_id, dst_cache_key._model_id, src_cache._cache_id, True)
            if route is not None and src_cache._is_blocks_cache and route.run(
                    src_blocks, dst_blocks, src_layer_range, dst_layer_range, tensor_num_per_layer):
                return
        self._check_is_inited()
        self._check_push_mode("push_blocks")
        if type(dst_cache_key) is not BlocksCacheKey:
            check_isinstance("dst_cache_key", dst_cache_key, BlocksCacheKey, allow_none=False)
        src = self._local(src_cache, "src_cache")
        src_list = self._block_list("src_blocks", src_blocks)
        dst_list = self._block_list("dst_blocks", dst_blocks)
        raise_if_false(self._is_kind(src_cache, src, True), "push_blocks: src_cache must be a blocks cache")
        raise_if_false(len(dst_list) > 0, "push_blocks: dst_blocks must not be empty")
        self._check_tensor_num_per_layer("push_blocks", tensor_num_per_layer, src.num_tensors)
        if len(src_list) != len(dst_list):
            raise param_invalid(f"push_blocks: src_blocks has {len(src_list)} entries, dst_blocks {len(dst_list)}")
        tensors = self._tensors(src_layer_range, dst_layer_range, tensor_num_per_layer)
        self._engine.push_blocks(self._remote_id(dst_cache_key.cluster_id), values.BlocksRef(dst_cache_key.model_id),
                                 src, values.BlockSpec(src_list, dst_list), tensors,
                                 (src_layer_range, dst_layer_range, tensor_num_per_layer))

    def transfer_cache_async(self, src_cache: Cache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs, src_block_indices=None, dst_block_indices=None,
                             dst_block_memory_size=None) -> CacheTask:
        """Layer by layer, wait for ``layer_synchronizer.synchronize_layer(L, None)`` and push
        layer ``L`` to every config that covers it, in a background thread. Returns a
        ``CacheTask``; results are per config (``None`` for a config whose last layer was never
        reached). docs/cann.md says how this differs from CANN's shipped quirks.

        As in CANN, non-empty ``src_block_indices`` move blocks to the ``dst_block_indices``;
        without them the source is read as rows: of a blocks cache, whose one row is its block 0
        (``src_batch_index`` must be 0), the layer's block 0 goes to the destination row, or with
        ``dst_block_indices`` its tensors are cut into ``dst_block_memory_size`` chunks.
        ``TypeError`` for a ``src_cache`` that is not a ``Cache`` (``None`` included).
        """
        self._check_is_inited()
        check_isinstance("src_cache", src_cache, Cache, allow_none=False)
        src = self._local(src_cache, "src_cache")
        raise_if_false(src.placement != Place.HOST, "src cache not support placement HOST")
        dst_arr = None if dst_block_indices is None else self._block_list("dst_block_indices", dst_block_indices)
        src_arr = None if src_block_indices is None else self._block_list("src_block_indices", src_block_indices)
        has_src, has_dst = src_arr is not None and len(src_arr) > 0, dst_arr is not None and len(dst_arr) > 0
        if dst_block_memory_size is not None:
            check_uint64("dst_block_memory_size", dst_block_memory_size)
        if has_src:
            raise_if_false(has_dst, "transfer from blocks to cache is not supported")
            raise_if_false(len(src_arr) == len(dst_arr),
                           f"num_block_indices mismatches, src_num = {len(src_arr)}, "
                           f"dst_num = {len(dst_arr)}")
        elif has_dst:
            raise_if_false(dst_block_memory_size is not None,
                           "dst_block_memory_size must be set when transfer from cache to blocks")
        check_isinstance("layer_synchronizer", layer_synchronizer, LayerSynchronizer, allow_none=False)
        wanted = TransferWithCacheKeyConfig if self._enable_remote_cache_accessible else TransferConfig
        check_isinstance("transfer_configs", transfer_configs, [list, tuple], wanted, allow_none=False,
                         extra_fmt="While enable_remote_cache_accessible is True, "
                         if self._enable_remote_cache_accessible else "")
        raise_if_false(has_dst or dst_block_memory_size in (None, 0),
                       f"dst_block_memory_size ({dst_block_memory_size}) is neither None nor 0 while "
                       f"dst is not blocks")
        raise_if_false(len(transfer_configs) > 0, "transfer_configs must not be empty")
        raise_if_false(src.num_tensors % 2 == 0, f"cache_desc.num_tensors ({src.num_tensors}) is not even")
        for cfg in transfer_configs:
            if cfg.src_layer_range is None:  # CANN fills in the default on the config itself
                cfg.src_layer_range = range(0, src.num_tensors // 2)
            if has_src:
                raise_if_false(cfg.src_batch_index == 0, f"Invalid TransferConfig, src_batch_index "
                               f"({cfg.src_batch_index}) != 0 while src is blocks")
        blocks = None
        if has_src:
            raise_if_false(self._is_kind(src_cache, src, True), "src_block_indices needs a blocks source cache")
            blocks = values.BlockSpec(src_arr, dst_arr, dst_block_memory_size or src.row_bytes)
        elif has_dst:
            raise_if_false(0 < dst_block_memory_size < src.tensor_bytes,
                           f"dst_block_memory_size ({dst_block_memory_size}) must be > 0 and < the tensor "
                           f"size ({src.tensor_bytes}) when transferring from a contiguous cache to blocks")
            blocks = values.BlockSpec(None, dst_arr, dst_block_memory_size)
        targets = [self._layer_target(cfg, cfg.src_layer_range) for cfg in transfer_configs]
        jobs = self._engine.layer_jobs(src, targets, blocks)
        thread, results = self._engine.start_layer_transfer(src, layer_synchronizer, jobs)
        return CacheTask(thread, results)
