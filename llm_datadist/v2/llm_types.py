"""CANN's ``llm_datadist.v2.llm_types``: the value types of the Python API, from
``llm_datadist.llm_types`` (and ``DataType``, ``LLMException``, ``LLMStatusCode``, which CANN's
module imports and programs import from it)."""

from llm_datadist.data_type import DataType
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
    Memtype,
    Placement,
    PushType,
    RegisterMemStatus,
    TransferConfig,
    TransferWithCacheKeyConfig,
    check_layer_range,
    int_to_mem_status_dict,
)
from llm_datadist.status import LLMException, LLMStatusCode

# CANN's __all__ for this module, as CANN writes it (without the names its __init__ imports from
# here besides these, e.g. MemInfo).
__all__ = ["CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "BlocksCacheKey",
           "Placement", "CacheTask", "TransferConfig", "LayerSynchronizer", "Cache"]
