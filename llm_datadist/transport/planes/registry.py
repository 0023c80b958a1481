"""The registry of data planes: plane classes by name, and ``PlaneSet``, one engine's instances.

The package (``llm_datadist.transport.planes``) re-exports every name here and imports each plane
module once, which registers its plane with ``register``; code elsewhere (a test, an integration)
may register more. It lives apart from the package so that ``base.DataPlane`` can make a set of
its own (``sibling``) without importing the package that imports it.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Dict, Iterator, Mapping, Optional, Tuple, Type

from llm_datadist.status import LLMException, LLMStatusCode

if TYPE_CHECKING:  # a type only: base imports this module
    from llm_datadist.transport.planes.base import DataPlane

AUTO = "auto"
DATA_PLANE_OPTION = "llm.DataPlane"
DATA_PLANE_ENV = "LLM_DATADIST_DATA_PLANE"

_registry: Dict[str, Type[DataPlane]] = {}


def register(plane: Type[DataPlane]) -> Type[DataPlane]:
    """Add a plane class (usable as a decorator); a plane of the same name is replaced."""
    name = plane.name
    if not isinstance(name, str) or not name or name != name.strip().lower() or name == AUTO:
        raise ValueError(f"a data plane needs a lower-case name other than {AUTO!r}, got {name!r}")
    _registry[name] = plane
    return plane


def unregister(name: str) -> None:
    _registry.pop(name, None)


def _ordered() -> Tuple[Type[DataPlane], ...]:
    return tuple(sorted(_registry.values(), key=lambda p: (p.fallback, p.auto_rank, p.name)))


def names() -> Tuple[str, ...]:
    """Every registered plane, in the order ``auto`` would consider them."""
    return tuple(p.name for p in _ordered())


def host_names() -> Tuple[str, ...]:
    """The planes that move host memory (all but device-only ones such as cuda_ipc): what a link
    with host caches can be forced onto and report as its plane."""
    return tuple(p.name for p in _ordered() if p.host_memory)


def choices() -> Tuple[str, ...]:
    """The values ``llm.DataPlane`` takes: ``auto`` and every plane."""
    return (AUTO,) + names()


def get(name: str) -> Type[DataPlane]:
    """The plane class of ``name``; KeyError if none is registered."""
    return _registry[name]


def lookup(name: str) -> Optional[Type[DataPlane]]:
    """The plane class of a name or alias, or None."""
    name = name.strip().lower()
    if name in _registry:
        return _registry[name]
    return next((p for p in _registry.values() if name in p.aliases), None)


def auto_order() -> Tuple[str, ...]:
    """The planes ``auto`` tries, best first; the fallbacks come last."""
    return tuple(p.name for p in _ordered() if p.auto or p.fallback)


def fallbacks() -> Tuple[str, ...]:
    return tuple(p.name for p in _ordered() if p.fallback)


def offered(forced: str) -> Tuple[str, ...]:
    """The planes a side names in its link request or reply: all of them under ``auto``, else
    the forced one, the planes it works with (``DataPlane.uses``: shm -> cma) and the fallbacks."""
    if forced == AUTO:
        return names()
    uses = _registry[forced].uses if forced in _registry else ()
    return tuple(p.name for p in _ordered() if p.name == forced or p.name in uses or p.fallback)


def resolve(options: Mapping[str, str]) -> str:
    """``auto`` or the registered plane that ``llm.DataPlane`` (or ``LLM_DATADIST_DATA_PLANE``)
    names; ``LLMException(LLM_PARAM_INVALID)`` for any other value."""
    value = (options.get(DATA_PLANE_OPTION) or os.environ.get(DATA_PLANE_ENV) or AUTO).strip().lower()
    if value != AUTO and value not in _registry:
        raise LLMException(f"{DATA_PLANE_OPTION} must be one of {', '.join(choices())}, got {value!r}",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID)
    return value


class PlaneSet(Mapping[str, "DataPlane"]):
    """The plane instances of one engine: one of every registered plane, made when the set is
    (``eager``) or on first use (``instance``), never twice. As a mapping it holds the instances
    made so far, by name."""

    def __init__(self, engine: Any, eager: bool = True) -> None:
        self.engine = engine
        self._planes: Dict[str, DataPlane] = {}
        self._all: Tuple[DataPlane, ...] = ()
        self._lock = threading.Lock()
        if eager:
            for name in names():
                self.instance(name)

    def instance(self, name: str) -> DataPlane:
        """This engine's instance of the plane ``name``, made now if it was not yet (a plane
        registered after the set was made); KeyError if no such plane is registered."""
        plane = self._planes.get(name)
        if plane is not None:
            return plane
        with self._lock:
            plane = self._planes.get(name)
            if plane is None:
                plane = get(name)(self.engine)
                plane.join(self)
                self._planes[name] = plane
                self._all = tuple(self._planes.values())
            return plane

    def adopt(self, plane: DataPlane) -> None:
        """Take ``plane`` (made alone) as this set's instance of its name."""
        with self._lock:
            self._planes.setdefault(plane.name, plane)
            self._all = tuple(self._planes.values())

    @property
    def all(self) -> Tuple[DataPlane, ...]:
        """Every instance made so far (a snapshot)."""
        return self._all

    def __getitem__(self, name: str) -> DataPlane:
        return self._planes[name]

    def __iter__(self) -> Iterator[str]:
        return iter([plane.name for plane in self._all])

    def __len__(self) -> int:
        return len(self._all)
