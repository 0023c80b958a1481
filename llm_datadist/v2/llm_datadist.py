"""CANN's ``llm_datadist.v2.llm_datadist``: ``LLMDataDist`` and its exit hook
``_shutdown_handler`` (``llm_datadist.llm_datadist``), with the names CANN's module imports that
this package has (``EngineConfig`` among them, which this ``LLMDataDist`` does not use: it has no
v1 mode)."""

from llm_datadist.cache_manager import CacheManager
from llm_datadist.configs import LLMClusterInfo, LLMRole
from llm_datadist.llm_datadist import LLMDataDist, _shutdown_handler
from llm_datadist.llm_types import RegisterMemStatus, int_to_mem_status_dict
from llm_datadist.status import LLMException, LLMStatusCode, code_2_status, handle_llm_status
from llm_datadist.v2.config import EngineConfig  # CANN's v1 mode's; nothing here calls it
from llm_datadist.v2.llm_utils import parse_listen_ip_info

__all__ = ["LLMDataDist"]
