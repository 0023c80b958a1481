"""Turning user memory (integer addresses, numpy arrays, torch tensors) into addresses."""

from __future__ import annotations

import math
from enum import IntEnum
from typing import Any, Collection, List, Sequence, Tuple

import numpy as np

from llm_datadist import _core
from llm_datadist._validate import UINT64_MAX, param_invalid, raise_if_false
from llm_datadist.data_type import DataType, element_bits, numpy_dtype


ADDRESS_SPACE = UINT64_MAX + 1
#: At most this many dimensions in a cache shape (as in CANN).
MAX_SHAPE_DIMS = 31


class Place(IntEnum):
    """Where a cache's memory lives: the one spelling of a placement below the API styles (each
    API converts its own enum, ``Placement`` or ``CachePlacement``, at its boundary)."""

    HOST = 0
    DEVICE = 1


def tensor_bytes(shape: Sequence[int], data_type: DataType) -> int:
    """Bytes of one tensor, as CANN's LLMUtils::GetSizeInBytes counts them: prod(shape) * element
    size, and for a type packed below a byte ceil(prod(shape) * bits / 8). ``data_type`` is a
    ``DataType`` or a ``ge::DataType`` number. Checks what the engine needs (1..31 dims, positive
    dims, a type with a size). CANN's CeilDiv there takes int32, so CANN miscounts a packed tensor
    of 2**31 bits or more; this count is exact."""
    bits = element_bits(data_type)
    raise_if_false(bits is not None, f"data type {data_type} has no element size")
    raise_if_false(1 <= len(shape) <= MAX_SHAPE_DIMS,
                   f"shape {list(shape)} must have 1..{MAX_SHAPE_DIMS} dimensions")
    raise_if_false(all(dim > 0 for dim in shape), f"shape {list(shape)} must have positive dimensions")
    return (math.prod(shape) * bits + 7) // 8


def check_address_range(addr: int, nbytes: int, where: str) -> None:
    """``[addr, addr + nbytes)`` must be a range of the 64-bit address space that does not start
    at 0 (a range ending exactly at 2**64 is accepted); LLM_PARAM_INVALID otherwise."""
    if addr <= 0 or addr + nbytes > ADDRESS_SPACE:
        raise param_invalid(f"{where} = {addr:#x} is not a valid address for a tensor of {nbytes} "
                            f"bytes: it must be non-zero and the tensor must end at or below 2**64")


def _is_torch_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr")


def resolve_address(value: Any, needed_bytes: int, runtime_name: str, where: str,
                    tensor_devices: Collection[str] = ()) -> Tuple[int, Any]:
    """``(address, object to keep alive or None)`` for one element of an ``addrs`` list.

    Arrays and tensors must be contiguous, writable and hold at least ``needed_bytes``; a torch
    tensor off the cpu must be on one of ``tensor_devices`` (the torch device types whose memory
    the ``runtime_name`` runtime holds: ``runtimes.tensor_devices``, asked by the caller so that
    this base helper stays below the runtimes).
    """
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        addr = int(value)
        check_address_range(addr, needed_bytes, where)
        return addr, None
    if isinstance(value, np.ndarray):
        if not value.flags.c_contiguous:
            raise param_invalid(f"{where}: numpy array must be C-contiguous")
        if not value.flags.writeable:
            raise param_invalid(f"{where}: numpy array must be writable")
        if value.nbytes < needed_bytes:
            raise param_invalid(f"{where}: numpy array holds {value.nbytes} bytes, the cache "
                                f"tensor needs {needed_bytes}")
        return int(value.ctypes.data), value
    if _is_torch_tensor(value):
        if not value.is_contiguous():
            raise param_invalid(f"{where}: torch tensor must be contiguous")
        nbytes = value.numel() * value.element_size()
        if nbytes < needed_bytes:
            raise param_invalid(f"{where}: torch tensor holds {nbytes} bytes, the cache tensor "
                                f"needs {needed_bytes}")
        device = getattr(getattr(value, "device", None), "type", "cpu")
        if device != "cpu" and device not in tensor_devices:
            raise param_invalid(f"{where}: a torch tensor on {device} cannot be used with the "
                                f"{runtime_name} runtime")
        return int(value.data_ptr()), value
    raise TypeError(f"{where} must be an int address, a numpy array or a torch tensor, "
                    f"got {type(value).__name__}")


def resolve_addresses(values, needed_bytes: int, runtime_name: str,
                      tensor_devices: Collection[str] = ()) -> Tuple[List[int], List[Any]]:
    addrs, keepalive = [], []
    for i, value in enumerate(values):
        addr, owner = resolve_address(value, needed_bytes, runtime_name, f"addrs[{i}]", tensor_devices)
        addrs.append(addr)
        keepalive.append(owner)
    return addrs, keepalive


def host_view(addr: int, nbytes: int, owner: Any, data_type: DataType, shape: Sequence[int]) -> np.ndarray:
    """A zero-copy numpy array of ``data_type``/``shape`` over host memory ``[addr, addr +
    nbytes)``; it keeps ``owner`` (what holds the memory) alive."""
    return _core.HostRegion(addr, nbytes, owner).as_array(numpy_dtype(data_type), shape)
