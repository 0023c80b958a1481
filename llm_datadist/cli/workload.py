"""Block transfers between cluster processes: the workload of ``bench/test_bench_transport.py``
(pytest-benchmark), ``bench/report_transport.py`` (standalone table) and ``python -m llm_datadist
bench`` (the sweep), kept in one place so that all of them measure exactly the same thing. It
lives in the package (not in ``bench/``) so that the command works from an installed wheel.

Processes (``llm_datadist.testing.Cluster``, one engine each, all on this host; with
``bench --role client`` the server is on another host instead, ``bench_roles.RemoteServer``):

* the server, cluster 1, listening, ``llm.DataPlane=auto`` (``LocalServer``): owns the remote blocks cache,
  registered under ``BlocksCacheKey(1, model_id)``. Each case uses a fresh model_id, so that a
  client's copy of the server's cache table misses it and is refreshed: re-registering a
  model_id with another geometry leaves the clients planning against the old one;
* a client per data plane measured, cluster 2 with ``llm.DataPlane=cma`` and cluster 3 with
  ``llm.DataPlane=tcp``, each linked to the server. A client picks the plane of its own
  transfers, and a forced plane fails the link rather than fall back, so each client is known to
  use the plane it names. (A rig that measures only the ``local`` copy starts one process with no
  server.)

Caches: one tensor per cache (not a K/V pair: the planes see a list of descriptors either way),
``[2 * moved, block_bytes]`` uint8, host memory allocated with numpy in the process that owns it
and registered as a HOST blocks cache (HOST, so that no device runtime is involved; DEVICE
memory of the ``cpu`` runtime is host memory too). numpy advises transparent huge pages for
arrays this large; caches and baseline buffers are allocated alike. A transfer moves
``moved`` blocks: its source ids are a random permutation of the even block ids of the source
cache and its destination ids one of the odd ids of the destination cache, so no two consecutive
descriptors continue each other and nothing merges into longer runs (checked: the plan has one
descriptor per block). Push (client -> server) and pull (server -> client) use separate id lists
that read and write disjoint blocks, so either direction's checks survive the other's runs.

Timing happens in the client process, around the public call alone (``cm.push_blocks(...)`` /
``cm.pull_blocks(...)`` with every argument built beforehand), with ``time.perf_counter_ns``.
A call from the parent runs a batch of back-to-back repetitions and returns the duration of each;
the parent's round trip (pipe, pickling) is never inside a measured duration.

Baselines, timed the same way in the *home* process (the cma client; the tcp client if there
is none), which issues transfers as the clients do:

* ``memcpy``: ``lowlevel.memcpy_baseline`` over a plan from ``lowlevel.plan_blocks`` with the push's
  block lists, from the client's cache into a second local buffer of the same geometry (a bare
  single-threaded memcpy loop over the same descriptors: no validation, no planning);
* ``copy_blocks``: ``cm.copy_blocks`` of the push's source blocks onto its destination ids
  inside the client's own cache: the public API's local copy (the ``local`` data plane) of the
  same descriptors. Measured in the latency case of the pytest suite and, as the ``local`` plane,
  at every block size of the sweep.

The baseline is one thread; the same-host plane splits transfers of 8 MiB or more over two
threads (``PARALLEL_CMA_BYTES`` in ``transport/links.py``), so on a quiet machine with two free
cores it can beat the baseline. ``python_loop`` (report only) times a fixed pure-Python loop in
the same process: shared virtual CPUs change speed under neighbours' load, and latencies in
microseconds follow.

All memory is written before anything is timed (numpy's ``empty`` leaves pages unfaulted), and
every timed path runs a few times first.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from llm_datadist.transport import planes as _plane_registry

SERVER_ID = 1
#: The planes between processes (every registered data plane), each measured by its own client.
PLANES = _plane_registry.names()
CLIENT_IDS = {plane: 2 + i for i, plane in enumerate(PLANES)}


def default_planes() -> Tuple[str, ...]:
    """The planes a rig measures unless told: every registered one, less those that serve only
    authenticated links and cannot run on this host (``probe``: nixl without NIXL, or without an
    RDMA port and ``LLM_DATADIST_NIXL_TCP=1``), and less those that move the rig's registered
    (numpy) memory with another plane (``DataPlane.uses``: shm moves it as cma; its own memory,
    allocated caches, is ``bench/shm_transport.py``'s)."""
    return tuple(name for name in PLANES
                 if (not _plane_registry.get(name).requires_secret or _plane_registry.get(name).probe()[0])
                 and not _plane_registry.get(name).uses)
#: Cluster id of the one process of a rig without remote planes.
LONE_ID = 2
SEED = 0x7A5F
#: Transfer timeout of every cluster (``llm.SyncKvCacheWaitTime``): the 1 s default is short for
#: 256 MiB over loopback TCP on a loaded 2-core machine.
TRANSFER_TIMEOUT_MS = 60000
#: Harness timeout for one batch of timed repetitions.
CALL_TIMEOUT_S = 600.0
UNLINK_TIMEOUT_S = 30.0
SETTLE_RUNS = 3

#: What a measurement can time, and in which process: ``(plane, op)``; plane None = the local
#: baselines and the local copy, timed in the home process.
PUSH, PULL, MEMCPY, COPY_BLOCKS = "push", "pull", "memcpy", "copy_blocks"
#: The same push with every layer argument given (``src_layer_range``, ``dst_layer_range``,
#: ``tensor_num_per_layer``): timed in the latency case, where it must cost what a plain push does.
PUSH_LAYERS = "push_layers"
#: Not a transfer: a fixed pure-Python loop timed in the baseline process, which tells how fast
#: the (shared, virtual) CPU ran while the latency case was measured.
CPU_REFERENCE = "python_loop"


@dataclass(frozen=True)
class Case:
    label: str
    block_bytes: int
    moved: int  # blocks per transfer (one tensor)
    rounds: int  # measured repetitions per (plane, op) in the pytest suite
    batch: int  # repetitions per call into the child process

    @property
    def cache_blocks(self) -> int:
        return 2 * self.moved

    @property
    def bytes_per_transfer(self) -> int:
        return self.moved * self.block_bytes


# 256 MiB a transfer. A cache holds twice the moved blocks (512 MiB); per case: server 512 MiB,
# each client 512 MiB, plus the memcpy destination in the cma client: 2 GiB, freed between cases.
BULK_CASES = [
    Case("2MiB", 2 << 20, moved=128, rounds=30, batch=5),
    Case("16KiB", 16 << 10, moved=16384, rounds=30, batch=5),
]
# One 4 KiB block a transfer (block 0 -> block 1), in one-tensor blocks caches of two blocks.
LATENCY_CASE = Case("4KiB", 4 << 10, moved=1, rounds=5000, batch=1000)

# Targets of the issue: bulk throughput relative to the memcpy baseline (per plane and block
# size, both directions), and the median of one same-host 4 KiB push.
THROUGHPUT_TARGETS = {("cma", "2MiB"): 0.9, ("cma", "16KiB"): 0.8,
                      ("tcp", "2MiB"): 0.3, ("tcp", "16KiB"): 0.15}
LATENCY_TARGET_NS = 4_000
#: The pushes the latency target applies to (same host), plain and with layer arguments.
LATENCY_TARGET_KINDS = (("cma", PUSH), ("cma", PUSH_LAYERS))
#: NIXL 1.x over UCX, one 4 KiB write between two processes of the development VM (2 cores),
#: measured outside this project's runs: printed beside our figures as a reference, not re-measured.
NIXL_4KIB_WRITE_US = (3.8, 6.4)


def block_ids(case: Case) -> Dict[str, tuple]:
    """``{"push": (client src ids, server dst ids), "pull": (server src ids, client dst ids)}``
    as lists of ints; sources even, destinations odd, each in random order."""
    rng = np.random.default_rng(SEED + case.block_bytes)
    even = np.arange(0, case.cache_blocks, 2)
    odd = even + 1
    return {op: ([int(b) for b in rng.permutation(even)], [int(b) for b in rng.permutation(odd)])
            for op in (PUSH, PULL)}


def _pattern(salt: int, num_blocks: int) -> np.ndarray:
    """One byte value per block, different between neighbouring blocks and between buffers."""
    return ((salt * 97 + np.arange(num_blocks)) % 251 + 1).astype(np.uint8)


def _filled(case: Case, salt: int) -> np.ndarray:
    arr = np.empty((case.cache_blocks, case.block_bytes), np.uint8)
    arr[:] = _pattern(salt, case.cache_blocks)[:, None]  # faults every page in
    return arr


def _python_loop() -> int:
    total = 0
    for i in range(200):
        total += i
    return total


def _register(state, arr: np.ndarray, case: Case, model_id: Optional[int]):
    from llm_datadist import BlocksCacheKey, CacheDesc, DataType, Placement
    desc = CacheDesc(1, [case.cache_blocks, case.block_bytes], DataType.DT_UINT8, Placement.HOST)
    key = None if model_id is None else BlocksCacheKey(state.cluster_id, model_id)
    return state.cm.register_blocks_cache(desc, [arr], key)


# -- functions run in the cluster processes (``fn(state, *args)``) ----------------------------------

def serve_case(state, case: Case, model_id: int) -> None:
    """Server: allocate, fill and register the remote blocks cache of ``case``."""
    arr = _filled(case, salt=SERVER_ID)
    state.arrays["cache"] = arr
    state.caches["cache"] = _register(state, arr, case, model_id)


def client_case(state, case: Case, model_id: Optional[int], with_baselines: bool) -> None:
    """Client: allocate, fill and register the local cache; build every timed call's arguments
    once (key objects, block lists, baseline plan). ``model_id`` None: a process without a
    server (local measurements only)."""
    from llm_datadist import BlocksCacheKey
    from llm_datadist.cli import lowlevel
    arr = _filled(case, salt=state.cluster_id)
    state.arrays["cache"] = arr
    cache = state.caches["cache"] = _register(state, arr, case, None)
    ids = block_ids(case)
    ops = {}
    if model_id is not None:
        key = BlocksCacheKey(SERVER_ID, model_id)
        ops[PUSH] = (state.cm.push_blocks, (key, cache, *ids[PUSH]))
        # One tensor = one layer with tensor_num_per_layer=1: the same bytes as PUSH.
        ops[PUSH_LAYERS] = (state.cm.push_blocks, (key, cache, *ids[PUSH]),
                            dict(src_layer_range=range(0, 1), dst_layer_range=range(0, 1), tensor_num_per_layer=1))
        ops[PULL] = (state.cm.pull_blocks, (key, cache, *ids[PULL]))
    if with_baselines:
        twin = _filled(case, salt=state.cluster_id + 100)
        state.arrays["twin"] = twin
        layout = lowlevel.CacheLayout([arr.ctypes.data], case.cache_blocks, case.block_bytes)
        twin_layout = lowlevel.CacheLayout([twin.ctypes.data], case.cache_blocks, case.block_bytes)
        plan = lowlevel.plan_blocks(layout, twin_layout, None, None, *ids[PUSH])
        if len(plan) != case.moved or plan.total_bytes != case.bytes_per_transfer:
            raise AssertionError(f"baseline plan has {len(plan)} descriptors for {case.moved} blocks")
        ops[MEMCPY] = (lowlevel.memcpy_baseline, (plan,))
        ops[CPU_REFERENCE] = (_python_loop, ())
        # The push's sources onto its destination ids, inside this cache: sources even,
        # destinations odd, so no copy reads a block that another one writes.
        ops[COPY_BLOCKS] = (state.cm.copy_blocks, (cache, {s: [d] for s, d in zip(*ids[PUSH])}))
    state.scratch["ops"] = ops


def unlink_peer(state, peer_id: int, ip: str, port: int) -> int:
    """Unlink from ``peer_id``, telling it (a link that merely ends is reported as lost by the
    side left behind); the status. Also the demo's."""
    from llm_datadist import LLMClusterInfo
    info = LLMClusterInfo()
    info.remote_cluster_id = peer_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info(ip, port)
    status, _ = state.dd.unlink_clusters([info])
    return int(status)


def sample(state, name: str, ids: Sequence[int]) -> np.ndarray:
    """First and last byte of every 4 KiB page of blocks ``ids`` (in order) of array ``name``."""
    arr = state.arrays[name]
    return np.concatenate([arr[ids, ::4096], arr[ids, -1:]], axis=1)


def sample_digest(state, name: str, ids: Sequence[int]) -> str:
    """SHA-256 of ``sample`` (what a server on another host sends instead of the bytes)."""
    import hashlib
    return hashlib.sha256(np.ascontiguousarray(sample(state, name, ids)).tobytes()).hexdigest()


def _op(state, op: str):
    """``(fn, args, kwargs)`` of a timed operation (kwargs optional in ``scratch["ops"]``)."""
    entry = state.scratch["ops"][op]
    return entry if len(entry) == 3 else (*entry, {})


def settle(state, ops: Sequence[str]) -> None:
    for op in ops:
        fn, args, kwargs = _op(state, op)
        for _ in range(SETTLE_RUNS):
            fn(*args, **kwargs)


def timed(state, op: str, repetitions: int) -> List[int]:
    """Run ``op`` ``repetitions`` times back to back; the nanoseconds of each."""
    fn, args, kwargs = _op(state, op)
    clock = time.perf_counter_ns
    durations = []
    if kwargs:  # the keyword arguments are built once, like the positional ones
        for _ in range(repetitions):
            start = clock()
            fn(*args, **kwargs)
            durations.append(clock() - start)
        return durations
    for _ in range(repetitions):
        start = clock()
        fn(*args)
        durations.append(clock() - start)
    return durations


def profile_op(state, op: str, repetitions: int, top: int = 25) -> str:
    """cProfile of ``repetitions`` runs of ``op`` in this process, as text (for bottleneck hunts)."""
    import cProfile
    import io
    import pstats
    fn, args, kwargs = _op(state, op)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repetitions):
        fn(*args, **kwargs)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def drop_case(state) -> None:
    """Unregister the case's cache and free its memory."""
    cache = state.caches.pop("cache", None)
    if cache is not None:
        state.cm.unregister_cache(cache.cache_id)
    state.caches.clear()
    state.arrays.clear()
    state.scratch.clear()
    gc.collect()


# -- the parent's side --------------------------------------------------------------------------

def kinds(case: Case, planes: Optional[Sequence[str]] = None, local_copy: Optional[bool] = None,
          ops: Optional[Sequence[str]] = None) -> List[tuple]:
    """``(plane, op)`` of every measurement of ``case``: the baselines first (plane None), then
    ``ops`` on each of ``planes`` (default ``default_planes()``; ops default: push and pull, plus
    the push with layer arguments
    for one-block cases). ``local_copy`` (default: for one-block cases only) adds the public
    local copy (``copy_blocks``)."""
    if local_copy is None:
        local_copy = case.moved == 1
    if ops is None:
        ops = (PUSH, PUSH_LAYERS, PULL) if case.moved == 1 else (PUSH, PULL)
    local = [(None, MEMCPY)] + ([(None, COPY_BLOCKS)] if local_copy else [])
    return local + [(plane, op) for plane in (default_planes() if planes is None else planes) for op in ops]


def kind_label(plane: Optional[str], op: str) -> str:
    return op if plane is None else f"{plane} {op}"


class LocalServer:
    """The rig's server: a cluster process of this host, listening on 127.0.0.1 with
    ``llm.DataPlane=auto``. ``bench_roles.RemoteServer`` is the same for a server on another
    host (``bench --role server``)."""

    def __init__(self, options: Dict[str, str]) -> None:
        from llm_datadist.testing import Cluster
        self.cluster = Cluster(SERVER_ID, role="PROMPT", listen=True, options={**options, "llm.DataPlane": "auto"})

    def link(self, client, plane: str) -> None:
        from llm_datadist.testing import link
        status, per_cluster = link(client, self.cluster, timeout_ms=10000)
        if status != 0:
            raise RuntimeError(f"the {plane} client could not link to the server: status {status}, {per_cluster}")

    def attach(self, home) -> None:
        """``home`` is the process that times the baselines (nothing to do for a local server)."""

    def serve(self, case: Case, model_id: int) -> None:
        self.cluster.call(serve_case, case, model_id, timeout=CALL_TIMEOUT_S)

    def digest(self, case: Case, op: str, index: int) -> str:
        """``sample_digest`` of the server's blocks ``block_ids(case)[op][index]``."""
        return self.cluster.call(sample_digest, "cache", block_ids(case)[op][index], timeout=CALL_TIMEOUT_S)

    def drop(self) -> None:
        if self.cluster.process.is_alive():
            self.cluster.call(drop_case, timeout=CALL_TIMEOUT_S)

    def finish(self) -> None:
        """The last word before the clients unlink (nothing for a local server)."""

    def unlink(self, client) -> None:
        client.call(unlink_peer, SERVER_ID, *self.cluster.address, timeout=UNLINK_TIMEOUT_S)

    def close(self) -> None:
        self.cluster.close()


class TransportRig:
    """The server and a client per plane of ``planes`` (default both), linked; one case set up
    at a time (``use``). With no plane, one process for the local measurements. ``server``: a
    factory of the server given the clusters' common options (default ``LocalServer``);
    ``options``: more options for every cluster (a link secret)."""

    def __init__(self, planes: Optional[Sequence[str]] = None, server=None,
                 options: Optional[Dict[str, str]] = None) -> None:
        from llm_datadist.testing import Cluster
        planes = default_planes() if planes is None else planes
        unknown = set(planes) - set(PLANES)
        if unknown:
            raise ValueError(f"unknown data planes {sorted(unknown)}; known: {', '.join(PLANES)}")
        # HOST caches need no device runtime: unless the caller chose one, the children use cpu
        # rather than probe for acl or cuda.
        os.environ.setdefault("LLM_DATADIST_DEVICE", "cpu")
        # A secret of this run shared by its processes: a plane that serves only authenticated links
        # (nixl) is measured too; the others do not change with it. ``options`` may replace it.
        common = {"llm.SyncKvCacheWaitTime": str(TRANSFER_TIMEOUT_MS), "llm.LinkSecret": os.urandom(16).hex(),
                  **(options or {})}
        self.case: Optional[Case] = None
        self._next_model_id = 100
        self.clusters: list = []
        self.server = None
        self.clients = {}
        try:
            if planes:
                self.server = (server or LocalServer)(common)
            for plane in (p for p in PLANES if p in planes):
                client = Cluster(CLIENT_IDS[plane], role="DECODER", options={**common, "llm.DataPlane": plane})
                self.clusters.append(client)
                self.server.link(client, plane)
                self.clients[plane] = client
            if self.clients:
                self.home = next(iter(self.clients.values()))  # the first plane's, in registry order
                self.server.attach(self.home)
            else:
                self.home = Cluster(LONE_ID, role="PROMPT", options=common)
                self.clusters.append(self.home)
        except BaseException:
            self.close()
            raise

    def process_of(self, plane: Optional[str]):
        """The process that times a measurement: the plane's client; the home process (the cma
        client if there is one) for the local measurements."""
        return self.home if plane is None else self.clients[plane]

    def use(self, case: Case) -> None:
        """Make ``case`` the current one (no-op if it is): free the previous case's caches,
        allocate and register this one's, check that push and pull move the right bytes on both
        planes, and run every timed path a few times."""
        if self.case == case:
            return
        self.clear_case()
        # A fresh model_id per case: each client's copy of the server's table misses it on the
        # first transfer and is refreshed, whatever the previous case registered.
        model_id = self._next_model_id
        self._next_model_id += 1
        try:
            if self.server is not None:
                self.server.serve(case, model_id)
            for client in self.clients.values():
                client.call(client_case, case, model_id, client is self.home, timeout=CALL_TIMEOUT_S)
            if not self.clients:
                self.home.call(client_case, case, None, True, timeout=CALL_TIMEOUT_S)
            self._check_delivery(case)
            for plane, op in kinds(case, tuple(self.clients), local_copy=True):
                self.process_of(plane).call(settle, [op], timeout=CALL_TIMEOUT_S)
        except BaseException:
            self._drop_all()
            raise
        self.case = case

    def _check_delivery(self, case: Case) -> None:
        ids = block_ids(case)
        self.home.call(timed, COPY_BLOCKS, 1, timeout=CALL_TIMEOUT_S)
        src_ids, dst_ids = ids[PUSH]
        if not np.array_equal(self.home.call(sample, "cache", src_ids), self.home.call(sample, "cache", dst_ids)):
            raise AssertionError("copy_blocks did not copy the source blocks")
        for plane, client in self.clients.items():
            for op in (PUSH, PUSH_LAYERS, PULL):
                client.call(timed, op, 1, timeout=CALL_TIMEOUT_S)
                moved = PUSH if op == PUSH_LAYERS else op
                # push: the client's sources land in the server's destinations; pull: the reverse.
                local_ids = ids[moved][0 if moved == PUSH else 1]
                mine = client.call(sample_digest, "cache", local_ids, timeout=CALL_TIMEOUT_S)
                if mine != self.server.digest(case, moved, 1 if moved == PUSH else 0):
                    raise AssertionError(f"{plane} {op} did not deliver the source blocks")

    def measure(self, plane: Optional[str], op: str, repetitions: int) -> List[int]:
        """Nanoseconds of ``repetitions`` runs of ``op`` of the current case, timed in the
        process that runs them, ``case.batch`` back-to-back runs per call into it."""
        durations: List[int] = []
        while len(durations) < repetitions:
            batch = min(self.case.batch, repetitions - len(durations))
            durations += self.process_of(plane).call(timed, op, batch, timeout=CALL_TIMEOUT_S)
        return durations

    def profile(self, plane: Optional[str], op: str, repetitions: int) -> str:
        return self.process_of(plane).call(profile_op, op, repetitions, timeout=CALL_TIMEOUT_S)

    def clear_case(self) -> None:
        if self.case is not None:
            self._drop_all()

    def _drop_all(self) -> None:
        self.case = None
        for cluster in self.clusters:
            if cluster.process.is_alive():
                cluster.call(drop_case, timeout=CALL_TIMEOUT_S)
        if self.server is not None:
            self.server.drop()

    def close(self, unlink: bool = True) -> None:
        """Stop every process; with ``unlink``, the server has its last word and each client
        then unlinks from it (telling it), so that no side reports a lost link. Leaving a
        ``with`` block on an exception skips that: a call may still be under way in a client."""
        try:
            if unlink and self.server is not None:
                self.server.finish()
                for client in self.clients.values():
                    if client.process.is_alive():
                        self.server.unlink(client)
        finally:
            for cluster in reversed(self.clusters):
                cluster.close()
            self.clusters = []
            if self.server is not None:
                self.server.close()
                self.server = None

    def __enter__(self) -> "TransportRig":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(unlink=exc_type is None)
