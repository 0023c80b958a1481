"""A counter in ``memfd`` shared memory that same-host peers map read-only.

The engine's registry generation lives here: a peer on the same-host plane compares it with the
generation of the cache table it planned against before every transfer. Mapping it (through
``/proc/<pid>/fd/<fd>``, which needs the same permission as ``process_vm_writev``) makes that
check a memory load instead of a system call; where the mapping is refused, the peer reads the
word with ``process_vm_readv`` at ``addr`` instead.
"""

from __future__ import annotations

import mmap
import os
from typing import Optional

import numpy as np

_PAGE = 4096


class SharedCounter:
    """The owner's side: a 64-bit counter in a memfd page."""

    def __init__(self, value: int = 1) -> None:
        self.fd = -1
        self._map: Optional[mmap.mmap] = None
        if hasattr(os, "memfd_create"):
            try:
                self.fd = os.memfd_create("llm_datadist-generation", os.MFD_CLOEXEC)
                os.ftruncate(self.fd, _PAGE)
                self._map = mmap.mmap(self.fd, _PAGE)
            except OSError:
                self.close()
        buffer = self._map if self._map is not None else bytearray(_PAGE)
        self._keep = buffer
        self._view = np.frombuffer(buffer, dtype=np.uint64, count=1)
        self._view[0] = value

    @property
    def addr(self) -> int:
        return self._view.ctypes.data

    @property
    def value(self) -> int:
        return int(self._view[0])

    @value.setter
    def value(self, v: int) -> None:
        self._view[0] = v

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PeerCounter:
    """A peer's counter mapped read-only; ``None`` from ``open`` when it cannot be mapped."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self._map = mapping
        self._view = np.frombuffer(mapping, dtype=np.uint64, count=1)

    @classmethod
    def open(cls, pid: int, fd: int) -> Optional["PeerCounter"]:
        if fd < 0:
            return None
        try:
            local = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            return cls(mmap.mmap(local, _PAGE, prot=mmap.PROT_READ))
        except (OSError, ValueError):
            return None
        finally:
            os.close(local)

    @property
    def view(self) -> Optional[np.ndarray]:
        """The mapped word as a one-element uint64 array (it keeps the page mapped while it is
        referenced), or None once closed."""
        return self._view

    @property
    def value(self) -> Optional[int]:
        """The counter; None once closed."""
        view = self._view
        return None if view is None else int(view[0])

    def close(self) -> None:
        """Unmap the page (a reader that still holds the old view keeps it mapped until done)."""
        self._view = None
        try:
            self._map.close()
        except BufferError:  # a concurrent reader's view: the page goes with it
            pass
