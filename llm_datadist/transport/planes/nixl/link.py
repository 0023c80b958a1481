"""``NixlLink``: the nixl plane's state for one link (``DataPlane.link_state``), and its changes.

Each change is made under the link's condition (``cond``); NIXL is never called under it here: a
method hands back the prepared lists that the caller releases, once no request of the link uses
them (``retire``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional, Tuple

if TYPE_CHECKING:  # the route holds its link: a type only
    from llm_datadist.transport.planes.nixl.route import NixlRoute


@dataclass(eq=False)
class NixlLink:
    """nixl's state for one link: the peer's agent loaded into ours (``remote``; None until accepted
    and after the link ends), the metadata loaded, the peer's generation word and its prepared
    descriptor list, and the count of this link's requests in flight (a metadata reload waits for
    them, and a prepared list goes only once none uses it: ``cond``)."""

    remote: Optional[str] = None
    blob: bytes = b""
    generation_addr: int = 0
    generation_list: Optional[int] = None
    #: The GPU whose memory the peer registers as VRAM (its DEVICE caches), or None.
    vram_device: Optional[int] = None
    active: int = 0
    reloading: bool = False
    closed: bool = False
    #: Prepared lists dropped while requests were in flight: released when the last one ends.
    retired: List[int] = field(default_factory=list)
    #: The block routes made for the link (``NixlRoute``): closed, their lists released, when the
    #: link ends, the peer's metadata is reloaded or their local cache leaves.
    routes: List["NixlRoute"] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def attach(self, name: str, blob: bytes, generation_addr: int, generation_list: int,
               vram_device: Optional[int]) -> bool:
        """The peer's agent ``name`` is loaded from ``blob``: keep it, unless the link closed
        meanwhile (False: its close found nothing to unload, the caller unloads it)."""
        with self.cond:
            if self.closed:
                return False
            self.remote, self.blob, self.generation_addr = name, blob, generation_addr
            self.generation_list, self.vram_device = generation_list, vram_device
            return True

    def detach(self, close: bool = False) -> Tuple[Optional[str], Optional[int]]:
        """Forget the peer's agent (and close the link, with ``close``): ``(its name, its
        generation list)`` as they were, for the caller to unload."""
        with self.cond:
            name, self.remote = self.remote, None
            generation_list, self.generation_list = self.generation_list, None
            if close:
                self.closed = True
                self.cond.notify_all()
            return name, generation_list

    def leave(self) -> List[int]:
        """A request of the link is over: the lists retired meanwhile, to release now, once none
        is left in flight."""
        with self.cond:
            self.active -= 1
            retired = []
            if not self.active:
                retired, self.retired = self.retired, []
            self.cond.notify_all()
            return retired

    def retire(self, handles: List[int]) -> List[int]:
        """Prepared lists the link no longer needs: those to release now (no request of the link
        is in flight), else none (kept until the last request ends, ``leave``)."""
        with self.cond:
            if self.active:
                self.retired.extend(handles)
                return []
            return handles

    def add_route(self, route: "NixlRoute") -> None:
        """Keep ``route`` (the condition held: the route's lists were prepared under it), and
        forget the routes closed meanwhile."""
        self.routes = [r for r in self.routes if not r.closed] + [route]

    def close_routes(self, local_layout=None) -> List[int]:
        """Close the link's routes (those of ``local_layout`` alone, if given): their lists, to
        release now, or none if a request of the link is in flight (they are retired)."""
        with self.cond:
            closing = [r for r in self.routes if local_layout is None or r.local is local_layout]
            self.routes = [r for r in self.routes if r not in closing and not r.closed]
            handles = []
            for route in closing:
                route.closed = True
                if route.lists is not None:
                    handles.extend(route.lists)
                    route.lists = None
            if self.active:
                self.retired.extend(handles)
                handles = []
            return handles

    def start_reload(self, wait_s: float) -> Tuple[int, bool]:
        """Hold new requests of the link back (``reloading``) and wait up to ``wait_s`` for those
        in flight: ``(requests still in flight, whether the link closed)``; ``end_reload`` after."""
        with self.cond:
            self.reloading = True
            ends = time.monotonic() + wait_s
            while self.active and not self.closed and time.monotonic() < ends:
                self.cond.wait(0.1)
            return self.active, self.closed

    def end_reload(self) -> None:
        with self.cond:
            self.reloading = False
            self.cond.notify_all()
