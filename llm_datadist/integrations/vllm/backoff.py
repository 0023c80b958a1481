"""The prompt backoff: trailing prompt tokens a prefill engine leaves uncomputed, so that its decode
engine computes them itself (NixlConnector's ``_prefill_backoff``).

A multi-module MTP drafter reads ``num_speculative_tokens`` tokens past the computed range
(vLLM's ``VllmConfig.num_prefill_lookahead_tokens``): a prefill engine that computed the whole
prompt would leave the drafts it made for the tokens after it in the MTP layers' KV, and the decode
engine would never rewrite them (its first step rejects nothing). So the prefill engine stops
``lookahead - 1`` tokens short of the prompt, and the decode engine loads only that many tokens
and computes the rest. EAGLE-style drafters read one token ahead (no backoff); ngram and other
methods without a drafter read none. Both engines must agree, which the links' compatibility
check makes sure of (``compat``: the speculative config of a method whose drafter keeps KV).

A state-space (Mamba) group needs one token of backoff too (the decode engine recomputes the last
token from the state before it); ``prefill_backoff`` takes that as ``state_groups``."""

from __future__ import annotations

from typing import Any


def prefill_backoff(vllm_config: Any, state_groups: bool = False) -> int:
    """Trailing prompt tokens this engine's prefill leaves to its decode engine (0: none)."""
    try:
        lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0)
    except (TypeError, ValueError):  # a config that cannot say (a test's stand-in)
        lookahead = 0
    return max(1 if state_groups else 0, lookahead - 1)


def loaded_tokens(prompt_tokens: int, backoff: int) -> int:
    """Of a prompt of ``prompt_tokens``, how many a decode engine loads: all but the backoff (a
    prompt no longer than the backoff is loaded whole, as its prefill engine computed it whole)."""
    return prompt_tokens - backoff if backoff and prompt_tokens > backoff else prompt_tokens


def truncate_for_prefill(request: Any, backoff: int) -> bool:
    """Prefill side: drop the request's last ``backoff`` prompt tokens (it is computed one token at
    most: ``max_tokens`` 1), as ``loaded_tokens`` expects; whether it was cut. Not for a prompt no
    longer than the backoff, or one that skips reading the prefix cache (prompt logprobs: its
    decode engine computes the whole prompt)."""
    length = getattr(request, "num_prompt_tokens", None)
    if not backoff or not isinstance(length, int) or length <= backoff:
        return False
    skips = getattr(request, "get_skip_reading_prefix_cache", None)
    if callable(skips) and skips():
        return False
    if request.prompt_token_ids is not None:
        del request.prompt_token_ids[-backoff:]
    elif getattr(request, "prompt_embeds", None) is not None:
        request.prompt_embeds = request.prompt_embeds[:-backoff]
    else:
        return False
    del request._all_token_ids[-backoff:]
    request.num_prompt_tokens -= backoff
    request.max_tokens = 1
    return True
