"""Prometheus metrics of one memory server (``smb2-server --metrics HOST:PORT``).

Nothing is counted here: at each scrape a collector reads the counters the
server already keeps for ``stat`` (ops per transport, bytes, refusals, the
receive pool, the lock table), so watching a server adds no work to its
requests.  The exporter is a small HTTP endpoint on the server's own event
loop, not prometheus-client's thread, so a scrape never reads the server's
dictionaries while the loop changes them.

``prometheus-client`` is an optional dependency (``pip install smb2[metrics]``);
it is imported only when metrics are asked for.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import logging
import time
from collections.abc import Iterator, Mapping, Sized
from typing import Any, Protocol

from ..errors import InvalidArgumentError, TransportError
from ..protocol import VERSION

log = logging.getLogger("smb2.server.metrics")

# an HTTP request line and headers larger than this is not a scraper
MAX_REQUEST = 16 << 10
REQUEST_TIMEOUT = 10.0


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9100`` for IPv6) as a (host, port) pair."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidArgumentError(f"metrics address must be HOST:PORT (e.g. 127.0.0.1:9100), not {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


@functools.cache
def package_version() -> str:
    """smb2's installed version ("unknown" when run from a bare source tree)."""
    try:
        return importlib.metadata.version("smb2")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def prometheus() -> Any:
    """The prometheus_client module, or InvalidArgumentError saying how to get it."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise InvalidArgumentError(
            "--metrics needs prometheus-client: pip install 'smb2[metrics]' "
            "(or pip install prometheus-client)") from exc
    return prometheus_client


class WatchedServer(Protocol):
    """What the collector reads of a MemoryServer (memory.py): its counters.
    (Properties: read-only here, so the server's own types fit.)"""

    server_id: str
    started: float
    rdma: Any
    bytes_in: int
    bytes_out: int
    refused: int
    auth_failures: int
    auth_throttled: int
    capacity: int
    used: int
    admission: Any          # guard.Admission: .refused
    receive_pool: Any       # guard.MemoryPool: .used, .peak, .limit
    locks: Any              # locks.LockService: .stat()

    @property
    def ops(self) -> Mapping[str, Mapping[str, int]]: ...
    @property
    def connections(self) -> Sized: ...
    @property
    def by_name(self) -> Sized: ...


class ServerCollector:
    """Reads a MemoryServer's counters into metric families at scrape time."""

    def __init__(self, server: WatchedServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        srv = self.server
        info = InfoMetricFamily("smb2_server", "this server process")
        info.add_metric([], {"server_id": srv.server_id, "version": package_version(),
                             "protocol_version": str(VERSION), "rdma": "on" if srv.rdma else "off"})
        yield info
        yield GaugeMetricFamily("smb2_uptime_seconds", "seconds since the server started",
                                value=time.time() - srv.started)

        ops = CounterMetricFamily("smb2_ops", "data operations executed, per transport and op",
                                  labels=["transport", "op"])
        for transport, counts in srv.ops.items():
            for op, n in counts.items():
                ops.add_metric([transport, op], n)
        yield ops
        moved = CounterMetricFamily("smb2_payload_bytes", "payload bytes written into (in) and read "
                                    "out of (out) the segments", labels=["direction"])
        moved.add_metric(["in"], srv.bytes_in)
        moved.add_metric(["out"], srv.bytes_out)
        yield moved

        yield GaugeMetricFamily("smb2_connections", "open connections", value=len(srv.connections))
        refused = CounterMetricFamily("smb2_refused", "what the server refused, by why", labels=["reason"])
        refused.add_metric(["request"], srv.refused)
        refused.add_metric(["connection_limit"], srv.admission.refused)
        refused.add_metric(["auth_failed"], srv.auth_failures)
        refused.add_metric(["auth_backoff"], srv.auth_throttled)
        yield refused

        yield GaugeMetricFamily("smb2_capacity_bytes", "memory this server serves (--capacity)",
                                value=srv.capacity)
        yield GaugeMetricFamily("smb2_used_bytes", "memory the buffers' segments take", value=srv.used)
        yield GaugeMetricFamily("smb2_buffers", "buffers held", value=len(srv.by_name))
        pool = srv.receive_pool
        recv = GaugeMetricFamily("smb2_receive_memory_bytes", "payload memory of all connections "
                                 "(accumulate scratch, deltas behind a write): the overhead over capacity",
                                 labels=["kind"])
        recv.add_metric(["used"], pool.used)
        recv.add_metric(["peak"], pool.peak)
        recv.add_metric(["limit"], pool.limit)
        yield recv

        locks = srv.locks.stat()
        held = waiting = 0
        for lock in locks["locks"].values():
            if lock["queued"]:
                held += 1
                waiting += lock["queued"] - 1
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


class MetricsExporter:
    """``GET /metrics`` on HOST:PORT, served on the running loop."""

    def __init__(self, server: WatchedServer) -> None:
        prom = prometheus()
        self.registry = prom.CollectorRegistry()
        self.registry.register(ServerCollector(server))
        # the process's RSS and CPU: what the memory budget (operations.md) bounds
        prom.ProcessCollector(registry=self.registry)
        self._generate = prom.generate_latest
        self.content_type: str = prom.CONTENT_TYPE_LATEST
        self._server: asyncio.AbstractServer | None = None
        self.address: tuple[str, int] = ("", 0)

    async def start(self, host: str, port: int) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, host, port, reuse_address=True,
                                                      limit=MAX_REQUEST)
        except OSError as exc:
            raise TransportError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}",
                                 errno=exc.errno, hint="pick another --metrics port") from None
        self.address = self._server.sockets[0].getsockname()[:2]
        log.info("metrics on http://%s:%d/metrics", *self.address)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def render(self) -> bytes:
        """The metrics in Prometheus' text format."""
        data: bytes = self._generate(self.registry)
        return data

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
            parts = head.split(b"\r\n", 1)[0].split()
            path = parts[1].split(b"?", 1)[0] if len(parts) >= 2 else b""
            if parts[:1] != [b"GET"] or path not in (b"/metrics", b"/"):
                self._respond(writer, "404 Not Found", b"smb2 metrics: GET /metrics\n", "text/plain")
            else:
                self._respond(writer, "200 OK", self.render(), self.content_type)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass    # a scraper that went away or sent no request: nothing to answer
        finally:
            writer.close()

    @staticmethod
    def _respond(writer: asyncio.StreamWriter, status: str, body: bytes, content_type: str) -> None:
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                     "Connection: close\r\n\r\n".encode() + body)
