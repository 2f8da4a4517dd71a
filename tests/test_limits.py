"""Limits: buffers per server, and memory per connection under clients that
flood requests without reading replies, or queue accumulates behind a write
that never completes.  (Frame size, control size and capacity limits are in
test_server.py.)"""

from __future__ import annotations

import asyncio
import socket
import tracemalloc
from collections.abc import AsyncIterator

import numpy as np
import pytest

import smb2
from smb2.protocol import DTYPE_SHIFT, WIRE_CODES, Op
from smb2.testing import wire

MiB = 1 << 20


@pytest.fixture
async def server() -> AsyncIterator[smb2.Server]:
    s = await smb2.start_server("127.0.0.1", 0, capacity="64MiB", max_buffers=3)
    yield s
    await s.close()


async def test_max_buffers(server: smb2.Server) -> None:
    async with await smb2.connect([server.address]) as c:
        for i in range(3):
            await c.create(f"b{i}", 100)
        with pytest.raises(smb2.OutOfMemory, match="maximum of 3 buffers"):
            await c.create("b3", 100)
        await c.create("b0", 100)          # an existing one is still fine (idempotent)
        await c.destroy("b1")
        await c.create("b3", 100)


async def _reply(reader: asyncio.StreamReader) -> tuple[int, ...]:
    return (await wire.reply(reader))[0]


def _flood(address: tuple[str, int], data: bytes) -> socket.socket:
    """Send as much of ``data`` as the server takes, reading nothing back."""
    s = socket.create_connection(address)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setblocking(False)
    try:
        s.send(data)
    except BlockingIOError:
        pass
    return s


async def _server_memory(server: smb2.Server, seconds: float) -> tuple[int, int]:
    """Peak traced memory and the largest write buffer of the server's
    connections over ``seconds``."""
    peak_buf = 0
    tracemalloc.reset_peak()
    end = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < end:
        await asyncio.sleep(0.02)
        for conn in server.connections:
            if conn.transport is not None:
                peak_buf = max(peak_buf, conn.transport.get_write_buffer_size())
    return tracemalloc.get_traced_memory()[1], peak_buf


@pytest.mark.parametrize("code", [0, WIRE_CODES["bfloat16"]], ids=["plain", "narrowing"])
async def test_flood_of_reads_without_reading_replies(server: smb2.Server, code: int) -> None:
    """4000 pipelined 4 MiB READs arrive in one recv (128 KiB of headers):
    the server must not answer all of them into its send buffer (16 GiB).
    A narrowing READ's reply is made (rounded) for it, not a view of the
    segment: no more of those either."""
    async with await smb2.connect([server.address]) as c:
        buf = await c.create("src", 8 * MiB)
        await buf.write(0, np.ones(buf.nbytes, np.uint8))
        seg = buf.segments[0]
    reqs = wire.hello() + b"".join(wire.frame(Op.READ, rid=k + 2, segment=seg, length=4 * MiB,
                                              flags=code << DTYPE_SHIFT) for k in range(4000))
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        sock = _flood(server.address, reqs)
        peak, peak_buf = await _server_memory(server, 1.5)
    finally:
        tracemalloc.stop()
    sock.close()
    # the transport's high-water mark plus one reply
    assert peak_buf < 12 * MiB, peak_buf
    assert peak - base < 32 * MiB, f"{(peak - base) >> 20} MiB for one flooding connection"
    async with await smb2.connect([server.address]) as c:
        assert bytes(await (await c.attach("src")).read(0, 3)) == b"\1\1\1"


async def test_flood_of_small_requests_without_reading_replies(server: smb2.Server) -> None:
    async with await smb2.connect([server.address]) as c:
        seg = (await c.create("ctr", 4096)).segments[0]
    one = wire.frame(Op.FETCH_ADD, (1).to_bytes(8, "little"), rid=7, segment=seg)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        socks = [_flood(server.address, wire.hello() + one * 20000) for _ in range(4)]
        peak, peak_buf = await _server_memory(server, 1.0)
    finally:
        tracemalloc.stop()
    for s in socks:
        s.close()
    assert peak_buf < 1 * MiB and peak - base < 16 * MiB, (peak_buf, peak - base)


async def test_accumulates_queued_behind_a_stalled_write_are_bounded(server: smb2.Server) -> None:
    """Connection A starts a 1 MiB write and stalls half way; connection B
    floods accumulates over that range.  They wait (atomicity), but B stops
    being read once a bounded amount is queued, and all of them are applied
    once A goes away."""
    async with await smb2.connect([server.address]) as c:
        seg = (await c.create("acc", 4 * MiB)).segments[0]
    ra, wa = await asyncio.open_connection(*server.address)
    wa.write(wire.hello() + wire.frame(Op.WRITE, b"\0" * (512 << 10), rid=2, segment=seg, length=MiB))
    await wa.drain()
    await _reply(ra)                                        # hello
    n = 60
    delta = np.ones(MiB // 8, np.int64).tobytes()
    acc = wire.frame(Op.ACCUMULATE, delta, rid=9, segment=seg, flags=4 << 4)   # int64
    rb, wb = await asyncio.open_connection(*server.address)
    wb.write(wire.hello() + acc * n)           # 60 MiB of deltas
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        _, _ = await _server_memory(server, 1.0)
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    conn_b = [cn for cn in server.connections if cn.ops.deferred_bytes]
    assert len(conn_b) == 1 and conn_b[0].held
    assert held < 24 * MiB, f"{held >> 20} MiB queued behind a stalled write"
    # A goes away: its half write is dropped, every accumulate is applied in order
    wa.transport.abort()
    await _reply(rb)                                        # hello
    for _ in range(n):
        hdr = await _reply(rb)
        assert hdr[4] == 0 and hdr[2] == Op.ACCUMULATE
    wb.close()
    async with await smb2.connect([server.address]) as c:
        got = (await (await c.attach("acc")).read(0, MiB)).view(np.int64)
        assert (got == n).all()


async def test_a_stalled_write_is_cut_after_the_write_timeout() -> None:
    """A writer that stops half way (SIGSTOP, a hung peer) would hold up every
    overlapping accumulate forever: the server cuts it after write_timeout.
    (One that trickles is in test_hardening_server.py.)"""
    # 500 bytes of payload per 0.5 s count as progress
    s = await smb2.start_server("127.0.0.1", 0, capacity="16MiB", write_timeout=0.5, write_min_rate=1000)
    try:
        async with await smb2.connect([s.address]) as c:
            buf = await c.create("w", MiB)
            ra, wa = await asyncio.open_connection(*s.address)
            wa.write(wire.hello() + wire.frame(Op.WRITE, b"\1" * 1000, rid=2, segment=buf.segments[0], length=MiB))
            await wa.drain()
            await _reply(ra)
            t0 = asyncio.get_running_loop().time()
            await asyncio.wait_for(buf.accumulate(0, np.ones(8, np.int64)), 5)
            waited = asyncio.get_running_loop().time() - t0
            assert 0.3 < waited < 2.5, waited
            hdr = await _reply(ra)                 # the reason, then the close
            assert hdr[4] != 0
            assert await ra.read() == b""
            wa.close()
            # a slow but steady writer is not cut
            ra, wa = await asyncio.open_connection(*s.address)
            wa.write(wire.hello() + wire.frame(Op.WRITE, b"", rid=2, segment=buf.segments[0], length=8000))
            for _ in range(8):
                await asyncio.sleep(0.2)
                wa.write(b"\2" * 1000)
            await _reply(ra)
            assert (await _reply(ra))[4] == 0
            wa.close()
            assert (await buf.read(0, 8000) == 2).all()
    finally:
        await s.close()


def test_a_buffer_cap_beyond_the_file_limit_is_refused_at_start() -> None:
    """Each buffer's segment holds two descriptors (a memfd and its
    mapping): a cap that the process's file limit cannot hold is refused
    when the options are made, saying so; with --shm off segments hold none."""
    from smb2.errors import InvalidArgumentError
    from smb2.server.memfd import fd_limit
    from smb2.server.options import ServerOptions
    too_many = fd_limit() // 2
    with pytest.raises(InvalidArgumentError, match=r"2 per buffer: its memfd and its mapping") as err:
        ServerOptions(max_buffers=too_many, shm="auto")
    assert "ulimit -n" in (err.value.hint or "")
    assert ServerOptions(max_buffers=too_many, shm="off").max_buffers == too_many


def test_the_default_buffer_cap_is_lowered_to_the_file_limit() -> None:
    # a process allowed 3000 files: the connections' default takes half of them (the file limit
    # binds before this machine's memory does), the default 4096 buffers do not fit beside them,
    # and are lowered with a WARNING
    import subprocess
    import sys
    script = ("import logging, resource; logging.basicConfig(); resource.setrlimit(resource.RLIMIT_NOFILE, "
              "(3000, 3000)); from smb2.server.options import ServerOptions; o = ServerOptions(); "
              "print(o.max_connections, o.max_buffers)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    connections, buffers = map(int, out.stdout.split())
    assert connections == (3000 - 64) // 2
    assert buffers == (3000 - connections - 64) // 2 - 1
    assert "max buffers lowered from 4096" in out.stderr and "ulimit -n" in out.stderr
