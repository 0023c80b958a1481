"""A group of daemon threads that one part of the transport starts and joins: the listener's
accept loops and handshake threads, the server's connection threads, the link manager's
background work. Each part owns its group; none joins another's threads.
"""

from __future__ import annotations

import threading
from typing import Callable, List


class Threads:
    """Daemon threads named ``name``, remembered until they end, joined by ``join``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._threads: List[threading.Thread] = []
        self._lock = threading.Lock()

    def spawn(self, target: Callable, *args) -> threading.Thread:
        """Start ``target(*args)`` on a new thread of the group (RuntimeError if none can start)."""
        thread = threading.Thread(target=target, args=args, daemon=True, name=self.name)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        try:
            thread.start()
        except BaseException:
            with self._lock:  # never started: nothing to join
                self._threads = [t for t in self._threads if t is not thread]
            raise
        return thread

    def join(self, timeout_s: float = 2.0) -> None:
        """Wait (``timeout_s`` per thread) for every thread of the group but the calling one."""
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=timeout_s)
