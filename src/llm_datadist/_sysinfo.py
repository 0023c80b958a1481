"""Facts about this installation and this host: ``python -m llm_datadist info`` and the headers of
the demo's and the sweep's reports.

Each fact about a runtime or a data plane is a string ``"available: why"`` or ``"not available:
why"``; the data planes are tried for real: a loopback TCP connection, and a
``process_vm_readv`` of this process made by a separate one (what a peer's link-time probe does).
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from typing import Dict, Optional, Tuple

PROBE_TIMEOUT_S = 30.0


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cpu_model() -> str:
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def available_memory() -> Optional[int]:
    """``MemAvailable`` in bytes (None where /proc/meminfo does not say)."""
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            try:
                return int(line.split()[1]) * 1024
            except (ValueError, IndexError):
                return None
    return None


#: The demo and the bench refuse to start when their caches would take more than this share of
#: the available memory.
MEMORY_SHARE = 0.5


def memory_shortfall(needed: int) -> Optional[str]:
    """Why ``needed`` bytes are too many for this machine, or None if they fit (or it cannot tell)."""
    from llm_datadist._console import format_size
    available = available_memory()
    if available is None or needed <= MEMORY_SHARE * available:
        return None
    return f"{format_size(needed)}, more than {MEMORY_SHARE:.0%} of the {format_size(available)} available"


def host_facts() -> Dict[str, object]:
    return dict(machine=platform.machine(), cpu=cpu_model(), cpus=os.cpu_count(),
                kernel=platform.release(), python=platform.python_version())


def build_facts() -> Dict[str, object]:
    """Version, debug or release, Cython version and the compiler command line recorded at build
    time (``_build_info.py``, written by setup.py)."""
    import numpy

    import llm_datadist
    from llm_datadist import _core
    facts: Dict[str, object] = dict(version=llm_datadist.__version__, python=platform.python_version(),
                                    numpy=numpy.__version__,
                                    build="debug" if _core.DEBUG_BUILD else "release",
                                    cython=_core.CYTHON_VERSION,
                                    location=os.path.dirname(os.path.abspath(llm_datadist.__file__)))
    try:
        from llm_datadist import _build_info as recorded
    except ImportError:
        facts["compile_flags"] = "not recorded (built without setup.py's build_ext, or before it recorded them)"
        return facts
    # The interpreter's flags (as distutils passes them), then the extension's own.
    command = list(recorded.COMPILER_COMMAND) + list(recorded.EXTRA_COMPILE_ARGS.get("llm_datadist._core", []))
    facts["compiler"] = command[0]
    facts["compile_flags"] = " ".join(command[1:])
    facts["macros"] = " ".join(recorded.DEFINE_MACROS.get("llm_datadist._core", []))
    facts["cython_directives"] = ", ".join(f"{k}={v}" for k, v in recorded.CYTHON_DIRECTIVES.items())
    facts["built_with"] = f"Cython {recorded.CYTHON_VERSION}, numpy {recorded.NUMPY_BUILD_VERSION}, " \
                          f"Python {recorded.PYTHON_BUILD_VERSION}"
    if recorded.DEBUG != _core.DEBUG_BUILD:
        facts["compile_flags"] += (" (recorded by another build than the extension loaded: it was "
                                   "skipped as up to date; rebuild with --force)")
    return facts


def runtime_facts() -> Dict[str, object]:
    """The device runtime this process would use, and every registered runtime's availability
    and capabilities."""
    from llm_datadist import LLMException, runtimes
    facts: Dict[str, object] = {}
    try:
        runtime, reason = runtimes.select_runtime()
        facts["device_runtime"] = f"{runtime.name} ({reason})"
    except LLMException as exc:
        facts["device_runtime"] = f"unusable: {str(exc).split(' (status_code')[0]}"
    facts["runtimes"] = {name: ("available: " if ok else "not available: ") + why
                         for name, (ok, why) in ((n, runtimes.probe(n)) for n in runtimes.names())}
    facts["runtime_capabilities"] = {
        name: ", ".join(sorted(runtimes.get(name).capabilities)) or "none" for name in runtimes.names()}
    return facts


def ptrace_scope() -> Tuple[Optional[int], str]:
    """Yama's ``ptrace_scope`` (None where Yama is absent) and what it means for sibling processes."""
    text = _read("/proc/sys/kernel/yama/ptrace_scope")
    if text is None:
        return None, "Yama not present: no restriction beyond same user"
    scope = int(text)
    meaning = {0: "classic: any process of the same user",
               1: "restricted: only descendants (sibling clusters are refused)",
               2: "admin-only: needs CAP_SYS_PTRACE",
               3: "no attach: process_vm_readv/writev refused between processes"}
    return scope, f"Yama ptrace_scope={scope} ({meaning.get(scope, 'unknown')})"


_PROBE_CHILD = """
import sys
from llm_datadist import _planes
status, err, data = _planes.cma_read_bytes(int(sys.argv[1]), int(sys.argv[2]), 8)
print(status, err, data.hex())
"""


def probe_same_host() -> Tuple[bool, str]:
    """Whether another process of this user may read this one's memory with
    ``process_vm_readv``: a child process (not an ancestor of ours, like a sibling cluster) reads
    a word of ours, as a peer's link-time probe does."""
    from llm_datadist import _planes
    _, scope_text = ptrace_scope()
    word = _planes.Word(int.from_bytes(os.urandom(8), "little") | 1)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(_planes.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE_CHILD, str(os.getpid()), str(word.addr)],
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"the probe process did not run ({exc}); {scope_text}"
    try:
        status, err, data = done.stdout.split()
        status, err = int(status), int(err)
    except ValueError:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return False, f"the probe process failed ({last}); {scope_text}"
    if status == 0 and int.from_bytes(bytes.fromhex(data), "little") == word.value:
        return True, f"another process read this one's memory with process_vm_readv; {scope_text}"
    why = os.strerror(err) if err else f"status {status}, wrong bytes"
    return False, (f"process_vm_readv of this process by another failed ({why}); {scope_text}; "
                   f"links between processes of this host use tcp")


def probe_tcp() -> Tuple[bool, str]:
    """A loopback TCP connection, one byte each way."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            server.settimeout(5)
            with socket.create_connection(server.getsockname(), timeout=5) as client:
                accepted, _ = server.accept()
                with accepted:
                    client.sendall(b"x")
                    if accepted.recv(1) != b"x":
                        return False, "a loopback connection did not deliver its byte"
        return True, "loopback connection made (any reachable listen_ip_info works)"
    except OSError as exc:
        return False, f"a loopback connection failed: {exc}"


def plane_facts() -> Dict[str, str]:
    planes = {"local": (True, "copies and swaps inside one process (device runtime memcpy)"),
              "cma": probe_same_host(), "tcp": probe_tcp()}
    return {name: ("available: " if ok else "not available: ") + why for name, (ok, why) in planes.items()}


def all_facts() -> Dict[str, object]:
    facts = build_facts()
    facts.update(runtime_facts())
    facts["data_planes"] = plane_facts()
    facts["host"] = host_facts()
    return facts
