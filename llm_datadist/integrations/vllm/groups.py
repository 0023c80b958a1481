"""A hybrid model's KV cache groups (vLLM's hybrid KV cache manager): which groups move, which of
their blocks, and which model shapes the connector refuses.

vLLM gives each kind of attention layer its own KV cache group with its own block ids (full
attention, sliding window...). A sliding-window group needs only the blocks that hold its window's
tokens: vLLM frees (and, on the decode side, never allocates) the ones before it, and lists them as
its null block. So both sides clip such a group's block list to its last ``window_blocks`` ids:
``ceil(window / block_size) + 1`` (the window seldom starts at a block boundary), less the null
block (vLLM's block 0) in front; the decode side's list is then paired with the tail of the prefill
side's (``Recv.group_pairs``), as for a local prefix hit.

A state-space (Mamba) group (``state``) moves one block per request, the one holding its running
state, by the rules of ``state``; the prefill engine then stops one token short of the prompt.
They move with vLLM's ``mamba_cache_mode`` ``"none"`` (no prefix caching) only, and beside at least
one attention group (a hybrid model such as NemotronH, Jamba, Bamba)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from llm_datadist.integrations.vllm import state


#: vLLM's null block (``BlockPool.null_block``, the first of the pool), which stands in a
#: sliding-window group's list for the blocks before its window.
NULL_BLOCK = 0


@dataclass(frozen=True)
class Group:
    """One KV cache group that moves between engines."""

    index: int  # in vLLM's ``kv_cache_groups``
    kind: str  # "full", "sliding_window" or "mamba" (or, for a lone group, the spec's class name)
    window: int = 0  # sliding window in tokens; 0: every block of the prompt
    block_size: int = 0
    layers: Tuple[str, ...] = ()
    spec_blocks: int = 0  # a state-space group's scratch blocks after its running state (speculative decoding)

    @property
    def window_blocks(self) -> int:
        """The most blocks of this group a request's KV needs (0: all of them)."""
        if not self.window or not self.block_size:
            return 0
        return -(-self.window // self.block_size) + 1

    @property
    def is_state(self) -> bool:
        """A state-space group: one running-state block per request moves (``state``)."""
        return self.kind == "mamba"

    @property
    def name(self) -> str:
        return f"sliding_window({self.window})" if self.window else self.kind


def transfer_groups(kv_cache_config: Any) -> Tuple[Group, ...]:
    """The groups of ``kv_cache_config`` that move (vLLM's ``transfer_group_ids``), in that order;
    ``()`` without a config (an engine that does not say: one group of full attention).
    ``NotImplementedError`` for groups this connector cannot move: state-space (Mamba) groups with
    prefix caching (a ``mamba_cache_mode`` but ``"none"``) or without an attention group beside them,
    and, in a model with several groups, any other than full, sliding-window or state-space."""
    if kv_cache_config is None or not getattr(kv_cache_config, "kv_cache_groups", None):
        return ()
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec, UniformTypeKVCacheSpecs

    all_groups = kv_cache_config.kv_cache_groups
    ids = getattr(kv_cache_config, "transfer_group_ids", None)
    ids = tuple(range(len(all_groups))) if ids is None else tuple(ids)
    out: List[Group] = []
    for index in ids:
        group = all_groups[index]
        spec = group.kv_cache_spec
        layers = tuple(group.layer_names)
        if isinstance(spec, MambaSpec):
            mode = str(getattr(spec, "mamba_cache_mode", "none"))
            if mode not in state.SUPPORTED_CACHE_MODES:
                raise NotImplementedError(
                    f"LLMDataDistConnector moves state-space (Mamba) KV cache groups with mamba_cache_mode "
                    f"{' or '.join(map(repr, state.SUPPORTED_CACHE_MODES))} only; this engine's group {index} has "
                    f"{mode!r} (prefix caching of a hybrid SSM model): start it with --no-enable-prefix-caching")
            out.append(Group(index, "mamba", 0, int(spec.block_size), layers,
                             spec_blocks=int(getattr(spec, "num_speculative_blocks", 0) or 0)))
            continue
        block_size = int(getattr(spec, "block_size", 0) or 0)
        if isinstance(spec, UniformTypeKVCacheSpecs) and spec.kv_cache_specs and all(
                isinstance(s, FullAttentionSpec) for s in spec.kv_cache_specs.values()):
            # full attention (MLA included) in layers of several shapes: an EAGLE drafter's beside
            # the target's, MLA's and indexer caches; each shape is a cache of its own (``caches``)
            out.append(Group(index, "full", 0, block_size, layers))
        elif isinstance(spec, SlidingWindowSpec):
            out.append(Group(index, "sliding_window", int(spec.sliding_window), block_size, layers))
        elif isinstance(spec, FullAttentionSpec):
            out.append(Group(index, "full", 0, block_size, layers))
        elif len(all_groups) > 1:
            raise NotImplementedError(
                f"LLMDataDistConnector moves full and sliding-window attention KV cache groups only; this "
                f"model's group {index} is {type(spec).__name__}")
        else:
            out.append(Group(index, type(spec).__name__, 0, block_size, layers))
    if out and all(g.is_state for g in out):
        raise NotImplementedError("LLMDataDistConnector moves state-space (Mamba) KV cache groups beside attention "
                                  "groups only (hybrid models); this model has state-space layers only")
    return tuple(out)


def state_backoff(groups: Sequence[Group]) -> int:
    """Trailing prompt tokens the prefill engine leaves to the decode engine: one with a
    state-space group (``state.PREFILL_BACKOFF``), else none."""
    return state.PREFILL_BACKOFF if any(g.is_state for g in groups) else 0


def describe(groups: Sequence[Group]) -> Optional[str]:
    """What the compatibility check compares (``compat``): each group's kind and window, and its
    layers; None for one full-attention group (what every engine without a config has)."""
    if len(groups) <= 1 and all(not g.window for g in groups):
        return None
    return ";".join(f"{g.name}:{len(g.layers)}" for g in groups)


def clip(groups: Sequence[Group], block_ids: Sequence[Sequence[int]], num_groups: int) -> Tuple[List[int], ...]:
    """A request's block ids (vLLM's, one list per KV cache group, ``num_groups`` of them) cut to
    what moves: the transfer groups, in order, each sliding-window one to its last
    ``window_blocks`` ids, each state-space one to its running-state block. Without groups (no
    config): the first list, whole."""
    if not groups:
        return (list(block_ids[0]) if block_ids else [],)
    if len(block_ids) != num_groups:
        raise ValueError(f"expected {num_groups} KV cache groups, got {len(block_ids)}")
    out = []
    for group in groups:
        blocks = list(block_ids[group.index])
        keep = group.window_blocks
        if group.is_state:
            blocks = state.running_state_block(blocks, group.spec_blocks, NULL_BLOCK)
        elif keep:
            blocks = [b for b in blocks[-keep:] if b != NULL_BLOCK]
        out.append(blocks)
    return tuple(out)


def expected_blocks(groups: Sequence[Group], prompt_tokens: int, block_size: int) -> List[Tuple[int, int]]:
    """``(fewest, most)`` block ids a prefill engine hands out per group for a prompt of
    ``prompt_tokens``: every block for a full group; for a sliding-window group at least one and
    at most ``window_blocks`` (never more than the prompt has); for a state-space group one.
    Whether the decode side's own blocks of a group are covered is checked when it pulls."""
    if not groups:
        wanted = -(-prompt_tokens // block_size)
        return [(wanted, wanted)]
    out = []
    for group in groups:
        blocks = -(-prompt_tokens // (group.block_size or block_size))
        if group.is_state:
            out.append((min(1, blocks), min(1, blocks)))
            continue
        out.append((min(1, blocks), min(blocks, group.window_blocks)) if group.window_blocks else (blocks, blocks))
    return out
