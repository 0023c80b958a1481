"""Layers call downward only (design §2): API styles -> engine -> transport/runtimes -> core.

Read from the sources (every import, lazy ones included): the API styles import neither the core
nor the transport, nor each other (the C++ style and the Python style are siblings); the engine
imports no module of either API style; the transport never imports the engine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import llm_datadist

PACKAGE = Path(llm_datadist.__file__).parent
PYTHON_STYLE = ["llm_datadist", "cache_manager", "llm_types", "configs"]
API_STYLES = PYTHON_STYLE + ["cpp"]


def imported(module: str) -> set:
    """Every ``llm_datadist`` module ``module`` imports (``from llm_datadist import x`` counts
    as importing ``llm_datadist.x``), at any depth of the file."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.startswith("llm_datadist.")}


@pytest.mark.parametrize("module", API_STYLES)
def test_api_styles_reach_neither_the_core_nor_the_transport(module):
    below = {n for n in imported(module) if n in ("llm_datadist._core", "llm_datadist._planes")
             or n.startswith("llm_datadist.transport")}
    assert not below, f"{module} imports {sorted(below)}"


def test_the_cpp_style_does_not_import_the_python_style():
    assert not {f"llm_datadist.{m}" for m in PYTHON_STYLE} & imported("cpp")


def test_the_engine_imports_no_api_style():
    assert not {f"llm_datadist.{m}" for m in API_STYLES} & imported("_engine")


@pytest.mark.parametrize("path", sorted((PACKAGE / "transport").glob("*.py")), ids=lambda p: p.name)
def test_the_transport_does_not_import_the_engine(path):
    module = f"transport/{path.stem}"
    assert not {"llm_datadist._engine"} & imported(module)


@pytest.mark.parametrize("module", ["cpp", "llm_datadist", "cache_manager", "_demo", "integrations/vllm"])
def test_no_caller_reaches_past_the_engine_into_its_links(module):
    source = (PACKAGE / f"{module}.py").read_text()
    assert "_engine.links" not in source
