"""The engine's registry: which caches, keys and pools exist, and what peers may touch.

``Registry`` owns, under its own lock, the cache records (and the cache_id counter), the row keys
and blocks keys bound to them, the byte accounting of the memory pools, the shared ranges (the
memory peers may read or write), the generation word peers watch, and the pins that hold memory
in the registry while a peer's bytes move through it. It is what the transport's ``EngineView``
asks of the engine about memory (``export_table``, ``pinned``, ``consume_key``,
``generation_word``, ``device_only``); the engine delegates those to it.

It does not acquire or free memory, and knows nothing of links, routes or threads: its owner
hears of each record that enters or leaves (``on_registered`` / ``on_unregistered``) and does
its part there (telling the links, dropping routes, unpinning host memory).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from llm_datadist import _io
from llm_datadist._memory import Place
from llm_datadist._validate import param_invalid
from llm_datadist.engine.values import CacheRecord, MemoryPool, is_blocks, is_rows, not_exist
from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.transport.shm import SharedCounter

logger = logging.getLogger("llm_datadist")

#: How long unregistering waits for a transfer pinned on the memory it removes that has no
#: deadline of its own (the transport's pins always have one: their frame's deadline).
UNPIN_WAIT_S = 90.0
#: How long unregistering waits, after cancelling a transfer past its deadline, for it to let go.
CANCEL_WAIT_S = 5.0


def _ignore(record: CacheRecord) -> None:
    pass


class Registry:
    """Cache records, keys, pools, pins, shared ranges and generation of one cluster."""

    def __init__(self, cluster_id: int,
                 on_registered: Callable[[CacheRecord], None] = _ignore,
                 on_unregistered: Callable[[CacheRecord], None] = _ignore) -> None:
        """``on_registered(record)`` runs after a record entered (lock not held);
        ``on_unregistered(record)`` when one leaves, with the lock held and the shared ranges
        already without it (it must not fail)."""
        self.cluster_id = cluster_id
        #: Held while the tables change; hold it to act consistently with them (block routes).
        self.lock = threading.RLock()
        self.runtime: Any = None
        self.pools: Dict[int, Optional[MemoryPool]] = {Place.HOST: None, Place.DEVICE: None}
        self._on_registered = on_registered
        self._on_unregistered = on_unregistered
        self._caches: Dict[int, CacheRecord] = {}
        self._keys: Dict[tuple, Tuple[CacheRecord, int]] = {}
        self._blocks_keys: Dict[int, CacheRecord] = {}
        self._next_cache_id = 1
        # Peers read the generation word (same-host plane) to notice memory leaving the registry;
        # TCP receives pin the shared ranges so memory is not released under them.
        self.generation_word = SharedCounter(1)
        self._shared_ranges = _io.RangeSet(())
        self._shared_device_ranges = _io.RangeSet(())
        self._pin_cond = threading.Condition()
        # token -> (plan, dst_side, deadline on time.monotonic(), cancel callable or None)
        self._pinned: Dict[int, Tuple[Any, bool, float, Optional[Callable[[], None]]]] = {}
        self._pin_serial = 0

    # -- life cycle ------------------------------------------------------------------------------
    def open(self, runtime: Any, pools: Dict[int, Optional[MemoryPool]]) -> None:
        """Start serving with the device ``runtime`` (which says what is ``device_only``) and
        the configured ``pools``."""
        with self.lock:
            self.runtime = runtime
            self.pools = pools

    def bump_generation(self) -> None:
        """Tell peers watching the generation word that registered memory is going away."""
        self.generation_word.value = self.generation_word.value + 1

    def close(self) -> List[CacheRecord]:
        """Close the generation word and forget every record, key and range; the pools are
        emptied. Returns the records it held (their owner still has memory to release)."""
        self.generation_word.close()
        with self.lock:
            records = list(self._caches.values())
            self._caches.clear()
            self._keys.clear()
            self._blocks_keys.clear()
            self._shared_ranges = _io.RangeSet(())
            self._shared_device_ranges = _io.RangeSet(())
            for pool in self.pools.values():
                if pool is not None:
                    pool.used = 0
        return records

    # -- pools ---------------------------------------------------------------------------------
    def reserve(self, placement: Place, nbytes: int) -> int:
        """Charge ``nbytes`` to the pool of ``placement``; returns the bytes charged (0 without a
        pool). LLM_OUT_OF_MEMORY if the pool cannot hold them."""
        pool = self.pools.get(placement)
        if pool is None:
            return 0
        with self.lock:
            if pool.used + nbytes > pool.capacity:
                raise LLMException(f"memory pool exhausted: {nbytes} bytes asked, "
                                   f"{pool.capacity - pool.used} of {pool.capacity} free",
                                   status_code=LLMStatusCode.LLM_OUT_OF_MEMORY)
            pool.used += nbytes
        return nbytes

    def release(self, placement: Place, nbytes: int) -> None:
        """Give back ``nbytes`` charged by ``reserve`` for memory that never became a record."""
        pool = self.pools.get(placement)
        if pool is not None and nbytes:
            with self.lock:
                pool.used -= nbytes

    # -- records and keys ------------------------------------------------------------------------
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

    def commit(self, record: CacheRecord, owner_keys: Sequence[Optional[tuple]] = (),
               blocks_model_id: Optional[int] = None) -> CacheRecord:
        """Enter ``record`` under a new cache_id, with its row keys and blocks key: everything
        that can fail (key checks, the new shared ranges) happens before the first table
        changes, so a failure leaves the registry and the ranges peers may touch exactly as they
        were."""
        with self.lock:
            keys = self._checked_keys(record, owner_keys)
            ranges = self.ranges_of([*self._caches.values(), record])
            record.cache_id = self._next_cache_id
            self._next_cache_id += 1
            self._caches[record.cache_id] = record
            for row, key in keys:
                self._keys[key] = (record, row)
                record.owner_keys.add(key)
            if blocks_model_id is not None:
                self._blocks_keys[blocks_model_id] = record
            self._shared_ranges, self._shared_device_ranges = ranges
        self._on_registered(record)
        return record

    def holds(self, record: CacheRecord) -> bool:
        """Whether ``record`` is (still) in the registry."""
        return self._caches.get(record.cache_id) is record

    def lookup(self, cache_id: int) -> CacheRecord:
        with self.lock:
            record = self._caches.get(cache_id)
        if record is None or record.id_released:
            raise not_exist(f"cache_id {cache_id} is not registered or allocated in cluster "
                            f"{self.cluster_id}")
        return record

    def find_key(self, owner_key: tuple) -> Tuple[CacheRecord, int]:
        with self.lock:
            entry = self._keys.get(owner_key)
        if entry is None:
            raise not_exist(f"no cache is bound to key {owner_key} in cluster {self.cluster_id}")
        return entry

    def find_blocks_key(self, model_id: int) -> CacheRecord:
        with self.lock:
            record = self._blocks_keys.get(model_id)
        if record is None:
            raise not_exist(f"no blocks cache is registered with model_id {model_id} in cluster "
                            f"{self.cluster_id}")
        return record

    def _prepare_drop(self, record: CacheRecord) -> Tuple[Any, Any]:
        """What the registry looks like without ``record``: ``((shared host ranges, shared device
        ranges), its memory)``, computed before anything changes, as everything that can fail
        (lock held)."""
        ranges = self.ranges_of([r for r in self._caches.values() if r is not record])
        removed = _io.RangeSet((addr, record.tensor_bytes) for addr in record.addrs)
        return ranges, removed

    def _drop(self, record: CacheRecord, prepared: Optional[Tuple[Any, Any]] = None) -> Any:
        """Remove a record and everything that names it (lock held); returns its memory as a
        RangeSet for ``_wait_unpinned``. Nothing changes if this raises."""
        ranges, removed = prepared if prepared is not None else self._prepare_drop(record)
        self._caches.pop(record.cache_id, None)
        for key in record.owner_keys:
            self._keys.pop(key, None)
        record.owner_keys.clear()
        for model_id in [m for m, r in self._blocks_keys.items() if r is record]:
            del self._blocks_keys[model_id]
        pool = self.pools.get(record.placement)
        if pool is not None and record.pool_bytes:
            pool.used -= record.pool_bytes
            record.pool_bytes = 0
        self.bump_generation()
        self._shared_ranges, self._shared_device_ranges = ranges
        self._on_unregistered(record)
        return removed

    def deallocate(self, cache_id: int, blocks: Optional[bool] = None) -> None:
        """Drop the id reference of an allocated cache; it leaves when no key is bound to it.
        ``blocks``: the kind the caller means (None = either); the record must be of it."""
        with self.lock:
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
        """Remove a registered (caller-owned) cache, once no transfer pinned before touches it."""
        with self.lock:
            record = self._caches.get(cache_id)
            if record is None:
                return
            if not record.registered:
                raise param_invalid(f"cache {cache_id} was allocated; use deallocate_cache")
            removed = self._drop(record)
        self._wait_unpinned(removed)

    def remove_key(self, owner_key: Optional[tuple]) -> None:
        """Unbind a row key of an allocated cache; the last key of a released id removes it."""
        with self.lock:
            entry = self._keys.get(owner_key)
            if entry is None or entry[0].registered:
                return
            record = entry[0]
            last = record.id_released and record.owner_keys == {owner_key}
            prepared = self._prepare_drop(record) if last else None
            del self._keys[owner_key]
            record.owner_keys.discard(owner_key)
            self.bump_generation()
            if not last:
                return
            removed = self._drop(record, prepared)
        self._wait_unpinned(removed)

    def consume_key(self, owner_key: tuple, tensors: Sequence[int]) -> bool:
        """A peer pulled ``tensors`` of the row bound to ``owner_key``: once every tensor of the
        row has been pulled, the key of an allocated cache is released (prefix keys never are).
        Returns whether it was released."""
        with self.lock:
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

    # -- what peers see ----------------------------------------------------------------------------
    def device_only(self, record: CacheRecord) -> bool:
        """Whether a cache is device memory that the host cannot address (cuda, acl)."""
        runtime = self.runtime
        return record.placement == Place.DEVICE and runtime is not None and not runtime.host_addressable

    def ranges_of(self, records) -> Tuple[Any, Any]:
        """The memory peers may read or write with ``records`` registered, as two RangeSets:
        the tensors of those caches that the host can address (moved by any plane), and the
        others, device memory of a runtime whose memory the host cannot address (moved by
        staging it through host memory: ``transport.staging``)."""
        host = [(addr, record.tensor_bytes) for record in records if not self.device_only(record)
                for addr in record.addrs]
        device = [(addr, record.tensor_bytes) for record in records if self.device_only(record)
                  for addr in record.addrs]
        return _io.RangeSet(host), _io.RangeSet(device)

    def export_table(self) -> Dict[str, Any]:
        """This cluster's cache table as peers receive it (see transport.table)."""
        with self.lock:
            caches = [[r.cache_id, r.kind, int(r.placement), r.num_tensors, r.num_rows, r.row_bytes,
                       list(r.addrs), not self.device_only(r)] for r in self._caches.values()]
            blocks = [[model_id, r.cache_id] for model_id, r in self._blocks_keys.items()]
            keys = [[key[0], key[1], key[2], r.cache_id, row, not r.registered]
                    for key, (r, row) in self._keys.items()]
            generation = self.generation_word.value
        return {"generation": generation, "caches": caches, "blocks": blocks, "keys": keys}

    @contextlib.contextmanager
    def pinned(self, plan, dst_side: bool, deadline: Optional[float] = None,
               cancel: Optional[Callable[[], None]] = None):
        """``(shared host ranges, registry generation, shared device ranges)``, held while a
        peer's bytes move through the ``dst_side`` (or source) ranges of ``plan``: memory they
        touch does not leave the registry until they are done. ``deadline`` (``time.monotonic()``):
        when the transfer ends at the latest; ``cancel()``: fail it now, so that it lets go of the
        pin without another byte moving (unregistering memory under it calls it once the
        deadline has passed)."""
        if deadline is None:
            deadline = time.monotonic() + UNPIN_WAIT_S
        with self._pin_cond:
            self._pin_serial += 1
            token = self._pin_serial
            self._pinned[token] = (plan, dst_side, deadline, cancel)
            ranges, device = self._shared_ranges, self._shared_device_ranges
            generation = self.generation_word.value
        try:
            yield ranges, generation, device
        finally:
            with self._pin_cond:
                del self._pinned[token]
                self._pin_cond.notify_all()

    def _wait_unpinned(self, removed) -> None:
        """Wait until no transfer pinned before now touches the ``removed`` ranges (transfers
        into other memory, and later ones, which are refused these ranges, do not hold it up).
        A transfer still pinned at its own deadline is cancelled (its connection is shut down:
        it fails, and not another byte of it moves), then awaited ``CANCEL_WAIT_S`` more."""
        with self._pin_cond:
            waiting = {token for token, (plan, side, _, _) in self._pinned.items() if removed.overlaps(plan, side)}
            given_up: Dict[int, float] = {}  # cancelled -> when to stop waiting for it
            while True:
                waiting.intersection_update(self._pinned)
                if not waiting:
                    return
                now = time.monotonic()
                if any(given_up.get(token, now + 1) <= now for token in waiting):
                    logger.error("cluster %d: a transfer cancelled %.0f s ago still holds memory being "
                                 "unregistered; going on", self.cluster_id, CANCEL_WAIT_S)
                    return
                due = [token for token in waiting if token not in given_up and self._pinned[token][2] <= now]
                for token in due:
                    given_up[token] = now + CANCEL_WAIT_S
                    cancel = self._pinned[token][3]
                    logger.warning("cluster %d: a transfer into memory being unregistered passed its deadline; "
                                   "cancelling it", self.cluster_id)
                    if cancel is not None:
                        try:
                            cancel()  # shuts its connection down: no lock of ours is taken
                        except Exception as exc:  # noqa: BLE001 - the wait for it is bounded anyway
                            logger.warning("cluster %d: cancelling a transfer failed: %s", self.cluster_id, exc)
                if due:
                    continue
                wake = min(given_up.get(token, self._pinned[token][2]) for token in waiting)
                self._pin_cond.wait(max(0.0, wake - now))
