"""CANN's ``llm_datadist.v2.cache_manager``: ``CacheManager`` (``llm_datadist.cache_manager``),
with the names CANN's module imports that this package has."""

from llm_datadist.cache_manager import CacheManager
from llm_datadist.llm_types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    CacheTask,
    LayerSynchronizer,
    MemInfo,
    Memtype,
    Placement,
    PushType,
    TransferConfig,
    TransferWithCacheKeyConfig,
    check_layer_range,
    is_invalid_id,
    is_valid_id,
)
from llm_datadist.status import handle_llm_status
