"""The lock's state machines in _core against plain-Python references
(hypothesis): the server's LockTable and the client's TicketState."""

from __future__ import annotations

import mmap
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smb2 import _core

M64 = 1 << 64


def _d(a: int, b: int) -> int:
    """a - b as a signed 64-bit distance."""
    x = (a - b) % M64
    return x - M64 if x >= 1 << 63 else x


class RefSlot:
    def __init__(self, base: int, lease: float, now: float) -> None:
        self.next = base
        self.serving = base
        self.hb = 0
        self.lease = lease
        self.parked: list[tuple[int, int]] = []      # (ticket, waiter), FIFO
        self.gone: set[int] = set()
        self.holder: int | None = None
        self.seen = (base, 0)
        self.last = now
        self.seen_free = True       # nobody held it at the table's last look


class RefTable:
    """The documented semantics, written the plain way: words are ints
    mod 2**64, every waiter is a dict entry."""

    def __init__(self) -> None:
        self.slots: dict[int, RefSlot] = {}
        self.waiters: dict[int, tuple[int, int, int]] = {}    # waiter -> slot, ticket, owner
        self.lost: list[tuple[int, int]] = []
        self.expired = 0
        self.stale_renewals = 0

    def open(self, slot: int, base: int, lease: float, now: float) -> None:
        self.slots[slot] = RefSlot(base, lease, now)

    @staticmethod
    def _saw_draws(s: RefSlot, now: float) -> None:
        """A ticket drawn one-sidedly on a lock seen free holds it from the
        table's first sight of it, not from when the lock fell free."""
        if s.seen_free and s.next != s.serving:
            s.last = now
        s.seen_free = s.next == s.serving

    def _settle(self, slot: int, now: float) -> list[int]:
        s = self.slots[slot]
        if s.holder is not None and (s.holder not in self.waiters
                                     or self.waiters[s.holder][1] != s.serving):
            self.waiters.pop(s.holder, None)
            s.holder = None
        grants = []
        while True:
            while s.parked and _d(s.parked[0][0], s.serving) < 0:
                _, w = s.parked.pop(0)
                self.waiters.pop(w, None)
                self.lost.append((slot, w))
            s.gone = {t for t in s.gone if _d(t, s.serving) >= 0}
            if s.serving == s.next:
                break
            if s.serving in s.gone:
                s.gone.discard(s.serving)
                s.serving = (s.serving + 1) % M64
                continue
            if s.parked and s.parked[0][0] == s.serving:
                _, w = s.parked.pop(0)
                s.holder = w
                s.seen, s.last = (s.serving, s.hb), now
                grants.append(w)
            break
        if s.serving != s.seen[0]:
            s.seen, s.last = (s.serving, s.hb), now
        self._saw_draws(s, now)
        return grants

    def acquire(self, slot: int, waiter: int, owner: int, now: float) -> tuple[int, bool]:
        s = self.slots[slot]
        t = s.next
        s.next = (t + 1) % M64
        self.waiters[waiter] = (slot, t, owner)
        if s.serving == t:
            s.holder = waiter
            s.seen, s.last = (s.serving, s.hb), now
            s.seen_free = False
            return t, True
        s.parked.append((t, waiter))
        return t, False

    def release(self, slot: int, ticket: int, now: float) -> tuple[bool, list[int]]:
        s = self.slots[slot]
        if s.serving != ticket or s.next == s.serving:
            return False, []
        if s.holder is not None:
            self.waiters.pop(s.holder, None)
            s.holder = None
        s.serving = (ticket + 1) % M64
        return True, self._settle(slot, now)

    def abandon(self, slot: int, ticket: int, now: float) -> list[int]:
        s = self.slots[slot]
        if _d(ticket, s.serving) < 0 or _d(ticket, s.next) >= 0:
            return []
        if ticket == s.serving:
            if s.holder is not None:
                self.waiters.pop(s.holder, None)
                s.holder = None
            s.serving = (ticket + 1) % M64
            return self._settle(slot, now)
        s.gone.add(ticket)
        return []

    def cancel(self, waiter: int, now: float) -> list[int]:
        if waiter not in self.waiters:
            return []
        slot, t, _ = self.waiters[waiter]
        s = self.slots[slot]
        if s.holder == waiter and s.serving == t:
            return self.release(slot, t, now)[1]
        del self.waiters[waiter]
        if (t, waiter) not in s.parked:
            return []
        s.parked.remove((t, waiter))
        return self.abandon(slot, t, now)

    def drop_owner(self, owner: int, now: float) -> list[int]:
        grants = []
        for w in sorted((w for w, e in self.waiters.items() if e[2] == owner), reverse=True):
            grants += self.cancel(w, now)
        return grants

    def sweep(self, now: float) -> list[int]:
        grants = []
        for slot in sorted(self.slots):
            s = self.slots[slot]
            self._saw_draws(s, now)
            if s.serving != s.seen[0]:
                s.seen, s.last = (s.serving, s.hb), now
                grants += self._settle(slot, now)
                continue
            if s.hb != s.seen[1]:
                s.seen = (s.serving, s.hb)
                if s.hb >> 16 == s.serving % (1 << 48):     # the holder renewed
                    s.last = now
                    continue
                self.stale_renewals += 1                     # a stale holder did
            if s.next != s.serving and now - s.last >= s.lease:
                self.expired += 1
                if s.holder is not None:
                    self.waiters.pop(s.holder, None)
                    s.holder = None
                s.serving = (s.serving + 1) % M64
                s.seen, s.last = (s.serving, s.hb), now
                grants += self._settle(slot, now)
        return grants


def _words(mem: mmap.mmap, slot: int) -> tuple[int, int, int]:
    return struct.unpack_from("<QQQ", mem, 32 * slot)


OPS = st.one_of(
    st.tuples(st.just("acquire"), st.integers(0, 2), st.integers(0, 3)),
    st.tuples(st.just("release"), st.integers(0, 2), st.integers(-1, 3)),
    st.tuples(st.just("cancel"), st.integers(0, 30)),
    st.tuples(st.just("drop"), st.integers(0, 3)),
    st.tuples(st.just("abandon"), st.integers(0, 2), st.integers(-2, 5)),
    st.tuples(st.just("raw_take"), st.integers(0, 2)),          # a polling client's fetch_add
    st.tuples(st.just("raw_release"), st.integers(0, 2)),       # its compare_swap
    st.tuples(st.just("renew"), st.integers(0, 2), st.integers(-1, 0)),  # heartbeat CAS by holder/stale
    st.tuples(st.just("sweep"), st.floats(0, 2.0)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(OPS, max_size=60),
       st.sampled_from([0, 1000, M64 - 3, (1 << 63) - 2]))
def test_lock_table_matches_reference(ops: list[tuple], base: int) -> None:
    nslots = 3
    mem = mmap.mmap(-1, 4096)
    table = _core.LockTable(memoryview(mem), nslots)
    ref = RefTable()
    now = 0.0
    for slot in range(nslots):
        table.open(slot, base + slot, 1.0, now)
        ref.open(slot, (base + slot) % M64, 1.0, now)
    next_waiter = 0
    for op in ops:
        kind = op[0]
        if kind == "acquire":
            _, slot, owner = op
            got = table.acquire(slot, next_waiter, owner, now)
            assert got == ref.acquire(slot, next_waiter, owner, now)
            next_waiter += 1
        elif kind == "release":
            _, slot, delta = op
            ticket = (ref.slots[slot].serving + delta) % M64
            assert table.release(slot, ticket, now) == ref.release(slot, ticket, now)
        elif kind == "cancel":
            assert table.cancel(op[1], now) == ref.cancel(op[1], now)
        elif kind == "drop":
            assert table.drop_owner(op[1], now) == ref.drop_owner(op[1], now)
        elif kind == "abandon":
            _, slot, delta = op
            ticket = (ref.slots[slot].serving + delta) % M64
            assert table.abandon(slot, ticket, now) == ref.abandon(slot, ticket, now)
        elif kind == "raw_take":
            slot = op[1]
            s = ref.slots[slot]
            s.next = (s.next + 1) % M64
            struct.pack_into("<Q", mem, 32 * slot, s.next)
            assert table.poke(slot, now) == ref._settle(slot, now)
        elif kind == "raw_release":
            slot = op[1]
            s = ref.slots[slot]
            if s.serving != s.next:
                s.serving = (s.serving + 1) % M64
                struct.pack_into("<Q", mem, 32 * slot + 8, s.serving)
            assert table.poke(slot, now) == ref._settle(slot, now)
        elif kind == "renew":
            _, slot, delta = op
            s = ref.slots[slot]
            s.hb = _core.renewal_word((s.serving + delta) % M64, s.hb)
            struct.pack_into("<Q", mem, 32 * slot + 16, s.hb)
        else:
            now += op[1]
            assert table.sweep(now) == ref.sweep(now)
        for slot in range(nslots):
            s = ref.slots[slot]
            assert table.words(slot) == _words(mem, slot) == (s.next, s.serving, s.hb)
            assert table.parked(slot) == s.parked
            assert table.abandoned(slot) == sorted(s.gone)
            assert table.holder(slot) == s.holder
            # FIFO: parked tickets are consecutive in queue order, all ahead of serving
            tickets = [t for t, _ in s.parked]
            assert all(_d(b, a) > 0 for a, b in zip(tickets, tickets[1:]))
            assert all(_d(t, s.serving) > 0 for t in tickets)
        assert table.lost == ref.lost
        assert table.expired == ref.expired
        assert table.stale_renewals == ref.stale_renewals


def test_lock_table_fifo_grants_and_fences() -> None:
    mem = mmap.mmap(-1, 4096)
    table = _core.LockTable(memoryview(mem), 1)
    table.open(0, 10, 5.0, 0.0)
    assert table.acquire(0, 1, 100, 0.0) == (10, True)
    assert [table.acquire(0, w, 100 + w, 0.0) for w in (2, 3, 4)] == [(11, False), (12, False), (13, False)]
    assert table.check_fence(0, 10) and not table.check_fence(0, 11)
    assert table.cancel(3, 0.0) == []                   # 12 abandoned
    assert table.release(0, 10, 0.1) == (True, [2])
    assert not table.check_fence(0, 10)
    assert table.release(0, 10, 0.1) == (False, [])     # twice: refused
    assert table.release(0, 11, 0.2) == (True, [4])     # 12 skipped
    assert table.abandoned_skips == 1
    # the holder goes silent: the lease moves the queue on
    assert table.sweep(5.1) == []
    assert table.words(0)[1] == 13
    assert table.sweep(5.3) == []
    assert table.words(0)[1] == 14 and table.expired == 1
    assert table.next_deadline() is None


def test_a_lock_drawn_one_sidedly_after_lying_free_is_held_a_whole_lease() -> None:
    """A polling or futex client takes a free lock by its own fetch_add, with
    no grant the table sees.  Its lease runs from the table's first sight of
    it: before, it ran from when the lock fell free, and a lock free for a
    lease was taken from its new holder at the next sweep (a loaded run of
    test_lock_bounds saw the next waiter granted at once)."""
    mem = mmap.mmap(-1, 4096)
    table = _core.LockTable(memoryview(mem), 1)
    table.open(0, 10, 1.0, 0.0)
    assert table.sweep(5.0) == []                       # free for five leases
    struct.pack_into("<Q", mem, 0, 11)                  # a client's one-sided draw: it holds ticket 10
    assert table.sweep(5.1) == []
    assert table.words(0)[1] == 10 and table.expired == 0      # still its
    assert table.sweep(5.9) == [] and table.expired == 0
    assert table.sweep(6.2) == [] and table.expired == 1       # a lease of silence after it was seen
    # and the same through a poke (TCP polling's generic fetch_add)
    struct.pack_into("<Q", mem, 0, 12)
    assert table.sweep(20.0) == [] and table.expired == 1
    assert table.poke(0, 20.0) == []
    assert table.sweep(20.5) == [] and table.expired == 1
    assert table.sweep(21.0) == [] and table.expired == 2


def test_impossible_words_are_found_and_a_reset_keeps_the_parked_order() -> None:
    mem = mmap.mmap(-1, 4096)
    table = _core.LockTable(memoryview(mem), 2)
    table.open(0, 10, 5.0, 0.0)
    table.open(1, 10, 5.0, 0.0)
    assert table.acquire(0, 1, 100, 0.0) == (10, True)
    assert [table.acquire(0, w, 100 + w, 0.0) for w in (2, 3, 4)] == [(11, False), (12, False), (13, False)]
    assert table.cancel(3, 0.0) == []                   # 12 abandoned: not kept
    assert table.impossible(100) == []
    # a client wrote the words: now_serving past next_ticket (slot 0), and
    # far more queued than allowed (slot 1)
    struct.pack_into("<Q", mem, 8, 1 << 40)
    struct.pack_into("<Q", mem, 32, 10 + 1000)
    assert table.impossible(100) == [0, 1]
    # slot 0 numbered again from 500: waiters 2 and 4 keep their order,
    # the holder (1) lost it, the first waiter is granted
    assert table.reset(0, 500, 1.0) == [2]
    assert table.words(0)[:2] == (502, 500)
    assert table.waiter_ticket(2) == (0, 500) and table.waiter_ticket(4) == (0, 501)
    assert table.waiter_ticket(1) is None and not table.check_fence(0, 10)
    assert table.check_fence(0, 500)
    assert table.release(0, 500, 1.1) == (True, [4])
    assert table.release(0, 501, 1.2) == (True, [])
    assert table.idle(0) and table.resets == 1
    assert table.reset(1, 2000, 1.0) == []
    assert table.words(1)[:2] == (2000, 2000) and table.impossible(100) == []


def test_lock_table_rejects_misuse() -> None:
    mem = mmap.mmap(-1, 4096)
    with pytest.raises(ValueError):
        _core.LockTable(memoryview(mem), 1000)          # too small
    with pytest.raises(ValueError):
        _core.LockTable(memoryview(mem)[1:], 2)         # misaligned
    table = _core.LockTable(memoryview(mem), 2)
    with pytest.raises(KeyError):
        table.acquire(1, 1, 1, 0.0)                     # not open
    with pytest.raises(IndexError):
        table.open(2, 0, 1.0, 0.0)
    with pytest.raises(ValueError):
        table.open(0, 0, 0.0, 0.0)
    table.open(0, 0, 1.0, 0.0)
    table.acquire(0, 1, 1, 0.0)
    with pytest.raises(ValueError):
        table.acquire(0, 1, 1, 0.0)                     # waiter id reused


# -- client side -------------------------------------------------------------

def _ref_observe(ticket: int, serving: int, est: float, lo: float, hi: float) -> tuple[int, float]:
    d = _d(ticket, serving)
    if d == 0:
        return _core.OBSERVE_GRANTED, 0.0
    if d < 0:
        return _core.OBSERVE_LAPSED, 0.0
    return _core.OBSERVE_WAIT, min(max(0.5 * (d - 0.5) * est, lo), hi)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, M64 - 1), st.lists(st.tuples(st.integers(-3, 40), st.floats(0, 0.01)), min_size=1,
                                         max_size=30),
       st.floats(0.01, 10.0), st.floats(0, 1e-3), st.floats(1e-3, 0.2))
def test_ticket_state_matches_reference(ticket: int, steps: list[tuple[int, float]], lease: float,
                                        lo: float, hi: float) -> None:
    state = _core.TicketState(lease, lo, hi)
    hi_eff = min(hi, lease / 4)
    lo_eff = min(lo, hi_eff)
    assert (state.min_delay, state.max_delay) == (lo_eff, hi_eff)
    now = start_t = 1.0
    state.start(ticket, now)
    est = state.est_hold
    first_d = 0
    last_serving: int | None = None
    prev_t = 0.0
    move_t: float | None = None
    # now_serving only moves forward: walk it towards the ticket
    for back, dt in steps:
        now += dt
        serving = (ticket - back) % M64
        if last_serving is not None and _d(serving, last_serving) < 0:
            continue
        assert state.distance(serving) == back
        code, delay = state.observe(serving, now)
        if back == 0 and first_d > 0 and (now - start_t) / first_d < est:
            est = 0.5 * est + 0.5 * (now - start_t) / first_d
        if back > 0:
            first_d = first_d or back
            if last_serving is None:
                last_serving = serving
            elif _d(serving, last_serving) > 0:
                t_move = (prev_t + now) / 2
                if move_t is not None and (t_move - move_t) > 0:
                    est = 0.5 * est + 0.5 * (t_move - move_t) / _d(serving, last_serving)
                move_t = t_move
                last_serving = serving
            prev_t = now
        ref_code, ref_delay = _ref_observe(ticket, serving, est, lo_eff, hi_eff)
        assert code == ref_code
        assert delay == pytest.approx(ref_delay)
        assert state.est_hold == pytest.approx(est)
        if code == _core.OBSERVE_GRANTED:
            assert state.state == _core.TICKET_HELD
            assert state.renew_at == pytest.approx(now + lease / 3)
            assert state.renewed(now + 1) == pytest.approx(now + 1 + lease / 3)
            return
        if code == _core.OBSERVE_LAPSED:
            assert state.state == _core.TICKET_IDLE
            return
        assert 0 <= delay <= lease / 4


def test_ticket_state_estimate_decays_in_a_short_queue() -> None:
    # a long queue taught it slow hand-offs (10 ms); now every wait is one
    # 0.5 ms hand-off long, which a next-in-line waiter only sees as its
    # grant: the estimate must come down, or it would sleep 2.5 ms per turn
    state = _core.TicketState(5.0, 20e-6, 0.05, est_hold=10e-3)
    now, ticket = 0.0, 100
    for _ in range(20):
        state.start(ticket, now)
        assert state.observe(ticket - 1, now + 1e-4)[0] == _core.OBSERVE_WAIT
        assert state.observe(ticket, now + 5e-4)[0] == _core.OBSERVE_GRANTED
        state.released()
        now, ticket = now + 1e-3, ticket + 2
    assert state.est_hold < 1e-3
    # ... and a slow wait does not push it up from the grant alone
    state.start(ticket, now)
    state.observe(ticket - 1, now)
    state.observe(ticket, now + 1.0)
    assert state.est_hold < 1e-3


def test_ticket_state_misuse() -> None:
    state = _core.TicketState(1.0)
    with pytest.raises(ValueError):
        state.observe(0, 0.0)
    with pytest.raises(ValueError):
        state.renewed(0.0)
    state.start(5, 0.0)
    with pytest.raises(ValueError):
        state.start(6, 0.0)
    with pytest.raises(ValueError):
        _core.TicketState(0.0)
