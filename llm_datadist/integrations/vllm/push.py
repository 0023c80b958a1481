"""Push mode (``kv_connector_extra_config: {"transfer_mode": "push"}``): the prefill engine writes
each layer's KV into the decode engine's blocks while its prefill still computes the next layers.

The request flow is that of vLLM 0.32's NIXL push mode, so its proxies drive it:

* The decode scheduler allocates the request's blocks and reports its prompt as loading
  asynchronously; its worker links to the prefill worker at ``remote_host:remote_port``, grants
  that peer write access to exactly those blocks (``GrantBook``: recorded on the decode side,
  keyed by the link's authenticated peer) and registers them with a ``push_reg`` notification
  naming the request: ``remote_request_id`` (with its lease token) when the params carry it, else
  the decode request's own id, which the prefill side matches by its base id (vLLM's ids without
  the ``-<8 hex>`` suffix it appends; NIXL's push matches the same way) only where its operator
  opted in (``push_match_by_request_id``: then any authenticated decode peer that knows a request's
  id can receive its KV), and never where two live requests share the base id.
* The prefill worker (``Pusher``) learns its requests' blocks and the prompt tokens each step
  computes from its scheduler. From ``save_kv_layer`` it pushes that layer's blocks of the step's
  tokens to every registered request on its push thread (one ``push_blocks`` call per layer and
  request, its layer range one tensor); ``wait_for_save`` waits for the step's pushes, so that no
  block is freed or reused under a push. Tokens computed before a registration came (the decode
  side saw the request late: always so behind a proxy that sends to the prefill engine first)
  are pushed at the next step, all layers at once. When a request's prompt is pushed whole the
  prefill worker tells the decode worker (``push_done``) and frees the blocks it held
  (``finished_sending``); the decode worker checks the grant named in it, ends the grant and
  reports the request in ``finished_recving``, so it decodes as soon as the last layer landed.

Writes through the decode engine's server (``tcp``, ``staging``) are checked against the grants
(``engine.set_write_guard``): a push outside every live grant of that peer is refused before a
byte lands. Over one-sided planes (``cma``, ``cuda_ipc``, ``nixl``) writes never pass through
the decode engine's code: an authenticated peer can write every registered cache.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import llm_datadist as ld
from llm_datadist.integrations.vllm.leases import MAX_RELEASE_ID_BYTES, check_lease, utf8_len
from llm_datadist.integrations.vllm.meta import Recv, prefill_rank

logger = logging.getLogger(__package__)

TRANSFER_MODES = ("pull", "push")

#: The most registrations a prefill worker keeps waiting for their request (from all peers).
MAX_PENDING_REGS = 4096

#: How long ending a grant waits for the peer's pushes through the server that passed the guard
#: before (``engine.quiesce_writes``; past it their connections are shut).
QUIESCE_S = 2.0

#: The most block ids one registration may name.
MAX_REG_BLOCKS = 1 << 20

#: Where the prefill and decode workers append their push timings (bench/report_vllm_push.py):
#: one JSON object a line, to ``<path>.<pid>``. Unset: nothing is recorded.
TRACE_ENV = "LLM_DATADIST_PUSH_TRACE"

_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def base_request_id(req_id: str) -> str:
    """vLLM's request id without the ``-<8 hex>`` it appends to the API's id."""
    return _SUFFIX.sub("", req_id)


@dataclass
class PushReg:
    """Decode scheduler -> worker: a request's blocks to register with its prefill worker.
    ``local_block_ids`` empty: nothing to receive (the prompt was cached here, or the request
    ended first): the prefill side only frees its blocks."""

    local_block_ids: List[int]
    first_block: int  # the prompt's block index of the first of them (blocks before are cached here)
    host: str
    port: int
    cluster_id: Optional[int]
    remote_request_id: str  # "" where the params name none (a proxy that sends to both at once)
    awaiting: bool = False  # vLLM waits for it (report in finished_recving)

    def as_recv(self) -> Recv:
        """The peer this goes to, as ``peers.Peers`` addresses it."""
        return Recv([], [], self.host, self.port, self.cluster_id, self.remote_request_id)


def push_spec(params: Any) -> Optional[PushReg]:
    """The prefill worker a decode request's ``kv_transfer_params`` name for push mode, or None if
    they are unusable (never raises: they come from outside). ``remote_request_id`` is optional."""
    if not isinstance(params, dict):
        return None
    remote_id = params.get("remote_request_id")
    if remote_id is None:
        remote_id = ""
    if not isinstance(remote_id, str):
        return None
    peer = prefill_rank(params.get("remote_host"), params.get("remote_port"), params.get("remote_cluster_id"),
                        remote_id or "-")
    if peer is None:
        return None
    tp_size = params.get("tp_size", 1)
    if tp_size != 1:  # (push mode moves KV between engines without tensor parallelism only)
        return None
    return PushReg([], 0, peer.host, peer.port, peer.cluster_id, remote_id)


@dataclass
class PushStep:
    """Prefill scheduler -> worker, for a push-mode request scheduled in this step: its blocks so
    far (of its one KV cache group) and the prompt tokens ``[start, end)`` this step computes."""

    block_ids: List[int]
    start: int
    end: int
    prompt_tokens: int


# -- the decode side ----------------------------------------------------------------------------------

@dataclass
class Grant:
    peer: int
    ranges: List[Tuple[int, int]]
    token: str
    deadline: float  # monotonic


class GrantBook:
    """Write grants of the decode side: request id -> ``Grant``; the engine's write guard allows a
    peer the union of its live grants (rebuilt when they change). Thread-safe: grants are made on
    the peers' threads, checked on the links' threads, ended on any."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.grants: Dict[str, Grant] = {}
        self._expired: Dict[str, Grant] = {}  # ran out, not yet taken (``take_expired``)
        self._union: Dict[int, Any] = {}  # peer -> its live grants' ranges, one tuple (the guard's answer)
        self._first_deadline = float("inf")

    def grant(self, req_id: str, peer: int, ranges: List[Tuple[int, int]], seconds: float) -> str:
        """Grant ``peer`` writes to ``ranges`` for ``req_id``; a grant it replaces ends (its peer's
        writes are rebuilt without it)."""
        token = secrets.token_urlsafe(16)
        with self._lock:
            old = self.grants.get(req_id)
            self.grants[req_id] = Grant(peer, list(ranges), token, time.monotonic() + seconds)
            self._rebuild(peer)
            if old is not None and old.peer != peer:
                self._rebuild(old.peer)
        return token

    def revoke(self, req_id: str) -> Optional[Grant]:
        """End the grant of ``req_id``; also one that ran out and was not yet taken (its peer's
        writes were rebuilt then)."""
        with self._lock:
            grant = self.grants.pop(req_id, None)
            if grant is not None:
                self._rebuild(grant.peer)
            else:
                grant = self._expired.pop(req_id, None)
        return grant

    def finish(self, peer: int, req_id: str, token: Any) -> Optional[Grant]:
        """End the grant of ``req_id`` if ``peer`` holds it and ``token`` is its token."""
        with self._lock:
            grant = self.grants.get(req_id)
            if grant is None or grant.peer != peer or not isinstance(token, str) or \
                    not secrets.compare_digest(grant.token, token):
                return None
            del self.grants[req_id]
            self._rebuild(peer)
        return grant

    def expire(self, now: float) -> None:
        """End the grants whose time ran out (kept for ``take_expired``)."""
        with self._lock:
            if now < self._first_deadline:
                return
            gone = [r for r, g in self.grants.items() if g.deadline <= now]
            for req_id in gone:
                self._expired[req_id] = self.grants.pop(req_id)
            for peer in {self._expired[r].peer for r in gone}:
                self._rebuild(peer)
            if not gone:
                self._first_deadline = min((g.deadline for g in self.grants.values()), default=float("inf"))

    def take_expired(self, now: float) -> Dict[str, Grant]:
        """The grants that ran out (by ``now``, or ended by the guard before) since the last call."""
        self.expire(now)
        with self._lock:
            out, self._expired = self._expired, {}
        return out

    def guard(self, peer: int):
        """The engine's write guard: what ``peer`` may write now (None: nothing)."""
        if time.monotonic() >= self._first_deadline:
            self.expire(time.monotonic())
        return self._union.get(peer)

    def _rebuild(self, peer: int) -> None:
        ranges = [r for g in self.grants.values() if g.peer == peer for r in g.ranges]
        union = dict(self._union)
        if ranges:
            union[peer] = tuple((int(a), int(n)) for a, n in ranges)  # (immutable: the guard converts it once)
        else:
            union.pop(peer, None)
        self._union = union  # (replaced whole: the links' threads read it without the lock)
        self._first_deadline = min((g.deadline for g in self.grants.values()), default=float("inf"))


def _deny_all(peer: int) -> None:
    """The write guard a closed receiver leaves: no peer may write anything."""
    return None


class Receiver:
    """The decode worker's half of push mode: registers requests' blocks with their prefill
    workers under a write grant, and reports them loaded when the prefill worker says it pushed
    them (``push_done``), failed when it refused, failed or did not finish within ``kv_lease_s``."""

    def __init__(self, worker) -> None:
        self.w = worker
        self.grants = GrantBook()
        self._lock = threading.Lock()
        self._recved: Set[str] = set()
        self._failed: Set[str] = set()
        self._awaiting: Dict[str, PushReg] = {}  # granted and registered, not yet pushed
        self._cancelling: Dict[str, PushReg] = {}  # ended on this side, the prefill side being told
        self.stats = {"push_registered": 0, "push_received": 0, "push_failed": 0, "push_refused_done": 0}
        self._trace = Trace()

    def install(self) -> None:
        self.w._links_api.set_write_guard(self.grants.guard)
        self.w._links_api.set_notify_handler(self.on_notify)

    def close(self) -> None:
        self.w._links_api.set_notify_handler(None)
        self.w._links_api.set_write_guard(_deny_all)  # (None would be no guard: every peer writes anything)

    def on_step(self, regs: Dict[str, PushReg], cancel: Set[str]) -> None:
        for req_id in cancel:
            with self._lock:  # (no grant is made for it from now on: ``_register_on``)
                reg = self._awaiting.pop(req_id, None)
                grant = self.grants.revoke(req_id)  # writes through this engine's server stop now
                if reg is not None:
                    self._cancelling[req_id] = reg
            if reg is not None:
                self._stop(req_id, reg, grant, "the request ended before its KV was pushed", True)
        for req_id, reg in regs.items():
            if reg.awaiting:
                with self._lock:
                    self._awaiting[req_id] = reg
            if not self.w.peers.submit(reg.as_recv(), lambda r=req_id, g=reg: self._register(r, g)):
                self._end(req_id, False, "this engine is shutting down")
        for req_id, grant in self.grants.take_expired(time.monotonic()).items():
            with self._lock:
                reg = self._awaiting.pop(req_id, None)
                if reg is not None:
                    self._cancelling[req_id] = reg
            if reg is not None:
                self._stop(req_id, reg, grant,
                           f"its prefill engine did not push it within {self.w.options.kv_lease_s:.0f} s", False)

    def _stop(self, req_id: str, reg: PushReg, grant: Optional[Grant], why: str, cancel: bool) -> None:
        """A request whose grant ended here before its push did: the prefill worker is told
        (``push_cancel``, on the peer's thread), then it is reported."""
        if grant is None or not self.w.peers.submit(reg.as_recv(),
                                                     lambda: self._cancel(req_id, grant, why, cancel)):
            self._end(req_id, False, why, cancel=cancel, peer=grant.peer if grant is not None else None)

    def _cancel(self, req_id: str, grant: Grant, why: str, cancel: bool) -> None:
        """Tell the prefill worker to push no more of an ended request and wait for its answer, sent
        once no push of it is in flight; then report it (vLLM frees its blocks only then). Without
        that answer the link is ended, so no push of it can start after."""
        problem = ""
        try:
            reply = self.w._links_api.notify(grant.peer, {"op": "push_cancel", "decode_request_id": req_id,
                                                          "grant": grant.token}, self.w.peers.notify_timeout_ms)
            if not isinstance(reply, dict) or reply.get("ok") is False:
                problem = str(reply.get("why") if isinstance(reply, dict) else "a malformed answer")[:200]
        except Exception as exc:  # noqa: BLE001 - reported all the same
            problem = f"{type(exc).__name__}: {exc}"
        if problem:
            logger.error("request %s: cluster %d did not confirm it stopped pushing it (%s): ending the link",
                         req_id, grant.peer, problem)
            try:
                self.w._links_api.unlink_many([grant.peer], 1000, True)
            except Exception as exc:  # noqa: BLE001 - the request is reported all the same
                logger.error("could not end the link to cluster %d: %s", grant.peer, exc)
        self._end(req_id, False, why, cancel=cancel, peer=grant.peer)

    def _register(self, req_id: str, reg: PushReg) -> None:
        """On the peer's thread: link, grant, register; a refusal fails the request."""
        try:
            why = self.w.peers.on_link(reg.as_recv(), lambda cluster_id: self._register_on(req_id, reg, cluster_id))
        except Exception as exc:  # noqa: BLE001 - the request must end whatever happens
            why = f"{type(exc).__name__}: {exc}"
        if why:
            self._end(req_id, False, why)

    def _register_on(self, req_id: str, reg: PushReg, cluster_id: int) -> str:
        incompatible = self.w.peers.peer(reg.as_recv()).incompatible
        if incompatible and reg.awaiting:
            return f"the prefill engine's KV is incompatible: {incompatible}"
        token = ""
        ranges = self.w.block_ranges(reg.local_block_ids) if reg.local_block_ids else []
        with self._lock:  # (a request cancelled meanwhile gets no grant: it only frees the prefill side)
            if ranges and req_id in self._awaiting:
                token = self.grants.grant(req_id, cluster_id, ranges, self.w.options.kv_lease_s)
        message = {"op": "push_reg", "request_id": reg.remote_request_id, "decode_request_id": req_id,
                   "blocks": reg.local_block_ids if token else [], "first_block": reg.first_block, "grant": token}
        reply = self.w._links_api.notify(cluster_id, message, self.w.peers.notify_timeout_ms)
        if not isinstance(reply, dict) or reply.get("accepted") is not True:
            why = reply.get("why") if isinstance(reply, dict) else None
            return f"the prefill engine refused the registration: {str(why or 'it does not push (pull mode?)')[:200]}"
        if token:
            self._count("push_registered")
        return ""

    def on_notify(self, peer: int, message: Any) -> Dict[str, Any]:
        """A prefill worker's ``push_done`` (on the link's thread)."""
        if not isinstance(message, dict) or message.get("op") != "push_done":
            return {"ok": False, "why": "this decode worker takes only push_done notifications"}
        req_id = message.get("decode_request_id")
        if not isinstance(req_id, str) or self.grants.finish(peer, req_id, message.get("grant")) is None:
            self._count("push_refused_done")
            logger.warning("llm_datadist: cluster %d said it pushed a request it holds no grant of; ignored", peer)
            return {"ok": False, "why": "no such grant"}
        ok = message.get("ok") is True
        self._trace.write({"event": "ready", "request": req_id, "t": time.time(), "ok": ok})
        self._end(req_id, ok, "" if ok else f"the prefill engine failed to push it: {str(message.get('why'))[:200]}",
                  peer=peer)
        return {"ok": True}

    def _end(self, req_id: str, ok: bool, why: str, cancel: bool = False, peer: Optional[int] = None) -> None:
        """Report a request (its grant ended first: no push of the granted peer that passed the
        guard before is still writing when vLLM hears of it, ``engine.quiesce_writes``)."""
        grant = self.grants.revoke(req_id)
        if grant is not None:
            peer = grant.peer
        with self._lock:
            reg = self._awaiting.pop(req_id, None) or self._cancelling.pop(req_id, None)
        if reg is None:
            return
        if peer is not None and not self.w._links_api.quiesce_writes(peer, QUIESCE_S):
            logger.error("request %s: a push of cluster %d was still writing %.0f s after its grant ended: its "
                         "link was ended", req_id, peer, QUIESCE_S)
            ok, why = False, why or "a push was still writing when its grant ended"
        with self._lock:
            self._recved.add(req_id)
            if not ok:
                self._failed.add(req_id)
        self._count("push_received" if ok else "push_failed")
        if not ok and not cancel:
            logger.error("request %s: its KV was not pushed: %s; reporting it as not loaded", req_id, why)
            self.w.recorder.count("failed_pulls")
        elif ok:
            self.w.recorder.pull(0.0, len(reg.local_block_ids), len(reg.local_block_ids) * self.w._block_bytes)

    def take(self) -> Tuple[Set[str], Set[str]]:
        with self._lock:
            out = (self._recved, self._failed)
            self._recved, self._failed = set(), set()
        return out

    def _count(self, name: str) -> None:
        with self._lock:
            self.stats[name] += 1


# -- the prefill side ---------------------------------------------------------------------------------

@dataclass(eq=False)
class Registration:
    peer: int
    decode_request_id: str
    remote_request_id: str
    blocks: List[int]
    first_block: int
    grant: str
    until: float  # monotonic: given up on if its request is not found by then; its job's deadline
    live: bool = True  # waiting (inbox or pending): counted against the caps
    key: Optional[Tuple[str, str]] = None  # ("id", request id) or ("base", base id), once checked


@dataclass
class Job:
    """A push-mode request on the prefill worker."""

    req_id: str
    blocks: List[int] = field(default_factory=list)
    prompt_tokens: int = 0
    computed: int = 0  # prompt tokens whose KV is in every layer (earlier steps)
    pushed: int = 0  # prompt tokens pushed in every layer
    step: Optional[Tuple[int, int]] = None  # this step's prompt tokens
    reg: Optional[Registration] = None
    failed: str = ""
    done: bool = False
    held: bool = False  # finished; its blocks held for its decode side
    sent: bool = False  # its decode side was told (``push_done``)
    deadline: float = float("inf")  # monotonic: no push after it (its grant runs out about then)


#: The most registrations one peer may have waiting for their request (of ``MAX_PENDING_REGS``).
MAX_PENDING_REGS_PER_PEER = MAX_PENDING_REGS // 4

#: The most notifications (``push_done``) waiting to be sent, in all and to one peer; more are
#: dropped and counted (``push_notes_dropped``): their grants end with their time.
MAX_NOTES = 1024
MAX_NOTES_PER_PEER = 64

#: How long a ``push_cancel`` waits for the request's push in flight before it answers ``ok: false``
#: (below the decode side's notification timeout).
CANCEL_WAIT_S = 2.0


class Pusher:
    """The prefill worker's half of push mode (see the module docstring)."""

    def __init__(self, worker) -> None:
        self.w = worker
        self.block_size = worker.block_size
        self._lock = threading.Lock()
        self.jobs: Dict[str, Job] = {}
        self._by_base: Dict[str, Set[str]] = {}  # base id -> the live requests of it
        self._inbox: List[Registration] = []
        self._pending: Dict[Tuple[str, str], List[Registration]] = {}  # by key: their request not here yet
        self._pending_order: "collections.deque[Registration]" = collections.deque()  # by ``until``
        self._waiting = 0  # live registrations (inbox and pending)
        self._waiting_of: Dict[int, int] = {}  # ... per peer
        self._meta = None  # the step's metadata begun (``begin``)
        self._step_jobs: List[Job] = []  # this step's jobs with a registration
        self._layer_index: Dict[str, int] = {}
        self._num_layers = 0
        self._saved = 0  # layers saved in this step
        self._queue: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._running: Optional[Job] = None  # whose push the push thread runs now
        self._ran = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="llm_datadist-push", daemon=True)
        self._thread.start()
        # notifications go on their own thread: a slow peer never holds up the steps' pushes
        self._notes: "queue.Queue[Optional[Tuple[int, Dict[str, Any]]]]" = queue.Queue(MAX_NOTES)
        self._notes_lock = threading.Lock()
        self._notes_of: Dict[int, int] = {}
        self._notifier = threading.Thread(target=self._send_notes, name="llm_datadist-push-notes", daemon=True)
        self._notifier.start()
        #: ``pushed_layers``: layers pushed (per request and step; a late push of all layers counts
        #: each), ``pushed_late``: pushes of all layers at once of tokens computed before their
        #: registration came, ``pushed_tokens``: prompt tokens pushed, counted once per layer (each
        #: layer of each token exactly once: layers x prompt tokens not cached on the decode side),
        #: ``push_regs``: registrations taken, ``push_regs_refused``: refused, ``push_notes_dropped``:
        #: notifications to decode workers dropped (too many waiting)
        self.stats = {"pushed_layers": 0, "pushed_blocks": 0, "pushed_tokens": 0, "pushed_requests": 0,
                      "push_failures": 0, "pushed_late": 0, "push_regs": 0, "push_regs_refused": 0,
                      "push_notes_dropped": 0}
        self._trace = Trace()
        self._device_sync: Optional[Callable[[], Any]] = None

    def set_layout(self, layer_index: Dict[str, int], device: Any) -> None:
        """Which registered tensor each attention layer's KV is (``layer name -> index``)."""
        self._layer_index = dict(layer_index)
        self._num_layers = len(self._layer_index)
        if getattr(device, "type", "cpu") != "cpu":
            import torch

            def event():  # the layer's KV is written on the current stream: pushed once that has run
                ev = torch.Event(device=device)
                ev.record()
                return ev.synchronize
            self._device_sync = event

    # -- the link's thread ---------------------------------------------------------------------------
    def on_reg(self, peer: int, message: Dict[str, Any]) -> Dict[str, Any]:
        """A decode worker's ``push_reg``: checked for form here, matched on the push thread."""
        d_id, r_id, blocks = message.get("decode_request_id"), message.get("request_id"), message.get("blocks")
        first, grant = message.get("first_block"), message.get("grant")
        if not (isinstance(d_id, str) and isinstance(r_id, str) and isinstance(grant, str)
                and isinstance(blocks, list) and len(blocks) <= MAX_REG_BLOCKS
                and all(type(b) is int and b >= 0 for b in blocks) and type(first) is int and first >= 0
                and utf8_len(d_id) <= MAX_RELEASE_ID_BYTES and utf8_len(r_id) <= MAX_RELEASE_ID_BYTES
                and len(grant) <= 64 and (grant or not blocks)):
            self._count("push_regs_refused")
            return {"accepted": False, "why": "a malformed registration"}
        with self._lock:
            if self._waiting >= MAX_PENDING_REGS or self._waiting_of.get(peer, 0) >= MAX_PENDING_REGS_PER_PEER:
                self.stats["push_regs_refused"] += 1
                return {"accepted": False, "why": "too many registrations are pending"}
            self._inbox.append(Registration(peer, d_id, r_id, list(blocks), first, grant,
                                            time.monotonic() + self.w.options.kv_lease_s))
            self._waiting += 1
            self._waiting_of[peer] = self._waiting_of.get(peer, 0) + 1
            self.stats["push_regs"] += 1
            first_in = len(self._inbox) == 1
        if first_in:  # (one task takes the whole inbox)
            self._queue.put(self._on_inbox)
        return {"accepted": True}

    def on_cancel(self, peer: int, message: Dict[str, Any]) -> Dict[str, Any]:
        """A decode worker's ``push_cancel`` (its request ended first, or its grant ran out): no
        more pushes for it. Answered once no push of it is in flight (``ok: false`` if one still
        is after ``CANCEL_WAIT_S``: the decode side then ends the link)."""
        d_id, grant = message.get("decode_request_id"), message.get("grant")
        if not isinstance(grant, str):
            return {"cancelled": False, "ok": True}
        with self._lock:
            found = None
            for job in self.jobs.values():
                reg = job.reg
                if reg is not None and reg.peer == peer and reg.decode_request_id == d_id and \
                        secrets.compare_digest(reg.grant, grant):
                    job.failed = job.failed or "its decode request ended first"
                    job.done = True  # (nothing to tell it)
                    self.w.leases.release(job.req_id)
                    found = job
                    break
            if found is None:
                for reg in self._inbox + [r for regs in self._pending.values() for r in regs]:
                    if reg.peer == peer and reg.decode_request_id == d_id:
                        self._settle(reg)
                        reg.blocks = []  # (it may wait in the expiry order a while yet)
                return {"cancelled": False, "ok": True}
        with self._ran:  # (its pushes queued skip it: ``failed``; one running is waited for)
            idle = self._ran.wait_for(lambda: self._running is not found, CANCEL_WAIT_S)
        if not idle:
            return {"cancelled": True, "ok": False, "why": f"a push of it was still running after {CANCEL_WAIT_S} s"}
        return {"cancelled": True, "ok": True}

    # -- vLLM's steps (the worker's main thread) ---------------------------------------------------------
    def begin(self, meta) -> None:
        """Take the step's metadata (once: from whichever of save_kv_layer, start_load_kv and
        wait_for_save comes first, as vLLM may start loads after the forward)."""
        if meta is None or meta is self._meta:
            return
        self._meta = meta
        with self._lock:
            for req_id in getattr(meta, "push_forget", ()):
                job = self.jobs.get(req_id)
                if job is not None and job.reg is not None:
                    self._fail(job, "the prefill request was aborted")  # its decode side hears it now
                self._drop(req_id)
            new: List[str] = []
            for req_id, step in getattr(meta, "push_steps", {}).items():
                job = self.jobs.get(req_id)
                if job is None:
                    job = self.jobs[req_id] = Job(req_id, computed=step.start)
                    self._by_base.setdefault(base_request_id(req_id), set()).add(req_id)
                    new.append(req_id)
                job.blocks, job.prompt_tokens = list(step.block_ids), step.prompt_tokens
                job.step = (step.start, step.end) if step.end > step.start else None
            for req_id in getattr(meta, "reqs_to_send", ()):
                job = self.jobs.get(req_id)
                if job is not None:
                    job.held = True  # finished: no step computes more of it; its blocks are held
            self._match_all(new)
            self._step_jobs = []
            self._saved = 0
            for job in list(self.jobs.values()):
                self._advance(job)
                if job.reg is not None and job.step is not None and not job.failed:
                    if job.step[0] != job.pushed:
                        self._fail(job, f"its prompt tokens from {job.pushed} were not computed before "
                                        f"{job.step[0]}")
                        continue
                    self._step_jobs.append(job)

    def _match_all(self, new: List[str]) -> None:
        """Under the lock: attach the registrations that came to their requests, and the pending
        ones to the requests ``new`` here; give up on those pending past their time."""
        now = time.monotonic()
        regs, self._inbox = self._inbox, []
        for reg in regs:
            if reg.live:
                self._match(reg, now)
        for req_id in new:
            for key in (("id", req_id), ("base", base_request_id(req_id))):
                for reg in self._pending.pop(key, ()):
                    if reg.live:
                        self._match(reg, now)
        while self._pending_order and (self._pending_order[0].until <= now or not self._pending_order[0].live):
            reg = self._pending_order.popleft()
            regs = self._pending.get(reg.key, [])
            if reg in regs:
                regs.remove(reg)
                if not regs:
                    del self._pending[reg.key]
            if reg.live:
                self._refuse(reg, "no such request here")

    def _advance(self, job: Job) -> None:
        """Under the lock: push what a registered request computed before (all layers at once),
        and finish one whose prompt is pushed whole and that no step is computing."""
        if job.reg is None or job.failed or job.done:
            return
        if time.monotonic() >= job.deadline:
            self._fail(job, f"it was not pushed within kv_lease_s ({self.w.options.kv_lease_s:.0f} s)")
            return
        if job.computed > job.pushed:
            self._submit(job, job.pushed, job.computed, None)
            job.pushed = job.computed
        if job.step is None and job.pushed >= job.prompt_tokens > 0:
            self._finish(job)

    def _on_inbox(self) -> None:
        """On the push thread, as registrations come: a request that finished (its blocks held,
        no step to wait for) is pushed now."""
        with self._lock:
            self._match_all([])
            for job in list(self.jobs.values()):
                if job.held and job.step is None:
                    self._advance(job)

    def _key(self, reg: Registration) -> Optional[Tuple[str, str]]:
        """Under the lock: which request a registration names (None: refused). By its lease token
        (with ``lease_tokens``; else its plain id), or without one by its decode request's base id
        where ``push_match_by_request_id`` lets it."""
        if reg.remote_request_id:
            if not self.w.options.lease_tokens:
                return ("id", reg.remote_request_id)
            checked = check_lease(self.w.leases.key, reg.remote_request_id)
            if checked is None:
                self._refuse(reg, "no valid lease token for this request")
                return None
            return ("id", checked[0])
        if not self.w.options.push_match_by_request_id:
            self._refuse(reg, "it names no request (remote_request_id) and this engine matches none by its id "
                              "(push_match_by_request_id is off)")
            return None
        return ("base", base_request_id(reg.decode_request_id))

    def _match(self, reg: Registration, now: float) -> None:
        if reg.key is None:
            reg.key = self._key(reg)
            if reg.key is None:
                return
        kind, name = reg.key
        if kind == "id":
            job = self.jobs.get(name)
        else:
            ids = self._by_base.get(name, set())
            if len(ids) > 1:  # (client-chosen ids that collide: neither is given away)
                self._refuse(reg, f"{len(ids)} requests here have its base id")
                return
            job = self.jobs[next(iter(ids))] if ids else None
        if job is None:
            if now < reg.until:
                self._pending.setdefault(reg.key, []).append(reg)  # its request has not reached this engine yet
                self._pending_order.append(reg)
            else:
                self._refuse(reg, "no such request here")
            return
        self._settle(reg)
        if job.reg is not None:
            self._refuse(reg, "another decode request registered for it first")
            return
        if not reg.blocks:  # nothing wanted: free what is held for it, if it named the request by its token
            if kind == "id":
                self._drop(job.req_id)
                self.w.leases.release(job.req_id)
            return  # (by its base id: its held blocks go when their lease runs out)
        total = -(-job.prompt_tokens // self.block_size)
        if reg.first_block > total or len(reg.blocks) != total - reg.first_block:
            self._refuse(reg, f"it names {len(reg.blocks)} blocks from block {reg.first_block}; the prompt has "
                              f"{total}")
            return
        job.reg = reg  # (blocks before ``first_block`` are cached there: ``_submit`` skips them)
        job.deadline = reg.until  # (its grant, made before it was sent, runs out about then)

    def _settle(self, reg: Registration) -> None:
        """Under the lock: a registration no longer waits (matched, refused, cancelled)."""
        if reg.live:
            reg.live = False
            self._waiting -= 1
            left = self._waiting_of.get(reg.peer, 0) - 1
            if left > 0:
                self._waiting_of[reg.peer] = left
            else:
                self._waiting_of.pop(reg.peer, None)

    def save_layer(self, layer_name: str) -> None:
        if not self._step_jobs:
            return
        index = self._layer_index.get(layer_name)
        if index is None:
            return
        t = time.time()
        sync = self._device_sync() if self._device_sync is not None else None
        self._saved += 1
        last = self._saved == self._num_layers  # the step's last layer: the prompt's KV may be whole now
        for job in self._step_jobs:
            self._submit(job, job.step[0], job.step[1], index, sync, t)
            if last and job.step[1] >= job.prompt_tokens:
                with self._lock:
                    self._finish(job)  # (after its pushes, before the step's end: the decode side starts sooner)

    def wait(self) -> None:
        """The step's pushes are done (``wait_for_save``); requests whose prompt is whole are
        reported to their decode side."""
        jobs, self._step_jobs = self._step_jobs, []
        self._queue.join()
        with self._lock:
            for job in jobs:
                if not job.failed:
                    job.pushed = job.step[1]
            for job in self.jobs.values():
                if job.step is not None:
                    job.computed = max(job.computed, job.step[1])
                job.step = None
            for job in jobs:
                if job.failed or job.pushed >= job.prompt_tokens:
                    self._finish(job)  # (told on the push thread; the blocks stay held until then)

    def forget(self, req_ids: Set[str]) -> None:
        """Requests whose held blocks were freed (``finished_sending``). One freed before its push
        ended (its lease ran out, the engine began to stop) fails, and its pushes in flight are
        waited for, so that none reads a block vLLM is about to reuse."""
        wait = False
        with self._lock:
            for req_id in req_ids:
                job = self.jobs.get(req_id)
                if job is not None and job.reg is not None and not job.sent:
                    job.failed = job.failed or "its blocks were freed before its push ended"
                    self._finish(job)
                    wait = True
                self._drop(req_id)
        if wait:
            self._queue.join()

    # -- the work -----------------------------------------------------------------------------------
    def _submit(self, job: Job, start: int, end: int, layer: Optional[int], sync=None, t_compute=None) -> None:
        """Push the blocks of prompt tokens ``[start, end)`` of one layer (None: all) on the push thread."""
        reg = job.reg
        bs = self.block_size
        first, last = max(start // bs, reg.first_block), -(-end // bs)
        if last <= first:
            return
        tokens = end - max(start, reg.first_block * bs)
        src = job.blocks[first:last]
        dst = reg.blocks[first - reg.first_block:last - reg.first_block]
        if len(src) != last - first:
            self._fail(job, f"the prefill side knows {len(job.blocks)} of its blocks, {last} needed")
            return
        key = ld.BlocksCacheKey(reg.peer, 0)

        def push() -> None:
            with self._ran:  # (``on_cancel`` sets ``failed`` first, then waits for ``_running``)
                if job.failed:
                    return
                if time.monotonic() >= job.deadline:
                    job.failed = f"it was not pushed within kv_lease_s ({self.w.options.kv_lease_s:.0f} s)"
                    return
                self._running = job
            try:
                if sync is not None:
                    sync()
                if layer is None:
                    self.w.cm.push_blocks(key, self.w.caches[0], src, dst)
                    layers = len(self.w._keep)
                else:
                    lr = range(layer, layer + 1)
                    self.w.cm.push_blocks(key, self.w.caches[0], src, dst, lr, lr, 1)
                    layers = 1
            except Exception as exc:  # noqa: BLE001 - reported to the decode side (push_done)
                job.failed = job.failed or f"{type(exc).__name__}: {exc}"
                return
            finally:
                with self._ran:
                    self._running = None
                    self._ran.notify_all()
            with self._lock:
                self.stats["pushed_layers"] += layers
                self.stats["pushed_blocks"] += len(src) * layers
                self.stats["pushed_late"] += layer is None
                self.stats["pushed_tokens"] += tokens * layers
            if t_compute is not None:
                self._trace.write({"event": "layer", "request": job.req_id, "layer": layer, "computed": t_compute,
                                   "pushed": time.time()})
        self._queue.put(push)

    def _finish(self, job: Job) -> None:
        """After the pushes queued so far: tell the decode side, free the held blocks."""
        if job.done:
            return
        job.done = True
        reg = job.reg

        def done() -> None:
            job.sent = True
            ok = not job.failed
            self._note(reg.peer, {"op": "push_done", "decode_request_id": reg.decode_request_id, "grant": reg.grant,
                                  "ok": ok, "why": job.failed[:200]})
            with self._lock:
                self.stats["pushed_requests" if ok else "push_failures"] += 1
            self._trace.write({"event": "done", "request": job.req_id, "t": time.time(), "ok": ok})
            if not ok:
                logger.error("request %s: pushing its KV to cluster %d failed: %s", job.req_id, reg.peer, job.failed)
            self.w.leases.release(job.req_id)
        self._queue.put(done)

    def _fail(self, job: Job, why: str) -> None:
        job.failed = job.failed or why
        self._finish(job)

    def _refuse(self, reg: Registration, why: str) -> None:
        """Under the lock: a registration refused (its decode side hears it, on the notifier's thread)."""
        self._settle(reg)
        reg.blocks = []  # (it may wait in the expiry order a while yet)
        self.stats["push_regs_refused"] += 1
        logger.warning("llm_datadist: refused cluster %d's registration of request %s: %s", reg.peer,
                       reg.decode_request_id, why)
        if reg.grant:
            self._note(reg.peer, {"op": "push_done", "decode_request_id": reg.decode_request_id, "grant": reg.grant,
                                  "ok": False, "why": why})

    def _note(self, peer: int, message: Dict[str, Any]) -> None:
        """Queue a notification for the notifier's thread; dropped (and counted) past the caps."""
        with self._notes_lock:
            if self._notes_of.get(peer, 0) < MAX_NOTES_PER_PEER:
                try:
                    self._notes.put_nowait((peer, message))
                except queue.Full:
                    pass
                else:
                    self._notes_of[peer] = self._notes_of.get(peer, 0) + 1
                    return
            self.stats["push_notes_dropped"] += 1
        logger.warning("llm_datadist: dropped a notification to cluster %d (too many waiting); its grant ends with "
                       "its time", peer)

    def _send_notes(self) -> None:
        while True:
            item = self._notes.get()
            try:
                if item is None:
                    return
                peer, message = item
                try:
                    self.w._links_api.notify(peer, message, 5000)
                except Exception as exc:  # noqa: BLE001 - its grant ends with its time
                    logger.error("could not tell cluster %d about request %s: %s", peer,
                                 message.get("decode_request_id"), exc)
                finally:
                    with self._notes_lock:
                        left = self._notes_of.get(peer, 0) - 1
                        if left > 0:
                            self._notes_of[peer] = left
                        else:
                            self._notes_of.pop(peer, None)
            finally:
                self._notes.task_done()

    def _drop(self, req_id: str) -> None:
        job = self.jobs.pop(req_id, None)
        if job is not None:
            ids = self._by_base.get(base_request_id(req_id))
            if ids is not None:
                ids.discard(req_id)
                if not ids:
                    del self._by_base[base_request_id(req_id)]

    def _count(self, name: str) -> None:
        with self._lock:
            self.stats[name] += 1

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            try:
                if task is None:
                    return
                task()
            except Exception:  # noqa: BLE001 - one task's failure is its own
                logger.exception("llm_datadist: a push task failed")
            finally:
                self._queue.task_done()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10)
        try:
            self._notes.put(None, timeout=5)
        except queue.Full:
            return
        self._notifier.join(10)


class Trace:
    """Push timings for the benchmark (``TRACE_ENV``); a no-op when it is unset."""

    def __init__(self) -> None:
        path = os.environ.get(TRACE_ENV)
        self._path = f"{path}.{os.getpid()}" if path else None
        self._lock = threading.Lock()

    def write(self, record: Dict[str, Any]) -> None:
        if self._path is None:
            return
        with self._lock, open(self._path, "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")


# -- the scheduler side -------------------------------------------------------------------------------

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
