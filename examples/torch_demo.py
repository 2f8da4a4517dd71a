"""The torch part of ``make demo``: what most users come for.

Four memory servers (smb2-server processes); examples/torch_train.py (a CNN
on scikit-learn's digits, an ordinary torch loop with
``smb2.torch.AsyncOptimizer``) trained by 4 torchrun workers through them
with the recommended rule, beside the same script in one process; then
``smb2 ls`` of the store the workers shared, as a user would look at it.

    python examples/torch_demo.py [--epochs 8] [--workers 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import smb2

# the rule docs/training.md recommends for a torch job ("Which rule, when"; torch_train.py
# scales SGD's learning rate by the number of workers for it): the one place the demo names it
RULE = "diloco"
SCRIPT = Path(__file__).resolve().parent / "torch_train.py"


async def run(*argv: str, env: dict[str, str]) -> tuple[list[dict[str, Any]], str, float]:
    """Run a command; the JSON reports it printed, its other output, and its seconds."""
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    seconds = time.perf_counter() - t0
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"torch_demo: {' '.join(argv)} failed (exit {proc.returncode}):\n{text}")
    reports = [json.loads(line) for line in text.splitlines() if line.startswith('{"rank"')]
    return reports, text, seconds


async def main(epochs: int, workers: int) -> None:
    print(f"\nsmb2 torch demo: {SCRIPT.name} through smb2.torch.AsyncOptimizer, rule {RULE!r}, {epochs} epochs")
    async with smb2.LocalCluster(servers=4, processes=True, capacity="64MiB") as cluster:
        servers = ",".join(cluster.addresses)
        print(f"  4 memory servers: {servers}")
        # one thread per worker: they share this machine's cores
        env = {**os.environ, "SMB2_SERVERS": servers, "OMP_NUM_THREADS": "1"}
        for name in ("RANK", "WORLD_SIZE", "SMB2_RANK", "SMB2_WORLD_SIZE"):
            env.pop(name, None)
        train = [str(SCRIPT), "--rule", RULE, "--epochs", str(epochs)]
        rows = []
        one, _, t_one = await run(sys.executable, *train, "--name", "demo-one-process", env=env)
        rows.append(("1 process", one, t_one))
        many, _, t_many = await run(sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    f"--nproc-per-node={workers}", *train, "--name", "demo-torchrun", env=env)
        rows.append((f"{workers} torchrun workers", many, t_many))
        print(f"\n  {'who':20} {'steps (each)':>12} {'test accuracy':>14} {'seconds':>8}")
        for who, reports, seconds in rows:
            steps = "/".join(str(r["steps"]) for r in sorted(reports, key=lambda r: r["rank"]))
            accuracy = min(r["accuracy"] for r in reports)
            print(f"  {who:20} {steps:>12} {accuracy:>13.2f}% {seconds:>8.1f}")
        print("  (each worker trains on its share of the data; seconds include starting python and torch)")
        print(f"\n$ smb2 ls --servers {servers}", flush=True)
        ls = await asyncio.create_subprocess_exec(sys.executable, "-m", "smb2.cli", "ls", "--servers", servers,
                                                  env=env)
        await ls.wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--workers", type=int, default=4)
    a = p.parse_args()
    asyncio.run(main(a.epochs, a.workers))
