"""The engine: one process's caches, keys and pools, local copies, transfers to linked clusters
and layer-wise jobs, below both API styles (design §2). ``LLMDataDist.engine`` is its documented
seam for the CLI and the integrations.

``engine.Engine`` is the facade the API styles call; it composes parts that own their state:

* ``values``: references, block specs, records, pools, option parsers (pure data, no threads);
* ``registry.Registry``: records, keys, pools, pins, shared ranges and the generation word;
* ``routes.BlockRoutes``: the same-host block routes by ``RouteKey`` (the latency path);
* ``copies``: local copies and swaps (plain functions: one plan, one execution);
* ``layerwise.LayerRunner``: layer-wise jobs and their threads, handed a transfer function;
* the links (``transport.links.LinkManager``), which see the engine only as an ``EngineView``.
"""
