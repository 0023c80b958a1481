"""The prompt backoff of speculative decoding: trailing prompt tokens a prefill engine leaves
uncomputed, so that its decode engine computes them itself (NixlConnector's ``_prefill_backoff``).

A multi-module MTP drafter reads ``num_speculative_tokens`` tokens past the computed range
(vLLM's ``VllmConfig.num_prefill_lookahead_tokens``): a prefill engine that computed the whole
prompt would leave the drafts it made for the tokens after it in the MTP layers' KV, and the decode
engine would never rewrite them (its first step rejects nothing). So the prefill engine stops
``lookahead - 1`` tokens short of the prompt, and the decode engine loads only that many tokens
and computes the rest. EAGLE-style drafters read one token ahead (no backoff); ngram and other
methods without a drafter read none. Both engines must agree, which the links' compatibility
check makes sure of (``compat``: the speculative config of a method whose drafter keeps KV).

The scheduler takes the larger of this and a state-space group's one token
(``groups.state_backoff``) and cuts the request (``scheduler.truncate_for_prefill``)."""

from __future__ import annotations

from typing import Any


def drafter_backoff(vllm_config: Any) -> int:
    """Trailing prompt tokens this engine's prefill leaves to its decode engine for its drafter (0: none)."""
    try:
        lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0)
    except (TypeError, ValueError):  # a config that cannot say (a test's stand-in)
        lookahead = 0
    return max(0, lookahead - 1)
