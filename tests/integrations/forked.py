"""Processes the live vLLM tests fork from one server of the session instead of starting afresh.

A process that imports torch and vLLM spends about 20 s of CPU on it before it does anything; the
suite starts dozens (engines, prefill workers). ``multiprocessing``'s forkserver imports them once
(``PRELOAD``, the engine script's environment defaults first, as the script sets them before it
imports vLLM) and forks each process from that server: ``context()`` for the tests' worker
processes (``prefill_child``, ``test_vllm_metrics``), ``EngineProcess`` for ``vllm_engine.py``
(``test_vllm.Engine``). An engine is handed the environment it would have been started with; one
that needs an environment vLLM reads at import (another logging level, another network namespace)
is still started as a script. A worker process has the server's environment: the session's, with
the engine script's defaults (no test of those changes its environment).
"""

from __future__ import annotations

import socket
import subprocess
from typing import Dict, List, Optional

PRELOAD = ["vllm_engine", "torch", "vllm", "vllm.entrypoints.llm", "vllm.config", "vllm.inputs",
           "vllm.sampling_params", "vllm.v1.request", "llm_datadist.integrations.vllm",
           "llm_datadist.integrations.vllm.worker", "llm_datadist.integrations.vllm.scheduler", "prefill_child"]


#: Every engine forked this session (``kill_leftovers``).
_ENGINES: List["EngineProcess"] = []


def context():
    """The forkserver context, its server importing ``PRELOAD`` when it starts (at the first
    process of the session)."""
    import multiprocessing

    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(PRELOAD)
    return forkserver


class EngineProcess:
    """``vllm_engine.py`` forked from the server with ``argv`` and ``env``, its stdin and stdout one
    socket, its stderr ``log``: the parts of ``subprocess.Popen`` the tests use (``stdin``,
    ``stdout``, ``pid``, ``poll``, ``wait``, ``kill``)."""

    def __init__(self, argv: List[str], env: Dict[str, str], log) -> None:
        ours, theirs = socket.socketpair()
        # (not daemonic: a TP engine starts workers; named as a started script's process is, which
        # vLLM's log lines show)
        self._process = context().Process(target=_run_engine, args=(list(argv), dict(env), str(log), theirs),
                                          name="MainProcess")
        self._process.start()
        _ENGINES.append(self)
        theirs.close()
        self.pid = self._process.pid
        self.stdin = ours.makefile("w", encoding="utf-8")
        self.stdout = ours.makefile("r", encoding="utf-8")
        ours.close()  # (the two files keep the connection open)

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("vllm_engine.py", timeout)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()


def kill_leftovers() -> int:
    """Kill the forked engines still running (a test that did not close one): multiprocessing would
    wait for them when this process exits. How many there were."""
    left = [engine for engine in _ENGINES if engine.poll() is None]
    for engine in left:
        engine.kill()
        engine.wait(30)
    _ENGINES.clear()
    return len(left)


def _run_engine(argv: List[str], env: Dict[str, str], log: str, channel: socket.socket) -> None:
    import vllm_engine

    vllm_engine.forked(argv, env, log, channel)
