"""The decode side's prefill peers: one link per prefill worker address, made on first use and
kept while used; each peer's own threads for its pulls; a memory of peers that could not be
reached; and the renewal of the leases of requests parked in vLLM's queue.

A peer is a prefill worker's ``remote_host:remote_port``. Its cluster id is the one the link's
handshake found there (``Engine.link_address``): a router that forwards no
``remote_cluster_id`` works, and a request that names one the address no longer has (the
prefill engine restarted there) is not pulled from the newcomer.

- Pulls and releases of a peer run on threads of that peer (at most ``PEER_THREADS`` at once,
  started when work comes and ended when it is done): a dead peer holds up only its own requests.
- A peer that could not be linked is not tried again for ``retry_s`` (``link_timeout_ms``): its
  queued and new requests fail at once, so that settling a dead peer's requests takes about one
  link timeout in all, not one each.
- A peer with no work and no parked request for ``link_idle_s`` is unlinked and forgotten.
- Requests parked in vLLM's queue (waiting for a free slot, so not yet pulled) have their prefill
  leases renewed: each about every third of the prefill side's lease, in ``renew`` notifications
  over the link that carry many requests of one peer (each with its lease token, at most
  ``RENEW_BATCH_BYTES`` a notification).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import llm_datadist as ld
from llm_datadist.integrations.vllm.meta import Recv
from llm_datadist.integrations.vllm.options import Options

logger = logging.getLogger(__package__)

#: Threads one peer's pulls and releases may use at once.
PEER_THREADS = 2
#: Most request ids' JSON in one renewal: below the links' smallest sensible message budget
#: (``LLM_DATADIST_MAX_MESSAGE_BYTES``, 64 KiB by default), with the reply's room besides.
RENEW_BATCH_BYTES = 16 << 10
#: How often the renewal and eviction thread looks at the peers.
TICK_S = 0.25
#: Shortest interval between two renewals of one request.
MIN_RENEW_S = 0.2

#: Statuses of a transfer or notification that mean the link itself is gone.
LINK_BROKEN = (ld.LLMStatusCode.LLM_LINK_FAILED, ld.LLMStatusCode.LLM_NOT_YET_LINK, ld.LLMStatusCode.LLM_TIMEOUT)


class Unreachable(Exception):
    """No working link to a prefill worker could be had; ``timed_out``: a link that was made did
    not answer within its bound (``LLM_TIMEOUT``), rather than being refused or broken."""

    def __init__(self, why: str, timed_out: bool = False) -> None:
        super().__init__(why)
        self.timed_out = timed_out


@dataclass
class Parked:
    """A request waiting in vLLM's queue whose prefill lease this side renews."""

    spec: Recv
    due: float  # monotonic time of its next renewal


@dataclass
class PrefillLink:
    """The decode worker's link to one prefill worker address (``remote_host:remote_port``) and
    what this side keeps about it: the link (made on first use and again after it broke;
    ``generation`` 0 while there is none), its queued work, its parked requests and renewals."""

    host: str
    port: int
    cluster_id: Optional[int] = None  # the one the current (or last) link found there
    generation: int = 0  # of the current link; 0: none
    gate: threading.Lock = field(default_factory=threading.Lock)  # one link attempt at a time
    unreachable_until: float = 0.0
    why: str = ""
    queue: Deque[Callable[[], None]] = field(default_factory=deque)
    running: int = 0
    last_used: float = field(default_factory=time.monotonic)
    parked: Dict[str, Parked] = field(default_factory=dict)
    renewing: bool = False
    lease_s: Optional[float] = None  # the prefill side's lease, as its renewal answers say
    incompatible: Optional[str] = None  # why the current link's peer's KV is refused (``hello``)

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port}"


class Peers:
    """The decode side's table of prefill peers (thread-safe)."""

    def __init__(self, dd: ld.LLMDataDist, options: Options, count: Callable[[str, int], None],
                 hello: Optional[Callable[[int, str], Optional[str]]] = None,
                 link_failed: Callable[[], None] = lambda: None) -> None:
        self.dd = dd
        self.options = options
        self._count = count
        # once per link made: why the peer's KV is refused, or None (the compatibility exchange)
        self._hello = hello
        self._link_failed = link_failed  # counts a failed link attempt or a link that broke
        self.links_api = dd.engine
        self.retry_s = max(1.0, options.link_timeout_ms / 1000)
        self.notify_timeout_ms = min(options.link_timeout_ms, 5000)
        self._lock = threading.Lock()
        self._peers: Dict[Tuple[str, int], PrefillLink] = {}
        self._parked: Dict[str, List[PrefillLink]] = {}  # our request id -> the peers holding its leases
        self._threads: List[threading.Thread] = []
        self._closed = False
        self._generation = 0
        self._wake = threading.Event()
        self._ticker: Optional[threading.Thread] = None

    # -- work on a peer's threads -------------------------------------------------------------------
    def peer(self, spec: Recv) -> PrefillLink:
        key = (spec.host, spec.port)
        with self._lock:
            peer = self._peers.get(key)
            if peer is None:
                peer = self._peers[key] = PrefillLink(spec.host, spec.port)
            return peer

    def submit(self, spec: Recv, task: Callable[[], None]) -> bool:
        """Run ``task()`` (which reports its own failures) on a thread of the spec's peer; False
        once closing."""
        peer = self.peer(spec)
        with self._lock:
            if self._closed:
                return False
            peer.queue.append(task)
            peer.last_used = time.monotonic()
            self._start_ticker()
            if peer.running >= PEER_THREADS:
                return True
            peer.running += 1
            self._start(self._drain, peer, f"llm_datadist-vllm-pull-{peer.name}")
        return True

    def _start(self, target: Callable[..., None], peer: PrefillLink, name: str) -> None:
        """A thread for ``target(peer)`` (lock held)."""
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=target, args=(peer,), name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _drain(self, peer: PrefillLink) -> None:
        while True:
            with self._lock:
                if not peer.queue or self._closed:
                    peer.running -= 1
                    peer.last_used = time.monotonic()
                    return
                task = peer.queue.popleft()
            try:
                task()
            except Exception:  # noqa: BLE001 - a task reports its own failures; this thread goes on
                logger.exception("llm_datadist: a transfer task for %s failed", peer.name)

    # -- links --------------------------------------------------------------------------------------
    def on_link(self, spec: Recv, action: Callable[[int], Any]) -> Any:
        """``action(cluster id)`` with a link to the spec's prefill worker in place; a link kept
        from earlier that turns out broken (the peer restarted?) is made anew once.
        ``Unreachable`` if no working link to the cluster the spec names can be had."""
        peer = self.peer(spec)
        for attempt in range(2):
            cluster_id, generation, fresh = self._link(peer)
            if spec.cluster_id is not None and spec.cluster_id != cluster_id:
                raise Unreachable(f"the prefill engine there is now cluster {cluster_id}, not cluster "
                                  f"{spec.cluster_id} (it restarted?)")
            try:
                return action(cluster_id)
            except ld.LLMException as exc:
                if exc.status_code not in LINK_BROKEN:
                    raise
                self._forget_link(peer, generation)
                if fresh or attempt:
                    self._mark_unreachable(peer, f"the link failed: {exc.status_code.name}")
                    raise Unreachable(f"the link failed: {exc.status_code.name}",
                                      exc.status_code == ld.LLMStatusCode.LLM_TIMEOUT) from None
        raise AssertionError("unreachable")

    def _link(self, peer: PrefillLink) -> Tuple[int, int, bool]:
        """``(cluster id, generation of the link, whether it was made now)``; ``Unreachable`` if
        the prefill worker refuses or does not answer, or did so less than ``retry_s`` ago."""
        with peer.gate:
            if peer.generation:
                return peer.cluster_id, peer.generation, False
            left = peer.unreachable_until - time.monotonic()
            if left > 0:
                raise Unreachable(f"{peer.why}; not tried again for another {left:.1f} s")
            try:
                address = socket.gethostbyname(peer.host)  # the library takes dotted IPv4 addresses
                status, cluster_id = self.links_api.link_address(address, peer.port, self.options.link_timeout_ms)
            except (ld.LLMException, OSError, ValueError, UnicodeError) as exc:  # a name that does not resolve...
                status, cluster_id = None, None
                why = f"{type(exc).__name__}: {exc}"
            else:
                why = f"linking failed: {status.name}"
            if status not in (ld.LLMStatusCode.LLM_SUCCESS, ld.LLMStatusCode.LLM_ALREADY_LINK) or cluster_id is None:
                self._mark_unreachable(peer, why)
                raise Unreachable(why)
            incompatible = None
            if self._hello is not None:
                try:
                    incompatible = self._hello(cluster_id, peer.name)
                except ld.LLMException as exc:  # the link broke during the exchange
                    self._unlink(cluster_id, force=True)
                    why = f"the compatibility exchange failed: {exc.status_code.name}"
                    self._mark_unreachable(peer, why)
                    raise Unreachable(why) from None
            with self._lock:
                self._generation += 1
                peer.generation, peer.cluster_id = self._generation, cluster_id
                peer.unreachable_until, peer.why = 0.0, ""
                peer.incompatible = incompatible
            self._count("links", 1)
            return cluster_id, peer.generation, True

    def _mark_unreachable(self, peer: PrefillLink, why: str) -> None:
        self._link_failed()
        with self._lock:
            peer.unreachable_until = time.monotonic() + self.retry_s
            peer.why = why

    def _forget_link(self, peer: PrefillLink, generation: int) -> None:
        """Drop the link that failed — not one another thread has made since."""
        with peer.gate:
            if peer.generation != generation:
                return
            peer.generation = 0
            self._unlink(peer.cluster_id, force=True)

    def _unlink(self, cluster_id: int, force: bool) -> None:
        info = ld.LLMClusterInfo()
        info.remote_cluster_id = cluster_id
        try:
            self.dd.unlink_clusters([info], 1000, force=force)
        except ld.LLMException as exc:  # finalized meanwhile...
            logger.debug("llm_datadist: unlinking cluster %d: %s", cluster_id, exc)

    # -- parked requests and their renewals ---------------------------------------------------------
    def park(self, req_id: str, specs: Sequence[Recv]) -> None:
        """Renew the leases of ``req_id`` (waiting in vLLM's queue) at each prefill rank of
        ``specs`` (those this rank will pull from or release) until ``unpark``; the first renewals
        go out at once. Parking a request again replaces its ranks."""
        peers = [(self.peer(spec), spec) for spec in specs]
        with self._lock:
            if self._closed:
                return
            for old in self._parked.pop(req_id, ()):
                old.parked.pop(req_id, None)
            now = time.monotonic()
            self._parked[req_id] = [peer for peer, _ in peers]
            for peer, spec in peers:
                peer.parked[req_id] = Parked(spec, now)
            self._start_ticker()
        self._wake.set()

    def _start_ticker(self) -> None:
        """The thread of renewals and evictions, from the first work on (lock held)."""
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick_loop, name="llm_datadist-vllm-peers", daemon=True)
            self._ticker.start()

    def unpark(self, req_id: str) -> None:
        with self._lock:
            for peer in self._parked.pop(req_id, ()):
                peer.parked.pop(req_id, None)
                peer.last_used = time.monotonic()

    @property
    def parked(self) -> int:
        with self._lock:
            return len(self._parked)

    def _tick_loop(self) -> None:
        while True:
            self._wake.wait(TICK_S)
            self._wake.clear()
            with self._lock:
                if self._closed:
                    return
            try:
                self.tick(time.monotonic())
            except Exception:  # noqa: BLE001 - the loop must go on
                logger.exception("llm_datadist: renewing leases failed")

    def tick(self, now: float) -> None:
        """Send the renewals that are due (one thread per peer at a time) and evict idle peers."""
        idle: List[PrefillLink] = []
        with self._lock:
            for key, peer in list(self._peers.items()):
                if peer.parked and not peer.renewing:
                    interval = self._interval(peer)
                    # what is due, and what would be within a sixth of a lease: renewed together
                    due = [(req_id, p) for req_id, p in peer.parked.items() if p.due <= now + interval / 2]
                    if any(p.due <= now for _, p in due):
                        peer.renewing = True
                        self._start(lambda pr, batch=due: self._renew(pr, batch), peer,
                                    f"llm_datadist-vllm-renew-{peer.name}")
                if not peer.parked and not peer.queue and not peer.running and not peer.renewing and \
                        now - peer.last_used > self.options.link_idle_s:
                    del self._peers[key]
                    idle.append(peer)
        for peer in idle:
            with peer.gate:
                if peer.generation:
                    peer.generation = 0
                    logger.info("llm_datadist: unlinking the prefill engine at %s (cluster %s): idle for %.0f s",
                                peer.name, peer.cluster_id, self.options.link_idle_s)
                    self._unlink(peer.cluster_id, force=False)
                    self._count("links_evicted", 1)

    def _interval(self, peer: PrefillLink) -> float:
        lease = peer.lease_s if peer.lease_s is not None else self.options.kv_lease_s
        return max(MIN_RENEW_S, lease / 3)

    def _renew(self, peer: PrefillLink, due: List[Tuple[str, Parked]]) -> None:
        """Renew ``due`` leases at ``peer``, in notifications of at most ``RENEW_BATCH_BYTES``."""
        try:
            batch: List[Tuple[str, Parked]] = []
            size = 0
            for item in due:
                cost = len(json.dumps(item[1].spec.remote_request_id)) + 1
                if batch and size + cost > RENEW_BATCH_BYTES:
                    self._renew_batch(peer, batch)
                    batch, size = [], 0
                batch.append(item)
                size += cost
            if batch:
                self._renew_batch(peer, batch)
        finally:
            with self._lock:
                peer.renewing = False

    def _renew_batch(self, peer: PrefillLink, batch: List[Tuple[str, Parked]]) -> None:
        ids = [parked.spec.remote_request_id for _, parked in batch]
        message = {"op": "renew", "request_ids": ids}
        try:
            # (whichever cluster is there now: a restarted one refuses the old tokens)
            anyone = Recv([], [], peer.host, peer.port, None, "")
            reply = self.on_link(anyone, lambda cluster_id: self.links_api.notify(cluster_id, message,
                                                                               self.notify_timeout_ms))
            renewed, refused, lease_s = read_renew_reply(reply, len(ids))
        except (Unreachable, ld.LLMException, ValueError) as exc:
            # Tried again at the next interval (an unreachable peer: when it may be tried again);
            # the pull itself will say what became of the request.
            logger.debug("llm_datadist: renewing %d lease(s) at %s failed: %s", len(ids), peer.name, exc)
            self._count("renew_failed", len(ids))
            renewed, refused, lease_s = 0, {}, None
        now = time.monotonic()
        with self._lock:
            if lease_s is not None:
                peer.lease_s = lease_s
            interval = self._interval(peer)
            for _, parked in batch:
                parked.due = now + interval
        self._count("renewed", renewed)
        if refused:
            self._count("renew_refused", len(refused))
            first = next(iter(refused.items()))
            logger.warning("llm_datadist: %s refused to renew %d lease(s) (request %s: %s); those requests will "
                           "find their blocks gone", peer.name, len(refused), batch[first[0]][0], first[1])
            with self._lock:  # renewing them again would be refused again
                for index in refused:
                    req_id = batch[index][0]
                    peers = self._parked.get(req_id, [])
                    if peer in peers:
                        peers.remove(peer)
                        peer.parked.pop(req_id, None)
                        if not peers:
                            del self._parked[req_id]

    # -- life cycle ---------------------------------------------------------------------------------
    def close(self, timeout_s: float = 30.0) -> None:
        """Stop: queued work is dropped, running work is waited for (up to ``timeout_s``)."""
        with self._lock:
            self._closed = True
            for peer in self._peers.values():
                peer.queue.clear()
            threads = list(self._threads) + ([self._ticker] if self._ticker is not None else [])
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def read_renew_reply(reply: Any, count: int) -> Tuple[int, Dict[int, str], Optional[float]]:
    """``(renewed, {index: why refused}, the prefill side's lease in seconds or None)`` of a
    renewal's answer; ValueError if it is malformed (it comes from a peer)."""
    if not isinstance(reply, dict):
        raise ValueError("a malformed answer")
    renewed, refused, lease_s = reply.get("renewed"), reply.get("refused"), reply.get("lease_s")
    if isinstance(renewed, bool) or not isinstance(renewed, int) or not isinstance(refused, list):
        raise ValueError("a malformed answer")
    why: Dict[int, str] = {}
    for item in refused[:count]:
        if isinstance(item, list) and len(item) == 2 and isinstance(item[0], int) and 0 <= item[0] < count:
            why[item[0]] = str(item[1])[:64]
    if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not 0 < lease_s < 1e7:
        lease_s = None
    return max(0, min(renewed, count)), why, lease_s
