"""What clients may take from a memory server: connections per source address
and in total, authentication attempts (a back-off per address after a wrong
token), and the memory that requests' payloads wait in (one pool shared by
every connection).  Warnings about refused clients are rate-limited, so a
flood of them cannot flood the log as well.

The memory server (memory.py) asks here before it admits a connection, checks
a proof, or lets a connection take payload memory; docs/operations.md lists
the bounds and the memory budget they add up to.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

# a wrong token makes its source address wait this long before the next try,
# doubling with each further failure up to AUTH_BACKOFF_MAX
AUTH_BACKOFF_MIN = 0.1
AUTH_BACKOFF_MAX = 10.0
# a source address's failures are forgotten after this long without one
AUTH_FORGET = 600.0
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


class Admission:
    """Connection counts per source address and the authentication back-off."""

    def __init__(self, max_connections: int, max_per_host: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_connections = max_connections
        self.max_per_host = max_per_host
        self.clock = clock
        self.per_host: collections.Counter[str] = collections.Counter()
        self.total = 0
        self.refused = 0
        # source address -> (failures in a row, monotonic time it may try again)
        self._failures: dict[str, tuple[int, float]] = {}

    def admit(self, host: str) -> str | None:
        """Count a new connection from ``host``; or why it is refused (not counted)."""
        if self.total >= self.max_connections:
            self.refused += 1
            return f"the server holds its maximum of {self.max_connections} connections"
        if self.per_host[host] >= self.max_per_host:
            self.refused += 1
            return (f"{host} holds this server's maximum of {self.max_per_host} connections "
                    "per source address")
        self.per_host[host] += 1
        self.total += 1
        return None

    def leave(self, host: str) -> None:
        """An admitted connection from ``host`` closed."""
        self.total -= 1
        self.per_host[host] -= 1
        if self.per_host[host] <= 0:
            del self.per_host[host]

    def auth_wait(self, host: str) -> float:
        """Seconds ``host`` must still wait before its next authentication try."""
        entry = self._failures.get(host)
        return max(0.0, entry[1] - self.clock()) if entry else 0.0

    def auth_failed(self, host: str) -> float:
        """Count a wrong proof from ``host``; returns the back-off it now waits."""
        now = self.clock()
        if len(self._failures) > 4096:
            # addresses that stopped guessing long ago: forget them
            self._failures = {h: e for h, e in self._failures.items() if now - e[1] < AUTH_FORGET}
        count, until = self._failures.get(host, (0, now))
        if now - until > AUTH_FORGET:
            count = 0
        delay = min(AUTH_BACKOFF_MIN * 2 ** count, AUTH_BACKOFF_MAX)
        self._failures[host] = (count + 1, now + delay)
        return delay

    def auth_ok(self, host: str) -> None:
        self._failures.pop(host, None)


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
