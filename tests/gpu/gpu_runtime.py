"""Which cuda runtime the tests in ``tests/gpu/`` run on, or why they skip.

A real GPU: the cuda runtime the package finds (``libcudart.so``, or ``LLM_DATADIST_CUDA_LIBRARY``)
loads and reports a GPU. A stub library (``tests/core/stub_runtime.c``) is refused, so that a run
with the stub never reads as a GPU run, unless ``LLM_DATADIST_GPU_TESTS_STUB=1`` asks for it:
``tools/gpu_check.py --stub`` sets it, so that these tests, the check's script and its report are
proven on every CI run. On the stub the tests prove themselves, not a GPU.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

#: Run the GPU tests against the stub library named by LLM_DATADIST_CUDA_LIBRARY.
STUB_ENV = "LLM_DATADIST_GPU_TESTS_STUB"


def on_stub() -> bool:
    """Whether the tests were asked to run against the stub library."""
    return os.environ.get(STUB_ENV) == "1"


def cuda_runtime() -> Tuple[Optional[object], str]:
    """``(loaded cuda runtime, "")``, or ``(None, why the GPU tests skip)``."""
    from llm_datadist import runtimes
    library = os.environ.get("LLM_DATADIST_CUDA_LIBRARY", "")
    if on_stub():
        if not library:
            return None, f"{STUB_ENV}=1 but LLM_DATADIST_CUDA_LIBRARY names no stub library"
    elif "stub" in os.path.basename(library):
        return None, (f"LLM_DATADIST_CUDA_LIBRARY={library} is a stub, not a GPU runtime ({STUB_ENV}=1 runs "
                      f"these tests against it: tools/gpu_check.py --stub)")
    usable, why = runtimes.probe("cuda")
    if not usable:
        return None, f"no usable cuda runtime here: {why}"
    return runtimes.load("cuda"), ""
