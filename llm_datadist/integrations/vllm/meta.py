"""What the connector's halves tell each other: a worker's address (handshake), the pulls and
leases of a step (connector metadata), and a decode request's pull read from its
``kv_transfer_params``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from llm_datadist.integrations.vllm.leases import MAX_RELEASE_ID_BYTES, utf8_len

#: Fields a decode request's ``kv_transfer_params`` must carry to be pulled (all of them NIXL's:
#: ``remote_cluster_id``, which our prefill engines add, is optional; without it the decode side
#: links to whichever cluster the handshake finds at ``remote_host:remote_port``).
REMOTE_FIELDS = ("remote_block_ids", "remote_host", "remote_port", "remote_request_id")


@dataclass
class Recv:
    """One request's blocks to pull: ``remote_block_ids[k]`` -> ``local_block_ids[k]``. A request
    the scheduler does not park for it (``awaiting`` False: nothing to load, or finished before its
    blocks were allocated) only tells the prefill side to free its blocks, and is not reported
    back to vLLM (which accepts ``finished_recving`` only for requests it parked)."""

    local_block_ids: List[int]
    remote_block_ids: List[int]
    host: str
    port: int
    cluster_id: Optional[int]  # None: the one found at host:port
    remote_request_id: str
    awaiting: bool = False


@dataclass
class LLMDataDistHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What a worker tells its scheduler: where decode engines reach it."""

    engine_id: str
    cluster_id: int
    host: str
    port: int
    #: hex key the scheduler makes lease tokens with (never leaves this engine's processes)
    lease_key: str = field(default="", repr=False)


class LLMDataDistConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once a step: pulls to start, requests that arrived to wait in the
    queue for their pull (whose prefill leases the worker renews until their pull starts or they
    end: both come as ``reqs_to_recv``), blocks to keep for a decode side, and whether the engine
    has begun to shut down (then held blocks are freed)."""

    def __init__(self) -> None:
        self.reqs_to_recv: Dict[str, Recv] = {}
        self.reqs_parked: Dict[str, Recv] = {}
        self.reqs_to_send: Dict[str, float] = {}  # request id -> seconds to keep its blocks
        self.stopping = False



def recv_spec(params: Any) -> Optional[Recv]:
    """The pull a decode request's ``kv_transfer_params`` ask for, or None if they are unusable
    (never raises: these come from outside, through the proxy)."""
    try:
        if not isinstance(params, dict) or any(params.get(name) is None for name in REMOTE_FIELDS):
            return None
        blocks = params["remote_block_ids"]
        if isinstance(blocks, (list, tuple)) and blocks and isinstance(blocks[0], (list, tuple)):
            if len(blocks) != 1:  # per-group form (NIXL style): one KV cache group only
                return None
            blocks = blocks[0]
        if not isinstance(blocks, (list, tuple)) or not all(isinstance(b, int) and b >= 0 for b in blocks):
            return None
        remote_id = params["remote_request_id"]
        if not isinstance(remote_id, str) or utf8_len(remote_id) > MAX_RELEASE_ID_BYTES:
            return None  # the prefill side would refuse its release
        cluster_id = params.get("remote_cluster_id")
        return Recv([], list(blocks), str(params["remote_host"]), int(params["remote_port"]),
                    None if cluster_id is None else int(cluster_id), remote_id)
    except (TypeError, ValueError, OverflowError):
        return None
