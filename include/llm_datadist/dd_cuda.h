/*
 * The few CUDA runtime entry points llm_datadist uses, as function pointer types.
 * They are resolved at run time from libcudart.so with dlsym; nothing links against CUDA.
 * Signatures follow the CUDA runtime API (cuda_runtime_api.h).
 */
#ifndef LLM_DATADIST_DD_CUDA_H
#define LLM_DATADIST_DD_CUDA_H

#include <stddef.h>

typedef int dd_cuda_error;

/* cudaMemcpyKind */
#define DD_CUDA_MEMCPY_HOST_TO_HOST 0
#define DD_CUDA_MEMCPY_HOST_TO_DEVICE 1
#define DD_CUDA_MEMCPY_DEVICE_TO_HOST 2
#define DD_CUDA_MEMCPY_DEVICE_TO_DEVICE 3

typedef dd_cuda_error (*dd_cudaGetDeviceCount_fn)(int *count);
typedef dd_cuda_error (*dd_cudaSetDevice_fn)(int device);
typedef dd_cuda_error (*dd_cudaMalloc_fn)(void **dev_ptr, size_t size);
typedef dd_cuda_error (*dd_cudaFree_fn)(void *dev_ptr);
typedef dd_cuda_error (*dd_cudaMemcpy_fn)(void *dst, const void *src, size_t count, int kind);

#endif /* LLM_DATADIST_DD_CUDA_H */
