"""Persistence: a server's segments in a data directory, a client's buffer in
a checkpoint file.

Server (``smb2-server --data-dir DIR``): on a planned stop (SIGTERM, SIGINT,
``await server.close()``) every segment is written to ``seg-<id>.<gen>.bin``
and the layout to ``manifest.json``, and at the next start the segments come
back under the same ids, so clients' buffer handles keep working once they
reconnect.  Atomic as a whole: each file is written to a temporary name,
fsynced and renamed; the segment files carry the new generation number in
their names, so the manifest that is on disk keeps pointing at complete files
of its own generation until the new manifest replaces it (rename, then fsync
of the directory).  Only then are the old generation's files removed.  A
crash at any moment leaves either the old or the new state, never a mixture.
Each segment carries a SHA-256 in the manifest; a mismatch at start is an
error (the server does not start), not a silent loss.  Segments are streamed
in chunks (no second copy in memory) and all-zero chunks become holes in a
sparse file, so a large, mostly untouched segment costs neither RAM nor disk.
Writes that had not been acknowledged when the server stopped may be torn;
acknowledged ones are in the files.

Client (``await client.checkpoint(name, path)`` / ``client.restore``): the
whole buffer in one file, with a header (name, nbytes, stripe, SHA-256 of the
data).  ``restore`` verifies the checksum before it writes a single byte into
the buffer, and refuses a buffer of another name or size.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import io
import json
import logging
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final

import numpy as np

from . import _core
from .errors import InvalidArgumentError, NoSuchBuffer, PersistenceError

if TYPE_CHECKING:
    from .client import Client
    from .server import MemoryServer

log = logging.getLogger("smb2.persist")

MANIFEST: Final = "manifest.json"
LOCKFILE: Final = ".lock"
FORMAT: Final = 1
CHUNK: Final = 8 << 20

CKPT_MAGIC: Final = b"SMB2CKPT"
CKPT_FORMAT: Final = 1
# magic, format, header length, sha256 of the data; then the JSON header, then the data
_CKPT_FIXED = struct.Struct("<8sII32s")


# --------------------------------------------------------------------------
# helpers


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _chunks(n: int, chunk: int = CHUNK) -> Iterator[tuple[int, int]]:
    for off in range(0, n, chunk):
        yield off, min(chunk, n - off)


def _write_sparse(f: IO[bytes], data: memoryview, h: Any) -> None:
    """Write ``data`` (hashing it), leaving all-zero chunks as holes."""
    arr = np.frombuffer(data, dtype=np.uint8)
    for off, n in _chunks(len(data), 1 << 20):
        piece = data[off:off + n]
        h.update(piece)
        if arr[off:off + n].any():
            f.write(piece)
        else:
            f.seek(n, os.SEEK_CUR)
    f.truncate()          # a trailing hole still counts towards the size


def _read_into(f: io.BufferedReader, dst: memoryview, h: Any, what: str) -> None:
    pos = 0
    while pos < len(dst):
        n = f.readinto(dst[pos:pos + CHUNK])
        if not n:
            raise PersistenceError(f"{what} is truncated: {pos} of {len(dst)} bytes")
        h.update(dst[pos:pos + n])
        pos += n


# --------------------------------------------------------------------------
# the server's data directory


class DataDir:
    """One server's data directory, held with an exclusive lock for the
    server's lifetime (two servers on one directory would overwrite each
    other's state)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock: int | None = None

    def acquire(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / LOCKFILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise PersistenceError(f"data directory {self.path} is in use by another server") from None
        self._lock = fd

    def release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def manifest(self) -> dict[str, Any] | None:
        p = self.path / MANIFEST
        try:
            m = json.loads(p.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise PersistenceError(f"{p} is unreadable: {exc}") from None
        if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("segments"), list):
            raise PersistenceError(f"{p} is not an smb2 manifest of format {FORMAT}")
        return m

    def save(self, server: MemoryServer) -> int:
        """Write every segment and the manifest; returns the bytes of data saved."""
        old = self.manifest()
        gen = int(old.get("generation", 0)) + 1 if old else 1
        entries = []
        total = 0
        t0 = time.monotonic()
        # buffers' segments only: the lock segment's leases mean nothing to
        # the next server process
        for seg in sorted(server.by_name.values(), key=lambda s: s.id):
            name = f"seg-{seg.id}.{gen}.bin"
            tmp = self.path / (name + ".tmp")
            h = hashlib.sha256()
            with open(tmp, "wb") as f:
                _write_sparse(f, seg.view, h)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path / name)
            entries.append({**seg.info(), "file": name, "sha256": h.hexdigest()})
            total += seg.size
        manifest = {"format": FORMAT, "generation": gen, "saved_at": time.time(),
                    "next_id": max([s.id for s in server.by_name.values()] + [0]) + 1,
                    "segments": entries}
        tmp = self.path / (MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / MANIFEST)
        _fsync_dir(self.path)
        # the new state is durable: the old generation's files may go
        keep = {e["file"] for e in entries} | {MANIFEST, LOCKFILE}
        for p in self.path.iterdir():
            if p.name not in keep and (p.name.startswith("seg-") or p.name.endswith(".tmp")):
                with contextlib.suppress(OSError):
                    p.unlink()
        log.info("saved %d segments (%d bytes) to %s in %.2f s", len(entries), total, self.path,
                 time.monotonic() - t0)
        return total

    def load(self, server: MemoryServer) -> int:
        """Bring the saved segments back (same ids); returns how many."""
        from .server import Segment, _alloc

        m = self.manifest()
        if m is None:
            return 0
        segs = []
        used = 0
        for e in m["segments"]:
            try:
                sid, name, nbytes, stripe = int(e["segment"]), str(e["name"]), int(e["nbytes"]), int(e["stripe"])
                nservers, index, size = int(e["nservers"]), int(e["index"]), int(e["size"])
                fname, digest = str(e["file"]), str(e["sha256"])
            except (KeyError, TypeError, ValueError):
                raise PersistenceError(f"{self.path / MANIFEST}: malformed segment entry {e!r}") from None
            if (size != _core.segment_size(nbytes, stripe, nservers) or "/" in fname
                    or sid in server.segments or not name):
                raise PersistenceError(f"{self.path / MANIFEST}: inconsistent entry for {name!r}")
            used += size
            if used > server.capacity:
                raise PersistenceError(f"the saved segments in {self.path} need more than this "
                                       f"server's capacity of {server.capacity} bytes")
            path = self.path / fname
            mem, view = _alloc(size)
            h = hashlib.sha256()
            try:
                with open(path, "rb") as f:
                    _read_into(f, view, h, str(path))
                    if f.read(1):
                        raise PersistenceError(f"{path} is longer than its segment ({size} bytes)")
            except OSError as exc:
                raise PersistenceError(f"cannot read {path}: {exc}") from None
            if h.hexdigest() != digest:
                raise PersistenceError(f"{path}: checksum mismatch (the file is corrupt); "
                                       f"move {self.path} aside to start empty")
            segs.append(Segment(sid, name, nbytes, stripe, nservers, index, size, mem, view))
        for seg in segs:
            server.segments[seg.id] = seg
            server.by_name[seg.name] = seg
        server.used += used
        server.set_next_id(max(int(m.get("next_id", 1)), max((s.id for s in segs), default=0) + 1))
        log.info("restored %d segments (%d bytes) from %s", len(segs), used, self.path)
        return len(segs)


# --------------------------------------------------------------------------
# client checkpoints


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
                for k, (off, n) in enumerate(_chunks(buf.nbytes, chunk)):
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
        _fsync_dir(path.parent)
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
                  chunk: int = CHUNK) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into buffer ``name`` (created with the
    checkpoint's size and stripe if it does not exist).  The file's checksum
    is verified before any byte is written; a buffer of another size, or a
    checkpoint of another buffer, is refused with InvalidArgumentError."""
    path = Path(path)
    try:
        f = await asyncio.to_thread(open, path, "rb")
    except OSError as exc:
        raise PersistenceError(f"cannot open checkpoint {path}: {exc}") from None
    with f:
        header, digest, start = read_checkpoint_header(f, str(path))
        nbytes = header["nbytes"]
        if header["name"] != name:
            raise InvalidArgumentError(
                f"{path} is a checkpoint of buffer {header['name']!r}, not {name!r}")
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
        if buf.nbytes != nbytes:
            raise InvalidArgumentError(
                f"buffer {name!r} has {buf.nbytes} bytes; the checkpoint {path} holds {nbytes}")
        f.seek(start)
        bufs = [np.empty(min(chunk, nbytes), np.uint8) for _ in range(2)]
        pending: asyncio.Future[None] | None = None
        try:
            for k, (off, n) in enumerate(_chunks(nbytes, chunk)):
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
