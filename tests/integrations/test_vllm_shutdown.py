"""A prefill engine holding blocks for a decode side that never comes still stops gracefully.

vLLM stops an engine the way ``vllm serve`` does here: its engine core process gets SIGTERM, drains
(it steps until no finished request holds blocks; ``shutdown_timeout``), and is killed if still
running when the grace period ends. The connector frees the held blocks when the drain begins
instead of letting a lease (120 s here) hold it up.

Needs vLLM (``pip install '.[vllm]'``, the CPU build 0.32.0); skipped without it.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from test_vllm import PRODUCER, Engine, needs_vllm, prompts_of, write_model

LEASE_S = 120
GRACE_S = 30
REPO_ROOT = Path(__file__).resolve().parents[2]
#: A prefill worker's connector (vLLM's factory's call) over loopback, its KV caches registered
#: (6 blocks; lease tokens on, so its engine has a read guard to take down at shutdown).
PREFILL_CONNECTOR = """
from types import SimpleNamespace
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from llm_datadist.integrations.vllm import LLMDataDistConnector
transfer = SimpleNamespace(engine_id="engine", is_kv_producer=True, is_kv_consumer=False,
                           kv_connector_extra_config={"listen_host": "127.0.0.1"})
config = SimpleNamespace(kv_transfer_config=transfer, cache_config=SimpleNamespace(block_size=4),
                         parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
connector = LLMDataDistConnector(config, KVConnectorRole.WORKER, SimpleNamespace(num_blocks=6, kv_cache_groups=[]))
connector.register_kv_caches({f"layer{i}": torch.zeros(6, 2, 4, 16, dtype=torch.float16) for i in range(2)})
"""


def _when(log: str, text: str) -> datetime:
    """The time of the first vLLM log line containing ``text`` (vLLM logs to the second)."""
    for line in log.splitlines():
        if text in line:
            return datetime.strptime(re.search(r"\d\d-\d\d \d\d:\d\d:\d\d", line).group(), "%m-%d %H:%M:%S")
    raise AssertionError(f"no log line contains {text!r}")


@needs_vllm
def test_a_held_lease_does_not_hold_up_shutdown(tmp_path):
    write_model(tmp_path / "model")
    prefill = Engine(tmp_path / "model", "producer", tmp_path / "prefill.log", {"kv_lease_s": LEASE_S},
                     engine_args={"shutdown_timeout": GRACE_S},
                     env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_LOGGING_LEVEL": "DEBUG"})
    try:
        prefill.wait_ready()
        held = prefill.generate(prompts_of([60], seed=4), 1, [{"do_remote_decode": True}])
        assert len(held[0]["kv_transfer_params"]["remote_block_ids"]) == 2  # kept for 120 s
        stopped = prefill.call(op="shutdown", grace_s=GRACE_S)
    finally:
        prefill.close()
    log = prefill.log.read_text(errors="replace")
    # The engine core process ended by itself, not killed when the grace period ran out, and
    # shut its scheduler (and so the connector) down on the way.
    assert stopped["exitcodes"] == [0], f"{stopped}; the log ends:\n" + "\n".join(log.splitlines()[-30:])
    assert "force killing" not in log
    assert "[shutdown] Scheduler: complete" in log
    # The drain did not wait for the lease (the rest of the stop is vLLM's own teardown).
    drained = _when(log, "request processing complete") - _when(log, "[shutdown] EngineCore: start mode=drain")
    assert drained.total_seconds() <= 2, drained
    assert stopped["seconds"] < GRACE_S
    # Said once.
    said = [line for line in log.splitlines() if line.startswith("llm_datadist:")]
    assert len(said) == 1 and "shutting down: freed the KV blocks of 1 finished request(s)" in said[0], said


@needs_vllm
def test_a_stopping_prefill_worker_frees_what_it_holds_and_refuses_late_releases(caplog):
    from llm_datadist.integrations.vllm import LLMDataDistConnectorMetadata
    from llm_datadist.integrations.vllm.leases import lease_request_id
    from llm_datadist.integrations.vllm.options import Options as _Options
    from llm_datadist.integrations.vllm.worker import Worker as _Worker

    def step(stopping: bool, **leases) -> set:
        meta = LLMDataDistConnectorMetadata()
        meta.reqs_to_send, meta.stopping = leases, stopping
        worker.start(meta)
        return worker.results().finished_sending

    worker = _Worker(PRODUCER, "engine", _Options.parse({"kv_lease_s": LEASE_S}), None)
    try:
        with caplog.at_level(logging.WARNING, logger="llm_datadist.integrations.vllm"):
            assert step(False, a=LEASE_S, b=LEASE_S) == set()
            assert step(True, c=LEASE_S) == {"a", "b", "c"}  # held ones, and one finishing now
            assert step(True, d=LEASE_S) == {"d"}
            a = lease_request_id(worker.leases.key, "a")  # as the scheduler handed it out
            assert worker.leases.on_release(7, {"op": "release", "request_id": a}) == {
                "request_id": a, "released": False,
                "why": "its blocks were already freed (the engine is shutting down)"}
            assert worker.stats["freed_at_shutdown"] == 4 and worker.stats["refused"] == 1
    finally:
        worker.close()
    said = [r.getMessage() for r in caplog.records if r.name == "llm_datadist.integrations.vllm"]
    assert len(said) == 1 and "freed the KV blocks of 3 finished request(s)" in said[0], said


@needs_vllm
def test_the_stop_signal_is_noticed_and_passed_on_to_the_handler_vllm_set():
    from llm_datadist.integrations.vllm.scheduler import StopSignals as _StopSignals

    received = []
    original = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        watcher = _StopSignals(watch=True)
        assert not watcher.stopping
        os.kill(os.getpid(), signal.SIGTERM)
        assert watcher.stopping and received == [signal.SIGTERM]
        watcher.close()
        assert signal.getsignal(signal.SIGTERM) is not watcher._handle  # vLLM's is back
        # a process whose handlers vLLM did not set keeps them: nothing is watched there
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        bystander = _StopSignals(watch=True)
        assert signal.SIGTERM not in bystander._previous
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        bystander.close()
    finally:
        signal.signal(signal.SIGTERM, original)


@needs_vllm
def test_connector_shutdown_twice_is_quiet(caplog, capfd):
    """vLLM may call ``shutdown`` again (at exit, from a finalizer): the second call does nothing,
    says nothing and raises nothing, in both roles."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from llm_datadist.integrations.vllm import LLMDataDistConnector

    scope = {}
    exec(PREFILL_CONNECTOR, scope)  # the worker role
    worker_side = scope["connector"]
    scheduler_side = LLMDataDistConnector(scope["config"], KVConnectorRole.SCHEDULER)
    engine = worker_side._worker.dd.engine
    # (its first shutdown takes the read guard of the lease tokens down)
    assert engine.initialized and worker_side._worker.cache is not None and worker_side.options.lease_tokens
    capfd.readouterr()
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        for connector in (worker_side, scheduler_side):
            connector.shutdown()
            connector.shutdown()
    assert not engine.initialized
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert capfd.readouterr() == ("", "")


@needs_vllm
def test_connector_shutdown_again_at_exit_prints_nothing():
    """As vLLM's engine client does: ``shutdown`` by hand, then again from a ``weakref`` finalizer
    when the interpreter exits. Nothing reaches stderr after the connector is up (it printed
    ``LLMException: llm_datadist is not initialized`` and a traceback)."""
    script = PREFILL_CONNECTOR + """
import sys, weakref
class EngineClient: pass
client = EngineClient()
weakref.finalize(client, connector.shutdown)
print("ready", file=sys.stderr, flush=True)
connector.shutdown()
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, ready, after = out.stderr.partition("ready\n")
    assert ready and after == "", out.stderr
