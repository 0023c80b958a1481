# Declarations of the transfer core's extension types, so later Cython modules (the data planes)
# can cimport them.
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t

from llm_datadist._acl cimport (
    dd_aclInit_fn, dd_aclrtFree_fn, dd_aclrtMalloc_fn, dd_aclrtMemcpy_fn, dd_aclrtSetDevice_fn,
)
from llm_datadist._cuda cimport (
    dd_cudaFree_fn, dd_cudaGetDeviceCount_fn, dd_cudaMalloc_fn, dd_cudaMemcpy_fn,
    dd_cudaSetDevice_fn,
)
from llm_datadist._runtime cimport dd_copy_desc, dd_runtime_table


cdef struct AclApi:
    dd_aclInit_fn init
    dd_aclrtSetDevice_fn set_device
    dd_aclrtMalloc_fn malloc
    dd_aclrtFree_fn free
    dd_aclrtMemcpy_fn memcpy


cdef struct CudaApi:
    dd_cudaGetDeviceCount_fn get_device_count
    dd_cudaSetDevice_fn set_device
    dd_cudaMalloc_fn malloc
    dd_cudaFree_fn free
    dd_cudaMemcpy_fn memcpy


cdef class Runtime:
    cdef readonly str name
    cdef readonly str library
    cdef readonly bint host_addressable
    cdef dd_runtime_table table
    cdef void *handle
    cdef AclApi acl
    cdef CudaApi cuda


cdef class Allocation:
    cdef readonly uint64_t addr
    cdef readonly uint64_t nbytes
    cdef readonly bint on_device
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
