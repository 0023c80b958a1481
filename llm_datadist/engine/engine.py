"""The engine: one per process, shared by the Python-style and the C++-style API.

``Engine`` is a facade over parts that own their state: the cache registry (``registry.Registry``:
records, keys, pools, pins, shared ranges, generation), the links (``transport.links.LinkManager``),
the same-host block routes (``routes.BlockRoutes``) and the layer-wise runner
(``layerwise.LayerRunner``). It keeps the life cycle (initialize / finalize / switch_role), the
device runtime and thread binding, the memory it allocates or registers, local copies (planned
and run by ``copies``) and transfers to linked clusters. It speaks in plain values
(``values``: placements as ``Place``, shapes as tuples, remote caches as ``RemoteRef`` values,
block lists as ``BlockSpec``) and raises ``LLMException`` carrying a status; each API style
converts its own types at its boundary and maps errors to its own surface. It imports nothing of
either API style.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from llm_datadist import _core, runtimes
from llm_datadist.runtimes import select_runtime
from llm_datadist._memory import Place, host_view, resolve_addresses
from llm_datadist._validate import param_invalid
from llm_datadist.data_type import DataType
from llm_datadist.engine import copies, shared_memory
from llm_datadist.engine.layerwise import FINALIZE_JOIN_S, LayerRunner
from llm_datadist.engine.registry import Registry
from llm_datadist.engine.routes import BlockRoutes
from llm_datadist.engine.values import (
    DEFAULT_SYNC_KV_TIMEOUT_MS, BlockSpec, BlocksRef, CacheRecord, LayerTarget, PlannedTransfer, RemoteRef,
    block_array, cache_geometry, check_row_in_range, new_record, parse_pool, resolve_remote, whole_caches,
)
from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.transport import comms
from llm_datadist.transport.links import LinkManager
from llm_datadist.transport.read_guard import check_tag, tagged

logger = logging.getLogger("llm_datadist")

_active_lock = threading.Lock()
_active_engine: Optional["Engine"] = None


class Engine:
    """The caches, memory, local copies and transfers of one cluster (one process)."""

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
        self._thread_state = threading.local()
        self.protocol_errors = 0
        self._stats_lock = threading.Lock()
        self.links: Optional[LinkManager] = None
        self.registry = Registry(cluster_id, self._registered, self._unregistered)
        self.layers = LayerRunner(cluster_id, self._transfer)
        #: Same-host block routes, the latency path of repeated block pushes and pulls: learnt
        #: after checked block transfers, dropped with their local cache and at finalize.
        self.routes = BlockRoutes(self.registry)

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
            pools = {Place.DEVICE: parse_pool(options, "llm.MemPoolConfig"),
                     Place.HOST: parse_pool(options, "llm.HostMemPoolConfig")}
            runtime, reason = select_runtime()
            runtime.set_device(device_id)
            self._thread_state = threading.local()
            self._thread_state.device_bound = True
            self.layers.restart()
            self.options = dict(options)
            self.device_id = device_id
            self.sync_kv_timeout_ms = sync_kv_timeout_ms
            self.listen = listen
            self.runtime, self.runtime_reason = runtime, reason
            self.registry.open(runtime, pools)
            links = LinkManager(self)
            if listen is not None:
                links.start_listener(*listen)
            self.links = links
            self.routes.open(links, sync_kv_timeout_ms)
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
            self.layers.stop(FINALIZE_JOIN_S)
            self.routes.close()
            # Memory is leaving: peers on the same-host plane see the generation move and stop
            # writing through their copy of our table.
            self.registry.bump_generation()
            if self.links is not None:
                self.links.close()
            for record in self.registry.close():
                self._unpin_host(record)
            self.initialized = False
            if _active_engine is self:
                _active_engine = None

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

    def linked_clusters(self) -> List[int]:
        """The clusters this one has a link to now, either side's (empty before init)."""
        return self.links.linked_clusters() if self.initialized else []

    def link_stats(self) -> Dict[str, int]:
        """This cluster's counters of what its links refused, lost or found malformed: the link
        manager's (``LinkManager.link_stats``: the caps' and the byte budgets' ``refused_*``,
        ``auth_failures``, ``links_lost``, the process budgets' bytes in use and at peak) and
        ``protocol_errors`` (malformed frames). Empty before ``init``; kept after ``finalize``."""
        if self.links is None:
            return {}
        return dict(self.links.link_stats(), protocol_errors=self.protocol_errors)

    def link_many(self, targets: Sequence[Tuple[int, str, int]], timeout_ms: int) -> List[LLMStatusCode]:
        """Link to each ``(cluster_id, ip, port)`` in parallel; one status per target."""
        self.check_initialized()
        return self.links.link_many(targets, timeout_ms)

    def link_address(self, ip: str, port: int, timeout_ms: int) -> Tuple[LLMStatusCode, Optional[int]]:
        """Link to whichever cluster listens on ``ip:port`` (the caller knows no cluster id):
        ``(status, its cluster id as the handshake proved it)``; ``LLM_ALREADY_LINK`` or
        ``LLM_SUCCESS`` with the id when it is linked already, id None when no handshake got that
        far. Never raises for the peer's failures."""
        self.check_initialized()
        return self.links.link_address(ip, port, timeout_ms)

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

    def link_protection(self, remote_id: int) -> str:
        """The protection of the link to ``remote_id``: "off", "integrity" or "encrypt"
        (``llm.LinkProtection``; the stronger of the two sides' settings)."""
        self.check_initialized()
        return self.links.peer(remote_id).protection

    def set_notify_handler(self, handler: Optional[Callable]) -> None:
        """Answer peers' notifications with ``handler(peer_cluster_id, message) -> reply`` (None
        refuses them). Removing the handler also works after ``finalize``."""
        if handler is not None:
            self.check_initialized()
        if self.links is not None:
            self.links.set_notify_handler(handler)

    def set_read_guard(self, guard: Optional[Callable]) -> None:
        """Check every pull a peer makes through this engine's server (the ``tcp`` and ``staging``
        planes) with ``guard(peer_cluster_id, tag) -> allowed ranges or None``: ``tag`` is the bytes
        the puller set (``read_tag``), the ranges ``(address, nbytes)`` pairs. A pull without a tag,
        with a tag the guard refuses (None) or reading outside the allowed ranges is refused with
        ``LLM_KV_CACHE_NOT_EXIST``; the link goes on. Reads over one-sided planes (``cma``,
        ``cuda_ipc``) never reach the server and are not guarded. None: no guard (the default).
        The guard runs on the connection's thread, so it must be quick."""
        self.check_initialized()
        self.links.set_read_guard(guard)

    def set_write_guard(self, guard: Optional[Callable]) -> None:
        """Check every push a peer makes through this engine's server (``tcp``, ``staging``) with
        ``guard(peer_cluster_id) -> allowed ranges or None`` (``(address, nbytes)`` pairs): a push
        with a descriptor outside what the guard allows that authenticated peer now (or any push
        when it answers None) is refused with ``LLM_KV_CACHE_NOT_EXIST`` before a byte lands; the
        link goes on. Writes over one-sided planes (``cma``, ``cuda_ipc``, ``nixl``) never reach
        the server and are not guarded. None: no guard (the default; removing it also works after
        ``finalize``). It runs on the connection's thread, so it must be quick."""
        if guard is not None:
            self.check_initialized()
        if self.links is not None:
            self.links.set_write_guard(guard)

    def quiesce_writes(self, peer_cluster_id: int, timeout_s: float) -> bool:
        """After narrowing what the write guard allows a peer (a grant ended): wait until none of
        its pushes through the server that passed the guard before is still writing, so that no
        byte of theirs lands from then on. True if none was left within ``timeout_s``; else the
        connections carrying them are shut down (those pushes fail and the link ends) and False is
        returned. True at once without a guard or links."""
        if self.links is None:
            return True
        return self.links.quiesce_writes(int(peer_cluster_id), float(timeout_s))

    @staticmethod
    def read_tag(tag: Any):
        """A context manager: the pulls this thread makes inside carry ``tag`` (bytes, or str as
        UTF-8; at most ``transport.budgets.MAX_PULL_TAG_BYTES``) to the owner's read guard.
        ``LLMException`` (``LLM_PARAM_INVALID``) for a tag that is not bytes or too long."""
        try:
            return tagged(check_tag(tag))
        except ValueError as exc:
            raise param_invalid(str(exc)) from None

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

    # -- memory and the registry ---------------------------------------------------------------
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
        record = new_record(num_tensors, shape, nbytes, data_type, placement, kind, resolved, True, -1,
                            batch_dim)
        record.keepalive = keepalive
        if record.placement == Place.HOST:
            record.pinned_addrs = self._pin_host(resolved, nbytes)
        try:
            return self.registry.commit(record, owner_keys, blocks_model_id)
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
        charged = self.registry.reserve(placement, total)
        try:
            # HOST caches of a device runtime are page-locked memory from it (cudaMallocHost,
            # aclrtMallocHost): what its copies reach at full speed.
            pinned = placement == Place.HOST and not self.runtime.host_addressable
            # Host memory of this process's own (a HOST cache of a host runtime, or any cache of
            # the cpu runtime): one memfd per cache, which the shm plane can hand to a peer.
            shared = shared_memory.allocate(nbytes, num_tensors) if self.runtime.host_addressable else None
            if shared is not None:
                allocations = list(shared.tensors)
            else:
                allocations = [_core.Allocation(self.runtime, nbytes, placement == Place.DEVICE, pinned)
                               for _ in range(num_tensors)]
            record = new_record(num_tensors, shape, nbytes, data_type, placement, kind,
                                [a.addr for a in allocations], False, -1, batch_dim)
            record.allocations = allocations
            record.shared = shared
            record.pool_bytes = charged
            return self.registry.commit(record, owner_keys, blocks_model_id)
        except BaseException:
            self.registry.release(placement, charged)
            raise

    def transient(self, num_tensors: int, shape: Sequence[int], data_type: DataType, placement: Place,
                  addrs: Sequence[int], kind: str, batch_dim: int = 0) -> CacheRecord:
        """A record for memory the engine does not track (``Cache.create_cpu_cache``)."""
        shape, nbytes = cache_geometry(shape, data_type)
        return new_record(num_tensors, shape, nbytes, data_type, placement, kind, list(addrs), True, -1,
                          batch_dim)

    def _registered(self, record: CacheRecord) -> None:
        """The registry took ``record``: the data planes hear of it (transport.engine_view)."""
        if self.links is not None:
            self.links.registered(record)

    def _unregistered(self, record: CacheRecord) -> None:
        """``record`` left the registry (its lock held): its routes go, the data planes hear of
        it, and host memory page-locked for it is unlocked."""
        self.routes.drop_cache(record.cache_id)
        if self.links is not None:
            self.links.unregistered(record)
        self._unpin_host(record)

    def lookup(self, cache_id: int) -> CacheRecord:
        return self.registry.lookup(cache_id)

    def deallocate(self, cache_id: int, blocks: Optional[bool] = None) -> None:
        """Drop the id reference of an allocated cache; memory goes when no key is bound to it.
        ``blocks``: the kind the caller means (None = either); the record must be of it."""
        self.check_initialized()
        self.registry.deallocate(cache_id, blocks)

    def unregister(self, cache_id: int) -> None:
        self.check_initialized()
        self.registry.unregister(cache_id)

    def remove_key(self, owner_key: Optional[tuple]) -> None:
        self.check_initialized()
        self.registry.remove_key(owner_key)

    def find_key(self, owner_key: tuple) -> Tuple[CacheRecord, int]:
        return self.registry.find_key(owner_key)

    def find_blocks_key(self, model_id: int) -> CacheRecord:
        return self.registry.find_blocks_key(model_id)

    @property
    def pools(self) -> Dict[int, Any]:
        """The configured memory pools by placement (``values.MemoryPool`` or None)."""
        return self.registry.pools

    # -- what the transport sees (transport.engine_view.EngineView) -------------------------------
    @property
    def generation_word(self):
        return self.registry.generation_word

    def export_table(self) -> Dict[str, Any]:
        """This cluster's cache table as peers receive it (see transport.table)."""
        return self.registry.export_table()

    def consume_key(self, owner_key: tuple, tensors: Sequence[int]) -> bool:
        """A peer pulled ``tensors`` of the row bound to ``owner_key`` (see
        ``Registry.consume_key``); returns whether the key was released."""
        return self.registry.consume_key(owner_key, tensors)

    def pinned(self, plan, dst_side: bool, deadline: Optional[float] = None,
               cancel: Optional[Callable[[], None]] = None):
        """``(shared host ranges, registry generation, shared device ranges)``, held while a
        peer's bytes move through ``plan``, until ``deadline`` at the latest, after which
        unregistering that memory calls ``cancel()`` (see ``Registry.pinned``)."""
        return self.registry.pinned(plan, dst_side, deadline, cancel)

    def device_only(self, record: CacheRecord) -> bool:
        """Whether a cache is device memory that the host cannot address (cuda, acl)."""
        return self.registry.device_only(record)

    def count_protocol_error(self) -> None:
        with self._stats_lock:
            self.protocol_errors += 1

    def bind_thread(self) -> None:
        """Bind the calling thread to the engine's device before it copies device memory through
        ``self.runtime``."""
        self._bind_thread()

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

    def copy_rows(self, dst: CacheRecord, src: CacheRecord, dst_row: int, src_row: int,
                  offset: int, size: int) -> None:
        """Copy row ``src_row`` of every tensor of ``src`` into row ``dst_row`` of ``dst``, from
        ``offset`` on, ``size`` bytes (-1 = rest of the source row)."""
        self.check_initialized()
        copies.copy_rows(self.runtime, self._bind_thread, dst, src, dst_row, src_row, offset, size)

    def copy_blocks(self, src: CacheRecord, dst: CacheRecord, src_blocks, dst_blocks,
                    block_bytes: int = -1) -> None:
        """Copy blocks ``src_blocks[k]`` -> ``dst_blocks[k]`` of every tensor, in list order."""
        self.check_initialized()
        copies.copy_blocks(self.runtime, self._bind_thread, src, dst, src_blocks, dst_blocks, block_bytes)

    def swap_blocks(self, src: CacheRecord, dst: CacheRecord, src_blocks, dst_blocks) -> None:
        """Copy blocks between a host and a device cache, block ``src_blocks[k]`` to
        ``dst_blocks[k]`` of every tensor, with the geometry recorded for each cache."""
        self.check_initialized()
        copies.swap_blocks(self.runtime, self._bind_thread, src, dst, src_blocks, dst_blocks)

    # -- transfers between clusters ----------------------------------------------------------------
    def _transfer(self, remote_id: int, local: CacheRecord, write: bool, make_plan):
        """Plan against the peer's table with ``make_plan(table) -> plan`` and move the bytes
        (``write``: ``local`` -> the peer); returns the plan that ran. A ``local`` cache in device
        memory that the host cannot address, or a remote one, is moved by the link's device plane
        (``transport.links``)."""
        self.check_initialized()
        self._bind_thread()
        return self.links.transfer(remote_id, make_plan, write, self.sync_kv_timeout_ms,
                                   local_device=self.device_only(local))

    def _transfer_planned(self, remote_id: int, local: CacheRecord, write: bool, planner) -> PlannedTransfer:
        """``_transfer`` with ``planner(table) -> PlannedTransfer``: returns the one of the plan
        that ran (the links may plan twice, against a refreshed table), so that the caller learns
        what the plan resolved."""
        planned = None

        def make(table):
            nonlocal planned
            planned = planner(table)
            return planned.plan
        self._transfer(remote_id, local, write, make)
        return planned

    def push_blocks(self, remote_id: int, ref: RemoteRef, src: CacheRecord, blocks: BlockSpec,
                    tensors, layer_args: Optional[tuple] = None) -> None:
        """Local blocks ``blocks.src_blocks[k]`` -> remote blocks ``blocks.dst_blocks[k]`` (block
        = the source block size; it must fit the remote block). ``tensors(src_n, dst_n)`` gives
        the tensor index lists (None = all). The one entry of both API styles for block pushes.
        ``layer_args``: the caller's layer arguments ``(src_layer_range, dst_layer_range,
        tensor_num_per_layer)`` when it tries the block routes (``routes.find``) first: the
        route of this transfer learns the tensors they select (``BlockRoutes.learn``)."""
        src_blocks, dst_blocks = blocks.src_blocks, blocks.dst_blocks

        def planner(table):
            cache, _ = resolve_remote(table, remote_id, ref)
            st, dt = tensors(src.num_tensors, cache.num_tensors)
            return PlannedTransfer(_core.plan_blocks(src.layout, cache.layout, st, dt, src_blocks, dst_blocks),
                                   table, cache, 0, st, dt)
        planned = self._transfer_planned(remote_id, src, True, planner)
        if layer_args is not None and type(ref) is BlocksRef and not self.device_only(src):
            self.routes.learn(remote_id, ref.model_id, src, True, layer_args, planned)

    def pull_blocks(self, remote_id: int, ref: RemoteRef, dst: CacheRecord, blocks: BlockSpec,
                    tensors, layer_args: Optional[tuple] = None) -> None:
        """Remote blocks -> local blocks; the puller's block size is used on both sides. A
        ``blocks.row_to_blocks`` spec pulls a remote contiguous row cut into local blocks.
        ``layer_args`` as in ``push_blocks``."""
        if blocks.row_to_blocks:
            self.pull_row_to_blocks(remote_id, ref, dst, blocks.dst_blocks, tensors)
            return
        src_blocks, dst_blocks = blocks.src_blocks, blocks.dst_blocks
        ranged = blocks.block_bytes != -1 or blocks.src_offset != 0 or blocks.dst_offset != 0

        def planner(table):
            cache, _ = resolve_remote(table, remote_id, ref)
            if cache.row_bytes != dst.row_bytes and not ranged:
                raise param_invalid(f"block sizes differ: remote cache {cache.cache_id} has "
                                    f"{cache.row_bytes}-byte blocks, the local cache {dst.row_bytes}")
            st, dt = tensors(cache.num_tensors, dst.num_tensors)
            if ranged:  # a byte range of each block (the planner checks it fits both block sizes)
                plan = _core.plan_blocks(cache.layout, dst.layout, st, dt, src_blocks, dst_blocks, blocks.block_bytes,
                                         blocks.src_offset, blocks.dst_offset)
            else:
                plan = _core.plan_blocks(cache.layout, dst.layout, st, dt, src_blocks, dst_blocks)
            return PlannedTransfer(plan, table, cache, 0, st, dt)
        planned = self._transfer_planned(remote_id, dst, False, planner)
        if layer_args is not None and type(ref) is BlocksRef and not self.device_only(dst):
            self.routes.learn(remote_id, ref.model_id, dst, False, layer_args, planned)

    def pull_block_range(self, remote_id: int, model_id: int, cache_id: int, src_blocks, dst_blocks,
                         src_offset: int, dst_offset: int, nbytes: int) -> None:
        """The engine seam's pull of a byte range of each block (for integrations; the public API
        pulls whole blocks): ``nbytes`` from ``src_offset`` bytes into the peer's blocks
        ``src_blocks[k]`` (its blocks cache of ``model_id``) to ``dst_offset`` bytes into blocks
        ``dst_blocks[k]`` of the registered cache ``cache_id``, in every tensor. The two block
        sizes may differ (a tensor parallel rank's KV heads from an engine of another TP size);
        each range must lie inside its block (``LLM_PARAM_INVALID`` naming the bad value)."""
        spec = BlockSpec(block_array(src_blocks, "src_blocks"), block_array(dst_blocks, "dst_blocks"), nbytes,
                         src_offset, dst_offset)
        if len(spec.src_blocks) != len(spec.dst_blocks):
            raise param_invalid(f"src_blocks has {len(spec.src_blocks)} entries, dst_blocks {len(spec.dst_blocks)}")
        self.pull_blocks(remote_id, BlocksRef(model_id), self.lookup(cache_id), spec, whole_caches(2))

    def pull_sub_blocks(self, remote_id: int, model_id: int, cache_id: int, src_blocks, dst_blocks,
                        regions, first: int = 0) -> None:
        """The engine seam's pull between blocks of different token counts (for integrations: a
        vLLM engine of another block size): one side's block is a whole multiple of the other's,
        a small block is ``regions`` (``(offset, nbytes, runs)``: runs of tokens, such as a KV
        head's keys) and each small block is one sub-block of a large one, region by region and run
        by run (``_core.plan_sub_blocks``, which says how the lists pair and what it refuses). From
        the peer's blocks cache of ``model_id`` into the registered cache ``cache_id``, every tensor."""
        self._pull_blocks_planned(remote_id, model_id, cache_id, src_blocks, dst_blocks,
                                  lambda *args: _core.plan_sub_blocks(*args, regions, first))

    def pull_strided_blocks(self, remote_id: int, model_id: int, cache_id: int, src_blocks, dst_blocks,
                            regions) -> None:
        """The engine seam's pull between blocks that hold the same bytes in another order (for
        integrations: a vLLM engine whose KV blocks are ``[tokens, heads, C]`` and one whose are
        ``[heads, tokens, C]``): each region ``(src_offset, src_stride, dst_offset, dst_stride,
        piece, count)`` of every block pair moves as ``count`` strided runs
        (``_core.plan_strided_blocks``, which says what it refuses), from the peer's blocks cache of
        ``model_id`` into the registered cache ``cache_id``, every tensor."""
        self._pull_blocks_planned(remote_id, model_id, cache_id, src_blocks, dst_blocks,
                                  lambda *args: _core.plan_strided_blocks(*args, regions))

    def _pull_blocks_planned(self, remote_id: int, model_id: int, cache_id: int, src_blocks, dst_blocks,
                             plan) -> None:
        """A pull of every tensor from the peer's blocks cache of ``model_id`` into ``cache_id``,
        planned by ``plan(src layout, dst layout, src tensors, dst tensors, src blocks, dst blocks)``
        (``pull_sub_blocks``, ``pull_strided_blocks``)."""
        dst = self.lookup(cache_id)
        src_blocks, dst_blocks = block_array(src_blocks, "src_blocks"), block_array(dst_blocks, "dst_blocks")

        def planner(table):
            cache, _ = resolve_remote(table, remote_id, BlocksRef(model_id))
            st, dt = whole_caches(2)(cache.num_tensors, dst.num_tensors)
            return PlannedTransfer(plan(cache.layout, dst.layout, st, dt, src_blocks, dst_blocks), table, cache, 0,
                                   st, dt)
        self._transfer_planned(remote_id, dst, False, planner)

    def _pull_row(self, remote_id: int, ref: RemoteRef, dst: CacheRecord, tensors, plan_row) -> None:
        """Pull a remote row with ``plan_row(cache, row, src_tensors, dst_tensors)``, then tell
        the owner if the row was bound to a key it may release."""
        def planner(table):
            cache, row = resolve_remote(table, remote_id, ref)
            check_row_in_range(cache, row, remote_id)
            st, dt = tensors(cache.num_tensors, dst.num_tensors)
            return PlannedTransfer(plan_row(cache, row, st, dt), table, cache, row, st, dt)
        self._release_pulled_key(remote_id, self._transfer_planned(remote_id, dst, False, planner))

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
            cache, row = resolve_remote(table, remote_id, ref)
            check_row_in_range(cache, row, remote_id)
            st, dt = tensors(src.num_tensors, cache.num_tensors)
            return _core.plan_rows(src.layout, cache.layout, st, dt, src_row, row, 0, 0, -1)
        self._transfer(remote_id, src, True, make)

    def _release_pulled_key(self, remote_id: int, planned: PlannedTransfer) -> None:
        """A pulled row bound to a key of an allocated cache: tell the owner which tensors it got."""
        if self.links.remote_accessible:
            return  # one-sided reads: the owner takes no part, its keys stay bound
        table, cache, src_tensors = planned.table, planned.cache, planned.src_tensors
        key = table.consumable_key(cache.cache_id, planned.row)
        if key is None:
            return
        pulled = list(range(cache.num_tensors)) if src_tensors is None else [int(t) for t in src_tensors]
        if self.links.release_key(remote_id, key, pulled, self.sync_kv_timeout_ms):
            table.forget_key(key)  # released by the owner; a later pull by it must miss

    # -- layer-wise asynchronous transfer (transfer_cache_async): the LayerRunner's ----------------
    def layer_jobs(self, src: CacheRecord, targets: Sequence[LayerTarget], blocks: Optional[BlockSpec]) -> list:
        """One job per target: ``(remote cluster, {source layer: plan maker})`` (``LayerRunner.jobs``)."""
        return self.layers.jobs(src, targets, blocks)

    def start_layer_transfer(self, src: CacheRecord, synchronizer, jobs: list
                             ) -> Tuple[threading.Thread, List[Optional[LLMStatusCode]]]:
        """Run ``jobs`` layer by layer in a background thread (``LayerRunner.start``): returns
        ``(thread, results)``. ``finalize`` waits for the thread (bounded) and, once it is
        finalizing, the thread starts no further transfer."""
        return self.layers.start(src, synchronizer, jobs)
