"""What push mode's scheduler half hands its worker half each step: a decode request's blocks to
register with its prefill worker (``PushReg``, read from its ``kv_transfer_params`` by
``push_spec``) and a prefill request's blocks and prompt tokens of the step (``PushStep``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from llm_datadist.integrations.vllm.meta import Recv, prefill_rank

#: The values of ``transfer_mode`` (``kv_connector_extra_config``).
TRANSFER_MODES = ("pull", "push")


@dataclass
class PushReg:
    """Decode scheduler -> worker: a request's blocks to register with its prefill worker.
    ``local_block_ids`` empty: nothing to receive (the prompt was cached here, or the request
    ended first): the prefill side only frees its blocks."""

    local_block_ids: List[int]
    first_block: int  # the prompt's block index of the first of them (blocks before are cached here)
    host: str
    port: int
    cluster_id: Optional[int]
    remote_request_id: str  # "" where the params name none (a proxy that sends to both at once)
    awaiting: bool = False  # vLLM waits for it (report in finished_recving)

    def as_recv(self) -> Recv:
        """The peer this goes to, as ``peers.Peers`` addresses it."""
        return Recv([], [], self.host, self.port, self.cluster_id, self.remote_request_id)


def push_spec(params: Any) -> Optional[PushReg]:
    """The prefill worker a decode request's ``kv_transfer_params`` name for push mode, or None if
    they are unusable (never raises: they come from outside). ``remote_request_id`` is optional."""
    if not isinstance(params, dict):
        return None
    remote_id = params.get("remote_request_id")
    if remote_id is None:
        remote_id = ""
    if not isinstance(remote_id, str):
        return None
    peer = prefill_rank(params.get("remote_host"), params.get("remote_port"), params.get("remote_cluster_id"),
                        remote_id or "-")
    if peer is None:
        return None
    tp_size = params.get("tp_size", 1)
    if tp_size != 1:  # (push mode moves KV between engines without tensor parallelism only)
        return None
    return PushReg([], 0, peer.host, peer.port, peer.cluster_id, remote_id)


@dataclass
class PushStep:
    """Prefill scheduler -> worker, for a push-mode request scheduled in this step: its blocks so
    far (of its one KV cache group) and the prompt tokens ``[start, end)`` this step computes."""

    block_ids: List[int]
    start: int
    end: int
    prompt_tokens: int

