"""Who waits for a handshake slot, and under which source a same-host link counts (issue 32, the
second attacker's review of protocol 8). Each test failed before its fix:

* a stranger with 6 loopback addresses filled the waiting room (its total was not shared out by
  source) and every honest link was refused: now a newcomer takes the place of a waiter of the
  source waiting most (``Listener._may_wait``);
* a same-host link's source was its request's loopback address for the link cap but its uid once
  linked, so the per-source cap never applied to same-host links, while TCP links from 127.0.0.1
  used up the share of every same-host cluster: now a request that will come over the Unix socket
  counts under the uid it states (held to it by ``SO_PEERCRED``) from the start."""

from __future__ import annotations

import time
from contextlib import ExitStack

import pytest

from llm_datadist.status import LLMStatusCode
from llm_datadist.testing import Cluster, link, _link
from llm_datadist.transport import auth, protection
from llm_datadist.transport.host import host_identity

import rawpeer
from cluster_ops import py_unlink, wait_for
from flood import Flood

S = LLMStatusCode
SECRET = "correct horse battery staple"
SERVER_ID, CLIENT_ID = 1, 2


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (auth.SECRET_ENV, protection.ENV, "LLM_DATADIST_DATA_PLANE"):
        monkeypatch.delenv(name, raising=False)


def start(stack, cluster_id, listen=False, plane=None):
    return stack.enter_context(Cluster(cluster_id, "PROMPT" if listen else "DECODER", listen=listen, plane=plane,
                                       options={"llm.LinkSecret": SECRET}, timeout=60.0))


def stats(state):
    return dict(state.dd.engine.links.stats)


def waiting(state):
    lst = state.dd.engine.links.listener.slots
    return lst._waiting_total, len(lst._preauth), {s: len(w) for s, w in lst._waiters.items()}


def full(state):
    """Whether the pre-auth pool and the waiting room are both full."""
    lst = state.dd.engine.links.listener.slots
    return len(lst._preauth) >= lst.max_pending and lst._waiting_total >= lst.max_pending


def linked(state):
    return sorted(state.dd.engine.links._peers)


def sources(state):
    return {k: p.source for k, p in state.dd.engine.links._peers.items()}


SOURCES = [f"127.0.0.{i}" for i in range(2, 8)]


def test_a_multi_address_stranger_filling_the_waiting_room_keeps_honest_links_out():
    """A stranger without the secret, 32 idle connections from each of 6 loopback addresses (192,
    each reopened at once): 64 fill the pre-auth pool and 64 the waiting room (its total cap is
    not per source). An honest same-host cluster's link request and its Unix data connections
    found no slot and no room to wait, and were closed at once: the link failed."""
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        client = start(stack, CLIENT_ID)
        flood = stack.enter_context(Flood(server.address, SOURCES, 32, ("idle",)))
        assert wait_for(lambda: flood.opened > 300 and server.call(full), 15), server.call(waiting)
        target = [(SERVER_ID, *server.address)]
        results, times = [], []
        for _ in range(10):
            t0 = time.monotonic()
            status = link(client, server, 2000)
            times.append(round(time.monotonic() - t0, 2))
            results.append(status)
            if status == (S.LLM_SUCCESS, [S.LLM_SUCCESS]):
                client.call(py_unlink, target, 2000)
        print("results", results, "times", times, "stats", server.call(stats), "opened", flood.opened)
        ok = sum(r == (S.LLM_SUCCESS, [S.LLM_SUCCESS]) for r in results)
        assert ok >= 9, results


def test_the_per_source_link_cap_holds_for_same_host_links(monkeypatch):
    """LLM_DATADIST_MAX_LINKS_PER_SOURCE=2: one local user (with the secret) asks for links that
    come over Unix sockets. The cap is checked against the link request's TCP address
    (("ip", "127.0.0.1")) while an accepted same-host link was counted under ("uid", uid): the
    count was always 0, so the cap never applied (links over TCP, the control, are capped)."""
    monkeypatch.setenv("LLM_DATADIST_MAX_LINKS_PER_SOURCE", "2")
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        key = SECRET.encode()
        tcp = []
        for cid in (80, 81, 82):
            try:
                tcp.append(rawpeer.RawLink(server.address, cid, key, planes=["tcp"], host={}))
                stack.callback(tcp[-1].close)
            except rawpeer.Refused as refused:
                print("tcp link", cid, "refused:", refused.message.get("error"))
        assert len(tcp) == 2  # control: the cap holds over TCP
        for raw in tcp:
            raw.close()
        assert wait_for(lambda: not server.call(linked), 10)
        unix = []
        for cid in range(90, 96):
            try:
                unix.append(rawpeer.RawLink(server.address, cid, key, unix=True, host=host_identity(),
                                            planes=["cma", "tcp"]))
                stack.callback(unix[-1].close)
            except rawpeer.Refused as refused:
                print("unix link", cid, "refused:", refused.message.get("error"))
        print("server links:", server.call(sources))
        assert len(unix) <= 2, f"{len(unix)} same-host links of one uid under a per-source cap of 2"


def test_tcp_links_from_127_0_0_1_do_not_use_up_the_share_of_same_host_links(monkeypatch):
    """LLM_DATADIST_MAX_LINKS_PER_SOURCE=2: a hostile local peer (with the secret) holds 2 links
    over TCP from 127.0.0.1 stating no host. An honest same-host cluster (another uid in real life;
    its links are accounted under its uid) asks for a link: its request's TCP connection comes from
    127.0.0.1 too, so it was refused for the hostile peer's share."""
    monkeypatch.setenv("LLM_DATADIST_MAX_LINKS_PER_SOURCE", "2")
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        client = start(stack, CLIENT_ID)
        key = SECRET.encode()
        for cid in (80, 81):
            stack.callback(rawpeer.RawLink(server.address, cid, key, planes=["tcp"], host={}).close)
        status = client.call(_link, SERVER_ID, *server.address, 3000)
        print("honest link:", status, server.call(sources))
        assert status == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
