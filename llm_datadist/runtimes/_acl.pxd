# Mirror of include/llm_datadist/dd_acl.h.
from libc.stdint cimport int32_t

cdef extern from "llm_datadist/dd_acl.h" nogil:
    ctypedef int dd_acl_error
    int DD_ACL_MEMCPY_HOST_TO_HOST
    int DD_ACL_MEMCPY_HOST_TO_DEVICE
    int DD_ACL_MEMCPY_DEVICE_TO_HOST
    int DD_ACL_MEMCPY_DEVICE_TO_DEVICE
    int DD_ACL_MEM_MALLOC_HUGE_FIRST
    ctypedef dd_acl_error (*dd_aclInit_fn)(const char *config_path) noexcept nogil
    ctypedef dd_acl_error (*dd_aclrtSetDevice_fn)(int32_t device_id) noexcept nogil
    ctypedef dd_acl_error (*dd_aclrtMalloc_fn)(void **dev_ptr, size_t size, int policy) noexcept nogil
    ctypedef dd_acl_error (*dd_aclrtFree_fn)(void *dev_ptr) noexcept nogil
    ctypedef dd_acl_error (*dd_aclrtMemcpy_fn)(void *dst, size_t dest_max, const void *src,
                                               size_t count, int kind) noexcept nogil
    ctypedef dd_acl_error (*dd_aclrtGetDevice_fn)(int32_t *device_id) noexcept nogil
    ctypedef void *dd_acl_stream
    ctypedef dd_acl_error (*dd_aclrtCreateStream_fn)(dd_acl_stream *stream) noexcept nogil
    ctypedef dd_acl_error (*dd_aclrtSynchronizeStream_fn)(dd_acl_stream stream) noexcept nogil
    ctypedef dd_acl_error (*dd_aclrtMemcpyAsync_fn)(void *dst, size_t dest_max, const void *src,
                                                    size_t count, int kind,
                                                    dd_acl_stream stream) noexcept nogil
    ctypedef dd_acl_error (*dd_aclrtMallocHost_fn)(void **host_ptr, size_t size) noexcept nogil
    ctypedef dd_acl_error (*dd_aclrtFreeHost_fn)(void *host_ptr) noexcept nogil
