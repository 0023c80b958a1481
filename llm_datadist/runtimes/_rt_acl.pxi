# The Ascend ACL binding (libascendcl.so), included by _core.pyx: resolves the entry points
# declared in include/llm_datadist/dd_acl.h and adapts them to the dd_runtime_table convention.
# Which runtime uses this binding, its default library and its environment variable are declared
# in llm_datadist/runtimes/acl.py.
#
# Copies: device-to-device lists are queued with aclrtMemcpyAsync on one stream per device and
# waited for once. ACL's asynchronous host<->device copies need host memory from aclrtMallocHost,
# which user caches are not known to be, so those lists wait for the stream, then run one
# synchronous aclrtMemcpy per descriptor. Staging buffers (Allocation(pinned=True)) come from
# aclrtMallocHost.
from llm_datadist.runtimes._acl cimport (
    DD_ACL_MEM_MALLOC_HUGE_FIRST, dd_acl_stream, dd_aclInit_fn, dd_aclrtCreateStream_fn,
    dd_aclrtFree_fn, dd_aclrtFreeHost_fn, dd_aclrtGetDevice_fn, dd_aclrtMalloc_fn,
    dd_aclrtMallocHost_fn, dd_aclrtMemcpy_fn, dd_aclrtMemcpyAsync_fn, dd_aclrtSetDevice_fn,
    dd_aclrtSynchronizeStream_fn,
)

# ACL answers aclInit on an already initialised process with ACL_ERROR_REPEAT_INITIALIZE.
cdef int _ACL_ERROR_REPEAT_INITIALIZE = 100002
# ACL_ERROR_INVALID_PARAM, returned for a device outside the binding's table.
cdef int _ACL_ERROR_INVALID_PARAM = 100000
DEF _ACL_MAX_DEVICES = 64


cdef struct AclApi:
    dd_aclInit_fn init
    dd_aclrtSetDevice_fn set_device
    dd_aclrtGetDevice_fn get_device
    dd_aclrtMalloc_fn malloc
    dd_aclrtFree_fn free
    dd_aclrtMemcpy_fn memcpy
    dd_aclrtCreateStream_fn stream_create
    dd_aclrtSynchronizeStream_fn stream_synchronize
    dd_aclrtMemcpyAsync_fn memcpy_async
    dd_aclrtMallocHost_fn malloc_host
    dd_aclrtFreeHost_fn free_host
    pthread_mutex_t lock
    dd_acl_stream streams[_ACL_MAX_DEVICES]


cdef int _acl_set_device(void *ctx, int32_t device_id) noexcept nogil:
    return (<AclApi *>ctx).set_device(device_id)


cdef int _acl_malloc(void *ctx, void **ptr, size_t size) noexcept nogil:
    return (<AclApi *>ctx).malloc(ptr, size if size > 0 else 1, DD_ACL_MEM_MALLOC_HUGE_FIRST)


cdef int _acl_free(void *ctx, void *ptr) noexcept nogil:
    return (<AclApi *>ctx).free(ptr)


cdef int _acl_memcpy(void *ctx, void *dst, const void *src, size_t count, int kind) noexcept nogil:
    # The planner has already checked that count fits the destination, so destMax = count.
    return (<AclApi *>ctx).memcpy(dst, count, src, count, kind)


cdef int _acl_stream(AclApi *api, dd_acl_stream *out) noexcept nogil:
    """The stream of the calling thread's device, created on first use."""
    cdef int32_t device = 0
    cdef int rc = api.get_device(&device)
    if rc != 0:
        return rc
    if device < 0 or device >= _ACL_MAX_DEVICES:
        return _ACL_ERROR_INVALID_PARAM
    pthread_mutex_lock(&api.lock)
    if api.streams[device] == NULL:
        rc = api.stream_create(&api.streams[device])
    out[0] = api.streams[device]
    pthread_mutex_unlock(&api.lock)
    return rc


cdef int _acl_copy_batch(void *ctx, const dd_copy_desc *descs, size_t count, int kind,
                         size_t *failed_at) noexcept nogil:
    cdef AclApi *api = <AclApi *>ctx
    cdef dd_acl_stream stream = NULL
    cdef size_t i
    cdef int rc = _acl_stream(api, &stream)
    failed_at[0] = count
    if rc == 0 and kind != DD_MEMCPY_DEVICE_TO_DEVICE:
        rc = api.stream_synchronize(stream)  # keep the order of copies queued before
    if rc != 0:
        return rc
    for i in range(count):
        if descs[i].nbytes == 0:
            continue
        if kind == DD_MEMCPY_DEVICE_TO_DEVICE:
            rc = api.memcpy_async(<void *>descs[i].dst, descs[i].nbytes, <const void *>descs[i].src,
                                  descs[i].nbytes, kind, stream)
        else:
            rc = api.memcpy(<void *>descs[i].dst, descs[i].nbytes, <const void *>descs[i].src,
                            descs[i].nbytes, kind)
        if rc != 0:
            failed_at[0] = i
            return rc
    return 0


cdef int _acl_synchronize(void *ctx) noexcept nogil:
    cdef dd_acl_stream stream = NULL
    cdef int rc = _acl_stream(<AclApi *>ctx, &stream)
    if rc != 0:
        return rc
    return (<AclApi *>ctx).stream_synchronize(stream)


cdef int _acl_malloc_host(void *ctx, void **ptr, size_t size) noexcept nogil:
    return (<AclApi *>ctx).malloc_host(ptr, size if size > 0 else 1)


cdef int _acl_free_host(void *ctx, void *ptr) noexcept nogil:
    return (<AclApi *>ctx).free_host(ptr)


cdef int _bind_acl(Runtime rt) except -1:
    cdef int rc
    cdef AclApi *api = <AclApi *>_binding_api(rt, sizeof(AclApi))
    api.init = <dd_aclInit_fn>_resolve(rt.handle, rt.library, "aclInit")
    api.set_device = <dd_aclrtSetDevice_fn>_resolve(rt.handle, rt.library, "aclrtSetDevice")
    api.get_device = <dd_aclrtGetDevice_fn>_resolve(rt.handle, rt.library, "aclrtGetDevice")
    api.malloc = <dd_aclrtMalloc_fn>_resolve(rt.handle, rt.library, "aclrtMalloc")
    api.free = <dd_aclrtFree_fn>_resolve(rt.handle, rt.library, "aclrtFree")
    api.memcpy = <dd_aclrtMemcpy_fn>_resolve(rt.handle, rt.library, "aclrtMemcpy")
    api.stream_create = <dd_aclrtCreateStream_fn>_resolve(rt.handle, rt.library, "aclrtCreateStream")
    api.stream_synchronize = <dd_aclrtSynchronizeStream_fn>_resolve(rt.handle, rt.library,
                                                                    "aclrtSynchronizeStream")
    api.memcpy_async = <dd_aclrtMemcpyAsync_fn>_resolve(rt.handle, rt.library, "aclrtMemcpyAsync")
    api.malloc_host = <dd_aclrtMallocHost_fn>_resolve(rt.handle, rt.library, "aclrtMallocHost")
    api.free_host = <dd_aclrtFreeHost_fn>_resolve(rt.handle, rt.library, "aclrtFreeHost")
    rc = api.init(NULL)
    if rc != 0 and rc != _ACL_ERROR_REPEAT_INITIALIZE:
        raise LLMException(f"aclInit failed with error {rc}", status_code=LLMStatusCode.LLM_FAILED)
    if pthread_mutex_init(&api.lock, NULL) != 0:
        raise MemoryError()
    rt.table.ctx = api
    rt.table.set_device = _acl_set_device
    rt.table.malloc_device = _acl_malloc
    rt.table.free_device = _acl_free
    rt.table.memcpy_kind = _acl_memcpy
    rt.table.copy_batch = _acl_copy_batch
    rt.table.synchronize = _acl_synchronize
    rt.table.malloc_host = _acl_malloc_host
    rt.table.free_host = _acl_free_host
    # One device as far as the core knows (aclrtGetDeviceCount is not bound). No batch copy and
    # no IPC are bound: DEVICE caches of ACL move between processes through the staging plane.
    rt.table.device_count = _one_device
    rt.table.capabilities = DD_RUNTIME_ASYNC_COPY
    return 0


_add_binding("acl", _bind_acl, True)
