"""``engine.layerwise.LayerRunner`` alone, with a fake transfer function: the jobs it makes, the
order it runs them in, how errors and a stop end them."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from llm_datadist import _core
from llm_datadist._memory import Place
from llm_datadist.data_type import DataType
from llm_datadist.engine import values
from llm_datadist.engine.layerwise import LayerRunner
from llm_datadist.status import LLMException, LLMStatusCode

S = LLMStatusCode
CLUSTER = 3
LAYERS, ROWS, ROW_BYTES = 3, 2, 64


@pytest.fixture
def src():
    arrays = [np.zeros(ROWS * ROW_BYTES, np.uint8) for _ in range(2 * LAYERS)]
    record = values.new_record(2 * LAYERS, (ROWS, ROW_BYTES), ROWS * ROW_BYTES, DataType.DT_INT8, Place.HOST,
                               values.CONTIGUOUS, [a.ctypes.data for a in arrays], True, 1)
    yield record
    del arrays


def remote_table(num_tensors: int = 2 * LAYERS):
    """A peer's table with one cache (id 5) of ``num_tensors`` tensors shaped like the source."""
    memory = [np.zeros(ROWS * ROW_BYTES, np.uint8) for _ in range(num_tensors)]
    layout = _core.CacheLayout([m.ctypes.data for m in memory], ROWS, ROW_BYTES)
    cache = SimpleNamespace(cache_id=5, num_tensors=num_tensors, num_rows=ROWS, row_bytes=ROW_BYTES,
                            layout=layout, memory=memory)
    return SimpleNamespace(cache=lambda cache_id: cache if cache_id == 5 else None)


class Recorder:
    """The transfer function handed to the runner: plans each layer against ``table`` and notes
    ``(remote, plan bytes)``; ``fail`` maps ``(remote, call number)`` to a status to raise."""

    def __init__(self, table=None, fail=None) -> None:
        self.table = table
        self.fail = fail or {}
        self.calls = []

    def __call__(self, remote_id, local, write, make_plan):
        assert write is True
        plan = make_plan(self.table)
        self.calls.append((remote_id, plan.total_bytes))
        status = self.fail.get((remote_id, len(self.calls)))
        if status is not None:
            raise LLMException("injected", status_code=status)
        return plan


class Gate:
    """A synchronizer: records the layers asked for; ``answer(layer)`` decides."""

    def __init__(self, answer=lambda layer: True) -> None:
        self.answer = answer
        self.layers = []

    def synchronize_layer(self, layer, timeout):
        assert timeout is None
        self.layers.append(layer)
        return self.answer(layer)


def keyed(remote_id: int, layers: range, dst_start=None):
    return values.LayerTarget(remote_id, layers, 0, ref=values.CacheRowRef(5, 1), dst_layer_start=dst_start)


def run(runner, src, gate, jobs):
    thread, results = runner.start(src, gate, jobs)
    thread.join(10)
    assert not thread.is_alive()
    return results


def test_jobs_are_made_per_target_with_a_maker_per_layer(src):
    runner = LayerRunner(CLUSTER, Recorder())
    jobs = runner.jobs(src, [keyed(8, range(0, 2)), keyed(9, range(1, 3), dst_start=0)], None)
    assert [(remote, sorted(makers)) for remote, makers in jobs] == [(8, [0, 1]), (9, [1, 2])]
    raw = values.LayerTarget(8, range(2, 3), 1, dst_addrs=(0x1000, 0x2000))
    ((_, makers),) = runner.jobs(src, [raw], None)
    assert makers[2](None).total_bytes == 2 * ROW_BYTES


@pytest.mark.parametrize("target, says", [
    (keyed(8, range(0, LAYERS + 1)), "exceeds the 3 layers"),
    (values.LayerTarget(8, range(0, 2), 0, dst_addrs=(0x1000, 0x2000)), "needs 4 addresses"),
    (keyed(CLUSTER, range(0, 1)), "names this cluster"),
])
def test_bad_targets_are_refused(src, target, says):
    with pytest.raises(LLMException) as raised:
        LayerRunner(CLUSTER, Recorder()).jobs(src, [target], None)
    assert raised.value.status_code == S.LLM_PARAM_INVALID and says in str(raised.value)


def test_layers_run_in_order_each_after_its_gate(src):
    transfer = Recorder(remote_table())
    runner = LayerRunner(CLUSTER, transfer)
    jobs = runner.jobs(src, [keyed(8, range(1, 3)), keyed(9, range(0, 2))], None)
    gate = Gate()
    assert run(runner, src, gate, jobs) == [S.LLM_SUCCESS, S.LLM_SUCCESS]
    assert gate.layers == [0, 1, 2]
    assert transfer.calls == [(9, 2 * ROW_BYTES), (8, 2 * ROW_BYTES), (9, 2 * ROW_BYTES), (8, 2 * ROW_BYTES)]


def test_a_destination_layer_beyond_the_remote_cache_fails_that_job(src):
    transfer = Recorder(remote_table(num_tensors=2))
    runner = LayerRunner(CLUSTER, transfer)
    jobs = runner.jobs(src, [keyed(8, range(0, 2))], None)
    assert run(runner, src, Gate(), jobs) == [S.LLM_PARAM_INVALID]
    assert len(transfer.calls) == 1  # layer 0 went; layer 1 has no destination layer
    with pytest.raises(LLMException) as raised:
        jobs[0][1][1](transfer.table)
    assert "destination layer 1 exceeds the 1 layers" in str(raised.value)


def test_a_failed_transfer_ends_its_job_only(src):
    transfer = Recorder(remote_table(), fail={(8, 1): S.LLM_LINK_FAILED})
    runner = LayerRunner(CLUSTER, transfer)
    jobs = runner.jobs(src, [keyed(8, range(0, 3)), keyed(9, range(0, 3))], None)
    assert run(runner, src, Gate(), jobs) == [S.LLM_LINK_FAILED, S.LLM_SUCCESS]
    assert [remote for remote, _ in transfer.calls] == [8, 9, 9, 9]  # job 8 stopped after its failure


@pytest.mark.parametrize("answer", [lambda layer: layer < 1, lambda layer: 1 / (layer - 1) and True])
def test_a_gate_that_refuses_or_raises_ends_the_jobs_it_covers(src, answer):
    transfer = Recorder(remote_table())
    runner = LayerRunner(CLUSTER, transfer)
    jobs = runner.jobs(src, [keyed(8, range(0, 1)), keyed(9, range(0, 3))], None)
    gate = Gate(answer)
    assert run(runner, src, gate, jobs) == [S.LLM_SUCCESS, S.LLM_PARAM_INVALID]
    assert gate.layers == [0, 1] and [remote for remote, _ in transfer.calls] == [8, 9]


def test_stop_waits_for_a_job_which_then_transfers_nothing_more(src):
    transfer = Recorder(remote_table())
    runner = LayerRunner(CLUSTER, transfer)
    jobs = runner.jobs(src, [keyed(8, range(0, 3))], None)
    waiting, go_on = threading.Event(), threading.Event()

    def answer(layer):
        if layer == 1:
            waiting.set()
            go_on.wait(10)
        return True
    thread, results = runner.start(src, Gate(answer), jobs)
    assert waiting.wait(10)
    stopper = threading.Thread(target=runner.stop, args=(10.0,))
    stopper.start()
    stopper.join(0.3)
    assert stopper.is_alive(), "stop returned while a job thread was still running"
    assert runner.stopping
    go_on.set()
    stopper.join(10)
    assert not thread.is_alive()
    assert results == [S.LLM_ENGINE_FINALIZED] and len(transfer.calls) == 1
    # Until restarted, a new job starts nothing; after, it runs.
    assert run(runner, src, Gate(), runner.jobs(src, [keyed(8, range(0, 1))], None)) == [S.LLM_ENGINE_FINALIZED]
    runner.restart()
    assert not runner.stopping
    assert run(runner, src, Gate(), runner.jobs(src, [keyed(8, range(0, 1))], None)) == [S.LLM_SUCCESS]


def test_stop_gives_up_on_a_gate_that_never_returns(src, caplog):
    runner = LayerRunner(CLUSTER, Recorder(remote_table()))
    release = threading.Event()
    thread, results = runner.start(src, Gate(lambda layer: release.wait(10)),
                                   runner.jobs(src, [keyed(8, range(0, 1))], None))
    with caplog.at_level(logging.WARNING, logger="llm_datadist"):
        runner.stop(0.2)
    assert thread.is_alive() and "still waiting in its layer synchronizer" in caplog.text
    release.set()
    thread.join(10)
    assert results == [S.LLM_ENGINE_FINALIZED]
