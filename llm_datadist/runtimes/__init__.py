"""The device runtime registry: which runtimes exist, what they can do, and which one
``Placement.DEVICE`` memory uses in this process.

A runtime is one :class:`RuntimeSpec` (``spec.py``), declared by its own module in this package
(``host``, ``cpu``, ``acl``, ``cuda``) and registered here: its name and aliases, the core
binding that fills its function table, its default shared library and the environment variable
that overrides it, how it is probed, and its capabilities. Nothing outside this package compares
runtime names; callers ask a spec or a loaded runtime (``runtime.host_addressable``) instead.

``LLM_DATADIST_DEVICE`` picks the runtime: ``auto`` (default) or any registered name or alias
(``cpu``, ``acl``/``ascend``/``npu``, ``cuda``/``gpu``). ``auto`` tries the runtimes with an
``auto_priority`` in that order (acl, cuda, then cpu) and takes the first usable one.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Dict, Optional, Tuple

from llm_datadist import _core
from llm_datadist._validate import param_invalid
from llm_datadist.runtimes.spec import CAPABILITY_NAMES, RuntimeSpec
from llm_datadist.status import LLMException, LLMStatusCode

logger = logging.getLogger("llm_datadist")

DEVICE_ENV = "LLM_DATADIST_DEVICE"

_registry: Dict[str, RuntimeSpec] = {}
_aliases: Dict[str, str] = {}
_lock = threading.RLock()
_chosen: Dict[tuple, Tuple[object, str]] = {}
#: (runtime name, library as opened) -> which candidate of the spec found it (``library_file``)
_origins: Dict[Tuple[str, str], str] = {}
#: runtime name -> the runtime its spec's search loaded (without the library variable)
_searched: Dict[str, _core.Runtime] = {}
#: dlinfo's request for the link map of a handle (<dlfcn.h>)
_RTLD_DI_LINKMAP = 2


def register(spec: RuntimeSpec) -> RuntimeSpec:
    """Add ``spec`` to the registry; a name or alias already taken raises ValueError."""
    unknown = set(spec.capabilities) - set(CAPABILITY_NAMES)
    if unknown:
        raise ValueError(f"runtime {spec.name}: unknown capabilities {sorted(unknown)}")
    if spec.binding not in _core.bindings():
        raise ValueError(f"runtime {spec.name}: the core has no binding {spec.binding!r}")
    keys = [spec.name, *spec.aliases]
    with _lock:
        for key in keys:
            if key != key.strip().lower() or key in ("", "auto") or key in _aliases:
                raise ValueError(f"runtime {spec.name}: the name {key!r} is reserved or taken")
        _registry[spec.name] = spec
        for key in keys:
            _aliases[key] = spec.name
        _chosen.clear()
    return spec


def unregister(name: str) -> None:
    """Remove runtime ``name`` and its aliases (tests register temporary runtimes)."""
    with _lock:
        spec = _registry.pop(name)
        _searched.pop(name, None)
        for key in (spec.name, *spec.aliases):
            _aliases.pop(key, None)
        _chosen.clear()


def names(selectable_only: bool = True) -> Tuple[str, ...]:
    """Registered runtime names in registration order (only ``LLM_DATADIST_DEVICE`` values
    unless ``selectable_only`` is False)."""
    return tuple(name for name, spec in _registry.items() if spec.selectable or not selectable_only)


def choices() -> Tuple[str, ...]:
    """The canonical ``LLM_DATADIST_DEVICE`` values: ``auto`` and every selectable runtime."""
    return ("auto",) + names()


def aliases() -> Dict[str, str]:
    """Every accepted ``LLM_DATADIST_DEVICE`` value (names and aliases) -> runtime name."""
    return {key: name for key, name in _aliases.items() if _registry[name].selectable}


def auto_order() -> Tuple[str, ...]:
    """The runtimes ``auto`` tries, first to last."""
    ranked = [spec for spec in _registry.values() if spec.auto_priority is not None and spec.selectable]
    return tuple(spec.name for spec in sorted(ranked, key=lambda spec: spec.auto_priority))


def get(name: str) -> RuntimeSpec:
    """The spec of runtime ``name`` (or alias); ``LLMException(LLM_PARAM_INVALID)`` if unknown."""
    spec_name = _aliases.get(name.strip().lower()) if isinstance(name, str) else None
    if spec_name is None:
        raise param_invalid(f"unknown device runtime {name!r}; expected one of {', '.join(names(False))}")
    return _registry[spec_name]


def load(name: str, library: Optional[str] = None) -> _core.Runtime:
    """Runtime ``name`` loaded through its binding from ``library``, by default the first of the
    spec's ``library_candidates()`` that loads (``LLMException(LLM_FAILED)`` saying what each
    candidate answered if none does); cached by the core per (name, binding, library)."""
    spec = get(name)
    if library is not None or not spec.library:
        return _core.load_runtime(spec.name, library or spec.library_path(), binding=spec.binding)
    searching = not (spec.library_env and os.environ.get(spec.library_env))
    if searching and spec.name in _searched:
        # what the search found first stays this process's copy (the search would now also
        # find it as already loaded, under another name)
        return _searched[spec.name]
    failures = []
    for candidate, origin in spec.library_candidates():
        try:
            runtime = _core.load_runtime(spec.name, candidate, binding=spec.binding)
        except LLMException as exc:
            if exc.status_code != LLMStatusCode.LLM_FAILED:
                raise
            failures.append(str(exc).split(" (status_code")[0])
            continue
        with _lock:
            _origins.setdefault((spec.name, runtime.library), origin)
            if searching:
                runtime = _searched.setdefault(spec.name, runtime)
        return runtime
    if len(failures) == 1:
        raise LLMException(failures[0], status_code=LLMStatusCode.LLM_FAILED)
    prefix = f"cannot load the {spec.name} runtime library "
    tried = "; ".join(failure[len(prefix):] if failure.startswith(prefix) else failure for failure in failures)
    raise LLMException(f"cannot load the {spec.name} runtime library; tried {tried}",
                       status_code=LLMStatusCode.LLM_FAILED)


def library_file(runtime: _core.Runtime) -> Optional[str]:
    """``"<file> (<where it came from>)"``: the file ``runtime``'s library was loaded from (links
    resolved; the name itself where this process cannot tell) and which candidate of its spec
    found it; None for a runtime without a library."""
    if not runtime.library:
        return None
    path = os.path.realpath(runtime.library) if os.path.isabs(runtime.library) else \
        _loaded_file(runtime.library) or runtime.library
    origin = _origins.get((runtime.name, runtime.library))
    return f"{path} ({origin})" if origin else path


def _loaded_file(name: str) -> Optional[str]:
    """The file the dynamic loader opened for ``name`` in this process (its link map's path),
    or None where it cannot say; never loads anything."""
    try:
        handle = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)._handle
        dlinfo = ctypes.CDLL(None).dlinfo
    except (OSError, AttributeError):
        return None
    link_map = ctypes.c_void_p()
    if dlinfo(ctypes.c_void_p(handle), _RTLD_DI_LINKMAP, ctypes.byref(link_map)) != 0 or not link_map.value:
        return None
    # struct link_map { ElfW(Addr) l_addr; char *l_name; ... }
    l_name = ctypes.c_char_p.from_address(link_map.value + ctypes.sizeof(ctypes.c_void_p)).value
    return os.path.realpath(l_name.decode(errors="replace")) if l_name else None


def probe(name: str) -> Tuple[bool, str]:
    """Whether runtime ``name`` can be used here, and why (or why not)."""
    spec = get(name)
    try:
        runtime = load(spec.name)
    except LLMException as exc:
        return False, str(exc).split(" (status_code")[0]
    if not runtime.library:
        return True, f"always available ({spec.description})"
    why_not = spec.usable(runtime) if spec.usable is not None else None
    if why_not:
        return False, why_not
    return True, f"{runtime.library} loaded"


def select_runtime():
    """``(runtime, reason)`` for this process's configuration; logged once per configuration."""
    requested = os.environ.get(DEVICE_ENV, "auto").strip().lower()
    accepted = aliases()
    if requested not in ("", "auto") and requested not in accepted:
        raise param_invalid(f"{DEVICE_ENV}={requested!r} is not one of {', '.join(choices())}")
    name = accepted.get(requested, "auto")
    with _lock:
        key = (name,) + tuple((spec.library_env, os.environ.get(spec.library_env))
                              for spec in _registry.values() if spec.library_env)
        if key in _chosen:
            return _chosen[key]
        if name == "auto":
            for candidate in auto_order():
                usable, why = probe(candidate)
                if usable:
                    name, reason = candidate, f"auto-detected: {why}"
                    break
            else:
                raise LLMException("no device runtime is usable", status_code=LLMStatusCode.LLM_FAILED)
        else:
            usable, why = probe(name)
            if not usable:
                raise LLMException(f"{DEVICE_ENV}={requested} but the runtime is not usable: {why}",
                                   status_code=LLMStatusCode.LLM_FAILED)
            reason = f"{DEVICE_ENV}={requested}: {why}"
        runtime = load(name)
        logger.info("llm_datadist device runtime: %s (%s)", name, reason)
        _chosen[key] = (runtime, reason)
        return runtime, reason


def host_addressable_fallback() -> str:
    """The first runtime in ``auto`` order whose device memory is host memory (``cpu``): what a
    caller that needs host-addressable DEVICE memory uses when the selected runtime's is not."""
    for name in auto_order():
        if get(name).host_addressable and probe(name)[0]:
            return name
    raise LLMException("no host-addressable device runtime is registered", status_code=LLMStatusCode.LLM_FAILED)


def tensor_devices(name: str) -> Tuple[str, ...]:
    """Torch device types (besides ``cpu``) whose tensors may be registered with runtime ``name``."""
    return get(name).tensor_devices


# The built-in runtimes, each declared by its module (``SPEC``), in registration order; a new
# runtime is one more module here.
from llm_datadist.runtimes import host, cpu, acl, cuda  # noqa: E402

for _module in (host, cpu, acl, cuda):
    register(_module.SPEC)
del _module
