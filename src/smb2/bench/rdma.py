"""RDMA transport overhead against a bare pyverbs post-and-poll loop, measured
in the same run (``python tools/bench_bandwidth.py --transport rdma``, or
``smb2 bench --transport rdma``).

Both sides do the same thing: one RDMA READ or WRITE of ``size`` bytes
between registered local memory and a server's segment, one at a time, on
an RC queue pair of the same device to the same server.  The baseline posts
with pyverbs and spins on ``CQ.poll`` (no event loop, no futures); the
subject is ``Buffer.read_into``/``Buffer.write`` on a registered array, with
``poll="event"`` (completion channel fd in the loop) and ``poll="busy"``.
Rounds alternate baseline and subject (docs/design.md, "Measuring"); each ratio
is subject / baseline time per operation within one round, reported as the
median over rounds, with the baseline's 8-byte READ round trip of that round
beside it.  Under TCG (the soft-RoCE VM) the absolute numbers mean nothing;
the ratio still shows what the Python/asyncio layer adds.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from . import report
from .common import MiB, fmt_size, size_list
from .report import run_and_report

KiB = 1 << 10
DEFAULT_SIZES = "4KiB,64KiB"
TARGET_SIZE = 4 * KiB
TARGET_RATIO = 1.5


def _gid_text(gid: bytes) -> str:
    # pyverbs' GID wants 8 colon-separated groups of 4 hex digits
    return ":".join(gid[i:i + 2].hex() for i in range(0, 16, 2))


class _Bare:
    """A pyverbs RC QP to the server (set up with the server's own
    ``rdma_connect``), posting one WR and spinning on ``CQ.poll``."""

    def __init__(self, device: Any, local: np.ndarray) -> None:
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.device import Context
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
        self.e = e
        self.dev = device
        self.ctx = Context(name=device.name)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 64, None, None, 0)
        self.local = local
        self.mr = MR(self.pd, local.nbytes, e.IBV_ACCESS_LOCAL_WRITE, address=local.ctypes.data)
        cap = QPCap(max_send_wr=64, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
        self.qp = QP(self.pd, init, QPAttr(port_num=device.port))
        self.psn = int.from_bytes(os.urandom(3), "little")
        self.raddr = 0
        self.rkey = 0

    def hello(self) -> dict[str, Any]:
        d = self.dev
        return {"cmd": "rdma_connect", "qpn": self.qp.qp_num, "psn": self.psn, "gid": d.gid,
                "lid": d.lid, "mtu": d.mtu, "max_rd_atomic": d.max_rd_atomic}

    def connect(self, r: dict[str, Any], raddr: int, rkey: int) -> None:
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr
        e, d = self.e, self.dev
        a = QPAttr(port_num=d.port)
        a.path_mtu = min(d.mtu, int(r["mtu"]))
        a.dest_qp_num = int(r["qpn"])
        a.rq_psn = int(r["psn"])
        a.sq_psn = self.psn
        a.max_dest_rd_atomic = d.max_rd_atomic
        a.max_rd_atomic = min(d.max_rd_atomic, int(r["max_rd_atomic"]))
        a.min_rnr_timer = 12
        a.timeout = 14
        a.retry_cnt = 6
        a.rnr_retry = 7
        if d.ethernet:
            gr = GlobalRoute(dgid=GID(_gid_text(bytes(r["gid"]))), sgid_index=d.gid_index)
            a.ah_attr = AHAttr(port_num=d.port, is_global=1, gr=gr, dlid=int(r.get("lid", 0)))
        else:
            a.ah_attr = AHAttr(port_num=d.port, is_global=0, dlid=int(r.get("lid", 0)))
        self.qp.to_rts(a)
        self.raddr, self.rkey = raddr, rkey
        self.opcodes = {"read": e.IBV_WR_RDMA_READ, "write": e.IBV_WR_RDMA_WRITE}

    def run(self, op: str, size: int, n: int) -> float:
        """Seconds per operation over ``n`` back-to-back post-and-poll ops."""
        from pyverbs.wr import SGE, SendWR
        e = self.e
        opcode = self.opcodes[op]
        t0 = time.perf_counter()
        for i in range(n):
            sge = SGE(self.mr.buf, size, self.mr.lkey)
            wr = SendWR(wr_id=i, opcode=opcode, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
            wr.set_wr_rdma(self.rkey, self.raddr)
            self.qp.post_send(wr)
            while True:
                cnt, wcs = self.cq.poll(1)
                if cnt:
                    if wcs[0].status != e.IBV_WC_SUCCESS:
                        raise RuntimeError(f"baseline work completion status {wcs[0].status}")
                    break
        return (time.perf_counter() - t0) / n

    def close(self) -> None:
        for r in (self.qp, self.mr, self.cq, self.pd, self.ctx):
            r.close()


async def _subject(buf: Any, arr: np.ndarray, op: str, size: int, n: int) -> float:
    view = arr[:size]
    t0 = time.perf_counter()
    if op == "read":
        for _ in range(n):
            await buf.read_into(view, 0)
    else:
        for _ in range(n):
            await buf.write(0, view)
    return (time.perf_counter() - t0) / n


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from ..client import connect
    from ..server import start_server
    from ..transport.tcp import TcpTransport

    server = await start_server("127.0.0.1", 0, capacity=4 * max(args.sizes) + 64 * MiB, rdma="on")
    assert server.rdma is not None
    device = server.rdma.device
    maxsize = max(args.sizes)
    local = np.zeros(maxsize, dtype=np.uint8)
    bare_mem = np.zeros(maxsize + 4096, dtype=np.uint8)
    bare = _Bare(device, bare_mem)
    clients = {}
    results: dict[str, Any] = {"device": device.describe(), "sizes": args.sizes, "ops": args.ops,
                               "rounds": args.repeat, "samples": []}
    ctl = None
    try:
        for mode in args.poll:
            clients[mode] = await connect([server.address], transport="rdma", poll=mode)
        buf = await clients[args.poll[0]].create("bench-rdma", maxsize, stripe=maxsize)
        bufs = {mode: await c.attach("bench-rdma") for mode, c in clients.items()}
        regs = [c.register(local) for c in clients.values()]
        ctl = await TcpTransport.connect(server.address)
        r = await ctl.control(bare.hello())
        seg = await ctl.control({"cmd": "rdma_segment", "segment": buf.segments[0]})
        bare.connect(r, int(seg["rdma_addr"]), int(seg["rdma_rkey"]))
        # warm up both paths (first touches, page faults, lazy set-up)
        for mode in args.poll:
            await _subject(bufs[mode], local, "read", maxsize, 3)
        bare.run("read", maxsize, 3)
        cells = args.repeat * 2 * len(args.sizes)
        report.progress("bandwidth", 0, cells, "rdma reads and writes, bare and " + ", ".join(args.poll))
        for rnd in range(args.repeat):
            rtt = bare.run("read", 8, max(10, args.ops // 10))
            for op in ("read", "write"):
                for size in args.sizes:
                    base = bare.run(op, size, args.ops)
                    row: dict[str, Any] = {"round": rnd, "op": op, "size": size,
                                           "bare_us": base * 1e6, "rtt_us": rtt * 1e6}
                    for mode in args.poll:
                        t = await _subject(bufs[mode], local, op, size, args.ops)
                        row[f"{mode}_us"] = t * 1e6
                        row[f"{mode}_ratio"] = t / base
                    results["samples"].append(row)
                    report.progress("bandwidth", len(results["samples"]), cells, f"round {rnd} {op} {size}",
                                    bare=f"{base * 1e6:.1f} us",
                                    **{m: f"{row[f'{m}_us']:.1f} us ({row[f'{m}_ratio']:.2f}x)" for m in args.poll})
        for reg in regs:
            reg.close()
        results["round_trip_64B_us"] = await report.round_trip_us([server.address])
    finally:
        for c in clients.values():
            await c.close()
        if ctl is not None:
            await ctl.close()
        bare.close()
        await server.close()
    return results


def summarize(results: dict[str, Any], modes: list[str]) -> list[dict[str, Any]]:
    rows = []
    for op in ("read", "write"):
        for size in results["sizes"]:
            s = [r for r in results["samples"] if r["op"] == op and r["size"] == size]
            row: dict[str, Any] = {"op": op, "size": size,
                                   "bare_us": statistics.median(r["bare_us"] for r in s),
                                   "rtt_us": statistics.median(r["rtt_us"] for r in s)}
            for m in modes:
                row[f"{m}_us"] = statistics.median(r[f"{m}_us"] for r in s)
                row[f"{m}_ratio"] = statistics.median(r[f"{m}_ratio"] for r in s)
            rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]], modes: list[str]) -> str:
    def goal(r: dict[str, Any]) -> str | None:
        if r["size"] != TARGET_SIZE:
            return None
        return report.target("<=", TARGET_RATIO, "{:g}x", min(r[m + "_ratio"] for m in modes) <= TARGET_RATIO)

    return "\n".join([
        report.table(["op", "size", "bare us/op"] + [h for m in modes for h in (f"{m} us/op", f"{m} ratio")]
                     + ["rtt us", "target"],
                     [[r["op"], fmt_size(r["size"], sep=""), r["bare_us"]]
                      + [r[m + k] for m in modes for k in ("_us", "_ratio")] + [r["rtt_us"], goal(r)] for r in rows],
                     formats=[None, None, "{:.1f}"] + ["{:.1f}", "{:.2f}x"] * len(modes) + ["{:.1f}"]),
        "",
        "ratio = median over rounds of smb2 / bare pyverbs post-and-poll time per op, one op at a time;",
        "rtt = the bare loop's 8-byte RDMA READ round trip in that round (the machine's mode)"])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smb2 bench --transport rdma",
        description="Per-operation overhead of smb2's RDMA transport against a bare pyverbs "
                    "post-and-poll loop, measured in one run.")
    p.add_argument("--transport", default="rdma", choices=("rdma",))
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"operation sizes (default {DEFAULT_SIZES})")
    p.add_argument("--ops", type=int, default=None, help="operations per sample (default 500; 100 with --quick)")
    p.add_argument("--repeat", type=int, default=None, help="rounds (default 5; 3 with --quick)")
    p.add_argument("--poll", default="event,busy", help="subject poll modes (default event,busy)")
    p.add_argument("--quick", action="store_true", help="fewer operations and rounds")
    p.add_argument("--json", default="bench-results/bandwidth_rdma.json", metavar="PATH",
                   help="where to write every sample ('' for none)")
    return p


def main(argv: list[str] | None = None) -> int:
    # smb2.bench hands over its whole command line: ignore the TCP benchmark's flags
    args, _ = _parser().parse_known_args(argv)
    sizes = size_list(args.sizes)
    if sizes is None:
        return 2
    args.sizes = sizes
    args.poll = [m for m in args.poll.split(",") if m]
    if not args.poll or any(m not in ("event", "busy") for m in args.poll):
        print("smb2 bench: --poll takes event and/or busy", file=sys.stderr)
        return 2
    args.ops = args.ops or (100 if args.quick else 500)
    args.repeat = args.repeat or (3 if args.quick else 5)
    try:
        import pyverbs.qp  # noqa: F401
        # pyverbs calls logging.basicConfig() when imported: keep smb2 as quiet as usual
        logging.getLogger("smb2").setLevel(logging.WARNING)
    except ImportError as exc:
        print(f"smb2 bench: the baseline needs pyverbs (apt-get install python3-pyverbs): {exc}",
              file=sys.stderr)
        return 1
    from ..transport import rdma_unavailable_reason
    reason = rdma_unavailable_reason()
    if reason is not None:
        print(f"smb2 bench: no RDMA here: {reason}", file=sys.stderr)
        return 1
    return run_and_report(lambda: _run(args), lambda r: summarize(r, args.poll),
                          lambda rows: format_table(rows, args.poll), args.json,
                          lambda result: result["round_trip_64B_us"])
