"""Suite-wide defaults.

The device runtime behind ``Placement.DEVICE`` is ``cpu`` (device memory emulated in host RAM)
unless a test, or the person running the suite, chooses another. Most tests register numpy memory
as DEVICE caches, read caches back as numpy views and move them between processes, which needs a
host-addressable runtime; on a machine with a GPU or NPU, ``auto`` would pick the accelerator and
those tests would be testing something else. Tests of the accelerator runtimes set
``LLM_DATADIST_DEVICE`` themselves (``tests/core/test_runtimes.py``). It is set here, at import,
so that the cluster processes the tests start inherit it.
"""

import os

os.environ.setdefault("LLM_DATADIST_DEVICE", "cpu")

# The stub ACL/CUDA runtime (tests/runtime_stub.py) for every test that needs a device runtime
# which is not host-addressable without an accelerator.
from runtime_stub import make_stub, stub, stub_libraries  # noqa: E402,F401
