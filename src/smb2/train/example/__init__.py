"""An example built on the parameter store: a numpy MLP (``mlp``), the data
sets the examples and benchmarks train on (``data``), and the launcher that
runs one process per worker (``job``, what ``make demo`` runs).

    from smb2.train.example import MLP, data
"""

from . import data
from .mlp import MLP

__all__ = ["MLP", "data"]
