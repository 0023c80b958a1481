/*
 * Device runtime function table and copy descriptors used by the transfer core.
 *
 * A runtime (host, cpu, acl, cuda, ...) is a table of C functions with one calling convention;
 * the core calls them without the GIL. Each vendor's entry points are declared once in its own
 * header (dd_acl.h, dd_cuda.h) and adapted to this convention by its binding,
 * llm_datadist/_rt_<vendor>.pxi, after being resolved with dlopen/dlsym. The core asks a table
 * what its runtime can do through the capability bits, never through the runtime's name.
 */
#ifndef LLM_DATADIST_DD_RUNTIME_H
#define LLM_DATADIST_DD_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

/* Copy directions; the numbers equal aclrtMemcpyKind and cudaMemcpyKind for the same direction. */
typedef enum dd_memcpy_kind {
    DD_MEMCPY_HOST_TO_HOST = 0,
    DD_MEMCPY_HOST_TO_DEVICE = 1,
    DD_MEMCPY_DEVICE_TO_HOST = 2,
    DD_MEMCPY_DEVICE_TO_DEVICE = 3
} dd_memcpy_kind;

/* Every function returns 0 on success and the runtime's own error code otherwise. */
typedef int (*dd_set_device_fn)(void *ctx, int32_t device_id);
typedef int (*dd_malloc_fn)(void *ctx, void **ptr, size_t size);
typedef int (*dd_free_fn)(void *ctx, void *ptr);
typedef int (*dd_memcpy_fn)(void *ctx, void *dst, const void *src, size_t count, int kind);
/* Stores the number of devices in *count; a runtime error returns non-zero. */
typedef int (*dd_device_count_fn)(void *ctx, int *count);

/* Capability bits of a runtime table (dd_runtime_table.capabilities). */
/* Device memory is plain memory of this process: the host may read and write it directly. */
#define DD_RUNTIME_HOST_ADDRESSABLE 0x1u
/* The binding can queue a copy on a stream and wait for it later. */
#define DD_RUNTIME_ASYNC_COPY 0x2u
/* The binding can hand a whole descriptor list to the runtime in one call. */
#define DD_RUNTIME_BATCHED_COPY 0x4u
/* Device memory can be exported to, and opened by, another process. */
#define DD_RUNTIME_IPC 0x8u

/* One contiguous copy: nbytes from src to dst (addresses in the runtime's address space). */
typedef struct dd_copy_desc {
    uint64_t src;
    uint64_t dst;
    uint64_t nbytes;
} dd_copy_desc;

/* Queue every descriptor's copy on the calling thread's device stream of the runtime (ASYNC_COPY),
 * in few driver calls where the binding can (BATCHED_COPY). The copies are done once synchronize
 * returns 0. On an error raised while queueing, *failed_at is the first descriptor not queued
 * (count when unknown). */
typedef int (*dd_copy_batch_fn)(void *ctx, const dd_copy_desc *descs, size_t count, int kind,
                                size_t *failed_at);
/* Wait for every copy queued on the calling thread's device stream; a copy that failed reports
 * its error here. */
typedef int (*dd_synchronize_fn)(void *ctx);
/* Page-locked host memory (cudaMallocHost, aclrtMallocHost): what device copies reach at full
 * speed, for staging buffers and HOST caches. */
typedef int (*dd_malloc_host_fn)(void *ctx, void **ptr, size_t size);
typedef int (*dd_free_host_fn)(void *ctx, void *ptr);
/* Page-lock existing host memory for the device (cudaHostRegister) and undo it. */
typedef int (*dd_host_register_fn)(void *ctx, void *ptr, size_t size);
typedef int (*dd_host_unregister_fn)(void *ctx, void *ptr);

/* An exported device allocation, as the runtime names it to other processes (CUDA: the 64 bytes
 * of a cudaIpcMemHandle_t). */
#define DD_IPC_HANDLE_BYTES 64
typedef struct dd_ipc_handle {
    unsigned char bytes[DD_IPC_HANDLE_BYTES];
} dd_ipc_handle;
/* The handle of the allocation that holds ptr, its base address and its size (IPC). */
typedef int (*dd_ipc_export_fn)(void *ctx, void *ptr, dd_ipc_handle *handle, uint64_t *base,
                                uint64_t *size);
/* Map a peer's exported allocation into this process; *base is its address here and *size the
 * size of the mapping as this process's runtime reports it (not as the peer claims it). */
typedef int (*dd_ipc_open_fn)(void *ctx, const dd_ipc_handle *handle, void **base, uint64_t *size);
typedef int (*dd_ipc_close_fn)(void *ctx, void *base);

typedef struct dd_runtime_table {
    dd_set_device_fn set_device;
    dd_malloc_fn malloc_device;
    dd_free_fn free_device;
    dd_memcpy_fn memcpy_kind;
    void *ctx;
    /* Appended after ctx so code built against the four-function table keeps its offsets. */
    dd_device_count_fn device_count;
    uint32_t capabilities; /* DD_RUNTIME_* bits */
    /* Optional entry points, NULL where the binding has none (the capability bits say which:
     * ASYNC_COPY: copy_batch and synchronize; IPC: ipc_export, ipc_open and ipc_close). A binding
     * may offer malloc_host/free_host and host_register/host_unregister on their own. */
    dd_copy_batch_fn copy_batch;
    dd_synchronize_fn synchronize;
    dd_malloc_host_fn malloc_host;
    dd_free_host_fn free_host;
    dd_host_register_fn host_register;
    dd_host_unregister_fn host_unregister;
    dd_ipc_export_fn ipc_export;
    dd_ipc_open_fn ipc_open;
    dd_ipc_close_fn ipc_close;
} dd_runtime_table;

#endif /* LLM_DATADIST_DD_RUNTIME_H */
