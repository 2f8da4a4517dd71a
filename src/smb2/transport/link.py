"""A client's link to one server: the address, the transport to it (opened
again on the next operation after a failure), and what the client learned
from that server about its locks.

A :class:`~smb2.Client` holds one link per server (``client.links``, in the
order that defines the buffers' striping).  Everything that needs "the open
transport to server i" asks the link: ``link.open or await link.get()``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from .base import Transport
from .choose import open_transport


@dataclass(frozen=True, slots=True)
class LockSlot:
    """Where a named lock lives on its server (the ``lock_open`` answer):
    the words at ``offset`` of the lock segment ``segment``, with the lease
    the server applies, valid for the server process ``server_id`` only."""

    segment: int
    offset: int
    lease: float
    server_id: Any


class Link:
    """One server of a client."""

    __slots__ = ("address", "kind", "timeout", "options", "transport", "_connecting", "_locks")

    def __init__(self, address: tuple[str, int], kind: str, timeout: float,
                 options: dict[str, Any] | None = None) -> None:
        self.address = address
        self.kind = kind
        self.timeout = timeout
        self.options = options or {}
        #: the transport last opened (it may have failed since: see ``open``)
        self.transport: Transport | None = None
        self._connecting: asyncio.Future[Transport] | None = None
        # lock name -> where the server put it (asked once per server process)
        self._locks: dict[str, LockSlot] = {}

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
            self._connecting = asyncio.ensure_future(
                open_transport(self.address, self.kind, timeout=self.timeout, **self.options))
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

    async def lock_slot(self, name: str, lease: float | None = None, *,
                        fresh: bool = False) -> tuple[Transport, LockSlot]:
        """The open transport and where the lock ``name`` lives on this
        server, asking the server (``lock_open``) the first time, after a
        restart of the server, or when ``fresh``."""
        tr = self.open or await self.get()
        server_id = tr.server_info.get("server_id")
        slot = None if fresh else self._locks.get(name)
        # A restarted server has forgotten its locks and may have given our
        # slot to another name: a slot is only good for the server process
        # that assigned it.
        if slot is None or slot.server_id != server_id:
            msg: dict[str, Any] = {"cmd": "lock_open", "name": name}
            if lease is not None:
                msg["lease"] = float(lease)
            info = await tr.control(msg)
            slot = LockSlot(int(info["segment"]), int(info["offset"]), float(info["lease"]), server_id)
            self._locks[name] = slot
        return tr, slot

    async def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
            self._connecting = None
        if self.transport is not None:
            t, self.transport = self.transport, None
            await t.close()
