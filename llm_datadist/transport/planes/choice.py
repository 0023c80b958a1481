"""Which data planes carry this side's transfers on each link (``PlaneChoice``), chosen by the
peer's cache table (``PlaneChoice.fetch_table``) and what of its table reply the planes read
(``plane_facts``).

Nothing the peer claims about itself is trusted: each side fetches the other's cache table over
its own connections of the link and picks the data plane of its own transfers: the one the
option ``llm.DataPlane`` (or the environment variable ``LLM_DATADIST_DATA_PLANE``) forces, or
under ``auto`` the first of ``planes.auto_order()`` that accepts the link -- the same-host plane
towards a process the kernel proved, frames otherwise. A transfer with device memory that the
host cannot address on either side (the engine says so of its own cache, the peer's table of the
peer's) goes to a plane with ``device_memory`` instead, chosen per link and per combination on
first use (``DataPlane`` in ``planes.base``). Each plane's per-link state lives in the link
(``Link.plane_state``, made by ``DataPlane.link_state`` before the plane's ``accept`` and dropped
when it refuses or the link ends).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Tuple

from llm_datadist.status import LLMException
from llm_datadist.transport import deadline as dl
from llm_datadist.transport import planes as plane_registry
from llm_datadist.transport import wire
from llm_datadist.transport.errors import S, ProtocolError, fail
from llm_datadist.transport.planes.base import DataPlane
from llm_datadist.transport.session import Link
from llm_datadist.transport.settings import LinkSettings
from llm_datadist.transport.stats import CountCallback
from llm_datadist.transport.table import RemoteTable

logger = logging.getLogger("llm_datadist")

def plane_facts(body: Dict[str, Any]) -> Dict[str, Any]:
    """What of a table reply is kept beside the table: each entry a plane reads
    (``DataPlane.facts_keys``) as that plane parsed it into bounded typed fields
    (``DataPlane.parse_facts``), nothing else the peer put in the reply; ProtocolError for a
    malformed entry."""
    facts: Dict[str, Any] = {}
    for name in plane_registry.names():
        plane = plane_registry.get(name)
        for key in plane.facts_keys:
            if key in body and key not in facts:
                facts[key] = plane.parse_facts(key, body[key])
    return facts


def accept_plane(peer: Link, plane: DataPlane, facts: Any, deadline: float) -> Optional[str]:
    """Give ``plane`` its state for the link (``DataPlane.link_state``, kept in
    ``peer.plane_state``) and ask it to accept the link; a plane that refuses is closed and
    its state dropped. None, or why it refused."""
    state = plane.link_state(peer)
    if state is not None:
        peer.plane_state[plane.name] = state
    reason = plane.accept(peer, facts, deadline)
    if reason is not None:
        peer.release_plane(plane)
    return reason


class PlaneChoice:
    """The peer's table on each link of one engine, and the choice of the link's planes by it,
    among the instances of ``planes`` (its ``PlaneSet``) under ``settings.plane`` (``auto`` or the
    forced plane). What it fetches and chooses is kept in the link (``Link.table``,
    ``Link.facts``, ``Link.plane``, ``Link.device_planes``, ``Link.extra_planes``). ``count`` is
    told of ``refused_tables`` and ``malformed_tables``."""

    def __init__(self, cluster_id: int, settings: LinkSettings, planes: plane_registry.PlaneSet,
                 count: CountCallback) -> None:
        self.cluster_id = cluster_id
        self._settings = settings
        self._planes = planes
        self._count = count

    def offered(self) -> List[str]:
        """The planes this side names in its link request or reply."""
        return list(plane_registry.offered(self._settings.plane))

    def wants_local_sockets(self) -> bool:
        """Whether a plane this side may use wants the link's connections on Unix sockets."""
        return any(plane_registry.get(name).local_sockets for name in plane_registry.offered(self._settings.plane))

    def fetch_table(self, peer: Link, timeout_ms: int) -> Tuple[RemoteTable, Dict[str, Any]]:
        """The peer's cache table, and what its planes told us (``plane_facts``); a reply that is
        malformed in either fails with ``LLM_LINK_FAILED`` (counted ``malformed_tables``)."""
        status, body = peer.outgoing.control(wire.OP_TABLE_GET, wire.OP_TABLE, {}, timeout_ms, "cache table",
                                             limit=self._settings.max_table_bytes,
                                             on_oversized=lambda: self._count("refused_tables"))
        try:
            return RemoteTable(body), plane_facts(body)
        except ProtocolError as exc:
            self._count("malformed_tables")
            raise LLMException(f"cluster {peer.cluster_id} sent a bad cache table: {exc}",
                               status_code=S.LLM_LINK_FAILED) from None

    def refresh_table(self, peer: Link, timeout_ms: int) -> RemoteTable:
        """Fetch the peer's table again (its registry changed), and tell the link's planes."""
        table, facts = self.fetch_table(peer, timeout_ms)
        peer.table, peer.facts = table, facts
        for plane in [peer.plane, *peer.extra_planes]:
            if plane is not None:
                plane.on_table(peer, table)
        return table

    def settle(self, peer: Link, deadline: float) -> None:
        """Fetch the peer's table and choose the plane of this side's transfers (once)."""
        if peer.plane is not None:
            return
        with peer.settle_lock:
            if peer.plane is not None:
                return
            table, facts = self.fetch_table(peer, dl.left_ms(deadline))
            plane = self.choose(peer, facts, deadline)
            peer.table, peer.facts = table, facts
            peer.plane = plane
            if peer.closed:  # unlinked or lost meanwhile: close() may have run before the accept
                peer.release_plane(plane)

    def data_plane(self, peer: Link, timeout_ms: int, local_device: bool, remote_device: bool) -> str:
        """The plane of this side's transfers on ``peer`` (chosen now if not yet): the link's
        plane, or with device memory on either side the device plane of that combination."""
        deadline = dl.after(timeout_ms)
        self.settle(peer, deadline)
        if local_device or remote_device:
            return self.device_plane(peer, local_device, remote_device, deadline).name
        return peer.plane.name

    def _plane(self, name: str) -> DataPlane:
        return self._planes.instance(name)  # made now if registered after this engine's set was

    def choose(self, peer: Link, facts: Any, deadline: Optional[float] = None) -> DataPlane:
        """The forced plane, or under ``auto`` the first of ``planes.auto_order()`` without
        ``device_memory`` (or with ``auto_host_memory``) whose ``accept`` takes the link (the
        fallback plane always does). A
        link to this very process uses the fallback: frames, checked by the owner (ourselves). A
        forced plane that refuses fails the link (``LLM_LINK_FAILED``)."""
        forced = self._settings.plane
        if deadline is None:
            deadline = dl.after(self._settings.handshake_ms)
        if not isinstance(facts, dict):
            facts = {}
        if peer.unix and peer.pid == os.getpid():
            names = plane_registry.fallbacks()
        elif forced == plane_registry.AUTO or not plane_registry.get(forced).host_memory:
            # Device planes are chosen per transfer (device_plane), unless they say they are host
            # planes under auto too (auto_host_memory); a forced plane that moves no host memory
            # applies to device transfers only.
            names = tuple(n for n in plane_registry.auto_order()
                          if not plane_registry.get(n).device_memory or plane_registry.get(n).auto_host_memory)
        else:
            names = (forced,)
        for name in names:
            plane = self._plane(name)
            reason = accept_plane(peer, plane, facts, deadline)
            if reason is None:
                return plane
            if name == forced:
                raise fail(S.LLM_LINK_FAILED, f"{plane_registry.DATA_PLANE_OPTION}={name} but {reason}")
            logger.warning("cluster %d -> %d: data plane %s not usable (%s); trying the next one",
                           self.cluster_id, peer.cluster_id, name, reason)
        raise fail(S.LLM_LINK_FAILED, f"no data plane of {', '.join(names)} accepts the link to cluster "
                                      f"{peer.cluster_id}")

    def device_plane(self, peer: Link, local_device: bool, remote_device: bool, deadline: float) -> DataPlane:
        """The plane of the link's transfers whose local side (``local_device``) or remote side
        (``remote_device``) is device memory the host cannot address: chosen on the first such
        transfer and kept for the link (``Link.device_planes``)."""
        combination = (local_device, remote_device)
        plane = peer.device_planes.get(combination)
        if plane is not None:
            return plane
        with peer.settle_lock:
            plane = peer.device_planes.get(combination)
            if plane is None:
                plane = self._choose_device_plane(peer, local_device, remote_device, deadline)
                peer.device_planes[combination] = plane
        if peer.closed:  # unlinked or lost meanwhile: close() may have run before the accept
            peer.release_plane(plane)
        return plane

    def _choose_device_plane(self, peer: Link, local_device: bool, remote_device: bool,
                             deadline: float) -> DataPlane:
        """The forced plane if it has ``device_memory`` and carries this combination, else the
        first plane of the ``auto``
        order with ``device_memory`` that accepts the link and carries this combination (a
        plane accepted here is closed with the link). ``LLM_FEATURE_NOT_ENABLED`` if none does:
        the transfer fails, the link stays."""
        forced = None if self._settings.plane == plane_registry.AUTO else self._plane(self._settings.plane)
        if forced is not None and forced.device_memory and forced.carries(peer, local_device, remote_device):
            candidates = [forced]
        else:
            candidates = [self._plane(name) for name in plane_registry.auto_order()
                          if plane_registry.get(name).device_memory]
        reasons = []
        for plane in candidates:
            if plane is not peer.plane and not any(p is plane for p in peer.extra_planes):
                reason = accept_plane(peer, plane, peer.facts, deadline)
                if reason is not None:
                    reasons.append(f"{plane.name}: {reason}")
                    continue
                peer.extra_planes.append(plane)
            if plane.carries(peer, local_device, remote_device):
                return plane
            reasons.append(f"{plane.name} does not carry it")
        sides = " and ".join(side for side, device in (("local", local_device), ("remote", remote_device)) if device)
        why = "; ".join(reasons) or "none has device_memory"
        raise fail(S.LLM_FEATURE_NOT_ENABLED, f"no data plane moves device memory ({sides} side) on the link to "
                                              f"cluster {peer.cluster_id}: {why}")
