#!/usr/bin/env python
"""The workload of the nixl benchmarks (``test_bench_nixl.py``, ``report_nixl.py``): the ``nixl``
plane against raw NIXL calls on the same descriptor lists, and the ``tcp`` plane against NIXL's
UCX TCP and a memcpy, on loopback and between two network namespaces.

Processes, each this file run as a program (``python bench/nixl_rig.py CLUSTER_ID [LISTEN_IP]``,
driven by JSON lines on stdin), all with the same link secret, ``LLM_DATADIST_NIXL_TCP=1`` and UCX
held to one device (``UCX_TLS=tcp``, ``UCX_NET_DEVICES=lo`` or the namespace's veth) before any
agent exists:

* the server, cluster 1, listening: owns the remote blocks cache (``BlocksCacheKey(1, model)``);
* the nixl client, cluster 2, ``llm.DataPlane=nixl``; the tcp client, cluster 3,
  ``llm.DataPlane=tcp``; each linked to the server.

``where="netns"`` starts the server in one fresh network namespace and the clients in another,
joined by a veth pair (root; the namespaces go with the rig); ``"loopback"`` runs them all on
127.0.0.1.

Caches: one tensor, ``[2 * moved, block_bytes]`` uint8 HOST memory (numpy, every page written
before timing), each block one byte value; a transfer moves ``moved`` blocks from random even ids
to random odd ids (no descriptor continues another). Kinds, all timed inside the client that
runs them, around the call alone (``time.perf_counter_ns``):

* ``nixl push`` / ``nixl pull``: ``cm.push_blocks`` / ``cm.pull_blocks`` over the nixl plane;
* ``raw write`` / ``raw read``: the same transfer as raw NIXL calls on the nixl client's own agent
  and connection: the plan's descriptors (``plan_blocks`` between the same two cache layouts)
  as two N x 3 lists, ``createXferReq`` + ``postXferReq``, ``getXferStatus`` polled as the plane
  polls (``nixl.poll_pause``), ``releaseXferReq``: what the plane's checked path does, without
  its checks (fences, the peer's registry generation read, the API's planning);
* ``raw prepped write`` / ``raw prepped read``: the same blocks from two prepared lists made once
  of the whole caches (NIXL's compact strided rows, ``prepXferDlist``), ``makeXferReq`` with the
  block ids as int32 indices, posted and polled the same way: what the plane's block route does
  (a push, after the first, runs on it), without the generation read and the route's checks;
* ``tcp push`` / ``tcp pull`` over the tcp plane;
* ``memcpy``: ``memcpy_baseline`` over the push's plan into a second local buffer (one thread).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
if str(REPO_ROOT) not in sys.path:  # the checkout's package (the Cython core is built in place)
    sys.path.insert(0, str(REPO_ROOT))

from llm_datadist.cli.workload import Case  # noqa: E402  (the transport benchmarks' cases, one definition)
SERVER_ID, NIXL_ID, TCP_ID = 1, 2, 3
SECRET = "bench-nixl-secret-0123456789"
SEED = 0x3D17
TRANSFER_TIMEOUT_MS = 60000
CALL_TIMEOUT_S = 600.0
SETTLE_RUNS = 3
MEMCPY, PUSH, PULL, RAW_WRITE, RAW_READ = "memcpy", "push", "pull", "raw_write", "raw_read"
RAW_PREP_WRITE, RAW_PREP_READ = "raw_prepped_write", "raw_prepped_read"
#: ``(process, op)`` of every kind, in the order a group lists them.
KINDS = [("nixl", MEMCPY), ("tcp", PUSH), ("tcp", PULL), ("nixl", RAW_WRITE), ("nixl", RAW_PREP_WRITE),
         ("nixl", PUSH), ("nixl", RAW_READ), ("nixl", RAW_PREP_READ), ("nixl", PULL)]
LABELS = {("nixl", MEMCPY): "memcpy", ("tcp", PUSH): "tcp push", ("tcp", PULL): "tcp pull",
          ("nixl", RAW_WRITE): "raw NIXL write", ("nixl", RAW_PREP_WRITE): "raw prepped write",
          ("nixl", PUSH): "nixl push", ("nixl", RAW_READ): "raw NIXL read",
          ("nixl", RAW_PREP_READ): "raw prepped read", ("nixl", PULL): "nixl pull"}


#: 64 MiB a bulk transfer; one 4 KiB block (completion included) for latency.
CASES = [Case("2MiB", 2 << 20, moved=32, rounds=15, batch=5),
         Case("16KiB", 16 << 10, moved=4096, rounds=15, batch=5),
         Case("4KiB", 4 << 10, moved=1, rounds=1000, batch=250)]


def block_ids(case: Case) -> Dict[str, list]:
    rng = np.random.default_rng(SEED + case.block_bytes)
    even = np.arange(0, case.cache_blocks, 2)
    return {op: [[int(b) for b in rng.permutation(even)], [int(b) for b in rng.permutation(even + 1)]]
            for op in (PUSH, PULL)}


# -- the child program ------------------------------------------------------------------------------
class Child:
    def __init__(self, cluster_id: int, listen_ip: str) -> None:
        from llm_datadist import LLMConfig, LLMDataDist, LLMRole
        self.cluster_id = cluster_id
        self.dd = LLMDataDist(LLMRole.PROMPT if listen_ip else LLMRole.DECODER, cluster_id)
        config = LLMConfig()
        config.device_id = 0
        config.enable_cache_manager = True
        config.enable_remote_cache_accessible = True
        if listen_ip:
            config.listen_ip_info = f"{listen_ip}:0"
        options = config.generate_options()
        options.update({"llm.SyncKvCacheWaitTime": str(TRANSFER_TIMEOUT_MS), "llm.LinkSecret": SECRET})
        options.update(json.loads(os.environ.get("NIXL_RIG_OPTIONS", "{}")))
        self.dd.init(options)
        self.cm = self.dd.cache_manager
        self.arrays: Dict[str, np.ndarray] = {}
        self.cache = None
        self.ops: Dict[str, tuple] = {}

    def ready(self) -> dict:
        info = self.dd.listen_ip_info
        return {"ready": True, "port": int(info.rpartition(":")[2]) if info else 0, "pid": os.getpid()}

    def link(self, remote_id: int, ip: str, port: int) -> dict:
        return {"status": int(self.dd.engine.links.link(remote_id, ip, port, 30000))}

    def plane(self, remote_id: int) -> dict:
        return {"plane": self.dd.engine.links.data_plane(remote_id)}

    def cache_of(self, block_bytes: int, blocks: int, model_id: Optional[int]) -> dict:
        from llm_datadist import BlocksCacheKey, CacheDesc, DataType, Placement
        arr = np.empty((blocks, block_bytes), np.uint8)
        arr[:] = ((self.cluster_id * 97 + np.arange(blocks)) % 251 + 1).astype(np.uint8)[:, None]
        self.arrays["cache"] = arr
        desc = CacheDesc(1, [blocks, block_bytes], DataType.DT_UINT8, Placement.HOST)
        key = None if model_id is None else BlocksCacheKey(self.cluster_id, model_id)
        self.cache = self.cm.register_blocks_cache(desc, [arr.ctypes.data], key)
        return {"ok": True}

    def prepare(self, model_id: int, ids: Dict[str, list], raw: bool) -> dict:
        """Build every timed call's arguments once; ``raw``: also the raw NIXL calls and memcpy."""
        from llm_datadist import BlocksCacheKey
        from llm_datadist.cli import lowlevel
        key = BlocksCacheKey(SERVER_ID, model_id)
        self.ops = {PUSH: (self.cm.push_blocks, (key, self.cache, *ids[PUSH])),
                    PULL: (self.cm.pull_blocks, (key, self.cache, *ids[PULL]))}
        self.cm.push_blocks(key, self.cache, *ids[PUSH])  # the table now lists the model's cache
        if not raw:
            return {"ok": True}
        arr = self.arrays["cache"]
        layout = lowlevel.CacheLayout([arr.ctypes.data], arr.shape[0], arr.shape[1])
        twin = self.arrays["twin"] = np.ones_like(arr)
        twin_layout = lowlevel.CacheLayout([twin.ctypes.data], arr.shape[0], arr.shape[1])
        self.ops[MEMCPY] = (lowlevel.memcpy_baseline, (lowlevel.plan_blocks(layout, twin_layout, None, None,
                                                                            *ids[PUSH]),))
        links = self.dd.engine.links
        peer = links.peer(SERVER_ID)
        remote = peer.table.blocks_cache(model_id).layout
        # The plane's own agent and its connection to the server's (a bench may look inside).
        plane = links.planes["nixl"]
        agent, name = plane._agent, peer.plane_state["nixl"].remote
        write = lowlevel.plan_blocks(layout, remote, None, None, *ids[PUSH]).descriptors()
        read = lowlevel.plan_blocks(remote, layout, None, None, *ids[PULL]).descriptors()
        self.ops[RAW_WRITE] = (_raw, (agent, True, _rows(write[:, 0], write[:, 2]), _rows(write[:, 1], write[:, 2]),
                                      name))
        self.ops[RAW_READ] = (_raw, (agent, False, _rows(read[:, 1], read[:, 2]), _rows(read[:, 0], read[:, 2]),
                                     name))
        block = arr.shape[1]
        local_list = agent.prepare_strided("", 0, np.array([[arr.ctypes.data, block, 0, block, arr.shape[0]]],
                                                           dtype=np.uint64))
        remote_list = agent.prepare_strided(name, 0, np.array([[remote.tensor_addrs[0], block, 0, remote.row_bytes,
                                                                remote.num_rows]], dtype=np.uint64))
        self.lists = [local_list, remote_list]
        self.agent = agent
        for op, kind, write in ((PUSH, RAW_PREP_WRITE, True), (PULL, RAW_PREP_READ, False)):
            src, dst = (np.asarray(i, dtype=np.int32) for i in ids[op])
            local, remote_ids = (src, dst) if write else (dst, src)
            self.ops[kind] = (_raw_prepped, (agent, write, local_list, local, remote_list, remote_ids))
        return {"ok": True}

    def settle(self) -> dict:
        for fn, args in self.ops.values():
            for _ in range(SETTLE_RUNS):
                fn(*args)
        return {"ok": True}

    def time(self, op: str, reps: int) -> dict:
        fn, args = self.ops[op]
        clock = time.perf_counter_ns
        durations = []
        for _ in range(reps):
            start = clock()
            fn(*args)
            durations.append(clock() - start)
        return {"ns": durations}

    def sample(self, ids: list) -> dict:
        arr = self.arrays["cache"]
        return {"bytes": np.concatenate([arr[ids, ::4096], arr[ids, -1:]], axis=1).tolist()}

    def stats(self) -> dict:
        return {"stats": self.dd.engine.link_stats()}

    def drop(self) -> dict:
        for handle in getattr(self, "lists", []):
            self.agent.release_list(handle)
        self.lists = []
        if self.cache is not None:
            self.cm.unregister_cache(self.cache.cache_id)
        self.cache, self.ops = None, {}
        self.arrays.clear()
        return {"ok": True}


def _rows(addrs: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    rows = np.zeros((len(addrs), 3), dtype=np.uint64)
    rows[:, 0], rows[:, 1] = addrs, nbytes
    return rows


def _raw(agent, write: bool, local: np.ndarray, remote: np.ndarray, name: str) -> None:
    """One raw NIXL transfer of the descriptor lists, polled as the plane polls (``poll_pause``:
    spinning throughout makes bulk transfers slower here, the poller fighting NIXL's progress
    thread for two cores)."""
    b = agent.b
    handle = agent.agent.createXferReq(b.NIXL_WRITE if write else b.NIXL_READ, b.nixlXferDList(b.DRAM_SEG, local),
                                       b.nixlXferDList(b.DRAM_SEG, remote), name, "", agent.backends)
    _post_and_wait(agent, handle, "raw NIXL transfer")


def _post_and_wait(agent, handle, what: str) -> None:
    """Post a made request, poll it as the plane polls (``nixl.poll_pause``), release it."""
    from llm_datadist.transport.planes.nixl import poll_pause
    b = agent.b
    started = time.monotonic()
    status = agent.agent.postXferReq(handle, "")
    while status == b.NIXL_IN_PROG:
        pause = poll_pause(time.monotonic() - started)
        if pause:
            time.sleep(pause)
        status = agent.agent.getXferStatus(handle)
    agent.agent.releaseXferReq(handle)
    if status != b.NIXL_SUCCESS:
        raise RuntimeError(f"{what}: {status}")


def _raw_prepped(agent, write: bool, local_list: int, local: np.ndarray, remote_list: int,
                 remote: np.ndarray) -> None:
    """One raw NIXL transfer from two prepared lists by index, polled as ``_raw`` polls."""
    b = agent.b
    handle = agent.agent.makeXferReq(b.NIXL_WRITE if write else b.NIXL_READ, local_list, local, remote_list, remote,
                                     "", agent.backends, False)
    _post_and_wait(agent, handle, "raw prepped NIXL transfer")


def child_main(argv: List[str]) -> int:
    sys.path.insert(0, str(REPO_ROOT))
    child = Child(int(argv[1]), argv[2] if len(argv) > 2 else "")
    print(json.dumps(child.ready()), flush=True)
    try:
        for line in sys.stdin:
            command = json.loads(line)
            name = command.pop("cmd")
            if name == "quit":
                break
            try:
                reply = getattr(child, name)(**command)
            except Exception as exc:  # report, keep serving
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(reply), flush=True)
    finally:
        child.dd.finalize()
    return 0


# -- the parent's side --------------------------------------------------------------------------------
class Peer:
    """A child process and its JSON lines."""

    def __init__(self, enter: List[str], args: List[str], env: Dict[str, str], log: Path) -> None:
        self.log_path = log
        self.log = open(log, "w")
        full_env = dict(os.environ, **env)
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), full_env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen([*enter, sys.executable, str(Path(__file__)), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=full_env)
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self._receive(120)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _receive(self, timeout: float) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no answer within {timeout} s: {self.log_path.read_text()[-2000:]}") from None
        if line is None:
            raise RuntimeError(f"the child exited ({self.proc.poll()}): {self.log_path.read_text()[-2000:]}")
        return json.loads(line)

    def call(self, cmd: str, timeout: float = CALL_TIMEOUT_S, **args) -> dict:
        self.proc.stdin.write(json.dumps(dict(cmd=cmd, **args)) + "\n")
        self.proc.stdin.flush()
        reply = self._receive(timeout)
        if "error" in reply:
            raise RuntimeError(f"{cmd}: {reply['error']}\n{self.log_path.read_text()[-2000:]}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(20)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class NixlRig:
    """The server and the two clients, linked (``where``: "loopback" or "netns"); one case set up
    at a time (``use``)."""

    def __init__(self, where: str, log_dir: Path) -> None:
        if where not in ("loopback", "netns"):
            raise ValueError(where)
        self.where, self.case = where, None
        self.namespaces: List[str] = []
        self.peers: Dict[str, Peer] = {}
        self._model_id = 100
        try:
            self._start(log_dir)
        except BaseException:
            self.close()
            raise

    def _start(self, log_dir: Path) -> None:
        base = {"LLM_DATADIST_NIXL_TCP": "1", "UCX_TLS": "tcp", "UCX_MODULES": "^efa", "LLM_DATADIST_DEVICE": "cpu"}
        if self.where == "loopback":
            server_ip = "127.0.0.1"
            enter = {"server": [], "client": []}
            devices = {"server": "lo", "client": "lo"}
        else:
            tag = f"{os.getpid() % 100000}"
            server_ns, client_ns, server_dev, client_dev = f"lldbn{tag}s", f"lldbn{tag}c", f"lbn{tag}s", f"lbn{tag}c"
            server_ip, client_ip = "10.215.0.1", "10.215.0.2"
            for ns in (server_ns, client_ns):
                _ip("netns", "add", ns)
                self.namespaces.append(ns)
            _ip("-n", server_ns, "link", "add", server_dev, "type", "veth", "peer", "name", client_dev, "netns",
                client_ns)
            _ip("-n", server_ns, "addr", "add", f"{server_ip}/30", "dev", server_dev)
            _ip("-n", client_ns, "addr", "add", f"{client_ip}/30", "dev", client_dev)
            for ns, dev in ((server_ns, server_dev), (client_ns, client_dev)):
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            enter = {"server": ["ip", "netns", "exec", server_ns], "client": ["ip", "netns", "exec", client_ns]}
            devices = {"server": server_dev, "client": client_dev}
        self.peers["server"] = Peer(enter["server"], [str(SERVER_ID), server_ip],
                                    dict(base, UCX_NET_DEVICES=devices["server"]), log_dir / "server.log")
        for plane, cluster_id in (("nixl", NIXL_ID), ("tcp", TCP_ID)):
            options = json.dumps({"llm.DataPlane": plane})
            self.peers[plane] = peer = Peer(enter["client"], [str(cluster_id)],
                                            dict(base, UCX_NET_DEVICES=devices["client"], NIXL_RIG_OPTIONS=options),
                                            log_dir / f"{plane}.log")
            status = peer.call("link", remote_id=SERVER_ID, ip=server_ip, port=self.peers["server"].ready["port"])
            if status["status"] != 0 or peer.call("plane", remote_id=SERVER_ID)["plane"] != plane:
                raise RuntimeError(f"the {plane} client did not link over {plane}: {status}\n"
                                   f"{peer.log_path.read_text()[-2000:]}")

    def use(self, case: Case) -> None:
        if self.case == case:
            return
        self.clear()
        self._model_id += 1
        model_id, ids = self._model_id, block_ids(case)
        self.peers["server"].call("cache_of", block_bytes=case.block_bytes, blocks=case.cache_blocks,
                                  model_id=model_id)
        for plane in ("nixl", "tcp"):
            peer = self.peers[plane]
            peer.call("cache_of", block_bytes=case.block_bytes, blocks=case.cache_blocks, model_id=None)
            peer.call("prepare", model_id=model_id, ids=ids, raw=plane == "nixl")
        self._check(ids)
        for plane in ("nixl", "tcp"):
            self.peers[plane].call("settle")
        self.case = case

    def _check(self, ids: Dict[str, list]) -> None:
        """Each kind moves the right bytes (the server's blocks are refilled from the client's)."""
        server = self.peers["server"]
        for plane in ("nixl", "tcp"):
            client = self.peers[plane]
            for op, source, dest in ((PUSH, client, server), (PULL, server, client)):
                raw = (RAW_WRITE, RAW_PREP_WRITE) if op == PUSH else (RAW_READ, RAW_PREP_READ)
                for kind in ((op,) if plane == "tcp" else (op, *raw)):
                    client.call("time", op=kind, reps=1)
                    src, dst = ids[op]
                    if source.call("sample", ids=src)["bytes"] != dest.call("sample", ids=dst)["bytes"]:
                        raise AssertionError(f"{plane} {kind} did not deliver the source blocks")

    def measure(self, process: str, op: str, reps: int) -> List[int]:
        durations: List[int] = []
        while len(durations) < reps:
            batch = min(self.case.batch, reps - len(durations))
            durations += self.peers[process].call("time", op=op, reps=batch)["ns"]
        return durations

    def clear(self) -> None:
        if self.case is not None:
            for peer in self.peers.values():
                peer.call("drop")
            self.case = None

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        self.peers = {}
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=15)
        self.namespaces = []

    def __enter__(self) -> "NixlRig":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def unavailable(where: str) -> Optional[str]:
    """Why the rig cannot run ``where`` here, or None."""
    import importlib.util
    if importlib.util.find_spec("nixl") is None:
        return "NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1)"
    if where == "netns" and (os.geteuid() != 0 or shutil.which("ip") is None):
        return "network namespaces need root and iproute2"
    return None


if __name__ == "__main__":
    sys.exit(child_main(sys.argv))
