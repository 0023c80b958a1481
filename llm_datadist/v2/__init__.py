"""CANN's ``llm_datadist.v2`` module paths (hicann/hixl, ``src/python/llm_datadist/llm_datadist/v2/``).

``llm_types``, ``cache_manager``, ``llm_datadist``, ``config`` and ``llm_utils`` each give the
names CANN's module of that name defines (and the public names of the package it imports), as
the very objects the rest of this package defines: programs that import from these paths get
the same classes as ``from llm_datadist import ...``. What CANN's modules hold only to drive its
native wrapper or its v1 mode is not here; ``tests/api/test_v2_paths.py`` lists it, with why.
"""
