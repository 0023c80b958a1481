"""The C++-style API tells the caller's mistakes from its own: a bad argument is LLM_PARAM_INVALID,
an exception that comes up from the engine, transport or core (a bug) is LLM_FAILED with its
traceback logged."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from llm_datadist import _core, cpp
from llm_datadist.engine import engine as _engine

DESC = dict(num_tensors=2, data_type=cpp.DT_INT32, shape=[4, 8])



def raiser(exc: BaseException):
    def fault(*args, **kwargs):
        raise exc
    return fault


def internal_error_records(caplog, method: str):
    return [r for r in caplog.records if r.name == "llm_datadist" and r.levelno == logging.ERROR
            and r.getMessage().startswith(f"{method} failed with an internal error")]


@pytest.mark.parametrize("exc", [AttributeError("'NoneType' object has no attribute 'addrs'"),
                                 TypeError("unsupported operand"), KeyError("cache 12"),
                                 ValueError("bad internal state"), RuntimeError("engine broke")])
def test_an_engine_exception_is_llm_failed_with_its_traceback(dd, monkeypatch, caplog, exc):
    monkeypatch.setattr(dd.engine, "allocate", raiser(exc))
    cache = cpp.Cache()
    with caplog.at_level(logging.ERROR, logger="llm_datadist"):
        assert dd.AllocateCache(cpp.CacheDesc(**DESC), cache) == cpp.LLM_FAILED
    (record,) = internal_error_records(caplog, "AllocateCache")
    assert record.exc_info is not None and record.exc_info[1] is exc
    assert type(exc).__name__ in record.getMessage()
    assert "in fault" in caplog.text and "raise exc" in caplog.text  # the traceback, down to the raise
    assert cache.cache_id == -1


def test_a_fault_deep_in_the_engine_is_llm_failed(dd, monkeypatch, caplog):
    """The bug is two calls below the engine's entry point, in a helper the engine uses."""
    monkeypatch.setattr(_engine, "cache_geometry", raiser(TypeError("'int' object is not iterable")))
    with caplog.at_level(logging.ERROR, logger="llm_datadist"):
        assert dd.AllocateCache(cpp.CacheDesc(**DESC), cpp.Cache()) == cpp.LLM_FAILED
    assert internal_error_records(caplog, "AllocateCache")


def test_a_fault_in_the_core_under_a_transfer_is_llm_failed(dd, monkeypatch, caplog):
    src, dst = cpp.Cache(), cpp.Cache()
    assert dd.AllocateCache(cpp.CacheDesc(**DESC), src) == cpp.LLM_SUCCESS
    assert dd.AllocateCache(cpp.CacheDesc(**DESC, placement=cpp.CachePlacement.kHost), dst) == cpp.LLM_SUCCESS
    monkeypatch.setattr(_core, "plan_blocks", raiser(AttributeError("'CacheLayout' object has no attribute 'x'")))
    monkeypatch.setattr(_core, "plan_rows", raiser(AttributeError("'CacheLayout' object has no attribute 'x'")))
    with caplog.at_level(logging.ERROR, logger="llm_datadist"):
        status = dd.CopyKvBlocks(src, dst, [0], [[1]])
    assert status == cpp.LLM_FAILED
    assert internal_error_records(caplog, "CopyKvBlocks")


def test_a_fault_in_the_links_is_llm_failed(dd, monkeypatch, caplog):
    monkeypatch.setattr(dd.engine.links, "link_many", raiser(KeyError(5)))
    rets = []
    info = cpp.ClusterInfo(remote_cluster_id=5, remote_ip_infos=[cpp.IpInfo(ip="127.0.0.1", port=1)])
    with caplog.at_level(logging.ERROR, logger="llm_datadist"):
        assert dd.LinkLlmClusters([info], rets) == cpp.LLM_FAILED
    assert internal_error_records(caplog, "LinkLlmClusters")


def test_the_engine_still_works_after_an_internal_error(dd, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(dd.engine, "allocate", raiser(AttributeError("x")))
        assert dd.AllocateCache(cpp.CacheDesc(**DESC), cpp.Cache()) == cpp.LLM_FAILED
    cache = cpp.Cache()
    assert dd.AllocateCache(cpp.CacheDesc(**DESC), cache) == cpp.LLM_SUCCESS and cache.cache_id > 0


def hostile_calls(dd, cache):
    """Bad arguments that the C++-style layer trips over itself (TypeError, AttributeError,
    ValueError, OverflowError raised while reading them), not through an explicit check."""
    info_without_ips = cpp.ClusterInfo(remote_cluster_id=5, remote_ip_infos=None)
    negative_packed_ip = cpp.ClusterInfo(remote_cluster_id=5, remote_ip_infos=[cpp.IpInfo(ip=-1, port=1)])
    index = cpp.CacheIndex(cluster_id=0, cache_id=cache.cache_id, batch_index=0)
    return {
        "shape not a list": lambda: dd.AllocateCache(cpp.CacheDesc(num_tensors=1, data_type=cpp.DT_INT32,
                                                                   shape=5), cpp.Cache()),
        "options not a dict": lambda: dd.SetRole(cpp.LlmRole.kPrompt, ["llm.ListenIpInfo"]),
        "remote_ip_infos None": lambda: dd.LinkLlmClusters([info_without_ips], []),
        "negative packed ip": lambda: dd.LinkLlmClusters([negative_packed_ip], []),
        "layer range not a pair": lambda: dd.PushKvBlocks(cache, index, [0], [1], cpp.KvCacheExtParam(
            src_layer_range=5, dst_layer_range=(0, 0))),
    }


@pytest.mark.parametrize("case", ["shape not a list", "options not a dict", "remote_ip_infos None",
                                  "negative packed ip", "layer range not a pair"])
def test_bad_arguments_are_still_llm_param_invalid(dd, caplog, case):
    cache = cpp.Cache()
    assert dd.AllocateCache(cpp.CacheDesc(**DESC), cache) == cpp.LLM_SUCCESS
    with caplog.at_level(logging.ERROR, logger="llm_datadist"):
        assert hostile_calls(dd, cache)[case]() == cpp.LLM_PARAM_INVALID
    records = [r for r in caplog.records if r.name == "llm_datadist"]
    assert records and all("invalid parameter" in r.getMessage() and r.exc_info is None for r in records)


def test_checked_bad_arguments_are_llm_param_invalid_not_internal(dd, caplog):
    """The explicit checks (LLMException(LLM_PARAM_INVALID) from this layer, the engine or the
    core) keep their status and log no traceback."""
    array = np.zeros((4, 8), np.int32)
    desc = cpp.CacheDesc(**DESC)
    with caplog.at_level(logging.ERROR, logger="llm_datadist"):
        assert dd.RegisterKvCache(desc, [array.ctypes.data, 0], cpp.RegisterCfg(), cpp.Ref()) == \
            cpp.LLM_PARAM_INVALID
        assert dd.CopyKvCache(cpp.Cache(cache_id=99), cpp.Cache(cache_id=98)) == cpp.LLM_KV_CACHE_NOT_EXIST
    assert caplog.records and all(r.exc_info is None for r in caplog.records)
