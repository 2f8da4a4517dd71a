"""Training throughput on smb2: samples/s of a communication-heavy model.

An MLP of 12.6 M parameters (1024-4096-2048-10, float32: 50 MB) on
synthetic data, batch 32, trained by 1, 2 and 4 worker processes through a
LocalCluster of 1 and 4 memory-server processes with each update rule; and,
when torch is installed, the same model trained by torch.distributed gloo
synchronous all-reduce data parallelism in the same run.

Both sides compute with the same numpy code (smb2.train.MLP), so only the
way gradients and weights travel differs: gloo all-reduces the flat
gradient each step; smb2 pulls the weights and pushes the update through
the striped buffer (EASGD only every tau steps).

Every worker uses one BLAS thread.  Before each configuration the median
round trip of an 8-byte fetch_add to a memory server is measured and recorded beside the result
(this machine has a slow mode: see docs/design.md, "Measuring").  Figures are
ratios against baselines measured in the same run: samples/s against the
same rule with 1 worker and 1 server, and against gloo with as many workers.
"not comp" is the share of the workers' time not spent computing gradients
(smb2: pulls, pushes, waiting for locks and notifications; gloo: the
all-reduce): measured step by step inside each worker, it suffers least from
the machine's noise.

    python tools/bench_training.py [--steps 12] [--workers 1,2,4] [--servers 1,4]
        [--rules accumulate,locked,locked/layer,easgd] [--json out.json] [--png out.png]

With ``--frontend`` (the default where torch is installed) each worker
count also runs the torch front ends on a torch twin of the model (the same
layers, ``torch.nn.Linear``): torch DDP over gloo, and
``smb2.torch.AsyncOptimizer`` (rule ``delta``, staleness 0 and 1; rule
``accumulate``, which pushes each layer's gradient during backward, staleness
0 and 1; ``--frontend-configs`` picks some) against the first server count;
their "x gloo" column is against that DDP run, and
"not comp" is the share of the training thread's time spent waiting on
communication (AsyncOptimizer's own measure; for DDP, whose all-reduce hides
inside backward, 1 - the time of the same steps under ``no_sync()`` over
the time of the synchronized ones).

``--transports shm,tcp`` runs every smb2 configuration (and the
AsyncOptimizer rows) once per transport, chosen for the workers through
``SMB2_TRANSPORT``: the one-host rows over shared memory beside the same
rows over loopback TCP, in the same run ("via" column; default: "auto",
which is shm here).

``--against HOST:PORT,...`` runs one configuration (the first rule, the
first worker count) against servers that run elsewhere and prints its
result as one JSON line: tools/bench_scaleout.py uses it for the
samples/s column of its table, from inside its client namespace.

``--quick`` runs each kind of row once, briefly: 1 and 2 workers (so the
"x 1w1s" column and gloo's all-reduce), 1 server, the rule accumulate, one
AsyncOptimizer configuration, 2 steps.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

import smb2
from smb2.testing.ports import free_port
from smb2.train import store as train_store
from smb2.train.example import data
from smb2.train.example.job import JobConfig, run_job
from smb2.train.example.mlp import MLP

from . import report
from .common import parse_with_quick

SIZES = [1024, 4096, 2048, 10]
BATCH = 32
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
#: rows of the torch front ends (a torch twin of the model; their "x gloo" is against torch DDP)
FRONTENDS = ("torch DDP", "AsyncOptimizer")
RULES: dict[str, dict[str, Any]] = {
    "accumulate": {"rule": "accumulate"},
    "locked": {"rule": "locked"},
    "locked/layer": {"rule": "locked", "rule_options": {"per_layer": True}},
    "easgd": {"rule": "easgd", "rule_options": {"tau": 4}},
}
#: AsyncOptimizer's configurations beside DDP: its rule and staleness, as its rows name them
FRONTEND_CONFIGS = ("delta/s0", "delta/s1", "accumulate/s0", "accumulate/s1")
#: the store AsyncOptimizer's runs train, removed after each
FRONTEND_STORE = "bench-torch"
#: --quick: every kind of row (gloo, smb2, DDP, AsyncOptimizer) once, with 1 and 2 workers
QUICK = ["--steps", "2", "--workers", "1,2", "--servers", "1", "--rules", "accumulate",
         "--frontend-configs", "delta/s1"]


def _via(transport: str) -> dict[str, str]:
    """The workers' environment for ``transport`` ("auto": none)."""
    return {} if transport == "auto" else {"SMB2_TRANSPORT": transport}


async def smb2_run(label: str, workers: int, servers: list[str], steps: int, path: Path,
                   transport: str = "auto") -> dict[str, Any]:
    spec = dict(RULES[label])
    cfg = JobConfig(rule=spec.pop("rule"), lr=0.01, batch=BATCH, sizes=SIZES, workers=workers, steps=steps,
                    report_every=1, policy="average", **spec)
    res = await run_job(cfg, servers, path, name="bench", env={**ONE_THREAD, **_via(transport)}, timeout=900)
    return {"samples_per_s": res["samples_per_s"], "seconds": res["seconds"], "samples": res["samples"],
            "bytes_moved": res["bytes_moved"], "comm_fraction": res["comm_fraction"]}


async def spawn_workers(what: str, workers: int, args: list[str], env: dict[str, str] | None = None
                        ) -> list[dict[str, Any]]:
    """Run ``workers`` processes of this script (``args`` + ``--rank R --world W``);
    each prints one JSON line, returned in rank order."""
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, "-m", "smb2.bench.training", *args, "--rank", str(r), "--world", str(workers),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **ONE_THREAD, **(env or {})}) for r in range(workers)]
    outs = []
    for p in procs:
        out, err = await p.communicate()
        if p.returncode:
            raise RuntimeError(f"{what} worker failed:\n{err.decode()[-3000:]}")
        outs.append(json.loads(out.decode().strip().splitlines()[-1]))
    return outs


def summarize(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the workers' JSON lines (seconds, samples, bytes, compute)."""
    seconds = max(o["seconds"] for o in outs)
    samples = sum(o["samples"] for o in outs)
    return {"samples_per_s": samples / seconds, "seconds": seconds, "samples": samples,
            "bytes_moved": sum(o["bytes"] for o in outs),
            "comm_fraction": 1 - sum(o["compute"] for o in outs) / sum(o["seconds"] for o in outs)}


async def gloo_run(workers: int, steps: int, path: Path) -> dict[str, Any]:
    args = ["--gloo-worker", "--port", str(free_port()), "--steps", str(steps), "--data", str(path)]
    return summarize(await spawn_workers("gloo", workers, args))


async def frontend_run(kind: str, workers: int, steps: int, path: Path, servers: list[str] | None = None,
                       staleness: int = 0, rule: str = "delta", transport: str = "auto") -> dict[str, Any]:
    """The torch front ends on a torch copy of the model: ``kind`` "ddp"
    (DistributedDataParallel over gloo) or "smb2" (AsyncOptimizer, ``rule``,
    ``staleness``)."""
    args = ["--torch-worker", kind, "--port", str(free_port()), "--steps", str(steps), "--data", str(path),
            "--staleness", str(staleness), "--frontend-rule", rule]
    env = {"SMB2_SERVERS": ",".join(servers), **_via(transport)} if servers else None
    return summarize(await spawn_workers(kind, workers, args, env))


def torch_worker(kind: str, rank: int, world: int, port: int, steps: int, path: str, staleness: int,
                 rule: str = "delta") -> None:
    """One worker of a torch front end: SGD on the MLP's torch twin.

    "compute" is the training thread's time not waiting on communication:
    for smb2 the step time less AsyncOptimizer's measured wait; for DDP
    (whose all-reduce overlaps backward inside it) the time of the same
    steps without synchronization (``no_sync``, measured after the timed
    ones) times the steps."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import smb2.torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y, _, _ = (torch.from_numpy(v) for v in data.load(path))
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(SIZES, SIZES[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(SIZES) - 2 else [])
    model = nn.Sequential(*layers)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    g = torch.Generator().manual_seed(rank)
    shard = torch.arange(rank, len(x), world)

    def one_step(opt: torch.optim.Optimizer, net: nn.Module) -> None:
        idx = shard[torch.randint(0, len(shard), (BATCH,), generator=g)]
        loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()

    if kind == "ddp":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        net = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        one_step(opt, net)                          # warm-up (DDP's first step builds its buckets)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            one_step(opt, net)
        seconds = time.perf_counter() - t0
        dist.barrier()
        with net.no_sync():
            tc = time.perf_counter()
            for _ in range(steps):
                one_step(opt, net)
            compute = time.perf_counter() - tc
        dist.destroy_process_group()
        moved = int(2 * (world - 1) / world * nbytes * steps * 2)
    else:
        aopt = smb2.torch.AsyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model, name=FRONTEND_STORE,
                                         rank=rank, world_size=world, staleness=staleness, resume=False, rule=rule)
        one_step(aopt, model)
        t0 = time.perf_counter()
        wait0 = aopt.stats()["wait_s"]
        for _ in range(steps):
            one_step(aopt, model)
        aopt.flush()
        seconds = time.perf_counter() - t0
        stats = aopt.stats()
        compute = seconds - (stats["wait_s"] - wait0)
        moved = stats["bytes_pushed"] + stats["bytes_pulled"]
        aopt.close()
    print(json.dumps({"seconds": seconds, "samples": steps * BATCH, "bytes": moved, "compute": compute}),
          flush=True)


def gloo_worker(rank: int, world: int, port: int, steps: int, path: str) -> None:
    """Synchronous data parallelism: all-reduce the flat gradient each step."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x, y, _, _ = data.load(path)
    model = MLP(SIZES)
    params = model.init(0)
    names = list(params)
    total = sum(p.size for p in params.values())
    flat = np.zeros(total, np.float32)
    rng = np.random.default_rng(rank)
    shard = np.arange(rank, len(x), world)
    dist.barrier()
    t0 = time.perf_counter()
    compute = 0.0
    for _ in range(steps):
        idx = rng.choice(shard, BATCH)
        tc = time.perf_counter()
        _, g = model.grads(params, x[idx], y[idx])
        compute += time.perf_counter() - tc
        o = 0
        for n in names:
            flat[o:o + g[n].size] = g[n].ravel()
            o += g[n].size
        if world > 1:
            dist.all_reduce(torch.from_numpy(flat))       # in place, no copy
            flat /= world
        o = 0
        for n in names:
            params[n] -= 0.01 * flat[o:o + params[n].size].reshape(params[n].shape)
            o += params[n].size
    seconds = time.perf_counter() - t0
    dist.destroy_process_group()
    # a ring all-reduce sends and receives about 2 (N-1)/N of the tensor per worker
    moved = int(2 * (world - 1) / world * flat.nbytes * steps * 2)
    print(json.dumps({"seconds": seconds, "samples": steps * BATCH, "bytes": moved, "compute": compute}),
          flush=True)


async def main(a: argparse.Namespace) -> dict[str, Any]:
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
        print("torch is not installed: no gloo baseline (pip install 'smb2[torch]')")
    workers = [int(w) for w in a.workers.split(",")]
    nservers = [int(s) for s in a.servers.split(",")]
    rules = [r for r in a.rules.split(",") if r]
    transports = [t for t in a.transports.split(",") if t]
    configs = [c for c in a.frontend_configs.split(",") if c]
    print(f"model: MLP {SIZES}, {MLP(SIZES).nparams / 1e6:.1f} M parameters "
          f"({MLP(SIZES).nparams * 4 / 1e6:.0f} MB float32), batch {BATCH}, {a.steps} steps per worker; "
          f"{os.cpu_count()} cores")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "synthetic.npz"
        data.save(path, data.synthetic(4096, SIZES[0], SIZES[-1], seed=0, test=256))
        clusters = {ns: await smb2.LocalCluster(servers=ns, processes=True, capacity="512MiB").start()
                    for ns in nservers}
        total = len(workers) * (a.repeat * (have_torch + len(clusters) * len(rules) * len(transports))
                                + have_torch * (1 + a.frontend * (1 + len(configs) * len(transports))))
        ran = itertools.count(1)
        report.progress("training", 0, total, f"runs: workers {a.workers}, servers {a.servers}, rules {a.rules}")
        try:
            # the machine is shared and noisy: for each number of workers, gloo
            # runs before and after the smb2 configurations it is compared with,
            # and each side counts its best run (interference only slows)
            for w in workers:
                gloo_runs = []
                for rep in range(a.repeat):
                    if have_torch:
                        gloo_runs.append(await gloo_run(w, a.steps, path))
                        report.progress("training", next(ran), total, f"gloo all-reduce, {w} workers",
                                        speed=f"{gloo_runs[-1]['samples_per_s']:.1f} samples/s")
                    for ns, cluster in clusters.items():
                        for label in rules:
                            for via in transports:
                                rtt = await report.round_trip_us(cluster.addresses, transport=via)
                                r = await smb2_run(label, w, cluster.addresses, a.steps, path, via)
                                row = {"system": "smb2", "rule": label, "workers": w, "servers": ns,
                                       "transport": via, "rtt_us": rtt, "repeat": rep, **r}
                                _show(row, next(ran), total)
                                rows.append(row)
                if have_torch and a.frontend:
                    rows += await frontend_rows(w, a.steps, path, clusters[nservers[0]], nservers[0], configs,
                                                transports, ran, total)
                if have_torch:
                    gloo_runs.append(await gloo_run(w, a.steps, path))
                    report.progress("training", next(ran), total, f"gloo all-reduce, {w} workers",
                                    speed=f"{gloo_runs[-1]['samples_per_s']:.1f} samples/s")
                    rtt = await report.round_trip_us(next(iter(clusters.values())).addresses, transport="auto")
                    sps = [g["samples_per_s"] for g in gloo_runs]
                    rows.append({"system": "gloo all-reduce", "rule": "sync", "workers": w, "servers": 0,
                                 "rtt_us": rtt, "runs": sps, **gloo_runs[-1],
                                 "samples_per_s": max(sps)})
        finally:
            for c in clusters.values():
                await c.close()
    rows = _best(rows)
    _ratios(rows)
    return {"model": SIZES, "params": MLP(SIZES).nparams, "batch": BATCH, "steps": a.steps, "quick": a.quick,
            "rows": rows}


async def frontend_rows(workers: int, steps: int, path: Path, cluster: smb2.LocalCluster, nservers: int,
                        configs: list[str], transports: list[str], ran: Iterator[int], total: int
                        ) -> list[dict[str, Any]]:
    """torch DDP and AsyncOptimizer (each of ``configs``, "rule/sSTALENESS" of
    :data:`FRONTEND_CONFIGS`, over each transport), one after the other;
    ``ran`` counts the runs of ``total``."""
    rows = []
    rtt = await report.round_trip_us(cluster.addresses, transport="auto")
    r = await frontend_run("ddp", workers, steps, path)
    rows.append({"system": "torch DDP", "rule": "sync", "workers": workers, "servers": 0, "rtt_us": rtt, **r})
    _show(rows[-1], next(ran), total)
    for config in configs:
        rule, _, staleness = config.partition("/s")
        for via in transports:
            rtt = await report.round_trip_us(cluster.addresses, transport=via)
            r = await frontend_run("smb2", workers, steps, path, cluster.addresses, staleness=int(staleness),
                                   rule=rule, transport=via)
            # the next run may have another rule or worker count: a store made for one is not the next's
            async with await smb2.connect(cluster.addresses) as client:
                await train_store.remove(client, FRONTEND_STORE)
            rows.append({"system": "AsyncOptimizer", "rule": config, "workers": workers,
                         "servers": nservers, "transport": via, "rtt_us": rtt, **r})
            _show(rows[-1], next(ran), total)
    return rows


async def against(a: argparse.Namespace) -> dict[str, Any]:
    """One configuration against the servers in ``--against``."""
    servers = [s for s in a.against.split(",") if s]
    workers = int(a.workers.split(",")[0])
    label = a.rules.split(",")[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "synthetic.npz"
        data.save(path, data.synthetic(4096, SIZES[0], SIZES[-1], seed=0, test=256))
        rtt = await report.round_trip_us(servers, transport="auto")
        r = await smb2_run(label, workers, servers, a.steps, path)
    return {"system": "smb2", "rule": label, "workers": workers, "servers": len(servers), "rtt_us": rtt, **r}


def _best(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration, the best of its repeats (interference only slows)."""
    best: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        key = (r["system"], r["rule"], r["workers"], r["servers"], r.get("transport"))
        if key not in best or r["samples_per_s"] > best[key]["samples_per_s"]:
            best[key] = r
    order = {k: i for i, k in enumerate(["gloo all-reduce", "smb2", "torch DDP", "AsyncOptimizer"])}
    return sorted(best.values(), key=lambda r: (r["system"] in FRONTENDS, r["servers"] > 0, r["servers"],
                                                r["workers"], order[r["system"]],
                                                list(RULES).index(r["rule"]) if r["rule"] in RULES else 0,
                                                r["rule"], r.get("transport") or ""))


def _show(r: dict[str, Any], done: int, total: int) -> None:
    # one line as each run ends; the table at the end lines them up
    via = f" over {r['transport']}" if r.get("transport") else ""
    report.progress("training", done, total, f"{r['system']} {r['rule']}{via}, {r['workers']} workers, "
                    f"{r['servers']} servers", speed=f"{r['samples_per_s']:.1f} samples/s",
                    rtt=f"{r['rtt_us']:.0f} µs")


def _ratios(rows: list[dict[str, Any]]) -> None:
    gloo = {r["workers"]: r["samples_per_s"] for r in rows if r["system"] == "gloo all-reduce"}
    ddp = {r["workers"]: r["samples_per_s"] for r in rows if r["system"] == "torch DDP"}
    base = {(r["rule"], r.get("transport")): r["samples_per_s"] for r in rows
            if r["system"] == "smb2" and r["workers"] == 1 and r["servers"] == min(x["servers"] for x in rows
                                                                                  if x["system"] == "smb2")}
    for r in rows:
        if r["system"] in FRONTENDS:
            # the torch front ends against DDP on the same torch model ("x gloo" column)
            r["vs_1_worker_1_server"] = None
            r["vs_gloo"] = r["samples_per_s"] / ddp[r["workers"]] if r["workers"] in ddp else None
        elif r["system"] == "smb2":
            key = (r["rule"], r.get("transport"))
            r["vs_1_worker_1_server"] = r["samples_per_s"] / base[key] if key in base else None
            r["vs_gloo"] = r["samples_per_s"] / gloo[r["workers"]] if r["workers"] in gloo else None
        else:
            r["vs_1_worker_1_server"] = r["samples_per_s"] / gloo[min(gloo)]
            r["vs_gloo"] = 1.0


def table(result: dict[str, Any]) -> str:
    return report.table(
        ["system", "rule", "via", "workers", "servers", "samples/s", "x 1w1s", "x gloo", "not comp", "MB moved",
         "rtt µs"],
        [[r["system"], r["rule"], r.get("transport") or "-", r["workers"], r["servers"] or None, r["samples_per_s"],
          r["vs_1_worker_1_server"], r["vs_gloo"], r.get("comm_fraction"), r["bytes_moved"] / 1e6, r["rtt_us"]]
         for r in result["rows"]],
        formats=[None, None, None, None, None, "{:.1f}", "{:.2f}", "{:.2f}", "{:.0%}", "{:.0f}", "{:.0f}"])


def plot(result: dict[str, Any], path: str) -> None:
    def draw(plt: Any) -> Any:
        rows = result["rows"]
        servers = sorted({r["servers"] for r in rows if r["system"] == "smb2"})
        fig, axes = plt.subplots(1, len(servers), figsize=(6 * len(servers), 4.5), sharey=True, squeeze=False)
        for ax, ns in zip(axes[0], servers):
            for rule, via in dict.fromkeys((r["rule"], r.get("transport")) for r in rows if r["system"] == "smb2"):
                pts = sorted((r["workers"], r["samples_per_s"]) for r in rows if r["system"] == "smb2"
                             and r["rule"] == rule and r.get("transport") == via and r["servers"] == ns)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"smb2 {rule}" + (f" over {via}" if via else ""))
            g = sorted((r["workers"], r["samples_per_s"]) for r in rows if r["system"] == "gloo all-reduce")
            if g:
                ax.plot(*zip(*g), marker="s", linestyle="--", color="black", label="torch gloo all-reduce (no servers)")
            report.style(ax, title=f"{ns} memory server{'s' if ns > 1 else ''}", xlabel="worker processes",
                         ylabel="samples/s" if ax is axes[0][0] else None,
                         xticks=sorted({r["workers"] for r in rows}), legend=ax is axes[0][-1])
        fig.suptitle(f"training throughput, MLP of {result['params'] / 1e6:.1f} M parameters, batch {result['batch']} "
                     f"({os.cpu_count()} cores shared by workers and servers)")
        fig.tight_layout()
        return fig

    why = report.plot(path, draw)
    print(why or f"plot: {path}", file=sys.stderr if why else sys.stdout)


def cli() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="steps per worker per configuration")
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--servers", default="1,4")
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--transports", default="auto",
                   help="the smb2 workers' transports, each a row of its own (e.g. shm,tcp; default auto)")
    p.add_argument("--repeat", type=int, default=1, help="runs per smb2 configuration (the best counts)")
    p.add_argument("--json", default="bench_training.json")
    p.add_argument("--png", default="bench_training.png")
    p.add_argument("--from-json", metavar="JSON", help="only print the table and draw the plot of an earlier run")
    p.add_argument("--against", metavar="SERVERS",
                   help="one configuration against these servers (HOST:PORT,...); prints one JSON line")
    # internal: one gloo worker
    p.add_argument("--gloo-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--torch-worker", choices=["ddp", "smb2"], help=argparse.SUPPRESS)
    p.add_argument("--staleness", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--frontend-rule", default="delta", help=argparse.SUPPRESS)
    p.add_argument("--frontend", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the torch front ends (DDP over gloo; smb2.torch.AsyncOptimizer, rule delta, "
                        "staleness 0 and 1) on the model's torch twin, with the first server count")
    p.add_argument("--frontend-configs", default=",".join(FRONTEND_CONFIGS),
                   help=f"AsyncOptimizer's configurations, rule/sSTALENESS (default {','.join(FRONTEND_CONFIGS)})")
    a = parse_with_quick(p, None, QUICK, "gloo, smb2, DDP and AsyncOptimizer rows, every ratio")
    if a.gloo_worker:
        gloo_worker(a.rank, a.world, a.port, a.steps, a.data)
        return 0
    if a.torch_worker:
        torch_worker(a.torch_worker, a.rank, a.world, a.port, a.steps, a.data, a.staleness, a.frontend_rule)
        return 0
    unknown = [r for r in a.rules.split(",") if r and r not in RULES]
    if unknown:
        p.error(f"unknown rules {unknown}; known: {', '.join(RULES)}")
    unknown = [c for c in a.frontend_configs.split(",") if c and c not in FRONTEND_CONFIGS]
    if unknown:
        p.error(f"unknown --frontend-configs {unknown}; known: {', '.join(FRONTEND_CONFIGS)}")
    if a.against:
        print(json.dumps(asyncio.run(against(a))), flush=True)
        return 0
    if a.from_json:
        result = json.loads(Path(a.from_json).read_text())
        for r in result["rows"]:
            if r["system"] != "smb2" and "runs" in r:
                r["samples_per_s"] = max(r["runs"])
        _ratios(result["rows"])
        print(table(result))
        plot(result, a.png)
        return 0
    result = asyncio.run(main(a))
    print()
    print(table(result))
    report.write_json(a.json, result, round_trip_64B_us=report.median_round_trip([r["rtt_us"] for r in result["rows"]]),
                      quiet=True)
    print(f"json: {a.json}")
    plot(result, a.png)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
