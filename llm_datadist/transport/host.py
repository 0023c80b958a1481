"""Host identity: two clusters may use the same-host plane only if they share a kernel (boot
id), a PID namespace (so a pid means the same process to both) and a network namespace (a
namespace of its own is treated as another host, as containers on one machine usually are)."""

from __future__ import annotations

import os
import socket
from functools import lru_cache
from typing import Dict


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _namespace(kind: str) -> str:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return ""


@lru_cache(maxsize=1)
def host_identity() -> Dict[str, str]:
    return {
        "hostname": socket.gethostname(),
        "boot_id": _read("/proc/sys/kernel/random/boot_id"),
        "pid_ns": _namespace("pid"),
        "net_ns": _namespace("net"),
    }


def same_host(mine: Dict[str, str], theirs: Dict[str, str]) -> bool:
    keys = ("boot_id", "pid_ns", "net_ns")
    return all(mine.get(k) for k in keys) and all(mine.get(k) == theirs.get(k) for k in keys)
