"""The GPU rows of ``python -m llm_datadist bench`` and of ``bench/test_bench_device.py``:
copies, swaps and transfers of device memory the host cannot address, each against a baseline
of the same bytes measured in the same run.

The device runtime is the first of the registry's ``auto`` order that is usable here and whose
memory is not host memory (``cuda`` on a GPU machine; the tests' stub library posing as cuda
elsewhere). Without one the rows are skipped with the reason (``device_runtime``).

Processes (``llm_datadist.testing.Cluster``, all with ``LLM_DATADIST_DEVICE`` set to that runtime):

* the server, cluster 21, listening, ``llm.DataPlane=auto``. It owns, per case, a DEVICE blocks
  cache (one tensor of ``2 * moved`` blocks, runtime memory registered by address under model
  ``M``) and a HOST blocks cache of the same geometry (numpy memory, model ``M + 1``), two device
  buffers and a pinned host buffer of ``moved * block`` bytes each, and runs the local rows;
* a client per data plane measured: ``cuda_ipc`` (cluster 22) and ``staging`` (cluster 23) with
  a DEVICE cache, ``tcp`` (cluster 24) with a HOST cache, each with its plane forced
  (``llm.DataPlane``), so a client is known to use the plane it names. A plane that is not
  registered, or whose client cannot link, is skipped with the reason.

Rows (``COMPARISONS``; ratio = baseline time / measured time, higher is faster):

* ``copy_blocks D2D``: ``copy_blocks`` of ``moved`` random even blocks onto random odd blocks of
  the DEVICE cache, against one ``Runtime.memcpy`` device-to-device (one ``cudaMemcpy``) of the
  same bytes between the two device buffers;
* ``swap_blocks D2H`` / ``H2D``: ``swap_blocks`` between the DEVICE and the HOST cache (random
  even source, random odd destination blocks), against one ``Runtime.memcpy`` of the same bytes
  between a device buffer and the pinned host buffer (``lowlevel.Allocation(..., pinned=True)``);
* ``cuda_ipc push`` / ``pull``: ``push_blocks`` / ``pull_blocks`` between the cuda_ipc client's
  DEVICE cache and the server's, completion included, against the server's one D2D memcpy;
* ``staging push`` / ``pull``: the same between the staging client's DEVICE cache and the
  server's over the staging plane (TCP connections on loopback), against the tcp client's
  ``push_blocks`` / ``pull_blocks`` of the same bytes between HOST caches over the tcp plane.

Latency (``measure_latency``): one ``push_blocks`` of one 4 KiB block over ``cuda_ipc``, against
one 4 KiB device-to-device ``Runtime.memcpy``, each call timed alone (a batch of one call and its
fence): the median and the 99th percentile of each, without a target.

Timing: inside the process that makes the call. A device copy may return before the GPU is done
(a device-to-device ``cudaMemcpy`` does), so every device measurement is a batch of back-to-back
calls closed by a *fence* -- ``Runtime.synchronize`` and a one-byte device-to-host
``Runtime.memcpy``, which waits for the work queued before it -- and one duration is the batch's
time divided by its calls. The library's calls and the baselines are timed alike; host-only
ones (tcp) need no fence. Before anything is timed, each operation's bytes are checked (copied
back to the host through the library).
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

SERVER_ID = 21
IPC_PLANE, STAGING_PLANE, HOST_PLANE = "cuda_ipc", "staging", "tcp"
CLIENT_IDS = {IPC_PLANE: 22, STAGING_PLANE: 23, HOST_PLANE: 24}
SEED = 0x6B0
TRANSFER_TIMEOUT_MS = 60000
CALL_TIMEOUT_S = 600.0
SETTLE_RUNS = 2
#: A batch of calls (closed by one fence) lasts about this long.
BATCH_SECONDS = 0.02
MAX_BATCH = 1000

# Operations, by where they run: (plane, op); plane None = the server's local operations.
COPY_BLOCKS, MEMCPY_D2D = "copy_blocks", "memcpy D2D"
SWAP_D2H, SWAP_H2D = "swap_blocks D2H", "swap_blocks H2D"
PINNED_D2H, PINNED_H2D = "memcpy D2H pinned", "memcpy H2D pinned"
PUSH, PULL = "push", "pull"
LOCAL_OPS = (COPY_BLOCKS, MEMCPY_D2D, SWAP_D2H, PINNED_D2H, SWAP_H2D, PINNED_H2D)


@dataclass(frozen=True)
class Comparison:
    """One reported row: ``kind`` against ``baseline`` (each ``(plane, op)``), and the issue's
    target ratio (None: reported without one) at the block sizes ``target_sizes`` (None: all)."""

    name: str
    kind: Tuple[Optional[str], str]
    baseline: Tuple[Optional[str], str]
    baseline_name: str
    target: Optional[float]
    target_sizes: Optional[Tuple[int, ...]] = None

    def target_at(self, block_bytes: int) -> Optional[float]:
        if self.target_sizes is not None and block_bytes not in self.target_sizes:
            return None
        return self.target


COMPARISONS = (
    Comparison("copy_blocks D2D", (None, COPY_BLOCKS), (None, MEMCPY_D2D), "one memcpy D2D", 0.85),
    Comparison("swap_blocks D2H", (None, SWAP_D2H), (None, PINNED_D2H), "one pinned memcpy D2H", 0.8),
    Comparison("swap_blocks H2D", (None, SWAP_H2D), (None, PINNED_H2D), "one pinned memcpy H2D", 0.8),
    Comparison(f"{IPC_PLANE} push", (IPC_PLANE, PUSH), (None, MEMCPY_D2D), "one memcpy D2D", 0.85),
    Comparison(f"{IPC_PLANE} pull", (IPC_PLANE, PULL), (None, MEMCPY_D2D), "one memcpy D2D", 0.85),
    Comparison(f"{STAGING_PLANE} push", (STAGING_PLANE, PUSH), (HOST_PLANE, PUSH), "tcp push, HOST caches",
               0.5, (2 << 20,)),
    Comparison(f"{STAGING_PLANE} pull", (STAGING_PLANE, PULL), (HOST_PLANE, PULL), "tcp pull, HOST caches",
               0.5, (2 << 20,)),
)
#: The issue's layout: a 256 MiB-class paged cache (one tensor of twice the moved blocks), half
#: of it moved a call: 64 blocks of 2 MiB or 8192 of 16 KiB.
DEFAULT_SIZES = (16 << 10, 2 << 20)
DEFAULT_TOTAL = 128 << 20
#: The latency row: one block of this size a push, and at least this many calls of each kind.
LATENCY_BLOCK = 4 << 10
LATENCY_CALLS = 200
LATENCY_NAME = f"{IPC_PLANE} push latency"


@dataclass(frozen=True)
class DeviceCase:
    label: str
    block_bytes: int
    moved: int

    @property
    def cache_blocks(self) -> int:
        return 2 * self.moved

    @property
    def bytes_per_call(self) -> int:
        return self.moved * self.block_bytes


def make_case(block_bytes: int, total: int) -> DeviceCase:
    from llm_datadist.cli.console import short_size
    return DeviceCase(short_size(block_bytes), block_bytes, max(1, total // block_bytes))


def device_runtime() -> Tuple[Optional[str], str]:
    """``(runtime name, why)`` of the runtime the GPU rows use, or ``(None, why none)``."""
    from llm_datadist import runtimes
    reasons = []
    for name in runtimes.auto_order():
        spec = runtimes.get(name)
        if spec.host_addressable:
            continue
        usable, why = runtimes.probe(name)
        if usable:
            return name, why
        reasons.append(f"{name}: {why}")
    return None, ("no runtime with device memory the host cannot address is usable here ("
                  + "; ".join(reasons) + ")")


def plane_note(plane: str) -> Optional[str]:
    """Why ``plane`` cannot be measured here (not registered, or its probe says no), or None."""
    from llm_datadist.transport import planes
    cls = planes.lookup(plane)
    if cls is None:
        return f"data plane {plane} is not registered"
    usable, why = cls.probe()
    return None if usable else f"data plane {plane}: {why}"


def block_ids(case: DeviceCase, salt: int) -> Tuple[List[int], List[int]]:
    """Random even source ids and random odd destination ids (no two descriptors merge)."""
    rng = np.random.default_rng([SEED, case.block_bytes, salt])
    even = np.arange(0, case.cache_blocks, 2)
    return [int(b) for b in rng.permutation(even)], [int(b) for b in rng.permutation(even + 1)]


def _pattern(salt: int, blocks: int) -> np.ndarray:
    return ((salt * 97 + np.arange(blocks)) % 251 + 1).astype(np.uint8)


# -- in the cluster processes (``fn(state, *args)``) ----------------------------------------------

def _runtime(state):
    runtime = state.dd.engine.runtime
    if not state.scratch.get("bound"):
        runtime.set_device(0)
        state.scratch["bound"] = True
    return runtime


def _alloc(state, nbytes: int, on_device: bool, pinned: bool = False):
    """A library allocation kept for the case; a pinned one where the core can make it."""
    from llm_datadist.cli import lowlevel
    runtime = _runtime(state)
    if pinned:
        try:
            allocation = lowlevel.Allocation(runtime, nbytes, on_device=False, pinned=True)
        except TypeError:  # a core without pinned host memory: plain host memory, and said so
            allocation = lowlevel.Allocation(runtime, nbytes, False)
    else:
        allocation = lowlevel.Allocation(runtime, nbytes, on_device)
    state.scratch.setdefault("allocations", []).append(allocation)
    return allocation


def _desc(case: DeviceCase, device: bool):
    from llm_datadist import CacheDesc, DataType, Placement
    return CacheDesc(1, [case.cache_blocks, case.block_bytes], DataType.DT_UINT8,
                     Placement.DEVICE if device else Placement.HOST)


def _host_cache(state, case: DeviceCase, salt: int, model_id: Optional[int]):
    from llm_datadist import BlocksCacheKey
    arr = np.empty((case.cache_blocks, case.block_bytes), np.uint8)
    arr[:] = _pattern(salt, case.cache_blocks)[:, None]  # faults every page in
    state.arrays["host"] = arr
    key = None if model_id is None else BlocksCacheKey(state.cluster_id, model_id)
    state.caches["host"] = state.cm.register_blocks_cache(_desc(case, False), [arr], key)


def _device_cache(state, case: DeviceCase, salt: int, model_id: Optional[int]):
    """A DEVICE cache of runtime memory registered by address, filled through the library
    (``swap_blocks`` from a filled host staging cache)."""
    from llm_datadist import BlocksCacheKey, Cache
    memory = _alloc(state, case.cache_blocks * case.block_bytes, True)
    key = None if model_id is None else BlocksCacheKey(state.cluster_id, model_id)
    state.caches["device"] = state.cm.register_blocks_cache(_desc(case, True), [memory.addr], key)
    filled = np.empty((case.cache_blocks, case.block_bytes), np.uint8)
    filled[:] = _pattern(salt, case.cache_blocks)[:, None]
    staging = Cache.create_cpu_cache(_desc(case, False), [filled])
    state.cm.swap_blocks(staging, state.caches["device"], {b: b for b in range(case.cache_blocks)})


def _fence(state) -> None:
    """Wait for the device work queued so far: the copies this thread queued on the library's
    stream (``Runtime.synchronize``), then a one-byte device-to-host copy, which waits for the
    work queued before it on the device's default stream (a D2D ``cudaMemcpy``)."""
    from llm_datadist.cli import lowlevel
    runtime = _runtime(state)
    dev, host = state.scratch["fence"]
    synchronize = getattr(runtime, "synchronize", None)
    if synchronize is not None:
        synchronize()
    runtime.memcpy(host.addr, dev.addr, 1, lowlevel.MEMCPY_DEVICE_TO_HOST)


def server_case(state, case: DeviceCase, model_id: int) -> dict:
    """Server: the DEVICE cache (model ``model_id``), the HOST cache (``model_id + 1``), the
    baseline buffers, and every local operation's arguments. Returns facts for the report."""
    from llm_datadist.cli import lowlevel
    runtime = _runtime(state)
    _device_cache(state, case, SERVER_ID, model_id)
    _host_cache(state, case, SERVER_ID + 100, model_id + 1)
    state.scratch["fence"] = (_alloc(state, 64, True), _alloc(state, 64, False))
    nbytes = case.bytes_per_call
    src, dst = _alloc(state, nbytes, True), _alloc(state, nbytes, True)
    pinned = _alloc(state, nbytes, False, pinned=True)
    cm, dev, host = state.cm, state.caches["device"], state.caches["host"]
    copy_src, copy_dst = block_ids(case, 1)
    d2h_src, d2h_dst = block_ids(case, 2)
    h2d_src, h2d_dst = block_ids(case, 3)
    state.scratch["ops"] = {
        COPY_BLOCKS: (cm.copy_blocks, (dev, {s: [d] for s, d in zip(copy_src, copy_dst)}), True),
        MEMCPY_D2D: (runtime.memcpy, (dst.addr, src.addr, nbytes, lowlevel.MEMCPY_DEVICE_TO_DEVICE), True),
        SWAP_D2H: (cm.swap_blocks, (dev, host, dict(zip(d2h_src, d2h_dst))), True),
        PINNED_D2H: (runtime.memcpy, (pinned.addr, src.addr, nbytes, lowlevel.MEMCPY_DEVICE_TO_HOST), True),
        SWAP_H2D: (cm.swap_blocks, (host, dev, dict(zip(h2d_src, h2d_dst))), True),
        PINNED_H2D: (runtime.memcpy, (dst.addr, pinned.addr, nbytes, lowlevel.MEMCPY_HOST_TO_DEVICE), True),
    }
    state.scratch["ids"] = {COPY_BLOCKS: (copy_src, copy_dst), SWAP_D2H: (d2h_src, d2h_dst),
                            SWAP_H2D: (h2d_src, h2d_dst)}
    return dict(pinned=bool(getattr(pinned, "pinned", False)), runtime=runtime.name,
                capabilities=sorted(name for name, bit in lowlevel.CAPABILITIES.items() if runtime.capabilities & bit))


def client_case(state, case: DeviceCase, model_id: int, device: bool) -> None:
    """Client: its cache (DEVICE, or HOST for the tcp client) and the push and pull arguments,
    against the server's cache of the same placement."""
    from llm_datadist import BlocksCacheKey
    if device:
        _device_cache(state, case, state.cluster_id, None)
        state.scratch["fence"] = (_alloc(state, 64, True), _alloc(state, 64, False))
    else:
        _host_cache(state, case, state.cluster_id, None)
    cache = state.caches["device" if device else "host"]
    key = BlocksCacheKey(SERVER_ID, model_id if device else model_id + 1)
    push_ids, pull_ids = block_ids(case, 4), block_ids(case, 5)
    state.scratch["ops"] = {PUSH: (state.cm.push_blocks, (key, cache, *push_ids), device),
                            PULL: (state.cm.pull_blocks, (key, cache, *pull_ids), device)}
    state.scratch["ids"] = {PUSH: push_ids, PULL: pull_ids}


def sample(state, cache: str, ids: Sequence[int]) -> np.ndarray:
    """The first and last byte of every 4 KiB of blocks ``ids`` of ``cache`` ("device" or
    "host"), read through the library (``swap_blocks`` into a host staging cache) for device
    memory."""
    from llm_datadist import Cache, CacheDesc, DataType, Placement
    ids = list(ids)
    if cache == "host":
        arr = state.arrays["host"][ids]
    else:
        record = state.caches["device"]
        blocks, block_bytes = record.cache_desc.shape
        arr = np.zeros((len(ids), block_bytes), np.uint8)
        staging = Cache.create_cpu_cache(CacheDesc(1, [len(ids), block_bytes], DataType.DT_UINT8, Placement.HOST),
                                         [arr])
        state.cm.swap_blocks(record, staging, {b: k for k, b in enumerate(ids)})
    return np.concatenate([arr[:, ::4096], arr[:, -1:]], axis=1)


def run_once(state, op: str) -> None:
    fn, args, _ = state.scratch["ops"][op]
    fn(*args)
    if state.scratch["ops"][op][2]:
        _fence(state)


def settle(state, ops: Sequence[str]) -> None:
    for op in ops:
        for _ in range(SETTLE_RUNS):
            run_once(state, op)


def timed(state, op: str, batches: int, calls: int) -> List[float]:
    """``batches`` batches of ``calls`` back-to-back calls of ``op``, each batch closed by a
    fence when ``op`` touches device memory; the nanoseconds per call of each batch."""
    fn, args, device = state.scratch["ops"][op]
    clock = time.perf_counter_ns
    out = []
    for _ in range(batches):
        start = clock()
        for _ in range(calls):
            fn(*args)
        if device:
            _fence(state)
        out.append((clock() - start) / calls)
    return out


def drop_case(state) -> None:
    for name in ("device", "host"):
        cache = state.caches.pop(name, None)
        if cache is not None:
            state.cm.unregister_cache(cache.cache_id)
    state.caches.clear()
    state.arrays.clear()
    bound = state.scratch.get("bound")
    state.scratch.clear()
    if bound:
        state.scratch["bound"] = True
    gc.collect()


def unlink_peer(state, peer_id: int, ip: str, port: int) -> int:
    from llm_datadist.cli.workload import unlink_peer as unlink
    return unlink(state, peer_id, ip, port)


# -- the parent's side ----------------------------------------------------------------------------

class DeviceRig:
    """The server and a client per measurable plane, all on the device runtime ``runtime``.
    ``notes`` says which planes were left out, and why."""

    def __init__(self, runtime: str, planes: Sequence[str] = (IPC_PLANE, STAGING_PLANE, HOST_PLANE)) -> None:
        from llm_datadist.testing import Cluster, link
        self.runtime = runtime
        self.notes: Dict[str, str] = {}
        self.clients: Dict[str, object] = {}
        self.clusters: list = []
        self.case: Optional[DeviceCase] = None
        self.facts: dict = {}
        self._next_model_id = 200
        # A secret of this run shared by its processes: cuda_ipc hands GPU memory only to a peer
        # on an authenticated link (docs/security.md).
        common = {"llm.SyncKvCacheWaitTime": str(TRANSFER_TIMEOUT_MS), "llm.LinkSecret": os.urandom(16).hex()}
        saved = os.environ.get("LLM_DATADIST_DEVICE")
        os.environ["LLM_DATADIST_DEVICE"] = runtime  # inherited by the (spawned) cluster processes
        try:
            self.server = Cluster(SERVER_ID, role="PROMPT", listen=True, timeout=CALL_TIMEOUT_S,
                                  options={**common, "llm.DataPlane": "auto"})
            self.clusters.append(self.server)
            for plane in planes:
                note = plane_note(plane)
                if note is None:
                    client = Cluster(CLIENT_IDS[plane], role="DECODER", timeout=CALL_TIMEOUT_S,
                                     options={**common, "llm.DataPlane": plane})
                    self.clusters.append(client)
                    status, per_cluster = link(client, self.server, timeout_ms=10000)
                    if status == 0:
                        self.clients[plane] = client
                        continue
                    note = f"the {plane} client could not link to the server: status {status}, {per_cluster}"
                self.notes[plane] = note
        except BaseException:
            self.close(unlink=False)
            raise
        finally:
            if saved is None:
                os.environ.pop("LLM_DATADIST_DEVICE", None)
            else:
                os.environ["LLM_DATADIST_DEVICE"] = saved

    def process_of(self, plane: Optional[str]):
        return self.server if plane is None else self.clients[plane]

    def measurable(self, kind: Tuple[Optional[str], str]) -> bool:
        return kind[0] is None or kind[0] in self.clients

    def use(self, case: DeviceCase) -> None:
        """Set ``case`` up on every process, check that every operation moves the right bytes,
        and run each a few times."""
        if self.case == case:
            return
        self.clear_case()
        model_id = self._next_model_id
        self._next_model_id += 2
        try:
            self.facts = self.server.call(server_case, case, model_id, timeout=CALL_TIMEOUT_S)
            for plane, client in self.clients.items():
                client.call(client_case, case, model_id, plane != HOST_PLANE, timeout=CALL_TIMEOUT_S)
            self._check(case)
            self.server.call(settle, LOCAL_OPS, timeout=CALL_TIMEOUT_S)
            for client in self.clients.values():
                client.call(settle, (PUSH, PULL), timeout=CALL_TIMEOUT_S)
        except BaseException:
            self._drop_all()
            raise
        self.case = case

    def _check(self, case: DeviceCase) -> None:
        server = self.server
        for op, src_cache, dst_cache in ((COPY_BLOCKS, "device", "device"), (SWAP_D2H, "device", "host"),
                                         (SWAP_H2D, "host", "device")):
            server.call(run_once, op, timeout=CALL_TIMEOUT_S)
            src_ids, dst_ids = block_ids(case, {COPY_BLOCKS: 1, SWAP_D2H: 2, SWAP_H2D: 3}[op])
            if not np.array_equal(server.call(sample, src_cache, src_ids), server.call(sample, dst_cache, dst_ids)):
                raise AssertionError(f"{op} did not move the source blocks")
        for plane, client in self.clients.items():
            cache = "host" if plane == HOST_PLANE else "device"
            for op, salt, source, dest in ((PUSH, 4, client, server), (PULL, 5, server, client)):
                client.call(run_once, op, timeout=CALL_TIMEOUT_S)
                src_ids, dst_ids = block_ids(case, salt)
                if not np.array_equal(source.call(sample, cache, src_ids), dest.call(sample, cache, dst_ids)):
                    raise AssertionError(f"{plane} {op} did not deliver the source blocks")

    def measure(self, kind: Tuple[Optional[str], str], batches: int, calls: int) -> List[float]:
        return self.process_of(kind[0]).call(timed, kind[1], batches, calls, timeout=CALL_TIMEOUT_S)

    def clear_case(self) -> None:
        if self.case is not None:
            self._drop_all()

    def _drop_all(self) -> None:
        self.case = None
        for cluster in self.clusters:
            if cluster.process.is_alive():
                cluster.call(drop_case, timeout=CALL_TIMEOUT_S)

    def close(self, unlink: bool = True) -> None:
        if unlink and self.clusters:
            for client in self.clients.values():
                if client.process.is_alive():
                    client.call(unlink_peer, SERVER_ID, *self.server.address, timeout=30.0)
        for cluster in reversed(self.clusters):
            cluster.close()
        self.clusters = []

    def __enter__(self) -> "DeviceRig":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(unlink=exc_type is None)


def kinds_of(comparisons: Sequence[Comparison], rig: DeviceRig) -> List[Tuple[Optional[str], str]]:
    """Every (plane, op) the measurable comparisons need, baselines included, once each."""
    out: List[Tuple[Optional[str], str]] = []
    for comparison in comparisons:
        if rig.measurable(comparison.kind) and rig.measurable(comparison.baseline):
            for kind in (comparison.baseline, comparison.kind):
                if kind not in out:
                    out.append(kind)
    return out


def measure_case(rig: DeviceRig, case: DeviceCase, min_time: float, min_repetitions: int,
                 on_batch=lambda: None) -> Dict[tuple, List[float]]:
    """Per-call nanoseconds of every kind of ``case`` (interleaved batches, as the host sweep)."""
    rig.use(case)
    kinds = kinds_of(COMPARISONS, rig)
    calls: Dict[tuple, int] = {}
    durations: Dict[tuple, List[float]] = {}
    spent: Dict[tuple, float] = {}
    for kind in kinds:  # one call each, to size the batches
        first = rig.measure(kind, 1, 1)
        durations[kind] = list(first)
        spent[kind] = first[0]
        calls[kind] = max(1, min(MAX_BATCH, int(BATCH_SECONDS * 1e9 / max(1.0, first[0]))))

    def done(kind) -> bool:
        return len(durations[kind]) >= min_repetitions and spent[kind] >= min_time * 1e9

    while not all(done(kind) for kind in kinds):
        for kind in kinds:
            if not done(kind):
                got = rig.measure(kind, 1, calls[kind])
                durations[kind] += got
                spent[kind] += sum(got) * calls[kind]
        on_batch()
    return durations


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def measure_latency(rig: DeviceRig, min_time: float, on_batch=lambda: None) -> dict:
    """The latency row: ``push_blocks`` of one ``LATENCY_BLOCK`` block over cuda_ipc and one D2D
    memcpy of its bytes (the baseline), each call timed alone with its fence, interleaved, until
    each kind has ``LATENCY_CALLS`` calls and ``min_time`` seconds. Skipped without a cuda_ipc
    client (``skipped``: why)."""
    case = make_case(LATENCY_BLOCK, LATENCY_BLOCK)
    row = dict(operation=LATENCY_NAME, block=case.label, block_bytes=case.block_bytes, blocks_per_call=1,
               bytes_per_call=case.bytes_per_call, baseline="one memcpy D2D", target=None, latency=True)
    if IPC_PLANE not in rig.clients:
        row["skipped"] = rig.notes.get(IPC_PLANE, f"no {IPC_PLANE} client")
        return row
    rig.use(case)
    kinds = ((IPC_PLANE, PUSH), (None, MEMCPY_D2D))
    durations: Dict[tuple, List[float]] = {kind: [] for kind in kinds}
    while not all(len(v) >= LATENCY_CALLS and sum(v) >= min_time * 1e9 for v in durations.values()):
        for kind in kinds:
            durations[kind] += rig.measure(kind, 50, 1)
        on_batch()
    values, base = durations[kinds[0]], durations[kinds[1]]
    median, base_median = max(1.0, statistics.median(values)), max(1.0, statistics.median(base))
    row.update(median_ns=median, p99_ns=percentile(values, 0.99), baseline_median_ns=base_median,
               baseline_p99_ns=percentile(base, 0.99), ratio=base_median / median, repetitions=len(values),
               met=None, durations_ns=values, baseline_durations_ns=base)
    return row


def rows(case: DeviceCase, durations: Dict[tuple, List[float]], rig: DeviceRig) -> List[dict]:
    """One row per comparison of ``case``: measured or skipped (``skipped``: why)."""
    out = []
    for comparison in COMPARISONS:
        row = dict(operation=comparison.name, block=case.label, block_bytes=case.block_bytes,
                   blocks_per_call=case.moved, bytes_per_call=case.bytes_per_call,
                   baseline=comparison.baseline_name, target=comparison.target_at(case.block_bytes))
        missing = [kind[0] for kind in (comparison.kind, comparison.baseline) if not rig.measurable(kind)]
        if missing:
            row["skipped"] = "; ".join(rig.notes.get(plane, f"no {plane} client") for plane in missing)
            out.append(row)
            continue
        values, base = durations[comparison.kind], durations[comparison.baseline]
        median, base_median = max(1.0, statistics.median(values)), max(1.0, statistics.median(base))
        ratio = base_median / median
        row.update(median_ns=median, gbps=case.bytes_per_call / median, baseline_median_ns=base_median,
                   baseline_gbps=case.bytes_per_call / base_median, ratio=ratio, repetitions=len(values),
                   met=None if row["target"] is None else ratio >= row["target"],
                   durations_ns=values, baseline_durations_ns=base)
        if comparison.baseline[1] in (PINNED_D2H, PINNED_H2D):
            row["baseline_pinned"] = bool(rig.facts.get("pinned"))
        out.append(row)
    return out


def format_rows(table: List[dict]) -> List[str]:
    """The GPU rows as text lines, in the sweep's table style, targets as ``report_local.py``."""
    lines = [f"{'block':>7} {'operation':16} {'GB/s':>8} {'baseline':24} {'GB/s':>8} {'ratio':>6}  target"]
    for row in table:
        if "skipped" in row:
            lines.append(f"{row['block']:>7} {row['operation']:16} skipped: {row['skipped']}")
            continue
        if row.get("latency"):
            lines.append(f"{row['block']:>7} {row['operation']:16} median {row['median_ns'] / 1e3:.1f} us, "
                         f"p99 {row['p99_ns'] / 1e3:.1f} us ({row['repetitions']} calls, each timed alone with "
                         f"its fence); {row['baseline']}: median {row['baseline_median_ns'] / 1e3:.1f} us, "
                         f"p99 {row['baseline_p99_ns'] / 1e3:.1f} us")
            continue
        baseline = row["baseline"]
        if row.get("baseline_pinned") is False:
            baseline = baseline.replace("pinned ", "pageable ")
        if row["target"] is None:
            verdict = "-"
        else:
            verdict = f">= {row['target']}x " + ("met" if row["met"] else "MISSED")
        lines.append(f"{row['block']:>7} {row['operation']:16} {row['gbps']:8.2f} {baseline:24} "
                     f"{row['baseline_gbps']:8.2f} {row['ratio']:5.2f}x  {verdict}")
    return lines
