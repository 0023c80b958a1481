# The operating-system calls the data planes use, declared once (Linux, glibc).
from posix.uio cimport iovec
from posix.types cimport pid_t


cdef extern from "<sys/uio.h>" nogil:
    ssize_t process_vm_readv(pid_t pid, const iovec *local_iov, unsigned long liovcnt,
                             const iovec *remote_iov, unsigned long riovcnt, unsigned long flags)
    ssize_t process_vm_writev(pid_t pid, const iovec *local_iov, unsigned long liovcnt,
                              const iovec *remote_iov, unsigned long riovcnt, unsigned long flags)


cdef extern from "<limits.h>" nogil:
    enum: IOV_MAX


cdef extern from "<sys/socket.h>" nogil:
    ctypedef unsigned int socklen_t

    cdef struct msghdr:
        void *msg_name
        socklen_t msg_namelen
        iovec *msg_iov
        size_t msg_iovlen
        void *msg_control
        size_t msg_controllen
        int msg_flags

    ssize_t sendmsg(int sockfd, const msghdr *msg, int flags)
    ssize_t recvmsg(int sockfd, msghdr *msg, int flags)
    int setsockopt(int sockfd, int level, int optname, const void *optval, socklen_t optlen)
    enum: SOL_SOCKET
    enum: SO_RCVLOWAT
    enum: MSG_NOSIGNAL
    enum: MSG_DONTWAIT


cdef extern from "<poll.h>" nogil:
    cdef struct pollfd:
        int fd
        short events
        short revents

    int poll(pollfd *fds, unsigned long nfds, int timeout)
    enum: POLLIN
    enum: POLLOUT
    enum: POLLERR
    enum: POLLHUP


cdef extern from "<time.h>" nogil:
    ctypedef long time_t

    cdef struct timespec:
        time_t tv_sec
        long tv_nsec

    enum: CLOCK_MONOTONIC
    int clock_gettime(int clk_id, timespec *tp)


cdef extern from "<errno.h>" nogil:
    # Plain ints, not enums: EAGAIN and EWOULDBLOCK share a value, which a generated switch
    # would reject as a duplicate case.
    int errno
    const int EAGAIN
    const int EWOULDBLOCK
    const int EINTR
    const int ESRCH
    const int EPERM
    const int EFAULT
    const int ENOMEM
    const int EPIPE
    const int ECONNRESET
    const int ENOSYS
