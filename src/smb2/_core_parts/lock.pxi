# Part of smb2._core, included by _core.pyx (which lists the parts): the
# ticket lock's state machines, LockTable and TicketState.

from libc.stdint cimport uint8_t, uint64_t, int64_t
from libc.stdlib cimport calloc, free

from collections import deque
from heapq import heappop, heappush

# --------------------------------------------------------------------------
# The FIFO ticket lock (docs/design.md, "The lock").
#
# A lock is a 32-byte slot of a server's lock segment, four u64 words:
#
#   +0  next_ticket   acquire: t = fetch_add(next_ticket, 1)
#   +8  now_serving   the holder's ticket; release moves it to t + 1
#   +16 heartbeat     the holder bumps it to renew its lease
#   +24 reserved
#
# Tickets are u64 and wrap around, so every comparison below is on the
# signed difference of two tickets, never on their values.
#
# Two state machines live here, both sans-IO: LockTable is the server's
# view of its slots (parked waiters, abandoned tickets, leases), TicketState
# is one client's view of one acquisition (ticket, distance, backoff,
# renewal).  The asyncio layers (server/locks.py, lock.py) only move bytes
# and timers between them and the transports.

LOCK_SLOT_SIZE = 32
LOCK_NEXT = 0
LOCK_SERVING = 8
LOCK_HEARTBEAT = 16

# A lock slot's fourth word (it was reserved): the number of acquires the
# server has parked on it, kept by server/locks.py.  A shm holder releases
# with its own atomic while it is 0, and through the server otherwise, so
# that a parked TCP waiter is granted at once (docs/design.md, "The lock").
LOCK_PARKED = 24


cdef inline int64_t _tdiff(uint64_t a, uint64_t b) noexcept nogil:
    # a - b as a signed distance: correct across wrap-around as long as the
    # two tickets are less than 2**63 apart (they are: a queue that long
    # does not fit in any memory)
    return <int64_t>(a - b)


# The heartbeat word names the ticket that renewed it: the top 48 bits are
# the renewer's ticket (mod 2**48), the low 16 a counter that every renewal
# moves.  The server credits a renewal to the holder only when the tag is
# now_serving's, so a stale holder that keeps renewing cannot extend the
# lease of the holder that replaced it.
LOCK_TAG_SHIFT = 16
cdef uint64_t _TAG_MASK = (1ULL << 48) - 1


cdef inline uint64_t _hb_tag(uint64_t ticket) noexcept nogil:
    return (ticket & _TAG_MASK) << 16


def renewal_word(uint64_t ticket, uint64_t old):
    """The heartbeat word a holder of ``ticket`` writes over ``old``
    (compare-and-swap): its tag, and a counter that differs from old's."""
    cdef uint64_t count = (old + 1) & 0xFFFF if (old >> 16) == (ticket & _TAG_MASK) else 0
    if _hb_tag(ticket) | count == old:
        count = (count + 1) & 0xFFFF
    return _hb_tag(ticket) | count


def renews(uint64_t heartbeat, uint64_t serving):
    """True if the heartbeat word was written by the holder of ``serving``."""
    return (heartbeat >> 16) == (serving & _TAG_MASK)


cdef struct _Slot:
    uint64_t seen_serving      # now_serving / heartbeat as of last_change
    uint64_t seen_heartbeat
    uint64_t base              # the first ticket: keys of the abandoned heap
    double last_change         # when the holder last showed a sign of life
    double lease
    int64_t holder             # waiter id of the parked holder, -1 if none/unknown
    bint seen_free             # nobody held it at the table's last look
    bint used


cdef class LockTable:
    """The server's lock table over one lock segment.

    ``mem`` is the segment (a writable byte buffer of ``nslots * 32`` bytes,
    8-byte aligned: the server's page-aligned mmap).  The words live THERE,
    not here, so that one-sided operations (RDMA atomics, or the generic TCP
    FETCH_ADD/COMPARE_SWAP/READ ops) and this table see the same lock; the
    table only keeps what the words cannot say: who waits (parked waiters,
    FIFO), which tickets were given up, and when each holder last renewed.

    Waiters are ints chosen by the caller (one per parked acquire); owners
    are ints too (one per connection).  Every method that can move a lock
    returns the list of waiter ids that were granted the lock by it, in
    grant order; the caller answers their parked requests.

    Costs: no operation scans a queue.  A cancelled waiter stays in its
    slot's FIFO, dead (its ``_waiters`` entry is gone), and is dropped when
    it reaches the front; abandoned tickets are a set for membership and a
    heap for pruning the passed ones.  Cancelling N waiters and skipping
    their tickets is O(N log N), not a scan of the queue per ticket."""

    cdef object _mem            # keeps the buffer alive
    cdef uint64_t *_w
    cdef _Slot *_s
    cdef readonly Py_ssize_t nslots
    cdef list _parked           # per slot: deque of (ticket, waiter) in ticket order, dead ones too
    cdef list _abandoned        # per slot: set of tickets given up, or None
    cdef list _abandoned_heap   # per slot: heap of their keys (ticket - base)
    cdef list _live             # per slot: number of live parked waiters
    cdef dict _waiters          # waiter -> [slot, ticket, owner]
    cdef dict _owners           # owner -> set of waiters
    cdef readonly list lost     # (slot, waiter) parked waiters whose ticket was passed
    # counters for stat()
    cdef readonly uint64_t grants, expired, abandoned_skips, stale_renewals, resets

    def __cinit__(self, mem, Py_ssize_t nslots):
        cdef uint8_t[::1] view = mem
        if nslots <= 0 or view.shape[0] < nslots * 32:
            raise ValueError("lock segment too small for its slots")
        if (<size_t>&view[0]) % 8:
            raise ValueError("lock segment must be 8-byte aligned")
        self._mem = mem
        self._w = <uint64_t *>&view[0]
        self._s = <_Slot *>calloc(nslots, sizeof(_Slot))
        if self._s == NULL:
            raise MemoryError()
        self.nslots = nslots
        self._parked = [None] * nslots
        self._abandoned = [None] * nslots
        self._abandoned_heap = [None] * nslots
        self._live = [0] * nslots
        self._waiters = {}
        self._owners = {}
        self.lost = []

    def __dealloc__(self):
        free(self._s)

    cdef inline uint64_t *_words(self, Py_ssize_t slot) noexcept:
        return self._w + 4 * slot

    cdef _Slot *_slot(self, Py_ssize_t slot) except NULL:
        if slot < 0 or slot >= self.nslots or not self._s[slot].used:
            raise KeyError(f"lock slot {slot} is not open")
        return &self._s[slot]

    # -- set-up ---------------------------------------------------------
    def open(self, Py_ssize_t slot, uint64_t base, double lease, double now):
        """Start using ``slot``: tickets begin at ``base`` (a server makes it
        time-based, so tokens stay monotone across its restarts)."""
        if slot < 0 or slot >= self.nslots:
            raise IndexError("lock slot out of range")
        if not lease > 0:
            raise ValueError("lease must be positive")
        cdef uint64_t *w = self._words(slot)
        cdef _Slot *s = &self._s[slot]
        w[0] = base
        w[1] = base
        w[2] = 0
        w[3] = 0
        s.seen_serving = base
        s.seen_heartbeat = 0
        s.seen_free = True
        s.base = base
        s.last_change = now
        s.lease = lease
        s.holder = -1
        s.used = True
        self._parked[slot] = deque()
        self._abandoned[slot] = set()
        self._abandoned_heap[slot] = []
        self._live[slot] = 0

    def idle(self, Py_ssize_t slot):
        """True if nobody holds ``slot``, waits for it or gave a ticket of
        it up: it could be closed without anyone noticing."""
        cdef _Slot *s = self._slot(slot)
        cdef uint64_t *w = self._words(slot)
        return w[0] == w[1] and s.holder < 0 and self._live[slot] == 0 \
            and not self._abandoned[slot]

    def close(self, Py_ssize_t slot):
        """Stop using an idle ``slot`` (see ``idle``); it may be opened again
        for another name.  ValueError if it is not idle."""
        if not self.idle(slot):
            raise ValueError(f"lock slot {slot} is in use")
        self._s[slot].used = False
        self._parked[slot] = None
        self._abandoned[slot] = None
        self._abandoned_heap[slot] = None

    def lease_of(self, Py_ssize_t slot):
        return self._slot(slot).lease

    def set_lease(self, Py_ssize_t slot, double lease):
        if not lease > 0:
            raise ValueError("lease must be positive")
        self._slot(slot).lease = lease

    def is_open(self, Py_ssize_t slot):
        return 0 <= slot < self.nslots and self._s[slot].used

    # -- the parked (server-side waiting) path --------------------------
    def acquire(self, Py_ssize_t slot, int64_t waiter, int64_t owner, double now):
        """Take a ticket for ``waiter``; return ``(ticket, granted)``.  If not
        granted, the waiter is parked until a later call grants it."""
        cdef _Slot *s = self._slot(slot)
        if waiter in self._waiters:
            raise ValueError(f"waiter {waiter} already has a ticket")
        cdef uint64_t *w = self._words(slot)
        cdef uint64_t t = smb2_fetch_add64(&w[0], 1)
        self._waiters[waiter] = [slot, t, owner]
        self._owners.setdefault(owner, set()).add(waiter)
        if w[1] == t:
            self._grant(slot, s, waiter, now)
            return t, True
        (<object>self._parked[slot]).append((t, waiter))
        self._live[slot] += 1
        return t, False

    def release(self, Py_ssize_t slot, uint64_t ticket, double now):
        """Release by the holder of ``ticket``: ``(ok, grants)``.  Not ok
        (nothing changes) when ``ticket`` does not hold the lock: its lease
        expired, or it was released already."""
        cdef _Slot *s = self._slot(slot)
        cdef uint64_t *w = self._words(slot)
        if w[1] != ticket or w[0] == w[1] or not smb2_cas64(&w[1], ticket, ticket + 1):
            return False, []
        self._forget_holder(slot, s)
        return True, self._advance(slot, now)

    def cancel(self, int64_t waiter, double now):
        """Give up whatever ``waiter`` has: a parked ticket is abandoned (the
        queue skips it), a lock it was granted is released.  Unknown waiters
        (granted and released already, or never seen) are a no-op.  O(log n):
        the parked entry stays in the FIFO, dead, until it reaches the front."""
        entry = self._waiters.get(waiter)
        if entry is None:
            return []
        cdef Py_ssize_t slot = entry[0]
        cdef uint64_t t = entry[1]
        cdef _Slot *s = &self._s[slot]
        cdef uint64_t *w = self._words(slot)
        if s.holder == waiter and w[1] == t:
            self._forget_holder(slot, s)
            smb2_cas64(&w[1], t, t + 1)
            return self._advance(slot, now)
        self._drop_waiter(waiter)
        if s.holder == waiter:
            return []           # granted, and passed since (lease expired)
        self._live[slot] -= 1
        return self.abandon(slot, t, now)

    def drop_owner(self, int64_t owner, double now):
        """The owner's connection is gone: cancel all its waiters, in ticket
        order (a holder first, so the queue moves at once)."""
        waiters = self._owners.pop(owner, None)
        if not waiters:
            return []
        grants = []
        # parked tickets become abandoned first, so that releasing a held
        # lock afterwards skips them all in one pass
        for wid in sorted(waiters, reverse=True):
            grants.extend(self.cancel(wid, now))
        return grants

    def waiter_ticket(self, int64_t waiter):
        """``(slot, ticket)`` of a waiter that has one, else None."""
        entry = self._waiters.get(waiter)
        return None if entry is None else (entry[0], entry[1])

    # -- any path ---------------------------------------------------------
    def abandon(self, Py_ssize_t slot, uint64_t ticket, double now):
        """Ticket ``ticket`` will never be used (a polling client gave up,
        or a parked waiter went away): skip it when its turn comes, or now
        if its turn has come already."""
        cdef _Slot *s = self._slot(slot)
        cdef uint64_t *w = self._words(slot)
        cdef int64_t d = _tdiff(ticket, w[1])
        if d < 0 or _tdiff(ticket, w[0]) >= 0:
            return []           # passed already, or never issued
        if d == 0:
            self._forget_holder(slot, s)
            smb2_cas64(&w[1], ticket, ticket + 1)
            return self._advance(slot, now)
        gone = <set>self._abandoned[slot]
        if ticket not in gone:
            gone.add(ticket)
            heappush(<list>self._abandoned_heap[slot], _tdiff(ticket, s.base))
        return []

    def poke(self, Py_ssize_t slot, double now):
        """The words of ``slot`` were changed behind the table's back (a
        generic atomic op): grant or skip whatever is now due."""
        cdef _Slot *s = self._slot(slot)
        return self._advance(slot, now)

    def sweep(self, double now):
        """Periodic: notice one-sided changes (renewals, releases), expire
        holders whose lease ran out, skip abandoned tickets.  Returns the
        grants; ``expired`` counts the expiries so far.  A heartbeat not
        tagged with now_serving's ticket (``renews``) is a stale holder's:
        it is counted in ``stale_renewals`` and extends nothing."""
        cdef Py_ssize_t i
        cdef _Slot *s
        cdef uint64_t *w
        grants = []
        for i in range(self.nslots):
            s = &self._s[i]
            if not s.used:
                continue
            w = self._words(i)
            self._saw_draws(s, w, now)
            if w[1] != s.seen_serving:
                s.seen_serving = w[1]
                s.seen_heartbeat = w[2]
                s.last_change = now
                grants.extend(self._advance(i, now))
                continue
            if w[2] != s.seen_heartbeat:
                s.seen_heartbeat = w[2]
                if (w[2] >> 16) == (w[1] & _TAG_MASK):
                    s.last_change = now
                    continue
                self.stale_renewals += 1
            if w[0] != w[1] and now - s.last_change >= s.lease:
                # the holder of now_serving showed no sign of life for a
                # whole lease: move the queue past it.  Its fenced writes
                # are refused from now on (check_fence).
                if smb2_cas64(&w[1], s.seen_serving, s.seen_serving + 1):
                    self.expired += 1
                    self._forget_holder(i, s)
                # else it moved under us (a late release): that is a sign of
                # life too, and the next sweep sees it
                s.seen_serving = w[1]
                s.seen_heartbeat = w[2]
                s.last_change = now
                grants.extend(self._advance(i, now))
        return grants

    def impossible(self, uint64_t max_queue):
        """The open slots whose words no client following the rules could
        have made: now_serving past next_ticket, or more than ``max_queue``
        tickets outstanding (a client wrote them with plain atomics).  One
        pass over the slots, in C."""
        cdef Py_ssize_t i
        cdef uint64_t *w
        cdef int64_t d
        out = []
        for i in range(self.nslots):
            if self._s[i].used:
                w = self._words(i)
                d = _tdiff(w[0], w[1])
                if d < 0 or <uint64_t>d > max_queue:
                    out.append(i)
        return out

    def reset(self, Py_ssize_t slot, uint64_t base, double now):
        """Number ``slot``'s tickets again from ``base`` (its words were
        made impossible, see ``impossible``): the live parked waiters keep
        their order with new tickets, the first of them granted; a holder
        loses the lock (its token no longer fences), and tickets drawn
        one-sidedly are passed (their waiters draw again).  Returns the
        grants, as every method that moves a lock does."""
        cdef _Slot *s = self._slot(slot)
        cdef uint64_t *w = self._words(slot)
        cdef uint64_t old, k = 0
        live = [p for p in <object>self._parked[slot] if self._is_live(p)]
        self._forget_holder(slot, s)
        # next_ticket first (a shm client may draw meanwhile: it then gets a
        # ticket of the new numbering), now_serving last
        while True:
            old = smb2_load64(&w[0])
            if smb2_cas64(&w[0], old, base + <uint64_t>len(live)):
                break
        smb2_store64(&w[2], 0)
        fifo = deque()
        for t, wid in live:
            (<list>self._waiters[wid])[1] = base + k
            fifo.append((base + k, wid))
            k += 1
        self._parked[slot] = fifo
        self._live[slot] = len(live)
        self._abandoned[slot] = set()
        self._abandoned_heap[slot] = []
        s.base = base
        smb2_store64(&w[1], base)
        s.seen_serving = base
        s.seen_heartbeat = 0
        s.seen_free = False     # whoever holds it now holds it from now (last_change)
        s.last_change = now
        self.resets += 1
        return self._advance(slot, now)

    def next_deadline(self):
        """The earliest time a lease can expire, or None when no lock is held."""
        cdef Py_ssize_t i
        cdef double best = -1
        cdef uint64_t *w
        for i in range(self.nslots):
            if self._s[i].used:
                w = self._words(i)
                if w[0] != w[1]:
                    d = self._s[i].last_change + self._s[i].lease
                    if best < 0 or d < best:
                        best = d
        return None if best < 0 else best

    def lease_deadline(self, Py_ssize_t slot):
        """When the holder of ``slot`` loses it unless it shows a sign of
        life first, or None when nobody holds it (the server's metrics time
        a hand-off after an expiry from here)."""
        cdef _Slot *s = self._slot(slot)
        cdef uint64_t *w = self._words(slot)
        return None if w[0] == w[1] else s.last_change + s.lease

    def check_fence(self, Py_ssize_t slot, uint64_t token):
        """True if ``token`` holds the lock right now."""
        if not (0 <= slot < self.nslots and self._s[slot].used):
            return False
        cdef uint64_t *w = self._words(slot)
        return w[1] == token and w[0] != w[1]

    def words(self, Py_ssize_t slot):
        """``(next_ticket, now_serving, heartbeat)``."""
        self._slot(slot)
        cdef uint64_t *w = self._words(slot)
        return w[0], w[1], w[2]

    def parked(self, Py_ssize_t slot):
        """Live parked ``(ticket, waiter)`` pairs in FIFO order (O(n): for
        tests and statistics; ``parked_count`` is O(1))."""
        self._slot(slot)
        return [p for p in <object>self._parked[slot] if self._is_live(p)]

    def parked_count(self, Py_ssize_t slot):
        self._slot(slot)
        return self._live[slot]

    def abandoned(self, Py_ssize_t slot):
        self._slot(slot)
        return sorted(<object>self._abandoned[slot])

    def holder(self, Py_ssize_t slot):
        """Waiter id of the parked-path holder, or None."""
        cdef _Slot *s = self._slot(slot)
        return None if s.holder < 0 else s.holder

    # -- internals --------------------------------------------------------
    cdef bint _is_live(self, tuple entry):
        # a parked entry is live while its waiter still waits with that ticket
        e = self._waiters.get(entry[1])
        return e is not None and e[1] == entry[0]

    cdef void _grant(self, Py_ssize_t slot, _Slot *s, int64_t waiter, double now):
        s.holder = waiter
        s.seen_serving = self._words(slot)[1]
        s.seen_heartbeat = self._words(slot)[2]
        s.last_change = now     # the lease runs from the grant
        s.seen_free = False
        self.grants += 1

    cdef inline void _saw_draws(self, _Slot *s, uint64_t *w, double now) noexcept:
        # A ticket drawn one-sidedly (shm futex, RDMA or TCP polling) on a
        # free lock holds it with no grant the table saw.  Its lease runs from
        # the table's first sight of it held, not from when the lock fell free
        # (maybe long before: the sweep would expire the new holder before
        # its first renewal, and hand the lock on while it holds it).
        if s.seen_free and w[0] != w[1]:
            s.last_change = now
        s.seen_free = w[0] == w[1]

    cdef void _forget_holder(self, Py_ssize_t slot, _Slot *s):
        if s.holder >= 0:
            self._drop_waiter(s.holder)
            s.holder = -1

    cdef void _drop_waiter(self, int64_t waiter):
        entry = self._waiters.pop(waiter, None)
        if entry is not None:
            ws = self._owners.get(entry[2])
            if ws is not None:
                ws.discard(waiter)
                if not ws:
                    del self._owners[entry[2]]

    cdef list _advance(self, Py_ssize_t slot, double now):
        # Whatever moved now_serving, bring the slot to a resting state:
        # skip abandoned tickets, grant the parked waiter whose turn it is,
        # drop parked waiters whose ticket was passed (a client moved the
        # words by hand; they are told via ``lost``).  Each step pops what
        # it looks at, so the work is proportional to what moved.
        cdef _Slot *s = &self._s[slot]
        cdef uint64_t *w = self._words(slot)
        cdef uint64_t cur
        cdef int64_t cur_key
        parked = <object>self._parked[slot]
        gone = <set>self._abandoned[slot]
        heap = <list>self._abandoned_heap[slot]
        grants = []
        if s.holder >= 0:
            entry = self._waiters.get(s.holder)
            if entry is None or entry[1] != w[1]:
                # the holder's ticket was passed by a one-sided op or expiry
                self._forget_holder(slot, s)
        while True:
            cur = w[1]
            while parked and (_tdiff(parked[0][0], cur) < 0 or not self._is_live(parked[0])):
                t, wid = parked.popleft()
                if self._is_live((t, wid)):
                    self._live[slot] -= 1
                    self._drop_waiter(wid)
                    self.lost.append((slot, wid))
            cur_key = _tdiff(cur, s.base)
            while heap and heap[0] < cur_key:
                gone.discard(<uint64_t>(s.base + <uint64_t><int64_t>heappop(heap)))
            if cur == w[0]:
                break
            if cur in gone:
                if smb2_cas64(&w[1], cur, cur + 1):
                    gone.discard(cur)
                    self.abandoned_skips += 1
                continue
            if parked and parked[0][0] == cur:
                t, wid = parked.popleft()
                self._live[slot] -= 1
                self._grant(slot, s, wid, now)
                grants.append(wid)
            break
        if w[1] != s.seen_serving:
            s.seen_serving = w[1]
            s.seen_heartbeat = w[2]
            s.last_change = now
        self._saw_draws(s, w, now)
        return grants


# Client side --------------------------------------------------------------

TICKET_IDLE = 0
TICKET_WAITING = 1
TICKET_HELD = 2

OBSERVE_GRANTED = 0
OBSERVE_WAIT = 1
OBSERVE_LAPSED = 2


cdef class TicketState:
    """One client's acquisition of one lock, for the polling path (RDMA
    READs of now_serving) and the renewal schedule of both paths.

    ``observe(serving, now)`` decides from one read of now_serving: granted,
    lapsed (the queue passed the ticket: its lease ran out while we slept),
    or wait ``delay`` seconds.  The delay is proportional to the distance
    ``d = ticket - serving``: ``(d - 1/2) / 2`` estimated hold times (the
    hold time is learnt from how fast now_serving moves), clamped to
    ``[min_delay, max_delay]``: a waiter far back reads rarely, the next in
    line often, and nobody sleeps through a lease."""

    cdef readonly int state
    cdef readonly uint64_t ticket
    cdef readonly double lease
    cdef readonly double min_delay, max_delay
    cdef readonly double est_hold       # seconds per ticket served (EWMA)
    cdef readonly double renew_at       # when the holder must next renew
    cdef readonly double acquired_at
    cdef uint64_t _last_serving     # now_serving at the last read
    cdef double _prev_t             # time of the last read
    cdef double _move_t             # estimated time of the last move seen
    cdef bint _have_last, _have_move
    cdef double _start_t            # when the ticket was drawn
    cdef int64_t _first_d           # its distance at the first read

    def __init__(self, double lease, double min_delay=20e-6, double max_delay=0.05,
                 double est_hold=50e-6):
        if not lease > 0 or min_delay < 0 or max_delay < min_delay:
            raise ValueError("need lease > 0 and 0 <= min_delay <= max_delay")
        self.lease = lease
        self.min_delay = min_delay
        # never sleep past a quarter lease: a waiter whose turn came must
        # notice (and start renewing) long before its lease runs out
        self.max_delay = max_delay if max_delay < lease / 4 else lease / 4
        if self.min_delay > self.max_delay:
            self.min_delay = self.max_delay
        self.est_hold = est_hold if est_hold > 0 else 50e-6
        self.state = TICKET_IDLE

    def start(self, uint64_t ticket, double now):
        """We drew ``ticket``."""
        if self.state != TICKET_IDLE:
            raise ValueError("already waiting or holding")
        self.ticket = ticket
        self.state = TICKET_WAITING
        self._have_last = False
        self._have_move = False
        self._start_t = now
        self._first_d = 0
        return None

    def distance(self, uint64_t serving):
        return _tdiff(self.ticket, serving)

    def observe(self, uint64_t serving, double now):
        """One read of now_serving: ``(OBSERVE_*, delay)``."""
        if self.state != TICKET_WAITING:
            raise ValueError("not waiting")
        cdef int64_t d = _tdiff(self.ticket, serving)
        cdef int64_t moved
        cdef double sample, delay, t_move
        if d == 0:
            # Our wait served _first_d tickets: an upper bound of sorts on the
            # hold time, and the only sample a short queue gives (a waiter
            # next in line sees one move, the grant, and moves are timed
            # between two).  Taken only downwards, so that an estimate
            # inflated under a long queue decays once the queue is short,
            # and never upwards, where a late look would feed on itself.
            if self._first_d > 0:
                sample = (now - self._start_t) / self._first_d
                if sample < self.est_hold:
                    self.est_hold = 0.5 * self.est_hold + 0.5 * sample
            self.granted(now)
            return OBSERVE_GRANTED, 0.0
        if d < 0:
            self.state = TICKET_IDLE
            return OBSERVE_LAPSED, 0.0
        if self._first_d == 0:
            self._first_d = d
        if self._have_last:
            moved = _tdiff(serving, self._last_serving)
            if moved > 0:
                # The move happened between the previous read and this one:
                # date it half-way, so that reading rarely (far back in the
                # queue) does not inflate the estimate by the read interval.
                # The first move seen only starts the clock.
                t_move = 0.5 * (self._prev_t + now)
                if self._have_move:
                    sample = (t_move - self._move_t) / moved
                    if sample > 0:
                        self.est_hold = 0.5 * self.est_hold + 0.5 * sample
                self._move_t = t_move
                self._have_move = True
                self._last_serving = serving
        else:
            self._have_last = True
            self._last_serving = serving
        self._prev_t = now
        # Sleep until about half-way to our expected turn, (d - 1/2) hold
        # times away: the next in line (d == 1) looks again after a quarter
        # of a hold.  Sleeping the whole expected time instead would make
        # each hand-off idle while the next in line sleeps; the observed
        # service interval would include that idle time, and the estimate
        # would feed on itself up to max_delay.  Waking half-way bounds the
        # idle time, so the estimate settles near the true hold time.
        delay = 0.5 * (d - 0.5) * self.est_hold
        if delay < self.min_delay:
            delay = self.min_delay
        elif delay > self.max_delay:
            delay = self.max_delay
        return OBSERVE_WAIT, delay

    def granted(self, double now):
        """The lock is ours (parked path: the server said so)."""
        self.state = TICKET_HELD
        self.acquired_at = now
        self.renew_at = now + self.lease / 3
        return self.renew_at

    def renewed(self, double now):
        """The heartbeat was bumped at ``now``: next renewal deadline."""
        if self.state != TICKET_HELD:
            raise ValueError("not holding")
        self.renew_at = now + self.lease / 3
        return self.renew_at

    def released(self):
        self.state = TICKET_IDLE
        return None
