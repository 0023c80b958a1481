from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

MEMCPY_HOST_TO_HOST: int
MEMCPY_HOST_TO_DEVICE: int
MEMCPY_DEVICE_TO_HOST: int
MEMCPY_DEVICE_TO_DEVICE: int
MEMCPY_KIND_NAMES: dict[int, str]
DEBUG_BUILD: bool
CYTHON_VERSION: str
C_STATUS_CODES: dict[str, int]
RUNTIME_HOST_ADDRESSABLE: int
RUNTIME_ASYNC_COPY: int
RUNTIME_BATCHED_COPY: int
RUNTIME_IPC: int
CAPABILITIES: dict[str, int]

class Runtime:
    name: str
    binding: str
    library: str
    @property
    def capabilities(self) -> int: ...
    @property
    def host_addressable(self) -> bool: ...
    def set_device(self, device_id: int) -> None: ...
    def device_count(self) -> int: ...
    def memcpy(self, dst: int, src: int, nbytes: int, kind: int) -> None: ...

def bindings() -> Tuple[str, ...]: ...
def load_runtime(name: str, library: Optional[str] = ..., binding: Optional[str] = ...) -> Runtime: ...

class Allocation:
    addr: int
    nbytes: int
    on_device: bool
    runtime: Runtime
    host_addressable: bool
    def __init__(self, runtime: Runtime, nbytes: int, on_device: bool) -> None: ...

class HostRegion:
    addr: int
    nbytes: int
    owner: Any
    def __init__(self, addr: int, nbytes: int, owner: Any = ...) -> None: ...
    def as_array(self, dtype: Any, shape: Sequence[int]) -> np.ndarray: ...

class CacheLayout:
    num_tensors: int
    num_rows: int
    row_bytes: int
    tensor_addrs: List[int]
    tensor_bytes: int
    def __init__(self, addrs: Sequence[int], num_rows: int, row_bytes: int) -> None: ...

class CopyPlan:
    total_bytes: int
    def __len__(self) -> int: ...
    def descriptors(self) -> np.ndarray: ...

BLOCK_ERRORS_STATUS: int
BLOCK_ERRORS_CANN: int

def as_block_array(values: Any, name: str = ..., errors: int = ...) -> np.ndarray: ...
def block_map_arrays(mapping: Any, one_to_many: bool = ...) -> Optional[Tuple[np.ndarray, np.ndarray]]: ...
def plan_blocks(src: CacheLayout, dst: CacheLayout, src_tensors: Optional[Sequence[int]],
                dst_tensors: Optional[Sequence[int]], src_blocks: Optional[Union[Sequence[int], np.ndarray]],
                dst_blocks: Optional[Union[Sequence[int], np.ndarray]], nbytes: int = ...) -> CopyPlan: ...
def plan_rows(src: CacheLayout, dst: CacheLayout, src_tensors: Optional[Sequence[int]],
              dst_tensors: Optional[Sequence[int]], src_row: int, dst_row: int,
              src_offset: int = ..., dst_offset: int = ..., size: int = ...) -> CopyPlan: ...
def plan_row_to_blocks(src: CacheLayout, dst: CacheLayout, src_tensors: Optional[Sequence[int]],
                       dst_tensors: Optional[Sequence[int]], src_row: int,
                       dst_blocks: Union[Sequence[int], np.ndarray]) -> CopyPlan: ...
def layer_range_to_tensor_indices(layer_range: Optional[range], num_tensors: int,
                                  tensor_num_per_layer: int = ...) -> List[int]: ...
def inclusive_layer_range_to_tensor_indices(layer_range: Tuple[int, int], num_tensors: int,
                                            tensor_num_per_layer: int = ...) -> List[int]: ...
def resolve_layer_ranges(src_range: Any, dst_range: Any, src_num_tensors: int, dst_num_tensors: int,
                         tensor_num_per_layer: int = ..., inclusive: bool = ...
                         ) -> Tuple[List[int], List[int]]: ...
def execute(plan: CopyPlan, runtime: Runtime, kind: int) -> None: ...
def memcpy_baseline(plan: CopyPlan) -> None: ...
