"""``NixlRoute``: repeated block pushes and pulls of a link over two prepared NIXL lists of the
whole caches (``DataPlane.block_route``), made once per local cache, peer cache and direction;
``route_fits`` says whether two caches can have one, ``prepare_lists`` makes its lists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import numpy as np

from llm_datadist import _io
from llm_datadist.transport.planes.nixl.agent import Agent
from llm_datadist.transport.planes.nixl.link import NixlLink
from llm_datadist.transport.planes.nixl.memory import GENERATION_SLOTS
from llm_datadist.transport.planes.nixl.metadata import DRAM

if TYPE_CHECKING:  # the route posts through its plane: a type only
    from llm_datadist.transport.planes.nixl.plane import NixlPlane

#: Most descriptors one route call posts (larger calls take the checked path).
ROUTE_MAX_DESCRIPTORS = 1 << 20
#: Most entries of a prepared list (NIXL takes int32 indices).
_MAX_LIST_ENTRIES = 2**31 - 1


class NixlRoute:
    """Repeated block transfers between one local blocks cache and one blocks cache of a link's
    peer (see ``DataPlane.block_route``), over two prepared NIXL descriptor lists made once.

    The lists are NIXL's compact strided rows (``Agent.prepare_strided``): the local one holds
    every block of every local tensor (tensor ``t``, block ``b`` at index ``t * rows + b``), then
    this plane's generation slots (``GenerationSlots``); the remote one every block of every remote tensor,
    then the peer's registry generation word, each descriptor the local block size. A call turns
    its block ids into indices (``_io.block_indices``: exact ints inside their cache, else the
    checked path) and posts one prepared request (``NixlPlane._route_run``): a push after reading
    the peer's generation, a pull with the generation word read last in the same request. A
    route declines (``run`` returns False, nothing moved) where the link or the route closed,
    the peer's generation is not the route's, or the call is not shaped like a learnt one; the
    caller then takes the checked path. Closed with its link, at a reload of the peer's metadata
    and when its local cache leaves the registry (``NixlPlane._close_routes``)."""

    def __init__(self, plane: "NixlPlane", session, state: NixlLink, remote_name: str, generation: int,
                 local_layout, remote_layout, write: bool, lists: Tuple[int, int], timeout_ms: int) -> None:
        self.plane, self.owner, self.link = plane, session, state
        self.remote_name = remote_name
        self.generation = generation
        #: Each call's limit in ms (``block_route``'s ``timeout_ms``); negative: none.
        self.timeout_ms = timeout_ms
        self.local, self.remote, self.write = local_layout, remote_layout, write
        self.local_rows, self.remote_rows = int(local_layout.num_rows), int(remote_layout.num_rows)
        #: Where the generation slots start in the local list, the generation word in the remote one.
        self.slot_base = int(local_layout.num_tensors) * self.local_rows
        self.generation_index = int(remote_layout.num_tensors) * self.remote_rows
        self.lists: Optional[Tuple[int, int]] = lists
        self.closed = False
        self.selections: Dict[tuple, Tuple[np.ndarray, np.ndarray]] = {}
        self.whole: Optional[Tuple[np.ndarray, np.ndarray]] = None
        self.last: Optional[tuple] = None

    @property
    def current(self) -> bool:
        """Whether the route may still be used: open, its link open, the peer's agent the one its
        remote list was prepared against (the peer's generation is read per call)."""
        return not self.closed and not self.owner.closed and self.link.remote == self.remote_name

    def learn(self, key: tuple, src_tensors, dst_tensors) -> None:
        """Remember the tensor selection of ``key`` = ``(src_layer_range, dst_layer_range,
        tensor_num_per_layer)`` that a checked call resolved (None = every tensor), as the first
        index of each selected tensor in the local and the remote list."""
        local_t, remote_t = (src_tensors, dst_tensors) if self.write else (dst_tensors, src_tensors)
        local_i = range(self.local.num_tensors) if local_t is None else list(local_t)
        remote_i = range(self.remote.num_tensors) if remote_t is None else list(remote_t)
        if len(local_i) != len(remote_i) or len(local_i) == 0:
            raise ValueError(f"a selection pairs {len(local_i)} local with {len(remote_i)} remote tensors")
        if not all(0 <= t < self.local.num_tensors for t in local_i) or \
                not all(0 <= t < self.remote.num_tensors for t in remote_i):
            raise ValueError("a selected tensor is outside the caches")
        selection = (np.asarray(local_i, dtype=np.int64) * self.local_rows,
                     np.asarray(remote_i, dtype=np.int64) * self.remote_rows)
        if key == (None, None, 2) and type(key[2]) is int:
            self.whole = selection
        self.selections[key] = selection

    def run(self, src_blocks, dst_blocks, src_layer_range, dst_layer_range, tensor_num_per_layer) -> bool:
        """Move ``src_blocks[k]`` -> ``dst_blocks[k]`` for every tensor pair of the selection;
        True when done, False when the caller must take the checked path (nothing was moved,
        but a pull whose generation check failed may have filled its destination blocks). A
        request that fails or outlives the deadline ends the link and raises, as the checked
        path does."""
        last = self.last
        if src_layer_range is None and dst_layer_range is None and type(tensor_num_per_layer) is int \
                and tensor_num_per_layer == 2:
            selection = self.whole
        elif (last is not None and last[0] is src_layer_range and last[1] is dst_layer_range
              and last[2] is tensor_num_per_layer):
            selection = last[3]
        elif ((src_layer_range is None or (type(src_layer_range) is range and src_layer_range.step == 1))
              and (dst_layer_range is None or (type(dst_layer_range) is range and dst_layer_range.step == 1))
              and type(tensor_num_per_layer) is int):
            selection = self.selections.get((src_layer_range, dst_layer_range, tensor_num_per_layer))
            if selection is not None:
                self.last = (src_layer_range, dst_layer_range, tensor_num_per_layer, selection)
        else:
            return False
        if selection is None or self.closed or (type(src_blocks) is not list and type(src_blocks) is not tuple):
            return False
        local_bases, remote_bases = selection
        count = len(src_blocks) * len(local_bases)
        if count == 0 or count > ROUTE_MAX_DESCRIPTORS:
            return False
        extra = 0 if self.write else 1  # a pull reads the peer's generation word last
        local_indices = np.empty(count + extra, dtype=np.int32)
        remote_indices = np.empty(count + extra, dtype=np.int32)
        local_blocks, remote_blocks = (src_blocks, dst_blocks) if self.write else (dst_blocks, src_blocks)
        if _io.block_indices(local_blocks, remote_blocks, local_bases, remote_bases, self.local_rows,
                             self.remote_rows, local_indices, remote_indices) != count:
            return False
        return self.plane._route_run(self, local_indices, remote_indices)

    def __repr__(self) -> str:
        return (f"<NixlRoute {'push to' if self.write else 'pull from'} {self.remote_name}, "
                f"{len(self.selections)} selections{', closed' if self.closed else ''}>")


def route_fits(table, remote_layout, local_layout, write: bool, local_ranges) -> bool:
    """Whether the two caches can have a route: the block sizes pair up (a pull's are equal),
    the lists fit NIXL's int32 indices, the local cache lies wholly inside ``local_ranges``
    (memory registered with NIXL here) and the remote one inside the peer's table."""
    block_bytes = int(local_layout.row_bytes)
    if block_bytes == 0 or block_bytes > remote_layout.row_bytes or (
            not write and block_bytes != remote_layout.row_bytes):
        return False
    local_entries = int(local_layout.num_tensors) * int(local_layout.num_rows) + GENERATION_SLOTS
    remote_entries = int(remote_layout.num_tensors) * int(remote_layout.num_rows) + 1
    if max(local_entries, remote_entries) > _MAX_LIST_ENTRIES:
        return False
    return all(local_ranges.contains(a, local_layout.tensor_bytes) for a in local_layout.tensor_addrs) and \
        all(table.ranges.contains(a, remote_layout.tensor_bytes) for a in remote_layout.tensor_addrs)


def prepare_lists(agent: Agent, peer: str, local_layout, remote_layout, slots_addr: int,
                  generation_addr: int) -> Tuple[int, int]:
    """A route's two prepared lists, in NIXL's compact strided form: every local block, then the
    generation slots at ``slots_addr``; every block of the peer's cache (of agent ``peer``), then
    its generation word at ``generation_addr``; each descriptor the local block size. NIXL's
    error propagates, the list made before it released."""
    block_bytes = int(local_layout.row_bytes)
    local_rows = _strided(local_layout, block_bytes)
    local_rows.append((slots_addr, 8, 0, 8, GENERATION_SLOTS))
    remote_rows = _strided(remote_layout, block_bytes)
    remote_rows.append((generation_addr, 8, 0, 8, 1))
    local_list = remote_list = None
    try:
        local_list = agent.prepare_strided("", DRAM, np.array(local_rows, dtype=np.uint64))
        remote_list = agent.prepare_strided(peer, DRAM, np.array(remote_rows, dtype=np.uint64))
    except agent.errors:
        for handle in (local_list, remote_list):
            if handle is not None:
                agent.release_list(handle)
        raise
    return local_list, remote_list


def _strided(layout, block_bytes: int) -> List[Tuple[int, int, int, int, int]]:
    """NIXL compact strided rows of every block of every tensor of ``layout`` (DRAM, device 0):
    ``(tensor address, block_bytes, 0, row bytes, rows)``."""
    return [(int(addr), block_bytes, 0, int(layout.row_bytes), int(layout.num_rows)) for addr in layout.tensor_addrs]
