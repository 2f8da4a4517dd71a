"""``smb2 bench``: smb2 against a raw uvloop TCP baseline, in one run.

What it measures (DESIGN.md, "Measuring"; issue 2, "Performance"):

* **baseline** -- a raw ``asyncio.BufferedProtocol`` transfer over loopback
  between this process and a child process (``python -m smb2.bench
  --raw-peer``): client->peer (the shape of a write) and peer->client (the
  shape of a read), payloads received straight into preallocated memory on
  both ends, and a raw 64-byte request/response round trip;
* **subject** -- smb2 against real ``smb2-server`` processes
  (``LocalCluster(processes=True)``): ``buf.write``, ``buf.read_into`` into a
  preallocated array and ``buf.accumulate`` (float32), and the latency of a
  4 KiB ``read_into``.

Both sides run uvloop.  The machine is shared and has a "slow mode" (waking a
process on the other CPU costs ~50 us instead of a few): baseline and subject
samples are taken back to back in pairs (alternating which goes first), a
burst of raw 64-byte round trips is timed before every pair and stored beside
it, figures are medians, and each ratio is the median of the per-pair ratios,
so a pair taken in slow mode is compared with a baseline taken in slow mode.

It prints a table on stdout, progress on stderr, and writes every sample with
the machine's description to JSON (``--json``, default
``bench-results/bandwidth.json``).  GB/s are 10**9 bytes per second.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import numpy as np

from .protocol import parse_size

MiB = 1 << 20
DEFAULT_SIZES = "1MiB,16MiB,64MiB"

# Targets of issue 2: (op, size) -> least ratio smb2/raw
BANDWIDTH_TARGETS: dict[tuple[str, int], float] = {
    ("read", 64 * MiB): 0.75,
    ("write", 64 * MiB): 0.75,
    ("accumulate", 16 * MiB): 0.5,
}
LATENCY_TARGET = 3.0          # 4 KiB read p50 <= 3x raw 64-byte round trip p50
LATENCY_SIZE = 4096
# A raw 64-byte round trip across CPUs takes ~13 us when the machine is well
# and 50-100 us in its "slow mode"; a pair timed above this was taken slow.
SLOW_RTT_US = 30.0

OPS = ("write", "read", "accumulate")

# -- the raw baseline's wire format --------------------------------------------
# Every message of the raw protocol is one 64-byte frame (cmd, 0, length, then
# padding), so that a ping is exactly 64 bytes each way.  SINK is followed by
# ``length`` payload bytes and answered with one frame once they are all in;
# SOURCE is answered with ``length`` bytes.  Each side receives straight into
# a preallocated buffer via ``get_buffer``: no copies, no ``bytes`` objects.
FRAME = 64
_HDR = struct.Struct("<IIQ")
CMD_PING, CMD_SINK, CMD_SOURCE = 1, 2, 3
_READY = "raw-peer listening on"
# the directory holding the smb2 package (the child imports the same one)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    # filled, so that its pages are faulted in before anything is timed
    mem = memoryview(bytearray(b"\1") * max(nbytes, FRAME))
    closed: asyncio.Future[None] = loop.create_future()
    server = await loop.create_server(lambda: _PeerProtocol(mem, closed), "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    print(f"{_READY} {host}:{port}", flush=True)

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


def _run_peer(nbytes: int) -> int:
    import uvloop
    uvloop.run(_raw_peer(nbytes))
    return 0


class _RawClient(asyncio.BufferedProtocol):
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


# -- helpers -------------------------------------------------------------------

def _pct(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), nearest rank on the sorted values."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def _fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_json(path: str, result: dict[str, Any]) -> None:
    """Write a run's result where ``--json`` says, making the directory."""
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}", file=sys.stderr)


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _machine(loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
    import uvloop

    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "loop": f"{type(loop).__module__}.{type(loop).__name__}",
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
        from . import __version__
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


class _CpuMeter:
    """How busy the machine was with *other* work: CPU time from
    ``/proc/stat`` less what this process, the raw peer and the servers used.
    The rtt shows the machine's mode; this shows a neighbour's test run."""

    def __init__(self) -> None:
        self.pids: list[int] = [os.getpid()]

    def read(self) -> tuple[int, int, int] | None:
        try:
            with open("/proc/stat") as f:
                vals = [int(v) for v in f.readline().split()[1:9]]
            ours = 0
            for pid in self.pids:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                ours += int(fields[11]) + int(fields[12])     # utime + stime
        except (OSError, ValueError, IndexError):
            return None
        # user + nice + system; the loopback's softirq time is mostly ours
        return sum(vals), vals[0] + vals[1] + vals[2], ours

    @staticmethod
    def others(a: tuple[int, int, int] | None, b: tuple[int, int, int] | None) -> float | None:
        """The share of all CPUs that others used between two readings."""
        if a is None or b is None or b[0] <= a[0]:
            return None
        return max(0, (b[1] - a[1]) - (b[2] - a[2])) / (b[0] - a[0])


async def _timed(fn: Callable[[], Awaitable[None]], k: int) -> float:
    t0 = time.perf_counter()
    for _ in range(k):
        await fn()
    return time.perf_counter() - t0


async def latencies(fn: Callable[[], Awaitable[None]], n: int) -> list[float]:
    """``n`` sequential calls; each one's time in microseconds."""
    out = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        await fn()
        out.append((clock() - t0) / 1000)
    return out


# -- the run -------------------------------------------------------------------

class _Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.sizes: list[int] = args.sizes
        self.maxsize = max(max(self.sizes), LATENCY_SIZE)
        self.samples: list[dict[str, Any]] = []
        self.latency: dict[str, Any] = {}
        self.peer: asyncio.subprocess.Process | None = None
        self.raw: _RawClient | None = None
        self.cpu = _CpuMeter()

    # raw peer ------------------------------------------------------------
    async def start_peer(self) -> _RawClient:
        loop = asyncio.get_running_loop()
        # the child imports this very smb2, installed or not
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (_PACKAGE_ROOT, env.get("PYTHONPATH"))))
        self.peer = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "smb2.bench", "--raw-peer", "--raw-peer-bytes", str(self.maxsize),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
        assert self.peer.stdout is not None
        line = (await asyncio.wait_for(self.peer.stdout.readline(), 30)).decode()
        if not line.startswith(_READY):
            raise RuntimeError(f"the raw peer did not start: {line!r}")
        host, _, port = line[len(_READY):].strip().rpartition(":")
        _, proto = await loop.create_connection(_RawClient, host, int(port))
        self.raw = proto
        return proto

    async def stop_peer(self) -> None:
        if self.raw is not None and self.raw.transport is not None:
            self.raw.transport.close()
        p = self.peer
        if p is None:
            return
        if p.stdin is not None:
            p.stdin.close()
        try:
            await asyncio.wait_for(p.wait(), 5)
        except TimeoutError:
            p.kill()
            await p.wait()

    async def rtt_burst(self, n: int) -> list[float]:
        assert self.raw is not None
        return await latencies(self.raw.ping, n)

    # the run -------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        import smb2

        args = self.args
        started = _now()
        machine = _machine(asyncio.get_running_loop())
        _progress(f"{machine['nproc']} CPUs, load {machine['loadavg_start']}, loop {machine['loop']}")

        # Children inherit the affinity they are spawned with: start the raw
        # peer and the servers on the "far" CPU, then move this process to
        # the "near" one.  Unpinned, the kernel puts two processes that ping
        # each other on one CPU at some times and on two at others, and the
        # round trip jumps between ~20 and ~70 us with placement rather than
        # load (and differently for the raw peer and the server); pinned,
        # baseline and subject always cross CPUs (as they would cross hosts),
        # so the rtt reads the machine's mode.
        own = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        near = far = None
        if args.pin and len(own) >= 2:
            near, far = own[0], own[1]
            os.sched_setaffinity(0, {far})
        machine["pinning"] = {"client": near, "peers": far} if near is not None else None

        capacity = max(256 * MiB, 2 * self.maxsize)
        cluster = smb2.LocalCluster(servers=args.servers, processes=True, capacity=capacity)
        try:
            try:
                raw = await self.start_peer()
                await cluster.start()
            finally:
                if near is not None:
                    os.sched_setaffinity(0, {near})
            if self.peer is not None:
                self.cpu.pids.append(self.peer.pid)
            self.cpu.pids.extend(cluster.pid(i) for i in range(args.servers))
            client = await cluster.connect(transport=args.transport)
            transports = client.transports
            name = f"bench-{os.getpid()}"
            buf = await client.create(name, self.maxsize)
            _progress(f"raw peer pid {self.peer.pid if self.peer else '?'}; smb2-server "
                      f"{', '.join(cluster.addresses)} over {', '.join(transports)}; pinned "
                      f"{machine['pinning'] or 'no'}")
            try:
                await self.bandwidth(raw, buf)
                await self.latencies(raw, buf)
            finally:
                await client.destroy(name)
        finally:
            await cluster.close()
            await self.stop_peer()

        machine["loadavg_end"] = list(os.getloadavg())
        return {
            "benchmark": "smb2 bandwidth and latency against raw uvloop TCP",
            "started": started, "finished": _now(),
            "machine": machine,
            "config": {"sizes": self.sizes, "repeat": args.repeat, "servers": args.servers,
                       "transport": args.transport, "transports_used": transports,
                       "sample_bytes": args.sample_bytes, "rtt_burst": args.rtt_burst,
                       "latency_count": len(self.latency["samples_us"]["raw_rtt_64"]),
                       "latency_block": args.latency_block, "quick": args.quick,
                       "loops": "uvloop in this process, the raw peer and smb2-server",
                       "units": "GB/s = 1e9 bytes/s; us = microseconds"},
            "samples": self.samples,
            "latency": self.latency,
        }

    async def bandwidth(self, raw: _RawClient, buf: Any) -> None:
        """Pairs of (raw, smb2) samples per op and size, ``repeat`` rounds."""
        args = self.args
        n = self.maxsize
        src = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
        delta = np.full(n // 4, 1.0, dtype=np.float32)
        dst = np.ones(n, dtype=np.uint8)          # touched: no page faults while timed
        srcv, dstv = src.data, dst.data
        await buf.write(0, src)                   # fault in the servers' pages

        def pair(op: str, size: int) -> tuple[Callable[[], Awaitable[None]],
                                              Callable[[], Awaitable[None]]]:
            if op == "write":
                s = src[:size]
                return (lambda: raw.sink(srcv[:size])), (lambda: buf.write(0, s))
            if op == "read":
                d = dst[:size]
                return (lambda: raw.source(dstv[:size])), (lambda: buf.read_into(d, 0))
            dl = delta[:size // 4]     # the raw side of an accumulate is a plain send
            return (lambda: raw.sink(srcv[:size])), (lambda: buf.accumulate(0, dl))

        # warm up: every op once each way (TCP windows grown, code paths hot)
        for size in self.sizes:
            for op in OPS:
                for fn in pair(op, size):
                    await fn()
        await self.rtt_burst(200)

        npair = 0
        for rep in range(args.repeat):
            for size in self.sizes:
                # ops per timed stretch: one 1 MiB op alone is too short to time
                k = max(1, -(-args.sample_bytes // (2 * size)))
                for op in OPS:
                    r, s = pair(op, size)
                    rtts = await self.rtt_burst(args.rtt_burst)
                    # A B B A: whichever runs first after the pause of the rtt
                    # burst runs measurably faster on a loaded machine, and the
                    # machine drifts; this cancels both (A alternates)
                    raw_first = npair % 2 == 0
                    npair += 1
                    a, b = (r, s) if raw_first else (s, r)
                    cpu0 = self.cpu.read()
                    ta = await _timed(a, k)
                    tb = await _timed(b, k)
                    tb += await _timed(b, k)
                    ta += await _timed(a, k)
                    others = self.cpu.others(cpu0, self.cpu.read())
                    t_raw, t_smb2 = (ta, tb) if raw_first else (tb, ta)
                    nbytes = 2 * k * size
                    self.samples.append({
                        "op": op, "size": size, "repeat": rep, "ops": 2 * k,
                        "raw_s": t_raw, "smb2_s": t_smb2,
                        "raw_gbps": nbytes / t_raw / 1e9, "smb2_gbps": nbytes / t_smb2 / 1e9,
                        "ratio": t_raw / t_smb2,
                        "rtt_p50_us": statistics.median(rtts), "rtt_min_us": min(rtts),
                        "others_cpu": others,
                        "order": "raw,smb2,smb2,raw" if raw_first else "smb2,raw,raw,smb2",
                        "t": time.time(),
                    })
            last = [x for x in self.samples[-len(self.sizes) * len(OPS):] if x["size"] == self.maxsize]
            _progress(f"round {rep + 1}/{args.repeat}: " + "; ".join(
                f"{x['op']} {_fmt_size(x['size'])} smb2 {x['smb2_gbps']:.2f} raw {x['raw_gbps']:.2f} GB/s"
                for x in last) + f"; rtt {self.samples[-1]['rtt_p50_us']:.0f} us")

    async def latencies(self, raw: _RawClient, buf: Any) -> None:
        """Blocks of raw 64-byte round trips and smb2 small reads, taken in
        turn so that both see the same modes of the machine."""
        args = self.args
        small = np.empty(LATENCY_SIZE, dtype=np.uint8)
        tiny = np.empty(64, dtype=np.uint8)
        runs: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("raw_rtt_64", raw.ping),
            ("smb2_read_4k", lambda: buf.read_into(small, 0)),
            ("smb2_read_64", lambda: buf.read_into(tiny, 0)),
        ]
        for _, fn in runs:
            await latencies(fn, 50)
        lat: dict[str, list[float]] = {key: [] for key, _ in runs}
        blocks: list[dict[str, Any]] = []
        per = args.latency_block
        for b in range(max(1, args.latency_count // per)):
            block: dict[str, Any] = {"block": b, "t": time.time()}
            cpu0 = self.cpu.read()
            for key, fn in (runs if b % 2 == 0 else runs[::-1]):
                xs = await latencies(fn, per)
                lat[key].extend(xs)
                block[f"{key}_p50_us"] = statistics.median(xs)
            block["others_cpu"] = self.cpu.others(cpu0, self.cpu.read())
            blocks.append(block)
        _progress(f"latency: smb2 4 KiB read p50 {_pct(lat['smb2_read_4k'], 50):.1f} us, "
                  f"raw 64 B rtt p50 {_pct(lat['raw_rtt_64'], 50):.1f} us")
        self.latency = {
            "samples_us": {k: [round(x, 2) for x in v] for k, v in lat.items()},
            "blocks": blocks,
            "p50_us": {k: _pct(v, 50) for k, v in lat.items()},
            "p99_us": {k: _pct(v, 99) for k, v in lat.items()},
        }


# -- summary -----------------------------------------------------------------------

def _mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def _pcent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians, ratios and targets from the samples of one run."""
    samples = result["samples"]
    all_rtt = [s["rtt_p50_us"] for s in samples]
    floor = min(all_rtt) if all_rtt else float("nan")
    pinned = bool(result["machine"].get("pinning"))
    rows = []
    for size in result["config"]["sizes"]:
        for op in OPS:
            ss = [s for s in samples if s["op"] == op and s["size"] == size]
            if not ss:
                continue
            smb2 = statistics.median(s["smb2_gbps"] for s in ss)
            raw = statistics.median(s["raw_gbps"] for s in ss)
            ratio = statistics.median(s["ratio"] for s in ss)
            target = BANDWIDTH_TARGETS.get((op, size))
            rows.append({
                "op": op, "size": size, "n": len(ss),
                "smb2_gbps": smb2, "raw_gbps": raw,
                "smb2_gbps_min": min(s["smb2_gbps"] for s in ss),
                "smb2_gbps_max": max(s["smb2_gbps"] for s in ss),
                "raw_gbps_min": min(s["raw_gbps"] for s in ss),
                "raw_gbps_max": max(s["raw_gbps"] for s in ss),
                "ratio": ratio, "ratio_of_medians": smb2 / raw,
                "rtt_us": statistics.median(s["rtt_p50_us"] for s in ss),
                "slow": sum(s["rtt_p50_us"] > SLOW_RTT_US for s in ss),
                "others_cpu": _mean([s["others_cpu"] for s in ss]),
                "target": target,
                "pass": None if target is None else ratio >= target,
            })
    lat = result["latency"]
    lrows = []
    if lat:
        raw50, raw99 = lat["p50_us"]["raw_rtt_64"], lat["p99_us"]["raw_rtt_64"]
        blocks = lat["blocks"]
        for key, size in (("smb2_read_4k", LATENCY_SIZE), ("smb2_read_64", 64)):
            p50, p99 = lat["p50_us"][key], lat["p99_us"][key]
            target = LATENCY_TARGET if size == LATENCY_SIZE else None
            ratio = p50 / raw50
            lrows.append({
                "op": "read", "size": size, "smb2_p50_us": p50, "smb2_p99_us": p99,
                "raw_p50_us": raw50, "raw_p99_us": raw99, "ratio": ratio,
                "ratio_blocks": statistics.median(b[f"{key}_p50_us"] / b["raw_rtt_64_p50_us"]
                                                  for b in blocks),
                "others_cpu": _mean([b["others_cpu"] for b in blocks]),
                "target": target, "pass": None if target is None else ratio <= target,
            })
    return {"bandwidth": rows, "latency": lrows, "rtt_floor_us": floor, "pinned": pinned}


def format_table(summary: dict[str, Any]) -> str:
    out = []
    head = (f"{'op':<11}{'size':>8}  {'smb2 GB/s':>9}  {'raw GB/s':>8}  {'ratio':>6}  "
            f"{'rtt us':>6}  {'slow':>5}  {'others':>6}  target")
    out.append(head)
    out.append("-" * len(head) + "-" * 12)
    for r in summary["bandwidth"]:
        tgt = "" if r["target"] is None else \
            f">={r['target']:.2f}x {'PASS' if r['pass'] else 'MISS'}"
        out.append(f"{r['op']:<11}{_fmt_size(r['size']):>8}  {r['smb2_gbps']:>9.2f}  "
                   f"{r['raw_gbps']:>8.2f}  {r['ratio']:>5.2f}x  {r['rtt_us']:>6.1f}  "
                   f"{r['slow']:>2}/{r['n']:<2}  {_pcent(r['others_cpu']):>6}  {tgt}")
    if summary["latency"]:
        out.append("")
        head = (f"{'latency':<11}{'size':>8}  {'smb2 p50/p99 us':>16}  {'raw 64 B rtt p50/p99':>20}  "
                f"{'ratio':>6}  {'others':>6}  target")
        out.append(head)
        out.append("-" * len(head) + "-" * 12)
        for r in summary["latency"]:
            tgt = "" if r["target"] is None else \
                f"<={r['target']:.1f}x {'PASS' if r['pass'] else 'MISS'}"
            smb2 = f"{r['smb2_p50_us']:.1f} / {r['smb2_p99_us']:.1f}"
            raw = f"{r['raw_p50_us']:.1f} / {r['raw_p99_us']:.1f}"
            out.append(f"{'read':<11}{_fmt_size(r['size']):>8}  {smb2:>16}  {raw:>20}  "
                       f"{r['ratio']:>5.2f}x  {_pcent(r['others_cpu']):>6}  {tgt}")
    out.append("")
    out.append("ratio = median over back-to-back pairs of smb2/raw; rtt = raw 64 B round trip "
               "p50 timed before each pair;")
    out.append(f"slow = pairs whose rtt exceeded {SLOW_RTT_US:.0f} us (the machine's slow mode); "
               f"best rtt of the run {summary['rtt_floor_us']:.1f} us;")
    out.append("others = share of all CPUs busy with other processes meanwhile")
    missing = sorted({size for _, size in BANDWIDTH_TARGETS} - {r["size"] for r in summary["bandwidth"]})
    if missing:
        out.append(f"(the bandwidth targets need --sizes to include {', '.join(map(_fmt_size, missing))})")
    if not summary["pinned"]:
        out.append("unpinned: the rtt also depends on whether the kernel put both ends on one CPU")
    return "\n".join(out)


# -- command line ----------------------------------------------------------------------

def _sizes(text: str) -> list[int]:
    try:
        sizes = [parse_size(s) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not sizes or any(s <= 0 or s % 4 for s in sizes):
        raise argparse.ArgumentTypeError("sizes are positive multiples of 4 bytes, e.g. 1MiB,16MiB")
    return sizes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smb2 bench",
        description="Bandwidth and latency of smb2 against a raw uvloop TCP baseline, "
                    "measured in one run on this machine.")
    p.add_argument("--sizes", type=_sizes, default=None,
                   help=f"transfer sizes (default {DEFAULT_SIZES})")
    p.add_argument("--repeat", type=int, default=None,
                   help="sample pairs per op and size (default 25; 9 with --quick)")
    p.add_argument("--json", default="bench-results/bandwidth.json", metavar="PATH",
                   help="where to write every sample (default bench-results/bandwidth.json; '' for none)")
    p.add_argument("--transport", default="tcp", choices=("tcp", "rdma", "auto"),
                   help="smb2 transport (default tcp, the baseline's fabric)")
    p.add_argument("--servers", type=int, default=1, help="smb2-server processes (default 1)")
    p.add_argument("--quick", action="store_true", help="fewer samples: done in about 20 s")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin this process to one CPU and the peers to another")
    p.add_argument("--raw-peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--raw-peer-bytes", type=int, default=64 * MiB, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.transport == "rdma":
        # against a bare pyverbs post-and-poll loop instead (bench_rdma.py)
        from . import bench_rdma
        return bench_rdma.main(argv)
    if args.raw_peer:
        return _run_peer(args.raw_peer_bytes)
    if args.servers < 1:
        print("smb2 bench: --servers must be at least 1", file=sys.stderr)
        return 2
    if args.sizes is None:
        args.sizes = _sizes(DEFAULT_SIZES)
    if args.repeat is None:
        args.repeat = 9 if args.quick else 25
    if args.repeat < 1:
        print("smb2 bench: --repeat must be at least 1", file=sys.stderr)
        return 2
    # per sample, repeat an op until it moved this much (a 1 MiB op alone is too short to time)
    args.sample_bytes = 32 * MiB if args.quick else 64 * MiB
    args.rtt_burst = 50
    args.latency_block = 200
    args.latency_count = 2000 if args.quick else 10000

    import uvloop

    from .errors import Smb2Error
    try:
        result = uvloop.run(_Bench(args).run())
    except (Smb2Error, OSError, RuntimeError) as exc:
        print(f"smb2 bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("smb2 bench: interrupted", file=sys.stderr)
        return 130
    summary = summarize(result)
    result["summary"] = summary
    print(format_table(summary))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
