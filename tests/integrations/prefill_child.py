"""A prefill ``Worker`` of the vLLM connector in a child process (``test_vllm_peers.PrefillChild``
forks it from the session's server, ``forked.py``): one ``LLMDataDist`` per process, so a decode
worker in the test process needs its prefill peer elsewhere. ``serve`` answers ``(op, args)``
messages on a pipe with ``(True, result)`` or ``(False, traceback)``."""

from __future__ import annotations

import json
import time
import traceback
from types import SimpleNamespace

BLOCKS, BLOCK_FLOATS = 8, 64
PRODUCER = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_producer=True, is_kv_consumer=False))


class _Prefill:
    def __init__(self, extra: dict) -> None:
        import torch

        from llm_datadist.integrations.vllm.options import Options
        from llm_datadist.integrations.vllm.worker import Worker

        self.options = Options.parse(extra)
        self.worker = Worker(PRODUCER, "prefill", self.options, None)
        self.kv = torch.arange(BLOCKS * BLOCK_FLOATS, dtype=torch.float32).reshape(BLOCKS, BLOCK_FLOATS)
        self.worker.register({"layer.0": self.kv})
        self.batches = []

    def ready(self) -> int:
        return self.worker.cluster_id

    def hand_out(self, req_ids, lease_s: float) -> dict:
        """Finish ``req_ids`` as the prefill engine does (scheduler, then a worker step): their
        kv_transfer_params, each naming one block."""
        from vllm.v1.request import RequestStatus

        from llm_datadist.integrations.vllm import LLMDataDistConnectorMetadata
        from llm_datadist.integrations.vllm.options import Options
        from llm_datadist.integrations.vllm.scheduler import Scheduler

        scheduler = Scheduler("prefill", Options.parse({"kv_lease_s": lease_s}), 16, producer=False)
        scheduler.set_worker(self.worker.handshake())
        params = {}
        for i, req_id in enumerate(req_ids):
            request = SimpleNamespace(request_id=req_id, kv_transfer_params={"do_remote_decode": True},
                                      status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=16)
            params[req_id] = scheduler.request_finished(request, [[i % BLOCKS]])[1]
        meta = LLMDataDistConnectorMetadata()
        meta.reqs_to_send = scheduler.build_connector_meta().reqs_to_send
        self.worker.start(meta)
        return params

    def hand_out_tp(self, req_ids, lease_s: float) -> dict:
        """``hand_out`` as rank 0 of a prefill engine of tensor parallel size 2 (rank 1 a stand-in:
        its handshake only) does it: their kv_transfer_params name both ranks, and this worker gets
        the table of ranks it answers rank queries with."""
        from vllm.v1.request import RequestStatus

        from llm_datadist.integrations.vllm import LLMDataDistConnectorMetadata
        from llm_datadist.integrations.vllm.meta import LLMDataDistHandshakeMetadata
        from llm_datadist.integrations.vllm.options import Options
        from llm_datadist.integrations.vllm.scheduler import Scheduler

        scheduler = Scheduler("prefill", Options.parse({"kv_lease_s": lease_s}), 16, producer=False, tp_size=2)
        rank1 = LLMDataDistHandshakeMetadata("prefill", self.worker.cluster_id + 1, "127.0.0.1", 9,
                                             lease_key="ab" * 32, tp_rank=1, tp_size=2)
        scheduler.set_workers({0: self.worker.handshake(), 1: rank1})
        params = {}
        for i, req_id in enumerate(req_ids):
            request = SimpleNamespace(request_id=req_id, kv_transfer_params={"do_remote_decode": True},
                                      status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=16)
            params[req_id] = scheduler.request_finished(request, [[i % BLOCKS]])[1]
        built = scheduler.build_connector_meta()
        meta = LLMDataDistConnectorMetadata()
        meta.reqs_to_send, meta.rank_table = built.reqs_to_send, built.rank_table
        self.worker.start(meta)
        return params

    def act_older(self) -> None:
        """Answer notifications as the release before rank queries did: a rank query is taken for
        a malformed release."""
        worker = self.worker

        def older(peer_id, message):
            if isinstance(message, dict) and message.get("op") == "ranks":
                return worker.leases.on_release(peer_id, message)
            return worker._on_notify(peer_id, message)

        worker.dd.engine.set_notify_handler(older)

    def count_batches(self) -> None:
        """Note each renewal's request ids' JSON size before the lease book answers it."""
        handler = self.worker.leases.on_message

        def counting(peer_id, message):
            if isinstance(message, dict) and message.get("op") == "renew":
                self.batches.append(len(json.dumps(message.get("request_ids"))))
            return handler(peer_id, message)

        self.worker.dd.engine.set_notify_handler(counting)

    def take_batches(self) -> list:
        batches, self.batches = self.batches, []
        return batches

    def finished(self) -> list:
        return sorted(self.worker.results().finished_sending)

    def stats(self) -> dict:
        return self.worker.stats

    def kv_rows(self, first: int, last: int) -> list:
        return self.kv[first:last].tolist()

    def linked(self) -> list:
        return self.worker.dd.engine.links.linked_clusters()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def serve(conn, extra: dict) -> None:
    prefill = None
    try:
        while True:
            try:
                op, args = conn.recv()
            except EOFError:
                return
            if op == "exit":
                conn.send((True, None))
                return
            try:
                if prefill is None:
                    prefill = _Prefill(extra)
                result = getattr(prefill, op)(*args)
                conn.send((True, result))
            except Exception:  # noqa: BLE001 - handed to the test
                conn.send((False, traceback.format_exc()))
    finally:
        if prefill is not None:
            prefill.worker.close()
        conn.close()
