"""llm_datadist: KV-cache transfer for disaggregated LLM serving, CANN LLM-DataDist API on any Linux.

The CANN Python API is exported here; the C++-style API (``LlmDataDist`` returning ``Status``
codes) lives in ``llm_datadist.cpp``.
"""

import os as _os

_os.environ.setdefault("AUTO_USE_UC_MEMORY", "0")

try:
    from llm_datadist import _core as _compiled_core  # noqa: F401
except ImportError as _exc:  # a source tree whose extensions were never built
    raise ImportError(
        f"llm_datadist's compiled core is missing from {_os.path.dirname(__file__)} ({_exc}). "
        "This is a source tree whose Cython extensions were not built: install the package "
        "(`pip install .`, or `pip install -e .` to work on it), or build it in place with "
        "`python setup.py build_ext --inplace` (`make build`)."
    ) from _exc
del _compiled_core

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

# CANN's module paths llm_datadist.v2.* (the same objects as above), loaded with the package as
# CANN's __init__ loads them, so that ``llm_datadist.v2.llm_types`` is there after ``import
# llm_datadist`` too.
from llm_datadist.v2 import cache_manager as _v2_cache_manager  # noqa: E402
from llm_datadist.v2 import config as _v2_config  # noqa: E402
from llm_datadist.v2 import llm_datadist as _v2_llm_datadist  # noqa: E402
from llm_datadist.v2 import llm_types as _v2_llm_types  # noqa: E402
from llm_datadist.v2 import llm_utils as _v2_llm_utils  # noqa: E402

del _v2_cache_manager, _v2_config, _v2_llm_datadist, _v2_llm_types, _v2_llm_utils

__version__ = "0.1.0"

__all__ = [
    "LLMDataDist", "LLMConfig", "LlmConfig", "LLMClusterInfo", "LLMRole", "LLMStatusCode",
    "LLMException", "Status", "DataType", "CacheDesc", "Cache", "KvCache", "CacheKey",
    "CacheKeyByIdAndIndex", "BlocksCacheKey", "Placement", "RegisterMemStatus", "LayerSynchronizer",
    "TransferConfig", "TransferWithCacheKeyConfig", "CacheTask", "Memtype", "MemInfo",
]

# CANN's list of the names its v2 modules provide (its own tests iterate it): __all__ without the
# v1 names below.
v2_list = list(__all__)

# CANN lists these in __all__ too; they are left out here because the v1 package they come from
# is not part of this library, and ``from llm_datadist import *`` must keep working.
_V1_NAMES = ("TensorDesc", "Tensor", "KvCacheManager")


def __getattr__(name: str):
    """CANN's lazy import of the v1-only classes from ``llm_datadist_v1``: without that package
    the import fails (``ModuleNotFoundError``, an ``ImportError``), as it does in CANN."""
    if name not in _V1_NAMES:
        raise AttributeError(f"Module 'llm_datadist' has no attribute '{name}'")
    import importlib

    return getattr(importlib.import_module("llm_datadist_v1"), name)
