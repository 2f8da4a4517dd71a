"""The memory server: owns RAM as segments and serves them to clients.

listener -> :class:`Connection` (frames, ``protocol.FrameReceiver``) ->
:class:`MemoryServer` (segments, capacity, stats).  The server never trusts a
client: every header is validated before anything is allocated, a refused
request gets an error reply, a malformed stream gets that one connection
closed with a reason, and nothing one client sends can stop the others.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import ipaddress
import itertools
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, cast

from .. import _core, auth
from ..checks import is_int
from ..errors import ErrorCode, PersistenceError, TransportError
from ..membership import View
from ..placement import Placement
from ..protocol import (
    CLOSED,
    DEFAULT_PORT,
    DISCARD,
    DTYPE_MASK,
    DTYPE_SHIFT,
    FENCE_SIZE,
    FLAG_FENCED,
    FLAG_NOREPLY,
    FLAG_REPLY,
    FLAG_STAGED,
    H_FLAGS,
    H_LENGTH,
    H_OFFSET,
    H_OP,
    H_REQUEST,
    H_SEGMENT,
    H_VERSION,
    INLINE,
    LOCK_OPS,
    LOCK_SEGMENT,
    MAX_ACCUMULATE,
    MAX_CONTROL,
    PEEK_BYTES,
    PEEK_READS,
    REPL_FLAGS,
    REPL_PREFIX_SIZE,
    REPLICATED_OPS,
    VERSION,
    Destination,
    FrameReceiver,
    Header,
    Op,
    Prefix,
    accumulate_span,
    error_payload,
    pack,
    parse_address,
    parse_size,
    unpack,
)
from ..version import __version__
from . import sparse
from .datadir import DataDir
from .guard import Admission, MemoryPool, RateLimitedLog
from .locks import LockService
from .memfd import FROZEN, LIVE, mark, mark_gone, raise_fd_limit
from .metrics import MetricsExporter, RequestCounts
from .metrics import parse_address as parse_metrics_address
from .options import ServerOptions
from .rdma import STAGING_BYTES, RdmaServer
from .replication import Replication
from .segment import Refused, Segment, alloc
from .shm import ShmService

log = logging.getLogger("smb2.server")

MAX_NAME = 255
MAX_BUFFER_ID = 64        # clients send 16 hex digits
# Before a connection has authenticated it holds a small inbox and may send
# nothing larger than a hello or an auth message (both are ~100 bytes).
PREAUTH_INBOX = 8 << 10
PREAUTH_MAX_CONTROL = 4 << 10
# a token shorter than this gets a warning at start: it could be guessed
MIN_TOKEN = 16
# a connection idle this long gives back its inbox and scratch
RELEASE_IDLE = 2.0
# accumulate deltas one connection may have waiting behind in-flight writes
MAX_DEFERRED = 2 * MAX_ACCUMULATE
# connections the kernel may hold accepted before the loop takes them: a
# job's workers all connect at start
LISTEN_BACKLOG = 4096


def listen_backlog_cap() -> int | None:
    """The kernel's cap on a listen backlog (net.core.somaxconn), if known."""
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


class MemoryServer:
    """Segments, capacity, connections and statistics of one memory server.

    Create it with :func:`start_server`; ``address`` is ``(host, port)``."""

    def __init__(self, options: ServerOptions | None = None, /, **overrides: Any) -> None:
        """``options``, or ServerOptions' fields as keyword arguments
        (``capacity="8GiB", lock_lease=2.0``), or both (the keywords win)."""
        if options is None:
            options = ServerOptions(**overrides)
        elif overrides:
            options = dataclasses.replace(options, **overrides)
        self.options = options
        # the caps' defaults assumed the hard file limit (sizing.py): take it now
        raised = raise_fd_limit()
        if raised is not None:
            log.info("raised this process's file limit (ulimit -n) from %d to its hard limit %d", *raised)
        self.capacity = parse_size(options.capacity)
        # a connection that stops sending in the middle of a WRITE is closed
        # after this long: its half-received range holds up every accumulate
        # that overlaps it (see Segment.inflight)
        self.write_timeout = options.write_timeout
        # ... and so is one that trickles: it must bring this many bytes of
        # its payload per write_timeout
        self.write_progress = max(1, int(parse_size(options.write_min_rate) * options.write_timeout))
        self.max_reply_bytes = parse_size(options.max_reply_bytes)
        # connection counts; unauthenticated connections make room (guard.py)
        assert options.max_connections is not None and options.max_connections_per_host is not None
        self.admission = Admission(options.max_connections, options.max_connections_per_host)
        # accumulate scratch and deferred deltas of all connections together
        self.receive_pool = MemoryPool(parse_size(options.max_receive_memory))
        self.warn = RateLimitedLog(log).warning
        self._sweeper: asyncio.Task[None] | None = None
        # segments are saved here on close and restored on start (datadir.py)
        self.data_dir = DataDir(options.data_dir) if options.data_dir is not None else None
        # the shared secret clients must prove they know (None: no authentication)
        self.token = auth.as_token(options.token)
        # the servers' own secret: a peer proves it (auth.peer_proof)
        self.peer_token = auth.as_token(options.peer_token)
        self.auth_failures = 0
        self.max_frame = parse_size(options.max_frame)
        self.max_buffers = options.max_buffers
        # threads one accumulate is cut among (ServerOptions made it a number):
        # the loop waits for all of them, so every op stays in the order the
        # loop took it, as with one
        assert options.threads is not None
        self.threads = options.threads
        self.thread_part = parse_size(options.thread_part)
        # accumulates cut among more than one thread, and their parts (stat)
        self.accumulates_cut = 0
        self.accumulate_parts = 0
        self.used = 0
        self.segments: dict[int, Segment] = {}
        self.by_name: dict[str, Segment] = {}
        self._ids = itertools.count(1)
        # segments restored from the data directory at start: a client's
        # handle from before the restart may go on using them (lookup says so)
        self.restored: set[int] = set()
        # they are the state the last run ended with (a planned stop saved
        # it), not an older save (datadir.RUNNING): replication.py vouches
        self.restored_clean = False
        self.connections: set[Connection] = set()
        self.started = time.time()
        # data operations this server's CPU executed, per transport: per op
        # how many, how long each took, their bytes (metrics.RequestCounts)
        self.requests: dict[str, RequestCounts] = collections.defaultdict(RequestCounts)
        self.bytes_in = 0
        self.bytes_out = 0
        # control commands answered, by command (stat's "controls")
        self.controls: collections.Counter[str] = collections.Counter()
        # what was refused, by why: an error code's name in lower case, or
        # connection_limit / auth_failed (--metrics)
        self.refusals: collections.Counter[str] = collections.Counter()
        # clients refused RDMA at --max-rdma-connections (they go on over TCP),
        # and RDMA peers given no staging area (their accumulates come in-band)
        self.rdma_refused = 0
        self.rdma_unstaged = 0
        # connections cut by the sweep, by which deadline (and those closed to
        # make room for a new one: admission.evicted)
        self.cuts: collections.Counter[str] = collections.Counter()
        self._server: asyncio.AbstractServer | None = None
        self.address: tuple[str, int] = ("", 0)
        self.server_id = os.urandom(8).hex()
        # the lock segment: lock words in memory an RDMA transport registers
        # like a buffer's segment (locks.py)
        # memfds (2 fds each) only where the shm hand-out may pass them on
        self.shared_memory = options.shm != "off"
        mem, view = alloc(options.lock_slots * _core.LOCK_SLOT_SIZE, shared=self.shared_memory)
        self.segments[LOCK_SEGMENT] = Segment(LOCK_SEGMENT, "", 0, 8, 1, 0, len(view), mem, view)
        self.locks = LockService(mem, view, slots=options.lock_slots, lease=options.lock_lease,
                                 max_lease=options.lock_max_lease,
                                 spin=options.lock_spin, clients=lambda: self.connections)
        # RDMA (rdma.py): opened at start() unless rdma="off"
        self.rdma: RdmaServer | None = None
        self.rdma_reason: str | None = "not started"
        # the hand-out of segments to clients on this host (shm.py)
        self.shm: ShmService | None = None
        self.shm_reason: str | None = "not started"
        # the Prometheus endpoint (options.metrics; metrics.py)
        self.metrics: MetricsExporter | None = None
        # replicated buffers (options.membership; replication.py): made at start()
        self.replication: Replication | None = None
        self.repair_rate = parse_size(options.repair_rate)
        self.replace_after = float(options.replace_after)
        self.dedup_clients = options.dedup_clients

    def __repr__(self) -> str:
        host, port = self.address
        where = f"{host}:{port}" if port else "not listening"
        return (f"<MemoryServer {where}: {len(self.by_name)} buffers, {self.used} of {self.capacity} "
                f"bytes used, {len(self.connections)} connections, rdma {'on' if self.rdma else 'off'}>")

    # -- lifecycle --------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
        mode = self.options.rdma
        if mode == "off":
            self.rdma_reason = "the server runs with rdma off"
        elif self.rdma is None:
            assert self.options.rdma_staging_memory is not None
            self.rdma, self.rdma_reason = RdmaServer.open(
                self.options.rdma_device, self.options.rdma_gid_index,
                parse_size(self.options.rdma_staging_memory) // STAGING_BYTES)
            if self.rdma is None and mode == "on":
                raise TransportError(f"rdma=on, but RDMA is not available: {self.rdma_reason}")
            log.info("RDMA: %s", self.rdma.describe() if self.rdma else f"off ({self.rdma_reason})")
        loop = asyncio.get_running_loop()
        if self.data_dir is not None:
            # restored before listening: no client ever sees the server empty
            self.data_dir.acquire()
            try:
                restored, next_id = self.data_dir.load(self.capacity, taken=self.segments,
                                                             shared=self.shared_memory)
            except BaseException:
                self.data_dir.release()
                raise
            for seg in restored:
                self._add(seg)
                self.restored.add(seg.id)
            self.restored_clean = bool(restored) and self.data_dir.clean
            self._ids = itertools.count(next_id)
        if self.rdma is not None:
            # segments made before RDMA was open (the lock segment, restored
            # buffers) are registered now; create() registers later ones
            for seg in self.segments.values():
                if seg.id not in self.rdma.mrs:
                    access = self.rdma.lock_access if seg.id == LOCK_SEGMENT else self.rdma.access_of(seg)
                    self.rdma.register(seg.id, seg.view, access)
        try:
            # a job's workers connect at once: a short backlog would drop their
            # SYNs into the kernel's retransmit back-off (seconds)
            self._server = await loop.create_server(
                lambda: Connection(self), host, port, reuse_address=True, backlog=LISTEN_BACKLOG)
        except BaseException:
            if self.data_dir is not None:
                self.data_dir.release()
            raise
        sock = self._server.sockets[0]
        self.address = sock.getsockname()[:2]
        if self.options.membership is not None:
            me = self.options.advertise or f"{self.address[0]}:{self.address[1]}"
            self.replication = Replication(self, self.options.membership, me)
            await self.replication.start()
        self._start_shm()
        if self.token is None and not _is_loopback(host):
            log.warning("listening on %s without an authentication token: anyone who can reach "
                        "this port can read and write its memory (--auth-token-file or %s)",
                        host or "all addresses", auth.ENV)
        if self.token is not None and len(self.token) < MIN_TOKEN:
            # every proof is checked (no back-off to lock out a guesser's
            # neighbours): the token's length is what keeps guessing hopeless
            log.warning("the authentication token is %d bytes: a short token can be guessed; "
                        "use at least %d random bytes (openssl rand -hex 32)", len(self.token), MIN_TOKEN)
        self._sweeper = asyncio.create_task(self._sweep())
        self.locks.start()
        if self.options.metrics is not None:
            # read-only over the counters above (metrics.py): no per-request work
            self.metrics = MetricsExporter(self)
            try:
                await self.metrics.start(*parse_metrics_address(self.options.metrics))
            except BaseException:       # the port is taken: no half-started server
                await self.close(save=False)
                raise
        log.info("listening on %s:%d (capacity %d bytes)", *self.address, self.capacity)
        self._state_limits()

    def _state_limits(self) -> None:
        """Log the caps and what the machine-sized ones came from; warn where
        the kernel caps the listen backlog below LISTEN_BACKLOG."""
        opts, sizing = self.options, self.options.sizing
        log.info("caps: --max-connections %s, --max-connections-per-host %s, --max-rdma-connections %s, "
                 "--rdma-staging-memory %s, --max-buffers %s (sized from file limit %s, memory %s MiB)",
                 opts.max_connections, opts.max_connections_per_host, opts.max_rdma_connections,
                 opts.rdma_staging_memory, opts.max_buffers, sizing.fd_limit if sizing else "?",
                 sizing.memory >> 20 if sizing else "?")
        somaxconn = listen_backlog_cap()
        if somaxconn is not None and somaxconn < LISTEN_BACKLOG:
            log.warning("the kernel caps the listen backlog at %d (net.core.somaxconn), below %d: workers that "
                        "connect at once beyond it wait for SYN retransmits (seconds); raise it with "
                        "sysctl -w net.core.somaxconn=%d", somaxconn, LISTEN_BACKLOG, LISTEN_BACKLOG)

    def _start_shm(self) -> None:
        if self.options.shm == "off":
            self.shm_reason = "the server runs with shm off"
            return
        self.shm, self.shm_reason = ShmService.open(self.options.shm_socket, self.address[1])
        if self.shm is None:
            log.info("shm: off (%s)", self.shm_reason)
        else:
            self.shm.start()

    def transports(self) -> list[str]:
        """What a client can use to reach this server (hello, stat)."""
        return ["tcp", *(["rdma"] if self.rdma else []), *(["shm"] if self.shm else [])]

    async def _sweep(self) -> None:
        """Cut connections that stall, never authenticate or sit idle; give
        back idle connections' memory."""
        opts = self.options
        period = min([1.0] + [t / 4 for t in (opts.write_timeout, opts.hello_timeout, opts.idle_timeout) if t > 0])
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for conn in list(self.connections):
                why = conn.overdue(now)
                if why is not None:
                    self.cuts[why[0]] += 1
                    conn.cut(why[1])
                elif conn.idle_for(now) > RELEASE_IDLE:
                    conn.release_memory()

    def reclaim_memory(self) -> None:
        """Idle connections give back their scratch (the pool ran short)."""
        for conn in self.connections:
            conn.release_memory()

    async def close(self, *, save: bool = True) -> None:
        """Save the segments (with a data directory, unless ``save`` is
        false), then stop listening, drop every connection and release all
        segments.

        A save that fails (disk full) raises :class:`PersistenceError` and
        leaves the server serving as before, with its segments in memory and
        the previous saved state intact: free space and close again, or
        ``close(save=False)`` to drop them."""
        if self._server is not None:
            if self.data_dir is not None and save:
                self.save()
                # nothing more is applied: the save holds all this run acknowledged
                self.data_dir.stopped()
            self._server.close()
            for conn in list(self.connections):
                conn.abort("server shutting down")
            await self._server.wait_closed()
            if self._sweeper is not None:
                self._sweeper.cancel()
                self._sweeper = None
            self._server = None
            if self.data_dir is not None:
                self.data_dir.release()
        if self.metrics is not None:
            await self.metrics.close()
            self.metrics = None
        if self.replication is not None:
            await self.replication.close()
        await self.locks.close()
        if self.shm is not None:
            await self.shm.close()
            self.shm = None
        if self.rdma is not None:
            self.rdma.close()
            self.rdma = None
        self.segments.clear()
        self.by_name.clear()
        self.used = 0

    def save(self) -> None:
        """Freeze the segments and write them to the data directory, to stop
        (PersistenceError; the segments are then LIVE again).

        Synchronous: no request through this server runs while it writes.
        Writers that do not pass through it are stopped first: every
        segment's state word becomes FROZEN, so shm clients refuse new
        operations, and one whose store overlapped the change reads the
        word after its store and raises instead of reporting success; the
        RDMA registrations are withdrawn, so a one-sided write fails rather
        than lands unseen.  What is saved is thus every acknowledged
        write; one still in flight may be torn, but never against its own
        file's checksum (datadir.py copies each chunk before hashing).  The
        buffers' segments only: the lock segment's leases mean nothing to
        the next server process."""
        assert self.data_dir is not None
        segs = list(self.by_name.values())
        for seg in segs:
            mark(seg.view, FROZEN)
        if self.rdma is not None:
            for seg in segs:
                self.rdma.deregister(seg.id)
        try:
            self.data_dir.save(segs, self.next_segment_id())
        except BaseException as exc:
            # the previous manifest is intact: the last good state survives,
            # and the server goes on serving what it holds
            for seg in segs:
                mark(seg.view, LIVE)
            if self.rdma is not None:
                for seg in segs:
                    self.rdma.register(seg.id, seg.view, self.rdma.access_of(seg))
            if isinstance(exc, OSError):
                raise PersistenceError(f"cannot save the segments to {self.data_dir.path}: {exc}") from exc
            raise

    async def __aenter__(self) -> MemoryServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def add(self, dst: memoryview, delta: memoryview | bytes, code: int) -> None:
        """``dst += delta`` (dtype ``code``), cut among this server's threads;
        done when it returns."""
        parts = _core.accumulate(dst, delta, code, self.threads, self.thread_part)
        if parts > 1:
            self.accumulates_cut += 1
            self.accumulate_parts += parts

    # -- control commands ----------------------------------------------
    def create(self, name: str, nbytes: int, stripe: int, nservers: int, index: int,
               buffer_id: str | None = None, seal: bool = False, *, replicas: int = 1,
               servers: list[str] | None = None, zones: list[str | None] | None = None) -> dict[str, Any]:
        """The part ``index`` of buffer ``name``: made (zero-filled, with
        the identity ``buffer_id``, sealed if ``seal``) when this server
        has none, else the one it has, sealed now if ``seal`` and the
        identity is the same.  A client without identities (no
        ``buffer_id``) makes sealed parts of identity "".  ``replicas`` > 1:
        a replicated buffer over ``servers`` (with their ``zones``), which
        needs this server in a replicated cluster (``--membership``)."""
        if not 0 < len(name.encode()) <= MAX_NAME:
            raise Refused(ErrorCode.BAD_REQUEST, f"buffer names are 1..{MAX_NAME} bytes")
        if nbytes <= 0 or stripe <= 0 or stripe % 8 or nservers <= 0 or not 0 <= index < nservers:
            raise Refused(ErrorCode.BAD_REQUEST, "bad buffer geometry")
        if replicas == 1:
            size = _core.segment_size(nbytes, stripe, nservers)
        else:
            size = self._replicated_size(name, nbytes, stripe, nservers, index, replicas, servers, zones)
        seg = self.by_name.get(name)
        if seg is not None:
            same = ((seg.nbytes, seg.stripe, seg.nservers, seg.index, seg.replicas)
                    == (nbytes, stripe, nservers, index, replicas))
            if not same:
                raise Refused(
                    ErrorCode.CONFLICT,
                    f"buffer {name!r} exists with nbytes={seg.nbytes} stripe={seg.stripe} "
                    f"over {seg.nservers} servers (this server #{seg.index}, {seg.replicas} replicas); asked "
                    f"for nbytes={nbytes} stripe={stripe} over {nservers} servers (#{index}, {replicas} "
                    "replicas)")
            if seal and seg.buffer_id == buffer_id:
                seg.sealed = True
            return {**seg.info(), "created": False}
        if len(self.by_name) >= self.max_buffers:      # the lock segment is not a buffer
            raise Refused(ErrorCode.OUT_OF_MEMORY, f"server holds its maximum of {self.max_buffers} buffers")
        if self.used + size > self.capacity:
            raise Refused(ErrorCode.OUT_OF_MEMORY,
                          f"buffer {name!r} needs {size} bytes on this server; "
                          f"{self.capacity - self.used} of {self.capacity} are free")
        try:
            # a replicated buffer's copies change only through its primary
            mem, view = alloc(size, clients_write=replicas == 1, shared=self.shared_memory)
        except (OSError, MemoryError, OverflowError) as exc:
            raise Refused(ErrorCode.OUT_OF_MEMORY, f"cannot map {size} bytes: {exc}") from None
        seg = Segment(next(self._ids), name, nbytes, stripe, nservers, index, size, mem, view,
                      buffer_id="" if buffer_id is None else buffer_id, sealed=buffer_id is None or seal,
                      replicas=replicas, servers=tuple(servers or ()),
                      zones=None if zones is None else tuple(zones))
        if self.rdma is not None:
            self.rdma.register(seg.id, view, self.rdma.access_of(seg))     # once, for its lifetime
        self._add(seg)
        log.debug("created buffer %r: segment %d, %d bytes", name, seg.id, size)
        return {**seg.info(), "created": True}

    def _replicated_size(self, name: str, nbytes: int, stripe: int, nservers: int, index: int,
                         replicas: int, servers: list[str] | None, zones: list[str | None] | None) -> int:
        if self.replication is None:
            raise Refused(ErrorCode.UNSUPPORTED, f"buffer {name!r} asks for {replicas} replicas; this "
                          "server is not part of a replicated cluster (start it with --membership)")
        if not 1 < replicas <= nservers or servers is None or len(servers) != nservers or (
                zones is not None and len(zones) != nservers) or len(set(servers)) != nservers:
            raise Refused(ErrorCode.BAD_REQUEST, f"a buffer of {replicas} replicas over {nservers} servers "
                          f"names {nservers} distinct servers (and zones), at most {nservers} replicas")
        if servers[index] != self.replication.me:
            raise Refused(ErrorCode.CONFLICT, f"part {index} of {name!r} belongs to server {servers[index]}; "
                          f"this server is {self.replication.me} in the view")
        return Placement(nservers, nbytes, stripe, _core.name_hash(name) % nservers, replicas,
                         zones).segment_size(index)

    def _add(self, seg: Segment) -> None:
        self.segments[seg.id] = seg
        self.by_name[seg.name] = seg
        self.used += seg.size

    def lookup(self, name: str) -> dict[str, Any]:
        seg = self.by_name.get(name)
        if seg is None:
            raise Refused(ErrorCode.NO_SUCH_BUFFER, f"no buffer named {name!r}")
        return {**seg.info(), "restored": seg.id in self.restored}

    def next_segment_id(self) -> int:
        """The id the next segment would get (segment ids are never reused
        by this server, nor, through its data directory, by its successors)."""
        nxt = next(self._ids)
        self._ids = itertools.count(nxt)
        return nxt

    def add_copy(self, of: Segment, index: int) -> Segment:
        """A segment for part ``index`` of replicated buffer ``of`` (another
        server's part, held here in a lost server's stead: replication.py):
        not a buffer of its own (not listed, not saved), reachable by id."""
        if self.used + of.size > self.capacity:
            raise Refused(ErrorCode.OUT_OF_MEMORY, f"a copy of part {index} of buffer {of.name!r} needs {of.size} "
                          f"bytes on this server; {self.capacity - self.used} of {self.capacity} are free")
        mem, view = alloc(of.size, shared=self.shared_memory)
        seg = dataclasses.replace(of, id=next(self._ids), index=index, mem=mem, view=view, inflight=[],
                                  deferred=collections.deque(), created=time.time())
        if self.rdma is not None:
            self.rdma.register(seg.id, view)
        self.segments[seg.id] = seg
        self.used += seg.size
        return seg

    def drop_copy(self, seg: Segment) -> None:
        """Release a segment made by add_copy."""
        if self.segments.pop(seg.id, None) is None:
            return
        self.used -= seg.size
        if self.rdma is not None:
            self.rdma.deregister(seg.id)
        mark_gone(seg.view)

    def destroy(self, name: str) -> dict[str, Any]:
        seg = self.by_name.pop(name, None)
        if seg is None:
            return {"destroyed": False}
        if self.replication is not None:
            self.replication.forget(name)
        del self.segments[seg.id]
        self.used -= seg.size
        if self.rdma is not None:
            # in-flight RDMA to it now fails with a remote access error
            self.rdma.deregister(seg.id)
        # shm clients that map it see it gone at their next operation
        mark_gone(seg.view)
        # The memory is released when the last view of it is gone (a reply
        # still being sent may hold one).
        return {"destroyed": True, "replicas": seg.replicas}

    @property
    def ops(self) -> dict[str, dict[str, int]]:
        """Data operations executed: {transport: {op: count}}, nonzero only."""
        return {t: c for t, r in self.requests.items() if (c := r.counts())}

    @property
    def limits(self) -> dict[str, Any]:
        """The caps in force, and what the machine-sized ones came from
        (stat, smb2 doctor, the smb2_limit metric)."""
        opts = self.options
        return {"max_connections": opts.max_connections, "max_connections_per_host": opts.max_connections_per_host,
                "max_rdma_connections": opts.max_rdma_connections, "max_buffers": self.max_buffers,
                "rdma_staging_areas": parse_size(opts.rdma_staging_memory or 0) // STAGING_BYTES,
                "listen_backlog": LISTEN_BACKLOG, **(opts.sizing.describe() if opts.sizing else {})}

    @property
    def refused(self) -> int:
        """Requests and connections refused, all reasons."""
        return sum(self.refusals.values())

    def stat(self) -> dict[str, Any]:
        return {
            "server_id": self.server_id,
            "address": f"{self.address[0]}:{self.address[1]}",
            "version": VERSION,
            "uptime_s": round(time.time() - self.started, 3),
            # the server's wall clock: smb2 doctor measures each server's offset
            "time": time.time(),
            "package_version": __version__,
            "capacity": self.capacity,
            "used": self.used,
            "buffers": {s.name: {**{k: v for k, v in s.info().items() if k != "name"},
                                 **({"degraded": self.replication.degraded(s)}
                                    if self.replication is not None and s.replicas > 1 else {})}
                        for s in self.by_name.values()},
            "connections": len(self.connections),
            # the caps in force and what the machine-sized ones came from (smb2 doctor)
            "limits": self.limits,
            "rdma_connections": len(self.rdma.peers) if self.rdma else 0,
            "rdma_refused": self.rdma_refused,
            "rdma_staging_lent": self.rdma.staging_lent if self.rdma else 0,
            "rdma_unstaged": self.rdma_unstaged,
            "ops": self.ops,
            "controls": dict(self.controls),
            "transports": self.transports(),
            "rdma": self.rdma.describe() if self.rdma else {"off": self.rdma_reason},
            "shm": ({"socket": self.shm.path, "fds_handed_out": self.shm.handed_out,
                     "tickets_withdrawn": self.shm.withdrawn} if self.shm
                    else {"off": self.shm_reason}),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "refused": self.refused,
            "auth": auth.MECH if self.token is not None else None,
            "auth_failures": self.auth_failures,
            "unauthenticated_evicted": self.admission.evicted,
            "connections_refused": self.admission.refused,
            "receive_memory": {"used": self.receive_pool.used, "peak": self.receive_pool.peak,
                               "limit": self.receive_pool.limit},
            "locks": self.locks.stat(),
            "threads": {"threads": self.threads, "part": self.thread_part,
                        "accumulates_cut": self.accumulates_cut, "parts": self.accumulate_parts},
            **({"replication": self.replication.stat()} if self.replication is not None else {}),
        }


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False     # "" (all addresses), a host name: treat as exposed


def _comes_from(address: str, source: str) -> bool:
    """May a connection from ``source`` (an IP) be the server ``address``
    ("host:port")?  Checked where the host is an IP literal (a name would
    need a lookup on the loop: it is taken as said)."""
    try:
        host = parse_address(address)[0]
        return ipaddress.ip_address(host) == ipaddress.ip_address(source)
    except ValueError:
        return True


def _str(msg: dict[str, Any], key: str) -> str:
    v = msg.get(key)
    if not isinstance(v, str):
        raise Refused(ErrorCode.BAD_REQUEST, f"control field {key!r} must be a string")
    return v


def _uint(msg: dict[str, Any], key: str) -> int:
    v = msg.get(key)
    if not is_int(v) or not 0 <= v < 1 << 63:
        raise Refused(ErrorCode.BAD_REQUEST, f"control field {key!r} must be a non-negative integer")
    return int(v)


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


# A reply payload up to this size is copied behind its header into one
# frame (one write, and corked with its neighbours); a larger one goes out
# as header + payload in one writev, not copied.
COPY_REPLY_MAX = 64 << 10
# close_with without a request to answer: the reason goes out as a reply to
# request id 0 of op 0, which the client reads as the connection's last word
NO_REQUEST: Header = (0,) * 9
# a staged accumulate's payload: u64 staging offset, u64 length
STAGED_PAYLOAD = 16
# the ops that add their payload: held whole in scratch, so bounded alike
ACCUMULATES = frozenset({Op.ACCUMULATE, Op.ACCUMULATE_SPARSE})
_FENCE = Prefix(FENCE_SIZE)


class Connection(FrameReceiver):
    """One client connection: validates frames and executes them."""

    transport_name = "tcp"

    def __init__(self, server: MemoryServer) -> None:
        super().__init__()
        self.inbox_size = PREAUTH_INBOX      # the full inbox once authenticated
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.host = "?"
        self.greeted = False
        # set by a valid ``auth`` (or by ``hello`` when the server has no token);
        # until then only auth.PUBLIC_COMMANDS are answered
        self.authed = False
        self._nonce = b""
        # the server this connection says it is, until it proves it (peer_auth)
        self._peer_claim: str | None = None
        self._peer_nonce = b""
        self._paused = False
        self._uvloop = False
        # the write whose payload is being received in place: (segment, range)
        self._write: tuple[Segment, tuple[int, int]] | None = None
        # bytes of accumulate deltas waiting for an overlapping write
        self._deferred_bytes = 0
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
        if self._write is not None:
            seg, rng = self._write
            self._write = None
            seg.write_done(rng)
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
        if self._inflight or self.mid_frame or self._write is not None:
            return 0.0
        return now - self._last_rx

    # Memory for payloads (accumulate scratch) comes from the server's pool:
    # a connection that does not fit waits, not reading, until memory is given back.
    def reserve(self, nbytes: int) -> bool:
        pool = self.server.receive_pool
        if not pool.fits(nbytes):
            self.server.reclaim_memory()
            if not pool.fits(nbytes):
                self._wait_for_memory()
                return False
        pool.take(nbytes)
        return True

    def unreserve(self, nbytes: int) -> None:
        self.server.receive_pool.give(nbytes)

    def _wait_for_memory(self) -> None:
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
        check = self._HEADER_CHECKS.get(op)
        if check is None:
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
            if flags & REPL_FLAGS:
                return self._check_replicated(hdr, size)
            return check(self, hdr, size)
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
    # payload goes, or Refused.
    def _check_lock_op(self, hdr: Header, size: int) -> Destination:
        self.server.locks.check_header(hdr, size)
        return INLINE

    def _check_replicated(self, hdr: Header, size: int) -> Destination:
        # the payload comes whole (INLINE): it is applied here and forwarded
        # to the backups in one step (replication.py)
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
        self._segment(hdr[H_SEGMENT], hdr[H_OFFSET], hdr[H_LENGTH])
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
            if size != STAGED_PAYLOAD or self.rdma_peer is None:
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
        if flags & FLAG_STAGED and (size != STAGED_PAYLOAD or self.rdma_peer is None):
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
            self.refuse(hdr, ErrorCode.STALE_FENCE,
                         f"write fenced with token {token} refused: the lock was lost "
                         "(lease expired, released, or a newer holder wrote here)")
            return DISCARD
        seg = self.server.segments.get(hdr[H_SEGMENT])
        if seg is None:     # destroyed between header and prefix
            self.refuse(hdr, ErrorCode.NO_SUCH_BUFFER, f"no segment {hdr[H_SEGMENT]}")
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

    def on_frame(self, hdr: Header, payload: memoryview | None) -> None:
        op = hdr[H_OP]
        try:
            if op == Op.CONTROL:
                assert payload is not None
                self._control(hdr, payload)
            elif hdr[H_FLAGS] & REPL_FLAGS:
                assert payload is not None and self.server.replication is not None
                self.server.replication.on_frame(self, hdr, payload)
            else:
                self._EXECUTE[op](self, hdr, payload)
        except Refused as exc:
            self.refuse(hdr, exc.code, str(exc), **exc.extra)
        except Exception as exc:  # a bug must cost one request, not the server
            log.exception("internal error handling op %d from %s", op, self.peer)
            self.refuse(hdr, ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
        if op != Op.CONTROL:
            # counted here, refused or not: the op count is the histogram's
            self.counts.time[op].observe(time.monotonic_ns() - self._frame_started)

    # Each op, executed once its frame is all in (its header was checked).
    def _do_lock_op(self, hdr: Header, payload: memoryview | None) -> None:
        assert payload is not None
        self.server.locks.on_frame(self, hdr, payload)

    def _do_read(self, hdr: Header, payload: memoryview | None) -> None:
        # no payload: this runs right after on_header found the segment
        seg = self.server.segments[hdr[H_SEGMENT]]
        offset = hdr[H_OFFSET]
        self.counts.bytes_out[hdr[H_OP]] += hdr[H_LENGTH]
        self.reply(hdr, seg.view[offset:offset + hdr[H_LENGTH]])

    def _do_write(self, hdr: Header, payload: memoryview | None) -> None:
        offset, length = hdr[H_OFFSET], hdr[H_LENGTH]
        if hdr[H_FLAGS] & FLAG_FENCED:
            length -= FENCE_SIZE
        self.server.bytes_in += length
        self.counts.bytes_in[hdr[H_OP]] += length
        if self._write is not None:
            wseg, rng = self._write
            self._write = None
            if payload is not None and length:
                # the part that came inline (a short write, or one whose
                # payload arrived with its header)
                _core.copy_into(wseg.view[offset:offset + length], payload)
            wseg.write_done(rng)
        self.reply(hdr)

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
            data: memoryview | bytes = bytes(self.rdma_peer.staged(_core.unpack_u64(payload, 0),
                                                                   _core.unpack_u64(payload, 8)))
        else:
            data = payload
        seg = self._still_there(hdr[H_SEGMENT])
        lo, hi = sparse.span(seg, flags, offset, data)
        self.server.bytes_in += len(data)
        self.counts.bytes_in[hdr[H_OP]] += len(data)
        self._in_order(hdr, seg, lo, hi, data, lambda items: sparse.add(seg, flags, offset, items))

    def _do_fetch_add(self, hdr: Header, payload: memoryview | None) -> None:
        assert payload is not None
        seg, offset = self._still_there(hdr[H_SEGMENT]), hdr[H_OFFSET]
        # a CPU atomic: shm clients change the same word from their processes
        add = _core.unpack_u64(payload)
        old = _core.atomic_fetch_add(seg.view, offset, add)
        self.reply(hdr, _core.pack_u64(old))
        if seg.id == LOCK_SEGMENT:
            self.server.locks.touched(offset, self)
        elif add:
            _core.futex_wake(seg.view, offset)      # a shm client may sleep on it (smb2.notify)

    def _do_compare_swap(self, hdr: Header, payload: memoryview | None) -> None:
        assert payload is not None
        seg, offset = self._still_there(hdr[H_SEGMENT]), hdr[H_OFFSET]
        expected = _core.unpack_u64(payload, 0)
        old = _core.atomic_compare_swap(seg.view, offset, expected, _core.unpack_u64(payload, 8))
        self.reply(hdr, _core.pack_u64(old))
        if seg.id == LOCK_SEGMENT:
            self.server.locks.touched(offset, self)
        elif old == expected:
            _core.futex_wake(seg.view, offset)      # a shm client may sleep on it (smb2.notify)

    def _accumulate(self, hdr: Header, seg: Segment, payload: memoryview) -> None:
        # ``length`` is the payload's; a widening dtype covers twice that (checked)
        offset, length = hdr[H_OFFSET], hdr[H_LENGTH]
        self.counts.bytes_in[hdr[H_OP]] += length
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
                self._hold_input("deferred")
            # ... and over all connections, in the server's pool
            pool = self.server.receive_pool
            pool.take(length)
            if not pool.fits(0):
                self._wait_for_memory()

            def run() -> None:
                if seg.id in self.server.segments:
                    apply(delta)
                self._deferred_bytes -= length
                pool.give(length)
                self.reply(hdr)
                if self._deferred_bytes <= MAX_DEFERRED and "deferred" in self._holds:
                    # not from here: this runs inside another connection's
                    # frame handling, and parsing ours now would nest them
                    asyncio.get_running_loop().call_soon(self._unhold_input, "deferred")
            seg.deferred.append((lo, hi, run))
            return
        apply(payload)
        self.reply(hdr)

    def _accumulate_staged(self, hdr: Header, payload: memoryview) -> None:
        # The delta was RDMA-written into this connection's staging area;
        # ``length`` is the staged delta's, a widening dtype covers twice that
        soff, length = _core.unpack_u64(payload, 0), _core.unpack_u64(payload, 8)
        offset = hdr[H_OFFSET]
        seg = self._segment(hdr[H_SEGMENT], offset, _accumulate_span(hdr, offset, length))
        delta = self.rdma_peer.staged(soff, length)
        self._accumulate((*hdr[:H_LENGTH], length), seg, delta)

    def _control(self, hdr: Header, payload: memoryview) -> None:
        try:
            msg = unpack(payload)
        except ValueError as exc:
            raise Refused(ErrorCode.BAD_REQUEST, str(exc)) from None
        if not isinstance(msg, dict):
            raise Refused(ErrorCode.BAD_REQUEST, "a control message is a msgpack map")
        cmd = msg.get("cmd")
        if cmd != "hello" and not self.greeted:
            self.close_with("the first request must be hello", hdr)
            return
        if not self.authed and not (isinstance(cmd, str) and cmd in auth.PUBLIC_COMMANDS):
            # the one gate: whatever a handler adds to the control commands
            # (RDMA keys, addresses) is unreachable before auth
            raise Refused(ErrorCode.ACCESS_DENIED, f"{cmd!r} needs authentication first")
        handler = self._CONTROL.get(cmd) if isinstance(cmd, str) else None
        if handler is None:
            raise Refused(ErrorCode.BAD_REQUEST, f"unknown control command {cmd!r}")
        self.server.controls[str(cmd)] += 1
        result = handler(self, hdr, msg)
        if result is not None:      # None: the handler closed the connection
            self.reply(hdr, pack(result))

    # The control commands (docs/protocol.md): each takes the request's header
    # and message and returns the reply's map, or None after close_with.
    def _cmd_hello(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any] | None:
        srv = self.server
        version = msg.get("version")
        if version != VERSION:
            self.close_with(f"client speaks protocol version {version!r}, server {VERSION}",
                            hdr, ErrorCode.VERSION_MISMATCH)
            return None
        self.greeted = True
        peer = msg.get("peer")
        if isinstance(peer, str):
            # a server of the cluster (replication.py checks it against the
            # view); one that names another host than it comes from is not
            if not _comes_from(peer, self.host):
                srv.warn("peer", "%s says it is server %s: not that server's address, ignored", self.peer, peer)
            elif srv.peer_token is None:
                self.peer_server = peer
            else:
                # taken as that server once it proves the peer token
                self._peer_claim, self._peer_nonce = peer, auth.new_nonce()
        result: dict[str, Any] = {
            "version": VERSION, "server_id": srv.server_id, "capacity": srv.capacity,
            "max_frame": srv.max_frame,
            "transports": srv.transports(),
            # this server takes ACCUMULATE_SPARSE (one without it closes the
            # connection on an op it does not know)
            "sparse": True}
        if srv.rdma is None:
            result["rdma_off"] = srv.rdma_reason
        if srv.shm is None:
            result["shm_off"] = srv.shm_reason
        if srv.token is None:
            self._authenticated()
            result.update(self._cluster_facts())
        elif not self.authed:
            self._nonce = auth.new_nonce()
            result.update(auth=auth.MECH, nonce=self._nonce)
        if self._peer_claim is not None:
            result["peer_nonce"] = self._peer_nonce
        return result

    def _cmd_peer_auth(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any] | None:
        # behind the authentication gate: a peer authenticates as a client first
        srv = self.server
        claim, self._peer_claim = self._peer_claim, None
        if claim is None or srv.peer_token is None:
            raise Refused(ErrorCode.BAD_REQUEST, "peer_auth follows a hello that names a server (peer)")
        nonce = msg.get("nonce")
        if not (isinstance(nonce, bytes) and len(nonce) == auth.NONCE_SIZE and auth.check(
                auth.peer_proof(srv.peer_token, self._peer_nonce, nonce, claim), msg.get("proof"))):
            srv.warn("peer", "%s says it is server %s and cannot prove the peer token", self.peer, claim)
            self.close_with("peer authentication failed: wrong peer token", hdr, ErrorCode.ACCESS_DENIED,
                            why="auth_failed")
            return None
        self.peer_server = claim
        return {}

    def _with_rdma_keys(self, info: dict[str, Any]) -> dict[str, Any]:
        # a segment's address and key, for clients that read it one-sidedly
        rdma = self.server.rdma
        return {**info, **rdma.segment_info(info["segment"])} if rdma is not None else info

    def _cmd_create(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        buffer_id = _str(msg, "buffer_id") if "buffer_id" in msg else None
        if buffer_id is not None and len(buffer_id) > MAX_BUFFER_ID:
            raise Refused(ErrorCode.BAD_REQUEST, f"a buffer_id is at most {MAX_BUFFER_ID} characters")
        replicas = _uint(msg, "replicas") if "replicas" in msg else 1
        servers, zones = msg.get("servers"), msg.get("zones")
        if replicas > 1 and (not isinstance(servers, list) or not all(isinstance(a, str) for a in servers)
                             or (zones is not None and (not isinstance(zones, list)
                                                        or not all(z is None or isinstance(z, str) for z in zones)))):
            raise Refused(ErrorCode.BAD_REQUEST, "a replicated create names its 'servers' (a list of "
                          "\"host:port\") and optionally their 'zones' (a list of str or None)")
        return self._with_rdma_keys(self.server.create(
            _str(msg, "name"), _uint(msg, "nbytes"), _uint(msg, "stripe"),
            _uint(msg, "nservers"), _uint(msg, "index"), buffer_id, msg.get("seal") is True,
            replicas=replicas, servers=servers, zones=zones))

    def _cmd_lookup(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        repl = self.server.replication
        if "copy_of" in msg and repl is not None:
            # a copy of a lost server's part this server holds in its stead
            return self._with_rdma_keys(repl.lookup_copy(_str(msg, "name"), _str(msg, "copy_of")).info())
        return self._with_rdma_keys(self.server.lookup(_str(msg, "name")))

    def _cmd_rdma_segment(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        seg = self.server.segments.get(_uint(msg, "segment"))
        if seg is None:
            raise Refused(ErrorCode.NO_SUCH_BUFFER, f"no segment {msg['segment']} "
                          "(destroyed, or the server restarted)")
        return self._with_rdma_keys(seg.info())

    def _cmd_rdma_connect(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        srv = self.server
        if srv.rdma is None:
            raise Refused(ErrorCode.UNSUPPORTED, f"this server has no RDMA: {srv.rdma_reason}")
        cap = srv.options.max_rdma_connections
        assert cap is not None
        if self.rdma_peer is None and len(srv.rdma.peers) >= cap:
            # each peer pins a staging area: the memory budget counts them.
            # Said loudly on both sides and counted: the client goes on over
            # TCP, several times slower, and that must not pass unnoticed
            srv.rdma_refused += 1
            srv.warn("rdma_limit", "refused RDMA to %s: this server serves its maximum of %d RDMA connections "
                     "(--max-rdma-connections); that client goes on over TCP", self.peer, cap)
            raise Refused(ErrorCode.OUT_OF_MEMORY,
                          f"server {srv.address[0]}:{srv.address[1]} serves its maximum of {cap} RDMA connections "
                          f"(--max-rdma-connections {cap}, each pinning a {STAGING_BYTES >> 20} MiB staging area): "
                          "raise --max-rdma-connections on that server where its memory allows")
        peer, result = srv.rdma.connect(msg, replacing=self.rdma_peer)
        if not peer.has_staging:
            # the pool of staging areas is lent out: this peer's accumulates
            # come over its TCP connection (correct, slower); said and counted
            srv.rdma_unstaged += 1
            srv.warn("rdma_staging", "RDMA peer %s got no staging area: all %d are lent "
                     "(--rdma-staging-memory %s); its accumulates come in-band over TCP", self.peer,
                     srv.rdma.staging_areas, srv.options.rdma_staging_memory)
        if self.rdma_peer is not None:
            srv.rdma.drop(self.rdma_peer)
        self.rdma_peer = peer
        # from now on this connection's server-side work counts as rdma's
        self._count_as("rdma")
        return result

    def _cmd_shm_grant(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        # behind the authentication gate of _control, like every command here
        srv = self.server
        if srv.shm is None:
            raise Refused(ErrorCode.UNSUPPORTED, f"this server has no shm: {srv.shm_reason}")
        ids = msg.get("segments")
        if not isinstance(ids, list) or not all(is_int(i) for i in ids):
            raise Refused(ErrorCode.BAD_REQUEST, "control field 'segments' must be a list of segment ids")
        segs = []
        for sid in ids:
            seg = srv.segments.get(sid)
            if seg is None:
                raise Refused(ErrorCode.NO_SUCH_BUFFER, f"no segment {sid} (destroyed, or the server restarted)")
            segs.append((seg.id, seg.view))
        # from now on this connection's server-side work counts as shm's
        self._count_as("shm")
        return srv.shm.grant(segs, owner=self)

    def _count_as(self, transport: str) -> None:
        self.transport_name = transport
        self.counts = self.server.requests[transport]

    def _cmd_repl_sync(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any] | None:
        # a joining server asks for its copies of a buffer's stripes: they go
        # through this server's ordered stream to it; answered when they landed
        repl = self.server.replication
        if repl is None or self.peer_server is None:
            raise Refused(ErrorCode.BAD_REQUEST, "repl_sync is for the servers of a replicated cluster")
        name, epoch, joiner = _str(msg, "name"), _uint(msg, "epoch"), self.peer_server

        async def run() -> None:
            try:
                self.reply(hdr, pack(await repl.serve_sync(joiner, name, epoch)))
            except Refused as exc:
                self.refuse(hdr, exc.code, str(exc), **exc.extra)
            except Exception as exc:
                self.refuse(hdr, ErrorCode.INTERNAL, f"copying to {joiner} failed: {exc}")
        repl.spawn(run())
        return None

    def _cmd_destroy(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        return self.server.destroy(_str(msg, "name"))

    def _cmd_list(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        return {"buffers": sorted(self.server.by_name)}

    def _cmd_stat(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        return self.server.stat()

    def _cmd_peek(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        """A few bytes of many buffers' parts here, in one request (``smb2
        ls`` reads every buffer's first bytes to tell the stores: one request
        per server, not one per buffer): ``reads`` is [[name, segment
        offset, length], ...]; ``data`` the bytes of each, None where this
        server holds no part of that name or the range is outside it."""
        reads = msg.get("reads")
        if not isinstance(reads, list) or len(reads) > PEEK_READS:
            raise Refused(ErrorCode.BAD_REQUEST, f"peek takes a list of at most {PEEK_READS} reads")
        out: list[bytes | None] = []
        for r in reads:
            if not (isinstance(r, list) and len(r) == 3 and isinstance(r[0], str) and is_int(r[1])
                    and is_int(r[2]) and 0 <= r[1] and 0 <= r[2] <= PEEK_BYTES):
                raise Refused(ErrorCode.BAD_REQUEST, f"a peek read is [name, offset, length <= {PEEK_BYTES}]")
            seg = self.server.by_name.get(r[0])
            out.append(None if seg is None or r[1] + r[2] > seg.size else bytes(seg.view[r[1]:r[1] + r[2]]))
        return {"data": out}

    def _cmd_lock_open(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        return self.server.locks.open(_str(msg, "name"), msg.get("lease"), self)

    def _cmd_lock_close(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        return self.server.locks.close_name(_str(msg, "name"), self)

    def _cmd_lock_abandon(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        return self.server.locks.abandon(_uint(msg, "offset"), _uint(msg, "ticket"))

    def _cmd_lock_records(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        if self.transport_name != "shm":
            # records are written by the client's own atomics on the mapped
            # lock segment: nobody else can use them
            raise Refused(ErrorCode.BAD_REQUEST, "lock_records is for shm clients (after shm_grant)")
        return self.server.locks.lend_records(self)

    def _cmd_auth(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any] | None:
        srv = self.server
        if srv.token is None:
            raise Refused(ErrorCode.BAD_REQUEST, "this server does not use authentication")
        if self.authed:
            raise Refused(ErrorCode.BAD_REQUEST, "already authenticated")
        # Every proof is checked (one HMAC, about a microsecond): a back-off
        # per source address would lock out the token holders who share the
        # guesser's address.  What a guess costs instead: a connection and a
        # hello for each (one try per challenge), and the token's 2**256
        # possible proofs (docs/operations.md, "What one client can take").
        nonce = msg.get("nonce")
        ok = (isinstance(nonce, bytes) and len(nonce) == auth.NONCE_SIZE
              and auth.check(auth.client_proof(srv.token, self._nonce, nonce), msg.get("proof")))
        if not ok:
            # one try per challenge: a guesser must reconnect for each
            srv.auth_failures += 1
            srv.warn("auth", "authentication failed from %s (wrong token)", self.peer)
            self.close_with("authentication failed: wrong token", hdr, ErrorCode.ACCESS_DENIED, why="auth_failed")
            return None
        assert isinstance(nonce, bytes)
        self._authenticated()
        log.debug("%s authenticated", self.peer)
        return {"proof": auth.server_proof(srv.token, self._nonce, nonce), **self._cluster_facts()}

    def _cluster_facts(self) -> dict[str, Any]:
        """Where this server stands in its replicated cluster: told after
        authentication only (hello to the unauthenticated says nothing of it)."""
        repl = self.server.replication
        return {"membership": repl.url if repl is not None else None,
                "server": repl.me if repl is not None else None,
                "zone": self.server.options.zone,
                "epoch": repl.view.epoch if repl is not None else 0}

    def _cmd_repl_accept(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        # the operator's word (smb2 repair --accept): this server's copies of
        # stripes no member copy is left of are taken as they are
        repl = self.server.replication
        if repl is None:
            raise Refused(ErrorCode.BAD_REQUEST, "this server is not part of a replicated cluster")
        repl.accept_as_is = True
        log.warning("%s: the operator takes this server's copies of stripes without a member copy as they are",
                    self.peer)
        return {"accepted": True, "stuck": repl.stuck}

    def _cmd_view(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any] | None:
        # clients hold no etcd credentials: they read the view through a server
        self._view_reply(hdr, lambda repl: repl.serve_view())
        return None

    def _cmd_view_change(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any] | None:
        members, joining = msg.get("members"), msg.get("joining", [])
        if not (isinstance(members, list) and isinstance(joining, list)
                and all(isinstance(m, str) for m in members + joining)):
            raise Refused(ErrorCode.BAD_REQUEST, "view_change takes members and joining as lists of host:port")
        epoch = _uint(msg, "epoch")
        self._view_reply(hdr, lambda repl: repl.serve_change(epoch, members, joining))
        return None

    def _view_reply(self, hdr: Header, work: Callable[[Replication], Awaitable[View]]) -> None:
        repl = self.server.replication
        if repl is None:
            raise Refused(ErrorCode.BAD_REQUEST, "this server is not part of a replicated cluster "
                          "(start it with --membership)")

        async def run() -> None:
            try:
                self.reply(hdr, pack({"view": (await work(repl)).to_json()}))
            except Refused as exc:
                self.refuse(hdr, exc.code, str(exc), **exc.extra)
            except Exception as exc:
                self.refuse(hdr, ErrorCode.INTERNAL, f"the membership service did not answer: {exc}")
        repl.spawn(run())

    def _authenticated(self) -> None:
        self.authed = True
        self.server.admission.authenticated(self)
        self.inbox_size = self.INBOX_SIZE      # grows at the next receive


    _HEADER_CHECKS: ClassVar[dict[int, Callable[[Connection, Header, int], Destination]]] = {
        Op.READ: _check_read, Op.WRITE: _check_write, Op.ACCUMULATE: _check_accumulate,
        Op.ACCUMULATE_SPARSE: _check_sparse,
        Op.FETCH_ADD: _check_atomic, Op.COMPARE_SWAP: _check_atomic,
        **dict.fromkeys(LOCK_OPS, _check_lock_op)}
    _EXECUTE: ClassVar[dict[int, Callable[[Connection, Header, memoryview | None], None]]] = {
        Op.READ: _do_read, Op.WRITE: _do_write, Op.ACCUMULATE: _do_accumulate,
        Op.ACCUMULATE_SPARSE: _do_sparse,
        Op.FETCH_ADD: _do_fetch_add, Op.COMPARE_SWAP: _do_compare_swap,
        **dict.fromkeys(LOCK_OPS, _do_lock_op)}
    _CONTROL: ClassVar[dict[str, Callable[[Connection, Header, dict[str, Any]], dict[str, Any] | None]]] = {
        "hello": _cmd_hello, "auth": _cmd_auth, "create": _cmd_create, "lookup": _cmd_lookup,
        "rdma_segment": _cmd_rdma_segment, "rdma_connect": _cmd_rdma_connect, "destroy": _cmd_destroy,
        "list": _cmd_list, "stat": _cmd_stat, "peek": _cmd_peek, "lock_open": _cmd_lock_open,
        "lock_abandon": _cmd_lock_abandon, "shm_grant": _cmd_shm_grant, "lock_close": _cmd_lock_close,
        "lock_records": _cmd_lock_records, "repl_sync": _cmd_repl_sync, "peer_auth": _cmd_peer_auth,
        "view": _cmd_view, "view_change": _cmd_view_change, "repl_accept": _cmd_repl_accept}


async def start_server(host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                       options: ServerOptions | None = None, **overrides: Any) -> MemoryServer:
    """Start a memory server in the running loop and return it once it listens.

    ``options`` / ``overrides`` are :class:`ServerOptions` (capacity, token,
    data_dir, lock_lease, lock_spin, rdma, ...), as :class:`MemoryServer`
    takes them.  ``port=0`` picks a free port (see ``server.address``).  With
    ``token``, clients must authenticate (``smb2.connect(..., token=...)``).
    With ``data_dir``, the segments saved there are restored now and saved
    again by ``close()``.  ``rdma``: "auto" (serve RDMA where this machine
    can), "on" (fail if it cannot), "off"."""
    server = MemoryServer(options, **overrides)
    await server.start(host, port)
    return server
