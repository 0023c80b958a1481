"""Links between two processes of one host travel over the server's Unix socket only, and are
accounted under the uid the kernel proved (issue 32, the attacker's review of protocol 8).

Found: a stranger of another user that floods the server's abstract Unix socket (its name is in
``/proc/net/unix``) filled its accept backlog; the client's Unix connect then failed with EAGAIN
and the link fell back to TCP -- through a relay on the link's TCP path, which read and changed
the pushed KV bytes on a link with a secret -- or failed. And an accepted same-host link was
budgeted under 127.0.0.1, the source every local process of every user shares. Each test here
failed before its fix.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from contextlib import ExitStack

import pytest

from llm_datadist.status import LLMStatusCode
from llm_datadist.testing import Cluster, _link
from llm_datadist.transport import auth, protection
from llm_datadist.transport.host import host_identity

import rawpeer
from test_protection import Middle, _unlink, link_through
from test_security import (CLIENT_ID, SECRET, SERVER_ID, block_bytes, data_plane, linked, push, register_guarded,
                           stats)

S = LLMStatusCode
FLOOD_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unix_flood_child.py")
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (auth.SECRET_ENV, protection.ENV, "LLM_DATADIST_DATA_PLANE"):
        monkeypatch.delenv(name, raising=False)


def start(stack: ExitStack, cluster_id: int, listen: bool = False) -> Cluster:
    return stack.enter_context(Cluster(cluster_id, "PROMPT" if listen else "DECODER", listen=listen,
                                       options={"llm.LinkSecret": SECRET}, timeout=60.0))


def flood(stack: ExitStack, server: Cluster, seconds: float) -> subprocess.Popen:
    """``unix_flood_child.py`` as uid 65534 against ``server``'s Unix listener, running."""
    folder = stack.enter_context(tempfile.TemporaryDirectory())  # (pytest's tmp_path is 0700)
    os.chmod(folder, 0o755)
    script = os.path.join(folder, "unix_flood_child.py")
    shutil.copy(FLOOD_CHILD, script)
    os.chmod(script, 0o644)
    child = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PYTHON, script,
                              str(server.pid), str(seconds)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, cwd="/", env={"PATH": "/usr/bin:/bin"})
    stack.callback(child.wait, 10)
    stack.callback(child.kill)
    assert child.stdout.readline().strip() == "started"
    return child


def needs_another_user() -> None:
    if os.geteuid() != 0 or SYSTEM_PYTHON is None or shutil.which("setpriv") is None:
        pytest.skip("needs root, setpriv and a system python3 to run the stranger as uid 65534")


def link_state(state, remote_id: int):
    peer = state.dd.engine.links._peers[remote_id]
    return peer.unix, peer.source, peer.shares.source


def test_a_flood_of_the_unix_socket_cannot_move_a_same_host_link_onto_a_relay():
    """The client links through a relay on its TCP path while a stranger floods the server's Unix
    socket: the link still comes up over the Unix socket on cma, and only the link request's
    connection crosses the relay (before: 5 connections crossed it, on tcp, and a flipped pushed
    byte landed unnoticed)."""
    needs_another_user()
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        client = start(stack, CLIENT_ID)
        server.call(register_guarded, 1)
        client.call(register_guarded, 2)
        middle = Middle(server.address, flip_at=40_000)
        stack.callback(middle.close)
        flood(stack, server, 30)
        assert link_through(client, server, middle) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert client.call(link_state, SERVER_ID)[0] and client.call(data_plane, SERVER_ID) == "shm"  # same host
        assert client.call(push, SERVER_ID, list(range(8)), list(range(8))) == 0
        assert len(middle.seen) == 1 and middle.flipped == 0
        assert all(server.call(block_bytes, t, b) == client.call(block_bytes, t, b) for t in (0, 1) for b in range(8))


def test_honest_same_host_links_keep_the_unix_socket_under_a_flood():
    """Eight links in a row while the stranger floods: each comes up, on the same-host plane (shm;
    before: on tcp, or failed with LLM_LINK_FAILED)."""
    needs_another_user()
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        client = start(stack, CLIENT_ID)
        child = flood(stack, server, 30)
        planes = []
        for _ in range(8):
            assert client.call(_link, SERVER_ID, *server.address, 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
            planes.append(client.call(data_plane, SERVER_ID))
            assert client.call(_unlink, SERVER_ID) == 0
        assert planes == ["shm"] * 8
        assert server.call(stats)["refused_source"] > 0  # the stranger's connections beyond its share
        child.kill()


def test_a_tcp_data_connection_of_a_same_host_link_is_refused():
    """A link request that states this host's identity with a plane that wants Unix sockets gets
    its data connections only over the Unix socket: one over TCP (what a relay, or a client made to
    fall back, opens) is refused and the link dropped; the same request over Unix is taken."""
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        key = SECRET.encode()
        with pytest.raises(rawpeer.Refused) as refused:
            rawpeer.RawLink(server.address, 73, key, host=host_identity(), planes=["cma", "tcp"])
        assert refused.value.message["error"] == "a TCP connection for a link of two processes of one host"
        assert 73 not in server.call(linked)
        honest = rawpeer.RawLink(server.address, 74, key, unix=True, host=host_identity(), planes=["cma", "tcp"])
        stack.callback(honest.close)
        # A request for TCP planes only (or from another host) may use TCP.
        tcp_only = rawpeer.RawLink(server.address, 75, key, host=host_identity(), planes=["tcp"])
        stack.callback(tcp_only.close)


def test_an_accepted_same_host_link_is_accounted_under_the_uid_the_kernel_proved():
    """For the caps and the budgets' shares, a same-host link's source is its uid on both sides
    (before: the server kept the loopback address of its link request, which every local process
    of every user shares)."""
    with ExitStack() as stack:
        server = start(stack, SERVER_ID, listen=True)
        client = start(stack, CLIENT_ID)
        assert client.call(_link, SERVER_ID, *server.address, 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        uid = ("uid", os.getuid())
        assert server.call(link_state, CLIENT_ID) == (True, uid, uid)
        assert client.call(link_state, SERVER_ID)[::2] == (True, uid)
