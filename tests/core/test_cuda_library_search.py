"""Where the cuda runtime finds ``libcudart`` without ``LLM_DATADIST_CUDA_LIBRARY`` (issue 22):
a copy already loaded in the process, then NVIDIA's pip wheels (which ship only the versioned
``libcudart.so.13`` / ``.so.12``, no ``libcudart.so``), then the versioned names and
``libcudart.so`` through the dynamic loader; ``info`` says which file it loaded and how.

No GPU is needed: the stub runtime (tests/core/stub_runtime.c) is copied under those file names.
Each case runs in a fresh interpreter, since a loaded library stays loaded for the process's life.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import llm_datadist
from llm_datadist import runtimes
from llm_datadist.status import LLMException, LLMStatusCode

PACKAGE_ROOT = Path(llm_datadist.__file__).resolve().parents[1]


def _install(stub_libraries, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(stub_libraries["full"], path)
    return path


def _python(code: str, *paths: Path, env_extra=None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with ``paths`` on ``sys.path`` (after the package) and
    no library variable of ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_DATADIST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), *map(str, paths)])
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


REPORT = """
    import json, sys
    from llm_datadist import runtimes
    from llm_datadist.cli import info
    runtime = runtimes.load("cuda")
    facts = info.runtime_facts()
    print(json.dumps({"library": runtime.library, "file": runtimes.library_file(runtime),
                      "again": runtimes.load("cuda") is runtime, "probe": runtimes.probe("cuda"),
                      "info": facts["runtime_libraries"]["cuda"]}))
"""


def _report(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_pip_wheels_library_loads_without_the_variable(stub_libraries, tmp_path):
    """torch's CUDA wheels depend on nvidia-cuda-runtime (CUDA 13: ``nvidia/cu13/lib``) or
    nvidia-cuda-runtime-cu12 (``nvidia/cuda_runtime/lib``): the newest is found under sys.path
    before anything the dynamic loader would find; ``info`` names the file and the wheel."""
    site = tmp_path / "site-packages"
    cu13 = _install(stub_libraries, site / "nvidia" / "cu13" / "lib" / "libcudart.so.13")
    _install(stub_libraries, site / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so.12")
    report = _report(_python(REPORT, site))
    assert report["library"] == str(cu13) and report["again"]
    assert report["file"] == report["info"] == f"{cu13} (pip wheel under {site})"
    assert report["probe"] == [True, f"{cu13} loaded"]  # the stub reports one GPU

    # only the CUDA 12 wheel: that one
    shutil.rmtree(site / "nvidia" / "cu13")
    assert _report(_python(REPORT, site))["library"] == str(site / "nvidia" / "cuda_runtime" / "lib" /
                                                             "libcudart.so.12")


def test_a_copy_already_loaded_in_the_process_comes_first(stub_libraries, tmp_path):
    """A process whose torch loaded a libcudart (here: ctypes, as torch's libraries' DT_NEEDED
    would) uses that copy, even with a wheel's copy on sys.path."""
    site = tmp_path / "site-packages"
    _install(stub_libraries, site / "nvidia" / "cu13" / "lib" / "libcudart.so.13")
    torchs = _install(stub_libraries, tmp_path / "torch" / "lib" / "libcudart.so.13")
    report = _report(_python(f"import ctypes; ctypes.CDLL({str(torchs)!r}, mode=ctypes.RTLD_GLOBAL)\n"
                             + textwrap.dedent(REPORT), site))
    assert report["library"] == str(torchs) and report["again"]
    assert report["info"] == f"{torchs} (already loaded in this process)"


def test_versioned_names_through_the_dynamic_loader(stub_libraries, tmp_path):
    """With no wheel, the loader is asked for ``libcudart.so.13`` (then ``.12``, then
    ``libcudart.so``): a toolkit directory on LD_LIBRARY_PATH holding only the soname is enough,
    and ``info`` resolves the name to the file the loader opened."""
    lib = tmp_path / "cuda" / "lib64"
    real = _install(stub_libraries, lib / "libcudart.so.13.0.48")
    (lib / "libcudart.so.13").symlink_to(real.name)
    report = _report(_python(REPORT, env_extra={"LD_LIBRARY_PATH": str(lib)}))
    assert report["library"] == "libcudart.so.13"
    assert report["info"] == f"{real} (the dynamic loader's search path)"


def test_the_variable_still_names_the_only_library(stub_libraries, tmp_path):
    site = tmp_path / "site-packages"
    _install(stub_libraries, site / "nvidia" / "cu13" / "lib" / "libcudart.so.13")
    chosen = _install(stub_libraries, tmp_path / "chosen" / "libcudart.so")
    report = _report(_python(REPORT, site, env_extra={"LLM_DATADIST_CUDA_LIBRARY": str(chosen)}))
    assert report["library"] == str(chosen)
    assert report["info"] == f"{chosen} (LLM_DATADIST_CUDA_LIBRARY)"
    missing = _python(REPORT, site, env_extra={"LLM_DATADIST_CUDA_LIBRARY": str(tmp_path / "missing.so")})
    assert missing.returncode != 0 and f"cannot load the cuda runtime library {tmp_path / 'missing.so'}" in \
        missing.stderr  # no fallback to the wheel: the variable is the user's choice


def test_a_search_that_finds_nothing_says_what_each_candidate_answered(stub_libraries):
    spec = runtimes.register(runtimes.RuntimeSpec(
        name="searchrt", binding="cuda", description="test runtime", library="libsearchrt.so",
        search=lambda: (("/nonexistent/one/libsearchrt.so.2", "first place"),
                        ("/nonexistent/two/libsearchrt.so", "second place"))))
    try:
        assert [origin for _, origin in spec.library_candidates()] == ["first place", "second place"]
        with pytest.raises(LLMException) as info:
            runtimes.load("searchrt")
        assert info.value.status_code == LLMStatusCode.LLM_FAILED
        message = str(info.value)
        assert message.startswith("cannot load the searchrt runtime library; tried /nonexistent/one/libsearchrt.so.2: ")
        assert "; /nonexistent/two/libsearchrt.so: " in message and "No such file or directory" in message
    finally:
        runtimes.unregister("searchrt")
