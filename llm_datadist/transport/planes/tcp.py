"""``tcp``: frames on the link's connections (TCP, or Unix sockets on this host), the payload
scatter/gathered straight from and into cache memory. The side that owns the memory checks every
range against its own registry, and the registry generation the plan was made against, before a
byte moves (``transport.server``), so this plane is usable on every link: the fallback.

A push is ``PUSH(generation, descriptors, bytes) -> PUSH_DONE(status)``; a pull is
``PULL(generation, tag, descriptors) -> PULL_DATA(status, bytes)``, the tag the one the pulling
thread set (``read_guard.tagged``) for the owner's read guard. Transfers of ``PARALLEL_TCP_BYTES``
or more are split over the link's data connections, the extra shares on the link's workers.

``push`` and ``pull`` take the payload's mover: straight from and into memory the host addresses
(``HostPayload``, this plane's), or staged through bounce buffers for device memory (the
``staging`` plane's ``StagedPayload``).
"""

from __future__ import annotations

import socket
from functools import partial
from typing import Any, Dict, Optional, Tuple

from llm_datadist import _core, _io
from llm_datadist.transport import budgets
from llm_datadist.transport import deadline as dl
from llm_datadist.transport import wire
from llm_datadist.transport.errors import S, CopyFailed, StaleTable, fail
from llm_datadist.transport.planes import register
from llm_datadist.transport.planes.base import DataPlane
from llm_datadist.transport.read_guard import current_tag
from llm_datadist.transport.session import Channel

#: TCP transfers of at least this many bytes are split over the link's data connections.
PARALLEL_TCP_BYTES = 8 << 20


class HostPayload:
    """A frame's payload straight from and into memory the host addresses (this plane's). The
    ``share`` and ``steady`` of a staged payload's calls (``planes.staging.StagedPayload``) do
    not apply: no budget is held."""

    def send(self, fd: int, head: bytes, plan: Any, timeout_ms: int,
             share: Optional[budgets.Share] = None) -> Tuple[int, int]:
        return _io.send_plan(fd, head, plan, False, timeout_ms)

    def recv(self, fd: int, plan: Any, timeout_ms: int, share: Optional[budgets.Share] = None,
             steady: bool = False) -> Tuple[int, int, int]:
        return _io.recv_plan(fd, plan, False, timeout_ms)


HOST_PAYLOAD = HostPayload()


@register
class TcpPlane(DataPlane):
    name = "tcp"
    summary = "frames over the link's connections (loopback or the network)"
    auto_rank = 100
    fallback = True
    stripe_bytes = PARALLEL_TCP_BYTES
    stripes = 2

    @classmethod
    def probe(cls) -> Tuple[bool, str]:
        return probe_loopback()

    def accept(self, session, peer_facts: Dict[str, Any], deadline: float) -> Optional[str]:
        return None  # the peer serves frames on every link

    def transfer(self, session, table, plan, write: bool, deadline: float) -> None:
        self.frames(session, table, plan, write, deadline, HOST_PAYLOAD)

    def block_route(self, session, table, remote_layout, local_layout, write: bool, timeout_ms: int = -1,
                    on_broken=None):
        """A route on the link's first connection (``_io.TcpRoute``): the frames ``push`` /
        ``pull`` send, made and sent in one call; larger calls than ``frames`` sends on one
        connection decline."""
        channels = session.channels
        if session.closed or session.table is not table or not channels or channels[0].broken is not None:
            return None
        request, reply = (wire.OP_PUSH, wire.OP_PUSH_DONE) if write else (wire.OP_PULL, wire.OP_PULL_DATA)
        return _io.TcpRoute(session, table, channels[0], wire.pack_header(request, 0, 0), wire.pack_header(reply, 0, 0),
                            local_layout, remote_layout, write, timeout_ms,
                            PARALLEL_TCP_BYTES if len(channels) > 1 else 2**64 - 1, on_broken, current_tag)

    def frames(self, session, table, plan, write: bool, deadline: float, payload: HostPayload) -> None:
        """Move ``plan`` in PUSH or PULL frames whose payload ``payload`` sends and receives;
        large plans split over the link's connections."""
        generation = table.generation
        channels = session.channels
        # A pull carries the calling thread's tag (``read_guard.tagged``), read here: the
        # shares of a large one run on the link's workers.
        move = push if write else partial(pull, tag=current_tag())
        if plan.total_bytes < PARALLEL_TCP_BYTES or len(channels) < 2 or len(plan) < 2:
            channel = channels[0]
            if channel.broken is not None and len(channels) > 1:
                channel = next((c for c in channels if c.broken is None), channel)
            move(channel, plan, generation, dl.left_ms(deadline), payload)
            return
        # Large transfers: one share per connection.
        live = [c for c in channels if c.broken is None] or channels[:1]
        shares = _core.split_plan(plan, len(live))
        results = session.workers.map(lambda job: move(job[0], job[1], generation, dl.left_ms(deadline), payload),
                                      list(zip(live, shares)))
        errors = [r for r in results if isinstance(r, BaseException)]
        for exc in errors:
            if not isinstance(exc, StaleTable):
                raise exc
        if errors:
            raise errors[0]


def push(channel: Channel, plan, generation: int, timeout_ms: int, payload: HostPayload = HOST_PAYLOAD) -> None:
    """Send the plan's source bytes for the peer to write at the descriptors' destinations
    (planned against the peer's table of ``generation``)."""
    descs = _io.plan_to_wire(plan)
    deadline = dl.after(timeout_ms)
    with channel.lock:
        req_id = channel.next_request_id()
        head = (wire.pack_header(wire.OP_PUSH, req_id, 16 + len(descs) + plan.total_bytes)
                + wire.U64x2.pack(generation, len(descs)) + descs)
        try:
            st, _ = payload.send(channel.fd, head, plan, dl.left_ms(deadline), channel.shares.staging)
        except CopyFailed as exc:
            if not exc.in_step:  # the frame went out cut short
                raise channel.fault(S.LLM_LINK_FAILED, f"push: the source copy failed mid-frame ({exc})") from None
            raise fail(S.LLM_FAILED, f"push to {channel.peer_name}: the source copy failed: {exc}") from None
        if st != 0:
            raise channel.fault(st, "push")
        status, length = channel.read_reply(wire.OP_PUSH_DONE, req_id, deadline, "push")
        if length:
            raise channel.fault(S.LLM_LINK_FAILED, "push: reply with a payload")
    channel.refused(status, "push", "destination")


def pull(channel: Channel, plan, generation: int, timeout_ms: int, payload: HostPayload = HOST_PAYLOAD,
         tag: bytes = b"") -> None:
    """Ask the peer for the plan's source ranges and receive them into the destinations;
    ``tag`` is for the peer's read guard (``read_guard``)."""
    descs = _io.plan_to_wire(plan)
    deadline = dl.after(timeout_ms)
    with channel.lock:
        req_id = channel.next_request_id()
        st, _ = _io.send_bytes(channel.fd, wire.pack_header(wire.OP_PULL, req_id, 16 + len(tag) + len(descs))
                                   + wire.U64x2.pack(generation, len(tag)) + tag + descs, dl.left_ms(deadline))
        if st != 0:
            raise channel.fault(st, "pull")
        status, length = channel.read_reply(wire.OP_PULL_DATA, req_id, deadline, "pull")
        if status == 0 and length != plan.total_bytes:
            raise channel.fault(S.LLM_LINK_FAILED, f"pull: {length} bytes announced, {plan.total_bytes} asked")
        if status == 0:
            try:
                st, _, _ = payload.recv(channel.fd, plan, dl.left_ms(deadline), channel.shares.staging)
            except CopyFailed as exc:  # in step: the payload was read whole
                raise fail(S.LLM_FAILED, f"pull from {channel.peer_name}: the destination copy failed: {exc}") \
                    from None
            if st != 0:
                raise channel.fault(st, "pull")
        elif length:
            raise channel.fault(S.LLM_LINK_FAILED, "pull: refusal with a payload")
    channel.refused(status, "pull", "source")


def probe_loopback() -> Tuple[bool, str]:
    """A loopback TCP connection, one byte each way."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            server.settimeout(5)
            with socket.create_connection(server.getsockname(), timeout=5) as client:
                accepted, _ = server.accept()
                with accepted:
                    client.sendall(b"x")
                    if accepted.recv(1) != b"x":
                        return False, "a loopback connection did not deliver its byte"
        return True, "loopback connection made (any reachable listen_ip_info works)"
    except OSError as exc:
        return False, f"a loopback connection failed: {exc}"
