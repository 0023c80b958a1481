"""Status codes and the one mapping from codes to exceptions.

The numbers mirror ``include/llm_datadist/dd_status.h`` (a test checks every one of them).
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["LLMStatusCode", "LLMException", "Status", "raise_on_status", "to_status_code"]


class LLMStatusCode(IntEnum):
    """CANN ``LLMStatusCode``: the Python names of the native status codes."""

    LLM_UNKNOWN_ERROR = -1
    LLM_SUCCESS = 0x0
    LLM_FAILED = 0xFFFFFFFF
    LLM_WAIT_PROCESS_TIMEOUT = 0x5010B001
    LLM_KV_CACHE_NOT_EXIST = 0x5010B002
    LLM_REPEAT_REQUEST = 0x5010B003
    LLM_REQUEST_ALREADY_COMPLETED = 0x5010B004
    LLM_PARAM_INVALID = 0x5010B005
    LLM_ENGINE_FINALIZED = 0x5010B006
    LLM_NOT_YET_LINK = 0x5010B007
    LLM_ALREADY_LINK = 0x5010B008
    LLM_LINK_FAILED = 0x5010B009
    LLM_UNLINK_FAILED = 0x5010B00A
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = 0x5010B00B
    LLM_CLUSTER_NUM_EXCEED_LIMIT = 0x5010B00C
    LLM_PROCESSING_LINK = 0x5010B00D
    LLM_DEVICE_OUT_OF_MEMORY = 0x5010B00E
    LLM_PREFIX_ALREADY_EXIST = 0x5010B00F
    LLM_PREFIX_NOT_EXIST = 0x5010B010
    LLM_SEQ_LENOVERLIMIT = 0x5010B011
    LLM_NO_FREE_BLOCK = 0x5010B012
    LLM_BLOCKS_OUT_OF_MEMORY = 0x5010B013
    LLM_EXIST_LINK = 0x5010B018
    LLM_FEATURE_NOT_ENABLED = 0x5010B019
    LLM_TIMEOUT = 0x5010B01A
    LLM_LINK_BUSY = 0x5010B01B
    LLM_OUT_OF_MEMORY = 0x5010B01C
    LLM_DEVICE_MEM_ERROR = 507053
    LLM_SUSPECT_REMOTE_ERROR = 507057

    def __str__(self) -> str:  # "LLMStatusCode.LLM_SUCCESS" on every Python version
        return f"{type(self).__name__}.{self.name}"


# C++ names (namespace llm_datadist) -> value. Every DD_<name> of dd_status.h appears here.
CPP_STATUS_CODES: dict[str, int] = {
    "LLM_SUCCESS": 0x0,
    "LLM_FAILED": 0xFFFFFFFF,
    "LLM_WAIT_PROC_TIMEOUT": 0x5010B001,
    "LLM_KV_CACHE_NOT_EXIST": 0x5010B002,
    "LLM_REPEAT_REQUEST": 0x5010B003,
    "LLM_REQUEST_ALREADY_COMPLETED": 0x5010B004,
    "LLM_PARAM_INVALID": 0x5010B005,
    "LLM_ENGINE_FINALIZED": 0x5010B006,
    "LLM_NOT_YET_LINK": 0x5010B007,
    "LLM_ALREADY_LINK": 0x5010B008,
    "LLM_LINK_FAILED": 0x5010B009,
    "LLM_UNLINK_FAILED": 0x5010B00A,
    "LLM_NOTIFY_PROMPT_UNLINK_FAILED": 0x5010B00B,
    "LLM_CLUSTER_NUM_EXCEED_LIMIT": 0x5010B00C,
    "LLM_PROCESSING_LINK": 0x5010B00D,
    "LLM_DEVICE_OUT_OF_MEMORY": 0x5010B00E,
    "LLM_PREFIX_ALREADY_EXIST": 0x5010B00F,
    "LLM_PREFIX_NOT_EXIST": 0x5010B010,
    "LLM_SEQ_LEN_OVER_LIMIT": 0x5010B011,
    "LLM_NO_FREE_BLOCK": 0x5010B012,
    "LLM_BLOCKS_OUT_OF_MEMORY": 0x5010B013,
    "LLM_CACHE_INCOMPATIBLE": 0x5010B014,
    "LLM_CACHE_KEY_ALREADY_EXIST": 0x5010B015,
    "LLM_COPY_CACHE_FAILED": 0x5010B016,
    "LLM_CACHE_ID_ALREADY_EXIST": 0x5010B017,
    "LLM_EXIST_LINK": 0x5010B018,
    "LLM_FEATURE_NOT_ENABLED": 0x5010B019,
    "LLM_TIMEOUT": 0x5010B01A,
    "LLM_LINK_BUSY": 0x5010B01B,
    "LLM_OUT_OF_MEMORY": 0x5010B01C,
    "LLM_DEVICE_MEM_ERROR": 507053,
    "LLM_SUSPECT_REMOTE_ERROR": 507057,
}


def to_status_code(code: int) -> LLMStatusCode:
    """Map a native code to ``LLMStatusCode``; codes Python does not know become ``LLM_FAILED``."""
    try:
        return LLMStatusCode(int(code))
    except ValueError:
        return LLMStatusCode.LLM_FAILED


class LLMException(RuntimeError):
    """Raised by the Python API; ``status_code`` says why (default ``LLM_SUCCESS``, as in CANN)."""

    def __init__(self, *args, status_code: int = LLMStatusCode.LLM_SUCCESS):
        super().__init__(*args)
        self._status_code = to_status_code(status_code)

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code

    def __str__(self) -> str:
        message = super().__str__()
        return f"{message} (status_code={self._status_code.name})" if message else self._status_code.name


class Status:
    """A native return code: ``Status(code).is_ok()``."""

    def __init__(self, code: int = LLMStatusCode.LLM_SUCCESS):
        self._status_code = to_status_code(code)

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


def raise_on_status(code: int, where: str, detail: str = "") -> None:
    """Raise ``LLMException`` for a non-zero native code (message names the method and the code)."""
    if code != 0:
        mapped = to_status_code(code)
        text = f"{where} failed, status code: {mapped.name} ({int(code):#x})"
        raise LLMException(f"{text}: {detail}" if detail else text, status_code=mapped)
