"""Helpers for tests and benchmarks that need real clusters in real processes.

``Cluster`` starts a process (``spawn``) that hosts one ``LLMDataDist`` (or C++-style
``LlmDataDist``) and runs functions sent to it::

    with Cluster(2, listen=True, plane="tcp") as decoder:
        ip, port = decoder.address
        decoder.call(register_blocks, ...)   # a module-level function f(state, *args)

A function runs as ``f(state, *args)`` where ``state`` is a ``ClusterState`` (``dd``, ``cm``,
``cpp``, a ``caches`` dict and an ``arrays`` dict for the test's own use). Its return value comes
back pickled; an exception comes back as ``ChildError`` carrying the child's traceback and, for
an ``LLMException``, its status code. Every call has a hard timeout; ``close()`` (or leaving the
``with`` block) finalizes, then terminates and finally kills the process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

_CTX = mp.get_context("spawn")


class ChildError(Exception):
    """An exception raised in a cluster process: ``kind`` is its class name, ``status_code`` the
    ``LLMStatusCode`` of an ``LLMException`` (else None)."""

    def __init__(self, kind: str, message: str, status_code: Optional[int], child_traceback: str) -> None:
        super().__init__(f"{kind} in cluster process: {message}\n--- child traceback ---\n{child_traceback}")
        self.kind = kind
        self.message = message
        self.status_code = status_code
        self.child_traceback = child_traceback


@dataclass
class ClusterState:
    cluster_id: int
    dd: Any = None
    cm: Any = None
    cpp: Any = None
    caches: Dict[Any, Any] = field(default_factory=dict)
    arrays: Dict[Any, Any] = field(default_factory=dict)
    scratch: Dict[Any, Any] = field(default_factory=dict)


def _start(cluster_id: int, role: str, listen: Optional[str], plane: Optional[str], options: Dict[str, str],
           api: str) -> Tuple[ClusterState, str]:
    if plane:
        os.environ["LLM_DATADIST_DATA_PLANE"] = plane
    state = ClusterState(cluster_id)
    if api == "cpp":
        from llm_datadist import cpp
        dd = cpp.LlmDataDist(cluster_id, getattr(cpp.LlmRole, role))
        opts = {cpp.OPTION_DEVICE_ID: "0", **options}
        if listen:
            opts[cpp.OPTION_LISTEN_IP_INFO] = listen
        status = dd.Initialize(opts)
        if status != cpp.LLM_SUCCESS:
            raise RuntimeError(f"Initialize returned {status}")
        state.cpp = dd
        return state, dd.listen_ip_info
    from llm_datadist import LLMConfig, LLMDataDist, LLMRole
    dd = LLMDataDist(getattr(LLMRole, role), cluster_id)
    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = options.pop("remote_cache_accessible", "1") == "1"
    if listen:
        config.listen_ip_info = listen
    opts = config.generate_options()
    opts.update(options)
    dd.init(opts)
    state.dd, state.cm = dd, dd.cache_manager
    return state, dd.listen_ip_info


def _reply(conn, message) -> bool:
    """Send ``message`` to the parent; False if the parent is gone (it was interrupted, or it
    closed this cluster without waiting): the child then ends without a word."""
    try:
        conn.send(message)
    except OSError:  # BrokenPipeError, ConnectionResetError
        return False
    except Exception as exc:  # a result that does not pickle: the parent gets that error instead
        return _reply(conn, ("err", type(exc).__name__, f"the result could not be sent back: {exc}", None,
                             traceback.format_exc()))
    return True


def _child_main(conn, cluster_id: int, role: str, listen: Optional[str], plane: Optional[str],
                options: Dict[str, str], api: str) -> None:
    try:
        state, address = _start(cluster_id, role, listen, plane, dict(options), api)
    except BaseException as exc:  # report start-up failures to the parent
        _reply(conn, ("err", type(exc).__name__, str(exc), getattr(exc, "status_code", None), traceback.format_exc()))
        return
    if not _reply(conn, ("ok", address)):
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message is None:
            break
        fn, args, kwargs = message
        try:
            reply = ("ok", fn(state, *args, **kwargs))
        except BaseException as exc:
            code = getattr(exc, "status_code", None)
            reply = ("err", type(exc).__name__, str(exc), None if code is None else int(code), traceback.format_exc())
        if not _reply(conn, reply):
            break
    if state.dd is not None:
        state.dd.finalize()
    if state.cpp is not None:
        state.cpp.Finalize()
    _reply(conn, ("ok", "finalized"))


class Cluster:
    """One cluster in its own process (see the module docstring)."""

    def __init__(self, cluster_id: int, role: str = "PROMPT", listen: bool = False, plane: Optional[str] = None,
                 options: Optional[Dict[str, str]] = None, api: str = "python", ip: str = "127.0.0.1",
                 timeout: float = 60.0) -> None:
        if api == "cpp":
            role = {"PROMPT": "kPrompt", "DECODER": "kDecoder", "MIX": "kMix"}.get(role, role)
        self.cluster_id = cluster_id
        self.timeout = timeout
        self._conn, child = _CTX.Pipe()
        self.process = _CTX.Process(target=_child_main, args=(child, cluster_id, role,
                                                              f"{ip}:0" if listen else None, plane,
                                                              dict(options or {}), api),
                                    daemon=True, name=f"llm_datadist-cluster-{cluster_id}")
        self.process.start()
        child.close()
        self.listen_ip_info = self._receive(timeout)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def address(self) -> Tuple[str, int]:
        ip, _, port = self.listen_ip_info.rpartition(":")
        return ip, int(port)

    def _receive(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            self.kill()
            raise TimeoutError(f"cluster {self.cluster_id} did not answer within {timeout} s")
        try:
            reply = self._conn.recv()
        except EOFError:
            raise ChildError("EOFError", f"cluster {self.cluster_id} exited "
                                         f"(exit code {self.process.exitcode})", None, "") from None
        if reply[0] == "ok":
            return reply[1]
        _, kind, message, code, tb = reply
        raise ChildError(kind, message, code, tb)

    def call(self, fn: Callable, *args, timeout: Optional[float] = None, **kwargs) -> Any:
        """Run ``fn(state, *args, **kwargs)`` in the cluster process and return its result."""
        self._conn.send((fn, args, kwargs))
        return self._receive(self.timeout if timeout is None else timeout)

    def send(self, fn: Callable, *args, **kwargs) -> None:
        """Start ``fn`` without waiting; collect its result with ``result()``."""
        self._conn.send((fn, args, kwargs))

    def result(self, timeout: Optional[float] = None) -> Any:
        return self._receive(self.timeout if timeout is None else timeout)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(None)
                if self._conn.poll(10):
                    self._conn.recv()
            except (OSError, EOFError):
                pass
            self.process.join(5)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(5)
            self.kill()
        self._conn.close()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def link(client: Cluster, server: Cluster, timeout_ms: int = 5000) -> Any:
    """Link ``client`` to ``server`` (one-sided ``link_clusters``); returns the status pair."""
    return client.call(_link, server.cluster_id, *server.address, timeout_ms)


def _link(state: ClusterState, remote_id: int, ip: str, port: int, timeout_ms: int):
    if state.cpp is not None:
        from llm_datadist import cpp
        info = cpp.ClusterInfo(remote_cluster_id=remote_id, local_ip_infos=[cpp.IpInfo(ip="127.0.0.1")],
                               remote_ip_infos=[cpp.IpInfo(ip=ip, port=port)])
        rets: list = []
        status = state.cpp.LinkLlmClusters([info], rets, timeout_ms)
        return int(status), [int(r) for r in rets]
    from llm_datadist import LLMClusterInfo
    info = LLMClusterInfo()
    info.remote_cluster_id = remote_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info(ip, port)
    status, rets = state.dd.link_clusters([info], timeout_ms)
    return int(status), [int(r) for r in rets]
