#!/usr/bin/env python3
"""What replication costs across hosts: every server, the client and etcd its own host
(tools/netns_cluster.py) behind a tc-shaped link, measured in one run.

    python tools/bench_replicas_netns.py [--servers 3] [--server-rate 200mbit] [--client-rate 200mbit]
        [--repeat 3] [--kills 10] [--repair-size 1GiB] [--repair-rate 48MiB] [--json out.json]
    python tools/bench_replicas_netns.py --quick          # seconds: small sizes, 2 kills, no repair

Three phases, each on its own cluster (N servers, one client host, etcd on a host of its own):

* **Throughput** in two shapings, ``replicas=1`` and ``replicas=2`` in turns against the same
  servers, medians of ``--repeat``: a 64 MiB write, read and accumulate (float32), a 64 B read
  (the round trip) and a 64 B fetch_add; with the bytes every link carried per operation, from
  the bridge ports' counters (headers included).  "server-bound": the client link unlimited,
  every server link at ``--server-rate``; "client-bound": the client link at ``--client-rate``
  too.  A replicated write goes to each stripe's primary, which forwards it to the backup: with
  R copies every server link carries R times the writes inward, so where the servers' inward
  links are the bottleneck replicas=2 halves write throughput (every scheme that stores two
  copies must carry them in), and where the client's link is, it costs nothing.
* **Failover**: ``--kills`` SIGKILLs of a primary (servers in turn) while one accumulate loop and
  one fetch_add loop run on every stripe; the failover time is from the kill to the completion of
  the first operation on the killed server's stripe invoked after it.  Each killed server is
  restarted empty and rejoins (the time to be a member again is reported too).  At the end the
  project's Jepsen checker (tools/jepsen.py) checks the final words against the acknowledged
  operations: no acknowledged update lost, none applied twice, fetch_add results unique.
* **Repair**: a ``--repair-size`` replicas=2 buffer of random bytes on servers with
  ``--repair-rate`` (bytes per second per primary); a server is SIGKILLed, a write finds it dead
  (the client takes it out of the view), it is restarted empty and timed until the buffer is no
  longer degraded; then every stripe copy on it is read raw and compared with the data.

Needs root, ``ip netns`` and ``tc``; otherwise it says why and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import smb2.testing.netns as netns_cluster  # noqa: E402
from smb2.testing import jepsen  # noqa: E402
from smb2.testing.replicas import read_copy  # noqa: E402

from . import report  # noqa: E402

log = logging.getLogger("smb2.bench_replicas_netns")

MiB = 1 << 20
OPS = ("write", "read", "accumulate")


# ---------------------------------------------------------------------------------------------
# Running in the client namespace while the main thread owns the servers

class MainThread:
    """Runs calls in the main thread on behalf of the client's thread: a server dies with the
    thread that started it (PR_SET_PDEATHSIG), so kills and restarts happen here, in the thread
    that outlives every phase."""

    def __init__(self) -> None:
        self.calls: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...], threading.Event, dict[str, Any]]] = \
            queue.Queue()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        done, box = threading.Event(), {}  # type: ignore[var-annotated]
        self.calls.put((fn, args, done, box))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    async def acall(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(self.call, fn, *args)

    def run(self, cluster: netns_cluster.NetnsCluster, coro_fn: Callable[..., Any], *args: Any) -> Any:
        """``coro_fn(*args)`` on uvloop in the client namespace; serve calls until it returns."""
        import uvloop

        box: dict[str, Any] = {}

        def client() -> None:
            try:
                box["value"] = cluster.run_coroutine(coro_fn, *args, runner=uvloop.run)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                box["error"] = e

        t = threading.Thread(target=client, name="bench-client", daemon=True)
        t.start()
        while t.is_alive():
            try:
                fn, fargs, done, out = self.calls.get(timeout=0.05)
            except queue.Empty:
                continue
            try:
                out["value"] = fn(*fargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                out["error"] = e
            done.set()
        if "error" in box:
            raise box["error"]
        return box.get("value")


def link_bytes(cluster: netns_cluster.NetnsCluster) -> dict[str, tuple[int, int]]:
    """Bytes into and out of every host so far: its bridge port's tx and rx counters (frames with
    their Ethernet, IP and TCP headers)."""
    r = subprocess.run(["ip", "-n", cluster.bridge_netns, "-s", "-j", "link", "show"], capture_output=True,
                       text=True, check=True)
    out = {}
    for dev in json.loads(r.stdout):
        if dev["ifname"] in cluster.hosts:
            s = dev["stats64"]
            out[dev["ifname"]] = (s["tx"]["bytes"], s["rx"]["bytes"])   # the port's tx goes into the host
    return out


def tcp_losses(cluster: netns_cluster.NetnsCluster) -> tuple[int, int]:
    """Retransmitted TCP segments and retransmission timeouts so far, summed over the client and
    server hosts (each namespace has its own counters)."""
    retrans = timeouts = 0
    for h, (netns, _) in cluster.hosts.items():
        if h == "e":
            continue
        r = subprocess.run(["ip", "netns", "exec", netns, "cat", "/proc/net/snmp", "/proc/net/netstat"],
                           capture_output=True, text=True, check=True)
        lines = r.stdout.splitlines()
        for names, values in zip(lines[::2], lines[1::2]):
            row = dict(zip(names.split()[1:], values.split()[1:]))
            retrans += int(row.get("RetransSegs", 0))
            timeouts += int(row.get("TCPTimeouts", 0))
    return retrans, timeouts


def carried(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, dict[str, float]]:
    """MiB into and out of each host between two snapshots (etcd's host left out)."""
    return {h: {"in": round((after[h][0] - before[h][0]) / MiB, 2), "out": round((after[h][1] - before[h][1]) / MiB, 2)}
            for h in sorted(after) if h != "e"}


def _cluster(args: argparse.Namespace, *, rate: str | None, client_rate: str | None, capacity: str,
             extra_server_args: tuple[str, ...] = ()) -> netns_cluster.NetnsCluster:
    return netns_cluster.NetnsCluster(
        servers=args.servers, rate=rate, client_rate=client_rate, capacity=capacity, etcd=True, quiet=not args.verbose,
        latency_ms=args.queue_ms,
        server_cmd=[*netns_cluster.DEFAULT_SERVER_CMD, *extra_server_args], handle_signals=True, ready_timeout=60)


async def _small_latencies(buf: Any, n: int) -> tuple[float, float]:
    """Medians in µs of a 64 B read (the round trip) and a 64 B fetch_add."""
    small = np.zeros(64, np.uint8)
    for _ in range(20):
        await buf.read_into(small, 0)
    reads, adds = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        await buf.read_into(small, 0)
        reads.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await buf.fetch_add(0, 1)
        adds.append(time.perf_counter() - t0)
    return statistics.median(reads) * 1e6, statistics.median(adds) * 1e6


# ---------------------------------------------------------------------------------------------
# Phase 1: throughput

async def throughput(cluster: netns_cluster.NetnsCluster, size: int, repeat: int) -> dict[str, Any]:
    import smb2

    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    delta = np.ones(size // 4, np.float32)
    out = np.empty(size, np.uint8)
    samples: dict[int, dict[str, list[float]]] = {r: {op: [] for op in OPS} for r in (1, 2)}
    links: dict[int, dict[str, list[dict[str, dict[str, float]]]]] = {r: {op: [] for op in OPS} for r in (1, 2)}
    losses: dict[int, dict[str, list[tuple[int, int]]]] = {r: {op: [] for op in OPS} for r in (1, 2)}
    small: dict[int, tuple[float, float]] = {}
    async with await smb2.connect(cluster.servers, transport="tcp") as client:
        bufs = {r: await client.create(f"bench-r{r}", size, replicas=r) for r in (1, 2)}
        for r, buf in bufs.items():
            small[r] = await _small_latencies(buf, 200)
        views = await client.views()
        epoch0 = (await views.refresh()).epoch
        error = None
        try:
            for _ in range(repeat):
                for r, buf in bufs.items():         # in turns: a load change hits both alike
                    for op in OPS:
                        before = await asyncio.to_thread(link_bytes, cluster)
                        lost0 = await asyncio.to_thread(tcp_losses, cluster)
                        t0 = time.perf_counter()
                        if op == "write":
                            await buf.write(0, data)
                        elif op == "read":
                            await buf.read_into(out, 0)
                        else:
                            await buf.accumulate(0, delta)
                        dt = time.perf_counter() - t0
                        links[r][op].append(carried(before, await asyncio.to_thread(link_bytes, cluster)))
                        lost1 = await asyncio.to_thread(tcp_losses, cluster)
                        losses[r][op].append((lost1[0] - lost0[0], lost1[1] - lost0[1]))
                        samples[r][op].append(size / dt / 1e6)
                        if op == "read" and not np.array_equal(out, data):
                            raise AssertionError(f"replicas={r}: the 64 MiB read back differs from what was written")
        except smb2.Smb2Error as e:     # reported with the samples so far
            error = f"{type(e).__name__}: {e}"
            log.error("throughput over %s: %s", cluster.client_rate_bits, error)
        # no server failed: every change of the view is a live server taken for a dead one
        view_changes = (await views.refresh()).epoch - epoch0
        for r in bufs:
            with contextlib.suppress(smb2.Smb2Error):
                await client.destroy(f"bench-r{r}")
    result: dict[str, Any] = {"error": error} if error else {}
    result["view_changes"] = view_changes
    for r in (1, 2):
        row: dict[str, Any] = {"rtt_64B_us": round(small[r][0], 1), "fetch_add_64B_us": round(small[r][1], 1)}
        for op in OPS:
            if not samples[r][op]:
                row[f"{op}_MBps"] = None
                continue
            row[f"{op}_MBps"] = round(statistics.median(samples[r][op]), 1)
            row[f"{op}_MBps_samples"] = [round(x, 1) for x in samples[r][op]]
            # the link bytes of the median-speed sample
            k = sorted(range(len(samples[r][op])), key=samples[r][op].__getitem__)[len(samples[r][op]) // 2]
            row[f"{op}_link_MiB"] = links[r][op][k]
            row[f"{op}_tcp_retransmits_timeouts"] = losses[r][op]
        result[f"replicas={r}"] = row
    result["ratio r2/r1"] = {op: round(result["replicas=2"][f"{op}_MBps"] / result["replicas=1"][f"{op}_MBps"], 3)
                             if result["replicas=2"][f"{op}_MBps"] and result["replicas=1"][f"{op}_MBps"] else None
                             for op in OPS}
    return result


# ---------------------------------------------------------------------------------------------
# Phase 2: failover under accumulate and fetch_add loops

STRIPE = 4096


def killed_at(cluster: netns_cluster.NetnsCluster, i: int) -> float:
    """SIGKILL server ``i``; the time the signal was sent."""
    t = time.monotonic()
    cluster.kill_server(i)
    return t


async def failover(cluster: netns_cluster.NetnsCluster, main: MainThread, kills: int, settle: float) -> dict[str, Any]:
    import smb2

    n = cluster.n
    name = "failover"
    ops: list[jepsen.Op] = []
    stop = asyncio.Event()
    async with await smb2.connect(cluster.servers, transport="tcp") as client:
        buf = await client.create(name, n * STRIPE, stripe=STRIPE, replicas=2)
        assert buf.placement is not None
        primary = {i: buf.placement.replicas_of(i)[0] for i in range(n)}
        rtt, fadd = await _small_latencies(buf, 100)
        await buf.write(0, np.zeros(n * STRIPE, np.uint8))
        rng = np.random.default_rng(7)

        async def loop(i: int, kind: str) -> None:
            # counter i at the start of stripe i, fetch_add word i 8 bytes after it
            while not stop.is_set():
                value = int(rng.integers(1, 1000)) if kind == "accumulate" else 1
                op = jepsen.Op(process=i, kind=kind, key=i, value=value, invoke=time.monotonic())
                try:
                    if kind == "accumulate":
                        await buf.accumulate(i * STRIPE, np.array([value], np.int64), timeout=30)
                    else:
                        op.result = await buf.fetch_add(i * STRIPE + 8, 1, timeout=30)
                    op.outcome = jepsen.OK
                except smb2.Smb2Error as e:
                    op.outcome, op.error = jepsen.UNKNOWN, f"{type(e).__name__}: {e}"
                    log.warning("stripe %d %s: %s", i, kind, op.error)
                op.complete = time.monotonic()
                ops.append(op)

        tasks = [asyncio.ensure_future(loop(i, kind)) for i in range(n) for kind in ("accumulate", "fetch_add")]
        kill_rows = []
        try:
            await asyncio.sleep(0.5)
            report.progress("replicas-netns", 0, kills, "SIGKILLs of a primary under accumulate and fetch_add")
            for k in range(kills):
                victim = k % n
                mine = [i for i in range(n) if primary[i] == victim]
                start = len(ops)
                t_kill = await main.acall(killed_at, cluster, victim)

                def after(start: int = start, mine: list[int] = mine, t_kill: float = t_kill) -> list[jepsen.Op]:
                    """The operations on the victim's stripes invoked after the kill that completed."""
                    return [op for op in ops[start:] if op.key in mine and op.invoke >= t_kill
                            and op.outcome == jepsen.OK]

                while not after():
                    if time.monotonic() - t_kill > 60:
                        raise AssertionError(f"no operation on server {victim}'s stripes went on within 60 s")
                    await asyncio.sleep(0.005)
                went_on = min(op.complete for op in after())
                t_restart = time.monotonic()
                await main.acall(cluster.restart_server, victim)
                t_ready = time.monotonic()
                while await buf.degraded():
                    if time.monotonic() - t_ready > 60:
                        raise AssertionError(f"server {victim} was not a member again 60 s after its restart")
                    await asyncio.sleep(0.02)
                t_member = time.monotonic()
                if k + 1 < kills:               # the new view's lease, so the next kill starts from a quiet state
                    await asyncio.sleep(settle)
                others = [op for op in ops[start:]
                          if op.key not in mine and t_kill <= op.invoke and op.complete <= t_member]
                kill_rows.append({"server": victim, "failover_s": round(went_on - t_kill, 3),
                                  "restart_s": round(t_ready - t_restart, 3),
                                  "member_again_s": round(t_member - t_restart, 3),
                                  "other_stripes_slowest_op_s": round(max((op.complete - op.invoke for op in others),
                                                                          default=0.0), 3)})
                report.progress("replicas-netns", k + 1, kills, f"failover of server {victim}",
                                **{"its stripes went on after": f"{kill_rows[-1]['failover_s']:.2f} s",
                                   "a member again after": f"{kill_rows[-1]['member_again_s']:.2f} s"})
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        words = np.frombuffer(await buf.read(0, n * STRIPE), np.int64).reshape(n, STRIPE // 8)
        await client.destroy(name)
    violations = jepsen.check_counters(ops, jepsen.Final(counters=[int(w) for w in words[:, 0]]))
    for i in range(n):
        violations += [f"fetch_add word {i}: {v}" for v in jepsen.check_fetch_adds(
            [op for op in ops if op.kind == "fetch_add" and op.key == i], jepsen.Final(fetch_add=int(words[i, 1])))]
    fo = [row["failover_s"] for row in kill_rows]
    return {"kills": kill_rows, "failover_s_median": round(statistics.median(fo), 3) if fo else None,
            "failover_s_worst": round(max(fo), 3) if fo else None,
            "member_again_s_median": round(statistics.median(r["member_again_s"] for r in kill_rows), 3)
            if kill_rows else None,
            "operations": jepsen.summary(jepsen.History(0, ops)), "violations": violations,
            "rtt_64B_us": round(rtt, 1), "fetch_add_64B_us": round(fadd, 1)}


# ---------------------------------------------------------------------------------------------
# Phase 3: repair

async def repair(cluster: netns_cluster.NetnsCluster, main: MainThread, size: int, kills: int) -> dict[str, Any]:
    import smb2

    name, stripe, victim = "repair", MiB, 1
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    rows = []
    async with await smb2.connect(cluster.servers, transport="tcp", op_timeout=300) as client:
        buf = await client.create(name, size, stripe=stripe, replicas=2)
        p = buf.placement
        assert p is not None
        rtt, _ = await _small_latencies(buf, 100)      # before the fill: its fetch_adds change word 0
        t0 = time.monotonic()
        retries: list[str] = []
        for at in range(0, size, 64 * MiB):     # in pieces, so one that fails is written again alone
            for attempt in range(4):
                try:
                    await buf.write(at, data[at:at + 64 * MiB])
                    break
                except smb2.Smb2Error as e:     # counted and reported: writing again is harmless here
                    if attempt == 3:
                        raise
                    retries.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")
                    log.warning("filling %s: %s", name, retries[-1])
        fill = time.monotonic() - t0
        first = next(i for i in range(p.nstripes) if p.replicas_of(i)[0] == victim)
        report.progress("replicas-netns", 0, kills, f"rejoins of server {victim}, restarted empty, {size // MiB} MiB")
        for k in range(kills):
            await main.acall(cluster.kill_server, victim)
            # a write to a stripe the victim is primary of finds it dead: the client takes it out of the view
            await buf.write(first * stripe, data[first * stripe:(first + 1) * stripe])
            t_restart = time.monotonic()
            await main.acall(cluster.restart_server, victim)
            t_ready = time.monotonic()
            while await still_degraded(buf, retries):
                if time.monotonic() - t_ready > 600:
                    raise AssertionError(f"server {victim} was not a member again 600 s after its restart")
                await asyncio.sleep(0.05)
            t_member = time.monotonic()
            rows.append({"restart_s": round(t_ready - t_restart, 3), "repair_s": round(t_member - t_restart, 3)})
            report.progress("replicas-netns", k + 1, kills, "rejoin",
                            **{"a member again after": f"{rows[-1]['repair_s']:.2f} s"})
        # every copy on the rejoined server holds the data
        host, port = cluster.servers[victim].rsplit(":", 1)
        bad = []
        for i in range(p.nstripes):
            if victim in p.replicas_of(i):
                want = data[i * stripe:(i + 1) * stripe]
                got = await read_copy(host, int(port), cluster.servers[victim], p.offset_on(victim, i), len(want),
                                      name=name)
                if got != want.tobytes():
                    bad.append(i)
        await client.destroy(name)
    held = p.stripes_on(victim) * stripe
    med = statistics.median(r["repair_s"] for r in rows)
    return {"size_MiB": size // MiB, "copied_to_rejoiner_MiB": held // MiB, "kills": rows,
            "repair_s_median": round(med, 3), "repair_s_worst": round(max(r["repair_s"] for r in rows), 3),
            "implied_MiB_per_s": round(held / MiB / med, 1), "fill_MBps": round(size / fill / 1e6, 1),
            "copies_equal_data": not bad, "differing_stripes": bad[:10], "rtt_64B_us": round(rtt, 1),
            "errors_retried": retries}


async def still_degraded(buf: Any, errors: list[str]) -> bool:
    """``buf.degraded()``; True where etcd did not answer in time (noted in ``errors``)."""
    import smb2

    try:
        return bool(await buf.degraded())
    except smb2.MembershipError as e:
        errors.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")
        return True


# ---------------------------------------------------------------------------------------------
# Report

def round_trip(result: dict[str, Any]) -> float | None:
    """The run's 64-byte round trip: the median of its phases' (across the shaped links)."""
    phases = [res.get(r, {}) for res in result["throughput"].values() for r in ("replicas=1", "replicas=2")]
    phases += [result.get(p) or {} for p in ("failover", "repair")]
    return report.median_round_trip([p.get("rtt_64B_us") for p in phases])


def table(result: dict[str, Any]) -> str:
    lines = []
    for shaping, res in result["throughput"].items():
        lines.append(f"{shaping}: {res['links']}")
        if "replicas=1" not in res:
            lines.append(f"  FAILED: {res.get('error')}")
            continue
        if res.get("error"):
            lines.append(f"  stopped early by: {res['error']}")
        if res["view_changes"]:
            lines.append(f"  {res['view_changes']} view changes with every server up (live servers taken for dead)")
        ratio = res["ratio r2/r1"]
        lines.append(report.table(
            ["", "write MB/s", "read MB/s", "accum MB/s", "64B rtt us", "fadd us"],
            [[r, res[r]["write_MBps"], res[r]["read_MBps"], res[r]["accumulate_MBps"], res[r]["rtt_64B_us"],
              res[r]["fetch_add_64B_us"]] for r in ("replicas=1", "replicas=2")]
            + [["r2/r1", ratio["write"], ratio["read"], ratio["accumulate"], None, None]], indent=2))
        links = [(r, op, res[r][f"{op}_link_MiB"], res[r][f"{op}_tcp_retransmits_timeouts"])
                 for r in ("replicas=1", "replicas=2") for op in OPS if res[r][f"{op}_MBps"]]
        lines.append(report.table(
            ["", "op", "MiB in/out per host", "tcp retransmits", "timeouts"],
            [[r, op, ", ".join(f"{h} {report.cell(v['in'])}/{report.cell(v['out'])}" for h, v in per.items()),
              statistics.median(x[0] for x in lost), statistics.median(x[1] for x in lost)]
             for r, op, per, lost in links], indent=4))
    fo = result.get("failover")
    if fo and fo.get("error"):
        lines.append(f"failover: FAILED: {fo['error']}")
    elif fo:
        lines.append(f"failover ({len(fo['kills'])} SIGKILLs of a primary): median {fo['failover_s_median']} s, "
                     f"worst {fo['failover_s_worst']} s; member again {fo['member_again_s_median']} s after restart "
                     f"(median, process start included); 64 B rtt {fo['rtt_64B_us']} us, "
                     f"fetch_add {fo['fetch_add_64B_us']} us")
        lines.append(f"  operations: {fo['operations']}")
        lines.append(f"  checker: {'; '.join(fo['violations']) or 'no acknowledged update lost, none applied twice'}")
    rp = result.get("repair")
    if rp and rp.get("error"):
        lines.append(f"repair: FAILED: {rp['error']}")
    elif rp:
        lines.append(f"repair of {rp['size_MiB']} MiB (replicas=2; {rp['copied_to_rejoiner_MiB']} MiB copied to the "
                     f"restarted server at --repair-rate {result['settings']['repair_rate']} per primary): "
                     f"median {rp['repair_s_median']} s, worst {rp['repair_s_worst']} s from its restart "
                     "(process start included) "
                     f"({rp['implied_MiB_per_s']} MiB/s); copies equal the data: {rp['copies_equal_data']}; "
                     f"64 B rtt {rp['rtt_64B_us']} us; fill {rp['fill_MBps']} MB/s")
        if rp["errors_retried"]:
            lines.append(f"  {len(rp['errors_retried'])} errors retried: {rp['errors_retried'][:3]}")
    return "\n".join(lines)


def phase(main_thread: MainThread, cluster: netns_cluster.NetnsCluster, coro_fn: Callable[..., Any],
          *args: Any) -> dict[str, Any]:
    """One phase's result, or the error that ended it (the other phases still run)."""
    import smb2

    try:
        return dict(main_thread.run(cluster, coro_fn, *args))
    except (smb2.Smb2Error, AssertionError) as e:
        log.error("%s failed: %s", coro_fn.__name__, e)
        return {"error": f"{type(e).__name__}: {e}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--server-rate", default="200mbit", help="every server link, both directions (tc syntax)")
    ap.add_argument("--client-rate", default="200mbit", help="the client link in the client-bound shaping")
    ap.add_argument("--size", default="64MiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--settle", type=float, default=1.5, help="seconds between a rejoin and the next kill")
    ap.add_argument("--repair-size", default="1GiB", help="0: no repair phase")
    ap.add_argument("--repair-rate", default="48MiB", help="the servers' --repair-rate in the repair phase")
    ap.add_argument("--repair-link", default="1gbit", help="server links in the repair phase")
    ap.add_argument("--repair-kills", type=int, default=2)
    ap.add_argument("--phases", default="throughput,failover,repair")
    ap.add_argument("--patience", type=float, default=None,
                    help="seconds a replicated request waits before its server is taken for dead (sets "
                         "smb2.replication.FAILOVER_AFTER for this run; default: the library's)")
    ap.add_argument("--queue-ms", type=float, default=None,
                    help="each shaped link's queue, in ms of its rate (tbf latency; default: netns_cluster's 5 ms)")
    ap.add_argument("--shapings", default="server-bound,client-bound")
    ap.add_argument("--quick", action="store_true", help="4 MiB, 1 sample, at most 2 kills, no repair, one shaping")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    from smb2.protocol import parse_size

    if args.quick:
        args.size, args.repeat, args.kills, args.settle, args.repair_size = "4MiB", 1, min(args.kills, 2), 1.0, "0"
    ok, why = netns_cluster.can_run()
    if not ok:
        print(f"bench_replicas_netns: cannot build a namespace cluster here: {why}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    phases = set(args.phases.split(","))
    size = parse_size(args.size)
    main_thread = MainThread()
    result: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "verbose")},
                              "throughput": {}}
    if args.patience is not None:
        import smb2.replication

        smb2.replication.FAILOVER_AFTER = args.patience
    shapings = {k: v for k, v in {"server-bound": None, "client-bound": args.client_rate}.items()
                if k in args.shapings.split(",") and not (args.quick and k == "client-bound")}

    def save() -> None:
        if args.json:
            report.write_json(args.json, result, round_trip_64B_us=round_trip(result), quiet=True)
    capacity = f"{max(64, 4 * size // MiB // args.servers)}MiB"
    t_start = time.monotonic()
    for shaping, client_rate in shapings.items():
        if not phases & {"throughput", "failover"}:
            break
        links = (f"{args.servers} server links at {args.server_rate} each way, client link at "
                 f"{client_rate or 'unlimited'}")
        with _cluster(args, rate=args.server_rate, client_rate=client_rate, capacity=capacity) as c:
            if "throughput" in phases:
                result["throughput"][shaping] = {"links": links, **phase(main_thread, c, throughput, c, size,
                                                                         args.repeat)}
                save()
            if "failover" in phases and shaping == "server-bound":
                result["failover"] = {"links": links, **phase(main_thread, c, failover, c, main_thread, args.kills,
                                                              args.settle)}
    repair_size = parse_size(args.repair_size)
    if "repair" in phases and repair_size:
        capacity = f"{repair_size * 2 // args.servers // MiB + 64}MiB"
        with _cluster(args, rate=args.repair_link, client_rate=None, capacity=capacity,
                      extra_server_args=("--repair-rate", args.repair_rate)) as c:
            result["repair"] = {"links": f"server links at {args.repair_link}, client link unlimited",
                                **phase(main_thread, c, repair, c, main_thread, repair_size, args.repair_kills)}
    result["seconds"] = round(time.monotonic() - t_start, 1)
    save()
    print(table(result))
    parts = [*result["throughput"].values(), result.get("failover") or {}, result.get("repair") or {}]
    bad = any(p.get("error") or p.get("violations") or p.get("copies_equal_data") is False for p in parts)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
