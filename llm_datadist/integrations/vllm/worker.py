"""The connector's worker half: registers the KV caches, pulls a decode request's blocks from
its prefill engine and tells that engine it may free them, renews the leases of requests still
in vLLM's queue and asks a prefill engine for the ranks its params did not name (decode side,
over ``peers.Peers``), and holds finished requests' blocks for their decode sides and answers
those questions (prefill side, ``leases.LeaseBook``)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

import llm_datadist as ld
from llm_datadist.integrations.vllm import block_sizes, caches, compat, kv_layouts, layout, stages, state
from llm_datadist.integrations.vllm import groups as kv_groups
from llm_datadist.integrations.vllm.leases import LeaseBook
from llm_datadist.integrations.vllm.meta import (LLMDataDistConnectorMetadata, LLMDataDistHandshakeMetadata,
                                                 LLMDataDistWorkerMetadata, Recv)
from llm_datadist.integrations.vllm.metrics import LLMDataDistKVConnectorStats, Recorder, failure_kind
from llm_datadist.integrations.vllm.options import Options
from llm_datadist.integrations.vllm.peers import LINK_BROKEN, Peers, Unreachable
from llm_datadist.integrations.vllm.push.grants import Receiver
from llm_datadist.integrations.vllm.push.pusher import Pusher

logger = logging.getLogger(__package__)

#: Linked prefill clusters whose block size a worker keeps (the oldest are forgotten past it).
MAX_LINKED_SIZES = 4096

#: Prefill requests a decode worker has already settled, remembered to skip a twin's release.
_SETTLED_REMEMBERED = 1 << 16


def parallel_ranks(vllm_config) -> Tuple[int, int, int]:
    """``(tensor parallel rank, tensor parallel size, data parallel rank)`` of this worker."""
    parallel = getattr(vllm_config, "parallel_config", None)
    tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    dp_rank = int(getattr(parallel, "data_parallel_index", getattr(parallel, "data_parallel_rank", 0)) or 0)
    tp_rank = 0
    if tp_size > 1:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        tp_rank = get_tensor_model_parallel_rank()
    return tp_rank, tp_size, dp_rank


class Worker:
    def __init__(self, vllm_config, engine_id: str, options: Options, kv_cache_config,
                 groups: Tuple[kv_groups.Group, ...] = ()):
        transfer = vllm_config.kv_transfer_config
        #: the KV cache groups that move (``groups.transfer_groups``): with more than one (a hybrid
        #: model), each group's layers are one llm_datadist cache, ``model_id`` = its position here
        self.groups = groups
        #: all of vLLM's KV cache groups (with more than one, vLLM takes failed loads only as
        #: ``failed_recving``: block ids are not unique across groups)
        self.num_kv_groups = len(getattr(kv_cache_config, "kv_cache_groups", None) or ()) or 1
        self.engine_id = engine_id
        self.options = options
        self._closed = False  # (``close`` ran)
        # multi-turn (``bidirectional``): a decode engine also holds blocks for a prefill engine, which
        # also pulls; both then listen and pull
        self.producer = bool(transfer.is_kv_producer) or options.bidirectional_kv_xfer
        self.consumer = bool(transfer.is_kv_consumer) or options.bidirectional_kv_xfer
        self.num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else None
        self._kv_cache_config = kv_cache_config  # (where a state-space layer's pages lie: state.py)
        self.kv_cache_layout: Optional[str] = getattr(kv_cache_config, "kv_cache_layout", None)
        self.tp_rank, self.tp_size, dp_rank = parallel_ranks(vllm_config)
        self.pp_rank, self.pp_size = stages.pipeline_ranks(vllm_config)  # (rank: the flat one, ``stages``)
        self.rank = stages.flat_rank(self.pp_rank, self.tp_rank, self.tp_size)
        # Every worker of every engine on a host listens on its own port: with a fixed one, worker
        # (dp, pp, tp) takes listen_port + dp * pp_size * tp_size + pp * tp_size + tp; a fixed
        # cluster id is offset the same way.
        offset = dp_rank * self.tp_size * self.pp_size + self.rank
        self.cluster_id = options.cluster_id + offset if options.cluster_id is not None else \
            int.from_bytes(os.urandom(4), "little") | 1
        self.listen_port = options.listen_port + offset if options.listen_port else 0
        self.device_id = layout.current_device_index()
        cfg = ld.LLMConfig()
        cfg.device_id = self.device_id
        cfg.sync_kv_timeout = options.sync_kv_timeout_ms
        cfg.enable_cache_manager = True
        cfg.enable_remote_cache_accessible = True
        cfg.link_secret = options.link_secret  # the option llm.LinkSecret; None: not authenticated
        if self.producer:
            cfg.listen_ip_info = f"{options.listen_host}:{self.listen_port}"
        role = ld.LLMRole.MIX if self.producer and self.consumer else \
            ld.LLMRole.PROMPT if self.producer else ld.LLMRole.DECODER
        engine_options = cfg.generate_options()
        engine_options["llm.DataPlane"] = options.data_plane
        self.dd = ld.LLMDataDist(role, self.cluster_id)
        self.dd.init(engine_options)
        self.cm = self.dd.cache_manager
        # Block releases travel as notifications over the links (no server of our own); the
        # engine passes them to its links.
        self._links_api = self.dd.engine
        self.cache: Optional[ld.Cache] = None  # the first of ``caches``
        #: one registered cache per group that moves (one in all without hybrid groups)
        self.caches: List[ld.Cache] = []
        self._descs: List[ld.CacheDesc] = []
        self._keep_groups: List[List[Any]] = []
        #: the registered caches' layers, shapes and groups (``caches.plan``), by model_id
        self._classes: List[caches.CacheClass] = []
        self._asleep: Optional[ld.CacheDesc] = None  # what was registered before sleep mode
        self.device: Optional[str] = None
        self._stats = {"links": 0, "pulled_requests": 0, "pulled_blocks": 0, "failed_requests": 0, "notified": 0,
                       "renewed": 0, "renew_refused": 0, "renew_failed": 0, "links_evicted": 0, "ranks_asked": 0,
                       "ranks_unanswered": 0}
        self._lock = threading.Lock()
        self.recorder = Recorder()  # what vLLM's stat loggers get (metrics.py)
        self.compat = compat.fields(vllm_config, options.model_id)  # + "layout" once registered
        self.compat["kv_groups"] = kv_groups.describe(groups)
        self.compat.update(stages.compat_fields(self.pp_rank, self.pp_size))
        self._block_bytes = 0
        #: bytes of one KV head in a block of one tensor, where a rank's heads are one byte range of
        #: each block (pulls from engines of another TP size); else why not
        self._head_bytes: Optional[int] = None
        self._heads_refusal = "the KV caches are not registered"
        # decode side
        self.peers = Peers(self.dd, options, self._count, hello=self._hello,
                           link_failed=lambda: self.recorder.count("link_failures"))
        self._settled: "OrderedDict[Tuple[int, str], str]" = OrderedDict()  # prefill request -> our request
        self._recved: Set[str] = set()
        self._failed: Set[str] = set()
        #: request id -> (pulls still running, whether one failed), for a request this rank pulls
        #: from several prefill ranks (an engine of another TP size): done when the last one is
        self._pending: Dict[str, List[Any]] = {}
        self._load_errors: Set[int] = set()
        #: prefill engines' answers about our requests' ranks, for the scheduler (``take_worker_meta``)
        self._answers: Dict[str, Dict[str, Any]] = {}
        #: linked prefill cluster -> the block size its compatibility answer said (``_hello``)
        self._link_block_sizes: "OrderedDict[int, int]" = OrderedDict()
        self.link_layouts = kv_layouts.LinkLayouts()  # (and the KV cache layout it said)
        # prefill side
        self.leases = LeaseBook(options)
        # push mode (``push``): the prefill worker pushes, the decode worker grants and receives
        self.sizes = block_sizes.Attention(vllm_config)  # (which layout inside a block: another size's pulls)
        self.block_size = self.sizes.block_size
        self.pusher: Optional[Pusher] = None
        self.receiver: Optional[Receiver] = None
        if options.transfer_mode == "push":
            if self.producer:
                self.pusher = Pusher(self)
            else:
                self.receiver = Receiver(self)
                self.receiver.install()
        if self.producer:
            if self.tp_size * self.pp_size == 1:  # the one rank a rank query is answered with
                self.leases.own_rank = {"host": options.advertise_host, "port": self._listening_port(),
                                        "cluster_id": self.cluster_id}
            self._links_api.set_notify_handler(self._on_notify)

    def _count(self, counter: str, n: int) -> None:
        """Adds ``n`` to a stat (``pulled_blocks_group<k>``: blocks of the k-th KV cache group that
        moves; ``pulled_blocks_cache<k>``: into the k-th registered cache...)."""
        with self._lock:
            self._stats[counter] = self._stats.get(counter, 0) + n

    @property
    def stats(self) -> Dict[str, int]:
        """A snapshot of the decode side's counters and the lease book's."""
        with self._lock:
            mine = dict(self._stats)
        for half in (self.pusher, self.receiver):
            if half is not None:
                mine.update(half.stats)
        return dict(mine, **self.leases.counts())

    def take_stats(self) -> Optional[LLMDataDistKVConnectorStats]:
        """vLLM's stats of this worker since the last call (None if nothing happened), with what the
        lease book and the links' guards counted since then (``metrics.SOURCE_COUNTERS``)."""
        sources = dict(self.leases.stats)
        links = self._links_api.link_stats()  # (kept after finalize)
        sources.update((f"link.{name}", links.get(name, 0)) for name in ("refused_reads", "refused_writes"))
        return self.recorder.take(sources)

    # -- registration -----------------------------------------------------------------------------
    def register(self, kv_caches: Dict[str, Any]) -> None:
        # One cache per KV cache group that moves and per shape and dtype of its layers' views
        # (``caches.plan``): a hybrid model's groups each index their own layers, and one group can
        # hold layers of several shapes (an EAGLE drafter's, MLA's, indexer caches); a group's
        # block ids move in each of its caches. A state-space group is one cache of its layers'
        # state pages (``state.group_pages``), of which a pull moves the states' bytes only.
        hybrid = len(self.groups) > 1
        if hybrid:
            missing = [g.index for g in self.groups if not any(name in kv_caches for name in g.layers)]
            if missing:
                raise ValueError(f"LLMDataDistConnector: no KV caches of the layers of KV cache group(s) {missing}")
        states = {k: state.group_pages(g, kv_caches, self._kv_cache_config, self.num_blocks)
                  for k, g in enumerate(self.groups) if hybrid and g.is_state}
        classes = caches.plan(kv_caches, [g.layers for g in self.groups] if hybrid else [], self.num_blocks,
                              self.kv_cache_layout, states)
        if (self.pusher is not None or self.receiver is not None) and len(classes) > 1:
            # (push mode pushes and grants the one cache's layers: a second cache would not move)
            raise NotImplementedError(
                f"LLMDataDistConnector: push mode moves models whose KV is one cache; this one's layers are "
                f"{len(classes)} caches ({'; '.join(f'{len(c.layers)} layer(s) of {tuple(c.shape)}' for c in classes)}"
                ": "
                "layers of several shapes, such as an EAGLE drafter's, or several KV cache groups); use "
                "transfer_mode 'pull'")
        parts = [cls.tensors for cls in classes]
        descs = [layout.cache_desc(cls.tensors, cls.shape) for cls in classes]  # (as vLLM's views say)
        tensors = [t for part in parts for t in part]
        first = tensors[0]
        if descs[0].placement == ld.Placement.DEVICE:
            layout.check_device(self.dd, first.device, self.device_id)
        self._keep = tensors
        self._keep_groups = parts
        self._classes = classes
        self._descs = descs
        self._block_bytes = sum(t[0].numel() * t.element_size() for t in parts[0])
        if len(parts) > 1:
            self._head_bytes, self._heads_refusal = None, "a model with several KV caches (KV cache groups or " \
                "layers of several shapes) moves KV only between engines of one tensor parallel size"
        else:
            self._head_bytes, self._heads_refusal = layout.head_split(first, self.compat.get("kv_heads"), self.tp_size,
                                                                      classes[0].token_major)
        # each state-space group's states (offsets, shapes, dtypes in a page): compared per link
        described = {"kv_states": ";".join(f"{self.groups[k].index}:{found.describe()}"
                                           for k, (_, found) in sorted(states.items()))} if states else {}
        # (a new dict: links' threads read it)
        self.compat = dict(self.compat, layout=";".join(compat.layout(d) for d in descs), tp_size=self.tp_size,
                           layout_all_heads=compat.layout(descs[0], min(self.tp_size, self.compat.get("kv_heads") or 0)
                                                            if self._head_bytes else 0),
                           caches=caches.describe(classes), block_layout=self.sizes.layout(classes), **described,
                           **kv_layouts.fields(classes, self.pusher is None and self.receiver is None))
        self._register()
        self.device = str(first.device)
        if self.pusher is not None:
            ptrs = {t.data_ptr(): i for i, t in enumerate(tensors)}
            self.pusher.set_layout({name: ptrs[layout.blocks_view(name, value, self.num_blocks).data_ptr()]
                                    for name, value in kv_caches.items()}, first.device)
        if self.producer and self.options.lease_tokens:
            # Pulls through this engine's server read only the blocks leased to the puller's token
            # (in every group's tensors: a request's ids of all its groups).
            self.leases.set_layout([t.data_ptr() for t in tensors], [t[0].numel() * t.element_size() for t in tensors])
            self._links_api.set_read_guard(self.leases.read_guard)
        logger.info("llm_datadist: registered %d KV tensors on %s as cluster %d, %d cache(s): %s", len(tensors),
                    first.device, self.cluster_id, len(classes),
                    "; ".join(f"group {c.group}: {len(c.tensors)}x{tuple(c.shape)} {c.dtype}" for c in classes))

    def registered_caches(self) -> List[Dict[str, Any]]:
        """The caches registered, by model_id: group (position among those that move), tensors,
        shape (block id first), torch dtype and layer names."""
        return [{"group": c.group, "num_tensors": len(c.tensors), "shape": list(c.shape),
                 "dtype": str(c.dtype).replace("torch.", ""), "layers": list(c.layers)} for c in self._classes]

    def _register(self) -> None:
        # By address: device memory is registered where it is (no host copy), moved by the
        # link's plane for device memory (cuda_ipc on one host with a link secret, staging elsewhere).
        # Cache k (``caches.plan``'s k-th: by group, then shape) is (this cluster, model_id k) for peers.
        self.caches = [self.cm.register_blocks_cache(desc, [t.data_ptr() for t in tensors],
                                                     ld.BlocksCacheKey(self.cluster_id, k), True)
                       for k, (desc, tensors) in enumerate(zip(self._descs, self._keep_groups))]
        self.cache = self.caches[0]

    # -- sleep mode (vLLM 0.33) -------------------------------------------------------------------
    def unregister(self) -> None:
        """Before vLLM frees the KV memory for sleep: the caches leave the registry (which waits
        for the transfers touching them — peers' reads, our pulls — and refuses later ones, so
        those fail cleanly), and the blocks held for decode sides are freed (their contents do
        not survive sleep; a decode side that comes for them is refused). Idempotent."""
        with self._lock:
            cache, self.cache = self.cache, None
            caches, self.caches = self.caches, []
            if cache is None:
                return
            self._asleep = cache.cache_desc
        freed = self.leases.free_held("the KV cache was put to sleep")
        for each in caches:
            self.cm.unregister_cache(each.cache_id)
        logger.info("llm_datadist: KV caches unregistered for sleep mode%s",
                    f"; freed the blocks of {freed} request(s) held for decode engines" if freed else "")

    def restore(self) -> None:
        """After wake-up: the same tensors registered again, under a new registry generation, so
        peers plan their transfers against the new registration. Idempotent."""
        with self._lock:
            desc = self._asleep
        if desc is None:
            return
        self._register()
        with self._lock:
            self._asleep = None
        logger.info("llm_datadist: KV caches registered again after sleep mode")

    def _listening_port(self) -> int:
        return int(self.dd.listen_ip_info.rsplit(":", 1)[1]) if self.producer else 0

    def handshake(self) -> LLMDataDistHandshakeMetadata:
        port = self._listening_port()
        return LLMDataDistHandshakeMetadata(self.engine_id, self.cluster_id, self.options.advertise_host, port,
                                            lease_key=self.leases.key.hex(), tp_rank=self.tp_rank,
                                            tp_size=self.tp_size, pp_rank=self.pp_rank, pp_size=self.pp_size)

    # -- each step --------------------------------------------------------------------------------
    def start(self, meta: LLMDataDistConnectorMetadata) -> None:
        if self.pusher is not None:
            self.pusher.begin(meta)
        if self.receiver is not None:
            self.receiver.on_step(meta.push_regs, meta.push_cancel)
        freed = self.leases.take_leases(meta.reqs_to_send, meta.stopping, meta.blocks_to_send)
        if meta.rank_table and self.rank == 0:
            # rank 0 answers rank queries: a decode side asks remote_host:remote_port, which is rank 0
            if meta.rank_table[0].get("cluster_id") == self.cluster_id:
                self.leases.set_rank_table(meta.rank_table)
            else:
                logger.error("llm_datadist: the scheduler's table of ranks does not begin with this worker (cluster "
                             "%d); rank queries are refused", self.cluster_id)
        if self.rank == 0:  # one question per request, from one worker; the scheduler tells the others
            for req_id, spec in meta.reqs_to_ask.items():
                self._count("ranks_asked", 1)
                if not self.peers.submit(spec, lambda r=req_id, sp=spec: self._ask_ranks(r, sp)):
                    self._answered(req_id, {"why": "this engine is shutting down"})
        for req_id, spec in meta.reqs_parked.items():
            # each rank renews the leases of the prefill ranks it will pull from or release
            self.peers.park(req_id, spec.peers(self.tp_rank, self.tp_size, self.pp_rank, self.pp_size))
        for req_id in meta.reqs_to_recv:
            self.peers.unpark(req_id)
        pulls = []
        with self._lock:
            for req_id, spec in self._peer_specs(meta.reqs_to_recv):
                key = (spec.cluster_id, spec.remote_request_id)
                if not spec.awaiting and key in self._settled:
                    # Nothing to load, and another request of ours has already pulled or
                    # released these prefill blocks (or found their engine gone): say nothing twice.
                    logger.debug("request %s: prefill request %s already settled by request %s", req_id,
                                 spec.remote_request_id, self._settled[key])
                    continue
                self._settled[key] = req_id
                while len(self._settled) > _SETTLED_REMEMBERED:
                    self._settled.popitem(last=False)
                pulls.append((req_id, spec))
            for req_id, spec in pulls:
                if spec.awaiting:  # (counted before any of them runs)
                    self._pending.setdefault(req_id, [0, False])[0] += 1
        if freed is not None:
            logger.warning("llm_datadist: the engine is shutting down: freed the KV blocks of %d finished "
                           "request(s) that no decode engine had taken yet (a decode engine that comes for them "
                           "is refused); requests that finish from now on hand out no KV", freed)
        for req_id, spec in pulls:
            self.peers.submit(spec, lambda r=req_id, sp=spec: self._pull(r, sp))

    def _peer_specs(self, reqs_to_recv: Dict[str, Recv]) -> List[Tuple[str, Recv]]:
        """``(request id, spec)`` for each prefill rank this rank pulls from or releases
        (``Recv.peers``): with the same TP size, the rank of our number; with another, the ranks
        holding some of our KV heads (their head ranges), or, where the scheduler computes the
        prompt, the releases of the ranks ``p % tp_size == tp_rank``. A request parked for a load
        that this rank cannot do is reported failed."""
        out = []
        for req_id, spec in reqs_to_recv.items():
            peers = spec.peers(self.tp_rank, self.tp_size, self.pp_rank, self.pp_size)
            if spec.awaiting and not any(p.awaiting for p in peers):
                logger.error("request %s: its prefill engine has tensor parallel size %d and pipeline parallel size "
                             "%d, this one %d and %d; reporting its KV as not loaded", req_id, spec.tp_size,
                             spec.remote_pp_size, self.tp_size, self.pp_size)
                self.recorder.count("failed_pulls")
                self.recorder.fail("incompatible_peer")
                self._recved.add(req_id)
                self._failed.add(req_id)
                self._load_errors.update(spec.local_block_ids)
            out.extend((req_id, peer) for peer in peers)
        return out

    def _ask_ranks(self, req_id: str, spec: Recv) -> None:
        """Ask the prefill worker at the spec's address (rank 0 of its engine) what the request's
        params did not say: every rank's address and release id, and whether it counts readers
        (``LeaseBook.on_ranks``), naming rank 0's release id with its lease token; the answer, or
        why there is none, goes to the scheduler (``take_worker_meta``)."""
        message = {"op": "ranks", "request_id": spec.remote_request_id}
        try:
            reply = self.peers.on_link(spec, lambda cluster_id: self._links_api.notify(
                cluster_id, message, self.peers.notify_timeout_ms))
        except Unreachable as exc:
            answer: Dict[str, Any] = {"why": f"it is unreachable: {exc}"}
        except ld.LLMException as exc:
            answer = {"why": f"the question failed: {exc}"}
        else:
            answer = read_ranks_reply(reply, spec.remote_request_id)
        self._answered(req_id, answer)

    def _answered(self, req_id: str, answer: Dict[str, Any]) -> None:
        with self._lock:
            self._answers[req_id] = answer
            if "ranks" not in answer:
                self._stats["ranks_unanswered"] += 1

    def take_worker_meta(self) -> Optional[LLMDataDistWorkerMetadata]:
        """The answers about our requests' ranks since the last step, for the scheduler (None if none)."""
        with self._lock:
            answers, self._answers = self._answers, {}
        return LLMDataDistWorkerMetadata(answers) if answers else None

    def results(self) -> KVConnectorTransferResults:
        sent = self.leases.take_finished()
        if self.pusher is not None:
            self.pusher.forget(sent)
        pushed, push_failed = self.receiver.take() if self.receiver is not None else (set(), set())
        with self._lock:
            out = KVConnectorTransferResults(finished_sending=sent, finished_recving=self._recved | pushed,
                                             failed_recving=self._failed | push_failed)
            self._recved, self._failed = set(), set()
        return out

    def block_ranges(self, blocks: List[int]) -> List[Tuple[int, int]]:
        """``(address, nbytes)`` of blocks ``blocks`` in every registered tensor (one KV cache group)."""
        out = []
        for t in self._keep:
            size = t[0].numel() * t.element_size()
            base = t.data_ptr()
            if any(b >= t.shape[0] for b in blocks):
                raise ValueError(f"block ids beyond the {t.shape[0]} blocks of the KV cache")
            out.extend((base + b * size, size) for b in blocks)
        return out

    def take_load_errors(self) -> Set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        # With several KV cache groups vLLM cannot map block ids to requests (and raises): their
        # failed loads reach it as failed_recving only.
        return errors if self.num_kv_groups == 1 else set()

    # -- decode side ------------------------------------------------------------------------------
    def _pull(self, req_id: str, spec: Recv) -> None:
        """Pull the request's blocks, then have the prefill side release them; the request is
        reported done in every case, and failed unless both steps succeeded. At most one line is
        logged per request, saying what happened."""
        local = spec.local_block_ids  # (of every group)
        ok, kind = False, "transfer_failed"
        try:
            kind = self._pull_and_release(req_id, spec)
            ok = kind is None
        except Exception:  # noqa: BLE001 - whatever happens, vLLM must hear about the request
            logger.exception("request %s: KV load failed", req_id)
        finally:
            with self._lock:
                if spec.awaiting:
                    pending = self._pending.get(req_id)
                    if pending is not None:
                        pending[0] -= 1
                        pending[1] = pending[1] or not ok
                    if pending is None or pending[0] <= 0:  # the last of its pulls on this rank
                        self._pending.pop(req_id, None)
                        self._recved.add(req_id)
                        if not ok or (pending is not None and pending[1]):
                            self._failed.add(req_id)
                    if not ok:
                        self._load_errors.update(local)
                if local:
                    self._stats["pulled_requests" if ok else "failed_requests"] += 1
                    if ok:
                        self._stats["pulled_blocks"] += len(local)
            if local and not ok:
                self.recorder.count("failed_pulls")
                self.recorder.fail(kind)

    def _pull_and_release(self, req_id: str, spec: Recv) -> Optional[str]:
        """None if the blocks (if any) were pulled and released, else the failure's kind
        (``metrics.KINDS``)."""
        local = spec.local_block_ids
        where = f"the prefill engine at {spec.host}:{spec.port}" + \
            (f" (cluster {spec.cluster_id})" if spec.cluster_id is not None else "")
        pull_error = None
        if local:
            with self._lock:
                registered, classes, asleep = list(self.caches), list(self._classes), self._asleep is not None
            try:
                pairs = [] if block_sizes.differ(spec, self.block_size) else pair_blocks(spec, max(1, len(self.groups)))
                if asleep:
                    raise ValueError("this engine's KV caches are unregistered (sleep mode)")
                self.peers.on_link(spec, lambda cluster_id: self._pull_blocks(spec, registered, classes, pairs,
                                                                                   cluster_id))
            except Unreachable as exc:
                # No link, so no release can be sent either: if that engine is alive, its lease
                # frees the blocks.
                logger.error("request %s: nothing pulled: %s is unreachable (%s); reporting prefill request %s "
                             "as not loaded", req_id, where, exc, spec.remote_request_id)
                return failure_kind(exc)
            except (ld.LLMException, TypeError, ValueError) as exc:  # compat.Incompatible included
                pull_error = exc  # the link works: still tell the prefill side to free the blocks
        released, why, release_kind = self._release_remote(spec)
        if pull_error is not None:
            told = ("it was told to free them" if released else
                    f"it no longer held them: {why}" if released is False else
                    f"it could not be told to free them ({why}) and does when its lease ends")
            what = "refused" if isinstance(pull_error, compat.Incompatible) else "failed"
            logger.error("request %s: pulling %d blocks of prefill request %s from %s %s: %s; reporting them "
                         "as not loaded; %s", req_id, len(local), spec.remote_request_id, where, what, pull_error,
                         told)
            return failure_kind(pull_error)
        if released:
            return None
        if local:
            # What we read may have been reused: the prefill side no longer held the blocks
            # when we said we were done (its lease ran out), or could not be asked.
            logger.error("request %s: pulled prefill request %s, but %s %s; reporting its blocks as not loaded",
                         req_id, spec.remote_request_id, where,
                         f"no longer held them: {why}" if released is False else
                         f"could not confirm that it still held them: {why}")
            return release_kind
        if released is None:
            logger.warning("request %s: could not tell %s that it may free the blocks of prefill request %s (%s); "
                           "it frees them when its lease ends", req_id, where, spec.remote_request_id, why)
        return None

    def _pull_blocks(self, spec: Recv, registered: List[ld.Cache], classes: List[caches.CacheClass],
                     pairs: List[Tuple[int, List[int], List[int]]], cluster_id: int) -> None:
        """Pull ``pairs`` (``(group, remote ids, local ids)``, ``pair_blocks``) from ``cluster_id``
        (the one linked at the spec's address), each group from and into its own caches
        (``registered``, one per class of ``classes``), timed for
        vLLM's metrics, tagged for the prefill engine's read guard (``LeaseBook.read_guard``);
        ``compat.Incompatible`` (nothing pulled) if the request or the link's peer was refused."""
        why = spec.refused or self.peers.peer(spec).incompatible
        said, linked = spec.remote_block_size or self.block_size, self._link_block_sizes.get(cluster_id)
        if not why and linked is not None and linked != said:  # (a router that dropped remote_block_size)
            why = f"its request says blocks of {said} tokens, the prefill engine's link says {linked}"
        why = why or kv_layouts.refusal(self.compat.get("kv_layout"), self.link_layouts.of(cluster_id),
                                        block_sizes.differ(spec, self.block_size), bool(spec.heads))
        if why:
            raise compat.Incompatible(why)
        if spec.heads and self._head_bytes is None:
            raise compat.Incompatible(f"this engine has another tensor parallel size than the prefill engine, and "
                                      f"{self._heads_refusal}")
        start = time.perf_counter()
        nbytes = blocks = 0
        if block_sizes.differ(spec, self.block_size):
            with self.dd.engine.read_tag(spec.remote_request_id):
                blocks, nbytes = self.sizes.pull(self.dd.engine, spec, registered, classes, cluster_id)
            self._count("pulled_other_block_size", 1)
            self.recorder.pull(time.perf_counter() - start, blocks, nbytes)
            return
        with self.dd.engine.read_tag(spec.remote_request_id):
            for group, remote, local in pairs:
                if not local:
                    continue
                if spec.heads:
                    # this rank's heads, one byte range of each block on both sides (one group only)
                    size = self._head_bytes
                    self.dd.engine.pull_block_range(cluster_id, 0, registered[0].cache_id, remote, local,
                                                    spec.src_head * size, spec.dst_head * size, spec.heads * size)
                    nbytes += len(local) * len(self._keep) * spec.heads * size
                else:
                    # the group's blocks in each of its caches (one per shape of its layers), cache k
                    # from the peer's cache k: the link's hello found both sides' caches the same
                    # (``caches.mismatch``)
                    for k, cls in enumerate(classes):
                        if cls.group != group:
                            continue
                        if cls.ranges is not None:
                            # a state-space group: the bytes of its states in each page (state.py)
                            if k >= len(registered):
                                raise ValueError("this engine's KV caches are not registered")
                            for offset, size in cls.ranges:
                                self.dd.engine.pull_block_range(cluster_id, k, registered[k].cache_id, remote, local,
                                                                offset, offset, size)
                            self._count(f"pulled_state_bytes_group{group}", len(local) * cls.block_bytes)
                        else:
                            # (whole blocks, or each head's strided runs between KV cache layouts)
                            kv_layouts.pull(self.cm, self.dd.engine, cluster_id, k, registered[k] if k < len(
                                registered) else None, cls, remote, local, self.link_layouts.of(cluster_id))
                        nbytes += len(local) * cls.block_bytes
                        if len(classes) > 1:
                            self._count(f"pulled_blocks_cache{k}", len(local))  # (``caches.plan``)
                blocks += len(local)
                if len(pairs) > 1:
                    self._count(f"pulled_blocks_group{group}", len(local))
        # (a prefill engine's pull of the prefix a decode engine held: ``bidirectional``)
        self.recorder.transfer("bidirectional" if spec.next_turn else "pull", time.perf_counter() - start, blocks,
                               nbytes)

    def _hello(self, cluster_id: int, where: str) -> Optional[str]:
        """Once per link (``Peers`` calls it when a link is made): ``compat.ask``; the block size the
        peer said is kept for the link's pulls (``_pull_blocks``)."""
        why, theirs, said = compat.ask(lambda peer, message: self._links_api.notify(peer, message,
                                                                                    self.peers.notify_timeout_ms),
                                       cluster_id, self.compat, where, LINK_BROKEN, self.recorder.count)
        self.link_layouts.learn(cluster_id, said)
        with self._lock:
            self._link_block_sizes.pop(cluster_id, None)
            if theirs is not None:
                self._link_block_sizes[cluster_id] = theirs
                while len(self._link_block_sizes) > MAX_LINKED_SIZES:
                    self._link_block_sizes.popitem(last=False)
        return why

    def _on_notify(self, peer_cluster_id: int, message: Any) -> Dict[str, Any]:
        """A linked decode worker's notification (on the link's thread): its description, or a
        lease's release or renewal, or a question about a request's ranks."""
        if isinstance(message, dict) and message.get("op") == "hello":
            return compat.answer(peer_cluster_id, message, self.compat, self.recorder.count)
        if isinstance(message, dict) and message.get("op") in ("push_reg", "push_cancel"):
            if self.pusher is None:
                return {"accepted": False, "why": "this prefill engine runs in pull mode (transfer_mode)"}
            if message["op"] == "push_cancel":
                return self.pusher.on_cancel(peer_cluster_id, message)
            return self.pusher.on_reg(peer_cluster_id, message)
        return self.leases.on_message(peer_cluster_id, message)

    def _release_remote(self, spec: Recv) -> Tuple[Optional[bool], str, str]:
        """Tell the prefill worker, over the link, that the request's blocks may be freed.
        ``(True, "", "")`` if it still held them, ``(False, why, kind)`` if it had freed them already
        (``lease_expired``) or refused the release (``guard_refused``), ``(None, why, kind)`` if it
        could not be told (the failure's kind, ``metrics.KINDS``)."""
        message = {"op": "release", "request_id": spec.remote_request_id}
        if spec.readers > 1:  # other decode ranks read these blocks too: freed at the last release
            message["readers"] = spec.readers
        try:
            reply = self.peers.on_link(spec, lambda cluster_id: self._links_api.notify(
                cluster_id, message, self.peers.notify_timeout_ms))
        except (Unreachable, ld.LLMException) as exc:
            return None, str(exc), failure_kind(exc)
        if not isinstance(reply, dict) or reply.get("request_id") != spec.remote_request_id:
            return None, "a malformed answer", "transfer_failed"
        with self._lock:
            self._stats["notified"] += 1
        if reply.get("released"):
            return True, "", ""
        why = str(reply.get("why", ""))[:200]
        # (``LeaseBook.release``'s words for blocks freed when their lease ended, or a lease that ended
        # long ago; any other refusal is the lease book's check)
        expired = why.endswith("(lease ended)") or why == "its lease has ended"
        return False, why, "lease_expired" if expired else "guard_refused"

    def close(self) -> None:
        """Stop this worker and finalize its engine. Again does nothing: vLLM calls the connector's
        ``shutdown`` a second time at exit (from a ``weakref`` finalizer), on an engine gone."""
        if self._closed:
            return
        self._closed = True
        if self.pusher is not None:
            self.pusher.close()
        if self.receiver is not None:
            self.receiver.close()
        if self.producer:
            self._links_api.set_notify_handler(None)
            if self.options.lease_tokens and self.cache is not None:
                self._links_api.set_read_guard(None)
        held = self.leases.close()
        if held:
            # No drain freed them (an engine stopped in-process, or by a signal vLLM did not turn
            # into a drain): they go with this engine.
            logger.warning("llm_datadist: shutting down with the KV blocks of %d finished requests still held "
                           "for decode engines; those find this engine gone", held)
        self.peers.close()
        self.dd.finalize()


def read_ranks_reply(reply: Any, remote_id: str) -> Dict[str, Any]:
    """What a prefill worker's answer to a rank query says, for the scheduler: ``{"ranks": [...],
    "readers_counted": bool}`` (checked there as ``kv_transfer_params`` are), or ``{"why": ...}``.
    An answer without ``ranks`` comes from an older release, which takes the question for a
    malformed release."""
    if not isinstance(reply, dict) or "ranks" not in reply:
        return {"why": "it does not answer rank queries (an older release?)"}
    if reply.get("request_id") != remote_id:
        return {"why": "its answer names another request"}
    ranks = reply["ranks"]
    if ranks is None:
        return {"why": "it refused: " + str(reply.get("why", "?"))[:200]}
    if not isinstance(ranks, list):
        return {"why": "its answer is malformed"}
    return {"ranks": ranks, "readers_counted": reply.get("readers_counted") is True}


def pair_blocks(spec: Recv, num_groups: int) -> List[Tuple[int, List[int], List[int]]]:
    """``(group, remote ids, local ids)`` per KV cache group: a group's local blocks take the tail
    of its remote ones (a local prefix-cache hit covers the first blocks; a sliding-window group
    needs only its last ones). ValueError if the spec names more than this engine's ``num_groups``, or
    fewer remote blocks than local ones (they come from outside)."""
    pairs = []
    for group, remote, local in spec.group_pairs():
        if group >= num_groups:
            raise ValueError(f"blocks of KV cache group {group}, but this engine moves {num_groups} group(s)")
        if len(remote) < len(local):
            where = f" of KV cache group {group}" if spec.remote_groups else ""
            raise ValueError(f"{len(remote)} remote blocks{where} for {len(local)} local ones")
        pairs.append((group, remote[len(remote) - len(local):], local))
    return pairs

