"""CANN's ``llm_datadist.v2.config`` (hicann/hixl, ``src/python/llm_datadist/llm_datadist/v2/``):
``ClusterConfig`` and ``EngineConfig``, with CANN's behaviour, and the names CANN's module imports
that this package has.

In CANN they serve its v1 (KvCacheManager) mode: ``LLMDataDist.init`` without
``llm.EnableCacheManager`` fills in ``llm.ClusterInfo`` and writes a NUMA resource file
(``EngineConfig.gen_cluster_info_if_not_exist``), and its private ``_cluster_config`` reads them
back. The v1 mode is not implemented here (``kv_cache_manager`` raises LLM_FEATURE_NOT_ENABLED),
so nothing in this package calls them; they are provided for programs and tests that use them
directly, and they read and write what CANN's do (options dicts, JSON text, the
``/tmp/stub_numa_config_*.json`` file).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Dict, Optional, Tuple

from llm_datadist import _validate
from llm_datadist.configs import LlmConfig, LLMRole, trans_str_ip

_log = logging.getLogger("llm_datadist")


class ClusterConfig:
    """Which device each local rank runs on: ``rank_id_to_device_id``."""

    def __init__(self, rank_id_to_device_id: Dict[int, int]) -> None:
        self.rank_id_to_device_id = rank_id_to_device_id

    @classmethod
    def from_engine_options(cls, engine_options: Dict[str, str]) -> "ClusterConfig":
        """From ``llm.ClusterInfo`` (its ``logic_device_id`` list) and the NUMA file at
        ``ge.resourceConfigPath``; the local ranks are ``ge.exec.rankId`` if given, else those
        whose logical device is a local item of the NUMA file. LLM_PARAM_INVALID if none is left."""
        rank_of_device = cls._parse_rank_mapping(engine_options)
        device_of_logical = cls._parse_numa_config(engine_options)
        local_ranks = []
        if "ge.exec.rankId" in engine_options:
            rank_id = int(engine_options["ge.exec.rankId"])
            _log.info("rank_id from ge.exec.rankId: %d", rank_id)
            local_ranks.append(rank_id)
        else:
            for logical in device_of_logical:
                if logical in rank_of_device:
                    _log.info("rank_id %s for logical device %s", rank_of_device[logical], logical)
                    local_ranks.append(rank_of_device[logical])
        rank_id_to_device_id: Dict[int, int] = {}
        for logical, rank_id in rank_of_device.items():
            if rank_id in local_ranks:
                rank_id_to_device_id[rank_id] = device_of_logical[logical]
        _validate.raise_if_false(len(rank_id_to_device_id) > 0,
                                 f"rank_id_to_device_id is empty, logical_device_id_to_rank_id = {rank_of_device}, "
                                 f"logical_device_id_to_device_id = {device_of_logical}")
        return cls(rank_id_to_device_id)

    @staticmethod
    def _parse_rank_mapping(engine_options: Dict[str, str]) -> Dict[str, int]:
        _validate.raise_if_false("llm.ClusterInfo" in engine_options, "option 'llm.ClusterInfo' is not defined")
        logical_ids = json.loads(engine_options["llm.ClusterInfo"])["logic_device_id"]
        if "ge.exec.deviceId" in engine_options and "ge.exec.rankId" in engine_options:
            rank_ids = [int(engine_options["ge.exec.rankId"])]
            _log.info("ge.exec.rankId and ge.exec.deviceId are both set: rank_id = %d", rank_ids[0])
        else:
            rank_ids = list(range(len(logical_ids)))
        return {logical: rank_id for rank_id, logical in zip(rank_ids, logical_ids)}

    @staticmethod
    def _parse_numa_config(engine_options: Dict[str, str]) -> Dict[str, int]:
        """Logical device id ``"cluster:node:item:0"`` -> ``item_id``, for the items of the
        nodes marked ``is_local`` in the NUMA file."""
        _validate.raise_if_false("ge.resourceConfigPath" in engine_options,
                                 "option 'ge.resourceConfigPath' is not defined")
        with open(engine_options["ge.resourceConfigPath"]) as f:
            numa_config = json.load(f)
        device_of_logical: Dict[str, int] = {}
        for cluster_index, cluster in enumerate(numa_config["cluster"]):
            for node_index, node in enumerate(cluster["cluster_nodes"]):
                if not node.get("is_local", False):
                    continue
                for item_index, item in enumerate(node["item_list"]):
                    device_of_logical[f"{cluster_index}:{node_index}:{item_index}:0"] = int(item["item_id"])
        return device_of_logical


class EngineConfig:
    """The role (``is_prompt``) and ``ClusterConfig`` of an engine, and CANN's generation of the
    v1 mode's ``llm.ClusterInfo`` option and NUMA resource file."""

    def __init__(self, is_prompt: bool, cluster_config: ClusterConfig) -> None:
        self.is_prompt = is_prompt
        self.cluster_config = cluster_config

    @classmethod
    def from_engine_options(cls, is_prompt: bool, engine_options: Dict[str, str]) -> "EngineConfig":
        return cls(is_prompt, ClusterConfig.from_engine_options(engine_options))

    @staticmethod
    def gen_numa_config(device_id: str, deploy_res_path: Optional[str]) -> str:
        """CANN's stub NUMA file (JSON text) for the devices of ``device_id`` (``"0;1"``): one
        local node at 127.0.0.1 whose items are those devices, with ``deploy_res_path`` on the
        node when it is not None (TypeError if it is no str)."""
        node_type, item_type = "FakeNodeType", "FakeItemType"
        items = [{"item_id": int(dev), "device_id": int(dev), "ipaddr": "192.168.0.1"} for dev in device_id.split(";")]
        node = {"node_id": 0, "node_type": node_type, "ipaddr": "127.0.0.1", "port": -1, "is_local": True,
                "data_panel": {"avail_ports": "65000~65535"}, "item_list": items}
        numa_config = {
            "cluster": [{"cluster_nodes": [node]}],
            "node_def": [{"node_type": node_type, "resource_type": "Aarch", "support_links": "[HCCS,PCIE,ROCE]",
                          "item_type": item_type}],
            "item_def": [{"item_type": item_type, "resource_type": "Ascend", "memory": "[DDR:64GB]",
                          "aic_type": "[FakeAicType]"}],
        }
        if deploy_res_path is not None:
            _validate.check_isinstance("llm.deployResPath", deploy_res_path, str)
            node["deploy_res_path"] = deploy_res_path
        return json.dumps(numa_config)

    @staticmethod
    def gen_cluster_info_if_not_exist(cluster_id: int, role: LLMRole, engine_options: Dict[str, str]) -> None:
        """Unless ``llm.ClusterInfo`` is set, set it (one logical device per id of
        ``ge.exec.deviceId``; for PROMPT, the addresses of ``llm.listenIpInfo``, one
        ``ip:port`` per device, separated by ``;``) and ``ge.resourceConfigPath``: the environment
        variable ``RESOURCE_CONFIG_PATH``, else a stub NUMA file written to
        ``/tmp/stub_numa_config_<role>_<ids>.json``. Changes ``engine_options`` in place."""
        if "llm.ClusterInfo" in engine_options:
            return
        device_num = len(engine_options["ge.exec.deviceId"].split(";"))
        cluster_info = {"cluster_id": cluster_id, "logic_device_id": [f"0:0:{i}:0" for i in range(device_num)]}
        if role == LLMRole.PROMPT:
            _validate.raise_if_false("llm.listenIpInfo" in engine_options,
                                     "neither llm.ClusterInfo nor llm.listenIp was specified")
            listen_ip_info = engine_options["llm.listenIpInfo"]
            _validate.check_isinstance("listen_ip_info", listen_ip_info, [str])
            entries = listen_ip_info.split(";")
            _validate.raise_if_false(len(entries) == device_num,
                                     f"listen ip info num:{len(entries)} in llm.listenIpInfo is not equal to "
                                     f"device num:{device_num}.")
            cluster_info["listen_ip_info"] = []
            for entry in entries:
                ip_and_port = entry.split(":")
                _validate.raise_if_false(len(ip_and_port) == 2,
                                         f'llm.listenIpInfo "{ip_and_port}" is invalid, format should be "ip:port"')
                cluster_info["listen_ip_info"].append({"ip": ip_and_port[0], "port": int(ip_and_port[1])})
        llm_config = LlmConfig()
        llm_config.cluster_info = json.dumps(cluster_info)  # packs the ips, as CANN's setter does
        engine_options["llm.ClusterInfo"] = llm_config.gen_options()["llm.ClusterInfo"]
        if "RESOURCE_CONFIG_PATH" in os.environ:
            numa_config_path = os.getenv("RESOURCE_CONFIG_PATH", "")
        else:
            _validate.raise_if_false("ge.exec.deviceId" in engine_options,
                                     "neither llm.ClusterInfo nor ge.exec.deviceId was specified")
            device_id = engine_options["ge.exec.deviceId"]
            _validate.check_isinstance("ge.exec.deviceId", device_id, [str])
            for dev in device_id.split(";"):
                _validate.raise_if_false(dev.isdigit(),
                                         f'ge.exec.deviceId is invalid, value="{device_id}", it should be composed '
                                         f"of numbers, separated by semicolons.")
            _validate.raise_if_false(len(device_id.split(";")) > 0,
                                     f'ge.exec.deviceId is invalid, value="{device_id}", At least one device id '
                                     f"is required.")
            numa_config = EngineConfig.gen_numa_config(device_id, engine_options.get("llm.deployResPath", None))
            numa_config_path = f'/tmp/stub_numa_config_{role.name.lower()}_{"_".join(device_id.split(";"))}.json'
            with open(numa_config_path, "w") as f:
                f.write(numa_config)
        engine_options["ge.resourceConfigPath"] = numa_config_path
        _log.info("using numa config: %s", numa_config_path)

    @staticmethod
    def parse_listen_ip_info(listen_ip_info: str) -> Tuple[int, int]:
        """``"ip:port"`` as ``(packed ip, port)``: the ip packed by ``trans_str_ip``
        (RuntimeError if it is no dotted IPv4 address), LLM_PARAM_INVALID for another number of
        ``:``, ValueError for a port that is no number."""
        _validate.check_isinstance("listen_ip_info", listen_ip_info, [str])
        ip_and_port = listen_ip_info.split(":")
        _validate.raise_if_false(len(ip_and_port) == 2,
                                 f'llm.listenIpInfo "{listen_ip_info}" is invalid, format should be "ip:port"')
        return trans_str_ip(ip_and_port[0]), int(ip_and_port[1])
