#!/usr/bin/env python3
"""Soft-RoCE diagnostic: is there a usable RDMA device, and do one-sided ops work?

Meant to run inside the tools/rxe_vm.sh guest before the RDMA test tier:

    tools/rxe_vm.sh -- python3 tools/rxe_probe.py

It uses only Debian's pyverbs (no numpy, nothing from smb2), so a failure here
points at the VM/device/pyverbs layer, not at the project's code. Steps:

  1. open the device named by $RXE_DEV (else the first one listed)
  2. print its attributes, port 1 state, the GID at $RXE_GID_INDEX (else the
     first IPv4-mapped RoCE v2 GID) and the atomic capability
  3. connect two RC QPs of that device to each other (loopback); with
     `rxe_vm.sh --veth` ($RXE_DEV2 set) the second QP is on $RXE_DEV2, since
     there a packet to the device's own address comes back in through the
     other veth end and the other device, which drops it
  4. RDMA WRITE 4 KiB from QP a's MR into QP b's MR, compare the bytes
  5. ATOMIC FETCH_AND_ADD on an 8-byte word of b's MR, twice, check the
     returned old values and the final word

Prints one line per step and exits 0 when everything passed, 1 otherwise.
"""

from __future__ import annotations

import os
import random
import struct
import sys
import time
from typing import Any, NoReturn

PORT = 1
POLL_LIMIT_S = 20.0  # the rxe loopback path can stall a jiffy per op under load


def say(msg: str) -> None:
    print(f"rxe_probe: {msg}", flush=True)


def fail(msg: str) -> NoReturn:
    say(f"FAIL: {msg}")
    sys.exit(1)


try:
    import pyverbs.device as dev
    import pyverbs.enums as en
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsError
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, SendWR
except ImportError as exc:
    fail(f"cannot import pyverbs ({exc}); install python3-pyverbs")

ACCESS = (
    en.IBV_ACCESS_LOCAL_WRITE
    | en.IBV_ACCESS_REMOTE_WRITE
    | en.IBV_ACCESS_REMOTE_READ
    | en.IBV_ACCESS_REMOTE_ATOMIC
)
PORT_STATES = {1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
ATOMIC_CAPS = {0: "NONE", 1: "HCA", 2: "GLOB"}


def open_device(var: str = "RXE_DEV") -> Any:
    # Without any RDMA device get_device_list() raises (no
    # /sys/class/infiniband_verbs) instead of returning [].
    try:
        names = [x.name.decode() for x in dev.get_device_list()]
    except PyverbsError as exc:
        fail(f"no RDMA device: get_device_list() raised: {exc}")
    if not names:
        fail("no RDMA device: get_device_list() is empty")
    want = os.environ.get(var) or names[0]
    if want not in names:
        fail(f"{var}={want} is not among the devices {names}")
    return want, dev.Context(name=want)


def pick_gid(ctx: Any, gid_tbl_len: int, var: str = "RXE_GID_INDEX") -> int:
    env = os.environ.get(var)
    if env:
        return int(env)
    for i in range(gid_tbl_len):
        try:
            if str(ctx.query_gid(PORT, i)).startswith("0000:0000:0000:0000:0000:ffff:"):
                return i
        except PyverbsError:
            pass
    return 0


class End:
    """One side of the loopback: its own PD, CQ, MR and RC QP."""

    def __init__(self, ctx: Any, gid_index: int, size: int) -> None:
        self.pd = PD(ctx)
        self.cq = CQ(ctx, 16, None, None, 0)
        self.mr = MR(self.pd, size, ACCESS)
        cap = QPCap(max_send_wr=8, max_recv_wr=8, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=en.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
        attr = QPAttr(port_num=PORT)
        attr.qp_access_flags = ACCESS
        self.qp = QP(self.pd, init, attr)
        self.psn = random.getrandbits(24)
        self.gid_index = gid_index
        self.gid = ctx.query_gid(PORT, gid_index)

    def connect(self, peer: End) -> None:
        a = QPAttr(port_num=PORT)
        a.qp_access_flags = ACCESS
        a.path_mtu = en.IBV_MTU_1024
        a.dest_qp_num = peer.qp.qp_num
        a.rq_psn = peer.psn
        a.sq_psn = self.psn
        a.max_rd_atomic = a.max_dest_rd_atomic = 4
        a.min_rnr_timer, a.timeout, a.retry_cnt, a.rnr_retry = 12, 14, 7, 7
        route = GlobalRoute(dgid=GID(str(peer.gid)), sgid_index=self.gid_index)
        a.ah_attr = AHAttr(port_num=PORT, is_global=1, gr=route)
        self.qp.to_rts(a)  # INIT -> RTR -> RTS

    def post_and_wait(self, wr: Any, what: str) -> Any:
        self.qp.post_send(wr)
        deadline = time.monotonic() + POLL_LIMIT_S
        while True:
            n, wcs = self.cq.poll(1)
            if n:
                break
            if time.monotonic() > deadline:
                fail(f"{what}: no completion within {POLL_LIMIT_S:.0f} s")
        wc = wcs[0]
        if wc.status != en.IBV_WC_SUCCESS:
            fail(f"{what}: work completion status {wc.status}")
        return wc


def main() -> int:
    t_start = time.perf_counter()
    name, ctx = open_device()
    dattr = ctx.query_device()
    pattr = ctx.query_port(PORT)
    state = PORT_STATES.get(pattr.state, str(pattr.state))
    say(
        f"device {name}: fw {getattr(dattr, 'fw_version', '?')}, "
        f"max_qp {dattr.max_qp}, max_mr_size {dattr.max_mr_size}, "
        f"max_qp_rd_atom {dattr.max_qp_rd_atom}"
    )
    say(
        f"port {PORT}: state {state}, active_mtu {pattr.active_mtu}, "
        f"link_layer {pattr.link_layer}, gid_tbl_len {pattr.gid_tbl_len}"
    )
    if pattr.state != en.IBV_PORT_ACTIVE:
        fail(f"port {PORT} is {state}, not ACTIVE")
    gidx = pick_gid(ctx, pattr.gid_tbl_len)
    gid = str(ctx.query_gid(PORT, gidx))
    say(f"gid[{gidx}] {gid}")
    if gid.strip(":0") == "":
        fail(f"gid[{gidx}] is empty")
    caps = ATOMIC_CAPS.get(dattr.atomic_caps, str(dattr.atomic_caps))
    say(f"atomic caps: {caps}")
    if dattr.atomic_caps == en.IBV_ATOMIC_NONE:
        fail("the device has no atomic support")

    size = 4096
    a = End(ctx, gidx, size)
    if os.environ.get("RXE_DEV2"):
        name2, ctx2 = open_device("RXE_DEV2")
        gidx2 = pick_gid(ctx2, ctx2.query_port(PORT).gid_tbl_len, "RXE_GID_INDEX2")
        b = End(ctx2, gidx2, size)
    else:
        name2 = name
        b = End(ctx, gidx, size)
    a.connect(b)
    b.connect(a)
    say(f"RC QPs connected: {name} qp {a.qp.qp_num} <-> {name2} qp {b.qp.qp_num}")

    # RDMA WRITE: a's whole MR -> b's MR
    pattern = bytes(random.getrandbits(8) for _ in range(size))
    a.mr.write(pattern, size)
    b.mr.write(bytes(size), size)
    wr = SendWR(
        wr_id=1,
        opcode=en.IBV_WR_RDMA_WRITE,
        num_sge=1,
        sg=[SGE(a.mr.buf, size, a.mr.lkey)],
        send_flags=en.IBV_SEND_SIGNALED,
    )
    wr.set_wr_rdma(b.mr.rkey, b.mr.buf)
    t0 = time.perf_counter()
    a.post_and_wait(wr, "RDMA WRITE")
    dt = time.perf_counter() - t0
    if b.mr.read(size, 0) != pattern:
        fail("RDMA WRITE completed but the target bytes differ")
    say(f"RDMA WRITE {size} B: ok ({dt * 1e6:.0f} us)")

    # ATOMIC FETCH_AND_ADD on b's word at offset 64; the old value lands in
    # a's MR at offset 0
    start = 0x0123456789ABCDEF
    b.mr.write(struct.pack("<Q", start), 8, 64)
    olds = []
    t0 = time.perf_counter()
    for i, add in enumerate((5, 7)):
        wr = SendWR(
            wr_id=2 + i,
            opcode=en.IBV_WR_ATOMIC_FETCH_AND_ADD,
            num_sge=1,
            sg=[SGE(a.mr.buf, 8, a.mr.lkey)],
            send_flags=en.IBV_SEND_SIGNALED,
        )
        wr.set_wr_atomic(rkey=b.mr.rkey, addr=b.mr.buf + 64, compare_add=add, swap=0)
        a.post_and_wait(wr, "FETCH_AND_ADD")
        olds.append(struct.unpack("<Q", a.mr.read(8, 0))[0])
    dt = (time.perf_counter() - t0) / 2
    final = struct.unpack("<Q", b.mr.read(8, 64))[0]
    if olds != [start, start + 5] or final != start + 12:
        fail(
            f"FETCH_AND_ADD: old values {[hex(x) for x in olds]}, final {final:#x}; "
            f"expected {start:#x}, {start + 5:#x}, final {start + 12:#x}"
        )
    say(f"FETCH_AND_ADD x2: ok ({dt * 1e6:.0f} us each)")
    say(f"all ok in {time.perf_counter() - t_start:.2f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PyverbsError as exc:
        fail(f"pyverbs error: {exc}")
