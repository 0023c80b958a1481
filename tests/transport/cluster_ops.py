"""Functions that run inside cluster processes: ``cluster.call(fn, *args)`` runs ``fn(state, *args)``.

Caches are named by the test (``state.caches[name]``); ``state.arrays[name]`` holds numpy views of
their tensors, so a test can fill a cache with known bytes and read it back. The Python-style
functions use ``state.cm``, the C++-style ones ``state.cpp``.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

import llm_datadist as ld
from llm_datadist import _core, cpp
from llm_datadist.data_type import numpy_dtype

DT = ld.DataType.DT_INT32


def _views(addrs: Sequence[int], shape: Sequence[int], dtype=DT) -> List[np.ndarray]:
    nbytes = int(np.prod(shape)) * np.dtype(numpy_dtype(dtype)).itemsize
    return [_core.HostRegion(addr, nbytes).as_array(numpy_dtype(dtype), tuple(shape)) for addr in addrs]


# -- creating caches ------------------------------------------------------------------------------

def register(state, name: str, num_tensors: int, shape: Sequence[int], placement: str = "DEVICE",
             blocks: bool = False, keys: Sequence[Any] = (), model_id: Optional[int] = None) -> int:
    """Register fresh zeroed numpy memory as a (blocks) cache; returns its cache_id."""
    arrays = [np.zeros(tuple(shape), dtype=np.int32) for _ in range(num_tensors)]
    desc = ld.CacheDesc(num_tensors, list(shape), DT, getattr(ld.Placement, placement))
    addrs = [a.ctypes.data for a in arrays]
    if blocks:
        key = None if model_id is None else ld.BlocksCacheKey(state.cluster_id, model_id)
        cache = state.cm.register_blocks_cache(desc, addrs, key)
    else:
        cache = state.cm.register_cache(desc, addrs, list(keys))
    state.caches[name] = cache
    state.arrays[name] = arrays
    return cache.cache_id


def allocate(state, name: str, num_tensors: int, shape: Sequence[int], placement: str = "DEVICE",
             blocks: bool = False, keys: Sequence[Any] = (), model_id: Optional[int] = None) -> int:
    """``allocate_cache`` / ``allocate_blocks_cache`` from the cluster's pool; returns the cache_id."""
    desc = ld.CacheDesc(num_tensors, list(shape), DT, getattr(ld.Placement, placement))
    if blocks:
        key = None if model_id is None else ld.BlocksCacheKey(state.cluster_id, model_id)
        cache = state.cm.allocate_blocks_cache(desc, key)
    else:
        cache = state.cm.allocate_cache(desc, list(keys))
    state.caches[name] = cache
    state.arrays[name] = cache.as_numpy()
    return cache.cache_id


def key_is_bound(state, req_id: int) -> bool:
    """Whether ``CacheKey(this cluster, req_id)`` is bound here: binding it to a new allocated
    cache is refused (LLM_PARAM_INVALID) while it is. The probe cache is released again."""
    key = ld.CacheKey(state.cluster_id, req_id=req_id)
    try:
        cache = state.cm.allocate_cache(ld.CacheDesc(1, [1, 4], DT, ld.Placement.DEVICE), [key])
    except ld.LLMException as exc:
        if exc.status_code != ld.LLMStatusCode.LLM_PARAM_INVALID:
            raise
        return True
    state.cm.remove_cache_key(key)
    state.cm.deallocate_cache(cache)
    return False


def unregister(state, name: str) -> None:
    state.cm.unregister_cache(state.caches.pop(name).cache_id)


def cpp_register(state, name: str, num_tensors: int, shape: Sequence[int], placement: str = "kDevice") -> int:
    """``RegisterKvCache`` over fresh numpy memory; returns the cache_id."""
    arrays = [np.zeros(tuple(shape), dtype=np.int32) for _ in range(num_tensors)]
    desc = cpp.CacheDesc(placement=getattr(cpp.CachePlacement, placement), num_tensors=num_tensors,
                         data_type=cpp.DT_INT32, shape=list(shape))
    addrs = [a.ctypes.data for a in arrays]
    cache_id = cpp.Ref()
    status = state.cpp.RegisterKvCache(desc, addrs, cpp.RegisterCfg(), cache_id)
    assert status == cpp.LLM_SUCCESS, f"RegisterKvCache returned {status}"
    state.caches[name] = cpp.Cache(cache_id=cache_id.value, tensor_addrs=addrs, cache_desc=desc)
    state.arrays[name] = arrays
    return cache_id.value


def cpp_unregister(state, name: str) -> int:
    return int(state.cpp.UnregisterKvCache(state.caches.pop(name).cache_id))


def cpp_allocate(state, name: str, num_tensors: int, shape: Sequence[int], placement: str = "kDevice") -> int:
    """``AllocateCache``; returns the cache_id."""
    desc = cpp.CacheDesc(placement=getattr(cpp.CachePlacement, placement), num_tensors=num_tensors,
                         data_type=cpp.DT_INT32, shape=list(shape))
    cache = cpp.Cache()
    status = state.cpp.AllocateCache(desc, cache)
    assert status == cpp.LLM_SUCCESS, f"AllocateCache returned {status}"
    state.caches[name] = cache
    state.arrays[name] = _views(cache.tensor_addrs, shape)
    return cache.cache_id


# -- contents -------------------------------------------------------------------------------------

def fill(state, name: str, seed: int) -> List[np.ndarray]:
    """Write a seeded random pattern (every tensor different) into the cache; returns a copy."""
    rng = np.random.default_rng(seed)
    for view in state.arrays[name]:
        view[...] = rng.integers(-2**31, 2**31, size=view.shape, dtype=np.int64).astype(np.int32)
    return snapshot(state, name)


def fill_pattern(state, name: str, base: int) -> List[np.ndarray]:
    """Element ``i`` (flat) of tensor ``t`` becomes ``base + 10000 * t + i``; returns a copy."""
    for t, view in enumerate(state.arrays[name]):
        view[...] = (base + 10000 * t + np.arange(view.size, dtype=np.int64)).astype(np.int32).reshape(view.shape)
    return snapshot(state, name)


def fill_value(state, name: str, value: int) -> List[np.ndarray]:
    for view in state.arrays[name]:
        view[...] = value
    return snapshot(state, name)


def snapshot(state, name: str) -> List[np.ndarray]:
    return [view.copy() for view in state.arrays[name]]


def tensor_addrs(state, name: str) -> List[int]:
    return list(state.caches[name].tensor_addrs)


# -- Python-style transfers ---------------------------------------------------------------------------

def py(state, method: str, key: Any, cache: Any, *args, **kwargs) -> None:
    """``state.cm.<method>(key, <cache named cache>, *args, **kwargs)``; a non-str ``cache`` is
    passed as it is (to test wrong arguments)."""
    target = state.caches[cache] if isinstance(cache, str) else cache
    getattr(state.cm, method)(key, target, *args, **kwargs)


def role(state) -> str:
    if state.cpp is not None:
        return state.cpp._role.name
    return state.dd.role.name


def listen_ip_info(state) -> str:
    return state.cpp.listen_ip_info if state.cpp is not None else state.dd.listen_ip_info


# -- C++-style transfers ---------------------------------------------------------------------------

def cpp_op(state, method: str, index: Any, cache: Any, *args, ext: Any = None) -> int:
    """``state.cpp.<method>`` with the arguments in the order the method takes them: Pull*
    ``(index, cache, *args)``, Push* ``(cache, index, *args)``. ``index`` is a
    ``(cluster_id, cache_id, batch_index)`` tuple (or any object, passed as it is); ``ext`` a
    dict of ``KvCacheExtParam`` fields (or any object). Returns the status as an int."""
    idx = cpp.CacheIndex(cluster_id=index[0], cache_id=index[1], batch_index=index[2]) \
        if isinstance(index, tuple) else index
    target = state.caches[cache] if isinstance(cache, str) else cache
    ext_param = cpp.KvCacheExtParam(**ext) if isinstance(ext, dict) else ext
    fn = getattr(state.cpp, method)
    if method.startswith("Pull"):
        status = fn(idx, target, *args, ext_param=ext_param)
    else:
        status = fn(target, idx, *args, ext_param=ext_param)
    assert isinstance(status, cpp.Status), f"{method} returned {status!r}, not a cpp.Status"
    return int(status)


def cpp_link(state, targets: Sequence[tuple], timeout_ms: int = 3000):
    """``LinkLlmClusters`` to ``[(cluster_id, ip, port), ...]``; returns (status, rets)."""
    infos = [cpp.ClusterInfo(remote_cluster_id=cid, local_ip_infos=[cpp.IpInfo(ip="127.0.0.1")],
                             remote_ip_infos=[cpp.IpInfo(ip=ip, port=port)]) for cid, ip, port in targets]
    rets: list = []
    status = state.cpp.LinkLlmClusters(infos, rets, timeout_ms)
    return int(status), [int(r) for r in rets]


def cpp_unlink(state, targets: Sequence[tuple], timeout_ms: int = 3000, force: bool = False):
    infos = [cpp.ClusterInfo(remote_cluster_id=cid, local_ip_infos=[cpp.IpInfo(ip="127.0.0.1")],
                             remote_ip_infos=[cpp.IpInfo(ip=ip, port=port)]) for cid, ip, port in targets]
    rets: list = []
    status = state.cpp.UnlinkLlmClusters(infos, rets, timeout_ms, force)
    return int(status), [int(r) for r in rets]


def cpp_set_role(state, role_name: str, listen: Optional[str] = None) -> int:
    options = {} if listen is None else {cpp.OPTION_LISTEN_IP_INFO: listen}
    return int(state.cpp.SetRole(getattr(cpp.LlmRole, role_name), options))


# -- links in the Python style ----------------------------------------------------------------------

def cluster_info(cluster_id: int, ip: str = "127.0.0.1", port: int = 0) -> ld.LLMClusterInfo:
    info = ld.LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info(ip, port)
    return info


def py_link(state, targets: Sequence[tuple], timeout_ms: int = 3000):
    """``link_clusters`` to ``[(cluster_id, ip, port), ...]``; returns (status, rets) as ints."""
    status, rets = state.dd.link_clusters([cluster_info(*t) for t in targets], timeout_ms)
    return int(status), [int(r) for r in rets]


def link_address(state, ip: str, port: int, timeout_ms: int = 3000):
    """The engine seam's ``link_address``: (status as an int, the cluster id it found)."""
    status, found = state.dd.engine.link_address(ip, port, timeout_ms)
    return int(status), found


def py_unlink(state, targets: Sequence[tuple], timeout_ms: int = 3000, force: bool = False):
    status, rets = state.dd.unlink_clusters([cluster_info(*t) for t in targets], timeout_ms, force)
    return int(status), [int(r) for r in rets]


def py_switch_role(state, role_name: str, listen: Optional[str] = None) -> None:
    options = None if listen is None else {"llm.listenIpInfo": listen}
    state.dd.switch_role(getattr(ld.LLMRole, role_name), options)


def timed(state, fn, *args, **kwargs):
    """``(fn(state, ...), seconds it took)``."""
    start = time.monotonic()
    result = fn(state, *args, **kwargs)
    return result, time.monotonic() - start


# -- transfer_cache_async -------------------------------------------------------------------------

class RecordingSynchronizer(ld.LayerSynchronizer):
    """Records the layers asked for. Before saying layer ``L`` is ready it writes layer ``L`` of
    the source (as a model would produce it just in time) and overwrites layer ``L - 1`` with
    ``clobber`` (already sent, so the destination must keep the earlier bytes). Returns
    ``answers.get(L, True)``; waits for ``gate`` first if one is given."""

    def __init__(self, views: List[np.ndarray], produce: Dict[int, List[np.ndarray]], clobber: int,
                 answers: Dict[int, bool], gate: Optional[threading.Event]) -> None:
        self.views = views
        self.produce = produce
        self.clobber = clobber
        self.answers = answers
        self.gate = gate
        self.calls: List[tuple] = []

    def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        self.calls.append((layer_index, timeout_in_millis))
        if self.gate is not None:
            self.gate.wait(30)
        previous = self.produce.get(layer_index - 1)
        if previous is not None:
            for t in (2 * (layer_index - 1), 2 * (layer_index - 1) + 1):
                self.views[t][...] = self.clobber
        for t, data in zip((2 * layer_index, 2 * layer_index + 1), self.produce.get(layer_index, [])):
            self.views[t][...] = data
        return self.answers.get(layer_index, True)


def start_async(state, src: str, configs: list, produce: Dict[int, List[np.ndarray]],
                answers: Optional[Dict[int, bool]] = None, gated: bool = False, clobber: int = -7,
                **kwargs) -> None:
    """Start ``transfer_cache_async`` from cache ``src``; the task goes to ``state.scratch``."""
    gate = threading.Event() if gated else None
    sync = RecordingSynchronizer(state.arrays[src], produce, clobber, answers or {}, gate)
    task = state.cm.transfer_cache_async(state.caches[src], sync, configs, **kwargs)
    state.scratch["task"], state.scratch["sync"], state.scratch["gate"] = task, sync, gate


def open_gate(state) -> None:
    state.scratch["gate"].set()


def task_synchronize(state, timeout_ms: Optional[int] = None) -> int:
    return int(state.scratch["task"].synchronize(timeout_ms))


def task_results(state, timeout_ms: Optional[int] = None) -> list:
    return [None if r is None else int(r) for r in state.scratch["task"].get_results(timeout_ms)]


def sync_calls(state) -> List[tuple]:
    return list(state.scratch["sync"].calls)


def transfer_async(state, src: str, configs: list, **kwargs) -> None:
    """``transfer_cache_async`` with an always-ready synchronizer (for argument errors)."""
    sync = RecordingSynchronizer(state.arrays[src], {}, 0, {}, None)
    state.cm.transfer_cache_async(state.caches[src], sync, configs, **kwargs)


def reregister_as(state, name: str, model_id: int) -> int:
    """Unregister blocks cache ``name`` and register the same memory again under ``model_id``."""
    cache = state.caches[name]
    state.cm.unregister_cache(cache.cache_id)
    arrays = state.arrays[name]
    new = state.cm.register_blocks_cache(cache.cache_desc, [a.ctypes.data for a in arrays],
                                         ld.BlocksCacheKey(state.cluster_id, model_id))
    state.caches[name] = new
    return new.cache_id


# -- notifications over a link (what the vLLM connector's block releases use) -------------------

def answer_notifications(state, fail_on: Optional[str] = None) -> None:
    """Answer every notification with ``{"echo": message, "from": peer}``, recording it; a message
    whose "what" equals ``fail_on`` makes the handler raise."""
    state.notes = []

    def handler(peer_id: int, message: Dict[str, Any]) -> Dict[str, Any]:
        if message.get("what") == fail_on:
            raise RuntimeError("the handler was told to fail")
        state.notes.append((peer_id, message))
        return {"echo": message, "from": peer_id}

    state.dd.engine.links.set_notify_handler(handler)


def notify(state, remote_id: int, message: Dict[str, Any], timeout_ms: int = 3000):
    """The peer's reply, or ``("error", status name)``."""
    try:
        return state.dd.engine.links.notify(remote_id, message, timeout_ms)
    except ld.LLMException as exc:
        return ["error", exc.status_code.name]


def notes(state) -> list:
    return [[peer, message] for peer, message in getattr(state, "notes", [])]


def lost_links(state) -> Dict[int, str]:
    """The clusters whose link ended without an unlink, and why."""
    return (state.dd or state.cpp).lost_links()


# -- resources of a cluster process (leak checks) ----------------------------------------------------

def resources(state) -> Dict[str, int]:
    """Open descriptors and live llm_datadist threads of this process."""
    return {"fds": len(os.listdir("/proc/self/fd")),
            "threads": sum(t.name.startswith("llm_datadist") for t in threading.enumerate())}


def settle_to(state, baseline: Dict[str, int], timeout: float = 10.0) -> Dict[str, int]:
    """``resources`` once they are back at ``baseline`` (or after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    now = resources(state)
    while now != baseline and time.monotonic() < deadline:
        time.sleep(0.05)
        now = resources(state)
    return now


def wait_for(condition, timeout: float = 10.0) -> bool:
    """Poll ``condition`` (in the test process) until it holds (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
