"""The one interface every transport offers (docs/design.md, "The transport
interface"), and the capabilities only some offer.

A transport reaches ONE server.  It knows segments and offsets, never buffer
names, stripes or training.  Data arguments are sequences of memoryviews (the
pieces of the caller's memory that one request scatters to or gathers from);
their lengths add up to ``length``.

Optional capabilities are mixins a transport inherits: :class:`LockCapable`
(the server parks lock waiters) and :class:`FutexCapable` (the lock's words
are mapped here, and a waiter sleeps on a futex).  A transport *says* which
ways of waiting for a lock it offers in ``lock_waits``; the lock reads that,
never the transport's class.  A transport that can use registered memory in
place names its :class:`MemoryDomain` in ``memory_domain``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ..errors import InterfaceError, Unsupported
from ..protocol import DEFAULT_MAX_REQUEST, narrow_into


def scatter(src: np.ndarray, dst: Sequence[memoryview]) -> None:
    """Copy ``src``'s bytes into the pieces ``dst``, in order."""
    data = src.data.cast("B")
    at = 0
    for piece in dst:
        n = len(piece)
        piece[:] = data[at:at + n]
        at += n


class MemoryDomain(Protocol):
    """Something user memory can be registered with (an RDMA device)."""

    def register(self, view: memoryview, /) -> Any:
        """Register ``view``; return a handle for :meth:`unregister` (OSError on failure)."""

    def unregister(self, handle: Any, /) -> None:
        """Forget a registration made by :meth:`register`."""


class Transport(abc.ABC):
    """One connection to one memory server."""

    #: "tcp", "rdma", ...
    name: str = "?"
    #: the largest request the client should send (the planner cuts at this)
    max_request: int = DEFAULT_MAX_REQUEST
    #: where ``Client.register`` registers memory for zero-copy use (None:
    #: this transport copies anyway, registering would buy nothing)
    memory_domain: MemoryDomain | None = None
    #: how a lock waiter may wait over this transport, the one ``mode="auto"``
    #: takes first (docs/design.md, "The lock"): "futex" (a
    #: :class:`FutexCapable`), "park" (a :class:`LockCapable`), "poll" (reads
    #: of the lock's words: every transport)
    lock_waits: tuple[str, ...] = ("poll",)

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        #: what the server said at hello
        self.server_info: dict[str, Any] = {}

    @property
    def label(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """True once the connection is gone (the client then reconnects)."""

    @abc.abstractmethod
    async def control(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Send a control message (hello, create, lookup, destroy, list, stat)."""

    @abc.abstractmethod
    async def read_into(self, dst: Sequence[memoryview], segment: int, offset: int,
                        length: int) -> None:
        """Fill ``dst`` with ``length`` bytes of the segment from ``offset``."""

    async def read_narrow(self, dst: Sequence[memoryview], segment: int, offset: int,
                          length: int, code: int) -> None:
        """Fill ``dst`` with ``length`` bytes: the float32 words of the
        segment from ``offset`` (twice as many bytes) narrowed to the wire
        type of ``code`` (``protocol.WIRE_CODES``).  Here: read them whole
        and narrow on this side (a transport whose server narrows them
        before they cross the link overrides it)."""
        words = np.empty(length // 2, np.float32)
        await self.read_into([words.data.cast("B")], segment, offset, 2 * length)
        narrow = np.empty(length // 2, np.uint16)
        narrow_into(code, words, narrow)
        scatter(narrow, dst)

    @abc.abstractmethod
    async def write(self, src: Sequence[memoryview], segment: int, offset: int,
                    length: int) -> None:
        """Store ``src`` at ``offset`` of the segment."""

    @abc.abstractmethod
    async def accumulate(self, src: Sequence[memoryview], segment: int, offset: int,
                         length: int, dtype_code: int) -> None:
        """Server-side ``segment[offset:...] += src`` as that dtype.  ``length``
        is the bytes of ``src``; a widening dtype code (``protocol.WIRE_CODES``)
        covers twice that of the segment (``protocol.accumulate_span``)."""

    @abc.abstractmethod
    async def accumulate_sparse(self, payload: Sequence[memoryview], segment: int, offset: int,
                                flags: int) -> None:
        """Server-side sparse accumulate: ``payload`` is the u64 count, the
        indices (float32 words from ``offset``) and the values; ``flags``
        their dtype code and index width (docs/protocol.md, "Sparse
        accumulate").  The server checks it whole before it adds any of it."""

    def require_sparse(self) -> None:
        """Raise ``Unsupported`` unless the server said at hello that it takes
        sparse accumulates (one without the op closes the connection on it)."""
        if not self.server_info.get("sparse"):
            raise Unsupported(f"server {self.label} does not take sparse accumulates (an older smb2-server)",
                              server=self.label, hint="upgrade smb2-server on every server, or use accumulate()")

    @abc.abstractmethod
    async def fetch_add(self, segment: int, offset: int, value: int) -> int:
        """Add ``value`` (mod 2**64) to the 8-byte word; return its old value."""

    @abc.abstractmethod
    async def compare_swap(self, segment: int, offset: int, expected: int, new: int) -> int:
        """Store ``new`` if the word equals ``expected``; return the old value."""

    async def write_fenced(self, src: Sequence[memoryview], segment: int, offset: int,
                           length: int, lock_key: int, token: int) -> None:
        """Like ``write``, but the server refuses it (``StaleFence``) unless
        ``token`` still fences the lock ``lock_key`` (docs/protocol.md,
        "Locks").  A one-sided fabric cannot check a fence: such a transport
        sends fenced writes through its server's CPU, or does not offer them."""
        raise InterfaceError(f"the {self.name} transport does not carry fenced writes")

    async def replicated(self, op: int, flags: int, segment: int, offset: int,
                         payload: Sequence[memoryview | bytes]) -> int | None:
        """A mutation of a replicated buffer, sent to the stripe's primary
        with ``FLAG_REPLICATED`` (``op``: WRITE, ACCUMULATE, FETCH_ADD or
        COMPARE_SWAP; ``payload``: the replication prefix, the fence if
        ``flags`` has FLAG_FENCED, then the data or operands).  Returns the
        old word of an atomic, None otherwise.  Only a server's CPU forwards
        to the backups, so every fabric sends these over its TCP connection
        (docs/design.md, "Replication")."""
        raise InterfaceError(f"the {self.name} transport does not carry replicated operations")

    def wake_ticket(self, segment: int, offset: int, ticket: int) -> None:
        """Wake the futex sleepers waiting for ``ticket`` at the word (a lock's
        now_serving).  Only where waiters sleep on futexes ("futex" in
        ``lock_waits``); elsewhere nobody sleeps on the word."""
        return None

    @abc.abstractmethod
    async def close(self) -> None:
        """Close the connection; pending operations fail with TransportError."""


class LockCapable(abc.ABC):
    """A transport whose server can park lock waiters: one request waits
    for the grant, instead of the client polling the lock's words
    (docs/design.md, "The lock").  Only over a connection the server's CPU
    reads (TCP): a one-sided fabric never wakes anybody."""

    @abc.abstractmethod
    async def lock_acquire(self, segment: int, offset: int) -> tuple[int, bool]:
        """Queue for the lock in slot ``offset``; return ``(ticket, queued)``
        once it is ours (``queued``: other tickets wait behind it).  A
        cancelled caller's ticket is given up."""

    @abc.abstractmethod
    async def lock_release(self, segment: int, offset: int, ticket: int) -> None:
        """Release the lock held with ``ticket``; StaleFence if it was lost."""

    @abc.abstractmethod
    def lock_release_nowait(self, segment: int, offset: int, ticket: int) -> None:
        """Release without waiting for (or getting) an answer; whatever this
        transport sends next reaches the server after it."""


class MapsSegments(Transport):
    """A transport that maps the server's segments into this process: a
    buffer serves its operations straight from the mapping, one Cython call
    each (``_core.MappedStripes``), while the connection's live flag
    ``alive`` says the mapping may be used."""

    #: how often an operation on a mapping lets the event loop run
    yield_every: float
    #: the connection's live flag (``_core.LiveFlag``)
    alive: Any

    @abc.abstractmethod
    def mapping_of(self, segment: int) -> tuple[memoryview, int, int, Any] | None:
        """``segment`` as mapped here: (the mapping, the data's size, the
        offset of its state word, the connection's live flag), or None while
        it is not mapped."""

    @abc.abstractmethod
    def copy_threads(self) -> int:
        """Threads a large copy on a mapping may use."""


class FutexCapable(MapsSegments, LockCapable):
    """A transport that maps the server's lock segment into this process, so
    a lock waiter takes its ticket with a CPU atomic and sleeps on a futex
    on ``now_serving`` (docs/design.md, "The lock"); it parks through the
    server too, for the release that hands the lock to a parked waiter."""

    @abc.abstractmethod
    async def wait_ticket(self, segment: int, offset: int, ticket: int, timeout: float) -> int:
        """The ticket word at ``offset`` once it reached ``ticket``, or as it
        is after ``timeout`` seconds (or less)."""

    @abc.abstractmethod
    def wake_ticket(self, segment: int, offset: int, ticket: int) -> None:
        """Wake the ``wait_ticket`` sleepers for ``ticket``, in any process."""

    @abc.abstractmethod
    async def wait_word(self, segment: int, offset: int, old: int, timeout: float, spin: float = 0.0) -> int:
        """The u64 word at ``offset`` once it is no longer ``old``, or as it
        is after ``timeout`` seconds (or less): a notification's sleep."""

    @abc.abstractmethod
    def wake_word(self, segment: int, offset: int) -> None:
        """Wake every ``wait_word`` sleeper on the word, in any process."""
