"""Choosing the device runtime for ``Placement.DEVICE`` memory.

``LLM_DATADIST_DEVICE``: ``auto`` (default), ``cpu``, ``acl`` (alias ``ascend``, ``npu``) or
``cuda`` (alias ``gpu``). ``auto`` takes ``acl`` if ``libascendcl.so`` loads, else ``cuda`` if
``libcudart.so`` loads and reports a GPU, else ``cpu`` (device memory emulated in host RAM).
``LLM_DATADIST_ACL_LIBRARY`` / ``LLM_DATADIST_CUDA_LIBRARY`` override the library paths.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Dict, Tuple

from llm_datadist import _core
from llm_datadist._validate import param_invalid
from llm_datadist.status import LLMException, LLMStatusCode

logger = logging.getLogger("llm_datadist")

_ALIASES = {"auto": "auto", "": "auto", "cpu": "cpu", "acl": "acl", "ascend": "acl", "npu": "acl",
            "cuda": "cuda", "gpu": "cuda"}
_LIBRARY_ENV = {"acl": "LLM_DATADIST_ACL_LIBRARY", "cuda": "LLM_DATADIST_CUDA_LIBRARY"}
_lock = threading.Lock()
_chosen: Dict[tuple, Tuple[object, str]] = {}


def _library(name: str):
    return os.environ.get(_LIBRARY_ENV[name]) or None


def probe(name: str) -> Tuple[bool, str]:
    """Whether runtime ``name`` can be used here, and why (or why not)."""
    if name == "cpu":
        return True, "always available (device memory emulated in host RAM)"
    try:
        runtime = _core.load_runtime(name, _library(name))
    except LLMException as exc:
        return False, str(exc).split(" (status_code")[0]
    if name == "cuda" and runtime.device_count() <= 0:
        return False, f"{runtime.library} loaded but reports no GPU"
    return True, f"{runtime.library} loaded"


def select_runtime():
    """``(runtime, reason)`` for this process's configuration; logged once per configuration."""
    requested = os.environ.get("LLM_DATADIST_DEVICE", "auto").strip().lower()
    if requested not in _ALIASES:
        raise param_invalid(f"LLM_DATADIST_DEVICE={requested!r} is not one of auto, cpu, acl, cuda")
    name = _ALIASES[requested]
    key = (name, _library("acl"), _library("cuda"))
    with _lock:
        if key in _chosen:
            return _chosen[key]
        if name == "auto":
            for candidate in ("acl", "cuda", "cpu"):
                usable, why = probe(candidate)
                if usable:
                    name, reason = candidate, f"auto-detected: {why}"
                    break
        else:
            usable, why = probe(name)
            if not usable:
                raise LLMException(f"LLM_DATADIST_DEVICE={requested} but the runtime is not usable: {why}",
                                   status_code=LLMStatusCode.LLM_FAILED)
            reason = f"LLM_DATADIST_DEVICE={requested}: {why}"
        runtime = _core.load_runtime(name, _library(name) if name in _LIBRARY_ENV else None)
        logger.info("llm_datadist device runtime: %s (%s)", name, reason)
        _chosen[key] = (runtime, reason)
        return runtime, reason
