"""KV between engines of different block sizes (``--block-size``), pull mode: one side's block
holds a whole multiple of the other's tokens. With vLLM's ``LBHNC`` layout a block is
``[heads, tokens, ...]``, so a small block is, head by head, one strided sub-block of a large one;
the core plans those runs (``_core.plan_sub_blocks``, bounds-checked on both sides) and the engine
seam pulls them (``Engine.pull_sub_blocks``). Either side may be the smaller. The decode
scheduler refuses what this does not cover (``refusal``); its worker pairs the blocks by their
position in the prompt (``sub_block_pairs``)."""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

from llm_datadist.integrations.vllm.meta import Recv

#: Off until the pairing knows each attention backend's layout inside a block: vLLM 0.32's CPU
#: attention ("vec" ISA) stores each head's keys of a block transposed (``[head_size, block_size]``,
#: its values ``[block_size, head_size]``), so a sub-block of tokens is ``head_size`` strided runs of
#: keys plus one run of values, not the ``2 * heads`` runs ``token_runs`` assumes; pulls planned
#: that way decode wrong tokens (``test_vllm_block_sizes``). The core's planner and the pairing
#: below are ready for the right runs.
ENABLED = False

#: Where a refusal line sends the operator.
_SAME = "(the engines must share --block-size)"


def differ(spec: Recv, block_size: int) -> bool:
    """Whether the prefill engine's blocks (its params say) hold another token count than ours."""
    return spec.remote_block_size is not None and spec.remote_block_size != block_size


def refusal(remote: int, block_size: int, groups: Sequence[Any], other_tp: bool) -> str:
    """Why KV cannot move between this engine's blocks of ``block_size`` tokens and a prefill
    engine's of ``remote`` (``remote_block_size``, from outside), for this engine's KV cache
    ``groups`` (``groups.Group``) and ``other_tp`` (the engines' TP sizes differ); "" if it can."""
    small, large = sorted((remote, block_size))
    if small <= 0 or large % small:
        return f"neither is a whole multiple of the other {_SAME}"
    if len(groups) > 1 or any(g.window or g.is_state for g in groups):
        return f"KV of sliding-window or state-space layers moves between equal block sizes only {_SAME}"
    if other_tp:
        return f"KV moves between engines of different tensor parallel sizes with equal block sizes only {_SAME}"
    if not ENABLED:
        return (f"KV of another block size is not supported yet: vLLM's CPU attention keeps each head's keys of a "
                f"block as [head_size, block_size] (transposed), so its tokens are no strided run {_SAME}")
    return ""


def sub_block_pairs(spec: Recv, block_size: int) -> Tuple[List[int], List[int], int]:
    """``(remote ids, local ids, first sub-block)`` of a pull between blocks of ``spec.remote_block_size``
    and ``block_size`` tokens, in ``_core.plan_sub_blocks``'s terms: the local list starts at the
    prompt's block ``spec.local_first_block`` (after a local prefix hit) and takes the remote blocks
    that hold its tokens — with larger local blocks, up to ``ratio`` remote ones each (the last
    one's tail may stay: tokens the prompt does not have); with smaller ones, from sub-block
    ``first`` of the remote block that holds its first token. ValueError if the remote list (it
    comes from outside) does not hold them."""
    size, local, remote = spec.remote_block_size or block_size, list(spec.local_block_ids), list(spec.remote_block_ids)
    if not local:
        return [], [], 0
    where = (f"{len(remote)} remote blocks of {size} tokens do not hold the {len(local)} local blocks of {block_size} "
             f"tokens from the prompt's block {spec.local_first_block} on")
    if size < block_size:
        ratio = block_size // size
        start = spec.local_first_block * ratio
        taken = remote[start:start + len(local) * ratio]
        if -(-len(taken) // ratio) != len(local):
            raise ValueError(where)
        return taken, local, 0
    ratio = size // block_size
    start, first = divmod(spec.local_first_block, ratio)
    count = -(-(first + len(local)) // ratio)
    if start + count > len(remote):
        raise ValueError(where)
    return remote[start:start + count], local, first


def token_runs(shape: Sequence[int], block_size: int) -> int:
    """The runs of one block of a cache of ``shape`` (block id on dimension 0), each that block's
    tokens in order. vLLM's ``LBHNC`` attention view ``[blocks, heads, tokens, 2 * head_size]``
    is, in memory, each head's keys of all the block's tokens, then its values (the CPU backend
    reads a block as ``[heads, 2 * tokens, head_size]``; a backend that keeps all keys before all
    values has as many runs): ``2 * heads`` runs. An MLA view ``[blocks, tokens, latent]`` is one.
    ValueError for other shapes (a block split into kernel blocks, another layout)."""
    per_block = list(shape[1:])
    if len(per_block) == 3 and per_block[1] == block_size and per_block[2] % 2 == 0:
        return 2 * per_block[0]
    if len(per_block) == 2 and per_block[0] == block_size:
        return 1
    raise ValueError(f"this engine's KV cache blocks of shape {per_block} are not [heads, {block_size} tokens, K+V] "
                     f"nor [{block_size} tokens, latent] (kernel blocks?), which KV of another block size needs "
                     f"{_SAME}")


def pull(engine: Any, spec: Recv, block_size: int, registered: Sequence[Any], classes: Sequence[Any],
         cluster_id: int) -> Tuple[int, int]:
    """Pull the request's blocks from ``cluster_id`` (the prefill engine) into each registered cache
    (``registered``, one per class of ``classes``, ``caches.CacheClass``), every class's blocks as
    sub-blocks of the larger side's; ``(local blocks, bytes moved)``. The peer's cache k is ours k
    (the link's hello compared them, tokens aside: ``compat``)."""
    remote, local, first = sub_block_pairs(spec, block_size)
    if not local:
        return 0, 0
    if len(registered) < len(classes):
        raise ValueError("this engine's KV caches are not registered")
    size = spec.remote_block_size or block_size
    moved = len(remote) if size < block_size else len(local)  # blocks of the smaller size
    nbytes = 0
    for k, cls in enumerate(classes):
        runs = token_runs(cls.shape, block_size)
        engine.pull_sub_blocks(cluster_id, k, registered[k].cache_id, remote, local, runs, first)
        nbytes += moved * cls.block_bytes * min(size, block_size) // block_size
    return len(local), nbytes

