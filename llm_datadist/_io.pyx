# cython: language_level=3, embedsignature=True
"""Data-plane executors: move a plan's bytes between processes with the GIL released.

* same host: ``process_vm_writev`` / ``process_vm_readv`` with up to IOV_MAX iovecs a call;
* TCP: a frame head and the plan's ranges sent with one ``sendmsg`` scatter/gather list, and
  payload received with ``recvmsg`` straight into the destination ranges.

Every function takes a timeout in milliseconds (-1 = none), works on non-blocking sockets (it
polls), and returns a status code from ``dd_status.h`` instead of raising, so the caller decides
what a failure means for its link. ``RangeSet`` is the receiver-side check: every range a peer
names must lie inside memory this process registered.
"""

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t, UINT64_MAX
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy
from posix.uio cimport iovec
from posix.unistd cimport close

from llm_datadist cimport _status
from llm_datadist._core cimport CacheLayout, CopyPlan
from llm_datadist._os cimport (
    CLOCK_MONOTONIC, EAGAIN, ECONNRESET, EFAULT, EINTR, ENOSYS, EPERM, EPIPE, ESRCH,
    EWOULDBLOCK, IOV_MAX, MSG_NOSIGNAL, POLLIN, POLLOUT, clock_gettime, errno, msghdr, poll,
    pollfd, process_vm_readv, process_vm_writev, recvmsg, sendmsg, setsockopt, SO_RCVLOWAT,
    SOL_SOCKET, timespec,
)
from llm_datadist._runtime cimport dd_copy_desc

import operator

cdef extern from *:
    """
    static inline uint64_t dd_load_acquire_u64(const void *p) {
        return __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE);
    }
    """
    uint64_t dd_load_acquire_u64(const void *p) noexcept nogil

#: Status codes returned by the executors (values from dd_status.h).
SUCCESS = _status.DD_LLM_SUCCESS
FAILED = _status.DD_LLM_FAILED
LINK_FAILED = _status.DD_LLM_LINK_FAILED
TIMEOUT = _status.DD_LLM_TIMEOUT
PARAM_INVALID = _status.DD_LLM_PARAM_INVALID
FEATURE_NOT_ENABLED = _status.DD_LLM_FEATURE_NOT_ENABLED

#: Most iovecs one system call takes.
MAX_IOVECS = IOV_MAX
#: Bytes of one wire descriptor (``src, dst, nbytes`` as little-endian uint64).
WIRE_DESC_BYTES = sizeof(dd_copy_desc)

cdef size_t _BATCH = IOV_MAX
_ADDRESS_SPACE = 2**64
# Bytes a waiting receiver asks the kernel to gather before waking it (SO_RCVLOWAT); 0 = off.
cdef int _recv_lowat = 0
# Streams with less than this left wake on any data (a small frame lands in one segment anyway).
cdef uint64_t _LOWAT_FLOOR = 64 * 1024


def set_recv_lowat(int nbytes):
    """While a stream receive waits for data, wake it only once ``nbytes`` (or the rest of the
    stream, if less) are queued: fewer wake-ups and larger copies per call. 0 turns it off.
    Keep it well under the receive buffer."""
    global _recv_lowat
    if nbytes < 0:
        raise ValueError("low-watermark must be >= 0")
    _recv_lowat = nbytes


def get_recv_lowat():
    return _recv_lowat


# Nanoseconds a receive that finds no data polls without sleeping before it blocks in poll(2).
cdef int64_t _spin_ns = 0
# Most a spin may be set to (a spin is CPU time burnt per wait).
cdef int64_t _SPIN_MAX_NS = 10 * 1000 * 1000


def set_spin_us(int us):
    """While a socket receive waits for data, poll it without sleeping for up to ``us``
    microseconds before blocking: a reply or next frame that comes within that time is taken
    without the wake-up of a sleeping thread (tens of microseconds on a VM). 0 turns it off;
    at most 10,000. Each wait that ends in a sleep burns up to ``us`` of CPU first."""
    global _spin_ns
    if us < 0 or <int64_t>us * 1000 > _SPIN_MAX_NS:
        raise ValueError(f"spin must be 0 to {_SPIN_MAX_NS // 1000} microseconds, not {us}")
    _spin_ns = <int64_t>us * 1000


def get_spin_us():
    return _spin_ns // 1000


# Whether spinning pays here and now: shared by the process's threads (a heuristic: a lost update
# between threads only shifts it a little). A spin that catches its data earns a point (up to
# _CREDIT_MAX), one that ends empty loses _MISS_COST (down to 0); at 0, waits block at once but for
# one in _PROBE_EVERY, which spins to see whether it pays again (a catch turns spinning back on).
# On an idle or lightly loaded host replies come within the spin and it stays on; on an
# oversubscribed one, where a spinning thread takes the CPU the peer needs to answer, misses turn
# it off.
cdef int _spin_credit = 8
cdef enum:
    _CREDIT_MAX = 16
    _MISS_COST = 4
    _PROBE_EVERY = 64
cdef unsigned int _spin_waits = 0
cdef uint64_t _spin_hits = 0, _spin_misses = 0, _spin_skipped = 0

# What a receive waits for, which says what its spin's outcome tells: SPIN_REPLY, the answer to
# something this side just sent (how fast the host lets the peer answer); SPIN_REQUEST, a peer's
# next request on a connection this side serves (whether the peer sends back to back: an idle
# link's misses turn these spins off, and say nothing of replies); SPIN_OFF, no spin (a handshake,
# answered from Python: a spin there would only burn CPU). Each of the two kinds keeps its own
# credit and probe count, so that neither turns the other off: before, the misses of a link's
# handshakes and of its new serving threads turned every spin of the process off at each link,
# and the two sides' probes then missed each other, the peer asleep.
SPIN_OFF, SPIN_REPLY, SPIN_REQUEST = 0, 1, 2
cdef enum:
    _SPIN_OFF = 0
    _SPIN_REPLY = 1
    _SPIN_REQUEST = 2
cdef int _request_credit = 8
cdef unsigned int _request_waits = 0


def spin_stats():
    """``(hits, misses, skipped)``: receive waits whose spin caught the data, whose spin ended
    empty, and that did not spin because spinning had stopped paying (process-wide counts)."""
    return _spin_hits, _spin_misses, _spin_skipped


cdef inline int64_t _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef inline int64_t _deadline(int timeout_ms) noexcept nogil:
    if timeout_ms < 0:
        return -1
    return _now_ns() + <int64_t>timeout_ms * 1000000


cdef inline int _remaining_ms(int64_t deadline) noexcept nogil:
    # -1 = wait forever; 0 = expired (poll returns at once).
    cdef int64_t left
    if deadline < 0:
        return -1
    left = deadline - _now_ns()
    if left <= 0:
        return 0
    return <int>((left + 999999) // 1000000)


cdef inline unsigned int _errno_status(int err) noexcept nogil:
    if err == ESRCH or err == EPIPE or err == ECONNRESET:
        return _status.DD_LLM_LINK_FAILED
    if err == EPERM or err == ENOSYS:
        return _status.DD_LLM_FEATURE_NOT_ENABLED
    if err == EFAULT:
        return _status.DD_LLM_PARAM_INVALID
    return _status.DD_LLM_FAILED


cdef inline void _advance(iovec *iov, size_t *first, size_t count, size_t done) noexcept nogil:
    # Skip ``done`` bytes from iov[first[0]]: whole entries first, then part of one.
    while done > 0 and first[0] < count:
        if done >= iov[first[0]].iov_len:
            done -= iov[first[0]].iov_len
            first[0] += 1
        else:
            iov[first[0]].iov_base = <char *>iov[first[0]].iov_base + done
            iov[first[0]].iov_len -= done
            done = 0
    while first[0] < count and iov[first[0]].iov_len == 0:
        first[0] += 1


# ------------------------------------------------------------------------------------------------
# Same host: cross-memory attach
# ------------------------------------------------------------------------------------------------

cdef inline bint _exited(int pidfd) noexcept nogil:
    # A pidfd turns readable when its process exits (an error also counts as gone); -1 = no pidfd.
    cdef pollfd fd
    if pidfd < 0:
        return False
    fd.fd = pidfd
    fd.events = POLLIN
    fd.revents = 0
    return poll(&fd, 1, 0) != 0


cdef unsigned int _cma_batch(int pid, iovec *local, iovec *remote, size_t count, bint write,
                             int *err) noexcept nogil:
    # Local and remote iovecs are paired one to one (same lengths), so a partial transfer
    # (the kernel stops at the first iovec it cannot reach) advances both lists alike.
    cdef size_t lfirst = 0, rfirst = 0
    cdef ssize_t n
    while lfirst < count:
        if write:
            n = process_vm_writev(pid, local + lfirst, count - lfirst, remote + rfirst,
                                  count - rfirst, 0)
        else:
            n = process_vm_readv(pid, local + lfirst, count - lfirst, remote + rfirst,
                                 count - rfirst, 0)
        if n < 0:
            if errno == EINTR:
                continue
            err[0] = errno
            return _errno_status(errno)
        if n == 0:
            err[0] = EFAULT
            return _status.DD_LLM_PARAM_INVALID
        _advance(local, &lfirst, count, <size_t>n)
        _advance(remote, &rfirst, count, <size_t>n)
    return _status.DD_LLM_SUCCESS


def cma_copy(int pid, CopyPlan plan not None, bint write, int timeout_ms=-1, int pidfd=-1):
    """Run ``plan`` against process ``pid``: ``write`` copies local ``src`` ranges into the
    peer's ``dst`` ranges (process_vm_writev), otherwise the peer's ``src`` ranges are read into
    local ``dst`` ranges (process_vm_readv). IOV_MAX descriptors per system call; the timeout is
    checked between calls. With ``pidfd`` (a pidfd of the peer), a peer that has exited is
    reported as ``LINK_FAILED`` before any byte moves, so a recycled pid is never written to.
    Returns ``(status, errno)``."""
    cdef iovec *local = NULL
    cdef iovec *remote = NULL
    cdef size_t start = 0, count, i
    cdef unsigned int status = _status.DD_LLM_SUCCESS
    cdef int err = 0
    cdef int64_t deadline = _deadline(timeout_ms)
    cdef const dd_copy_desc *d = plan.descs
    if plan.count == 0:
        return SUCCESS, 0
    cdef size_t batch = plan.count if plan.count < _BATCH else _BATCH
    if _exited(pidfd):
        return LINK_FAILED, ESRCH
    local = <iovec *>malloc(2 * batch * sizeof(iovec))
    if local == NULL:
        raise MemoryError()
    remote = local + batch
    with nogil:
        while start < plan.count:
            count = plan.count - start
            if count > batch:
                count = batch
            for i in range(count):
                if write:
                    local[i].iov_base = <void *>d[start + i].src
                    remote[i].iov_base = <void *>d[start + i].dst
                else:
                    local[i].iov_base = <void *>d[start + i].dst
                    remote[i].iov_base = <void *>d[start + i].src
                local[i].iov_len = d[start + i].nbytes
                remote[i].iov_len = d[start + i].nbytes
            status = _cma_batch(pid, local, remote, count, write, &err)
            if status != _status.DD_LLM_SUCCESS:
                break
            start += count
            if start < plan.count and deadline >= 0 and _now_ns() > deadline:
                status = _status.DD_LLM_TIMEOUT
                break
    free(local)
    return status, err


def cma_read_bytes(int pid, uint64_t addr, uint64_t nbytes):
    """Read ``nbytes`` at ``addr`` of process ``pid`` (the link-time probe and generation word).
    Returns ``(status, errno, data)``."""
    cdef bytearray out = bytearray(nbytes)
    cdef iovec local, remote
    cdef unsigned int status
    cdef int err = 0
    if nbytes == 0:
        return SUCCESS, 0, bytes(out)
    local.iov_base = <void *><char *>out
    local.iov_len = nbytes
    remote.iov_base = <void *>addr
    remote.iov_len = nbytes
    with nogil:
        status = _cma_batch(pid, &local, &remote, 1, False, &err)
    return status, err, bytes(out)


def cma_read_u64(int pid, uint64_t addr):
    """Read one 64-bit word of process ``pid``. Returns ``(status, errno, value)``."""
    cdef uint64_t value = 0
    cdef iovec local, remote
    cdef unsigned int status
    cdef int err = 0
    local.iov_base = &value
    local.iov_len = 8
    remote.iov_base = <void *>addr
    remote.iov_len = 8
    with nogil:
        status = _cma_batch(pid, &local, &remote, 1, False, &err)
    return status, err, value


cdef class Word:
    """A 64-bit word in this process's memory, readable by same-host peers (the registry
    generation counter and the link probe cookie)."""

    cdef uint64_t *ptr

    def __cinit__(self, uint64_t value=0):
        self.ptr = <uint64_t *>malloc(64)
        if self.ptr == NULL:
            raise MemoryError()
        self.ptr[0] = value

    def __dealloc__(self):
        free(self.ptr)

    @property
    def addr(self):
        return <uint64_t>self.ptr

    @property
    def value(self):
        return self.ptr[0]

    @value.setter
    def value(self, uint64_t v):
        self.ptr[0] = v


# ------------------------------------------------------------------------------------------------
# Same host: block routes (the latency path)
# ------------------------------------------------------------------------------------------------

cdef enum:
    _ROUTE_SLOTS = 1024  # descriptors one route call plans (IOV_MAX is 1024 on Linux)
    _ROUTE_STACK = 64    # of which this many on the stack

#: Most descriptors one route call plans; a larger call takes the checked path.
ROUTE_MAX_DESCRIPTORS = _ROUTE_SLOTS if _ROUTE_SLOTS < IOV_MAX else IOV_MAX
cdef size_t _route_max = ROUTE_MAX_DESCRIPTORS


cdef class _Selection:
    # The tensor pairs of one learnt selection, as base addresses: local and remote tensor t.
    cdef uint64_t *local_base
    cdef uint64_t *remote_base
    cdef size_t count

    def __dealloc__(self):
        free(self.local_base)


cdef class _Route:
    # What the block routes of every plane share: the two cache layouts, the direction, the
    # tensor selections learnt from checked calls, and the per-call checks of the arguments.

    cdef readonly CacheLayout local
    cdef readonly CacheLayout remote
    cdef readonly bint write
    cdef readonly uint64_t block_bytes
    cdef dict selections
    cdef _Selection whole
    cdef tuple last  # (src range, dst range, tensor_num_per_layer, selection) of the last lookup

    cdef int _setup(self, local, remote, bint write) except -1:
        if not isinstance(local, CacheLayout) or not isinstance(remote, CacheLayout):
            raise TypeError("local and remote must be CacheLayouts")
        cdef CacheLayout mine = local, theirs = remote
        if mine.row_bytes == 0 or mine.row_bytes > theirs.row_bytes or (
                not write and mine.row_bytes != theirs.row_bytes):
            raise ValueError(f"local blocks of {local.row_bytes} bytes do not fit remote blocks of "
                             f"{remote.row_bytes} bytes")
        self.local = local
        self.remote = remote
        self.write = write
        self.block_bytes = local.row_bytes
        self.selections = {}
        self.whole = None
        return 0

    def learn(self, key, src_tensors, dst_tensors):
        """Remember the tensor selection of ``key`` = ``(src_layer_range, dst_layer_range,
        tensor_num_per_layer)``: the source and destination tensor indices (None = all) that a
        checked call resolved it to."""
        local_t, remote_t = (src_tensors, dst_tensors) if self.write else (dst_tensors, src_tensors)
        local_i = range(self.local.num_tensors) if local_t is None else list(local_t)
        remote_i = range(self.remote.num_tensors) if remote_t is None else list(remote_t)
        if len(local_i) != len(remote_i) or len(local_i) == 0:
            raise ValueError(f"a selection pairs {len(local_i)} local with {len(remote_i)} remote tensors")
        cdef _Selection sel = _Selection()
        cdef size_t n = len(local_i), i
        sel.local_base = <uint64_t *>malloc(2 * n * sizeof(uint64_t))
        if sel.local_base == NULL:
            raise MemoryError()
        sel.remote_base = sel.local_base + n
        sel.count = n
        for i in range(n):
            if not 0 <= local_i[i] < self.local.num_tensors or not 0 <= remote_i[i] < self.remote.num_tensors:
                raise ValueError(f"tensor pair ({local_i[i]}, {remote_i[i]}) is outside the caches")
            sel.local_base[i] = self.local.addrs[local_i[i]]
            sel.remote_base[i] = self.remote.addrs[remote_i[i]]
        if key == (None, None, 2) and type(key[2]) is int:
            self.whole = sel
        self.selections[key] = sel

    cdef _Selection _selection(self, src_layer_range, dst_layer_range, tensor_num_per_layer):
        # The learnt selection of these exact layer arguments, or None (the call declines).
        cdef _Selection sel
        cdef tuple last = self.last
        if src_layer_range is None and dst_layer_range is None and type(tensor_num_per_layer) is int \
                and tensor_num_per_layer == 2:
            return self.whole
        if (last is not None and last[0] is src_layer_range and last[1] is dst_layer_range
                and last[2] is tensor_num_per_layer):
            return last[3]  # the very objects of the previous call with layer arguments
        if ((src_layer_range is None or (type(src_layer_range) is range and src_layer_range.step == 1))
                and (dst_layer_range is None or (type(dst_layer_range) is range and dst_layer_range.step == 1))
                and type(tensor_num_per_layer) is int):
            sel = self.selections.get((src_layer_range, dst_layer_range, tensor_num_per_layer))
            if sel is not None:
                self.last = (src_layer_range, dst_layer_range, tensor_num_per_layer, sel)
            return sel
        return None

    cdef Py_ssize_t _count(self, src_blocks, dst_blocks, size_t nt, size_t most):
        # How many blocks the call moves, or -1 when it declines: both lists plain lists or
        # tuples of one length, not empty, and at most ``most`` descriptors in all.
        cdef Py_ssize_t n
        if (type(src_blocks) is not list and type(src_blocks) is not tuple) or \
                (type(dst_blocks) is not list and type(dst_blocks) is not tuple):
            return -1
        n = len(src_blocks)
        if n == 0 or n != len(dst_blocks) or <size_t>n > most // nt:
            return -1
        return n

    cdef bint _block_ids(self, src_blocks, dst_blocks, Py_ssize_t n, uint64_t *lblock, uint64_t *rblock):
        # The block ids as local and remote indices; False unless every one is an exact int
        # inside its cache.
        cdef Py_ssize_t k
        cdef uint64_t lrows = self.local.num_rows, rrows = self.remote.num_rows
        local_blocks, remote_blocks = (src_blocks, dst_blocks) if self.write else (dst_blocks, src_blocks)
        for k in range(n):
            value = local_blocks[k]
            if type(value) is not int or not 0 <= value < lrows:
                return False
            lblock[k] = value
            value = remote_blocks[k]
            if type(value) is not int or not 0 <= value < rrows:
                return False
            rblock[k] = value
        return True


cdef class BlockRoute(_Route):
    """Repeated block transfers between one local blocks cache and one blocks cache of a
    same-host peer, with what holds between calls established once.

    The same-host plane builds a route after a transfer that went through every check (the
    link, the peer's table, the cache geometry, the layer arguments). ``run`` then re-checks only
    what can change between calls: the link is still open, the peer's registry generation is
    still the one the remote geometry came from, the peer process is alive, every block id is an
    exact int inside its cache, and the tensor selection is one the route has learnt (``learn``)
    from a checked call. It plans on the stack and moves the bytes with one
    ``process_vm_writev``/``readv`` call. Whatever it cannot take (another argument shape, more
    than ``ROUTE_MAX_DESCRIPTORS`` descriptors, any failure) returns False before or instead of
    reporting, and the caller takes the checked path, which reports errors as usual.
    """

    cdef readonly int pid
    cdef int pidfd
    cdef const void *word
    cdef object word_keep
    cdef readonly uint64_t generation
    cdef readonly object owner
    cdef bint closed
    cdef bint owns_pidfd
    cdef int busy  # run calls between their checks and their end (they use pidfd without the GIL)
    cdef object __weakref__

    def __cinit__(self, owner, pid, pidfd, generation_word, generation, local, remote, write):
        """``owner``: the link (its ``closed`` attribute is read on every call); ``pid``: the proven
        peer process; ``pidfd``: a pidfd of it that the route takes over (closed with the route)
        or -1; ``generation_word``: a C-contiguous uint64 array mapping the
        peer's registry generation (kept referenced, so the page stays mapped while the route
        lives); ``generation``: the generation of the table ``remote`` came from; ``write``:
        push (local -> remote) or pull (remote -> local). The block size is the local one and
        must fit the remote blocks (a pull needs equal sizes)."""
        self.pidfd = pidfd  # taken over first: closed with the route even if a check below raises
        self.owns_pidfd = True  # (C fields start at 0: never close descriptor 0 by mistake)
        self.pid = pid
        self.generation = generation
        if not isinstance(local, CacheLayout) or not isinstance(remote, CacheLayout):
            raise TypeError("local and remote must be CacheLayouts")
        cdef const uint64_t[::1] view = generation_word
        if view.shape[0] < 1:
            raise ValueError("the generation word is empty")
        self._setup(local, remote, write)
        self.owner = owner
        self.word = &view[0]
        self.word_keep = generation_word

    def __dealloc__(self):
        if self.owns_pidfd and self.pidfd >= 0:
            close(self.pidfd)

    def close(self):
        """Release the pidfd and the generation page now (the plane does this when the link
        ends); every later ``run`` declines. Idempotent."""
        self.closed = True
        self.word = NULL
        self.word_keep = None
        if self.owns_pidfd and self.pidfd >= 0 and self.busy == 0:  # else the last running call closes it
            close(self.pidfd)
            self.pidfd = -1

    @property
    def current(self):
        """Whether the route may still be used: the link is open and the peer's registry has not
        changed since the route's table was fetched."""
        return (not self.closed and not self.owner.closed
                and dd_load_acquire_u64(self.word) == self.generation)

    def run(self, src_blocks, dst_blocks, src_layer_range, dst_layer_range, tensor_num_per_layer):
        """Move ``src_blocks[k]`` -> ``dst_blocks[k]`` for every tensor pair of the selection;
        True when done, False when the caller must take the checked path (nothing was written
        unless a system call failed part-way, which the checked path then repeats)."""
        cdef Py_ssize_t n
        cdef size_t nt
        # Small calls plan on the stack (2.5 KiB), larger ones on the heap: 48 KiB of locals
        # overflowed threads made with a small threading.stack_size.
        cdef uint64_t blocks_s[2 * _ROUTE_STACK]
        cdef iovec iov_s[2 * _ROUTE_STACK]
        cdef uint64_t *lblock
        cdef uint64_t *rblock
        cdef iovec *liov
        cdef iovec *riov
        cdef void *heap = NULL
        cdef _Selection sel = self._selection(src_layer_range, dst_layer_range, tensor_num_per_layer)
        if sel is None:
            return False
        nt = sel.count
        n = self._count(src_blocks, dst_blocks, nt, _route_max)
        if n < 0:
            return False
        if <size_t>n * nt <= _ROUTE_STACK:
            lblock, rblock = blocks_s, blocks_s + _ROUTE_STACK
            liov, riov = iov_s, iov_s + _ROUTE_STACK
        else:
            heap = malloc(2 * <size_t>n * sizeof(uint64_t) + 2 * <size_t>n * nt * sizeof(iovec))
            if heap == NULL:
                return False
            liov = <iovec *>heap
            riov = liov + <size_t>n * nt
            lblock = <uint64_t *>(riov + <size_t>n * nt)
            rblock = lblock + n
        try:
            return self._run(sel, n, nt, src_blocks, dst_blocks, lblock, rblock, liov, riov)
        finally:
            free(heap)

    cdef bint _run(self, _Selection sel, Py_ssize_t n, size_t nt, src_blocks, dst_blocks,
                   uint64_t *lblock, uint64_t *rblock, iovec *liov, iovec *riov) except -1:
        cdef Py_ssize_t k
        cdef size_t t, count = 0
        cdef uint64_t lstride = self.local.row_bytes, rstride = self.remote.row_bytes
        cdef uint64_t nbytes = self.block_bytes, laddr, raddr
        cdef unsigned int status
        cdef int err = 0
        cdef int pidfd
        if not self._block_ids(src_blocks, dst_blocks, n, lblock, rblock):
            return False
        if self.closed or self.owner.closed or dd_load_acquire_u64(self.word) != self.generation:
            return False
        pidfd = self.pidfd
        self.busy += 1
        with nogil:
            for t in range(nt):
                for k in range(n):
                    laddr = sel.local_base[t] + lblock[k] * lstride
                    raddr = sel.remote_base[t] + rblock[k] * rstride
                    if (count > 0 and <uint64_t>liov[count - 1].iov_base + liov[count - 1].iov_len == laddr
                            and <uint64_t>riov[count - 1].iov_base + riov[count - 1].iov_len == raddr):
                        liov[count - 1].iov_len += nbytes
                        riov[count - 1].iov_len += nbytes
                    else:
                        liov[count].iov_base = <void *>laddr
                        liov[count].iov_len = nbytes
                        riov[count].iov_base = <void *>raddr
                        riov[count].iov_len = nbytes
                        count += 1
            status = _status.DD_LLM_SUCCESS
            if _exited(pidfd):
                status = _status.DD_LLM_LINK_FAILED
            if status == _status.DD_LLM_SUCCESS:
                status = _cma_batch(self.pid, liov, riov, count, self.write, &err)
        self.busy -= 1
        if self.closed and self.busy == 0 and self.pidfd >= 0:
            close(self.pidfd)
            self.pidfd = -1
        return status == _status.DD_LLM_SUCCESS

    def __repr__(self):
        return (f"<BlockRoute {'push to' if self.write else 'pull from'} pid {self.pid}, "
                f"{len(self.selections)} selections>")


cdef class MappedRoute(_Route):
    """Repeated block transfers between one local blocks cache and one blocks cache of a
    same-host peer whose memory is mapped here (the shm plane: the peer's memfd of that cache):
    the copies are memcpy into or out of the mapping, on the calling thread.

    As ``BlockRoute``, ``run`` re-checks per call only what can change between calls (the link is
    open, the peer's registry generation is the route's, every block id is an exact int inside
    its cache, the tensor selection was learnt from a checked call) and returns False for anything
    else, which then takes the checked path. The route keeps the mapping referenced for as long as
    it lives: a call that passed its checks copies into memory that stays mapped (at worst the
    old file of a cache the peer dropped meanwhile, which no other cache of the peer uses).
    """

    cdef const void *word
    cdef object word_keep
    cdef object mapping
    cdef uint64_t shift
    cdef readonly uint64_t generation
    cdef readonly object owner
    cdef bint closed
    cdef object __weakref__

    def __cinit__(self, owner, generation_word, generation, local, remote, write, mapping,
                  uint64_t peer_base, uint64_t local_base, uint64_t size):
        """``owner``: the link (``closed`` read on every call); ``generation_word``: a C-contiguous
        uint64 array mapping the peer's registry generation, ``generation``: that of the table
        ``remote`` came from; ``mapping``: what keeps the peer's file mapped here, ``size`` bytes at
        ``local_base``, which the peer maps at ``peer_base``. Every tensor of ``remote`` must lie
        inside that file (ValueError otherwise)."""
        cdef const uint64_t[::1] view = generation_word
        cdef CacheLayout theirs
        cdef uint64_t tensor_bytes, offset
        cdef Py_ssize_t t
        if view.shape[0] < 1:
            raise ValueError("the generation word is empty")
        self._setup(local, remote, write)
        theirs = remote
        tensor_bytes = theirs.row_bytes * theirs.num_rows
        if theirs.num_rows != 0 and tensor_bytes // theirs.num_rows != theirs.row_bytes:
            raise ValueError("the remote tensors are larger than the address space")
        for t in range(theirs.num_tensors):
            offset = <uint64_t>theirs.addrs[t] - peer_base
            if <uint64_t>theirs.addrs[t] < peer_base or offset > size or tensor_bytes > size - offset:
                raise ValueError(f"remote tensor {t} lies outside the mapped file")
        self.shift = local_base - peer_base  # modulo 2**64: a peer address plus shift is ours
        self.generation = generation
        self.owner = owner
        self.mapping = mapping
        self.word = &view[0]
        self.word_keep = generation_word

    def close(self):
        """Every later ``run`` declines (the plane does this when the link ends); the mapping goes
        with the route. Idempotent."""
        self.closed = True
        self.word = NULL
        self.word_keep = None

    @property
    def current(self):
        """Whether the route may still be used: the link is open and the peer's registry has not
        changed since the route's table was fetched."""
        return (not self.closed and not self.owner.closed
                and dd_load_acquire_u64(self.word) == self.generation)

    def run(self, src_blocks, dst_blocks, src_layer_range, dst_layer_range, tensor_num_per_layer):
        """Move ``src_blocks[k]`` -> ``dst_blocks[k]`` for every tensor pair of the selection;
        True when done, False when the caller must take the checked path (nothing was moved)."""
        cdef Py_ssize_t n
        cdef uint64_t blocks_s[2 * _ROUTE_STACK]
        cdef uint64_t *lblock
        cdef uint64_t *rblock
        cdef void *heap = NULL
        cdef _Selection sel = self._selection(src_layer_range, dst_layer_range, tensor_num_per_layer)
        if sel is None:
            return False
        n = self._count(src_blocks, dst_blocks, sel.count, _route_max)
        if n < 0:
            return False
        if n <= _ROUTE_STACK:
            lblock, rblock = blocks_s, blocks_s + _ROUTE_STACK
        else:
            heap = malloc(2 * <size_t>n * sizeof(uint64_t))
            if heap == NULL:
                return False
            lblock = <uint64_t *>heap
            rblock = lblock + n
        try:
            if not self._block_ids(src_blocks, dst_blocks, n, lblock, rblock):
                return False
            if self.closed or self.owner.closed or dd_load_acquire_u64(self.word) != self.generation:
                return False
            self._copy(sel, n, lblock, rblock)
            return True
        finally:
            free(heap)

    cdef void _copy(self, _Selection sel, Py_ssize_t n, const uint64_t *lblock, const uint64_t *rblock) noexcept:
        cdef size_t t
        cdef Py_ssize_t k
        cdef uint64_t lstride = self.local.row_bytes, rstride = self.remote.row_bytes
        cdef uint64_t nbytes = self.block_bytes, laddr, raddr, shift = self.shift
        cdef bint write = self.write
        with nogil:
            for t in range(sel.count):
                for k in range(n):
                    laddr = sel.local_base[t] + lblock[k] * lstride
                    raddr = sel.remote_base[t] + rblock[k] * rstride + shift
                    if write:
                        memcpy(<void *>raddr, <const void *>laddr, nbytes)
                    else:
                        memcpy(<void *>laddr, <const void *>raddr, nbytes)

    def __repr__(self):
        return f"<MappedRoute {'push' if self.write else 'pull'}, {len(self.selections)} selections>"


def block_indices(local_blocks, remote_blocks, const int64_t[::1] local_bases not None,
                  const int64_t[::1] remote_bases not None, int64_t local_rows, int64_t remote_rows,
                  int32_t[::1] local_out not None, int32_t[::1] remote_out not None):
    """Indices into two prepared descriptor lists whose tensor ``t`` holds its blocks from index
    ``bases[t]`` on (NIXL's block routes): entry ``t * n + k`` is ``local_bases[t] +
    local_blocks[k]`` (and the same for the remote side), for every tensor pair ``t`` and every
    block ``k``. The block lists are lists or tuples of ``n > 0`` exact ints inside ``[0, rows)``;
    the caller made every ``base + rows`` fit an int32. Returns the count written, or -1 where an
    argument is not as that (nothing to move: the caller takes the checked path)."""
    cdef Py_ssize_t n, k, t, nt = local_bases.shape[0]
    if (type(local_blocks) is not list and type(local_blocks) is not tuple) or \
            (type(remote_blocks) is not list and type(remote_blocks) is not tuple):
        return -1
    n = len(local_blocks)
    if n == 0 or n != len(remote_blocks) or nt == 0 or nt != remote_bases.shape[0] or \
            n > min(local_out.shape[0], remote_out.shape[0]) // nt:
        return -1
    for k in range(n):
        value = local_blocks[k]
        if type(value) is not int or not 0 <= value < local_rows:
            return -1
        local_out[k] = <int32_t>(<int64_t>value)
        value = remote_blocks[k]
        if type(value) is not int or not 0 <= value < remote_rows:
            return -1
        remote_out[k] = <int32_t>(<int64_t>value)
    with nogil:
        for t in range(nt - 1, -1, -1):  # the last tensor first: row 0 still holds the block ids
            for k in range(n):
                local_out[t * n + k] = <int32_t>(local_bases[t] + local_out[k])
                remote_out[t * n + k] = <int32_t>(remote_bases[t] + remote_out[k])
    return n * nt


# ------------------------------------------------------------------------------------------------
# TCP: scatter/gather socket I/O
# ------------------------------------------------------------------------------------------------

cdef unsigned int _wait(int fd, short events, int64_t deadline, int spin=_SPIN_REPLY) noexcept nogil:
    # Wait until ``fd`` is ready for ``events`` or the deadline passes; a receive spins first
    # (``set_spin_us``; ``spin`` says what it waits for, SPIN_OFF none): polls that do not sleep,
    # until data comes or the spin is over. A spin that the deadline cut short says nothing of
    # whether spinning pays.
    global _spin_waits, _spin_credit, _spin_hits, _spin_misses, _spin_skipped, _request_credit, _request_waits
    cdef pollfd p
    cdef int rc, ms, credit
    cdef unsigned int waits
    cdef int64_t until
    p.fd = fd
    p.events = events
    if spin != _SPIN_OFF and _spin_ns > 0 and events == POLLIN:
        if spin == _SPIN_REPLY:
            _spin_waits += 1
            credit, waits = _spin_credit, _spin_waits
        else:
            _request_waits += 1
            credit, waits = _request_credit, _request_waits
        if credit > 0 or waits % _PROBE_EVERY == 0:
            until = _now_ns() + _spin_ns
            if deadline >= 0 and deadline < until:
                until = deadline
            while True:
                p.revents = 0
                rc = poll(&p, 1, 0)
                if rc > 0:
                    _spin_hits += 1
                    if credit < _CREDIT_MAX:
                        credit += 1
                    if spin == _SPIN_REPLY:
                        _spin_credit = credit
                    else:
                        _request_credit = credit
                    return _status.DD_LLM_SUCCESS
                if rc < 0 and errno != EINTR:
                    return _status.DD_LLM_FAILED
                if _now_ns() >= until:
                    break
            if until == deadline:
                return _status.DD_LLM_TIMEOUT
            _spin_misses += 1
            credit = credit - _MISS_COST if credit > _MISS_COST else 0
            if spin == _SPIN_REPLY:
                _spin_credit = credit
            else:
                _request_credit = credit
        else:
            _spin_skipped += 1
    while True:
        ms = _remaining_ms(deadline)
        p.revents = 0
        rc = poll(&p, 1, ms)
        if rc > 0:
            return _status.DD_LLM_SUCCESS  # ready, or an error the next call reports
        if rc == 0:
            return _status.DD_LLM_TIMEOUT
        if errno != EINTR:
            return _status.DD_LLM_FAILED


cdef inline void _message(msghdr *msg, iovec *iov, size_t first, size_t count) noexcept nogil:
    # A message over iov[first:count], at most IOV_MAX entries.
    cdef size_t batch = count - first
    if batch > _BATCH:
        batch = _BATCH
    msg.msg_name = NULL
    msg.msg_namelen = 0
    msg.msg_iov = iov + first
    msg.msg_iovlen = batch
    msg.msg_control = NULL
    msg.msg_controllen = 0
    msg.msg_flags = 0


cdef unsigned int _stream_iov(int fd, iovec *iov, size_t count, bint sending, int64_t deadline,
                              int *err, uint64_t *moved, int spin=_SPIN_REPLY) noexcept nogil:
    # Send (sendmsg) or receive (recvmsg) the whole of iov[0:count], IOV_MAX entries a call,
    # polling the non-blocking socket until the deadline. A receiver waiting for more than
    # _LOWAT_FLOOR bytes raises the socket's low-watermark to min(rest of the stream, _recv_lowat)
    # and puts it back to 1 when it is done,
    # so the next reader of the socket (a frame header, or Python) is never held back by it.
    cdef size_t first = 0, i
    cdef ssize_t n
    cdef msghdr msg
    cdef unsigned int st = _status.DD_LLM_SUCCESS
    cdef int lowat = 1, want
    cdef uint64_t rest = 0
    if not sending and _recv_lowat > 1:
        for i in range(count):
            rest += iov[i].iov_len
    while first < count:
        _message(&msg, iov, first, count)
        n = sendmsg(fd, &msg, MSG_NOSIGNAL) if sending else recvmsg(fd, &msg, 0)
        if n < 0:
            if errno == EINTR:
                continue
            if errno == EAGAIN or errno == EWOULDBLOCK:
                if rest > _LOWAT_FLOOR or lowat != 1:
                    # never more than the rest, and back to 1 once the rest is small
                    if rest <= _LOWAT_FLOOR:
                        want = 1
                    else:
                        want = <int>rest if rest < <uint64_t>_recv_lowat else _recv_lowat
                    if want != lowat and setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &want,
                                                    sizeof(int)) == 0:
                        lowat = want
                # (no spin while the low-watermark holds the wake-up back for a large body)
                st = _wait(fd, POLLOUT if sending else POLLIN, deadline, spin if lowat == 1 else _SPIN_OFF)
                if st != _status.DD_LLM_SUCCESS:
                    break
                continue
            err[0] = errno
            st = _errno_status(errno)
            break
        if n == 0 and not sending:
            st = _status.DD_LLM_LINK_FAILED  # the peer closed the connection
            break
        moved[0] += <uint64_t>n
        if rest:
            rest -= <uint64_t>n
        _advance(iov, &first, count, <size_t>n)
    if lowat != 1:
        lowat = 1
        setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &lowat, sizeof(int))
    return st


cdef iovec *_plan_iovecs(const unsigned char *head, size_t head_len, CopyPlan plan,
                         bint dst_side, size_t *count) except NULL:
    cdef size_t n = 0, i
    cdef iovec *iov = <iovec *>malloc((plan.count + 1) * sizeof(iovec))
    if iov == NULL:
        raise MemoryError()
    if head_len:
        iov[0].iov_base = <void *>head
        iov[0].iov_len = head_len
        n = 1
    if plan is not None:
        for i in range(plan.count):
            if plan.descs[i].nbytes == 0:
                continue
            iov[n].iov_base = <void *>(plan.descs[i].dst if dst_side else plan.descs[i].src)
            iov[n].iov_len = plan.descs[i].nbytes
            n += 1
    count[0] = n
    return iov


def send_plan(int fd, const unsigned char[::1] head, CopyPlan plan not None, bint from_dst=False,
              int timeout_ms=-1):
    """Send ``head`` then the bytes of every descriptor's source range (destination range with
    ``from_dst``) as one scatter/gather stream. Returns ``(status, errno)``."""
    cdef size_t count = 0
    cdef size_t head_len = head.shape[0] if head is not None else 0
    cdef const unsigned char *head_ptr = &head[0] if head_len else NULL
    cdef iovec *iov = _plan_iovecs(head_ptr, head_len, plan, from_dst, &count)
    cdef unsigned int status
    cdef int err = 0
    cdef uint64_t sent = 0
    cdef int64_t deadline = _deadline(timeout_ms)
    with nogil:
        status = _stream_iov(fd, iov, count, True, deadline, &err, &sent)
    free(iov)
    return status, err


def send_bytes(int fd, const unsigned char[::1] data, int timeout_ms=-1):
    """Send all of ``data``. Returns ``(status, errno)``."""
    cdef iovec iov
    cdef unsigned int status = _status.DD_LLM_SUCCESS
    cdef int err = 0
    cdef uint64_t sent = 0
    cdef int64_t deadline = _deadline(timeout_ms)
    if data.shape[0] == 0:
        return status, err
    iov.iov_base = <void *>&data[0]
    iov.iov_len = data.shape[0]
    with nogil:
        status = _stream_iov(fd, &iov, 1, True, deadline, &err, &sent)
    return status, err


def recv_plan(int fd, CopyPlan plan not None, bint into_src=False, int timeout_ms=-1):
    """Receive the stream of every descriptor's destination range (source range with
    ``into_src``) in plan order, straight into memory. Returns ``(status, errno, received)``."""
    cdef size_t count = 0
    cdef iovec *iov = _plan_iovecs(NULL, 0, plan, not into_src, &count)
    cdef unsigned int status
    cdef int err = 0
    cdef uint64_t received = 0
    cdef int64_t deadline = _deadline(timeout_ms)
    with nogil:
        status = _stream_iov(fd, iov, count, False, deadline, &err, &received)
    free(iov)
    return status, err, received


def recv_into(int fd, unsigned char[::1] buffer, int timeout_ms=-1, int spin=SPIN_REPLY):
    """Fill ``buffer`` from the socket. Returns ``(status, errno, received)``; a peer that closed
    at a frame boundary gives ``LINK_FAILED`` with 0 bytes received. ``spin``: what a wait for
    the data waits for (``SPIN_REPLY``, ``SPIN_REQUEST`` or ``SPIN_OFF``: how it spins)."""
    if spin < _SPIN_OFF or spin > _SPIN_REQUEST:
        raise ValueError(f"spin must be SPIN_OFF, SPIN_REPLY or SPIN_REQUEST, not {spin}")
    cdef iovec iov
    cdef unsigned int status = _status.DD_LLM_SUCCESS
    cdef int err = 0
    cdef uint64_t received = 0
    cdef int64_t deadline = _deadline(timeout_ms)
    if buffer.shape[0] == 0:
        return status, err, received
    iov.iov_base = <void *>&buffer[0]
    iov.iov_len = buffer.shape[0]
    with nogil:
        status = _stream_iov(fd, &iov, 1, False, deadline, &err, &received, spin)
    return status, err, received


def recv_discard(int fd, uint64_t nbytes, int timeout_ms=-1):
    """Read and drop ``nbytes`` (a refused payload, so the stream stays in step)."""
    cdef char *scratch = <char *>malloc(1 << 16)
    cdef iovec iov
    cdef unsigned int status = _status.DD_LLM_SUCCESS
    cdef int err = 0
    cdef uint64_t received = 0, got
    cdef int64_t deadline = _deadline(timeout_ms)
    if scratch == NULL:
        raise MemoryError()
    with nogil:
        while nbytes > 0 and status == _status.DD_LLM_SUCCESS:
            iov.iov_base = scratch
            iov.iov_len = nbytes if nbytes < (1 << 16) else (1 << 16)
            got = 0
            status = _stream_iov(fd, &iov, 1, False, deadline, &err, &got)
            received += got
            nbytes -= got
    free(scratch)
    return status, err, received


# ------------------------------------------------------------------------------------------------
# TCP: block routes (the latency path)
# ------------------------------------------------------------------------------------------------

cdef enum:
    _HEADER_BYTES = 28  # a frame header (``wire.HEADER``)
    _PREFIX_BYTES = 44  # the header, the u64 table generation and the u64 descriptor (push) or tag (pull) bytes
    _HEAD_FIXED = 8     # magic, version and op: the bytes of a reply header known in advance
    _STATUS_AT = 8
    _REQ_ID_AT = 12
    _LENGTH_AT = 20


cdef inline uint64_t _load_u64(const unsigned char *p) noexcept nogil:
    cdef uint64_t v
    memcpy(&v, p, 8)
    return v


cdef inline void _store_u64(unsigned char *p, uint64_t v) noexcept nogil:
    memcpy(p, &v, 8)


cdef size_t _route_plan(_Selection sel, Py_ssize_t n, const uint64_t *lblock, const uint64_t *rblock,
                        uint64_t lstride, uint64_t rstride, uint64_t nbytes, bint write,
                        dd_copy_desc *descs) noexcept nogil:
    # The descriptors ``_core.plan_blocks`` makes for the same call, in its order and merged by
    # its rule (``CopyPlan.add``), so that a route's frame is byte for byte the checked path's.
    cdef size_t t, count = 0
    cdef Py_ssize_t k
    cdef uint64_t laddr, raddr, src, dst, apart
    cdef dd_copy_desc *last
    for t in range(sel.count):
        for k in range(n):
            laddr = sel.local_base[t] + lblock[k] * lstride
            raddr = sel.remote_base[t] + rblock[k] * rstride
            src, dst = (laddr, raddr) if write else (raddr, laddr)
            if count > 0:
                last = &descs[count - 1]
                apart = last.src - last.dst if last.src >= last.dst else last.dst - last.src
                if (src >= last.src and src - last.src == last.nbytes
                        and dst >= last.dst and dst - last.dst == last.nbytes
                        and nbytes <= apart and last.nbytes <= apart - nbytes):
                    last.nbytes += nbytes
                    continue
            descs[count].src = src
            descs[count].dst = dst
            descs[count].nbytes = nbytes
            count += 1
    return count


cdef class TcpRoute(_Route):
    """Repeated block pushes or pulls over one connection of a ``tcp`` link, with what holds
    between calls established once: the latency path of the tcp plane.

    The plane builds a route after a block transfer that went through every check, for the link's
    first connection (``channel``, a ``session.Channel``) and the peer's table it was planned
    against. ``run`` takes a call whose tensor selection the route has learnt (``learn``), whose
    block ids are exact ints inside their caches, on a link that is open, whose table is still
    ``table`` and whose connection is not broken, and whose bytes are fewer than ``stripe_bytes``
    (the checked path splits larger ones over the link's connections); anything else declines
    (False) before a byte is sent, and the caller takes the checked path.

    A call it takes plans on the stack exactly as ``_core.plan_blocks`` does, then, holding the
    connection's lock and with a request id from ``Channel.next_request_id``, sends the frame the
    tcp plane sends (PUSH with the payload gathered from the local blocks, or PULL with the
    calling thread's read tag) and reads the reply (and a pull's payload, straight into the local
    blocks) in one call without the GIL, under ``timeout_ms``. The owner checks the frame as any
    other. A connection that fails, times out or answers out of step raises what the tcp plane
    raises (``Channel.fault``: the link is out of step, ``on_broken(why)`` is told so that it ends
    the link). A refusal (a stale table, an unregistered range) returns False, and the route
    is no longer ``current``: the checked path then repeats the call, refreshes the table and
    reports as it does without a route. Nothing was written by the peer in that case.
    """

    cdef readonly object owner
    cdef readonly object table
    cdef readonly uint64_t generation
    cdef readonly int timeout_ms
    cdef readonly uint64_t stripe_bytes
    cdef object channel
    cdef object lock
    cdef int fd
    cdef int reply_op
    cdef object on_broken
    cdef object tag_of
    cdef unsigned char request[_HEADER_BYTES]
    cdef unsigned char reply[_HEADER_BYTES]
    cdef bint closed
    cdef bint stale
    cdef object __weakref__

    def __cinit__(self, owner, table, channel, const unsigned char[::1] request_head,
                  const unsigned char[::1] reply_head, local, remote, bint write, int timeout_ms,
                  uint64_t stripe_bytes, on_broken=None, tag_of=None):
        """``owner``: the link (``closed``, ``table`` and ``broken()`` are read); ``table``: the
        peer's table ``remote`` comes from (its ``generation`` goes in every frame);
        ``channel``: the connection (``fd``, ``lock``, ``broken``, ``next_request_id()``,
        ``fault()``, ``check_reply()``, ``header``); ``request_head`` / ``reply_head``: frame
        headers of the request and of its reply with request id and length 0; ``timeout_ms``:
        each call's limit (-1: none); ``on_broken(why)``: called after a call left the
        connection out of step; ``tag_of()``: a pull's read tag (bytes). Block sizes as for
        ``BlockRoute``."""
        if request_head.shape[0] != _HEADER_BYTES or reply_head.shape[0] != _HEADER_BYTES:
            raise ValueError(f"frame headers are {_HEADER_BYTES} bytes")
        if not write and tag_of is None:
            raise ValueError("a pull route needs tag_of")
        self._setup(local, remote, write)
        memcpy(self.request, &request_head[0], _HEADER_BYTES)
        memcpy(self.reply, &reply_head[0], _HEADER_BYTES)
        self.reply_op = self.reply[6] | (self.reply[7] << 8)
        self.owner = owner
        self.table = table
        self.generation = table.generation
        self.channel = channel
        self.lock = channel.lock
        self.fd = channel.fd
        self.timeout_ms = timeout_ms
        self.stripe_bytes = stripe_bytes
        self.on_broken = on_broken
        self.tag_of = tag_of

    def close(self):
        """Every later ``run`` declines (the route holds nothing of the system's). Idempotent."""
        self.closed = True

    @property
    def current(self):
        """Whether the route may still be used: the link is open, its table is still the
        route's, its connection is not broken, and no call was refused."""
        return (not self.closed and not self.stale and not self.owner.closed and self.owner.table is self.table
                and self.channel.broken is None)

    def run(self, src_blocks, dst_blocks, src_layer_range, dst_layer_range, tensor_num_per_layer):
        """Move ``src_blocks[k]`` -> ``dst_blocks[k]`` for every tensor pair of the selection;
        True when done, False when the caller must take the checked path (the call was declined
        before a byte was sent, or the peer refused it and wrote nothing). Raises as the tcp
        plane's ``push`` / ``pull`` do when the connection fails."""
        cdef Py_ssize_t n
        cdef size_t nt
        cdef uint64_t blocks_s[2 * _ROUTE_STACK]
        cdef dd_copy_desc descs_s[_ROUTE_STACK]
        cdef iovec iov_s[_ROUTE_STACK + 3]
        cdef uint64_t *lblock
        cdef uint64_t *rblock
        cdef dd_copy_desc *descs
        cdef iovec *iov
        cdef void *heap = NULL
        cdef _Selection sel = self._selection(src_layer_range, dst_layer_range, tensor_num_per_layer)
        if sel is None:
            return False
        nt = sel.count
        n = self._count(src_blocks, dst_blocks, nt, _route_max)
        if n < 0:
            return False
        if <size_t>n * nt <= _ROUTE_STACK:
            lblock, rblock, descs, iov = blocks_s, blocks_s + _ROUTE_STACK, descs_s, iov_s
        else:
            heap = malloc(2 * <size_t>n * sizeof(uint64_t) + <size_t>n * nt * sizeof(dd_copy_desc)
                          + (<size_t>n * nt + 3) * sizeof(iovec))
            if heap == NULL:
                return False
            descs = <dd_copy_desc *>heap
            iov = <iovec *>(descs + <size_t>n * nt)
            lblock = <uint64_t *>(iov + <size_t>n * nt + 3)
            rblock = lblock + n
        try:
            return self._run(sel, n, src_blocks, dst_blocks, lblock, rblock, descs, iov)
        finally:
            free(heap)

    cdef bint _run(self, _Selection sel, Py_ssize_t n, src_blocks, dst_blocks, uint64_t *lblock,
                   uint64_t *rblock, dd_copy_desc *descs, iovec *iov) except -1:
        cdef size_t count, i
        cdef uint64_t total
        cdef bytes tag = b""
        cdef unsigned char prefix[_PREFIX_BYTES]
        cdef long long status
        owner, channel = self.owner, self.channel
        if not self._block_ids(src_blocks, dst_blocks, n, lblock, rblock):
            return False
        if self.block_bytes >= self.stripe_bytes:
            return False
        total = <uint64_t>n * sel.count * self.block_bytes
        if total >= self.stripe_bytes:
            return False
        if not self.write:
            given = self.tag_of()
            if type(given) is not bytes:
                return False
            tag = given
        if (self.closed or self.stale or owner.closed or owner.table is not self.table
                or channel.broken is not None):
            return False
        count = _route_plan(sel, n, lblock, rblock, self.local.row_bytes, self.remote.row_bytes,
                            self.block_bytes, self.write, descs)
        memcpy(prefix, self.request, _HEADER_BYTES)
        _store_u64(prefix + _HEADER_BYTES, self.generation)
        iov[0].iov_base = prefix
        iov[0].iov_len = _PREFIX_BYTES
        if self.write:
            _store_u64(prefix + _LENGTH_AT, 16 + count * sizeof(dd_copy_desc) + total)
            _store_u64(prefix + _HEADER_BYTES + 8, count * sizeof(dd_copy_desc))
            iov[1].iov_base = descs
            iov[1].iov_len = count * sizeof(dd_copy_desc)
            for i in range(count):
                iov[2 + i].iov_base = <void *>descs[i].src
                iov[2 + i].iov_len = descs[i].nbytes
        else:
            _store_u64(prefix + _LENGTH_AT, 16 + len(tag) + count * sizeof(dd_copy_desc))
            _store_u64(prefix + _HEADER_BYTES + 8, len(tag))
            iov[1].iov_base = <char *>tag
            iov[1].iov_len = len(tag)
            iov[2].iov_base = descs
            iov[2].iov_len = count * sizeof(dd_copy_desc)
            for i in range(count):
                iov[3 + i].iov_base = <void *>descs[i].dst
                iov[3 + i].iov_len = descs[i].nbytes
        lock = self.lock
        lock.acquire()
        try:
            status = self._exchange(prefix, iov, count, total)
        except BaseException:
            lock.release()
            why = owner.broken()
            if why is not None and self.on_broken is not None:
                self.on_broken(why)
            raise
        lock.release()
        if status <= 0:
            return status == 0  # done, or declined (the connection broke meanwhile)
        self.stale = True  # refused: the checked path repeats it and refreshes the table
        return False

    cdef long long _exchange(self, unsigned char *prefix, iovec *iov, size_t count, uint64_t total) except -2:
        # One request and its reply, the connection's lock held: the reply's status (0: done),
        # or -1 when the connection broke before the request went out (declined).
        cdef unsigned char head[_HEADER_BYTES]
        cdef iovec head_iov
        cdef int fd = self.fd, err = 0, phase = 0
        cdef bint write = self.write
        cdef unsigned int st
        cdef uint64_t moved = 0, req_id, length
        cdef uint32_t status
        cdef size_t sent = count + 2 if write else 3
        cdef int64_t deadline
        channel = self.channel
        if channel.broken is not None:
            return -1
        req_id = channel.next_request_id()
        _store_u64(prefix + _REQ_ID_AT, req_id)
        deadline = _deadline(self.timeout_ms)
        head_iov.iov_base = head
        head_iov.iov_len = _HEADER_BYTES
        with nogil:
            st = _stream_iov(fd, iov, sent, True, deadline, &err, &moved)
            if st == _status.DD_LLM_SUCCESS:
                phase = 1
                st = _stream_iov(fd, &head_iov, 1, False, deadline, &err, &moved)
            if (st == _status.DD_LLM_SUCCESS and not write and memcmp(head, self.reply, _HEAD_FIXED) == 0
                    and _load_u64(head + _REQ_ID_AT) == req_id and _load_u64(head + _LENGTH_AT) == total
                    and head[_STATUS_AT] == 0 and head[_STATUS_AT + 1] == 0 and head[_STATUS_AT + 2] == 0
                    and head[_STATUS_AT + 3] == 0):
                phase = 2
                st = _stream_iov(fd, iov + 3, count, False, deadline, &err, &moved)
        what = "push" if write else "pull"
        if st != _status.DD_LLM_SUCCESS:
            raise channel.fault(st, what)  # the request, its reply or a pull's payload cut short
        if memcmp(head, self.reply, _HEAD_FIXED) != 0 or _load_u64(head + _REQ_ID_AT) != req_id:
            channel.header[:] = head[:_HEADER_BYTES]
            channel.check_reply(self.reply_op, req_id, what)  # raises the fault that names it
            raise channel.fault(_status.DD_LLM_LINK_FAILED, f"{what}: unexpected reply")
        memcpy(&status, head + _STATUS_AT, 4)
        length = _load_u64(head + _LENGTH_AT)
        if write and length:
            raise channel.fault(_status.DD_LLM_LINK_FAILED, "push: reply with a payload")
        if not write and status == 0 and length != total:
            raise channel.fault(_status.DD_LLM_LINK_FAILED, f"pull: {length} bytes announced, {total} asked")
        if not write and status != 0 and length:
            raise channel.fault(_status.DD_LLM_LINK_FAILED, "pull: refusal with a payload")
        return status

    def __repr__(self):
        return (f"<TcpRoute {'push to' if self.write else 'pull from'} {self.channel.peer_name}, "
                f"{len(self.selections)} selections>")


# ------------------------------------------------------------------------------------------------
# TCP: the serving side of a push
# ------------------------------------------------------------------------------------------------

#: What ``read_push`` found wrong with a PUSH frame (its first value; the server names each).
PUSH_OK = 0
PUSH_TRUNCATED = 1          # the generation and descriptor length cut short (status)
PUSH_BAD_LENGTH = 2         # a descriptor length the frame cannot hold or not whole descriptors
PUSH_TOO_MANY = 3           # more descriptor bytes than ``max_desc_bytes``
PUSH_DESCS_TRUNCATED = 4    # the descriptors cut short (status)
PUSH_WRAPS = 5              # a descriptor whose range wraps around the address space (index)
PUSH_SIZE_MISMATCH = 6      # the descriptors do not cover the frame's payload (bytes covered)


def read_push(int fd, uint64_t length, int timeout_ms, uint64_t max_desc_bytes):
    """Read a PUSH frame's body up to its payload (``length`` >= 16: the table generation, the
    descriptor length and the descriptors) and check it as ``transport.server`` does, in that
    order: ``(PUSH_OK, generation, desc_len, plan)``, or ``(problem, value, generation,
    desc_len)`` with ``value`` the receive status, descriptor index or bytes covered. The
    descriptors are received straight into the plan."""
    cdef unsigned char prefix[16]
    cdef iovec iov
    cdef unsigned int st
    cdef int err = 0
    cdef uint64_t got = 0, generation, desc_len, n, i, total = 0
    cdef int64_t deadline = _deadline(timeout_ms)
    cdef CopyPlan plan
    cdef const dd_copy_desc *d
    iov.iov_base = prefix
    iov.iov_len = 16
    with nogil:
        st = _stream_iov(fd, &iov, 1, False, deadline, &err, &got)
    if st != _status.DD_LLM_SUCCESS:
        return PUSH_TRUNCATED, st, 0, 0
    generation = _load_u64(prefix)
    desc_len = _load_u64(prefix + 8)
    if desc_len > length - 16 or desc_len % sizeof(dd_copy_desc):
        return PUSH_BAD_LENGTH, 0, generation, desc_len
    if desc_len > max_desc_bytes:
        return PUSH_TOO_MANY, 0, generation, desc_len
    n = desc_len // sizeof(dd_copy_desc)
    plan = CopyPlan()
    if n:
        plan.reserve(n)
        iov.iov_base = plan.descs
        iov.iov_len = desc_len
        with nogil:
            st = _stream_iov(fd, &iov, 1, False, deadline, &err, &got)
        if st != _status.DD_LLM_SUCCESS:
            return PUSH_DESCS_TRUNCATED, st, generation, desc_len
        d = plan.descs
        for i in range(n):
            if d[i].nbytes > UINT64_MAX - d[i].src or d[i].nbytes > UINT64_MAX - d[i].dst:
                return PUSH_WRAPS, i, generation, desc_len
            total += d[i].nbytes  # wraps as ``CopyPlan.total_bytes`` does; the range check refuses such plans
        plan.count = n
        plan.total_bytes = total
    if total != length - 16 - desc_len:
        return PUSH_SIZE_MISMATCH, total, generation, desc_len
    return PUSH_OK, generation, desc_len, plan


def recv_plan_reply(int fd, CopyPlan plan not None, const unsigned char[::1] reply, int timeout_ms=-1):
    """``recv_plan`` into the descriptors' destinations, then, if all of it came, send ``reply``
    (a frame) in the same call. Returns ``(receive status, send status)`` (the send's is the
    receive's when nothing was sent)."""
    cdef size_t count = 0
    cdef iovec *iov = _plan_iovecs(NULL, 0, plan, True, &count)
    cdef iovec reply_iov
    cdef unsigned int st, sent_st
    cdef int err = 0
    cdef uint64_t moved = 0
    cdef int64_t deadline = _deadline(timeout_ms)
    reply_iov.iov_base = <void *>&reply[0]
    reply_iov.iov_len = reply.shape[0]
    with nogil:
        st = _stream_iov(fd, iov, count, False, deadline, &err, &moved)
        sent_st = st
        if st == _status.DD_LLM_SUCCESS:
            sent_st = _stream_iov(fd, &reply_iov, 1, True, deadline, &err, &moved)
    free(iov)
    return st, sent_st


# ------------------------------------------------------------------------------------------------
# Wire descriptors and the receiver's range check
# ------------------------------------------------------------------------------------------------

def plan_to_wire(CopyPlan plan not None):
    """The plan's descriptors as bytes (``src, dst, nbytes`` little-endian uint64 each)."""
    cdef bytes out = (<char *>plan.descs)[:plan.count * sizeof(dd_copy_desc)] if plan.count else b""
    return out


def plan_from_wire(const unsigned char[::1] data):
    """A plan from wire descriptors; PARAM_INVALID-style ``ValueError`` for a ragged buffer or
    a descriptor whose range wraps around the address space."""
    cdef size_t n, i
    cdef CopyPlan plan = CopyPlan()
    cdef const dd_copy_desc *src
    if data.shape[0] % sizeof(dd_copy_desc):
        raise ValueError(f"{data.shape[0]} descriptor bytes is not a multiple of {sizeof(dd_copy_desc)}")
    n = data.shape[0] // sizeof(dd_copy_desc)
    if n == 0:
        return plan
    plan.reserve(n)
    src = <const dd_copy_desc *>&data[0]
    for i in range(n):
        if src[i].nbytes > UINT64_MAX - src[i].src or src[i].nbytes > UINT64_MAX - src[i].dst:
            raise ValueError(f"descriptor {i} wraps around the address space")
        plan.descs[i] = src[i]
        plan.total_bytes += src[i].nbytes
    plan.count = n
    return plan


cdef class RangeSet:
    """Sorted, merged address ranges: the memory a process lets peers touch.

    Built from ``(address, nbytes)`` pairs. A range may end at the very top of the address space
    (``address + nbytes == 2**64``); one that would run past it, or a negative value, is refused
    with ``ValueError`` before anything is stored. Each range is kept as its first and its last
    byte, so that the top end needs no 65th bit.
    """

    cdef uint64_t *starts
    cdef uint64_t *lasts
    cdef size_t count

    def __cinit__(self, ranges=()):
        cdef list spans = []
        cdef list merged = []
        cdef list last = None
        cdef size_t i
        for pair in ranges:
            start, nbytes = (operator.index(v) for v in pair)
            if start < 0 or nbytes < 0 or start + nbytes > _ADDRESS_SPACE:
                raise ValueError(f"range of {nbytes} bytes at {start:#x} does not lie in the 64-bit "
                                 f"address space")
            if nbytes > 0:
                spans.append((start, start + nbytes))
        spans.sort()
        for start, end in spans:
            if last is not None and start <= last[1]:
                if end > last[1]:
                    last[1] = end
            else:
                last = [start, end]
                merged.append(last)
        self.count = len(merged)
        self.starts = <uint64_t *>malloc((self.count + 1) * sizeof(uint64_t))
        self.lasts = <uint64_t *>malloc((self.count + 1) * sizeof(uint64_t))
        if self.starts == NULL or self.lasts == NULL:
            raise MemoryError()
        for i in range(self.count):
            self.starts[i] = merged[i][0]
            self.lasts[i] = merged[i][1] - 1

    def __dealloc__(self):
        free(self.starts)
        free(self.lasts)

    def __len__(self):
        return self.count

    def spans(self):
        """The merged ranges as ``(start, end)`` pairs, ``end`` exclusive (at most 2**64)."""
        return [(int(self.starts[i]), int(self.lasts[i]) + 1) for i in range(self.count)]

    cdef bint _contains(self, uint64_t addr, uint64_t nbytes) noexcept nogil:
        # Inside one merged range: it starts at or before addr, addr is one of its bytes and so
        # is addr + nbytes - 1 (nothing here computes an end that could wrap). A zero-length
        # range counts as inside when addr is a byte of the set.
        cdef size_t lo = 0, hi = self.count, mid
        # The last range whose start <= addr.
        while lo < hi:
            mid = (lo + hi) // 2
            if self.starts[mid] <= addr:
                lo = mid + 1
            else:
                hi = mid
        if lo == 0 or addr > self.lasts[lo - 1]:
            return False
        return nbytes == 0 or nbytes - 1 <= self.lasts[lo - 1] - addr

    def contains(self, uint64_t addr, uint64_t nbytes):
        return self._contains(addr, nbytes)

    cdef bint _overlaps(self, uint64_t addr, uint64_t nbytes) noexcept nogil:
        cdef size_t lo = 0, hi = self.count, mid
        if nbytes == 0:
            return False
        # The first range whose last byte is at or after addr; it overlaps if it starts before
        # addr + nbytes.
        while lo < hi:
            mid = (lo + hi) // 2
            if self.lasts[mid] < addr:
                lo = mid + 1
            else:
                hi = mid
        if lo >= self.count:
            return False
        if self.starts[lo] <= addr:
            return True  # that range holds addr itself
        return self.starts[lo] - addr < nbytes

    def overlaps(self, CopyPlan plan not None, bint dst_side):
        """Whether any descriptor's destination (or source) range meets a range of the set."""
        cdef size_t i
        cdef bint hit = False
        with nogil:
            for i in range(plan.count):
                if self._overlaps(plan.descs[i].dst if dst_side else plan.descs[i].src, plan.descs[i].nbytes):
                    hit = True
                    break
        return hit

    def first_outside(self, CopyPlan plan not None, bint dst_side):
        """Index of the first descriptor whose destination (or source) range is not wholly
        inside one range of the set, or -1 when all are."""
        cdef size_t i
        cdef Py_ssize_t bad = -1
        with nogil:
            for i in range(plan.count):
                if not self._contains(plan.descs[i].dst if dst_side else plan.descs[i].src,
                                      plan.descs[i].nbytes):
                    bad = <Py_ssize_t>i
                    break
        return bad
