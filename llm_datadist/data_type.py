"""Element types of cache tensors.

``DataType`` is CANN's Python enum (its 14 types). Below it, every type is a ``ge::DataType``
number: ``GE_DATA_TYPES`` lists the 41 that CANN's C++ header ``llm_datadist.h`` re-exports from
GE, with GE's numbers and element sizes, and the helpers here take either a ``DataType`` or such
a number (the C++ style's ``cpp.DataType`` members are ints).
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple, Optional

import numpy as np

from llm_datadist._validate import param_invalid

__all__ = ["DataType", "GE_DATA_TYPES", "ge_number", "element_bits", "element_size", "numpy_dtype",
           "dtype_to_np_dtype", "valid_np_dtypes", "np_dtype_to_dtype"]


class DataType(Enum):
    # The members in the order of CANN's data_type.py (list(DataType) iterates them so), with
    # GE's numbers.
    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_BF16 = 27
    DT_INT8 = 2
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT8 = 4
    DT_INT32 = 3
    DT_INT64 = 9
    DT_UINT32 = 8
    DT_UINT64 = 10
    DT_BOOL = 12
    DT_DOUBLE = 11
    DT_STRING = 13


class GeTypeInfo(NamedTuple):
    """One ``ge::DataType``: its name, number and element size."""

    name: str
    number: int  # the ge::DataType value
    bits: Optional[int]  # bits of one element; None: no size, a tensor of it is refused


# The ge::DataType names llm_datadist.h re-exports (``using ge::DT_*``), with the numbers of GE's
# enum (hicann/metadef, inc/external/graph/types.h and c_types.h) and the element sizes of GE's
# GetSizeByDataType in that header. GE writes the size of a type packed below a byte as
# kDataTypeSizeBitOffset (1000) + its bits; a tensor of such a type takes ceil(elements * bits / 8)
# bytes, as CANN's LLMUtils::GetSizeInBytes computes it. Two entries follow CANN's own code instead
# of GE's table, where they disagree: CANN's LLMUtils::GetDataTypeLength (hicann/hixl,
# src/llm_datadist/common/llm_utils.cc) sizes DT_STRING and DT_STRING_REF as 16 bytes (two
# uint64: GE's StringHead), where GetSizeByDataType says -1 (no size), and so does the API spec's
# table (§2.3, "n/a"): CANN's source wins. DT_UNDEFINED has no size in both, and number 5 is
# reserved.
GE_DATA_TYPES = tuple(GeTypeInfo(*entry) for entry in (
    ("DT_FLOAT", 0, 32), ("DT_FLOAT16", 1, 16), ("DT_INT8", 2, 8), ("DT_INT32", 3, 32),
    ("DT_UINT8", 4, 8), ("DT_INT16", 6, 16), ("DT_UINT16", 7, 16), ("DT_UINT32", 8, 32),
    ("DT_INT64", 9, 64), ("DT_UINT64", 10, 64), ("DT_DOUBLE", 11, 64), ("DT_BOOL", 12, 8),
    ("DT_STRING", 13, 128), ("DT_DUAL_SUB_INT8", 14, 8), ("DT_DUAL_SUB_UINT8", 15, 8),
    ("DT_COMPLEX64", 16, 64), ("DT_COMPLEX128", 17, 128), ("DT_QINT8", 18, 8), ("DT_QINT16", 19, 16),
    ("DT_QINT32", 20, 32), ("DT_QUINT8", 21, 8), ("DT_QUINT16", 22, 16), ("DT_RESOURCE", 23, 64),
    ("DT_STRING_REF", 24, 128), ("DT_DUAL", 25, 40), ("DT_VARIANT", 26, 64), ("DT_BF16", 27, 16),
    ("DT_UNDEFINED", 28, None), ("DT_INT4", 29, 4), ("DT_UINT1", 30, 1), ("DT_INT2", 31, 2),
    ("DT_UINT2", 32, 2), ("DT_COMPLEX32", 33, 32), ("DT_HIFLOAT8", 34, 8), ("DT_FLOAT8_E5M2", 35, 8),
    ("DT_FLOAT8_E4M3FN", 36, 8), ("DT_FLOAT8_E8M0", 37, 8), ("DT_FLOAT6_E3M2", 38, 6),
    ("DT_FLOAT6_E2M3", 39, 6), ("DT_FLOAT4_E2M1", 40, 4), ("DT_FLOAT4_E1M2", 41, 4),
))
_BY_NUMBER = {entry.number: entry for entry in GE_DATA_TYPES}

# How tensors are viewed with numpy: the types numpy has, by number. Any other type of whole bytes
# is viewed as its raw bit patterns, an unsigned integer of its width (BF16 as uint16, the FP8
# types as uint8, COMPLEX32 as uint32) or, for widths numpy has no integer of, raw bytes (void:
# DT_DUAL 5 bytes, DT_STRING 16). Types packed below a byte have no view.
_NUMPY_VIEWS = {
    0: np.float32, 1: np.float16, 2: np.int8, 3: np.int32, 4: np.uint8, 6: np.int16, 7: np.uint16,
    8: np.uint32, 9: np.int64, 10: np.uint64, 11: np.float64, 12: np.bool_, 14: np.int8, 15: np.uint8,
    16: np.complex64, 17: np.complex128, 18: np.int8, 19: np.int16, 20: np.int32, 21: np.uint8,
    22: np.uint16,
}
_RAW_VIEWS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def ge_number(data_type) -> int:
    """The ``ge::DataType`` number of a ``DataType``, or of a C++-style data type (an int)."""
    if isinstance(data_type, DataType):
        return data_type.value
    if isinstance(data_type, int) and not isinstance(data_type, bool):
        return int(data_type)
    raise TypeError(f"{data_type!r} is not a data type")


def element_bits(data_type) -> Optional[int]:
    """Bits of one element; None for a type without a size (DT_UNDEFINED, or no GE type)."""
    entry = _BY_NUMBER.get(ge_number(data_type))
    return None if entry is None else entry.bits


def element_size(data_type) -> Optional[int]:
    """Bytes of one element; None for a type packed below a byte or without a size."""
    bits = element_bits(data_type)
    return bits // 8 if bits is not None and bits % 8 == 0 else None


def numpy_dtype(data_type) -> np.dtype:
    """The numpy dtype of zero-copy views of tensors of ``data_type``; LLM_PARAM_INVALID for a type
    packed below a byte or without a size."""
    number = ge_number(data_type)
    if number in _NUMPY_VIEWS:
        return np.dtype(_NUMPY_VIEWS[number])
    size = element_size(number)
    if size is None:
        raise param_invalid(f"tensors of data type {data_type} have no numpy view (elements below a byte, "
                            f"or no size)")
    return np.dtype(_RAW_VIEWS[size]) if size in _RAW_VIEWS else np.dtype(f"V{size}")


# CANN's numpy tables (its data_type.py builds them on first access; numpy is imported here anyway).
# They are CANN's, kept as CANN writes them: DT_BF16 maps to np.float16 (numpy has no bfloat16)
# although numpy_dtype() views BF16 tensors as uint16 bit patterns, valid_np_dtypes therefore
# holds np.float16 twice, and np_dtype_to_dtype has no entry that gives DT_BF16.
dtype_to_np_dtype = {
    DataType.DT_FLOAT: np.float32,
    DataType.DT_FLOAT16: np.float16,
    DataType.DT_BF16: np.float16,
    DataType.DT_INT8: np.int8,
    DataType.DT_INT16: np.int16,
    DataType.DT_UINT16: np.uint16,
    DataType.DT_UINT8: np.uint8,
    DataType.DT_INT32: np.int32,
    DataType.DT_INT64: np.int64,
    DataType.DT_UINT32: np.uint32,
    DataType.DT_UINT64: np.uint64,
    DataType.DT_BOOL: np.bool_,
    DataType.DT_DOUBLE: np.double,
    DataType.DT_STRING: np.bytes_,
}

valid_np_dtypes = list(dtype_to_np_dtype.values())

np_dtype_to_dtype = {np.dtype(np_type): data_type for data_type, np_type in dtype_to_np_dtype.items()
                     if data_type is not DataType.DT_BF16}
