"""``cuda`` (alias ``gpu``): NVIDIA GPUs through the CUDA runtime library, opened with dlopen;
usable when it reports a GPU.

Which library: ``LLM_DATADIST_CUDA_LIBRARY`` if set (that file only), else the first of these
that loads (``find_libraries``):

1. a ``libcudart.so*`` this process has already loaded (torch's CUDA build loads one on import):
   the same copy, so one runtime state per process;
2. the copy NVIDIA's pip wheels put under ``site-packages`` — ``nvidia/cu13/lib/libcudart.so.13``
   (``nvidia-cuda-runtime``, CUDA 13) and ``nvidia/cuda_runtime/lib/libcudart.so.12``
   (``nvidia-cuda-runtime-cu12``) — which torch's wheels depend on; they ship no ``libcudart.so``;
3. ``libcudart.so.13``, ``libcudart.so.12`` and ``libcudart.so`` through the dynamic loader's
   search path (``LD_LIBRARY_PATH``, the ``ld.so`` cache: a CUDA toolkit).

``python -m llm_datadist info`` says which file was loaded and how it was found.

Copies are queued on one stream per device (the copy kernel, ``cudaMemcpyBatchAsync`` or
``cudaMemcpyAsync``, see ``_rt_cuda.pxi``) and waited for; ``cudaMalloc`` memory can be exported to
other processes with CUDA IPC. Torch ``cuda`` tensors hold its memory."""

import glob
import os
import re
import sys
from typing import List, Optional, Tuple

from llm_datadist.runtimes.spec import RuntimeSpec

#: Where NVIDIA's pip wheels put the runtime library, under a ``sys.path`` entry (newest CUDA first).
WHEEL_DIRS = ("nvidia/cu13/lib", "nvidia/cuda_runtime/lib")
#: Names the dynamic loader is asked for: the sonames of the CUDA releases this binding knows
#: (newest first), then the toolkit's development link.
SONAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")
_CUDART = re.compile(r"libcudart\.so(\.\d+)*$")


def loaded_copies(maps: str = "/proc/self/maps") -> List[str]:
    """The ``libcudart.so*`` files mapped into this process, in the order they appear."""
    found: List[str] = []
    try:
        with open(maps) as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith("/") and _CUDART.match(os.path.basename(path)) and path not in found:
                    found.append(path)
    except OSError:  # no /proc: nothing to reuse
        pass
    return found


def find_libraries() -> Tuple[Tuple[str, str], ...]:
    """``(library, where it comes from)`` in the order the module docstring gives."""
    found = [(path, "already loaded in this process") for path in loaded_copies()]
    for entry in sys.path:
        for sub in WHEEL_DIRS:
            for path in sorted(glob.glob(os.path.join(entry or ".", sub, "libcudart.so.*")), reverse=True):
                if _CUDART.match(os.path.basename(path)):
                    found.append((os.path.abspath(path), "pip wheel under " + (entry or ".")))
    found += [(name, "the dynamic loader's search path") for name in SONAMES]
    seen, unique = set(), []
    for path, origin in found:
        if path not in seen:
            seen.add(path)
            unique.append((path, origin))
    return tuple(unique)


def _has_a_gpu(runtime) -> Optional[str]:
    return None if runtime.device_count() > 0 else f"{runtime.library} loaded but reports no GPU"


SPEC = RuntimeSpec(
    name="cuda",
    binding="cuda",
    description="NVIDIA GPU through libcudart",
    aliases=("gpu",),
    library="libcudart.so",
    library_env="LLM_DATADIST_CUDA_LIBRARY",
    capabilities=frozenset({"async_copy", "batched_copy", "ipc"}),
    auto_priority=20,
    usable=_has_a_gpu,
    tensor_devices=("cuda",),
    search=find_libraries,
)
