"""A same-host peer written with the standard library only, run by the cuda_ipc tests as another
user (``setpriv``) or as this one: it links to a cluster over its abstract Unix socket, asks for
its cache table and prints, as one JSON line, what the reply says about ``cuda_ipc``.

It imports nothing of the package (a process of another user cannot read this interpreter's
installation), so the frame layout, the operation codes and the HMAC labels come in the JSON
argument, taken by the test from ``llm_datadist.transport``. The link's reverse connection is
served with an empty table, so the owner settles its own plane towards us (tcp) and keeps the link.
"""

import hashlib
import hmac
import json
import os
import socket
import struct
import sys
import threading

CONFIG = json.loads(sys.argv[1])
HEADER = struct.Struct(CONFIG["header"])
MAGIC, VERSION, OP = CONFIG["magic"].encode(), CONFIG["version"], CONFIG["ops"]
SECRET = None if CONFIG["secret"] is None else CONFIG["secret"].encode()
ME = CONFIG["cluster_id"]


def send(sock, op, obj, req_id=1):
    body = json.dumps(obj).encode()
    sock.sendall(HEADER.pack(MAGIC, VERSION, op, 0, req_id, len(body)) + body)


def read_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def recv(sock):
    _, _, op, status, req_id, length = HEADER.unpack(read_exact(sock, HEADER.size))
    body = read_exact(sock, length)
    return op, status, req_id, json.loads(body) if body else {}


def proof(side, client_nonce, server_nonce, server_id):
    message = b"|".join([bytes.fromhex(CONFIG["labels"][side]), bytes.fromhex(client_nonce),
                         bytes.fromhex(server_nonce), str(ME).encode(), str(server_id).encode()])
    return hmac.new(SECRET, message, hashlib.sha256).hexdigest()


def mac(side, client_nonce, server_nonce, server_id, message):
    """Protocol 8's MAC of an AUTH message (``auth.message_mac``, written again here)."""
    signed = {key: value for key, value in message.items() if key not in ("proof", "self_proof", "mac")}
    body = json.dumps([signed], sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    head = b"|".join([bytes.fromhex(CONFIG["labels"][side]), bytes.fromhex(client_nonce),
                      bytes.fromhex(server_nonce), str(ME).encode(), str(server_id).encode()])
    return hmac.new(SECRET, head + b"|" + hashlib.sha256(body).digest(), hashlib.sha256).hexdigest()


def handshake(sock, request):
    nonce = os.urandom(32).hex()
    send(sock, OP["HELLO"], {"cluster_id": ME, "nonce": nonce, "auth": SECRET is not None})
    op, status, _, challenge = recv(sock)
    if status != 0:
        raise SystemExit(f"hello refused: {challenge}")
    message = dict(request)
    if SECRET is not None:
        message["proof"] = proof("client", nonce, challenge["nonce"], challenge["cluster_id"])
        message["mac"] = mac("request", nonce, challenge["nonce"], challenge["cluster_id"], message)
    send(sock, OP["AUTH"], message)
    op, status, _, reply = recv(sock)
    if status != 0:
        raise SystemExit(f"authentication refused: {reply}")
    return reply


def serve_reverse(sock):
    try:
        while True:
            op, _, req_id, _ = recv(sock)
            if op != OP["TABLE_GET"]:
                return
            send(sock, OP["TABLE"], {"generation": 1, "caches": [], "blocks": [], "keys": []}, req_id)
    except (EOFError, OSError):
        return


first = socket.create_connection(("127.0.0.1", CONFIG["port"]), timeout=20)
reply = handshake(first, {"purpose": "link", "role": "DECODER", "planes": ["cuda_ipc", "tcp"], "host": {},
                          "remote_cache_accessible": True, "connections": [1, 1], "pid": os.getpid(),
                          "uid": os.getuid()})
conns = []
for purpose in ("forward", "reverse"):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.connect("\0" + reply["unix"])
    handshake(sock, {"purpose": purpose, "token": reply["token"]})
    conns.append(sock)
first.close()
forward, reverse = conns
threading.Thread(target=serve_reverse, args=(reverse,), daemon=True).start()
send(forward, OP["TABLE_GET"], {}, 2)
op, status, _, table = recv(forward)
if op != OP["TABLE"] or status != 0:
    raise SystemExit(f"table request answered with op {op}, status {status}")
print(json.dumps({"uid": os.getuid(), "caches": len(table.get("caches", [])), "cuda_ipc": table.get("cuda_ipc")}),
      flush=True)
for sock in conns:
    sock.close()
