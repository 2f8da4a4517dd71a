"""A PyTorch model trained asynchronously by several processes through smb2.

For an ordinary (not async) training loop use ``smb2.torch.AsyncOptimizer``
instead: see examples/torch_train.py.  This example drives the store from
asyncio code.

With torchrun, against memory servers you started (every worker gets the
same SMB2_SERVERS; rank 0 creates the store, the others attach by name):

    smb2-server --port 7420 & smb2-server --port 7421 &
    SMB2_SERVERS=127.0.0.1:7420,127.0.0.1:7421 \\
        torchrun --nproc-per-node 2 examples/torch_async_training.py

Standalone, it starts a LocalCluster of 2 servers and spawns the workers
itself (setting RANK and WORLD_SIZE as torchrun would):

    python examples/torch_async_training.py --workers 2

Needs ``pip install 'smb2[torch]'``; uses scikit-learn's digits if it is
installed, synthetic data otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import torch

import smb2
import smb2.torch


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    try:
        from smb2.train.example import data
        xtr, ytr, xte, yte = data.digits()
    except smb2.InterfaceError:
        from smb2.train.example import data
        xtr, ytr, xte, yte = data.synthetic(1500, 64, 10, test=500)
    return (torch.from_numpy(xtr), torch.from_numpy(ytr), torch.from_numpy(xte), torch.from_numpy(yte))


async def worker(servers: str, epochs: int) -> None:
    rank, world = smb2.torch.resolve_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    xtr, ytr, xte, yte = load_data()
    shard = torch.arange(rank, len(xtr), world)
    async with await smb2.connect(servers) as client:
        dm = await smb2.torch.DistributedModule.open(client, "torch-example", model, rule="accumulate", lr=0.05)
        await dm.store.join(timeout=60)          # start together
        t0 = time.perf_counter()
        steps = 0
        for epoch in range(epochs):
            order = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(epoch * 100 + rank))]
            for s in range(0, len(order), 32):
                idx = order[s:s + 32]
                loss = torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
                loss.backward()
                await dm.step()                  # push grads, pull the shared weights
                steps += 1
            await dm.store.heartbeat(steps)      # this rank's progress, for stalled-rank reports
        await dm.store.finish()                  # this rank is done (nothing is destroyed)
        await dm.store.wait_finished(timeout=120)  # everyone done: the shared weights are final
        await dm.pull()
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item() * 100
        print(f"rank {rank}/{world}: {steps} steps in {time.perf_counter() - t0:.1f} s, "
              f"loss {loss.item():.3f}, test accuracy of the shared model {acc:.2f} %", flush=True)


async def standalone(workers: int, epochs: int) -> int:
    async with smb2.LocalCluster(servers=2, processes=True) as cluster:
        servers = ",".join(cluster.addresses)
        procs = []
        for r in range(workers):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(workers), SMB2_SERVERS=servers)
            procs.append(await asyncio.create_subprocess_exec(sys.executable, __file__, "--epochs", str(epochs),
                                                              env=env))
        codes = [await p.wait() for p in procs]
    return max(codes)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="standalone mode: worker processes to spawn")
    p.add_argument("--epochs", type=int, default=10)
    a = p.parse_args()
    servers = os.environ.get("SMB2_SERVERS")
    if servers and "RANK" in os.environ:
        asyncio.run(worker(servers, a.epochs))
        return 0
    if servers:
        # one process without torchrun: a world of one
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        asyncio.run(worker(servers, a.epochs))
        return 0
    return asyncio.run(standalone(a.workers, a.epochs))


if __name__ == "__main__":
    sys.exit(main())
