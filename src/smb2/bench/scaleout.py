#!/usr/bin/env python3
"""Scale-out: aggregate bandwidth of one buffer striped over 1, 2, 4, 8 memory servers.

Every memory server is its own host (a network namespace with a ``tc tbf`` limited link, by
default 1 Gbit/s in both directions, see ``tools/netns_cluster.py``), so each server's link --
not the shared CPU -- is what a single server can deliver, as on a real cluster.  The client
runs in the client namespace (a child process of this script started with
``NetnsCluster.popen_client``); it never runs in the root namespace.

What one run does:

* builds ONE cluster with ``max(--servers)`` server hosts and starts one worker process in the
  client namespace;
* the worker opens one smb2 client per server count N (the first N servers) and creates a
  ``--size`` buffer (default 256 MiB, stripe ``--stripe``) on each, warms each up, then takes
  ``--rounds`` rounds; a round measures a full write and a full read of every buffer, with the
  order of N and of write/read alternating from round to round, so every N is sampled at the
  same times of the (noisy, shared) machine's life;
* one measurement = ``--tasks`` concurrent asyncio tasks (a training job's workers), each
  moving its contiguous share of the buffer (in ``--chunk`` pieces, default its whole share in
  one call) with ``buf.write`` / ``buf.read_into``;
* the baseline, measured next to every smb2 measurement (order alternating): the same bytes
  over plain blocking sockets, one thread per server host, to netns_cluster's stand-in
  sink/source started beside smb2-server on every host (same link, same tbf) -- what the links
  and this machine deliver without smb2 (``--no-baseline`` to skip); "vs raw" is the median of
  the per-round ratios smb2 / raw;
* beside every measurement: the smb2 round trip through the namespaces (median of 21 8-byte
  ``fetch_add``s, just before), the client's and the servers' CPU seconds per GB moved and
  event-loop wakeups per MiB, the whole machine's busy fraction and the part of it that is not
  ours ("others": other programs and uncharged kernel work -- a sample taken with "others" high
  was taken on a loaded machine);
* then the training benchmark (``tools/bench_training.py --against``: an MLP of 12.6 M
  parameters, ``--training-workers`` worker processes, ``--training-rule``) runs once per
  server count from the client namespace, for its samples/s against one server's
  (``--training-steps 0`` to skip it);
* figures are medians over rounds; the speedup of N servers is the median over rounds of
  ``BW_r(N) / BW_r(1)`` (a ratio taken within one round), efficiency = speedup / N.

It prints a table, writes every sample to JSON (``--json``, default
``bench-results/scaleout.json``) and draws ``--png`` (default ``bench-results/scaleout.png``;
needs matplotlib -- without it, it says so and still writes the table and the JSON).

Needs root and ``ip netns`` (see netns_cluster.py); otherwise it says why and exits 2.

    sudo .venv/bin/python tools/bench_scaleout.py                  # 1,2,4,8 servers, 1 Gbit/s
    .venv/bin/python tools/bench_scaleout.py --rate 500mbit --tasks 4 --stripe 4MiB --rounds 3
    .venv/bin/python tools/bench_scaleout.py --servers 1,8 --loop asyncio --profile /tmp/client.txt \
        --profile-server /tmp/server.txt [--native]   # where the client's / server 0's time goes
    sudo .venv/bin/python -m smb2.bench scaleout --quick   # seconds: 1 and 2 servers, 8 MiB, 1 round

GB/s here are 10**9 bytes per second; a 1 Gbit/s link carries at most about 0.119 GB/s of TCP
payload (1448 of every 1514 bytes on the wire at MTU 1500).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import smb2.testing.netns as netns_cluster
from smb2.testing.launch import ready_address
from smb2.testing.netns.probe import ProbeConn
from smb2.train.example.mlp import MLP

from . import report
from .common import fmt_size, parse_with_quick, proc_cpu
from .training import SIZES as TRAINING_SIZES

MiB = 1 << 20
GB = 1e9
SMB2_PUBLISHED = (8, 6.3)  # SMB2 (IEEE Access 2020): 6.3x SMB1's bandwidth with 8 memory servers
TARGET_EFFICIENCY = 0.90  # the scale-out target: >= 7.2x one server's bandwidth at 8 servers
OPS = ("write", "read")
RAW_OPS = ("raw-write", "raw-read")  # the baseline: plain sockets to a stand-in on each server host
#: --quick: two server counts (so a speedup), both ops and their baseline, a training step each
QUICK = ["--servers", "1,2", "--size", "8MiB", "--tasks", "2", "--rounds", "1", "--training-steps", "1",
         "--training-workers", "1"]


def parse_size(text: str) -> int:
    s = text.strip().lower().replace("ib", "").replace("b", "")
    for suffix, mult in (("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30)):
        if s.endswith(suffix):
            return int(float(s[:-1]) * mult)
    return int(s)


def progress(msg: str) -> None:
    print(f"bench_scaleout: {msg}", file=sys.stderr, flush=True)


# =============================================================================================
# The worker: runs inside the client namespace, prints one JSON document on stdout


def _wakeups(pid: int | str) -> int:
    """Voluntary context switches of all threads of ``pid`` so far: about one per time a thread
    slept (in epoll, recv, send) and was woken (0 if it is gone)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
                        break
        except OSError:  # the thread ended meanwhile
            pass
    return total


def _machine_cpu() -> tuple[float, float]:
    """(total, idle) jiffies of the whole machine."""
    with open("/proc/stat") as f:
        v = [float(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]


def _spy(pyspy: str, pid: int, path: str, native: bool) -> subprocess.Popen:
    """py-spy record of ``pid`` into ``path`` (raw collapsed stacks) until :func:`_stop_spy`.
    py-spy reads the target's memory by pid; it sends nothing over any network."""
    # --native cannot sample without pausing the target; then fewer samples per second
    mode = ["--native", "-r", "100"] if native else ["--nonblocking", "-r", "250"]
    return subprocess.Popen([pyspy, "record", *mode, "-f", "raw", "-o", path, "-p", str(pid)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop_spy(spy: subprocess.Popen) -> None:
    spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    try:
        spy.wait(30)
    except subprocess.TimeoutExpired:
        spy.kill()
        spy.wait()


async def _worker(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    import smb2

    endpoints = [e for e in os.environ.get("SMB2_SERVERS", "").split(",") if e]
    counts = [int(x) for x in args.servers.split(",")]
    if max(counts) > len(endpoints):
        raise SystemExit(f"asked for {max(counts)} servers, SMB2_SERVERS has {len(endpoints)}")
    smb2_pids = [int(p) for p in args.server_pids.split(",") if p]
    raw_pids = [int(p) for p in args.raw_pids.split(",") if p]
    ncpu = os.cpu_count() or 1
    size, stripe, tasks = args.size, args.stripe, args.tasks
    chunk = args.chunk or (size // tasks)
    share = size // tasks
    if size % tasks or share % chunk:
        raise SystemExit(f"--size {size} must split into --tasks {tasks} shares of whole --chunk {chunk}")

    rng = np.random.default_rng(2026)
    src = rng.integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    dst[:] = 1  # touch every page now, not inside a timed read

    clients: dict[int, Any] = {}
    bufs: dict[int, Any] = {}
    counter_off = size - 8  # the fetch_add word used for round trips (overwritten by writes: fine)
    raw_endpoints = [e for e in args.raw.split(",") if e]
    raw_conns: list[Any] = []
    try:
        # the baseline: one plain blocking socket per server host (a thread each, sendall /
        # recv_into of 1 MiB pieces) to netns_cluster's stand-in server on the same host and link
        raw_conns = [ProbeConn(e) for e in raw_endpoints]

        def raw_move(op: str, n: int) -> None:
            part = size // n
            errors: list[BaseException] = []

            def one(c: Any) -> None:
                try:
                    c.write(part) if op == "raw-write" else c.read(part)
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    errors.append(e)

            threads = [threading.Thread(target=one, args=(c,)) for c in raw_conns[:n]]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]

        for n in counts:
            clients[n] = await smb2.connect(endpoints[:n])
            name = f"scaleout-{os.getpid()}-{n}"
            bufs[n] = await clients[n].create(name, size, stripe=stripe)

        async def move(op: str, n: int) -> None:
            if op in RAW_OPS:
                raw_move(op, n)  # blocks the loop: nothing else runs meanwhile
                return
            buf = bufs[n]

            async def task(i: int) -> None:
                for off in range(i * share, (i + 1) * share, chunk):
                    if op == "write":
                        await buf.write(off, src[off:off + chunk])
                    else:
                        await buf.read_into(dst[off:off + chunk], off)

            await asyncio.gather(*(task(i) for i in range(tasks)))

        async def rtt_us(n: int) -> float:
            buf = bufs[n]
            lat = []
            for _ in range(21):
                t = time.perf_counter()
                await buf.fetch_add(counter_off, 0)
                lat.append(time.perf_counter() - t)
            return statistics.median(lat) * 1e6

        # warm up every buffer (server pages, TCP windows, the planner), check one round trip
        report.progress("scaleout", 0, len(counts), "warm-ups: every op once, read back and checked")
        for i, n in enumerate(counts):
            for op in OPS + (RAW_OPS if raw_conns else ()):
                await move(op, n)
            if not np.array_equal(src[:-8], dst[:-8]):
                raise SystemExit(f"warm-up: data read back from {n} server(s) differs from what was written")
            await rtt_us(n)
            report.progress("scaleout", i + 1, len(counts), f"warm-up of {n} server(s)")

        spy = _spy(args.pyspy, os.getpid(), args.profile, args.native) if args.profile else None
        if spy is not None:
            await asyncio.sleep(1.0)  # let py-spy attach
        samples: list[dict[str, Any]] = []
        measured = tuple(op for op in OPS if op in args.ops.split(","))
        if raw_conns:  # each smb2 op next to its baseline, in alternating order
            measured = tuple(x for op in measured for x in (op, "raw-" + op))
        cells = args.rounds * len(counts) * len(measured)
        report.progress("scaleout", 0, cells, f"rounds of {', '.join(measured)} over {counts} server(s)")
        for r in range(args.rounds):
            order = counts if r % 2 == 0 else counts[::-1]
            ops = measured if r % 2 == 0 else measured[::-1]
            for n in order:
                for op in ops:
                    # the servers that serve this op: smb2-server, or the stand-ins for the baseline
                    server_pids = raw_pids if op in RAW_OPS else smb2_pids
                    rtt = await rtt_us(n)
                    m0 = _machine_cpu()
                    s0 = [proc_cpu(p) for p in server_pids[:n]]
                    w0 = [_wakeups("self"), sum(_wakeups(p) for p in server_pids[:n])]
                    c0 = time.process_time()
                    t0 = time.perf_counter()
                    await move(op, n)
                    dt = time.perf_counter() - t0
                    c1 = time.process_time()
                    s1 = [proc_cpu(p) for p in server_pids[:n]]
                    w1 = [_wakeups("self"), sum(_wakeups(p) for p in server_pids[:n])]
                    m1 = _machine_cpu()
                    total, idle = m1[0] - m0[0], m1[1] - m0[1]
                    ours = (c1 - c0) + sum(b - a for a, b in zip(s0, s1))  # cpu-s of the client and servers
                    busy = 1 - idle / total if total > 0 else None
                    samples.append({
                        "round": r, "servers": n, "op": op, "seconds": dt, "bytes": size,
                        "GBps": size / dt / GB, "rtt_us": round(rtt, 1),
                        "client_cpu_s_per_GB": round((c1 - c0) / (size / GB), 3),
                        "server_cpu_s_per_GB": (round(sum(b - a for a, b in zip(s0, s1)) / (size / GB), 3)
                                                if server_pids else None),
                        "client_wakeups_per_MiB": round((w1[0] - w0[0]) / (size / MiB), 2),
                        "server_wakeups_per_MiB": (round((w1[1] - w0[1]) / (size / MiB), 2)
                                                   if server_pids else None),
                        "machine_busy": round(busy, 3) if busy is not None else None,
                        # the rest of the machine's busy time: other programs, and kernel work (the
                        # bridge, tbf, softirqs) not charged to our processes -- high = a noisy sample
                        "others_busy": (round(max(0.0, busy - ours / (dt * ncpu)), 3)
                                        if busy is not None and server_pids else None),
                    })
                    s = samples[-1]
                    report.progress("scaleout", len(samples), cells, f"round {r} {n} server(s) {op}",
                                    speed=f"{s['GBps']:.3f} GB/s", rtt=f"{s['rtt_us']:.0f} us",
                                    client=f"{s['client_cpu_s_per_GB']:.2f} cpu-s/GB",
                                    **{"wakeups/MiB": f"client {s['client_wakeups_per_MiB']:.1f} "
                                                      f"servers {s['server_wakeups_per_MiB'] or 0:.1f}"},
                                    machine=f"{s['machine_busy']:.0%} busy, others {s['others_busy'] or 0:.0%}")
        if spy is not None:
            _stop_spy(spy)
        # the last full read must still be exactly what was written
        for n in counts:
            await move("write", n)
            dst[:] = 0
            await move("read", n)
            if not np.array_equal(src, dst):
                raise SystemExit(f"data read back from {n} server(s) differs from what was written")
        return {"samples": samples, "transports": {n: clients[n].transports for n in counts},
                "loop": type(asyncio.get_running_loop()).__module__.split(".")[0]}
    finally:
        for rc in raw_conns:
            rc.sock.close()
        for n, c in clients.items():
            if n in bufs:
                try:
                    await c.destroy(bufs[n].name)
                except Exception:  # noqa: BLE001 - best effort; the servers die with the cluster anyway
                    pass
            await c.close()


def worker_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench_scaleout.py _worker")
    ap.add_argument("--servers", required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--stripe", type=int, required=True)
    ap.add_argument("--tasks", type=int, required=True)
    ap.add_argument("--chunk", type=int, default=0)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--server-pids", default="")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--raw", default="", help="stand-in endpoints for the raw baseline")
    ap.add_argument("--raw-pids", default="", help="their pids (for their CPU time)")
    ap.add_argument("--out", help="write the JSON here instead of stdout")
    ap.add_argument("--profile", help="py-spy this process during the measured rounds, raw output here")
    ap.add_argument("--pyspy", default="py-spy")
    ap.add_argument("--native", action="store_true")
    args = ap.parse_args(argv)
    if args.loop == "uvloop":
        import uvloop
        result = uvloop.run(_worker(args))
    else:
        result = asyncio.run(_worker(args))
    if args.out:
        Path(args.out).write_text(json.dumps(result))
    else:
        json.dump(result, sys.stdout)
        print()
    return 0


# =============================================================================================
# The driver: builds the cluster, runs the worker in the client namespace, summarizes


def training_samples_per_s(cluster: netns_cluster.NetnsCluster, nservers: int, *, steps: int, workers: int,
                           rule: str) -> float | None:
    """The training benchmark (tools/bench_training.py, one configuration) against the first
    ``nservers`` servers: samples/s, or None (with the reason on stderr) if it failed.  It runs in
    the client namespace, and its worker processes are its children there, so every byte it moves
    crosses the rate-limited links."""
    servers = ",".join(cluster.servers[:nservers])
    cmd = [sys.executable, "-m", "smb2.bench.training", "--against", servers,
           "--rules", rule, "--workers", str(workers), "--steps", str(steps)]
    r = cluster.run_client(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        print(f"bench_scaleout: the training run on {nservers} server(s) failed (exit {r.returncode}):\n"
              f"{r.stderr[-2000:]}", file=sys.stderr)
        return None
    return float(json.loads(r.stdout.strip().splitlines()[-1])["samples_per_s"])


def summarize(samples: list[dict[str, Any]], counts: list[int]) -> dict[str, Any]:
    by: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for s in samples:
        by.setdefault((s["servers"], s["op"]), []).append(s)
    base = counts[0]
    rows: dict[str, Any] = {}
    for op in OPS + RAW_OPS:
        for n in counts:
            ss = by.get((n, op), [])
            if not ss:
                continue
            # per-round ratio against the same round's smallest-N figure
            base_by_round = {s["round"]: s["GBps"] for s in by.get((base, op), [])}
            ratios = [s["GBps"] / base_by_round[s["round"]] * base for s in ss if s["round"] in base_by_round]
            speedup = statistics.median(ratios) if ratios else None

            def med(key: str, ss: list[dict[str, Any]] = ss) -> float | None:
                vals = [s[key] for s in ss if s.get(key) is not None]
                return statistics.median(vals) if vals else None

            raw_by_round = {s["round"]: s["GBps"] for s in by.get((n, "raw-" + op), [])}
            vs_raw = [s["GBps"] / raw_by_round[s["round"]] for s in ss if s["round"] in raw_by_round]
            rows[f"{op}/{n}"] = {
                "op": op, "servers": n, "rounds": len(ss),
                "GBps_median": med("GBps"), "GBps_min": min(s["GBps"] for s in ss),
                "GBps_max": max(s["GBps"] for s in ss),
                "speedup": speedup, "efficiency": speedup / n if speedup is not None else None,
                # smb2 against plain sockets over the same links in the same round (median of ratios)
                "vs_raw": statistics.median(vs_raw) if vs_raw else None,
                "rtt_us_median": med("rtt_us"),
                "client_cpu_s_per_GB": med("client_cpu_s_per_GB"),
                "server_cpu_s_per_GB": med("server_cpu_s_per_GB"),
                "client_wakeups_per_MiB": med("client_wakeups_per_MiB"),
                "server_wakeups_per_MiB": med("server_wakeups_per_MiB"),
                "machine_busy": med("machine_busy"),
                "others_busy": med("others_busy"),
            }
    return rows


def format_table(rows: dict[str, Any], counts: list[int], rate_bits: int | None,
                 training: dict[int, float | None]) -> str:
    link_payload = link_payload_GBps(rate_bits)
    picked = [(op, n, rows[f"{op}/{n}"]) for op in OPS + RAW_OPS for n in counts if f"{op}/{n}" in rows]
    lines = [report.table(
        ["op", "servers", "GB/s", "min", "max", "x 1 srv", "eff", "vs raw", "of links", "rtt us", "cli cpu-s/GB",
         "srv cpu-s/GB", "machine", "others"],
        [[op, n, r["GBps_median"], r["GBps_min"], r["GBps_max"], r["speedup"], r["efficiency"], r["vs_raw"],
          r["GBps_median"] / (n * link_payload) if link_payload else None, r["rtt_us_median"],
          r["client_cpu_s_per_GB"], r["server_cpu_s_per_GB"], r["machine_busy"], r["others_busy"] or 0]
         for op, n, r in picked],
        formats=[None, None, "{:.3f}", "{:.3f}", "{:.3f}", "{:.2f}x", "{:.1%}", "{:.0%}", "{:.0%}", "{:.0f}",
                 "{:.2f}", "{:.2f}", "{:.0%}", "{:.0%}"])]
    one = training.get(1)
    if training:
        lines += ["", "training benchmark (smb2 bench training, one run per server count):",
                  report.table(["servers", "samples/s", "x 1 srv"],
                               [[n, sps, sps / one if sps is not None and one else None]
                                for n, sps in training.items()],
                               formats=[None, "{:.1f}", "{:.2f}x"])]
    return "\n".join(lines)


def link_payload_GBps(rate_bits: int | None) -> float | None:
    """The most TCP payload a link of ``rate_bits`` carries (1448 of 1514 bytes per frame)."""
    return rate_bits / 8 * 1448 / 1514 / GB if rate_bits else None


def plot(path: Path, rows: dict[str, Any], counts: list[int], title: str, link_GBps: float | None,
         training: dict[int, float | None] | None = None) -> str | None:
    """Draw the PNG; returns None on success, else why not."""
    def draw(plt: Any) -> Any:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 5))
        nmax = max(counts)
        for op, color in (("raw-write", "tab:blue"), ("raw-read", "tab:orange")):
            ns = [n for n in counts if f"{op}/{n}" in rows]
            if ns:
                ax.plot(ns, [rows[f"{op}/{n}"]["GBps_median"] for n in ns], ls="--", color=color, alpha=0.5, lw=1,
                        label=f"raw sockets, {op[4:]} (baseline)")
        for op, marker in (("write", "o"), ("read", "s")):
            ns = [n for n in counts if f"{op}/{n}" in rows]
            if not ns:
                continue
            bw = [rows[f"{op}/{n}"]["GBps_median"] for n in ns]
            lo = [b - rows[f"{op}/{n}"]["GBps_min"] for b, n in zip(bw, ns)]
            hi = [rows[f"{op}/{n}"]["GBps_max"] - b for b, n in zip(bw, ns)]
            ax.errorbar(ns, bw, yerr=[lo, hi], marker=marker, capsize=3, label=f"smb2 {op} (median, min..max)",
                        color="tab:blue" if op == "write" else "tab:orange")
            ax2.plot(ns, [rows[f"{op}/{n}"]["speedup"] for n in ns], marker=marker, label=f"smb2 {op}",
                     color="tab:blue" if op == "write" else "tab:orange")
            one = rows.get(f"{op}/1")
            if one is not None and op == "read":
                ax.plot([1, nmax], [one["GBps_median"], nmax * one["GBps_median"]], "k--", lw=1,
                        label="ideal (N x one server's read)")
                ax.plot([SMB2_PUBLISHED[0]], [SMB2_PUBLISHED[1] * one["GBps_median"]], "r*", ms=14,
                        label=f"SMB2 paper: {SMB2_PUBLISHED[1]}x one server at {SMB2_PUBLISHED[0]}")
        if link_GBps:
            ax.plot([1, nmax], [link_GBps, nmax * link_GBps], ":", color="gray", lw=1,
                    label="N links' TCP payload capacity")
        report.style(ax, title="bandwidth", xlabel="memory servers (one 1-link host each)",
                     ylabel="aggregate bandwidth, GB/s", xticks=counts)
        trained = {n: v for n, v in (training or {}).items() if v is not None}
        if 1 in trained and len(trained) > 1:
            ns = sorted(trained)
            ax2.plot(ns, [trained[n] / trained[1] for n in ns], marker="D", color="tab:green",
                     label="training samples/s (bench_training.py)")
        ax2.plot([1, nmax], [1, nmax], "k--", lw=1, label="ideal (N x)")
        ax2.plot([1, nmax], [TARGET_EFFICIENCY, TARGET_EFFICIENCY * nmax], ":", color="gray", lw=1,
                 label=f"target ({TARGET_EFFICIENCY:.0%} efficiency)")
        ax2.plot([SMB2_PUBLISHED[0]], [SMB2_PUBLISHED[1]], "r*", ms=14, label="SMB2 paper: 6.3x at 8 servers")
        report.style(ax2, title="scale-out", xlabel="memory servers", ylabel="speedup over one server", xticks=counts)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        return fig

    return report.plot(path, draw)


def top_frames(path: Path, limit: int = 25) -> str:
    """The frames that the samples of a py-spy raw (collapsed stacks) file spent most *own* time
    in, and the worker's share of samples in each op's code path."""
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
    lines = [f"py-spy: {total} samples in {path}; frames by own time:"]
    for leaf, n in sorted(own.items(), key=lambda kv: -kv[1])[:limit]:
        lines.append(f"  {n / max(total, 1):6.1%}  {leaf}")
    lines.append("frames by inclusive time:")
    for f, n in sorted(incl.items(), key=lambda kv: -kv[1])[:limit]:
        lines.append(f"  {n / max(total, 1):6.1%}  {f}")
    return "\n".join(lines)


def start_stand_ins(cluster: netns_cluster.NetnsCluster) -> tuple[list[str], list[int]]:
    """Start netns_cluster's stand-in server (plain sockets: sink for writes, source for reads)
    beside smb2-server on every server host, one port up; return their endpoints.  They live in
    the cluster's server namespaces, so the cluster's teardown removes them with everything else.
    Returns their endpoints and pids."""
    port = cluster.port + 1
    procs = []
    for netns, addr in zip(cluster.server_netns, cluster.server_addrs):
        argv = cluster.exec_prefix(netns) + [sys.executable, "-m", "smb2.testing.netns.standin",
                                             "--host", addr, "--port", str(port)]
        procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                                      preexec_fn=netns_cluster.die_with_parent))
    for p in procs:
        line = p.stdout.readline() if p.stdout is not None else ""
        if ready_address(line) is None:
            raise netns_cluster.NetnsError(f"a stand-in server did not start (exit {p.poll()}): {line!r}")
        assert p.stdout is not None
        p.stdout.close()
    return [f"{addr}:{port}" for addr in cluster.server_addrs], [p.pid for p in procs]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="1,2,4,8", help="server counts to measure (default 1,2,4,8)")
    p.add_argument("--rate", default="1gbit", help="per-server link rate, tc syntax (default 1gbit)")
    p.add_argument("--size", default="256MiB", help="buffer size (default 256MiB)")
    p.add_argument("--stripe", default="1MiB", help="stripe size (default 1MiB)")
    p.add_argument("--tasks", type=int, default=8, help="concurrent client tasks, each moving its share (default 8)")
    p.add_argument("--chunk", default="0", help="each task moves its share in pieces of this size (default: one call)")
    p.add_argument("--rounds", type=int, default=5, help="rounds to take medians over (default 5)")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                   help="client event loop (default uvloop)")
    p.add_argument("--ops", default=",".join(OPS), help="what to measure (default write,read)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the raw-socket baseline (a stand-in sink/source on every server host)")
    p.add_argument("--profile", metavar="PATH",
                   help="run the worker under py-spy (inside the client namespace): collapsed stacks to PATH "
                        "(py-spy's raw format) and the top frames by own time on stderr")
    p.add_argument("--native", action="store_true", help="py-spy --native: C frames too (uvloop, numpy, _core)")
    p.add_argument("--profile-server", metavar="PATH",
                   help="py-spy server 0 (smb2-server, attached by pid) while the worker runs: collapsed stacks "
                        "to PATH and its top frames on stderr")
    p.add_argument("--training-steps", type=int, default=6,
                   help="steps per worker of the training benchmark on each server count (0 = skip it; default 6)")
    p.add_argument("--training-workers", type=int, default=4, help="its worker processes (default 4)")
    p.add_argument("--training-rule", default="accumulate", help="its update rule (default accumulate)")
    p.add_argument("--json", default=str(Path("bench-results") / "scaleout.json"), help="where to write JSON")
    p.add_argument("--png", default=str(Path("bench-results") / "scaleout.png"), help="where to draw the plot")
    p.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_worker":
        return worker_main(argv[1:])
    args = parse_with_quick(_parser(), argv, QUICK, "the raw baseline, every table and the training rows")
    counts = sorted({int(x) for x in args.servers.split(",")})
    size, stripe, chunk = parse_size(args.size), parse_size(args.stripe), parse_size(args.chunk)
    rate_bits = netns_cluster.parse_rate(args.rate)
    ok, why = netns_cluster.can_run()
    if not ok:
        print(f"bench_scaleout: cannot build network namespaces here: {why}", file=sys.stderr)
        return 2
    nmax = max(counts)
    # server 0 holds a share of every buffer at once: size/1 + size/2 + ... (+ slack); pages are
    # only committed when touched
    capacity = sum(-(-size // n) for n in counts) + len(counts) * 16 * MiB
    if args.training_steps > 0:
        # the training benchmark's model, on one server (the buffers above are gone by then)
        capacity = max(capacity, MLP(TRAINING_SIZES).nparams * 4 + 16 * MiB)
    started = _dt.datetime.now(_dt.UTC)
    with netns_cluster.NetnsCluster(servers=nmax, rate=args.rate, capacity=str(capacity),
                                    quiet=args.quiet) as cluster:
        out_path = Path(tempfile.mkdtemp(prefix="bench_scaleout-")) / "worker.json"
        pids = [str(cluster.server_process(i).pid) for i in range(nmax)]  # type: ignore[union-attr]
        cmd = [sys.executable, "-m", "smb2.bench.scaleout", "_worker", "--servers", ",".join(map(str, counts)),
               "--size", str(size), "--stripe", str(stripe), "--tasks", str(args.tasks), "--chunk", str(chunk),
               "--rounds", str(args.rounds), "--server-pids", ",".join(pids), "--loop", args.loop,
               "--ops", args.ops, "--out", str(out_path)]
        if not args.no_baseline:
            raw_endpoints, raw_pids = start_stand_ins(cluster)
            cmd += ["--raw", ",".join(raw_endpoints), "--raw-pids", ",".join(map(str, raw_pids))]
        pyspy = Path(sys.executable).with_name("py-spy")
        if args.profile or args.profile_server:
            if not pyspy.exists():
                print(f"bench_scaleout: --profile needs py-spy ({pyspy} is missing: "
                      f"{Path(sys.executable).with_name('pip')} install py-spy)", file=sys.stderr)
                return 2
        if args.profile:
            # the worker attaches py-spy to itself for the measured rounds only (not set-up, warm-up)
            cmd += ["--profile", args.profile, "--pyspy", str(pyspy)] + (["--native"] if args.native else [])
        spy = None
        if args.profile_server:
            # py-spy reads the server's memory by pid: it sends nothing over any network
            spy = _spy(str(pyspy), int(pids[0]), args.profile_server, args.native)
        if not args.quiet:
            progress(f"worker in the client namespace {cluster.client_netns}: {size >> 20} MiB, stripe "
                     f"{fmt_size(stripe, sep='')}, {args.tasks} tasks, {args.rounds} rounds over {counts} server(s)")
        quiet = subprocess.DEVNULL if args.quiet else None
        p = cluster.popen_client(cmd, stdout=quiet, stderr=quiet)
        try:
            rc = p.wait()
            if rc != 0 or not out_path.exists():
                print(f"bench_scaleout: the worker failed (exit {rc})", file=sys.stderr)
                return 1
            result = json.loads(out_path.read_text())
        finally:
            shutil.rmtree(out_path.parent, ignore_errors=True)
            if spy is not None:
                _stop_spy(spy)
        training: dict[int, float | None] = {}
        if args.training_steps > 0:
            if not args.quiet:
                report.progress("scaleout", 0, len(counts), f"training runs ({args.training_rule}, "
                                f"{args.training_workers} workers, {args.training_steps} steps)")
            for i, n in enumerate(counts):
                sps = training[n] = training_samples_per_s(cluster, n, steps=args.training_steps,
                                                           workers=args.training_workers, rule=args.training_rule)
                if not args.quiet:
                    report.progress("scaleout", i + 1, len(counts), f"training on {n} server(s)",
                                    speed=None if sps is None else f"{sps:.1f} samples/s")
    for path in (args.profile, args.profile_server):
        if path:
            print(top_frames(Path(path)) if Path(path).exists() else f"py-spy wrote no {path}", file=sys.stderr)
    rows = summarize(result["samples"], counts)
    title = (f"smb2 scale-out: {fmt_size(size, sep='')} buffer, stripe {fmt_size(stripe, sep='')}, "
             f"{args.tasks} client tasks, "
             f"tbf {args.rate} per server link, median of {args.rounds} rounds ({started:%Y-%m-%d %H:%M} UTC)")
    table = format_table(rows, counts, rate_bits, training)
    print(title)
    print(table)
    for op in OPS:
        r = rows.get(f"{op}/{nmax}")
        if r is not None and nmax > 1:
            verdict = "meets" if r["efficiency"] >= TARGET_EFFICIENCY else "MISSES"
            print(f"{op} at {nmax} servers: {r['speedup']:.2f}x one server, efficiency {r['efficiency']:.1%} "
                  f"({verdict} the {TARGET_EFFICIENCY:.0%} target; SMB2 published {SMB2_PUBLISHED[1]}x at "
                  f"{SMB2_PUBLISHED[0]})")
    doc = {
        "benchmark": "scaleout", "started": started.isoformat(), "title": title, "quick": args.quick,
        "params": {"servers": counts, "rate": args.rate, "rate_bits": rate_bits, "size": size, "stripe": stripe,
                   "tasks": args.tasks, "chunk": chunk or size // args.tasks, "rounds": args.rounds,
                   "loop": result.get("loop"), "transports": result.get("transports")},
        "summary": rows,
        "training_samples_per_s": {str(n): v for n, v in training.items()},
        "training": {"steps": args.training_steps, "workers": args.training_workers, "rule": args.training_rule,
                     "benchmark": "tools/bench_training.py --against (MLP of 12.6 M parameters)"},
        "smb2_published": {"servers": SMB2_PUBLISHED[0], "speedup": SMB2_PUBLISHED[1]},
        "samples": result["samples"],
    }
    jpath = report.write_json(args.json, doc, quiet=True, round_trip_64B_us=report.median_round_trip(
        [r["rtt_us_median"] for r in rows.values()]))
    print(f"JSON: {jpath}")
    if not args.no_plot:
        why_not = plot(Path(args.png), rows, counts, title, link_payload_GBps(rate_bits), training)
        print(f"plot: {why_not}" if why_not else f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
