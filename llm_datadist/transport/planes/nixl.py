"""``nixl``: one-sided reads and writes through NVIDIA's NIXL (its UCX backend): RDMA between hosts
(GPUDirect for cuda DEVICE caches where UCX has it), or UCX TCP where ``LLM_DATADIST_NIXL_TCP=1``.

NIXL is an optional dependency (``pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1``), imported
only once the plane is about to be used; without it the plane refuses every link, and nothing else
changes.

**Who gets it.** Only links authenticated with a secret (``llm.LinkSecret``) whose connections are
TCP, towards a peer that named the plane:

* ``auto`` chooses it for a link to another host (the peer's address is none of this host's) when
  UCX finds an RDMA port here (``probe_rdma``: the active ports of ``/sys/class/infiniband``, then
  an agent made with them in a child process, so that a crash stays there), or when
  ``LLM_DATADIST_NIXL_TCP=1`` lets it run over UCX TCP (for tests and hosts without RDMA); never
  for a link to this host, where cma and cuda_ipc apply;
* ``llm.DataPlane=nixl`` forces it on any authenticated TCP link, one to this host included; where
  it cannot serve, the link fails naming why.

A side offers its agent's metadata (``offer``) to a peer that named the plane on an authenticated
TCP link (the peer may have forced it on a link to this host). **Trust**: NIXL's target side does
not check what a peer reads or writes (UCX's TCP and software-RMA paths write wherever the peer
says; only a NIC executing real RDMA enforces memory regions), so a peer given this process's
metadata can read and write all of its memory, as under ``cma``; and malformed metadata can crash
NIXL's loader. Hence the secret, and the checks below.

**Metadata.** Each side's table reply carries ``{"nixl": {"agent", "md", "generation", "vram"}}``:
its agent's name (``llmdd-<cluster id>-<16 hex>``), the agent's metadata (base64), the address of
its registry generation word (registered with NIXL) and whether it registers DEVICE caches as VRAM.
The link keeps the entry as ``NixlFacts`` (bounded fields, the metadata decoded; a malformed entry
fails the link when the reply arrives). Before NIXL sees a peer's blob it is read field by field as
NIXL's loader reads it (``parse_metadata``): at most ``MAX_METADATA_BYTES``; naming the agent
announced, which must be of the peer's authenticated cluster id, not this side's and not loaded by
another link; one UCX connection; DRAM/VRAM sections only; the generation word among its regions;
nothing after it; and NIXL must load it under that name. (A truncated blob that NIXL 1.5.1 loads
part of leaves that agent name unloadable for good, a reason more to never hand it one.) The peer's
agent is removed when the link ends, and reloaded when a refreshed table carries new metadata (the
peer registered or unregistered memory).

**UCX's settings** are process-wide and fixed when the process makes its first agent (``fix_ucx``):
TCP mode: ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES`` = the interface of the link's own address; RDMA
mode: ``UCX_TLS=^tcp`` and ``UCX_NET_DEVICES`` = the probed ports or those pinned with
``llm.NixlDevices`` / ``LLM_DATADIST_NIXL_DEVICES``; ``UCX_MODULES=^efa`` unless an EFA device is
used (with the system's rdma-core installed, the wheel's EFA module makes every process SIGSEGV at
exit). Variables the user set are left as they are. A later link that needs other settings (another
interface) is refused.

**Transfers.** Our fences first: the plan's remote side inside the peer's table, its local side
inside what this side registered with NIXL (else the transfer goes to ``tcp`` / ``staging``); then
the plan's descriptors become two N x 3 arrays (numpy column copies of
``CopyPlan.descriptors()``) for one NIXL request, posted and polled until our deadline. The peer's
registry generation, read through NIXL, must be the table's (else the table is stale): a write
reads it first, in a request of its own (a write must not land in memory the peer re-registered);
a read of host memory reads it as the last descriptor of its own request and checks it after.
Repeated block pushes and pulls take a block route (``NixlRoute``): two prepared lists of the
whole caches in NIXL's compact strided form, one request by index per call. NIXL's own
NOT_FOUND (a range outside the peer's metadata) is the second fence. A request past its deadline is
released (cancelled) and the peer's agent removed, so that no late byte lands; the link then ends
(``LLM_TIMEOUT``); a request that fails ends it too (``LLM_LINK_FAILED``); linking again works.

**Memory.** HOST caches and DEVICE caches of a runtime whose device memory is host memory (cpu) are
registered as DRAM, cuda DEVICE caches as VRAM (device id = the engine's device); acl memory is
not registered (it stays on ``staging``). Registration starts with the agent (the first link that
uses the plane) and follows the registry; a cache is deregistered before the engine releases its
memory (``on_unregister`` runs with the registry's lock held, before the memory goes).
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import importlib
import importlib.util
import ipaddress
import json
import logging
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from llm_datadist import _io
from llm_datadist._memory import Place
from llm_datadist.transport import auth
from llm_datadist.transport import deadline as dl
from llm_datadist.transport import planes as plane_registry
from llm_datadist.transport.errors import S, ProtocolError, StaleTable, brief, fail, is_int
from llm_datadist.transport.listener import is_loopback
from llm_datadist.transport.planes import register
from llm_datadist.transport.planes.base import DataPlane
from llm_datadist.status import LLMException

logger = logging.getLogger("llm_datadist")

#: How to install NIXL (its metadata declares torch, which it does not need: hence ``--no-deps``).
INSTALL = "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1"
#: The oldest NIXL this plane takes (compact strided descriptor lists came with 1.5).
MIN_VERSION = (1, 5)
#: ``1`` lets the plane run over UCX TCP (tests, hosts without RDMA); ``auto`` may then choose it.
TCP_ENV = "LLM_DATADIST_NIXL_TCP"
#: UCX devices (``mlx5_0:1``, comma separated) this process uses in RDMA mode instead of every
#: active port: one per GPU rank, say. The option wins over the environment variable.
DEVICES_OPTION = "llm.NixlDevices"
DEVICES_ENV = "LLM_DATADIST_NIXL_DEVICES"
#: How long (µs) NIXL's progress thread sleeps in poll() between wake-ups. 0 makes it spin: a
#: core busy for ever (measured here: 2.1 s of CPU per 3 s idle), for about 40 µs less latency.
PROGRESS_ENV = "LLM_DATADIST_NIXL_PROGRESS_US"
DEFAULT_PROGRESS_US = 1000
#: The largest agent metadata offered or taken (a peer's base64 is checked before decoding).
MAX_METADATA_BYTES = 256 << 10
#: The largest UCX connection blob (a worker address) and extra bytes of a region (its rkey).
MAX_CONNECTION_BYTES = 16 << 10
MAX_REGION_META_BYTES = 4096
#: Generation words read at once (one per transfer in flight, across links).
GENERATION_SLOTS = 4096
#: How long ``probe`` waits for its child process.
PROBE_TIMEOUT_S = 60.0
#: How long a metadata reload waits for the link's transfers in flight to end.
RELOAD_WAIT_S = 60.0
#: How long finalize waits for requests in flight (their links are gone: they fail at once).
SHUTDOWN_WAIT_S = 10.0
#: How long a request is polled without a pause: a one-block request completes within it (a
#: loopback round trip takes 30-100 µs here). Pausing sooner made the next request's post wait
#: for NIXL's progress thread (about 1 ms, its poll() period) on this machine.
SPIN_S = 2e-3

_FACTS = "nixl"
#: NIXL's memory types (``nixl_mem_t``): DRAM_SEG and VRAM_SEG.
DRAM, VRAM = 0, 1
_AGENT_NAME = re.compile(r"llmdd-([0-9]{1,20})-[0-9a-f]{16}")
_SERDES_INTRO = b"nixlSerDes|"
_U32, _U64, _REGION = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<QQQ")

#: Why a link without a secret never gets the plane.
NO_SECRET = (f"the link has no secret ({auth.SECRET_OPTION}): a peer loaded into NIXL can read and write "
             f"all of this process's memory, so nixl is only used on authenticated links")


# -- the peer's metadata, read before NIXL sees it -------------------------------------------------
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


# -- this host's interfaces and RDMA ports ---------------------------------------------------------
class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [("next", ctypes.POINTER(_IfAddrs)), ("name", ctypes.c_char_p), ("flags", ctypes.c_uint),
                     ("addr", ctypes.c_void_p), ("netmask", ctypes.c_void_p), ("ifu", ctypes.c_void_p),
                     ("data", ctypes.c_void_p)]


def interface_addresses() -> List[Tuple[str, str]]:
    """``(interface, address)`` of every IPv4 and IPv6 address of this network namespace
    (``getifaddrs``); empty where it fails."""
    libc = ctypes.CDLL(None, use_errno=True)
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        return []
    found = []
    try:
        node = head
        while node:
            entry = node.contents
            if entry.addr:
                family = ctypes.c_ushort.from_address(entry.addr).value
                if family == socket.AF_INET:
                    raw = ctypes.string_at(entry.addr + 4, 4)
                    found.append((entry.name.decode(errors="replace"), socket.inet_ntop(socket.AF_INET, raw)))
                elif family == socket.AF_INET6:
                    raw = ctypes.string_at(entry.addr + 8, 16)
                    found.append((entry.name.decode(errors="replace"), socket.inet_ntop(socket.AF_INET6, raw)))
            node = entry.next
    finally:
        libc.freeifaddrs(head)
    return found


def _plain(ip: str) -> str:
    """``ip`` without a zone and as IPv4 where it is an IPv4-mapped IPv6 address."""
    try:
        address = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ip
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped or address)


def interface_of(ip: str) -> Optional[str]:
    """The interface holding address ``ip`` here, or None."""
    ip = _plain(ip)
    return next((name for name, address in interface_addresses() if _plain(address) == ip), None)


def is_this_host(ip: str) -> bool:
    """Whether ``ip`` is a loopback address or one of this network namespace's own."""
    ip = _plain(ip)
    return is_loopback(ip) or any(_plain(address) == ip for _, address in interface_addresses())


def rdma_ports(root: str = "/sys/class/infiniband") -> List[str]:
    """The active RDMA ports of this host as UCX names them (``mlx5_0:1``)."""
    ports = []
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        return []
    for device in devices:
        try:
            numbers = sorted(os.listdir(os.path.join(root, device, "ports")), key=lambda p: (len(p), p))
        except OSError:
            continue
        for number in numbers:
            try:
                with open(os.path.join(root, device, "ports", number, "state")) as f:
                    if "ACTIVE" in f.read():
                        ports.append(f"{device}:{number}")
            except OSError:
                continue
    return ports


def tcp_mode() -> bool:
    return os.environ.get(TCP_ENV, "").strip().lower() in ("1", "true", "yes")


def ucx_settings(mode: str, interface: Optional[str] = None, devices: Sequence[str] = (),
                 cuda: bool = False) -> Dict[str, str]:
    """The UCX variables of ``mode``: ``"tcp"`` over ``interface`` alone, or ``"rdma"`` over
    ``devices`` with every transport but TCP (so UCX opens no socket); ``UCX_MODULES=^efa``
    unless a device is an EFA one."""
    if mode == "tcp":
        settings = {"UCX_TLS": "tcp,cuda_copy" if cuda else "tcp", "UCX_NET_DEVICES": interface or ""}
    else:
        settings = {"UCX_TLS": "^tcp", "UCX_NET_DEVICES": ",".join(devices)}
    if not any(device.startswith("efa") for device in devices):
        settings["UCX_MODULES"] = "^efa"
    return settings


_ucx_lock = threading.Lock()
#: The UCX variables this process set at its first agent (those the user had not set), and the mode.
_ucx_fixed: Optional[Dict[str, str]] = None
_ucx_mode: Optional[str] = None


def fix_ucx(mode: str, settings: Dict[str, str]) -> Optional[str]:
    """Put ``settings`` in this process's environment, where the user has not set them, before its
    first agent (UCX reads them when an agent's backend is made, and they hold for the process);
    later: None if the process's settings are these, else why not."""
    global _ucx_fixed, _ucx_mode
    with _ucx_lock:
        if _ucx_fixed is None:
            _ucx_fixed = {key: value for key, value in settings.items() if key not in os.environ}
            _ucx_mode = mode
            os.environ.update(_ucx_fixed)
            return None
        if mode != _ucx_mode:
            return (f"this process's NIXL agents run in {_ucx_mode} mode since its first one (UCX's "
                    f"settings are process-wide)")
        differ = [key for key, value in _ucx_fixed.items() if settings.get(key) != value]
        if differ:
            return (f"UCX was set up with {', '.join(f'{k}={_ucx_fixed[k]}' for k in differ)} at this process's "
                    f"first NIXL agent; this link needs {', '.join(f'{k}={settings.get(k)}' for k in differ)} "
                    f"(UCX's settings are process-wide)")
        return None


# -- NIXL itself -----------------------------------------------------------------------------------
def installed() -> bool:
    return importlib.util.find_spec("nixl") is not None


def nixl_version() -> str:
    try:
        from importlib import metadata
        return metadata.version("nixl")
    except Exception:  # noqa: BLE001 - any failure: unknown
        return "unknown"


def _version_tuple(version: str) -> Tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


_bindings_lock = threading.Lock()


def bindings() -> Any:
    """NIXL's Python bindings (``nixl._bindings``), imported now if not yet; ImportError, with the
    install line, where NIXL is missing or too old."""
    with _bindings_lock:
        if not installed():
            raise ImportError(f"NIXL is not installed ({INSTALL})")
        version = nixl_version()
        if version != "unknown" and _version_tuple(version) < MIN_VERSION:
            raise ImportError(f"NIXL {version} is older than {'.'.join(map(str, MIN_VERSION))} ({INSTALL})")
        module = importlib.import_module("nixl")
        return module._bindings


class Agent:
    """One NIXL agent with its UCX backend, used through NIXL's bindings (``nixl._bindings``; the
    ``nixl_agent`` wrapper fixes the progress thread's delay at 0, a spinning thread). Every
    method may raise one of NIXL's errors (``self.errors``)."""

    def __init__(self, name: str, progress_us: int) -> None:
        b = self.b = bindings()
        config = b.nixlAgentConfig()
        config.useProgThread = True  # the target side of UCX TCP and software RMA needs progress
        config.useListenThread = False  # metadata travels over our link: no NIXL port
        config.pthrDelay = progress_us
        config.syncMode = b.NIXL_THREAD_SYNC_RW
        config.captureTelemetry = False
        self.name = name
        self.errors = tuple(getattr(b, n) for n in dir(b) if n.startswith("nixl") and n.endswith("Error"))
        self.agent = b.nixlAgent(name, config)
        self.backends = [self.agent.createBackend("UCX", {})]
        self.memory = {DRAM: b.DRAM_SEG, VRAM: b.VRAM_SEG}
        if (int(b.DRAM_SEG), int(b.VRAM_SEG)) != (DRAM, VRAM):
            raise ImportError("this NIXL numbers its memory types differently from 1.5")
        self.ops = (b.NIXL_READ, b.NIXL_WRITE)
        self.done, self.in_progress = b.NIXL_SUCCESS, b.NIXL_IN_PROG
        self.not_found = getattr(b, "nixlNotFoundError", None)

    def register(self, mem: int, rows: np.ndarray) -> Any:
        descs = self.b.nixlRegDList(self.memory[mem], rows)
        self.agent.registerMem(descs, self.backends)
        return descs

    def deregister(self, descs: Any) -> None:
        self.agent.deregisterMem(descs, self.backends)

    def metadata(self) -> bytes:
        return self.agent.getLocalMD()

    def load(self, blob: bytes) -> str:
        loaded = self.agent.loadRemoteMD(blob)
        return loaded.decode("utf-8", "replace") if isinstance(loaded, bytes) else str(loaded)

    def remove(self, name: str) -> None:
        try:
            self.agent.invalidateRemoteMD(name)
        except self.errors:
            pass  # not loaded (any more)

    def request(self, write: bool, local_mem: int, local: np.ndarray, remote_mem: int, remote: np.ndarray,
                peer: str) -> int:
        return self.agent.createXferReq(self.ops[write], self.b.nixlXferDList(self.memory[local_mem], local),
                                        self.b.nixlXferDList(self.memory[remote_mem], remote), peer, "",
                                        self.backends)

    def prepare(self, peer: str, mem: int, rows: np.ndarray) -> int:
        """A prepared descriptor list of ``peer``'s memory (``peer`` "": this agent's)."""
        return self.agent.prepXferDlist(peer or self.b.NIXL_INIT_AGENT, self.b.nixlXferDList(self.memory[mem], rows),
                                        self.backends)

    def prepare_strided(self, peer: str, mem: int, rows: np.ndarray) -> int:
        """A prepared list of ``peer``'s memory (``peer`` "": this agent's) from NIXL's compact
        strided rows ``(address, bytes, device, stride, count)``, N x 5 uint64: row ``r`` stands
        for ``count`` descriptors, ``stride`` bytes apart, indexed one after the other."""
        return self.agent.prepXferDlist(peer or self.b.NIXL_INIT_AGENT, self.memory[mem], rows, self.backends)

    def prepared_request(self, write: bool, local: int, local_indices: Any, remote: int, remote_indices: Any) -> int:
        return self.agent.makeXferReq(self.ops[write], local, local_indices, remote, remote_indices, "",
                                      self.backends, False)

    def release_list(self, handle: int) -> None:
        try:
            self.agent.releasedDlistH(handle)
        except self.errors:
            pass

    def post(self, handle: int) -> Any:
        return self.agent.postXferReq(handle, "")

    def status(self, handle: int) -> Any:
        return self.agent.getXferStatus(handle)

    def release(self, handle: int) -> bool:
        """Free a request, cancelling it if it is still going; False where NIXL cannot."""
        try:
            self.agent.releaseXferReq(handle)
            return True
        except self.errors:
            return False

    def close(self) -> None:
        """Drop the agent (its progress thread, UCX worker and context go with it)."""
        self.backends = []
        self.agent = None


# -- the probe, in a child process -----------------------------------------------------------------
_PROBE_CHILD = r"""
import ctypes, json, os, sys
out = {"version": "unknown", "ucx": "", "backend": "", "transports": []}
try:
    from importlib import metadata
    out["version"] = metadata.version("nixl")
except Exception:
    pass
try:
    import nixl
    b = nixl._bindings
    config = b.nixlAgentConfig()
    config.useProgThread = False
    config.useListenThread = False
    agent = b.nixlAgent("llmdd-probe", config)
    try:
        agent.createBackend("UCX", {})
        out["backend"] = "ok"
    except Exception as exc:
        out["backend"] = f"{type(exc).__name__}: {exc}"
    path = next((line.split()[-1] for line in open("/proc/self/maps") if "libucp" in line), None)
    if path:
        ucp = ctypes.CDLL(path)
        major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        ucp.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
        out["ucx"] = f"{major.value}.{minor.value}.{release.value}"
        config = ctypes.c_void_p()
        context = ctypes.c_void_p()
        params = (ctypes.c_uint64 * 64)()
        params[0], params[1] = 1, 2 | 8  # field mask: features; features: RMA | AM
        if ucp.ucp_config_read(None, None, ctypes.byref(config)) == 0 and \
                ucp.ucp_init_version(major, minor, params, config, ctypes.byref(context)) == 0:
            import tempfile
            with tempfile.NamedTemporaryFile("r") as listing:
                libc = ctypes.CDLL(None)
                libc.fopen.restype = ctypes.c_void_p
                stream = ctypes.c_void_p(libc.fopen(listing.name.encode(), b"w"))
                ucp.ucp_context_print_info(context, stream)
                libc.fclose(stream)
                text = listing.read()
            out["transports"] = [line.split("--")[-1].strip() for line in text.splitlines()
                                 if "resource" in line and "--" in line]
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""

_probe_lock = threading.Lock()
_probe_cache: Dict[Tuple[Tuple[str, str], ...], Dict[str, Any]] = {}


def probe_child(settings: Dict[str, str]) -> Dict[str, Any]:
    """What a child process with the UCX variables ``settings`` found: NIXL's and UCX's versions,
    whether the UCX backend came up (``"ok"`` or the error) and the UCX transports and devices it
    lists (``tcp/lo``, ``rc_mlx5/mlx5_0:1``...). Cached per settings; a crash stays in the child."""
    key = tuple(sorted(settings.items()))
    with _probe_lock:
        cached = _probe_cache.get(key)
        if cached is not None:
            return cached
        env = dict(os.environ, **settings)
        try:
            done = subprocess.run([sys.executable, "-c", _PROBE_CHILD], capture_output=True, text=True,
                                  timeout=PROBE_TIMEOUT_S, env=env)
            last = (done.stdout.strip().splitlines() or [""])[-1]
            report = json.loads(last) if last.startswith("{") else {
                "error": f"the probe process exited with {done.returncode}: "
                         f"{(done.stderr.strip().splitlines() or ['no output'])[-1][:200]}"}
        except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
            report = {"error": f"the probe process did not run ({exc})"}
        _probe_cache[key] = report
        return report


def _probe_rdma_settings(devices: Sequence[str]) -> Dict[str, str]:
    settings = ucx_settings("rdma", devices=devices)
    if not devices:  # no RDMA port: UCX lists what it has besides TCP (no socket either way)
        settings.pop("UCX_NET_DEVICES")
    return settings


def probe_rdma(devices: Optional[Sequence[str]] = None) -> Tuple[bool, str]:
    """Whether UCX has an RDMA device here: the active ports (or ``devices``), then an agent made
    with them in a child process."""
    if not installed():
        return False, f"NIXL is not installed ({INSTALL})"
    ports = list(devices) if devices else rdma_ports()
    if not ports:
        return False, "no active RDMA port in /sys/class/infiniband"
    report = probe_child(_probe_rdma_settings(ports))
    if report.get("backend") == "ok":
        return True, f"UCX over {', '.join(ports)}: {', '.join(report.get('transports') or ['?'])}"
    why = report.get("error") or report.get("backend")
    return False, f"UCX found no usable RDMA device on {', '.join(ports)} ({why})"


# -- the plane ---------------------------------------------------------------------------------------
@dataclass(eq=False)
class NixlLink:
    """nixl's state for one link: the peer's agent loaded into ours (``remote``; None until accepted
    and after the link ends), the metadata loaded, the peer's generation word and its prepared
    descriptor list, and the count of this link's requests in flight (a metadata reload waits for
    them, and a prepared list goes only once none uses it: ``cond``)."""

    remote: Optional[str] = None
    blob: bytes = b""
    generation_addr: int = 0
    generation_list: Optional[int] = None
    #: The GPU whose memory the peer registers as VRAM (its DEVICE caches), or None.
    vram_device: Optional[int] = None
    active: int = 0
    reloading: bool = False
    closed: bool = False
    #: Prepared lists dropped while requests were in flight: released when the last one ends.
    retired: List[int] = field(default_factory=list)
    #: The block routes made for the link (``NixlRoute``): closed, their lists released, when the
    #: link ends, the peer's metadata is reloaded or their local cache leaves.
    routes: List["NixlRoute"] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)


@dataclass
class _Registration:
    mem: int
    rows: np.ndarray   # N x 3 uint64: address, bytes, device
    descs: Any = None  # NIXL's registration list, once registered


class NixlRoute:
    """Repeated block transfers between one local blocks cache and one blocks cache of a link's
    peer (see ``DataPlane.block_route``), over two prepared NIXL descriptor lists made once.

    The lists are NIXL's compact strided rows (``Agent.prepare_strided``): the local one holds
    every block of every local tensor (tensor ``t``, block ``b`` at index ``t * rows + b``), then
    this plane's generation scratch words; the remote one every block of every remote tensor,
    then the peer's registry generation word, each descriptor the local block size. A call turns
    its block ids into indices (``_io.block_indices``: exact ints inside their cache, else the
    checked path) and posts one prepared request (``NixlPlane._route_run``): a push after reading
    the peer's generation, a pull with the generation word read last in the same request. A
    route declines (``run`` returns False, nothing moved) where the link or the route closed,
    the peer's generation is not the route's, or the call is not shaped like a learnt one; the
    caller then takes the checked path. Closed with its link, at a reload of the peer's metadata
    and when its local cache leaves the registry (``NixlPlane._close_routes``)."""

    def __init__(self, plane: "NixlPlane", session, state: NixlLink, remote_name: str, generation: int,
                 local_layout, remote_layout, write: bool, lists: Tuple[int, int]) -> None:
        self.plane, self.owner, self.link = plane, session, state
        self.remote_name = remote_name
        self.generation = generation
        self.local, self.remote, self.write = local_layout, remote_layout, write
        self.local_rows, self.remote_rows = int(local_layout.num_rows), int(remote_layout.num_rows)
        #: Where the scratch words start in the local list, the generation word in the remote one.
        self.slot_base = int(local_layout.num_tensors) * self.local_rows
        self.generation_index = int(remote_layout.num_tensors) * self.remote_rows
        self.lists: Optional[Tuple[int, int]] = lists
        self.closed = False
        self.selections: Dict[tuple, Tuple[np.ndarray, np.ndarray]] = {}
        self.whole: Optional[Tuple[np.ndarray, np.ndarray]] = None
        self.last: Optional[tuple] = None

    @property
    def current(self) -> bool:
        """Whether the route may still be used: open, its link open, the peer's agent the one its
        remote list was prepared against (the peer's generation is read per call)."""
        return not self.closed and not self.owner.closed and self.link.remote == self.remote_name

    def learn(self, key: tuple, src_tensors, dst_tensors) -> None:
        """Remember the tensor selection of ``key`` = ``(src_layer_range, dst_layer_range,
        tensor_num_per_layer)`` that a checked call resolved (None = every tensor), as the first
        index of each selected tensor in the local and the remote list."""
        local_t, remote_t = (src_tensors, dst_tensors) if self.write else (dst_tensors, src_tensors)
        local_i = range(self.local.num_tensors) if local_t is None else list(local_t)
        remote_i = range(self.remote.num_tensors) if remote_t is None else list(remote_t)
        if len(local_i) != len(remote_i) or len(local_i) == 0:
            raise ValueError(f"a selection pairs {len(local_i)} local with {len(remote_i)} remote tensors")
        if not all(0 <= t < self.local.num_tensors for t in local_i) or \
                not all(0 <= t < self.remote.num_tensors for t in remote_i):
            raise ValueError("a selected tensor is outside the caches")
        selection = (np.asarray(local_i, dtype=np.int64) * self.local_rows,
                     np.asarray(remote_i, dtype=np.int64) * self.remote_rows)
        if key == (None, None, 2) and type(key[2]) is int:
            self.whole = selection
        self.selections[key] = selection

    def run(self, src_blocks, dst_blocks, src_layer_range, dst_layer_range, tensor_num_per_layer) -> bool:
        """Move ``src_blocks[k]`` -> ``dst_blocks[k]`` for every tensor pair of the selection;
        True when done, False when the caller must take the checked path (nothing was moved,
        but a pull whose generation check failed may have filled its destination blocks). A
        request that fails or outlives the deadline ends the link and raises, as the checked
        path does."""
        last = self.last
        if src_layer_range is None and dst_layer_range is None and type(tensor_num_per_layer) is int \
                and tensor_num_per_layer == 2:
            selection = self.whole
        elif (last is not None and last[0] is src_layer_range and last[1] is dst_layer_range
              and last[2] is tensor_num_per_layer):
            selection = last[3]
        elif ((src_layer_range is None or (type(src_layer_range) is range and src_layer_range.step == 1))
              and (dst_layer_range is None or (type(dst_layer_range) is range and dst_layer_range.step == 1))
              and type(tensor_num_per_layer) is int):
            selection = self.selections.get((src_layer_range, dst_layer_range, tensor_num_per_layer))
            if selection is not None:
                self.last = (src_layer_range, dst_layer_range, tensor_num_per_layer, selection)
        else:
            return False
        if selection is None or self.closed or (type(src_blocks) is not list and type(src_blocks) is not tuple):
            return False
        local_bases, remote_bases = selection
        count = len(src_blocks) * len(local_bases)
        if count == 0 or count > ROUTE_MAX_DESCRIPTORS:
            return False
        extra = 0 if self.write else 1  # a pull reads the peer's generation word last
        local_indices = np.empty(count + extra, dtype=np.int32)
        remote_indices = np.empty(count + extra, dtype=np.int32)
        local_blocks, remote_blocks = (src_blocks, dst_blocks) if self.write else (dst_blocks, src_blocks)
        if _io.block_indices(local_blocks, remote_blocks, local_bases, remote_bases, self.local_rows,
                             self.remote_rows, local_indices, remote_indices) != count:
            return False
        return self.plane._route_run(self, local_indices, remote_indices)

    def __repr__(self) -> str:
        return (f"<NixlRoute {'push to' if self.write else 'pull from'} {self.remote_name}, "
                f"{len(self.selections)} selections{', closed' if self.closed else ''}>")


#: Most descriptors one route call posts (larger calls take the checked path).
ROUTE_MAX_DESCRIPTORS = 1 << 20
#: Most entries of a prepared list (NIXL takes int32 indices).
_MAX_LIST_ENTRIES = 2**31 - 1


@register
class NixlPlane(DataPlane):
    name = "nixl"
    summary = "one-sided RDMA (or UCX TCP) reads and writes through NIXL; links with a secret only"
    facts_keys = (_FACTS,)
    auto_rank = 30
    device_memory = True
    auto_host_memory = True
    requires_secret = True

    def __init__(self, engine) -> None:
        super().__init__(engine)
        options = getattr(engine, "options", None) or {}
        self._forced = _resolved_plane(options) == self.name
        self._offers = _resolved_plane(options) in (plane_registry.AUTO, self.name)
        self._secret = auth.resolve_secret(options) is not None
        devices = options.get(DEVICES_OPTION) or os.environ.get(DEVICES_ENV, "")
        self._devices = [d.strip() for d in devices.split(",") if d.strip()]
        self._lock = threading.RLock()
        self._agent: Optional[Agent] = None
        self._agent_error: Optional[str] = None
        self._registrations: Dict[int, _Registration] = {}
        self._extra: List[Any] = []  # registrations of the generation word and the scratch words
        self._host_ranges = _io.RangeSet(())
        self._device_ranges = _io.RangeSet(())
        self._serial = 0
        self._offered: Optional[Tuple[int, Dict[str, Any]]] = None
        self._loaded: Dict[str, NixlLink] = {}  # the peers' agents loaded into ours, by name
        self._scratch = np.zeros(GENERATION_SLOTS, dtype=np.uint64)
        self._scratch_list: Optional[int] = None
        self._free_slots = list(range(GENERATION_SLOTS))
        self._slot_lock = threading.Lock()
        self._leaked: List[int] = []  # requests NIXL could not release yet
        self._active = 0  # requests in flight, all links (``_begin`` .. ``_finish``)
        self._idle = threading.Condition(self._lock)
        self._kept: List[Agent] = []  # agents left alive at a finalize that found requests running
        self.stats = {"nixl_refused_metadata": 0, "nixl_timeouts": 0, "nixl_failures": 0}
        if self._secret and self._offers and installed() and (tcp_mode() or self._devices or rdma_ports()):
            # The first link would import NIXL (about 2 s of loading libraries): start now.
            threading.Thread(target=_import_quietly, name="llm_datadist-nixl-import", daemon=True).start()

    def counters(self) -> Dict[str, int]:
        return dict(self.stats)

    @classmethod
    def probe(cls) -> Tuple[bool, str]:
        if not installed():
            return False, f"NIXL is not installed ({INSTALL})"
        devices = [d.strip() for d in os.environ.get(DEVICES_ENV, "").split(",") if d.strip()]
        ports = devices or rdma_ports()
        report = probe_child(_probe_rdma_settings(ports))
        version = f"NIXL {report.get('version')}" + (f" (UCX {report['ucx']})" if report.get("ucx") else "")
        if report.get("error"):
            return False, f"{version}: {report['error']}"
        found = ", ".join(report.get("transports") or []) or "none"
        rdma_ok = bool(ports) and report.get("backend") == "ok"
        rdma = (f"RDMA over {', '.join(ports)}" if rdma_ok else
                f"no RDMA ({'no active port in /sys/class/infiniband' if not ports else report.get('backend')})")
        text = f"{version}; UCX transports without TCP: {found}; {rdma}"
        if tcp_mode():
            tcp = probe_child(ucx_settings("tcp", "lo"))
            tcp_ok = tcp.get("backend") == "ok"
            text += (f"; UCX TCP on ({TCP_ENV}=1): {', '.join(tcp.get('transports') or []) or 'none'} on lo"
                     + ("" if tcp_ok else f" ({tcp.get('error') or tcp.get('backend')})"))
            return rdma_ok or tcp_ok, text + "; links with a secret only"
        return rdma_ok, text + f"; {TCP_ENV}=1 runs it over UCX TCP; links with a secret only"

    @classmethod
    def trust(cls) -> str:
        return ("only peers of links with a secret get this process's NIXL metadata; such a peer can read and "
                "write any memory of this process (NIXL's target does not check registrations over UCX TCP or "
                "software RMA; only a NIC executing real RDMA enforces them), and malformed metadata from it can "
                "crash NIXL's loader: the trust of cma, across hosts")

    # -- who may use it ------------------------------------------------------------------------------
    def _refusal(self, session, accepting: bool = True) -> Optional[str]:
        """Why this side does not use the plane on the link of ``session`` (``accepting``), or does
        not offer it there, or None. An offer goes to any peer that named the plane on an
        authenticated TCP link, one of this host too (the peer may have forced it); under ``auto``
        this side uses it only towards another host."""
        if not session.authenticated:
            return NO_SECRET
        if session.unix:
            return "the link's connections are Unix sockets (a peer of this host: cma and cuda_ipc apply)"
        if getattr(session, "protection", "off") != "off":
            return (f"the link is protected ({session.protection}, llm.LinkProtection) and NIXL's transfers would "
                    f"bypass its sealed connections")
        if self.name not in session.planes:
            return "the peer does not offer it"
        if not self._offers:
            return f"this side's {plane_registry.DATA_PLANE_OPTION} is {_resolved_plane(self.engine.options)}"
        addresses = _link_addresses(session)
        if addresses is None:
            return "the link's connections are closed"
        if accepting and not self._forced and is_this_host(addresses[1]):
            return ("the peer is on this host (under auto nixl is for links to other hosts; force it with "
                    f"{plane_registry.DATA_PLANE_OPTION}=nixl)")
        if not installed():
            return f"NIXL is not installed ({INSTALL})"
        if not tcp_mode():
            usable, why = probe_rdma(self._devices)
            if not usable:
                return f"{why}; {TCP_ENV}=1 runs NIXL over UCX TCP"
        return None

    def _ensure_agent(self, session) -> Tuple[Optional[Agent], Optional[str]]:
        """This engine's agent, made now (with the process's UCX settings) if not yet: ``(agent,
        None)``, or ``(None, why not)``."""
        with self._lock:
            if self._agent is not None or self._agent_error is not None:
                if self._agent is not None and tcp_mode():
                    why = self._settings_refusal(session)
                    if why is not None:
                        return None, why
                return self._agent, self._agent_error
            why = self._settings_refusal(session)
            if why is not None:
                return None, why
            try:
                agent = Agent(agent_name(self.engine.cluster_id), _progress_us())
            except ImportError as exc:
                self._agent_error = str(exc)
                return None, self._agent_error
            except Exception as exc:  # noqa: BLE001 - NIXL's or UCX's refusal: the plane is unusable here
                self._agent_error = f"NIXL's UCX backend did not start ({type(exc).__name__}: {exc})"
                logger.warning("cluster %s: %s", self.engine.cluster_id, self._agent_error)
                return None, self._agent_error
            try:
                self._start(agent)
            except Exception as exc:  # noqa: BLE001 - registration refused: unusable
                self._agent_error = f"NIXL refused this process's memory ({type(exc).__name__}: {exc})"
                agent.close()
                return None, self._agent_error
            self._agent = agent
            logger.info("cluster %s: NIXL agent %s (%s mode, %s)", self.engine.cluster_id, agent.name,
                        _ucx_mode, ", ".join(f"{k}={os.environ.get(k, '')}" for k in
                                             ("UCX_TLS", "UCX_NET_DEVICES", "UCX_MODULES")))
            return agent, None

    def _settings_refusal(self, session) -> Optional[str]:
        """Fix UCX's settings for this process (the first time), or say why they do not serve the
        link of ``session``."""
        runtime = getattr(self.engine, "runtime", None)
        cuda = getattr(runtime, "name", "") == "cuda"
        if tcp_mode():
            addresses = _link_addresses(session)
            interface = None if addresses is None else interface_of(addresses[0])
            if interface is None:
                return "the interface of the link's own address is not found (getifaddrs)"
            return fix_ucx("tcp", ucx_settings("tcp", interface, cuda=cuda))
        return fix_ucx("rdma", ucx_settings("rdma", devices=self._devices or rdma_ports()))

    def _start(self, agent: Agent) -> None:
        """Register the generation word, the scratch words and every cache known so far (lock held)."""
        word = self.engine.generation_word
        self._extra = [agent.register(DRAM, _rows([word.addr], 8, 0)),
                       agent.register(DRAM, _rows([self._scratch.ctypes.data], self._scratch.nbytes, 0))]
        rows = np.zeros((GENERATION_SLOTS, 3), dtype=np.uint64)
        rows[:, 0] = self._scratch.ctypes.data + 8 * np.arange(GENERATION_SLOTS, dtype=np.uint64)
        rows[:, 1] = 8
        self._scratch_list = agent.prepare("", DRAM, rows)
        for registration in self._registrations.values():
            registration.descs = agent.register(registration.mem, registration.rows)
        self._serial += 1

    # -- this side's memory --------------------------------------------------------------------------
    def _memory_of(self, record) -> Optional[Tuple[int, int]]:
        """``(NIXL memory type, device)`` of a cache, or None where NIXL does not take it (acl)."""
        if record.placement != Place.DEVICE:
            return DRAM, 0
        runtime = getattr(self.engine, "runtime", None)
        if runtime is None or runtime.host_addressable:
            return DRAM, 0
        if getattr(runtime, "name", "") == "cuda":
            return VRAM, int(getattr(self.engine, "device_id", 0))
        return None

    def on_register(self, record) -> None:
        memory = self._memory_of(record)
        if memory is None or record.cache_id <= 0:
            return
        registration = _Registration(memory[0], _rows(record.addrs, record.tensor_bytes, memory[1]))
        with self._lock:
            if self._agent is not None:
                try:
                    registration.descs = self._agent.register(registration.mem, registration.rows)
                except self._agent.errors as exc:
                    logger.warning("cluster %s: NIXL did not register cache %d (%s); transfers touching it go "
                                   "through tcp or staging", self.engine.cluster_id, record.cache_id, exc)
                    return
            self._registrations[record.cache_id] = registration
            self._changed()

    def on_unregister(self, record) -> None:
        # The registry's lock is held and the memory is still there: deregister before it goes,
        # the cache's routes closed first (no route posts from memory NIXL no longer knows; none
        # is made meanwhile: routes are made under the registry's lock). A link's lock comes
        # before the plane's (``_begin``): close them outside it.
        with self._lock:
            if record.cache_id not in self._registrations:
                return
            states = set(self._loaded.values())
        for state in states:
            self._close_routes(state, getattr(record, "layout", None))
        with self._lock:
            registration = self._registrations.pop(record.cache_id, None)
            if registration is None:
                return
            if self._agent is not None and registration.descs is not None:
                try:
                    self._agent.deregister(registration.descs)
                except self._agent.errors as exc:
                    logger.error("cluster %s: NIXL did not deregister cache %d: %s", self.engine.cluster_id,
                                 record.cache_id, exc)
            self._changed()

    def _changed(self) -> None:
        """The registrations changed (lock held): new local fences and metadata."""
        host, device = [], []
        for registration in self._registrations.values():
            pairs = [(int(a), int(n)) for a, n in registration.rows[:, :2]]
            (device if registration.mem == VRAM else host).extend(pairs)
        self._host_ranges = _io.RangeSet(host)
        self._device_ranges = _io.RangeSet(device)
        self._serial += 1

    # -- the table reply and the peer's --------------------------------------------------------------
    def offer(self, session) -> Dict[str, Any]:
        try:
            if self._refusal(session, accepting=False) is not None:
                return {}
            agent, _ = self._ensure_agent(session)
            if agent is None:
                return {}
            with self._lock:
                if self._offered is not None and self._offered[0] == self._serial:
                    return self._offered[1]
                blob = agent.metadata()
                if len(blob) > MAX_METADATA_BYTES:
                    logger.warning("cluster %s: NIXL metadata of %d bytes, more than %d: nixl is not offered",
                                   self.engine.cluster_id, len(blob), MAX_METADATA_BYTES)
                    return {}
                vram = int(getattr(self.engine, "device_id", 0)) if self._memory_kind() == VRAM else None
                offer = {_FACTS: {"agent": agent.name, "md": base64.b64encode(blob).decode(),
                                  "generation": self.engine.generation_word.addr, "vram": vram}}
                self._offered = (self._serial, offer)
                return offer
        except Exception as exc:  # noqa: BLE001 - an offer never breaks the table reply
            logger.warning("cluster %s: no NIXL metadata for cluster %s: %s", self.engine.cluster_id,
                           session.cluster_id, exc)
            return {}

    @classmethod
    def parse_facts(cls, key: str, value: Any) -> NixlFacts:
        return NixlFacts.parse(value)

    def _read_facts(self, session, facts: Any) -> Tuple[str, bytes, int, Optional[int]]:
        """``(agent name, metadata, generation address, VRAM device or None)`` of the peer's
        ``NixlFacts`` in ``facts``, checked against the link and read field by field
        (``parse_metadata``); ValueError saying what is wrong."""
        info = facts.get(_FACTS) if isinstance(facts, dict) else None
        if not isinstance(info, NixlFacts):
            raise ValueError("the peer sent no NIXL metadata (it offers it only where it would use nixl)")
        name, blob, generation, vram = info.agent, info.blob, info.generation, info.vram
        if info.cluster_id != session.cluster_id:
            raise ValueError(f"agent name {name} is not one of cluster {session.cluster_id}")
        regions = parse_metadata(blob, name)
        if not any(r.mem == DRAM and r.addr <= generation and generation + 8 <= r.addr + r.nbytes for r in regions):
            raise ValueError("the generation word is not among the registered regions")
        if any(r.mem == VRAM and r.device != vram for r in regions):
            raise ValueError(f"VRAM regions of another device than the one announced ({vram})")
        return name, blob, generation, vram

    def link_state(self, session) -> NixlLink:
        return NixlLink()

    def accept(self, session, peer_facts: Dict[str, Any], deadline: float) -> Optional[str]:
        refusal = self._refusal(session)
        if refusal is not None:
            return refusal
        try:
            name, blob, generation, vram = self._read_facts(session, peer_facts)
        except ValueError as exc:
            self._count("nixl_refused_metadata")
            return f"refused the peer's NIXL metadata before loading it: {exc}"
        agent, why = self._ensure_agent(session)
        if agent is None:
            return why
        state = self.state(session)
        if state is None:
            return "the link is closed"
        with self._lock:
            if name == agent.name:
                self._count("nixl_refused_metadata")
                return "the peer's NIXL metadata names this process's own agent"
            if name in self._loaded:
                self._count("nixl_refused_metadata")
                return f"agent {name} is loaded for another link"
            self._loaded[name] = state
        return self._load(agent, state, name, blob, generation, vram)

    def _load(self, agent: Agent, state: NixlLink, name: str, blob: bytes, generation: int,
              vram: Optional[int]) -> Optional[str]:
        """Load the peer's metadata (its name reserved in ``_loaded``) and prepare its generation
        word; None, or why not (the reservation then goes, and what NIXL loaded of it)."""
        loaded = None
        try:
            loaded = agent.load(blob)
            if loaded != name:
                raise ValueError(f"NIXL loaded it as {brief(loaded)}")
            generation_list = agent.prepare(name, DRAM, _rows([generation], 8, 0))
        except (ValueError, *agent.errors) as exc:
            agent.remove(name)
            with self._lock:
                self._loaded.pop(name, None)
                if loaded not in (None, name, agent.name) and loaded not in self._loaded:
                    agent.remove(loaded)  # loaded under a name no link holds: unload that too
            self._count("nixl_refused_metadata")
            return f"NIXL refused the peer's metadata: {type(exc).__name__}: {exc}"
        with state.cond:
            if state.closed:  # the link ended meanwhile: its close found nothing to unload
                closed = True
            else:
                closed = False
                state.remote, state.blob, state.generation_addr = name, blob, generation
                state.generation_list, state.vram_device = generation_list, vram
        if closed:
            self._unload(state, name, generation_list)
            return "the link is closed"
        return None

    def on_table(self, session, table) -> None:
        """Reload the peer's agent if the refreshed reply carries new metadata (it registered or
        unregistered memory), once the link's requests in flight are done."""
        state = self.state(session)
        if state is None or state.remote is None:
            return
        try:
            name, blob, generation, vram = self._read_facts(session, getattr(session, "facts", None))
            if name != state.remote:
                raise ValueError(f"its agent is now {name}, not {state.remote}")
        except ValueError as exc:
            self._count("nixl_refused_metadata")
            raise self._end(session, state, S.LLM_LINK_FAILED,
                            f"refused cluster {session.cluster_id}'s new NIXL metadata: {exc}") from None
        if blob == state.blob and generation == state.generation_addr and vram == state.vram_device:
            return
        agent = self._agent
        with state.cond:
            state.reloading = True
            ends = time.monotonic() + RELOAD_WAIT_S
            while state.active and not state.closed and time.monotonic() < ends:
                state.cond.wait(0.1)
            busy, closed = state.active, state.closed
        try:
            if closed or agent is None:
                raise fail(S.LLM_LINK_FAILED, f"the link to cluster {session.cluster_id} is closed")
            if busy:
                raise self._end(session, state, S.LLM_LINK_FAILED, f"cluster {session.cluster_id}'s transfers did "
                                                                   f"not end within {RELOAD_WAIT_S:.0f} s")
            with state.cond:
                old, state.remote = state.remote, None
                generation_list, state.generation_list = state.generation_list, None
            self._close_routes(state)  # their remote lists name the metadata about to go
            if generation_list is not None:
                agent.release_list(generation_list)
            if old is not None:
                agent.remove(old)  # its name stays reserved in _loaded for the reload
            why = self._load(agent, state, name, blob, generation, vram)
            if why is not None:
                raise self._end(session, state, S.LLM_LINK_FAILED, f"cluster {session.cluster_id}: {why}")
        finally:
            with state.cond:
                state.reloading = False
                state.cond.notify_all()

    # -- block routes ----------------------------------------------------------------------------------
    def block_route(self, session, table, remote_layout, local_layout, write: bool, timeout_ms: int = -1,
                    on_broken=None) -> Optional[NixlRoute]:
        """A route over prepared lists of the whole two caches (``NixlRoute``), or None where the
        link is not ready, a cache is not wholly inside memory registered with NIXL (here) or
        listed by the peer's table (there), the block sizes do not pair up, or NIXL refuses a
        list. Host memory only (the engine asks for routes of host memory alone). Its calls take
        the engine's transfer timeout and end the link themselves on a failure, as ``transfer``
        does (so ``timeout_ms`` and ``on_broken`` are not needed)."""
        state = self.state(session)
        agent = self._agent
        if state is None or agent is None or session.closed:
            return None
        block_bytes = int(local_layout.row_bytes)
        if block_bytes == 0 or block_bytes > remote_layout.row_bytes or (
                not write and block_bytes != remote_layout.row_bytes):
            return None
        local_entries = int(local_layout.num_tensors) * int(local_layout.num_rows) + GENERATION_SLOTS
        remote_entries = int(remote_layout.num_tensors) * int(remote_layout.num_rows) + 1
        if max(local_entries, remote_entries) > _MAX_LIST_ENTRIES:
            return None
        if not all(self._host_ranges.contains(a, local_layout.tensor_bytes) for a in local_layout.tensor_addrs) or \
                not all(table.ranges.contains(a, remote_layout.tensor_bytes) for a in remote_layout.tensor_addrs):
            return None
        with state.cond:
            if state.closed or state.reloading or state.remote is None:
                return None
            name, generation_addr = state.remote, state.generation_addr
            local_rows = _strided(local_layout, block_bytes)
            local_rows.append((self._scratch.ctypes.data, 8, 0, 8, GENERATION_SLOTS))
            remote_rows = _strided(remote_layout, block_bytes)
            remote_rows.append((generation_addr, 8, 0, 8, 1))
            local_list = remote_list = None
            try:
                local_list = agent.prepare_strided("", DRAM, np.array(local_rows, dtype=np.uint64))
                remote_list = agent.prepare_strided(name, DRAM, np.array(remote_rows, dtype=np.uint64))
            except agent.errors as exc:
                for handle in (local_list, remote_list):
                    if handle is not None:
                        agent.release_list(handle)
                logger.info("cluster %s: no NIXL block route to cluster %s (%s)", self.engine.cluster_id,
                            session.cluster_id, exc)
                return None
            route = NixlRoute(self, session, state, name, table.generation, local_layout, remote_layout, write,
                              (local_list, remote_list))
            state.routes = [r for r in state.routes if not r.closed] + [route]
            return route

    def _route_run(self, route: NixlRoute, local_indices: np.ndarray, remote_indices: np.ndarray) -> bool:
        """One call of ``route`` with its indices (a pull's last entries left for the generation
        word): False where it declines before moving anything or the peer's generation is not
        the route's."""
        session, state = route.owner, route.link
        if route.closed or session.closed:
            return False
        deadline = dl.after(self.engine.sync_kv_timeout_ms)
        try:
            agent, _, remote, generation_list, _, _ = self._begin(session, deadline)
        except LLMException:
            return False  # the checked path says why
        try:
            lists = route.lists  # alive while this request counts in state.active (``_close_routes``)
            if route.closed or lists is None or remote != route.remote_name:
                return False
            what = f"{'write to' if route.write else 'read from'} cluster {session.cluster_id}"
            if route.write:
                if self._peer_generation(session, agent, state, generation_list, deadline) != route.generation:
                    return False
                try:
                    handle = agent.prepared_request(True, lists[0], local_indices, lists[1], remote_indices)
                except agent.errors:
                    return False
                self._complete(session, agent, state, handle, deadline, what)
                return True
            with self._slot_lock:
                slot = self._free_slots.pop() if self._free_slots else -1
            if slot < 0:
                return False
            try:
                local_indices[-1] = route.slot_base + slot
                remote_indices[-1] = route.generation_index
                try:
                    handle = agent.prepared_request(False, lists[0], local_indices, lists[1], remote_indices)
                except agent.errors:
                    return False
                self._complete(session, agent, state, handle, deadline, what)
                return int(self._scratch[slot]) == route.generation
            finally:
                with self._slot_lock:
                    self._free_slots.append(slot)
        finally:
            self._finish(agent, state)

    def _close_routes(self, state: NixlLink, local_layout=None) -> None:
        """Close the link's routes (those of ``local_layout`` alone, if given) and release their
        lists, now if no request of the link is in flight, else when the last one ends."""
        agent = self._agent
        with state.cond:
            closing = [r for r in state.routes if local_layout is None or r.local is local_layout]
            state.routes = [r for r in state.routes if r not in closing and not r.closed]
            handles = []
            for route in closing:
                route.closed = True
                if route.lists is not None:
                    handles.extend(route.lists)
                    route.lists = None
            if state.active:
                state.retired.extend(handles)
                handles = []
        if agent is not None:
            for handle in handles:
                agent.release_list(handle)

    # -- transfers -----------------------------------------------------------------------------------
    def table_is_current(self, session, table) -> bool:
        return True  # the generation is read through NIXL in transfer, under its deadline

    def transfer(self, session, table, plan, write: bool, deadline: float) -> None:
        bad = table.ranges.first_outside(plan, write)
        if bad >= 0:
            raise fail(S.LLM_KV_CACHE_NOT_EXIST, f"descriptor {bad} names memory that cluster "
                                                 f"{session.cluster_id} has not registered")
        if self._host_ranges.first_outside(plan, not write) >= 0:
            # Local memory NIXL does not know (a create_cpu_cache buffer): frames carry it.
            self.sibling("tcp").transfer(session, table, plan, write, deadline)
            return
        self._move(session, table, plan, write, deadline, DRAM, 0, False)

    def carries(self, session, local_device: bool, remote_device: bool) -> bool:
        if local_device and self._memory_kind() != VRAM:
            return False  # acl memory stays on staging
        if remote_device:
            state = self.state(session)
            return state is not None and state.vram_device is not None
        return True

    def _memory_kind(self) -> int:
        """How this engine's DEVICE caches are registered: VRAM for cuda, else DRAM (or not at all)."""
        runtime = getattr(self.engine, "runtime", None)
        return VRAM if getattr(runtime, "name", "") == "cuda" else DRAM

    def transfer_device(self, session, table, plan, write: bool, deadline: float, local_device: bool,
                        remote_device: bool) -> None:
        remote_ranges = table.device_ranges if remote_device else table.ranges
        bad = remote_ranges.first_outside(plan, write)
        if bad >= 0:
            raise fail(S.LLM_KV_CACHE_NOT_EXIST, f"descriptor {bad} names memory that cluster "
                                                 f"{session.cluster_id} has not registered")
        local_ranges = self._device_ranges if local_device else self._host_ranges
        if local_ranges.first_outside(plan, not write) >= 0:
            staging = self.sibling("staging")
            if staging is None:
                raise fail(S.LLM_KV_CACHE_NOT_EXIST, "the local side of the transfer is not registered with NIXL")
            staging.transfer_device(session, table, plan, write, deadline, local_device, remote_device)
            return
        device = int(getattr(self.engine, "device_id", 0))
        self._move(session, table, plan, write, deadline, VRAM if local_device else DRAM,
                   device if local_device else 0, remote_device)

    def _move(self, session, table, plan, write: bool, deadline: float, local_mem: int, local_device: int,
              remote_vram: bool) -> None:
        """Move ``plan`` in one NIXL request (``write``: local -> peer) before ``deadline``, the
        peer's generation checked: a write reads it first (no byte may land in memory the peer
        re-registered); a read of host memory into host memory reads it last in the same request
        (``StaleTable`` after it: nothing of the peer's was written), other reads first."""
        agent, state, remote, generation_list, vram_device, generation_addr = self._begin(session, deadline)
        slot = -1
        try:
            folded = not write and local_mem == DRAM and not remote_vram
            if folded:
                with self._slot_lock:
                    slot = self._free_slots.pop() if self._free_slots else -1
                if slot < 0:
                    raise fail(S.LLM_LINK_BUSY, f"{GENERATION_SLOTS} NIXL transfers are starting at once")
            elif self._peer_generation(session, agent, state, generation_list, deadline) != table.generation:
                raise StaleTable()
            descriptors = plan.descriptors()
            if not len(descriptors):
                return
            if remote_vram and vram_device is None:
                raise fail(S.LLM_FEATURE_NOT_ENABLED, f"cluster {session.cluster_id} registers no VRAM with NIXL")
            local, remote_rows = _request_rows(descriptors, write, local_device, vram_device if remote_vram else 0,
                                               extra=folded)
            if folded:  # the generation word last: read after the data on a lane that keeps order
                local[-1] = (self._scratch.ctypes.data + 8 * slot, 8, 0)
                remote_rows[-1] = (generation_addr, 8, 0)
            try:
                handle = agent.request(write, local_mem, local, VRAM if remote_vram else DRAM, remote_rows, remote)
            except agent.errors as exc:
                if agent.not_found is not None and isinstance(exc, agent.not_found):
                    raise fail(S.LLM_KV_CACHE_NOT_EXIST, f"NIXL does not know part of the transfer's memory on "
                                                         f"cluster {session.cluster_id} or here: {exc}") from None
                raise self._end(session, state, S.LLM_LINK_FAILED, f"NIXL refused the transfer with cluster "
                                                                   f"{session.cluster_id}: {exc}") from None
            self._complete(session, agent, state, handle, deadline,
                           f"{'write to' if write else 'read from'} cluster {session.cluster_id}")
            if folded and int(self._scratch[slot]) != table.generation:
                raise StaleTable()
        finally:
            if slot >= 0:
                with self._slot_lock:
                    self._free_slots.append(slot)
            self._finish(agent, state)

    def _begin(self, session, deadline: float) -> Tuple[Agent, NixlLink, str, int, Optional[int], int]:
        """The agent, the link's state, the peer's agent name, its generation list, VRAM device and
        generation word's address,
        the link counted as in use until ``_finish``; LLM_LINK_FAILED where the link ended,
        LLM_TIMEOUT where a reload outlasts the deadline."""
        state = self.state(session)
        if state is None:
            raise fail(S.LLM_LINK_FAILED, f"the link to cluster {session.cluster_id} is closed")
        with state.cond:
            while state.reloading and not dl.expired(deadline):
                state.cond.wait(min(0.1, max(0.001, dl.left_s(deadline))))
            if state.reloading:
                raise fail(S.LLM_TIMEOUT, f"the NIXL metadata of cluster {session.cluster_id} was still reloading "
                                          f"at the deadline")
            with self._lock:
                agent = self._agent
                if agent is None or state.closed or state.remote is None or state.generation_list is None:
                    raise fail(S.LLM_LINK_FAILED, f"the link to cluster {session.cluster_id} is closed")
                self._active += 1
            state.active += 1
            return agent, state, state.remote, state.generation_list, state.vram_device, state.generation_addr

    def _finish(self, agent: Agent, state: NixlLink) -> None:
        """A request of the link is over: release the lists retired meanwhile once none is left."""
        with state.cond:
            state.active -= 1
            retired = []
            if not state.active:
                retired, state.retired = state.retired, []
            state.cond.notify_all()
        for handle in retired:
            agent.release_list(handle)
        with self._lock:
            self._active -= 1
            self._idle.notify_all()

    def _peer_generation(self, session, agent: Agent, state: NixlLink, generation_list: int, deadline: float) -> int:
        """The peer's registry generation, read now through NIXL."""
        with self._slot_lock:
            slot = self._free_slots.pop() if self._free_slots else -1
        if slot < 0:
            raise fail(S.LLM_LINK_BUSY, f"{GENERATION_SLOTS} NIXL transfers are starting at once")
        try:
            try:
                handle = agent.prepared_request(False, self._scratch_list, [slot], generation_list, [0])
            except agent.errors as exc:
                raise self._end(session, state, S.LLM_LINK_FAILED,
                                f"NIXL refused to read cluster {session.cluster_id}'s generation: {exc}") from None
            self._complete(session, agent, state, handle, deadline,
                           f"reading cluster {session.cluster_id}'s registry generation")
            return int(self._scratch[slot])
        finally:
            with self._slot_lock:
                self._free_slots.append(slot)

    def _complete(self, session, agent: Agent, state: NixlLink, handle: int, deadline: float, what: str) -> None:
        """Post ``handle`` and wait for it until ``deadline``; the request is released either way.
        Past the deadline it is cancelled and the peer's agent removed (no late byte lands), and
        the link ends (LLM_TIMEOUT); a failed request ends it too (LLM_LINK_FAILED)."""
        started = time.monotonic()
        failure = None
        try:
            status = agent.post(handle)
            while status == agent.in_progress:
                now = time.monotonic()
                if now >= deadline:
                    break
                pause = poll_pause(now - started)
                if pause:
                    time.sleep(min(pause, max(deadline - now, 0.0)))
                status = agent.status(handle)
            if status != agent.done and status != agent.in_progress:
                failure = f"status {status}"
        except agent.errors as exc:
            status, failure = None, str(exc) or type(exc).__name__
        finally:
            self._release(agent, handle)  # cancels it if it is still going
        if failure is not None:
            self._count("nixl_failures")
            raise self._end(session, state, S.LLM_LINK_FAILED, f"{what} failed: {failure}")
        if status != agent.done:
            self._count("nixl_timeouts")
            raise self._end(session, state, S.LLM_TIMEOUT, f"{what}: not done within the deadline; the request was "
                                                          f"cancelled and the link ended (link again)")

    def _release(self, agent: Agent, handle: int) -> None:
        if not agent.release(handle):
            with self._lock:
                self._leaked.append(handle)  # tried again when the agent goes

    def _end(self, session, state: NixlLink, code: int, why: str) -> Exception:
        """Remove the peer's agent (nothing more moves through it) and end the link (its first
        connection is shut down, so the manager drops the link); the exception to raise."""
        with state.cond:
            name, state.remote = state.remote, None
            generation_list, state.generation_list = state.generation_list, None
        self._unload(state, name, generation_list)
        channel = getattr(session, "outgoing", None)
        if channel is not None:
            channel.fault(S.LLM_LINK_FAILED, f"nixl: {why}")
        return fail(code, why)

    def _unload(self, state: NixlLink, name: Optional[str], generation_list: Optional[int]) -> None:
        """Close the link's routes, remove the peer's agent ``name`` and release its generation
        list (the routes' lists too), now if no request of the link is in flight, else when the
        last one ends."""
        self._close_routes(state)
        agent = self._agent
        if generation_list is not None:
            with state.cond:
                later = state.active > 0
                if later:
                    state.retired.append(generation_list)
            if not later and agent is not None:
                agent.release_list(generation_list)
        if name is not None:
            if agent is not None:
                agent.remove(name)  # requests in flight fail at once (NIXL: the agent was invalidated)
            with self._lock:
                if self._loaded.get(name) is state:
                    del self._loaded[name]

    def close(self, session) -> None:
        state = self.state(session)
        if state is None:
            return
        with state.cond:
            state.closed = True
            name, state.remote = state.remote, None
            generation_list, state.generation_list = state.generation_list, None
            state.cond.notify_all()
        self._unload(state, name, generation_list)

    def shutdown(self) -> None:
        """The engine's links are closing (each already dropped its peer's agent): wait for the
        requests still in flight (they fail at once), deregister everything, drop the agent."""
        with self._lock:
            states = set(self._loaded.values())
        for state in states:
            self._close_routes(state)
        with self._lock:
            ends = time.monotonic() + SHUTDOWN_WAIT_S
            while self._active and time.monotonic() < ends:
                self._idle.wait(0.1)
            agent, self._agent = self._agent, None
            self._agent_error = "the engine is finalized"
            if agent is None:
                return
            if self._active:  # a request still inside NIXL: keep the agent rather than free it under it
                logger.error("cluster %s: %d NIXL requests still running at finalize; the agent is left alive",
                             self.engine.cluster_id, self._active)
                self._kept.append(agent)
                return
            for name in list(self._loaded):
                agent.remove(name)
            self._loaded.clear()
            for handle in self._leaked:
                agent.release(handle)
            self._leaked.clear()
            if self._scratch_list is not None:
                agent.release_list(self._scratch_list)
                self._scratch_list = None
            for descs in [r.descs for r in self._registrations.values() if r.descs is not None] + self._extra:
                try:
                    agent.deregister(descs)
                except agent.errors:
                    pass
            for registration in self._registrations.values():
                registration.descs = None
            self._extra = []
            agent.close()

    def _count(self, counter: str) -> None:
        with self._lock:
            self.stats[counter] += 1


def poll_pause(waited: float) -> float:
    """How long to sleep before checking a request again, ``waited`` seconds after posting it: not
    at all for ``SPIN_S``, then about 1/32 of the time spent (between 20 µs and 1 ms), so that a
    long request costs little CPU (NIXL's progress thread moves it meanwhile) and ends at most ~3%
    late."""
    return 0.0 if waited <= SPIN_S else min(max(waited / 32, 20e-6), 1e-3)


def _rows(addrs: Sequence[int], nbytes: int, device: int) -> np.ndarray:
    """N x 3 uint64 rows ``(address, nbytes, device)``, one per address."""
    rows = np.empty((len(addrs), 3), dtype=np.uint64)
    rows[:, 0] = np.asarray(addrs, dtype=np.uint64)
    rows[:, 1] = nbytes
    rows[:, 2] = device
    return rows


def _request_rows(descriptors: np.ndarray, write: bool, local_device: int, remote_device: int,
                  extra: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """The local and remote N x 3 rows of a plan's ``(src, dst, nbytes)`` descriptors (column copies:
    no loop per descriptor), and one row more each, left for the caller, with ``extra``. A write
    reads the local sources; a read fills the local destinations."""
    n = len(descriptors)
    local = np.empty((n + extra, 3), dtype=np.uint64)
    remote = np.empty((n + extra, 3), dtype=np.uint64)
    local_column, remote_column = (0, 1) if write else (1, 0)
    local[:n, 0] = descriptors[:, local_column]
    remote[:n, 0] = descriptors[:, remote_column]
    local[:n, 1] = remote[:n, 1] = descriptors[:, 2]
    local[:n, 2] = local_device
    remote[:n, 2] = remote_device
    return local, remote


def _strided(layout, block_bytes: int) -> List[Tuple[int, int, int, int, int]]:
    """NIXL compact strided rows of every block of every tensor of ``layout`` (DRAM, device 0):
    ``(tensor address, block_bytes, 0, row bytes, rows)``."""
    return [(int(addr), block_bytes, 0, int(layout.row_bytes), int(layout.num_rows)) for addr in layout.tensor_addrs]


def _link_addresses(session) -> Optional[Tuple[str, str]]:
    """``(this side's address, the peer's)`` of the link's first TCP connection, or None."""
    sockets = [channel.sock for channel in getattr(session, "channels", ())] + list(getattr(session, "incoming", ()))
    for sock in sockets:
        try:
            return sock.getsockname()[0], sock.getpeername()[0]
        except (OSError, IndexError, TypeError):
            continue
    return None


def _resolved_plane(options: Any) -> str:
    try:
        return plane_registry.resolve(options)
    except Exception:  # noqa: BLE001 - an invalid value fails the engine elsewhere
        return plane_registry.AUTO


def _progress_us() -> int:
    try:
        value = int(os.environ.get(PROGRESS_ENV, DEFAULT_PROGRESS_US))
    except ValueError:
        return DEFAULT_PROGRESS_US
    return value if value >= 0 else DEFAULT_PROGRESS_US


def _import_quietly() -> None:
    try:
        bindings()
    except Exception:  # noqa: BLE001 - the link that needs it says why
        pass
