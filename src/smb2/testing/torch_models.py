"""Small torch models and references for the torch tests: a model, an
AsyncOptimizer around it, the store's values read by a client of their own,
two linear heads whose every gradient is known, and the repository's example
(examples/torch_train.py) trained in one process with plain torch, as the
accuracy bar the torchrun workers must reach.  Imports torch."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import smb2
import smb2.torch as st
from smb2.testing.workers import EXAMPLES, torchrun_ranks
from smb2.torch.loop_thread import LoopThread

#: the example the torchrun tests run (the repository's: the tests run from a checkout), and the
#: same script under DDP, which it is ported from
EXAMPLE = EXAMPLES / "torch_train.py"
EXAMPLE_DDP = EXAMPLES / "torch_train_ddp.py"


def small_model(seed: int = 0, bn: bool = False) -> torch.nn.Module:
    """10 inputs, 32 hidden (with BatchNorm if ``bn``), 3 classes; seeded."""
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(10, 32)] + ([torch.nn.BatchNorm1d(32)] if bn else []) + \
        [torch.nn.ReLU(), torch.nn.Linear(32, 3)]
    return torch.nn.Sequential(*layers)


def rank_batches(steps: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of 16 samples for ``small_model`` (3 classes: how
    many of the first two inputs are positive), a rank's own (seeded by it)."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(steps, 16, 10, generator=g)
    return [(xb, (xb[:, 0] > 0).long() + (xb[:, 1] > 0).long()) for xb in x]


def async_optimizer(model: torch.nn.Module, opt: torch.optim.Optimizer, servers: str, name: str,
                    **kw: Any) -> st.AsyncOptimizer:
    """``opt`` wrapped for store ``name`` as rank 0 of 1 unless told, never resuming."""
    kw.setdefault("rank", 0)
    kw.setdefault("world_size", 1)
    return st.AsyncOptimizer(opt, model, name=name, servers=servers, resume=False, **kw)


def shared_values(opt: st.AsyncOptimizer) -> dict[str, np.ndarray]:
    """The store's current values, read by a separate client."""
    async def read() -> dict[str, np.ndarray]:
        async with await smb2.connect(opt.store.client.servers) as c:
            buf = await c.attach(opt.store.buf.name)
            flat = np.empty_like(opt.store.flat())
            await buf.read_into(flat, opt.store.data_off)
        return {n: flat[opt.store.flat_offset(n):opt.store.flat_offset(n) + v.size].reshape(v.shape).copy()
                for n, v in opt.store.params.items()}
    loop = LoopThread("test-read")
    try:
        return loop.run(read())
    finally:
        loop.stop()


def mean_step_reference(steps: int, workers: int, clip: float, micro: int = 1,
                        members: Sequence[Sequence[int]] | None = None,
                        cycle: int | None = None) -> dict[str, torch.Tensor]:
    """One process on the CPU: AdamW on the mean of ``workers`` workers'
    gradients of ``small_model`` on their ``rank_batches``, clipped to
    ``clip`` (DDP's arithmetic: the clip sees the mean); each worker's
    gradient of a step is the sum of its ``micro`` batches' (each loss over
    ``micro``).  ``members``: the ranks each step's mean is over (a worker
    lost, then taken back; default: all); ``cycle``: the ranks' batches
    repeat after that many steps.  The weights after ``steps`` steps."""
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    period = steps if cycle is None else cycle
    batches = [rank_batches(period * micro, r) for r in range(workers)]
    for s in range(steps):
        ranks = range(workers) if members is None else members[s]
        at = s % period
        sums = [torch.zeros_like(p) for p in model.parameters()]
        for r in ranks:
            model.zero_grad()
            for x, y in batches[r][at * micro:(at + 1) * micro]:
                (torch.nn.functional.cross_entropy(model(x), y) / micro).backward()
            sums = [a if p.grad is None else a + p.grad for a, p in zip(sums, model.parameters())]
        for p, a in zip(model.parameters(), sums):
            p.grad = a / len(ranks)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def in_threads(workers: int, work: Any) -> None:
    """``work(rank)`` in a thread per worker; raises the first error."""
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            work(r)
        except BaseException as e:      # noqa: BLE001 (the test thread raises it)
            # said at once: the others may wait for this rank until the test's timeout, which shows only them
            logging.getLogger("smb2.testing").error("rank %d of %d failed: %r", r, workers, e, exc_info=e)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01)


def allreduce_workers(servers: str, name: str, workers: int, loop: Any, make_model: Any = small_model,
                      make_optimizer: Any = _adamw) -> tuple[list[Any], list[st.AsyncOptimizer]]:
    """``workers`` workers in threads, each ``make_model()`` under
    ``make_optimizer(model)`` (AdamW) wrapped for rule allreduce (float32 on
    the wire), every one made before any trains: ``loop(opt, model, rank)``,
    then ``close(wait_all=30)``."""
    models = [make_model() for _ in range(workers)]
    opts: list[st.AsyncOptimizer] = []
    ready = threading.Barrier(workers)

    def worker(r: int) -> None:
        try:
            opt = async_optimizer(models[r], make_optimizer(models[r]), servers, name, rank=r, world_size=workers,
                                  rule="allreduce", push_dtype="float32")
            opts.append(opt)
            ready.wait()
        except BaseException:
            ready.abort()
            raise
        loop(opt, models[r], r)
        opt.close(wait_all=30)

    in_threads(workers, worker)
    return models, opts


def all_at(models: list[Any], ref: dict[str, torch.Tensor]) -> None:
    """Every model at ``ref``'s weights, and all of them the same, bit for bit."""
    for n, p in models[0].named_parameters():
        torch.testing.assert_close(p.detach(), ref[n], rtol=1e-5, atol=1e-6)
        for other in models[1:]:
            assert torch.equal(p.detach(), dict(other.named_parameters())[n].detach())


def sparse_model() -> torch.nn.Module:
    """A sum of 3 of 40 embedding rows (``sparse=True``: its gradient is
    sparse) before a linear head; seeded."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.EmbeddingBag(40, 6, mode="sum", sparse=True), torch.nn.Linear(6, 2))


def sparse_steps(opt: torch.optim.Optimizer, model: torch.nn.Module, device: str = "cpu") -> None:
    """4 steps of ``sparse_model`` on batches of 8 (class: whether the first
    row is below 20), the same ones every call."""
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randint(0, 40, (8, 3), generator=g).to(device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), (x[:, 0] < 20).long()).backward()
        opt.step()
        grad = next(model.parameters()).grad      # (the embedding's)
        assert grad is not None and grad.is_sparse and grad.device.type == torch.device(device).type


class TwoHeads(torch.nn.Module):
    """Two linear layers whose gradients never change (the loss is linear
    in the weights): what a step changes is known exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 2)
        for p in self.parameters():
            torch.nn.init.zeros_(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).sum() + 0.5 * self.b(x).sum()


ONES = torch.ones(8, 4)


LR = 0.125


#: every step's gradient of each parameter (8 samples of ones; head b counts half)
GRAD = {"a.weight": 8.0, "a.bias": 8.0, "b.weight": 4.0, "b.bias": 4.0}


def constant_steps(opt: torch.optim.Optimizer, model: torch.nn.Module, steps: int) -> None:
    """``steps`` steps of ``TwoHeads`` on ``ONES``: every gradient is ``GRAD``."""
    for _ in range(steps):
        opt.zero_grad()
        model(ONES).backward()
        opt.step()


def load_example() -> Any:
    """examples/torch_train.py as a module."""
    spec = importlib.util.spec_from_file_location("torch_train_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _PerRankBatches(torch.nn.Module):
    """Training forward of a batch of ``world`` ranks' batches one rank's
    batch at a time (BatchNorm normalizes each by its own statistics, as on
    DDP's ranks); evaluation forward as the model."""

    def __init__(self, model: torch.nn.Module, world: int) -> None:
        super().__init__()
        self.model, self.world = model, world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return self.model(x)
        return torch.cat([self.model(part) for part in x.chunk(self.world)])


def single_process_accuracy(kind: str, epochs: int, seed: int = 0, shard: slice = slice(None),
                             world: int = 1) -> float:
    """The example's loop in this process, plain torch, no smb2 (on the
    whole training set, or on one worker's ``shard`` of it alone).
    ``world=W``: DDP's arithmetic for W ranks of the example's batch 32: one
    step per batch of W·32, its gradient the mean of the W ranks' (the
    mean loss over the batch), clipped once, BatchNorm per rank's 32."""
    from smb2.train.example import data
    ex = load_example()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # as the example's workers do (and faster on a busy machine)
    torch.manual_seed(seed)
    xtr, ytr, xte, yte = (torch.from_numpy(v) for v in data.digits())
    xtr, xte = xtr.view(-1, 1, 8, 8), xte.view(-1, 1, 8, 8)
    model = ex.make_model()
    opt = ex.make_optimizer(model, kind)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    trained = model if world == 1 else _PerRankBatches(model, world)
    try:
        ex.train(trained, opt, sched, xtr, ytr, torch.arange(len(xtr))[shard], epochs, 32 * world)
    finally:
        torch.set_num_threads(threads)
    return float(ex.accuracy(model, xte, yte))



def torchrun_beside_single(servers: str, *args: str, kind: str = "sgd", epochs: int = 12, nproc: int = 4,
                           timeout: float = 300) -> tuple[list[dict[str, Any]], float]:
    """The example under torchrun (``nproc`` workers on ``servers``, with
    ``--optimizer kind --epochs epochs`` and ``args``), while this process
    trains the single-process reference on the same samples: every rank's
    JSON line, and the reference's accuracy.  A failed run fails with the
    end of its stderr."""
    from smb2.testing.workers import json_objects, torchrun, torchrun_failure

    env = dict(os.environ, SMB2_SERVERS=servers, OMP_NUM_THREADS="1")
    run = subprocess.Popen(torchrun(str(EXAMPLE), "--optimizer", kind, "--epochs", str(epochs), *args, nproc=nproc),
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        single = single_process_accuracy(kind, epochs)
        stdout, stderr = run.communicate(timeout=timeout)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 0, torchrun_failure(stderr)
    return json_objects(stdout), single


def example_run(servers: str, kind: str, epochs: int, *args: str,
                nproc: int = 4) -> tuple[list[dict[str, Any]], str]:
    """The example under torchrun (``nproc`` ranks on ``servers``, ``--optimizer
    kind --epochs epochs`` and ``args``): every rank's JSON line, in rank
    order, and torchrun's stderr.  A failed run fails with its ranks'
    tracebacks."""
    env = dict(os.environ, SMB2_SERVERS=servers, OMP_NUM_THREADS="1")
    return torchrun_ranks(EXAMPLE, "--optimizer", kind, "--epochs", str(epochs), *args, nproc=nproc, env=env,
                          timeout=300)


def ddp_accuracy(kind: str, epochs: int, nproc: int = 4, seed: int = 0) -> float:
    """The example's accuracy under torch DDP (examples/torch_train_ddp.py,
    ``nproc`` ranks under torchrun, the same seed, data and loop as the
    example's): rank 0's model."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ranks, _ = torchrun_ranks(EXAMPLE_DDP, "--optimizer", kind, "--epochs", str(epochs), "--seed", str(seed),
                              nproc=nproc, env=env, timeout=300)
    return float(ranks[0]["accuracy"])
