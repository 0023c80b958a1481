"""How many pytest-xdist workers the whole suite runs in (``tests/conftest.py``)."""

import os

import pytest

#: The most worker processes the whole suite runs in by default (``pytest_cmdline_main``).
MAX_WORKERS = 4


def default_workers(cores: int) -> int:
    """How many xdist workers the whole suite runs in when nobody said: one per core up to
    ``MAX_WORKERS``, or ``LLM_DATADIST_TEST_WORKERS`` (0: no workers, the suite in this process)."""
    chosen = os.environ.get("LLM_DATADIST_TEST_WORKERS", "")
    if chosen:
        try:
            workers = int(chosen)
        except ValueError:
            raise pytest.UsageError(f"LLM_DATADIST_TEST_WORKERS={chosen!r} is not a number of workers") from None
        if workers < 0:
            raise pytest.UsageError(f"LLM_DATADIST_TEST_WORKERS={chosen!r} is negative")
        return workers
    return min(cores, MAX_WORKERS) if cores >= 2 else 0
