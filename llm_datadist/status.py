"""Status codes and the one mapping from codes to exceptions.

The codes are those of ``include/llm_datadist/dd_status.h``, the one status table: its generated
mirror ``_status_codes`` (C++ name -> value) is all this module reads. Only the Python API's
spelling is written here: two codes have other Python names, four have none (as in CANN).
"""

from __future__ import annotations

from enum import IntEnum

from llm_datadist._status_codes import STATUS_CODES

__all__ = ["LLMStatusCode", "LLMException", "Status", "code_2_status", "handle_llm_status", "raise_on_status",
           "to_status_code"]

# C++ name -> the name CANN's Python LLMStatusCode gives the same code.
_PYTHON_NAMES = {"LLM_WAIT_PROC_TIMEOUT": "LLM_WAIT_PROCESS_TIMEOUT", "LLM_SEQ_LEN_OVER_LIMIT": "LLM_SEQ_LENOVERLIMIT"}
# C++ codes CANN's Python LLMStatusCode does not name (to_status_code maps them to LLM_FAILED).
_CPP_ONLY = frozenset({"LLM_CACHE_INCOMPATIBLE", "LLM_CACHE_KEY_ALREADY_EXIST", "LLM_COPY_CACHE_FAILED",
                       "LLM_CACHE_ID_ALREADY_EXIST"})


class _StatusCodeEnum(IntEnum):
    """What LLMStatusCode adds to IntEnum (an enum with members cannot be subclassed, so the
    methods live in this member-less base)."""

    def __str__(self) -> str:  # "LLMStatusCode.LLM_SUCCESS" on every Python version
        return f"{type(self).__name__}.{self.name}"


LLMStatusCode = _StatusCodeEnum(
    "LLMStatusCode",
    [("LLM_UNKNOWN_ERROR", -1)]
    + [(_PYTHON_NAMES.get(name, name), value) for name, value in STATUS_CODES.items() if name not in _CPP_ONLY],
    module=__name__,
    qualname="LLMStatusCode",
)
LLMStatusCode.__doc__ = "CANN ``LLMStatusCode``: the Python names of the native status codes."

# C++ names (namespace llm_datadist) -> value: every DD_<name> of dd_status.h.
CPP_STATUS_CODES: dict[str, int] = dict(STATUS_CODES)


def to_status_code(code: int) -> LLMStatusCode:
    """Map a native code to ``LLMStatusCode``; codes Python does not know become ``LLM_FAILED``."""
    try:
        return LLMStatusCode(int(code))
    except ValueError:
        return LLMStatusCode.LLM_FAILED


class LLMException(RuntimeError):
    """Raised by the Python API; ``status_code`` says why (default ``LLM_SUCCESS``, as in CANN).
    The code is kept as given, as CANN's ``LLMException`` keeps it: this package raises it with
    ``LLMStatusCode`` members, and a program's own value (12345, None) comes back unchanged."""

    def __init__(self, *args, status_code: int = LLMStatusCode.LLM_SUCCESS):
        super().__init__(*args)
        self._status_code = status_code

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code

    def __str__(self) -> str:
        message = super().__str__()
        name = getattr(self._status_code, "name", self._status_code)
        return f"{message} (status_code={name})" if message else str(name)


class Status:
    """A native return code: ``Status(status).is_ok()``. The keyword is ``status``, as in CANN's
    status.py (the API spec, §2.5, writes ``Status(code)``: the source wins)."""

    def __init__(self, status: int = LLMStatusCode.LLM_SUCCESS):
        self._status_code = to_status_code(status)

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code

    def is_ok(self) -> bool:
        return self._status_code == LLMStatusCode.LLM_SUCCESS

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Status):
            return self._status_code == other._status_code
        if isinstance(other, int):
            return self._status_code == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._status_code)

    def __repr__(self) -> str:
        return f"Status({self._status_code.name})"


# CANN's code_2_status table: every native code its Python names, LLM_UNKNOWN_ERROR (-1) excepted.
_NATIVE_CODES = {int(code): code for code in LLMStatusCode if code != LLMStatusCode.LLM_UNKNOWN_ERROR}


def code_2_status(status) -> LLMStatusCode:
    """CANN's ``code_2_status``: a native code as ``LLMStatusCode``, ``LLM_FAILED`` for any other
    value. Unlike ``to_status_code`` it is a plain table lookup, as CANN's is: -1 (the value of
    ``LLM_UNKNOWN_ERROR``, which CANN's table leaves out) and values that are no int (``None``)
    are ``LLM_FAILED`` too. (The API spec, §2.5, maps every known code to its member, -1 to
    ``LLM_UNKNOWN_ERROR`` then; CANN's source, which wins, does not.)"""
    return _NATIVE_CODES.get(status, LLMStatusCode.LLM_FAILED)


def handle_llm_status(status, func_name, other_info) -> None:
    """CANN's ``handle_llm_status``: raise ``LLMException`` for a native code other than success,
    with CANN's message (``"<func_name> failed, error code is LLMStatusCode.<name>, <other_info>."``)
    and the code as mapped by ``code_2_status``."""
    if status != LLMStatusCode.LLM_SUCCESS:
        mapped = code_2_status(status)
        raise LLMException(f"{func_name} failed, error code is {mapped}, {other_info}.", status_code=mapped)


def raise_on_status(code: int, where: str, detail: str = "") -> None:
    """Raise ``LLMException`` for a non-zero native code (message names the method and the code)."""
    if code != 0:
        mapped = to_status_code(code)
        text = f"{where} failed, status code: {mapped.name} ({int(code):#x})"
        raise LLMException(f"{text}: {detail}" if detail else text, status_code=mapped)
