"""``CacheManager``: the CANN v2 cache API (registration, allocation, local copies, transfers)."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

from llm_datadist import _engine
from llm_datadist._validate import (
    check_int64,
    check_isinstance,
    check_uint32,
    check_uint64,
    raise_if_false,
)
from llm_datadist.llm_types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    MemInfo,
    Memtype,
    Placement,
)
from llm_datadist.status import LLMException, LLMStatusCode

__all__ = ["CacheManager"]

_PLACEMENT = {Placement.HOST: _engine.HOST, Placement.DEVICE: _engine.DEVICE}


def _transport_missing(method: str) -> LLMException:
    return LLMException(f"{method} moves data between clusters; this build has no transport yet "
                        f"(inter-process transfers arrive with the transport layer)",
                        status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)


class CacheManager:
    """Cache operations of one initialized ``LLMDataDist`` (obtain it from ``cache_manager``).

    Errors: ``TypeError``/``ValueError`` for wrong argument types or C ranges,
    ``LLMException(LLM_PARAM_INVALID)`` for semantic checks, ``LLMException(<status>)`` for
    failures (e.g. ``LLM_KV_CACHE_NOT_EXIST`` for an unknown cache).
    """

    def __init__(self, llm_datadist, engine: "_engine.Engine", options: Dict[str, str]) -> None:
        self._llm_datadist = llm_datadist
        self._engine = engine
        self._initialized = True
        self._is_call_linked = False
        self._enabled_mem_pool = bool(options.get("llm.MemPoolConfig"))
        self._enable_host_mem_pool = bool(options.get("llm.HostMemPoolConfig"))
        self._enable_remote_cache_accessible = options.get("llm.EnableRemoteCacheAccessible", "0") == "1"

    # -- helpers ---------------------------------------------------------------------------------
    def _check_is_inited(self) -> None:
        if not self._initialized:
            raise LLMException("CacheManager is no longer initialized; obtain a new one after "
                               "LLMDataDist.init", status_code=LLMStatusCode.LLM_ENGINE_FINALIZED)

    def _mark_finalized(self) -> None:
        self._initialized = False

    def _record(self, cache: Cache):
        """The engine record behind ``cache`` (a transient one for ``create_cpu_cache`` caches)."""
        if cache.cache_id == -1:
            raise_if_false(bool(cache.tensor_addrs), "the cache has no tensors (was it released?)")
            desc = cache.cache_desc
            return self._engine.transient(desc.num_tensors, desc.shape, desc.data_type,
                                          _PLACEMENT[desc.placement], cache.tensor_addrs,
                                          _engine.BLOCKS if cache.is_blocks_cache else _engine.CONTIGUOUS)
        return self._engine.lookup(cache.cache_id)

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
                                       _PLACEMENT[cache_desc.placement], addrs, _engine.CONTIGUOUS,
                                       [key.owner_key() for key in cache_keys])
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
        record = self._engine.register(cache_desc.num_tensors, cache_desc.shape, cache_desc.data_type,
                                       _PLACEMENT[cache_desc.placement], addrs, _engine.BLOCKS,
                                       blocks_model_id=model_id)
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
                       f"mem_infos must be MemInfo or a list of MemInfo, got {type(mem_infos).__name__}")
        for i, info in enumerate(mem_infos if isinstance(mem_infos, list) else [mem_infos]):
            raise_if_false(isinstance(info, MemInfo), f"mem_infos[{i}] must be MemInfo")
            raise_if_false(info.mem_type == Memtype.MEM_TYPE_DEVICE,
                           f"mem_infos[{i}].mem_type must be MEM_TYPE_DEVICE")
            raise_if_false(info.addr != 0, f"mem_infos[{i}].addr must not be zero")
            raise_if_false(info.size > 0, f"mem_infos[{i}].size must be > 0")

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
                                       _PLACEMENT[cache_desc.placement], _engine.CONTIGUOUS,
                                       [key.owner_key() for key in cache_keys])
        return Cache(record.cache_id, cache_desc, record.addrs, self, False, False)

    def allocate_blocks_cache(self, cache_desc: CacheDesc,
                              blocks_cache_key: Optional[BlocksCacheKey] = None) -> Cache:
        """Allocate a blocks cache from the configured pool."""
        self._check_is_inited()
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        self._check_pool(cache_desc)
        model_id = blocks_cache_key.model_id if blocks_cache_key is not None else None
        record = self._engine.allocate(cache_desc.num_tensors, cache_desc.shape, cache_desc.data_type,
                                       _PLACEMENT[cache_desc.placement], _engine.BLOCKS,
                                       blocks_model_id=model_id)
        return Cache(record.cache_id, cache_desc, record.addrs, self, False, True)

    def _release(self, cache: Cache) -> None:
        self._engine.deallocate(cache.cache_id)
        cache._tensor_addrs = []
        cache._valid = False

    def deallocate_cache(self, cache: Cache) -> None:
        """Release an allocated contiguous cache (memory goes once no key is bound to it)."""
        self._check_is_inited()
        check_isinstance("cache", cache, Cache, allow_none=False)
        raise_if_false(not cache.is_blocks_cache, "deallocate_cache takes a contiguous cache; "
                       "use deallocate_blocks_cache for blocks caches")
        self._release(cache)

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        """Release an allocated blocks cache."""
        self._check_is_inited()
        check_isinstance("cache", cache, Cache, allow_none=False)
        raise_if_false(cache.is_blocks_cache, "deallocate_blocks_cache takes a blocks cache")
        self._release(cache)

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
        self._engine.copy_rows(self._record(dst), self._record(src), dst_batch_index,
                               src_batch_index, offset, size)

    def copy_blocks(self, cache: Cache, copy_block_info: Dict[int, List[int]]) -> None:
        """Inside one blocks cache, copy block ``s`` to each block of ``copy_block_info[s]``."""
        self._check_is_inited()
        check_isinstance("cache", cache, Cache, allow_none=False)
        check_isinstance("copy_block_info", copy_block_info, dict, allow_none=False)
        for src_block, dst_blocks in copy_block_info.items():
            check_isinstance("copy_block_info key", src_block, int, allow_none=False)
            check_isinstance("copy_block_info value", dst_blocks, list, int, allow_none=False)
        raise_if_false(cache.is_blocks_cache, "copy_blocks: cache should be a blocks cache")
        src_blocks = [s for s, dsts in copy_block_info.items() for _ in dsts]
        dst_blocks = [d for dsts in copy_block_info.values() for d in dsts]
        record = self._record(cache)
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
        check_isinstance("src_to_dst", src_to_dst, dict, int, allow_none=False)
        src_desc, dst_desc = src_cache.cache_desc, dst_cache.cache_desc
        src_block = src_desc.size // src_desc.batch_size
        dst_block = dst_desc.size // dst_desc.batch_size
        raise_if_false(src_block == dst_block,
                       f"src block size {src_block} and dst block size {dst_block} must be equal")
        raise_if_false(src_desc.num_tensors == dst_desc.num_tensors,
                       f"src num_tensors {src_desc.num_tensors} and dst num_tensors "
                       f"{dst_desc.num_tensors} must be equal")
        raise_if_false((src_desc.placement, dst_desc.placement)
                       in ((Placement.HOST, Placement.DEVICE), (Placement.DEVICE, Placement.HOST)),
                       f"swap from {src_desc.placement} to {dst_desc.placement} is not supported")
        self._engine.swap_blocks(self._record(src_cache), self._record(dst_cache),
                                 list(src_to_dst.keys()), list(src_to_dst.values()), src_block,
                                 src_desc.batch_size, dst_desc.batch_size)

    # -- transfers between clusters (transport layer) --------------------------------------------
    def pull_cache(self, cache_key: Union[CacheKey, CacheKeyByIdAndIndex], cache: Cache,
                   batch_index: int = 0, size: int = -1, **kwargs) -> None:
        self._check_is_inited()
        raise _transport_missing("pull_cache")

    def pull_blocks(self, src_cache_key, dst_cache: Cache, src_blocks=(), dst_blocks=(), **kwargs) -> None:
        self._check_is_inited()
        raise _transport_missing("pull_blocks")

    def push_cache(self, dst_cache_key, src_cache: Cache, src_batch_index: int = 0,
                   src_layer_range: range = None, dst_layer_range: range = None, size: int = -1,
                   tensor_num_per_layer: int = 2) -> None:
        self._check_is_inited()
        raise _transport_missing("push_cache")

    def push_blocks(self, dst_cache_key: BlocksCacheKey, src_cache: Cache, src_blocks=(), dst_blocks=(),
                    src_layer_range: range = None, dst_layer_range: range = None,
                    tensor_num_per_layer: int = 2) -> None:
        self._check_is_inited()
        raise _transport_missing("push_blocks")

    def transfer_cache_async(self, src_cache: Cache, layer_synchronizer, transfer_configs,
                             src_block_indices=None, dst_block_indices=None, dst_block_memory_size=None):
        self._check_is_inited()
        raise _transport_missing("transfer_cache_async")
