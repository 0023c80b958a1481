#!/usr/bin/env python
"""What one hostile source can hold of a cluster's process budgets (issue 32, defect 2), and
whether another peer still gets through, at the default budgets.

    python bench/report_budgets.py                   # both attacks
    python bench/report_budgets.py --only parsing    # or: staging

``parsing``: 64 links x 4 connections from 127.0.0.2 each announce a 64 KiB table request or
notification and send one byte of it; then a cluster from 127.0.0.1 links and notifies.
``staging``: 32 links from 127.0.0.2 each start a staged push of 6 MiB into the owner's DEVICE
memory (the stub runtime posing as cuda, built with gcc) and stall after 1 KiB; then another
peer pushes 64 bytes. Printed: the bytes the attack holds, the other peer's outcome and time,
and the budget once the stall window (``LLM_DATADIST_STALL_MS``) has passed. Run it with
``PYTHONPATH`` at another checkout to measure that one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
for path in (str(REPO_ROOT), str(REPO_ROOT / "tests" / "transport")):  # the checkout's package, rawpeer
    if path not in sys.path:
        sys.path.insert(0, path)

HOSTILE = "127.0.0.2"
EMPTY_TABLE = json.dumps({"generation": 1, "caches": [], "blocks": [], "keys": []}).encode()
COUNTERS = ("parsing_bytes", "staging_bytes", "refused_parsing", "stalled_parsing", "stalled_staging")


def _stats(state):
    counted = state.dd.engine.link_stats()
    return {name: counted[name] for name in COUNTERS if name in counted}


def _set_handler(state) -> None:
    state.dd.engine.links.set_notify_handler(lambda peer, message: {"ok": 1})


def _link(state, remote_id: int, ip: str, port: int) -> int:
    return int(state.dd.engine.links.link(remote_id, ip, port, 10000))


def _notify(state, remote_id: int) -> int:
    try:
        state.dd.engine.links.notify(remote_id, {"hello": 1}, 5000)
    except Exception as exc:  # noqa: BLE001 - the status is the result
        return int(getattr(exc, "status_code", -1))
    return 0


def _allocate_device(state) -> int:
    import llm_datadist as ld
    cache = state.cm.allocate_cache(ld.CacheDesc(1, [8 << 20], ld.DataType.DT_UINT8, ld.Placement.DEVICE))
    state.caches["device"] = cache
    return cache.tensor_addrs[0]


def _after_window(server) -> None:
    time.sleep(3.0)
    print(f"  3 s later:       {server.call(_stats)}")


def parsing_attack() -> None:
    import rawpeer
    from llm_datadist.testing import Cluster
    from llm_datadist.transport import wire

    print("parsing: 64 links x 4 connections from 127.0.0.2, a 64 KiB body announced on each, 1 byte sent")
    with ExitStack() as stack:
        server = stack.enter_context(Cluster(1, "PROMPT", listen=True, plane="tcp", timeout=60))
        server.call(_set_handler)
        answerer = rawpeer.ReverseAnswerer(EMPTY_TABLE)
        stack.callback(answerer.close)
        links = []
        for i in range(64):
            links.append(answerer.add(rawpeer.RawLink(server.address, 300 + i, source=HOSTILE, forward=4)))
            stack.callback(links[-1].close)
        client = stack.enter_context(Cluster(2, "DECODER", plane="tcp", timeout=60))
        sent = 0
        for i, sock in enumerate(s for link in links for s in link.forwards):
            data = rawpeer.frame(wire.OP_TABLE_GET if i % 2 else wire.OP_NOTIFY, b"{", length=64 << 10, req_id=7)
            sock.sendall(data)
            sent += len(data)
        time.sleep(0.5)
        print(f"  attacker sent {sent} bytes; held: {server.call(_stats)}")
        started = time.monotonic()
        status = client.call(_link, 1, *server.address)
        linked = time.monotonic()
        notified = client.call(_notify, 1) if status == 0 else None
        print(f"  other cluster:   link status {status} in {linked - started:.2f} s, notify status {notified} "
              f"in {time.monotonic() - linked:.2f} s")
        _after_window(server)


def _stub_library(workdir: str) -> str:
    gcc = shutil.which("gcc")
    if gcc is None:
        raise SystemExit("staging: gcc is needed to build the stub runtime")
    out = os.path.join(workdir, "libstub_runtime.so")
    subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-o", out, str(REPO_ROOT / "tests/core/stub_runtime.c")],
                   check=True)
    return out


def staging_attack() -> None:
    import rawpeer
    from llm_datadist.testing import Cluster
    from llm_datadist.transport import wire

    def push_head(generation: int, addr: int, nbytes: int, req_id: int) -> bytes:
        descs = wire.U64.pack(0) + wire.U64.pack(addr) + wire.U64.pack(nbytes)
        return rawpeer.frame(wire.OP_PUSH, wire.U64x2.pack(generation, len(descs)) + descs,
                             length=16 + len(descs) + nbytes, req_id=req_id)

    print("staging: 32 links from 127.0.0.2, a 6 MiB staged push on each, stalled after 1 KiB")
    with tempfile.TemporaryDirectory() as workdir, ExitStack() as stack:
        library = _stub_library(workdir)
        saved = {name: os.environ.get(name) for name in ("LLM_DATADIST_DEVICE", "LLM_DATADIST_CUDA_LIBRARY",
                                                          "LLM_DATADIST_CUDA_DRIVER_LIBRARY")}
        os.environ.update(LLM_DATADIST_DEVICE="cuda", LLM_DATADIST_CUDA_LIBRARY=library,
                          LLM_DATADIST_CUDA_DRIVER_LIBRARY=library)
        try:
            server = stack.enter_context(Cluster(1, "PROMPT", listen=True, timeout=60,
                                                 options={"llm.MemPoolConfig": '{"memory_size": 67108864}'}))
        finally:
            for name, value in saved.items():  # (the cluster process has its copy)
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        addr = server.call(_allocate_device)
        answerer = rawpeer.ReverseAnswerer(EMPTY_TABLE)
        stack.callback(answerer.close)
        hostile = []
        for i in range(32):
            hostile.append(answerer.add(rawpeer.RawLink(server.address, 300 + i, source=HOSTILE)))
            stack.callback(hostile[-1].close)
        other = answerer.add(rawpeer.RawLink(server.address, 101))
        stack.callback(other.close)
        generation = other.table()["generation"]
        for link in hostile:
            link.sock.sendall(push_head(generation, addr, 6 << 20, 5) + b"\xab" * 1024)
        time.sleep(0.5)
        print(f"  held:            {server.call(_stats)}")
        started = time.monotonic()
        other.sock.sendall(push_head(generation, addr + 4096, 64, 6) + b"\x5a" * 64)
        try:
            status = rawpeer.read_frame(other.sock, timeout=40)[1]
        except OSError as exc:
            status = repr(exc)
        print(f"  other peer:      64-byte staged push status {status} after {time.monotonic() - started:.2f} s")
        _after_window(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("parsing", "staging"))
    args = parser.parse_args()
    import llm_datadist
    print(f"package: {llm_datadist.__file__}")
    if args.only in (None, "parsing"):
        parsing_attack()
    if args.only in (None, "staging"):
        staging_attack()


if __name__ == "__main__":
    main()
