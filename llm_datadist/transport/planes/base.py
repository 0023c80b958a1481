"""The data plane protocol: what one way of moving a link's bytes provides.

A data plane is one module of this package defining one ``DataPlane`` subclass and registering it
(``planes.register``). The link manager makes one instance of every registered plane per engine,
and for each link picks the plane of *its own* transfers: the one ``llm.DataPlane`` forces, or the
first of ``planes.auto_order()`` whose ``accept`` takes the link. Nothing outside the plane modules
knows what a plane is called or what it needs; the manager only calls the methods below.

That plane (the link's *host plane*; under ``auto`` only planes without ``device_memory``, or
with ``auto_host_memory``, are considered for it) moves every transfer between memory the host can
address.
A transfer whose local cache, or whose remote cache, is device memory that the host cannot
address (a cuda or acl DEVICE cache) goes to the link's *device plane* for that combination
instead: the forced plane if it has ``device_memory``, else the first plane of the ``auto`` order
with ``device_memory`` that accepts the link and ``carries`` the combination; chosen on the first
such transfer, kept per link and per combination, closed with the link.

Calls, in the order a link meets them:

``probe()`` (class method)
    ``(usable, why)`` on this host, for ``python -m llm_datadist info`` and ``bench``; may be slow
    (it may start a process). Never called on the transfer path.
``trust()`` (class method, optional)
    One sentence for ``info``: which peers get what the plane exposes of this process (cuda_ipc:
    who receives its IPC handles), or ``""`` (the default) where docs/security.md's rule for every
    link says it all.
``offer(session)``
    Extra fields of this side's cache-table reply to the peer of ``session`` (a ``session.Link``): what the
    peer needs to use this plane towards us (cma: where to probe, where our registry generation
    lives), or ``{}``. Runs for every table request, on the connection's thread. Which planes a
    side *names* in its link request/reply is the manager's (``planes.offered``).
``link_state(session)``
    A new object of a class the plane declares, holding *all* of the plane's state for the link
    of ``session``, or ``None`` (the default) for a plane that keeps none. Called once per link
    and plane, just before ``accept``; the link keeps it (``session.plane_state[plane.name]``)
    and the plane reads it from there (``self.state(session)``: one dict lookup, fine per
    transfer). ``accept`` fills it in, ``on_table`` updates it, ``close`` releases what it holds;
    the link drops it when ``accept`` refuses and when the link ends (after ``close``), so a
    transfer racing the end of its link finds ``None``: the plane then fails the transfer
    (``LLM_LINK_FAILED``), it never recreates the state. Nothing of a plane's goes on the session
    itself. Examples: cma keeps the peer's mapped generation counter, a pidfd and the link's block
    routes (``cma.CmaLink``); cuda_ipc the mapped generation counter and the peer's allocations
    mapped here (``cuda_ipc.IpcLink``); nixl the peer's agent loaded into its own (by ``accept``,
    from the agent metadata in ``peer_facts``) and the prepared descriptor list of the peer's
    generation word (reloaded by ``on_table`` when the peer's metadata changed, released with the
    agent by ``close``: ``nixl.NixlLink``).
``parse_facts(key, value)`` (class method; planes with ``facts_keys``)
    The peer's entry ``key`` of its table reply (untrusted JSON), read into a small frozen value
    of typed fields with fixed limits (lengths, counts, integer ranges): what the link keeps of
    it (``session.facts[key]``), the JSON dropped. Raises ``errors.ProtocolError`` for an entry
    that is not as the plane's ``offer`` makes it (the link fails, ``LLM_LINK_FAILED``, counted
    ``malformed_tables``); unknown fields inside the entry are ignored. Knows nothing of the
    link: what needs it (the peer's cluster id, pid) is ``accept``'s to check.
``accept(session, peer_facts, deadline)``
    Whether this plane can carry this side's transfers on the link, judged from what the kernel
    proved about the peer (``session.unix``, ``session.pid``, ``session.uid``: ``SO_PEERCRED`` of
    its Unix connections), the planes it named (``session.planes``) and ``peer_facts`` (what
    ``parse_facts`` made of the peer's authenticated table reply, by key; a key the peer did not
    send is absent). Returns ``None`` once the plane is set up for the link (in its
    ``link_state``), or a sentence saying why not. ``deadline`` is a ``transport.deadline``
    instant. Must not raise for hostile facts.
``on_register(record)`` / ``on_unregister(record)``
    The engine's registry gained or lost a cache (``record``: the engine's cache record, with
    ``cache_id``, ``addrs``, ``tensor_bytes``, ``placement``). For planes that export memory
    handles (CUDA IPC, RDMA registration); may run with the engine's registry lock held: be quick.
``table_is_current(session, table)``
    Before each transfer: False if the peer's registry changed since ``table`` was fetched and
    this side must find out before planning (the manager refreshes the table and plans again).
    A plane whose peer checks the generation itself returns True.
``on_table(session, table)``
    The link fetched a new table of the peer (``session.facts`` holds its parsed entries): release what
    the old one named and the new one does not (cuda_ipc closes mappings of caches the peer
    unregistered). Planes the link accepted only.
``transfer(session, table, plan, write, deadline)``
    Move a plan made against ``table`` (``write``: local -> peer) between memory that both
    hosts can address. Raise ``LLMException`` with ``LLM_KV_CACHE_NOT_EXIST`` for memory the
    peer has not registered, ``LLM_TIMEOUT`` or ``LLM_LINK_FAILED`` when the bytes did not move,
    ``errors.StaleTable`` when the peer says the table is stale. Plans of ``stripe_bytes`` or
    more may be split over ``session.workers`` (never over new threads).
``carries(session, local_device, remote_device)`` (planes with ``device_memory``)
    Whether this plane moves a transfer whose local side (``local_device``) and remote side
    (``remote_device``) are, or are not, device memory that the host cannot address. The
    default: a device plane carries every combination, a host plane only host memory.
``transfer_device(session, table, plan, write, deadline, local_device, remote_device)``
    As ``transfer``, for a plan with at least one side in device memory the host cannot address
    (``local_device``: the local side; ``remote_device``: the remote side, which lies wholly in
    ``table.device_ranges``). Called only on planes with ``device_memory`` whose ``accept`` took
    the link and whose ``carries`` said yes; a plane without ``device_memory`` never sees such a
    plan (its ``transfer`` may read and write the plan's addresses as host memory).
``block_route(session, table, remote_layout, local_layout, write, timeout_ms, on_broken)`` (optional)
    A route for repeated block transfers between a local cache and a cache of ``table`` (the
    link's current table), or ``None`` (the default: every transfer takes the checked path):
    cma's ``_io.BlockRoute``, tcp's and staging's ``_io.TcpRoute``, nixl's ``NixlRoute`` (prepared
    NIXL lists). A route has ``current``, ``generation``, ``local``, ``remote``, ``learn(key,
    src_tensors, dst_tensors)`` and ``run(...)`` (True when done, False to send the call down the
    checked path). ``timeout_ms``: the limit of each of its calls; ``on_broken(why)``: what a call
    that left the link out of step calls (the manager then ends the link, as after a failed
    ``transfer``). The engine builds one after a checked transfer went through and keeps it until
    the route is no longer ``current`` or either cache leaves the registry; the route re-checks per
    call what can change between calls (see ``BlockRoute``, ``TcpRoute``, ``NixlRoute``).
``close(session)``
    Release the per-link state ``accept`` set up; called once the link ends (possibly more than
    once, and possibly for a link it never accepted or whose state is already dropped): must be
    idempotent.

Per engine rather than per link:

``device_payload`` (optional attribute)
    The payload mover (``planes.tcp.HostPayload``) with which this side's *server* moves
    a peer's frames into and out of its own device memory (the staging plane's bounce-buffer
    payload); ``None`` by default. The manager hands the first plane's to its server.
``sibling(name)``
    The same engine's instance of another plane (``planes.PlaneSet``), or None if no such plane
    is registered: how a plane hands some transfers to another (cuda_ipc -> staging).
``shutdown()``
    The engine's links are closing (finalize): release per-engine state (staging: its bounce
    buffers). The default does nothing.
``requests()``
    Extra request handlers of the engine's server, opcode -> handler (``server.Handler``:
    ``(fd, req_id, length, peer) -> goes on``), for a plane whose peers ask it for something on
    the link's connections (shm: ``OP_SHM_GET``, its memfds passed with ``SCM_RIGHTS``); ``{}``
    by default. Collected once, when the link manager starts.
"""

from __future__ import annotations

import os
from typing import Any, Callable, ClassVar, Dict, Optional, Tuple

from llm_datadist.transport.engine_view import EngineView
from llm_datadist.transport.planes.registry import PlaneSet


class DataPlane:
    """Base class of the data planes; see the module docstring for the contract."""

    #: The name ``llm.DataPlane`` and the wire (the ``planes`` of a link request) use.
    name: ClassVar[str] = ""
    #: One line for ``--help`` and ``info``.
    summary: ClassVar[str] = ""
    #: Other names the CLI accepts for it.
    aliases: ClassVar[Tuple[str, ...]] = ()
    #: The entries of the peer's table reply that ``accept`` and ``on_table`` read (what its
    #: ``offer`` puts there): the link keeps what ``parse_facts`` makes of these (``session.facts``),
    #: nothing else of the reply. A key belongs to one plane.
    facts_keys: ClassVar[Tuple[str, ...]] = ()
    #: Planes this one moves some transfers with (shm: cma for user memory), named with it in a
    #: link request or reply when it is forced.
    uses: ClassVar[Tuple[str, ...]] = ()
    #: Position in the order ``auto`` tries planes (lower first).
    auto_rank: ClassVar[int] = 50
    #: Whether ``auto`` tries it at all (a plane only reachable by forcing it says False).
    auto: ClassVar[bool] = True
    #: Usable on every link (the peer always serves it): offered even when another plane is
    #: forced, and the plane of links to this very process.
    fallback: ClassVar[bool] = False
    #: Wants the link's connections on Unix sockets when the peer is on this host, so that the
    #: kernel names the peer's process (``SO_PEERCRED``).
    local_sockets: ClassVar[bool] = False
    #: Transfers of at least this many bytes are split over ``stripes`` threads (0: never).
    stripe_bytes: ClassVar[int] = 0
    stripes: ClassVar[int] = 1
    #: Moves memory that the host cannot address (device memory of a cuda or acl runtime): the
    #: plane has ``transfer_device``.
    device_memory: ClassVar[bool] = False
    #: Moves memory that both hosts address (``transfer``). A plane without it (cuda_ipc) is never
    #: a link's host plane: forced, it applies to device transfers, and host memory takes the
    #: plane ``auto`` picks.
    host_memory: ClassVar[bool] = True
    #: A plane with ``device_memory`` that ``auto`` also tries as a link's host plane (nixl). By
    #: default ``auto`` tries such a plane for device transfers only (staging moves host memory
    #: only when forced).
    auto_host_memory: ClassVar[bool] = False
    #: Serves only links authenticated with a secret (nixl: a peer given it is trusted with this
    #: process's memory); forced on a link without one, the link fails naming why.
    requires_secret: ClassVar[bool] = False

    #: See ``device_payload`` in the module docstring.
    device_payload: Any = None

    def __init__(self, engine: EngineView) -> None:
        self.engine = engine
        self._set: Any = None  # the engine's planes.PlaneSet, given by join

    def join(self, planes) -> None:
        """Become a member of ``planes`` (the engine's ``PlaneSet``): ``sibling`` asks it."""
        self._set = planes

    def sibling(self, name: str) -> Optional["DataPlane"]:
        """The same engine's instance of the plane ``name`` (None if none is registered)."""
        if self._set is None:  # made alone (a test): a set of its own, holding this plane
            planes = PlaneSet(self.engine, eager=False)
            planes.adopt(self)
            self.join(planes)
        try:
            return self._set.instance(name)
        except KeyError:
            return None

    def link_state(self, session) -> Any:
        return None

    def state(self, session) -> Any:
        """This plane's state for the link of ``session`` (``link_state``), or None."""
        return session.plane_state.get(self.name)

    def shutdown(self) -> None:
        pass

    def requests(self) -> Dict[int, Callable[..., bool]]:
        return {}

    def counters(self) -> Dict[str, int]:
        """This plane's counters for ``LinkManager.link_stats`` (names unique across planes)."""
        return {}

    @classmethod
    def probe(cls) -> Tuple[bool, str]:
        return True, cls.summary

    @classmethod
    def trust(cls) -> str:
        return ""

    @classmethod
    def parse_facts(cls, key: str, value: Any) -> Any:
        raise NotImplementedError(f"data plane {cls.name} declares facts_keys but no parse_facts")

    def offer(self, session) -> Dict[str, Any]:
        return {}

    def accept(self, session, peer_facts: Dict[str, Any], deadline: float) -> Optional[str]:
        raise NotImplementedError

    def on_register(self, record) -> None:
        pass

    def on_unregister(self, record) -> None:
        pass

    def table_is_current(self, session, table) -> bool:
        return True

    def on_table(self, session, table) -> None:
        pass

    def transfer(self, session, table, plan, write: bool, deadline: float) -> None:
        raise NotImplementedError

    def carries(self, session, local_device: bool, remote_device: bool) -> bool:
        if local_device or remote_device:
            return self.device_memory
        return self.host_memory

    def transfer_device(self, session, table, plan, write: bool, deadline: float, local_device: bool,
                        remote_device: bool) -> None:
        raise NotImplementedError

    def block_route(self, session, table, remote_layout, local_layout, write: bool, timeout_ms: int = -1,
                    on_broken: Optional[Callable[[str], None]] = None):
        return None

    def close(self, session) -> None:
        pass

    def __repr__(self) -> str:
        return f"<data plane {self.name}>"

    def local_peer_refusal(self, session) -> Optional[str]:
        """Why the peer of ``session`` is not a process of this host that the kernel proved,
        other than this one, of this user, offering this plane; None when it is (the first
        checks of the same-host planes' ``accept``)."""
        if not session.unix:
            return ("the link's connections are TCP: the peer is on another host or in another network "
                    "namespace, or it uses tcp only")
        if self.name not in session.planes:
            return "the peer does not offer it"
        if session.pid <= 0 or session.pid == os.getpid():
            return "the peer is this process"
        if session.uid != os.geteuid():
            return f"the peer runs as another user (uid {session.uid})"
        return None
