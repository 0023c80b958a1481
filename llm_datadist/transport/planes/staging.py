"""``staging``: device memory of any runtime between processes, through pinned host memory.

The frames are tcp's (``PUSH`` / ``PULL`` on the link's connections, large transfers split over
them); a side whose memory is device memory the host cannot address stages it through pinned
bounce buffers, chunk by chunk, the device copy of one chunk overlapping the socket transfer of
the other (``transport.staging``): this side stages its local cache, the owner stages its own
(``transport.server``: a plan wholly in its device ranges). The owner checks every range against
its registry as for tcp, so the plane accepts every link; it is the device plane of links where
no same-host device plane applies (acl everywhere, cuda across hosts or namespaces). Forced
(``llm.DataPlane=staging``), it carries host memory too, as plain tcp frames.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from llm_datadist.transport.planes import register
from llm_datadist.transport.planes.tcp import TcpPlane, probe_loopback
from llm_datadist.transport.staging import HOST_PAYLOAD, STAGING_CHUNK_BYTES, StagedPayload


@register
class StagingPlane(TcpPlane):
    name = "staging"
    summary = (f"device memory through pinned host buffers ({STAGING_CHUNK_BYTES >> 20} MiB chunks, copies "
               f"overlapping the transfer) in tcp frames")
    auto_rank = 90
    fallback = False
    device_memory = True

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.staged = StagedPayload(engine)

    @classmethod
    def probe(cls) -> Tuple[bool, str]:
        usable, why = probe_loopback()
        return usable, (f"{why}; device memory is staged through pinned host buffers of the device runtime"
                        if usable else why)

    def accept(self, session, peer_facts: Dict[str, Any], deadline: float) -> Optional[str]:
        return None  # the peer serves tcp frames on every link and stages its own side

    def transfer_device(self, session, table, plan, write: bool, deadline: float, local_device: bool,
                        remote_device: bool) -> None:
        self.frames(session, table, plan, write, deadline, self.staged if local_device else HOST_PAYLOAD)
