"""The decode worker's half of push mode: ``GrantBook`` records which prefill peer may write which
blocks (the engine's write guard), and ``Receiver`` registers a request's blocks with its prefill
worker under a grant and reports the request when that worker says it pushed them
(docs/design.md §9)."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

from llm_datadist.integrations.vllm.metrics import KINDS, failure_kind
from llm_datadist.integrations.vllm.push.specs import PushReg
from llm_datadist.integrations.vllm.push.trace import Trace

logger = logging.getLogger("llm_datadist.integrations.vllm")  # (the connector's one logger)

#: How long ending a grant waits for the peer's pushes through the server that passed the guard
#: before (``engine.quiesce_writes``; past it their connections are shut).
QUIESCE_S = 2.0


@dataclass
class Grant:
    """One request's write grant: ``peer`` (the cluster id of the prefill engine's link) may write
    ``ranges`` (``(address, nbytes)`` of every registered tensor) until ``deadline``; its
    ``push_done`` names ``token``."""

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
                self._end(req_id, False, "this engine is shutting down", kind="transfer_failed")
        for req_id, grant in self.grants.take_expired(time.monotonic()).items():
            with self._lock:
                reg = self._awaiting.pop(req_id, None)
                if reg is not None:
                    self._cancelling[req_id] = reg
            if reg is not None:
                self._stop(req_id, reg, grant,
                           f"its prefill engine did not push it within {self.w.options.kv_lease_s:.0f} s", False,
                           kind="timed_out")

    def _stop(self, req_id: str, reg: PushReg, grant: Optional[Grant], why: str, cancel: bool,
              kind: str = "transfer_failed") -> None:
        """A request whose grant ended here before its push did: the prefill worker is told
        (``push_cancel``, on the peer's thread), then it is reported."""
        if grant is None or not self.w.peers.submit(reg.as_recv(),
                                                     lambda: self._cancel(req_id, grant, why, cancel, kind)):
            self._end(req_id, False, why, cancel=cancel, peer=grant.peer if grant is not None else None, kind=kind)

    def _cancel(self, req_id: str, grant: Grant, why: str, cancel: bool, kind: str = "transfer_failed") -> None:
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
        self._end(req_id, False, why, cancel=cancel, peer=grant.peer, kind=kind)

    def _register(self, req_id: str, reg: PushReg) -> None:
        """On the peer's thread: link, grant, register; a refusal fails the request."""
        try:
            why, kind = self.w.peers.on_link(reg.as_recv(),
                                             lambda cluster_id: self._register_on(req_id, reg, cluster_id))
        except Exception as exc:  # noqa: BLE001 - the request must end whatever happens
            why, kind = f"{type(exc).__name__}: {exc}", failure_kind(exc)
        if why:
            self._end(req_id, False, why, kind=kind)

    def _register_on(self, req_id: str, reg: PushReg, cluster_id: int) -> Tuple[str, str]:
        """``("", "")`` once registered, else why not and the failure's kind (``metrics.KINDS``)."""
        incompatible = self.w.peers.peer(reg.as_recv()).incompatible
        if incompatible and reg.awaiting:
            return f"the prefill engine's KV is incompatible: {incompatible}", "incompatible_peer"
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
            return (f"the prefill engine refused the registration: {str(why or 'it does not push (pull mode?)')[:200]}",
                    "guard_refused" if isinstance(reply, dict) else "transfer_failed")
        if token:
            self._count("push_registered")
        return "", ""

    def on_notify(self, peer: int, message: Any) -> Dict[str, Any]:
        """A prefill worker's ``push_done`` (on the link's thread)."""
        if not isinstance(message, dict) or message.get("op") != "push_done":
            return {"ok": False, "why": "this decode worker takes only push_done notifications"}
        req_id = message.get("decode_request_id")
        if not isinstance(req_id, str) or self.grants.finish(peer, req_id, message.get("grant")) is None:
            self._count("push_refused_done")
            self.w.recorder.fail("guard_refused")
            logger.warning("llm_datadist: cluster %d said it pushed a request it holds no grant of; ignored", peer)
            return {"ok": False, "why": "no such grant"}
        ok = message.get("ok") is True
        self._trace.write({"event": "ready", "request": req_id, "t": time.time(), "ok": ok})
        # (the kind the prefill side names, if it is one: an older one names none)
        kind = message.get("kind") if message.get("kind") in KINDS else "transfer_failed"
        self._end(req_id, ok, "" if ok else f"the prefill engine failed to push it: {str(message.get('why'))[:200]}",
                  peer=peer, kind=kind)
        return {"ok": True}

    def _end(self, req_id: str, ok: bool, why: str, cancel: bool = False, peer: Optional[int] = None,
             kind: str = "transfer_failed") -> None:
        """Report a request (its grant ended first: no push of the granted peer that passed the
        guard before is still writing when vLLM hears of it, ``engine.quiesce_writes``); a failure
        not cancelled here counts as ``kind`` (``metrics.KINDS``)."""
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
            ok, why, kind = False, why or "a push was still writing when its grant ended", "timed_out"
        with self._lock:
            self._recved.add(req_id)
            if not ok:
                self._failed.add(req_id)
        self._count("push_received" if ok else "push_failed")
        if not ok and not cancel:
            logger.error("request %s: its KV was not pushed: %s; reporting it as not loaded", req_id, why)
            self.w.recorder.count("failed_pulls")
            self.w.recorder.fail(kind)
        # (a push's samples are the prefill side's, which moves the bytes: ``Pusher``)

    def take(self) -> Tuple[Set[str], Set[str]]:
        with self._lock:
            out = (self._recved, self._failed)
            self._recved, self._failed = set(), set()
        return out

    def _count(self, name: str) -> None:
        with self._lock:
            self.stats[name] += 1

