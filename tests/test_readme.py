"""README.md and docs/*.md cannot rot: every ```python block runs as written, every command of a
```bash block is checked against the code it names (the command line's parser, pytest's options,
the extras in pyproject.toml, the Makefile's targets, the options of the scripts in tools/), the
paths they mention exist, the README stays a door (at most ``README_MAX_LINES`` lines), and
``.ci/run`` runs the README's "Run it" and "Test it" commands verbatim. Every test a document cites
exists; docs/security.md's trust matrix cites one for every claim. (Links between the documents:
``tests/test_doc_links.py``.)

A block that cannot run here (it needs vLLM, a GPU or two hosts) is written as a ```bash block of
commands this file checks, or as a plain ``` block, which is shown and not run. A shell command
this file does not know how to check fails the test: teach ``check_command`` about it rather than
leave it unchecked.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
#: The documents whose blocks run or are checked: the README, then docs/ (design.md included).
DOCUMENTS = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]
#: The README is the door: what the package is, install, the first commands, short examples, links.
README_MAX_LINES = 300
#: The README's run command, exactly as a user types it at the root of a clone (issue 11).
RUN_COMMAND = "pip install -e . && python -m llm_datadist demo"
TEST_COMMAND = 'pip install -e ".[test]" && python -m pytest'
BLOCK_TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    document: str  # its path from the repository's root
    language: str
    line: int  # of the opening fence, 1-based
    section: str
    text: str


def document_blocks(path: Path) -> List[Block]:
    """The fenced code blocks of the document at ``path`` with their language, line and section
    heading (the last ``## `` heading above them)."""
    name = path.relative_to(REPO_ROOT).as_posix()
    blocks, section, fence = [], "", None
    body: List[str] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if fence is not None:
            if line.startswith("```"):
                blocks.append(Block(name, fence[0], fence[1], section, "\n".join(body) + "\n"))
                fence, body = None, []
            else:
                body.append(line)
        elif line.startswith("```"):
            fence = (line[3:].strip(), number)
        elif line.startswith("## "):
            section = line[3:].strip()
    assert fence is None, f"{name}: the block opened at line {fence[1]} is never closed"
    return blocks


BLOCKS = [block for path in DOCUMENTS for block in document_blocks(path)]
PYTHON_BLOCKS = [b for b in BLOCKS if b.language == "python"]
SHELL_BLOCKS = [b for b in BLOCKS if b.language == "bash"]


def _block_id(block: Block) -> str:
    where = re.sub(r"[^a-z0-9]+", "-", f"{Path(block.document).stem}-line{block.line}-{block.section}".lower())
    return where.strip("-")


def test_the_documents_have_the_blocks_this_file_checks():
    """Guards the extraction itself: a parser that found nothing would pass every test below."""
    python = {(b.document, b.section) for b in PYTHON_BLOCKS}
    shell = {(b.document, b.section) for b in SHELL_BLOCKS}
    assert python >= {("README.md", "Python API (CANN style)"), ("README.md", "C++ API (as Python wrappers)"),
                      ("docs/planes.md", "Linking two clusters and moving blocks")}, python
    assert shell >= {("README.md", "Run it"), ("README.md", "Test it"), ("README.md", "Benchmarks"),
                     ("docs/planes.md", "Two hosts"), ("docs/planes.md", "The nixl plane: across hosts over RDMA"),
                     ("docs/vllm.md", "Install"), ("docs/vllm.md", "Start a prefill and a decode server"),
                     ("docs/testing.md", "GPU check"), ("docs/testing.md", "Wheels")}, shell
    assert all(b.language in ("python", "bash", "") for b in BLOCKS), [(b.document, b.language) for b in BLOCKS]


def test_the_readme_is_a_door():
    """The README says what the package is, how to install, run and test it, shows each API style
    once and links the documents; the manuals live in docs/."""
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, over {README_MAX_LINES}: move the rest to docs/"


def test_run_and_test_commands_are_the_ones_ci_runs():
    run_it = next(b for b in SHELL_BLOCKS if b.document == "README.md" and b.section == "Run it")
    assert run_it.text.splitlines()[0] == RUN_COMMAND
    test_it = next(b for b in SHELL_BLOCKS if b.document == "README.md" and b.section == "Test it")
    assert test_it.text.splitlines()[0] == TEST_COMMAND
    ci_lines = [line.strip() for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()]
    assert RUN_COMMAND in ci_lines, ".ci/run must run the README's run command verbatim"
    assert TEST_COMMAND in ci_lines, ".ci/run must run the README's test command verbatim"


# -- Python blocks ------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=_block_id)
def test_python_block_runs_as_written(block, tmp_path):
    """The block as a script of its own, in an empty directory, in a process group of its own: it
    must exit 0 without a word on stderr and leave no process behind."""
    script = tmp_path / "readme_block.py"
    script.write_text(block.text)
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{block.document} line {block.line}: the block did not finish within {BLOCK_TIMEOUT_S} s")
    assert proc.returncode == 0 and not stderr.strip(), (
        f"{block.document} line {block.line} ({block.section}) fails as written:\n{stderr}")
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        pass
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{block.document} line {block.line}: the block left processes behind")


# -- shell blocks -------------------------------------------------------------------------------------

def shell_commands(text: str) -> List[List[str]]:
    """The simple commands of a shell block: logical lines (a quoted string may span lines),
    comments dropped, split at ``&&``."""
    commands, pending = [], ""
    for line in text.splitlines():
        pending += line + "\n"
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on on the next line
            continue
        pending = ""
        command: List[str] = []
        for word in words + ["&&"]:
            if word == "&&":
                if command:
                    commands.append(command)
                command = []
            else:
                command.append(word)
    assert not pending.strip(), f"unterminated command: {pending!r}"
    return commands


def _extras() -> set:
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        tomllib = pytest.importorskip("tomli")
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        return set(tomllib.load(f)["project"]["optional-dependencies"])


_EXTRA = re.compile(r"^(?:\.|llm_datadist)\[([\w,-]+)\]$")


def _check_pip(words: List[str]) -> None:
    assert words[1] in ("install", "uninstall"), words
    for word in words[2:]:
        match = _EXTRA.match(word)
        if match:
            unknown = set(match.group(1).split(",")) - _extras()
            assert not unknown, f"pip {' '.join(words[1:])}: no such extra {sorted(unknown)} in pyproject.toml"


def _check_llm_datadist(args: List[str]) -> None:
    """Parse the arguments with the command line's own parser: every command, flag and value."""
    from llm_datadist.cli.main import build_parser
    try:
        build_parser().parse_args(args)
    except SystemExit as exc:  # --help / --version exit 0 after printing; errors exit 2
        assert exc.code == 0 and args[-1] in ("--help", "--version"), f"python -m llm_datadist {shlex.join(args)}"


_pytest_help: List[str] = []


def _check_pytest(args: List[str]) -> None:
    if not _pytest_help:
        _pytest_help.append(subprocess.run([sys.executable, "-m", "pytest", "--help"], cwd=REPO_ROOT,
                                           capture_output=True, text=True, timeout=120).stdout)
    for arg in args:
        if arg.startswith("-"):
            option = arg.split("=", 1)[0]
            assert re.search(rf"(^|[\s,]){re.escape(option)}([\s=,]|$)", _pytest_help[0], re.M), \
                f"pytest has no option {option}"
        else:
            assert (REPO_ROOT / arg).exists(), f"python -m pytest {arg}: no such path"


def _check_pytest_benchmark(args: List[str]) -> None:
    executable = shutil.which("pytest-benchmark") or shutil.which("pytest-benchmark",
                                                                 path=os.path.dirname(sys.executable))
    assert executable, "pytest-benchmark is not installed (the test extra installs it)"
    assert args[0] == "compare", args
    help_text = subprocess.run([executable, "compare", "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    for arg in args[1:]:
        if arg.startswith("-"):
            assert arg.split("=", 1)[0] in help_text, f"pytest-benchmark compare has no option {arg}"


def _check_tool(args: List[str]) -> None:
    """``python tools/NAME.py ...``: the script exists and its --help names every option used."""
    script = REPO_ROOT / args[0]
    assert script.is_file(), f"python {args[0]}: no such script"
    help_text = subprocess.run([sys.executable, str(script), "--help"], cwd=REPO_ROOT, capture_output=True,
                               text=True, timeout=60).stdout
    for arg in args[1:]:
        if arg.startswith("-"):
            option = arg.split("=", 1)[0]
            assert re.search(rf"(^|[\s,\[]){re.escape(option)}([\s=,\]]|$)", help_text, re.M), \
                f"python {args[0]} has no option {option}"


def _check_vllm_serve(args: List[str]) -> None:
    """vLLM itself may be absent: check what is ours, the connector named by the JSON config."""
    import importlib.util
    assert args[0] == "serve", args
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    spec = importlib.util.find_spec(config["kv_connector_module_path"])
    assert spec is not None and spec.origin, config["kv_connector_module_path"]
    name = re.escape(config["kv_connector"])
    # defined there, or (a package) imported from one of its modules and listed in __all__
    text = Path(spec.origin).read_text()
    assert re.search(rf"^(class {name}\b|{name} = )", text, re.M) or (
        re.search(rf"^from \S+ import .*\b{name}\b", text, re.M) and f'"{config["kv_connector"]}"' in text), \
        config["kv_connector"]
    assert config["kv_role"] in ("kv_producer", "kv_consumer", "kv_both")


def _check_ssh(args: List[str]) -> None:
    """An SSH port forward: ``-N -L LOCAL_PORT:HOST:REMOTE_PORT destination``."""
    assert "-N" in args and "-L" in args, args
    forward = args[args.index("-L") + 1]
    assert re.fullmatch(r"\d{1,5}:[\w.]+:\d{1,5}", forward), forward
    assert args[-1] not in ("-N", "-L", forward) and not args[-1].startswith("-"), args


def _environment(words: List[str]) -> List[str]:
    """The command after its leading ``NAME=value`` assignments, each of a variable the package
    reads (its name appears in the package's source)."""
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        name = words[0].split("=", 1)[0]
        assert any(name in path.read_text() for path in (REPO_ROOT / "llm_datadist").rglob("*.py")), \
            f"a document sets {name}, which the package never reads"
        words = words[1:]
    return words


def check_command(words: List[str]) -> None:
    words = _environment(words)
    if words[0] == "pip":
        _check_pip(words)
    elif words[:3] == ["python", "-m", "llm_datadist"]:
        _check_llm_datadist(words[3:])
    elif words[:3] == ["python", "-m", "pytest"]:
        _check_pytest(words[3:])
    elif words[0] == "python" and len(words) > 1 and re.fullmatch(r"tools/\w+\.py", words[1]):
        _check_tool(words[1:])
    elif words[0] == "pytest-benchmark":
        _check_pytest_benchmark(words[1:])
    elif words[0] == "vllm":
        _check_vllm_serve(words[1:])
    elif words[0] == "ssh":
        _check_ssh(words[1:])
    else:
        pytest.fail(f"a document runs {words[0]!r}, which tests/test_readme.py does not know how to check")


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=_block_id)
def test_shell_block_commands_exist(block):
    commands = shell_commands(block.text)
    assert commands, f"{block.document} line {block.line}: no command found"
    for words in commands:
        check_command(words)


def test_the_checks_catch_what_they_are_for():
    """Each check refuses the kind of mistake it exists for."""
    with pytest.raises(AssertionError):
        _check_llm_datadist(["bench", "--no-such-flag"])
    with pytest.raises(AssertionError):
        _check_ssh(["-N", "-L", "7000:127.0.0.1", "user@host"])
    with pytest.raises(AssertionError):
        _check_pip(["pip", "install", ".[no_such_extra]"])
    with pytest.raises(AssertionError):
        _check_pytest(["no_such_dir/"])
    with pytest.raises(AssertionError):
        _check_tool(["tools/build_wheels.py", "--no-such-flag"])
    with pytest.raises(AssertionError):
        _check_tool(["tools/no_such_tool.py"])
    with pytest.raises(pytest.fail.Exception):
        check_command(["curl", "http://example.invalid"])
    with pytest.raises(AssertionError):
        check_command(["LLM_DATADIST_NO_SUCH_SETTING=1", "python", "-m", "llm_datadist", "info"])
    check_command(["LLM_DATADIST_LINK_PROTECTION=encrypt", "python", "-m", "llm_datadist", "info"])
    assert shell_commands('a b && c "d\ne" # note\nf\n') == [["a", "b"], ["c", "d\ne"], ["f"]]


# -- prose ---------------------------------------------------------------------------------------------

def test_make_targets_the_documents_name_exist():
    targets = set(re.findall(r"^([\w-]+):", (REPO_ROOT / "Makefile").read_text(), re.M))
    named = {target for path in DOCUMENTS for target in re.findall(r"`make ([\w-]+)", path.read_text())}
    assert named and named <= targets, named - targets


def test_paths_the_documents_name_exist():
    """Every repository path in backquotes exists at the root of the repository, and so does every
    link of the README (the links of docs/, relative to their folder: tests/test_doc_links.py).
    docs/design.md is left out: it names the package's modules from inside ``llm_datadist/``, and
    files that are not built yet."""
    missing = []
    for path in DOCUMENTS:
        if path.name == "design.md":
            continue
        text = path.read_text()
        candidates = set(re.findall(r"`([\w.][\w./-]*/[\w./-]*)`", text))
        if path == README:
            candidates |= set(re.findall(r"\]\(([^)#:]+)\)", text))
            assert "docs/design.md" in candidates
        missing += [f"{path.name}: {name}" for name in sorted(candidates) if not (REPO_ROOT / name).exists()]
    assert not missing, f"the documents name paths that do not exist: {missing}"


# -- docs/security.md's trust matrix -----------------------------------------------------------------

SECURITY = REPO_ROOT / "docs" / "security.md"
#: A test docs/security.md cites: ``file::function``, with a parameter id at most (the file is
#: named by its name alone, which must be unique under tests/).
CITATION = re.compile(r"`(test_\w+\.py)::(test_\w+)(?:\[[^\]`]*\])?`")
MARKER = re.compile(r"\[(\d+)\]")
FOOTNOTE = re.compile(r"^\[(\d+)\]\s", re.MULTILINE)


def defined_tests(path: Path) -> set:
    import ast
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def missing_tests(cited) -> List[str]:
    """What is wrong with each ``(file name, function)`` cited: no test file of that name, several,
    or no such function in it."""
    files: dict = {}
    for path in (REPO_ROOT / "tests").rglob("test_*.py"):
        files.setdefault(path.name, []).append(path)
    wrong = []
    for name, function in sorted(set(cited)):
        paths = files.get(name, [])
        if len(paths) != 1:
            wrong.append(f"{name}::{function}: {len(paths)} test files are named {name}")
        elif function not in defined_tests(paths[0]):
            wrong.append(f"{name}::{function}: no such test in {paths[0].relative_to(REPO_ROOT)}")
    return wrong


def test_the_tests_the_documents_cite_exist():
    """A ``file::test`` named anywhere in the README or docs/ is a test of that name in the one test
    file of that name."""
    wrong = [f"{path.name}: {why}" for path in DOCUMENTS for why in missing_tests(CITATION.findall(path.read_text()))]
    assert not wrong, "the documents cite tests that do not exist:\n" + "\n".join(wrong)


def test_security_matrix_cites_existing_tests():
    """Every test docs/security.md names exists (a function of that name in the one test file
    of that name), so the citations cannot rot; every ``[n]`` it uses is a footnote naming tests,
    and every claim cell of the trust matrix and the plane table carries one (or points at
    another row: "as ...", "per plane")."""
    section = SECURITY.read_text()
    cited = CITATION.findall(section)
    assert len(cited) >= 100, f"found only {len(cited)} citations: is the pattern still docs/security.md's?"
    wrong = missing_tests(cited)
    assert not wrong, "docs/security.md cites tests that do not exist:\n" + "\n".join(wrong)

    footnotes = {int(n): body for n, body in re.findall(r"^\[(\d+)\]\s(.*?)(?=^\[\d+\]\s|\n\n)", section,
                                                        re.MULTILINE | re.DOTALL)}
    assert footnotes and sorted(footnotes) == list(range(1, len(footnotes) + 1)), sorted(footnotes)
    assert all(CITATION.search(body) for body in footnotes.values()), "a footnote that names no test"
    used = {int(n) for n in MARKER.findall(FOOTNOTE.sub("", section))}
    assert used == set(footnotes), f"used but not defined: {used - set(footnotes)}; unused: {set(footnotes) - used}"

    tables = {"| actor ": 2, "| plane ": 1}  # the claim cells start at these columns
    checked = 0
    lines = section.splitlines()
    for header, first in tables.items():
        start = next(i for i, line in enumerate(lines) if line.startswith(header))
        for row in lines[start + 2:]:
            if not row.startswith("|"):
                break
            cells = [cell.strip() for cell in row.strip("|").split(" | ")]
            for cell in cells[first:]:
                checked += 1
                assert MARKER.search(cell) or cell.startswith(("as ", "per plane")), f"no test for: {cell!r} in {row}"
    assert checked >= 40, checked
