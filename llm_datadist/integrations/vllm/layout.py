"""Which memory a worker registers: vLLM's per-layer KV views checked and turned into the
tensors of one llm_datadist blocks cache (block id on dimension 0), its ``CacheDesc``, and the
device they must be on.

vLLM 0.32 hands each layer over as a 4-D ``[blocks, heads, tokens, K+V bytes]`` view of one backing
buffer, strided as its KV cache layout says; ``LBHNC`` makes every layer's view one contiguous run,
so the connector asks for it (``REQUIRED_LAYOUT``). vLLM may resolve another (an attention backend
that does not support it, ``VLLM_KV_CACHE_LAYOUT``): ``LBNHC``'s views are registered as their
blocks' transpose (``kv_layouts``); any other is refused."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

import llm_datadist as ld

logger = logging.getLogger(__package__)

DTYPES = {
    torch.float16: ld.DataType.DT_FLOAT16,
    torch.bfloat16: ld.DataType.DT_BF16,
    torch.float32: ld.DataType.DT_FLOAT,
    torch.int8: ld.DataType.DT_INT8,
    torch.uint8: ld.DataType.DT_UINT8,
    torch.int32: ld.DataType.DT_INT32,
    torch.int64: ld.DataType.DT_INT64,
}
# Other element types (fp8 caches...) move as raw bytes of the same width.
BY_WIDTH = {1: ld.DataType.DT_UINT8, 2: ld.DataType.DT_UINT16, 4: ld.DataType.DT_UINT32,
            8: ld.DataType.DT_UINT64}


def current_device_index() -> int:
    """The accelerator device this worker's process computes on (vLLM sets it before it builds
    the connector); 0 without an accelerator."""
    accelerator = getattr(torch, "accelerator", None)
    try:
        if accelerator is not None and accelerator.is_available():
            return int(accelerator.current_device_index())
    except (RuntimeError, AssertionError):  # a build whose accelerator cannot be initialised here
        pass
    return 0


#: The KV cache layout the connector asks vLLM for (``get_required_kvcache_layout``): each layer's
#: view of vLLM's backing buffer is then one contiguous run of its blocks, which the connector
#: registers where it is.
REQUIRED_LAYOUT = "LBHNC"


def kv_tensors(kv_caches: Dict[str, Any], num_blocks: Optional[int],
               layout: Optional[str] = None) -> List[torch.Tensor]:
    """The tensors to register, one per distinct cache (layers sharing one cache count once), all
    of one shape, dtype and device, block id on dimension 0. ``layout`` is the KV cache layout
    vLLM resolved (for the refusal's message)."""
    tensors: List[torch.Tensor] = []
    seen: Set[int] = set()
    for name, value in kv_caches.items():
        if not isinstance(value, torch.Tensor):
            raise NotImplementedError(f"LLMDataDistConnector: layer {name} has a KV cache of type "
                                      f"{type(value).__name__}; one tensor per layer is supported")
        part = blocks_view(name, value, num_blocks, layout)
        if part.data_ptr() not in seen:
            seen.add(part.data_ptr())
            tensors.append(part)
    if not tensors:
        raise ValueError("LLMDataDistConnector: no KV caches to register")
    first = tensors[0]
    for t in tensors:
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise NotImplementedError("LLMDataDistConnector: all layers' KV caches must share shape, "
                                      f"dtype and device; got {tuple(first.shape)}/{first.dtype} and "
                                      f"{tuple(t.shape)}/{t.dtype}")
    return tensors


def blocks_view(name: str, t: torch.Tensor, num_blocks: Optional[int], layout: Optional[str] = None) -> torch.Tensor:
    """The layer's cache with one row per vLLM block on dimension 0: vLLM's view itself, or, where
    the attention backend splits each block into ``k`` kernel blocks (dimension 0 is then
    ``num_blocks * k``), the same memory with block ``b`` = rows ``b*k ... b*k+k-1`` grouped as
    dimension 1. A layer whose view is one contiguous run (the ``LBHNC`` layout, or any layout with
    one head) is registered as it is; one whose view is the transpose of contiguous ``[tokens, heads,
    C]`` blocks (``LBNHC``) as those blocks (``[blocks, tokens, heads, C]``, ``kv_layouts``); others
    are refused with the fix."""
    if t.dim() == 4 and not t.is_contiguous() and t.transpose(1, 2).is_contiguous():
        t = t.transpose(1, 2)  # (LBNHC: the memory's own order)
    elif not t.is_contiguous():
        raise NotImplementedError(
            f"LLMDataDistConnector: layer {name}'s KV cache is not one contiguous run of blocks (shape "
            f"{tuple(t.shape)}, strides {t.stride()}: vLLM KV cache layout {layout or 'unknown'}); the "
            f"connector moves {REQUIRED_LAYOUT} and LBNHC and asks vLLM for {REQUIRED_LAYOUT}: unset "
            f"VLLM_KV_CACHE_LAYOUT (or set it to {REQUIRED_LAYOUT}) and use an attention backend that "
            f"supports {REQUIRED_LAYOUT} or LBNHC")
    if num_blocks is None or t.shape[0] == num_blocks:
        return t
    if t.dim() > 0 and num_blocks > 0 and t.shape[0] % num_blocks == 0:
        return t.unflatten(0, (num_blocks, t.shape[0] // num_blocks))
    raise NotImplementedError(f"LLMDataDistConnector: layer {name}'s KV cache has shape {tuple(t.shape)}; "
                              f"expected {num_blocks} blocks (or a multiple: kernel blocks) on dimension 0")


def cache_desc(tensors: List[torch.Tensor], shape: Optional[Tuple[int, ...]] = None) -> ld.CacheDesc:
    """The blocks cache the tensors make: their shape (or ``shape``: of as many elements, as vLLM's
    views say it where they are registered transposed), their dtype (or raw bytes of its width),
    HOST for CPU tensors and DEVICE otherwise."""
    first = tensors[0]
    dtype = DTYPES.get(first.dtype) or BY_WIDTH[first.element_size()]
    placement = ld.Placement.HOST if first.device.type == "cpu" else ld.Placement.DEVICE
    return ld.CacheDesc(len(tensors), list(shape or first.shape), dtype, placement)


def check_device(dd: ld.LLMDataDist, device: torch.device, device_id: int) -> None:
    """KV tensors on ``device`` must be memory of the engine's device runtime, on the device the
    engine binds its threads to (``device_id``); else refused with what to change."""
    from llm_datadist import runtimes
    engine = dd.engine
    runtime = engine.runtime
    if device.type not in runtimes.tensor_devices(runtime.name):
        holders = [name for name in runtimes.names() if device.type in runtimes.tensor_devices(name)]
        fix = (f"set LLM_DATADIST_DEVICE={holders[0]}" if holders else
               "no llm_datadist device runtime holds such tensors")
        raise NotImplementedError(f"LLMDataDistConnector: the KV caches are {device.type} tensors, but the "
                                  f"llm_datadist device runtime is {runtime.name} ({engine.runtime_reason}); "
                                  f"{fix}")
    index = device.index if device.index is not None else device_id
    if index != device_id:
        raise NotImplementedError(f"LLMDataDistConnector: the KV caches are on {device}, but this worker's "
                                  f"llm_datadist engine uses device {device_id} (the current device when "
                                  f"the connector was built)")


def head_split(first: torch.Tensor, heads: Any, tp_size: int, token_major: bool = False) -> Tuple[Optional[int], str]:
    """``(bytes of one KV head in a block, "")`` if each block of a rank's registered tensors (the
    first of them: ``first``) holds the rank's share of the model's ``heads`` KV heads outermost
    (``[heads, tokens, ...]``: vLLM's LBHNC views), so that a range of heads is one byte range of
    each block; else ``(None, why not)``. A rank holds ``heads / tp_size`` of them, or one (replicated)
    where ``tp_size`` is a multiple of ``heads`` (``meta.held_heads``)."""
    if token_major:
        return None, "its KV cache layout is LBNHC: a range of heads is no one byte range of a block"
    if not isinstance(heads, int) or heads <= 0:
        return None, "this engine's model does not say its KV heads"
    if heads % tp_size and tp_size % heads:
        return None, f"the model's {heads} KV heads and this engine's {tp_size} ranks do not divide one another"
    mine = max(1, heads // tp_size)
    if first.dim() != 4 or first.shape[1] != mine:
        return None, (f"its KV blocks of shape {tuple(first.shape[1:])} do not hold this rank's {mine} KV "
                      "heads outermost")
    return first[0].numel() * first.element_size() // mine, ""

