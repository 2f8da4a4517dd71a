"""The server's side of the RDMA transport.

The memory server calls in here through a few hooks (memory.py): every
segment is registered once, at creation, as a memory region with local
write, remote read, remote write and remote atomic access (``register`` /
``deregister``; a replicated buffer's segment with remote read only: its
copies change only through its primary); a connection that says ``rdma_connect`` over the TCP control
connection gets its own RC queue pair and a registered *staging area*
(:class:`Peer`).  After that the client reads, writes and does atomics with
one-sided RDMA: the server's CPU never sees those operations (they do not
appear in its statistics).  Only ``accumulate`` is server-assisted, as in
SMB1: the client RDMA-writes the delta into a slot of its staging area and
then sends an ACCUMULATE frame with ``FLAG_STAGED`` naming that slot.

Staging areas are pinned memory, so they come from a bounded pool
(``--rdma-staging-memory``), not one per peer without end: a peer that
connects while every area is lent gets its queue pair without one
(``staging_slots`` 0 in the reply) and sends its accumulates in-band over
its TCP connection, as a TCP client does; its area is its own registration
(its own rkey), so no peer can write into another's.

Control commands (docs/protocol.md): ``rdma_connect`` and ``rdma_segment``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..errors import ErrorCode
from ..rdma_device import Device, _verbs, alloc_pinned, get_device, unavailable_reason
from .segment import Refused, Segment

log = logging.getLogger("smb2.transport.rdma")

#: staging area per RDMA connection: STAGING_SLOTS slots of STAGING_SLOT bytes
STAGING_SLOT = 1 << 20
STAGING_SLOTS = 4
STAGING_BYTES = STAGING_SLOT * STAGING_SLOTS


class Peer:
    """One client's queue pair and staging area on this server."""

    def __init__(self, server: RdmaServer, msg: dict[str, Any], staged: bool = True) -> None:
        assert _verbs is not None
        dev = server.device
        try:
            qpn, psn, gid = int(msg["qpn"]), int(msg["psn"]), msg["gid"]
            lid, mtu = int(msg.get("lid", 0)), int(msg.get("mtu", dev.mtu))
        except (KeyError, TypeError, ValueError):
            raise Refused(ErrorCode.BAD_REQUEST,
                          "rdma_connect needs qpn, psn, gid (16 bytes), lid, mtu") from None
        if not isinstance(gid, bytes) or len(gid) != 16:
            raise Refused(ErrorCode.BAD_REQUEST, "rdma_connect: gid must be 16 bytes")
        self.mtu = max(1, min(mtu, dev.mtu))
        self.psn = int.from_bytes(os.urandom(3), "little")
        # no staging area (the pool is lent out): accumulates come in-band
        self.staging_mem = alloc_pinned(STAGING_BYTES) if staged else None
        self.staging_view = memoryview(self.staging_mem if self.staging_mem is not None else b"")
        self.qp: Any = None
        self.staging: Any = None
        try:
            if self.staging_mem is not None:
                self.staging = _verbs.MR(dev.pd, self.staging_mem,
                                         _verbs.ACCESS_LOCAL_WRITE | _verbs.ACCESS_REMOTE_WRITE)
            # The server never posts: a tiny send queue on the shared CQ.
            self.qp = _verbs.QP(dev.pd, server.cq, max_send_wr=1, max_sge=1)
            self.qp.to_init(dev.port, _verbs.ACCESS_REMOTE_ALL)
            self.qp.to_rtr(qpn, psn, gid, dev.gid_index if dev.ethernet else -1, lid, self.mtu,
                           dev.max_rd_atomic)
            self.qp.to_rts(self.psn)
        except OSError as exc:
            self.close()
            raise Refused(ErrorCode.INTERNAL, f"cannot set up the RDMA queue pair: {exc}") from None

    def reply(self, server: RdmaServer) -> dict[str, Any]:
        dev = server.device
        staging = self.staging
        return {"qpn": self.qp.qpn, "psn": self.psn, "gid": dev.gid, "lid": dev.lid,
                "mtu": self.mtu, "max_rd_atomic": dev.max_rd_atomic,
                "staging_addr": staging.addr if staging is not None else 0,
                "staging_rkey": staging.rkey if staging is not None else 0,
                "staging_slot": STAGING_SLOT, "staging_slots": STAGING_SLOTS if staging is not None else 0}

    @property
    def has_staging(self) -> bool:
        return self.staging_mem is not None

    def staged(self, offset: int, length: int) -> memoryview:
        """The staging bytes a FLAG_STAGED accumulate names (validated)."""
        if self.staging_mem is None:
            raise Refused(ErrorCode.BAD_REQUEST, "this RDMA connection has no staging area (the server lent "
                          "them all out): send accumulates in-band")
        if offset > len(self.staging_view) or length > len(self.staging_view) - offset:
            raise Refused(ErrorCode.OUT_OF_BOUNDS,
                          f"staged range [{offset}, {offset + length}) is outside the "
                          f"staging area of {len(self.staging_view)} bytes")
        return self.staging_view[offset:offset + length]

    def close(self) -> None:
        # the QP first: after it is gone the client cannot write into staging
        if self.qp is not None:
            self.qp.close()
            self.qp = None
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        self.staging_view.release()
        if self.staging_mem is not None:
            self.staging_mem.close()


class RdmaServer:
    """A memory server's device, its segments' MRs and its peers."""

    def __init__(self, device: Device, staging_areas: int = 1 << 30) -> None:
        assert _verbs is not None
        self.device = device
        #: staging areas that may be lent at once (--rdma-staging-memory)
        self.staging_areas = staging_areas
        # QPs need a CQ; one-sided operations complete nothing on the
        # responder, so it is never polled.
        self.cq = _verbs.CQ(device.context, 16)
        self.mrs: dict[int, Any] = {}
        self.peers: set[Peer] = set()
        #: access every new segment gets (tests lower it to see the error)
        self.segment_access: int = _verbs.ACCESS_REMOTE_ALL
        # the lock segment: clients READ and use atomics on it, never WRITE
        # (a one-sided WRITE could not be refused by this CPU: the NIC must)
        self.lock_access: int = (_verbs.ACCESS_LOCAL_WRITE | _verbs.ACCESS_REMOTE_READ
                                 | _verbs.ACCESS_REMOTE_ATOMIC)
        # a replicated buffer's segment: clients READ it, and change it only
        # through its primary, which forwards to the other copies (a
        # one-sided WRITE or atomic would change one copy, unseen by this CPU)
        self.replica_access: int = _verbs.ACCESS_LOCAL_WRITE | _verbs.ACCESS_REMOTE_READ

    @classmethod
    def open(cls, device: str | None, gid_index: int | None,
             staging_areas: int = 1 << 30) -> tuple[RdmaServer | None, str | None]:
        """The server's RDMA side, or (None, why not)."""
        reason = unavailable_reason(device, gid_index)
        if reason is not None:
            return None, reason
        try:
            return cls(get_device(device, gid_index), staging_areas), None
        except OSError as exc:
            return None, str(exc)

    def describe(self) -> dict[str, Any]:
        return self.device.describe()

    def access_of(self, seg: Segment) -> int:
        """The remote access a buffer's segment is registered with."""
        return self.replica_access if seg.replicas > 1 else self.segment_access

    def register(self, seg_id: int, view: memoryview, access: int | None = None) -> None:
        assert _verbs is not None
        try:
            self.mrs[seg_id] = _verbs.MR(self.device.pd, view,
                                         self.segment_access if access is None else access)
        except OSError as exc:
            raise Refused(ErrorCode.OUT_OF_MEMORY,
                          f"cannot register {len(view)} bytes for RDMA: {exc} (registered "
                          "memory is pinned: see the memlock limit, ulimit -l)") from None

    def deregister(self, seg_id: int) -> None:
        mr = self.mrs.pop(seg_id, None)
        if mr is not None:
            mr.close()

    def segment_info(self, seg_id: int) -> dict[str, Any]:
        mr = self.mrs.get(seg_id)
        if mr is None:
            return {}
        return {"rdma_addr": mr.addr, "rdma_rkey": mr.rkey}

    @property
    def staging_lent(self) -> int:
        """Staging areas lent to peers now."""
        return sum(1 for p in self.peers if p.has_staging)

    def connect(self, msg: dict[str, Any], replacing: Peer | None = None) -> tuple[Peer, dict[str, Any]]:
        """A queue pair for a client, with a staging area while the pool
        has one (``replacing``: the connection's earlier peer, whose area
        it takes over)."""
        lent = self.staging_lent - (1 if replacing is not None and replacing.has_staging else 0)
        peer = Peer(self, msg, staged=lent < self.staging_areas)
        self.peers.add(peer)
        return peer, peer.reply(self)

    def drop(self, peer: Peer) -> None:
        self.peers.discard(peer)
        peer.close()

    def close(self) -> None:
        for peer in list(self.peers):
            self.drop(peer)
        for seg_id in list(self.mrs):
            self.deregister(seg_id)
        self.cq.close()
