# Mirror of include/llm_datadist/dd_cuda.h.
cdef extern from "llm_datadist/dd_cuda.h" nogil:
    ctypedef int dd_cuda_error
    int DD_CUDA_MEMCPY_HOST_TO_HOST
    int DD_CUDA_MEMCPY_HOST_TO_DEVICE
    int DD_CUDA_MEMCPY_DEVICE_TO_HOST
    int DD_CUDA_MEMCPY_DEVICE_TO_DEVICE
    ctypedef dd_cuda_error (*dd_cudaGetDeviceCount_fn)(int *count) noexcept nogil
    ctypedef dd_cuda_error (*dd_cudaSetDevice_fn)(int device) noexcept nogil
    ctypedef dd_cuda_error (*dd_cudaMalloc_fn)(void **dev_ptr, size_t size) noexcept nogil
    ctypedef dd_cuda_error (*dd_cudaFree_fn)(void *dev_ptr) noexcept nogil
    ctypedef dd_cuda_error (*dd_cudaMemcpy_fn)(void *dst, const void *src, size_t count,
                                               int kind) noexcept nogil
