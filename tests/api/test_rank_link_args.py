"""Argument checks of the two-sided link (``link``, ``unlink``, ``query_register_mem_status``) as
CANN's Python package makes them (``src/python/llm_datadist/llm_datadist/v2/llm_datadist.py``):
TypeError for wrong types, ValueError for out-of-range integers, LLMException(LLM_PARAM_INVALID)
for the name, count and order rules; LLM_NOT_YET_LINK for an unknown comm id. The links
themselves are tested between processes in tests/transport/test_rank_link.py."""

from __future__ import annotations

import json

import pytest

from llm_datadist import LLMException, LLMStatusCode

TABLE = json.dumps({"version": "1.2", "server_count": "1", "status": "completed", "server_list": [
    {"device": [{"device_id": "0", "device_ip": "127.0.0.1", "rank_id": "0"},
                {"device_id": "0", "device_ip": "127.0.0.1", "rank_id": "1"}], "server_id": "1"}]})


def code(fn, *args, **kwargs):
    with pytest.raises(LLMException) as info:
        fn(*args, **kwargs)
    return info.value.status_code


@pytest.mark.parametrize("args, error", [
    ((123, {1: 0, 2: 1}, TABLE), TypeError),
    (("c", [(1, 0)], TABLE), TypeError),
    (("c", None, TABLE), TypeError),
    (("c", {"1": 0, 2: 1}, TABLE), TypeError),
    (("c", {1: "0", 2: 1}, TABLE), TypeError),
    (("c", {1: 0, 2: 1}, {"server_list": []}), TypeError),
    (("c", {1: 0, 2: 1}, None), TypeError),
    (("c", {-1: 0, 2: 1}, TABLE), ValueError),
    (("c", {1: 0, 2: 2**32}, TABLE), ValueError),
])
def test_link_type_and_range_errors(py_api, args, error):
    with pytest.raises(error):
        py_api.dd.link(*args)


@pytest.mark.parametrize("args", [
    ("", {7: 0, 2: 1}, TABLE),                       # empty name
    ("x" * 128, {7: 0, 2: 1}, TABLE),                # name too long
    ("c", {7: 0}, TABLE),                            # one member
    ("c", {7: 0, 2: 1, 3: 2, 4: 3, 5: 4}, TABLE),   # more than 4
    ("c", {7: 1, 2: 0}, TABLE),                      # ranks not ascending in dict order
    ("c", {1: 0, 2: 1}, TABLE),                      # this cluster (7) is not a member
    ("c", {7: 0, 2: 1}, "not json"),                 # rank table not JSON
    ("c", {7: 0, 2: 5}, TABLE),                      # rank 5 not in the table
])
def test_link_parameter_errors(py_api, args):
    assert py_api.dd.cluster_id == 7
    assert code(py_api.dd.link, *args) == LLMStatusCode.LLM_PARAM_INVALID


def test_unknown_comm_ids(py_api):
    assert code(py_api.dd.query_register_mem_status, 1) == LLMStatusCode.LLM_NOT_YET_LINK
    assert code(py_api.dd.query_register_mem_status, comm_id=3) == LLMStatusCode.LLM_NOT_YET_LINK
    assert code(py_api.dd.unlink, 1) == LLMStatusCode.LLM_NOT_YET_LINK
    with pytest.raises(TypeError):
        py_api.dd.unlink("1")
    with pytest.raises(TypeError):
        py_api.dd.query_register_mem_status(comm_id=None)
    with pytest.raises(ValueError):
        py_api.dd.unlink(-1)
