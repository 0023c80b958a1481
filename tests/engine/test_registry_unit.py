"""``engine.registry.Registry`` alone, without an ``LLMDataDist`` or links: records, keys, pools,
pins, shared ranges and the generation, and what its owner hears (``on_registered`` /
``on_unregistered``)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from llm_datadist import _core, _io
from llm_datadist._memory import Place
from llm_datadist.data_type import DataType
from llm_datadist.engine import values
from llm_datadist.engine.registry import Registry
from llm_datadist.status import LLMException, LLMStatusCode

CLUSTER = 7
TENSOR_BYTES = 4096  # 4 rows of 1024 bytes
BASE = 0x7000_0000_0000


class Owner:
    """What the registry's owner hears, and in what state the registry is when it does."""

    def __init__(self) -> None:
        self.registered = []
        self.unregistered = []
        self.registry = Registry(CLUSTER, self.on_registered, self.on_unregistered)

    def on_registered(self, record) -> None:
        self.registered.append(record.cache_id)

    def on_unregistered(self, record) -> None:
        with self.registry.pinned(_io.plan_from_wire(b""), True) as (ranges, _, _):
            still_shared = ranges.contains(record.addrs[0], 1)
        self.unregistered.append((record.cache_id, self.registry.holds(record), still_shared))


def record(slot: int, num_tensors: int = 2, registered: bool = True, placement: Place = Place.HOST,
           kind: str = values.BLOCKS):
    addrs = [BASE + (slot * 8 + t) * TENSOR_BYTES for t in range(num_tensors)]
    return values.new_record(num_tensors, (4, 1024), TENSOR_BYTES, DataType.DT_INT8, placement, kind,
                             addrs, registered, -1)


def shared(registry: Registry, addr: int, device: bool = False) -> bool:
    with registry.pinned(_io.plan_from_wire(b""), True) as (host_ranges, _, device_ranges):
        return (device_ranges if device else host_ranges).contains(addr, 1)


def status_of(raised) -> LLMStatusCode:
    return raised.value.status_code


@pytest.fixture
def owner() -> Owner:
    owner = Owner()
    yield owner
    owner.registry.close()


def test_commit_numbers_records_and_shares_their_memory(owner):
    registry = owner.registry
    first, second = registry.commit(record(0)), registry.commit(record(1), blocks_model_id=3)
    assert (first.cache_id, second.cache_id) == (1, 2)
    assert owner.registered == [1, 2]
    assert registry.lookup(2) is second and registry.find_blocks_key(3) is second
    assert all(shared(registry, addr) for addr in first.addrs + second.addrs)
    assert not shared(registry, BASE + 64 * TENSOR_BYTES)
    table = registry.export_table()
    assert [entry[0] for entry in table["caches"]] == [1, 2]
    assert table["caches"][1] == [2, values.BLOCKS, int(Place.HOST), 2, 4, 1024, second.addrs, True]
    assert table["blocks"] == [[3, 2]]
    with pytest.raises(LLMException) as raised:
        registry.lookup(3)
    assert status_of(raised) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST and f"cluster {CLUSTER}" in str(raised.value)


def test_row_keys_are_bound_once_and_a_refused_commit_changes_nothing(owner):
    registry = owner.registry
    first = registry.commit(record(0, registered=False), [("k", 1, 0), None, ("k", 1, 2)])
    assert registry.find_key(("k", 1, 0)) == (first, 0) and registry.find_key(("k", 1, 2)) == (first, 2)
    generation = registry.generation_word.value
    with pytest.raises(LLMException) as raised:
        registry.commit(record(1, registered=False), [("k", 1, 2)])
    assert status_of(raised) == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException):
        registry.commit(record(2), [("a", 0, 0)] * 5)  # more keys than rows
    assert owner.registered == [1] and not shared(registry, record(1).addrs[0])
    assert registry.generation_word.value == generation
    assert registry.commit(record(3)).cache_id == 2  # no cache_id was used up
    keys = registry.export_table()["keys"]
    assert sorted(keys) == [["k", 1, 0, 1, 0, True], ["k", 1, 2, 1, 2, True]]


def test_unregister_removes_the_record_before_the_owner_hears_of_it(owner):
    registry = owner.registry
    kept, gone = registry.commit(record(0)), registry.commit(record(1), [("r", 0, 0)], blocks_model_id=9)
    generation = registry.generation_word.value
    registry.unregister(gone.cache_id)
    assert owner.unregistered == [(gone.cache_id, False, False)]
    assert registry.generation_word.value == generation + 1
    with pytest.raises(LLMException):
        registry.lookup(gone.cache_id)
    with pytest.raises(LLMException):
        registry.find_key(("r", 0, 0))
    with pytest.raises(LLMException):
        registry.find_blocks_key(9)
    assert registry.lookup(kept.cache_id) is kept and shared(registry, kept.addrs[0])
    registry.unregister(gone.cache_id)  # a second time: nothing happens
    assert len(owner.unregistered) == 1
    allocated = registry.commit(record(2, registered=False))
    with pytest.raises(LLMException) as raised:
        registry.unregister(allocated.cache_id)
    assert status_of(raised) == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException):
        registry.deallocate(kept.cache_id)  # registered memory is unregistered, not deallocated


def test_a_deallocated_id_lives_on_until_its_last_key_goes(owner):
    registry = owner.registry
    registry.open(None, {Place.HOST: values.MemoryPool(10 * TENSOR_BYTES), Place.DEVICE: None})
    charged = registry.reserve(Place.HOST, 2 * TENSOR_BYTES)
    rec = record(0, registered=False, kind=values.CONTIGUOUS)
    rec.pool_bytes = charged
    registry.commit(rec, [("k", 0, 0), ("k", 0, 1)])
    with pytest.raises(LLMException):
        registry.deallocate(rec.cache_id, blocks=True)  # a contiguous cache, not a blocks cache
    registry.deallocate(rec.cache_id)
    assert rec.id_released and owner.unregistered == []
    with pytest.raises(LLMException):
        registry.lookup(rec.cache_id)
    assert registry.find_key(("k", 0, 1)) == (rec, 1)
    registry.remove_key(("k", 0, 0))
    assert owner.unregistered == [] and registry.pools[Place.HOST].used == 2 * TENSOR_BYTES
    registry.remove_key(("k", 0, 1))
    assert owner.unregistered == [(rec.cache_id, False, False)]
    assert registry.pools[Place.HOST].used == 0 and rec.pool_bytes == 0


def test_a_key_is_consumed_once_every_tensor_was_pulled(owner):
    registry = owner.registry
    allocated = registry.commit(record(0, num_tensors=3, registered=False),
                                [("k", 1, 0), ("prefix", 1, 1)])
    registered = registry.commit(record(1), [("k", 2, 0)])
    assert not registry.consume_key(("k", 1, 0), [0, 2, 7])  # 7 is no tensor of the row
    assert registry.find_key(("k", 1, 0)) == (allocated, 0)
    assert registry.consume_key(("k", 1, 0), [1])
    with pytest.raises(LLMException):
        registry.find_key(("k", 1, 0))
    assert not registry.consume_key(("prefix", 1, 1), [0, 1, 2])
    assert not registry.consume_key(("k", 2, 0), [0, 1])
    assert registry.find_key(("prefix", 1, 1)) == (allocated, 1)
    assert registry.find_key(("k", 2, 0)) == (registered, 0)
    assert not registry.consume_key(("k", 9, 9), [0])


def test_pools_refuse_what_they_cannot_hold(owner):
    registry = owner.registry
    assert registry.reserve(Place.HOST, 1 << 40) == 0  # no pool configured: nothing is charged
    registry.open(None, {Place.HOST: None, Place.DEVICE: values.MemoryPool(1000)})
    assert registry.reserve(Place.DEVICE, 600) == 600
    with pytest.raises(LLMException) as raised:
        registry.reserve(Place.DEVICE, 401)
    assert status_of(raised) == LLMStatusCode.LLM_OUT_OF_MEMORY and "400 of 1000 free" in str(raised.value)
    registry.release(Place.DEVICE, 600)
    assert registry.reserve(Place.DEVICE, 1000) == 1000


def test_device_memory_the_host_cannot_address_is_shared_apart(owner):
    registry = owner.registry
    host, device = registry.commit(record(0)), record(1, placement=Place.DEVICE)
    assert not registry.device_only(device)  # no runtime yet
    registry.open(SimpleNamespace(host_addressable=False), {Place.HOST: None, Place.DEVICE: None})
    assert registry.device_only(device) and not registry.device_only(host)
    registry.commit(device)
    assert shared(registry, device.addrs[0], device=True) and not shared(registry, device.addrs[0])
    assert shared(registry, host.addrs[0]) and not shared(registry, host.addrs[0], device=True)
    assert [entry[-1] for entry in registry.export_table()["caches"]] == [True, False]


def test_unregister_waits_for_a_transfer_pinned_on_that_memory(owner):
    registry = owner.registry
    busy, other = registry.commit(record(0)), registry.commit(record(1))
    layout = _core.CacheLayout(busy.addrs, 4, 1024)
    plan = _core.plan_blocks(layout, layout, None, None, values.block_array([0], "s"),
                             values.block_array([1], "d"))
    pinned, release = threading.Event(), threading.Event()

    def transfer() -> None:
        with registry.pinned(plan, True):
            pinned.set()
            release.wait(10)
    thread = threading.Thread(target=transfer)
    thread.start()
    assert pinned.wait(10)
    registry.unregister(other.cache_id)  # other memory: not held up
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (registry.unregister(busy.cache_id), done.set()))
    waiter.start()
    assert not done.wait(0.3), "unregister returned while a transfer into its memory was pinned"
    assert not registry.holds(busy)  # gone from the registry: later transfers are refused
    release.set()
    assert done.wait(10)
    thread.join(10)
    waiter.join(10)


def test_unregister_behind_a_stalled_transfer_waits_for_its_deadline_then_cancels_it(owner):
    """A transfer pinned on the memory being unregistered that is still going at its deadline
    (0.5 s) is cancelled -- the transfer then fails and lets go -- and the unregister returns
    right after: not before the deadline, and not when the stalled transfer would have ended
    by itself (10 s)."""
    import time
    registry = owner.registry
    busy = registry.commit(record(0))
    layout = _core.CacheLayout(busy.addrs, 4, 1024)
    plan = _core.plan_blocks(layout, layout, None, None, values.block_array([0], "s"),
                             values.block_array([1], "d"))
    pinned, cancelled = threading.Event(), threading.Event()
    held_after_cancel = []

    def transfer() -> None:
        with registry.pinned(plan, True, time.monotonic() + 0.5, cancelled.set):
            pinned.set()
            cancelled.wait(10)  # a stalled receive, until its connection is shut down
            held_after_cancel.append(registry.holds(busy))
    thread = threading.Thread(target=transfer)
    thread.start()
    assert pinned.wait(10)
    started = time.monotonic()
    registry.unregister(busy.cache_id)
    took = time.monotonic() - started
    assert cancelled.is_set(), "the stalled transfer was not cancelled"
    assert 0.3 < took < 3, took
    thread.join(10)
    assert held_after_cancel == [False]


def test_close_returns_the_records_and_forgets_everything(owner):
    registry = owner.registry
    registry.open(None, {Place.HOST: values.MemoryPool(1 << 20), Place.DEVICE: None})
    a = record(0, registered=False)
    a.pool_bytes = registry.reserve(Place.HOST, 2 * TENSOR_BYTES)
    registry.commit(a, [("k", 0, 0)])
    b = registry.commit(record(1))
    assert registry.close() == [a, b]
    assert registry.export_table()["caches"] == [] and not shared(registry, b.addrs[0])
    assert registry.pools[Place.HOST].used == 0
    assert owner.unregistered == []  # closing is not unregistering: the owner releases memory itself
    with pytest.raises(LLMException):
        registry.lookup(b.cache_id)
    with pytest.raises(LLMException):
        registry.find_key(("k", 0, 0))


def test_a_pin_sees_the_generation_and_ranges_of_its_time():
    registry = Registry(CLUSTER)
    try:
        rec = registry.commit(record(0))
        plan = _io.plan_from_wire(b"")
        with registry.pinned(plan, True) as (ranges, generation, _):
            registry.unregister(rec.cache_id)  # an empty plan touches nothing: no wait
            assert ranges.contains(rec.addrs[0], 1) and not shared(registry, rec.addrs[0])
            assert registry.generation_word.value == generation + 1
        assert registry._pinned == {}
    finally:
        registry.close()
