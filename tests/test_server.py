"""The memory server: limits, bad bytes on the wire, the smb2-server command."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tracemalloc

import msgpack
import numpy as np
import pytest

import smb2
from smb2 import _core
from smb2.errors import ErrorCode
from smb2.protocol import FLAG_REPLY, VERSION, Op
from smb2.testing import wire
from smb2.testing.launch import ServerProcess, ready_address


async def _raw(server: smb2.Server) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(*server.address)


async def _serves_others(server: smb2.Server) -> None:
    async with await smb2.connect([server.address]) as c:
        buf = await c.create("canary", 4096)
        await buf.write(10, b"alive")
        assert bytes(await buf.read(10, 5)) == b"alive"


@pytest.fixture
async def server() -> smb2.Server:
    s = await smb2.start_server("127.0.0.1", 0, capacity="64MiB")
    yield s
    await s.close()


async def test_start_server_address_and_close() -> None:
    s = await smb2.start_server(port=0, capacity="1MiB")
    host, port = s.address
    assert host == "127.0.0.1" and port > 0
    await s.close()
    with pytest.raises(smb2.TransportError):
        await smb2.connect([f"{host}:{port}"], timeout=5)


async def test_repr_says_where_and_how_full() -> None:
    s = smb2.Server(capacity="1MiB", rdma="off")
    assert repr(s) == "<MemoryServer not listening: 0 buffers, 0 of 1048576 bytes used, 0 connections, rdma off>"
    await s.start("127.0.0.1", 0)
    try:
        async with await smb2.connect([s.address]) as c:
            await c.create("r", 4096, stripe=4096)
            assert repr(s) == (f"<MemoryServer 127.0.0.1:{s.address[1]}: 1 buffers, 4096 of 1048576 bytes "
                               "used, 1 connections, rdma off>")
    finally:
        await s.close()


async def test_capacity_is_enforced(server: smb2.Server) -> None:
    async with await smb2.connect([server.address]) as c:
        await c.create("fits", 48 << 20)
        with pytest.raises(smb2.OutOfMemory, match="free"):
            await c.create("too-big", 32 << 20)
        assert await c.buffers() == ["fits"]
        await c.destroy("fits")
        await c.create("now-fits", 60 << 20)


async def test_failed_create_leaves_nothing_behind() -> None:
    big = await smb2.start_server(port=0, capacity="64MiB")
    small = await smb2.start_server(port=0, capacity="1MiB")
    try:
        async with await smb2.connect([big.address, small.address]) as c:
            with pytest.raises(smb2.OutOfMemory):
                await c.create("half", 16 << 20)
            assert await c.buffers() == []
            assert big.used == 0
    finally:
        await big.close()
        await small.close()


async def test_segments_are_page_aligned(server: smb2.Server) -> None:
    async with await smb2.connect([server.address]) as c:
        for n in (1, 4097, 1 << 20):
            await c.create(f"p{n}", n)
    for seg in server.segments.values():
        assert seg.mem.ctypes.data % 4096 == 0


@pytest.mark.parametrize("garbage", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 8,
    os.urandom(64),
    b"\x53\x32" + b"\xff" * 30,                      # magic right, rest nonsense
], ids=["http", "random", "magic-then-nonsense"])         # ids fixed: xdist workers must collect the same names
async def test_garbage_closes_that_connection_only(server: smb2.Server, garbage: bytes) -> None:
    reader, writer = await _raw(server)
    writer.write(garbage)
    await writer.drain()
    assert await wire.closed(reader)
    writer.close()
    await _serves_others(server)


async def test_absurd_length_allocates_nothing(server: smb2.Server) -> None:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for op in (Op.WRITE, Op.ACCUMULATE, Op.CONTROL, Op.READ):
            reader, writer = await _raw(server)
            writer.write(wire.hello() + wire.frame(op, length=2**62, rid=2))
            await writer.drain()
            hdr, _ = await wire.reply(reader)                 # hello's reply
            assert hdr[4] == 0
            hdr, body = await wire.reply(reader)
            assert hdr[4] == ErrorCode.TOO_LARGE
            assert b"limit" in body or b"exceeds" in body
            assert await wire.closed(reader)
            writer.close()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 4 << 20, f"server allocated {grown} bytes for absurd lengths"
    await _serves_others(server)


async def test_truncated_frame_then_disconnect(server: smb2.Server) -> None:
    reader, writer = await _raw(server)
    writer.write(wire.hello() + wire.frame(Op.WRITE, length=1000, rid=2)[:20])
    await writer.drain()
    await wire.reply(reader)
    writer.close()
    # and a header promising a payload that never fully comes
    reader, writer = await _raw(server)
    async with await smb2.connect([server.address]) as c:
        buf = await c.create("trunc", 4096)
        seg = buf.segments[0]
    writer.write(wire.hello() + wire.frame(Op.WRITE, b"x" * 10, rid=2, segment=seg, length=100))
    await writer.drain()
    await wire.reply(reader)
    writer.close()
    await asyncio.sleep(0.05)
    assert not server.segments[seg].inflight     # the half write was forgotten
    await _serves_others(server)


async def test_unknown_op_and_bad_version_and_reply_flag(server: smb2.Server) -> None:
    cases = [
        (wire.frame(99), ErrorCode.BAD_REQUEST),
        (wire.frame(Op.CONTROL, b"", version=VERSION + 1), ErrorCode.VERSION_MISMATCH),
        (wire.frame(Op.READ, length=8, flags=FLAG_REPLY), ErrorCode.BAD_REQUEST),
    ]
    for frame, code in cases:
        reader, writer = await _raw(server)
        writer.write(wire.hello() + frame)
        await writer.drain()
        await wire.reply(reader)
        hdr, _ = await wire.reply(reader)
        assert hdr[4] == code
        assert await wire.closed(reader)
        writer.close()
    await _serves_others(server)


async def test_data_before_hello_is_refused(server: smb2.Server) -> None:
    reader, writer = await _raw(server)
    writer.write(wire.frame(Op.READ, length=8))
    await writer.drain()
    hdr, body = await wire.reply(reader)
    assert hdr[4] == ErrorCode.BAD_REQUEST and b"hello" in body
    assert await wire.closed(reader)
    writer.close()


@pytest.mark.parametrize("msg", [
    b"\xc1",                                          # not msgpack
    msgpack.packb([1, 2, 3]),                         # not a map
    msgpack.packb({"cmd": "create"}),                 # missing fields
    msgpack.packb({"cmd": "create", "name": 5, "nbytes": "x", "stripe": None,
                   "nservers": 1, "index": 0}),       # wrong types
    msgpack.packb({"cmd": "create", "name": "n" * 100000, "nbytes": 8, "stripe": 8,
                   "nservers": 1, "index": 0}),       # huge string
    msgpack.packb({"cmd": "create", "name": "x", "nbytes": 8, "stripe": 8,
                   "nservers": 1, "index": 5}),       # index out of range
    msgpack.packb({"cmd": "launch-missiles"}),
    msgpack.packb({1: 2}),                            # non-str keys
])
async def test_malformed_control_messages_get_error_replies(server: smb2.Server, msg: bytes) -> None:
    reader, writer = await _raw(server)
    writer.write(wire.hello() + wire.frame(Op.CONTROL, msg, rid=7))
    await writer.drain()
    await wire.reply(reader)
    hdr, body = await wire.reply(reader)
    assert hdr[4] == ErrorCode.BAD_REQUEST and hdr[5] == 7
    # the same connection keeps working
    writer.write(wire.frame(Op.CONTROL, msgpack.packb({"cmd": "list"}), rid=8))
    await writer.drain()
    hdr, body = await wire.reply(reader)
    assert hdr[4] == 0 and hdr[5] == 8
    writer.close()
    assert server.by_name == {} or "x" not in server.by_name


async def test_out_of_bounds_and_unknown_segment_keep_the_connection(server: smb2.Server) -> None:
    async with await smb2.connect([server.address]) as c:
        buf = await c.create("oob", 4096)
        seg = buf.segments[0]
    end = server.segments[seg].size          # whole stripes: larger than the buffer
    reader, writer = await _raw(server)
    writer.write(wire.hello()
                 + wire.frame(Op.WRITE, b"y" * 100, rid=2, segment=seg, offset=end - 50)
                 + wire.frame(Op.READ, rid=3, segment=seg + 99, length=10)
                 + wire.frame(Op.FETCH_ADD, b"\1" + b"\0" * 7, rid=4, segment=seg, offset=3)
                 + wire.frame(Op.ACCUMULATE, b"\0" * 8, rid=5, segment=seg, flags=0xF0)
                 + wire.frame(Op.WRITE, b"z" * 10, rid=6, segment=seg, offset=0))
    await writer.drain()
    codes = {}
    for _ in range(6):
        hdr, _ = await wire.reply(reader)
        codes[hdr[5]] = hdr[4]
    assert codes == {1: 0, 2: ErrorCode.OUT_OF_BOUNDS, 3: ErrorCode.NO_SUCH_BUFFER,
                     4: ErrorCode.BAD_REQUEST, 5: ErrorCode.BAD_REQUEST, 6: 0}
    writer.close()
    assert bytes(server.segments[seg].mem[:10]) == b"z" * 10
    assert not server.segments[seg].mem[end - 50:].any()


async def test_many_pipelined_small_frames_in_one_burst(server: smb2.Server) -> None:
    async with await smb2.connect([server.address]) as c:
        buf = await c.create("burst", 1 << 16)
        seg = buf.segments[0]
    reader, writer = await _raw(server)
    frames = [wire.hello()] + [wire.frame(Op.FETCH_ADD, _core.pack_u64(1), rid=10 + k, segment=seg)
                           for k in range(5000)]
    writer.write(b"".join(frames))
    await writer.drain()
    olds = []
    for _ in range(5001):
        hdr, body = await wire.reply(reader)
        if hdr[2] == Op.FETCH_ADD:
            olds.append(_core.unpack_u64(body))
    assert sorted(olds) == list(range(5000))
    writer.close()


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "smb2.server", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_smb2_server_command_prints_ready_line_and_stops_cleanly() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        # the launcher waits for the ready line and says where it listens
        with ServerProcess("--capacity", "16MiB", host="127.0.0.1") as srv:
            assert srv.host == "127.0.0.1"
            port = srv.port

            async def use(port: int) -> None:
                async with await smb2.connect([f"127.0.0.1:{port}"]) as c:
                    buf = await c.create("cli", 1000)
                    await buf.write(0, np.arange(10, dtype=np.int64))
                    assert (await c.stat())[0]["buffers"]["cli"]["size"] >= 1000
            asyncio.run(use(port))
            assert srv.stop(timeout=10, sig=sig) == 0


def test_the_launcher_reads_the_ready_line_and_says_why_a_server_did_not_start() -> None:
    assert ready_address(b"smb2-server listening on 10.0.0.2:7420\n") == ("10.0.0.2", 7420)
    assert ready_address("smb2-server: error: something else") is None
    with pytest.raises(smb2.InterfaceError, match="(?s)did not start .*not a size"):
        ServerProcess("--capacity", "lots")


def test_smb2_server_command_rejects_bad_options() -> None:
    proc = _spawn("--capacity", "lots")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "not a size" in err
    for option, value, words in [("--lock-spin", "-1", "lock spin must be in [0, 0.1] s"),
                                 ("--lock-spin", "0.5", "lock spin must be in [0, 0.1] s"),
                                 ("--lock-lease", "0", "lock lease must be in (0, 3600] s"),
                                 ("--lock-slots", "0", "lock slots must be in 1..")]:
        proc = _spawn("--port", "0", option, value)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 2 and words in err and "Traceback" not in err, (option, value, err)
    # a port in use
    with ServerProcess() as holder:
        proc = _spawn("--port", str(holder.port))
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 1 and "cannot listen" in err
