"""The wire protocol: op codes, flags, dtype codes, control messages, and the
frame receiver that both ends of a TCP connection share.

A frame is a fixed 32-byte header (``_core.encode_header``) followed by a
payload.  Data ops carry raw bytes; control messages (op ``CONTROL``) carry a
msgpack map.  docs/protocol.md is the written contract.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import re
from typing import Any, Final

import msgpack

from . import _core
from .errors import InvalidArgumentError

# 2: lock renewals tagged with the holder's ticket (a version-1 client's
# renewals would no longer count), lock_close, lookup's "restored"
VERSION: Final = 2
HEADER_SIZE: Final = _core.HEADER_SIZE
MAGIC: Final = _core.MAGIC
DEFAULT_PORT: Final = 7420


# A decoded header (``_core.decode_header``) is a plain tuple, the cheapest
# thing to make once per frame; these name its fields' positions.
Header = tuple[int, ...]
H_MAGIC: Final = 0
H_VERSION: Final = 1
H_OP: Final = 2
H_FLAGS: Final = 3
H_STATUS: Final = 4
H_REQUEST: Final = 5          # the request id a reply echoes
H_SEGMENT: Final = 6
H_OFFSET: Final = 7
H_LENGTH: Final = 8

# the wire's words are u64: Python ints are reduced to 64 bits with this
MASK64: Final = (1 << 64) - 1


class Op(enum.IntEnum):
    CONTROL = 1        # payload: msgpack map {"cmd": ..., ...}; reply: msgpack map
    READ = 2           # length = bytes wanted, no payload; reply payload: the bytes
                       # (flags may carry a narrowing code: read_span)
    WRITE = 3          # payload: the bytes; empty reply
    ACCUMULATE = 4     # payload: the delta; flags carry the dtype; empty reply
    FETCH_ADD = 5      # payload: u64 addend; reply: u64 old value
    COMPARE_SWAP = 6   # payload: u64 expected, u64 new; reply: u64 old value
    # The lock (server-side waiting, the TCP path; docs/protocol.md "Locks").
    # segment = LOCK_SEGMENT, offset = the lock's slot offset.
    LOCK_ACQUIRE = 7   # no payload; reply (when granted, maybe much later): u64 ticket
    LOCK_RELEASE = 8   # payload: u64 ticket; empty reply, STALE_FENCE if it did not hold
    LOCK_CANCEL = 9    # payload: u64 request id of an earlier LOCK_ACQUIRE; empty reply
    # payload: u64 count n, n indices (u32; u64 with FLAG_WIDE_INDEX), n values
    # (flags carry their dtype); offset: the segment's byte offset of element
    # index 0; empty reply.  A server says it takes it at hello ("sparse").
    ACCUMULATE_SPARSE = 10


DATA_OPS: Final = frozenset({Op.READ, Op.WRITE, Op.ACCUMULATE, Op.FETCH_ADD,
                             Op.COMPARE_SWAP, Op.ACCUMULATE_SPARSE})

LOCK_OPS: Final = frozenset({Op.LOCK_ACQUIRE, Op.LOCK_RELEASE, Op.LOCK_CANCEL})

# flags
FLAG_REPLY: Final = 0x0001
# WRITE: the payload starts with a fence (u64 lock key, u64 token); the
# server checks it before a byte of the data lands in the segment
FLAG_FENCED: Final = 0x0004
FENCE_SIZE: Final = 16
# LOCK_RELEASE: send no reply (the releaser does not wait for one; a reply
# would only wake its process).  A release that fails is counted and logged.
FLAG_NOREPLY: Final = 0x0008
# LOCK_ACQUIRE reply: other tickets wait behind the one granted (the holder
# may poll rather than sleep through its critical section: others wait on it)
FLAG_QUEUED: Final = 0x0100
# segment id of every server's lock segment (buffers' segments start at 1)
LOCK_SEGMENT: Final = 0
# ACCUMULATE only: the delta is in the connection's RDMA staging area; the
# payload is u64 staging offset, u64 length (see server/rdma.py)
FLAG_STAGED: Final = 0x0002
DTYPE_SHIFT: Final = 4
DTYPE_MASK: Final = 0x00F0
# WRITE, ACCUMULATE, FETCH_ADD, COMPARE_SWAP on a replicated buffer: from a
# client to the stripe's primary (REPLICATED), and from the primary to each
# backup (FORWARDED).  The payload starts with REPL_PREFIX_SIZE bytes: u64
# view epoch, u64 client id, u64 sequence number (the op's identity: a retry
# carries the same one and is applied once), then the fence (FENCED), then
# the data (docs/protocol.md, "Replication")
FLAG_REPLICATED: Final = 0x0200
FLAG_FORWARDED: Final = 0x0400
REPL_FLAGS: Final = FLAG_REPLICATED | FLAG_FORWARDED
REPL_PREFIX_SIZE: Final = 24
REPLICATED_OPS: Final = frozenset({Op.WRITE, Op.ACCUMULATE, Op.FETCH_ADD, Op.COMPARE_SWAP,
                                   Op.ACCUMULATE_SPARSE})
# ACCUMULATE_SPARSE only: its indices are u64 (u32 without it)
FLAG_WIDE_INDEX: Final = 0x0800
# the value dtypes a sparse accumulate takes, all into float32 words
SPARSE_CODES: Final = frozenset({_core.DTYPE_FLOAT32, _core.DTYPE_BFLOAT16_INTO_FLOAT32,
                                 _core.DTYPE_FLOAT16_INTO_FLOAT32})
SPARSE_COUNT_SIZE: Final = 8

# dtype codes carried in the flags of ACCUMULATE (the same numbers as _core's):
# a delta of the destination's own dtype, by its numpy name ...
DTYPE_CODES: Final[dict[str, int]] = {
    "float32": _core.DTYPE_FLOAT32,
    "float64": _core.DTYPE_FLOAT64,
    "int32": _core.DTYPE_INT32,
    "int64": _core.DTYPE_INT64,
}
# ... and a float32 delta that travels narrower (``accumulate(wire=...)``): the
# payload holds one half-width item per float32 word of the destination range,
# which the server upcasts before it adds (docs/protocol.md, "Ops")
WIRE_CODES: Final[dict[str, int]] = {
    "bfloat16": _core.DTYPE_BFLOAT16_INTO_FLOAT32,
    "float16": _core.DTYPE_FLOAT16_INTO_FLOAT32,
}
_CODE_NAMES: Final = {**{c: n for n, c in DTYPE_CODES.items()},
                      **{c: f"{n} into float32" for n, c in WIRE_CODES.items()}}


def accumulate_span(flags: int, offset: int, length: int) -> int:
    """The bytes of the destination an ACCUMULATE covers: its flags carry the
    dtype code, its payload is ``length`` bytes for the segment ``offset``.
    The same as ``length`` but for the widening codes (twice it).  Raises
    ValueError, with a message for the sender, for an unknown code or a range
    that is not whole, aligned items."""
    code = (flags & DTYPE_MASK) >> DTYPE_SHIFT
    try:
        dst_item, src_item = _core.dtype_sizes(code)
    except ValueError:
        raise ValueError(f"unknown accumulate dtype code {code} (known: "
                         f"{', '.join(f'{c} {n}' for c, n in sorted(_CODE_NAMES.items()))})") from None
    if offset % dst_item or length % src_item:
        raise ValueError(f"accumulate of {_CODE_NAMES[code]} needs an offset aligned to "
                         f"{dst_item} bytes and whole {src_item}-byte items of payload, "
                         f"not offset {offset} and {length} bytes")
    return length // src_item * dst_item

def read_span(flags: int, offset: int, length: int) -> int:
    """The bytes of the segment a READ covers: ``length``, the bytes wanted,
    unless its flags carry a code of :data:`WIRE_CODES`: then the server
    sends float32 words from ``offset`` narrowed to that type (rounded as
    ``accumulate(wire=)`` rounds), ``length`` bytes of them for twice as
    many of the segment.  Raises ValueError, with a message for the sender,
    for another code or a range that is not whole, aligned items."""
    code = (flags & DTYPE_MASK) >> DTYPE_SHIFT
    if code == 0:
        return length
    if code not in WIRE_CODES.values():
        raise ValueError(f"a READ narrows float32 to {' or '.join(WIRE_CODES)} (codes "
                         f"{', '.join(map(str, sorted(WIRE_CODES.values())))}), not to dtype code {code}")
    return accumulate_span(flags, offset, length)


def narrow_into(code: int, src: Any, out: Any) -> None:
    """Round the float32 items of ``src`` into ``out`` (2-byte items) as the
    wire type of ``code`` (of :data:`WIRE_CODES`; to nearest, ties to even):
    what a widening accumulate and a narrowing READ carry, made on either
    side."""
    (_core.to_bfloat16 if code == _core.DTYPE_BFLOAT16_INTO_FLOAT32 else _core.to_float16)(src, out)


def widen_into(code: int, src: Any, out: Any) -> None:
    """The 2-byte items of ``src``, of the wire type of ``code``, into the
    float32 items of ``out`` (exact)."""
    (_core.from_bfloat16 if code == _core.DTYPE_BFLOAT16_INTO_FLOAT32 else _core.from_float16)(src, out)


def sparse_code(flags: int) -> int:
    """The value dtype code an ACCUMULATE_SPARSE's flags carry."""
    return (flags & DTYPE_MASK) >> DTYPE_SHIFT


def sparse_item_size(flags: int) -> int:
    """Payload bytes per item (index and value) of an ACCUMULATE_SPARSE."""
    index = 8 if flags & FLAG_WIDE_INDEX else 4
    return index + _core.dtype_sizes(sparse_code(flags))[1]

# Limits a server applies unless configured otherwise.
DEFAULT_MAX_FRAME: Final = 64 << 20      # largest payload of one frame
MAX_CONTROL: Final = 1 << 20             # largest control message
# a peek control command reads at most this many ranges, each at most
# PEEK_BYTES: its request and reply stay well within MAX_CONTROL
PEEK_READS: Final = 4096
PEEK_BYTES: Final = 128
# Clients cut operations into requests of at most this many bytes: several
# requests per server stay in flight (pipelining), and a server never needs
# more than this much scratch for an accumulate.
DEFAULT_MAX_REQUEST: Final = 4 << 20
# An accumulate is applied only once its whole delta is in, so the server
# holds it in scratch memory: cap it at the request size clients use.
MAX_ACCUMULATE: Final = DEFAULT_MAX_REQUEST


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: Any) -> Any:
    """Decode a control message; raises ValueError on anything malformed."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many unrelated types
        raise ValueError(f"malformed msgpack: {exc}") from None


def error_payload(message: str) -> bytes:
    return pack({"message": message[:4096]})


# --------------------------------------------------------------------------
# Sizes: "1GiB", "512MiB", "64k", "1000000"

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b?)\s*$", re.I)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: int | str) -> int:
    """Parse a size such as ``"1GiB"``, ``"64MiB"``, ``"4k"`` or ``4096``
    (units are powers of two)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise InvalidArgumentError(f"size must not be negative: {value}")
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            return int(m.group(1)) * _UNITS[m.group(2).lower()]
    raise InvalidArgumentError(f"not a size: {value!r} (try 1GiB, 512MiB or 4096)")


def parse_address(addr: str | tuple[str, int]) -> tuple[str, int]:
    """``"host:port"``, ``"[v6]:port"``, ``"host"`` or ``(host, port)``."""
    if isinstance(addr, tuple):
        host, port = addr
    else:
        s = addr.strip()
        if s.startswith("["):
            host, _, rest = s[1:].partition("]")
            port = int(rest[1:]) if rest.startswith(":") else DEFAULT_PORT
        elif s.count(":") == 1:
            host, p = s.split(":")
            if not p.isdigit():
                raise InvalidArgumentError(f"bad port in server address {addr!r}")
            port = int(p)
        else:
            host, port = s, DEFAULT_PORT
    if not host or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"bad server address {addr!r}")
    return host, int(port)


# --------------------------------------------------------------------------
# The frame receiver shared by the server and the client side of TCP.


class _Inline:
    """Deliver the payload to ``on_frame`` as one memoryview."""


class _Discard:
    """Read the payload and throw it away (the request was refused)."""


class _Closed:
    """The receiver closed the connection; stop parsing."""


class Prefix:
    """Deliver the first ``size`` bytes of the payload to ``on_prefix``,
    which then says where the rest goes (a fenced WRITE: check the fence,
    then receive the data straight into the segment, or discard it)."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size


INLINE: Final = _Inline()
DISCARD: Final = _Discard()
CLOSED: Final = _Closed()

Destination = _Inline | _Discard | _Closed | Prefix | list[memoryview]


class FrameReceiver(asyncio.BufferedProtocol, abc.ABC):
    """Frames off a stream, with payloads received straight into place.

    Three modes.  *Inbox*: bytes land in an inbox (``inbox_size``, 256 KiB by
    default) and frames are parsed out of it, many per ``recv``; a small
    payload is handed to ``on_frame`` as a view of the inbox.  *Direct*: a payload whose destination the subclass
    names (a slice of segment memory, pieces of a user's array) is received
    straight into it; only the part that arrived together with its header is
    copied.  *Discard*: a refused request's payload is read and dropped so the
    stream stays in sync.  Subclasses implement ``payload_size``,
    ``on_header`` and ``on_frame``, and call ``close_with`` to stop parsing.

    Memory: the inbox is allocated when the first byte arrives (a connection
    that sends nothing holds none), grows to ``inbox_size`` when a subclass
    raises it (a server keeps it small until the peer authenticates), and
    ``release_memory`` drops it and the scratch while nothing is pending.  A
    subclass bounds scratch memory with ``reserve``/``unreserve``.
    """

    INBOX_SIZE = 256 << 10
    _DISCARD_CHUNK = 64 << 10

    def __init__(self) -> None:
        self.inbox_size = self.INBOX_SIZE
        self._inbox = bytearray(0)
        self._inview = memoryview(self._inbox)
        self._start = 0
        self._end = 0
        # the frame whose payload is being received outside the inbox
        self._hdr: Header | None = None
        self._targets: list[memoryview] = []
        self._tidx = 0
        self._tpos = 0
        self._deliver: memoryview | None = None
        self._discard = 0
        # reused for inline payloads larger than the inbox (grows as ``reserve``
        # allows; ``release_memory`` gives it back): busy while a frame fills it
        self._scratch = bytearray(0)
        self._scratch_busy = False
        # the header at self._start was accepted as INLINE; waiting for its payload
        self._inline_wait = False
        # the header at self._start asked for a prefix that is not all here yet
        self._prefix_wait: Prefix | None = None
        self._stopped = False
        # why parsing is on hold (see hold()); frames already in the inbox wait
        self._holds: set[str] = set()

    # -- to implement -----------------------------------------------------
    @abc.abstractmethod
    def payload_size(self, hdr: Header) -> int:
        """Bytes of payload that follow this header."""

    @abc.abstractmethod
    def on_header(self, hdr: Header, size: int) -> Destination:
        """Where this frame's payload goes: INLINE, DISCARD, CLOSED or a
        list of memoryviews whose lengths add up to ``size``."""

    def on_prefix(self, hdr: Header, prefix: memoryview, rest: int) -> Destination:
        """Where the payload after a requested ``Prefix`` goes (``rest``
        bytes): INLINE, DISCARD, CLOSED or a list of memoryviews.  Only
        subclasses whose ``on_header`` returns a Prefix implement it."""
        raise TypeError(f"{type(self).__name__}.on_header asked for a prefix but has no on_prefix")

    @abc.abstractmethod
    def on_frame(self, hdr: Header, payload: memoryview | None) -> None:
        """The whole frame is in: ``payload`` for INLINE, else None (never
        called for DISCARD).  An inline payload may be a view of the inbox:
        use it before returning."""

    def close_with(self, reason: str) -> None:
        """Stop parsing; subclasses also close the transport."""
        self._stopped = True

    def reserve(self, nbytes: int) -> bool:
        """May the scratch grow by ``nbytes`` now?  A subclass that says no
        must hold parsing (``hold``) until it may; the frame is then retried."""
        return True

    def unreserve(self, nbytes: int) -> None:
        """``nbytes`` of scratch were given back (see ``reserve``)."""

    def release_memory(self, *, closed: bool = False) -> int:
        """Drop the inbox and the scratch if nothing is pending in them (an
        idle connection), or whatever is pending once the connection is
        ``closed``; returns the bytes given back.  They are allocated again
        when the next bytes arrive."""
        if not closed and (self.mid_frame or self._scratch_busy):
            return 0
        freed = len(self._inbox) + len(self._scratch)
        self._inbox = bytearray(0)
        self._inview = memoryview(self._inbox)
        self._start = self._end = 0
        if self._scratch:
            self.unreserve(len(self._scratch))
            self._scratch = bytearray(0)
        return freed

    @property
    def mid_frame(self) -> bool:
        """Part of a frame (header or payload) is in, the rest is not."""
        return self._hdr is not None or self._start != self._end

    @property
    def memory(self) -> int:
        """Bytes this receiver holds (inbox and scratch)."""
        return len(self._inbox) + len(self._scratch)

    def hold(self, reason: str) -> None:
        """Parse no further frame until ``unhold(reason)``.  Pausing the
        transport's reading is not enough: one recv can bring thousands of
        small requests into the inbox (8192 READ headers in 256 KiB), and
        answering all of them before looking at back-pressure again would
        buffer gigabytes of replies."""
        self._holds.add(reason)

    def unhold(self, reason: str) -> None:
        """Lift one hold; with none left, parse what is waiting in the inbox."""
        self._holds.discard(reason)
        if not self._holds and not self._stopped and self._hdr is None:
            self._parse()

    @property
    def held(self) -> bool:
        return bool(self._holds)

    # -- asyncio.BufferedProtocol ------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        if len(self._inbox) < self.inbox_size and self._hdr is None:
            self._grow_inbox()
        if self._hdr is not None:
            if self._discard:
                return self._inview[:min(self._discard, self._DISCARD_CHUNK)]
            return self._targets[self._tidx][self._tpos:]
        if self._stopped:
            return self._inview          # drain the peer until the close lands
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._inbox) - self._end < 4096:
            self._compact()
        return self._inview[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._stopped:
            return
        if self._hdr is not None:
            if not self._advance(nbytes):
                return
        else:
            self._end += nbytes
        self._parse()

    # -- internals ------------------------------------------------------
    def _grow_inbox(self) -> None:
        inbox = bytearray(self.inbox_size)
        n = self._end - self._start
        inbox[0:n] = self._inview[self._start:self._end]
        self._inbox, self._inview = inbox, memoryview(inbox)
        self._start, self._end = 0, n

    def _scratch_view(self, size: int) -> memoryview | None:
        """Scratch for one payload, or None when ``reserve`` refused it."""
        if len(self._scratch) < size:
            if not self.reserve(size - len(self._scratch)):
                return None
            self._scratch = bytearray(size)
        self._scratch_busy = True
        return memoryview(self._scratch)[:size]

    def _compact(self) -> None:
        n = self._end - self._start
        if self._start:
            self._inbox[0:n] = self._inview[self._start:self._end]
        self._start, self._end = 0, n

    def _advance(self, nbytes: int) -> bool:
        """Account for ``nbytes`` of payload received outside the inbox;
        finish the frame (and return True) when it is complete."""
        if self._discard:
            # a refused request's payload: it was answered already
            self._discard -= nbytes
            if self._discard == 0:
                self._hdr = None
                return True
            return False
        else:
            targets = self._targets
            self._tpos += nbytes
            while self._tidx < len(targets) and self._tpos >= len(targets[self._tidx]):
                self._tpos -= len(targets[self._tidx])
                self._tidx += 1
            done = self._tidx == len(targets)
        if done:
            hdr, deliver = self._hdr, self._deliver
            self._hdr, self._deliver, self._targets = None, None, []
            assert hdr is not None
            try:
                self.on_frame(hdr, deliver)
            finally:
                self._scratch_busy = False
        return done

    def _parse(self) -> None:
        inview = self._inview
        while not self._stopped and self._hdr is None and not self._holds:
            avail = self._end - self._start
            if avail < HEADER_SIZE:
                return
            hdr = _core.decode_header(self._inbox, self._start)
            if hdr[H_MAGIC] != MAGIC:
                self.close_with(f"bad magic 0x{hdr[H_MAGIC]:04x}: not an smb2 peer")
                return
            size = self.payload_size(hdr)
            if self._inline_wait:
                dest: Destination = INLINE
            elif self._prefix_wait is not None:
                dest = self._prefix_wait
            else:
                dest = self.on_header(hdr, size)
                if dest is CLOSED or self._stopped:
                    return
            self._inline_wait = False
            body = self._start + HEADER_SIZE
            if isinstance(dest, Prefix):
                # the prefix is small: wait until it is in the inbox, then let
                # the subclass decide about the rest, which is then received
                # like any payload (in place, inline or discarded)
                plen = dest.size
                if size < plen:
                    self.close_with(f"payload of {size} bytes is shorter than its {plen}-byte prefix")
                    return
                if avail - HEADER_SIZE < plen:
                    self._compact()
                    self._prefix_wait = dest
                    return
                self._prefix_wait = None
                dest = self.on_prefix(hdr, inview[body:body + plen], size - plen)
                if dest is CLOSED or self._stopped:
                    return
                body += plen
                size -= plen
                avail -= plen
                if dest is INLINE and avail - HEADER_SIZE < size:
                    # waiting for the rest would re-parse the header without
                    # its prefix: take the scratch path below instead (a
                    # prefixed payload that comes inline is short: no reserve)
                    if len(self._scratch) < size:
                        self._scratch = bytearray(size)
                    self._scratch_busy = True
                    self._deliver = memoryview(self._scratch)[:size]
                    dest = [self._deliver]
            have = min(avail - HEADER_SIZE, size)
            if have == size and dest is not DISCARD and not isinstance(dest, list):
                self._start = body + size
                self.on_frame(hdr, inview[body:body + size])
                continue
            if dest is INLINE:
                if size <= len(self._inbox) - HEADER_SIZE:
                    self._compact()      # the rest will fit behind it: wait
                    self._inline_wait = True
                    return
                scratch = self._scratch_view(size)
                if scratch is None:      # reserve() held parsing: retry this header later
                    self._inline_wait = True
                    return
                self._deliver = scratch
                self._targets = [scratch]
            elif dest is DISCARD:
                self._start = body + have
                if have == size:
                    continue
                self._hdr = hdr
                self._discard = size - have
                return
            else:
                assert isinstance(dest, list)
                self._targets = dest
            # direct: copy what came with the header, receive the rest in place
            self._hdr = hdr
            self._tidx = self._tpos = 0
            self._start = body + have
            if size == 0:
                self._advance(0)
                continue
            pos, left = body, have
            while left:
                t = self._targets[self._tidx]
                take = min(len(t) - self._tpos, left)
                _core.copy_into(t[self._tpos:self._tpos + take], inview[pos:pos + take])
                pos += take
                left -= take
                if self._advance(take):
                    break
