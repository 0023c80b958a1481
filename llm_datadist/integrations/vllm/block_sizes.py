"""KV between engines of different block sizes (``--block-size``), pull mode: one side's block
holds a whole multiple of the other's tokens. A small block is, region by region, one strided
sub-block of a large one; the regions come from the attention backend's layout inside a block,
asked of vLLM at run time (``Attention``) and moved only where that layout is verified
(``LAYOUTS``). The core plans the copies (``_core.plan_sub_blocks``, bounds-checked on both sides)
and the engine seam pulls them (``Engine.pull_sub_blocks``). Either side may be the smaller. The
decode scheduler refuses what this does not cover (``refusal``); its worker pairs the blocks by
their position in the prompt (``sub_block_pairs``)."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from llm_datadist.integrations.vllm.compat import Incompatible
from llm_datadist.integrations.vllm.meta import Recv

#: Where a refusal line sends the operator.
_SAME = "(the engines must share --block-size)"

#: The layouts inside a block that KV of another block size moves in, by (vLLM attention backend,
#: ISA), each checked against the installed vLLM 0.32's own cache writer
#: (``ops.cpu_attn_reshape_and_cache``) for float32, float16 and bfloat16 at block sizes 32 and 64:
#: the CPU backend's "vec" and "vec16" kernels keep, per KV head of the ``[heads, tokens, 2 *
#: head_size]`` view, its keys as ``[head_size, tokens]`` (transposed) and then its values as
#: ``[tokens, head_size]``. Any other (the CPU backend's "amx" and "neon" kernels, GPU backends) is
#: refused until checked the same way.
LAYOUTS = {("CPU_ATTN", "vec"): "heads[keys^T,values]", ("CPU_ATTN", "vec16"): "heads[keys^T,values]"}


class Attention:
    """Which attention backend and ISA lay out this engine's KV blocks, asked of vLLM's layers
    (``static_forward_context``: each ``Attention`` layer's ``attn_backend`` and, on the CPU
    backend, the ``isa`` its metadata builder set, before vLLM hands the connector its KV caches),
    once per set of layers; and this engine's block size."""

    def __init__(self, vllm_config: Any):
        self._config = vllm_config
        self.block_size = int(getattr(getattr(vllm_config, "cache_config", None), "block_size", 0) or 0)
        self._known: Dict[Tuple[str, ...], str] = {}

    def of(self, layers: Sequence[str]) -> str:
        """``"<backend>:<isa>"`` of ``layers`` (``"<backend>"`` without an ISA; several joined by
        ``","`` if they differ; ``"unknown"`` where vLLM does not say)."""
        key = tuple(layers)
        if key not in self._known:
            context = getattr(getattr(self._config, "compilation_config", None), "static_forward_context", None) or {}
            found = set()
            for name in key:
                layer = context.get(name)
                backend = getattr(layer, "attn_backend", None)
                try:
                    label = str(backend.get_name()) if backend is not None else "unknown"
                except Exception:  # noqa: BLE001 - a backend that cannot say is not verified
                    label = "unknown"
                isa = getattr(layer, "isa", None)
                found.add(f"{label}:{isa}" if isa else label)
            self._known[key] = ",".join(sorted(found)) or "unknown"
        return self._known[key]

    def layout(self, classes: Sequence[Any]) -> str:
        """The verified layout inside a block of the registered caches (``caches.CacheClass``), what
        engines of different block sizes compare (``compat``); ``"unverified <backend:isa>"`` else."""
        labels = sorted({self.of(cls.layers) for cls in classes})
        names = {LAYOUTS.get(tuple(label.split(":", 1)) if ":" in label else (label, "")) for label in labels}
        if len(names) == 1 and None not in names:
            return names.pop()
        return "unverified " + ",".join(labels)

    def pull(self, engine: Any, spec: Recv, registered: Sequence[Any], classes: Sequence[Any],
             cluster_id: int) -> Tuple[int, int]:
        """``pull`` with this engine's block size and each cache's regions (``regions``)."""
        found = [self.of(cls.layers) for cls in classes]
        return pull(engine, spec, self.block_size, registered, classes, cluster_id, found)


def differ(spec: Recv, block_size: int) -> bool:
    """Whether the prefill engine's blocks (its params say) hold another token count than ours (an
    engine that does not know its own block size, 0, moves whole blocks as before)."""
    return block_size > 0 and spec.remote_block_size is not None and spec.remote_block_size != block_size


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


def regions(shape: Sequence[int], block_size: int, tokens: int, element_size: int,
            attention: str) -> List[Tuple[int, int, int]]:
    """The regions (``_core.plan_sub_blocks``: ``(offset, nbytes, runs)``) of a block of ``tokens``
    tokens of a cache of ``shape`` (block id on dimension 0, ``block_size`` tokens a block) whose
    attention is ``attention`` (``Attention.of``), each run that block's tokens in order. For
    ``LAYOUTS``' CPU layout of ``[heads, tokens, 2 * head_size]``: per head, ``head_size`` runs of
    keys (one per dimension), then one run of values. ValueError naming the backend, ISA or shape
    otherwise (a layout not verified, a block split into kernel blocks)."""
    backend, _, isa = attention.partition(":")
    if LAYOUTS.get((backend, isa)) != "heads[keys^T,values]":
        raise ValueError(f"the layout of KV inside a block of vLLM's attention {attention} (backend:ISA) is not "
                         f"verified for KV of another block size ({', '.join(f'{b}:{i}' for b, i in LAYOUTS)} are) "
                         f"{_SAME}")
    per_block = list(shape[1:])
    if len(per_block) != 3 or per_block[1] != block_size or per_block[2] % 2 or per_block[0] <= 0:
        raise ValueError(f"this engine's KV cache blocks of shape {per_block} are not [heads, {block_size} tokens, "
                         f"K+V] (kernel blocks?), which KV of another block size needs {_SAME}")
    heads, head_size = per_block[0], per_block[2] // 2
    half = tokens * head_size * element_size  # one head's keys (or values) of the block
    return [r for h in range(heads) for r in ((2 * h * half, half, head_size), ((2 * h + 1) * half, half, 1))]


def pull(engine: Any, spec: Recv, block_size: int, registered: Sequence[Any], classes: Sequence[Any],
         cluster_id: int, attention: Sequence[str]) -> Tuple[int, int]:
    """Pull the request's blocks from ``cluster_id`` (the prefill engine) into each registered cache
    (``registered``, one per class of ``classes``, ``caches.CacheClass``, whose layers' attention is
    ``attention``, ``Attention.of``), every class's blocks as sub-blocks of the larger side's;
    ``(local blocks, bytes moved)``. The peer's cache k is ours k and lays out its blocks as ours
    (the link's hello compared them, tokens aside: ``compat``). ``compat.Incompatible`` naming both
    block sizes, nothing pulled, where a layout is not verified; ValueError if the remote list does
    not hold the local blocks."""
    remote, local, first = sub_block_pairs(spec, block_size)
    if not local:
        return 0, 0
    if len(registered) < len(classes):
        raise ValueError("this engine's KV caches are not registered")
    size = spec.remote_block_size or block_size
    small = min(size, block_size)
    try:
        plans = [regions(cls.shape, block_size, small, cls.tensors[0].element_size(), found)
                 for cls, found in zip(classes, attention)]
    except ValueError as exc:
        raise Incompatible(f"its block size is {size} tokens, this engine's {block_size}: {exc}") from None
    moved = len(remote) if size < block_size else len(local)  # blocks of the smaller size
    nbytes = 0
    for k, (cls, planned) in enumerate(zip(classes, plans)):
        engine.pull_sub_blocks(cluster_id, k, registered[k].cache_id, remote, local, planned, first)
        nbytes += moved * cls.block_bytes * small // block_size
    return len(local), nbytes
