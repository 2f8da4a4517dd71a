"""A replicated cluster seen from below the client: a raw connection that
can say it is a peer server, a server's stat and a buffer's bytes on one
server, and writers whose acknowledged increments a test then finds."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import msgpack
import numpy as np

from smb2 import Buffer, _core, auth
from smb2.protocol import VERSION, Op, pack, unpack

from .wire import control, frame, reply


class Raw:
    """One raw connection to a server (hello, then frames)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.rid = 1

    token: bytes | None = None      # set by a test whose servers want one

    @classmethod
    async def open(cls, address: str, peer: str | None = None) -> Raw:
        host, port = address.rsplit(":", 1)
        r, w = await asyncio.open_connection(host, int(port))
        raw = cls(r, w)
        msg = {"cmd": "hello", "version": VERSION, "transports": ["tcp"]}
        if peer is not None:
            msg["peer"] = peer
        hdr, body = await raw.call_frame(control(msg))
        assert hdr[4] == 0, body
        nonce = msgpack.unpackb(body).get("nonce")
        if nonce is not None and cls.token is not None:
            mine = os.urandom(32)
            await raw.control({"cmd": "auth", "nonce": mine, "proof": auth.client_proof(cls.token, nonce, mine)})
        return raw

    async def call_frame(self, data: bytes) -> tuple[tuple[int, ...], bytes]:
        self.writer.write(data)
        return await reply(self.reader)

    async def control(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.rid += 1
        hdr, body = await self.call_frame(control(msg, self.rid))
        out = msgpack.unpackb(body)
        assert hdr[4] == 0, out
        return out

    async def op(self, op: int, segment: int, offset: int, payload: bytes,
                 flags: int) -> tuple[int, dict[str, Any] | bytes]:
        self.rid += 1
        hdr, body = await self.call_frame(frame(op, payload, rid=self.rid, segment=segment, offset=offset,
                                                flags=flags))
        return hdr[4], (msgpack.unpackb(body) if hdr[4] else body)

    async def read(self, segment: int, offset: int, n: int) -> bytes:
        self.rid += 1
        hdr, body = await self.call_frame(frame(Op.READ, rid=self.rid, segment=segment, offset=offset, length=n))
        assert hdr[4] == 0
        return body

    def close(self) -> None:
        self.writer.close()


async def segment_bytes(address: str, name: str) -> tuple[dict[str, Any], bytes]:
    """Buffer ``name``'s segment on the server at ``address``: its lookup and all its bytes."""
    raw = await Raw.open(address)
    try:
        info = await raw.control({"cmd": "lookup", "name": name})
        return info, await raw.read(info["segment"], 0, info["size"])
    finally:
        raw.close()


async def server_stat(address: str) -> dict[str, Any]:
    """The server's ``stat`` reply."""
    raw = await Raw.open(address)
    try:
        return await raw.control({"cmd": "stat"})
    finally:
        raw.close()


class Increments:
    """Writers accumulating int64 ones at random places of ``buf`` until
    stopped, recording what each sent and which were acknowledged: the
    buffer must then hold at least every acknowledged one, at most every
    one sent."""

    def __init__(self, buf: Buffer, writers: int = 2, most: int = 2048) -> None:
        self.buf, self.n = buf, buf.nbytes // 8
        self.acked = np.zeros(self.n, np.int64)
        self.sent = np.zeros(self.n, np.int64)
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._writer(k, most)) for k in range(writers)]

    async def _writer(self, k: int, most: int) -> None:
        rng = np.random.default_rng(k)
        while not self._stop.is_set():
            m = int(rng.integers(1, most))
            at = int(rng.integers(0, self.n - m))
            self.sent[at:at + m] += 1
            await self.buf.accumulate(8 * at, np.ones(m, np.int64))
            self.acked[at:at + m] += 1

    async def stop(self) -> np.ndarray:
        """Stop the writers; the buffer's contents, checked."""
        self._stop.set()
        await asyncio.gather(*self._tasks)
        whole = np.frombuffer(await self.buf.read(0, self.buf.nbytes), np.int64)
        assert self.acked.sum() > 0
        assert np.all(whole >= self.acked) and np.all(whole <= self.sent)
        return whole



async def read_copy(host: str, port: int, slot: str, offset: int, n: int, name: str = "repair") -> bytes:
    """One raw READ of server ``slot``'s part of buffer ``name`` as the
    server at host:port holds it (its own, or a copy moved there): the client
    reads primaries only; this reads a given copy."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        async def control(rid: int, msg: dict[str, Any]) -> dict[str, Any]:
            body = pack(msg)
            writer.write(_core.encode_header(VERSION, Op.CONTROL, 0, 0, rid, 0, 0, len(body)) + body)
            hdr = _core.decode_header(await reader.readexactly(32))
            reply = unpack(await reader.readexactly(hdr[8]))
            assert hdr[4] == 0, reply
            return dict(reply)
        await control(1, {"cmd": "hello", "version": VERSION, "transports": ["tcp"]})
        info = await control(2, {"cmd": "lookup", "name": name,
                                 **({} if slot == f"{host}:{port}" else {"copy_of": slot})})
        writer.write(_core.encode_header(VERSION, Op.READ, 0, 0, 3, int(info["segment"]), offset, n))
        hdr = _core.decode_header(await reader.readexactly(32))
        return await reader.readexactly(hdr[8])
    finally:
        writer.close()

