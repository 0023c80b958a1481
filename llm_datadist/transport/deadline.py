"""Deadlines of the transport: a ``time.monotonic()`` instant, made from a timeout in ms.

Every layer of the transport (handshake, link, transfer, plane) takes one deadline and asks it
how long is left; plain floats keep the hot path free of allocations.
"""

from __future__ import annotations

import time

_now = time.monotonic


def after(timeout_ms: float) -> float:
    """The deadline ``timeout_ms`` from now."""
    return _now() + timeout_ms / 1000


def left_ms(deadline: float) -> int:
    """Whole milliseconds left before ``deadline`` (0 once it has passed)."""
    left = int((deadline - _now()) * 1000)
    return left if left > 0 else 0


def left_s(deadline: float) -> float:
    """Seconds left before ``deadline`` (may be negative)."""
    return deadline - _now()


def expired(deadline: float) -> bool:
    return _now() >= deadline
