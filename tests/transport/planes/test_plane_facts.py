"""What a link keeps of its peer's table reply beside the table: each plane's entry, parsed into
bounded typed fields (``DataPlane.parse_facts``), the JSON dropped (``planes.choice.plane_facts``).

The peer is untrusted: a malformed entry is a ``ProtocolError`` (the link then fails with
``LLM_LINK_FAILED``, ``tests/transport/test_budgets.py`` checks that end to end), fields no plane
reads are dropped, and the largest well-formed entry a reply at the table budget can carry is
kept in well under docs/security.md's 2 MiB a link.
"""

from __future__ import annotations

import base64
import gc
import json
import tracemalloc

import pytest

from llm_datadist.transport import budgets
from llm_datadist.transport import planes as plane_registry
from llm_datadist.transport.errors import ProtocolError
from llm_datadist.transport.planes.choice import plane_facts
from llm_datadist.transport.planes.base import DataPlane
from llm_datadist.transport.planes.cma import SameHostFacts
from llm_datadist.transport.planes.cuda_ipc import MAX_EXPORTS, IpcFacts
from llm_datadist.transport.planes.nixl import MAX_METADATA_BYTES

SAME_HOST = {"probe": [0x7F0000001000, 0x1234], "generation_addr": 0x7F0000002000, "generation_fd": 7}
MiB = 1 << 20


def test_every_plane_that_reads_an_entry_parses_it():
    for name in plane_registry.names():
        plane = plane_registry.get(name)
        if plane.facts_keys:
            assert plane.parse_facts.__func__ is not DataPlane.parse_facts.__func__, name


def test_the_link_keeps_the_parsed_entries_and_nothing_else_of_the_reply():
    body = {"generation": 1, "caches": [], "blocks": [], "keys": [], "junk": [[]] * 1000,
            "same_host": dict(SAME_HOST, pad=[[]] * 1000),
            "cuda_ipc": {"generation_fd": 3, "exports": [[5, 1, [["ab" * 64, 0]]]]}}
    facts = plane_facts(body)
    assert set(facts) == {"same_host", "cuda_ipc"}
    assert facts["same_host"] == SameHostFacts(0x7F0000001000, 0x1234, 0x7F0000002000, 7)
    assert isinstance(facts["cuda_ipc"], IpcFacts) and facts["cuda_ipc"].exports.tensors(5) == [
        ((bytes.fromhex("ab" * 64), 1), 0)]
    with pytest.raises(AttributeError):
        facts["same_host"].probe_addr = 0  # frozen: what the peer sent cannot change under a plane


@pytest.mark.parametrize("change", [
    {"probe": [1]}, {"probe": [1, 2, 3]}, {"probe": [1, -1]}, {"probe": [1, 2**64]}, {"probe": "12"},
    {"probe": [True, 1]}, {"probe": [[]] * 2}, {"generation_addr": None}, {"generation_addr": 1.5},
    {"generation_fd": -2}, {"generation_fd": 2**31}, {"generation_fd": "3"},
], ids=lambda change: repr(change)[:40])
def test_a_malformed_same_host_entry_is_refused(change):
    with pytest.raises(ProtocolError, match="malformed same_host entry"):
        plane_facts({"same_host": dict(SAME_HOST, **change)})


@pytest.mark.parametrize("entry", ["x", [], None, {}])
def test_a_same_host_entry_that_is_no_entry_is_refused(entry):
    with pytest.raises(ProtocolError):
        plane_facts({"same_host": entry})


def _largest_entries(nbytes: int):
    """Per plane key, the well-formed entry that keeps the most within a reply of ``nbytes``."""
    handle = "ab" * 64
    # One tensor a cache (a cache costs more than a tensor), small numbers: the most entries.
    entry = len(json.dumps([99999, 0, [[handle, 0]]], separators=(",", ":"))) + 1
    exports = [[i, 0, [[handle, 0]]] for i in range(1, min(MAX_EXPORTS, (nbytes - 64) // entry))]
    blob = b"\xff" * MAX_METADATA_BYTES
    return {"same_host": SAME_HOST,
            "cuda_ipc": {"generation_fd": 3, "exports": exports},
            "nixl": {"agent": "llmdd-2-00112233445566ff", "md": base64.b64encode(blob).decode(),
                     "generation": 2**64 - 1, "vram": 2**31 - 1}}


@pytest.mark.parametrize("key", ["same_host", "cuda_ipc", "nixl"])
def test_the_largest_entry_a_reply_at_the_budget_carries_is_kept_in_under_1_mib(key):
    """The JSON is parsed before tracing starts: what is traced after the parse is what the
    link keeps (cuda_ipc's exports one cache a tensor, 72 bytes a tensor and 20 a cache; nixl's
    metadata as bytes)."""
    body = {key: _largest_entries(budgets.DEFAULT_MAX_TABLE_BYTES)[key]}
    assert len(json.dumps(body, separators=(",", ":"))) <= budgets.DEFAULT_MAX_TABLE_BYTES
    gc.collect()
    tracemalloc.start()
    try:
        facts = plane_facts(body)
        gc.collect()
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert set(facts) == {key}
    assert kept < MiB, f"{key}: {kept} bytes kept"
