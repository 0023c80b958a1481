"""``python -m llm_datadist``: demo, bench and info run at small sizes and say what they did.

Every command runs in a process group of its own with a hard timeout; afterwards the group must be
empty (the cluster processes a command starts end with it).
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optional_deps
import pytest

from llm_datadist.cli.console import Progress, parse_size
from llm_datadist.transport import planes as registry

REPO_ROOT = Path(__file__).resolve().parents[2]
#: A demo small enough to take about a second: 2 layers x K/V, 16-token blocks of 4 heads x 32
#: dims (4 KiB per block and tensor), 3 requests of 40 tokens = 3 blocks each (the last one
#: partly used), 9 blocks in all.
SMALL_DEMO = ["--layers", "2", "--kv-heads", "4", "--head-dim", "32", "--requests", "3", "--tokens", "40"]
TINY_BENCH = ["--sizes", "4KiB,64KiB", "--total", "256KiB", "--min-time", "0.01"]


def _group_gone(pgid: int, wait: float = 10.0) -> bool:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def run_python(args, timeout: float = 90.0, env=None) -> subprocess.CompletedProcess:
    """``python *args`` from the repository root in a new process group; kills the group on timeout
    and checks that nothing of it outlives the command. ``env``: variables added to ours."""
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=None if env is None else {**os.environ, **env})
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"python {' '.join(args)} did not finish within {timeout} s")
    assert _group_gone(proc.pid), f"python {' '.join(args)} left processes behind"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run(*args, timeout: float = 90.0, env=None) -> subprocess.CompletedProcess:
    return run_python(["-m", "llm_datadist", *args], timeout, env)


#: Runs the command line in this interpreter, then prints its peak resident memory (KiB) to stderr:
#: VmHWM, the high-water mark of this program's own memory (getrusage's ru_maxrss would also count
#: the RSS of the process that forked it, which Linux carries across exec).
_MEASURED_MAIN = ("import re, sys; from llm_datadist.cli.main import main; status = main(sys.argv[1:]); "
                  "hwm = re.search(r'^VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read(), re.M).group(1); "
                  "print('peak_rss_kib', hwm, file=sys.stderr); sys.exit(status)")
#: Runs the command line with ``llm_datadist.testing.Cluster`` replaced by a class that fails: a
#: command that starts a cluster process would end with that traceback.
_NO_CLUSTERS_MAIN = ("import sys; import llm_datadist.testing as testing\n"
                     "class NoCluster:\n"
                     "    def __init__(self, *args, **kwargs):\n"
                     "        raise AssertionError('a cluster process was started')\n"
                     "testing.Cluster = NoCluster\n"
                     "from llm_datadist.cli.main import main; sys.exit(main(sys.argv[1:]))")


def assert_clean_failure(out: subprocess.CompletedProcess, *words: str) -> None:
    """Exit status 2 and a one-line message naming ``words``, never a traceback."""
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr + out.stdout
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    for word in words:
        assert word in out.stderr, out.stderr


def assert_interrupted(returncode: int, stderr: str, command: str) -> None:
    """Exit 130 and ``<command>: interrupted`` last; before it, at most the clusters' own log
    lines (``cluster N: ...``: a link that ended under a transfer), never a traceback."""
    assert returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    lines = stderr.splitlines()
    assert lines and lines[-1] == f"{command}: interrupted", stderr
    assert all(line.startswith("cluster ") for line in lines[:-1]), stderr


def test_help_lists_commands():
    out = run("--help")
    assert out.returncode == 0
    for command in ("demo", "info", "bench", "--version"):
        assert command in out.stdout


def test_version_is_the_installed_distribution_version():
    import llm_datadist
    out = run("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"llm_datadist {importlib.metadata.version('llm_datadist')}\n"
    assert out.stdout == f"llm_datadist {llm_datadist.__version__}\n"


# -- demo -------------------------------------------------------------------------------------------

def test_demo_help_lists_the_knobs():
    out = run("demo", "--help")
    assert out.returncode == 0
    for flag in ("--layers", "--block-size", "--kv-heads", "--head-dim", "--requests", "--tokens", "--plane",
                 "--pull", "--device", "--seed", "--json", "--corrupt-block"):
        assert flag in out.stdout


def test_demo_report_says_what_moved_and_that_it_was_verified():
    out = run("demo", *SMALL_DEMO, "--device", "cpu")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "geometry:  2 layers x K/V = 4 tensors" in text and "16 tokens x 4 KV heads x 32 head dim" in text
    assert "3 requests x 40 tokens = 3 blocks each, 9 blocks" in text
    assert "push_blocks" in text and "data plane" in text and "GB/s" in text
    # 3 requests: a nearest-rank p99 would be the maximum, so the report says max and no p99.
    assert "median" in text and "max" in text and "over 3 requests (too few for a p99)" in text
    assert "verified:  every byte of 9 blocks x 4 tensors matches" in text
    # No progress bar without a terminal, and nothing else: the clusters unlink before they close,
    # so neither reports a lost link.
    assert out.stderr == ""


@pytest.mark.parametrize("plane", [name for name in registry.host_names() if not registry.get(name).requires_secret])
@pytest.mark.parametrize("pull", [False, True], ids=["push", "pull"])
def test_demo_moves_and_verifies_on_each_plane(plane, pull):
    out = run("demo", *SMALL_DEMO, "--plane", plane, "--json", *(["--pull"] if pull else []))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["verified"] is True and report["failures"] == [] and report["untouched_failures"] == []
    assert report["data_plane"] == plane
    assert report["operation"] == ("pull_blocks" if pull else "push_blocks")
    assert report["blocks"] == 9 and report["descriptors"] == 9 * 4
    assert report["bytes"] == 9 * 4 * 16 * 4 * 32 * 2
    assert report["prefill_pid"] != report["decode_pid"]
    latency = report["latency_ms"]
    assert len(latency["per_request"]) == 3 and 0 < latency["median"] <= latency["max"] == max(latency["per_request"])
    assert latency["p99"] is None  # too few requests for one
    assert report["gbps"] > 0


def test_demo_counts_in_the_singular_where_there_is_one():
    out = run("demo", "--layers", "1", "--kv-heads", "1", "--head-dim", "8", "--block-size", "1", "--requests", "1",
              "--tokens", "1")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "geometry:  1 layer x K/V = 2 tensors; a block is 1 token x 1 KV head x 8 head dim" in text
    assert "batch:     1 request x 1 token = 1 block each, 1 block\n" in text
    assert "caches:    prefill 1 block (32 B), decode 2 blocks (64 B)" in text
    assert "moved:     1 request, 1 block x 2 tensors = 2 block copies" in text
    assert "push_blocks of 1 block x 2 tensors" in text and "over 1 request (too few for a p99)" in text
    assert "every byte of 1 block x 2 tensors matches; 1 spare decode block untouched" in text
    for wrong in ("1 layers", "1 tokens", "1 requests", "1 blocks", "1 KV heads", "1 spare decode blocks"):
        assert wrong not in text


def test_demo_reports_a_p99_from_100_requests_on():
    out = run("demo", "--layers", "1", "--kv-heads", "1", "--head-dim", "8", "--block-size", "1", "--requests", "100",
              "--tokens", "1", "--json")
    assert out.returncode == 0, out.stderr
    latency = json.loads(out.stdout)["latency_ms"]
    ordered = sorted(latency["per_request"])
    assert len(ordered) == 100 and latency["p99"] == ordered[98] and latency["max"] == ordered[99]
    text = run("demo", "--layers", "1", "--kv-heads", "1", "--head-dim", "8", "--block-size", "1", "--requests",
               "100", "--tokens", "1").stdout
    assert ", p99 " in text and "over 100 requests\n" in text and "too few" not in text


def test_demo_reports_a_corrupted_block_and_fails():
    # Block 4 of the batch = block 1 of request 1 (3 blocks a request).
    out = run("demo", *SMALL_DEMO, "--corrupt-block", "4")
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "VERIFICATION FAILED: 1 of 36 block tensors differ" in out.stdout
    assert "request 1 block 1" in out.stdout and "layer 0 K: 1 byte differs" in out.stdout
    assert "verified:" not in out.stdout and "VERIFICATION FAILED" in out.stdout


def test_demo_refuses_bad_input_without_a_traceback():
    assert_clean_failure(run("demo", "--layers", "0"), "--layers", "must be >= 1")
    assert_clean_failure(run("demo", "--plane", "rdma"), "--plane", "invalid choice")
    assert_clean_failure(run("demo", "--requests", "many"), "not an integer")
    assert_clean_failure(run("demo", *SMALL_DEMO, "--corrupt-block", "9"), "blocks 0..8")


def test_demo_refuses_a_runtime_it_cannot_use():
    # acl: not loadable here, or (on an Ascend host) device memory that cannot move between processes.
    assert_clean_failure(run("demo", *SMALL_DEMO, "--device", "acl"), "demo:", "acl")


# -- bench ------------------------------------------------------------------------------------------

def test_bench_tiny_sweep_prints_a_table_and_writes_json(tmp_path):
    path = tmp_path / "sweep.json"
    out = run("bench", *TINY_BENCH, "--planes", "local,cma,tcp", "--json", str(path))
    assert out.returncode == 0, out.stderr
    assert "GB/s" in out.stdout and "us/block" in out.stdout and "ratio" in out.stdout
    assert str(path) in out.stdout
    data = json.loads(path.read_text())
    assert data["config"]["sizes"] == [4096, 65536] and data["config"]["total"] == 256 << 10
    assert data["meta"]["host"]["cpus"] == os.cpu_count()
    kinds = {(row["plane"], row["direction"]) for row in data["results"]}
    assert kinds == {("memcpy", "baseline"), ("local", "copy"), ("cma", "push"), ("cma", "pull"),
                     ("tcp", "push"), ("tcp", "pull")}
    assert len(data["results"]) == 2 * len(kinds)
    for row in data["results"]:
        assert row["blocks_per_call"] == (256 << 10) // row["block_bytes"]
        assert row["bytes_per_call"] == 256 << 10
        assert len(row["durations_ns"]) == row["repetitions"] >= 5
        for field in ("ratio", "gbps", "baseline_gbps", "us_per_block"):
            assert isinstance(row[field], float) and math.isfinite(row[field]) and row[field] > 0, (field, row)
        assert row["threads"] == 1  # 256 KiB a call: below every plane's split
        line = f"{row['block']:>7} {row['plane']:6} {row['direction']:9} {row['threads']:7d} {row['gbps']:7.2f}"
        assert row["plane"] == "memcpy" or line in out.stdout
    assert "threads:" not in out.stdout


def test_bench_subset_of_planes_and_directions(tmp_path):
    path = tmp_path / "sweep.json"
    out = run("bench", "--sizes", "16K", "--total", "64K", "--min-time", "0", "--planes", "tcp",
              "--directions", "pull", "--json", str(path))
    assert out.returncode == 0, out.stderr
    rows = json.loads(path.read_text())["results"]
    assert [(row["plane"], row["direction"]) for row in rows] == [("memcpy", "baseline"), ("tcp", "pull")]


def test_bench_accepts_every_direction_its_help_offers(tmp_path):
    from llm_datadist.cli.main import build_parser
    help_text = run("bench", "--help").stdout
    assert "push, pull or both" in help_text
    parser = build_parser()
    assert [parser.parse_args(["bench", "--directions", d]).directions for d in ("push", "pull", "both")] == \
        [["push"], ["pull"], ["push", "pull"]]
    path = tmp_path / "sweep.json"
    out = run("bench", "--sizes", "16K", "--total", "64K", "--min-time", "0", "--planes", "tcp",
              "--directions", "both", "--json", str(path))
    assert out.returncode == 0, out.stderr
    rows = json.loads(path.read_text())["results"]
    assert [(row["plane"], row["direction"]) for row in rows] == [("memcpy", "baseline"), ("tcp", "push"),
                                                                   ("tcp", "pull")]


def test_bench_says_which_transfers_ran_on_two_threads(tmp_path):
    """8 MiB a call: the same-host and TCP planes split it over two threads, the baseline is one;
    the JSON rows, the table and the plot's legend say so."""
    from llm_datadist.cli.bench import series_label
    path = tmp_path / "sweep.json"
    out = run("bench", "--sizes", "1MiB", "--total", "8MiB", "--min-time", "0", "--planes", "local,cma,tcp",
              "--directions", "push", "--json", str(path))
    assert out.returncode == 0, out.stderr
    threads = {row["plane"]: row["threads"] for row in json.loads(path.read_text())["results"]}
    assert threads == {"memcpy": 1, "local": 1, "cma": 2, "tcp": 2}
    assert "threads: the memcpy baseline is one thread; cma transfers of 8 MiB or more" in out.stdout
    assert series_label("memcpy", "baseline", [1, 1]) == "memcpy (baseline, 1 thread)"
    assert series_label("cma", "push", [2, 2]) == "cma push (2 threads)"
    assert series_label("tcp", "pull", [1, 2]) == "tcp pull (2 threads from 8 MiB a call)"
    assert series_label("local", "copy", [1]) == "local copy (1 thread)"


def test_bench_ctrl_c_stops_everything_quietly_with_130(tmp_path):
    path = tmp_path / "sweep.json"
    args = ["-m", "llm_datadist", "bench", "--sizes", "4KiB", "--total", "1MiB", "--min-time", "60", "--planes",
            "cma,tcp", "--json", str(path)]
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("sweep:"):
                break
        time.sleep(3)  # the rig starts, then measures for a minute
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert_interrupted(proc.returncode, stderr, "bench")
    assert not path.exists()
    assert _group_gone(proc.pid), "processes of the bench outlived it"


def test_bench_plot_without_matplotlib_says_how_to_get_it(tmp_path):
    # Whether or not matplotlib is installed, make it unimportable for this run.
    code = ("import sys; sys.modules['matplotlib'] = None; from llm_datadist.cli.main import main; "
            "sys.exit(main(sys.argv[1:]))")
    path = tmp_path / "sweep.json"
    out = run_python(["-c", code, "bench", *TINY_BENCH, "--json", str(path), "--plot", str(tmp_path / "p.png")])
    assert_clean_failure(out, "--plot needs matplotlib", "pip install")
    assert not path.exists()  # refused before measuring anything


def test_bench_plot_draws_a_png(tmp_path):
    optional_deps.importorskip("matplotlib")
    plot = tmp_path / "sweep.png"
    out = run("bench", *TINY_BENCH, "--planes", "local,tcp", "--json", str(tmp_path / "s.json"),
              "--plot", str(plot))
    assert out.returncode == 0, out.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_refuses_bad_input_without_a_traceback(tmp_path):
    assert_clean_failure(run("bench", "--sizes", "0"), "--sizes")
    assert_clean_failure(run("bench", "--sizes", "4 parsecs"), "not a size")
    assert_clean_failure(run("bench", "--planes", "rdma"), "unknown data plane: rdma")
    assert_clean_failure(run("bench", "--directions", "sideways"), "unknown direction")
    assert_clean_failure(run("bench", "--min-time", "-1"), "--min-time")
    assert_clean_failure(run("bench", *TINY_BENCH, "--json", str(tmp_path / "missing" / "x.json")),
                         "not a writable directory")


# -- info -------------------------------------------------------------------------------------------

def test_info_reports_build_runtimes_and_planes():
    out = run("info", "--json")
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout)
    assert facts["build"] in ("release", "debug")
    assert facts["cython"] and facts["version"]
    assert facts["compile_flags"]  # recorded at build time (or says that it was not)
    assert facts["device_runtime"].startswith(("cpu", "acl", "cuda"))
    assert facts["runtimes"]["cpu"].startswith("available")
    planes = facts["data_planes"]
    assert set(planes) == {"local", *registry.names()}
    assert planes["local"].startswith("available")
    assert planes["tcp"].startswith("available")  # loopback works wherever the test suite runs
    assert planes["cma"].startswith(("available: ", "not available: "))
    assert "ptrace" in planes["cma"] or "Yama" in planes["cma"]
    assert facts["host"]["cpus"] == os.cpu_count()


def test_info_says_who_gets_cuda_ipc_handles():
    if "cuda_ipc" not in registry.names():
        pytest.skip("no cuda_ipc plane is registered")
    texts = {}
    for opt_in in ("0", "1"):
        out = run("info", "--json", env={"LLM_DATADIST_CUDA_IPC_WITHOUT_SECRET": opt_in})
        assert out.returncode == 0, out.stderr
        trust = json.loads(out.stdout)["data_plane_trust"]
        assert set(trust) <= set(registry.names())
        texts[opt_in] = text = trust["cuda_ipc"]
        assert "pid and uid the kernel proved" in text and "of this user" in text
        assert "whole cudaMalloc allocation" in text and "exposes all of it" in text
    assert "links authenticated with a secret" in texts["0"] and "llm.CudaIpcWithoutSecret" in texts["0"]
    assert "LLM_DATADIST_CUDA_IPC_WITHOUT_SECRET is on" in texts["1"]


def test_info_text_names_every_section():
    out = run("info")
    assert out.returncode == 0, out.stderr
    for heading in ("version:", "build:", "compile_flags:", "device_runtime:", "runtimes:", "data_planes:",
                    "  cma ", "  tcp ", "data_plane_trust:", "budgets:", "  table ", "host:"):
        assert heading in out.stdout


#: The byte budgets docs/security.md documents: (name in info, environment variable, default,
#: counter of ``LLMDataDist.engine.link_stats()``).
DOCUMENTED_BUDGETS = [("table", "LLM_DATADIST_MAX_TABLE_BYTES", "1 MiB (1048576 bytes) per link", "refused_tables"),
                      ("message", "LLM_DATADIST_MAX_MESSAGE_BYTES", "64 KiB (65536 bytes) per message",
                       "refused_oversized"),
                      ("parsing", "LLM_DATADIST_MAX_PARSING_BYTES", "16 MiB (16777216 bytes) per process",
                       "refused_parsing"),
                      ("staging", "LLM_DATADIST_MAX_STAGING_BYTES", "256 MiB (268435456 bytes) per process",
                       "refused_staging")]


def test_info_lists_the_budgets_in_force():
    """Each byte budget with its value, its environment variable and the counter of its refusals;
    a value set in the environment is the one listed (the default still named)."""
    out = run("info", "--json", env={name: "" for _, name, _, _ in DOCUMENTED_BUDGETS})
    assert out.returncode == 0, out.stderr
    budgets = json.loads(out.stdout)["budgets"]
    for name, env, default, counter in DOCUMENTED_BUDGETS:
        assert budgets[name].startswith(default), budgets[name]
        assert f"({env}, default " in budgets[name] and f"({counter})" in budgets[name]
    assert budgets["lost_links"].startswith("1024 records per engine (fixed)")
    assert budgets["lost_reason"].startswith("256 characters per record (fixed)")
    assert budgets["handshake"].startswith("64 KiB (65536 bytes) per message (fixed)")
    assert budgets["pull_tag"].startswith("512 B (512 bytes) per pull (fixed)")
    out = run("info", "--json", env={"LLM_DATADIST_MAX_TABLE_BYTES": "2m", "LLM_DATADIST_MAX_PARSING_BYTES": "300k"})
    assert out.returncode == 0, out.stderr
    budgets = json.loads(out.stdout)["budgets"]
    assert budgets["table"].startswith("2 MiB (2097152 bytes) per link (LLM_DATADIST_MAX_TABLE_BYTES, default 1 MiB)")
    assert budgets["parsing"].startswith("300 KiB (307200 bytes) per process")


# -- helpers ----------------------------------------------------------------------------------------

class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_on_a_terminal_only():
    terminal, pipe = _Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        with Progress(4, stream) as progress:
            for i in range(4):
                progress.step(f"step {i}")
    assert "100%" in terminal.getvalue() and "#" * Progress.WIDTH in terminal.getvalue()
    assert pipe.getvalue() == ""


def test_parse_size():
    assert [parse_size(s) for s in ("4096", "4K", "4KiB", "2MiB", "1g")] == [4096, 4096, 4096, 2 << 20, 1 << 30]
    for bad in ("", "4X", "-1K", "1.5M"):
        with pytest.raises(ValueError):
            parse_size(bad)



@pytest.mark.parametrize("args, words", [
    (["--requests", "100000000"], ["--requests 100000000 is more than", "use fewer --requests"]),
    (["--requests", "10000000", "--tokens", "1000000"], ["use fewer --requests"]),
    (["--requests", "1000", "--tokens", "1000000"],
     ["4,000,000,000 block copies", "--tokens", "--block-size"]),
    (["--layers", "1000000"], ["block copies", "--layers"]),
    # One block of a tensor is 1600 TB: within the block-copy limit, beyond any machine's memory.
    (["--requests", "1", "--layers", "1", "--block-size", "100000", "--head-dim", "250000000"],
     ["would take", "available", "--block-size", "--head-dim", "--kv-heads"]),
    (["--requests", "1", "--kv-heads", "1000000"], ["would take", "available", "--kv-heads"]),
], ids=["requests", "requests-and-tokens", "tokens", "layers", "block-bytes", "kv-heads"])
def test_demo_refuses_a_huge_batch_from_its_arguments_alone(args, words):
    """Sizes beyond the demo's limits or the memory available are refused before anything is
    allocated: exit 2, one line naming the flags, and the process never grows."""
    out = run_python(["-c", _MEASURED_MAIN, "demo", *args], timeout=60)
    message, measured = out.stderr.strip().splitlines()
    assert_clean_failure(subprocess.CompletedProcess(out.args, out.returncode, out.stdout, message), "demo: ", *words)
    peak_mib = int(measured.split()[1]) / 1024
    assert peak_mib < 150, f"peak RSS {peak_mib:.0f} MiB: allocated before refusing"


def test_demo_refuses_a_bad_data_plane_variable_before_starting_processes():
    out = run_python(["-c", _NO_CLUSTERS_MAIN, "demo", *SMALL_DEMO], env={"LLM_DATADIST_DATA_PLANE": "rdma"})
    assert_clean_failure(out, "LLM_DATADIST_DATA_PLANE='rdma' is not a data plane", "--plane")
    # --plane overrides the variable, as its help says.
    out = run("demo", *SMALL_DEMO, "--plane", "tcp", "--json", env={"LLM_DATADIST_DATA_PLANE": "rdma"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["data_plane"] == "tcp"


@pytest.mark.parametrize("after", ["caches:", "transfer:"], ids=["while-starting", "while-moving"])
def test_demo_ctrl_c_stops_everything_quietly_with_130(after):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it: while the cluster
    processes start (after the 'caches:' line) or while requests move (after 'transfer:'). The
    demo exits with 130 and 'demo: interrupted', no traceback from it or its children, nothing
    left behind. (A cluster closed mid-transfer may log that its link went away: see
    ``assert_interrupted``.)"""
    # 4000 requests: several seconds of calls, long enough to be interrupted.
    args = ["-m", "llm_datadist", "demo", "--layers", "1", "--kv-heads", "1", "--head-dim", "8", "--requests", "4000",
            "--tokens", "16"]
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(after):
                break
        assert seen and seen[-1].startswith(after), seen
        if after == "transfer:":
            time.sleep(0.3)  # into the requests
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert_interrupted(proc.returncode, stderr, "demo")
    assert "verified:" not in stdout
    assert _group_gone(proc.pid), "processes of the demo outlived it"
