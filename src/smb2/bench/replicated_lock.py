#!/usr/bin/env python3
"""What a replicated lock costs, and how long its failover takes, measured in one run.

    python tools/bench_replicated_lock.py [--transport tcp] [--rounds 7] [-n 100] [--kills 3]
    smb2 bench replicated-lock --quick        # 1 round of 10, 1 kill

Starts 3 ``smb2-server`` processes with a private etcd (``LocalCluster(replicated=True)``) and
measures, in alternating rounds against the same servers: the 64-byte round trip (a READ of
64 B of an unreplicated buffer), an uncontended acquire + release of the unreplicated lock
(``client.lock``: parked over TCP) and of the replicated one (``client.replicated_lock``,
replicas=2: every step a replicated atomic).  Then, ``--kills`` times: a holder keeps the
replicated lock while its server is SIGKILLed and releases it at once: the time from the kill
until that release succeeded on the new primary ("released": it still held the lock there) and
until the waiter queued before the kill held it ("handed on") is recorded; the server is restarted (it rejoins)
before the next kill.  Medians (and the worst failover) are printed as a table and written as
JSON (``--json``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import smb2

from . import report
from .common import parse_with_quick

#: --quick: the three kinds once, one failover
QUICK = ["--rounds", "1", "-n", "10", "--kills", "1"]


async def _timed(n: int, op: Any) -> float:
    t = time.perf_counter()
    for _ in range(n):
        await op()
    return (time.perf_counter() - t) / n * 1e6


async def latencies(cluster: smb2.LocalCluster, transport: str, rounds: int, n: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"rtt64": [], "lock": [], "replicated_lock": []}
    async with await cluster.connect(transport=transport) as client:
        buf = await client.create("bench-rtt", 4096)
        plain = client.lock("bench-plain")
        repl = client.replicated_lock("bench-repl", 2)

        async def once(lock: Any) -> None:
            await lock.acquire()
            await lock.release()
        for lock in (plain, repl):
            await once(lock)        # opened (the replicated lock's buffer made) outside the timing
        kinds = {"rtt64": lambda: buf.read(0, 64), "lock": lambda: once(plain), "replicated_lock": lambda: once(repl)}
        order = list(kinds)
        for r in range(rounds):
            for k in order[r % 3:] + order[:r % 3]:     # the order rotates: no kind always runs first
                out[k].append(await _timed(n, kinds[k]))
    return out


async def failover(cluster: smb2.LocalCluster, transport: str, kills: int) -> list[dict[str, float]]:
    out = []
    async with await cluster.connect(transport=transport) as a, await cluster.connect(transport=transport) as b:
        report.progress("replicated-lock", 0, kills, "SIGKILLs of the lock's server, a holder and a waiter on it")
        for k in range(kills):
            holder = a.replicated_lock("bench-failover", 2)
            await holder.acquire()
            words = await a.attach("lock:bench-failover")
            lost = cluster.addresses.index(await words.primary_server(0))
            waiter = b.replicated_lock("bench-failover", 2)
            waiting = asyncio.ensure_future(waiter.acquire())
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            await cluster.kill(lost)
            # the holder's release goes through the failover to the new primary: it still held the lock
            await holder.release()
            kept = time.monotonic() - t0
            await waiting
            handed = time.monotonic() - t0
            await waiter.release()
            out.append({"kept_s": kept, "handed_on_s": handed, "server": float(lost)})
            report.progress("replicated-lock", k + 1, kills, f"kill of server {lost}: the holder released it on the "
                            f"new primary after {kept:.2f} s, the waiter held it {handed:.2f} s after the kill")
            await cluster.restart(lost)
            if k + 1 < kills:
                await asyncio.sleep(3.0)        # it rejoins and catches up before the next kill
    return out


async def bench(a: argparse.Namespace) -> dict[str, Any]:
    async with smb2.LocalCluster(servers=3, processes=True, replicated=True, capacity="64MiB") as cluster:
        lat = await latencies(cluster, a.transport, a.rounds, a.n)
        fo = await failover(cluster, a.transport, a.kills) if a.kills else []
    med = {k: statistics.median(v) for k, v in lat.items()}
    ratio = statistics.median(r / p for r, p in zip(lat["replicated_lock"], lat["lock"]))
    return {"transport": a.transport, "rounds": a.rounds, "n": a.n, "quick": a.quick, "median_us": med,
            "replicated_over_plain": ratio, "samples_us": lat, "failover": fo}


def table(res: dict[str, Any]) -> str:
    m = res["median_us"]
    lines = [f"transport {res['transport']}, 3 servers, medians of {res['rounds']} rounds of {res['n']}",
             report.table(["", "us", "x unreplicated lock"],
                          [["64-byte round trip (READ)", m["rtt64"], None],
                           ["lock acquire+release (unreplicated)", m["lock"], None],
                           ["replicated_lock acquire+release (R=2)", m["replicated_lock"],
                            res["replicated_over_plain"]]],
                          formats=[None, "{:.0f}", "{:.1f}x"], indent=2)]
    fo = res["failover"]
    if fo:
        kept = [f["kept_s"] for f in fo]
        handed = [f["handed_on_s"] for f in fo]
        lines.append(f"  SIGKILL of the lock's server ({len(fo)} kills): the holder kept it and released it on "
                     f"the new primary after {statistics.median(kept):.2f} s (worst {max(kept):.2f}); "
                     f"the waiter held it {statistics.median(handed):.2f} s after the kill "
                     f"(worst {max(handed):.2f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", default="tcp")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("-n", type=int, default=100, help="acquire+release per round and kind")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--json", default=str(Path("bench-results") /
                                         "replicated_lock.json"))
    a = parse_with_quick(p, argv, QUICK, "the three kinds measured, the failover with a holder and a waiter")
    logging.basicConfig(level=logging.ERROR)
    res = asyncio.run(bench(a))
    print(table(res))
    report.write_json(a.json, res, round_trip_64B_us=res["median_us"]["rtt64"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
