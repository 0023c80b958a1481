"""Turning user memory (integer addresses, numpy arrays, torch tensors) into addresses."""

from __future__ import annotations

from typing import Any, List, Tuple

import numpy as np

from llm_datadist import runtimes
from llm_datadist._validate import UINT64_MAX, param_invalid


ADDRESS_SPACE = UINT64_MAX + 1


def check_address_range(addr: int, nbytes: int, where: str) -> None:
    """``[addr, addr + nbytes)`` must be a range of the 64-bit address space that does not start
    at 0 (a range ending exactly at 2**64 is accepted); LLM_PARAM_INVALID otherwise."""
    if addr <= 0 or addr + nbytes > ADDRESS_SPACE:
        raise param_invalid(f"{where} = {addr:#x} is not a valid address for a tensor of {nbytes} "
                            f"bytes: it must be non-zero and the tensor must end at or below 2**64")


def _is_torch_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr")


def resolve_address(value: Any, needed_bytes: int, runtime_name: str, where: str) -> Tuple[int, Any]:
    """``(address, object to keep alive or None)`` for one element of an ``addrs`` list.

    Arrays and tensors must be contiguous, writable and hold at least ``needed_bytes``.
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
        if device != "cpu" and device not in runtimes.tensor_devices(runtime_name):
            raise param_invalid(f"{where}: a torch tensor on {device} cannot be used with the "
                                f"{runtime_name} runtime")
        return int(value.data_ptr()), value
    raise TypeError(f"{where} must be an int address, a numpy array or a torch tensor, "
                    f"got {type(value).__name__}")


def resolve_addresses(values, needed_bytes: int, runtime_name: str) -> Tuple[List[int], List[Any]]:
    addrs, keepalive = [], []
    for i, value in enumerate(values):
        addr, owner = resolve_address(value, needed_bytes, runtime_name, f"addrs[{i}]")
        addrs.append(addr)
        keepalive.append(owner)
    return addrs, keepalive
