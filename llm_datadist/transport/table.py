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
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

from llm_datadist import _core, _io
from llm_datadist.transport.errors import S, fail
from llm_datadist.transport.wire import ProtocolError


@dataclass
class RemoteCache:
    cache_id: int
    kind: str
    placement: int
    num_tensors: int
    num_rows: int
    row_bytes: int
    addrs: Sequence[int]  # array('Q'): 8 bytes an address
    host_addressable: bool
    layout: Any  # _core.CacheLayout over the owner's addresses

    @property
    def tensor_bytes(self) -> int:
        return self.num_rows * self.row_bytes


def _int(value: Any, what: str, lo: int = 0, hi: int = 2**64 - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ProtocolError(f"cache table: {what} {value!r} is not an integer in [{lo}, {hi}]")
    return value


class RemoteTable:
    """A peer's caches, parsed and checked (a malformed table fails the link or transfer).

    Kept compact: each cache's tensor addresses in an ``array('Q')`` (and the C arrays of its
    ``layout`` and the table's range sets), not the reply's lists; the reply itself is not kept.
    What a peer can make a link hold is bounded by the table reply's byte budget
    (``budgets.DEFAULT_MAX_TABLE_BYTES``), checked before the reply is read."""

    def __init__(self, data: Dict[str, Any]) -> None:
        try:
            self.generation = _int(data["generation"], "generation")
            self.caches: Dict[int, RemoteCache] = {}
            for entry in data["caches"]:
                cache_id, kind, placement, num_tensors, num_rows, row_bytes, addrs, host_ok = entry
                cache_id = _int(cache_id, "cache_id", 1, 2**63 - 1)
                addrs = array("Q", [_int(a, "tensor address", 1) for a in addrs])
                if len(addrs) != _int(num_tensors, "num_tensors", 1, 2**32 - 1):
                    raise ProtocolError(f"cache table: cache {cache_id} lists {len(addrs)} addresses "
                                        f"for {num_tensors} tensors")
                num_rows = _int(num_rows, "num_rows", 1)
                row_bytes = _int(row_bytes, "row_bytes", 1)
                self.caches[cache_id] = RemoteCache(
                    cache_id, str(kind), _int(placement, "placement", 0, 1), len(addrs), num_rows,
                    row_bytes, addrs, bool(host_ok), _core.CacheLayout(addrs, num_rows, row_bytes))
            self.blocks: Dict[int, int] = {_int(m, "model_id"): _int(c, "cache_id", 1)
                                           for m, c in data["blocks"]}
            self.keys: Dict[tuple, Tuple[int, int]] = {}
            self.consumable: set = set()
            for kind, ident, model_id, cache_id, row, consumable in data["keys"]:
                if kind not in ("req", "prefix"):
                    raise ProtocolError(f"cache table: key kind {kind!r}")
                key = (kind, _int(ident, "key id"), _int(model_id, "model_id"))
                self.keys[key] = (_int(cache_id, "cache_id", 1), _int(row, "row"))
                if consumable and kind == "req":
                    self.consumable.add(key)
            self.row_keys = {entry: key for key, entry in self.keys.items()}
            #: Every cache's memory, and the part of it that the owner's host cannot address.
            self.ranges = _io.RangeSet((addr, c.tensor_bytes) for c in self.caches.values()
                                           for addr in c.addrs)
            self.device_ranges = _io.RangeSet((addr, c.tensor_bytes) for c in self.caches.values()
                                                  if not c.host_addressable for addr in c.addrs)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed cache table: {exc!r}") from None
        except Exception as exc:  # CacheLayout refusing a geometry
            if isinstance(exc, ProtocolError):
                raise
            raise ProtocolError(f"malformed cache table: {exc}") from None

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

    def forget_key(self, owner_key: tuple) -> None:
        entry = self.keys.pop(owner_key, None)
        self.consumable.discard(owner_key)
        if entry is not None:
            self.row_keys.pop(entry, None)

    def cache(self, cache_id: int) -> Optional[RemoteCache]:
        return self.caches.get(cache_id)

    def blocks_cache(self, model_id: int) -> Optional[RemoteCache]:
        cache_id = self.blocks.get(model_id)
        return None if cache_id is None else self.caches.get(cache_id)

    def key(self, owner_key: tuple) -> Optional[Tuple[RemoteCache, int]]:
        entry = self.keys.get(owner_key)
        if entry is None or entry[0] not in self.caches:
            return None
        return self.caches[entry[0]], entry[1]
