"""``smb2 bench``: smb2 against a raw uvloop TCP baseline, in one run.

What it measures (docs/design.md, "Measuring"):

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
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from ..protocol import parse_size
from . import report
from .common import (
    MiB,
    RawClient,
    describe_machine,
    fmt_size,
    latencies,
    now,
    pct,
    start_raw_peer,
    stop_raw_peer,
    timed,
)
from .report import median_round_trip, run_and_report

DEFAULT_SIZES = "1MiB,16MiB,64MiB"

# The least ratio smb2/raw each (op, size) must reach: TCP at the loopback ceiling
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


def _progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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


# -- the run -------------------------------------------------------------------

class _Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.sizes: list[int] = args.sizes
        self.maxsize = max(max(self.sizes), LATENCY_SIZE)
        self.samples: list[dict[str, Any]] = []
        self.latency: dict[str, Any] = {}
        self.peer: asyncio.subprocess.Process | None = None
        self.raw: RawClient | None = None
        self.cpu = _CpuMeter()

    # raw peer ------------------------------------------------------------
    async def start_peer(self) -> RawClient:
        self.peer, self.raw = await start_raw_peer(self.maxsize)
        return self.raw

    async def stop_peer(self) -> None:
        if self.peer is not None:
            await stop_raw_peer(self.peer, self.raw)

    async def rtt_burst(self, n: int) -> list[float]:
        assert self.raw is not None
        return await latencies(self.raw.ping, n)

    # the run -------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        import smb2

        args = self.args
        started = now()
        machine = describe_machine(asyncio.get_running_loop())
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
            "started": started, "finished": now(),
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

    async def bandwidth(self, raw: RawClient, buf: Any) -> None:
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
        report.progress("bandwidth", 0, args.repeat, "rounds of " + ", ".join(OPS) + " at "
                        + ", ".join(fmt_size(x) for x in self.sizes))
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
                    ta = await timed(a, k)
                    tb = await timed(b, k)
                    tb += await timed(b, k)
                    ta += await timed(a, k)
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
            report.progress("bandwidth", rep + 1, args.repeat, f"round at {fmt_size(self.maxsize)}",
                            **{x["op"]: f"smb2 {x['smb2_gbps']:.2f} raw {x['raw_gbps']:.2f} GB/s" for x in last},
                            rtt=f"{self.samples[-1]['rtt_p50_us']:.0f} us")

    async def latencies(self, raw: RawClient, buf: Any) -> None:
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
        _progress(f"latency: smb2 4 KiB read p50 {pct(lat['smb2_read_4k'], 50):.1f} us, "
                  f"raw 64 B rtt p50 {pct(lat['raw_rtt_64'], 50):.1f} us")
        self.latency = {
            "samples_us": {k: [round(x, 2) for x in v] for k, v in lat.items()},
            "blocks": blocks,
            "p50_us": {k: pct(v, 50) for k, v in lat.items()},
            "p99_us": {k: pct(v, 99) for k, v in lat.items()},
        }


# -- summary -----------------------------------------------------------------------

def _mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


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
    out = [report.table(
        ["op", "size", "smb2 GB/s", "raw GB/s", "ratio", "rtt us", "slow", "others", "target"],
        [[r["op"], fmt_size(r["size"]), r["smb2_gbps"], r["raw_gbps"], r["ratio"], r["rtt_us"],
          f"{r['slow']}/{r['n']}", r["others_cpu"],
          None if r["target"] is None else report.target(">=", r["target"], "{:.2f}x", r["pass"])]
         for r in summary["bandwidth"]],
        formats=[None, None, "{:.2f}", "{:.2f}", "{:.2f}x", "{:.1f}", None, "{:.0%}"])]
    if summary["latency"]:
        out += ["", report.table(
            ["latency", "size", "smb2 p50 us", "smb2 p99 us", "raw 64 B rtt p50", "raw 64 B rtt p99", "ratio",
             "others", "target"],
            [["read", fmt_size(r["size"]), r["smb2_p50_us"], r["smb2_p99_us"], r["raw_p50_us"], r["raw_p99_us"],
              r["ratio"], r["others_cpu"],
              None if r["target"] is None else report.target("<=", r["target"], "{:.1f}x", r["pass"])]
             for r in summary["latency"]],
            formats=[None, None, "{:.1f}", "{:.1f}", "{:.1f}", "{:.1f}", "{:.2f}x", "{:.0%}"])]
    out.append("")
    out.append("ratio = median over back-to-back pairs of smb2/raw; rtt = raw 64 B round trip "
               "p50 timed before each pair;")
    out.append(f"slow = pairs whose rtt exceeded {SLOW_RTT_US:.0f} us (the machine's slow mode); "
               f"best rtt of the run {summary['rtt_floor_us']:.1f} us;")
    out.append("others = share of all CPUs busy with other processes meanwhile")
    missing = sorted({size for _, size in BANDWIDTH_TARGETS} - {r["size"] for r in summary["bandwidth"]})
    if missing:
        out.append(f"(the bandwidth targets need --sizes to include {', '.join(map(fmt_size, missing))})")
    if not summary["pinned"]:
        out.append("unpinned: the rtt also depends on whether the kernel put both ends on one CPU")
    return "\n".join(out)


def round_trip(result: dict[str, Any]) -> float | None:
    """The run's 64-byte round trip: the raw peer's, the median of those timed before each pair."""
    return median_round_trip([r["rtt_us"] for r in result["summary"]["bandwidth"]])


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
    p.add_argument("--transport", default="tcp", choices=("tcp", "rdma", "shm", "auto"),
                   help="smb2 transport (default tcp, the baseline's fabric; rdma and shm have "
                        "benchmarks of their own)")
    p.add_argument("--servers", type=int, default=1, help="smb2-server processes (default 1)")
    p.add_argument("--quick", action="store_true", help="fewer samples: done in about 20 s")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin this process to one CPU and the peers to another")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
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

    return run_and_report(_Bench(args).run, summarize, format_table, args.json, round_trip)
