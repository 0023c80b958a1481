"""The descriptor-driven copy kernel (``llm_datadist/runtimes/dd_copy.cu``) and its generated header.

No GPU is needed:

* the committed ``include/llm_datadist/dd_copy_kernel.h`` is what ``tools/copy_kernel.py`` makes with
  the nvcc installed now (skipped without nvcc/ptxas);
* the PTX embedded in the header, read back by a C program that includes the header, assembles with
  ptxas for sm_70 (where this ptxas still knows it), sm_75, sm_80 and sm_90;
* the kernel's work split: the ``.cu`` itself, compiled for the CPU by
  ``tests/core/copy_kernel_emulation.cpp``, run for every (block, thread) of a launch on random
  descriptor lists, copies every destination byte exactly once, with the expected unit width, and
  writes nothing else and reads nothing but the sources.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNEL_DIR = ROOT / "llm_datadist" / "runtimes"
HEADER = ROOT / "include" / "llm_datadist" / "dd_copy_kernel.h"
EMULATION = Path(__file__).with_name("copy_kernel_emulation.cpp")
TOOL = ROOT / "tools" / "copy_kernel.py"

UNROLL = 4  # DD_COPY_KERNEL_UNROLL in dd_copy.cu
DESC_DTYPE = np.dtype([("src", "<u8"), ("dst", "<u8"), ("nbytes", "<u8")])  # dd_copy_desc


def _load_tool():
    spec = importlib.util.spec_from_file_location("llm_datadist_copy_kernel_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


def _need(name: str) -> str:
    path = tool.find_tool(name) if name in ("nvcc", "ptxas") else shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed")
    return path


# ---- (a) the header is what the tool generates ----

def test_header_is_what_nvcc_generates():
    _need("nvcc")
    _need("ptxas")
    recorded, installed = tool.header_release(HEADER), tool.nvcc_release()
    if recorded != installed:
        pytest.skip(f"the header was generated with nvcc release {recorded}; this nvcc is release {installed}, "
                    f"which may emit other PTX")
    assert HEADER.read_text() == tool.generate(), (
        "include/llm_datadist/dd_copy_kernel.h is stale: run `make kernel`")


def test_check_without_nvcc_skips_with_a_message(tmp_path):
    env = dict(os.environ, NVCC=str(tmp_path / "no-nvcc"))
    done = subprocess.run([sys.executable, str(TOOL), "--check"], capture_output=True, text=True, env=env)
    assert done.returncode == 0
    assert "nvcc is not installed" in done.stderr


# ---- (b) the embedded PTX assembles ----

_PRINT_HEADER = r"""
#include <stdio.h>
#include <string.h>
#include "llm_datadist/dd_copy_kernel.h"
int main(int argc, char **argv)
{
    if (argc > 1) {
        printf("%s %u %u %zu %zu\n", DD_COPY_KERNEL_NAME, (unsigned)DD_COPY_KERNEL_THREADS,
               (unsigned)DD_COPY_KERNEL_PIECE_BYTES, sizeof dd_copy_kernel_ptx, strlen(dd_copy_kernel_ptx));
        return 0;
    }
    fwrite(dd_copy_kernel_ptx, 1, sizeof dd_copy_kernel_ptx - 1, stdout);
    return 0;
}
"""


@pytest.fixture(scope="module")
def header_program(tmp_path_factory) -> Path:
    """A C program that includes the header: no argument prints the PTX, one prints the macros."""
    gcc = _need("gcc")
    tmp = tmp_path_factory.mktemp("copy_kernel_header")
    (tmp / "print.c").write_text(_PRINT_HEADER)
    subprocess.run([gcc, "-std=c99", "-Wall", "-Werror", "-I", str(ROOT / "include"), str(tmp / "print.c"),
                    "-o", str(tmp / "print")], check=True)
    return tmp / "print"


@pytest.fixture(scope="module")
def embedded_ptx(header_program) -> str:
    return subprocess.run([str(header_program)], check=True, capture_output=True, text=True).stdout


def test_header_macros(header_program, emulation):
    name, threads, piece, size, length = subprocess.run(
        [str(header_program), "macros"], check=True, capture_output=True, text=True).stdout.split()
    assert name == "dd_copy_descs"
    assert int(threads) == 256 == emulation.dd_emulate_threads()
    assert int(piece) == 256 << 10 == emulation.dd_emulate_piece_bytes()
    assert int(size) == int(length) + 1  # one NUL, at the end: cuModuleLoadData reads up to it


def test_embedded_ptx_declares_the_kernel(embedded_ptx):
    assert re.search(r"^\.version 7\.0$", embedded_ptx, re.MULTILINE)
    assert re.search(r"^\.target sm_70$", embedded_ptx, re.MULTILINE)
    # cuLaunchKernel's two parameters: the descriptor pointer and the count, both 64-bit.
    entry = re.search(r"\.visible \.entry dd_copy_descs\(\s*([^)]*)\)", embedded_ptx)
    assert entry is not None
    params = [p.strip() for p in entry.group(1).split(",")]
    assert params == [".param .u64 dd_copy_descs_param_0", ".param .u64 dd_copy_descs_param_1"]
    assert ".maxntid 256, 1, 1" in embedded_ptx
    assert "ld.global.cg.v4.u32" in embedded_ptx and "st.global.cg.v4.u32" in embedded_ptx


@pytest.mark.parametrize("arch", ["sm_70", "sm_75", "sm_80", "sm_90"])
def test_ptxas_assembles_the_embedded_ptx(embedded_ptx, arch):
    ptxas = _need("ptxas")
    ok, message = tool.assemble(embedded_ptx, arch, ptxas)
    if ok is None:
        pytest.skip(f"this ptxas cannot build {arch}: {message}")
    assert ok, message


# ---- (c) the work split, on the CPU ----

@pytest.fixture(scope="module")
def emulation(tmp_path_factory) -> ctypes.CDLL:
    """The kernel compiled for the CPU (copy_kernel_emulation.cpp includes dd_copy.cu)."""
    gxx = _need("g++")
    lib = tmp_path_factory.mktemp("copy_kernel_emulation") / "emulation.so"
    subprocess.run([gxx, "-std=c++17", "-O2", "-Wall", "-Wno-unknown-pragmas", "-Werror", "-shared", "-fPIC",
                    "-I", str(KERNEL_DIR), str(EMULATION), "-o", str(lib)], check=True)
    emu = ctypes.CDLL(str(lib))
    emu.dd_emulate_threads.restype = ctypes.c_uint
    emu.dd_emulate_piece_bytes.restype = ctypes.c_uint
    emu.dd_emulate_launch.restype = ctypes.c_ulonglong
    emu.dd_emulate_launch.argtypes = [
        ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_uint, ctypes.c_uint,
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_char_p, ctypes.c_size_t]
    return emu


def _aligned(nbytes: int, rng: np.random.Generator) -> np.ndarray:
    """``nbytes`` random bytes starting at a multiple of 64."""
    raw = rng.integers(0, 256, nbytes + 64, dtype=np.uint8)
    skip = -raw.ctypes.data % 64
    return raw[skip:skip + nbytes]


def _random_size(rng: np.random.Generator, unit: int, block: int) -> int:
    pick = rng.random()
    if pick < 0.1:
        return 0
    if pick < 0.3:
        units = int(rng.integers(1, 40))
    elif pick < 0.45:  # around the edge of an unrolled iteration
        units = int(rng.integers(0, 4)) * block * UNROLL + int(rng.integers(-2, 3))
    else:
        units = int(rng.integers(0, 70000 // unit + 1))
    return max(0, min(units * unit, 70000))


def random_layout(rng: np.random.Generator, count: int, block: int = 256) -> List[Tuple[int, int, int]]:
    """``count`` descriptors ``(src offset, dst offset, nbytes)``: alignments 0..15 and sizes 0..70000, half
    drawn freely and half a multiple of 16, 8 or 4 on all three; sources in order, destinations in order
    with 16 to 48 guard bytes before and after each."""
    layout = []
    src_at, dst_at = 0, 64
    for _ in range(count):
        unit = int(rng.choice([1, 1, 1, 16, 8, 4]))
        src_align = int(rng.integers(0, 16 // unit)) * unit
        dst_align = int(rng.integers(0, 16 // unit)) * unit
        nbytes = _random_size(rng, unit, block)
        src_at = -(-src_at // 16) * 16 + src_align
        dst_at = -(-dst_at // 16) * 16 + dst_align
        layout.append((src_at, dst_at, nbytes))
        src_at += nbytes + int(rng.integers(0, 33))
        dst_at += nbytes + int(rng.integers(16, 49))
    return layout


def _unit(src: int, dst: int, nbytes: int) -> int:
    bits = src | dst | nbytes
    return next(unit for unit in (16, 8, 4, 1) if bits % unit == 0)


def run_and_check(emulation, rng, layout, grid: int, block: int = 256) -> None:
    """Launch the kernel on ``layout`` in the emulator and prove what it did, byte by byte."""
    src_len = max([s + n for s, _, n in layout], default=0) + 64
    dst_len = max([d + n for _, d, n in layout], default=0) + 64
    src = _aligned(src_len, rng)
    dst = _aligned(dst_len, rng)  # random guard bytes
    readable = np.zeros(src_len, np.uint8)
    expected = dst.copy()
    expected_writes = np.zeros(dst_len, np.uint8)
    expected_width = np.zeros(dst_len, np.uint8)
    src_base, dst_base = src.ctypes.data, dst.ctypes.data
    descs = np.zeros(max(len(layout), 1), DESC_DTYPE)
    for k, (s, d, n) in enumerate(layout):
        descs[k] = (src_base + s, dst_base + d, n)
        readable[s:s + n] = 1
        expected[d:d + n] = src[s:s + n]
        expected_writes[d:d + n] = 1
        expected_width[d:d + n] = _unit(src_base + s, dst_base + d, n)
    source_before = src.copy()
    writes = np.zeros(dst_len, np.uint8)
    width = np.zeros(dst_len, np.uint8)
    error = ctypes.create_string_buffer(512)
    errors = emulation.dd_emulate_launch(
        descs.ctypes.data, len(layout), grid, block, src_base, src_len, readable.ctypes.data,
        dst_base, dst_len, writes.ctypes.data, width.ctypes.data, error, len(error))
    where = f"{len(layout)} descriptors, grid {grid}, block {block}"
    assert errors == 0, f"{where}: {errors} bad accesses, first: {error.value.decode()}"
    wrong = np.flatnonzero(writes != expected_writes)
    assert wrong.size == 0, (f"{where}: byte {wrong[0]} of the destination arena written {writes[wrong[0]]} "
                             f"times, expected {expected_writes[wrong[0]]}")
    assert np.array_equal(dst, expected), f"{where}: wrong bytes at {np.flatnonzero(dst != expected)[:8]}"
    assert np.array_equal(width, expected_width), (
        f"{where}: unit widths differ at {np.flatnonzero(width != expected_width)[:8]}")
    assert np.array_equal(src, source_before)


def test_no_descriptors(emulation):
    rng = np.random.default_rng(0)
    for grid in (1, 5):
        run_and_check(emulation, rng, [], grid)


def test_empty_and_tiny_descriptors(emulation):
    rng = np.random.default_rng(1)
    layout = [(0, 64, 0), (16, 128, 0), (32, 192, 1), (49, 256, 15), (64, 320, 16), (80, 400, 17)]
    for grid in (1, 2, len(layout), 3 * len(layout)):
        run_and_check(emulation, rng, layout, grid)


@pytest.mark.parametrize("seed", range(12))
def test_random_descriptor_lists(emulation, seed):
    rng = np.random.default_rng(1000 + seed)
    count = int(rng.integers(0, 301))
    layout = random_layout(rng, count)
    # one block for everything, a few blocks walking many descriptors each, one per descriptor, more
    # blocks than descriptors
    grid = [1, int(rng.integers(2, 17)), max(count, 1), count + int(rng.integers(1, 50))][seed % 4]
    run_and_check(emulation, rng, layout, grid)


@pytest.mark.parametrize("block", [1, 32, 96, 255])
def test_other_block_sizes(emulation, block):
    """The kernel strides by blockDim.x: a smaller block than DD_COPY_KERNEL_THREADS is slower, not wrong."""
    rng = np.random.default_rng(block)
    layout = random_layout(rng, 40, block)
    run_and_check(emulation, rng, layout, 7, block)


def test_every_unit_width_is_exercised():
    """The random layouts above reach the 16-, 8-, 4- and 1-byte paths, each with several iterations."""
    rng = np.random.default_rng(7)
    seen = {}
    for _ in range(4):
        for s, d, n in random_layout(rng, 300):
            unit = _unit(s, d, n)  # the arenas start at multiples of 64
            seen[unit] = max(seen.get(unit, 0), n // unit)
    assert set(seen) == {16, 8, 4, 1}
    assert min(seen.values()) > 256 * UNROLL * 2
