"""One status table: dd_status.h, the compiled core, the C++-style names and LLMStatusCode agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llm_datadist import LLMException, LLMStatusCode, Status, _core, cpp
from llm_datadist.status import CPP_STATUS_CODES, raise_on_status, to_status_code

HEADER = Path(__file__).resolve().parents[2] / "include" / "llm_datadist" / "dd_status.h"
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
