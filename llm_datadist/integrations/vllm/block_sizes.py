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
    """The runs of one block of a cache of ``shape`` (block id on dimension 0): the dimensions
    before its tokens, which are the second last (``LBHNC``: the KV heads; 1 for MLA's ``[blocks,
    tokens, latent]``). ValueError where the second last is not ``block_size`` tokens (a block
    split into kernel blocks, another layout)."""
    if len(shape) < 3 or shape[-2] != block_size:
        raise ValueError(f"this engine's KV cache blocks of shape {list(shape[1:])} do not hold their {block_size} "
                         f"tokens second last (kernel blocks?), which KV of another block size needs {_SAME}")
    runs = 1
    for dim in shape[1:-2]:
        runs *= dim
    return runs


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

