"""The lab: what smb2's tests, benchmarks and tools share, importable by name
(as torch has ``torch.testing``): clusters on this machine, the one
``smb2-server`` launcher, raw-wire and hostile clients, fault injection, the
fuzz harness and float oracles, the network-namespace cluster (``netns``) and
the Jepsen harness (``jepsen``).

The lab may use the whole library; nothing in the library imports it at
import time (``smb2.LocalCluster`` and the ``smb2 demo``/``smb2 bench``
commands reach it on first use).  Its modules:

* ``cluster``: :class:`LocalCluster`, :class:`ExternalCluster` (the pytest plugin's);
* ``etcd``: :class:`LocalEtcd`, a private single-node etcd;
* ``launch``: :class:`ServerProcess` / :class:`AsyncServerProcess`, the ready line;
* ``wire``: frames by hand; ``proxy``: :class:`~smb2.testing.proxy.FaultProxy`;
* ``hostile``: clients that attack a server (the hardening tests, ``bench_attacks``);
* ``replicas``: a replicated cluster's raw peers and increments;
* ``workers``: lock-holding worker processes; torchrun launch and its JSON lines;
* ``fuzzing``, ``floats``: the fuzz harness and the narrow-float oracles;
* ``netns``: ``python -m smb2.testing.netns``; ``jepsen``: ``python -m smb2.testing.jepsen``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cluster import ExternalCluster, LocalCluster, external_servers
    from .etcd import LocalEtcd
    from .launch import AsyncServerProcess, ServerProcess, server_process

#: loaded on first use (name: module): ``python -m smb2.testing.netns``'s
#: stand-in server, run in every namespace, need not import the server side
_LAZY = {"LocalCluster": "cluster", "ExternalCluster": "cluster", "external_servers": "cluster",
         "LocalEtcd": "etcd", "ServerProcess": "launch", "AsyncServerProcess": "launch",
         "server_process": "launch"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AsyncServerProcess", "ExternalCluster", "LocalCluster", "LocalEtcd", "ServerProcess",
           "external_servers", "server_process"]
