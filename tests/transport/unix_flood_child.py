"""A stranger that floods a cluster's abstract Unix listener, for ``test_same_host_links.py``:
standard library only, run as another user (uid 65534). The listener's name is no secret:
``/proc/net/unix`` shows it to every local user (``@llm_datadist.<pid>.<hex>``).

    python3 unix_flood_child.py PID SECONDS

It connects as fast as it can and holds what the server keeps open, dropping what the server
closes, until SECONDS have passed; it prints ``started`` after its first round, then at the end
``connects N eagain M``: how many connections it made and how often the backlog was full.
"""

import select
import socket
import sys
import time


def listener_names(pid):
    found = set()
    with open("/proc/net/unix") as table:
        for line in table:
            fields = line.split()
            if len(fields) >= 8 and fields[-1].startswith(f"@llm_datadist.{pid}."):
                found.add(fields[-1][1:])
    return sorted(found)


def drop_closed(held):
    """The connections the server closed (evicted, refused, timed out) leave ``held``."""
    if not held:
        return held
    poller = select.poll()
    by_fd = {sock.fileno(): sock for sock in held}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    gone = set()
    for fd, _ in poller.poll(0):
        try:
            if by_fd[fd].recv(1) == b"":
                gone.add(fd)
        except OSError:
            gone.add(fd)
    for fd in gone:
        by_fd[fd].close()
    return [sock for sock in held if sock.fileno() not in gone]


def main():
    pid, seconds = int(sys.argv[1]), float(sys.argv[2])
    names = listener_names(pid)
    if not names:
        print("no listener", flush=True)
        sys.exit(2)
    held, connects, eagain, said = [], 0, 0, False
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        for name in names:
            for _ in range(128):
                if len(held) > 900:  # (the descriptor limit)
                    break
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.setblocking(False)
                try:
                    sock.connect("\0" + name)
                except BlockingIOError:
                    eagain += 1
                    sock.close()
                    break
                except OSError:
                    sock.close()
                    break
                connects += 1
                held.append(sock)
        if not said:
            print("started", flush=True)
            said = True
        held = drop_closed(held)
        time.sleep(0.001)
    print(f"connects {connects} eagain {eagain}", flush=True)
    for sock in held:
        sock.close()


if __name__ == "__main__":
    main()
