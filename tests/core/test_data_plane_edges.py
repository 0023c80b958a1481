"""Edges of the data-plane checks: the receiver's range check (``_io.RangeSet``), the
same-host copy (``_io.cma_copy``) against a peer whose memory ends in an unmapped page, and
the core planners' block / row / tensor index checks at exactly the first invalid index.

Each test here is written to fail when its check is off by one byte or one index, or when a
short count from the kernel is taken for a whole transfer.
"""

from __future__ import annotations

import errno
import os
import select
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_datadist import _core, _io
from llm_datadist.status import LLMException, LLMStatusCode
from refusals import names

HOST = _core.load_runtime("host")
H2H = _core.MEMCPY_HOST_TO_HOST
JUNK = 0  # the other side of a probe descriptor: never registered, never looked at


def wire_plan(*descs):
    """A CopyPlan holding exactly ``descs`` ((src, dst, nbytes) each), unmerged."""
    return _io.plan_from_wire(b"".join(struct.pack("<QQQ", *d) for d in descs))


def probe(addr, nbytes, dst_side):
    """A one-descriptor plan whose destination (or source) range is ``[addr, addr + nbytes)``."""
    return wire_plan((JUNK, addr, nbytes) if dst_side else (addr, JUNK, nbytes))


# ------------------------------------------------------------------------------------------------
# RangeSet.first_outside: a pure-Python oracle
# ------------------------------------------------------------------------------------------------

def registered_bytes(ranges):
    return {b for addr, n in ranges for b in range(addr, addr + n)}


def oracle_inside(registered, addr, nbytes):
    """Whether a peer may touch ``[addr, addr + nbytes)``: every byte is registered. A
    zero-length range counts as inside when its address is a registered byte."""
    if nbytes == 0:
        return addr in registered
    return all(b in registered for b in range(addr, addr + nbytes))


def oracle_first_outside(ranges, descs, dst_side):
    registered = registered_bytes(ranges)
    for i, (src, dst, nbytes) in enumerate(descs):
        if not oracle_inside(registered, dst if dst_side else src, nbytes):
            return i
    return -1


SIDES = pytest.mark.parametrize("dst_side", [True, False], ids=["dst", "src"])


@SIDES
def test_range_set_refuses_one_byte_past_either_end(dst_side):
    ranges = _io.RangeSet([(1000, 100)])
    inside = [(1000, 100), (1000, 1), (1099, 1), (1050, 50), (1000, 0), (1099, 0)]
    outside = [(999, 101),   # starts one byte before
               (1000, 101),  # ends one byte past
               (999, 1), (1100, 1), (1099, 2), (1050, 51), (999, 2), (1100, 0), (999, 0),
               (0, 2**64 - 1), (1000, 2**64 - 1001)]
    for addr, n in inside:
        assert ranges.first_outside(probe(addr, n, dst_side), dst_side) == -1, (addr, n)
        assert ranges.contains(addr, n), (addr, n)
    for addr, n in outside:
        assert ranges.first_outside(probe(addr, n, dst_side), dst_side) == 0, (addr, n)
        assert not ranges.contains(addr, n), (addr, n)


@SIDES
def test_range_set_gaps_between_registrations(dst_side):
    # Two registrations with a one-byte gap, and two that touch (merged: one range).
    gap = _io.RangeSet([(1200, 100), (1000, 199)])
    assert gap.first_outside(probe(1000, 199, dst_side), dst_side) == -1
    assert gap.first_outside(probe(1200, 100, dst_side), dst_side) == -1
    for addr, n in [(1000, 200), (1198, 2), (1199, 1), (1199, 2), (1000, 300)]:
        assert gap.first_outside(probe(addr, n, dst_side), dst_side) == 0, (addr, n)
    touching = _io.RangeSet([(1100, 100), (1000, 100)])
    assert touching.first_outside(probe(1000, 200, dst_side), dst_side) == -1
    assert touching.first_outside(probe(1000, 201, dst_side), dst_side) == 0
    assert touching.first_outside(probe(999, 201, dst_side), dst_side) == 0


@SIDES
def test_first_outside_names_the_first_bad_descriptor(dst_side):
    ranges = _io.RangeSet([(1000, 100)])
    good, bad = (1000, 50), (1050, 51)
    descs = [good, good, bad, good, bad]
    plan = wire_plan(*[((JUNK, a, n) if dst_side else (a, JUNK, n)) for a, n in descs])
    assert ranges.first_outside(plan, dst_side) == 2
    # The other side of the descriptors (JUNK) is not what was asked about.
    assert ranges.first_outside(wire_plan(*[((JUNK, a, n) if dst_side else (a, JUNK, n))
                                            for a, n in [good, good]]), dst_side) == -1
    assert _io.RangeSet([]).first_outside(probe(1000, 1, dst_side), dst_side) == 0


# Registrations of a small address space, in the shapes that matter: one range, a one-byte gap,
# touching and overlapping ranges, single bytes, a range nested in another.
EXHAUSTIVE_LAYOUTS = [
    [(10, 20)],
    [(10, 10), (21, 10)],
    [(10, 10), (20, 10)],
    [(10, 15), (20, 10)],
    [(5, 1), (7, 1), (8, 1), (30, 1)],
    [(10, 30), (15, 5)],
    [(1, 44)],
    [],
]


@pytest.mark.parametrize("layout", EXHAUSTIVE_LAYOUTS, ids=lambda r: str(r))
def test_range_set_matches_oracle_exhaustively(layout):
    """Every range [addr, addr + n) of a 50-byte address space, both sides."""
    ranges = _io.RangeSet(layout)
    registered = registered_bytes(layout)
    for addr in range(0, 50):
        for n in range(0, 50 - addr + 2):
            expected = oracle_inside(registered, addr, n)
            assert ranges.contains(addr, n) == expected, (layout, addr, n)
            for dst_side in (True, False):
                got = ranges.first_outside(probe(addr, n, dst_side), dst_side)
                assert got == (-1 if expected else 0), (layout, addr, n, dst_side)


small_ranges = st.lists(st.tuples(st.integers(1, 400), st.integers(0, 60)), max_size=8)
probe_descs = st.lists(st.tuples(st.integers(0, 480), st.integers(0, 480), st.integers(0, 80)),
                       min_size=1, max_size=12)


@settings(max_examples=400, deadline=None)
@given(ranges=small_ranges, descs=probe_descs, dst_side=st.booleans())
def test_range_set_first_outside_matches_oracle(ranges, descs, dst_side):
    assert _io.RangeSet(ranges).first_outside(wire_plan(*descs), dst_side) == \
        oracle_first_outside(ranges, descs, dst_side)


@settings(max_examples=300, deadline=None)
@given(ranges=small_ranges, data=st.data())
def test_range_set_edges_of_each_registration(ranges, data):
    """Around both ends of every registration: the range itself, one byte longer at either end,
    one byte shorter at either end."""
    rs = _io.RangeSet(ranges)
    registered = registered_bytes(ranges)
    dst_side = data.draw(st.booleans())
    for addr, n in ranges:
        for a, m in [(addr, n), (addr - 1, n + 1), (addr, n + 1), (addr + 1, n - 1), (addr, n - 1),
                     (addr + n - 1, 1), (addr + n, 1), (addr - 1, 1)]:
            if m < 0 or a < 0:
                continue
            expected = -1 if oracle_inside(registered, a, m) else 0
            assert rs.first_outside(probe(a, m, dst_side), dst_side) == expected, (ranges, a, m)


TOP = 2**64


def test_range_set_holds_a_range_ending_at_the_top_of_the_address_space():
    """A registration may end at 2**64 exactly: it is stored and checked like any other."""
    ranges = _io.RangeSet([(TOP - 1024, 1024), (TOP - 4096, 1024)])
    assert ranges.spans() == [(TOP - 4096, TOP - 3072), (TOP - 1024, TOP)]
    assert ranges.contains(TOP - 1024, 1024) and ranges.contains(TOP - 1, 1)
    assert not ranges.contains(TOP - 1025, 2) and not ranges.contains(TOP - 3072, 1)
    assert not ranges.contains(TOP - 1, 2)  # would run past the top: not inside
    for dst_side in (True, False):
        assert ranges.first_outside(probe(TOP - 1024, 1023, dst_side), dst_side) == -1
        assert ranges.first_outside(probe(TOP - 1025, 1023, dst_side), dst_side) == 0
        assert ranges.first_outside(probe(TOP - 3073, 1, dst_side), dst_side) == -1
        assert ranges.first_outside(probe(TOP - 3072, 1, dst_side), dst_side) == 0
    assert ranges.overlaps(probe(TOP - 1, 0, True), True) is False
    assert ranges.overlaps(probe(TOP - 2000, 977, True), True)       # reaches TOP - 1024
    assert not ranges.overlaps(probe(TOP - 2000, 976, True), True)   # stops one byte short


@pytest.mark.parametrize("bad", [(TOP - 1024, 1025), (TOP, 1), (TOP - 1, 2), (-1, 4), (4, -1),
                                 (0, TOP + 1), (TOP + 5, 0)])
def test_range_set_refuses_ranges_outside_the_address_space(bad):
    with pytest.raises(ValueError):
        _io.RangeSet([(4096, 16), bad])
    with pytest.raises(TypeError):
        _io.RangeSet([(4096.0, 16)])


top_ranges = st.lists(st.tuples(st.integers(TOP - 400, TOP), st.integers(0, 60)).filter(
    lambda r: r[0] + r[1] <= TOP), max_size=6)
top_probes = st.lists(st.tuples(st.integers(TOP - 480, TOP - 1), st.integers(0, 80)).filter(
    lambda r: r[0] + r[1] < TOP), min_size=1, max_size=8)


def interval_oracle_first_outside(ranges, probes):
    merged = _merged(ranges)
    for i, (addr, n) in enumerate(probes):
        if not any(s <= addr < e and addr + n <= e for s, e in merged):
            return i
    return -1


@settings(max_examples=300, deadline=None)
@given(ranges=top_ranges, probes=top_probes, dst_side=st.booleans())
def test_range_set_at_the_top_matches_an_interval_oracle(ranges, probes, dst_side):
    rs = _io.RangeSet(ranges)
    plan = wire_plan(*[((JUNK, a, n) if dst_side else (a, JUNK, n)) for a, n in probes])
    assert rs.first_outside(plan, dst_side) == interval_oracle_first_outside(ranges, probes)
    assert rs.spans() == [tuple(m) for m in _merged(ranges)]


def _merged(ranges):
    spans = sorted((a, a + n) for a, n in ranges if n > 0)
    merged = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


# ------------------------------------------------------------------------------------------------
# cma_copy against a child whose mapping ends in an unmapped page
# ------------------------------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import ctypes, mmap, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = mmap.PAGESIZE
    addr = libc.mmap(None, 2 * page, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        sys.exit("mmap failed: errno %d" % ctypes.get_errno())
    ctypes.memset(addr, 0x5A, 2 * page)
    if libc.munmap(addr + page, page) != 0:
        sys.exit("munmap failed: errno %d" % ctypes.get_errno())
    sys.stdout.write("%d %d\\n" % (addr, page))
    sys.stdout.flush()
    sys.stdin.readline()          # the parent copies now; say what the page holds afterwards
    sys.stdout.write(ctypes.string_at(addr, page).hex() + "\\n")
    sys.stdout.flush()
    sys.stdin.readline()
""")

CHILD_TIMEOUT_S = 30


def _read_line(proc):
    ready, _, _ = select.select([proc.stdout], [], [], CHILD_TIMEOUT_S)
    assert ready, "the child process did not answer in time"
    line = proc.stdout.readline()
    assert line, f"the child process exited (rc {proc.poll()}): {proc.stderr.read()}"
    return line


def _mapped(pid, addr):
    """Whether ``addr`` lies in a mapping of process ``pid`` (from /proc/pid/maps)."""
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= addr < end:
                return True
    return False


class HoleChild:
    """A child process with one readable, writable page at ``addr`` followed by an unmapped one."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            self.addr, self.page = (int(x) for x in _read_line(self.proc).split())
        except BaseException:
            self.close()
            raise
        self.pid = self.proc.pid

    def check_layout(self):
        assert _mapped(self.pid, self.addr) and _mapped(self.pid, self.addr + self.page - 1)
        assert not _mapped(self.pid, self.addr + self.page), "the second page is mapped again"

    def page_bytes(self):
        """The child's view of its mapped page (ends the copying phase)."""
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return bytes.fromhex(_read_line(self.proc).strip())

    def close(self):
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write("\n\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=10)
            for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                stream.close()


@pytest.fixture
def hole_child():
    if not sys.platform.startswith("linux"):
        pytest.skip("process_vm_readv/writev are Linux system calls")
    child = HoleChild()
    try:
        child.check_layout()
        local = np.zeros(16, np.uint8)
        status, err = _io.cma_copy(child.pid, wire_plan((child.addr, local.ctypes.data, 16)),
                                       False, 5000)
        if status == _io.FEATURE_NOT_ENABLED:
            pytest.skip(f"process_vm_readv of a child is not permitted here ({os.strerror(err)}; "
                        f"see /proc/sys/kernel/yama/ptrace_scope)")
        assert (status, err) == (_io.SUCCESS, 0)
        assert (local == 0x5A).all()
        yield child
    finally:
        child.close()


def hole_cases(addr, page):
    """Remote ranges (offset from ``addr``, length) that run into the unmapped page, each after
    zero or more whole in-page ranges, so that the kernel's count comes back short."""
    end = page
    return {
        "one range across the boundary": [(end - 64, 128)],
        "in-page range then one across": [(0, 64), (end - 64, 128)],
        "several in-page ranges then one across": [(0, 32), (64, 32), (128, 32), (end - 8, 16)],
        "across, then an in-page range": [(end - 64, 128), (0, 64)],
        "the whole page and one byte more": [(0, page + 1)],
        "in-page range then one in the hole": [(0, 64), (end, 16)],
        "starts in the hole": [(end, 16)],
    }


CASES = list(hole_cases(0, 4096))


@pytest.mark.parametrize("pidfd", [False, True], ids=["pid", "pidfd"])
@pytest.mark.parametrize("write", [False, True], ids=["readv", "writev"])
@pytest.mark.parametrize("case", CASES)
def test_cma_copy_into_an_unmapped_page_reports_failure(hole_child, case, write, pidfd):
    """As links.py calls it: ``cma_copy(pid, plan, write, timeout_ms, pidfd)``."""
    if pidfd and not hasattr(os, "pidfd_open"):
        pytest.skip("os.pidfd_open is not available")
    fd = os.pidfd_open(hole_child.pid) if pidfd else -1
    ranges = hole_cases(hole_child.addr, hole_child.page)[case]
    local = np.full(4 * hole_child.page, 0xC3, np.uint8)
    descs, offset = [], 0
    for remote_offset, n in ranges:
        remote = hole_child.addr + remote_offset
        local_addr = local.ctypes.data + offset
        descs.append((local_addr, remote, n) if write else (remote, local_addr, n))
        offset += n
    try:
        status, err = _io.cma_copy(hole_child.pid, wire_plan(*descs), write, 5000, fd)
    finally:
        if fd >= 0:
            os.close(fd)
    hole_child.check_layout()
    assert status != _io.SUCCESS, f"{case}: a copy that ran into an unmapped page reported success"
    assert (status, err) == (_io.PARAM_INVALID, errno.EFAULT), (case, status, err)


def test_cma_copy_inside_the_page_still_succeeds(hole_child):
    """The control case: the same calls within the mapped page move every byte."""
    page = hole_child.page
    out = np.arange(page, dtype=np.uint32).astype(np.uint8)
    status = _io.cma_copy(hole_child.pid, wire_plan((out.ctypes.data, hole_child.addr, 64),
                                                        (out.ctypes.data + 64, hole_child.addr + 64, page - 64)),
                              True, 5000)
    assert status == (_io.SUCCESS, 0)
    back = np.zeros(page, np.uint8)
    assert _io.cma_copy(hole_child.pid, wire_plan((hole_child.addr, back.ctypes.data, page)),
                            False, 5000) == (_io.SUCCESS, 0)
    assert np.array_equal(back, out)
    assert hole_child.page_bytes() == out.tobytes()


def test_cma_read_bytes_across_the_boundary_reports_failure(hole_child):
    status, err, _ = _io.cma_read_bytes(hole_child.pid, hole_child.addr + hole_child.page - 8, 16)
    assert (status, err) == (_io.PARAM_INVALID, errno.EFAULT)
    status, err, data = _io.cma_read_bytes(hole_child.pid, hole_child.addr + hole_child.page - 8, 8)
    assert (status, err, data) == (_io.SUCCESS, 0, b"\x5a" * 8)


# ------------------------------------------------------------------------------------------------
# Planner index checks at the first invalid index, with guard bytes around the memory
# ------------------------------------------------------------------------------------------------

SENTINEL = 0xA5


class Guarded:
    """``num_tensors`` tensors of ``rows`` rows of ``row_bytes`` bytes, each tensor in its own
    numpy buffer with two rows and a bit of guard bytes before and after it."""

    def __init__(self, num_tensors, rows, row_bytes, seed):
        self.guard = 2 * row_bytes + 16
        self.tensor_bytes = rows * row_bytes
        rng = np.random.default_rng(seed)
        self.buffers = []
        for _ in range(num_tensors):
            buf = np.full(self.tensor_bytes + 2 * self.guard, SENTINEL, np.uint8)
            buf[self.guard:self.guard + self.tensor_bytes] = rng.integers(0, 255, self.tensor_bytes)
            self.buffers.append(buf)
        self.layout = _core.CacheLayout([b.ctypes.data + self.guard for b in self.buffers], rows, row_bytes)
        self.rows, self.row_bytes = rows, row_bytes

    def snapshot(self):
        return [b.copy() for b in self.buffers]

    def unchanged_since(self, snapshot):
        return all(np.array_equal(b, s) for b, s in zip(self.buffers, snapshot))

    def guards_intact(self):
        return all((b[:self.guard] == SENTINEL).all() and (b[self.guard + self.tensor_bytes:] == SENTINEL).all()
                   for b in self.buffers)

    def row(self, tensor, row):
        start = self.guard + row * self.row_bytes
        return self.buffers[tensor][start:start + self.row_bytes]


def refused_before_any_byte_moves(plan_call, caches, bad=None, run=True):
    """``plan_call()`` must raise LLMException(LLM_PARAM_INVALID), naming ``bad`` (so that it is
    refused for that value, not for another reason). If a wrong planner returns a plan instead,
    it is executed (``run``) so the failure shows what it would have written."""
    before = [c.snapshot() for c in caches]
    try:
        plan = plan_call()
    except LLMException as exc:
        assert exc.status_code == LLMStatusCode.LLM_PARAM_INVALID
        if bad is not None:
            assert names(exc.args[0], bad), (exc.args[0], bad)
        assert all(c.unchanged_since(s) for c, s in zip(caches, before))
        return
    if run:
        _core.execute(plan, HOST, H2H)
    guards = all(c.guards_intact() for c in caches)
    pytest.fail(f"the planner accepted an out-of-range index (guards intact after running it: {guards})")


@pytest.fixture
def pair():
    return Guarded(3, 5, 24, 1), Guarded(2, 4, 24, 2)


@pytest.mark.parametrize("bad", ["limit", "-1", "limit+1", "-limit"])
@pytest.mark.parametrize("side", ["src", "dst"])
def test_plan_blocks_refuses_block_index_at_the_limit(pair, side, bad):
    src, dst = pair
    limit = src.rows if side == "src" else dst.rows
    value = {"limit": limit, "-1": -1, "limit+1": limit + 1, "-limit": -limit}[bad]
    # The bad index after a valid one, so that a planner checking only the first entry fails.
    blocks = {"src": [0, 1], "dst": [1, 0]}
    blocks[side] = [blocks[side][0], value]
    # A wrong plan is run only where its writes would land in the guards (one index off).
    run = bad in ("limit", "-1")
    refused_before_any_byte_moves(
        lambda: _core.plan_blocks(src.layout, dst.layout, [0, 1], [0, 1], blocks["src"], blocks["dst"]),
        [src, dst], value, run)
    if side == "dst":
        refused_before_any_byte_moves(
            lambda: _core.plan_row_to_blocks(src.layout, dst.layout, [0, 1], [0, 1], 0, blocks["dst"]),
            [src, dst], value, run)


def test_plan_blocks_last_block_is_valid_and_stays_inside(pair):
    src, dst = pair
    plan = _core.plan_blocks(src.layout, dst.layout, [2, 0], [1, 0], [src.rows - 1, 0], [dst.rows - 1, 0])
    expected = [src.row(2, src.rows - 1).copy(), src.row(0, src.rows - 1).copy()]
    _core.execute(plan, HOST, H2H)
    assert np.array_equal(dst.row(1, dst.rows - 1), expected[0])
    assert np.array_equal(dst.row(0, dst.rows - 1), expected[1])
    assert src.guards_intact() and dst.guards_intact()


@pytest.mark.parametrize("bad", ["limit", "-1", "limit+1"])
@pytest.mark.parametrize("side", ["src", "dst"])
@pytest.mark.parametrize("planner", ["blocks", "rows", "row_to_blocks"])
def test_planners_refuse_tensor_index_at_the_limit(pair, planner, side, bad):
    src, dst = pair
    limit = src.layout.num_tensors if side == "src" else dst.layout.num_tensors
    value = {"limit": limit, "-1": -1, "limit+1": limit + 1}[bad]
    tensors = {"src": [0, 1], "dst": [1, 0]}
    tensors[side] = [tensors[side][0], value]
    call = {
        "blocks": lambda: _core.plan_blocks(src.layout, dst.layout, tensors["src"], tensors["dst"], [0], [0]),
        "rows": lambda: _core.plan_rows(src.layout, dst.layout, tensors["src"], tensors["dst"], 0, 0),
        "row_to_blocks": lambda: _core.plan_row_to_blocks(src.layout, dst.layout, tensors["src"],
                                                          tensors["dst"], 0, [0]),
    }[planner]
    # A tensor index past the address table would make a wrong planner read an address from
    # outside it: never run such a plan.
    refused_before_any_byte_moves(call, [src, dst], value, run=False)


@pytest.mark.parametrize("side", ["src", "dst"])
def test_plan_rows_refuses_row_at_the_limit(pair, side):
    src, dst = pair
    rows = {"src": 0, "dst": 0}
    rows[side] = src.rows if side == "src" else dst.rows
    # Two tensors on each side: the row is the only thing wrong.
    refused_before_any_byte_moves(
        lambda: _core.plan_rows(src.layout, dst.layout, [0, 1], [0, 1], rows["src"], rows["dst"]), [src, dst],
        rows[side])
    for value in (-1, -src.rows):
        rows[side] = value
        refused_before_any_byte_moves(
            lambda: _core.plan_rows(src.layout, dst.layout, [0, 1], [0, 1], rows["src"], rows["dst"]),
            [src, dst], value, run=False)
    if side == "src":
        refused_before_any_byte_moves(
            lambda: _core.plan_row_to_blocks(src.layout, dst.layout, [0, 1], [0, 1], src.rows, [0]),
            [src, dst], src.rows)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_plans_at_the_top_of_the_address_space_match_plans_below(data):
    """A tensor may end at 2**64 (the registry accepts it): its plans are the plans of the same
    cache anywhere else, shifted. Merging must not compute a range end that wraps to 0 (which
    made an overlapping chain such as blocks [5, 6] -> [6, 7] one memmove, not two copies)."""
    rows, row_bytes = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 32))
    tensor = rows * row_bytes
    n = data.draw(st.integers(1, 6))
    src_blocks = data.draw(st.lists(st.integers(0, rows - 1), min_size=n, max_size=n))
    dst_blocks = data.draw(st.lists(st.integers(0, rows - 1), min_size=n, max_size=n))
    same_cache = data.draw(st.booleans())
    low_base, top_base = 1 << 40, TOP - tensor
    plans = []
    for base in (low_base, top_base):
        layout = _core.CacheLayout([base], rows, row_bytes)
        other = layout if same_cache else _core.CacheLayout([base - 2 * tensor], rows, row_bytes)
        descs = [tuple(int(x) for x in d) for d in
                 _core.plan_blocks(layout, other, None, None, src_blocks, dst_blocks).descriptors()]
        plans.append([(s - base, d - base, k) for s, d, k in descs])
    assert plans[1] == plans[0]


def test_plan_rows_last_row_is_valid_and_stays_inside(pair):
    src, dst = pair
    expected = [src.row(t, src.rows - 1).copy() for t in (0, 1)]
    _core.execute(_core.plan_rows(src.layout, dst.layout, [0, 1], [0, 1], src.rows - 1, dst.rows - 1),
                  HOST, H2H)
    assert all(np.array_equal(dst.row(t, dst.rows - 1), expected[t]) for t in (0, 1))
    assert src.guards_intact() and dst.guards_intact()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_block_indices_around_the_limit(data):
    """Random block lists drawn from [-2, rows + 2): the plan is made iff every index is in
    [0, rows) on its side; made plans stay inside the tensors, refused ones move nothing."""
    rows_src, rows_dst = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 6))
    row_bytes = data.draw(st.integers(1, 16))
    src, dst = Guarded(2, rows_src, row_bytes, 3), Guarded(2, rows_dst, row_bytes, 4)
    n = data.draw(st.integers(1, 5))
    sb = data.draw(st.lists(st.integers(-2, rows_src + 1), min_size=n, max_size=n))
    db = data.draw(st.lists(st.integers(-2, rows_dst + 1), min_size=n, max_size=n))
    valid = all(0 <= b < rows_src for b in sb) and all(0 <= b < rows_dst for b in db)
    if not valid:
        refused_before_any_byte_moves(lambda: _core.plan_blocks(src.layout, dst.layout, None, None, sb, db),
                                      [src, dst])
        return
    expected = [[dst.row(t, r).copy() for r in range(rows_dst)] for t in range(2)]
    for t in range(2):
        for s, d in zip(sb, db):
            expected[t][d] = src.row(t, s).copy()
    _core.execute(_core.plan_blocks(src.layout, dst.layout, None, None, sb, db), HOST, H2H)
    assert src.guards_intact() and dst.guards_intact()
    for t in range(2):
        for r in range(rows_dst):
            assert np.array_equal(dst.row(t, r), expected[t][r])
