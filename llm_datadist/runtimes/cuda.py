"""``cuda`` (alias ``gpu``): NVIDIA GPUs through the CUDA runtime, ``libcudart.so`` opened with
dlopen (``LLM_DATADIST_CUDA_LIBRARY`` overrides the path); usable when it reports a GPU.

Copies are queued on one stream per device (the copy kernel, ``cudaMemcpyBatchAsync`` or
``cudaMemcpyAsync``, see ``_rt_cuda.pxi``) and waited for; ``cudaMalloc`` memory can be exported to
other processes with CUDA IPC. Torch ``cuda`` tensors hold its memory."""

from typing import Optional

from llm_datadist.runtimes import RuntimeSpec, register


def _has_a_gpu(runtime) -> Optional[str]:
    return None if runtime.device_count() > 0 else f"{runtime.library} loaded but reports no GPU"


SPEC = register(RuntimeSpec(
    name="cuda",
    binding="cuda",
    description="NVIDIA GPU through libcudart.so",
    aliases=("gpu",),
    library="libcudart.so",
    library_env="LLM_DATADIST_CUDA_LIBRARY",
    capabilities=frozenset({"async_copy", "batched_copy", "ipc"}),
    auto_priority=20,
    usable=_has_a_gpu,
    tensor_devices=("cuda",),
))
