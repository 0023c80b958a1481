"""A peer's cache table as this side keeps it (``transport.table.RemoteTable``).

- every lookup (``cache``, ``blocks_cache``, ``key``, ``consumable_key``, ``forget_key``) answers
  as a plain-dict reading of the same reply would (``DictTable``, the oracle), on random tables;
- a malformed table is a ``ProtocolError``: a value out of range, an unknown kind, a key,
  model_id or cache_id listed twice, two keys naming one row;
- the largest reply the table budget admits, of each kind of content, is kept in under
  ``KEPT_BOUND`` of Python memory (``tracemalloc``): the columns take 0.25 to 0.5 MiB where the
  former dicts of tuples took 5 to 9 MiB.
"""

from __future__ import annotations

import gc
import json
import tracemalloc
from typing import Any, Dict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_datadist.transport import budgets
from llm_datadist.transport.table import RemoteTable
from llm_datadist.transport.wire import ProtocolError

MiB = 1 << 20
#: Python memory a table kept from a reply of ``DEFAULT_MAX_TABLE_BYTES`` may take.
KEPT_BOUND = 1 * MiB
U64 = 2**64 - 1


class DictTable:
    """The oracle: the reply read into dicts, as the table was kept before it became columns."""

    def __init__(self, data: Dict[str, Any]) -> None:
        self.caches = {entry[0]: entry for entry in data["caches"]}
        self.blocks = dict(map(tuple, data["blocks"]))
        self.keys = {(k[0], k[1], k[2]): (k[3], k[4]) for k in data["keys"]}
        self.consumable = {(k[0], k[1], k[2]) for k in data["keys"] if k[5] and k[0] == "req"}

    def cache(self, cache_id):
        return self.caches.get(cache_id)

    def key(self, owner_key):
        entry = self.keys.get(owner_key)
        return None if entry is None or entry[0] not in self.caches else entry

    def consumable_key(self, cache_id, row):
        return next((key for key, entry in self.keys.items() if entry == (cache_id, row) and key in self.consumable),
                    None)

    def forget_key(self, owner_key):
        self.keys.pop(owner_key, None)
        self.consumable.discard(owner_key)


def _same_cache(kept, entry) -> bool:
    if entry is None:
        return kept is None
    cache_id, kind, placement, num_tensors, num_rows, row_bytes, addrs, host_ok = entry
    return (kept is not None and (kept.cache_id, kept.kind, kept.placement, kept.num_tensors, kept.num_rows,
                                  kept.row_bytes, list(kept.addrs), kept.host_addressable)
            == (cache_id, kind, placement, num_tensors, num_rows, row_bytes, addrs, host_ok)
            and list(kept.layout.tensor_addrs) == addrs and kept.layout.tensor_bytes == num_rows * row_bytes)


def _merged(spans):
    """``(start, end)`` spans sorted, overlapping and touching ones merged (as ``RangeSet.spans``)."""
    merged = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


@st.composite
def tables(draw):
    """A well-formed reply: caches with distinct ids, blocks keys with distinct model_ids, row
    keys with distinct keys and rows (some naming caches the table does not list)."""
    ids = draw(st.lists(st.sampled_from([1, 2, 3, 7, 2**40, 2**63 - 1]), unique=True, max_size=5))
    caches = []
    for cache_id in ids:
        count = draw(st.integers(1, 3))
        addrs = draw(st.lists(st.integers(1, 2**48), min_size=count, max_size=count))
        caches.append([cache_id, draw(st.sampled_from(["cache", "blocks", "mix"])), draw(st.integers(0, 1)), count,
                       draw(st.integers(1, 8)), draw(st.sampled_from([1, 64, 4096])), addrs, draw(st.booleans())])
    known = ids + [5]
    blocks = [[model_id, draw(st.sampled_from(known))]
              for model_id in draw(st.lists(st.sampled_from([0, 1, 9, 2**32, U64]), unique=True, max_size=4))]
    owner_keys = draw(st.lists(st.tuples(st.sampled_from(["req", "prefix"]), st.sampled_from([0, 1, 2**33, U64]),
                                         st.sampled_from([0, 3, U64])), unique=True, max_size=8))
    rows = draw(st.lists(st.tuples(st.sampled_from(known), st.integers(0, 300)), unique=True,
                         min_size=len(owner_keys), max_size=len(owner_keys)))
    keys = [[*key, cache_id, row, draw(st.booleans())] for key, (cache_id, row) in zip(owner_keys, rows)]
    return {"generation": draw(st.integers(0, U64)), "caches": caches, "blocks": blocks, "keys": keys}


@settings(max_examples=150, deadline=None)
@given(tables(), st.data())
def test_lookups_answer_as_the_dicts_did(data, draw):
    table, oracle = RemoteTable(json.loads(json.dumps(data))), DictTable(data)
    assert table.generation == data["generation"]
    assert sorted(table.caches) == sorted(oracle.caches) and len(table.caches) == len(oracle.caches)
    for cache_id in [*oracle.caches, 0, 4, 5, 2**64, -1]:
        assert _same_cache(table.cache(cache_id), oracle.cache(cache_id))
    assert sorted(c.cache_id for c in table.caches.values()) == sorted(oracle.caches)
    spans = {True: [], False: []}
    for _, _, _, _, rows, row_bytes, addrs, host_ok in oracle.caches.values():
        spans[bool(host_ok)] += [(addr, addr + rows * row_bytes) for addr in addrs]
    assert table.ranges.spans() == _merged(spans[True] + spans[False])
    assert table.device_ranges.spans() == _merged(spans[False])
    for model_id in [0, 1, 2, 9, 2**32, U64, 2**64]:
        assert _same_cache(table.blocks_cache(model_id), oracle.cache(oracle.blocks.get(model_id)))
    probes = [*oracle.keys, ("req", 5, 0), ("prefix", 1, 1), ("other", 0, 0), ("req", "1", 0)]
    bound_rows = [entry for entry in oracle.keys.values()] + [(1, 301), (6, 0)]
    for _ in range(3):  # forget some keys, as a consuming pull does, and ask again
        for key in probes:
            found, expected = table.key(key), oracle.key(key)
            assert (found is None) == (expected is None)
            if found is not None:
                assert (found[0].cache_id, found[1]) == expected and found[0] is table.cache(expected[0])
        for cache_id, row in bound_rows:
            assert table.consumable_key(cache_id, row) == oracle.consumable_key(cache_id, row)
        for key in draw.draw(st.lists(st.sampled_from(probes), max_size=3)):
            table.forget_key(key)
            oracle.forget_key(key)


def test_a_named_cache_is_made_once_and_its_layout_kept():
    table = RemoteTable({"generation": 1, "blocks": [[4, 2]], "keys": [["req", 1, 0, 2, 0, True]],
                         "caches": [[2, "blocks", 0, 1, 4, 64, [4096], True]]})
    first = table.cache(2)
    assert table.blocks_cache(4) is first and table.key(("req", 1, 0))[0] is first
    assert table.cache(2).layout is first.layout


def _valid() -> Dict[str, Any]:
    return {"generation": 1, "blocks": [[0, 1]], "keys": [["req", 1, 0, 1, 0, True]],
            "caches": [[1, "blocks", 0, 2, 4, 64, [4096, 8192], True]]}


def _changed(path, value) -> Dict[str, Any]:
    """``_valid()`` with the item at ``path`` set to ``value`` (an index one past a list's end
    appends it)."""
    data = _valid()
    where = data
    for step in path[:-1]:
        where = where[step]
    if isinstance(where, list) and path[-1] == len(where):
        where.append(value)
    else:
        where[path[-1]] = value
    return data


MALFORMED = {
    "generation": (_changed(["generation"], -1), "generation"),
    "cache_id 0": (_changed(["caches", 0, 0], 0), "cache_id"),
    "cache kind": (_changed(["caches", 0, 1], "rows"), "kind"),
    "placement": (_changed(["caches", 0, 2], 2), "placement"),
    "tensor count": (_changed(["caches", 0, 3], 3), "addresses for 3 tensors"),
    "address 0": (_changed(["caches", 0, 6], [0, 1]), "tensor address"),
    "overflowing geometry": (_changed(["caches", 0, 4], 2**63), "overflow 64 bits"),
    "address space": (_changed(["caches", 0, 6], [U64 - 10, 1]), "address space"),
    "key kind": (_changed(["keys", 0, 0], "lease"), "key kind"),
    "key id": (_changed(["keys", 0, 1], 2**64), "key id"),
    "key as bool": (_changed(["keys", 0, 2], True), "model_id"),
    "blocks model_id": (_changed(["blocks", 0, 0], -1), "model_id"),
    "short key": (_changed(["keys", 0], ["req", 1, 0, 1, 0]), "row keys are not a list of lists of 6 fields"),
    "caches not a list": (_changed(["caches"], 5), "caches are not a list of lists of 8 fields"),
    "addresses not a list": (_changed(["caches", 0, 6], "ab"), "addresses of cache 1 are not a list"),
    "key kind not a string": (_changed(["keys", 0, 0], ["req"]), "key kind ['req']"),
    "no keys": ({"generation": 1, "caches": [], "blocks": []}, "malformed"),
    "cache twice": (_changed(["caches", 1], [1, "cache", 0, 1, 1, 1, [1 << 30], True]), "cache 1 is listed twice"),
    "model_id twice": (_changed(["blocks", 1], [0, 2]), "model_id 0 is listed twice"),
    "key twice": (_changed(["keys", 1], ["req", 1, 0, 1, 3, False]), "key ('req', 1, 0) is listed twice"),
    "row twice": (_changed(["keys", 1], ["prefix", 1, 0, 1, 0, False]), "row 0 of cache 1 is bound to two keys"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_table_is_a_protocol_error(name):
    data, says = MALFORMED[name]
    with pytest.raises(ProtocolError, match="cache table") as raised:
        RemoteTable(data)
    assert says in str(raised.value)


def test_a_well_formed_table_with_the_same_entries_is_taken():
    data = _valid()
    data["caches"].append([2, "cache", 1, 1, 1, 1, [1 << 30], False])
    data["blocks"].append([1, 2])
    data["keys"] += [["req", 1, 1, 1, 1, False], ["prefix", 1, 0, 2, 0, False]]
    table = RemoteTable(data)
    assert table.key(("req", 1, 1)) and table.key(("prefix", 1, 0))[0].cache_id == 2
    assert table.consumable_key(1, 0) == ("req", 1, 0) and table.consumable_key(1, 1) is None


# -- what a table at the budget keeps ---------------------------------------------------------------

def _largest(make) -> Dict[str, Any]:
    """``make(n)`` for the largest ``n`` whose JSON fits the default table budget."""
    lo, hi = 1, 1 << 18
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(json.dumps(make(mid), separators=(",", ":"))) <= budgets.DEFAULT_MAX_TABLE_BYTES:
            lo = mid
        else:
            hi = mid - 1
    return json.loads(json.dumps(make(lo)))


ONE_CACHE = [[1, "blocks", 0, 1, 1 << 20, 64, [1 << 32], True]]
AT_THE_BUDGET = {
    # one entry each, as small as JSON writes them: the most entries a reply can carry
    "row keys": lambda n: {"generation": 1, "caches": ONE_CACHE, "blocks": [],
                           "keys": [["req", i, 0, 1, i, True] for i in range(n)]},
    "wide row keys": lambda n: {"generation": 1, "caches": ONE_CACHE, "blocks": [],
                                "keys": [["req", U64 - i, U64, 1, i << 20, True] for i in range(n)]},
    "blocks keys": lambda n: {"generation": 1, "caches": ONE_CACHE, "blocks": [[i, 1] for i in range(n)],
                              "keys": []},
    "caches": lambda n: {"generation": 1, "blocks": [], "keys": [],
                         "caches": [[i + 1, "cache", 1, 1, 1, 1, [2 * i + 1], False] for i in range(n)]},
}


@pytest.mark.parametrize("content", list(AT_THE_BUDGET))
def test_a_table_at_the_budget_is_kept_in_under_a_mebibyte(content):
    data = _largest(AT_THE_BUDGET[content])
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        table = RemoteTable(data)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert table.generation == 1
    assert kept < KEPT_BOUND, f"{content}: {kept / MiB:.2f} MiB kept"
