"""The ticket engine both locks drive (docs/design.md, "The lock").

A ticket lock is three words wherever they are kept: ``next_ticket`` (a
waiter draws its ticket with a fetch-and-add), ``now_serving`` (the ticket
that holds the lock) and a heartbeat the holder renews.  :class:`smb2.Lock`
keeps them in a slot of one server's lock segment, :class:`smb2.ReplicatedLock`
in a replicated buffer.  Each is a driver: it supplies its words
(:class:`TicketWords`) and what its storage decides (how a waiter looks at
its turn, how a ticket is given up, who holds the lease), and subclasses
:class:`TicketLock`, which does what they share:

* ``acquire``: one acquisition at a time per object, the timeout
  (:class:`~smb2.LockTimeout`), ``async with``;
* drawing a ticket that no cancellation can lose: a ticket drawn but never
  known would stall the queue behind it, so one that lands after its waiter
  stopped is given up as soon as it is known;
* the polling wait (``_wait_turn``): look at ``now_serving`` until it shows
  our ticket, draw again if the lock passed us by, back off meanwhile; a
  waiter stopped by a timeout, a cancellation or an error gives its ticket
  up, so that the queue does not wait for it;
* the renewal's heartbeat (``_beat``), and telling a holder that lost the
  lock (``_raise_if_lost``).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from typing import Any, Generic, Protocol, Self, TypeVar

from . import _core
from .errors import InterfaceError, LockTimeout, StaleFence

log = logging.getLogger("smb2.lock")

# The loops' timers tick in milliseconds (libuv under uvloop rounds to them):
# a shorter sleep would really last about a millisecond and idle every
# hand-off that long, so the polling wait does not sleep for less.
TIMER_RESOLUTION = 1e-3
#: A ticket passed before its waiter saw its turn is drawn again.  Again
#: and again only where a client wrote the lock's words by hand (now_serving
#: past next_ticket): the waiter then lets its loop run and backs off, up to
#: this long, until the server resets the lock (server/locks.py), so that
#: its own timeout fires and it draws no flood of tickets meanwhile.
LAPSE_BACKOFF = 0.05


async def after_lapse(lapses: int) -> None:
    """Let the loop run after the ``lapses``-th ticket in a row was passed
    (see LAPSE_BACKOFF): at once the first time, then ever longer."""
    await asyncio.sleep(0 if lapses <= 1 else min(LAPSE_BACKOFF, 1e-4 * (1 << min(lapses, 16))))


# fire-and-forget work (renewals, giving tickets up): referenced until done
_background: set[asyncio.Future[Any]] = set()


def spawn(coro: Any) -> asyncio.Future[Any]:
    """Run ``coro`` in the background, kept alive until it is done; its
    failure is logged (at DEBUG: the lock's own paths recover from it)."""
    task = asyncio.ensure_future(coro)
    _background.add(task)

    def done(t: asyncio.Future[Any]) -> None:
        _background.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.debug("lock background work failed: %s", t.exception())
    task.add_done_callback(done)
    return task


class TicketWords(Protocol):
    """A ticket lock's words where its driver keeps them."""

    async def draw(self) -> int:
        """``fetch_add(next_ticket, 1)``: a new ticket."""

    async def swap_serving(self, expected: int, new: int) -> int:
        """Compare-and-swap ``now_serving``; its old value."""

    async def swap_heartbeat(self, expected: int, new: int) -> int:
        """Compare-and-swap the heartbeat word; its old value."""


class TicketOwner(Protocol):
    """What the engine needs of the client a lock belongs to."""

    @property
    def closed(self) -> bool: ...

    def ensure_open(self) -> None: ...


W = TypeVar("W", bound=TicketWords)


class TicketLock(abc.ABC, Generic[W]):
    """What a ticket lock is whatever keeps its words (see the module)."""

    __slots__ = ("client", "name", "_busy", "_lost", "_heartbeat")

    #: how the messages name an object of the driver's class
    kind = "TicketLock"
    #: what a holder that lost the lock gets, and what it is told to do
    lost_error: type[StaleFence] = StaleFence
    lost_hint = "what was done under the lock since then was not protected"
    #: the level at which a waiter passed by logs that it draws again
    lapse_level = logging.DEBUG

    def __init__(self, client: TicketOwner, name: str) -> None:
        self.client = client
        self.name = name
        self._busy = False              # an acquisition is under way
        self._lost: str | None = None   # why the lock was lost, until the holder is told
        self._heartbeat = 0             # the heartbeat word as last written or seen

    # -- what a driver supplies -------------------------------------------------
    @abc.abstractmethod
    def _held(self) -> bool:
        """True while this object holds the lock, as far as it knows now."""

    def _may_acquire(self) -> None:
        """Raise if this object may not acquire at all (a closed Lock)."""

    @abc.abstractmethod
    async def _acquire(self) -> None:
        """Wait until this object holds the lock (within ``acquire``)."""

    @abc.abstractmethod
    async def release(self) -> None:
        """Release the lock."""

    @abc.abstractmethod
    def _give_up(self, words: W, ticket: int) -> None:
        """``ticket`` was drawn for a waiter that stopped waiting: see that
        the queue does not wait for it (in the background)."""

    def _started(self, ticket: int) -> None:
        """The polling wait drew ``ticket`` and starts waiting for it."""

    @abc.abstractmethod
    async def _look(self, words: W, ticket: int) -> tuple[int, float]:
        """One look at our turn in the polling wait: ``(OBSERVE_*, delay)``
        (``_core.OBSERVE_GRANTED``: we hold the lock now; ``OBSERVE_LAPSED``:
        the lock passed ``ticket`` by; ``OBSERVE_WAIT``: look again after
        ``delay`` seconds)."""

    def _stop_waiting(self, words: W, ticket: int) -> None:
        """The polling wait for ``ticket`` stopped before the grant (a
        timeout, a cancellation, an error): give the ticket up."""
        self._give_up(words, ticket)

    def _next_heartbeat(self, ticket: int, old: int) -> int | None:
        """The heartbeat word a renewal of ``ticket`` writes over ``old``
        (None: none, ``old`` says the lock was passed on)."""
        return _core.renewal_word(ticket, old)

    # -- acquire ------------------------------------------------------------------
    async def acquire(self, timeout: float | None = None) -> bool:
        """Wait for the lock (FIFO).  With ``timeout`` (seconds), raise
        :class:`~smb2.LockTimeout` when it runs out; the ticket is then given
        up and the queue does not wait for it.  Cancellation does the same."""
        self.client.ensure_open()
        self._may_acquire()
        if self._busy or self._held():
            raise InterfaceError(f"lock {self.name!r} is already held or being acquired by this "
                                 f"{self.kind} object (it is not reentrant)")
        self._lost = None
        self._busy = True
        try:
            if timeout is None:
                await self._acquire()
            else:
                try:
                    async with asyncio.timeout(timeout):
                        await self._acquire()
                except TimeoutError:
                    raise LockTimeout(f"lock {self.name!r} not acquired within {timeout} s") from None
        finally:
            self._busy = False
        return True

    async def __aenter__(self) -> Self:
        await self.acquire()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._held():
            await self.release()
        elif exc[0] is None:
            self._raise_if_lost()

    def _raise_if_lost(self) -> None:
        why, self._lost = self._lost, None
        if why is not None:
            raise self.lost_error(why, hint=self.lost_hint)

    # -- the ticket ---------------------------------------------------------------
    async def _draw(self, words: W) -> int:
        # The fetch-and-add must not be lost to a cancellation: a ticket
        # drawn but never known would stall the queue for a whole lease.
        fut = asyncio.ensure_future(words.draw())
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            def late(f: asyncio.Future[int]) -> None:
                if not f.cancelled() and f.exception() is None:
                    self._give_up(words, f.result())
            fut.add_done_callback(late)
            raise

    async def _wait_turn(self, words: W) -> None:
        """Draw a ticket and look at ``now_serving`` (``_look``) until the
        lock is ours: the polling wait."""
        ticket = await self._draw(words)
        self._started(ticket)
        lapses = 0
        try:
            while True:
                code, delay = await self._look(words, ticket)
                if code == _core.OBSERVE_GRANTED:
                    return
                if code == _core.OBSERVE_LAPSED:
                    # we were passed by (slept past our turn, or looked as
                    # dead as a crashed holder): take a new place at the end
                    log.log(self.lapse_level, "lock %r: ticket %d was passed over while waiting; "
                            "drawing a new one", self.name, ticket)
                    lapses += 1
                    await after_lapse(lapses)
                    ticket = await self._draw(words)
                    self._started(ticket)
                    continue
                lapses = 0
                # else look again after the backoff; one pass of the loop at
                # least, so that the holder's release can run
                await asyncio.sleep(delay if delay >= TIMER_RESOLUTION else 0)
        except BaseException:
            self._stop_waiting(words, ticket)
            raise

    # -- holding --------------------------------------------------------------------
    async def _beat(self, words: W, ticket: int) -> tuple[int, int]:
        """A renewal's two steps: the heartbeat raised, tagged with our
        ticket (a CAS: we learn the word if someone else wrote it, and try
        again over that, 4 times at most), then an atomic read of
        ``now_serving`` (a CAS that changes nothing): do we still hold it?
        Returns the heartbeat word as last seen and ``now_serving``."""
        old = self._heartbeat
        for _ in range(4):
            new = self._next_heartbeat(ticket, old)
            if new is None:
                break
            got = await words.swap_heartbeat(old, new)
            if got == old:
                old = self._heartbeat = new
                break
            old = got
        return old, await words.swap_serving(ticket, ticket)
