"""Which KV memory the connector registers, on views vLLM itself builds (issue 22, item 1).

vLLM 0.32 allocates one backing buffer and hands each layer over as a 4-D ``[blocks, heads, tokens,
K+V]`` view strided as the resolved KV cache layout says (``allocate_kv_cache`` ->
``create_kv_cache_views``). These tests build those views with vLLM's own functions for every
layout, with and without a kernel-block split, on host memory: the layouts whose views are one
contiguous run per layer register and move block for block between two workers (compared with
vLLM's own grouping of kernel blocks, ``group_kernel_blocks``); the others are refused in one line
that names the fix. They also check that vLLM resolves the layout the connector asks for.

Issue 35, item 5: LBNHC (token-major blocks) is registered as its blocks and moves to and from
LBHNC engines head by head (``kv_layouts``). vLLM's CPU build cannot run an LBNHC engine: its
only attention backend for such models (``vllm/platforms/cpu.py:177-179``, CPU_ATTN) supports
LBHNC alone (``vllm/v1/attention/backends/cpu_attn.py:73-75``), and a ``VLLM_KV_CACHE_LAYOUT``
outside that set is an error (``vllm/v1/attention/backends/utils.py:328-334``); so the permuted
path is tested here, with vLLM's own views and two processes, not with live engines.

Needs vLLM (``pip install '.[vllm]'``); no engine is started.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_vllm import needs_vllm

pytestmark = needs_vllm

NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE = 6, 3, 16
PULLED = {3: 0, 1: 4, 5: 5}  # remote block -> local block


def _spec(mla: bool = False):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    if mla:  # one latent "head" holding the compressed KV
        return MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=24, dtype=torch.float16)
    return FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.float16)


def vllm_views(layout_name: str, kernel_block_size=None, mla: bool = False):
    """``(kv_caches, kv_cache_config)`` as vLLM's worker builds them: the tensors' strides from
    ``compute_layout_strides`` (what ``get_kv_cache_config_from_groups`` places), the views from
    ``allocate_kv_cache``."""
    import torch
    from vllm.v1.kv_cache_interface import (KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                            compute_layout_strides)
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    spec, layout = _spec(mla), KVCacheLayout[layout_name]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, NUM_LAYERS, layout)
    size = spec.page_size_bytes * NUM_BLOCKS * NUM_LAYERS
    config = KVCacheConfig(num_blocks=NUM_BLOCKS,
                           kv_cache_tensors=[KVCacheTensor(size=size, layers=names, layer_stride=layer_stride,
                                                           block_stride=block_stride)],
                           kv_cache_groups=[KVCacheGroupSpec(names, spec)], kv_cache_layout=layout.name)
    sizes = None if kernel_block_size is None else [kernel_block_size]
    return allocate_kv_cache(config, torch.device("cpu"), layout, sizes), config


def blocks_of(view):
    """One row per vLLM block, through vLLM's own grouping of kernel blocks, as raw bytes."""
    import torch
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    grouped = group_kernel_blocks(view, NUM_BLOCKS)
    return [grouped[b].contiguous().view(torch.uint8).flatten() for b in range(NUM_BLOCKS)]


def _worker(config):
    from llm_datadist.integrations.vllm.options import Options
    from llm_datadist.integrations.vllm.worker import Worker

    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_producer=False, is_kv_consumer=True))
    return Worker(vllm_config, "decode", Options.parse({}), config)


def _release_ok(peer_cluster_id, message):
    return {"request_id": message.get("request_id"), "released": True, "why": ""}


def _answering(said):
    """A prefill worker's notify handler that answers a link's hello with ``said`` (its compat
    description) and releases as ``_release_ok``."""
    def on_notify(peer_cluster_id, message):
        if isinstance(message, dict) and message.get("op") == "hello":
            return {"kv_compat": said, "compatible": True}
        return _release_ok(peer_cluster_id, message)
    return on_notify


def prefill_side(state, layout_name: str, kernel_block_size, mla: bool, seed: int, said=None) -> dict:
    """In the prefill engine's process (one llm_datadist engine per process): vLLM's views with
    seeded bytes, registered by the connector's layout code as its worker does (model 0, in place
    of the previous case's), releases answered as its worker does, a hello with ``said`` if given.
    Returns each layer's blocks (in vLLM's logical order)."""
    import torch

    import llm_datadist as ld
    from llm_datadist.integrations.vllm import layout

    kv, config = vllm_views(layout_name, kernel_block_size, mla)
    generator = torch.Generator().manual_seed(seed)
    for view in kv.values():
        raw = view.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    if "kv" in state.caches:
        state.cm.unregister_cache(state.caches.pop("kv").cache_id)
    tensors = layout.kv_tensors(kv, config.num_blocks, config.kv_cache_layout)
    state.caches["kv"] = state.cm.register_blocks_cache(layout.cache_desc(tensors), [t.data_ptr() for t in tensors],
                                                        ld.BlocksCacheKey(state.cluster_id, 0), True)
    state.scratch["kv"] = kv  # the memory stays alive while registered
    state.dd.engine.set_notify_handler(_release_ok if said is None else _answering(said))
    return {name: [block.numpy() for block in blocks_of(view)] for name, view in kv.items()}


@pytest.fixture(scope="module")
def prefill_engine():
    from llm_datadist.testing import Cluster

    with Cluster(51, role="PROMPT", listen=True, timeout=180) as cluster:
        yield cluster


REGISTERED = [("LBHNC", None, False), ("LBHNC", 8, False), ("LBHNC", 4, False), ("LBNHC", None, True)]
REFUSED = [("BLHNC", None), ("BLNHC", None), ("LHBNC", None), ("BHLNC", None)]


@pytest.mark.parametrize("layout_name, kernel_block_size, mla", REGISTERED)
def test_vllms_views_register_and_move_block_for_block(prefill_engine, layout_name, kernel_block_size, mla):
    """LBHNC (with 1, 2 or 4 kernel blocks per block; MLA under vLLM's default LBNHC): a decode
    worker pulls three blocks of a prefill engine, both registered from vLLM's views; each pulled
    logical block holds the prefill's bytes, every other block is untouched."""
    import numpy as np

    from llm_datadist.integrations.vllm.meta import Recv

    sent = prefill_engine.call(prefill_side, layout_name, kernel_block_size, mla, 7)
    decode_kv, config = vllm_views(layout_name, kernel_block_size, mla)
    split = 1 if kernel_block_size is None else BLOCK_SIZE // kernel_block_size
    assert all(view.shape[0] == NUM_BLOCKS * split for view in decode_kv.values())  # vLLM's view, as handed over
    decode = _worker(config)
    try:
        decode.register(decode_kv)
        desc = decode.cache.cache_desc
        assert desc.num_tensors == NUM_LAYERS and desc.placement.name == "HOST"
        assert list(desc.shape)[:2] == ([NUM_BLOCKS, split] if split > 1 else [NUM_BLOCKS, _spec(mla).num_heads])
        assert decode.cache.tensor_addrs == [v.data_ptr() for v in decode_kv.values()]  # registered where they are
        host, port = prefill_engine.address
        spec = Recv(list(PULLED.values()), list(PULLED), host, port, prefill_engine.cluster_id, "p1", awaiting=True)
        decode._pull("d1", spec)
        results = decode.results()
        assert results.finished_recving == {"d1"} and results.failed_recving == set(), decode.stats
        assert decode.stats["pulled_blocks"] == len(PULLED) and decode.stats["notified"] == 1
        for name, view in decode_kv.items():
            got = [block.numpy() for block in blocks_of(view)]
            assert all(block.nbytes == _spec(mla).page_size_bytes for block in got)
            for remote, local in PULLED.items():
                assert np.array_equal(got[local], sent[name][remote]), (name, remote, local)
            for local in set(range(NUM_BLOCKS)) - set(PULLED.values()):
                assert not got[local].any(), (name, local)
    finally:
        decode.close()


def said(layout_name: str) -> dict:
    """A prefill worker's description of its layout on the link (``kv_layouts.fields``)."""
    return {"kv_format": 2 if layout_name == "LBNHC" else 1, "kv_layout": layout_name, "kv_layout_pulls": True}


#: (prefill layout, decode layout, kernel block size), each side registered from vLLM's views
PERMUTED = [("LBNHC", "LBHNC", None), ("LBHNC", "LBNHC", None), ("LBNHC", "LBNHC", None), ("LBNHC", "LBHNC", 8)]


def test_permuted_layouts_move_head_by_head_and_lying_peers_are_refused(prefill_engine):
    """Issue 35, item 5. A decode worker of one layout pulls three blocks of a prefill engine of
    another (LBNHC <-> LBHNC, kernel blocks too) or of the same: each pulled block holds the
    prefill's KV in vLLM's logical order, every other block is untouched, and the bytes moved are
    the blocks'. A peer that lies is refused with nothing written: one whose blocks are smaller
    than the LBNHC layout it claims (the planner reads only its registered blocks), one that
    claims a layout that does not move, and an LBNHC one that does not say its layout (an older
    release's description)."""
    import numpy as np

    from llm_datadist.integrations.vllm.meta import Recv

    def pull(prefill_layout, decode_layout, kernel_block_size, claim, mla=False):
        sent = prefill_engine.call(prefill_side, prefill_layout, kernel_block_size, mla, 11, claim)
        decode_kv, config = vllm_views(decode_layout, kernel_block_size)
        decode = _worker(config)
        try:
            decode.register(decode_kv)
            assert decode.compat["kv_layout"] == decode_layout
            host, port = prefill_engine.address
            decode._pull("d1", Recv(list(PULLED.values()), list(PULLED), host, port, prefill_engine.cluster_id,
                                    "p1", awaiting=True))
            results = decode.results()
            got = {name: [block.numpy() for block in blocks_of(view)] for name, view in decode_kv.items()}
            return sent, got, results, dict(decode.stats), decode.take_stats()
        finally:
            decode.close()

    for prefill_layout, decode_layout, kernel_block_size in PERMUTED:
        case = (prefill_layout, decode_layout, kernel_block_size)
        sent, got, results, stats, metrics = pull(*case, said(prefill_layout))
        assert results.finished_recving == {"d1"} and results.failed_recving == set(), (case, stats)
        assert stats["pulled_blocks"] == len(PULLED), case
        assert metrics.data["pull_bytes"] == [len(PULLED) * NUM_LAYERS * _spec().page_size_bytes], case
        for name in got:
            for remote, local in PULLED.items():
                assert np.array_equal(got[name][local], sent[name][remote]), (case, name, remote, local)
            for local in set(range(NUM_BLOCKS)) - set(PULLED.values()):
                assert not got[name][local].any(), (case, name, local)

    lies = [("MLA blocks of 768 bytes claimed as LBNHC", said("LBNHC"), True),
            ("a layout that does not move", dict(said("LBNHC"), kv_layout="BLHNC"), False),
            ("an LBNHC engine that does not say so", {"kv_format": 2}, False)]
    for what, claim, mla in lies:
        _, got, results, stats, _ = pull("LBNHC", "LBHNC", None, claim, mla)
        assert results.failed_recving == {"d1"} and stats["pulled_blocks"] == 0, (what, stats)
        assert stats["notified"] == 1, what  # (the prefill side is still told to free its blocks)
        assert not any(block.any() for blocks in got.values() for block in blocks), what


@pytest.mark.parametrize("layout_name, kernel_block_size", REFUSED)
def test_other_layouts_are_refused_in_one_line_naming_the_fix(layout_name, kernel_block_size):
    kv, config = vllm_views(layout_name, kernel_block_size)
    worker = _worker(config)
    try:
        with pytest.raises(NotImplementedError) as info:
            worker.register(kv)
        message = str(info.value)
        assert "\n" not in message and worker.cache is None
        assert "layer model.layers.0.self_attn.attn's KV cache is not one contiguous run of blocks" in message
        assert f"vLLM KV cache layout {layout_name})" in message
        assert "the connector moves LBHNC and LBNHC" in message
        assert "unset VLLM_KV_CACHE_LAYOUT (or set it to LBHNC)" in message
    finally:
        worker.close()


def test_views_of_another_block_count_are_refused():
    from llm_datadist.integrations.vllm.layout import kv_tensors

    kv, _ = vllm_views("LBHNC")
    with pytest.raises(NotImplementedError, match=r"has shape \(6, 2, 16, 16\); expected 4 blocks \(or a multiple"):
        kv_tensors(kv, 4)
    assert [tuple(t.shape) for t in kv_tensors(kv, 3)] == [(3, 2, 2, 16, 16)] * NUM_LAYERS  # 6 = 3 x 2


def test_vllm_resolves_the_layout_the_connector_asks_for(monkeypatch):
    """With no attention backend declaring layouts (FlashAttention), vLLM's default is LBNHC; with
    this connector configured it resolves LBHNC, and leaves MLA models to the default."""
    from vllm.config import CacheConfig, KVTransferConfig
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout

    from llm_datadist.integrations.vllm import LLMDataDistConnector

    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    supported = [[layout.name for layout in get_supported_kv_cache_layouts([])]]  # no backend declares
    assert supported[0][0] == "LBNHC"
    transfer = KVTransferConfig(kv_connector="LLMDataDistConnector", kv_role="kv_consumer",
                                kv_connector_module_path="llm_datadist.integrations.vllm")

    def resolved(mla: bool, transfer=transfer) -> str:
        config = SimpleNamespace(cache_config=CacheConfig(), kv_transfer_config=transfer,
                                 model_config=SimpleNamespace(use_mla=mla))
        return resolve_kv_cache_layout(config, supported, [_spec(mla)]).name

    assert resolved(False) == "LBHNC"
    assert resolved(True) == "LBNHC"
    assert resolved(False, transfer=None) == "LBNHC"  # without the connector: vLLM's default
    assert LLMDataDistConnector.get_required_kvcache_layout(SimpleNamespace(model_config=None)) is None


def test_kv_layouts_that_differ_move_only_where_a_pull_permutes_them():
    """The link's check (``compat.verdict``): LBNHC and LBHNC engines that both pull, of one TP and
    block size, are compatible; push mode, other TP or block sizes, a layout that does not move,
    and an older release's description against an LBNHC engine are refused naming the field."""
    from llm_datadist.integrations.vllm import compat, kv_layouts

    mine = dict(said("LBHNC"), tp_size=1, block_size=16)
    token_major = dict(mine, **said("LBNHC"))
    assert compat.verdict(mine, dict(mine)) is None and compat.verdict(token_major, dict(token_major)) is None
    assert compat.verdict(mine, token_major) is None and compat.verdict(token_major, mine) is None
    for other, field in [(dict(token_major, kv_layout_pulls=False), "kv_layout 'LBNHC' there, 'LBHNC' here"),
                         (dict(token_major, tp_size=2), "kv_layout 'LBNHC' there"),
                         (dict(token_major, block_size=32), "kv_layout 'LBNHC' there"),
                         (dict(mine, kv_layout="BLHNC"), "kv_layout 'BLHNC' there"),
                         ({"kv_format": 1, "tp_size": 1, "block_size": 16}, None)]:
        why = compat.verdict(token_major if field is None else mine, other)
        assert why is not None and (field or "kv_format 1 there, 2 here") in why, (other, why)
    # (the pull's own check, whatever the link said)
    assert kv_layouts.refusal("LBHNC", "LBHNC", True, False) == ""
    assert "where both KV cache layouts are LBHNC" in kv_layouts.refusal("LBNHC", "LBNHC", True, False)
    assert "tensor parallel sizes" in kv_layouts.refusal("LBHNC", "LBNHC", False, True)
    assert "'XYZ' is none this connector moves" in kv_layouts.refusal("LBHNC", "XYZ", False, False)


def test_vllms_cpu_build_runs_no_permuted_layout(monkeypatch):
    """Why no live engine tests LBNHC here: the CPU attention backend supports LBHNC alone, and vLLM
    refuses a ``VLLM_KV_CACHE_LAYOUT`` outside that set (the lines the module docstring names)."""
    from vllm.config import CacheConfig
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout

    supported = [[layout.name for layout in get_supported_kv_cache_layouts([CPUAttentionBackend])]]
    assert supported == [["LBHNC"]]
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBNHC")
    config = SimpleNamespace(cache_config=CacheConfig(), kv_transfer_config=None, model_config=None)
    with pytest.raises(ValueError, match="VLLM_KV_CACHE_LAYOUT=LBNHC does not satisfy every supported set"):
        resolve_kv_cache_layout(config, supported, [_spec()])
