"""The registry and the memory peers may touch stay one consistent thing.

Every register / unregister / allocate / deallocate either takes effect completely or, when it
raises, leaves the engine as it was: the cache records, their keys, the cache-id counter, the
table peers fetch (``export_table``) and the range set a TCP receive is checked against
(``_shared_ranges``). Addresses are checked before anything is committed: non-zero, and every
tensor inside the 64-bit address space (a tensor may end exactly at 2**64).

Both API styles run the same sequences; the engine's state is compared with a plain model after
every call.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llm_datadist as ld
from llm_datadist import _io, cpp
from llm_datadist.status import LLMException, LLMStatusCode

SUCCESS = int(LLMStatusCode.LLM_SUCCESS)
PARAM_INVALID = int(LLMStatusCode.LLM_PARAM_INVALID)
OUT_OF_MEMORY = int(LLMStatusCode.LLM_OUT_OF_MEMORY)
TOP = 2**64
POOL_BYTES = 64 * 1024
DT = ld.DataType.DT_UINT8


class InjectedFailure(MemoryError):
    """Raised by the fault injector in place of building a range set."""


# ------------------------------------------------------------------------------------------------
# The two API styles, reduced to what this module needs
# ------------------------------------------------------------------------------------------------

class PythonStyle:
    name = "python"

    def __init__(self, cluster_id: int = 7) -> None:
        self.dd = ld.LLMDataDist(ld.LLMRole.PROMPT, cluster_id)
        cfg = ld.LLMConfig()
        cfg.device_id = 0
        cfg.enable_cache_manager = True
        cfg.mem_pool_cfg = json.dumps({"memory_size": POOL_BYTES})
        cfg.host_mem_pool_cfg = json.dumps({"memory_size": POOL_BYTES})
        self.dd.init(cfg.generate_options())
        self.cm = self.dd.cache_manager
        self.engine = self.dd.engine

    def close(self) -> None:
        self.dd.finalize()

    @staticmethod
    def _call(fn, *args):
        """``(status, result)``: LLMException becomes its status; other exceptions propagate."""
        try:
            return SUCCESS, fn(*args)
        except LLMException as exc:
            return int(exc.status_code), None

    def register(self, num_tensors, shape, addrs, blocks, device, keys=(), model_id=None):
        placement = ld.Placement.DEVICE if device else ld.Placement.HOST
        desc = ld.CacheDesc(num_tensors, list(shape), DT, placement)
        if blocks:
            key = None if model_id is None else ld.BlocksCacheKey(7, model_id)
            status, cache = self._call(self.cm.register_blocks_cache, desc, list(addrs), key)
        else:
            status, cache = self._call(self.cm.register_cache, desc, list(addrs),
                                       [ld.CacheKey(7, k) for k in keys])
        return status, (cache.cache_id if cache is not None else None), cache

    def allocate(self, num_tensors, shape, blocks, device, keys=()):
        placement = ld.Placement.DEVICE if device else ld.Placement.HOST
        desc = ld.CacheDesc(num_tensors, list(shape), DT, placement)
        if blocks:
            status, cache = self._call(self.cm.allocate_blocks_cache, desc)
        else:
            status, cache = self._call(self.cm.allocate_cache, desc, [ld.CacheKey(7, k) for k in keys])
        return status, (cache.cache_id if cache is not None else None), cache

    def unregister(self, cache_id, handle):
        return self._call(self.cm.unregister_cache, cache_id)[0]

    def deallocate(self, cache_id, handle):
        if handle.is_blocks_cache:
            return self._call(self.cm.deallocate_blocks_cache, handle)[0]
        return self._call(self.cm.deallocate_cache, handle)[0]

    def remove_key(self, req_id):
        return self._call(self.cm.remove_cache_key, ld.CacheKey(7, req_id))[0]


class CppStyle:
    name = "cpp"

    def __init__(self, cluster_id: int = 7) -> None:
        self.dd = cpp.LlmDataDist(cluster_id, cpp.LlmRole.kPrompt)
        assert self.dd.Initialize({cpp.OPTION_DEVICE_ID: "0"}) == cpp.LLM_SUCCESS
        self.engine = self.dd.engine

    def close(self) -> None:
        self.dd.Finalize()

    def register(self, num_tensors, shape, addrs, blocks, device, keys=(), model_id=None):
        placement = cpp.CachePlacement.kDevice if device else cpp.CachePlacement.kHost
        desc = cpp.CacheDesc(placement=placement, num_tensors=num_tensors, data_type=DT, shape=list(shape))
        cache_id = cpp.Ref(None)
        status = int(self.dd.RegisterKvCache(desc, list(addrs), cpp.RegisterCfg(), cache_id))
        return status, (cache_id.value if status == SUCCESS else None), None

    def allocate(self, num_tensors, shape, blocks, device, keys=()):
        placement = cpp.CachePlacement.kDevice if device else cpp.CachePlacement.kHost
        desc = cpp.CacheDesc(placement=placement, num_tensors=num_tensors, data_type=DT, shape=list(shape))
        cache = cpp.Cache()
        status = int(self.dd.AllocateCache(desc, cache))
        return status, (cache.cache_id if status == SUCCESS else None), cache

    def unregister(self, cache_id, handle):
        return int(self.dd.UnregisterKvCache(cache_id))

    def deallocate(self, cache_id, handle):
        return int(self.dd.DeallocateCache(cache_id))


STYLES = {"python": PythonStyle, "cpp": CppStyle}


@contextlib.contextmanager
def started(style: str):
    api = STYLES[style]()
    try:
        yield api
    finally:
        api.close()


# ------------------------------------------------------------------------------------------------
# The model and the consistency check
# ------------------------------------------------------------------------------------------------

@dataclass
class ModelCache:
    addrs: List[int]
    tensor_bytes: int
    rows: int
    registered: bool
    blocks: bool
    handle: object = None
    keys: Dict[tuple, int] = field(default_factory=dict)  # owner key -> row
    released: bool = False  # deallocated while keys still hold it


@dataclass
class Model:
    caches: Dict[int, ModelCache] = field(default_factory=dict)
    blocks: Dict[int, int] = field(default_factory=dict)  # model_id -> cache_id
    points: set = field(default_factory=set)  # every range boundary seen, for the range check
    next_id: Optional[int] = None

    def note_range(self, addr: int, nbytes: int) -> None:
        for point in (addr - 1, addr, addr + nbytes - 1, addr + nbytes):
            if 0 <= point < TOP:
                self.points.add(point)

    def add(self, cache_id: int, cache: ModelCache, model_id: Optional[int]) -> None:
        if self.next_id is not None:
            assert cache_id == self.next_id, "cache ids must count up by one per success"
        self.next_id = cache_id + 1
        self.caches[cache_id] = cache
        if model_id is not None:
            self.blocks[model_id] = cache_id
        for addr in cache.addrs:
            self.note_range(addr, cache.tensor_bytes)

    def drop(self, cache_id: int) -> None:
        del self.caches[cache_id]
        self.blocks = {m: c for m, c in self.blocks.items() if c != cache_id}

    def keys(self) -> Dict[tuple, Tuple[int, int]]:
        return {key: (cid, row) for cid, c in self.caches.items() for key, row in c.keys.items()}

    def registered_bytes(self, point: int) -> bool:
        return any(a <= point < a + c.tensor_bytes for c in self.caches.values() for a in c.addrs)


def check_engine(engine, model: Model) -> None:
    """The engine's records, keys, exported table and shared ranges all match the model."""
    assert sorted(engine.registry._caches) == sorted(model.caches)
    table = engine.export_table()
    exported = {entry[0]: entry for entry in table["caches"]}
    assert sorted(exported) == sorted(model.caches)
    for cache_id, m in model.caches.items():
        _, _, _, num_tensors, rows, row_bytes, addrs, _ = exported[cache_id]
        assert (num_tensors, rows, row_bytes * rows, addrs) == (len(m.addrs), m.rows, m.tensor_bytes, m.addrs)
        record = engine.registry._caches[cache_id]
        assert (record.addrs, record.tensor_bytes, record.id_released) == (m.addrs, m.tensor_bytes, m.released)
    assert {m: c for m, c in table["blocks"]} == model.blocks
    assert {tuple(k[:3]): (k[3], k[4]) for k in table["keys"]} == model.keys()
    # What a TCP receive is checked against (taken the way the receiver takes it), at every
    # boundary of every range ever registered in this run: the union of two sets of such ranges
    # is decided by those points.
    with engine.pinned(_io.plan_from_wire(b""), True) as (ranges, generation, _device):
        assert generation == table["generation"]
        wrong = [hex(p) for p in sorted(model.points) if ranges.contains(p, 1) != model.registered_bytes(p)]
        assert not wrong, f"the shared ranges disagree with the registry at {wrong[:8]}"


# ------------------------------------------------------------------------------------------------
# Direct tests
# ------------------------------------------------------------------------------------------------

@pytest.fixture(params=sorted(STYLES))
def api(request):
    with started(request.param) as api:
        yield api


def test_a_range_that_wraps_past_2_64_is_refused_before_anything_changes(api):
    """Issue 10 finding 6: ``register_cache(desc, [2**64 - 1024])`` for a 2048-byte tensor used to
    commit the record, then fail with OverflowError building the range set; every later
    register/unregister then raised OverflowError yet took effect."""
    model = Model()
    arrays = [np.zeros(2048, np.uint8) for _ in range(2)]
    status, cache_id, handle = api.register(1, [2048], [arrays[0].ctypes.data], True, False)
    assert status == SUCCESS
    model.add(cache_id, ModelCache([arrays[0].ctypes.data], 2048, 2048, True, True, handle), None)
    for addrs in ([TOP - 1024], [arrays[1].ctypes.data, TOP - 1024], [TOP - 1], [0], [TOP - 2048 + 1]):
        status, _, _ = api.register(len(addrs), [2048], addrs, True, False)
        assert status == PARAM_INVALID, addrs
        model.note_range(addrs[-1] % TOP, 2048)
        check_engine(api.engine, model)
    # The registry still works: register, then unregister, both take effect exactly once.
    status, second, handle = api.register(1, [2048], [arrays[1].ctypes.data], True, False)
    assert status == SUCCESS and second == cache_id + 1
    model.add(second, ModelCache([arrays[1].ctypes.data], 2048, 2048, True, True, handle), None)
    check_engine(api.engine, model)
    assert api.unregister(cache_id, None) == SUCCESS
    model.drop(cache_id)
    check_engine(api.engine, model)


def test_a_tensor_may_end_exactly_at_2_64(api):
    """The last byte of the address space is a byte like any other: [2**64 - 1024, 2**64) is a
    valid (if unusual) tensor; it enters and leaves the range set like any other."""
    model = Model()
    status, cache_id, _ = api.register(2, [4, 256], [TOP - 1024, TOP - 4096], True, False)
    assert status == SUCCESS
    model.add(cache_id, ModelCache([TOP - 1024, TOP - 4096], 1024, 4, True, True), None)
    check_engine(api.engine, model)
    assert api.engine.registry._shared_ranges.spans() == [(TOP - 4096, TOP - 3072), (TOP - 1024, TOP)]
    assert api.unregister(cache_id, None) == SUCCESS
    model.drop(cache_id)
    check_engine(api.engine, model)
    assert api.engine.registry._shared_ranges.spans() == []


def test_a_tensor_larger_than_the_address_space_is_refused(api):
    """A geometry no address space holds is a parameter error in both styles, for register and
    for allocate (the C++ style used to raise OverflowError out of AllocateCache)."""
    model = Model()
    huge = [2**40, 2**30]  # 2**70 bytes
    assert api.register(1, huge, [4096], True, False)[0] == PARAM_INVALID
    assert api.allocate(1, huge, True, True)[0] in (PARAM_INVALID, OUT_OF_MEMORY)
    assert api.allocate(1, [2**62, 4], True, True)[0] in (PARAM_INVALID, OUT_OF_MEMORY)
    check_engine(api.engine, model)


def test_finalize_clears_the_shared_ranges():
    """After finalize nothing is registered, so nothing may be reachable by a peer of the next
    initialization either."""
    memory = np.zeros(4096, np.uint8)
    with started("python") as api:
        status, _, _ = api.register(1, [4096], [memory.ctypes.data], True, False)
        assert status == SUCCESS
        engine = api.engine
        assert engine.registry._shared_ranges.contains(memory.ctypes.data, 4096)
    assert not engine.registry._shared_ranges.contains(memory.ctypes.data, 1)
    with started("python") as api:
        assert not api.engine.registry._shared_ranges.contains(memory.ctypes.data, 1)


@contextlib.contextmanager
def failing_range_sets(after: int):
    """Make the engine's ``after``-th next range-set construction raise InjectedFailure (as a
    MemoryError would); ranges built by the data planes' own code are not affected."""
    real = _io.RangeSet
    calls = [0]

    def faulty(*args, **kwargs):
        calls[0] += 1
        if calls[0] == after + 1:
            raise InjectedFailure("injected: building a range set failed")
        return real(*args, **kwargs)

    _io.RangeSet = faulty
    try:
        yield calls
    finally:
        _io.RangeSet = real


def expect_injected_failure(api, call) -> None:
    """The Python style lets the injected MemoryError through; the C++ style reports any
    exception from below its argument checks as an internal error, LLM_FAILED."""
    if api.name == "cpp":
        assert call() == int(LLMStatusCode.LLM_FAILED)
    else:
        with pytest.raises(InjectedFailure):
            call()


def test_a_failure_while_building_the_ranges_changes_nothing(api):
    model = Model()
    memory = [np.zeros(1024, np.uint8) for _ in range(3)]
    addrs = [m.ctypes.data for m in memory]
    status, first, _ = api.register(1, [1024], addrs[:1], True, False)
    assert status == SUCCESS
    model.add(first, ModelCache(addrs[:1], 1024, 1024, True, True), None)
    for point in addrs[1:]:
        model.note_range(point, 1024)
    with failing_range_sets(0):
        expect_injected_failure(api, lambda: api.register(2, [1024], addrs[1:], True, False)[0])
    check_engine(api.engine, model)
    with failing_range_sets(0):
        expect_injected_failure(api, lambda: api.unregister(first, None))
    check_engine(api.engine, model)
    status, second, _ = api.register(2, [1024], addrs[1:], True, False)
    assert status == SUCCESS and second == first + 1
    model.add(second, ModelCache(addrs[1:], 1024, 1024, True, True), None)
    check_engine(api.engine, model)


# ------------------------------------------------------------------------------------------------
# Random sequences
# ------------------------------------------------------------------------------------------------

REGISTER_FAULTS = ["wraps", "wraps_second", "zero", "count", "zero_dim", "huge", "small_array", "bound_key"]


@st.composite
def operations(draw, style: str):
    kinds = ["register"] * 4 + ["bad_register"] * 3 + ["allocate"] * 3 + ["bad_allocate", "unregister",
                                                                          "unregister", "deallocate",
                                                                          "deallocate", "unknown_id",
                                                                          "fault"]
    if style == "python":
        kinds += ["remove_key"] * 2
    ops = []
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(kinds))
        op = {"kind": kind, "pick": draw(st.integers(0, 2**16)), "num_tensors": draw(st.integers(1, 3)),
              "shape": [draw(st.integers(1, 6)), draw(st.integers(1, 48))], "blocks": draw(st.booleans()),
              "device": draw(st.booleans()), "keys": draw(st.lists(st.integers(0, 5), max_size=3, unique=True)),
              "model_id": draw(st.sampled_from([None, 0, 1])), "fault": draw(st.sampled_from(REGISTER_FAULTS)),
              "inject_after": draw(st.integers(0, 1)), "target": draw(st.sampled_from(["register", "unregister",
                                                                                      "allocate", "deallocate"]))}
        ops.append(op)
    return ops


class Runner:
    """Applies one random sequence to an API style and the model, checking after each call."""

    def __init__(self, api, style: str) -> None:
        self.api, self.style, self.model = api, style, Model()
        self.memory: List[np.ndarray] = []  # keeps registered buffers alive
        self.handles: Dict[int, object] = {}
        self.gone: List[Tuple[int, object, bool]] = []  # (cache_id, handle, registered) no longer there

    def buffer(self, nbytes: int) -> int:
        buf = np.zeros(nbytes, np.uint8)
        self.memory.append(buf)
        return buf.ctypes.data

    def expect(self, status: int, expected: int, op) -> None:
        assert status == expected, (op, status, expected)

    def pick(self, op, registered: Optional[bool]):
        ids = sorted(c for c, m in self.model.caches.items()
                     if (registered is None or m.registered == registered) and not m.released)
        return ids[op["pick"] % len(ids)] if ids else None

    def keys_for(self, op, rows: int) -> List[int]:
        if self.style != "python" or op["blocks"]:
            return []
        return [k for k in op["keys"] if k not in {key[1] for key in self.model.keys()}][:rows]

    def register(self, op) -> None:
        nt, shape = op["num_tensors"], op["shape"]
        nbytes = shape[0] * shape[1]
        addrs = [self.buffer(nbytes) for _ in range(nt)]
        keys = self.keys_for(op, shape[0])
        model_id = op["model_id"] if op["blocks"] and self.style == "python" else None
        status, cache_id, handle = self.api.register(nt, shape, addrs, op["blocks"], op["device"], keys, model_id)
        self.expect(status, SUCCESS, op)
        cache = ModelCache(addrs, nbytes, shape[0], True, op["blocks"], handle,
                           {("req", k, 0): row for row, k in enumerate(keys)})
        self.model.add(cache_id, cache, model_id)
        self.handles[cache_id] = handle

    def bad_register(self, op) -> None:
        nt, shape, fault = op["num_tensors"], list(op["shape"]), op["fault"]
        nbytes = shape[0] * shape[1]
        addrs = [self.buffer(nbytes) for _ in range(nt)]
        keys: List[int] = []
        if fault == "wraps":
            addrs[0] = TOP - nbytes + 1
        elif fault == "wraps_second":
            addrs.append(TOP - nbytes // 2)
            nt += 1
        elif fault == "zero":
            addrs[-1] = 0
        elif fault == "count":
            addrs.append(self.buffer(nbytes))
        elif fault == "zero_dim":
            shape[1] = 0
        elif fault == "huge":
            shape = [2**40, 2**30]
        elif fault == "small_array":
            addrs = [np.zeros(nbytes - 1 or 1, np.uint8) if nbytes > 1 else np.zeros(0, np.uint8)
                     for _ in range(nt)]
        elif fault == "bound_key":
            bound = sorted(k[1] for k in self.model.keys())
            if self.style != "python" or not bound:
                addrs[0] = 0  # the same refusal, by another way (a 1-byte tensor at TOP - 1 is valid)
            else:
                keys = [bound[op["pick"] % len(bound)]]
        for addr in addrs:
            if isinstance(addr, int):
                self.model.note_range(addr % TOP, nbytes)
        status, _, _ = self.api.register(nt, shape, addrs, op["blocks"] and not keys, op["device"], keys)
        self.expect(status, PARAM_INVALID, op)

    def allocate(self, op, bad: bool = False) -> None:
        nt, shape = op["num_tensors"], op["shape"]
        keys = self.keys_for(op, shape[0])
        if bad:
            if op["pick"] % 2 and self.style == "python":
                shape = [POOL_BYTES, 2]  # more than the pool
                expected = OUT_OF_MEMORY
            else:
                nt, expected = 0, PARAM_INVALID
            status, _, _ = self.api.allocate(nt, shape, op["blocks"], op["device"], [])
            self.expect(status, expected, op)
            return
        status, cache_id, handle = self.api.allocate(nt, shape, op["blocks"], op["device"], keys)
        if status == OUT_OF_MEMORY and self.style == "python":
            return  # the pool is full of this run's caches
        self.expect(status, SUCCESS, op)
        record = self.api.engine.registry._caches[cache_id]
        cache = ModelCache(list(record.addrs), shape[0] * shape[1], shape[0], False, op["blocks"], handle,
                           {("req", k, 0): row for row, k in enumerate(keys)})
        self.model.add(cache_id, cache, None)
        self.handles[cache_id] = handle

    def unregister(self, op) -> None:
        cache_id = self.pick(op, None)
        if cache_id is None:
            return
        m = self.model.caches[cache_id]
        status = self.api.unregister(cache_id, m.handle)
        if not m.registered:
            self.expect(status, PARAM_INVALID, op)
            return
        self.expect(status, SUCCESS, op)
        self.model.drop(cache_id)
        self.gone.append((cache_id, m.handle, True))

    def deallocate(self, op) -> None:
        cache_id = self.pick(op, None)
        if cache_id is None:
            return
        m = self.model.caches[cache_id]
        status = self.api.deallocate(cache_id, m.handle)
        if m.registered:
            self.expect(status, PARAM_INVALID, op)
            return
        self.expect(status, SUCCESS, op)
        if m.keys:
            m.released = True
        else:
            self.model.drop(cache_id)
            self.gone.append((cache_id, m.handle, False))

    def unknown_id(self, op) -> None:
        if not self.gone or op["pick"] % 3 == 0:
            self.expect(self.api.unregister(10**9 + op["pick"], None), SUCCESS, op)
            return
        cache_id, handle, registered = self.gone[op["pick"] % len(self.gone)]
        if registered:
            self.expect(self.api.unregister(cache_id, handle), SUCCESS, op)
        else:
            self.expect(self.api.deallocate(cache_id, handle), SUCCESS, op)

    def remove_key(self, op) -> None:
        keys = self.model.keys()
        if not keys:
            self.expect(self.api.remove_key(1000 + op["pick"]), SUCCESS, op)
            return
        key = sorted(keys)[op["pick"] % len(keys)]
        cache_id, _ = keys[key]
        m = self.model.caches[cache_id]
        self.expect(self.api.remove_key(key[1]), SUCCESS, op)
        if m.registered:
            return  # keys of registered memory are never released
        del m.keys[key]
        if m.released and not m.keys:
            self.model.drop(cache_id)

    def fault(self, op) -> None:
        """One of the four calls with a range-set construction failing inside it: it raises and
        the engine is as before (or the call is refused before it builds any, e.g. a full
        pool, and nothing changed either)."""
        target = op["target"]
        # register and allocate build one range set (the new shared ranges); unregister and
        # deallocate two (the shared ranges without the cache, and the cache's own).
        after = 0 if target in ("register", "allocate") else op["inject_after"]
        with failing_range_sets(after) as calls:
            try:
                if target == "register":
                    shape = op["shape"]
                    status = self.api.register(1, shape, [self.buffer(shape[0] * shape[1])], True,
                                               op["device"])[0]
                elif target == "allocate":
                    status = self.api.allocate(1, op["shape"], True, op["device"])[0]
                else:
                    registered = target == "unregister"
                    cache_id = self.pick(op, registered)
                    if cache_id is None or (not registered and self.model.caches[cache_id].keys):
                        return
                    m = self.model.caches[cache_id]
                    status = (self.api.unregister if registered else self.api.deallocate)(cache_id, m.handle)
            except InjectedFailure:
                return
        if self.api.name == "cpp" and calls[0] == after + 1:  # the C++ style reports the injected
            assert status == int(LLMStatusCode.LLM_FAILED)  # failure as an internal error
            return
        assert status != SUCCESS and calls[0] == 0, \
            f"{target} succeeded although building its ranges failed ({op}, {calls[0]} built)"

    def run(self, ops) -> None:
        check_engine(self.api.engine, self.model)
        for op in ops:
            kind = op["kind"]
            if kind == "fault":
                before_next = self.model.next_id
                self.fault(op)
                self.model.next_id = before_next
            elif kind == "bad_allocate":
                self.allocate(op, bad=True)
            else:
                getattr(self, kind)(op)
            check_engine(self.api.engine, self.model)

    def clean_up(self) -> None:
        for cache_id, m in list(self.model.caches.items()):
            if m.registered:
                self.api.unregister(cache_id, m.handle)
            else:
                if self.style == "python":
                    for key in list(m.keys):
                        self.api.remove_key(key[1])
                self.api.deallocate(cache_id, m.handle)


SEQUENCES = settings(max_examples=120, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("style", sorted(STYLES))
def test_random_registry_sequences_keep_registry_table_and_ranges_consistent(style):
    with started(style) as api:
        @SEQUENCES
        @given(ops=operations(style))
        def run(ops):
            runner = Runner(api, style)
            try:
                runner.run(ops)
            finally:
                runner.clean_up()
                assert not api.engine.registry._caches, "the sequence left caches behind"
                assert len(api.engine.registry._shared_ranges) == 0

        run()
