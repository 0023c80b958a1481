"""What a device runtime is, as the registry knows it: ``RuntimeSpec``.

Each runtime's module in this package (``host``, ``cpu``, ``acl``, ``cuda``) declares its ``SPEC``
with it; the registry (``llm_datadist.runtimes``) registers them, and re-exports both names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, Optional, Sequence, Tuple

from llm_datadist import _core

#: What a runtime can do; the same names as ``_core.CAPABILITIES`` (the table's bits).
CAPABILITY_NAMES: Tuple[str, ...] = tuple(_core.CAPABILITIES)


@dataclass(frozen=True)
class RuntimeSpec:
    """One device runtime as the registry knows it.

    ``binding`` names the core binding that fills the runtime's table (``_core.bindings()``);
    ``library``/``library_env`` are the default shared library and the variable overriding it,
    for bindings that open one. ``capabilities`` must equal what that binding reports once loaded
    (tests/core/test_runtimes.py checks every registered runtime). ``auto_priority`` orders
    ``auto`` selection, lowest first; None keeps the runtime out of it. ``selectable`` False keeps
    it out of ``LLM_DATADIST_DEVICE`` (the ``host`` runtime of host memory). ``usable`` is an
    extra check after loading: it returns why the loaded runtime cannot be used, or None.
    ``tensor_devices`` are the torch device types whose tensors hold this runtime's memory.
    ``search`` lists where to look for the library when ``library_env`` is unset: ``(name or
    path, where it comes from)`` pairs, tried in order until one loads.
    """

    name: str
    binding: str
    description: str
    aliases: Tuple[str, ...] = ()
    library: Optional[str] = None
    library_env: Optional[str] = None
    capabilities: FrozenSet[str] = frozenset()
    auto_priority: Optional[int] = None
    selectable: bool = True
    usable: Optional[Callable[[_core.Runtime], Optional[str]]] = field(default=None, compare=False)
    tensor_devices: Tuple[str, ...] = ()
    search: Optional[Callable[[], Sequence[Tuple[str, str]]]] = field(default=None, compare=False)

    @property
    def host_addressable(self) -> bool:
        return "host_addressable" in self.capabilities

    def capability_flags(self) -> Dict[str, bool]:
        """Every capability name with whether this runtime has it."""
        return {name: name in self.capabilities for name in CAPABILITY_NAMES}

    def library_path(self) -> Optional[str]:
        """The shared library to open: ``library_env``'s value if set, else ``library``."""
        if self.library_env and os.environ.get(self.library_env):
            return os.environ[self.library_env]
        return self.library

    def library_candidates(self) -> Tuple[Tuple[str, str], ...]:
        """``(library to open, where it comes from)`` pairs, to try in order: ``library_env``'s
        value alone if set, else what ``search`` finds, else ``library``."""
        if self.library_env and os.environ.get(self.library_env):
            return ((os.environ[self.library_env], f"{self.library_env}"),)
        found = tuple(self.search()) if self.search is not None else ()
        if found:
            return found
        return ((self.library, "the default name"),) if self.library else ()
