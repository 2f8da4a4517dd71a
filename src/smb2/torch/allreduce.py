"""Rule ``allreduce`` in a torch training loop: each step's gradients go out,
and the optimizer steps on the mean of a round.

:class:`~smb2.train.rules.AllReduce` makes the mean on the servers; here the
gradients (a buffer's value, for a float buffer such as BatchNorm's running
statistics, whose mean every worker then takes) are copied into a flat host
array laid out like the store's data, and the mean comes back into each
parameter's ``.grad``.  With ``staleness=1`` a step's round travels while
the next step computes, and that next step applies it; the first step then
applies nothing.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from ..train.rules import AllReduce
from .loop_thread import LoopThread
from .staging import Entry

Wrap = Callable[[Coroutine[Any, Any, Any], int], Coroutine[Any, Any, None]]


class MeanGradients:
    """The rounds of one worker: :meth:`launch` sends a step's gradients,
    :meth:`apply_due` puts the mean of the oldest round into the gradients
    once ``staleness`` rounds are in flight beside it."""

    def __init__(self, torch: Any, entries: list[Entry], size: int, rule: AllReduce, loop: LoopThread,
                 wrap: Wrap) -> None:
        self.torch = torch
        self.entries = entries
        self.size = size
        self.rule = rule
        self.loop = loop
        self.wrap = wrap        # the exchange's faults in training terms
        self.inflight: collections.deque[tuple[concurrent.futures.Future[Any], np.ndarray, np.ndarray]] = \
            collections.deque()
        self._free: list[tuple[np.ndarray, np.ndarray]] = []

    def launch(self, step: int) -> None:
        """This step's gradients (zeros for a parameter without one) go out as round ``step``."""
        grad, out = self._free.pop() if self._free else (np.zeros(self.size, np.float32),
                                                          np.zeros(self.size, np.float32))
        with self.torch.no_grad():
            for e in self.entries:
                n = e.tensor.numel()
                dst = self.torch.from_numpy(grad[e.offset:e.offset + n])
                src = e.tensor.grad if e.param else e.tensor
                if src is None:
                    dst.zero_()
                else:
                    dst.copy_(src.detach().reshape(-1))
        round_ = self.wrap(self.rule.reduce(grad, out, step=step), step)
        self.inflight.append((self.loop.submit(round_), grad, out))

    @property
    def due(self) -> bool:
        """Is a round's mean to be applied now (beyond the rounds allowed in flight)?"""
        return len(self.inflight) > self.rule.staleness

    def wait_all(self) -> float:
        """Wait for every round in flight (their means stay due); the seconds waited."""
        t0 = time.perf_counter()
        for future, _, _ in self.inflight:
            future.result()
        return time.perf_counter() - t0

    def apply_oldest(self) -> float:
        """Wait for the oldest round and put its mean into the gradients
        (parameters) or the values (buffers); the seconds waited."""
        future, grad, out = self.inflight.popleft()
        t0 = time.perf_counter()
        try:
            future.result()
        finally:
            waited = time.perf_counter() - t0
        with self.torch.no_grad():
            for e in self.entries:
                t = e.tensor
                mean = self.torch.from_numpy(out[e.offset:e.offset + t.numel()]).view(t.shape)
                if not e.param:
                    t.copy_(mean)
                elif t.grad is None:
                    t.grad = mean.to(device=t.device, dtype=t.dtype, copy=True)
                else:
                    t.grad.copy_(mean)
        self._free.append((grad, out))
        return waited
