"""The stand-in server: a plain-socket sink and source that prints ``smb2-server``'s ready
line, for measuring the links without the real server (``--selftest``, ``--probe``).

    python -m smb2.testing.netns.standin --host H --port P

Wire: 9-byte request, an op and a u64 big-endian n.  b"W": the client sends n bytes, the server
answers b"K" once it has all of them.  b"R": the server sends n bytes.  b"P": answers b"P" (ping).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading

CHUNK = 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m smb2.testing.netns.standin")
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--capacity", default="0")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((a.host, a.port))
    ls.listen(128)
    host, port = ls.getsockname()[:2]
    print(f"smb2-server listening on {host}:{port}", flush=True)
    payload = memoryview(bytearray(os.urandom(64)) * (CHUNK // 64))

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sink = memoryview(bytearray(CHUNK))
        try:
            while True:
                hdr = recv_exact(conn, 9)
                if hdr is None:
                    return
                op, n = hdr[:1], int.from_bytes(hdr[1:], "big")
                if op == b"P":
                    conn.sendall(b"P")
                elif op == b"W":
                    while n:
                        k = conn.recv_into(sink, min(n, CHUNK))
                        if not k:
                            return
                        n -= k
                    conn.sendall(b"K")
                elif op == b"R":
                    while n:
                        k = min(n, CHUNK)
                        conn.sendall(payload[:k])
                        n -= k
                else:
                    return
        except OSError:
            pass
        finally:
            conn.close()

    while True:
        c, _ = ls.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        b = sock.recv(n - len(buf))
        if not b:
            return None
        buf += b
    return bytes(buf)



if __name__ == "__main__":
    sys.exit(main())
