"""Small helpers of the command line: byte sizes in and out, counted nouns, a progress bar, child
processes that leave Ctrl-C to their parent."""

from __future__ import annotations

import contextlib
import re
import signal
import sys
import threading
from typing import Iterator, Optional

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
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes:.0f} B"


def short_size(nbytes: int) -> str:
    """``4096`` -> ``"4KiB"`` (labels and table cells)."""
    return format_size(nbytes).replace(" ", "")


def count(number: int, singular: str, plural: Optional[str] = None) -> str:
    """``count(1, "layer")`` -> ``"1 layer"``, ``count(2, "layer")`` -> ``"2 layers"``."""
    return f"{number} {singular if number == 1 else plural or singular + 's'}"


@contextlib.contextmanager
def sigint_for_parent_only() -> Iterator[None]:
    """Processes started inside this block never see SIGINT; this process gets it when the block
    ends.

    A Ctrl-C at the terminal goes to every process of the foreground group, so the cluster
    processes of the demo and the bench would each raise ``KeyboardInterrupt`` and print a
    traceback while their parent shuts them down. SIGINT is blocked here while they start (a
    process started with a blocked signal keeps it blocked, across ``exec`` too); a Ctrl-C that
    comes meanwhile stays pending in this process and is raised here as ``KeyboardInterrupt`` as
    soon as the block ends, so nothing is lost and the children are closed by their owner."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread handles signals
        return
    # multiprocessing starts its resource tracker with the first spawned process and *unblocks*
    # SIGINT after doing so, which would end the block below: start it first.
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


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
