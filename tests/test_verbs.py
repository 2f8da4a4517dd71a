"""smb2._verbs on a real device (the soft-RoCE VM tier): two RC queue pairs
connected to each other in one process, WRITE/READ/FAA/CAS, the completion
channel fd in the event loop, and a remote access error.  Skips where there
is no usable RDMA device (rdma-core's tests/base.py habit)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import numpy as np
import pytest

from smb2.rdma_device import _verbs, alloc_pinned, get_device, unavailable_reason

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no RDMA here: {REASON}")


class _Pair:
    """Queue pair ``a`` (ours) connected to ``b`` (the 'server'), one CQ each."""

    def __init__(self) -> None:
        assert _verbs is not None
        dev = self.dev = get_device()
        self.cq = _verbs.CQ(dev.context, 64)
        self.cq_b = _verbs.CQ(dev.context, 8)
        self.a = _verbs.QP(dev.pd, self.cq, 32, dev.max_sge)
        self.b = _verbs.QP(dev.pd, self.cq_b, 1, 1)
        gidx = dev.gid_index if dev.ethernet else -1
        psn_a, psn_b = 100, 200
        self.a.to_init(dev.port, 0)
        self.b.to_init(dev.port, _verbs.ACCESS_REMOTE_ALL)
        self.a.to_rtr(self.b.qpn, psn_b, dev.gid, gidx, dev.lid, dev.mtu, dev.max_rd_atomic)
        self.b.to_rtr(self.a.qpn, psn_a, dev.gid, gidx, dev.lid, dev.mtu, dev.max_rd_atomic)
        self.a.to_rts(psn_a)
        self.b.to_rts(psn_b)
        self.comps = _verbs.Completions(16, 32)
        self.comps.on_error = lambda slot, status, vendor: OSError(status, _verbs.wc_status_str(status))
        self.words = alloc_pinned(4096)
        self.words_mr = _verbs.MR(dev.pd, self.words)
        self.comps.set_atomic_area(self.words_mr)

    def close(self) -> None:
        for r in (self.a, self.b, self.cq, self.cq_b, self.words_mr):
            r.close()
            r.close()                      # idempotent


async def _complete(pair: _Pair, fut: asyncio.Future[Any]) -> Any:
    loop = asyncio.get_running_loop()

    def ready() -> None:
        pair.cq.ack()
        pair.cq.arm()
        pair.comps.drain(pair.cq)

    loop.add_reader(pair.cq.fd, ready)
    pair.cq.arm()
    # a completion may have landed before the CQ was armed
    pair.comps.drain(pair.cq)
    try:
        return await asyncio.wait_for(fut, 30)
    finally:
        loop.remove_reader(pair.cq.fd)


async def test_write_read_atomics_through_the_channel_fd() -> None:
    assert _verbs is not None
    pair = _Pair()
    loop = asyncio.get_running_loop()
    remote = alloc_pinned(1 << 20)
    local = np.zeros(1 << 20, dtype=np.uint8)
    try:
        rmr = _verbs.MR(pair.dev.pd, remote, _verbs.ACCESS_REMOTE_ALL)
        table = _verbs.MRTable()
        table.add(_verbs.MR(pair.dev.pd, local))
        data = np.frombuffer(os.urandom(1 << 20), dtype=np.uint8)
        local[:] = data
        # WRITE as an SGE list of 40 pieces (3 chained work requests)
        pieces = [memoryview(local)[i * 26214:(i + 1) * 26214] for i in range(40)]
        fut = loop.create_future()
        slot = pair.comps.alloc(fut, 3)
        assert pair.a.post_rw(_verbs.WR_RDMA_WRITE, slot, pieces, table, rmr.addr, rmr.rkey) >= 3
        await _complete(pair, fut)
        n = 40 * 26214
        assert bytes(remote[:n]) == data[:n].tobytes()
        # READ back into the other half of nothing: zero the local copy first
        local[:] = 0
        fut = loop.create_future()
        slot = pair.comps.alloc(fut, 1)
        assert pair.a.post_rw(_verbs.WR_RDMA_READ, slot, [memoryview(local)], table,
                              rmr.addr, rmr.rkey) == 1
        await _complete(pair, fut)
        assert bytes(local) == bytes(remote)
        # an unregistered piece: post_rw says so instead of posting
        fut = loop.create_future()
        slot = pair.comps.alloc(fut, 1)
        assert pair.a.post_rw(_verbs.WR_RDMA_READ, slot, [memoryview(bytearray(8))], table,
                              rmr.addr, rmr.rkey) == 0
        pair.comps.cancel(slot)
        # atomics: the old value is the future's result
        remote[0:8] = (41).to_bytes(8, "little")
        fut = loop.create_future()
        slot = pair.comps.alloc(fut, 1, True)
        pair.a.post_atomic(False, slot, pair.comps.word_addr(slot), pair.words_mr.lkey,
                           rmr.addr, rmr.rkey, 1)
        assert await _complete(pair, fut) == 41
        fut = loop.create_future()
        slot = pair.comps.alloc(fut, 1, True)
        pair.a.post_atomic(True, slot, pair.comps.word_addr(slot), pair.words_mr.lkey,
                           rmr.addr, rmr.rkey, 42, 7)
        assert await _complete(pair, fut) == 42
        assert int.from_bytes(remote[0:8], "little") == 7
        rmr.close()
    finally:
        pair.close()


async def test_write_to_an_mr_without_remote_write_fails_with_a_status() -> None:
    assert _verbs is not None
    pair = _Pair()
    loop = asyncio.get_running_loop()
    remote = alloc_pinned(4096)
    try:
        rmr = _verbs.MR(pair.dev.pd, remote, _verbs.ACCESS_LOCAL_WRITE | _verbs.ACCESS_REMOTE_READ)
        table = _verbs.MRTable()
        local = bytearray(64)
        table.add(_verbs.MR(pair.dev.pd, local))
        fut = loop.create_future()
        slot = pair.comps.alloc(fut, 1)
        pair.a.post_rw(_verbs.WR_RDMA_WRITE, slot, [memoryview(local)], table, rmr.addr, rmr.rkey)
        with pytest.raises(OSError) as info:
            await _complete(pair, fut)
        assert info.value.errno == 10          # IBV_WC_REM_ACCESS_ERR
        rmr.close()
    finally:
        pair.close()
