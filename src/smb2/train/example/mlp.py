"""A small multi-layer perceptron in numpy (ReLU, softmax cross-entropy), so
the demo, the tests and the benchmark need no deep-learning framework.

Parameters are a dict ``{"w0", "b0", "w1", "b1", ...}`` of float32 arrays: the
same dict a :class:`~smb2.train.ParameterStore` holds as ``store.params``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ...errors import InvalidArgumentError


class MLP:
    def __init__(self, sizes: Sequence[int]) -> None:
        if len(sizes) < 2 or any(not isinstance(s, int) or s < 1 for s in sizes):
            raise InvalidArgumentError(f"sizes must be >= 2 positive ints (input, hidden..., classes), not {sizes!r}")
        self.sizes = list(sizes)
        self.layers = len(sizes) - 1

    def init(self, seed: int = 0) -> dict[str, np.ndarray]:
        """He-initialized weights, zero biases."""
        rng = np.random.default_rng(seed)
        params: dict[str, np.ndarray] = {}
        for i, (a, b) in enumerate(zip(self.sizes[:-1], self.sizes[1:])):
            params[f"w{i}"] = (rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32)
            params[f"b{i}"] = np.zeros(b, dtype=np.float32)
        return params

    @property
    def nparams(self) -> int:
        return sum(a * b + b for a, b in zip(self.sizes[:-1], self.sizes[1:]))

    def logits(self, params: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        h = x
        for i in range(self.layers):
            h = h @ params[f"w{i}"] + params[f"b{i}"]
            if i < self.layers - 1:
                np.maximum(h, 0, out=h)
        return h

    def grads(self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray
              ) -> tuple[float, dict[str, np.ndarray]]:
        """Mean cross-entropy loss of the batch and its gradients."""
        acts = [x]
        h = x
        for i in range(self.layers):
            h = h @ params[f"w{i}"] + params[f"b{i}"]
            if i < self.layers - 1:
                h = np.maximum(h, 0)
            acts.append(h)
        z = acts[-1] - acts[-1].max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        n = len(y)
        loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
        d = p
        d[np.arange(n), y] -= 1.0
        d /= n
        grads: dict[str, np.ndarray] = {}
        for i in reversed(range(self.layers)):
            grads[f"w{i}"] = acts[i].T @ d
            grads[f"b{i}"] = d.sum(axis=0)
            if i:
                d = (d @ params[f"w{i}"].T) * (acts[i] > 0)
        return loss, {k: grads[k] for k in sorted(grads, key=_order)}

    def accuracy(self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
        """Percent of ``x`` classified as ``y``."""
        return float((self.logits(params, x).argmax(axis=1) == y).mean() * 100.0)


def _order(key: str) -> tuple[int, str]:
    return int(key[1:]), key[0]


def sgd_epochs(model: MLP, params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, *,
               epochs: int, batch: int, lr: float, seed: int) -> dict[str, np.ndarray]:
    """Plain single-process minibatch SGD: the baseline the distributed rules
    are held against."""
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(len(x))
        for s in range(0, len(x), batch):
            idx = order[s:s + batch]
            _, g = model.grads(params, x[idx], y[idx])
            for k, v in g.items():
                params[k] -= (lr * v).astype(params[k].dtype, copy=False)
    return params
