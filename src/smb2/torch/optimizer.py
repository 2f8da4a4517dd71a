"""AsyncOptimizer: a torch optimizer whose steps reach a shared smb2 store.

    opt = smb2.torch.AsyncOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), model, name="run-17")
    for x, y in loader:
        loss_fn(model(x), y).backward()
        opt.step(); opt.zero_grad()
    opt.close()

The training loop stays ordinary code: a background thread owns an event
loop and the smb2 client.  Under the default rule, ``allreduce`` (DDP's
arithmetic: the one-line port above), backward leaves the mean of the
workers' gradients in ``.grad`` and ``step()`` runs the user's optimizer on
it (see the last rule below).  Under the asynchronous rules ``step()`` runs
the user's optimizer on the local weights, then hands the step's
communication (push, then pull) to the background thread as one
"exchange", and returns while it travels.

Staleness.  After step ``t`` the model computes step ``t+1`` on the weights
of the last pull it swapped in (issued after step ``k``) plus its own
changes since then; ``t - k`` (its lag) never exceeds ``staleness``:
``step()`` waits for the oldest exchange in flight until it does.
``staleness=0`` (the default) is pull -> compute -> push in sequence;
``staleness=1`` (what the asynchronous port, ``rule="delta"``, passes) lets
the push of step ``t`` and the pull after it travel while step ``t+1``
computes (ShmCaffe's overlap).  The elastic rules (``easgd``, ``diloco``) and ``allreduce`` ignore it.  A
finished exchange is swapped in at the next ``step()`` whatever the lag.  A
step's communication starts only after the previous step's exchange
finished, so a pull never sees this worker's later pushes (which ``since``
adds back on top of it).

What a step pushes depends on the rule:

* ``delta`` (the asynchronous baseline; the default before ``allreduce``):
  the change of the weights ``w_after - w_before`` made
  by the user's optimizer (any optimizer; its state stays local); the
  servers add it up, each worker's change counted ``1/W`` (``average``:
  the workers' changes average, so their momentum or Adam moments act once,
  not W times: W workers in step move the shared model as one optimizer with
  W times the batch, DDP's arithmetic).

Every push (but the layer pushes during backward) is checked by the
divergence guard first (:mod:`smb2.train.stability`; ``guard=False`` turns
it off), then scaled by its lag (``lag_scaling``: a push that missed more
than the expected number of other workers' updates counts less).  Together
they are the stable configuration, on by default (docs/training.md,
"Stability"): they kept an overloaded job with a straggler from collapsing
(``tests/test_async_collapse.py``).  ``average=False, lag_scaling=False``
give the earlier arithmetic (each change whole: W workers learn per sample
as W single processes, and can collapse under uneven load).
* ``accumulate`` / ``locked``: the gradients; the servers apply ``-lr * g``
  with the optimizer's current learning rate (so schedulers apply).
  ``accumulate`` pushes each parameter's gradient during backward, as soon
  as autograd produced it (:mod:`smb2.torch.backward`).  Only a
  plain ``torch.optim.SGD`` is allowed: momentum, weight decay or Adam would
  be lost between the servers and the next pull, so anything else is refused
  with a hint to use ``rule="delta"``.
* ``easgd``: the user's optimizer trains the local copy; every ``tau`` steps
  an elastic exchange with the shared center (local weights move by ``-d``
  when it lands).
* ``diloco``: the user's optimizer is the inner optimizer: it trains the
  local copy for ``local_steps`` steps (a round); then the round's
  pseudo-gradient ``w_start - w_local`` goes out (bfloat16 by default), an
  outer Nesterov step (``outer_lr``, ``outer_momentum``; its momentum step
  once per W pseudo-gradients) applies it to the shared weights, and the
  worker continues from the fresh shared weights (the
  steps it made while the exchange travelled are kept on top).  ``close()``
  pushes the last, shorter round.  Lag scaling is on by default for it.
  ``compress="topk:0.01"`` sends each round's top 1 % by sparse accumulate,
  the rest kept on the worker for the next round (error feedback).
  ``compress="sparseloco:0.02"`` (SparseLoCo's form) sends the top 2 % of
  an accumulator that decays by 0.95 each round before the round is added
  (``"sparseloco:0.02,decay=0.9"`` sets the decay); no outer momentum step
  (``outer_momentum`` must be 0 or left out) and ``outer_lr`` 1 unless
  given: the servers add the mean of the sent updates.  At W = 4 it uploads
  about 46x fewer bytes per round than the dense bf16 exchange
  (docs/training.md, "Compressed exchange").
  ``local_steps="auto"``: each worker chooses each round's length from its
  own measured step and exchange times (:mod:`smb2.train.local_steps`;
  ``stats()`` shows ``local_steps`` and ``rounds``).
* ``allreduce`` (the default: the one-line port): DDP's arithmetic, the sum
  made by the servers: backward
  sends the gradients part by part as it produces them (bfloat16 by
  default) and returns with the mean of the workers' gradients in
  ``.grad`` (:mod:`smb2.torch.allreduce`), which the user's clipping and
  the wrapped optimizer's step then see; every worker's weights stay the
  same, and nothing is pulled.  Every worker runs the same backward passes,
  as under DDP.  ``staleness`` does not apply (a gradient one step old
  measured worse than DDP on a language model with AdamW).  What it cannot
  honour is refused before connecting, with the hint to pass
  ``rule="delta"``: layer dropping (``dropping=``), ``average=False`` (each
  worker's change whole), ``push_in_backward`` (its backward always sends
  the gradients, and only that way).  The divergence guard does not see
  its rounds (as under DDP, a non-finite gradient reaches every worker's
  mean); the collapse watch sees the mean gradients.

Model buffers (BatchNorm's running mean and variance: floating-point
buffers) are averaged through the store: each exchange adds
``(b_now - b_then) / world`` to the shared copy, where ``b_then`` is the
value this worker last took from it, and the worker then takes the shared
copy.  With every worker doing so, the shared copy moves by the mean of the
workers' changes, i.e. it follows the running statistics of all workers'
batches (for EASGD buffers are averaged elastically with the weights).
Integer buffers (``num_batches_tracked``) stay local.  Parameters with
``requires_grad=False`` are not in the store and never pushed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import sys
import time
import types
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..client import Client, connect
from ..errors import InterfaceError, InvalidArgumentError, NotifyTimeout, Smb2Error
from ..mirror import DEFAULT_AGENT_PORT, agent_address
from ..train.dropping import LayerDropping
from ..train.faults import ExchangeWatch, end_ranks_briefly, in_training_terms
from ..train.lifecycle import RunEnd, host_workers, restarts_alone
from ..train.rules import RULES, AllReduce, UpdateRule
from ..train.stability import LagScaling, TrainingDiverged
from ..train.store import AGENT_RULES, ParameterStore, resolve_rank
from . import named_buffers, named_parameters
from .allreduce import MeanGradients, give_back_gpus, take_gpus
from .backward import BackwardPushes, StepPushes, wait_for
from .frozen import FrozenTensors
from .loop_thread import LoopThread
from .resume import SAVE_EVERY, SAVE_SHARE, SavedState
from .staging import Entry, Staging, flat_values

log = logging.getLogger("smb2.torch")

#: push_dtype names -> the wire type of the accumulate (None: the store's dtype)
PUSH_DTYPES = {"float32": None, "float64": None, "bfloat16": "bfloat16", "float16": "float16"}
#: the rules whose pushes may travel narrower than the store's dtype
WIRED_RULES = ("delta", "diloco", "allreduce")
#: the layers whose weight rows are units (an output feature or channel) the collapse watch counts
#: as dead when their gradient is exactly zero (not an embedding: its rows are inputs, and the
#: rows of the tokens a batch lacks get no gradient in any healthy run)
UNIT_LAYERS = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def check_plain_sgd(optimizer: torch.optim.Optimizer, rule: str) -> None:
    """Refuse an optimizer whose effect a gradient rule would drop."""
    what = None
    if type(optimizer) is not torch.optim.SGD:
        what = type(optimizer).__name__
    else:
        for g in optimizer.param_groups:
            extras = [k for k in ("momentum", "weight_decay", "dampening") if g.get(k)]
            extras += [k for k in ("nesterov", "maximize") if g.get(k)]
            if extras:
                what = "SGD with " + ", ".join(f"{k}={g[k]}" for k in extras)
                break
        lrs = {float(g["lr"]) for g in optimizer.param_groups}
        if what is None and len(lrs) > 1:
            what = f"SGD with several learning rates {sorted(lrs)}"
    if what is not None:
        raise InvalidArgumentError(
            f"rule {rule!r} applies -lr * gradient on the servers, so the torch optimizer ({what}) would be "
            "ignored (its momentum, weight decay or adaptive state would never reach the shared weights): "
            "use rule='delta'", hint="rule='delta' applies your optimizer locally and pushes the change it "
                                     "makes; the default, rule='allreduce', steps it on the workers' mean gradient")


#: why a rule that does not push every step's changes or gradients cannot drop layers
NO_DROPPING = {"easgd": "whose elastic exchange every tau steps already sends less",
               "diloco": "whose round's pseudo-gradient goes out whole, or by compress=",
               "allreduce": "whose backward sends every gradient, as DDP does: the mean needs all of them"}


def refuse_what_the_rule_cannot_honour(rule: str, dropping: LayerDropping | None, average: bool,
                                       push_in_backward: bool | None) -> None:
    """Refuse, before connecting, an option ``rule`` would silently not
    honour: layer dropping, ``average=False``, and ``push_in_backward`` with
    rule ``allreduce`` (the default: its backward always sends the
    gradients).  Each error says which rule honours it."""
    cls = RULES.get(rule)
    if cls is None:
        return          # (the store names the rules it knows)
    default = " (the default)" if rule == "allreduce" else ""
    if dropping is not None and not cls.gradient_rule:
        why = NO_DROPPING.get(rule, "which does not push every step")
        raise InvalidArgumentError(f"layer dropping applies to rules that push every step ('delta', 'accumulate', "
                                   f"'locked'), not {rule!r}{default}, {why}",
                                   hint="pass rule='delta' (or rule='accumulate') with dropping=, or leave "
                                        "dropping out")
    if not average and rule != "delta":
        raise InvalidArgumentError(f"average={average!r} applies to rule 'delta' (each worker's change counted "
                                   f"whole, not 1/W); rule {rule!r}{default} has its own arithmetic",
                                   hint="pass rule='delta' with average=False, or leave average out")
    if push_in_backward is not None and rule == "allreduce":
        raise InvalidArgumentError(f"push_in_backward={push_in_backward!r} does not apply to rule 'allreduce'"
                                   f"{default}: its backward always sends the gradients, part by part, and returns "
                                   "with the workers' mean in .grad",
                                   hint="leave push_in_backward out with rule 'allreduce'; pass rule='delta' to "
                                        "push each step's change after opt.step(), or rule='accumulate' (plain "
                                        "SGD) to push each gradient during backward")


@dataclass
class Exchange:
    """One step's communication in flight, and the host memory it uses."""

    step: int
    stage: np.ndarray            # what goes out: changes (or, for EASGD, the local weights)
    snapshot: np.ndarray         # what comes back: pulled weights (EASGD: the correction -d)
    grads: np.ndarray | None     # gradient rules: the gradients that go out
    lr: float = 0.0              # gradient rules: the learning rate of this step
    since: list[Any] = field(default_factory=list)   # own changes after this exchange's push
    #: (the version of the pull this step was computed on, own pushes since it): the push's lag
    based_on: tuple[int, int] = (0, 0)
    version: int = 0             # the version this exchange's pull holds at least
    changed_since: bool = False  # any change in ``since`` (else it is all zeros)
    future: Any = None
    #: gradient rules: the parameters that had a gradient at step() and were not pushed during backward
    rest: list[str] = field(default_factory=list)
    #: what went out during backward, and the exchange before this one (which this one waits for)
    early: StepPushes = field(default_factory=lambda: StepPushes(None))


class AsyncOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` (any torch optimizer over ``model``'s parameters)
    so that its steps train the shared store ``name``.

    ``servers``: "h:p,..." or a list (default: ``SMB2_SERVERS``).  Every
    worker of the job (torchrun's ``RANK``/``WORLD_SIZE``, or ``rank=`` /
    ``world_size=``) opens the same store; rank 0 creates it from its
    model's values (or resumes it), the others take those.  ``rule``: how the steps reach
    the shared model: ``"allreduce"`` (the default, the one-line port: DDP's arithmetic, every
    worker steps on the mean gradient, and every worker waits for the others at each step),
    ``"delta"`` (the asynchronous baseline: each worker's change of the weights, averaged),
    ``"diloco"`` (the one to train with, and with SGD the learning rate times the number of
    workers), ``"easgd"``, ``"accumulate"``, ``"locked"`` (plain SGD only); docs/training.md,
    "Which rule, when", says which and why.  ``staleness``: how many of its own steps a worker
    may run past its last pull (see the module's doc).  Its default, 0, runs pull, compute,
    push in sequence, the closest to one process; the asynchronous port (``rule="delta"``)
    passes ``staleness=1`` so that a step's exchange travels while the next step computes
    (each step then computed on weights one exchange older).  ``diloco`` and ``easgd`` ignore
    it: their exchange every few steps always overlaps the next steps.  ``allreduce`` ignores
    it too: each step waits for its own round's mean.
    ``push_dtype``: the type changes (allreduce: gradients) travel as: "bfloat16" (the
    default of rules ``allreduce`` and ``diloco``, and of ``delta`` for a bf16 model),
    "float16", or "float32"; the shared master copy is float32 either way.  ``resume``,
    ``stripe``, ``replicas`` (2: train on through a lost memory server; this rank's saved
    optimizer state and the frozen tensors get as many copies), ``checkpoint_every``... go to
    :meth:`ParameterStore.open` (the store's options), other keywords to the
    rule (``tau``, ``alpha``, ``per_layer``...).  ``log_every``: steps between INFO lines
    of :meth:`stats` on logger ``smb2.torch``.  ``state_every``: seconds
    between saves of this rank's optimizer state, step and LR schedules to
    the servers, which a resumed run loads (:mod:`smb2.torch.resume`; None:
    neither saved nor loaded); ``state_share``: the most the saves add to
    this rank's exchange bytes (0.02: a save also waits until the exchange
    moved 50 times the last one's bytes; None: by time alone).  ``average`` (rule ``delta``: each worker's
    change counts 1/W; ``False`` is refused by every other rule), ``lag_scaling`` and
    ``guard``: the stable configuration of the asynchronous rules, on by default (see the
    module's doc).  ``dropping`` (layer dropping): rules ``delta``, ``accumulate`` and
    ``locked`` only.

    ``push_in_backward``: push each parameter's gradient as soon as
    backward produced it (see :mod:`smb2.torch.backward`).  None (the
    default): wherever that is possible: rule ``accumulate``, no layer
    dropping, a CPU model.  True asks for it (refused where impossible),
    False pushes the whole step after ``step()``.  Rule ``allreduce`` takes
    neither: its backward always sends the gradients, part by part.

    ``lag_scaling``: scale each push by its lag (:mod:`smb2.train.stability`),
    on by default; it applies to the rules whose pushes are lag-scaled
    (``delta``, ``accumulate``, ``locked``, ``diloco``; not ``easgd``).

    ``agent``: exchange the weights through this host's agent
    (``smb2-agent``, one per worker host: it combines the host's pushes
    into one and pulls once for all of them; :meth:`ParameterStore.use_agent`).
    None (the default): the agent ``SMB2_AGENT`` names ("host:port"), if set;
    True: that, else one on this host's default port; a "host:port"; False:
    none.  Rules ``delta``, ``diloco``, ``easgd`` and ``accumulate`` use it;
    ``allreduce`` and ``locked`` say so at WARNING and reach the servers.  A
    lost agent is said at WARNING and the worker goes on without it.
    Where the agent serves its rule, the worker connects to the memory
    servers on first use (``smb2.connect(lazy=True)``) and pulls the first
    weights through the agent: the agent holds the host's connection to
    each server, and a worker connects only to those it reaches itself
    (the store's control words and side buffers, and its optimizer state's
    saves, which are striped over every server: with ``state_every`` on, a
    worker still reaches them all)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, *, name: str,
                 rule: str = "allreduce", staleness: int = 0, servers: str | list[str] | None = None,
                 resume: str | bool = "auto", push_dtype: str | None = None, timeout: float = 120.0,
                 rank: int | None = None, world_size: int | None = None, dropping: LayerDropping | None = None,
                 sync_buffers: bool = True, log_every: int = 100, push_in_backward: bool | None = None,
                 state_every: float | None = SAVE_EVERY, state_share: float | None = SAVE_SHARE,
                 lag_scaling: bool = True, guard: bool = True,
                 average: bool = True, agent: bool | str | None = None,
                 **options: Any) -> None:
        # torch's Optimizer.__init__ is not called: param_groups, state and
        # defaults are the wrapped optimizer's (properties below)
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, AsyncOptimizer):
            raise InvalidArgumentError(f"optimizer must be a torch optimizer, not {type(optimizer).__name__}")
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
            raise InvalidArgumentError(f"staleness must be an int >= 0, not {staleness!r}")
        if not isinstance(rule, str):
            raise InvalidArgumentError(f"rule must be a rule's name, not {type(rule).__name__}")
        refuse_what_the_rule_cannot_honour(rule, dropping, average, push_in_backward)
        _refuse_in_a_child_rerunning_the_script(name)
        self.optimizer = optimizer
        self.model = model
        self.staleness = staleness
        # a rank that ends with a fault in training terms says it in its lines, not a traceback
        end_ranks_briefly()
        self.log_every = log_every
        #: this worker's rank and the job's number of workers (:func:`resolve_rank`): shard the data by them
        self.rank, self.world = resolve_rank(rank, world_size)
        #: (and the parameters the optimizer holds that were frozen when it was made: the store does not hold
        #: them, so a step that moves one, unfrozen since, is refused: :meth:`_check_outside`)
        self._entries, self._outside = self._synced_tensors(model, optimizer, sync_buffers)
        in_store = {id(t) for _, t, _ in self._entries}
        self.frozen = FrozenTensors(torch, [(n, p, True) for n, p in named_parameters(model) if id(p) not in in_store]
                                    + [(n, b, False) for n, b in named_buffers(model) if id(b) not in in_store])
        self.rule_name = rule
        self._gradient_rule = rule in ("accumulate", "locked")
        if self._gradient_rule:
            check_plain_sgd(optimizer, rule)
            options.setdefault("lr", float(optimizer.param_groups[0]["lr"]))
        self.push_dtype = self._push_dtype(push_dtype)
        pushes_in_backward = self._pushes_in_backward(push_in_backward, dropping)
        #: rule allreduce: the GPUs this rank trains on, which no other rank of the store in this process may
        self._gpus = take_gpus([t for _, t, _ in self._entries], name, self.rank) if rule == "allreduce" else []
        self._loop = LoopThread(f"smb2-{name}")
        self._client: Client | None = None
        self._watching: asyncio.Task[None] | None = None
        self._agent_address = _agent_address(agent)
        self._agent_client: Client | None = None
        try:
            if self.rule_name in WIRED_RULES:
                options["wire"] = self.push_dtype       # the rule's: the client converts (fewer bytes on the wire)
            if self.rule_name == "diloco":
                options["buffers"] = [n for n, _, param in self._entries if not param]
            if self.rule_name == "allreduce":
                # a worker restarted on its own is taken back into the lockstep rounds; one that torchrun
                # restarts with its whole group opens a resumed run with the others
                options.setdefault("rejoin", restarts_alone(self.world))
            self.store = self._loop.run(self._open(servers, name, rule, dropping, timeout,
                                                   dict(options, resume=resume)))
            #: this rank's optimizer state, step and LR schedules, saved beside the store (whole resume)
            # (allreduce: every rank's optimizer state is the same one, which rank 0 saves for all, with
            # the weights, which the store gets only at close)
            lockstep = isinstance(self.store.rule, AllReduce)
            taken_back_at = self._back_into_lockstep(servers, name, rule, dropping, timeout,
                                                     dict(options, resume=resume))
            self._saved = SavedState.open(optimizer, (self, optimizer), self.store, self._loop, state_every,
                                          shared=lockstep, weights=self._weights_now if lockstep else None,
                                          share=state_share, handed_over=taken_back_at)
            if isinstance(self.store.rule, AllReduce):
                self.store.rule.hand_over = self._hand_over
                if taken_back_at is not None:
                    self.store.rule.taken_back_at = self._saved.start_step
        except BaseException as e:
            give_back_gpus(self._gpus)
            self._loop.run(self._close_client())
            self._loop.stop()
            if isinstance(e, Smb2Error):
                raise in_training_terms(e, store=name, rank=self.rank, step=0) from None
            raise
        #: an elastic rule (EASGD, DiLoCo), which trains the local copy and exchanges with the shared weights
        #: every few steps
        self._elastic: UpdateRule | None = self.store.rule if self.store.rule.elastic else None
        # (an elastic rule's exchange waits for the one before: each round sees the others' last pushes)
        self.store.lag = LagScaling(self.world, 0 if self._elastic else staleness,
                                    enabled=lag_scaling)
        self.store.guard.enabled = guard
        flat = self.store.flat()
        # a change counts 1/W in the shared copy where every worker's change
        # is its own estimate of one step: buffers, and delta's steps (each
        # worker's momentum or Adam moments act once, not W times)
        averaged = average and rule == "delta"
        self.staging = Staging(torch, [Entry(n, t, self.store.flat_offset(n),
                                             1.0 / self.world if averaged or not param else 1.0, param)
                                       for n, t, param in self._entries], flat.size, flat.dtype)
        self._register = self.staging.cuda
        self._mean_waited = 0.0
        #: rule allreduce: the rounds of gradients whose mean the optimizer steps on
        self._mean = MeanGradients(torch, self.staging.entries, flat.size, self.store.rule, self._loop,
                                   self._round_in_training_terms, lambda: self.steps + 1,
                                   self._saved.take_loss_scale if taken_back_at is not None else None) \
            if isinstance(self.store.rule, AllReduce) else None
        if self._mean is not None and self.rank == 0:
            # the store's weights are rank 0's, written at close and before each checkpoint
            self.store.publish_weights = self._write_weights
        #: the weights of the model's Linear and Conv layers in the store: their rows (a unit: an output
        #: feature or channel) are what the collapse watch counts as dead or alive
        mine = {id(e.tensor) for e in self.staging.entries if e.param}
        self._unit_weights = [m.weight for m in model.modules() if isinstance(m, UNIT_LAYERS)
                              and isinstance(m.weight, torch.Tensor) and id(m.weight) in mine and m.weight.dim() >= 2]
        # rank 0's values (or the resumed ones) for everyone
        self.staging.swap(flat if self._saved.weights is None else self._saved.weights, None)
        self._free: list[Exchange] = []
        self._inflight: collections.deque[Exchange] = collections.deque()
        #: the exchange of the coming step, once backward started pushing into it
        self._next: Exchange | None = None
        shared = self.store.rule
        self._backward = None if not (pushes_in_backward and shared.pushes_in_backward) else BackwardPushes(
            torch, self.staging.entries, shared, self._loop, self._upcoming,
            lambda: float(self.optimizer.param_groups[0]["lr"]))
        self.steps = self._saved.start_step
        self._pulled_at = self.steps            # the step after which the weights in use were pulled
        self._round_from = self.steps           # an elastic rule's: the step its round started after
        self._pulled_version = self.store.pulled_version    # and the store's version they hold
        self._stats = {"steps": 0, "wait_s": 0.0, "max_lag": 0, "exchanges": 0}
        self._lags: collections.Counter[int] = collections.Counter()
        self._t_first: float | None = None
        self.closed = False

    # -- setting up --------------------------------------------------------------
    @staticmethod
    def _synced_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer, buffers: bool
                        ) -> tuple[list[tuple[str, torch.Tensor, bool]], list[tuple[str, torch.Tensor]]]:
        """(name, tensor, is a parameter) of what the store holds: trainable
        parameters, floating-point buffers; and (name, parameter) of those
        the optimizer holds that are frozen now."""
        lazy = [n for n, p in named_parameters(model) if isinstance(p, torch.nn.parameter.UninitializedParameter)]
        if lazy:
            raise InvalidArgumentError(
                f"parameters {', '.join(lazy[:3])}{' ...' if len(lazy) > 3 else ''} are not initialized yet (a lazy "
                f"module's, such as nn.LazyLinear): the store is laid out from the parameters' shapes",
                hint="run the model once on a dummy batch before making the AsyncOptimizer (as for DDP)")
        params = [(n, p) for n, p in named_parameters(model) if p.requires_grad]
        if not params:
            raise InvalidArgumentError("the model has no parameters that require a gradient: nothing to train")
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
        ours = {id(p) for _, p in model.named_parameters()}
        if owned - ours:
            raise InvalidArgumentError(
                f"the optimizer holds {len(owned - ours)} tensors that are not parameters of the model: "
                "their updates would never be shared",
                hint="build the optimizer from model.parameters() of the model you pass")
        unowned = [n for n, p in params if id(p) not in owned]
        if unowned:
            log.warning("parameters %s%s require a gradient but the optimizer does not step them: the store holds "
                        "them and their gradients travel with every exchange. Where another optimizer steps them, "
                        "give each AsyncOptimizer the module its optimizer steps (AsyncOptimizer(opt, "
                        "model.encoder, ...)); else freeze them (requires_grad_(False))", ", ".join(unowned[:5]),
                        " ..." if len(unowned) > 5 else "")
        frozen_owned: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in named_parameters(model)
                                                        if not p.requires_grad and id(p) in owned]
        if frozen_owned:
            log.info("parameters %s do not require a gradient: rank 0's values for every rank, never pushed (a step "
                     "after they are unfrozen is refused)", [n for n, _ in frozen_owned])
        for n, t in params:
            if not t.is_floating_point():
                raise InvalidArgumentError(f"parameter {n!r} is {t.dtype}; smb2.torch trains float parameters")
        out: list[tuple[str, torch.Tensor, bool]] = [(n, p, True) for n, p in params]
        if buffers:
            out += [(n, b, False) for n, b in named_buffers(model) if b.is_floating_point()]
        return out, frozen_owned

    def _push_dtype(self, push_dtype: str | None) -> str | None:
        """The wire type of pushes (None: the store's dtype)."""
        if push_dtype is None:
            bf16 = any(t.dtype == torch.bfloat16 for _, t, _ in self._entries)
            # diloco's pseudo-gradient of a whole round is big and smooth, and allreduce's mean of W
            # gradients as exact as the mean of bf16 gradients: bf16 by default
            return "bfloat16" if (bf16 and self.rule_name == "delta") or self.rule_name in ("diloco", "allreduce") \
                else None
        if push_dtype not in PUSH_DTYPES:
            raise InvalidArgumentError(f"push_dtype must be one of {', '.join(PUSH_DTYPES)}, not {push_dtype!r}")
        wire = PUSH_DTYPES[push_dtype]
        if wire is not None and self.rule_name not in WIRED_RULES:
            raise InvalidArgumentError(f"push_dtype={push_dtype!r} applies to rules {' and '.join(WIRED_RULES)}, "
                                       f"not {self.rule_name!r}")
        return wire

    def _pushes_in_backward(self, wanted: bool | None, dropping: LayerDropping | None) -> bool:
        """Will backward's hooks push the gradients (see :mod:`smb2.torch.backward`)?"""
        if wanted is not None and not isinstance(wanted, bool):
            raise InvalidArgumentError(f"push_in_backward must be True, False or None, not {wanted!r}")
        why_not = None
        if self.rule_name != "accumulate":
            why_not = f"rule {self.rule_name!r} does not push the gradient" + (
                ": its change exists only after opt.step()" if self.rule_name == "delta" else "")
        elif dropping is not None:
            why_not = "layer dropping ranks all of a step's layers before it sends any"
        elif any(t.device.type != "cpu" for _, t, _ in self._entries):
            why_not = "the model is not on the CPU (its gradients are staged after step(), on the side stream)"
        if wanted and why_not is not None:
            raise InvalidArgumentError(f"push_in_backward=True is not possible here: {why_not}",
                                       hint="rule='accumulate' (plain SGD) on a CPU model without layer dropping "
                                            "pushes during backward; leave push_in_backward unset for 'where "
                                            "possible'")
        return why_not is None and wanted is not False

    async def _open(self, servers: str | list[str] | None, name: str, rule: str, dropping: LayerDropping | None,
                    timeout: float, options: dict[str, Any]) -> ParameterStore:
        # through an agent, a server the worker never reaches itself gets no connection from it: the
        # first pull too goes through the agent
        through_agent = self._agent_address is not None and rule in AGENT_RULES
        self._client = await connect(servers, lazy=through_agent)
        arrays = {n: t.detach().to("cpu", torch.float64 if self._store_f64 else torch.float32).numpy()
                  for n, t, _ in self._entries}
        # the store takes its own options (resume, stripe, checkpoint_every...) and hands the rest to the rule
        store = await ParameterStore.open(self._client, name, arrays, rule=rule, workers=self.world,
                                          rank=self.rank, dropping=dropping, timeout=timeout,
                                          pull=not through_agent, **options)
        if store.workers != self.world:
            raise InvalidArgumentError(f"store {name!r} was made for {store.workers} workers; this job has "
                                       f"{self.world} (WORLD_SIZE)", hint="use another name, or the same WORLD_SIZE")
        # frozen parameters and the buffers the store does not hold: rank 0's
        # for everyone, as DDP broadcasts them (stamped with the run, which
        # the others wait for: frozen.py says why the barrier is not enough)
        opened_the_run = self.rank == 0 and not store.rejoined
        if opened_the_run:
            await self.frozen.publish(self._client, name, store.generation, store.buf.replicas)
        await store.join(timeout)
        if not opened_the_run:
            await self.frozen.adopt(self._client, name, store.generation, timeout)
        # (the rule first: no connection to an agent that would not be used)
        if self._agent_address is not None and store.agent_serves_rule():
            self._agent_client = await connect([self._agent_address])
            await store.use_agent(self._agent_client, timeout=timeout, host_workers=host_workers())
        if through_agent:
            await store.pull()
        #: the exchanges in flight, and the servers that keep one waiting without a word
        self._watch = ExchangeWatch(self._client, name, self.rank, self._agent_client)
        self._watching = asyncio.get_running_loop().create_task(self._watch.watch())
        return store

    @property
    def _store_f64(self) -> bool:
        return all(t.dtype == torch.float64 for _, t, param in self._entries if param)

    # -- torch.optim.Optimizer's face: the wrapped optimizer's state ------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise InterfaceError(
            f"rank {self.rank}: a parameter group cannot be added to the AsyncOptimizer of store "
            f"{self.store.name!r}: the store is laid out from the parameters it trains when it is made",
            hint="give the torch optimizer every group when it is made, while their parameters require a gradient "
                 "(a group that trains later can start at lr=0, or be frozen after the AsyncOptimizer is made: it "
                 "stays in the store and trains again when unfrozen), or make a new AsyncOptimizer then (as a DDP "
                 "model is wrapped again)")

    def __repr__(self) -> str:
        return (f"AsyncOptimizer({self.optimizer.__class__.__name__}, store={self.store.buf.name!r}, "
                f"rule={self.rule_name!r}, staleness={self.staleness}, rank={self.rank}/{self.world})")

    # -- training ------------------------------------------------------------------
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of the wrapped optimizer on the local weights, then its
        exchange with the store (see the module's doc).  Raises here any
        error the background exchange met, with its original type."""
        self._check_open()
        self._raise_failed()
        self._check_outside()
        t_start = time.perf_counter()
        if self._t_first is None:
            self._t_first = t_start
        if self._gradient_rule:
            check_plain_sgd(self.optimizer, self.rule_name)
        self._saved.before_step()
        if self._mean is not None:
            return self._step_on_mean(closure)
        self._watch_gradients()
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.steps += 1
        self._saved.after_step(self.steps)
        wait = 0.0
        if self._elastic:
            self._elastic.inner_step()
            if self.steps - self._round_from >= self._elastic.exchange_every:
                wait += self._settle(limit=0)               # one exchange with the center at a time
                self._end_round()
            else:
                wait += self._settle(limit=None)
        else:
            self._launch()
            wait += self._settle(limit=self.staleness)
        self._count_step(wait, self.lag)
        return loss

    def _check_outside(self) -> None:
        """Refuse a step that would move a parameter the store does not hold."""
        moved = [n for n, p in self._outside if p.grad is not None]
        if moved:
            raise InterfaceError(
                f"rank {self.rank} step {self.steps + 1}: parameters {', '.join(moved[:3])}"
                f"{' ...' if len(moved) > 3 else ''} have gradients, but they were frozen (requires_grad=False) "
                f"when the AsyncOptimizer was made, so store {self.store.name!r} does not hold them: each rank "
                f"would step them on its own gradients and the ranks' models would drift apart",
                hint="make the AsyncOptimizer while they require a gradient and freeze them after (a parameter "
                     "frozen later stays in the store, and trains again when unfrozen), or make a new "
                     "AsyncOptimizer once they train (as a DDP model is wrapped again)")

    def _count_step(self, wait: float, lag: int) -> None:
        self._lags[lag] += 1
        self._stats["max_lag"] = max(self._stats["max_lag"], lag)
        self._stats["steps"] += 1
        self._stats["wait_s"] += wait
        if self.log_every and self._stats["steps"] % self.log_every == 0:
            log.info("rank %d step %d: %s", self.rank, self.steps, self.stats())

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside exchange nothing: their gradients
        accumulate in ``.grad``, and the next backward outside sends the
        sum with its own (torch DDP's ``model.no_sync()``, for gradient
        accumulation: one round a step rather than one a micro-batch).
        Rule ``allreduce`` only; the other rules exchange at ``step()``,
        not in backward, and it changes nothing there.  A ``step()`` whose
        last backward ran inside is refused: its gradients are this rank's
        own."""
        self._check_open()
        if self._mean is None:
            yield
            return
        was, self._mean.deferred = self._mean.deferred, True
        try:
            yield
        finally:
            self._mean.deferred = was

    def _step_on_mean(self, closure: Callable[[], float] | None) -> float | None:
        """Rule allreduce: backward left the workers' mean in the gradients
        (:mod:`smb2.torch.allreduce`); the wrapped optimizer steps on it."""
        assert self._mean is not None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()        # (its backward leaves the mean in the gradients)
        else:
            loss = None
        if self._mean.unreduced:
            raise InterfaceError(f"rank {self.rank} steps on gradients that only it has: the last backward "
                                 f"before step {self.steps + 1} ran inside opt.no_sync(), which sends nothing "
                                 f"(rule 'allreduce': every rank steps on the mean of every rank's gradients)",
                                 hint="run the last micro-batch's backward outside no_sync(), as with torch "
                                      "DDP's model.no_sync(): it sends the accumulated gradients")
        if self._mean.rule.rounds == self._mean.rule.step_round:
            raise InterfaceError(f"rank {self.rank} step {self.steps + 1}: step() with no backward since the last "
                                 f"step; rule 'allreduce' steps every rank on the mean of every rank's gradients of "
                                 f"the step, so each step needs a backward on every rank (this rank's rounds would "
                                 f"fall out of line with the others')",
                                 hint="to leave a batch out, leave its whole step out (backward and step) on every "
                                      "rank, or use rule='diloco', whose ranks step on their own gradients")
        self._mean.rule.stepped()      # (each step needs a round of its own; the next one begins a step)
        self._watch_gradients()
        self.optimizer.step()
        self._stats["exchanges"] = self._mean.rule.rounds
        self.steps += 1
        self._saved.after_step(self.steps)
        # the wait was backward's, for the means, since the last step
        waited, self._mean_waited = self._mean.waited - self._mean_waited, self._mean.waited
        self._count_step(waited, 0)
        return loss

    def _end_round(self) -> None:
        """An elastic rule's round ends: its exchange goes out, and the next round starts."""
        assert self._elastic is not None
        self._elastic.round_ended(self.steps - self._round_from)
        self._round_from = self.steps
        self._launch()

    def _watch_gradients(self) -> None:
        """Show this step's gradients to the collapse watch (a few times a
        second: it costs one device sync): which tensors' are exactly zero,
        and how many units (rows of a Linear or Conv weight) got none."""
        watch = self.store.watch
        if not watch.due("gradients"):
            return
        with torch.no_grad():
            grads = [(e.tensor.numel(), e.tensor.grad) for e in self.staging.entries
                     if e.param and e.tensor.grad is not None]
            if not grads:
                return
            # one pass over each gradient: a unit layer's weight is read row by row (its rows'
            # flags also say whether any of it is alive), every other tensor whole
            rows = {id(w.grad): w.grad.reshape(w.shape[0], -1).any(1) for w in self._unit_weights
                    if w.grad is not None and not w.grad.is_sparse}
            flags = [rows[id(g)] if id(g) in rows else g.any().reshape(1) for _, g in grads]
            counts = torch.stack([f.any() for f in flags] + [(~f).sum() for f in rows.values()]).tolist()
        alive = counts[:len(grads)]
        watch.see_gradients(self.steps + 1, sum(n for (n, _), a in zip(grads, alive) if not a),
                            sum(n for n, _ in grads), int(sum(counts[len(grads):])),
                            sum(f.numel() for f in rows.values()))

    def _take(self) -> Exchange:
        if self._free:
            ex = self._free.pop()
            if ex.changed_since:
                for t in ex.since:
                    t.zero_()
            ex.changed_since = False
        else:
            st = self.staging
            grads = st.host_array() if self._gradient_rule else None
            ex = Exchange(0, st.host_array(), st.host_array(), grads, since=st.new_since(),
                          early=StepPushes(grads))
            if self._register:
                for arr in (ex.stage, ex.snapshot):
                    self._loop.run(self._register_array(arr))
        # this step's communication starts after the previous step's exchange
        # (whose pull must not see this step's pushes: see _land)
        ex.early.reset(self._inflight[-1].future if self._inflight else None)
        return ex

    def _upcoming(self) -> StepPushes:
        """Where backward's hooks push the coming step (training thread)."""
        if self._next is None:
            self._next = self._take()
        return self._next.early

    def _launch(self) -> None:
        ex, self._next = (self._next or self._take()), None
        ex.step = self.steps
        ex.based_on = (self._pulled_version, self.steps - 1 - self._pulled_at)
        st = self.staging
        if self._elastic:
            st.load(ex.stage)
        else:
            st.capture(ex.stage, [e.since for e in self._inflight])
            for e in self._inflight:
                e.changed_since = True
            if ex.grads is not None:
                ex.lr = float(self.optimizer.param_groups[0]["lr"])     # this step's (schedulers apply)
                if self._backward is not None:
                    self._backward.settle_step(ex.early, ex.lr)
                self._stage_grads(ex)
        ex.future = self._loop.submit(self._in_training_terms(self._exchange(ex), ex.step))
        self._inflight.append(ex)
        self._stats["exchanges"] += 1

    def _stage_grads(self, ex: Exchange) -> None:
        """The gradients that backward did not push yet go into ``ex.grads``."""
        assert ex.grads is not None
        ex.rest.clear()
        with torch.no_grad():
            for e in self.staging.entries:
                if e.param and e.tensor.grad is not None and e.name not in ex.early.lrs:
                    n = e.tensor.numel()
                    torch.from_numpy(ex.grads[e.offset:e.offset + n]).copy_(flat_values(e.tensor.grad))
                    ex.rest.append(e.name)

    def _settle(self, limit: int | None) -> float:
        """Swap in the exchanges that are done; wait for the oldest until
        the lag is at most ``limit`` (None: never wait).  Seconds waited."""
        waited = 0.0
        while self._inflight:
            ex = self._inflight[0]
            if not ex.future.done():
                if limit is None or self.steps - self._pulled_at <= limit:
                    break
                t0 = time.perf_counter()
                try:
                    ex.future.result()
                finally:
                    waited += time.perf_counter() - t0
            self._inflight.popleft()
            ex.future.result()          # its error, in its type
            self._land(ex)
        return waited

    def _land(self, ex: Exchange) -> None:
        if self._elastic:
            self.staging.add(ex.snapshot)
        else:
            # the pull saw this worker's changes up to ex.step; its later
            # ones (ex.since) are added back on top
            self.staging.swap(ex.snapshot, ex.since if ex.changed_since else None)
        self._pulled_at = ex.step
        self._pulled_version = ex.version
        self._free.append(ex)

    async def _round_in_training_terms(self, work: Coroutine[Any, Any, None], step: int) -> None:
        """Rule allreduce: a round, then this rank's heartbeat, faults in training terms."""
        async def round_then_heartbeat() -> None:
            await work
            # the steps done: the weights hold step - 1's update while step's gradients
            # travel, so a checkpoint made now holds the weights of the step it is named after
            await self.store.heartbeat(step - 1)
        await self._in_training_terms(round_then_heartbeat(), step)

    async def _in_training_terms(self, work: Coroutine[Any, Any, None], step: int) -> None:
        """``work``'s faults as the user meets them: one line naming the
        store, this rank, the step and the server, and what to do."""
        try:
            with self._watch.running(step):
                await work
        except Smb2Error as e:
            raise in_training_terms(e, store=self.store.name, rank=self.rank, step=step) from None

    async def _exchange(self, ex: Exchange) -> None:
        """Push ``ex``'s step, then pull (in the background loop)."""
        st = self.store
        await wait_for(ex.early.after)
        if self.staging.cuda:
            await asyncio.to_thread(self.staging.ready)       # the side stream's copies into ex.stage
        views = {e.name: ex.stage[e.offset:e.offset + e.tensor.numel()] for e in self.staging.entries}
        if self._elastic:
            flat = st.flat()
            flat[...] = ex.stage
            await self._elastic.exchange(step=ex.step)
            np.subtract(flat, ex.stage, out=ex.snapshot)     # -d: how the local weights move
        else:
            if ex.grads is not None:
                grads = {n: ex.grads[st.flat_offset(n):st.flat_offset(n) + st.params[n].size].reshape(
                    st.params[n].shape) for n in ex.rest}
                buffers = {e.name: views[e.name] for e in self.staging.entries if not e.param}
                if ex.early.lrs:
                    # part of the step went out during backward: the rest, then one version
                    assert self._backward is not None
                    await self._backward.finish(ex.early)
                    await st.count_push(await st.rule.push(grads, lr=ex.lr))
                else:
                    await st.push(grads, lr=ex.lr, step=ex.step, based_on=ex.based_on)
                await _accumulate_each(st, buffers)
            else:
                # the stage is laid out like the data region
                await st.push_region(ex.stage, step=ex.step, based_on=ex.based_on)
            ex.version = await st.pull_into(ex.snapshot)
        await st.heartbeat(ex.step)

    # -- state and the end -----------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Steps, seconds the training thread waited on communication, their
        share of its time since the first step, the largest lag seen, the
        store's byte counts, and what kept the updates in bounds: pushes
        the guard ``skipped`` (far out of line) and ``refused`` (not
        finite), pushes ``lag_scaled``, the ``max_version_lag``, the
        ``collapses`` of the shared model the watch saw (``smb2 ls`` shows
        the run's sums), ``via``: where the weights were exchanged
        ("servers", "agent", "servers (agent lost)"), and
        ``servers_connected``: how many memory servers this worker holds a
        connection to (through an agent, those it reached itself)."""
        s: dict[str, Any] = dict(self._stats)
        elapsed = time.perf_counter() - self._t_first if self._t_first is not None else 0.0
        s["elapsed_s"] = elapsed
        s["comm_wait_share"] = s["wait_s"] / elapsed if elapsed > 0 else 0.0
        s["lags"] = dict(sorted(self._lags.items()))
        s["push_in_backward"] = self._backward is not None and self._backward.enabled
        s["pushes_in_backward"] = 0 if self._backward is None else self._backward.issued
        s.update({k: v for k, v in self.store.stats.items() if k.startswith("bytes")})
        s.update(self.store.counts())       # the guard's, the lag scaling's and the collapse watch's
        s.update(self.store.rule.round_stats())     # diloco's local_steps="auto": its rounds' lengths
        s["via"] = self.store.weights.via           # the servers, or the host agent (smb2-agent)
        s["servers_connected"] = sum(t != "-" for t in self.store.buf.client.transports)
        return s

    @property
    def lag(self) -> int:
        """Own steps the model's weights run past its last pull (at most
        ``staleness`` when :meth:`step` returns).  Rule allreduce: 0 (nothing
        is pulled: every step is on the mean of its own round)."""
        return 0 if self._mean is not None else self.steps - self._pulled_at

    @property
    def start_step(self) -> int:
        """The step this worker started from (0 unless the store resumed):
        that of its saved optimizer state (see :mod:`smb2.torch.resume`)."""
        return self._saved.start_step

    @property
    def resumed(self) -> bool:
        return self.store.resumed

    def flush(self) -> None:
        """Wait for every exchange in flight and swap in the last pull."""
        self._check_open()
        t0 = time.perf_counter()
        self._settle(limit=-1)
        self._stats["wait_s"] += time.perf_counter() - t0

    def pull(self) -> None:
        """Flush, then take the shared weights (e.g. to evaluate the model
        the workers train together; EASGD: the center)."""
        self.flush()
        self._take_shared()

    def _take_shared(self) -> None:
        if self._mean is not None:
            return      # every worker's weights are the shared model (the store's are written at close)
        if self._elastic:
            # into the mirror: an elastic rule's next exchange starts from it (DiLoCo: a new round)
            self._loop.run(self.store.pull())
            self.staging.swap(self.store.flat(), None)
            return
        snapshot = self.staging.host_array()
        # the store's pull: checked by the guard and the collapse watch, counted, and with the version
        # the weights hold, from which the next push's lag counts (a plain read left the lag counting
        # from the pull before, and a push made on these weights was scaled as if it were late)
        version = self._loop.run(self.store.pull_into(snapshot))
        self.staging.swap(snapshot, None)
        self._pulled_at, self._pulled_version = self.steps, version

    def close(self, *, wait_all: float | None = None, strict: bool = False) -> RunEnd | None:
        """Flush, tell the store this worker finished (it is never
        destroyed here: other workers may still train), close the client
        and stop the background thread.  Raises what the last exchanges met.

        ``wait_all=T``: then wait up to ``T`` s until every worker finished,
        take the final shared weights into the model (to evaluate or save
        the model the job trained) and return a :class:`RunEnd`: who
        finished, and who is missing since which step.  A worker that died
        does not fail the others: a missing one is logged (a warning) and
        reported, and this worker goes on to evaluate and save; with
        ``strict=True`` it raises :class:`NotifyTimeout` instead.  A shared
        model that collapsed during the run (some rank's collapse watch saw
        it, :mod:`smb2.train.stability`) is in the report
        (``end.collapsed``, and logged); ``strict=True`` raises
        :class:`TrainingDiverged` for it.  Without ``wait_all``, returns None."""
        if self.closed:
            return None
        self.closed = True
        end = None
        try:
            self._settle(limit=-1)
            if self._mean is not None:
                self._mean.close()
                assert isinstance(self.store.rule, AllReduce)
                if self.rank == self.store.rule.leader:     # (rank 0, or the lowest survivor of its loss)
                    self._loop.run(self.store.checkpoint_saved())
                    self._loop.run(self._write_weights())
                # the rounds' heartbeats said the steps done before each round: the last one counts too
                self._loop.run(self.store.heartbeat(self.steps, force=True))
            if self._elastic and self._elastic.exchange_at_close and self.steps > self._round_from:
                self._end_round()   # the last, shorter round
                self._settle(limit=-1)
            if self._backward is not None:
                self._backward.close()
                if self._next is not None and self._next.early.lrs:
                    # a backward whose step never came: take its pushes back
                    self._backward.settle_step(self._next.early, 0.0, final=False)
                    self._loop.run(self._backward.finish(self._next.early))
            self._saved.close(self.steps)
            self._loop.run(self.store.finish())
            if wait_all is not None:
                end = self._loop.run(self.store.await_finished(wait_all))
                end.frozen_changed = self.frozen.changed()
                if isinstance(self.store.rule, AllReduce) and self.rank != self.store.rule.leader:
                    end.drifted = self._drifted_from_leader()
                self._take_shared()
        except Smb2Error as e:
            raise in_training_terms(e, store=self.store.name, rank=self.rank, step=self.steps) from None
        finally:
            give_back_gpus(self._gpus)
            try:
                self._loop.run(self._close_client())
            finally:
                self._loop.stop()
        log.info("rank %d closed after %d steps: %s", self.rank, self.steps, self.stats())
        if end is not None:
            if end.collapsed and strict:
                raise TrainingDiverged(str(end), hint="the model holds the collapsed shared weights: restart from a "
                                                      "checkpoint (init_from=) with a lower learning rate, gradient "
                                                      "clipping, or average=True, lag_scaling=True")
            if end.collapsed:
                log.warning("rank %d: %s", self.rank, end)
            if not end.complete:
                if strict:
                    raise NotifyTimeout(str(end), hint="strict=False (the default) returns this report "
                                                       "instead, and the model holds the shared weights")
                log.warning("rank %d: %s; the model holds the shared weights as they are", self.rank, end)
            if end.drifted:
                leader = self.store.rule.leader if isinstance(self.store.rule, AllReduce) else 0
                log.warning("rank %d ends with weights that differ from rank %d's (%s): under rule allreduce every "
                            "rank steps on the same mean, so something this rank did alone moved them (a learning "
                            "rate set from its own metric, such as ReduceLROnPlateau on this rank's loss; weights "
                            "changed by hand on one rank); the store holds rank %d's", self.rank, leader,
                            ", ".join(end.drifted[:5]) + (" ..." if len(end.drifted) > 5 else ""), leader)
            if end.frozen_changed:
                log.warning("rank %d: frozen parameters %s differ from the values rank 0 gave every rank at "
                            "start: this worker trained against another model than the others", self.rank,
                            end.frozen_changed)
        return end

    async def _write_weights(self) -> None:
        """Rule allreduce: rank 0's weights (every worker's) become the store's."""
        await self.store.buf.write(self.store.data_off, self._weights_now())

    def _drifted_from_leader(self) -> list[str]:
        """Rule allreduce, after every rank finished: the tensors whose
        weights here differ from the leader's, which it wrote at its close."""
        leader = np.empty_like(self.store.flat())
        self._loop.run(self.store.buf.read_into(leader, self.store.data_off))
        mine = self._weights_now()
        return [e.name for e in self.staging.entries if e.param and not np.array_equal(
            mine[e.offset:e.offset + e.tensor.numel()], leader[e.offset:e.offset + e.tensor.numel()])]

    def _back_into_lockstep(self, servers: str | list[str] | None, name: str, rule: str,
                            dropping: LayerDropping | None, timeout: float, options: dict[str, Any]) -> int | None:
        """Rule allreduce, this rank restarted on its own into a run that goes
        on: wait to be taken back; the round it was taken back at (its
        leader handed it its state), else None.  Where no one is left to
        take it back, every worker went down and this restart is the whole
        job's: the store is opened again so (rank 0 opens a resumed run from
        its last save, the others join it); where the others finished, it
        loads rank 0's last save, the run's end, as a resumed rank."""
        shared = self.store.rule
        if not (isinstance(shared, AllReduce) and self.store.rejoined):
            return None
        at = self._loop.run(shared.rejoin(timeout))
        if at is None and not shared.run_over:
            self._loop.run(self._close_client())
            self.store = self._loop.run(self._open(servers, name, rule, dropping, timeout, dict(options, rejoin=False)))
        return at

    async def _hand_over(self, restarted: dict[int, int], round_: int) -> int:
        """Rule allreduce, this rank leading, at the start of round
        ``round_`` (its step's backward under way): write what the
        ``restarted`` ranks need to train on in step from there; the step
        they continue after."""
        step = self.steps
        await self._saved.hand_over(restarted, round_, step)
        return step

    def _weights_now(self) -> np.ndarray:
        """The model's weights (the store's tensors) as a flat host array of their own."""
        weights = self.staging.host_array()
        self.staging.load(weights)
        return weights

    async def _register_array(self, arr: np.ndarray) -> None:
        """Pinned host memory registered with the client: RDMA reads and
        writes land in it without copies (nothing to do over TCP)."""
        assert self._client is not None
        self._client.register(arr)

    async def _close_client(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
            self._watch.close()
        if self._agent_client is not None:
            await self._agent_client.close()
        if self._client is not None:
            await self._client.close()

    def __enter__(self) -> AsyncOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise InterfaceError("the AsyncOptimizer is closed")

    def _raise_failed(self) -> None:
        for ex in self._inflight:
            if ex.future.done() and ex.future.exception() is not None:
                ex.future.result()


def _refuse_in_a_child_rerunning_the_script(name: str) -> None:
    """Refuse an AsyncOptimizer made while multiprocessing runs the main
    script again to start a child process (the "spawn" and "forkserver"
    start methods do, for a DataLoader's workers among others): in a script
    without ``if __name__ == "__main__":`` the child would open the store
    as this rank, with its RANK and WORLD_SIZE, and open a new run, which
    ends the job's own (its ranks stop with "re-opened by a newer run")."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_fixup_main_from_path" and frame.f_globals.get("__name__") == \
                "multiprocessing.spawn":
            raise InterfaceError(
                f"an AsyncOptimizer of store {name!r} is being made in a child process, while multiprocessing "
                "runs the main script again to start it (a DataLoader worker, or any process started with the "
                "'spawn' or 'forkserver' method): it would open the store as this rank and end the job's run",
                hint="put the script's training under `if __name__ == \"__main__\":` (which those start methods "
                     "need), or start the DataLoader's workers with multiprocessing_context=\"fork\"")
        frame = frame.f_back


def _agent_address(agent: bool | str | None) -> str | None:
    """The host agent's "host:port" that ``AsyncOptimizer(agent=...)`` asks for, or None."""
    if agent is None:
        return agent_address()
    if agent is False:
        return None
    if agent is True:
        return agent_address() or f"127.0.0.1:{DEFAULT_AGENT_PORT}"
    if isinstance(agent, str) and agent.strip():
        return agent.strip()
    raise InvalidArgumentError(f"agent must be None, True, False or a 'host:port', not {agent!r}")


async def _accumulate_each(st: ParameterStore, changes: dict[str, np.ndarray]) -> None:
    await asyncio.gather(*(st.weights.accumulate(st.ranges[n][0] - st.data_off, d) for n, d in changes.items()))


__all__ = ["AsyncOptimizer", "check_plain_sgd"]
