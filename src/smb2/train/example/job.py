"""A data-parallel training job on smb2: N worker processes, one store.

Used by the demo (``examples/async_training.py``), the tests and
``tools/bench_training.py``.  Each worker is a fresh ``python -m
smb2.train.example.job worker ...`` process that trains the numpy :class:`MLP` on its
shard of the data through a :class:`ParameterStore` and prints one JSON line
of statistics.  The launcher watches the job through the store's progress
table (attaching by name only, like any other worker could) and evaluates
the shared parameters when the job is over.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ...client import connect
from ...errors import Smb2Error
from ..dropping import LayerDropping
from ..store import ParameterStore
from . import data as datasets
from .mlp import MLP, sgd_epochs

log = logging.getLogger("smb2.train")


@dataclasses.dataclass
class JobConfig:
    rule: str = "accumulate"
    lr: float = 0.1
    epochs: int = 10
    batch: int = 32
    sizes: list[int] = dataclasses.field(default_factory=lambda: [64, 64, 10])
    seed: int = 0
    workers: int = 4
    #: LayerDropping ratio, or None for none
    dropping: float | None = None
    #: end policy: "first", "slowest" or "average"
    policy: str = "average"
    rule_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: publish progress (and check the end policy) every this many steps
    report_every: int = 1
    stripe: int | None = None
    #: steps per worker instead of epochs (benchmarks)
    steps: int | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, s: str) -> JobConfig:
        return cls(**json.loads(s))

    def steps_per_epoch(self, n_train: int) -> int:
        shard = math.ceil(n_train / self.workers)
        return math.ceil(shard / self.batch)

    def target(self, n_train: int) -> int:
        """Steps per worker: the end policy's goal."""
        return self.steps if self.steps is not None else self.epochs * self.steps_per_epoch(n_train)


# -- one worker -------------------------------------------------------------------

async def run_worker(servers: list[str], name: str, rank: int, cfg: JobConfig,
                     split: datasets.Split) -> dict[str, Any]:
    """Train on shard ``rank`` until the end policy fires; return statistics."""
    x, y = split[0], split[1]
    model = MLP(cfg.sizes)
    # the same permutation on every worker, so the shards are disjoint
    order = np.random.default_rng(cfg.seed).permutation(len(x))
    shard = order[rank::cfg.workers]
    target = cfg.target(len(x))
    rng = np.random.default_rng(cfg.seed * 1000 + rank + 1)
    dropping = LayerDropping(cfg.dropping) if cfg.dropping is not None else None
    async with await connect(servers) as client:
        t_open = time.perf_counter()
        store = await ParameterStore.open(
            client, name, model.init(cfg.seed), rule=cfg.rule, workers=cfg.workers, rank=rank,
            dropping=dropping, stripe=cfg.stripe, lr=cfg.lr, **cfg.rule_options)
        # the processes start over a second or so: without this the first one
        # would do most of the job alone
        await store.join(timeout=120)
        t0 = time.perf_counter()
        it = store.start_step       # a resumed run continues from this rank's step
        samples = 0
        compute = 0.0       # seconds spent computing gradients (the rest: smb2)
        losses: list[float] = []
        done = False
        while not done:
            perm = shard[rng.permutation(len(shard))]
            for s in range(0, len(perm), cfg.batch):
                idx = perm[s:s + cfg.batch]
                if store.rule.pull_each_step:
                    await store.pull()
                tc = time.perf_counter()
                loss, grads = model.grads(store.params, x[idx], y[idx])
                compute += time.perf_counter() - tc
                await store.push(grads)
                losses.append(loss)
                it += 1
                samples += len(idx)
                if (it % cfg.report_every == 0 or it >= target) and await store.report(it, target, cfg.policy):
                    done = True
                    break
        elapsed = time.perf_counter() - t0
        if store.rule.elastic:
            # leave our last local progress in the center before it is evaluated
            await store.rule.exchange()
        # done: the store stays (the launcher evaluates it; slower ranks still train)
        await store.finish()
        out: dict[str, Any] = {
            "rank": rank, "iterations": it, "samples": samples, "seconds": elapsed, "compute_seconds": compute,
            "open_seconds": t0 - t_open, "loss": float(np.mean(losses[-20:])) if losses else None,
            **store.stats,
        }
        if dropping is not None:
            out["dropping"] = dropping.stats()
        return out


def _worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m smb2.train.example.job worker")
    p.add_argument("--servers", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--data", required=True)
    a = p.parse_args(argv)
    cfg = JobConfig.from_json(a.config)
    split = datasets.load(a.data)
    try:
        import uvloop
        result = uvloop.run(run_worker(a.servers.split(","), a.name, a.rank, cfg, split))
    except ImportError:
        result = asyncio.run(run_worker(a.servers.split(","), a.name, a.rank, cfg, split))
    print(json.dumps(result), flush=True)
    return 0


# -- the launcher -------------------------------------------------------------------

ProgressCallback = Callable[[np.ndarray, int], None]


async def run_job(cfg: JobConfig, servers: list[str], data_path: str | Path, *, name: str = "job",
                  on_progress: ProgressCallback | None = None, interval: float = 0.25,
                  timeout: float = 600.0, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cfg.workers`` worker processes against ``servers``; return the
    job's statistics and the test accuracy of the shared parameters.
    ``env``: extra environment variables for the workers."""
    split = datasets.load(data_path)
    target = cfg.target(len(split[0]))
    cmd = [sys.executable, "-m", "smb2.train.example.job", "worker", "--servers", ",".join(servers),
           "--name", name, "--config", cfg.to_json(), "--data", str(data_path)]
    t0 = time.perf_counter()
    penv = None if env is None else {**os.environ, **env}
    procs = [await asyncio.create_subprocess_exec(*cmd, "--rank", str(r), stdout=asyncio.subprocess.PIPE,
                                                  stderr=asyncio.subprocess.PIPE, env=penv)
             for r in range(cfg.workers)]
    async with await connect(servers) as client:
        watcher = asyncio.ensure_future(_watch(client, name, target, on_progress, interval))
        try:
            outs = await asyncio.wait_for(asyncio.gather(*(_finish(p, r) for r, p in enumerate(procs))), timeout)
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Smb2Error):
                await watcher
        wall = time.perf_counter() - t0
        # evaluate what the job left in the shared buffer, attaching by name only
        store = await ParameterStore.attach(client, name, timeout=10)
        if on_progress is not None:
            on_progress(await store.progress(), target)
        model = MLP(cfg.sizes)
        accuracy = model.accuracy(store.params, split[2], split[3])
        # every worker process has exited: nobody uses the store any more
        await store.destroy()
    samples = sum(o["samples"] for o in outs)
    seconds = max(o["seconds"] for o in outs)
    result: dict[str, Any] = {
        "rule": cfg.rule + (f"+drop{cfg.dropping:g}" if cfg.dropping is not None else ""),
        "workers": cfg.workers, "servers": len(servers), "epochs": cfg.epochs, "accuracy": accuracy,
        "samples": samples, "seconds": seconds, "wall_seconds": wall, "samples_per_s": samples / seconds,
        "bytes_pulled": sum(o["bytes_pulled"] for o in outs),
        "bytes_pushed": sum(o["bytes_pushed"] for o in outs),
        "iterations": [o["iterations"] for o in outs], "target": target, "per_worker": outs,
        # the share of the workers' time not spent computing gradients
        "comm_fraction": 1 - sum(o["compute_seconds"] for o in outs) / sum(o["seconds"] for o in outs),
    }
    result["bytes_moved"] = result["bytes_pulled"] + result["bytes_pushed"]
    if cfg.dropping is not None:
        sent = sum(o["dropping"]["bytes_sent"] for o in outs)
        saved = sum(o["dropping"]["bytes_saved"] for o in outs)
        result["dropping"] = {"bytes_sent": sent, "bytes_saved": saved, "saved_fraction": saved / (sent + saved)}
    return result


async def _finish(proc: asyncio.subprocess.Process, rank: int) -> dict[str, Any]:
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise Smb2Error(f"worker {rank} failed (exit {proc.returncode}):\n"
                        f"{err.decode(errors='replace')[-3000:]}")
    return dict(json.loads(out.decode().strip().splitlines()[-1]))


async def _watch(client: Any, name: str, target: int, on_progress: ProgressCallback | None,
                 interval: float) -> None:
    if on_progress is None:
        return
    store = await ParameterStore.attach(client, name, timeout=60)
    while True:
        on_progress(await store.progress(), target)
        await asyncio.sleep(interval)


def single_process(cfg: JobConfig, split: datasets.Split) -> dict[str, Any]:
    """The baseline: the same model and epochs, trained by one process with
    plain SGD on all the data (no smb2)."""
    model = MLP(cfg.sizes)
    params = model.init(cfg.seed)
    t0 = time.perf_counter()
    sgd_epochs(model, params, split[0], split[1], epochs=cfg.epochs, batch=cfg.batch, lr=cfg.lr, seed=cfg.seed)
    seconds = time.perf_counter() - t0
    samples = cfg.epochs * len(split[0])
    return {"rule": "single process", "workers": 1, "servers": 0, "epochs": cfg.epochs,
            "accuracy": model.accuracy(params, split[2], split[3]), "samples": samples,
            "seconds": seconds, "samples_per_s": samples / seconds, "bytes_moved": 0,
            "bytes_pulled": 0, "bytes_pushed": 0}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return _worker_main(argv[1:])
    print("usage: python -m smb2.train.example.job worker --servers H:P,... --name N --rank R --config JSON --data NPZ",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
