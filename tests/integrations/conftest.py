"""Where ``LLM_DATADIST_REQUIRE_VLLM=1`` (``.ci/run`` sets it, having installed the vllm extra and
fetched vLLM's toy proxy), the vLLM connector's tests must run: a missing vLLM fails the run here,
and any test of this folder that skips anyway (for whatever reason) is reported as a failure
(the other optional dependencies: ``tests/optional_deps.py``).

``plain_engine``: the one plain engine (no connector) of the session on ``test_vllm``'s model, which
gives the baseline tokens of every module whose engines run that model with ``vllm_engine.py``'s
defaults."""

import os
from importlib.util import find_spec

import optional_deps
import pytest

REQUIRED = optional_deps.required("vllm")  # LLM_DATADIST_REQUIRE_VLLM=1

# The connector listens on this host's routable address by default (VLLM_HOST_IP, else the default
# route's): here, and in the engine processes the tests start, that is loopback, so that no test
# listens on or sends to an address outside this machine's loopback (the network-namespace tests
# set their own per namespace).
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

if REQUIRED and find_spec("vllm") is None:
    raise RuntimeError("LLM_DATADIST_REQUIRE_VLLM=1, but vLLM is not installed: the vLLM connector tests "
                       "(tests/integrations) would be skipped; pip install '.[vllm]'")


def pytest_sessionfinish(session, exitstatus):
    import forked

    left = forked.kill_leftovers()
    if left:
        print(f"\ntests/integrations: killed {left} forked vLLM engine(s) that no test closed")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRED and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (f"LLM_DATADIST_REQUIRE_VLLM=1: {item.nodeid} must run here, but it skipped: {reason}")


class SharedPlainEngine:
    """A plain engine on ``test_vllm.write_model``'s model (seed 0, ``GEOMETRY``) and
    ``vllm_engine.py``'s defaults, started at the first ``engine()`` call and kept for the session.
    (A module's fixture asks it for the baseline before it starts its own engines: engines that
    start together on two cores take longer than one after the other.)"""

    def __init__(self, work) -> None:
        self._work = work
        self._engine = None

    def engine(self):
        """The plain engine, ready (``test_vllm.Engine``)."""
        from test_vllm import Engine, write_model

        if self._engine is None:
            write_model(self._work / "model")
            engine = Engine(self._work / "model", "plain", self._work / "plain.log")
            try:
                engine.wait_ready()
            except BaseException:
                engine.close()
                raise
            self._engine = engine
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()


@pytest.fixture(scope="session")
def plain_engine(tmp_path_factory):
    shared = SharedPlainEngine(tmp_path_factory.mktemp("vllm-plain"))
    try:
        yield shared
    finally:
        shared.close()
