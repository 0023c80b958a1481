"""The engine: one per process, shared by the Python-style and the C++-style API.

Its values (references, block specs, records, pools) and option parsers are in ``values``.

It owns the cache registry (cache_id counter, keys, blocks keys), memory allocated per placement,
the device runtime and the links (``transport.links.LinkManager``), and turns local copy requests
into one core plan + one execution each. It speaks in plain values (placements as ``Place``,
shapes as tuples, remote caches as ``RemoteRef`` values, block lists as ``BlockSpec``) and raises
``LLMException`` carrying a status; each API style converts its own types at its boundary and
maps errors to its own surface. It imports nothing of either API style.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from llm_datadist import _core, _io, runtimes
from llm_datadist.runtimes import select_runtime
from llm_datadist._memory import Place, check_address_range, host_view, resolve_addresses
from llm_datadist._validate import is_instance_strict, param_invalid
from llm_datadist.data_type import DataType
from llm_datadist.engine.values import (
    BLOCKS, DEFAULT_SYNC_KV_TIMEOUT_MS, BlockSpec, BlocksRef, CacheRecord, CacheRowRef, KeyRef, LayerTarget,
    MemoryPool, RemoteRef, cache_geometry, is_blocks, is_rows, not_exist as _not_exist, parse_pool as _parse_pool,
)
from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.transport import comms
from llm_datadist.transport.links import LinkManager
from llm_datadist.transport.shm import SharedCounter

logger = logging.getLogger("llm_datadist")

#: How long ``finalize`` waits in all for the ``transfer_cache_async`` threads still running (a
#: transfer in flight ends at the link's timeout; a synchronizer that never returns is abandoned,
#: and its thread starts no transfer after it returns).
FINALIZE_JOIN_S = 10.0

_KIND_BY_PLACEMENT = {
    (Place.HOST, Place.HOST): _core.MEMCPY_HOST_TO_HOST,
    (Place.HOST, Place.DEVICE): _core.MEMCPY_HOST_TO_DEVICE,
    (Place.DEVICE, Place.HOST): _core.MEMCPY_DEVICE_TO_HOST,
    (Place.DEVICE, Place.DEVICE): _core.MEMCPY_DEVICE_TO_DEVICE,
}


def _needs_order(src: CacheRecord, dst: CacheRecord, src_blocks, dst_blocks) -> bool:
    """Device copies of one list run in parallel: a list whose result depends on its order --
    one that writes a block twice, or (in one cache) writes blocks it also reads -- runs one copy
    after another in list order instead, as the host path does."""
    written = [int(b) for b in dst_blocks]
    if len(set(written)) != len(written):
        return True
    return src is dst and not set(written).isdisjoint(int(b) for b in src_blocks)


_active_lock = threading.Lock()
_active_engine: Optional["Engine"] = None


class Engine:
    """Cache registry, memory and local transfers of one cluster (one process)."""

    def __init__(self, cluster_id: int, role: str) -> None:
        self.cluster_id = cluster_id
        self.role = role
        self.initialized = False
        self.options: Dict[str, str] = {}
        self.device_id = 0
        self.sync_kv_timeout_ms = DEFAULT_SYNC_KV_TIMEOUT_MS
        self.listen: Optional[Tuple[str, int]] = None
        self.runtime = None
        self.runtime_reason = ""
        self.pools: Dict[int, Optional[MemoryPool]] = {Place.HOST: None, Place.DEVICE: None}
        self._lock = threading.RLock()
        self._caches: Dict[int, CacheRecord] = {}
        self._keys: Dict[tuple, Tuple[CacheRecord, int]] = {}
        self._blocks_keys: Dict[int, CacheRecord] = {}
        self._next_cache_id = 1
        self._thread_state = threading.local()
        # Peers read the generation word (same-host plane) to notice memory leaving the registry;
        # TCP receives pin the shared ranges so memory is not released under them.
        self.generation_word = SharedCounter(1)
        self._shared_ranges = _io.RangeSet(())
        self._shared_device_ranges = _io.RangeSet(())
        self._pin_cond = threading.Condition()
        self._pinned: Dict[int, Tuple[Any, bool]] = {}
        self._pin_serial = 0
        self.protocol_errors = 0
        self.links: Optional[LinkManager] = None
        # Same-host block routes, the latency path of repeated block pushes/pulls:
        # (remote cluster id, model_id, local cache_id, push?) -> _io.BlockRoute. Built after a
        # checked transfer went through (``_learn_route``), dropped with the local cache and at
        # finalize; a route notices a closed link or a changed peer registry by itself.
        self.routes: Dict[tuple, Any] = {}
        self._async_threads: List[threading.Thread] = []
        self._stopping = threading.Event()

    # -- life cycle ----------------------------------------------------------------------------
    def initialize(self, options: Dict[str, str], device_id: int, sync_kv_timeout_ms: int,
                   listen: Optional[Tuple[str, int]]) -> None:
        """Claim the process's one engine slot, load the device runtime and bind the device."""
        global _active_engine
        with _active_lock:
            if self.initialized:
                return
            if _active_engine is not None:
                raise LLMException("another llm_datadist instance is already initialized in this "
                                   "process; finalize it first", status_code=LLMStatusCode.LLM_FAILED)
            pools = {Place.DEVICE: _parse_pool(options, "llm.MemPoolConfig"),
                     Place.HOST: _parse_pool(options, "llm.HostMemPoolConfig")}
            runtime, reason = select_runtime()
            runtime.set_device(device_id)
            self._thread_state = threading.local()
            self._thread_state.device_bound = True
            self._stopping = threading.Event()
            self.options = dict(options)
            self.device_id = device_id
            self.sync_kv_timeout_ms = sync_kv_timeout_ms
            self.listen = listen
            self.runtime, self.runtime_reason = runtime, reason
            self.pools = pools
            links = LinkManager(self)
            if listen is not None:
                links.start_listener(*listen)
            self.links = links
            self.initialized = True
            _active_engine = self
        logger.info("llm_datadist cluster %d (%s) initialized on %s device %d", self.cluster_id,
                    self.role, runtime.name, device_id)

    def finalize(self) -> None:
        """Wait (bounded) for the ``transfer_cache_async`` threads, which start nothing more, then
        close the links and drop every cache (allocated memory is freed once no numpy view holds
        it)."""
        global _active_engine
        with _active_lock:
            if not self.initialized:
                return
            self._stop_async_threads()
            with self._lock:
                self.routes.clear()
            # Memory is leaving: peers on the same-host plane see the generation move and stop
            # writing through their copy of our table.
            self.generation_word.value = self.generation_word.value + 1
            if self.links is not None:
                self.links.close()
            self.generation_word.close()
            with self._lock:
                for record in self._caches.values():
                    self._unpin_host(record)
                self._caches.clear()
                self._keys.clear()
                self._blocks_keys.clear()
                self._shared_ranges = _io.RangeSet(())
                self._shared_device_ranges = _io.RangeSet(())
                for pool in self.pools.values():
                    if pool is not None:
                        pool.used = 0
            self.initialized = False
            if _active_engine is self:
                _active_engine = None

    # -- registry ------------------------------------------------------------------------------
    def _new_record(self, num_tensors: int, shape: Tuple[int, ...], nbytes: int, data_type: DataType,
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
        layout = _core.CacheLayout(addrs, shape[0], nbytes // shape[0])
        return CacheRecord(cache_id, num_tensors, shape, data_type, Place(placement), kind,
                           list(addrs), nbytes, layout, registered, batch_dim)

    def _checked_keys(self, record: CacheRecord, owner_keys: Sequence[Optional[tuple]]) -> List[tuple]:
        """``(row, key)`` for the row keys to bind (k-th key -> row k; None = placeholder), after
        checking that none is bound already (lock held)."""
        if len(owner_keys) > record.num_rows:
            raise param_invalid(f"{len(owner_keys)} cache keys given for a batch of {record.num_rows}")
        seen = set()
        for key in owner_keys:
            if key is None:
                continue
            if key in seen or key in self._keys:
                raise param_invalid(f"cache key {key} is already bound")
            seen.add(key)
        return [(row, key) for row, key in enumerate(owner_keys) if key is not None]

    def _commit(self, record: CacheRecord, owner_keys, blocks_model_id) -> CacheRecord:
        """Enter ``record`` into the registry: everything that can fail (key checks, the new
        shared ranges) happens before the first table changes, so a failure leaves the registry
        and the ranges peers may touch exactly as they were."""
        with self._lock:
            keys = self._checked_keys(record, owner_keys)
            ranges = self._ranges_of([*self._caches.values(), record])
            record.cache_id = self._next_cache_id
            self._next_cache_id += 1
            self._caches[record.cache_id] = record
            for row, key in keys:
                self._keys[key] = (record, row)
                record.owner_keys.add(key)
            if blocks_model_id is not None:
                self._blocks_keys[blocks_model_id] = record
            self._shared_ranges, self._shared_device_ranges = ranges
        if self.links is not None:
            self.links.registered(record)  # the data planes hear of it (transport.engine_view)
        return record

    def register(self, num_tensors: int, shape: Sequence[int], data_type: DataType, placement: Place,
                 addrs: Sequence[Any], kind: str, owner_keys: Sequence[Optional[tuple]] = (),
                 blocks_model_id: Optional[int] = None, batch_dim: int = 0) -> CacheRecord:
        """Register caller-owned memory (ints, numpy arrays or torch tensors) as a cache."""
        self.check_initialized()
        if not addrs:
            raise param_invalid("addrs must not be empty")
        shape, nbytes = cache_geometry(shape, data_type)
        resolved, keepalive = resolve_addresses(addrs, nbytes, self.runtime.name,
                                                runtimes.tensor_devices(self.runtime.name))
        record = self._new_record(num_tensors, shape, nbytes, data_type, placement, kind, resolved, True, -1,
                                  batch_dim)
        record.keepalive = keepalive
        if record.placement == Place.HOST:
            record.pinned_addrs = self._pin_host(resolved, nbytes)
        try:
            return self._commit(record, owner_keys, blocks_model_id)
        except BaseException:
            self._unpin_host(record)
            raise

    def _pin_host(self, addrs: Sequence[int], nbytes: int) -> List[int]:
        """Page-lock the tensors of a registered HOST cache for a device runtime whose memory the
        host cannot address (``cudaHostRegister``), so swaps and staged transfers copy them at
        full speed; tensors the runtime refuses (already page-locked, say) stay as they are."""
        runtime = self.runtime
        if runtime.host_addressable:
            return []
        self._bind_thread()
        return [addr for addr in addrs if runtime.host_register(addr, nbytes)]

    def _unpin_host(self, record: CacheRecord) -> None:
        pinned, record.pinned_addrs = record.pinned_addrs, []
        for addr in pinned:
            self.runtime.host_unregister(addr)

    def allocate(self, num_tensors: int, shape: Sequence[int], data_type: DataType, placement: Place,
                 kind: str, owner_keys: Sequence[Optional[tuple]] = (),
                 blocks_model_id: Optional[int] = None, batch_dim: int = 0) -> CacheRecord:
        """Allocate ``num_tensors`` tensors (device memory through the runtime; host and cpu-runtime
        memory starts zeroed, acl/cuda device memory is uninitialised as aclrtMalloc's is)."""
        self.check_initialized()
        self._bind_thread()
        if num_tensors <= 0:
            raise param_invalid(f"num_tensors must be > 0, got {num_tensors}")
        shape, nbytes = cache_geometry(shape, data_type)
        total = nbytes * num_tensors
        pool = self.pools.get(placement)
        with self._lock:
            if pool is not None:
                if pool.used + total > pool.capacity:
                    raise LLMException(f"memory pool exhausted: {total} bytes asked, "
                                       f"{pool.capacity - pool.used} of {pool.capacity} free",
                                       status_code=LLMStatusCode.LLM_OUT_OF_MEMORY)
                pool.used += total
        try:
            # HOST caches of a device runtime are page-locked memory from it (cudaMallocHost,
            # aclrtMallocHost): what its copies reach at full speed.
            pinned = placement == Place.HOST and not self.runtime.host_addressable
            allocations = [_core.Allocation(self.runtime, nbytes, placement == Place.DEVICE, pinned)
                           for _ in range(num_tensors)]
            record = self._new_record(num_tensors, shape, nbytes, data_type, placement, kind,
                                      [a.addr for a in allocations], False, -1, batch_dim)
            record.allocations = allocations
            record.pool_bytes = total if pool is not None else 0
            return self._commit(record, owner_keys, blocks_model_id)
        except BaseException:
            if pool is not None:
                with self._lock:
                    pool.used -= total
            raise

    def transient(self, num_tensors: int, shape: Sequence[int], data_type: DataType, placement: Place,
                  addrs: Sequence[int], kind: str, batch_dim: int = 0) -> CacheRecord:
        """A record for memory the engine does not track (``Cache.create_cpu_cache``)."""
        shape, nbytes = cache_geometry(shape, data_type)
        return self._new_record(num_tensors, shape, nbytes, data_type, placement, kind, list(addrs), True, -1,
                                batch_dim)

    def lookup(self, cache_id: int) -> CacheRecord:
        with self._lock:
            record = self._caches.get(cache_id)
        if record is None or record.id_released:
            raise _not_exist(f"cache_id {cache_id} is not registered or allocated in cluster "
                             f"{self.cluster_id}")
        return record

    def _prepare_drop(self, record: CacheRecord) -> Tuple[Any, Any]:
        """What the registry looks like without ``record``: ``((shared host ranges, shared device
        ranges), its memory)``,
        computed before anything changes, as everything that can fail (lock held)."""
        ranges = self._ranges_of([r for r in self._caches.values() if r is not record])
        removed = _io.RangeSet((addr, record.tensor_bytes) for addr in record.addrs)
        return ranges, removed

    def _drop(self, record: CacheRecord, prepared: Optional[Tuple[Any, Any]] = None) -> Any:
        """Remove a record and everything that names it (lock held); returns its memory as a
        RangeSet for ``_wait_unpinned``. Nothing changes if this raises."""
        ranges, removed = prepared if prepared is not None else self._prepare_drop(record)
        self._caches.pop(record.cache_id, None)
        for key in [k for k in self.routes if k[2] == record.cache_id]:
            del self.routes[key]
        for key in record.owner_keys:
            self._keys.pop(key, None)
        record.owner_keys.clear()
        for model_id in [m for m, r in self._blocks_keys.items() if r is record]:
            del self._blocks_keys[model_id]
        pool = self.pools.get(record.placement)
        if pool is not None and record.pool_bytes:
            pool.used -= record.pool_bytes
            record.pool_bytes = 0
        self.generation_word.value = self.generation_word.value + 1
        self._shared_ranges, self._shared_device_ranges = ranges
        if self.links is not None:
            self.links.unregistered(record)
        self._unpin_host(record)
        return removed

    def deallocate(self, cache_id: int, blocks: Optional[bool] = None) -> None:
        """Drop the id reference of an allocated cache; memory goes when no key is bound to it.
        ``blocks``: the kind the caller means (None = either); the record must be of it."""
        self.check_initialized()
        with self._lock:
            record = self._caches.get(cache_id)
            if record is None or record.id_released:
                return
            if record.registered:
                raise param_invalid(f"cache {cache_id} is registered memory; use unregister_cache")
            if blocks is not None and not (is_blocks(record) if blocks else is_rows(record)):
                raise param_invalid(f"cache {cache_id} is a {'contiguous' if blocks else 'blocks'} cache; "
                                    f"use {'deallocate_cache' if blocks else 'deallocate_blocks_cache'}")
            if record.owner_keys:
                record.id_released = True
                return
            removed = self._drop(record)
        self._wait_unpinned(removed)

    def unregister(self, cache_id: int) -> None:
        self.check_initialized()
        with self._lock:
            record = self._caches.get(cache_id)
            if record is None:
                return
            if not record.registered:
                raise param_invalid(f"cache {cache_id} was allocated; use deallocate_cache")
            removed = self._drop(record)
        self._wait_unpinned(removed)

    def remove_key(self, owner_key: Optional[tuple]) -> None:
        self.check_initialized()
        with self._lock:
            entry = self._keys.get(owner_key)
            if entry is None or entry[0].registered:
                return
            record = entry[0]
            last = record.id_released and record.owner_keys == {owner_key}
            prepared = self._prepare_drop(record) if last else None
            del self._keys[owner_key]
            record.owner_keys.discard(owner_key)
            self.generation_word.value = self.generation_word.value + 1
            if not last:
                return
            removed = self._drop(record, prepared)
        self._wait_unpinned(removed)

    def find_key(self, owner_key: tuple) -> Tuple[CacheRecord, int]:
        with self._lock:
            entry = self._keys.get(owner_key)
        if entry is None:
            raise _not_exist(f"no cache is bound to key {owner_key} in cluster {self.cluster_id}")
        return entry

    def find_blocks_key(self, model_id: int) -> CacheRecord:
        with self._lock:
            record = self._blocks_keys.get(model_id)
        if record is None:
            raise _not_exist(f"no blocks cache is registered with model_id {model_id} in cluster "
                             f"{self.cluster_id}")
        return record

    # -- what peers see ----------------------------------------------------------------------------
    def _ranges_of(self, records) -> Tuple[Any, Any]:
        """The memory peers may read or write with ``records`` registered, as two RangeSets:
        the tensors of those caches that the host can address (moved by any plane), and the
        others, device memory of a runtime whose memory the host cannot address (moved by
        staging it through host memory: ``transport.staging``)."""
        host = [(addr, record.tensor_bytes) for record in records if not self.device_only(record)
                for addr in record.addrs]
        device = [(addr, record.tensor_bytes) for record in records if self.device_only(record)
                  for addr in record.addrs]
        return _io.RangeSet(host), _io.RangeSet(device)

    def device_only(self, record: CacheRecord) -> bool:
        """Whether a cache is device memory that the host cannot address (cuda, acl)."""
        return record.placement == Place.DEVICE and self.runtime is not None and not self.runtime.host_addressable

    @contextlib.contextmanager
    def pinned(self, plan, dst_side: bool):
        """``(shared host ranges, registry generation, shared device ranges)``, held while a
        peer's bytes move through the ``dst_side`` (or source) ranges of ``plan``: memory they
        touch does not leave the registry until they are done."""
        with self._pin_cond:
            self._pin_serial += 1
            token = self._pin_serial
            self._pinned[token] = (plan, dst_side)
            ranges, device = self._shared_ranges, self._shared_device_ranges
            generation = self.generation_word.value
        try:
            yield ranges, generation, device
        finally:
            with self._pin_cond:
                del self._pinned[token]
                self._pin_cond.notify_all()

    def _wait_unpinned(self, removed, timeout: float = 90.0) -> None:
        """Wait until no transfer pinned before now touches the ``removed`` ranges (transfers
        into other memory, and later ones, which are refused these ranges, do not hold it up).
        A stalled peer's transfer ends at the frame timeout, well inside ``timeout``."""
        with self._pin_cond:
            waiting = {token for token, (plan, side) in self._pinned.items() if removed.overlaps(plan, side)}
            self._pin_cond.wait_for(lambda: not waiting.intersection(self._pinned), timeout)

    def count_protocol_error(self) -> None:
        with self._lock:
            self.protocol_errors += 1

    def export_table(self) -> Dict[str, Any]:
        """This cluster's cache table as peers receive it (see transport.table)."""
        with self._lock:
            caches = [[r.cache_id, r.kind, int(r.placement), r.num_tensors, r.num_rows, r.row_bytes,
                       list(r.addrs), not self.device_only(r)] for r in self._caches.values()]
            blocks = [[model_id, r.cache_id] for model_id, r in self._blocks_keys.items()]
            keys = [[key[0], key[1], key[2], r.cache_id, row, not r.registered]
                    for key, (r, row) in self._keys.items()]
            generation = self.generation_word.value
        return {"generation": generation, "caches": caches, "blocks": blocks, "keys": keys}

    def consume_key(self, owner_key: tuple, tensors: Sequence[int]) -> bool:
        """A peer pulled ``tensors`` of the row bound to ``owner_key``: once every tensor of the
        row has been pulled, the key of an allocated cache is released (prefix keys never are).
        Returns whether it was released."""
        with self._lock:
            entry = self._keys.get(owner_key)
            if entry is None or entry[0].registered or owner_key[0] == "prefix":
                return False
            record = entry[0]
            delivered = record.delivered.setdefault(owner_key, set())
            delivered.update(t for t in tensors if 0 <= t < record.num_tensors)
            if len(delivered) < record.num_tensors:
                return False
            record.delivered.pop(owner_key, None)
        self.remove_key(owner_key)
        return True

    def switch_role(self, role_name: str, listen: Optional[Tuple[str, int]]) -> None:
        """Shared by both API styles: refuse while linked, then move (or stop) the listener."""
        self.check_initialized()
        if self.links.has_links():
            raise LLMException(f"cluster {self.cluster_id} still has links to "
                               f"{self.links.linked_clusters()}; unlink them before switching role",
                               status_code=LLMStatusCode.LLM_EXIST_LINK)
        current = self.links.listen_address
        if listen is None:
            self.links.stop_listener()
        elif current is None or listen != self.listen or listen[1] == 0:
            self.links.start_listener(*listen)
        self.listen = listen
        self.role = role_name

    # -- links (what the API styles, the demo and the vLLM connector use of them) -----------------
    @property
    def listen_address(self) -> Optional[Tuple[str, int]]:
        """``(ip, port)`` actually listened on (port 0 resolved), None when not listening or not
        initialized."""
        return self.links.listen_address if self.initialized else None

    def lost_links(self) -> Dict[int, str]:
        """Clusters whose link ended without an unlink here, with the reason (empty before init)."""
        return self.links.lost_links() if self.initialized else {}

    def link_many(self, targets: Sequence[Tuple[int, str, int]], timeout_ms: int) -> List[LLMStatusCode]:
        """Link to each ``(cluster_id, ip, port)`` in parallel; one status per target."""
        self.check_initialized()
        return self.links.link_many(targets, timeout_ms)

    def unlink_many(self, cluster_ids: Sequence[int], timeout_ms: int, force: bool) -> List[LLMStatusCode]:
        """Drop the links to ``cluster_ids`` (non-forced: the peer is told first)."""
        self.check_initialized()
        return self.links.unlink_many(cluster_ids, timeout_ms, force)

    def data_plane(self, remote_id: int, timeout_ms: int = 5000, local_device: bool = False,
                   remote_device: bool = False) -> str:
        """The data plane transfers to ``remote_id`` use: the link's (chosen when it was made), or
        with device memory the host cannot address on the local or remote side, the link's device
        plane for that combination (chosen now if not yet)."""
        self.check_initialized()
        return self.links.data_plane(remote_id, timeout_ms, local_device, remote_device)

    def set_notify_handler(self, handler: Optional[Callable]) -> None:
        """Answer peers' notifications with ``handler(peer_cluster_id, message) -> reply`` (None
        refuses them). Removing the handler also works after ``finalize``."""
        if handler is not None:
            self.check_initialized()
        if self.links is not None:
            self.links.set_notify_handler(handler)

    def notify(self, remote_id: int, message: Any, timeout_ms: int) -> Any:
        """Send ``message`` to a linked peer's notify handler; returns its answer."""
        self.check_initialized()
        return self.links.notify(remote_id, message, timeout_ms)

    def comm_count(self) -> int:
        """How many two-sided links (``link(comm_name, ...)``) exist now."""
        self.check_initialized()
        return len(self.links.comms)

    def join_comm(self, comm_name: str, cluster_rank_info: Dict[int, int], rank_table: str) -> int:
        """Make this member's part of a two-sided link and wait until every member has linked
        (``llm.LinkTotalTime`` seconds, else ``HCCL_CONNECT_TIMEOUT``, else the default);
        returns the comm id. ``LLM_LINK_FAILED`` if a member does not link in time."""
        self.check_initialized()
        members = comms.parse(rank_table, cluster_rank_info, comms.port_base(self.options))
        me = next(m for m in members if m.cluster_id == self.cluster_id)
        digest = comms.digest(comm_name, rank_table, cluster_rank_info)
        comm = self.links.new_comm(comm_name, (comm_name, digest), members, me)
        total_s = int(self.options.get("llm.LinkTotalTime", "0") or 0) or int(
            os.environ.get("HCCL_CONNECT_TIMEOUT", comms.DEFAULT_LINK_TOTAL_S))
        self.links.join_comm(comm, total_s * 1000)
        return comm.comm_id

    def leave_comm(self, comm_id: int) -> None:
        """Drop a two-sided link; ``LLM_NOT_YET_LINK`` for an unknown id."""
        self.check_initialized()
        self.links.leave_comm(comm_id, self.sync_kv_timeout_ms)

    def comm_status(self, comm_id: int) -> str:
        """``"PREPARING"``, ``"OK"`` or ``"FAILED"`` for a two-sided link."""
        self.check_initialized()
        return self.links.comm(comm_id).status

    def check_initialized(self) -> None:
        if not self.initialized:
            raise LLMException("llm_datadist is not initialized", status_code=LLMStatusCode.LLM_FAILED)

    # -- views -----------------------------------------------------------------------------------
    def tensor_views(self, record: CacheRecord) -> list:
        """Zero-copy numpy views of a record's tensors (host-addressable memory only)."""
        if record.placement == Place.DEVICE and not self.runtime.host_addressable:
            raise LLMException(f"device memory of the {self.runtime.name} runtime cannot be viewed "
                               f"from the host", status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        owners = record.allocations or record.keepalive or [None] * record.num_tensors
        return [host_view(addr, record.tensor_bytes, owner, record.data_type, record.shape)
                for addr, owner in zip(record.addrs, owners)]

    # -- local transfers -------------------------------------------------------------------------
    def _bind_thread(self) -> None:
        """ACL contexts and the CUDA current device belong to a thread: bind each thread that
        allocates or copies to the engine's device once."""
        if getattr(self._thread_state, "device_bound", False):
            return
        self.runtime.set_device(self.device_id)
        self._thread_state.device_bound = True

    def bind_thread(self) -> None:
        """For the transport (``EngineView``): bind the calling thread to the engine's device
        before it copies device memory through ``self.runtime``."""
        self._bind_thread()

    def _run(self, plan, src: CacheRecord, dst: CacheRecord, blocks: Optional[tuple] = None) -> None:
        """Run ``plan``; ``blocks`` = ``(src_blocks, dst_blocks)`` of a block copy, whose order is
        kept (``_needs_order``) where the runtime would run the list in parallel."""
        self._bind_thread()
        kind = _KIND_BY_PLACEMENT[(src.placement, dst.placement)]
        # Host copies and synchronous runtimes run in list order anyway: no need to look.
        ordered = (blocks is not None and kind != _core.MEMCPY_HOST_TO_HOST and self.runtime.async_copy
                   and _needs_order(src, dst, *blocks))
        _core.execute(plan, self.runtime, kind, ordered=ordered)

    def copy_rows(self, dst: CacheRecord, src: CacheRecord, dst_row: int, src_row: int,
                  offset: int, size: int) -> None:
        """Copy row ``src_row`` of every tensor of ``src`` into row ``dst_row`` of ``dst``, from
        ``offset`` on, ``size`` bytes (-1 = rest of the source row)."""
        self.check_initialized()
        if src.num_tensors != dst.num_tensors:
            raise param_invalid(f"source has {src.num_tensors} tensors, destination {dst.num_tensors}")
        plan = _core.plan_rows(src.layout, dst.layout, None, None, src_row, dst_row, offset, offset, size)
        self._run(plan, src, dst)

    def copy_blocks(self, src: CacheRecord, dst: CacheRecord, src_blocks, dst_blocks,
                    block_bytes: int = -1) -> None:
        """Copy blocks ``src_blocks[k]`` -> ``dst_blocks[k]`` of every tensor, in list order."""
        self.check_initialized()
        if src.num_tensors != dst.num_tensors:
            raise param_invalid(f"source has {src.num_tensors} tensors, destination {dst.num_tensors}")
        plan = _core.plan_blocks(src.layout, dst.layout, None, None, src_blocks, dst_blocks, block_bytes)
        self._run(plan, src, dst, (src_blocks, dst_blocks))

    @staticmethod
    def swap_geometry(record: CacheRecord) -> Tuple[int, int]:
        """``(blocks, block bytes)`` of a cache as swap_blocks sees it: the blocks are
        ``shape[batch_dim]`` and one block is ``tensor bytes // blocks``, as recorded."""
        blocks = record.shape[record.batch_dim]
        return blocks, record.tensor_bytes // blocks

    def swap_blocks(self, src: CacheRecord, dst: CacheRecord, src_blocks, dst_blocks) -> None:
        """Copy blocks between a host and a device cache, block ``src_blocks[k]`` to
        ``dst_blocks[k]`` of every tensor, with the geometry recorded for each cache."""
        self.check_initialized()
        (src_count, src_block), (dst_count, dst_block) = self.swap_geometry(src), self.swap_geometry(dst)
        if src_block != dst_block:
            raise param_invalid(f"src block size {src_block} and dst block size {dst_block} must be equal")
        if src.num_tensors != dst.num_tensors:
            raise param_invalid(f"src num_tensors {src.num_tensors} and dst num_tensors "
                                f"{dst.num_tensors} must be equal")
        if (src.placement, dst.placement) not in ((Place.HOST, Place.DEVICE), (Place.DEVICE, Place.HOST)):
            raise param_invalid(f"swap from placement {src.placement} to {dst.placement} is not "
                                f"supported: one side must be HOST and the other DEVICE")
        src_layout = _core.CacheLayout(src.addrs, src_count, src_block)
        dst_layout = _core.CacheLayout(dst.addrs, dst_count, dst_block)
        plan = _core.plan_blocks(src_layout, dst_layout, None, None, src_blocks, dst_blocks, src_block)
        self._run(plan, src, dst, (src_blocks, dst_blocks))

    # -- transfers between clusters ----------------------------------------------------------------
    @staticmethod
    def _remote(table, remote_id: int, ref: RemoteRef):
        """Resolve a remote reference in ``table`` -> ``(RemoteCache, row)``."""
        kind = type(ref)
        if kind is BlocksRef:
            cache = table.blocks_cache(ref.model_id)
            if cache is None:
                raise _not_exist(f"cluster {remote_id} has no blocks cache with model_id {ref.model_id}")
            return cache, 0
        if kind is CacheRowRef:
            cache = table.cache(ref.cache_id)
            if cache is None:
                raise _not_exist(f"cache_id {ref.cache_id} is not registered in cluster {remote_id}")
            return cache, ref.row
        if kind is KeyRef:
            entry = table.key(ref.owner_key)
            if entry is None:
                raise _not_exist(f"no cache of cluster {remote_id} is bound to key {ref.owner_key}")
            return entry
        raise param_invalid(f"{ref!r} is not a remote cache reference")

    @staticmethod
    def _row_in_range(cache, row: int, remote_id: int) -> None:
        if row >= cache.num_rows:
            raise _not_exist(f"batch index {row} is out of range: cache {cache.cache_id} of "
                             f"cluster {remote_id} has {cache.num_rows} rows")

    def _transfer(self, remote_id: int, local: CacheRecord, write: bool, make_plan):
        """Plan against the peer's table and move the bytes (``write``: ``local`` -> the peer).
        A ``local`` cache in device memory that the host cannot address, or a remote one, is
        moved by the link's device plane (``transport.links``)."""
        self.check_initialized()
        self._bind_thread()
        return self.links.transfer(remote_id, make_plan, write, self.sync_kv_timeout_ms,
                                   local_device=self.device_only(local))

    def push_blocks(self, remote_id: int, ref: RemoteRef, src: CacheRecord, blocks: BlockSpec,
                    tensors, route_key: Optional[tuple] = None) -> None:
        """Local blocks ``blocks.src_blocks[k]`` -> remote blocks ``blocks.dst_blocks[k]`` (block
        = the source block size; it must fit the remote block). ``tensors(src_n, dst_n)`` gives
        the tensor index lists (None = all). The one entry of both API styles for block pushes.
        ``route_key``: the caller's layer arguments ``(src_layer_range, dst_layer_range,
        tensor_num_per_layer)`` when it takes the route path (``routes``) for later calls."""
        src_blocks, dst_blocks = blocks.src_blocks, blocks.dst_blocks
        used = []

        def make(table):
            cache, _ = self._remote(table, remote_id, ref)
            st, dt = tensors(src.num_tensors, cache.num_tensors)
            used[:] = (table, cache, st, dt)
            return _core.plan_blocks(src.layout, cache.layout, st, dt, src_blocks, dst_blocks)
        self._transfer(remote_id, src, True, make)
        if route_key is not None and type(ref) is BlocksRef:
            self._learn_route((remote_id, ref.model_id, src.cache_id, True), src, route_key, *used)

    def pull_blocks(self, remote_id: int, ref: RemoteRef, dst: CacheRecord, blocks: BlockSpec,
                    tensors, route_key: Optional[tuple] = None) -> None:
        """Remote blocks -> local blocks; the puller's block size is used on both sides. A
        ``blocks.row_to_blocks`` spec pulls a remote contiguous row cut into local blocks.
        ``route_key`` as in ``push_blocks``."""
        if blocks.row_to_blocks:
            self.pull_row_to_blocks(remote_id, ref, dst, blocks.dst_blocks, tensors)
            return
        src_blocks, dst_blocks = blocks.src_blocks, blocks.dst_blocks
        used = []

        def make(table):
            cache, _ = self._remote(table, remote_id, ref)
            if cache.row_bytes != dst.row_bytes:
                raise param_invalid(f"block sizes differ: remote cache {cache.cache_id} has "
                                    f"{cache.row_bytes}-byte blocks, the local cache {dst.row_bytes}")
            st, dt = tensors(cache.num_tensors, dst.num_tensors)
            used[:] = (table, cache, st, dt)
            return _core.plan_blocks(cache.layout, dst.layout, st, dt, src_blocks, dst_blocks)
        self._transfer(remote_id, dst, False, make)
        if route_key is not None and type(ref) is BlocksRef:
            self._learn_route((remote_id, ref.model_id, dst.cache_id, False), dst, route_key, *used)

    def _learn_route(self, key: tuple, local: CacheRecord, selection: tuple, table, cache, st, dt) -> None:
        """After a checked block transfer: keep (or build) the route of ``key`` and teach it the
        tensor selection the layer arguments ``selection`` resolved to. A plane without routes,
        a transient (``create_cpu_cache``) cache or one that left the registry meanwhile: none."""
        if local.cache_id <= 0 or self.device_only(local) or not cache.host_addressable:
            return  # routes copy host memory (device memory moves through its device plane)
        with self._lock:
            if not self.initialized or self._stopping.is_set() or self._caches.get(local.cache_id) is not local:
                return
            route = self.routes.get(key)
            if (route is None or not route.current or route.generation != table.generation
                    or route.remote is not cache.layout or route.local is not local.layout):
                route = self.links.block_route(key[0], table, cache.layout, local.layout, key[3])
                if route is None:
                    self.routes.pop(key, None)
                    return
                self.routes[key] = route
            route.learn(selection, st, dt)

    def _pull_row(self, remote_id: int, ref: RemoteRef, dst: CacheRecord, tensors, plan_row) -> None:
        """Pull a remote row with ``plan_row(cache, row, src_tensors, dst_tensors)``, then tell
        the owner if the row was bound to a key it may release."""
        used = []

        def make(table):
            cache, row = self._remote(table, remote_id, ref)
            self._row_in_range(cache, row, remote_id)
            st, dt = tensors(cache.num_tensors, dst.num_tensors)
            used[:] = [table, cache, row, st]
            return plan_row(cache, row, st, dt)
        self._transfer(remote_id, dst, False, make)
        self._release_pulled_key(remote_id, *used)

    def pull_row_to_blocks(self, remote_id: int, ref: RemoteRef, dst: CacheRecord, dst_blocks,
                           tensors) -> None:
        """A remote contiguous row scattered into local blocks (block-sized chunks)."""
        self._pull_row(remote_id, ref, dst, tensors, lambda cache, row, st, dt: _core.plan_row_to_blocks(
            cache.layout, dst.layout, st, dt, row, dst_blocks))

    def pull_rows(self, remote_id: int, ref: RemoteRef, dst: CacheRecord, dst_row: int, size: int,
                  tensors, src_offset: int = 0, dst_offset: int = 0) -> None:
        """A remote row -> local row ``dst_row``; ``size`` bytes (-1 = the local row from
        ``dst_offset`` on), read from ``src_offset`` into the remote row."""
        nbytes = dst.row_bytes - dst_offset if size == -1 else size
        if nbytes <= 0:
            raise param_invalid(f"dst_cache_offset {dst_offset} is outside the row of {dst.row_bytes} bytes")
        self._pull_row(remote_id, ref, dst, tensors, lambda cache, row, st, dt: _core.plan_rows(
            cache.layout, dst.layout, st, dt, row, dst_row, src_offset, dst_offset, nbytes))

    def push_rows(self, remote_id: int, ref: RemoteRef, src: CacheRecord, src_row: int, tensors) -> None:
        """Local row ``src_row`` (one source row of bytes) -> a remote row."""
        def make(table):
            cache, row = self._remote(table, remote_id, ref)
            self._row_in_range(cache, row, remote_id)
            st, dt = tensors(src.num_tensors, cache.num_tensors)
            return _core.plan_rows(src.layout, cache.layout, st, dt, src_row, row, 0, 0, -1)
        self._transfer(remote_id, src, True, make)

    # -- layer-wise asynchronous transfer (transfer_cache_async) -----------------------------------
    def layer_jobs(self, src: CacheRecord, targets: Sequence[LayerTarget], blocks: Optional[BlockSpec]) -> list:
        """One job per target: ``(remote cluster, {source layer: plan maker})``. ``blocks`` None
        moves rows; a spec moves blocks, or (``row_to_blocks``) cuts the row into blocks."""
        num_layers = src.num_tensors // 2
        if src.kind == BLOCKS and (blocks is None or blocks.row_to_blocks):
            # A blocks source read as rows, as CANN reads it: one row (batch size 1) of one block
            # for a row transfer (block 0 goes), of the whole tensor when cut into blocks.
            row_bytes = src.row_bytes if blocks is None else src.tensor_bytes
            src = replace(src, layout=_core.CacheLayout(list(src.addrs), 1, row_bytes))
        jobs = []
        for target in targets:
            src_range = target.src_layers
            if src_range.stop > num_layers:
                raise param_invalid(f"src_layer_range {src_range} exceeds the {num_layers} layers of the source")
            if target.dst_addrs is not None:
                addrs = target.dst_addrs
                if len(addrs) != 2 * len(src_range):
                    raise param_invalid(f"dst_addrs needs {2 * len(src_range)} addresses, got {len(addrs)}")
                makers = {layer: self._raw_layer_maker(src, target, layer, addrs[2 * k:2 * k + 2], blocks)
                          for k, layer in enumerate(src_range)}
            else:
                # No dst_layer_range (a setter allows None): each layer into the same layer, as in CANN.
                dst_start = src_range.start if target.dst_layer_start is None else target.dst_layer_start
                makers = {layer: self._keyed_layer_maker(src, target, layer, dst_start + k, blocks)
                          for k, layer in enumerate(src_range)}
            if target.remote_id == self.cluster_id:
                raise param_invalid(f"transfer config names this cluster ({target.remote_id}) as its destination")
            jobs.append((target.remote_id, makers))
        return jobs

    @staticmethod
    def _layer_plan(src: CacheRecord, dst_layout, st, dt, row: int, dst_row: int, blocks: Optional[BlockSpec]):
        if blocks is None:
            return _core.plan_rows(src.layout, dst_layout, st, dt, row, dst_row, 0, 0, -1)
        if not blocks.row_to_blocks:
            return _core.plan_blocks(src.layout, dst_layout, st, dt, blocks.src_blocks, blocks.dst_blocks,
                                     blocks.block_bytes)
        return _core.plan_row_to_blocks(src.layout, dst_layout, st, dt, row, blocks.dst_blocks)

    def _raw_layer_maker(self, src: CacheRecord, target: LayerTarget, layer: int, addrs,
                         blocks: Optional[BlockSpec]):
        if blocks is None:
            layout = _core.CacheLayout(list(addrs), 1, src.row_bytes)
        else:
            top = int(blocks.dst_blocks.max()) + 1 if len(blocks.dst_blocks) else 1
            layout = _core.CacheLayout(list(addrs), top, blocks.block_bytes)
        tensors = [2 * layer, 2 * layer + 1]
        return lambda table: self._layer_plan(src, layout, tensors, [0, 1], target.src_row, 0, blocks)

    def _keyed_layer_maker(self, src: CacheRecord, target: LayerTarget, layer: int, dst_layer: int,
                           blocks: Optional[BlockSpec]):
        remote_id, ref = target.remote_id, target.ref

        def make(table):
            cache, row = self._remote(table, remote_id, ref)
            if 2 * dst_layer + 1 >= cache.num_tensors:
                raise param_invalid(f"destination layer {dst_layer} exceeds the {cache.num_tensors // 2} "
                                    f"layers of remote cache {cache.cache_id}")
            if blocks is not None and blocks.row_to_blocks and blocks.block_bytes != cache.row_bytes:
                raise param_invalid(f"dst_block_memory_size {blocks.block_bytes} differs from the remote block "
                                    f"size {cache.row_bytes}")
            return self._layer_plan(src, cache.layout, [2 * layer, 2 * layer + 1],
                                    [2 * dst_layer, 2 * dst_layer + 1], target.src_row, row, blocks)
        return make

    def start_layer_transfer(self, src: CacheRecord, synchronizer, jobs: list
                             ) -> Tuple[threading.Thread, List[Optional[LLMStatusCode]]]:
        """Run ``jobs`` layer by layer in a background thread: ``synchronizer.synchronize_layer(L,
        None)`` gates layer ``L``. Returns ``(thread, results)``: ``results[i]`` becomes job
        ``i``'s status (None while its last layer is not done). ``finalize`` waits for the
        thread (bounded) and, once it is finalizing, the thread starts no further transfer."""
        results: List[Optional[LLMStatusCode]] = [None] * len(jobs)
        layers = sorted({layer for _, makers in jobs for layer in makers})
        stopping = self._stopping

        def run() -> None:
            failed = [False] * len(jobs)
            for layer in layers:
                covering = [i for i, (_, makers) in enumerate(jobs) if layer in makers and not failed[i]]
                if not covering:
                    continue
                if stopping.is_set():
                    for i in covering:
                        results[i] = LLMStatusCode.LLM_ENGINE_FINALIZED
                    return
                try:
                    ready = bool(synchronizer.synchronize_layer(layer, None))
                except Exception:  # a synchronizer that raises stops the job like one returning False
                    logger.exception("synchronize_layer(%d) raised", layer)
                    ready = False
                if not ready or stopping.is_set():
                    status = LLMStatusCode.LLM_PARAM_INVALID if not ready else LLMStatusCode.LLM_ENGINE_FINALIZED
                    for i in covering:
                        results[i] = status
                    return
                for i in covering:
                    remote, makers = jobs[i]
                    try:
                        self._transfer(remote, src, True, makers[layer])
                    except LLMException as exc:
                        results[i], failed[i] = exc.status_code, True
                        continue
                    if layer == max(makers):
                        results[i] = LLMStatusCode.LLM_SUCCESS

        thread = threading.Thread(target=run, daemon=True, name="llm_datadist-transfer")
        with self._lock:
            self._async_threads = [t for t in self._async_threads if t.is_alive()]
            self._async_threads.append(thread)
        thread.start()
        return thread, results

    def _stop_async_threads(self, timeout_s: float = FINALIZE_JOIN_S) -> None:
        """Tell the ``transfer_cache_async`` threads to start nothing more and wait for them, at
        most ``timeout_s`` in all (the links are still up, so a transfer in flight ends normally)."""
        self._stopping.set()
        with self._lock:
            threads, self._async_threads = self._async_threads, []
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logger.warning("finalize: a transfer_cache_async thread is still waiting in its layer "
                               "synchronizer; it will not transfer anything more")

    def _release_pulled_key(self, remote_id: int, table, cache, row: int, src_tensors) -> None:
        """A pulled row bound to a key of an allocated cache: tell the owner which tensors it got."""
        if self.links.remote_accessible:
            return  # one-sided reads: the owner takes no part, its keys stay bound
        key = table.row_keys.get((cache.cache_id, row))
        if key is None or key not in table.consumable:
            return
        pulled = list(range(cache.num_tensors)) if src_tensors is None else [int(t) for t in src_tensors]
        if self.links.release_key(remote_id, key, pulled, self.sync_kv_timeout_ms):
            table.forget_key(key)  # released by the owner; a later pull by it must miss


