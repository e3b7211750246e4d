"""A flood of handshakes against a receiver, from its own process:

    python handshake_flood.py PORT COUNT MODE [THREADS]

MODE ``wrong-proof``: HELLO (PSK mode, a new identity each time), then an
AUTH with a wrong proof; ``hello-close``: HELLO, then close before AUTH;
``complete-close``: the whole handshake without a key, then close.  Each
connection reads until the receiver closes it.  Prints the count done.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading

MAGIC = 0x4642564B


def frame(ftype: int, payload: bytes) -> bytes:
    return struct.pack("<IBBHI", MAGIC, 1, ftype, 0, len(payload)) + payload


def hello(identity: str, auth: int) -> bytes:
    ident = identity.encode()
    fixed = struct.pack("<BBBBQII32s", 1, 1, auth, 0, 0, 1 << 20, 7, os.urandom(32))
    return frame(0x01, fixed + struct.pack("<H", len(ident)) + ident)


def read_frame(s: socket.socket) -> int | None:
    head = b""
    while len(head) < 12:
        got = s.recv(12 - len(head))
        if not got:
            return None
        head += got
    _m, _v, ftype, _f, n = struct.unpack("<IBBHI", head)
    while n:
        got = s.recv(min(n, 65536))
        if not got:
            return None
        n -= len(got)
    return int(ftype)


def one(port: int, i: int, mode: str) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(hello(f"flood-{i}", 1 if mode == "wrong-proof" else 0))
        if mode == "hello-close":
            return
        if read_frame(s) != 0x02:  # HELLO_ACK
            return
        s.sendall(frame(0x03, bytes(32)))  # AUTH: zeros (a wrong proof with a key)
        while read_frame(s) is not None:  # ERROR, or READY (then we close)
            if mode == "complete-close":
                return


def main() -> None:
    port, count, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    threads = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    done = [0]
    lock = threading.Lock()
    next_i = iter(range(count))

    def worker() -> None:
        while True:
            with lock:
                i = next(next_i, None)
            if i is None:
                return
            try:
                one(port, i, mode)
            except OSError:
                pass
            with lock:
                done[0] += 1

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    print(done[0], flush=True)


if __name__ == "__main__":
    main()
