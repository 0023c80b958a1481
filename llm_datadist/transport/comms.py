"""Two-sided links (``LLMDataDist.link``): the rank table, and where each member is reached.

CANN builds an HCCL communicator from the rank table; here the members of a comm make ordinary
links to each other, a full mesh in which each member listens for the members of higher rank
and connects to those of lower rank. Where a member is reached comes from its rank-table entry:

* address: its ``device_ip``;
* port: ``base + 16 * device_id + rank_id``, where ``base`` is the option ``llm.RankTablePortBase``
  or the environment variable ``LLM_DATADIST_RANK_PORT_BASE`` (default 26100). So two members on
  one host may share ``device_ip`` and even ``device_id`` as long as their ranks differ.

``server_id``, ``host_ip``, ``super_device_id``, ``super_pod_list``, ``server_count`` and ``status``
are accepted and ignored.

Who may join: on one host every member may be 127.0.0.1, so an address proves nothing. A link
request on a member's rank-table port must name the comm, carry the digest of its rank table
and rank map (``digest``: which rank each cluster id has) and the rank it claims, and that rank
must be one of the higher ranks this member still expects, under the cluster id the rank map
gives it; anything else is refused before it counts as a member. A comm that the listening
member is not making at that moment is refused too (the connecting member retries until the
``link`` deadline). Two links claiming one rank fail the comm (``Join.failed``): that member's
``link`` fails and drops the comm's links, so the other members see their links to it end and
fail too (``Comm.status`` FAILED once ``link`` has returned). A link belongs to the one comm it
was made for and ends with its ``unlink``. With a link secret only its holders can link at all;
without one, knowing the rank table is all an impostor needs.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from llm_datadist.status import LLMException, LLMStatusCode

PORT_BASE_OPTION = "llm.RankTablePortBase"
PORT_BASE_ENV = "LLM_DATADIST_RANK_PORT_BASE"
DEFAULT_PORT_BASE = 26100
PORTS_PER_DEVICE = 16
#: HCCL's connect timeout when ``llm.LinkTotalTime`` is 0 or absent (``HCCL_CONNECT_TIMEOUT`` s).
DEFAULT_LINK_TOTAL_S = 120


@dataclass(frozen=True)
class Member:
    cluster_id: int
    rank: int
    device_id: int
    device_ip: str
    port: int


def _invalid(message: str) -> LLMException:
    return LLMException(message, status_code=LLMStatusCode.LLM_PARAM_INVALID)


def port_base(options: Dict[str, str]) -> int:
    text = options.get(PORT_BASE_OPTION) or os.environ.get(PORT_BASE_ENV) or str(DEFAULT_PORT_BASE)
    try:
        base = int(text)
    except ValueError:
        raise _invalid(f"{PORT_BASE_OPTION} must be an integer port, got {text!r}") from None
    if not 1 <= base <= 65535:
        raise _invalid(f"{PORT_BASE_OPTION} must be a port number, got {base}")
    return base


def _as_int(value, what: str) -> int:
    try:
        number = int(str(value), 10)
    except ValueError:
        raise _invalid(f"rank table: {what} {value!r} is not an integer") from None
    if number < 0:
        raise _invalid(f"rank table: {what} {value!r} is negative")
    return number


def parse(rank_table: str, cluster_rank_info: Dict[int, int], base: int) -> List[Member]:
    """The members of a comm, in rank order; ``LLMException(LLM_PARAM_INVALID)`` for a table that
    is not JSON, lacks a rank of ``cluster_rank_info`` or lists one twice."""
    try:
        table = json.loads(rank_table)
    except ValueError as exc:
        raise _invalid(f"rank_table is not JSON: {exc}") from None
    servers = table.get("server_list") if isinstance(table, dict) else None
    if not isinstance(servers, list):
        raise _invalid("rank_table needs a server_list")
    by_rank: Dict[int, Tuple[int, str]] = {}
    for server in servers:
        devices = server.get("device") if isinstance(server, dict) else None
        if not isinstance(devices, list):
            raise _invalid("rank_table: every server_list entry needs a device list")
        for device in devices:
            if not isinstance(device, dict) or not {"rank_id", "device_id", "device_ip"} <= set(device):
                raise _invalid("rank_table: every device needs rank_id, device_id and device_ip")
            rank = _as_int(device["rank_id"], "rank_id")
            if rank in by_rank:
                raise _invalid(f"rank_table lists rank {rank} twice")
            ip = device["device_ip"]
            if not isinstance(ip, str) or not ip:
                raise _invalid(f"rank_table: device_ip of rank {rank} is {ip!r}")
            by_rank[rank] = (_as_int(device["device_id"], "device_id"), ip)
    members = []
    for cluster_id, rank in cluster_rank_info.items():
        if rank not in by_rank:
            raise _invalid(f"rank {rank} of cluster {cluster_id} is not in the rank table")
        device_id, ip = by_rank[rank]
        port = base + PORTS_PER_DEVICE * device_id + rank
        if rank >= PORTS_PER_DEVICE or port > 65535:
            raise _invalid(f"rank {rank} on device {device_id} gives no port below 65536 from base {base} "
                           f"({PORT_BASE_OPTION})")
        members.append(Member(cluster_id, rank, device_id, ip, port))
    return sorted(members, key=lambda m: m.rank)


def digest(comm_name: str, rank_table: str, cluster_rank_info: Dict[int, int]) -> str:
    """What two members must agree on to be in one comm: its name, the rank table and the rank
    map, pairs of (cluster id, rank), so that members that disagree on who has which rank do
    not meet."""
    text = json.dumps([comm_name, rank_table, sorted(cluster_rank_info.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass
class Comm:
    """A two-sided link as this member holds it."""

    comm_id: int
    name: str
    key: Tuple[str, str]
    members: List[Member]
    me: Member
    status: str = "PREPARING"  # then "OK" or "FAILED" (sticky)

    @property
    def others(self) -> List[Member]:
        return [m for m in self.members if m.cluster_id != self.me.cluster_id]


@dataclass
class Join:
    """A two-sided link being made, as its listening member holds it: the higher members that
    link here (cluster id -> rank), the link accepted for each (a ``session.Link``), and why the
    join failed (two links claimed one rank, or a link of it ended), if it did."""

    expected: Dict[int, int]
    claimed: Dict[int, Any] = field(default_factory=dict)
    failed: Optional[str] = None
