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
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Mapping

import numpy as np

from ..errors import InvalidArgumentError, Smb2Error

log = logging.getLogger("smb2.train")

__all__ = ["DivergenceGuard", "LagScaling", "TrainingDiverged"]


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

    def check(self, step: int, changes: Mapping[str, np.ndarray]) -> bool:
        """Should ``changes`` (tensor name -> this step's change or
        gradient) be pushed?  Raises :class:`TrainingDiverged` for a
        non-finite one; False (and counted) for one far out of line."""
        if not self.enabled:
            return True
        norm = math.sqrt(sum(float(np.dot(a.reshape(-1), a.reshape(-1))) for a in changes.values()))
        if not math.isfinite(norm):
            raise TrainingDiverged(
                f"rank {self.rank} produced a non-finite update at step {step} (in {_first_bad(changes)}): it was "
                "not pushed, and the shared model is unchanged",
                hint="lower the learning rate, clip gradients (torch.nn.utils.clip_grad_norm_), or check the "
                     "inputs of this rank's batch; then restart the job: the store resumes from the shared model")
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
                                " logged once)", self.rank, step, norm / median, len(self.norms), self.multiple)
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


def _first_bad(arrays: Mapping[str, np.ndarray]) -> str:
    for name, a in arrays.items():
        if not np.isfinite(a).all():
            return f"tensor {name!r}"
    return "the update"
