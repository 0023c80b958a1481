"""The connector's scheduler half: which requests load KV from a prefill engine, which hand
theirs out, and whether the engine has begun to stop."""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

from llm_datadist.integrations.vllm import bidirectional, block_sizes, stages, state
from llm_datadist.integrations.vllm import groups as kv_groups
from llm_datadist.integrations.vllm.leases import MAX_REQUEST_ID_BYTES, lease_request_id, utf8_len
from llm_datadist.integrations.vllm.meta import (LLMDataDistConnectorMetadata, LLMDataDistHandshakeMetadata,
                                                 LLMDataDistWorkerMetadata, Recv, recv_spec, split_refusal)
from llm_datadist.integrations.vllm.options import Options
from llm_datadist.integrations.vllm.push.scheduling import PushScheduling

logger = logging.getLogger(__package__)

#: Signals on which vLLM's engine core process begins to shut down.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Notices that the engine process was told to stop, before vLLM's drain begins.

    vLLM's engine core process installs SIGTERM/SIGINT handlers before it builds the scheduler
    (and so this connector); on a signal they start a drain (or an abort) that steps the engine
    until no finished request holds blocks, and connectors hear of it only after that. So this
    wraps those handlers: it records the signal, then calls vLLM's. Only Python callables are
    wrapped, and not ``signal.default_int_handler`` (``KeyboardInterrupt``): a process whose
    handlers vLLM did not install (an in-process engine) keeps its own. Setting a bool is all the
    wrapper does before calling on, so it is safe wherever the signal lands."""

    def __init__(self, watch: bool) -> None:
        self.stopping = False
        self._previous: Dict[int, Any] = {}
        if not watch or threading.current_thread() is not threading.main_thread():
            return  # (signal handlers can only be set from the main thread)
        for signum in _STOP_SIGNALS:
            previous = signal.getsignal(signum)
            if callable(previous) and previous is not signal.default_int_handler:
                try:
                    signal.signal(signum, self._handle)
                except (ValueError, OSError) as exc:  # not the main interpreter...: serve without it
                    logger.debug("llm_datadist: cannot watch signal %d: %s", signum, exc)
                    continue
                self._previous[signum] = previous

    def _handle(self, signum: int, frame: Any) -> None:
        self.stopping = True
        previous = self._previous.get(signum)
        if previous is not None:
            previous(signum, frame)

    def close(self) -> None:
        """Put vLLM's handlers back where ours are still installed."""
        if threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous.items():
                if signal.getsignal(signum) == self._handle:
                    signal.signal(signum, previous)
        self._previous = {}


def truncate_for_prefill(request, backoff: int) -> None:
    """Prefill side of a model with state-space layers or a drafter with a lookahead: the request's
    last ``backoff`` prompt tokens are dropped and it stops after one token, so that the state (and
    the drafter's KV) it hands out is the one before them, from which the decode side computes them
    (``state.PREFILL_BACKOFF``, ``backoff.drafter_backoff``). Once per
    request (marked in its params, so a preempted request is not cut twice); not for a prompt of
    ``backoff`` tokens or fewer, nor one that skips reading cached prefixes (its decode side loads
    nothing)."""
    params = request.kv_transfer_params
    skips = getattr(request, "get_skip_reading_prefix_cache", None)
    if params.get("_llm_datadist_truncated") or prompt_length(request) <= backoff or (skips is not None and skips()):
        return
    if request.prompt_token_ids is not None:
        del request.prompt_token_ids[-backoff:]
    elif getattr(request, "prompt_embeds", None) is not None:
        request.prompt_embeds = request.prompt_embeds[:-backoff]
    else:
        return
    del request._all_token_ids[-backoff:]
    request.num_prompt_tokens -= backoff
    request.max_tokens = 1
    params["_llm_datadist_truncated"] = True


def prompt_length(request) -> int:
    """Tokens of the request's prompt, given as token ids or as embeddings (vLLM's
    ``Request.num_prompt_tokens`` counts both)."""
    length = getattr(request, "num_prompt_tokens", None)
    if isinstance(length, int):
        return length
    return len(request.prompt_token_ids or ())


class Scheduler:
    def __init__(self, engine_id: str, options: Options, block_size: int, producer: bool, tp_size: int = 1,
                 kv_heads: int = 0, groups: Tuple[kv_groups.Group, ...] = (), num_groups: int = 1,
                 backoff: int = 0, pp_size: int = 1):
        self.engine_id = engine_id
        #: the KV cache groups that move (``groups.transfer_groups``; () if vLLM gave no config) and
        #: how many groups vLLM's block id lists have
        self.groups = groups
        self.num_groups = num_groups
        #: trailing prompt tokens a prefill leaves to the decode side: one with state-space groups, a
        #: multi-module MTP drafter's lookahead less one (``backoff``: ``backoff.drafter_backoff``)
        self.backoff = max(kv_groups.state_backoff(groups), backoff)
        self.options = options
        self.block_size = block_size
        self.tp_size = tp_size
        self.pp_size = pp_size  # (``stages``: tp_size * pp_size workers)
        self.kv_heads = kv_heads  # the model's, over all ranks (0: unknown)
        self.worker: Optional[LLMDataDistHandshakeMetadata] = None  # rank 0
        self.workers: List[LLMDataDistHandshakeMetadata] = []  # by flat rank (``stages.flat_rank``)
        self._recv: Dict[str, Recv] = {}
        self._parked: Dict[str, Recv] = {}
        self._send: Dict[str, float] = {}
        self._send_blocks: Dict[str, List[int]] = {}
        #: every rank's address and lease key, for rank 0's worker (rank queries), until handed over
        self._rank_table: Optional[List[Dict[str, Any]]] = None
        #: decode side, requests whose params lack what only their prefill engine can say: those
        #: to ask at the next step, those asked (-> when, monotonic) and the answers come back
        self._ask: Dict[str, Recv] = {}
        self._asking: Dict[str, float] = {}
        self._answers: Dict[str, Dict[str, Any]] = {}
        #: the params of requests asked about while they wait in the queue (their answer re-parks
        #: them with every rank, so that each decode rank renews the prefill ranks it will read)
        self._asked_params: Dict[str, Dict[str, Any]] = {}
        #: how long a request waits for its prefill engine's answer: a link, a notification and a
        #: pull ahead of it on that peer's threads
        self.ask_s = (options.link_timeout_ms + options.sync_kv_timeout_ms) / 1000 + 10.0
        self._signals = StopSignals(watch=producer)  # only a prefill engine holds blocks
        #: push mode (``push``; None: pull)
        if options.transfer_mode == "push" and self.backoff:
            # (a pushed prompt is the whole prompt: the decode side would wait for tokens the
            # prefill leaves to it, or decode without their KV)
            raise NotImplementedError(
                f"LLMDataDistConnector: push mode does not support a prompt backoff (this engine's prefill would "
                f"leave its last {self.backoff} prompt token(s) to the decode engine: a multi-module MTP drafter or "
                "state-space layers); use transfer_mode 'pull'")
        self.push = PushScheduling(block_size, producer) if options.transfer_mode == "push" else None
        if options.bidirectional_kv_xfer and (self.backoff or len(groups) > 1 or tp_size != 1):
            raise NotImplementedError(
                "LLMDataDistConnector: bidirectional_kv_xfer supports engines without tensor parallelism whose model "
                "has one KV cache group and leaves no prompt tokens to the decode side (this one: tensor parallel "
                f"size {tp_size}, {max(1, len(groups))} group(s), a prompt backoff of {self.backoff}); turn it off")

    def close(self) -> None:
        self._signals.close()

    def set_worker(self, metadata: Optional[KVConnectorHandshakeMetadata]) -> None:
        """The one worker of an engine without tensor parallelism."""
        self.set_workers({0: metadata} if metadata is not None else {})

    def set_workers(self, by_rank: Dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Every worker's handshake by flat rank (``{pp_rank * tp_size + tp_rank: handshake}``,
        ``stages``); until all of them have spoken, no request's KV is handed out."""
        for rank, metadata in by_rank.items():
            if not isinstance(metadata, LLMDataDistHandshakeMetadata):
                raise TypeError(f"unexpected handshake metadata {type(metadata).__name__}")
            if self.options.lease_tokens and len(metadata.lease_key) < 32:
                raise ValueError(f"LLMDataDistConnector: the handshake of worker rank {rank} carries no lease key")
            said = stages.flat_rank(getattr(metadata, "pp_rank", 0), metadata.tp_rank, self.tp_size)
            if said != rank:
                raise ValueError(f"LLMDataDistConnector: the handshake of worker rank {rank} says it is pipeline stage "
                                 f"{getattr(metadata, 'pp_rank', 0)}, tensor parallel rank {metadata.tp_rank}")
        workers = self.tp_size * self.pp_size
        if sorted(by_rank) != list(range(workers)):
            if by_rank:
                logger.error("LLMDataDistConnector: handshakes came from worker ranks %s of %d (tensor parallel size "
                             "%d, pipeline parallel size %d); this engine hands no KV to decode engines",
                             sorted(by_rank), workers, self.tp_size, self.pp_size)
            self.worker, self.workers = None, []
            return
        self.workers = [by_rank[rank] for rank in range(workers)]
        self.worker = self.workers[0]
        if workers > 1:
            self._rank_table = [{"host": w.host, "port": w.port, "cluster_id": w.cluster_id, "lease_key": w.lease_key}
                                for w in self.workers]

    def on_new_request(self, request) -> None:
        """A request that will load its prompt from a prefill engine waits in vLLM's queue until
        a slot is free, and vLLM asks this connector about it only then (it skips the connector
        while ``max_num_seqs`` requests run): its prefill lease is renewed from now on, until its
        pull starts or it ends (``update_state_after_alloc``, ``request_finished`` or a refusal in
        ``get_num_new_matched_tokens``, each of which hands it to ``reqs_to_recv``)."""
        params = request.kv_transfer_params
        if isinstance(params, dict):
            bidirectional.strip_marks(params)  # (ours: a router's copies would skip the decode engine's check)
        if isinstance(params, dict) and params.get("do_remote_decode") and self.backoff:
            truncate_for_prefill(request, self.backoff)
        if isinstance(params, dict) and params.get("do_remote_prefill") and self.push is None:
            spec = recv_spec(params)
            if spec is not None:
                self._parked[request.request_id] = spec
                if self._must_ask(spec):  # asked now, not when a slot frees: the queue may outlast a lease
                    self._ask[request.request_id] = spec
                    self._asking[request.request_id] = time.monotonic()
                    self._asked_params[request.request_id] = params

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        params = request.kv_transfer_params
        if self.options.bidirectional_kv_xfer and bidirectional.is_next_turn(params) and \
                params.get(bidirectional.STATE) is not False and not params.get(bidirectional.SCHEDULED):
            return self._next_turn_matched(request, num_computed_tokens)
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return 0, False
        if self.push is not None:
            size = params.get("remote_block_size")
            if isinstance(size, int) and not isinstance(size, bool) and size != self.block_size:
                logger.warning("request %s: its prefill engine's block size is %s tokens, this engine's %d: push mode "
                               "moves equal blocks only (use transfer_mode 'pull', or the same --block-size); "
                               "computing the prompt locally", request.request_id, size, self.block_size)
                self.push.allocated(request, [], 0, prompt_length(request))  # (its blocks freed: a bare registration)
                return 0, False
            return self.push.matched_tokens(request, num_computed_tokens, prompt_length(request))
        spec = recv_spec(params)
        if spec is not None and self._must_ask(spec):
            spec = self._learn(request, spec)
            if spec is None:
                return None, False  # asked; vLLM asks this again at a later step
            if not params.get("do_remote_prefill"):
                return 0, False  # it could not say: computed here
        # (the prefill stopped short of the prompt's last ``backoff`` tokens, which are computed here)
        prompt = prompt_length(request)
        if self.backoff and prompt <= self.backoff:
            logger.warning("request %s: a prompt of %d token(s) leaves nothing to load from a prefill engine that "
                           "stops %d token(s) short of the prompt (state-space layers, or a drafter's lookahead); "
                           "computing it locally", request.request_id, prompt, self.backoff)
            params["do_remote_prefill"] = False
            if spec is not None:
                self._recv[request.request_id] = spec  # still let the prefill side free its blocks
            return 0, False
        prompt -= self.backoff
        why = stages.refusal(spec.remote_pp_size, self.pp_size) if spec is not None else ""
        if why:
            logger.warning("request %s: %s; computing the prompt locally", request.request_id, why)
            params["do_remote_prefill"] = False
            self._recv[request.request_id] = spec  # still let every prefill worker free its blocks
            return 0, False
        why = self._tp_refusal(spec) if spec is not None and spec.tp_size != self.tp_size else ""
        if why:
            logger.warning("request %s: its prefill engine runs with tensor parallel size %d and this one with %d, "
                           "and %s: computing the prompt locally", request.request_id, spec.tp_size, self.tp_size,
                           why)
            params["do_remote_prefill"] = False
            self._recv[request.request_id] = spec  # still let every prefill rank free its blocks
            return 0, False
        if spec is not None and self._refusal(spec):
            # Not computed here silently: the worker refuses the load (one line saying why), and
            # vLLM recomputes or fails the request (kv_load_failure_policy).
            count = prompt - num_computed_tokens
            return (count, True) if count > 0 else (0, False)
        why = "they are malformed" if spec is None else self._blocks_refusal(spec, prompt)
        if not why and kv_groups.state_backoff(self.groups):
            why = state.computed_refusal(params, prompt)
        if why:
            logger.warning("request %s: kv_transfer_params do not fit a prompt of %d tokens here (%s); computing "
                           "the prompt locally", request.request_id, prompt, why)
            params["do_remote_prefill"] = False
            if spec is not None:
                self._recv[request.request_id] = spec  # still let the prefill side free its blocks
            return 0, False
        count = prompt - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if self.options.bidirectional_kv_xfer and isinstance(params, dict) and params.get(bidirectional.STATE) and \
                not params.get(bidirectional.SCHEDULED):
            self._next_turn_allocated(request, blocks, num_external_tokens)
        if self.push is not None and isinstance(params, dict) and params.get("do_remote_decode"):
            self.push.prefill_allocated(request, prompt_length(request))
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return
        if self.push is not None:
            local = list(blocks.get_unhashed_block_ids()) if num_external_tokens > 0 else []
            self.push.allocated(request, local, num_external_tokens, prompt_length(request))
            return
        params["do_remote_prefill"] = False  # one transfer per request, even if called again
        spec = recv_spec(params)
        if spec is None:
            return
        if num_external_tokens <= 0:
            local: Tuple[List[int], ...] = tuple([] for _ in spec.remote_groups) or ([],)
        elif self.groups:
            # (vLLM's lists without the null blocks of sliding-window groups), clipped as the prefill
            # side clips its own
            local = kv_groups.clip(self.groups, blocks.get_unhashed_block_ids_all_groups(), self.num_groups)
        else:
            local = (list(blocks.get_unhashed_block_ids()),)
        # (where the block sizes differ the worker pairs blocks by position: the first local block's)
        first = max(0, prompt_length(request) - self.backoff - num_external_tokens) // max(1, self.block_size)
        self._recv[request.request_id] = replace(spec.with_local(local), awaiting=num_external_tokens > 0,
                                                 refused=self._refusal(spec), local_first_block=first,
                                                 kv_heads=self.kv_heads if spec.tp_size != self.tp_size else 0)

    def _next_turn_matched(self, request, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        """A prefill request of a conversation's next turn whose params name the prefix a decode
        engine holds (``bidirectional``): the tokens to pull of it, once the decode engine has said
        that it holds them for this token (asked as a prefill engine is for its ranks: a forged,
        foreign or expired token is refused there, and the prompt is computed); 0 where the prefix
        is shorter than ``kv_recompute_threshold`` tokens (NIXL's rule), does not fit the prompt, or
        cannot be asked for. Whatever is not pulled is released, so the decode engine frees it now."""
        params, req_id = request.kv_transfer_params, request.request_id
        spec = recv_spec(params)
        why = bidirectional.not_by_tokens(request)
        held, why = (0, why) if why else bidirectional.held_prefix(params, request.prompt_token_ids, self.block_size)
        if spec is not None and not why:  # (else this engine's workers pull none of it: a failed load)
            why = stages.refusal(spec.remote_pp_size, self.pp_size)
        if spec is None or why:
            logger.warning("request %s: the prefix its params name on a decode engine is not pulled (%s); "
                           "computing the prompt", req_id, why or "they are malformed")
            self._next_turn_done(request, spec)
            return 0, False
        count, threshold = held - num_computed_tokens, self.options.kv_recompute_threshold
        if count <= 0 or (threshold > 0 and count < threshold):
            # (computing a few tokens is quicker than a pull: released, as NIXL's are)
            logger.debug("request %s: %d tokens of a held prefix to pull, kv_recompute_threshold %d: computed",
                         req_id, count, threshold)
            self._next_turn_done(request, spec)
            return 0, False
        if params.get(bidirectional.STATE) is None:
            params[bidirectional.STATE] = True
            learnt = self._learn(request, spec, flag=bidirectional.STATE)
            if learnt is None:
                params[bidirectional.STATE] = None  # asked; vLLM asks this again at a later step
                return None, False
            if params.get(bidirectional.STATE) is False:
                params[bidirectional.SCHEDULED] = True  # (_learn released it)
                return 0, False
        params[bidirectional.TOKENS] = held
        return held - num_computed_tokens, True

    def _next_turn_allocated(self, request, blocks, num_external_tokens: int) -> None:
        """The pull of a next turn's prefix, into the blocks vLLM allocated for it (none: only released)."""
        params = request.kv_transfer_params
        params[bidirectional.SCHEDULED] = True
        spec = recv_spec(params)
        held = params.get(bidirectional.TOKENS)
        if spec is None or not isinstance(held, int):
            return
        # the blocks of the pulled tokens (vLLM allocates no more for a load, but pairing by tails needs it)
        wanted = -(-held // self.block_size) - (held - num_external_tokens) // self.block_size
        local = list(blocks.get_unhashed_block_ids())[:wanted] if num_external_tokens > 0 else []
        remote = bidirectional.clip(spec.remote_block_ids, held, self.block_size)
        self._recv[request.request_id] = replace(spec, remote_block_ids=remote, local_block_ids=local,
                                                 awaiting=num_external_tokens > 0, next_turn=True)

    def _next_turn_done(self, request, spec: Optional[Recv]) -> None:
        """A next turn's prefix that is not pulled: released (the decode engine frees it now)."""
        params = request.kv_transfer_params
        params[bidirectional.STATE] = False
        params[bidirectional.SCHEDULED] = True
        if spec is not None:
            self._recv[request.request_id] = replace(spec, next_turn=True)

    def _must_ask(self, spec: Recv) -> bool:
        """Whether the request's params lack what only its prefill engine can say: every rank's
        address and release id (a router that forwards only NIXL's fields drops ``remote_ranks``),
        or, between engines of different TP sizes, whether it counts readers."""
        return spec.ranks_unknown or (spec.tp_size != self.tp_size and not spec.readers_counted)

    def _learn(self, request, spec: Recv, flag: str = "do_remote_prefill") -> Optional[Recv]:
        """The request's spec completed with its prefill engine's answer, which goes into its
        params (so that it loads exactly as if they had come with them); None while the question
        is on its way (it is asked once: rank 0 of this engine's workers asks the prefill engine's
        rank 0, authenticated by the link and checked with rank 0's lease token). If the prefill
        engine could not say (an older release, a refused token, unreachable, no answer within
        ``ask_s``), the request is computed here (``do_remote_prefill`` cleared, one line) and the
        prefill ranks it knows are released."""
        req_id, params = request.request_id, request.kv_transfer_params
        answer = self._answers.pop(req_id, None)
        if answer is None:
            asked = self._asking.get(req_id)
            if asked is None:
                self._ask[req_id] = spec
                self._asking[req_id] = time.monotonic()
                return None
            if time.monotonic() - asked < self.ask_s:
                return None
            answer = {"why": f"no answer within {self.ask_s:.0f} s"}
        self._asking.pop(req_id, None)
        self._asked_params.pop(req_id, None)
        learnt = None
        if isinstance(answer.get("ranks"), list):
            learnt = recv_spec(dict(params, remote_ranks=answer["ranks"],
                                    readers_counted=answer.get("readers_counted") is True))
            if learnt is None or learnt.tp_size != spec.tp_size or learnt.remote_pp_size != spec.remote_pp_size:
                answer, learnt = {"why": "its answer is malformed"}, None
        if learnt is not None:
            params["remote_ranks"] = answer["ranks"]
            params["readers_counted"] = learnt.readers_counted
            return learnt
        if flag == bidirectional.STATE:
            logger.warning("request %s: the decode engine at %s:%d did not confirm that it holds the prefix the "
                           "request's params name for it (%s): computing the prompt", req_id, spec.host, spec.port,
                           str(answer.get("why", "?"))[:200])
            params[flag] = False
            self._recv[req_id] = spec  # (released: a decode engine that does hold it frees it now)
            return spec
        workers = f"{spec.tp_size} tensor parallel ranks" if spec.remote_pp_size == 1 else \
            f"{spec.tp_size * spec.remote_pp_size} workers (pipeline parallel size {spec.remote_pp_size})"
        what = f"its {workers}" if spec.ranks_unknown else \
            "whether it counts the readers of a rank's blocks"
        logger.warning("request %s: its kv_transfer_params do not say %s (a router that forwards only NIXL's "
                       "fields?), and the prefill engine at %s:%d could not say either (%s): computing the prompt "
                       "locally%s", req_id, what, spec.host, spec.port, str(answer.get("why", "?"))[:200],
                       "; only its rank 0 is released (the others free their blocks when their leases end)"
                       if spec.ranks_unknown else "")
        params[flag] = False
        self._recv[req_id] = spec  # still let the prefill ranks it knows free their blocks
        return spec

    def has_pending_push_work(self) -> bool:
        return self.push is not None and self.push.pending()

    def update_connector_output(self, output) -> None:
        """The workers' answers for the requests asked about (``LLMDataDistWorkerMetadata``); those
        of requests no longer waiting for one are dropped."""
        if self.push is not None:
            self.push.output(output)
        meta = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(meta, LLMDataDistWorkerMetadata):
            for req_id, answer in meta.answers.items():
                if req_id in self._asking and isinstance(answer, dict):
                    self._answers[req_id] = answer
                    params = self._asked_params.pop(req_id, None)
                    if params is not None and isinstance(answer.get("ranks"), list) and req_id not in self._recv:
                        learnt = recv_spec(dict(params, remote_ranks=answer["ranks"],
                                                readers_counted=answer.get("readers_counted") is True))
                        if learnt is not None:
                            self._parked[req_id] = learnt  # parked again: its workers renew every rank

    def _tp_refusal(self, spec: Recv) -> str:
        """Why KV cannot move head by head from a prefill engine of another TP size; "" if it can."""
        if not spec.readers_counted:
            return ("that engine frees a rank's blocks at its first release (an older release): KV moves only "
                    "between engines of the same tensor parallel size")
        return split_refusal(self.kv_heads, spec.tp_size, self.tp_size)

    def _blocks_refusal(self, spec: Recv, prompt: int) -> str:
        """Why the blocks the params name cannot be this engine's KV of a prompt of ``prompt``
        tokens (they come from outside: counted per KV cache group); "" if they can."""
        if spec.remote_block_size and spec.remote_block_size != self.block_size:
            # (another block size: one full-attention group, ``_refusal``) counted in the prefill's blocks
            expected = kv_groups.expected_blocks((), prompt, spec.remote_block_size)
        else:
            expected = kv_groups.expected_blocks(self.groups, prompt, self.block_size)
        named = [list(g) for g in spec.remote_groups] or [spec.remote_block_ids]
        if len(named) != len(expected):
            return (f"they name blocks of {len(named)} KV cache group(s), this engine has {len(expected)} (the "
                    "engines must run one model with the same --disable-hybrid-kv-cache-manager)")
        for index, (blocks, (fewest, most)) in enumerate(zip(named, expected)):
            if not fewest <= len(blocks) <= most:
                where = f" of KV cache group {index}" if len(expected) > 1 else ""
                wanted = str(most) if fewest == most else f"{fewest} to {most}"
                return f"they name {len(blocks)} blocks{where}, {wanted} wanted"
        return ""

    def _refusal(self, spec: Recv) -> str:
        """Why the prefill engine's blocks cannot be loaded here, from what its params say; "" if they can."""
        size = spec.remote_block_size
        if size is None or size == self.block_size:
            return ""
        why = block_sizes.refusal(size, self.block_size, self.groups, spec.tp_size != self.tp_size)
        return f"its block size is {size} tokens, this engine's {self.block_size}: {why}" if why else ""

    def _forget_asked(self, req_id: str) -> None:
        self._asked_params.pop(req_id, None)
        self._ask.pop(req_id, None)
        self._asking.pop(req_id, None)
        self._answers.pop(req_id, None)

    def build_connector_meta(self, scheduler_output=None) -> LLMDataDistConnectorMetadata:
        meta = LLMDataDistConnectorMetadata()
        if self.push is not None:
            self.push.fill(meta, scheduler_output)
        meta.reqs_to_recv, self._recv = self._recv, {}
        meta.reqs_parked = {r: spec for r, spec in self._parked.items() if r not in meta.reqs_to_recv}
        self._parked = {}
        meta.reqs_to_send, self._send = self._send, {}
        meta.blocks_to_send, self._send_blocks = self._send_blocks, {}
        meta.rank_table, self._rank_table = self._rank_table, None
        meta.reqs_to_ask, self._ask = self._ask, {}
        meta.stopping = self._signals.stopping
        return meta

    def request_finished(self, request, block_ids) -> Tuple[bool, Optional[Dict[str, Any]]]:
        params = request.kv_transfer_params
        self._forget_asked(request.request_id)
        if not isinstance(params, dict):
            return False, None
        if self.options.bidirectional_kv_xfer and bidirectional.is_next_turn(params) and \
                not params.get(bidirectional.SCHEDULED):
            self._next_turn_done(request, recv_spec(params))  # finished before its pull: the prefix released
        if self.push is not None and not params.get("do_remote_decode"):
            self.push.decode_finished(request)
            return False, None
        if self.push is not None:
            held, out = self._handed_out(request, block_ids)
            self.push.prefill_finished(request, held)
            if out is not None:
                out["transfer_mode"] = "push"
            return held, out
        return self._handed_out(request, block_ids)

    def _handed_out(self, request, block_ids) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """A finished prefill's blocks held for its decode side, and the params naming them."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if params.get("do_remote_prefill"):
            # Finished (aborted) before its blocks were allocated: nothing to pull, but the
            # prefill side must still hear that it can free its blocks.
            params["do_remote_prefill"] = False
            spec = recv_spec(params)
            if spec is not None:
                self._recv[request.request_id] = spec
            return False, None
        # multi-turn: a decode engine holds a finished request's blocks for the next turn's prefill
        next_turn = not params.get("do_remote_decode")
        if next_turn and not (self.options.bidirectional_kv_xfer and params):
            return False, None
        if next_turn and bidirectional.not_by_tokens(request):
            return False, None  # (equal token hashes could name other KV)
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted prefill: free its blocks now
        if block_ids and not isinstance(block_ids[0], (list, tuple)):
            block_ids = (list(block_ids),)
        try:
            # what moves: the transfer groups, sliding-window ones cut to their window
            per_group = kv_groups.clip(self.groups, block_ids or ((),), self.num_groups)
        except ValueError as exc:
            logger.error("request %s: %s; its KV is not handed to a decode engine", request.request_id, exc)
            return False, None
        if next_turn:  # (the blocks of its computed tokens: what the next turn may take)
            per_group = [list(per_group[0][:-(-request.num_computed_tokens // self.block_size)])]
        ids = [b for group in per_group for b in group]
        if not ids:
            return False, None
        if self._signals.stopping:
            return False, None  # the engine is going away: no decode side could take them in time
        if self.worker is None:
            logger.warning("request %s: no llm_datadist worker address yet; its KV cannot be handed "
                           "to a decode engine", request.request_id)
            return False, None
        if utf8_len(request.request_id) > MAX_REQUEST_ID_BYTES:
            logger.warning("request %s: its id is longer than %d bytes, which no release may name; its KV is "
                           "not handed to a decode engine", request.request_id[:64] + "...", MAX_REQUEST_ID_BYTES)
            return False, None
        # Only the decode side the proxy hands these params to can release the blocks: each rank's
        # release names the request with a token under that rank's key; rank 0's rides in
        # remote_request_id, which every NIXL-style proxy forwards.
        issued = int(time.time())
        remote_ids = [lease_request_id(bytes.fromhex(w.lease_key), request.request_id, issued)
                      if self.options.lease_tokens else request.request_id for w in self.workers]
        lease_s = self.options.decoder_kv_blocks_ttl if next_turn else self.options.kv_lease_s
        self._send[request.request_id] = lease_s
        self._send_blocks[request.request_id] = ids  # what the decode side may read (LeaseBook.read_guard)
        out = {
            "do_remote_prefill": not next_turn,
            "do_remote_decode": next_turn,
            # one list, or (a hybrid model) one per KV cache group, as NIXL's connector sends them
            "remote_block_ids": per_group[0] if len(per_group) == 1 else [list(g) for g in per_group],
            "remote_engine_id": self.engine_id,
            "remote_request_id": remote_ids[0],
            "remote_host": self.worker.host,
            "remote_port": self.worker.port,
            "remote_cluster_id": self.worker.cluster_id,
            "remote_num_tokens": request.num_computed_tokens,
            "remote_block_size": self.block_size,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            # every worker by flat rank (rank 0 again first): a decode worker pulls from the prefill
            # worker of its stage and tensor parallel rank
            "remote_ranks": [{"host": w.host, "port": w.port, "cluster_id": w.cluster_id, "request_id": remote_id}
                             for w, remote_id in zip(self.workers, remote_ids)],
            # each rank frees its blocks after as many releases as the decode side has readers of
            # it (a decode engine of another TP size reads one rank from several of its own)
            "readers_counted": True,
        }
        if next_turn:
            # (NIXL's field, in Unix seconds: our prefill engines read it)
            out["remote_blocks_expiry_time"] = time.time() + lease_s
            held = list(request.all_token_ids)[:request.num_computed_tokens]
            out["remote_block_hashes"] = bidirectional.block_hashes(held, self.block_size)
        return True, out
