#!/usr/bin/env python
"""One 4 KiB same-host push_blocks, three ways, between two cluster processes.

    python bench/latency_layers.py             # medians of 10 x 2000 calls per kind, interleaved

* ``plain``: ``push_blocks(key, cache, [0], [1])``;
* ``layer args``: the same with ``src_layer_range``, ``dst_layer_range`` and
  ``tensor_num_per_layer`` given, the range objects built once (as ``report_transport.py``'s
  ``push_layers`` does);
* ``layer args, new ranges``: the range objects built inline in every call, as code that writes
  ``range(0, 1)`` in the call does (their construction is inside the timing).

Completion is included (the cma plane copies synchronously). The script only imports what every
version of the package has, so ``PYTHONPATH=<another checkout> python bench/latency_layers.py``
measures another commit the same way.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if "PYTHONPATH" not in os.environ:  # the checkout's package (the Cython core is built in place)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SERVER, CLIENT, MODEL = 1, 2, 9
KINDS = ("plain", "layer args", "layer args, new ranges")
ROUNDS, BATCH, WARMUP = 10, 2000, 200


def setup(state, owner: bool) -> None:
    """A one-tensor blocks cache of two 4 KiB blocks (the server's under MODEL)."""
    import llm_datadist as ld
    arr = np.full((2, 4096), 7 if owner else 3, np.uint8)
    state.arrays["cache"] = arr
    desc = ld.CacheDesc(1, [2, 4096], ld.DataType.DT_UINT8, ld.Placement.HOST)
    key = ld.BlocksCacheKey(state.cluster_id, MODEL) if owner else None
    state.caches["cache"] = state.cm.register_blocks_cache(desc, [arr.ctypes.data], key)


def timed(state, kind: str, repetitions: int) -> list:
    """Nanoseconds of each of ``repetitions`` pushes of block 0 to the server's block 1."""
    import llm_datadist as ld
    key, cache, push = ld.BlocksCacheKey(SERVER, MODEL), state.caches["cache"], state.cm.push_blocks
    clock = time.perf_counter_ns
    out = []
    if kind == "layer args, new ranges":
        for _ in range(WARMUP + repetitions):
            start = clock()
            push(key, cache, [0], [1], src_layer_range=range(0, 1), dst_layer_range=range(0, 1),
                 tensor_num_per_layer=1)
            out.append(clock() - start)
        return out[WARMUP:]
    kwargs = {} if kind == "plain" else dict(src_layer_range=range(0, 1), dst_layer_range=range(0, 1),
                                             tensor_num_per_layer=1)
    for _ in range(WARMUP + repetitions):
        start = clock()
        push(key, cache, [0], [1], **kwargs)
        out.append(clock() - start)
    return out[WARMUP:]


def main() -> int:
    os.environ.setdefault("LLM_DATADIST_DEVICE", "cpu")
    from llm_datadist.testing import Cluster, link
    options = {"remote_cache_accessible": "1", "llm.DataPlane": "cma"}
    with Cluster(SERVER, "PROMPT", listen=True, options=options) as server, \
            Cluster(CLIENT, "DECODER", options=options) as client:
        server.call(setup, True)
        client.call(setup, False)
        status, _ = link(client, server)
        if status != 0:
            print(f"link failed: status {status}")
            return 1
        durations = {kind: [] for kind in KINDS}
        for _ in range(ROUNDS):
            for kind in KINDS:
                durations[kind] += client.call(timed, kind, BATCH)
    for kind in KINDS:
        print(f"{kind:24} median {statistics.median(durations[kind]) / 1e3:6.2f} us "
              f"(n={len(durations[kind])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
