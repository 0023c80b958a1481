"""The type stubs shipped beside the compiled modules (``_core.pyi``, ``_io.pyi``) name exactly
what each module exports: every public name of the module is in its stub and every name of the
stub is in the module, and so for the public attributes and methods of each class."""

from __future__ import annotations

import ast
import inspect
import types
from pathlib import Path
from typing import Dict, Set

import pytest

from llm_datadist import _core, _io

MODULES = [_core, _io]


def _stub_names(body) -> Set[str]:
    """The names a stub's module or class body defines (imports left out)."""
    names: Set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
    return names


def _stub(module: types.ModuleType) -> ast.Module:
    return ast.parse(Path(module.__file__).with_name(module.__name__.rsplit(".", 1)[1] + ".pyi").read_text())


def _public(names) -> Set[str]:
    return {name for name in names if not name.startswith("_")}


def _exported(module: types.ModuleType) -> Set[str]:
    """The module's public names less the modules and the classes and functions it imported."""
    out = set()
    for name in _public(dir(module)):
        value = getattr(module, name)
        if isinstance(value, types.ModuleType):
            continue
        imported = getattr(value, "__module__", None) != module.__name__
        if (inspect.isclass(value) or inspect.isroutine(value)) and imported:
            continue
        out.add(name)
    return out


def _stub_classes(module: types.ModuleType) -> Dict[str, ast.ClassDef]:
    return {node.name: node for node in _stub(module).body if isinstance(node, ast.ClassDef)}


@pytest.mark.parametrize("module", MODULES, ids=[m.__name__ for m in MODULES])
def test_the_stub_names_every_public_name_of_its_module_and_nothing_else(module):
    stub = _public(_stub_names(_stub(module).body))
    exported = _exported(module)
    assert sorted(exported - stub) == [], "exported but missing from the stub"
    assert sorted(stub - exported) == [], "in the stub but not exported"


@pytest.mark.parametrize("module", MODULES, ids=[m.__name__ for m in MODULES])
def test_the_stub_names_every_public_member_of_each_class(module):
    for name, node in _stub_classes(module).items():
        cls = getattr(module, name)
        stub = _public(_stub_names(node.body))
        own = _public(vars(cls))
        assert sorted(own - stub) == [], f"{name}: members missing from the stub"
        assert sorted(stub - own) == [], f"{name}: stub members the class does not define"


def test_the_stubs_ship_with_the_package():
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert '"*.pyi"' in pyproject
    for module in MODULES:
        assert Path(module.__file__).with_name(module.__name__.rsplit(".", 1)[1] + ".pyi").is_file()
