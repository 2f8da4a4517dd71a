#!/usr/bin/env python3
"""The distributed ticket lock against two baselines, in one run.

* **uncontended**: acquire + release latency (p50, p99) of the ticket lock,
  on both waiting paths ("park": the server answers when our turn comes, the
  TCP default; "poll": fetch_add + reads of now_serving, the RDMA algorithm
  run over TCP), against
    - a raw 64-byte round trip between two uvloop processes (smb2.bench's
      raw peer: no smb2 code on either side),
    - a 64-byte smb2 READ round trip to the same server,
    - a naive spin lock: ``compare_swap(w, 0, 1)`` until it succeeds, then
      ``compare_swap(w, 1, 0)``, on the same transport.
* **contended**: acquisitions per second with 1, 2, 4 and 8 client
  processes looping acquire/release (empty critical section) for a fixed
  time, for the spin lock and the ticket lock, with fairness (max/min
  acquisitions per client) and the server's data ops per acquisition (from
  its statistics: the parked path sends nothing while it waits).
* **shm**: the same lock from clients that map the server's
  memory, in the same run: "futex" (the shm default: atomics on the mapped
  words, waiters sleep on a futex), "shmpoll" (the same atomics, waiters
  poll with the loop yielding: the alternative to the futex), and "mixed"
  (half the processes futex over shm, half parked over TCP, one lock),
  each against the TCP lock ("park") of the same round, and
  "futex_anycpu": "futex" with the workers free to run on every CPU,
  the server's included (it takes no part in a shm lock, so its CPU is
  theirs: the same CPUs as the TCP lock uses, its clients' and its
  server's).  The issue's target (>= 10x the TCP lock) is judged on it;
  pinned "futex" gives all the shm clients one CPU, and each hand-off
  there is a context switch.
  ``--futex-spin`` sets how long a futex waiter next in line spins before
  it sleeps (the library's default: 50 us where it may run on more than
  one CPU, so 0 in the pinned runs).

The machine is shared and noisy: subject and baselines are measured in
alternation (the order rotates every round), every figure is a median, every
ratio is the median of per-round ratios, and the raw round trip is measured
right before each contended run and stored beside it.  Prints a table and
writes JSON (``--json``, default bench-results/lock.json).

The server and the raw peer are pinned to one CPU, this process and the
workers to another (``--no-pin`` to leave placement to the kernel), as
``smb2 bench`` does.  ``--lock-spin 0 --holder-spin 0`` runs the parked
path without its polling (server and holder sleep between hand-offs), to
see what the polling buys.

    python tools/bench_lock.py [--rounds 15] [--duration 1.5] [--procs 1,2,4,8]
    smb2 bench lock --quick           # seconds: 1 round, 2 processes, one 0.3 s run per cell
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvloop

import smb2
from smb2.bench.common import describe_machine, latencies, now, parse_with_quick, pct, start_raw_peer, stop_raw_peer

from . import report

TARGET_UNCONTENDED = 3.0      # park p50 <= 3x raw round trip p50
TARGET_THROUGHPUT = 2.0       # with 4 processes, >= 2x the spin lock
TARGET_FAIRNESS = 1.1         # max/min acquisitions per client, 4 processes
TARGET_SHM = 10.0             # shm futex lock, 4 processes: >= 10x the TCP lock
SHM_KINDS = ("futex", "futex_anycpu", "shmpoll", "mixed")
LOCK = "bench-lock"
SPIN_BUFFER = "bench-spin"
#: --quick: every kind, both critical sections and both tables, each cell once and briefly (2 processes:
#: the 4-process targets are not judged)
QUICK = ["--rounds", "1", "-n", "20", "--reps", "1", "--duration", "0.3", "--procs", "2"]


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Ops:
    """Lock and baseline operations over one client (used by the main
    process for latencies and by every worker for throughput)."""

    def __init__(self, client: smb2.Client, spin: smb2.Buffer, holder_spin: float | None = None,
                 futex_spin: float | None = None) -> None:
        self.client = client
        # holder_spin: the Lock's `spin` (None: the library's default)
        self.park = client.lock(LOCK, mode="park", **({} if holder_spin is None else {"spin": holder_spin}))
        self.poll = client.lock(LOCK, mode="poll")
        link = client.links[0]
        assert link.transport is not None
        self.tr = link.transport
        # over shm: the futex path (a TCP client leaves it unused)
        futex_args = {} if futex_spin is None else {"futex_spin": futex_spin}
        self.futex = client.lock(LOCK, mode="futex", **futex_args)
        # first used with every CPU allowed: its spin is chosen then
        self.futex_anycpu = client.lock(LOCK, mode="futex", **futex_args)
        self.spin_seg = spin.segments[0]
        self.read_dst = [memoryview(bytearray(64))]

        self.word = bytearray(8)
        self.word_view = [memoryview(self.word)]

    async def park_once(self) -> None:
        await self.park.acquire()
        await self.park.release()

    async def poll_once(self) -> None:
        await self.poll.acquire()
        await self.poll.release()

    async def futex_once(self) -> None:
        await self.futex.acquire()
        await self.futex.release()

    async def futex_anycpu_once(self) -> None:
        await self.futex_anycpu.acquire()
        await self.futex_anycpu.release()

    async def spin_acquire(self) -> None:
        tr, seg = self.tr, self.spin_seg
        while await tr.compare_swap(seg, 0, 0, 1) != 0:
            pass

    async def spin_release(self) -> None:
        await self.tr.compare_swap(self.spin_seg, 0, 1, 0)

    async def spin_once(self) -> None:
        await self.spin_acquire()
        await self.spin_release()

    async def rmw(self) -> None:
        # the critical section of asynchronous training: read a word of the
        # shared buffer, change it, write it back
        await self.tr.read_into(self.word_view, self.spin_seg, 128, 8)
        self.word[0] = (self.word[0] + 1) & 0xFF
        await self.tr.write(self.word_view, self.spin_seg, 128, 8)

    async def park_rmw(self) -> None:
        await self.park.acquire()
        await self.rmw()
        await self.park.release()

    async def poll_rmw(self) -> None:
        await self.poll.acquire()
        await self.rmw()
        await self.poll.release()

    async def futex_rmw(self) -> None:
        await self.futex.acquire()
        await self.rmw()
        await self.futex.release()

    async def futex_anycpu_rmw(self) -> None:
        await self.futex_anycpu.acquire()
        await self.rmw()
        await self.futex_anycpu.release()

    async def spin_rmw(self) -> None:
        await self.spin_acquire()
        await self.rmw()
        await self.spin_release()

    async def read64(self) -> None:
        await self.tr.read_into(self.read_dst, self.spin_seg, 64, 64)

    def op(self, kind: str, cs: str = "empty") -> Callable[[], Awaitable[None]]:
        if cs == "rmw":
            return {"park": self.park_rmw, "poll": self.poll_rmw, "spin": self.spin_rmw,
                    "futex": self.futex_rmw, "futex_anycpu": self.futex_anycpu_rmw}[kind]
        return {"park": self.park_once, "poll": self.poll_once, "spin": self.spin_once,
                "futex": self.futex_once, "futex_anycpu": self.futex_anycpu_once,
                "read64": self.read64}[kind]


def _worker_op(tcp: _Ops, shm: _Ops, kind: str, cs: str, index: int) -> Callable[[], Awaitable[None]]:
    """A worker's operation for a contended run of ``kind``: the shm kinds
    run on its shm client ("mixed": every other worker parks over TCP)."""
    if kind in ("futex", "futex_anycpu") or (kind == "mixed" and index % 2 == 0):
        return shm.op("futex" if kind == "mixed" else kind, cs)
    if kind == "shmpoll":
        return shm.op("poll", cs)
    if kind == "mixed":
        return tcp.op("park", cs)
    return tcp.op(kind, cs)


# -- worker processes --------------------------------------------------------------

async def _worker(servers: list[str], holder_spin: float | None, futex_spin: float | None) -> None:
    client = await smb2.connect(servers, transport="tcp")
    ops = _Ops(client, await client.attach(SPIN_BUFFER), holder_spin)
    shm_client = await smb2.connect(servers, transport="shm")
    shm_ops = _Ops(shm_client, await shm_client.attach(SPIN_BUFFER), holder_spin, futex_spin)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print("ready", flush=True)
    while line := await reader.readline():
        cmd = json.loads(line)
        fn = _worker_op(ops, shm_ops, cmd["kind"], cmd["cs"], cmd["index"])
        start, end = cmd["start"], cmd["start"] + cmd["duration"]
        pinned = os.sched_getaffinity(0)
        if cmd.get("cpus"):
            os.sched_setaffinity(0, cmd["cpus"])
        try:
            await asyncio.sleep(max(0.0, start - time.time()))
            n = 0
            # count acquisitions that completed inside the window; the one
            # in flight at its end still runs to completion (and releases)
            while time.time() < end:
                await fn()
                if time.time() <= end:
                    n += 1
        finally:
            os.sched_setaffinity(0, pinned)
        print(json.dumps({"n": n}), flush=True)
    await client.close()
    await shm_client.close()


class _Pool:
    def __init__(self) -> None:
        self.procs: list[asyncio.subprocess.Process] = []

    async def start(self, n: int, servers: list[str], holder_spin: float | None,
                    futex_spin: float | None) -> None:
        env = dict(os.environ)
        for _ in range(n):
            p = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "smb2.bench.lock", "--worker", ",".join(servers),
                *([] if holder_spin is None else ["--holder-spin", str(holder_spin)]),
                *([] if futex_spin is None else ["--futex-spin", str(futex_spin)]),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
            self.procs.append(p)
        for p in self.procs:
            assert p.stdout is not None
            line = await asyncio.wait_for(p.stdout.readline(), 60)
            if line.strip() != b"ready":
                raise RuntimeError(f"a worker did not start: {line!r}")

    async def run(self, kind: str, cs: str, nprocs: int, duration: float,
                  cpus: list[int] | None = None) -> list[int]:
        """Counts per worker; ``cpus``: the CPUs they may run on meanwhile."""
        start = time.time() + 0.2
        procs = self.procs[:nprocs]
        for i, p in enumerate(procs):
            assert p.stdin is not None
            p.stdin.write((json.dumps({"kind": kind, "cs": cs, "start": start, "duration": duration,
                                       "index": i, "cpus": cpus}) + "\n").encode())
        counts = []
        for p in procs:
            assert p.stdout is not None
            counts.append(json.loads(await asyncio.wait_for(p.stdout.readline(), duration + 60))["n"])
        return counts

    async def close(self) -> None:
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in self.procs:
            try:
                await asyncio.wait_for(p.wait(), 10)
            except TimeoutError:
                p.kill()
                await p.wait()


# -- the run ---------------------------------------------------------------------

def _server_data_ops(stats: list[dict[str, Any]]) -> int:
    return sum(sum(c.values()) for s in stats for c in s["ops"].values())


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    result: dict[str, Any] = {"started": now(), "machine": describe_machine(loop), "args": vars(args)}
    # Pinned as smb2.bench pins: the server and the raw peer are started on
    # the "far" CPU (children inherit the affinity they are spawned with),
    # this process and the contending workers on the "near" one.  Every
    # round trip then crosses CPUs, as it would cross hosts, for subject and
    # baselines alike; unpinned, the kernel puts two processes that ping
    # each other on one CPU at some times and on two at others, and the
    # ratios follow placement rather than the lock.
    own = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    near = far = None
    if args.pin and len(own) >= 2:
        near, far = own[0], own[1]
        os.sched_setaffinity(0, {far})
    result["machine"]["pinning"] = {"clients": near, "server_and_raw_peer": far} if near is not None else None
    server_args = [] if args.lock_spin is None else ["--lock-spin", str(args.lock_spin)]
    cluster = smb2.LocalCluster(servers=1, processes=True, capacity="64MiB", server_args=server_args)
    peer = None
    try:
        try:
            await cluster.start()
            peer, raw = await start_raw_peer(64)
        finally:
            if near is not None:
                os.sched_setaffinity(0, {near})
        _progress(f"pinned: {result['machine']['pinning'] or 'no'}")
        client = await cluster.connect(transport="tcp")
        spin = await client.create(SPIN_BUFFER, 4096)
        ops = _Ops(client, spin, args.holder_spin)
        shm_client = await cluster.connect(transport="shm")
        shm_ops = _Ops(shm_client, await shm_client.attach(SPIN_BUFFER), args.holder_spin, args.futex_spin)
        pool = _Pool()
        try:
            await latencies(raw.ping, 2000)          # warm up every path
            for kind in ("read64", "park", "poll", "spin"):
                await latencies(ops.op(kind), 500)
            await latencies(shm_ops.op("futex"), 500)

            # -- uncontended ------------------------------------------------
            kinds = ["raw", "read64", "park", "poll", "spin", "futex"]
            fns = {"raw": raw.ping, **{k: ops.op(k) for k in kinds[1:-1]}, "futex": shm_ops.op("futex")}
            samples: dict[str, list[float]] = {k: [] for k in kinds}
            rounds: list[dict[str, float]] = []
            report.progress("lock", 0, args.rounds, "uncontended rounds of " + ", ".join(kinds))
            for r in range(args.rounds):
                order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
                med = {}
                for k in order:
                    lat = await latencies(fns[k], args.n)
                    samples[k].extend(lat)
                    med[k] = statistics.median(lat)
                rounds.append(med)
                report.progress("lock", r + 1, args.rounds, "uncontended round",
                                **{k: f"{med[k]:.1f}us" for k in kinds})
            unc: dict[str, Any] = {}
            for k in kinds:
                unc[k] = {"p50_us": pct(samples[k], 50), "p99_us": pct(samples[k], 99),
                          "ratio_p50_vs_raw": statistics.median(m[k] / m["raw"] for m in rounds),
                          "ratio_p50_vs_read64": statistics.median(m[k] / m["read64"] for m in rounds)}
            result["uncontended"] = {"rounds": rounds, "summary": unc}

            # -- contended ----------------------------------------------------
            await pool.start(max(args.procs), cluster.addresses, args.holder_spin, args.futex_spin)
            contended: list[dict[str, Any]] = []
            ckinds = ["spin", "park", "poll", *args.shm]
            cells = len(args.cs) * len(args.procs) * args.reps * len(ckinds)
            report.progress("lock", 0, cells, "contended cells of " + ", ".join(ckinds))
            for cs, nprocs in [(cs, n) for cs in args.cs for n in args.procs]:
                for rep in range(args.reps):
                    order = ckinds[rep % len(ckinds):] + ckinds[:rep % len(ckinds)]
                    for kind in order:
                        rtt = statistics.median(await latencies(raw.ping, 300))
                        before = _server_data_ops(await client.stat())
                        counts = await pool.run(kind, cs, nprocs, args.duration,
                                                own if kind == "futex_anycpu" else None)
                        after = _server_data_ops(await client.stat())
                        total = sum(counts)
                        row = {"kind": kind, "cs": cs, "procs": nprocs, "rep": rep, "rtt_us": rtt,
                               "counts": counts, "per_s": total / args.duration,
                               "fairness": (max(counts) / min(counts)) if min(counts) else None,
                               "server_ops_per_acq": (after - before) / total if total else None}
                        contended.append(row)
                        report.progress("lock", len(contended), cells, f"{cs}, {nprocs} procs, {kind}",
                                        rate=f"{row['per_s']:.0f}/s", fairness=f"{row['fairness'] or float('inf'):.3f}",
                                        **{"server ops/acq": f"{row['server_ops_per_acq'] or 0:.1f}"},
                                        rtt=f"{rtt:.1f}us")
            summary = []
            for cs, nprocs in [(cs, n) for cs in args.cs for n in args.procs]:
                rows = {k: [c for c in contended if c["procs"] == nprocs and c["kind"] == k and c["cs"] == cs]
                        for k in ckinds}
                ratio = {k: statistics.median(a["per_s"] / b["per_s"]
                                              for a, b in zip(rows[k], rows["spin"]))
                         for k in ("park", "poll")}
                summary.append({
                    "cs": cs, "procs": nprocs,
                    **{f"{k}_per_s": statistics.median(r["per_s"] for r in rows[k]) for k in ckinds},
                    **{f"{k}_vs_spin": ratio[k] for k in ("park", "poll")},
                    # the shm kinds against the TCP lock of the same rep
                    **{f"{k}_vs_park": statistics.median(a["per_s"] / b["per_s"]
                                                         for a, b in zip(rows[k], rows["park"]))
                       for k in args.shm},
                    **{f"{k}_fairness": statistics.median((r["fairness"] or float("inf")) for r in rows[k])
                       for k in ckinds},
                    **{f"{k}_server_ops_per_acq": statistics.median(r["server_ops_per_acq"] or 0
                                                                    for r in rows[k]) for k in ckinds},
                    "rtt_us": statistics.median(r["rtt_us"] for k in ckinds for r in rows[k]),
                })
            result["contended"] = {"runs": contended, "summary": summary}
        finally:
            await pool.close()
            await client.close()
            await shm_client.close()
    finally:
        if peer is not None:
            await stop_raw_peer(peer, raw)
        await cluster.close()
    result["finished"] = now()
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    return result


def table(result: dict[str, Any]) -> str:
    u = result["uncontended"]["summary"]
    contended = result["contended"]["summary"]
    pin = result["machine"].get("pinning")
    spin, hspin = result["args"].get("lock_spin"), result["args"].get("holder_spin")
    park = u["park"]["ratio_p50_vs_raw"]
    parts = [f"pinned: {pin or 'no'}; server --lock-spin: {'default' if spin is None else spin}; "
             f"Lock(spin=...): {'default' if hspin is None else hspin}",
             "uncontended acquire+release (medians of per-round ratios)",
             report.table(["", "p50 us", "p99 us", "x raw", "x read64"],
                          [[k, v["p50_us"], v["p99_us"], v["ratio_p50_vs_raw"], v["ratio_p50_vs_read64"]]
                           for k, v in u.items()], formats=[None, "{:.1f}", "{:.1f}", "{:.2f}", "{:.2f}"]),
             f"target: park p50 <= {TARGET_UNCONTENDED}x raw: {park:.2f}x {report.verdict(park <= TARGET_UNCONTENDED)}",
             "", "contended (acquisitions/s; fairness = max/min per client; critical section: empty, or "
             "rmw = read 8 bytes + write them back)",
             report.table(["cs", "procs", "spin/s", "park/s", "poll/s", "park/spin", "poll/spin", "fair park",
                           "fair spin", "ops/acq park", "ops/acq spin", "rtt us"],
                          [[s["cs"], s["procs"], s["spin_per_s"], s["park_per_s"], s["poll_per_s"], s["park_vs_spin"],
                            s["poll_vs_spin"], s["park_fairness"], s["spin_fairness"], s["park_server_ops_per_acq"],
                            s["spin_server_ops_per_acq"], s["rtt_us"]] for s in contended],
                          formats=[None, None, "{:.0f}", "{:.0f}", "{:.0f}", "{:.2f}", "{:.2f}", "{:.3f}", "{:.3f}",
                                   "{:.1f}", "{:.1f}", "{:.1f}"])]
    shm = [k for k in SHM_KINDS if f"{k}_per_s" in (contended or [{}])[0]]
    if shm:
        parts += ["", "shm clients (same run; x park = against the TCP lock of the same rep)",
                  report.table(["cs", "procs", "park/s"] + [h for k in shm for h in (f"{k}/s", "x park", "fair",
                                                                                     "ops/acq")] + ["rtt us"],
                               [[s["cs"], s["procs"], s["park_per_s"]]
                                + [s[k + f] for k in shm for f in ("_per_s", "_vs_park", "_fairness",
                                                                   "_server_ops_per_acq")] + [s["rtt_us"]]
                                for s in contended],
                               formats=[None, None, "{:.0f}"] + ["{:.0f}", "{:.2f}", "{:.3f}", "{:.2f}"] * len(shm)
                               + ["{:.1f}"])]
    for s in contended:
        if s["procs"] != 4:
            continue
        if "futex_anycpu_per_s" in s:
            # judged with the CPUs the TCP lock uses (its clients' and its
            # server's); the pinned "futex" row gives the shm clients one
            k = "futex_anycpu"
            ok_t, ok_f = s[f"{k}_vs_park"] >= TARGET_SHM, s[f"{k}_fairness"] <= TARGET_FAIRNESS
            parts.append(f"target (4 procs, cs {s['cs']}): shm futex on the TCP lock's CPUs >= {TARGET_SHM}x "
                         f"the TCP lock: {s[f'{k}_vs_park']:.2f}x {report.verdict(ok_t)}; max/min <= "
                         f"{TARGET_FAIRNESS}: {s[f'{k}_fairness']:.3f} {report.verdict(ok_f)}")
        if "futex_per_s" in s:
            parts.append(f"  (shm futex with every client on one CPU: {s['futex_vs_park']:.2f}x the TCP lock, "
                         f"max/min {s['futex_fairness']:.3f})")
        ok_t = s["park_vs_spin"] >= TARGET_THROUGHPUT
        ok_f = s["park_fairness"] <= TARGET_FAIRNESS
        parts.append(f"target (4 procs, cs {s['cs']}): park >= {TARGET_THROUGHPUT}x spin: "
                     f"{s['park_vs_spin']:.2f}x {report.verdict(ok_t)}; max/min <= {TARGET_FAIRNESS}: "
                     f"{s['park_fairness']:.3f} {report.verdict(ok_f)}")
    return "\n".join(parts)


def round_trip(result: dict[str, Any]) -> float | None:
    """The run's 64-byte round trip: the uncontended rounds' 64-byte read."""
    return float(result["uncontended"]["summary"]["read64"]["p50_us"])


def plot(path: Path, result: dict[str, Any]) -> str | None:
    """Acquisitions/s against contending processes, one panel per critical
    section.  Returns None once drawn, else why not."""
    def draw(plt: Any) -> Any:
        summary = result["contended"]["summary"]
        kinds = [("park", "ticket lock, parked (TCP default)", "tab:blue", "o"),
                 ("poll", "ticket lock, polling (RDMA's algorithm, here over TCP)", "tab:green", "^"),
                 ("spin", "compare-and-swap spin lock (baseline)", "tab:red", "s")]
        css = list(dict.fromkeys(s["cs"] for s in summary))
        fig, axes = plt.subplots(1, len(css), figsize=(6 * len(css), 4.5), squeeze=False)
        for ax, cs in zip(axes[0], css):
            rows = [s for s in summary if s["cs"] == cs]
            procs = [s["procs"] for s in rows]
            for kind, label, color, marker in kinds:
                ax.plot(procs, [s[f"{kind}_per_s"] for s in rows], marker=marker, color=color, label=label)
            for s in rows:
                ax.annotate(f"{s['park_vs_spin']:.2f}x", (s["procs"], s["park_per_s"]), textcoords="offset points",
                            xytext=(0, 6), ha="center", fontsize=8, color="tab:blue")
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.12 * max(s[f"{k}_per_s"] for s in rows for k, *_ in kinds))
            report.style(ax, title="empty critical section" if cs == "empty" else "read-modify-write critical section",
                         xlabel="contending client processes", ylabel="acquisitions per second (median)",
                         xticks=procs)
        pin = result["machine"].get("pinning")
        fig.suptitle(f"smb2 lock over TCP loopback, {result['machine'].get('nproc', '?')} CPUs"
                     f"{', pinned' if pin else ''}; labels: parked / spin lock", fontsize=10)
        fig.tight_layout()
        return fig

    return report.plot(path, draw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15, help="uncontended rounds (default 15)")
    p.add_argument("-n", type=int, default=300, help="operations per kind per round (default 300)")
    p.add_argument("--procs", default="1,2,4,8", help="client processes for the contended runs")
    p.add_argument("--cs", default="empty,rmw", help="critical sections: empty, rmw (default both)")
    p.add_argument("--reps", type=int, default=5, help="contended runs per kind and process count (default 5)")
    p.add_argument("--duration", type=float, default=1.5, help="seconds per contended run")
    p.add_argument("--json", default=str(Path("bench-results") / "lock.json"))
    p.add_argument("--png", default=str(Path("bench-results") / "lock.png"), help="where to draw the plot")
    p.add_argument("--replot", metavar="JSON", help="only draw --png from an earlier run's JSON")
    p.add_argument("--lock-spin", type=float, default=None,
                   help="the server's --lock-spin (default: its default; 0 shows the hand-offs without it)")
    p.add_argument("--holder-spin", type=float, default=None,
                   help="the workers' Lock(spin=...) (default: the library's; 0 shows hand-offs without it)")
    p.add_argument("--shm", default=",".join(SHM_KINDS),
                   help=f"shm kinds in the contended runs (default {','.join(SHM_KINDS)}; '' for none)")
    p.add_argument("--futex-spin", type=float, default=None,
                   help="the shm Lock(futex_spin=...) (default: the library's)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin the server and raw peer to one CPU and the clients to another")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = parse_with_quick(p, argv, QUICK, "every kind of lock and baseline, both critical sections (the targets "
                                             "judged at 4 processes need --procs 4)")
    if args.worker:
        uvloop.run(_worker(args.worker.split(","), args.holder_spin, args.futex_spin))
        return 0
    if args.replot:
        why_not = plot(Path(args.png), json.loads(Path(args.replot).read_text()))
        print(f"plot: {why_not}" if why_not else f"plot: {args.png}")
        return 0 if why_not is None else 1
    args.procs = [int(x) for x in args.procs.split(",")]
    args.cs = [x for x in args.cs.split(",") if x]
    args.shm = [x for x in args.shm.split(",") if x]
    if not set(args.shm) <= set(SHM_KINDS):
        p.error(f"--shm takes {', '.join(SHM_KINDS)}, not {args.shm}")
    result = uvloop.run(bench(args))
    text = table(result)
    print(text)
    path = report.write_json(args.json, {**result, "quick": args.quick, "table": text},
                             round_trip_64B_us=round_trip(result), quiet=True)
    _progress(f"wrote {path}")
    why_not = plot(Path(args.png), result)
    _progress(f"plot: {why_not}" if why_not else f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
