"""The scheduler half of push mode: what each step hands the worker (``PushReg``, ``PushStep``)
and the blocks a finished prefill request holds for its decode side."""

from __future__ import annotations

import logging
from typing import Dict, List, Set, Tuple

from llm_datadist.integrations.vllm.push.specs import PushReg, PushStep, push_spec

logger = logging.getLogger("llm_datadist.integrations.vllm")  # (the connector's one logger)


class PushScheduling:
    """The scheduler half of push mode. Decode side: a request with ``do_remote_prefill`` loads
    asynchronously, its allocated blocks go to the worker to register (``PushReg``); prefill
    side: the blocks and computed prompt tokens of each request with ``do_remote_decode`` go to
    the worker every step it is scheduled (``PushStep``); it holds a finished request's blocks
    (as in pull mode) until its worker frees them, and keeps the engine stepping meanwhile
    (``has_pending_push_work``)."""

    def __init__(self, block_size: int, producer: bool) -> None:
        self.block_size = block_size
        self.producer = producer
        self._regs: Dict[str, PushReg] = {}
        self._cancel: Set[str] = set()
        self._waiting: Set[str] = set()  # decode side: registered, not yet reported
        self._prompts: Dict[str, int] = {}  # prefill side: push-mode requests -> prompt tokens
        self._blocks: Dict[str, List[int]] = {}
        self._forget: Set[str] = set()
        self._held: Set[str] = set()  # prefill side: finished, blocks held until finished_sending

    # decode side
    def matched_tokens(self, request, num_computed_tokens: int, prompt: int) -> Tuple[int, bool]:
        params = request.kv_transfer_params
        if push_spec(params) is None:
            logger.warning("request %s: its kv_transfer_params do not name a usable prefill worker for push mode "
                           "(remote_host, remote_port; tp_size 1); computing the prompt locally", request.request_id)
            params["do_remote_prefill"] = False
            return 0, False
        count = prompt - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def allocated(self, request, local_blocks: List[int], num_external_tokens: int, prompt: int) -> None:
        params = request.kv_transfer_params
        params["do_remote_prefill"] = False  # one registration per request
        spec = push_spec(params)
        if spec is None:
            return
        awaiting = num_external_tokens > 0 and bool(local_blocks)
        spec.local_block_ids = list(local_blocks) if awaiting else []
        spec.first_block = (prompt - num_external_tokens) // self.block_size if awaiting else 0
        spec.awaiting = awaiting
        self._regs[request.request_id] = spec
        if awaiting:
            self._waiting.add(request.request_id)

    def decode_finished(self, request) -> None:
        params = request.kv_transfer_params
        if params.get("do_remote_prefill"):
            params["do_remote_prefill"] = False  # ended before its blocks were allocated: P frees its own
            spec = push_spec(params)
            if spec is not None:
                self._regs[request.request_id] = spec
        elif request.request_id in self._waiting:
            self._waiting.discard(request.request_id)
            self._cancel.add(request.request_id)

    # prefill side
    def prefill_allocated(self, request, prompt: int) -> None:
        self._prompts[request.request_id] = prompt

    def prefill_finished(self, request, held: bool) -> None:
        req_id = request.request_id
        if self._prompts.pop(req_id, None) is not None:
            self._blocks.pop(req_id, None)
            if held:
                self._held.add(req_id)
            else:
                self._forget.add(req_id)

    def fill(self, meta, scheduler_output) -> None:
        meta.push_regs, self._regs = self._regs, {}
        meta.push_cancel, self._cancel = self._cancel, set()
        meta.push_forget, self._forget = self._forget, set()
        if not self._prompts or scheduler_output is None:
            return
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
        starts: Dict[str, int] = {}
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            if new.req_id in self._prompts:
                self._blocks[new.req_id] = list(new.block_ids[0]) if new.block_ids else []
                starts[new.req_id] = new.num_computed_tokens
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = getattr(cached, "resumed_req_ids", set()) or set()
            for i, req_id in enumerate(cached.req_ids):
                if req_id not in self._prompts:
                    continue
                new_ids = cached.new_block_ids[i]
                if req_id in resumed:
                    self._blocks[req_id] = list(new_ids[0]) if new_ids else []
                elif new_ids:
                    self._blocks.setdefault(req_id, []).extend(new_ids[0])
                starts[req_id] = cached.num_computed_tokens[i]
        for req_id, start in starts.items():
            prompt = self._prompts[req_id]
            end = min(start + int(scheduled.get(req_id, 0)), prompt)
            meta.push_steps[req_id] = PushStep(list(self._blocks.get(req_id, ())), min(start, prompt), end, prompt)

    def output(self, connector_output) -> None:
        for req_id in getattr(connector_output, "finished_sending", None) or ():
            self._held.discard(req_id)
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            self._waiting.discard(req_id)

    def pending(self) -> bool:
        return bool(self._held or self._regs)
