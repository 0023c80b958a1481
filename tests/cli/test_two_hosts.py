"""``demo --role`` and ``bench --role``: the two sides as two real processes, on 127.0.0.1 (port 0
for the listening side, the chosen port read from its output) and between two network namespaces
joined by a veth pair (root only).

Each side runs in a process group of its own, its output in files; every test ends by killing
what is left of its groups and checking that nothing outlives them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

import optional_deps
import pytest

from netns_pairs import make_pair
from test_cli import REPO_ROOT, SMALL_DEMO, _group_gone, assert_clean_failure, run

SECRET = "not-a-real-secret-9f2c"
#: Every wait of a side for the other in these tests (the default is 60 s).
TIMEOUT = ["--timeout", "20"]
FINISH_S = 60.0


class Side:
    """One ``python -m llm_datadist ...`` process (inside ``enter``, a command prefix such as
    ``ip netns exec NS``), stdout and stderr in files."""

    def __init__(self, args: Sequence[str], folder: Path, name: str, enter: Sequence[str] = ()) -> None:
        self.name = name
        self.out_path, self.err_path = folder / f"{name}.out", folder / f"{name}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([*enter, sys.executable, "-m", "llm_datadist", *args], cwd=REPO_ROOT,
                                         stdout=out, stderr=err, text=True, start_new_session=True)
        self.returncode: Optional[int] = None

    @property
    def stdout(self) -> str:
        return self.out_path.read_text()

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait_for_line(self, prefix: str, timeout: float = 30.0) -> str:
        """The first line of stdout or stderr starting with ``prefix``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for text in (self.stdout, self.stderr):
                for line in text.splitlines():
                    if line.startswith(prefix):
                        return line
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        pytest.fail(f"{self.name} printed no {prefix!r} line (exit {self.proc.poll()}):\n{self.stdout}{self.stderr}")

    def port(self) -> int:
        return int(re.search(r"^listening: [\d.]+:(\d+) ", self.wait_for_line("listening: ")).group(1))

    def finish(self, timeout: float = FINISH_S) -> int:
        try:
            self.returncode = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.name} did not finish within {timeout} s:\n{self.stdout}{self.stderr}")
        return self.returncode

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


@pytest.fixture
def sides(tmp_path):
    """Starts sides (``sides(args, name)``) and, whatever happens, kills what is left of them."""
    started: List[Side] = []

    def start(args: Sequence[str], name: str, enter: Sequence[str] = ()) -> Side:
        side = Side(args, tmp_path, name, enter)
        started.append(side)
        return side

    yield start
    for side in started:
        if side.proc.poll() is None:
            side.kill()
        assert _group_gone(side.proc.pid), f"{side.name} left processes behind"


@pytest.fixture
def secret_file(tmp_path) -> Path:
    path = tmp_path / "link-secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return path


def demo_pair(sides, secret_file, decode_args=(), prefill_args=(), listen="127.0.0.1:0", peer_ip="127.0.0.1",
              enter=((), ())):
    """Decode, then prefill linking to the port decode printed: both sides, finished."""
    decode = sides(["demo", "--role", "decode", "--listen", listen, "--secret-file", str(secret_file), *TIMEOUT,
                    *SMALL_DEMO, *decode_args], "decode", enter[0])
    port = decode.port()
    prefill = sides(["demo", "--role", "prefill", "--peer", f"{peer_ip}:{port}", "--secret-file", str(secret_file),
                     *TIMEOUT, *SMALL_DEMO, *prefill_args], "prefill", enter[1])
    prefill.finish()
    decode.finish()
    for side in (prefill, decode):
        assert SECRET not in side.stdout + side.stderr, f"{side.name} printed the secret"
    return prefill, decode


def reports(prefill: Side, decode: Side) -> tuple:
    assert (prefill.returncode, decode.returncode) == (0, 0), (prefill.stderr, decode.stderr)
    return json.loads(prefill.stdout), json.loads(decode.stdout)


def assert_same_run(prefill: dict, decode: dict, operation: str) -> None:
    for report, role in ((prefill, "prefill"), (decode, "decode")):
        assert report["role"] == role and report["verified"] is True
        assert report["failures"] == [] and report["failure_count"] == 0 and report["untouched_count"] == 0
        assert report["operation"] == operation and report["blocks"] == 9 and report["descriptors"] == 9 * 4
    for key in ("data_plane", "latency_ms", "bytes", "transfer_seconds", "issuer"):
        assert prefill[key] == decode[key], key
    assert prefill["pid"] != decode["pid"]


# -- demo -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pull, plane", [(False, None), (True, "tcp")], ids=["push-auto", "pull-tcp"])
def test_demo_roles_move_and_verify_on_loopback(sides, secret_file, pull, plane):
    args = ["--json", *(["--pull"] if pull else []), *(["--plane", plane] if plane else [])]
    prefill, decode = reports(*demo_pair(sides, secret_file, args, args))
    assert_same_run(prefill, decode, "pull_blocks" if pull else "push_blocks")
    assert prefill["issuer"] == ("decode" if pull else "prefill")
    if plane:
        assert decode["data_plane"] == plane


def test_demo_roles_text_report_on_both_sides(sides, secret_file):
    prefill, decode = demo_pair(sides, secret_file)
    assert (prefill.returncode, decode.returncode) == (0, 0), (prefill.stderr, decode.stderr)
    assert decode.stdout.startswith("listening: 127.0.0.1:")
    for side in (prefill, decode):
        assert "link:      prefill" in side.stdout and f"authenticated with the secret of {secret_file}" in side.stdout
        assert "geometry:  2 layers x K/V = 4 tensors" in side.stdout
        assert "verified:  every byte of 9 blocks x 4 tensors matches" in side.stdout
        assert side.stderr == ""
    assert "(checked by the decode at 127.0.0.1:" in prefill.stdout


def test_demo_roles_refuse_different_workload_flags_on_both_sides(sides, secret_file):
    prefill, decode = demo_pair(sides, secret_file, decode_args=["--layers", "3", "--pull"])
    assert (prefill.returncode, decode.returncode) == (2, 2)
    line = ("demo: the workload flags of prefill and decode differ: --layers (prefill 2, decode 3), "
            "--pull (prefill off, decode on); give both sides the same flags\n")
    assert prefill.stderr == line and decode.stderr.endswith(line)
    assert "verified" not in prefill.stdout + decode.stdout


def test_demo_roles_corrupted_block_fails_both_sides(sides, secret_file):
    prefill, decode = demo_pair(sides, secret_file, decode_args=["--corrupt-block", "4"])
    assert (prefill.returncode, decode.returncode) == (1, 1), (prefill.stderr, decode.stderr)
    for side in (prefill, decode):
        assert "VERIFICATION FAILED: 1 of 36 block tensors differ" in side.stdout
        assert "request 1 block 1" in side.stdout and "layer 0 K: 1 byte differs" in side.stdout


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_demo_roles_give_up_on_a_peer_that_never_comes(sides, secret_file):
    started = time.monotonic()
    prefill = sides(["demo", "--role", "prefill", "--peer", f"127.0.0.1:{_closed_port()}", "--secret-file",
                     str(secret_file), "--timeout", "1", *SMALL_DEMO], "prefill")
    decode = sides(["demo", "--role", "decode", "--listen", "127.0.0.1:0", "--secret-file", str(secret_file),
                    "--timeout", "1", *SMALL_DEMO], "decode")
    assert (prefill.finish(), decode.finish()) == (2, 2)
    assert time.monotonic() - started < 15
    assert re.fullmatch(r"demo: no decode linked at 127\.0\.0\.1:\d+ within 1 s \(last attempt: "
                        r"ConnectionRefusedError: .*\)\n", prefill.stderr), prefill.stderr
    assert decode.stderr == "demo: no word from the prefill for 1 s (--timeout) while waiting for the prefill to link\n"


def test_demo_roles_end_when_the_peer_vanishes(sides, secret_file):
    """The prefill is killed once linked: the decode learns it from the link and exits 2 at once."""
    many = ["--layers", "1", "--kv-heads", "1", "--head-dim", "8", "--requests", "4000", "--tokens", "16"]
    decode = sides(["demo", "--role", "decode", "--listen", "127.0.0.1:0", "--secret-file", str(secret_file),
                    *TIMEOUT, *many], "decode")
    prefill = sides(["demo", "--role", "prefill", "--peer", f"127.0.0.1:{decode.port()}", "--secret-file",
                     str(secret_file), *TIMEOUT, *many], "prefill")
    prefill.wait_for_line("link: ")
    prefill.kill()
    killed = time.monotonic()
    assert decode.finish() == 2
    assert time.monotonic() - killed < 5
    assert decode.stderr.splitlines()[-1] in ("demo: the link to the prefill ended (the connection was closed)",
                                              "demo: the prefill closed the link"), decode.stderr


def test_demo_roles_ctrl_c_on_one_side_stops_both(sides, secret_file):
    """SIGINT to the prefill's group, as a terminal's Ctrl-C: it exits 130 quietly after telling
    the decode side, which exits 2 saying why."""
    many = ["--layers", "1", "--kv-heads", "1", "--head-dim", "8", "--requests", "4000", "--tokens", "16"]
    decode = sides(["demo", "--role", "decode", "--listen", "127.0.0.1:0", "--secret-file", str(secret_file),
                    *TIMEOUT, *many], "decode")
    prefill = sides(["demo", "--role", "prefill", "--peer", f"127.0.0.1:{decode.port()}", "--secret-file",
                     str(secret_file), *TIMEOUT, *many], "prefill")
    prefill.wait_for_line("caches: ")
    os.killpg(prefill.proc.pid, signal.SIGINT)
    assert (prefill.finish(), decode.finish()) == (130, 2), (prefill.stderr, decode.stderr)
    assert prefill.stderr == "demo: interrupted\n"
    assert decode.stderr.splitlines()[-1] == "demo: the prefill stopped: interrupted (Ctrl-C)"


def test_demo_roles_refuse_a_malformed_hello(sides, secret_file, tmp_path):
    """A peer holding the secret is still untrusted: a hello whose flags are not all integers is
    refused, the peer is told why, and the decode side stops with exit 2."""
    decode = sides(["demo", "--role", "decode", "--listen", "127.0.0.1:0", "--secret-file", str(secret_file),
                    *TIMEOUT, *SMALL_DEMO], "decode")
    rogue = ("import json, sys\n"
             "from llm_datadist import LLMConfig, LLMDataDist, LLMRole\n"
             "dd = LLMDataDist(LLMRole.PROMPT, 1)\n"
             "config = LLMConfig(); config.device_id = 0; config.link_secret = sys.argv[2]\n"
             "config.enable_remote_cache_accessible = True\n"
             "dd.init(config.generate_options())\n"
             "status, peer = dd.engine.link_address('127.0.0.1', int(sys.argv[1]), 5000)\n"
             "flags = dict(layers=True, block_size=16, kv_heads=4, head_dim=32, requests=3, tokens=40, seed=0, "
             "pull=False)\n"
             "print(json.dumps(dd.engine.notify(peer, {'demo': 'hello', 'version': 1, 'flags': flags}, 5000)))\n"
             "dd.finalize()\n")
    out = subprocess.run([sys.executable, "-c", rogue, str(decode.port()), SECRET], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"error": "the prefill's workload flags: field layers has a bad value True"}
    assert decode.finish() == 2
    assert decode.stderr == "demo: the prefill's workload flags: field layers has a bad value True\n"


@pytest.mark.parametrize("mode", [0o640, 0o604])
def test_demo_roles_refuse_a_secret_file_open_to_group_or_others(tmp_path, mode):
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    secret.chmod(mode)
    out = run("demo", "--role", "decode", "--listen", "127.0.0.1:0", "--secret-file", str(secret))
    assert_clean_failure(out, f"open to group or others (mode {mode:04o})", f"chmod 600 {secret}")
    assert SECRET not in out.stderr


def test_secret_files_are_refused_unless_private_and_not_empty(tmp_path):
    from llm_datadist.cli.two_hosts import TwoHostError, read_secret_file
    from llm_datadist.transport.auth import MAX_SECRET_FILE_BYTES
    secret = tmp_path / "secret"
    with pytest.raises(TwoHostError, match="cannot read the secret file .*: No such file"):
        read_secret_file(str(secret))
    for text, refusal in ((" \n", "is empty"), ("x" * (MAX_SECRET_FILE_BYTES + 1), "more than the 4096"),
                          (b"\xff\xfe", "not UTF-8 text")):
        secret.write_bytes(text if isinstance(text, bytes) else text.encode())
        secret.chmod(0o600)
        with pytest.raises(TwoHostError, match=refusal) as refused:
            read_secret_file(str(secret))
        assert "xxxx" not in str(refused.value)
    with pytest.raises(TwoHostError, match="not a regular file"):
        read_secret_file(str(tmp_path))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)  # no writer: opening it for reading must not wait for one
    with pytest.raises(TwoHostError, match="not a regular file"):
        read_secret_file(str(fifo))
    secret.write_text(f"  {SECRET}\n")
    secret.chmod(0o600)
    assert read_secret_file(str(secret)) == SECRET


def test_secret_files_are_treated_as_keys(tmp_path):
    """As OpenSSH treats a private key: no permission for group or others, owned by this user
    (after following links), and a secret of at least 16 bytes (white space around it not counted);
    each refusal says how to make a good one and never quotes the file."""
    from llm_datadist.cli.two_hosts import TwoHostError, read_secret_file
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    for mode in (0o640, 0o604, 0o620, 0o602, 0o610):
        secret.chmod(mode)
        with pytest.raises(TwoHostError, match=f"open to group or others \\(mode {mode:04o}\\); make it private: "
                                               f"chmod 600 {secret}$"):
            read_secret_file(str(secret))
    secret.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(secret)
    assert read_secret_file(str(link)) == SECRET  # links are followed
    theirs = tmp_path / "theirs"
    theirs.write_text(SECRET)
    theirs.chmod(0o600)
    os.chown(theirs, 65534, 65534)  # nobody's (the tests run as root)
    os.unlink(link)
    link.symlink_to(theirs)
    for path in (theirs, link):
        with pytest.raises(TwoHostError, match=f"belongs to user 65534, not to this one \\({os.geteuid()}\\)") \
                as refused:
            read_secret_file(str(path))
        assert "openssl rand -hex 32" in str(refused.value)
    for text, size in (("Q", 1), ("QUIXOTIC-PROOF!", 15), ("  QUIXOTIC-PROOF!\n", 15)):
        secret.write_text(text)
        with pytest.raises(TwoHostError, match=f"has {size} byte\\(s\\), fewer than the 16") as refused:
            read_secret_file(str(secret))
        assert "openssl rand -hex 32" in str(refused.value) and "Q" not in str(refused.value)
    secret.write_text("QUIXOTIC-PROOFS!\n")
    assert read_secret_file(str(secret)) == "QUIXOTIC-PROOFS!"


@pytest.mark.parametrize("args, refusal", [
    (["--role", "decode", "--secret-file", "s"], "--role decode needs --listen HOST:PORT"),
    (["--role", "decode", "--listen", "127.0.0.1:0", "--peer", "127.0.0.1:1", "--secret-file", "s"],
     "--role decode takes --listen, not --peer"),
    (["--role", "prefill", "--peer", "127.0.0.1:1"], "--role prefill needs --secret-file PATH"),
    (["--peer", "127.0.0.1:1"], "--peer needs --role prefill or --role decode"),
    (["--timeout", "5"], "--timeout needs --role"),
    (["--role", "prefill", "--peer", "127.0.0.1:1", "--secret-file", "s", "--corrupt-block", "1"],
     "give it to the side with --role decode"),
])
def test_demo_role_flags_are_checked_before_anything_starts(args, refusal):
    from llm_datadist.cli.demo_roles import check_args
    from llm_datadist.cli.main import build_parser
    assert refusal in check_args(build_parser().parse_args(["demo", *args]))


def test_demo_role_addresses_are_host_and_port():
    from llm_datadist.cli.two_hosts import parse_address
    assert parse_address("10.0.0.2:7000", False) == ("10.0.0.2", 7000)
    assert parse_address("decode-host:0", True) == ("decode-host", 0)
    for text, listening in (("10.0.0.2", True), (":7000", True), ("h:0", False), ("h:65536", True), ("h:x", True)):
        with pytest.raises(ValueError):
            parse_address(text, listening)
    assert_clean_failure(run("demo", "--role", "prefill", "--peer", "127.0.0.1:0"), "port 0 is not in 1..65535")


def test_workload_flags_are_checked_strictly():
    from llm_datadist.cli.demo_roles import check_flags, differences
    from llm_datadist.cli.two_hosts import TwoHostError
    good = dict(layers=2, block_size=16, kv_heads=4, head_dim=32, requests=3, tokens=40, seed=0, pull=False)
    assert check_flags(dict(good), "flags") == good
    for bad in (dict(good, layers=0), dict(good, layers=2.0), dict(good, layers="2"), dict(good, seed=-1),
                dict(good, seed=1 << 63), dict(good, pull=1), dict(good, extra=1), {k: good[k] for k in list(good)[1:]},
                [], None):
        with pytest.raises(TwoHostError):
            check_flags(bad, "flags")
    assert differences(good, dict(good)) == ""
    assert differences(good, dict(good, tokens=41, pull=True)) == \
        "--tokens (prefill 40, decode 41), --pull (prefill off, decode on)"


class _NoLinks:
    """An engine seam with no links, for ``PeerChannel`` alone."""

    def lost_links(self) -> dict:
        return {}

    def linked_clusters(self) -> list:
        return []


def test_peer_channel_refuses_what_it_does_not_expect():
    from llm_datadist.cli.two_hosts import MAX_QUEUED, PeerChannel, TwoHostError

    def channel() -> PeerChannel:
        return PeerChannel(_NoLinks(), "demo", ["ready"], "prefill", peers={1})
    assert channel().handler(3, {"demo": "ready"}) == {"error": "cluster 3 is not this run's prefill"}
    for message in ({"demo": ["ready"]}, {"demo": "verdict"}, ["demo"], {"other": "ready"}):
        refused = channel()
        assert refused.handler(1, message) == {"error": "unknown message"}
        with pytest.raises(TwoHostError, match="unknown kind"):
            refused.wait("ready", 5, "testing")
    flooded = channel()
    assert all(flooded.handler(1, {"demo": "ready"}) == {} for _ in range(MAX_QUEUED))
    assert flooded.handler(1, {"demo": "ready"}) == {"error": "too many messages"}
    ran = []  # past the bound, a message's answer does not even run
    flooded.answers["ready"] = lambda message: ran.append(message) or {}
    assert flooded.handler(1, {"demo": "ready"}) == {"error": "too many messages"} and ran == []
    assert flooded.handler(1, {"demo": "alive"}) == {}  # heartbeats are never queued
    malformed_abort = channel()
    malformed_abort.handler(1, {"demo": "abort", "why": "x" * 500})
    with pytest.raises(TwoHostError, match="malformed"):
        malformed_abort.wait("ready", 5, "testing")
    with pytest.raises(TwoHostError, match=r"no word from the prefill for 0\.1 s \(--timeout\) while testing"):
        channel().wait("ready", 0.1, "testing")


# -- between two network namespaces -----------------------------------------------------------------

def test_demo_roles_between_two_network_namespaces_over_tcp(sides, secret_file, request):
    pair = make_pair(request)
    enter = (["ip", "netns", "exec", pair.server_ns], ["ip", "netns", "exec", pair.client_ns])
    prefill, decode = reports(*demo_pair(sides, secret_file, ["--json"], ["--json"], listen=f"{pair.server_ip}:0",
                                         peer_ip=pair.server_ip, enter=enter))
    assert_same_run(prefill, decode, "push_blocks")
    assert prefill["data_plane"] == "tcp"  # auto, between two hosts
    assert prefill["peer"].startswith(f"{pair.server_ip}:")


@pytest.mark.parametrize("over", ["nixl", "tcp, encrypted"])
def test_demo_roles_between_two_network_namespaces_over_nixl_and_protected_tcp(sides, secret_file, request, over):
    """nixl: NIXL over UCX TCP on the veth pair, UCX held to each namespace's veth (the test env of
    ``tests/transport/test_netns.py``); protected tcp: both sides set LLM_DATADIST_LINK_PROTECTION."""
    if over == "nixl":
        from llm_datadist.transport.planes import nixl
        if not nixl.installed():
            optional_deps.skip_without("nixl", f"NIXL is not installed ({nixl.INSTALL})")
    pair = make_pair(request)
    env = {pair.server_ns: [], pair.client_ns: []}
    for ns, device in ((pair.server_ns, pair.server_dev), (pair.client_ns, pair.client_dev)):
        env[ns] = (["env", "LLM_DATADIST_NIXL_TCP=1", "UCX_TLS=tcp", f"UCX_NET_DEVICES={device}", "UCX_MODULES=^efa"]
                   if over == "nixl" else ["env", "LLM_DATADIST_LINK_PROTECTION=encrypt"])
    enter = tuple(["ip", "netns", "exec", ns, *env[ns]] for ns in (pair.server_ns, pair.client_ns))
    args = ["--json", *(["--plane", "nixl"] if over == "nixl" else [])]
    prefill, decode = reports(*demo_pair(sides, secret_file, ["--json"], args, listen=f"{pair.server_ip}:0",
                                         peer_ip=pair.server_ip, enter=enter))
    assert_same_run(prefill, decode, "push_blocks")
    assert prefill["data_plane"] == ("nixl" if over == "nixl" else "tcp")
    protected = "off" if over == "nixl" else "encrypt"
    assert prefill["link_protection"] == decode["link_protection"] == protected


# -- bench ------------------------------------------------------------------------------------------

def test_bench_roles_print_a_cross_host_table_on_loopback(sides, secret_file, tmp_path):
    server = sides(["bench", "--role", "server", "--listen", "127.0.0.1:0", "--secret-file", str(secret_file),
                    *TIMEOUT], "server")
    path = tmp_path / "sweep.json"
    client = sides(["bench", "--role", "client", "--peer", f"127.0.0.1:{server.port()}", "--secret-file",
                    str(secret_file), *TIMEOUT, "--sizes", "4KiB,64KiB", "--total", "256KiB", "--min-time", "0.01",
                    "--json", str(path)], "client")
    assert (client.finish(), server.finish()) == (0, 0), (client.stderr, server.stderr)
    data = json.loads(path.read_text())
    kinds = {(row["plane"], row["direction"]) for row in data["results"]}
    assert kinds == {("memcpy", "baseline"), ("local", "copy"), ("tcp", "push"), ("tcp", "pull")}
    assert len(data["results"]) == 2 * len(kinds)
    assert data["gpu"]["results"] == [] and data["meta"]["server"]["address"][0] == "127.0.0.1"
    assert data["meta"]["server"]["host"]["cpus"] == os.cpu_count()
    for row in data["results"]:
        assert row["bytes_per_call"] == 256 << 10 and row["ratio"] > 0
        line = f"{row['block']:>7} {row['plane']:6} {row['direction']:9} {row['threads']:7d} {row['gbps']:7.2f}"
        assert row["plane"] == "memcpy" or line in client.stdout
    assert "server host: llm_datadist " in client.stdout
    assert "served:    2 block sizes (4,096 B, 65,536 B)" in server.stdout
    for side in (client, server):
        assert SECRET not in side.stdout + side.stderr


def test_bench_server_refuses_malformed_or_oversized_cases():
    from llm_datadist.cli.bench_roles import BenchServer
    from llm_datadist.cli.two_hosts import TwoHostError
    server = BenchServer(state=None)  # every refusal comes before the state is touched
    good = {"bench": "case", "model_id": 100, "block_bytes": 4096, "moved": 64}
    with pytest.raises(TwoHostError, match="a case before its hello"):
        server.serve(good)
    server.greeted = True
    for bad, refusal in ((dict(good, model_id=True), "model_id"), (dict(good, block_bytes=0), "block_bytes"),
                         (dict(good, moved=1 << 30), "moved"), (dict(good, extra=1), "unknown fields .extra."),
                         ({"bench": "case"}, "lacks"), (dict(good, block_bytes=1 << 30, moved=2), "more than the")):
        with pytest.raises(TwoHostError, match=refusal):
            server.serve(bad)
    with pytest.raises(TwoHostError, match="no case"):
        server.sample({"bench": "sample", "op": "push", "index": 0})
    with pytest.raises(TwoHostError, match="index"):
        server.sample({"bench": "sample", "op": "push", "index": 2})
    with pytest.raises(TwoHostError, match="version 7"):
        server.hello({"bench": "hello", "version": 7})


def test_bench_role_flags_are_checked_before_anything_starts():
    from llm_datadist.cli.bench_roles import check_args
    from llm_datadist.cli.main import build_parser
    parser = build_parser()
    defaults = parser.parse_args(["bench"])
    for args, refusal in ((["--role", "server", "--secret-file", "s"], "needs --listen"),
                          (["--role", "client", "--peer", "h:1"], "needs --secret-file"),
                          (["--listen", "h:0"], "--listen needs --role server or --role client"),
                          (["--role", "server", "--listen", "h:0", "--secret-file", "s", "--sizes", "4K", "--planes",
                            "tcp"], "give --sizes, --planes to the client"),
                          (["--role", "client", "--peer", "h:1", "--secret-file", "s", "--gpu", "only"],
                           "GPU rows are measured on one host")):
        assert refusal in check_args(parser.parse_args(["bench", *args]), defaults)
    assert check_args(parser.parse_args(["bench", "--role", "client", "--peer", "h:1", "--secret-file", "s",
                                         "--planes", "local,tcp"]), defaults) is None
