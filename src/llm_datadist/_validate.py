"""Argument checks with CANN's error classes: TypeError for wrong types, ValueError for integers
out of their C range, LLMException(LLM_PARAM_INVALID) for semantic checks."""

from __future__ import annotations

from typing import Any

from llm_datadist.status import LLMException, LLMStatusCode

UINT16_MAX = 2**16 - 1
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _type_names(types) -> str:
    return " or ".join(t.__name__ for t in types)


def check_isinstance(name: str, value: Any, types, elem_type=None, allow_none: bool = True) -> None:
    """``value`` must be an instance of ``types`` (a class or a list of classes); for lists,
    tuples and dicts, ``elem_type`` is checked on every element (dict: keys and values)."""
    if value is None and allow_none:
        return
    types = tuple(types) if isinstance(types, (list, tuple)) else (types,)
    if not isinstance(value, types) or (int in types and isinstance(value, bool) and bool not in types):
        raise TypeError(f"{name} must be {_type_names(types)}, got {type(value).__name__}")
    if elem_type is None or not isinstance(value, (list, tuple, dict)):
        return
    items = list(value.items()) if isinstance(value, dict) else [(v,) for v in value]
    for item in items:
        for element in item:
            if not is_instance_strict(element, elem_type):
                raise TypeError(f"elements of {name} must be {elem_type.__name__}, "
                                f"got {type(element).__name__}")


def is_instance_strict(value: Any, cls) -> bool:
    """isinstance, except that bool does not count as int."""
    if cls is int and isinstance(value, bool):
        return False
    return isinstance(value, cls)


def check_int(name: str, value: Any, low: int, high: int) -> int:
    if not is_instance_strict(value, int):
        raise TypeError(f"{name} must be int, got {type(value).__name__}")
    if value < low or value > high:
        raise ValueError(f"{name} = {value} is out of range [{low}, {high}]")
    return value


def check_uint16(name: str, value: Any) -> int:
    return check_int(name, value, 0, UINT16_MAX)


def check_uint32(name: str, value: Any) -> int:
    return check_int(name, value, 0, UINT32_MAX)


def check_uint64(name: str, value: Any) -> int:
    return check_int(name, value, 0, UINT64_MAX)


def check_int32(name: str, value: Any) -> int:
    return check_int(name, value, INT32_MIN, INT32_MAX)


def check_int64(name: str, value: Any) -> int:
    return check_int(name, value, INT64_MIN, INT64_MAX)


def param_invalid(message: str) -> LLMException:
    return LLMException(message, status_code=LLMStatusCode.LLM_PARAM_INVALID)


def raise_if_false(condition: bool, message: str) -> None:
    if not condition:
        raise param_invalid(message)
