"""The memory server: owns RAM as segments and serves them to clients.

listener -> :class:`~smb2.server.connection.Connection` (frames; its data
ops in ``dataops.py``, its control messages in ``control.py``) ->
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
import time
from collections.abc import Callable
from typing import Any

from .. import _core, auth
from ..errors import ErrorCode, PersistenceError, TransportError
from ..placement import Placement
from ..protocol import (
    DEFAULT_PORT,
    LOCK_SEGMENT,
    VERSION,
    parse_size,
)
from ..version import __version__
from .connection import Connection
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
# a token shorter than this gets a warning at start: it could be guessed
MIN_TOKEN = 16
# a connection idle this long gives back its inbox and scratch
RELEASE_IDLE = 2.0
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
        # it), not an older save (datadir.RUNNING): replication/ vouches
        self.restored_clean = False
        self.connections: set[Connection] = set()
        self.started = time.time()
        # what a process that runs this server in its own loop says of itself
        # in stat, by key: the host agent (smb2.agent) says it is one, and
        # whether it reaches its memory servers, which smb2 doctor checks
        self.stat_extra: dict[str, Callable[[], Any]] = {}
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
        # replicated buffers (options.membership; replication/): made at start()
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
        return Placement.of(name, nservers, nbytes, stripe, replicas, zones).segment_size(index)

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
        server's part, held here in a lost server's stead: replication/):
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
            self.replication.moved.forget(name)
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
            **{key: describe() for key, describe in self.stat_extra.items()},
        }


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False     # "" (all addresses), a host name: treat as exposed



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
