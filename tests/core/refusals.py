"""Shared checks of the core against the reference planner: both refuse the same input, and the
core's error names the bad value."""

from __future__ import annotations

import re

import pytest

from llm_datadist.status import LLMException, LLMStatusCode


def names(message, value):
    """Does ``message`` name ``value`` (an int as a whole number, anything else by str or repr)?"""
    if isinstance(value, int) and not isinstance(value, bool):
        return re.search(rf"(?<![0-9]){value}(?![0-9])", message) is not None
    return str(value) in message or repr(value) in message


def assert_both_refuse(core_call, ref_call, bad):
    """The core raises LLMException(LLM_PARAM_INVALID) naming ``bad``; the reference ValueError."""
    with pytest.raises(LLMException) as info:
        core_call()
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert names(info.value.args[0], bad), info.value.args[0]
    with pytest.raises(ValueError):
        ref_call()
