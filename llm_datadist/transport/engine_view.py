"""What the transport needs of the engine it serves: this narrow view, and nothing else.

The transport never imports the engine; ``LinkManager(engine)`` takes any object with these
members (``_engine.Engine`` in the library, a stand-in in tests). In return the engine tells the
link manager when its registry changes (``LinkManager.registered`` / ``unregistered``), which the
manager passes to every data plane (``DataPlane.on_register`` / ``on_unregister``).
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Dict, Optional, Protocol, Sequence, Tuple


class SharedWord(Protocol):
    """A 64-bit word in a memfd mapping that same-host peers may map read-only."""

    addr: int
    fd: int
    value: int


class EngineView(Protocol):
    #: This cluster's id and role name (``PROMPT`` / ``DECODER`` ...).
    cluster_id: int
    role: str
    #: The engine's options (``llm.DataPlane``, ``llm.LinkSecret``, ...), strings.
    options: Dict[str, str]
    #: The registry generation, bumped whenever registered memory goes away.
    generation_word: SharedWord

    def export_table(self) -> Dict[str, Any]:
        """This cluster's cache table as peers receive it (``transport.table``)."""

    def consume_key(self, owner_key: Tuple[str, int, int], tensors: Sequence[int]) -> bool:
        """A peer pulled ``tensors`` of the row bound to ``owner_key``; True if it was released."""

    def count_protocol_error(self) -> None:
        """A peer broke the protocol (counted in the engine's stats)."""

    #: The device runtime (``_core.Runtime``) of the engine's DEVICE caches.
    runtime: Any

    def pinned(self, plan: Any, dst_side: bool, deadline: Optional[float] = None,
               cancel: Optional[Callable[[], None]] = None) -> ContextManager[Tuple[Any, int, Any]]:
        """``(shared host RangeSet, registry generation, shared device RangeSet)``, held while a
        peer's bytes move through the ``dst_side`` (or source) ranges of ``plan``. The host
        ranges are memory the host addresses; the device ranges are device memory it does not
        (moved only through ``runtime``'s copies). ``deadline`` (``time.monotonic()``): when the
        transfer ends at the latest; memory being unregistered under a transfer past it calls
        ``cancel()``, which must make the transfer fail and let go at once."""

    def bind_thread(self) -> None:
        """Bind the calling thread to the engine's device (before it uses ``runtime``)."""
