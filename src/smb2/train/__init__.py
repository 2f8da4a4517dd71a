"""Asynchronous distributed training on smb2: workers share their model
through one striped buffer instead of a parameter server.

    store = await ParameterStore.open(client, "mlp", model.init(), rule="accumulate",
                                      lr=0.1, workers=4, rank=rank)
    await store.pull()                       # fresh parameters into store.params
    loss, grads = model.grads(store.params, x, y)
    await store.push(grads)                  # the update rule moves them to the servers

Only the public client API is used here: no transport code.  The numpy MLP,
its data sets and the multi-process job launcher that ``make demo`` runs are
an example built on the store: :mod:`smb2.train.example`.  The PyTorch front
end sits above this package, in :mod:`smb2.torch`.
"""

from .dropping import LayerDropping
from .rules import EASGD, RULES, Accumulate, DiLoCo, Locked, UpdateRule, make_rule
from .store import POLICIES, ParameterStore

__all__ = ["EASGD", "POLICIES", "RULES", "Accumulate", "DiLoCo", "LayerDropping", "Locked", "ParameterStore",
           "UpdateRule", "make_rule"]
