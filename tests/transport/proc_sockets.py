"""The TCP and UDP sockets a process holds, read from /proc: for the tests that must prove a process
(and the UCX inside it) opened no socket on an address outside the ones the test allows."""

from __future__ import annotations

import os
import socket
import struct
from typing import List, Set, Tuple

Endpoint = Tuple[str, int]


def _address(field: str) -> Endpoint:
    """``ADDR:PORT`` of /proc/net/tcp (little-endian words of hex) as ``(ip, port)``."""
    raw, port = field.split(":")
    data = bytes.fromhex(raw)
    words = b"".join(struct.pack("<I", struct.unpack(">I", data[i:i + 4])[0]) for i in range(0, len(data), 4))
    family = socket.AF_INET if len(data) == 4 else socket.AF_INET6
    ip = socket.inet_ntop(family, words)
    if family == socket.AF_INET6 and ip.startswith("::ffff:") and "." in ip:
        ip = ip[len("::ffff:"):]
    return ip, int(port, 16)


def _inodes(pid: int) -> Set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[len("socket:["):-1])
    return found


def process_sockets(pid: int) -> List[Tuple[str, Endpoint, Endpoint]]:
    """``(protocol, local, remote)`` of every TCP and UDP socket (IPv4 and IPv6) process ``pid``
    holds, as its network namespace lists them."""
    inodes = _inodes(pid)
    sockets = []
    for protocol in ("tcp", "tcp6", "udp", "udp6"):
        try:
            with open(f"/proc/{pid}/net/{protocol}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[9] in inodes:
                sockets.append((protocol, _address(fields[1]), _address(fields[2])))
    return sockets


def foreign_sockets(pid: int, allowed: Set[str]) -> List[Tuple[str, Endpoint, Endpoint]]:
    """The sockets of ``pid`` bound or connected to an address outside ``allowed`` (a wildcard
    bind, 0.0.0.0 or ::, counts as foreign: it listens on every interface)."""
    return [(protocol, local, remote) for protocol, local, remote in process_sockets(pid)
            if local[0] not in allowed or (remote[0] not in allowed and remote[0] not in ("0.0.0.0", "::"))]
