"""Host agents on a job of several workers per host: the bytes on the servers' links and the time to
accuracy with one ``smb2-agent`` per worker host, against none, in the same run.

The simulated cluster is tta's (smb2/bench/tta.py): every host is a network namespace behind a veth
link rate limited by ``tc tbf`` in both directions (``--rate``, the same for every link), N memory
server hosts (``--servers``, default 2; smb2-server with ``--shm off``: the namespaces share this
kernel, and a worker that mapped a server's memory would bypass the links) and H worker hosts
(``--hosts``, default 2) with K workers each (``--workers-per-host``, default 4), the K processes of
a host in its one namespace, behind its one link.  (The links have no propagation delay: netem is
not in every kernel, this machine's among them; tbf's queue, up to 5 ms, is all the delay there is.)

The task is tta's classifier (a fixed random teacher labels Gaussian inputs; an MLP learns it:
full 16-1024-1024-10, 1.07 M parameters, 4.3 MB; --quick 64-128-10), trained by
``smb2.torch.AsyncOptimizer`` with each of ``--systems`` (tta's names: ``diloco``, H = 8, and
``delta/stable``, rule delta at staleness 1), in two configurations, one after the other on the
same hosts and servers:

* ``direct``: every worker reaches the memory servers itself (no agent);
* ``agents``: one ``smb2-agent`` per worker host, started in that host's namespace (``--servers``
  the server hosts, ``--listen 127.0.0.1:7430``), and every worker of the host given
  ``SMB2_AGENT=127.0.0.1:7430``, which AsyncOptimizer reads: the workers exchange the weights
  through their host's agent (over shm: the agent and its workers are on one host, so shm is what a
  real host would use), the agent forwards their combined pushes as one and pulls once for all the
  asks that come together, and diloco's shares of its outer momentum step (its pending
  pseudo-gradients, ``B``) likewise.  What does not go through the agent still goes to the servers
  from each worker: the control words (version, barrier, heartbeats) and the outer momentum step's
  read and write of ``M | B`` (once per W pseudo-gradients, by the worker whose push completes them).

Scenarios (``--scenario``; the link rate is ``--rate``'s in each): ``homogeneous`` (the default),
``straggler`` (tta's: the last rank, on the last worker host, sleeps after every step as long as that
step's computing took, so it is 2x slower) and ``overloaded`` (the straggler, and one busy process,
``while True: pass``, in each worker host's namespace, unpinned, as tta's (d) has them).  tta's
comm-bound case is the default rate (200 Mbit/s); its homogeneous case is ``--rate 1gbit``.

How to read it.  Each worker reads the byte counters (both directions) of every server host's and
every worker host's link at the start of its training (after the start barrier, and with agents
after its mirror is ready) and at its end; a link's bytes for one system and configuration are its
counter at the last worker's end less its counter at the first worker's start, and "per step" divides
them by the steps all workers took.  "x fewer" is the direct configuration's bytes per step over the
agents': with K workers per host it is at most K for a rule whose whole exchange is the weights (delta:
a push and a pull of the float32 weights each step), reached where the host's workers ask during one
another's transfers (a link-bound job); at most about 2.6 for diloco at K = 4 and W = 8, whose
momentum step (read ``M | B`` in float32, write both and the weights' part in bfloat16, once per 8
pseudo-gradients) still goes from one worker (the agent forwards the pushes in the rule's wire type,
bfloat16, as a direct push). "to tgt" is rank 0's time to the target accuracy on
its own model (tta's clock: evaluation left out); "final" the delivered model's accuracy (the shared
weights, read after every worker finished) on a test set drawn apart; "via" what each worker's
``stats()["via"]`` said ("agent" for every worker of the agents' configuration, or one lost its agent),
and how it reached the agent (``shm``, else ``tcp``). With agents, a row's ``agent_counts`` are each
host's agent's mirror cycles, forwards and pulls at the end of the configuration (of every system it
trained: run one system to read them against its ``exchanges_per_host``, the workers' pushes of a
round each). The JSON has every worker's figures, the machine
and the 64-byte loopback round trip measured before each configuration.

    smb2 bench agents [--quick] [--servers 2] [--hosts 2] [--workers-per-host 4] [--rate 200mbit]
        [--scenario homogeneous|straggler|overloaded] [--systems diloco,delta/stable] [--budget 120]
        [--stop budget|target] [--json out.json]

Needs root, ``ip netns`` and ``tc``; otherwise it says why and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import smb2.testing.netns as netns_cluster
from smb2.mirror import AGENT_ENV, DEFAULT_AGENT_PORT
from smb2.testing.launch import agent_command, agent_ready_address
from smb2.train.store import AGENT_RULES

from . import report, tta
from .common import add_agent_options, agent_flags, parse_with_quick

#: the configurations, in the order they run
CONFIGS = ("direct", "agents")
#: the update rules an agent serves: the systems of tta this benchmark takes
SYSTEMS = ("diloco", tta.ASYNC_PORT)
#: what else the hosts do (tta's scenarios of that name; the link rate is --rate's in each)
SCENARIOS = ("homogeneous", "straggler", "overloaded")
#: the full run's task: an MLP of 4.3 MB, which a step computes in tens of ms on one core and a
#: 200 Mbit/s link moves in 0.17 s, so the exchange, not the computing, is what the links decide
FULL_SIZES = [16, 1024, 1024, 10]
QUICK = ["--sizes", "[64,128,10]", "--target", "0.5", "--budget", "40", "--stop", "target", "--eval-every", "10",
         "--eval-n", "256", "--final-n", "1024"]


# ---------------------------------------------------------------------------------------------
# The driver


def start_agents(cluster: netns_cluster.NetnsCluster, hosts: list[int], servers: list[str], a: argparse.Namespace,
                 logs: Path) -> list[subprocess.Popen]:
    """One smb2-agent in each of ``hosts``' namespaces, for the memory servers ``servers``; waits
    for their ready lines."""
    flags = agent_flags(a, servers)
    procs = []
    for h in hosts:
        with open(logs / f"agent-{h}.log", "ab") as err:
            procs.append(subprocess.Popen(
                cluster.exec_prefix(cluster.server_netns[h])
                + agent_command(*flags, listen=f"127.0.0.1:{DEFAULT_AGENT_PORT}"),
                stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                preexec_fn=netns_cluster.die_with_parent))
    for h, p in zip(hosts, procs):
        assert p.stdout is not None
        line = p.stdout.readline()
        if agent_ready_address(line) is None:
            stop(procs)
            raise RuntimeError(f"smb2-agent on host {cluster.server_addrs[h]} did not start (exit {p.poll()}): "
                               f"{line!r}\n{(logs / f'agent-{h}.log').read_text()[-2000:]}")
    return procs


def agent_counts(cluster: netns_cluster.NetnsCluster, hosts: list[int]) -> list[dict[str, int] | None]:
    """Each host's agent's mirror cycles, forwards and pulls so far (``smb2 stat`` of it, run in the
    host's namespace; None where it did not answer)."""
    counts: list[dict[str, int] | None] = []
    for h in hosts:
        got = subprocess.run(cluster.exec_prefix(cluster.server_netns[h])
                             + [sys.executable, "-m", "smb2.cli", "stat", f"127.0.0.1:{DEFAULT_AGENT_PORT}"],
                             capture_output=True, text=True, timeout=60)
        try:
            agent = json.loads(got.stdout)["agent"]
            counts.append({k: int(agent[k]) for k in ("cycles", "forwards", "pulls")})
        except (ValueError, KeyError, TypeError):
            counts.append(None)
    return counts


def stop(procs: list[subprocess.Popen], timeout: float = 10.0) -> None:
    """SIGTERM (an agent forwards what its workers pushed, then stops), SIGKILL after ``timeout``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_config(cluster: netns_cluster.NetnsCluster, a: argparse.Namespace, cfg: dict[str, Any], config: str,
               servers: list[str], logs: Path) -> list[dict[str, Any]]:
    """Every system of ``a.systems`` in turn, in one configuration (``direct`` or ``agents``): one
    worker process per rank, K of them in each worker host's namespace; a row per system."""
    hosts = list(range(a.servers, a.servers + a.hosts))
    world = a.hosts * a.workers_per_host
    stop_file = Path(tempfile.gettempdir()) / f"bench-agents-{os.getpid()}-{config}.stop"
    # every worker reads every host's link, the servers' and the worker hosts' (see the module's doc)
    watch = cluster.server_netns[:a.servers + a.hosts]
    common = tta.worker_args(cfg, a.systems, config, servers, master=cluster.server_addrs[hosts[0]], world=world,
                             stop_file=stop_file, replicas=1, wait_all=a.budget + 120)
    common += ["--budget", str(a.budget), "--watch", ",".join(watch)]
    if a.scenario in ("straggler", "overloaded"):
        common.append("--straggler")            # the last rank, on the last worker host
    env = {k: v for k, v in os.environ.items() if k != AGENT_ENV}
    env.update(tta.ONE_THREAD)
    if config == "agents":
        env[AGENT_ENV] = f"127.0.0.1:{DEFAULT_AGENT_PORT}"      # the agent of the worker's own host
        env["LOCAL_WORLD_SIZE"] = str(a.workers_per_host)       # as torchrun on the host would say
    agents = start_agents(cluster, hosts, servers, a, logs) if config == "agents" else []
    # overloaded: one busy process in each worker host's namespace, unpinned (as tta's (d))
    hogs = tta.start_hogs(cluster, hosts) if a.scenario == "overloaded" else []
    procs: list[tuple[subprocess.Popen, Path]] = []
    counts: list[dict[str, int] | None] | None = None
    try:
        for r in range(world):
            h = hosts[r // a.workers_per_host]
            out = logs / f"{config}-rank{r}.out"
            with open(out, "wb") as stdout, open(logs / f"{config}-rank{r}.err", "wb") as stderr:
                procs.append((subprocess.Popen(
                    cluster.exec_prefix(cluster.server_netns[h])
                    + [sys.executable, "-m", "smb2.bench.tta", "_worker", "--rank", str(r),
                       "--host-addr", cluster.server_addrs[h], *common],
                    stdout=stdout, stderr=stderr, env=env, preexec_fn=netns_cluster.die_with_parent), out))
        wait_for(procs, len(a.systems) * (a.budget + 300), config, logs)
        outs = [[json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
                for _, out in procs]
        counts = agent_counts(cluster, hosts) if agents else None
    finally:
        for p in [p for p, _ in procs] + hogs:
            if p.poll() is None:
                p.kill()
                p.wait()
        stop(agents)
        for path in stop_file.parent.glob(f"{stop_file.name}*"):
            path.unlink(missing_ok=True)
    rows = [summarize([o[n] for o in outs], system, config, cfg, watch[:a.servers], watch[a.servers:])
            for n, system in enumerate(a.systems)]
    for row in rows:
        # (the agents serve every system of the configuration in turn: their counts are of them all)
        row["agent_counts"] = counts
        row["exchanges_per_host"] = [sum(row["exchanges_per_worker"][h * a.workers_per_host:
                                                                     (h + 1) * a.workers_per_host])
                                     for h in range(a.hosts)]
    return rows


def wait_for(procs: list[tuple[subprocess.Popen, Path]], timeout: float, config: str, logs: Path) -> None:
    """Until every worker exited; RuntimeError with the stderr of the first that failed (the others
    then wait at a barrier for it, and would fail later for its sake)."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p, _ in procs):
        if any(p.returncode for p, _ in procs):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the workers ({config}) did not finish within {timeout:.0f} s")
        time.sleep(0.2)
    failed = [r for r, (p, _) in enumerate(procs) if p.returncode]
    if failed:
        r = failed[0]
        raise RuntimeError(f"worker rank {r} ({config}) failed (exit {procs[r][0].returncode}):\n"
                           f"{(logs / f'{config}-rank{r}.err').read_text()[-3000:]}")


def window_bytes(outs: list[dict[str, Any]], netns: str) -> int:
    """Bytes on host ``netns``'s link from the first worker's start to the last one's end (the
    counters only grow: the least start reading and the greatest end reading)."""
    return max(o["watched_links"][netns][1] for o in outs) - min(o["watched_links"][netns][0] for o in outs)


def summarize(outs: list[dict[str, Any]], system: str, config: str, cfg: dict[str, Any], server_netns: list[str],
              host_netns: list[str]) -> dict[str, Any]:
    """One system's row in one configuration: tta's row (rank 0's curve and time to target, the
    delivered model's accuracy, collapsed or not), with the links' bytes per step in place of each
    worker's own (here a worker host's link is its K workers' together)."""
    row = tta.summarize(outs, system, config, cfg)
    for per_worker in ("scenario", "link_bytes_per_step", "expected_bytes_per_step", "payload_bytes_per_step"):
        row.pop(per_worker, None)
    steps = sum(o["steps"] for o in outs)
    row.update(config=config, rule=tta.rule_of(tta.spec_of(system) or {}),
               server_link_bytes_per_step=[window_bytes(outs, ns) / steps for ns in server_netns],
               host_link_bytes_per_step=[window_bytes(outs, ns) / steps for ns in host_netns],
               via=[o.get("via") for o in outs], agent_transport=[o.get("agent_transport") for o in outs],
               stragglers=[o["straggler"] for o in outs],
               steps_per_worker=[o["steps"] for o in outs],
               exchanges_per_worker=[o.get("exchanges", 0) for o in outs])
    return row


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per system, the agents against none: each server link's bytes per step, direct over agents
    ("x fewer"), the worker hosts' likewise, the time to target (direct's over the agents': above 1
    the agents reached it sooner) and the final accuracies."""
    out = []
    for system in dict.fromkeys(r["system"] for r in rows):
        d, g = ({r["config"]: r for r in rows if r["system"] == system}[c] for c in CONFIGS)

        def fewer(key: str, d: dict[str, Any] = d, g: dict[str, Any] = g) -> list[float | None]:
            return [x / y if y else None for x, y in zip(d[key], g[key])]

        td, tg = d["time_to_target_s"], g["time_to_target_s"]
        out.append({"system": system, "rule": d["rule"],
                    "server_link_fewer": fewer("server_link_bytes_per_step"),
                    "host_link_fewer": fewer("host_link_bytes_per_step"),
                    "server_bytes_per_step": {c: sum(r["server_link_bytes_per_step"]) for c, r in zip(CONFIGS, (d, g))},
                    "time_to_target_s": {"direct": td, "agents": tg},
                    "sooner": td / tg if td and tg else None,
                    "final": {"direct": d["final"], "agents": g["final"]},
                    "final_vs_direct": 100 * (g["final"] - d["final"]),
                    "via": sorted(set(map(str, g["via"])))})
    return out


def run(a: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = {"task": "mlp", "sizes": json.loads(a.sizes), "batch": a.batch, "lr": a.lr,
                           "target": a.target, "eval_every": a.eval_every, "eval_n": a.eval_n,
                           "final_n": a.final_n, "stop": a.stop,
                           "servers": a.servers, "hosts": a.hosts, "workers_per_host": a.workers_per_host,
                           "rate": a.rate, "scenario": a.scenario, "budget_s": a.budget,
                           "agent_period_s": a.agent_period, "agent_gather_s": a.agent_gather,
                           "systems": a.systems, "quick": a.quick}
    result: dict[str, Any] = {"config": cfg, "rows": [], "rtt_us": {}}
    report.progress("agents", 0, len(CONFIGS), f"{', '.join(a.systems)} on {a.hosts} hosts x {a.workers_per_host} "
                    f"workers, {a.servers} servers, {a.rate} links, {a.scenario}")
    with netns_cluster.NetnsCluster(servers=a.servers + a.hosts, rate=a.rate, start_servers=False,
                                    quiet=True) as cluster, tempfile.TemporaryDirectory(prefix="bench-agents-") as tmp:
        servers = [f"{cluster.server_addrs[i]}:{tta.SERVER_PORT}" for i in range(a.servers)]
        procs = tta.start_servers(cluster, list(range(a.servers)), a.capacity)
        try:
            for n, config in enumerate(CONFIGS):
                # the machine's round trip before each configuration: its slow mode moves every figure
                rtt = result["rtt_us"][config] = tta.loopback_rtt_us()
                for row in run_config(cluster, a, cfg, config, servers, Path(tmp)):
                    row["rtt_us"] = rtt
                    result["rows"].append(row)
                report.progress("agents", n + 1, len(CONFIGS), f"{config} (loopback 64 B round trip {rtt:.0f} µs)")
        finally:
            stop(procs)
    result["summary"] = compare(result["rows"])
    return result


# ---------------------------------------------------------------------------------------------
# Output


def _kb(values: list[float]) -> str:
    return " / ".join(f"{v / 1e3:.1f}" for v in values)


def _ratios(values: list[float | None]) -> str:
    return " / ".join("-" if v is None else f"{v:.2f}x" for v in values)


def table(result: dict[str, Any]) -> str:
    rows = [[r["system"], r["config"], r["workers"], r["steps"], r["time_to_target_s"] or "miss", r["final"],
             _kb(r["server_link_bytes_per_step"]), _kb(r["host_link_bytes_per_step"]),
             ", ".join(sorted(set(map(str, r["via"])))),
             ", ".join(sorted({"/".join(t) for t in r["agent_transport"] if t})) or "-"]
            for r in result["rows"]]
    parts = [report.table(["system", "config", "workers", "steps", "to tgt s", "final", "server links kB/step",
                           "host links kB/step", "via", "to agent"], rows,
                          formats=[None, None, None, None, "{:.1f}", "{:.3f}"])]
    parts += ["", report.table(
        ["system", "server links x fewer", "host links x fewer", "to tgt s direct", "to tgt s agents", "sooner",
         "final direct", "final agents"],
        [[s["system"], _ratios(s["server_link_fewer"]), _ratios(s["host_link_fewer"]),
          s["time_to_target_s"]["direct"], s["time_to_target_s"]["agents"], s["sooner"], s["final"]["direct"],
          s["final"]["agents"]] for s in result["summary"]],
        formats=[None, None, None, "{:.1f}", "{:.1f}", "{:.2f}x", "{:.3f}", "{:.3f}"])]
    return "\n".join(parts)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="smb2 bench agents", description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", type=int, default=2, help="memory-server hosts (default 2)")
    ap.add_argument("--hosts", type=int, default=2, help="worker hosts (default 2)")
    ap.add_argument("--workers-per-host", type=int, default=4, help="workers on each worker host (default 4)")
    ap.add_argument("--rate", default="200mbit", help="every host's link rate, both directions (tc syntax; "
                                                      "default 200mbit)")
    ap.add_argument("--scenario", choices=SCENARIOS, default="homogeneous",
                    help="homogeneous; straggler: the last rank 2x slower; overloaded: the straggler and a busy "
                         "process on every worker host (default homogeneous)")
    ap.add_argument("--systems", type=lambda s: s.split(","), default=list(SYSTEMS),
                    help=f"tta's systems whose rule an agent serves, trained in turn (default {','.join(SYSTEMS)})")
    ap.add_argument("--sizes", default=str(FULL_SIZES).replace(" ", ""), help="the MLP's layer sizes (JSON)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--target", type=float, default=0.75, help="target held-out accuracy (default 0.75)")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds of training per system and "
                                                                "configuration (default 120)")
    ap.add_argument("--stop", choices=("target", "budget"), default="budget",
                    help="end a run at the target or train the whole budget (default: budget, so final "
                         "accuracies compare at equal time)")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-n", type=int, default=512)
    ap.add_argument("--final-n", type=int, default=4096)
    ap.add_argument("--capacity", default="1GiB", help="each memory server's --capacity")
    add_agent_options(ap)
    ap.add_argument("--json", default=None)
    return ap


def served(system: str) -> bool:
    """Is ``system`` one of tta's whose rule a host agent serves (not DDP's, torchft's, allreduce's)?"""
    try:
        spec = tta.spec_of(system)
    except KeyError:
        return False
    return spec is not None and "torchft" not in spec and tta.rule_of(spec) in AGENT_RULES


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    a = parse_with_quick(ap, argv, QUICK, "the same hosts, workers, links, systems and both configurations")
    not_served = [s for s in a.systems if not served(s)]
    if not_served:
        ap.error(f"no agent serves {', '.join(not_served)}: --systems takes tta's systems of the rules "
                 f"{', '.join(AGENT_RULES)}")
    if min(a.servers, a.hosts, a.workers_per_host) < 1:
        ap.error("--servers, --hosts and --workers-per-host must be at least 1")
    ok, why = netns_cluster.can_run()
    if not ok:
        print(f"smb2 bench agents: cannot build a namespace cluster here: {why}", file=sys.stderr)
        return 2
    result = run(a)
    print(table(result))
    print("loopback 64 B round trip: " + ", ".join(f"{c} {us:.0f} µs" for c, us in result["rtt_us"].items()))
    if a.json:
        report.write_json(a.json, result, quiet=True,
                          round_trip_64B_us=statistics.median(result["rtt_us"].values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
