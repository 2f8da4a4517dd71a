"""What replication costs, measured in one run on this machine.

    python tools/bench_replicas.py [--transport tcp|shm] [--repeat 15] [--baseline-python PATH]
    smb2 bench replicas --quick       # seconds: one turn, one sample a figure

Starts 3 ``smb2-server`` processes (with a private etcd where the package
has ``LocalCluster(replicated=True)``) and measures, as medians of
``--repeat`` samples: the 64-byte round trip (a read of 64 B), a 64 B
fetch_add, and a 64 MiB write and read, for ``replicas=1`` and
``replicas=2``.  With ``--baseline-python`` (another checkout's venv
python, e.g. main's) the replicas=1 figures are measured by that code too,
in turns with this one's against the same servers, so the ratio is the cost
the replication code adds to the unreplicated path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

import numpy as np

MiB = 1 << 20
BIG = 64 * MiB
#: --quick: replicas=1 and 2 once, one sample of each figure
QUICK = ["--repeat", "1", "--turns", "1"]


async def measure(servers: list[str], transport: str, replicas: int, repeat: int, name: str) -> dict[str, float]:
    """Medians in µs (64 B) and MB/s (64 MiB) of one code version."""
    import smb2

    async with await smb2.connect(servers, transport=transport) as client:
        await client.destroy(name)
        # replicas=1 as main's code calls it (no keyword), so it can be the baseline
        buf = await (client.create(name, BIG, replicas=replicas) if replicas > 1 else client.create(name, BIG))
        small = np.zeros(64, np.uint8)
        data = np.random.default_rng(0).integers(0, 256, BIG, dtype=np.uint8)
        out = np.empty(BIG, np.uint8)
        for _ in range(200):            # warm: connections, mappings
            await buf.read_into(small, 0)
        rtt, fadd, write, read = [], [], [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in range(100):
                await buf.read_into(small, 0)
            rtt.append((time.perf_counter() - t0) / 100 * 1e6)
            t0 = time.perf_counter()
            for _ in range(100):
                await buf.fetch_add(0, 1)
            fadd.append((time.perf_counter() - t0) / 100 * 1e6)
            t0 = time.perf_counter()
            await buf.write(0, data)
            write.append(BIG / (time.perf_counter() - t0) / 1e6)
            t0 = time.perf_counter()
            await buf.read_into(out, 0)
            read.append(BIG / (time.perf_counter() - t0) / 1e6)
        await client.destroy(name)
    return {"rtt_64B_us": statistics.median(rtt), "fetch_add_us": statistics.median(fadd),
            "write_64MiB_MBps": statistics.median(write), "read_64MiB_MBps": statistics.median(read)}


def child(args: argparse.Namespace) -> int:
    import uvloop  # the loop smb2 runs on (its training layer, smb2-server)

    uvloop.install()
    print(json.dumps(asyncio.run(measure(args.servers.split(","), args.transport, args.replicas, args.repeat,
                                         args.name))))
    return 0


def run_child(python: str, servers: list[str], transport: str, replicas: int, repeat: int) -> dict[str, float]:
    out = subprocess.run([python, __file__, "--child", "--servers", ",".join(servers), "--transport", transport,
                          "--replicas", str(replicas), "--repeat", str(repeat), "--name", f"bench-r{replicas}"],
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"replicas={replicas} with {python} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    import smb2
    from smb2.bench import report

    try:
        cluster = smb2.LocalCluster(servers=3, processes=True, replicated=True, capacity="512MiB")
        replicated = True
    except TypeError:       # a package without replication: replicas=1 only
        cluster = smb2.LocalCluster(servers=3, processes=True, capacity="512MiB")
        replicated = False
    async with cluster:
        servers = cluster.addresses
        rows: dict[str, list[dict[str, float]]] = {"this r1": [], "this r2": [], "baseline r1": []}
        report.progress("replicas", 0, args.turns, f"turns of every version, {args.repeat} samples a figure")
        for turn in range(args.turns):
            # in turns, so a load change on the machine hits every version alike
            if args.baseline_python:
                rows["baseline r1"].append(await asyncio.to_thread(
                    run_child, args.baseline_python, servers, args.transport, 1, args.repeat))
            rows["this r1"].append(await asyncio.to_thread(
                run_child, sys.executable, servers, args.transport, 1, args.repeat))
            if replicated and not args.only_r1:
                rows["this r2"].append(await asyncio.to_thread(
                    run_child, sys.executable, servers, args.transport, 2, args.repeat))
            report.progress("replicas", turn + 1, args.turns, "turn, 64 B round trip",
                            **{k: f"{v[-1]['rtt_64B_us']:.0f} us" for k, v in rows.items() if v})
    result: dict[str, object] = {"transport": args.transport, "turns": args.turns, "repeat": args.repeat,
                                 "quick": args.quick}
    for key, samples in rows.items():
        if samples:
            result[key] = {k: round(statistics.median(s[k] for s in samples), 2) for k in samples[0]}
    base = result.get("baseline r1") or result.get("this r1")
    for key in ("this r1", "this r2"):
        if key in result and isinstance(base, dict):
            mine = result[key]
            assert isinstance(mine, dict)
            result[f"{key} / {'baseline r1' if 'baseline r1' in result else 'this r1'}"] = {
                k: round(mine[k] / base[k], 3) for k in base}
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", default="tcp", choices=["tcp", "shm"])
    p.add_argument("--repeat", type=int, default=15, help="samples per figure and turn")
    p.add_argument("--turns", type=int, default=3, help="turns of each version")
    p.add_argument("--baseline-python", help="another checkout's python, measured in turns for replicas=1")
    p.add_argument("--only-r1", action="store_true", help="measure replicas=1 only")
    p.add_argument("--json", default="bench-results/replicas.json", help="where to write the result")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--servers", help=argparse.SUPPRESS)
    p.add_argument("--replicas", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--name", default="bench", help=argparse.SUPPRESS)
    if "--child" in sys.argv[1:]:
        return child(p.parse_args())
    # here, not at the top: the child runs this file alone, possibly from another checkout
    from smb2.bench import report
    from smb2.bench.common import parse_with_quick

    args = parse_with_quick(p, None, QUICK, "both replica counts, every figure, the ratios")
    result = asyncio.run(main_async(args))
    print(table(result))
    this_r1 = result["this r1"]
    assert isinstance(this_r1, dict)
    report.write_json(args.json, result, round_trip_64B_us=this_r1["rtt_64B_us"])
    return 0


def table(result: dict[str, object]) -> str:
    """One row per version and replica count, and each against replicas=1."""
    from smb2.bench import report

    figures = ["rtt_64B_us", "fetch_add_us", "write_64MiB_MBps", "read_64MiB_MBps"]
    rows = [[key, *(cols.get(k) for k in figures)] for key, cols in result.items() if isinstance(cols, dict)]
    return report.table(["", "64 B rtt us", "fetch_add us", "write 64 MiB MB/s", "read 64 MiB MB/s"], rows,
                        formats=[None, "{:.2f}", "{:.2f}", "{:.2f}", "{:.2f}"])


if __name__ == "__main__":
    sys.exit(main())
