"""CANN's ``llm_datadist.v2`` module paths (hicann/hixl, ``src/python/llm_datadist/llm_datadist/v2/``).

Every name each of CANN's five v2 modules binds at module level (what it defines, and what it
imports from CANN's own package; not the standard library's names) is listed below: either it is
provided, as the very object the rest of this package has, or it is absent and the entry says
why. A v2 module here has exactly the public names marked provided, nothing else.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

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
CHECKS = ("CANN's argument-check helpers (status.raise_if_*, utils.utils.check_*); the checks here "
          "raise what CANN's raise, from llm_datadist._validate, whose signatures differ")
PACKING = "packs arguments into tuples for CANN's native wrapper"
JOBS = "CANN's layer-wise job around its native transfer call; here CacheManager.transfer_cache_async and the engine"
V1 = "the v1 (KvCacheManager) mode's option and resource-file parsing; the v1 mode is not implemented"
UNUSED = "not used by CANN's own code; CacheDesc.size gives a tensor's bytes"
PRIVATE = "a private constant of CANN's module"

CANN_V2_NAMES = {
    v2_llm_types: {
        # defined in CANN's v2/llm_types.py
        "PushType": PROVIDED, "RegisterMemStatus": PROVIDED, "Memtype": PROVIDED, "MemInfo": PROVIDED,
        "int_to_mem_status_dict": PROVIDED, "Placement": PROVIDED, "CacheDesc": PROVIDED, "Cache": PROVIDED,
        "BlocksCacheKey": PROVIDED, "CacheKey": PROVIDED, "CacheKeyByIdAndIndex": PROVIDED, "KvCache": PROVIDED,
        "LayerSynchronizer": PROVIDED, "check_layer_range": PROVIDED, "TransferWithCacheKeyConfig": PROVIDED,
        "TransferConfig": PROVIDED, "CacheTask": PROVIDED, "_INVALID_ID": PRIVATE,
        # imported there from CANN's package
        "LLMException": PROVIDED, "DataType": PROVIDED, "LLMStatusCode": PROVIDED, "llm_wrapper": NATIVE,
        "log": LOG, "raise_if_false": CHECKS, "raise_if_true": CHECKS, "check_isinstance": CHECKS,
        "check_uint32": CHECKS, "check_int32": CHECKS, "check_uint64": CHECKS, "check_int64": CHECKS,
        "check_list_int64": CHECKS, "check_list_uint64": CHECKS,
    },
    v2_cache_manager: {
        "CacheManager": PROVIDED, "_NUM_TENSORS_PER_LAYER": PRIVATE, "_INVALID_ID": PRIVATE,
        "handle_llm_status": PROVIDED, "CacheDesc": PROVIDED, "Cache": PROVIDED, "CacheKey": PROVIDED,
        "CacheKeyByIdAndIndex": PROVIDED, "BlocksCacheKey": PROVIDED, "Placement": PROVIDED,
        "TransferConfig": PROVIDED, "CacheTask": PROVIDED, "LayerSynchronizer": PROVIDED,
        "TransferWithCacheKeyConfig": PROVIDED, "PushType": PROVIDED, "check_layer_range": PROVIDED,
        "MemInfo": PROVIDED, "Memtype": PROVIDED, "is_invalid_id": PROVIDED, "is_valid_id": PROVIDED,
        "raise_if_false": CHECKS, "raise_if_true": CHECKS, "log": LOG, "check_isinstance": CHECKS,
        "check_dict": CHECKS, "check_uint32": CHECKS, "check_int64": CHECKS, "check_uint64": CHECKS,
        "pack_cache_desc": PACKING, "pack_cache_key": PACKING, "pack_block_cache_key": PACKING,
        "pack_mem_info": PACKING, "pack_cache_key_by_id": PACKING, "transfer_cache_async": JOBS,
        "TransferCacheParameters": JOBS, "layer_range_to_tensor_indices": PACKING,
    },
    v2_llm_datadist: {
        "LLMDataDist": PROVIDED, "_shutdown_handler": PROVIDED, "_MAX_CLUSTER_NAME": PRIVATE,
        "_MAX_NODE_NUM": PRIVATE, "code_2_status": PROVIDED, "handle_llm_status": PROVIDED,
        "LLMStatusCode": PROVIDED, "LLMException": PROVIDED, "LLMRole": PROVIDED, "LLMClusterInfo": PROVIDED,
        "RegisterMemStatus": PROVIDED, "int_to_mem_status_dict": PROVIDED, "CacheManager": PROVIDED,
        "parse_listen_ip_info": PROVIDED, "EngineConfig": V1, "llm_datadist_wrapper": NATIVE, "log": LOG,
        "check_isinstance": CHECKS, "check_dict": CHECKS, "check_uint64": CHECKS, "check_int32": CHECKS,
        "check_uint32": CHECKS, "raise_if_false": CHECKS, "raise_if_true": CHECKS,
    },
    v2_config: {
        "ClusterConfig": V1, "EngineConfig": V1,
        "LLMRole": PROVIDED, "LlmConfig": PROVIDED, "trans_str_ip": PROVIDED, "log": LOG,
        "check_isinstance": CHECKS, "raise_if_false": CHECKS,
    },
    v2_llm_utils: {
        "is_invalid_id": PROVIDED, "is_valid_id": PROVIDED, "parse_listen_ip_info": PROVIDED,
        "_INVALID_ID": PRIVATE, "_MAX_DISPLAYED_REQ_ID_COUNT": PRIVATE, "_NUM_TENSORS_PER_LAYER": PRIVATE,
        "clone_cache_desc": UNUSED, "calc_tensor_size": UNUSED, "verify_cache_shape": V1, "to_data_type": V1,
        "CacheDescParser": V1, "pack_cache_desc": PACKING, "pack_cache_key": PACKING,
        "pack_cache_key_by_id": PACKING, "pack_block_cache_key": PACKING, "pack_mem_info": PACKING,
        "layer_range_to_tensor_indices": PACKING, "TransferCacheParameters": JOBS, "TransferCacheJob": JOBS,
        "TransferAsyncThread": JOBS, "_check_block_indices": JOBS, "transfer_cache_async": JOBS,
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

# Where each provided object lives in this package (the v2 name may differ from ours).
OURS = {"parse_listen_ip_info": python_api._parse_listen_ip_info, "_shutdown_handler": python_api._shutdown_handler}
for _module in (llm_types, cache_manager, configs, status, data_type, python_api):
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
    else:
        assert not hasattr(module, name), f"{name} is here although the table says: {reason}"


@pytest.mark.parametrize("module", list(CANN_V2_NAMES), ids=lambda m: m.__name__)
def test_a_v2_module_has_no_public_name_cann_s_lacks(module):
    public = {name for name in vars(module) if not name.startswith("_")}
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
