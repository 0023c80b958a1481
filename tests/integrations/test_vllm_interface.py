"""The connector against vLLM's connector interface (issue 22, items 6 and 7): its overrides keep
the installed base class's signatures, another connector's handshake metadata under
MultiConnector is ignored, prompt-embeds requests load from the prefill engine, configurations
vLLM documents as incompatible with P2P KV loading are refused, and sleep mode (vLLM 0.33's
``unregister_kv_caches`` / ``restore_kv_caches``) takes the KV caches out of the registry and puts
them back.

Needs vLLM (``pip install '.[vllm]'``); no engine is started.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
from test_vllm import needs_vllm

pytestmark = needs_vllm

#: Hooks vLLM 0.33 added to KVConnectorBase_V1 (sleep mode); on 0.32 the base class lacks them and
#: nothing calls them.
NEWER_HOOKS = {"supports_sleep_mode": (0, 33), "unregister_kv_caches": (0, 33), "restore_kv_caches": (0, 33)}
#: What the connector adds for tests and logs, not a hook.
OWN = {"stats", "registration"}


def _vllm_version() -> tuple:
    import vllm

    return tuple(int(part) for part in vllm.__version__.split(".")[:2])


def _callable_as(ours, base) -> bool:
    """``ours`` takes every call ``base`` takes: the same parameters (names, kinds, order), and a
    default wherever the base has one (ours may add defaults)."""
    mine, theirs = (list(inspect.signature(fn).parameters.values()) for fn in (ours, base))
    return [(p.name, p.kind) for p in mine] == [(p.name, p.kind) for p in theirs] and all(
        p.default is not inspect.Parameter.empty for p, q in zip(mine, theirs) if q.default is not q.empty)


def test_overrides_match_the_installed_base_class():
    """Every method the connector defines is a hook of the installed vLLM's KVConnectorBase_V1 (or
    of SupportsHMA, which it declares) with the same parameters and the same kind (class method or
    not): a release that renames, adds or drops a parameter, or removes a hook, fails here instead
    of at the first request."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA, supports_hma

    from llm_datadist.integrations.vllm import LLMDataDistConnector

    version = _vllm_version()
    checked = []
    for name, ours in vars(LLMDataDistConnector).items():
        if name.startswith("_") or name in OWN:
            continue
        owner = KVConnectorBase_V1 if inspect.getattr_static(KVConnectorBase_V1, name, None) is not None \
            else SupportsHMA
        base = inspect.getattr_static(owner, name, None)
        if base is None:
            assert name in NEWER_HOOKS and version < NEWER_HOOKS[name], \
                f"{name} is no hook of vLLM {'.'.join(map(str, version))}'s KVConnectorBase_V1"
            continue
        assert isinstance(ours, classmethod) == isinstance(base, classmethod), name
        assert isinstance(ours, staticmethod) == isinstance(base, staticmethod), name
        assert _callable_as(getattr(LLMDataDistConnector, name), getattr(owner, name)), name
        checked.append(name)
    assert {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
            "register_kv_caches", "start_load_kv", "get_finished", "get_block_ids_with_load_errors",
            "set_xfer_handshake_metadata", "get_required_kvcache_layout", "request_finished_all_groups"} <= set(checked)
    # vLLM keeps its hybrid KV cache manager on only for connectors that declare it
    assert supports_hma(LLMDataDistConnector)
    if version >= (0, 33):
        assert set(NEWER_HOOKS) <= set(checked)
    # the constructor vLLM's factory calls (it refuses connectors without kv_cache_config)
    assert _callable_as(LLMDataDistConnector.__init__, KVConnectorBase_V1.__init__)


def _config(producer: bool = False, **extra) -> SimpleNamespace:
    transfer = SimpleNamespace(engine_id="engine", kv_connector_extra_config={}, is_kv_producer=producer,
                               is_kv_consumer=not producer)
    return SimpleNamespace(kv_transfer_config=transfer, cache_config=SimpleNamespace(block_size=32),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
                           **extra)


def test_another_connectors_handshake_metadata_is_ignored_under_multiconnector():
    """MultiConnector hands every child the metadata the first publishing child gave: a scheduler
    half keeps its own worker's and ignores another connector's (it raised TypeError, so such a
    MultiConnector could not start)."""
    from dataclasses import dataclass

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from llm_datadist.integrations.vllm import LLMDataDistConnector, LLMDataDistHandshakeMetadata

    @dataclass
    class OtherMetadata(KVConnectorHandshakeMetadata):
        agent: bytes = b"agent"

    connector = LLMDataDistConnector(_config(), KVConnectorRole.SCHEDULER)
    try:
        multi = SimpleNamespace(_connectors=[connector])
        MultiConnector.set_xfer_handshake_metadata(multi, {0: OtherMetadata()})  # vLLM's own fan-out
        assert connector._scheduler.worker is None
        ours = LLMDataDistHandshakeMetadata("engine", 5, "127.0.0.1", 4000, lease_key="ab" * 32)
        MultiConnector.set_xfer_handshake_metadata(multi, {0: ours})
        MultiConnector.set_xfer_handshake_metadata(multi, {0: OtherMetadata()})  # later foreign: ours stays
        assert connector._scheduler.worker == ours
    finally:
        connector.shutdown()


def _request(request_id: str, params: dict, tokens: int, embeds: bool):
    import torch
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sampling = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params})
    if embeds:
        return Request(request_id, None, sampling, None, prompt_embeds=torch.zeros(tokens, 8))
    return Request(request_id, list(range(tokens)), sampling, None)


def test_a_prompt_embeds_request_loads_its_prompt_from_the_prefill_engine():
    """The prompt's length comes from vLLM's ``Request.num_prompt_tokens``, which counts embeddings
    too: a prompt-embeds request with the right block count loads its 70 tokens (it used to count
    0 tokens, find 3 blocks too many and compute the prompt locally)."""
    from llm_datadist.integrations.vllm.options import Options
    from llm_datadist.integrations.vllm.scheduler import Scheduler

    scheduler = Scheduler("decode", Options.parse({}), 32, producer=False)
    try:
        def params(blocks: int) -> dict:
            return {"do_remote_prefill": True, "remote_block_ids": list(range(blocks)), "remote_host": "127.0.0.1",
                    "remote_port": 4000, "remote_cluster_id": 5, "remote_request_id": "p"}

        for embeds in (True, False):
            request = _request(f"r-{embeds}", params(3), 70, embeds)
            assert (request.prompt_token_ids is None) == embeds and request.num_prompt_tokens == 70
            assert scheduler.get_num_new_matched_tokens(request, 0) == (70, True)
            assert scheduler.get_num_new_matched_tokens(request, 32) == (38, True)  # a local prefix hit
        wrong = _request("r-wrong", params(2), 70, True)  # 2 blocks cannot hold 70 tokens
        assert scheduler.get_num_new_matched_tokens(wrong, 0) == (0, False)
        assert wrong.kv_transfer_params["do_remote_prefill"] is False
    finally:
        scheduler.close()


def test_return_routed_experts_is_refused():
    """vLLM 0.33 refuses ``--enable-return-routed-experts`` with its own P2P connectors (the prefill's
    routed experts never reach the decode side); so does this one, in both roles."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from llm_datadist.integrations.vllm import LLMDataDistConnector

    aux = SimpleNamespace(enable_return_routed_experts=True)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="--enable-return-routed-experts is incompatible with "
                                             "LLMDataDistConnector"):
            LLMDataDistConnector(_config(aux_output_config=aux), role)
    assert LLMDataDistConnector.supports_sleep_mode(_config().kv_transfer_config) is True


# -- sleep mode --------------------------------------------------------------------------------------

BLOCKS, LAYER = 6, (6, 2, 4, 16)  # LBHNC views: 6 blocks of 2 heads x 4 tokens x 16 (K+V) fp16
BLOCK_BYTES = 2 * 4 * 16 * 2


def _release_ok(peer_cluster_id, message):
    return {"request_id": message.get("request_id"), "released": True, "why": ""}


def peer_setup(state, seed: int) -> list:
    """The peer engine (own process): a HOST blocks cache of the worker's block size, seeded,
    answering releases; returns its tensors' bytes, one row per block."""
    import llm_datadist as ld

    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 256, (BLOCKS, BLOCK_BYTES), dtype=np.uint8) for _ in range(2)]
    state.arrays["kv"] = arrays
    desc = ld.CacheDesc(2, [BLOCKS, BLOCK_BYTES], ld.DataType.DT_UINT8, ld.Placement.HOST)
    state.caches["kv"] = state.cm.register_blocks_cache(desc, [a.ctypes.data for a in arrays],
                                                        ld.BlocksCacheKey(state.cluster_id, 0))
    state.dd.engine.set_notify_handler(_release_ok)
    return arrays


def peer_pull(state, cluster_id: int, host: str, port: int, remote, local):
    """The peer pulls the worker's blocks ``remote`` into its blocks ``local``: the bytes it got,
    or the error (linking first if it has no link yet)."""
    import llm_datadist as ld
    from llm_datadist.testing import _link

    if not state.scratch.get("linked"):
        assert _link(state, cluster_id, host, port, 5000)[1] == [int(ld.LLMStatusCode.LLM_SUCCESS)]
        state.scratch["linked"] = True
    try:
        state.cm.pull_blocks(ld.BlocksCacheKey(cluster_id, 0), state.caches["kv"], list(remote), list(local))
    except ld.LLMException as exc:
        return f"{exc.status_code.name}: {exc}"
    return [a[list(local)].copy() for a in state.arrays["kv"]]


def test_sleep_mode_unregisters_the_caches_and_restore_registers_them_again():
    """A worker (prefill and decode at once) and a peer engine in another process that pulls from
    it and is pulled from. ``unregister_kv_caches``: the blocks held for a decode side are freed
    (a release for them is refused), the peer's pull of our blocks fails, our pull from the peer is
    reported failed with its blocks; twice is harmless. ``restore_kv_caches``: the same tensors are
    registered again under a new registry generation, and both pulls move the right bytes."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    import llm_datadist as ld
    from llm_datadist.integrations.vllm import LLMDataDistConnector, LLMDataDistConnectorMetadata
    from llm_datadist.integrations.vllm.meta import Recv
    from llm_datadist.integrations.vllm.options import Options
    from llm_datadist.integrations.vllm.worker import Worker
    from llm_datadist.testing import Cluster

    generator = torch.Generator().manual_seed(3)
    kv = {f"layer{i}": torch.randint(-100, 100, LAYER, generator=generator).to(torch.float16) for i in range(2)}
    mine = [t.view(torch.uint8).reshape(BLOCKS, BLOCK_BYTES).numpy() for t in kv.values()]
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_producer=True, is_kv_consumer=True))
    worker = Worker(config, "engine", Options.parse({"lease_tokens": False, "kv_lease_s": 60}),
                    SimpleNamespace(num_blocks=BLOCKS, kv_cache_groups=[0]))
    connector = SimpleNamespace(_worker=worker)  # the connector's hooks over this worker
    sleep = lambda: LLMDataDistConnector.unregister_kv_caches(connector)  # noqa: E731
    wake = lambda: LLMDataDistConnector.restore_kv_caches(connector)  # noqa: E731
    try:
        worker.register(kv)
        with Cluster(61, role="MIX", listen=True, timeout=120) as peer:
            theirs = peer.call(peer_setup, 11)
            me = (worker.cluster_id, worker.handshake().host, worker.handshake().port)
            got = peer.call(peer_pull, *me, [4, 1], [0, 5])
            assert all(np.array_equal(g, m[[4, 1]]) for g, m in zip(got, mine))
            meta = LLMDataDistConnectorMetadata()
            meta.reqs_to_send = {"held": 60.0}
            worker.start(meta)
            assert worker.results().finished_sending == set()
            generation = worker.dd.engine.generation_word.value
            stale = worker.cache  # what a pull that began before the sleep holds

            sleep()
            sleep()  # idempotent
            assert worker.cache is None and worker.results().finished_sending == {"held"}
            assert worker.leases.on_release(61, {"op": "release", "request_id": "held"}) == {
                "request_id": "held", "released": False,
                "why": "its blocks were already freed (the KV cache was put to sleep)"}
            failed = peer.call(peer_pull, *me, [2], [3])
            assert isinstance(failed, str), "a peer read the KV memory of a sleeping engine"
            host, port = peer.address
            worker._pull("asleep", Recv([1, 2], [0, 3], host, port, 61, "p1", awaiting=True))
            results = worker.results()
            assert results.finished_recving == {"asleep"} and results.failed_recving == {"asleep"}
            assert worker.take_load_errors() == {1, 2}
            before = [m[0].copy() for m in mine]
            with pytest.raises(ld.LLMException) as refused:  # a pull that began before: refused, nothing written
                worker.peers.on_link(Recv([], [], host, port, 61, "x"), lambda cluster_id: worker.cm.pull_blocks(
                    ld.BlocksCacheKey(cluster_id, 0), stale, [1], [0]))
            assert refused.value.status_code == ld.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
            assert all(np.array_equal(m[0], b) for m, b in zip(mine, before))

            wake()
            wake()  # idempotent
            assert worker.cache is not None and worker.dd.engine.generation_word.value > generation
            assert worker.cache.tensor_addrs == [t.data_ptr() for t in kv.values()]  # the same memory
            got = peer.call(peer_pull, *me, [2, 3], [3, 2])
            assert not isinstance(got, str), got
            assert all(np.array_equal(g, m[[2, 3]]) for g, m in zip(got, mine))
            worker._pull("awake", Recv([1, 2], [1, 4], host, port, 61, "p2", awaiting=True))  # blocks it never got
            results = worker.results()
            assert results.finished_recving == {"awake"} and results.failed_recving == set(), worker.stats
            for t, want in zip(kv.values(), theirs):
                assert np.array_equal(t.view(torch.uint8).reshape(BLOCKS, BLOCK_BYTES).numpy()[[1, 2]], want[[1, 4]])
    finally:
        worker.close()
    # on vLLM 0.32 the base class has no such hooks: defining them changes nothing there
    assert hasattr(KVConnectorBase_V1, "unregister_kv_caches") == (_vllm_version() >= (0, 33))


# -- where the prefill worker listens (issue 23, item 4) -------------------------------------------

def test_the_listener_defaults_to_the_routable_address_vllm_finds(monkeypatch):
    """No ``listen_host``: VLLM_HOST_IP (here 10.9.8.7, only parsed, never bound), advertised as is;
    ``0.0.0.0`` listens everywhere and advertises the routable address; given hosts are kept."""
    from llm_datadist.integrations.vllm.options import Options
    monkeypatch.setenv("VLLM_HOST_IP", "10.9.8.7")
    opts = Options.parse({})
    assert (opts.listen_host, opts.advertise_host) == ("10.9.8.7", "10.9.8.7")
    opts = Options.parse({"listen_host": "0.0.0.0"})
    assert (opts.listen_host, opts.advertise_host) == ("0.0.0.0", "10.9.8.7")
    opts = Options.parse({"listen_host": "127.0.0.1", "advertise_host": "10.1.1.1"})
    assert (opts.listen_host, opts.advertise_host) == ("127.0.0.1", "10.1.1.1")
    with pytest.raises(ValueError, match="listen_host must be an address"):
        Options.parse({"listen_host": 7})


def test_without_a_route_the_listener_stays_on_loopback_and_says_so(monkeypatch, caplog):
    import vllm.utils.network_utils as network_utils

    from llm_datadist.integrations.vllm.options import Options
    monkeypatch.setattr(network_utils, "get_ip", lambda: "0.0.0.0")
    caplog.set_level("WARNING")
    opts = Options.parse({})
    assert (opts.listen_host, opts.advertise_host) == ("127.0.0.1", "127.0.0.1")
    assert "no route to other hosts" in caplog.text and "VLLM_HOST_IP" in caplog.text
    # an IPv6 address or a name (VLLM_HOST_IP may hold either): the listener takes IPv4 only
    for found in ("2001:db8::5", "prefill.example"):
        caplog.clear()
        monkeypatch.setattr(network_utils, "get_ip", lambda found=found: found)
        opts = Options.parse({})
        assert (opts.listen_host, opts.advertise_host) == ("127.0.0.1", "127.0.0.1")
        assert "not an IPv4 address" in caplog.text
