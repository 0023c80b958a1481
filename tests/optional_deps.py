"""The suite's optional dependencies, which the ``test`` extra does not install.

A test that needs one skips without it, saying what to install; where the run must have it
(``.ci/run`` installs every one and sets ``LLM_DATADIST_REQUIRE_<NAME>=1``), its absence fails
the test instead, so that a broken install cannot pass as a green run of skips.

    torch       LLM_DATADIST_REQUIRE_TORCH        torch tensors as caches (the CPU build will do)
    matplotlib  LLM_DATADIST_REQUIRE_MATPLOTLIB   ``bench --plot`` (the plot extra)
    nixl        LLM_DATADIST_REQUIRE_NIXL         the nixl data plane
    vllm        LLM_DATADIST_REQUIRE_VLLM         the vLLM connector (tests/integrations/conftest.py
                                                  fails every skip of that folder)

Everything else a test imports is in the ``test`` extra (pyproject.toml), or comes with one of
these (vLLM brings transformers, safetensors, httpx...).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

INSTALL = {
    "torch": "pip install torch (the CPU build: --index-url https://download.pytorch.org/whl/cpu)",
    "matplotlib": "pip install '.[plot]'",
    "nixl": "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1",
    "vllm": "pip install '.[vllm]'",
}


def require_env(name: str) -> str:
    """The variable that makes ``name`` required: ``LLM_DATADIST_REQUIRE_TORCH`` for torch."""
    return f"LLM_DATADIST_REQUIRE_{name.upper()}"


def required(name: str) -> bool:
    return os.environ.get(require_env(name)) == "1"


def skip_without(name: str, why: str) -> None:
    """Skip the test for ``why`` (``name`` is missing), or fail it where ``name`` is required."""
    if required(name):
        pytest.fail(f"{why}, and {require_env(name)}=1: this run must have it")
    pytest.skip(why)


def importorskip(name: str) -> ModuleType:
    """``pytest.importorskip(name)``, except that where ``name`` is required a missing module fails."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        skip_without(name, f"{name} cannot be imported ({exc}; {INSTALL[name]})")
