"""The two-sided links of one engine (``TwoSidedLinks``): the comms it made with
``LLMDataDist.link`` and those it is making (who may join, and where each member is reached:
``comms``).

A comm's links are ordinary links of the link table, each made for that one comm: this part
makes the ones to the members of lower rank (through ``link``), waits for those of higher rank,
and hears from the table when a link of a comm ends. Its state changes under the link table's
lock: a join's claim on an accepted link is decided with the link itself, and a comm fails as
the table forgets its link.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, Optional, Tuple

from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.transport import budgets
from llm_datadist.transport import deadline as dl
from llm_datadist.transport.comms import Comm, Join
from llm_datadist.transport.errors import S, fail, status_of
from llm_datadist.transport.listener import Listener
from llm_datadist.transport.session import Link
from llm_datadist.transport.settings import LinkSettings
from llm_datadist.transport.threads import Threads

logger = logging.getLogger("llm_datadist")

#: ``link(cluster_id, ip, port, timeout_ms, comm=, quiet=, rank=)``: make a link (``LinkManager.link``).
LinkFunction = Callable[..., LLMStatusCode]


class TwoSidedLinks:
    """The comms of one engine, under ``lock`` (the link table's). It is handed ``link`` and
    ``unlink`` (``LinkManager``'s), the link table's ``current(cluster_id)`` (its link to a
    cluster, or None) and ``forget_ended(cluster_id)`` (forget why a link ended),
    ``settle(cluster_id, deadline)`` (fetch a linked peer's table and choose its plane), and the
    ``listener`` that listens on a member's rank-table address while it joins."""

    def __init__(self, cluster_id: int, lock: threading.RLock, settings: LinkSettings, listener: Listener,
                 link: LinkFunction, unlink: Callable[[int, int, bool], LLMStatusCode],
                 current: Callable[[int], Optional[Link]], forget_ended: Callable[[int], None],
                 settle: Callable[[int, float], None]) -> None:
        self.cluster_id = cluster_id
        self._lock = lock
        self._settings = settings
        self._listener = listener
        self._link = link
        self._unlink = unlink
        self._current = current
        self._forget_ended = forget_ended
        self._settle = settle
        self._joining: Dict[Tuple[str, str], Join] = {}  # two-sided links being made, listening side
        #: The comms made, by comm id.
        self.comms: Dict[int, Comm] = {}
        self._next_comm_id = 1
        self._threads = Threads("llm_datadist-conn")  # the tables' exchange of a comm just made

    def new_comm(self, name: str, key: Tuple[str, str], members, me) -> Comm:
        with self._lock:
            comm = Comm(self._next_comm_id, name, key, list(members), me)
            self._next_comm_id += 1
        return comm

    def join(self, comm: Comm, timeout_ms: int) -> None:
        """Make the links of a two-sided link: listen for the members of higher rank, link to those
        of lower rank (retrying while they are not listening yet), and wait for every link; then
        fetch the tables in the background (``comm.status`` PREPARING -> OK or FAILED).
        ``LLMException(LLM_LINK_FAILED)`` if not every link is made within ``timeout_ms``, or if
        the join fails (``comms.Join.failed``: two links claimed one rank, or a link of the comm
        ended meanwhile); the comm's links made so far are unlinked then, so that the other
        members see theirs end and fail too."""
        deadline = dl.after(timeout_ms)
        higher = [m for m in comm.others if m.rank > comm.me.rank]
        lower = [m for m in comm.others if m.rank < comm.me.rank]
        listen_at = (comm.me.device_ip, comm.me.port) if higher else None
        join = Join({m.cluster_id: m.rank for m in higher})
        with self._lock:
            if comm.key in self._joining:
                raise fail(S.LLM_LINK_FAILED, f"this cluster is making the link {comm.name!r} already")
            taken = [m.cluster_id for m in comm.others
                     if (link := self._current(m.cluster_id)) is not None and not link.hung_up()]
            if taken:  # a link belongs to one comm (or to none): it proves no membership of this one
                raise fail(S.LLM_LINK_FAILED, f"cluster(s) {taken} of {comm.name!r} are linked already (by "
                                               f"link_clusters or another link()); unlink them first")
            self._joining[comm.key] = join
        try:
            if listen_at is not None:
                self._listener.open_extra(*listen_at)
                self._settings.warn_if_open(*listen_at)
        except BaseException:
            with self._lock:
                self._joining.pop(comm.key, None)
            raise
        try:
            for member in lower:
                status = S.LLM_LINK_FAILED
                while not dl.expired(deadline) and join.failed is None:
                    status = self._link(member.cluster_id, member.device_ip, member.port, max(1, dl.left_ms(deadline)),
                                        comm=comm.key, quiet=True, rank=comm.me.rank)
                    if status not in (S.LLM_LINK_FAILED, S.LLM_NOT_YET_LINK, S.LLM_ALREADY_LINK):
                        break
                    time.sleep(0.05)
                self._check_join(join)
                if status != S.LLM_SUCCESS:
                    raise fail(S.LLM_LINK_FAILED, f"cluster {member.cluster_id} (rank {member.rank}) at "
                                                   f"{member.device_ip}:{member.port} was not linked in time "
                                                   f"({status_of(status).name})")
            for member in higher:
                while not self._claimed(join, member.cluster_id):
                    self._check_join(join)
                    if dl.expired(deadline):
                        raise fail(S.LLM_LINK_FAILED, f"cluster {member.cluster_id} (rank {member.rank}) did not "
                                                       f"link to {comm.me.device_ip}:{comm.me.port} in time")
                    time.sleep(0.01)
            with self._lock:  # from here a link of the comm that ends fails comm.status instead
                self._check_join(join)
                del self._joining[comm.key]
                self.comms[comm.comm_id] = comm
        except BaseException:
            with self._lock:
                self._joining.pop(comm.key, None)
            for member in comm.others:  # links made for this comm go with it
                self._drop(member.cluster_id, comm.key)
            raise
        finally:
            if listen_at is not None:
                self._listener.close_extra(listen_at)
        self._threads.spawn(self._prepare, comm)

    @staticmethod
    def _check_join(join: Join) -> None:
        if join.failed is not None:
            raise fail(S.LLM_LINK_FAILED, join.failed)

    def _claimed(self, join: Join, cluster_id: int) -> bool:
        """Whether the member ``cluster_id`` has linked here for the join, with a request that
        claimed its rank (a link made for anything else does not count)."""
        with self._lock:
            peer = join.claimed.get(cluster_id)
            return peer is not None and peer.ready and self._current(cluster_id) is peer

    def joining(self, key: Tuple[str, str]) -> Optional[Join]:
        """The join of the comm ``key`` this cluster is making now, or None (lock held)."""
        return self._joining.get(key)

    def admit_member(self, join: Join, peer_id: int, rank: Optional[int]) -> Optional[str]:
        """Why a link request for a join, from ``peer_id`` claiming ``rank``, is refused (lock
        held); None if it may go on. A second request claiming a rank fails the join."""
        if join.failed is not None:
            return f"that link failed: {join.failed}"
        if peer_id not in join.expected or join.expected[peer_id] != rank:
            return f"cluster {peer_id} claims rank {rank}, not one of the higher ranks this cluster expects"
        if peer_id in join.claimed:
            join.failed = f"two links claimed rank {rank} (cluster {peer_id})"
            logger.error("cluster %d: %s; the link fails", self.cluster_id, join.failed)
            return join.failed
        return None

    def link_ended(self, peer: Link, why: str) -> None:
        """A link made for a two-sided link ended, not by this side (lock held). One that was not
        complete yet frees its rank; a complete one fails the join, or the comm's status."""
        if peer.comm is None:
            return
        join = self._joining.get(peer.comm)
        if join is not None and join.claimed.get(peer.cluster_id) is peer and not peer.ready:
            del join.claimed[peer.cluster_id]
            return
        if not peer.ready:
            return
        text = f"the link to cluster {peer.cluster_id} ended ({budgets.truncate_reason(why)})"  # a peer's words
        if join is not None and join.failed is None:
            join.failed = text
        for comm in self.comms.values():
            if comm.key == peer.comm and comm.status != "FAILED":
                logger.error("cluster %d: link %r failed: %s", self.cluster_id, comm.name, text)
                comm.status = "FAILED"

    def _prepare(self, comm: Comm) -> None:
        deadline = dl.after(self._settings.handshake_ms)
        try:
            for member in comm.others:
                self._settle(member.cluster_id, deadline)
            with self._lock:
                if comm.status == "PREPARING":  # FAILED is sticky
                    comm.status = "OK"
        except LLMException as exc:
            logger.error("cluster %d: link %r failed while exchanging cache tables: %s", self.cluster_id,
                         comm.name, exc)
            comm.status = "FAILED"

    def comm(self, comm_id: int) -> Comm:
        with self._lock:
            comm = self.comms.get(comm_id)
        if comm is None:
            raise LLMException(f"comm_id {comm_id} is not a link of this cluster", status_code=S.LLM_NOT_YET_LINK)
        return comm

    def leave(self, comm_id: int, timeout_ms: int) -> None:
        """Drop a two-sided link: its links (made for it, accepted or initiated) are unlinked."""
        comm = self.comm(comm_id)
        with self._lock:
            self.comms.pop(comm_id, None)
        for member in comm.others:
            self._drop(member.cluster_id, comm.key, timeout_ms)

    def _drop(self, cluster_id: int, key: Tuple[str, str], timeout_ms: int = 1000) -> None:
        """Unlink the link to ``cluster_id`` if it was made for the comm ``key`` (a link belongs to
        the one comm it was made for: ``link`` does not let another comm use it)."""
        peer = self._current(cluster_id)
        if peer is not None and peer.comm == key:
            self._unlink(cluster_id, timeout_ms, False)
        self._forget_ended(cluster_id)

    def join_threads(self) -> None:
        """Join the threads exchanging the tables of comms just made."""
        self._threads.join()
