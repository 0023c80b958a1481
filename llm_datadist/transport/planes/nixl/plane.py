"""``NixlPlane``, the ``nixl`` data plane (the package's docstring tells what it does and why): who
gets it (``_refusal``), this engine's agent (made at the first link that uses the plane), the
metadata offered and taken, the checks of a transfer and the count of requests in flight. Its
parts live beside it: ``LocalMemory`` (what this side registers), ``NixlLink`` (a link's state),
``Transfers`` (what a transfer posts to NIXL), ``NixlRoute`` (block routes), ``Agent`` (NIXL),
``environment`` (UCX's settings), ``probe``, ``metadata``.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from llm_datadist.status import LLMException
from llm_datadist.transport import auth
from llm_datadist.transport import deadline as dl
from llm_datadist.transport import planes as plane_registry
from llm_datadist.transport.errors import S, brief, fail
from llm_datadist.transport.planes import register
from llm_datadist.transport.planes.base import DataPlane
from llm_datadist.transport.planes.nixl import environment as env
from llm_datadist.transport.planes.nixl import probe as nixl_probe
from llm_datadist.transport.planes.nixl.agent import INSTALL, Agent, import_quietly, installed, progress_us, rows
from llm_datadist.transport.planes.nixl.link import NixlLink
from llm_datadist.transport.planes.nixl.memory import LocalMemory, device_memory_type, memory_type
from llm_datadist.transport.planes.nixl.metadata import (DRAM, FACTS_KEY, MAX_METADATA_BYTES, VRAM, NixlFacts,
                                                         agent_name, check_facts)
from llm_datadist.transport.planes.nixl.route import NixlRoute, prepare_lists, route_fits
from llm_datadist.transport.planes.nixl.transfers import Begun, Transfers

logger = logging.getLogger("llm_datadist")

#: How long a metadata reload waits for the link's transfers in flight to end.
RELOAD_WAIT_S = 60.0
#: How long finalize waits for requests in flight (their links are gone: they fail at once).
SHUTDOWN_WAIT_S = 10.0

#: Why a link without a secret never gets the plane.
NO_SECRET = (f"the link has no secret ({auth.SECRET_OPTION}): a peer loaded into NIXL can read and write "
             f"all of this process's memory, so nixl is only used on authenticated links")


@register
class NixlPlane(DataPlane):
    name = "nixl"
    summary = "one-sided RDMA (or UCX TCP) reads and writes through NIXL; links with a secret only"
    facts_keys = (FACTS_KEY,)
    auto_rank = 30
    device_memory = True
    auto_host_memory = True
    requires_secret = True

    def __init__(self, engine) -> None:
        super().__init__(engine)
        options = getattr(engine, "options", None) or {}
        self._forced = _resolved_plane(options) == self.name
        self._offers = _resolved_plane(options) in (plane_registry.AUTO, self.name)
        self._secret = auth.resolve_secret(options) is not None
        self._devices = env.pinned_devices(options)
        self._lock = threading.RLock()
        self._agent: Optional[Agent] = None
        self._agent_error: Optional[str] = None
        self._memory = LocalMemory()  # under _lock
        self._offered: Optional[Tuple[int, Dict[str, Any]]] = None
        self._loaded: Dict[str, NixlLink] = {}  # the peers' agents loaded into ours, by name
        self._active = 0  # requests in flight, all links (``_begin`` .. ``_finish``)
        self._idle = threading.Condition(self._lock)
        self._kept: List[Agent] = []  # agents left alive at a finalize that found requests running
        self.stats = {"nixl_refused_metadata": 0, "nixl_timeouts": 0, "nixl_failures": 0}
        self._transfers = Transfers(self._memory.slots, self._lock, self._count, self._end)
        if self._secret and self._offers and installed() and (env.tcp_mode() or self._devices or env.rdma_ports()):
            # The first link would import NIXL (about 2 s of loading libraries): start now.
            threading.Thread(target=import_quietly, name="llm_datadist-nixl-import", daemon=True).start()

    def counters(self) -> Dict[str, int]:
        return dict(self.stats)

    @classmethod
    def probe(cls) -> Tuple[bool, str]:
        return nixl_probe.describe()

    @classmethod
    def trust(cls) -> str:
        return ("only peers of links with a secret get this process's NIXL metadata; such a peer can read and "
                "write any memory of this process (NIXL's target does not check registrations over UCX TCP or "
                "software RMA; only a NIC executing real RDMA enforces them), and malformed metadata from it can "
                "crash NIXL's loader: the trust of cma, across hosts")

    # -- who may use it ------------------------------------------------------------------------------
    def _refusal(self, session, accepting: bool = True) -> Optional[str]:
        """Why this side does not use the plane on the link of ``session`` (``accepting``), or does
        not offer it there, or None. An offer goes to any peer that named the plane on an
        authenticated TCP link, one of this host too (the peer may have forced it); under ``auto``
        this side uses it only towards another host."""
        if not session.authenticated:
            return NO_SECRET
        if session.unix:
            return "the link's connections are Unix sockets (a peer of this host: cma and cuda_ipc apply)"
        if getattr(session, "protection", "off") != "off":
            return (f"the link is protected ({session.protection}, llm.LinkProtection) and NIXL's transfers would "
                    f"bypass its sealed connections")
        if self.name not in session.planes:
            return "the peer does not offer it"
        if not self._offers:
            return f"this side's {plane_registry.DATA_PLANE_OPTION} is {_resolved_plane(self.engine.options)}"
        addresses = _link_addresses(session)
        if addresses is None:
            return "the link's connections are closed"
        if accepting and not self._forced and env.is_this_host(addresses[1]):
            return ("the peer is on this host (under auto nixl is for links to other hosts; force it with "
                    f"{plane_registry.DATA_PLANE_OPTION}=nixl)")
        if not installed():
            return f"NIXL is not installed ({INSTALL})"
        if not env.tcp_mode():
            usable, why = nixl_probe.probe_rdma(self._devices)
            if not usable:
                return f"{why}; {env.TCP_ENV}=1 runs NIXL over UCX TCP"
        return None

    def _ensure_agent(self, session) -> Tuple[Optional[Agent], Optional[str]]:
        """This engine's agent, made now (with the process's UCX settings) if not yet: ``(agent,
        None)``, or ``(None, why not)``."""
        with self._lock:
            if self._agent is not None or self._agent_error is not None:
                if self._agent is not None and env.tcp_mode():
                    why = self._settings_refusal(session)
                    if why is not None:
                        return None, why
                return self._agent, self._agent_error
            why = self._settings_refusal(session)
            if why is not None:
                return None, why
            try:
                agent = Agent(agent_name(self.engine.cluster_id), progress_us())
            except ImportError as exc:
                self._agent_error = str(exc)
                return None, self._agent_error
            except Exception as exc:  # noqa: BLE001 - NIXL's or UCX's refusal: the plane is unusable here
                self._agent_error = f"NIXL's UCX backend did not start ({type(exc).__name__}: {exc})"
                logger.warning("cluster %s: %s", self.engine.cluster_id, self._agent_error)
                return None, self._agent_error
            try:
                self._memory.start(agent, self.engine.generation_word.addr)
            except Exception as exc:  # noqa: BLE001 - registration refused: unusable
                self._agent_error = f"NIXL refused this process's memory ({type(exc).__name__}: {exc})"
                agent.close()
                return None, self._agent_error
            self._agent = agent
            logger.info("cluster %s: NIXL agent %s (%s mode, %s)", self.engine.cluster_id, agent.name,
                        env.fixed_mode(), ", ".join(f"{k}={os.environ.get(k, '')}" for k in
                                                    ("UCX_TLS", "UCX_NET_DEVICES", "UCX_MODULES")))
            return agent, None

    def _settings_refusal(self, session) -> Optional[str]:
        """Fix UCX's settings for this process (the first time), or say why they do not serve the
        link of ``session``."""
        runtime = getattr(self.engine, "runtime", None)
        cuda = getattr(runtime, "name", "") == "cuda"
        if env.tcp_mode():
            addresses = _link_addresses(session)
            interface = None if addresses is None else env.interface_of(addresses[0])
            if interface is None:
                return "the interface of the link's own address is not found (getifaddrs)"
            return env.fix_ucx("tcp", env.ucx_settings("tcp", interface, cuda=cuda))
        return env.fix_ucx("rdma", env.ucx_settings("rdma", devices=self._devices or env.rdma_ports()))

    # -- this side's memory --------------------------------------------------------------------------
    def on_register(self, record) -> None:
        memory = memory_type(record, self.engine)
        if memory is None or record.cache_id <= 0:
            return
        cache_rows = rows(record.addrs, record.tensor_bytes, memory[1])
        with self._lock:
            why = self._memory.add(record.cache_id, memory[0], cache_rows, self._agent)
        if why is not None:
            logger.warning("cluster %s: NIXL did not register cache %d (%s); transfers touching it go "
                           "through tcp or staging", self.engine.cluster_id, record.cache_id, why)

    def on_unregister(self, record) -> None:
        # The registry's lock is held and the memory is still there: deregister before it goes,
        # the cache's routes closed first (no route posts from memory NIXL no longer knows; none
        # is made meanwhile: routes are made under the registry's lock). A link's lock comes
        # before the plane's (``_begin``): close them outside it.
        with self._lock:
            if record.cache_id not in self._memory:
                return
            states = set(self._loaded.values())
        for state in states:
            self._close_routes(state, getattr(record, "layout", None))
        with self._lock:
            why = self._memory.remove(record.cache_id, self._agent)
        if why is not None:
            logger.error("cluster %s: NIXL did not deregister cache %d: %s", self.engine.cluster_id,
                         record.cache_id, why)

    # -- the table reply and the peer's --------------------------------------------------------------
    def offer(self, session) -> Dict[str, Any]:
        try:
            if self._refusal(session, accepting=False) is not None:
                return {}
            agent, _ = self._ensure_agent(session)
            if agent is None:
                return {}
            with self._lock:
                serial = self._memory.serial
                if self._offered is not None and self._offered[0] == serial:
                    return self._offered[1]
                blob = agent.metadata()
                if len(blob) > MAX_METADATA_BYTES:
                    logger.warning("cluster %s: NIXL metadata of %d bytes, more than %d: nixl is not offered",
                                   self.engine.cluster_id, len(blob), MAX_METADATA_BYTES)
                    return {}
                vram = int(getattr(self.engine, "device_id", 0)) if self._memory_kind() == VRAM else None
                offer = {FACTS_KEY: {"agent": agent.name, "md": base64.b64encode(blob).decode(),
                                     "generation": self.engine.generation_word.addr, "vram": vram}}
                self._offered = (serial, offer)
                return offer
        except Exception as exc:  # noqa: BLE001 - an offer never breaks the table reply
            logger.warning("cluster %s: no NIXL metadata for cluster %s: %s", self.engine.cluster_id,
                           session.cluster_id, exc)
            return {}

    @classmethod
    def parse_facts(cls, key: str, value: Any) -> NixlFacts:
        return NixlFacts.parse(value)

    def _read_facts(self, session, facts: Any) -> Tuple[str, bytes, int, Optional[int]]:
        """``(agent name, metadata, generation address, VRAM device or None)`` of the peer's
        ``NixlFacts`` in ``facts``, checked against the link (``metadata.check_facts``)."""
        return check_facts(facts, session.cluster_id)

    def link_state(self, session) -> NixlLink:
        return NixlLink()

    def accept(self, session, peer_facts: Dict[str, Any], deadline: float) -> Optional[str]:
        refusal = self._refusal(session)
        if refusal is not None:
            return refusal
        try:
            name, blob, generation, vram = self._read_facts(session, peer_facts)
        except ValueError as exc:
            self._count("nixl_refused_metadata")
            return f"refused the peer's NIXL metadata before loading it: {exc}"
        agent, why = self._ensure_agent(session)
        if agent is None:
            return why
        state = self.state(session)
        if state is None:
            return "the link is closed"
        with self._lock:
            if name == agent.name:
                self._count("nixl_refused_metadata")
                return "the peer's NIXL metadata names this process's own agent"
            if name in self._loaded:
                self._count("nixl_refused_metadata")
                return f"agent {name} is loaded for another link"
            self._loaded[name] = state
        return self._load(agent, state, name, blob, generation, vram)

    def _load(self, agent: Agent, state: NixlLink, name: str, blob: bytes, generation: int,
              vram: Optional[int]) -> Optional[str]:
        """Load the peer's metadata (its name reserved in ``_loaded``) and prepare its generation
        word; None, or why not (the reservation then goes, and what NIXL loaded of it)."""
        loaded = None
        try:
            loaded = agent.load(blob)
            if loaded != name:
                raise ValueError(f"NIXL loaded it as {brief(loaded)}")
            generation_list = agent.prepare(name, DRAM, rows([generation], 8, 0))
        except (ValueError, *agent.errors) as exc:
            agent.remove(name)
            with self._lock:
                self._loaded.pop(name, None)
                if loaded not in (None, name, agent.name) and loaded not in self._loaded:
                    agent.remove(loaded)  # loaded under a name no link holds: unload that too
            self._count("nixl_refused_metadata")
            return f"NIXL refused the peer's metadata: {type(exc).__name__}: {exc}"
        if not state.attach(name, blob, generation, generation_list, vram):
            self._unload(state, name, generation_list)
            return "the link is closed"
        return None

    def on_table(self, session, table) -> None:
        """Reload the peer's agent if the refreshed reply carries new metadata (it registered or
        unregistered memory), once the link's requests in flight are done."""
        state = self.state(session)
        if state is None or state.remote is None:
            return
        try:
            name, blob, generation, vram = self._read_facts(session, getattr(session, "facts", None))
            if name != state.remote:
                raise ValueError(f"its agent is now {name}, not {state.remote}")
        except ValueError as exc:
            self._count("nixl_refused_metadata")
            raise self._end(session, state, S.LLM_LINK_FAILED,
                            f"refused cluster {session.cluster_id}'s new NIXL metadata: {exc}") from None
        if blob == state.blob and generation == state.generation_addr and vram == state.vram_device:
            return
        agent = self._agent
        busy, closed = state.start_reload(RELOAD_WAIT_S)
        try:
            if closed or agent is None:
                raise fail(S.LLM_LINK_FAILED, f"the link to cluster {session.cluster_id} is closed")
            if busy:
                raise self._end(session, state, S.LLM_LINK_FAILED, f"cluster {session.cluster_id}'s transfers did "
                                                                   f"not end within {RELOAD_WAIT_S:.0f} s")
            old, generation_list = state.detach()
            self._close_routes(state)  # their remote lists name the metadata about to go
            if generation_list is not None:
                agent.release_list(generation_list)
            if old is not None:
                agent.remove(old)  # its name stays reserved in _loaded for the reload
            why = self._load(agent, state, name, blob, generation, vram)
            if why is not None:
                raise self._end(session, state, S.LLM_LINK_FAILED, f"cluster {session.cluster_id}: {why}")
        finally:
            state.end_reload()

    # -- block routes ----------------------------------------------------------------------------------
    def block_route(self, session, table, remote_layout, local_layout, write: bool, timeout_ms: int = -1,
                    on_broken=None) -> Optional[NixlRoute]:
        """A route over prepared lists of the whole two caches (``NixlRoute``), or None where the
        link is not ready, a cache is not wholly inside memory registered with NIXL (here) or
        listed by the peer's table (there), the block sizes do not pair up, or NIXL refuses a
        list. Host memory only (the engine asks for routes of host memory alone).
        ``timeout_ms``: the limit of each of its calls (the engine passes its transfer timeout,
        ``sync_kv_timeout_ms``, the checked path's); negative: none. A call that fails or
        outlives it ends the link itself, as ``transfer`` does (so ``on_broken`` is not needed)."""
        state = self.state(session)
        agent = self._agent
        if state is None or agent is None or session.closed:
            return None
        if not route_fits(table, remote_layout, local_layout, write, self._memory.host_ranges):
            return None
        with state.cond:
            if state.closed or state.reloading or state.remote is None:
                return None
            try:
                lists = prepare_lists(agent, state.remote, local_layout, remote_layout, self._memory.slots.addr,
                                      state.generation_addr)
            except agent.errors as exc:
                logger.info("cluster %s: no NIXL block route to cluster %s (%s)", self.engine.cluster_id,
                            session.cluster_id, exc)
                return None
            route = NixlRoute(self, session, state, state.remote, table.generation, local_layout, remote_layout,
                              write, lists, timeout_ms)
            state.add_route(route)
            return route

    def _route_run(self, route: NixlRoute, local_indices: np.ndarray, remote_indices: np.ndarray) -> bool:
        """One call of ``route`` with its indices (``Transfers.route_call``) under the route's
        ``timeout_ms``, counted in flight on its link: False where it declines before moving
        anything or the peer's generation is not the route's."""
        session = route.owner
        if route.closed or session.closed:
            return False
        deadline = dl.after(route.timeout_ms) if route.timeout_ms >= 0 else float("inf")
        try:
            begun = self._begin(session, deadline)
        except LLMException:
            return False  # the checked path says why
        try:
            return self._transfers.route_call(route, begun, local_indices, remote_indices, deadline)
        finally:
            self._finish(begun[0], begun[1])

    def _close_routes(self, state: NixlLink, local_layout=None) -> None:
        """Close the link's routes (those of ``local_layout`` alone, if given) and release their
        lists, now if no request of the link is in flight, else when the last one ends."""
        agent = self._agent
        handles = state.close_routes(local_layout)
        if agent is not None:
            for handle in handles:
                agent.release_list(handle)

    # -- transfers -----------------------------------------------------------------------------------
    def table_is_current(self, session, table) -> bool:
        return True  # the generation is read through NIXL in transfer, under its deadline

    def transfer(self, session, table, plan, write: bool, deadline: float) -> None:
        bad = table.ranges.first_outside(plan, write)
        if bad >= 0:
            raise fail(S.LLM_KV_CACHE_NOT_EXIST, f"descriptor {bad} names memory that cluster "
                                                 f"{session.cluster_id} has not registered")
        if self._memory.host_ranges.first_outside(plan, not write) >= 0:
            # Local memory NIXL does not know (a create_cpu_cache buffer): frames carry it.
            self.sibling("tcp").transfer(session, table, plan, write, deadline)
            return
        self._move(session, table, plan, write, deadline, DRAM, 0, False)

    def carries(self, session, local_device: bool, remote_device: bool) -> bool:
        if local_device and self._memory_kind() != VRAM:
            return False  # acl memory stays on staging
        if remote_device:
            state = self.state(session)
            return state is not None and state.vram_device is not None
        return True

    def _memory_kind(self) -> int:
        """How this engine's DEVICE caches are registered: VRAM for cuda, else DRAM (or not at all)."""
        return device_memory_type(getattr(self.engine, "runtime", None))

    def transfer_device(self, session, table, plan, write: bool, deadline: float, local_device: bool,
                        remote_device: bool) -> None:
        remote_ranges = table.device_ranges if remote_device else table.ranges
        bad = remote_ranges.first_outside(plan, write)
        if bad >= 0:
            raise fail(S.LLM_KV_CACHE_NOT_EXIST, f"descriptor {bad} names memory that cluster "
                                                 f"{session.cluster_id} has not registered")
        local_ranges = self._memory.device_ranges if local_device else self._memory.host_ranges
        if local_ranges.first_outside(plan, not write) >= 0:
            staging = self.sibling("staging")
            if staging is None:
                raise fail(S.LLM_KV_CACHE_NOT_EXIST, "the local side of the transfer is not registered with NIXL")
            staging.transfer_device(session, table, plan, write, deadline, local_device, remote_device)
            return
        device = int(getattr(self.engine, "device_id", 0))
        self._move(session, table, plan, write, deadline, VRAM if local_device else DRAM,
                   device if local_device else 0, remote_device)

    def _move(self, session, table, plan, write: bool, deadline: float, local_mem: int, local_device: int,
              remote_vram: bool) -> None:
        """Move ``plan`` in one NIXL request before ``deadline`` (``Transfers.move``), counted in
        flight on its link."""
        begun = self._begin(session, deadline)
        try:
            self._transfers.move(session, begun, table, plan, write, deadline, local_mem, local_device, remote_vram)
        finally:
            self._finish(begun[0], begun[1])

    # -- the life of a request -----------------------------------------------------------------------
    def _begin(self, session, deadline: float) -> Begun:
        """The agent, the link's state, the peer's agent name, its generation list, VRAM device and
        generation word's address, the link counted as in use until ``_finish``; LLM_LINK_FAILED
        where the link ended, LLM_TIMEOUT where a reload outlasts the deadline."""
        state = self.state(session)
        if state is None:
            raise fail(S.LLM_LINK_FAILED, f"the link to cluster {session.cluster_id} is closed")
        with state.cond:
            while state.reloading and not dl.expired(deadline):
                state.cond.wait(min(0.1, max(0.001, dl.left_s(deadline))))
            if state.reloading:
                raise fail(S.LLM_TIMEOUT, f"the NIXL metadata of cluster {session.cluster_id} was still reloading "
                                          f"at the deadline")
            with self._lock:
                agent = self._agent
                if agent is None or state.closed or state.remote is None or state.generation_list is None:
                    raise fail(S.LLM_LINK_FAILED, f"the link to cluster {session.cluster_id} is closed")
                self._active += 1
            state.active += 1
            return agent, state, state.remote, state.generation_list, state.vram_device, state.generation_addr

    def _finish(self, agent: Agent, state: NixlLink) -> None:
        """A request of the link is over: release the lists retired meanwhile once none is left."""
        for handle in state.leave():
            agent.release_list(handle)
        with self._lock:
            self._active -= 1
            self._idle.notify_all()

    def _end(self, session, state: NixlLink, code: int, why: str) -> Exception:
        """Remove the peer's agent (nothing more moves through it) and end the link (its first
        connection is shut down, so the manager drops the link); the exception to raise."""
        name, generation_list = state.detach()
        self._unload(state, name, generation_list)
        channel = getattr(session, "outgoing", None)
        if channel is not None:
            channel.fault(S.LLM_LINK_FAILED, f"nixl: {why}")
        return fail(code, why)

    def _unload(self, state: NixlLink, name: Optional[str], generation_list: Optional[int]) -> None:
        """Close the link's routes, remove the peer's agent ``name`` and release its generation
        list (the routes' lists too), now if no request of the link is in flight, else when the
        last one ends."""
        self._close_routes(state)
        agent = self._agent
        if generation_list is not None:
            for handle in state.retire([generation_list]):
                if agent is not None:
                    agent.release_list(handle)
        if name is not None:
            if agent is not None:
                agent.remove(name)  # requests in flight fail at once (NIXL: the agent was invalidated)
            with self._lock:
                if self._loaded.get(name) is state:
                    del self._loaded[name]

    def close(self, session) -> None:
        state = self.state(session)
        if state is None:
            return
        name, generation_list = state.detach(close=True)
        self._unload(state, name, generation_list)

    def shutdown(self) -> None:
        """The engine's links are closing (each already dropped its peer's agent): wait for the
        requests still in flight (they fail at once), deregister everything, drop the agent."""
        with self._lock:
            states = set(self._loaded.values())
        for state in states:
            self._close_routes(state)
        with self._lock:
            ends = time.monotonic() + SHUTDOWN_WAIT_S
            while self._active and time.monotonic() < ends:
                self._idle.wait(0.1)
            agent, self._agent = self._agent, None
            self._agent_error = "the engine is finalized"
            if agent is None:
                return
            if self._active:  # a request still inside NIXL: keep the agent rather than free it under it
                logger.error("cluster %s: %d NIXL requests still running at finalize; the agent is left alive",
                             self.engine.cluster_id, self._active)
                self._kept.append(agent)
                return
            for name in list(self._loaded):
                agent.remove(name)
            self._loaded.clear()
            for handle in self._transfers.leaked:
                agent.release(handle)
            self._transfers.leaked.clear()
            self._memory.release(agent)
            agent.close()

    def _count(self, counter: str) -> None:
        with self._lock:
            self.stats[counter] += 1


def _link_addresses(session) -> Optional[Tuple[str, str]]:
    """``(this side's address, the peer's)`` of the link's first TCP connection, or None."""
    sockets = [channel.sock for channel in getattr(session, "channels", ())] + list(getattr(session, "incoming", ()))
    for sock in sockets:
        try:
            return sock.getsockname()[0], sock.getpeername()[0]
        except (OSError, IndexError, TypeError):
            continue
    return None


def _resolved_plane(options: Any) -> str:
    try:
        return plane_registry.resolve(options)
    except Exception:  # noqa: BLE001 - an invalid value fails the engine elsewhere
        return plane_registry.AUTO
