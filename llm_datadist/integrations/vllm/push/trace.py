"""Push timings for ``bench/report_vllm_push.py``, written by both workers where ``TRACE_ENV`` is set."""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Dict

#: Where the prefill and decode workers append their push timings (bench/report_vllm_push.py):
#: one JSON object a line, to ``<path>.<pid>``. Unset: nothing is recorded.
TRACE_ENV = "LLM_DATADIST_PUSH_TRACE"


class Trace:
    """Push timings for the benchmark (``TRACE_ENV``); a no-op when it is unset."""

    def __init__(self) -> None:
        path = os.environ.get(TRACE_ENV)
        self._path = f"{path}.{os.getpid()}" if path else None
        self._lock = threading.Lock()

    def write(self, record: Dict[str, Any]) -> None:
        if self._path is None:
            return
        with self._lock, open(self._path, "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")
