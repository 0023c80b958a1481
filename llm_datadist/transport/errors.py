"""Errors of the transport: status codes as exceptions, and the internal signals between layers."""

from __future__ import annotations

from typing import Any

from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.transport.wire import ProtocolError

S = LLMStatusCode

__all__ = ["S", "status_of", "fail", "brief", "is_int", "StaleTable", "MutualLink", "ProtocolError", "Stalled",
           "CopyFailed"]


def status_of(code: int) -> LLMStatusCode:
    """The status of a code (``LLM_FAILED`` for one this version does not know)."""
    try:
        return LLMStatusCode(code)
    except ValueError:
        return S.LLM_FAILED


def fail(code: int, message: str) -> LLMException:
    return LLMException(message, status_code=status_of(code))


def brief(value: Any) -> str:
    """``repr(value)`` cut to 80 characters, for messages about a peer's malformed input."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_int(value: Any, lo: int = 0, hi: int = 2**64 - 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


class MutualLink(Exception):
    """The peer is linking to this cluster at the same time, and its link is the one kept."""


class Stalled(ProtocolError):
    """A body holding a budget stopped arriving (``session.receive_steadily``): its connection
    goes like one that broke the protocol, and the stall was counted and logged (rate-limited,
    ``ByteBudget.note_stall``) where it was found."""


class StaleTable(Exception):
    """The peer's registry changed since its table was fetched: refresh and plan again."""


class CopyFailed(Exception):
    """A device copy of a staged payload failed (``transport.staging``): ``cause`` is the
    runtime's ``LLMException``; ``in_step`` whether the connection is still in step with the frame
    (nothing of it was sent, or all of it was read), else the connection must be dropped."""

    def __init__(self, cause: LLMException, in_step: bool) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.in_step = in_step
