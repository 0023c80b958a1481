"""``bench --role server|client``: the bench's table between two hosts.

The server (``--role server --listen HOST:PORT``) is the rig's server cluster (id 1) in this
process, serving one client run; the client (``--role client --peer HOST:PORT``) is the rest of
the rig of ``workload.TransportRig``: a cluster process per data plane, each linked to the
server, the first of them (the *home*) also timing the memcpy baseline and the local copy, so the
baseline is measured on the measuring side, in the same run. The links are authenticated with the
secret in ``--secret-file`` on both sides.

What the local rig does with calls into its server process, the client does with notifications
from its home process (``two_hosts``; JSON objects whose field ``bench`` names their kind), each
answered by the server on the link's thread:

* ``hello``: the protocol version; the server answers with its own and facts about its host
  (version of llm_datadist, machine, CPUs) for the client's report;
* ``case``: allocate, fill and register the cache of a block size (``model_id``, ``block_bytes``,
  ``moved``: the server derives the block ids from them, as the client does), after dropping the
  previous one; refused beyond ``MAX_CASE_BYTES`` or the memory available;
* ``sample``: the SHA-256 of a sample of the blocks a push wrote or a pull will read
  (``workload.sample_digest``), which the client compares with its own;
* ``drop``: free the case; ``bye``: the run is over (the server then waits for the clients to
  unlink, and exits 0).

The home sends ``alive`` every second meanwhile, so the server's ``--timeout`` measures the
client's absence (a partition, a vanished client: exit 2), not the length of a block size's
measurements. Every message is checked strictly on arrival.
"""

from __future__ import annotations

import os
import re
from typing import Dict, Optional

from llm_datadist.cli.console import count
from llm_datadist.cli.two_hosts import (
    CLOSING_WAIT_S, DEFAULT_TIMEOUT_S, Heartbeat, PeerChannel, TwoHostError, check_fields, check_role_flags,
    heartbeat_interval, is_int, link_to, read_secret_file, resolve, send, text_field,
)
from llm_datadist.cli.workload import (
    CLIENT_IDS, PULL, PUSH, SERVER_ID, TRANSFER_TIMEOUT_MS, Case, block_ids, drop_case, sample_digest, serve_case,
)

KEY = "bench"
PROTOCOL = 1
KINDS = ("hello", "case", "sample", "drop", "bye")
ROLES = ("server", "client")
#: The largest cache a client may ask the server for: twice the bytes of a call (``--total`` is
#: at most 1 GiB).
MAX_CASE_BYTES = 2 << 30
#: The most blocks of a call (so that the block-id lists stay within reason).
MAX_MOVED = 1 << 24
#: The flags of the sweep: the client's alone.
SWEEP_FLAGS = ("sizes", "planes", "directions", "total", "min_time", "gpu", "gpu_sizes", "gpu_total", "json", "plot")
_HEX_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def check_args(args, defaults) -> Optional[str]:
    """What is wrong with the combination of ``args``' two-host flags, or None (``defaults``: the
    parser's defaults, to tell the flags given)."""
    problem = check_role_flags(args, listening="server", linking="client", listening_first=True)
    if problem is not None or args.role is None:
        return problem
    if args.role == "server":
        sweep = [f"--{name.replace('_', '-')}" for name in SWEEP_FLAGS
                 if getattr(args, name) != getattr(defaults, name)]
        if sweep:
            return f"--role server takes the sweep from the client: give {', '.join(sweep)} to the client"
    elif args.gpu == "only":
        return "the GPU rows are measured on one host: run bench --gpu only without --role"
    return None


def _settings(args) -> tuple:
    """``(secret, ip, port, timeout)`` of a role; ``TwoHostError`` for a bad secret file or host."""
    secret = read_secret_file(args.secret_file)
    host, port = args.listen if args.role == "server" else args.peer
    return secret, resolve(host), port, args.timeout or DEFAULT_TIMEOUT_S


# -- the client's side (the rig's server, on the other host) ----------------------------------------

def link_server(state, ip: str, port: int, timeout_s: float) -> None:
    """In a client process: link to the server at ``ip:port`` (retried until ``timeout_s``)."""
    link_to(state.dd.engine, ip, port, timeout_s, SERVER_ID, "bench server")


def ask_server(state, message: dict, timeout_s: float) -> dict:
    """In the home process: send ``message`` to the server, return its answer."""
    return send(state.dd.engine, SERVER_ID, message, timeout_s, "bench server")


_heartbeat: Optional[Heartbeat] = None


def start_heartbeat(state, timeout_s: float) -> None:
    """In the home process: tell the server every second that the client is still there."""
    global _heartbeat
    _heartbeat = Heartbeat(state.dd.engine, SERVER_ID, KEY, heartbeat_interval(timeout_s), timeout_s).start()


def stop_heartbeat(state) -> None:
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop()
        _heartbeat = None


class RemoteServer:
    """The rig's server on another host (``workload.LocalServer``'s interface), reached through
    the client processes."""

    def __init__(self, ip: str, port: int, timeout_s: float) -> None:
        self.address = (ip, port)
        self.timeout = timeout_s
        self.home = None
        self.facts: Optional[dict] = None

    def _ask(self, message: dict) -> dict:
        return self.home.call(ask_server, message, self.timeout, timeout=self.timeout + 30)

    def link(self, client, plane: str) -> None:
        client.call(link_server, *self.address, self.timeout, timeout=self.timeout + 30)

    def attach(self, home) -> None:
        self.home = home
        reply = self._ask({KEY: "hello", "version": PROTOCOL})
        check_fields(reply, "the server's answer to the hello", {"version": is_int, "facts": lambda v: True})
        if reply["version"] != PROTOCOL:
            raise TwoHostError(f"the server speaks version {reply['version']} of the bench's messages, the client "
                               f"{PROTOCOL}: run the same llm_datadist on both hosts")
        self.facts = check_fields(reply["facts"], "the server's facts",
                                  {"version": text_field, "machine": text_field, "cpu": text_field,
                                   "cpus": lambda v: is_int(v, 1, 1 << 20)})
        home.call(start_heartbeat, self.timeout)

    def serve(self, case: Case, model_id: int) -> None:
        self._ask({KEY: "case", "model_id": model_id, "block_bytes": case.block_bytes, "moved": case.moved})

    def digest(self, case: Case, op: str, index: int) -> str:
        reply = self._ask({KEY: "sample", "op": op, "index": index})
        return check_fields(reply, "the server's sample", {"digest": lambda v: isinstance(v, str) and
                                                           bool(_HEX_DIGEST.match(v))})["digest"]

    def drop(self) -> None:
        if self.home is not None and self.home.process.is_alive():
            self._ask({KEY: "drop"})

    def finish(self) -> None:
        if self.home is not None and self.home.process.is_alive():
            self.home.call(stop_heartbeat)
            self._ask({KEY: "bye"})

    def unlink(self, client) -> None:
        from llm_datadist.cli.workload import UNLINK_TIMEOUT_S, unlink_peer
        client.call(unlink_peer, SERVER_ID, *self.address, timeout=UNLINK_TIMEOUT_S)

    def close(self) -> None:
        """Nothing of the server's runs on this host."""


class ClientSide:
    """The client role's settings and, once the sweep ran, what the server said of its host."""

    def __init__(self, args) -> None:
        secret, ip, port, timeout = _settings(args)
        self.address = (ip, port)
        self.timeout = timeout
        self._options = {"llm.LinkSecret": secret,
                         "llm.SyncKvCacheWaitTime": str(max(TRANSFER_TIMEOUT_MS, int(timeout * 1000)))}
        self.server: Optional[RemoteServer] = None

    def rig(self, planes):
        """A ``TransportRig`` whose server is the one at ``address``."""
        from llm_datadist.cli.workload import TransportRig

        def server(_options) -> RemoteServer:
            self.server = RemoteServer(*self.address, self.timeout)
            return self.server
        return TransportRig(planes, server=server, options=self._options)

    def describe_server(self) -> str:
        """What the server said of its host (after the rig linked to it)."""
        facts = self.server.facts if self.server is not None else None
        if not facts:
            return "unknown (it never answered)"
        return f"llm_datadist {facts['version']} on {facts['machine']}, {facts['cpus']} CPUs ({facts['cpu']})"


# -- the server's side ------------------------------------------------------------------------------

class BenchServer:
    """The server's answers to the client's requests (on the links' threads, one at a time)."""

    def __init__(self, state) -> None:
        import threading
        self.state = state
        self.case: Optional[Case] = None
        self.block_sizes: list = []
        self.greeted = False  # a case only after the client's hello was answered
        self._lock = threading.Lock()

    def answers(self) -> Dict[str, object]:
        return {"hello": self.hello, "case": self.serve, "sample": self.sample, "drop": self.drop, "bye": self.bye}

    def hello(self, message: dict) -> dict:
        from llm_datadist.cli.info import build_facts, host_facts
        check_fields(message, "the client's hello", {KEY: lambda v: True, "version": is_int})
        if message["version"] != PROTOCOL:
            raise TwoHostError(f"the client speaks version {message['version']} of the bench's messages, the "
                               f"server {PROTOCOL}: run the same llm_datadist on both hosts")
        host = host_facts()
        with self._lock:
            self.greeted = True
        return {"version": PROTOCOL, "facts": {"version": str(build_facts()["version"])[:200],
                                               "machine": str(host["machine"])[:200] or "?",
                                               "cpu": str(host["cpu"])[:200] or "?", "cpus": int(host["cpus"])}}

    def serve(self, message: dict) -> dict:
        from llm_datadist.cli.info import memory_shortfall
        check_fields(message, "the client's case", {KEY: lambda v: True, "model_id": lambda v: is_int(v, 1, 1 << 31),
                                                   "block_bytes": lambda v: is_int(v, 1, 1 << 30),
                                                   "moved": lambda v: is_int(v, 1, MAX_MOVED)})
        with self._lock:
            if not self.greeted:
                raise TwoHostError("the client asked for a case before its hello")
        case = Case(f"{message['block_bytes']}B", message["block_bytes"], moved=message["moved"], rounds=0, batch=1)
        nbytes = case.cache_blocks * case.block_bytes
        if nbytes > MAX_CASE_BYTES:
            raise TwoHostError(f"the client asked for a cache of {nbytes} bytes, more than the {MAX_CASE_BYTES} a "
                               f"server gives")
        with self._lock:
            self._drop()
            shortfall = memory_shortfall(nbytes)
            if shortfall:
                raise TwoHostError(f"the server's cache would take {shortfall}; lower the client's --total")
            serve_case(self.state, case, message["model_id"])
            self.case = case
            self.block_sizes.append(case.block_bytes)
        return {}

    def sample(self, message: dict) -> dict:
        check_fields(message, "the client's sample request", {KEY: lambda v: True, "op": lambda v: v in (PUSH, PULL),
                                                             "index": lambda v: v in (0, 1) and type(v) is int})
        with self._lock:
            if self.case is None:
                raise TwoHostError("the client asked for a sample with no case set up")
            ids = block_ids(self.case)[message["op"]][message["index"]]
            return {"digest": sample_digest(self.state, "cache", ids)}

    def drop(self, message: dict) -> dict:
        check_fields(message, "the client's drop", {KEY: lambda v: True})
        with self._lock:
            self._drop()
        return {}

    def _drop(self) -> None:
        if self.case is not None:
            drop_case(self.state)
            self.case = None

    def bye(self, message: dict) -> dict:
        check_fields(message, "the client's bye", {KEY: lambda v: True})
        return {}


def serve(args, out) -> int:
    """The server role: serve one client run; 0 once the client said bye. ``TwoHostError`` (or
    ``LLMException``) when it cannot."""
    from llm_datadist import LLMConfig, LLMDataDist, LLMException, LLMRole
    from llm_datadist.testing import ClusterState
    secret, ip, port, timeout = _settings(args)
    os.environ.setdefault("LLM_DATADIST_DEVICE", "cpu")  # HOST caches only, as in the local rig
    dd = LLMDataDist(LLMRole.PROMPT, SERVER_ID)
    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True  # as the clients' (testing.Cluster's default)
    config.link_secret = secret
    config.listen_ip_info = f"{ip}:{port}"
    options = config.generate_options()
    options["llm.SyncKvCacheWaitTime"] = str(max(TRANSFER_TIMEOUT_MS, int(timeout * 1000)))
    options["llm.DataPlane"] = "auto"
    try:
        dd.init(options)
    except LLMException as exc:
        raise TwoHostError(f"could not start the server on {ip}:{port}: {str(exc).split(' (status_code')[0]}") from None
    engine = dd.engine
    server = BenchServer(ClusterState(SERVER_ID, dd=dd, cm=dd.cache_manager))
    channel = PeerChannel(engine, KEY, KINDS, "bench client", server.answers(), peers=set(CLIENT_IDS.values()))
    try:
        engine.set_notify_handler(channel.handler)
        ip, port = engine.listen_address
        out(f"listening: {ip}:{port} (bench server, cluster {SERVER_ID}); waiting up to {timeout:g} s for the client")
        channel.wait("hello", timeout, "waiting for the client to link")
        clients = engine.linked_clusters()
        out(f"client:    linked (clusters {', '.join(map(str, clients))}), authenticated with the secret of "
            f"{args.secret_file}; the client prints the table")
        while channel.wait(("case", "sample", "drop", "bye"), timeout, "waiting for the client")[KEY] != "bye":
            pass
        sizes = ", ".join(f"{size:,} B" for size in server.block_sizes)
        out(f"served:    {count(len(server.block_sizes), 'block size')} ({sizes or 'none'})")
        for client in engine.linked_clusters():
            channel.wait_gone(client, CLOSING_WAIT_S)
        return 0
    finally:
        engine.set_notify_handler(None)
        server.drop({KEY: "drop"})
        dd.finalize()
