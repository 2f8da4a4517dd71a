"""Segments: the memory a server holds for one buffer, and the one error a
server answers a request with.

Every part of the server (the connection, the lock service, the RDMA side, the
data directory) allocates segments with :func:`alloc` and refuses requests by
raising :class:`Refused`; the connection turns it into an error reply.
"""

from __future__ import annotations

import collections
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ErrorCode
from .memfd import alloc_shared


class Refused(Exception):
    """A request the server answers with an error code (``code``) and this
    message (and ``extra`` fields in the error payload's map, such as a
    server's view ``epoch``); the connection stays open."""

    def __init__(self, code: ErrorCode, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.extra = extra


@dataclass(eq=False)
class Segment:
    """One server's share of one buffer: page-aligned, zero-filled memory."""

    id: int
    name: str
    nbytes: int          # the whole buffer's size (geometry, for attach)
    stripe: int
    nservers: int
    index: int           # this server's position in the buffer's server list
    size: int            # bytes held here
    mem: np.ndarray      # uint8 over a shared memfd mapping (page aligned, lazily backed)
    view: memoryview
    # the buffer's identity, the same on each of its parts: made at random by
    # the client that created the buffer ("" for a part made by a client
    # that sent none); ``sealed`` on part 0 says that every part was made
    # (docs/protocol.md, "Buffer identity")
    buffer_id: str = ""
    sealed: bool = True
    # a replicated buffer (docs/design.md, "Replication"): each stripe on
    # ``replicas`` of ``servers`` (the cluster's "host:port" names, in order,
    # with their ``zones``), placed by smb2.placement
    replicas: int = 1
    servers: tuple[str, ...] = ()
    zones: tuple[str | None, ...] | None = None
    created: float = field(default_factory=time.time)
    # byte ranges of writes being received in place right now; an accumulate
    # that overlaps one waits for it, so that it is atomic w.r.t. writes
    inflight: list[tuple[int, int]] = field(default_factory=list)
    deferred: collections.deque[tuple[int, int, Callable[[], None]]] = field(
        default_factory=collections.deque)

    def info(self) -> dict[str, Any]:
        return {"segment": self.id, "name": self.name, "nbytes": self.nbytes,
                "stripe": self.stripe, "nservers": self.nservers,
                "index": self.index, "size": self.size, "buffer_id": self.buffer_id,
                "sealed": self.sealed, "replicas": self.replicas,
                **({"servers": list(self.servers), "zones": None if self.zones is None else list(self.zones)}
                   if self.replicas > 1 else {})}

    def overlaps_inflight(self, lo: int, hi: int) -> bool:
        return any(a < hi and lo < b for a, b in self.inflight)

    def write_done(self, rng: tuple[int, int]) -> None:
        self.inflight.remove(rng)
        if not self.deferred:
            return
        waiting: collections.deque[tuple[int, int, Callable[[], None]]] = collections.deque()
        while self.deferred:
            lo, hi, run = self.deferred.popleft()
            if self.overlaps_inflight(lo, hi):
                waiting.append((lo, hi, run))
            else:
                run()
        self.deferred = waiting


def alloc(size: int, *, clients_write: bool = True, shared: bool = True) -> tuple[np.ndarray, memoryview]:
    """``size`` bytes of fresh memory: a uint8 array and a view of the same
    bytes.  ``clients_write=False`` (a replicated buffer's segment): the
    clients this host hands it to can only read it.  ``shared=False`` (a
    server with --shm off hands nothing out): not a memfd, so it holds no
    file descriptor."""
    if shared and hasattr(os, "memfd_create"):
        # shared with the shm clients of this host (memfd.py)
        return alloc_shared(size, clients_write=clients_write)
    # An anonymous mmap is page aligned (so RDMA can register it) and
    # zero-filled on first touch, so capacity is not committed up front.
    mm = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mem = np.frombuffer(mm, dtype=np.uint8, count=size)
    return mem, memoryview(mm)[:size]
