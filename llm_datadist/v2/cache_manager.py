"""CANN's ``llm_datadist.v2.cache_manager``: ``CacheManager`` (``llm_datadist.cache_manager``),
with the names CANN's module imports that this package has (the ``v2.llm_utils`` helpers among
them, which this ``CacheManager`` does not use)."""

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
from llm_datadist.v2.llm_utils import (
    TransferCacheParameters,
    layer_range_to_tensor_indices,
    pack_block_cache_key,
    pack_cache_desc,
    pack_cache_key,
    pack_cache_key_by_id,
    pack_mem_info,
    transfer_cache_async,
)
