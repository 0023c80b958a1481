"""Multi-turn KV (``bidirectional_kv_xfer``, NixlConnector's option and fields): a decode engine
holds a finished request's blocks for the conversation's next turn, and that turn's prefill engine
pulls the prefix they hold instead of computing it (docs/vllm.md, "Multi-turn").

The decode engine hands the blocks out as a prefill engine does: under a lease token of its own
workers' keys (only the holder of ``remote_request_id`` may read or release them), for
``decoder_kv_blocks_ttl`` seconds. Its ``request_finished`` returns them as NIXL's decode side
does, ``do_remote_decode`` set, and the router sends those params with the next turn's prefill
request. Beyond NIXL's fields it adds ``remote_block_hashes``: a chained hash of the tokens of each
block it holds, so that the prefill engine takes only the blocks whose tokens its prompt repeats
(a chat template that renders the last answer otherwise, an edited history) and never KV of other
tokens. This module holds the pure parts: what the params say and what a prompt may take of them."""

from __future__ import annotations

import hashlib
import time
from array import array
from typing import Any, List, Optional, Sequence, Tuple

#: The fields that make a prefill request a next turn's, besides ``do_remote_decode`` and
#: ``remote_block_ids`` (NixlConnector's ``pull_scheduler.py`` checks the same).
TURN_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")

#: How close to ``remote_blocks_expiry_time`` a prefix is no longer pulled (NIXL's margin): the
#: question, the wait in the queue and the pull must fit before the decode engine frees it.
EXPIRY_MARGIN_S = 5.0

#: Bytes of one block's hash (hex in the params: twice as many characters).
HASH_BYTES = 8

#: Most blocks one held prefix may name (a longer list is refused: the prompt is computed).
MAX_HELD_BLOCKS = 1 << 17

#: Marks in a prefill request's params (ours, never read from outside: ``strip_marks``): the
#: prefix's state (None: not seen; True: the decode engine was asked and holds it; False:
#: computed here), the tokens it covers, and whether its pull was scheduled.
STATE = "_llm_datadist_next_turn"
TOKENS = "_llm_datadist_next_turn_tokens"
SCHEDULED = "_llm_datadist_next_turn_scheduled"


def is_next_turn(params: Any) -> bool:
    """Whether a prefill request's params name a prefix a decode engine holds (NIXL's test)."""
    return isinstance(params, dict) and bool(params.get("do_remote_decode")) and \
        bool(params.get("remote_block_ids")) and all(params.get(name) is not None for name in TURN_FIELDS)


def strip_marks(params: dict) -> None:
    """Drop marks a router copied in from elsewhere: only this engine sets them."""
    for name in (STATE, TOKENS, SCHEDULED):
        params.pop(name, None)


def block_hashes(tokens: Sequence[int], block_size: int) -> List[str]:
    """A chained hash of each block of ``tokens`` (the last one may be partial): block k's covers
    every token up to the end of block k, so that equal hashes mean equal prefixes."""
    out: List[str] = []
    previous = b""
    for start in range(0, len(tokens), block_size):
        chunk = array("q", tokens[start:start + block_size]).tobytes()
        previous = hashlib.blake2b(previous + chunk, digest_size=HASH_BYTES).digest()
        out.append(previous.hex())
    return out


def not_by_tokens(request: Any) -> str:
    """Why a request's KV is not given by its token ids alone (a LoRA adapter's, an image's whose
    placeholder tokens another image shares, a prompt given as embeddings whose ids are zeros), so
    that equal block hashes could name other KV; "" if it is. Such KV is neither held nor pulled."""
    if getattr(request, "lora_request", None) is not None:
        return "it runs with a LoRA adapter"
    if getattr(request, "mm_features", None):
        return "its prompt has multimodal inputs"
    if getattr(request, "prompt_token_ids", ()) is None:
        return "its prompt is given as embeddings"
    return ""


def held_prefix(params: dict, prompt: Optional[Sequence[int]], block_size: int,
                now: Optional[float] = None) -> Tuple[int, str]:
    """``(tokens, "")``: how many of ``prompt``'s first tokens the decode engine's held blocks
    hold the KV of, or ``(0, why)`` where none can be taken. The params come from outside: every
    field is checked, and a claim that does not add up takes nothing."""
    if prompt is None:
        return 0, "its prompt is given as embeddings"
    held = params.get("remote_num_tokens")
    if isinstance(held, bool) or not isinstance(held, int) or held <= 0:
        return 0, "remote_num_tokens is not a token count > 0"
    blocks = params.get("remote_block_ids")
    if isinstance(blocks, (list, tuple)) and len(blocks) == 1 and isinstance(blocks[0], (list, tuple)):
        blocks = blocks[0]  # (NIXL's per-group form, one group)
    if not isinstance(blocks, (list, tuple)) or not 0 < len(blocks) <= MAX_HELD_BLOCKS or \
            not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks):
        return 0, "remote_block_ids is not one list of block ids"
    if len(blocks) != -(-held // block_size):  # (integers: a float overflows on a huge count)
        return 0, f"{len(blocks)} blocks cannot hold {held} tokens of {block_size}"
    size = params.get("remote_block_size", block_size)
    if size != block_size:
        return 0, f"the decode engine's blocks are of {size!r} tokens, this engine's {block_size}"
    tp_size = params.get("tp_size", 1)
    if tp_size != 1:
        return 0, f"the decode engine has tensor parallel size {tp_size!r} (multi-turn KV moves between engines " \
                  "without tensor parallelism)"
    expiry = params.get("remote_blocks_expiry_time")
    if isinstance(expiry, (int, float)) and not isinstance(expiry, bool) and \
            (time.time() if now is None else now) + EXPIRY_MARGIN_S >= expiry:
        return 0, "the decode engine frees them within seconds (remote_blocks_expiry_time)"
    hashes = params.get("remote_block_hashes")
    if not isinstance(hashes, list) or len(hashes) != len(blocks) or not all(isinstance(h, str) for h in hashes):
        return 0, "remote_block_hashes is missing or does not name each block (not a decode engine of this connector?)"
    # the leading blocks whose tokens this prompt repeats; a partial last block only where the prompt
    # goes at least as far as the decode engine's tokens
    mine = block_hashes(list(prompt[:held]), block_size)
    matched = 0
    for theirs, ours in zip(hashes, mine):
        if theirs != ours:
            break
        matched += 1
    if not matched:
        return 0, "the prompt does not begin with the tokens of the held blocks"
    return min(matched * block_size, held, len(prompt)), ""


def clip(blocks: List[int], tokens: int, block_size: int) -> List[int]:
    """The held blocks that cover the first ``tokens`` tokens."""
    return list(blocks[:-(-tokens // block_size)])
