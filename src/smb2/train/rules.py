"""Update rules: how a worker's step reaches the shared parameters.

* ``"accumulate"`` (SMB1): the servers add ``-lr * g`` in place; no lock, so
  concurrent workers' updates all land (each server request is atomic with
  respect to the others), at the price of reading slightly stale weights.
* ``"locked"`` (TFSM on SMB2): under the buffer's lock, read the weights, apply
  ``w -= lr * g``, write them back; ``per_layer=True`` takes one lock per
  tensor so updates of different layers proceed in parallel.
* ``"easgd"`` (ShmCaffe's elastic averaging SGD): each worker trains its own
  copy with local SGD and every ``tau`` steps exchanges an elastic difference
  ``d = alpha * (w_local - w_center)`` with the shared center: ``w_local -= d``
  locally and ``w_center += d`` by a server-side accumulate.
* ``"delta"`` (local SGD's pseudo-gradient): the worker applies its own
  optimizer (momentum, Adam, weight decay: any torch optimizer) to its local
  weights and pushes the change ``dw = w_after - w_before`` by a server-side
  accumulate.  Concurrent workers' changes add up; with plain SGD
  ``dw = -lr * g``, so it equals ``"accumulate"``.  Its ``push`` takes the
  changes, not gradients (see :class:`smb2.torch.AsyncOptimizer`).
* ``"diloco"`` (DiLoCo, Douillard et al. 2023, made asynchronous): the worker
  trains its own copy for ``local_steps`` inner steps, then pushes its
  pseudo-gradient ``D = w_start - w_local``; an outer Nesterov step on the
  shared weights with delayed momentum (Liu et al. 2024): each
  pseudo-gradient's plain part at once, the momentum step once per W of
  them, the momentum and the pseudo-gradients waiting for it beside the store
  (``<store>/outer``), all by server-side accumulates; the worker starts its
  next round from the fresh shared weights.  ``local_steps="auto"``
  (:class:`AdaptiveDiLoCo`): each worker chooses each round's length from
  its own measured compute and exchange times (:mod:`smb2.train.local_steps`).
* ``"allreduce"`` (DDP's arithmetic, the reduction on the servers): every
  worker adds its gradient to a sum kept beside the store
  (``<store>/gradients``), waits for the others' and steps its own optimizer
  on the mean, so that every worker's weights stay the same ones, as under
  torch DDP (:class:`AllReduce`).

``wire`` (an attribute of every rule, default None) names the type a pushed
float32 change travels as ("bfloat16", "float16": half the bytes; the server
adds it into the float32 words), where the client offers it.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from ..client import Buffer, Client, as_wire
from ..errors import InterfaceError, InvalidArgumentError, NoSuchBuffer, NotifyTimeout, OutOfMemory, Smb2Error
from ..lock import Lock, ReplicatedLock
from ..mirror import AgentMirror
from . import beside, roster
from .compress import SparseLoCo, parse_spec
from .dropping import LayerDropping
from .lifecycle import Control, Waiting
from .local_steps import MOST, SHARE, LocalSteps
from .weights import AgentWeights, ServerWeights, SharedWeights

log = logging.getLogger("smb2.train")


class BoundStore(Protocol):
    """What a rule needs of the store it is bound to (``store.ParameterStore``
    satisfies it; stated here so that the rules do not import the store,
    which imports them)."""

    client: Client
    buf: Buffer
    params: dict[str, np.ndarray]
    ranges: dict[str, tuple[int, int]]
    data_off: int
    #: where the shared weights are read and accumulated (smb2.train.weights)
    weights: SharedWeights
    workers: int
    dropping: LayerDropping | None
    stats: dict[str, int]
    rank: int
    #: the updates applied in all, as of this worker's last push or pull
    version: int

    name: str
    #: the run this worker is in
    generation: int

    def flat(self) -> np.ndarray: ...

    async def pull(self) -> None: ...

    async def push_region(self, region: np.ndarray, *, step: int | None = None,
                          based_on: tuple[int, int] | None = None) -> bool: ...

    def flat_offset(self, name: str) -> int: ...

    def tensors_of(self, region: np.ndarray) -> dict[str, np.ndarray]: ...

    async def count_push(self, nbytes: int, *, update: bool = True) -> None: ...

    def count_pull(self, nbytes: int) -> None: ...

    async def bump_version(self) -> int: ...

    async def refresh(self) -> Control: ...

    def keep_beating(self) -> None: ...



def _positive(what: str, v: Any, *, upper: float | None = None) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or (upper is not None and v > upper):
        rng = f"in (0, {upper}]" if upper is not None else "> 0"
        raise InvalidArgumentError(f"{what} must be a number {rng}, not {v!r}")
    return float(v)


class UpdateRule(abc.ABC):
    """Base of the rules; ``bind`` attaches a rule to one store."""

    name = "?"
    #: the rule stages what it sends (-lr * g, a round's change) in a
    #: model-sized array of its own, made once at :meth:`bind`
    uses_stage = True
    #: gradients go to the shared buffer each push (layer dropping applies)
    gradient_rule = True
    #: each push is one step on stale weights: scaled by its lag (smb2.train.stability)
    lag_scaled = True
    #: the worker trains its own copy and meets the shared weights in an
    #: :meth:`exchange` every :attr:`exchange_every` steps (EASGD's elastic
    #: exchange, DiLoCo's outer step), instead of pushing its step and pulling
    #: the shared weights each step
    elastic = False
    #: an elastic rule's last steps (since its last exchange) go out at the
    #: worker's close, as a last, shorter round
    exchange_at_close = False
    #: a parameter's gradient may go out as soon as backward produced it
    #: (smb2.torch.backward): the push of a step is the sum of per-tensor pushes
    pushes_in_backward = False
    #: inner steps in the change being pushed: the divergence guard compares
    #: changes per inner step (an elastic round of any length against the others)
    round_steps = 1
    #: a restarted worker may go back into the run the others go on with
    #: (smb2.train.lifecycle); a rule whose workers move in lockstep says no,
    #: and a torchrun restart of the group then opens a new, resumed run
    rejoinable = True
    #: the others take a worker whose heartbeat stopped for dead: the store
    #: beats in the background from the start barrier on (ParameterStore.keep_beating)
    watches_heartbeats = False
    #: seconds of silence after which such a worker is taken for dead (None: it is not)
    dead_after: float | None = None

    def __init__(self, lr: float = 0.01) -> None:
        self.lr = _positive("lr", lr)
        self._store: BoundStore | None = None
        #: the type pushed changes travel as (None: the store's own dtype)
        self.wire: str | None = None

    @property
    def store(self) -> BoundStore:
        if self._store is None:
            raise InterfaceError(f"rule {self.name!r} is not bound to a store")
        return self._store

    def bind(self, store: BoundStore) -> None:
        if self._store is not None and self._store is not store:
            raise InterfaceError(f"rule {self.name!r} is already bound to another store")
        self._store = store
        # -lr * g of every tensor, laid out like the data region (padding
        # stays zero): allocated once, since a step of a big model would
        # otherwise pay for a fresh model-sized temporary (and its page faults)
        self._stage = np.zeros_like(store.flat()) if self.uses_stage else np.zeros(0, store.flat().dtype)

    def _delta(self, name: str, g: np.ndarray, lr: float | None = None) -> np.ndarray:
        """``-lr * g`` in the stage (a view shaped like the tensor); ``lr``
        defaults to the rule's."""
        st = self.store
        o = st.flat_offset(name)
        out = self._stage[o:o + g.size]
        np.multiply(g.reshape(-1), -(self.lr if lr is None else lr), out=out, casting="unsafe")
        return out.reshape(g.shape)

    def settings(self) -> dict[str, Any]:
        return {"name": self.name, "lr": self.lr}

    @property
    def pull_each_step(self) -> bool:
        """Should the worker pull fresh parameters before each step?"""
        return True

    @property
    def exchange_every(self) -> int:
        """Steps between two exchanges with the shared weights."""
        return 1

    async def exchange(self, step: int | None = None) -> None:
        """An elastic rule's exchange with the shared weights (see
        :attr:`elastic`): the mirror holds the local weights before, and the
        weights the worker continues from after; ``step`` names the step in
        messages."""
        raise InterfaceError(f"rule {self.name!r} pushes each step; it has no elastic exchange")

    async def open_run(self, fresh: bool) -> None:  # noqa: B027 (most rules keep nothing beside the store)
        """Rank 0 opens a run (under the store's lock, before any rank
        joins): set up what the rule keeps beside the store."""

    async def through_agent(self, agent: Client, weights: AgentWeights, *,  # noqa: B027 (most rules: nothing)
                            timeout: float, host_workers: int) -> None:
        """The store now reads and accumulates its weights through the host
        agent that ``agent`` is connected to (``weights``,
        :meth:`ParameterStore.use_agent`): a rule that also pushes into a
        buffer beside the store may send those pushes through the agent too
        (:meth:`AgentWeights.beside`)."""

    def pulled(self) -> None:  # noqa: B027 (most rules need not know)
        """The mirror now holds the shared weights (a pull)."""

    def inner_step(self) -> None:  # noqa: B027 (rules of a fixed round need not know)
        """An elastic rule's inner step ended in the training loop (its
        compute, before any wait for an exchange)."""

    def round_ended(self, steps: int) -> None:  # noqa: B027 (rules of a fixed round need not know)
        """An elastic rule's round of ``steps`` inner steps ended: its
        :meth:`exchange` comes next (and :attr:`exchange_every` is the next
        round's length)."""

    def round_stats(self) -> dict[str, Any]:
        """What the rule chose about its rounds, for ``stats()`` (most rules: nothing)."""
        return {}

    @abc.abstractmethod
    async def push(self, grads: Mapping[str, np.ndarray], *, scale: float = 1.0, lr: float | None = None) -> int:
        """Apply one step of gradients (``delta``: changes), times ``scale``,
        to the shared parameters with learning rate ``lr`` (default the
        rule's); the bytes sent.  The store counts the push
        (:meth:`ParameterStore.push`), not the rule."""

    async def push_region(self, region: np.ndarray, *, scale: float = 1.0) -> int:
        """:meth:`push` of every tensor at once, ``region`` laid out like the
        store's data (a rule may send it without splitting it)."""
        return await self.push(self.store.tensors_of(region), scale=scale)

    def _selected(self, grads: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        st = self.store
        return st.dropping.select(grads) if st.dropping is not None else dict(grads)


class Accumulate(UpdateRule):
    """Server-side accumulate of ``-lr * g``, no lock."""

    name = "accumulate"
    pushes_in_backward = True

    async def push(self, grads: Mapping[str, np.ndarray], *, scale: float = 1.0, lr: float | None = None) -> int:
        st = self.store
        sent = self._selected(grads)
        if not sent:
            return 0
        rate = (self.lr if lr is None else lr) * scale
        deltas = {name: self._delta(name, g, rate) for name, g in sent.items()}
        return await accumulate_changes(st, deltas, self._stage, self.wire)


async def accumulate_changes(st: BoundStore, changes: Mapping[str, np.ndarray], stage: np.ndarray,
                             wire: str | None) -> int:
    """Add ``changes`` (tensor name -> array, views of ``stage`` laid out
    like the data region) to the shared tensors by server-side accumulate,
    and to the local mirror; the bytes sent."""
    if len(changes) == len(st.params):
        # the whole model: one accumulate, which the client splits over all servers
        await st.weights.accumulate(0, stage, wire=wire)
        nbytes = stage.nbytes
        st.flat()[...] += stage       # our own step, seen at once
    else:
        await asyncio.gather(*(st.weights.accumulate(st.ranges[name][0] - st.data_off, d.reshape(-1), wire=wire)
                               for name, d in changes.items()))
        nbytes = sum(d.nbytes for d in changes.values())
        for name, d in changes.items():
            st.params[name] += d
    return int(nbytes * _wire_fraction(stage.dtype, wire))


def _drop_non_finite(values: np.ndarray) -> bool:
    """Set the values that are inf or NaN to 0; True if there were any."""
    with np.errstate(invalid="ignore", over="ignore"):     # (inf + -inf: NaN, which says the same)
        if math.isfinite(float(np.add.reduce(values))):
            return False
    bad = ~np.isfinite(values)
    values[bad] = 0.0
    return bool(bad.any())       # (False: only the sum of finite values overflowed)


def _wire_fraction(dtype: np.dtype[Any], wire: str | None) -> float:
    """The bytes on the wire per byte of ``dtype`` pushed as ``wire``."""
    return 1.0 if wire is None else np.dtype("uint16").itemsize / dtype.itemsize


class Locked(UpdateRule):
    """TFSM on SMB2: read-modify-write of the weights under the lock.

    With ``per_layer=False`` one lock (the buffer's own) covers the whole
    model, so every update is applied to the latest weights and none is
    lost.  ``per_layer=True`` takes one lock per tensor (named
    ``"<buffer>/<tensor>"``): updates of different layers by different workers
    then proceed in parallel.  Write-backs are fenced: a worker that stalled
    past its lease gets :class:`~smb2.StaleFence` instead of overwriting a
    newer update."""

    name = "locked"

    def __init__(self, lr: float = 0.01, per_layer: bool = False, lease: float | None = None,
                 timeout: float | None = 60.0) -> None:
        super().__init__(lr)
        if not isinstance(per_layer, bool):
            raise InvalidArgumentError(f"per_layer must be a bool, not {per_layer!r}")
        self.per_layer = per_layer
        self.lease = lease
        self.timeout = timeout
        self._locks: dict[str, Lock | ReplicatedLock] = {}
        self._lock: Lock | ReplicatedLock | None = None

    def settings(self) -> dict[str, Any]:
        return {"name": self.name, "lr": self.lr, "per_layer": self.per_layer}

    @property
    def pull_each_step(self) -> bool:
        # A push reads the latest weights under the lock and leaves them,
        # updated, in the mirror: a pull before the next step would read them
        # again.  Only tensors that layer dropping kept home go stale.
        return self._store is not None and self._store.dropping is not None

    def bind(self, store: BoundStore) -> None:
        super().bind(store)
        if self.per_layer:
            self._locks = {name: beside.lock(store.client, store.buf, name, self.lease)
                           for name in store.params}
        else:
            self._lock = beside.lock(store.client, store.buf, None, self.lease)

    async def push(self, grads: Mapping[str, np.ndarray], *, scale: float = 1.0, lr: float | None = None) -> int:
        st = self.store
        sent = self._selected(grads)
        if not sent:
            return 0
        rate = (self.lr if lr is None else lr) * scale
        if self.per_layer:
            await asyncio.gather(*(self._update({name: g}, self._locks[name], rate) for name, g in sent.items()))
        else:
            assert self._lock is not None
            await self._update(sent, self._lock, rate)
        nbytes = sum(st.ranges[name][1] for name in sent)
        st.count_pull(nbytes)       # (read under the lock)
        return nbytes

    async def _update(self, grads: Mapping[str, np.ndarray], lock: Lock | ReplicatedLock, lr: float) -> None:
        st = self.store
        await lock.acquire(timeout=self.timeout)
        try:
            # read the latest values of exactly these tensors into the mirror ...
            await asyncio.gather(*(st.buf.read_into(st.params[name], st.ranges[name][0]) for name in grads))
            for name, g in grads.items():
                st.params[name] += self._delta(name, g, lr)
            # ... and write them back before anyone else may read them
            await asyncio.gather(*(st.buf.write(st.ranges[name][0], st.params[name], fence=lock)
                                   for name in grads))
        finally:
            await lock.release()


class EASGD(UpdateRule):
    """Elastic averaging SGD against a shared center (ShmCaffe)."""

    name = "easgd"
    gradient_rule = False
    lag_scaled = False      # the elastic term bounds how far a worker pulls the center
    elastic = True

    @property
    def pull_each_step(self) -> bool:
        return False        # each worker trains its own copy; the center is not its weights

    def __init__(self, lr: float = 0.01, alpha: float | None = None, tau: int = 4) -> None:
        super().__init__(lr)
        self.alpha = None if alpha is None else _positive("alpha", alpha, upper=1.0)
        if not isinstance(tau, int) or isinstance(tau, bool) or tau < 1:
            raise InvalidArgumentError(f"tau must be a positive int, not {tau!r}")
        self.tau = tau
        self.steps = 0

    @property
    def exchange_every(self) -> int:
        return self.tau

    def bind(self, store: BoundStore) -> None:
        super().bind(store)
        if self.alpha is None:
            # EASGD's stability condition: alpha = beta / p with beta = 0.9
            self.alpha = min(1.0, 0.9 / store.workers)
        self._center = np.zeros_like(store.flat())
        self._diff = np.zeros_like(store.flat())

    def settings(self) -> dict[str, Any]:
        return {"name": self.name, "lr": self.lr, "alpha": self.alpha, "tau": self.tau}

    async def push(self, grads: Mapping[str, np.ndarray], *, scale: float = 1.0, lr: float | None = None) -> int:
        """Local SGD; every ``tau`` pushes an :meth:`exchange` (which counts
        itself: a local step sends nothing)."""
        st = self.store
        for name, g in grads.items():
            st.params[name] += self._delta(name, g, lr)        # local SGD on our own copy
        self.steps += 1
        if self.steps % self.tau == 0:
            await self.exchange()
        return 0

    async def exchange(self, step: int | None = None) -> None:
        """One elastic exchange with the center."""
        st = self.store
        assert self.alpha is not None
        await st.weights.read_into(self._center)
        local = st.flat()
        np.subtract(local, self._center, out=self._diff)
        self._diff *= self.alpha
        local -= self._diff
        await st.weights.accumulate(0, self._diff)
        st.count_pull(self._center.nbytes)
        await st.count_push(self._diff.nbytes)

    async def center(self, out: np.ndarray | None = None) -> np.ndarray:
        """The shared center's values (flat), e.g. to evaluate the model."""
        st = self.store
        out = np.empty_like(st.flat()) if out is None else out
        await st.weights.read_into(out)
        return out


class Delta(UpdateRule):
    """Server-side accumulate of the worker's own change ``w_after - w_before``.

    The worker's optimizer decides the change (so its learning rate, not
    this rule's, applies); the rule only carries it to the shared weights.
    Layer dropping applies to the changes as to gradients."""

    name = "delta"

    def __init__(self, wire: str | None = None) -> None:
        super().__init__()      # (its lr is not used: the worker's optimizer has one)
        self.wire = wire

    def settings(self) -> dict[str, Any]:
        return {"name": self.name}

    async def push(self, grads: Mapping[str, np.ndarray], *, scale: float = 1.0, lr: float | None = None) -> int:
        """``grads`` are the changes of the weights (not gradients; ``lr``
        does not apply)."""
        st = self.store
        changes = {}
        for name, d in self._selected(grads).items():
            o = st.flat_offset(name)
            out = self._stage[o:o + d.size]
            np.multiply(d.reshape(-1), scale, out=out, casting="unsafe")
            changes[name] = out.reshape(d.shape)
        if not changes:
            return 0
        return await accumulate_changes(st, changes, self._stage, self.wire)

    async def push_region(self, changes: np.ndarray, *, scale: float = 1.0) -> int:
        """The changes of every tensor at once, laid out like the data region
        (padding zero; no layer dropping), times ``scale`` (in place): accumulated
        without a copy; the local mirror is left alone (its owner keeps its own
        weights, as :class:`smb2.torch.AsyncOptimizer` does).  The bytes sent."""
        st = self.store
        if st.dropping is not None:
            return await super().push_region(changes, scale=scale)
        if scale != 1.0:
            changes *= scale
        await st.weights.accumulate(0, changes, wire=self.wire)
        return int(changes.nbytes * _wire_fraction(changes.dtype, self.wire))


def outer_momentum_name(store: str) -> str:
    """The buffer beside store ``store`` that holds rule ``diloco``'s outer
    momentum (laid out like the store's data region)."""
    return beside.name_of(store, OUTER)


#: the outer momentum's side buffer (smb2.train.beside)
OUTER = "outer"
#: rule diloco's outer step unless told (``compress="sparseloco:F"``: lr 1, no momentum): the paper's lr
#: 0.7 with momentum 0.5, not its 0.9, which overshoots asynchronously (docs/training.md, "DiLoCo")
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.5


class DiLoCo(UpdateRule):
    """DiLoCo's outer Nesterov step, asynchronously, with delayed momentum.

    A round: the worker takes the shared weights ``w_start``, trains its own
    copy for ``local_steps`` inner steps (its optimizer; in this numpy API
    :meth:`push` is an SGD step with ``lr``), then pushes its pseudo-gradient
    ``D = w_start - w_local`` (:meth:`exchange`).  The store's guard sees
    ``D`` and lag-scales it (lag: the other workers' pseudo-gradients since
    the worker's pull); ``s`` is that scale over the workers, so W
    pseudo-gradients make one averaged outer step, as in synchronous DiLoCo.

    Synchronous DiLoCo's outer step on the mean ``g`` of W pseudo-gradients,
    ``m = mu M + g``, ``w -= lr_out (g + mu m)``, is split as Liu et al.
    (2024, "delayed Nesterov") do: each push moves the weights by the plain
    part ``-lr_out s D`` and adds ``s D`` to a buffer ``B`` beside the
    momentum ``M`` (:func:`outer_momentum_name`), by server-side accumulates
    (``wire``, bfloat16 by default); the push that brings the store's
    version to a multiple of W then makes the momentum step once for them
    all (:meth:`momentum_step`): ``m = mu M + B``, ``w -= lr_out mu m``,
    ``M += m - M``, ``B -= B``.  With one worker every push completes its
    group, and both parts go in one accumulate: torch's
    ``SGD(nesterov=True)`` step.  Then the worker pulls the shared weights
    and starts its next round from them.

    ``compress`` (:mod:`smb2.train.compress`) sends only a round's top-k by
    sparse accumulates, the rest kept on the worker: ``"topk:F"`` with the
    outer step above (``outer_lr`` 0.7, ``outer_momentum`` 0.5 unless told),
    ``"sparseloco:F"`` with a decaying residual and no momentum step
    (``outer_lr`` 1 unless told)."""

    name = "diloco"
    gradient_rule = False
    elastic = True
    exchange_at_close = True

    def __init__(self, lr: float = 0.01, local_steps: int = 8, outer_lr: float | None = None,
                 outer_momentum: float | None = None, wire: str | None = "bfloat16", buffers: Sequence[str] = (),
                 compress: str | None = None) -> None:
        super().__init__(lr)
        #: tensors that are model buffers (running statistics), not parameters:
        #: they take the workers' mean change, not an outer step
        self.buffer_names = list(buffers)
        if not isinstance(local_steps, int) or isinstance(local_steps, bool) or local_steps < 1:
            raise InvalidArgumentError(f"local_steps must be a positive int (inner steps per round), "
                                       f"not {local_steps!r}")
        self.local_steps = local_steps
        #: the top-k cut and residual of a compressed exchange (``compress="topk:F"`` or
        #: ``"sparseloco:F"``), or None: dense
        self.compress = parse_spec(compress)
        sparseloco = isinstance(self.compress, SparseLoCo)
        if outer_lr is None:
            outer_lr = SparseLoCo.OUTER_LR if sparseloco else OUTER_LR
        self.outer_lr = _positive("outer_lr", outer_lr)
        if outer_momentum is None:
            outer_momentum = 0.0 if sparseloco else OUTER_MOMENTUM
        if (not isinstance(outer_momentum, (int, float)) or isinstance(outer_momentum, bool)
                or not 0 <= outer_momentum < 1):
            raise InvalidArgumentError(f"outer_momentum must be a number in [0, 1), not {outer_momentum!r}")
        if isinstance(self.compress, SparseLoCo) and outer_momentum != 0:
            # its decaying residual is the momentum: a dense momentum step per group of W rounds would
            # also bring back most of the bytes the cut saves
            raise InvalidArgumentError(f"compress={self.compress.spec()!r} makes no outer momentum step (the "
                                       f"decaying residual is its momentum), so outer_momentum must be 0 or "
                                       f"left out, not {outer_momentum!r}",
                                       hint="compress='topk:F' keeps the outer Nesterov momentum")
        self.outer_momentum = float(outer_momentum)
        if wire not in (None, "bfloat16", "float16"):
            raise InvalidArgumentError(f"wire must be None, 'bfloat16' or 'float16', not {wire!r}")
        self.wire = wire
        self.steps = 0
        self._outer: Buffer | None = None
        #: where this worker's pushes into ``B`` go: the outer buffer on the
        #: servers (after ``M``), or the host agent's mirror of it (:meth:`through_agent`)
        self._pending: SharedWeights | None = None
        # the entries of the pseudo-gradient the coming push sends (compressed)
        self._cut: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def pull_each_step(self) -> bool:
        return False        # the worker trains its own copy for a round

    @property
    def exchange_every(self) -> int:
        return self.local_steps

    def settings(self) -> dict[str, Any]:
        out = {"name": self.name, "lr": self.lr, "local_steps": self.local_steps, "outer_lr": self.outer_lr,
               "outer_momentum": self.outer_momentum}
        if self.compress is not None:
            out["compress"] = self.compress.spec()
        return out

    def bind(self, store: BoundStore) -> None:
        super().bind(store)
        #: the shared weights this round started from; the momentum and the buffer (M | B) as read,
        #: then their changes; the new momentum
        self._start = np.zeros_like(store.flat())
        self._both = np.zeros(2 * store.flat().size, store.flat().dtype)
        self._read = self._both[:store.flat().size]
        self._momentum = np.zeros_like(store.flat())
        unknown = [n for n in self.buffer_names if n not in store.params]
        if unknown:
            raise InvalidArgumentError(f"buffers {unknown} are not tensors of the store")
        self._buffers = [slice(store.flat_offset(n), store.flat_offset(n) + store.params[n].size)
                         for n in self.buffer_names]
        if self.compress is not None:
            if store.flat().dtype != np.float32:
                raise InvalidArgumentError(f"compress={self.compress.spec()!r} sends float32 entries by sparse "
                                           f"accumulate; this store holds {store.flat().dtype}")
            self.compress.bind(store.flat().size, self._buffers)
            #: the round's sent entries, laid out like the data region (zero elsewhere): what the guard sees
            self._sent = np.zeros_like(store.flat())

    def pulled(self) -> None:
        self._start[...] = self.store.flat()     # a new round starts from the shared weights
        self.steps = 0

    async def open_run(self, fresh: bool) -> None:
        """The outer momentum and the pseudo-gradients since its last step
        (``M | B``): zero in a fresh run, kept in a resumed one (none for a
        compressed exchange without outer momentum)."""
        if not self._momentum_kept:
            return
        st = self.store
        nbytes = 2 * st.flat().nbytes
        # with the store's replicas: a lost server loses it no more than the store
        # (an earlier store's of another model is made again)
        buf = await beside.make(st.client, st.buf.name, OUTER, nbytes, replicas=st.buf.replicas,
                                stripe=st.buf.stripe)
        if fresh:
            await buf.write(0, np.zeros(nbytes, np.uint8))
        self._outer = buf

    async def push(self, grads: Mapping[str, np.ndarray], *, scale: float = 1.0, lr: float | None = None) -> int:
        """An inner step: local SGD on the worker's copy (the mirror; the
        lag scale does not apply to a local step); every ``local_steps``
        pushes an :meth:`exchange`, which counts itself."""
        st = self.store
        for name, g in grads.items():
            st.params[name] += self._delta(name, g, lr)
        self.steps += 1
        if self.steps % self.local_steps == 0:
            await self.exchange()
        return 0

    async def exchange(self, step: int | None = None) -> None:
        """Push the round's pseudo-gradient (through the store: guard, lag,
        version), the momentum step if the push completed a group of W, then
        start the next round from the shared weights."""
        st = self.store
        np.subtract(self._start, st.flat(), out=self._stage)
        if self.compress is None:
            pushed = await st.push_region(self._stage, step=step)
        else:
            pushed = await self._push_cut(step)
        if pushed and st.workers > 1 and st.version % st.workers == 0 and self._momentum_kept:
            await self.momentum_step()
        await st.pull()

    @property
    def _momentum_kept(self) -> bool:
        # a compressed exchange without outer momentum keeps no M | B: its
        # momentum step would add nothing to the weights
        return self.compress is None or self.outer_momentum > 0

    async def _push_cut(self, step: int | None) -> bool:
        """The round's pseudo-gradient (in ``_stage``) plus the residual, cut
        to its top-k, pushed through the store (guard, lag, version) as the
        sparse region it is; the residual keeps the rest if it went out."""
        assert self.compress is not None
        idx, values = self._cut = self.compress.cut(self._stage, self.wire)
        self._sent[idx] = values
        try:
            pushed = await self.store.push_region(self._sent, step=step)
        finally:
            self._sent.fill(0.0)        # (one worker with momentum made it its dense step)
            self._cut = None
        if pushed:
            self.compress.sent(idx, values)
        return pushed

    async def _attach_outer(self) -> Buffer:
        if self._outer is None:
            self._outer = await beside.find(self.store.client, self.store.buf.name, OUTER)
        return self._outer

    async def _pending_sum(self) -> SharedWeights:
        """Where this worker adds its share of the next momentum step (``B``)."""
        if self._pending is None:
            self._pending = ServerWeights(await self._attach_outer(), self._read.nbytes)
        return self._pending

    async def through_agent(self, agent: Client, weights: AgentWeights, *, timeout: float,
                            host_workers: int) -> None:
        """This worker's pushes into ``B`` go through the host agent too: the
        agent combines the host's shares as it combines their plain parts
        (a sum either way, so the momentum step is the same), and forwards
        them in the rule's wire type, what rounding leaves out staying on the
        host.  ``M`` and the momentum step's read and write stay direct: the
        worker that makes the step reads what the servers hold, and a share
        still on the host then waits in ``B`` for the next step, as a push
        that lands during a step does.  Not with one worker (its Nesterov
        step reads and writes ``M`` itself, and ``B`` stays zero) nor
        without outer momentum (no ``B``).  An agent without room for the
        mirror is said at WARNING, and the shares go to the servers."""
        st = self.store
        if st.workers == 1 or not self._momentum_kept:
            return
        outer = await self._attach_outer()
        n = self._read.nbytes
        wire = self.wire if self._read.dtype == np.float32 else None
        try:
            mirror = await AgentMirror.open_pulled(agent, outer, n, n, self._read.dtype, timeout=timeout, wire=wire,
                                                   host_workers=host_workers)
        except OutOfMemory as exc:
            log.warning("rank %d of store %r: %s; its shares of the outer momentum step go to the memory servers "
                        "directly", st.rank, st.name, exc.message)
            return
        self._pending = weights.beside(mirror, ServerWeights(outer, n))

    async def push_region(self, region: np.ndarray, *, scale: float = 1.0) -> int:
        """The pseudo-gradient ``region`` (laid out like the data region;
        overwritten), times ``scale`` / workers: the plain part of the outer
        step, and its share of the next momentum step into ``B``; with one
        worker the whole Nesterov step."""
        st = self.store
        if self._cut is not None and not (st.workers == 1 and self._momentum_kept):
            return await self._push_sparse(self._cut[0], region[self._cut[0]] * np.float32(scale / st.workers))
        region *= scale / st.workers                    # s D
        if st.workers == 1:
            return await self._nesterov(await self._attach_outer(), region)
        pending = await self._pending_sum()
        averaged = [region[b].copy() for b in self._buffers]
        self._read[...] = region                        # its share of the next momentum step: B += s D
        region *= -self.outer_lr                        # the plain part: -lr_out s D
        for b, d in zip(self._buffers, averaged):
            # a running statistic takes the workers' mean change, no momentum
            # (a momentum step could overshoot it, a variance below zero)
            np.negative(d, out=region[b])
            self._read[b] = 0.0
        await asyncio.gather(pending.accumulate(0, self._read, wire=self.wire),
                             st.weights.accumulate(0, region, wire=self.wire))
        return int(2 * region.nbytes * _wire_fraction(region.dtype, self.wire))

    async def _push_sparse(self, idx: np.ndarray, sent: np.ndarray) -> int:
        """A compressed pseudo-gradient's entries ``sent`` (``s D`` at
        ``idx``): what :meth:`push_region` does with a dense one, by sparse
        accumulates: ``-lr_out s D`` into the weights, ``s D`` into ``B``
        (no ``B`` without outer momentum: the momentum step would add
        nothing); a running statistic takes its mean change, no momentum."""
        st = self.store
        change = sent * np.float32(-self.outer_lr)
        statistic = np.zeros(idx.size, bool)
        for b in self._buffers:
            statistic |= (idx >= b.start) & (idx < b.stop)
        change[statistic] = -sent[statistic]
        pushes = [st.weights.accumulate_sparse(idx, change, wire=self.wire)]
        items = idx.size
        if self._momentum_kept:
            pending = await self._pending_sum()
            keep = ~statistic
            pushes.append(pending.accumulate_sparse(idx[keep], sent[keep], wire=self.wire))
            items += int(keep.sum())
        await asyncio.gather(*pushes)
        assert self.compress is not None
        return self.compress.wire_bytes(items, self.wire)

    async def _nesterov(self, outer: Buffer, region: np.ndarray) -> int:
        """One worker: the plain part and the momentum step in one, as torch's
        ``SGD(nesterov=True)`` computes them (``B`` stays zero)."""
        st = self.store
        mu = self.outer_momentum
        await outer.read_into(self._read, 0)
        st.count_pull(self._read.nbytes)
        averaged = [region[b].copy() for b in self._buffers]
        m = self._momentum
        np.multiply(self._read, mu, out=m)
        m += region                                     # m = mu M + s D
        region += mu * m
        region *= -self.outer_lr                        # -lr_out (s D + mu m)
        self._read -= m
        self._read *= -1.0                              # m - M
        for b, d in zip(self._buffers, averaged):
            np.negative(d, out=region[b])               # (the buffers' mean change, no momentum)
            self._read[b] = 0.0
        await asyncio.gather(outer.accumulate(0, self._read, wire=self.wire),
                             st.weights.accumulate(0, region, wire=self.wire))
        return int(2 * region.nbytes * _wire_fraction(region.dtype, self.wire))

    async def momentum_step(self) -> None:
        """The momentum step of a group of W pseudo-gradients: read ``M | B``,
        ``m = mu M + B``, add ``-lr_out mu m`` to the weights and
        ``m - M | -B`` beside them (pushes that land meanwhile stay in ``B``
        for the next step: none is lost)."""
        st = self.store
        outer = await self._attach_outer()
        mu = self.outer_momentum
        n = self._read.size
        await outer.read_into(self._both, 0)
        st.count_pull(self._both.nbytes)
        moment, pending = self._both[:n], self._both[n:]
        m = self._momentum
        np.multiply(moment, mu, out=m)
        m += pending                                    # m = mu M + B (buffers: both zero)
        np.multiply(m, -self.outer_lr * mu, out=self._stage)
        np.subtract(m, moment, out=moment)              # m - M
        np.negative(pending, out=pending)               # -B
        await asyncio.gather(outer.accumulate(0, self._both, wire=self.wire),
                             st.weights.accumulate(0, self._stage, wire=self.wire))
        await st.count_push(int(3 * self._stage.nbytes * _wire_fraction(self._stage.dtype, self.wire)),
                            update=False)


class AdaptiveDiLoCo(DiLoCo):
    """Rule ``diloco`` with ``local_steps="auto"``: each worker chooses each
    round's number of inner steps from its own measured compute per step and
    time per exchange (:class:`smb2.train.local_steps.LocalSteps`: at most
    ``exchange_share`` of a round goes to the exchange, 1 to
    ``max_local_steps`` steps; ``clock`` is what it measures with).

    Rounds of different lengths combine as rounds of one length do: a
    round's pseudo-gradient is the sum of its inner steps' changes and
    counts whole (times its lag's scale, over W), so every inner step counts
    1/W, whichever round it is in; a round is not rescaled by its length
    (a round of H steps counting H_ref/H of itself would give each step of a
    short round, a slow worker's, more weight than a fast worker's).  The
    divergence guard compares pseudo-gradients per inner step
    (:attr:`round_steps`), so a long round is not skipped for being longer
    than the short ones before it."""

    def __init__(self, lr: float = 0.01, local_steps: str = "auto", exchange_share: float = SHARE,
                 max_local_steps: int = MOST, clock: Callable[[], float] = time.perf_counter,
                 **options: Any) -> None:
        if local_steps != "auto":
            raise InvalidArgumentError(f"AdaptiveDiLoCo chooses its local steps: local_steps='auto', "
                                       f"not {local_steps!r}")
        super().__init__(lr, local_steps=1, **options)
        self.local = LocalSteps(exchange_share, max_local_steps, clock=clock)

    def bind(self, store: BoundStore) -> None:
        super().bind(store)
        self.local.label = f"rank {store.rank}: "

    def settings(self) -> dict[str, Any]:
        return dict(super().settings(), local_steps="auto", exchange_share=self.local.share,
                    max_local_steps=self.local.most)

    def inner_step(self) -> None:
        self.local.stepped()

    def round_ended(self, steps: int) -> None:
        self.round_steps = max(1, steps)
        self.local_steps = self.local.round_ended(steps)

    def round_stats(self) -> dict[str, Any]:
        return {"local_steps": self.local.h, "rounds": self.local.summary()}

    async def push(self, grads: Mapping[str, np.ndarray], *, scale: float = 1.0, lr: float | None = None) -> int:
        """An inner step (numpy API: local SGD, timed from the last one's
        end); at the round's end its exchange, in line (not timed as compute)."""
        st = self.store
        for name, g in grads.items():
            st.params[name] += self._delta(name, g, lr)
        self.steps += 1
        self.local.stepped()
        if self.steps >= self.local_steps:
            self.round_ended(self.steps)
            await self.exchange()
            self.local.restart()
        return 0

    async def exchange(self, step: int | None = None) -> None:
        """:meth:`DiLoCo.exchange`, timed."""
        if self.steps:
            # numpy API: the steps since the last exchange (a call at the end
            # of training pushes the last, shorter round; in torch's path the
            # optimizer counts the round's steps, and these stay zero)
            self.round_steps = self.steps
        t0 = self.local.clock()
        await super().exchange(step)
        self.local.exchanged(self.local.clock() - t0)


GRADIENTS = "gradients"
#: seconds a worker rule allreduce waits for may stay silent before the others go on without it
DEAD_AFTER = 5.0
#: how often a worker waiting for a round looks at the others' heartbeats (s)
LOOK_EVERY = 0.25
#: seconds a round waits for live workers (their heartbeats go on) before it gives up: torch's
#: default timeout of a collective, so that a rank evaluating or saving a checkpoint between two
#: steps holds the others as long as under DDP
ROUND_TIMEOUT = 1800.0
#: seconds a round waits before it says so at WARNING, and between two such reports
SAY_WAITING_AFTER = 30.0
SAY_WAITING_EVERY = 60.0
#: how often the leader of a membership asks whether a restarted worker wants back in (s): a read
#: of the roster's request words, made beside the training and looked at where a step begins
LOOK_FOR_RESTARTED_EVERY = 1.0
#: a part of the gradients (its own sum and counter): at most this many bytes of float32 values, so
#: that a model's first parts travel while backward still computes the others (DDP's buckets)
PART_BYTES = 4 << 20
#: the bytes a worker has in flight each way over TCP (``AllReduce(slice_bytes=)``): a part crosses
#: the link as slices of this size, one at a time, less than a link's queue holds (the bench's
#: 5 ms at 200 Mbit/s: about 256 kB with its burst), so that the W workers' bursts into the N
#: servers, and back, are not dropped there (incast).  Each slice waits for the one before: a
#: round trip per 1 ms of a 1 Gbit/s link
SLICE_BYTES = 128 << 10


class AllReduce(UpdateRule):
    """Every worker steps its own optimizer on the mean of the W workers'
    gradients: torch DDP's arithmetic, with the sum made by the servers.

    A round: each worker adds its float32 gradient (flat, laid out like the
    data region) into one of two sums kept beside the store
    (``<store>/gradients``) by a server-side accumulate (``wire``: bfloat16
    by default, half the bytes up), counts itself in at that sum's counter
    (a notification slot), waits until all W have, and reads the sum back
    (float32 on the servers; read rounded to ``wire``, which the servers
    do before it crosses the link: half the bytes down too, as torch DDP's
    bf16 compression hook, but summed in float32): the mean is the sum over
    W, the same bytes for every worker, so that workers that start from the
    same weights with the same optimizer keep the same weights.  Nothing
    else is exchanged: the store's weights are written by rank 0 when it
    closes.

    The gradients go in :attr:`parts` (whole tensors, in the reverse of
    their order, about :data:`PART_BYTES` each; a larger tensor cut into
    parts of that size), each with its own sums and
    counters: a part travels, and its mean comes back, as soon as its
    tensors' gradients exist (:mod:`smb2.torch.allreduce` sends each part
    from backward, as DDP sends its buckets).

    The sums are never cleared: a worker adds the difference between this
    gradient and what it added to that sum last time (as rounded for the
    wire, which it keeps exactly), so a sum holds one round's gradients and
    does not grow.  Rounds alternate between the two sums: a worker adds
    round ``r``'s only after every worker counted itself in round ``r - 1``,
    which each does after it read round ``r - 2``, the last in that sum.

    A worker that dies does not stop the others, as it stops DDP's: a
    worker waiting for a round watches the others' heartbeats, and once one
    has been silent for ``dead_after`` seconds the survivors agree on a new
    membership without it and redo the round among themselves, its mean
    then over the W - 1 (:mod:`smb2.train.roster`: how they agree, and why
    no one steps on a partial or different mean).  If rank 0 is the one
    lost, the lowest surviving rank writes the store's weights at close
    (:attr:`leader`); rank 0's checkpoints stop with it.  A worker that
    closed its run (it took fewer steps) is named at once by the workers
    whose round waits for it: every rank takes the same number of steps.
    A worker that is alive but sends nothing (it is stuck while its
    heartbeat goes on) leaves the others waiting, and after
    ``round_timeout`` seconds (30 minutes, torch's default for a
    collective; they say so at WARNING every minute after the first 30 s)
    they raise :class:`~smb2.NotifyTimeout` saying
    how many gradients never came.  A torchrun restart of the group (one
    torchrun for the job) opens a new, resumed run, which continues from
    rank 0's last save (:mod:`smb2.torch.resume`: the weights, the optimizer
    state and the step of one step).  A worker restarted on its own (one
    launcher per worker: ``rejoin=True``, :attr:`rejoinable`) is **taken
    back**: it asks (:meth:`rejoin`), the leader hands it its own state at
    the start of a step (:attr:`hand_over`) and declares a membership with it
    (:mod:`smb2.train.roster`), and it trains on in step with the others.  A
    worker started alone into a running run otherwise is refused."""

    name = "allreduce"
    uses_stage = False          # its sums are sent from the gradients themselves
    gradient_rule = False       # the optimizer's own gradients, whole (no layer dropping)
    lag_scaled = False          # every round is complete: nothing arrives late
    # a restarted worker's rounds would count from 0 while the others' go on:
    # a torchrun restart (the whole group) opens a new run from rank 0's last save
    rejoinable = False
    # a worker silent for dead_after is taken for dead: every worker beats while it computes
    watches_heartbeats = True
    dead_after: float
    sums = 2

    def __init__(self, wire: str | None = "bfloat16", round_timeout: float = ROUND_TIMEOUT,
                 dead_after: float = DEAD_AFTER, slice_bytes: int | None = SLICE_BYTES,
                 rejoin: bool = False) -> None:
        super().__init__()      # (its lr is not used: the worker's optimizer has one)
        if wire not in (None, "bfloat16", "float16"):
            raise InvalidArgumentError(f"wire must be None, 'bfloat16' or 'float16', not {wire!r}")
        if slice_bytes is not None and (isinstance(slice_bytes, bool) or not isinstance(slice_bytes, int)
                                        or slice_bytes < 4096):
            raise InvalidArgumentError(f"slice_bytes must be None (a part at once) or at least 4096 bytes, "
                                       f"not {slice_bytes!r}")
        self.wire = wire
        #: over TCP, a part goes (and its mean comes back) as slices of this many bytes on the wire,
        #: one in flight each way (None: a part at once, its stripes to every server together)
        self.slice_bytes = slice_bytes
        self.round_timeout = _positive("round_timeout", round_timeout)
        #: seconds of silence (no heartbeat) after which a worker a round waits for is taken for dead
        self.dead_after = _positive("dead_after", dead_after)
        self.rounds = 0
        #: the parts, as (first, end) element ranges of the flat region, the last tensors' first
        self.parts: list[tuple[int, int]] = []
        #: the membership the rounds run in (None until the first round)
        self.epoch: roster.Epoch | None = None
        self._roster: roster.Roster | None = None
        self._silence = roster.Silence()
        #: the others' heartbeats as last looked at, and when (this worker's clock)
        self._control: Control | None = None
        self._looked = -math.inf
        #: the memberships below this one have had their sums removed (by this worker, their leader)
        self._removed = 0
        self._waiting: tuple[int, Waiting] | None = None     # (a round's report of its wait, one for all parts)
        self._attaching = asyncio.Lock()      # (a round's parts start together: one attaches)
        self._regrouping = asyncio.Lock()     # (one part of this worker declares or adopts an epoch)
        #: a worker restarted on its own asks to be taken back (:meth:`rejoin`) rather than being refused
        self.rejoinable = bool(rejoin)
        #: the round that begins the step under way (:meth:`stepped`): where a restarted worker can
        #: start, as every other's weights and optimizer state are those after the step before
        self.step_round = 0
        #: writes what restarted workers (rank -> token) need to start at a round, as after the step
        #: before it (the torch layer's: the weights, optimizer state, schedules and step); returns
        #: that step.  None: this worker cannot take a restarted one back
        self.hand_over: Callable[[dict[int, int], int], Awaitable[int]] | None = None
        self._asking: asyncio.Future[dict[int, int]] | None = None     # (the leader's read of the requests)
        self._asked_at = -math.inf
        self._looked_for_asking = -math.inf     # (a blocked round's read of the requests)
        self._looked_for_restarted = -1
        #: this worker was restarted and taken back after this step (set by the torch layer)
        self.taken_back_at: int | None = None
        #: this worker was restarted after the others finished the run (:meth:`rejoin`)
        self.run_over = False

    def settings(self) -> dict[str, Any]:
        # (slice_bytes paces the link and changes no value: not a setting of the store's arithmetic)
        return {"name": self.name, "wire": self.wire}

    @property
    def pull_each_step(self) -> bool:
        return False

    def _slices(self, buf: Buffer, n: int) -> list[tuple[int, int]]:
        """The (start, end) element ranges in which a part of ``n`` float32
        elements of ``buf`` crosses the link: one range where the part goes
        at once (``slice_bytes`` None, or a transport other than TCP: shm has
        no link, an RDMA NIC paces its own flows, and both would pay a
        request per slice), else slices of ``slice_bytes`` on the wire, this
        worker's first one a stripe further into the part than the rank
        before's, so that workers going through their slices together are at
        different servers."""
        if self.slice_bytes is None or any(t != "tcp" for t in buf.client.transports):
            return [(0, n)]
        size = max(1, self.slice_bytes // (4 if self.wire is None else 2))
        starts = list(range(0, n, size))
        first = (self.store.rank * (buf.stripe // 4)) % n // size
        return [(a, min(a + size, n)) for a in starts[first:] + starts[:first]]

    async def _paced(self, lock: asyncio.Lock, slices: list[tuple[int, int]],
                     move: Callable[..., Awaitable[Any]], offset: int, values: np.ndarray) -> None:
        """``move(offset + 4 * start, values[start:end], wire=self.wire)``
        (``Buffer.accumulate``, or ``read_into`` with its arguments turned) for each slice, one at a
        time, the whole part under ``lock`` (this worker's one slice in flight that way); a
        part that goes at once goes without waiting for the lock.  The parts waiting go whole, in
        the order they came: taken a slice each in turn, every part waiting would finish near the
        last one, and no part's mean could come down while the others still go up."""
        if len(slices) == 1:
            await move(offset, values, wire=self.wire)
            return
        async with lock:
            for a, b in slices:
                await move(offset + 4 * a, values[a:b], wire=self.wire)

    def bind(self, store: BoundStore) -> None:
        super().bind(store)
        # (this worker's one slice in flight each way, made where the store's loop runs)
        self._sending = asyncio.Lock()
        self._receiving = asyncio.Lock()
        n = self._size = store.flat().size
        self._span = -(-4 * n // 64) * 64
        starts = sorted((store.flat_offset(t), t) for t in store.params)
        self.parts = []
        end = n
        for first, _ in reversed(starts):
            if self.parts and 4 * (self.parts[-1][1] - first) <= PART_BYTES:
                self.parts[-1] = (first, self.parts[-1][1])
            else:
                self.parts.append((first, end))
            end = first
        if self.parts and self.parts[-1][0] > 0:        # (padding before the first tensor, if any)
            self.parts[-1] = (0, self.parts[-1][1])
        # a tensor larger than a part (an embedding, a wide layer) is cut into parts of its own, so that
        # its first parts' means come down while its last parts still go up: one whole part would
        # cross the link up, then down, with nothing beside it
        most = PART_BYTES // 4
        self.parts = [(a + i, min(a + i + most, b)) for a, b in self.parts for i in range(0, b - a, most)]
        self._counters = -(-8 * self.sums * len(self.parts) // 64) * 64
        #: each part's tensors, in the order of their offsets
        self.part_tensors = [[t for first, t in starts if a <= first < b] for a, b in self.parts]
        # beside each sum, each part's marks (float32): whether a worker's gradient overflowed, and
        # for each of its tensors whether the worker had a gradient; each worker adds its change
        # since the last round on that sum, as for the gradients (most rounds: none), so a mark holds
        # how many workers had it this round
        self._marks_at = [0]
        for names in self.part_tensors:
            self._marks_at.append(self._marks_at[-1] + 1 + len(names))
        self._marks_span = -(-4 * self._marks_at[-1] // 64) * 64
        #: the tensors of each part that no worker had a gradient for in the part's last round
        self.no_gradient: list[frozenset[str]] = [frozenset()] * len(self.parts)
        self._without: list[Collection[str]] = [()] * len(self.parts)
        #: (round, membership) in which each part's mean last came back
        self._came_back = [(-1, 0)] * len(self.parts)

    def parts_over(self, first: int, end: int) -> list[int]:
        """The parts that hold some of the flat elements ``first`` to ``end``
        (a tensor: one part, or the several it was cut into)."""
        over = [i for i, (a, b) in enumerate(self.parts) if a < end and first < b]
        if not over:
            raise InvalidArgumentError(f"elements {first} to {end} are in no part of store {self.store.name!r}")
        return over

    @property
    def marks_start(self) -> int:
        """Where the marks begin in the sums' buffer, after the counters and sums."""
        return self._counters + self.sums * self._span

    def _nbytes(self) -> int:
        return self.marks_start + self.sums * self._marks_span

    async def open_run(self, fresh: bool) -> None:
        """Rank 0, before any rank joins: the sums and their counters start
        at zero (a resumed run counts its rounds from 0 again)."""
        st = self.store
        await self._make_sums(0)
        size = roster.Roster.nbytes(st.workers)
        # (one stripe of its own size: one server, and no room taken beyond its words)
        members = await beside.make(st.client, st.buf.name, roster.MEMBERS, size, replicas=st.buf.replicas,
                                    stripe=size)
        await members.write(0, np.zeros(members.nbytes, np.uint8))

    async def _make_sums(self, epoch: int) -> Buffer:
        """Epoch ``epoch``'s sums and counters, made (or found) and zeroed."""
        st = self.store
        buf = await beside.make(st.client, st.buf.name, roster.sums_name(epoch, GRADIENTS), self._nbytes(),
                                replicas=st.buf.replicas, stripe=st.buf.stripe)
        await buf.write(0, np.zeros(buf.nbytes, np.uint8))
        return buf

    async def _find_sums(self, epoch: int) -> Buffer:
        st = self.store
        buf = (await beside.find(st.client, st.buf.name, roster.sums_name(epoch, GRADIENTS))).set_notify_area(
            0, self.sums * len(self.parts))
        if buf.nbytes != self._nbytes():
            raise InterfaceError(f"the gradient sums of store {st.name!r} hold {buf.nbytes} bytes, not the "
                                 f"{self._nbytes()} this model needs", hint="every worker passes the same model")
        return buf

    async def _epoch_now(self, r: int) -> roster.Epoch:
        """The membership round ``r`` runs in (the first round: attach; the
        first round of a step: take back the restarted workers that ask)."""
        async with self._attaching:
            if self.epoch is None:
                self.epoch = await self._attach(first=r == 0)
            elif r == self.step_round and r != self._looked_for_restarted:
                self._looked_for_restarted = r
                await self._take_back_restarted(self.epoch, r)
        return self.epoch

    async def _take_back_restarted(self, ep: roster.Epoch, r: int) -> None:
        """The leader of ``ep``, at round ``r`` that begins a step and before
        it counts itself into it: take back the restarted workers that asked
        (found by a read made beside the training since the last look, so that
        no step waits for it), once the others have left their old selves out."""
        st = self.store
        if self.hand_over is None or self._roster is None or ep.members[0] != st.rank:
            return
        asking = self._asking
        if asking is None or not asking.done():
            if asking is None and time.monotonic() - self._asked_at >= LOOK_FOR_RESTARTED_EVERY:
                self._asked_at = time.monotonic()
                self._asking = asyncio.ensure_future(self._roster.asking())
            return
        self._asking = None
        try:
            restarted = {rank: token for rank, token in asking.result().items() if rank not in ep.members}
        except Smb2Error as exc:
            log.debug("store %r: the roster's requests were not read (%s); looked at again later", st.name, exc)
            return
        if restarted:
            await self._take_back(ep, r, restarted)

    async def _take_back(self, ep: roster.Epoch, r: int, restarted: dict[int, int]) -> None:
        """Hand the ``restarted`` workers (rank -> token) their state as
        after the step before round ``r``, then declare the next membership
        with them in it from round ``r`` (:mod:`smb2.train.roster`)."""
        st = self.store
        rst = self._roster
        assert rst is not None and self.hand_over is not None
        ranks = ", ".join(map(str, restarted))
        async with self._regrouping:
            if self.epoch is not ep or await rst.claim(st.rank) != 0:
                return      # (a survivor is declaring a membership: the next step looks again)
            try:
                if await rst.epoch() != ep.number:
                    return      # (the round adopts the newer membership)
                try:
                    step = await self.hand_over(restarted, r)
                except Exception as exc:    # noqa: BLE001 (the training goes on without the restarted rank)
                    log.warning("store %r: restarted rank %s asked to be taken back, but its state could not be "
                                "handed over (%s): the %d workers train on without it, and it is asked again "
                                "at a later step", st.name, ranks, exc, ep.workers)
                    return
                # (the others may have counted themselves into round r: they redo it in the new membership)
                await self._poison(ep, r)
                members = tuple(sorted(set(ep.members) | set(restarted)))
                await self._declare_next(ep, r, members, restarted)
                await asyncio.gather(*(rst.answered(rank, token) for rank, token in restarted.items()))
            finally:
                await rst.release(st.rank)
            log.warning("store %r: restarted rank %s is taken back into the training at step %d (rule 'allreduce': "
                        "each step's mean is over %d workers from here on)", st.name, ranks, step + 1, len(members))
            await self._adopt_now(ep)

    async def rejoin(self, timeout: float) -> int | None:
        """A worker restarted on its own, into a run that goes on: ask to be
        taken back and wait until a membership takes it in (the others
        first leave its old self out: at once where a round waits for it,
        as they read its request, else after ``dead_after`` s of silence).
        Returns the round it starts at; its state, as after the step before
        that round, waits in its own saves (:attr:`hand_over`).  None: no
        one is left to take it back: the others finished (:attr:`run_over`:
        the caller ends with the trained weights, from rank 0's last save),
        or every other member has been silent for ``dead_after`` or rank 0
        opened a new run (the whole job went down and is restarting: the
        caller opens the store again as a restart of the whole job)."""
        st = self.store
        self._roster = rst = roster.Roster(await beside.find(st.client, st.buf.name, roster.MEMBERS), st.workers)
        token = roster.new_token()
        since = await rst.epoch()
        await rst.ask(st.rank, token)
        deadline = time.monotonic() + timeout
        waiting = Waiting(deadline, SAY_WAITING_AFTER, SAY_WAITING_EVERY)
        silence = roster.Silence()
        while (record := await rst.taken_back_since(since, st.rank, token)) is None:
            control = await st.refresh()
            if control.generation != st.generation:
                # (every worker went down, and rank 0, restarted, opened a resumed run: this one joins it)
                log.warning("store %r: restarted rank %d finds run %d opened by rank 0: it joins that one",
                            st.name, st.rank, control.generation)
                return None
            now = time.monotonic()
            silence.saw(control.beats, now)
            members = (await rst.read()).members
            if all(control.has_finished(m) for m in members if m != st.rank):
                await rst.answered(st.rank, token)
                log.warning("store %r: restarted rank %d comes back after the other workers finished their "
                            "training: nothing is left for it to train, and it ends with the trained weights (rank "
                            "0's last save, at step %d)", st.name, st.rank, max(int(control.steps[m]) for m in members))
                self.run_over = True
                return None
            if not [m for m in members if m != st.rank and silence.quiet_for(m, now) < self.dead_after]:
                await rst.answered(st.rank, token)
                log.warning("store %r: restarted rank %d finds no other worker alive (none sent a heartbeat for %g "
                            "s): the whole job restarts, from rank 0's last save", st.name, st.rank, self.dead_after)
                return None
            # (its old self may still lead: the one after it leads once it is left out)
            leader = next(m for m in members if m != st.rank)
            if now >= deadline:
                await rst.answered(st.rank, token)
                raise InterfaceError(f"rank {st.rank} was restarted into the training of store {st.name!r}, but no "
                                     f"worker took it back in {timeout:g} s (rule 'allreduce' takes a restarted "
                                     f"worker back at the start of a step, from its leader, rank {leader})",
                                     hint="restart the whole job (resume=True continues from rank 0's last save)")
            if waiting.due():
                waiting.say(f"store {st.name!r}: restarted rank {st.rank} waits to be taken back into the "
                            f"training by rank {leader} (at the start of its next step, once the others "
                            f"left this rank's old self out)")
            await asyncio.sleep(2 * LOOK_EVERY)
        self.epoch = self._epoch(record.number, record.base, record.members, await self._find_sums(record.number))
        self.rounds = self.step_round = self._looked_for_restarted = record.base
        st.keep_beating()
        log.info("store %r: restarted rank %d trains again with %d workers (%s) from round %d", st.name, st.rank,
                 len(record.members), ", ".join(map(str, record.members)), record.base)
        return record.base

    async def _attach(self, first: bool) -> roster.Epoch:
        st = self.store
        self._roster = roster.Roster(await beside.find(st.client, st.buf.name, roster.MEMBERS), st.workers)
        now = await self._roster.read()
        number, base, members = now.number, now.base, now.members
        buf = await self._find_sums(number)
        # the others may be in round 0, which waits for this worker, and in no later round
        counts = await buf.read_notify()
        if first and (number > 0 or (counts >= st.workers).any() or counts[len(self.parts):].any()):
            raise InterfaceError(f"rank {st.rank} cannot join the running training of store {st.name!r}: "
                                 f"rule 'allreduce' keeps every worker in step, and the others are past "
                                 f"their first step",
                                 hint="restart the whole job (resume=True continues from the last "
                                      "checkpoint), or use rule='diloco', which a restarted worker rejoins")
        # (from the start barrier on, where it was passed: this store's rank beats while it computes)
        st.keep_beating()
        return self._epoch(number, base, members, buf)

    def _epoch(self, number: int, base: int, members: tuple[int, ...], buf: Buffer) -> roster.Epoch:
        """A membership's record as this worker starts in it: nothing sent to its sums yet."""
        return roster.Epoch(number, base, members, buf, np.zeros((self.sums, self._size), np.float32),
                            np.zeros((self.sums, self._marks_at[-1]), np.float32))

    @property
    def leader(self) -> int:
        """The rank that writes the store's weights (rank 0 unless it was lost)."""
        return 0 if self.epoch is None else self.epoch.members[0]

    def next_round(self) -> int:
        """Number a new round (this worker's rounds go in order; one at a time)."""
        r, self.rounds = self.rounds, self.rounds + 1
        return r

    def stepped(self) -> None:
        """The worker's optimizer stepped: the next round begins a step."""
        self.step_round = self.rounds

    async def reduce(self, grad: np.ndarray, out: np.ndarray, *, step: int | None = None) -> int:
        """One round: add ``grad`` (float32, ``flat().size`` values), wait for
        every worker's, and write their mean into ``out`` (float32, the same
        size); every part at once.  The bytes sent."""
        n = self._size
        if grad.dtype != np.float32 or out.dtype != np.float32 or not grad.size == out.size == n:
            raise InvalidArgumentError(f"rule 'allreduce' reduces float32 arrays of {n} values")
        r = self.step_round = self.next_round()        # (here every round is a step)
        sent = await asyncio.gather(*(self.reduce_part(r, i, grad, out, step=step) for i in range(len(self.parts))))
        return sum(sent) + await self.complete_round(r, grad, out, step=step)

    async def complete_round(self, r: int, grad: np.ndarray, out: np.ndarray, *, step: int | None = None) -> int:
        """After every part of round ``r`` came back: send again, in the
        current membership, the parts that came back in an older one (a
        part can go through before a worker dies in another part of the
        round, and the survivors then redo the round whole).  The bytes sent."""
        sent = 0
        while stale := [i for i, got in enumerate(self._came_back) if got != (r, self.epoch_number)]:
            sent += sum(await asyncio.gather(*(self.reduce_part(r, i, grad, out, step=step, without=self._without[i])
                                               for i in stale)))
        ep = self.epoch
        if ep is not None and self._removed < ep.number and r > ep.base and ep.members[0] == self.store.rank:
            await self._remove_old_sums(ep)
        return sent

    async def _remove_old_sums(self, ep: roster.Epoch) -> None:
        """The leader of ``ep``, once a round after its first came back:
        remove the older memberships' sums (each holds two gradients' worth
        of float32 on the servers).  No member touches them any more: every
        member counted itself into that round, which it starts only after
        its first round in ``ep`` came back whole, so nothing of theirs is in
        flight on an older epoch's sums; a worker left out that still sends
        to them finds them gone and stops as left out (:meth:`reduce_part`)."""
        st = self.store
        try:
            for number in range(self._removed, ep.number):
                await beside.discard(st.client, st.buf.name, roster.sums_name(number, GRADIENTS))
            log.debug("store %r: the sums of memberships %d-%d removed", st.name, self._removed, ep.number - 1)
        except Smb2Error as exc:
            # (housekeeping: a server that cannot take it now does not stop the training)
            log.warning("store %r: the sums of the memberships before %d were not removed (%s); they stay on "
                        "the servers until the store is removed (smb2 rm)", st.name, ep.number, exc)
        self._removed = ep.number

    @property
    def epoch_number(self) -> int:
        return 0 if self.epoch is None else self.epoch.number

    async def reduce_part(self, r: int, part: int, grad: np.ndarray, out: np.ndarray, *,
                          step: int | None = None, without: Collection[str] = ()) -> int:
        """Part ``part`` of round ``r`` (:meth:`next_round`): its range of
        ``grad`` goes in, and the mean of every worker's comes into the same
        range of ``out``.  ``without``: the part's tensors this worker has no
        gradient for (zeros in ``grad``, as under DDP); those that no worker
        had one for are in :attr:`no_gradient` afterwards.  The bytes sent."""
        st = self.store
        first, end = self.parts[part]
        self._without[part] = without
        names = self.part_tensors[part]
        marks = np.array([0.0] + [0.0 if t in without else 1.0 for t in names], np.float32)
        at, upto = self._marks_at[part], self._marks_at[part + 1]
        while True:
            ep = await self._epoch_now(r)
            k = (r - ep.base) % self.sums
            diff = grad[first:end] - ep.sent[k, first:end]
            if self.wire is not None:
                as_wire(diff, self.wire, out=diff)      # what the servers will add (rounding again: the same)
            marks[0] = _drop_non_finite(diff)
            offset = self._counters + k * self._span + 4 * first
            marks_offset = self.marks_start + k * self._marks_span + 4 * at
            slices = self._slices(ep.buf, diff.size)
            need = ((r - ep.base) // self.sums + 1) * ep.workers
            try:
                await self._paced(self._sending, slices, ep.buf.accumulate, offset, diff)
                ep.sent[k, first:end] += diff
                changed = marks - ep.marks_sent[k, at:upto]
                if changed.any():
                    # (before this worker counts itself in: whoever sees the round complete sees them)
                    await ep.buf.accumulate(marks_offset, changed)
                    ep.marks_sent[k, at:upto] = marks
                if await self._counted(ep, r, k * len(self.parts) + part, need, step):
                    break
            except NoSuchBuffer:
                # the others went on in a newer membership long enough for its leader to remove
                # this one's sums: adopting it says whether this worker is still in it (else it
                # stops as left out); sums gone for any other reason are an error as they are
                if not await self._adopt(ep):
                    raise
            # (the survivors of a dead worker went on to a new membership: this round again, in it)
        mean = out[first:end]
        # (the sum rounded to the wire by the servers: the same values for every worker, half the bytes)
        held = np.empty(upto - at, np.float32)
        await asyncio.gather(
            ep.buf.read_into(held, marks_offset),
            self._paced(self._receiving, slices, lambda at, into, wire: ep.buf.read_into(into, at, wire=wire),
                        offset, mean))
        np.divide(mean, ep.workers, out=mean)
        if held[0] > 0:
            # a worker's gradient here held inf or NaN (mixed precision's loss scale too high, most
            # often), which it did not add: every worker's mean of the part is NaN, so that
            # torch's GradScaler skips the step on every rank, as under DDP, while the sums stay finite
            mean.fill(np.nan)
        self.no_gradient[part] = frozenset(t for t, n in zip(names, held[1:]) if n == 0)
        self._came_back[part] = (r, ep.number)
        fraction = _wire_fraction(diff.dtype, self.wire)
        sent = int(diff.nbytes * fraction)
        await st.count_push(sent, update=False)     # (the shared weights' version does not move)
        st.count_pull(int(mean.nbytes * fraction))
        return sent

    async def _counted(self, ep: roster.Epoch, r: int, slot: int, need: int, step: int | None) -> bool:
        """Count this worker in at ``slot`` and wait until every member of
        ``ep`` has: True; False where a new membership replaced ``ep``
        meanwhile (this worker is in it: :meth:`_adopt`)."""
        st = self.store
        poisoned = await ep.buf.notify_add(slot, 1) < 0
        since = time.monotonic()
        waiting = self._round_waiting(r)
        while True:
            if not poisoned:
                try:
                    await ep.buf.wait_notify(slot, need, timeout=min(LOOK_EVERY, self.dead_after))
                    return True
                except NotifyTimeout:
                    have = int(await ep.buf.read_notify(slot))
                if have >= need:
                    return True
                poisoned = have < 0
            if poisoned:
                # another survivor is declaring a new membership (or finding the round went through)
                if await self._adopt(ep):
                    return False
            elif time.monotonic() - since >= self.round_timeout:
                what = f"step {step}" if step is not None else f"round {r}"
                raise NotifyTimeout(f"{need - have} of the {ep.workers} workers of store {st.name!r} sent no "
                                    f"gradient for {what} in {self.round_timeout:g} s (rule 'allreduce' waits for "
                                    f"every live worker; these still send heartbeats)",
                                    hint="a worker stalls or took fewer steps than the others: restart the job "
                                         "(resume=True), or use rule='diloco', which goes on without it")
            elif waiting.due():
                what = f"step {step}" if step is not None else f"round {r}"
                waiting.say(f"store {st.name!r}: rank {st.rank} has waited for the gradients of {what} from "
                            f"{need - have} of the {ep.workers} workers, which still send heartbeats (an "
                            f"evaluation or a checkpoint save between steps, a slow data loader?; "
                            f"round_timeout={self.round_timeout:g} s)")
            # a silent member is declared dead; where the round is poisoned, it may be a declaring
            # survivor that died half-way: its claim is taken over, the declaration made.  A member
            # that asks to be taken back was restarted: its old self is gone, without waiting out
            # its silence
            restarted = await self._restarted_members(ep)
            dead = sorted(set(await self._silent(ep)) | set(restarted))
            if dead and await self._declare(ep, r, dead, step, restarted):
                return False
            if not poisoned and (closed := self._closed_members(ep)):
                # a member closes only after its last round came back whole: a count read after
                # seeing it closed is final, and short of ``need`` it never completes
                have = int(await ep.buf.read_notify(slot))
                if have >= need:
                    return True
                if have >= 0:
                    raise self._fewer_steps(closed, r, step)
                poisoned = True
            if poisoned:
                poisoned = int(await ep.buf.read_notify(slot)) < 0
                await asyncio.sleep(LOOK_EVERY / 4)

    def _closed_members(self, ep: roster.Epoch) -> list[int]:
        """The members of ``ep`` other than this worker that closed their
        run (finished, or stopped on an error), as last looked at."""
        control = self._control
        if control is None:
            return []
        return [m for m in ep.members if m != self.store.rank and control.has_finished(m)]

    def _fewer_steps(self, closed: list[int], r: int, step: int | None) -> InterfaceError:
        """The error of a round that waits for ranks that closed their run."""
        st = self.store
        control = self._control
        assert control is not None
        done = ", ".join(f"rank {m} after {int(control.steps[m])} steps" for m in closed)
        what = f"step {step}" if step is not None else f"round {r}"
        hint = ("give every rank as many batches (torch's DistributedSampler gives the shards one length; "
                "drop_last=True drops an uneven last batch), or use rule='diloco', whose ranks may take "
                "different numbers of steps; where a rank stopped on an error, its own output says which")
        if self.taken_back_at is not None:
            hint = (f"this rank was restarted and taken back at step {self.taken_back_at + 1}: its loop must go "
                    f"on from there, skipping the batches of the steps before (opt.start_step, inside an "
                    f"epoch too), as the others did not train them again; else {hint}")
        return InterfaceError(f"rank {st.rank} of store {st.name!r} waits for the gradients of {what} from "
                              f"workers that closed their training ({done}): rule 'allreduce' needs every "
                              f"rank's gradient for every step, as torch DDP does, so every rank must take the "
                              f"same number of steps", hint=hint)

    def _round_waiting(self, r: int) -> Waiting:
        """The report of round ``r``'s wait, one for all its parts."""
        if self._waiting is None or self._waiting[0] != r:
            self._waiting = (r, Waiting(time.monotonic() + self.round_timeout, SAY_WAITING_AFTER, SAY_WAITING_EVERY))
        return self._waiting[1]

    async def _silent(self, ep: roster.Epoch) -> list[int]:
        """The members of ``ep`` other than this worker (and not finished)
        whose heartbeat has not changed for :attr:`dead_after` s."""
        st = self.store
        now = time.monotonic()
        if now - self._looked >= LOOK_EVERY:
            fresh = await st.refresh()
            self._looked, self._control = now, fresh
            self._silence.saw(fresh.beats, now)
        control = self._control
        if control is None:
            return []       # (another part of this round is reading them)
        return [m for m in ep.members if m != st.rank and not control.has_finished(m)
                and self._silence.quiet_for(m, now) >= self.dead_after]

    async def _restarted_members(self, ep: roster.Epoch) -> list[int]:
        """The members of ``ep`` that ask to be taken back (restarted: their
        old selves, which the round waits for, are gone), as read at most
        every :data:`LOOK_FOR_RESTARTED_EVERY` s, by the first two members
        only (one of them is not the restarted one); a request that a
        membership already answered (its leader did not clear it yet) is not
        one."""
        st = self.store
        rst = self._roster
        now = time.monotonic()
        if (rst is None or st.rank not in ep.members[:2] or len(ep.members) < 2
                or now - self._looked_for_asking < LOOK_FOR_RESTARTED_EVERY):
            return []
        self._looked_for_asking = now
        try:
            asking = {m: token for m, token in (await rst.asking()).items() if m in ep.members and m != st.rank}
            return [m for m, token in asking.items() if await rst.taken_back_since(-1, m, token) is None]
        except Smb2Error as exc:
            log.debug("store %r: the roster's requests were not read (%s); looked at again later", st.name, exc)
            return []

    async def _declare(self, ep: roster.Epoch, r: int, dead: list[int], step: int | None,
                       restarted: Collection[int] = ()) -> bool:
        """Round ``r`` of ``ep`` waits for the silent ranks ``dead`` (those
        of ``restarted`` ask to be taken back): make the next membership
        without them (:mod:`smb2.train.roster`).  True once this worker is
        in a newer membership; False where round ``r`` went through after
        all."""
        st = self.store
        rst = self._roster
        assert rst is not None
        async with self._regrouping:
            if self.epoch is not ep:
                return True     # (another part of this worker's round adopted one)
            while (holder := await rst.claim(st.rank)) != 0:
                if await self._adopt_now(ep):
                    return True
                if holder - 1 in await self._silent(ep) and await rst.take_over(st.rank, holder):
                    break
                await asyncio.sleep(LOOK_EVERY / 4)
            try:
                if await rst.epoch() != ep.number:
                    return await self._adopt_now(ep)
                need = ((r - ep.base) // self.sums + 1) * ep.workers
                if all(h >= need for h in await self._poison(ep, r)):
                    # every member counted itself into every part: the round went through for all
                    await self._poison(ep, r, undo=True)
                    return False
                members = tuple(m for m in ep.members if m not in dead)
                await self._declare_next(ep, r, members)
            finally:
                await rst.release(st.rank)
            what = f"step {step}" if step is not None else f"round {r}"
            why = ", ".join(f"rank {m} was restarted (it asks to be taken back)" if m in restarted else
                            f"rank {m} sent no heartbeat for {self.dead_after:g} s" for m in dead)
            log.warning("store %r: %s: the %d other workers go on without it from %s (rule "
                        "'allreduce': each step's mean is over %d workers from here on)%s",
                        st.name, why, len(members), what, len(members),
                        "; rank 0's checkpoints stop with it" if 0 in dead else "")
            return await self._adopt_now(ep)

    async def _poison(self, ep: roster.Epoch, r: int, undo: bool = False) -> list[int]:
        """Poison round ``r``'s counters in ``ep`` (the claim held), so that
        no one completes it there: what each held before (``undo``: restore them)."""
        k = (r - ep.base) % self.sums
        slots = range(k * len(self.parts), (k + 1) * len(self.parts))
        return list(await asyncio.gather(*(ep.buf.notify_add(s, roster.POISON if undo else -roster.POISON)
                                           for s in slots)))

    async def _declare_next(self, ep: roster.Epoch, r: int, members: tuple[int, ...],
                            taken_back: dict[int, int] | None = None) -> None:
        """The membership after ``ep`` (the claim held, round ``r`` poisoned):
        its zeroed sums, then its record from round ``r``."""
        assert self._roster is not None
        await self._make_sums(ep.number + 1)
        await self._roster.publish(ep.number + 1, r, members, taken_back)

    async def _adopt(self, ep: roster.Epoch) -> bool:
        async with self._regrouping:
            return self.epoch is not ep or await self._adopt_now(ep)

    async def _adopt_now(self, ep: roster.Epoch) -> bool:
        """Move from ``ep`` to the roster's newer membership, if there is one
        (True); a worker left out of it stops (InterfaceError)."""
        st = self.store
        assert self._roster is not None
        now = await self._roster.read()
        number, base, members = now.number, now.base, now.members
        if number == ep.number:
            return False
        if st.rank not in members:
            raise InterfaceError(f"rank {st.rank} was left out of the training of store {st.name!r}: it sent no "
                                 f"heartbeat for {self.dead_after:g} s, and the other {len(members)} workers went "
                                 f"on without it (rule 'allreduce')",
                                 hint="restart this worker: launched one torchrun per worker (--max-restarts), "
                                      "its restart is taken back into the training; under one torchrun for the "
                                      "job, restart the job (resume=True); a worker that stalls for long (a slow "
                                      "data loader, a debugger) needs a larger dead_after")
        buf = await self._find_sums(number)
        self.epoch = self._epoch(number, base, members, buf)
        # (a member new since ``ep`` was taken back after a restart: its silence counts from now, not
        # from its old self's last beat; also where this worker missed the membership that took it in)
        for rank in set(members) - set(ep.members):
            self._silence.forget(rank)
        log.info("store %r: rank %d trains on with %d workers (%s) from round %d", st.name, st.rank, len(members),
                 ", ".join(map(str, members)), base)
        return True

    async def push(self, grads: Mapping[str, np.ndarray], *, scale: float = 1.0, lr: float | None = None) -> int:
        raise InterfaceError("rule 'allreduce' pushes nothing to the shared weights: each worker steps on the "
                             "gradients' mean", hint="call rule.reduce(grad, out), or use "
                                                     "smb2.torch.AsyncOptimizer(rule='allreduce')")


RULES: dict[str, type[UpdateRule]] = {"accumulate": Accumulate, "locked": Locked, "easgd": EASGD, "delta": Delta,
                                      "diloco": DiLoCo, "allreduce": AllReduce}


def make_rule(rule: str | UpdateRule, **options: Any) -> UpdateRule:
    """A rule instance from its name and options (or a rule given as is)."""
    if isinstance(rule, UpdateRule):
        if options:
            raise InvalidArgumentError(f"options {sorted(options)} given with a ready-made rule")
        return rule
    cls = RULES.get(rule) if isinstance(rule, str) else None
    if cls is DiLoCo and options.get("local_steps") == "auto":
        cls = AdaptiveDiLoCo
    if cls is None:
        raise InvalidArgumentError(f"unknown update rule {rule!r}: one of {', '.join(RULES)}")
    try:
        return cls(**options)
    except TypeError as exc:
        raise InvalidArgumentError(f"bad options for rule {rule!r}: {exc}") from None
