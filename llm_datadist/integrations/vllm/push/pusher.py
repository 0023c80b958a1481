"""The prefill worker's half of push mode: ``Pusher`` matches the registrations of decode workers
to its requests and pushes each layer's blocks of the prompt tokens a step computes, on its push
thread, to the blocks the decode side granted (docs/design.md §9)."""

from __future__ import annotations

import collections
import logging
import queue
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import llm_datadist as ld
from llm_datadist.integrations.vllm.leases import MAX_RELEASE_ID_BYTES, check_lease, utf8_len
from llm_datadist.integrations.vllm.metrics import failure_kind
from llm_datadist.integrations.vllm.push.trace import Trace

logger = logging.getLogger("llm_datadist.integrations.vllm")  # (the connector's one logger)

#: The most registrations a prefill worker keeps waiting for their request (from all peers).
MAX_PENDING_REGS = 4096

#: The most block ids one registration may name.
MAX_REG_BLOCKS = 1 << 20

_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def base_request_id(req_id: str) -> str:
    """vLLM's request id without the ``-<8 hex>`` it appends to the API's id."""
    return _SUFFIX.sub("", req_id)


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
    kind: str = ""  # the failure's kind (``metrics.KINDS``), told to the decode side with ``push_done``
    seconds: float = 0.0  # spent in its pushes (vLLM's ``push_seconds``)
    nbytes: int = 0  # pushed, every layer
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
    """The prefill worker's half of push mode (see the module's docstring)."""

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
            self.w.recorder.fail("guard_refused")
            return {"accepted": False, "why": "a malformed registration"}
        with self._lock:
            if self._waiting >= MAX_PENDING_REGS or self._waiting_of.get(peer, 0) >= MAX_PENDING_REGS_PER_PEER:
                self.stats["push_regs_refused"] += 1
                self.w.recorder.fail("guard_refused")
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
                self._refuse(reg, "no such request here", "timed_out")

    def _advance(self, job: Job) -> None:
        """Under the lock: push what a registered request computed before (all layers at once),
        and finish one whose prompt is pushed whole and that no step is computing."""
        if job.reg is None or job.failed or job.done:
            return
        if time.monotonic() >= job.deadline:
            self._fail(job, f"it was not pushed within kv_lease_s ({self.w.options.kv_lease_s:.0f} s)", "timed_out")
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
                self._refuse(reg, "no such request here", "timed_out")
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
                    self._fail(job, "its blocks were freed before its push ended", "lease_expired")
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
                    if not job.failed:
                        job.failed = f"it was not pushed within kv_lease_s ({self.w.options.kv_lease_s:.0f} s)"
                        job.kind = "timed_out"
                    return
                self._running = job
            try:
                if sync is not None:
                    sync()
                start = time.perf_counter()
                if layer is None:
                    self.w.cm.push_blocks(key, self.w.caches[0], src, dst)
                    layers = len(self.w._keep)
                else:
                    lr = range(layer, layer + 1)
                    self.w.cm.push_blocks(key, self.w.caches[0], src, dst, lr, lr, 1)
                    layers = 1
            except Exception as exc:  # noqa: BLE001 - reported to the decode side (push_done)
                if not job.failed:
                    job.failed, job.kind = f"{type(exc).__name__}: {exc}", failure_kind(exc)
                return
            finally:
                with self._ran:
                    self._running = None
                    self._ran.notify_all()
            # (the one cache's layers are alike: ``Worker.register``)
            job.seconds += time.perf_counter() - start
            job.nbytes += len(src) * layers * (self.w._block_bytes // max(1, len(self.w._keep)))
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
            kind = job.kind or "transfer_failed"
            self._note(reg.peer, {"op": "push_done", "decode_request_id": reg.decode_request_id, "grant": reg.grant,
                                  "ok": ok, "why": job.failed[:200], **({} if ok else {"kind": kind})})
            with self._lock:
                self.stats["pushed_requests" if ok else "push_failures"] += 1
            if ok:  # (every registered block was pushed)
                self.w.recorder.transfer("push", job.seconds, len(reg.blocks), job.nbytes)
            else:
                self.w.recorder.fail(kind)
            self._trace.write({"event": "done", "request": job.req_id, "t": time.time(), "ok": ok})
            if not ok:
                logger.error("request %s: pushing its KV to cluster %d failed: %s", job.req_id, reg.peer, job.failed)
            self.w.leases.release(job.req_id)
        self._queue.put(done)

    def _fail(self, job: Job, why: str, kind: str = "transfer_failed") -> None:
        if not job.failed:
            job.failed, job.kind = why, kind
        self._finish(job)

    def _refuse(self, reg: Registration, why: str, kind: str = "guard_refused") -> None:
        """Under the lock: a registration refused (its decode side hears it, on the notifier's
        thread); counted as ``kind`` (``metrics.KINDS``)."""
        self._settle(reg)
        reg.blocks = []  # (it may wait in the expiry order a while yet)
        self.stats["push_regs_refused"] += 1
        self.w.recorder.fail(kind)
        logger.warning("llm_datadist: refused cluster %d's registration of request %s: %s", reg.peer,
                       reg.decode_request_id, why)
        if reg.grant:
            self._note(reg.peer, {"op": "push_done", "decode_request_id": reg.decode_request_id, "grant": reg.grant,
                                  "ok": False, "why": why, "kind": kind})

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
                    self.w.recorder.fail(failure_kind(exc))
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

