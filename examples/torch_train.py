"""An ordinary torch training script, trained by several workers through smb2.

A small CNN on scikit-learn's digits (no download), SGD with momentum (or
AdamW), a StepLR schedule, gradient clipping.  Start memory servers, then
launch it with torchrun; every worker gets the same SMB2_SERVERS:

    smb2-server --port 7420 & smb2-server --port 7421 &
    SMB2_SERVERS=127.0.0.1:7420,127.0.0.1:7421 \\
        torchrun --standalone --nproc-per-node 4 examples/torch_train.py

The lines marked "smb2" are all that differ from the single-process script
(docs/training.md shows the diff, and the one against DDP).  Without
``--rule`` the script passes no rule: AsyncOptimizer's default,
``allreduce`` (DDP's arithmetic), the porting recipe's one line.  ``--rule
diloco`` is the rule docs/training.md recommends ("Which rule, when"; with
SGD it also multiplies the learning rate by the number of workers);
``--rule delta`` is the asynchronous baseline (at ``--staleness 1`` unless
told).  Each rank prints one JSON line: its steps, its last loss, and the
test accuracy of the shared model once every rank finished.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import smb2.torch  # smb2
from smb2.train.example import data


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def train(model: nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
          x: torch.Tensor, y: torch.Tensor, shard: torch.Tensor, epochs: int, batch: int,
          first_epoch: int = 0, max_norm: float = 1.0, skip: int = 0) -> float:
    """The training loop, as in any torch script (from epoch ``first_epoch``,
    its first ``skip`` batches done); returns the last loss."""
    loss = torch.tensor(float("nan"))
    for epoch in range(first_epoch, epochs):
        model.train()
        order = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(epoch))]
        for i in range(skip * batch if epoch == first_epoch else 0, len(order), batch):
            idx = order[i:i + batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
        sched.step()
    return loss.item()


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item() * 100


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # beta1 0.7, not torch's 0.9: asynchronous workers add momentum of their
    # own (each pushes a step computed on weights the others moved since), and
    # 0.9 on top of it cost about a point on digits; 0.7 does as well alone
    return torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.7, 0.999), weight_decay=1e-4)


def local_steps(text: str) -> int | str:
    """--local-steps: a number of inner steps, or "auto"."""
    return text if text == "auto" else int(text)


def default_device() -> str:
    """This rank's GPU (torchrun's LOCAL_RANK over the GPUs of the host) where there is one."""
    if not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{int(os.environ.get('LOCAL_RANK', 0)) % torch.cuda.device_count()}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--name", default="digits-cnn", help="the store's name (one per job)")
    p.add_argument("--seed", type=int, default=0, help="the model's initial weights")
    p.add_argument("--staleness", type=int, default=None,
                   help="rule delta: own steps a worker may run past its last pull (default 1: the exchange "
                        "travels while the next step computes); allreduce and diloco ignore it")
    p.add_argument("--rule", choices=["allreduce", "delta", "diloco"], default=None,
                   help="how steps reach the shared model: allreduce, DDP's arithmetic, AsyncOptimizer's "
                        "default (used when no --rule is given: no rule is passed), diloco, the recommended "
                        "one, or delta, the asynchronous baseline (docs/training.md, 'Which rule, when')")
    p.add_argument("--local-steps", type=local_steps, default=None,
                   help="rule diloco: inner steps per round, or 'auto': each worker chooses them from its "
                        "measured compute and exchange times (docs/training.md, 'DiLoCo')")
    p.add_argument("--max-local-steps", type=int, default=None,
                   help="rule diloco, --local-steps auto: the most inner steps a round may take")
    p.add_argument("--outer-momentum", type=float, default=None, help="rule diloco: the outer Nesterov momentum")
    p.add_argument("--compress", default=None,
                   help="rule diloco: send each round's top-k, e.g. topk:0.05, or sparseloco:0.02 (the "
                        "residual decaying, no outer momentum; docs/training.md)")
    p.add_argument("--device", default=default_device(),
                   help="where the model trains (default: this rank's GPU where there is one, else cpu)")
    a = p.parse_args()

    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = (torch.from_numpy(v) for v in data.digits())
    xtr, xte = xtr.view(-1, 1, 8, 8).to(a.device), xte.view(-1, 1, 8, 8).to(a.device)
    ytr, yte = ytr.to(a.device), yte.to(a.device)
    model = make_model().to(a.device)
    opt = make_optimizer(model, a.optimizer)
    # smb2: the options the command line chose; none: the porting recipe's one line
    rule: dict[str, object] = {} if a.rule is None else {"rule": a.rule}
    if a.staleness is not None or a.rule == "delta":
        rule["staleness"] = 1 if a.staleness is None else a.staleness
    if a.local_steps is not None:
        rule["local_steps"] = a.local_steps
    if a.max_local_steps is not None:
        rule["max_local_steps"] = a.max_local_steps
    if a.compress is not None:
        rule["compress"] = a.compress
    if a.outer_momentum is not None:
        rule["outer_momentum"] = a.outer_momentum
    opt = smb2.torch.AsyncOptimizer(opt, model, name=a.name, **rule)  # smb2
    if a.rule == "diloco" and a.optimizer == "sgd":
        # smb2, rule diloco: each worker's round counts 1/W, so the shared model learns per sample
        # as DDP does at W times the batch: scale the inner lr by W, as DDP users do (the linear
        # scaling rule; docs/training.md, "DiLoCo"), before the schedule takes it as its start
        for group in opt.param_groups:
            group["lr"] *= opt.world
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    shard = torch.arange(opt.rank, len(xtr), opt.world)  # smb2: this rank's share of the data
    # smb2: a resumed store (a crash, a torchrun restart) continues at this rank's
    # last saved step, with its optimizer state and schedule, and a rank restarted on its
    # own is taken back at the others' step: skip the epochs and the batches done
    first_epoch, skip = divmod(opt.start_step, -(-len(shard) // a.batch))

    # smb2: with delta the ranks' changes average into one step, DDP's arithmetic; each rank clips
    # its own gradient (a mean over its batch), which carries sqrt(W) times the noise of the mean
    # over the W ranks' batches that DDP clips: clipping at sqrt(W) times DDP's threshold clips
    # about as often as DDP does (docs/training.md, "Stability").  allreduce's backward leaves the
    # ranks' mean gradient, which is clipped as DDP clips it; DiLoCo's inner steps are each rank's
    # own local training: clipped as in one process
    max_norm = 1.0 * opt.world ** 0.5 if a.rule == "delta" else 1.0
    t0 = time.perf_counter()
    loss = train(model, opt, sched, xtr, ytr, shard, a.epochs, a.batch, first_epoch, max_norm, skip)
    stats = opt.stats()
    end = opt.close(wait_all=300)  # smb2: wait for every rank, take the weights they trained

    report = {"rank": opt.rank, "world": opt.world, "rule": opt.rule_name, "optimizer": a.optimizer,
              "device": a.device, "steps": stats["steps"],
              "loss": round(loss, 4), "accuracy": round(accuracy(model, xte, yte), 2),
              "seconds": round(time.perf_counter() - t0, 2), "comm_wait_share": round(stats["comm_wait_share"], 3),
              "lag_scaled": stats["lag_scaled"], "max_version_lag": stats["max_version_lag"],
              "bytes_pushed": stats["bytes_pushed"], "exchanges": stats["exchanges"],
              "via": stats["via"],      # the servers, or this host's agent (SMB2_AGENT)
              "servers_connected": stats["servers_connected"],     # through an agent: those it reached itself
              "local_steps": stats.get("rounds"),       # diloco with --local-steps auto: its rounds' lengths
              "collapsed": end.collapsed if end else []}     # ranks that saw the shared model collapse
    print(json.dumps(report) + "\n", end="", flush=True)  # one write: ranks share torchrun's stdout


if __name__ == "__main__":
    main()
