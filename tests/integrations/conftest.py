"""Where ``LLM_DATADIST_REQUIRE_VLLM=1`` (``.ci/run`` sets it, having installed the vllm extra), the
vLLM connector's tests must run: a missing vLLM fails the run here instead of skipping them."""

import os
from importlib.util import find_spec

if os.environ.get("LLM_DATADIST_REQUIRE_VLLM") == "1" and find_spec("vllm") is None:
    raise RuntimeError("LLM_DATADIST_REQUIRE_VLLM=1, but vLLM is not installed: the vLLM connector tests "
                       "(tests/integrations) would be skipped; pip install '.[vllm]'")
