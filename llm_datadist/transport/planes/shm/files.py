"""Passing a cache's memfd to the peer and mapping it there: the owner's reply with the files
attached (``SCM_RIGHTS``), the peer's request and its receipt, and the checks of each file
received. See the package's docstring."""

from __future__ import annotations

import fcntl
import mmap
import os
import select
import socket
import stat
import time
from array import array
from typing import List, Optional

import numpy as np

from llm_datadist import _io
from llm_datadist.transport import deadline as dl
from llm_datadist.transport import session as _session
from llm_datadist.transport import wire
from llm_datadist.transport.errors import S, ProtocolError, fail, is_int

#: At most this many files are asked for (and passed) in one ``OP_SHM_GET`` (the kernel passes at
#: most 253 descriptors in one message).
MAX_FDS_PER_REQUEST = 200
#: The seal a mapped file must carry: a file the owner could shrink would fault our loads (SIGBUS).
SEALS_NEEDED = fcntl.F_SEAL_SHRINK if hasattr(fcntl, "F_SEAL_SHRINK") else 0


class MappedCache:
    """One file of the peer mapped here: ``cache_id``, ``serial`` (export id), ``base`` (where
    the owner maps it), ``size``, ``local`` (where it is mapped here). The mapping goes when the
    last reference does."""

    __slots__ = ("cache_id", "serial", "base", "size", "local", "_view")

    def __init__(self, cache_id: int, serial: int, base: int, size: int, fd: int) -> None:
        self.cache_id, self.serial, self.base, self.size = cache_id, serial, base, size
        self._view = np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8)
        self.local = int(self._view.ctypes.data)


def connection_refusal(fd: int, peer) -> Optional[str]:
    """Why the connection ``fd`` is not the peer's proven Unix connection (None if it is)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError as exc:
        return f"the connection is gone ({exc})"
    try:
        if sock.family != socket.AF_UNIX:
            return "the request came over TCP"
        pid, uid = _session.peer_credentials(sock)
    except OSError as exc:
        return f"the connection's credentials cannot be read ({exc})"
    finally:
        sock.close()
    if (pid, uid) != (peer.pid, peer.uid) or uid != os.geteuid():
        return f"the connection is of pid {pid}, uid {uid}"
    return None


def send_with_files(fd: int, data: bytes, files: List[int]) -> bool:
    """Send ``data`` on ``fd`` with ``files`` attached to its first byte; whether all went out."""
    sock = socket.socket(fileno=os.dup(fd))
    deadline = time.monotonic() + _session.FRAME_TIMEOUT_MS / 1000
    try:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", files))] if files else []
        while True:
            try:
                sent = sock.sendmsg([data], ancillary, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
                break
            except (BlockingIOError, InterruptedError):
                if not _wait(sock, select.POLLOUT, deadline):
                    return False
    except OSError:
        return False
    finally:
        sock.close()
    if sent < len(data):
        st, _ = _io_send(fd, data[sent:])
        return st == 0
    return True


def _io_send(fd: int, data: bytes):
    return _io.send_bytes(fd, data, _session.FRAME_TIMEOUT_MS)


def _wait(sock: socket.socket, events: int, deadline: float) -> bool:
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    poller = select.poll()
    poller.register(sock, events)
    poller.poll(max(1, int(left * 1000)))
    return True


def fetch_files(session, cache_ids: List[int], deadline: float, proof: int = 0) -> List[MappedCache]:
    """Ask the peer of ``session`` for the files of ``cache_ids`` on the link's outgoing Unix
    connection, with ``proof`` (the word read at the peer's ``proof_addr``), and map each; what
    the peer left out is not returned. ``LLM_LINK_FAILED`` for a reply that breaks the protocol
    (the connection is dropped), ``LLM_FEATURE_NOT_ENABLED`` when the peer refuses."""
    channel = session.outgoing
    if channel is None:
        raise fail(S.LLM_LINK_FAILED, f"the link to cluster {session.cluster_id} is closed")
    what = "shared memory request"
    payload = wire.encode_json({"caches": list(cache_ids), "proof": proof})
    files: List[int] = []
    try:
        with channel.lock:
            req_id = channel.next_request_id()
            st, _ = _io.send_bytes(channel.fd, wire.pack_header(wire.OP_SHM_GET, req_id, len(payload)) + payload,
                                   dl.left_ms(deadline))
            if st != 0:
                raise channel.fault(st, what)
            header = _recv_with_files(channel, wire.HEADER_BYTES, len(cache_ids), files, deadline, what)
            channel.header[:] = header
            status, length = channel.check_reply(wire.OP_SHM, req_id, what)
            if length > wire.MAX_CONTROL_BYTES:
                raise channel.fault(S.LLM_LINK_FAILED, f"{what}: oversized reply of {length} bytes")
            st, body = _session.read_body(channel.fd, length, dl.left_ms(deadline))
            if st != 0:
                raise channel.fault(st, what)
        try:
            reply = wire.decode_json(body) if body else {}
        except ProtocolError as exc:
            raise fail(S.LLM_LINK_FAILED, f"{what}: {exc}") from None
        if status != 0:
            raise fail(status, f"cluster {session.cluster_id} refused the {what}: "
                               f"{str(reply.get('error', ''))[:200]}")
        listed = reply.get("caches")
        if not isinstance(listed, list) or len(listed) != len(files) or not all(
                isinstance(e, list) and len(e) == 4 and e[0] in cache_ids and all(is_int(x, 0, 2**64 - 1) for x in e)
                for e in listed):
            raise fail(S.LLM_LINK_FAILED, f"cluster {session.cluster_id} sent a malformed {what} reply")
        return [map_file(session, entry, fd) for entry, fd in zip(listed, files)]
    finally:
        for fd in files:
            os.close(fd)


def map_file(session, entry: List[int], fd: int) -> MappedCache:
    """Map one file the peer passed, after checking it is a memfd sealed against shrinking that
    holds the bytes it says."""
    cache_id, serial, base, size = entry
    try:
        info = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise fail(S.LLM_LINK_FAILED,
                   f"cluster {session.cluster_id} passed a file that is not a memfd ({exc})") from None
    if not stat.S_ISREG(info.st_mode) or info.st_size != size or size <= 0 or not seals & SEALS_NEEDED:
        raise fail(S.LLM_LINK_FAILED, f"cluster {session.cluster_id} passed a file for cache {cache_id} that "
                                      f"is not a sealed memfd of {size} bytes")
    try:
        return MappedCache(cache_id, serial, base, size, fd)
    except (OSError, ValueError) as exc:
        raise fail(S.LLM_LINK_FAILED,
                   f"mapping cache {cache_id} of cluster {session.cluster_id} failed: {exc}") from None


def _recv_with_files(channel, nbytes: int, max_files: int, files: List[int], deadline: float, what: str) -> bytes:
    """Receive exactly ``nbytes`` on the channel, collecting the descriptors that come with them
    into ``files`` (the caller closes them); at most ``max_files`` are accepted."""
    sock = socket.socket(fileno=os.dup(channel.fd))
    got = bytearray()
    room = socket.CMSG_SPACE(max(1, max_files) * array("i").itemsize)
    try:
        while len(got) < nbytes:
            try:
                data, ancillary, flags, _ = sock.recvmsg(nbytes - len(got), room,
                                                         socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
            except (BlockingIOError, InterruptedError):
                if not _wait(sock, select.POLLIN, deadline):
                    raise channel.fault(S.LLM_TIMEOUT, what) from None
                continue
            except OSError:
                raise channel.fault(S.LLM_LINK_FAILED, what) from None
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    passed = array("i")
                    passed.frombytes(payload[:len(payload) - len(payload) % passed.itemsize])
                    files.extend(passed)
            if flags & socket.MSG_CTRUNC or len(files) > max_files:
                raise channel.fault(S.LLM_LINK_FAILED, f"{what}: more descriptors than asked for")
            if not data:
                raise channel.fault(S.LLM_LINK_FAILED, what)
            got += data
    finally:
        sock.close()
    return bytes(got)
