"""Fixtures for the transport tests: real clusters in real processes, over each data plane.

Every test of ``test_examples.py``, ``test_transfers.py`` and ``test_links.py`` asks for the
``plane`` fixture (directly or through a cluster fixture), so each runs once over the same-host
plane (``cma``: process_vm_readv/writev) and once over ``tcp`` -- once over every registered
data plane (``transport.planes``) that serves links without a secret (these clusters have none;
a plane that ``requires_secret``, nixl, has its own tests: ``planes/test_plane_nixl.py``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List

import pytest

from llm_datadist.testing import Cluster
from llm_datadist.transport import planes

PLANES = [name for name in planes.host_names() if not planes.get(name).requires_secret]


@pytest.fixture(scope="session", params=PLANES, ids=PLANES)
def plane(request) -> str:
    """The data plane forced in every cluster a test starts (``LLM_DATADIST_DATA_PLANE``)."""
    return request.param


class ClusterPool:
    """Starts clusters on one plane and closes every one of them, whatever happens."""

    def __init__(self, plane: str) -> None:
        self.plane = plane
        self._stack = contextlib.ExitStack()
        self.started: List[Cluster] = []

    def start(self, cluster_id: int, role: str = "PROMPT", listen: bool = False, api: str = "python",
              options=None) -> Cluster:
        cluster = self._stack.enter_context(Cluster(cluster_id, role=role, listen=listen, plane=self.plane,
                                                    options=options, api=api, timeout=30.0))
        self.started.append(cluster)
        return cluster

    def close(self) -> None:
        self._stack.close()
        for cluster in self.started:
            assert not cluster.process.is_alive(), f"cluster {cluster.cluster_id} outlived its test"


@pytest.fixture
def clusters(plane) -> Iterator[ClusterPool]:
    """Clusters for one test; all of them are finalized and their processes reaped afterwards."""
    pool = ClusterPool(plane)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module")
def module_clusters(plane) -> Iterator[ClusterPool]:
    """Clusters shared by the tests of one module (per plane)."""
    pool = ClusterPool(plane)
    try:
        yield pool
    finally:
        pool.close()
