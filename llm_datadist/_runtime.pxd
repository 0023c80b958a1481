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

    ctypedef struct dd_copy_desc:
        uint64_t src
        uint64_t dst
        uint64_t nbytes

    ctypedef int (*dd_copy_batch_fn)(void *ctx, const dd_copy_desc *descs, size_t count, int kind,
                                     size_t *failed_at) noexcept nogil
    ctypedef int (*dd_synchronize_fn)(void *ctx) noexcept nogil
    ctypedef int (*dd_malloc_host_fn)(void *ctx, void **ptr, size_t size) noexcept nogil
    ctypedef int (*dd_free_host_fn)(void *ctx, void *ptr) noexcept nogil
    ctypedef int (*dd_host_register_fn)(void *ctx, void *ptr, size_t size) noexcept nogil
    ctypedef int (*dd_host_unregister_fn)(void *ctx, void *ptr) noexcept nogil

    int DD_IPC_HANDLE_BYTES
    ctypedef struct dd_ipc_handle:
        unsigned char bytes[64]
    ctypedef int (*dd_ipc_export_fn)(void *ctx, void *ptr, dd_ipc_handle *handle, uint64_t *base,
                                     uint64_t *size) noexcept nogil
    ctypedef int (*dd_ipc_open_fn)(void *ctx, const dd_ipc_handle *handle, void **base,
                                   uint64_t *size) noexcept nogil
    ctypedef int (*dd_ipc_close_fn)(void *ctx, void *base) noexcept nogil

    ctypedef struct dd_runtime_table:
        dd_set_device_fn set_device
        dd_malloc_fn malloc_device
        dd_free_fn free_device
        dd_memcpy_fn memcpy_kind
        void *ctx
        dd_device_count_fn device_count
        uint32_t capabilities
        dd_copy_batch_fn copy_batch
        dd_synchronize_fn synchronize
        dd_malloc_host_fn malloc_host
        dd_free_host_fn free_host
        dd_host_register_fn host_register
        dd_host_unregister_fn host_unregister
        dd_ipc_export_fn ipc_export
        dd_ipc_open_fn ipc_open
        dd_ipc_close_fn ipc_close
