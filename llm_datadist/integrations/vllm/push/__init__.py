"""Push mode (``transfer_mode: push``): the prefill engine writes each layer's KV into blocks the
decode engine allocated and granted it, while its prefill still computes the next layers. How to
run it, what it trusts and what it refuses: ``docs/vllm.md``; by role here: ``grants`` (decode
worker), ``pusher`` (prefill worker), ``scheduling`` (both schedulers), ``specs`` (what the
schedulers hand their workers)."""

from llm_datadist.integrations.vllm.push.grants import QUIESCE_S, Grant, GrantBook, Receiver
from llm_datadist.integrations.vllm.push.pusher import (CANCEL_WAIT_S, MAX_NOTES, MAX_NOTES_PER_PEER,
                                                        MAX_PENDING_REGS, MAX_PENDING_REGS_PER_PEER, MAX_REG_BLOCKS,
                                                        Job, Pusher, Registration, base_request_id)
from llm_datadist.integrations.vllm.push.scheduling import PushScheduling
from llm_datadist.integrations.vllm.push.specs import TRANSFER_MODES, PushReg, PushStep, push_spec
from llm_datadist.integrations.vllm.push.trace import TRACE_ENV, Trace

__all__ = ["CANCEL_WAIT_S", "MAX_NOTES", "MAX_NOTES_PER_PEER", "MAX_PENDING_REGS", "MAX_PENDING_REGS_PER_PEER",
           "MAX_REG_BLOCKS", "QUIESCE_S", "TRACE_ENV", "TRANSFER_MODES", "Grant", "GrantBook", "Job", "PushReg",
           "PushScheduling", "PushStep", "Pusher", "Receiver", "Registration", "Trace", "base_request_id",
           "push_spec"]
