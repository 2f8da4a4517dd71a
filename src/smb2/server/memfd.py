"""Segment memory that another process can map: a ``memfd`` per segment.

Every segment (and the lock segment) is a ``memfd`` mapped ``MAP_SHARED``:
page aligned, so RDMA registers it as before, and zero-filled on first
touch, so capacity is not committed up front.  Its file descriptor is what
the shm hand-out (``server/shm.py``) passes to a client on this host, which
maps the same pages.

Behind the segment's bytes, at ``state_offset(size)``, lies one u64 **state
word**: ``LIVE`` while the segment belongs to a buffer, ``GONE`` once it was
destroyed, ``FROZEN`` while the server saves it to stop.  A shm client checks it before each operation, so an operation
on a destroyed buffer fails with ``NoSuchBuffer`` as over TCP.  The pages
themselves are freed only when the last mapping of them and the last fd are
gone: a client that still maps a destroyed segment keeps its pages alive and
never touches freed memory.

Each memfd is **sealed** at its size (``F_SEAL_SHRINK | F_SEAL_GROW``)
before anyone else sees it: a client that got the fd cannot ``ftruncate``
it.  Shrunk, the server's own accesses past the new end (the lock sweep, a
TCP client's read) would die of SIGBUS; grown, the file would hold memory
outside ``--capacity``.  Writing through a mapping stays allowed: that is
what the hand-out is for -- except for a replicated buffer's segment, which
is also sealed ``F_SEAL_FUTURE_WRITE`` once the server mapped it: the
server's own mapping stays writable, and no other (a client's ``mmap`` with
``PROT_WRITE``, ``mprotect`` to write, ``write()``, a reopen through
``/proc/PID/fd``) can be made.  Its copies change only through its primary,
which forwards every change to the other copies; a client writing one copy
would make them differ silently.  A client maps such a segment read-only
(it reads the seals).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import resource
import weakref

import numpy as np

from .. import _core
from ..host import F_SEAL_FUTURE_WRITE

LIVE = 1
GONE = 0
# the server is saving the segment to stop (server/memory.py, close): shm
# clients stop writing, and one whose store overlapped the change raises
FROZEN = 2
# the state word sits on its own cache line behind the data
_STATE_ALIGN = 64
# a handed-out memfd keeps its size whatever the client does (see the top)
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

# mmap object (the exporter behind a segment's view) -> its memfd
_fds: weakref.WeakKeyDictionary[mmap.mmap, int] = weakref.WeakKeyDictionary()


def state_offset(size: int) -> int:
    """Where the state word of a ``size``-byte segment lies in its memfd."""
    return -(-size // _STATE_ALIGN) * _STATE_ALIGN


#: file descriptors a segment holds open: its memfd and its mapping's own
FDS_PER_SEGMENT = 2
# descriptors kept for everything else a server opens besides its
# connections (sockets it listens on, the data directory, etcd, logs)
FDS_SPARE = 64


def fd_limit() -> int:
    """The file descriptors this process may open once the soft limit is
    raised to the hard one (as the first segment does)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(soft, 1 << 20) if hard == resource.RLIM_INFINITY else max(soft, hard)


def buffers_within_fd_limit(connections: int, limit: int | None = None) -> int:
    """How many buffers' segments fit in :func:`fd_limit` (or ``limit``)
    beside ``connections`` connections (and the lock segment)."""
    return max(0, ((fd_limit() if limit is None else limit) - connections - FDS_SPARE) // FDS_PER_SEGMENT - 1)


def raise_fd_limit() -> tuple[int, int] | None:
    """Raise this process's soft file limit to the hard one where allowed,
    once: ``(before, after)`` if it changed, else None.  Each segment holds
    FDS_PER_SEGMENT fds and each connection one, so the usual soft limit of
    1024 would cap a server far below what the machine allows."""
    global _fd_limit_raised
    _fd_limit_raised = True
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(soft, 1 << 20) if hard == resource.RLIM_INFINITY else hard
    if soft >= want:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        return None
    return soft, want


_fd_limit_raised = False


def alloc_shared(size: int, name: str = "smb2-segment", *,
                 clients_write: bool = True) -> tuple[np.ndarray, memoryview]:
    """``size`` bytes of fresh memfd memory: a uint8 array and a view of the
    same bytes (the view's exporter is the mapping, see :func:`fd_of`).
    ``clients_write=False``: only this mapping can write it (see the top)."""
    if not _fd_limit_raised:
        raise_fd_limit()
    total = state_offset(size) + _STATE_ALIGN
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, total)
        # mapped before the seals: F_SEAL_FUTURE_WRITE leaves only mappings
        # made before it writable
        mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS if clients_write else SEALS | F_SEAL_FUTURE_WRITE)
    except BaseException:
        os.close(fd)
        raise
    # the fd lives as long as the mapping: a buffer's memory is released
    # when the last view of it is gone (a reply still being sent may hold one)
    _fds[mm] = fd
    weakref.finalize(mm, os.close, fd)
    whole = memoryview(mm)
    _core.atomic_store(whole, state_offset(size), LIVE)
    mem = np.frombuffer(mm, dtype=np.uint8, count=size)
    return mem, whole[:size]


def fd_of(view: memoryview) -> int | None:
    """The memfd behind a view made by :func:`alloc_shared`, else None."""
    owner = view.obj
    return _fds.get(owner) if isinstance(owner, mmap.mmap) else None


def mark(view: memoryview, state: int) -> None:
    """Set the state word of the segment ``view`` (LIVE, GONE, FROZEN) for
    every client that maps it (a seq-cst store: see
    ``_core.load_after_stores`` for what a writer learns from it)."""
    owner = view.obj
    if isinstance(owner, mmap.mmap) and owner in _fds:
        _core.atomic_store(memoryview(owner), state_offset(len(view)), state)


def mark_gone(view: memoryview) -> None:
    """Tell every client that maps this segment that its buffer is gone."""
    mark(view, GONE)
