/*
 * The CUDA entry points llm_datadist uses, as function pointer types.
 * They are resolved at run time with dlsym: the runtime API from libcudart.so, the driver API
 * (kernel loading, address ranges) from libcuda.so.1; nothing links against CUDA.
 * Signatures follow the CUDA runtime API (cuda_runtime_api.h, driver_types.h) and the driver API
 * (cuda.h) of CUDA 12 and 13.
 */
#ifndef LLM_DATADIST_DD_CUDA_H
#define LLM_DATADIST_DD_CUDA_H

#include <stddef.h>

typedef int dd_cuda_error;
typedef void *dd_cuda_stream; /* cudaStream_t, the same object as the driver's CUstream */

/* cudaMemcpyKind */
#define DD_CUDA_MEMCPY_HOST_TO_HOST 0
#define DD_CUDA_MEMCPY_HOST_TO_DEVICE 1
#define DD_CUDA_MEMCPY_DEVICE_TO_HOST 2
#define DD_CUDA_MEMCPY_DEVICE_TO_DEVICE 3

typedef dd_cuda_error (*dd_cudaGetDeviceCount_fn)(int *count);
typedef dd_cuda_error (*dd_cudaSetDevice_fn)(int device);
typedef dd_cuda_error (*dd_cudaGetDevice_fn)(int *device);
/* Returns and clears the calling thread's last runtime error. */
typedef dd_cuda_error (*dd_cudaGetLastError_fn)(void);
typedef dd_cuda_error (*dd_cudaRuntimeGetVersion_fn)(int *version);
typedef dd_cuda_error (*dd_cudaMalloc_fn)(void **dev_ptr, size_t size);
typedef dd_cuda_error (*dd_cudaFree_fn)(void *dev_ptr);
typedef dd_cuda_error (*dd_cudaMemcpy_fn)(void *dst, const void *src, size_t count, int kind);

/* Streams and asynchronous copies. */
typedef dd_cuda_error (*dd_cudaStreamCreate_fn)(dd_cuda_stream *stream);
typedef dd_cuda_error (*dd_cudaStreamSynchronize_fn)(dd_cuda_stream stream);
typedef dd_cuda_error (*dd_cudaMemcpyAsync_fn)(void *dst, const void *src, size_t count, int kind,
                                               dd_cuda_stream stream);

/* cudaMemcpyBatchAsync (CUDA 12.8 on): struct cudaMemLocation and struct cudaMemcpyAttributes. */
typedef struct dd_cuda_mem_location {
    int type; /* enum cudaMemLocationType */
    int id;
} dd_cuda_mem_location;
typedef struct dd_cuda_memcpy_attributes {
    int src_access_order; /* enum cudaMemcpySrcAccessOrder */
    dd_cuda_mem_location src_loc_hint;
    dd_cuda_mem_location dst_loc_hint;
    unsigned int flags;
} dd_cuda_memcpy_attributes;
/* cudaMemcpySrcAccessOrderStream: the source is read in stream order. */
#define DD_CUDA_MEMCPY_SRC_ACCESS_ORDER_STREAM 1
/* CUDA 13.0 on (cudaRuntimeGetVersion >= 13000). */
typedef dd_cuda_error (*dd_cudaMemcpyBatchAsync_fn)(void *const *dsts, const void *const *srcs,
                                                    const size_t *sizes, size_t count,
                                                    dd_cuda_memcpy_attributes *attrs,
                                                    size_t *attrs_idxs, size_t num_attrs,
                                                    dd_cuda_stream stream);
/* CUDA 12.8 and 12.9: the same with the index of a failed copy before the stream. */
typedef dd_cuda_error (*dd_cudaMemcpyBatchAsync12_fn)(void **dsts, void **srcs, size_t *sizes,
                                                      size_t count,
                                                      dd_cuda_memcpy_attributes *attrs,
                                                      size_t *attrs_idxs, size_t num_attrs,
                                                      size_t *fail_idx, dd_cuda_stream stream);

/* Page-locked host memory. */
#define DD_CUDA_HOST_REGISTER_PORTABLE 1
typedef dd_cuda_error (*dd_cudaMallocHost_fn)(void **ptr, size_t size);
typedef dd_cuda_error (*dd_cudaFreeHost_fn)(void *ptr);
typedef dd_cuda_error (*dd_cudaHostRegister_fn)(void *ptr, size_t size, unsigned int flags);
typedef dd_cuda_error (*dd_cudaHostUnregister_fn)(void *ptr);

/* Inter-process memory (cudaIpcMemHandle_t is 64 opaque bytes, passed by value to open). */
#define DD_CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 1
typedef struct dd_cuda_ipc_mem_handle {
    char reserved[64];
} dd_cuda_ipc_mem_handle;
typedef dd_cuda_error (*dd_cudaIpcGetMemHandle_fn)(dd_cuda_ipc_mem_handle *handle, void *dev_ptr);
typedef dd_cuda_error (*dd_cudaIpcOpenMemHandle_fn)(void **dev_ptr, dd_cuda_ipc_mem_handle handle,
                                                    unsigned int flags);
typedef dd_cuda_error (*dd_cudaIpcCloseMemHandle_fn)(void *dev_ptr);

/* Driver API (cuda.h). */
typedef int dd_cu_result;
typedef unsigned long long dd_cu_deviceptr;
typedef void *dd_cu_module;
typedef void *dd_cu_function;
typedef dd_cu_result (*dd_cuInit_fn)(unsigned int flags);
/* Exported as cuMemGetAddressRange_v2. */
typedef dd_cu_result (*dd_cuMemGetAddressRange_fn)(dd_cu_deviceptr *base, size_t *size,
                                                   dd_cu_deviceptr ptr);
typedef dd_cu_result (*dd_cuModuleLoadData_fn)(dd_cu_module *module, const void *image);
typedef dd_cu_result (*dd_cuModuleGetFunction_fn)(dd_cu_function *function, dd_cu_module module,
                                                  const char *name);
typedef dd_cu_result (*dd_cuLaunchKernel_fn)(dd_cu_function function, unsigned int grid_x,
                                             unsigned int grid_y, unsigned int grid_z,
                                             unsigned int block_x, unsigned int block_y,
                                             unsigned int block_z, unsigned int shared_bytes,
                                             dd_cuda_stream stream, void **params, void **extra);

#endif /* LLM_DATADIST_DD_CUDA_H */
