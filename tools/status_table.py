"""The status table: ``include/llm_datadist/dd_status.h`` and the mirrors generated from it.

The header is the one place a status code is written. Two files are generated from it and kept in
git, so that readers, linters and builds without this script see them:

* ``llm_datadist/_status_codes.py``: ``STATUS_CODES``, C++ name -> value, in header order
  (``llm_datadist.status`` builds ``LLMStatusCode`` and ``CPP_STATUS_CODES`` from it, ``cpp`` its
  constants);
* ``llm_datadist/_status.pxd``: the header's Cython declaration, plus
  ``compiled_status_codes()``, the same table as the C compiler read it (``_core.C_STATUS_CODES``).

``setup.py`` calls :func:`check` and stops the build when a generated file differs from what the
header gives, or when ``status.py`` names a code the header lacks.
``python tools/status_table.py`` (``make status``) rewrites the generated files;
``python tools/status_table.py --check`` only checks. Standard library only: setup.py imports
this before anything is built.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "include" / "llm_datadist" / "dd_status.h"
PACKAGE = ROOT / "llm_datadist"
PY_MIRROR = "_status_codes.py"
PXD_MIRROR = "_status.pxd"
#: status.py's tables of C++ names (renamed in, or left out of, the Python enum); check() makes
#: sure every name in them is one of the header's.
STATUS_PY_NAME_TABLES = ("_PYTHON_NAMES", "_CPP_ONLY")

_DEFINE = re.compile(r"#define\s+DD_(LLM_\w+)\s+(0x[0-9A-Fa-f]+|[0-9]+)[uU]?")
_REGENERATE = "run `python tools/status_table.py` (make status) to regenerate it"


def read_header(header: Path = HEADER) -> List[Tuple[str, int, str]]:
    """The ``#define DD_LLM_<name> <value>u`` lines as ``(name, value, literal)``, in order.

    A ``DD_LLM_`` define this cannot read, a name or value given twice, or a value outside uint32
    is an error (ValueError), not a code silently left out.
    """
    entries: List[Tuple[str, int, str]] = []
    names, values = set(), set()
    for number, line in enumerate(Path(header).read_text().splitlines(), 1):
        text = line.strip()
        if not re.match(r"#\s*define\s+DD_LLM_", text):
            continue
        match = _DEFINE.fullmatch(text)
        if match is None:
            raise ValueError(f"{header}:{number}: cannot read the status code in {text!r}")
        name, literal = match.group(1), match.group(2)
        value = int(literal, 0)
        if name in names or value in values:
            raise ValueError(f"{header}:{number}: DD_{name} = {literal} repeats a name or a value")
        if value > 0xFFFFFFFF:
            raise ValueError(f"{header}:{number}: DD_{name} = {literal} does not fit dd_status (uint32)")
        names.add(name)
        values.add(value)
        entries.append((name, value, literal))
    if not entries:
        raise ValueError(f"{header}: no #define DD_LLM_<name> status codes found")
    return entries


def parse_header(header: Path = HEADER) -> Dict[str, int]:
    """C++ name (``DD_`` dropped) -> value, in header order."""
    return {name: value for name, value, _ in read_header(header)}


def _banner(comment: str) -> str:
    return (f"{comment} Generated from include/llm_datadist/dd_status.h by tools/status_table.py: do not edit.\n"
            f"{comment} setup.py and tests/api/test_status_table.py check it against the header.\n")


def render_py(entries: List[Tuple[str, int, str]]) -> str:
    lines = [_banner("#"), '"""The status codes of dd_status.h by C++ name (``DD_`` dropped), in header order."""\n',
             "\n", "STATUS_CODES = {\n"]
    lines += [f'    "{name}": {literal},\n' for name, _, literal in entries]
    lines.append("}\n")
    return "".join(lines)


def render_pxd(entries: List[Tuple[str, int, str]]) -> str:
    lines = [_banner("#"), "from libc.stdint cimport uint32_t\n", "\n",
             'cdef extern from "llm_datadist/dd_status.h" nogil:\n', "    ctypedef uint32_t dd_status\n"]
    lines += [f"    uint32_t DD_{name}\n" for name, _, _ in entries]
    lines += ["\n", "\n", "cdef inline dict compiled_status_codes():\n",
              '    """The codes as the C compiler read them from dd_status.h, by C++ name."""\n',
              "    return {\n"]
    lines += [f'        "{name}": DD_{name},\n' for name, _, _ in entries]
    lines.append("    }\n")
    return "".join(lines)


def generated_files(header: Path = HEADER) -> Dict[str, str]:
    """File name (in the package) -> the text the header gives it."""
    entries = read_header(header)
    return {PY_MIRROR: render_py(entries), PXD_MIRROR: render_pxd(entries)}


def _status_py_names(status_py: Path) -> Dict[str, List[str]]:
    """The C++ names in status.py's name tables (dict keys, or set/list/tuple items)."""
    found: Dict[str, List[str]] = {}
    for node in ast.parse(status_py.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if not isinstance(target, ast.Name) or target.id not in STATUS_PY_NAME_TABLES:
            continue
        value = node.value
        if isinstance(value, ast.Call) and value.args:  # frozenset({...})
            value = value.args[0]
        found[target.id] = list(ast.literal_eval(value))
    return found


def check(header: Path = HEADER, package: Path = PACKAGE) -> List[str]:
    """What disagrees with the header, one sentence each; empty when every mirror agrees."""
    try:
        expected = generated_files(header)
    except (OSError, ValueError) as exc:
        return [str(exc)]
    problems = []
    for name, text in expected.items():
        path = Path(package) / name
        if not path.is_file():
            problems.append(f"{path} is missing: {_REGENERATE}")
        elif path.read_text() != text:
            problems.append(f"{path} does not match {header}: {_REGENERATE}")
    codes = parse_header(header)
    status_py = Path(package) / "status.py"
    tables = _status_py_names(status_py) if status_py.is_file() else {}
    for table in STATUS_PY_NAME_TABLES:
        if table not in tables:
            problems.append(f"{status_py} has no {table} table")
            continue
        for unknown in sorted(set(tables[table]) - set(codes)):
            problems.append(f"{status_py}: {table} names {unknown}, which {header} does not define")
    return problems


def write(header: Path = HEADER, package: Path = PACKAGE) -> List[Path]:
    """Rewrite the generated files that differ from what the header gives; return those written."""
    written = []
    for name, text in generated_files(header).items():
        path = Path(package) / name
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            written.append(path)
    return written


def main(argv: List[str]) -> int:
    if argv[1:] == ["--check"]:
        problems = check()
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    if argv[1:]:
        print(f"usage: {argv[0]} [--check]", file=sys.stderr)
        return 2
    for path in write():
        print(f"wrote {path}")
    problems = check()  # status.py's name tables are checked, not generated
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
