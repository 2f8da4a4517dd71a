"""Scale: what W workers of one job cost N memory servers, simulated on this machine.

Each simulated worker is one smb2 client (a TCP connection to every server)
and one ``ParameterStore`` rank; many of them share an event loop in one
process, and ``--processes`` such processes run side by side against ``--servers``
real ``smb2-server`` processes.  The parent steps every process through the
phases together and reads the servers' CPU time (``/proc/PID/stat``) and
resident memory around each phase:

* **connect**: every worker connects at once (the connect storm): how many got
  in, how many were refused, the slowest connect;
* **open**: rank 0 opens the store (rule ``delta``), the others attach to its run;
* **join**: every rank enters the start barrier at once; the time until the
  last one passed, and the barrier's polls (each reads one 64-byte line);
* **beat**: ``--beats`` rounds of a forced heartbeat and a version read by
  every rank (the control plane while training);
* **exchange**: every rank pulls the model and pushes one change of it (one
  step of ``delta``: ``2 * model`` bytes per worker, ``W / N`` model shares
  per server and direction).

Server CPU is given per phase, per worker (ms) and, for the exchange, per GB
moved.  A 2-core machine shared with other work makes these figures a
loaded machine's: the JSON records the machine and the 64-byte round trip
beside them, and the load average before and after.

    smb2 bench scale --workers 1000 --servers 2 --processes 4
    smb2 bench scale --quick            # W=64 over 2 servers: what the test runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .common import proc_cpu
from .report import plot, progress, round_trip_us, style, table, write_json

STORE = "bench-scale"
PHASES = ("connect", "open", "join", "beat", "exchange")


# -- one process of simulated workers --------------------------------------------------

class Crowd:
    """The workers of one process: ranks ``first, first + step, ...`` of ``workers``."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.ranks = list(range(cfg["first"], cfg["workers"], cfg["step"]))
        self.clients: dict[int, Any] = {}
        self.stores: dict[int, Any] = {}

    async def run(self, phase: str) -> dict[str, Any]:
        t0 = time.monotonic()
        out: dict[str, Any] = await getattr(self, phase)()
        out["wall_s"] = time.monotonic() - t0
        return out

    async def connect(self) -> dict[str, Any]:
        import smb2

        async def one(rank: int) -> float:
            t = time.monotonic()
            self.clients[rank] = await smb2.connect(self.cfg["servers"], transport="tcp",
                                                    timeout=self.cfg["connect_timeout"])
            return time.monotonic() - t

        got = await asyncio.gather(*(one(r) for r in self.ranks), return_exceptions=True)
        errors = [f"{type(e).__name__}: {e}" for e in got if isinstance(e, BaseException)]
        return {"connected": len(self.clients), "refused": len(errors), "errors": sorted(set(errors))[:3],
                "slowest_connect_s": max((t for t in got if isinstance(t, float)), default=0.0)}

    async def open(self) -> dict[str, Any]:
        from ..train import ParameterStore

        n = self.cfg["model_bytes"] // 4
        params = {"w": np.zeros(n, np.float32)}

        async def one(rank: int) -> None:
            self.stores[rank] = await ParameterStore.open(
                self.clients[rank], STORE, params, rule="delta", workers=self.cfg["workers"], rank=rank,
                resume=False, timeout=self.cfg["timeout"])

        got = await asyncio.gather(*(one(r) for r in self.clients), return_exceptions=True)
        return {"opened": len(self.stores), "errors": sorted({repr(e) for e in got if e is not None})[:3]}

    async def join(self) -> dict[str, Any]:
        t0 = time.monotonic()
        await asyncio.gather(*(s.join(timeout=self.cfg["timeout"]) for s in self.stores.values()))
        return {"joined_after_s": time.monotonic() - t0,
                "polls": sum(s.stats.get("barrier_polls", 0) for s in self.stores.values()),
                "full_reads": sum(s.stats.get("barrier_full_reads", 0) for s in self.stores.values())}

    async def beat(self) -> dict[str, Any]:
        for k in range(self.cfg["beats"]):
            await asyncio.gather(*(s.heartbeat(k + 1, force=True) for s in self.stores.values()),
                                 *(s.read_version() for s in self.stores.values()))
        return {"beats": self.cfg["beats"] * len(self.stores)}

    async def exchange(self) -> dict[str, Any]:
        async def one(store: Any) -> int:
            await store.pull()
            change = np.full(store.flat().shape, 1e-3, store.layout.dtype)
            await store.push_region(change)
            return 2 * int(store.flat().nbytes)

        moved = await asyncio.gather(*(one(s) for s in self.stores.values()))
        return {"bytes": sum(moved)}

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients.values()), return_exceptions=True)


async def _crowd_main(cfg: dict[str, Any]) -> None:
    crowd = Crowd(cfg)
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    import smb2.train  # noqa: F401 (imported before the first phase, whose time it is not)
    print(json.dumps({"ready": True}), flush=True)
    try:
        while (line := (await reader.readline()).decode().strip()) and line != "exit":
            try:
                result = await crowd.run(line)
            except Exception as exc:        # the parent reports it beside the phase
                result = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(result), flush=True)
    finally:
        await crowd.close()


def crowd_main(cfg_json: str) -> int:
    """A process of simulated workers (started by :func:`main`): runs the
    phases named on stdin, one JSON line of results each on stdout."""
    import uvloop
    uvloop.run(_crowd_main(json.loads(cfg_json)))
    return 0


# -- the parent --------------------------------------------------------------------------

def _step(crowds: list[subprocess.Popen[str]], phase: str) -> list[dict[str, Any]]:
    for p in crowds:
        assert p.stdin is not None
        p.stdin.write(phase + "\n")
        p.stdin.flush()
    out = []
    for p in crowds:
        assert p.stdout is not None
        line = p.stdout.readline()
        out.append(json.loads(line) if line else {"error": f"the process exited ({p.poll()})"})
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ..testing.launch import ServerProcess

    flags = ["--capacity", args.capacity, "--max-connections", str(args.workers + 64),
             "--max-connections-per-host", str(args.workers + 64), *args.server_flag]
    servers = [ServerProcess(*flags) for _ in range(args.servers)]
    crowds: list[subprocess.Popen[str]] = []
    result: dict[str, Any] = {"workers": args.workers, "servers": args.servers, "processes": args.processes,
                              "model_bytes": args.model_bytes, "beats": args.beats, "server_flags": flags,
                              "loadavg_before": os.getloadavg(), "phases": {}}
    try:
        addresses = [s.endpoint for s in servers]
        result["round_trip_64B_us"] = asyncio.run(round_trip_us(addresses))
        for i in range(args.processes):
            cfg = {"servers": addresses, "workers": args.workers, "first": i, "step": args.processes,
                   "model_bytes": args.model_bytes, "beats": args.beats, "timeout": args.timeout,
                   "connect_timeout": args.connect_timeout}
            crowds.append(subprocess.Popen([sys.executable, "-m", "smb2.bench.scale", "--crowd", json.dumps(cfg)],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        pids = [s.proc.pid for s in servers]
        for p in crowds:
            assert p.stdout is not None
            if not p.stdout.readline():
                raise RuntimeError(f"a process of simulated workers did not start (exit {p.wait()})")
        if not args.quiet:
            progress("scale", 0, len(PHASES), "phases: " + ", ".join(PHASES))
        for phase in PHASES:
            cpu0, t0 = [proc_cpu(p) for p in pids], time.monotonic()
            parts = _step(crowds, phase)
            wall = time.monotonic() - t0
            cpu = [proc_cpu(p) - c for p, c in zip(pids, cpu0)]
            row = _merge(parts)
            row.update(wall_s=round(wall, 3), server_cpu_s=[round(c, 3) for c in cpu],
                       server_rss=[s.rss for s in servers])
            result["phases"][phase] = row
            if not args.quiet:
                progress("scale", len(result["phases"]), len(PHASES), phase, wall=f"{wall:.2f} s",
                         **{"server CPU": f"{sum(cpu):.2f} s"})
            if row.get("errors"):
                print(f"  {phase}: {row['errors']}", file=sys.stderr)
        stats = asyncio.run(_server_stats(addresses))
        result["server_connections"] = [s.get("connections") for s in stats]
        result["connections_refused"] = [s.get("connections_refused") for s in stats]
    finally:
        for p in crowds:
            try:
                _step([p], "exit")
            except (OSError, ValueError):
                pass
            p.wait(60)
        for s in servers:
            s.stop()
    result["loadavg_after"] = os.getloadavg()
    # other programs' load makes these a loaded machine's figures: said in the result
    load = max(result["loadavg_before"][0], result["loadavg_after"][0])
    result["loaded_machine"] = load > 0.5 * (os.cpu_count() or 1)
    result["summary"] = summarize(result)
    return result


async def _server_stats(addresses: list[str]) -> list[dict[str, Any]]:
    import smb2
    async with await smb2.connect(addresses, transport="tcp") as c:
        return await c.stat()


def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The processes' results of one phase as one: counts added, times' maximum."""
    out: dict[str, Any] = {"errors": []}
    for part in parts:
        for k, v in part.items():
            if k in ("errors", "error"):
                out["errors"] += v if isinstance(v, list) else [v]
            elif k.endswith("_s"):
                out[k] = round(max(out.get(k, 0.0), v), 4)
            elif isinstance(v, (int, float)):
                out[k] = out.get(k, 0) + v
    return out


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Per-operation figures from the phases: server CPU per worker and per
    byte, the barrier's time and bytes per poll."""
    ph = result["phases"]
    w = result["workers"]
    cpu = {k: sum(v["server_cpu_s"]) for k, v in ph.items()}
    moved = ph["exchange"].get("bytes", 0)
    return {
        "connected": ph["connect"].get("connected", 0),
        "refused": ph["connect"].get("refused", 0),
        "slowest_connect_s": ph["connect"].get("slowest_connect_s"),
        "join_after_last_open_s": ph["join"].get("joined_after_s"),
        "barrier_polls": ph["join"].get("polls", 0),
        "barrier_full_reads": ph["join"].get("full_reads", 0),
        "server_cpu_ms_per_worker": {k: round(1000 * c / w, 3) for k, c in cpu.items()},
        "server_cpu_ms_per_beat": round(1000 * cpu["beat"] / max(1, ph["beat"].get("beats", 0)), 4),
        "server_cpu_s_per_GB_exchanged": round(cpu["exchange"] / (moved / 1e9), 3) if moved else None,
        "exchange_GBps_all_servers": round(moved / 1e9 / ph["exchange"]["wall_s"], 3) if moved else None,
        "server_rss_max": max(max(v["server_rss"]) for v in ph.values()),
    }


def format_table(result: dict[str, Any]) -> str:
    w = result["workers"]
    rows = []
    for name, v in result["phases"].items():
        cpu = sum(v["server_cpu_s"])
        rows.append([name, v["wall_s"], round(cpu, 3), round(1000 * cpu / w, 3),
                     round(max(v["server_rss"]) / 1e6, 1), len(v.get("errors", []))])
    return table(["phase", "wall s", "server CPU s", "CPU ms/worker", "server RSS MB (max)", "errors"], rows)


def summary_table(summary: dict[str, Any]) -> str:
    """The run's summary, one figure a line (a phase's figures under its name)."""
    rows: list[list[Any]] = []
    for key, value in summary.items():
        if isinstance(value, dict):
            rows += [[f"{key} ({sub})", v] for sub, v in value.items()]
        else:
            rows.append([key, value])
    return table(["summary", ""], rows)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="smb2 bench scale", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=256, help="simulated workers, W (default 256)")
    p.add_argument("--servers", type=int, default=2, help="smb2-server processes, N (default 2)")
    p.add_argument("--processes", type=int, default=4, help="processes the workers are spread over (default 4)")
    p.add_argument("--model-bytes", type=int, default=256 << 10, help="the model's bytes (default 256 KiB)")
    p.add_argument("--beats", type=int, default=4, help="heartbeat rounds of the beat phase (default 4)")
    p.add_argument("--capacity", default="4GiB", help="each server's --capacity (default 4GiB)")
    p.add_argument("--server-flag", action="append", default=[],
                   help="one more smb2-server flag (repeatable; the connection caps are raised to W + 64)")
    p.add_argument("--timeout", type=float, default=600.0, help="open and join timeout, s (default 600)")
    p.add_argument("--connect-timeout", type=float, default=30.0, help="each connect's timeout, s (default 30)")
    p.add_argument("--quick", action="store_true", help="W=64 over 2 servers in 2 processes, a 64 KiB model")
    p.add_argument("--json", default=str(Path("bench-results") / "scale.json"), help="where to write JSON")
    p.add_argument("--png", default=None, help="draw server CPU per worker by phase here (PNG)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--crowd", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.crowd:
        return crowd_main(args.crowd)
    if args.quick:
        args.workers, args.servers, args.processes, args.model_bytes, args.beats = 64, 2, 2, 64 << 10, 2
    for what in ("workers", "servers", "processes", "model_bytes", "beats"):
        if getattr(args, what) < 1:
            print(f"smb2 bench scale: --{what.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    args.processes = min(args.processes, args.workers)
    if not args.quiet:
        print(f"scale: {args.workers} workers in {args.processes} processes, {args.servers} servers, "
              f"model {args.model_bytes} bytes", file=sys.stderr)
    result = run(args)
    print(format_table(result))
    if result["loaded_machine"]:
        print(f"(a loaded machine: load average {result['loadavg_before'][0]:.1f} before, "
              f"{result['loadavg_after'][0]:.1f} after, on {os.cpu_count()} cores)")
    print()
    print(summary_table(result["summary"]))
    write_json(args.json, result, round_trip_64B_us=result["round_trip_64B_us"], quiet=args.quiet)
    if args.png:
        why = plot(args.png, lambda plt: _draw(plt, result))
        if why:
            print(why, file=sys.stderr)
    return 0


def _draw(plt: Any, result: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    per = result["summary"]["server_cpu_ms_per_worker"]
    ax.bar(list(per), list(per.values()))
    style(ax, title=f"{result['workers']} workers, {result['servers']} servers", xlabel="phase",
          ylabel="server CPU ms per worker", legend=False)
    return fig


if __name__ == "__main__":
    sys.exit(main())
