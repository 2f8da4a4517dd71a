"""How would rule ``diloco``'s outer step train the digits example? A quick simulation.

The arithmetic of rule ``diloco`` (docs/training.md, "DiLoCo"), simulated in
one process in float32, to try many settings in seconds each; the servers,
the wire (bfloat16) and real timing are not in it, and
``tests/test_torch_diloco.py``'s torchrun test is the check on the real
thing.  ``W`` workers of ``examples/torch_train.py`` (its model, optimizer,
clipping, schedule and data order; shard ``rank::W``) at equal speed: each
trains its own copy for ``--local-steps`` steps, then the round's pushes
land one after another in a random order (``--seed``), each worker pulling
the shared weights right after its own push.  Outer steps (``--outer``):

* ``delayed`` (the rule's): each pseudo-gradient ``D`` moves the weights by
  ``-lr_out s D`` (``s`` = 1/W) and waits in ``B``; every W-th push the
  momentum step ``m = mu M + B``, ``w -= lr_out mu m``, ``B = 0``;
* ``each``: a Nesterov step per pseudo-gradient (the rule before):
  ``m = mu M + s D``, ``w -= lr_out (s D + mu m)``;
* ``sync``: synchronous DiLoCo: every worker starts each round from the same
  weights, one Nesterov step on the mean ``D``;
* ``single``: the example in one process (the reference).

Model buffers (BatchNorm's statistics) take the workers' mean change.

    python tools/studies/diloco_sim.py --outer delayed --inner-lr-scale 4 --seeds 0 1 2

prints one JSON line per run (the settings and the shared model's test
accuracy).  Needs torch and scikit-learn.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smb2.testing.torch_models import load_example
from smb2.train.example import data


def _steps(ex: ModuleType, model: nn.Module, opt: torch.optim.Optimizer, sched: Any, x: torch.Tensor,
           y: torch.Tensor, shard: torch.Tensor, epochs: int, batch: int) -> Iterator[None]:
    """The example's loop, one step at a time."""
    for epoch in range(epochs):
        model.train()
        order = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(epoch))]
        for i in range(0, len(order), batch):
            idx = order[i:i + batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            yield
        sched.step()


def _tensors(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return list(model.parameters()), [b for b in model.buffers() if b.dtype.is_floating_point]


class Shared:
    """The shared weights and the outer step's state."""

    def __init__(self, model: nn.Module, outer: str, workers: int, lr: float, mu: float) -> None:
        self.model, self.outer, self.workers, self.lr, self.mu = model, outer, workers, lr, mu
        self.params, self.buffers = _tensors(model)
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.pending = [torch.zeros_like(p) for p in self.params]
        self.pushes = 0

    @torch.no_grad()
    def push(self, d_params: list[torch.Tensor], d_buffers: list[torch.Tensor]) -> None:
        """One pseudo-gradient (``start - local``) lands."""
        s = 1.0 / self.workers
        for b, d in zip(self.buffers, d_buffers):
            b -= s * d
        self.pushes += 1
        if self.outer == "each":
            for w, m, d in zip(self.params, self.momentum, d_params):
                m.mul_(self.mu).add_(d, alpha=s)
                w -= self.lr * (s * d + self.mu * m)
            return
        for w, b, d in zip(self.params, self.pending, d_params):
            w -= self.lr * s * d
            b += s * d
        if self.pushes % self.workers == 0:
            for w, m, b in zip(self.params, self.momentum, self.pending):
                m.mul_(self.mu).add_(b)
                w -= self.lr * self.mu * m
                b.zero_()

    @torch.no_grad()
    def step_on_mean(self, ds: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
        """Synchronous DiLoCo: one Nesterov step on the mean pseudo-gradient."""
        for i, b in enumerate(self.buffers):
            b -= sum(d[1][i] for d in ds) / len(ds)
        for i, (w, m) in enumerate(zip(self.params, self.momentum)):
            g = sum(d[0][i] for d in ds) / len(ds)
            m.mul_(self.mu).add_(g)
            w -= self.lr * (g + self.mu * m)


def run(outer: str, workers: int, local_steps: int, epochs: int, outer_lr: float, outer_momentum: float,
        inner_lr_scale: float, seed: int) -> float:
    """The shared model's test accuracy (%) after ``epochs`` of each worker."""
    ex = load_example()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    xtr, ytr, xte, yte = (torch.from_numpy(v) for v in data.digits())
    xtr, xte = xtr.view(-1, 1, 8, 8), xte.view(-1, 1, 8, 8)
    model = ex.make_model()
    if outer == "single":
        opt = ex.make_optimizer(model, "sgd")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        ex.train(model, opt, sched, xtr, ytr, torch.arange(len(xtr)), epochs, 32)
        return float(ex.accuracy(model, xte, yte))
    shared = Shared(model, outer, workers, outer_lr, outer_momentum)
    models = [copy.deepcopy(model) for _ in range(workers)]
    loops, starts = [], []
    for r, m in enumerate(models):
        opt = ex.make_optimizer(m, "sgd")
        for group in opt.param_groups:
            group["lr"] *= inner_lr_scale
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        loops.append(_steps(ex, m, opt, sched, xtr, ytr, torch.arange(r, len(xtr), workers), epochs, 32))
        starts.append([t.detach().clone() for t in sum(_tensors(m), [])])
    order = random.Random(seed)
    alive = list(range(workers))
    while alive:
        took = {r: sum(1 for _ in zip(range(local_steps), loops[r])) for r in alive}
        ended = [r for r in alive if took[r] < local_steps]
        alive = [r for r in alive if took[r] > 0]
        ds = {}
        for r in alive:
            now = sum(_tensors(models[r]), [])
            diff = [s - t.detach() for s, t in zip(starts[r], now)]
            ds[r] = (diff[:len(shared.params)], diff[len(shared.params):])
        if outer == "sync":
            shared.step_on_mean(list(ds.values()))
        pushing = list(alive)
        order.shuffle(pushing)
        for r in pushing:
            if outer != "sync":
                shared.push(*ds[r])
            with torch.no_grad():      # the pull: the next round starts from the shared weights
                for t, s in zip(sum(_tensors(models[r]), []), sum(_tensors(shared.model), [])):
                    t.copy_(s)
            starts[r] = [t.detach().clone() for t in sum(_tensors(shared.model), [])]
        alive = [r for r in alive if r not in ended]
    return float(ex.accuracy(shared.model, xte, yte))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--outer", choices=["delayed", "each", "sync", "single"], default="delayed")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--local-steps", type=int, default=8)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.5)
    p.add_argument("--inner-lr-scale", type=float, default=1.0, help="the example's lr times this (W: x W)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="the orders in which pushes land")
    a = p.parse_args()
    for seed in a.seeds:
        t0 = time.perf_counter()
        acc = run(a.outer, a.workers, a.local_steps, a.epochs, a.outer_lr, a.outer_momentum, a.inner_lr_scale,
                  seed)
        settings = {k: v for k, v in vars(a).items() if k != "seeds"}
        print(json.dumps({**settings, "seed": seed, "accuracy": round(acc, 2),
                          "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
