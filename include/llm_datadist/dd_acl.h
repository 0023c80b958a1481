/*
 * The few Ascend ACL runtime entry points llm_datadist uses, as function pointer types.
 * They are resolved at run time from libascendcl.so with dlsym; nothing links against ACL.
 * Signatures follow the public ACL runtime documentation (acl/acl_rt.h).
 */
#ifndef LLM_DATADIST_DD_ACL_H
#define LLM_DATADIST_DD_ACL_H

#include <stddef.h>
#include <stdint.h>

typedef int dd_acl_error;

/* aclrtMemcpyKind */
#define DD_ACL_MEMCPY_HOST_TO_HOST 0
#define DD_ACL_MEMCPY_HOST_TO_DEVICE 1
#define DD_ACL_MEMCPY_DEVICE_TO_HOST 2
#define DD_ACL_MEMCPY_DEVICE_TO_DEVICE 3
/* aclrtMemMallocPolicy: ACL_MEM_MALLOC_HUGE_FIRST */
#define DD_ACL_MEM_MALLOC_HUGE_FIRST 0

typedef dd_acl_error (*dd_aclInit_fn)(const char *config_path);
typedef dd_acl_error (*dd_aclrtSetDevice_fn)(int32_t device_id);
typedef dd_acl_error (*dd_aclrtMalloc_fn)(void **dev_ptr, size_t size, int policy);
typedef dd_acl_error (*dd_aclrtFree_fn)(void *dev_ptr);
typedef dd_acl_error (*dd_aclrtMemcpy_fn)(void *dst, size_t dest_max, const void *src,
                                          size_t count, int kind);
typedef dd_acl_error (*dd_aclrtGetDevice_fn)(int32_t *device_id);

/* Streams and asynchronous copies (aclrtStream is an opaque pointer). */
typedef void *dd_acl_stream;
typedef dd_acl_error (*dd_aclrtCreateStream_fn)(dd_acl_stream *stream);
typedef dd_acl_error (*dd_aclrtSynchronizeStream_fn)(dd_acl_stream stream);
typedef dd_acl_error (*dd_aclrtMemcpyAsync_fn)(void *dst, size_t dest_max, const void *src,
                                               size_t count, int kind, dd_acl_stream stream);

/* Page-locked host memory. */
typedef dd_acl_error (*dd_aclrtMallocHost_fn)(void **host_ptr, size_t size);
typedef dd_acl_error (*dd_aclrtFreeHost_fn)(void *host_ptr);

#endif /* LLM_DATADIST_DD_ACL_H */
