"""Does asynchronous training with the porting recipe survive an overloaded host?

An overloaded host with a straggler, as a user meets it: the torch CNN of
``examples/torch_train.py`` on digits (SGD, lr 0.05, momentum 0.9; no
gradient clipping unless ``--clip``), wrapped by the asynchronous porting
recipe's one line ``AsyncOptimizer(opt, model, name=..., rule="delta",
staleness=1)`` (the default port before the default rule became
``allreduce``, whose workers move in lockstep), 3 torchrun workers,
the last one ``--slow-ms`` (30) slower per step, and ``--hogs`` (3) busy
processes beside them.  One torchrun job trains ``--runs`` models one after
another (a fresh model, optimizer and store each, seeds ``--seed + i``), so
the workers start once.  In each run rank 0 evaluates its model on the test
set every ``--eval-every`` seconds (off the clock) and ends the run when it
reaches ``--target`` (95 %) or the ``--budget`` (60 s) runs out; then every
rank closes with ``close(wait_all=...)`` and rank 0 evaluates the model the
run delivers (the shared weights).

    python tools/studies/async_collapse.py --runs 5 [--hogs 3] [--old-default] [--json out.json]

prints one line per run (time to target, the delivered model's accuracy,
steps, and the optimizer's guard counts) and the count of runs that reached
the target.  It starts its own two ``smb2-server`` processes.  A run counts
as collapsed when the delivered model is at chance (below 20 %).
``--old-default`` runs the arithmetic the recipe had before the stable
configuration became the default (``average=False, lag_scaling=False``).
``--budget-steps N`` counts the budget in rank 0's steps instead, and rank
0 then evaluates every ``--eval-every-steps`` steps: what a run achieves no
longer depends on how fast the machine is (``tests/test_async_collapse.py``
calls :func:`run_job` so, 5 runs).

``python tools/studies/async_collapse.py --worker ...`` is what torchrun runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from smb2.testing.workers import json_objects

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "torch_train.py"
CHANCE = 20.0       # digits has 10 classes: a collapsed model scores about 9-10 %


def _worker(a: argparse.Namespace) -> None:
    """One torchrun worker: ``a.runs`` trainings with the porting recipe,
    unchanged, plus a clock; one JSON line per run."""
    import importlib.util

    import torch

    import smb2.torch  # noqa: F401  (imported before the busy processes start, as torch is)
    from smb2.train.example import data

    spec = importlib.util.spec_from_file_location("torch_train_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = (torch.from_numpy(v) for v in data.digits())
    xtr, xte = xtr.view(-1, 1, 8, 8), xte.view(-1, 1, 8, 8)
    # the busy processes start once every worker has loaded (the scenario is
    # training beside them: starting torch beside them only costs minutes)
    ex.make_optimizer(ex.make_model(), "sgd")   # torch loads its optimizers' machinery at the first one
    Path(f"{a.stop_file}-ready-{rank}").touch()
    busy = Path(f"{a.stop_file}-busy")
    while not busy.exists():
        time.sleep(0.05)
    for i in range(a.runs):
        report = _train_one(a, ex, (xtr, ytr, xte, yte), rank, world, f"{a.name}-{i}", a.seed + i,
                            Path(f"{a.stop_file}-{i}"))
        print(json.dumps(dict(report, run=i)) + "\n", end="", flush=True)
    Path(f"{a.stop_file}-done-{rank}").touch()        # the busy processes may go


def _train_one(a: argparse.Namespace, ex: Any, digits: tuple[Any, ...], rank: int, world: int, name: str,
               seed: int, stop: Path) -> dict[str, Any]:
    """One run: a fresh model and store, trained until rank 0 reaches the
    target (or the budget ran out); its report."""
    import torch
    import torch.nn.functional as F

    import smb2.torch

    xtr, ytr, xte, yte = digits
    torch.manual_seed(seed)
    model = ex.make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    t_open = time.perf_counter()
    if a.old_default:
        opt = smb2.torch.AsyncOptimizer(sgd, model, name=name, rule="delta", staleness=1, average=False,
                                        lag_scaling=False)
    else:
        opt = smb2.torch.AsyncOptimizer(sgd, model, name=name, rule="delta", staleness=1)  # the recipe's line
    shard = torch.arange(rank, len(xtr), world)
    slow = a.slow_ms / 1000 if rank == world - 1 else 0.0
    t0 = time.perf_counter()
    open_s = t0 - t_open
    off_clock = 0.0                         # seconds spent evaluating
    next_eval = t0 + a.eval_every
    by_steps = a.budget_steps is not None

    def within_budget(now: float) -> bool:
        if not by_steps:
            return now - t0 - off_clock < a.budget
        return rank != 0 or step < a.budget_steps    # the others go on until rank 0 says stop

    reached = None
    reached_step = None
    best = 0.0
    curve: list[tuple[float, float]] = []
    step = 0
    epoch = 0
    error = None
    try:
        while reached is None and not stop.exists() and within_budget(time.perf_counter()):
            order = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(epoch))]
            epoch += 1
            for i in range(0, len(order), 32):
                idx = order[i:i + 32]
                model.train()
                loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
                opt.zero_grad()
                loss.backward()
                if a.clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                step += 1
                if slow:
                    time.sleep(slow)
                now = time.perf_counter()
                if rank == 0 and (step % a.eval_every_steps == 0 if by_steps else now >= next_eval):
                    acc = ex.accuracy(model, xte, yte)
                    best = max(best, acc)
                    curve.append((round(now - t0 - off_clock, 1), round(acc, 1)))
                    off_clock += time.perf_counter() - now
                    next_eval = time.perf_counter() + a.eval_every
                    if acc >= a.target:
                        reached, reached_step = now - t0 - off_clock, step
                        break
                if not within_budget(now) or (step % 10 == 0 and stop.exists()):
                    break
            else:
                continue
            break
        if rank == 0:
            stop.touch()        # reached or out of budget: the run ends for every rank
        stats = opt.stats()
        t_close = time.perf_counter()
        opt.close(wait_all=120)
        stats["close_s"] = time.perf_counter() - t_close
    except Exception as exc:    # reported, the run counts as failed
        error = f"{type(exc).__name__}: {exc}"
        stats = {}
        stop.touch()
    final = ex.accuracy(model, xte, yte) if error is None else None
    return {"rank": rank, "steps": step, "reached_s": None if reached is None else round(reached, 2),
            "reached_step": reached_step,
            "best": round(best, 2), "curve": curve[-8:], "final": None if final is None else round(final, 2),
            "error": error,
            "guard": {k: stats.get(k) for k in ("skipped", "max_version_lag", "lag_scaled", "collapses")},
            "open_s": round(open_s, 2), "close_s": round(stats.get("close_s", 0.0), 2),
            "eval_s": round(off_clock, 2), "wall_s": round(time.perf_counter() - t_open, 2)}


def _hog() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def run_job(servers: str, *, runs: int, hogs: int = 3, slow_ms: float = 30.0, budget: float = 60.0,
            budget_steps: int | None = None, eval_every_steps: int = 10, target: float = 95.0,
            name: str = "collapse", workers: int = 3, seed: int = 0, eval_every: float = 0.5, clip: bool = False,
            old_default: bool = False, timeout: float = 600) -> list[dict[str, Any]]:
    """One torchrun job of ``workers`` that trains ``runs`` models in turn
    beside ``hogs`` busy processes; rank 0's report of each run (time to
    target, the delivered model's accuracy, ``collapsed``...), or one row
    with ``error`` when the job failed."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, SMB2_SERVERS=servers, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
               __file__, "--worker", "--name", name, "--stop-file", str(Path(tmp) / "stop"), "--runs", str(runs),
               "--slow-ms", str(slow_ms), "--budget", str(budget), "--target", str(target), "--seed", str(seed),
               "--eval-every", str(eval_every), "--eval-every-steps", str(eval_every_steps)] + \
              (["--budget-steps", str(budget_steps)] if budget_steps is not None else []) + \
              (["--clip"] if clip else []) + \
              (["--old-default"] if old_default else [])
        busy: list[subprocess.Popen[bytes]] = []
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as job:
            try:
                deadline = time.monotonic() + timeout
                ready = [Path(tmp) / f"stop-ready-{r}" for r in range(workers)]
                while job.poll() is None and not all(f.exists() for f in ready) and time.monotonic() < deadline:
                    time.sleep(0.05)
                busy = [_hog() for _ in range(hogs)]
                (Path(tmp) / "stop-busy").touch()
                done = [Path(tmp) / f"stop-done-{r}" for r in range(workers)]
                while job.poll() is None and not all(f.exists() for f in done) and time.monotonic() < deadline:
                    time.sleep(0.05)
                for p in busy:
                    p.kill()
                stdout, stderr = job.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except BaseException:
                job.kill()
                raise
            finally:
                for p in busy:
                    p.kill()
                    p.wait()
        out = subprocess.CompletedProcess(cmd, job.returncode, stdout, stderr)
    ranks = json_objects(out.stdout)
    rows = []
    for i in range(runs):
        r0 = next((dict(r) for r in ranks if r["rank"] == 0 and r["run"] == i), None)
        if r0 is None:
            break
        r0["collapsed"] = r0["final"] is None or r0["final"] < CHANCE
        r0["ranks"] = [r for r in ranks if r["run"] == i]
        rows.append(r0)
    if out.returncode != 0 or len(rows) < runs:
        errors = [line for line in out.stderr.splitlines() if "Error" in line and "ChildFailed" not in line]
        rows.append({"error": f"torchrun exited {out.returncode}: {' | '.join(errors[-5:])}", "ranks": ranks})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stop-file", help=argparse.SUPPRESS)
    p.add_argument("--name", default="collapse")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--hogs", type=int, default=3)
    p.add_argument("--slow-ms", type=float, default=30.0)
    p.add_argument("--budget", type=float, default=60.0)
    p.add_argument("--budget-steps", type=int, help="the budget in rank 0's steps instead of seconds")
    p.add_argument("--target", type=float, default=95.0)
    p.add_argument("--eval-every", type=float, default=0.5)
    p.add_argument("--eval-every-steps", type=int, default=10, help="with --budget-steps: rank 0 evaluates so often")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clip", action="store_true",
                   help="clip_grad_norm_(1.0) in the loop (the issue's loop had none: without it, main collapsed)")
    p.add_argument("--old-default", action="store_true",
                   help="AsyncOptimizer(..., average=False, lag_scaling=False): each worker's change whole and no "
                        "lag scaling, the recipe's arithmetic before the stable configuration became the default")
    p.add_argument("--json")
    a = p.parse_args()
    if a.worker:
        _worker(a)
        return

    import smb2

    async def job() -> list[dict[str, Any]]:
        async with smb2.LocalCluster(servers=2, processes=True) as cluster:
            return await asyncio.to_thread(
                run_job, ",".join(cluster.addresses), runs=a.runs, hogs=a.hogs, slow_ms=a.slow_ms,
                budget=a.budget, budget_steps=a.budget_steps, eval_every_steps=a.eval_every_steps,
                target=a.target, name=f"{a.name}-{os.getpid()}", seed=a.seed, eval_every=a.eval_every,
                clip=a.clip, old_default=a.old_default)

    t0 = time.perf_counter()
    rows = asyncio.run(job())
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k != "ranks"}), flush=True)
    ok = sum(1 for r in rows if r.get("reached_s") is not None and not r.get("collapsed"))
    collapsed = sum(1 for r in rows if r.get("collapsed"))
    budget = f"{a.budget} s" if a.budget_steps is None else f"{a.budget_steps} of rank 0's steps"
    print(f"{ok} of {a.runs} runs reached {a.target} % within {budget}; {collapsed} delivered a "
          f"collapsed model (< {CHANCE} %); the job took {time.perf_counter() - t0:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
