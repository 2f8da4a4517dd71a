"""How many inner steps a worker's next DiLoCo round takes, from what it measures.

Rule ``diloco`` with ``local_steps="auto"`` (:class:`smb2.train.rules.AdaptiveDiLoCo`):
each worker times its own inner steps (``compute``: the training loop's time
per step, not counting what it waited for at a round's end) and its own exchanges (the push
of the pseudo-gradient, the outer momentum step where it makes one, the pull
of the new weights), smooths both over rounds, and at each round's end takes
for the next round

    H = ceil(exchange / (share * compute)),   clamped to [1, most]

so that an exchange costs at most ``share`` of a round's time.  Where the
exchange is free (shared memory, a tiny model) H is 1, a step's exchange per
step; a slow link takes more inner steps per exchange, in proportion; a slow
worker (more compute per step) takes fewer for the same link, so fast and
slow workers exchange at about the same wall-clock period, and their
pseudo-gradients land at about the same rate (each worker's expected lag,
W - 1 others' pushes, holds for all of them).

The constants:

* ``SHARE = 0.1``: an exchange is at most a tenth of a round.  Where it does
  not overlap the inner steps (the numpy API exchanges in line; a CPU-bound
  torch worker's exchange shares its cores) the worker loses at most
  ``share / (1 + share)``, about 9 %, of its compute; where it overlaps, it
  is hidden already at ``share = 1``, and the margin covers the other
  workers' exchanges on the same links and servers, which a worker's own
  time cannot see until they slow it.  A smaller share would buy at most
  those 9 % with proportionally longer rounds, each a larger, staler step.
* ``MOST = 64``: the rounds this project measured against DDP and torchft
  ran H = 8 and 32 (docs/training.md, "DiLoCo"); beyond 64 a round's
  pseudo-gradient is more than the delayed outer momentum was measured
  with, and a worker that stalls holds that much more work unshared.
* ``SMOOTHING = 0.3``: the weight of a round's measurement in the running
  means (about the last three rounds count), and H at most doubles from one
  round to the next: one slow exchange (a first exchange that opens the
  outer buffer, a garbage collection, a busy server) does not throw the
  next round far out, while a real change of link or load is followed
  within a few rounds; H falls at once when the exchange got cheaper.

The clock is a parameter (default :func:`time.perf_counter`): the tests
give a fake one and check the choices exactly, never wall-clock speed.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgumentError

log = logging.getLogger("smb2.train")

#: the largest share of a round an exchange may take
SHARE = 0.1
#: the most inner steps per round
MOST = 64
#: the weight of a round's measurement in the running means
SMOOTHING = 0.3
#: H grows at most this many times from one round to the next
GROWTH = 2


class LocalSteps:
    """The running measurements of one worker, and its rounds' lengths.

    :meth:`stepped` after each inner step, :meth:`exchanged` with each
    exchange's seconds, :meth:`round_ended` at each round's end, which
    chooses the next round's :attr:`h`."""

    def __init__(self, share: float = SHARE, most: int = MOST, *, smoothing: float = SMOOTHING,
                 clock: Callable[[], float] = time.perf_counter, label: str = "") -> None:
        if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 < share <= 1:
            raise InvalidArgumentError(f"exchange_share must be a number in (0, 1] (the largest share of a round "
                                       f"an exchange may take), not {share!r}")
        if not isinstance(most, int) or isinstance(most, bool) or most < 1:
            raise InvalidArgumentError(f"max_local_steps must be a positive int, not {most!r}")
        if not isinstance(smoothing, (int, float)) or not 0 < smoothing <= 1:
            raise InvalidArgumentError(f"smoothing must be a number in (0, 1], not {smoothing!r}")
        if not callable(clock):
            raise InvalidArgumentError(f"clock must be a function returning seconds, not {clock!r}")
        self.share = float(share)
        self.most = most
        self.smoothing = float(smoothing)
        self.clock = clock
        #: names the worker in log lines ("rank 3: ")
        self.label = label
        #: inner steps of the round under way
        self.h = 1
        #: running means: seconds of compute per inner step, seconds per exchange (None: not measured yet)
        self.step_s: float | None = None
        self.exchange_s: float | None = None
        self._mark: float | None = None
        self._round_s = 0.0
        self._timed = 0
        #: rounds ended, their inner steps in all, the shortest and longest
        self.rounds = 0
        self.steps = 0
        self.shortest = 0
        self.longest = 0
        self._logged = 1

    def _smooth(self, mean: float | None, value: float) -> float:
        return value if mean is None else mean + self.smoothing * (value - mean)

    def stepped(self) -> None:
        """An inner step's compute ended: it took the time since the last
        one's ended, or since :meth:`restart`."""
        now = self.clock()
        if self._mark is not None:
            self._round_s += max(0.0, now - self._mark)
            self._timed += 1
        self._mark = now

    def restart(self) -> None:
        """The time from now to the next :meth:`stepped` is the next step's
        (what went before, e.g. an exchange made in line, is not compute)."""
        self._mark = self.clock()

    def exchanged(self, seconds: float) -> None:
        """An exchange took ``seconds``."""
        self.exchange_s = self._smooth(self.exchange_s, max(0.0, seconds))

    def round_ended(self, steps: int) -> int:
        """A round of ``steps`` inner steps ended: its compute joins the
        running mean, and the next round's H is chosen (and returned).  The
        next step's compute starts now (what the worker waited for at the
        round's end is not compute)."""
        if self._timed:
            self.step_s = self._smooth(self.step_s, self._round_s / self._timed)
        self._round_s, self._timed = 0.0, 0
        self.rounds += 1
        self.steps += steps
        self.shortest = steps if self.rounds == 1 else min(self.shortest, steps)
        self.longest = max(self.longest, steps)
        self.h = min(self.wanted(), GROWTH * self.h)
        if self.h >= 2 * self._logged or 2 * self.h <= self._logged:
            log.info("%s%d inner steps per round (was %d): an inner step takes %.3g s, an exchange %.3g s "
                     "(at most %.0f %% of a round, at most %d steps)", self.label, self.h, self._logged,
                     self.step_s or 0.0, self.exchange_s or 0.0, 100 * self.share, self.most)
            self._logged = self.h
        self.restart()
        return self.h

    def wanted(self) -> int:
        """H from the running means alone: the fewest inner steps whose
        compute makes an exchange at most ``share`` of the round."""
        if self.exchange_s is None or self.step_s is None or self.exchange_s <= 0:
            return 1            # nothing measured yet, or a free exchange: one step per exchange
        if self.step_s <= 0:
            return self.most
        # (less a hair: a quotient that is an integer but for rounding is not rounded up past it)
        h = math.ceil(self.exchange_s / (self.share * self.step_s) * (1 - 1e-9))
        return max(1, min(self.most, h))

    def summary(self) -> dict[str, Any]:
        """The current H and the rounds so far, for ``stats()``."""
        return {"now": self.h, "rounds": self.rounds, "min": self.shortest, "max": self.longest,
                "mean": self.steps / self.rounds if self.rounds else 0.0,
                "step_s": self.step_s, "exchange_s": self.exchange_s}


__all__ = ["GROWTH", "MOST", "SHARE", "SMOOTHING", "LocalSteps"]
