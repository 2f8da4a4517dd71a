"""Transports: how a client reaches one server (tcp today; rdma plugs in here).

``open_transport`` is the one place that chooses a transport for a server.
"""

from __future__ import annotations

import logging

from ..errors import InvalidArgumentError, TransportError
from .base import Transport
from .tcp import TcpTransport

log = logging.getLogger("smb2.transport")

KINDS = ("auto", "tcp", "rdma")

_reported: set[tuple[str, str]] = set()


def rdma_unavailable_reason() -> str | None:
    """Why RDMA cannot be used from this process, or None if it can."""
    return "this build of smb2 has no RDMA transport yet (tcp only)"


async def open_transport(address: tuple[str, int], kind: str = "auto", *,
                         timeout: float = 10.0, token: bytes | None = None) -> Transport:
    """Connect to one server with the transport ``kind``.

    ``auto`` picks RDMA where both ends can, else TCP, and says why once at
    INFO; an explicit ``rdma`` never falls back."""
    if kind not in KINDS:
        raise InvalidArgumentError(f"transport must be one of {', '.join(KINDS)}, not {kind!r}")
    label = f"{address[0]}:{address[1]}"
    if kind == "rdma":
        reason = rdma_unavailable_reason()
        raise TransportError(f"transport='rdma' for {label} is not possible: {reason}",
                             server=label)
    transport = await TcpTransport.connect(address, timeout=timeout, token=token)
    if kind == "auto":
        reason = rdma_unavailable_reason()
        key = (label, reason or "")
        if key not in _reported:
            _reported.add(key)
            log.info("%s: using tcp (%s)", label, reason)
    return transport


__all__ = ["KINDS", "TcpTransport", "Transport", "open_transport", "rdma_unavailable_reason"]
