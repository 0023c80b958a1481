"""``python -m llm_datadist demo``: prefill -> decode of a batch of requests, verified and timed.

Three processes on this host: this one coordinates; a prefill cluster (id 1, role PROMPT) and a
decode cluster (id 2, role DECODER) run in processes of their own (``llm_datadist.testing.
Cluster``). Each allocates a paged KV cache on the device runtime: ``2 * layers`` tensors (K and V
of every layer, interleaved) of ``[blocks, block_tokens, kv_heads, head_dim]`` fp16. Every request
owns ``ceil(tokens / block_tokens)`` blocks on each side, at block ids drawn at random from each
side's cache (the decode cache has spare blocks that no request uses). Both caches are written
(zeroed) once when allocated, as the caches of a serving process are in use: the transfers are
timed, not the first touch of their pages.

The demo never reads or writes a DEVICE cache from the host: each side keeps a HOST staging cache
of one request's blocks (``Cache.create_cpu_cache`` over numpy memory) and moves bytes between it
and the DEVICE cache with ``swap_blocks``, so the same code runs on every runtime -- ``cpu``
(device memory that is host memory), ``cuda`` or ``acl`` (memory the host cannot address, moved
between the processes by a device data plane: ``cuda_ipc`` or ``staging``).

1. The prefill process writes every block of every request: the bytes of (request, layer, K/V,
   block of the request) are a pseudo-random stream seeded with those four numbers and the seed,
   so the decode process can compute what it must receive without being sent it.
2. One transfer per request (all its blocks, every layer's K and V), timed around the call in the
   process that issues it (the call returns once the bytes are in place): ``push_blocks`` from
   prefill into decode (decode listens, prefill links to it), or with ``--pull``, ``pull_blocks``
   by decode from prefill (prefill listens, decode links to it). The data plane is the one the
   link chose (``--plane`` / ``LLM_DATADIST_DATA_PLANE`` force one).
3. The decode process checks every byte of every block of every request against the stream, and
   that its spare blocks are still zero.

``--corrupt-block N`` is a self-test of step 3: between steps 2 and 3 it flips one byte of block N
of the batch (counted over the requests in order) in layer 0's K tensor on the decode side; the
demo must then report that block and exit with status 1.

Before anything is allocated or started, the arguments alone are checked against the demo's
limits (requests, block copies) and the memory it would take (both caches and the block
tables) against the memory available; a refusal is one line naming the flags to change, exit
status 2. Ctrl-C stops the cluster processes and exits with 130.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

import numpy as np

from llm_datadist.cli.console import Progress, count, format_size, sigint_for_parent_only
from llm_datadist.cli.info import memory_shortfall

PREFILL_ID, DECODE_ID = 1, 2
MODEL_ID = 0
#: Decode-cache blocks beyond the batch's: never written, checked to stay zero.
SPARE_FRACTION = 0.25
#: Transfer deadline of both clusters (``llm.SyncKvCacheWaitTime``); the 1 s default is short for
#: a request's tens of MiB over TCP on a loaded machine.
TRANSFER_TIMEOUT_MS = 60000
CALL_TIMEOUT_S = 300.0
FP16_BYTES = 2
#: How many failing blocks the report lists.
REPORTED_FAILURES = 10
#: Limits of the work (each request costs three calls into the cluster processes, and each block
#: of each tensor is written and checked by numpy calls of its own: about a millisecond a request
#: and a tenth of one a block copy on the 2-core development VM, so a few minutes at most).
MAX_REQUESTS = 10_000
MAX_BLOCK_COPIES = 1_000_000
#: Estimated bookkeeping per block (block tables in the coordinator and the clusters) and per
#: block copy (the transfer plan's descriptors), counted with the caches against the memory.
TABLE_BYTES_PER_BLOCK = 256
PLAN_BYTES_PER_BLOCK_COPY = 64
#: The flags that make the caches smaller, named by every refusal of their size.
SIZE_FLAGS = "use fewer --requests or --tokens, or a smaller --layers, --kv-heads, --head-dim or --block-size"
#: A p99 differs from the maximum only from this many samples on.
P99_MIN_SAMPLES = 100
#: The HOST staging cache of each side (``Staging``) holds this many requests' blocks.
STAGING_REQUESTS = 1


class DemoError(Exception):
    """The demo cannot run as asked (bad sizes, unusable runtime, a failed link): a message, exit 2."""


@dataclass(frozen=True)
class Geometry:
    layers: int
    block_tokens: int
    kv_heads: int
    head_dim: int

    @property
    def num_tensors(self) -> int:
        return 2 * self.layers

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one tensor (K or V of one layer)."""
        return self.block_tokens * self.kv_heads * self.head_dim * FP16_BYTES

    def describe(self) -> str:
        return (f"{count(self.layers, 'layer')} x K/V = {self.num_tensors} tensors; a block is "
                f"{count(self.block_tokens, 'token')} x {count(self.kv_heads, 'KV head')} x "
                f"{self.head_dim} head dim x fp16 = "
                f"{format_size(self.block_bytes)} per tensor, {format_size(self.block_bytes * self.num_tensors)} "
                f"over all layers")


@dataclass(frozen=True)
class BatchShape:
    """The sizes of a batch, from the arguments alone (nothing allocated)."""

    requests: int
    blocks_per_request: int
    spare_blocks: int

    @property
    def total_blocks(self) -> int:
        return self.requests * self.blocks_per_request

    @property
    def prefill_cache_blocks(self) -> int:
        return self.total_blocks

    @property
    def decode_cache_blocks(self) -> int:
        return self.total_blocks + self.spare_blocks


def batch_shape(requests: int, tokens: int, block_tokens: int) -> BatchShape:
    per_request = -(-tokens // block_tokens)  # ceil, in integers however large
    return BatchShape(requests, per_request, max(1, int(requests * per_request * SPARE_FRACTION)))


def check_budget(geometry: Geometry, shape: BatchShape, caches_in_host_memory: bool = True,
                 sides: Sequence[str] = ("prefill", "decode")) -> None:
    """Refuse (``DemoError``, naming the flags to change) a batch beyond the demo's limits or the
    memory available, from the sizes alone: before anything is allocated or started. The caches
    of ``sides`` (both on one host; one side's with ``--role``) count against host memory when the
    runtime's device memory is host memory (``caches_in_host_memory``); their HOST staging caches
    always do."""
    if shape.requests > MAX_REQUESTS:
        raise DemoError(f"--requests {shape.requests} is more than the demo's {MAX_REQUESTS:,} (each request is "
                        f"a call into the cluster processes); use fewer --requests")
    copies = shape.total_blocks * geometry.num_tensors
    if copies > MAX_BLOCK_COPIES:
        raise DemoError(f"the batch has {copies:,} block copies ({shape.total_blocks:,} blocks x "
                        f"{geometry.num_tensors} tensors), more than the {MAX_BLOCK_COPIES:,} the demo writes and "
                        f"checks one by one; use fewer --requests, --tokens or --layers, or a larger --block-size")
    per_block = geometry.block_bytes * geometry.num_tensors
    blocks = sum({"prefill": shape.prefill_cache_blocks, "decode": shape.decode_cache_blocks}[side] for side in sides)
    cache_bytes = blocks * per_block if caches_in_host_memory else 0
    cache_bytes += len(sides) * staging_blocks(shape) * per_block
    table_bytes = blocks * TABLE_BYTES_PER_BLOCK + copies * PLAN_BYTES_PER_BLOCK_COPY
    shortfall = memory_shortfall(cache_bytes + table_bytes)
    if shortfall:
        caches = "the two caches" if len(sides) == 2 else f"the {sides[0]} cache"
        what = caches if caches_in_host_memory else caches.replace("cache", "HOST staging cache")
        raise DemoError(f"{what} and {'their' if len(sides) == 2 else 'its'} block tables would take {shortfall}; "
                        f"{SIZE_FLAGS}")


def staging_blocks(shape: BatchShape) -> int:
    """Blocks per tensor of each side's HOST staging cache."""
    return STAGING_REQUESTS * shape.blocks_per_request


def check_data_plane() -> str:
    """The data plane asked for by ``LLM_DATADIST_DATA_PLANE`` (``auto`` if unset), refused before
    any cluster process starts if the engine would refuse it."""
    from llm_datadist.transport.planes import DATA_PLANE_ENV, choices
    value = os.environ.get(DATA_PLANE_ENV) or "auto"
    if value.strip().lower() not in choices():
        raise DemoError(f"{DATA_PLANE_ENV}={value!r} is not a data plane ({', '.join(choices())}); "
                        f"set it to one, unset it, or pass --plane")
    return value.strip().lower()


@dataclass(frozen=True)
class Batch:
    """Which blocks each request owns on each side (block tables, logical block order)."""

    prefill_blocks: List[List[int]]
    decode_blocks: List[List[int]]
    prefill_cache_blocks: int
    decode_cache_blocks: int

    @property
    def total_blocks(self) -> int:
        return sum(len(b) for b in self.prefill_blocks)

    def spare_decode_blocks(self) -> List[int]:
        used = {b for table in self.decode_blocks for b in table}
        return [b for b in range(self.decode_cache_blocks) if b not in used]

    def locate(self, index: int) -> tuple:
        """``(request, block of the request)`` of block ``index`` of the batch."""
        for request, table in enumerate(self.decode_blocks):
            if index < len(table):
                return request, index
            index -= len(table)
        raise IndexError(index)


def make_batch(shape: BatchShape, seed: int) -> Batch:
    total, per_request = shape.total_blocks, shape.blocks_per_request
    rng = np.random.default_rng([seed, 0xB10C])
    prefill = rng.permutation(total).tolist()
    decode = rng.permutation(shape.decode_cache_blocks)[:total].tolist()
    cut = [slice(r * per_request, (r + 1) * per_request) for r in range(shape.requests)]
    return Batch([prefill[c] for c in cut], [decode[c] for c in cut], shape.prefill_cache_blocks,
                 shape.decode_cache_blocks)


def expected_block(seed: int, request: int, layer: int, kv: int, block: int, nbytes: int) -> np.ndarray:
    """The bytes of block ``block`` of ``request`` in tensor (``layer``, ``kv``: 0 = K, 1 = V)."""
    return np.frombuffer(np.random.default_rng([seed, request, layer, kv, block]).bytes(nbytes), np.uint8)


def _bytes(count: int, singular_verb: str, plural_verb: str) -> str:
    return f"1 byte {singular_verb}" if count == 1 else f"{count} bytes {plural_verb}"


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (``fraction`` in (0, 1])."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def latency_summary(per_request: Sequence[float]) -> dict:
    """Median, minimum and maximum, and the p99 where the sample has one: below
    ``P99_MIN_SAMPLES`` values the nearest-rank p99 is the maximum, so it is None."""
    return dict(median=statistics.median(per_request), min=min(per_request), max=max(per_request),
                p99=percentile(per_request, 0.99) if len(per_request) >= P99_MIN_SAMPLES else None,
                per_request=list(per_request))


# -- functions run in the cluster processes (``fn(state, *args)``) ----------------------------------

def side_setup(state, geometry: Geometry, num_blocks: int, staging: int) -> dict:
    """Allocate this side's paged KV cache (DEVICE, the process's runtime), keyed for the peer,
    and its HOST staging cache of ``staging`` blocks; zero every block of the KV cache through
    the staging cache (which also faults its pages in, as a serving process's cache is: time
    transfers, not faults)."""
    from llm_datadist import BlocksCacheKey, Cache, CacheDesc, DataType, Placement
    shape = [num_blocks, geometry.block_tokens, geometry.kv_heads, geometry.head_dim]
    desc = CacheDesc(geometry.num_tensors, shape, DataType.DT_FLOAT16, Placement.DEVICE)
    state.caches["kv"] = state.cm.allocate_blocks_cache(desc, BlocksCacheKey(state.cluster_id, MODEL_ID))
    # uint8 [tensors, staging blocks, block_bytes]: the bytes the demo writes and checks.
    host = np.zeros((geometry.num_tensors, staging, geometry.block_bytes), np.uint8)
    host_desc = CacheDesc(geometry.num_tensors, [staging, *shape[1:]], DataType.DT_FLOAT16, Placement.HOST)
    state.arrays["staging"] = host
    state.caches["staging"] = Cache.create_cpu_cache(host_desc, [host[t] for t in range(geometry.num_tensors)])
    for first in range(0, num_blocks, staging):
        _to_device(state, range(first, min(num_blocks, first + staging)))
    engine = state.dd.engine
    return dict(pid=os.getpid(), runtime=engine.runtime.name, runtime_reason=engine.runtime_reason,
                host_addressable=bool(engine.runtime.host_addressable))


def _to_device(state, blocks: Sequence[int]) -> None:
    """Staging block ``k`` -> KV cache block ``blocks[k]``, every tensor (``swap_blocks`` H2D)."""
    state.cm.swap_blocks(state.caches["staging"], state.caches["kv"], {k: b for k, b in enumerate(blocks)})


def _to_host(state, blocks: Sequence[int]) -> np.ndarray:
    """KV cache block ``blocks[k]`` -> staging block ``k``, every tensor (``swap_blocks`` D2H);
    the staging array ``[tensors, staging blocks, block_bytes]``."""
    state.cm.swap_blocks(state.caches["kv"], state.caches["staging"], {b: k for k, b in enumerate(blocks)})
    return state.arrays["staging"]


def fill_request(state, geometry: Geometry, seed: int, request: int, blocks: List[int]) -> None:
    """Write the known bytes of every block of ``request`` (prefill side)."""
    host = state.arrays["staging"]
    for tensor in range(geometry.num_tensors):
        layer, kv = divmod(tensor, 2)
        for block in range(len(blocks)):
            host[tensor, block] = expected_block(seed, request, layer, kv, block, geometry.block_bytes)
    _to_device(state, blocks)


def transfer_request(state, pull: bool, peer_id: int, src_blocks: List[int], dst_blocks: List[int]) -> int:
    """Push this side's ``src_blocks`` into the peer's ``dst_blocks``, or (``pull``) pull the
    peer's ``src_blocks`` into this side's ``dst_blocks``; nanoseconds the call took."""
    from llm_datadist import BlocksCacheKey
    cache, key = state.caches["kv"], BlocksCacheKey(peer_id, MODEL_ID)
    transfer = state.cm.pull_blocks if pull else state.cm.push_blocks
    start = time.perf_counter_ns()
    transfer(key, cache, src_blocks, dst_blocks)
    return time.perf_counter_ns() - start


def plane_to(state, peer_id: int, device: bool) -> str:
    """The data plane this side's transfers to ``peer_id`` use: the link's plane (chosen when
    the link was made) for host-addressable caches; with device memory the host cannot address on
    both sides, the link's device plane for that combination."""
    if not device:
        return state.dd.engine.data_plane(peer_id)
    return state.dd.engine.data_plane(peer_id, local_device=True, remote_device=True)


def corrupt(state, physical_block: int, tensor: int) -> None:
    """Flip one byte in the middle of ``physical_block`` of ``tensor`` (the verifier's self-test)."""
    row = _to_host(state, [physical_block])[tensor, 0]
    row[row.size // 2] ^= 0xFF
    _to_device(state, [physical_block])


def verify_request(state, geometry: Geometry, seed: int, request: int, blocks: List[int]) -> List[dict]:
    """Every byte of every block of ``request`` (decode side); one entry per wrong block tensor."""
    failures = []
    host = _to_host(state, blocks)
    for tensor in range(geometry.num_tensors):
        layer, kv = divmod(tensor, 2)
        for block, physical in enumerate(blocks):
            expected = expected_block(seed, request, layer, kv, block, geometry.block_bytes)
            got = host[tensor, block]
            if not np.array_equal(got, expected):
                wrong = np.flatnonzero(got != expected)
                first = int(wrong[0])
                failures.append(dict(request=request, layer=layer, kv="KV"[kv], block=block,
                                     decode_block=physical, bytes_wrong=int(wrong.size),
                                     first_byte=first, got=int(got[first]), expected=int(expected[first])))
    return failures


def verify_untouched(state, blocks: List[int]) -> List[dict]:
    """Blocks no request owns must still be zero (nothing written outside the destinations)."""
    failures = []
    staging = state.arrays["staging"].shape[1]
    for first in range(0, len(blocks), staging):
        chunk = blocks[first:first + staging]
        host = _to_host(state, chunk)
        for tensor in range(host.shape[0]):
            for k, physical in enumerate(chunk):
                wrong = np.flatnonzero(host[tensor, k])
                if wrong.size:
                    failures.append(dict(layer=tensor // 2, kv="KV"[tensor % 2], decode_block=physical,
                                         bytes_wrong=int(wrong.size), first_byte=int(wrong[0])))
    failures.sort(key=lambda f: (f["layer"], f["kv"], f["decode_block"]))
    return failures


# -- the coordinator ---------------------------------------------------------------------------

def device_planes() -> tuple:
    """The registered data planes that move device memory the host cannot address
    (``DataPlane.device_memory``: ``cuda_ipc``, ``staging``)."""
    from llm_datadist.transport import planes
    return tuple(name for name in planes.names() if getattr(planes.get(name), "device_memory", False))


def choose_device(requested: Optional[str]) -> tuple:
    """``(runtime name, why, whether its memory is host-addressable)`` for the children:
    ``requested`` (or ``LLM_DATADIST_DEVICE``) if it can move DEVICE blocks between processes --
    host-addressable memory always can, other memory when a device data plane is registered;
    without an explicit choice, the registry's host-addressable fallback (``cpu``) when the
    auto-detected runtime cannot. An explicit runtime that cannot be used is a ``DemoError``.
    Sets ``LLM_DATADIST_DEVICE`` for the children."""
    from llm_datadist import LLMException, runtimes
    if requested is not None:
        os.environ["LLM_DATADIST_DEVICE"] = requested
    explicit = os.environ.get("LLM_DATADIST_DEVICE", "auto").strip().lower() not in ("", "auto")
    try:
        runtime, reason = runtimes.select_runtime()
    except LLMException as exc:
        raise DemoError(str(exc).split(" (status_code")[0]) from None
    if runtime.host_addressable:
        os.environ["LLM_DATADIST_DEVICE"] = runtime.name
        return runtime.name, reason, True
    carriers = device_planes()
    if carriers:
        os.environ["LLM_DATADIST_DEVICE"] = runtime.name
        return runtime.name, f"{reason}; device memory moves over {' or '.join(carriers)}", False
    unsupported = (f"transfers of {runtime.name} device memory between processes need a device data "
                   f"plane (device IPC or staging), and none is registered")
    fallback = runtimes.host_addressable_fallback()
    if explicit:
        raise DemoError(f"device runtime {runtime.name}: {unsupported}; run with --device {fallback}")
    os.environ["LLM_DATADIST_DEVICE"] = fallback
    return fallback, f"{runtime.name} was detected, but {unsupported}", True


def check_plane_carries(asked_plane: str, host_addressable: bool) -> None:
    """A forced plane that cannot move the caches' memory is refused before anything starts."""
    from llm_datadist.transport import planes
    if host_addressable or asked_plane == planes.AUTO:
        return
    if not getattr(planes.get(asked_plane), "device_memory", False):
        raise DemoError(f"data plane {asked_plane} cannot move device memory that the host cannot address; "
                        f"use --plane {' or --plane '.join(device_planes())} or auto")


def workload_lines(geometry: Geometry, tokens: int, batch: Batch) -> List[str]:
    """The report's ``geometry:`` and ``batch:`` lines."""
    requests = len(batch.prefill_blocks)
    return [f"geometry:  {geometry.describe()}",
            f"batch:     {count(requests, 'request')} x {count(tokens, 'token')} = "
            f"{count(len(batch.prefill_blocks[0]), 'block')} each, {count(batch.total_blocks, 'block')}"]


def run(geometry: Geometry, requests: int, tokens: int, pull: bool, plane: Optional[str],
        device: Optional[str], seed: int, corrupt_block: Optional[int] = None, out=None) -> dict:
    """Run the demo and return its report (``report["verified"]`` says whether every byte
    arrived). Raises ``DemoError`` when it cannot run as asked."""
    from llm_datadist.cli.workload import unlink_peer
    from llm_datadist.testing import ChildError, Cluster, link

    out = out or (lambda line: None)
    shape = batch_shape(requests, tokens, geometry.block_tokens)
    if corrupt_block is not None and not 0 <= corrupt_block < shape.total_blocks:
        raise DemoError(f"--corrupt-block {corrupt_block}: the batch has blocks 0..{shape.total_blocks - 1}")
    per_block = geometry.block_bytes * geometry.num_tensors
    if plane is not None:
        os.environ["LLM_DATADIST_DATA_PLANE"] = plane
    asked_plane = check_data_plane()
    runtime, runtime_why, host_addressable = choose_device(device)
    check_plane_carries(asked_plane, host_addressable)
    check_budget(geometry, shape, caches_in_host_memory=host_addressable)
    batch = make_batch(shape, seed)
    staging = staging_blocks(shape)

    op = "pull_blocks" if pull else "push_blocks"
    for line in workload_lines(geometry, tokens, batch):
        out(line)
    sizes = [format_size(blocks * per_block) for blocks in (batch.prefill_cache_blocks, batch.decode_cache_blocks)]
    out(f"caches:    prefill {count(batch.prefill_cache_blocks, 'block')} ({sizes[0]}), "
        f"decode {count(batch.decode_cache_blocks, 'block')} ({sizes[1]}), "
        f"DEVICE memory of the {runtime} runtime ({runtime_why})")

    # A secret of this run shared by its two processes: cuda_ipc hands GPU memory only to a peer
    # on an authenticated link (docs/security.md).
    secret = os.urandom(16).hex()

    def options(cache_blocks: int) -> dict:
        return {"llm.SyncKvCacheWaitTime": str(TRANSFER_TIMEOUT_MS), "llm.LinkSecret": secret,
                "llm.MemPoolConfig": json.dumps({"memory_size": cache_blocks * per_block + (1 << 20)})}

    progress = Progress(3 * requests)
    progress.step("starting prefill and decode", 0)
    try:
        with contextlib.ExitStack() as clusters:
            with sigint_for_parent_only():  # Ctrl-C is this process's to handle: it closes them
                prefill = clusters.enter_context(Cluster(PREFILL_ID, role="PROMPT", listen=pull,
                                                         timeout=CALL_TIMEOUT_S,
                                                         options=options(batch.prefill_cache_blocks)))
                decode = clusters.enter_context(Cluster(DECODE_ID, role="DECODER", listen=not pull,
                                                        timeout=CALL_TIMEOUT_S,
                                                        options=options(batch.decode_cache_blocks)))
            issuer, target = (decode, prefill) if pull else (prefill, decode)
            status, per_cluster = link(issuer, target, timeout_ms=10000)
            if status != 0:
                raise DemoError(f"cluster {issuer.cluster_id} could not link to cluster "
                                f"{target.cluster_id}: status {status}, per cluster {per_cluster}")
            progress.step("allocating the caches", 0)
            prefill_info = prefill.call(side_setup, geometry, batch.prefill_cache_blocks, staging)
            decode_info = decode.call(side_setup, geometry, batch.decode_cache_blocks, staging)
            pids = f"prefill (pid {prefill_info['pid']})", f"decode (pid {decode_info['pid']})"
            direction = f"{pids[1]} pulls from {pids[0]}" if pull else f"{pids[0]} pushes to {pids[1]}"

            for request, blocks in enumerate(batch.prefill_blocks):
                prefill.call(fill_request, geometry, seed, request, blocks)
                progress.step(f"prefill {request + 1}/{requests}")
            latencies_ns = []
            for request in range(requests):
                latencies_ns.append(issuer.call(transfer_request, pull, target.cluster_id,
                                                batch.prefill_blocks[request], batch.decode_blocks[request]))
                progress.step(f"{op} {request + 1}/{requests}")
            # Asked after the transfers: a device plane is chosen by the first transfer that needs one.
            used_plane = issuer.call(plane_to, target.cluster_id, not host_addressable)
            out(f"transfer:  {direction} with {op}, one call per request, data plane {used_plane} "
                f"(asked: {asked_plane})")
            if corrupt_block is not None:
                request, block = batch.locate(corrupt_block)
                decode.call(corrupt, batch.decode_blocks[request][block], 0)
            failures = []
            for request, blocks in enumerate(batch.decode_blocks):
                failures += decode.call(verify_request, geometry, seed, request, blocks)
                progress.step(f"verify {request + 1}/{requests}")
            spare = batch.spare_decode_blocks()
            untouched_failures = decode.call(verify_untouched, spare)
            # Unlink (telling the peer) before closing: a link that merely ends is reported as lost.
            issuer.call(unlink_peer, target.cluster_id, *target.address)
    except ChildError as exc:
        raise DemoError(f"{exc.kind} in a cluster process: {exc.message}") from None
    except TimeoutError as exc:
        raise DemoError(str(exc)) from None
    finally:
        progress.close()

    moved = batch.total_blocks * per_block
    busy_s = sum(latencies_ns) / 1e9
    per_request = [ns / 1e6 for ns in latencies_ns]
    return dict(
        geometry=asdict(geometry), requests=requests, tokens_per_request=tokens,
        blocks_per_request=len(batch.prefill_blocks[0]), blocks=batch.total_blocks,
        tensors=geometry.num_tensors, descriptors=batch.total_blocks * geometry.num_tensors,
        bytes=moved, bytes_per_request=len(batch.prefill_blocks[0]) * per_block, operation=op,
        data_plane=used_plane, data_plane_asked=asked_plane,
        device_runtime=runtime, device_runtime_reason=runtime_why, device_host_addressable=host_addressable,
        staging_blocks=staging,
        prefill_pid=prefill_info["pid"], decode_pid=decode_info["pid"],
        transfer_seconds=busy_s, gbps=moved / busy_s / 1e9 if busy_s else 0.0,
        latency_ms=latency_summary(per_request),
        spare_decode_blocks=len(spare), corrupted_block=corrupt_block,
        failures=failures, untouched_failures=untouched_failures,
        verified=not failures and not untouched_failures)


def print_report(report: dict, out) -> None:
    """The report's lines after the run (``out(line)``)."""
    lat = report["latency_ms"]
    out(f"moved:     {count(report['requests'], 'request')}, {count(report['blocks'], 'block')} x "
        f"{report['tensors']} tensors = {count(report['descriptors'], 'block copy', 'block copies')}, "
        f"{format_size(report['bytes'])} in "
        f"{report['transfer_seconds'] * 1e3:.1f} ms inside {report['operation']}: "
        f"{report['gbps']:.2f} GB/s over {report['data_plane']}")
    p99 = "" if lat["p99"] is None else f", p99 {lat['p99']:.2f} ms"
    out(f"latency:   per request ({report['operation']} of {count(report['blocks_per_request'], 'block')} x "
        f"{report['tensors']} tensors, {format_size(report['bytes_per_request'])}, completion included): "
        f"median {lat['median']:.2f} ms{p99}, max {lat['max']:.2f} ms over {count(report['requests'], 'request')}"
        + ("" if p99 else " (too few for a p99)"))
    # With --role, the prefill side reports the decode side's verdict, which lists the first
    # failures only and counts them all (``failure_count``, ``untouched_count``).
    where = f" (checked by the {report['checked_by']})" if report.get("checked_by") else ""
    if report["verified"]:
        out(f"verified:  every byte of {count(report['blocks'], 'block')} x {report['tensors']} tensors matches; "
            f"{count(report['spare_decode_blocks'], 'spare decode block')} untouched{where}")
        return
    failures, untouched = report["failures"], report["untouched_failures"]
    failed = report.get("failure_count", len(failures))
    written = report.get("untouched_count", len(untouched))
    out(f"VERIFICATION FAILED: {failed} of {report['descriptors']} block tensors differ, "
        f"{written} spare block tensors were written{where}")
    for f in failures[:REPORTED_FAILURES]:
        out(f"  request {f['request']} block {f['block']} (decode block {f['decode_block']}), layer "
            f"{f['layer']} {f['kv']}: {_bytes(f['bytes_wrong'], 'differs', 'differ')}, first at byte {f['first_byte']} "
            f"(got 0x{f['got']:02x}, expected 0x{f['expected']:02x})")
    for f in untouched[:REPORTED_FAILURES]:
        out(f"  spare decode block {f['decode_block']}, layer {f['layer']} {f['kv']}: "
            f"{_bytes(f['bytes_wrong'], 'written', 'written')}, first at byte {f['first_byte']}")
    hidden = failed - len(failures[:REPORTED_FAILURES]) + written - len(untouched[:REPORTED_FAILURES])
    if hidden:
        out(f"  ... and {hidden} more")
