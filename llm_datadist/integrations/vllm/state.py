"""State-space (Mamba) KV cache groups: which block holds a request's state, how a layer's state
pages are registered, which bytes of them move, and the prompt backoff.

vLLM keeps a Mamba layer's state in pages of the same backing allocation as the attention layers'
blocks (cache groups overlay each other: a block id belongs to one group at a time): block ``b``
of a state-space group is one page holding every state of the layer for one request, packed from
the page's start in the ``MambaSpec``'s order (Mamba2: the convolution state, then the SSM state),
then padding up to the page size the groups share. vLLM 0.32 hands the connector such a layer as
an ``int8`` view of its pages (``[blocks, 1, 1, state bytes]``, block stride = the page; the layer
cuts its own per-state views out of it). So each layer registers its pages (``state_pages``:
``[blocks, page stride]`` bytes over the same memory; the group's layers are one llm_datadist
cache), and a pull moves only the byte ranges its states cover (``StateLayout.ranges``, one range
per page for Mamba2: conv and SSM states are adjacent), with the states' offsets, shapes and dtypes
part of what two engines compare (``StateLayout.describe``).

Which blocks move: with ``mamba_cache_mode`` ``"none"`` (no prefix caching: the only mode vLLM
0.32's CPU build runs) a request holds one state block (the group's block size is the model's
length) plus, with speculative decoding, ``num_speculative_blocks`` scratch blocks after it. The
running state is the last block before the scratch ones (``running_state_block``): that one block
moves. The prefill engine stops one token short of the prompt (``PREFILL_BACKOFF``): it computes
the state after token N-1, and the decode engine computes token N itself from that state (a state
cannot be rewound, so the decode engine cannot recompute a token the prefill already folded in),
as vLLM's NixlConnector does."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

#: Trailing prompt tokens a prefill engine of a model with state-space layers leaves to the
#: decode engine (NixlConnector's ``_prefill_backoff`` for Mamba).
PREFILL_BACKOFF = 1

#: The ``mamba_cache_mode`` whose block lists this module reads (see the module's docstring).
SUPPORTED_CACHE_MODES = ("none",)


def running_state_block(blocks: Sequence[int], spec_blocks: int, null_block: int = 0) -> List[int]:
    """The block of a state-space group's list that holds the request's running state, as a list
    (empty if there is none): the last one once the trailing ``spec_blocks`` scratch blocks are
    left out (all but the first of a list shorter than that), never the null block."""
    if not blocks:
        return []
    scratch = min(max(0, spec_blocks), len(blocks) - 1)
    kept = blocks[len(blocks) - 1 - scratch]
    return [] if kept == null_block else [kept]


def computed_refusal(params: Any, loaded: int) -> str:
    """Why a prefill's ``kv_transfer_params`` (untrusted) cannot give a decode engine the state of
    the first ``loaded`` prompt tokens: its ``remote_num_tokens`` (the tokens it computed) must be
    exactly those, else the state it holds is of another position (a prefill engine that did not
    stop one token short); "" if they can."""
    told = params.get("remote_num_tokens") if isinstance(params, dict) else None
    if type(told) is not int:
        return ("they do not say how many tokens the prefill computed (remote_num_tokens), which the state of a "
                "model with state-space layers needs")
    if told != loaded:
        return (f"the prefill computed {told} tokens, {loaded} wanted (its state-space layers' state is of another "
                "position: a prefill engine that does not stop one token short?)")
    return ""


@dataclass(frozen=True)
class State:
    """One state of a layer, inside each of its pages."""

    offset: int  # bytes from the page's start
    nbytes: int
    shape: Tuple[int, ...]  # of one block's state
    dtype: str


@dataclass(frozen=True)
class StateLayout:
    """Where a state-space layer's states lie in its pages."""

    page_bytes: int
    states: Tuple[State, ...]

    @property
    def ranges(self) -> Tuple[Tuple[int, int], ...]:
        """``(offset, bytes)`` of each page that a pull moves: the states' ranges, adjacent ones
        merged (Mamba2's conv and SSM states are one range), padding left out."""
        merged: List[List[int]] = []
        for s in sorted(self.states, key=lambda s: s.offset):
            if merged and merged[-1][0] + merged[-1][1] == s.offset:
                merged[-1][1] += s.nbytes
            else:
                merged.append([s.offset, s.nbytes])
        return tuple((o, n) for o, n in merged)

    @property
    def state_bytes(self) -> int:
        return sum(s.nbytes for s in self.states)

    def describe(self) -> str:
        """What two engines compare: the page size and each state's place, shape and dtype."""
        return f"page{self.page_bytes}:" + ",".join(
            f"{s.offset}+{s.nbytes}={list(s.shape)}{s.dtype}" for s in self.states)


def spec_layout(spec: Any) -> StateLayout:
    """Where a ``MambaSpec``'s states lie in its pages: packed from the page's start in the spec's
    order (vLLM's ``MambaBase.bind_kv_cache``), ``page_size_bytes`` apart."""
    from vllm.utils.torch_utils import get_dtype_size

    states, offset = [], 0
    for shape, dtype in zip(spec.shapes, spec.dtypes):
        nbytes = math.prod(shape) * get_dtype_size(dtype)
        states.append(State(offset, nbytes, tuple(int(n) for n in shape), str(dtype).replace("torch.", "")))
        offset += nbytes
    return StateLayout(int(spec.page_size_bytes), tuple(states))


def state_pages(name: str, cache: Any, layout: StateLayout, num_blocks: Optional[int]) -> torch.Tensor:
    """A state-space layer's pages as one blocks tensor over the same memory: ``[blocks, stride]``
    bytes, row ``b`` starting at block ``b``'s page (``stride``: one page to the next, at least
    the page). ``cache`` is what vLLM hands the connector: its view of the layer's pages (vLLM
    0.32: ``int8 [blocks, 1, 1, state bytes]``, block stride = the page) or the layer's per-state
    views (block id on dimension 0), which must lie where ``layout`` says. ``NotImplementedError``
    naming what does not fit."""
    views = [cache] if isinstance(cache, torch.Tensor) else cache
    if not isinstance(views, (list, tuple)) or not views or not all(isinstance(v, torch.Tensor) for v in views):
        raise NotImplementedError(f"LLMDataDistConnector: state-space layer {name}'s cache is a "
                                  f"{type(cache).__name__}; a view of its pages or a tuple of its state views is "
                                  "supported")
    first = views[0]
    blocks = first.shape[0] if first.dim() else 0
    stride = first.stride(0) * first.element_size() if first.dim() else 0
    base = min(v.data_ptr() for v in views)
    found = []
    for v in views:
        if v.dim() < 2 or v.shape[0] != blocks or blocks != (num_blocks if num_blocks is not None else blocks) or \
                v.stride(0) * v.element_size() != stride or v.device != first.device or not v[0].is_contiguous():
            raise NotImplementedError(f"LLMDataDistConnector: state-space layer {name}'s cache of shape "
                                      f"{tuple(v.shape)} and strides {v.stride()} is not one contiguous range of "
                                      f"each of {num_blocks} pages {stride} bytes apart")
        found.append((v.data_ptr() - base, v[0].numel() * v.element_size()))
    if isinstance(cache, torch.Tensor):
        # (the page view: the states are packed from its start, and it must hold them all)
        if found[0][1] < layout.state_bytes:
            raise NotImplementedError(f"LLMDataDistConnector: state-space layer {name}'s pages hold {found[0][1]} "
                                      f"bytes of state, its spec {layout.state_bytes} ({layout.describe()})")
    elif found != [(s.offset, s.nbytes) for s in layout.states] or \
            [tuple(v.shape[1:]) for v in views] != [s.shape for s in layout.states]:
        raise NotImplementedError(f"LLMDataDistConnector: state-space layer {name}'s states lie at (offset, bytes) "
                                  f"{found}, its spec says {layout.describe()}")
    if layout.page_bytes > stride:
        raise NotImplementedError(f"LLMDataDistConnector: state-space layer {name}'s states ({layout.describe()}) do "
                                  f"not fit pages {stride} bytes apart")
    storage = first.untyped_storage()
    start = base - storage.data_ptr()
    if start < 0 or start + blocks * stride > storage.nbytes():
        # (a registered blocks tensor's rows are whole: where the last page ends the buffer short of a
        # row, as in a block-outermost layout, the layer cannot be registered)
        raise NotImplementedError(f"LLMDataDistConnector: state-space layer {name}'s {blocks} pages, {stride} "
                                  "bytes apart, do not lie inside its buffer as whole rows (the connector asks "
                                  "for a layer-outermost KV cache layout)")
    pages = torch.empty(0, dtype=torch.uint8, device=first.device)
    pages.set_(storage, start, (blocks, stride), (stride, 1))
    return pages


def group_pages(group: Any, kv_caches: Any, kv_cache_config: Any, num_blocks: Optional[int]
                ) -> Tuple[List[torch.Tensor], StateLayout]:
    """The pages of a state-space group's layers (``group``: a ``groups.Group``; those of its
    layers in ``kv_caches``, layers sharing memory once) and their one layout, from the group's
    ``MambaSpec`` in ``kv_cache_config``."""
    spec = kv_cache_config.kv_cache_groups[group.index].kv_cache_spec
    layout = spec_layout(spec)
    tensors: List[torch.Tensor] = []
    seen = set()
    for name in group.layers:
        if name not in kv_caches:
            continue
        pages = state_pages(name, kv_caches[name], layout, num_blocks)
        if pages.data_ptr() not in seen:
            seen.add(pages.data_ptr())
            tensors.append(pages)
    if not tensors:
        raise ValueError(f"LLMDataDistConnector: no caches of the state-space layers of KV cache group {group.index}")
    return tensors, layout
