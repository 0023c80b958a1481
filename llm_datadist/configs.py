"""``LLMRole``, ``LLMConfig`` (alias ``LlmConfig``) and ``LLMClusterInfo``."""

from __future__ import annotations

import json
import socket
from enum import IntEnum
from typing import Dict, List, Optional, Tuple

from llm_datadist._validate import (
    UINT32_MAX,
    check_isinstance,
    check_int32,
    check_uint16,
    check_uint32,
    check_uint64,
    raise_if_false,
    unpack_ip,
)

__all__ = ["LLMRole", "LLMConfig", "LlmConfig", "LLMClusterInfo"]


class LLMRole(IntEnum):
    PROMPT = 1
    DECODER = 2
    MIX = 3

    def __str__(self) -> str:  # "LLMRole.PROMPT" on every Python version, as in CANN
        return f"{type(self).__name__}.{self.name}"


ROLE_NAMES = {LLMRole.PROMPT: "Prompt", LLMRole.DECODER: "Decoder", LLMRole.MIX: "Mix"}


def _check_pool_cfg(name: str, value: Optional[str]) -> None:
    if value is None or value == "":
        return
    try:
        cfg = json.loads(value)
    except ValueError as exc:
        raise_if_false(False, f"{name} must be a JSON object, got {value!r}: {exc}")
    raise_if_false(isinstance(cfg, dict), f"{name} must be a JSON object, got {value!r}")
    size = cfg.get("memory_size")
    raise_if_false(isinstance(size, int) and not isinstance(size, bool) and size > 0,
                   f"{name}.memory_size must be a positive integer, got {size!r}")
    page_shift = cfg.get("page_shift", 16)
    raise_if_false(isinstance(page_shift, int) and 10 <= page_shift < 31,
                   f"{name}.page_shift must be in [10, 31), got {page_shift!r}")


class LLMConfig:
    """Options for ``LLMDataDist.init``. Each setter validates its value at once;
    ``generate_options()`` returns the option dict (the same dict object on every call)."""

    def __init__(self) -> None:
        # The defaults are CANN's, "" where its getters give "" for an unset value.
        self._options: Dict[str, str] = {}
        self._device_id = None
        self._sync_kv_timeout = None
        self._listen_ip_info = ""
        self._enable_cache_manager = None
        self._enable_remote_cache_accessible = None
        self._enable_switch_role = False
        self._link_secret: Optional[str] = None
        self._link_protection: Optional[str] = None
        self._ge_options: Dict[str, str] = {}
        self._mem_utilization = 0.95
        self._buf_pool_cfg = ""
        self._mem_pool_cfg = ""
        self._host_mem_pool_cfg = ""
        self._link_total_time = None
        self._link_retry_count = None
        self._rdma_traffic_class = None
        self._rdma_service_level = None
        self._local_comm_res = None
        self._transfer_backend = None
        self._global_resource_config = None
        self._deploy_res_path = ""
        self._output_max_size = None
        self._cluster_info = ""

    # -- device and timeouts --------------------------------------------------------------------
    @property
    def device_id(self):
        return self._device_id

    @device_id.setter
    def device_id(self, value) -> None:
        """An int or a list/tuple of ints: TypeError otherwise; a negative id is
        ``LLMException(LLM_PARAM_INVALID)`` and one past int32 a ValueError, as in CANN."""
        check_isinstance("device_id", value, [list, tuple, int], int)
        ids = list(value) if isinstance(value, (list, tuple)) else [value]
        for device in ids:
            raise_if_false(device >= 0, "device_id should be greater than or equal to zero.")
        for device in ids:
            check_int32("device_id", device)
        self._device_id = value

    @property
    def sync_kv_timeout(self):
        return self._sync_kv_timeout

    @sync_kv_timeout.setter
    def sync_kv_timeout(self, value) -> None:
        """An int or a digit string, > 0 and an int32; CANN's checks in CANN's order and words.
        As in CANN, ``None`` passes the type check and fails at ``int(None)`` (TypeError)."""
        check_isinstance("sync_kv_timeout", value, [int, str])
        if isinstance(value, str):
            raise_if_false(value.isdigit(), "sync_kv_timeout must be digit.")
        raise_if_false(int(value) > 0, "sync_kv_timeout should be greater than zero.")
        check_int32("sync_kv_timeout", int(value))
        self._sync_kv_timeout = value

    @property
    def listen_ip_info(self) -> str:
        return self._listen_ip_info

    # The string setters below and the three switches take None as CANN's do (its check_isinstance
    # lets None through): the option is then not emitted, as if it had never been set; the getter
    # gives None back, or the default CANN's getter gives for an unset value.
    @listen_ip_info.setter
    def listen_ip_info(self, value: Optional[str]) -> None:
        check_isinstance("listen_ip_info", value, str)
        self._listen_ip_info = value

    # -- feature switches ---------------------------------------------------------------------
    def _bool_setter(self, name: str, value) -> Optional[bool]:
        check_isinstance(name, value, bool)
        return value

    @property
    def enable_cache_manager(self) -> bool:
        return bool(self._enable_cache_manager)

    @enable_cache_manager.setter
    def enable_cache_manager(self, value: bool) -> None:
        self._enable_cache_manager = self._bool_setter("enable_cache_manager", value)

    @property
    def enable_remote_cache_accessible(self) -> bool:
        return bool(self._enable_remote_cache_accessible)

    @enable_remote_cache_accessible.setter
    def enable_remote_cache_accessible(self, value: bool) -> None:
        self._enable_remote_cache_accessible = self._bool_setter("enable_remote_cache_accessible", value)

    @property
    def enable_switch_role(self) -> bool:
        return self._enable_switch_role

    @enable_switch_role.setter
    def enable_switch_role(self, value: bool) -> None:
        self._enable_switch_role = self._bool_setter("enable_switch_role", value)

    @property
    def link_secret(self) -> Optional[str]:
        """Shared secret that every cluster of a deployment sets alike: links are then
        authenticated by HMAC challenge-response (``llm.LinkSecret``; default: the environment
        variable ``LLM_DATADIST_LINK_SECRET``). Not in CANN's API."""
        return self._link_secret

    @link_secret.setter
    def link_secret(self, value: Optional[str]) -> None:
        check_isinstance("link_secret", value, str)
        self._link_secret = value

    @property
    def link_protection(self) -> Optional[str]:
        """``off``, ``integrity`` or ``encrypt``: seal every TCP connection of this cluster's links
        with keys derived from the link secret's handshake (``llm.LinkProtection``; default: the
        environment variable ``LLM_DATADIST_LINK_PROTECTION``, else ``off``). Needs ``link_secret``;
        ``encrypt`` needs the cryptography package. Not in CANN's API."""
        return self._link_protection

    @link_protection.setter
    def link_protection(self, value: Optional[str]) -> None:
        check_isinstance("link_protection", value, str)
        self._link_protection = value

    @property
    def ge_options(self) -> Dict[str, str]:
        return self._ge_options

    @ge_options.setter
    def ge_options(self, value: Dict[str, str]) -> None:
        check_isinstance("ge_options", value, dict, str, allow_none=False)
        self._ge_options = value

    # -- memory --------------------------------------------------------------------------------
    @property
    def mem_utilization(self) -> float:
        return self._mem_utilization

    @mem_utilization.setter
    def mem_utilization(self, value: float) -> None:
        check_isinstance("mem_utilization", value, [float, int], allow_none=False)
        raise_if_false(0 <= value <= 1, f"mem_utilization must be in range [0,1], current:{value}")
        self._mem_utilization = float(value)

    @property
    def buf_pool_cfg(self) -> str:
        return self._buf_pool_cfg

    @buf_pool_cfg.setter
    def buf_pool_cfg(self, value: Optional[str]) -> None:
        check_isinstance("buf_pool_cfg", value, str)
        self._buf_pool_cfg = value

    @property
    def mem_pool_cfg(self) -> str:
        return self._mem_pool_cfg

    @mem_pool_cfg.setter
    def mem_pool_cfg(self, value: Optional[str]) -> None:
        check_isinstance("mem_pool_cfg", value, str)
        _check_pool_cfg("mem_pool_cfg", value)
        self._mem_pool_cfg = value

    @property
    def host_mem_pool_cfg(self) -> str:
        return self._host_mem_pool_cfg

    @host_mem_pool_cfg.setter
    def host_mem_pool_cfg(self, value: Optional[str]) -> None:
        check_isinstance("host_mem_pool_cfg", value, str)
        _check_pool_cfg("host_mem_pool_cfg", value)
        self._host_mem_pool_cfg = value

    # -- links ---------------------------------------------------------------------------------
    @property
    def link_total_time(self) -> int:
        return 0 if self._link_total_time is None else self._link_total_time

    @link_total_time.setter
    def link_total_time(self, value: int) -> None:
        check_isinstance("link_total_time", value, int, allow_none=False)
        raise_if_false(0 <= value <= UINT32_MAX, "link_total_time should be an integer between [0, 2^32-1], "
                       f"given value is {value}")
        self._link_total_time = value

    @property
    def link_retry_count(self) -> int:
        return 1 if self._link_retry_count is None else self._link_retry_count

    @link_retry_count.setter
    def link_retry_count(self, value: int) -> None:
        check_isinstance("link_retry_count", value, int, allow_none=False)
        raise_if_false(1 <= value <= 100, f"link_retry_count should be an integer between [1, 100], "
                       f"given value is {value}")
        self._link_retry_count = value

    @property
    def rdma_traffic_class(self):
        return self._rdma_traffic_class

    @rdma_traffic_class.setter
    def rdma_traffic_class(self, value: int) -> None:
        self._rdma_traffic_class = check_uint32("rdma_traffic_class", value)

    @property
    def rdma_service_level(self):
        return self._rdma_service_level

    @rdma_service_level.setter
    def rdma_service_level(self, value: int) -> None:
        self._rdma_service_level = check_uint32("rdma_service_level", value)

    @property
    def local_comm_res(self) -> str:
        return "" if self._local_comm_res is None else self._local_comm_res

    @local_comm_res.setter
    def local_comm_res(self, value: Optional[str]) -> None:
        check_isinstance("local_comm_res", value, str)
        self._local_comm_res = value

    # The getters of transfer_backend and global_resource_config give "" while unset, as CANN's
    # configs.py does; the API spec (§5) gives their default as None (the source wins). Unset,
    # neither is emitted.
    @property
    def transfer_backend(self) -> str:
        return "" if self._transfer_backend is None else self._transfer_backend

    @transfer_backend.setter
    def transfer_backend(self, value: Optional[str]) -> None:
        check_isinstance("transfer_backend", value, str)
        self._transfer_backend = value

    @property
    def global_resource_config(self) -> str:
        return "" if self._global_resource_config is None else self._global_resource_config

    @global_resource_config.setter
    def global_resource_config(self, value: Optional[str]) -> None:
        check_isinstance("global_resource_config", value, str)
        self._global_resource_config = value

    # -- legacy --------------------------------------------------------------------------------
    @property
    def deploy_res_path(self) -> str:
        return self._deploy_res_path

    @deploy_res_path.setter
    def deploy_res_path(self, value: Optional[str]) -> None:
        check_isinstance("deploy_res_path", value, str)
        self._deploy_res_path = value

    @property
    def cluster_info(self) -> str:
        """The legacy cluster info as a JSON string (``""`` when unset), its ``listen_ip_info``
        addresses packed to integers by the setter."""
        return self._cluster_info

    @cluster_info.setter
    def cluster_info(self, value: str) -> None:
        """A JSON string, as CANN's setter takes it, with CANN's errors: ``TypeError`` for what is
        not a ``str`` (``None`` reaches ``json.loads``, which raises it), ``json.JSONDecodeError``
        (a ``ValueError``) for bad JSON, ``RuntimeError`` for an ``"ip"`` of ``listen_ip_info``
        that is no dotted IPv4 address. Like CANN's, it looks for ``listen_ip_info`` with ``in``,
        so any JSON value that supports ``in`` is stored as given."""
        check_isinstance("cluster_info", value, str)
        cluster_info = json.loads(value)
        if "listen_ip_info" in cluster_info:
            for ip_info in cluster_info["listen_ip_info"]:
                ip_info["ip"] = trans_str_ip(ip_info["ip"])
        self._cluster_info = json.dumps(cluster_info)

    @property
    def output_max_size(self):
        return self._output_max_size

    @output_max_size.setter
    def output_max_size(self, value: Optional[int]) -> None:
        self._output_max_size = None if value is None else check_uint64("output_max_size", value)

    # -- emission ------------------------------------------------------------------------------
    @property
    def options(self) -> Dict[str, str]:
        """The option dict ``generate_options`` fills (empty before its first call), as CANN's."""
        return self._options

    def generate_options(self) -> Dict[str, str]:
        """Merge every set option into the internal dict and return it (same object each call),
        in CANN's order: ``ge_options``, device, timeout, deploy path, memory, links, legacy."""
        opts = self._options
        opts.update(self._ge_options)
        if isinstance(self._device_id, int):
            opts["ge.exec.deviceId"] = str(self._device_id)
            opts["ge.session_device_id"] = str(self._device_id)
        elif self._device_id is not None:
            # A list: CANN emits the session id first, and an empty list fails here with
            # IndexError, as CANN's ``device_id[0]`` does (its setter takes [] too).
            opts["ge.session_device_id"] = str(self._device_id[0])
            opts["ge.exec.deviceId"] = ";".join(str(d) for d in self._device_id)
        if self._sync_kv_timeout is not None:
            opts["llm.SyncKvCacheWaitTime"] = str(self._sync_kv_timeout)
        if self._deploy_res_path:
            opts["llm.deployResPath"] = self._deploy_res_path
        if self._buf_pool_cfg:
            opts["llm.BufPoolCfg"] = self._buf_pool_cfg
        if self._mem_pool_cfg:
            opts["llm.MemPoolConfig"] = self._mem_pool_cfg
        if self._host_mem_pool_cfg:
            opts["llm.HostMemPoolConfig"] = self._host_mem_pool_cfg
        if self._enable_cache_manager is not None:
            opts["llm.EnableCacheManager"] = "1" if self._enable_cache_manager else "0"
        if self._enable_remote_cache_accessible is not None:
            opts["llm.EnableRemoteCacheAccessible"] = "1" if self._enable_remote_cache_accessible else "0"
        if self._listen_ip_info:
            opts["llm.listenIpInfo"] = self._listen_ip_info
        if self._link_total_time is not None:
            opts["llm.LinkTotalTime"] = str(self._link_total_time)
        if self._link_retry_count is not None:
            opts["llm.LinkRetryCount"] = str(self._link_retry_count)
        if self._rdma_traffic_class is not None:
            opts["llm.RdmaTrafficClass"] = str(self._rdma_traffic_class)
        if self._rdma_service_level is not None:
            opts["llm.RdmaServiceLevel"] = str(self._rdma_service_level)
        if self._local_comm_res is not None:
            opts["llm.LocalCommRes"] = self._local_comm_res
        if self._transfer_backend is not None:
            opts["llm.TransferBackend"] = self._transfer_backend
        if self._global_resource_config is not None:
            opts["llm.GlobalResourceConfig"] = self._global_resource_config
        if self._link_secret is not None:
            opts["llm.LinkSecret"] = self._link_secret
        if self._link_protection is not None:
            opts["llm.LinkProtection"] = self._link_protection
        if self._cluster_info:
            opts["llm.ClusterInfo"] = self._cluster_info
        if self._output_max_size is not None:
            opts["llm.OutputMaxSize"] = str(self._output_max_size)
        if self._enable_switch_role:
            opts["llm.EnableSwitchRole"] = "1"
        opts["llm.MemoryUtilization"] = str(self._mem_utilization)
        return opts

    gen_options = generate_options


LlmConfig = LLMConfig


def pack_ip(ip) -> int:
    """A dotted IPv4 string as CANN packs it: the inet_aton bytes read little-endian."""
    if isinstance(ip, int) and not isinstance(ip, bool):
        return check_uint32("ip", ip)
    check_isinstance("ip", ip, [str, int], allow_none=False)
    try:
        return int.from_bytes(socket.inet_aton(ip), "little")
    except OSError:
        raise ValueError(f"ip {ip!r} is not a dotted IPv4 address") from None


def trans_str_ip(ip):
    """CANN's ``trans_str_ip`` (``LLMConfig.cluster_info`` uses it): a dotted IPv4 string packed
    as ``pack_ip`` packs it, ``RuntimeError`` if it is none; any other value is returned as it
    is, unchecked, as CANN's does."""
    if not isinstance(ip, str):
        return ip
    try:
        return int.from_bytes(socket.inet_aton(ip), "little")
    except OSError:
        raise RuntimeError(f"Can not parse ip str:{ip}") from None


class LLMClusterInfo:
    """Where a remote cluster listens (and which local address to use) for link/unlink."""

    def __init__(self) -> None:
        self._remote_cluster_id = None
        self._remote_role_type = None  # CANN's default; the links do not read it
        self._local_ip_info_list: List[Tuple[int, int]] = []
        self._remote_ip_info_list: List[Tuple[int, int]] = []

    @property
    def remote_cluster_id(self) -> Optional[int]:
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, value: int) -> None:
        self._remote_cluster_id = check_uint64("remote_cluster_id", value)

    @property
    def remote_role_type(self):
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, value) -> None:
        """An ``LLMRole`` or an int, kept as given (``None`` too), as CANN's setter keeps it."""
        check_isinstance("remote_role_type", value, [LLMRole, int])
        self._remote_role_type = value

    @staticmethod
    def _ip_info(ip, port: int) -> Tuple[Optional[int], int]:
        """CANN's ``_check_inputs``, in its order: the ip's type, the port, then the ip's value.
        ``None`` is kept as CANN keeps it (its type check lets None through and ``trans_str_ip``
        returns it): ``link_clusters`` / ``unlink_clusters`` refuse such an info with TypeError,
        as CANN's native call does."""
        if ip is not None:
            check_isinstance("ip", ip, [str, int])
        check_uint16("port", port)
        return (None if ip is None else pack_ip(ip)), port

    def append_local_ip_info(self, ip, port: int) -> None:
        self._local_ip_info_list.append(self._ip_info(ip, port))

    def append_remote_ip_info(self, ip, port: int) -> None:
        self._remote_ip_info_list.append(self._ip_info(ip, port))

    @property
    def local_ip_info_list(self) -> List[Tuple[int, int]]:
        return self._local_ip_info_list

    @property
    def remote_ip_info_list(self) -> List[Tuple[int, int]]:
        return self._remote_ip_info_list

    def __repr__(self) -> str:
        local = [f"{ip if ip is None else unpack_ip(ip)}:{port}" for ip, port in self._local_ip_info_list]
        remote = [f"{ip if ip is None else unpack_ip(ip)}:{port}" for ip, port in self._remote_ip_info_list]
        return (f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, "
                f"local={local}, remote={remote})")
