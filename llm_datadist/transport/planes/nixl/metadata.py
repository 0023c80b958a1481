"""The peer's NIXL metadata, read before NIXL sees it: the ``nixl`` entry of a table reply
(``NixlFacts``: bounded fields, the metadata decoded) and the agent metadata blob itself, read
field by field as NIXL 1.5's loader reads it (``parse_metadata``).

Why it is read at all: malformed metadata can crash NIXL's loader, and a blob that names an agent
already loaded merges into that agent's entry (the plane's docstring, "Metadata").
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from llm_datadist.transport.errors import ProtocolError, brief, is_int

#: The largest agent metadata offered or taken (a peer's base64 is checked before decoding).
MAX_METADATA_BYTES = 256 << 10
#: The largest UCX connection blob (a worker address) and extra bytes of a region (its rkey).
MAX_CONNECTION_BYTES = 16 << 10
MAX_REGION_META_BYTES = 4096

#: The key of the plane's entry in a table reply (``NixlPlane.offer``) and in a link's facts.
FACTS_KEY = "nixl"
#: NIXL's memory types (``nixl_mem_t``): DRAM_SEG and VRAM_SEG.
DRAM, VRAM = 0, 1
_AGENT_NAME = re.compile(r"llmdd-([0-9]{1,20})-[0-9a-f]{16}")
_SERDES_INTRO = b"nixlSerDes|"
_U32, _U64, _REGION = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<QQQ")


@dataclass(frozen=True)
class Region:
    """One registered range a peer's metadata lists: NIXL memory type, address, bytes, device."""

    mem: int
    addr: int
    nbytes: int
    device: int


class _Fields:
    """NIXL's serialization (``nixlSerDes``): the intro, then ``tag, u64 length, value, "|"`` fields."""

    def __init__(self, blob: bytes) -> None:
        self.blob = blob
        self.pos = len(_SERDES_INTRO)
        if blob[:self.pos] != _SERDES_INTRO:
            raise ValueError("it does not start as NIXL metadata")

    def take(self, tag: bytes, limit: int) -> bytes:
        blob, at = self.blob, self.pos
        name = tag.decode() or "(untagged)"
        if blob[at:at + len(tag)] != tag or at + len(tag) + 8 > len(blob):
            raise ValueError(f"field {name} is missing at byte {at}")
        length = _U64.unpack_from(blob, at + len(tag))[0]
        start = at + len(tag) + 8
        if length > limit:
            raise ValueError(f"field {name} of {length} bytes (at most {limit})")
        if start + length + 1 > len(blob) or blob[start + length:start + length + 1] != b"|":
            raise ValueError(f"field {name} is cut short")
        self.pos = start + length + 1
        return blob[start:start + length]

    def number(self, tag: bytes, fmt: struct.Struct) -> int:
        value = self.take(tag, fmt.size)
        if len(value) != fmt.size:
            raise ValueError(f"field {tag.decode()} has {len(value)} bytes, not {fmt.size}")
        return fmt.unpack(value)[0]


def parse_metadata(blob: bytes, name: str) -> List[Region]:
    """The regions of a NIXL 1.5 agent metadata blob (``getLocalMD``), read field by field in the
    order NIXL's loader reads them; ``ValueError`` naming the first thing that is not as this plane
    makes it: another agent name than ``name``, other than one UCX connection, a section of another
    backend or memory type, a region of zero bytes or past 2**64, anything after the last field."""
    if len(blob) > MAX_METADATA_BYTES:
        raise ValueError(f"{len(blob)} bytes (at most {MAX_METADATA_BYTES})")
    fields = _Fields(blob)
    agent = fields.take(b"Agent", 256)
    if agent != name.encode():
        raise ValueError(f"it names agent {brief(agent)}, not {name}")
    if fields.number(b"Conns", _U64) != 1:
        raise ValueError("it does not list exactly one connection")
    if fields.take(b"t", 16) != b"UCX":
        raise ValueError("its connection is not UCX's")
    if not fields.take(b"c", MAX_CONNECTION_BYTES):
        raise ValueError("its UCX connection is empty")
    if fields.take(b"", 16) != b"MemSection":
        raise ValueError("no memory section")
    sections = fields.number(b"nixlSecElms", _U64)
    if sections > 2:
        raise ValueError(f"{sections} memory sections (at most DRAM and VRAM)")
    regions: List[Region] = []
    seen = set()
    for _ in range(sections):
        if fields.take(b"bknd", 16) != b"UCX":
            raise ValueError("a section of another backend than UCX")
        if fields.take(b"nixlDList", 16) != b"nixlSDList":
            raise ValueError("a section that is not a registration list")
        mem = fields.number(b"t", _U32)
        if mem not in (DRAM, VRAM) or mem in seen:
            raise ValueError(f"a section of memory type {mem} (DRAM and VRAM once each)")
        seen.add(mem)
        count = fields.number(b"n", _U64)
        if not 1 <= count <= len(blob) // (_REGION.size + 9):
            raise ValueError(f"a section of {count} regions")
        for _ in range(count):
            raw = fields.take(b"", _REGION.size + MAX_REGION_META_BYTES)
            if len(raw) < _REGION.size:
                raise ValueError("a region of fewer than 24 bytes")
            addr, nbytes, device = _REGION.unpack_from(raw)
            if nbytes == 0 or addr + nbytes > 2**64:
                raise ValueError(f"region {addr:#x}+{nbytes}")
            regions.append(Region(mem, addr, nbytes, device))
    if fields.pos != len(blob):
        raise ValueError(f"{len(blob) - fields.pos} bytes after the last field")
    return regions


@dataclass(frozen=True)
class NixlFacts:
    """The peer's ``nixl`` entry (``NixlPlane.offer``), read into bounded fields: its agent's name
    and the cluster id that name carries, the agent's metadata (at most ``MAX_METADATA_BYTES``;
    ``parse_metadata`` reads it at accept), the address of the peer's registry generation word,
    and the device of its VRAM registrations (None: it registers none)."""

    agent: str
    cluster_id: int
    blob: bytes
    generation: int
    vram: Optional[int]

    @classmethod
    def parse(cls, value: Any) -> "NixlFacts":
        """ProtocolError unless ``value`` is ``{"agent": "llmdd-<cluster id>-<16 hex>", "md":
        base64 of at most MAX_METADATA_BYTES, "generation": a non-zero 64-bit address, "vram":
        None or a device number}``."""
        if not isinstance(value, dict):
            raise ProtocolError("malformed nixl entry")
        name, encoded, generation, vram = (value.get(k) for k in ("agent", "md", "generation", "vram"))
        if (not isinstance(name, str) or not isinstance(encoded, str) or not is_int(generation, 1)
                or not (vram is None or is_int(vram, 0, 2**31 - 1))):
            raise ProtocolError("malformed nixl entry")
        match = _AGENT_NAME.fullmatch(name)
        if match is None:
            raise ProtocolError(f"nixl agent name {brief(name[:100])} is not llmdd-<cluster id>-<16 hex>")
        if len(encoded) > (MAX_METADATA_BYTES + 2) // 3 * 4:
            raise ProtocolError(f"NIXL metadata of more than {MAX_METADATA_BYTES} bytes")
        try:
            blob = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError("NIXL metadata that is not base64") from None
        return cls(name, int(match.group(1)), blob, generation, vram)


def agent_name(cluster_id: int) -> str:
    """A new agent name of this cluster: ``llmdd-<cluster id>-<16 random hex>``."""
    return f"llmdd-{cluster_id}-{os.urandom(8).hex()}"



def check_facts(facts: Any, cluster_id: int) -> Tuple[str, bytes, int, Optional[int]]:
    """``(agent name, metadata, generation address, VRAM device or None)`` of the peer's
    ``NixlFacts`` in a link's ``facts``, checked against the link's authenticated ``cluster_id``
    and read field by field (``parse_metadata``); ValueError saying what is wrong."""
    info = facts.get(FACTS_KEY) if isinstance(facts, dict) else None
    if not isinstance(info, NixlFacts):
        raise ValueError("the peer sent no NIXL metadata (it offers it only where it would use nixl)")
    name, blob, generation, vram = info.agent, info.blob, info.generation, info.vram
    if info.cluster_id != cluster_id:
        raise ValueError(f"agent name {name} is not one of cluster {cluster_id}")
    regions = parse_metadata(blob, name)
    if not any(r.mem == DRAM and r.addr <= generation and generation + 8 <= r.addr + r.nbytes for r in regions):
        raise ValueError("the generation word is not among the registered regions")
    if any(r.mem == VRAM and r.device != vram for r in regions):
        raise ValueError(f"VRAM regions of another device than the one announced ({vram})")
    return name, blob, generation, vram
