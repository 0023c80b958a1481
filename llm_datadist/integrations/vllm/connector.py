"""The connector vLLM builds twice, once per role: the scheduler half (``scheduler.Scheduler``) in
the engine core, the worker half (``worker.Worker``) in each worker."""

from __future__ import annotations

from typing import Any, Dict, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from llm_datadist.integrations.vllm.meta import LLMDataDistConnectorMetadata, LLMDataDistHandshakeMetadata
from llm_datadist.integrations.vllm.options import Options
from llm_datadist.integrations.vllm.scheduler import Scheduler
from llm_datadist.integrations.vllm.worker import Worker


class LLMDataDistConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector over llm_datadist: decode engines pull prefill blocks."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.engine_id = str(transfer.engine_id)
        self.options = Options.parse(transfer.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise NotImplementedError("LLMDataDistConnector supports tensor and pipeline parallel size 1 only")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise NotImplementedError("LLMDataDistConnector supports models with one KV cache group only "
                                      f"(this one has {len(kv_cache_config.kv_cache_groups)})")
        self._scheduler: Optional[Scheduler] = None
        self._worker: Optional[Worker] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = Scheduler(self.engine_id, self.options, vllm_config.cache_config.block_size,
                                         producer=bool(transfer.is_kv_producer))
        else:
            self._worker = Worker(vllm_config, self.engine_id, self.options, kv_cache_config)

    # -- scheduler side ---------------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> Tuple[int, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> LLMDataDistConnectorMetadata:
        return self._scheduler.build_connector_meta()

    def request_finished(self, request, block_ids) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return self._scheduler.request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: Dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._scheduler.set_worker(metadata.get(0))

    def get_loaded_kv_cache_group_ids(self, request) -> tuple:
        return (0,)

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
        return  # decode engines pull; nothing is pushed while the prefill runs

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: Set[str]) -> KVConnectorTransferResults:
        return self._worker.results()

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self._worker.take_load_errors()

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
        dropped); on the prefill side ``lease_renewed`` and ``renewal_refused``."""
        if self._worker is None:
            return {}
        return dict(self._worker.stats, release_record_bytes=self._worker.leases.record_bytes)

    @property
    def registration(self) -> Optional[Dict[str, Any]]:
        """What the worker registered with llm_datadist: ``cluster_id``, ``num_tensors``, ``shape``
        (block id first), ``dtype`` (a ``DataType`` name), ``placement`` (``HOST``/``DEVICE``),
        ``device`` (the tensors' torch device) and ``runtime`` (the engine's device runtime);
        None before ``register_kv_caches``."""
        if self._worker is None or self._worker.cache is None:
            return None
        desc = self._worker.cache.cache_desc
        return {"cluster_id": self._worker.cluster_id, "num_tensors": desc.num_tensors,
                "shape": list(desc.shape), "dtype": desc.data_type.name, "placement": desc.placement.name,
                "device": self._worker.device, "runtime": self._worker.dd.engine.runtime.name}


#: The name vllm-ascend gave its llm_datadist connector, so its configs need only the module path changed.
LLMDataDistCMgrConnector = LLMDataDistConnector

