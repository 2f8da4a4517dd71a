"""Prometheus metrics of one memory server (``smb2-server --metrics HOST:PORT``).

Two halves.  What the hot path feeds: :class:`Durations`, a histogram with
fixed buckets (one bisect and two additions per observation: a request's
handling time, a lock hand-off), and :class:`RequestCounts`, one transport's
per-op histograms and data bytes, indexed by op code.  And what reads them:
at each scrape :class:`ServerCollector` turns those and the counters the
server keeps for ``stat`` (refusals, the receive pool, the lock table) into
metric families.  The exporter is a small HTTP endpoint on the server's own
event loop: the collector reads the server's dictionaries there (a thread
could see them mid-change), and a thread turns what it read into text.  A
scrape costs the loop at most one such reading per SNAPSHOT_EVERY seconds
however often it is asked (scrapes that come sooner wait for the next
reading and share it), and at most
MAX_SCRAPERS connections are accepted at once (the others wait in the
kernel's backlog), so a flood of scrapes cannot take the data path's time.

``prometheus-client`` is an optional dependency (``pip install smb2[metrics]``);
it is imported only when metrics are asked for: the counting here needs none.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import socket
import time
from collections.abc import Collection, Coroutine, Iterator, Mapping, Sized
from typing import Any, Final, Protocol

from ..errors import InvalidArgumentError, TransportError
from ..protocol import VERSION, Op
from ..version import __version__

log = logging.getLogger("smb2.server.metrics")

# an HTTP request line and headers larger than this is not a scraper
MAX_REQUEST = 16 << 10
# a scraper sends its request at once, and reads the answer: one that
# waits holds a place
REQUEST_TIMEOUT = 2.0
SEND_TIMEOUT = 10.0
# scrape connections served at once; more wait in the listening socket's
# backlog (costing the server nothing) until one is done
MAX_SCRAPERS = 16
# the server's numbers are read at most this often: a scrape that comes
# sooner waits for the next reading, and shares it with every scrape waiting
# (Prometheus scrapes every 10-60 s)
SNAPSHOT_EVERY = 0.25


# The time histograms' buckets are powers of two nanoseconds: a duration of
# ``ns`` falls in bucket ``b = (ns - 1).bit_length()`` (2**(b-1) < ns <= 2**b), which
# costs a fraction of a bisect over decimal bounds on the per-request path.
# Prometheus sees those from 2**10 ns (1.02 us) to 2**34 ns (17.2 s), the
# ones below folded into the first: a request on loopback takes 5-100 us of
# the server, a 64 MiB one some ms, a hand-off after a lease expiry up to
# the lock sweep's period (50 ms).
_BITS: Final = 64
_FIRST_BIT: Final = 10
_LAST_BIT: Final = 34
_BUCKET_LABELS: Final = tuple(str((1 << b) / 1e9) for b in range(_FIRST_BIT, _LAST_BIT + 1))
# the data ops whose payload bytes are counted (an atomic moves one 8-byte
# word, a lock op one ticket: their count says it)
BYTE_OPS: Final = (Op.READ, Op.WRITE, Op.ACCUMULATE, Op.ACCUMULATE_SPARSE)


class Durations:
    """Durations counted into fixed power-of-two buckets: cheap enough to
    feed from every request (one ``bit_length`` and two additions), made a
    Prometheus histogram at scrape time."""

    __slots__ = ("counts", "sum_ns")

    def __init__(self) -> None:
        self.counts = [0] * _BITS
        self.sum_ns = 0

    def observe(self, ns: int) -> None:
        self.counts[(ns - 1).bit_length()] += 1
        self.sum_ns += ns

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, observations <= le)`` per bucket, +Inf last, as Prometheus wants them."""
        total = sum(self.counts[:_FIRST_BIT])
        out = []
        for b, le in enumerate(_BUCKET_LABELS, _FIRST_BIT):
            total += self.counts[b]
            out.append((le, float(total)))
        out.append(("+Inf", float(self.count)))
        return out


class RequestCounts:
    """One transport's requests, indexed by op code: the server's handling
    time of each (a :class:`Durations`, whose count is the op count) and the
    payload bytes that came in (WRITE, ACCUMULATE) and went out (READ)."""

    __slots__ = ("time", "bytes_in", "bytes_out")

    def __init__(self) -> None:
        n = max(Op) + 1
        self.time = [Durations() for _ in range(n)]
        self.bytes_in = [0] * n
        self.bytes_out = [0] * n

    def counts(self) -> dict[str, int]:
        """Requests per op name (lower case), the ops seen only."""
        return {op.name.lower(): n for op in Op if (n := self.time[op].count)}


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9100`` for IPv6) as a (host, port) pair."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidArgumentError(f"metrics address must be HOST:PORT (e.g. 127.0.0.1:9100), not {text!r}")
    # no host: loopback (the endpoint has no authentication; 0.0.0.0:PORT
    # serves every interface, when asked for by name)
    return host.strip("[]") or "127.0.0.1", int(port)


def prometheus() -> Any:
    """The prometheus_client module, or InvalidArgumentError saying how to get it."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise InvalidArgumentError(
            "--metrics needs prometheus-client: pip install 'smb2[metrics]' "
            "(or pip install prometheus-client)") from exc
    return prometheus_client


class WatchedConnection(Protocol):
    """What the collector reads of a connection (connection.Connection)."""

    @property
    def memory(self) -> int: ...
    @property
    def transport(self) -> Any: ...     # asyncio.Transport | None


class WatchedServer(Protocol):
    """What the collector reads of a MemoryServer (memory.py): its counters.
    (Properties: read-only here, so the server's own types fit.)"""

    server_id: str
    started: float
    rdma: Any
    capacity: int
    used: int
    receive_pool: Any       # guard.MemoryPool: .used, .peak, .limit
    admission: Any          # guard.Admission: .evicted
    locks: Any              # locks.LockService: .stat(), .handoffs
    replication: Any        # replication.Replication (.stat()) or None
    threads: int            # --threads
    accumulates_cut: int    # accumulates added by more than one thread
    accumulate_parts: int   # ... and the parts they were cut into
    rdma_refused: int
    rdma_unstaged: int

    @property
    def requests(self) -> Mapping[str, RequestCounts]: ...
    @property
    def refusals(self) -> Mapping[str, int]: ...
    @property
    def cuts(self) -> Mapping[str, int]: ...
    @property
    def connections(self) -> Collection[WatchedConnection]: ...
    @property
    def by_name(self) -> Sized: ...
    @property
    def limits(self) -> Mapping[str, Any]: ...


def histogram(name: str, help: str, labels: list[str] | None = None) -> Any:
    from prometheus_client.core import HistogramMetricFamily
    return HistogramMetricFamily(name, help, labels=labels)


def add_durations(family: Any, labels: list[str], durations: Durations) -> None:
    family.add_metric(labels, durations.cumulative(), sum_value=durations.sum_ns / 1e9)


class ServerCollector:
    """Reads a MemoryServer's counters into metric families at scrape time."""

    def __init__(self, server: WatchedServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

        srv = self.server
        info = InfoMetricFamily("smb2_server", "this server process")
        info.add_metric([], {"server_id": srv.server_id, "version": __version__,
                             "protocol_version": str(VERSION), "rdma": "on" if srv.rdma else "off"})
        yield info
        yield GaugeMetricFamily("smb2_uptime_seconds", "seconds since the server started",
                                value=time.time() - srv.started)
        yield from self.requests()
        yield from self.refusals()
        yield from self.limits()

        yield GaugeMetricFamily("smb2_capacity_bytes", "memory this server serves (--capacity)",
                                value=srv.capacity)
        yield GaugeMetricFamily("smb2_used_bytes", "memory the buffers' segments take", value=srv.used)
        yield GaugeMetricFamily("smb2_buffers", "buffers held", value=len(srv.by_name))
        pool = srv.receive_pool
        recv = GaugeMetricFamily("smb2_receive_memory_bytes", "payload memory of all connections "
                                 "(accumulate scratch, deltas behind a write): the overhead over capacity "
                                 "that --max-receive-memory bounds", labels=["kind"])
        recv.add_metric(["used"], pool.used)
        recv.add_metric(["peak"], pool.peak)
        recv.add_metric(["limit"], pool.limit)
        yield recv
        conns = srv.connections
        held = GaugeMetricFamily("smb2_connection_memory_bytes", "what the connections hold besides the "
                                 "pool: receive buffers (inboxes and accumulate scratch) and replies "
                                 "queued for sending", labels=["kind"])
        held.add_metric(["receive"], sum(c.memory for c in conns))
        held.add_metric(["replies"], sum(c.transport.get_write_buffer_size() for c in conns
                                         if c.transport is not None))
        yield held
        yield from self.threads()
        yield from self.locks()
        yield from self.replication()

    def requests(self) -> Iterator[Any]:
        """Per transport and op: requests, their handling time, their bytes."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        srv = self.server
        ops = CounterMetricFamily("smb2_ops", "data operations executed, per transport and op",
                                  labels=["transport", "op"])
        took = histogram("smb2_op_seconds", "the server's time on a request, from its header to its "
                         "reply handed to the socket, per transport and op", ["transport", "op"])
        moved = CounterMetricFamily("smb2_op_bytes", "payload bytes that came in with requests (write, "
                                    "accumulate) and went out in replies (read)",
                                    labels=["transport", "op", "direction"])
        for transport, counts in sorted(srv.requests.items()):
            for op in Op:
                durations = counts.time[op]
                n = durations.count
                if not n:
                    continue
                name = op.name.lower()
                ops.add_metric([transport, name], n)
                add_durations(took, [transport, name], durations)
                if op in BYTE_OPS:
                    moved.add_metric([transport, name, "in"], counts.bytes_in[op])
                    moved.add_metric([transport, name, "out"], counts.bytes_out[op])
        yield ops
        yield took
        yield moved
        yield GaugeMetricFamily("smb2_connections", "open connections", value=len(srv.connections))

    def threads(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        srv = self.server
        yield GaugeMetricFamily("smb2_threads", "threads a large accumulate is cut among (--threads)",
                                value=srv.threads)
        yield CounterMetricFamily("smb2_accumulates_cut", "accumulates added by more than one thread",
                                  value=srv.accumulates_cut)
        yield CounterMetricFamily("smb2_accumulate_parts", "the parts the accumulates cut among threads "
                                  "were added in", value=srv.accumulate_parts)

    def refusals(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        refused = CounterMetricFamily("smb2_refused", "requests and connections the server said no to, by "
                                      "why: the error code it answered, or connection_limit, auth_failed",
                                      labels=["reason"])
        for reason, n in sorted(self.server.refusals.items()):
            refused.add_metric([reason], n)
        yield refused
        cut = CounterMetricFamily("smb2_connections_cut", "connections the server closed for a deadline, "
                                  "by which, or unauthenticated ones closed to make room (evicted)",
                                  labels=["reason"])
        for reason, n in sorted({**self.server.cuts, "evicted": self.server.admission.evicted}.items()):
            cut.add_metric([reason], n)
        yield cut

    def limits(self) -> Iterator[Any]:
        """The caps in force (machine-sized or set), and the RDMA peers held
        and refused: a job's workers past --max-rdma-connections go on over
        TCP, and that shows here."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        srv = self.server
        caps = GaugeMetricFamily("smb2_limit", "the caps in force (--max-connections, --max-connections-per-host, "
                                 "--max-rdma-connections, --max-buffers, the listen backlog) and the file limit "
                                 "and memory the defaults were sized from", labels=["limit"])
        for name, value in sorted(srv.limits.items()):
            if isinstance(value, int):
                caps.add_metric([name], value)
        yield caps
        yield GaugeMetricFamily("smb2_rdma_connections", "connections that set up RDMA (each pins a staging area)",
                                value=len(srv.rdma.peers) if srv.rdma is not None else 0)
        yield CounterMetricFamily("smb2_rdma_refused", "clients refused RDMA at --max-rdma-connections: they go "
                                  "on over TCP, several times slower", value=srv.rdma_refused)
        yield GaugeMetricFamily("smb2_rdma_staging_lent", "staging areas lent to RDMA peers now (at most "
                                "--rdma-staging-memory / 4 MiB)", value=srv.rdma.staging_lent if srv.rdma else 0)
        yield CounterMetricFamily("smb2_rdma_unstaged", "RDMA peers given no staging area (all lent): their "
                                  "accumulates come in-band over TCP", value=srv.rdma_unstaged)

    def replication(self) -> Iterator[Any]:
        """A replicated cluster's server: its view, whether it is caught up,
        the buffers short of a copy, what it copied to servers catching up."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        repl = self.server.replication
        if repl is None:
            return
        st = repl.stat()
        yield GaugeMetricFamily("smb2_replication_epoch", "the membership view's epoch this server knows",
                                value=st["epoch"])
        yield GaugeMetricFamily("smb2_replication_member", "1 when this server is a member of the view "
                                "(0 while it catches up after a restart or a removal)",
                                value=1 if st["state"] == "member" else 0)
        yield GaugeMetricFamily("smb2_replication_degraded_buffers", "replicated buffers with a stripe "
                                "short of a member copy (a server of theirs is out of the view or catching up)",
                                value=len(st["degraded"]))
        yield GaugeMetricFamily("smb2_replication_moved_copies", "parts of lost servers' buffers this server "
                                "holds in their stead (--replace-after)", value=len(st["copies_held"]))
        yield CounterMetricFamily("smb2_replication_copied_bytes", "bytes of stripe copies this server sent "
                                  "to servers catching up (paced by --repair-rate)", value=st["copied_bytes"])
        yield CounterMetricFamily("smb2_replication_diverged", "atomics whose old value on a backup differed "
                                  "from this primary's (the copies differ: should stay 0)", value=st["diverged"])
        yield CounterMetricFamily("smb2_replication_lease_waits", "answers this primary held back for a read of "
                                  "the view (its lease on it had run out: paused, loaded, or cut off from etcd)",
                                  value=st["lease_waits"])

    def locks(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        service = self.server.locks
        locks = service.stat()
        held = waiting = 0
        for lock in locks["locks"].values():
            if lock["queued"]:
                held += 1
                # tickets drawn behind the holder, less those given up
                # (still counted between the words until the queue skips them)
                waiting += lock["queued"] - 1 - lock["abandoned"]
        yield GaugeMetricFamily("smb2_lock_slots", "lock slots (--lock-slots)", value=locks["slots"])
        yield GaugeMetricFamily("smb2_locks_open", "locks open", value=locks["open"])
        yield GaugeMetricFamily("smb2_locks_held", "locks that have a holder", value=held)
        yield GaugeMetricFamily("smb2_lock_waiters", "tickets waiting behind a holder", value=waiting)
        for name, key, help in (
                ("smb2_lock_grants", "grants", "lock grants"),
                ("smb2_lock_lease_expiries", "expired", "holders that lost the lock when their lease ran out"),
                ("smb2_lock_stale_renewals", "stale_renewals", "renewals from a holder that had lost the lock"),
                ("smb2_lock_slots_reclaimed", "reclaimed", "idle lock slots given back"),
                ("smb2_lock_spin_seconds", "spin_seconds", "seconds the lock service polled for waiters")):
            yield CounterMetricFamily(name, help, value=locks[key])
        handoff = histogram("smb2_lock_handoff_seconds", "from a holder's release or lease expiry, as the "
                            "server saw it, to the next parked waiter's grant sent")
        add_durations(handoff, [], service.handoffs)
        yield handoff


class Reading:
    """Metric families already collected, for ``generate_latest`` to render."""

    def __init__(self, families: list[Any], *live: Any) -> None:
        self.families = families
        # collectors safe to run in the rendering thread (the process's /proc)
        self.live = live

    def collect(self) -> Iterator[Any]:
        yield from self.families
        for collector in self.live:
            yield from collector.collect()


class MetricsExporter:
    """``GET /metrics`` on HOST:PORT: read on the running loop, at most once
    per ``every`` seconds; rendered in a thread; ``max_scrapers`` connections
    accepted at once."""

    def __init__(self, server: WatchedServer, *, every: float = SNAPSHOT_EVERY,
                 max_scrapers: int = MAX_SCRAPERS) -> None:
        prom = prometheus()
        self.collector = ServerCollector(server)
        # the process's RSS and CPU: what the memory budget (operations.md) bounds
        self.process = prom.ProcessCollector(registry=None)
        self._generate = prom.generate_latest
        self.content_type: str = prom.CONTENT_TYPE_LATEST
        self.every = every
        self._room = asyncio.Semaphore(max_scrapers)
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.address: tuple[str, int] = ("", 0)
        self._renderer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="smb2-metrics")
        # the last text, when its reading was taken (loop time), and the
        # render under way, which the scrapes waiting for it share
        self._text = b""
        self._taken = -math.inf
        self._rendering: asyncio.Future[bytes] | None = None

    async def start(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            sock = socket.create_server((host, port), family=family, backlog=MAX_SCRAPERS)
        except OSError as exc:
            raise TransportError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}",
                                 errno=exc.errno, hint="pick another --metrics port") from None
        sock.setblocking(False)
        self._sock = sock
        self.address = sock.getsockname()[:2]
        self._spawn(self._accept())
        log.info("metrics on http://%s:%d/metrics", *self.address)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._renderer.shutdown(wait=False, cancel_futures=True)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self) -> None:
        # a place first, then the connection: past max_scrapers the next
        # ones wait in the backlog, and a flood of them costs no loop time
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            await self._room.acquire()
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:
                self._room.release()
                log.warning("metrics: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            self._spawn(self._scrape(conn))

    async def text(self) -> bytes:
        """The metrics' text, from a reading taken after this call began: a
        new one (taken here, on the loop, then rendered in the exporter's
        thread) once ``every`` has passed since the last, shared by every
        scrape that waits for it."""
        loop = asyncio.get_running_loop()
        asked = loop.time()
        while True:
            self._settle()
            if self._rendering is not None:
                await asyncio.shield(self._rendering)     # not done: this yields
            elif self._taken >= asked:
                return self._text
            elif (wait := self._taken + self.every - loop.time()) > 0:
                await asyncio.sleep(wait)
            else:
                self._taken = loop.time()
                reading = Reading(list(self.collector.collect()), self.process)
                self._rendering = loop.run_in_executor(self._renderer, self._generate, reading)

    def _settle(self) -> None:
        # a finished render's text becomes the last text (a failed one's
        # error is raised to the scrapes that waited for it)
        done = self._rendering
        if done is not None and done.done():
            self._rendering = None
            if not done.cancelled() and done.exception() is None:
                self._text = done.result()

    async def _scrape(self, conn: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=conn, limit=MAX_REQUEST)
        except BaseException:
            conn.close()
            self._room.release()
            raise
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
            parts = head.split(b"\r\n", 1)[0].split()
            path = parts[1].split(b"?", 1)[0] if len(parts) >= 2 else b""
            if parts[:1] != [b"GET"] or path not in (b"/metrics", b"/"):
                self._respond(writer, "404 Not Found", b"smb2 metrics: GET /metrics\n", "text/plain")
            else:
                self._respond(writer, "200 OK", await self.text(), self.content_type)
            await asyncio.wait_for(writer.drain(), SEND_TIMEOUT)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass    # a scraper that went away, sent no request or reads no answer
        finally:
            if writer.transport.get_write_buffer_size():
                writer.transport.abort()    # unread: its text is not kept
            else:
                writer.close()
            self._room.release()

    @staticmethod
    def _respond(writer: asyncio.StreamWriter, status: str, body: bytes, content_type: str) -> None:
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                     "Connection: close\r\n\r\n".encode() + body)
