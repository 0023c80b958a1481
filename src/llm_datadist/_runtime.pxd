# Mirror of include/llm_datadist/dd_runtime.h.
from libc.stdint cimport int32_t, uint32_t, uint64_t

cdef extern from "llm_datadist/dd_runtime.h" nogil:
    ctypedef enum dd_memcpy_kind:
        DD_MEMCPY_HOST_TO_HOST
        DD_MEMCPY_HOST_TO_DEVICE
        DD_MEMCPY_DEVICE_TO_HOST
        DD_MEMCPY_DEVICE_TO_DEVICE

    ctypedef int (*dd_set_device_fn)(void *ctx, int32_t device_id) noexcept nogil
    ctypedef int (*dd_malloc_fn)(void *ctx, void **ptr, size_t size) noexcept nogil
    ctypedef int (*dd_free_fn)(void *ctx, void *ptr) noexcept nogil
    ctypedef int (*dd_memcpy_fn)(void *ctx, void *dst, const void *src, size_t count,
                                 int kind) noexcept nogil
    ctypedef int (*dd_device_count_fn)(void *ctx, int *count) noexcept nogil

    uint32_t DD_RUNTIME_HOST_ADDRESSABLE
    uint32_t DD_RUNTIME_ASYNC_COPY
    uint32_t DD_RUNTIME_BATCHED_COPY
    uint32_t DD_RUNTIME_IPC

    ctypedef struct dd_runtime_table:
        dd_set_device_fn set_device
        dd_malloc_fn malloc_device
        dd_free_fn free_device
        dd_memcpy_fn memcpy_kind
        void *ctx
        dd_device_count_fn device_count
        uint32_t capabilities

    ctypedef struct dd_copy_desc:
        uint64_t src
        uint64_t dst
        uint64_t nbytes
