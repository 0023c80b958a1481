"""Whether two engines' KV caches mean the same thing: each worker describes its own (``fields``),
a decode worker sends that description to a prefill worker once per link (``hello``), and both
compare (``differences``). A mismatch refuses the link's KV with one line naming what differs.

What is compared: the KV format version of this connector (``KV_FORMAT``, not the package
version: releases that move KV the same way stay compatible), the model (vLLM's model name or
path and its revision, or ``model_id`` from ``kv_connector_extra_config``), the model dtype, the
model's KV heads, head size and layers, the cache dtype, the block size, the registered layout
(tensors, per-block shape, element type; one per cache), the caches registered (``caches``: one
per KV cache group and shape of its layers, with their tensors, block shape, dtype and layer
names, compared cache by cache by ``caches.mismatch``), the KV cache groups that move
(``kv_groups``: kind, window, layers; None for one full-attention group), a state-space hybrid's
states (``kv_states``: page size, offsets, shapes, dtypes; ``state.py``) and the speculative
decoding config of a method whose drafter keeps KV (EAGLE, MTP, a draft model; ngram decoding on
one side only changes nothing that moves). Between engines of different block sizes, the block size
is not compared, the layouts are compared without their token dimension, and the layout inside a
block (``block_layout``: the attention backend's, ``block_sizes.Attention.layout``) must be the same.
A rank's layout and caches are compared only between engines of one tensor parallel size; engines of
different sizes compare the layout of all heads together instead (``PER_RANK``,
``layout_all_heads``). The KV cache layouts the engines registered (``kv_layout``, ``kv_layouts``) may
differ where both are moved, both pull (``kv_layout_pulls``) and the engines share TP and block
sizes: the decode worker then permutes each head; elsewhere a difference refuses. The weights are
known by the model's name: two checkpoints of one geometry differ only there (a fine-tune has its
base's config), and hashing gigabytes of weights at start is not an option. Engines that load one
checkpoint from different paths say so with the same ``model_id``."""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

from llm_datadist.integrations.vllm import kv_layouts

#: What the KV blocks of this connector hold and how they are addressed; bumped when that changes.
KV_FORMAT = 1

#: Limits on a peer's description (it comes from the network).
MAX_FIELDS = 32
MAX_NAME_CHARS = 64
MAX_VALUE_CHARS = 4096  # (``caches`` of a model with many shapes: ~50 each)
#: How much of a value a log line shows.
SHOWN_CHARS = 120

logger = logging.getLogger(__package__)


class Incompatible(ValueError):
    """The peer's KV cannot be used here; the message names the fields that differ."""


def _get(obj: Any, *path: str) -> Any:
    for name in path:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def _call(obj: Any, method: str, *args: Any) -> Any:
    fn = getattr(obj, method, None)
    try:
        return fn(*args) if fn is not None else None
    except Exception:  # noqa: BLE001 - a model config that cannot say: the field is unknown
        return None


def fields(vllm_config: Any, model_id: Optional[str] = None) -> Dict[str, Any]:
    """This engine's description, less the layout (known once the KV caches are registered)."""
    model = _get(vllm_config, "model_config")
    parallel = _get(vllm_config, "parallel_config")
    cache = _get(vllm_config, "cache_config")
    spec = _get(vllm_config, "speculative_config")
    name = model_id
    if name is None and model is not None:
        name = str(_get(model, "model"))
        revision = _get(model, "revision")
        if revision:
            name += f"@{revision}"
    speculative = None
    # (only a method whose drafter keeps KV of its own (EAGLE, MTP, a draft model) changes what
    # moves; ngram or suffix decoding on one side only does not)
    if spec is not None and _call(spec, "uses_draft_kv_cache") is not False:
        speculative = (f"{_get(spec, 'method')}:{_get(spec, 'model')}:"
                       f"{_get(spec, 'num_speculative_tokens')}")
    dtype = _get(model, "dtype")
    layers = _call(model, "get_num_layers", parallel) if parallel is not None else None
    return {
        "kv_format": KV_FORMAT,
        "model": name,
        "dtype": None if dtype is None else str(dtype).replace("torch.", ""),
        "kv_heads": _call(model, "get_total_num_kv_heads"),
        "head_size": _call(model, "get_head_size"),
        "layers": layers,
        "cache_dtype": None if _get(cache, "cache_dtype") is None else str(_get(cache, "cache_dtype")),
        "block_size": _get(cache, "block_size"),
        "speculative": speculative,
    }


def layout(desc: Any, tp_size: int = 1) -> str:
    """The registered blocks cache as a string: tensors, per-block shape, element type. With
    ``tp_size`` (a rank's KV heads outermost in a block; the count of ranks holding distinct heads,
    fewer than the TP size where heads are replicated), the block of all the model's heads together,
    which engines of different TP sizes compare; 0: "" (no such layout)."""
    if not tp_size:
        return ""
    shape = list(desc.shape)[1:]
    if tp_size != 1 and shape:
        shape[0] *= tp_size
    return f"{desc.num_tensors}x{shape}:{desc.data_type.name}"


#: Fields that describe one rank, compared only between engines of the same TP size (``tp_size``);
#: between others, ``layout_all_heads`` says whether their blocks hold the same heads.
PER_RANK = ("tp_size", "layout", "caches")


def check(description: Any) -> Dict[str, Any]:
    """A peer's description, checked; ``Incompatible`` if it is not one."""
    if not isinstance(description, dict) or len(description) > MAX_FIELDS:
        raise Incompatible("its compatibility description is malformed")
    for name, value in description.items():
        if not isinstance(name, str) or len(name) > MAX_NAME_CHARS:
            raise Incompatible("its compatibility description is malformed")
        if value is not None and not isinstance(value, (str, int, float, bool)):
            raise Incompatible(f"its compatibility field {name[:MAX_NAME_CHARS]!r} is malformed")
        if isinstance(value, str) and len(value) > MAX_VALUE_CHARS:
            raise Incompatible(f"its compatibility field {name!r} is longer than {MAX_VALUE_CHARS} characters")
    if "kv_format" not in description:
        raise Incompatible("its compatibility description has no kv_format")
    return description


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def differences(mine: Dict[str, Any], theirs: Dict[str, Any]) -> List[str]:
    """``"<field> <theirs> there, <mine> here"`` for each field both describe and that differs; a
    field only one side knows (a newer release's) is not compared — ``kv_format`` is what a change
    of meaning bumps."""
    other_tp = "tp_size" in mine and "tp_size" in theirs and mine["tp_size"] != theirs["tp_size"]
    skip = PER_RANK if other_tp else ()
    sizes = block_sizes(mine, theirs)
    skip = skip + _layouts_moved(mine, theirs, other_tp or sizes is not None)
    if sizes is None:
        # (how a block is laid out inside, ``block_sizes.Attention.layout``, matters where blocks of
        # other token counts are cut into sub-blocks)
        skip = skip + ("block_layout",)
    else:
        # blocks of other token counts hold the same KV (``_core.plan_sub_blocks``): the layouts are
        # compared with each side's token dimension left out
        skip = skip + ("block_size",) + tuple(
            name for name in ("layout", "layout_all_heads")
            if _without_tokens(mine.get(name), sizes[0]) == _without_tokens(theirs.get(name), sizes[1]))
    out = [f"{name} {_shown(theirs[name])} there, {_shown(value)} here"
           for name, value in mine.items()
           if name in theirs and theirs[name] != value and name not in skip and name != "caches"]
    if sizes is not None and "block_layout" in mine and "block_layout" not in theirs:
        out.append("block_layout: it does not say how its KV blocks are laid out inside (an older release), which "
                   "KV of another block size needs")
    if "caches" in mine and "caches" not in skip:
        # the caches each side registered (``caches.describe``), compared cache by cache; a peer
        # that does not say them (an older release) registers one cache of one shape at most
        from llm_datadist.integrations.vllm import caches
        if "caches" in theirs:
            why = caches.mismatch(mine["caches"], theirs["caches"], sizes)
            if why:
                out.append(f"caches: {why}")
        elif len(str(mine["caches"]).split(";")) > 1:
            out.append("caches: it does not describe its KV caches (an older release), this engine registers "
                       f"{len(str(mine['caches']).split(';'))} of different shapes or groups")
    return out


def _layouts_moved(mine: Dict[str, Any], theirs: Dict[str, Any], other_sizes: bool) -> Tuple[str, ...]:
    """The fields not compared because the engines' KV cache layouts differ where KV still moves
    (``kv_layouts``): both say theirs (then ``kv_format`` says the same twice), both are layouts
    that move, both pull, and the engines share TP and block sizes (``other_sizes`` False)."""
    if "kv_layout" not in mine or "kv_layout" not in theirs:
        return ("kv_layout_pulls",)
    formats = (KV_FORMAT, kv_layouts.KV_FORMAT_TOKEN_MAJOR)
    skip = ("kv_layout_pulls",) + (("kv_format",) if mine.get("kv_format") in formats and
                                   theirs.get("kv_format") in formats else ())
    if mine["kv_layout"] == theirs["kv_layout"] or (
            mine["kv_layout"] in kv_layouts.MOVED and theirs["kv_layout"] in kv_layouts.MOVED and not other_sizes
            and mine.get("kv_layout_pulls") is True and theirs.get("kv_layout_pulls") is True):
        skip += ("kv_layout",)
    return skip


def block_sizes(mine: Dict[str, Any], theirs: Dict[str, Any]) -> Optional[Tuple[int, int]]:
    """``(ours, theirs)`` where both engines say their block sizes, which differ and of which one is a
    whole multiple of the other (their KV can move: ``_core.plan_sub_blocks``); else None."""
    ours, other = mine.get("block_size"), theirs.get("block_size")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (ours, other)) or ours == other:
        return None
    small, large = sorted((ours, other))
    return None if large % small else (ours, other)


_LAYOUT = re.compile(r"(\d{1,6})x\[([0-9, ]{0,200})\]:(\w{1,32})$")


def _without_tokens(value: Any, block_size: int) -> Any:
    """A ``layout`` with its per-block token dimension (the second last: ``LBHNC``) as ``N`` where it
    is ``block_size``; anything else as it is (then unlike a layout of another block size)."""
    match = _LAYOUT.match(value) if isinstance(value, str) else None
    if match is None:
        return value
    dims = [d.strip() for d in match.group(2).split(",") if d.strip()]
    if len(dims) < 2 or dims[-2] != str(block_size):
        return value
    dims[-2] = "N"
    return f"{match.group(1)}x[{', '.join(dims)}]:{match.group(3)}"


def verdict(mine: Dict[str, Any], theirs: Any) -> Optional[str]:
    """None if the peer's description matches ours, else the line that says why not."""
    try:
        diff = differences(mine, check(theirs))
    except Incompatible as exc:
        return str(exc)
    return "it serves another model or KV layout: " + "; ".join(diff) if diff else None


def ask(notify: Callable[[int, Dict[str, Any]], Any], cluster_id: int, mine: Dict[str, Any], where: str,
        link_broken: Any, count: Callable[[str], None]) -> Tuple[Optional[str], Optional[int], Optional[str]]:
    """The decode side of a link's compatibility exchange (once per link): tell the prefill worker
    (``notify(cluster_id, message)``) what this engine's KV is and compare with its answer; why its
    KV is refused (or None), the block size it says it has (None if it says none that fits) and its
    KV cache layout (``kv_layout``; None if it says none: an older release registers LBHNC only). A
    peer that does not describe itself (an older release) is not refused: that is said once per
    link. Re-raises an ``LLMException`` whose status is in ``link_broken``."""
    from llm_datadist import LLMException

    try:
        reply = notify(cluster_id, {"op": "hello", "kv_compat": mine})
    except LLMException as exc:
        if exc.status_code in link_broken:
            raise
        reply = None  # it answers no notifications, or its handler failed: not checked (below)
    if not isinstance(reply, dict) or "kv_compat" not in reply:
        logger.warning("llm_datadist: the prefill engine at %s (cluster %d) does not describe its KV (an older "
                       "release?); its compatibility with this engine is not checked", where, cluster_id)
        return None, None, None
    why = verdict(mine, reply["kv_compat"])
    if why is not None:  # (each request refused says why in its line)
        count("incompatible_peers")
    said = reply["kv_compat"] if isinstance(reply["kv_compat"], dict) else {}
    theirs, layout = said.get("block_size"), said.get("kv_layout")
    return (why, theirs if type(theirs) is int and theirs > 0 else None,
            layout[:MAX_NAME_CHARS] if isinstance(layout, str) else None)


def answer(peer_cluster_id: int, message: Dict[str, Any], mine: Dict[str, Any],
           count: Callable[[str], None]) -> Dict[str, Any]:
    """The prefill side of the exchange: a decode worker's ``hello`` answered with this engine's
    description and whether the two match (a mismatch is logged and counted here)."""
    why = verdict(mine, message.get("kv_compat"))
    if why is not None:
        count("incompatible_peers")
        logger.error("llm_datadist: cluster %d (a decode engine) cannot use this engine's KV: %s", peer_cluster_id, why)
    return {"kv_compat": mine, "compatible": why is None}
