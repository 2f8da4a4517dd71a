"""The server's half of the lock: glue between ``_core.LockTable`` and the
connections (docs/design.md, "The lock"; docs/protocol.md, "Locks").

Every server has one *lock segment* (segment id ``LOCK_SEGMENT`` = 0): page
aligned, so an RDMA transport can register it like any segment, made of
32-byte slots of four u64 words (next_ticket, now_serving, heartbeat,
reserved).  A lock name is bound to a slot by the ``lock_open`` control
command; which server holds a lock is the client's choice (the name's hash,
like stripes).

Three ways in:

* LOCK_ACQUIRE / LOCK_RELEASE / LOCK_CANCEL frames (the TCP path): the
  server PARKS an acquire whose turn has not come and answers it when it
  does, so a waiter sends nothing while it waits.
* the generic atomics and READ on the lock segment (the polling path that
  RDMA uses one-sidedly; over TCP this server executes them and then
  ``touched`` lets the table react at once).
* a sweep every few milliseconds: it notices one-sided changes (RDMA
  releases and renewals), expires holders whose lease ran out, and skips
  tickets that were given up.

shm clients wait on a futex on ``now_serving`` (lock.py, the futex path):
whatever moves it here (a release over TCP, an expiry, a dead connection's
tickets, a skipped ticket) wakes them (``_settle``).  The slot's
``LOCK_PARKED`` word tells them how many acquires are parked here, so that
a shm holder releases through this server while there are any.  Their
tickets are drawn by their own atomics, so each shm connection stores the
tickets it holds or waits for in record words this server lends it
(``lock_records``, a free slot's four words): when the connection dies,
they are passed on at once, as a parked connection's are.

Hand-offs: between a grant and the release that ends it the server has
nothing to do but wait, and sleeping in epoll there costs a wakeup on every
hand-off (on a virtual machine most of a round trip).  So while waiters are
parked the server keeps its loop polling instead of sleeping, for at most
``spin`` seconds after the last grant: the adaptive spinning of kernel
mutexes, bounded so that a long critical section costs at most ``spin`` of
one CPU per hand-off, and none at all without contention.

Fences: a fenced WRITE carries (lock key, token).  On the lock's own server
the token must hold the lock right now (a token it never issued belongs to
the same name placed on another server, and is judged like the next case).  Any other server cannot see the
lock's words, so it applies the classic fencing-token rule: refuse a token
lower than the highest it has seen for that key.  A stale holder's write is
thus refused everywhere once the next holder has written there, and on the
lock's server at once.

What cleans itself, so that no client can pile up work: a connection may park at most
``max_parked`` acquires; cancelling any number of them, or dropping the
connection, costs O(n log n), not a scan per waiter (``_core.LockTable``).
A connection that ``lock_open``ed a name keeps its slot bound until it
``lock_close``s it or goes away; a slot nobody has open, nobody holds and
nobody waits for is freed, for any name to use, and its last ticket is
remembered as that key's fence floor, so that no stale token of the freed
lock passes a fence.  The fence table itself is bounded: a key it forgets
raises the floor of its bucket to the key's token, so forgetting can refuse
an old token that was good, but never accepts a stale one.

Words a client wrote by hand: the words are in memory clients change
with plain atomics (shm mappings, RDMA, TCP FETCH_ADD/COMPARE_SWAP), so a
buggy or hostile client can write anything there.  Two states no client
following the rules can make are checked at every sweep (one pass in C)
and after each TCP atomic on the segment: now_serving past next_ticket, and
more tickets queued than the connected clients could hold
(MAX_TICKETS_PER_CONNECTION each).  Such a lock is reset
(``LockTable.reset``): its tickets start again above every plausible word
and the time-based base, so fencing tokens only grow; parked waiters keep
their order, the holder loses the lock, and one-sided waiters draw again.
It is logged with the client that did it where the server can tell (a TCP
atomic), else with the shm connections that could have.  Parked acquires
whose tickets a client skipped by hand are queued again, not failed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Collection
from typing import Any, Protocol

from .. import _core
from ..busypoll import poll_while
from ..errors import ErrorCode
from ..protocol import (
    FLAG_NOREPLY,
    FLAG_QUEUED,
    H_FLAGS,
    H_OFFSET,
    H_OP,
    H_REQUEST,
    H_SEGMENT,
    LOCK_SEGMENT,
    Header,
    Op,
    error_payload,
)
from .guard import RateLimitedLog
from .metrics import Durations
from .segment import Refused

log = logging.getLogger("smb2.lock")

SLOT = _core.LOCK_SLOT_SIZE
DEFAULT_LEASE = 5.0
DEFAULT_SLOTS = 4096
MAX_LEASE = 3600.0
DEFAULT_SPIN = 0.001
MAX_SPIN = 0.1
MAX_SLOTS = 1 << 20
# tokens seen in fenced writes for locks held elsewhere; an untrusted client
# must not grow this without bound (the oldest keys are forgotten first,
# into the floor of their bucket)
MAX_FENCE_KEYS = 1 << 16
FENCE_BUCKETS = 1 << 12
# parked LOCK_ACQUIREs per connection (each costs about 800 bytes).  Below
# the server's in-flight cap (--max-inflight, 1024), where it stops reading
# a connection: a connection full of parked acquires could then no longer
# send the release they wait for; refused, it can.
DEFAULT_MAX_PARKED = 512
# record slots (of _core.LOCK_RECORDS words) one connection may borrow: as
# many futex-path acquisitions at once; more only pass on at the lease's end
MAX_RECORD_SLOTS = 16
# ...and all connections together at most this share of the lock slots, so
# that clients borrowing records can never leave no slot for a lock
RECORD_SHARE = 4
# Tickets one connection can have outstanding on a lock, at the most: one
# per Lock object that waits or holds (parked acquires are capped at 512).
# More queued than this per connection (plus one) is a lock whose words a
# client wrote by hand: the server resets it (see "Words a client wrote").
MAX_TICKETS_PER_CONNECTION = 1 << 16
# a reset numbers the lock's tickets on from the largest of its words that
# a server could have issued (tickets start near 2**60.6, see _ticket_base)
# and the time-based base, so that fencing tokens only grow
PLAUSIBLE_TICKET = 1 << 62


class Requester(Protocol):
    """What the lock service needs of a client connection (``connection.Connection``
    implements it): its address for the log, whether it can still be answered,
    and a way to answer a request, maybe long after the request came in (a
    parked acquire)."""

    peer: str
    transport_name: str

    def is_open(self) -> bool:
        """False once the connection is closing or closed."""

    def reply(self, hdr: Header, payload: bytes | memoryview = b"",
              status: int = 0, flags: int = 0) -> None:
        """Answer the request whose header is ``hdr``."""


def _ticket_base() -> int:
    # Tickets start at a time-based value, so that tokens stay monotone
    # across a restart of this server (other servers remember the highest
    # token they saw): microseconds since the epoch << 10 leaves room for
    # 1024 tickets per microsecond of the previous incarnation, in 2**61.
    return (time.time_ns() // 1000) << 10


class LockService:
    """One server's locks: the lock segment, the table, parked requests."""

    def __init__(self, mem: Any, view: memoryview, *,
                 slots: int = DEFAULT_SLOTS, lease: float = DEFAULT_LEASE, max_lease: float | None = None,
                 spin: float = DEFAULT_SPIN, max_parked: int = DEFAULT_MAX_PARKED,
                 clients: Callable[[], Collection[Requester]] = tuple) -> None:
        self.mem = mem
        # the server's connections now: how many tickets can be outstanding,
        # and whom to name when a lock's words were made impossible
        self.clients = clients
        self.view = view
        self.nslots = slots
        self.lease = lease
        # the longest lease a client may ask for at lock_open: the server's
        # own unless the operator allows longer (--lock-max-lease).  The
        # first opener's lease holds for every later user, so a client that
        # could pick an hour would make everyone wait an hour behind a
        # holder that froze.
        self.max_lease = max(lease, max_lease or lease)
        self.table = _core.LockTable(view, slots)
        self.by_name: dict[str, int] = {}      # lock name -> slot
        self.names: list[str | None] = [None] * slots
        self._free = list(range(slots - 1, -1, -1))     # free slots, lowest last
        # who has each slot open (lock_open .. lock_close or disconnect), and
        # the slots nobody has open that still wait to become idle
        self._openers: dict[int, set[Requester]] = {}
        self._opened: dict[Requester, set[int]] = {}
        self._orphans: set[int] = set()
        self.reclaimed = 0
        self.by_key: dict[int, int] = {}       # fence key -> slot (locks held here)
        self.fences: dict[int, int] = {}       # fence key -> lowest good token (others, freed)
        self._fence_floors = [0] * FENCE_BUCKETS  # the same, for keys forgotten
        # parked LOCK_ACQUIREs: waiter id -> (connection, header).  A waiter
        # id is (owner << 32 | request id): LOCK_CANCEL names the acquire by
        # its request id, and no table maps one to the other.
        self._parked: dict[int, tuple[Requester, Header]] = {}
        self._parked_of: dict[int, set[int]] = {}  # owner -> its parked waiter ids
        self.max_parked = max_parked
        # each connection that used a lock: its owner id in the table (the
        # table knows owners, not connections; connection_lost forgets it)
        self._owners: dict[Requester, int] = {}
        self._leases: dict[int, float] = {}      # slot -> lease, where set by lock_open
        self._next_owner = 1
        self._sweeper: asyncio.Task[None] | None = None
        self.stale_fences = 0
        self.stale_releases = 0
        # polling instead of sleeping while a hand-off is due (see the top)
        self.spin = spin
        self._spin_until = 0.0
        self._spin_since: float | None = None
        self.spin_seconds = 0.0
        # from a holder's release or lease expiry to the next parked
        # waiter's grant (--metrics): the server's share of a hand-off
        self.handoffs = Durations()
        # now_serving per open slot when futex sleepers were last woken
        self._woken_at: dict[int, int] = {}
        # record slots lent to shm connections (lock_records)
        self._records: dict[Requester, list[int]] = {}
        # locks reset because a client made their words impossible, and
        # parked acquires queued again because a client moved now_serving
        # past them (stat)
        self.resets = 0
        self.requeued = 0
        # a client that keeps writing impossible words gets one WARNING per
        # 10 s, not one per reset
        self.warn = RateLimitedLog(log).warning

    # -- lifecycle --------------------------------------------------------
    def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except asyncio.CancelledError:
                pass
            self._sweeper = None
        self._parked.clear()
        self._spin_until = 0.0

    def _interval(self) -> float:
        # the sweep's period bounds how late an expiry is noticed: a small
        # fraction of the shortest lease, and never longer than 50 ms (so an
        # abandoned ticket or a one-sided release is noticed soon)
        shortest = min(self._leases.values(), default=self.lease)
        return max(0.002, min(0.05, shortest / 20))

    def table_lease(self, slot: int) -> float:
        return self._leases.get(slot, self.lease)

    async def _sweep_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._interval())
            if not self.by_name:
                continue
            try:
                expired = self.table.expired
                now = loop.time()
                started = time.monotonic_ns()
                lapsed = self._lapsed(now, started)
                self._reset_impossible(None)
                self._deliver(self.table.sweep(now), started, lapsed)
                self._settle_all()
                if self._orphans:
                    for slot in list(self._orphans):
                        self._reclaim(slot)
                if self.table.expired != expired:
                    log.info("lock lease expired %d time(s); the queue moved on",
                             self.table.expired - expired)
            except Exception:  # a bug must not stop expiries for good
                log.exception("lock sweep failed")

    def max_queue(self) -> int:
        """The most tickets a lock can have outstanding with the clients
        connected now (see MAX_TICKETS_PER_CONNECTION)."""
        return (len(self.clients()) + 1) * MAX_TICKETS_PER_CONNECTION

    def _reset_impossible(self, who: Requester | None) -> None:
        """Reset every lock whose words a client made impossible (see the
        top: "Words a client wrote"); ``who`` is the connection whose atomic
        changed them just now, if one did (None: the sweep found them)."""
        for slot in self.table.impossible(self.max_queue()):
            self._reset(slot, who)

    def _reset(self, slot: int, who: Requester | None) -> None:
        nxt, serving, _ = self.table.words(slot)
        base = max([_ticket_base()] + [w + 1 for w in (nxt, serving) if w < PLAUSIBLE_TICKET])
        if who is not None:
            culprit = f"{who.peer} ({who.transport_name}) changed them"
        else:
            mapped = sorted(c.peer for c in self.clients() if c.transport_name == "shm")
            culprit = ("one of the clients that map the lock segment over shm changed them: "
                       + (", ".join(mapped[:8]) + (f" and {len(mapped) - 8} more" if len(mapped) > 8 else "")
                          if mapped else "none is connected now"))
        self.resets += 1
        self.warn("lock_reset", "lock %r had impossible words (next_ticket %d, now_serving %d: %s); %s. "
                    "It starts again at ticket %d: its holder, if any, lost it, and its waiters "
                    "keep their places", self.names[slot],
                    nxt, serving, "now_serving is past next_ticket" if (nxt - serving) % (1 << 64) >= 1 << 63
                    else f"{(nxt - serving) % (1 << 64)} tickets queued, more than {self.max_queue()} "
                    "the connected clients could hold", culprit, base)
        now = asyncio.get_running_loop().time()
        self._deliver(self.table.reset(slot, base, now))
        self._settle(slot)

    def _lapsed(self, now: float, now_ns: int) -> dict[int, int]:
        """Slot -> when (monotonic ns) its holder's lease ran out, for the
        slots whose lease has by ``now`` (loop time): the hand-off that
        follows an expiry is timed from there, not from the sweep."""
        due = self.table.next_deadline()
        if due is None or due > now:
            return {}
        lapsed = {}
        for slot in self.by_name.values():
            deadline = self.table.lease_deadline(slot)
            if deadline is not None and deadline <= now:
                lapsed[slot] = now_ns - int((now - deadline) * 1e9)
        return lapsed

    def _hand_off_due(self) -> None:
        """A waiter was parked or granted: poll for the release that comes
        next rather than sleep, for up to ``spin`` s."""
        if not self.spin:
            return
        # time.monotonic: uvloop's loop.time() moves in whole milliseconds
        now = time.monotonic()
        self._spin_until = now + self.spin
        if self._spin_since is None:
            self._spin_since = now
            poll_while(asyncio.get_running_loop(),
                       lambda: bool(self._parked) and time.monotonic() < self._spin_until, self._spin_stopped)

    def _spin_stopped(self) -> None:
        assert self._spin_since is not None
        self.spin_seconds += time.monotonic() - self._spin_since
        self._spin_since = None

    # -- control ------------------------------------------------------------
    def open(self, name: str, lease: float | None, conn: Requester) -> dict[str, Any]:
        """``lock_open``: bind ``name`` to a slot (if it has none) and count
        ``conn`` among its users until ``close_name`` or disconnect.  The
        lease is fixed when the slot is bound: another value is refused, and
        so is one over ``max_lease``."""
        if not isinstance(name, str) or not 0 < len(name.encode()) <= 255:
            raise Refused(ErrorCode.BAD_REQUEST, "lock names are 1..255 bytes of str")
        if lease is not None and not (isinstance(lease, (int, float)) and 0 < lease <= self.max_lease):
            raise Refused(ErrorCode.BAD_REQUEST,
                          f"lease must be in (0, {self.max_lease:g}] seconds on this server (its "
                          f"--lock-lease is {self.lease:g} s; --lock-max-lease lets clients ask for longer): "
                          "leave lease unset to get the server's")
        slot = self.by_name.get(name)
        key = _core.name_hash(name)
        if slot is None:
            if not self._free:
                raise Refused(ErrorCode.OUT_OF_MEMORY,
                              f"this server holds its maximum of {self.nslots} locks, all open "
                              "(a client frees the locks it no longer uses with lock.close())")
            slot = self._free.pop()
            # tickets go on from the freed lock's last one, if this key had one
            base = max(_ticket_base(), self.fences.pop(key, 0))
            self.table.open(slot, base, float(lease or self.lease), asyncio.get_running_loop().time())
            self._woken_at[slot] = base
            self.by_name[name] = slot
            self.names[slot] = name
            self.by_key[key] = slot
            if lease is not None:
                self._leases[slot] = float(lease)
            log.debug("lock %r in slot %d", name, slot)
        elif lease is not None and float(lease) != self.table.lease_of(slot):
            raise Refused(ErrorCode.CONFLICT,
                          f"lock {name!r} has a lease of {self.table.lease_of(slot)} s, fixed when "
                          f"it was opened; this client asked for {float(lease)} s (every user of a "
                          "lock must give the same lease, or none)")
        self._openers.setdefault(slot, set()).add(conn)
        self._opened.setdefault(conn, set()).add(slot)
        self._orphans.discard(slot)
        return {"segment": LOCK_SEGMENT, "offset": slot * SLOT, "slot": slot,
                "key": key, "lease": self.table_lease(slot)}

    def close_name(self, name: str, conn: Requester) -> dict[str, Any]:
        """``lock_close``: ``conn`` no longer uses ``name``; the slot is freed
        once nobody has it open and it is idle."""
        slot = self.by_name.get(name)
        if slot is not None and conn in self._openers.get(slot, ()):
            self._opened[conn].discard(slot)
            self._unopen(slot, conn)
        return {}

    def _unopen(self, slot: int, conn: Requester) -> None:
        users = self._openers.get(slot)
        if users is None:
            return
        users.discard(conn)
        if not users:
            del self._openers[slot]
            self._reclaim(slot)

    def _reclaim(self, slot: int) -> None:
        """Free ``slot`` if nobody has it open and it is idle; else look
        again at each sweep."""
        if slot in self._openers or not self.table.is_open(slot):
            self._orphans.discard(slot)
            return
        if not self.table.idle(slot):
            self._orphans.add(slot)
            return
        self._orphans.discard(slot)
        name = self.names[slot]
        assert name is not None
        key = _core.name_hash(name)
        # no token below the next ticket may pass a fence on this key again
        self._remember_fence(key, self.table.words(slot)[0])
        self.table.close(slot)
        self._woken_at.pop(slot, None)
        del self.by_name[name]
        self.names[slot] = None
        self.by_key.pop(key, None)
        self._leases.pop(slot, None)
        self._free.append(slot)
        self.reclaimed += 1
        log.debug("lock %r freed slot %d", name, slot)

    def abandon(self, offset: int, ticket: int) -> dict[str, Any]:
        """``lock_abandon``: a polling client gives up ``ticket`` (timeout or
        cancellation); the queue skips it."""
        slot = self._slot_of(offset)
        since = time.monotonic_ns()
        now = asyncio.get_running_loop().time()
        self._deliver(self.table.abandon(slot, ticket, now), since)
        # a ticket passed already comes from a shm holder that released
        # with its own atomic and saw acquires parked here: grant them
        self._deliver(self.table.poke(slot, now), since)
        self._settle(slot)
        return {}

    def lend_records(self, conn: Requester) -> dict[str, Any]:
        """``lock_records``: a slot of record words for ``conn``'s tickets
        (see the top); it comes back to the free list with the connection."""
        mine = self._records.setdefault(conn, [])
        lent = sum(len(slots) for slots in self._records.values())
        if len(mine) >= MAX_RECORD_SLOTS or lent >= self.nslots // RECORD_SHARE or not self._free:
            raise Refused(ErrorCode.OUT_OF_MEMORY,
                          f"no more ticket records for this connection (it has {len(mine)} slots of them, "
                          f"all connections {lent} of at most {self.nslots // RECORD_SHARE}, this server "
                          f"{len(self._free)} free slots); a lock still works, and a dead holder's "
                          "ticket passes at the end of its lease")
        slot = self._free.pop()
        for i in range(_core.LOCK_RECORDS):
            _core.atomic_store(self.view, slot * SLOT + 8 * i, 0)
        mine.append(slot)
        return {"segment": LOCK_SEGMENT, "offset": slot * SLOT, "words": _core.LOCK_RECORDS}

    def _pass_recorded(self, conn: Requester) -> int:
        """``conn`` is gone: give up the tickets its records name, and free
        the record slots.  Returns how many tickets were given up."""
        now = asyncio.get_running_loop().time()
        given_up = 0
        for rslot in self._records.pop(conn, ()):
            for i in range(_core.LOCK_RECORDS):
                at = rslot * SLOT + 8 * i
                record = _core.atomic_load(self.view, at)
                _core.atomic_store(self.view, at, 0)
                slot = _core.record_slot(record)
                if slot < 0 or not self.table.is_open(slot):
                    continue
                nxt, serving, _ = self.table.words(slot)
                ticket = _core.recorded_ticket(record, nxt, serving)
                if ticket is not None:
                    given_up += 1
                    self._deliver(self.table.abandon(slot, ticket, now))
            self._free.append(rslot)
        return given_up

    def stat(self) -> dict[str, Any]:
        locks = {}
        for name, slot in self.by_name.items():
            nxt, serving, hb = self.table.words(slot)
            locks[name] = {"slot": slot, "next_ticket": nxt, "now_serving": serving,
                           "queued": (nxt - serving) % (1 << 64),
                           "parked": self.table.parked_count(slot), "lease": self.table_lease(slot),
                           "abandoned": len(self.table.abandoned(slot))}
        return {"slots": self.nslots, "open": len(self.by_name), "grants": self.table.grants,
                "reclaimed": self.reclaimed, "stale_renewals": self.table.stale_renewals,
                "spin": self.spin, "spinning": self._spin_since is not None,
                "spin_seconds": self.spin_seconds,
                "expired": self.table.expired, "abandoned_skips": self.table.abandoned_skips,
                "stale_fences": self.stale_fences, "stale_releases": self.stale_releases,
                "resets": self.resets, "requeued": self.requeued, "locks": locks}

    def _slot_of(self, offset: int) -> int:
        if offset % SLOT or not 0 <= offset < self.nslots * SLOT:
            raise Refused(ErrorCode.BAD_REQUEST, f"offset {offset} is not a lock slot")
        slot = offset // SLOT
        if not self.table.is_open(slot):
            raise Refused(ErrorCode.NO_SUCH_BUFFER,
                          f"no lock in slot {slot} (open it first; did the server restart?)")
        return slot

    # -- frames -------------------------------------------------------------
    def check_header(self, hdr: Header, size: int) -> None:
        """Validate a lock op's header before its payload is read."""
        op, segment, offset = hdr[H_OP], hdr[H_SEGMENT], hdr[H_OFFSET]
        if segment != LOCK_SEGMENT:
            raise Refused(ErrorCode.BAD_REQUEST, "lock ops address the lock segment (0)")
        self._slot_of(offset)
        want = 0 if op == Op.LOCK_ACQUIRE else 8
        if size != want:
            raise Refused(ErrorCode.BAD_REQUEST, f"{Op(op).name} carries {want} bytes, not {size}")

    def _owner(self, conn: Requester) -> int:
        owner = self._owners.get(conn)
        if owner is None:
            owner = self._owners[conn] = self._next_owner
            self._next_owner = self._next_owner % 0x7FFFFFFF + 1
        return owner

    def on_frame(self, conn: Requester, hdr: Header, payload: memoryview) -> None:
        op, rid, offset = hdr[H_OP], hdr[H_REQUEST], hdr[H_OFFSET]
        now = asyncio.get_running_loop().time()
        owner = self._owner(conn)
        slot = self._slot_of(offset)
        if op == Op.LOCK_ACQUIRE:
            waiter = owner << 32 | rid
            mine = self._parked_of.setdefault(owner, set())
            if len(mine) >= self.max_parked:
                raise Refused(ErrorCode.OUT_OF_MEMORY,
                              f"this connection already has {len(mine)} lock acquires waiting, "
                              "the most a server parks for one connection")
            # marked parked BEFORE the table looks at now_serving: a shm
            # holder that releases meanwhile sees the mark (lock.py)
            _core.atomic_store(self.view, slot * SLOT + _core.LOCK_PARKED, self.table.parked_count(slot) + 1)
            try:
                ticket, granted = self.table.acquire(slot, waiter, owner, now)
            except ValueError:
                raise Refused(ErrorCode.BAD_REQUEST,
                              f"request id {rid} already waits for or holds a lock") from None
            finally:
                self._settle(slot)
            if granted:
                conn.reply(hdr, _core.pack_u64(ticket))
            else:
                self._parked[waiter] = (conn, hdr)
                mine.add(waiter)
                self._hand_off_due()
            return
        since = time.monotonic_ns()
        if op == Op.LOCK_RELEASE:
            ticket = _core.unpack_u64(payload)
            ok, grants = self.table.release(slot, ticket, now)
            if hdr[H_FLAGS] & FLAG_NOREPLY:
                if not ok:
                    self.stale_releases += 1
                    log.info("%s released lock %r with ticket %d, which did not hold it "
                             "(lease expired?)", conn.peer, self.names[slot], ticket)
                self._deliver(grants, since)
                self._settle(slot)
                return
            if not ok:
                raise Refused(ErrorCode.STALE_FENCE,
                              f"ticket {ticket} does not hold lock {self.names[slot]!r} "
                              "(its lease expired, or it was released already)")
            conn.reply(hdr)
            self._deliver(grants, since)
            self._settle(slot)
            return
        # LOCK_CANCEL: give up what the acquire with that request id got
        target = _core.unpack_u64(payload)
        if target <= 0xFFFFFFFF:
            waiter_id = owner << 32 | target
            parked = self._unpark(waiter_id)
            grants = self.table.cancel(waiter_id, now)
            if parked is not None:
                # the acquire is answered (the client ignores it) so that
                # its request id is not pending forever
                pconn, phdr = parked
                pconn.reply(phdr, error_payload("acquire cancelled"), status=ErrorCode.CONFLICT)
            self._deliver(grants, since)
            self._settle(slot)
        conn.reply(hdr)

    def touched(self, offset: int, who: Requester | None = None) -> None:
        """A generic atomic changed a lock word (the polling path over TCP),
        sent by ``who``."""
        slot = offset // SLOT
        if self.table.is_open(slot):
            if who is not None:
                nxt, serving, _ = self.table.words(slot)
                # the same test as LockTable.impossible, for this slot only
                if (nxt - serving) % (1 << 64) > self.max_queue():
                    self._reset(slot, who)
                    return
            since = time.monotonic_ns()
            self._deliver(self.table.poke(slot, asyncio.get_running_loop().time()), since)
            self._settle(slot)

    def connection_lost(self, conn: Requester) -> None:
        since = time.monotonic_ns()
        if self._pass_recorded(conn):
            log.info("shm connection %s lost while holding or waiting for a lock; passed on", conn.peer)
            self._settle_all()
        owner = self._owners.pop(conn, None)
        if owner is None:
            for slot in self._opened.pop(conn, ()):
                self._unopen(slot, conn)
            return          # never waited for a lock
        for slot in self._opened.pop(conn, ()):
            self._unopen(slot, conn)
        grants = self.table.drop_owner(owner, asyncio.get_running_loop().time())
        for wid in self._parked_of.pop(owner, ()):
            del self._parked[wid]
        for slot in list(self._orphans):
            self._reclaim(slot)     # what the owner held or waited for is given up
        if grants:
            log.info("connection %s lost while holding or waiting for a lock; passed on", conn.peer)
        self._deliver(grants, since)
        self._settle_all()

    def _settle(self, slot: int) -> None:
        """After anything that may have moved ``slot``: publish how many
        acquires are parked on it, and wake the shm clients sleeping on its
        now_serving if it moved."""
        if not self.table.is_open(slot):
            return
        base = slot * SLOT
        _core.atomic_store(self.view, base + _core.LOCK_PARKED, self.table.parked_count(slot))
        serving = self.table.words(slot)[1]
        if self._woken_at.get(slot) != serving:
            self._woken_at[slot] = serving
            _core.futex_wake(self.view, base + _core.LOCK_SERVING)

    def _settle_all(self) -> None:
        for slot in self.by_name.values():
            self._settle(slot)

    def _deliver(self, grants: list[int], since_ns: int | None = None,
                 lapsed: dict[int, int] | None = None) -> None:
        # Answer the parked acquires that were just granted.  A grant to a
        # connection that is closing is passed on at once (its
        # connection_lost may not have run yet), which may grant the next.
        # Each grant is a hand-off, timed from ``since_ns`` (when the move
        # that caused it began: a release, a cancel, a sweep) or, for a
        # slot in ``lapsed``, from when its holder's lease ran out.
        if since_ns is None:
            since_ns = time.monotonic_ns()
        queue = collections.deque(grants)
        while queue:
            wid = queue.popleft()
            entry = self._unpark(wid)
            if entry is None:
                continue
            conn, hdr = entry
            if not conn.is_open():
                queue.extend(self.table.cancel(wid, asyncio.get_running_loop().time()))
                continue
            got = self.table.waiter_ticket(wid)
            assert got is not None
            slot, ticket = got
            behind = (self.table.words(slot)[0] - ticket - 1) % (1 << 64)
            conn.reply(hdr, _core.pack_u64(ticket), flags=FLAG_QUEUED if behind else 0)
            self.handoffs.observe(time.monotonic_ns() - (lapsed.get(slot, since_ns) if lapsed else since_ns))
            self._hand_off_due()
        if self.table.lost:
            # A client moved now_serving past parked tickets by hand: their
            # waiters never held the lock, so they queue again (a new
            # ticket) rather than fail; their own timeouts still apply.
            lost = list(self.table.lost)
            self.table.lost.clear()
            now = asyncio.get_running_loop().time()
            for slot, wid in lost:
                entry = self._parked.get(wid)
                if entry is None or not self.table.is_open(slot):
                    continue
                self.requeued += 1
                ticket, granted = self.table.acquire(slot, wid, wid >> 32, now)
                if granted:
                    self._unpark(wid)
                    conn, hdr = entry
                    conn.reply(hdr, _core.pack_u64(ticket))
            if lost:
                self.warn("lock_requeue", "a client moved now_serving of a lock past %d parked "
                          "acquire(s); they queue again", len(lost))

    def _unpark(self, wid: int) -> tuple[Requester, Header] | None:
        entry = self._parked.pop(wid, None)
        if entry is not None:
            mine = self._parked_of.get(wid >> 32)
            if mine is not None:
                mine.discard(wid)
        return entry

    # -- fences -------------------------------------------------------------
    def check_fence(self, key: int, token: int) -> bool:
        slot = self.by_key.get(key)
        if slot is not None:
            # An RDMA holder releases one-sidedly, and the sweep sees that
            # only a few ms later: read the words now, so a write fenced with
            # a just-released token cannot slip through that gap.
            self.touched(slot * SLOT)
        # A token at or past our next ticket was never issued here: the same
        # name lives on another server for this writer (a client with
        # another server list -- say the next job on a subset of this
        # cluster -- places it by its own list).  Ours is then a leftover,
        # and the rule for locks held elsewhere applies.
        if slot is not None and token < self.table.words(slot)[0]:
            ok = bool(self.table.check_fence(slot, token))
        else:
            seen = self.fences.get(key)
            ok = token >= (self._fence_floors[key % FENCE_BUCKETS] if seen is None else seen)
            if ok and seen != token:
                self._remember_fence(key, token)
        if not ok:
            self.stale_fences += 1
        return ok


    def note_fence(self, key: int, token: int) -> None:
        """Learn that a fenced write with ``token`` was applied elsewhere (a
        replicated stripe's primary checked it): from now on no older token
        of ``key`` passes here.  Never refuses: the primary decided."""
        seen = self.fences.get(key)
        if token > (self._fence_floors[key % FENCE_BUCKETS] if seen is None else seen):
            self._remember_fence(key, token)

    def _remember_fence(self, key: int, token: int) -> None:
        """From now on ``key`` needs a token of at least ``token``.  The
        table is bounded: the key used longest ago is forgotten, and its
        token raises its bucket's floor, so a stale token of a forgotten key
        is still refused (an older good one may be refused too)."""
        self.fences.pop(key, None)
        self.fences[key] = token        # most recent last: evicted last
        if len(self.fences) > MAX_FENCE_KEYS:
            old = next(iter(self.fences))
            floor = self.fences.pop(old)
            bucket = old % FENCE_BUCKETS
            self._fence_floors[bucket] = max(self._fence_floors[bucket], floor)
