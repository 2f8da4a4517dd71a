"""``smb2 bench accumulate``: server-side accumulate throughput with 1 and
with more server threads (``smb2-server --threads``), in one run.

    smb2 bench accumulate [--threads 1,2] [--size 64MiB] [--clients 2] [--seconds 3] [--turns 2]
    smb2 bench accumulate --quick     # seconds: 1 MiB pushes for 0.2 s, one turn

For each thread count it starts one ``smb2-server`` process with that
``--threads`` and has ``--clients`` connections push ``--size`` deltas at
once into one buffer (fp32, then bf16 widened into fp32 words) for
``--seconds``.  It reports, per thread count and element kind, the GB/s of
destination words updated, the server's CPU seconds per GB (read from
/proc: what the server spent, whatever the clients on the same machine
cost), the part of it its loop's thread spent ("loop": one loop can do at
most 1 / that GB a second, so it is the figure threads must bring down,
and it holds still on a loaded machine where GB/s does not), and the
64-byte round trip of that server beside them; the add alone in this
process ("kernel", GB/s, cut among the same threads in requests of at
most 4 MiB: what a staged RDMA accumulate costs, its delta already in
the server's memory); and the
same for plain writes of those words, which the server receives in place
without adding: their CPU per GB is what receiving costs, and an
accumulate's CPU beyond it is what threads can cut.  Thread
counts are measured in turns, so a change of load on the machine hits each
alike; the table gives medians over the turns.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from ..protocol import MAX_ACCUMULATE, WIRE_CODES
from .common import fmt_size, now, parse_with_quick, size_list
from .report import median_round_trip, progress, round_trip_us, run_and_report, table

KINDS = {"fp32": None, "bf16": "bfloat16"}
# a plain write of the same float32 words: what receiving the payload costs
# the server without the add (its CPU s/GB against an fp32 push's is the add's share)
WRITE = "write"
#: --quick: both thread counts and every kind, once and briefly
QUICK = ["--threads", "1,2", "--size", "1MiB", "--seconds", "0.2", "--turns", "1"]


def _cpu_seconds(pid: int, loop_only: bool = False) -> float:
    """User and system CPU seconds the process has used, or only its main
    thread, the one running the loop (Linux /proc)."""
    with open(f"/proc/{pid}/task/{pid}/stat" if loop_only else f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _push(servers: list[str], transport: str, size: int, clients: int, wire: str | None,
                seconds: float, pid: int, write: bool = False) -> dict[str, float]:
    import smb2

    name = f"bench-acc-{time.monotonic_ns()}"
    conns = [await smb2.connect(servers, transport=transport) for _ in range(clients)]
    try:
        bufs = [await conns[0].create(name, size)] + [await c.attach(name) for c in conns[1:]]
        delta = np.ones(size // 4, np.float32)
        for b in bufs:          # warm: connections, the segment's pages
            await b.accumulate(0, delta, wire=wire)
        done = [0] * clients
        stop = time.perf_counter() + seconds

        async def pusher(k: int) -> None:
            while time.perf_counter() < stop:
                if write:
                    await bufs[k].write(0, delta)
                else:
                    await bufs[k].accumulate(0, delta, wire=wire)
                done[k] += 1

        cpu0, loop0, t0 = _cpu_seconds(pid), _cpu_seconds(pid, loop_only=True), time.perf_counter()
        await asyncio.gather(*(pusher(k) for k in range(clients)))
        elapsed, cpu = time.perf_counter() - t0, _cpu_seconds(pid) - cpu0
        loop_cpu = _cpu_seconds(pid, loop_only=True) - loop0
        gb = sum(done) * size / 1e9
        # every push added 1 to every word: the sum says none was lost
        total = 1 if write else clients + sum(done)
        got = (await bufs[0].read(0, 4096)).view(np.float32)
        if not (got == total).all():
            raise RuntimeError(f"the buffer holds {got[0]} after {total} pushes of 1: an accumulate was lost")
        await conns[0].destroy(name)
    finally:
        for c in conns:
            await c.close()
    return {"GBps": gb / elapsed, "server_cpu_s_per_GB": cpu / gb if gb else float("nan"),
            "loop_cpu_s_per_GB": loop_cpu / gb if gb else float("nan")}


def _kernel(size: int, threads: int, code: int, seconds: float) -> float:
    """GB/s of float32 words the add alone updates in this process, cut
    among ``threads`` as a server cuts it: what a staged RDMA accumulate
    costs a server, whose delta is in its memory before the loop sees it."""
    from .. import _core

    dst = np.zeros(size // 4, np.float32)
    src = np.ones(size // 4, np.float32) if code == 1 else np.full(size // 4, 0x3F80, np.uint16)   # 1.0
    words, delta = dst.data.cast("B"), src.data.cast("B")
    per_word = src.itemsize
    done, stop = 0, time.perf_counter() + seconds
    t0 = time.perf_counter()
    while time.perf_counter() < stop:
        # a server's request is at most MAX_ACCUMULATE bytes of delta: add in such pieces
        for lo in range(0, len(words), MAX_ACCUMULATE):
            hi = min(len(words), lo + MAX_ACCUMULATE)
            _core.accumulate(words[lo:hi], delta[lo * per_word // 4:hi * per_word // 4], code, threads)
        done += 1
    return done * size / (time.perf_counter() - t0) / 1e9


async def measure(args: argparse.Namespace, size: int) -> dict[str, Any]:
    import smb2

    runs: list[dict[str, Any]] = []
    for turn in range(args.turns):
        for threads in args.threads:
            async with smb2.LocalCluster(servers=1, processes=True, capacity=size + (64 << 20),
                                         options={"threads": threads}) as cluster:
                pid = cluster.pid(0)
                row: dict[str, Any] = {"turn": turn, "threads": threads,
                                       "round_trip_64B_us": await round_trip_us(cluster.addresses)}
                for kind, wire in KINDS.items():
                    row[kind] = await _push(cluster.addresses, args.transport, size, args.clients, wire,
                                            args.seconds, pid)
                row[WRITE] = await _push(cluster.addresses, args.transport, size, args.clients, None,
                                         args.seconds, pid, write=True)
                row["kernel_GBps"] = {kind: _kernel(size, threads, WIRE_CODES.get(wire or "", 1), args.seconds / 2)
                                      for kind, wire in KINDS.items()}
                runs.append(row)
                progress("accumulate", len(runs), args.turns * len(args.threads), f"turn {turn}, {threads} threads",
                         **{k: f"{row[k]['GBps']:.2f} GB/s" for k in KINDS})
    return {"benchmark": "accumulate", "started": now(), "quick": args.quick, "transport": args.transport,
            "size": size, "clients": args.clients, "seconds": args.seconds, "turns": args.turns, "runs": runs,
            "note": "GB/s of float32 destination words updated; a bf16 push sends half those bytes"}


def summarize(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    threads = sorted({r["threads"] for r in result["runs"]})
    base: dict[str, float] = {}
    for t in threads:
        runs = [r for r in result["runs"] if r["threads"] == t]
        row: dict[str, Any] = {"threads": t, "round_trip_64B_us": round(
            statistics.median(r["round_trip_64B_us"] for r in runs), 1)}
        for kind in KINDS:
            gbps = statistics.median(r[kind]["GBps"] for r in runs)
            base.setdefault(kind, gbps)
            row[f"{kind}_GBps"] = round(gbps, 3)
            row[f"{kind}_vs_first"] = round(gbps / base[kind], 2)
            row[f"{kind}_cpu_s_per_GB"] = round(statistics.median(r[kind]["server_cpu_s_per_GB"] for r in runs), 3)
            row[f"{kind}_loop_cpu_s_per_GB"] = round(statistics.median(r[kind]["loop_cpu_s_per_GB"] for r in runs), 3)
        for kind in KINDS:
            row[f"{kind}_kernel_GBps"] = round(statistics.median(r["kernel_GBps"][kind] for r in runs), 2)
        row["write_GBps"] = round(statistics.median(r[WRITE]["GBps"] for r in runs), 3)
        row["write_cpu_s_per_GB"] = round(statistics.median(r[WRITE]["server_cpu_s_per_GB"] for r in runs), 3)
        out.append(row)
    return out


def format_table(summary: list[dict[str, Any]]) -> str:
    header = ["threads", "fp32 GB/s", "x", "fp32 CPU s/GB", "loop", "bf16 GB/s", "x", "bf16 CPU s/GB", "loop",
              "write GB/s", "write CPU s/GB", "kernel fp32", "kernel bf16", "64 B rtt us"]
    rows = [[r["threads"], r["fp32_GBps"], r["fp32_vs_first"], r["fp32_cpu_s_per_GB"], r["fp32_loop_cpu_s_per_GB"],
             r["bf16_GBps"], r["bf16_vs_first"], r["bf16_cpu_s_per_GB"], r["bf16_loop_cpu_s_per_GB"],
             r["write_GBps"], r["write_cpu_s_per_GB"], r["fp32_kernel_GBps"], r["bf16_kernel_GBps"],
             r["round_trip_64B_us"]] for r in summary]
    return table(header, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="smb2 bench accumulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2", help="server thread counts to compare (default 1,2)")
    p.add_argument("--size", default="16MiB", help="bytes of float32 words one push updates (default 16MiB)")
    p.add_argument("--clients", type=int, default=2, help="connections pushing at once (default 2)")
    p.add_argument("--seconds", type=float, default=3.0, help="how long each kind is pushed (default 3)")
    p.add_argument("--turns", type=int, default=2, help="turns over the thread counts (default 2)")
    p.add_argument("--transport", default="tcp", choices=["tcp", "shm"],
                   help="the clients' transport (an accumulate's delta goes over the connection either way)")
    p.add_argument("--json", default="", help="write every sample here")
    args = parse_with_quick(p, argv, QUICK, "1 and 2 server threads, fp32, bf16, plain writes and the add alone")
    sizes = size_list(args.size)
    if sizes is None or len(sizes) != 1 or sizes[0] <= 0 or sizes[0] % 4096:
        print("smb2 bench accumulate: --size is one size, a multiple of 4 KiB", file=sys.stderr)
        return 2
    try:
        args.threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        print(f"smb2 bench accumulate: --threads is a list of numbers, not {args.threads!r}", file=sys.stderr)
        return 2
    progress("accumulate", 0, args.turns * len(args.threads),
             f"{fmt_size(sizes[0])} pushes, {args.clients} clients, threads {args.threads}")
    return run_and_report(lambda: measure(args, sizes[0]), summarize, format_table, args.json,
                          lambda result: median_round_trip([r["round_trip_64B_us"] for r in result["runs"]]))


if __name__ == "__main__":
    sys.exit(main())
