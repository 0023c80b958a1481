"""KV between engines whose KV cache layouts differ (``VLLM_KV_CACHE_LAYOUT``, or an attention
backend that supports another layout than the ``LBHNC`` the connector asks for).

vLLM 0.32 hands each layer over as a logical ``[blocks, heads, tokens, C]`` view whose strides follow
the resolved layout (``vllm/v1/kv_cache_layout.py``). Two layouts keep each layer's blocks one
contiguous run, so the connector registers them where they are: ``LBHNC`` (a block is ``[heads,
tokens, C]``) and ``LBNHC`` (``[tokens, heads, C]``: the view is the block's transpose, registered as
that, ``layout.blocks_view``). In both, one KV head of a block is one strided range: ``tokens`` runs
of ``C`` elements, adjacent in ``LBHNC``, ``heads * C`` apart in ``LBNHC``. Between engines of one
of them, blocks move whole; between one of each, the decode worker pulls each head of each block as
strided runs (``regions``, planned by the core: ``_core.plan_strided_blocks``). Other layouts are
refused when the caches are registered.

Each side says its layout on the link (compat field ``kv_layout``, ``compat.differences``); the
decode worker keeps what each prefill engine said (``LinkLayouts``) and plans with it. What a peer
says is checked against what its registered blocks are: a region outside its blocks is refused by
the planner, nothing written. Between engines of other tensor parallel sizes or block sizes, KV
moves only where both are ``LBHNC`` (``refusal``)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from math import prod
from typing import Any, List, Optional, Sequence, Tuple

import llm_datadist as ld

#: The layout a cache whose views are one contiguous run is registered as (``layout.REQUIRED_LAYOUT``).
HEAD_MAJOR = "LBHNC"
#: The layout whose views are registered as their blocks' transpose.
TOKEN_MAJOR = "LBNHC"
#: The layouts KV moves between.
MOVED = (HEAD_MAJOR, TOKEN_MAJOR)
#: The KV format (``compat.KV_FORMAT``) of an engine whose blocks are token-major: releases that
#: know only format 1 refuse it instead of misreading it; those that say their ``kv_layout``
#: compare that instead.
KV_FORMAT_TOKEN_MAJOR = 2
#: Linked prefill clusters whose layout a worker keeps (the oldest are forgotten past it).
MAX_LINKS = 4096


def logical_shape(shape: Sequence[int]) -> Tuple[int, ...]:
    """A registered token-major tensor's shape (``[blocks, (kernel blocks,) tokens, heads, C]``) as
    vLLM's logical view says it (``[..., heads, tokens, C]``)."""
    shape = tuple(shape)
    return shape[:-3] + (shape[-2], shape[-3], shape[-1])


def engine_layout(classes: Sequence[Any]) -> str:
    """The layout of an engine's registered caches (``caches.CacheClass``): token-major if any is."""
    return TOKEN_MAJOR if any(getattr(cls, "token_major", False) for cls in classes) else HEAD_MAJOR


def fields(classes: Sequence[Any], pulls: bool) -> dict:
    """What an engine says of its layout on the link (``compat``): ``kv_layout``, whether its pulls
    permute (``kv_layout_pulls``: pull mode; push mode writes whole blocks) and, for a token-major
    engine, the KV format that older releases refuse (``KV_FORMAT_TOKEN_MAJOR``)."""
    layout = engine_layout(classes)
    said = {"kv_layout": layout, "kv_layout_pulls": pulls}
    return dict(said, kv_format=KV_FORMAT_TOKEN_MAJOR) if layout == TOKEN_MAJOR else said


def regions(shape: Sequence[int], element_size: int, src_layout: str, dst_layout: str
            ) -> List[Tuple[int, int, int, int, int, int]]:
    """``_core.plan_strided_blocks``'s regions from blocks laid out as ``src_layout`` into blocks laid
    out as ``dst_layout`` of a cache of logical ``shape`` (``[blocks, (kernel blocks,) heads, tokens,
    C]``): per kernel block and head, ``tokens`` runs of ``C`` elements."""
    *outer, heads, tokens, c = shape[1:]
    piece = c * element_size
    head_bytes = heads * tokens * piece  # one kernel block

    def start_and_stride(layout: str, h: int) -> Tuple[int, int]:
        return (h * tokens * piece, piece) if layout == HEAD_MAJOR else (h * piece, heads * piece)
    out = []
    for kb in range(prod(outer)):
        for h in range(heads):
            (src, src_stride), (dst, dst_stride) = start_and_stride(src_layout, h), start_and_stride(dst_layout, h)
            out.append((kb * head_bytes + src, src_stride, kb * head_bytes + dst, dst_stride, piece, tokens))
    return out


def refusal(mine: Optional[str], theirs: str, other_block_size: bool, other_tp: bool) -> str:
    """Why KV cannot move between this engine's layout ``mine`` and a prefill engine's ``theirs`` for
    one request (``other_block_size``/``other_tp``: the engines' block or TP sizes differ); ""."""
    mine = mine or HEAD_MAJOR
    if theirs not in MOVED:
        return f"its KV cache layout {theirs[:16]!r} is none this connector moves ({', '.join(MOVED)})"
    if (other_block_size or other_tp) and (mine, theirs) != (HEAD_MAJOR, HEAD_MAJOR):
        what = "block sizes" if other_block_size else "tensor parallel sizes"
        return (f"KV moves between engines of different {what} where both KV cache layouts are {HEAD_MAJOR} "
                f"(its is {theirs}, this engine's {mine})")
    return ""


class LinkLayouts:
    """The KV cache layout each linked prefill cluster said (``compat.ask``); an engine that says
    none (an older release) registers ``LBHNC`` only."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said: "OrderedDict[int, str]" = OrderedDict()

    def learn(self, cluster_id: int, layout: Any) -> None:
        with self._lock:
            self._said.pop(cluster_id, None)
            if isinstance(layout, str):
                self._said[cluster_id] = layout[:32]
                while len(self._said) > MAX_LINKS:
                    self._said.popitem(last=False)

    def of(self, cluster_id: int) -> str:
        with self._lock:
            return self._said.get(cluster_id, HEAD_MAJOR)


def pull(cm: Any, engine: Any, cluster_id: int, k: int, cache: Any, cls: Any, remote: Sequence[int],
         local: Sequence[int], theirs: str) -> None:
    """Cache ``k``'s blocks (``cls``, ``caches.CacheClass``, registered as ``cache``) from the peer
    ``cluster_id``'s cache ``k``, laid out as ``theirs``: whole blocks where the layouts are one, else
    each head as strided runs (``Engine.pull_strided_blocks``)."""
    mine = TOKEN_MAJOR if cls.token_major else HEAD_MAJOR
    if cache is None or mine == theirs:  # (no cache: not registered, which pull_blocks refuses)
        cm.pull_blocks(ld.BlocksCacheKey(cluster_id, k), cache, remote, local)
        return
    planned = regions(cls.shape, cls.tensors[0].element_size(), theirs, mine)
    engine.pull_strided_blocks(cluster_id, k, cache.cache_id, remote, local, planned)
