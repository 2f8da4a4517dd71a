"""What saving the optimizer's state for a whole resume costs the training loop.

One AsyncOptimizer worker (AdamW, rule delta, staleness 1) trains an MLP
(1024-1024-1024-10 by default: 2.1 M parameters, AdamW state 17 MB) against
a LocalCluster of two memory-server processes, with ``state_every=None``
(no saves: the baseline) and with ``state_every=E`` (a save every E s; the
default of AsyncOptimizer is 5 s, the bench uses 0.5 s to make the cost
visible), alternating the two in each round so that both see the same
machine.  Per configuration: the median and the mean time of a training
step (forward, backward, ``opt.step()``; the mean carries the steps that
began a save), the saves made, and their ratios against the baseline of
the same round (median over the rounds).  The median round trip of a
64-byte read from a server is recorded beside.

    python tools/bench_resume.py [--rounds 3] [--steps 40] [--every 0.5] [--json out.json]
    smb2 bench resume --quick         # seconds: one round of 20 steps of a small MLP
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import smb2
import smb2.torch
from smb2.torch.loop_thread import LoopThread
from smb2.train import store

from . import report
from .common import parse_with_quick

#: --quick: one round of both configurations on a small MLP; a save due every few ms, so that the
#: saving run makes saves whatever the machine's pace
QUICK = ["--rounds", "1", "--steps", "20", "--every", "0.005", "--widths", "256,256,10"]


def run(servers: str, widths: list[int], steps: int, every: float | None, name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    opt = smb2.torch.AsyncOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, name=name,
                                    servers=servers, rule="delta", staleness=1, resume=False, rank=0,
                                    world_size=1, state_every=every)
    x = torch.randn(32, widths[0])
    y = torch.randint(0, widths[-1], (32,))
    times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i >= 3:                      # warm-up steps are not counted
            times.append(time.perf_counter() - t0)
    saves = opt._saved.saves if every is not None else 0     # noqa: SLF001 (a bench reads the count)
    opt.close()
    return {"every_s": every, "median_ms": statistics.median(times) * 1e3,
            "mean_ms": statistics.fmean(times) * 1e3, "max_ms": max(times) * 1e3, "saves": saves,
            "state_mb": sum(p.numel() for p in model.parameters()) * 8 / 1e6}


async def remove(servers: list[str], name: str) -> None:
    async with await smb2.connect(servers) as c:
        await store.remove(c, name)      # the store and its state buffers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=float, default=0.5)
    p.add_argument("--widths", default="1024,1024,1024,10")
    p.add_argument("--json", help="write the results here")
    a = parse_with_quick(p, argv, QUICK, "the baseline and the saving run, their ratios, the round trip")
    torch.set_num_threads(1)
    widths = [int(w) for w in a.widths.split(",")]
    loop = LoopThread("bench-cluster")
    cluster = smb2.LocalCluster(servers=2, processes=True)
    loop.run(cluster.start())
    rows = []
    try:
        servers = ",".join(cluster.addresses)
        report.progress("resume", 0, a.rounds, f"rounds of {a.steps} steps, without and with saving every {a.every} s")
        for r in range(a.rounds):
            rtt = loop.run(report.round_trip_us(cluster.addresses))
            base = run(servers, widths, a.steps, None, f"bench-resume-{r}-base")
            saving = run(servers, widths, a.steps, a.every, f"bench-resume-{r}-saves")
            for name in (f"bench-resume-{r}-base", f"bench-resume-{r}-saves"):
                loop.run(remove(cluster.addresses, name))
            for row in (base, saving):
                row.update(round=r, rtt_us=rtt, median_ratio=row["median_ms"] / base["median_ms"],
                           mean_ratio=row["mean_ms"] / base["mean_ms"])
                rows.append(row)
            report.progress("resume", r + 1, a.rounds, "round",
                            **{"step time": f"x{saving['median_ratio']:.3f} saving"})
    finally:
        loop.run(cluster.close())
        loop.stop()
    saving_rows = [r for r in rows if r["every_s"] is not None]
    summary = {"median_ratio": statistics.median(r["median_ratio"] for r in saving_rows),
               "mean_ratio": statistics.median(r["mean_ratio"] for r in saving_rows),
               "rtt_us": statistics.median(r["rtt_us"] for r in rows)}
    print(report.table(
        ["round", "state every s", "step median ms", "x", "mean ms", "x", "max ms", "saves", "state MB",
         "64-byte read us"],
        [[r["round"], r["every_s"], r["median_ms"], r["median_ratio"], r["mean_ms"], r["mean_ratio"], r["max_ms"],
          r["saves"], r["state_mb"], r["rtt_us"]] for r in rows],
        formats=[None, None, "{:.2f}", "{:.3f}", "{:.2f}", "{:.3f}", "{:.1f}", None, "{:.0f}", "{:.0f}"]))
    print(f"saving every {a.every} s: step time x{summary['median_ratio']:.3f} (median), "
          f"x{summary['mean_ratio']:.3f} (mean), medians over {a.rounds} rounds; "
          f"64-byte read {summary['rtt_us']:.0f} us")
    if a.json:
        report.write_json(a.json, {"args": vars(a), "quick": a.quick, "rows": rows, "summary": summary},
                          round_trip_64B_us=summary["rtt_us"])
    return 0


if __name__ == "__main__":
    main()
