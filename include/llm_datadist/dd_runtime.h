/*
 * Device runtime function table and copy descriptors used by the transfer core.
 *
 * A runtime (host, cpu, acl, cuda) is a table of C functions with one calling convention; the
 * core calls them without the GIL. Vendor functions (aclrtMemcpy, cudaMemcpy, ...) are adapted to
 * this convention in llm_datadist/_core.pyx after being resolved with dlopen/dlsym.
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

typedef struct dd_runtime_table {
    dd_set_device_fn set_device;
    dd_malloc_fn malloc_device;
    dd_free_fn free_device;
    dd_memcpy_fn memcpy_kind;
    void *ctx;
} dd_runtime_table;

/* One contiguous copy: nbytes from src to dst (addresses in the runtime's address space). */
typedef struct dd_copy_desc {
    uint64_t src;
    uint64_t dst;
    uint64_t nbytes;
} dd_copy_desc;

#endif /* LLM_DATADIST_DD_RUNTIME_H */
