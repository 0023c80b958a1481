"""``LLMConfig`` and ``LLMClusterInfo`` as CANN's ``configs.py`` (hicann/hixl,
``src/python/llm_datadist/llm_datadist/configs.py``) has them: ``cluster_info`` is a JSON string
whose ``listen_ip_info`` addresses the setter packs (``trans_str_ip``), ``options`` is the dict
``generate_options`` fills, the getters' defaults and the order of the options are CANN's, and
the setters raise ``LLMException`` where CANN's ``raise_if_false`` does."""

from __future__ import annotations

import json

import pytest

from llm_datadist import LLMClusterInfo, LLMConfig, LLMException, LLMRole, LLMStatusCode

PARAM_INVALID = LLMStatusCode.LLM_PARAM_INVALID


def raises_llm(fn, *args, status=PARAM_INVALID, **kwargs) -> str:
    with pytest.raises(LLMException) as info:
        fn(*args, **kwargs)
    assert info.value.status_code == status
    return info.value.args[0]


def set_config(name, value):
    setattr(LLMConfig(), name, value)


# -- LLMConfig.cluster_info: a JSON string ----------------------------------------------------------

def test_cluster_info_is_a_json_string_whose_listen_ips_are_packed():
    cfg = LLMConfig()
    assert cfg.cluster_info == ""
    assert "llm.ClusterInfo" not in cfg.generate_options()
    cfg.cluster_info = json.dumps({"cluster_id": 1, "logic_device_id": ["0:0:0:0"],
                                   "listen_ip_info": [{"ip": "127.0.0.1", "port": 26000},
                                                      {"ip": 16777343, "port": 26001}]})
    expected = {"cluster_id": 1, "logic_device_id": ["0:0:0:0"],
                "listen_ip_info": [{"ip": 0x0100007F, "port": 26000}, {"ip": 16777343, "port": 26001}]}
    assert isinstance(cfg.cluster_info, str) and json.loads(cfg.cluster_info) == expected
    assert cfg.generate_options()["llm.ClusterInfo"] == cfg.cluster_info


def test_cluster_info_without_listen_ips_is_stored_as_json():
    cfg = LLMConfig()
    cfg.cluster_info = '{"cluster_id": 7}'
    assert json.loads(cfg.cluster_info) == {"cluster_id": 7}
    cfg.cluster_info = "[1, 2]"  # `"listen_ip_info" in [1, 2]` is False in CANN's setter too
    assert cfg.cluster_info == "[1, 2]"


@pytest.mark.parametrize("value, error", [
    ({"cluster_id": 1}, TypeError),                                     # a dict, as our old setter took
    (b'{"cluster_id": 1}', TypeError),
    (None, TypeError),                                                  # json.loads(None)
    ("{not json", json.JSONDecodeError),
    ('{"listen_ip_info": [{"ip": "300.1.1.1", "port": 1}]}', RuntimeError),  # trans_str_ip
    ('{"listen_ip_info": [{"port": 1}]}', KeyError),
    ("5", TypeError),                                                   # `"listen_ip_info" in 5`
])
def test_cluster_info_refusals_are_cann_s(value, error):
    cfg = LLMConfig()
    with pytest.raises(error):
        cfg.cluster_info = value
    assert cfg.cluster_info == ""


def test_cluster_info_bad_ip_message_is_cann_s():
    with pytest.raises(RuntimeError, match="Can not parse ip str:1.2.3"):
        set_config("cluster_info", '{"listen_ip_info": [{"ip": "1.2.3.x", "port": 1}]}')


# -- LLMConfig: options, getter defaults, order, LLMException setters ------------------------------

def test_options_is_the_dict_generate_options_fills():
    cfg = LLMConfig()
    assert cfg.options == {}
    cfg.device_id = 1
    generated = cfg.generate_options()
    assert cfg.options is generated and cfg.options["ge.exec.deviceId"] == "1"


def test_getter_defaults_are_cann_s():
    cfg = LLMConfig()
    assert (cfg.transfer_backend, cfg.global_resource_config, cfg.local_comm_res) == ("", "", "")
    assert (cfg.deploy_res_path, cfg.cluster_info, cfg.listen_ip_info, cfg.buf_pool_cfg) == ("", "", "", "")
    assert (cfg.device_id, cfg.sync_kv_timeout, cfg.output_max_size) == (None, None, None)
    assert (cfg.rdma_traffic_class, cfg.rdma_service_level) == (None, None)
    assert (cfg.link_total_time, cfg.link_retry_count, cfg.mem_utilization) == (0, 1, 0.95)
    assert cfg.ge_options == {} and cfg.enable_cache_manager is False
    assert cfg.generate_options() == {"llm.MemoryUtilization": "0.95"}
    info = LLMClusterInfo()
    assert info.remote_role_type is None and info.remote_cluster_id is None


def test_unset_getters_are_not_emitted_but_set_empty_strings_are():
    cfg = LLMConfig()
    cfg.transfer_backend = ""
    cfg.global_resource_config = ""
    cfg.deploy_res_path = ""  # CANN emits llm.deployResPath only when it is non-empty
    options = cfg.generate_options()
    assert options["llm.TransferBackend"] == "" and options["llm.GlobalResourceConfig"] == ""
    assert "llm.deployResPath" not in options


def test_remote_role_type_is_kept_as_given():
    info = LLMClusterInfo()
    info.remote_role_type = LLMRole.DECODER
    assert info.remote_role_type is LLMRole.DECODER
    info.remote_role_type = 0
    assert info.remote_role_type == 0
    info.remote_role_type = None
    assert info.remote_role_type is None
    with pytest.raises(TypeError):
        info.remote_role_type = "PROMPT"


def test_generate_options_emits_in_cann_s_order():
    cfg = LLMConfig()
    cfg.mem_utilization = 0.5
    cfg.enable_switch_role = True
    cfg.output_max_size = 10
    cfg.cluster_info = '{"cluster_id": 1}'
    cfg.global_resource_config = "{}"
    cfg.transfer_backend = "hixl"
    cfg.local_comm_res = ""
    cfg.rdma_service_level = 1
    cfg.rdma_traffic_class = 2
    cfg.link_retry_count = 3
    cfg.link_total_time = 4
    cfg.listen_ip_info = "127.0.0.1:1"
    cfg.enable_remote_cache_accessible = True
    cfg.enable_cache_manager = True
    cfg.host_mem_pool_cfg = '{"memory_size": 1}'
    cfg.mem_pool_cfg = '{"memory_size": 1}'
    cfg.buf_pool_cfg = "{}"
    cfg.deploy_res_path = "/tmp"
    cfg.sync_kv_timeout = 5
    cfg.device_id = 0
    cfg.ge_options = {"ge.x": "y"}
    assert list(cfg.generate_options()) == [
        "ge.x", "ge.exec.deviceId", "ge.session_device_id", "llm.SyncKvCacheWaitTime", "llm.deployResPath",
        "llm.BufPoolCfg", "llm.MemPoolConfig", "llm.HostMemPoolConfig", "llm.EnableCacheManager",
        "llm.EnableRemoteCacheAccessible", "llm.listenIpInfo", "llm.LinkTotalTime", "llm.LinkRetryCount",
        "llm.RdmaTrafficClass", "llm.RdmaServiceLevel", "llm.LocalCommRes", "llm.TransferBackend",
        "llm.GlobalResourceConfig", "llm.ClusterInfo", "llm.OutputMaxSize", "llm.EnableSwitchRole",
        "llm.MemoryUtilization"]


@pytest.mark.parametrize("name, value, message", [
    ("device_id", -1, "device_id should be greater than or equal to zero."),
    ("device_id", [0, -1], "device_id should be greater than or equal to zero."),
    ("link_total_time", -1, "link_total_time should be an integer between [0, 2^32-1], given value is -1"),
    ("link_total_time", 2**32, "link_total_time should be an integer between [0, 2^32-1], given value is 4294967296"),
    ("link_retry_count", 0, "link_retry_count should be an integer between [1, 100], given value is 0"),
    ("link_retry_count", 101, "link_retry_count should be an integer between [1, 100], given value is 101"),
    ("sync_kv_timeout", -3, "sync_kv_timeout should be greater than zero."),
    ("sync_kv_timeout", 0, "sync_kv_timeout should be greater than zero."),
    ("sync_kv_timeout", "0", "sync_kv_timeout should be greater than zero."),
    ("sync_kv_timeout", -2**40, "sync_kv_timeout should be greater than zero."),  # before the int32 check
    ("sync_kv_timeout", "x1", "sync_kv_timeout must be digit."),
    ("sync_kv_timeout", "-3", "sync_kv_timeout must be digit."),
    ("mem_utilization", 1.5, "mem_utilization must be in range [0,1], current:1.5"),
    ("mem_utilization", -0.1, "mem_utilization must be in range [0,1], current:-0.1"),
])
def test_setters_raise_llm_exception_where_cann_s_do(name, value, message):
    assert raises_llm(set_config, name, value) == message


@pytest.mark.parametrize("name, value, error", [
    ("device_id", 2**31, ValueError), ("device_id", [0, 2**31], ValueError), ("device_id", "0", TypeError),
    ("device_id", [0, "1"], TypeError), ("link_total_time", "1", TypeError), ("link_retry_count", 1.0, TypeError),
    ("rdma_traffic_class", -1, ValueError), ("rdma_service_level", 2**32, ValueError),
    ("sync_kv_timeout", 2**31, ValueError), ("sync_kv_timeout", "2147483648", ValueError),
    ("sync_kv_timeout", None, TypeError),  # CANN's type check lets None through, int(None) raises
    ("sync_kv_timeout", 1.5, TypeError), ("mem_utilization", None, TypeError),
])
def test_setters_raise_type_and_value_errors_where_cann_s_do(name, value, error):
    with pytest.raises(error):
        set_config(name, value)


def test_setters_take_the_ends_of_their_ranges():
    cfg = LLMConfig()
    cfg.link_total_time = 2**32 - 1
    cfg.link_retry_count = 100
    cfg.device_id = 2**31 - 1
    assert (cfg.link_total_time, cfg.link_retry_count, cfg.device_id) == (2**32 - 1, 100, 2**31 - 1)


def test_sync_kv_timeout_keeps_what_it_was_given():
    cfg = LLMConfig()
    cfg.sync_kv_timeout = "7"
    assert cfg.sync_kv_timeout == "7" and cfg.generate_options()["llm.SyncKvCacheWaitTime"] == "7"


# -- setters that take None, as CANN's check_isinstance lets it through -----------------------------

# name, a value, its option, and what the getter gives after None (CANN's getter over a None field)
NONE_SETTERS = [
    ("transfer_backend", "hixl", "llm.TransferBackend", ""),
    ("global_resource_config", "{}", "llm.GlobalResourceConfig", ""),
    ("local_comm_res", "", "llm.LocalCommRes", ""),
    ("enable_cache_manager", True, "llm.EnableCacheManager", False),
    ("enable_remote_cache_accessible", False, "llm.EnableRemoteCacheAccessible", False),
    ("listen_ip_info", "127.0.0.1:1", "llm.listenIpInfo", None),
    ("deploy_res_path", "/tmp", "llm.deployResPath", None),
    ("buf_pool_cfg", "{}", "llm.BufPoolCfg", None),
    ("mem_pool_cfg", '{"memory_size": 1}', "llm.MemPoolConfig", None),
    ("host_mem_pool_cfg", '{"memory_size": 1}', "llm.HostMemPoolConfig", None),
    ("output_max_size", 10, "llm.OutputMaxSize", None),
    ("enable_switch_role", True, "llm.EnableSwitchRole", None),
]


@pytest.mark.parametrize("name, value, option, after_none", NONE_SETTERS, ids=[c[0] for c in NONE_SETTERS])
def test_none_unsets_an_option_as_in_cann(name, value, option, after_none):
    cfg = LLMConfig()
    setattr(cfg, name, None)
    assert getattr(cfg, name) == after_none and type(getattr(cfg, name)) is type(after_none)
    assert option not in cfg.generate_options()
    cfg = LLMConfig()
    setattr(cfg, name, value)
    setattr(cfg, name, None)  # None after a value: as if it had never been set
    assert getattr(cfg, name) == after_none
    assert option not in cfg.generate_options()


@pytest.mark.parametrize("name", ["ge_options", "mem_utilization", "link_total_time", "link_retry_count",
                                  "rdma_traffic_class", "rdma_service_level", "device_id"])
def test_setters_that_fail_on_none_still_do(name):
    with pytest.raises((TypeError, AttributeError)):  # CANN: a TypeError or AttributeError further on
        set_config(name, None)


# -- device_id lists, as CANN emits them -----------------------------------------------------------

def test_a_device_list_emits_the_session_device_first():
    cfg = LLMConfig()
    cfg.device_id = [3, 4]
    assert list(cfg.generate_options()) == ["ge.session_device_id", "ge.exec.deviceId", "llm.MemoryUtilization"]
    assert cfg.options["ge.session_device_id"] == "3" and cfg.options["ge.exec.deviceId"] == "3;4"
    cfg = LLMConfig()
    cfg.device_id = (5,)
    assert list(cfg.generate_options())[:2] == ["ge.session_device_id", "ge.exec.deviceId"]
    cfg = LLMConfig()
    cfg.device_id = 2
    assert list(cfg.generate_options())[:2] == ["ge.exec.deviceId", "ge.session_device_id"]


def test_an_empty_device_list_is_taken_and_fails_in_generate_options_as_in_cann():
    cfg = LLMConfig()
    cfg.device_id = []
    assert cfg.device_id == []
    with pytest.raises(IndexError):
        cfg.generate_options()


def test_device_id_type_message_is_cann_s():
    with pytest.raises(TypeError, match=r"device_id only support \['list', 'tuple', 'int'\], but got <class 'str'>."):
        set_config("device_id", "0")


# -- LLMClusterInfo ip infos with None -------------------------------------------------------------

def test_append_ip_info_keeps_a_none_ip_as_cann_s_does():
    info = LLMClusterInfo()
    info.append_local_ip_info(None, 1)
    info.append_remote_ip_info(None, 2)
    assert info.local_ip_info_list == [(None, 1)] and info.remote_ip_info_list == [(None, 2)]
    assert "None:2" in repr(info)
    with pytest.raises(ValueError):  # the port is still checked
        info.append_local_ip_info(None, 70000)
    with pytest.raises(TypeError, match=r"ip only support \['str', 'int'\], but got <class 'float'>."):
        info.append_local_ip_info(1.0, 1)
    with pytest.raises(ValueError):  # CANN checks the port before it parses the ip
        info.append_local_ip_info("1.2.3.x", -1)


def test_link_and_unlink_refuse_a_none_ip_with_type_error(py_api):
    info = LLMClusterInfo()
    info.remote_cluster_id = 9
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info(None, 26000)
    with pytest.raises(TypeError, match="remote_ip_info_list holds an ip that is None"):
        py_api.dd.link_clusters([info])
    with pytest.raises(TypeError, match="remote_ip_info_list holds an ip that is None"):
        py_api.dd.unlink_clusters([info])
    local_none = LLMClusterInfo()
    local_none.remote_cluster_id = 9
    local_none.append_local_ip_info(None, 0)
    local_none.append_remote_ip_info("127.0.0.1", 1)
    with pytest.raises(TypeError, match="local_ip_info_list holds an ip that is None"):
        py_api.dd.link_clusters([local_none])
    # unlink passes only the remote ip infos on (CANN's too): a None local ip is not looked at
    assert py_api.dd.unlink_clusters([local_none]) == (LLMStatusCode.LLM_NOT_YET_LINK,
                                                       [LLMStatusCode.LLM_NOT_YET_LINK])
