"""The shm transport: a server on this host, its segments mapped into ours.

The client keeps its TCP connection to the server for control messages,
accumulates, fenced writes and parked lock waits, exactly as the TCP
transport does.  What changes is everything one-sided: the server hands us
its segments' memfds (``server/shm.py``: a one-time ticket asked for over
the authenticated connection, claimed on the server's Unix socket, the fds
passed with ``SCM_RIGHTS``) and we map them, so that

* ``read_into`` / ``write`` are memcpys in this process (``_core.copy_into``,
  the GIL released for large copies): no system call, no server CPU;
* ``fetch_add`` / ``compare_swap`` are seq-cst CPU atomics on the mapped
  word (``_core.atomic_*``), the same instructions the server uses for the
  TCP clients' atomics and the lock table, so mixed clients never lose an
  update;
* ``accumulate`` is server-assisted: the delta goes over the connection and
  the server adds it, as for a TCP client.  That keeps an accumulate atomic
  with respect to every other accumulate and every write that passes
  through the server (TCP writes, fenced writes), which a client-side
  read-add-write on the mapping could only do with a lock of its own.  Like
  RDMA's one-sided writes, a shm client's plain write is not ordered against
  an accumulate on the same range: readers and writers who race there must
  hold a lock, over any fabric.

A segment's **state word** (behind its data, ``server/memfd.py``) says
whether its buffer still exists; every operation checks it, so an operation
on a destroyed buffer fails with ``NoSuchBuffer`` and never touches memory
the buffer no longer owns (our mapping keeps the pages alive regardless).
A server that stops to save its data directory first FREEZES every segment
(the word's third value): operations fail with ``TransportError``, and a
write or atomic reads the word again after its store, with a full fence
between, so one that returns is in the server's snapshot and one that
overlapped the freeze raises instead of reporting success.
The server's death is seen on the connection: once the loop has read its
end, every operation raises ``TransportError`` (the mapping stays valid, so
nothing crashes), and the link reconnects on the next one.
"""

from __future__ import annotations

import asyncio
import errno as errno_mod
import mmap
import os
import socket
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .. import _core
from ..errors import ErrorCode, OutOfMemory, TransportError, Unsupported, server_error
from ..host import boot_id, usable_cpus, writable_by_clients
from ..protocol import FENCE_SIZE, LOCK_SEGMENT, MASK64, unpack
from .base import FutexCapable
from .tcp import TcpTransport

# the state word's values (server/memfd.py)
_LIVE = 1
_GONE = 0
# fds one hand-out may carry (the server's MAX_SEGMENTS_PER_GRANT)
_MAX_FDS = 64
_MAX_REPLY = 64 << 10
# A copy is cut only where the caller's memory is: glibc's memcpy streams
# large copies past the cache (non-temporal stores), and 16 copies of 4 MiB
# run at about 0.65x of one of 64 MiB on the development machines.
_MAX_COPY = 1 << 30
# An operation on a mapping finishes without suspending, so a coroutine
# that loops on them (polling a flag, a reader pinging) would never let the
# loop run anything else: not the writer it waits for, not a timer, not the
# connection that tells it the server died.  Each transport yields to the
# loop once this long has passed since it last did (a clock read costs
# ~50 ns; a yield, a few microseconds, is paid at most once per interval).
_YIELD_EVERY = 0.0005
# Futex sleeps block a thread, never the loop: they run here (threads are
# made on demand).  A sleep is cut at MAX_SLEEP so that a sleeper also sees
# what moves the word without waking it (an RDMA client's atomic, a server
# of an older version), a dead server's connection, and a cancelled waiter
# gives its thread back soon.
_SLEEPERS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="smb2-futex")
MAX_SLEEP = 0.05


@dataclass(slots=True)
class _Mapping:
    """One segment mapped into this process."""

    mm: mmap.mmap
    whole: memoryview     # data and state word
    data: memoryview      # the segment's bytes
    state: int            # offset of the state word in ``whole``


class ShmTransport(FutexCapable):
    """A server on this host: one-sided operations on our mapping of its
    segments; the rest over ``control``, a :class:`TcpTransport`."""

    name = "shm"
    # the lock's words are in our mapping: futexes; parked waits over the
    # TCP connection; polling the mapping
    lock_waits = ("futex", "park", "poll")

    def __init__(self, control: TcpTransport) -> None:
        super().__init__(control.address)
        self._ctl = control
        self.server_info = control.server_info
        # copies are cut only where the caller's memory is; what travels over
        # TCP (accumulate, fenced writes) is cut to the connection's size
        self.max_request = _MAX_COPY
        self._frame = control.max_request
        # a fenced write's frame carries the fence too
        max_frame = control.server_info.get("max_frame")
        self._fenced_frame = min(self._frame, max_frame - FENCE_SIZE) if isinstance(max_frame, int) \
            and max_frame > FENCE_SIZE else self._frame
        self._maps: dict[int, _Mapping] = {}
        self._mapping_lock = asyncio.Lock()
        #: the server's Unix socket, once known
        self.socket_path: str | None = None
        self._yielded = time.monotonic()
        #: cleared when the connection closes or is lost: the buffers' fast
        #: path reads it instead of ``closed`` (see mapping_of)
        self.alive = _core.LiveFlag()
        control.on_lost = self._connection_lost

    def _connection_lost(self, exc: Exception) -> None:
        self.alive.live = False

    @classmethod
    async def upgrade(cls, control: TcpTransport, *, timeout: float = 10.0) -> ShmTransport:
        """Map the server's lock segment over ``control`` (authenticated):
        the shm transport, or TransportError saying why this server cannot
        be reached over shared memory (the caller still owns ``control``)."""
        if "shm" not in control.server_info.get("transports", ()):
            raise TransportError(f"{control.label} offers no shm: "
                                 f"{control.server_info.get('shm_off', 'not offered')}",
                                 server=control.label)
        self = cls(control)
        try:
            await asyncio.wait_for(self._map([LOCK_SEGMENT]), timeout)
        except (OutOfMemory, Unsupported) as exc:
            # the server offers shm and refused us this time (its tickets
            # are all waiting to be claimed, say): TCP still reaches it
            raise TransportError(f"{control.label} refused the shm hand-out: {exc}", server=control.label,
                                 hint="transport='auto' takes TCP; transport='tcp' does so always") from exc
        return self

    @property
    def closed(self) -> bool:
        return self._ctl.closed

    # -- mapping segments ------------------------------------------------------
    @property
    def mapped(self) -> list[int]:
        """The segments this transport maps now."""
        return sorted(self._maps)

    def _unmap_destroyed(self) -> None:
        # A mapping keeps its pages alive after the buffer is destroyed: drop
        # the ones whose buffer is gone, or a client that goes through many
        # short-lived buffers would hold all their memory.  (A copy still
        # running keeps its own view; the pages go with the last one.)
        for sid, m in list(self._maps.items()):
            if _core.atomic_load(m.whole, m.state) != _LIVE:
                del self._maps[sid]

    async def _map(self, segments: list[int]) -> None:
        self._unmap_destroyed()
        grant = await self._ctl.control({"cmd": "shm_grant", "segments": segments})
        here, there = boot_id(), grant.get("boot_id")
        if here is None or here != there:
            raise TransportError(
                f"{self.label} runs on another host (its boot id is {there}, ours {here})",
                server=self.label, hint="use transport='tcp' or 'rdma' for a remote server")
        path, ticket = grant.get("path"), grant.get("ticket")
        if not isinstance(path, str) or not isinstance(ticket, bytes):
            raise TransportError(f"{self.label}: malformed shm_grant reply", server=self.label)
        self.socket_path = path
        items, fds = await _claim(path, ticket, self.label)
        try:
            if len(items) != len(fds):
                raise TransportError(f"{self.label} sent {len(fds)} fds for {len(items)} segments",
                                     server=self.label)
            for (sid, size, state), fd in zip(items, fds):
                if os.fstat(fd).st_size < state + 8:
                    raise TransportError(f"{self.label}: segment {sid} is shorter than announced",
                                         server=self.label)
                # a replicated buffer's segment is sealed against writes
                # from here: its copies change only through the primary
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable_by_clients(fd) else 0)
                mm = mmap.mmap(fd, state + 8, flags=mmap.MAP_SHARED, prot=prot)
                whole = memoryview(mm)
                self._maps[sid] = _Mapping(mm, whole, whole[:size], state)
        finally:
            for fd in fds:
                os.close(fd)

    async def _map_first(self, segment: int) -> None:
        # the requests of one operation all meet the new segment at once:
        # one hand-out serves them all
        async with self._mapping_lock:
            if segment not in self._maps:
                await self._map([segment])

    # -- the buffers' fast path (_core.MappedStripes) ---------------------------
    #: how often an operation on a mapping lets the event loop run
    yield_every = _YIELD_EVERY

    @staticmethod
    def copy_threads() -> int:
        """Threads a large copy on a mapping may use: one per CPU this
        process may run on, at most ``_core.MAX_COPY_THREADS`` (see there)."""
        return min(usable_cpus(), _core.MAX_COPY_THREADS)

    def mapping_of(self, segment: int) -> tuple[memoryview, int, int, _core.LiveFlag] | None:
        """``segment`` as this transport maps it: (the mapping, the data's
        size, the offset of the state word, ``alive``), or None while it is
        not mapped.  A Buffer serves its operations straight from it (one
        Cython call each, ``_core.MappedStripes``) while ``alive.live``."""
        m = self._maps.get(segment)
        return None if m is None or not self.alive.live else (m.whole, len(m.data), m.state, self.alive)

    def _mapping(self, segment: int, offset: int, length: int) -> _Mapping:
        """The live mapping of ``segment`` holding the range (a plain call: the
        operations' fast path awaits only for a segment not mapped yet)."""
        if self._ctl.closed:
            raise self._lost()
        m = self._maps[segment]
        if _core.atomic_load(m.whole, m.state) != _LIVE:
            raise self._not_live(segment, m)
        if offset > len(m.data) or length > len(m.data) - offset:
            raise server_error(ErrorCode.OUT_OF_BOUNDS, f"{self.label}: range [{offset}, "
                               f"{offset + length}) is outside segment {segment} of {len(m.data)} bytes",
                               server=self.label)
        return m

    def _not_live(self, segment: int, m: _Mapping, done: str = "") -> Exception:
        """The error for an operation on a segment whose state word left
        LIVE (before it, or while it ran: ``done`` says what was done)."""
        self._maps.pop(segment, None)
        if _core.atomic_load(m.whole, m.state) == _GONE:
            return server_error(ErrorCode.NO_SUCH_BUFFER, f"{self.label}: no segment {segment} "
                                f"(its buffer was destroyed{done})", server=self.label)
        # FROZEN: the server is saving its memory to stop; it will not come
        # back to LIVE in this process, so this connection is done
        self.alive.live = False
        return TransportError(f"{self.label} is stopping: it froze segment {segment} to save it{done}",
                              errno=errno_mod.ECONNRESET, server=self.label,
                              hint="the server restarts with every acknowledged write; "
                              "the next operation reconnects")

    def _check_kept(self, segment: int, m: _Mapping, what: str) -> None:
        # after a store: the segment was still LIVE once the store was
        # visible, so the server's snapshot (taken after it leaves LIVE)
        # holds it (_core.load_after_stores)
        if _core.load_after_stores(m.whole, m.state) != _LIVE:
            raise self._not_live(segment, m, f" while this {what} ran; it may not have been kept")

    async def _let_others_run(self) -> None:
        now = time.monotonic()
        if now - self._yielded >= _YIELD_EVERY:
            self._yielded = now
            await asyncio.sleep(0)

    def _lost(self) -> TransportError:
        return TransportError(f"connection to {self.label} lost (the server is gone)",
                              errno=errno_mod.ECONNRESET, server=self.label)

    # -- one-sided: our own CPU ------------------------------------------------
    async def read_into(self, dst: Sequence[memoryview], segment: int, offset: int,
                        length: int) -> None:
        await self._let_others_run()
        if segment not in self._maps:
            await self._map_first(segment)
        data = self._mapping(segment, offset, length).data
        for piece in dst:
            n = len(piece)
            _core.copy_into(piece, data[offset:offset + n])
            offset += n

    async def write(self, src: Sequence[memoryview], segment: int, offset: int,
                    length: int) -> None:
        await self._let_others_run()
        if segment == LOCK_SEGMENT:
            # as the server refuses it: lock words change only by atomics
            raise server_error(ErrorCode.ACCESS_DENIED, f"{self.label}: the lock segment only takes "
                               "READ and atomics", server=self.label)
        if segment not in self._maps:
            await self._map_first(segment)
        m = self._mapping(segment, offset, length)
        data = m.data
        for piece in src:
            n = len(piece)
            _core.copy_into(data[offset:offset + n], piece)
            offset += n
        self._check_kept(segment, m, "write")

    async def fetch_add(self, segment: int, offset: int, value: int) -> int:
        await self._let_others_run()
        if segment not in self._maps:
            await self._map_first(segment)
        m = self._mapping(segment, offset, 8)
        old = int(_core.atomic_fetch_add(m.data, offset, value & MASK64))
        if segment != LOCK_SEGMENT:     # lock words are not saved
            self._check_kept(segment, m, "fetch_add")
        return old

    async def compare_swap(self, segment: int, offset: int, expected: int, new: int) -> int:
        await self._let_others_run()
        if segment not in self._maps:
            await self._map_first(segment)
        m = self._mapping(segment, offset, 8)
        old = int(_core.atomic_compare_swap(m.data, offset, expected & MASK64, new & MASK64))
        if segment != LOCK_SEGMENT:
            self._check_kept(segment, m, "compare_swap")
        return old

    # -- waiting on a word: futexes (the lock, notifications) -------------------
    async def wait_word(self, segment: int, offset: int, old: int, timeout: float,
                        spin: float = 0.0) -> int:
        """The u64 word at ``offset`` once it is no longer ``old``, or as it
        is after ``timeout`` seconds (at most ``MAX_SLEEP``; the caller
        loops).  Polls for ``spin`` seconds, yielding to the loop, then
        sleeps on a shared futex in a thread: whoever changes the word
        wakes it (``wake_word``; the server for the lock words)."""
        if segment not in self._maps:
            await self._map_first(segment)
        data = self._mapping(segment, offset, 8).data
        old &= MASK64
        value = int(_core.atomic_load(data, offset))
        if value != old:
            return value
        if spin > 0:
            until = time.monotonic() + min(spin, timeout)
            while time.monotonic() < until:
                await asyncio.sleep(0)
                value = int(_core.atomic_load(data, offset))
                if value != old:
                    self._yielded = time.monotonic()
                    return value
        await asyncio.get_running_loop().run_in_executor(
            _SLEEPERS, _core.futex_wait_u64, data, offset, old, min(timeout, MAX_SLEEP))
        self._yielded = time.monotonic()
        self._mapping(segment, offset, 8)       # the server died, or the buffer went, meanwhile?
        return int(_core.atomic_load(data, offset))

    async def wait_ticket(self, segment: int, offset: int, ticket: int, timeout: float) -> int:
        """The u64 ticket word at ``offset`` once it has reached ``ticket``
        (a lock's now_serving), or as it is after ``timeout`` seconds (at
        most ``MAX_SLEEP``).  Only a wake for this ticket (``wake_ticket``)
        or for everyone (``wake_word``) wakes this waiter."""
        if segment not in self._maps:
            await self._map_first(segment)
        data = self._mapping(segment, offset, 8).data
        await asyncio.get_running_loop().run_in_executor(
            _SLEEPERS, _core.futex_wait_ticket, data, offset, ticket & MASK64, min(timeout, MAX_SLEEP))
        self._yielded = time.monotonic()
        self._mapping(segment, offset, 8)       # the server died meanwhile?
        return int(_core.atomic_load(data, offset))

    def wake_ticket(self, segment: int, offset: int, ticket: int) -> None:
        """Wake the ``wait_ticket`` sleepers for ``ticket``, in any process."""
        m = self._maps.get(segment)
        if m is not None:
            _core.futex_wake_ticket(m.data, offset, ticket & MASK64)

    def wake_word(self, segment: int, offset: int) -> None:
        """Wake every ``wait_word`` sleeper on the word, in any process."""
        m = self._maps.get(segment)
        if m is not None:
            _core.futex_wake(m.data, offset)

    # -- through the server ------------------------------------------------------
    async def control(self, msg: dict[str, Any]) -> dict[str, Any]:
        return await self._ctl.control(msg)

    async def accumulate(self, src: Sequence[memoryview], segment: int, offset: int,
                         length: int, dtype_code: int) -> None:
        # ``at`` counts payload bytes; a widening dtype (bf16 into float32)
        # covers ``widen`` times as many bytes of the segment
        dst_item, src_item = _core.dtype_sizes(dtype_code)
        widen = dst_item // src_item
        for at, pieces, n in _cut(src, self._frame):
            await self._ctl.accumulate(pieces, segment, offset + at * widen, n, dtype_code)

    async def accumulate_sparse(self, payload: Sequence[memoryview], segment: int, offset: int,
                                flags: int) -> None:
        # over the connection, as a dense accumulate: the server adds it (the
        # client cut it to the connection's frames)
        await self._ctl.accumulate_sparse(payload, segment, offset, flags)

    async def write_fenced(self, src: Sequence[memoryview], segment: int, offset: int,
                           length: int, lock_key: int, token: int) -> None:
        # only the server can refuse a stale token before a byte lands
        for at, pieces, n in _cut(src, self._fenced_frame):
            await self._ctl.write_fenced(pieces, segment, offset + at, n, lock_key, token)

    async def replicated(self, op: int, flags: int, segment: int, offset: int,
                         payload: Sequence[memoryview | bytes]) -> int | None:
        # the primary's CPU forwards it to the backups: through the server
        return await self._ctl.replicated(op, flags, segment, offset, payload)

    async def lock_acquire(self, segment: int, offset: int) -> tuple[int, bool]:
        return await self._ctl.lock_acquire(segment, offset)

    async def lock_release(self, segment: int, offset: int, ticket: int) -> None:
        await self._ctl.lock_release(segment, offset, ticket)

    def lock_release_nowait(self, segment: int, offset: int, ticket: int) -> None:
        # sent now, not at the end of the loop iteration: a shm holder's next
        # acquire may sleep on the loop's own thread (lock.py, FUTEX_BLOCK),
        # and the queue behind this release would wait that long
        self._ctl.lock_release_nowait(segment, offset, ticket)
        self._ctl.flush()

    async def close(self) -> None:
        # the mappings are dropped, not unmapped: a copy still running in
        # another task keeps its view, and the pages go with the last one
        self.alive.live = False
        self._maps.clear()
        await self._ctl.close()


def _cut(src: Sequence[memoryview], limit: int) -> list[tuple[int, list[memoryview], int]]:
    """``src`` as consecutive requests of at most ``limit`` bytes each:
    (offset from the start, pieces, length).  Requests are cut at the same
    size for every transport of a client as long as they travel on a
    frame; only shm's own copies are not (``_MAX_COPY``)."""
    out: list[tuple[int, list[memoryview], int]] = []
    pieces: list[memoryview] = []
    start = filled = 0
    for piece in src:
        while len(piece):
            take = min(len(piece), limit - filled)
            pieces.append(piece[:take])
            piece = piece[take:]
            filled += take
            if filled == limit:
                out.append((start, pieces, filled))
                start, pieces, filled = start + filled, [], 0
    if filled:
        out.append((start, pieces, filled))
    return out


async def _claim(path: str, ticket: bytes, label: str) -> tuple[list[list[int]], list[int]]:
    """Claim ``ticket`` on the server's Unix socket: (segments, fds).

    On the loop, not in a thread: a loop kept busy (a coroutine polling a
    mapped word yields to it every half millisecond, and each of its turns
    releases the GIL for a moment in select) starves a thread that waits
    for the GIL -- CPython's convoy effect -- for seconds, long enough for
    the ticket to expire."""
    loop = asyncio.get_running_loop()
    fds: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.setblocking(False)
            async with asyncio.timeout(10.0):
                await loop.sock_connect(sock, path)
                await loop.sock_sendall(sock, ticket)
                await _readable(loop, sock)
                data, fds, flags, _ = socket.recv_fds(sock, _MAX_REPLY, _MAX_FDS)
                if flags & socket.MSG_CTRUNC:
                    raise TransportError(f"{label} sent more fds than one hand-out carries", server=label)
                while chunk := await loop.sock_recv(sock, _MAX_REPLY):
                    data += chunk
                    if len(data) > _MAX_REPLY:
                        raise TransportError(f"{label}: shm hand-out too long", server=label)
        reply = unpack(data)
        if not isinstance(reply, dict) or "segments" not in reply:
            message = reply.get("error") if isinstance(reply, dict) else None
            raise TransportError(f"{label} refused the shm hand-out: {message or 'malformed reply'}",
                                 server=label)
        items = reply["segments"]
        if not (isinstance(items, list) and all(isinstance(i, list) and len(i) == 3 for i in items)):
            raise TransportError(f"{label}: malformed shm hand-out", server=label)
        return items, fds
    except TimeoutError:
        for fd in fds:
            os.close(fd)
        raise TransportError(f"{label}'s Unix socket {path} did not hand out the segments within 10 s",
                             server=label) from None
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        raise TransportError(f"cannot reach {label}'s Unix socket {path}: {exc.strerror or exc}",
                             errno=exc.errno, server=label,
                             hint="a server in another container or mount namespace cannot be "
                                  "mapped; use transport='tcp'") from None
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Until ``sock`` has something to read (recv_fds has no loop method)."""
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)
    loop.add_reader(sock.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())
