"""``python -m llm_datadist``: the commands run and say what they do."""

from __future__ import annotations

import json
import subprocess
import sys


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "llm_datadist", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_demo_verifies_at_small_size():
    out = run("demo", "--layers", "2", "--blocks", "8")
    assert out.returncode == 0, out.stderr
    assert "verified" in out.stdout and "geometry: 2 layers" in out.stdout
    assert "transport layer" in out.stdout  # says what is not in this build yet


def test_info_reports_runtime_and_build():
    out = run("info", "--json")
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout)
    assert facts["build"] in ("release", "debug")
    assert facts["device_runtime"].startswith(("cpu", "acl", "cuda"))
    assert facts["runtimes"]["cpu"].startswith("available")


def test_help_lists_commands():
    out = run("--help")
    assert out.returncode == 0
    for command in ("demo", "info", "bench"):
        assert command in out.stdout
