"""Facts about this installation and this host: ``python -m llm_datadist info`` and the headers of
the demo's and the sweep's reports.

Each fact about a runtime or a data plane is a string ``"available: why"`` or ``"not available:
why"``; the data planes are tried for real, each by its own ``DataPlane.probe`` (``tcp``: a
loopback connection; ``cma``: a ``process_vm_readv`` of this process made by a separate one, what
a peer's link-time probe does). ``budgets`` lists the bounds on what peers can make this process
hold, as the environment sets them (docs/security.md).
"""

from __future__ import annotations

import os
import platform
from typing import Dict, Optional

def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cpu_model() -> str:
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def available_memory() -> Optional[int]:
    """``MemAvailable`` in bytes (None where /proc/meminfo does not say)."""
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            try:
                return int(line.split()[1]) * 1024
            except (ValueError, IndexError):
                return None
    return None


#: The demo and the bench refuse to start when their caches would take more than this share of
#: the available memory.
MEMORY_SHARE = 0.5


def memory_shortfall(needed: int) -> Optional[str]:
    """Why ``needed`` bytes are too many for this machine, or None if they fit (or it cannot tell)."""
    from llm_datadist.cli.console import format_size
    available = available_memory()
    if available is None or needed <= MEMORY_SHARE * available:
        return None
    return f"{format_size(needed)}, more than {MEMORY_SHARE:.0%} of the {format_size(available)} available"


def host_facts() -> Dict[str, object]:
    return dict(machine=platform.machine(), cpu=cpu_model(), cpus=os.cpu_count(),
                kernel=platform.release(), python=platform.python_version())


def build_facts() -> Dict[str, object]:
    """Version, debug or release, Cython version and the compiler command line recorded at build
    time (``_build_info.py``, written by setup.py)."""
    import numpy

    import llm_datadist
    from llm_datadist.cli import lowlevel
    facts: Dict[str, object] = dict(version=llm_datadist.__version__, python=platform.python_version(),
                                    numpy=numpy.__version__,
                                    build="debug" if lowlevel.DEBUG_BUILD else "release",
                                    cython=lowlevel.CYTHON_VERSION,
                                    location=os.path.dirname(os.path.abspath(llm_datadist.__file__)))
    try:
        from llm_datadist import _build_info as recorded
    except ImportError:
        facts["compile_flags"] = "not recorded (built without setup.py's build_ext, or before it recorded them)"
        return facts
    # The interpreter's flags (as distutils passes them), then the extension's own.
    command = list(recorded.COMPILER_COMMAND) + list(recorded.EXTRA_COMPILE_ARGS.get("llm_datadist._core", []))
    facts["compiler"] = command[0]
    facts["compile_flags"] = " ".join(command[1:])
    facts["macros"] = " ".join(recorded.DEFINE_MACROS.get("llm_datadist._core", []))
    facts["cython_directives"] = ", ".join(f"{k}={v}" for k, v in recorded.CYTHON_DIRECTIVES.items())
    facts["built_with"] = f"Cython {recorded.CYTHON_VERSION}, numpy {recorded.NUMPY_BUILD_VERSION}, " \
                          f"Python {recorded.PYTHON_BUILD_VERSION}"
    if recorded.DEBUG != lowlevel.DEBUG_BUILD:
        facts["compile_flags"] += (" (recorded by another build than the extension loaded: it was "
                                   "skipped as up to date; rebuild with --force)")
    return facts


def runtime_facts() -> Dict[str, object]:
    """The device runtime this process would use, and every registered runtime's availability
    and capabilities: those its loaded library reports where it loads, else the registry's; and
    for each runtime whose library loads, the file and how it was found (``runtime_libraries``)."""
    from llm_datadist import LLMException, runtimes
    from llm_datadist.cli import lowlevel
    facts: Dict[str, object] = {}
    try:
        runtime, reason = runtimes.select_runtime()
        facts["device_runtime"] = f"{runtime.name} ({reason})"
    except LLMException as exc:
        facts["device_runtime"] = f"unusable: {str(exc).split(' (status_code')[0]}"
    facts["runtimes"] = {name: ("available: " if ok else "not available: ") + why
                         for name, (ok, why) in ((n, runtimes.probe(n)) for n in runtimes.names())}
    capabilities, libraries = {}, {}
    for name in runtimes.names():
        spec = runtimes.get(name)
        try:
            runtime = runtimes.load(name)
            bits = runtime.capabilities
            if spec.library is not None:
                libraries[name] = runtimes.library_file(runtime)
            listed = sorted(cap for cap, bit in lowlevel.CAPABILITIES.items() if bits & bit)
            where = "" if spec.library is None else " (reported by the loaded library)"
        except LLMException:
            listed = sorted(spec.capabilities)
            where = " (as registered; the library does not load here)"
        capabilities[name] = (", ".join(listed) or "none") + where
    facts["runtime_capabilities"] = capabilities
    facts["runtime_libraries"] = libraries or "none loads here"
    return facts


def _plane_probes() -> Dict[str, tuple]:
    from llm_datadist.transport import planes as registry
    probes = {"local": (True, "copies and swaps inside one process (device runtime memcpy)")}
    probes.update((name, registry.get(name).probe()) for name in registry.names())
    return probes


def _moves_device_memory(name: str) -> bool:
    from llm_datadist.transport import planes as registry
    return name != "local" and bool(getattr(registry.get(name), "device_memory", False))


def plane_facts(probes: Optional[Dict[str, tuple]] = None) -> Dict[str, str]:
    """``local`` and every registered data plane, each tried for real (``DataPlane.probe``);
    a plane that moves device memory the host cannot address (``DataPlane.device_memory``:
    cuda_ipc, staging) says so."""
    probes = _plane_probes() if probes is None else probes
    return {name: ("available: " if ok else "not available: ") + why
            + (" [moves device memory]" if _moves_device_memory(name) else "")
            for name, (ok, why) in probes.items()}


def plane_trust_facts() -> Dict[str, str]:
    """Which peers get what a data plane exposes of this process (``DataPlane.trust``), for the
    planes that say (cuda_ipc: who receives its IPC handles, and that a handle names a whole
    allocation)."""
    from llm_datadist.transport import planes as registry
    notes = ((name, registry.get(name).trust()) for name in registry.names())
    return {name: note for name, note in notes if note}


def device_transfer_facts(probes: Dict[str, tuple]) -> str:
    """How DEVICE caches of the selected runtime move between processes here."""
    from llm_datadist import LLMException, runtimes
    try:
        runtime, _ = runtimes.select_runtime()
    except LLMException:
        return "no device runtime is usable"
    if runtime.host_addressable:
        return f"{runtime.name} device memory is host memory: every data plane carries it"
    carriers = [name for name in probes if _moves_device_memory(name)]
    if not carriers:
        return (f"{runtime.name} device memory cannot move between processes: no data plane that moves "
                f"device memory is registered (LLM_FEATURE_NOT_ENABLED)")
    usable = [name for name in carriers if probes[name][0]]
    listed = ", ".join(f"{name} ({'available' if probes[name][0] else 'not available'})" for name in carriers)
    if not usable:
        return f"{runtime.name} device memory: no plane that moves it is usable here: {listed}"
    return f"{runtime.name} device memory moves over {listed}"


def budget_facts() -> Dict[str, str]:
    """The bounds on what peers can make this process hold (``transport.budgets.in_force``):
    each one's value, what it covers, the environment variable that sets it and its default,
    and what happens beyond it (with the counter of ``LLMDataDist.engine.link_stats()`` that
    counts it)."""
    from llm_datadist.cli.console import format_size
    from llm_datadist.transport import budgets

    def amount(value: int, unit: str) -> str:
        return format_size(value) if unit == "bytes" else f"{value} {unit}"

    facts = {}
    for budget in budgets.in_force():
        exact = f" ({budget.value} bytes)" if budget.unit == "bytes" else ""
        source = "fixed" if budget.env is None else f"{budget.env}, default {amount(budget.default, budget.unit)}"
        facts[budget.name] = (f"{amount(budget.value, budget.unit)}{exact} per {budget.scope} ({source}); "
                              f"beyond it: {budget.refusal}")
    return facts


def all_facts() -> Dict[str, object]:
    facts = build_facts()
    facts.update(runtime_facts())
    probes = _plane_probes()
    facts["data_planes"] = plane_facts(probes)
    facts["data_plane_trust"] = plane_trust_facts()
    facts["device_transfers"] = device_transfer_facts(probes)
    facts["budgets"] = budget_facts()
    facts["host"] = host_facts()
    return facts
