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
 *   - Streams run late: cudaMemcpyAsync, cudaMemcpyBatchAsync, cuLaunchKernel and aclrtMemcpyAsync
 *     only queue their copies, which run at the next synchronize of the stream (or a synchronous
 *     copy, or a free), so a caller that forgets to wait sees stale bytes. As on the real runtimes,
 *     a queued copy from pageable host memory takes its source bytes at once; one from page-locked
 *     memory (cudaMallocHost, cudaHostRegister, aclrtMallocHost) reads them when it runs.
 *   - cudaMalloc memory is a memfd mapping: cudaIpcGetMemHandle names it (pid, fd, size) and
 *     cudaIpcOpenMemHandle in another process maps the same pages through /proc/<pid>/fd/<fd>,
 *     so CUDA IPC between processes really shares memory. Opening a handle of one's own process
 *     fails, as on CUDA; cudaIpcGetMemHandle takes only an allocation's base, as documented.
 *   - The driver API loads "PTX" images naming an entry point (".entry <name>") and cuLaunchKernel
 *     of the copy kernel (parameters: a device pointer to dd_copy_desc pieces and their count)
 *     performs those copies on the stream, like the real kernel.
 *
 * Build: gcc -shared -fPIC -O1 -o libstub_runtime.so stub_runtime.c
 * With -DSTUB_OMIT_MEMCPY the library exports neither aclrtMemcpy nor cudaMemcpy; with
 * -DSTUB_OMIT_DRIVER it exports no driver API (cu*) entry point.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

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
    STUB_CUDA_MEMCPY = 15,
    STUB_ACL_GET_DEVICE = 6,
    STUB_ACL_CREATE_STREAM = 7,
    STUB_ACL_SYNCHRONIZE_STREAM = 8,
    STUB_ACL_MEMCPY_ASYNC = 9,
    STUB_ACL_MALLOC_HOST = 10,
    STUB_ACL_FREE_HOST = 20,
    STUB_CUDA_GET_DEVICE = 16,
    STUB_CUDA_RUNTIME_GET_VERSION = 17,
    STUB_CUDA_STREAM_CREATE = 18,
    STUB_CUDA_STREAM_SYNCHRONIZE = 19,
    STUB_CUDA_MEMCPY_ASYNC = 21,
    STUB_CUDA_MEMCPY_BATCH_ASYNC = 22,
    STUB_CUDA_MALLOC_HOST = 23,
    STUB_CUDA_FREE_HOST = 24,
    STUB_CUDA_HOST_REGISTER = 25,
    STUB_CUDA_HOST_UNREGISTER = 26,
    STUB_CUDA_IPC_GET_MEM_HANDLE = 27,
    STUB_CUDA_IPC_OPEN_MEM_HANDLE = 28,
    STUB_CUDA_IPC_CLOSE_MEM_HANDLE = 29,
    STUB_CU_INIT = 30,
    STUB_CU_MEM_GET_ADDRESS_RANGE = 31,
    STUB_CU_MODULE_LOAD_DATA = 32,
    STUB_CU_MODULE_GET_FUNCTION = 33,
    STUB_CU_LAUNCH_KERNEL = 34,
    /* One copy of a cudaMemcpyBatchAsync (kind -1) or one piece of a copy kernel launch (kind 3),
     * recorded after the call's own entry, so tests see every copy a batched call queued. */
    STUB_QUEUED_COPY = 35
};

#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_REPEAT_INITIALIZE 100002
#define ACL_ERROR_RT_CONTEXT_NULL 107002
#define ACL_ERROR_RT_MEMORY_ALLOCATION 207001
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_MEMORY_ALLOCATION 2
#define CUDA_ERROR_INVALID_MEMCPY_DIRECTION 21
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_RESOURCE_HANDLE 400
#define CU_ERROR_INVALID_PTX 218
#define CU_ERROR_NOT_FOUND 500

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
    /* One slot per call, also when threads call at once (each reads the total once). */
    uint64_t slot = __atomic_fetch_add(&g_log_total, 1, __ATOMIC_RELAXED);
    stub_call *entry = slot < STUB_LOG_CAPACITY ? &g_log[slot] : &sink;
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

/* Memory the stub handed out, for address ranges, IPC and page-locked checks. */
enum { MEM_DEVICE = 1, MEM_PINNED = 2, MEM_REGISTERED = 3, MEM_MAPPED = 4 };
typedef struct stub_mem {
    uint64_t base;
    uint64_t size;
    int kind; /* MEM_*, 0 = free slot */
    int fd;   /* MEM_DEVICE from cudaMalloc: the memfd; -1 otherwise */
    uint64_t serial;
} stub_mem;
#define STUB_MEM_CAPACITY 4096
static stub_mem g_mem[STUB_MEM_CAPACITY];
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int64_t g_live_host_allocations;
static int64_t g_live_mappings;

static uint64_t g_mem_serial;

static void mem_add(uint64_t base, uint64_t size, int kind, int fd)
{
    pthread_mutex_lock(&g_lock);
    g_mem_serial++;
    for (int i = 0; i < STUB_MEM_CAPACITY; i++) {
        if (g_mem[i].kind == 0) {
            g_mem[i].base = base;
            g_mem[i].size = size;
            g_mem[i].kind = kind;
            g_mem[i].fd = fd;
            g_mem[i].serial = g_mem_serial;
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
}

/* The entry of kind holding addr (kind 0: any), copied to *out; 0 if found. */
static int mem_find(uint64_t addr, int kind, stub_mem *out)
{
    int found = -1;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < STUB_MEM_CAPACITY; i++) {
        if (g_mem[i].kind != 0 && (kind == 0 || g_mem[i].kind == kind) && addr >= g_mem[i].base &&
            addr - g_mem[i].base < g_mem[i].size) {
            *out = g_mem[i];
            found = 0;
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return found;
}

/* Remove the entry of kind starting at base; 0 if there was one (copied to *out). */
static int mem_remove(uint64_t base, int kind, stub_mem *out)
{
    int found = -1;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < STUB_MEM_CAPACITY; i++) {
        if (g_mem[i].kind == kind && g_mem[i].base == base) {
            *out = g_mem[i];
            g_mem[i].kind = 0;
            found = 0;
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return found;
}

static int is_pinned(const void *ptr)
{
    stub_mem m;
    return ptr != NULL && (mem_find((uint64_t)(uintptr_t)ptr, MEM_PINNED, &m) == 0 ||
                           mem_find((uint64_t)(uintptr_t)ptr, MEM_REGISTERED, &m) == 0);
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

/* cudaMalloc: a memfd mapping another process can map too. */
static void *shared_alloc(size_t size)
{
    int fd = memfd_create("stub_cuda", MFD_CLOEXEC);
    void *ptr;
    if (fd < 0) {
        return NULL;
    }
    if (ftruncate(fd, (off_t)size) != 0) {
        close(fd);
        return NULL;
    }
    ptr = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (ptr == MAP_FAILED) {
        close(fd);
        return NULL;
    }
    memset(ptr, 0xA5, size);
    mem_add((uint64_t)(uintptr_t)ptr, size, MEM_DEVICE, fd);
    g_live_allocations++;
    return ptr;
}

static int shared_free(void *ptr)
{
    stub_mem m;
    if (mem_remove((uint64_t)(uintptr_t)ptr, MEM_DEVICE, &m) != 0) {
        return -1;
    }
    munmap(ptr, m.size);
    close(m.fd);
    g_live_allocations--;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Streams: queued copies run at the next synchronize
 * ------------------------------------------------------------------------------------------- */

typedef struct stub_op {
    void *dst;
    const void *src; /* NULL when the bytes were taken at once (held in copy) */
    void *copy;
    size_t count;
} stub_op;

#define STUB_STREAM_MAGIC 0x5354524dU
typedef struct stub_stream {
    uint32_t magic;
    size_t len;
    size_t cap;
    stub_op *ops;
} stub_stream;

static int64_t g_live_streams;
static uint64_t g_ops_run;

static int stream_push_locked(stub_stream *stream, void *dst, const void *src, size_t count,
                             int take_now)
{
    stub_op *op;
    if (stream->len == stream->cap) {
        size_t cap = stream->cap ? stream->cap * 2 : 64;
        stub_op *grown = realloc(stream->ops, cap * sizeof(*grown));
        if (grown == NULL) {
            return -1;
        }
        stream->ops = grown;
        stream->cap = cap;
    }
    op = &stream->ops[stream->len];
    op->dst = dst;
    op->count = count;
    op->src = src;
    op->copy = NULL;
    if (take_now && count > 0) {
        op->copy = malloc(count);
        if (op->copy == NULL) {
            return -1;
        }
        memcpy(op->copy, src, count);
        op->src = NULL;
    }
    stream->len++;
    return 0;
}

/* Under the lock stream_run holds: another thread may be waiting for the same stream. */
static int stream_push(stub_stream *stream, void *dst, const void *src, size_t count, int take_now)
{
    int rc;
    pthread_mutex_lock(&g_lock);
    rc = stream_push_locked(stream, dst, src, count, take_now);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

static void stream_run(stub_stream *stream)
{
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < stream->len; i++) {
        stub_op *op = &stream->ops[i];
        if (op->count > 0) {
            memmove(op->dst, op->copy != NULL ? op->copy : op->src, op->count);
        }
        free(op->copy);
        g_ops_run++;
    }
    stream->len = 0;
    pthread_mutex_unlock(&g_lock);
}

/* Every stream made, so synchronous calls can drain them first (as the legacy stream would). */
#define STUB_STREAMS_CAPACITY 256
static stub_stream *g_streams[STUB_STREAMS_CAPACITY];

static stub_stream *stream_new(void)
{
    stub_stream *stream = calloc(1, sizeof(*stream));
    if (stream == NULL) {
        return NULL;
    }
    stream->magic = STUB_STREAM_MAGIC;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < STUB_STREAMS_CAPACITY; i++) {
        if (g_streams[i] == NULL) {
            g_streams[i] = stream;
            break;
        }
    }
    g_live_streams++;
    pthread_mutex_unlock(&g_lock);
    return stream;
}

static void streams_drain(void)
{
    for (int i = 0; i < STUB_STREAMS_CAPACITY; i++) {
        if (g_streams[i] != NULL) {
            stream_run(g_streams[i]);
        }
    }
}

static stub_stream *as_stream(void *ptr)
{
    stub_stream *stream = ptr;
    return stream != NULL && stream->magic == STUB_STREAM_MAGIC ? stream : NULL;
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
    case STUB_ACL_GET_DEVICE: return "aclrtGetDevice";
    case STUB_ACL_CREATE_STREAM: return "aclrtCreateStream";
    case STUB_ACL_SYNCHRONIZE_STREAM: return "aclrtSynchronizeStream";
    case STUB_ACL_MEMCPY_ASYNC: return "aclrtMemcpyAsync";
    case STUB_ACL_MALLOC_HOST: return "aclrtMallocHost";
    case STUB_ACL_FREE_HOST: return "aclrtFreeHost";
    case STUB_CUDA_GET_DEVICE: return "cudaGetDevice";
    case STUB_CUDA_RUNTIME_GET_VERSION: return "cudaRuntimeGetVersion";
    case STUB_CUDA_STREAM_CREATE: return "cudaStreamCreate";
    case STUB_CUDA_STREAM_SYNCHRONIZE: return "cudaStreamSynchronize";
    case STUB_CUDA_MEMCPY_ASYNC: return "cudaMemcpyAsync";
    case STUB_CUDA_MEMCPY_BATCH_ASYNC: return "cudaMemcpyBatchAsync";
    case STUB_CUDA_MALLOC_HOST: return "cudaMallocHost";
    case STUB_CUDA_FREE_HOST: return "cudaFreeHost";
    case STUB_CUDA_HOST_REGISTER: return "cudaHostRegister";
    case STUB_CUDA_HOST_UNREGISTER: return "cudaHostUnregister";
    case STUB_CUDA_IPC_GET_MEM_HANDLE: return "cudaIpcGetMemHandle";
    case STUB_CUDA_IPC_OPEN_MEM_HANDLE: return "cudaIpcOpenMemHandle";
    case STUB_CUDA_IPC_CLOSE_MEM_HANDLE: return "cudaIpcCloseMemHandle";
    case STUB_CU_INIT: return "cuInit";
    case STUB_CU_MEM_GET_ADDRESS_RANGE: return "cuMemGetAddressRange_v2";
    case STUB_CU_MODULE_LOAD_DATA: return "cuModuleLoadData";
    case STUB_CU_MODULE_GET_FUNCTION: return "cuModuleGetFunction";
    case STUB_CU_LAUNCH_KERNEL: return "cuLaunchKernel";
    case STUB_QUEUED_COPY: return "(queued copy)";
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

/* Page-locked host allocations (cudaMallocHost, aclrtMallocHost) not yet freed, plus ranges
 * registered with cudaHostRegister and not yet unregistered. */
STUB_EXPORT int64_t stub_live_host_allocations(void)
{
    return g_live_host_allocations;
}

/* Peer allocations mapped with cudaIpcOpenMemHandle and not yet closed. */
STUB_EXPORT int64_t stub_live_mappings(void)
{
    return g_live_mappings;
}

/* Copies that ran on a stream (queued, then executed at a synchronize). */
STUB_EXPORT uint64_t stub_stream_ops_run(void)
{
    return g_ops_run;
}

/* Copies queued on streams and not yet run. */
STUB_EXPORT uint64_t stub_stream_ops_pending(void)
{
    uint64_t n = 0;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < STUB_STREAMS_CAPACITY; i++) {
        if (g_streams[i] != NULL) {
            n += g_streams[i]->len;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return n;
}

static int g_runtime_version = 13000;

/* The version cudaRuntimeGetVersion reports (default 13000: cudaMemcpyBatchAsync is used). */
STUB_EXPORT void stub_set_runtime_version(int version)
{
    g_runtime_version = version;
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
    streams_drain();
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
    streams_drain(); /* a synchronous copy is ordered after queued work */
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
    *dev_ptr = shared_alloc(size > 0 ? size : 1);
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
    streams_drain(); /* cudaFree waits for the device */
    if (dev_ptr != NULL && shared_free(dev_ptr) != 0) { /* cudaFree(NULL) is a no-op */
        return finish(entry, CUDA_ERROR_INVALID_VALUE);
    }
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
    streams_drain(); /* a synchronous copy is ordered after queued work */
    memmove(dst, src, count);
    return finish(entry, 0);
}
#endif

/* ---------------------------------------------------------------------------------------------
 * CUDA runtime: devices, streams, asynchronous and batched copies
 * ------------------------------------------------------------------------------------------- */

STUB_EXPORT int cudaGetDevice(int *device)
{
    stub_call *entry = record(STUB_CUDA_GET_DEVICE, t_cuda_device);
    int rc = injected_failure(STUB_CUDA_GET_DEVICE);
    if (rc != 0) {
        return finish(entry, rc);
    }
    if (device == NULL) {
        return finish(entry, CUDA_ERROR_INVALID_VALUE);
    }
    *device = t_cuda_device;
    return finish(entry, 0);
}

STUB_EXPORT int cudaRuntimeGetVersion(int *version)
{
    stub_call *entry = record(STUB_CUDA_RUNTIME_GET_VERSION, t_cuda_device);
    if (version == NULL) {
        return finish(entry, CUDA_ERROR_INVALID_VALUE);
    }
    *version = g_runtime_version;
    entry->size = (uint64_t)g_runtime_version;
    return finish(entry, 0);
}

STUB_EXPORT int cudaStreamCreate(void **stream)
{
    stub_call *entry = record(STUB_CUDA_STREAM_CREATE, t_cuda_device);
    int rc = injected_failure(STUB_CUDA_STREAM_CREATE);
    if (rc != 0) {
        return finish(entry, rc);
    }
    if (stream == NULL) {
        return finish(entry, CUDA_ERROR_INVALID_VALUE);
    }
    *stream = stream_new();
    entry->dst = (uint64_t)(uintptr_t)*stream;
    return finish(entry, *stream == NULL ? CUDA_ERROR_MEMORY_ALLOCATION : 0);
}

STUB_EXPORT int cudaStreamSynchronize(void *handle)
{
    stub_call *entry = record(STUB_CUDA_STREAM_SYNCHRONIZE, t_cuda_device);
    stub_stream *stream = as_stream(handle);
    int rc = injected_failure(STUB_CUDA_STREAM_SYNCHRONIZE);
    entry->dst = (uint64_t)(uintptr_t)handle;
    if (stream == NULL) {
        return finish(entry, CUDA_ERROR_INVALID_RESOURCE_HANDLE);
    }
    entry->size = stream->len;
    if (rc != 0) {
        /* A failed copy reports at the synchronize: the queued work is dropped. */
        pthread_mutex_lock(&g_lock);
        for (size_t i = 0; i < stream->len; i++) {
            free(stream->ops[i].copy);
        }
        stream->len = 0;
        pthread_mutex_unlock(&g_lock);
        return finish(entry, rc);
    }
    stream_run(stream);
    return finish(entry, 0);
}

STUB_EXPORT int cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind, void *handle)
{
    stub_call *entry = record(STUB_CUDA_MEMCPY_ASYNC, t_cuda_device);
    stub_stream *stream = as_stream(handle);
    int rc = injected_failure(STUB_CUDA_MEMCPY_ASYNC);
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
    if (stream == NULL) {
        return finish(entry, CUDA_ERROR_INVALID_RESOURCE_HANDLE);
    }
    if (count > 0 && (dst == NULL || src == NULL)) {
        return finish(entry, CUDA_ERROR_INVALID_VALUE);
    }
    /* From pageable host memory the bytes are taken at once; into pageable host memory the
     * call returns once the copy is done. */
    if (stream_push(stream, dst, src, count, kind == 1 && !is_pinned(src)) != 0) {
        return finish(entry, CUDA_ERROR_MEMORY_ALLOCATION);
    }
    if (kind == 2 && !is_pinned(dst)) {
        stream_run(stream);
    }
    return finish(entry, 0);
}

/* CUDA 13's signature. entry: kind = numAttrs, size = count, dst/src = the first copy's. */
STUB_EXPORT int cudaMemcpyBatchAsync(void *const *dsts, const void *const *srcs, const size_t *sizes,
                                     size_t count, const int *attrs, const size_t *attrs_idxs,
                                     size_t num_attrs, void *handle)
{
    stub_call *entry = record(STUB_CUDA_MEMCPY_BATCH_ASYNC, t_cuda_device);
    stub_stream *stream = as_stream(handle);
    int rc = injected_failure(STUB_CUDA_MEMCPY_BATCH_ASYNC);
    entry->size = count;
    entry->kind = (int32_t)num_attrs;
    if (count > 0 && dsts != NULL && srcs != NULL) {
        entry->dst = (uint64_t)(uintptr_t)dsts[0];
        entry->src = (uint64_t)(uintptr_t)srcs[0];
    }
    if (rc != 0) {
        return finish(entry, rc);
    }
    /* cudaErrorInvalidValue for what the real call refuses: no copies, no attributes, an
     * attribute list not starting at copy 0, a source order other than "stream" (1), or the
     * legacy default stream. */
    if (count == 0 || dsts == NULL || srcs == NULL || sizes == NULL || attrs == NULL ||
        attrs_idxs == NULL || num_attrs != 1 || attrs_idxs[0] != 0 || attrs[0] != 1 ||
        stream == NULL) {
        return finish(entry, CUDA_ERROR_INVALID_VALUE);
    }
    for (size_t i = 0; i < count; i++) {
        if (sizes[i] == 0 || dsts[i] == NULL || srcs[i] == NULL) {
            return finish(entry, CUDA_ERROR_INVALID_VALUE);
        }
    }
    for (size_t i = 0; i < count; i++) {
        stub_mem m;
        int pageable_host = mem_find((uint64_t)(uintptr_t)srcs[i], 0, &m) != 0;
        stub_call *copy = record(STUB_QUEUED_COPY, t_cuda_device);
        copy->src = (uint64_t)(uintptr_t)srcs[i];
        copy->dst = (uint64_t)(uintptr_t)dsts[i];
        copy->size = sizes[i];
        if (stream_push(stream, dsts[i], srcs[i], sizes[i], pageable_host) != 0) {
            return finish(entry, CUDA_ERROR_MEMORY_ALLOCATION);
        }
    }
    return finish(entry, 0);
}

/* ---------------------------------------------------------------------------------------------
 * CUDA runtime: page-locked host memory
 * ------------------------------------------------------------------------------------------- */

STUB_EXPORT int cudaMallocHost(void **ptr, size_t size)
{
    stub_call *entry = record(STUB_CUDA_MALLOC_HOST, t_cuda_device);
    int rc = injected_failure(STUB_CUDA_MALLOC_HOST);
    entry->size = size;
    if (rc != 0) {
        return finish(entry, rc);
    }
    if (ptr == NULL) {
        return finish(entry, CUDA_ERROR_INVALID_VALUE);
    }
    *ptr = malloc(size > 0 ? size : 1);
    if (*ptr == NULL) {
        return finish(entry, CUDA_ERROR_MEMORY_ALLOCATION);
    }
    mem_add((uint64_t)(uintptr_t)*ptr, size > 0 ? size : 1, MEM_PINNED, -1);
    g_live_host_allocations++;
    entry->dst = (uint64_t)(uintptr_t)*ptr;
    return finish(entry, 0);
}

STUB_EXPORT int cudaFreeHost(void *ptr)
{
    stub_call *entry = record(STUB_CUDA_FREE_HOST, t_cuda_device);
    stub_mem m;
    entry->dst = (uint64_t)(uintptr_t)ptr;
    streams_drain();
    if (ptr == NULL || mem_remove((uint64_t)(uintptr_t)ptr, MEM_PINNED, &m) != 0) {
        return finish(entry, CUDA_ERROR_INVALID_VALUE);
    }
    free(ptr);
    g_live_host_allocations--;
    return finish(entry, 0);
}

STUB_EXPORT int cudaHostRegister(void *ptr, size_t size, unsigned int flags)
{
    stub_call *entry = record(STUB_CUDA_HOST_REGISTER, t_cuda_device);
    stub_mem m;
    int rc = injected_failure(STUB_CUDA_HOST_REGISTER);
    entry->dst = (uint64_t)(uintptr_t)ptr;
    entry->size = size;
    entry->kind = (int32_t)flags;
    if (rc != 0) {
        return finish(entry, rc);
    }
    if (ptr == NULL || size == 0) {
        return finish(entry, CUDA_ERROR_INVALID_VALUE);
    }
    if (mem_find((uint64_t)(uintptr_t)ptr, MEM_REGISTERED, &m) == 0) {
        return finish(entry, 712); /* cudaErrorHostMemoryAlreadyRegistered */
    }
    mem_add((uint64_t)(uintptr_t)ptr, size, MEM_REGISTERED, -1);
    g_live_host_allocations++;
    return finish(entry, 0);
}

STUB_EXPORT int cudaHostUnregister(void *ptr)
{
    stub_call *entry = record(STUB_CUDA_HOST_UNREGISTER, t_cuda_device);
    stub_mem m;
    entry->dst = (uint64_t)(uintptr_t)ptr;
    if (mem_remove((uint64_t)(uintptr_t)ptr, MEM_REGISTERED, &m) != 0) {
        return finish(entry, 713); /* cudaErrorHostMemoryNotRegistered */
    }
    g_live_host_allocations--;
    return finish(entry, 0);
}

/* ---------------------------------------------------------------------------------------------
 * CUDA runtime: inter-process memory
 * ------------------------------------------------------------------------------------------- */

typedef struct stub_ipc_handle {
    char magic[8]; /* "DDSTUBIP" */
    int32_t pid;
    int32_t fd;
    uint64_t size;
    uint64_t serial; /* the allocation's, as CUDA's handles name one allocation */
    char pad[64 - 32];
} stub_ipc_handle;

STUB_EXPORT int cudaIpcGetMemHandle(stub_ipc_handle *handle, void *dev_ptr)
{
    stub_call *entry = record(STUB_CUDA_IPC_GET_MEM_HANDLE, t_cuda_device);
    stub_mem m;
    int rc = injected_failure(STUB_CUDA_IPC_GET_MEM_HANDLE);
    entry->src = (uint64_t)(uintptr_t)dev_ptr;
    if (rc != 0) {
        return finish(entry, rc);
    }
    /* CUDA documents devPtr as the base of a cudaMalloc allocation: an interior pointer is refused. */
    if (handle == NULL || mem_find((uint64_t)(uintptr_t)dev_ptr, MEM_DEVICE, &m) != 0 ||
        m.base != (uint64_t)(uintptr_t)dev_ptr) {
        return finish(entry, CUDA_ERROR_INVALID_VALUE);
    }
    memset(handle, 0, sizeof(*handle));
    memcpy(handle->magic, "DDSTUBIP", 8);
    handle->pid = (int32_t)getpid();
    handle->fd = m.fd;
    handle->size = m.size;
    handle->serial = m.serial;
    entry->size = m.size;
    return finish(entry, 0);
}

STUB_EXPORT int cudaIpcOpenMemHandle(void **dev_ptr, stub_ipc_handle handle, unsigned int flags)
{
    stub_call *entry = record(STUB_CUDA_IPC_OPEN_MEM_HANDLE, t_cuda_device);
    char path[64];
    void *ptr;
    int fd;
    int rc = injected_failure(STUB_CUDA_IPC_OPEN_MEM_HANDLE);
    entry->kind = (int32_t)flags;
    entry->size = handle.size;
    if (rc != 0) {
        return finish(entry, rc);
    }
    if (dev_ptr == NULL || memcmp(handle.magic, "DDSTUBIP", 8) != 0 || handle.size == 0) {
        return finish(entry, CUDA_ERROR_INVALID_VALUE);
    }
    if (handle.pid == (int32_t)getpid()) {
        return finish(entry, CUDA_ERROR_INVALID_RESOURCE_HANDLE); /* not in the exporting process */
    }
    snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)handle.pid, (int)handle.fd);
    fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        return finish(entry, CUDA_ERROR_INVALID_RESOURCE_HANDLE);
    }
    ptr = mmap(NULL, handle.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (ptr == MAP_FAILED) {
        return finish(entry, CUDA_ERROR_MEMORY_ALLOCATION);
    }
    mem_add((uint64_t)(uintptr_t)ptr, handle.size, MEM_MAPPED, -1);
    g_live_mappings++;
    *dev_ptr = ptr;
    entry->dst = (uint64_t)(uintptr_t)ptr;
    return finish(entry, 0);
}

STUB_EXPORT int cudaIpcCloseMemHandle(void *dev_ptr)
{
    stub_call *entry = record(STUB_CUDA_IPC_CLOSE_MEM_HANDLE, t_cuda_device);
    stub_mem m;
    entry->dst = (uint64_t)(uintptr_t)dev_ptr;
    streams_drain();
    if (mem_remove((uint64_t)(uintptr_t)dev_ptr, MEM_MAPPED, &m) != 0) {
        return finish(entry, CUDA_ERROR_INVALID_VALUE);
    }
    munmap(dev_ptr, m.size);
    g_live_mappings--;
    return finish(entry, 0);
}

/* ---------------------------------------------------------------------------------------------
 * CUDA driver API (cuda.h)
 * ------------------------------------------------------------------------------------------- */
#ifndef STUB_OMIT_DRIVER

typedef struct stub_module {
    char *image;
} stub_module;

STUB_EXPORT int cuInit(unsigned int flags)
{
    stub_call *entry = record(STUB_CU_INIT, t_cuda_device);
    entry->kind = (int32_t)flags;
    return finish(entry, injected_failure(STUB_CU_INIT));
}

STUB_EXPORT int cuMemGetAddressRange_v2(uint64_t *base, size_t *size, uint64_t ptr)
{
    stub_call *entry = record(STUB_CU_MEM_GET_ADDRESS_RANGE, t_cuda_device);
    stub_mem m;
    entry->src = ptr;
    if (mem_find(ptr, 0, &m) != 0 || (m.kind != MEM_DEVICE && m.kind != MEM_MAPPED)) {
        return finish(entry, CU_ERROR_NOT_FOUND);
    }
    if (base != NULL) {
        *base = m.base;
    }
    if (size != NULL) {
        *size = m.size;
    }
    entry->dst = m.base;
    entry->size = m.size;
    return finish(entry, 0);
}

STUB_EXPORT int cuModuleLoadData(stub_module **module, const char *image)
{
    stub_call *entry = record(STUB_CU_MODULE_LOAD_DATA, t_cuda_device);
    int rc = injected_failure(STUB_CU_MODULE_LOAD_DATA);
    if (rc != 0) {
        return finish(entry, rc);
    }
    if (module == NULL || image == NULL || strstr(image, ".entry") == NULL ||
        strstr(image, ".version") == NULL) {
        return finish(entry, CU_ERROR_INVALID_PTX);
    }
    *module = calloc(1, sizeof(**module));
    if (*module == NULL) {
        return finish(entry, CUDA_ERROR_MEMORY_ALLOCATION);
    }
    (*module)->image = strdup(image);
    entry->size = strlen(image);
    return finish(entry, 0);
}

STUB_EXPORT int cuModuleGetFunction(const char **function, stub_module *module, const char *name)
{
    stub_call *entry = record(STUB_CU_MODULE_GET_FUNCTION, t_cuda_device);
    char wanted[160];
    if (function == NULL || module == NULL || name == NULL) {
        return finish(entry, CUDA_ERROR_INVALID_VALUE);
    }
    snprintf(wanted, sizeof(wanted), ".entry %s(", name);
    if (strstr(module->image, wanted) == NULL) {
        return finish(entry, CU_ERROR_NOT_FOUND);
    }
    *function = "dd_copy_descs";
    return finish(entry, 0);
}

/* The copy kernel's work: params[0] points at a device pointer to the pieces, params[1] at
 * their count. entry: size = count, kind = grid x, dest_max = block x. */
STUB_EXPORT int cuLaunchKernel(const char *function, unsigned int gx, unsigned int gy,
                               unsigned int gz, unsigned int bx, unsigned int by, unsigned int bz,
                               unsigned int shared, void *handle, void **params, void **extra)
{
    typedef struct { uint64_t src, dst, nbytes; } piece;
    stub_call *entry = record(STUB_CU_LAUNCH_KERNEL, t_cuda_device);
    stub_stream *stream = as_stream(handle);
    int rc = injected_failure(STUB_CU_LAUNCH_KERNEL);
    const piece *pieces;
    unsigned long long count;
    (void)extra;
    entry->kind = (int32_t)gx;
    entry->dest_max = bx;
    if (rc != 0) {
        return finish(entry, rc);
    }
    if (function == NULL || params == NULL || stream == NULL || gx == 0 || gy != 1 || gz != 1 ||
        bx == 0 || bx > 1024 || by != 1 || bz != 1 || shared != 0) {
        return finish(entry, CUDA_ERROR_INVALID_VALUE);
    }
    /* The kernel reads its pieces when it runs: drain what was queued before (the upload). */
    stream_run(stream);
    pieces = *(const piece *const *)params[0];
    count = *(const unsigned long long *)params[1];
    entry->size = count;
    entry->src = (uint64_t)(uintptr_t)pieces;
    for (unsigned long long i = 0; i < count; i++) {
        stub_call *copy = record(STUB_QUEUED_COPY, t_cuda_device);
        copy->kind = 3;
        copy->src = pieces[i].src;
        copy->dst = pieces[i].dst;
        copy->size = pieces[i].nbytes;
        if (stream_push(stream, (void *)(uintptr_t)pieces[i].dst,
                        (const void *)(uintptr_t)pieces[i].src, pieces[i].nbytes, 0) != 0) {
            return finish(entry, CUDA_ERROR_MEMORY_ALLOCATION);
        }
    }
    return finish(entry, 0);
}
#endif

/* ---------------------------------------------------------------------------------------------
 * ACL runtime: devices, streams, asynchronous copies, page-locked host memory
 * ------------------------------------------------------------------------------------------- */

STUB_EXPORT int aclrtGetDevice(int32_t *device_id)
{
    stub_call *entry = record(STUB_ACL_GET_DEVICE, t_acl_device);
    if (device_id == NULL) {
        return finish(entry, ACL_ERROR_INVALID_PARAM);
    }
    if (t_acl_device == STUB_NO_DEVICE) {
        return finish(entry, ACL_ERROR_RT_CONTEXT_NULL);
    }
    *device_id = t_acl_device;
    return finish(entry, 0);
}

STUB_EXPORT int aclrtCreateStream(void **stream)
{
    stub_call *entry = record(STUB_ACL_CREATE_STREAM, t_acl_device);
    int rc = injected_failure(STUB_ACL_CREATE_STREAM);
    if (rc != 0) {
        return finish(entry, rc);
    }
    if (stream == NULL) {
        return finish(entry, ACL_ERROR_INVALID_PARAM);
    }
    if (t_acl_device == STUB_NO_DEVICE) {
        return finish(entry, ACL_ERROR_RT_CONTEXT_NULL);
    }
    *stream = stream_new();
    entry->dst = (uint64_t)(uintptr_t)*stream;
    return finish(entry, *stream == NULL ? ACL_ERROR_RT_MEMORY_ALLOCATION : 0);
}

STUB_EXPORT int aclrtSynchronizeStream(void *handle)
{
    stub_call *entry = record(STUB_ACL_SYNCHRONIZE_STREAM, t_acl_device);
    stub_stream *stream = as_stream(handle);
    int rc = injected_failure(STUB_ACL_SYNCHRONIZE_STREAM);
    entry->dst = (uint64_t)(uintptr_t)handle;
    if (rc != 0) {
        return finish(entry, rc);
    }
    if (stream == NULL) {
        return finish(entry, ACL_ERROR_INVALID_PARAM);
    }
    entry->size = stream->len;
    stream_run(stream);
    return finish(entry, 0);
}

STUB_EXPORT int aclrtMemcpyAsync(void *dst, size_t dest_max, const void *src, size_t count, int kind,
                                 void *handle)
{
    stub_call *entry = record(STUB_ACL_MEMCPY_ASYNC, t_acl_device);
    stub_stream *stream = as_stream(handle);
    int rc = injected_failure(STUB_ACL_MEMCPY_ASYNC);
    entry->kind = kind;
    entry->size = count;
    entry->dest_max = dest_max;
    entry->dst = (uint64_t)(uintptr_t)dst;
    entry->src = (uint64_t)(uintptr_t)src;
    if (rc != 0) {
        return finish(entry, rc);
    }
    /* ACL's asynchronous host<->device copies need aclrtMallocHost memory on the host side. */
    if (dst == NULL || src == NULL || dest_max < count || kind < 0 || kind > 3 || stream == NULL ||
        (kind == 1 && !is_pinned(src)) || (kind == 2 && !is_pinned(dst))) {
        return finish(entry, ACL_ERROR_INVALID_PARAM);
    }
    if (t_acl_device == STUB_NO_DEVICE) {
        return finish(entry, ACL_ERROR_RT_CONTEXT_NULL);
    }
    if (stream_push(stream, dst, src, count, 0) != 0) {
        return finish(entry, ACL_ERROR_RT_MEMORY_ALLOCATION);
    }
    return finish(entry, 0);
}

STUB_EXPORT int aclrtMallocHost(void **ptr, size_t size)
{
    stub_call *entry = record(STUB_ACL_MALLOC_HOST, t_acl_device);
    int rc = injected_failure(STUB_ACL_MALLOC_HOST);
    entry->size = size;
    if (rc != 0) {
        return finish(entry, rc);
    }
    if (ptr == NULL || size == 0) {
        return finish(entry, ACL_ERROR_INVALID_PARAM);
    }
    *ptr = malloc(size);
    if (*ptr == NULL) {
        return finish(entry, ACL_ERROR_RT_MEMORY_ALLOCATION);
    }
    mem_add((uint64_t)(uintptr_t)*ptr, size, MEM_PINNED, -1);
    g_live_host_allocations++;
    entry->dst = (uint64_t)(uintptr_t)*ptr;
    return finish(entry, 0);
}

STUB_EXPORT int aclrtFreeHost(void *ptr)
{
    stub_call *entry = record(STUB_ACL_FREE_HOST, t_acl_device);
    stub_mem m;
    entry->dst = (uint64_t)(uintptr_t)ptr;
    streams_drain();
    if (ptr == NULL || mem_remove((uint64_t)(uintptr_t)ptr, MEM_PINNED, &m) != 0) {
        return finish(entry, ACL_ERROR_INVALID_PARAM);
    }
    free(ptr);
    g_live_host_allocations--;
    return finish(entry, 0);
}
