"""Raw frames for tests that talk to a server below the client API (bad
bytes, the auth gate, limits, fuzzing): build a request, read a reply, wait
for the server to close the connection."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack

from smb2 import _core
from smb2.protocol import DTYPE_SHIFT, VERSION, Op


def frame(op: int, payload: bytes = b"", *, rid: int = 1, segment: int = 0, offset: int = 0,
          length: int | None = None, flags: int = 0, version: int = VERSION) -> bytes:
    """A request frame; ``length`` defaults to the payload's (override it to lie)."""
    n = len(payload) if length is None else length
    return _core.encode_header(version, op, flags, 0, rid, segment, offset, n) + payload


def typed(op: int, code: int, payload: bytes, *, segment: int, offset: int, rid: int, flags: int = 0) -> bytes:
    """A request of an op whose flags carry a dtype ``code`` (ACCUMULATE,
    ACCUMULATE_SPARSE), with any other ``flags``."""
    return frame(op, payload, rid=rid, segment=segment, offset=offset, flags=code << DTYPE_SHIFT | flags)


def control(msg: object, rid: int = 1) -> bytes:
    return frame(Op.CONTROL, msgpack.packb(msg, use_bin_type=True), rid=rid)


def hello(rid: int = 1) -> bytes:
    return control({"cmd": "hello", "version": VERSION, "transports": ["tcp"]}, rid)


async def reply(reader: asyncio.StreamReader) -> tuple[tuple[int, ...], bytes]:
    """The next reply: its decoded header and its payload."""
    hdr = _core.decode_header(await asyncio.wait_for(reader.readexactly(32), 10))
    body = await asyncio.wait_for(reader.readexactly(hdr[8]), 10)
    return hdr, body


async def closed(reader: asyncio.StreamReader) -> bool:
    """True once the server has closed the connection (after any final reply)."""
    try:
        while await asyncio.wait_for(reader.read(65536), 10):
            pass
    except ConnectionResetError:
        pass
    return True


async def expect_refusals(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          refused: list[tuple[bytes, int, str]]) -> None:
    """Send hello and every ``(frame, error code, words of its message)``
    of ``refused`` in one write, and check each reply in turn: the code, and
    the words within the message.  The connection stays open for more."""
    writer.write(hello() + b"".join(frame for frame, _, _ in refused))
    await reply(reader)
    for _, code, message in refused:
        hdr, body = await reply(reader)
        assert hdr[4] == code, (hdr, body)
        assert message in msgpack.unpackb(body)["message"], (message, body)


async def held_by_half_a_write(server: Any, name: str, offset: int, data: bytes, push: Any) -> None:
    """Check that the accumulate ``push`` (a coroutine) on buffer ``name`` of
    the in-process ``server`` waits for a WRITE of ``data`` at ``offset``
    still being received: the write's first half is sent, then ``push``
    starts and must change nothing (before ``offset`` either) while the
    write stalls; once the rest is sent both complete."""
    seg = server.by_name[name]
    reader, writer = await asyncio.open_connection(*server.address)
    try:
        writer.write(hello() + frame(Op.WRITE, data[:len(data) // 2], rid=2, segment=seg.id, offset=offset,
                                     length=len(data)))
        await reply(reader)
        for _ in range(500):
            if seg.inflight:
                break
            await asyncio.sleep(0.01)
        assert seg.inflight == [(offset, offset + len(data))]
        task = asyncio.ensure_future(push)
        await asyncio.sleep(0.3)
        assert not task.done() and not seg.mem[:offset].any()
        writer.write(data[len(data) // 2:])
        await asyncio.wait_for(task, 10)
        hdr, _ = await reply(reader)
        assert hdr[4] == 0
    finally:
        writer.close()
