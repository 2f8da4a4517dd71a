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

``compress="topk:0.01"`` keeps 1 %; bytes per exchange: docs/training.md,
"Compressed exchange".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..client import as_wire
from ..errors import InvalidArgumentError


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

    @classmethod
    def parse(cls, spec: str | None) -> TopK | None:
        """``"topk:F"`` (0 < F <= 1, the fraction of entries sent) or None."""
        if spec is None:
            return None
        kind, _, arg = spec.partition(":") if isinstance(spec, str) else ("", "", "")
        try:
            fraction = float(arg)
        except ValueError:
            fraction = math.nan
        if kind != "topk" or not 0 < fraction <= 1:
            raise InvalidArgumentError(f"compress must be 'topk:F' with F in (0, 1] (the fraction of a "
                                       f"pseudo-gradient's entries each round sends, e.g. 'topk:0.01'), "
                                       f"or None, not {spec!r}")
        return cls(fraction)

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
        change += self.residual
        n = change.size
        k = min(n, max(1, math.ceil(self.fraction * n)))
        # a NaN sorts past every number: it is sent, and the store's guard refuses the round
        top = np.argpartition(np.abs(change), n - k)[n - k:] if k < n else np.arange(n)
        idx = np.union1d(top, self._always)
        values = as_wire(change[idx], wire)     # what the servers will add
        self._carried = change
        return idx, values

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
