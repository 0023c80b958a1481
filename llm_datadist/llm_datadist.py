"""``LLMDataDist``: one cluster (one process) of the CANN Python API."""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Dict, List, Optional, Sequence, Tuple

from llm_datadist.engine import values
from llm_datadist.engine.engine import Engine
from llm_datadist._validate import check_int32, check_isinstance, check_uint32, check_uint64, raise_if_false
from llm_datadist.cache_manager import CacheManager
from llm_datadist.configs import ROLE_NAMES, LLMClusterInfo, LLMRole, unpack_ip
from llm_datadist.llm_types import RegisterMemStatus
from llm_datadist.status import LLMException, LLMStatusCode

__all__ = ["LLMDataDist"]

logger = logging.getLogger("llm_datadist")

_atexit_lock = threading.Lock()
_atexit_registered = False


def _shutdown_handler() -> None:
    """CANN's exit hook (its name, which CANN's tests import from ``llm_datadist.v2.llm_datadist``):
    finalize the initialized instance; an ``LLMException`` is logged, not raised. Registered with
    ``atexit`` by the first ``init`` (CANN registers it on import)."""
    instance = LLMDataDist.llm_engine_instance
    if instance is not None:
        try:
            instance.finalize()
        except LLMException as exc:
            logger.warning("error while finalizing llm datadist at exit: %s", exc)


_MAX_COMM_NAME = 128
_MAX_COMM_MEMBERS = 4
_MAX_COMMS = 512


def _not_in_mode(what: str, cache_manager: bool) -> str:
    """CANN's message for an API or option of the other mode (v1 vs. cache manager)."""
    state = "configured" if cache_manager else "not configured"
    return f"{what} is not supported when llm.EnableCacheManager is {state}."


def _parse_listen_ip_info(text: str) -> Tuple[str, int]:
    """``llm.listenIpInfo`` as (ip, port). A value that is not ``ip:port`` (or ``[ipv6]:port``)
    is refused with CANN's message; a port that is not a number raises ``ValueError``, as
    CANN's ``int(port)`` does."""
    host, _, port = text.rpartition(":")
    if not (text.count(":") == 1 or (host.startswith("[") and host.endswith("]"))):
        raise_if_false(False, f'llm.listenIpInfo "{text}" is invalid, format should be "ip:port"')
    int(port)
    try:
        return values.parse_listen_ip_info(text)
    except LLMException as exc:
        raise LLMException(f'llm.listenIpInfo "{text}" is invalid, format should be "ip:port" '
                           f"({exc.args[0] if exc.args else exc})", status_code=exc.status_code) from None


def _check_ip_infos(ip_infos, what: str) -> None:
    """An ip info whose ip is None (``append_*_ip_info`` keeps None, as CANN's does) is refused with
    TypeError, as CANN's native call refuses the list holding it (before any cluster is linked)."""
    for ip, port in ip_infos:
        if ip is None:
            raise TypeError(f"{what} holds an ip that is None (port {port}); an ip must be a str or an int")


def _overall(rets: List[LLMStatusCode]) -> LLMStatusCode:
    failed = [r for r in rets if r != LLMStatusCode.LLM_SUCCESS]
    return failed[0] if failed else LLMStatusCode.LLM_SUCCESS


class LLMDataDist:
    """A cluster of a disaggregated service: ``LLMDataDist(role, cluster_id)``, then ``init``.

    Only one instance may be initialized per process; ``finalize`` (or process exit) releases it.
    """

    #: The initialized instance of this process, None when there is none (CANN's class attribute;
    #: ``init`` refuses a second one with ``LLM_FAILED``, as CANN's does).
    llm_engine_instance: Optional["LLMDataDist"] = None

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        check_isinstance("role", role, LLMRole, allow_none=False)
        check_uint64("cluster_id", cluster_id)
        self._role = role
        self._cluster_id = cluster_id
        self._engine: Optional[Engine] = None
        self._cache_manager: Optional[CacheManager] = None
        self._is_v2 = False

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def role(self) -> LLMRole:
        return self._role

    @property
    def engine(self) -> Optional[Engine]:
        """The engine below this cluster (``llm_datadist.engine.engine.Engine``): the one
        documented seam for the CLI, the integrations and tests, as h5py's ``.id`` (design §2,
        "The engine seam"). None before ``init``; after ``finalize`` an engine that refuses work.

        Not part of CANN's API. What callers may use of it: ``runtime`` and ``runtime_reason``
        (the device runtime and why it was chosen), ``data_plane(remote_id, local_device=,
        remote_device=)``, ``set_notify_handler``/``notify`` (messages over the links),
        ``device_only(record)``, ``link_stats()`` (the counters of what peers were refused:
        docs/security.md), ``links`` (the transport's ``LinkManager``, for tests and
        diagnostics) and ``options``; everything else is internal and may change."""
        return self._engine

    def _is_initialized(self) -> bool:
        return self._engine is not None and self._engine.initialized

    def init(self, options: Dict[str, str]) -> None:
        """Initialize with engine options (see ``LLMConfig.generate_options``); no-op if done."""
        global _atexit_registered
        if self._is_initialized():
            return
        if LLMDataDist.llm_engine_instance is not None:
            raise LLMException("Cannot init multiple LLMDataDists", status_code=LLMStatusCode.LLM_FAILED)
        check_isinstance("options", options, dict, str, allow_none=False)
        opts = dict(options)
        opts["llm.Role"] = ROLE_NAMES[self._role]
        if "llm.LocalCommRes" in opts:
            opts.setdefault("llm.EnableCacheManager", "1")
            opts.setdefault("llm.EnableRemoteCacheAccessible", "1")
        is_v2 = opts.get("llm.EnableCacheManager") == "1"
        raise_if_false(not ("llm.LocalCommRes" in opts and not is_v2),
                       _not_in_mode("llm.LocalCommRes", cache_manager=False))
        if "llm.TransferBackend" in opts:
            raise_if_false(is_v2, _not_in_mode("llm.TransferBackend", cache_manager=False))
            opts.setdefault("llm.EnableRemoteCacheAccessible", "1")
            raise_if_false(opts["llm.EnableRemoteCacheAccessible"] == "1",
                           "llm.TransferBackend is not supported when llm.EnableRemoteCacheAccessible is not enable.")
            raise_if_false(bool(opts.get("llm.listenIpInfo")),
                           "llm.TransferBackend is not supported when llm.listenIpInfo is not configured.")
        flow_mem = opts.get("ge.flowGraphMemMaxSize")
        if flow_mem is not None:
            raise_if_false(len(flow_mem.split(",")) == 1,
                           "ge.flowGraphMemMaxSize only support one mem pool in llm datadist")
            raise_if_false(flow_mem.isdigit(), f"ge.flowGraphMemMaxSize must be digit, config value={flow_mem}")
        listen = None
        if opts.get("llm.listenIpInfo"):
            listen = _parse_listen_ip_info(opts["llm.listenIpInfo"])
            if is_v2:
                opts["llm.ListenIp"], opts["llm.ListenPort"] = listen[0], str(listen[1])
        device_id = values.check_device_id(opts.get("ge.exec.deviceId", "0"))
        timeout = values.check_sync_timeout(opts.get("llm.SyncKvCacheWaitTime",
                                                      str(values.DEFAULT_SYNC_KV_TIMEOUT_MS)))
        engine = Engine(self._cluster_id, ROLE_NAMES[self._role])
        engine.initialize(opts, device_id, timeout, listen)
        self._engine = engine
        self._is_v2 = is_v2
        self._cache_manager = CacheManager(self, engine, opts) if is_v2 else None
        LLMDataDist.llm_engine_instance = self
        with _atexit_lock:
            if not _atexit_registered:
                atexit.register(_shutdown_handler)
                _atexit_registered = True

    def finalize(self) -> None:
        """Release every cache and the process slot (no-op if not initialized)."""
        if not self._is_initialized():
            return
        if self._cache_manager is not None:
            self._cache_manager._mark_finalized()
        self._engine.finalize()
        self._cache_manager = None
        if LLMDataDist.llm_engine_instance is self:
            LLMDataDist.llm_engine_instance = None

    def _check_init(self) -> None:
        if not self._is_initialized():
            raise RuntimeError("llm datadist is not initialized")

    @property
    def cache_manager(self) -> CacheManager:
        self._check_init()
        self._check_cache_manager_mode("cache_manager")
        return self._cache_manager

    @property
    def kv_cache_manager(self):
        self._check_init()
        raise_if_false(not self._is_v2, _not_in_mode("kv_cache_manager", cache_manager=True))
        raise LLMException("the v1 KvCacheManager mode is not implemented by this library; enable the "
                           "cache manager (LLMConfig.enable_cache_manager = True) and use cache_manager",
                           status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)

    # -- links -----------------------------------------------------------------------------------
    @property
    def listen_ip_info(self) -> str:
        """Where this cluster listens, ``"ip:port"`` with the port actually bound (so
        ``listen_ip_info="127.0.0.1:0"`` can be read back); ``""`` when not listening.
        Not in CANN's API."""
        self._check_init()
        address = self._engine.listen_address
        return f"{address[0]}:{address[1]}" if address else ""

    def lost_links(self) -> Dict[int, str]:
        """Clusters whose link ended without an ``unlink_clusters`` here (the peer exited,
        unlinked with ``force``, or a connection broke), each with the reason. Transfers to them
        raise ``LLM_LINK_FAILED``; ``unlink_clusters`` or a new ``link_clusters`` clears the
        entry. Not in CANN's API."""
        self._check_init()
        return self._engine.lost_links()

    def _check_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: int) -> None:
        check_int32("timeout", timeout)
        raise_if_false(timeout > 0, "Param timeout should be greater than 0.")
        check_isinstance("clusters", clusters, [list, tuple], LLMClusterInfo, allow_none=False)

    def link_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000
                      ) -> Tuple[LLMStatusCode, List[LLMStatusCode]]:
        """Link to each cluster's listener (in parallel); never raises for a link failure.

        Returns ``(overall, per-cluster)``: overall is ``LLM_SUCCESS`` only if every link was
        made. Per cluster: ``LLM_SUCCESS`` (also when that cluster has linked to this one, or
        links to it at the same moment: one link serves both), ``LLM_ALREADY_LINK``,
        ``LLM_LINK_FAILED`` (connect, handshake, authentication or timeout), ``LLM_PARAM_INVALID``
        (not exactly one remote ip info, mismatched remote-cache-accessible settings). Bad
        arguments raise as CANN's code does.
        """
        self._check_init()
        self._check_clusters(clusters, timeout)
        has_comm_res = bool(self._engine.options.get("llm.LocalCommRes"))
        for cluster in clusters:
            if not has_comm_res:
                raise_if_false(cluster.local_ip_info_list, "local_ip_info_list is empty. Call append_local_ip_info "
                               "to add local_ip_info when local_comm_res option is unspecified or empty.")
            check_uint64("remote_cluster_id", cluster.remote_cluster_id)
        for cluster in clusters:
            _check_ip_infos(cluster.local_ip_info_list, "local_ip_info_list")
            _check_ip_infos(cluster.remote_ip_info_list, "remote_ip_info_list")
        rets: List[Optional[LLMStatusCode]] = [None] * len(clusters)
        targets, slots = [], []
        for i, cluster in enumerate(clusters):
            if len(cluster.remote_ip_info_list) != 1:  # the native layer's check: that cluster's status
                rets[i] = LLMStatusCode.LLM_PARAM_INVALID
                continue
            ip, port = cluster.remote_ip_info_list[0]
            targets.append((cluster.remote_cluster_id, unpack_ip(ip), port))
            slots.append(i)
        for i, status in zip(slots, self._engine.link_many(targets, timeout)):
            rets[i] = status
        return _overall(rets), rets

    def unlink_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000,
                        force: bool = False) -> Tuple[LLMStatusCode, List[LLMStatusCode]]:
        """Drop links. Non-forced: tell the peer over the link, then drop local state
        (``LLM_UNLINK_FAILED`` if the peer could not be told; local state is dropped anyway).
        ``force=True``: local state only. Only ``remote_cluster_id`` is needed; a cluster info
        with more than one remote ip info gets ``LLM_PARAM_INVALID`` in the list."""
        self._check_init()
        self._check_clusters(clusters, timeout)
        check_isinstance("force", force, bool)
        for cluster in clusters:
            check_uint64("remote_cluster_id", cluster.remote_cluster_id)
        for cluster in clusters:
            _check_ip_infos(cluster.remote_ip_info_list, "remote_ip_info_list")  # CANN passes these on
        rets: List[Optional[LLMStatusCode]] = [None] * len(clusters)
        ids, slots = [], []
        for i, cluster in enumerate(clusters):
            if len(cluster.remote_ip_info_list) > 1:
                rets[i] = LLMStatusCode.LLM_PARAM_INVALID
                continue
            ids.append(cluster.remote_cluster_id)
            slots.append(i)
        for i, status in zip(slots, self._engine.unlink_many(ids, timeout, bool(force))):
            rets[i] = status
        return _overall(rets), rets

    def switch_role(self, role: LLMRole, switch_options: Optional[Dict[str, str]] = None) -> None:
        """Change the role label; ``"llm.listenIpInfo"`` in ``switch_options`` (re)starts the
        listener there, its absence stops listening. ``LLM_EXIST_LINK`` while links exist."""
        self._check_init()
        check_isinstance("role", role, LLMRole, allow_none=False)
        check_isinstance("switch_options", switch_options, dict, str)
        listen_text = (switch_options or {}).get("llm.listenIpInfo", "")
        listen = _parse_listen_ip_info(listen_text) if listen_text else None
        self._engine.switch_role(ROLE_NAMES[role], listen)
        self._role = role

    def _check_cache_manager_mode(self, method: str) -> None:
        raise_if_false(self._is_v2, f"{method} is not supported when llm.EnableCacheManager is not configured.")

    def link(self, comm_name: str, cluster_rank_info: Dict[int, int], rank_table: str) -> int:
        """Two-sided link: every member calls it with the same arguments; returns this member's
        ``comm_id``. Blocks until every member has linked (``llm.LinkTotalTime`` seconds, default
        120), then the cache tables are exchanged in the background: poll
        ``query_register_mem_status`` until ``OK``. How rank-table entries map to addresses and
        ports: ``llm_datadist.transport.comms``. Raises ``LLMException(LLM_LINK_FAILED)`` if a
        member does not link in time."""
        self._check_init()
        self._check_cache_manager_mode("link")
        check_isinstance("comm_name", comm_name, str, allow_none=False)
        raise_if_false(len(comm_name) != 0, "comm_name can not be empty")
        raise_if_false(len(comm_name) < _MAX_COMM_NAME, "comm_name length should be smaller than 128.")
        check_isinstance("cluster_rank_info", cluster_rank_info, dict, allow_none=False)
        for key, value in cluster_rank_info.items():
            check_isinstance("cluster_rank_info key", key, int, allow_none=False)
            check_isinstance("cluster_rank_info value", value, int, allow_none=False)
        raise_if_false(len(cluster_rank_info) <= _MAX_COMM_MEMBERS, "cluster_rank_info size can not be greater than 4.")
        for key, value in cluster_rank_info.items():
            check_uint64("cluster_rank_info key", key)
            check_uint32("cluster_rank_info value", value)
        check_isinstance("rank_table", rank_table, str, allow_none=False)
        ranks = list(cluster_rank_info.values())
        raise_if_false(len(ranks) > 1, "cluster num must be bigger than 1.")
        raise_if_false(ranks == sorted(ranks), "rank in cluster_rank_info must be ordered")
        raise_if_false(len(set(ranks)) == len(ranks), "rank in cluster_rank_info can not be duplicated.")
        raise_if_false(self._cluster_id in cluster_rank_info,
                       f"cluster_rank_info does not contain this cluster's id {self._cluster_id}")
        raise_if_false(self._engine.comm_count() < _MAX_COMMS, f"at most {_MAX_COMMS} links made with link() at a time")
        comm_id = self._engine.join_comm(comm_name, cluster_rank_info, rank_table)
        self._cache_manager._is_call_linked = True
        return comm_id

    def unlink(self, comm_id: int) -> None:
        """Drop a two-sided link (the links made for it); ``LLM_NOT_YET_LINK`` for an unknown id."""
        self._check_init()
        self._check_cache_manager_mode("unlink")
        check_isinstance("comm_id", comm_id, int, allow_none=False)
        check_uint64("comm_id", comm_id)
        self._engine.leave_comm(comm_id)

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        """``PREPARING`` while the cache tables of a two-sided link are exchanged, then ``OK``, or
        ``FAILED`` (sticky); ``LLM_NOT_YET_LINK`` for an unknown id."""
        self._check_init()
        self._check_cache_manager_mode("query_register_mem_status")
        check_isinstance("comm_id", comm_id, int, allow_none=False)
        check_uint64("comm_id", comm_id)
        return RegisterMemStatus[self._engine.comm_status(comm_id)]

    def check_link_status(self, remote_cluster_id: int) -> None:
        self._check_init()
        raise_if_false(not self._is_v2, _not_in_mode("check_link_status", cache_manager=True))
        raise LLMException("check_link_status belongs to the v1 KvCacheManager mode, which is not "
                           "implemented", status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
