"""Duplicate detection for replicated ops: each client's recent (sequence,
result) pairs, so that a retried op returns its stored result instead of
being applied twice (docs/design.md, "Replication")."""


from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Final

from ... import _core
from ...protocol import Header
from .needs import Client

# duplicate detection (see Dedup): each client's last DEDUP_PER_CLIENT ops
# at least (more while the table has room) are remembered, about
# DEDUP_ENTRY_BYTES each, for at most --dedup-clients clients
# (ServerOptions.dedup_clients) at once
DEDUP_PER_CLIENT: Final = 64
DEDUP_ENTRY_BYTES: Final = 300
DEDUP_CLIENTS: Final = 4096
# a client's record is forgotten only after it sent this server nothing for
# this long: far above smb2.replication.RETRY_SPAN, the longest a client
# retries one op after its first send, so no retry can come after its record
# went, whatever the clocks' rates
DEDUP_IDLE: Final = 600.0


def prefix(epoch: int, client: int, seq: int) -> bytes:
    return _core.pack_u64(epoch) + _core.pack_u64(client) + _core.pack_u64(seq)


@dataclass(eq=False, slots=True)
class Entry:
    """One applied op in the duplicate table: its result, the backups known
    to hold it, and (while its forwards are out) who waits for its reply."""

    result: bytes
    acked: frozenset[str] = frozenset()
    waiters: list[tuple[Client, Header]] | None = None


class Record:
    """One client's part of the duplicate table: its recent ops' results by
    sequence number (oldest first), the highest sequence number it forgot,
    and when it was last heard of (time.monotonic())."""

    __slots__ = ("client", "entries", "floor", "seen")

    def __init__(self, client: int, now: float) -> None:
        self.client = client
        self.entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self.floor = -1     # none dropped yet (0 is a sequence number too)
        self.seen = now


class TooManyClients(Exception):
    """No room for a new client's record: every record is of a client heard
    of within DEDUP_IDLE."""


class Dedup:
    """Results of replicated ops by (client id, sequence), so that a retry is
    answered, not applied again.

    Kept per client, so that no client's ops push out another's: each
    client's record holds at least its last ``per_client`` results (its
    share), more while the table has room (``clients`` x ``per_client``
    results in all: a busy client may use what idle ones leave); past that,
    results go oldest first from a client over its share, never from one
    within it.  A client's highest dropped sequence number is kept
    (``floor``: an op at or below it is refused, never applied a second
    time on a guess).  At most ``clients`` records: a new client finds room
    only where a record was idle for ``idle`` seconds (a retry never comes
    that late), else it is refused (``TooManyClients``) while every other
    record stays.  Ops forwarded by a primary, which already took them, are
    always recorded.

    Memory: ``clients`` x ``per_client`` x about DEDUP_ENTRY_BYTES (4096 x 64
    x 300 B, 75 MiB, at the defaults) for the clients this server admits as
    a primary, and ``per_client`` results more for each client a primary
    forwarded past that."""

    def __init__(self, clients: int = DEDUP_CLIENTS, per_client: int = DEDUP_PER_CLIENT,
                 idle: float = DEDUP_IDLE) -> None:
        # least recently heard of first
        self.records: collections.OrderedDict[int, Record] = collections.OrderedDict()
        self.clients = clients
        self.per_client = per_client
        self.idle = idle
        self.budget = clients * per_client
        self.entries = 0
        # the clients holding more than their share
        self._over: set[int] = set()

    def record(self, client: int, *, overfull: bool = False, now: float | None = None) -> Record:
        """``client``'s record, heard of now; made for a new client, which
        is refused (``TooManyClients``) where no record was idle long
        enough to go, unless ``overfull``."""
        now = time.monotonic() if now is None else now
        rec = self.records.get(client)
        if rec is not None:
            rec.seen = now
            self.records.move_to_end(client)
            return rec
        while self.records:
            oldest = next(iter(self.records.values()))
            if now - oldest.seen < self.idle:
                break
            self.records.popitem(last=False)
            self.entries -= len(oldest.entries)
            self._over.discard(oldest.client)
        if len(self.records) >= self.clients and not overfull:
            raise TooManyClients
        rec = self.records[client] = Record(client, now)
        return rec

    def put(self, rec: Record, seq: int, entry: Entry) -> None:
        rec.entries[seq] = entry
        self.entries += 1
        if len(rec.entries) > self.per_client:
            self._over.add(rec.client)
        while self.entries > self.budget and self._over:
            # the client itself where it is over its share, else another that is
            victim = rec if rec.client in self._over else self.records[next(iter(self._over))]
            s, _ = victim.entries.popitem(last=False)
            victim.floor = max(victim.floor, s)
            self.entries -= 1
            if len(victim.entries) <= self.per_client:
                self._over.discard(victim.client)
