"""One client connection of the memory server: the link.

It reads frames (``protocol.FrameReceiver``) and checks each header before
anything is allocated; it answers (corked: the small replies of one receive
go out in one write); and it bounds what the client can take: a client that
does not read its replies stops being read, requests answered later count up
to ``max_inflight``, payload memory comes from the server's pool.  What the
frames ask for is done by :class:`~smb2.server.dataops.DataOps` (data ops)
and :class:`~smb2.server.control.Control` (control messages).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any, cast

from .. import _core
from ..errors import ErrorCode
from ..protocol import (
    CLOSED,
    DISCARD,
    FLAG_NOREPLY,
    FLAG_REPLY,
    H_FLAGS,
    H_LENGTH,
    H_OFFSET,
    H_OP,
    H_REQUEST,
    H_SEGMENT,
    H_VERSION,
    INLINE,
    MAX_ACCUMULATE,
    MAX_CONTROL,
    REPL_FLAGS,
    REPL_PREFIX_SIZE,
    VERSION,
    Destination,
    FrameReceiver,
    Header,
    Op,
    error_payload,
    pack,
)
from .control import Control
from .dataops import DataOps
from .segment import Refused

log = logging.getLogger("smb2.server")

# Before a connection has authenticated it holds a small inbox and may send
# nothing larger than a hello or an auth message (both are ~100 bytes).
PREAUTH_INBOX = 8 << 10
PREAUTH_MAX_CONTROL = 4 << 10
# A reply payload up to this size is copied behind its header into one
# frame (one write, and corked with its neighbours); a larger one goes out
# as header + payload in one writev, not copied.
COPY_REPLY_MAX = 64 << 10
# close_with without a request to answer: the reason goes out as a reply to
# request id 0 of op 0, which the client reads as the connection's last word
NO_REQUEST: Header = (0,) * 9
# the ops that add their payload: held whole in scratch, so bounded alike
ACCUMULATES = frozenset({Op.ACCUMULATE, Op.ACCUMULATE_SPARSE})


class Connection(FrameReceiver):
    """One client connection: validates frames and executes them."""

    transport_name = "tcp"

    def __init__(self, server: Any) -> None:
        super().__init__()
        self.inbox_size = PREAUTH_INBOX      # the full inbox once authenticated
        # the MemoryServer (memory.py, which imports this module)
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.host = "?"
        self.greeted = False
        # set by a valid ``auth`` (or by ``hello`` when the server has no token);
        # until then only auth.PUBLIC_COMMANDS are answered
        self.authed = False
        self._paused = False
        self._uvloop = False
        self._last_rx = 0.0
        self._opened = 0.0
        # bytes received, and (time, bytes) when payload progress was last seen
        self._rx_bytes = 0
        self._progress: tuple[float, int] = (0.0, 0)
        # requests answered later than their frame (parked lock acquires,
        # deferred accumulates) count here until their reply: bounded by
        # max_inflight
        self._inflight = 0
        # when the replies queued for this connection last went over
        # max_reply_bytes without draining since (None: they drain)
        self._replies_stuck_since: float | None = None
        # small replies made while one receive is parsed, sent with one write
        # (a pipelined LOCK_RELEASE + LOCK_ACQUIRE costs one syscall, not two)
        self._cork: list[bytes] | None = None
        self._cork_bytes = 0
        # this client's queue pair and staging area, after rdma_connect
        self.rdma_peer: Any = None
        # what this connection's requests count into (--metrics), and when
        # the frame being handled started (its header was read)
        self.counts = server.requests[self.transport_name]
        self._frame_started = 0
        # the "host:port" a peer server named itself by in its hello (the
        # replication's forwarded ops are taken only from a stripe's primary)
        self.peer_server: str | None = None
        # what this connection's frames ask for: data ops and control messages
        self.ops = DataOps(self)
        self.commands = Control(self)

    # -- asyncio -----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.host = str(peer[0]) if peer else "?"
        refused = self.server.admission.admit(self, self.host)
        if refused is not None:
            self.server.warn("admission", "refused a connection from %s: %s", self.peer, refused)
            self.close_with(refused, code=ErrorCode.OUT_OF_MEMORY, why="connection_limit")
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # pause_writing (and so no more parsing) once this much is queued
        self.transport.set_write_buffer_limits(high=self.server.max_reply_bytes)
        self._uvloop = type(asyncio.get_running_loop()).__module__.startswith("uvloop")
        self._last_rx = self._opened = asyncio.get_running_loop().time()
        self._progress = (self._opened, 0)
        self.server.connections.add(self)
        log.debug("connection from %s", self.peer)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.admission.leave(self)
        self.release_memory(closed=True)
        self.server.connections.discard(self)
        self.server.locks.connection_lost(self)
        if self.server.shm is not None:
            self.server.shm.drop_owner(self)
        self.ops.abandon_write()
        if self.rdma_peer is not None and self.server.rdma is not None:
            self.server.rdma.drop(self.rdma_peer)
        self.rdma_peer = None
        self.transport = None
        log.debug("connection from %s closed%s", self.peer, f": {exc}" if exc else "")

    def overdue(self, now: float) -> tuple[str, str] | None:
        """Which deadline this connection missed and why it is to be cut
        now, if it is: no hello and authentication in time, a request's
        payload that stopped making progress, or idle too long."""
        opts = self.server.options
        if self.transport is None:
            return None
        if not self.authed and opts.hello_timeout and now - self._opened > opts.hello_timeout:
            return "hello_timeout", f"no hello and authentication within {opts.hello_timeout:g} s"
        if self.stalled(now):
            return "no_progress", (f"less than {self.server.write_progress} bytes of a request's payload "
                                   f"in {opts.write_timeout:g} s")
        stuck = self._replies_stuck_since
        if opts.write_timeout and stuck is not None and now - stuck > opts.write_timeout:
            return "replies_not_read", f"its replies were not read for {opts.write_timeout:g} s"
        if opts.idle_timeout and self.idle_for(now) > opts.idle_timeout:
            return "idle_timeout", f"idle for {opts.idle_timeout:g} s"
        return None

    def stalled(self, now: float) -> bool:
        """In the middle of a frame, not held by us, and fewer than
        ``server.write_progress`` bytes of it in the last write_timeout: a
        peer that stopped, or one that trickles a byte now and then."""
        timeout = self.server.write_timeout
        if not self.mid_frame or self._paused or not timeout:
            self._progress = (now, self._rx_bytes)
            return False
        since, rx = self._progress
        if now - since < timeout:
            return False
        if self._rx_bytes - rx >= self.server.write_progress:
            self._progress = (now, self._rx_bytes)
            return False
        return True

    def idle_for(self, now: float) -> float:
        """Seconds since the last byte came in, with nothing left to answer
        (0 while a request waits for its reply or a frame is half in)."""
        if self._inflight or self.mid_frame or self.ops.receiving:
            return 0.0
        return now - self._last_rx

    # Memory for payloads (accumulate scratch) comes from the server's pool:
    # a connection that does not fit waits, not reading, until memory is given back.
    def reserve(self, nbytes: int) -> bool:
        pool = self.server.receive_pool
        if not pool.fits(nbytes):
            self.server.reclaim_memory()
            if not pool.fits(nbytes):
                self.wait_for_memory()
                return False
        pool.take(nbytes)
        return True

    def unreserve(self, nbytes: int) -> None:
        self.server.receive_pool.give(nbytes)

    def wait_for_memory(self) -> None:
        """Stop reading until the server's receive pool has room again."""
        self._hold_input("memory")
        loop = asyncio.get_running_loop()
        # not from give(): it runs inside another connection's frame handling
        self.server.receive_pool.wait(lambda: loop.call_soon(self._unhold_input, "memory"))

    # Flow control: a client that does not read its replies stops being read
    # and parsed, so one connection's memory stays bounded by the transport's
    # high-water mark plus one reply (at most max_frame).
    def pause_writing(self) -> None:
        self._replies_stuck_since = asyncio.get_running_loop().time()
        self._hold_input("writing")

    def resume_writing(self) -> None:
        self._replies_stuck_since = None
        self._unhold_input("writing")

    def _hold_input(self, reason: str) -> None:
        if self.transport is None:
            return
        if not self.held:
            self._paused = True
            self.transport.pause_reading()
        self.hold(reason)

    # for the replication module: a replicated op waits for the view, or for
    # a backup's link to drain, without this connection's later frames
    # overtaking it
    def hold_input(self, reason: str) -> None:
        self._hold_input(reason)

    def unhold_input(self, reason: str) -> None:
        self._unhold_input(reason)

    def _unhold_input(self, reason: str) -> None:
        if self.transport is None or reason not in self._holds:
            return
        if len(self._holds) == 1:
            self._paused = False
            self.transport.resume_reading()
        self.unhold(reason)      # parses what waited in the inbox

    def holding(self, reason: str) -> bool:
        """Is input held for ``reason``?"""
        return reason in self._holds

    def is_open(self) -> bool:
        t = self.transport
        return t is not None and not t.is_closing()

    def cut(self, reason: str) -> None:
        """Close with the reason; abort if replies are still queued (a close
        would wait for them to drain, and a peer that reads none never lets it)."""
        self.close_with(reason, why="")     # counted in server.cuts
        t = self.transport
        if t is not None and t.get_write_buffer_size():
            self.abort(reason)

    def abort(self, reason: str) -> None:
        if self.transport is not None:
            log.debug("closing %s: %s", self.peer, reason)
            self.transport.abort()

    # -- replies -----------------------------------------------------------
    def buffer_updated(self, nbytes: int) -> None:
        self._last_rx = asyncio.get_running_loop().time()     # see overdue
        self._rx_bytes += nbytes
        self._cork = []
        self._cork_bytes = 0
        try:
            super().buffer_updated(nbytes)
        finally:
            self._uncork()

    def _uncork(self) -> None:
        cork, self._cork = self._cork, None
        t = self.transport
        if cork and t is not None and not t.is_closing():
            t.write(cork[0] if len(cork) == 1 else b"".join(cork))

    def reply(self, hdr: Header, payload: bytes | memoryview = b"",
              status: int = 0, flags: int = 0) -> None:
        """Answer the request whose header is ``hdr`` (the lock service
        answers parked acquires through this too)."""
        if not hdr[H_FLAGS] & FLAG_NOREPLY:
            self._inflight -= 1
            if self._inflight < self.server.options.max_inflight and "inflight" in self._holds:
                asyncio.get_running_loop().call_soon(self._unhold_input, "inflight")
        t = self.transport
        if t is None or t.is_closing():
            return
        n = len(payload)
        self.server.bytes_out += n
        if n <= COPY_REPLY_MAX:
            frame = _core.encode_header_with(VERSION, hdr[H_OP], FLAG_REPLY | flags, status, hdr[H_REQUEST],
                                             hdr[H_SEGMENT], hdr[H_OFFSET], n, payload)
            if self._cork is not None:
                self._cork.append(frame)
                self._cork_bytes += len(frame)
                if self._cork_bytes >= COPY_REPLY_MAX:
                    # hand the transport what is corked: its flow control
                    # (pause_writing) then stops parsing, for small replies too
                    self._uncork()
                    self._cork = []
                    self._cork_bytes = 0
            else:
                t.write(frame)
            return
        if self._cork:
            # keep the order of replies: the corked ones go first
            cork, self._cork = self._cork, []
            t.write(b"".join(cork))
        head = _core.encode_header(VERSION, hdr[H_OP], FLAG_REPLY | flags, status, hdr[H_REQUEST],
                                   hdr[H_SEGMENT], hdr[H_OFFSET], n)
        if self._uvloop:
            t.writelines((head, payload))       # one writev, payload not copied
        else:
            t.write(head)
            t.write(payload)

    def refuse(self, hdr: Header, code: ErrorCode, message: str, **extra: Any) -> None:
        """Answer ``hdr`` with an error (``extra``: more fields of its map)."""
        self._count_refusal(code)
        if hdr[H_FLAGS] & FLAG_NOREPLY:
            # the client asked for no answer (a lock release): none, not even this
            log.info("refused a request from %s that wants no reply: %s", self.peer, message)
            return
        self.reply(hdr, pack({"message": message[:4096], **extra}) if extra else error_payload(message),
                   status=code)

    def close_with(self, reason: str, hdr: Header | None = None,
                   code: ErrorCode = ErrorCode.BAD_REQUEST, why: str | None = None) -> None:
        """Answer with the reason (so the client can tell why), then close.
        ``why``: the refusal's metrics label, if not the code's ("": not a
        refusal, counted by the caller)."""
        super().close_with(reason)
        if self._cork is not None:
            self._uncork()
            self._cork = []
        self._count_refusal(code, why)
        log.info("closing connection from %s: %s", self.peer, reason)
        t = self.transport
        if t is not None and not t.is_closing():
            h = hdr if hdr is not None else NO_REQUEST
            t.write(_core.encode_header_with(VERSION, h[H_OP] & 0xFF, FLAG_REPLY, code, h[H_REQUEST], 0, 0,
                                             len(p := error_payload(reason)), p))
            t.close()

    def _count_refusal(self, code: ErrorCode, why: str | None = None) -> None:
        if why is None:
            why = ErrorCode(code).name.lower()
        if why:
            self.server.refusals[why] += 1

    # -- frames --------------------------------------------------------
    def payload_size(self, hdr: Header) -> int:
        return 0 if hdr[H_OP] == Op.READ else hdr[H_LENGTH]

    def on_header(self, hdr: Header, size: int) -> Destination:
        self._frame_started = time.monotonic_ns()
        version, op, flags, length = hdr[H_VERSION], hdr[H_OP], hdr[H_FLAGS], hdr[H_LENGTH]
        # what a well-behaved client never sends closes the connection
        if version != VERSION:
            self.close_with(f"protocol version {version} not supported (server speaks {VERSION})",
                            hdr, ErrorCode.VERSION_MISMATCH)
            return CLOSED
        if flags & FLAG_REPLY:
            self.close_with("a client sent a reply frame", hdr)
            return CLOSED
        if op == Op.CONTROL:
            limit = MAX_CONTROL if self.authed else PREAUTH_MAX_CONTROL
            if size > limit:
                before = "" if self.authed else " before authentication"
                self.close_with(f"control message of {size} bytes{before} (limit {limit})",
                                hdr, ErrorCode.TOO_LARGE)
                return CLOSED
            self._expect_reply(hdr)
            return INLINE
        if not self.ops.knows(op):
            self.close_with(f"unknown op {op}", hdr)
            return CLOSED
        if size > self.server.max_frame or (op == Op.READ and length > self.server.max_frame):
            self.close_with(f"frame of {length} bytes exceeds the limit of "
                            f"{self.server.max_frame}", hdr, ErrorCode.TOO_LARGE)
            return CLOSED
        if op in ACCUMULATES and size > MAX_ACCUMULATE + (REPL_PREFIX_SIZE if flags & REPL_FLAGS else 0):
            self.close_with(f"accumulate of {size} bytes exceeds the limit of {MAX_ACCUMULATE}",
                            hdr, ErrorCode.TOO_LARGE)
            return CLOSED
        if not self.authed:
            if not self.greeted:
                self.close_with("the first request must be hello", hdr)
            else:
                self.close_with("not authenticated", hdr, ErrorCode.ACCESS_DENIED)
            return CLOSED
        self._expect_reply(hdr)
        # a request this server refuses gets an error reply; its payload is dropped
        try:
            return self.ops.check(hdr, size)
        except Refused as exc:
            self.refuse(hdr, exc.code, str(exc), **exc.extra)
            return DISCARD

    def _expect_reply(self, hdr: Header) -> None:
        # counted until reply() answers it; at the cap, stop reading
        if not hdr[H_FLAGS] & FLAG_NOREPLY:
            self._inflight += 1
            if self._inflight >= self.server.options.max_inflight:
                self._hold_input("inflight")

    # Each op's header check, before a byte of its payload is read: where the

    def on_prefix(self, hdr: Header, prefix: memoryview, rest: int) -> Destination:
        return self.ops.on_prefix(hdr, prefix, rest)

    def on_frame(self, hdr: Header, payload: memoryview | None) -> None:
        op = hdr[H_OP]
        try:
            if op == Op.CONTROL:
                assert payload is not None
                self.commands.handle(hdr, payload)
            elif hdr[H_FLAGS] & REPL_FLAGS:
                assert payload is not None and self.server.replication is not None
                self.server.replication.on_frame(self, hdr, payload)
            else:
                self.ops.execute(hdr, payload)
        except Refused as exc:
            self.refuse(hdr, exc.code, str(exc), **exc.extra)
        except Exception as exc:  # a bug must cost one request, not the server
            log.exception("internal error handling op %d from %s", op, self.peer)
            self.refuse(hdr, ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
        if op != Op.CONTROL:
            # counted here, refused or not: the op count is the histogram's
            self.counts.time[op].observe(time.monotonic_ns() - self._frame_started)

    # for the control handlers: what authentication and the transport hand-outs change here
    def authenticated(self) -> None:
        """The peer proved the token (or the server has none): the full inbox."""
        self.authed = True
        self.server.admission.authenticated(self)
        self.inbox_size = self.INBOX_SIZE      # grows at the next receive

    def count_as(self, transport: str) -> None:
        """From now on this connection's server-side work counts as ``transport``'s."""
        self.transport_name = transport
        self.counts = self.server.requests[transport]
