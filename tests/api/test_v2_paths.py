"""CANN's ``llm_datadist.v2`` module paths (hicann/hixl, ``src/python/llm_datadist/llm_datadist/v2/``).

Every name each of CANN's five v2 modules binds at module level (what it defines, and what it
imports from CANN's own package; not the standard library's names) is listed below: either it is
provided, as the very object the rest of this package has, or it is absent and the entry says
why (a private constant may be either: if it is here, it has CANN's value). A v2 module here has
exactly the public names marked provided, and names of the standard library, nothing else.
``tests/api/test_v2_helpers.py`` tests what the helpers of ``llm_utils`` and ``config`` do.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest

import llm_datadist as ld
from llm_datadist import cache_manager, configs, data_type, llm_types, status
from llm_datadist import llm_datadist as python_api
from llm_datadist.v2 import cache_manager as v2_cache_manager
from llm_datadist.v2 import config as v2_config
from llm_datadist.v2 import llm_datadist as v2_llm_datadist
from llm_datadist.v2 import llm_types as v2_llm_types
from llm_datadist.v2 import llm_utils as v2_llm_utils

PROVIDED = None  # the value of a provided name in the tables below

# Why a name CANN binds is absent here.
NATIVE = "CANN's native wrapper (pybind11 module); here the engine does its work"
LOG = "CANN's logging module (llm_datadist.utils.log); this package logs to the 'llm_datadist' logger"
CHECKS = ("CANN's argument-check helpers, which its v2 modules import from its status and utils.utils "
          "modules (they define none of them); the checks here raise what CANN's raise, from "
          "llm_datadist._validate, whose signatures differ")


class Private:
    """A private name of CANN's module: absent here, or CANN's value."""

    def __init__(self, value) -> None:
        self.value = value


UINT64_MAX = 2**64 - 1

CANN_V2_NAMES = {
    v2_llm_types: {
        # defined in CANN's v2/llm_types.py
        "PushType": PROVIDED, "RegisterMemStatus": PROVIDED, "Memtype": PROVIDED, "MemInfo": PROVIDED,
        "int_to_mem_status_dict": PROVIDED, "Placement": PROVIDED, "CacheDesc": PROVIDED, "Cache": PROVIDED,
        "BlocksCacheKey": PROVIDED, "CacheKey": PROVIDED, "CacheKeyByIdAndIndex": PROVIDED, "KvCache": PROVIDED,
        "LayerSynchronizer": PROVIDED, "check_layer_range": PROVIDED, "TransferWithCacheKeyConfig": PROVIDED,
        "TransferConfig": PROVIDED, "CacheTask": PROVIDED, "_INVALID_ID": Private(UINT64_MAX),
        # imported there from CANN's package
        "LLMException": PROVIDED, "DataType": PROVIDED, "LLMStatusCode": PROVIDED, "llm_wrapper": NATIVE,
        "log": LOG, "raise_if_false": CHECKS, "raise_if_true": CHECKS, "check_isinstance": CHECKS,
        "check_uint32": CHECKS, "check_int32": CHECKS, "check_uint64": CHECKS, "check_int64": CHECKS,
        "check_list_int64": CHECKS, "check_list_uint64": CHECKS,
    },
    v2_cache_manager: {
        "CacheManager": PROVIDED, "_NUM_TENSORS_PER_LAYER": Private(2), "_INVALID_ID": Private(UINT64_MAX),
        "handle_llm_status": PROVIDED, "CacheDesc": PROVIDED, "Cache": PROVIDED, "CacheKey": PROVIDED,
        "CacheKeyByIdAndIndex": PROVIDED, "BlocksCacheKey": PROVIDED, "Placement": PROVIDED,
        "TransferConfig": PROVIDED, "CacheTask": PROVIDED, "LayerSynchronizer": PROVIDED,
        "TransferWithCacheKeyConfig": PROVIDED, "PushType": PROVIDED, "check_layer_range": PROVIDED,
        "MemInfo": PROVIDED, "Memtype": PROVIDED, "is_invalid_id": PROVIDED, "is_valid_id": PROVIDED,
        "raise_if_false": CHECKS, "raise_if_true": CHECKS, "log": LOG, "check_isinstance": CHECKS,
        "check_dict": CHECKS, "check_uint32": CHECKS, "check_int64": CHECKS, "check_uint64": CHECKS,
        "pack_cache_desc": PROVIDED, "pack_cache_key": PROVIDED, "pack_block_cache_key": PROVIDED,
        "pack_mem_info": PROVIDED, "pack_cache_key_by_id": PROVIDED, "transfer_cache_async": PROVIDED,
        "TransferCacheParameters": PROVIDED, "layer_range_to_tensor_indices": PROVIDED,
    },
    v2_llm_datadist: {
        "LLMDataDist": PROVIDED, "_shutdown_handler": PROVIDED, "_MAX_CLUSTER_NAME": Private(128),
        "_MAX_NODE_NUM": Private(4), "code_2_status": PROVIDED, "handle_llm_status": PROVIDED,
        "LLMStatusCode": PROVIDED, "LLMException": PROVIDED, "LLMRole": PROVIDED, "LLMClusterInfo": PROVIDED,
        "RegisterMemStatus": PROVIDED, "int_to_mem_status_dict": PROVIDED, "CacheManager": PROVIDED,
        "parse_listen_ip_info": PROVIDED, "EngineConfig": PROVIDED, "llm_datadist_wrapper": NATIVE, "log": LOG,
        "check_isinstance": CHECKS, "check_dict": CHECKS, "check_uint64": CHECKS, "check_int32": CHECKS,
        "check_uint32": CHECKS, "raise_if_false": CHECKS, "raise_if_true": CHECKS,
    },
    v2_config: {
        "ClusterConfig": PROVIDED, "EngineConfig": PROVIDED,
        "LLMRole": PROVIDED, "LlmConfig": PROVIDED, "trans_str_ip": PROVIDED, "log": LOG,
        "check_isinstance": CHECKS, "raise_if_false": CHECKS,
    },
    v2_llm_utils: {
        "is_invalid_id": PROVIDED, "is_valid_id": PROVIDED, "parse_listen_ip_info": PROVIDED,
        "_INVALID_ID": Private(UINT64_MAX), "_MAX_DISPLAYED_REQ_ID_COUNT": Private(8),
        "_NUM_TENSORS_PER_LAYER": Private(2),
        "clone_cache_desc": PROVIDED, "calc_tensor_size": PROVIDED, "verify_cache_shape": PROVIDED,
        "to_data_type": PROVIDED, "CacheDescParser": PROVIDED, "pack_cache_desc": PROVIDED,
        "pack_cache_key": PROVIDED, "pack_cache_key_by_id": PROVIDED, "pack_block_cache_key": PROVIDED,
        "pack_mem_info": PROVIDED, "layer_range_to_tensor_indices": PROVIDED,
        "TransferCacheParameters": PROVIDED, "TransferCacheJob": PROVIDED, "TransferAsyncThread": PROVIDED,
        "_check_block_indices": PROVIDED, "transfer_cache_async": PROVIDED,
        # imported there from CANN's package
        "LLMException": PROVIDED, "LLMStatusCode": PROVIDED, "code_2_status": PROVIDED, "DataType": PROVIDED,
        "CacheDesc": PROVIDED, "KvCache": PROVIDED, "CacheKey": PROVIDED, "CacheKeyByIdAndIndex": PROVIDED,
        "BlocksCacheKey": PROVIDED, "Placement": PROVIDED, "CacheTask": PROVIDED, "TransferConfig": PROVIDED,
        "LayerSynchronizer": PROVIDED, "Cache": PROVIDED, "TransferWithCacheKeyConfig": PROVIDED,
        "PushType": PROVIDED, "MemInfo": PROVIDED, "python_dtype_2_dwrapper_dtype": NATIVE,
        "llm_datadist_wrapper": NATIVE, "log": LOG, "check_isinstance": CHECKS, "check_list_uint64": CHECKS,
        "check_uint64": CHECKS, "check_uint32": CHECKS, "raise_if_false": CHECKS, "raise_if_true": CHECKS,
    },
}

# Where each provided object lives in this package (the v2 name may differ from ours). CANN's
# helpers that only the v2 modules have live in v2.llm_utils and v2.config.
OURS = {"_shutdown_handler": python_api._shutdown_handler,
        "_check_block_indices": v2_llm_utils._check_block_indices}
for _module in (llm_types, cache_manager, configs, status, data_type, python_api, v2_llm_utils, v2_config):
    for _name in dir(_module):
        if not _name.startswith("_"):
            OURS.setdefault(_name, getattr(_module, _name))

CASES = [(module, name) for module, names in CANN_V2_NAMES.items() for name in names]


def case_id(case) -> str:
    module, name = case
    return f"{module.__name__.rsplit('.', 1)[1]}.{name}"


@pytest.mark.parametrize("module, name", CASES, ids=[case_id(c) for c in CASES])
def test_every_name_cann_s_v2_module_binds_is_provided_or_absent_for_a_reason(module, name):
    reason = CANN_V2_NAMES[module][name]
    if reason is PROVIDED:
        assert getattr(module, name) is OURS[name]
        if name in ld.__all__:
            assert getattr(module, name) is getattr(ld, name)
    elif isinstance(reason, Private):
        assert getattr(module, name, reason.value) == reason.value
    else:
        assert not hasattr(module, name), f"{name} is here although the table says: {reason}"


def is_standard_library(value) -> bool:
    """A module, class or function of the standard library (typing's names, dataclass, Thread)."""
    if isinstance(value, types.ModuleType):
        return value.__name__.split(".")[0] in sys.stdlib_module_names
    return getattr(value, "__module__", "").split(".")[0] in sys.stdlib_module_names


@pytest.mark.parametrize("module", list(CANN_V2_NAMES), ids=lambda m: m.__name__)
def test_a_v2_module_has_no_public_name_cann_s_lacks(module):
    public = {name for name, value in vars(module).items()
              if not name.startswith("_") and not is_standard_library(value)}
    assert public == {name for name, reason in CANN_V2_NAMES[module].items()
                      if reason is PROVIDED and not name.startswith("_")}


def test_the_serving_framework_import_line_works():
    code = textwrap.dedent("""
        from llm_datadist.v2.llm_types import Cache, CacheDesc, BlocksCacheKey
        import llm_datadist
        assert (Cache, CacheDesc, BlocksCacheKey) == (llm_datadist.Cache, llm_datadist.CacheDesc,
                                                      llm_datadist.BlocksCacheKey)
        from llm_datadist.v2.llm_datadist import LLMDataDist, _shutdown_handler
        from llm_datadist.v2.cache_manager import CacheManager
        from llm_datadist.v2.llm_utils import is_invalid_id
        from llm_datadist.v2.config import LlmConfig
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_import_llm_datadist_loads_the_v2_modules():
    code = "import llm_datadist as ld; print(ld.v2.llm_types.CacheDesc is ld.CacheDesc, ld.v2.config.LlmConfig)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("True "), out.stderr


def test_all_lists_are_cann_s():
    assert v2_llm_types.__all__ == ["CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "BlocksCacheKey",
                                    "Placement", "CacheTask", "TransferConfig", "LayerSynchronizer", "Cache"]
    assert v2_llm_datadist.__all__ == ["LLMDataDist"]
    for module in (v2_cache_manager, v2_config, v2_llm_utils):
        assert not hasattr(module, "__all__")


def test_v2_list_is_cann_s():
    assert sorted(ld.v2_list) == sorted([
        "LLMClusterInfo", "LLMStatusCode", "LLMException", "LLMRole", "LlmConfig", "LLMConfig", "DataType",
        "Status", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "Cache", "BlocksCacheKey",
        "LLMDataDist", "Placement", "RegisterMemStatus", "LayerSynchronizer", "TransferConfig", "CacheTask",
        "TransferWithCacheKeyConfig", "Memtype", "MemInfo"])
    assert all(hasattr(ld, name) for name in ld.v2_list)


def test_push_type_and_check_layer_range_are_cann_s():
    assert [(t.name, t.value) for t in v2_llm_types.PushType] == [
        ("NO_CACHE_KEY", 0), ("BLOCKS_CACHE_KEY", 1), ("CACHE_KEY_BY_ID", 2)]
    check = v2_llm_types.check_layer_range
    assert check("r", None) is None and check("r", range(0, 2)) is None
    with pytest.raises(TypeError):
        check("r", None, allow_none=False)
    with pytest.raises(TypeError):
        check("r", [0, 1])
    for bad, message in ((range(0, 4, 2), "check r.step == 1 failed"),
                         (range(2, 2), "check 0 <= range.start < range.stop failed, r = range(2, 2)")):
        with pytest.raises(ld.LLMException) as info:
            check("r", bad)
        assert info.value.status_code == ld.LLMStatusCode.LLM_PARAM_INVALID and info.value.args[0] == message


def test_v2_llm_utils_helpers():
    assert v2_llm_utils.is_invalid_id(2**64 - 1) and v2_llm_utils.is_invalid_id(-1)
    assert v2_llm_utils.is_valid_id(0) and not v2_llm_utils.is_valid_id(2**64 - 1)
    assert v2_llm_utils.parse_listen_ip_info("10.0.0.1:26000") == ("10.0.0.1", 26000)
    with pytest.raises(ld.LLMException):
        v2_llm_utils.parse_listen_ip_info("10.0.0.1")
    assert v2_config.trans_str_ip("127.0.0.1") == 0x0100007F and v2_config.trans_str_ip(5) == 5
