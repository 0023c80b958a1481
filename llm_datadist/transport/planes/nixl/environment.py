"""The UCX environment of the nixl plane: this host's interfaces and active RDMA ports, and UCX's
settings, which are process-wide and fixed when the process makes its first agent (``fix_ucx``;
which settings each mode takes: the package's docstring, "UCX's settings")."""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import threading
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from llm_datadist.transport.listener import is_loopback

#: ``1`` lets the plane run over UCX TCP (tests, hosts without RDMA); ``auto`` may then choose it.
TCP_ENV = "LLM_DATADIST_NIXL_TCP"
#: UCX devices (``mlx5_0:1``, comma separated) this process uses in RDMA mode instead of every
#: active port: one per GPU rank, say. The option wins over the environment variable.
DEVICES_OPTION = "llm.NixlDevices"
DEVICES_ENV = "LLM_DATADIST_NIXL_DEVICES"


# -- this host's interfaces and RDMA ports ---------------------------------------------------------
class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [("next", ctypes.POINTER(_IfAddrs)), ("name", ctypes.c_char_p), ("flags", ctypes.c_uint),
                     ("addr", ctypes.c_void_p), ("netmask", ctypes.c_void_p), ("ifu", ctypes.c_void_p),
                     ("data", ctypes.c_void_p)]


def interface_addresses() -> List[Tuple[str, str]]:
    """``(interface, address)`` of every IPv4 and IPv6 address of this network namespace
    (``getifaddrs``); empty where it fails."""
    libc = ctypes.CDLL(None, use_errno=True)
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        return []
    found = []
    try:
        node = head
        while node:
            entry = node.contents
            if entry.addr:
                family = ctypes.c_ushort.from_address(entry.addr).value
                if family == socket.AF_INET:
                    raw = ctypes.string_at(entry.addr + 4, 4)
                    found.append((entry.name.decode(errors="replace"), socket.inet_ntop(socket.AF_INET, raw)))
                elif family == socket.AF_INET6:
                    raw = ctypes.string_at(entry.addr + 8, 16)
                    found.append((entry.name.decode(errors="replace"), socket.inet_ntop(socket.AF_INET6, raw)))
            node = entry.next
    finally:
        libc.freeifaddrs(head)
    return found


def _plain(ip: str) -> str:
    """``ip`` without a zone and as IPv4 where it is an IPv4-mapped IPv6 address."""
    try:
        address = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ip
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped or address)


def interface_of(ip: str) -> Optional[str]:
    """The interface holding address ``ip`` here, or None."""
    ip = _plain(ip)
    return next((name for name, address in interface_addresses() if _plain(address) == ip), None)


def is_this_host(ip: str) -> bool:
    """Whether ``ip`` is a loopback address or one of this network namespace's own."""
    ip = _plain(ip)
    return is_loopback(ip) or any(_plain(address) == ip for _, address in interface_addresses())


def rdma_ports(root: str = "/sys/class/infiniband") -> List[str]:
    """The active RDMA ports of this host as UCX names them (``mlx5_0:1``)."""
    ports = []
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        return []
    for device in devices:
        try:
            numbers = sorted(os.listdir(os.path.join(root, device, "ports")), key=lambda p: (len(p), p))
        except OSError:
            continue
        for number in numbers:
            try:
                with open(os.path.join(root, device, "ports", number, "state")) as f:
                    if "ACTIVE" in f.read():
                        ports.append(f"{device}:{number}")
            except OSError:
                continue
    return ports


def tcp_mode() -> bool:
    return os.environ.get(TCP_ENV, "").strip().lower() in ("1", "true", "yes")


def ucx_settings(mode: str, interface: Optional[str] = None, devices: Sequence[str] = (),
                 cuda: bool = False) -> Dict[str, str]:
    """The UCX variables of ``mode``: ``"tcp"`` over ``interface`` alone, or ``"rdma"`` over
    ``devices`` with every transport but TCP (so UCX opens no socket); ``UCX_MODULES=^efa``
    unless a device is an EFA one."""
    if mode == "tcp":
        settings = {"UCX_TLS": "tcp,cuda_copy" if cuda else "tcp", "UCX_NET_DEVICES": interface or ""}
    else:
        settings = {"UCX_TLS": "^tcp", "UCX_NET_DEVICES": ",".join(devices)}
    if not any(device.startswith("efa") for device in devices):
        settings["UCX_MODULES"] = "^efa"
    return settings


_ucx_lock = threading.Lock()
#: The UCX variables this process set at its first agent (those the user had not set), and the mode.
_ucx_fixed: Optional[Dict[str, str]] = None
_ucx_mode: Optional[str] = None


def fix_ucx(mode: str, settings: Dict[str, str]) -> Optional[str]:
    """Put ``settings`` in this process's environment, where the user has not set them, before its
    first agent (UCX reads them when an agent's backend is made, and they hold for the process);
    later: None if the process's settings are these, else why not."""
    global _ucx_fixed, _ucx_mode
    with _ucx_lock:
        if _ucx_fixed is None:
            _ucx_fixed = {key: value for key, value in settings.items() if key not in os.environ}
            _ucx_mode = mode
            os.environ.update(_ucx_fixed)
            return None
        if mode != _ucx_mode:
            return (f"this process's NIXL agents run in {_ucx_mode} mode since its first one (UCX's "
                    f"settings are process-wide)")
        differ = [key for key, value in _ucx_fixed.items() if settings.get(key) != value]
        if differ:
            return (f"UCX was set up with {', '.join(f'{k}={_ucx_fixed[k]}' for k in differ)} at this process's "
                    f"first NIXL agent; this link needs {', '.join(f'{k}={settings.get(k)}' for k in differ)} "
                    f"(UCX's settings are process-wide)")
        return None


def fixed_mode() -> Optional[str]:
    """The mode (``"tcp"`` or ``"rdma"``) of this process's UCX settings, None before its first agent."""
    return _ucx_mode


def pinned_devices(options: Optional[Mapping[str, str]] = None) -> List[str]:
    """The UCX devices pinned with ``llm.NixlDevices`` (in ``options``; it wins) or
    ``LLM_DATADIST_NIXL_DEVICES``; empty: every active port."""
    text = (options or {}).get(DEVICES_OPTION) or os.environ.get(DEVICES_ENV, "")
    return [device.strip() for device in text.split(",") if device.strip()]
