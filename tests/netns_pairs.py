"""Two network namespaces joined by a veth pair, for tests that put processes on "two hosts"
(``tests/transport/test_netns.py``, ``tests/cli/test_two_hosts.py``,
``tests/integrations/test_vllm_hosts.py``).

``make_pair(request)`` creates a fresh pair (names carry this process's pid and a counter;
addresses are a private /30) and registers its removal with the test; it skips the test, with the
reason, where that is impossible: not root, no ``ip`` tool, or ``ip netns`` refused. Traffic stays
on the veth pair.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass

import pytest

_pairs = itertools.count()


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15)


@dataclass
class NetnsPair:
    server_ns: str
    client_ns: str
    server_ip: str
    client_ip: str
    server_dev: str
    client_dev: str


def make_pair(request, default_route: bool = False) -> NetnsPair:
    """Two fresh network namespaces joined by a veth pair, removed when the test ends; loopback is
    up in both, as on a real host. With ``default_route`` each namespace's default route points at
    the other end of the veth, so that a process there that asks which address reaches other hosts
    (a connected UDP socket, which sends nothing) finds its veth address; nothing behind the other
    end forwards anywhere."""
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("the ip tool (iproute2) is not installed")
    number = next(_pairs)
    tag = f"{os.getpid() % 100000}x{number}"
    pair = NetnsPair(f"lldd{tag}s", f"lldd{tag}c", f"10.213.{number % 64 * 4}.1", f"10.213.{number % 64 * 4}.2",
                     f"lv{tag}s", f"lv{tag}c")
    made = []

    def remove() -> None:
        for ns in made:
            ip("netns", "del", ns)

    request.addfinalizer(remove)
    for ns in (pair.server_ns, pair.client_ns):
        result = ip("netns", "add", ns)
        if result.returncode != 0:
            pytest.skip(f"ip netns add failed: {result.stderr.strip()}")
        made.append(ns)
    steps = [
        ("-n", pair.server_ns, "link", "add", pair.server_dev, "type", "veth", "peer", "name", pair.client_dev,
         "netns", pair.client_ns),
        ("-n", pair.server_ns, "addr", "add", f"{pair.server_ip}/30", "dev", pair.server_dev),
        ("-n", pair.client_ns, "addr", "add", f"{pair.client_ip}/30", "dev", pair.client_dev),
        ("-n", pair.server_ns, "link", "set", pair.server_dev, "up"),
        ("-n", pair.client_ns, "link", "set", pair.client_dev, "up"),
        # As on a real host: traffic to the namespace's own address goes through lo (UCX's TCP
        # connection of an agent to itself hangs without it).
        ("-n", pair.server_ns, "link", "set", "lo", "up"),
        ("-n", pair.client_ns, "link", "set", "lo", "up"),
    ]
    if default_route:
        steps += [("-n", pair.server_ns, "route", "add", "default", "via", pair.client_ip),
                  ("-n", pair.client_ns, "route", "add", "default", "via", pair.server_ip)]
    for step in steps:
        result = ip(*step)
        if result.returncode != 0:
            pytest.skip(f"ip {' '.join(step)} failed: {result.stderr.strip()}")
    return pair
