"""CANN's ``llm_datadist.v2.llm_utils``: of CANN's helpers, those that mean something without its
native wrapper (the id tests and ``parse_listen_ip_info``), with the names CANN's module imports
that this package has. The rest of CANN's module packs arguments for its native wrapper and runs
its layer-wise jobs on it; here ``CacheManager.transfer_cache_async`` and the engine do that."""

from llm_datadist.data_type import DataType
from llm_datadist.llm_datadist import _parse_listen_ip_info as parse_listen_ip_info
from llm_datadist.llm_types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    CacheTask,
    KvCache,
    LayerSynchronizer,
    MemInfo,
    Placement,
    PushType,
    TransferConfig,
    TransferWithCacheKeyConfig,
    is_invalid_id,
    is_valid_id,
)
from llm_datadist.status import LLMException, LLMStatusCode, code_2_status
