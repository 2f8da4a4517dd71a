"""A client's link to one server: the address, the transport to it (opened
again on the next operation after a failure), and what the client learned
from that server about its locks.

A :class:`~smb2.Client` holds one link per server (``client.links``, in the
order that defines the buffers' striping).  Everything that needs "the open
transport to server i" asks the link: ``link.open or await link.get()``,
or ``link.call(op, timeout, ...)`` for an operation with a deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import BufferConflict, OperationTimeout, TransportError
from .base import Transport
from .choose import open_transport

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LockSlot:
    """Where a named lock lives on its server (the ``lock_open`` answer):
    the words at ``offset`` of the lock segment ``segment``, with the lease
    the server applies.  Valid while ``transport``, the connection that
    opened it, is open: the server keeps a slot bound to its name only
    while some connection has it open (a slot nobody has open may go to
    another name), and a restarted server forgets them all."""

    segment: int
    offset: int
    lease: float
    transport: Transport


class Link:
    """One server of a client."""

    __slots__ = ("address", "kind", "timeout", "options", "transport", "on_open", "_connecting", "_locks",
                 "_lock_users")

    def __init__(self, address: tuple[str, int], kind: str, timeout: float,
                 options: dict[str, Any] | None = None) -> None:
        self.address = address
        self.kind = kind
        self.timeout = timeout
        self.options = options or {}
        #: the transport last opened (it may have failed since: see ``open``)
        self.transport: Transport | None = None
        #: called with (link, transport) on each new connection before anything is sent on it; what
        #: it raises closes that connection and fails the operation (a client checks there that no
        #: other of its servers is the same process)
        self.on_open: Callable[[Link, Transport], None] | None = None
        self._connecting: asyncio.Future[Transport] | None = None
        # lock name -> where the server put it (asked once per server process)
        self._locks: dict[str, LockSlot] = {}
        # lock name -> how many Lock objects of this client use it
        self._lock_users: dict[str, int] = {}

    def __repr__(self) -> str:
        t = self.open
        return f"<smb2 link to {self.label} over {t.name if t is not None else '-'}>"

    @property
    def label(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    @property
    def open(self) -> Transport | None:
        """The transport if it is connected now, else None.  The operations'
        fast path: ``t = link.open or await link.get()`` costs no coroutine
        while the connection is up."""
        t = self.transport
        return t if t is not None and not t.closed else None

    async def get(self) -> Transport:
        """The connected transport, connecting first if needed (concurrent
        callers share one attempt; its failure is raised to each of them)."""
        t = self.open
        if t is not None:
            return t
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
        fut = self._connecting
        try:
            t = await asyncio.shield(fut)
        finally:
            if fut.done():
                self._connecting = None
                if not fut.cancelled():
                    fut.exception()     # retrieved: a failure is re-raised to each waiter
        old, self.transport = self.transport, t
        if old is not None and old is not t:
            await old.close()       # a failed one: release what it still holds
        return t

    async def _open(self) -> Transport:
        t = await open_transport(self.address, self.kind, timeout=self.timeout, **self.options)
        if self.on_open is not None:
            try:
                self.on_open(self, t)
            except BaseException:
                await t.close()
                raise
        return t

    async def lock_slot(self, name: str, lease: float | None = None, *,
                        fresh: bool = False) -> tuple[Transport, LockSlot]:
        """The open transport and where the lock ``name`` lives on this
        server, asking the server (``lock_open``) the first time, on each
        new connection, or when ``fresh``.  A lease other than the one
        the lock has raises :class:`BufferConflict`."""
        tr = self.open or await self.get()
        slot = None if fresh else self._locks.get(name)
        if slot is None or slot.transport is not tr:
            msg: dict[str, Any] = {"cmd": "lock_open", "name": name}
            if lease is not None:
                msg["lease"] = float(lease)
            info = await tr.control(msg)
            slot = LockSlot(int(info["segment"]), int(info["offset"]), float(info["lease"]), tr)
            self._locks[name] = slot
        elif lease is not None and float(lease) != slot.lease:
            raise BufferConflict(f"lock {name!r} has a lease of {slot.lease} s, fixed when it was "
                                 f"opened; this Lock asks for {float(lease)} s",
                                 server=self.label, hint="give every Lock of a name the same lease, or none")
        return tr, slot

    def lock_used(self, name: str) -> None:
        """A Lock object of this client started using ``name``."""
        self._lock_users[name] = self._lock_users.get(name, 0) + 1

    async def lock_unused(self, name: str) -> None:
        """A Lock object stopped using ``name``: when it was the last one,
        tell the server (``lock_close``), which frees the slot once nobody
        holds it or waits for it."""
        left = self._lock_users.get(name, 0) - 1
        if left > 0:
            self._lock_users[name] = left
            return
        self._lock_users.pop(name, None)
        slot = self._locks.pop(name, None)
        if slot is not None and not slot.transport.closed:
            await slot.transport.control({"cmd": "lock_close", "name": name})

    async def call(self, op: Callable[[Transport], Awaitable[T]], timeout: float | None, *,
                   idempotent: bool, what: str, keep: bool = True) -> T:
        """``op(transport)`` within ``timeout`` seconds (None: no deadline).

        When the deadline passes, the connection is reset (closed: whatever
        it still had in flight fails, and no late reply lands in the
        caller's memory) and :class:`OperationTimeout` is raised; the next
        operation reconnects.  An ``idempotent`` op whose connection broke
        is tried once more on a fresh connection, within the same deadline;
        the others raise the :class:`TransportError`.

        ``keep=False``: where no connection is open (or being opened),
        ``op`` goes over one opened for it alone and closed after it, tried
        once.  A lazy client's control messages to a server it does not
        otherwise use go so (``create`` makes a part on every server, and
        ``destroy`` removes them): the server holds no connection of it
        afterwards."""
        once = not keep and self.open is None and self._connecting is None
        attempt = self._once(op) if once else self._attempt(op, idempotent)
        if timeout is None:
            return await attempt
        try:
            async with asyncio.timeout(timeout) as deadline:
                return await attempt
        except TimeoutError:
            if not deadline.expired():
                raise
            if not once:
                await self.reset()
            raise OperationTimeout(
                f"{what} on server {self.label} did not complete within {timeout} s; its connection "
                "was reset", server=self.label,
                hint="the server may be overloaded or stopped; the next operation reconnects") from None

    async def _once(self, op: Callable[[Transport], Awaitable[T]]) -> T:
        """``op`` over a connection of its own, closed after it (``call(keep=False)``)."""
        t = await self._open()
        try:
            return await op(t)
        finally:
            await t.close()

    async def _attempt(self, op: Callable[[Transport], Awaitable[T]], idempotent: bool) -> T:
        t = self.open or await self.get()
        try:
            return await op(t)
        except TransportError:
            if not idempotent or not t.closed:
                raise
        return await op(await self.get())

    async def reset(self) -> None:
        """Close the current connection; the next operation opens a new one."""
        t = self.transport
        if t is not None:
            await t.close()

    async def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
            self._connecting = None
        if self.transport is not None:
            t, self.transport = self.transport, None
            await t.close()
