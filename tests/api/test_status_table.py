"""One status table: dd_status.h, its generated mirrors, the compiled core, the C++-style names and
LLMStatusCode agree, and the build-time check notices when they do not."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llm_datadist import LLMException, LLMStatusCode, Status, _core, _status_codes, cpp
from llm_datadist.status import CPP_STATUS_CODES, raise_on_status, to_status_code

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "include" / "llm_datadist" / "dd_status.h"
PACKAGE = ROOT / "llm_datadist"
# Python spells two codes differently from C++ (as CANN does).
PYTHON_NAME = {"LLM_WAIT_PROC_TIMEOUT": "LLM_WAIT_PROCESS_TIMEOUT", "LLM_SEQ_LEN_OVER_LIMIT": "LLM_SEQ_LENOVERLIMIT"}
# Codes CANN's Python API does not name (they map to LLM_FAILED there).
CPP_ONLY = {"LLM_CACHE_INCOMPATIBLE", "LLM_CACHE_KEY_ALREADY_EXIST", "LLM_COPY_CACHE_FAILED",
            "LLM_CACHE_ID_ALREADY_EXIST"}


def header_codes():
    text = HEADER.read_text()
    return {name: int(value, 0) for name, value in
            re.findall(r"#define DD_(LLM_\w+)\s+(0x[0-9A-Fa-f]+|\d+)u", text)}


def test_header_lists_every_code_once_with_spec_values():
    codes = header_codes()
    assert len(codes) == 32
    assert codes["LLM_PARAM_INVALID"] == 0x5010B005 == 1343270917
    assert codes["LLM_FAILED"] == 0xFFFFFFFF
    assert codes["LLM_TIMEOUT"] == 1343270938
    assert codes["LLM_DEVICE_MEM_ERROR"] == 507053


def test_generated_python_mirror_matches_header():
    assert _status_codes.STATUS_CODES == header_codes()
    assert list(_status_codes.STATUS_CODES) == list(header_codes())  # header order


def test_pxd_declares_exactly_the_header_codes():
    text = (PACKAGE / "_status.pxd").read_text()
    declared = re.findall(r"^    uint32_t DD_(LLM_\w+)$", text, re.M)
    assert declared == list(header_codes())
    # compiled_status_codes() maps each C++ name to the macro of the same name
    assert re.findall(r'^        "(LLM_\w+)": DD_(LLM_\w+),$', text, re.M) == [(n, n) for n in header_codes()]


def test_compiled_core_matches_header():
    assert _core.C_STATUS_CODES == header_codes()


def test_cpp_names_match_header():
    assert CPP_STATUS_CODES == header_codes()
    for name, value in header_codes().items():
        assert getattr(cpp, name) == value
        assert repr(getattr(cpp, name)) == name


def test_python_enum_matches_header():
    for name, value in header_codes().items():
        if name in CPP_ONLY:
            assert to_status_code(value) == LLMStatusCode.LLM_FAILED
            continue
        assert LLMStatusCode[PYTHON_NAME.get(name, name)] == value
    python_only = {m.name for m in LLMStatusCode} - {PYTHON_NAME.get(n, n) for n in header_codes()}
    assert python_only == {"LLM_UNKNOWN_ERROR"}


@pytest.mark.parametrize("code", [int(c) for c in LLMStatusCode if c != 0])
def test_every_code_maps_to_an_exception_carrying_it(code):
    with pytest.raises(LLMException) as info:
        raise_on_status(code, "[op]")
    assert info.value.status_code == code
    assert "[op]" in str(info.value)


def test_unknown_native_code_becomes_llm_failed():
    with pytest.raises(LLMException) as info:
        raise_on_status(0x5010B0FF, "[op]")
    assert info.value.status_code == LLMStatusCode.LLM_FAILED


def test_exception_and_status_helpers():
    assert LLMException("x").status_code == LLMStatusCode.LLM_SUCCESS
    assert isinstance(LLMException("x"), RuntimeError)
    assert Status(0).is_ok() and not Status(LLMStatusCode.LLM_TIMEOUT).is_ok()
    assert Status(12345).status_code == LLMStatusCode.LLM_FAILED
    raise_on_status(0, "[op]")  # success raises nothing


# -- the build-time check (tools/status_table.py, run by setup.py) ----------------------------------

def load_status_table():
    spec = importlib.util.spec_from_file_location("status_table_under_test", ROOT / "tools" / "status_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tree(tmp_path):
    """A copy of the header and of the package files the check reads."""
    header = tmp_path / "dd_status.h"
    shutil.copy(HEADER, header)
    package = tmp_path / "llm_datadist"
    package.mkdir()
    for name in ("_status_codes.py", "_status.pxd", "status.py"):
        shutil.copy(PACKAGE / name, package / name)
    return header, package


def test_check_passes_on_the_committed_tree():
    table = load_status_table()
    assert table.check() == []
    assert table.parse_header() == header_codes()


def test_check_detects_a_changed_value_in_the_header(tree):
    header, package = tree
    text = header.read_text()
    header.write_text(text.replace("0x5010B01Au", "0x5010B0AAu"))  # LLM_TIMEOUT
    problems = load_status_table().check(header, package)
    # the .pxd holds names only (the C compiler reads the values from the header itself)
    assert len(problems) == 1 and "_status_codes.py does not match" in problems[0]
    assert "tools/status_table.py" in problems[0]


def test_check_detects_a_code_added_to_the_header(tree):
    header, package = tree
    header.write_text(header.read_text().replace(
        "#endif", "#define DD_LLM_NEW_CODE                      0x5010B01Du\n#endif"))
    problems = load_status_table().check(header, package)
    assert len(problems) == 2
    assert any("_status_codes.py does not match" in p for p in problems)
    assert any("_status.pxd does not match" in p for p in problems)
    table = load_status_table()
    table.write(header, package)  # what `make status` does
    assert table.check(header, package) == []
    assert '"LLM_NEW_CODE": 0x5010B01D,' in (package / "_status_codes.py").read_text()
    assert "    uint32_t DD_LLM_NEW_CODE\n" in (package / "_status.pxd").read_text()


def test_check_detects_a_hand_edited_mirror(tree):
    header, package = tree
    mirror = package / "_status_codes.py"
    mirror.write_text(mirror.read_text().replace('"LLM_TIMEOUT": 0x5010B01A', '"LLM_TIMEOUT": 0x5010B01B'))
    (package / "_status.pxd").unlink()
    problems = load_status_table().check(header, package)
    assert len(problems) == 2
    assert any("_status_codes.py does not match" in p for p in problems)
    assert any("_status.pxd is missing" in p for p in problems)


def test_check_detects_status_py_naming_a_code_the_header_lacks(tree):
    header, package = tree
    header.write_text("\n".join(line for line in header.read_text().splitlines()
                                if "DD_LLM_COPY_CACHE_FAILED" not in line))
    table = load_status_table()
    table.write(header, package)
    assert table.check(header, package) == [
        f"{package / 'status.py'}: _CPP_ONLY names LLM_COPY_CACHE_FAILED, which {header} does not define"]


@pytest.mark.parametrize("line", [
    "#define DD_LLM_ODD                          5010B01D",  # neither hex nor decimal
    "#define DD_LLM_FAILED_TOO                   0xFFFFFFFFu",  # a value given twice
    "#define DD_LLM_TOO_BIG                      0x1FFFFFFFFu",  # not a uint32
    "#define DD_LLM_COMMENTED                    0x5010B01Du  /* trailing text */",
])
def test_check_refuses_a_header_line_it_cannot_read_exactly(tree, line):
    header, package = tree
    header.write_text(header.read_text().replace("#endif", line + "\n#endif"))
    problems = load_status_table().check(header, package)
    assert len(problems) == 1 and "DD_LLM_" in problems[0], problems


def test_setup_py_stops_the_build_when_a_mirror_disagrees(tmp_path):
    """setup.py runs the check before anything is compiled (here: before it would look for the
    .pyx sources, which this copy of the tree does not have)."""
    (tmp_path / "include" / "llm_datadist").mkdir(parents=True)
    (tmp_path / "llm_datadist").mkdir(parents=True)
    (tmp_path / "tools").mkdir()
    shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    shutil.copy(ROOT / "tools" / "status_table.py", tmp_path / "tools" / "status_table.py")
    for name in ("_status_codes.py", "_status.pxd", "status.py"):
        shutil.copy(PACKAGE / name, tmp_path / "llm_datadist" / name)
    header = tmp_path / "include" / "llm_datadist" / "dd_status.h"
    header.write_text(HEADER.read_text().replace("0x5010B005u", "0x5010B0F5u"))  # LLM_PARAM_INVALID
    result = subprocess.run([sys.executable, "setup.py", "--name"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0
    assert "status table mirrors disagree with include/llm_datadist/dd_status.h" in result.stderr
    assert "_status_codes.py does not match" in result.stderr
