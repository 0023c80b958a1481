"""``DataType``: element types of cache tensors (values are GE ``ge::DataType`` numbers)."""

from __future__ import annotations

from enum import Enum

import numpy as np

__all__ = ["DataType", "element_size", "numpy_dtype", "dtype_to_np_dtype", "valid_np_dtypes", "np_dtype_to_dtype"]


class DataType(Enum):
    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_STRING = 13
    DT_BF16 = 27


_ELEMENT_SIZE = {
    DataType.DT_FLOAT: 4, DataType.DT_FLOAT16: 2, DataType.DT_INT8: 1, DataType.DT_INT32: 4,
    DataType.DT_UINT8: 1, DataType.DT_INT16: 2, DataType.DT_UINT16: 2, DataType.DT_UINT32: 4,
    DataType.DT_INT64: 8, DataType.DT_UINT64: 8, DataType.DT_DOUBLE: 8, DataType.DT_BOOL: 1,
    DataType.DT_BF16: 2,
}

# numpy has no bfloat16: BF16 tensors are viewed as their raw 16-bit patterns (uint16).
_NUMPY_DTYPE = {
    DataType.DT_FLOAT: np.float32, DataType.DT_FLOAT16: np.float16, DataType.DT_INT8: np.int8,
    DataType.DT_INT32: np.int32, DataType.DT_UINT8: np.uint8, DataType.DT_INT16: np.int16,
    DataType.DT_UINT16: np.uint16, DataType.DT_UINT32: np.uint32, DataType.DT_INT64: np.int64,
    DataType.DT_UINT64: np.uint64, DataType.DT_DOUBLE: np.float64, DataType.DT_BOOL: np.bool_,
    DataType.DT_BF16: np.uint16,
}


def element_size(data_type: DataType) -> int | None:
    """Bytes per element, or None for types without a fixed size (DT_STRING)."""
    return _ELEMENT_SIZE.get(data_type)


def numpy_dtype(data_type: DataType):
    """The numpy dtype used for zero-copy views of tensors of ``data_type``."""
    return np.dtype(_NUMPY_DTYPE[data_type])


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
