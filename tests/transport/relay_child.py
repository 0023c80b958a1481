"""A same-host relay that tries to strip a link's protection (issue 32, defect 1), run as its own
process (as root or as another uid) by ``test_protection.py``. Standard library only, so that a
user without access to the package can run it.

    python relay_child.py SERVER_PORT CAPTURE_FILE

It listens on 127.0.0.1 (the port is printed as the first line of stdout) and forwards every TCP
connection to the server at 127.0.0.1:SERVER_PORT. In each server-to-client stream it reads the
frames up to the HELLO_REPLY and rewrites that reply's ``unix`` field, the abstract name of the
server's Unix socket, to a socket of its own, which it relays to the real one. Whatever crosses
those Unix relays (both ways) is appended to CAPTURE_FILE (at most 16 MiB), so the test can see
whether block bytes passed in the clear. It runs until killed.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading

HEADER = struct.Struct("<4sHHIQQ")  # magic, version, op, status, req_id, length (transport/wire.py)
OP_HELLO_REPLY = 2
CAPTURE_LIMIT = 16 << 20

lock = threading.Lock()
state = {"real_unix": None, "captured": 0}


def read_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def shut(*socks: socket.socket) -> None:
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def pump(source: socket.socket, sink: socket.socket, capture) -> None:
    try:
        while True:
            data = source.recv(1 << 16)
            if not data:
                break
            if capture is not None:
                with lock:
                    room = CAPTURE_LIMIT - state["captured"]
                    if room > 0:
                        capture.write(data[:room])
                        capture.flush()
                        state["captured"] += min(room, len(data))
            sink.sendall(data)
    except OSError:
        pass
    finally:
        shut(source, sink)


def rewrite_replies(server: socket.socket, client: socket.socket, my_unix: str) -> None:
    """Server to client: frames up to the HELLO_REPLY, its ``unix`` rewritten, then raw bytes."""
    try:
        while True:
            head = read_exact(server, HEADER.size)
            magic, version, op, status, req_id, length = HEADER.unpack(head)
            body = read_exact(server, length)
            if op == OP_HELLO_REPLY:
                reply = json.loads(body)
                if isinstance(reply.get("unix"), str):
                    with lock:
                        state["real_unix"] = reply["unix"]
                    reply["unix"] = my_unix
                    body = json.dumps(reply).encode()
                    head = HEADER.pack(magic, version, op, status, req_id, len(body))
                client.sendall(head + body)
                break
            client.sendall(head + body)
    except (OSError, EOFError, ValueError):
        shut(server, client)
        return
    pump(server, client, None)


def serve_tcp(listener: socket.socket, server_port: int, my_unix: str) -> None:
    while True:
        client, _ = listener.accept()
        server = socket.create_connection(("127.0.0.1", server_port))
        threading.Thread(target=pump, args=(client, server, None), daemon=True).start()
        threading.Thread(target=rewrite_replies, args=(server, client, my_unix), daemon=True).start()


def serve_unix(listener: socket.socket, capture) -> None:
    while True:
        client, _ = listener.accept()
        with lock:
            real = state["real_unix"]
        if real is None:
            client.close()
            continue
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.connect("\0" + real)
        threading.Thread(target=pump, args=(client, server, capture), daemon=True).start()
        threading.Thread(target=pump, args=(server, client, capture), daemon=True).start()


def main() -> None:
    server_port, capture_path = int(sys.argv[1]), sys.argv[2]
    capture = open(capture_path, "ab")
    my_unix = f"llm_datadist.relay.{os.getpid()}"
    unix_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix_listener.bind("\0" + my_unix)
    unix_listener.listen(64)
    tcp_listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=serve_unix, args=(unix_listener, capture), daemon=True).start()
    print(tcp_listener.getsockname()[1], flush=True)
    serve_tcp(tcp_listener, server_port, my_unix)


if __name__ == "__main__":
    main()
