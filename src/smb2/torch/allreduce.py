"""Rule ``allreduce`` in backward: the gradients' mean is in ``.grad`` when
``backward()`` returns, as under torch DDP.

:class:`~smb2.train.rules.AllReduce` cuts the model's tensors into parts
(DDP's buckets) and makes each part's mean on the servers.  Here a hook on
every parameter (``register_post_accumulate_grad_hook``) counts the
gradients backward has produced; when a part's are all there, they are
copied into a flat host array laid out like the store's data and the part
goes out, while backward computes the earlier layers.  At the end of
backward (a callback queued on the autograd engine) the parts no gradient
reached go out too (zeros; a float buffer such as BatchNorm's running
statistics goes as its value, whose mean every worker then takes), every
part's mean is awaited and written into the parameters' ``.grad``: the
user's clipping and optimizer step then see the mean, as under DDP.  A
parameter that no worker had a gradient for (unused in the forward pass,
or frozen since the optimizer was made) keeps ``.grad`` None, so the
optimizer skips it (no weight decay, no momentum), as DDP leaves one that
is unused on every rank; one that some worker had a gradient for gets the
mean, the others counting zeros.  Every backward is a round, so every worker runs the same backward passes, but
those under ``AsyncOptimizer.no_sync()`` (DDP's ``no_sync()``, for gradient
accumulation): they send nothing, and the next backward sends the gradients
they accumulated with its own.

Ranks of one store that are threads of one process cannot share a GPU:
autograd runs the backward of every thread's model on one thread per GPU,
where the callback at the end of one rank's backward waits for the other
ranks' gradients, which that same thread would compute next.  DDP's reducer
waits there too; the second such rank is refused when it is made.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from ..train.rules import AllReduce
from .loop_thread import LoopThread
from .staging import Entry, flat_values

Wrap = Callable[[Coroutine[Any, Any, Any], int], Coroutine[Any, Any, None]]

#: (store, GPU) -> the rank of this process that has its backward there
_GPU_RANKS: dict[tuple[str, str], int] = {}
_GPU_RANKS_LOCK = threading.Lock()


def take_gpus(tensors: list[Any], store: str, rank: int) -> list[tuple[str, str]]:
    """The GPUs of rank ``rank``'s tensors, taken for it in this process;
    refused where another rank of ``store`` in this process has taken one.
    :func:`give_back_gpus` gives them back."""
    keys = sorted({(store, str(t.device)) for t in tensors if t.device.type == "cuda"})
    with _GPU_RANKS_LOCK:
        for key in keys:
            if _GPU_RANKS.get(key, rank) != rank:
                raise InvalidArgumentError(
                    f"rank {rank} of store {store!r} would train on {key[1]} beside rank {_GPU_RANKS[key]}, in "
                    f"this same process: autograd runs every thread's backward on that GPU on one thread, where "
                    f"each rank waits for the other's gradients, so both would wait forever",
                    hint="run one rank per process (torchrun --nproc-per-node), or give each rank its own GPU")
        for key in keys:
            _GPU_RANKS[key] = rank
    return keys


def give_back_gpus(keys: list[tuple[str, str]]) -> None:
    with _GPU_RANKS_LOCK:
        for key in keys:
            _GPU_RANKS.pop(key, None)


class MeanGradients:
    """One worker's rounds: parts go out from backward's hooks, and the
    means are in the gradients when backward returns.  ``step`` names the
    step a backward belongs to (in messages); ``wrap`` puts a part's faults
    in training terms."""

    def __init__(self, torch: Any, entries: list[Entry], size: int, rule: AllReduce, loop: LoopThread,
                 wrap: Wrap, step: Callable[[], int], rescale_first: Callable[[], float] | None = None) -> None:
        self.torch = torch
        self.rule = rule
        self.loop = loop
        self.wrap = wrap
        self.step = step
        self.grad = np.zeros(size, np.float32)
        self.mean = np.zeros(size, np.float32)
        self.entries = entries
        #: each part's tensors (parameters and buffers), those of which some elements are in it
        self.members: list[list[Entry]] = [[] for _ in rule.parts]
        #: the parts of each parameter with a hook (those that trained when the optimizer was made):
        #: one, or the several a large tensor is cut into
        self.part: dict[int, list[int]] = {}
        for e in entries:
            over = rule.parts_over(e.offset, e.offset + e.tensor.numel())
            for i in over:
                self.members[i].append(e)
            if e.param and e.tensor.requires_grad:
                self.part[id(e.tensor)] = over
        self.hooks = [e.tensor.register_post_accumulate_grad_hook(self._produced)
                      for e in entries if id(e.tensor) in self.part]
        # the backward under way: its round, the gradients each part still waits for, the parts sent
        self._round: int | None = None
        self._missing: list[int] = []
        self._sent: dict[int, concurrent.futures.Future[Any]] = {}
        self._dense: dict[int, Any] = {}      # (this round's sparse gradients made dense, by id)
        #: seconds backward waited for the means, in all
        self.waited = 0.0
        #: backward passes send nothing (``AsyncOptimizer.no_sync()``): the gradients accumulate here
        self.deferred = False
        #: the gradients hold this rank's own, accumulated under ``no_sync()`` since the last round
        self.unreduced = False
        #: called at the first round's start: the factor its gradients go by (a loss scale handed over)
        self._rescale_first = rescale_first
        self._factor = 1.0

    def _produced(self, tensor: Any) -> None:
        """A parameter's gradient is accumulated (autograd's hook)."""
        if self.deferred:
            self.unreduced = True       # (a later backward outside no_sync() sends the sum)
            return
        if self._round is None:
            if self._rescale_first is not None:
                self._factor, self._rescale_first = self._rescale_first(), None
            self._round = self.rule.next_round()
            self._missing = self._expected()
            self._sent = {}
            self._dense = {}
            self.torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        for i in self.part[id(tensor)]:
            self._missing[i] -= 1
            if self._missing[i] == 0:
                self._send(i)

    def _expected(self) -> list[int]:
        """How many gradients each part waits for in this backward: its
        parameters that train now (frozen since: not), all with a hook; a
        part with one that trains without (it trains since) goes at
        backward's end (-1: never counted down to 0)."""
        expected = []
        for members in self.members:
            training = [e for e in members if e.param and e.tensor.requires_grad]
            expected.append(-1 if any(id(e.tensor) not in self.part for e in training) else len(training))
        return expected

    def _send(self, part: int) -> None:
        assert self._round is not None
        first, end = self.rule.parts[part]
        with self.torch.no_grad():
            for e in self.members[part]:
                # (the tensor's elements in this part: all of it, or a piece of a large one)
                a, b = max(first, e.offset), min(end, e.offset + e.tensor.numel())
                dst = self.torch.from_numpy(self.grad[a:b])
                src = e.tensor.grad if e.param else e.tensor
                if src is None:
                    dst.zero_()
                else:
                    dst.copy_(self._flat(src)[a - e.offset:b - e.offset])
                    if e.param and self._factor != 1.0:
                        dst.mul_(self._factor)
        step = self.step()
        without = [e.name for e in self.members[part] if e.param and e.tensor.grad is None]
        work = self.rule.reduce_part(self._round, part, self.grad, self.mean, step=step, without=without)
        self._sent[part] = self.loop.submit(self.wrap(work, step))

    def _flat(self, src: Any) -> Any:
        """``src``'s values, flat; a sparse gradient made dense once a
        round, however many parts it spans."""
        if not src.is_sparse:
            return src.detach().reshape(-1)
        dense = self._dense.get(id(src))
        if dense is None:
            dense = self._dense[id(src)] = flat_values(src.detach())
        return dense

    def _backward_ended(self) -> None:
        """Send the parts no gradient completed, wait for every part's mean,
        and put it into the gradients (buffers: their values)."""
        try:
            for i in range(len(self.members)):
                if i not in self._sent:
                    self._send(i)
            t0 = time.perf_counter()
            try:
                for future in self._sent.values():
                    future.result()
                # (parts that came back before the survivors of a dead worker went on without it)
                step, r = self.step(), self._round
                assert r is not None
                self.loop.submit(self.wrap(self.rule.complete_round(r, self.grad, self.mean, step=step),
                                           step)).result()
            finally:
                self.waited += time.perf_counter() - t0
        finally:
            self._round = None
            self._dense = {}
            self._factor = 1.0
        self.unreduced = False
        unused = set().union(*self.rule.no_gradient)
        with self.torch.no_grad():
            for e in self.entries:
                t = e.tensor
                if e.name in unused:
                    continue        # (no worker had a gradient: it stays None, and the optimizer skips it, as DDP's)
                mean = self.torch.from_numpy(self.mean[e.offset:e.offset + t.numel()]).view(t.shape)
                if not e.param:
                    t.copy_(mean)
                elif t.grad is None:
                    t.grad = mean.to(device=t.device, dtype=t.dtype, copy=True)
                elif t.grad.is_sparse:
                    # (sparse as it came: an optimizer such as SparseAdam takes only sparse gradients;
                    # its rows are those any worker's gradient touched)
                    t.grad = mean.to(device=t.device, dtype=t.dtype).to_sparse()
                else:
                    t.grad.copy_(mean)

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
