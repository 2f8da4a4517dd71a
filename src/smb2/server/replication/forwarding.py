"""Forwarding: a primary's replicated op applied here and sent, in arrival
order, over one ordered stream per backup (:class:`Outbox`); its answer
waits until every backup answered (:class:`Pending`)."""


from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from ... import _core
from ...errors import ErrorCode
from ...placement import Placement
from ...protocol import (
    DTYPE_MASK,
    DTYPE_SHIFT,
    Op,
    accumulate_span,
)
from .. import sparse
from ..peers import LINK_FAILED, PeerLink, error_message
from ..segment import Segment
from .dedup import Entry

log = logging.getLogger("smb2.server.replication")

# a member backup that has not answered a forwarded op within this is failed
FORWARD_TIMEOUT: Final = 1.0
# bytes queued for one backup (not yet handed to its socket, or in its send
# buffer) before clients that forward to it stop being read
OUTBOX_HIGH: Final = 16 << 20


# a buffer's part on a peer: (name, buffer_id, slot), slot "" for its own part
BufferKey = tuple[str, str, str]


class Forwarder(Protocol):
    """What the outboxes and pending ops need of their replication
    (cluster.Replication)."""

    me: str
    diverged: int

    @property
    def server(self) -> PeerTokens: ...
    def spawn(self, work: Any) -> asyncio.Task[Any]: ...
    async def settle(self, where: Stripe, entry: Entry, failed: dict[str, str]) -> None: ...
    def acknowledge(self, where: Stripe, entry: Entry) -> None: ...


class PeerTokens(Protocol):
    """The tokens a server's link to a peer authenticates with."""

    @property
    def token(self) -> bytes | None: ...
    @property
    def peer_token(self) -> bytes | None: ...


def apply_op(seg: Segment, op: int, flags: int, offset: int, data: memoryview,
             add_delta: Callable[[memoryview, memoryview, int], None]) -> bytes:
    """Apply one data op to ``seg`` (its range was checked): the reply's
    payload.  ``add_delta`` adds an accumulate's delta (the server's, over
    its threads: done when it returns)."""
    if op == Op.WRITE:
        _core.copy_into(seg.view[offset:offset + len(data)], data)
        return b""
    if op == Op.ACCUMULATE_SPARSE:
        sparse.add(seg, flags, offset, data)       # checked whole before (sparse.span)
        return b""
    if op == Op.ACCUMULATE:
        end = offset + accumulate_span(flags, offset, len(data))
        add_delta(seg.view[offset:end], data, (flags & DTYPE_MASK) >> DTYPE_SHIFT)
        return b""
    if op == Op.FETCH_ADD:
        add = _core.unpack_u64(data)
        old = _core.atomic_fetch_add(seg.view, offset, add)
        if add:
            _core.futex_wake(seg.view, offset)      # a shm reader may sleep on it (smb2.notify)
        return _core.pack_u64(old)
    expected = _core.unpack_u64(data, 0)
    old = _core.atomic_compare_swap(seg.view, offset, expected, _core.unpack_u64(data, 8))
    if old == expected:
        _core.futex_wake(seg.view, offset)
    return _core.pack_u64(old)



class Outbox:
    """The ordered stream of forwarded ops from this server to one peer.

    A forward goes straight to the link's socket when the link is up, nothing
    waits before it and the peer's segment id of the buffer is known; else it
    is queued (its payload copied) and a pump connects, looks the buffer's
    segment up by name (once per link) and sends the queue in order.

    A backup is failed when it stops making progress: ops are out and no
    answer came for FORWARD_TIMEOUT (a watchdog), not when one op waited
    that long behind many others on a loaded link."""

    def __init__(self, repl: Forwarder, address: str) -> None:
        self.repl = repl
        self.address = address
        self.link: PeerLink | None = None
        self.queue: collections.deque[tuple[BufferKey, int, int, int, list[bytes],
                                            Callable[[int, bytes], None]]] = (
            collections.deque())
        self.queued_bytes = 0
        # the peer's segment of each buffer, by (name, buffer_id, slot): a
        # buffer destroyed and made again under its name is another buffer;
        # slot "" is the peer's own part, else the part of the lost server
        # whose copies it holds in its stead (see Replication.copy_of)
        self.segment_ids: dict[BufferKey, int] = {}
        self._pump: asyncio.Task[None] | None = None
        # client connections that stopped being read while this outbox was full
        self.blocked: set[Any] = set()
        # stripe copies waiting for room (see room)
        self.room_waiters: list[asyncio.Future[None]] = []
        # ops sent or queued and not answered; when the last answer came
        self.outstanding = 0
        self.progress = 0.0
        self._watchdog: asyncio.TimerHandle | None = None

    def forward(self, buffer: BufferKey, op: int, flags: int, offset: int,
                parts: Sequence[bytes | memoryview], on_reply: Callable[[int, bytes], None]) -> None:
        """Send an op for ``buffer`` (name, buffer_id, slot) to this peer,
        after every op sent before it."""
        loop = asyncio.get_running_loop()
        if not self.outstanding:
            self.progress = loop.time()
        self.outstanding += 1
        if self._watchdog is None:
            self._watchdog = loop.call_at(self.progress + FORWARD_TIMEOUT, self._check_progress)

        def answered(status: int, payload: bytes) -> None:
            self.outstanding -= 1
            self.progress = loop.time()
            on_reply(status, payload)
        link = self.link
        if link is not None and link.is_open and not self.queue:
            sid = self.segment_ids.get(buffer)
            if sid is not None:
                link.send(op, flags, sid, offset, parts, answered)
                return
        copied = [bytes(p) for p in parts]
        self.queue.append((buffer, op, flags, offset, copied, answered))
        self.queued_bytes += sum(len(p) for p in copied)
        if self._pump is None:
            self._pump = asyncio.get_running_loop().create_task(self.pump())

    def _check_progress(self) -> None:
        self._watchdog = None
        if not self.outstanding:
            return
        loop = asyncio.get_running_loop()
        if loop.time() - self.progress >= FORWARD_TIMEOUT:
            self.fail(f"{self.outstanding} forwarded ops and no answer for {FORWARD_TIMEOUT:g} s")
        else:
            self._watchdog = loop.call_at(self.progress + FORWARD_TIMEOUT, self._check_progress)

    @property
    def full(self) -> bool:
        link = self.link
        return self.queued_bytes > OUTBOX_HIGH or (link is not None and link.paused)

    def block(self, conn: Any) -> None:
        """Stop reading ``conn`` until this outbox drains."""
        conn.hold_input("forward")
        self.blocked.add(conn)
        self.drained()

    async def room(self) -> None:
        """Return once this outbox is not full (or has failed)."""
        if not self.full:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.room_waiters.append(fut)
        self.drained()          # arranges to be called again when the link drains
        await fut

    def drained(self) -> None:
        """Read the blocked connections again, unless still full: then when
        the link's socket drains (or the pump ends)."""
        if self.full:
            link = self.link
            if link is not None and link.paused and self.drained not in link.on_drain:
                link.on_drain.append(self.drained)
            return
        blocked, self.blocked = self.blocked, set()
        for conn in blocked:
            conn.unhold_input("forward")
        waiters, self.room_waiters = self.room_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def pump(self) -> None:
        try:
            if self.link is None or not self.link.is_open:
                self.segment_ids.clear()
                self.link = await PeerLink.open(self.address, self.repl.me, self.repl.server.token,
                                                self.repl.server.peer_token)
            link = self.link
            while self.queue:
                buffer = self.queue[0][0]
                if buffer not in self.segment_ids:
                    info = await link.control({"cmd": "lookup", "name": buffer[0],
                                               **({"copy_of": buffer[2]} if buffer[2] else {})})
                    if info.get("buffer_id") != buffer[1]:
                        raise LookupError(f"server {self.address} holds another buffer named {buffer[0]!r} "
                                          f"(buffer_id {info.get('buffer_id')!r}, not {buffer[1]!r})")
                    self.segment_ids[buffer] = int(info["segment"])
                buffer, op, flags, offset, parts, cb = self.queue.popleft()
                self.queued_bytes -= sum(len(p) for p in parts)
                link.send(op, flags, self.segment_ids[buffer], offset, parts, cb)
            self.drained()
        except asyncio.CancelledError:
            self.fail("server shutting down")
            raise
        except Exception as exc:  # the peer is down, refused us, or lacks the buffer
            self.fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        finally:
            self._pump = None

    def fail(self, why: str) -> None:
        """Drop the link; every op queued or waiting for the peer fails."""
        if self.link is not None:
            self.link.close(why)
            self.link = None
        self.segment_ids.clear()
        queue, self.queue = self.queue, collections.deque()
        self.queued_bytes = 0
        for *_, cb in queue:
            cb(LINK_FAILED, why.encode())
        self.drained()

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        self.fail("server shutting down")


def resolver(fut: asyncio.Future[tuple[int, bytes]]) -> Callable[[int, bytes], None]:
    def done(status: int, payload: bytes) -> None:
        if not fut.done():
            fut.set_result((status, payload))
    return done


@dataclass(eq=False)
class Stripe:
    """Where one op landed: the buffer's segment here, its placement, the
    stripe and this server's place among its replicas."""

    seg: Segment
    placement: Placement
    index: int


class Pending:
    """A primary's op whose forwards are out: answers its waiters when every
    backup answered (or its outbox failed it: see Outbox)."""

    def __init__(self, repl: Forwarder, where: Stripe, entry: Entry, backups: list[str]) -> None:
        self.repl = repl
        self.where = where
        self.entry = entry
        self.waiting = set(backups)
        self.acked: set[str] = set()
        self.failed: dict[str, str] = {}
        self.stale = False
        self.done = False

    def callback(self, backup: str) -> Callable[[int, bytes], None]:
        def on_reply(status: int, payload: bytes) -> None:
            if backup not in self.waiting:
                return
            self.waiting.discard(backup)
            if status == 0:
                self.acked.add(backup)
                if payload != self.entry.result:
                    # an atomic's old value differs: the copies diverged
                    self.repl.diverged += 1
                    log.error("backup %s returned %r where this primary returned %r: its copy of "
                              "buffer %r differs", backup, payload, self.entry.result, self.where.seg.name)
            elif status == ErrorCode.STALE_EPOCH:
                self.stale = True
            else:
                why = "the link failed" if status == LINK_FAILED else ErrorCode(status).name
                self.failed[backup] = f"{why}: {error_message(payload) or payload.decode(errors='replace')}"
            if not self.waiting:
                self.finish()
        return on_reply

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        self.entry.acked = frozenset(self.acked)
        if self.stale or self.failed:
            # a backup knows a newer view, or failed: settle it under the
            # view read now (repairing a backup that missed the op)
            self.repl.spawn(self.repl.settle(self.where, self.entry, self.failed))
        else:
            self.repl.acknowledge(self.where, self.entry)
