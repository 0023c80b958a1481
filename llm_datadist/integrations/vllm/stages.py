"""Pipeline parallelism: which worker of a prefill engine a decode worker pulls from.

An engine with ``pipeline_parallel_size`` P and ``tensor_parallel_size`` T has P * T workers; the
worker of pipeline stage ``s`` and tensor parallel rank ``r`` holds the KV of stage ``s``'s layers
only, and is the engine's worker number ``s * T + r`` (its *flat rank*, as vLLM numbers the ranks
of one data parallel group). ``kv_transfer_params`` list every prefill worker in ``remote_ranks``
by flat rank, and say P as ``pp_size`` (NIXL's name). A decode worker of stage ``s`` pulls from
the prefill workers of stage ``s`` only (``stage_ranks``), which then hold the same layers: the
two engines must have the same pipeline parallel size (``refusal``), and their tensor parallel
ranks within a stage map as between engines without pipeline parallelism (``meta.Recv.peers``).
Each link's compatibility exchange (``compat``) compares both sides' ``pp_size`` and ``pp_rank``
and the layers of their caches, so a prefill worker that is not the stage it is taken for is
refused."""

from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple, TypeVar

#: The largest pipeline parallel size ``kv_transfer_params`` may name (they come from outside).
MAX_PP_SIZE = 64

T = TypeVar("T")


def pipeline_ranks(vllm_config: Any) -> Tuple[int, int]:
    """``(pipeline stage, pipeline parallel size)`` of this worker."""
    parallel = getattr(vllm_config, "parallel_config", None)
    pp_size = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if pp_size == 1:
        return 0, 1
    from vllm.distributed.parallel_state import get_pp_group
    return int(get_pp_group().rank_in_group), pp_size


def flat_rank(pp_rank: int, tp_rank: int, tp_size: int) -> int:
    """The worker's number among its engine's ``pp_size * tp_size`` workers."""
    return pp_rank * tp_size + tp_rank


def stage_ranks(ranks: Sequence[T], pp_size: int, pp_rank: int) -> Tuple[T, ...]:
    """The entries of stage ``pp_rank`` among ``ranks`` (every worker by flat rank)."""
    tp_size = len(ranks) // pp_size
    return tuple(ranks[pp_rank * tp_size:(pp_rank + 1) * tp_size])


def compat_fields(pp_rank: int, pp_size: int) -> Dict[str, int]:
    """What a worker adds to its compatibility description (``compat``): its pipeline stage and
    the engine's pipeline parallel size, so that a peer of another stage (other layers) or of
    another size is refused on the link (a peer of an older release says neither: its layers are
    still compared, ``layers`` and ``caches``)."""
    return {"pp_size": pp_size, "pp_rank": pp_rank}


def refusal(remote_pp_size: int, pp_size: int) -> str:
    """Why KV cannot move from a prefill engine of pipeline parallel size ``remote_pp_size`` to
    this one of ``pp_size``; "" if it can (the same size: stage s pulls stage s's layers)."""
    if remote_pp_size == pp_size:
        return ""
    return (f"its prefill engine runs with pipeline_parallel_size {remote_pp_size} and this one with {pp_size}: KV "
            "moves between engines of the same pipeline parallel size only (stage s pulls the layers of prefill "
            "stage s)")


def by_flat_rank(metadata: Dict[Tuple[int, int], Any], tp_size: int) -> Dict[int, Any]:
    """vLLM's handshakes keyed ``(pp_rank, tp_rank)`` (``set_xfer_handshake_metadata_pp_aware``)
    keyed by flat rank; keys that are not such pairs are left out."""
    out = {}
    for key, value in metadata.items():
        if isinstance(key, tuple) and len(key) == 2 and all(type(k) is int and k >= 0 for k in key) and \
                key[1] < tp_size:
            out[flat_rank(key[0], key[1], tp_size)] = value
    return out
