"""The distributed FIFO ticket lock, client side (docs/design.md, "The lock").

    async with buf.lock():                 # the buffer's own lock
        await buf.write(0, data)           # others wait their turn
    lock = client.lock("epoch")            # any named lock
    await lock.acquire(timeout=5.0)        # LockTimeout; the ticket is given up
    await buf.write(0, data, fence=lock)   # StaleFence if the lock was lost
    await lock.release()

A lock lives on one server (its name's hash picks it, like a buffer's first
stripe) as two words, ``next_ticket`` and ``now_serving``.  Two ways to wait:

* **park** (TCP and shm: their ``lock_waits`` offer "park"):
  one LOCK_ACQUIRE frame; the server answers when our turn comes.  Release
  is one LOCK_RELEASE.  No traffic while waiting.
* **poll** (RDMA, and TCP when asked): ``fetch_add(next_ticket, 1)``, then
  reads of ``now_serving`` with a backoff proportional to the distance to
  our ticket (``_core.TicketState``).  Only the transport interface's
  ``fetch_add``/``read_into``/``compare_swap`` are used, so the server's CPU
  takes no part when the fabric is one-sided.  Release is one
  ``compare_swap(now_serving, t, t + 1)``: as cheap as the fetch-and-add of
  the textbook lock, but a holder whose lease ran out cannot move the queue
  past the ticket of the holder that replaced it.
* **futex** (shm, whose ``lock_waits`` offer "futex"): the poll
  path's atomics on our own mapping of the lock segment, but a waiter
  spins for ``futex_spin`` seconds and then sleeps on a shared futex on
  ``now_serving`` (in a thread: the loop keeps running), and the releaser
  wakes it.  While the server has acquires parked on the lock (its
  ``LOCK_PARKED`` word), the release goes through the server instead, so
  that a TCP waiter is granted at once; no server CPU otherwise.  The
  ticket is stored in a record word the server lent this connection
  (``lock_records``), so that the server passes it on at once if this
  process dies, as it does for a parked ticket.

Either way the holder renews its lease every lease/3: a compare-and-swap
writes the heartbeat word tagged with its ticket (``_core.renewal_word``;
the server credits only a renewal tagged with the ticket it serves), and an
atomic read of now_serving tells the holder whether it still holds the
lock.  A holder that stops renewing loses the lock after the lease, and
learns it at its next renewal: ``locked()`` turns False and ``release()``,
``fence`` and the ``async with`` exit raise :class:`StaleFence`.  The
ticket is the fencing token.

``lock.close()`` (or dropping the object) tells the server this client no
longer uses the name; a slot nobody uses is freed for other names, so a job
may use any number of distinct lock names over time.

Which way a waiter waits is what the transport says it offers
(``Transport.lock_waits``, the first for ``mode="auto"``), never its class.

A lock that must outlive its server is a :class:`ReplicatedLock`
(``client.replicated_lock(name, replicas=2)``, at the end of this module):
the same ticket lock, its words in a replicated buffer, every step a
replicated atomic, and the lease kept by the waiters instead of a server.
Both drive the one ticket engine (:mod:`smb2.ticket`): acquire and its
timeout, a ticket no cancellation loses, the polling wait, the heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any, Protocol, cast

from . import _core
from .busypoll import poll_while
from .errors import (
    InterfaceError,
    InvalidArgumentError,
    LockLost,
    NoSuchBuffer,
    OutOfMemory,
    ServerError,
    StaleFence,
    TransportError,
)
from .host import usable_cpus
from .ticket import TicketLock, TicketOwner, after_lapse, spawn
from .transport import FutexCapable, Link, LockCapable, LockSlot, Transport

log = logging.getLogger("smb2.lock")

MODES = ("auto", "park", "poll", "futex")
#: seconds a futex-path waiter spins on now_serving while it is next in
#: line, before it sleeps on the futex: it is then on a CPU when its turn
#: comes, and the hand-off costs no wake-up (measured as the path was
#: built, 4 processes on 2 CPUs: about twice the acquisitions/s).  Only where this
#: process may run on more than one CPU: where every waiter shares one, a
#: spinner only delays the holder it waits for (there, a quarter of the
#: acquisitions/s at 50 us).
FUTEX_SPIN = 50e-6
#: seconds a futex-path waiter may sleep on the futex in the event loop's
#: own thread, per acquisition, before it sleeps in a helper thread instead.
#: The loop runs nothing else meanwhile, so this is taken only while no
#: other futex-path Lock on the same loop holds its lock or sleeps in a
#: helper thread (a holder on the loop could not run to release).  Woken
#: in the loop's thread, a hand-off costs one context switch; from a
#: helper thread it costs three and a trip through the GIL (measured as
#: the path was built, 4 processes on one CPU: about 3x the acquisitions/s).
FUTEX_BLOCK = 1e-3
#: an acquisition that never has to wait does not suspend: a coroutine
#: looping on one still lets the loop run this often
_YIELD_EVERY = 0.0005


def _not_drawn(next_ticket: int, ticket: int) -> bool:
    """True if ``ticket`` is not below ``next_ticket`` (modulo 2**64): no
    client following the rules drew it."""
    return not 0 < (next_ticket - ticket) % (1 << 64) < 1 << 63


def _default_futex_spin() -> float:
    return FUTEX_SPIN if usable_cpus() > 1 else 0.0


class LockOwner(TicketOwner, Protocol):
    """What a lock needs of its client (:class:`smb2.Client` is one): the
    links to the servers, and whether it is still open."""

    @property
    def links(self) -> Sequence[Link]: ...


def wait_path(mode: str, tr: Transport) -> str:
    """How a Lock in ``mode`` waits over ``tr``: what the transport says
    it offers (``lock_waits``; the first of them for "auto"), or
    InterfaceError if a forced mode is not among them."""
    path = tr.lock_waits[0] if mode == "auto" else mode
    if path in tr.lock_waits:
        return path
    if path == "futex":
        raise InterfaceError(f"the {tr.name} transport cannot wait on a futex: only shm can",
                             hint="use mode='auto'")
    if path == "park":
        raise InterfaceError(f"the {tr.name} transport cannot park lock waiters",
                             hint="use mode='poll' (or 'auto')")
    raise InterfaceError(f"the {tr.name} transport cannot poll a lock's words", hint="use mode='auto'")


class _SlotWords:
    """A Lock's words: its slot in the lock segment of its server, reached
    through one transport."""

    __slots__ = ("transport", "segment", "offset", "_buf8", "_view8")

    def __init__(self, transport: Transport, slot: LockSlot) -> None:
        self.transport = transport
        self.segment = slot.segment
        self.offset = slot.offset
        self._buf8 = bytearray(8)
        self._view8 = [memoryview(self._buf8)]

    def of(self, transport: Transport, slot: LockSlot) -> bool:
        return self.transport is transport and self.segment == slot.segment and self.offset == slot.offset

    async def draw(self) -> int:
        return await self.transport.fetch_add(self.segment, self.offset + _core.LOCK_NEXT, 1)

    async def swap_serving(self, expected: int, new: int) -> int:
        return await self.transport.compare_swap(self.segment, self.offset + _core.LOCK_SERVING, expected, new)

    async def swap_heartbeat(self, expected: int, new: int) -> int:
        return await self.transport.compare_swap(self.segment, self.offset + _core.LOCK_HEARTBEAT, expected, new)

    async def read_serving(self) -> int:
        await self.transport.read_into(self._view8, self.segment, self.offset + _core.LOCK_SERVING, 8)
        return _core.unpack_u64(self._buf8)


class _Records:
    """The ticket record words one shm connection borrowed from its server,
    free for a Lock to take: (byte offset in the lock segment, the value
    last stored there).  A record is never cleared: one that names a ticket
    passed already means nothing to the server."""

    __slots__ = ("free", "refused")

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []
        self.refused = False


_records: weakref.WeakKeyDictionary[Transport, _Records] = weakref.WeakKeyDictionary()


# Per event loop: how many futex-path Locks hold their lock, or wait for it
# asleep in a helper thread, on that loop.  A waiter blocks its loop's
# thread only while none does (see FUTEX_BLOCK), since any of them may need
# the loop to go on; a Lock on another loop (another thread) does not.  A
# Lock dropped while held leaves its loop counted, and waiters there then
# sleep in helper threads: slower, never stuck.  A loop leaves the table
# when its count returns to 0 (a plain dict: a weak one costs microseconds
# per acquisition).
_in_use: dict[asyncio.AbstractEventLoop, int] = {}


def _count_in_use(loop: asyncio.AbstractEventLoop, n: int) -> None:
    n += _in_use.get(loop, 0)
    if n:
        _in_use[loop] = n
    else:
        del _in_use[loop]


class Fence:
    """A fencing token by value: ``Fence(lock_name, token)``.  A process can
    hand its token to another one, or keep one to prove later that its lock
    was lost; ``buf.write(..., fence=Fence(...))`` is refused unless the
    token still fences the lock."""

    __slots__ = ("name", "token", "key")

    def __init__(self, name: str, token: int) -> None:
        if not isinstance(token, int) or not 0 <= token < 1 << 64:
            raise InvalidArgumentError(f"a fencing token is a u64, not {token!r}")
        self.name = name
        self.token = token
        self.key = _core.name_hash(name)

    def __repr__(self) -> str:
        return f"Fence({self.name!r}, {self.token})"


class Lock(TicketLock[_SlotWords]):
    """One contender for the named lock.  Not reentrant; one acquisition at a
    time per object (make several objects to contend from one client).

    ``lease``: seconds the holder may go without renewing (default: the
    server's ``--lock-lease``; longer only up to the server's
    ``--lock-max-lease``, and the lock's first opener fixes it for every
    user); ``mode``: "park", "poll", "futex" or
    "auto" (futex over shm, park over TCP, poll over RDMA);
    ``min_delay``/``max_delay``: bounds of the
    polling backoff; ``spin``: seconds this client's loop polls instead of
    sleeping after a contended grant (parked path), so that the critical
    section's round trips are not slowed by wakeups (0 = never);
    ``futex_spin``: seconds a futex-path waiter next in line spins before
    it sleeps (default :data:`FUTEX_SPIN` where this process may run on
    more than one CPU, else 0);
    ``futex_block``: seconds per acquisition it may sleep in the event
    loop's own thread, while no other futex-path Lock on the loop holds or
    waits (:data:`FUTEX_BLOCK`; 0: always sleep in a helper thread)."""

    __slots__ = ("mode", "_lease", "_min_delay", "_max_delay", "_spin", "_state", "_slot", "_transport",
                 "_words", "_parker", "_futex", "_path", "_renew", "_contended", "_link", "_unuse", "_closed",
                 "_record", "_recorded", "_recbox", "_futex_spin", "_futex_block", "_mapped", "_yielded",
                 "_holding", "__weakref__")

    kind = "Lock"
    client: LockOwner

    def __init__(self, client: LockOwner, name: str, *, lease: float | None = None, mode: str = "auto",
                 min_delay: float = 20e-6, max_delay: float = 0.05, spin: float = 1e-3,
                 futex_spin: float | None = None, futex_block: float = FUTEX_BLOCK) -> None:
        if not isinstance(name, str) or not 0 < len(name.encode()) <= 255:
            raise InvalidArgumentError(f"a lock name is a non-empty str of at most 255 bytes, not {name!r}")
        if mode not in MODES:
            raise InvalidArgumentError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        if lease is not None and not 0 < lease <= 3600:
            raise InvalidArgumentError(f"lease must be in (0, 3600] seconds, not {lease!r}")
        for what, value in (("spin", spin), ("futex_spin", futex_spin), ("futex_block", futex_block)):
            if value is not None and not 0 <= value <= 0.1:
                raise InvalidArgumentError(f"{what} must be in [0, 0.1] seconds, not {value!r}")
        super().__init__(client, name)
        self.mode = mode
        self._lease = lease
        self._min_delay = min_delay
        self._max_delay = max_delay
        self._spin = spin
        self._futex_spin = futex_spin
        self._futex_block = futex_block
        self._contended = False
        self._state: _core.TicketState | None = None
        self._slot: LockSlot | None = None
        self._transport: Transport | None = None
        # the slot's words through that transport
        self._words: _SlotWords | None = None
        # the same transport while the last acquisition parked, or waited
        # on a futex (else None)
        self._parker: LockCapable | None = None
        self._futex: FutexCapable | None = None
        self._path = ""
        self._renew: asyncio.TimerHandle | None = None
        self._link: Link | None = None  # where the name is open (see close)
        self._unuse: weakref.finalize[Any, Any] | None = None
        self._closed = False
        # futex path: our ticket record word (transport, offset), and its value
        self._record: tuple[Transport, int] | None = None
        # the same, for the finalizer of a Lock dropped without close (it
        # gives the record back to the connection's pool)
        self._recbox: list[tuple[Transport, int] | None] = [None]
        self._recorded = 0
        # futex path: the slot's words on our mapping (one C call per step)
        self._mapped: _core.MappedLock | None = None
        self._yielded = time.monotonic()
        # the loop this Lock is counted on in _in_use while it holds
        self._holding: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        state = "locked" if self.locked() else "unlocked"
        return f"<smb2.Lock {self.name!r} {state}{f' token={self.token}' if self.locked() else ''}>"

    # -- state --------------------------------------------------------------
    def locked(self) -> bool:
        """True while this object holds the lock (as far as it knows: a
        holder that stalled past its lease finds out at its next fenced
        write or at release, with StaleFence)."""
        return self._state is not None and self._state.state == _core.TICKET_HELD

    _held = locked

    @property
    def token(self) -> int | None:
        """The fencing token (our ticket) while held, else None."""
        return self._state.ticket if self.locked() and self._state is not None else None

    @property
    def fence(self) -> Fence:
        """The current fencing token as a :class:`Fence` (must be held;
        :class:`StaleFence` if the lock was found lost at a renewal)."""
        self._raise_if_lost()
        if not self.locked() or self._state is None:
            raise InterfaceError(f"lock {self.name!r} is not held by this Lock object")
        return Fence(self.name, self._state.ticket)

    @property
    def contended(self) -> bool:
        """True if, when the server granted the lock we hold, other tickets
        waited behind ours (parked path; the polling path does not know)."""
        return self.locked() and self._contended

    @property
    def path(self) -> str:
        """How the last acquisition waited: "park", "poll" or "futex" ("" before any)."""
        return self._path

    # -- acquire / release --------------------------------------------------
    async def acquire(self, timeout: float | None = None) -> bool:
        """Wait for the lock (FIFO).  With ``timeout`` (seconds), raise
        :class:`LockTimeout` when it runs out; the ticket is then given up
        and the queue does not wait for it.  Cancellation does the same."""
        ml, st = self._mapped, self._state
        if ml is not None and timeout is None and st is not None and st.state == _core.TICKET_IDLE \
                and not self._busy and not self._closed and ml.live:
            # the futex path on a lock used before: its words are in our
            # mapping, and an uncontended acquisition is one C call
            self._lost = None
            self._busy = True
            try:
                t = time.monotonic()
                if t - self._yielded >= _YIELD_EVERY:
                    # an acquisition that need not wait does not suspend: a
                    # loop of them would never let the loop run.  Before the
                    # draw, so as not to hold the lock meanwhile.
                    self._yielded = t
                    await asyncio.sleep(0)
                try:
                    code = ml.take(st, self._block_budget())
                except ConnectionError:
                    code = -1
                if code != _core.OBSERVE_GRANTED:
                    futex, slot = self._futex, self._slot
                    assert futex is not None and slot is not None
                    await self._wait_futex(futex, st, slot, ml, code)
                else:
                    self._futex_granted(st)
            finally:
                self._busy = False
            return True
        return await super().acquire(timeout)

    def _may_acquire(self) -> None:
        if self._closed:
            raise InterfaceError(f"lock {self.name!r} was closed", hint="make a new one: client.lock(name)")

    async def release(self, *, wait: bool = False) -> None:
        """Release the lock.

        On the parked (TCP) path the release is sent at once and this
        returns without waiting for the server's answer: anything this
        client sends the lock's server afterwards is ordered behind it, so
        nothing can observe the difference except a holder whose lease had
        already run out.  On the polling (RDMA) path it returns once the
        releasing atomic has completed.  With
        ``wait=True`` the answer is awaited and such a holder gets
        :class:`StaleFence` (what it did under the lock was not protected);
        otherwise the server only counts it (``stale_releases`` in its
        statistics), and over RDMA it is logged at WARNING on ``smb2.lock``."""
        st, ml = self._state, self._mapped
        if ml is not None and st is not None and st.state == _core.TICKET_HELD and self._path == "futex":
            ticket = st.ticket
            st.released()
            self._unhold()
            try:
                outcome = ml.release(ticket)
            except ConnectionError:
                outcome = -1
            if outcome != _core.RELEASE_DONE:
                await self._released_futex(outcome, ticket, wait)
            return
        if st is None or st.state != _core.TICKET_HELD:
            self._raise_if_lost()
            raise InterfaceError(f"release() of lock {self.name!r}, which this Lock object does not hold")
        ticket = st.ticket
        st.released()
        self._unhold()
        tr, slot, words = self._transport, self._slot, self._words
        assert tr is not None and slot is not None and words is not None
        if tr.closed:
            # the server gave the lock up when the connection went
            if wait:
                raise StaleFence(f"lock {self.name!r}: the connection to its server was lost, "
                                 "and the lock with it")
            return
        seg, off = slot.segment, slot.offset
        parker = self._parker
        if parker is not None:
            if wait:
                await parker.lock_release(seg, off, ticket)
            else:
                parker.lock_release_nowait(seg, off, ticket)
            return
        # The polling path's release is an atomic that may travel on another
        # channel than this client's next request (RDMA: the QP, while fenced
        # writes go through the server's CPU), so nothing orders the two:
        # wait for the atomic, or a write fenced with the released token could
        # reach the server first and pass.  Shielded: a cancelled caller must
        # not leave the lock held.
        done = spawn(self._release_cas(words, ticket))
        if not wait:
            done.add_done_callback(self._released)
            await asyncio.wait([done])
            return
        await asyncio.shield(done)

    async def _release_cas(self, words: _SlotWords, ticket: int) -> None:
        old = await words.swap_serving(ticket, ticket + 1)
        # a polling holder over a transport with futexes: waiters may sleep
        # behind it (elsewhere nobody sleeps on the word)
        words.transport.wake_ticket(words.segment, words.offset + _core.LOCK_SERVING, ticket + 1)
        if old != ticket:
            raise StaleFence(f"lock {self.name!r} was lost before release (lease expired: "
                             f"now serving {old}, our ticket {ticket})")

    def _released(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if isinstance(exc, StaleFence):
            log.warning("%s", exc)
        elif exc is not None:
            # the connection failed: the server passes the lock on by itself
            log.debug("lock %r: release not confirmed: %s", self.name, exc)

    async def close(self) -> None:
        """Release the lock if held, and stop using its name: once no Lock
        of this client uses it, the server is told, and frees the slot when
        nobody else uses it either.  Dropping the object does the same."""
        if self._closed:
            return
        try:
            if self.locked():
                await self.release()
        finally:
            self._closed = True
            self._return_record()
            link, unuse, self._unuse = self._link, self._unuse, None
            if link is not None and unuse is not None and unuse.detach() is not None:
                await link.lock_unused(self.name)

    # -- internals ------------------------------------------------------------
    async def _open(self, fresh: bool = False) -> tuple[Transport, LockSlot]:
        links = self.client.links
        # on the server its name's hash picks, like a buffer's first stripe
        link = links[_core.name_hash(self.name) % len(links)]
        got = await link.lock_slot(self.name, self._lease, fresh=fresh)
        if self._link is None:
            self._link = link
            link.lock_used(self.name)
            self._unuse = weakref.finalize(self, _unused, link, self.name, self._recbox)
        return got

    async def _acquire(self) -> None:
        tr, parker, st, slot = self._transport, self._parker, self._state, self._slot
        if parker is not None and tr is not None and st is not None and slot is not None and not tr.closed:
            # the common case, without the layers below: one frame on a
            # connection and a lock we used before (a NoSuchBuffer: below)
            with contextlib.suppress(NoSuchBuffer):
                self._granted(st, *await parker.lock_acquire(slot.segment, slot.offset))
                return
        if tr is None or slot is None or tr.closed:
            tr, slot = await self._open()
        try:
            await self._acquire_on(tr, slot)
        except NoSuchBuffer:
            # the lock's server restarted and forgot the lock: open it again
            tr, slot = await self._open(fresh=True)
            await self._acquire_on(tr, slot)

    async def _acquire_on(self, tr: Transport, slot: LockSlot) -> None:
        st = self._state
        if st is None or st.lease != slot.lease:
            st = self._state = _core.TicketState(slot.lease, self._min_delay, self._max_delay)
        seg, off = slot.segment, slot.offset
        self._transport, self._slot = tr, slot
        words = self._words
        if words is None or not words.of(tr, slot):
            words = self._words = _SlotWords(tr, slot)
        # what the transport offers: futexes on a mapping (shm), parking
        # where the server's CPU reads our requests (TCP), polling anywhere
        # (one-sided RDMA never wakes the server); auto takes the first
        path = wait_path(self.mode, tr)
        if path == "futex":
            futex = self._futex = cast(FutexCapable, tr)
            self._path, self._parker = "futex", None
            await self._wait_futex(futex, st, slot, await self._mapped_lock(futex, seg, off))
            return
        self._futex = None
        if path == "park":
            parker = self._parker = cast(LockCapable, tr)
            self._path = "park"
            self._granted(st, *await parker.lock_acquire(seg, off))
            return
        self._path, self._parker = "poll", None
        await self._wait_turn(words)
        self._arm_renewal(st)

    def _granted(self, st: _core.TicketState, ticket: int, queued: bool) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        st.start(ticket, now)
        st.granted(now)
        self._contended = queued
        if queued and self._spin:
            # Others wait on us: answers to what we send inside the critical
            # section should find this loop polling rather than asleep
            # (each wakeup is most of a round trip on a virtual machine).
            # For at most `spin` seconds, and none without contention.
            until = time.monotonic() + self._spin
            poll_while(loop, lambda: st.state == _core.TICKET_HELD and st.ticket == ticket
                       and time.monotonic() < until)
        self._arm_renewal(st)

    def _arm_renewal(self, st: _core.TicketState) -> None:
        # One renewal timer per Lock, armed lazily: a lock taken and given
        # back many times per lease costs no timer per acquisition.
        if self._renew is None:
            self._renew = self._renew_at(asyncio.get_running_loop(), st.renew_at)

    # -- the polling wait (the engine's, on our words) ---------------------------
    def _started(self, ticket: int) -> None:
        # time.monotonic, not loop.time: uvloop's clock is cached per loop
        # iteration in whole milliseconds, and the hold times the backoff
        # learns are tens of microseconds.  Both read CLOCK_MONOTONIC, so
        # renew_at stays good for loop.call_at.
        assert self._state is not None
        self._state.start(ticket, time.monotonic())

    async def _look(self, words: _SlotWords, ticket: int) -> tuple[int, float]:
        # LAPSED: we slept past our turn and the server expired our ticket
        # (or a client moved now_serving by hand).  The backoff is the
        # state's; where it is shorter than a timer tick the read's round
        # trip is the pause, and where there is none (a mapped segment:
        # shm) one pass of the loop
        assert self._state is not None
        serving = await words.read_serving()
        code, delay = self._state.observe(serving, time.monotonic())
        return code, delay

    def _stop_waiting(self, words: _SlotWords, ticket: int) -> None:
        st = self._state
        if st is not None and st.state != _core.TICKET_IDLE:
            self._give_up(words, st.ticket)
            st.released()

    async def _wait_futex(self, tr: FutexCapable, st: _core.TicketState, slot: LockSlot,
                          ml: _core.MappedLock, code: int | None = None) -> None:
        """Wait on the futex path: draw a ticket, or go on with the one
        ``ml.take`` drew (its ``code``; -1: the connection was gone)."""
        seg, off = slot.segment, slot.offset
        words = self._words
        assert words is not None
        now = time.monotonic
        loop = asyncio.get_running_loop()
        block = self._block_budget()
        try:
            if code is None:
                t = now()
                code = ml.take(st, block)
                block -= now() - t
            elif code == -1:
                raise ConnectionError
            else:
                block = 0.0     # the caller's take() spent the budget
            lapses = 0
            while code != _core.OBSERVE_GRANTED:
                if code == _core.OBSERVE_LAPSED:
                    log.debug("lock %r: ticket passed while waiting; drawing a new one", self.name)
                    lapses += 1
                    await after_lapse(lapses)
                    self._yielded = now()
                    code = ml.take(st, 0.0)
                    continue
                lapses = 0
                if block > 0:
                    t = now()
                    serving = ml.wait(st.ticket, block)
                    block -= now() - t
                else:
                    # MAX_SLEEP bounds each sleep: the waiter then looks at
                    # the words again, so a lapse or a dead server is seen
                    _count_in_use(loop, 1)
                    try:
                        serving = await tr.wait_ticket(seg, off + _core.LOCK_SERVING, st.ticket, st.lease)
                    finally:
                        _count_in_use(loop, -1)
                    self._yielded = now()
                code = st.observe(serving, now())[0]
                if code == _core.OBSERVE_WAIT and _not_drawn(ml.next_ticket(), st.ticket):
                    # next_ticket is at or below our ticket: a client wrote
                    # the words by hand (moved next_ticket and back), and our
                    # ticket is of a numbering nobody will serve: draw again
                    st.released()
                    code = _core.OBSERVE_LAPSED
        except ConnectionError:
            st.released()
            raise await self._connection_gone(tr, seg, off) from None
        except BaseException:
            self._stop_waiting(words, st.ticket)
            raise
        self._futex_granted(st)

    def _block_budget(self) -> float:
        # sleep in the loop's own thread (the releaser's wake lands there,
        # with no thread or loop hop between) unless a Lock on this loop
        # that holds or sleeps in a helper thread could need the loop
        return 0.0 if _in_use.get(asyncio.get_running_loop()) else self._futex_block

    def _futex_granted(self, st: _core.TicketState) -> None:
        if self._holding is None:
            self._holding = asyncio.get_running_loop()
            _count_in_use(self._holding, 1)
        if self._renew is None:
            self._arm_renewal(st)

    async def _mapped_lock(self, tr: FutexCapable, seg: int, off: int) -> _core.MappedLock:
        """The slot's words on our mapping of the lock segment, with our
        ticket record (borrowed from the server once per few Locks)."""
        ml = self._mapped
        if ml is not None:
            if ml.live and ml.slot * _core.LOCK_SLOT_SIZE == off and \
                    (self._record is None or self._record[0] is tr):
                return ml
            self._recorded, self._mapped = ml.recorded, None
        await self._take_record(tr)
        mapping = tr.mapping_of(seg)
        if mapping is None:
            await tr.fetch_add(seg, off + _core.LOCK_SERVING, 0)     # maps the segment
            mapping = tr.mapping_of(seg)
        if mapping is None:
            raise await self._connection_gone(tr, seg, off)
        ml = _core.MappedLock(mapping[0], off, mapping[3])
        ml.spin = _default_futex_spin() if self._futex_spin is None else self._futex_spin
        if self._record is not None:
            ml.use_record(self._record[1], self._recorded)
        self._mapped = ml
        return ml

    async def _connection_gone(self, tr: FutexCapable, seg: int, off: int) -> Exception:
        # the server's connection went while we used its words: the
        # transport's own operation says so in the user's words
        self._mapped = None
        try:
            await tr.fetch_add(seg, off + _core.LOCK_SERVING, 0)
        except Exception as exc:
            return exc
        return TransportError(f"lock {self.name!r}: the connection to {tr.label} was lost",
                              server=tr.label)

    async def _take_record(self, tr: FutexCapable) -> None:
        """A record word on ``tr`` for our tickets, borrowed from the server
        once per few Locks; without one (the server refused) a dead holder's
        ticket passes on at the end of its lease instead."""
        if self._record is not None and self._record[0] is tr:
            return
        self._return_record()
        pool = _records.get(tr)
        if pool is None:
            pool = _records[tr] = _Records()
        if not pool.free and not pool.refused:
            try:
                got = await tr.control({"cmd": "lock_records"})
                pool.free.extend((int(got["offset"]) + 8 * i, 0) for i in range(int(got["words"])))
            except (ServerError, KeyError, TypeError, ValueError) as exc:
                # an older server does not know the command: do not ask again
                pool.refused = not isinstance(exc, OutOfMemory)
                log.info("lock %r: the server lends no ticket records (%s): if this process dies "
                         "holding the lock, it passes on at the end of the lease", self.name, exc)
        if pool.free:
            offset, self._recorded = pool.free.pop()
            self._record = self._recbox[0] = (tr, offset)

    def _return_record(self) -> None:
        record, self._record = self._record, None
        self._recbox[0] = None
        if self._mapped is not None:
            self._recorded, self._mapped = self._mapped.recorded, None
        if record is not None:
            pool = _records.get(record[0])
            if pool is not None:
                pool.free.append((record[1], self._recorded))

    async def _released_futex(self, done: int, ticket: int, wait: bool) -> None:
        # what MappedLock.release found, where it is not RELEASE_DONE
        tr, slot = self._futex, self._slot
        assert tr is not None and slot is not None
        if done == _core.RELEASE_BY_SERVER:
            # TCP waiters are parked at the server: it releases, grants the
            # next of them at once, and wakes our sleepers
            if wait:
                await tr.lock_release(slot.segment, slot.offset, ticket)
            else:
                tr.lock_release_nowait(slot.segment, slot.offset, ticket)
        elif done == _core.RELEASE_PARKED_AFTER:
            # the server parked an acquire as we released (both seq-cst,
            # server/locks.py): make it look again
            spawn(tr.control({"cmd": "lock_abandon", "offset": slot.offset, "ticket": ticket}))
        elif wait:
            # lost: to a lease's end, or with the connection to the server
            raise StaleFence(f"lock {self.name!r} was lost before release: " + (
                "its lease ran out and the server passed it on" if done == _core.RELEASE_LOST else
                "the connection to its server was lost, and the lock with it") + f" (ticket {ticket})")
        elif done == _core.RELEASE_LOST:
            log.warning("lock %r was lost before release: its lease ran out and the server passed "
                        "it on (ticket %d)", self.name, ticket)

    def _unhold(self) -> None:
        loop, self._holding = self._holding, None
        if loop is not None:
            _count_in_use(loop, -1)

    def _give_up(self, words: _SlotWords, ticket: int) -> None:
        # the server skips the ticket when its turn comes (or now, if it has
        # come already: then we were the holder, and this releases)
        spawn(words.transport.control({"cmd": "lock_abandon", "offset": words.offset, "ticket": ticket}))

    def _renew_at(self, loop: asyncio.AbstractEventLoop, when: float) -> asyncio.TimerHandle:
        # The timer holds the Lock weakly: a Lock released and dropped must
        # go now (its finalizer frees its slot and its ticket record), not
        # when the timer fires a third of a lease later.  A job that takes a
        # fresh lock name per task would otherwise run out of slots: over
        # shm, 4,080 names went by in less than that time.
        return loop.call_at(when, _renew_due, weakref.ref(self))

    def _renew_due(self) -> None:
        self._renew = None
        st = self._state
        if st is None or st.state != _core.TICKET_HELD or self.client.closed:
            return          # released meanwhile (the next grant re-arms), or closed
        loop = asyncio.get_running_loop()
        if loop.time() < st.renew_at - 1e-3:
            # re-acquired since the timer was armed: not due yet
            self._renew = self._renew_at(loop, st.renew_at)
            return
        spawn(self._renew_now(st.ticket))

    async def _renew_now(self, ticket: int) -> None:
        words = self._words
        assert words is not None
        try:
            # the heartbeat tagged with our ticket (the server credits only
            # a renewal tagged with the ticket it serves), then do we hold it?
            serving = (await self._beat(words, ticket))[1]
        except (TransportError, NoSuchBuffer) as exc:
            log.warning("lock %r: renewing the lease failed (%s); the lock may be lost", self.name, exc)
            return
        st = self._state
        if serving != ticket and st is not None and st.state == _core.TICKET_HELD and st.ticket == ticket:
            st.released()
            self._unhold()
            self._lost = (f"lock {self.name!r} was lost: its lease of {st.lease} s ran out before "
                          f"this holder renewed it (ticket {ticket}, the lock now serves {serving})")
            log.warning("%s", self._lost)
            return
        if st is not None and st.state == _core.TICKET_HELD and st.ticket == ticket:
            loop = asyncio.get_running_loop()
            st.renewed(loop.time())
            if self._renew is None:
                self._renew = self._renew_at(loop, st.renew_at)


def _renew_due(ref: weakref.ref[Lock]) -> None:
    lock = ref()
    if lock is not None:
        lock._renew_due()


def _unused(link: Link, name: str, recbox: list[tuple[Transport, int] | None]) -> None:
    # a Lock was dropped without close(): its ticket record goes back to
    # its connection's pool (a record that names a passed ticket means
    # nothing), and its server is told, if a loop runs
    record = recbox[0]
    if record is not None:
        pool = _records.get(record[0])
        if pool is not None:
            pool.free.append((record[1], 0))
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    spawn(link.lock_unused(name))


def fence_of(fence: Lock | ReplicatedLock | Fence) -> tuple[int, int]:
    """``(key, token)`` of a fence argument."""
    if isinstance(fence, (Lock, ReplicatedLock)):
        fence = fence.fence
    if not isinstance(fence, Fence):
        raise InvalidArgumentError(f"fence must be a Lock or a Fence, not {type(fence).__name__}")
    return fence.key, fence.token


# -- the replicated lock ---------------------------------------------------------
#
# A lock that survives the loss of its server (docs/design.md, "The lock,
# replicated").  Its words live in a small replicated buffer, and every
# change to them is a replicated atomic: applied by the primary, copied to
# the backups before it is acknowledged, applied once however often it is
# retried.  So the words the new primary holds after a failover are the
# words every acknowledged step left, and the lock goes on from them.

#: the words of a replicated lock, in its buffer "lock:<name>"
_R_BASE, _R_NEXT, _R_SERVING, _R_HEARTBEAT = 0, 8, 16, 24
#: the size (and stripe: one stripe, so one replica group) of that buffer
REPLICATED_LOCK_BYTES = 32


def replicated_lock_buffer(name: str) -> str:
    """The replicated buffer that holds the words of replicated lock ``name``."""
    return "lock:" + name
#: the lease of a replicated lock when none is asked for (as --lock-lease's)
REPLICATED_LEASE = 5.0
_R_MASK62 = (1 << 62) - 1


def _tomb(ticket: int) -> int:
    """The heartbeat word that says ``ticket`` was passed on by a waiter
    (odd: a renewal only ever writes even words), so that the holder's
    next renewal fails instead of landing on a lock that moved on."""
    return ((ticket & _R_MASK62) << 1) | 1


class LockWords(Protocol):
    """What a replicated lock needs of its buffer (:class:`smb2.Buffer` is
    one): replicated atomics, a read, and which server takes them now."""

    async def fetch_add(self, offset: int, value: int = 1, *, timeout: float | None = None) -> int: ...

    async def compare_swap(self, offset: int, expected: int, new: int, *,
                           timeout: float | None = None) -> int: ...

    async def read(self, offset: int, nbytes: int, *, timeout: float | None = None) -> Any: ...

    async def primary_server(self, offset: int) -> str: ...


class _ReplicaWords:
    """A replicated lock's words: its buffer "lock:<name>"."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: LockWords) -> None:
        self.buffer = buffer

    async def draw(self) -> int:
        return await self.buffer.fetch_add(_R_NEXT, 1)

    async def swap_serving(self, expected: int, new: int) -> int:
        return await self.buffer.compare_swap(_R_SERVING, expected, new)

    async def swap_heartbeat(self, expected: int, new: int) -> int:
        return await self.buffer.compare_swap(_R_HEARTBEAT, expected, new)


class _Watch:
    """A waiter's eye on the holder: ``look`` reads ``now_serving`` and the
    heartbeat, and passes the holder over once both stayed the same for a
    whole lease from the first read that showed them.  ``delay``: the
    waiter's backoff between looks."""

    __slots__ = ("lease", "seen", "since", "heartbeat", "delay")

    def __init__(self, lease: float) -> None:
        self.lease = lease
        self.seen: tuple[int, int] | None = None
        self.since = 0.0
        self.heartbeat = 0
        self.delay = 1e-3

    async def look(self, lock: ReplicatedLock, words: _ReplicaWords) -> int:
        got = bytes(await words.buffer.read(_R_SERVING, 16))
        serving, self.heartbeat = _core.unpack_u64(got, 0), _core.unpack_u64(got, 8)
        now = time.monotonic()
        if (serving, self.heartbeat) != self.seen:
            self.seen, self.since = (serving, self.heartbeat), now
        elif now - self.since >= self.lease:
            self.seen = None
            if await lock._pass_over(words, serving, self.heartbeat):
                return serving + 1
        return serving


class ReplicatedLock(TicketLock[_ReplicaWords]):
    """The FIFO ticket lock, kept on ``replicas`` servers:
    ``client.replicated_lock(name, replicas=2)``.  Same use as :class:`Lock`
    (``acquire``/``release``, ``async with``, ``token``/``fence`` for fenced
    writes); it survives the loss of the server it is on.

    A holder keeps the lock across a failover as long as it renews it within
    its ``lease`` (default :data:`REPLICATED_LEASE`, longer than a failover);
    otherwise it is told, with :class:`~smb2.LockLost`, at its next
    ``release``, ``fence`` or ``async with`` exit, and ``locked()`` turns
    False as soon as its lease ran out.  Waiters keep their place in the
    queue.  A holder that stops renewing (its process died) is passed over
    by the waiters after a lease.  Every step is a replicated atomic, a few
    milliseconds each: use it where a lock must outlive a server, not where
    hand-offs must be fast."""

    __slots__ = ("replicas", "_open_words", "_words", "_lease", "_max_delay", "_ticket", "_valid_until",
                 "_server", "_renewer", "_watch", "__weakref__")

    kind = "ReplicatedLock"
    lost_error = LockLost
    lost_hint = ("what was done under the lock since then was not protected; acquire it again and check "
                 "the state it guards")
    # a waiter passed over looked as dead as a crashed holder: worth a line
    lapse_level = logging.INFO

    def __init__(self, client: LockOwner, name: str, open_words: Any, *, replicas: int,
                 lease: float | None = None, max_delay: float = 0.05) -> None:
        if not isinstance(name, str) or not 0 < len(name.encode()) <= 250:
            raise InvalidArgumentError(f"a replicated lock name is a non-empty str of at most 250 bytes, "
                                       f"not {name!r}")
        if lease is not None and not 0 < lease <= 3600:
            raise InvalidArgumentError(f"lease must be in (0, 3600] seconds, not {lease!r}")
        super().__init__(client, name)
        self.replicas = replicas
        self._open_words = open_words       # () -> awaitable LockWords: the buffer "lock:<name>"
        self._words: _ReplicaWords | None = None
        self._lease = REPLICATED_LEASE if lease is None else float(lease)
        self._max_delay = max_delay
        self._ticket: int | None = None     # ours while held
        self._valid_until = 0.0             # monotonic: held until then unless renewed
        self._server = ""                   # the server that granted or last renewed it
        self._renewer: asyncio.Task[None] | None = None
        self._watch: _Watch | None = None   # while acquiring: our eye on the holder

    def __repr__(self) -> str:
        state = f"locked token={self._ticket}" if self.locked() else "unlocked"
        return f"<smb2.ReplicatedLock {self.name!r} replicas={self.replicas} {state}>"

    @property
    def lease(self) -> float:
        return self._lease

    def locked(self) -> bool:
        """True while this object holds the lock and its lease, counted from
        the start of its last renewal that succeeded, has not run out."""
        return self._ticket is not None and time.monotonic() < self._valid_until

    @property
    def token(self) -> int | None:
        """The fencing token (our ticket) while held, else None."""
        return self._ticket if self.locked() else None

    @property
    def fence(self) -> Fence:
        """The current fencing token as a :class:`Fence` (must be held;
        :class:`~smb2.LockLost` if it was lost)."""
        self._check_lease()
        self._raise_if_lost()
        if self._ticket is None:
            raise InterfaceError(f"lock {self.name!r} is not held by this ReplicatedLock object")
        return Fence(self.name, self._ticket)

    # -- acquire / release ----------------------------------------------------
    def _held(self) -> bool:
        self._check_lease()         # a holder whose lease ran out may take the lock again
        return self._ticket is not None

    async def _open(self) -> _ReplicaWords:
        words = self._words
        if words is None:
            buffer = await self._open_words()
            # the first user sets the base: tickets start at a time-based
            # value, so that tokens keep growing even if every copy of the
            # lock was lost and it is made again
            base = (time.time_ns() // 1000) << 10
            got = await buffer.compare_swap(_R_BASE, 0, base)
            base = got or base
            await buffer.compare_swap(_R_NEXT, 0, base)
            await buffer.compare_swap(_R_SERVING, 0, base)
            words = self._words = _ReplicaWords(buffer)
        return words

    async def _acquire(self) -> None:
        words = await self._open()
        self._watch = _Watch(self._lease)
        try:
            await self._wait_turn(words)
        finally:
            self._watch = None

    async def _look(self, words: _ReplicaWords, ticket: int) -> tuple[int, float]:
        watch = self._watch
        assert watch is not None
        serving = await watch.look(self, words)
        if serving == ticket:
            # what a read shows may not be acknowledged yet (the primary
            # applies before its backups do): confirm with a renewal, a
            # replicated CAS, which also restarts the clock of any waiter
            # watching the heartbeat
            self._ticket, self._heartbeat, self._valid_until = ticket, watch.heartbeat, 0.0
            self._server = await words.buffer.primary_server(_R_SERVING)
            if await self._renew(ticket, granting=True):
                self._renewer = asyncio.ensure_future(_renew_replicated(weakref.ref(self), ticket))
                return _core.OBSERVE_GRANTED, 0.0
            self._ticket = None
            serving = ticket + 1
        if serving > ticket:
            return _core.OBSERVE_LAPSED, 0.0
        watch.delay = min(self._max_delay, max(1e-3, watch.delay * 1.5), 2e-3 * (ticket - serving))
        return _core.OBSERVE_WAIT, watch.delay

    def _stop_waiting(self, words: _ReplicaWords, ticket: int) -> None:
        if self._ticket == ticket and self._renewer is None:
            self._ticket = None         # stopped while confirming the grant
        if self._ticket != ticket:
            # the waiter's watch goes on: a silent holder it watched for
            # part of a lease is passed over a lease after it first saw it
            spawn(self._give_up_watching(words, ticket, self._watch or _Watch(self._lease)))

    def _give_up(self, words: _ReplicaWords, ticket: int) -> None:
        spawn(self._give_up_watching(words, ticket, _Watch(self._lease)))

    def _next_heartbeat(self, ticket: int, old: int) -> int | None:
        # even words only (a waiter's mark is odd); none over the mark that
        # says our ticket was passed on
        return None if old == _tomb(ticket) else (old | 1) + 1

    async def _pass_over(self, words: _ReplicaWords, serving: int, heartbeat: int) -> bool:
        """The holder of ``serving`` has not renewed for a whole lease: mark
        its heartbeat passed over (a CAS: fails if a renewal landed since),
        then move the lock on (a CAS: one waiter wins).  True if we moved it."""
        if heartbeat != _tomb(serving):
            if await words.swap_heartbeat(heartbeat, _tomb(serving)) != heartbeat:
                return False        # it renewed after all
        if await words.swap_serving(serving, serving + 1) != serving:
            return False
        log.warning("lock %r: the holder of ticket %d did not renew it for its lease of %g s; "
                    "passed on to the next waiter", self.name, serving, self._lease)
        return True

    async def _give_up_watching(self, words: _ReplicaWords, ticket: int, watch: _Watch) -> None:
        """A waiter that stopped waiting: when its turn comes, pass the lock
        on at once instead of after a lease; meanwhile it goes on watching
        for a silent holder, as a waiter does (waiters whose timeouts are
        shorter than the lease would otherwise never see a whole lease
        pass).  For as long as this process lives, up to 10 leases."""
        until = time.monotonic() + 10 * self._lease
        serving = ticket - 1
        while time.monotonic() < until and not self.client.closed:
            try:
                serving = await watch.look(self, words)
                if serving > ticket:
                    return
                if serving == ticket:
                    await words.swap_serving(ticket, ticket + 1)
                    return
            except Exception as exc:        # a failover: try again
                log.debug("lock %r: giving ticket %d up: %s", self.name, ticket, exc)
            await asyncio.sleep(min(self._max_delay, 2e-3 * max(1, ticket - serving)))

    async def release(self) -> None:
        """Release the lock: :class:`~smb2.LockLost` if it had been passed on
        meanwhile (what was done under it since then was not protected)."""
        ticket, words = self._ticket, self._words
        if ticket is None or words is None:
            self._raise_if_lost()
            raise InterfaceError(f"release() of lock {self.name!r}, which this ReplicatedLock object "
                                 "does not hold")
        self._unhold()
        old = await words.swap_serving(ticket, ticket + 1)
        if old != ticket:
            raise LockLost(
                f"lock {self.name!r} was lost before release: another client passed it on after this "
                f"holder did not renew it within its lease of {self._lease:g} s (ticket {ticket}, the lock "
                f"now serves {old})", hint=self.lost_hint)

    async def close(self) -> None:
        """Release the lock if held (the lock's buffer stays: other clients use it)."""
        if self._ticket is not None:
            with contextlib.suppress(StaleFence):
                await self.release()

    # -- holding --------------------------------------------------------------
    def _unhold(self) -> None:
        self._ticket = None
        renewer, self._renewer = self._renewer, None
        if renewer is not None and renewer is not asyncio.current_task():
            renewer.cancel()

    def _check_lease(self) -> None:
        # past the lease without a renewal: lost, as far as this holder can
        # know (a waiter may pass it on from now)
        if self._ticket is not None and time.monotonic() >= self._valid_until:
            self._lose(f"its lease of {self._lease:g} s ran out before this holder (ticket {self._ticket}) "
                       f"could renew it: its server {self._server} did not answer in time (lost, or "
                       "failing over to another copy)")

    def _lose(self, why: str) -> None:
        if self._ticket is None:
            return
        self._unhold()
        self._lost = f"lock {self.name!r} was lost: {why}"
        log.warning("%s", self._lost)

    async def _renew(self, ticket: int, granting: bool = False) -> bool:
        """One renewal: the heartbeat raised (a CAS: it fails on the word a
        waiter marked when it passed the lock on), then whether the lock
        still serves us (a CAS that changes nothing: an atomic read).  True,
        and the lease counted from this renewal's start, if we hold it."""
        words = self._words
        assert words is not None
        start = time.monotonic()
        if not granting and start >= self._valid_until:
            # the lease ran out first: a waiter may have the lock already,
            # and a renewal now must not make this holder think it kept it
            self._check_lease()
            return False
        # a heartbeat CAS that fails sees a renewal of ours that answered
        # late, or the last holder's word: it tries again over that
        old, serving = await self._beat(words, ticket)
        if self._ticket != ticket:
            return False        # released meanwhile
        if serving != ticket or old != self._heartbeat:
            return False
        server = await words.buffer.primary_server(_R_SERVING)
        self._valid_until = max(self._valid_until, start + self._lease)
        if self._ticket != ticket or time.monotonic() >= self._valid_until:
            self._check_lease()         # renewed too late to count: lost
            return False
        if server != self._server:
            log.warning("lock %r: kept by this holder (ticket %d) across the loss of server %s; now on %s",
                        self.name, ticket, self._server, server)
            self._server = server
        return True

    def _passed_over(self, ticket: int) -> str:
        return (f"this holder (ticket {ticket}) did not renew it within its lease of {self._lease:g} s "
                f"(its server {self._server} was lost, or this process stalled), and a waiter passed it on")


async def _renew_replicated(ref: weakref.ref[ReplicatedLock], ticket: int) -> None:
    """A replicated lock's renewals, every lease/3 while it is held (holds
    the lock weakly: one dropped while held stops renewing)."""
    lock = ref()
    if lock is None:
        return
    period = lock.lease / 3
    del lock
    while True:
        await asyncio.sleep(period)
        lock = ref()
        if lock is None or lock._ticket != ticket or lock.client.closed:
            return
        try:
            if not await lock._renew(ticket):
                if lock._ticket == ticket:
                    lock._lose(lock._passed_over(ticket))
                return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # a failover under way: the next renewal tries again; past the
            # lease the holder is told it lost the lock
            log.warning("lock %r: renewing failed (%s: %s); the lock is lost unless a renewal succeeds "
                        "within %.1f s", lock.name, type(exc).__name__, str(exc).splitlines()[0],
                        max(0.0, lock._valid_until - time.monotonic()))
            lock._check_lease()
        del lock
