"""Which transport reaches a server: ``open_transport`` is the one place
that chooses (tcp, rdma, shm, or auto: shm on the same host, else RDMA
where both ends can, else TCP)."""

from __future__ import annotations

import logging
from typing import Any

from ..errors import InvalidArgumentError, TransportError
from .base import Transport
from .shm import ShmTransport
from .tcp import TcpTransport

log = logging.getLogger("smb2.transport")

KINDS = ("auto", "tcp", "rdma", "shm")

# what was said, per server incarnation: a server restarted on a port that
# an earlier one used (tests, a supervisor's restart) is said again
_reported: set[tuple[str, Any, str, str]] = set()


def rdma_unavailable_reason(rdma_device: str | None = None,
                            rdma_gid_index: int | None = None) -> str | None:
    """Why RDMA cannot be used from this process, or None if it can."""
    from ..rdma_device import unavailable_reason
    return unavailable_reason(rdma_device, rdma_gid_index)


def why_tcp(local_reason: str | None, server_info: dict[str, Any]) -> str | None:
    """Why ``auto`` takes TCP to a server that answered hello with
    ``server_info`` (this process's own reason first), or None: RDMA.
    open_transport and ``smb2 doctor`` both ask here."""
    if local_reason is not None:
        return local_reason
    if "rdma" not in server_info.get("transports", ()):
        return f"the server has no RDMA: {server_info.get('rdma_off', 'not offered')}"
    return None


def _report(transport: Transport, kind: str, reason: str, level: int = logging.INFO) -> None:
    label = transport.label
    key = (label, transport.server_info.get("server_id"), kind, reason)
    if key not in _reported:
        _reported.add(key)
        log.log(level, "%s: using %s (%s)", label, kind, reason)


async def open_transport(address: tuple[str, int], kind: str = "auto", *,
                         timeout: float = 10.0, token: bytes | None = None,
                         rdma_device: str | None = None, rdma_gid_index: int | None = None,
                         poll: str = "event") -> Transport:
    """Connect to one server with the transport ``kind``.

    ``auto`` picks shm where the server is on this host and hands us its
    segments, else RDMA where both ends can (this process has a usable
    device, the server said ``rdma`` at hello), else TCP, and says why once
    at INFO -- at WARNING where both ends offered RDMA and its set-up
    failed or was refused (the server's RDMA cap): this worker then runs
    several times slower, which must not pass unnoticed; an explicit
    ``shm`` or ``rdma`` never falls back."""
    if kind not in KINDS:
        raise InvalidArgumentError(f"transport must be one of {', '.join(KINDS)}, not {kind!r}")
    opts: dict[str, Any] = {"rdma_device": rdma_device, "rdma_gid_index": rdma_gid_index,
                            "poll": poll}
    if kind == "rdma":
        from .rdma import RdmaTransport
        return await RdmaTransport.connect(address, timeout=timeout, token=token, **opts)
    if kind == "tcp":
        return await TcpTransport.connect(address, timeout=timeout, token=token)
    transport = await TcpTransport.connect(address, timeout=timeout, token=token)
    try:
        shm = await ShmTransport.upgrade(transport, timeout=timeout)
    except TransportError as exc:
        if kind == "shm":
            await transport.close()
            raise
        shm_reason = exc.message      # one line: the hint would break it
    except BaseException:
        await transport.close()
        raise
    else:
        if kind == "auto":
            _report(shm, "shm", f"same host: segments mapped from {shm.socket_path}")
        return shm
    reason = why_tcp(rdma_unavailable_reason(rdma_device, rdma_gid_index), transport.server_info)
    if reason is not None:
        _report(transport, "tcp", f"no shm: {shm_reason}; no RDMA: {reason}")
        return transport
    from .rdma import RdmaTransport
    try:
        rdma = await RdmaTransport.upgrade(transport, timeout=timeout, **opts)
    except TransportError as exc:
        # both ends said they could, and yet: TCP still works, several times slower
        _report(transport, "tcp", f"RDMA set-up failed, so this worker's traffic to this server goes over TCP, "
                f"several times slower: {exc.message}; no shm: {shm_reason}", logging.WARNING)
        return await TcpTransport.connect(address, timeout=timeout, token=token)
    _report(rdma, "rdma", "no shm: {}; device {device}, GID {gid_index} ({gid})".format(
        shm_reason, **rdma.device.describe()))
    return rdma

