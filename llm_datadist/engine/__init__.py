"""The engine: one process's caches, keys and pools, local copies, transfers to linked clusters
and layer-wise jobs, below both API styles (design §2). ``LLMDataDist.engine`` is its documented
seam for the CLI and the integrations."""
