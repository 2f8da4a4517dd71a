"""Notifications in the style of GPI-2: fine-grained synchronization instead
of global barriers, built only on a buffer's public one-sided operations.

Where the slots live
--------------------
A buffer has no notification slots until its users designate an area of it
with :meth:`Buffer.set_notify_area` ``(offset, slots)``: ``slots`` int64 words
starting at the 8-byte aligned byte ``offset``.  Slot ``i`` is the word at
``offset + 8 * i``.  The area is ordinary buffer memory, so every client of
the buffer must designate the same area (the training store records it in
its header, so workers that attach by name learn it from there).  Nothing
else should write into the area.

What a notification promises
----------------------------
``await buf.write(off, data, notify=(slot, value))`` first waits until the
write has completed on *every* server it touched (each server acknowledges a
write only once its payload is in memory), and only then updates the slot.
So a reader that saw the slot reach ``value`` and reads the range afterwards
sees the data (or something newer).  This holds on every transport because
it relies on nothing but "an operation has completed when its await
returns".

A slot only grows: ``notify`` raises it to ``max(slot, value)`` with a
compare-and-swap loop, so several writers can use increasing values on one
slot and ``wait_notify(slot, at_least=v)`` is never fooled by a late, smaller
value overwriting a larger one.  Counters use :meth:`Buffer.notify_add`.

How a waiter waits
------------------
Over shm (the slot's server maps into this process) ``wait_notify`` sleeps
on a shared futex on the slot's word, in a thread (``wait_word`` of a
:class:`~smb2.transport.FutexCapable` transport, one that maps the word:
shm's), and every writer that changes a slot wakes it: a shm writer with
``FUTEX_WAKE`` on its own mapping, the server after a TCP client's atomic.
A sleep lasts at most ``MAX_SLEEP`` of that transport, so an RDMA writer's
change (the NIC's atomic wakes nobody) is seen within it.  Over other
transports the waiter polls with exponential backoff.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Protocol

import numpy as np

from .checks import check_int
from .errors import InterfaceError, InvalidArgumentError, NotifyTimeout
from .protocol import MASK64
from .transport import FutexCapable, Transport


class NotifyBuffer(Protocol):
    """What notifications need of a buffer (:class:`smb2.Buffer` is one):
    its size and notification area, and its public one-sided operations."""

    name: str
    nbytes: int
    notify_area: tuple[int, int] | None

    async def fetch_add(self, offset: int, value: int = 1) -> int: ...

    async def compare_swap(self, offset: int, expected: int, new: int) -> int: ...

    async def read_into(self, out: Any, offset: int = 0) -> None: ...

    def word_transport(self, offset: int) -> tuple[Transport | None, int, int]: ...

#: polling of a slot starts this fast (seconds) ...
FIRST_DELAY = 50e-6
#: ... and backs off exponentially to at most this, so an idle waiter costs a
#: few requests per second per slot, and a busy one sees a change within
#: about one round trip plus the current delay
MAX_DELAY = 5e-3


def slot_offset(buf: NotifyBuffer, slot: int) -> int:
    """The byte offset of ``slot``'s word (validated)."""
    area = buf.notify_area
    if area is None:
        raise InterfaceError(
            f"buffer {buf.name!r} has no notification area",
            hint="designate one first: buf.set_notify_area(offset, slots)")
    slot = check_int("a notification slot", slot)
    offset, nslots = area
    if not 0 <= slot < nslots:
        raise InvalidArgumentError(f"slot {slot} is outside the notification area of {nslots} slots")
    return offset + 8 * slot


def check_area(buf: NotifyBuffer, offset: int, slots: int) -> tuple[int, int]:
    offset = check_int("the notification area's offset", offset)
    slots = check_int("the notification area's slots", slots)
    if offset < 0 or offset % 8:
        raise InvalidArgumentError(f"the notification area needs an 8-byte aligned offset, not {offset}")
    if slots < 1 or offset + 8 * slots > buf.nbytes:
        raise InvalidArgumentError(
            f"a notification area of {slots} slots at {offset} does not fit in buffer "
            f"{buf.name!r} ({buf.nbytes} bytes)")
    return offset, slots


def check_notify(buf: NotifyBuffer, notify: object) -> tuple[int, int]:
    """Validate a ``notify=(slot, value)`` argument before any data moves."""
    if not (isinstance(notify, tuple) and len(notify) == 2):
        raise InvalidArgumentError(f"notify must be a (slot, value) tuple, not {notify!r}")
    slot, value = notify
    off = slot_offset(buf, slot)
    return off, check_int("a notification value", value)


async def raise_to(buf: NotifyBuffer, offset: int, value: int) -> int:
    """Atomically set the word at ``offset`` to ``max(word, value)``; return
    the old value.  Usually two round trips (read, then compare-and-swap)."""
    old = await buf.fetch_add(offset, 0)      # an atomic read of the word
    while old < value:
        seen = await buf.compare_swap(offset, old, value)
        if seen == old:
            wake(buf, offset)
            break
        old = seen      # somebody else changed it: retry against their value
    return old


async def add(buf: NotifyBuffer, offset: int, value: int) -> int:
    """Add ``value`` to the word at ``offset`` and wake its waiters; the old value."""
    old = await buf.fetch_add(offset, value)
    if value:
        wake(buf, offset)
    return old


def wake(buf: NotifyBuffer, offset: int) -> None:
    """Wake whoever sleeps on the word at ``offset`` over shm (nothing to
    do elsewhere: the server wakes them after a TCP atomic)."""
    tr, segment, seg_off = buf.word_transport(offset)
    if isinstance(tr, FutexCapable):     # it maps the word: sleepers wait on a futex
        tr.wake_word(segment, seg_off)


async def wait_word(buf: NotifyBuffer, offset: int, at_least: int, timeout: float | None,
                    what: str = "notification") -> int:
    """Wait until the int64 word at ``offset`` is ``>= at_least``: a futex
    sleep over shm, polling with exponential backoff elsewhere; return the
    value seen.  Raises :class:`NotifyTimeout`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = FIRST_DELAY
    while True:
        value = await buf.fetch_add(offset, 0)
        if value >= at_least:
            return value
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise NotifyTimeout(
                f"{what} at byte {offset} of buffer {buf.name!r} is {value}, "
                f"still below {at_least} after {timeout} s")
        left = None if deadline is None else max(0.0, deadline - now)
        tr, segment, seg_off = buf.word_transport(offset)
        if isinstance(tr, FutexCapable):
            await tr.wait_word(segment, seg_off, value & MASK64, math.inf if left is None else left)
            continue
        await asyncio.sleep(delay if left is None else min(delay, left))
        delay = min(delay * 2, MAX_DELAY)


async def read_slots(buf: NotifyBuffer) -> np.ndarray:
    """All slots of the area as an int64 array, in one read."""
    area = buf.notify_area
    if area is None:
        slot_offset(buf, 0)     # raises the helpful error
        raise AssertionError("unreachable")
    offset, nslots = area
    out = np.empty(nslots, dtype=np.int64)
    await buf.read_into(out, offset)
    return out
