"""Every operation plans against the geometry the engine recorded, never the caller's objects.

A ``CacheDesc`` is the caller's and stays mutable after registration (``update_dim``, list
shapes changed in place); ``Cache`` objects, ``cpp.CacheDesc`` and ``cpp.Cache`` structs are the
caller's too. Whatever the caller does to them, a copy, swap, transfer or view uses the
geometry, placement, addresses and tensor count recorded when the cache was registered,
allocated or created, and an index outside that geometry gets the spec's error
(``LLMException(LLM_PARAM_INVALID)`` / ``LLM_PARAM_INVALID``) with nothing written.

Memory is checked with guard bytes: every registered tensor lies in a numpy buffer with sentinel
bytes before and after it (after it: room for the mutated geometry, so that a wrong write lands
in the guard, not in the heap), and the bytes of every tensor are compared with a model.
"""

from __future__ import annotations

import contextlib
import json
from typing import Dict, List

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import llm_datadist as ld
from llm_datadist import cpp
from llm_datadist.llm_types import Cache, CacheDesc, Placement
from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.testing import Cluster, link
from llm_datadist.transport import planes

PARAM_INVALID = int(LLMStatusCode.LLM_PARAM_INVALID)
U8 = ld.DataType.DT_UINT8
LEAD = 64
SENTINEL = 0xA5
POOL = json.dumps({"memory_size": 16 * 1024 * 1024})


class Guarded:
    """``num_tensors`` tensors of ``nbytes`` bytes, each in its own numpy buffer: LEAD sentinel
    bytes, the tensor (random bytes), then ``trail`` sentinel bytes."""

    def __init__(self, num_tensors: int, nbytes: int, trail: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.nbytes, self.trail = nbytes, trail
        self.buffers = []
        for _ in range(num_tensors):
            buf = np.full(LEAD + nbytes + trail, SENTINEL, np.uint8)
            buf[LEAD:LEAD + nbytes] = rng.integers(0, 256, nbytes, dtype=np.uint8)
            self.buffers.append(buf)
        self.addrs = [b.ctypes.data + LEAD for b in self.buffers]
        self.model = [self.tensor(t).copy() for t in range(num_tensors)]

    def tensor(self, t: int) -> np.ndarray:
        return self.buffers[t][LEAD:LEAD + self.nbytes]

    def check(self, what: str) -> None:
        for t, buf in enumerate(self.buffers):
            lead, trail = buf[:LEAD], buf[LEAD + self.nbytes:]
            assert (lead == SENTINEL).all(), f"{what}: tensor {t}'s lead guard was written"
            bad = np.flatnonzero(trail != SENTINEL)
            assert bad.size == 0, (f"{what}: {bad.size} bytes after tensor {t} were written, the first "
                                   f"{bad[0]} bytes past its registered end")
            diff = np.flatnonzero(self.tensor(t) != self.model[t])
            assert diff.size == 0, f"{what}: tensor {t} differs from the model at byte {diff[0]}"

    def block(self, t: int, index: int, block_bytes: int) -> np.ndarray:
        return self.model[t][index * block_bytes:(index + 1) * block_bytes]


def status_of(fn, *args, **kwargs) -> int:
    try:
        fn(*args, **kwargs)
    except LLMException as exc:
        return int(exc.status_code)
    return 0


@pytest.fixture
def cm():
    dd = ld.LLMDataDist(ld.LLMRole.PROMPT, 11)
    cfg = ld.LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.mem_pool_cfg = POOL
    cfg.host_mem_pool_cfg = POOL
    dd.init(cfg.generate_options())
    try:
        yield dd.cache_manager
    finally:
        dd.finalize()


@contextlib.contextmanager
def registered(cm, memory: Guarded, shape, placement, blocks=True, batch_dim_index=0):
    desc = CacheDesc(len(memory.addrs), list(shape), U8, placement, batch_dim_index=batch_dim_index)
    register = cm.register_blocks_cache if blocks else cm.register_cache
    cache = register(desc, list(memory.addrs))
    try:
        yield cache
    finally:
        cm.unregister_cache(cache.cache_id)


# ------------------------------------------------------------------------------------------------
# The reported case and its neighbours
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("direction", ["host_to_device", "device_to_host"])
def test_swap_blocks_after_update_dim_keeps_to_the_registered_blocks(cm, direction):
    """Issue 10 finding 5: an 8-block registration, ``update_dim(0, 64)`` on its CacheDesc, then
    a swap naming block 40 used to plan against 64 blocks and write 8 KiB past the registered end.
    It is refused; block 7 (the last registered one) still swaps."""
    block = 256
    host = Guarded(2, 8 * block, 64 * block, 1)
    device = Guarded(2, 8 * block, 64 * block, 2)
    with registered(cm, host, [8, block], Placement.HOST) as h, \
            registered(cm, device, [8, block], Placement.DEVICE) as d:
        h.cache_desc.update_dim(0, 64)
        d.cache_desc.update_dim(0, 64)
        src, dst, src_mem, dst_mem = (h, d, host, device) if direction == "host_to_device" else (d, h, device, host)
        for mapping in ({0: 40}, {40: 0}, {0: 8}, {8: 0}, {1: 2, 3: 63}, {-1: 0}):
            assert status_of(cm.swap_blocks, src, dst, mapping) == PARAM_INVALID, mapping
            host.check(f"swap {mapping}")
            device.check(f"swap {mapping}")
        cm.swap_blocks(src, dst, {7: 0, 0: 7})
        for t in range(2):
            a, b = src_mem.block(t, 7, block).copy(), src_mem.block(t, 0, block).copy()
            dst_mem.block(t, 0, block)[:] = a
            dst_mem.block(t, 7, block)[:] = b
        host.check("swap {7: 0, 0: 7}")
        device.check("swap {7: 0, 0: 7}")


def test_swap_blocks_block_size_comes_from_the_registration(cm):
    """Changing the block dimension of one desc does not change the block size the swap uses
    (so it neither refuses a valid swap nor copies a wrong number of bytes)."""
    host = Guarded(1, 4 * 16, 4096, 3)
    device = Guarded(1, 4 * 16, 4096, 4)
    with registered(cm, host, [4, 16], Placement.HOST) as h, \
            registered(cm, device, [4, 16], Placement.DEVICE) as d:
        h.cache_desc.update_dim(1, 512)
        cm.swap_blocks(d, h, {3: 1})
        host.block(0, 1, 16)[:] = device.block(0, 3, 16)
        host.check("swap after update_dim(1, 512)")
        device.check("swap after update_dim(1, 512)")


def test_swap_blocks_with_a_changed_cpu_cache(cm):
    """A ``create_cpu_cache`` cache keeps the geometry and addresses it was created with: its
    desc grown, its ``tensor_addrs`` list changed, a swap still stays inside its memory."""
    host = Guarded(2, 4 * 32, 64 * 32, 5)
    device = Guarded(2, 8 * 32, 64 * 32, 6)
    desc = CacheDesc(2, [4, 32], U8, Placement.HOST)
    cpu = Cache.create_cpu_cache(desc, list(host.addrs))
    with registered(cm, device, [8, 32], Placement.DEVICE) as d:
        desc.update_dim(0, 64)
        addrs = cpu.tensor_addrs
        addrs[0] += 32 * 32
        addrs.append(device.addrs[0])
        assert cpu.tensor_addrs == host.addrs  # a copy was changed, not the cache
        for mapping in ({7: 4}, {0: 40}, {0: 4}):
            assert status_of(cm.swap_blocks, d, cpu, mapping) == PARAM_INVALID, mapping
            assert status_of(cm.swap_blocks, cpu, d, {v: k for k, v in mapping.items()}) == PARAM_INVALID
            host.check(f"swap {mapping}")
            device.check(f"swap {mapping}")
        cm.swap_blocks(d, cpu, {7: 3})
        for t in range(2):
            host.block(t, 3, 32)[:] = device.block(t, 7, 32)
        host.check("swap {7: 3}")
        views = cpu.as_numpy()
        assert [v.shape for v in views] == [(4, 32), (4, 32)]
        assert [v.ctypes.data for v in views] == host.addrs


def test_views_have_the_registered_shape(cm):
    memory = Guarded(2, 3 * 8, 4096, 7)
    with registered(cm, memory, [3, 8], Placement.HOST) as cache:
        cache.cache_desc.update_dim(0, 300)
        cache.cache_desc.shape[1] = 80
        views = cache.as_numpy()
        assert [(v.shape, v.nbytes, v.ctypes.data) for v in views] == [((3, 8), 24, a) for a in memory.addrs]
        cache.tensor_addrs.clear()
        assert cache.as_numpy(1).ctypes.data == memory.addrs[1]
    allocated = cm.allocate_blocks_cache(CacheDesc(1, [2, 4], U8, Placement.DEVICE))
    allocated.cache_desc.update_dim(0, 2000)
    assert allocated.as_numpy(0).shape == (2, 4)
    cm.deallocate_blocks_cache(allocated)


class GrowsTheShapeWhileChecked(np.ndarray):
    """An array whose size check grows the CacheDesc being registered, as another thread of
    the caller could while ``register_*`` runs."""

    grow = None

    @property
    def nbytes(self):
        if GrowsTheShapeWhileChecked.grow is not None:
            GrowsTheShapeWhileChecked.grow()
        return np.ndarray.nbytes.__get__(self)


def test_a_shape_changed_during_registration_does_not_change_the_record(cm):
    """The shape is read once: what the arrays were checked against is what is recorded."""
    memory = Guarded(1, 2 * 64, 64 * 64, 8)
    desc = CacheDesc(1, [2, 64], U8, Placement.HOST)
    array = memory.tensor(0).view(GrowsTheShapeWhileChecked)
    GrowsTheShapeWhileChecked.grow = lambda: desc.update_dim(0, 64)
    try:
        cache = cm.register_blocks_cache(desc, [array])
    finally:
        GrowsTheShapeWhileChecked.grow = None
    try:
        assert desc.shape == [64, 64]
        assert cache.as_numpy(0).shape == (2, 64)
        assert status_of(cm.copy_blocks, cache, {0: [40]}) == PARAM_INVALID
        memory.check("copy_blocks {0: [40]}")
        cm.copy_blocks(cache, {0: [1]})
        memory.model[0][64:] = memory.model[0][:64]
        memory.check("copy_blocks {0: [1]}")
    finally:
        cm.unregister_cache(cache.cache_id)


def test_swap_blocks_uses_the_recorded_batch_dim(cm):
    """swap_blocks counts blocks along the desc's batch dimension (block = size // batch_size),
    as recorded: growing that dimension, or dropping a dimension of a list shape so that
    batch_dim_index no longer fits it, changes nothing."""
    host = Guarded(1, 2 * 6 * 4, 4096, 9)     # shape [2, 6, 4], batch dim 1: 6 blocks of 8 bytes
    device = Guarded(1, 6 * 8, 4096, 10)      # shape [6, 8]: 6 blocks of 8 bytes
    with registered(cm, host, [2, 6, 4], Placement.HOST, batch_dim_index=1) as h, \
            registered(cm, device, [6, 8], Placement.DEVICE) as d:
        h.cache_desc.update_dim(1, 60)
        assert status_of(cm.swap_blocks, d, h, {0: 6}) == PARAM_INVALID
        host.check("swap {0: 6}")
        h.cache_desc.shape.pop()
        h.cache_desc.shape.pop()
        cm.swap_blocks(d, h, {5: 5})
        host.block(0, 5, 8)[:] = device.block(0, 5, 8)
        host.check("swap {5: 5}")


def test_caches_built_by_the_caller_cannot_change_the_kind(cm):
    """A Cache object the caller built over a registered cache id, claiming the other kind: the
    kind recorded by the engine decides (LLM_PARAM_INVALID, nothing written)."""
    rows = Guarded(1, 4 * 8, 4096, 11)
    blocks = Guarded(1, 4 * 8, 4096, 12)
    with registered(cm, rows, [4, 8], Placement.HOST, blocks=False) as r, \
            registered(cm, blocks, [4, 8], Placement.HOST) as b:
        fake_blocks = Cache(r.cache_id, CacheDesc(1, [64, 8], U8, Placement.HOST), r.tensor_addrs, cm, True, True)
        fake_rows = Cache(b.cache_id, CacheDesc(1, [64, 8], U8, Placement.HOST), b.tensor_addrs, cm, True, False)
        assert status_of(cm.copy_blocks, fake_blocks, {0: [3]}) == PARAM_INVALID
        assert status_of(cm.copy_cache, fake_rows, r, 1, 0) == PARAM_INVALID
        assert status_of(cm.copy_cache, r, fake_rows, 1, 0) == PARAM_INVALID
        assert status_of(cm.swap_blocks, fake_blocks, b, {0: 0}) == PARAM_INVALID
        rows.check("fake kinds")
        blocks.check("fake kinds")
        assert fake_rows.as_numpy(0).shape == (4, 8)  # and views come from the record
    allocated = cm.allocate_blocks_cache(CacheDesc(1, [2, 8], U8, Placement.HOST))
    fake = Cache(allocated.cache_id, CacheDesc(1, [2, 8], U8, Placement.HOST), [], cm, False, False)
    assert status_of(cm.deallocate_cache, fake) == PARAM_INVALID
    assert allocated.as_numpy(0).shape == (2, 8)  # still allocated
    cm.deallocate_blocks_cache(allocated)


# ------------------------------------------------------------------------------------------------
# Random local operations after random changes to the caller's objects (Python style)
# ------------------------------------------------------------------------------------------------

def mutations():
    return st.lists(st.tuples(st.sampled_from(["device", "host", "rows_a", "rows_b"]),
                              st.sampled_from(["dim0", "dim1", "list0", "addrs"]), st.integers(1, 64)),
                    max_size=6)


def index(limit):
    """Indices for a dimension of ``limit``: mostly valid, else just past it (the most likely
    to be taken for valid by a wrong geometry), far past it or negative."""
    invalid = st.one_of(st.integers(limit, limit + 2), st.sampled_from([-1, 2 * limit + 5, 63]))
    return st.integers(0, 9).flatmap(lambda r: st.integers(0, limit - 1) if r < 8 else invalid)


@st.composite
def local_case(draw):
    nt = draw(st.integers(1, 3))
    block = draw(st.integers(1, 24))
    geometry = {
        "device": (nt, draw(st.integers(1, 6)), block),
        "host": (nt, draw(st.integers(1, 6)), block),
        "rows_a": (nt, draw(st.integers(1, 4)), draw(st.integers(1, 24))),
        "rows_b": (nt, draw(st.integers(1, 4)), None),
    }
    geometry["rows_b"] = (nt, geometry["rows_b"][1], geometry["rows_a"][2])
    cpu_host = draw(st.booleans())
    ops = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["swap_in", "swap_out", "copy_blocks", "copy_cache", "views"]))
        if kind in ("swap_in", "swap_out"):
            src, dst = ("host", "device") if kind == "swap_in" else ("device", "host")
            pairs = draw(st.lists(st.tuples(index(geometry[src][1]), index(geometry[dst][1])),
                                  min_size=1, max_size=4))
            ops.append((kind, dict(pairs)))
        elif kind == "copy_blocks":
            name = draw(st.sampled_from(["device"] if cpu_host else ["device", "host"]))
            limit = geometry[name][1]
            info = draw(st.dictionaries(index(limit), st.lists(index(limit), min_size=1, max_size=3),
                                        min_size=1, max_size=3))
            ops.append((kind, (name, info)))
        elif kind == "copy_cache":
            (_, src_rows, row_bytes), dst_rows = geometry["rows_a"], geometry["rows_b"][1]
            offset = draw(st.sampled_from([0, 0, 0, row_bytes]) | st.integers(0, row_bytes - 1))
            size = draw(st.sampled_from([-1, -1, 1, row_bytes - offset, row_bytes + 1, 64]))
            ops.append((kind, (draw(index(dst_rows)), draw(index(src_rows)), offset, size)))
        else:
            ops.append((kind, None))
    return geometry, cpu_host, draw(mutations()), ops, draw(st.integers(0, 2**32))


def expect_swap(memories, geometry, src, dst, mapping):
    """The model after a swap per the recorded geometry; None if an index is out of range."""
    (_, src_blocks, block), (_, dst_blocks, _) = geometry[src], geometry[dst]
    if not all(0 <= s < src_blocks and 0 <= d < dst_blocks for s, d in mapping.items()):
        return None
    for t in range(len(memories[src].model)):
        for s, d in mapping.items():
            memories[dst].block(t, d, block)[:] = memories[src].block(t, s, block)
    return True


def expect_copy_blocks(memory, blocks, block, info):
    pairs = [(s, d) for s, dsts in info.items() for d in dsts]
    if not all(0 <= s < blocks and 0 <= d < blocks for s, d in pairs):
        return None
    for t in range(len(memory.model)):
        for s, d in pairs:
            memory.block(t, d, block)[:] = memory.block(t, s, block).copy()
    return True


def expect_copy_cache(src, dst, src_rows, dst_rows, row_bytes, args):
    dst_row, src_row, offset, size = args
    if dst_row < 0 or src_row < 0:
        return "ValueError"
    n = row_bytes - offset if size == -1 else size
    if not (src_row < src_rows and dst_row < dst_rows and offset < row_bytes and 0 < n <= row_bytes - offset):
        return None
    for t in range(len(src.model)):
        dst.model[t][dst_row * row_bytes + offset:dst_row * row_bytes + offset + n] = \
            src.model[t][src_row * row_bytes + offset:src_row * row_bytes + offset + n]
    return True


def mutate(caches, name, how, value):
    cache = caches[name]
    desc = cache.cache_desc
    if how == "dim0":
        desc.update_dim(0, value)
    elif how == "dim1":
        desc.update_dim(1, value)
    elif how == "list0":
        desc.shape[0] = desc.shape[0] + value
    else:
        addrs = cache.tensor_addrs
        addrs[0] += value
        addrs.append(value)


LOCAL = settings(max_examples=150, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@LOCAL
@given(case=local_case())
def test_local_operations_after_the_callers_objects_changed(cm, case):
    geometry, cpu_host, changes, ops, seed = case
    memories = {name: Guarded(nt, rows * size, 2 * 64 * 88 + 4096, seed + i)
                for i, (name, (nt, rows, size)) in enumerate(geometry.items())}
    caches: Dict[str, Cache] = {}
    with contextlib.ExitStack() as stack:
        for name, (nt, rows, size) in geometry.items():
            placement = Placement.DEVICE if name == "device" else Placement.HOST
            if name == "host" and cpu_host:
                caches[name] = Cache.create_cpu_cache(CacheDesc(nt, [rows, size], U8, placement),
                                                      list(memories[name].addrs))
            else:
                caches[name] = stack.enter_context(registered(cm, memories[name], [rows, size], placement,
                                                              blocks=not name.startswith("rows")))
        for name, how, value in changes:
            mutate(caches, name, how, value)
        for kind, args in ops:
            if kind in ("swap_in", "swap_out"):
                src, dst = ("host", "device") if kind == "swap_in" else ("device", "host")
                ok = expect_swap(memories, geometry, src, dst, args)
                status = status_of(cm.swap_blocks, caches[src], caches[dst], args)
            elif kind == "copy_blocks":
                name, info = args
                _, blocks, block = geometry[name]
                ok = expect_copy_blocks(memories[name], blocks, block, info)
                status = status_of(cm.copy_blocks, caches[name], info)
            elif kind == "copy_cache":
                (_, src_rows, row_bytes), dst_rows = geometry["rows_a"], geometry["rows_b"][1]
                ok = expect_copy_cache(memories["rows_a"], memories["rows_b"], src_rows, dst_rows, row_bytes, args)
                if ok == "ValueError":
                    with pytest.raises(ValueError):
                        cm.copy_cache(caches["rows_b"], caches["rows_a"], *args)
                    status, ok = PARAM_INVALID, None
                else:
                    status = status_of(cm.copy_cache, caches["rows_b"], caches["rows_a"], *args)
            else:
                for name, (_, rows, size) in geometry.items():
                    views = caches[name].as_numpy()
                    assert [(v.shape, v.ctypes.data) for v in views] == \
                        [((rows, size), a) for a in memories[name].addrs], name
                status, ok = 0, True
            event(f"{kind}: {'done' if ok else 'refused'}")
            assert status == (0 if ok else PARAM_INVALID), (kind, args, status)
            for name, memory in memories.items():
                memory.check(f"{kind} {args} ({name})")


# ------------------------------------------------------------------------------------------------
# The C++ style: its structs are plain, mutable objects
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def cpp_dd():
    dd = cpp.LlmDataDist(12, cpp.LlmRole.kPrompt)
    assert dd.Initialize({cpp.OPTION_DEVICE_ID: "0"}) == cpp.LLM_SUCCESS
    try:
        yield dd
    finally:
        dd.Finalize()


def cpp_register(dd, memory: Guarded, shape, placement=cpp.CachePlacement.kDevice):
    desc = cpp.CacheDesc(placement=placement, num_tensors=len(memory.addrs), data_type=U8, shape=list(shape))
    ref = cpp.Ref()
    assert dd.RegisterKvCache(desc, list(memory.addrs), cpp.RegisterCfg(), ref) == cpp.LLM_SUCCESS
    return cpp.Cache(cache_id=ref.value, tensor_addrs=list(memory.addrs), cache_desc=desc)


def cpp_mutate(cache, how, value):
    if how == "dim0":
        cache.cache_desc.shape[0] = value
    elif how == "dim1":
        cache.cache_desc.shape[-1] = value
    elif how == "num_tensors":
        cache.cache_desc.num_tensors = value
    elif how == "addrs":
        cache.tensor_addrs = [a + value for a in cache.tensor_addrs] + [value]
    else:
        cache.cache_desc = cpp.CacheDesc(placement=cpp.CachePlacement.kHost, num_tensors=value,
                                         data_type=U8, shape=[value, value])


@st.composite
def cpp_case(draw):
    nt = draw(st.integers(1, 3))
    block = draw(st.integers(1, 24))
    blocks = {"a": draw(st.integers(1, 6)), "b": draw(st.integers(1, 6))}
    changes = draw(st.lists(st.tuples(st.sampled_from(["a", "b"]),
                                      st.sampled_from(["dim0", "dim1", "num_tensors", "addrs", "desc"]),
                                      st.integers(1, 64)), max_size=5))
    ops = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            n = draw(st.integers(1, 3))
            src = draw(st.lists(index(blocks["a"]), min_size=n, max_size=n))
            dsts = draw(st.lists(st.lists(index(blocks["b"]), min_size=n, max_size=n), min_size=1, max_size=2))
            ops.append(("blocks", (src, dsts)))
        else:
            rows = min(blocks.values())
            ops.append(("rows", (draw(index(rows)), draw(index(rows)), draw(st.integers(0, block + 1)),
                                 draw(st.sampled_from([-1, 1, block, block + 1])))))
    return nt, block, blocks, changes, ops, draw(st.integers(0, 2**32))


@LOCAL
@given(case=cpp_case())
def test_cpp_copies_after_the_callers_structs_changed(cpp_dd, case):
    nt, block, blocks, changes, ops, seed = case
    memories = {name: Guarded(nt, count * block, 2 * 64 * 88 + 4096, seed + i)
                for i, (name, count) in enumerate(sorted(blocks.items()))}
    caches = {name: cpp_register(cpp_dd, memories[name], [blocks[name], block]) for name in blocks}
    try:
        for name, how, value in changes:
            cpp_mutate(caches[name], how, value)
        for kind, args in ops:
            if kind == "blocks":
                src, dsts = args
                valid = all(0 <= s < blocks["a"] for s in src) and all(0 <= d < blocks["b"] for ds in dsts for d in ds)
                status = int(cpp_dd.CopyKvBlocks(caches["a"], caches["b"], src, dsts))
                if valid:
                    for t in range(nt):
                        for ds in dsts:
                            for s, d in zip(src, ds):
                                memories["b"].block(t, d, block)[:] = memories["a"].block(t, s, block)
            else:
                src_row, dst_row, offset, size = args
                rows = {name: count for name, count in blocks.items()}
                n = block - offset if size == -1 else size
                valid = (0 <= src_row < rows["a"] and 0 <= dst_row < rows["b"] and offset < block
                         and 0 < n <= block - offset)
                status = int(cpp_dd.CopyKvCache(caches["a"], caches["b"], src_row, dst_row, offset, size))
                if valid:
                    for t in range(nt):
                        memories["b"].model[t][dst_row * block + offset:dst_row * block + offset + n] = \
                            memories["a"].model[t][src_row * block + offset:src_row * block + offset + n]
            event(f"{kind}: {'done' if valid else 'refused'}")
            assert status == (cpp.LLM_SUCCESS if valid else cpp.LLM_PARAM_INVALID), (kind, args, status)
            for name, memory in memories.items():
                memory.check(f"{kind} {args} ({name})")
    finally:
        for cache in caches.values():
            assert cpp_dd.UnregisterKvCache(cache.cache_id) == cpp.LLM_SUCCESS


# ------------------------------------------------------------------------------------------------
# Transfers between two clusters (real processes) after the local objects changed
# ------------------------------------------------------------------------------------------------
# These functions run inside the cluster processes (``Cluster.call(fn, *args)`` runs
# ``fn(state, *args)``); ``state.arrays[name]`` holds the Guarded memory of cache ``name``.

PEER, LOCAL_ID = 2, 1
BLOCK = 32


def peer_register(state, name: str, rows: int, blocks: bool, seed: int) -> int:
    memory = Guarded(2, rows * BLOCK, 64 * BLOCK + 4096, seed)
    if state.cpp is not None:
        desc = cpp.CacheDesc(placement=cpp.CachePlacement.kDevice, num_tensors=2, data_type=U8, shape=[rows, BLOCK])
        ref = cpp.Ref()
        assert state.cpp.RegisterKvCache(desc, list(memory.addrs), cpp.RegisterCfg(), ref) == cpp.LLM_SUCCESS
        cache = cpp.Cache(cache_id=ref.value, tensor_addrs=list(memory.addrs), cache_desc=desc)
    else:
        desc = CacheDesc(2, [rows, BLOCK], U8, Placement.DEVICE)
        if blocks:
            cache = state.cm.register_blocks_cache(desc, list(memory.addrs), ld.BlocksCacheKey(state.cluster_id, 0))
        else:
            cache = state.cm.register_cache(desc, list(memory.addrs))
    state.caches[name], state.arrays[name] = cache, memory
    return cache.cache_id


def peer_change_objects(state, rows: int) -> None:
    """What a careless (or hostile) caller does to its objects after registering."""
    for cache in state.caches.values():
        if state.cpp is not None:
            cache.cache_desc.shape[0] = rows
            cache.cache_desc.num_tensors += 5
            cache.tensor_addrs = [a + 4096 for a in cache.tensor_addrs] + [4096]
        else:
            cache.cache_desc.update_dim(0, rows)
            cache.tensor_addrs.append(4096)


def peer_check(state, what: str) -> None:
    for name, memory in state.arrays.items():
        memory.check(f"{what} ({name} of cluster {state.cluster_id})")


def peer_model(state, name: str) -> List[np.ndarray]:
    return [m.copy() for m in state.arrays[name].model]


def peer_set_model(state, name: str, t: int, start: int, data: np.ndarray) -> None:
    state.arrays[name].model[t][start:start + data.size] = data


class AlwaysReady(ld.LayerSynchronizer):
    def synchronize_layer(self, layer_index, timeout_in_millis):
        return True


def peer_python_op(state, op: str, *args) -> int:
    """One Python-style transfer to/from the peer; the status (0 = success)."""
    cm, caches = state.cm, state.caches
    try:
        if op == "push_blocks":
            cm.push_blocks(ld.BlocksCacheKey(PEER, 0), caches["blocks"], *args)
        elif op == "pull_blocks":
            cm.pull_blocks(ld.BlocksCacheKey(PEER, 0), caches["blocks"], *args)
        elif op == "push_cache":
            rows_id, dst_row, src_row = args
            cm.push_cache(ld.CacheKeyByIdAndIndex(PEER, rows_id, dst_row), caches["rows"], src_row)
        elif op == "pull_cache":
            rows_id, src_row, dst_row = args
            cm.pull_cache(ld.CacheKeyByIdAndIndex(PEER, rows_id, src_row), caches["rows"], dst_row)
        else:
            src_blocks, dst_blocks = args
            config = ld.TransferWithCacheKeyConfig(ld.BlocksCacheKey(PEER, 0), range(0, 1), range(0, 1))
            task = cm.transfer_cache_async(caches["blocks"], AlwaysReady(), [config], src_blocks, dst_blocks)
            return int(task.synchronize(10000))
    except LLMException as exc:
        return int(exc.status_code)
    return 0


def peer_cpp_op(state, op: str, *args) -> int:
    dd, caches = state.cpp, state.caches
    if op == "push_blocks":
        cache_id, src, dst = args
        return int(dd.PushKvBlocks(caches["blocks"], cpp.CacheIndex(cluster_id=PEER, cache_id=cache_id), src, dst))
    if op == "pull_blocks":
        cache_id, src, dst = args
        return int(dd.PullKvBlocks(cpp.CacheIndex(cluster_id=PEER, cache_id=cache_id), caches["blocks"], src, dst))
    if op == "push_cache":
        cache_id, dst_row, src_row = args
        return int(dd.PushKvCache(caches["rows"], cpp.CacheIndex(cluster_id=PEER, cache_id=cache_id,
                                                                 batch_index=dst_row), src_row))
    cache_id, src_row, dst_row = args
    return int(dd.PullKvCache(cpp.CacheIndex(cluster_id=PEER, cache_id=cache_id, batch_index=src_row),
                              caches["rows"], dst_row))


@pytest.mark.parametrize("plane", [name for name in planes.names() if not planes.get(name).requires_secret])
@pytest.mark.parametrize("api", ["python", "cpp"])
def test_transfers_after_the_local_objects_changed(api, plane):
    """push/pull of blocks and rows (and transfer_cache_async): a local index valid only for the
    grown CacheDesc is refused with LLM_PARAM_INVALID and nothing moves on either side; the last
    registered block and row still move exactly."""
    options = {} if api == "cpp" else {"remote_cache_accessible": "1"}
    with Cluster(PEER, listen=True, plane=plane, api=api, options=options, timeout=30) as peer, \
            Cluster(LOCAL_ID, plane=plane, api=api, options=options, timeout=30) as local:
        ids = {name: peer.call(peer_register, name, rows, name == "blocks", seed)
               for name, rows, seed in (("blocks", 4, 21), ("rows", 3, 22))}
        local.call(peer_register, "blocks", 4, True, 23)
        local.call(peer_register, "rows", 3, False, 24)
        assert link(local, peer) == (0, [0])
        local.call(peer_change_objects, 64)

        def run(op, *args):
            if api == "python":
                return local.call(peer_python_op, op, *args)
            if op in ("push_blocks", "pull_blocks"):
                return local.call(peer_cpp_op, op, ids["blocks"], *args)
            return local.call(peer_cpp_op, op, ids["rows"], *args)

        refused = [("push_blocks", [4], [0]), ("push_blocks", [0, 40], [0, 1]), ("pull_blocks", [0], [4]),
                   ("pull_blocks", [1, 2], [3, 63])]
        refused += [("push_cache", 0, 3), ("pull_cache", 0, 3)] if api == "cpp" else \
            [("push_cache", ids["rows"], 0, 3), ("pull_cache", ids["rows"], 0, 3), ("transfer", [4], [0])]
        for op, *args in refused:
            assert run(op, *args) == PARAM_INVALID, (op, args)
            local.call(peer_check, f"{op} {args}")
            peer.call(peer_check, f"{op} {args}")

        # The edges of the registered geometry still work, and move exactly what was asked.
        rows_args = (lambda *a: a) if api == "cpp" else (lambda *a: (ids["rows"], *a))
        local_blocks, peer_blocks = local.call(peer_model, "blocks"), peer.call(peer_model, "blocks")
        assert run("push_blocks", [3], [2]) == 0
        assert run("pull_blocks", [1], [3]) == 0
        for t in range(2):
            peer.call(peer_set_model, "blocks", t, 2 * BLOCK, local_blocks[t][3 * BLOCK:4 * BLOCK])
            local.call(peer_set_model, "blocks", t, 3 * BLOCK, peer_blocks[t][1 * BLOCK:2 * BLOCK])
        local_rows, peer_rows = local.call(peer_model, "rows"), peer.call(peer_model, "rows")
        assert run("push_cache", *rows_args(0, 2)) == 0
        assert run("pull_cache", *rows_args(1, 2)) == 0
        for t in range(2):
            peer.call(peer_set_model, "rows", t, 0, local_rows[t][2 * BLOCK:3 * BLOCK])
            local.call(peer_set_model, "rows", t, 2 * BLOCK, peer_rows[t][1 * BLOCK:2 * BLOCK])
        local.call(peer_check, "valid transfers")
        peer.call(peer_check, "valid transfers")
