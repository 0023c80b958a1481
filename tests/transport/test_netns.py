"""Clusters in two network namespaces joined by a veth pair: to llm_datadist they are on two
hosts (the host identity includes the network namespace), so their link must use the tcp data
plane; bytes must still arrive exactly, and a network partition in the middle of a transfer
must end in LLM_TIMEOUT or LLM_LINK_FAILED within the deadline, after which the link is rebuilt.

Each test creates its own pair of namespaces (names carry this process's pid and a counter;
addresses are a private /30) and removes them, and its processes, whatever happens. Traffic
stays on the veth pair. Needs root and a working ``ip netns``; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import optional_deps
import pytest

import llm_datadist
from llm_datadist.status import LLMStatusCode
from netns_pairs import NetnsPair, ip, make_pair

S = LLMStatusCode
CHILD = Path(__file__).with_name("netns_child.py")
PACKAGE_ROOT = Path(llm_datadist.__file__).resolve().parents[1]
SYNC_TIMEOUT_MS = 2000
DEADLINE_S = SYNC_TIMEOUT_MS / 1000 + 1.0
SERVER_ID, CLIENT_ID = 1, 2
BLOCK = 64 << 10


@pytest.fixture
def netns_pair(request) -> NetnsPair:
    """Two fresh network namespaces joined by a veth pair with addresses in a private /30."""
    return make_pair(request)


class NetnsChild:
    """A process running netns_child.py (a cluster, or with ``args`` starting with "impostor",
    an impostor) inside the namespaces ``enter`` (a command prefix) puts it in, driven by JSON
    lines; ``ready`` is its first line."""

    def __init__(self, enter: List[str], args: List[str], log_path: Path, env: Optional[Dict[str, str]] = None) -> None:
        env = dict(os.environ, **(env or {}))
        env.pop("LLM_DATADIST_DATA_PLANE", None)  # let the link choose
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
        env["NETNS_CHILD_SYNC_MS"] = str(SYNC_TIMEOUT_MS)
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([*enter, sys.executable, str(CHILD), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.lines: "queue.Queue[str | None]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.ready = self.receive(60)
        except BaseException:
            self.close()
            raise

    @classmethod
    def cluster(cls, netns: str, cluster_id: int, listen_ip: str, log_path: Path,
                env: Optional[Dict[str, str]] = None) -> "NetnsChild":
        return cls(["ip", "netns", "exec", netns], [str(cluster_id)] + ([listen_ip] if listen_ip else []), log_path,
                   env)

    def python_pid(self) -> int:
        """The pid (in this test's pid namespace) of the python process, which is the launched
        process itself (``ip netns exec`` execs) or its child (``nsenter`` forks)."""
        python = os.path.realpath(sys.executable)
        pid = self.proc.pid
        for _ in range(4):
            try:
                if os.path.realpath(f"/proc/{pid}/exe") == python:
                    return pid
                with open(f"/proc/{pid}/task/{pid}/children") as f:
                    children = f.read().split()
            except OSError:
                break
            if not children:
                break
            pid = int(children[0])
        raise ProcessLookupError(f"no python process at or below pid {self.proc.pid}")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def receive(self, timeout: float) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no answer within {timeout} s; log:\n{self.log_tail()}") from None
        if line is None:
            raise RuntimeError(f"the child exited ({self.proc.poll()}); log:\n{self.log_tail()}")
        return json.loads(line)

    def send(self, cmd: str, **args) -> None:
        self.proc.stdin.write(json.dumps(dict(cmd=cmd, **args)) + "\n")
        self.proc.stdin.flush()

    def call(self, cmd: str, timeout: float = 30, **args) -> dict:
        self.send(cmd, **args)
        reply = self.receive(timeout)
        if "error" in reply:
            raise AssertionError(f"{cmd} failed in the child: {reply['error']}\n{reply.get('traceback', '')}")
        return reply

    def log_tail(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-4000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(10)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            try:
                os.kill(self.python_pid(), signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture
def netns_clusters(netns_pair, tmp_path, request):
    """A server cluster in one namespace and a client cluster in the other, each with a blocks
    cache ``c`` (32 blocks of 64 KiB, 2 tensors) filled from its own seed."""
    server = NetnsChild.cluster(netns_pair.server_ns, SERVER_ID, netns_pair.server_ip, tmp_path / "server.log")
    request.addfinalizer(server.close)
    client = NetnsChild.cluster(netns_pair.client_ns, CLIENT_ID, "", tmp_path / "client.log")
    request.addfinalizer(client.close)
    server.call("register", name="c", model_id=0, num_blocks=32, block_bytes=BLOCK, seed=5)
    client.call("register", name="c", model_id=0, num_blocks=32, block_bytes=BLOCK, seed=6)
    return server, client


def link(server: NetnsChild, client: NetnsChild, pair: NetnsPair) -> dict:
    return client.call("link", remote_id=SERVER_ID, ip=pair.server_ip, port=server.ready["port"], timeout_ms=3000)


def cut_while_looping(request, pair: NetnsPair, client: NetnsChild, op: str) -> None:
    """The client loops ``op`` over blocks 0..29 of "big"; its veth goes down mid-transfer: the
    transfer fails (LLM_TIMEOUT or LLM_LINK_FAILED) within sync_kv_timeout + 1 s of its start and of
    the cut. The veth comes up again when the test ends, if not before."""
    client.send("loop", op=op, remote_id=SERVER_ID, name="big", blocks=list(range(30)), max_seconds=60)
    assert client.receive(60) == {"progress": 1}
    time.sleep(0.05)
    cut_at = time.monotonic()
    down = ip("-n", pair.client_ns, "link", "set", pair.client_dev, "down")
    request.addfinalizer(lambda: ip("-n", pair.client_ns, "link", "set", pair.client_dev, "up"))
    assert down.returncode == 0, down.stderr
    outcome = client.receive(60)
    assert outcome["status"] in (S.LLM_TIMEOUT, S.LLM_LINK_FAILED), outcome
    assert outcome["failed"] - outcome["started"] <= DEADLINE_S
    assert outcome["failed"] - cut_at <= DEADLINE_S


def relink_and_move(server: NetnsChild, client: NetnsChild, pair: NetnsPair, connect, plane: str,
                    wait_s: float) -> None:
    """Link again (``connect(server, client, pair)``, retried for ``wait_s``: the veth's carrier and
    route come back asynchronously) on ``plane``, then push blocks 30, 31 of "big" (out of the
    loop's) and pull them back, byte-exactly."""
    relinked = None
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        relinked = connect(server, client, pair)
        if relinked["status"] == S.LLM_SUCCESS:
            break
        time.sleep(0.2)
    assert relinked["status"] == S.LLM_SUCCESS, relinked.get("logs", relinked)
    assert client.call("plane", remote_id=SERVER_ID)["plane"] == plane
    assert client.call("transfer", op="push", remote_id=SERVER_ID, name="big", src=[30, 31], dst=[2, 3])["status"] == 0
    assert server.call("holds", name="big", seed=6, blocks=[2, 3], pattern_blocks=[30, 31])["holds"]
    assert client.call("transfer", op="pull", remote_id=SERVER_ID, name="big", src=[30, 31], dst=[6, 7])["status"] == 0
    assert client.call("holds", name="big", seed=5, blocks=[6, 7], pattern_blocks=[30, 31])["holds"]


def test_link_across_namespaces_uses_tcp_and_moves_bytes(netns_pair, netns_clusters):
    """Same kernel, different network namespaces: the link picks tcp on both sides; pushes and
    pulls in both directions land byte-exactly and leave every other block alone."""
    server, client = netns_clusters
    server_host, client_host = server.call("host")["host"], client.call("host")["host"]
    assert server_host["boot_id"] == client_host["boot_id"]
    assert server_host["net_ns"] != client_host["net_ns"]

    outcome = link(server, client, netns_pair)
    assert (outcome["status"], outcome["rets"]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert client.call("plane", remote_id=SERVER_ID)["plane"] == "tcp"
    assert server.call("plane", remote_id=CLIENT_ID)["plane"] == "tcp"

    moves = [  # (who, op, src blocks, dst blocks)
        (client, "push", range(0, 8), range(8, 16)),
        (client, "pull", range(16, 24), range(24, 32)),
        (server, "push", range(0, 4), range(16, 20)),
        (server, "pull", range(4, 8), range(28, 32)),
    ]
    for who, op, src, dst in moves:
        remote = SERVER_ID if who is client else CLIENT_ID
        assert who.call("transfer", op=op, remote_id=remote, name="c", src=list(src), dst=list(dst))["status"] == 0

    def holds(who: NetnsChild, seed: int, blocks, pattern_blocks=None) -> bool:
        return who.call("holds", name="c", seed=seed, blocks=list(blocks),
                        pattern_blocks=None if pattern_blocks is None else list(pattern_blocks))["holds"]

    assert holds(server, 6, range(8, 16), range(0, 8))  # client push
    assert holds(client, 5, range(24, 32), range(16, 24))  # client pull
    assert holds(client, 5, range(16, 20), range(0, 4))  # server push
    assert holds(server, 6, range(28, 32), range(4, 8))  # server pull
    assert holds(server, 5, [*range(0, 8), *range(16, 28)])  # the rest of each side untouched
    assert holds(client, 6, [*range(0, 16), *range(20, 24)])

    assert client.call("unlink", remote_id=SERVER_ID, ip=netns_pair.server_ip,
                       port=server.ready["port"])["status"] == S.LLM_SUCCESS
    deadline = time.monotonic() + 5
    while server.call("linked")["linked"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.call("linked")["linked"] == []


@pytest.mark.parametrize("op", ["push", "pull"])
def test_partition_mid_transfer_fails_in_time_and_relinks(netns_pair, tmp_path, request, op):
    """The client's veth goes down while a 60 MiB transfer runs: LLM_TIMEOUT or LLM_LINK_FAILED
    within sync_kv_timeout + 1 s (measured in the client). Once the veth is up again, the link
    is rebuilt (unlink, link) and moves bytes exactly."""
    server = NetnsChild.cluster(netns_pair.server_ns, SERVER_ID, netns_pair.server_ip, tmp_path / "server.log")
    request.addfinalizer(server.close)
    client = NetnsChild.cluster(netns_pair.client_ns, CLIENT_ID, "", tmp_path / "client.log")
    request.addfinalizer(client.close)
    for who, seed in ((server, 5), (client, 6)):
        who.call("register", name="big", model_id=0, num_blocks=32, block_bytes=1 << 20, seed=seed)
    assert link(server, client, netns_pair)["status"] == S.LLM_SUCCESS

    cut_while_looping(request, netns_pair, client, op)  # blocks 30, 31 stay out: sources after the relink
    if op == "push":
        assert client.call("holds", name="big", seed=6, blocks=list(range(32)))["holds"]
    else:
        assert client.call("holds", name="big", seed=6, blocks=[30, 31])["holds"]

    assert ip("-n", netns_pair.client_ns, "link", "set", netns_pair.client_dev, "up").returncode == 0
    unlinked = client.call("unlink", remote_id=SERVER_ID, ip=netns_pair.server_ip, port=server.ready["port"])
    assert unlinked["status"] in (S.LLM_SUCCESS, S.LLM_UNLINK_FAILED)
    assert client.call("linked")["linked"] == []
    relink_and_move(server, client, netns_pair, link, "tcp", 15)


# ------------------------------------------------------------------------------------------------
# The nixl plane across the namespaces (NIXL over UCX TCP on the veth pair)
# ------------------------------------------------------------------------------------------------

NIXL_SECRET = "netns-nixl-secret-0123456789"


def nixl_env(device: str) -> Dict[str, str]:
    """A cluster with the link secret and nixl allowed over UCX TCP, UCX held to the namespace's
    veth ``device`` before any agent exists (UCX would otherwise also pick CMA across namespaces of
    one kernel, or listen on every device)."""
    return {"NETNS_CHILD_OPTIONS": json.dumps({"llm.LinkSecret": NIXL_SECRET}), "LLM_DATADIST_NIXL_TCP": "1",
            "UCX_TLS": "tcp", "UCX_NET_DEVICES": device, "UCX_MODULES": "^efa"}


@pytest.fixture
def nixl_clusters(netns_pair, tmp_path, request):
    from llm_datadist.transport.planes import nixl
    if not nixl.installed():
        optional_deps.skip_without("nixl", f"NIXL is not installed ({nixl.INSTALL})")
    server = NetnsChild.cluster(netns_pair.server_ns, SERVER_ID, netns_pair.server_ip, tmp_path / "server.log",
                                nixl_env(netns_pair.server_dev))
    request.addfinalizer(server.close)
    client = NetnsChild.cluster(netns_pair.client_ns, CLIENT_ID, "", tmp_path / "client.log",
                                nixl_env(netns_pair.client_dev))
    request.addfinalizer(client.close)
    return server, client


def nixl_link(server: NetnsChild, client: NetnsChild, pair: NetnsPair) -> dict:
    """The link's outcome, with both sides' logs (``logs``) to show why where it failed."""
    outcome = client.call("link", remote_id=SERVER_ID, ip=pair.server_ip, port=server.ready["port"],
                          timeout_ms=20000, timeout=60)
    return dict(outcome, logs=f"client:\n{client.log_tail()}\nserver:\n{server.log_tail()}")


def test_nixl_across_namespaces_is_chosen_by_auto_and_moves_bytes_exactly(netns_pair, nixl_clusters):
    """With a secret and LLM_DATADIST_NIXL_TCP=1, auto picks nixl for a peer in another namespace on
    both sides; pushes and pulls in both directions land byte-exactly and leave every other block
    alone; neither process holds a socket on an address outside the pair's."""
    from proc_sockets import foreign_sockets
    server, client = nixl_clusters
    for who, seed in ((server, 5), (client, 6)):
        who.call("register", name="c", model_id=0, num_blocks=32, block_bytes=BLOCK, seed=seed)
    linked = nixl_link(server, client, netns_pair)
    assert linked["status"] == S.LLM_SUCCESS, linked["logs"]
    assert client.call("plane", remote_id=SERVER_ID)["plane"] == "nixl"
    assert server.call("plane", remote_id=CLIENT_ID)["plane"] == "nixl"
    moves = [(client, "push", range(0, 8), range(8, 16)), (client, "pull", range(16, 24), range(24, 32)),
             (server, "push", range(0, 4), range(16, 20)), (server, "pull", range(4, 8), range(28, 32))]
    for who, op, src, dst in moves:
        remote = SERVER_ID if who is client else CLIENT_ID
        assert who.call("transfer", op=op, remote_id=remote, name="c", src=list(src), dst=list(dst))["status"] == 0

    def holds(who: NetnsChild, seed: int, blocks, pattern_blocks=None) -> bool:
        return who.call("holds", name="c", seed=seed, blocks=list(blocks),
                        pattern_blocks=None if pattern_blocks is None else list(pattern_blocks))["holds"]

    assert holds(server, 6, range(8, 16), range(0, 8)) and holds(client, 5, range(24, 32), range(16, 24))
    assert holds(client, 5, range(16, 20), range(0, 4)) and holds(server, 6, range(28, 32), range(4, 8))
    assert holds(server, 5, [*range(0, 8), *range(16, 28)]) and holds(client, 6, [*range(0, 16), *range(20, 24)])
    allowed = {netns_pair.server_ip, netns_pair.client_ip, "127.0.0.1"}
    for who in (server, client):
        assert foreign_sockets(who.python_pid(), allowed) == []
        assert who.call("stats")["stats"]["nixl_failures"] == 0


def test_nixl_partition_mid_transfer_fails_in_time_and_relinks(netns_pair, nixl_clusters, request):
    """The client's veth goes down while nixl pushes 60 MiB: NIXL alone would wait for ever (the
    request stays in progress); our deadline cancels it, removes the peer's agent and ends the
    link, within sync_kv_timeout + 1 s. Once the veth is up again a new link is nixl again and
    moves bytes exactly."""
    server, client = nixl_clusters
    for who, seed in ((server, 5), (client, 6)):
        who.call("register", name="big", model_id=0, num_blocks=32, block_bytes=1 << 20, seed=seed)
    linked = nixl_link(server, client, netns_pair)
    assert linked["status"] == S.LLM_SUCCESS, linked["logs"]
    assert client.call("plane", remote_id=SERVER_ID)["plane"] == "nixl"
    cut_while_looping(request, netns_pair, client, "push")
    assert client.call("holds", name="big", seed=6, blocks=list(range(32)))["holds"]

    assert ip("-n", netns_pair.client_ns, "link", "set", netns_pair.client_dev, "up").returncode == 0
    client.call("unlink", remote_id=SERVER_ID, ip=netns_pair.server_ip, port=server.ready["port"])
    relink_and_move(server, client, netns_pair, nixl_link, "nixl", 30)  # (also the server's view of the old link)


# ------------------------------------------------------------------------------------------------
# A private pid namespace: a dead peer's pid taken by another process
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def pid_namespace(request):
    """``(nsenter prefix, write_last_pid)`` for a fresh pid namespace with its own /proc; every
    process in it dies with it."""
    if os.geteuid() != 0:
        pytest.skip("creating a pid namespace needs root")
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.skip("unshare / nsenter (util-linux) are not installed")
    holder = subprocess.Popen(["unshare", "--pid", "--mount-proc", "--kill-child", "sleep", "600"])
    init = None

    def stop() -> None:
        if init is not None:
            os.kill(init, signal.SIGKILL)  # the namespace's init: every process in it dies too
        holder.kill()
        holder.wait(10)

    request.addfinalizer(stop)
    deadline = time.monotonic() + 10
    while init is None and time.monotonic() < deadline and holder.poll() is None:
        with open(f"/proc/{holder.pid}/task/{holder.pid}/children") as f:
            children = f.read().split()
        init = int(children[0]) if children else None
        time.sleep(0.02)
    if init is None:
        pytest.skip(f"unshare --pid did not start (exit code {holder.poll()})")
    enter = ["nsenter", "-t", str(init), "--pid", "--mount"]

    def write_last_pid(pid: int) -> None:
        result = subprocess.run([*enter, "sh", "-c", f"echo {pid} > /proc/sys/kernel/ns_last_pid"],
                                capture_output=True, text=True, timeout=10)
        if result.returncode != 0:
            pytest.skip(f"cannot set ns_last_pid: {result.stderr.strip()}")

    return enter, write_last_pid


def test_cma_never_writes_to_a_process_that_took_a_dead_peers_pid(pid_namespace, tmp_path, request):
    """Two clusters linked over cma in one pid namespace; the server is SIGKILLed and an
    unrelated process gets its pid and maps memory where the server's cache was. A push to the
    dead server must fail (LLM_LINK_FAILED) and must not write a byte into that process; a pull
    must not read from it.

    Found before commit b923a13 (which added the pidfd liveness check; this test fails on
    49a2fcf): the cma plane addressed the peer by pid alone -- LinkManager._cma called
    ``_io.cma_copy(peer.pid, plan, write, ...)`` without a pidfd, and the staleness check
    read the generation word through a mapping of the dead peer's memfd, which outlives the
    peer. Once the pid was reused, the push succeeded and its bytes landed in the unrelated
    process."""
    enter, write_last_pid = pid_namespace
    args = {"name": "c", "model_id": 0, "num_blocks": 8, "block_bytes": 1 << 20}
    server = NetnsChild(enter, [str(SERVER_ID), "127.0.0.1"], tmp_path / "server.log")
    request.addfinalizer(server.close)
    client = NetnsChild(enter, [str(CLIENT_ID)], tmp_path / "client.log")
    request.addfinalizer(client.close)
    server.call("register", seed=5, **args)
    client.call("register", seed=6, **args)
    assert client.call("link", remote_id=SERVER_ID, ip="127.0.0.1", port=server.ready["port"],
                       timeout_ms=3000)["status"] == S.LLM_SUCCESS
    assert client.call("plane", remote_id=SERVER_ID)["plane"] == "shm"  # user memory: through cma
    assert client.call("transfer", op="push", remote_id=SERVER_ID, name="c", src=[0], dst=[1])["status"] == 0
    target = server.call("addrs", name="c")
    dead_pid = server.ready["pid"]  # as the namespace sees it

    os.kill(server.python_pid(), signal.SIGKILL)
    server.proc.wait(10)
    write_last_pid(dead_pid - 1)
    impostor = NetnsChild(enter, ["impostor", ",".join(map(str, target["addrs"])), str(target["tensor_bytes"])],
                          tmp_path / "impostor.log")
    request.addfinalizer(impostor.close)
    if impostor.ready["pid"] != dead_pid or not impostor.ready["mapped"]:
        pytest.skip(f"could not recreate pid {dead_pid} with the dead cache's addresses mapped: {impostor.ready}")

    pushed = client.call("transfer", op="push", remote_id=SERVER_ID, name="c", src=[0, 1], dst=[0, 1])["status"]
    changed = impostor.call("changed")["changed"]
    pulled = client.call("transfer", op="pull", remote_id=SERVER_ID, name="c", src=[2, 3], dst=[2, 3])["status"]
    assert changed == 0, f"the push wrote {changed} bytes into pid {dead_pid}, another process (status {pushed})"
    assert pushed == S.LLM_LINK_FAILED
    assert pulled == S.LLM_LINK_FAILED
