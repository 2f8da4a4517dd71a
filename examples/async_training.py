"""Asynchronous data-parallel training on smb2 (what ``make demo`` runs).

A LocalCluster of 4 memory-server processes holds one striped buffer with
the model; 4 worker processes train a multi-layer perceptron (numpy, no
torch) on scikit-learn's bundled digits data set, each on its quarter of the
data, and share their updates through the buffer with each update rule in
turn.  Their progress bars are read from the store's progress table (by
attaching to it by name, as any process could).  At the end: accuracy,
samples/s and bytes moved per rule, against one process training alone.

    python examples/async_training.py [--epochs 30] [--rules accumulate,locked,...]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import smb2
from smb2.train.example import data
from smb2.train.example.job import JobConfig, run_job, single_process

RULES = {
    "accumulate": {},
    "locked": {},
    "locked/layer": {"rule": "locked", "rule_options": {"per_layer": True}},
    "easgd": {"lr": 0.4, "rule_options": {"tau": 4, "alpha": 0.5}},
    "accumulate+drop": {"rule": "accumulate", "dropping": 0.7},
}


class Bars:
    """One progress bar per worker: redrawn in place on a terminal, printed
    at every quarter otherwise (logs, CI)."""

    WIDTH = 30

    def __init__(self, workers: int, label: str) -> None:
        self.workers = workers
        self.label = label
        self.tty = sys.stdout.isatty()
        self.drawn = False
        self.quarter = 0        # printed at 25, 50, 75 and 100 % (not at 0)
        self.t0 = time.perf_counter()

    def __call__(self, progress: np.ndarray, target: int) -> None:
        frac = np.minimum(progress / max(target, 1), 1.0)
        lines = []
        for r, (it, f) in enumerate(zip(progress.tolist(), frac.tolist())):
            fill = int(round(f * self.WIDTH))
            lines.append(f"  {self.label:<16} worker {r} [{'#' * fill}{'.' * (self.WIDTH - fill)}] "
                         f"{min(it, target):4d}/{target} steps")
        if self.tty:
            if self.drawn:
                sys.stdout.write(f"\x1b[{self.workers}F")
            sys.stdout.write("\n".join(lines) + "\n")
            sys.stdout.flush()
            self.drawn = True
            return
        quarter = int(frac.mean() * 4)
        if quarter > self.quarter:
            self.quarter = quarter
            print(f"  [{time.perf_counter() - self.t0:5.1f} s]")
            print("\n".join(lines), flush=True)


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


async def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--rules", default=",".join(RULES), help=f"comma-separated, of {', '.join(RULES)}")
    a = p.parse_args(argv)
    rules = [r for r in a.rules.split(",") if r]
    unknown = [r for r in rules if r not in RULES]
    if unknown:
        p.error(f"unknown rules {unknown}")
    t_start = time.perf_counter()
    split = data.digits()
    base = JobConfig(epochs=a.epochs, workers=a.workers, lr=0.1, sizes=[64, 256, 10])
    print(f"digits: {len(split[0])} training and {len(split[2])} test images; "
          f"MLP {base.sizes} ({sum(a * b + b for a, b in zip(base.sizes, base.sizes[1:])):,} parameters), "
          f"{a.epochs} epochs")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "digits.npz"
        data.save(path, split)
        print(f"starting {a.servers} memory servers (smb2-server processes) ...")
        async with smb2.LocalCluster(servers=a.servers, processes=True) as cluster:
            print("  " + ", ".join(cluster.addresses))
            for label in rules:
                spec = dict(RULES[label])
                cfg = JobConfig(**{**vars(base), "rule": spec.pop("rule", label), **spec})
                solo = single_process(cfg, split)
                print(f"\n{label}: {a.workers} worker processes (single process alone: "
                      f"{solo['accuracy']:.2f} %)")
                res = await run_job(cfg, cluster.addresses, path, name=f"demo-{label.replace('/', '-')}",
                                    on_progress=Bars(a.workers, label))
                res["label"] = label
                res["single"] = solo["accuracy"]
                rows.append(res)
                print(f"  test accuracy {res['accuracy']:.2f} %, {res['samples_per_s']:,.0f} samples/s, "
                      f"{_mb(res['bytes_moved'])} moved")
    print()
    head = (f"{'update rule':<17} {'accuracy':>9} {'1 process':>9} {'samples/s':>10} "
            f"{'pulled':>11} {'pushed':>11} {'moved':>11}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['label']:<17} {r['accuracy']:>8.2f}% {r['single']:>8.2f}% {r['samples_per_s']:>10,.0f} "
              f"{_mb(r['bytes_pulled']):>11} {_mb(r['bytes_pushed']):>11} {_mb(r['bytes_moved']):>11}")
    for r in rows:
        if "dropping" in r:
            print(f"\nlayer dropping (ratio 0.7): {r['dropping']['saved_fraction']:.0%} of the gradient bytes "
                  "stayed in the workers' residual caches")
    print(f"\n{a.workers} workers x {a.servers} memory servers on this machine; "
          f"whole demo {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    try:
        import uvloop
        sys.exit(uvloop.run(main()))
    except ImportError:
        sys.exit(asyncio.run(main()))
