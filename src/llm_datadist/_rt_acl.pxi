# The Ascend ACL binding (libascendcl.so), included by _core.pyx: resolves the entry points
# declared in include/llm_datadist/dd_acl.h and adapts them to the dd_runtime_table convention.
# Which runtime uses this binding, its default library and its environment variable are declared
# in llm_datadist/runtimes/acl.py.
from llm_datadist._acl cimport (
    DD_ACL_MEM_MALLOC_HUGE_FIRST, dd_aclInit_fn, dd_aclrtFree_fn, dd_aclrtMalloc_fn,
    dd_aclrtMemcpy_fn, dd_aclrtSetDevice_fn,
)

# ACL answers aclInit on an already initialised process with ACL_ERROR_REPEAT_INITIALIZE.
cdef int _ACL_ERROR_REPEAT_INITIALIZE = 100002


cdef struct AclApi:
    dd_aclInit_fn init
    dd_aclrtSetDevice_fn set_device
    dd_aclrtMalloc_fn malloc
    dd_aclrtFree_fn free
    dd_aclrtMemcpy_fn memcpy


cdef int _acl_set_device(void *ctx, int32_t device_id) noexcept nogil:
    return (<AclApi *>ctx).set_device(device_id)


cdef int _acl_malloc(void *ctx, void **ptr, size_t size) noexcept nogil:
    return (<AclApi *>ctx).malloc(ptr, size if size > 0 else 1, DD_ACL_MEM_MALLOC_HUGE_FIRST)


cdef int _acl_free(void *ctx, void *ptr) noexcept nogil:
    return (<AclApi *>ctx).free(ptr)


cdef int _acl_memcpy(void *ctx, void *dst, const void *src, size_t count, int kind) noexcept nogil:
    # The planner has already checked that count fits the destination, so destMax = count.
    return (<AclApi *>ctx).memcpy(dst, count, src, count, kind)


cdef int _bind_acl(Runtime rt) except -1:
    cdef int rc
    cdef AclApi *api = <AclApi *>_binding_api(rt, sizeof(AclApi))
    api.init = <dd_aclInit_fn>_resolve(rt.handle, rt.library, "aclInit")
    api.set_device = <dd_aclrtSetDevice_fn>_resolve(rt.handle, rt.library, "aclrtSetDevice")
    api.malloc = <dd_aclrtMalloc_fn>_resolve(rt.handle, rt.library, "aclrtMalloc")
    api.free = <dd_aclrtFree_fn>_resolve(rt.handle, rt.library, "aclrtFree")
    api.memcpy = <dd_aclrtMemcpy_fn>_resolve(rt.handle, rt.library, "aclrtMemcpy")
    rc = api.init(NULL)
    if rc != 0 and rc != _ACL_ERROR_REPEAT_INITIALIZE:
        raise LLMException(f"aclInit failed with error {rc}", status_code=LLMStatusCode.LLM_FAILED)
    rt.table.ctx = api
    rt.table.set_device = _acl_set_device
    rt.table.malloc_device = _acl_malloc
    rt.table.free_device = _acl_free
    rt.table.memcpy_kind = _acl_memcpy
    # One device as far as the core knows (aclrtGetDeviceCount is not bound); copies are
    # synchronous aclrtMemcpy calls, one per descriptor; no IPC yet.
    rt.table.device_count = _one_device
    rt.table.capabilities = 0
    return 0


_add_binding("acl", _bind_acl, True)
