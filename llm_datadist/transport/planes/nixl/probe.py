"""The nixl plane's probe: an agent made in a child process (so that a crash stays there) with the
UCX settings to try, reporting NIXL's and UCX's versions, whether the UCX backend came up and the
UCX transports and devices it lists. ``probe_rdma`` says whether UCX has an RDMA device here (the
plane's ``auto`` test), ``describe`` what ``info`` prints.

The child is ``_PROBE_CHILD`` run as ``python -c``: it imports NIXL and the standard library only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any, Dict, Optional, Sequence, Tuple

from llm_datadist.transport.planes.nixl import environment as env
from llm_datadist.transport.planes.nixl.agent import INSTALL, installed

#: How long ``probe`` waits for its child process.
PROBE_TIMEOUT_S = 60.0

_PROBE_CHILD = r"""
import ctypes, json, os, sys
out = {"version": "unknown", "ucx": "", "backend": "", "transports": []}
try:
    from importlib import metadata
    out["version"] = metadata.version("nixl")
except Exception:
    pass
try:
    import nixl
    b = nixl._bindings
    config = b.nixlAgentConfig()
    config.useProgThread = False
    config.useListenThread = False
    agent = b.nixlAgent("llmdd-probe", config)
    try:
        agent.createBackend("UCX", {})
        out["backend"] = "ok"
    except Exception as exc:
        out["backend"] = f"{type(exc).__name__}: {exc}"
    path = next((line.split()[-1] for line in open("/proc/self/maps") if "libucp" in line), None)
    if path:
        ucp = ctypes.CDLL(path)
        major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        ucp.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
        out["ucx"] = f"{major.value}.{minor.value}.{release.value}"
        config = ctypes.c_void_p()
        context = ctypes.c_void_p()
        params = (ctypes.c_uint64 * 64)()
        params[0], params[1] = 1, 2 | 8  # field mask: features; features: RMA | AM
        if ucp.ucp_config_read(None, None, ctypes.byref(config)) == 0 and \
                ucp.ucp_init_version(major, minor, params, config, ctypes.byref(context)) == 0:
            import tempfile
            with tempfile.NamedTemporaryFile("r") as listing:
                libc = ctypes.CDLL(None)
                libc.fopen.restype = ctypes.c_void_p
                stream = ctypes.c_void_p(libc.fopen(listing.name.encode(), b"w"))
                ucp.ucp_context_print_info(context, stream)
                libc.fclose(stream)
                text = listing.read()
            out["transports"] = [line.split("--")[-1].strip() for line in text.splitlines()
                                 if "resource" in line and "--" in line]
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""

_probe_lock = threading.Lock()
_probe_cache: Dict[Tuple[Tuple[str, str], ...], Dict[str, Any]] = {}


def probe_child(settings: Dict[str, str]) -> Dict[str, Any]:
    """What a child process with the UCX variables ``settings`` found: NIXL's and UCX's versions,
    whether the UCX backend came up (``"ok"`` or the error) and the UCX transports and devices it
    lists (``tcp/lo``, ``rc_mlx5/mlx5_0:1``...). Cached per settings; a crash stays in the child."""
    key = tuple(sorted(settings.items()))
    with _probe_lock:
        cached = _probe_cache.get(key)
        if cached is not None:
            return cached
        child_env = dict(os.environ, **settings)
        try:
            done = subprocess.run([sys.executable, "-c", _PROBE_CHILD], capture_output=True, text=True,
                                  timeout=PROBE_TIMEOUT_S, env=child_env)
            last = (done.stdout.strip().splitlines() or [""])[-1]
            report = json.loads(last) if last.startswith("{") else {
                "error": f"the probe process exited with {done.returncode}: "
                         f"{(done.stderr.strip().splitlines() or ['no output'])[-1][:200]}"}
        except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
            report = {"error": f"the probe process did not run ({exc})"}
        _probe_cache[key] = report
        return report


def _probe_rdma_settings(devices: Sequence[str]) -> Dict[str, str]:
    settings = env.ucx_settings("rdma", devices=devices)
    if not devices:  # no RDMA port: UCX lists what it has besides TCP (no socket either way)
        settings.pop("UCX_NET_DEVICES")
    return settings


def probe_rdma(devices: Optional[Sequence[str]] = None) -> Tuple[bool, str]:
    """Whether UCX has an RDMA device here: the active ports (or ``devices``), then an agent made
    with them in a child process."""
    if not installed():
        return False, f"NIXL is not installed ({INSTALL})"
    ports = list(devices) if devices else env.rdma_ports()
    if not ports:
        return False, "no active RDMA port in /sys/class/infiniband"
    report = probe_child(_probe_rdma_settings(ports))
    if report.get("backend") == "ok":
        return True, f"UCX over {', '.join(ports)}: {', '.join(report.get('transports') or ['?'])}"
    why = report.get("error") or report.get("backend")
    return False, f"UCX found no usable RDMA device on {', '.join(ports)} ({why})"


def describe() -> Tuple[bool, str]:
    """Whether the plane can serve here, and what ``info`` says of it (``NixlPlane.probe``):
    NIXL's and UCX's versions, UCX's transports without TCP, RDMA over the pinned or active
    ports, and in TCP mode UCX TCP on lo."""
    if not installed():
        return False, f"NIXL is not installed ({INSTALL})"
    ports = env.pinned_devices() or env.rdma_ports()
    report = probe_child(_probe_rdma_settings(ports))
    version = f"NIXL {report.get('version')}" + (f" (UCX {report['ucx']})" if report.get("ucx") else "")
    if report.get("error"):
        return False, f"{version}: {report['error']}"
    found = ", ".join(report.get("transports") or []) or "none"
    rdma_ok = bool(ports) and report.get("backend") == "ok"
    rdma = (f"RDMA over {', '.join(ports)}" if rdma_ok else
            f"no RDMA ({'no active port in /sys/class/infiniband' if not ports else report.get('backend')})")
    text = f"{version}; UCX transports without TCP: {found}; {rdma}"
    if env.tcp_mode():
        tcp = probe_child(env.ucx_settings("tcp", "lo"))
        tcp_ok = tcp.get("backend") == "ok"
        text += (f"; UCX TCP on ({env.TCP_ENV}=1): {', '.join(tcp.get('transports') or []) or 'none'} on lo"
                 + ("" if tcp_ok else f" ({tcp.get('error') or tcp.get('backend')})"))
        return rdma_ok or tcp_ok, text + "; links with a secret only"
    return rdma_ok, text + f"; {env.TCP_ENV}=1 runs it over UCX TCP; links with a secret only"
