"""Client checkpoints: a whole buffer saved to one file and restored from it.

``await client.checkpoint(name, path)`` / ``client.restore``: the whole buffer
in one file, with a header (name, nbytes, stripe, SHA-256 of the data).
``restore`` verifies the checksum before it writes a single byte into the
buffer, and refuses a buffer of another name or size.  (A server's own
segments are saved by its data directory, :mod:`smb2.server.datadir`.)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import os
import struct
import time
from pathlib import Path
from typing import IO, Any, Final, Protocol

import numpy as np

from .durable import CHUNK, chunks, fsync_dir
from .errors import BufferDamaged, InvalidArgumentError, NoSuchBuffer, PersistenceError


class StoredBuffer(Protocol):
    """What a checkpoint needs of a buffer (:class:`smb2.Buffer` is one)."""

    name: str
    nbytes: int
    stripe: int
    nservers: int

    async def read_into(self, out: Any, offset: int = 0) -> None: ...

    async def write(self, offset: int, data: Any) -> None: ...


class Client(Protocol):
    """What a checkpoint needs of a client (:class:`smb2.Client` is one);
    stated here so that this module does not import the client's."""

    async def attach(self, name: str) -> StoredBuffer: ...

    async def create(self, name: str, nbytes: int, *, stripe: int = ...,
                     recreate_lost: bool = ...) -> StoredBuffer: ...

__all__ = ["CHUNK", "checkpoint", "read_checkpoint_header", "restore"]

CKPT_MAGIC: Final = b"SMB2CKPT"
CKPT_FORMAT: Final = 1
# magic, format, header length, sha256 of the data; then the JSON header, then the data
_CKPT_FIXED = struct.Struct("<8sII32s")


async def checkpoint(client: Client, name: str, path: str | os.PathLike[str], *,
                     chunk: int = CHUNK) -> dict[str, Any]:
    """Save buffer ``name`` to ``path`` (atomically: a temporary file, fsync,
    rename).  Reads the next chunk from the servers while the previous one
    is hashed and written, so memory stays at two chunks."""
    buf = await client.attach(name)
    path = Path(path)
    header = json.dumps({"name": buf.name, "nbytes": buf.nbytes, "stripe": buf.stripe,
                         "nservers": buf.nservers, "saved_at": time.time()}).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    h = hashlib.sha256()
    bufs = [np.empty(min(chunk, buf.nbytes), np.uint8) for _ in range(2)]

    def put(f: IO[bytes], data: np.ndarray) -> None:
        h.update(data.data)
        f.write(data.data)

    try:
        f = await asyncio.to_thread(open, tmp, "wb")
        with f:
            f.write(_CKPT_FIXED.pack(CKPT_MAGIC, CKPT_FORMAT, len(header), b"\0" * 32) + header)
            pending: asyncio.Future[None] | None = None
            try:
                for k, (off, n) in enumerate(chunks(buf.nbytes, chunk)):
                    cur = bufs[k % 2][:n]
                    await buf.read_into(cur, off)
                    if pending is not None:
                        await pending
                    pending = asyncio.ensure_future(asyncio.to_thread(put, f, cur))
                if pending is not None:
                    await pending
            finally:
                if pending is not None and not pending.done():
                    await asyncio.gather(pending, return_exceptions=True)
            f.seek(_CKPT_FIXED.size - 32)
            f.write(h.digest())
            f.flush()
            await asyncio.to_thread(os.fsync, f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return {"name": buf.name, "nbytes": buf.nbytes, "sha256": h.hexdigest(), "path": str(path)}


def read_checkpoint_header(f: io.BufferedReader, path: str) -> tuple[dict[str, Any], bytes, int]:
    fixed = f.read(_CKPT_FIXED.size)
    if len(fixed) < _CKPT_FIXED.size:
        raise PersistenceError(f"{path} is not an smb2 checkpoint (too short)")
    magic, fmt, hlen, digest = _CKPT_FIXED.unpack(fixed)
    if magic != CKPT_MAGIC:
        raise PersistenceError(f"{path} is not an smb2 checkpoint")
    if fmt != CKPT_FORMAT:
        raise PersistenceError(f"{path} is a checkpoint of format {fmt}; this smb2 reads {CKPT_FORMAT}")
    try:
        header = json.loads(f.read(min(hlen, 1 << 20)))
        if not (isinstance(header, dict) and isinstance(header.get("name"), str)
                and isinstance(header.get("nbytes"), int) and isinstance(header.get("stripe"), int)):
            raise ValueError("missing fields")
    except ValueError as exc:
        raise PersistenceError(f"{path}: malformed checkpoint header: {exc}") from None
    return header, digest, _CKPT_FIXED.size + hlen


async def restore(client: Client, name: str, path: str | os.PathLike[str], *,
                  chunk: int = CHUNK, saved_as: str | None = None) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into buffer ``name`` (created with the
    checkpoint's size and stripe if it does not exist; a damaged buffer's
    lost parts are made again, since every byte is rewritten).  The file's checksum
    is verified before any byte is written; a buffer of another size, or a
    checkpoint of another buffer (than ``saved_as``, by default ``name``), is
    refused with InvalidArgumentError."""
    path = Path(path)
    try:
        f = await asyncio.to_thread(open, path, "rb")
    except OSError as exc:
        raise PersistenceError(f"cannot open checkpoint {path}: {exc}") from None
    with f:
        header, digest, start = read_checkpoint_header(f, str(path))
        nbytes = header["nbytes"]
        expected = name if saved_as is None else saved_as
        if header["name"] != expected:
            raise InvalidArgumentError(
                f"{path} is a checkpoint of buffer {header['name']!r}, not {expected!r}")
        size = os.fstat(f.fileno()).st_size
        if size != start + nbytes:
            raise PersistenceError(f"{path} holds {size - start} bytes of data; its header says {nbytes}")

        def verify() -> bool:
            h = hashlib.sha256()
            f.seek(start)
            scratch = bytearray(min(chunk, max(nbytes, 1)))
            view = memoryview(scratch)
            left = nbytes
            while left:
                n = f.readinto(view[:min(len(view), left)])
                if not n:
                    return False
                h.update(view[:n])
                left -= n
            return h.digest() == digest
        if not await asyncio.to_thread(verify):
            raise PersistenceError(f"{path}: checksum mismatch (the file is corrupt)")
        try:
            buf = await client.attach(name)
        except NoSuchBuffer:
            buf = await client.create(name, nbytes, stripe=header["stripe"])
        except BufferDamaged:
            buf = await client.create(name, nbytes, stripe=header["stripe"], recreate_lost=True)
        if buf.nbytes != nbytes:
            raise InvalidArgumentError(
                f"buffer {name!r} has {buf.nbytes} bytes; the checkpoint {path} holds {nbytes}")
        f.seek(start)
        bufs = [np.empty(min(chunk, nbytes), np.uint8) for _ in range(2)]
        pending: asyncio.Future[None] | None = None
        try:
            for k, (off, n) in enumerate(chunks(nbytes, chunk)):
                cur = bufs[k % 2][:n]
                got = await asyncio.to_thread(f.readinto, cur.data)
                if got != n:
                    raise PersistenceError(f"{path} changed while it was being restored")
                if pending is not None:
                    await pending
                pending = asyncio.ensure_future(buf.write(off, cur))
            if pending is not None:
                await pending
        finally:
            # a write still in flight uses bufs: wait for it (its error, if
            # any, is secondary to the one propagating)
            if pending is not None and not pending.done():
                await asyncio.gather(pending, return_exceptions=True)
    return {"name": name, "nbytes": nbytes, "sha256": digest.hex(), "path": str(path)}
