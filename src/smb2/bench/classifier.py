"""``smb2 bench classifier``: the porting recipe's one line against torch DDP
on a plain classifier at equal epochs, seed by seed, in one run.

    smb2 bench classifier [--workers 4] [--epochs 12] [--optimizers sgd,adamw] [--seeds 5] [--servers 2]
    smb2 bench classifier --quick     # seconds: 2 workers, 1 epoch, one seed, AdamW

For each optimizer and seed (the model's initial weights) it runs two
torchrun jobs of ``--workers`` ranks on this host, one after the other:
``examples/torch_train_ddp.py`` (DDP, gloo) and ``examples/torch_train.py``
with no ``--rule`` (the porting recipe's one line: rule ``allreduce``, the
default) against ``--servers`` real ``smb2-server`` processes.  The two
scripts share the model (a small CNN), the loop (clipping at 1.0), the
optimizers (SGD with momentum, AdamW), the StepLR schedule and each rank's
shard and order of the digits data, so their runs differ only by how the
ranks' gradients are averaged: gloo's all-reduce in float32, or the
servers' sums of bf16 gradients read back rounded to bf16.

A run's figure is the test accuracy (539 digits: one point is 5.4 images)
of the model the system delivers: DDP's rank 0 (its ranks' parameters are
equal; rank 0's buffers are the ones DDP broadcasts), and the shared
model every smb2 rank holds once all finished.  The table gives, per
optimizer, each system's median over the seeds, the difference of the
medians, the median of the seeds' own differences (the same seed: the same
initial weights, data and order), and the target the default is held to:
within 0.5 points of DDP.  This measures learning, not speed: the 64-byte
round trip of the servers (``transport`` auto: shm on one host) is
recorded beside it as every benchmark's yardstick, and the runs' seconds
are in the JSON, not compared.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import InterfaceError
from ..testing.workers import EXAMPLES, torchrun_ranks
from .common import now, parse_with_quick
from .report import progress, round_trip_us, run_and_report, table, target

SYSTEMS = ("ddp", "default")
#: the default ends within this many points of DDP's accuracy (the median over the seeds)
WITHIN_POINTS = 0.5
SCRIPTS = {"ddp": "torch_train_ddp.py", "default": "torch_train.py"}
QUICK = ["--workers", "2", "--epochs", "1", "--optimizers", "adamw", "--seeds", "1"]


def _job(examples: Path, system: str, kind: str, seed: int, args: argparse.Namespace,
         servers: list[str]) -> dict[str, Any]:
    """One torchrun job of ``system``: rank 0's figures, with every rank's accuracy beside them."""
    argv = ["--optimizer", kind, "--epochs", str(args.epochs), "--seed", str(seed)]
    if system == "default":
        argv += ["--name", f"bench-classifier-{kind}-{seed}-{time.monotonic_ns()}"]
    env = dict(os.environ, SMB2_SERVERS=",".join(servers), OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    ranks, _ = torchrun_ranks(examples / SCRIPTS[system], *argv, nproc=args.workers, env=env, timeout=args.timeout)
    first = ranks[0]
    return {"system": system, "optimizer": kind, "seed": seed, "accuracy": first["accuracy"],
            "ranks_accuracy": [r["accuracy"] for r in ranks], "rule": first["rule"], "steps": first["steps"],
            "loss": first["loss"], "seconds": round(time.perf_counter() - t0, 1)}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import smb2

    examples = Path(args.examples)
    missing = [s for s in SCRIPTS.values() if not (examples / s).is_file()]
    if missing:
        raise InterfaceError(f"the example scripts {', '.join(missing)} are not in {examples}",
                             hint="run from a source checkout, or pass --examples DIR (the repository's examples/)")
    total = len(args.optimizers) * len(args.seeds) * len(SYSTEMS)
    runs: list[dict[str, Any]] = []
    async with smb2.LocalCluster(servers=args.servers, processes=True) as cluster:
        rtt = await round_trip_us(cluster.addresses, transport="auto")
        progress("classifier", 0, total, f"{args.workers} workers, {args.epochs} epochs, 64 B round trip "
                                         f"{rtt:.0f} us")
        for kind in args.optimizers:
            for i, seed in enumerate(args.seeds):
                # each seed's pair in turns, so that a drift of the machine's load hits both alike
                for system in SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]:
                    run = await asyncio.to_thread(_job, examples, system, kind, seed, args, cluster.addresses)
                    runs.append(run)
                    progress("classifier", len(runs), total, f"{kind} seed {seed} {system}",
                             accuracy=f"{run['accuracy']:.2f} %")
    return {"benchmark": "classifier", "started": now(), "quick": args.quick, "workers": args.workers,
            "epochs": args.epochs, "servers": args.servers, "transport": "auto", "round_trip_64B_us": rtt,
            "task": "digits CNN (examples/torch_train.py's model, loop and optimizers), 539 test images",
            "runs": runs}


def summarize(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for kind in dict.fromkeys(r["optimizer"] for r in result["runs"]):
        of = {s: {r["seed"]: r["accuracy"] for r in result["runs"] if r["optimizer"] == kind and r["system"] == s}
              for s in SYSTEMS}
        ddp, default = statistics.median(of["ddp"].values()), statistics.median(of["default"].values())
        paired = [of["default"][s] - of["ddp"][s] for s in of["ddp"] if s in of["default"]]
        out.append({"optimizer": kind, "seeds": len(paired), "ddp_median": ddp, "default_median": default,
                    "difference_of_medians": round(default - ddp, 2),
                    "median_seed_difference": round(statistics.median(paired), 2),
                    "ddp_runs": sorted(of["ddp"].values()), "default_runs": sorted(of["default"].values()),
                    "within": abs(default - ddp) <= WITHIN_POINTS})
    return out


def format_table(summary: list[dict[str, Any]]) -> str:
    header = ["optimizer", "seeds", "DDP %", "default %", "default - DDP", "per seed (median)",
              f"within {WITHIN_POINTS} points"]
    rows = [[s["optimizer"], s["seeds"], s["ddp_median"], s["default_median"], s["difference_of_medians"],
             s["median_seed_difference"], target("<=", WITHIN_POINTS, "{:.1f}", s["within"])] for s in summary]
    return table(header, rows, formats=[None, None, "{:.2f}", "{:.2f}", "{:+.2f}", "{:+.2f}"])


def _names(text: str) -> list[str]:
    names = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in names if k not in ("sgd", "adamw")]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"optimizers are sgd and adamw, not {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="smb2 bench classifier", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4, help="torchrun ranks of each job")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--optimizers", type=_names, default=["sgd", "adamw"], help="sgd, adamw or both")
    p.add_argument("--seeds", type=lambda t: list(range(int(t))), default=list(range(5)),
                   help="seeds 0..N-1 (the models' initial weights), each run by both systems")
    p.add_argument("--servers", type=int, default=2, help="smb2-server processes the default's jobs use")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a torchrun job may take")
    p.add_argument("--examples", default=str(EXAMPLES),     # (a source checkout's: the wheel ships none)
                   help="the directory holding torch_train.py and torch_train_ddp.py (a source checkout's "
                        "examples/)")
    p.add_argument("--json", default="", help="write every run and the summary here")
    args = parse_with_quick(p, argv, QUICK, "both systems, every figure")
    if args.workers < 2 or not args.seeds:
        p.error("--workers must be at least 2 and --seeds at least 1")
    return run_and_report(lambda: measure(args), summarize, format_table, args.json,
                          lambda r: r["round_trip_64B_us"])


if __name__ == "__main__":
    sys.exit(main())
