"""The RDMA transport: one-sided READ/WRITE and atomics on an RC queue pair.

Control messages (and the queue pair handshake) ride on a TCP connection to
the server's usual port (:class:`TcpTransport`); data never does, except
``accumulate``'s small request (the server adds a delta the client has
RDMA-written into a staging slot the server gave it, as SMB1 did).

Completions: the CQ has its own completion channel; its fd is watched with
``loop.add_reader``.  On readiness the channel event is acknowledged, the CQ
re-armed, then drained in batches by ``_verbs.Completions`` (Cython), which
resolves the waiting futures by ``wr_id`` with no Python object per
completion.  ``poll="busy"`` instead spins on the CQ (yielding to the loop
between polls) while an operation waits: lowest latency, one busy core.

Memory: user memory registered with ``Client.register`` is used in place
(an SGE list per request); anything else goes through a registered bounce
pool (copy in for WRITE, copy out after READ).

Failure: a failed work completion fails its operation with a
``TransportError`` whose ``status`` is the work-completion status, and the
transport closes (an RC QP in error is useless); the client opens a new one
(a new queue pair) on the next operation.  The retry timeout is set so that
a dead server surfaces within about a second; a lost control connection
fails everything at once.
"""

from __future__ import annotations

import asyncio
import errno as errno_mod
import functools
import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .. import _core
from ..errors import NoSuchBuffer, OutOfBounds, ServerError, TransportError
from ..protocol import DTYPE_SHIFT, MASK64, accumulate_span
from ..rdma_device import Device, _verbs, alloc_pinned, get_device, unavailable_reason
from .base import Transport
from .tcp import TcpTransport

log = logging.getLogger("smb2.transport.rdma")

#: bytes of one request (the client's planner cuts here) = one bounce chunk
CHUNK = 1 << 20
BOUNCE_CHUNKS = 4
#: operations in flight per queue pair, and work requests in its send queue
SLOTS = 128
# how often the CQ is drained without an event while an operation waits
# (a safety net: a drain of an empty CQ costs a few microseconds)
SWEEP_EVERY = 1.0
SQ_DEPTH = 256
# signaled completions (<= SLOTS) plus error completions of unsignaled WRs
CQ_DEPTH = SLOTS + SQ_DEPTH
#: 4.096 us * 2**14 = 67 ms per try, 6 retries: a dead peer fails in ~0.5 s.
#: (7 would be "retry forever" on rdma_rxe: a dead server would hang us.)
QP_TIMEOUT = 14
QP_RETRY = 6
_REM_ACCESS_ERR = 10

POLL_MODES = ("event", "busy")


class _Pool:
    """Indices of equal chunks of a registered area, handed out FIFO."""

    def __init__(self, n: int) -> None:
        self._free = list(range(n - 1, -1, -1))
        self._waiters: deque[asyncio.Future[int]] = deque()
        self.failed: BaseException | None = None

    async def get(self) -> int:
        if self.failed is not None:
            raise self.failed
        if self._free:
            return self._free.pop()
        w: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append(w)
        try:
            return await w
        except asyncio.CancelledError:
            if w.done() and not w.cancelled():
                self.put(w.result())
            raise

    def put(self, i: int) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(i)
                return
        self._free.append(i)

    def fail(self, exc: BaseException) -> None:
        self.failed = exc
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_exception(exc)


def _window(pieces: Sequence[memoryview], start: int, n: int) -> list[memoryview]:
    """The pieces covering bytes [start, start+n) of their concatenation."""
    out: list[memoryview] = []
    pos = 0
    for p in pieces:
        ln = len(p)
        if pos + ln > start and pos < start + n:
            a = max(start - pos, 0)
            b = min(start + n - pos, ln)
            out.append(p[a:b])
        pos += ln
        if pos >= start + n:
            break
    return out


def _gather(pieces: Sequence[memoryview], dst: memoryview) -> None:
    pos = 0
    for p in pieces:
        _core.copy_into(dst[pos:pos + len(p)], p)
        pos += len(p)


def _scatter(src: memoryview, pieces: Sequence[memoryview]) -> None:
    pos = 0
    for p in pieces:
        _core.copy_into(p, src[pos:pos + len(p)])
        pos += len(p)


class RdmaTransport(Transport):
    """Client side of one RC queue pair (plus its TCP control connection)."""

    name = "rdma"
    max_request = CHUNK
    # one-sided: the server's CPU never sees a waiter, nothing to sleep on
    lock_waits = ("poll",)

    def __init__(self, tcp: TcpTransport, device: Device, poll: str) -> None:
        super().__init__(tcp.address)
        assert _verbs is not None
        self._tcp = tcp
        self.server_info = tcp.server_info
        self.device = device
        #: what Client.register registers memory with (one per device)
        self.memory_domain: Device = device
        self._busy = poll == "busy"
        self._loop = asyncio.get_running_loop()
        self._failed: TransportError | None = None
        self._broken: TransportError | None = None
        self._segs: dict[int, tuple[int, int, int, str]] = {}
        self._kinds: list[str] = [""] * SLOTS
        self._orphans: dict[int, Any] = {}
        self._space: list[asyncio.Future[None]] = []
        self._reader = False
        #: operations waiting for a completion, and the sweep that looks at the CQ while there are any
        self._waiting = 0
        self._sweep: asyncio.TimerHandle | None = None
        #: completions the sweep found that no channel event had announced
        self.swept = 0
        self._resources: list[Any] = []
        self._qp: Any = None
        self._cq: Any = None
        self._comps: Any = None
        # the server's staging area for this client: (address, rkey, slot size), or None
        self._staging: tuple[int, int, int] | None = (0, 0, 0)
        self._bounce = _Pool(BOUNCE_CHUNKS)
        self._stage = _Pool(1)

    # -- set-up ---------------------------------------------------------------
    @classmethod
    async def connect(cls, address: tuple[str, int], *, timeout: float = 10.0,
                      token: bytes | None = None, rdma_device: str | None = None,
                      rdma_gid_index: int | None = None, poll: str = "event") -> RdmaTransport:
        """Open the control connection, then the queue pair; never falls back."""
        label = f"{address[0]}:{address[1]}"
        reason = unavailable_reason(rdma_device, rdma_gid_index)
        if reason is not None:
            raise TransportError(f"transport='rdma' for {label} is not possible: {reason}",
                                 errno=errno_mod.ENODEV, server=label)
        # hello and authentication happen on this control connection before
        # any RDMA key or segment address is asked for
        tcp = await TcpTransport.connect(address, timeout=timeout, token=token)
        return await cls.upgrade(tcp, timeout=timeout, rdma_device=rdma_device,
                                 rdma_gid_index=rdma_gid_index, poll=poll)

    @classmethod
    async def upgrade(cls, tcp: TcpTransport, *, timeout: float = 10.0,
                      rdma_device: str | None = None, rdma_gid_index: int | None = None,
                      poll: str = "event") -> RdmaTransport:
        """Set up a queue pair over an open control connection (closed on failure)."""
        if poll not in POLL_MODES:
            await tcp.close()
            raise ValueError(f"poll must be one of {POLL_MODES}, not {poll!r}")
        label = tcp.label
        if "rdma" not in tcp.server_info.get("transports", ()):
            await tcp.close()
            why = tcp.server_info.get("rdma_off") or "it does not offer rdma"
            raise TransportError(f"transport='rdma' for {label} is not possible: the server "
                                 f"has no RDMA ({why})", errno=errno_mod.EPROTONOSUPPORT,
                                 server=label)
        try:
            self = cls(tcp, get_device(rdma_device, rdma_gid_index), poll)
        except OSError as exc:
            await tcp.close()
            raise TransportError(f"transport='rdma' for {label} is not possible: {exc}",
                                 errno=exc.errno, server=label) from None
        try:
            await asyncio.wait_for(self._setup(), timeout)
        except BaseException as exc:
            self._teardown(TransportError(f"RDMA set-up with {label} failed"))
            await tcp.close()
            if isinstance(exc, TransportError | asyncio.CancelledError):
                raise
            if isinstance(exc, TimeoutError):
                raise TransportError(f"RDMA set-up with {label} timed out after {timeout} s",
                                     errno=errno_mod.ETIMEDOUT, server=label) from None
            if isinstance(exc, OSError):
                raise TransportError(f"RDMA set-up with {label} failed: {exc}",
                                     errno=exc.errno, server=label) from None
            if isinstance(exc, ServerError):
                # the server said no (its RDMA connection limit, say): a reason
                # not to use RDMA with it, which auto answers with TCP
                raise TransportError(f"RDMA set-up with {label} refused: {exc.message}", server=label,
                                     hint="use transport='tcp' for this server") from None
            raise
        return self

    async def _setup(self) -> None:
        v = _verbs
        assert v is not None
        dev = self.device
        self._cq = cq = v.CQ(dev.context, CQ_DEPTH)
        self._qp = qp = v.QP(dev.pd, cq, max_send_wr=SQ_DEPTH, max_sge=dev.max_sge)
        qp.to_init(dev.port, 0)        # nobody reads or writes *our* memory remotely
        psn = int.from_bytes(os.urandom(3), "little")
        r = await self._tcp.control({"cmd": "rdma_connect", "qpn": qp.qpn, "psn": psn,
                                     "gid": dev.gid, "lid": dev.lid, "mtu": dev.mtu,
                                     "max_rd_atomic": dev.max_rd_atomic})
        qp.to_rtr(int(r["qpn"]), int(r["psn"]), bytes(r["gid"]),
                  dev.gid_index if dev.ethernet else -1, int(r.get("lid", 0)),
                  min(dev.mtu, int(r["mtu"])), dev.max_rd_atomic)
        qp.to_rts(psn, QP_TIMEOUT, QP_RETRY, min(dev.max_rd_atomic, int(r["max_rd_atomic"])))
        slot_size = min(int(r["staging_slot"]), CHUNK)
        if int(r["staging_slots"]) > 0:
            self._staging = (int(r["staging_addr"]), int(r["staging_rkey"]), slot_size)
            self._stage = _Pool(max(1, int(r["staging_slots"]) * int(r["staging_slot"]) // slot_size))
        else:
            # the server lent all its staging areas: accumulates go in-band
            # over the TCP connection (correct, slower); said once
            self._staging = None
            log.warning("%s: the server has no RDMA staging area free for this client (all are lent: "
                        "--rdma-staging-memory on that server); its accumulates go in-band over TCP, slower, "
                        "while reads, writes and atomics stay RDMA", self.label)
        # registered memory: the bounce pool and one atomic word per slot
        self._bounce_mem = alloc_pinned(CHUNK * BOUNCE_CHUNKS)
        self._bounce_view = memoryview(self._bounce_mem)
        self._bounce_mr = v.MR(dev.pd, self._bounce_mem, v.ACCESS_LOCAL_WRITE)
        self._atomic_mem = alloc_pinned(SLOTS * 8)
        self._atomic_mr = v.MR(dev.pd, self._atomic_mem, v.ACCESS_LOCAL_WRITE)
        self._comps = v.Completions(SLOTS, qp.max_send_wr)
        self._comps.set_atomic_area(self._atomic_mr)
        self._comps.on_error = self._wc_error
        if not self._busy:
            self._loop.add_reader(cq.fd, self._on_ready)
            self._reader = True
            cq.arm()
        self._tcp.on_lost = self._on_tcp_lost
        log.debug("%s: RC QP %d <-> %d up", self.label, qp.qpn, int(r["qpn"]))

    # -- state ------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._failed is not None or self._tcp.closed

    def _on_tcp_lost(self, exc: Exception) -> None:
        self._teardown(TransportError(f"connection to {self.label} lost: {exc}",
                                      errno=getattr(exc, "errno", None) or errno_mod.ECONNRESET,
                                      server=self.label))

    def _wc_error(self, slot: int, status: int, vendor_err: int) -> TransportError:
        assert _verbs is not None
        what = self._kinds[slot] or "operation"
        hint = None
        if status == _REM_ACCESS_ERR:
            hint = ("the server's memory region does not allow this access "
                    "(registered without it, or the buffer was destroyed)")
        err = TransportError(
            f"{self.label}: RDMA {what} failed: {_verbs.wc_status_str(status)} (status {status}"
            f"{f', vendor error 0x{vendor_err:x}' if vendor_err else ''})" + (f": {hint}" if hint else ""),
            status=status, server=self.label, hint=hint)
        if self._broken is None:
            self._broken = err
        return err

    def _teardown(self, exc: TransportError) -> None:
        """Stop everything now (idempotent): the QP goes first, so the NIC no
        longer touches any memory; then every waiter fails with ``exc``."""
        if self._failed is not None:
            return
        self._failed = exc
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        if self._reader and self._cq is not None:
            self._loop.remove_reader(self._cq.fd)
            self._reader = False
        if self._qp is not None:
            self._qp.close()
        if self._comps is not None:
            self._comps.fail_all(exc)
        self._orphans.clear()
        self._bounce.fail(exc)
        self._stage.fail(exc)
        for w in self._space:
            if not w.done():
                w.set_exception(exc)
        self._space.clear()
        if self._cq is not None:
            self._cq.close()
        for name in ("_bounce_mr", "_atomic_mr"):
            mr = getattr(self, name, None)
            if mr is not None:
                mr.close()
        for name in ("_bounce_view",):
            view = getattr(self, name, None)
            if view is not None:
                view.release()
        for name in ("_bounce_mem", "_atomic_mem"):
            mem = getattr(self, name, None)
            if mem is not None:
                try:
                    mem.close()
                except BufferError:   # a slice is still referenced: GC frees it
                    pass
        self._tcp.on_lost = None
        if not self._tcp.closed:
            self._tcp.abort()

    # -- completions ------------------------------------------------------------
    def _on_ready(self) -> None:
        cq = self._cq
        if self._failed is not None or cq is None:
            return
        try:
            cq.ack()
            cq.arm()        # before draining: a completion during the drain re-fires
            self._comps.drain(cq)
        except OSError as exc:
            self._teardown(TransportError(f"{self.label}: completion queue failed: {exc}",
                                          errno=exc.errno, server=self.label))
            return
        self._after_drain()

    def _sweep_cq(self) -> None:
        """Drain the CQ without an event, every SWEEP_EVERY seconds while an
        operation waits: a completion whose channel event never came (seen
        under soft-RoCE on a loaded machine: an operation waited for ever)
        is found here instead of hanging its caller."""
        self._sweep = None
        cq = self._cq
        if self._failed is not None or cq is None or self._waiting == 0:
            return
        try:
            found = self._comps.drain(cq)
        except OSError as exc:
            self._teardown(TransportError(f"{self.label}: completion queue failed: {exc}",
                                          errno=exc.errno, server=self.label))
            return
        if found:
            self.swept += found
            # (also when the event is merely queued behind this timer on a busy loop: not an error)
            log.debug("%s: %d RDMA completion(s) found by the periodic sweep before their completion event",
                      self.label, found)
        self._after_drain()
        if self._waiting and self._failed is None:
            self._sweep = self._loop.call_later(SWEEP_EVERY, self._sweep_cq)

    def _after_drain(self) -> None:
        comps = self._comps
        if comps.orphaned:
            for slot in comps.orphaned:
                # the NIC is done with that memory: drop it, or give it back
                keep = self._orphans.pop(slot, None)
                if callable(keep):
                    keep()
            comps.orphaned.clear()
        if self._broken is not None:
            self._teardown(self._broken)
            return
        if self._space:
            space, self._space = self._space, []
            for w in space:
                if not w.done():
                    w.set_result(None)

    async def _alloc(self, fut: asyncio.Future[Any], nwr: int, kind: str,
                     atomic: bool = False) -> int:
        while True:
            if self._failed is not None:
                raise self._failed
            slot = int(self._comps.alloc(fut, nwr, atomic))
            if slot >= 0:
                self._kinds[slot] = kind
                return slot
            w: asyncio.Future[None] = self._loop.create_future()
            self._space.append(w)
            await w

    async def _wait(self, slot: int, fut: asyncio.Future[Any], keep: Any) -> Any:
        """Wait for ``slot``'s completion.  If the caller is cancelled first,
        ``keep`` (memory the NIC may still use) lives on until it comes."""
        try:
            if self._busy:
                comps, cq = self._comps, self._cq
                while not fut.done():
                    try:
                        comps.drain(cq)
                    except OSError as exc:
                        self._teardown(TransportError(f"{self.label}: completion queue failed: "
                                                      f"{exc}", errno=exc.errno, server=self.label))
                    self._after_drain()
                    if not fut.done():
                        await asyncio.sleep(0)
                return fut.result()
            self._waiting += 1
            if self._sweep is None:
                self._sweep = self._loop.call_later(SWEEP_EVERY, self._sweep_cq)
            try:
                return await fut
            finally:
                self._waiting -= 1
        except asyncio.CancelledError:
            if not fut.done():
                fut.cancel()
            if fut.cancelled() and self._failed is None:
                self._orphans[slot] = keep
            raise

    def _post_error(self, slot: int, exc: OSError) -> TransportError:
        self._comps.cancel(slot)
        err = TransportError(f"{self.label}: posting an RDMA {self._kinds[slot]} failed: {exc}",
                             errno=exc.errno, server=self.label)
        self._teardown(err)
        return err

    # -- segments -----------------------------------------------------------------
    def _remember(self, info: dict[str, Any]) -> tuple[int, int, int, str] | None:
        if "rdma_addr" not in info:
            return None
        entry = (int(info["rdma_addr"]), int(info["rdma_rkey"]), int(info["size"]), str(info["name"]))
        self._segs[int(info["segment"])] = entry
        return entry

    async def _remote(self, segment: int, offset: int, length: int) -> tuple[int, int]:
        entry = self._segs.get(segment)
        if entry is None:
            entry = self._remember(await self._tcp.control({"cmd": "rdma_segment", "segment": segment}))
            if entry is None:
                raise TransportError(f"{self.label} gave no RDMA key for segment {segment}",
                                     server=self.label)
        addr, rkey, size, _ = entry
        if offset > size or length > size - offset:
            raise OutOfBounds(f"range [{offset}, {offset + length}) is outside segment {segment} "
                              f"of {size} bytes", server=self.label)
        return addr + offset, rkey

    async def _explain(self, exc: TransportError, segment: int) -> BaseException:
        """A remote access error on a segment that is gone is a NoSuchBuffer."""
        if exc.status != _REM_ACCESS_ERR or self._tcp.closed:
            return exc
        try:
            await self._tcp.control({"cmd": "rdma_segment", "segment": segment})
        except NoSuchBuffer as gone:
            self._segs.pop(segment, None)
            return gone
        except Exception:
            pass
        return exc

    # -- the interface -----------------------------------------------------------
    async def write_fenced(self, src: Sequence[memoryview], segment: int, offset: int,
                           length: int, lock_key: int, token: int) -> None:
        # A one-sided WRITE cannot be refused by anyone: the fence can only be
        # checked by the server's CPU, so fenced writes take the TCP path.
        await self._tcp.write_fenced(src, segment, offset, length, lock_key, token)

    async def replicated(self, op: int, flags: int, segment: int, offset: int,
                         payload: Sequence[memoryview | bytes]) -> int | None:
        # the primary's CPU forwards it to the backups: through the server
        return await self._tcp.replicated(op, flags, segment, offset, payload)

    async def control(self, msg: dict[str, Any]) -> dict[str, Any]:
        reply = await self._tcp.control(msg)
        cmd = msg.get("cmd")
        if cmd in ("create", "lookup"):
            self._remember(reply)
        elif cmd == "destroy":
            name = msg.get("name")
            for seg in [s for s, e in self._segs.items() if e[3] == name]:
                del self._segs[seg]
        return reply

    async def _rw(self, opcode: int, kind: str, pieces: Sequence[memoryview], segment: int,
                  offset: int, length: int) -> None:
        if self._failed is not None:
            raise self._failed
        raddr, rkey = await self._remote(segment, offset, length)
        try:
            if len(self.device.table) and await self._rw_direct(opcode, kind, pieces, raddr, rkey):
                return
            await self._rw_bounce(opcode, kind, pieces, raddr, rkey, length)
        except TransportError as exc:
            raise await self._explain(exc, segment) from None

    async def _rw_direct(self, opcode: int, kind: str, pieces: Sequence[memoryview],
                         raddr: int, rkey: int) -> bool:
        """Zero copy from/to registered user memory; False if some piece is not."""
        plist = list(pieces)
        nwr = -(-len(plist) // self._qp.max_sge)
        if nwr > SQ_DEPTH // 4:
            return False    # a tiny stripe: thousands of pieces; gathering is cheaper
        fut = self._loop.create_future()
        slot = await self._alloc(fut, nwr, kind)
        try:
            posted = self._qp.post_rw(opcode, slot, plist, self.device.table, raddr, rkey)
        except OSError as exc:
            raise self._post_error(slot, exc) from None
        if not posted:
            self._comps.cancel(slot)
            return False
        await self._wait(slot, fut, plist)
        return True

    async def _rw_bounce(self, opcode: int, kind: str, pieces: Sequence[memoryview],
                         raddr: int, rkey: int, length: int) -> None:
        read = opcode == _verbs.WR_RDMA_READ
        pos = 0
        while pos < length:
            n = min(CHUNK, length - pos)
            window = _window(pieces, pos, n) if (pos or n < length) else list(pieces)
            chunk = await self._bounce.get()
            buf = self._bounce_view[chunk * CHUNK:chunk * CHUNK + n]
            release = True
            try:
                if not read:
                    _gather(window, buf)
                fut = self._loop.create_future()
                slot = await self._alloc(fut, 1, kind)
                try:
                    self._qp.post_one(opcode, slot, self._bounce_mr.addr + chunk * CHUNK, n,
                                      self._bounce_mr.lkey, raddr + pos, rkey)
                except OSError as exc:
                    raise self._post_error(slot, exc) from None
                try:
                    await self._wait(slot, fut, lambda c=chunk: self._bounce.put(c))
                except asyncio.CancelledError:
                    # the NIC may still use the chunk: it returns to the pool
                    # when the completion comes (see _wait)
                    release = not fut.cancelled()
                    raise
                if read:
                    _scatter(buf, window)
            finally:
                buf.release()
                if release and self._failed is None:
                    self._bounce.put(chunk)
            pos += n

    async def read_into(self, dst: Sequence[memoryview], segment: int, offset: int,
                        length: int) -> None:
        await self._rw(_verbs.WR_RDMA_READ, "READ", dst, segment, offset, length)

    async def write(self, src: Sequence[memoryview], segment: int, offset: int,
                    length: int) -> None:
        await self._rw(_verbs.WR_RDMA_WRITE, "WRITE", src, segment, offset, length)

    async def accumulate(self, src: Sequence[memoryview], segment: int, offset: int,
                         length: int, dtype_code: int) -> None:
        if self._failed is not None:
            raise self._failed
        # bounds, and that it exists; ``pos`` below counts bytes of src, the
        # segment's bytes go ``widen`` times as fast (a bf16 delta into float32)
        span = accumulate_span(dtype_code << DTYPE_SHIFT, offset, length)
        widen = span // length if length else 1
        await self._remote(segment, offset, span)
        if self._staging is None:
            await self._tcp.accumulate(src, segment, offset, length, dtype_code)
            return
        slot_size = self._staging[2]
        pos = 0
        while pos < length:
            n = min(slot_size, length - pos)
            window = _window(src, pos, n) if (pos or n < length) else list(src)
            await self._staged(window, n, "WRITE (accumulate)", functools.partial(
                self._add_staged, segment, offset + pos * widen, n, dtype_code))
            pos += n

    def _add_staged(self, segment: int, offset: int, n: int, dtype_code: int, staging_offset: int) -> Awaitable[None]:
        return self._tcp.accumulate_staged(segment, offset, staging_offset, n, dtype_code)

    async def accumulate_sparse(self, payload: Sequence[memoryview], segment: int, offset: int,
                                flags: int) -> None:
        if self._failed is not None:
            raise self._failed
        await self._remote(segment, offset, 0)
        length = sum(len(p) for p in payload)
        if self._staging is None or length > self._staging[2]:
            # no staging area lent (or a request larger than a slot): in-band
            await self._tcp.accumulate_sparse(payload, segment, offset, flags)
            return
        # the whole request through one slot; the server copies it out of
        # the slot before it checks and adds it
        await self._staged(list(payload), length, "WRITE (sparse accumulate)",
                           lambda soff: self._tcp.accumulate_sparse_staged(segment, offset, soff, length, flags))

    async def _staged(self, window: list[memoryview], n: int, kind: str,
                      add: Callable[[int], Awaitable[None]]) -> None:
        """``n`` bytes of ``window`` into one of our staging slots on the
        server, one-sided, then ``add(the slot's offset)``: the request that
        has the server add them in (over the control connection)."""
        assert self._staging is not None
        saddr, srkey, slot_size = self._staging
        s = await self._stage.get()
        try:
            if not (len(self.device.table) and await self._rw_direct(
                    _verbs.WR_RDMA_WRITE, kind, window, saddr + s * slot_size, srkey)):
                await self._rw_bounce(_verbs.WR_RDMA_WRITE, kind, window, saddr + s * slot_size, srkey, n)
            call = asyncio.ensure_future(add(s * slot_size))
            try:
                await asyncio.shield(call)
            except asyncio.CancelledError:
                # the server may still read the slot: free it only after its reply
                call.add_done_callback(self._staged_done(s))
                s = -1
                raise
        finally:
            if s >= 0:
                self._stage.put(s)

    def _staged_done(self, s: int) -> Any:
        def done(f: asyncio.Future[Any]) -> None:
            if not f.cancelled():
                f.exception()       # retrieved: nobody waits for it any more
            self._stage.put(s)
        return done

    async def _atomic(self, cas: bool, segment: int, offset: int, a: int, b: int) -> int:
        if self._failed is not None:
            raise self._failed
        raddr, rkey = await self._remote(segment, offset, 8)
        kind = "COMPARE_SWAP" if cas else "FETCH_ADD"
        fut = self._loop.create_future()
        slot = await self._alloc(fut, 1, kind, atomic=True)
        try:
            self._qp.post_atomic(cas, slot, self._comps.word_addr(slot), self._atomic_mr.lkey,
                                 raddr, rkey, a & MASK64, b & MASK64)
        except OSError as exc:
            raise self._post_error(slot, exc) from None
        try:
            return int(await self._wait(slot, fut, None))
        except TransportError as exc:
            raise await self._explain(exc, segment) from None

    async def fetch_add(self, segment: int, offset: int, value: int) -> int:
        return await self._atomic(False, segment, offset, value, 0)

    async def compare_swap(self, segment: int, offset: int, expected: int, new: int) -> int:
        return await self._atomic(True, segment, offset, expected, new)

    async def close(self) -> None:
        self._teardown(TransportError(f"the RDMA transport to {self.label} is closed",
                                      errno=errno_mod.ENOTCONN, server=self.label))
        await self._tcp.close()
