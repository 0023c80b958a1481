"""The copy kernel's PTX: ``llm_datadist/runtimes/dd_copy.cu`` -> ``include/llm_datadist/dd_copy_kernel.h``.

The package ships the descriptor-driven copy kernel as PTX text inside a C header, so that it builds
with no CUDA toolkit: the cuda binding hands the string to ``cuModuleLoadData`` at run time and the
driver compiles it for the GPU present. This script makes that header:

1. ``nvcc -ptx -arch=compute_70 -O3 --std=c++17`` on the ``.cu`` (nvcc 13 has no ``compute_70``: then
   ``compute_75``, and the ``.target`` directive is lowered to ``sm_70``; ptxas refuses any
   instruction a declared target lacks, so step 2 proves that the lowering is sound);
2. the ``.version`` directive lowered to the lowest PTX ISA, at or above :data:`VERSION_FLOOR`, with
   which ptxas assembles the PTX for every architecture of :data:`CHECK_ARCHS` it knows. A driver
   JIT-compiles PTX up to its own ISA only; nvcc 13 writes ``.version 9.0`` (CUDA 13 drivers), 7.0
   loads on every driver since CUDA 11.0;
3. the PTX's comment lines (compiler build ids) and blank lines dropped, the rest written as one C
   string literal, ``dd_copy_kernel_ptx``, with the kernel's name, block size and piece size as
   macros (read from the ``.cu``'s own ``#define`` lines, the one place they are written).

``python tools/copy_kernel.py`` (``make kernel``) rewrites the header; ``--check`` exits 1 when the
committed header differs from what nvcc gives now, and 0 with a message when nvcc or ptxas is
absent. ``NVCC`` / ``PTXAS`` in the environment name the tools; else they are looked up on PATH.
Standard library only.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "llm_datadist" / "runtimes" / "dd_copy.cu"
HEADER = ROOT / "include" / "llm_datadist" / "dd_copy_kernel.h"
KERNEL_NAME = "dd_copy_descs"
#: The GPU generation the PTX declares (.target): Volta and newer.
TARGET = "sm_70"
#: Virtual architectures asked of nvcc, in order (nvcc 13 dropped compute_70).
NVCC_ARCHS = ("compute_70", "compute_75")
NVCC_FLAGS = ("-O3", "--std=c++17")
#: The lowest .version written (CUDA 11.0, driver r450).
VERSION_FLOOR = (7, 0)
#: Real architectures the PTX must assemble for; those ptxas does not know are left out
#: (ptxas 13 has no sm_70; sm_75 is the lowest it builds).
CHECK_ARCHS = ("sm_70", "sm_75", "sm_80", "sm_90")
#: The .cu's macros copied into the header.
MACROS = ("DD_COPY_KERNEL_THREADS", "DD_COPY_KERNEL_PIECE_BYTES")

_REGENERATE = "run `python tools/copy_kernel.py` (make kernel) to regenerate it"


class ToolMissing(RuntimeError):
    """nvcc or ptxas is not installed."""


def find_tool(name: str) -> Optional[str]:
    """The path of ``nvcc`` / ``ptxas``: ``$NVCC`` / ``$PTXAS``, else PATH, else beside nvcc."""
    env = os.environ.get(name.upper())
    if env:
        return env if shutil.which(env) else None
    found = shutil.which(name)
    if found is None and name != "nvcc":
        nvcc = shutil.which(os.environ.get("NVCC") or "nvcc")
        if nvcc is not None:
            beside = Path(nvcc).resolve().with_name(name)
            found = str(beside) if beside.is_file() else None
    return found


def _tools() -> Tuple[str, str]:
    nvcc, ptxas = find_tool("nvcc"), find_tool("ptxas")
    if nvcc is None or ptxas is None:
        raise ToolMissing("nvcc is not installed" if nvcc is None else "ptxas is not installed")
    return nvcc, ptxas


def read_macros(source: Path = SOURCE) -> List[Tuple[str, str]]:
    """``(name, value text)`` of the :data:`MACROS` defined in the ``.cu``, in that order."""
    text = Path(source).read_text()
    found = []
    for name in MACROS:
        match = re.search(rf"^#define\s+{name}\s+(.+?)\s*$", text, re.MULTILINE)
        if match is None:
            raise ValueError(f"{source}: no #define {name}")
        found.append((name, match.group(1)))
    return found


def compile_ptx(source: Path = SOURCE, nvcc: Optional[str] = None) -> Tuple[str, str]:
    """``(ptx, arch)``: nvcc's PTX for the first of :data:`NVCC_ARCHS` it accepts."""
    nvcc = nvcc or _tools()[0]
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "dd_copy.ptx"
        for arch in NVCC_ARCHS:
            cmd = [nvcc, "-ptx", f"-arch={arch}", *NVCC_FLAGS, str(source), "-o", str(out)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode == 0:
                return out.read_text(), arch
            errors.append(f"{' '.join(cmd)}: {done.stderr.strip()}")
    raise RuntimeError("nvcc produced no PTX:\n  " + "\n  ".join(errors))


def _directive(ptx: str, name: str) -> str:
    match = re.search(rf"^\s*\.{name}\s+(\S+)\s*$", ptx, re.MULTILINE)
    if match is None:
        raise ValueError(f"the PTX has no .{name} directive")
    return match.group(1)


def set_directive(ptx: str, name: str, value: str) -> str:
    """``ptx`` with its ``.version`` / ``.target`` directive set to ``value``."""
    _directive(ptx, name)
    return re.sub(rf"^(\s*\.{name}\s+)\S+(\s*)$", rf"\g<1>{value}\g<2>", ptx, count=1, flags=re.MULTILINE)


def strip_comments(ptx: str) -> str:
    """The PTX without its whole-line ``//`` comments (build ids, ``.globl`` notes) and blank lines."""
    lines = [line.rstrip() for line in ptx.splitlines()]
    return "".join(line + "\n" for line in lines if line.strip() and not line.lstrip().startswith("//"))


def assemble(ptx: str, arch: str, ptxas: Optional[str] = None) -> Tuple[Optional[bool], str]:
    """Run ``ptxas -arch=<arch>`` on ``ptx``: ``(True, "")`` when it assembles, ``(False, errors)`` when
    ptxas refuses it, ``(None, message)`` when this ptxas does not know ``arch``."""
    ptxas = ptxas or _tools()[1]
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        done = subprocess.run([ptxas, f"-arch={arch}", "-O3", str(src), "-o", str(out)],
                              capture_output=True, text=True)
    if done.returncode == 0:
        return True, ""
    message = (done.stderr or done.stdout).strip()
    if "is not defined for option" in message:
        return None, message
    return False, message


def ptx_versions(ptxas: Optional[str] = None) -> List[Tuple[int, int]]:
    """The PTX ISA versions this ptxas reads (``ptxas --list-version``), ascending."""
    ptxas = ptxas or _tools()[1]
    done = subprocess.run([ptxas, "--list-version"], capture_output=True, text=True, check=True)
    versions = {tuple(int(part) for part in word.split(".")) for word in done.stdout.split()
                if re.fullmatch(r"\d+\.\d+", word)}
    return sorted(versions)  # type: ignore[arg-type]


def lower_version(ptx: str, archs: Sequence[str] = CHECK_ARCHS,
                  ptxas: Optional[str] = None) -> Tuple[str, List[str]]:
    """``(ptx, archs checked)``: ``ptx`` with the lowest ``.version`` >= :data:`VERSION_FLOOR` (and <=
    nvcc's) that assembles for every arch of ``archs`` this ptxas knows."""
    ptxas = ptxas or _tools()[1]
    written = tuple(int(part) for part in _directive(ptx, "version").split("."))
    known = [arch for arch in archs if assemble(ptx, arch, ptxas)[0] is not None]
    if not known:
        raise RuntimeError(f"ptxas knows none of {', '.join(archs)}")
    failures = []
    for version in ptx_versions(ptxas):
        if not VERSION_FLOOR <= version <= written:
            continue
        candidate = set_directive(ptx, "version", "%d.%d" % version)
        results = [(arch, *assemble(candidate, arch, ptxas)) for arch in known]
        bad = [f"{arch}: {message}" for arch, ok, message in results if not ok]
        if not bad:
            return candidate, known
        failures.append(f".version {version[0]}.{version[1]}: " + "; ".join(bad))
    raise RuntimeError("ptxas assembles the PTX at no .version:\n  " + "\n  ".join(failures))


def c_string(text: str, indent: str = "    ") -> str:
    """``text`` as C string literals, one per line of it."""
    escape = {"\\": "\\\\", '"': '\\"', "\t": "\\t", "\n": "\\n", "?": "\\?"}
    out = []
    for line in text.splitlines(keepends=True):
        body = "".join(escape.get(ch, ch) if " " <= ch <= "~" or ch in escape else "\\%03o" % ord(ch)
                       for ch in line)
        out.append(f'{indent}"{body}"')
    return "\n".join(out) if out else f'{indent}""'


def nvcc_release(nvcc: Optional[str] = None) -> str:
    """The CUDA release of ``nvcc`` (``nvcc --version``: "release 13.0"), e.g. ``"13.0"``."""
    nvcc = nvcc or _tools()[0]
    text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"release (\d+\.\d+)", text)
    return found.group(1) if found else "unknown"


def header_release(header: Path = HEADER) -> Optional[str]:
    """The nvcc release a header was generated with (None for a header that does not say)."""
    found = re.search(r"^ \* nvcc release: (\S+)$", Path(header).read_text(), re.M) if Path(header).is_file() else None
    return found.group(1) if found else None


def render_header(ptx: str, nvcc_arch: str, archs: Sequence[str], macros: Sequence[Tuple[str, str]],
                  release: str = "unknown") -> str:
    version, target = _directive(ptx, "version"), _directive(ptx, "target")
    defines = "".join(f"#define {name} {value}\n" for name, value in macros)
    return (
        "/*\n"
        " * Generated from llm_datadist/runtimes/dd_copy.cu by tools/copy_kernel.py: do not edit.\n"
        " * Regenerate with `make kernel` (python tools/copy_kernel.py); `python tools/copy_kernel.py --check`\n"
        " * and tests/core/test_copy_kernel.py check it against what nvcc gives.\n"
        f" * nvcc release: {release}\n"
        " *\n"
        f" * The PTX of {KERNEL_NAME} (dd_copy.cu describes its launch contract): nvcc -ptx -arch={nvcc_arch} "
        f"{' '.join(NVCC_FLAGS)},\n"
        f" * .target {target}, .version {version} (the lowest ISA from {VERSION_FLOOR[0]}.{VERSION_FLOOR[1]} "
        f"up that ptxas assembles for {', '.join(archs)}).\n"
        " * Load it with cuModuleLoadData(&module, dd_copy_kernel_ptx) and cuModuleGetFunction(&fn, module,\n"
        " * DD_COPY_KERNEL_NAME); its two parameters are (const dd_copy_desc *descs, unsigned long long count):\n"
        " * cuLaunchKernel's kernelParams = {&descs_device_pointer, &count}, block (DD_COPY_KERNEL_THREADS, 1, 1).\n"
        " */\n"
        "#ifndef LLM_DATADIST_DD_COPY_KERNEL_H\n"
        "#define LLM_DATADIST_DD_COPY_KERNEL_H\n"
        "\n"
        f'#define DD_COPY_KERNEL_NAME "{KERNEL_NAME}"\n'
        f"{defines}"
        "\n"
        "static const char dd_copy_kernel_ptx[] =\n"
        f"{c_string(ptx)};\n"
        "\n"
        "#endif /* LLM_DATADIST_DD_COPY_KERNEL_H */\n"
    )


def generate(source: Path = SOURCE) -> str:
    """The header's text as nvcc and ptxas give it now (:class:`ToolMissing` without them)."""
    nvcc, ptxas = _tools()
    ptx, nvcc_arch = compile_ptx(source, nvcc)
    ptx = set_directive(strip_comments(ptx), "target", TARGET)
    ptx, archs = lower_version(ptx, CHECK_ARCHS, ptxas)
    return render_header(ptx, nvcc_arch, archs, read_macros(source), nvcc_release(nvcc))


def check(header: Path = HEADER, source: Path = SOURCE) -> List[str]:
    """What disagrees, one sentence each; empty when the header is what nvcc gives now.

    :class:`ToolMissing` when nvcc or ptxas is absent.
    """
    recorded, installed = header_release(header), nvcc_release()
    if recorded is not None and recorded != installed:
        raise ToolMissing(f"{header} was generated with nvcc release {recorded}, this nvcc is release "
                          f"{installed} (another release may emit other PTX)")
    expected = generate(source)
    if not Path(header).is_file():
        return [f"{header} is missing: {_REGENERATE}"]
    if Path(header).read_text() != expected:
        return [f"{header} differs from what nvcc makes of {source}: {_REGENERATE}"]
    return []


def main(argv: List[str]) -> int:
    if argv[1:] not in ([], ["--check"]):
        print(f"usage: {argv[0]} [--check]", file=sys.stderr)
        return 2
    try:
        if argv[1:] == ["--check"]:
            problems = check()
            for problem in problems:
                print(problem, file=sys.stderr)
            return 1 if problems else 0
        text = generate()
    except ToolMissing as exc:
        print(f"{exc}: the copy kernel's header is not checked" if argv[1:] else f"{exc}: cannot generate",
              file=sys.stderr)
        return 0 if argv[1:] else 1
    if not HEADER.is_file() or HEADER.read_text() != text:
        HEADER.write_text(text)
        print(f"wrote {HEADER}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
