"""A stranger that holds a listener's handshake slots: a child process (``spawn``) with one thread
per connection, each connecting from a given local address, saying what its mode says and then
nothing, and reconnecting as soon as the server closes it (the full rate of the issue's attack).

Modes: ``idle`` sends nothing, ``partial`` the first bytes of a hello, ``hello`` a whole valid
hello (claiming a secret it does not know), after which it reads the challenge and stalls.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import threading
import time
from typing import List, Sequence, Tuple

from llm_datadist.transport import auth, wire

_CTX = mp.get_context("spawn")
MODES = ("idle", "partial", "hello")
STRANGER_ID = 666


def _hello() -> bytes:
    payload = json.dumps({"cluster_id": STRANGER_ID, "nonce": os.urandom(auth.NONCE_BYTES).hex(),
                          "auth": True}).encode()
    return wire.HEADER.pack(wire.MAGIC, wire.PROTOCOL_VERSION, wire.OP_HELLO, 0, 1, len(payload)) + payload


def _hold(address: Tuple[str, int], source: str, mode: str, stop, opened, held) -> None:
    """Keep one connection from ``source`` open, reopening it at once whenever it is closed."""
    while not stop.is_set():
        try:
            sock = socket.create_connection(address, timeout=1.0, source_address=(source, 0))
        except OSError:
            time.sleep(0.001)
            continue
        with opened.get_lock():
            opened.value += 1
        with held.get_lock():
            held.value += 1
        try:
            if mode == "partial":
                sock.sendall(_hello()[:10])
            elif mode == "hello":
                sock.sendall(_hello())
            sock.settimeout(0.1)
            while not stop.is_set():
                try:
                    if not sock.recv(4096):  # closed by the server
                        break
                except socket.timeout:
                    continue
        except OSError:
            pass
        finally:
            with held.get_lock():
                held.value -= 1
            sock.close()


def _main(address, plan: List[Tuple[str, str]], stop, opened, held) -> None:
    threads = [threading.Thread(target=_hold, args=(address, source, mode, stop, opened, held), daemon=True)
               for source, mode in plan]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


class Flood:
    """``per_source`` connections from each of ``sources`` to ``address``, in the modes of
    ``modes`` taken in turn, held until ``close()``. ``opened``: connections made so far;
    ``held``: open now."""

    def __init__(self, address: Tuple[str, int], sources: Sequence[str], per_source: int,
                 modes: Sequence[str] = ("idle",)) -> None:
        plan = [(source, modes[i % len(modes)]) for source in sources for i in range(per_source)]
        self._stop = _CTX.Event()
        self._opened = _CTX.Value("l", 0)
        self._held = _CTX.Value("l", 0)
        self.process = _CTX.Process(target=_main, args=(tuple(address), plan, self._stop, self._opened, self._held),
                                    daemon=True, name="llm_datadist-flood")
        self.process.start()

    @property
    def opened(self) -> int:
        return self._opened.value

    @property
    def held(self) -> int:
        return self._held.value

    def close(self) -> None:
        self._stop.set()
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def __enter__(self) -> "Flood":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
