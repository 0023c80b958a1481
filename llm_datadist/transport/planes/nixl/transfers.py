"""``Transfers``: what the nixl plane's transfers post to NIXL, and how they are waited for.

Each method runs for one transfer that ``NixlPlane._begin`` counted in flight on its link, with
what ``_begin`` read (``begun``: the agent, the link's state, the peer's agent name, its
generation list, VRAM device and generation word's address); ``NixlPlane._finish`` ends it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from llm_datadist.transport.errors import S, StaleTable, fail
from llm_datadist.transport.planes.nixl.agent import Agent, request_rows
from llm_datadist.transport.planes.nixl.link import NixlLink
from llm_datadist.transport.planes.nixl.memory import GENERATION_SLOTS, GenerationSlots
from llm_datadist.transport.planes.nixl.metadata import DRAM, VRAM

#: What ``NixlPlane._begin`` read for a transfer.
Begun = Tuple[Agent, NixlLink, str, int, Optional[int], int]


class Transfers:
    """The plane's NIXL requests: the peer's registry generation read through NIXL
    (``peer_generation``), a plan as one request (``move``), a block route's call by index
    (``route_call``), each posted and waited for until its deadline (``complete``). A request
    that fails or outlives its deadline is released (cancelled) and ends its link (``end``: the
    plane's ``_end``, which returns the exception to raise), counted with ``count``; one NIXL could
    not release is kept in ``leaked`` (under ``lock``) for the agent's end."""

    def __init__(self, slots: GenerationSlots, lock: threading.RLock, count: Callable[[str], None],
                 end: Callable[[Any, NixlLink, int, str], Exception]) -> None:
        self.slots = slots
        self.leaked: List[int] = []
        self._lock = lock
        self._count = count
        self._end = end

    def move(self, session, begun: Begun, table, plan, write: bool, deadline: float, local_mem: int,
             local_device: int, remote_vram: bool) -> None:
        """Move ``plan`` in one NIXL request (``write``: local -> peer) before ``deadline``, the
        peer's generation checked: a write reads it first (no byte may land in memory the peer
        re-registered); a read of host memory into host memory reads it last in the same request
        (``StaleTable`` after it: nothing of the peer's was written), other reads first."""
        agent, state, remote, generation_list, vram_device, generation_addr = begun
        slots = self.slots
        slot = -1
        try:
            folded = not write and local_mem == DRAM and not remote_vram
            if folded:
                slot = slots.take()
                if slot < 0:
                    raise fail(S.LLM_LINK_BUSY, f"{GENERATION_SLOTS} NIXL transfers are starting at once")
            elif self.peer_generation(session, agent, state, generation_list, deadline) != table.generation:
                raise StaleTable()
            descriptors = plan.descriptors()
            if not len(descriptors):
                return
            if remote_vram and vram_device is None:
                raise fail(S.LLM_FEATURE_NOT_ENABLED, f"cluster {session.cluster_id} registers no VRAM with NIXL")
            local, remote_rows = request_rows(descriptors, write, local_device, vram_device if remote_vram else 0,
                                              extra=folded)
            if folded:  # the generation word last: read after the data on a lane that keeps order
                local[-1] = (slots.addr + 8 * slot, 8, 0)
                remote_rows[-1] = (generation_addr, 8, 0)
            try:
                handle = agent.request(write, local_mem, local, VRAM if remote_vram else DRAM, remote_rows, remote)
            except agent.errors as exc:
                if agent.not_found is not None and isinstance(exc, agent.not_found):
                    raise fail(S.LLM_KV_CACHE_NOT_EXIST, f"NIXL does not know part of the transfer's memory on "
                                                         f"cluster {session.cluster_id} or here: {exc}") from None
                raise self._end(session, state, S.LLM_LINK_FAILED, f"NIXL refused the transfer with cluster "
                                                                   f"{session.cluster_id}: {exc}") from None
            self.complete(session, agent, state, handle, deadline,
                          f"{'write to' if write else 'read from'} cluster {session.cluster_id}")
            if folded and slots.value(slot) != table.generation:
                raise StaleTable()
        finally:
            if slot >= 0:
                slots.give(slot)

    def route_call(self, route, begun: Begun, local_indices: np.ndarray, remote_indices: np.ndarray,
                   deadline: float) -> bool:
        """One call of block route ``route`` by index (a pull's last entries left for the
        generation word): a push after reading the peer's generation, a pull with it read last
        in the same request. False where it declines before moving anything or the peer's
        generation is not the route's."""
        agent, state, remote, generation_list, _, _ = begun
        session = route.owner
        lists = route.lists  # alive while this request counts in state.active (``NixlLink.close_routes``)
        if route.closed or lists is None or remote != route.remote_name:
            return False
        what = f"{'write to' if route.write else 'read from'} cluster {session.cluster_id}"
        if route.write:
            if self.peer_generation(session, agent, state, generation_list, deadline) != route.generation:
                return False
            try:
                handle = agent.prepared_request(True, lists[0], local_indices, lists[1], remote_indices)
            except agent.errors:
                return False
            self.complete(session, agent, state, handle, deadline, what)
            return True
        slots = self.slots
        slot = slots.take()
        if slot < 0:
            return False
        try:
            local_indices[-1] = route.slot_base + slot
            remote_indices[-1] = route.generation_index
            try:
                handle = agent.prepared_request(False, lists[0], local_indices, lists[1], remote_indices)
            except agent.errors:
                return False
            self.complete(session, agent, state, handle, deadline, what)
            return slots.value(slot) == route.generation
        finally:
            slots.give(slot)

    def peer_generation(self, session, agent: Agent, state: NixlLink, generation_list: int, deadline: float) -> int:
        """The peer's registry generation, read now through NIXL."""
        slots = self.slots
        slot = slots.take()
        if slot < 0:
            raise fail(S.LLM_LINK_BUSY, f"{GENERATION_SLOTS} NIXL transfers are starting at once")
        try:
            try:
                handle = agent.prepared_request(False, slots.list, [slot], generation_list, [0])
            except agent.errors as exc:
                raise self._end(session, state, S.LLM_LINK_FAILED,
                                f"NIXL refused to read cluster {session.cluster_id}'s generation: {exc}") from None
            self.complete(session, agent, state, handle, deadline,
                          f"reading cluster {session.cluster_id}'s registry generation")
            return slots.value(slot)
        finally:
            slots.give(slot)

    def complete(self, session, agent: Agent, state: NixlLink, handle: int, deadline: float, what: str) -> None:
        """Post ``handle`` and wait for it until ``deadline``; the request is released either way.
        Past the deadline it is cancelled and the peer's agent removed (no late byte lands), and
        the link ends (LLM_TIMEOUT); a failed request ends it too (LLM_LINK_FAILED)."""
        try:
            status, failure = agent.wait(handle, deadline)
        finally:
            self.release(agent, handle)  # cancels it if it is still going
        if failure is not None:
            self._count("nixl_failures")
            raise self._end(session, state, S.LLM_LINK_FAILED, f"{what} failed: {failure}")
        if status != agent.done:
            self._count("nixl_timeouts")
            raise self._end(session, state, S.LLM_TIMEOUT, f"{what}: not done within the deadline; the request was "
                                                          f"cancelled and the link ended (link again)")

    def release(self, agent: Agent, handle: int) -> None:
        if not agent.release(handle):
            with self._lock:
                self.leaked.append(handle)  # tried again when the agent goes
