"""The memory server: owns RAM as segments and serves them to clients.

listener -> :class:`_Connection` (frames, ``protocol.FrameReceiver``) ->
:class:`MemoryServer` (segments, capacity, stats).  The server never trusts a
client: every header is validated before anything is allocated, a refused
request gets an error reply, a malformed stream gets that one connection
closed with a reason, and nothing one client sends can stop the others.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ipaddress
import itertools
import logging
import mmap
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from . import _core, auth
from .errors import ErrorCode, InvalidArgumentError, PersistenceError, TransportError
from .persist import DataDir
from .protocol import (
    CLOSED,
    DATA_OPS,
    DEFAULT_MAX_FRAME,
    DEFAULT_PORT,
    DISCARD,
    DTYPE_MASK,
    DTYPE_SHIFT,
    FENCE_SIZE,
    FLAG_FENCED,
    FLAG_NOREPLY,
    FLAG_REPLY,
    FLAG_STAGED,
    INLINE,
    LOCK_OPS,
    LOCK_SEGMENT,
    MAX_ACCUMULATE,
    MAX_CONTROL,
    VERSION,
    Destination,
    FrameReceiver,
    Op,
    Prefix,
    accumulate_span,
    error_payload,
    pack,
    parse_size,
    unpack,
)
from .rdma_server import RdmaServer, RefusedError
from .server_locks import DEFAULT_LEASE, DEFAULT_SLOTS, DEFAULT_SPIN, MAX_SLOTS, MAX_SPIN, LockRefused, LockService

log = logging.getLogger("smb2.server")

MAX_NAME = 255
# accumulate deltas one connection may have waiting behind in-flight writes
MAX_DEFERRED = 2 * MAX_ACCUMULATE
DEFAULT_WRITE_TIMEOUT = 30.0
PAGE = mmap.PAGESIZE


class _Refused(Exception):
    """A request the server answers with an error code (internal)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class Segment:
    """One server's share of one buffer: page-aligned, zero-filled memory."""

    id: int
    name: str
    nbytes: int          # the whole buffer's size (geometry, for attach)
    stripe: int
    nservers: int
    index: int           # this server's position in the buffer's server list
    size: int            # bytes held here
    mem: np.ndarray      # uint8 over an anonymous mmap (page aligned, lazily backed)
    view: memoryview
    created: float = field(default_factory=time.time)
    # byte ranges of writes being received in place right now; an accumulate
    # that overlaps one waits for it, so that it is atomic w.r.t. writes
    inflight: list[tuple[int, int]] = field(default_factory=list)
    deferred: collections.deque[tuple[int, int, Callable[[], None]]] = field(
        default_factory=collections.deque)

    def info(self) -> dict[str, Any]:
        return {"segment": self.id, "name": self.name, "nbytes": self.nbytes,
                "stripe": self.stripe, "nservers": self.nservers,
                "index": self.index, "size": self.size}

    def overlaps_inflight(self, lo: int, hi: int) -> bool:
        return any(a < hi and lo < b for a, b in self.inflight)

    def write_done(self, rng: tuple[int, int]) -> None:
        self.inflight.remove(rng)
        if not self.deferred:
            return
        waiting: collections.deque[tuple[int, int, Callable[[], None]]] = collections.deque()
        while self.deferred:
            lo, hi, run = self.deferred.popleft()
            if self.overlaps_inflight(lo, hi):
                waiting.append((lo, hi, run))
            else:
                run()
        self.deferred = waiting


def _alloc(size: int) -> tuple[np.ndarray, memoryview]:
    # An anonymous mmap is page aligned (so RDMA can register it) and
    # zero-filled on first touch, so capacity is not committed up front.
    mm = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mem = np.frombuffer(mm, dtype=np.uint8, count=size)
    return mem, memoryview(mm)[:size]


class MemoryServer:
    """Segments, capacity, connections and statistics of one memory server.

    Create it with :func:`start_server`; ``address`` is ``(host, port)``."""

    def __init__(self, *, capacity: int | str = "1GiB", max_frame: int = DEFAULT_MAX_FRAME,
                 max_buffers: int = 4096, token: str | bytes | None = None,
                 data_dir: str | os.PathLike[str] | None = None,
                 write_timeout: float = DEFAULT_WRITE_TIMEOUT, lock_lease: float = DEFAULT_LEASE,
                 lock_slots: int = DEFAULT_SLOTS, lock_spin: float = DEFAULT_SPIN, rdma: str = "auto",
                 rdma_device: str | None = None,
                 rdma_gid_index: int | None = None) -> None:
        if rdma not in ("auto", "on", "off"):
            raise InvalidArgumentError(f"rdma must be auto, on or off, not {rdma!r}")
        self.capacity = parse_size(capacity)
        # a connection that stops sending in the middle of a WRITE is closed
        # after this long: its half-received range holds up every accumulate
        # that overlaps it (see Segment.inflight)
        self.write_timeout = write_timeout
        self._sweeper: asyncio.Task[None] | None = None
        # segments are saved here on close and restored on start (persist.py)
        self.data_dir = DataDir(data_dir) if data_dir is not None else None
        # the shared secret clients must prove they know (None: no authentication)
        self.token = auth.as_token(token)
        self.auth_failures = 0
        self.max_frame = max_frame
        self.max_buffers = max_buffers
        self.used = 0
        self.segments: dict[int, Segment] = {}
        self.by_name: dict[str, Segment] = {}
        self._ids = itertools.count(1)
        self.connections: set[_Connection] = set()
        self.started = time.time()
        # data operations this server's CPU executed, per transport and op
        self.ops: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.bytes_in = 0
        self.bytes_out = 0
        self.refused = 0
        self._server: asyncio.AbstractServer | None = None
        self.address: tuple[str, int] = ("", 0)
        self.server_id = os.urandom(8).hex()
        # the lock segment: lock words in memory an RDMA transport registers
        # like a buffer's segment (server_locks.py)
        if not 0 < lock_slots <= MAX_SLOTS:
            raise InvalidArgumentError(f"lock slots must be in 1..{MAX_SLOTS}, not {lock_slots}")
        mem, view = _alloc(lock_slots * _core.LOCK_SLOT_SIZE)
        self.segments[LOCK_SEGMENT] = Segment(LOCK_SEGMENT, "", 0, 8, 1, 0, len(view), mem, view)
        self.locks = LockService(self, mem, view, slots=lock_slots, lease=lock_lease,
                                 spin=lock_spin)
        # RDMA (rdma_server.py): opened at start() unless rdma="off"
        self._rdma_args = (rdma, rdma_device, rdma_gid_index)
        self.rdma: RdmaServer | None = None
        self.rdma_reason: str | None = "not started"

    # -- lifecycle --------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
        mode, device, gid_index = self._rdma_args
        if mode == "off":
            self.rdma_reason = "the server runs with rdma off"
        elif self.rdma is None:
            self.rdma, self.rdma_reason = RdmaServer.open(device, gid_index)
            if self.rdma is None and mode == "on":
                raise TransportError(f"rdma=on, but RDMA is not available: {self.rdma_reason}")
            log.info("RDMA: %s", self.rdma.describe() if self.rdma else f"off ({self.rdma_reason})")
        loop = asyncio.get_running_loop()
        if self.data_dir is not None:
            # restored before listening: no client ever sees the server empty
            self.data_dir.acquire()
            try:
                self.data_dir.load(self)
            except BaseException:
                self.data_dir.release()
                raise
        if self.rdma is not None:
            # segments made before RDMA was open (the lock segment, restored
            # buffers) are registered now; create() registers later ones
            for seg in self.segments.values():
                if seg.id not in self.rdma.mrs:
                    access = self.rdma.lock_access if seg.id == LOCK_SEGMENT else None
                    self.rdma.register(seg.id, seg.view, access)
        try:
            self._server = await loop.create_server(
                lambda: _Connection(self), host, port, reuse_address=True)
        except BaseException:
            if self.data_dir is not None:
                self.data_dir.release()
            raise
        sock = self._server.sockets[0]
        self.address = sock.getsockname()[:2]
        if self.token is None and not _is_loopback(host):
            log.warning("listening on %s without an authentication token: anyone who can reach "
                        "this port can read and write its memory (--auth-token-file or %s)",
                        host or "all addresses", auth.ENV)
        if self.write_timeout > 0:
            self._sweeper = asyncio.create_task(self._sweep())
        self.locks.start()
        log.info("listening on %s:%d (capacity %d bytes)", *self.address, self.capacity)

    async def _sweep(self) -> None:
        period = min(1.0, self.write_timeout / 4)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for conn in list(self.connections):
                if conn.stalled_write(now, self.write_timeout):
                    conn.close_with(f"no data for {self.write_timeout:g} s in the middle of a write")

    def set_next_id(self, next_id: int) -> None:
        self._ids = itertools.count(next_id)

    async def close(self) -> None:
        """Stop listening, drop every connection, save the segments (with a
        data directory), release all segments."""
        if self._server is not None:
            self._server.close()
            for conn in list(self.connections):
                conn.abort("server shutting down")
            await self._server.wait_closed()
            if self._sweeper is not None:
                self._sweeper.cancel()
                self._sweeper = None
            self._server = None
            if self.data_dir is not None:
                # nothing can change the segments any more: save them
                try:
                    self.data_dir.save(self)
                except OSError as exc:
                    # the previous manifest is intact: the last good state survives
                    raise PersistenceError(f"cannot save the segments to {self.data_dir.path}: "
                                           f"{exc}") from exc
                finally:
                    self.data_dir.release()
        await self.locks.close()
        if self.rdma is not None:
            self.rdma.close()
            self.rdma = None
        self.segments.clear()
        self.by_name.clear()
        self.used = 0

    async def __aenter__(self) -> MemoryServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- control commands ----------------------------------------------
    def create(self, name: str, nbytes: int, stripe: int, nservers: int, index: int) -> dict[str, Any]:
        if not 0 < len(name.encode()) <= MAX_NAME:
            raise _Refused(ErrorCode.BAD_REQUEST, f"buffer names are 1..{MAX_NAME} bytes")
        if nbytes <= 0 or stripe <= 0 or stripe % 8 or nservers <= 0 or not 0 <= index < nservers:
            raise _Refused(ErrorCode.BAD_REQUEST, "bad buffer geometry")
        size = _core.segment_size(nbytes, stripe, nservers)
        seg = self.by_name.get(name)
        if seg is not None:
            same = (seg.nbytes, seg.stripe, seg.nservers, seg.index) == (nbytes, stripe, nservers, index)
            if not same:
                raise _Refused(
                    ErrorCode.CONFLICT,
                    f"buffer {name!r} exists with nbytes={seg.nbytes} stripe={seg.stripe} "
                    f"over {seg.nservers} servers (this server #{seg.index}); asked for "
                    f"nbytes={nbytes} stripe={stripe} over {nservers} servers (#{index})")
            return {**seg.info(), "created": False}
        if len(self.by_name) >= self.max_buffers:      # the lock segment is not a buffer
            raise _Refused(ErrorCode.OUT_OF_MEMORY, f"server holds its maximum of {self.max_buffers} buffers")
        if self.used + size > self.capacity:
            raise _Refused(ErrorCode.OUT_OF_MEMORY,
                           f"buffer {name!r} needs {size} bytes on this server; "
                           f"{self.capacity - self.used} of {self.capacity} are free")
        try:
            mem, view = _alloc(size)
        except (OSError, MemoryError, OverflowError) as exc:
            raise _Refused(ErrorCode.OUT_OF_MEMORY, f"cannot map {size} bytes: {exc}") from None
        seg = Segment(next(self._ids), name, nbytes, stripe, nservers, index, size, mem, view)
        if self.rdma is not None:
            try:
                self.rdma.register(seg.id, view)     # once, for the segment's lifetime
            except RefusedError as exc:
                raise _Refused(exc.code, str(exc)) from None
        self.segments[seg.id] = seg
        self.by_name[name] = seg
        self.used += size
        log.debug("created buffer %r: segment %d, %d bytes", name, seg.id, size)
        return {**seg.info(), "created": True}

    def lookup(self, name: str) -> dict[str, Any]:
        seg = self.by_name.get(name)
        if seg is None:
            raise _Refused(ErrorCode.NO_SUCH_BUFFER, f"no buffer named {name!r}")
        return seg.info()

    def destroy(self, name: str) -> dict[str, Any]:
        seg = self.by_name.pop(name, None)
        if seg is None:
            return {"destroyed": False}
        del self.segments[seg.id]
        self.used -= seg.size
        if self.rdma is not None:
            # in-flight RDMA to it now fails with a remote access error
            self.rdma.deregister(seg.id)
        # The memory is released when the last view of it is gone (a reply
        # still being sent may hold one).
        return {"destroyed": True}

    def stat(self) -> dict[str, Any]:
        return {
            "server_id": self.server_id,
            "address": f"{self.address[0]}:{self.address[1]}",
            "version": VERSION,
            "uptime_s": round(time.time() - self.started, 3),
            "capacity": self.capacity,
            "used": self.used,
            "buffers": {s.name: {"segment": s.id, "size": s.size, "nbytes": s.nbytes,
                                 "stripe": s.stripe, "nservers": s.nservers, "index": s.index}
                        for s in self.segments.values() if s.id != LOCK_SEGMENT},
            "connections": len(self.connections),
            "ops": {t: dict(c) for t, c in self.ops.items()},
            "transports": ["tcp", "rdma"] if self.rdma else ["tcp"],
            "rdma": self.rdma.describe() if self.rdma else {"off": self.rdma_reason},
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "refused": self.refused,
            "auth": auth.MECH if self.token is not None else None,
            "auth_failures": self.auth_failures,
            "locks": self.locks.stat(),
        }


def _accumulate_span(flags: int, offset: int, length: int) -> int:
    try:
        return accumulate_span(flags, offset, length)
    except ValueError as exc:
        raise _Refused(ErrorCode.BAD_REQUEST, str(exc)) from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False     # "" (all addresses), a host name: treat as exposed


def _str(msg: dict[str, Any], key: str) -> str:
    v = msg.get(key)
    if not isinstance(v, str):
        raise _Refused(ErrorCode.BAD_REQUEST, f"control field {key!r} must be a string")
    return v


def _uint(msg: dict[str, Any], key: str) -> int:
    v = msg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v >= 1 << 63:
        raise _Refused(ErrorCode.BAD_REQUEST, f"control field {key!r} must be a non-negative integer")
    return v


_FENCE = Prefix(FENCE_SIZE)
# the statistics' name of each op, looked up once per frame
_STAT_NAME = {int(op): op.name.lower() for op in Op}


class _Connection(FrameReceiver):
    """One client connection: validates frames and executes them."""

    transport_name = "tcp"

    def __init__(self, server: MemoryServer) -> None:
        super().__init__()
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.greeted = False
        # set by a valid ``auth`` (or by ``hello`` when the server has no token);
        # until then only auth.PUBLIC_COMMANDS are answered
        self.authed = False
        self._nonce = b""
        self._paused = False
        self._uvloop = False
        # the write whose payload is being received in place: (segment, range)
        self._write: tuple[Segment, tuple[int, int]] | None = None
        # bytes of accumulate deltas waiting for an overlapping write
        self._deferred_bytes = 0
        self._last_rx = 0.0
        # small replies made while one receive is parsed, sent with one write
        # (a pipelined LOCK_RELEASE + LOCK_ACQUIRE costs one syscall, not two)
        self._cork: list[bytes] | None = None
        # this client's queue pair and staging area, after rdma_connect
        self.rdma_peer: Any = None

    # -- asyncio -----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._uvloop = type(asyncio.get_running_loop()).__module__.startswith("uvloop")
        self._last_rx = asyncio.get_running_loop().time()
        self.server.connections.add(self)
        log.debug("connection from %s", self.peer)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.server.locks.connection_lost(self)
        if self._write is not None:
            seg, rng = self._write
            self._write = None
            seg.write_done(rng)
        if self.rdma_peer is not None and self.server.rdma is not None:
            self.server.rdma.drop(self.rdma_peer)
        self.rdma_peer = None
        self.transport = None
        log.debug("connection from %s closed%s", self.peer, f": {exc}" if exc else "")

    def stalled_write(self, now: float, timeout: float) -> bool:
        """In the middle of a WRITE, not paused by us, and silent too long."""
        return (self._write is not None and not self._paused and self.transport is not None
                and now - self._last_rx > timeout)

    # Flow control: a client that does not read its replies stops being read
    # and parsed, so one connection's memory stays bounded by the transport's
    # high-water mark plus one reply (at most max_frame).
    def pause_writing(self) -> None:
        self._hold_input("writing")

    def resume_writing(self) -> None:
        self._unhold_input("writing")

    def _hold_input(self, reason: str) -> None:
        if self.transport is None:
            return
        if not self.held:
            self._paused = True
            self.transport.pause_reading()
        self.hold(reason)

    def _unhold_input(self, reason: str) -> None:
        if self.transport is None or reason not in self._holds:
            return
        if len(self._holds) == 1:
            self._paused = False
            self.transport.resume_reading()
        self.unhold(reason)      # parses what waited in the inbox

    def abort(self, reason: str) -> None:
        if self.transport is not None:
            log.debug("closing %s: %s", self.peer, reason)
            self.transport.abort()

    # -- replies -----------------------------------------------------------
    def buffer_updated(self, nbytes: int) -> None:
        self._last_rx = asyncio.get_running_loop().time()     # see stalled_write
        self._cork = []
        try:
            super().buffer_updated(nbytes)
        finally:
            self._uncork()

    def _uncork(self) -> None:
        cork, self._cork = self._cork, None
        t = self.transport
        if cork and t is not None and not t.is_closing():
            t.write(cork[0] if len(cork) == 1 else b"".join(cork))

    def _reply(self, hdr: tuple[int, ...], payload: bytes | memoryview = b"",
               status: int = 0, flags: int = 0) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        n = len(payload)
        self.server.bytes_out += n
        if n <= 65536:
            frame = _core.encode_header_with(VERSION, hdr[2], FLAG_REPLY | flags, status, hdr[5],
                                             hdr[6], hdr[7], n, payload)
            if self._cork is not None:
                self._cork.append(frame)
            else:
                t.write(frame)
            return
        if self._cork:
            # keep the order of replies: the corked ones go first
            cork, self._cork = self._cork, []
            t.write(b"".join(cork))
        head = _core.encode_header(VERSION, hdr[2], FLAG_REPLY | flags, status, hdr[5], hdr[6], hdr[7], n)
        if self._uvloop:
            t.writelines((head, payload))       # one writev, payload not copied
        else:
            t.write(head)
            t.write(payload)

    def _refuse(self, hdr: tuple[int, ...], code: ErrorCode, message: str) -> None:
        self.server.refused += 1
        if hdr[3] & FLAG_NOREPLY:
            # the client asked for no answer (a lock release): none, not even this
            log.info("refused a request from %s that wants no reply: %s", self.peer, message)
            return
        self._reply(hdr, error_payload(message), status=code)

    def close_with(self, reason: str, hdr: tuple[int, ...] | None = None,
                   code: ErrorCode = ErrorCode.BAD_REQUEST) -> None:
        """Answer with the reason (so the client can tell why), then close."""
        super().close_with(reason)
        if self._cork is not None:
            self._uncork()
            self._cork = []
        self.server.refused += 1
        log.info("closing connection from %s: %s", self.peer, reason)
        t = self.transport
        if t is not None and not t.is_closing():
            h = hdr if hdr is not None else (0, 0, 0, 0, 0, 0, 0, 0, 0)
            t.write(_core.encode_header_with(VERSION, h[2] & 0xFF, FLAG_REPLY, code, h[5], 0, 0,
                                             len(p := error_payload(reason)), p))
            t.close()

    # -- frames --------------------------------------------------------
    def payload_size(self, hdr: tuple[int, ...]) -> int:
        return 0 if hdr[2] == Op.READ else hdr[8]

    def on_header(self, hdr: tuple[int, ...], size: int) -> Destination:
        _, version, op, flags, _, _, segment, offset, length = hdr
        if version != VERSION:
            self.close_with(f"protocol version {version} not supported (server speaks {VERSION})",
                            hdr, ErrorCode.VERSION_MISMATCH)
            return CLOSED
        if flags & FLAG_REPLY:
            self.close_with("a client sent a reply frame", hdr)
            return CLOSED
        if op == Op.CONTROL:
            if size > MAX_CONTROL:
                self.close_with(f"control message of {size} bytes (limit {MAX_CONTROL})",
                                hdr, ErrorCode.TOO_LARGE)
                return CLOSED
            return INLINE
        if op not in DATA_OPS and op not in LOCK_OPS:
            self.close_with(f"unknown op {op}", hdr)
            return CLOSED
        if size > self.server.max_frame or (op == Op.READ and length > self.server.max_frame):
            self.close_with(f"frame of {length} bytes exceeds the limit of "
                            f"{self.server.max_frame}", hdr, ErrorCode.TOO_LARGE)
            return CLOSED
        if op == Op.ACCUMULATE and size > MAX_ACCUMULATE:
            self.close_with(f"accumulate of {size} bytes exceeds the limit of {MAX_ACCUMULATE}",
                            hdr, ErrorCode.TOO_LARGE)
            return CLOSED
        if not self.authed:
            if not self.greeted:
                self.close_with("the first request must be hello", hdr)
            else:
                self.close_with("not authenticated", hdr, ErrorCode.ACCESS_DENIED)
            return CLOSED
        try:
            if op in LOCK_OPS:
                try:
                    self.server.locks.check_header(hdr, size)
                except LockRefused as exc:
                    raise _Refused(exc.code, str(exc)) from None
                return INLINE
            # (before the staged case, which names its segment in the header too)
            if segment == LOCK_SEGMENT and op in (Op.WRITE, Op.ACCUMULATE):
                raise _Refused(ErrorCode.ACCESS_DENIED, "the lock segment only takes READ and atomics")
            if op == Op.ACCUMULATE and flags & FLAG_STAGED:
                # payload: u64 staging offset, u64 length (checked in on_frame)
                if size != 16 or self.rdma_peer is None:
                    raise _Refused(ErrorCode.BAD_REQUEST, "a staged accumulate needs rdma_connect "
                                   "and a 16-byte payload")
                return INLINE
            atomic = op in (Op.FETCH_ADD, Op.COMPARE_SWAP)
            if op == Op.WRITE and flags & FLAG_FENCED:
                if length < FENCE_SIZE:
                    raise _Refused(ErrorCode.BAD_REQUEST, "a fenced WRITE starts with a 16-byte fence")
                self._segment(segment, offset, length - FENCE_SIZE)
                return _FENCE
            # an accumulate's range: validated (dtype, alignment) before its bounds
            span = _accumulate_span(flags, offset, length) if op == Op.ACCUMULATE else length
            seg = self._segment(segment, offset, 8 if atomic else span)
            if op == Op.WRITE:
                rng = (offset, offset + length)
                seg.inflight.append(rng)
                self._write = (seg, rng)
                return [seg.view[offset:offset + length]] if length else INLINE
            if atomic:
                want = 8 if op == Op.FETCH_ADD else 16
                if offset % 8 or size != want:
                    raise _Refused(ErrorCode.BAD_REQUEST,
                                   "atomics act on one 8-byte aligned word")
        except _Refused as exc:
            self._refuse(hdr, exc.code, str(exc))
            return DISCARD
        return INLINE

    def on_prefix(self, hdr: tuple[int, ...], prefix: memoryview, rest: int) -> Destination:
        # a fenced WRITE: check the fence before a byte of data lands
        key, token = _core.unpack_u64(prefix, 0), _core.unpack_u64(prefix, 8)
        if not self.server.locks.check_fence(key, token):
            self._refuse(hdr, ErrorCode.STALE_FENCE,
                         f"write fenced with token {token} refused: the lock was lost "
                         "(lease expired, released, or a newer holder wrote here)")
            return DISCARD
        seg = self.server.segments.get(hdr[6])
        if seg is None:     # destroyed between header and prefix
            self._refuse(hdr, ErrorCode.NO_SUCH_BUFFER, f"no segment {hdr[6]}")
            return DISCARD
        offset = hdr[7]
        rng = (offset, offset + rest)
        seg.inflight.append(rng)
        self._write = (seg, rng)
        return [seg.view[offset:offset + rest]] if rest else INLINE

    def _segment(self, segment: int, offset: int, length: int) -> Segment:
        seg = self.server.segments.get(segment)
        if seg is None:
            raise _Refused(ErrorCode.NO_SUCH_BUFFER, f"no segment {segment} (destroyed, or the server restarted)")
        if offset > seg.size or length > seg.size - offset:
            raise _Refused(ErrorCode.OUT_OF_BOUNDS,
                           f"range [{offset}, {offset + length}) is outside segment {segment} of {seg.size} bytes")
        return seg

    def on_frame(self, hdr: tuple[int, ...], payload: memoryview | None) -> None:
        op = hdr[2]
        try:
            if op == Op.CONTROL:
                assert payload is not None
                self._control(hdr, payload)
                return
            stats = self.server.ops[self.transport_name]
            stats[_STAT_NAME[op]] += 1
            if op in LOCK_OPS:
                assert payload is not None
                try:
                    self.server.locks.on_frame(self, hdr, payload)
                except LockRefused as exc:
                    raise _Refused(exc.code, str(exc)) from None
                return
            seg = self.server.segments.get(hdr[6])
            offset, length = hdr[7], hdr[8]
            if hdr[3] & FLAG_FENCED:
                length -= FENCE_SIZE
            if op == Op.READ:
                assert seg is not None
                self._reply(hdr, seg.view[offset:offset + length])
            elif op == Op.WRITE:
                self.server.bytes_in += length
                if self._write is not None:
                    wseg, rng = self._write
                    self._write = None
                    if payload is not None and length:
                        _core.copy_into(wseg.view[offset:offset + length], payload)
                    wseg.write_done(rng)
                self._reply(hdr)
            elif op == Op.ACCUMULATE and hdr[3] & FLAG_STAGED:
                assert payload is not None
                self._accumulate_staged(hdr, payload)
            elif op == Op.ACCUMULATE:
                assert seg is not None and payload is not None
                self.server.bytes_in += length
                self._accumulate(hdr, seg, payload)
            elif op == Op.FETCH_ADD:
                assert seg is not None and payload is not None
                word = seg.mem[offset:offset + 8].view(np.uint64)
                old = int(word[0])
                word[0] = (old + _core.unpack_u64(payload)) & 0xFFFFFFFFFFFFFFFF
                self._reply(hdr, _core.pack_u64(old))
                if seg.id == LOCK_SEGMENT:
                    self.server.locks.touched(offset)
            elif op == Op.COMPARE_SWAP:
                assert seg is not None and payload is not None
                word = seg.mem[offset:offset + 8].view(np.uint64)
                old = int(word[0])
                if old == _core.unpack_u64(payload, 0):
                    word[0] = _core.unpack_u64(payload, 8)
                self._reply(hdr, _core.pack_u64(old))
                if seg.id == LOCK_SEGMENT:
                    self.server.locks.touched(offset)
        except _Refused as exc:
            self._refuse(hdr, exc.code, str(exc))
        except Exception as exc:  # a bug must cost one request, not the server
            log.exception("internal error handling op %d from %s", op, self.peer)
            self._refuse(hdr, ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")

    def _accumulate(self, hdr: tuple[int, ...], seg: Segment, payload: memoryview) -> None:
        # ``length`` is the payload's; a widening dtype covers twice that (validated)
        offset, length = hdr[7], hdr[8]
        code = (hdr[3] & DTYPE_MASK) >> DTYPE_SHIFT
        end = offset + accumulate_span(hdr[3], offset, length)
        if seg.overlaps_inflight(offset, end):
            delta = bytes(payload)       # the inbox is reused: keep a copy
            # Waiting accumulates hold copies of their deltas: bound them per
            # connection (a write that never completes must not let a client
            # queue unbounded memory behind it).
            self._deferred_bytes += length
            if self._deferred_bytes > MAX_DEFERRED:
                self._hold_input("deferred")

            def run() -> None:
                if seg.id in self.server.segments:
                    _core.accumulate(seg.view[offset:end], delta, code)
                self._deferred_bytes -= length
                self._reply(hdr)
                if self._deferred_bytes <= MAX_DEFERRED and "deferred" in self._holds:
                    # not from here: this runs inside another connection's
                    # frame handling, and parsing ours now would nest them
                    asyncio.get_running_loop().call_soon(self._unhold_input, "deferred")
            seg.deferred.append((offset, end, run))
            return
        _core.accumulate(seg.view[offset:end], payload, code)
        self._reply(hdr)

    def _accumulate_staged(self, hdr: tuple[int, ...], payload: memoryview) -> None:
        # The delta was RDMA-written into this connection's staging area.
        # ``length`` is the staged delta's; a widening dtype covers twice that
        soff, length = _core.unpack_u64(payload, 0), _core.unpack_u64(payload, 8)
        seg = self._segment(hdr[6], hdr[7], _accumulate_span(hdr[3], hdr[7], length))
        try:
            delta = self.rdma_peer.staged(soff, length)
        except RefusedError as exc:
            raise _Refused(exc.code, str(exc)) from None
        self._accumulate((*hdr[:8], length), seg, delta)

    def _control(self, hdr: tuple[int, ...], payload: memoryview) -> None:
        try:
            msg = unpack(payload)
        except ValueError as exc:
            raise _Refused(ErrorCode.BAD_REQUEST, str(exc)) from None
        if not isinstance(msg, dict):
            raise _Refused(ErrorCode.BAD_REQUEST, "a control message is a msgpack map")
        cmd = msg.get("cmd")
        srv = self.server
        if cmd == "hello":
            version = msg.get("version")
            if version != VERSION:
                self.close_with(f"client speaks protocol version {version!r}, server {VERSION}",
                                hdr, ErrorCode.VERSION_MISMATCH)
                return
            self.greeted = True
            result: dict[str, Any] = {
                "version": VERSION, "server_id": srv.server_id, "capacity": srv.capacity,
                "max_frame": srv.max_frame,
                "transports": ["tcp", "rdma"] if srv.rdma else ["tcp"]}
            if srv.rdma is None:
                result["rdma_off"] = srv.rdma_reason
            if srv.token is None:
                self.authed = True
            elif not self.authed:
                self._nonce = auth.new_nonce()
                result.update(auth=auth.MECH, nonce=self._nonce)
        elif not self.greeted:
            self.close_with("the first request must be hello", hdr)
            return
        elif cmd == "auth":
            result = self._auth(hdr, msg)
            if not result:
                return
        elif not self.authed:
            # the one gate: whatever a later branch adds to the control
            # commands (RDMA keys, addresses) is unreachable before auth
            raise _Refused(ErrorCode.ACCESS_DENIED, f"{cmd!r} needs authentication first")
        elif cmd == "create":
            result = srv.create(_str(msg, "name"), _uint(msg, "nbytes"), _uint(msg, "stripe"),
                                _uint(msg, "nservers"), _uint(msg, "index"))
            if srv.rdma is not None:
                result.update(srv.rdma.segment_info(result["segment"]))
        elif cmd == "lookup":
            result = srv.lookup(_str(msg, "name"))
            if srv.rdma is not None:
                result.update(srv.rdma.segment_info(result["segment"]))
        elif cmd == "rdma_segment":
            seg = srv.segments.get(_uint(msg, "segment"))
            if seg is None:
                raise _Refused(ErrorCode.NO_SUCH_BUFFER, f"no segment {msg['segment']} "
                               "(destroyed, or the server restarted)")
            result = {**seg.info(), **(srv.rdma.segment_info(seg.id) if srv.rdma else {})}
        elif cmd == "rdma_connect":
            if srv.rdma is None:
                raise _Refused(ErrorCode.UNSUPPORTED, f"this server has no RDMA: {srv.rdma_reason}")
            try:
                peer, result = srv.rdma.connect(msg)
            except RefusedError as exc:
                raise _Refused(exc.code, str(exc)) from None
            if self.rdma_peer is not None:
                srv.rdma.drop(self.rdma_peer)
            self.rdma_peer = peer
            # from now on this connection's server-side work counts as rdma's
            self.transport_name = "rdma"
        elif cmd == "destroy":
            result = srv.destroy(_str(msg, "name"))
        elif cmd == "list":
            result = {"buffers": sorted(srv.by_name)}
        elif cmd == "stat":
            result = srv.stat()
        elif cmd == "lock_open":
            lease = msg.get("lease")
            try:
                result = srv.locks.open(_str(msg, "name"), lease)
            except LockRefused as exc:
                raise _Refused(exc.code, str(exc)) from None
        elif cmd == "lock_abandon":
            try:
                result = srv.locks.abandon(_uint(msg, "offset"), _uint(msg, "ticket"))
            except LockRefused as exc:
                raise _Refused(exc.code, str(exc)) from None
        else:
            raise _Refused(ErrorCode.BAD_REQUEST, f"unknown control command {cmd!r}")
        self._reply(hdr, pack(result))

    def _auth(self, hdr: tuple[int, ...], msg: dict[str, Any]) -> dict[str, Any]:
        srv = self.server
        if srv.token is None:
            raise _Refused(ErrorCode.BAD_REQUEST, "this server does not use authentication")
        if self.authed:
            raise _Refused(ErrorCode.BAD_REQUEST, "already authenticated")
        nonce = msg.get("nonce")
        ok = (isinstance(nonce, bytes) and len(nonce) == auth.NONCE_SIZE
              and auth.check(auth.client_proof(srv.token, self._nonce, nonce), msg.get("proof")))
        if not ok:
            # one try per challenge: a guesser must reconnect for each
            srv.auth_failures += 1
            log.warning("authentication failed from %s", self.peer)
            self.close_with("authentication failed: wrong token", hdr, ErrorCode.ACCESS_DENIED)
            return {}
        assert isinstance(nonce, bytes)
        self.authed = True
        log.debug("%s authenticated", self.peer)
        return {"proof": auth.server_proof(srv.token, self._nonce, nonce)}


async def start_server(host: str = "127.0.0.1", port: int = DEFAULT_PORT, **options: Any) -> MemoryServer:
    """Start a memory server in the running loop and return it once it listens.

    ``options`` are :class:`MemoryServer`'s keyword arguments (capacity,
    token, data_dir, lock_lease, lock_spin, rdma, ...).  ``port=0`` picks a
    free port (see ``server.address``).  With ``token``, clients must
    authenticate (``smb2.connect(..., token=...)``).  With ``data_dir``, the
    segments saved there are restored now and saved again by ``close()``.
    ``rdma``: "auto" (serve RDMA where this machine can), "on" (fail if it
    cannot), "off"."""
    server = MemoryServer(**options)
    await server.start(host, port)
    return server


# --------------------------------------------------------------------------
# smb2-server


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smb2-server",
        description="Serve this machine's memory as smb2 segments.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0 = any free)")
    p.add_argument("--capacity", default="1GiB", help="memory to serve, e.g. 512MiB, 8GiB (default 1GiB)")
    p.add_argument("--max-frame", default=str(DEFAULT_MAX_FRAME),
                   help="largest payload of one request (default 64MiB)")
    p.add_argument("--auth-token-file", metavar="FILE",
                   help=f"require clients to prove they know the token in FILE "
                        f"(default: ${auth.ENV} if set, else no authentication)")
    p.add_argument("--max-buffers", type=int, default=4096, help="buffers this server holds at most (default 4096)")
    p.add_argument("--write-timeout", type=float, default=DEFAULT_WRITE_TIMEOUT,
                   help="close a connection silent this many seconds in the middle of a write "
                        f"(default {DEFAULT_WRITE_TIMEOUT:g}; 0 = never)")
    p.add_argument("--data-dir", metavar="DIR",
                   help="save the segments to DIR on SIGTERM/SIGINT and restore them at start")
    p.add_argument("--lock-lease", type=float, default=DEFAULT_LEASE,
                   help=f"seconds a lock holder may go without renewing (default {DEFAULT_LEASE:g})")
    p.add_argument("--lock-slots", type=int, default=DEFAULT_SLOTS,
                   help=f"locks this server can hold (default {DEFAULT_SLOTS})")
    p.add_argument("--lock-spin", type=float, default=DEFAULT_SPIN,
                   help="while lock waiters are parked, poll instead of sleeping for up to this many "
                        f"seconds after each grant (default {DEFAULT_SPIN:g}; 0 = never, at most {MAX_SPIN:g})")
    p.add_argument("--rdma", choices=("auto", "on", "off"), default="auto",
                   help="serve RDMA: auto (where a device is usable; default), on, off")
    p.add_argument("--rdma-device", default=None, help="RDMA device name (default: the first ACTIVE one)")
    p.add_argument("--rdma-gid-index", type=int, default=None,
                   help="GID index (default: the port's IPv4 RoCE v2 GID)")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop (default uvloop)")
    p.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")
    return p


async def _serve(args: argparse.Namespace) -> None:
    server = await start_server(args.host, args.port, capacity=args.capacity,
                                max_frame=parse_size(args.max_frame), max_buffers=args.max_buffers,
                                token=args.token, write_timeout=args.write_timeout,
                                data_dir=args.data_dir, lock_lease=args.lock_lease,
                                lock_slots=args.lock_slots, lock_spin=args.lock_spin, rdma=args.rdma,
                                rdma_device=args.rdma_device, rdma_gid_index=args.rdma_gid_index)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    host, port = server.address
    print(f"smb2-server listening on {host}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()
        log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        parse_size(args.capacity)
        parse_size(args.max_frame)
        args.token = (auth.token_from_file(args.auth_token_file) if args.auth_token_file
                      else auth.token_from_env())
    except InvalidArgumentError as exc:
        print(f"smb2-server: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"smb2-server: cannot read the token file: {exc}", file=sys.stderr)
        return 2
    try:
        if args.loop == "uvloop":
            import uvloop
            uvloop.run(_serve(args))
        else:
            asyncio.run(_serve(args))
    except InvalidArgumentError as exc:     # an option out of range
        print(f"smb2-server: {exc}", file=sys.stderr)
        return 2
    except (PersistenceError, TransportError) as exc:
        print(f"smb2-server: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"smb2-server: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
