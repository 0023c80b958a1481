"""What the connector's halves tell each other: a worker's address (handshake), the pulls and
leases of a step (connector metadata), and a decode request's pull read from its
``kv_transfer_params``."""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorHandshakeMetadata, KVConnectorMetadata,
                                                                KVConnectorWorkerMetadata)

from llm_datadist.integrations.vllm import stages
from llm_datadist.integrations.vllm.leases import MAX_RELEASE_ID_BYTES, utf8_len

#: Fields a decode request's ``kv_transfer_params`` must carry to be pulled (all of them NIXL's:
#: ``remote_cluster_id``, which our prefill engines add, is optional; without it the decode side
#: links to whichever cluster the handshake finds at ``remote_host:remote_port``).
REMOTE_FIELDS = ("remote_block_ids", "remote_host", "remote_port", "remote_request_id")

#: The largest tensor parallel size ``kv_transfer_params`` may name (they come from outside), and
#: the most workers (``tp_size * pp_size``).
MAX_TP_SIZE = 256

#: The most KV cache groups ``kv_transfer_params`` may name block ids for (hybrid models: one list
#: per group; they come from outside).
MAX_KV_GROUPS = 64


@dataclass(frozen=True)
class PrefillRank:
    """One prefill worker (a tensor parallel rank) as a decode request's ``kv_transfer_params`` name
    it: where it listens and the request id (lease token included) its release must name."""

    host: str
    port: int
    cluster_id: Optional[int]  # None: the one found at host:port
    remote_request_id: str


@dataclass
class Recv:
    """One request's blocks to pull: ``remote_block_ids[k]`` -> ``local_block_ids[k]``. A request
    the scheduler does not park for it (``awaiting`` False: nothing to load, or finished before its
    blocks were allocated) only tells the prefill side to free its blocks, and is not reported
    back to vLLM (which accepts ``finished_recving`` only for requests it parked)."""

    local_block_ids: List[int]
    remote_block_ids: List[int]
    host: str
    port: int
    cluster_id: Optional[int]  # None: the one found at host:port
    remote_request_id: str
    awaiting: bool = False
    #: the prefill engine's block size, if its params say (this connector's do)
    remote_block_size: Optional[int] = None
    #: why this engine refuses the blocks (the worker then pulls nothing and only releases)
    refused: str = ""
    #: every prefill worker, by flat rank (``stages``: by tensor parallel rank within each pipeline
    #: stage; the first is the one above)
    ranks: Tuple[PrefillRank, ...] = ()
    #: whether the prefill engine frees a rank's blocks only after as many releases as it has
    #: readers (``readers`` in a release; ``kv_transfer_params`` ``readers_counted``)
    readers_counted: bool = False
    #: the model's KV heads, set by the scheduler when the blocks move between engines of different
    #: TP sizes (each decode rank pulls its heads' byte range of each block); 0 otherwise
    kv_heads: int = 0
    #: of one peer's spec (``peers``): its heads ``[src_head, src_head + heads)`` (counted from that
    #: prefill rank's first) go to this rank's heads from ``dst_head``; ``heads`` 0: whole blocks
    src_head: int = 0
    dst_head: int = 0
    heads: int = 0
    #: how many decode ranks read (and release) that prefill rank's blocks
    readers: int = 1
    #: the prefill engine's tensor parallel size as its params say (``tp_size``), which counts
    #: where they name no ranks (a router that forwards only NIXL's fields): see ``ranks_unknown``
    remote_tp_size: int = 1
    #: the prefill engine's pipeline parallel size as its params say (``pp_size``, NIXL's)
    remote_pp_size: int = 1
    #: a hybrid model's blocks, one list per KV cache group (vLLM's hybrid KV cache manager), where
    #: the params name more than one group; ``remote_block_ids`` and ``local_block_ids`` then hold
    #: their concatenation (what counts and reports use). Empty: one group, the flat lists above.
    remote_groups: Tuple[List[int], ...] = ()
    local_groups: Tuple[List[int], ...] = ()
    #: the prompt's block (in this engine's block size) the local list starts at: a local
    #: prefix-cache hit's count; how blocks pair where the two engines' block sizes differ
    local_first_block: int = 0
    #: a prefill engine pulls the prefix a decode engine held for the next turn (``bidirectional``)
    next_turn: bool = False

    def group_pairs(self) -> List[Tuple[int, List[int], List[int]]]:
        """``(group, remote block ids, local block ids)`` per KV cache group, as the params and the
        scheduler gave them (not yet paired: a group's local blocks take the tail of its remote ones)."""
        if not self.remote_groups:
            return [(0, self.remote_block_ids, self.local_block_ids)]
        local = self.local_groups or tuple([] for _ in self.remote_groups)
        return [(group, list(remote), list(mine))
                for group, (remote, mine) in enumerate(zip(self.remote_groups, local))]

    def with_local(self, groups: Tuple[List[int], ...]) -> "Recv":
        """This spec with the local blocks per KV cache group (one group: the flat list)."""
        if not self.remote_groups:
            return replace(self, local_block_ids=list(groups[0]) if groups else [])
        return replace(self, local_groups=tuple(list(g) for g in groups),
                       local_block_ids=[b for g in groups for b in g])

    @property
    def tp_size(self) -> int:
        """The prefill engine's tensor parallel size."""
        return len(self.ranks) // self.remote_pp_size if self.ranks else self.remote_tp_size

    @property
    def ranks_unknown(self) -> bool:
        """A prefill engine of several workers (tensor or pipeline parallelism) whose ranks the
        params do not name: the decode side asks its rank 0 for them (``ranks`` notification)
        before it loads."""
        return not self.ranks and (self.remote_tp_size > 1 or self.remote_pp_size > 1)

    def peers(self, rank: int, size: int, pp_rank: int = 0, pp_size: int = 1) -> List["Recv"]:
        """What decode worker ``(pp_rank, rank)`` of an engine of ``pp_size`` pipeline stages of
        ``size`` tensor parallel ranks does for this request: one spec per prefill rank it pulls
        from or releases, addressed to it. With the same pipeline parallel size it deals with the
        prefill ranks of its own stage only (``stages.stage_ranks``: they hold its layers), and
        among them: with the same TP size, exactly rank ``rank``, whole blocks; with another TP
        size and ``kv_heads`` set (the scheduler found the heads shardable on both sides:
        ``split_refusal``), the prefill ranks this rank reads its heads from (``head_overlaps``),
        each with its head range and its count of readers, then the replicas no decode rank reads
        that this rank releases (``unread_ranks``: nothing pulled). Else nothing is pulled
        (``awaiting`` stays only with the same TP and PP sizes) and this worker releases the prefill
        ranks ``p % workers == flat rank`` (of all stages: every prefill worker holds a lease)."""
        ranks = self.ranks or (PrefillRank(self.host, self.port, self.cluster_id, self.remote_request_id),)
        if self.remote_pp_size != pp_size or len(ranks) % pp_size:
            workers, me = size * pp_size, stages.flat_rank(pp_rank, rank, size)
            return [replace(self, host=peer.host, port=peer.port, cluster_id=peer.cluster_id,
                            remote_request_id=peer.remote_request_id, local_block_ids=[], local_groups=(),
                            awaiting=False)
                    for p, peer in enumerate(ranks) if p % workers == me]
        ranks = stages.stage_ranks(ranks, pp_size, pp_rank)
        if len(ranks) != size and self.kv_heads and self.awaiting:
            reads = [replace(self, host=peer.host, port=peer.port, cluster_id=peer.cluster_id,
                             remote_request_id=peer.remote_request_id, src_head=src, dst_head=dst, heads=count,
                             readers=readers)
                     for p, src, dst, count, readers in head_overlaps(self.kv_heads, len(ranks), size, rank)
                     for peer in (ranks[p],)]
            return reads + [replace(self, host=peer.host, port=peer.port, cluster_id=peer.cluster_id,
                                    remote_request_id=peer.remote_request_id, local_block_ids=[], local_groups=(),
                                    awaiting=False)
                            for p in unread_ranks(self.kv_heads, len(ranks), size, rank) for peer in (ranks[p],)]
        same = len(ranks) == size
        return [replace(self, host=peer.host, port=peer.port, cluster_id=peer.cluster_id,
                        remote_request_id=peer.remote_request_id, local_block_ids=self.local_block_ids if same else [],
                        local_groups=self.local_groups if same else (), awaiting=self.awaiting and same)
                for p, peer in enumerate(ranks) if p % size == rank]


def split_refusal(kv_heads: int, prefill_tp: int, decode_tp: int) -> str:
    """Why KV cannot move head by head between TP sizes ``prefill_tp`` and ``decode_tp`` of a model
    with ``kv_heads`` KV heads; "" if it can: each side's TP size divides the heads (each rank its
    own share) or is a multiple of them (each rank one head, replicated: ``held_heads``)."""
    if kv_heads <= 0:
        return "this engine does not know its model's KV heads"
    for tp in (prefill_tp, decode_tp):
        if kv_heads % tp and tp % kv_heads:
            return (f"the model's {kv_heads} KV heads and tensor parallel size {tp} do not divide one another "
                    "(vLLM shards KV heads so only)")
    return ""


def held_heads(kv_heads: int, tp: int, rank: int) -> range:
    """The KV heads rank ``rank`` of an engine of TP size ``tp`` holds, outermost in its blocks in this
    order, as vLLM's ``QKVParallelLinear`` shards them: ``[rank * kv_heads / tp, (rank + 1) * kv_heads /
    tp)`` where ``tp`` divides ``kv_heads``, else (``tp`` a multiple of them) the one head ``rank // (tp
    / kv_heads)``, which ``tp / kv_heads`` ranks hold alike (``split_refusal`` is "")."""
    if tp <= kv_heads:
        share = kv_heads // tp
        return range(rank * share, (rank + 1) * share)
    head = rank // (tp // kv_heads)
    return range(head, head + 1)


@functools.lru_cache(maxsize=64)
def _head_reads(kv_heads: int, prefill_tp: int, decode_tp: int) -> Tuple[Tuple[Tuple[int, int, int, int], ...], ...]:
    """Per decode rank, ``(prefill rank, first head there, first head here, heads)`` for each run of
    its heads read from one prefill rank. Each head is read from one prefill rank holding it: the
    i-th of the decode ranks holding a head (several where it is replicated here) reads the holder
    ``i * replicas there // replicas here`` of that head's prefill replicas, which spreads readers
    over them (NIXL's choice too: decode rank r of a larger TP reads ``r * P / D``)."""
    replicas_p, replicas_d = max(1, prefill_tp // kv_heads), max(1, decode_tp // kv_heads)
    table = []
    for rank in range(decode_tp):
        mine = held_heads(kv_heads, decode_tp, rank)
        runs: List[List[int]] = []
        for head in mine:
            if prefill_tp <= kv_heads:
                source = head // (kv_heads // prefill_tp)
            else:
                source = head * replicas_p + (rank % replicas_d) * replicas_p // replicas_d
            if runs and runs[-1][0] == source:
                runs[-1][3] += 1  # (the prefill rank's heads are one run: so are those read here)
            else:
                runs.append([source, head - held_heads(kv_heads, prefill_tp, source).start, head - mine.start, 1])
        table.append(tuple(tuple(run) for run in runs))
    return tuple(table)


def head_overlaps(kv_heads: int, prefill_tp: int, decode_tp: int, rank: int) -> List[Tuple[int, int, int, int, int]]:
    """``(prefill rank, first head there, first head here, heads, readers)`` for each prefill rank
    decode rank ``rank`` reads some of its heads from (``held_heads``; ``split_refusal`` is ""):
    each of its heads from exactly one prefill rank holding it; first heads count from each rank's
    own first; ``readers``: how many decode ranks read that prefill rank (each releases it once)."""
    table = _head_reads(kv_heads, prefill_tp, decode_tp)
    readers = collections.Counter(p for runs in table for p, *_ in runs)
    return [(p, src, dst, count, readers[p]) for p, src, dst, count in table[rank]]


def unread_ranks(kv_heads: int, prefill_tp: int, decode_tp: int, rank: int) -> List[int]:
    """The prefill ranks decode rank ``rank`` releases without reading them: replicas no decode rank
    reads (``head_overlaps``) are each released once, by decode rank ``p % decode_tp``, so that every
    prefill rank frees its blocks."""
    read = {p for runs in _head_reads(kv_heads, prefill_tp, decode_tp) for p, *_ in runs}
    return [p for p in range(prefill_tp) if p not in read and p % decode_tp == rank]


@dataclass
class LLMDataDistHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What a worker tells its scheduler: where decode engines reach it."""

    engine_id: str
    cluster_id: int
    host: str
    port: int
    #: hex key the scheduler makes this rank's lease tokens with (never leaves this engine's processes)
    lease_key: str = field(default="", repr=False)
    tp_rank: int = 0
    tp_size: int = 1
    #: this worker's pipeline stage and the engine's pipeline parallel size (``stages``)
    pp_rank: int = 0
    pp_size: int = 1


class LLMDataDistConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once a step: pulls to start, requests that arrived to wait in the
    queue for their pull (whose prefill leases the worker renews until their pull starts or they
    end: both come as ``reqs_to_recv``), blocks to keep for a decode side, and whether the engine
    has begun to shut down (then held blocks are freed)."""

    def __init__(self) -> None:
        self.reqs_to_recv: Dict[str, Recv] = {}
        self.reqs_parked: Dict[str, Recv] = {}
        self.reqs_to_send: Dict[str, float] = {}  # request id -> seconds to keep its blocks
        self.blocks_to_send: Dict[str, List[int]] = {}  # request id -> those blocks (the read guard's)
        #: prefill side, with tensor parallelism, once: every rank's ``host``, ``port``,
        #: ``cluster_id`` and ``lease_key``, with which rank 0 answers the decode sides that did not
        #: get ``remote_ranks`` (``ranks`` queries, ``LeaseBook.on_ranks``)
        self.rank_table: Optional[List[Dict[str, Any]]] = None
        #: decode side: requests whose prefill engine rank 0 is to be asked what their params lack
        #: (every rank's address and release id; whether it counts readers); rank 0 asks
        self.reqs_to_ask: Dict[str, Recv] = {}
        self.stopping = False
        #: push mode (``push``), decode side: blocks to register with prefill workers (request id
        #: -> ``push.specs.PushReg``), requests that ended before their push did; prefill side: each
        #: push-mode request scheduled in this step (-> ``push.specs.PushStep``), requests that ended
        #: without handing their KV out
        self.push_regs: Dict[str, Any] = {}
        self.push_cancel: Set[str] = set()
        self.push_steps: Dict[str, Any] = {}
        self.push_forget: Set[str] = set()


class LLMDataDistWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once a step (decode side): the answers of the prefill engines asked for
    a request's ranks (``reqs_to_ask``), by our request id: ``{"ranks": [...], "readers_counted":
    bool}`` as the prefill engine said them, or ``{"why": ...}`` if it could not say."""

    def __init__(self, answers: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
        self.answers: Dict[str, Dict[str, Any]] = dict(answers or {})

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "LLMDataDistWorkerMetadata":
        if isinstance(other, LLMDataDistWorkerMetadata):
            self.answers.update(other.answers)
        return self



def recv_spec(params: Any) -> Optional[Recv]:
    """The pull a decode request's ``kv_transfer_params`` ask for, or None if they are unusable
    (never raises: these come from outside, through the proxy)."""
    try:
        if not isinstance(params, dict) or any(params.get(name) is None for name in REMOTE_FIELDS):
            return None
        blocks = params["remote_block_ids"]
        groups: Tuple[List[int], ...] = ()
        if isinstance(blocks, (list, tuple)) and blocks and isinstance(blocks[0], (list, tuple)):
            # per-group form (NIXL style): one list per KV cache group
            if len(blocks) > MAX_KV_GROUPS or not all(_block_list(g) for g in blocks):
                return None
            if len(blocks) == 1:
                blocks = blocks[0]
            else:
                groups = tuple(list(g) for g in blocks)
                blocks = [b for g in groups for b in g]
        if not _block_list(blocks):
            return None
        first = prefill_rank(params["remote_host"], params["remote_port"], params.get("remote_cluster_id"),
                             params["remote_request_id"])
        if first is None:
            return None
        block_size = params.get("remote_block_size")
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)):
            return None
        ranks: Tuple[PrefillRank, ...] = ()
        listed = params.get("remote_ranks")
        tp_size, pp_size = params.get("tp_size", 1), params.get("pp_size", 1)
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or not 1 <= tp_size <= MAX_TP_SIZE:
            return None
        if not isinstance(pp_size, int) or isinstance(pp_size, bool) or not 1 <= pp_size <= stages.MAX_PP_SIZE or \
                tp_size * pp_size > MAX_TP_SIZE:  # (each worker listed may be a link and a thread here)
            return None
        if listed is not None:
            # a prefill engine of several workers: every worker's address and lease, by flat rank
            # (without them, as from a router that forwards only NIXL's fields, rank 0 is asked)
            if not isinstance(listed, (list, tuple)) or len(listed) != tp_size * pp_size or \
                    not all(isinstance(r, dict) for r in listed):
                return None
            ranks = tuple(prefill_rank(r.get("host"), r.get("port"), r.get("cluster_id"), r.get("request_id"))
                          for r in listed)
            if any(rank is None for rank in ranks):
                return None
            # rank 0 is where the NIXL-style fields say (a router may have rewritten them)
            ranks = (first,) + ranks[1:]
        return Recv([], list(blocks), first.host, first.port, first.cluster_id, first.remote_request_id,
                    ranks=ranks, remote_block_size=block_size, readers_counted=params.get("readers_counted") is True,
                    remote_tp_size=tp_size, remote_pp_size=pp_size, remote_groups=groups)
    except (TypeError, ValueError, OverflowError):
        return None


def _block_list(blocks: Any) -> bool:
    """Whether ``blocks`` is a list of block ids (ints >= 0, no bools)."""
    return isinstance(blocks, (list, tuple)) and \
        all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks)


def prefill_rank(host: Any, port: Any, cluster_id: Any, remote_id: Any) -> Optional[PrefillRank]:
    """One prefill rank named in ``kv_transfer_params``, or None if unusable (raises nothing)."""
    if not isinstance(host, str) or not host or not isinstance(remote_id, str) or \
            utf8_len(remote_id) > MAX_RELEASE_ID_BYTES:  # the prefill side would refuse its release
        return None
    if isinstance(port, bool) or isinstance(cluster_id, bool):
        return None
    try:  # no cluster id (a router that forwards only NIXL's fields): the one found at host:port
        port, cluster_id = int(port), None if cluster_id is None else int(cluster_id)
    except (TypeError, ValueError, OverflowError):
        return None
    if not 0 < port < 65536 or cluster_id is not None and not 0 <= cluster_id < 1 << 64:
        return None
    return PrefillRank(host, port, cluster_id, remote_id)
