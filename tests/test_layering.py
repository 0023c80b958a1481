"""Layers call downward only (design §2): every module of the package belongs to one layer, and
each layer imports only the layers below it.

Read from the sources of every ``.py``, ``.pyx``, ``.pxd`` and ``.pxi`` file under the package,
recursively (every import, lazy ones and ``cimport`` included). The rules, in ``RULES``:

* the face (both API styles, values, ``testing``) never imports ``transport``, ``runtimes`` or the
  Cython modules; the C++ style and the Python style are siblings and never import each other;
* ``engine/`` never imports the face, ``cli/`` or ``integrations/``;
* ``transport/`` never imports ``engine/`` (it sees the engine as an ``EngineView``);
* ``runtimes/`` imports only the core and the base helpers;
* ``cli/`` and ``integrations/`` use the face, ``cpp``, ``testing``, the engine seam
  (``LLMDataDist.engine``, an attribute: no import) and the public names of the plane and runtime
  registries (``llm_datadist.transport.planes``, ``llm_datadist.runtimes``) and of the table of
  byte budgets (``llm_datadist.transport.budgets``, which ``info`` lists) and of the secret rules
  (``llm_datadist.transport.auth``); the CLI's baselines
  reach the core through ``cli/lowlevel.py`` alone;
* nothing outside the API modules touches a private ``._engine``;
* ``_reference`` (the tests' oracle) imports nothing of the package and nothing imports it.

A module in no layer fails. The checker is a function of (module -> source); the tests at the
end feed it one forbidden import per rule and expect it to say so.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Dict, FrozenSet, List, Optional, Set, Tuple

import pytest

import llm_datadist

PACKAGE = Path(llm_datadist.__file__).parent
ROOT = "llm_datadist"

PYTHON_STYLE = {"llm_datadist.llm_datadist", "llm_datadist.cache_manager", "llm_datadist.llm_types",
                "llm_datadist.configs"}
# CANN's module paths llm_datadist.v2.*: the Python style again, under CANN's names.
PYTHON_STYLE |= {f"llm_datadist.v2.{name}" for name in ("llm_types", "cache_manager", "llm_datadist", "config",
                                                        "llm_utils")}
CPP_STYLE = {"llm_datadist.cpp"}

#: Modules at the package root, by layer; a folder's modules are in the folder's layer (FOLDERS).
ROOT_MODULES = {
    "face": {"llm_datadist", "llm_datadist.testing"} | PYTHON_STYLE | CPP_STYLE,
    "base": {"llm_datadist.status", "llm_datadist._status_codes", "llm_datadist.data_type",
             "llm_datadist._validate", "llm_datadist._memory", "llm_datadist._build_info"},
    "core": {"llm_datadist._core", "llm_datadist._io", "llm_datadist._os", "llm_datadist._runtime",
             "llm_datadist._status"},
    "cli": {"llm_datadist.__main__"},
    "oracle": {"llm_datadist._reference"},
}
FOLDERS = {
    "llm_datadist.engine": "engine",
    "llm_datadist.runtimes": "runtimes",
    "llm_datadist.transport": "transport",
    "llm_datadist.cli": "cli",
    "llm_datadist.integrations": "integrations",
    "llm_datadist.v2": "face",  # CANN's llm_datadist.v2 module paths (re-exports of the Python style)
}

#: What each layer may import besides itself.
RULES = {
    "base": {"core"},
    "core": {"base"},
    "runtimes": {"core", "base"},
    "transport": {"runtimes", "core", "base"},
    "engine": {"transport", "runtimes", "core", "base"},
    "face": {"engine", "base"},
    "cli": {"face", "base"},
    "integrations": {"face", "base"},
    "oracle": set(),
}
#: Registries (and the table of byte budgets, which ``info`` lists, and the rules a link secret
#: must meet, ``auth.read_secret_file`` / ``secret_refusal``, which the two-host CLI and the vLLM
#: options apply to theirs) the CLI and the integrations may use: their public names only.
REGISTRIES = {"llm_datadist.transport.planes", "llm_datadist.runtimes", "llm_datadist.transport.budgets",
              "llm_datadist.transport.auth"}
#: The one CLI module through which the CLI's baselines and ``info`` reach the core.
CLI_CORE_DOOR = "llm_datadist.cli.lowlevel"
#: Named exceptions, each with its reason.
ALLOWED = {
    # The package's __init__ imports the compiled core first, to give one clear error in a source
    # tree whose extensions were never built (instead of a failure deep in another import).
    ("llm_datadist", "llm_datadist._core"): "clear error for an unbuilt source tree",
    # The core compiles in each runtime's C bindings (runtimes/_rt_*.pxi include their .pxd).
    ("llm_datadist._core", "llm_datadist.runtimes._acl"): "runtime bindings compiled into the core",
    ("llm_datadist._core", "llm_datadist.runtimes._cuda"): "runtime bindings compiled into the core",
    ("llm_datadist._core", "llm_datadist.runtimes._copy_kernel"): "runtime bindings compiled into the core",
    ("llm_datadist._core", "llm_datadist.runtimes._rt_acl"): "runtime bindings compiled into the core",
    ("llm_datadist._core", "llm_datadist.runtimes._rt_cuda"): "runtime bindings compiled into the core",
}

_CYTHON_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+c?import\s+(.+)|c?import\s+([\w., ]+))", re.M)
_INCLUDE = re.compile(r'^\s*include\s+"([^"]+)"', re.M)


def module_name(path: Path) -> str:
    """``llm_datadist.x.y`` for ``PACKAGE/x/y.py`` (``.pyx``/``.pxd``/``.pxi`` alike);
    a package's ``__init__`` is the package."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([ROOT, *parts])


def package_sources() -> Dict[str, Tuple[Path, str]]:
    """Every source file of the package, by module name (a ``.pyx`` and its ``.pxd``/``.pyi``
    count as one module: all their imports are the module's)."""
    sources: Dict[str, Tuple[Path, str]] = {}
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix not in (".py", ".pyx", ".pxd", ".pxi") or "__pycache__" in path.parts:
            continue
        name = module_name(path)
        if name in sources:
            previous_path, previous = sources[name]
            sources[name] = (previous_path, previous + "\n" + path.read_text())
        else:
            sources[name] = (path, path.read_text())
    return sources


def _resolve_relative(module: str, is_package: bool, level: int, target: Optional[str]) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def imports_of(module: str, source: str, suffix: str = ".py", is_package: bool = False) -> Set[str]:
    """Every ``llm_datadist`` name ``source`` imports (``from llm_datadist import x`` counts as
    importing ``llm_datadist.x``), at any depth; Cython ``cimport`` and ``include`` too."""
    return set(_imports_of(module, source, suffix, is_package))


@functools.lru_cache(maxsize=None)
def _imports_of(module: str, source: str, suffix: str, is_package: bool) -> FrozenSet[str]:
    """``imports_of``, parsed once per source: every case below checks the whole package again,
    and only the module it changes is new."""
    names: Set[str] = set()
    if suffix == ".py":
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module if node.level == 0 else _resolve_relative(module, is_package, node.level,
                                                                             node.module)
                names.update(f"{base}.{alias.name}" for alias in node.names)
    else:
        for match in _CYTHON_IMPORT.finditer(source):
            if match.group(1):
                targets = match.group(2).replace("(", " ").replace(")", " ").split(",")
                names.update(f"{match.group(1)}.{t.split()[0]}" for t in targets if t.split())
            else:
                names.update(t.split()[0] for t in match.group(3).split(",") if t.split())
        for match in _INCLUDE.finditer(source):
            names.add(f"{ROOT}." + match.group(1).rsplit(".", 1)[0].replace("/", "."))
    return frozenset(n for n in names if n == ROOT or n.startswith(ROOT + "."))


def layer_of(module: str) -> Optional[str]:
    for layer, members in ROOT_MODULES.items():
        if module in members:
            return layer
    for folder, layer in FOLDERS.items():
        if module == folder or module.startswith(folder + "."):
            return layer
    return None


def target_module(name: str, modules: Set[str]) -> str:
    """The module an imported name lives in: the longest known module that is a prefix of it
    (``llm_datadist.BlocksCacheKey`` -> ``llm_datadist``)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return ROOT


def violations(sources: Dict[str, Tuple[str, str]]) -> List[str]:
    """The broken rules of a package given as {module: (file suffix, source)}; [] if none."""
    found: List[str] = []
    modules = set(sources)
    for module, (suffix, source) in sorted(sources.items()):
        layer = layer_of(module)
        if layer is None:
            found.append(f"{module} belongs to no layer (add it to the layer table of tests/test_layering.py)")
            continue
        if layer not in ("face",) and re.search(r"\._engine\b", source):
            found.append(f"{module} ({layer}) touches a private ._engine: use the seam LLMDataDist.engine")
        is_package = sources[module][0] == "package"
        for name in sorted(imports_of(module, source, ".py" if suffix in (".py", "package") else suffix,
                                      is_package)):
            target = target_module(name, modules)
            target_layer = layer_of(target)
            if target == module or (module, target) in ALLOWED:
                continue
            if target_layer == "oracle":
                found.append(f"{module} imports the test oracle {target}")
                continue
            if layer in ("cli", "integrations"):
                if target in REGISTRIES or (target_layer in ("runtimes", "transport") and name in REGISTRIES):
                    leaf = name[len(target) + 1:] if name != target else ""
                    if leaf.startswith("_"):
                        found.append(f"{module} ({layer}) uses the private {name} of a registry")
                    continue
                if target_layer == "core" and module == CLI_CORE_DOOR:
                    continue
            if target_layer == layer:
                if layer == "face" and ((module in CPP_STYLE and target in PYTHON_STYLE)
                                        or (module in PYTHON_STYLE and target in CPP_STYLE)):
                    found.append(f"{module} imports its sibling API style {target}")
                continue
            if target_layer not in RULES[layer]:
                found.append(f"{module} ({layer}) imports {name} ({target_layer})")
    return found


def real_sources() -> Dict[str, Tuple[str, str]]:
    out = {}
    for name, (path, text) in package_sources().items():
        suffix = "package" if path.name == "__init__.py" else path.suffix
        out[name] = (suffix, text)
    return out


def test_every_module_is_in_a_layer_and_every_layer_imports_only_downward():
    sources = real_sources()
    assert {"llm_datadist.engine.engine", "llm_datadist.cli.main", "llm_datadist.transport.planes.cma",
            "llm_datadist._core", "llm_datadist._io", "llm_datadist.runtimes.cuda"} <= set(sources)
    assert violations(sources) == []


def test_the_import_reader_sees_lazy_relative_and_cython_imports():
    source = "def f():\n    from . import engine\n    from llm_datadist.transport import links\n"
    assert {"llm_datadist.engine", "llm_datadist.transport.links"} <= imports_of("llm_datadist.cpp", source)
    pyx = 'from llm_datadist._core cimport (CacheLayout,\n    CopyPlan)\ninclude "runtimes/_rt_cuda.pxi"\n'
    assert {"llm_datadist._core.CacheLayout", "llm_datadist.runtimes._rt_cuda"} <= \
        imports_of("llm_datadist._io", pyx, ".pyx")


def with_module(module: str, source: str, suffix: str = ".py") -> Dict[str, Tuple[str, str]]:
    sources = real_sources()
    sources[module] = (suffix, source)
    return sources


FORBIDDEN = [
    ("llm_datadist.cache_manager", "from llm_datadist.transport import links", "imports llm_datadist.transport"),
    ("llm_datadist.cpp", "def f():\n    from llm_datadist import runtimes", "imports llm_datadist.runtimes"),
    ("llm_datadist.llm_types", "from llm_datadist import _io", "imports llm_datadist._io"),
    ("llm_datadist.testing", "import llm_datadist._core", "imports llm_datadist._core"),
    ("llm_datadist.cpp", "from llm_datadist import cache_manager", "sibling API style"),
    ("llm_datadist.configs", "from llm_datadist.cpp import LlmDataDist", "sibling API style"),
    ("llm_datadist.v2.llm_types", "from llm_datadist.cpp import CacheDesc", "sibling API style"),
    ("llm_datadist.v2.llm_utils", "from llm_datadist.transport import wire", "imports llm_datadist.transport"),
    ("llm_datadist.engine.engine", "from llm_datadist import LLMDataDist", "imports llm_datadist.LLMDataDist"),
    ("llm_datadist.engine.engine", "from llm_datadist.cli import demo", "imports llm_datadist.cli.demo"),
    ("llm_datadist.transport.links", "from llm_datadist.engine import engine", "imports llm_datadist.engine"),
    ("llm_datadist.transport.planes.cma", "from ...engine import engine", "imports llm_datadist.engine"),
    ("llm_datadist.runtimes.cuda", "from llm_datadist.transport import wire", "imports llm_datadist.transport"),
    ("llm_datadist.runtimes.cpu", "from llm_datadist.engine import engine", "imports llm_datadist.engine"),
    ("llm_datadist.cli.demo", "from llm_datadist.transport import links", "imports llm_datadist.transport.links"),
    ("llm_datadist.cli.demo", "from llm_datadist import _core", "imports llm_datadist._core"),
    ("llm_datadist.cli.demo", "from llm_datadist.engine.engine import Engine", "imports llm_datadist.engine"),
    ("llm_datadist.cli.demo", "from llm_datadist.runtimes import _REGISTRY", "private"),
    ("llm_datadist.cli.info", "from llm_datadist.transport.budgets import _process_budget", "private"),
    ("llm_datadist.cli.info", "from llm_datadist.transport import table", "imports llm_datadist.transport.table"),
    ("llm_datadist.integrations.vllm", "from llm_datadist.runtimes import cuda", "imports llm_datadist.runtimes.cuda"),
    ("llm_datadist.integrations.vllm", "x = dd._engine.runtime", "private ._engine"),
    ("llm_datadist.cli.bench", "x = state.dd._engine", "private ._engine"),
    ("llm_datadist.status", "from llm_datadist import runtimes", "imports llm_datadist.runtimes"),
    ("llm_datadist._io", "from llm_datadist.transport cimport wire", "imports llm_datadist.transport"),
    ("llm_datadist.engine.engine", "from llm_datadist import _reference", "test oracle"),
    ("llm_datadist._reference", "from llm_datadist import status", "imports llm_datadist.status"),
    ("llm_datadist.brand_new", "x = 1", "belongs to no layer"),
    ("llm_datadist.extras.thing", "x = 1", "belongs to no layer"),
]


@pytest.mark.parametrize("module, source, says", FORBIDDEN, ids=[f"{m}:{s[:40]}" for m, s, _ in FORBIDDEN])
def test_a_forbidden_import_is_reported(module, source, says):
    suffix = ".pyx" if module == "llm_datadist._io" else ".py"
    found = violations(with_module(module, source, suffix))
    assert any(says in line for line in found), found


@pytest.mark.parametrize("module, source", [
    ("llm_datadist.cli.lowlevel", "from llm_datadist._core import memcpy_baseline"),
    ("llm_datadist.cli.demo", "from llm_datadist.transport.planes import choices"),
    ("llm_datadist.cli.demo", "from llm_datadist.transport import planes"),
    ("llm_datadist.cli.info", "from llm_datadist.transport import budgets\nx = budgets.in_force()"),
    ("llm_datadist.integrations.vllm", "from llm_datadist import runtimes\nx = dd.engine.runtime"),
    ("llm_datadist.engine.engine", "from llm_datadist.transport.links import LinkManager"),
    ("llm_datadist.cpp", "from llm_datadist.engine import engine as _engine\nself._engine = 1"),
])
def test_an_allowed_import_is_not_reported(module, source):
    assert violations(with_module(module, source)) == []
