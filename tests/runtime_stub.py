"""The stub ACL/CUDA runtime library built from ``tests/core/stub_runtime.c``, a ctypes reader
for the calls it records, and its fixtures (``stub_libraries``, ``make_stub``, ``stub``), which
``tests/conftest.py`` offers to every test.

``_core.load_runtime`` opens a library with ``dlopen(path, RTLD_NOW | RTLD_LOCAL)``; ctypes opens the
same path, and the dynamic loader hands back the already loaded object for a path it knows, so the
stub's call log seen through ctypes is the one the core writes to (test_runtimes.py checks this).
Loaded runtimes are cached per process and never unloaded, so every test gets its own copy of the
library at a new path (a new file, hence a new loaded object with its own globals and log).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import pytest

STUB_SOURCE = Path(__file__).parent / "core" / "stub_runtime.c"

# Variants of the stub: name -> extra gcc flags.
STUB_VARIANTS = {"full": [], "omit_memcpy": ["-DSTUB_OMIT_MEMCPY"], "no_driver": ["-DSTUB_OMIT_DRIVER"]}


class _StubCall(ctypes.Structure):
    """Mirror of ``struct stub_call`` in stub_runtime.c."""

    _fields_ = [
        ("fn", ctypes.c_int32),
        ("kind", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("rc", ctypes.c_int32),
        ("size", ctypes.c_uint64),
        ("dest_max", ctypes.c_uint64),
        ("dst", ctypes.c_uint64),
        ("src", ctypes.c_uint64),
    ]


@dataclass(frozen=True)
class Call:
    """One call recorded by the stub (see ``struct stub_call``)."""

    fn: str
    kind: int
    device: int
    rc: int
    size: int
    dest_max: int
    dst: int
    src: int


class StubRuntime:
    """A loaded copy of the stub library and its call log."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        lib = ctypes.CDLL(self.path)
        lib.stub_log_count.restype = ctypes.c_int
        lib.stub_log_count.argtypes = []
        lib.stub_log_dropped.restype = ctypes.c_uint64
        lib.stub_log_dropped.argtypes = []
        lib.stub_log_entry.restype = ctypes.c_int
        lib.stub_log_entry.argtypes = [ctypes.c_int, ctypes.POINTER(_StubCall)]
        lib.stub_log_reset.restype = None
        lib.stub_log_reset.argtypes = []
        lib.stub_fn_name.restype = ctypes.c_char_p
        lib.stub_fn_name.argtypes = [ctypes.c_int]
        lib.stub_fail_call.restype = None
        lib.stub_fail_call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.stub_set_device_count.restype = None
        lib.stub_set_device_count.argtypes = [ctypes.c_int]
        lib.stub_live_allocations.restype = ctypes.c_int64
        lib.stub_live_allocations.argtypes = []
        for name, restype in (("stub_live_host_allocations", ctypes.c_int64),
                              ("stub_live_mappings", ctypes.c_int64),
                              ("stub_stream_ops_run", ctypes.c_uint64),
                              ("stub_stream_ops_pending", ctypes.c_uint64)):
            getattr(lib, name).restype = restype
            getattr(lib, name).argtypes = []
        lib.stub_set_runtime_version.restype = None
        lib.stub_set_runtime_version.argtypes = [ctypes.c_int]
        self.lib = lib
        self._ids: Dict[str, int] = {}
        for fn in range(64):
            name = lib.stub_fn_name(fn)
            if name is not None:
                self._ids[name.decode()] = fn
        self._names = {fn: name for name, fn in self._ids.items()}

    # -- the log -------------------------------------------------------------------------------
    def calls(self, *names: str) -> List[Call]:
        """Every recorded call in order, or only the calls of the functions ``names``."""
        assert self.lib.stub_log_dropped() == 0, "the stub's call log overflowed"
        out = []
        entry = _StubCall()
        for i in range(self.lib.stub_log_count()):
            assert self.lib.stub_log_entry(i, ctypes.byref(entry)) == 0
            call = Call(self._names[entry.fn], entry.kind, entry.device, entry.rc, entry.size,
                        entry.dest_max, entry.dst, entry.src)
            if not names or call.fn in names:
                out.append(call)
        return out

    def names(self) -> List[str]:
        return [call.fn for call in self.calls()]

    def reset_log(self) -> None:
        self.lib.stub_log_reset()

    # -- switches ------------------------------------------------------------------------------
    def fail(self, fn: str, code: int, skip: int = 0) -> None:
        """Let ``skip`` calls of ``fn`` through, then make one return ``code`` (doing nothing)."""
        self.lib.stub_fail_call(self._ids[fn], skip, code)

    def set_device_count(self, count: int) -> None:
        self.lib.stub_set_device_count(count)

    def live_allocations(self) -> int:
        return self.lib.stub_live_allocations()

    def live_host_allocations(self) -> int:
        """Page-locked host allocations and registrations not yet released."""
        return self.lib.stub_live_host_allocations()

    def live_mappings(self) -> int:
        """Peer allocations opened with cudaIpcOpenMemHandle and not yet closed."""
        return self.lib.stub_live_mappings()

    def pending_copies(self) -> int:
        """Copies queued on streams that have not run yet."""
        return self.lib.stub_stream_ops_pending()

    def set_runtime_version(self, version: int) -> None:
        """What cudaRuntimeGetVersion reports (set before loading: below 12080, no batch API)."""
        self.lib.stub_set_runtime_version(version)


def _compile(gcc: str, out: Path, flags: List[str]) -> None:
    cmd = [gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", *flags, "-o", str(out), str(STUB_SOURCE)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        pytest.fail(f"compiling the stub runtime failed: {' '.join(cmd)}\n{proc.stderr}")


@pytest.fixture(scope="session")
def stub_libraries(tmp_path_factory) -> Dict[str, Path]:
    """The stub runtime compiled once per session: variant name -> path of the .so."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not on PATH: the stub ACL/CUDA runtime library cannot be built")
    build = tmp_path_factory.mktemp("stub_runtime")
    built = {}
    for variant, flags in STUB_VARIANTS.items():
        out = build / f"libstub_runtime_{variant}.so"
        _compile(gcc, out, flags)
        built[variant] = out
    return built


@pytest.fixture
def make_stub(stub_libraries, tmp_path):
    """Factory: a fresh copy of a stub variant at a new path, loaded with ctypes."""
    counter = [0]

    def make(variant: str = "full") -> StubRuntime:
        counter[0] += 1
        target = tmp_path / f"stub{counter[0]}" / f"libstub_{variant}.so"
        target.parent.mkdir()
        shutil.copyfile(stub_libraries[variant], target)
        return StubRuntime(target)

    return make


@pytest.fixture
def stub(make_stub) -> StubRuntime:
    """A fresh copy of the full stub runtime (its own globals and an empty call log)."""
    return make_stub()
