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

**Modules** (one per concern, as NIXL's ``src/plugins/<name>/``):

* ``plane.py``: ``NixlPlane``, the plane itself: who gets it, this engine's agent, the metadata
  offered and taken, checked transfers and the life of their requests;
* ``link.py``: ``NixlLink``, the plane's state for one link, and its changes;
* ``route.py``: ``NixlRoute``, block routes over prepared lists;
* ``memory.py``: ``LocalMemory``, what this side registers with NIXL, and ``GenerationSlots``;
* ``metadata.py``: the peer's entry (``NixlFacts``) and agent metadata (``parse_metadata``);
* ``environment.py``: this host's interfaces and RDMA ports, UCX's process-wide settings;
* ``agent.py``: NIXL itself: installed or not, its bindings, ``Agent``;
* ``probe.py``: the probe, an agent made in a child process.

Every public name of the modules above that the former ``planes/nixl.py`` had is importable from
here.
"""

from __future__ import annotations

from llm_datadist.transport.planes.nixl.agent import (DEFAULT_PROGRESS_US, INSTALL, MIN_VERSION, PROGRESS_ENV,
                                                      SPIN_S, Agent, bindings, installed, nixl_version, poll_pause)
from llm_datadist.transport.planes.nixl.environment import (DEVICES_ENV, DEVICES_OPTION, TCP_ENV, fix_ucx,
                                                            interface_addresses, interface_of, is_this_host,
                                                            rdma_ports, tcp_mode, ucx_settings)
from llm_datadist.transport.planes.nixl.link import NixlLink
from llm_datadist.transport.planes.nixl.memory import GENERATION_SLOTS
from llm_datadist.transport.planes.nixl.metadata import _AGENT_NAME  # noqa: F401 - the tests read it here
from llm_datadist.transport.planes.nixl.metadata import (DRAM, MAX_CONNECTION_BYTES, MAX_METADATA_BYTES,
                                                         MAX_REGION_META_BYTES, VRAM, NixlFacts, Region, agent_name,
                                                         parse_metadata)
from llm_datadist.transport.planes.nixl.plane import NO_SECRET, RELOAD_WAIT_S, SHUTDOWN_WAIT_S, NixlPlane
from llm_datadist.transport.planes.nixl.probe import PROBE_TIMEOUT_S, probe_child, probe_rdma
from llm_datadist.transport.planes.nixl.route import ROUTE_MAX_DESCRIPTORS, NixlRoute

__all__ = [
    # the plane and its per-link parts
    "NixlPlane", "NixlLink", "NixlRoute", "NO_SECRET", "RELOAD_WAIT_S", "SHUTDOWN_WAIT_S", "GENERATION_SLOTS",
    "ROUTE_MAX_DESCRIPTORS",
    # the peer's metadata
    "NixlFacts", "Region", "parse_metadata", "agent_name", "MAX_METADATA_BYTES", "MAX_CONNECTION_BYTES",
    "MAX_REGION_META_BYTES", "DRAM", "VRAM",
    # UCX's environment
    "TCP_ENV", "DEVICES_OPTION", "DEVICES_ENV", "interface_addresses", "interface_of", "is_this_host", "rdma_ports",
    "tcp_mode", "ucx_settings", "fix_ucx",
    # NIXL itself and the probe
    "INSTALL", "MIN_VERSION", "PROGRESS_ENV", "DEFAULT_PROGRESS_US", "SPIN_S", "Agent", "bindings", "installed",
    "nixl_version", "poll_pause", "PROBE_TIMEOUT_S", "probe_child", "probe_rdma",
]
