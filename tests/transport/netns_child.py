"""A cluster process driven by JSON lines on stdin, for tests that run clusters inside network
or pid namespaces (``ip netns exec NS python netns_child.py CLUSTER_ID [LISTEN_IP]``), and an
"impostor" (``netns_child.py impostor ADDR,ADDR,... LENGTH``) for the pid-reuse test.

It initializes one ``LLMDataDist`` (listening on ``LISTEN_IP:0`` when given; more options, such
as a link secret, from the JSON object in ``NETNS_CHILD_OPTIONS``), prints
``{"ready": true, "port": ..., "pid": ...}``, then answers one JSON line per command line::

    {"cmd": "register", "name": "c", "model_id": 0, "num_blocks": 16, "block_bytes": 65536, "seed": 1}
    {"cmd": "link", "remote_id": 1, "ip": "10.213.0.1", "port": 4242, "timeout_ms": 2000}
    {"cmd": "transfer", "op": "push", "remote_id": 1, "name": "c", "src": [0, 1], "dst": [2, 3]}
    {"cmd": "loop", "op": "push", "remote_id": 1, "name": "c", "blocks": [...], "max_seconds": 30}
    {"cmd": "holds", "name": "c", "seed": 1, "blocks": [2, 3], "pattern_blocks": [0, 1]}
    {"cmd": "plane", "remote_id": 1}   {"cmd": "host"}   {"cmd": "addrs", "name": "c"}   {"cmd": "unlink", ...}
    {"cmd": "stats"}
    {"cmd": "quit"}

``loop`` repeats a transfer until it fails and prints ``{"progress": 1}`` after the first
success, before its result. Errors come back as ``{"error": "...", "status": code}``. Cache
contents follow the same seeded pattern as test_adversity.py (recomputed here so that this
script needs nothing but the package).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

from llm_datadist import (BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig, LLMDataDist, LLMException,
                          LLMRole, Placement)
from llm_datadist.transport.host import host_identity

TENSORS = 2


def _mix(values: np.ndarray) -> np.ndarray:
    values = (values + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    return values ^ (values >> np.uint64(29))


def _pattern_parts(seed: int, tensor: int, blocks, block_bytes: int):
    salt = np.uint64((seed << 24) + (tensor << 8))
    within = _mix(np.arange(block_bytes // 8, dtype=np.uint64) + salt)
    per_block = _mix(np.asarray(list(blocks), dtype=np.uint64) * np.uint64(0x100000001) + ~salt)
    return per_block, within


class Child:
    def __init__(self, cluster_id: int, listen_ip: str) -> None:
        self.cluster_id = cluster_id
        self.dd = LLMDataDist(LLMRole.PROMPT if listen_ip else LLMRole.DECODER, cluster_id)
        config = LLMConfig()
        config.device_id = 0
        config.enable_cache_manager = True
        config.enable_remote_cache_accessible = True
        if listen_ip:
            config.listen_ip_info = f"{listen_ip}:0"
        options = config.generate_options()
        options["llm.SyncKvCacheWaitTime"] = os.environ.get("NETNS_CHILD_SYNC_MS", "2000")
        options.update(json.loads(os.environ.get("NETNS_CHILD_OPTIONS", "{}")))
        self.dd.init(options)
        self.cm = self.dd.cache_manager
        self.arrays = {}
        self.caches = {}

    def ready(self) -> dict:
        info = self.dd.listen_ip_info
        return {"ready": True, "port": int(info.rpartition(":")[2]) if info else 0, "pid": os.getpid()}

    # -- commands ----------------------------------------------------------------------------
    def register(self, name: str, model_id: int, num_blocks: int, block_bytes: int, seed: int) -> dict:
        arrays = []
        for t in range(TENSORS):
            per_block, within = _pattern_parts(seed, t, range(num_blocks), block_bytes)
            arrays.append((per_block[:, None] ^ within[None, :]).view(np.uint8))
        desc = CacheDesc(TENSORS, [num_blocks, block_bytes], DataType.DT_UINT8, Placement.HOST)
        self.caches[name] = self.cm.register_blocks_cache(desc, [a.ctypes.data for a in arrays],
                                                          BlocksCacheKey(self.cluster_id, model_id))
        self.arrays[name] = arrays
        return {"ok": True}

    def holds(self, name: str, seed: int, blocks, pattern_blocks=None) -> dict:
        pattern_blocks = blocks if pattern_blocks is None else pattern_blocks
        for t, array in enumerate(self.arrays[name]):
            words = array.view(np.uint64)
            per_block, within = _pattern_parts(seed, t, pattern_blocks, array.shape[1])
            if not all(np.array_equal(words[b], per_block[i] ^ within) for i, b in enumerate(blocks)):
                return {"holds": False}
        return {"holds": True}

    @staticmethod
    def _info(remote_id: int, ip: str, port: int) -> LLMClusterInfo:
        info = LLMClusterInfo()
        info.remote_cluster_id = remote_id
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info(ip, port)
        return info

    def link(self, remote_id: int, ip: str, port: int, timeout_ms: int) -> dict:
        started = time.monotonic()
        status, rets = self.dd.link_clusters([self._info(remote_id, ip, port)], timeout_ms)
        return {"status": int(status), "rets": [int(r) for r in rets], "seconds": time.monotonic() - started}

    def unlink(self, remote_id: int, ip: str = "127.0.0.1", port: int = 0, force: bool = False) -> dict:
        status, _ = self.dd.unlink_clusters([self._info(remote_id, ip, port)], 2000, force=force)
        return {"status": int(status)}

    def _transfer_fn(self, op: str):
        return self.cm.push_blocks if op == "push" else self.cm.pull_blocks

    def transfer(self, op: str, remote_id: int, name: str, src, dst) -> dict:
        try:
            self._transfer_fn(op)(BlocksCacheKey(remote_id, 0), self.caches[name], list(src), list(dst))
        except LLMException as exc:
            return {"status": int(exc.status_code)}
        return {"status": 0}

    def loop(self, op: str, remote_id: int, name: str, blocks, max_seconds: float) -> dict:
        fn = self._transfer_fn(op)
        key = BlocksCacheKey(remote_id, 0)
        done = 0
        stop = time.monotonic() + max_seconds
        while time.monotonic() < stop:
            started = time.monotonic()
            try:
                fn(key, self.caches[name], list(blocks), list(blocks))
            except LLMException as exc:
                return {"status": int(exc.status_code), "started": started, "failed": time.monotonic(),
                        "done": done}
            done += 1
            if done == 1:
                emit({"progress": 1})
        return {"status": 0, "done": done}

    def addrs(self, name: str) -> dict:
        """The tensor addresses of cache ``name`` and the bytes of one tensor."""
        arrays = self.arrays[name]
        return {"addrs": [a.ctypes.data for a in arrays], "tensor_bytes": arrays[0].nbytes}

    def plane(self, remote_id: int) -> dict:
        return {"plane": self.dd.engine.links.data_plane(remote_id)}

    def host(self) -> dict:
        return {"host": host_identity()}

    def linked(self) -> dict:
        return {"linked": self.dd.engine.links.linked_clusters()}

    def stats(self) -> dict:
        return {"stats": self.dd.engine.link_stats()}


def emit(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def impostor(addrs, length: int) -> int:
    """An unrelated process: map ``length`` zeroed bytes at each of ``addrs`` (where a dead
    cluster had its tensors), print ``{"pid", "mapped"}``, then answer every command line on
    stdin (until "quit") with how many of those bytes are no longer zero."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    page = os.sysconf("SC_PAGE_SIZE")
    prot_rw, map_private_anonymous, map_fixed_noreplace = 0x3, 0x22, 0x100000
    regions = []
    for addr in addrs:
        start = addr - addr % page
        size = (addr + length - start + page - 1) // page * page
        if libc.mmap(start, size, prot_rw, map_private_anonymous | map_fixed_noreplace, -1, 0) != start:
            break
        regions.append(np.frombuffer((ctypes.c_uint8 * length).from_address(addr), dtype=np.uint8))
    emit({"pid": os.getpid(), "mapped": len(regions) == len(addrs)})
    for line in sys.stdin:
        if json.loads(line).get("cmd") == "quit":
            break
        emit({"changed": sum(int(np.count_nonzero(region)) for region in regions)})
    return 0


def main(argv) -> int:
    if argv[1] == "impostor":
        return impostor([int(a) for a in argv[2].split(",")], int(argv[3]))
    cluster_id = int(argv[1])
    listen_ip = argv[2] if len(argv) > 2 else ""
    child = Child(cluster_id, listen_ip)
    emit(child.ready())
    try:
        for line in sys.stdin:
            command = json.loads(line)
            name = command.pop("cmd")
            if name == "quit":
                break
            try:
                emit(getattr(child, name)(**command))
            except Exception as exc:  # report, keep serving
                emit({"error": f"{type(exc).__name__}: {exc}", "status": int(getattr(exc, "status_code", -1)),
                      "traceback": traceback.format_exc()})
    finally:
        child.dd.finalize()
    emit({"finalized": True})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
