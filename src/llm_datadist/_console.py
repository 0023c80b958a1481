"""Small helpers of the command line: byte sizes in and out, a progress bar."""

from __future__ import annotations

import re
import sys

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """``"4096"``, ``"4K"``, ``"4KiB"``, ``"2MiB"``, ``"1G"`` -> bytes (binary units; ``ValueError``
    for anything else)."""
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 4KiB, 2MiB, 1GiB)")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def format_size(nbytes: float) -> str:
    """Bytes in binary units: ``131072`` -> ``"128 KiB"``, ``1.5 * 2**20`` -> ``"1.5 MiB"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes:.0f} B"


def short_size(nbytes: int) -> str:
    """``4096`` -> ``"4KiB"`` (labels and table cells)."""
    return format_size(nbytes).replace(" ", "")


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    WIDTH = 30

    def __init__(self, total: int, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total = max(1, total)
        self.done = 0

    def step(self, label: str, count: int = 1) -> None:
        self.done = min(self.total, self.done + count)
        if self.enabled:
            filled = self.WIDTH * self.done // self.total
            self.stream.write(f"\r{label[:32]:<32} [{'#' * filled}{'.' * (self.WIDTH - filled)}] "
                              f"{100 * self.done // self.total:3d}%")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * (self.WIDTH + 40) + "\r")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
