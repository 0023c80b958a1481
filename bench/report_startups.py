#!/usr/bin/env python
"""How long a cluster with the link secret takes to link while a stranger without it holds the
listener's handshake slots (``transport.slots``: the pre-authentication pool).

    python bench/report_startups.py                       # the default scenarios, 20 links each
    python bench/report_startups.py 32x2:idle 128x2:hello --attempts 40

A scenario ``NxK:MODES`` is a stranger (``tests/transport/flood.py``, its own process) holding N
connections from each of K loopback addresses (127.0.0.1 first: the address the linking
cluster uses too), in the modes ``idle``, ``partial`` (part of a hello) or ``hello`` (a whole
hello, then nothing), joined by ``+`` and taken in turn, each reopened as soon as the server
closes it. The server and the linking cluster are their own processes, with the same secret;
each attempt is one link (timeout ``--timeout-ms``) and, when it succeeded, one unlink.
Reported: links made, the median, 95th percentile and largest link time, the connections the
stranger opened and the server's counters (``preauth_evicted``, ``preauth_waited``,
``refused_busy`` + ``refused_source``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "transport"))
sys.path.insert(0, str(ROOT))

SECRET = "bench-startups-link-secret"
SERVER_ID, CLIENT_ID = 1, 2
DEFAULT_SCENARIOS = ["32x2:idle", "32x2:partial+hello", "64x2:idle", "128x2:hello", "32x4:idle"]


def _pending(state) -> int:
    return len(state.dd.engine.links.listener.pending())


def _stats(state):
    return dict(state.dd.engine.links.stats)


def run(scenario: str, attempts: int, timeout_ms: int) -> str:
    from cluster_ops import py_unlink, wait_for
    from flood import Flood

    from llm_datadist.testing import Cluster, link

    shape, _, modes = scenario.partition(":")
    per_source, sources = (int(x) for x in shape.split("x"))
    addresses = [f"127.0.0.{i + 1}" for i in range(sources)]
    options = {"llm.LinkSecret": SECRET}
    with ExitStack() as stack:
        server = stack.enter_context(Cluster(SERVER_ID, "PROMPT", listen=True, options=dict(options)))
        client = stack.enter_context(Cluster(CLIENT_ID, "DECODER", options=dict(options)))
        flood = stack.enter_context(Flood(server.address, addresses, per_source, tuple((modes or "idle").split("+"))))
        wait_for(lambda: server.call(_pending) >= min(64, per_source * sources), 10)
        time.sleep(0.5)  # the stranger's connections settle into the pool
        made, times = 0, []
        for _ in range(attempts):
            started = time.monotonic()
            status = link(client, server, timeout_ms)
            times.append(time.monotonic() - started)
            if status == (0, [0]):
                made += 1
                client.call(py_unlink, [(SERVER_ID, *server.address)], timeout_ms)
        counted = server.call(_stats)
    times.sort()
    p95 = times[min(len(times) - 1, int(round(0.95 * (len(times) - 1))))]
    refused = counted["refused_busy"] + counted["refused_source"]
    return (f"{scenario:<20} {made:>3}/{attempts:<3} {statistics.median(times) * 1000:>7.0f} {p95 * 1000:>7.0f} "
            f"{times[-1] * 1000:>7.0f} {flood.opened:>8} {counted['preauth_evicted']:>8} "
            f"{counted['preauth_waited']:>7} {refused:>7}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", default=DEFAULT_SCENARIOS)
    parser.add_argument("--attempts", type=int, default=20)
    parser.add_argument("--timeout-ms", type=int, default=2000)
    args = parser.parse_args()
    print(f"{'scenario':<20} {'linked':>7} {'med ms':>7} {'p95 ms':>7} {'max ms':>7} {'opened':>8} "
          f"{'evicted':>8} {'waited':>7} {'refused':>7}", flush=True)
    for scenario in args.scenarios:
        print(run(scenario, args.attempts, args.timeout_ms), flush=True)


if __name__ == "__main__":
    main()
