"""The script ``examples/torch_train.py`` is ported from: the same training
under torch DDP (gloo), launched the same way, without memory servers:

    torchrun --standalone --nproc-per-node 4 examples/torch_train_ddp.py

The model, the loop (zero_grad, backward, clip_grad_norm_, step), the
optimizers and the data are torch_train.py's own, imported from it, so that
the two scripts differ only in the lines docs/training.md's "Porting a torch
script" shows.  ``smb2 bench classifier`` runs both, seed by seed, to show
whether the port ends where DDP does.  Each rank prints one JSON line, as
torch_train.py's ranks do: its steps, its last loss and the test accuracy
of its model (DDP keeps every rank's parameters equal and broadcasts rank
0's buffers before each forward).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from smb2.train.example import data
from torch_train import accuracy, make_model, make_optimizer, train


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--seed", type=int, default=0, help="the model's initial weights")
    a = p.parse_args()

    dist.init_process_group("gloo")
    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = (torch.from_numpy(v) for v in data.digits())
    xtr, xte = xtr.view(-1, 1, 8, 8), xte.view(-1, 1, 8, 8)
    model = DDP(make_model())
    opt = make_optimizer(model, a.optimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = torch.arange(rank, len(xtr), world)
    t0 = time.perf_counter()
    loss = train(model, opt, sched, xtr, ytr, shard, a.epochs, a.batch)
    steps = a.epochs * -(-len(shard) // a.batch)
    report = {"rank": rank, "world": world, "rule": "ddp", "optimizer": a.optimizer, "steps": steps,
              "loss": round(loss, 4), "accuracy": round(accuracy(model.module, xte, yte), 2),
              "seconds": round(time.perf_counter() - t0, 2)}
    print(json.dumps(report) + "\n", end="", flush=True)  # one write: ranks share torchrun's stdout
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
