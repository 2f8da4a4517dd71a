"""Raw frames for tests that talk to a server below the client API (bad
bytes, the auth gate, limits, fuzzing): build a request, read a reply, wait
for the server to close the connection."""

from __future__ import annotations

import asyncio

import msgpack

from smb2 import _core
from smb2.protocol import VERSION, Op


def frame(op: int, payload: bytes = b"", *, rid: int = 1, segment: int = 0, offset: int = 0,
          length: int | None = None, flags: int = 0, version: int = VERSION) -> bytes:
    """A request frame; ``length`` defaults to the payload's (override it to lie)."""
    n = len(payload) if length is None else length
    return _core.encode_header(version, op, flags, 0, rid, segment, offset, n) + payload


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
