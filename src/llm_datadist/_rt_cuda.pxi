# The CUDA runtime binding (libcudart.so), included by _core.pyx: resolves the entry points
# declared in include/llm_datadist/dd_cuda.h and adapts them to the dd_runtime_table convention.
# Which runtime uses this binding, its default library and its environment variable are declared
# in llm_datadist/runtimes/cuda.py.
from llm_datadist._cuda cimport (
    dd_cudaFree_fn, dd_cudaGetDeviceCount_fn, dd_cudaMalloc_fn, dd_cudaMemcpy_fn,
    dd_cudaSetDevice_fn,
)


cdef struct CudaApi:
    dd_cudaGetDeviceCount_fn get_device_count
    dd_cudaSetDevice_fn set_device
    dd_cudaMalloc_fn malloc
    dd_cudaFree_fn free
    dd_cudaMemcpy_fn memcpy


cdef int _cuda_device_count(void *ctx, int *count) noexcept nogil:
    return (<CudaApi *>ctx).get_device_count(count)


cdef int _cuda_set_device(void *ctx, int32_t device_id) noexcept nogil:
    return (<CudaApi *>ctx).set_device(device_id)


cdef int _cuda_malloc(void *ctx, void **ptr, size_t size) noexcept nogil:
    return (<CudaApi *>ctx).malloc(ptr, size if size > 0 else 1)


cdef int _cuda_free(void *ctx, void *ptr) noexcept nogil:
    return (<CudaApi *>ctx).free(ptr)


cdef int _cuda_memcpy(void *ctx, void *dst, const void *src, size_t count, int kind) noexcept nogil:
    return (<CudaApi *>ctx).memcpy(dst, src, count, kind)


cdef int _bind_cuda(Runtime rt) except -1:
    cdef CudaApi *api = <CudaApi *>_binding_api(rt, sizeof(CudaApi))
    api.get_device_count = <dd_cudaGetDeviceCount_fn>_resolve(rt.handle, rt.library,
                                                              "cudaGetDeviceCount")
    api.set_device = <dd_cudaSetDevice_fn>_resolve(rt.handle, rt.library, "cudaSetDevice")
    api.malloc = <dd_cudaMalloc_fn>_resolve(rt.handle, rt.library, "cudaMalloc")
    api.free = <dd_cudaFree_fn>_resolve(rt.handle, rt.library, "cudaFree")
    api.memcpy = <dd_cudaMemcpy_fn>_resolve(rt.handle, rt.library, "cudaMemcpy")
    rt.table.ctx = api
    rt.table.set_device = _cuda_set_device
    rt.table.malloc_device = _cuda_malloc
    rt.table.free_device = _cuda_free
    rt.table.memcpy_kind = _cuda_memcpy
    rt.table.device_count = _cuda_device_count
    # Synchronous cudaMemcpy per descriptor; device memory is not host memory; no IPC yet.
    rt.table.capabilities = 0
    return 0


_add_binding("cuda", _bind_cuda, True)
