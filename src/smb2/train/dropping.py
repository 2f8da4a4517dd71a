"""Layer dropping (Applied Sciences 10(24) 8846): send only the layers whose
gradients matter this step, keep the rest in a local residual cache.

Each step, every layer's candidate update is its gradient plus its residual
(what it did not send before).  Its score is the L1 norm of that candidate
per element (the mean absolute value: a plain L1 norm would always favour the
big weight matrices and never save their bytes).  The threshold is the
``ratio``-quantile of this step's scores, so about ``ratio`` of the layers
stay home; a dropped layer's candidate becomes its residual and keeps growing
until its score passes the threshold, so no gradient is ever lost, only
delayed.  ``max_skips`` bounds that delay.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from ..errors import InvalidArgumentError

log = logging.getLogger("smb2.train")


class LayerDropping:
    """``LayerDropping(ratio=0.7)``: drop about 70 % of the layers per push."""

    def __init__(self, ratio: float = 0.7, *, max_skips: int | None = 16) -> None:
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0.0 <= ratio < 1.0:
            raise InvalidArgumentError(f"ratio must be a number in [0, 1), not {ratio!r}")
        if max_skips is not None and (not isinstance(max_skips, int) or max_skips < 1):
            raise InvalidArgumentError(f"max_skips must be a positive int or None, not {max_skips!r}")
        self.ratio = float(ratio)
        self.max_skips = max_skips
        self.residual: dict[str, np.ndarray] = {}
        self.skips: dict[str, int] = {}
        self.threshold = 0.0
        self.bytes_sent = 0
        self.bytes_saved = 0
        self.layers_sent = 0
        self.layers_dropped = 0

    def select(self, grads: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The gradients to send this step (residuals folded in); the rest
        goes to the residual cache.  Arrays returned may be the cache's own
        buffers: use them before the next call."""
        cand: dict[str, np.ndarray] = {}
        scores: dict[str, float] = {}
        for name, g in grads.items():
            r = self.residual.get(name)
            if r is None:
                r = self.residual[name] = np.zeros(g.shape, dtype=g.dtype)
            r += g                      # the candidate, accumulated in the cache in place
            cand[name] = r
            scores[name] = float(np.abs(r).mean()) if r.size else 0.0
        if not cand:
            return {}
        self.threshold = float(np.quantile(np.fromiter(scores.values(), float), self.ratio))
        out: dict[str, np.ndarray] = {}
        for name, r in cand.items():
            skips = self.skips.get(name, 0)
            if scores[name] >= self.threshold or (self.max_skips is not None and skips >= self.max_skips):
                out[name] = r.copy()
                r.fill(0)
                self.skips[name] = 0
                self.bytes_sent += r.nbytes
                self.layers_sent += 1
            else:
                self.skips[name] = skips + 1
                self.bytes_saved += r.nbytes
                self.layers_dropped += 1
        return out

    @property
    def saved_fraction(self) -> float:
        total = self.bytes_sent + self.bytes_saved
        return self.bytes_saved / total if total else 0.0

    def stats(self) -> dict[str, float]:
        return {"ratio": self.ratio, "bytes_sent": self.bytes_sent, "bytes_saved": self.bytes_saved,
                "saved_fraction": self.saved_fraction, "layers_sent": self.layers_sent,
                "layers_dropped": self.layers_dropped, "threshold": self.threshold}
