#!/usr/bin/env python
"""One 4 KiB push over the ``tcp`` plane, completion included, with and without the receive spin
(``LLM_DATADIST_SPIN_US``), beside two raw ping-pongs of 4 KiB between two processes over the same
kind of socket -- both ends blocking in ``recv``, and both ends spinning on non-blocking sockets --
all in one run. (One 4 KiB write of NIXL over UCX TCP beside the tcp plane: ``report_nixl.py``.)

    python bench/latency_tcp.py                      # loopback, 3 rounds of 2000 pushes a kind
    python bench/latency_tcp.py --spins 0,20,50,100  # more spin settings
    python bench/latency_tcp.py --json out.json

The pushes: ``llm_datadist.cli.workload``'s latency case (one-tensor HOST caches of 4 KiB
blocks; ``push_blocks`` of one block, plain and with every layer argument), between a server and
a client process linked over ``tcp`` (forced); the spin is set in both processes before each
batch (``_io.set_spin_us``), and the settings are measured in turn, a batch each, so that every
setting shares the same stretches of a noisy machine; beside them, in the same rounds, a second
server and client pair that nothing is set in (``default settings``: the spin and its
self-adjustment as a user gets them, ``LLM_DATADIST_SPIN_US`` unset). A ping-pong round trip moves 4 KiB one
way and 28 bytes (a frame header's worth) back, as a push and its reply do. The spin's CPU cost:
each process's CPU time over the batches of a setting, per push (``cpu_us``), so the price of the
shorter latency is measured, not assumed; and how many of the receive waits' spins caught their
data, ended empty or were skipped (the spin turns itself off where it stops paying: ``_io``).

Reported per kind: median, p99 and min in microseconds, and the ratio to the spinning
ping-pong (the target: the default settings within 1.5x of it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from multiprocessing import get_context
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the checkout's package (the Cython core is built in place)
    sys.path.insert(0, str(REPO_ROOT))

from llm_datadist.cli.workload import LATENCY_CASE, PUSH, PUSH_LAYERS, TransportRig  # noqa: E402

PING_BYTES, PONG_BYTES = 4096, 28


def _set_spin(state, us: int) -> None:
    from llm_datadist import _io
    _io.set_spin_us(us)


def _cpu_ns(state) -> tuple:
    """This process's CPU time and its receive spins' ``(hits, misses, skipped)`` so far."""
    from llm_datadist import _io
    return (time.process_time_ns(), *_io.spin_stats())


def _pong(address, spin: bool, rounds: int) -> None:
    """The server end of a ping-pong: ``rounds`` times, take PING_BYTES and answer PONG_BYTES."""
    with socket.create_connection(address) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(not spin)
        buf, reply = bytearray(PING_BYTES), b"r" * PONG_BYTES
        view = memoryview(buf)
        for _ in range(rounds):
            if not _receive(sock, view):
                return
            sock.sendall(reply) if not spin else _send_spinning(sock, reply)


def _receive(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock`` (retrying at once on a non-blocking one); False if it closed."""
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:])
        except BlockingIOError:
            continue
        if n == 0:
            return False
        got += n
    return True


def _send_spinning(sock: socket.socket, data: bytes) -> None:
    sent = 0
    while sent < len(data):
        try:
            sent += sock.send(data[sent:])
        except BlockingIOError:
            continue


def ping_pong(spin: bool, rounds: int) -> list:
    """Microseconds of each round trip, timed in this process against a child process."""
    listener = socket.create_server(("127.0.0.1", 0))
    child = get_context("spawn").Process(target=_pong, args=(listener.getsockname(), spin, rounds), daemon=True)
    child.start()
    try:
        sock, _ = listener.accept()
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(not spin)
            ping, buf = b"p" * PING_BYTES, bytearray(PONG_BYTES)
            view = memoryview(buf)
            out = []
            for _ in range(rounds):
                start = time.perf_counter_ns()
                sock.sendall(ping) if not spin else _send_spinning(sock, ping)
                if not _receive(sock, view):
                    raise ConnectionError("the ping-pong child closed its end")
                out.append((time.perf_counter_ns() - start) / 1e3)
            return out
    finally:
        listener.close()
        child.join(10)
        if child.is_alive():
            child.kill()


def summary(values: list) -> dict:
    ordered = sorted(values)
    return dict(median=statistics.median(ordered), p99=ordered[max(0, int(0.99 * len(ordered)) - 1)],
                min=ordered[0], n=len(ordered))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spins", default="0,50", help="spin settings in microseconds (default 0,50)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of batches (default 3)")
    parser.add_argument("--batch", type=int, default=2000, help="pushes per kind and round (default 2000)")
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args()
    spins = [int(s) for s in args.spins.split(",")]
    pushes = {(spin, op): [] for spin in spins for op in (PUSH, PUSH_LAYERS)}
    defaults = {op: [] for op in (PUSH, PUSH_LAYERS)}
    cpu = {spin: [0, 0] for spin in spins}  # CPU ns of (client, server), pushes timed
    spun = {spin: [0, 0, 0] for spin in spins}  # receive spins that caught data, ended empty, were skipped
    os.environ["LLM_DATADIST_DATA_PLANE"] = "tcp"
    os.environ.pop("LLM_DATADIST_SPIN_US", None)
    with TransportRig(planes=("tcp",)) as rig, TransportRig(planes=("tcp",)) as untouched:
        rig.use(LATENCY_CASE)
        untouched.use(LATENCY_CASE)
        client, server = rig.clients["tcp"], rig.server.cluster
        for _ in range(args.rounds):
            for op in (PUSH, PUSH_LAYERS):
                defaults[op] += [ns / 1e3 for ns in untouched.measure("tcp", op, args.batch)]
            for spin in spins:
                for cluster in (client, server):
                    cluster.call(_set_spin, spin)
                before = client.call(_cpu_ns), server.call(_cpu_ns)
                for op in (PUSH, PUSH_LAYERS):
                    pushes[(spin, op)] += [ns / 1e3 for ns in rig.measure("tcp", op, args.batch)]
                after = client.call(_cpu_ns), server.call(_cpu_ns)
                for side in (0, 1):
                    cpu[spin][side] += after[side][0] - before[side][0]
                    for k in range(3):
                        spun[spin][k] += after[side][k + 1] - before[side][k + 1]
    rounds = args.rounds * args.batch
    baselines = {"ping-pong, both blocking": ping_pong(False, rounds),
                 "ping-pong, both spinning": ping_pong(True, rounds)}
    spinning = statistics.median(baselines["ping-pong, both spinning"])
    rows = []
    for (spin, op), values in pushes.items():
        per_push = 2 * args.rounds * args.batch
        rows.append(dict(kind=f"tcp {op}, spin {spin} us", **summary(values),
                         cpu_us_client=cpu[spin][0] / per_push / 1e3, cpu_us_server=cpu[spin][1] / per_push / 1e3,
                         spins=dict(zip(("hits", "misses", "skipped"), spun[spin]))))
    rows += [dict(kind=f"tcp {op}, default settings", **summary(values)) for op, values in defaults.items()]
    rows += [dict(kind=name, **summary(values)) for name, values in baselines.items()]
    print(f"{'kind':34} {'median us':>10} {'p99 us':>9} {'min us':>8} {'x spinning ping-pong':>21}  CPU us/push "
          "(client, server); spins caught/empty/skipped")
    for row in rows:
        cost = (f"  {row['cpu_us_client']:.1f}, {row['cpu_us_server']:.1f}; "
                f"{row['spins']['hits']}/{row['spins']['misses']}/{row['spins']['skipped']}") if "spins" in row else ""
        print(f"{row['kind']:34} {row['median']:10.1f} {row['p99']:9.1f} {row['min']:8.1f} "
              f"{row['median'] / spinning:20.2f}x{cost}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows=rows, pushes={f"{s} {o}": v for (s, o), v in pushes.items()},
                                                   defaults=defaults, baselines=baselines), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
