"""The one-command GPU check: what to run on a lent GPU machine, and what comes back.

On the GPU machine, at the root of a checkout (no network needed; nothing is installed from an
index)::

    python tools/gpu_check.py --out DIR          # or: make gpu-check (DIR = gpu-check/)

Anywhere with gcc, the same steps against the project's stub CUDA runtime (CI runs this)::

    python tools/gpu_check.py --stub --out DIR

Steps, in order, each a child process (its own process group) under its own time limit:

1. ``facts``: GPU name and memory (the driver API), driver version (``nvidia-smi``) and the CUDA
   version it supports, the cuda runtime library the package finds and how (``runtimes.load``,
   the package's own discovery), torch and its CUDA version, Python, Cython, numpy, pytest,
   cores. One line each, printed and in the report.
2. ``build``: ``python setup.py build_ext --inplace -j <cores>`` (``make build``; what ``pip install
   -e .`` builds, without pip), or if that fails the same from a folder of links without
   ``pyproject.toml`` (a setuptools older than 77 refuses its license field), timed, log in
   ``build.log``. Skipped where ``llm_datadist/_core`` and ``_io`` exist for this interpreter and
   are newer than every source they are built from.
3. ``gpu-tests``: ``pytest tests/gpu`` (but ``test_vllm_views.py``): the copy kernel, batch copies,
   pinned memory, IPC between processes, cuda_ipc and staging through the public API, torch cuda
   tensors as a DEVICE cache. On a GPU any skip fails the step.
4. ``device-suite``: with ``LLM_DATADIST_DEVICE=cuda``, the suite's tests of device memory the host
   cannot address (``DEVICE_SUITE``): core copies and swaps, pinned memory and IPC
   (``tests/core/test_device_copies.py``), the cuda_ipc plane between real processes (transfers,
   unregistering, unlinking, allocations of their own: four tests of ``test_plane_cuda_ipc.py``)
   and the staging plane (device caches both ways, byte ranges: ``test_staging.py``'s e2e). These
   tests choose the stub library themselves (they read its call log), so on the GPU machine they
   prove the build and these paths on its compiler and Python, not the GPU. Without hypothesis
   (which ``test_device_copies.py`` imports) that file is left out, and the report says so. The API contract and
   the engine tests are not in it: they read DEVICE caches through host views and pin the cpu
   runtime (``tests/api_styles.py``); the API's device paths on the GPU are those of step 3.
5. ``vllm-views``: ``tests/gpu/test_vllm_views.py``: vLLM 0.32's per-layer KV views (``LBHNC``,
   kernel-block splits, MLA under ``LBNHC``; one torch buffer, ``as_strided``) on the GPU,
   registered by the connector's code, copied, pushed and pulled over cuda_ipc between two
   processes, byte-exact against torch. Needs torch with CUDA, not vLLM. A skip fails the step on
   a GPU.
6. ``bench``: ``python -m llm_datadist bench --gpu only`` (GPU: 16 KiB and 2 MiB blocks, 128 MiB a
   call, 0.3 s per kind; stub: one 16 KiB row per kind, 64 KiB a call): each row with its baseline
   of the same run and its target -- copy_blocks D2D 0.85x of one cudaMemcpy D2D, swap_blocks
   0.8x of one pinned cudaMemcpy, cuda_ipc push/pull 0.85x of one cudaMemcpy D2D, staging
   push/pull 0.5x of one pinned D2H cudaMemcpy (and 0.5x of tcp with HOST caches, the bench's own
   row; both at 2 MiB blocks, as the bench sets staging's target) -- and one 4 KiB push over
   cuda_ipc: median and p99. On a GPU a missed target or a skipped row fails the step; on the stub
   the figures mean nothing (its device memory is host memory) and only that every row ran counts.

Budget: ``--budget-s`` (default 420) is split between the steps (``SHARES``); a step's limit is
its share plus what earlier steps left unused. A step whose limit is below its minimum is skipped
with that reason; a step still running at its limit is stopped (its process group killed) and
reported skipped, with what its log holds. ``--only`` runs some steps (a rerun).

What comes back, in ``DIR`` (at most 7 files, no folder): ``report.md`` (a table a person reads:
the facts, each step's status with its reason and time, each speed row with its ratio and target),
``report.json`` (the same, with every bench duration), ``build.log``, ``gpu-tests.log``,
``device-suite.log``, ``vllm-views.log``, ``bench.log``. Both reports are rewritten as each step
finishes, so a run killed at its limit leaves what was done (SIGTERM or Ctrl-C also stops the
running step's processes first). Exit status: 0 every step passed; 1 a step failed or was skipped;
2 the check cannot run here (no GPU without ``--stub``, no gcc with it, a bad argument); 130
interrupted.

``--stub``: the stub library (``tests/core/stub_runtime.c``, built with gcc into a temporary
folder) poses as libcudart and libcuda for every step (``LLM_DATADIST_CUDA_LIBRARY``,
``LLM_DATADIST_CUDA_DRIVER_LIBRARY``), and ``LLM_DATADIST_GPU_TESTS_STUB=1`` lets ``tests/gpu`` run
against it (their skips are then allowed). ``LLM_DATADIST_GPU_CHECK_STALL=<step>`` makes that
step's command hang (a process and its child that sleep), to test the budget
(``tests/tools/test_gpu_check.py``).
Standard library only.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
STUB_SOURCE = ROOT / "tests" / "core" / "stub_runtime.c"
STALL_ENV = "LLM_DATADIST_GPU_CHECK_STALL"
STUB_TESTS_ENV = "LLM_DATADIST_GPU_TESTS_STUB"  # tests/gpu/gpu_runtime.py
DRIVER_ENV = "LLM_DATADIST_CUDA_DRIVER_LIBRARY"  # the package's override of libcuda.so.1
DEFAULT_BUDGET_S = 420.0
#: step -> (share of the budget, the least time it is started with, in seconds)
SHARES = {"facts": (0.08, 5), "build": (0.22, 20), "gpu-tests": (0.20, 15), "device-suite": (0.15, 15),
          "vllm-views": (0.15, 10), "bench": (0.20, 15)}
STEPS = tuple(SHARES)
#: The command of a step named by LLM_DATADIST_GPU_CHECK_STALL: it hangs, and so does a child of it.
STALL_CODE = ("import os, subprocess, sys, time; "
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(86400)']); "
              "print('stalling: pids', os.getpid(), child.pid, flush=True); time.sleep(86400)")
#: What a step still running at its limit gets between SIGTERM and SIGKILL.
KILL_GRACE_S = 5.0
VLLM_VIEWS = "tests/gpu/test_vllm_views.py"
DEVICE_SUITE = (
    "tests/core/test_device_copies.py",
    "tests/transport/planes/test_plane_cuda_ipc.py::test_device_to_device_transfers_take_cuda_ipc_and_move_every_byte",
    "tests/transport/planes/test_plane_cuda_ipc.py::test_an_unregistered_cache_is_unmapped_and_never_written_through",
    "tests/transport/planes/test_plane_cuda_ipc.py::test_unlink_closes_every_mapping",
    "tests/transport/planes/test_plane_cuda_ipc.py::"
    "test_allocated_caches_have_allocations_of_their_own_and_registered_parts_are_counted",
    "tests/transport/planes/test_staging.py::test_e2e_device_caches_move_through_staging",
    "tests/transport/planes/test_staging.py::test_e2e_a_byte_range_of_each_block_moves_through_staging",
)
#: Suite files that import a package a GPU machine may lack: left out there, and said so.
DEVICE_SUITE_NEEDS = {"tests/core/test_device_copies.py": "hypothesis"}
BENCH_GPU = ("--gpu-sizes", "16KiB,2MiB", "--gpu-total", "128MiB", "--min-time", "0.3")
BENCH_STUB = ("--gpu-sizes", "16KiB", "--gpu-total", "64KiB", "--min-time", "0.01")
#: The sources of the extension modules (``setup.py``): newer than a built module = rebuild.
BUILD_SOURCES = ("setup.py", "llm_datadist/*.pyx", "llm_datadist/*.pxd",
                 "llm_datadist/runtimes/*.pxd", "llm_datadist/runtimes/*.pxi", "include/llm_datadist/*.h")
STUB_NOTE = ("stub run: the figures of the stub runtime mean nothing (its device memory is host memory); "
             "the rows prove that every path runs and is reported")


# -- facts (run as ``gpu_check.py --facts all|runtime`` in a child process) -----------------------

def driver_gpu(library: Optional[str] = None) -> dict:
    """What the CUDA driver API says: ``{"gpus": [...], "cuda": "13.0"}`` or ``{"why": ...}``."""
    library = library or os.environ.get(DRIVER_ENV) or "libcuda.so.1"
    try:
        cuda = ctypes.CDLL(library)
    except OSError as exc:
        return {"why": f"no CUDA driver: {exc}"}
    rc = cuda.cuInit(0)
    if rc != 0:
        return {"why": f"{library}: cuInit returned {rc}"}
    count, version = ctypes.c_int(0), ctypes.c_int(0)
    if not hasattr(cuda, "cuDeviceGetCount") or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 \
            or count.value < 1:
        return {"why": f"{library}: the driver reports no GPU"}
    out = {"gpus": []}
    if cuda.cuDriverGetVersion(ctypes.byref(version)) == 0:
        out["cuda"] = f"{version.value // 1000}.{version.value % 1000 // 10}"
    for index in range(count.value):
        device, name, memory = ctypes.c_int(0), ctypes.create_string_buffer(256), ctypes.c_size_t(0)
        cuda.cuDeviceGet(ctypes.byref(device), index)
        cuda.cuDeviceGetName(name, 256, device)
        cuda.cuDeviceTotalMem_v2(ctypes.byref(memory), device)
        out["gpus"].append(f"{name.value.decode(errors='replace')}, {memory.value / 2**30:.1f} GiB")
    return out


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception as exc:  # noqa: BLE001 - a fact, whatever went wrong
        return f"not importable ({type(exc).__name__}: {exc})"


def _runtime_fact() -> str:
    try:
        from llm_datadist import runtimes
    except Exception as exc:  # noqa: BLE001
        return f"pending: the package does not import yet ({type(exc).__name__}: {exc})"
    usable, why = runtimes.probe("cuda")
    try:
        runtime = runtimes.load("cuda")
    except Exception as exc:  # noqa: BLE001
        return f"none: {exc}"
    version = ctypes.c_int(0)
    try:
        ctypes.CDLL(runtime.library).cudaRuntimeGetVersion(ctypes.byref(version))
        release = f"CUDA runtime {version.value // 1000}.{version.value % 1000 // 10}"
    except (OSError, AttributeError):
        release = "runtime version unknown"
    names = [name for name in ("async_copy", "batched_copy", "pinned_host", "ipc") if getattr(runtime, name, False)]
    return (f"{runtimes.library_file(runtime)}, {release}, {'usable' if usable else 'NOT usable: ' + why}; "
            f"capabilities: {', '.join(names) or 'none'}")


def collect_facts(which: str) -> Dict[str, str]:
    """The report's facts, one line each (``which``: ``all``, or ``runtime`` after the build)."""
    facts: Dict[str, str] = {}
    if which == "all":
        stub = os.environ.get(STUB_TESTS_ENV) == "1"
        if stub:
            facts["GPU"] = ("none: the stub runtime poses as the GPU (tests/core/stub_runtime.c, device memory in "
                            "host RAM)")
            facts["driver"] = f"the stub: {os.environ.get(DRIVER_ENV)}"
        else:
            gpu = driver_gpu()
            facts["GPU"] = "; ".join(gpu.get("gpus", [])) or gpu.get("why", "?")
            smi = shutil.which("nvidia-smi")
            driver = "nvidia-smi not found"
            if smi:
                try:
                    driver = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
                except (subprocess.SubprocessError, IndexError, OSError) as exc:
                    driver = f"nvidia-smi failed: {exc}"
            facts["driver"] = f"{driver}, supports CUDA {gpu.get('cuda', '?')}"
    facts["cuda runtime"] = _runtime_fact()
    if which == "all":
        try:
            import torch
            cuda = torch.cuda.is_available()
            device = f", {torch.cuda.get_device_name(0)}" if cuda else ""
            facts["torch"] = f"{torch.__version__}, CUDA {torch.version.cuda}, cuda available: {cuda}{device}"
        except Exception as exc:  # noqa: BLE001
            facts["torch"] = f"not importable ({type(exc).__name__}: {exc})"
        facts["Python"] = f"{sys.version.split()[0]} ({sys.executable})"
        facts["Cython"], facts["numpy"], facts["pytest"] = (_version(m) for m in ("Cython", "numpy", "pytest"))
        usable_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        facts["cores"] = f"{os.cpu_count()} ({usable_cores} usable by this process)"
    return facts


# -- running steps ----------------------------------------------------------------------------------

@dataclass
class Result:
    step: str
    status: str  # pass, fail, skip
    ok: bool
    reason: str
    seconds: float = 0.0
    limit_s: Optional[float] = None
    log: Optional[str] = None
    details: dict = field(default_factory=dict)


def run_logged(cmd: Sequence[str], log: Path, env: Dict[str, str], limit_s: float,
               capture: bool = False, cwd: Path = ROOT) -> tuple:
    """Run ``cmd`` in ``cwd`` in a process group of its own, its output appended to ``log`` (or
    captured: stdout returned, stderr to ``log``); stopped at ``limit_s`` (``stop_group``).
    Returns ``(exit status or None if stopped, seconds, captured stdout)``."""
    if os.environ.get(STALL_ENV) == log.stem:
        cmd = [sys.executable, "-c", STALL_CODE]
    started = time.monotonic()
    with open(log, "ab") as out:
        out.write(f"$ {shlex.join(cmd)}\n".encode())
        out.flush()
        child = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE if capture else out,
                                 stderr=out, start_new_session=True)
        try:
            stdout, _ = child.communicate(timeout=max(0.1, limit_s))
        except subprocess.TimeoutExpired:
            stop_group(child)
            return None, time.monotonic() - started, b""
        except BaseException:
            stop_group(child)
            raise
    return child.returncode, time.monotonic() - started, stdout or b""


def stop_group(child: subprocess.Popen) -> None:
    """SIGTERM to ``child``'s process group, SIGKILL to what is left of it after ``KILL_GRACE_S``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            break
        if group_gone(child, KILL_GRACE_S):
            break
    try:
        child.communicate(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass


def group_gone(child: subprocess.Popen, wait_s: float) -> bool:
    """Whether ``child``'s process group has no member left within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        child.poll()  # reaps the leader: a group whose members are all zombies still answers
        try:
            os.killpg(child.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def log_tail(log: Path, lines: int = 3) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])


def pytest_outcome(junit: Path) -> dict:
    """Counts and skip reasons from pytest's JUnit XML."""
    try:
        root = ElementTree.parse(junit).getroot()
    except (OSError, ElementTree.ParseError):
        return {}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    skips = []
    for case in suite.iter("testcase"):
        skipped = case.find("skipped")
        if skipped is not None:
            skips.append(f"{case.get('name')}: {skipped.get('message', '')}")
    failed = [case.get("name") for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return dict(counts, skips=skips, failed=failed)


class Check:
    """One run: its steps, their budget, the report."""

    def __init__(self, args, out: Path, scratch: Path, env: Dict[str, str]) -> None:
        self.args, self.out, self.scratch, self.env = args, out, scratch, env
        self.stub = args.stub
        self.steps = args.only or list(STEPS)
        self.started = time.monotonic()
        self.started_at = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        self.results: List[Result] = []
        self.facts: Dict[str, str] = {}
        self.speed: List[dict] = []
        self.bench: dict = {}
        self.state = "running"

    # -- budget --------------------------------------------------------------------------------
    def limit_for(self, step: str) -> float:
        """The step's share of the budget and the shares earlier steps left unused."""
        budget = self.args.budget_s
        allotted = sum(SHARES[name][0] for name in STEPS[:STEPS.index(step) + 1] if name in self.steps) \
            / sum(SHARES[name][0] for name in self.steps) * budget
        spent = time.monotonic() - self.started
        return max(0.0, min(allotted, budget) - spent)

    def run(self) -> int:
        self.write()
        for step in STEPS:
            if step not in self.steps:
                continue
            limit = self.limit_for(step)
            minimum = SHARES[step][1]
            if limit < minimum:
                result = Result(step, "skip", False, f"would overrun the budget: {limit:.0f} s of --budget-s "
                                f"{self.args.budget_s:g} left for it, it needs at least {minimum} s", limit_s=limit)
            else:
                result = getattr(self, "step_" + step.replace("-", "_"))(limit)
                result.limit_s = limit
            self.results.append(result)
            print(f"[{time.monotonic() - self.started:5.0f} s] {step}: {result.status} ({result.seconds:.1f} s) "
                  f"{result.reason}", flush=True)
            self.write()
        self.state = "PASS" if all(r.ok for r in self.results) else "FAIL"
        self.write()
        return 0 if self.state == "PASS" else 1

    def stopped(self, step: str, limit: float, seconds: float, log: Path) -> Result:
        return Result(step, "skip", False, f"overran its limit of {limit:.0f} s: stopped after {seconds:.0f} s "
                      f"(its process group killed); the end of {log.name}: {log_tail(log)}", seconds, log=log.name)

    # -- the steps -----------------------------------------------------------------------------
    def _facts(self, which: str, limit: float, step: str) -> tuple:
        log = self.scratch / f"{step}.log"  # stderr of the facts child: quoted in the report, not kept
        rc, seconds, stdout = run_logged([sys.executable, str(Path(__file__).resolve()), "--facts", which], log,
                                         self.env, limit, capture=True)
        if rc is None:
            return None, seconds, self.stopped(step, limit, seconds, log)
        if rc != 0:
            return None, seconds, Result(step, "fail", False, f"the facts child exited {rc}: {log_tail(log, 5)}",
                                         seconds)
        return json.loads(stdout.decode()), seconds, None

    def step_facts(self, limit: float) -> Result:
        facts, seconds, failed = self._facts("all", limit, "facts")
        if failed:
            return failed
        self.facts.update(facts)
        for key, value in self.facts.items():
            print(f"        {key}: {value}", flush=True)
        return Result("facts", "pass", True, f"{len(self.facts)} facts", seconds)

    def built_from_sources(self) -> Optional[str]:
        """Why the extension modules are current (None: build them)."""
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        modules = [ROOT / "llm_datadist" / f"{name}{suffix}" for name in ("_core", "_io")]
        if not all(module.exists() for module in modules):
            return None
        sources = [path for pattern in BUILD_SOURCES for path in ROOT.glob(pattern)]
        newest = max(path.stat().st_mtime for path in sources)
        if min(module.stat().st_mtime for module in modules) < newest:
            return None
        return f"already built from the same sources ({', '.join(m.name for m in modules)} newer than every source)"

    def without_pyproject(self) -> Path:
        """A folder of links to what ``setup.py`` reads, without ``pyproject.toml``: a setuptools
        older than 77 refuses the project's SPDX license there, and ``build_ext`` needs none of
        it. The extensions land in the checkout (``llm_datadist`` is a link), the build folder in
        the scratch folder."""
        folder = self.scratch / "build-without-pyproject"
        folder.mkdir(exist_ok=True)
        for name in ("setup.py", "llm_datadist", "include", "tools"):
            if not (folder / name).exists():
                (folder / name).symlink_to(ROOT / name)
        return folder

    def step_build(self, limit: float) -> Result:
        current = self.built_from_sources()
        if current:
            result = Result("build", "skip", True, current)
        else:
            log = self.out / "build.log"
            log.write_bytes(b"")
            started = time.monotonic()
            cmd = [sys.executable, "setup.py", "build_ext", "--inplace", "-j", str(os.cpu_count() or 1)]
            for where, how in ((ROOT, "at the root"), (self.without_pyproject(), "without pyproject.toml")):
                rc, _, _ = run_logged(cmd, log, self.env, limit - (time.monotonic() - started), cwd=where)
                seconds = time.monotonic() - started
                if rc is None:
                    return self.stopped("build", limit, seconds, log)
                if rc == 0:
                    result = Result("build", "pass", True, f"built in {seconds:.1f} s: {shlex.join(cmd[1:])} {how}",
                                    seconds, log=log.name)
                    break
            else:
                return Result("build", "fail", False, f"both builds failed; the end of build.log: {log_tail(log, 5)}",
                              seconds, log=log.name)
        if "pending" in self.facts.get("cuda runtime", "pending"):
            facts, _, _ = self._facts("runtime", max(5.0, limit - result.seconds), "build-facts")
            if facts:
                self.facts.update(facts)
                print(f"        cuda runtime: {self.facts['cuda runtime']}", flush=True)
        return result

    def pytest_step(self, step: str, targets: Sequence[str], extra: Sequence[str], limit: float,
                    skips_fail: bool) -> Result:
        log = self.out / f"{step}.log"
        log.write_bytes(b"")
        junit = self.scratch / f"{step}.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}",
               *extra, *targets]
        rc, seconds, _ = run_logged(cmd, log, self.env, limit)
        if rc is None:
            return self.stopped(step, limit, seconds, log)
        outcome = pytest_outcome(junit)
        summary = (f"{outcome.get('passed', 0)} passed, {outcome.get('failures', 0) + outcome.get('errors', 0)} "
                   f"failed, {outcome.get('skipped', 0)} skipped")
        if rc != 0 or not outcome:
            failed = ", ".join(outcome.get("failed", [])[:5])
            return Result(step, "fail", False, f"pytest exited {rc}: {summary}" + (f" ({failed})" if failed else
                                                                                   f"; {log_tail(log)}"),
                          seconds, log=log.name, details=outcome)
        if outcome["tests"] == 0:
            return Result(step, "fail", False, "no test ran", seconds, log=log.name, details=outcome)
        if skips_fail and outcome["skipped"]:
            return Result(step, "fail", False, f"{summary}: a test skipped on a GPU: {outcome['skips'][0]}", seconds,
                          log=log.name, details=outcome)
        note = f"; skipped: {'; '.join(outcome['skips'])}" if outcome["skipped"] else ""
        return Result(step, "pass", True, summary + note, seconds, log=log.name, details=outcome)

    def step_gpu_tests(self, limit: float) -> Result:
        return self.pytest_step("gpu-tests", ["tests/gpu"], ["--ignore", VLLM_VIEWS], limit, not self.stub)

    def step_device_suite(self, limit: float) -> Result:
        missing = {path: module for path, module in DEVICE_SUITE_NEEDS.items()
                   if importlib.util.find_spec(module) is None}
        result = self.pytest_step("device-suite", [t for t in DEVICE_SUITE if t.split("::")[0] not in missing], [],
                                  limit, False)
        if missing:
            result.reason += "; left out: " + "; ".join(f"{path} ({module} is not installed)"
                                                         for path, module in missing.items())
        return result

    def step_vllm_views(self, limit: float) -> Result:
        # test_kv_views_are_vllms compares with vLLM itself, on the CPU: the suite runs it
        return self.pytest_step("vllm-views", [VLLM_VIEWS], ["-k", "not test_kv_views_are_vllms"], limit,
                                not self.stub)

    def step_bench(self, limit: float) -> Result:
        log = self.out / "bench.log"
        log.write_bytes(b"")
        raw = self.scratch / "bench.json"
        cmd = [sys.executable, "-m", "llm_datadist", "bench", "--gpu", "only",
               *(BENCH_STUB if self.stub else BENCH_GPU), "--json", str(raw)]
        rc, seconds, _ = run_logged(cmd, log, self.env, limit)
        if rc is None:
            return self.stopped("bench", limit, seconds, log)
        if rc != 0 or not raw.exists():
            return Result("bench", "fail", False, f"bench exited {rc}: {log_tail(log)}", seconds, log=log.name)
        self.bench = json.loads(raw.read_text()).get("gpu", {})
        self.speed = speed_rows(self.bench.get("results", []), judge=not self.stub)
        skipped = [f"{row['name']} {row['block']}: {row['skipped']}" for row in self.speed if row.get("skipped")]
        missed = [f"{row['name']} {row['block']} {row['ratio']:.2f}x < {row['target']}x" for row in self.speed
                  if row.get("met") is False]
        judged = [row for row in self.speed if row.get("met") is not None]
        if skipped:
            return Result("bench", "fail", False, f"{len(skipped)} row(s) not measured: {'; '.join(skipped)}",
                          seconds, log=log.name)
        if self.stub:
            return Result("bench", "pass", True, f"{len(self.speed)} rows measured; {STUB_NOTE}", seconds,
                          log=log.name)
        if missed:
            return Result("bench", "fail", False, f"{len(missed)} of {len(judged)} targets missed: {'; '.join(missed)}",
                          seconds, log=log.name)
        return Result("bench", "pass", True, f"{len(self.speed)} rows, {len(judged)} targets met", seconds,
                      log=log.name)

    # -- the report ----------------------------------------------------------------------------
    def payload(self) -> dict:
        return dict(state=self.state, mode="stub" if self.stub else "gpu", command=shlex.join(sys.argv),
                    started=self.started_at, elapsed_s=round(time.monotonic() - self.started, 1),
                    budget_s=self.args.budget_s, steps=self.steps, facts=self.facts,
                    results=[r.__dict__ for r in self.results], speed=self.speed, bench=self.bench,
                    note=STUB_NOTE if self.stub else None)

    def write(self) -> None:
        data = self.payload()
        for name, text in (("report.json", json.dumps(data, indent=1)), ("report.md", markdown(data))):
            temporary = self.out / f".{name}.tmp"
            temporary.write_text(text)
            os.replace(temporary, self.out / name)


def speed_rows(results: List[dict], judge: bool = True) -> List[dict]:
    """The report's speed rows from the bench's GPU rows: each as measured (ratio to its baseline,
    its target), plus staging push/pull against the same run's pinned D2H memcpy of the same
    bytes (the baseline of ``swap_blocks D2H``), with staging's target at the sizes the bench
    gives it one. ``met``: whether the ratio reaches the target (None: no target, or not
    ``judge``d: the stub's figures)."""
    out = []
    pinned = {row["block"]: row for row in results if row.get("operation") == "swap_blocks D2H" and "ratio" in row}
    for row in results:
        entry = dict(name=row["operation"], block=row["block"], baseline=row.get("baseline"), target=row.get("target"))
        if "skipped" in row:
            out.append(dict(entry, skipped=row["skipped"]))
            continue
        if row.get("latency"):
            out.append(dict(entry, latency=True, median_us=row["median_ns"] / 1e3, p99_us=row["p99_ns"] / 1e3,
                            baseline_median_us=row["baseline_median_ns"] / 1e3,
                            baseline_p99_us=row["baseline_p99_ns"] / 1e3, met=None))
            continue
        out.append(dict(entry, gbps=row["gbps"], baseline_gbps=row["baseline_gbps"], ratio=row["ratio"],
                        met=row.get("met") if judge else None))
        base = pinned.get(row["block"])
        if row["operation"].startswith("staging ") and base is not None:
            ratio = base["baseline_median_ns"] / row["median_ns"]
            target = row.get("target")
            out.append(dict(name=row["operation"], block=row["block"], baseline="one pinned memcpy D2H",
                            target=target, gbps=row["gbps"], baseline_gbps=base["baseline_gbps"], ratio=ratio,
                            met=None if target is None or not judge else ratio >= target))
    return out


def markdown(data: dict) -> str:
    mode = "stub runtime (no GPU)" if data["mode"] == "stub" else "GPU"
    lines = [f"# GPU check: {data['state']}", "",
             f"{mode}; `{data['command']}`; started {data['started']}, {data['elapsed_s']:.0f} s of a "
             f"{data['budget_s']:g} s budget; steps: {', '.join(data['steps'])}.", ""]
    if data["facts"]:
        lines += ["## Facts", ""] + [f"- {key}: {value}" for key, value in data["facts"].items()] + [""]
    lines += ["## Steps", "", "| step | status | seconds | limit s | reason | log |", "|---|---|---:|---:|---|---|"]
    for r in data["results"]:
        limit = "" if r["limit_s"] is None else f"{r['limit_s']:.0f}"
        reason = r["reason"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['step']} | {r['status']} | {r['seconds']:.1f} | {limit} | {reason} | {r['log'] or ''} |")
    done = {r["step"] for r in data["results"]}
    lines += [f"| {step} | not run yet | | | | |" for step in data["steps"] if step not in done]
    if data["speed"]:
        lines += ["", "## Speed (`python -m llm_datadist bench --gpu only`)", ""]
        if data["note"]:
            lines += [f"**{data['note']}.**", ""]
        lines += ["| row | block | GB/s | baseline | baseline GB/s | ratio | target |",
                  "|---|---|---:|---|---:|---:|---|"]
        for row in data["speed"]:
            if row.get("skipped"):
                lines.append(f"| {row['name']} | {row['block']} | skipped: {row['skipped']} | | | | |")
            elif row.get("latency"):
                lines.append(f"| {row['name']} | {row['block']} | median {row['median_us']:.1f} µs, p99 "
                             f"{row['p99_us']:.1f} µs | {row['baseline']} | median {row['baseline_median_us']:.1f} "
                             f"µs, p99 {row['baseline_p99_us']:.1f} µs | | - |")
            else:
                verdict = "-" if row["target"] is None else f">= {row['target']}x " + \
                    ("not judged (stub)" if row["met"] is None else "met" if row["met"] else "MISSED")
                lines.append(f"| {row['name']} | {row['block']} | {row['gbps']:.2f} | {row['baseline']} | "
                             f"{row['baseline_gbps']:.2f} | {row['ratio']:.2f}x | {verdict} |")
    return "\n".join(lines) + "\n"


# -- the command ------------------------------------------------------------------------------------

def build_stub(scratch: Path) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        raise SystemExit("gpu_check: --stub needs gcc on PATH to build tests/core/stub_runtime.c")
    target = scratch / "libstub_cuda.so"
    done = subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-o", str(target), str(STUB_SOURCE)],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise SystemExit(f"gpu_check: building the stub runtime failed: {done.stderr.strip()}")
    return target


def step_env(stub: Optional[Path]) -> Dict[str, str]:
    env = dict(os.environ, LLM_DATADIST_DEVICE="cuda", PYTHONUNBUFFERED="1")
    env.pop(STUB_TESTS_ENV, None)
    if stub is not None:
        env.update(LLM_DATADIST_CUDA_LIBRARY=str(stub), LLM_DATADIST_CUDA_DRIVER_LIBRARY=str(stub))
        env[STUB_TESTS_ENV] = "1"
    return env


def parse_args(argv: Optional[Sequence[str]] = None):
    parser = argparse.ArgumentParser(prog="tools/gpu_check.py",
                                     description="The GPU check: facts, build, GPU tests, device suite, vLLM's "
                                                 "GPU views, GPU bench; reports in --out. See the docstring.")
    parser.add_argument("--out", type=Path, help="folder for report.md, report.json and the step logs")
    parser.add_argument("--stub", action="store_true", help="run against the stub CUDA runtime (no GPU needed)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds for all steps, split between them (default {DEFAULT_BUDGET_S:g})")
    parser.add_argument("--only", type=lambda text: [s.strip() for s in text.split(",") if s.strip()],
                        help=f"comma-separated steps to run (of {', '.join(STEPS)}); default all")
    parser.add_argument("--facts", choices=("all", "runtime"), help=argparse.SUPPRESS)  # the facts child
    args = parser.parse_args(argv)
    if args.facts is None:
        if args.out is None:
            parser.error("--out DIR is required")
        if args.budget_s <= 0:
            parser.error("--budget-s must be positive")
        unknown = sorted(set(args.only or ()) - set(STEPS))
        if unknown:
            parser.error(f"unknown steps {', '.join(unknown)}; the steps are {', '.join(STEPS)}")
    return args


class Stopped(Exception):
    """SIGTERM (a command limit's ``timeout``) arrived: stop the running step, write the reports."""


def _on_sigterm(signum, frame) -> None:
    raise Stopped()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.facts:
        print(json.dumps(collect_facts(args.facts)))
        return 0
    if not args.stub:
        gpu = driver_gpu()
        if not gpu.get("gpus"):
            print(f"gpu_check: no GPU here ({gpu['why']}); --stub runs the check against the stub CUDA runtime",
                  file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as scratch:
        try:
            stub = build_stub(Path(scratch)) if args.stub else None
        except SystemExit as exc:
            print(exc, file=sys.stderr)
            return 2
        check = Check(args, args.out, Path(scratch), step_env(stub))
        signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            status = check.run()
        except (KeyboardInterrupt, Stopped) as exc:
            check.state = "INTERRUPTED"
            check.write()
            print(f"gpu_check: interrupted ({type(exc).__name__}); report: {args.out / 'report.md'}", file=sys.stderr)
            return 130
    print(f"gpu_check: {check.state} in {time.monotonic() - check.started:.0f} s; report: {args.out / 'report.md'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
