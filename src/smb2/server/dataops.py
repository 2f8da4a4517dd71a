"""A server connection's data ops: READ, WRITE (fenced or not), ACCUMULATE
(dense, sparse, staged over RDMA), FETCH_ADD, COMPARE_SWAP and the lock ops.

Each op has a header check, run before a byte of its payload is read (where
the payload goes, or :class:`~smb2.server.segment.Refused`), and an execution,
run once its frame is all in.  :class:`DataOps` keeps what spans frames: the
WRITE whose payload lands in place, and the accumulates waiting behind it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import numpy as np

from .. import _core
from ..errors import ErrorCode
from ..protocol import (
    DISCARD,
    DTYPE_MASK,
    DTYPE_SHIFT,
    FENCE_SIZE,
    FLAG_FENCED,
    FLAG_STAGED,
    H_FLAGS,
    H_LENGTH,
    H_OFFSET,
    H_OP,
    H_SEGMENT,
    INLINE,
    LOCK_OPS,
    LOCK_SEGMENT,
    MAX_ACCUMULATE,
    REPL_FLAGS,
    REPL_PREFIX_SIZE,
    REPLICATED_OPS,
    Destination,
    Header,
    Op,
    Prefix,
    accumulate_span,
    narrow_into,
    read_span,
)
from . import sparse
from .replication import Client
from .segment import Refused, Segment

# accumulate deltas one connection may have waiting behind in-flight writes
MAX_DEFERRED = 2 * MAX_ACCUMULATE
# a staged accumulate's payload: u64 staging offset, u64 length
STAGED_PAYLOAD = 16
_FENCE = Prefix(FENCE_SIZE)


class Link(Client, Protocol):
    """What the data ops need of their connection (connection.Connection):
    what the replication needs (answers, holding input), and more."""

    server: Any         # the MemoryServer (memory.py)
    counts: Any         # metrics.RequestCounts of the connection's transport
    rdma_peer: Any

    def holding(self, reason: str) -> bool: ...
    def wait_for_memory(self) -> None: ...


def _refuse_lock_segment(segment: int) -> None:
    # a client changes lock words only with atomics, which the lock service sees
    if segment == LOCK_SEGMENT:
        raise Refused(ErrorCode.ACCESS_DENIED, "the lock segment only takes READ and atomics")


def _refuse_unreplicated(seg: Segment) -> None:
    # one copy changed without the others would make the replicas differ
    raise Refused(ErrorCode.BAD_REQUEST, f"buffer {seg.name!r} is replicated ({seg.replicas} copies): "
                  "its writes, accumulates and atomics go to a stripe's primary with REPLICATED")


def _accumulate_span(hdr: Header, offset: int, length: int) -> int:
    """The destination bytes an accumulate covers: ``length`` (its payload's
    bytes) for a same-width dtype, twice that for a widening one (bf16/fp16
    into float32); refused unless whole, aligned items of a known dtype."""
    try:
        return accumulate_span(hdr[H_FLAGS], offset, length)
    except ValueError as exc:
        raise Refused(ErrorCode.BAD_REQUEST, str(exc)) from None


class DataOps:
    """One connection's data ops: each op's header check and execution."""

    def __init__(self, conn: Link) -> None:
        self.conn = conn
        self.server = conn.server
        # the write whose payload is being received in place: (segment, range)
        self._write: tuple[Segment, tuple[int, int]] | None = None
        # bytes of accumulate deltas waiting for an overlapping write
        self._deferred_bytes = 0

    def knows(self, op: int) -> bool:
        """Is ``op`` a data op (not CONTROL)?"""
        return op in self._HEADER_CHECKS

    def check(self, hdr: Header, size: int) -> Destination:
        """Where the payload of the request ``hdr`` goes, or Refused."""
        if hdr[H_FLAGS] & REPL_FLAGS:
            return self._check_replicated(hdr, size)
        return self._HEADER_CHECKS[hdr[H_OP]](self, hdr, size)

    def execute(self, hdr: Header, payload: memoryview | None) -> None:
        """Run the request ``hdr`` (checked) now that its payload is all in."""
        self._EXECUTE[hdr[H_OP]](self, hdr, payload)

    @property
    def deferred_bytes(self) -> int:
        """Bytes of accumulate deltas waiting behind a write still being received."""
        return self._deferred_bytes

    @property
    def receiving(self) -> bool:
        """A WRITE's payload is being received in place."""
        return self._write is not None

    def abandon_write(self) -> None:
        """The connection is gone mid-WRITE: accumulates waiting on it go on."""
        if self._write is not None:
            seg, rng = self._write
            self._write = None
            seg.write_done(rng)

    # Each op's header check, before a byte of its payload is read: where the
    # payload goes, or Refused.
    def _check_lock_op(self, hdr: Header, size: int) -> Destination:
        self.server.locks.check_header(hdr, size)
        return INLINE

    def _check_replicated(self, hdr: Header, size: int) -> Destination:
        # the payload comes whole (INLINE): it is applied here and forwarded
        # to the backups in one step (replication/)
        op, flags, offset = hdr[H_OP], hdr[H_FLAGS], hdr[H_OFFSET]
        if self.server.replication is None:
            raise Refused(ErrorCode.UNSUPPORTED, "this server is not part of a replicated cluster "
                          "(smb2-server --membership)")
        if op not in REPLICATED_OPS or flags & FLAG_STAGED or (flags & REPL_FLAGS) == REPL_FLAGS:
            raise Refused(ErrorCode.BAD_REQUEST, "REPLICATED or FORWARDED is a flag of WRITE, ACCUMULATE, "
                          "ACCUMULATE_SPARSE, FETCH_ADD or COMPARE_SWAP, not both, never STAGED")
        head = REPL_PREFIX_SIZE + (FENCE_SIZE if flags & FLAG_FENCED and op == Op.WRITE else 0)
        if size < head:
            raise Refused(ErrorCode.BAD_REQUEST, f"a replicated op's payload starts with {head} bytes "
                          "(epoch, client id, sequence[, fence])")
        n = size - head
        _refuse_lock_segment(hdr[H_SEGMENT])
        if op == Op.ACCUMULATE_SPARSE:
            # its indices are checked, against the stripe, once the payload is in
            seg = self._segment(hdr[H_SEGMENT], 0, 0)
            sparse.check_header(seg, flags, offset)
            if seg.replicas < 2:
                raise Refused(ErrorCode.BAD_REQUEST, f"buffer {seg.name!r} is not replicated: send its ops "
                              "without REPLICATED")
            return INLINE
        if op == Op.ACCUMULATE:
            n = _accumulate_span(hdr, offset, n)
        elif op != Op.WRITE and (offset % 8 or n != (8 if op == Op.FETCH_ADD else 16)):
            raise Refused(ErrorCode.BAD_REQUEST, "atomics act on one 8-byte aligned word")
        span = 8 if op in (Op.FETCH_ADD, Op.COMPARE_SWAP) else n     # a CAS's 16 bytes act on one word
        seg = self._segment(hdr[H_SEGMENT], offset, span)
        if seg.replicas < 2:
            raise Refused(ErrorCode.BAD_REQUEST, f"buffer {seg.name!r} is not replicated: send its ops "
                          "without REPLICATED")
        if span and offset // seg.stripe != (offset + span - 1) // seg.stripe:
            raise Refused(ErrorCode.BAD_REQUEST, "a replicated op stays within one stripe")
        return INLINE

    def _check_read(self, hdr: Header, size: int) -> Destination:
        try:
            span = read_span(hdr[H_FLAGS], hdr[H_OFFSET], hdr[H_LENGTH])
        except ValueError as exc:
            raise Refused(ErrorCode.BAD_REQUEST, str(exc)) from None
        self._segment(hdr[H_SEGMENT], hdr[H_OFFSET], span)
        return INLINE

    def _check_write(self, hdr: Header, size: int) -> Destination:
        segment, offset, length = hdr[H_SEGMENT], hdr[H_OFFSET], hdr[H_LENGTH]
        _refuse_lock_segment(segment)
        if hdr[H_FLAGS] & FLAG_FENCED:
            if length < FENCE_SIZE:
                raise Refused(ErrorCode.BAD_REQUEST, "a fenced WRITE starts with a 16-byte fence")
            if self._segment(segment, offset, length - FENCE_SIZE).replicas > 1:
                _refuse_unreplicated(self.server.segments[segment])
            return _FENCE
        seg = self._segment(segment, offset, length)
        if seg.replicas > 1:
            _refuse_unreplicated(seg)
        return self._receive_write(seg, offset, length)

    def _receive_write(self, seg: Segment, offset: int, length: int) -> Destination:
        # the payload lands straight in the segment; accumulates that overlap
        # it wait until it is complete (Segment.inflight)
        rng = (offset, offset + length)
        seg.inflight.append(rng)
        self._write = (seg, rng)
        return [seg.view[offset:offset + length]] if length else INLINE

    def _check_accumulate(self, hdr: Header, size: int) -> Destination:
        segment, offset, length = hdr[H_SEGMENT], hdr[H_OFFSET], hdr[H_LENGTH]
        # before the staged case, which names its segment in the header too
        _refuse_lock_segment(segment)
        if hdr[H_FLAGS] & FLAG_STAGED:
            # payload: u64 staging offset, u64 length (checked in on_frame)
            if size != STAGED_PAYLOAD or self.conn.rdma_peer is None:
                raise Refused(ErrorCode.BAD_REQUEST, "a staged accumulate needs rdma_connect "
                              "and a 16-byte payload")
            return INLINE
        # the dtype and alignment first, then the bounds of the whole range
        if self._segment(segment, offset, _accumulate_span(hdr, offset, length)).replicas > 1:
            _refuse_unreplicated(self.server.segments[segment])
        return INLINE

    def _check_sparse(self, hdr: Header, size: int) -> Destination:
        segment, offset, flags = hdr[H_SEGMENT], hdr[H_OFFSET], hdr[H_FLAGS]
        _refuse_lock_segment(segment)
        if flags & FLAG_STAGED and (size != STAGED_PAYLOAD or self.conn.rdma_peer is None):
            raise Refused(ErrorCode.BAD_REQUEST, "a staged accumulate needs rdma_connect and a 16-byte payload")
        seg = self._segment(segment, 0, 0)
        # the dtype and the base now; the indices once the payload is in
        sparse.check_header(seg, flags, offset)
        if seg.replicas > 1:
            _refuse_unreplicated(seg)
        return INLINE

    def _check_atomic(self, hdr: Header, size: int) -> Destination:
        offset = hdr[H_OFFSET]
        if self._segment(hdr[H_SEGMENT], offset, 8).replicas > 1:
            _refuse_unreplicated(self.server.segments[hdr[H_SEGMENT]])
        want = 8 if hdr[H_OP] == Op.FETCH_ADD else 16
        if offset % 8 or size != want:
            raise Refused(ErrorCode.BAD_REQUEST, "atomics act on one 8-byte aligned word")
        return INLINE

    def on_prefix(self, hdr: Header, prefix: memoryview, rest: int) -> Destination:
        # a fenced WRITE: check the fence before a byte of data lands
        key, token = _core.unpack_u64(prefix, 0), _core.unpack_u64(prefix, 8)
        if not self.server.locks.check_fence(key, token):
            self.conn.refuse(hdr, ErrorCode.STALE_FENCE,
                         f"write fenced with token {token} refused: the lock was lost "
                         "(lease expired, released, or a newer holder wrote here)")
            return DISCARD
        seg = self.server.segments.get(hdr[H_SEGMENT])
        if seg is None:     # destroyed between header and prefix
            self.conn.refuse(hdr, ErrorCode.NO_SUCH_BUFFER, f"no segment {hdr[H_SEGMENT]}")
            return DISCARD
        return self._receive_write(seg, hdr[H_OFFSET], rest)

    def _segment(self, segment: int, offset: int, length: int) -> Segment:
        seg = self.server.segments.get(segment)
        if seg is None:
            raise Refused(ErrorCode.NO_SUCH_BUFFER, f"no segment {segment} (destroyed, or the server restarted)")
        if offset > seg.size or length > seg.size - offset:
            raise Refused(ErrorCode.OUT_OF_BOUNDS,
                          f"range [{offset}, {offset + length}) is outside segment {segment} of {seg.size} bytes")
        return seg

    def _still_there(self, segment: int) -> Segment:
        # another connection may have destroyed it while this payload came in
        seg = self.server.segments.get(segment)
        if seg is None:
            raise Refused(ErrorCode.NO_SUCH_BUFFER, f"no segment {segment} (destroyed while the "
                          "request was being received)")
        return seg


    # Each op, executed once its frame is all in (its header was checked).
    def _do_lock_op(self, hdr: Header, payload: memoryview | None) -> None:
        assert payload is not None
        self.server.locks.on_frame(self.conn, hdr, payload)

    def _do_read(self, hdr: Header, payload: memoryview | None) -> None:
        # no payload: this runs right after on_header found the segment
        seg = self.server.segments[hdr[H_SEGMENT]]
        offset, length = hdr[H_OFFSET], hdr[H_LENGTH]
        self.conn.counts.bytes_out[hdr[H_OP]] += length
        code = (hdr[H_FLAGS] & DTYPE_MASK) >> DTYPE_SHIFT
        if not code:
            self.conn.reply(hdr, seg.view[offset:offset + length])
            return
        # a narrowing read (checked: a code of WIRE_CODES): half the bytes on the link
        narrow = np.empty(length // 2, np.uint16)
        narrow_into(code, seg.view[offset:offset + 2 * length], narrow)
        self.conn.reply(hdr, narrow.data.cast("B"))

    def _do_write(self, hdr: Header, payload: memoryview | None) -> None:
        offset, length = hdr[H_OFFSET], hdr[H_LENGTH]
        if hdr[H_FLAGS] & FLAG_FENCED:
            length -= FENCE_SIZE
        self.server.bytes_in += length
        self.conn.counts.bytes_in[hdr[H_OP]] += length
        if self._write is not None:
            wseg, rng = self._write
            self._write = None
            if payload is not None and length:
                # the part that came inline (a short write, or one whose
                # payload arrived with its header)
                _core.copy_into(wseg.view[offset:offset + length], payload)
            wseg.write_done(rng)
        self.conn.reply(hdr)

    def _do_accumulate(self, hdr: Header, payload: memoryview | None) -> None:
        assert payload is not None
        if hdr[H_FLAGS] & FLAG_STAGED:
            self._accumulate_staged(hdr, payload)
            return
        seg = self._still_there(hdr[H_SEGMENT])
        self.server.bytes_in += hdr[H_LENGTH]
        self._accumulate(hdr, seg, payload)

    def _do_sparse(self, hdr: Header, payload: memoryview | None) -> None:
        assert payload is not None
        flags, offset = hdr[H_FLAGS], hdr[H_OFFSET]
        if flags & FLAG_STAGED:
            # a copy: the client can still RDMA-write its staging slot, and
            # the indices checked must be the indices added
            data: memoryview | bytes = bytes(self.conn.rdma_peer.staged(_core.unpack_u64(payload, 0),
                                                                   _core.unpack_u64(payload, 8)))
        else:
            data = payload
        seg = self._still_there(hdr[H_SEGMENT])
        lo, hi = sparse.span(seg, flags, offset, data)
        self.server.bytes_in += len(data)
        self.conn.counts.bytes_in[hdr[H_OP]] += len(data)
        self._in_order(hdr, seg, lo, hi, data, lambda items: sparse.add(seg, flags, offset, items))

    def _do_fetch_add(self, hdr: Header, payload: memoryview | None) -> None:
        assert payload is not None
        seg, offset = self._still_there(hdr[H_SEGMENT]), hdr[H_OFFSET]
        # a CPU atomic: shm clients change the same word from their processes
        add = _core.unpack_u64(payload)
        old = _core.atomic_fetch_add(seg.view, offset, add)
        self.conn.reply(hdr, _core.pack_u64(old))
        if seg.id == LOCK_SEGMENT:
            self.server.locks.touched(offset, self.conn)
        elif add:
            _core.futex_wake(seg.view, offset)      # a shm client may sleep on it (smb2.notify)

    def _do_compare_swap(self, hdr: Header, payload: memoryview | None) -> None:
        assert payload is not None
        seg, offset = self._still_there(hdr[H_SEGMENT]), hdr[H_OFFSET]
        expected = _core.unpack_u64(payload, 0)
        old = _core.atomic_compare_swap(seg.view, offset, expected, _core.unpack_u64(payload, 8))
        self.conn.reply(hdr, _core.pack_u64(old))
        if seg.id == LOCK_SEGMENT:
            self.server.locks.touched(offset, self.conn)
        elif old == expected:
            _core.futex_wake(seg.view, offset)      # a shm client may sleep on it (smb2.notify)

    def _accumulate(self, hdr: Header, seg: Segment, payload: memoryview) -> None:
        # ``length`` is the payload's; a widening dtype covers twice that (checked)
        offset, length = hdr[H_OFFSET], hdr[H_LENGTH]
        self.conn.counts.bytes_in[hdr[H_OP]] += length
        code = (hdr[H_FLAGS] & DTYPE_MASK) >> DTYPE_SHIFT
        end = offset + accumulate_span(hdr[H_FLAGS], offset, length)
        self._in_order(hdr, seg, offset, end, payload, lambda delta: self.server.add(seg.view[offset:end], delta, code))

    def _in_order(self, hdr: Header, seg: Segment, lo: int, hi: int, payload: memoryview | bytes,
                  apply: Callable[[memoryview | bytes], None]) -> None:
        """``apply(payload)`` (an accumulate, dense or sparse, of the
        segment's bytes ``[lo, hi)``) now, or once no write still being
        received overlaps them; then the reply."""
        if seg.overlaps_inflight(lo, hi):
            delta = bytes(payload)       # the inbox is reused: keep a copy
            length = len(delta)
            # Waiting accumulates hold copies of their deltas: bound them per
            # connection (a write that never completes must not let a client
            # queue unbounded memory behind it).
            self._deferred_bytes += length
            if self._deferred_bytes > MAX_DEFERRED:
                self.conn.hold_input("deferred")
            # ... and over all connections, in the server's pool
            pool = self.server.receive_pool
            pool.take(length)
            if not pool.fits(0):
                self.conn.wait_for_memory()

            def run() -> None:
                if seg.id in self.server.segments:
                    apply(delta)
                self._deferred_bytes -= length
                pool.give(length)
                self.conn.reply(hdr)
                if self._deferred_bytes <= MAX_DEFERRED and self.conn.holding("deferred"):
                    # not from here: this runs inside another connection's
                    # frame handling, and parsing ours now would nest them
                    asyncio.get_running_loop().call_soon(self.conn.unhold_input, "deferred")
            seg.deferred.append((lo, hi, run))
            return
        apply(payload)
        self.conn.reply(hdr)

    def _accumulate_staged(self, hdr: Header, payload: memoryview) -> None:
        # The delta was RDMA-written into this connection's staging area;
        # ``length`` is the staged delta's, a widening dtype covers twice that
        soff, length = _core.unpack_u64(payload, 0), _core.unpack_u64(payload, 8)
        offset = hdr[H_OFFSET]
        seg = self._segment(hdr[H_SEGMENT], offset, _accumulate_span(hdr, offset, length))
        delta = self.conn.rdma_peer.staged(soff, length)
        self._accumulate((*hdr[:H_LENGTH], length), seg, delta)

    _HEADER_CHECKS: ClassVar[dict[int, Callable[[DataOps, Header, int], Destination]]] = {
        Op.READ: _check_read, Op.WRITE: _check_write, Op.ACCUMULATE: _check_accumulate,
        Op.ACCUMULATE_SPARSE: _check_sparse,
        Op.FETCH_ADD: _check_atomic, Op.COMPARE_SWAP: _check_atomic,
        **dict.fromkeys(LOCK_OPS, _check_lock_op)}
    _EXECUTE: ClassVar[dict[int, Callable[[DataOps, Header, memoryview | None], None]]] = {
        Op.READ: _do_read, Op.WRITE: _do_write, Op.ACCUMULATE: _do_accumulate,
        Op.ACCUMULATE_SPARSE: _do_sparse,
        Op.FETCH_ADD: _do_fetch_add, Op.COMPARE_SWAP: _do_compare_swap,
        **dict.fromkeys(LOCK_OPS, _do_lock_op)}
