"""The socket helpers every part of the transport uses: where an accepted connection comes from
(``source_of``, for the per-source caps and budget shares), the listening sockets
(``tcp_listener``, ``unix_listener``), the tuning of a link's connections (``tune``: no Nagle
delay, keepalive, buffer sizes; and, for the whole process at import, ``_io``'s receive low-water
mark and spin from ``LLM_DATADIST_TCP_LOWAT`` / ``LLM_DATADIST_SPIN_US``), ``close_socket``, and
the small helpers of settings (``env_int``) and one-time warnings (``warn_once``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from typing import Any, Optional, Tuple

from llm_datadist import _io
from llm_datadist.transport.session import peer_credentials

logger = logging.getLogger("llm_datadist")


def env_int(name: str, default: int, lo: int = 1) -> int:
    try:
        return max(lo, int(os.environ.get(name, str(default))))
    except ValueError:
        return default


#: Where a connection comes from, for the per-source caps: ``("ip", address)`` over TCP (every
#: peer on this host is a loopback address), ``("uid", uid)`` over a Unix socket (as the kernel
#: has it).
Source = Tuple[str, Any]


def source_of(conn: socket.socket, address: Any = None) -> Source:
    """The source of an accepted connection (``address``: what ``accept()`` returned)."""
    if conn.family == socket.AF_UNIX:
        try:
            return "uid", peer_credentials(conn)[1]
        except OSError:
            return "uid", -1
    if address is None:
        try:
            address = conn.getpeername()
        except OSError:
            return "ip", "?"
    return "ip", str(address[0])


def describe(source: Source) -> str:
    return f"uid {source[1]}" if source[0] == "uid" else str(source[1])


#: Connections the kernel queues for ``accept()`` (capped by ``net.core.somaxconn``): while the
#: accept loop holds a newcomer (``slots.HandshakeSlots.admit``) the rest wait there, first come
#: first served, rather than have their SYNs dropped (a second or more of retransmission for a
#: peer among them).
LISTEN_BACKLOG = 1024


def tcp_listener(ip: str, port: int) -> socket.socket:
    """A listening TCP socket on ``ip:port``; OSError if it cannot be had."""
    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def unix_listener() -> Tuple[Optional[socket.socket], Optional[str]]:
    """A listening Unix socket of a random abstract name (per network namespace), or Nones."""
    name = f"llm_datadist.{os.getpid()}.{os.urandom(12).hex()}"
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except (OSError, AttributeError):
        return None, None
    try:
        sock.bind("\0" + name)
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        return None, None
    return sock, name


def is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return ip == "localhost"


_warned: set = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)


def _env_bytes(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, str(default)))
    except ValueError:
        return default


def _buffer_bytes() -> int:
    return _env_bytes("LLM_DATADIST_TCP_BUFFER", 4 << 20)


def tune(sock: socket.socket) -> None:
    """No Nagle delay for the small control frames; large socket buffers for the data
    (``LLM_DATADIST_TCP_BUFFER`` bytes, default 4 MiB; 0 leaves the system's autotuning). A
    receiver waiting for a large payload is woken once 1 MiB (a quarter of the buffer at most) is
    queued rather than for every segment: on loopback that is a third more throughput."""
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A peer whose host vanished without closing its connections is noticed (and its link
        # dropped) within about a minute.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 6)):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    size = _buffer_bytes()
    if size > 0:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, size)
            except OSError:
                pass


def _recv_lowat() -> int:
    """``LLM_DATADIST_TCP_LOWAT`` bytes (0 = off), default 1 MiB, at most a quarter of the buffer."""
    cap = max(0, _buffer_bytes()) // 4 or 1 << 20
    return max(0, min(_env_bytes("LLM_DATADIST_TCP_LOWAT", 1 << 20), cap))


_io.set_recv_lowat(_recv_lowat())

#: Default ``LLM_DATADIST_SPIN_US``: how long a link's receive polls before it sleeps.
DEFAULT_SPIN_US = 50


def _spin_us() -> int:
    """``LLM_DATADIST_SPIN_US`` microseconds (0 = off, at most 10,000), default ``DEFAULT_SPIN_US``;
    an unusable value is warned about and the default kept."""
    raw = os.environ.get("LLM_DATADIST_SPIN_US", "").strip()
    if not raw:
        return DEFAULT_SPIN_US
    try:
        value = int(raw)
        if not 0 <= value <= 10_000:
            raise ValueError
    except ValueError:
        logger.warning("LLM_DATADIST_SPIN_US=%r is not 0 to 10000 microseconds; using %d", raw, DEFAULT_SPIN_US)
        return DEFAULT_SPIN_US
    return value


_io.set_spin_us(_spin_us())


def close_socket(sock: Optional[socket.socket]) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
