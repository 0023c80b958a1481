"""The command line's one door to the Cython core (the layering test allows no other CLI module
to import it): what the in-run baselines need (``memcpy_baseline`` over descriptors planned with
``plan_blocks`` from ``CacheLayout``\\ s, runtime allocations and copy kinds for the GPU rows)
and the build facts ``info`` prints. Everything else of the CLI goes through the public face,
``testing``, the engine seam and the plane and runtime registries."""

from llm_datadist._core import (  # noqa: F401  (re-exported for the CLI)
    CAPABILITIES,
    CYTHON_VERSION,
    DEBUG_BUILD,
    MEMCPY_DEVICE_TO_DEVICE,
    MEMCPY_DEVICE_TO_HOST,
    MEMCPY_HOST_TO_DEVICE,
    Allocation,
    CacheLayout,
    memcpy_baseline,
    plan_blocks,
)
