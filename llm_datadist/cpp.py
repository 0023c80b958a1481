"""The CANN C++ API (``llm_datadist/llm_datadist.h``) as Python wrappers.

Names, defaults and ``Status`` return codes follow the C++ header: methods never raise for bad
input, they return a status (``LLM_SUCCESS``, ``LLM_PARAM_INVALID``, ...). Output parameters stay
output parameters, so documented C++ examples translate line by line::

    from llm_datadist import cpp

    dd = cpp.LlmDataDist(1, cpp.LlmRole.kPrompt)
    status = dd.Initialize({cpp.OPTION_DEVICE_ID: "0"})
    desc = cpp.CacheDesc(num_tensors=4, data_type=cpp.DT_INT32, shape=[4, 16])
    cache = cpp.Cache()
    status = dd.AllocateCache(desc, cache)        # fills cache.cache_id / tensor_addrs
    cache_id = cpp.Ref()                           # stands for ``int64_t &cache_id``
    status = dd.RegisterKvCache(desc, addrs, cpp.RegisterCfg(), cache_id)

An output ``int64_t&`` may be passed as a :class:`Ref` (or anything with a settable ``value``,
such as ``ctypes.c_int64``, or a list whose first element is set). ``std::pair`` layer ranges are
tuples; ``std::vector`` arguments are lists.

Differences from the V2 native library (documented in docs/cann.md): ``AllocateCache``,
``DeallocateCache``, ``CopyKvCache`` and ``CopyKvBlocks`` are implemented (as in the V1 library)
instead of returning ``LLM_FEATURE_NOT_ENABLED``; allocated caches are MIX caches usable as rows
and as blocks.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import sysconfig
from enum import IntEnum
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from llm_datadist import _validate
from llm_datadist.engine import values
from llm_datadist.engine.engine import Engine
from llm_datadist._memory import Place
from llm_datadist._validate import UINT64_MAX, is_instance_strict, param_invalid
from llm_datadist.data_type import GE_DATA_TYPES
from llm_datadist.data_type import DataType as _PythonDataType
from llm_datadist.status import CPP_STATUS_CODES, LLMException

logger = logging.getLogger("llm_datadist")


class Status(int):
    """``llm_datadist::Status`` (uint32): an int that prints its name."""

    def is_ok(self) -> bool:
        return self == 0

    @property
    def name(self) -> str:
        return _STATUS_NAMES.get(int(self), f"UNKNOWN_STATUS_{int(self):#x}")

    def __repr__(self) -> str:
        return self.name

    __str__ = __repr__


_STATUS_NAMES = {value: name for name, value in CPP_STATUS_CODES.items()}

# Every code of dd_status.h as a constant of this module (cpp.LLM_TIMEOUT, ...), from the
# generated status table; the three this module returns itself are also bound by name.
_STATUS_CONSTANTS = {name: Status(value) for name, value in CPP_STATUS_CODES.items()}
globals().update(_STATUS_CONSTANTS)
LLM_SUCCESS = _STATUS_CONSTANTS["LLM_SUCCESS"]
LLM_FAILED = _STATUS_CONSTANTS["LLM_FAILED"]
LLM_PARAM_INVALID = _STATUS_CONSTANTS["LLM_PARAM_INVALID"]
SUCCESS = LLM_SUCCESS
FAILED = LLM_FAILED

# Option keys (llm_datadist.h).
OPTION_LISTEN_IP_INFO = "llm.ListenIpInfo"
OPTION_DEVICE_ID = "llm.DeviceId"
OPTION_SYNC_CACHE_WAIT_TIME = "llm.SyncKvCacheWaitTime"
OPTION_BUF_POOL_CFG = "llm.BufPoolCfg"
OPTION_ENABLE_SET_ROLE = "llm.EnableSwitchRole"
OPTION_LOCAL_COMM_RES = "llm.LocalCommRes"
OPTION_TRANSFER_BACKEND = "llm.TransferBackend"
OPTION_GLOBAL_RESOURCE_CONFIG = "llm.GlobalResourceConfig"
#: Not in CANN: the shared secret that authenticates links (see ``transport.auth``).
OPTION_LINK_SECRET = "llm.LinkSecret"

# ``llm_datadist::DataType`` (``using DataType = ge::DataType``) and its 41 ``DT_*`` values, which
# llm_datadist.h re-exports from GE: an IntEnum of GE's numbers (data_type.GE_DATA_TYPES holds them
# with their sizes), each also a constant of this module (cpp.DT_FLOAT8_E4M3FN, ...). Every one but
# DT_UNDEFINED sizes a cache, as in CANN; a cache of DT_UNDEFINED is LLM_PARAM_INVALID.
class _DataTypeEnum(IntEnum):
    """What DataType adds to IntEnum (members are made from GE_DATA_TYPES, so the method lives in
    this member-less base)."""

    def __str__(self) -> str:  # "DataType.DT_INT4" on every Python version
        return f"{type(self).__name__}.{self.name}"


DataType = _DataTypeEnum("DataType", [(info.name, info.number) for info in GE_DATA_TYPES], module=__name__,
                         qualname="DataType")
globals().update(DataType.__members__)
DT_UNDEFINED = DataType.DT_UNDEFINED  # bound by name too: CacheDesc's default below


class llm:  # lower case: the C++ namespace's name
    """Namespace ``llm`` of CANN's header ``llm_datadist/llm_engine_types.h``: the role names and
    option keys it defines, as ``cpp.llm.LLM_OPTION_SYNC_KV_CACHE_WAIT_TIME`` and so on."""

    kPrompt = "Prompt"
    kDecoder = "Decoder"
    LLM_OPTION_CLUSTER_INFO = "llm.ClusterInfo"
    LLM_OPTION_ROLE = "llm.Role"
    LLM_OPTION_SYNC_KV_CACHE_WAIT_TIME = "llm.SyncKvCacheWaitTime"
    LLM_OPTION_OUTPUT_MAX_SIZE = "llm.OutputMaxSize"
    LLM_OPTION_ENABLE_SWITCH_ROLE = "llm.EnableSwitchRole"
    LLM_OPTION_BUF_POOL_CFG = "llm.BufPoolCfg"


class LlmRole(IntEnum):
    kPrompt = 1
    kDecoder = 2
    kMix = 3
    kEnd = 4


class CachePlacement(IntEnum):
    kHost = 0
    kDevice = 1


_ROLE_NAMES = {LlmRole.kPrompt: "Prompt", LlmRole.kDecoder: "Decoder", LlmRole.kMix: "Mix"}


class _Struct:
    """A C++ struct: fields with defaults, settable by keyword or attribute."""

    _fields: Tuple[Tuple[str, Any], ...] = ()

    def __init__(self, **kwargs: Any) -> None:
        for name, default in self._fields:
            value = kwargs.pop(name, default)
            setattr(self, name, list(value) if isinstance(default, list) and value is default else value)
        if kwargs:
            raise TypeError(f"{type(self).__name__} has no field(s) {', '.join(kwargs)}")

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name, _ in self._fields)
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and all(
            getattr(self, n) == getattr(other, n) for n, _ in self._fields)


class IpInfo(_Struct):
    _fields = (("ip", ""), ("port", 0))


class ClusterInfo(_Struct):
    _fields = (("remote_cluster_id", 0), ("remote_role_type", 0), ("local_ip_infos", []),
               ("remote_ip_infos", []))


class CacheIndex(_Struct):
    _fields = (("cluster_id", 0), ("cache_id", 0), ("batch_index", 0))


class CacheDesc(_Struct):
    _fields = (("placement", CachePlacement.kDevice), ("num_tensors", 0), ("data_type", DT_UNDEFINED),
               ("shape", []))


class Cache(_Struct):
    _fields = (("cache_id", -1), ("tensor_addrs", []), ("cache_desc", None))

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.cache_desc is None:
            self.cache_desc = CacheDesc()


class KvCacheExtParam(_Struct):
    _fields = (("src_layer_range", (-1, -1)), ("dst_layer_range", (-1, -1)), ("tensor_num_per_layer", 2))


class RegisterCfg(_Struct):
    _fields = ()


class Ref:
    """A mutable holder for C++ output parameters such as ``int64_t &cache_id``."""

    def __init__(self, value: Any = 0) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Ref({self.value!r})"


def _set_output(holder: Any, value: Any) -> None:
    if isinstance(holder, list):
        if holder:
            holder[0] = value
        else:
            holder.append(value)
    elif hasattr(holder, "value"):
        holder.value = value
    else:
        raise param_invalid(f"output parameter must be a cpp.Ref, an object with .value or a list, "
                            f"got {type(holder).__name__}")


# Where a bad argument is found. This module reads and converts the caller's arguments (with the
# checks and the ip conversion of _validate); the engine and the layers under it report
# a bad argument as LLMException(LLM_PARAM_INVALID). So a TypeError, ValueError, AttributeError or
# OverflowError is the caller's when it was raised here (directly, or by the standard library
# called from here, e.g. list(shape) or LlmRole(role)); one that comes up through any other code
# (engine, transport, core, runtimes) is a bug of this library, reported as LLM_FAILED.
_ARGUMENT_ERRORS = (TypeError, ValueError, AttributeError, OverflowError)
_ARGUMENT_FILES = frozenset(os.path.abspath(module.__file__) for module in (sys.modules[__name__], _validate))
_STDLIB_DIRS = tuple(sorted({os.path.join(os.path.abspath(sysconfig.get_paths()[key]), "")
                             for key in ("stdlib", "platstdlib")}))
# site-packages usually lies inside the standard library's directory: installed code is not it.
_INSTALLED_DIRS = tuple(sorted({os.path.join(os.path.abspath(sysconfig.get_paths()[key]), "")
                                for key in ("purelib", "platlib")}))


def _in_stdlib(filename: str) -> bool:
    if filename.startswith("<frozen "):
        return True
    path = os.path.abspath(filename)
    return path.startswith(_STDLIB_DIRS) and not path.startswith(_INSTALLED_DIRS)


def _is_argument_error(exc: BaseException) -> bool:
    """Whether ``exc`` (caught by ``_returns_status``) was raised checking the caller's arguments:
    an argument error type, and every frame from the wrapper down to the raise is in this module,
    its argument helpers or the standard library."""
    if not isinstance(exc, _ARGUMENT_ERRORS):
        return False
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if os.path.abspath(filename) not in _ARGUMENT_FILES and not _in_stdlib(filename):
            return False
        tb = tb.tb_next
    return True


def _returns_status(method):
    """Run a method, turning every error into its status: C++ methods report, never raise.

    ``LLMException`` gives its status; a bad argument found by this module gives
    ``LLM_PARAM_INVALID``; any other exception is an internal error: ``LLM_FAILED``, with the
    traceback logged (logger ``llm_datadist``, level ERROR).
    """

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if method.__name__ != "Initialize" and not self._engine.initialized:
            logger.error("%s called before Initialize", method.__name__)
            return LLM_FAILED
        try:
            result = method(self, *args, **kwargs)
        except LLMException as exc:
            logger.error("%s failed: %s", method.__name__, exc)
            return Status(int(exc.status_code))
        except Exception as exc:
            if _is_argument_error(exc):
                logger.error("%s: invalid parameter: %s", method.__name__, exc)
                return LLM_PARAM_INVALID
            logger.exception("%s failed with an internal error (%s), not caused by its arguments",
                             method.__name__, type(exc).__name__)
            return LLM_FAILED
        return LLM_SUCCESS if result is None else result

    return wrapper


def _check_uint(name: str, value: Any, bits: int) -> int:
    if not is_instance_strict(value, int) or not 0 <= value < 2**bits:
        raise param_invalid(f"{name} must be a uint{bits}, got {value!r}")
    return value


def _data_type(value: Any) -> DataType:
    """A ``DataType`` member or its number; also (not in C++) a Python-style ``DataType``."""
    number = value.value if isinstance(value, _PythonDataType) else value
    if not is_instance_strict(number, int):
        raise param_invalid(f"data_type {value!r} is not a ge::DataType")
    try:
        return DataType(number)
    except ValueError:
        raise param_invalid(f"data_type {value!r} is not a ge::DataType of llm_datadist.h") from None


def _placement(value: Any) -> Place:
    if value not in (CachePlacement.kHost, CachePlacement.kDevice):
        raise param_invalid(f"placement {value!r} must be kHost or kDevice")
    return Place.DEVICE if value == CachePlacement.kDevice else Place.HOST


def _desc_values(desc: CacheDesc) -> Tuple[int, List[int], DataType, Place]:
    if not isinstance(desc, CacheDesc):
        raise param_invalid(f"cache_desc must be a cpp.CacheDesc, got {type(desc).__name__}")
    num_tensors = _check_uint("num_tensors", desc.num_tensors, 32)
    shape = list(desc.shape)
    if not shape or not all(is_instance_strict(d, int) for d in shape):
        raise param_invalid(f"shape {desc.shape!r} must be a non-empty list of ints")
    return num_tensors, shape, _data_type(desc.data_type), _placement(desc.placement)


def _block_list(name: str, blocks: Sequence[int]) -> np.ndarray:
    """A ``std::vector<uint64_t>`` of block indices as the core's checked uint64 array: the
    container is checked here, every element once by the core (LLM_PARAM_INVALID if bad)."""
    if not isinstance(blocks, (list, tuple, np.ndarray)):
        raise param_invalid(f"{name} must be a list of uint64")
    return values.block_array(blocks, name)


class LlmDataDist:
    """``llm_datadist::LlmDataDist(cluster_id, role)``; every method returns a ``Status``."""

    def __init__(self, cluster_id: int, role: LlmRole) -> None:
        if not is_instance_strict(cluster_id, int) or not 0 <= cluster_id <= UINT64_MAX:
            raise ValueError(f"cluster_id must be a uint64, got {cluster_id!r}")
        self._cluster_id = cluster_id
        self._role = LlmRole(role)
        self._engine = Engine(cluster_id, _ROLE_NAMES.get(self._role, "Mix"))

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def engine(self) -> Engine:
        """The engine below this cluster: the documented seam of ``LLMDataDist.engine`` (not part
        of CANN's API), for tests, diagnostics and integrations."""
        return self._engine

    @_returns_status
    def Initialize(self, options: Dict[str, str]) -> Status:
        """Options: OPTION_DEVICE_ID (required, one device), OPTION_LISTEN_IP_INFO,
        OPTION_SYNC_CACHE_WAIT_TIME (ms, default 1000). Success also when already initialized."""
        if self._engine.initialized:
            return LLM_SUCCESS
        if self._role not in _ROLE_NAMES:
            raise param_invalid(f"role {self._role!r} is not kPrompt, kDecoder or kMix")
        if not isinstance(options, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in options.items()):
            raise param_invalid("options must map str to str")
        device = options.get(OPTION_DEVICE_ID, options.get("ge.exec.deviceId"))
        if device is None:
            raise param_invalid(f"option {OPTION_DEVICE_ID} is required")
        device_id = values.check_device_id(device)
        timeout = values.check_sync_timeout(options.get(OPTION_SYNC_CACHE_WAIT_TIME,
                                                         str(values.DEFAULT_SYNC_KV_TIMEOUT_MS)))
        listen_text = options.get(OPTION_LISTEN_IP_INFO, options.get("llm.listenIpInfo", ""))
        listen = values.parse_listen_ip_info(listen_text) if listen_text else None
        opts = dict(options)
        opts["llm.Role"] = _ROLE_NAMES[self._role]
        opts["llm.EnableRemoteCacheAccessible"] = "1"
        self._engine.initialize(opts, device_id, timeout, listen)
        return LLM_SUCCESS

    def Finalize(self) -> None:
        self._engine.finalize()

    @_returns_status
    def SetRole(self, role: LlmRole, options: Dict[str, str] = None) -> Status:
        """Change the role label; OPTION_LISTEN_IP_INFO in ``options`` sets where to listen."""
        if role not in _ROLE_NAMES:
            raise param_invalid(f"role {role!r} is not kPrompt, kDecoder or kMix")
        options = options or {}
        listen_text = options.get(OPTION_LISTEN_IP_INFO, "")
        listen = values.parse_listen_ip_info(listen_text) if listen_text else None
        self._engine.switch_role(_ROLE_NAMES[LlmRole(role)], listen)
        self._role = LlmRole(role)
        return LLM_SUCCESS

    @property
    def listen_ip_info(self) -> str:
        """``"ip:port"`` actually listened on (port 0 resolved), ``""`` if not listening. Not in
        the C++ API; there for programs that listen on port 0."""
        address = self._engine.listen_address
        return f"{address[0]}:{address[1]}" if address else ""

    def lost_links(self) -> Dict[int, str]:
        """Clusters whose link ended without an ``UnlinkLlmClusters`` here, with the reason (see
        ``LLMDataDist.lost_links``); empty before ``Initialize``. Not in the C++ API."""
        return self._engine.lost_links()

    # -- caches --------------------------------------------------------------------------------
    @_returns_status
    def AllocateCache(self, cache_desc: CacheDesc, cache: Cache) -> Status:
        """Allocate ``num_tensors`` zeroed tensors and fill ``cache`` (id, addresses, desc)."""
        num_tensors, shape, data_type, placement = _desc_values(cache_desc)
        if not isinstance(cache, Cache):
            raise param_invalid(f"cache must be a cpp.Cache output object, got {type(cache).__name__}")
        record = self._engine.allocate(num_tensors, shape, data_type, placement, values.MIX)
        cache.cache_id = record.cache_id
        cache.tensor_addrs = list(record.addrs)
        cache.cache_desc = cache_desc
        return LLM_SUCCESS

    @_returns_status
    def DeallocateCache(self, cache_id: int) -> Status:
        self._engine.deallocate(cache_id)
        return LLM_SUCCESS

    @_returns_status
    def RegisterKvCache(self, cache_desc: CacheDesc, addrs: Sequence[int], cfg: RegisterCfg,
                        cache_id: Any) -> Status:
        """Register caller-owned memory as a MIX cache; the new id goes to ``cache_id``."""
        num_tensors, shape, data_type, placement = _desc_values(cache_desc)
        if not isinstance(addrs, (list, tuple)) or not addrs:
            raise param_invalid("addrs must be a non-empty list of addresses")
        if len(addrs) != num_tensors:
            raise param_invalid(f"{len(addrs)} addresses for num_tensors {num_tensors}")
        record = self._engine.register(num_tensors, shape, data_type, placement, list(addrs), values.MIX)
        _set_output(cache_id, record.cache_id)
        return LLM_SUCCESS

    @_returns_status
    def UnregisterKvCache(self, cache_id: int) -> Status:
        self._engine.unregister(cache_id)
        return LLM_SUCCESS

    def _record(self, cache: Cache, name: str):
        if not isinstance(cache, Cache):
            raise param_invalid(f"{name} must be a cpp.Cache, got {type(cache).__name__}")
        return self._engine.lookup(cache.cache_id)

    @staticmethod
    def _check_not_host_to_host(src, dst, method: str) -> None:
        if src.placement == Place.HOST and dst.placement == Place.HOST:
            raise param_invalid(f"{method} does not copy host to host")

    @_returns_status
    def CopyKvCache(self, src_cache: Cache, dst_cache: Cache, src_batch_index: int = 0,
                    dst_batch_index: int = 0, offset: int = 0, size: int = -1) -> Status:
        """Copy row ``src_batch_index`` of each tensor into row ``dst_batch_index`` (from
        ``offset``, ``size`` bytes, -1 = rest of the row). Device to device or device to host."""
        src, dst = self._record(src_cache, "src_cache"), self._record(dst_cache, "dst_cache")
        if src.placement == Place.HOST:
            raise param_invalid("CopyKvCache copies from a device cache (D2D or D2H)")
        _check_uint("src_batch_index", src_batch_index, 32)
        _check_uint("dst_batch_index", dst_batch_index, 32)
        _check_uint("offset", offset, 64)
        if not is_instance_strict(size, int) or not (size == -1 or size > 0):
            raise param_invalid(f"size {size!r} must be -1 or > 0")
        self._engine.copy_rows(dst, src, dst_batch_index, src_batch_index, offset, size)
        return LLM_SUCCESS

    @_returns_status
    def CopyKvBlocks(self, src_cache: Cache, dst_cache: Cache, src_blocks: Sequence[int],
                     dst_blocks_list: Sequence[Sequence[int]]) -> Status:
        """Copy blocks ``src_blocks`` into each block list of ``dst_blocks_list`` (D2D, D2H, H2D)."""
        src, dst = self._record(src_cache, "src_cache"), self._record(dst_cache, "dst_cache")
        self._check_not_host_to_host(src, dst, "CopyKvBlocks")
        src_list = _block_list("src_blocks", src_blocks)
        if not len(src_list):
            raise param_invalid("src_blocks must not be empty")
        if not isinstance(dst_blocks_list, (list, tuple)) or not dst_blocks_list:
            raise param_invalid("dst_blocks_list must be a non-empty list of block lists")
        checked = [_block_list("dst_blocks", d) for d in dst_blocks_list]
        for dst_list in checked:
            if len(dst_list) != len(src_list):
                raise param_invalid(f"a dst block list has {len(dst_list)} entries, src_blocks has "
                                    f"{len(src_list)}")
        src_all = src_list if len(checked) == 1 else np.tile(src_list, len(checked))
        dst_all = checked[0] if len(checked) == 1 else np.concatenate(checked)
        self._engine.copy_blocks(src, dst, src_all, dst_all)
        return LLM_SUCCESS

    # -- links -----------------------------------------------------------------------------------
    @staticmethod
    def _ip(info: Any, what: str) -> Tuple[str, int]:
        if not isinstance(info, IpInfo):
            raise param_invalid(f"{what} must hold cpp.IpInfo, got {type(info).__name__}")
        ip = info.ip
        if is_instance_strict(ip, int):  # the deprecated packed form
            ip = _validate.unpack_ip(ip)
        if not isinstance(ip, str) or not ip:
            raise param_invalid(f"{what}: ip must be a dotted address string, got {info.ip!r}")
        return ip, _check_uint(f"{what}.port", info.port, 16)

    def _clusters(self, clusters: Sequence[ClusterInfo], rets: Any, timeout: int, need_ip: bool):
        if not isinstance(rets, list):
            raise param_invalid("rets must be a list (std::vector<Status>&) to fill")
        if not is_instance_strict(timeout, int) or not 0 < timeout <= 2**31 - 1:
            raise param_invalid(f"timeout_in_millis must be a positive int32, got {timeout!r}")
        if not isinstance(clusters, (list, tuple)):
            raise param_invalid("clusters must be a list of cpp.ClusterInfo")
        targets = []
        for i, info in enumerate(clusters):
            if not isinstance(info, ClusterInfo):
                raise param_invalid(f"clusters[{i}] must be a cpp.ClusterInfo")
            cluster_id = _check_uint(f"clusters[{i}].remote_cluster_id", info.remote_cluster_id, 64)
            if need_ip:
                if len(info.remote_ip_infos) != 1:
                    raise param_invalid(f"clusters[{i}] needs exactly one remote ip info")
                ip, port = self._ip(info.remote_ip_infos[0], f"clusters[{i}].remote_ip_infos[0]")
                targets.append((cluster_id, ip, port))
            else:
                targets.append((cluster_id, "", 0))
        return targets

    @staticmethod
    def _fill(rets: List[Status], codes) -> Status:
        rets[:] = [Status(int(code)) for code in codes]
        failed = [r for r in rets if r != LLM_SUCCESS]
        return failed[0] if failed else LLM_SUCCESS

    @_returns_status
    def LinkLlmClusters(self, clusters: Sequence[ClusterInfo], rets: List[Status],
                        timeout_in_millis: int = 1000) -> Status:
        """Link to each cluster's listener; ``rets`` gets one status per cluster. Returns
        ``LLM_SUCCESS`` only if every link was made, else the first failure."""
        targets = self._clusters(clusters, rets, timeout_in_millis, True)
        return self._fill(rets, self._engine.link_many(targets, timeout_in_millis))

    @_returns_status
    def UnlinkLlmClusters(self, clusters: Sequence[ClusterInfo], rets: List[Status],
                          timeout_in_millis: int = 1000, force_flag: bool = False) -> Status:
        """Drop links (non-forced: the peer is told first; forced: local state only)."""
        if not isinstance(force_flag, bool):
            raise param_invalid("force_flag must be a bool")
        targets = self._clusters(clusters, rets, timeout_in_millis, not force_flag)
        codes = self._engine.unlink_many([t[0] for t in targets], timeout_in_millis, force_flag)
        return self._fill(rets, codes)

    # -- transfers ---------------------------------------------------------------------------------
    @staticmethod
    def _ext(ext_param: Any):
        """The layer selection of a ``KvCacheExtParam`` as ``tensors(src_n, dst_n)``."""
        ext = KvCacheExtParam() if ext_param is None else ext_param
        if not isinstance(ext, KvCacheExtParam):
            raise param_invalid(f"ext_param must be a cpp.KvCacheExtParam, got {type(ext).__name__}")
        n = _check_uint("tensor_num_per_layer", ext.tensor_num_per_layer, 8)
        if n == 0:
            raise param_invalid("tensor_num_per_layer must be > 0")
        src_range, dst_range = tuple(ext.src_layer_range), tuple(ext.dst_layer_range)
        if src_range == (-1, -1) and dst_range == (-1, -1):
            return values.whole_caches(n)
        return values.layer_tensors(src_range, dst_range, n, inclusive=True)

    def _index(self, index: Any, name: str) -> Tuple[int, int, int]:
        if not isinstance(index, CacheIndex):
            raise param_invalid(f"{name} must be a cpp.CacheIndex, got {type(index).__name__}")
        cluster_id = _check_uint(f"{name}.cluster_id", index.cluster_id, 64)
        if not is_instance_strict(index.cache_id, int):
            raise param_invalid(f"{name}.cache_id must be an int64")
        return cluster_id, index.cache_id, _check_uint(f"{name}.batch_index", index.batch_index, 32)

    def _check_push_role(self, method: str) -> None:
        if self._role not in (LlmRole.kPrompt, LlmRole.kMix):
            raise param_invalid(f"{method} is only available to the Prompt (or Mix) role; this "
                                f"cluster is {self._role.name}")

    @_returns_status
    def PullKvCache(self, src_cache_index: CacheIndex, dst_cache: Cache, batch_index: int = 0,
                    size: int = -1, ext_param: KvCacheExtParam = None) -> Status:
        """Pull row ``src_cache_index.batch_index`` of the remote cache into row ``batch_index``
        of ``dst_cache`` (``size`` bytes per tensor, -1 = one local row)."""
        cluster_id, cache_id, row = self._index(src_cache_index, "src_cache_index")
        dst = self._record(dst_cache, "dst_cache")
        _check_uint("batch_index", batch_index, 32)
        if not is_instance_strict(size, int) or not (size == -1 or 0 < size <= dst.row_bytes):
            raise param_invalid(f"size {size!r} must be -1 or in [1, {dst.row_bytes}]")
        if batch_index >= dst.num_rows:
            raise param_invalid(f"batch_index {batch_index} is out of range for {dst.num_rows} rows")
        self._engine.pull_rows(cluster_id, values.CacheRowRef(cache_id, row), dst, batch_index, size,
                               self._ext(ext_param))
        return LLM_SUCCESS

    @_returns_status
    def PullKvBlocks(self, src_cache_index: CacheIndex, dst_cache: Cache, src_blocks: Sequence[int],
                     dst_blocks: Sequence[int], ext_param: KvCacheExtParam = None) -> Status:
        """Pull remote blocks ``src_blocks[k]`` into local blocks ``dst_blocks[k]``."""
        cluster_id, cache_id, row = self._index(src_cache_index, "src_cache_index")
        if row != 0:
            raise param_invalid("src_cache_index.batch_index must be 0 for block transfers")
        dst = self._record(dst_cache, "dst_cache")
        src_list, dst_list = self._block_lists(src_blocks, dst_blocks)
        self._engine.pull_blocks(cluster_id, values.CacheRowRef(cache_id, 0), dst,
                                 values.BlockSpec(src_list, dst_list), self._ext(ext_param))
        return LLM_SUCCESS

    @_returns_status
    def PushKvCache(self, src_cache: Cache, dst_cache_index: CacheIndex, src_batch_index: int = 0,
                    size: int = -1, ext_param: KvCacheExtParam = None) -> Status:
        """Push row ``src_batch_index`` of ``src_cache`` into row ``dst_cache_index.batch_index``
        of the remote cache. Prompt (or Mix) role only; ``size`` must be -1."""
        self._check_push_role("PushKvCache")
        cluster_id, cache_id, row = self._index(dst_cache_index, "dst_cache_index")
        src = self._record(src_cache, "src_cache")
        _check_uint("src_batch_index", src_batch_index, 32)
        if size != -1:
            raise param_invalid(f"size must be -1 (one row), got {size!r}")
        if src_batch_index >= src.num_rows:
            raise param_invalid(f"src_batch_index {src_batch_index} is out of range for {src.num_rows} rows")
        self._engine.push_rows(cluster_id, values.CacheRowRef(cache_id, row), src, src_batch_index,
                               self._ext(ext_param))
        return LLM_SUCCESS

    @_returns_status
    def PushKvBlocks(self, src_cache: Cache, dst_cache_index: CacheIndex, src_blocks: Sequence[int],
                     dst_blocks: Sequence[int], ext_param: KvCacheExtParam = None) -> Status:
        """Push local blocks ``src_blocks[k]`` into blocks ``dst_blocks[k]`` of the remote cache
        ``dst_cache_index.cache_id``. Prompt (or Mix) role only."""
        self._check_push_role("PushKvBlocks")
        cluster_id, cache_id, row = self._index(dst_cache_index, "dst_cache_index")
        if row != 0:
            raise param_invalid("dst_cache_index.batch_index must be 0 for block transfers")
        src = self._record(src_cache, "src_cache")
        src_list, dst_list = self._block_lists(src_blocks, dst_blocks)
        self._engine.push_blocks(cluster_id, values.CacheRowRef(cache_id, 0), src,
                                 values.BlockSpec(src_list, dst_list), self._ext(ext_param))
        return LLM_SUCCESS

    @staticmethod
    def _block_lists(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
        src_list, dst_list = _block_list("src_blocks", src_blocks), _block_list("dst_blocks", dst_blocks)
        if not len(src_list):
            raise param_invalid("src_blocks must not be empty")
        if len(src_list) != len(dst_list):
            raise param_invalid(f"src_blocks has {len(src_list)} entries, dst_blocks {len(dst_list)}")
        return src_list, dst_list
