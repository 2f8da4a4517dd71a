"""PyTorch adapter: a ``torch.nn.Module`` trained through a smb2 parameter store.

An ordinary training loop uses :class:`AsyncOptimizer` (no asyncio: see
:mod:`smb2.torch.optimizer`)::

    opt = smb2.torch.AsyncOptimizer(torch.optim.AdamW(model.parameters()), model, name="run-17",
                                    rule="diloco")      # docs/training.md, "Which rule, when"
    for x, y in loader:
        loss_fn(model(x), y).backward()
        opt.step(); opt.zero_grad()
    opt.close()

asyncio code may use the store directly through :class:`DistributedModule`::

    import smb2, smb2.torch
    model = torch.nn.Sequential(...)
    async with await smb2.connect() as client:             # SMB2_SERVERS=h:p,...
        dm = await smb2.torch.DistributedModule.open(client, "mlp", model, rule="accumulate", lr=0.05)
        for x, y in batches:
            loss = loss_fn(model(x), y)
            loss.backward()
            await dm.step()          # push the gradients, zero them, pull fresh weights

The module's parameters are bound to the store's local mirror without
copies (``param.data`` becomes a tensor over the mirror's memory), so a pull
updates the module in place, and ``param.grad`` is pushed as a numpy view.
Every rank's place in the job comes from :func:`resolve_rank`, the one
resolver of the package: an explicit ``rank=``/``world_size=``, else
``SMB2_RANK``/``SMB2_WORLD_SIZE`` (one torchrun per worker), else torchrun's
``RANK``/``WORLD_SIZE``, else 0/1.  ``opt.rank``/``opt.world`` (and
``dm.rank``/``dm.world``) are what it resolved: shard the data by them, so
both launch recipes shard alike.  Rank 0 creates the store, the others
attach to it by name.  CPU tensors, float32
or float64.

torch is imported lazily (``pip install 'smb2[torch]'``): importing this
module without torch works; using it raises :class:`~smb2.InterfaceError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..client import Client
from ..errors import InterfaceError, InvalidArgumentError
from ..train.dropping import LayerDropping
from ..train.rules import UpdateRule
from ..train.store import ParameterStore, resolve_rank

if TYPE_CHECKING:
    import torch

    from .optimizer import AsyncOptimizer


def __getattr__(name: str) -> Any:
    # AsyncOptimizer subclasses torch.optim.Optimizer (LR schedulers check
    # for one), so it is defined where torch is imported: on first use
    if name == "AsyncOptimizer":
        _torch()
        from .optimizer import AsyncOptimizer
        return AsyncOptimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise InterfaceError("smb2.torch needs PyTorch", hint="pip install 'smb2[torch]'") from None
    return torch


#: the attribute under which ``torch.compile(model)`` holds the model it compiled
COMPILED_MODULE = "_orig_mod"


def store_name(name: str) -> str:
    """The name a store gives a module's tensor: its name in the module
    without the components ``torch.compile`` adds (``_orig_mod.0.weight`` is
    ``0.weight``), so that a model and the same model compiled (whole, or a
    submodule of it) are one model to a store, and a run made with one
    resumes with the other."""
    return ".".join(part for part in name.split(".") if part != COMPILED_MODULE)


def named_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``module.named_parameters()`` by their store names (:func:`store_name`)."""
    return [(store_name(n), p) for n, p in module.named_parameters()]


def named_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module.named_buffers()`` by their store names (:func:`store_name`)."""
    return [(store_name(n), b) for n, b in module.named_buffers()]


def module_arrays(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """The module's parameters as numpy arrays (copies), by their store names."""
    out = {}
    for name, p in named_parameters(module):
        if p.device.type != "cpu":
            raise InvalidArgumentError(f"parameter {name!r} is on {p.device}; smb2.torch binds CPU tensors")
        out[name] = p.detach().numpy().copy()
    return out


class DistributedModule:
    """A module whose parameters live in a :class:`ParameterStore`."""

    def __init__(self, store: ParameterStore, module: torch.nn.Module) -> None:
        self.store = store
        self.module = module
        #: this worker's rank and the job's number of workers (shard the data by them)
        self.rank, self.world = store.rank, store.workers
        torch = _torch()
        self._params = named_parameters(module)
        names = [n for n, _ in self._params]
        if names != list(store.params):
            raise InvalidArgumentError(f"the module's parameters {names} are not the store's {list(store.params)}")
        for name, p in self._params:
            view = store.params[name]
            if tuple(p.shape) != view.shape:
                raise InvalidArgumentError(f"parameter {name!r} has shape {tuple(p.shape)}, "
                                           f"the store has {view.shape}")
            # no copy: the parameter's storage IS the mirror from now on
            p.data = torch.from_numpy(view)

    @classmethod
    async def open(cls, client: Client, name: str, module: torch.nn.Module, *,
                   rule: str | UpdateRule = "accumulate", rank: int | None = None,
                   world_size: int | None = None, dropping: LayerDropping | None = None,
                   stripe: int | None = None, timeout: float = 120.0, **rule_options: Any) -> DistributedModule:
        """Every rank opens the store ``name``: the first creates it from the
        module's current parameters, the others attach to it (waiting up to
        ``timeout``) and take its values.  ``rank``/``world_size`` default to
        :func:`resolve_rank` (the one precedence of the package); ``stripe`` is the store's (on
        every rank), the other options are the rule's."""
        _torch()
        rank, world_size = resolve_rank(rank, world_size)
        store = await ParameterStore.open(client, name, module_arrays(module), rule=rule, workers=world_size,
                                          rank=rank, dropping=dropping, stripe=stripe, timeout=timeout,
                                          **rule_options)
        if store.workers != world_size:
            raise InvalidArgumentError(f"store {name!r} was made for {store.workers} workers, "
                                       f"this job has WORLD_SIZE={world_size}")
        return cls(store, module)

    async def pull(self) -> None:
        """Fresh parameters from the store, in place."""
        await self.store.pull()

    def grads(self) -> dict[str, np.ndarray]:
        """The parameters' gradients as numpy views (parameters without a
        gradient are left out)."""
        return {name: p.grad.numpy() for name, p in self._params if p.grad is not None}

    async def push(self) -> None:
        """Apply the current gradients with the store's update rule."""
        await self.store.push(self.grads())

    async def step(self) -> None:
        """After ``loss.backward()``: push, zero the gradients, and pull the
        parameters if the rule trains on the shared ones."""
        await self.push()
        for _, p in self._params:
            p.grad = None
        if self.store.rule.pull_each_step:
            await self.store.pull()


__all__ = ["AsyncOptimizer", "DistributedModule", "module_arrays", "resolve_rank"]
