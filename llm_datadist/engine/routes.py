"""Same-host block routes: the latency path of repeated block pushes and pulls.

A route moves blocks between one local blocks cache and one blocks cache of a linked peer with
what holds between calls established once (``DataPlane.block_route``: cma's ``_io.BlockRoute``,
tcp's and staging's ``_io.TcpRoute``, nixl's ``NixlRoute``). ``BlockRoutes`` keeps an engine's
routes by ``RouteKey``, the one place a key is made: the Python-style API asks it first
(``find``) and takes the checked path through the engine when no route takes the call; after a
checked block transfer, the engine has the route of its key built or kept and taught the tensor
selection the caller's layer arguments resolved to (``learn``). Routes go with their local cache
(``drop_cache``) and at finalize (``close``); a route notices a closed link or a changed peer
registry by itself (``route.current``).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Mapping, NamedTuple, Optional

from llm_datadist.engine.registry import Registry
from llm_datadist.engine.values import CacheRecord, PlannedTransfer


class RouteKey(NamedTuple):
    """Which route serves a block transfer: the remote cluster, the model_id its blocks cache is
    registered under (``BlocksCacheKey.model_id``), the local cache and the direction (``write``:
    a push)."""

    remote_id: int
    model_id: int
    cache_id: int
    write: bool


class BlockRoutes(Mapping[RouteKey, Any]):
    """An engine's block routes, a read-only mapping ``RouteKey -> route``.

    Changed under the registry's lock, so that a route never outlives its local cache: the
    registry drops a cache's routes (``drop_cache``) while it holds the lock. Routes are learnt
    only between ``open`` (the engine initialized, with its links) and ``close`` (finalize)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._routes: Dict[RouteKey, Any] = {}
        self._links: Any = None  # the engine's transport.links.LinkManager between open and close
        self._timeout_ms = 0

    def open(self, links: Any, timeout_ms: int) -> None:
        """Learn routes from now on, built by ``links`` (``LinkManager.block_route``), each of
        their calls limited to ``timeout_ms``."""
        with self._registry.lock:
            self._links, self._timeout_ms = links, timeout_ms

    def close(self) -> None:
        """Drop every route and learn none until ``open``."""
        with self._registry.lock:
            self._links = None
            self._routes.clear()

    def clear(self) -> None:
        """Drop every route (the next checked transfer of a key builds its route anew)."""
        with self._registry.lock:
            self._routes.clear()

    def find(self, remote_id: int, model_id: int, cache_id: int, write: bool) -> Optional[Any]:
        """The route of a block transfer, or None: the first thing a push or pull tries, so no
        lock (a route checks what can change between calls itself). The probe is a plain tuple of
        the key's fields, which hashes and compares equal to the ``RouteKey`` and costs a fraction
        of making one."""
        return self._routes.get((remote_id, model_id, cache_id, write))

    def learn(self, remote_id: int, model_id: int, local: CacheRecord, write: bool, layer_args: tuple,
              planned: PlannedTransfer) -> None:
        """After a checked block transfer between the local ``local`` and the peer's blocks cache
        of ``model_id`` (``planned`` what it planned): keep (or build) the route of that key and
        teach it the tensor selection the caller's ``layer_args`` (``(src_layer_range,
        dst_layer_range, tensor_num_per_layer)``) resolved to. A transient
        (``create_cpu_cache``) cache, a remote cache the host cannot address, a plane without
        routes or a cache that left the registry meanwhile: none. The caller leaves out local
        device memory the host cannot address (it moves through the link's device plane)."""
        table, cache = planned.table, planned.cache
        if local.cache_id <= 0 or not cache.host_addressable:
            return  # routes copy host memory
        registry = self._registry
        with registry.lock:
            links = self._links
            if links is None or not registry.holds(local):
                return
            key = RouteKey(remote_id, model_id, local.cache_id, write)
            route = self._routes.get(key)
            if (route is None or not route.current or route.generation != table.generation
                    or route.remote is not cache.layout or route.local is not local.layout):
                route = links.block_route(remote_id, table, cache.layout, local.layout, write, self._timeout_ms)
                if route is None:
                    self._routes.pop(key, None)
                    return
                self._routes[key] = route
            route.learn(layer_args, planned.src_tensors, planned.dst_tensors)

    def drop_cache(self, cache_id: int) -> None:
        """Drop the routes of a local cache (it is leaving the registry, whose lock is held)."""
        for key in [key for key in self._routes if key.cache_id == cache_id]:
            del self._routes[key]

    # -- the mapping ----------------------------------------------------------------------------
    def __getitem__(self, key: RouteKey) -> Any:
        return self._routes[key]

    def __iter__(self) -> Iterator[RouteKey]:
        return iter(list(self._routes))

    def __len__(self) -> int:
        return len(self._routes)
