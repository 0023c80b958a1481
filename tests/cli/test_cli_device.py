"""The CLI with device memory the host cannot address: the stub runtime library
(``tests/core/stub_runtime.c``) posing as ``cuda`` and ``acl``.

The stub's device memory is host memory, but the bindings report it as not host-addressable, so
every byte the demo and the GPU rows write or check goes through the runtime's copies, as on a
GPU. Timings of the stub mean nothing: these tests check that the paths run and say what they did.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from test_cli import SMALL_DEMO, assert_clean_failure, run

from llm_datadist.cli import demo as _demo
from llm_datadist.cli import device_workload as _device_workload

#: The GPU rows at the smallest sizes: two block sizes, a few blocks a call.
TINY_GPU = ["--gpu", "only", "--gpu-sizes", "4KiB,16KiB", "--gpu-total", "64KiB", "--min-time", "0.01"]


@pytest.fixture(scope="module")
def stub_path(stub_libraries) -> str:
    """The stub runtime library (tests/runtime_stub.py), posing as cuda and acl."""
    return str(stub_libraries["full"])


def _env(stub: str, device: str) -> dict:
    return {"LLM_DATADIST_DEVICE": device, "LLM_DATADIST_CUDA_LIBRARY": stub, "LLM_DATADIST_ACL_LIBRARY": stub,
            "LLM_DATADIST_CUDA_DRIVER_LIBRARY": stub}


# -- demo -----------------------------------------------------------------------------------------

@pytest.fixture
def stub_cuda(stub_path, monkeypatch):
    for key, value in _env(stub_path, "cuda").items():
        monkeypatch.setenv(key, value)
    return stub_path


def test_demo_sides_never_touch_device_memory_from_the_host(stub_cuda):
    """The demo's cluster functions, in this process, on DEVICE memory of the stub cuda runtime:
    filled, copied, corrupted and checked through the HOST staging cache and swap_blocks alone
    (a host view of that memory is refused, so any direct access would fail)."""
    from llm_datadist import LLMConfig, LLMDataDist, LLMException, LLMRole, LLMStatusCode
    geometry = _demo.Geometry(layers=2, block_tokens=4, kv_heads=2, head_dim=8)  # 128-byte blocks, 4 tensors
    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.mem_pool_cfg = json.dumps({"memory_size": 1 << 20})
    dd = LLMDataDist(LLMRole.PROMPT, 7)
    dd.init(config.generate_options())
    try:
        state = SimpleNamespace(cluster_id=7, dd=dd, cm=dd.cache_manager, caches={}, arrays={}, scratch={})
        info = _demo.side_setup(state, geometry, num_blocks=6, staging=2)
        assert info["runtime"] == "cuda" and info["host_addressable"] is False
        with pytest.raises(LLMException) as refused:
            state.caches["kv"].as_numpy()
        assert refused.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
        assert _demo.verify_untouched(state, list(range(6))) == []  # zeroed through the staging cache
        _demo.fill_request(state, geometry, 5, 0, [4, 1])
        # What a transfer would do: request 0's blocks 4, 1 land on blocks 0, 3.
        state.cm.copy_blocks(state.caches["kv"], {4: [0], 1: [3]})
        assert _demo.verify_request(state, geometry, 5, 0, [0, 3]) == []
        assert _demo.verify_untouched(state, [2, 5]) == []
        wrong = _demo.verify_request(state, geometry, 6, 0, [0, 3])  # another seed: every block tensor differs
        assert len(wrong) == 2 * geometry.num_tensors
        _demo.corrupt(state, 3, 1)
        [failure] = _demo.verify_request(state, geometry, 5, 0, [0, 3])
        assert (failure["block"], failure["decode_block"], failure["layer"], failure["kv"]) == (1, 3, 0, "V")
        assert failure["bytes_wrong"] == 1 and failure["first_byte"] == geometry.block_bytes // 2
        untouched = _demo.verify_untouched(state, [2, 3, 5])  # block 3 holds data
        assert {f["decode_block"] for f in untouched} == {3} and len(untouched) == geometry.num_tensors
    finally:
        dd.finalize()


@pytest.mark.parametrize("device", ["cuda", "acl"])
@pytest.mark.parametrize("pull", [False, True], ids=["push", "pull"])
def test_demo_on_a_runtime_the_host_cannot_address(stub_path, device, pull):
    """``demo --device cuda|acl`` with the stub: DEVICE caches of that runtime in both processes.
    With a device data plane registered the batch moves and is verified through the library;
    without one the demo refuses in one line, before starting anything."""
    args = ["demo", *SMALL_DEMO, "--device", device, "--json", *(["--pull"] if pull else [])]
    out = run(*args, env=_env(stub_path, "auto"))
    if not _demo.device_planes():
        assert_clean_failure(out, "demo:", device, "device data plane")
        return
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["verified"] is True and report["failures"] == [] and report["untouched_failures"] == []
    assert report["device_runtime"] == device and report["device_host_addressable"] is False
    assert report["data_plane"] in _demo.device_planes(), report["data_plane"]
    assert report["blocks"] == 9 and report["descriptors"] == 9 * 4


def test_demo_corrupt_block_is_found_on_device_memory(stub_path):
    if not _demo.device_planes():
        pytest.skip("no device data plane is registered (the transport's cuda_ipc / staging planes)")
    out = run("demo", *SMALL_DEMO, "--device", "cuda", "--corrupt-block", "4", env=_env(stub_path, "auto"))
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "VERIFICATION FAILED: 1 of 36 block tensors differ" in out.stdout
    assert "request 1 block 1" in out.stdout and "layer 0 K: 1 byte differs" in out.stdout


def test_demo_refuses_a_host_plane_for_device_memory(stub_path):
    if not _demo.device_planes():
        pytest.skip("no device data plane is registered: the demo refuses the runtime itself (tested above)")
    assert_clean_failure(run("demo", *SMALL_DEMO, "--device", "cuda", "--plane", "cma", env=_env(stub_path, "auto")),
                         "cma cannot move device memory")


def test_demo_device_cuda_without_a_usable_library_fails_cleanly(tmp_path):
    out = run("demo", *SMALL_DEMO, "--device", "cuda",
              env={"LLM_DATADIST_CUDA_LIBRARY": str(tmp_path / "libcudart-missing.so")})
    assert_clean_failure(out, "demo:", "cuda", "libcudart-missing.so")


# -- bench's GPU rows ------------------------------------------------------------------------------

def test_bench_gpu_rows_run_on_the_stub(stub_path, tmp_path):
    """Every GPU row's code path runs (tiny sizes, no timing claims): the local rows are measured,
    the transfer rows measured or skipped naming the plane that is missing."""
    path = tmp_path / "gpu.json"
    env = {**_env(stub_path, "cpu"), "LLM_DATADIST_ACL_LIBRARY": str(tmp_path / "no-acl.so")}  # the stub as cuda
    out = run("bench", *TINY_GPU, "--json", str(path), env=env, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "GPU rows: the cuda runtime" in out.stdout and "GB/s" in out.stdout and "target" in out.stdout
    gpu = json.loads(path.read_text())["gpu"]
    assert gpu["runtime"] == "cuda" and json.loads(path.read_text())["results"] == []
    rows = {(row["operation"], row["block"]): row for row in gpu["results"]}
    latency = (_device_workload.LATENCY_NAME, "4KiB")
    assert set(rows) == {(c.name, size) for c in _device_workload.COMPARISONS for size in ("4KiB", "16KiB")} | {latency}
    for (operation, block), row in rows.items():
        if "skipped" in row:
            assert row["skipped"] and operation.split()[0] in row["skipped"], row
            continue
        if row.get("latency"):
            # each call timed alone: at least LATENCY_CALLS of each, p99 at or above the median
            assert row["bytes_per_call"] == 4096 and row["target"] is None
            assert len(row["durations_ns"]) >= _device_workload.LATENCY_CALLS <= len(row["baseline_durations_ns"])
            assert row["p99_ns"] >= row["median_ns"] > 0 and row["baseline_p99_ns"] >= row["baseline_median_ns"] > 0
            assert f"{operation:16} median " in out.stdout and " p99 " in out.stdout
            continue
        assert row["gbps"] > 0 and row["baseline_gbps"] > 0 and row["ratio"] > 0
        assert row["bytes_per_call"] == 64 << 10
        assert f"{block:>7} {operation:16}" in out.stdout
    for name in ("copy_blocks D2D", "swap_blocks D2H", "swap_blocks H2D"):
        assert "skipped" not in rows[(name, "16KiB")]
    for plane in (_device_workload.IPC_PLANE, _device_workload.STAGING_PLANE):
        measured = "skipped" not in rows[(f"{plane} push", "16KiB")]
        assert measured == (plane not in gpu["notes"]), gpu["notes"]
    assert ("skipped" not in rows[latency]) == (_device_workload.IPC_PLANE not in gpu["notes"])
    # Targets as the issue states them: staging's only at 2 MiB blocks.
    assert rows[("copy_blocks D2D", "4KiB")]["target"] == 0.85
    assert rows[("staging push", "16KiB")]["target"] is None


def test_bench_gpu_rows_are_skipped_with_the_reason_without_a_gpu(tmp_path):
    missing = str(tmp_path / "missing.so")
    env = {"LLM_DATADIST_CUDA_LIBRARY": missing, "LLM_DATADIST_ACL_LIBRARY": missing}
    out = run("bench", "--sizes", "4KiB", "--total", "64KiB", "--min-time", "0.01", "--planes", "local",
              "--json", str(tmp_path / "b.json"), env=env)
    assert out.returncode == 0, out.stderr
    assert "GPU rows skipped: no runtime with device memory the host cannot address is usable here" in out.stdout
    assert "missing.so" in out.stdout
    assert json.loads((tmp_path / "b.json").read_text())["gpu"]["results"] == []
    assert_clean_failure(run("bench", "--gpu", "only", "--json", str(tmp_path / "c.json"), env=env),
                         "--gpu only", "no runtime")


def test_device_rows_read_device_bytes_only_through_the_library(stub_cuda):
    """``_device_workload.sample`` of a DEVICE cache copies it to the host with swap_blocks."""
    from llm_datadist import LLMConfig, LLMDataDist, LLMRole
    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    dd = LLMDataDist(LLMRole.PROMPT, 9)
    dd.init(config.generate_options())
    try:
        state = SimpleNamespace(cluster_id=9, dd=dd, cm=dd.cache_manager, caches={}, arrays={}, scratch={})
        case = _device_workload.make_case(4096, 4 * 4096)
        _device_workload._device_cache(state, case, salt=3, model_id=None)
        got = _device_workload.sample(state, "device", [5, 0])
        pattern = _device_workload._pattern(3, case.cache_blocks)
        assert np.array_equal(got[:, 0], pattern[[5, 0]]) and np.array_equal(got[:, -1], pattern[[5, 0]])
        _device_workload.drop_case(state)
    finally:
        dd.finalize()


# -- info -------------------------------------------------------------------------------------------

def test_info_shows_capabilities_and_how_device_memory_moves(stub_path):
    from llm_datadist.transport import planes
    out = run("info", "--json", env=_env(stub_path, "cuda"))
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout)
    assert facts["device_runtime"].startswith("cuda")
    assert facts["runtimes"]["cuda"] == f"available: {stub_path} loaded"
    assert facts["runtime_capabilities"]["cuda"].endswith("(reported by the loaded library)")
    assert facts["runtime_capabilities"]["cpu"] == "host_addressable"
    carriers = _demo.device_planes()
    for name in planes.names():
        assert facts["data_planes"][name].endswith(" [moves device memory]") == (name in carriers)
    if carriers:
        assert facts["device_transfers"].startswith("cuda device memory")
        for name in carriers:
            assert name in facts["device_transfers"]
    else:
        assert "no data plane that moves device memory is registered" in facts["device_transfers"]
    text = run("info", env=_env(stub_path, "cpu")).stdout
    assert "device_transfers: cpu device memory is host memory: every data plane carries it" in text


def test_percentile_is_the_nearest_rank():
    values = list(range(1, 101))  # 1..100
    assert _device_workload.percentile(values, 0.99) == 99 and _device_workload.percentile(values, 0.5) == 50
    assert _device_workload.percentile([7.0], 0.99) == 7.0
    assert _device_workload.percentile([5, 1, 3], 1.0) == 5 and _device_workload.percentile([5, 1, 3], 0.0) == 1
