"""Argument checks with CANN's error classes and wording (its ``utils/utils.py`` and
``status.py``): TypeError for wrong types, ValueError for integers out of their C range,
LLMException(LLM_PARAM_INVALID) for semantic checks. One difference: bool is not accepted where an
int is asked for."""

from __future__ import annotations

import socket
from typing import Any

from llm_datadist.status import LLMException, LLMStatusCode

UINT16_MAX = 2**16 - 1
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def check_isinstance(name: str, value: Any, types, elem_type=None, allow_none: bool = True,
                     extra_fmt: str = "") -> None:
    """``value`` must be an instance of ``types`` (a class or a list of classes); for lists and
    tuples ``elem_type`` is checked on every element, for dicts on every key and value.
    ``extra_fmt`` prefixes the message, as CANN's ``check_isinstance`` does."""
    if value is None and allow_none:
        return
    types = tuple(types) if isinstance(types, (list, tuple)) else (types,)
    if not isinstance(value, types) or (int in types and isinstance(value, bool) and bool not in types):
        raise TypeError(f"{extra_fmt}{name} only support {[t.__name__ for t in types]}, "
                        f"but got {type(value)}.")
    if elem_type is None or not isinstance(value, (list, tuple, dict)):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not is_instance_strict(key, elem_type):
                raise TypeError(f"{name} dict key only support {elem_type}, but got {type(key)}.")
            if not is_instance_strict(item, elem_type):
                raise TypeError(f"{name} dict value only support {elem_type}, but got {type(item)}.")
        return
    for element in value:
        if not is_instance_strict(element, elem_type):
            raise TypeError(f"{name} inner type only support {[elem_type]}, but got {type(element)}.")


def is_instance_strict(value: Any, cls) -> bool:
    """isinstance, except that bool does not count as int."""
    if cls is int and isinstance(value, bool):
        return False
    return isinstance(value, cls)


def check_int(name: str, value: Any, low: int, high: int, c_type: str = "") -> int:
    """``value`` must be an int in ``[low, high]``; ``c_type`` ("uint32", ...) words the message
    as CANN's ``check_uint32`` and friends do."""
    if not is_instance_strict(value, int):
        raise TypeError(f"{name} only support ['int'], but got {type(value)}.")
    if value < low or value > high:
        if c_type:
            raise ValueError(f"{name}'s value is out of range,{value} is not a {c_type} value.")
        raise ValueError(f"{name} = {value} is out of range [{low}, {high}]")
    return value


def check_uint16(name: str, value: Any) -> int:
    return check_int(name, value, 0, UINT16_MAX, "uint16")


def check_uint32(name: str, value: Any) -> int:
    return check_int(name, value, 0, UINT32_MAX, "uint32")


def check_uint64(name: str, value: Any) -> int:
    return check_int(name, value, 0, UINT64_MAX, "uint64")


def check_int32(name: str, value: Any) -> int:
    return check_int(name, value, INT32_MIN, INT32_MAX, "int32")


def check_int64(name: str, value: Any) -> int:
    return check_int(name, value, INT64_MIN, INT64_MAX, "int64")


def param_invalid(message: str) -> LLMException:
    return LLMException(message, status_code=LLMStatusCode.LLM_PARAM_INVALID)


def raise_if_false(condition: bool, message: str) -> None:
    if not condition:
        raise param_invalid(message)


def unpack_ip(ip: int) -> str:
    """A packed IPv4 address (the deprecated integer form, little-endian) as a dotted string."""
    return socket.inet_ntoa(int(ip).to_bytes(4, "little"))
