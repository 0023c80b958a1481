"""``python -m llm_datadist bench``: block size x data plane x direction, against an in-run memcpy.

The processes, caches and timing are those of the transport benchmarks (``workload.py``): a
server cluster and a client cluster per plane between processes (``cma``: same-host
``process_vm_writev``/``readv``; ``tcp``: loopback), linked, each owning a one-tensor HOST blocks
cache of twice the blocks a transfer moves; sources and destinations are random non-adjacent block
ids, so every block is one descriptor. For each block size:

* ``memcpy`` (the baseline): ``lowlevel.memcpy_baseline``, a bare single-threaded memcpy loop over
  the same descriptors inside one process;
* ``local copy``: the public ``copy_blocks`` of the same descriptors inside one process (the
  ``local`` data plane has no direction);
* ``<plane> push`` / ``<plane> pull``: ``push_blocks`` (client -> server) and ``pull_blocks``
  (server -> client), completion included.

GPU rows (``--gpu``, ``device_workload.py``): where a runtime whose memory the host cannot
address is usable (cuda on a GPU machine), ``copy_blocks`` device-to-device, ``swap_blocks`` both
ways, ``push_blocks`` / ``pull_blocks`` over ``cuda_ipc`` and over ``staging`` between processes
on this host, each against a baseline of the same bytes in the same run (one runtime memcpy, one
pinned memcpy, the tcp plane with HOST caches) and the issue's target ratio, and the latency of
one 4 KiB push over ``cuda_ipc`` (median and p99, each call timed alone); elsewhere they are
skipped with the reason.

Each point moves ``total`` bytes a call (``total // block`` blocks, at least one). The baseline is
one thread; a same-host transfer of 8 MiB or more a call is split over two threads, and a TCP one
over the link's two connections, each on a thread (``stripe_bytes`` / ``stripes`` of each plane
in ``transport/planes/``), so on a machine with two free cores these can beat the baseline: every
row, the table and the plot say how many threads moved the bytes. Durations are
taken inside the process that makes the call, around the call alone. The kinds of one block size
are measured interleaved, a batch of calls each in turn, until each has run ``min_time`` seconds
and ``min_repetitions`` times, so that the baseline and the transfers share the same stretches of
a noisy machine. Reported: medians; GB/s = bytes / median; ratio = median of the baseline /
median of the kind (1.0x = as fast as one memcpy loop).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from llm_datadist.cli.console import Progress, format_size, short_size, sigint_for_parent_only
from llm_datadist.cli.info import build_facts, host_facts, memory_shortfall

LOCAL = "local"


def all_planes() -> Tuple[str, ...]:
    """``local`` and every registered data plane (``transport.planes``)."""
    from llm_datadist.transport import planes
    return (LOCAL,) + planes.names()


def plane_aliases() -> Dict[str, str]:
    """Every name and alias ``--planes`` takes, to the plane it means."""
    from llm_datadist.transport import planes
    aliases = {LOCAL: LOCAL}
    for name in planes.names():
        aliases[name] = name
        aliases.update((alias, name) for alias in planes.get(name).aliases)
    return aliases


DIRECTIONS = ("push", "pull")
DEFAULT_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
DEFAULT_TOTAL = 64 << 20
DEFAULT_MIN_TIME = 0.5
MIN_REPETITIONS = 5
MAX_REPETITIONS = 20000
#: A batch (calls per trip into a process) lasts about this long.
BATCH_SECONDS = 0.05


class BenchError(Exception):
    """The sweep cannot run as asked: a message, exit status 2."""


#: ``--gpu``: measure the GPU rows where a GPU is usable (``auto``), never (``off``), or only them.
GPU_MODES = ("auto", "off", "only")


@dataclass(frozen=True)
class SweepConfig:
    sizes: Sequence[int] = DEFAULT_SIZES
    planes: Sequence[str] = field(default_factory=all_planes)
    directions: Sequence[str] = DIRECTIONS
    total: int = DEFAULT_TOTAL
    min_time: float = DEFAULT_MIN_TIME
    min_repetitions: int = MIN_REPETITIONS
    gpu: str = "auto"
    gpu_sizes: Sequence[int] = (16 << 10, 2 << 20)
    gpu_total: int = 128 << 20  # _device_workload.DEFAULT_TOTAL


def require_matplotlib():
    """``matplotlib.pyplot`` on the Agg backend, or ``BenchError`` saying how to get it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BenchError(f"--plot needs matplotlib, which is not importable here ({exc}); install it "
                         f"with: pip install 'llm_datadist[plot]' (or pip install matplotlib)") from None
    return plt


def memory_needed(config: SweepConfig, server_here: bool = True) -> int:
    """Peak host bytes of the sweep's caches on this host: per block size, the server's cache
    (unless the server is on another host), one per client and the baseline's second buffer,
    each twice the moved blocks (block sizes run one at a time); for the GPU rows, the host
    caches, fill buffers and the pinned buffer, at most eight times the bytes a call moves."""
    gpu = 8 * max(_moved(size, config.gpu_total) * size for size in config.gpu_sizes) if config.gpu != "off" else 0
    if config.gpu == "only":
        return gpu
    remote = [p for p in config.planes if p != LOCAL]
    buffers = (int(server_here) + len(remote) if remote else 1) + 1
    return max(gpu, max(2 * _moved(size, config.total) * size for size in config.sizes) * buffers)


def _moved(block_bytes: int, total: int) -> int:
    return max(1, total // block_bytes)


def _kind_name(plane: Optional[str], op: str) -> tuple:
    """``(plane, direction)`` as reported."""
    from llm_datadist.cli.workload import COPY_BLOCKS, MEMCPY
    if plane is None:
        return {MEMCPY: ("memcpy", "baseline"), COPY_BLOCKS: (LOCAL, "copy")}[op]
    return plane, op


def _measure_case(rig, case, kinds: List[tuple], config: SweepConfig,
                  on_batch: Callable[[], None]) -> Dict[tuple, List[int]]:
    """Nanoseconds per call of every kind of ``case``, measured interleaved."""
    durations: Dict[tuple, List[int]] = {kind: [] for kind in kinds}
    batch: Dict[tuple, int] = {}
    for kind in kinds:  # one call each, to size the batches
        durations[kind] += rig.measure(kind[0], kind[1], 1)
        batch[kind] = max(1, min(1000, int(BATCH_SECONDS * 1e9 / max(1, durations[kind][0]))))

    def done(values: List[int]) -> bool:
        return len(values) >= MAX_REPETITIONS or (
            len(values) >= config.min_repetitions and sum(values) >= config.min_time * 1e9)

    while not all(done(values) for values in durations.values()):
        for kind in kinds:
            values = durations[kind]
            if not done(values):
                values += rig.measure(kind[0], kind[1], min(batch[kind], MAX_REPETITIONS - len(values)))
        on_batch()
    return durations


def threads_of(plane: str, case) -> int:
    """Threads that move the bytes of one call of ``plane`` (as reported) in ``case``."""
    from llm_datadist.transport import planes
    spec = planes.lookup(plane)
    if case.moved < 2 or spec is None or not spec.stripe_bytes:
        return 1
    return spec.stripes if case.bytes_per_transfer >= spec.stripe_bytes else 1


def _rows(case, durations: Dict[tuple, List[int]]) -> List[dict]:
    from llm_datadist.cli.workload import MEMCPY
    base = durations[(None, MEMCPY)]
    base_median = max(1, statistics.median(base))  # a clock tick at least: never divide by 0
    rows = []
    for (plane, op), values in durations.items():
        median = max(1, statistics.median(values))
        name, direction = _kind_name(plane, op)
        rows.append(dict(plane=name, direction=direction, threads=threads_of(name, case), block_bytes=case.block_bytes,
                         block=short_size(case.block_bytes), blocks_per_call=case.moved,
                         bytes_per_call=case.bytes_per_transfer, repetitions=len(values),
                         median_ns=median, min_ns=min(values), max_ns=max(values),
                         gbps=case.bytes_per_transfer / median, us_per_block=median / 1e3 / case.moved,
                         baseline_median_ns=base_median,
                         baseline_gbps=case.bytes_per_transfer / base_median,
                         ratio=base_median / median, durations_ns=values))
    return rows


def sweep(config: SweepConfig, progress: Optional[Progress] = None, make_rig: Optional[Callable] = None) -> List[dict]:
    """Run the sweep; one row per (block size, kind), baseline rows included. ``make_rig(planes)``
    gives the rig (default: ``TransportRig``, its server on this host)."""
    from llm_datadist.cli.workload import Case, TransportRig, kinds
    remote = tuple(p for p in all_planes() if p != LOCAL and p in config.planes)
    rows: List[dict] = []
    progress = progress or Progress(0)
    with contextlib.ExitStack() as stack:
        with sigint_for_parent_only():  # Ctrl-C is this process's to handle: it closes the rig
            rig = stack.enter_context((make_rig or TransportRig)(remote))
        for block_bytes in config.sizes:
            case = Case(short_size(block_bytes), block_bytes, moved=_moved(block_bytes, config.total),
                        rounds=0, batch=MAX_REPETITIONS)
            label = f"{case.label} blocks"
            progress.step(f"{label}: setting up", 0)
            rig.use(case)
            measured = kinds(case, remote, local_copy=LOCAL in config.planes, ops=tuple(config.directions))
            durations = _measure_case(rig, case, measured, config,
                                      lambda text=f"{label}: measuring": progress.step(text, 0))
            rows += _rows(case, durations)
            rig.clear_case()
            progress.step(f"{label}: done")
    return rows


def print_table(rows: List[dict], out: Callable[[str], None] = print) -> None:
    out(f"{'block':>7} {'plane':6} {'direction':9} {'threads':>7} {'GB/s':>7} {'us/block':>9} {'memcpy GB/s':>11} "
        f"{'ratio':>6} {'calls':>6}")
    for row in rows:
        if row["plane"] == "memcpy":
            continue
        out(f"{row['block']:>7} {row['plane']:6} {row['direction']:9} {row['threads']:7d} {row['gbps']:7.2f} "
            f"{row['us_per_block']:9.2f} {row['baseline_gbps']:11.2f} {row['ratio']:5.2f}x "
            f"{row['repetitions']:6d}")
    if any(row["threads"] > 1 for row in rows):
        out("threads: the memcpy baseline is one thread; cma transfers of 8 MiB or more a call run on two "
            "threads and tcp ones on two connections, so their ratio can exceed 1.0x")


def series_label(plane: str, direction: str, threads: Sequence[int]) -> str:
    """The plot's legend entry of one series (its rows' thread counts)."""
    if plane == "memcpy":
        return "memcpy (baseline, 1 thread)"
    most = max(threads)
    if most == 1:
        return f"{plane} {direction} (1 thread)"
    return f"{plane} {direction} ({most} threads{'' if min(threads) == most else ' from 8 MiB a call'})"


def plot(rows: List[dict], path: str, title: str) -> None:
    plt = require_matplotlib()
    figure, axes = plt.subplots(figsize=(8, 5))
    series: Dict[tuple, List[tuple]] = {}
    for row in rows:
        series.setdefault((row["plane"], row["direction"]), []).append((row["block_bytes"], row["gbps"],
                                                                        row["threads"]))
    for (plane, direction), points in series.items():
        points.sort()
        label = series_label(plane, direction, [p[2] for p in points])
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label,
                  linestyle="--" if plane == "memcpy" else "-", color="black" if plane == "memcpy" else None)
    axes.set_xscale("log", base=2)
    sizes = sorted({row["block_bytes"] for row in rows})
    axes.set_xticks(sizes)
    axes.set_xticklabels([short_size(s) for s in sizes])
    axes.set_xlabel("block size")
    axes.set_ylabel("GB/s (median)")
    axes.set_ylim(bottom=0)
    if any(row["threads"] > 1 for row in rows):
        title += "\nthe baseline is one memcpy thread; cma and tcp calls of 8 MiB or more run on two threads"
    axes.set_title(title, fontsize=9)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def cross_host_planes() -> Tuple[str, ...]:
    """``local`` and the planes that work between any two hosts (the registry's fallbacks:
    ``tcp``): what the client role measures unless ``--planes`` says otherwise."""
    from llm_datadist.transport import planes
    return (LOCAL,) + planes.fallbacks()


def available_planes() -> tuple:
    """The planes this host can measure, and a note on any left out."""
    from llm_datadist.transport import planes
    usable, notes = [LOCAL], []
    for name in planes.names():
        ok, why = planes.get(name).probe()
        if ok:
            usable.append(name)
        else:
            notes.append(f"{name} left out: {why}")
    return tuple(usable), "; ".join(notes)


def gpu_sweep(config: SweepConfig, runtime: str, progress: Optional[Progress] = None) -> tuple:
    """The GPU rows on ``runtime``: ``(rows, notes on planes left out, facts of the server)``."""
    from llm_datadist.cli import device_workload as device
    progress = progress or Progress(0)
    table: List[dict] = []
    with contextlib.ExitStack() as stack:
        with sigint_for_parent_only():
            rig = stack.enter_context(device.DeviceRig(runtime))
        for block_bytes in config.gpu_sizes:
            case = device.make_case(block_bytes, config.gpu_total)
            progress.step(f"GPU {case.label}: setting up", 0)
            durations = device.measure_case(rig, case, config.min_time, config.min_repetitions,
                                            lambda text=f"GPU {case.label}: measuring": progress.step(text, 0))
            table += device.rows(case, durations, rig)
            rig.clear_case()
            progress.step(f"GPU {case.label}: done")
        table.append(device.measure_latency(rig, config.min_time,
                                            lambda: progress.step("GPU latency: measuring", 0)))
        rig.clear_case()
        return table, dict(rig.notes), dict(rig.facts)


def run(config: SweepConfig, json_path: str, plot_path: Optional[str], out: Callable[[str], None] = print,
        client=None) -> int:
    """The ``bench`` command: sweep, table, JSON (and plot). Raises ``BenchError``. ``client``: the
    client role's ``bench_roles.ClientSide`` (the server on another host; no GPU rows)."""
    from llm_datadist.testing import ChildError
    if plot_path is not None:
        require_matplotlib()  # before minutes of measuring, not after
    for path in filter(None, (json_path, plot_path)):
        folder = os.path.dirname(os.path.abspath(path))
        if not os.access(folder, os.W_OK):
            raise BenchError(f"cannot write {path}: {folder} is not a writable directory")
    shortfall = memory_shortfall(memory_needed(config, server_here=client is None))
    if shortfall:
        raise BenchError(f"the sweep's caches would take {shortfall}; lower --total or the largest of --sizes")
    host, build = host_facts(), build_facts()
    meta = dict(version=build["version"], build=build["build"], host=host, started=time.strftime("%Y-%m-%d %H:%M:%S"),
                loadavg_start=os.getloadavg())
    out(f"llm_datadist {build['version']} ({build['build']}) on {host['machine']}, {host['cpus']} CPUs "
        f"({host['cpu']}), load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    gpu_runtime = gpu_why = None
    if config.gpu != "off":
        from llm_datadist.cli.device_workload import device_runtime
        gpu_runtime, gpu_why = device_runtime()
        if gpu_runtime is None and config.gpu == "only":
            raise BenchError(f"--gpu only, but {gpu_why}")
    if client is not None:
        out(f"server: {client.address[0]}:{client.address[1]} (transfers cross the network to it; the baselines "
            f"are this host's)")
    if config.gpu != "only":
        out(f"sweep: blocks {', '.join(short_size(s) for s in config.sizes)}; planes {', '.join(config.planes)}; "
            f"directions {', '.join(config.directions)}; {format_size(config.total)} per call (at least one block); "
            f"each kind >= {config.min_time:g} s and >= {config.min_repetitions} calls")
    if gpu_runtime is not None:
        out(f"GPU rows: the {gpu_runtime} runtime ({gpu_why}); blocks "
            f"{', '.join(short_size(s) for s in config.gpu_sizes)}; {format_size(config.gpu_total)} per call, "
            f"one tensor of twice the moved blocks, random block ids")
    started = time.perf_counter()
    rows: List[dict] = []
    gpu_rows: List[dict] = []
    gpu_notes: Dict[str, str] = {}
    gpu_facts: dict = {}
    steps = (len(config.sizes) if config.gpu != "only" else 0) + (len(config.gpu_sizes) if gpu_runtime else 0)
    try:
        with Progress(max(1, steps)) as progress:
            if config.gpu != "only":
                rows = sweep(config, progress, client.rig if client is not None else None)
            if gpu_runtime is not None:
                gpu_rows, gpu_notes, gpu_facts = gpu_sweep(config, gpu_runtime, progress)
    except ChildError as exc:
        if exc.kind in ("TwoHostError", "PeerAborted"):  # the client role's link to its server
            raise BenchError(exc.message) from None
        raise BenchError(f"{exc.kind} in a cluster process: {exc.message}") from None
    except (RuntimeError, TimeoutError) as exc:
        raise BenchError(str(exc)) from None
    meta.update(seconds=time.perf_counter() - started, loadavg_end=os.getloadavg())
    if client is not None:
        meta.update(server=dict(address=list(client.address), host=client.server.facts if client.server else None))
        out(f"server host: {client.describe_server()}")
    if rows:
        out("")
        print_table(rows, out)
    if config.gpu != "off":
        from llm_datadist.cli.device_workload import format_rows
        out("")
        if gpu_runtime is None:
            out(f"GPU rows skipped: {gpu_why}")
        else:
            out(f"GPU rows ({gpu_runtime}; ratio = baseline time / time, medians of batches closed by a "
                f"device fence):")
            for line in format_rows(gpu_rows):
                out(line)
    payload = dict(meta=meta, config=dict(sizes=list(config.sizes), planes=list(config.planes),
                                          directions=list(config.directions), total=config.total,
                                          min_time=config.min_time, min_repetitions=config.min_repetitions,
                                          gpu=config.gpu, gpu_sizes=list(config.gpu_sizes),
                                          gpu_total=config.gpu_total),
                   results=rows,
                   gpu=dict(runtime=gpu_runtime, why=gpu_why, notes=gpu_notes, facts=gpu_facts, results=gpu_rows))
    with open(json_path, "w") as f:
        json.dump(payload, f, indent=1)
    out(f"\nraw results (every duration): {json_path}")
    if plot_path is not None:
        plot(rows, plot_path, f"llm_datadist {build['version']} bench on {host['machine']}, {host['cpus']} CPUs "
                              f"({host['cpu']}), {format_size(config.total)} per call")
        out(f"plot: {plot_path}")
    return 0
