"""Host memory the engine allocates in a ``memfd`` of its own per cache (``SharedCache``).

``allocate_cache`` / ``allocate_blocks_cache`` put each HOST cache (and each DEVICE cache of a
runtime whose device memory is host memory, ``cpu``) in one new memfd: the ``shm`` data plane
(``transport/planes/shm/``) hands that file to a proven same-host peer, which maps it once and
moves bytes with memcpy. One file per cache, made for this allocation only, so that a peer's
mapping reaches that cache and nothing else: never another cache, never a later allocation (a
new registration is a new file; the configured pool stays a budget of bytes, not one region).

The file is sealed against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``):
a peer holding it cannot truncate it under this process's mapping (which would turn our own
loads into SIGBUS). Its pages start zeroed, as plain host allocations do, and are freed when the
cache is gone here (a hole punched over the file) even while a peer still maps it.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import weakref
from typing import List, Optional

import numpy as np

#: Tensors start on page boundaries in the file (a peer maps the whole file once).
PAGE_BYTES = mmap.PAGESIZE


def available() -> bool:
    """Whether this host can make sealed memfds (Linux 3.17+ with Python's ``memfd_create``)."""
    return hasattr(os, "memfd_create") and hasattr(os, "MFD_ALLOW_SEALING") and hasattr(fcntl, "F_ADD_SEALS")


class SharedCache:
    """One cache's tensors in one sealed memfd mapped here read-write.

    ``fd``: the file (closed when the last tensor of the cache and the cache itself are gone);
    ``base``: where it is mapped here; ``size``: its bytes; ``stride``: from one tensor to the next
    (``tensor_bytes`` rounded up to a page); ``tensors``: one ``SharedTensor`` per tensor, which
    the engine keeps as the cache's allocations (each keeps the mapping alive; the cache does not
    hold them, so that the file is released as soon as the last one goes, not at a collection)."""

    def __init__(self, tensor_bytes: int, num_tensors: int, name: str = "llm_datadist-cache") -> None:
        stride = max(PAGE_BYTES, -(-tensor_bytes // PAGE_BYTES) * PAGE_BYTES)
        size = stride * num_tensors
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.size = size
        self.stride = stride
        self.tensor_bytes = tensor_bytes
        # The mapping is released when nothing refers to the view any more (no explicit unmap:
        # a copy that still holds a tensor finishes first).
        self._view = np.frombuffer(mapping, dtype=np.uint8)
        self.base = int(self._view.ctypes.data)
        self._closer = weakref.finalize(self, _release, fd, size)
        self.num_tensors = num_tensors

    @property
    def tensors(self) -> List["SharedTensor"]:
        return [SharedTensor(self, self.base + i * self.stride, self.tensor_bytes) for i in range(self.num_tensors)]

    def offset(self, index: int) -> int:
        return index * self.stride

    def __repr__(self) -> str:
        return f"<SharedCache memfd {self.fd}, {self.num_tensors} x {self.tensor_bytes} bytes at {self.base:#x}>"


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2
_fallocate = None


def _release(fd: int, size: int) -> None:
    """The cache is gone here: free its pages (a hole over the whole file: a peer that still maps
    it reads zeros and holds none of this process's memory), then close the file."""
    global _fallocate
    try:
        if _fallocate is None:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            _fallocate = libc.fallocate64
            _fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
        _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, size)
    except (OSError, AttributeError):
        pass  # the pages then go with the last mapping
    finally:
        os.close(fd)


class SharedTensor:
    """One tensor of a ``SharedCache`` (what ``_core.Allocation`` is to other caches): ``addr``,
    ``nbytes``; it keeps the cache's mapping alive."""

    __slots__ = ("cache", "addr", "nbytes")
    host_addressable = True
    on_device = False
    pinned = False

    def __init__(self, cache: SharedCache, addr: int, nbytes: int) -> None:
        self.cache = cache
        self.addr = addr
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"<SharedTensor {self.nbytes} bytes at {self.addr:#x} of {self.cache!r}>"


def allocate(tensor_bytes: int, num_tensors: int) -> Optional[SharedCache]:
    """A ``SharedCache``, or None where memfds are not available or the kernel refuses one (the
    engine then allocates as before)."""
    if not available():
        return None
    try:
        return SharedCache(tensor_bytes, num_tensors)
    except OSError:
        return None
