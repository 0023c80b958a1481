"""Strangers cannot starve authenticated peers of handshake slots (the listener's pre-authentication
pool, ``transport.listener``): a stranger without the secret that holds every slot it can get, from
two loopback addresses, reopening each connection the moment the server closes it, does not keep
a cluster with the secret from linking.

The server and the linking cluster are real processes (``llm_datadist.testing``); the stranger is
another (``flood``)."""

from __future__ import annotations

import time
from contextlib import ExitStack

import pytest

from llm_datadist.status import LLMStatusCode
from llm_datadist.testing import Cluster, link
from llm_datadist.transport import auth

from cluster_ops import py_unlink, wait_for
from flood import Flood

S = LLMStatusCode
SECRET = "correct horse battery staple"
SERVER_ID, CLIENT_ID = 1, 2
ATTEMPTS = 20
LINK_MS = 2000


def pending(state) -> int:
    return len(state.dd.engine.links.listener.pending())


def stats(state):
    return dict(state.dd.engine.links.stats)


@pytest.fixture(autouse=True)
def _no_inherited_secret(monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv("LLM_DATADIST_DATA_PLANE", raising=False)


def start(stack: ExitStack, cluster_id: int, listen: bool = False) -> Cluster:
    return stack.enter_context(Cluster(cluster_id, "PROMPT" if listen else "DECODER", listen=listen,
                                       options={"llm.LinkSecret": SECRET}, timeout=60.0))


@pytest.mark.parametrize("modes", [("idle",), ("partial", "hello")], ids=["idle", "partial+hello"])
def test_a_stranger_holding_every_slot_does_not_keep_an_authenticated_peer_out(modes):
    """32 connections from 127.0.0.1 and 32 from 127.0.0.2 (the per-source cap, and all 64 slots),
    each reopened as soon as it closes: the cluster with the secret links in at least 19 of 20
    attempts, each within 2 s, and unlinks after each."""
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        client = start(stack, CLIENT_ID)
        flood = stack.enter_context(Flood(server.address, ["127.0.0.1", "127.0.0.2"], 32, modes))
        assert wait_for(lambda: flood.held == 64 and server.call(pending) == 64, 10), (flood.held, server.call(pending))
        target = [(SERVER_ID, *server.address)]
        times, failures = [], []
        for attempt in range(ATTEMPTS):
            started = time.monotonic()
            status = link(client, server, LINK_MS)
            times.append(time.monotonic() - started)
            if status != (S.LLM_SUCCESS, [S.LLM_SUCCESS]):
                failures.append((attempt, status))
                continue
            assert client.call(py_unlink, target, LINK_MS) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        counted = server.call(stats)
        print(f"modes {modes}: {ATTEMPTS - len(failures)}/{ATTEMPTS} linked; link times (s): "
              f"median {sorted(times)[len(times) // 2]:.3f}, max {max(times):.3f}; stranger connections opened: "
              f"{flood.opened}; server counters: {counted}")
        assert len(failures) <= 1, failures
        assert max(times) < LINK_MS / 1000 + 0.5, times
        assert counted["preauth_evicted"] > 0
        assert wait_for(lambda: server.call(pending) == 64, 5)  # the stranger still holds every slot
