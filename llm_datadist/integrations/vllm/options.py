"""What ``kv_connector_extra_config`` may say, checked once at start (each key is in the table of
``docs/vllm.md``, "Configuration")."""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from llm_datadist.transport import auth
from llm_datadist.transport.planes import choices as plane_choices

logger = logging.getLogger(__package__)

#: Where the links' shared secret comes from when the extra config names none (the library reads
#: it there too).
LINK_SECRET_ENV = auth.SECRET_ENV


@dataclass
class Options:
    listen_host: str = ""  # "": this host's routable address (``routable_host``)
    advertise_host: str = ""
    listen_port: int = 0
    cluster_id: Optional[int] = None
    data_plane: str = "auto"
    sync_kv_timeout_ms: int = 30000
    link_timeout_ms: int = 10000
    kv_lease_s: float = 30.0
    link_secret: Optional[str] = field(default=None, repr=False)
    lease_tokens: bool = True
    release_records_bytes: int = 16 << 20
    model_id: Optional[str] = None
    link_idle_s: float = 300.0
    transfer_mode: str = "pull"  # or "push" (``push``)
    push_match_by_request_id: bool = False  # push mode: match registrations without a lease token by base id
    # multi-turn (NixlConnector's names and defaults: ``bidirectional``): a decode engine holds a
    # finished request's blocks for the next turn's prefill, which pulls a held prefix longer than
    # kv_recompute_threshold tokens
    bidirectional_kv_xfer: bool = False
    kv_recompute_threshold: int = 64
    decoder_kv_blocks_ttl: float = 480.0

    @classmethod
    def parse(cls, extra: Optional[Dict[str, Any]]) -> "Options":
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
        if opts.transfer_mode not in ("pull", "push"):
            raise ValueError("LLMDataDistConnector: transfer_mode must be 'pull' or 'push', got "
                             f"{opts.transfer_mode!r}")
        for name in ("lease_tokens", "push_match_by_request_id", "bidirectional_kv_xfer"):
            if not isinstance(getattr(opts, name), bool):
                raise ValueError(f"LLMDataDistConnector: {name} must be true or false, got {getattr(opts, name)!r}")
        if isinstance(opts.release_records_bytes, bool) or not isinstance(opts.release_records_bytes, int) or \
                opts.release_records_bytes < 0:
            raise ValueError("LLMDataDistConnector: release_records_bytes must be a byte count >= 0, "
                             f"got {opts.release_records_bytes!r}")
        if opts.model_id is not None and (not isinstance(opts.model_id, str) or not opts.model_id):
            raise ValueError(f"LLMDataDistConnector: model_id must be a non-empty string, got {opts.model_id!r}")
        threshold = opts.kv_recompute_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError("LLMDataDistConnector: kv_recompute_threshold must be a token count >= 0, got "
                             f"{threshold!r}")
        if opts.bidirectional_kv_xfer and opts.transfer_mode == "push":
            raise NotImplementedError("LLMDataDistConnector: bidirectional_kv_xfer is not supported in push mode "
                                      "(as NixlConnector's); use transfer_mode 'pull'")
        for name in ("kv_lease_s", "link_idle_s", "decoder_kv_blocks_ttl"):
            value = getattr(opts, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"LLMDataDistConnector: {name} must be a number of seconds > 0, got {value!r}")
        source = "link_secret"
        if opts.link_secret is None:
            opts.link_secret, source = os.environ.get(LINK_SECRET_ENV) or None, LINK_SECRET_ENV
        elif not isinstance(opts.link_secret, str) or not opts.link_secret:
            # (the value itself stays out of the message)
            raise ValueError("LLMDataDistConnector: link_secret must be a non-empty string")
        why = None if opts.link_secret is None else auth.secret_refusal(opts.link_secret, source)
        if why is not None:  # (the engine refuses it too, later and in the workers only)
            raise ValueError(f"LLMDataDistConnector: {why}")
        for name in ("listen_host", "advertise_host"):
            if not isinstance(getattr(opts, name), str):
                raise ValueError(f"LLMDataDistConnector: {name} must be an address, got {getattr(opts, name)!r}")
        if not opts.listen_host:
            opts.listen_host = routable_host()
        if not opts.advertise_host:
            opts.advertise_host = opts.listen_host
            if opts.listen_host in ANY_ADDRESS:
                opts.advertise_host = routable_host()
        return opts


#: Listen addresses that mean every interface (never advertised as such).
ANY_ADDRESS = ("0.0.0.0", "::")


def routable_host() -> str:
    """The address other hosts reach this one at, as vLLM finds it for its own processes:
    ``VLLM_HOST_IP`` if set, else the source address of this host's default route (a UDP socket
    is connected, which sends nothing); 127.0.0.1, with a warning, where there is no route."""
    import warnings

    from vllm.utils.network_utils import get_ip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vLLM's own warning names only its variables
        found = get_ip()
    if found in ANY_ADDRESS or not found:
        logger.warning("LLMDataDistConnector: this host has no route to other hosts (and VLLM_HOST_IP is not "
                       "set): listening on 127.0.0.1, so only engines on this host can pull; set listen_host "
                       "(and advertise_host) or VLLM_HOST_IP")
        return "127.0.0.1"
    try:
        ipv4 = ipaddress.ip_address(found).version == 4
    except ValueError:
        ipv4 = False
    if not ipv4:  # the listener takes IPv4 addresses (listen_ip_info is "IP:PORT")
        logger.warning("LLMDataDistConnector: this host's address for other hosts is %r, not an IPv4 address: "
                       "listening on 127.0.0.1, so only engines on this host can pull; set listen_host (and "
                       "advertise_host) to an IPv4 address", found[:64])
        return "127.0.0.1"
    return found

