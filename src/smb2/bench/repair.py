"""How long a replicated buffer takes to be whole again after a server is lost.

    python tools/bench_repair.py [--mode rejoin|replace|both] [--size 256MiB] [--repair-rate 256MiB]
                                 [--kills 3] [--replace-after 1]
    smb2 bench repair --quick         # seconds: 8 MiB, one kill in each mode, --load

Starts 3 ``smb2-server`` processes with a private etcd
(``LocalCluster(replicated=True)``) and fills a ``replicas=2`` buffer of
``--size`` with random bytes.  Then, ``--kills`` times:

* ``rejoin``: SIGKILLs server 1, takes it out of the view (as a client that
  found it dead does), restarts it empty and times until it is a member
  again (its stat's replication state); the time counts from the restart,
  the process start included;
* ``replace`` (repair onto another server; a new cluster each time):
  SIGKILLs server 1 for good, takes it out of the view, and times until
  the buffer is no longer degraded: the other two servers made new copies
  of the stripes it held (``--replace-after`` s after they saw it out of
  the view, then a copy through each primary's ordered link at
  ``--repair-rate``).  The figure is reported from the removal, and less
  the grace period.  With ``--load``, a client writes 4 MiB pieces (and
  reads 64 bytes) all along: its write rate and 64-byte round trip during
  the repair (from the end of the grace, so use a grace longer than the
  client's failover, e.g. ``--replace-after 3``) are reported against the
  same traffic for as long after it, which shows what the repair takes
  from training (``--repair-rate``).

Each mode then checks that every stripe's two member copies are the same
bytes as the data written.  Prints the median and worst times and the rate
they imply, beside the 64-byte round trip (TCP) measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from typing import Any

import numpy as np

import smb2
from smb2.placement import Placement
from smb2.protocol import parse_size
from smb2.testing.replicas import read_copy

from . import report
from .common import parse_with_quick

MiB = 1 << 20
#: --quick: both modes once each, the load beside the replacement
QUICK = ["--size", "8MiB", "--kills", "1", "--mode", "both", "--load"]


async def stat_of(client: smb2.Client, index: int) -> dict:
    return (await client.stat())[index]


async def _filled(cluster: smb2.LocalCluster, size: int) -> tuple[smb2.Client, smb2.Buffer, np.ndarray, list[float]]:
    """A client, the replicas=2 buffer filled with random bytes, the data, and
    200 64-byte read round trips (µs)."""
    client = await smb2.connect(cluster.addresses, transport="tcp", op_timeout=120)
    buf = await client.create("repair", size, stripe=MiB, replicas=2)
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    await buf.write(0, data)
    small = np.zeros(64, np.uint8)
    rtts = []
    for _ in range(200):
        t0 = time.perf_counter()
        await buf.read_into(small, 0)
        rtts.append((time.perf_counter() - t0) * 1e6)
    return client, buf, data, rtts


async def _remove(cluster: smb2.LocalCluster, index: int) -> None:
    """Take server ``index`` out of the view, as a client that found it dead does."""
    assert cluster.membership_url is not None
    async with cluster.membership() as m:
        v = await m.view()
        await m.change(v, members=[a for a in v.members if a != cluster.addresses[index]],
                       joining=[a for a in v.joining if a != cluster.addresses[index]])


async def _check(cluster: smb2.LocalCluster, data: np.ndarray) -> list[tuple[int, str, int, int]]:
    """Every stripe's member copies (in the view now: on their own servers or
    moved) against ``data``: the differing ones (stripe, server, bytes read,
    bytes wrong)."""
    assert cluster.membership_url is not None
    async with cluster.membership() as m:
        view = await m.view()
    servers = list(cluster.addresses)
    p = Placement.of("repair", 3, len(data), MiB, 2)
    bad = []
    for i in range(p.nstripes):
        want = data[i * MiB:(i + 1) * MiB]
        holders = [h for h in view.holders([servers[s] for s in p.replicas_of(i)]) if h.state == "member"]
        if len(holders) < 2:
            bad.append((i, "only " + ",".join(h.server for h in holders), 0, -1))
        for h in holders:
            host, port = h.server.rsplit(":", 1)
            got = await read_copy(host, int(port), h.slot, p.offset_on(servers.index(h.slot), i), len(want))
            if got != want.tobytes():
                bad.append((i, h.server, len(got), int(np.count_nonzero(np.frombuffer(got, np.uint8) != want))
                            if len(got) == len(want) else -1))
    return bad


async def rejoin(args: argparse.Namespace) -> dict[str, object]:
    size = parse_size(args.size)
    async with smb2.LocalCluster(servers=3, processes=True, replicated=True, capacity=f"{size // MiB + 64}MiB",
                                 server_args=["--repair-rate", args.repair_rate]) as cluster:
        client, buf, data, rtts = await _filled(cluster, size)
        async with client:
            times = []
            report.progress("repair", 0, args.kills, "rejoins of a SIGKILLed server restarted empty")
            for k in range(args.kills):
                await cluster.kill(1)
                await _remove(cluster, 1)
                t0 = time.monotonic()
                await cluster.restart(1)
                while True:
                    try:
                        st = (await stat_of(client, 1))["replication"]
                        if st["state"] == "member":
                            break
                    except smb2.Smb2Error:
                        pass
                    await asyncio.sleep(0.02)
                times.append(time.monotonic() - t0)
                report.progress("repair", k + 1, args.kills, "rejoin", **{"a member again after": f"{times[-1]:.2f} s"})
            bad = await _check(cluster, data)
    held = Placement.of("repair", 3, size, MiB, 2).stripes_on(1) * MiB
    return {"mode": "rejoin (the lost server restarts empty and catches up)", "size": size,
            "repair_rate": args.repair_rate, "bytes_copied": held,
            "repair_s_median": round(statistics.median(times), 3), "repair_s_worst": round(max(times), 3),
            "implied_MiB_per_s": round(held / MiB / statistics.median(times), 1),
            "rtt_64B_us_median": round(statistics.median(rtts), 1), "copies_equal_data": not bad,
            "differing (stripe, server, bytes read, bytes wrong)": bad[:10]}


class Traffic:
    """With ``--load``: training-like traffic while the repair runs, 4 MiB
    writes of the buffer's own bytes (its contents do not change) each
    followed by a 64-byte read, counted per phase: not counted during the
    grace (the client fails over then: the view's lease, a refused
    connection), "during" from the end of the grace until the buffer is
    whole, "after" for as long again."""

    def __init__(self, buf: smb2.Buffer, data: np.ndarray, grace: float) -> None:
        self.buf, self.data = buf, data
        self.phase = "grace"
        self.bytes: dict[str, int] = {"grace": 0, "during": 0, "after": 0}
        self.rtts: dict[str, list[float]] = {"grace": [], "during": [], "after": []}
        self.started: dict[str, float] = {}
        self.ended = 0.0
        self.etcd_stalls = 0
        self.stop = False
        self.task = asyncio.create_task(self._run())
        asyncio.get_running_loop().call_later(grace, self._during)

    def _during(self) -> None:
        if self.phase == "grace":
            self.started["during"] = time.monotonic()
            self.phase = "during"

    async def _run(self) -> None:
        small = np.zeros(64, np.uint8)
        at, piece = 0, 4 * MiB
        while not self.stop:
            phase = self.phase
            try:
                await self.buf.write(at, self.data[at:at + piece])
            except smb2.MembershipError:
                # the private etcd starved on a loaded host: the client waits, as a training job would
                self.etcd_stalls += 1
                continue
            t0 = time.perf_counter()
            await self.buf.read_into(small, 0)
            self.rtts[phase].append((time.perf_counter() - t0) * 1e6)
            self.bytes[phase] += piece
            at = (at + piece) % (len(self.data) - piece)

    def next_phase(self) -> None:
        self._during()
        self.started["after"] = self.ended = time.monotonic()
        self.phase = "after"

    async def finish(self) -> dict[str, float]:
        self.stop = True
        await self.task
        end = time.monotonic()
        during = self.bytes["during"] / (self.ended - self.started["during"]) / 1e6
        after = self.bytes["after"] / (end - self.started["after"]) / 1e6
        return {"during": during, "after": after, "etcd_stalls": self.etcd_stalls,
                "rtt_during": statistics.median(self.rtts["during"] or [float("nan")]),
                "rtt_after": statistics.median(self.rtts["after"] or [float("nan")])}


async def replace(args: argparse.Namespace) -> dict[str, object]:
    size = parse_size(args.size)
    times, rtts, bad, loads = [], [], [], []
    report.progress("repair", 0, args.kills, "replacements of a SIGKILLed server's copies on the other two")
    for k in range(args.kills):
        async with smb2.LocalCluster(
                servers=3, processes=True, replicated=True, capacity=f"{2 * size // MiB + 64}MiB",
                server_args=["--repair-rate", args.repair_rate, "--replace-after", str(args.replace_after)]) as cluster:
            client, buf, data, rtt = await _filled(cluster, size)
            rtts += rtt
            async with client:
                await cluster.kill(1)
                await _remove(cluster, 1)
                t0 = time.monotonic()
                traffic = Traffic(buf, data, args.replace_after) if args.load else None
                while True:
                    with contextlib.suppress(smb2.MembershipError):     # etcd starved on a loaded host
                        if not await buf.degraded():
                            break
                    await asyncio.sleep(0.02)
                times.append(time.monotonic() - t0)
                if traffic is not None:
                    # as long again with the buffer whole: the same traffic without a repair
                    traffic.next_phase()
                    await asyncio.sleep(max(2.0, times[-1] - args.replace_after))
                    loads.append(await traffic.finish())
                bad += await _check(cluster, data)
        report.progress("repair", k + 1, args.kills, "replace", **{"whole again after": f"{times[-1]:.2f} s"})
    held = Placement.of("repair", 3, size, MiB, 2).stripes_on(1) * MiB
    med = statistics.median(times)
    out: dict[str, object] = {
        "mode": "replace (the lost server stays dead; its copies are made on the other two)", "size": size,
        "repair_rate": args.repair_rate, "replace_after_s": args.replace_after, "bytes_copied": held,
        "repair_s_median": round(med, 3), "repair_s_worst": round(max(times), 3),
        "repair_s_median_less_grace": round(med - args.replace_after, 3),
        "implied_MiB_per_s": round(held / MiB / max(med - args.replace_after, 1e-3), 1),
        "rtt_64B_us_median": round(statistics.median(rtts), 1), "copies_equal_data": not bad,
        "differing (stripe, server, bytes read, bytes wrong)": bad[:10]}
    if loads:
        during = statistics.median(x["during"] for x in loads)
        after = statistics.median(x["after"] for x in loads)
        out.update({"load_write_MB_per_s_during_repair": round(during, 1),
                    "load_write_MB_per_s_after_repair": round(after, 1),
                    "load_during_over_after": round(during / after, 2),
                    "load_rtt_64B_us_during_repair": round(statistics.median(x["rtt_during"] for x in loads), 1),
                    "load_rtt_64B_us_after_repair": round(statistics.median(x["rtt_after"] for x in loads), 1),
                    "load_writes_refused_for_etcd": sum(int(x["etcd_stalls"]) for x in loads)})
    return out


async def main_async(args: argparse.Namespace) -> list[dict[str, object]]:
    out = []
    if args.mode in ("rejoin", "both"):
        out.append(await rejoin(args))
    if args.mode in ("replace", "both"):
        out.append(await replace(args))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="256MiB")
    p.add_argument("--repair-rate", default="256MiB")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--mode", choices=("rejoin", "replace", "both"), default="both")
    p.add_argument("--replace-after", type=float, default=1.0,
                   help="the servers' --replace-after in replace mode (seconds; default 1)")
    p.add_argument("--load", action="store_true",
                   help="replace mode: 4 MiB writes and 64 B reads all along, their rate during the repair "
                        "against as long after it")
    p.add_argument("--json", default="bench-results/repair.json", help="where to write the rows")
    args = parse_with_quick(p, argv, QUICK, "rejoin and replace, the load's rates and the copies' check")
    rows: list[dict[str, Any]] = asyncio.run(main_async(args))
    print(table(rows))
    report.write_json(args.json, {"args": vars(args), "quick": args.quick, "rows": rows},
                      round_trip_64B_us=report.median_round_trip([r["rtt_64B_us_median"] for r in rows]))
    return 0


def table(rows: list[dict[str, Any]]) -> str:
    lines = [report.table(["mode", "bytes", "median s", "worst s", "MiB/s", "64B rtt us", "copies"],
                          [[str(r["mode"]).split()[0], r["bytes_copied"], r["repair_s_median"], r["repair_s_worst"],
                            r["implied_MiB_per_s"], r["rtt_64B_us_median"],
                            "equal" if r["copies_equal_data"] else "DIFFER"] for r in rows])]
    for r in rows:
        if "load_during_over_after" in r:
            lines.append(f"  with --load ({str(r['mode']).split()[0]}): writes {r['load_write_MB_per_s_during_repair']}"
                         f" MB/s during the repair, {r['load_write_MB_per_s_after_repair']} MB/s after "
                         f"({r['load_during_over_after']}x); 64 B round trip {r['load_rtt_64B_us_during_repair']} us "
                         f"during, {r['load_rtt_64B_us_after_repair']} us after")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
