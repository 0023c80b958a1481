"""Local copies between caches of this process: one core plan and one execution each.

Plain functions of their arguments: the caches' records, the device runtime the engine loaded
and ``bind``, which binds the calling thread to the engine's device (called after the checks
and the planning, right before the copies run). The engine checks that it is initialized before
it calls one (``Engine.copy_rows`` / ``copy_blocks`` / ``swap_blocks``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from llm_datadist import _core
from llm_datadist._memory import Place
from llm_datadist._validate import param_invalid
from llm_datadist.engine.values import CacheRecord, swap_geometry

KIND_BY_PLACEMENT = {
    (Place.HOST, Place.HOST): _core.MEMCPY_HOST_TO_HOST,
    (Place.HOST, Place.DEVICE): _core.MEMCPY_HOST_TO_DEVICE,
    (Place.DEVICE, Place.HOST): _core.MEMCPY_DEVICE_TO_HOST,
    (Place.DEVICE, Place.DEVICE): _core.MEMCPY_DEVICE_TO_DEVICE,
}


def needs_order(src: CacheRecord, dst: CacheRecord, src_blocks, dst_blocks) -> bool:
    """Device copies of one list run in parallel: a list whose result depends on its order --
    one that writes a block twice, or (in one cache) writes blocks it also reads -- runs one copy
    after another in list order instead, as the host path does."""
    written = [int(b) for b in dst_blocks]
    if len(set(written)) != len(written):
        return True
    return src is dst and not set(written).isdisjoint(int(b) for b in src_blocks)


def execute(plan, runtime: Any, bind: Callable[[], None], src: CacheRecord, dst: CacheRecord,
            blocks: Optional[tuple] = None) -> None:
    """Bind the thread and run ``plan`` with ``runtime``; ``blocks`` = ``(src_blocks,
    dst_blocks)`` of a block copy, whose order is kept (``needs_order``) where the runtime would
    run the list in parallel."""
    bind()
    kind = KIND_BY_PLACEMENT[(src.placement, dst.placement)]
    # Host copies and synchronous runtimes run in list order anyway: no need to look.
    ordered = (blocks is not None and kind != _core.MEMCPY_HOST_TO_HOST and runtime.async_copy
               and needs_order(src, dst, *blocks))
    _core.execute(plan, runtime, kind, ordered=ordered)


def copy_rows(runtime: Any, bind: Callable[[], None], dst: CacheRecord, src: CacheRecord, dst_row: int,
              src_row: int, offset: int, size: int) -> None:
    """Copy row ``src_row`` of every tensor of ``src`` into row ``dst_row`` of ``dst``, from
    ``offset`` on, ``size`` bytes (-1 = rest of the source row)."""
    if src.num_tensors != dst.num_tensors:
        raise param_invalid(f"source has {src.num_tensors} tensors, destination {dst.num_tensors}")
    plan = _core.plan_rows(src.layout, dst.layout, None, None, src_row, dst_row, offset, offset, size)
    execute(plan, runtime, bind, src, dst)


def copy_blocks(runtime: Any, bind: Callable[[], None], src: CacheRecord, dst: CacheRecord, src_blocks,
                dst_blocks, block_bytes: int = -1) -> None:
    """Copy blocks ``src_blocks[k]`` -> ``dst_blocks[k]`` of every tensor, in list order."""
    if src.num_tensors != dst.num_tensors:
        raise param_invalid(f"source has {src.num_tensors} tensors, destination {dst.num_tensors}")
    plan = _core.plan_blocks(src.layout, dst.layout, None, None, src_blocks, dst_blocks, block_bytes)
    execute(plan, runtime, bind, src, dst, (src_blocks, dst_blocks))


def swap_blocks(runtime: Any, bind: Callable[[], None], src: CacheRecord, dst: CacheRecord, src_blocks,
                dst_blocks) -> None:
    """Copy blocks between a host and a device cache, block ``src_blocks[k]`` to
    ``dst_blocks[k]`` of every tensor, with the geometry recorded for each cache."""
    (src_count, src_block), (dst_count, dst_block) = swap_geometry(src), swap_geometry(dst)
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
    execute(plan, runtime, bind, src, dst, (src_blocks, dst_blocks))
