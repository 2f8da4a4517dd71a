"""Compressed pseudo-gradients for rule ``diloco``: the top-k by magnitude,
with error feedback.

Each round a worker sends only the fraction ``k`` of its pseudo-gradient's
entries that are largest in magnitude (with a model's running statistics,
which are always sent whole), as the values the servers will add (bfloat16
or float32, the rule's ``wire``), by sparse accumulate.  What it did not
send stays in its **residual** and is added to the next round's
pseudo-gradient before that one is cut (error feedback; Stich et al. 2018,
as SparseLoCo does): nothing a worker computed is dropped, only delayed, so
over any number of sent rounds its sum of sent updates plus its residual is
its sum of pseudo-gradients.

Two forms (:func:`parse_spec`):

* ``compress="topk:0.01"`` (:class:`TopK`) keeps 1 %, with the rule's outer
  Nesterov step on what was sent;
* ``compress="sparseloco:0.02"`` (:class:`SparseLoCo`; Sarfi et al. 2025)
  keeps 2 %, and the residual decays by 0.95 each round before the round is
  added to it; the rule then makes no outer momentum step and its outer lr
  is 1 (the servers add the mean of the sent updates).

Bytes per exchange: docs/training.md, "Compressed exchange".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..client import as_wire
from ..errors import InvalidArgumentError

#: what a bad ``compress`` is told
SPECS = ("compress must be 'topk:F' or 'sparseloco:F' (F in (0, 1]: the fraction of a pseudo-gradient's entries "
         "each round sends, e.g. 'topk:0.01'; 'sparseloco:F,decay=B': the residual's decay B in (0, 1], "
         "0.95 unless given), or None")


def _number(text: str, low_open: float, high: float) -> float:
    """``text`` as a number in (low_open, high], else NaN."""
    try:
        v = float(text)
    except ValueError:
        return math.nan
    return v if low_open < v <= high else math.nan


def parse_spec(spec: str | None) -> TopK | None:
    """The compression ``spec`` names: ``"topk:F"``, ``"sparseloco:F"``,
    ``"sparseloco:F,decay=B"``, or None (a dense exchange)."""
    if spec is None:
        return None
    kind, _, arg = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    fraction_text, comma, more = arg.partition(",")
    fraction = _number(fraction_text, 0.0, 1.0)
    if kind == "topk" and not comma and not math.isnan(fraction):
        return TopK(fraction)
    if kind == "sparseloco" and not math.isnan(fraction):
        key, _, value = more.partition("=")
        if not comma:
            return SparseLoCo(fraction)
        decay = _number(value, 0.0, 1.0)
        if key == "decay" and not math.isnan(decay):
            return SparseLoCo(fraction, decay)
    raise InvalidArgumentError(f"{SPECS}, not {spec!r}")


class TopK:
    """One worker's top-k cut and residual.

    :meth:`cut` takes a round's pseudo-gradient and gives the entries to
    send; :meth:`sent` then makes what was left out the residual (a round
    the store's guard skipped is dropped whole, residual unchanged, as a
    dense round is dropped)."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.residual = np.zeros(0, np.float32)
        self._always = np.zeros(0, np.int64)
        self._carried: np.ndarray | None = None

    def spec(self) -> str:
        return f"topk:{self.fraction:g}"

    def bind(self, size: int, always: Sequence[slice]) -> None:
        """A model of ``size`` float32 entries, of which those in ``always``
        (running statistics) are sent whole every round."""
        self.residual = np.zeros(size, np.float32)
        self._always = (np.concatenate([np.arange(s.start, s.stop) for s in always]) if always
                        else np.zeros(0, np.int64))

    def cut(self, change: np.ndarray, wire: str | None) -> tuple[np.ndarray, np.ndarray]:
        """``(indices, values)`` to send of the round's pseudo-gradient
        ``change`` plus the residual (``change`` becomes that sum): the
        sorted indices of the largest entries, and their values as the
        servers will add them (rounded to ``wire``'s type)."""
        self._carry_in(change)
        n = change.size
        k = min(n, max(1, math.ceil(self.fraction * n)))
        # a NaN sorts past every number: it is sent, and the store's guard refuses the round
        top = np.argpartition(np.abs(change), n - k)[n - k:] if k < n else np.arange(n)
        idx = np.union1d(top, self._always)
        values = as_wire(change[idx], wire)     # what the servers will add
        self._carried = change
        return idx, values

    def _carry_in(self, change: np.ndarray) -> None:
        change += self.residual

    def sent(self, idx: np.ndarray, values: np.ndarray) -> None:
        """The cut went out: the residual is what it left (the exact rounding
        error where a value was rounded, the whole entry elsewhere)."""
        assert self._carried is not None
        self.residual[...] = self._carried
        self.residual[idx] -= values
        self._carried = None

    def wire_bytes(self, items: int, wire: str | None) -> int:
        """Bytes one sparse accumulate of ``items`` entries puts on the wire
        (u32 indices and the values; each request's 8-byte count aside)."""
        return items * (4 + (2 if wire is not None else 4))


class SparseLoCo(TopK):
    """The top-k cut of SparseLoCo (Sarfi et al. 2025): the residual decays.

    Each round the accumulator is ``A = decay * A + D`` (``decay`` 0.95 by
    default, as the paper's), the top-k of ``A`` goes out and ``A`` keeps
    the rest.  The decay makes the residual a momentum of the worker's own
    pseudo-gradients: what the outer Nesterov momentum does with a dense
    exchange, but without a dense step per group of W rounds, which is most
    of a compressed exchange's bytes.  So the rule makes no outer momentum
    step with it, and its outer lr is :attr:`OUTER_LR` unless given: the
    servers add the mean of the workers' sent updates, as the paper's do.
    With ``decay=1`` it is :class:`TopK`'s error feedback.

    The decayed residual is ``decay * A`` rounded to float32, then the round
    is added to it; a round the guard skips leaves ``A`` as it was (not
    decayed)."""

    #: the paper's decay of the error-feedback accumulator
    DECAY = 0.95
    #: the paper's outer lr: the servers add the mean of the sent updates whole
    OUTER_LR = 1.0

    def __init__(self, fraction: float, decay: float = DECAY) -> None:
        super().__init__(fraction)
        self.decay = decay

    def spec(self) -> str:
        more = "" if self.decay == self.DECAY else f",decay={self.decay!r}"
        return f"sparseloco:{self.fraction:g}{more}"

    def _carry_in(self, change: np.ndarray) -> None:
        # a new array, not the residual decayed in place: a round the guard
        # skips must leave the residual as it was
        change += self.residual * np.float32(self.decay)
