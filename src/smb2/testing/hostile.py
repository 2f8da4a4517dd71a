"""Hostile and watching clients: what the hardening tests and
``tools/bench_attacks.py`` do to a memory server (connections that never
speak, trickling writes, unread replies, token guesses, shm writers and lock
words a client can reach) and the clients that check it still serves
(:func:`well_behaved`, :class:`SlowestRead`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time

import msgpack
import numpy as np

import smb2
from smb2 import auth
from smb2.errors import LockTimeout, TransportError
from smb2.protocol import Op
from smb2.transport import ShmTransport

from . import wire
from .launch import ServerProcess

MiB = 1 << 20

# -- over TCP -------------------------------------------------------------------------

TOKEN = b"the right token"


async def rss_over(server: ServerProcess, seconds: float) -> int:
    """The server's largest RSS seen over ``seconds``."""
    peak = server.rss
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await asyncio.sleep(0.05)
        peak = max(peak, server.rss)
    return peak


async def well_behaved(address: tuple[str, int], token: bytes | None = None) -> None:
    """A client still gets correct answers."""
    async with await smb2.connect([address], token=token) as c:
        buf = await c.create(f"ok{os.getpid()}-{time.monotonic_ns()}", MiB)
        data = np.arange(MiB // 8, dtype=np.int64)
        await buf.write(0, data)
        await buf.accumulate(0, np.ones(MiB // 8, np.int64))
        assert ((await buf.read(0, MiB)).view(np.int64) == data + 1).all()
        await c.destroy(buf.name)


def open_sockets(address: tuple[str, int], n: int, first: bytes = b"",
                 source: str = "127.0.0.1") -> list[socket.socket]:
    """``n`` connections that send ``first`` and nothing more."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(address, source_address=(source, 0))
        if first:
            s.sendall(first)
        socks.append(s)
    return socks


async def trickle(writer: asyncio.StreamWriter) -> None:
    """One byte every 0.1 s into ``writer`` until the server cuts it."""
    with contextlib.suppress(ConnectionError):
        while True:
            writer.write(b"\1")
            await writer.drain()
            await asyncio.sleep(0.1)


def unread_reads(address: tuple[str, int], segment: int, n: int = 8000) -> socket.socket:
    """A connection that sends hello and ``n`` pipelined 64 KiB READs of
    ``segment`` (at least 4 MiB) and reads none of the replies."""
    reads = b"".join(wire.frame(Op.READ, rid=k + 2, segment=segment, offset=(k % 64) << 16, length=64 << 10)
                     for k in range(n))
    s = socket.create_connection(address)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        s.send(wire.hello() + reads)
    return s


def closed_by_server(s: socket.socket, timeout: float = 10) -> bool:
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


async def guess(address: tuple[str, int], source: str, token: bytes) -> bytes:
    """One raw handshake; the auth reply's message ('' when accepted)."""
    reader, writer = await asyncio.open_connection(*address, local_addr=(source, 0))
    try:
        writer.write(wire.hello())
        _, body = await wire.reply(reader)
        nonce = os.urandom(32)
        proof = auth.client_proof(token, msgpack.unpackb(body)["nonce"], nonce)
        writer.write(wire.control({"cmd": "auth", "nonce": nonce, "proof": proof}, 2))
        hdr, body = await wire.reply(reader)
        return b"" if hdr[4] == 0 else msgpack.unpackb(body)["message"].encode()
    finally:
        writer.close()


async def keep_guessing(address: tuple[str, int], stop: asyncio.Event, pause: float) -> int:
    """Wrong proofs from 127.0.0.1, ``pause`` seconds apart, until ``stop``:
    how many were refused as wrong."""
    failed = 0
    while not stop.is_set():
        failed += b"authentication failed" in await guess(address, "127.0.0.1", b"guess")
        await asyncio.sleep(pause)
    return failed


# -- over shm ---------------------------------------------------------------------------

def shm_of(client: smb2.Client) -> ShmTransport:
    t = client.links[0].open
    assert isinstance(t, ShmTransport), t
    return t


REGION = 4 * MiB


WARM_UP = 5


def fill_region(address: tuple[str, int], name: str, region: int, acked: list[int],
                stop: threading.Event, going: threading.Semaphore) -> None:
    """Fill our region with the sequence number, again and again, over shm;
    ``acked[region]`` is the last one a write returned for.  ``going`` is
    released after WARM_UP writes."""
    async def run() -> None:
        async with await smb2.connect([address], transport="shm") as c:
            buf = await c.attach(name)
            seq = 0
            while not stop.is_set():
                seq += 1
                try:
                    await buf.write(region * REGION, np.full(REGION // 8, seq, np.int64))
                except (TransportError, smb2.NoSuchBuffer):
                    return          # the server stopped: this write was not acknowledged
                acked[region] = seq
                if seq == WARM_UP:
                    going.release()
    try:
        asyncio.run(run())
    finally:
        going.release()     # a writer that failed early must not hold the test up


def start_writers(address: tuple[str, int], name: str, n: int, acked: list[int],
                  stop: threading.Event) -> list[threading.Thread]:
    """``n`` writer threads (fill_region), once each has written WARM_UP times."""
    going = threading.Semaphore(0)
    threads = [threading.Thread(target=fill_region, args=(address, name, r, acked, stop, going))
               for r in range(n)]
    for t in threads:
        t.start()
    for _ in threads:
        assert going.acquire(timeout=30)
    return threads


def claim_fds(path: str, ticket: bytes) -> list[int]:
    """What the shm transport does to get a grant's fds: the ticket in, the
    fds out (SCM_RIGHTS)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        sock.sendall(ticket)
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 64)
        assert "segments" in msgpack.unpackb(msg), msg
        return fds


async def lock_offset(c: smb2.Client, name: str) -> int:
    info = await c.links[0].open.control({"cmd": "lock_open", "name": name})  # type: ignore[union-attr]
    return int(info["offset"])


async def lock_words(c: smb2.Client, name: str) -> tuple[int, int]:
    lock = (await c.stat())[0]["locks"]["locks"][name]
    return int(lock["next_ticket"]), int(lock["now_serving"])


async def acquire_within(lock: smb2.Lock, timeout: float) -> float:
    """How long ``acquire(timeout)`` took; LockTimeout is an answer too."""
    t0 = time.monotonic()
    with contextlib.suppress(LockTimeout):
        await lock.acquire(timeout=timeout)
        await lock.release()
    return time.monotonic() - t0


# -- watching the server serve ---------------------------------------------------------

class LoopWatch:
    """The longest the loop went without running a 1 ms ticker."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.001)
            now = time.monotonic()
            self.worst = max(self.worst, now - last)
            last = now

    def stop(self) -> float:
        self._task.cancel()
        return self.worst


class SlowestRead:
    """Reads 8 bytes of ``buf`` over and over until ``stop()``: ``worst`` is
    the longest one took (a read's error surfaces at ``stop()``)."""

    def __init__(self, buf: smb2.Buffer) -> None:
        self.buf = buf
        self.worst = 0.0
        self._done = False
        self._task = asyncio.ensure_future(self._ping())

    async def _ping(self) -> None:
        while not self._done:
            t0 = time.monotonic()
            await self.buf.read(0, 8)
            self.worst = max(self.worst, time.monotonic() - t0)

    async def stop(self) -> float:
        self._done = True
        await self._task
        return self.worst

