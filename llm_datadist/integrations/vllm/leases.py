"""Lease tokens and the prefill side's lease book.

A prefill engine hands a finished request's blocks to one decode side: ``remote_request_id`` is
``"<request id>.<lease token>"`` and only a release naming it so frees the blocks, and only a
renewal naming it so extends the lease (a decode side whose request waits in its queue renews it
every third of a lease). The book keeps the leases, the releases that came before their lease
and the requests already freed, within a byte budget, and ages the records out; a renewal keeps
no record. It is also the engine's read guard: a pull over a server-mediated plane (``tcp``,
``staging``) tagged with ``remote_request_id`` reads only the blocks leased for that request,
while the lease lasts (``read_guard``). It also answers a decode side whose ``kv_transfer_params``
lost ``remote_ranks`` (a router that forwards only NIXL's fields) with every rank's address and
release id, checked like a release (``on_ranks``: rank 0 of an engine with tensor parallelism)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Set, Tuple, Union

from llm_datadist.integrations.vllm.options import Options

logger = logging.getLogger(__package__)


#: The longest request id (UTF-8 bytes) a prefill engine hands out for a decode side to release; a
#: request with a longer id is not handed out (the decode side computes its prompt), and a release
#: naming a longer one is refused.
MAX_REQUEST_ID_BYTES = 256

#: A lease token: base64url (no padding) of 5 bytes of issue time (Unix seconds, big-endian) and
#: the first 16 bytes of HMAC-SHA256 over the request id and that time, under a key the prefill
#: worker draws at start and hands only to its own scheduler. It travels after the request id in
#: ``remote_request_id``: ``"<request id>.<token>"``.
_TOKEN_SEPARATOR = "."
_TOKEN_TIME_BYTES = 5
_TOKEN_MAC_BYTES = 16
_TOKEN_CHARS = 4 * (_TOKEN_TIME_BYTES + _TOKEN_MAC_BYTES) // 3
_TOKEN_LABEL = b"llm_datadist vllm lease v1\0"

#: The longest ``remote_request_id`` a release may name: a request id, the separator and a token.
MAX_RELEASE_ID_BYTES = MAX_REQUEST_ID_BYTES + len(_TOKEN_SEPARATOR) + _TOKEN_CHARS

#: The most decode ranks a release may say read one prefill rank's blocks (``readers``).
MAX_READERS = 64

#: What one release record (a freed or early-released request) is counted as, beyond its id's
#: bytes: the dict slot and links of an OrderedDict entry, the str header, the value.
_RECORD_OVERHEAD_BYTES = 256

#: Release records outlive a lease by this much (clock steps, a lease that started late).
_RECORD_SLACK_S = 30.0

#: How long a pull with a valid token waits for its lease to reach this worker: the scheduler
#: hands it over in the step after the request finished, which a quick decode side may beat.
LEASE_WAIT_S = 2.0

#: Most request ids one renewal may name (its bytes are bounded by the links' message budget).
MAX_RENEW_IDS = 4096

#: The largest answer to a rank query (``on_ranks``), in bytes of compact JSON: below the links'
#: smallest sensible message budget (``LLM_DATADIST_MAX_MESSAGE_BYTES``, 64 KiB by default), which a
#: decode side holds a reply to (a longer one would break its link). A rank list that does not fit
#: is refused (``too_large``); with request ids of at most ``MAX_REQUEST_ID_BYTES`` and short host
#: names it fits about 90 ranks.
MAX_RANKS_ANSWER_BYTES = 32 << 10


def utf8_len(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (lone surrogates, which JSON can carry, count as 3)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def record_bytes(req_id: str) -> int:
    """What one release record of ``req_id`` counts against ``release_records_bytes``."""
    return utf8_len(req_id) + _RECORD_OVERHEAD_BYTES


def _lease_mac(key: bytes, req_id: str, issued: bytes) -> bytes:
    message = _TOKEN_LABEL + issued + req_id.encode("utf-8", "surrogatepass")
    return hmac.new(key, message, hashlib.sha256).digest()[:_TOKEN_MAC_BYTES]


def lease_request_id(key: bytes, req_id: str, issued_s: Optional[int] = None) -> str:
    """``"<req_id>.<token>"``: what a prefill engine hands out in ``remote_request_id`` for a
    decode side to release ``req_id`` with (``issued_s``: Unix seconds, now by default)."""
    issued = int(time.time() if issued_s is None else issued_s).to_bytes(_TOKEN_TIME_BYTES, "big")
    token = base64.urlsafe_b64encode(issued + _lease_mac(key, req_id, issued)).decode("ascii")
    return f"{req_id}{_TOKEN_SEPARATOR}{token}"


def check_lease(key: bytes, remote_id: str) -> Optional[Tuple[str, int]]:
    """``(request id, issue time)`` if ``remote_id`` carries this key's token for its request id,
    else None (the MAC compared in constant time)."""
    req_id, separator, token = remote_id.rpartition(_TOKEN_SEPARATOR)
    if not separator or len(token) != _TOKEN_CHARS:
        return None
    try:
        raw = base64.b64decode(token, altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        return None
    issued, mac = raw[:_TOKEN_TIME_BYTES], raw[_TOKEN_TIME_BYTES:]
    if len(mac) != _TOKEN_MAC_BYTES or not hmac.compare_digest(mac, _lease_mac(key, req_id, issued)):
        return None
    return req_id, int.from_bytes(issued, "big")



class LeaseBook:
    """The prefill side's leases: blocks held for decode sides, until released, expired or the
    engine stops.

    ``held``: request id -> monotonic deadline. Release records, oldest first, count together
    (``record_bytes``) within ``options.release_records_bytes``: ``released`` (a release that came
    before its lease -> when) and ``gone`` (blocks freed -> (why, when)). ``finished`` collects the
    requests whose blocks vLLM may free (its ``finished_sending``). Thread-safe: the link's thread
    hands releases in while vLLM's steps hand leases and take the finished ones.

    Rank queries (``on_ranks``) are answered from ``_rank_table`` (tensor parallel rank 0: every
    rank's address and lease key, ``set_rank_table``) or ``own_rank`` (an engine without tensor
    parallelism: this worker's ``host``, ``port`` and ``cluster_id``); nothing per request."""

    def __init__(self, options: Options) -> None:
        self.options = options
        #: the key of this worker's lease tokens; its scheduler gets it with the handshake
        self.key = secrets.token_bytes(32)
        self.held: Dict[str, float] = {}
        self.released: "OrderedDict[str, float]" = OrderedDict()
        self.gone: "OrderedDict[str, Tuple[str, float]]" = OrderedDict()
        self.record_bytes = 0
        self.finished: Set[str] = set()
        #: request id -> (releases so far, readers) of a request read by several decode ranks, until
        #: the last of them releases it (held, or released before its lease came)
        self.reads: Dict[str, Tuple[int, int]] = {}
        self.stopping = False
        self.stats = {"released": 0, "refused": 0, "bad_token": 0, "too_long": 0, "over_budget": 0,
                      "expired": 0, "freed_at_shutdown": 0, "records_dropped": 0, "refused_reads": 0,
                      "lease_renewed": 0, "renewal_refused": 0, "bad_readers": 0,
                      "ranks_answered": 0, "ranks_refused": 0}
        self._lock = threading.Lock()
        #: what a guarded read may touch (``read_guard``): request id -> its leased block ids,
        #: kept while the request is in ``held``; and the registered tensors' addresses and bytes
        #: per block (``set_layout``)
        self.blocks: Dict[str, List[int]] = {}
        #: request id -> the byte ranges its blocks span in every registered tensor, made at its first
        #: guarded pull and kept while it is held (a request's pulls come in several shares)
        self._ranges: Dict[str, List[Tuple[int, int]]] = {}
        self._tensors: List[Tuple[int, int]] = []  # (address, bytes of one block)
        self._leased = threading.Condition(self._lock)  # a lease came (``read_guard`` waits for it)
        self._rank_table: List[Tuple[str, int, int, bytes]] = []
        self.own_rank: Optional[Dict[str, Any]] = None

    def counts(self) -> Dict[str, int]:
        """The book's counters, and ``leases_held``: the finished requests whose blocks it holds now
        (each until released or its lease ends: docs/vllm.md, "Failures and bounds")."""
        with self._lock:
            return dict(self.stats, leases_held=len(self.held))

    # -- vLLM's steps -------------------------------------------------------------------------------
    def take_leases(self, to_send: Dict[str, float], stopping: bool,
                    blocks: Optional[Dict[str, List[int]]] = None) -> Optional[int]:
        """Hold the blocks of ``to_send`` (request id -> seconds; ``blocks``: request id -> its
        block ids, which guarded reads may then touch); with ``stopping``, free them all. If the
        engine began to stop in this step, how many requests' blocks were freed; else None."""
        now = time.monotonic()
        began, freed = False, 0
        blocks = blocks or {}
        with self._lock:
            if stopping and not self.stopping:
                # vLLM waits for these before it stops: free them now (finished_sending)
                self.stopping = began = True
                for req_id in self.held:
                    self._free_at_shutdown(req_id)
                freed = len(self.held)
                self.held.clear()
            for req_id, seconds in to_send.items():
                if self.released.pop(req_id, None) is not None:
                    self.record_bytes -= record_bytes(req_id)
                    count, readers = self.reads.get(req_id, (1, 1))
                    if count < readers and not self.stopping:
                        # some of its decode ranks came before the lease; the others are still to come
                        self.held[req_id] = now + seconds
                        self.blocks[req_id] = list(blocks.get(req_id, ()))
                        self._ranges.pop(req_id, None)
                        continue
                    self.finished.add(req_id)  # its decode side was done before the lease came
                    self._forget(req_id, "released")
                elif self.stopping:
                    self._free_at_shutdown(req_id)
                    freed += 1
                else:
                    self.held[req_id] = now + seconds
                    self.blocks[req_id] = list(blocks.get(req_id, ()))
                    self._ranges.pop(req_id, None)
            self._drop_blocks()
            self._leased.notify_all()
        return freed if began else None

    def take_finished(self) -> Set[str]:
        """Expire the leases that ran out; the requests whose blocks may be freed since the last call."""
        now = time.monotonic()
        with self._lock:
            for req_id, deadline in list(self.held.items()):
                if deadline <= now:
                    del self.held[req_id]
                    self.finished.add(req_id)
                    self._forget(req_id, "lease ended")
                    self.stats["expired"] += 1
                    # (kv_lease_s, or a decode engine's decoder_kv_blocks_ttl: ``bidirectional``)
                    logger.warning("request %s: no engine took its KV before its lease ended; freeing its blocks",
                                   req_id)
            self._age(now)
            self._drop_blocks()
            finished, self.finished = self.finished, set()
        return finished

    def free_held(self, why: str) -> int:
        """Free every held lease now (``finished_sending`` at the next step; later releases are
        refused, saying ``why``); how many there were."""
        with self._lock:
            held = list(self.held)
            self.held.clear()
            for req_id in held:
                self.finished.add(req_id)
                self._forget(req_id, why)
        return len(held)

    def close(self) -> int:
        """Drop every lease (the engine goes); how many there were."""
        with self._lock:
            held, self.held = len(self.held), {}
            self.blocks, self.reads, self._ranges = {}, {}, {}
        return held

    def _free_at_shutdown(self, req_id: str) -> None:
        self.finished.add(req_id)
        self._forget(req_id, "the engine is shutting down")
        self.stats["freed_at_shutdown"] += 1

    # -- releases and renewals from decode sides (on the link's thread: quick) ----------------------
    def on_message(self, peer_cluster_id: int, message: Dict[str, Any]) -> Dict[str, Any]:
        """The notification handler: a renewal (``on_renew``), a rank query (``on_ranks``) or a
        release (``on_release``, which also answers anything else)."""
        if isinstance(message, dict) and message.get("op") == "renew":
            return self.on_renew(peer_cluster_id, message)
        if isinstance(message, dict) and message.get("op") == "ranks":
            return self.on_ranks(peer_cluster_id, message)
        return self.on_release(peer_cluster_id, message)

    def on_renew(self, peer_cluster_id: int, message: Dict[str, Any]) -> Dict[str, Any]:
        """A linked decode worker's ``{"op": "renew", "request_ids": [remote_request_id, ...]}``
        (requests waiting in its queue) -> ``{"renewed": n, "refused": [[index, why], ...],
        "lease_s": kv_lease_s}``. A held lease runs ``kv_lease_s`` from now; one on its way (its
        prefill's step has not handed it over yet) needs nothing, as it starts whole. With lease
        tokens, only ids carrying this engine's token for their request are renewed; nothing is
        recorded, so renewals cost nothing against ``release_records_bytes``."""
        ids = message.get("request_ids")
        if not isinstance(ids, list) or len(ids) > MAX_RENEW_IDS:
            logger.warning("llm_datadist: cluster %d sent a malformed lease renewal; ignored", peer_cluster_id)
            return {"renewed": 0, "refused": [], "lease_s": self.options.kv_lease_s,
                    "error": "request_ids must be a list of at most %d ids" % MAX_RENEW_IDS}
        refused = []
        checked: Dict[int, Tuple[str, Optional[int]]] = {}
        for index, remote_id in enumerate(ids):
            if not isinstance(remote_id, str) or len(remote_id) > MAX_RELEASE_ID_BYTES or \
                    utf8_len(remote_id) > MAX_RELEASE_ID_BYTES:
                refused.append([index, "too_long"])
                continue
            if self.options.lease_tokens:
                lease = check_lease(self.key, remote_id)
                if lease is None:
                    refused.append([index, "bad_token"])
                    continue
                checked[index] = lease
            else:
                checked[index] = (remote_id, None)
        now = time.monotonic()
        with self._lock:
            for index, (req_id, issued) in checked.items():
                why = self._renew(req_id, issued, now)
                if why:
                    refused.append([index, why])
            self.stats["lease_renewed"] += len(ids) - len(refused)
            self.stats["renewal_refused"] += len(refused)
        if refused:
            logger.info("llm_datadist: cluster %d: %d of %d lease renewal(s) refused (the first: %s)",
                        peer_cluster_id, len(refused), len(ids), refused[0][1])
        return {"renewed": len(ids) - len(refused), "refused": refused, "lease_s": self.options.kv_lease_s}

    def _renew(self, req_id: str, issued: Optional[int], now: float) -> str:
        """Renew one lease (lock held): "" if it is held (now ``kv_lease_s`` longer) or on its way,
        else why not."""
        if req_id in self.held:
            self.held[req_id] = max(self.held[req_id], now + self.options.kv_lease_s)
            return ""
        if req_id in self.gone:
            return "freed"
        if req_id in self.released:
            return "released"
        if issued is not None and time.time() - issued > self.options.kv_lease_s + _RECORD_SLACK_S:
            return "ended"
        return ""

    def on_release(self, peer_cluster_id: int, message: Dict[str, Any]) -> Dict[str, Any]:
        """A linked decode worker's ``{"op": "release", "request_id": remote_request_id, "readers":
        n}`` -> ``{"request_id": remote_request_id, "released": bool, "why": str}``. With lease
        tokens (the default) ``remote_request_id`` must be the one this engine handed out, token
        included; anything else is refused and the lease stays. ``readers`` (1 if absent: older
        decode sides): how many decode ranks read these blocks, each of which releases them; they
        are freed at the last of those releases (``release``)."""
        remote_id = message.get("request_id") if isinstance(message, dict) else None
        if not isinstance(message, dict) or message.get("op") != "release" or not isinstance(remote_id, str):
            logger.warning("llm_datadist: cluster %d sent a notification that is not a block release; ignored",
                           peer_cluster_id)
            return {"released": False, "why": "not a block release"}
        readers = message.get("readers", 1)
        if isinstance(readers, bool) or not isinstance(readers, int) or not 1 <= readers <= MAX_READERS:
            self._refuse("bad_readers", peer_cluster_id, "a release whose readers are not in [1, %d]", MAX_READERS)
            return {"request_id": remote_id[:MAX_RELEASE_ID_BYTES], "released": False,
                    "why": f"readers must be an integer in [1, {MAX_READERS}]"}
        if len(remote_id) > MAX_RELEASE_ID_BYTES or utf8_len(remote_id) > MAX_RELEASE_ID_BYTES:
            self._refuse("too_long", peer_cluster_id, "a request id longer than %d bytes", MAX_RELEASE_ID_BYTES)
            return {"released": False, "why": f"request id longer than {MAX_RELEASE_ID_BYTES} bytes"}
        issued = None
        req_id = remote_id
        if self.options.lease_tokens:
            checked = check_lease(self.key, remote_id)
            if checked is None:
                self._refuse("bad_token", peer_cluster_id, "a release without this engine's lease token for it")
                return {"request_id": remote_id, "released": False, "why": "no valid lease token for this request"}
            req_id, issued = checked
        released, why = self.release(req_id, issued, readers)
        return {"request_id": remote_id, "released": released, "why": why}

    def _refuse(self, reason: str, peer_cluster_id: int, what: str, *args: Any) -> None:
        """Count a refused release; say so in the log the first time and then every 1000th."""
        with self._lock:
            self.stats["refused"] += 1
            self.stats[reason] += 1
            count = self.stats[reason]
        if count % 1000 == 1:
            logger.warning("llm_datadist: cluster %d sent " + what + "; refused (%d such so far; the lease stays)",
                           peer_cluster_id, *args, count)

    def release(self, req_id: str, issued: Optional[int] = None, readers: int = 1) -> Tuple[bool, str]:
        """Free a request's blocks for the decode side that has them (``issued``: when its lease
        token was made, None without tokens), at the ``readers``-th release: each of that many
        decode ranks that read them releases them once."""
        now = time.monotonic()
        with self._lock:
            self._age(now)
            gone = self.gone.get(req_id)
            if gone is not None:
                self.stats["refused"] += 1
                return False, f"its blocks were already freed ({gone[0]})"
            if req_id in self.held:
                count = self.reads.get(req_id, (0, readers))[0] + 1
                self.stats["released"] += 1
                if count < readers:
                    self.reads[req_id] = (count, readers)  # other readers are still at it
                    return True, ""
                del self.held[req_id]
                self.blocks.pop(req_id, None)
                self._ranges.pop(req_id, None)
                self.finished.add(req_id)
                self._forget(req_id, "released")
                return True, ""
            if req_id in self.released:
                count, known = self.reads.get(req_id, (1, 1))
                if count >= max(known, readers):
                    self.stats["refused"] += 1
                    return False, "its blocks were already released"
                self.reads[req_id] = (count + 1, max(known, readers))
                self.stats["released"] += 1
                return True, ""
            if issued is not None and time.time() - issued > self.options.kv_lease_s + _RECORD_SLACK_S:
                # its lease has ended longer ago than this engine keeps records
                self.stats["refused"] += 1
                return False, "its lease has ended"
            # Its lease is on the way (the scheduler's next step brings it): keep the release,
            # within the records' budget.
            cost = record_bytes(req_id)
            if self.record_bytes + cost > self.options.release_records_bytes:
                self.stats["refused"] += 1
                self.stats["over_budget"] += 1
                return False, "too many releases are pending"
            self.released[req_id] = now
            self.record_bytes += cost
            if readers > 1:
                self.reads[req_id] = (1, readers)
            self.stats["released"] += 1
            return True, ""

    # -- guarded reads (the engine's read guard, on the link's thread) ----------------------------------
    def set_layout(self, tensors: List[int], block_bytes: Union[int, List[int]]) -> None:
        """The registered KV tensors (addresses; block id on dim 0) and the bytes of one block: one
        count for all, or one per tensor (a hybrid model's groups may differ)."""
        sizes = [int(block_bytes)] * len(tensors) if isinstance(block_bytes, int) else [int(b) for b in block_bytes]
        if len(sizes) != len(tensors):
            raise ValueError(f"{len(tensors)} tensors but {len(sizes)} block sizes")
        with self._lock:
            self._tensors = list(zip(tensors, sizes))
            self._ranges = {}

    def read_guard(self, peer_cluster_id: int, tag: bytes) -> Optional[List[Tuple[int, int]]]:
        """The engine's read guard (``engine.set_read_guard``): a pull tagged with the
        ``remote_request_id`` this engine handed out may read exactly the blocks leased for that
        request, in every registered tensor, while the lease lasts; anything else reads nothing
        (None). A valid token whose lease has not come yet waits for it up to ``LEASE_WAIT_S``."""
        try:
            checked = check_lease(self.key, tag.decode("utf-8")) if len(tag) <= MAX_RELEASE_ID_BYTES else None
        except UnicodeDecodeError:
            checked = None
        if checked is None:
            self._refuse_read(peer_cluster_id, "a pull without this engine's lease token for it")
            return None
        req_id, issued = checked
        deadline = time.monotonic() + LEASE_WAIT_S
        with self._lock:
            while req_id not in self.held and req_id not in self.gone and not self.stopping \
                    and time.time() - issued <= self.options.kv_lease_s:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._leased.wait(left)
            blocks = self.blocks.get(req_id) if req_id in self.held else None
            ranges = self._ranges.get(req_id)
            if blocks is not None and ranges is None:
                ranges = self._ranges[req_id] = [(addr + block * size, size) for addr, size in self._tensors
                                                 for block in blocks]
        if blocks is None:
            self._refuse_read(peer_cluster_id, "a pull for a request whose blocks this engine no longer holds")
            return None
        return ranges

    def _refuse_read(self, peer_cluster_id: int, what: str) -> None:
        with self._lock:
            self.stats["refused_reads"] += 1
            count = self.stats["refused_reads"]
        if count % 1000 == 1:
            logger.warning("llm_datadist: cluster %d sent %s; refused (%d such reads so far)", peer_cluster_id,
                           what, count)

    def _drop_blocks(self) -> None:
        """Forget the block ids of requests no longer held (called with the lock)."""
        if len(self.blocks) != len(self.held):
            for req_id in [r for r in self.blocks if r not in self.held]:
                del self.blocks[req_id]
        for req_id in [r for r in self._ranges if r not in self.blocks]:
            del self._ranges[req_id]

    # -- rank queries (the link's thread: quick) -------------------------------------------------------
    def set_rank_table(self, table: List[Dict[str, Any]]) -> None:
        """Every worker of this engine by flat rank (``stages``), rank 0 (this worker) first: ``host``,
        ``port``, ``cluster_id`` and ``lease_key`` (hex), as the scheduler has them from the
        handshakes; rank 0 answers rank queries with it."""
        rows = [(str(r["host"]), int(r["port"]), int(r["cluster_id"]), bytes.fromhex(r["lease_key"])) for r in table]
        with self._lock:
            self._rank_table = rows

    def on_ranks(self, peer_cluster_id: int, message: Dict[str, Any]) -> Dict[str, Any]:
        """A linked decode worker's ``{"op": "ranks", "request_id": remote_request_id}`` (a request
        whose ``kv_transfer_params`` came without ``remote_ranks`` or ``readers_counted``) ->
        ``{"request_id": remote_request_id, "ranks": [{"host", "port", "cluster_id", "request_id"},
        ...], "readers_counted": true}``: every tensor parallel rank of this engine with its release
        id for that request, the ``remote_ranks`` the scheduler handed out. Checked like a release:
        with lease tokens only the id this engine handed out, token included, and only while its
        lease may still be held (held, or on its way: not freed, not older than a lease and its
        slack); anything else gets ``{"request_id", "ranks": None, "refused", "why"}`` (counted,
        ``ranks_refused``), never another request's ranks. Nothing is kept per request: each rank's
        release id is its token for the request id and issue time rank 0's token carries, made with
        that rank's key (``set_rank_table``; an engine without tensor parallelism: ``own_rank``)."""
        remote_id = message.get("request_id") if isinstance(message, dict) else None
        if not isinstance(remote_id, str):
            return self._refuse_ranks(peer_cluster_id, "", "malformed", "request_id must be a string")
        if len(remote_id) > MAX_RELEASE_ID_BYTES or utf8_len(remote_id) > MAX_RELEASE_ID_BYTES:
            return self._refuse_ranks(peer_cluster_id, remote_id[:MAX_RELEASE_ID_BYTES], "too_long",
                                      f"request id longer than {MAX_RELEASE_ID_BYTES} bytes")
        req_id, issued = remote_id, None
        if self.options.lease_tokens:
            checked = check_lease(self.key, remote_id)
            if checked is None:
                return self._refuse_ranks(peer_cluster_id, remote_id, "bad_token",
                                          "no valid lease token for this request")
            req_id, issued = checked
        with self._lock:
            held = req_id in self.held
            gone = self.gone.get(req_id) if not held else None
            table = self._rank_table
        if gone is not None:
            return self._refuse_ranks(peer_cluster_id, remote_id, "freed", f"its blocks were already freed ({gone[0]})")
        # (a lease still held may be older than one lease: its decode side has been renewing it)
        if not held and issued is not None and time.time() - issued > self.options.kv_lease_s + _RECORD_SLACK_S:
            return self._refuse_ranks(peer_cluster_id, remote_id, "ended", "its lease has ended")
        if table:
            ranks = [{"host": host, "port": port, "cluster_id": cluster_id,
                      "request_id": remote_id if rank == 0 else
                      lease_request_id(key, req_id, issued) if issued is not None else req_id}
                     for rank, (host, port, cluster_id, key) in enumerate(table)]
        elif self.own_rank is not None:
            ranks = [dict(self.own_rank, request_id=remote_id)]
        else:
            return self._refuse_ranks(peer_cluster_id, remote_id, "unknown",
                                      "this worker does not know its engine's ranks (not rank 0?)")
        answer = {"request_id": remote_id, "ranks": ranks, "readers_counted": True}
        if len(json.dumps(answer, separators=(",", ":"))) > MAX_RANKS_ANSWER_BYTES:
            return self._refuse_ranks(peer_cluster_id, remote_id, "too_large",
                                      f"its rank list is longer than {MAX_RANKS_ANSWER_BYTES} bytes")
        with self._lock:
            self.stats["ranks_answered"] += 1
        return answer

    def _refuse_ranks(self, peer_cluster_id: int, remote_id: str, reason: str, why: str) -> Dict[str, Any]:
        """Count a refused rank query (log it the first time and then every 1000th); its answer."""
        with self._lock:
            self.stats["ranks_refused"] += 1
            count = self.stats["ranks_refused"]
        if count % 1000 == 1:
            logger.warning("llm_datadist: cluster %d asked for the ranks of a request and was refused (%s: %s; %d "
                           "such so far)", peer_cluster_id, reason, why, count)
        return {"request_id": remote_id, "ranks": None, "refused": reason, "why": why}

    # -- records ------------------------------------------------------------------------------------
    def age(self, now: float) -> None:
        """Drop the release records no release can need any more at monotonic time ``now``."""
        with self._lock:
            self._age(now)

    def _forget(self, req_id: str, why: str) -> None:
        """Remember (for ``kv_lease_s`` and a bit, within the records' budget) that a request's blocks
        are gone, to refuse late releases. Its blocks are freed whether or not the record fits: the
        oldest records make room."""
        self.reads.pop(req_id, None)
        previous = self.gone.pop(req_id, None)
        if previous is not None:
            self.record_bytes -= record_bytes(req_id)
        self.gone[req_id] = (why, time.monotonic())
        self.record_bytes += record_bytes(req_id)
        while self.record_bytes > self.options.release_records_bytes and self.gone:
            old, _ = self.gone.popitem(last=False)
            self.record_bytes -= record_bytes(old)
            self.stats["records_dropped"] += 1

    def _age(self, now: float) -> None:
        """Drop the release records no release can need any more."""
        lease = self.options.kv_lease_s
        while self.released:
            req_id, when = next(iter(self.released.items()))
            if now - when <= lease:
                break
            del self.released[req_id]  # a release for a request this engine never leased
            self.reads.pop(req_id, None)
            self.record_bytes -= record_bytes(req_id)
        while self.gone:
            req_id, (_, when) = next(iter(self.gone.items()))
            if now - when <= lease + _RECORD_SLACK_S:
                break
            del self.gone[req_id]
            self.record_bytes -= record_bytes(req_id)
