# Declarations of the transfer core's extension types, so later Cython modules (the data planes)
# can cimport them.
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t

from llm_datadist._runtime cimport dd_copy_desc, dd_runtime_table


cdef class Runtime:
    cdef readonly str name
    cdef readonly str binding
    cdef readonly str library
    cdef dd_runtime_table table
    cdef void *handle
    # The binding's resolved vendor entry points (table.ctx points here); malloc'd by the binding.
    cdef void *api
    # Peer allocations mapped with ipc_open: handle bytes -> [base, references].
    cdef dict ipc_maps


cdef class Allocation:
    cdef readonly uint64_t addr
    cdef readonly uint64_t nbytes
    cdef readonly bint on_device
    cdef readonly bint pinned
    cdef readonly Runtime runtime
    cdef dd_runtime_table table


cdef class HostRegion:
    cdef readonly uint64_t addr
    cdef readonly uint64_t nbytes
    cdef readonly object owner
    cdef Py_ssize_t shape[1]


cdef class CacheLayout:
    cdef uint64_t *addrs
    cdef readonly uint32_t num_tensors
    cdef readonly uint64_t num_rows
    cdef readonly uint64_t row_bytes


cdef class CopyPlan:
    cdef dd_copy_desc *descs
    cdef size_t count
    cdef size_t capacity
    cdef readonly uint64_t total_bytes
    cdef int reserve(self, size_t extra) except -1
    cdef void add(self, uint64_t src, uint64_t dst, uint64_t nbytes) noexcept nogil


# Block lists: how as_block_array reports bad input (see _core.pyx).
cdef enum:
    BLOCK_ERRORS_STATUS_C = 0
    BLOCK_ERRORS_CANN_C = 1

# A block list (list/tuple of ints or numpy integers, or a 1-D integer array) as a new 1-D
# C-contiguous uint64 numpy array, every element checked; for fast paths that plan themselves.
cdef object block_array(object values, str name, int errors)
