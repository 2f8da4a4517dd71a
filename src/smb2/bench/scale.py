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

With ``--agents K`` the workers are also split over K simulated hosts (ranks
in K contiguous blocks), each with a real ``smb2-agent`` process (reaching
the servers over TCP, as the workers do), and two phases follow:

* **agent**: every rank connects to its host's agent (over shm: it is on this
  machine) and exchanges through it from now on
  (``ParameterStore.use_agent``, ``host_workers`` its host's ranks);
* **exchange_agents**: the exchange again, the same workers, through the
  agents: each host's agent gathers its workers' pulls into one and their
  pushes into one forward; a worker's exchange ends once its push is on the
  servers.

Each exchange's change is integer-valued (float32), so that what the servers
hold after it is checked against the sum of the workers' changes exactly.
Server CPU is given per phase, per worker (ms) and, for the exchange, per GB
the workers exchanged; the servers' requests and bytes (their ``stat``:
accumulates and reads, payload bytes in and out) are read around each
exchange, and the agents' CPU around each phase.  A 2-core machine shared
with other work makes these figures a loaded machine's: the JSON records
the machine and the 64-byte round trip beside them, and the load average
before and after.

    smb2 bench scale --workers 1000 --servers 2 --processes 4
    smb2 bench scale --workers 1000 --agents 125     # 8 workers per host, direct and through agents
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

from .common import add_agent_options, agent_flags, parse_with_quick, proc_cpu
from .report import plot, progress, round_trip_us, style, table, write_json

STORE = "bench-scale"
PHASES = ("connect", "open", "join", "beat", "exchange")
#: the phases that follow with --agents: each worker takes its host's agent, then exchanges through it
AGENT_PHASES = ("agent", "exchange_agents")
#: the exchange phases, in order (the first's changes are change_of(..., 0), the second's 1), and how each
#: is named in the comparison
EXCHANGES = {"exchange": "direct", "exchange_agents": "agents"}
QUICK = ["--workers", "64", "--servers", "2", "--processes", "2", "--model-bytes", str(64 << 10), "--beats", "2"]


def host_of(rank: int, workers: int, hosts: int) -> int:
    """The simulated host of ``rank``: the ranks in ``hosts`` contiguous blocks."""
    return rank * hosts // workers


def change_of(rank: int, n: int, exchange: int) -> np.ndarray:
    """Rank ``rank``'s change in exchange ``exchange`` (0, 1): ``n`` small
    integers in float32, so that any sum of them is exact."""
    return ((np.arange(n) + rank + exchange) % 4 + 1).astype(np.float32)


def expected_change(workers: int, n: int, exchange: int) -> np.ndarray:
    """The sum of every rank's :func:`change_of` (float64; exact)."""
    counts = np.bincount([(r + exchange) % 4 for r in range(workers)], minlength=4)
    return sum(c * ((np.arange(n) + k) % 4 + 1.0) for k, c in enumerate(counts))


# -- one process of simulated workers --------------------------------------------------

class Crowd:
    """The workers of one process: ranks ``first, first + step, ...`` of ``workers``."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.ranks = list(range(cfg["first"], cfg["workers"], cfg["step"]))
        self.clients: dict[int, Any] = {}
        self.stores: dict[int, Any] = {}
        #: each rank's client of its host's agent (--agents)
        self.agents: dict[int, Any] = {}

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
        out = {"opened": len(self.stores), "errors": sorted({repr(e) for e in got if e is not None})[:3]}
        if 0 in self.stores:    # where the weights lie, for the parent's check (rank 0's process alone says it)
            out.update(data_offset=self.stores[0].data_off, data_bytes=self.stores[0].layout.data_len)
        return out

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
        return await self._exchange("exchange")

    async def exchange_agents(self) -> dict[str, Any]:
        return await self._exchange("exchange_agents")

    async def _exchange(self, phase: str) -> dict[str, Any]:
        """Every rank's pull and push of exchange ``phase``; a push through an
        agent ends once the agent forwarded it to the servers."""
        n, k = self.cfg["model_bytes"] // 4, list(EXCHANGES).index(phase)

        async def one(rank: int, store: Any) -> int:
            await store.pull()
            change = np.zeros(store.flat().shape, store.layout.dtype)      # (the padding stays zero)
            change[:n] = change_of(rank, n, k)
            await store.push_region(change)
            await store.weights.flushed()
            return 2 * int(store.flat().nbytes)

        moved = await asyncio.gather(*(one(r, s) for r, s in self.stores.items()))
        return {"bytes": sum(moved), "via_agent": sum(s.weights.via == "agent" for s in self.stores.values())}

    async def agent(self) -> dict[str, Any]:
        """Every rank takes its host's agent (``use_agent``, its host's ranks as ``host_workers``)."""
        import smb2

        w, agents = self.cfg["workers"], self.cfg["agents"]
        per_host = np.bincount([host_of(r, w, len(agents)) for r in range(w)], minlength=len(agents))

        async def one(rank: int) -> bool:
            host = host_of(rank, w, len(agents))
            self.agents[rank] = await smb2.connect([agents[host]], timeout=self.cfg["connect_timeout"])
            return bool(await self.stores[rank].use_agent(self.agents[rank], timeout=self.cfg["timeout"],
                                                          host_workers=int(per_host[host])))

        got = await asyncio.gather(*(one(r) for r in self.stores), return_exceptions=True)
        return {"via_agent": sum(g is True for g in got),
                "errors": sorted({repr(e) for e in got if isinstance(e, BaseException)})[:3]}

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in (*self.agents.values(), *self.clients.values())),
                             return_exceptions=True)


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
    from ..testing.launch import AgentProcess, ServerProcess

    flags = ["--capacity", args.capacity, "--max-connections", str(args.workers + args.agents + 64),
             "--max-connections-per-host", str(args.workers + args.agents + 64), *args.server_flag]
    servers = [ServerProcess(*flags) for _ in range(args.servers)]
    agents: list[Any] = []
    crowds: list[subprocess.Popen[str]] = []
    phases = PHASES + (AGENT_PHASES if args.agents else ())
    result: dict[str, Any] = {"workers": args.workers, "servers": args.servers, "processes": args.processes,
                              "model_bytes": args.model_bytes, "beats": args.beats, "server_flags": flags,
                              "agents": args.agents, "quick": args.quick,
                              "loadavg_before": os.getloadavg(), "phases": {}, "exchange": {}}
    try:
        addresses = [s.endpoint for s in servers]
        result["round_trip_64B_us"] = asyncio.run(round_trip_us(addresses))
        if args.agents:
            # each a simulated host's: it reaches the servers over TCP, as the workers do
            result["agent_flags"] = [*agent_flags(args, addresses), "--transport", "tcp"]
            agents = [AgentProcess(*result["agent_flags"], stderr=sys.stderr) for _ in range(args.agents)]
        for i in range(args.processes):
            cfg = {"servers": addresses, "workers": args.workers, "first": i, "step": args.processes,
                   "model_bytes": args.model_bytes, "beats": args.beats, "timeout": args.timeout,
                   "connect_timeout": args.connect_timeout, "agents": [a.endpoint for a in agents]}
            crowds.append(subprocess.Popen([sys.executable, "-m", "smb2.bench.scale", "--crowd", json.dumps(cfg)],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        pids, agent_pids = [s.proc.pid for s in servers], [a.proc.pid for a in agents]
        for p in crowds:
            assert p.stdout is not None
            if not p.stdout.readline():
                raise RuntimeError(f"a process of simulated workers did not start (exit {p.wait()})")
        if not args.quiet:
            progress("scale", 0, len(phases), "phases: " + ", ".join(phases))
        region: tuple[int, int] | None = None
        for phase in phases:
            before = asyncio.run(_look(addresses, region, stat_first=False)) if phase in EXCHANGES else None
            cpu0, agent_cpu0, t0 = [proc_cpu(p) for p in pids], [proc_cpu(p) for p in agent_pids], time.monotonic()
            parts = _step(crowds, phase)
            wall = time.monotonic() - t0
            cpu = [proc_cpu(p) - c for p, c in zip(pids, cpu0)]
            row = _merge(parts)
            row.update(wall_s=round(wall, 3), server_cpu_s=[round(c, 3) for c in cpu],
                       server_rss=[s.rss for s in servers])
            if agents:
                row["agent_cpu_s"] = [round(proc_cpu(p) - c, 3) for p, c in zip(agent_pids, agent_cpu0)]
            if phase == "open" and "data_offset" in row:
                region = (row.pop("data_offset"), row.pop("data_bytes"))
            if before is not None:
                after = asyncio.run(_look(addresses, region, stat_first=True))
                result["exchange"][EXCHANGES[phase]] = exchange_figures(row, before, after, args.workers,
                                                                        args.model_bytes // 4, phase)
            result["phases"][phase] = row
            if not args.quiet:
                progress("scale", len(result["phases"]), len(phases), phase, wall=f"{wall:.2f} s",
                         **{"server CPU": f"{sum(cpu):.2f} s"})
            if row.get("errors"):
                print(f"  {phase}: {row['errors']}", file=sys.stderr)
        stats, _ = asyncio.run(_look(addresses, None, stat_first=True))
        result["server_connections"] = [s.get("connections") for s in stats]
        result["connections_refused"] = [s.get("connections_refused") for s in stats]
    finally:
        for p in crowds:
            try:
                _step([p], "exit")
            except (OSError, ValueError):
                pass
            p.wait(60)
        for a in agents:
            a.stop()
        for s in servers:
            s.stop()
    result["loadavg_after"] = os.getloadavg()
    # other programs' load makes these a loaded machine's figures: said in the result
    load = max(result["loadavg_before"][0], result["loadavg_after"][0])
    result["loaded_machine"] = load > 0.5 * (os.cpu_count() or 1)
    result["summary"] = summarize(result)
    return result


Look = tuple[list[dict[str, Any]], np.ndarray | None]


async def _look(addresses: list[str], region: tuple[int, int] | None, *, stat_first: bool) -> Look:
    """The servers' stat and (``region``: the store's data offset and bytes)
    their weights.  Before a phase the weights are read first, after it the
    stat is: so the phase's counts leave these reads out."""
    import smb2
    async with await smb2.connect(addresses, transport="tcp") as c:
        stats = await c.stat() if stat_first else None
        weights = None
        if region is not None:
            weights = np.empty(region[1] // 4, np.float32)
            await (await c.attach(STORE)).read_into(weights, region[0])
        return (stats if stats is not None else await c.stat()), weights


def _stat_sum(stats: list[dict[str, Any]], key: str) -> int:
    """A stat counter over the servers: ``bytes_in``, ``bytes_out``, or an op's requests (every transport)."""
    return sum(s.get(key, 0) if key.startswith("bytes") else sum(t.get(key, 0) for t in s["ops"].values())
               for s in stats)


def exchange_figures(row: dict[str, Any], before: Look, after: Look, workers: int, n: int,
                     phase: str) -> dict[str, Any]:
    """One exchange phase (of :data:`EXCHANGES`) as the servers saw it: their
    CPU (all, and per GB the workers exchanged), their requests and payload
    bytes (read from their stat around the phase: the workers' control words
    included, which every worker still sends itself), the agents' CPU, and
    whether the servers' weights moved by the sum of the workers' changes
    exactly."""
    cpu, moved = sum(row["server_cpu_s"]), row.get("bytes", 0)
    out: dict[str, Any] = {
        "wall_s": row["wall_s"], "server_cpu_s": round(cpu, 3),
        "server_cpu_s_per_GB": round(cpu / (moved / 1e9), 3) if moved else None,
        **{key: _stat_sum(after[0], op) - _stat_sum(before[0], op)
           for key, op in (("accumulate_requests", "accumulate"), ("read_requests", "read"),
                           ("server_bytes_in", "bytes_in"), ("server_bytes_out", "bytes_out"))},
        "agent_cpu_s": round(sum(row["agent_cpu_s"]), 3) if "agent_cpu_s" in row else None,
        "via_agent": row.get("via_agent", 0)}
    if before[1] is not None and after[1] is not None:
        want = np.zeros(before[1].size)
        want[:n] = expected_change(workers, n, list(EXCHANGES).index(phase))
        got = after[1].astype(np.float64) - before[1]
        out.update(servers_change_sum=float(got.sum()), expected_change_sum=float(want.sum()),
                   servers_change_exact=bool(np.array_equal(got, want)))
    return out


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
        **({"agents_fewer": agents_fewer(result["exchange"])} if len(result["exchange"]) == 2 else {}),
    }


#: the exchange's figures compared with and without agents
COMPARED = ("accumulate_requests", "read_requests", "server_bytes_in", "server_bytes_out", "server_cpu_s")


def agents_fewer(exchange: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Each of :data:`COMPARED`, direct over agents (above 1: the agents saved it)."""
    d, g = exchange["direct"], exchange["agents"]
    return {k: round(d[k] / g[k], 3) if g[k] else None for k in COMPARED}


def format_table(result: dict[str, Any]) -> str:
    w = result["workers"]
    rows = []
    for name, v in result["phases"].items():
        cpu = sum(v["server_cpu_s"])
        rows.append([name, v["wall_s"], round(cpu, 3), round(1000 * cpu / w, 3),
                     round(max(v["server_rss"]) / 1e6, 1), len(v.get("errors", []))])
    return table(["phase", "wall s", "server CPU s", "CPU ms/worker", "server RSS MB (max)", "errors"], rows)


def exchange_table(result: dict[str, Any]) -> str:
    """The exchange as the servers saw it, direct and (--agents) through the agents."""
    mb = result["model_bytes"]
    rows = [[config, e["server_cpu_s"], e["server_cpu_s_per_GB"], e["accumulate_requests"], e["read_requests"],
             e["server_bytes_in"] / mb, e["server_bytes_out"] / mb, e["agent_cpu_s"],
             {True: "yes", False: "NO"}.get(e.get("servers_change_exact"), "-")]
            for config, e in result["exchange"].items()]
    return table(["exchange", "server CPU s", "server CPU s/GB", "accumulates", "reads", "in (models)",
                  "out (models)", "agent CPU s", "exact sum"], rows,
                 formats=[None, "{:.3f}", "{:.3f}", None, None, "{:.2f}", "{:.2f}", "{:.3f}", None])


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
                   help="one more smb2-server flag (repeatable; the connection caps are raised to W + K + 64)")
    p.add_argument("--timeout", type=float, default=600.0, help="open and join timeout, s (default 600)")
    p.add_argument("--connect-timeout", type=float, default=30.0, help="each connect's timeout, s (default 30)")
    p.add_argument("--agents", type=int, default=0, metavar="K",
                   help="also split the workers over K simulated hosts, each with an smb2-agent, and exchange "
                        "again through them (default 0: no agents)")
    add_agent_options(p)
    p.add_argument("--json", default=str(Path("bench-results") / "scale.json"), help="where to write JSON")
    p.add_argument("--png", default=None, help="draw server CPU per worker by phase here (PNG)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--crowd", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_with_quick(_parser(), argv, QUICK, "every phase (and with --agents the agents' phases)")
    if args.crowd:
        return crowd_main(args.crowd)
    for what in ("workers", "servers", "processes", "model_bytes", "beats"):
        if getattr(args, what) < 1:
            print(f"smb2 bench scale: --{what.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if not 0 <= args.agents <= args.workers:
        print("smb2 bench scale: --agents must be 0 or more, and at most --workers", file=sys.stderr)
        return 2
    args.processes = min(args.processes, args.workers)
    if not args.quiet:
        print(f"scale: {args.workers} workers in {args.processes} processes, {args.servers} servers, "
              f"model {args.model_bytes} bytes" + (f", {args.agents} hosts with agents" if args.agents else ""),
              file=sys.stderr)
    result = run(args)
    print(format_table(result))
    print()
    print(exchange_table(result))
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
