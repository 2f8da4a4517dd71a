"""``smb2 bench --transport shm``: the shm transport against a plain
``np.copyto`` of the same size, measured in the same run.

The subject is ``buf.write`` / ``buf.read_into`` of a preallocated array on
a buffer of real ``smb2-server`` processes on this host, mapped by the shm
transport; the baseline is one ``np.copyto`` between two arrays of the same
size in this process, the most a copy can do here.  Pairs alternate which
goes first (docs/design.md, "Measuring"); each ratio is the median over
pairs of subject bandwidth / baseline bandwidth.  Latencies: a 4 KiB
``read_into`` and a ``fetch_add``, each against a 4 KiB ``np.copyto`` and,
for scale, the raw 64-byte TCP round trip of ``smb2 bench`` (the raw peer,
``common.start_raw_peer``).  Each latency is one ``await`` of the operation
itself (the copy: of a coroutine doing just that), and includes reading the
clock around it (~0.05-0.3 us, depending on the machine).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from . import report
from .common import (
    FRAME,
    MiB,
    describe_machine,
    fmt_size,
    latencies,
    now,
    pct,
    size_list,
    start_raw_peer,
    stop_raw_peer,
)
from .report import run_and_report

KiB = 1 << 10
DEFAULT_SIZES = "4KiB,1MiB,64MiB"
# the targets shm must reach (above memcpy's pace): 64 MiB read and write >= 0.8x the in-process copy,
# 4 KiB read p50 <= 2 us, fetch_add p50 <= 1 us
RATIO_TARGETS = {("read", 64 * MiB): 0.8, ("write", 64 * MiB): 0.8}
LATENCY_TARGETS_US = {"read 4 KiB": 2.0, "fetch_add": 1.0}
#: the latency row of the raw loopback round trip (the run's yardstick)
RAW_RTT = "raw TCP 64 B rtt"


async def _seconds(fn: Callable[[], Awaitable[None] | None], k: int) -> float:
    t0 = time.perf_counter()
    for _ in range(k):
        r = fn()
        if r is not None:
            await r
    return time.perf_counter() - t0


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from ..testing.cluster import LocalCluster
    largest = max(args.sizes)
    capacity = f"{(largest + 4 * MiB) * 2 // MiB}MiB"
    result: dict[str, Any] = {"started": now(), "machine": describe_machine(asyncio.get_running_loop()),
                              "args": {"sizes": args.sizes, "repeat": args.repeat, "servers": args.servers},
                              "bandwidth": [], "latency": {}}
    async with LocalCluster(servers=args.servers, processes=True, capacity=capacity) as cluster:
        client = await cluster.connect(transport="shm")
        result["transports_used"] = client.transports
        for size in args.sizes:
            buf = await client.create(f"bench-shm-{size}", size)
            src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            dst = np.empty_like(src)
            await buf.write(0, src)          # maps the segments, touches the pages
            await buf.read_into(dst, 0)
            k = max(1, args.sample_bytes // size)

            def baseline(d: np.ndarray = dst, s: np.ndarray = src) -> None:
                np.copyto(d, s)

            async def write(b: Any = buf, s: np.ndarray = src) -> None:
                await b.write(0, s)

            async def read(b: Any = buf, d: np.ndarray = dst) -> None:
                await b.read_into(d, 0)

            for op, subject in (("write", write), ("read", read)):
                pairs = []
                for r in range(args.repeat):
                    order = [baseline, subject] if r % 2 == 0 else [subject, baseline]
                    times = {fn: await _seconds(fn, k) for fn in order}
                    pairs.append((size * k / times[baseline], size * k / times[subject]))
                result["bandwidth"].append({"op": op, "size": size, "pairs": pairs})
            await client.destroy(f"bench-shm-{size}")
        small = await client.create("bench-shm-small", 4 * KiB)
        out = np.empty(4 * KiB, np.uint8)
        copy_src = np.ones(4 * KiB, np.uint8)

        async def copy4k() -> None:
            np.copyto(out, copy_src)

        await small.read_into(out, 0)        # maps the segment
        peer, raw = await start_raw_peer(FRAME)
        try:
            for name, fn in (("np.copyto 4 KiB", copy4k),
                             ("read 4 KiB", lambda: small.read_into(out, 0)),
                             ("fetch_add", lambda: small.fetch_add(0, 1)),
                             (RAW_RTT, raw.ping)):
                result["latency"][name] = await latencies(fn, args.latency_count)
        finally:
            await stop_raw_peer(peer, raw)
        stats = await client.stat()
        result["server_ops"] = [s["ops"] for s in stats]
        await client.close()
    return result


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for entry in result["bandwidth"]:
        base = [b for b, _ in entry["pairs"]]
        subj = [s for _, s in entry["pairs"]]
        ratio = statistics.median(s / b for b, s in entry["pairs"])
        target = RATIO_TARGETS.get((entry["op"], entry["size"]))
        rows.append({"op": entry["op"], "size": entry["size"], "smb2_gbs": statistics.median(subj) / 1e9,
                     "copyto_gbs": statistics.median(base) / 1e9, "ratio": ratio, "target": target,
                     "met": None if target is None else ratio >= target})
    lat = {name: {"p50_us": pct(v, 50), "p99_us": pct(v, 99), "target_us": LATENCY_TARGETS_US.get(name)}
           for name, v in result["latency"].items()}
    return {"bandwidth": rows, "latency": lat}


def format_table(summary: dict[str, Any]) -> str:
    return "\n".join([
        report.table(["op", "size", "smb2 shm GB/s", "np.copyto GB/s", "ratio", "target"],
                     [[r["op"], fmt_size(r["size"]), r["smb2_gbs"], r["copyto_gbs"], r["ratio"],
                       None if r["target"] is None else report.target(">=", r["target"], "{:.2f}", r["met"])]
                      for r in summary["bandwidth"]], formats=[None, None, "{:.2f}", "{:.2f}", "{:.2f}"]),
        "",
        report.table(["latency", "p50 us", "p99 us", "target"],
                     [[name, v["p50_us"], v["p99_us"], None if v["target_us"] is None else
                       report.target("<=", v["target_us"], "{:g}", v["p50_us"] <= v["target_us"])]
                      for name, v in summary["latency"].items()], formats=[None, "{:.2f}", "{:.2f}"])])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smb2 bench --transport shm",
        description="The shm transport against np.copyto of the same size, in one run on this machine.")
    p.add_argument("--transport", default="shm", choices=("shm",))
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"transfer sizes (default {DEFAULT_SIZES})")
    p.add_argument("--repeat", type=int, default=None, help="sample pairs per op and size (default 15; 5 with --quick)")
    p.add_argument("--servers", type=int, default=2, help="smb2-server processes (default 2)")
    p.add_argument("--json", default="bench-results/shm.json", metavar="PATH",
                   help="where to write every sample (default bench-results/shm.json; '' for none)")
    p.add_argument("--quick", action="store_true", help="fewer samples")
    return p


def main(argv: list[str] | None = None) -> int:
    args, _ = _parser().parse_known_args(argv)
    sizes = size_list(args.sizes)
    if sizes is None:
        return 2
    if not sizes or any(s <= 0 for s in sizes) or args.servers < 1:
        print("smb2 bench: --sizes must be positive and --servers at least 1", file=sys.stderr)
        return 2
    args.sizes = sizes
    args.repeat = args.repeat or (5 if args.quick else 15)
    args.sample_bytes = 64 * MiB if args.quick else 256 * MiB
    args.latency_count = 2000 if args.quick else 20000
    return run_and_report(lambda: _run(args), summarize, format_table, args.json,
                          lambda result: result["summary"]["latency"][RAW_RTT]["p50_us"])
