"""The connector vLLM builds twice, once per role: the scheduler half (``scheduler.Scheduler``) in
the engine core, the worker half (``worker.Worker``) in each worker."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from llm_datadist.integrations.vllm import compat, layout, stages
from llm_datadist.integrations.vllm.backoff import drafter_backoff
from llm_datadist.integrations.vllm import groups as kv_groups
from llm_datadist.integrations.vllm.meta import (LLMDataDistConnectorMetadata, LLMDataDistHandshakeMetadata,
                                                 LLMDataDistWorkerMetadata)
from llm_datadist.integrations.vllm.metrics import LLMDataDistKVConnectorStats, LLMDataDistPromMetrics
from llm_datadist.integrations.vllm.options import Options
from llm_datadist.integrations.vllm.scheduler import Scheduler
from llm_datadist.integrations.vllm.worker import Worker

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput


class LLMDataDistConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector over llm_datadist: decode engines pull prefill blocks. It supports vLLM's
    hybrid KV cache manager (``SupportsHMA``): each KV cache group's blocks move, a sliding-window
    group's only inside its window, a state-space (Mamba) group's running-state block (``groups``,
    ``state``)."""

    #: vLLM's label of the prompt tokens this connector loads (``vllm:prompt_tokens_cached_by_source``):
    #: they come from another vLLM instance.
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.engine_id = str(transfer.engine_id)
        self.options = Options.parse(transfer.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        aux_output = getattr(vllm_config, "aux_output_config", None)
        if getattr(aux_output, "enable_return_routed_experts", False):
            # vLLM 0.33 refuses it with its own P2P connectors: the prefill's routed experts are
            # not handed to the decode side.
            raise ValueError("--enable-return-routed-experts is incompatible with LLMDataDistConnector: "
                             "the routed experts of a prefill are not passed to its decode engine")
        # (refuses the group kinds and Mamba cache modes it cannot move)
        self._groups = kv_groups.transfer_groups(kv_cache_config)
        if self.options.transfer_mode == "push":
            _check_push(transfer, parallel, self._groups)
        _check_pipeline(parallel, self._groups)
        num_groups = len(getattr(kv_cache_config, "kv_cache_groups", None) or ()) or 1
        self._scheduler: Optional[Scheduler] = None
        self._worker: Optional[Worker] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = Scheduler(self.engine_id, self.options, vllm_config.cache_config.block_size,
                                         producer=bool(transfer.is_kv_producer) or self.options.bidirectional_kv_xfer,
                                         tp_size=parallel.tensor_parallel_size,
                                         kv_heads=_kv_heads(vllm_config), groups=self._groups,
                                         num_groups=num_groups, backoff=drafter_backoff(vllm_config),
                                         pp_size=parallel.pipeline_parallel_size)
        else:
            self._worker = Worker(vllm_config, self.engine_id, self.options, kv_cache_config, self._groups)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> Optional[str]:
        """``LBHNC``: every layer's KV view is then one contiguous run of its blocks, registered
        where it is. None (vLLM's default, LBNHC) for MLA models: with their one head, that layout
        is contiguous per layer too."""
        model = getattr(vllm_config, "model_config", None)
        if model is None or getattr(model, "use_mla", False):
            return None
        return layout.REQUIRED_LAYOUT

    # -- scheduler side ---------------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> Tuple[int, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> LLMDataDistConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def request_finished(self, request, block_ids) -> Tuple[bool, Optional[Dict[str, Any]]]:
        # (vLLM calls this only for connectors without SupportsHMA: one group's list)
        return self._scheduler.request_finished(request, (list(block_ids),))

    def request_finished_all_groups(self, request, block_ids) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # (the answers of prefill engines asked for what a request's params lacked)
        self._scheduler.update_connector_output(connector_output)

    def set_xfer_handshake_metadata(self, metadata: Dict[int, KVConnectorHandshakeMetadata]) -> None:
        # Under MultiConnector every child gets the metadata one of them published: another
        # connector's is not ours to read (and does not replace ours).
        ours = {rank: m for rank, m in metadata.items() if isinstance(m, LLMDataDistHandshakeMetadata)}
        if ours:
            self._scheduler.set_workers(ours)  # {tp_rank: handshake}

    def set_xfer_handshake_metadata_pp_aware(self, metadata: Dict[Tuple[int, int], KVConnectorHandshakeMetadata]
                                             ) -> None:
        # (what vLLM's engine core calls: every worker's handshake by (pp_rank, tp_rank))
        ours = {key: m for key, m in metadata.items() if isinstance(m, LLMDataDistHandshakeMetadata)}
        if ours:
            self._scheduler.set_workers(stages.by_flat_rank(ours, self._scheduler.tp_size))

    def get_loaded_kv_cache_group_ids(self, request) -> tuple:
        # a pull restores the request's own blocks of every group that moves
        return tuple(g.index for g in self._groups) or (0,)

    # -- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> Optional[LLMDataDistHandshakeMetadata]:
        return self._worker.handshake() if self._worker is not None else None

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker.start(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous: the scheduler waits for them

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        # pull mode: nothing (decode engines pull); push mode: the layer goes to registered requests
        pusher = self._worker.pusher if self._worker is not None else None
        if pusher is not None:
            pusher.begin(self._get_connector_metadata())
            pusher.save_layer(layer_name)

    def wait_for_save(self) -> None:
        pusher = self._worker.pusher if self._worker is not None else None
        if pusher is not None and self.has_connector_metadata():
            pusher.begin(self._get_connector_metadata())
            pusher.wait()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
        # push mode works from save_kv_layer, which a full CUDA graph would skip on replay
        return isinstance(extra_config, dict) and extra_config.get("transfer_mode") == "push"

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: Set[str]) -> KVConnectorTransferResults:
        return self._worker.results()

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> Optional[LLMDataDistWorkerMetadata]:
        return self._worker.take_worker_meta() if self._worker is not None else None

    # -- vLLM's stat loggers (metrics.py) -----------------------------------------------------------
    def get_kv_connector_stats(self) -> Optional[LLMDataDistKVConnectorStats]:
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> LLMDataDistKVConnectorStats:
        return LLMDataDistKVConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return LLMDataDistPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- sleep mode (vLLM 0.33: the GPU worker calls these around --enable-sleep-mode; 0.32's base
    # class has no such hooks and never calls them) ---------------------------------------------
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        return True

    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.unregister()

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.restore()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()

    # -- introspection (tests, logs) ----------------------------------------------------------------
    @property
    def stats(self) -> Dict[str, int]:
        """Worker counters: links made, requests pulled / failed, blocks pulled, releases sent (``notified``)
        and received (``released``; ``refused`` when too late, or for one of the reasons also counted in
        ``bad_token``: no valid lease token, ``too_long``: a request id over ``MAX_RELEASE_ID_BYTES``,
        ``over_budget``: no room in ``release_records_bytes``), leases that ran out (``expired``) or were
        cut short because the engine began to shut down (``freed_at_shutdown``), release records
        dropped early to stay within the budget (``records_dropped``); and ``release_record_bytes``,
        what the release records count now. Renewals of the leases of requests waiting in the queue:
        on the decode side ``renewed``, ``renew_refused`` (the prefill side said no: bad token,
        freed...), ``renew_failed`` (not delivered; tried again), and ``links_evicted`` (idle links
        dropped); on the prefill side ``lease_renewed`` and ``renewal_refused``. Rank queries (a
        request whose ``kv_transfer_params`` lacked ``remote_ranks``): on the decode side
        ``ranks_asked`` and ``ranks_unanswered`` (no usable answer: the prompt was computed); on
        the prefill side ``ranks_answered`` and ``ranks_refused``."""
        if self._worker is None:
            return {}
        return dict(self._worker.stats, release_record_bytes=self._worker.leases.record_bytes)

    @property
    def registration(self) -> Optional[Dict[str, Any]]:
        """What the worker registered with llm_datadist: ``cluster_id``, ``num_tensors``, ``shape``
        (block id first), ``dtype`` (a ``DataType`` name), ``placement`` (``HOST``/``DEVICE``),
        ``device`` (the tensors' torch device) and ``runtime`` (the engine's device runtime), all of
        the first cache; ``caches``: every cache (``caches.plan``: one per KV cache group and shape)
        as ``{"group", "num_tensors", "shape", "dtype", "layers"}``; None before ``register_kv_caches``."""
        if self._worker is None or self._worker.cache is None:
            return None
        desc = self._worker.cache.cache_desc
        return {"cluster_id": self._worker.cluster_id, "num_tensors": desc.num_tensors,
                "shape": list(desc.shape), "dtype": desc.data_type.name, "placement": desc.placement.name,
                "device": self._worker.device, "runtime": self._worker.dd.engine.runtime.name,
                "caches": self._worker.registered_caches()}


#: The name vllm-ascend gave its llm_datadist connector, so its configs need only the module path changed.
LLMDataDistCMgrConnector = LLMDataDistConnector


def _check_push(transfer, parallel, groups) -> None:
    """Push mode's start-up refusals: what it does not support yet, said once, with the fix."""
    if transfer.is_kv_producer and transfer.is_kv_consumer:
        raise NotImplementedError("LLMDataDistConnector: transfer_mode 'push' needs kv_role kv_producer or "
                                  "kv_consumer, not kv_both")
    if parallel.tensor_parallel_size != 1:
        raise NotImplementedError("LLMDataDistConnector: transfer_mode 'push' supports engines without tensor "
                                  f"parallelism only (this one has {parallel.tensor_parallel_size}); use "
                                  "transfer_mode 'pull'")
    if parallel.pipeline_parallel_size != 1:
        raise NotImplementedError("LLMDataDistConnector: transfer_mode 'push' supports engines without pipeline "
                                  f"parallelism only (this one has {parallel.pipeline_parallel_size}); use "
                                  "transfer_mode 'pull'")
    if len(groups) > 1:
        raise NotImplementedError(f"LLMDataDistConnector: transfer_mode 'push' supports models with one KV cache "
                                  f"group only (this one has {len(groups)}: {kv_groups.describe(groups)}); use "
                                  "transfer_mode 'pull', or --disable-hybrid-kv-cache-manager")


def _check_pipeline(parallel, groups) -> None:
    """Pipeline parallelism's start-up refusals (``stages``): what it does not move yet."""
    pp_size = parallel.pipeline_parallel_size
    if pp_size == 1:
        return
    if len(groups) > 1:
        raise NotImplementedError(f"LLMDataDistConnector: with pipeline_parallel_size {pp_size} it moves models with "
                                  f"one KV cache group only (this one has {len(groups)}: "
                                  f"{kv_groups.describe(groups)}); use --disable-hybrid-kv-cache-manager, or "
                                  "pipeline_parallel_size 1")


def _kv_heads(vllm_config) -> int:
    """The model's KV heads over all tensor parallel ranks (0 if its config does not say)."""
    heads = compat.fields(vllm_config).get("kv_heads")
    return heads if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0 else 0
