/*
 * A stand-in for libascendcl.so and libcudart.so, used by tests/core/test_runtimes.py.
 *
 * It exports the ACL and CUDA runtime entry points that llm_datadist resolves with dlsym (the
 * signatures of include/llm_datadist/dd_acl.h and dd_cuda.h, which follow the public ACL and CUDA
 * runtime APIs), implements them over host memory, and records every call in a global log that the
 * tests read back through the stub_* accessors below (with ctypes, from the same loaded copy).
 *
 * Emulated behaviour, kept close to the real runtimes where the library's correctness depends on it:
 *   - aclInit answers ACL_ERROR_REPEAT_INITIALIZE (100002) when called a second time.
 *   - aclrtSetDevice binds the calling thread; aclrtMalloc and aclrtMemcpy fail with
 *     ACL_ERROR_RT_CONTEXT_NULL (107002) on a thread that has bound no device.
 *   - aclrtMalloc rejects size 0, aclrtMemcpy rejects destMax < count and unknown kinds
 *     (ACL_ERROR_INVALID_PARAM, 100000).
 *   - cudaSetDevice rejects a device outside [0, count) (cudaErrorInvalidDevice, 101);
 *     cudaMemcpy rejects a kind outside 0..4 (cudaErrorInvalidMemcpyDirection, 21).
 *   - Fresh "device" memory is filled with 0xA5, as device memory is not zeroed by the runtimes.
 *
 * Build: gcc -shared -fPIC -O1 -o libstub_runtime.so stub_runtime.c
 * With -DSTUB_OMIT_MEMCPY the library exports neither aclrtMemcpy nor cudaMemcpy.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define STUB_EXPORT __attribute__((visibility("default")))

/* Function ids stored in the log. */
enum {
    STUB_ACL_INIT = 1,
    STUB_ACL_SET_DEVICE = 2,
    STUB_ACL_MALLOC = 3,
    STUB_ACL_FREE = 4,
    STUB_ACL_MEMCPY = 5,
    STUB_CUDA_GET_DEVICE_COUNT = 11,
    STUB_CUDA_SET_DEVICE = 12,
    STUB_CUDA_MALLOC = 13,
    STUB_CUDA_FREE = 14,
    STUB_CUDA_MEMCPY = 15
};

#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_REPEAT_INITIALIZE 100002
#define ACL_ERROR_RT_CONTEXT_NULL 107002
#define ACL_ERROR_RT_MEMORY_ALLOCATION 207001
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_MEMORY_ALLOCATION 2
#define CUDA_ERROR_INVALID_MEMCPY_DIRECTION 21
#define CUDA_ERROR_INVALID_DEVICE 101

#define STUB_LOG_CAPACITY 8192
#define STUB_NO_DEVICE (-1)

/* One recorded call. Fields that do not apply to a function hold 0 (kind: -1). */
typedef struct stub_call {
    int32_t fn;        /* STUB_* id */
    int32_t kind;      /* memcpy kind, or the aclrtMalloc policy; -1 otherwise */
    int32_t device;    /* set-device calls: the requested device; others: the thread's device */
    int32_t rc;        /* the value the call returned */
    uint64_t size;     /* memcpy count, malloc size */
    uint64_t dest_max; /* aclrtMemcpy destMax */
    uint64_t dst;      /* memcpy destination, pointer returned by malloc, pointer given to free */
    uint64_t src;      /* memcpy source */
} stub_call;

static stub_call g_log[STUB_LOG_CAPACITY];
static uint64_t g_log_total; /* calls seen since the last reset, including those not stored */

static int g_fail_fn;        /* function whose call is made to fail, 0 = none */
static int g_fail_skip;      /* calls of g_fail_fn to let through first */
static int g_fail_code;

static int g_cuda_device_count = 1;
static int g_acl_initialized;
static int64_t g_live_allocations;

/* The device bound by the calling thread (ACL binds per thread; CUDA defaults to device 0). */
static __thread int32_t t_acl_device = STUB_NO_DEVICE;
static __thread int32_t t_cuda_device = 0;

static stub_call *record(int32_t fn, int32_t device)
{
    static stub_call sink;
    stub_call *entry = g_log_total < STUB_LOG_CAPACITY ? &g_log[g_log_total] : &sink;
    g_log_total++;
    memset(entry, 0, sizeof(*entry));
    entry->fn = fn;
    entry->kind = -1;
    entry->device = device;
    return entry;
}

/* The injected error code if this call of fn is the one to fail, else 0. */
static int injected_failure(int32_t fn)
{
    if (g_fail_fn != fn) {
        return 0;
    }
    if (g_fail_skip > 0) {
        g_fail_skip--;
        return 0;
    }
    g_fail_fn = 0;
    return g_fail_code;
}

static int finish(stub_call *entry, int rc)
{
    entry->rc = rc;
    return rc;
}

static void *device_alloc(size_t size)
{
    void *ptr = malloc(size);
    if (ptr != NULL) {
        memset(ptr, 0xA5, size);
        g_live_allocations++;
    }
    return ptr;
}

static void device_free(void *ptr)
{
    if (ptr != NULL) {
        free(ptr);
        g_live_allocations--;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Test accessors
 * ------------------------------------------------------------------------------------------- */

/* Number of calls stored in the log (at most the capacity). */
STUB_EXPORT int stub_log_count(void)
{
    return (int)(g_log_total < STUB_LOG_CAPACITY ? g_log_total : STUB_LOG_CAPACITY);
}

/* Calls seen but not stored because the log was full. */
STUB_EXPORT uint64_t stub_log_dropped(void)
{
    return g_log_total > STUB_LOG_CAPACITY ? g_log_total - STUB_LOG_CAPACITY : 0;
}

/* Copy entry i to *out; 0 on success, -1 if i is not a stored entry. */
STUB_EXPORT int stub_log_entry(int i, stub_call *out)
{
    if (i < 0 || i >= stub_log_count() || out == NULL) {
        return -1;
    }
    *out = g_log[i];
    return 0;
}

STUB_EXPORT void stub_log_reset(void)
{
    g_log_total = 0;
}

/* The name of a function id, or NULL. */
STUB_EXPORT const char *stub_fn_name(int fn)
{
    switch (fn) {
    case STUB_ACL_INIT: return "aclInit";
    case STUB_ACL_SET_DEVICE: return "aclrtSetDevice";
    case STUB_ACL_MALLOC: return "aclrtMalloc";
    case STUB_ACL_FREE: return "aclrtFree";
    case STUB_ACL_MEMCPY: return "aclrtMemcpy";
    case STUB_CUDA_GET_DEVICE_COUNT: return "cudaGetDeviceCount";
    case STUB_CUDA_SET_DEVICE: return "cudaSetDevice";
    case STUB_CUDA_MALLOC: return "cudaMalloc";
    case STUB_CUDA_FREE: return "cudaFree";
    case STUB_CUDA_MEMCPY: return "cudaMemcpy";
    default: return NULL;
    }
}

/* Make a call of fn fail with code: the calls before it (skip of them) succeed, then one call
 * returns code without doing anything; the switch then clears itself. fn = 0 clears it now. */
STUB_EXPORT void stub_fail_call(int fn, int skip, int code)
{
    g_fail_fn = fn;
    g_fail_skip = skip;
    g_fail_code = code;
}

/* The number of GPUs cudaGetDeviceCount reports (default 1). */
STUB_EXPORT void stub_set_device_count(int count)
{
    g_cuda_device_count = count;
}

/* Allocations made through aclrtMalloc/cudaMalloc and not yet freed. */
STUB_EXPORT int64_t stub_live_allocations(void)
{
    return g_live_allocations;
}

/* ---------------------------------------------------------------------------------------------
 * ACL runtime (acl/acl_rt.h)
 * ------------------------------------------------------------------------------------------- */

STUB_EXPORT int aclInit(const char *config_path)
{
    stub_call *entry = record(STUB_ACL_INIT, t_acl_device);
    int rc = injected_failure(STUB_ACL_INIT);
    (void)config_path;
    if (rc != 0) {
        return finish(entry, rc);
    }
    if (g_acl_initialized) {
        return finish(entry, ACL_ERROR_REPEAT_INITIALIZE);
    }
    g_acl_initialized = 1;
    return finish(entry, 0);
}

STUB_EXPORT int aclrtSetDevice(int32_t device_id)
{
    stub_call *entry = record(STUB_ACL_SET_DEVICE, device_id);
    int rc = injected_failure(STUB_ACL_SET_DEVICE);
    if (rc != 0) {
        return finish(entry, rc);
    }
    if (device_id < 0) {
        return finish(entry, ACL_ERROR_INVALID_PARAM);
    }
    t_acl_device = device_id;
    return finish(entry, 0);
}

STUB_EXPORT int aclrtMalloc(void **dev_ptr, size_t size, int policy)
{
    stub_call *entry = record(STUB_ACL_MALLOC, t_acl_device);
    int rc = injected_failure(STUB_ACL_MALLOC);
    entry->size = size;
    entry->kind = policy;
    if (rc != 0) {
        return finish(entry, rc);
    }
    if (dev_ptr == NULL || size == 0) {
        return finish(entry, ACL_ERROR_INVALID_PARAM);
    }
    if (t_acl_device == STUB_NO_DEVICE) {
        return finish(entry, ACL_ERROR_RT_CONTEXT_NULL);
    }
    *dev_ptr = device_alloc(size);
    if (*dev_ptr == NULL) {
        return finish(entry, ACL_ERROR_RT_MEMORY_ALLOCATION);
    }
    entry->dst = (uint64_t)(uintptr_t)*dev_ptr;
    return finish(entry, 0);
}

STUB_EXPORT int aclrtFree(void *dev_ptr)
{
    stub_call *entry = record(STUB_ACL_FREE, t_acl_device);
    int rc = injected_failure(STUB_ACL_FREE);
    entry->dst = (uint64_t)(uintptr_t)dev_ptr;
    if (rc != 0) {
        return finish(entry, rc);
    }
    if (dev_ptr == NULL) {
        return finish(entry, ACL_ERROR_INVALID_PARAM);
    }
    device_free(dev_ptr);
    return finish(entry, 0);
}

#ifndef STUB_OMIT_MEMCPY
STUB_EXPORT int aclrtMemcpy(void *dst, size_t dest_max, const void *src, size_t count, int kind)
{
    stub_call *entry = record(STUB_ACL_MEMCPY, t_acl_device);
    int rc = injected_failure(STUB_ACL_MEMCPY);
    entry->kind = kind;
    entry->size = count;
    entry->dest_max = dest_max;
    entry->dst = (uint64_t)(uintptr_t)dst;
    entry->src = (uint64_t)(uintptr_t)src;
    if (rc != 0) {
        return finish(entry, rc);
    }
    if (dst == NULL || src == NULL || dest_max < count || kind < 0 || kind > 3) {
        return finish(entry, ACL_ERROR_INVALID_PARAM);
    }
    if (t_acl_device == STUB_NO_DEVICE) {
        return finish(entry, ACL_ERROR_RT_CONTEXT_NULL);
    }
    memmove(dst, src, count);
    return finish(entry, 0);
}
#endif

/* ---------------------------------------------------------------------------------------------
 * CUDA runtime (cuda_runtime_api.h)
 * ------------------------------------------------------------------------------------------- */

STUB_EXPORT int cudaGetDeviceCount(int *count)
{
    stub_call *entry = record(STUB_CUDA_GET_DEVICE_COUNT, t_cuda_device);
    int rc = injected_failure(STUB_CUDA_GET_DEVICE_COUNT);
    if (rc != 0) {
        return finish(entry, rc);
    }
    if (count == NULL) {
        return finish(entry, CUDA_ERROR_INVALID_VALUE);
    }
    *count = g_cuda_device_count;
    entry->size = (uint64_t)g_cuda_device_count;
    return finish(entry, 0);
}

STUB_EXPORT int cudaSetDevice(int device)
{
    stub_call *entry = record(STUB_CUDA_SET_DEVICE, device);
    int rc = injected_failure(STUB_CUDA_SET_DEVICE);
    if (rc != 0) {
        return finish(entry, rc);
    }
    if (device < 0 || device >= g_cuda_device_count) {
        return finish(entry, CUDA_ERROR_INVALID_DEVICE);
    }
    t_cuda_device = device;
    return finish(entry, 0);
}

STUB_EXPORT int cudaMalloc(void **dev_ptr, size_t size)
{
    stub_call *entry = record(STUB_CUDA_MALLOC, t_cuda_device);
    int rc = injected_failure(STUB_CUDA_MALLOC);
    entry->size = size;
    if (rc != 0) {
        return finish(entry, rc);
    }
    if (dev_ptr == NULL) {
        return finish(entry, CUDA_ERROR_INVALID_VALUE);
    }
    *dev_ptr = device_alloc(size > 0 ? size : 1);
    if (*dev_ptr == NULL) {
        return finish(entry, CUDA_ERROR_MEMORY_ALLOCATION);
    }
    entry->dst = (uint64_t)(uintptr_t)*dev_ptr;
    return finish(entry, 0);
}

STUB_EXPORT int cudaFree(void *dev_ptr)
{
    stub_call *entry = record(STUB_CUDA_FREE, t_cuda_device);
    int rc = injected_failure(STUB_CUDA_FREE);
    entry->dst = (uint64_t)(uintptr_t)dev_ptr;
    if (rc != 0) {
        return finish(entry, rc);
    }
    device_free(dev_ptr); /* cudaFree(NULL) is a no-op */
    return finish(entry, 0);
}

#ifndef STUB_OMIT_MEMCPY
STUB_EXPORT int cudaMemcpy(void *dst, const void *src, size_t count, int kind)
{
    stub_call *entry = record(STUB_CUDA_MEMCPY, t_cuda_device);
    int rc = injected_failure(STUB_CUDA_MEMCPY);
    entry->kind = kind;
    entry->size = count;
    entry->dst = (uint64_t)(uintptr_t)dst;
    entry->src = (uint64_t)(uintptr_t)src;
    if (rc != 0) {
        return finish(entry, rc);
    }
    if (kind < 0 || kind > 4) {
        return finish(entry, CUDA_ERROR_INVALID_MEMCPY_DIRECTION);
    }
    if (count > 0 && (dst == NULL || src == NULL)) {
        return finish(entry, CUDA_ERROR_INVALID_VALUE);
    }
    memmove(dst, src, count);
    return finish(entry, 0);
}
#endif
