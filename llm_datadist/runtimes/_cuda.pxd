# Mirror of include/llm_datadist/dd_cuda.h.
cdef extern from "llm_datadist/dd_cuda.h" nogil:
    ctypedef int dd_cuda_error
    ctypedef void *dd_cuda_stream
    int DD_CUDA_MEMCPY_HOST_TO_HOST
    int DD_CUDA_MEMCPY_HOST_TO_DEVICE
    int DD_CUDA_MEMCPY_DEVICE_TO_HOST
    int DD_CUDA_MEMCPY_DEVICE_TO_DEVICE
    ctypedef dd_cuda_error (*dd_cudaGetDeviceCount_fn)(int *count) noexcept nogil
    ctypedef dd_cuda_error (*dd_cudaSetDevice_fn)(int device) noexcept nogil
    ctypedef dd_cuda_error (*dd_cudaGetDevice_fn)(int *device) noexcept nogil
    ctypedef dd_cuda_error (*dd_cudaGetLastError_fn)() noexcept nogil
    ctypedef dd_cuda_error (*dd_cudaRuntimeGetVersion_fn)(int *version) noexcept nogil
    ctypedef dd_cuda_error (*dd_cudaMalloc_fn)(void **dev_ptr, size_t size) noexcept nogil
    ctypedef dd_cuda_error (*dd_cudaFree_fn)(void *dev_ptr) noexcept nogil
    ctypedef dd_cuda_error (*dd_cudaMemcpy_fn)(void *dst, const void *src, size_t count,
                                               int kind) noexcept nogil

    ctypedef dd_cuda_error (*dd_cudaStreamCreate_fn)(dd_cuda_stream *stream) noexcept nogil
    ctypedef dd_cuda_error (*dd_cudaStreamSynchronize_fn)(dd_cuda_stream stream) noexcept nogil
    ctypedef dd_cuda_error (*dd_cudaMemcpyAsync_fn)(void *dst, const void *src, size_t count,
                                                    int kind, dd_cuda_stream stream) noexcept nogil

    ctypedef struct dd_cuda_mem_location:
        int type
        int id
    ctypedef struct dd_cuda_memcpy_attributes:
        int src_access_order
        dd_cuda_mem_location src_loc_hint
        dd_cuda_mem_location dst_loc_hint
        unsigned int flags
    int DD_CUDA_MEMCPY_SRC_ACCESS_ORDER_STREAM
    ctypedef dd_cuda_error (*dd_cudaMemcpyBatchAsync_fn)(
        void **dsts, const void **srcs, const size_t *sizes, size_t count,
        dd_cuda_memcpy_attributes *attrs, size_t *attrs_idxs, size_t num_attrs,
        dd_cuda_stream stream) noexcept nogil
    ctypedef dd_cuda_error (*dd_cudaMemcpyBatchAsync12_fn)(
        void **dsts, void **srcs, size_t *sizes, size_t count, dd_cuda_memcpy_attributes *attrs,
        size_t *attrs_idxs, size_t num_attrs, size_t *fail_idx, dd_cuda_stream stream) noexcept nogil

    int DD_CUDA_HOST_REGISTER_PORTABLE
    ctypedef dd_cuda_error (*dd_cudaMallocHost_fn)(void **ptr, size_t size) noexcept nogil
    ctypedef dd_cuda_error (*dd_cudaFreeHost_fn)(void *ptr) noexcept nogil
    ctypedef dd_cuda_error (*dd_cudaHostRegister_fn)(void *ptr, size_t size,
                                                     unsigned int flags) noexcept nogil
    ctypedef dd_cuda_error (*dd_cudaHostUnregister_fn)(void *ptr) noexcept nogil

    int DD_CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    ctypedef struct dd_cuda_ipc_mem_handle:
        char reserved[64]
    ctypedef dd_cuda_error (*dd_cudaIpcGetMemHandle_fn)(dd_cuda_ipc_mem_handle *handle,
                                                        void *dev_ptr) noexcept nogil
    ctypedef dd_cuda_error (*dd_cudaIpcOpenMemHandle_fn)(void **dev_ptr, dd_cuda_ipc_mem_handle handle,
                                                         unsigned int flags) noexcept nogil
    ctypedef dd_cuda_error (*dd_cudaIpcCloseMemHandle_fn)(void *dev_ptr) noexcept nogil

    ctypedef int dd_cu_result
    ctypedef unsigned long long dd_cu_deviceptr
    ctypedef void *dd_cu_module
    ctypedef void *dd_cu_function
    ctypedef dd_cu_result (*dd_cuInit_fn)(unsigned int flags) noexcept nogil
    ctypedef dd_cu_result (*dd_cuMemGetAddressRange_fn)(dd_cu_deviceptr *base, size_t *size,
                                                        dd_cu_deviceptr ptr) noexcept nogil
    ctypedef dd_cu_result (*dd_cuModuleLoadData_fn)(dd_cu_module *module, const void *image) noexcept nogil
    ctypedef dd_cu_result (*dd_cuModuleGetFunction_fn)(dd_cu_function *function, dd_cu_module module,
                                                       const char *name) noexcept nogil
    ctypedef dd_cu_result (*dd_cuLaunchKernel_fn)(
        dd_cu_function function, unsigned int grid_x, unsigned int grid_y, unsigned int grid_z,
        unsigned int block_x, unsigned int block_y, unsigned int block_z, unsigned int shared_bytes,
        dd_cuda_stream stream, void **params, void **extra) noexcept nogil
