"""What keeps asynchronous updates in bounds: lag scaling and the divergence guard.

**Lag.**  A worker computes its step on the weights of its last pull, taken
at store version ``v_pull`` (the version counts the pushes applied).  When
its push lands the store is at ``v_now``; its own pushes in between are
already in its weights, so the step's *lag* is the number of other workers'
updates it did not see::

    lag = v_now - v_pull - own pushes since that pull

With ``W`` workers of equal speed and staleness ``s`` a step's window spans
``s + 1`` step times, so the expected lag is ``L0 = (s + 1) (W - 1)``.
:class:`LagScaling` scales a push by (Zhang et al., "Staleness-aware
async-SGD", IJCAI 2016, relative to the expected lag)::

    factor = min(1, max(1, L0) / lag)

A push at or below the expected lag goes in whole; a worker 4x slower than
the others (its lag is about 4 L0) counts a quarter; a worker paused for
seconds (lag in the hundreds) barely moves the model.  So no worker moves the
shared model by more than its share of the time, whatever its speed.

**Guard.**  :class:`DivergenceGuard` looks at every change before it is
pushed: a non-finite value is refused with :class:`TrainingDiverged` (rank,
step, tensor, what to do) and nothing is pushed; a change whose norm exceeds
``multiple`` (10) times the median of the last ``window`` (64) pushes' norms
(once ``warmup`` (8) were seen) is skipped, counted and logged once.  Every
norm, a skipped one too, enters the window, so a lasting change of scale (a
learning-rate schedule that raises the rate) is accepted after about half a
window, while a lone spike is not.  A pull whose values are not finite (the
shared model diverged) is refused the same way instead of being swapped in.

**Collapse watch.**  A shared model can also collapse while every value
stays finite: under an overloaded host with a straggler, W momentum streams
computed on stale weights blew the weights of the digits CNN up to 10-23
times their initial norm within 4-8 s, after which 98 % of its parameters
got exactly zero gradients (dead units: it predicted one class, 8.9 %) for
good.  A model can also end **half dead**: most units dead, a few alive, so
no tensor's gradient is all zero (the digits CNN at 13 % accuracy with 1-4
of the 64 units of its widest layer alive, 81-88 % of all its units dead).
:class:`CollapseWatch` looks for all three, each at most every ``every``
(0.2) s: a model is **dead** when the tensors whose gradient is exactly zero
hold ``dead_share`` (90 %) of its parameters, or when ``dead_units`` (70 %)
of the units of its Linear and Conv layers (a weight row: an output feature
or channel) got exactly zero gradient, in ``patience`` (5) looks in a row
(AsyncOptimizer shows it each step's gradients; measured on a batch,
healthy training left at most 24 % of the units dead, a stressed run that
still learned 43 %, a model that lost units to a learning-rate spike and
recovered 62 %, half-dead ones 74-88 %); it is **blown up or
dying** when the norm of the shared weights a pull brought leaves
``[base / growth, base * growth]`` (``growth`` 8), ``base`` being the norm
at the first look after ``settle`` (20) pulls (the scale of a model that
just started can move a lot; one that starts at zero has none).  Healthy training grows the norm slowly: the
same CNN trained alone for 40 epochs ends at 2.5 times it.  A collapse is
logged once with the rank, the step and what to do, and counted.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Mapping

import numpy as np

from ..errors import InvalidArgumentError, Smb2Error

log = logging.getLogger("smb2.train")

__all__ = ["CollapseWatch", "DivergenceGuard", "LagScaling", "TrainingDiverged"]


class TrainingDiverged(Smb2Error):
    """A worker's update, or the shared model, is not finite (or out of all
    proportion): refused so that the shared model stays usable."""


class LagScaling:
    """``factor(lag) = min(1, max(1, L0) / lag)`` with ``L0 = (s + 1) (W - 1)``."""

    def __init__(self, workers: int, staleness: int = 0, enabled: bool = True) -> None:
        self.expected = max(1, (staleness + 1) * (workers - 1))
        self.enabled = enabled
        #: pushes scaled down, and the largest lag seen
        self.scaled = 0
        self.max_lag = 0

    def factor(self, lag: int) -> float:
        self.max_lag = max(self.max_lag, lag)
        if not self.enabled or lag <= self.expected:
            return 1.0
        self.scaled += 1
        return self.expected / lag


#: a state loaded this many steps or fewer before an update the guard
#: refuses or skips is named in its message as a suspect
SUSPECT_STEPS = 10


class DivergenceGuard:
    """Refuses non-finite changes; skips a change whose norm is more than
    ``multiple`` times the running median of the last ``window`` norms."""

    def __init__(self, rank: int, *, multiple: float = 10.0, window: int = 64, warmup: int = 8,
                 enabled: bool = True) -> None:
        if not isinstance(multiple, (int, float)) or not multiple > 1:
            raise InvalidArgumentError(f"the guard's multiple must be a number > 1, not {multiple!r}")
        self.rank = rank
        self.multiple = float(multiple)
        self.warmup = warmup
        self.enabled = enabled
        self.norms: collections.deque[float] = collections.deque(maxlen=window)
        self.skipped = 0
        self._logged = False
        # (step, what, side buffer) of the last state loaded (see loaded)
        self._loaded: tuple[int, str, str] | None = None

    def loaded(self, step: int, what: str, buffer: str) -> None:
        """A state was loaded to continue at ``step`` (``what``, in words,
        from side buffer ``buffer``): an update that goes wrong within
        SUSPECT_STEPS of it names it as a suspect."""
        self._loaded = (step, what, buffer)

    def _suspect(self, step: int) -> tuple[str, str]:
        """(" and a sentence naming the suspect", a hint's first clause), or ("", "")."""
        if self._loaded is None or not 0 <= step - self._loaded[0] <= SUSPECT_STEPS:
            return "", ""
        at, what, buffer = self._loaded
        return (f"; {what} was loaded {step - at} step(s) before, at step {at}: a suspect",
                f"if the loaded state is bad, remove it (`smb2 rm {buffer}`: the rank then starts with a fresh "
                "optimizer state) and restart; else ")

    def check(self, step: int, changes: Mapping[str, np.ndarray], *, steps: int = 1) -> bool:
        """Should ``changes`` (tensor name -> this step's change or
        gradient; an elastic round's change over ``steps`` inner steps) be
        pushed?  Raises :class:`TrainingDiverged` for a non-finite one; False
        (and counted) for one far out of line.  Norms are compared per inner
        step (over ``steps``), so rounds of different lengths compare fairly."""
        if not self.enabled:
            return True
        with np.errstate(over="ignore", invalid="ignore"):     # an overflow is what is checked for here
            norm = math.sqrt(sum(float(np.dot(a.reshape(-1), a.reshape(-1))) for a in changes.values())) / steps
        if not math.isfinite(norm):
            suspect, first = self._suspect(step)
            raise TrainingDiverged(
                f"rank {self.rank} produced a non-finite update at step {step} (in {_first_bad(changes)}): it was "
                f"not pushed, and the shared model is unchanged{suspect}",
                hint=f"{first}lower the learning rate, clip gradients (torch.nn.utils.clip_grad_norm_), or check "
                     "the inputs of this rank's batch; then restart the job: the store resumes from the shared model")
        ok = True
        if len(self.norms) >= self.warmup:
            median = float(np.median(self.norms))
            if median > 0 and norm > self.multiple * median:
                ok = False
                self.skipped += 1
                if not self._logged:
                    self._logged = True
                    log.warning("rank %d step %d: an update %.3g times the median of the last %d was not pushed "
                                "(the guard skips updates over %g times the median; counted in stats()['skipped'],"
                                " logged once)%s", self.rank, step, norm / median, len(self.norms), self.multiple,
                                self._suspect(step)[0])
        self.norms.append(norm)
        return ok

    def check_pulled(self, step: int, values: Mapping[str, np.ndarray]) -> None:
        """Refuse shared weights that are not finite (a collapse of the shared model)."""
        if self.enabled and not all(np.isfinite(a).all() for a in values.values()):
            raise TrainingDiverged(
                f"the shared model is not finite (in {_first_bad(values)}), seen by rank {self.rank} at step "
                f"{step}: it was not taken into the model",
                hint="some worker pushed a diverging update with the guard off; restart from a checkpoint "
                     "(init_from=) with a lower learning rate")


#: the collapse watch's look at the weights reads at most about this many of them
SAMPLE = 1 << 16


class CollapseWatch:
    """Reports a shared model that collapsed while staying finite: dead (the
    gradients of nearly all of it, or of most of its units, exactly zero) or
    blown up / dying (its
    weights' norm out of ``[base / growth, base * growth]``); see the
    module's doc."""

    def __init__(self, rank: int, store: str, *, growth: float = 8.0, dead_share: float = 0.9,
                 dead_units: float = 0.7, patience: int = 5, settle: int = 20, every: float = 0.2,
                 enabled: bool = True) -> None:
        self.rank = rank
        self.store = store
        self.growth = growth
        self.dead_share = dead_share
        self.dead_units = dead_units
        self.patience = patience
        self.settle = settle
        self.every = every
        self.enabled = enabled
        #: the reference norm of the weights (None until known), and the latest one
        self.base: float | None = None
        self.norm = 0.0
        #: collapses seen (a model that comes back and collapses again counts again)
        self.collapses = 0
        self._blown = self._dead = False
        self._dead_run = 0
        self._pulls = 0
        self._at = {"weights": -math.inf, "gradients": -math.inf}
        self._logged = False

    def due(self, what: str) -> bool:
        """Is a look at ``what`` ("weights", "gradients") due (at most every ``every`` s)?"""
        now = time.monotonic()
        if not self.enabled or now - self._at[what] < self.every:
            return False
        self._at[what] = now
        return True

    def see(self, step: int, weights: np.ndarray) -> None:
        """Look at the shared weights (flat) a pull brought, at ``step``."""
        self._pulls += 1
        if not self.due("weights"):
            return
        # a big model's norm from an evenly strided sample of it (the same one every time: its
        # ratio to the base is what counts), so a look costs about the same at any size
        w = weights.reshape(-1)[::max(1, weights.size // SAMPLE)]
        self.norm = norm = math.sqrt(float(np.dot(w, w)))
        if self.base is None:
            # the scale of a model that just started can move a lot (one that starts at zero has
            # none): it is taken once the model learned for a while
            if norm > 0 and self._pulls >= self.settle:
                self.base = norm
            return
        blown = not self.base / self.growth <= norm <= self.base * self.growth
        if blown and not self._blown:
            how = "grew to" if norm > self.base else "fell to"
            self._report(step, f"its weights' norm {how} {max(norm, 1e-30) / self.base:.3g} times its value at "
                               f"start ({self.base:.3g} -> {norm:.3g}; reported beyond {self.growth:g} times)")
        self._blown = blown

    def see_gradients(self, step: int, zero: int, total: int, dead_units: int = 0, units: int = 0) -> None:
        """``zero`` of the ``total`` elements of the gradients of a step sit
        in tensors whose gradient is exactly zero, and ``dead_units`` of the
        ``units`` of its Linear and Conv layers got exactly zero gradient: a
        model that no longer learns (dead units pass no gradient), when
        either holds for nearly all of it ``patience`` looks in a row."""
        all_dead = total > 0 and zero >= self.dead_share * total
        half_dead = units > 0 and dead_units >= self.dead_units * units
        dead = all_dead or half_dead
        # as many looks in a row to enter the state as to leave it: a flicker counts once
        self._dead_run = self._dead_run + 1 if dead != self._dead else 0
        if self._dead_run >= self.patience and dead != self._dead:
            self._dead, self._dead_run = dead, 0
            if all_dead:
                self._report(step, f"{zero / total:.0%} of its parameters got exactly zero gradients in "
                                   f"{self.patience} looks in a row (its units died: it predicts the same for "
                                   "every input)")
            elif dead:
                self._report(step, f"{dead_units} of the {units} units of its Linear and Conv layers "
                                   f"({dead_units / units:.0%}) got exactly zero gradients in {self.patience} looks "
                                   "in a row (they died: the few left cannot learn the task)")

    def _report(self, step: int, what: str) -> None:
        self.collapses += 1
        if not self._logged:
            self._logged = True
            log.warning("rank %d step %d: the shared model of store %r collapsed: %s. It is likely no longer "
                        "learning: stop the job and restart from a checkpoint (init_from=) with a lower learning "
                        "rate, gradient clipping, or average=True, lag_scaling=True (counted in "
                        "stats()['collapses'], reported by close(), logged once)", self.rank, step, self.store,
                        what)


def _first_bad(arrays: Mapping[str, np.ndarray]) -> str:
    for name, a in arrays.items():
        if not np.isfinite(a).all():
            return f"tensor {name!r}"
    return "the update"
