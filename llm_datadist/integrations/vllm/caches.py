"""The llm_datadist caches a worker registers: vLLM's per-layer KV views sorted into classes of one
shape and element type, each class one blocks cache, and the description peers compare before a
pull writes anything.

One model can hold layers of several cache shapes in one KV cache group: an EAGLE or draft model's
layers beside the target's (other heads or head size), MLA's latent caches, DeepSeek's indexer
caches. vLLM then gives the group one list of block ids that indexes every layer's view, whatever
its shape. So the caches are keyed by ``(group, shape, dtype)``: a group's block ids move in each
of its caches, and the caches are numbered (llm_datadist ``model_id``) in the order of their
first layer in vLLM's ``kv_caches``, which is the same on two engines of one model and config.

Peers check that they agree (``mismatch``): the description (``describe``) names, per cache, its
group, its tensors, the shape of one block, the element type, its layers' count and a digest of
their names. A peer that describes other caches is refused for every request (the worker reports
them in ``failed_recving``); a peer that does not describe its caches (an older release) is
refused where this engine has more than one."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from llm_datadist.integrations.vllm import kv_layouts, layout

#: Hex digits of a cache's layer-name digest in its description.
DIGEST_CHARS = 16
#: The most caches a description may list (it comes from the network).
MAX_CACHES = 64


@dataclass
class CacheClass:
    """The layers of one KV cache group whose block views share one shape and dtype: one
    llm_datadist blocks cache."""

    group: int  # position among the groups that move (0 without groups)
    #: of each layer's view as vLLM says it (``[blocks, (kernel blocks,) heads, tokens, C]``): its
    #: tensor's shape, or that of its transpose where ``token_major``
    shape: Tuple[int, ...]
    dtype: torch.dtype
    layers: List[str] = field(default_factory=list)  # every layer whose view is here
    tensors: List[torch.Tensor] = field(default_factory=list)  # one per distinct view
    #: a state-space group's pages (``state.py``): the byte ranges of each page a pull moves (its
    #: states, not the padding) and their bytes; None: whole blocks
    ranges: Optional[Tuple[Tuple[int, int], ...]] = None
    state_bytes: int = 0
    #: registered as blocks of ``[tokens, heads, C]`` (vLLM's LBNHC layout, ``kv_layouts``)
    token_major: bool = False

    @property
    def block_bytes(self) -> int:
        """Bytes a pull moves of one block of all tensors together."""
        if self.ranges is not None:
            return len(self.tensors) * self.state_bytes
        return sum(t[0].numel() * t.element_size() for t in self.tensors)

    def describe(self) -> str:
        """``g<group>:<tensors>x<block shape>:<dtype>:<layers>L:<digest of the layer names>``."""
        digest = hashlib.sha256("\n".join(self.layers).encode()).hexdigest()[:DIGEST_CHARS]
        dtype = str(self.dtype).replace("torch.", "")
        return f"g{self.group}:{len(self.tensors)}x{list(self.shape[1:])}:{dtype}:{len(self.layers)}L:{digest}"


def plan(kv_caches: Dict[str, Any], group_layers: Sequence[Sequence[str]], num_blocks: Optional[int],
         kv_layout: Optional[str] = None, states: Optional[Dict[int, Tuple[List[torch.Tensor], Any]]] = None
         ) -> List[CacheClass]:
    """vLLM's ``kv_caches`` sorted into caches: per group (``group_layers``, the layer names of each
    group that moves, in order; empty: every layer is of one group), per ``(shape, dtype)`` of the
    layers' block views (``layout.blocks_view``), in the order of their first layer. Layers that
    share one view count once among the tensors, and all appear among the layers. A state-space
    group (``states``: by group position, its pages and ``state.StateLayout``, from
    ``state.group_pages``) is one cache of its pages. Refused (``ValueError`` /
    ``NotImplementedError``, one line): a group without layers here, a layer that is not one
    tensor, views on different devices."""
    names = list(kv_caches)
    if group_layers:
        wanted: List[Set[str]] = [set(layers) for layers in group_layers]
        missing = [k for k, layers in enumerate(wanted) if not layers & set(names)]
        if missing:
            raise ValueError(f"LLMDataDistConnector: no KV caches of the layers of KV cache group(s) {missing}")
    else:
        wanted = [set(names)]
    out: List[CacheClass] = []
    for group, layers in enumerate(wanted):
        if states and group in states:
            pages, found = states[group]
            out.append(CacheClass(group, tuple(pages[0].shape), pages[0].dtype, [n for n in names if n in layers],
                                  list(pages), ranges=tuple(found.ranges), state_bytes=found.state_bytes))
            continue
        # (views of one memory in two groups are normal: vLLM's hybrid manager lays a layer of
        # each group over one buffer, each group's blocks indexing it its own way)
        seen: Dict[int, CacheClass] = {}  # data_ptr -> the class of this group holding that view
        by_key: Dict[Tuple[Tuple[int, ...], torch.dtype, bool], CacheClass] = {}
        for name in names:  # vLLM's order
            if name not in layers:
                continue
            value = kv_caches[name]
            if not isinstance(value, torch.Tensor):
                raise NotImplementedError(f"LLMDataDistConnector: layer {name} has a KV cache of type "
                                          f"{type(value).__name__}; one tensor per layer is supported")
            view = layout.blocks_view(name, value, num_blocks, kv_layout)
            owner = seen.get(view.data_ptr())
            if owner is not None:  # a layer sharing another's cache (vLLM's KV sharing)
                if owner.tensors[0].shape != view.shape or owner.dtype != view.dtype:
                    raise NotImplementedError(f"LLMDataDistConnector: layer {name} shares its KV cache with a "
                                              "layer of another shape")
                owner.layers.append(name)
                continue
            token_major = not value.is_contiguous()  # (blocks_view took it as LBNHC blocks)
            key = (kv_layouts.logical_shape(view.shape) if token_major else tuple(view.shape), view.dtype, token_major)
            cls = by_key.get(key)
            if cls is None:
                cls = by_key[key] = CacheClass(group, key[0], key[1], token_major=token_major)
                out.append(cls)
            cls.layers.append(name)
            cls.tensors.append(view)
            seen[view.data_ptr()] = cls
    if not out:
        raise ValueError("LLMDataDistConnector: no KV caches to register")
    devices = {t.device for cls in out for t in cls.tensors}
    if len(devices) > 1:
        raise NotImplementedError(f"LLMDataDistConnector: the KV caches are on different devices "
                                  f"({', '.join(sorted(map(str, devices)))})")
    # caches of one group in the order of their first layer in vLLM's kv_caches, groups in order
    order = {name: k for k, name in enumerate(names)}
    out.sort(key=lambda c: (c.group, order[c.layers[0]]))
    return out


def describe(classes: Sequence[CacheClass]) -> str:
    """What peers compare (``compat`` field ``caches``): each cache's description, in order."""
    return ";".join(cls.describe() for cls in classes)


_ENTRY = re.compile(r"g(\d{1,3}):(\d{1,6})x\[([0-9, ]{0,200})\]:([a-z0-9_]{1,32}):(\d{1,7})L:([0-9a-f]{%d})$"
                    % DIGEST_CHARS)


def parse(description: Any) -> Optional[List[Tuple[int, int, Tuple[int, ...], str, int, str]]]:
    """A peer's ``caches`` description as ``(group, tensors, block shape, dtype, layers, digest)``
    per cache, or None if it is not one (it comes from the network: never raises)."""
    if not isinstance(description, str) or not description or len(description) > MAX_CACHES * 300:
        return None
    out = []
    entries = description.split(";")
    if len(entries) > MAX_CACHES:
        return None
    for entry in entries:
        match = _ENTRY.match(entry)
        if match is None:
            return None
        group, tensors, shape, dtype, layers, digest = match.groups()
        try:
            dims = tuple(int(d) for d in shape.split(",") if d.strip())
        except ValueError:
            return None
        out.append((int(group), int(tensors), dims, dtype, int(layers), digest))
    return out


def mismatch(mine: str, theirs: Any, block_sizes: Optional[Tuple[int, int]] = None) -> Optional[str]:
    """Why a peer whose description is ``theirs`` has other caches than ours (``mine``); None if it
    has the same: as many caches, each of the same group, tensors, block shape, element type and
    layers (by name). The first difference is named. ``block_sizes``: ``(ours, theirs)`` where the
    engines' block sizes differ: block shapes are compared without their token dimension (the
    second last, where it is that side's block size)."""
    here, there = parse(mine), parse(theirs)
    if block_sizes is not None and here is not None and there is not None:
        here = [e[:2] + (_without_tokens(e[2], block_sizes[0]),) + e[3:] for e in here]
        there = [e[:2] + (_without_tokens(e[2], block_sizes[1]),) + e[3:] for e in there]
    if here is None:
        return "this engine's cache description is malformed"
    if there is None:
        return "its cache description is malformed"
    if len(here) != len(there):
        return f"it registers {len(there)} KV caches, this engine {len(here)} ({_shapes(there)} there, " \
               f"{_shapes(here)} here)"
    for k, (a, b) in enumerate(zip(there, here)):
        what = [f"{name} {x} there, {y} here" for name, x, y in
                (("KV cache group", a[0], b[0]), ("tensors", a[1], b[1]), ("block shape", list(a[2]), list(b[2])),
                 ("dtype", a[3], b[3]), ("layers", a[4], b[4])) if x != y]
        if not what and a[5] != b[5]:
            what = ["its layers have other names"]
        if what:
            return f"KV cache {k}: " + ", ".join(what)
    return None


def _without_tokens(shape: Tuple[int, ...], block_size: int) -> Tuple[Any, ...]:
    """A block shape with its token dimension (the second last) as ``N`` where it is ``block_size``."""
    if len(shape) < 2 or shape[-2] != block_size:
        return shape
    return shape[:-2] + ("N",) + shape[-1:]


def _shapes(entries) -> str:
    return "; ".join(f"{list(e[2])}:{e[3]}" for e in entries)
