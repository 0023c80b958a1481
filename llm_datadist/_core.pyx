# cython: language_level=3, embedsignature=True
"""Transfer core: copy plans, bounds checks, device runtimes and GIL-free executors.

Everything that is done per block, per row or per tensor lives here. The Python layers above
validate argument types, resolve keys to caches and call this module once per transfer.

A *plan* is a list of ``(src, dst, nbytes)`` descriptors computed from two cache layouts (tensor
base addresses, rows or blocks, row stride), tensor index lists and block/row selections. Every
index is checked against the layouts before the first descriptor is produced, and descriptors
whose source and destination both continue the previous one are merged. An *executor* runs a plan
through a device runtime with the GIL released.
"""

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t, UINT64_MAX
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memmove, memset
from posix.dlfcn cimport RTLD_LOCAL, RTLD_NOW, dlclose, dlerror, dlopen, dlsym

# Binds the dl* calls above to the symbol versions every glibc exports (GLIBC_2.2.5 on x86_64), not
# to the GLIBC_2.34 ones a build on a newer glibc would get: see include/llm_datadist/dd_glibc.h.
cdef extern from "llm_datadist/dd_glibc.h":
    pass

cimport numpy as cnp

cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void **memptr, size_t alignment, size_t size)
import threading

import numpy as np

from llm_datadist._runtime cimport (
    DD_IPC_HANDLE_BYTES, dd_ipc_handle, DD_MEMCPY_DEVICE_TO_DEVICE, DD_MEMCPY_DEVICE_TO_HOST, DD_MEMCPY_HOST_TO_DEVICE,
    DD_MEMCPY_HOST_TO_HOST, DD_RUNTIME_ASYNC_COPY, DD_RUNTIME_BATCHED_COPY,
    DD_RUNTIME_HOST_ADDRESSABLE, DD_RUNTIME_IPC,
)
from llm_datadist cimport _status

from llm_datadist.status import LLMException, LLMStatusCode

cnp.import_array()

cdef extern from *:
    """
    #ifndef LLM_DATADIST_DEBUG
    #define LLM_DATADIST_DEBUG 0
    #endif
    #ifndef LLM_DATADIST_CYTHON_VERSION
    #define LLM_DATADIST_CYTHON_VERSION "unknown"
    #endif
    """
    int LLM_DATADIST_DEBUG
    const char *LLM_DATADIST_CYTHON_VERSION

MEMCPY_HOST_TO_HOST = DD_MEMCPY_HOST_TO_HOST
MEMCPY_HOST_TO_DEVICE = DD_MEMCPY_HOST_TO_DEVICE
MEMCPY_DEVICE_TO_HOST = DD_MEMCPY_DEVICE_TO_HOST
MEMCPY_DEVICE_TO_DEVICE = DD_MEMCPY_DEVICE_TO_DEVICE
MEMCPY_KIND_NAMES = {
    DD_MEMCPY_HOST_TO_HOST: "host-to-host",
    DD_MEMCPY_HOST_TO_DEVICE: "host-to-device",
    DD_MEMCPY_DEVICE_TO_HOST: "device-to-host",
    DD_MEMCPY_DEVICE_TO_DEVICE: "device-to-device",
}

#: True when the extension was built with LLM_DATADIST_DEBUG=1 (bounds checks, line tracing).
DEBUG_BUILD = bool(LLM_DATADIST_DEBUG)
#: The Cython version that generated this extension.
CYTHON_VERSION = LLM_DATADIST_CYTHON_VERSION.decode()

# The status codes as compiled from dd_status.h (tests compare them with llm_datadist.status); the
# table is generated into _status.pxd from the header by tools/status_table.py.
C_STATUS_CODES = _status.compiled_status_codes()

cdef uint64_t _ALIGNMENT = 64


cdef inline object _param_invalid(str message):
    return LLMException(message, status_code=LLMStatusCode.LLM_PARAM_INVALID)


# ------------------------------------------------------------------------------------------------
# Runtimes
# ------------------------------------------------------------------------------------------------

cdef int _host_set_device(void *ctx, int32_t device_id) noexcept nogil:
    return 0


cdef int _host_malloc(void *ctx, void **ptr, size_t size) noexcept nogil:
    cdef int rc = posix_memalign(ptr, _ALIGNMENT, size if size > 0 else 1)
    if rc == 0:
        # Host and cpu-runtime memory starts zeroed (acl/cuda device memory, like aclrtMalloc's,
        # is not initialised).
        memset(ptr[0], 0, size)
    return rc


cdef int _host_free(void *ctx, void *ptr) noexcept nogil:
    free(ptr)
    return 0


cdef inline uint64_t _distance(uint64_t a, uint64_t b) noexcept nogil:
    return a - b if a >= b else b - a


cdef inline void _host_copy(void *dst, const void *src, size_t count) noexcept nogil:
    # The ranges overlap when their starts are less than count apart (no end is computed: a
    # range may end at the top of the address space).
    if src == dst:
        return
    if _distance(<uint64_t>src, <uint64_t>dst) < count:
        memmove(dst, src, count)
    else:
        memcpy(dst, src, count)


cdef int _host_memcpy(void *ctx, void *dst, const void *src, size_t count, int kind) noexcept nogil:
    _host_copy(dst, src, count)
    return 0


cdef int _one_device(void *ctx, int *count) noexcept nogil:
    count[0] = 1
    return 0


cdef class Runtime:
    """A device runtime: a C function table (set_device, malloc, free, memcpy with kind,
    device_count) filled by one *binding* (host, acl, cuda), and the binding's capability bits.

    Obtain one with :func:`load_runtime`; runtimes are cached for the life of the process so the
    function pointers they hand out stay valid. ``name`` is the registry's name for the runtime
    (llm_datadist.runtimes), ``binding`` the binding that filled the table.
    """

    def __init__(self):
        raise TypeError("use llm_datadist._core.load_runtime(name) to obtain a Runtime")

    def set_device(self, int32_t device_id):
        """Bind the calling process to ``device_id``; raises LLMException on a runtime error."""
        cdef int rc
        with nogil:
            rc = self.table.set_device(self.table.ctx, device_id)
        if rc != 0:
            raise LLMException(f"{self.name}: set device {device_id} failed with error {rc}",
                               status_code=LLMStatusCode.LLM_FAILED)

    def device_count(self):
        """Number of devices the runtime reports (0 when the query fails)."""
        cdef int count = 0
        cdef int rc
        with nogil:
            rc = self.table.device_count(self.table.ctx, &count)
        return count if rc == 0 else 0

    @property
    def capabilities(self):
        """The binding's ``RUNTIME_*`` capability bits."""
        return self.table.capabilities

    @property
    def host_addressable(self):
        """Whether device memory of this runtime is plain memory the host may read and write."""
        return bool(self.table.capabilities & DD_RUNTIME_HOST_ADDRESSABLE)

    @property
    def async_copy(self):
        """Whether copies can be queued (``execute(..., wait=False)``) and waited for later."""
        return bool(self.table.capabilities & DD_RUNTIME_ASYNC_COPY)

    @property
    def batched_copy(self):
        """Whether a descriptor list becomes few driver calls (a kernel launch, a batch copy)."""
        return bool(self.table.capabilities & DD_RUNTIME_BATCHED_COPY)

    @property
    def ipc(self):
        """Whether device memory can be exported to, and mapped by, another process."""
        return bool(self.table.capabilities & DD_RUNTIME_IPC)

    @property
    def pinned_host(self):
        """Whether the runtime allocates page-locked host memory (``Allocation(pinned=True)``)."""
        return self.table.malloc_host != NULL

    def synchronize(self):
        """Wait for the copies this thread's device queued with ``execute(..., wait=False)``;
        a copy that failed raises ``LLMException(LLM_FAILED)`` here. No-op without async copies."""
        cdef int rc = 0
        if self.table.synchronize == NULL:
            return
        with nogil:
            rc = self.table.synchronize(self.table.ctx)
        if rc != 0:
            raise LLMException(f"{self.name}: waiting for queued copies failed with error {rc}",
                               status_code=LLMStatusCode.LLM_FAILED)

    def host_register(self, uint64_t addr, uint64_t nbytes):
        """Page-lock host memory ``[addr, addr + nbytes)`` for device copies; False where the
        runtime cannot or refuses (the memory stays usable, copies of it are slower)."""
        cdef int rc
        if self.table.host_register == NULL or addr == 0 or nbytes == 0:
            return False
        with nogil:
            rc = self.table.host_register(self.table.ctx, <void *>addr, nbytes)
        return rc == 0

    def host_unregister(self, uint64_t addr):
        """Undo ``host_register`` of the range starting at ``addr``."""
        if self.table.host_unregister != NULL and addr != 0:
            with nogil:
                self.table.host_unregister(self.table.ctx, <void *>addr)

    def ipc_export(self, uint64_t addr):
        """``(handle, offset, allocation bytes)``: the IPC handle of the device allocation that
        holds ``addr``, and where ``addr`` lies in it."""
        cdef dd_ipc_handle handle
        cdef uint64_t base = 0, size = 0
        cdef int rc
        if self.table.ipc_export == NULL:
            raise LLMException(f"{self.name}: device memory cannot be exported to other processes",
                               status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        with nogil:
            rc = self.table.ipc_export(self.table.ctx, <void *>addr, &handle, &base, &size)
        if rc != 0 or addr < base or addr - base >= size:
            raise LLMException(f"{self.name}: exporting device memory at {addr:#x} failed (error "
                               f"{rc})", status_code=LLMStatusCode.LLM_FAILED)
        return bytes(handle.bytes[:DD_IPC_HANDLE_BYTES]), addr - base, size

    def ipc_open(self, handle):
        """The base address here of a peer's exported allocation (mapped on the first open of a
        handle, reference-counted after); ``ipc_size(base)`` is how much was mapped."""
        cdef dd_ipc_handle h
        cdef void *base = NULL
        cdef uint64_t size = 0
        cdef int rc
        if self.table.ipc_open == NULL:
            raise LLMException(f"{self.name}: device memory of other processes cannot be mapped",
                               status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        key = bytes(handle)
        if len(key) != DD_IPC_HANDLE_BYTES:
            raise _param_invalid(f"an IPC handle has {DD_IPC_HANDLE_BYTES} bytes, got {len(key)}")
        # One lock for every runtime: links map on their own threads, and two first opens of one
        # handle must not both reach the runtime (nor a close run between a lookup and its use).
        with _IPC_LOCK:
            if self.ipc_maps is None:
                self.ipc_maps = {}
            entry = self.ipc_maps.get(key)
            if entry is not None:
                entry[1] += 1
                return entry[0]
            memcpy(h.bytes, <const char *>key, DD_IPC_HANDLE_BYTES)
            with nogil:
                rc = self.table.ipc_open(self.table.ctx, &h, &base, &size)
            if rc != 0 or base == NULL:
                raise LLMException(f"{self.name}: mapping a peer's device memory failed (error {rc})",
                                   status_code=LLMStatusCode.LLM_FAILED)
            self.ipc_maps[key] = [<uint64_t>base, 1, size]
            return <uint64_t>base

    def ipc_size(self, uint64_t base):
        """The size of the mapping ``ipc_open`` returned ``base`` for (0 if none is open)."""
        for entry in (self.ipc_maps or {}).values():
            if entry[0] == base:
                return entry[2]
        return 0

    def ipc_close(self, uint64_t base):
        """Drop one reference to a mapping ``ipc_open`` returned; unmapped at the last."""
        with _IPC_LOCK:
            if not self.ipc_maps:
                return
            for key, entry in self.ipc_maps.items():
                if entry[0] == base:
                    entry[1] -= 1
                    if entry[1] <= 0:
                        del self.ipc_maps[key]
                        with nogil:
                            self.table.ipc_close(self.table.ctx, <void *>base)
                    return

    @property
    def ipc_mapped(self):
        """How many peer allocations are mapped now (tests)."""
        return len(self.ipc_maps) if self.ipc_maps else 0

    def memcpy(self, uint64_t dst, uint64_t src, uint64_t nbytes, int kind):
        """Copy one range through the runtime (kind is a MEMCPY_* constant)."""
        cdef int rc
        if kind < DD_MEMCPY_HOST_TO_HOST or kind > DD_MEMCPY_DEVICE_TO_DEVICE:
            raise _param_invalid(f"memcpy kind {kind} is not one of 0..3")
        with nogil:
            rc = self.table.memcpy_kind(self.table.ctx, <void *>dst, <const void *>src,
                                        nbytes, kind)
        if rc != 0:
            raise LLMException(f"{self.name}: memcpy {MEMCPY_KIND_NAMES[kind]} of {nbytes} bytes "
                               f"failed with error {rc}", status_code=LLMStatusCode.LLM_FAILED)

    def __repr__(self):
        where = f" from {self.library}" if self.library else ""
        return f"<Runtime {self.name}{where}>"


#: Capability bits of a runtime table (dd_runtime_table.capabilities), by name.
RUNTIME_HOST_ADDRESSABLE = DD_RUNTIME_HOST_ADDRESSABLE
RUNTIME_ASYNC_COPY = DD_RUNTIME_ASYNC_COPY
RUNTIME_BATCHED_COPY = DD_RUNTIME_BATCHED_COPY
RUNTIME_IPC = DD_RUNTIME_IPC
CAPABILITIES = {
    "host_addressable": DD_RUNTIME_HOST_ADDRESSABLE,
    "async_copy": DD_RUNTIME_ASYNC_COPY,
    "batched_copy": DD_RUNTIME_BATCHED_COPY,
    "ipc": DD_RUNTIME_IPC,
}

cdef dict _RUNTIMES = {}
# Serializes Runtime.ipc_open / ipc_close (their reference counts and the runtime calls).
_IPC_LOCK = threading.Lock()

ctypedef int (*_bind_fn)(Runtime rt) except -1


cdef class _Binding:
    """One way of filling a runtime table: a C binder and whether it opens a shared library."""
    cdef readonly str name
    cdef readonly bint needs_library
    cdef _bind_fn bind


cdef dict _BINDINGS = {}


cdef _add_binding(str name, _bind_fn bind, bint needs_library):
    cdef _Binding binding = _Binding.__new__(_Binding)
    binding.name = name
    binding.needs_library = needs_library
    binding.bind = bind
    _BINDINGS[name] = binding


cdef void *_resolve(void *handle, str library, str symbol) except NULL:
    cdef bytes name = symbol.encode()
    dlerror()
    cdef void *fn = dlsym(handle, name)
    if fn == NULL:
        raise LLMException(f"{library} does not export {symbol}", status_code=LLMStatusCode.LLM_FAILED)
    return fn


cdef void *_binding_api(Runtime rt, size_t size) except NULL:
    """Zeroed storage for a binding's resolved entry points, owned by ``rt``: freed if the binding
    fails, kept for the life of the process once it succeeds (like the library handle)."""
    rt.api = calloc(1, size)
    if rt.api == NULL:
        raise MemoryError()
    return rt.api


cdef int _bind_host(Runtime rt) except -1:
    rt.table.set_device = _host_set_device
    rt.table.malloc_device = _host_malloc
    rt.table.free_device = _host_free
    rt.table.memcpy_kind = _host_memcpy
    rt.table.device_count = _one_device
    rt.table.capabilities = DD_RUNTIME_HOST_ADDRESSABLE
    return 0


_add_binding("host", _bind_host, False)

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    int pthread_mutex_init(pthread_mutex_t *mutex, const void *attr)
    int pthread_mutex_lock(pthread_mutex_t *mutex)
    int pthread_mutex_unlock(pthread_mutex_t *mutex)


cdef void *_optional(void *handle, str symbol) noexcept:
    """``symbol`` of the library ``handle``, or NULL where it does not export it."""
    cdef bytes name = symbol.encode()
    dlerror()
    return dlsym(handle, name)


# One file per vendor binding; each ends by registering itself with _add_binding.
include "runtimes/_rt_acl.pxi"
include "runtimes/_rt_cuda.pxi"


def bindings():
    """The names of the bindings this build of the core can fill a runtime table with."""
    return tuple(_BINDINGS)


cdef Runtime _new_runtime(str name, _Binding binding, str library):
    cdef Runtime rt = Runtime.__new__(Runtime)
    cdef bytes path
    cdef const char *err
    rt.name = name
    rt.binding = binding.name
    rt.library = library
    rt.table.ctx = NULL
    rt.table.device_count = _one_device
    rt.table.capabilities = 0
    if binding.needs_library:
        path = library.encode()
        rt.handle = dlopen(path, RTLD_NOW | RTLD_LOCAL)
        if rt.handle == NULL:
            err = dlerror()
            reason = err.decode(errors="replace") if err != NULL else "unknown error"
            raise LLMException(f"cannot load the {name} runtime library {library}: {reason}",
                               status_code=LLMStatusCode.LLM_FAILED)
    try:
        binding.bind(rt)
    except BaseException:
        free(rt.api)
        rt.api = NULL
        if rt.handle != NULL:
            dlclose(rt.handle)
            rt.handle = NULL
        raise
    # Once bound, the handle and the entry points are kept: allocations may still call into the
    # library at exit.
    return rt


def load_runtime(str name, library=None, binding=None):
    """Return the runtime ``name`` filled by ``binding`` (default: the binding called ``name``,
    one of :func:`bindings`), loading it on first use.

    Bindings that open a shared library (acl, cuda) need ``library``, its path; the runtime
    registry (llm_datadist.runtimes) supplies the default and the environment override. A library
    that cannot be opened, or that lacks one of the functions used, raises
    ``LLMException(LLM_FAILED)`` naming the library and the reason; an unknown binding or a
    missing library path raises ``LLMException(LLM_PARAM_INVALID)``.
    """
    binding_name = name if binding is None else binding
    found = _BINDINGS.get(binding_name) if isinstance(binding_name, str) else None
    if found is None:
        raise _param_invalid(f"unknown device runtime {name!r}: no binding {binding_name!r}; "
                             f"expected one of {', '.join(_BINDINGS)}")
    if not (<_Binding>found).needs_library:
        library = ""
    elif not library:
        raise _param_invalid(f"the {name} runtime needs the path of its shared library")
    else:
        library = str(library)
        if "\0" in library:
            raise _param_invalid(f"the {name} runtime library path {library!r} contains a NUL byte")
    key = (name, binding_name, library)
    rt = _RUNTIMES.get(key)
    if rt is None:
        rt = _new_runtime(name, <_Binding>found, library)
        _RUNTIMES[key] = rt
    return rt


# ------------------------------------------------------------------------------------------------
# Memory
# ------------------------------------------------------------------------------------------------

cdef class Allocation:
    """Memory owned by the library, freed through its runtime when the last reference goes."""

    def __init__(self, Runtime runtime not None, uint64_t nbytes, bint on_device, bint pinned=False):
        cdef void *ptr = NULL
        cdef int rc
        self.table = runtime.table
        # Host memory: page-locked from the runtime when asked and offered, else plain.
        self.pinned = not on_device and pinned and runtime.table.malloc_host != NULL
        if self.pinned:
            self.table.malloc_device = runtime.table.malloc_host
            self.table.free_device = runtime.table.free_host
        elif not on_device:
            self.table.malloc_device = _host_malloc
            self.table.free_device = _host_free
        with nogil:
            rc = self.table.malloc_device(self.table.ctx, &ptr, nbytes)
        if rc != 0 or ptr == NULL:
            status = (LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY if on_device
                      else LLMStatusCode.LLM_OUT_OF_MEMORY)
            raise LLMException(f"{runtime.name}: allocating {nbytes} bytes failed (error {rc})",
                               status_code=status)
        if self.pinned:
            memset(ptr, 0, nbytes)  # as plain host memory is
        self.addr = <uint64_t>ptr
        self.nbytes = nbytes
        self.on_device = on_device
        self.runtime = runtime

    def __dealloc__(self):
        if self.addr != 0:
            self.table.free_device(self.table.ctx, <void *>self.addr)
            self.addr = 0

    @property
    def host_addressable(self):
        return (not self.on_device) or self.runtime.host_addressable

    def __repr__(self):
        where = f"{self.runtime.name} device" if self.on_device else ("pinned host" if self.pinned else "host")
        return f"<Allocation {self.nbytes} bytes of {where} memory at {self.addr:#x}>"


cdef class HostRegion:
    """A writable buffer over host memory ``[addr, addr + nbytes)``; keeps ``owner`` alive."""

    def __init__(self, uint64_t addr, uint64_t nbytes, owner=None):
        if addr == 0 and nbytes != 0:
            raise _param_invalid("cannot view memory at address 0")
        self.addr = addr
        self.nbytes = nbytes
        self.owner = owner
        self.shape[0] = <Py_ssize_t>nbytes

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        buffer.buf = <void *>self.addr
        buffer.obj = self
        buffer.len = <Py_ssize_t>self.nbytes
        buffer.readonly = 0
        buffer.itemsize = 1
        buffer.format = "B"
        buffer.ndim = 1
        buffer.shape = self.shape
        buffer.strides = &buffer.itemsize
        buffer.suboffsets = NULL
        buffer.internal = NULL

    def __releasebuffer__(self, Py_buffer *buffer):
        pass

    def as_array(self, dtype, shape):
        """A zero-copy numpy array of ``dtype``/``shape`` over this region (keeps it alive)."""
        return np.frombuffer(self, dtype=np.uint8).view(dtype).reshape(shape)


# ------------------------------------------------------------------------------------------------
# Layouts and plans
# ------------------------------------------------------------------------------------------------

cdef class CacheLayout:
    """The geometry the planners check against: tensor base addresses, rows (or blocks) per tensor
    and the bytes of one row (the stride)."""

    def __cinit__(self, addrs, uint64_t num_rows, uint64_t row_bytes):
        cdef Py_ssize_t i, n = len(addrs)
        if n <= 0:
            raise _param_invalid("a cache needs at least one tensor address")
        if n > 0xFFFFFFFF:
            raise _param_invalid(f"too many tensors: {n}")
        if num_rows > 0 and row_bytes > UINT64_MAX // num_rows:
            raise _param_invalid(f"{num_rows} rows of {row_bytes} bytes overflow 64 bits")
        self.addrs = <uint64_t *>malloc(n * sizeof(uint64_t))
        if self.addrs == NULL:
            raise MemoryError()
        self.num_tensors = <uint32_t>n
        for i in range(n):
            self.addrs[i] = addrs[i]
        self.num_rows = num_rows
        self.row_bytes = row_bytes

    def __dealloc__(self):
        free(self.addrs)

    @property
    def tensor_addrs(self):
        return [self.addrs[i] for i in range(self.num_tensors)]

    @property
    def tensor_bytes(self):
        return self.num_rows * self.row_bytes

    def __repr__(self):
        return (f"CacheLayout(num_tensors={self.num_tensors}, num_rows={self.num_rows}, "
                f"row_bytes={self.row_bytes})")


cdef class CopyPlan:
    """A list of ``(src, dst, nbytes)`` copy descriptors produced by one of the planners."""

    def __cinit__(self):
        self.descs = NULL
        self.count = 0
        self.capacity = 0
        self.total_bytes = 0

    def __dealloc__(self):
        free(self.descs)

    cdef int reserve(self, size_t extra) except -1:
        cdef size_t wanted
        cdef dd_copy_desc *grown
        if extra > (<size_t>-1) // sizeof(dd_copy_desc) - self.count:
            raise _param_invalid(f"a transfer of {extra} descriptors is too large")
        wanted = self.count + extra
        if wanted <= self.capacity:
            return 0
        grown = <dd_copy_desc *>realloc(self.descs, wanted * sizeof(dd_copy_desc))
        if grown == NULL:
            raise MemoryError(f"cannot hold {wanted} copy descriptors")
        self.descs = grown
        self.capacity = wanted
        return 0

    cdef void add(self, uint64_t src, uint64_t dst, uint64_t nbytes) noexcept nogil:
        # Callers reserve first. A descriptor that continues the previous one on both sides is
        # merged into it, unless the merged ranges would overlap (then the copies must stay
        # separate and ordered, as the caller listed them).
        # Written without computing range ends, which wrap for a range that ends at 2**64: the
        # merged ranges are apart when their starts are at least their length apart.
        cdef dd_copy_desc *last
        cdef uint64_t apart
        self.total_bytes += nbytes
        if self.count > 0:
            last = &self.descs[self.count - 1]
            apart = _distance(last.src, last.dst)
            if (src >= last.src and src - last.src == last.nbytes
                    and dst >= last.dst and dst - last.dst == last.nbytes
                    and nbytes <= apart and last.nbytes <= apart - nbytes):
                last.nbytes += nbytes
                return
        self.descs[self.count].src = src
        self.descs[self.count].dst = dst
        self.descs[self.count].nbytes = nbytes
        self.count += 1

    def __len__(self):
        return self.count

    def descriptors(self):
        """The descriptors as a new ``(n, 3)`` uint64 array of ``src, dst, nbytes``."""
        out = np.empty((self.count, 3), dtype=np.uint64)
        cdef uint64_t[:, ::1] view = out
        cdef size_t i
        for i in range(self.count):
            view[i, 0] = self.descs[i].src
            view[i, 1] = self.descs[i].dst
            view[i, 2] = self.descs[i].nbytes
        return out

    def __repr__(self):
        return f"<CopyPlan {self.count} descriptors, {self.total_bytes} bytes>"


cdef inline bint _is_int(object value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


cdef uint64_t _as_uint64(object value, str name) except? 0:
    if not _is_int(value) or value < 0 or value > UINT64_MAX:
        raise _param_invalid(f"{name} {value!r} must be an integer in [0, 2**64)")
    return <uint64_t>value


cdef int64_t _as_int64(object value, str name) except? -1:
    if not _is_int(value) or value < -2**63 or value >= 2**63:
        raise _param_invalid(f"{name} {value!r} must be an integer in [-2**63, 2**63)")
    return <int64_t>value


cdef inline cnp.int64_t *_i64(object arr):
    # The data of a C-contiguous int64 array made by the helpers below (no buffer acquisition:
    # it costs more than the planning of a short list).
    return <cnp.int64_t *>cnp.PyArray_DATA(<cnp.ndarray>arr)


cdef object _as_index_array(object values, str name):
    """``values`` as a C-contiguous int64 array (a copy only when needed); every entry must be an
    integer in int64 range, else LLM_PARAM_INVALID naming the first bad entry."""
    cdef Py_ssize_t i, n
    cdef cnp.int64_t *out
    if type(values) is list or type(values) is tuple:
        # Fast path for the short lists of the latency-bound calls: exact ints only.
        n = len(values)
        if n <= 64:
            arr = np.empty(n, dtype=np.int64)
            out = _i64(arr)
            for i in range(n):
                value = values[i]
                if type(value) is not int or not -2**63 <= value < 2**63:
                    break
                out[i] = value
            else:
                return arr
    arr = values if isinstance(values, np.ndarray) else None
    if arr is None or arr.dtype.kind not in "iu":
        try:
            arr = np.asarray(values)
        except (OverflowError, ValueError, TypeError) as exc:
            raise _param_invalid(f"{name} must be a sequence of integers: {exc}") from None
    if arr.size and (arr.dtype.kind not in "iu" or (arr.dtype.kind == "u" and arr.max() > 2**63 - 1)):
        for i, value in enumerate(values):
            if not _is_int(value) or not -2**63 <= value < 2**63:
                raise _param_invalid(f"{name}[{i}] = {value!r} is not an integer in int64 range")
        raise _param_invalid(f"{name} must be a sequence of integers in int64 range")
    try:
        arr = np.ascontiguousarray(arr, dtype=np.int64)
    except (OverflowError, ValueError, TypeError) as exc:
        raise _param_invalid(f"{name} must be a sequence of integers in int64 range: {exc}") from None
    if arr.ndim != 1:
        raise _param_invalid(f"{name} must be one-dimensional, got shape {arr.shape}")
    return arr


cdef inline Py_ssize_t _first_out_of_range(cnp.int64_t *values, Py_ssize_t n,
                                           uint64_t limit) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        if values[i] < 0 or <uint64_t>values[i] >= limit:
            return i
    return -1


# ------------------------------------------------------------------------------------------------
# Block lists
# ------------------------------------------------------------------------------------------------

#: How :func:`as_block_array` reports a bad block list: every error as LLM_PARAM_INVALID (the
#: core's own contract, and the C++-style API's), or with the CANN Python API's classes and
#: wording (TypeError for a wrong container or element type, ValueError for a value outside
#: uint64), as its ``check_isinstance``/``check_uint64`` word them.
BLOCK_ERRORS_STATUS = BLOCK_ERRORS_STATUS_C
BLOCK_ERRORS_CANN = BLOCK_ERRORS_CANN_C


cdef inline cnp.uint64_t *_u64(object arr):
    return <cnp.uint64_t *>cnp.PyArray_DATA(<cnp.ndarray>arr)


cdef inline bint _is_block_array(object values):
    # What block_array returns: a 1-D C-contiguous uint64 array (taken as it is).
    return (type(values) is np.ndarray and cnp.PyArray_TYPE(<cnp.ndarray>values) == cnp.NPY_UINT64
            and cnp.PyArray_NDIM(<cnp.ndarray>values) == 1
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>values))


cdef int _block_error(object values, str name, int errors) except -1:
    """Raise the error for the first bad element of ``values`` (the slow path, after the fast
    conversion failed). CANN's checks run in its order: every element's type, then each range."""
    if errors == BLOCK_ERRORS_CANN_C:
        for value in values:
            if not _is_int(value):
                raise TypeError(f"{name} inner type only support [{int!r}], but got {type(value)}.")
        for value in values:
            if value < 0 or value > UINT64_MAX:
                raise ValueError(f"{name}'s value is out of range,{value} is not a uint64 value.")
    else:
        for i, value in enumerate(values):
            if not _is_int(value) or value < 0 or value > UINT64_MAX:
                raise _param_invalid(f"{name}[{i}] = {value!r} is not an integer in [0, 2**64)")
    raise _param_invalid(f"{name} must be a sequence of integers in [0, 2**64)")


cdef object _list_to_blocks(object values, str name, int errors):
    cdef Py_ssize_t i, n = len(values)
    cdef cnp.npy_intp dims[1]
    dims[0] = n
    arr = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT64, 0)
    cdef cnp.uint64_t *out = _u64(arr)
    cdef object value
    try:
        for i in range(n):
            value = values[i]
            if type(value) is not int and not _is_int(value):
                break
            out[i] = value  # OverflowError below 0 or above UINT64_MAX
        else:
            return arr
    except OverflowError:
        pass
    _block_error(values, name, errors)


cdef object block_array(object values, str name, int errors):
    """``values`` (a list or tuple of ints or numpy integers, or a 1-D integer numpy array) as a
    new 1-D C-contiguous uint64 array, every element checked to be an integer (not a bool) in
    [0, 2**64). The one place a block list is read element by element; ``errors`` is
    BLOCK_ERRORS_STATUS or BLOCK_ERRORS_CANN (see there)."""
    cdef cnp.ndarray array
    if type(values) is list or type(values) is tuple:
        return _list_to_blocks(values, name, errors)
    if isinstance(values, np.ndarray):
        array = <cnp.ndarray>values
        if array.ndim != 1:
            raise _param_invalid(f"{name} must be one-dimensional, got shape {values.shape}")
        if array.dtype.kind not in "iu":
            if errors == BLOCK_ERRORS_CANN_C:
                raise TypeError(f"{name} inner type only support [{int!r}], but got {array.dtype}.")
            raise _param_invalid(f"{name} must hold integers, got dtype {array.dtype}")
        if array.dtype.kind == "i" and array.shape[0] > 0 and array.min() < 0:
            _block_error(values, name, errors)
        return np.ascontiguousarray(values, dtype=np.uint64)
    if errors == BLOCK_ERRORS_CANN_C:
        raise TypeError(f"{name} only support ['list', 'tuple'], but got {type(values)}.")
    try:
        listed = list(values)
    except TypeError:
        raise _param_invalid(f"{name} must be a sequence of integers, got "
                             f"{type(values).__name__}") from None
    return _list_to_blocks(listed, name, errors)


def as_block_array(values, str name="blocks", int errors=BLOCK_ERRORS_STATUS_C):
    """A block list as the planners take it: see ``block_array`` (a uint64 array already in that
    form is returned as it is). The planners convert what they are given the same way, so the
    API layers call this once and hand the array down."""
    if _is_block_array(values):
        return values
    return block_array(values, name, errors)


cdef object _blocks_from_map(dict mapping, bint one_to_many):
    cdef Py_ssize_t n = 0, k = 0, i, m
    cdef cnp.npy_intp dims[1]
    cdef object src, dsts, value
    if one_to_many:
        for dsts in mapping.values():
            if type(dsts) is not list:
                return None
            n += len(dsts)
    else:
        n = len(mapping)
    dims[0] = n
    src_arr = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT64, 0)
    dst_arr = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT64, 0)
    cdef cnp.uint64_t *sv = _u64(src_arr)
    cdef cnp.uint64_t *dv = _u64(dst_arr)
    try:
        for src, dsts in mapping.items():
            if type(src) is not int:
                return None
            if not one_to_many:
                if type(dsts) is not int:
                    return None
                sv[k] = src
                dv[k] = dsts
                k += 1
                continue
            m = len(dsts)
            if k + m > n:
                return None  # the lists changed while being read
            for i in range(m):
                value = dsts[i]
                if type(value) is not int:
                    return None
                sv[k] = src
                dv[k] = value
                k += 1
    except OverflowError:
        return None
    if k != n:
        return None
    return src_arr, dst_arr


def block_map_arrays(mapping, bint one_to_many=False):
    """``(src, dst)`` block arrays of a ``{src: dst}`` dict (``one_to_many``: ``{src: [dst, ...]}``,
    src repeated for each of its destinations, in dict order), or None when any key or value is
    not a plain int in [0, 2**64) (the caller then checks the dict its own way)."""
    if type(mapping) is not dict:
        return None
    return _blocks_from_map(<dict>mapping, one_to_many)


cdef object _checked_blocks(object values, uint64_t limit, str name):
    """Block array for ``values`` (None = all of ``range(limit)``), each block checked in
    [0, limit) (the blocks of the cache)."""
    if values is None:
        return np.arange(limit, dtype=np.uint64)
    arr = values if _is_block_array(values) else block_array(values, name, BLOCK_ERRORS_STATUS_C)
    cdef cnp.uint64_t *view = _u64(arr)
    cdef Py_ssize_t i, bad = -1, n = arr.shape[0]
    with nogil:
        for i in range(n):
            if view[i] >= limit:
                bad = i
                break
    if bad >= 0:
        raise _param_invalid(f"{name}[{bad}] = {arr[bad]} is out of range: the cache has "
                             f"{limit} blocks (valid: 0..{limit - 1 if limit else 'none'})")
    return arr


cdef dict _ALL_INDICES = {}


cdef object _all_indices(uint64_t limit):
    # "All tensors" is asked for on every transfer without layer ranges: keep one read-only
    # arange per small count instead of building it each time.
    arr = _ALL_INDICES.get(limit)
    if arr is None:
        arr = np.arange(limit, dtype=np.int64)
        if limit <= 4096:
            arr.flags.writeable = False
            _ALL_INDICES[limit] = arr
    return arr


cdef object _checked_indices(object values, uint64_t limit, str name, str what):
    """Index array for ``values`` (None = all of ``range(limit)``), each checked in [0, limit)."""
    if values is None:
        return _all_indices(limit)
    arr = _as_index_array(values, name)
    cdef cnp.int64_t *view = _i64(arr)
    cdef Py_ssize_t bad = -1, n = arr.shape[0]
    if n > 0:
        with nogil:
            bad = _first_out_of_range(view, n, limit)
    if bad >= 0:
        raise _param_invalid(f"{name}[{bad}] = {arr[bad]} is out of range: the cache has "
                             f"{limit} {what} (valid: 0..{limit - 1 if limit else 'none'})")
    return arr


cdef object _tensor_pairs(CacheLayout src, CacheLayout dst, src_tensors, dst_tensors):
    s = _checked_indices(src_tensors, src.num_tensors, "src tensor index", "tensors")
    d = _checked_indices(dst_tensors, dst.num_tensors, "dst tensor index", "tensors")
    if s.shape[0] != d.shape[0]:
        raise _param_invalid(f"source selects {s.shape[0]} tensors but destination selects "
                             f"{d.shape[0]}; they must match one to one")
    if s.shape[0] == 0:
        raise _param_invalid("no tensor selected")
    return s, d


def plan_blocks(CacheLayout src not None, CacheLayout dst not None, src_tensors, dst_tensors,
                src_blocks, dst_blocks, nbytes_arg=-1, src_offset_arg=0, dst_offset_arg=0):
    """Plan block copies: for each selected tensor pair ``(s, d)`` and each ``k``, copy ``nbytes``
    from ``src_offset`` bytes into block ``src_blocks[k]`` of tensor ``s`` to ``dst_offset``
    bytes into block ``dst_blocks[k]`` of tensor ``d``.

    ``src_tensors``/``dst_tensors``: tensor indices (None = all). ``nbytes`` -1 = the source
    block size after ``src_offset``; each range must lie inside its block. Raises
    ``LLMException(LLM_PARAM_INVALID)`` naming the first bad value; nothing is planned then.
    """
    cdef uint64_t soff = _as_uint64(src_offset_arg, "source offset")
    cdef uint64_t doff = _as_uint64(dst_offset_arg, "destination offset")
    cdef int64_t nbytes = _as_int64(nbytes_arg, "nbytes")
    st, dt = _tensor_pairs(src, dst, src_tensors, dst_tensors)
    sb = _checked_blocks(src_blocks, src.num_rows, "src_blocks")
    db = _checked_blocks(dst_blocks, dst.num_rows, "dst_blocks")
    if sb.shape[0] != db.shape[0]:
        raise _param_invalid(f"src_blocks has {sb.shape[0]} entries but dst_blocks has "
                             f"{db.shape[0]}; they must have the same length")
    if soff >= src.row_bytes:
        raise _param_invalid(f"source offset {soff} is outside the source block of {src.row_bytes} bytes")
    if doff >= dst.row_bytes:
        raise _param_invalid(f"destination offset {doff} is outside the destination block of "
                             f"{dst.row_bytes} bytes")
    if nbytes == -1:
        nbytes = <int64_t>(src.row_bytes - soff)
    if nbytes <= 0 or <uint64_t>nbytes > src.row_bytes - soff or <uint64_t>nbytes > dst.row_bytes - doff:
        raise _param_invalid(f"block copy size {nbytes} must be in [1, min(src block "
                             f"{src.row_bytes} - offset {soff}, dst block {dst.row_bytes} - offset {doff})]")
    cdef CopyPlan plan = CopyPlan()
    cdef Py_ssize_t nt = st.shape[0], nb = sb.shape[0]
    if nb == 0:
        return plan
    if nt > 0 and <size_t>nb > (<size_t>-1) // <size_t>nt:
        raise _param_invalid("too many descriptors")
    plan.reserve(<size_t>nt * <size_t>nb)
    cdef cnp.int64_t *stv = _i64(st)
    cdef cnp.int64_t *dtv = _i64(dt)
    cdef cnp.uint64_t *sbv = _u64(sb)
    cdef cnp.uint64_t *dbv = _u64(db)
    cdef Py_ssize_t t, k
    cdef uint64_t sbase, dbase, n = <uint64_t>nbytes
    cdef uint64_t sstride = src.row_bytes, dstride = dst.row_bytes
    with nogil:
        for t in range(nt):
            sbase = src.addrs[stv[t]] + soff
            dbase = dst.addrs[dtv[t]] + doff
            for k in range(nb):
                plan.add(sbase + sbv[k] * sstride, dbase + dbv[k] * dstride, n)
    return plan


cdef object _checked_regions(object regions, uint64_t small):
    """``regions`` (``(offset, nbytes, runs)`` triples in a small block) as a ``(k, 3)`` uint64
    array: each inside the block, ``nbytes`` > 0 a whole multiple of ``runs`` > 0, in order of
    offset and disjoint; LLM_PARAM_INVALID naming the first bad value otherwise."""
    try:
        items = list(regions)
    except TypeError:
        raise _param_invalid(f"regions must be a sequence of (offset, nbytes, runs), got {type(regions).__name__}")
    if not items:
        raise _param_invalid("regions must name at least one (offset, nbytes, runs)")
    out = np.empty((len(items), 3), dtype=np.uint64)
    cdef uint64_t offset, nbytes, runs, end = 0
    cdef Py_ssize_t k
    for k, item in enumerate(items):
        try:
            offset_arg, nbytes_arg, runs_arg = item
        except (TypeError, ValueError):
            raise _param_invalid(f"regions[{k}] = {item!r} is not an (offset, nbytes, runs) triple")
        offset = _as_uint64(offset_arg, f"regions[{k}] offset")
        nbytes = _as_uint64(nbytes_arg, f"regions[{k}] nbytes")
        runs = _as_uint64(runs_arg, f"regions[{k}] runs")
        if offset < end:
            raise _param_invalid(f"regions[{k}] offset {offset} overlaps the region before it (which ends at {end})")
        if nbytes == 0 or offset > small or nbytes > small - offset:
            raise _param_invalid(f"regions[{k}] nbytes {nbytes} from offset {offset} is outside the smaller "
                                 f"block of {small} bytes")
        if runs == 0 or nbytes % runs != 0:
            raise _param_invalid(f"regions[{k}] runs {runs} must divide its {nbytes} bytes")
        out[k, 0], out[k, 1], out[k, 2] = offset, nbytes, runs
        end = offset + nbytes
    return out


def plan_sub_blocks(CacheLayout src not None, CacheLayout dst not None, src_tensors, dst_tensors,
                    src_blocks, dst_blocks, regions, first_arg=0):
    """Plan copies between caches whose blocks hold different token counts: the blocks of one
    side (the large one) are ``ratio`` times the bytes of the other's (the small one's). A small
    block is ``regions``, each ``(offset, nbytes, runs)``: ``nbytes`` bytes from ``offset``, made of
    ``runs`` equal runs of tokens in order; in a large block the same region lies at ``ratio *
    offset``, ``ratio`` times as long, its runs ``ratio`` times as long (a KV head's keys, or one
    dimension of them, for all the block's tokens). So small block ``i`` is, run by run, sub-block
    ``(first + i) % ratio`` of large block ``(first + i) // ratio``, where ``i`` counts the small
    side's list and the large side's list names ``ceil((first + n) / ratio)`` blocks for ``n``
    small ones: ``n * sum(runs)`` copies per tensor pair.

    Which side is large is told by the block sizes; equal sizes are ratio 1. ``first`` in
    ``[0, ratio)``: the sub-block of the first large block the list starts at (a prefix that
    ends inside a large block). Regions must lie in the small block, in order of offset, without
    overlap. Raises ``LLMException(LLM_PARAM_INVALID)`` naming the first bad value (sizes that are
    no multiple, a bad region, a list of the wrong length, a block out of range); nothing is
    planned then.
    """
    cdef uint64_t first = _as_uint64(first_arg, "first sub-block")
    cdef bint src_large = src.row_bytes > dst.row_bytes
    cdef uint64_t large = src.row_bytes if src_large else dst.row_bytes
    cdef uint64_t small = dst.row_bytes if src_large else src.row_bytes
    st, dt = _tensor_pairs(src, dst, src_tensors, dst_tensors)
    if small == 0 or large % small != 0:
        raise _param_invalid(f"blocks of {src.row_bytes} and {dst.row_bytes} bytes: the larger must be a "
                             "whole multiple of the smaller")
    cdef uint64_t ratio = large // small
    reg = _checked_regions(regions, small)
    if first >= ratio:
        raise _param_invalid(f"first sub-block {first} is out of range: a block holds {ratio}")
    sb = _checked_blocks(src_blocks, src.num_rows, "src_blocks")
    db = _checked_blocks(dst_blocks, dst.num_rows, "dst_blocks")
    small_list, large_list = (db, sb) if src_large else (sb, db)
    cdef Py_ssize_t n = small_list.shape[0], m = large_list.shape[0]
    cdef uint64_t wanted = (first + <uint64_t>n - 1) // ratio + 1 if n > 0 else 0  # (first < ratio: no wrap)
    if <uint64_t>m != wanted:
        raise _param_invalid(f"{'src' if src_large else 'dst'}_blocks has {m} entries; {n} blocks of "
                             f"{small} bytes from sub-block {first} on fill {wanted} of {large} bytes")
    cdef CopyPlan plan = CopyPlan()
    cdef Py_ssize_t nt = st.shape[0], nr = reg.shape[0]
    if n == 0:
        return plan
    # (disjoint regions of at least one byte a run: at most ``small`` runs in all)
    cdef uint64_t total_runs = <uint64_t>reg[:, 2].sum()
    if <uint64_t>n > UINT64_MAX // total_runs or <size_t>(<uint64_t>n * total_runs) > (<size_t>-1) // <size_t>nt:
        raise _param_invalid("too many descriptors")
    plan.reserve(<size_t>nt * <size_t>(<uint64_t>n * total_runs))
    cdef cnp.int64_t *stv = _i64(st)
    cdef cnp.int64_t *dtv = _i64(dt)
    cdef cnp.uint64_t *smv = _u64(small_list)
    cdef cnp.uint64_t *lgv = _u64(large_list)
    cdef cnp.uint64_t *rv = _u64(reg)
    cdef uint64_t sbase, lbase, at, s_addr, l_addr, r, piece, offset, runs
    cdef Py_ssize_t t, i, k
    with nogil:
        for t in range(nt):
            sbase = (dst.addrs[dtv[t]] if src_large else src.addrs[stv[t]])
            lbase = (src.addrs[stv[t]] if src_large else dst.addrs[dtv[t]])
            for i in range(n):
                at = first + <uint64_t>i
                for k in range(nr):
                    offset, runs = rv[3 * k], rv[3 * k + 2]
                    piece = rv[3 * k + 1] // runs
                    s_addr = sbase + smv[i] * small + offset
                    l_addr = lbase + lgv[at // ratio] * large + offset * ratio + (at % ratio) * piece
                    for r in range(runs):
                        if src_large:
                            plan.add(l_addr + r * piece * ratio, s_addr + r * piece, piece)
                        else:
                            plan.add(s_addr + r * piece, l_addr + r * piece * ratio, piece)
    return plan


cdef object _checked_strides(object regions, uint64_t src_bytes, uint64_t dst_bytes):
    """``regions`` (``(src_offset, src_stride, dst_offset, dst_stride, piece, count)`` in a block of
    each side) as a ``(k, 6)`` uint64 array: ``piece`` and ``count`` > 0, each side's last run
    inside its block; LLM_PARAM_INVALID naming the first bad value otherwise."""
    try:
        items = list(regions)
    except TypeError:
        raise _param_invalid(f"regions must be a sequence of (src_offset, src_stride, dst_offset, dst_stride, "
                             f"piece, count), got {type(regions).__name__}")
    if not items:
        raise _param_invalid("regions must name at least one strided region")
    out = np.empty((len(items), 6), dtype=np.uint64)
    names = ("src_offset", "src_stride", "dst_offset", "dst_stride", "piece", "count")
    cdef Py_ssize_t k, j
    for k, item in enumerate(items):
        try:
            values = tuple(item)
        except TypeError:
            values = ()
        if len(values) != 6:
            raise _param_invalid(f"regions[{k}] = {item!r} is not (src_offset, src_stride, dst_offset, dst_stride, "
                                 "piece, count)")
        got = [_as_uint64(values[j], f"regions[{k}] {names[j]}") for j in range(6)]
        if got[4] == 0 or got[5] == 0:
            raise _param_invalid(f"regions[{k}] piece {got[4]} and count {got[5]} must be > 0")
        # (Python integers: no wrap) the last run of each side must end inside its block
        for side, offset, stride, limit in (("source", got[0], got[1], src_bytes),
                                            ("destination", got[2], got[3], dst_bytes)):
            if offset + (got[5] - 1) * stride + got[4] > limit:
                raise _param_invalid(f"regions[{k}]: {got[5]} runs of {got[4]} bytes from offset {offset} every "
                                     f"{stride} bytes end outside the {side} block of {limit} bytes")
        for j in range(6):
            out[k, j] = got[j]
    return out


def plan_strided_blocks(CacheLayout src not None, CacheLayout dst not None, src_tensors, dst_tensors,
                        src_blocks, dst_blocks, regions):
    """Plan copies between blocks that hold the same bytes in another order (a vLLM KV cache of
    ``[tokens, heads, C]`` blocks and one of ``[heads, tokens, C]``): for each selected tensor pair
    and each ``k``, every region ``(src_offset, src_stride, dst_offset, dst_stride, piece, count)``
    copies ``count`` runs of ``piece`` bytes, run ``r`` from ``src_offset + r * src_stride`` bytes
    into block ``src_blocks[k]`` to ``dst_offset + r * dst_stride`` bytes into block
    ``dst_blocks[k]``: ``len(blocks) * sum(count)`` copies per tensor pair. The two block sizes
    may differ; each region's runs must lie inside their blocks. Raises
    ``LLMException(LLM_PARAM_INVALID)`` naming the first bad value (a run outside a block, lists
    of different lengths, a block out of range); nothing is planned then.
    """
    st, dt = _tensor_pairs(src, dst, src_tensors, dst_tensors)
    reg = _checked_strides(regions, src.row_bytes, dst.row_bytes)
    sb = _checked_blocks(src_blocks, src.num_rows, "src_blocks")
    db = _checked_blocks(dst_blocks, dst.num_rows, "dst_blocks")
    if sb.shape[0] != db.shape[0]:
        raise _param_invalid(f"src_blocks has {sb.shape[0]} entries but dst_blocks has "
                             f"{db.shape[0]}; they must have the same length")
    cdef CopyPlan plan = CopyPlan()
    cdef Py_ssize_t nt = st.shape[0], nb = sb.shape[0], nr = reg.shape[0]
    if nb == 0:
        return plan
    cdef uint64_t total_runs = <uint64_t>reg[:, 5].sum()
    if total_runs > UINT64_MAX // <uint64_t>nb or \
            <size_t>(<uint64_t>nb * total_runs) > (<size_t>-1) // <size_t>nt:
        raise _param_invalid("too many descriptors")
    plan.reserve(<size_t>nt * <size_t>(<uint64_t>nb * total_runs))
    cdef cnp.int64_t *stv = _i64(st)
    cdef cnp.int64_t *dtv = _i64(dt)
    cdef cnp.uint64_t *sbv = _u64(sb)
    cdef cnp.uint64_t *dbv = _u64(db)
    cdef cnp.uint64_t *rv = _u64(reg)
    cdef uint64_t s_addr, d_addr, r
    cdef Py_ssize_t t, i, k
    with nogil:
        for t in range(nt):
            for i in range(nb):
                for k in range(nr):
                    s_addr = src.addrs[stv[t]] + sbv[i] * src.row_bytes + rv[6 * k]
                    d_addr = dst.addrs[dtv[t]] + dbv[i] * dst.row_bytes + rv[6 * k + 2]
                    for r in range(rv[6 * k + 5]):
                        plan.add(s_addr + r * rv[6 * k + 1], d_addr + r * rv[6 * k + 3], rv[6 * k + 4])
    return plan


def plan_rows(CacheLayout src not None, CacheLayout dst not None, src_tensors, dst_tensors,
              src_row_arg, dst_row_arg, src_offset_arg=0, dst_offset_arg=0, size_arg=-1):
    """Plan row copies of a contiguous cache: for each selected tensor pair, copy ``size`` bytes
    from ``src_row``/``src_offset`` to ``dst_row``/``dst_offset``.

    ``size`` -1 = the rest of the source row after ``src_offset``. Both ranges must lie inside
    their rows; rows must exist. Raises ``LLMException(LLM_PARAM_INVALID)`` otherwise.
    """
    cdef uint64_t src_row = _as_uint64(src_row_arg, "source batch index")
    cdef uint64_t dst_row = _as_uint64(dst_row_arg, "destination batch index")
    cdef uint64_t src_offset = _as_uint64(src_offset_arg, "source offset")
    cdef uint64_t dst_offset = _as_uint64(dst_offset_arg, "destination offset")
    cdef int64_t size = _as_int64(size_arg, "size")
    st, dt = _tensor_pairs(src, dst, src_tensors, dst_tensors)
    if src_row >= src.num_rows:
        raise _param_invalid(f"source batch index {src_row} is out of range: the cache has "
                             f"{src.num_rows} rows")
    if dst_row >= dst.num_rows:
        raise _param_invalid(f"destination batch index {dst_row} is out of range: the cache has "
                             f"{dst.num_rows} rows")
    if src_offset >= src.row_bytes:
        raise _param_invalid(f"offset {src_offset} is outside the source row of {src.row_bytes} bytes")
    if size == -1:
        size = <int64_t>(src.row_bytes - src_offset)
    if size <= 0:
        raise _param_invalid(f"size {size} must be -1 or > 0")
    if <uint64_t>size > src.row_bytes - src_offset:
        raise _param_invalid(f"offset {src_offset} + size {size} exceeds the source row of "
                             f"{src.row_bytes} bytes")
    if dst_offset >= dst.row_bytes or <uint64_t>size > dst.row_bytes - dst_offset:
        raise _param_invalid(f"offset {dst_offset} + size {size} exceeds the destination row of "
                             f"{dst.row_bytes} bytes")
    cdef CopyPlan plan = CopyPlan()
    cdef Py_ssize_t nt = st.shape[0], t
    plan.reserve(<size_t>nt)
    cdef cnp.int64_t *stv = _i64(st)
    cdef cnp.int64_t *dtv = _i64(dt)
    cdef uint64_t soff = src_row * src.row_bytes + src_offset
    cdef uint64_t doff = dst_row * dst.row_bytes + dst_offset
    with nogil:
        for t in range(nt):
            plan.add(src.addrs[stv[t]] + soff, dst.addrs[dtv[t]] + doff, <uint64_t>size)
    return plan


def plan_row_to_blocks(CacheLayout src not None, CacheLayout dst not None, src_tensors,
                       dst_tensors, src_row_arg, dst_blocks):
    """Plan a contiguous row scattered into blocks: chunk ``k`` of source row ``src_row`` (one
    destination block long; the last chunk may be shorter) goes to block ``dst_blocks[k]``.

    Every chunk must start inside the row. Raises ``LLMException(LLM_PARAM_INVALID)`` otherwise.
    """
    cdef uint64_t src_row = _as_uint64(src_row_arg, "source batch index")
    st, dt = _tensor_pairs(src, dst, src_tensors, dst_tensors)
    if src_row >= src.num_rows:
        raise _param_invalid(f"source batch index {src_row} is out of range: the cache has "
                             f"{src.num_rows} rows")
    db = _checked_blocks(dst_blocks, dst.num_rows, "dst_blocks")
    cdef Py_ssize_t nb = db.shape[0], nt = st.shape[0], t, k
    cdef uint64_t block = dst.row_bytes, row = src.row_bytes
    if block == 0 or <uint64_t>nb > (row + block - 1) // block:
        raise _param_invalid(f"{nb} destination blocks of {block} bytes do not fit a source row "
                             f"of {row} bytes")
    cdef CopyPlan plan = CopyPlan()
    if nb == 0:
        return plan
    plan.reserve(<size_t>nt * <size_t>nb)
    cdef cnp.int64_t *stv = _i64(st)
    cdef cnp.int64_t *dtv = _i64(dt)
    cdef cnp.uint64_t *dbv = _u64(db)
    cdef uint64_t sbase, dbase, chunk
    with nogil:
        for t in range(nt):
            sbase = src.addrs[stv[t]] + src_row * row
            dbase = dst.addrs[dtv[t]]
            for k in range(nb):
                chunk = row - <uint64_t>k * block
                if chunk > block:
                    chunk = block
                plan.add(sbase + <uint64_t>k * block, dbase + dbv[k] * block, chunk)
    return plan


# ------------------------------------------------------------------------------------------------
# Layer ranges
# ------------------------------------------------------------------------------------------------

cdef int _check_tensor_num_per_layer(object tensor_num_per_layer, uint64_t num_tensors) except -1:
    if isinstance(tensor_num_per_layer, bool) or not isinstance(tensor_num_per_layer, int):
        raise _param_invalid(f"tensor_num_per_layer must be an int, got {tensor_num_per_layer!r}")
    if tensor_num_per_layer < 1 or tensor_num_per_layer > num_tensors:
        raise _param_invalid(f"tensor_num_per_layer {tensor_num_per_layer} must be in "
                             f"[1, {num_tensors}] (the number of tensors of the cache)")
    if tensor_num_per_layer != 2 and num_tensors % tensor_num_per_layer != 0:
        raise _param_invalid(f"tensor_num_per_layer {tensor_num_per_layer} must divide the "
                             f"number of tensors {num_tensors}")
    return 0


def layer_range_to_tensor_indices(layer_range, uint64_t num_tensors, tensor_num_per_layer=2):
    """Tensor indices of a Python half-open layer ``range`` (step 1; None = all layers).

    Layer ``l`` is tensors ``[l*N, (l+1)*N)`` with ``N = tensor_num_per_layer``.
    """
    _check_tensor_num_per_layer(tensor_num_per_layer, num_tensors)
    cdef uint64_t n = tensor_num_per_layer
    cdef uint64_t num_layers = num_tensors // n
    if layer_range is None:
        return list(range(num_layers * n))
    if not isinstance(layer_range, range):
        raise _param_invalid(f"layer range must be a range, got {type(layer_range).__name__}")
    if layer_range.step != 1:
        raise _param_invalid(f"layer range {layer_range} must have step 1")
    if layer_range.start < 0 or layer_range.start >= layer_range.stop:
        raise _param_invalid(f"layer range {layer_range} must satisfy 0 <= start < stop")
    if layer_range.stop > num_layers:
        raise _param_invalid(f"layer range {layer_range} exceeds the {num_layers} layers of a "
                             f"cache of {num_tensors} tensors with {n} tensors per layer")
    return list(range(layer_range.start * n, layer_range.stop * n))


def inclusive_layer_range_to_tensor_indices(layer_range, uint64_t num_tensors,
                                            tensor_num_per_layer=2):
    """Tensor indices of a C++ inclusive layer pair ``(first, second)``; ``(-1, -1)`` = all layers.

    Each value must lie in ``[0, num_tensors / tensor_num_per_layer - 1]`` and first <= second.
    """
    _check_tensor_num_per_layer(tensor_num_per_layer, num_tensors)
    cdef uint64_t n = tensor_num_per_layer
    cdef int64_t max_layer = <int64_t>(num_tensors // n) - 1
    try:
        first, second = layer_range
    except (TypeError, ValueError):
        raise _param_invalid(f"layer range must be a pair of ints, got {layer_range!r}") from None
    if not (_is_int(first) and _is_int(second)):
        raise _param_invalid(f"layer range must be a pair of ints, got {layer_range!r}")
    first, second = int(first), int(second)
    if first == -1 and second == -1:
        return list(range((max_layer + 1) * n))
    if first < 0 or second < 0 or first > second or second > max_layer:
        raise _param_invalid(f"layer range ({first}, {second}) is invalid: need 0 <= first <= "
                             f"second <= {max_layer} (or (-1, -1) for all layers)")
    return list(range(first * n, (second + 1) * n))


def resolve_layer_ranges(src_range, dst_range, uint64_t src_num_tensors,
                         uint64_t dst_num_tensors, tensor_num_per_layer=2, bint inclusive=False):
    """Source and destination tensor index lists for a pair of layer ranges.

    Python ranges (``inclusive=False``, None = all layers) or C++ inclusive pairs
    (``inclusive=True``, ``(-1, -1)`` = all layers). The spans must be equal.
    """
    convert = inclusive_layer_range_to_tensor_indices if inclusive else layer_range_to_tensor_indices
    if inclusive:
        src_range = (-1, -1) if src_range is None else src_range
        dst_range = (-1, -1) if dst_range is None else dst_range
    src_idx = convert(src_range, src_num_tensors, tensor_num_per_layer)
    dst_idx = convert(dst_range, dst_num_tensors, tensor_num_per_layer)
    if len(src_idx) != len(dst_idx):
        n = tensor_num_per_layer
        raise _param_invalid(f"source layer range {src_range} spans {len(src_idx) // n} layers "
                             f"but destination layer range {dst_range} spans "
                             f"{len(dst_idx) // n}; the spans must be equal")
    return src_idx, dst_idx


# ------------------------------------------------------------------------------------------------
# Executors
# ------------------------------------------------------------------------------------------------

cdef int _run_plan(const dd_runtime_table *table, const dd_copy_desc *descs, size_t count,
                   int kind, bint wait, bint ordered, size_t *failed_at) noexcept nogil:
    cdef size_t i
    cdef int rc
    if kind == DD_MEMCPY_HOST_TO_HOST:
        for i in range(count):
            _host_copy(<void *>descs[i].dst, <const void *>descs[i].src, descs[i].nbytes)
        return 0
    if table.copy_batch != NULL and ordered:
        # One queued copy per descriptor on the device's one stream: the stream runs them in list
        # order. (Synchronous copies would not do: cudaMemcpy returns before a device-to-device
        # copy, or one from pageable memory, has completed.)
        for i in range(count):
            rc = table.copy_batch(table.ctx, &descs[i], 1, kind, failed_at)
            if rc != 0:
                failed_at[0] = i
                table.synchronize(table.ctx)
                return rc
        failed_at[0] = count
        return table.synchronize(table.ctx) if wait else 0
    if table.copy_batch != NULL:
        rc = table.copy_batch(table.ctx, descs, count, kind, failed_at)
        if rc != 0:
            # The copies queued before the failure still run: wait for them (keeping the first
            # error), so none writes a destination or reads a source after the caller has seen
            # the error and may free or reuse the buffers.
            table.synchronize(table.ctx)
        elif wait:
            failed_at[0] = count
            rc = table.synchronize(table.ctx)
        return rc
    for i in range(count):
        rc = table.memcpy_kind(table.ctx, <void *>descs[i].dst, <const void *>descs[i].src,
                               descs[i].nbytes, kind)
        if rc != 0:
            failed_at[0] = i
            return rc
    return 0


def execute(CopyPlan plan not None, Runtime runtime not None, int kind, bint wait=True,
            bint ordered=False):
    """Run every descriptor of ``plan`` with the GIL released.

    Host-to-host copies use memcpy (memmove where ranges overlap). The other kinds go through the
    runtime: as one queued batch where it has async copies (a copy kernel, a batch copy or one
    async copy per descriptor on the device's stream), then waited for; with ``wait=False`` they
    are only queued and the caller must ``runtime.synchronize()`` before touching the memory.
    Queued copies run in parallel: ``ordered=True`` (a list whose later copies read what earlier
    ones write) runs them one descriptor after the other in list order instead (queued one by one
    on the stream where the runtime has async copies, else one synchronous copy each). A runtime error
    raises ``LLMException(LLM_FAILED)`` naming the runtime, the kind and the descriptor; the
    copies queued before the error are waited for first (with ``wait=False`` too).
    """
    cdef int rc
    cdef size_t failed_at = 0
    if kind < DD_MEMCPY_HOST_TO_HOST or kind > DD_MEMCPY_DEVICE_TO_DEVICE:
        raise _param_invalid(f"memcpy kind {kind} is not one of 0..3")
    with nogil:
        rc = _run_plan(&runtime.table, plan.descs, plan.count, kind, wait, ordered, &failed_at)
    if rc != 0:
        where = (f"at descriptor {failed_at} of {plan.count}" if failed_at < plan.count
                 else f"(a list of {plan.count} descriptors)")
        raise LLMException(f"{runtime.name}: {MEMCPY_KIND_NAMES[kind]} copy failed with error {rc} "
                           f"{where}", status_code=LLMStatusCode.LLM_FAILED)


def stage_plan(CopyPlan plan not None, uint64_t start, uint64_t nbytes, uint64_t bounce,
               bint to_bounce):
    """The part of ``plan`` covering bytes ``[start, start + nbytes)`` of its byte stream (its
    descriptors concatenated in order), one side replaced by the contiguous buffer at ``bounce``:
    ``to_bounce`` keeps the plan's sources and writes the bounce buffer, else the bounce buffer is
    read into the plan's destinations."""
    if nbytes > plan.total_bytes or start > plan.total_bytes - nbytes:
        raise _param_invalid(f"bytes [{start}, {start} + {nbytes}) are not inside a plan of "
                             f"{plan.total_bytes} bytes")
    cdef CopyPlan out = CopyPlan()
    cdef uint64_t pos = 0, end = start + nbytes, lo, hi
    cdef size_t i
    cdef dd_copy_desc d
    for i in range(plan.count):
        d = plan.descs[i]
        if pos >= end:
            break
        if pos + d.nbytes > start:
            lo = start - pos if start > pos else 0
            hi = end - pos if end - pos < d.nbytes else d.nbytes
            out.reserve(1)
            if to_bounce:
                out.add(d.src + lo, bounce + (pos + lo - start), hi - lo)
            else:
                out.add(bounce + (pos + lo - start), d.dst + lo, hi - lo)
        pos += d.nbytes
    return out


def translate_plan(CopyPlan plan not None, bint dst_side, spans):
    """A copy of ``plan`` with its destinations (``dst_side``) or sources moved from a peer's
    address space into ours: ``spans`` lists ``(peer_start, nbytes, local_start)``, and every
    descriptor must lie wholly inside one span (``LLM_KV_CACHE_NOT_EXIST`` otherwise)."""
    cdef list table = sorted((int(a), int(n), int(b)) for a, n, b in spans)
    cdef Py_ssize_t count = len(table), lo, hi, mid
    cdef uint64_t *starts = <uint64_t *>malloc((count + 1) * sizeof(uint64_t))
    cdef uint64_t *sizes = <uint64_t *>malloc((count + 1) * sizeof(uint64_t))
    cdef uint64_t *locals_ = <uint64_t *>malloc((count + 1) * sizeof(uint64_t))
    cdef CopyPlan out = CopyPlan()
    cdef size_t i
    cdef uint64_t addr, n
    cdef dd_copy_desc d
    if starts == NULL or sizes == NULL or locals_ == NULL:
        free(starts)
        free(sizes)
        free(locals_)
        raise MemoryError()
    try:
        for lo in range(count):
            starts[lo], sizes[lo], locals_[lo] = table[lo]
        out.reserve(plan.count)
        for i in range(plan.count):
            d = plan.descs[i]
            addr = d.dst if dst_side else d.src
            # The last span starting at or below addr.
            lo, hi = 0, count
            while lo < hi:
                mid = (lo + hi) // 2
                if starts[mid] <= addr:
                    lo = mid + 1
                else:
                    hi = mid
            lo -= 1
            n = d.nbytes
            if lo < 0 or addr - starts[lo] > sizes[lo] or n > sizes[lo] - (addr - starts[lo]):
                raise LLMException(f"descriptor {i} ({n} bytes at {addr:#x}) is not inside memory "
                                   f"the peer exported", status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
            addr = locals_[lo] + (addr - starts[lo])
            if dst_side:
                out.add(d.src, addr, n)
            else:
                out.add(addr, d.dst, n)
    finally:
        free(starts)
        free(sizes)
        free(locals_)
    return out


def memcpy_baseline(CopyPlan plan not None):
    """Benchmark baseline: a bare memcpy loop over the plan's descriptors (GIL released)."""
    cdef size_t i
    cdef const dd_copy_desc *d = plan.descs
    with nogil:
        for i in range(plan.count):
            memcpy(<void *>d[i].dst, <const void *>d[i].src, d[i].nbytes)


def split_plan(CopyPlan plan not None, Py_ssize_t parts):
    """Split ``plan`` into ``parts`` plans of about equal bytes (descriptors are cut where a
    share ends), for running one plan on several threads."""
    if parts < 1:
        raise _param_invalid(f"parts must be >= 1, got {parts}")
    cdef list out = [CopyPlan() for _ in range(parts)]
    cdef uint64_t share = (plan.total_bytes + <uint64_t>parts - 1) // <uint64_t>parts
    cdef Py_ssize_t p = 0
    cdef size_t i
    cdef uint64_t offset, take, room
    cdef CopyPlan cur = out[0]
    cdef dd_copy_desc d
    for i in range(plan.count):
        d = plan.descs[i]
        offset = 0
        while offset < d.nbytes:
            room = share - cur.total_bytes if share > cur.total_bytes else 0
            if room == 0 and p + 1 < parts:
                p += 1
                cur = out[p]
                continue
            take = d.nbytes - offset
            if p + 1 < parts and take > room:
                take = room
            cur.reserve(1)
            cur.add(d.src + offset, d.dst + offset, take)
            offset += take
    return out
