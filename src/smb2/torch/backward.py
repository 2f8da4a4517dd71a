"""Each parameter's push starts as soon as backward produced its gradient.

With rule ``accumulate`` a step's push is ``-lr * g`` of every parameter,
and ``g`` is final when autograd finished accumulating it: torch then calls
the hook registered with ``register_post_accumulate_grad_hook``.
:class:`BackwardPushes` copies that gradient into the host array of the
coming exchange and starts the parameter's server-side accumulate in the
background loop at once, so the last layers' pushes travel while backward
still computes the first layers' gradients.

The first step pushes after ``step()``, as every step would without this:
its gradients, copied during backward, show whether the loop changes them
before the step (clipping, a loss scaler's unscaling) or makes ones that are
not finite (a loss scaler's overflow); only where neither happened do the
later steps push during backward, so a scaled or infinite gradient never
reaches the store.

The math stays the whole-step push's:

* a layer push of step ``t`` waits (in the background loop) for the
  exchange of step ``t - 1``: the servers see this worker's pushes and pulls
  in the same order as when the whole step is pushed after ``opt.step()``;
* the exchange of step ``t`` waits for the step's layer pushes before it
  pulls, pushes the parameters whose hook did not fire, and counts the step
  once in the store's version;
* a gradient that changed after its push (``clip_grad_norm_`` between
  ``backward()`` and ``step()``, a second ``backward()`` before the step, a
  step skipped after ``zero_grad()``) or a learning rate that changed is
  made right at ``step()``: the difference goes with the exchange.  Such a
  model would send those layers twice every step, so pushing during
  backward then turns itself off (logged once).

Only rules whose push is the gradient can do this: ``delta``'s change exists
only after the optimizer's step, ``locked`` would take its lock once per
layer, ``easgd`` pushes every ``tau`` steps, layer dropping ranks all the
layers of a step before it sends any.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..train.rules import UpdateRule
from .loop_thread import LoopThread
from .staging import Entry, flat_values

log = logging.getLogger("smb2.torch")


@dataclass
class StepPushes:
    """What one step pushed during backward, and what its exchange waits for."""

    grads: np.ndarray | None            # host array laid out like the data region: the gradients pushed
    after: concurrent.futures.Future[None] | None = None    # the previous step's exchange
    lrs: dict[str, float] = field(default_factory=dict)     # parameter -> the lr of its push
    futures: list[concurrent.futures.Future[None]] = field(default_factory=list)
    corrections: dict[str, np.ndarray] = field(default_factory=dict)    # parameter -> pushed as -1 * this

    def reset(self, after: concurrent.futures.Future[None] | None) -> None:
        self.after = after
        self.lrs.clear()
        self.futures.clear()
        self.corrections.clear()


async def wait_for(fut: concurrent.futures.Future[Any] | None) -> None:
    """Wait until ``fut`` is done, whatever its outcome (its error is raised
    where its owner collects it)."""
    if fut is not None and not fut.done():
        waited = asyncio.wrap_future(fut)
        await asyncio.wait([waited])
        # this copy's error is seen: the owner's future reports it (else asyncio
        # prints "Future exception was never retrieved" with a traceback at exit)
        if not waited.cancelled():
            waited.exception()


class BackwardPushes:
    """Hooks on every parameter in ``entries`` that push its gradient
    (``rule``'s ``-lr * g``, ``lr`` from ``lr()``) into the step that
    ``upcoming()`` returns."""

    def __init__(self, torch: Any, entries: list[Entry], rule: UpdateRule, loop: LoopThread,
                 upcoming: Callable[[], StepPushes], lr: Callable[[], float]) -> None:
        self.torch = torch
        self.entries = [e for e in entries if e.param]
        self.rule = rule
        self.loop = loop
        self.upcoming = upcoming
        self.lr = lr
        self.enabled = True
        #: the first step pushes after step(), as every step would without this: its gradients,
        #: copied during backward, show whether they change before step() (a loss scaler unscales
        #: them, clipping scales them) or are not finite (a scaler's overflow, which it then skips);
        #: pushing during backward starts at the next step only where neither happened
        self.probing = True
        self._probed: set[str] = set()
        #: layer pushes started during backward, in all
        self.issued = 0
        self.handles = [e.tensor.register_post_accumulate_grad_hook(self._hook_for(e)) for e in self.entries]

    def _hook_for(self, e: Entry) -> Callable[[Any], None]:
        shape, n = tuple(e.tensor.shape), e.tensor.numel()

        def hook(param: Any) -> None:
            if not self.enabled or param.grad is None:
                return
            sp = self.upcoming()
            if e.name in sp.lrs or sp.grads is None:
                return              # a second backward before step(): step() pushes the difference
            view = sp.grads[e.offset:e.offset + n]
            with self.torch.no_grad():
                self.torch.from_numpy(view).copy_(flat_values(param.grad))
            if self.probing:
                self._probed.add(e.name)
                return
            lr = self.lr()
            sp.lrs[e.name] = lr
            sp.futures.append(self.loop.submit(self._push(e.name, view.reshape(shape), lr, sp.after)))
            self.issued += 1
        return hook

    async def _push(self, name: str, g: np.ndarray, lr: float, after: concurrent.futures.Future[None] | None
                    ) -> None:
        await wait_for(after)
        await self.rule.store.count_push(await self.rule.push({name: g}, lr=lr), update=False)

    def settle_step(self, sp: StepPushes, lr: float, final: bool = True) -> None:
        """At ``step()`` (``final=False``: at ``close()`` with no step to
        come): the difference between what went out during backward and
        ``-lr * g`` of the gradients now (none when the step never comes)
        becomes ``sp.corrections``."""
        if self.probing and final:
            self._end_probe(sp)
            return
        for e in self.entries:
            used = sp.lrs.get(e.name)
            if used is None or sp.grads is None:
                continue
            pushed = self._copied(sp, e)
            now = self._gradient_now(e, pushed.dtype) if final else None
            if now is not None and used == lr and self.torch.equal(now, pushed):
                continue
            # pushed as -1 * this: -lr * g_now in all, whatever went out before
            target = np.zeros(pushed.shape, pushed.numpy().dtype) if now is None else lr * now.numpy()
            sp.corrections[e.name] = (target - used * pushed.numpy()).astype(pushed.numpy().dtype, copy=False)
        if sp.corrections and final and self.enabled:
            self.enabled = False
            log.info("the gradients of %s changed between backward() and step() (clip_grad_norm_, several "
                     "backward passes per step, a changed learning rate): their pushes were corrected; from "
                     "now on the whole step is pushed after step()", sorted(sp.corrections))

    def _copied(self, sp: StepPushes, e: Entry) -> Any:
        """The gradient of ``e`` as backward's hook copied it into the step's host array."""
        assert sp.grads is not None
        return self.torch.from_numpy(sp.grads[e.offset:e.offset + e.tensor.numel()])

    def _gradient_now(self, e: Entry, dtype: Any) -> Any:
        """The gradient of ``e`` as it is now, flat on the CPU in ``dtype`` (None: it has none)."""
        g = e.tensor.grad
        return None if g is None else flat_values(g.detach()).to("cpu", dtype)

    def _end_probe(self, sp: StepPushes) -> None:
        """At the first ``step()``: push during backward from the next step
        on if every gradient copied during backward is still the same and
        finite (nothing went out yet: this step pushes after ``step()``)."""
        self.probing = False
        changed = []
        for e in self.entries:
            if e.name not in self._probed or sp.grads is None:
                continue
            copied = self._copied(sp, e)
            now = self._gradient_now(e, copied.dtype)
            if now is None or not self.torch.equal(now, copied) or not bool(self.torch.isfinite(now).all()):
                changed.append(e.name)
        self._probed.clear()
        if changed:
            self.enabled = False
            log.info("the gradients of %s changed between backward() and step(), or were not finite (a loss "
                     "scaler, clip_grad_norm_, several backward passes per step, a changed learning rate): "
                     "every step is pushed after step()", sorted(changed))

    async def finish(self, sp: StepPushes) -> None:
        """In the background loop: wait for the step's layer pushes, then
        push its corrections."""
        if sp.futures:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in sp.futures))
        if sp.corrections:
            shaped = {n: c.reshape(self.rule.store.params[n].shape) for n, c in sp.corrections.items()}
            await self.rule.store.count_push(await self.rule.push(shaped, lr=1.0), update=False)

    def close(self) -> None:
        self.enabled = False
        for h in self.handles:
            h.remove()
        self.handles.clear()
