"""The server side of the wire fuzzer: an ``LLMDataDist`` initialized in the test process, with
registered blocks caches whose tensors sit inside larger buffers between guard bytes, and an
unregistered secret buffer; and ``FuzzServer.run``, which feeds one connection's bytes to the
server's own connection code.

``run`` does what the listener does with an accepted connection, without the TCP round trip:
the peer's end of an ``AF_UNIX`` socket pair gets the case's bytes (then ``SHUT_WR``), the
server's end goes, non-blocking and tuned like an accepted one, to
``LinkManager._serve_accepted`` (a handshake, then requests on a forward connection) or, for a
link forged in the link table, straight to ``LinkManager.server.serve``, on a worker thread, while
this thread writes the input and reads every reply until the server closes its end.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from llm_datadist import BlocksCacheKey, CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole, Placement
from llm_datadist.transport import session, sockets
from llm_datadist.transport import wire
from llm_datadist.transport.host import host_identity
from llm_datadist.transport.session import Link

from wire_cases import Case, Target, guard_spans, notify_handler
from wire_oracle import Ranges, ServerModel, Session, Shadow

SERVER_ID = 41
LINK_SECRET = b"wire fuzz: correct horse battery staple"
#: The challenge nonce while the fuzz runs (``auth.new_nonce`` is patched), so that a case can
#: carry a valid proof although the whole connection is written before the server answers.
SERVER_NONCE = "5e" * 32
GUARD = 96
#: (model id, tensors, blocks, block bytes, whether the tensors share one buffer)
CACHES = ((0, 2, 8, 64, False), (1, 3, 4, 32, True))
SECRET_TEXT = b"TOP-SECRET, never registered. "
CASE_TIMEOUT_S = 30.0
#: Replies up to this size fit in the buffer of a socket pair (212 KiB by default): a case whose
#: input also fit is served on the calling thread, without a thread switch.
SYNC_REPLY_BYTES = 64 << 10


def guard_pattern(n: int, salt: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.uint32) * 167 + 13 * salt + 0xA5) & 0xFF).astype(np.uint8)


@dataclass
class Observed:
    replies: bytes
    escape: Optional[BaseException]
    escape_trace: str
    seconds: float
    threaded: bool  # served on the worker thread while this one wrote and read


class Worker:
    """One thread that runs the server's connection code, one job at a time; what a job raises
    is kept (it is what would have left a connection thread of the listener)."""

    def __init__(self) -> None:
        self._jobs: List[Callable[[], None]] = []
        self._cond = threading.Condition()
        self.done_r, self._done_w = os.pipe()
        self.error: Optional[BaseException] = None
        self.trace = ""
        self._thread = threading.Thread(target=self._loop, daemon=True, name="wire-fuzz-worker")
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs)
                job = self._jobs.pop(0)
            if job is None:
                return
            try:
                job()
            except BaseException as exc:  # the finding itself: recorded, compared by the caller
                self.error, self.trace = exc, traceback.format_exc()
            os.write(self._done_w, b"x")

    def submit(self, job: Callable[[], None]) -> None:
        self.error, self.trace = None, ""
        with self._cond:
            self._jobs.append(job)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._jobs.append(None)
            self._cond.notify()
        self._thread.join(5)
        os.close(self.done_r)
        os.close(self._done_w)


class FuzzServer:
    """The in-process cluster under fuzz and everything needed to check it."""

    def __init__(self) -> None:
        self.dd = LLMDataDist(LLMRole.PROMPT, SERVER_ID)
        config = LLMConfig()
        config.device_id = 0
        config.enable_cache_manager = True
        config.enable_remote_cache_accessible = True
        config.listen_ip_info = "127.0.0.1:0"
        self.dd.init(config.generate_options())
        self.worker: Optional[Worker] = None
        try:
            self._register()
            self.engine.set_read_guard(lambda peer_id, tag: self.guard_spans(tag))
            self.worker = Worker()
        except BaseException:
            self.close()
            raise

    def _register(self) -> None:
        self.engine = self.dd.engine
        self.links = self.engine.links
        self.cookie = self.links.planes["cma"].cookie  # the same-host plane's probe word
        rng = np.random.default_rng(20240610)
        self.buffers: List[np.ndarray] = []
        self.guards: List[Tuple[np.ndarray, np.ndarray]] = []  # (buffer, mask of its guard bytes)
        self.tensors: List[Tuple[int, int]] = []
        self.caches: Dict[int, Any] = {}
        self.cache_tensors: Dict[int, List[Tuple[int, int]]] = {}
        for model_id, count, blocks, block_bytes, shared in CACHES:
            tensor_bytes = blocks * block_bytes
            groups = [count] if shared else [1] * count
            addrs = []
            for group in groups:
                size = GUARD + group * (tensor_bytes + GUARD)
                array = guard_pattern(size, len(self.buffers))
                mask = np.ones(size, dtype=bool)
                for k in range(group):
                    start = GUARD + k * (tensor_bytes + GUARD)
                    array[start:start + tensor_bytes] = rng.integers(0, 256, tensor_bytes, dtype=np.uint8)
                    mask[start:start + tensor_bytes] = False
                    addrs.append(array.ctypes.data + start)
                self.buffers.append(array)
                self.guards.append((array, mask))
            desc = CacheDesc(count, [blocks, block_bytes], DataType.DT_UINT8, Placement.HOST)
            self.caches[model_id] = self.dd.cache_manager.register_blocks_cache(desc, addrs,
                                                                                BlocksCacheKey(SERVER_ID, model_id))
            self.cache_tensors[model_id] = [(a, tensor_bytes) for a in addrs]
            self.tensors += self.cache_tensors[model_id]
        self.secret = np.frombuffer(SECRET_TEXT * 40, dtype=np.uint8).copy()
        self.buffers.append(self.secret)
        self.pristine = [array.copy() for array in self.buffers]
        self.private = {"generation": (self.engine.generation_word.addr, self.engine.generation_word.value),
                        "probe": (self.cookie.addr, self.cookie.value)}

    @property
    def address(self) -> Tuple[str, int]:
        ip, _, port = self.dd.listen_ip_info.rpartition(":")
        return ip, int(port)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        self.dd.finalize()

    # -- what the fuzzer and its oracle know ------------------------------------------------------
    def target(self, linked: Sequence[int] = ()) -> Target:
        return Target(cluster_id=SERVER_ID, generation=self.engine.generation_word.value, linked=list(linked),
                      remote_accessible=self.links.remote_accessible, tensors=list(self.tensors),
                      buffers=[(a.ctypes.data, a.size) for a in self.buffers[:-1]],
                      secret=(self.secret.ctypes.data, self.secret.size),
                      private=[addr for addr, _ in self.private.values()], server_nonce=SERVER_NONCE,
                      link_secret=LINK_SECRET)

    def guard_spans(self, tag: bytes) -> Optional[List[Tuple[int, int]]]:
        """What the server's read guard allows ``tag`` (``wire_cases.guard_spans``)."""
        return guard_spans(tag, self.tensors, [(a.ctypes.data, a.size) for a in self.buffers[:-1]])

    def _model_guard(self, tag: bytes) -> Optional[Ranges]:
        spans = self.guard_spans(tag)
        return None if spans is None else Ranges(spans)

    def model(self) -> ServerModel:
        engine, links = self.engine, self.links
        same_host = {"probe": [self.cookie.addr, self.cookie.value],
                     "generation_addr": engine.generation_word.addr, "generation_fd": engine.generation_word.fd}
        return ServerModel(
            cluster_id=SERVER_ID, generation=engine.generation_word.value, ranges=Ranges(self.tensors),
            shadow=Shadow([(a.ctypes.data, a) for a in self.buffers]), table=engine.export_table(),
            same_host=same_host, server_nonce=SERVER_NONCE, remote_accessible=links.remote_accessible,
            role=engine.role, planes=links.plane_choice.offered(), host=host_identity(), unix_name=links.unix_name,
            guard=self._model_guard)

    @staticmethod
    def session(case: Case, linked: Tuple[int, ...] = ()) -> Session:
        handler = notify_handler if case.notify else None
        secret = LINK_SECRET if case.secret else None
        if case.mode == "direct":
            return Session(secret, handler, linked=linked, direct=(case.peer_id, case.unix))
        return Session(secret, handler, linked=linked, staged=(case.peer_id, case.token))

    def counters(self) -> Dict[str, int]:
        stats = self.links.stats
        return {"protocol_errors": self.engine.protocol_errors, "auth_failures": stats["auth_failures"],
                "handshake_failures": stats["handshake_failures"], "links_lost": stats["links_lost"],
                "refused_reads": stats["refused_reads"]}

    def private_words_intact(self) -> bool:
        return all(word.value == value for word, (_, value) in
                   ((self.engine.generation_word, self.private["generation"]),
                    (self.cookie, self.private["probe"])))

    def guards_intact(self) -> bool:
        """Every guard byte and the secret are as they were at the start (independent of the
        oracle's shadow)."""
        for (array, mask), pristine in zip(self.guards, self.pristine):
            if not np.array_equal(array[mask], pristine[mask]):
                return False
        return np.array_equal(self.secret, self.pristine[-1])

    # -- one connection ------------------------------------------------------------------------------
    def run(self, case: Case, reply_bytes: int = 1 << 30) -> Observed:
        """Serve one connection whose peer sends ``case.data`` and shuts down its side
        (``reply_bytes``: about how much the server will answer, when known)."""
        links = self.links
        links.secret = LINK_SECRET if case.secret else None
        links.set_notify_handler(notify_handler if case.notify else None)
        client, conn = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        staged: Optional[Link] = None
        try:
            conn.setblocking(False)  # as the listener leaves an accepted connection
            sockets.tune(conn)
            if case.mode == "direct":
                # A link made by the handshake: this connection is its forward one (_accept_data).
                peer = Link(case.peer_id, "DECODER", False, ("fuzz", 0), ["tcp"], token=case.token, want=(1, 1))
                if case.unix:
                    peer.unix = True
                    peer.pid, peer.uid = session.peer_credentials(conn)
                peer.incoming.append(conn)
                peer.ready = True
                with links._lock:
                    links._peers[case.peer_id] = peer
                job = lambda: links.server.serve(conn, "fuzz", peer)  # noqa: E731
            else:
                # A link whose handshake is done and whose data connections are awaited, and the
                # listener's bookkeeping of a connection in its handshake (_accept_loop).
                # (Its link request came from this process: the connection's SO_PEERCRED is this pid.)
                staged = Link(case.peer_id, "DECODER", False, ("fuzz", 0), ["tcp"], token=case.token, want=(1, 1),
                              stated=(os.getpid(), os.getuid()))
                with links._lock:
                    links._peers[case.peer_id] = staged
                    links._pending[case.token] = staged
                assert links.listener.admit(conn) is None
                job = lambda: links._serve_accepted(conn, "fuzz")  # noqa: E731
            return self._pump(client, case.data, job, staged, reply_bytes)
        finally:
            client.close()

    def _drop(self, staged: Optional[Link]) -> None:
        if staged is not None:
            # A link still waiting for connections, or holding this one as its reverse
            # connection: what the end of that link would do.
            self.links._drop_peer(staged.cluster_id, staged)

    def _pump(self, client: socket.socket, data: bytes, job: Callable[[], None], staged: Optional[Link],
              reply_bytes: int) -> Observed:
        started = time.monotonic()
        deadline = started + CASE_TIMEOUT_S
        client.setblocking(False)
        view = memoryview(data)
        sent = 0
        try:
            while sent < len(view):  # as much as the socket takes before the server starts
                sent += client.send(view[sent:sent + (1 << 20)])
        except BlockingIOError:
            pass
        writing = sent < len(view)
        if not writing:
            client.shutdown(socket.SHUT_WR)
            if reply_bytes <= SYNC_REPLY_BYTES:
                return self._serve_here(client, job, staged, started)
        worker = self.worker
        worker.submit(job)
        replies = bytearray()
        poller = select.poll()
        client_fd = client.fileno()
        poller.register(client_fd, select.POLLIN | (select.POLLOUT if writing else 0))
        poller.register(worker.done_r, select.POLLIN)
        done = eof = False
        while not (done and eof):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the server did not finish the connection in {CASE_TIMEOUT_S} s "
                                   f"(worker done: {done}, closed: {eof}, {sent} of {len(view)} bytes sent)")
            for fd, events in poller.poll(int(left * 1000) + 1):
                if fd == worker.done_r:
                    os.read(worker.done_r, 1)
                    done = True
                    poller.unregister(worker.done_r)
                    self._drop(staged)
                    continue
                if events & select.POLLOUT and writing:
                    try:
                        sent += client.send(view[sent:sent + (1 << 20)])
                    except BlockingIOError:
                        pass
                    except (BrokenPipeError, ConnectionResetError):
                        sent = len(view)  # the server has closed: the rest is never read
                    if sent >= len(view):
                        writing = False
                        try:
                            client.shutdown(socket.SHUT_WR)
                        except OSError:
                            pass
                        poller.modify(client_fd, select.POLLIN)
                if events & (select.POLLIN | select.POLLHUP | select.POLLERR) and not eof:
                    try:
                        chunk = client.recv(1 << 20)
                    except BlockingIOError:
                        continue
                    except ConnectionResetError:  # closed with our bytes unread; replies came first
                        chunk = b""
                    if chunk:
                        replies += chunk
                    else:
                        eof = True
                        poller.unregister(client_fd)
        return Observed(bytes(replies), worker.error, worker.trace, time.monotonic() - started, True)

    def _serve_here(self, client: socket.socket, job: Callable[[], None], staged: Optional[Link],
                    started: float) -> Observed:
        """The whole input is in the socket and the replies fit in its buffer: serve on this
        thread, then read what came back."""
        error, trace = None, ""
        try:
            job()
        except BaseException as exc:  # what would have left a connection thread
            error, trace = exc, traceback.format_exc()
        self._drop(staged)
        replies = bytearray()
        while True:
            try:
                chunk = client.recv(1 << 20)
            except BlockingIOError:
                raise AssertionError("the server left the connection open") from None
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                break
            replies += chunk
        return Observed(bytes(replies), error, trace, time.monotonic() - started, False)


def parse_frames(data: bytes) -> List[Tuple[int, int, int, int, bytes, int]]:
    """``(op, status, req_id, length, payload, version)`` of each reply frame (a refusal of a peer of
    another version comes in that version); a trailing partial frame is returned with op -1."""
    frames = []
    pos = 0
    while pos < len(data):
        if len(data) - pos < wire.HEADER_BYTES:
            frames.append((-1, 0, 0, 0, data[pos:], 0))
            break
        magic, version, op, status, req_id, length = wire.HEADER.unpack_from(data, pos)
        pos += wire.HEADER_BYTES
        if magic != wire.MAGIC or length > len(data) - pos:
            frames.append((-1, 0, 0, 0, data[pos - wire.HEADER_BYTES:], 0))
            break
        frames.append((op, status, req_id, length, data[pos:pos + length], version))
        pos += length
    return frames
