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
9.2 MiB. ``tests/transport/test_table.py`` holds it under 1 MiB. Each field is checked over
its whole column at once (types, least and greatest value, duplicates through a set), so that
reading a table costs about what decoding its JSON does.
"""

from __future__ import annotations

import operator
import threading
from array import array
from bisect import bisect_left
from collections.abc import Mapping
from itertools import accumulate, chain, compress, repeat
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from llm_datadist import _core, _io
from llm_datadist.transport.errors import S, fail
from llm_datadist.transport.wire import ProtocolError

#: The kinds of cache a registry exports (``engine.values.CONTIGUOUS``, ``BLOCKS`` and ``MIX``).
CACHE_KINDS = ("cache", "blocks", "mix")
#: The kinds of row key (``CacheKey.owner_key()``), in the order the key columns sort them.
KEY_KINDS = ("req", "prefix")
_KIND_CODES = {kind: code for code, kind in enumerate(KEY_KINDS)}
_CACHE_KIND_CODES = {kind: code for code, kind in enumerate(CACHE_KINDS)}

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

    def tensors(self) -> Tuple[array, List[int], List[int]]:
        """Every tensor of every cache: the addresses, and in the same order the tensors' bytes
        and their caches' flags (``_HOST_ADDRESSABLE``, ...)."""
        counts = map(operator.sub, self._addr_start[1:], self._addr_start)
        per_cache = zip(map(operator.mul, self._num_rows, self._row_bytes), self._flags)
        per_tensor = list(chain.from_iterable(map(repeat, per_cache, counts)))
        return self._addrs, list(map(operator.itemgetter(0), per_tensor)), list(map(operator.itemgetter(1), per_tensor))


def _fields(entries: Any, count: int, what: str) -> List[list]:
    """The ``count`` fields of every entry of ``entries`` (a list of lists), as ``count``
    columns."""
    if type(entries) is not list or not set(map(type, entries)) <= {list} or not set(map(len, entries)) <= {count}:
        raise ProtocolError(f"cache table: the {what}s are not a list of lists of {count} fields")
    return [list(map(operator.itemgetter(field), entries)) for field in range(count)]


def _ordered(columns: Sequence[list], order: List[int]) -> List[list]:
    """Each of ``columns`` in ``order`` (a permutation of its indices)."""
    return [list(map(column.__getitem__, order)) for column in columns]


def _twice(values: Sequence[Any]) -> Any:
    """The first of ``values`` that an earlier one equals."""
    seen: set = set()
    return next(value for value in values if value in seen or seen.add(value))


def _checked(values: Sequence[Any], what: str, lo: int = 0, hi: int = 2**64 - 1) -> Sequence[int]:
    """``values``, each an integer (not a bool) in [``lo``, ``hi``]; else a ProtocolError naming
    the first that is not. The checks run in C over the whole column; the loop that names the
    culprit runs only when one fails."""
    if values and not (set(map(type, values)) <= {int} and lo <= min(values) and max(values) <= hi):
        for value in values:
            _int(value, what, lo, hi)
    return values


def _codes(values: Sequence[Any], codes: Dict[str, int], what: str) -> List[int]:
    """The code of each of ``values`` in ``codes``; a ProtocolError for the first unknown one."""
    try:
        return list(map(codes.__getitem__, values))
    except (KeyError, TypeError):
        bad = next(value for value in values if not isinstance(value, str) or value not in codes)
        raise ProtocolError(f"cache table: {what} {bad!r} is not one of {tuple(codes)}") from None


def _parse_caches(entries: Any) -> CacheColumns:
    ids, kinds, placements, counts, num_rows, row_bytes, addr_lists, host_ok = _fields(entries, 8, "cache")
    _checked(ids, "cache_id", 1, 2**63 - 1)
    kind_codes = _codes(kinds, _CACHE_KIND_CODES, "cache kind")
    _checked(placements, "placement", 0, 1)
    _checked(counts, "num_tensors", 1, 2**32 - 1)
    if not set(map(type, addr_lists)) <= {list} or list(map(len, addr_lists)) != list(counts):
        i = next(i for i, addrs in enumerate(addr_lists) if type(addrs) is not list or len(addrs) != counts[i])
        if type(addr_lists[i]) is not list:
            raise ProtocolError(f"cache table: the addresses of cache {ids[i]} are not a list")
        raise ProtocolError(f"cache table: cache {ids[i]} lists {len(addr_lists[i])} addresses for {counts[i]} "
                            f"tensors")
    _checked(num_rows, "num_rows", 1)
    _checked(row_bytes, "row_bytes", 1)
    if ids and max(map(operator.mul, num_rows, row_bytes)) > 2**64 - 1:
        i = next(i for i, nbytes in enumerate(map(operator.mul, num_rows, row_bytes)) if nbytes > 2**64 - 1)
        raise ProtocolError(f"cache table: cache {ids[i]}: {num_rows[i]} rows of {row_bytes[i]} bytes overflow "
                            f"64 bits")
    addrs = _checked(list(chain.from_iterable(addr_lists)), "tensor address", 1)
    if len(set(ids)) != len(ids):
        raise ProtocolError(f"cache table: cache {_twice(ids)} is listed twice")
    flags = [(_DEVICE_PLACEMENT if placement else 0) | (_HOST_ADDRESSABLE if host else 0) | code << _KIND_SHIFT
             for placement, host, code in zip(placements, host_ok, kind_codes)]
    addr_start = [0, *accumulate(counts)]
    order = sorted(range(len(ids)), key=ids.__getitem__)
    if order != list(range(len(ids))):  # as the owner's registry lists them, they are in order already
        ids, flags, num_rows, row_bytes, counts = _ordered((ids, flags, num_rows, row_bytes, counts), order)
        addrs = list(chain.from_iterable(addrs[addr_start[i]:addr_start[i + 1]] for i in order))
        addr_start = [0, *accumulate(counts)]
    return CacheColumns(_column(ids), _column(flags), _column(num_rows), _column(row_bytes), _column(addr_start),
                        _column(addrs))


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
            addrs, sizes, flags = self.caches.tensors()
            self.ranges = _io.RangeSet(zip(addrs, sizes))
            device = [not flag & _HOST_ADDRESSABLE for flag in flags]
            self.device_ranges = _io.RangeSet(compress(zip(addrs, sizes), device))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed cache table: {exc!r}") from None
        except Exception as exc:  # an unforeseen refusal of a value
            if isinstance(exc, ProtocolError):
                raise
            raise ProtocolError(f"malformed cache table: {exc}") from None

    def _parse_blocks(self, entries: Any) -> None:
        models, caches = _fields(entries, 2, "blocks key")
        _checked(models, "model_id")
        _checked(caches, "cache_id", 1)
        if len(set(models)) != len(models):
            raise ProtocolError(f"cache table: blocks key of model_id {_twice(models)} is listed twice")
        order = sorted(range(len(models)), key=models.__getitem__)
        self._block_models, self._block_caches = map(_column, _ordered((models, caches), order))

    def _parse_keys(self, entries: Any) -> None:
        kinds, idents, models, caches, rows, consumable = _fields(entries, 6, "row key")
        codes = _codes(kinds, _KIND_CODES, "key kind")
        _checked(idents, "key id")
        _checked(models, "model_id")
        _checked(caches, "cache_id", 1)
        _checked(rows, "row")
        keys = list(zip(codes, idents, models))
        if len(set(keys)) != len(keys):
            kind, ident, model_id = _twice(keys)
            raise ProtocolError(f"cache table: key {(KEY_KINDS[kind], ident, model_id)} is listed twice")
        bound = list(zip(caches, rows))
        if len(set(bound)) != len(bound):
            cache_id, row = _twice(bound)
            raise ProtocolError(f"cache table: row {row} of cache {cache_id} is bound to two keys")
        flags = [_CONSUMABLE if wanted and code == 0 else 0 for wanted, code in zip(consumable, codes)]
        order = sorted(range(len(keys)), key=keys.__getitem__)
        codes, idents, models, caches, rows, flags = _ordered((codes, idents, models, caches, rows, flags), order)
        self._key_kinds, self._key_idents, self._key_models, self._key_caches, self._key_rows = map(
            _column, (codes, idents, models, caches, rows))
        self._key_flags = bytearray(flags)
        #: The key columns' indices ordered by (cache_id, row): which key names a row.
        bound = list(zip(caches, rows))
        self._keys_by_row = _column(sorted(range(len(bound)), key=bound.__getitem__))

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
