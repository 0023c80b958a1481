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

typedef struct dd_runtime_table {
    dd_set_device_fn set_device;
    dd_malloc_fn malloc_device;
    dd_free_fn free_device;
    dd_memcpy_fn memcpy_kind;
    void *ctx;
    /* Appended after ctx so code built against the four-function table keeps its offsets. */
    dd_device_count_fn device_count;
    uint32_t capabilities; /* DD_RUNTIME_* bits */
} dd_runtime_table;

/* One contiguous copy: nbytes from src to dst (addresses in the runtime's address space). */
typedef struct dd_copy_desc {
    uint64_t src;
    uint64_t dst;
    uint64_t nbytes;
} dd_copy_desc;

#endif /* LLM_DATADIST_DD_RUNTIME_H */
