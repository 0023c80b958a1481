"""Layer-wise asynchronous transfers (``transfer_cache_async``): jobs and the threads that run them.

``LayerRunner`` turns the destinations of one call (``LayerTarget``) into jobs -- one per
destination, a plan maker per source layer -- and runs them layer by layer in a background
thread, each layer gated by the caller's synchronizer. It moves bytes only through the transfer
function it is handed (``transfer(remote_id, local record, write, make_plan)``, the engine's),
and it owns its threads: ``stop`` tells them to start nothing more and waits for them (bounded).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any, Callable, List, Optional, Sequence, Tuple

from llm_datadist import _core
from llm_datadist._validate import param_invalid
from llm_datadist.engine.values import BLOCKS, BlockSpec, CacheRecord, LayerTarget, resolve_remote
from llm_datadist.status import LLMException, LLMStatusCode

logger = logging.getLogger("llm_datadist")

#: How long ``stop`` (at ``finalize``) waits in all for the ``transfer_cache_async`` threads still
#: running (a transfer in flight ends at the link's timeout; a synchronizer that never returns is
#: abandoned, and its thread starts no transfer after it returns).
FINALIZE_JOIN_S = 10.0

#: ``transfer(remote_id, local, write, make_plan)``: plan against the peer's table with
#: ``make_plan(table)`` and move the bytes (``write``: ``local`` -> the peer).
TransferFn = Callable[[int, CacheRecord, bool, Callable[[Any], Any]], Any]


def layer_plan(src: CacheRecord, dst_layout, st, dt, row: int, dst_row: int, blocks: Optional[BlockSpec]):
    """The plan of one layer: rows (``blocks`` None), blocks, or a row cut into blocks."""
    if blocks is None:
        return _core.plan_rows(src.layout, dst_layout, st, dt, row, dst_row, 0, 0, -1)
    if not blocks.row_to_blocks:
        return _core.plan_blocks(src.layout, dst_layout, st, dt, blocks.src_blocks, blocks.dst_blocks,
                                 blocks.block_bytes)
    return _core.plan_row_to_blocks(src.layout, dst_layout, st, dt, row, blocks.dst_blocks)


def raw_layer_maker(src: CacheRecord, target: LayerTarget, layer: int, addrs, blocks: Optional[BlockSpec]):
    """The plan maker of ``layer`` into the raw tensor addresses ``addrs`` (its two tensors)."""
    if blocks is None:
        layout = _core.CacheLayout(list(addrs), 1, src.row_bytes)
    else:
        top = int(blocks.dst_blocks.max()) + 1 if len(blocks.dst_blocks) else 1
        layout = _core.CacheLayout(list(addrs), top, blocks.block_bytes)
    tensors = [2 * layer, 2 * layer + 1]
    return lambda table: layer_plan(src, layout, tensors, [0, 1], target.src_row, 0, blocks)


def keyed_layer_maker(src: CacheRecord, target: LayerTarget, layer: int, dst_layer: int,
                      blocks: Optional[BlockSpec]):
    """The plan maker of ``layer`` into layer ``dst_layer`` of the remote cache ``target.ref``."""
    remote_id, ref = target.remote_id, target.ref

    def make(table):
        cache, row = resolve_remote(table, remote_id, ref)
        if 2 * dst_layer + 1 >= cache.num_tensors:
            raise param_invalid(f"destination layer {dst_layer} exceeds the {cache.num_tensors // 2} "
                                f"layers of remote cache {cache.cache_id}")
        if blocks is not None and blocks.row_to_blocks and blocks.block_bytes != cache.row_bytes:
            raise param_invalid(f"dst_block_memory_size {blocks.block_bytes} differs from the remote block "
                                f"size {cache.row_bytes}")
        return layer_plan(src, cache.layout, [2 * layer, 2 * layer + 1],
                          [2 * dst_layer, 2 * dst_layer + 1], target.src_row, row, blocks)
    return make


class LayerRunner:
    """The layer-wise jobs of one cluster and the threads running them."""

    def __init__(self, cluster_id: int, transfer: TransferFn) -> None:
        self.cluster_id = cluster_id
        self._transfer = transfer
        self._lock = threading.Lock()
        self._threads: List[threading.Thread] = []
        self._stopping = threading.Event()

    @property
    def stopping(self) -> bool:
        """Whether ``stop`` was called (since the last ``restart``)."""
        return self._stopping.is_set()

    def restart(self) -> None:
        """Accept jobs again after a ``stop`` (the engine initialized again)."""
        self._stopping = threading.Event()

    def jobs(self, src: CacheRecord, targets: Sequence[LayerTarget], blocks: Optional[BlockSpec]) -> list:
        """One job per target: ``(remote cluster, {source layer: plan maker})``. ``blocks`` None
        moves rows; a spec moves blocks, or (``row_to_blocks``) cuts the row into blocks."""
        num_layers = src.num_tensors // 2
        if src.kind == BLOCKS and (blocks is None or blocks.row_to_blocks):
            # A blocks source read as rows, as CANN reads it: one row (batch size 1) of one block
            # for a row transfer (block 0 goes), of the whole tensor when cut into blocks.
            row_bytes = src.row_bytes if blocks is None else src.tensor_bytes
            src = replace(src, layout=_core.CacheLayout(list(src.addrs), 1, row_bytes))
        jobs = []
        for target in targets:
            src_range = target.src_layers
            if src_range.stop > num_layers:
                raise param_invalid(f"src_layer_range {src_range} exceeds the {num_layers} layers of the source")
            if target.dst_addrs is not None:
                addrs = target.dst_addrs
                if len(addrs) != 2 * len(src_range):
                    raise param_invalid(f"dst_addrs needs {2 * len(src_range)} addresses, got {len(addrs)}")
                makers = {layer: raw_layer_maker(src, target, layer, addrs[2 * k:2 * k + 2], blocks)
                          for k, layer in enumerate(src_range)}
            else:
                # No dst_layer_range (a setter allows None): each layer into the same layer, as in CANN.
                dst_start = src_range.start if target.dst_layer_start is None else target.dst_layer_start
                makers = {layer: keyed_layer_maker(src, target, layer, dst_start + k, blocks)
                          for k, layer in enumerate(src_range)}
            if target.remote_id == self.cluster_id:
                raise param_invalid(f"transfer config names this cluster ({target.remote_id}) as its destination")
            jobs.append((target.remote_id, makers))
        return jobs

    def start(self, src: CacheRecord, synchronizer, jobs: list
              ) -> Tuple[threading.Thread, List[Optional[LLMStatusCode]]]:
        """Run ``jobs`` layer by layer in a background thread: ``synchronizer.synchronize_layer(L,
        None)`` gates layer ``L``. Returns ``(thread, results)``: ``results[i]`` becomes job
        ``i``'s status (None while its last layer is not done). ``stop`` waits for the thread
        (bounded) and, once it is called, the thread starts no further transfer."""
        results: List[Optional[LLMStatusCode]] = [None] * len(jobs)
        layers = sorted({layer for _, makers in jobs for layer in makers})
        stopping = self._stopping
        transfer = self._transfer

        def run() -> None:
            failed = [False] * len(jobs)
            for layer in layers:
                covering = [i for i, (_, makers) in enumerate(jobs) if layer in makers and not failed[i]]
                if not covering:
                    continue
                if stopping.is_set():
                    for i in covering:
                        results[i] = LLMStatusCode.LLM_ENGINE_FINALIZED
                    return
                try:
                    ready = bool(synchronizer.synchronize_layer(layer, None))
                except Exception:  # a synchronizer that raises stops the job like one returning False
                    logger.exception("synchronize_layer(%d) raised", layer)
                    ready = False
                if not ready or stopping.is_set():
                    status = LLMStatusCode.LLM_PARAM_INVALID if not ready else LLMStatusCode.LLM_ENGINE_FINALIZED
                    for i in covering:
                        results[i] = status
                    return
                for i in covering:
                    remote, makers = jobs[i]
                    try:
                        transfer(remote, src, True, makers[layer])
                    except LLMException as exc:
                        results[i], failed[i] = exc.status_code, True
                        continue
                    if layer == max(makers):
                        results[i] = LLMStatusCode.LLM_SUCCESS

        thread = threading.Thread(target=run, daemon=True, name="llm_datadist-transfer")
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()
        return thread, results

    def stop(self, timeout_s: float = FINALIZE_JOIN_S) -> None:
        """Tell the threads to start nothing more and wait for them, at most ``timeout_s`` in all
        (the links are still up, so a transfer in flight ends normally)."""
        self._stopping.set()
        with self._lock:
            threads, self._threads = self._threads, []
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logger.warning("finalize: a transfer_cache_async thread is still waiting in its layer "
                               "synchronizer; it will not transfer anything more")
