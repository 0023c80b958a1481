"""Shared setup of the local-transfer benchmarks in ``bench/``.

The benchmarks are opt-in. ``pyproject.toml`` sets ``testpaths = ["tests"]``, so a bare ``pytest``
never reaches this directory; for wider invocations (``pytest .``) the ``pytest_ignore_collect``
hook below keeps the bench files out unless the run asks for them, by naming a path inside
``bench/`` or by passing ``--benchmark-only``::

    python -m pytest bench/ --benchmark-only -q
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent

# The package is used from the checkout (the Cython core is built in place); make it importable
# when pytest is started as a script rather than with ``python -m pytest`` from the root.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# DEVICE caches must be host-addressable: the C-loop baseline memcpys the plan's device addresses
# from the host and the numpy baseline and the data checks read them. Pin the ``cpu`` runtime
# (device memory emulated in host RAM) even on a machine where ``auto`` would pick acl or cuda.
os.environ["LLM_DATADIST_DEVICE"] = "cpu"

# Pool sizes: the largest case allocates 128 tensors x 4 blocks x 2 MiB = 1 GiB of DEVICE memory
# (cases run one after the other and each frees its caches). The HOST side of swap_blocks is a
# ``Cache.create_cpu_cache`` over a numpy array, which does not draw from the host pool.
DEVICE_POOL_BYTES = 2 << 30
HOST_POOL_BYTES = 1 << 30


def _asked_for(config: pytest.Config) -> bool:
    """True when this run explicitly wants the benchmarks."""
    if config.getoption("benchmark_only", default=False):
        return True
    invocation_dir = Path(config.invocation_params.dir)
    for arg in config.args:
        path = (invocation_dir / arg.split("::", 1)[0]).resolve()
        if path == BENCH_DIR or BENCH_DIR in path.parents:
            return True
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config):
    if collection_path.name.startswith("test_") and not _asked_for(config):
        return True
    return None


@pytest.fixture(scope="session")
def datadist():
    """The one ``LLMDataDist`` of the process (PROMPT role, cluster 1, cache manager on)."""
    from llm_datadist import LLMConfig, LLMDataDist, LLMRole

    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.mem_pool_cfg = json.dumps({"memory_size": DEVICE_POOL_BYTES})
    config.host_mem_pool_cfg = json.dumps({"memory_size": HOST_POOL_BYTES})
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init(config.generate_options())
    try:
        yield dd
    finally:
        dd.finalize()
