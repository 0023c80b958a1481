"""Prefill and decode engines on two "hosts" (issue 23, item 4): each in a network namespace of its
own, joined by a veth pair, with the connector's defaults. The prefill worker must listen on, and
advertise, the address other hosts reach (the namespace's veth address, found as vLLM finds its own:
the default route's source address), and the decode engine must pull the KV from there and decode
the baseline's greedy tokens. Between namespaces the link is a cross-host one, so ``auto`` takes
the ``tcp`` plane (``tests/transport/test_netns.py`` proves that choice for the library itself);
a second pair of engines does the same with ``data_plane: nixl`` over UCX TCP
(``LLM_DATADIST_NIXL_TCP=1``; needs NIXL: ``pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1``).

Needs root and ``ip netns`` (skipped otherwise) and vLLM (``pip install '.[vllm]'``). The
namespaces' default routes point at each other's veth end and nothing forwards beyond it: no
traffic leaves the pair.
"""

from __future__ import annotations

import math

import pytest
from netns_pairs import make_pair
from test_vllm import LINK_SECRET, Engine, close_all, delta, needs_vllm, prompts_of, write_model

pytestmark = needs_vllm

MAX_TOKENS = 8
PROMPTS = prompts_of([40, 75, 130], seed=31)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-hosts") / "model"
    write_model(path)
    return path


@pytest.fixture(scope="module")
def expected(plain_engine):
    """The baseline's greedy tokens of PROMPTS (a plain engine on this host: the session's, on the
    same weights, ``conftest.py``)."""
    return [o["token_ids"] for o in plain_engine.engine().generate(PROMPTS, MAX_TOKENS)]


def _nixl_missing() -> str:
    from importlib.util import find_spec
    return "" if find_spec("nixl") is not None else \
        "NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1)"


@needs_vllm
@pytest.mark.parametrize("plane", ["auto", "nixl"])
def test_engines_on_two_hosts_link_with_the_connectors_defaults(request, model, expected, tmp_path, plane):
    if plane == "nixl" and _nixl_missing():
        pytest.skip(_nixl_missing())
    pair = make_pair(request, default_route=True)
    engines = []
    request.addfinalizer(lambda: close_all(engines))
    # No listen_host, no advertise_host, no VLLM_HOST_IP: the defaults find the veth address.
    extra = {"link_secret": LINK_SECRET, **({"data_plane": "nixl"} if plane == "nixl" else {})}
    env = {"LLM_DATADIST_NIXL_TCP": "1"} if plane == "nixl" else {}
    prefill = Engine(model, "producer", tmp_path / "prefill.log", extra, env=env,
                     enter=("ip", "netns", "exec", pair.server_ns), unset=("VLLM_HOST_IP",))
    engines.append(prefill)
    decode = Engine(model, "consumer", tmp_path / "decode.log", extra, env=env,
                    enter=("ip", "netns", "exec", pair.client_ns), unset=("VLLM_HOST_IP",))
    engines.append(decode)
    prefill.wait_ready()
    decode.wait_ready()
    params = [o["kv_transfer_params"] for o in prefill.generate(PROMPTS, 1, [{"do_remote_decode": True}] * 3)]
    assert {p["remote_host"] for p in params} == {pair.server_ip}, params[0]
    before = decode.stats()["stats"]
    outputs = decode.generate(PROMPTS, MAX_TOKENS, params)
    assert [o["token_ids"] for o in outputs] == expected
    pulled = delta(decode.stats()["stats"], before)
    assert pulled["pulled_requests"] == len(PROMPTS) and pulled["failed_requests"] == 0
    assert pulled["pulled_blocks"] == sum(math.ceil(len(p) / 32) for p in PROMPTS)
