"""The server's data directory: its segments saved on a planned stop and
restored at the next start.

``smb2-server --data-dir DIR``: on a planned stop (SIGTERM, SIGINT,
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
acknowledged ones are in the files: the server freezes every segment before
it saves (``MemoryServer.close``; shm clients stop writing, and one whose
store overlapped the freeze is told it failed), and each chunk is hashed and
written from a private copy, so a file always matches its checksum.

(A client's checkpoint of a whole buffer is :mod:`smb2.checkpoint`.)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import logging
import os
import time
from collections.abc import Collection, Container
from pathlib import Path
from typing import IO, Any, Final

import numpy as np

from .. import _core
from ..durable import CHUNK, chunks, fsync_dir
from ..errors import PersistenceError
from ..placement import Placement
from .segment import Segment, alloc

log = logging.getLogger("smb2.persist")

MANIFEST: Final = "manifest.json"
LOCKFILE: Final = ".lock"
# present while a server runs on segments restored from this directory: a
# start that finds it knows the last run ended without a save (a crash), so
# the saved state may be older than what that run acknowledged
RUNNING: Final = "running"
FORMAT: Final = 1


def _write_sparse(f: IO[bytes], data: memoryview, h: Any) -> None:
    """Write ``data`` (hashing it), leaving all-zero chunks as holes.

    Each chunk is copied first, and hashed and written from the copy: the
    file and its hash are the same bytes even if something still changes
    ``data`` (a shm client's store that was in flight when the server froze
    the segment), so a save is never torn against its own checksum."""
    scratch = memoryview(bytearray(min(len(data), 1 << 20)))
    for off, n in chunks(len(data), 1 << 20):
        piece = scratch[:n]
        _core.copy_into(piece, data[off:off + n])
        h.update(piece)
        if np.frombuffer(piece, dtype=np.uint8).any():
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


class DataDir:
    """One server's data directory, held with an exclusive lock for the
    server's lifetime (two servers on one directory would overwrite each
    other's state)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock: int | None = None
        #: whether what load() restored is the state of the last run's end (a
        #: planned stop saved it), rather than of an earlier save (a crash since)
        self.clean = False

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

    def save(self, buffers: Collection[Segment], next_id: int = 1) -> int:
        """Write the buffers' segments and the manifest; returns the bytes of
        data saved.  ``next_id``, the server's next segment id, is kept, so
        that no id is used twice in this directory, not even a destroyed
        buffer's (a client's stale handle must not reach another buffer).
        On an error (OSError: disk full, a file size limit) the
        files of this attempt are removed and the previous state stays."""
        old = self.manifest()
        gen = int(old.get("generation", 0)) + 1 if old else 1
        try:
            return self._save(buffers, gen, next_id)
        except BaseException:
            # keep what the manifest on disk names (the old one, or the new
            # one if only the cleanup after it failed)
            keep = {e["file"] for m in (old, self._manifest_or_none()) if m for e in m["segments"]}
            self._remove(keep)
            raise

    def _manifest_or_none(self) -> dict[str, Any] | None:
        try:
            return self.manifest()
        except PersistenceError:
            return None

    def _remove(self, keep: set[str]) -> None:
        """Remove segment files not in ``keep`` and every temporary file."""
        keep = keep | {MANIFEST, LOCKFILE, RUNNING}
        for p in self.path.iterdir():
            if p.name not in keep and (p.name.startswith("seg-") or p.name.endswith(".tmp")):
                with contextlib.suppress(OSError):
                    p.unlink()

    def _save(self, buffers: Collection[Segment], gen: int, next_id: int) -> int:
        entries = []
        total = 0
        t0 = time.monotonic()
        for seg in sorted(buffers, key=lambda s: s.id):
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
                    "next_id": max([s.id for s in buffers] + [0, next_id - 1]) + 1,
                    "segments": entries}
        tmp = self.path / (MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / MANIFEST)
        fsync_dir(self.path)
        # the new state is durable: the old generation's files may go
        self._remove(keep={e["file"] for e in entries})
        log.info("saved %d segments (%d bytes) to %s in %.2f s", len(entries), total, self.path,
                 time.monotonic() - t0)
        return total

    def stopped(self) -> None:
        """The run ends with a save of all it acknowledged (a planned stop)."""
        with contextlib.suppress(FileNotFoundError):
            (self.path / RUNNING).unlink()
        fsync_dir(self.path)

    def load(self, capacity: int, taken: Container[int], *, shared: bool = True) -> tuple[list[Segment], int]:
        """The saved segments, read back (same ids), and the next free id.
        Their total size must fit in ``capacity``, and no id may be ``taken``;
        ``shared``: memfds (see segment.alloc).  Marks the directory running
        until :meth:`stopped` (``clean``)."""
        self.clean = not (self.path / RUNNING).exists()
        m = self.manifest()
        if m is None:
            return [], 1
        # (only where something is restored: an empty directory vouches for nothing)
        with open(self.path / RUNNING, "w"):
            pass
        fsync_dir(self.path)
        segs = []
        used = 0
        for e in m["segments"]:
            try:
                sid, name, nbytes, stripe = int(e["segment"]), str(e["name"]), int(e["nbytes"]), int(e["stripe"])
                nservers, index, size = int(e["nservers"]), int(e["index"]), int(e["size"])
                fname, digest = str(e["file"]), str(e["sha256"])
                # a manifest from before buffer identities: parts of identity "", sealed
                buffer_id, sealed = str(e.get("buffer_id", "")), bool(e.get("sealed", True))
                # a manifest from before replicated buffers: one replica
                replicas = int(e.get("replicas", 1))
                servers = tuple(str(a) for a in e.get("servers", ()))
                zones = None if e.get("zones") is None else tuple(e["zones"])
            except (KeyError, TypeError, ValueError):
                raise PersistenceError(f"{self.path / MANIFEST}: malformed segment entry {e!r}") from None
            want = (_core.segment_size(nbytes, stripe, nservers) if replicas == 1 else
                    Placement.of(name, nservers, nbytes, stripe, replicas, zones).segment_size(index))
            if (size != want or "/" in fname
                    or sid in taken or not name):
                raise PersistenceError(f"{self.path / MANIFEST}: inconsistent entry for {name!r}")
            used += size
            if used > capacity:
                raise PersistenceError(f"the saved segments in {self.path} need more than this "
                                       f"server's capacity of {capacity} bytes")
            path = self.path / fname
            mem, view = alloc(size, clients_write=replicas == 1, shared=shared)
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
            segs.append(Segment(sid, name, nbytes, stripe, nservers, index, size, mem, view,
                                buffer_id=buffer_id, sealed=sealed, replicas=replicas, servers=servers,
                                zones=zones))
        log.info("restored %d segments (%d bytes) from %s", len(segs), used, self.path)
        return segs, max(int(m.get("next_id", 1)), max((s.id for s in segs), default=0) + 1)
