"""``tools/gpu_check.py`` without a GPU: its refusal, its budget and its reports.

The whole ``--stub`` run is CI's (``.ci/run``), not the suite's. Here: without a GPU and without
``--stub`` it says so in one line and exits 2; a step that hangs (``LLM_DATADIST_GPU_CHECK_STALL``:
a process and its child that sleep) is stopped at its limit, its whole process group killed, and
reported skipped, as is a step left too little of the budget; the reports are written as steps
finish, so a check killed in the middle leaves what was done (and on SIGTERM it stops the running
step's processes first).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.py"


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_DATADIST_GPU_")}
    env.update(extra)
    return env


def _stalled_pids(log: Path) -> List[int]:
    found = re.search(r"stalling: pids (\d+) (\d+)", log.read_text()) if log.exists() else None
    return [int(pid) for pid in found.groups()] if found else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill(pids: List[int]) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_without_a_gpu_and_without_stub_it_says_so_in_one_line_and_exits_2(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          timeout=60, env=_env(LLM_DATADIST_CUDA_DRIVER_LIBRARY=str(tmp_path / "no-libcuda.so")))
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("gpu_check: no GPU here") and "--stub" in done.stderr
    assert not out.exists()


def test_a_hung_step_is_stopped_at_its_limit_and_a_step_without_time_is_skipped(tmp_path):
    """Budget 12 s for facts and vllm-views: facts' share (4 s) is below its minimum, so it is
    skipped unrun; vllm-views hangs and is stopped at its 12 s, its process and that process's
    child killed; exit status 1, both reasons in both reports."""
    out = tmp_path / "out"
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(SCRIPT), "--stub", "--out", str(out), "--only", "facts,vllm-views",
                           "--budget-s", "12"], capture_output=True, text=True, timeout=120,
                          env=_env(LLM_DATADIST_GPU_CHECK_STALL="vllm-views"))
    took = time.monotonic() - started
    pids = _stalled_pids(out / "vllm-views.log")
    try:
        assert done.returncode == 1, (done.stdout, done.stderr)
        assert len(pids) == 2, (out / "vllm-views.log").read_text()
        assert not any(_alive(pid) for pid in pids), "the stalled step's processes outlived it"
        assert took < 12 + 2 * 5 + 10, took  # the budget, the two kill grace times, start-up
        report = json.loads((out / "report.json").read_text())
        assert report["state"] == "FAIL" and report["mode"] == "stub"
        facts, views = report["results"]
        assert (facts["step"], facts["status"], facts["ok"], facts["seconds"]) == ("facts", "skip", False, 0.0)
        assert facts["reason"].startswith("would overrun the budget: 4 s of --budget-s 12 left for it, it needs "
                                          "at least 5 s")
        assert (views["step"], views["status"], views["ok"], views["log"]) == ("vllm-views", "skip", False,
                                                                              "vllm-views.log")
        stopped = re.match(r"overran its limit of 12 s: stopped after (\d+) s \(its process group killed\); the "
                           r"end of vllm-views.log: .*stalling: pids", views["reason"])
        assert stopped and 12 <= int(stopped.group(1)) <= 12 + 2 * 5, views["reason"]  # + the kill's grace times
        markdown = (out / "report.md").read_text()
        assert markdown.startswith("# GPU check: FAIL\n")
        assert "| facts | skip | 0.0 | 4 | would overrun the budget" in markdown
        assert "| vllm-views | skip | 1" in markdown and "overran its limit of 12 s" in markdown
        assert "vllm-views: skip" in done.stdout and "gpu_check: FAIL" in done.stdout
        assert sorted(os.listdir(out)) == ["report.json", "report.md", "vllm-views.log"]
    finally:
        _kill(pids)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_the_reports_hold_each_finished_step_while_the_next_runs(tmp_path, how):
    """A check killed during a step (here: one that hangs) leaves reports of the steps before it;
    on SIGTERM (``timeout``'s first signal) it also stops that step's processes and says so."""
    out = tmp_path / "out"
    check = subprocess.Popen([sys.executable, str(SCRIPT), "--stub", "--out", str(out), "--only",
                              "facts,device-suite"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env=_env(LLM_DATADIST_GPU_CHECK_STALL="device-suite"))
    pids: List[int] = []
    try:
        deadline = time.monotonic() + 90
        while not pids and time.monotonic() < deadline and check.poll() is None:
            time.sleep(0.2)
            pids = _stalled_pids(out / "device-suite.log")
        assert len(pids) == 2, "the stalled step never started"
        check.send_signal(how)  # as a command limit does
        assert check.wait(timeout=30) == (-signal.SIGKILL if how == signal.SIGKILL else 130)
        report = json.loads((out / "report.json").read_text())
        assert report["state"] == ("running" if how == signal.SIGKILL else "INTERRUPTED")
        if how == signal.SIGTERM:
            assert not any(_alive(pid) for pid in pids), "the running step's processes outlived the check"
        [facts] = report["results"]
        assert facts["step"] == "facts" and facts["status"] == "pass", facts
        assert report["facts"]["GPU"].startswith("none: the stub runtime poses as the GPU")
        assert report["facts"]["cuda runtime"].endswith("usable; capabilities: async_copy, batched_copy, "
                                                        "pinned_host, ipc")
        markdown = (out / "report.md").read_text()
        assert markdown.startswith(f"# GPU check: {report['state']}\n") and "| device-suite | not run yet |" in markdown
    finally:
        if check.poll() is None:
            check.kill()
            check.wait(timeout=30)
        _kill(pids)


@pytest.mark.parametrize("args, message", [(["--stub"], "--out DIR is required"),
                                           (["--stub", "--out", "x", "--only", "facts,gpu"], "unknown steps gpu"),
                                           (["--stub", "--out", "x", "--budget-s", "0"], "must be positive")])
def test_bad_arguments_exit_2(args, message):
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
