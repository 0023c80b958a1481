"""CANN's ``llm_datadist.v2`` module paths (hicann/hixl, ``src/python/llm_datadist/llm_datadist/v2/``).

``llm_types``, ``cache_manager``, ``llm_datadist``, ``config`` and ``llm_utils`` each give the
names CANN's module of that name defines (and the public names of the package it imports), as
the very objects the rest of this package defines: programs that import from these paths get
the same classes as ``from llm_datadist import ...``. The helpers CANN defines in them for its
native wrapper and its v1 mode (``llm_utils``' ``pack_*`` and layer-wise job, ``config``'s
``ClusterConfig`` / ``EngineConfig``) are here too, with CANN's behaviour over this package's
objects. Not here: CANN's native wrapper modules, its logging module and its argument-check
helpers; ``tests/api/test_v2_paths.py`` lists every name, with why.
"""
