"""The registry of data planes.

Every module of this package (other than ``base``; ``registry``, which holds the registry's state
and ``PlaneSet``, which this package re-exports; and ``choice``: which planes a link uses) is
imported once and registers its plane with ``register``; code elsewhere (a test, an integration)
may register more. Everything that lists planes -- ``llm.DataPlane`` values, the CLI's choices,
``info``, the benchmarks -- asks this registry, so adding a plane is adding its module.

The registry holds plane *classes*; ``PlaneSet`` holds the *instances* of one engine (one of each
registered plane, made on first use). The link manager owns an engine's set, and a plane that
hands some transfers to another (cuda_ipc -> staging) reaches that plane's instance through the set
(``DataPlane.sibling``) rather than making its own.
"""

from __future__ import annotations

import importlib
import pkgutil

from llm_datadist.transport.planes.base import DataPlane
from llm_datadist.transport.planes.registry import (
    AUTO, DATA_PLANE_ENV, DATA_PLANE_OPTION, PlaneSet, auto_order, choices, fallbacks, get, host_names, lookup, names,
    offered, register, resolve, unregister,
)

__all__ = ["DataPlane", "register", "unregister", "names", "host_names", "get", "choices", "auto_order", "offered",
           "resolve", "fallbacks", "lookup", "PlaneSet", "AUTO", "DATA_PLANE_OPTION", "DATA_PLANE_ENV"]


def _discover() -> None:
    for module in pkgutil.iter_modules(__path__):
        if module.name not in ("base", "registry", "choice") and not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")


_discover()
