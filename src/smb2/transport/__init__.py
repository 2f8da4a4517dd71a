"""Transports: how a client reaches one server (tcp, rdma, shm).

* :mod:`.base` -- the interface every transport offers (and the optional
  lock capability);
* :mod:`.tcp`, :mod:`.rdma`, :mod:`.shm` -- the transports;
* :mod:`.choose` -- ``open_transport``, the one place that picks one;
* :mod:`.link` -- a client's link to one server (reconnects, its lock slots).

This package imports only the modules both sides share (``errors``,
``protocol``, ``auth``, ``_core``, ``rdma_device``): never the client or the
server (docs/design.md, "Layers").
"""

from __future__ import annotations

from .base import FutexCapable, LockCapable, MapsSegments, MemoryDomain, Transport
from .choose import KINDS, open_transport, rdma_unavailable_reason
from .link import Link, LockSlot
from .shm import ShmTransport
from .tcp import TcpTransport

__all__ = ["KINDS", "FutexCapable", "Link", "LockCapable", "LockSlot", "MapsSegments", "MemoryDomain", "ShmTransport",
           "TcpTransport", "Transport", "open_transport", "rdma_unavailable_reason"]
