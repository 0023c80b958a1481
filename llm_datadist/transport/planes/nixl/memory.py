"""This side's memory registered with NIXL (``LocalMemory``): the engine's caches, its registry
generation word and the generation slots (``GenerationSlots``) into which requests read the
peers' generation words; and the local fences a transfer checks against them. Which memory type
a cache is registered as: ``memory_type`` (the package's docstring, "Memory")."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from llm_datadist import _io
from llm_datadist._memory import Place
from llm_datadist.transport.planes.nixl.agent import Agent, rows
from llm_datadist.transport.planes.nixl.metadata import DRAM, VRAM

#: Generation words read at once (one per transfer in flight, across links).
GENERATION_SLOTS = 4096


def memory_type(record, engine) -> Optional[Tuple[int, int]]:
    """``(NIXL memory type, device)`` of a cache of ``engine``, or None where NIXL does not take
    it (acl)."""
    if record.placement != Place.DEVICE:
        return DRAM, 0
    runtime = getattr(engine, "runtime", None)
    if runtime is None or runtime.host_addressable:
        return DRAM, 0
    if getattr(runtime, "name", "") == "cuda":
        return VRAM, int(getattr(engine, "device_id", 0))
    return None


def device_memory_type(runtime) -> int:
    """How an engine on ``runtime`` registers its DEVICE caches: VRAM for cuda, else DRAM (or not at all)."""
    return VRAM if getattr(runtime, "name", "") == "cuda" else DRAM


class GenerationSlots:
    """``GENERATION_SLOTS`` 8-byte words into which requests read the peers' registry generations,
    one per request in flight (across links), and their prepared list (``list``, once the agent
    is made)."""

    def __init__(self) -> None:
        self.words = np.zeros(GENERATION_SLOTS, dtype=np.uint64)
        self.addr = self.words.ctypes.data
        self.list: Optional[int] = None
        self._free = list(range(GENERATION_SLOTS))
        self._lock = threading.Lock()

    def take(self) -> int:
        """A free slot, or -1 where every one is in use."""
        with self._lock:
            return self._free.pop() if self._free else -1

    def give(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def value(self, slot: int) -> int:
        return int(self.words[slot])


@dataclass
class _Registration:
    mem: int
    rows: np.ndarray   # N x 3 uint64: address, bytes, device
    descs: Any = None  # NIXL's registration list, once registered


class LocalMemory:
    """What this engine registers with NIXL, with the agent from its start (``start``) to its
    end (``release``), and before it (kept for ``start``): the caches by id, the generation word
    and the generation slots. ``host_ranges`` and ``device_ranges`` are the local fences of a
    transfer; ``serial`` changes with them (an offer of the agent's metadata is made again).

    Not locked: the plane calls it with its lock held."""

    def __init__(self) -> None:
        self.slots = GenerationSlots()
        self.host_ranges = _io.RangeSet(())
        self.device_ranges = _io.RangeSet(())
        self.serial = 0
        self._registrations: Dict[int, _Registration] = {}
        self._extra: List[Any] = []  # registrations of the generation word and the slots

    def __contains__(self, cache_id: int) -> bool:
        return cache_id in self._registrations

    def start(self, agent: Agent, generation_addr: int) -> None:
        """Register the generation word, the slots and every cache known so far with ``agent``."""
        slots = self.slots
        self._extra = [agent.register(DRAM, rows([generation_addr], 8, 0)),
                       agent.register(DRAM, rows([slots.addr], slots.words.nbytes, 0))]
        slot_rows = np.zeros((GENERATION_SLOTS, 3), dtype=np.uint64)
        slot_rows[:, 0] = slots.addr + 8 * np.arange(GENERATION_SLOTS, dtype=np.uint64)
        slot_rows[:, 1] = 8
        slots.list = agent.prepare("", DRAM, slot_rows)
        for registration in self._registrations.values():
            registration.descs = agent.register(registration.mem, registration.rows)
        self.serial += 1

    def add(self, cache_id: int, mem: int, cache_rows: np.ndarray, agent: Optional[Agent]) -> Optional[str]:
        """Register a cache (``cache_rows``: one N x 3 row per tensor) with ``agent``, if made yet;
        why not where NIXL refused it (then nothing is kept)."""
        registration = _Registration(mem, cache_rows)
        if agent is not None:
            try:
                registration.descs = agent.register(mem, cache_rows)
            except agent.errors as exc:
                return str(exc)
        self._registrations[cache_id] = registration
        self._changed()
        return None

    def remove(self, cache_id: int, agent: Optional[Agent]) -> Optional[str]:
        """Deregister a cache (its memory is still there); why NIXL refused, if it did."""
        registration = self._registrations.pop(cache_id, None)
        if registration is None:
            return None
        why = None
        if agent is not None and registration.descs is not None:
            try:
                agent.deregister(registration.descs)
            except agent.errors as exc:
                why = str(exc)
        self._changed()
        return why

    def release(self, agent: Agent) -> None:
        """Deregister everything from ``agent``, which is going (the caches stay known, for
        another start)."""
        if self.slots.list is not None:
            agent.release_list(self.slots.list)
            self.slots.list = None
        for descs in [r.descs for r in self._registrations.values() if r.descs is not None] + self._extra:
            try:
                agent.deregister(descs)
            except agent.errors:
                pass
        for registration in self._registrations.values():
            registration.descs = None
        self._extra = []

    def _changed(self) -> None:
        """The registrations changed: new local fences (and metadata to offer)."""
        host, device = [], []
        for registration in self._registrations.values():
            pairs = [(int(a), int(n)) for a, n in registration.rows[:, :2]]
            (device if registration.mem == VRAM else host).extend(pairs)
        self.host_ranges = _io.RangeSet(host)
        self.device_ranges = _io.RangeSet(device)
        self.serial += 1
