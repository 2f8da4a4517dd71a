"""Data sets for the demo, the tests and the benchmark.

``digits``: scikit-learn's bundled 8x8 handwritten digits (1797 images, no
download), split into train and test with a fixed seed.  scikit-learn is an
optional dependency (``pip install smb2[demo]``), imported only here.
``synthetic``: a linearly separable-ish random problem of any size.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...errors import InterfaceError

Split = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def digits(test_fraction: float = 0.3, seed: int = 0) -> Split:
    """(x_train, y_train, x_test, y_test): float32 pixels standardized with
    the training set's mean and deviation (SGD then converges in a few
    epochs, to nearly the same accuracy whatever the seed)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise InterfaceError("the digits data set needs scikit-learn",
                             hint="pip install 'smb2[demo]'  (or: pip install scikit-learn)") from None
    d = load_digits()
    x = d.data.astype(np.float64)
    y = d.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    te, tr = order[:n_test], order[n_test:]
    mean, dev = x[tr].mean(axis=0), x[tr].std(axis=0) + 0.1   # + 0.1: some pixels are always 0
    x = ((x - mean) / dev).astype(np.float32)
    return x[tr], y[tr], x[te], y[te]


def synthetic(n: int, dim: int, classes: int, seed: int = 0, test: int = 0) -> Split:
    """Gaussian blobs around random class centers."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((classes, dim)).astype(np.float32)
    y = rng.integers(0, classes, n + test)
    x = centers[y] + rng.standard_normal((n + test, dim)).astype(np.float32) * 2.0
    return x[:n], y[:n], x[n:], y[n:]


def save(path: str | Path, split: Split) -> None:
    np.savez(path, x_train=split[0], y_train=split[1], x_test=split[2], y_test=split[3])


def load(path: str | Path) -> Split:
    with np.load(path) as z:
        return z["x_train"], z["y_train"], z["x_test"], z["y_test"]
