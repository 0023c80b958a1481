"""CANN's ``llm_datadist.v2.llm_utils`` (hicann/hixl, ``src/python/llm_datadist/llm_datadist/v2/``):
every public helper CANN's module defines, with CANN's signatures, results and errors, written over
this package's objects, and the names CANN's module imports that this package has.

Two kinds of helper serve CANN's native wrapper there, and mean here only what they compute:

* ``pack_*`` and ``layer_range_to_tensor_indices`` build the tuples and index lists CANN's
  ``CacheManager`` hands its native calls. They build the same values here; this package's
  ``CacheManager`` does not use them (its engine takes the objects themselves).
* ``TransferCacheParameters``, ``TransferCacheJob``, ``TransferAsyncThread`` and
  ``transfer_cache_async`` are CANN's layer-wise job: a thread that waits for each layer and calls
  ``transfer_cache_func(task_id, packed_config, block_config)``, which in CANN is its native
  ``transfer_cache_v2``. Here they run with whatever callable is given (it returns a status code)
  and move nothing by themselves; ``CacheManager.transfer_cache_async`` does this package's
  layer-wise transfers through the engine instead (docs/cann.md).

``calc_tensor_size`` counts bytes as CANN's native ``calc_tensor_size`` does, in Python.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from threading import Thread
from typing import Callable, Dict, List, Optional, Tuple, Union

# This package's checks, under private names: this module has the public names CANN's has (CANN's
# own check helpers, whose signatures differ, are not provided; tests/api/test_v2_paths.py).
from llm_datadist import _validate
from llm_datadist.data_type import DataType
from llm_datadist.data_type import element_bits as _element_bits
from llm_datadist.llm_types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    CacheTask,
    KvCache,
    LayerSynchronizer,
    MemInfo,
    Placement,
    PushType,
    TransferConfig,
    TransferWithCacheKeyConfig,
    is_invalid_id,
    is_valid_id,
)
from llm_datadist.status import LLMException, LLMStatusCode, code_2_status

_log = logging.getLogger("llm_datadist")

_INVALID_ID = 2**64 - 1  # UINT64_MAX: "no id" in packed keys
_MAX_DISPLAYED_REQ_ID_COUNT = 8
_NUM_TENSORS_PER_LAYER = 2  # K and V


def clone_cache_desc(cache_desc: CacheDesc) -> CacheDesc:
    """A new ``CacheDesc`` with the same fields and a copy of the shape."""
    return CacheDesc(cache_desc.num_tensors, cache_desc.shape[:], cache_desc.data_type, cache_desc.placement,
                     cache_desc.batch_dim, cache_desc.seq_len_dim_index, cache_desc.kv_tensor_format)


def verify_cache_shape(shape: List[int]) -> None:
    """A cache shape: not empty, no 0 dimension (LLM_PARAM_INVALID), no dimension below -1 (-1 is
    a dynamic one). The last is raised as CANN raises it: an ``LLMException`` without a status
    code, so its ``status_code`` is ``LLM_SUCCESS`` (odd, but CANN's)."""
    _validate.raise_if_false(len(shape) > 0, "scalar is not supported")
    _validate.raise_if_false(0 not in shape, f"empty dimension is not supported, shape = {shape}")
    for dim in shape:
        if dim < -1:
            raise LLMException(f"dim {dim} is not supported, shape = {shape}")


def to_data_type(data_type_str: str) -> DataType:
    """The ``DataType`` whose number, as a decimal string, is ``data_type_str`` ("27": DT_BF16)."""
    for data_type in DataType:
        if str(data_type.value) == data_type_str:
            return data_type
    raise LLMException(f"unsupported dtype: {data_type_str}", status_code=LLMStatusCode.LLM_PARAM_INVALID)


def calc_tensor_size(shape: List[int], data_type: DataType) -> int:
    """Bytes of one tensor of ``shape`` and ``data_type``, counted as CANN's native
    ``calc_tensor_size`` (LLMUtils::CalcTensorMemSize) counts them: the product of the dimensions
    (an empty shape is one element) times the element size. A dimension that is not positive, or
    a count past int64, is ``LLMException(LLM_PARAM_INVALID)`` with CANN's message. CANN hands the
    arguments to pybind11, which refuses what is not a list of ints and a ``DataType`` with
    ``TypeError``; so does this function."""
    _validate.check_isinstance("shape", shape, [list, tuple], int, allow_none=False)
    _validate.check_isinstance("data_type", data_type, DataType, allow_none=False)
    count, size = 1, -1
    if all(dim > 0 for dim in shape):
        count = math.prod(shape)
        if count <= _validate.INT64_MAX:
            size = (count * _element_bits(data_type) + 7) // 8
    _validate.raise_if_false(0 <= size <= _validate.INT64_MAX,
                             f"Failed to calc tensor size, shape = {shape}, data_type = {data_type}")
    return size


class CacheDescParser:
    """CANN's reading of a ``CacheDesc`` from the GE options ``llm.RefInputShapes`` /
    ``llm.RefInputDtypes`` (one tensor per ``;``-separated entry, all alike),
    ``llm.RefInputSeqLenDimIndex`` and ``llm.kvTensorFormat``: a DEVICE ``CacheDesc``."""

    @staticmethod
    def parse_by_options(options: Dict[str, str]) -> CacheDesc:
        _validate.raise_if_false("llm.RefInputShapes" in options, "llm.RefInputShapes not set")
        shapes = options["llm.RefInputShapes"].split(";")
        _validate.raise_if_false(len(set(shapes)) == 1,
                                 f"zero or multiple different shapes is not supported, llm.RefInputShapes = {shapes}")
        _validate.raise_if_false("llm.RefInputDtypes" in options, "llm.RefInputDtypes not set")
        dtypes = options["llm.RefInputDtypes"].split(";")
        _validate.raise_if_false(len(set(dtypes)) == 1,
                                 "zero or multiple different data types is not supported, "
                                 f"llm.RefInputDtypes = {dtypes}")
        _validate.raise_if_false(len(shapes) == len(dtypes),
                                 f"kv_shapes num ({len(shapes)}) mismatches that of kv_data_type ({len(dtypes)})")
        shape = [int(dim) for dim in shapes[0].split(",")]
        verify_cache_shape(shape)
        if "llm.RefInputSeqLenDimIndex" in options:
            seq_len_dim_index = int(options["llm.RefInputSeqLenDimIndex"])
            _log.info("seq_len_dim_index from the options: %d", seq_len_dim_index)
            _validate.raise_if_false(0 <= seq_len_dim_index < len(shape),
                                     f"seq_len_dim_index ({seq_len_dim_index}) out of range, kv_shape = {shape}")
        elif -1 in shape[1:]:
            dynamic = shape[1:].count(-1)
            _validate.raise_if_false(dynamic == 1, f"can only have one dynamic dim apart from batch_dim(0), "
                                     f"but got {dynamic}, shape = {shape}")
            seq_len_dim_index = shape.index(-1, 1)
            _log.info("seq_len_dim_index inferred from the shape: %d", seq_len_dim_index)
        else:
            seq_len_dim_index = -1
            _log.info("llm.RefInputSeqLenDimIndex is not set and the shape has no dynamic dim: -1")
        cache_desc = CacheDesc(len(shapes), shape, to_data_type(dtypes[0]), Placement.DEVICE, 0,
                               seq_len_dim_index, options.get("llm.kvTensorFormat", None))
        _log.info("cache_desc from the options: %s", cache_desc)
        return cache_desc


def pack_cache_desc(cache_desc: CacheDesc) -> Tuple[int, int, int, List[int], int, bool]:
    """``(num_tensors, data type number, seq_len_dim_index, shape, placement number, is_blocks)``;
    ``is_blocks`` is set once the desc has been given to ``register_blocks_cache`` or
    ``allocate_blocks_cache``, as in CANN."""
    return (cache_desc.num_tensors, cache_desc.data_type.value, cache_desc.seq_len_dim_index, cache_desc.shape,
            cache_desc.placement.value, cache_desc._is_blocks)


def pack_cache_key(cache_key: CacheKey) -> Tuple[int, int, int, int, int, int, bool]:
    """``(cluster_id, cache_id -1, batch_index 0, req_id, prefix_id, model_id, False)``."""
    return (cache_key.prompt_cluster_id, -1, 0, cache_key.req_id, cache_key.prefix_id, cache_key.model_id, False)


def pack_cache_key_by_id(cache_key: CacheKeyByIdAndIndex) -> Tuple[int, int, int, int, int, int, bool]:
    """``(cluster_id, cache_id, batch_index, no req_id, no prefix_id, model_id 0, False)``."""
    return (cache_key.cluster_id, cache_key.cache_id, cache_key.batch_index, _INVALID_ID, _INVALID_ID, 0, False)


def pack_block_cache_key(cache_key: BlocksCacheKey) -> Tuple[int, int, int, int, int, int, bool]:
    """``(cluster_id, cache_id -1, batch_index 0, no req_id, no prefix_id, model_id, True)``."""
    return (cache_key.prompt_cluster_id, -1, 0, _INVALID_ID, _INVALID_ID, cache_key.model_id, True)


def pack_mem_info(mem_info: MemInfo) -> Tuple[int, int, int]:
    """``(mem_type number, addr, size)``."""
    return (mem_info.mem_type.value, mem_info.addr, mem_info.size)


@dataclass
class TransferCacheParameters:
    """The arguments of ``transfer_cache_async`` (CANN's ``CacheManager`` builds one per call)."""

    src_cache: Union[Cache, KvCache]
    transfer_configs: Union[List[Union[TransferConfig, TransferWithCacheKeyConfig]],
                            Tuple[Union[TransferConfig, TransferWithCacheKeyConfig], ...]]
    src_block_indices: Optional[List[int]] = None
    dst_block_indices: Optional[List[int]] = None
    dst_block_memory_size: Optional[int] = None


class TransferCacheJob:
    """CANN's layer-wise job: for each source layer, wait for ``layer_synchronizer``, then call
    ``transfer_cache_func(task_id, packed_config, block_config)`` once per config covering it.
    Results are kept per ``dst_cluster_id`` (configs to one cluster share a slot, as in CANN).
    Here ``transfer_cache_func`` is whatever callable the caller gives (CANN's native
    ``transfer_cache_v2`` there); its return value is read with ``code_2_status``."""

    task_id = 0  # the id passed to transfer_cache_func, counted over all jobs

    def __init__(self, params: TransferCacheParameters, layer_synchronizer: LayerSynchronizer,
                 transfer_cache_func: Callable) -> None:
        self._transfer_configs = params.transfer_configs
        self._src_block_indices = params.src_block_indices
        self._dst_block_indices = params.dst_block_indices
        self._dst_block_memory_size = params.dst_block_memory_size
        self._cache_id = params.src_cache.cache_id
        self._cache_desc = params.src_cache.cache_desc
        self._num_layers = 0
        self._rets: Dict[int, LLMStatusCode] = {}
        self._timeout_in_millis: Optional[int] = None
        self._is_data_cache_engine = isinstance(params.src_cache, Cache)
        self._layer_synchronizer = layer_synchronizer
        self._transfer_cache_func = transfer_cache_func

    def init(self) -> None:
        """Count the layers (two tensors each) and give each config without a source range all
        of them, then check every config."""
        num_tensors = self._cache_desc.num_tensors
        _validate.raise_if_false(num_tensors % 2 == 0, f"cache_desc.num_tensors ({num_tensors}) is not even")
        self._num_layers = num_tensors // 2
        for config in self._transfer_configs:
            if config.src_layer_range is None:
                config.src_layer_range = range(0, self._num_layers)
            self.check_transfer_config(config)

    def transfer_layers(self) -> None:
        for position, layer in enumerate(range(self._num_layers)):
            configs = [config for config in self._transfer_configs if layer in config.src_layer_range]
            if not configs:
                _log.info("source layer %d goes to no destination", layer)
                continue
            if not self._layer_synchronizer.synchronize_layer(layer, self._timeout_in_millis):
                _log.error("synchronizing layer %d failed", layer)
                for config in configs:
                    self._rets[config.dst_cluster_id] = LLMStatusCode.LLM_PARAM_INVALID  # CANN's code here
                return
            for config in configs:
                # CANN indexes the destination range with the layer's position among all source
                # layers (not within src_layer_range); kept as CANN's.
                dst_layer = layer if config.dst_layer_range is None else list(config.dst_layer_range)[position]
                ret = self.transfer_layer(layer, dst_layer, config)
                if ret != LLMStatusCode.LLM_SUCCESS:
                    _log.error("transferring layer %d to cluster %d failed", layer, config.dst_cluster_id)
                    self._rets[config.dst_cluster_id] = ret
                    return
                if layer == config.src_layer_range.stop - 1:
                    self._rets[config.dst_cluster_id] = LLMStatusCode.LLM_SUCCESS
        _log.info("every layer transferred")

    def transfer_layer(self, src_layer_index: int, dst_layer_idx: int,
                       transfer_config: Union[TransferConfig, TransferWithCacheKeyConfig]) -> LLMStatusCode:
        """Pack one layer's transfer as CANN's native call takes it and make that call:
        ``(cache_id, src_batch_index, src_layer, dst_addrs, dst cluster, dst cache_id or
        model_id, dst batch_index, push type, dst_layer, tensors per layer)`` and
        ``(dst_block_memory_size, src_block_indices, dst_block_indices)``."""
        packed = None
        if isinstance(transfer_config, TransferConfig):
            first = (src_layer_index - transfer_config.src_layer_range.start) * _NUM_TENSORS_PER_LAYER
            dst_addrs = transfer_config.dst_addrs[first:first + _NUM_TENSORS_PER_LAYER]
            packed = (self._cache_id, transfer_config.src_batch_index, src_layer_index, dst_addrs,
                      transfer_config.dst_cluster_id, 0, 0, PushType.NO_CACHE_KEY.value, src_layer_index,
                      _NUM_TENSORS_PER_LAYER)
        elif isinstance(transfer_config.cache_key, BlocksCacheKey):
            key = transfer_config.cache_key
            packed = (self._cache_id, 0, src_layer_index, [], key.cluster_id, key.model_id, 0,
                      PushType.BLOCKS_CACHE_KEY.value, dst_layer_idx, _NUM_TENSORS_PER_LAYER)
        elif isinstance(transfer_config.cache_key, CacheKeyByIdAndIndex):
            key = transfer_config.cache_key
            packed = (self._cache_id, transfer_config.src_batch_index, src_layer_index, [], key.cluster_id,
                      key.cache_id, key.batch_index, PushType.CACHE_KEY_BY_ID.value, dst_layer_idx,
                      _NUM_TENSORS_PER_LAYER)
        blocks = (0 if self._dst_block_memory_size is None else self._dst_block_memory_size,
                  [] if self._src_block_indices is None else self._src_block_indices,
                  [] if self._dst_block_indices is None else self._dst_block_indices)
        ret = self._transfer_cache_func(TransferCacheJob.task_id, packed, blocks)
        TransferCacheJob.task_id += 1
        return code_2_status(ret)

    def check_transfer_config(self, transfer_config: Union[TransferConfig, TransferWithCacheKeyConfig]) -> None:
        if self._src_block_indices:
            index = transfer_config.src_batch_index
            _validate.raise_if_false(index == 0,
                                     f"Invalid TransferConfig, src_batch_index ({index}) != 0 while src is blocks")
            _validate.raise_if_false(0 <= index < self._cache_desc.batch_size,
                                     f"Invalid TransferConfig, src_batch_index ({index}) out of range: "
                                     f"[0, {self._cache_desc.batch_size})")
        layers = transfer_config.src_layer_range
        _validate.raise_if_false(0 <= layers.start < layers.stop <= self._num_layers,
                                 f"src_layer_range: {layers} out of range, src_layer_num = {self._num_layers}")
        wanted = (layers.stop - layers.start) * _NUM_TENSORS_PER_LAYER
        if isinstance(transfer_config, TransferConfig):
            got = len(transfer_config.dst_addrs)
            _validate.raise_if_false(got == wanted,
                                     f"expect {wanted} dst_addrs, but len(dst_addrs) = {got}, range = {layers}")

    def get_results(self) -> List[Optional[LLMStatusCode]]:
        """Per config, its destination cluster's result (None: not reached)."""
        return [self._rets.get(config.dst_cluster_id) for config in self._transfer_configs]

    def num_transfer_configs(self) -> int:
        return len(self._transfer_configs)


class TransferAsyncThread(Thread):
    """Runs a ``TransferCacheJob``; ``get`` / ``get_results`` wait at most ``timeout`` seconds
    (None: no limit) and give ``default_err_code`` while the job still runs."""

    def __init__(self, transfer_job: TransferCacheJob, default_err_code=LLMStatusCode.LLM_TIMEOUT) -> None:
        super().__init__()
        self._transfer_job = transfer_job
        self._rets: list = []
        self._default_err_code = default_err_code

    def run(self) -> None:
        self._transfer_job.transfer_layers()

    def get_results(self, timeout) -> List[Optional[LLMStatusCode]]:
        self.join(timeout)
        if self.is_alive():
            return [self._default_err_code] * self._transfer_job.num_transfer_configs()
        return self._transfer_job.get_results()

    def get(self, timeout) -> LLMStatusCode:
        """The first result that is neither success nor None, else ``LLM_SUCCESS``."""
        self.join(timeout)
        if self.is_alive():
            return self._default_err_code
        for ret in self._transfer_job.get_results():
            if ret is not None and ret != LLMStatusCode.LLM_SUCCESS:
                return ret
        return LLMStatusCode.LLM_SUCCESS


def _check_block_indices(arg_name: str, arg_value) -> None:
    if arg_value is not None:
        _validate.check_isinstance(arg_name, arg_value, [list, tuple], int)
        for value in arg_value:
            _validate.check_uint64(arg_name, value)


def transfer_cache_async(params: TransferCacheParameters, layer_synchronizer: LayerSynchronizer,
                         transfer_cache_func: Callable, default_error_code=LLMStatusCode.LLM_TIMEOUT,
                         enable_remote_cache: bool = False) -> CacheTask:
    """Check ``params`` as CANN's ``CacheManager.transfer_cache_async`` does, then start a
    ``TransferAsyncThread`` over a ``TransferCacheJob`` calling ``transfer_cache_func``, and
    return its ``CacheTask``. Nothing moves unless ``transfer_cache_func`` moves it: this
    package's ``CacheManager.transfer_cache_async`` does not go through here."""
    _check_block_indices("dst_block_indices", params.dst_block_indices)
    _check_block_indices("src_block_indices", params.src_block_indices)
    if params.dst_block_memory_size is not None:
        _validate.check_uint64("dst_block_memory_size", params.dst_block_memory_size)
    if params.src_block_indices:  # from blocks
        _validate.raise_if_false(bool(params.dst_block_indices), "transfer from blocks to cache is not supported")
        _validate.raise_if_false(len(params.src_block_indices) == len(params.dst_block_indices),
                                 f"num_block_indices mismatches, src_num = {len(params.src_block_indices)}, "
                                 f"dst_num = {len(params.dst_block_indices)}")
    elif params.dst_block_indices:  # from a cache to blocks
        _validate.raise_if_false(params.dst_block_memory_size is not None,
                                 "dst_block_memory_size must be set when transfer from cache to blocks")
    _validate.check_isinstance("layer_synchronizer", layer_synchronizer, LayerSynchronizer, allow_none=False)
    if enable_remote_cache:
        _validate.check_isinstance("transfer_configs", params.transfer_configs, [list, tuple],
                                   TransferWithCacheKeyConfig, allow_none=False,
                                   extra_fmt="While enable_remote_cache_accessible is True, ")
    else:
        _validate.check_isinstance("transfer_configs", params.transfer_configs, [list, tuple], TransferConfig,
                                   allow_none=False)
    _validate.raise_if_false(bool(params.dst_block_indices) or params.dst_block_memory_size in (None, 0),
                             f"dst_block_memory_size ({params.dst_block_memory_size}) is neither None nor 0 "
                             "while dst is not blocks")
    job = TransferCacheJob(params, layer_synchronizer, transfer_cache_func)
    job.init()
    thread = TransferAsyncThread(job, default_error_code)
    thread.start()
    return CacheTask(thread)


def layer_range_to_tensor_indices(src_layer_range: Optional[range], dst_layer_range: Optional[range],
                                  tensor_num_per_layer: int = _NUM_TENSORS_PER_LAYER) -> Tuple[List[int], List[int]]:
    """The tensor indices of two layer ranges (``tensor_num_per_layer`` tensors a layer; a range
    that is None or empty gives []). A step other than 1 and a negative start are
    ``LLMException(LLM_PARAM_INVALID)``; a first or last layer past uint32 is ``ValueError``."""
    _validate.check_isinstance("src_layer_range", src_layer_range, range)
    _validate.check_isinstance("dst_layer_range", dst_layer_range, range)
    _validate.raise_if_false(src_layer_range is None or src_layer_range.step == 1,
                             "param check failed, src_layer_range step must be 1.")
    _validate.raise_if_false(dst_layer_range is None or dst_layer_range.step == 1,
                             "param check failed, dst_layer_range step must be 1.")
    indices = []
    for name, layers in (("src_layer_range", src_layer_range), ("dst_layer_range", dst_layer_range)):
        layer_list = [] if layers is None else list(layers)
        tensor_indices: List[int] = []
        if layer_list:
            _validate.raise_if_false(layer_list[0] >= 0, f"{name} is invalid, the start value:{layer_list[0]} is < 0")
            _validate.check_uint32(name, layer_list[0])
            _validate.check_uint32(name, layer_list[-1])
            first = layer_list[0] * tensor_num_per_layer
            tensor_indices = list(range(first, first + len(layer_list) * tensor_num_per_layer))
        indices.append(tensor_indices)
    return indices[0], indices[1]


def parse_listen_ip_info(listen_ip_info: str) -> Tuple[str, int]:
    """CANN's helper as CANN has it: ``"ip:port"`` split at its one ``:`` into ``(ip, int(port))``
    (``":5"`` gives ``("", 5)``), LLM_PARAM_INVALID for another number of ``:``, ``ValueError``
    for a port that is no number. ``LLMDataDist.init`` and ``switch_role`` here parse
    ``llm.listenIpInfo`` with a stricter parser of their own (it also takes ``"[ipv6]:port"`` and
    refuses an empty or bad address; docs/cann.md, "Types and checks")."""
    _validate.check_isinstance("listen_ip_info", listen_ip_info, [str])
    ip_and_port = listen_ip_info.split(":")
    _validate.raise_if_false(len(ip_and_port) == 2,
                             f'llm.listenIpInfo "{listen_ip_info}" is invalid, format should be "ip:port"')
    return ip_and_port[0], int(ip_and_port[1])
