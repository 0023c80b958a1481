"""Cache tables: what a cluster publishes to its linked peers, and a peer's table as we hold it.

A table lists every cache of the owner (id, kind, geometry, tensor addresses), the blocks keys
(model_id -> cache_id) and the row keys (CacheKey -> cache_id, row), plus the owner's registry
generation, which changes whenever memory leaves the registry. A peer plans transfers against
the table it fetched at link time; a miss refreshes it once, and the same-host plane compares the
generation before each transfer so it never writes through a stale table.

Each cache says whether its owner's host can address it (``host_addressable``: host caches, and
device caches of a runtime whose device memory is host memory, such as ``cpu``); the others are
device memory (cuda, acl) and only a plane with ``device_memory`` moves them
(``RemoteTable.device_side``).

A peer decides how large its table is (up to ``budgets.DEFAULT_MAX_TABLE_BYTES`` of JSON), so
``RemoteTable`` keeps it in columns: one ``array`` per field, each of the narrowest unsigned type
that holds its values, sorted by key and searched with ``bisect``. Measured with ``tracemalloc``,
the largest reply the default budget admits costs at most 0.5 MiB kept this way (37,000 row keys:
0.36 MiB; 105,000 blocks keys: 0.50 MiB; 29,000 caches: 0.25 MiB, and their ``RangeSet``s' C
arrays, 16 bytes a range); kept as dicts of tuples and an object per cache, it cost 8.7, 5.0 and
9.2 MiB. ``tests/transport/test_table.py`` holds it under 1 MiB.
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_left
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from llm_datadist import _core, _io
from llm_datadist.transport.errors import S, fail
from llm_datadist.transport.wire import ProtocolError

#: The kinds of cache a registry exports (``engine.values.CONTIGUOUS``, ``BLOCKS`` and ``MIX``).
CACHE_KINDS = ("cache", "blocks", "mix")
#: The kinds of row key (``CacheKey.owner_key()``), in the order the key columns sort them.
KEY_KINDS = ("req", "prefix")
_KIND_CODES = {kind: code for code, kind in enumerate(KEY_KINDS)}

#: Flag bits of a cache (``CacheColumns._flags``) and of a row key (``RemoteTable._key_flags``).
#: A cache's kind is the index in ``CACHE_KINDS`` shifted by ``_KIND_SHIFT``.
_DEVICE_PLACEMENT, _HOST_ADDRESSABLE, _KIND_SHIFT = 1, 2, 2
_CONSUMABLE, _FORGOTTEN = 1, 2

_UNSIGNED = [(code, (1 << (8 * array(code).itemsize)) - 1) for code in "BHIQ"]


def _column(values: List[int]) -> array:
    """``values`` (integers in [0, 2**64)) in the narrowest unsigned array that holds them all."""
    top = max(values, default=0)
    code = next(code for code, limit in _UNSIGNED if top <= limit)
    return array(code, values)


def _int(value: Any, what: str, lo: int = 0, hi: int = 2**64 - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ProtocolError(f"cache table: {what} {value!r} is not an integer in [{lo}, {hi}]")
    return value


class RemoteCache:
    """One cache of a peer's table, as the planners see it. ``layout`` (a
    ``_core.CacheLayout`` over the owner's addresses) is made when first asked for."""

    __slots__ = ("cache_id", "kind", "placement", "num_tensors", "num_rows", "row_bytes", "addrs",
                 "host_addressable", "_layout")

    def __init__(self, cache_id: int, kind: str, placement: int, num_rows: int, row_bytes: int,
                 addrs: Sequence[int], host_addressable: bool) -> None:
        self.cache_id = cache_id
        self.kind = kind
        self.placement = placement
        self.num_tensors = len(addrs)
        self.num_rows = num_rows
        self.row_bytes = row_bytes
        self.addrs = addrs  # array('Q'): 8 bytes an address
        self.host_addressable = host_addressable
        self._layout = None

    @property
    def tensor_bytes(self) -> int:
        return self.num_rows * self.row_bytes

    @property
    def layout(self):
        layout = self._layout
        if layout is None:
            layout = self._layout = _core.CacheLayout(self.addrs, self.num_rows, self.row_bytes)
        return layout

    def __repr__(self) -> str:
        return (f"RemoteCache(cache_id={self.cache_id}, kind={self.kind!r}, placement={self.placement}, "
                f"num_tensors={self.num_tensors}, num_rows={self.num_rows}, row_bytes={self.row_bytes}, "
                f"host_addressable={self.host_addressable})")


class CacheColumns(Mapping):
    """A peer's caches by cache_id, kept in columns. Looking one up (``[]``, ``get``) makes its
    ``RemoteCache`` once and keeps it (its ``layout`` is what block routes are checked against,
    by identity); iterating ``values()`` makes none to keep, so a walk over every cache of the
    table (cuda_ipc's spans) does not leave one object per cache behind."""

    def __init__(self, ids: array, flags: array, num_rows: array, row_bytes: array, addr_start: array,
                 addrs: array) -> None:
        self._ids, self._flags, self._num_rows, self._row_bytes = ids, flags, num_rows, row_bytes
        self._addr_start, self._addrs = addr_start, addrs
        self._named: Dict[int, RemoteCache] = {}
        self._lock = threading.Lock()

    def _index(self, cache_id: Any) -> int:
        ids = self._ids
        i = bisect_left(ids, cache_id) if isinstance(cache_id, int) else len(ids)
        return i if i < len(ids) and ids[i] == cache_id else -1

    def _make(self, i: int) -> RemoteCache:
        flags = self._flags[i]
        addrs = array("Q", self._addrs[self._addr_start[i]:self._addr_start[i + 1]])
        return RemoteCache(self._ids[i], CACHE_KINDS[flags >> _KIND_SHIFT], int(bool(flags & _DEVICE_PLACEMENT)),
                           self._num_rows[i], self._row_bytes[i], addrs, bool(flags & _HOST_ADDRESSABLE))

    def __getitem__(self, cache_id: Any) -> RemoteCache:
        cache = self._named.get(cache_id)
        if cache is not None:
            return cache
        i = self._index(cache_id)
        if i < 0:
            raise KeyError(cache_id)
        with self._lock:
            cache = self._named.get(cache_id)
            if cache is None:
                cache = self._make(i)
                cache.layout  # noqa: B018 - made once, under the lock: routes compare it by identity
                self._named[cache_id] = cache
        return cache

    def __contains__(self, cache_id: Any) -> bool:
        return self._index(cache_id) >= 0

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def values(self) -> Iterator[RemoteCache]:  # type: ignore[override]
        for i, cache_id in enumerate(self._ids):
            yield self._named.get(cache_id) or self._make(i)

    def spans(self) -> Iterator[Tuple[int, int, bool]]:
        """``(address, tensor bytes, host addressable)`` of every tensor of every cache."""
        start, addrs = self._addr_start, self._addrs
        for i in range(len(self._ids)):
            nbytes, host = self._num_rows[i] * self._row_bytes[i], bool(self._flags[i] & _HOST_ADDRESSABLE)
            for j in range(start[i], start[i + 1]):
                yield addrs[j], nbytes, host


def _parse_caches(entries) -> CacheColumns:
    caches = []
    for cache_id, kind, placement, num_tensors, num_rows, row_bytes, addrs, host_ok in entries:
        cache_id = _int(cache_id, "cache_id", 1, 2**63 - 1)
        if kind not in CACHE_KINDS:
            raise ProtocolError(f"cache table: cache {cache_id} is of kind {kind!r}, not one of {CACHE_KINDS}")
        if len(addrs) != _int(num_tensors, "num_tensors", 1, 2**32 - 1):
            raise ProtocolError(f"cache table: cache {cache_id} lists {len(addrs)} addresses for {num_tensors} "
                                f"tensors")
        num_rows, row_bytes = _int(num_rows, "num_rows", 1), _int(row_bytes, "row_bytes", 1)
        if num_rows * row_bytes > 2**64 - 1:
            raise ProtocolError(f"cache table: cache {cache_id}: {num_rows} rows of {row_bytes} bytes overflow "
                                f"64 bits")
        flags = ((_DEVICE_PLACEMENT if _int(placement, "placement", 0, 1) else 0)
                 | (_HOST_ADDRESSABLE if host_ok else 0) | CACHE_KINDS.index(kind) << _KIND_SHIFT)
        caches.append((cache_id, flags, num_rows, row_bytes, [_int(a, "tensor address", 1) for a in addrs]))
    caches.sort(key=lambda cache: cache[0])
    for before, after in zip(caches, caches[1:]):
        if before[0] == after[0]:
            raise ProtocolError(f"cache table: cache {after[0]} is listed twice")
    addr_start, addrs = [0], []
    for cache in caches:
        addrs.extend(cache[4])
        addr_start.append(len(addrs))
    return CacheColumns(*(_column([cache[field] for cache in caches]) for field in range(4)),
                        _column(addr_start), _column(addrs))


class RemoteTable:
    """A peer's caches, parsed and checked (a malformed table fails the link or transfer).

    Kept compact (see the module's docstring): ``caches`` is a ``CacheColumns``; the blocks keys
    and the row keys are columns searched with ``bisect``, and the reply itself is not kept. What
    a peer can make a link hold is bounded by the table reply's byte budget
    (``budgets.DEFAULT_MAX_TABLE_BYTES``), checked before the reply is read. A key, model_id or
    cache_id listed twice, or two keys naming one row, is a malformed table."""

    def __init__(self, data: Dict[str, Any]) -> None:
        try:
            self.generation = _int(data["generation"], "generation")
            self.caches = _parse_caches(data["caches"])
            self._parse_blocks(data["blocks"])
            self._parse_keys(data["keys"])
            #: Every cache's memory, and the part of it that the owner's host cannot address.
            spans = list(self.caches.spans())
            self.ranges = _io.RangeSet((addr, nbytes) for addr, nbytes, _ in spans)
            self.device_ranges = _io.RangeSet((addr, nbytes) for addr, nbytes, host in spans if not host)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed cache table: {exc!r}") from None
        except Exception as exc:  # an unforeseen refusal of a value
            if isinstance(exc, ProtocolError):
                raise
            raise ProtocolError(f"malformed cache table: {exc}") from None

    def _parse_blocks(self, entries) -> None:
        pairs = [(_int(model_id, "model_id"), _int(cache_id, "cache_id", 1)) for model_id, cache_id in entries]
        pairs.sort()
        for before, after in zip(pairs, pairs[1:]):
            if before[0] == after[0]:
                raise ProtocolError(f"cache table: blocks key of model_id {after[0]} is listed twice")
        self._block_models = _column([model_id for model_id, _ in pairs])
        self._block_caches = _column([cache_id for _, cache_id in pairs])

    def _parse_keys(self, entries) -> None:
        keys = []
        for kind, ident, model_id, cache_id, row, consumable in entries:
            code = _KIND_CODES.get(kind) if isinstance(kind, str) else None
            if code is None:
                raise ProtocolError(f"cache table: key kind {kind!r}")
            keys.append((code, _int(ident, "key id"), _int(model_id, "model_id"), _int(cache_id, "cache_id", 1),
                         _int(row, "row"), _CONSUMABLE if consumable and kind == "req" else 0))
        keys.sort()
        for before, after in zip(keys, keys[1:]):
            if before[:3] == after[:3]:
                raise ProtocolError(f"cache table: key {(KEY_KINDS[after[0]], *after[1:3])} is listed twice")
        self._key_kinds, self._key_idents, self._key_models, self._key_caches, self._key_rows = (
            _column([key[field] for key in keys]) for field in range(5))
        self._key_flags = bytearray(key[5] for key in keys)
        #: The key columns' indices ordered by (cache_id, row): which key names a row.
        by_row = sorted(zip(self._key_caches, self._key_rows, range(len(keys))))
        for before, after in zip(by_row, by_row[1:]):
            if before[:2] == after[:2]:
                raise ProtocolError(f"cache table: row {after[1]} of cache {after[0]} is bound to two keys")
        self._keys_by_row = _column([i for _, _, i in by_row])

    def device_side(self, plan, dst_side: bool) -> bool:
        """Whether the ``dst_side`` (or source) ranges of ``plan``, this peer's side of a
        transfer, are device memory that its host cannot address: True when every one lies in
        ``device_ranges``, False when none meets them. A plan with both kinds is refused
        (``LLM_KV_CACHE_NOT_EXIST``, as for memory the peer has not registered): one transfer
        is moved by one plane."""
        device = self.device_ranges
        if not len(device) or not device.overlaps(plan, dst_side):
            return False
        bad = device.first_outside(plan, dst_side)
        if bad < 0:
            return True
        raise fail(S.LLM_KV_CACHE_NOT_EXIST, f"descriptor {bad} of a transfer names host memory while others "
                                             f"name device memory of the peer; one transfer must lie wholly in "
                                             f"one kind of memory")

    # -- lookups ------------------------------------------------------------------------------------
    def cache(self, cache_id: int) -> Optional[RemoteCache]:
        return self.caches.get(cache_id)

    def blocks_cache(self, model_id: int) -> Optional[RemoteCache]:
        models = self._block_models
        i = bisect_left(models, model_id) if isinstance(model_id, int) else len(models)
        if i == len(models) or models[i] != model_id:
            return None
        return self.caches.get(self._block_caches[i])

    def _key_index(self, owner_key: tuple) -> int:
        """The index of ``owner_key`` in the key columns, or -1 (forgotten keys included)."""
        try:
            kind, ident, model_id = owner_key
        except (TypeError, ValueError):
            return -1
        code = _KIND_CODES.get(kind) if isinstance(kind, str) else None
        if code is None or not isinstance(ident, int) or not isinstance(model_id, int):
            return -1
        kinds, idents, models = self._key_kinds, self._key_idents, self._key_models
        target = (code, ident, model_id)
        i = bisect_left(range(len(kinds)), target, key=lambda j: (kinds[j], idents[j], models[j]))
        if i == len(kinds) or (kinds[i], idents[i], models[i]) != target:
            return -1
        return i

    def key(self, owner_key: tuple) -> Optional[Tuple[RemoteCache, int]]:
        """The cache and row bound to ``owner_key``, or None (unbound, forgotten, or naming a
        cache the table does not list)."""
        i = self._key_index(owner_key)
        if i < 0 or self._key_flags[i] & _FORGOTTEN:
            return None
        cache = self.caches.get(self._key_caches[i])
        return None if cache is None else (cache, self._key_rows[i])

    def consumable_key(self, cache_id: int, row: int) -> Optional[tuple]:
        """The req key of an allocated cache bound to ``row`` of ``cache_id`` (one the owner
        releases once every tensor of the row was pulled), or None."""
        caches, rows, by_row = self._key_caches, self._key_rows, self._keys_by_row
        target = (cache_id, row)
        at = bisect_left(range(len(by_row)), target, key=lambda j: (caches[by_row[j]], rows[by_row[j]]))
        if at == len(by_row):
            return None
        i = by_row[at]
        if (caches[i], rows[i]) != target or self._key_flags[i] & (_CONSUMABLE | _FORGOTTEN) != _CONSUMABLE:
            return None
        return KEY_KINDS[self._key_kinds[i]], self._key_idents[i], self._key_models[i]

    def forget_key(self, owner_key: tuple) -> None:
        """The owner released ``owner_key``: a later lookup of it misses (until a refresh)."""
        i = self._key_index(owner_key)
        if i >= 0:
            self._key_flags[i] |= _FORGOTTEN
