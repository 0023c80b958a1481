# The CUDA binding (libcudart.so, and libcuda.so.1 for the driver API), included by _core.pyx:
# resolves the entry points declared in include/llm_datadist/dd_cuda.h and adapts them to the
# dd_runtime_table convention. Which runtime uses this binding, its default library and its
# environment variable are declared in llm_datadist/runtimes/cuda.py.
#
# Copies: every copy of a descriptor list is queued on one stream per device (created on first
# use, a blocking stream: it is ordered after work of the legacy default stream, where torch
# computes by default) and waited for once. Device-to-device lists run as one launch of the copy
# kernel (include/llm_datadist/dd_copy_kernel.h, PTX loaded with the driver API, descriptors cut
# into pieces of DD_COPY_KERNEL_PIECE_BYTES so every thread block has similar work); host<->device
# lists as one cudaMemcpyBatchAsync where the runtime has it (CUDA 12.8 on). Anything else, and
# every list when those are missing or refuse, is one cudaMemcpyAsync per descriptor on the stream.
from llm_datadist.runtimes._copy_kernel cimport (
    DD_COPY_KERNEL_NAME, DD_COPY_KERNEL_PIECE_BYTES, DD_COPY_KERNEL_THREADS, dd_copy_kernel_ptx,
)
from llm_datadist.runtimes._cuda cimport (
    DD_CUDA_HOST_REGISTER_PORTABLE, DD_CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
    DD_CUDA_MEMCPY_SRC_ACCESS_ORDER_STREAM, dd_cu_deviceptr, dd_cu_function, dd_cu_module,
    dd_cuda_ipc_mem_handle, dd_cuda_memcpy_attributes, dd_cuda_stream, dd_cudaFree_fn,
    dd_cudaFreeHost_fn, dd_cudaGetDevice_fn, dd_cudaGetDeviceCount_fn, dd_cudaGetLastError_fn,
    dd_cudaHostRegister_fn, dd_cudaHostUnregister_fn, dd_cudaIpcCloseMemHandle_fn, dd_cudaIpcGetMemHandle_fn,
    dd_cudaIpcOpenMemHandle_fn, dd_cudaMalloc_fn, dd_cudaMallocHost_fn, dd_cudaMemcpy_fn,
    dd_cudaMemcpyAsync_fn, dd_cudaMemcpyBatchAsync12_fn, dd_cudaMemcpyBatchAsync_fn,
    dd_cudaRuntimeGetVersion_fn, dd_cudaSetDevice_fn, dd_cudaStreamCreate_fn,
    dd_cudaStreamSynchronize_fn, dd_cuInit_fn, dd_cuLaunchKernel_fn, dd_cuMemGetAddressRange_fn,
    dd_cuModuleGetFunction_fn, dd_cuModuleLoadData_fn,
)
from llm_datadist._runtime cimport dd_ipc_handle

import os as _os

#: Devices the binding keeps a stream (and a loaded kernel) for.
DEF _CUDA_MAX_DEVICES = 64
#: The library of the driver API, unless LLM_DATADIST_CUDA_DRIVER_LIBRARY names another.
CUDA_DRIVER_LIBRARY = "libcuda.so.1"
CUDA_DRIVER_LIBRARY_ENV = "LLM_DATADIST_CUDA_DRIVER_LIBRARY"
# cudaErrorInvalidValue, returned for a device outside the binding's table.
cdef int _CUDA_ERROR_INVALID_VALUE = 1
# States of a per-device kernel / of the process-wide batch API.
cdef enum:
    _UNTRIED = 0
    _READY = 1
    _UNUSABLE = 2


cdef struct CudaDevice:
    dd_cuda_stream stream
    bint has_stream
    int kernel_state
    dd_cu_module module
    dd_cu_function kernel
    # Device memory the kernel reads its descriptor pieces from (grown on demand).
    void *pieces
    size_t pieces_bytes
    # Host arrays of pieces whose copy to ``pieces`` is queued: freed once the stream is waited
    # for (a cudaMemcpyAsync from pageable memory may read its source after it returns).
    PendingPieces *pending


cdef struct PendingPieces:
    PendingPieces *next


cdef struct CudaApi:
    dd_cudaGetDeviceCount_fn get_device_count
    dd_cudaSetDevice_fn set_device
    dd_cudaGetDevice_fn get_device
    dd_cudaMalloc_fn malloc
    dd_cudaFree_fn free
    dd_cudaMemcpy_fn memcpy
    # cudaGetLastError (NULL where absent): clears the error a refused call left for this thread.
    dd_cudaGetLastError_fn get_last_error
    dd_cudaStreamCreate_fn stream_create
    dd_cudaStreamSynchronize_fn stream_synchronize
    dd_cudaMemcpyAsync_fn memcpy_async
    dd_cudaMemcpyBatchAsync_fn batch13
    dd_cudaMemcpyBatchAsync12_fn batch12
    int batch_state
    dd_cudaMallocHost_fn malloc_host
    dd_cudaFreeHost_fn free_host
    dd_cudaHostRegister_fn host_register
    dd_cudaHostUnregister_fn host_unregister
    dd_cudaIpcGetMemHandle_fn ipc_get
    dd_cudaIpcOpenMemHandle_fn ipc_open
    dd_cudaIpcCloseMemHandle_fn ipc_close
    # Driver API: NULL where libcuda.so.1 (or the override) cannot be opened.
    dd_cuMemGetAddressRange_fn address_range
    dd_cuModuleLoadData_fn module_load
    dd_cuModuleGetFunction_fn module_function
    dd_cuLaunchKernel_fn launch
    pthread_mutex_t lock
    CudaDevice devices[_CUDA_MAX_DEVICES]


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


cdef int _cuda_current(CudaApi *api, CudaDevice **out) noexcept nogil:
    """The calling thread's device and its stream (created on first use). Lock held."""
    cdef int device = 0
    cdef int rc = api.get_device(&device)
    if rc != 0:
        return rc
    if device < 0 or device >= _CUDA_MAX_DEVICES:
        return _CUDA_ERROR_INVALID_VALUE
    cdef CudaDevice *dev = &api.devices[device]
    if not dev.has_stream:
        rc = api.stream_create(&dev.stream)
        if rc != 0:
            return rc
        dev.has_stream = True
    out[0] = dev
    return 0


cdef bint _cuda_kernel_ready(CudaApi *api, CudaDevice *dev) noexcept nogil:
    """Load the copy kernel into the device's primary context on first use; False, for good, if
    the driver refuses it."""
    if dev.kernel_state == _UNTRIED:
        dev.kernel_state = _UNUSABLE
        if api.module_load != NULL and dd_copy_kernel_ptx[0] != 0:
            # The stream may have been created on another thread: cudaFree(NULL) makes the device's
            # primary context current to this one, as the driver API calls below need.
            api.free(NULL)
            if (api.module_load(&dev.module, <const void *>dd_copy_kernel_ptx) == 0
                    and api.module_function(&dev.kernel, dev.module, DD_COPY_KERNEL_NAME) == 0):
                dev.kernel_state = _READY
    return dev.kernel_state == _READY


cdef int _cuda_launch_pieces(CudaApi *api, CudaDevice *dev, const dd_copy_desc *descs,
                             size_t count, int *wait_rc) noexcept nogil:
    """One launch of the copy kernel over ``descs`` cut into pieces; -1 if it cannot run (nothing
    was queued), else the runtime's or the driver's code. ``wait_rc``: the error of copies queued
    before, met while waiting to grow the piece buffer (nothing was queued then)."""
    cdef size_t pieces = 0, i, k = 0
    cdef uint64_t off, take, piece = DD_COPY_KERNEL_PIECE_BYTES
    cdef dd_copy_desc *host
    cdef PendingPieces *block
    cdef void *grown = NULL
    cdef unsigned long long n
    cdef void *params[2]
    cdef unsigned int grid
    cdef int rc
    for i in range(count):
        pieces += <size_t>((descs[i].nbytes + piece - 1) // piece)
    if pieces == 0:
        return 0
    block = <PendingPieces *>malloc(sizeof(PendingPieces) + pieces * sizeof(dd_copy_desc))
    if block == NULL:
        return -1
    host = <dd_copy_desc *>(block + 1)
    for i in range(count):
        off = 0
        while off < descs[i].nbytes:
            take = descs[i].nbytes - off
            if take > piece:
                take = piece
            host[k].src = descs[i].src + off
            host[k].dst = descs[i].dst + off
            host[k].nbytes = take
            k += 1
            off += take
    if dev.pieces_bytes < pieces * sizeof(dd_copy_desc):
        # The old buffer may still be read by a queued launch: wait for the stream first.
        rc = api.stream_synchronize(dev.stream)
        _cuda_free_pending(dev.pending)  # every queued copy has run (the lock is held)
        dev.pending = NULL
        if rc != 0:
            free(block)
            wait_rc[0] = rc
            return -1
        rc = api.malloc(&grown, pieces * sizeof(dd_copy_desc) * 2)
        if rc != 0:
            free(block)
            return rc
        if dev.pieces != NULL:
            api.free(dev.pieces)
        dev.pieces = grown
        dev.pieces_bytes = pieces * sizeof(dd_copy_desc) * 2
    # An asynchronous copy from pageable memory "might be synchronous" (CUDA's API
    # synchronization behavior): nothing promises the bytes were taken on return, so the host
    # array lives until the stream is waited for.
    rc = api.memcpy_async(dev.pieces, host, pieces * sizeof(dd_copy_desc), DD_MEMCPY_HOST_TO_DEVICE,
                          dev.stream)
    if rc != 0:
        free(block)
        return rc
    block.next = dev.pending
    dev.pending = block
    n = pieces
    params[0] = &dev.pieces
    params[1] = &n
    grid = <unsigned int>(pieces if pieces < 65535 else 65535)
    return api.launch(dev.kernel, grid, 1, 1, DD_COPY_KERNEL_THREADS, 1, 1, 0, dev.stream, params, NULL)


cdef void _cuda_free_pending(PendingPieces *block) noexcept nogil:
    cdef PendingPieces *next
    while block != NULL:
        next = block.next
        free(block)
        block = next


cdef void _cuda_clear_error(CudaApi *api) noexcept nogil:
    """Reset the runtime's last error of this thread after a call whose refusal we handle: the
    runtime keeps it for cudaGetLastError, where torch's next kernel launch check would take it
    for its own (when torch uses the same libcudart)."""
    if api.get_last_error != NULL:
        api.get_last_error()


cdef int _cuda_batch(CudaApi *api, CudaDevice *dev, const dd_copy_desc *descs,
                     size_t count) noexcept nogil:
    """One cudaMemcpyBatchAsync of the list; -1 if the runtime has none (nothing was queued)."""
    cdef void **dsts = <void **>malloc(count * sizeof(void *))
    cdef void **srcs = <void **>malloc(count * sizeof(void *))
    cdef size_t *sizes = <size_t *>malloc(count * sizeof(size_t))
    cdef dd_cuda_memcpy_attributes attrs
    cdef size_t attr_index = 0, fail_index = 0, i, n = 0
    cdef int rc = -1
    if dsts != NULL and srcs != NULL and sizes != NULL:
        for i in range(count):
            if descs[i].nbytes:
                dsts[n] = <void *>descs[i].dst
                srcs[n] = <void *>descs[i].src
                sizes[n] = descs[i].nbytes
                n += 1
        memset(&attrs, 0, sizeof(attrs))
        attrs.src_access_order = DD_CUDA_MEMCPY_SRC_ACCESS_ORDER_STREAM
        if n == 0:
            rc = 0
        elif api.batch13 != NULL:
            rc = api.batch13(dsts, <const void **>srcs, sizes, n, &attrs, &attr_index, 1, dev.stream)
        elif api.batch12 != NULL:
            rc = api.batch12(dsts, srcs, sizes, n, &attrs, &attr_index, 1, &fail_index, dev.stream)
    free(dsts)
    free(srcs)
    free(sizes)
    return rc


cdef int _cuda_copy_batch(void *ctx, const dd_copy_desc *descs, size_t count, int kind,
                          size_t *failed_at) noexcept nogil:
    cdef CudaApi *api = <CudaApi *>ctx
    cdef CudaDevice *dev = NULL
    cdef int rc, wait_rc = 0
    cdef size_t i
    failed_at[0] = count
    pthread_mutex_lock(&api.lock)
    rc = _cuda_current(api, &dev)
    if rc != 0:
        pthread_mutex_unlock(&api.lock)
        return rc
    rc = -1
    if kind == DD_MEMCPY_DEVICE_TO_DEVICE and _cuda_kernel_ready(api, dev):
        rc = _cuda_launch_pieces(api, dev, descs, count, &wait_rc)
        if wait_rc != 0:  # an earlier copy failed: report it, the kernel is not at fault
            pthread_mutex_unlock(&api.lock)
            return wait_rc
        if rc > 0:  # the driver refused the launch: do not try it again, copy another way
            _cuda_clear_error(api)
            dev.kernel_state = _UNUSABLE
            rc = -1
    if rc == -1 and kind != DD_MEMCPY_HOST_TO_HOST and api.batch_state != _UNUSABLE:
        rc = _cuda_batch(api, dev, descs, count)
        if rc > 0:  # refused (nothing queued): per-descriptor copies from now on
            _cuda_clear_error(api)
            api.batch_state = _UNUSABLE
            rc = -1
    if rc == -1:
        rc = 0
        for i in range(count):
            if descs[i].nbytes == 0:
                continue
            rc = api.memcpy_async(<void *>descs[i].dst, <const void *>descs[i].src, descs[i].nbytes,
                                  kind, dev.stream)
            if rc != 0:
                failed_at[0] = i
                break
    pthread_mutex_unlock(&api.lock)
    return rc


cdef int _cuda_synchronize(void *ctx) noexcept nogil:
    cdef CudaApi *api = <CudaApi *>ctx
    cdef CudaDevice *dev = NULL
    cdef PendingPieces *done = NULL
    pthread_mutex_lock(&api.lock)
    cdef int rc = _cuda_current(api, &dev)
    if rc == 0:
        # Taken before the wait: what other threads queue meanwhile stays for their own wait.
        done = dev.pending
        dev.pending = NULL
    pthread_mutex_unlock(&api.lock)
    if rc != 0:
        return rc
    rc = api.stream_synchronize(dev.stream)
    _cuda_free_pending(done)
    return rc


cdef int _cuda_malloc_host(void *ctx, void **ptr, size_t size) noexcept nogil:
    return (<CudaApi *>ctx).malloc_host(ptr, size if size > 0 else 1)


cdef int _cuda_free_host(void *ctx, void *ptr) noexcept nogil:
    return (<CudaApi *>ctx).free_host(ptr)


cdef int _cuda_host_register(void *ctx, void *ptr, size_t size) noexcept nogil:
    cdef CudaApi *api = <CudaApi *>ctx
    cdef int rc = api.host_register(ptr, size, DD_CUDA_HOST_REGISTER_PORTABLE)
    if rc != 0:  # e.g. memory torch already pinned (cudaErrorHostMemoryAlreadyRegistered)
        _cuda_clear_error(api)
    return rc


cdef int _cuda_host_unregister(void *ctx, void *ptr) noexcept nogil:
    return (<CudaApi *>ctx).host_unregister(ptr)


cdef int _cuda_ipc_export(void *ctx, void *ptr, dd_ipc_handle *handle, uint64_t *base,
                          uint64_t *size) noexcept nogil:
    cdef CudaApi *api = <CudaApi *>ctx
    cdef dd_cuda_ipc_mem_handle h
    cdef dd_cu_deviceptr start = 0
    cdef size_t length = 0
    # cudaIpcGetMemHandle takes the base of a cudaMalloc allocation; ptr may lie inside one (a
    # tensor of torch's caching allocator): find the base first. The peer maps the whole
    # allocation at its own base and adds the offset.
    cdef int rc = api.address_range(&start, &length, <dd_cu_deviceptr>ptr)
    if rc != 0:
        return rc
    rc = api.ipc_get(&h, <void *>start)
    if rc != 0:  # not exportable (VMM memory, e.g. torch's expandable segments)
        _cuda_clear_error(api)
        return rc
    memcpy(handle.bytes, h.reserved, sizeof(h.reserved))
    base[0] = start
    size[0] = length
    return 0


cdef int _cuda_ipc_open(void *ctx, const dd_ipc_handle *handle, void **base,
                        uint64_t *size) noexcept nogil:
    cdef CudaApi *api = <CudaApi *>ctx
    cdef dd_cuda_ipc_mem_handle h
    cdef dd_cu_deviceptr start = 0
    cdef size_t length = 0
    memcpy(h.reserved, handle.bytes, sizeof(h.reserved))
    cdef int rc = api.ipc_open(base, h, DD_CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
    if rc != 0:
        return rc
    # How much was mapped, from our own runtime: the exporter's word for it is not trusted.
    rc = api.address_range(&start, &length, <dd_cu_deviceptr>base[0])
    if rc != 0 or start != <dd_cu_deviceptr>base[0]:
        api.ipc_close(base[0])
        return rc if rc != 0 else _CUDA_ERROR_INVALID_VALUE
    size[0] = length
    return 0


cdef int _cuda_ipc_close(void *ctx, void *base) noexcept nogil:
    return (<CudaApi *>ctx).ipc_close(base)


cdef void *_cuda_driver(Runtime rt) except? NULL:
    """The handle to resolve driver entry points in: the runtime library itself when it exports
    them (a test stand-in does), else libcuda.so.1 or the override; NULL when none opens."""
    if _optional(rt.handle, "cuLaunchKernel") != NULL:
        return rt.handle
    path = (_os.environ.get(CUDA_DRIVER_LIBRARY_ENV) or CUDA_DRIVER_LIBRARY).encode()
    return dlopen(path, RTLD_NOW | RTLD_LOCAL)


cdef int _bind_cuda(Runtime rt) except -1:
    cdef CudaApi *api = <CudaApi *>_binding_api(rt, sizeof(CudaApi))
    cdef void *driver
    cdef int version = 0
    cdef dd_cudaRuntimeGetVersion_fn get_version
    cdef dd_cuInit_fn cu_init
    api.get_device_count = <dd_cudaGetDeviceCount_fn>_resolve(rt.handle, rt.library,
                                                              "cudaGetDeviceCount")
    api.set_device = <dd_cudaSetDevice_fn>_resolve(rt.handle, rt.library, "cudaSetDevice")
    api.get_device = <dd_cudaGetDevice_fn>_resolve(rt.handle, rt.library, "cudaGetDevice")
    api.malloc = <dd_cudaMalloc_fn>_resolve(rt.handle, rt.library, "cudaMalloc")
    api.free = <dd_cudaFree_fn>_resolve(rt.handle, rt.library, "cudaFree")
    api.memcpy = <dd_cudaMemcpy_fn>_resolve(rt.handle, rt.library, "cudaMemcpy")
    api.get_last_error = <dd_cudaGetLastError_fn>_optional(rt.handle, "cudaGetLastError")
    api.stream_create = <dd_cudaStreamCreate_fn>_resolve(rt.handle, rt.library, "cudaStreamCreate")
    api.stream_synchronize = <dd_cudaStreamSynchronize_fn>_resolve(rt.handle, rt.library,
                                                                   "cudaStreamSynchronize")
    api.memcpy_async = <dd_cudaMemcpyAsync_fn>_resolve(rt.handle, rt.library, "cudaMemcpyAsync")
    api.malloc_host = <dd_cudaMallocHost_fn>_resolve(rt.handle, rt.library, "cudaMallocHost")
    api.free_host = <dd_cudaFreeHost_fn>_resolve(rt.handle, rt.library, "cudaFreeHost")
    api.host_register = <dd_cudaHostRegister_fn>_resolve(rt.handle, rt.library, "cudaHostRegister")
    api.host_unregister = <dd_cudaHostUnregister_fn>_resolve(rt.handle, rt.library,
                                                             "cudaHostUnregister")
    api.ipc_get = <dd_cudaIpcGetMemHandle_fn>_resolve(rt.handle, rt.library, "cudaIpcGetMemHandle")
    api.ipc_open = <dd_cudaIpcOpenMemHandle_fn>_resolve(rt.handle, rt.library, "cudaIpcOpenMemHandle")
    api.ipc_close = <dd_cudaIpcCloseMemHandle_fn>_resolve(rt.handle, rt.library,
                                                          "cudaIpcCloseMemHandle")
    # cudaMemcpyBatchAsync changed its signature in CUDA 13: pick the one of this runtime.
    get_version = <dd_cudaRuntimeGetVersion_fn>_optional(rt.handle, "cudaRuntimeGetVersion")
    if get_version != NULL and get_version(&version) == 0:
        if version >= 13000:
            api.batch13 = <dd_cudaMemcpyBatchAsync_fn>_optional(rt.handle, "cudaMemcpyBatchAsync")
        elif version >= 12080:
            api.batch12 = <dd_cudaMemcpyBatchAsync12_fn>_optional(rt.handle, "cudaMemcpyBatchAsync")
    api.batch_state = _READY if (api.batch13 != NULL or api.batch12 != NULL) else _UNUSABLE
    driver = _cuda_driver(rt)
    if driver != NULL:
        cu_init = <dd_cuInit_fn>_optional(driver, "cuInit")
        api.address_range = <dd_cuMemGetAddressRange_fn>_optional(driver, "cuMemGetAddressRange_v2")
        api.module_load = <dd_cuModuleLoadData_fn>_optional(driver, "cuModuleLoadData")
        api.module_function = <dd_cuModuleGetFunction_fn>_optional(driver, "cuModuleGetFunction")
        api.launch = <dd_cuLaunchKernel_fn>_optional(driver, "cuLaunchKernel")
        if (cu_init == NULL or cu_init(0) != 0 or api.module_load == NULL
                or api.module_function == NULL or api.launch == NULL):
            api.module_load = NULL
    if pthread_mutex_init(&api.lock, NULL) != 0:
        raise MemoryError()
    rt.table.ctx = api
    rt.table.set_device = _cuda_set_device
    rt.table.malloc_device = _cuda_malloc
    rt.table.free_device = _cuda_free
    rt.table.memcpy_kind = _cuda_memcpy
    rt.table.device_count = _cuda_device_count
    rt.table.copy_batch = _cuda_copy_batch
    rt.table.synchronize = _cuda_synchronize
    rt.table.malloc_host = _cuda_malloc_host
    rt.table.free_host = _cuda_free_host
    rt.table.host_register = _cuda_host_register
    rt.table.host_unregister = _cuda_host_unregister
    rt.table.capabilities = DD_RUNTIME_ASYNC_COPY
    if api.module_load != NULL or api.batch_state == _READY:
        rt.table.capabilities |= DD_RUNTIME_BATCHED_COPY
    if api.address_range != NULL:
        rt.table.ipc_export = _cuda_ipc_export
        rt.table.ipc_open = _cuda_ipc_open
        rt.table.ipc_close = _cuda_ipc_close
        rt.table.capabilities |= DD_RUNTIME_IPC
    return 0


_add_binding("cuda", _bind_cuda, True)
