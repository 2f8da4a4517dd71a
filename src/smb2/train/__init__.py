"""Asynchronous distributed training on smb2: workers share their model
through one striped buffer instead of a parameter server.

    store = await ParameterStore.open(client, "mlp", model.init(), rule="accumulate",
                                      lr=0.1, workers=4, rank=rank)
    await store.pull()                       # fresh parameters into store.params
    loss, grads = model.grads(store.params, x, y)
    await store.push(grads)                  # the update rule moves them to the servers

Only the public client API is used here: no transport code.
"""

from .dropping import LayerDropping
from .mlp import MLP
from .rules import EASGD, RULES, Accumulate, Locked, UpdateRule, make_rule
from .store import POLICIES, ParameterStore

__all__ = ["EASGD", "MLP", "POLICIES", "RULES", "Accumulate", "LayerDropping", "Locked", "ParameterStore",
           "UpdateRule", "make_rule"]
