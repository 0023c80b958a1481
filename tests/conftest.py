"""Suite-wide defaults.

The device runtime behind ``Placement.DEVICE`` is ``cpu`` (device memory emulated in host RAM)
unless a test, or the person running the suite, chooses another. Most tests register numpy memory
as DEVICE caches, read caches back as numpy views and move them between processes, which needs a
host-addressable runtime; on a machine with a GPU or NPU, ``auto`` would pick the accelerator and
those tests would be testing something else. Tests of the accelerator runtimes set
``LLM_DATADIST_DEVICE`` themselves (``tests/core/test_runtimes.py``). It is set here, at import,
so that the cluster processes the tests start inherit it.

The whole suite runs in pytest-xdist workers (``pytest_cmdline_main``, ``tests/xdist_workers.py``).
"""

import os

os.environ.setdefault("LLM_DATADIST_DEVICE", "cpu")

# The stub ACL/CUDA runtime (tests/runtime_stub.py) for every test that needs a device runtime
# which is not host-addressable without an accelerator.
from runtime_stub import make_stub, stub, stub_libraries  # noqa: E402,F401

import pytest  # noqa: E402
from xdist_workers import default_workers  # noqa: E402


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The whole suite (``python -m pytest`` with no paths: the README's test command) runs in
    ``default_workers`` xdist workers where pytest-xdist is installed (the ``test`` extra) and the
    command line chose nothing itself (``-n``, ``--dist``, ``--pdb``, ``--collect-only`` or a path).
    Most of its time is spent waiting on other processes (clusters, vLLM engines), so two workers on
    two cores take about 0.6 of one. The vLLM modules run in groups of one module each
    (``pytest_collection_modifyitems``): a module's engines live in one worker."""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return
    option = config.option
    if option.numprocesses and option.dist == "no" and not option.distload:
        option.dist = "loadgroup"  # (``-n N`` alone: still one worker per vLLM module)
        return
    source = getattr(pytest.Config, "ArgsSource", None)  # pytest >= 7.2
    whole_suite = source is not None and config.args_source == source.TESTPATHS
    if (not whole_suite or option.numprocesses is not None
            or option.dist != "no" or option.usepdb or option.collectonly):
        return
    workers = default_workers(os.cpu_count() or 1)
    if workers:
        option.numprocesses = workers
        option.dist = "loadgroup"
        if hasattr(option, "benchmark_disable"):  # no test here is a benchmark (they live in bench/)
            option.benchmark_disable = True


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Tells each xdist worker the distribution mode chosen here: a worker parses the command line
    again, so ``pytest_cmdline_main``'s choice of ``loadgroup`` would not reach it, and it would not
    name its items' groups (``pytest_collection_modifyitems``)."""
    node.workerinput["llm_datadist_dist"] = node.config.option.dist


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A vLLM module's tests share the module's engines (module-scoped fixtures): under xdist they
    run as one group, in one worker, so that no engine is started twice. (First: a worker's xdist
    plugin names each item's group from these marks in its own hook, which would otherwise run
    before this one and find none.)"""
    if getattr(config, "workerinput", {}).get("llm_datadist_dist") == "loadgroup":
        config.option.loadgroup = True  # (what the worker's xdist reads: ``pytest_configure_node``)
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path.startswith("tests/integrations/"):
            item.add_marker(pytest.mark.xdist_group(path))
