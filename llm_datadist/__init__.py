"""llm_datadist: KV-cache transfer for disaggregated LLM serving, CANN LLM-DataDist API on any Linux.

The CANN Python API is exported here; the C++-style API (``LlmDataDist`` returning ``Status``
codes) lives in ``llm_datadist.cpp``.
"""

import os as _os

_os.environ.setdefault("AUTO_USE_UC_MEMORY", "0")

from llm_datadist.configs import LLMClusterInfo, LLMConfig, LlmConfig, LLMRole  # noqa: E402
from llm_datadist.data_type import DataType  # noqa: E402
from llm_datadist.llm_datadist import LLMDataDist  # noqa: E402
from llm_datadist.llm_types import (  # noqa: E402
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    CacheTask,
    KvCache,
    LayerSynchronizer,
    MemInfo,
    Memtype,
    Placement,
    RegisterMemStatus,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from llm_datadist.status import LLMException, LLMStatusCode, Status  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "LLMDataDist", "LLMConfig", "LlmConfig", "LLMClusterInfo", "LLMRole", "LLMStatusCode",
    "LLMException", "Status", "DataType", "CacheDesc", "Cache", "KvCache", "CacheKey",
    "CacheKeyByIdAndIndex", "BlocksCacheKey", "Placement", "RegisterMemStatus", "LayerSynchronizer",
    "TransferConfig", "TransferWithCacheKeyConfig", "CacheTask", "Memtype", "MemInfo",
]
