"""How many xdist workers the whole suite runs in (``tests/xdist_workers.py``, ``tests/conftest.py``),
and that a run of named files stays in one process."""

import os
import subprocess
import sys

import pytest
import xdist_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("cores, expected", [(1, 0), (2, 2), (3, 3), (16, xdist_workers.MAX_WORKERS)])
def test_one_worker_per_core_up_to_the_cap_and_none_on_one_core(monkeypatch, cores, expected):
    monkeypatch.delenv("LLM_DATADIST_TEST_WORKERS", raising=False)
    assert xdist_workers.default_workers(cores) == expected


@pytest.mark.parametrize("value, expected", [("0", 0), ("1", 1), ("7", 7)])
def test_the_environment_chooses_the_workers(monkeypatch, value, expected):
    monkeypatch.setenv("LLM_DATADIST_TEST_WORKERS", value)
    assert xdist_workers.default_workers(2) == expected


@pytest.mark.parametrize("value", ["two", "-1", "1.5"])
def test_an_unusable_number_of_workers_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("LLM_DATADIST_TEST_WORKERS", value)
    with pytest.raises(pytest.UsageError, match="LLM_DATADIST_TEST_WORKERS"):
        xdist_workers.default_workers(2)


def test_a_run_of_named_files_stays_in_one_process():
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_doc_links.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, LLM_DATADIST_TEST_WORKERS="2"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "passed" in out.stdout and "bringing up nodes" not in out.stdout and "[gw" not in out.stdout


def test_the_whole_suite_starts_the_workers():
    """The README's command (no paths), here selecting no test: the workers start and each collects."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-k", "no_test_has_this_name"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, LLM_DATADIST_TEST_WORKERS="2"))
    assert out.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, out.stdout[-2000:] + out.stderr[-2000:]
    assert "created: 2/2 workers" in out.stdout, out.stdout[-2000:]


def test_a_vllm_modules_tests_run_in_one_worker():
    """``-n 2`` alone (the loadgroup chosen in ``conftest.py``, which the workers parse again): every
    test of one tests/integrations module runs in the same worker, as the module's engines must."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "2",
                          "tests/integrations/test_vllm_interface.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode in (0, pytest.ExitCode.NO_TESTS_COLLECTED), out.stdout[-2000:] + out.stderr[-2000:]
    ran = [line for line in out.stdout.splitlines() if line.startswith("[gw")]
    assert ran, out.stdout[-2000:]
    assert {line.split()[0] for line in ran} in ({"[gw0]"}, {"[gw1]"}), ran
    assert all("@tests/integrations/test_vllm_interface.py" in line for line in ran), ran
