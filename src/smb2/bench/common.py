"""What every smb2 benchmark shares: the raw TCP baseline, the machine's
description, percentiles, timing loops, the JSON file and the ``--quick``
option.

The raw baseline is a ``asyncio.BufferedProtocol`` pair with no smb2 code on
either side: a peer process (``python -m smb2.bench --raw-peer``, started by
:func:`start_raw_peer`) and :class:`RawClient` in the benchmark's process.
``smb2 bench`` compares smb2's transfers with it, ``tools/bench_lock.py``
its lock round trips (docs/design.md, "Measuring").
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import mmap
import os
import platform
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import numpy as np

MiB = 1 << 20

# -- the raw baseline's wire format --------------------------------------------
# Every message of the raw protocol is one 64-byte frame (cmd, 0, length, then
# padding), so that a ping is exactly 64 bytes each way.  SINK is followed by
# ``length`` payload bytes and answered with one frame once they are all in;
# SOURCE is answered with ``length`` bytes.  Each side receives straight into
# a preallocated buffer via ``get_buffer``: no copies, no ``bytes`` objects.
FRAME = 64
_HDR = struct.Struct("<IIQ")
CMD_PING, CMD_SINK, CMD_SOURCE = 1, 2, 3
#: the first line the peer prints: "<READY> host:port"
READY = "raw-peer listening on"
# the directory holding the smb2 package (the child imports the same one)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _frame(cmd: int, length: int = 0) -> bytes:
    return _HDR.pack(cmd, 0, length).ljust(FRAME, b"\0")


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _PeerProtocol(asyncio.BufferedProtocol):
    """The child's end: echoes pings, sinks and sources payloads."""

    def __init__(self, mem: memoryview, closed: asyncio.Future[None]) -> None:
        self.mem = mem
        self.closed = closed
        self.head = bytearray(FRAME)
        self.hview = memoryview(self.head)
        self.hpos = 0
        self.sink: memoryview | None = None
        self.spos = 0
        self.ack = _frame(CMD_SINK)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        _nodelay(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.sink is not None:
            return self.sink[self.spos:]
        return self.hview[self.hpos:]

    def buffer_updated(self, nbytes: int) -> None:
        t = self.transport
        assert t is not None
        if self.sink is not None:
            self.spos += nbytes
            if self.spos == len(self.sink):
                self.sink = None
                t.write(self.ack)
            return
        self.hpos += nbytes
        if self.hpos < FRAME:
            return
        self.hpos = 0
        cmd, _, length = _HDR.unpack_from(self.head)
        if cmd == CMD_PING:
            t.write(bytes(self.head))
        elif cmd == CMD_SINK and length <= len(self.mem):
            if length:
                self.sink, self.spos = self.mem[:length], 0
            else:
                t.write(self.ack)
        elif cmd == CMD_SOURCE and length <= len(self.mem):
            t.write(self.mem[:length])
        else:
            t.abort()


async def _raw_peer(nbytes: int) -> None:
    loop = asyncio.get_running_loop()
    # The memory a server sends from and receives into is a page-aligned
    # shared mapping (a memfd); the peer's is the same kind (an anonymous
    # shared mapping is shmem too), not a heap bytearray: the kernel's copy
    # to and from the socket then costs both sides the same per page.
    # Filled, so that its pages are faulted in before anything is timed.
    size = max(nbytes, FRAME)
    region = mmap.mmap(-1, size)
    region.write(b"\1" * size)
    mem = memoryview(region)
    closed: asyncio.Future[None] = loop.create_future()
    server = await loop.create_server(lambda: _PeerProtocol(mem, closed), "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    print(f"{READY} {host}:{port}", flush=True)

    # exit with the connection, or when the parent goes away (stdin closes)
    def stdin_readable() -> None:
        if not os.read(0, 4096) and not closed.done():
            closed.set_result(None)

    loop.add_reader(0, stdin_readable)
    try:
        await closed
    finally:
        loop.remove_reader(0)
        server.close()


def run_raw_peer(nbytes: int) -> int:
    import uvloop
    uvloop.run(_raw_peer(nbytes))
    return 0


class RawClient(asyncio.BufferedProtocol):
    """This process's end of the baseline: one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.dest: memoryview | None = None
        self.pos = 0
        self.fut: asyncio.Future[None] | None = None
        self.reply = memoryview(bytearray(FRAME))
        self.scratch = memoryview(bytearray(FRAME))
        self.ping_frame = _frame(CMD_PING)
        self.lost: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        _nodelay(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionResetError("raw peer closed the connection")
        self.transport = None
        if self.fut is not None and not self.fut.done():
            self.fut.set_exception(self.lost)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.dest[self.pos:] if self.dest is not None else self.scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self.dest is None:
            assert self.transport is not None
            self.transport.abort()      # nothing was asked: the peer is broken
            return
        self.pos += nbytes
        if self.pos == len(self.dest):
            self.dest = None
            assert self.fut is not None
            self.fut.set_result(None)

    def _expect(self, dest: memoryview) -> asyncio.Future[None]:
        if self.transport is None:
            raise self.lost or ConnectionError("raw peer not connected")
        self.dest, self.pos = dest, 0
        self.fut = asyncio.get_running_loop().create_future()
        return self.fut

    async def ping(self) -> None:
        fut = self._expect(self.reply)
        assert self.transport is not None
        self.transport.write(self.ping_frame)
        await fut

    async def sink(self, src: memoryview) -> None:
        """Send ``src`` to the peer; return once the peer has all of it."""
        fut = self._expect(self.reply)
        assert self.transport is not None
        self.transport.writelines((_frame(CMD_SINK, len(src)), src))
        await fut

    async def source(self, dest: memoryview) -> None:
        """Receive ``len(dest)`` bytes from the peer straight into ``dest``."""
        fut = self._expect(dest)
        assert self.transport is not None
        self.transport.write(_frame(CMD_SOURCE, len(dest)))
        await fut


async def start_raw_peer(nbytes: int) -> tuple[asyncio.subprocess.Process, RawClient]:
    """Start the raw peer process (able to source and sink ``nbytes``) and
    connect to it.  It exits when its connection or its stdin closes."""
    loop = asyncio.get_running_loop()
    # the child imports this very smb2, installed or not
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (_PACKAGE_ROOT, env.get("PYTHONPATH"))))
    peer = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "smb2.bench", "--raw-peer", "--raw-peer-bytes", str(nbytes),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
    try:
        assert peer.stdout is not None
        line = (await asyncio.wait_for(peer.stdout.readline(), 30)).decode()
        if not line.startswith(READY):
            raise RuntimeError(f"the raw peer did not start: {line!r}")
        host, _, port = line[len(READY):].strip().rpartition(":")
        _, raw = await loop.create_connection(RawClient, host, int(port))
    except BaseException:
        await stop_raw_peer(peer, None)
        raise
    return peer, raw


async def stop_raw_peer(peer: asyncio.subprocess.Process, raw: RawClient | None) -> None:
    """Close the connection and the peer's stdin; kill it if it lingers."""
    if raw is not None and raw.transport is not None:
        raw.transport.close()
    if peer.stdin is not None:
        peer.stdin.close()
    try:
        await asyncio.wait_for(peer.wait(), 5)
    except TimeoutError:
        peer.kill()
        await peer.wait()


# -- helpers -------------------------------------------------------------------

def proc_cpu(pid: int) -> float:
    """utime + stime of process ``pid`` in seconds (0.0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), nearest rank on the sorted values."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def fmt_size(n: int, sep: str = " ") -> str:
    """``n`` bytes in the largest binary unit that divides it ("16 MiB")."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{sep}{unit}"
    return f"{n}{sep}B"


def now() -> str:
    """The time in UTC, ISO 8601, to the second."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def describe_machine(loop: asyncio.AbstractEventLoop | None = None) -> dict[str, Any]:
    """This machine, its load and the versions in use, for a result file."""
    import uvloop

    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "loop": None if loop is None else f"{type(loop).__module__}.{type(loop).__name__}",
        "uvloop": uvloop.__version__,
        "numpy": np.__version__,
        "loadavg_start": list(os.getloadavg()),
    }
    try:
        with open("/proc/cpuinfo") as f:
            models = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        info["cpu"] = models[0] if models else None
    except OSError:
        info["cpu"] = None
    try:
        from .. import __version__
        info["smb2"] = __version__
        here = os.path.dirname(os.path.abspath(__file__))
        rev = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--", "."],
                               capture_output=True, text=True, timeout=5)
        if rev.returncode == 0:
            info["git"] = rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return info


async def timed(fn: Callable[[], Awaitable[None]], k: int) -> float:
    """Seconds for ``k`` sequential calls."""
    t0 = time.perf_counter()
    for _ in range(k):
        await fn()
    return time.perf_counter() - t0


async def latencies(fn: Callable[[], Awaitable[object]], n: int) -> list[float]:
    """``n`` sequential calls; each one's time in microseconds."""
    out = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        await fn()
        out.append((clock() - t0) / 1000)
    return out


def size_list(text: str) -> list[int] | None:
    """``--sizes`` (``4KiB,64MiB``) as byte counts, or None after saying
    on stderr what is wrong with it."""
    from ..protocol import parse_size
    try:
        return [parse_size(s) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        print(f"smb2 bench: {exc}", file=sys.stderr)
        return None


def parse_with_quick(parser: argparse.ArgumentParser, argv: Sequence[str] | None, quick: Sequence[str],
                     keeps: str) -> argparse.Namespace:
    """Add ``--quick`` to ``parser`` and parse ``argv`` (None: ``sys.argv[1:]``).

    ``quick`` is the argv of the benchmark's smallest run that still goes
    through its whole path (every phase and row kind, its baseline, its
    progress lines and JSON) in seconds: with ``--quick`` it is put before
    ``argv``, so an option given on the command line wins over its quick
    value (argparse keeps an option's last value).  ``keeps`` says, for
    ``--help``, what the quick run still does.  Its figures check the
    benchmark's bookkeeping (tests/test_bench_quick.py and the
    benchmarks' own tests run them); they are not for quoting."""
    parser.add_argument("--quick", action="store_true",
                        help=f"the smallest run through the whole benchmark, in seconds, for tests (its figures are "
                             f"not for quoting): {' '.join(quick)}; {keeps} (an option given beside it wins)")
    args = list(sys.argv[1:] if argv is None else argv)
    if parser.parse_known_args(args)[0].quick:
        args = [*quick, *args]
    return parser.parse_args(args)


# -- the host agents a benchmark starts (smb2 bench agents, smb2 bench scale --agents) ------------

def add_agent_options(parser: argparse.ArgumentParser) -> None:
    """``--agent-capacity``, ``--agent-period`` and ``--agent-gather``: what each
    ``smb2-agent`` the benchmark starts is given (:func:`agent_flags`)."""
    parser.add_argument("--agent-capacity", default="256MiB",
                        help="each agent's --capacity (a mirror takes twice its model; default 256MiB)")
    parser.add_argument("--agent-period", type=float, default=None,
                        help="each agent's --period, s (default: the agent's own, 5 ms)")
    parser.add_argument("--agent-gather", type=float, default=None,
                        help="each agent's --gather, s (default: the agent's own, 20 ms; 0: no gathering)")


def agent_flags(args: argparse.Namespace, servers: Sequence[str]) -> list[str]:
    """The ``smb2-agent`` flags (less ``--listen``) of one agent for the memory
    servers ``servers``, from :func:`add_agent_options`'s options."""
    flags = ["--servers", ",".join(servers), "--capacity", args.agent_capacity, "--log-level", "WARNING"]
    if args.agent_period is not None:
        flags += ["--period", str(args.agent_period)]
    if args.agent_gather is not None:
        flags += ["--gather", str(args.agent_gather)]
    return flags
