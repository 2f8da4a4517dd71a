"""What clients may take from a memory server: connections per source address
and in total (where a client without the token can never crowd out one that
has it), and the memory that requests' payloads wait in (one pool shared by
every connection).  Warnings about refused clients are rate-limited, so a
flood of them cannot flood the log as well.

The memory server (memory.py) asks here before it admits a connection or
lets a connection take payload memory; docs/operations.md lists the bounds
and the memory budget they add up to.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

# at most one warning line per kind per this many seconds (the rest counted)
WARN_EVERY = 10.0


class RateLimitedLog:
    """``warning(kind, fmt, *args)`` logs at most once per ``every`` seconds
    per kind; the next line says how many were left out."""

    def __init__(self, log: logging.Logger, every: float = WARN_EVERY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.every = every
        self.clock = clock
        self._last: dict[str, float] = {}
        self._skipped: collections.Counter[str] = collections.Counter()

    def warning(self, kind: str, fmt: str, *args: Any) -> None:
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.every:
            self._skipped[kind] += 1
            return
        self._last[kind] = now
        skipped = self._skipped.pop(kind, 0)
        if skipped:
            fmt += " (%d more like this in the last %.0f s)"
            args = (*args, skipped, now - last if last is not None else 0.0)
        self.log.warning(fmt, *args)


class Guest(Protocol):
    """What admission needs of a connection: a way to close it."""

    def cut(self, reason: str) -> None: ...


class Admission:
    """Connection counts, per source address and in total, and which
    connections have not authenticated yet.

    Everyone on one host (or behind one NAT) shares a source address, so a
    limit that refuses new connections could be filled by a client without
    the token and aimed at one that has it.  Instead, a connection that
    would go over a limit makes room by closing the oldest connection that
    has not authenticated (from the same address when the per-address limit
    is what binds): a client that authenticates within its first round
    trips is never the oldest.  Only connections that authenticated fill a
    limit for good; then the new one is refused."""

    def __init__(self, max_connections: int, max_per_host: int) -> None:
        self.max_connections = max_connections
        self.max_per_host = max_per_host
        self.per_host: collections.Counter[str] = collections.Counter()
        self.total = 0
        self.refused = 0
        self.evicted = 0
        # admitted connection -> its source address
        self._hosts: dict[Guest, str] = {}
        # those not authenticated yet, oldest first
        self._guests: dict[Guest, str] = {}

    def admit(self, conn: Guest, host: str) -> str | None:
        """Count ``conn``, a new connection from ``host`` (closing the oldest
        unauthenticated one to make room if a limit is reached); or why it
        is refused (not counted): every connection in the way authenticated."""
        if self.per_host[host] >= self.max_per_host:
            victim = next((c for c, h in self._guests.items() if h == host), None)
            if victim is None:
                self.refused += 1
                return (f"{host} holds this server's maximum of {self.max_per_host} connections "
                        "per source address, all authenticated: raise --max-connections-per-host on the "
                        "server, or spread the workers over more hosts")
            self._evict(victim, f"the connections from {host} are at their maximum "
                                f"({self.max_per_host}): the oldest unauthenticated one makes room")
        if self.total >= self.max_connections:
            victim = next(iter(self._guests), None)
            if victim is None:
                self.refused += 1
                return (f"the server holds its maximum of {self.max_connections} connections, all authenticated: "
                        "raise --max-connections on the server (its file limit and memory bound it: "
                        "smb2 doctor shows both)")
            self._evict(victim, f"the server is at its maximum of {self.max_connections} connections: "
                                "the oldest unauthenticated one makes room")
        self.per_host[host] += 1
        self.total += 1
        self._hosts[conn] = host
        self._guests[conn] = host
        return None

    def authenticated(self, conn: Guest) -> None:
        """``conn`` proved it holds the token: it is never closed to make room."""
        self._guests.pop(conn, None)

    def leave(self, conn: Guest) -> None:
        """An admitted connection closed (again, or never admitted: nothing)."""
        host = self._hosts.pop(conn, None)
        if host is None:
            return
        self._guests.pop(conn, None)
        self.total -= 1
        self.per_host[host] -= 1
        if self.per_host[host] <= 0:
            del self.per_host[host]

    @property
    def unauthenticated(self) -> int:
        return len(self._guests)

    def _evict(self, conn: Guest, reason: str) -> None:
        # uncounted now: its close completes later, in connection_lost
        self.leave(conn)
        self.evicted += 1
        conn.cut(reason)


class MemoryPool:
    """Payload memory shared by all connections (accumulate scratch, deltas
    waiting behind a write): ``take`` says whether it fits, and a connection
    that did not fit waits (``wait``) until ``give`` frees enough."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._waiters: collections.deque[Callable[[], object]] = collections.deque()

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.limit

    def take(self, nbytes: int) -> None:
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def wait(self, wake: Callable[[], object]) -> None:
        """Call ``wake`` (once) when memory is given back."""
        self._waiters.append(wake)

    def give(self, nbytes: int) -> None:
        self.used -= nbytes
        # every waiter retries: each takes what it needs or waits again
        waiters, self._waiters = self._waiters, collections.deque()
        for wake in waiters:
            wake()
