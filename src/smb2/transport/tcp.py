"""The TCP transport: the server executes one-sided operations for us.

One connection per server; requests are pipelined (each carries a request
id and replies may come in any order).  A READ reply is received straight
into the caller's memory; a WRITE's pieces go out with one ``writev`` on
uvloop.
"""

from __future__ import annotations

import asyncio
import errno as errno_mod
import itertools
import logging
import random
import socket
from collections.abc import Callable, Sequence
from typing import Any, cast

from .. import _core, auth
from ..errors import ProtocolError, TransportError, server_error
from ..protocol import (
    CLOSED,
    DTYPE_SHIFT,
    FLAG_FENCED,
    FLAG_NOREPLY,
    FLAG_QUEUED,
    FLAG_REPLICATED,
    FLAG_REPLY,
    FLAG_STAGED,
    H_FLAGS,
    H_LENGTH,
    H_OP,
    H_REQUEST,
    H_STATUS,
    INLINE,
    MASK64,
    MAX_ACCUMULATE,
    VERSION,
    Destination,
    FrameReceiver,
    Header,
    Op,
    pack,
    unpack,
)
from .base import LockCapable, Transport

log = logging.getLogger("smb2.transport.tcp")

# connect failures worth another try (TcpTransport.connect): what a crowded
# server (a full accept queue resets) or a crowded client host (no ephemeral
# port, no buffer) answers; ECONNREFUSED (nobody listens) is not among them
RETRY_ERRNOS = frozenset({errno_mod.ECONNRESET, errno_mod.ECONNABORTED, errno_mod.EAGAIN, errno_mod.EPIPE,
                          errno_mod.EADDRNOTAVAIL, errno_mod.ENOBUFS})
# the first retry's pause bound, doubled each time up to the second
RETRY_FIRST_PAUSE = 0.05
RETRY_MAX_PAUSE = 2.0

# what a reply carries: nothing, data into the caller's buffers, a u64, a
# msgpack map, or a lock grant (u64 ticket; flag QUEUED: others wait behind)
_EMPTY, _INTO, _U64, _MSG, _GRANT = 0, 1, 2, 3, 4
# the largest replies the client accepts: an error's message, a control
# reply (``stat`` of a server with thousands of buffers and locks)
_MAX_ERROR_REPLY = 64 << 10
_MAX_CONTROL_REPLY = 16 << 20


class _Pending:
    __slots__ = ("fut", "kind", "targets", "length")

    def __init__(self, fut: asyncio.Future[Any], kind: int,
                 targets: Sequence[memoryview] | None, length: int) -> None:
        self.fut = fut
        self.kind = kind
        self.targets = targets
        self.length = length


class _ClientProtocol(FrameReceiver):
    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, _Pending] = {}
        self.lost: Exception | None = None
        self._drain: asyncio.Future[None] | None = None
        self._paused = False
        self.uvloop = False
        # called once with the error when the connection is lost (the RDMA
        # transport, which rides on this connection, fails its ops with it)
        self.on_lost: Callable[[Exception], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.uvloop = type(asyncio.get_running_loop()).__module__.startswith("uvloop")

    def connection_lost(self, exc: Exception | None) -> None:
        err = exc if isinstance(exc, TransportError) else TransportError(
            f"connection to {self.label} lost" + (f": {exc}" if exc else ""),
            errno=getattr(exc, "errno", None) or errno_mod.ECONNRESET, server=self.label)
        if self.lost is None:
            self.lost = err
        self.transport = None
        pending, self.pending = self.pending, {}
        for p in pending.values():
            if not p.fut.done():
                p.fut.set_exception(self.lost)
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(self.lost)
        if self.on_lost is not None:
            on_lost, self.on_lost = self.on_lost, None
            on_lost(self.lost)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    async def drain(self) -> None:
        if self._paused:
            if self._drain is None:
                self._drain = asyncio.get_running_loop().create_future()
            await self._drain

    def close_with(self, reason: str) -> None:
        super().close_with(reason)
        self.lost = ProtocolError(f"{self.label}: {reason}")
        if self.transport is not None:
            self.transport.abort()

    # -- frames ------------------------------------------------------------
    def payload_size(self, hdr: Header) -> int:
        return hdr[H_LENGTH]

    def on_header(self, hdr: Header, size: int) -> Destination:
        if not hdr[H_FLAGS] & FLAG_REPLY:
            self.close_with(f"server sent a request frame (op {hdr[H_OP]})")
            return CLOSED
        p = self.pending.get(hdr[H_REQUEST])
        if p is None:
            if hdr[H_REQUEST] == 0 and hdr[H_STATUS]:
                if size > _MAX_ERROR_REPLY:
                    self.close_with(f"close reason of {size} bytes")
                    return CLOSED
                return INLINE     # the server's reason for closing us
            self.close_with(f"reply to unknown request {hdr[H_REQUEST]}")
            return CLOSED
        # Never trust an announced length: an inline payload is allocated
        # before it arrives, and a broken or hostile server must not make the
        # client allocate what it names.
        if hdr[H_STATUS] or p.kind == _MSG:
            limit = _MAX_ERROR_REPLY if hdr[H_STATUS] else _MAX_CONTROL_REPLY
            if size > limit:
                self.close_with(f"reply of {size} bytes to a request that expects at most {limit}")
                return CLOSED
        elif p.kind in (_U64, _GRANT, _EMPTY) and size != (0 if p.kind == _EMPTY else 8):
            self.close_with(f"reply of {size} bytes to a request that expects "
                            f"{0 if p.kind == _EMPTY else 8}")
            return CLOSED
        if hdr[H_STATUS] == 0 and p.kind == _INTO:
            if size != p.length:
                self.close_with(f"READ reply of {size} bytes for {p.length} asked")
                return CLOSED
            assert p.targets is not None
            return list(p.targets)
        return INLINE

    def on_frame(self, hdr: Header, payload: memoryview | None) -> None:
        status = hdr[H_STATUS]
        p = self.pending.pop(hdr[H_REQUEST], None)
        if p is None:
            # status != 0 with request id 0: the server closes the connection
            msg = _message(payload)
            self.lost = server_error(status, f"{self.label} closed the connection: {msg}",
                                     server=self.label)
            log.warning("%s", self.lost)
            return
        if p.fut.done():          # cancelled by the caller
            return
        if status:
            p.fut.set_exception(server_error(status, f"{self.label}: {_message(payload)}",
                                             server=self.label))
        elif p.kind == _EMPTY or p.kind == _INTO:
            p.fut.set_result(None)
        elif p.kind == _U64:
            assert payload is not None
            p.fut.set_result(_core.unpack_u64(payload))
        elif p.kind == _GRANT:
            assert payload is not None
            p.fut.set_result((_core.unpack_u64(payload), bool(hdr[H_FLAGS] & FLAG_QUEUED)))
        else:
            try:
                p.fut.set_result(unpack(payload))
            except ValueError as exc:
                p.fut.set_exception(ProtocolError(f"{self.label}: {exc}"))


def _message(payload: memoryview | None) -> str:
    if not payload:
        return "(no reason given)"
    try:
        msg = unpack(payload)
        return str(msg.get("message", msg)) if isinstance(msg, dict) else str(msg)
    except ValueError:
        return bytes(payload[:200]).decode("utf-8", "replace")


class TcpTransport(Transport, LockCapable):
    """Client side of one TCP connection to one server."""

    name = "tcp"
    # the server reads every request: it parks waiters
    lock_waits = ("park", "poll")

    def __init__(self, address: tuple[str, int], protocol: _ClientProtocol) -> None:
        super().__init__(address)
        self._proto = protocol
        self._next_id = 0
        # small frames that may wait for the next request (a lock release):
        # sent with it in one write, or at the end of this loop iteration
        self._cork: list[bytes] = []

    @classmethod
    async def connect(cls, address: tuple[str, int], *, timeout: float = 10.0,
                      token: bytes | None = None) -> TcpTransport:
        """Open the connection, say hello and authenticate if the server asks;
        raises TransportError (or AccessDenied).

        A connection that fails the way a crowded server or a crowded client
        host fails (reset, aborted, no local port or buffer free) is tried
        again after a pause drawn at random below a bound that doubles each
        time ("full jitter"), all within ``timeout``: a thousand workers
        that start together spread out instead of retrying in step.  A
        refused port (nobody listens) and a server's answer (its connection
        cap, a wrong token) are raised at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for attempt in itertools.count():
            try:
                return await cls._connect_once(address, max(0.0, deadline - loop.time()), token)
            except TransportError as exc:
                pause = random.uniform(0.0, min(RETRY_MAX_PAUSE, RETRY_FIRST_PAUSE * 2 ** attempt))
                if exc.errno not in RETRY_ERRNOS or loop.time() + pause >= deadline:
                    raise
                log.debug("%s: connect failed (%s), try %d again in %.3f s", exc.server, exc.message,
                          attempt + 2, pause)
                await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    @classmethod
    async def _connect_once(cls, address: tuple[str, int], timeout: float, token: bytes | None) -> TcpTransport:
        loop = asyncio.get_running_loop()
        label = f"{address[0]}:{address[1]}"
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(lambda: _ClientProtocol(label), address[0], address[1]),
                timeout)
        except TimeoutError:
            raise TransportError(f"connecting to {label} timed out after {timeout} s",
                                 errno=errno_mod.ETIMEDOUT, server=label) from None
        except OSError as exc:
            raise TransportError(f"cannot connect to {label}: {exc.strerror or exc}",
                                 errno=exc.errno, server=label) from None
        self = cls(address, proto)
        try:
            info = await asyncio.wait_for(
                self.control({"cmd": "hello", "version": VERSION, "transports": ["tcp"]}), timeout)
            info.update(await asyncio.wait_for(
                auth.client_handshake(self.control, info, token, label), timeout))
        except TimeoutError:
            # connected, but nobody answers (a stopped or overloaded server)
            await self.close()
            raise TransportError(f"{label} accepted the connection but did not answer hello within "
                                 f"{timeout} s", errno=errno_mod.ETIMEDOUT, server=label) from None
        except BaseException:
            await self.close()
            raise
        self.server_info = info
        max_frame = info.get("max_frame")
        if isinstance(max_frame, int) and max_frame > 0:
            self.max_request = min(self.max_request, max_frame, MAX_ACCUMULATE)
        return self

    @property
    def closed(self) -> bool:
        return self._proto.transport is None

    @property
    def on_lost(self) -> Callable[[Exception], None] | None:
        """Called once, with the error, when the connection is lost (a
        transport that rides on this connection fails its own operations
        with it); None for nobody."""
        return self._proto.on_lost

    @on_lost.setter
    def on_lost(self, callback: Callable[[Exception], None] | None) -> None:
        self._proto.on_lost = callback

    def _submit(self, rid: int, parts: Sequence[bytes | memoryview], kind: int,
                targets: Sequence[memoryview] | None, length: int) -> asyncio.Future[Any]:
        proto = self._proto
        t = proto.transport
        if t is None:
            raise proto.lost or TransportError(f"connection to {self.label} is closed",
                                               errno=errno_mod.ENOTCONN, server=self.label)
        fut = asyncio.get_running_loop().create_future()
        proto.pending[rid] = _Pending(fut, kind, targets, length)
        if self._cork:
            parts = [*self._cork, *parts]
            self._cork.clear()
        if len(parts) == 1:
            t.write(parts[0])
        elif proto.uvloop:
            t.writelines(parts)     # one writev; the pieces are not copied
        else:
            for part in parts:
                t.write(part)
        return fut

    def _new_id(self) -> int:
        self._next_id = (self._next_id % 0xFFFFFFFF) + 1
        return self._next_id

    async def _call(self, op: int, flags: int, segment: int, offset: int, length: int,
                    payload: bytes | Sequence[memoryview], kind: int,
                    targets: Sequence[memoryview] | None = None) -> Any:
        await self._proto.drain()
        rid = self._new_id()
        if isinstance(payload, bytes):
            parts: list[bytes | memoryview] = [_core.encode_header_with(
                VERSION, op, flags, 0, rid, segment, offset, length, payload)]
        else:
            parts = [_core.encode_header(VERSION, op, flags, 0, rid, segment, offset, length)]
            parts.extend(payload)
        # If the caller is cancelled, a READ still in flight keeps its targets
        # alive and may yet land in them; the reply itself is then ignored.
        return await self._submit(rid, parts, kind, targets, length)

    async def control(self, msg: dict[str, Any]) -> dict[str, Any]:
        data = pack(msg)
        result = await self._call(Op.CONTROL, 0, 0, 0, len(data), data, _MSG)
        if not isinstance(result, dict):
            raise ProtocolError(f"{self.label}: control reply is not a map")
        return result

    async def read_into(self, dst: Sequence[memoryview], segment: int, offset: int,
                        length: int) -> None:
        # length is the number of bytes asked for; READ carries no payload
        await self._call(Op.READ, 0, segment, offset, length, b"", _INTO, dst)

    async def read_narrow(self, dst: Sequence[memoryview], segment: int, offset: int,
                          length: int, code: int) -> None:
        if not self.server_info.get("narrow_read"):
            # (an older server: it would read the code-less bytes; narrowed here)
            return await super().read_narrow(dst, segment, offset, length, code)
        # the server narrows: ``length`` bytes cross the link, for twice as many of the segment
        await self._call(Op.READ, code << DTYPE_SHIFT, segment, offset, length, b"", _INTO, dst)

    async def write(self, src: Sequence[memoryview], segment: int, offset: int,
                    length: int) -> None:
        await self._call(Op.WRITE, 0, segment, offset, length, src, _EMPTY)

    async def accumulate(self, src: Sequence[memoryview], segment: int, offset: int,
                         length: int, dtype_code: int) -> None:
        await self._call(Op.ACCUMULATE, dtype_code << DTYPE_SHIFT, segment, offset, length,
                         src, _EMPTY)

    async def accumulate_sparse(self, payload: Sequence[memoryview], segment: int, offset: int,
                                flags: int) -> None:
        self.require_sparse()
        await self._call(Op.ACCUMULATE_SPARSE, flags, segment, offset, sum(len(p) for p in payload),
                         payload, _EMPTY)

    async def fetch_add(self, segment: int, offset: int, value: int) -> int:
        return int(await self._call(Op.FETCH_ADD, 0, segment, offset, 8,
                                    _core.pack_u64(value & MASK64), _U64))

    async def compare_swap(self, segment: int, offset: int, expected: int, new: int) -> int:
        return int(await self._call(Op.COMPARE_SWAP, 0, segment, offset, 16,
                                    _core.pack_u64x2(expected & MASK64, new & MASK64), _U64))

    async def accumulate_staged(self, segment: int, offset: int, staging_offset: int, length: int,
                                dtype_code: int) -> None:
        """Add ``length`` bytes that the client has already put into the
        server's staging area at ``staging_offset`` (an RDMA WRITE) to the
        segment at ``offset``: the server's CPU does the adding."""
        await self._call(Op.ACCUMULATE, (dtype_code << DTYPE_SHIFT) | FLAG_STAGED, segment, offset, 16,
                         _core.pack_u64x2(staging_offset, length), _EMPTY)

    async def accumulate_sparse_staged(self, segment: int, offset: int, staging_offset: int, length: int,
                                       flags: int) -> None:
        """A sparse accumulate whose ``length`` bytes of payload the client
        has already put into the server's staging area at ``staging_offset``."""
        self.require_sparse()
        await self._call(Op.ACCUMULATE_SPARSE, flags | FLAG_STAGED, segment, offset, 16,
                         _core.pack_u64x2(staging_offset, length), _EMPTY)

    async def write_fenced(self, src: Sequence[memoryview], segment: int, offset: int,
                           length: int, lock_key: int, token: int) -> None:
        # the fence travels as a 16-byte prefix of the payload, in the same
        # writev as the header and the data (which is not copied)
        parts: list[memoryview] = [memoryview(_core.pack_u64x2(lock_key & MASK64, token & MASK64))]
        parts.extend(src)
        await self._call(Op.WRITE, FLAG_FENCED, segment, offset, length + 16, parts, _EMPTY)

    async def replicated(self, op: int, flags: int, segment: int, offset: int,
                         payload: Sequence[memoryview | bytes]) -> int | None:
        parts = [p if isinstance(p, memoryview) else memoryview(p) for p in payload]
        atomic = op in (Op.FETCH_ADD, Op.COMPARE_SWAP)
        result = await self._call(op, flags | FLAG_REPLICATED, segment, offset, sum(len(p) for p in parts),
                                  parts, _U64 if atomic else _EMPTY)
        return int(result) if atomic else None

    # -- LockCapable: the server parks waiters (smb2.server.locks) -------------
    async def lock_acquire(self, segment: int, offset: int) -> tuple[int, bool]:
        # If the caller is cancelled (or times out) while waiting, the server
        # is told to give the ticket up (LOCK_CANCEL), and to release the lock
        # if the grant crossed the cancellation.
        await self._proto.drain()
        rid = self._new_id()
        fut = self._submit(rid, [_core.encode_header(VERSION, Op.LOCK_ACQUIRE, 0, 0, rid,
                                                     segment, offset, 0)], _GRANT, None, 0)
        try:
            ticket, queued = await fut
            return int(ticket), queued
        except asyncio.CancelledError:
            if not (fut.done() and not fut.cancelled() and fut.exception() is not None):
                self._lock_cancel(segment, offset, rid)
            raise

    def _lock_cancel(self, segment: int, offset: int, rid: int) -> None:
        if self._proto.transport is None:
            return          # connection gone: the server drops our tickets itself
        cid = self._new_id()
        try:
            fut = self._submit(cid, [_core.encode_header_with(
                VERSION, Op.LOCK_CANCEL, 0, 0, cid, segment, offset, 8, _core.pack_u64(rid))],
                _EMPTY, None, 0)
        except TransportError:
            return
        # nobody awaits the answer; retrieve a failure so it is not logged
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def lock_release(self, segment: int, offset: int, ticket: int) -> None:
        await self._call(Op.LOCK_RELEASE, 0, segment, offset, 8, _core.pack_u64(ticket & MASK64),
                         _EMPTY)

    def lock_release_nowait(self, segment: int, offset: int, ticket: int) -> None:
        # FLAG_NOREPLY: the frame leaves with this connection's next request,
        # or at the end of this loop iteration
        proto = self._proto
        if proto.transport is None:
            raise proto.lost or TransportError(f"connection to {self.label} is closed",
                                               errno=errno_mod.ENOTCONN, server=self.label)
        if not self._cork:
            asyncio.get_running_loop().call_soon(self.flush)
        # request id 0: no reply will name it
        self._cork.append(_core.encode_header_with(
            VERSION, Op.LOCK_RELEASE, FLAG_NOREPLY, 0, 0, segment, offset, 8,
            _core.pack_u64(ticket & MASK64)))

    def flush(self) -> None:
        """Send the releases held back for this loop iteration now."""
        t = self._proto.transport
        if self._cork and t is not None:
            t.write(b"".join(self._cork))
        self._cork.clear()

    def abort(self) -> None:
        """Drop the connection now (no waiting; pending ops fail)."""
        t = self._proto.transport
        if t is not None:
            t.abort()

    async def close(self) -> None:
        t = self._proto.transport
        if t is not None:
            t.close()
            # let connection_lost run so pending ops fail now, not later
            for _ in range(3):
                if self._proto.transport is None:
                    break
                await asyncio.sleep(0)
