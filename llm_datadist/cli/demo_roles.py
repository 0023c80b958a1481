"""``demo --role decode|prefill``: the demo's workload between two hosts.

One side per host, each in this process (one engine, no cluster processes): the decode side
(cluster 2) listens on ``--listen``, the prefill side (cluster 1) links to it at ``--peer``; the
link is authenticated with the secret in ``--secret-file``, which both sides share. The workload
is the demo's (``demo.py``): the same caches, block tables, data, transfers and checks, with the
two sides' work split between the hosts. The sides speak over the link in notifications
(``two_hosts``), JSON objects whose field ``demo`` names their kind:

1. ``hello`` (prefill -> decode): the protocol version and the prefill's workload flags
   (``WORKLOAD_FLAGS``); the decode answers with its own. Each side checks the other's strictly
   and compares them with its own: a difference ends both sides with the same one line naming the
   flags that differ (exit 2).
2. ``ready`` (both ways): this side's cache is allocated (the prefill's filled); the side that
   issues the transfers (the prefill pushes; with ``--pull`` the decode pulls) starts once the
   other is ready.
3. ``latencies`` (one or more, a chunk of per-request nanoseconds each) and ``moved`` (the data
   plane used), from the issuer to the other side, so both report the same transfer.
4. ``verdict`` (decode -> prefill): the decode has checked every byte of every block and that its
   spare blocks are untouched; the first ``REPORTED_FAILURES`` failures of each kind and their
   counts. Both sides exit 0 when verified, 1 when not.

The prefill then unlinks; the decode waits for that (briefly) and both close. Meanwhile each side
sends ``alive`` every second, and a side that stops on an error tells the other why (``abort``).
A side waiting for its peer gives up after ``--timeout`` seconds without a word from it, at once
when the link ends; the same deadline bounds each transfer call and the first link.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional

from llm_datadist.cli.console import Progress, count, format_size
from llm_datadist.cli.demo import (
    DECODE_ID, PREFILL_ID, REPORTED_FAILURES, Batch, BatchShape, DemoError, Geometry, batch_shape, check_budget,
    check_data_plane, check_plane_carries, choose_device, corrupt, fill_request, latency_summary, make_batch,
    plane_to, side_setup, staging_blocks, transfer_request, verify_request, verify_untouched, workload_lines,
)
from llm_datadist.cli.two_hosts import (
    CLOSING_WAIT_S, DEFAULT_TIMEOUT_S, Heartbeat, PeerAborted, PeerChannel, PeerClosed, TwoHostError, check_fields,
    check_role_flags, heartbeat_interval, is_int, link_to, read_secret_file, receive_ints, resolve, send_ints,
    text_field,
)

ROLES = ("prefill", "decode")
#: The field naming a message's kind, and the version of the messages below.
KEY = "demo"
PROTOCOL = 1
KINDS = ("hello", "ready", "latencies", "moved", "verdict")
#: The flags both sides must agree on (argparse's names).
WORKLOAD_FLAGS = ("layers", "block_size", "kv_heads", "head_dim", "requests", "tokens", "seed", "pull")
_FLAG_CHECKS = {name: (lambda v: is_int(v, 1)) for name in WORKLOAD_FLAGS}
_FLAG_CHECKS.update(seed=lambda v: is_int(v, 0), pull=lambda v: type(v) is bool)
_PEER = {"prefill": "decode", "decode": "prefill"}
_ID = {"prefill": PREFILL_ID, "decode": DECODE_ID}


def check_args(args) -> Optional[str]:
    """What is wrong with the combination of ``args``' two-host flags, or None."""
    problem = check_role_flags(args, listening="decode", linking="prefill")
    if problem is not None or args.role is None:
        return problem
    if args.role == "prefill" and args.corrupt_block is not None:
        return "--corrupt-block acts where the bytes are checked: give it to the side with --role decode"
    return None


def workload_flags(args) -> Dict[str, object]:
    flags = {name: getattr(args, name) for name in WORKLOAD_FLAGS}
    flags["pull"] = bool(flags["pull"])
    return flags


def check_flags(flags, what: str) -> dict:
    """``flags`` if it is a well-formed set of workload flags, else ``TwoHostError``."""
    return check_fields(flags, what, _FLAG_CHECKS)


def differences(prefill: dict, decode: dict) -> str:
    """The workload flags that differ, each with both values; empty if none."""
    def show(value) -> str:
        return ("on" if value else "off") if isinstance(value, bool) else str(value)
    return ", ".join(f"--{name.replace('_', '-')} (prefill {show(prefill[name])}, decode {show(decode[name])})"
                     for name in WORKLOAD_FLAGS if prefill[name] != decode[name])


def mismatch(prefill: dict, decode: dict) -> None:
    """Raise the one line both sides print when their workload flags differ."""
    diff = differences(prefill, decode)
    if diff:
        raise DemoError(f"the workload flags of prefill and decode differ: {diff}; give both sides the same flags")


def _failure_checks(tensors: int) -> dict:
    layer = lambda v: is_int(v, 0, max(0, tensors // 2 - 1))  # noqa: E731
    return dict(layer=layer, kv=lambda v: v in ("K", "V"), decode_block=is_int, bytes_wrong=lambda v: is_int(v, 1),
                first_byte=is_int)


def check_verdict(message: dict, geometry: Geometry, batch: Batch) -> dict:
    """The decode's verdict, checked field by field (the prefill side prints it)."""
    what = "the decode's verdict"
    untouched = _failure_checks(geometry.num_tensors)
    failure = dict(untouched, request=lambda v: is_int(v, 0, len(batch.prefill_blocks) - 1), block=is_int,
                   got=lambda v: is_int(v, 0, 255), expected=lambda v: is_int(v, 0, 255))

    def entries(checks: dict):
        return lambda values: isinstance(values, list) and len(values) <= REPORTED_FAILURES and all(
            check_fields(value, f"an entry of {what}", checks) for value in values)
    descriptors = batch.total_blocks * geometry.num_tensors
    spare = len(batch.spare_decode_blocks()) * geometry.num_tensors
    check_fields(message, what, {KEY: lambda v: True, "failures": entries(failure), "untouched": entries(untouched),
                                 "failure_count": lambda v: is_int(v, 0, descriptors),
                                 "untouched_count": lambda v: is_int(v, 0, spare)})
    if message["failure_count"] < len(message["failures"]) or message["untouched_count"] < len(message["untouched"]):
        raise TwoHostError(f"{what} counts fewer failures than it lists")
    return message


@dataclass
class _Side:
    """This side's part of the run, from the arguments (nothing started)."""

    role: str
    geometry: Geometry
    shape: BatchShape
    batch: Batch
    staging: int
    asked_plane: str
    runtime: str
    runtime_why: str
    host_addressable: bool
    flags: dict
    timeout: float

    @property
    def peer(self) -> str:
        return _PEER[self.role]

    @property
    def peer_id(self) -> int:
        return _ID[self.peer]

    @property
    def cache_blocks(self) -> int:
        return self.batch.decode_cache_blocks if self.role == "decode" else self.batch.prefill_cache_blocks

    @property
    def issuer(self) -> bool:
        """Whether this side makes the transfer calls."""
        return (self.role == "decode") == self.flags["pull"]


def _prepare(args) -> _Side:
    geometry = Geometry(args.layers, args.block_size, args.kv_heads, args.head_dim)
    shape = batch_shape(args.requests, args.tokens, geometry.block_tokens)
    if args.corrupt_block is not None and not 0 <= args.corrupt_block < shape.total_blocks:
        raise DemoError(f"--corrupt-block {args.corrupt_block}: the batch has blocks 0..{shape.total_blocks - 1}")
    flags = workload_flags(args)
    try:
        check_flags(flags, "this side's workload flags")
    except TwoHostError:
        raise DemoError("with --role, every workload flag must be below 2**63") from None
    if args.plane is not None:
        os.environ["LLM_DATADIST_DATA_PLANE"] = args.plane
    asked_plane = check_data_plane()
    runtime, runtime_why, host_addressable = choose_device(args.device)
    check_plane_carries(asked_plane, host_addressable)
    check_budget(geometry, shape, caches_in_host_memory=host_addressable, sides=(args.role,))
    return _Side(args.role, geometry, shape, make_batch(shape, args.seed), staging_blocks(shape), asked_plane, runtime,
                 runtime_why, host_addressable, flags, args.timeout or DEFAULT_TIMEOUT_S)


def _start_engine(side: _Side, secret: str, listen: Optional[str]):
    """This side's ``LLMDataDist``, initialized (listening on ``listen`` if given)."""
    from llm_datadist import LLMConfig, LLMDataDist, LLMException, LLMRole
    dd = LLMDataDist(LLMRole.DECODER if side.role == "decode" else LLMRole.PROMPT, _ID[side.role])
    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.link_secret = secret
    if listen is not None:
        config.listen_ip_info = listen
    options = config.generate_options()
    per_block = side.geometry.block_bytes * side.geometry.num_tensors
    options["llm.SyncKvCacheWaitTime"] = str(max(1, int(side.timeout * 1000)))
    options["llm.MemPoolConfig"] = json.dumps({"memory_size": side.cache_blocks * per_block + (1 << 20)})
    try:
        dd.init(options)
    except LLMException as exc:
        where = f" on {listen}" if listen is not None else ""
        raise DemoError(f"could not start the {side.role} side{where}: {str(exc).split(' (status_code')[0]}") from None
    return dd


def run(args, out, note) -> dict:
    """Run this host's side (``args.role``) and return its report; ``DemoError`` when it cannot
    run. ``out(line)`` prints the report's lines, ``note(line)`` the lines a user must see even
    with ``--json`` (the decode's listening address)."""
    from llm_datadist import LLMException
    from llm_datadist.testing import ClusterState
    side = _prepare(args)
    try:
        secret = read_secret_file(args.secret_file)
        host, port = args.listen if side.role == "decode" else args.peer
        ip = resolve(host)
    except TwoHostError as exc:
        raise DemoError(str(exc)) from None
    dd = _start_engine(side, secret, f"{ip}:{port}" if side.role == "decode" else None)
    engine = dd.engine
    answers = {"hello": lambda message: _answer_hello(side, message)} if side.role == "decode" else {}
    channel = PeerChannel(engine, KEY, KINDS, side.peer, answers, peers={side.peer_id})
    linked = False
    try:
        engine.set_notify_handler(channel.handler)
        if side.role == "decode":
            ip, port = engine.listen_address
            note(f"listening: {ip}:{port} (decode, cluster {DECODE_ID}); waiting up to {side.timeout:g} s for the "
                 f"prefill to link")
            theirs = channel.wait("hello", side.timeout, "waiting for the prefill to link")["flags"]
            linked = True
            mismatch(theirs, side.flags)
            where = f"prefill (cluster {PREFILL_ID}) linked to decode (this host) at {ip}:{port}"
        else:
            link_to(engine, ip, port, side.timeout, DECODE_ID, "decode")
            linked = True
            channel.heard_from(DECODE_ID)
            mismatch(side.flags, _hello(channel, side))
            where = f"prefill (this host) linked to decode (cluster {DECODE_ID}) at {ip}:{port}"
        out(f"link:      {where}, authenticated with the secret of {args.secret_file}")
        with Heartbeat(engine, side.peer_id, KEY, heartbeat_interval(side.timeout), side.timeout):
            report = _work(side, ClusterState(_ID[side.role], dd=dd, cm=dd.cache_manager), engine, channel, args, out)
        if side.role == "prefill":
            engine.unlink_many([DECODE_ID], int(side.timeout * 1000), False)
        else:
            channel.wait_gone(PREFILL_ID, min(side.timeout, CLOSING_WAIT_S))
        return report
    except DemoError as exc:
        if not str(exc).startswith("the workload flags"):  # the peer found the same difference
            channel.abort(side.peer_id if linked else None, str(exc))
        raise
    except PeerAborted as exc:  # nothing to tell a peer that stopped
        raise DemoError(str(exc)) from None
    except TwoHostError as exc:
        channel.abort(side.peer_id if linked else None, str(exc))
        raise DemoError(str(exc)) from None
    except LLMException as exc:  # a transfer failed: because the peer left, if it did
        why = str(channel.peer_failure() or str(exc).split(" (status_code")[0])
        channel.abort(side.peer_id if linked else None, why)
        raise DemoError(why) from None
    except KeyboardInterrupt:
        channel.abort(side.peer_id if linked else None, "interrupted (Ctrl-C)")
        raise
    finally:
        engine.set_notify_handler(None)
        dd.finalize()


def _answer_hello(side: _Side, message: dict) -> dict:
    """The decode's answer to the prefill's hello (on the link's thread): its own flags."""
    check_fields(message, "the prefill's hello", {KEY: lambda v: True, "version": is_int, "flags": lambda v: True})
    if message["version"] != PROTOCOL:
        raise TwoHostError(f"the prefill speaks version {message['version']} of the demo's messages, the decode "
                           f"{PROTOCOL}: run the same llm_datadist on both hosts")
    check_flags(message["flags"], "the prefill's workload flags")
    return {"version": PROTOCOL, "flags": side.flags}


def _hello(channel: PeerChannel, side: _Side) -> dict:
    """The prefill's hello: send its flags, return the decode's (checked)."""
    reply = channel.send(DECODE_ID, {KEY: "hello", "version": PROTOCOL, "flags": side.flags}, side.timeout)
    check_fields(reply, "the decode's answer to the hello", {"version": is_int, "flags": lambda v: True})
    if reply["version"] != PROTOCOL:
        raise TwoHostError(f"the decode speaks version {reply['version']} of the demo's messages, the prefill "
                           f"{PROTOCOL}: run the same llm_datadist on both hosts")
    return check_flags(reply["flags"], "the decode's workload flags")


def _work(side: _Side, state, engine, channel: PeerChannel, args, out) -> dict:
    """Allocate, fill, move, check: this side's part of the demo, from the hello on."""
    batch, geometry, requests = side.batch, side.geometry, side.flags["requests"]
    pull, peer, timeout = side.flags["pull"], side.peer_id, side.timeout
    per_block = geometry.block_bytes * geometry.num_tensors
    for line in workload_lines(geometry, side.flags["tokens"], batch):
        out(line)
    out(f"caches:    {side.role} {count(side.cache_blocks, 'block')} ({format_size(side.cache_blocks * per_block)}) on "
        f"this host, DEVICE memory of the {side.runtime} runtime ({side.runtime_why})")
    progress = Progress(2 * requests + 1)
    try:
        progress.step("allocating the cache", 0)
        info = side_setup(state, geometry, side.cache_blocks, side.staging)
        if side.role == "prefill":
            for request, blocks in enumerate(batch.prefill_blocks):
                fill_request(state, geometry, args.seed, request, blocks)
                progress.step(f"prefill {request + 1}/{requests}")
        channel.send(peer, {KEY: "ready"}, timeout)
        channel.wait("ready", timeout, f"waiting for the {side.peer}'s cache")
        op = "pull_blocks" if pull else "push_blocks"
        if side.issuer:
            latencies: List[int] = []
            for request in range(requests):
                src, dst = batch.prefill_blocks[request], batch.decode_blocks[request]
                latencies.append(transfer_request(state, pull, peer, src, dst))
                progress.step(f"{op} {request + 1}/{requests}")
            plane = plane_to(state, peer, not side.host_addressable)
            send_ints(channel, peer, "latencies", latencies, timeout)
            channel.send(peer, {KEY: "moved", "plane": plane}, timeout)
        else:
            latencies = receive_ints(channel, "latencies", requests, timeout, f"waiting for the {side.peer}'s {op}")
            moved = channel.wait("moved", timeout, f"waiting for the {side.peer}'s {op}")
            plane = check_fields(moved, f"the {side.peer}'s moved message",
                                 {KEY: lambda v: True, "plane": _plane_name})["plane"]
        issuer = "decode" if pull else "prefill"
        mine = f"{side.role} (this host, pid {info['pid']})"
        theirs = f"{side.peer} (cluster {peer})"
        who = f"{mine} pulls from {theirs}" if pull and side.issuer else f"{theirs} pulls from {mine}" if pull else \
            f"{mine} pushes to {theirs}" if side.issuer else f"{theirs} pushes to {mine}"
        asked = f"asked: {side.asked_plane}" if side.issuer else f"chosen by the {issuer}"
        protected = state.dd.engine.link_protection(peer)
        out(f"transfer:  {who} with {op}, one call per request, data plane {plane} ({asked})"
            + ("" if protected == "off" else f", link protection {protected}"))
        progress.step("verifying", 0)
        if side.role == "decode":
            verdict = _verify(side, state, args.corrupt_block, progress)
            try:
                channel.send(peer, verdict, timeout)
            except PeerClosed:
                # The prefill unlinks once it has taken the verdict, and only then (a prefill that
                # fails says so first: PeerAborted); its answer to the verdict can come after that.
                pass
        else:
            verdict = check_verdict(channel.wait("verdict", timeout, "waiting for the decode's verdict"), geometry,
                                    batch)
            progress.step("verified", requests)
    finally:
        progress.close()
    busy_s = sum(latencies) / 1e9
    moved = batch.total_blocks * per_block
    return dict(
        role=side.role, peer=f"{args.peer[0]}:{args.peer[1]}" if side.role == "prefill" else None, pid=os.getpid(),
        geometry=dict(layers=geometry.layers, block_tokens=geometry.block_tokens, kv_heads=geometry.kv_heads,
                      head_dim=geometry.head_dim),
        requests=requests, tokens_per_request=side.flags["tokens"], blocks_per_request=len(batch.prefill_blocks[0]),
        blocks=batch.total_blocks, tensors=geometry.num_tensors, descriptors=batch.total_blocks * geometry.num_tensors,
        bytes=moved, bytes_per_request=len(batch.prefill_blocks[0]) * per_block, operation=op, issuer=issuer,
        data_plane=plane, data_plane_asked=side.asked_plane if side.issuer else None, link_protection=protected,
        device_runtime=side.runtime, device_runtime_reason=side.runtime_why,
        device_host_addressable=side.host_addressable, staging_blocks=side.staging,
        transfer_seconds=busy_s, gbps=moved / busy_s / 1e9 if busy_s else 0.0,
        latency_ms=latency_summary([ns / 1e6 for ns in latencies]),
        spare_decode_blocks=len(batch.spare_decode_blocks()), corrupted_block=args.corrupt_block,
        failures=verdict["failures"], failure_count=verdict["failure_count"],
        untouched_failures=verdict["untouched"], untouched_count=verdict["untouched_count"],
        checked_by=None if side.role == "decode" else f"decode at {args.peer[0]}:{args.peer[1]}",
        verified=verdict["failure_count"] == 0 and verdict["untouched_count"] == 0)


def _plane_name(value) -> bool:
    from llm_datadist.transport import planes
    return text_field(value) and value in planes.names()


def _verify(side: _Side, state, corrupt_block: Optional[int], progress: Progress) -> dict:
    """The decode's check of every byte (after the self-test's flipped byte, if asked): its verdict."""
    batch = side.batch
    if corrupt_block is not None:
        request, block = batch.locate(corrupt_block)
        corrupt(state, batch.decode_blocks[request][block], 0)
    failures: List[dict] = []
    for request, blocks in enumerate(batch.decode_blocks):
        failures += verify_request(state, side.geometry, side.flags["seed"], request, blocks)
        progress.step(f"verify {request + 1}/{len(batch.decode_blocks)}")
    untouched = verify_untouched(state, batch.spare_decode_blocks())
    return {KEY: "verdict", "failures": failures[:REPORTED_FAILURES], "failure_count": len(failures),
            "untouched": untouched[:REPORTED_FAILURES], "untouched_count": len(untouched)}
