"""How long a replicated buffer takes to be whole again after a server is lost.

    python tools/bench_repair.py [--size 256MiB] [--repair-rate 256MiB] [--kills 3]

Starts 3 ``smb2-server`` processes with a private etcd
(``LocalCluster(replicated=True)``), fills a ``replicas=2`` buffer of
``--size`` with random bytes, then, ``--kills`` times: SIGKILLs server 1,
takes it out of the view (as a client that found it dead does), restarts it
empty and times until it is a member again (its stat's replication state),
then checks that every stripe's two copies are the same bytes as the data
written.  Prints the median and worst catch-up time (from the restart; the
process start included) and the rate it implies, beside the 64-byte round
trip measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import numpy as np

import smb2
from smb2 import _core
from smb2.membership import open_membership
from smb2.placement import Placement
from smb2.protocol import parse_size

MiB = 1 << 20


async def stat_of(client: smb2.Client, index: int) -> dict:
    return (await client.stat())[index]


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    size = parse_size(args.size)
    stripe = MiB
    async with smb2.LocalCluster(servers=3, processes=True, replicated=True, capacity=f"{size // MiB + 64}MiB",
                                 server_args=["--repair-rate", args.repair_rate]) as cluster:
        async with await smb2.connect(cluster.addresses, transport="tcp", op_timeout=120) as client:
            buf = await client.create("repair", size, stripe=stripe, replicas=2)
            data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
            await buf.write(0, data)
            small = np.zeros(64, np.uint8)
            rtts = []
            for _ in range(200):
                t0 = time.perf_counter()
                await buf.read_into(small, 0)
                rtts.append((time.perf_counter() - t0) * 1e6)
            times = []
            for _ in range(args.kills):
                await cluster.kill(1)
                assert cluster.membership_url is not None
                async with open_membership(cluster.membership_url) as m:
                    v = await m.view()
                    await m.change(v, members=[a for a in v.members if a != cluster.addresses[1]],
                                   joining=[a for a in v.joining if a != cluster.addresses[1]])
                t0 = time.monotonic()
                await cluster.restart(1)
                while True:
                    try:
                        st = (await stat_of(client, 1))["replication"]
                        if st["state"] == "member":
                            break
                    except smb2.Smb2Error:
                        pass
                    await asyncio.sleep(0.02)
                times.append(time.monotonic() - t0)
            # every copy holds the data
            p = Placement(3, size, stripe, _core.name_hash("repair") % 3, 2)
            parts = []
            for s in range(3):
                info = (await stat_of(client, s))["buffers"]["repair"]
                parts.append(info["segment"])
            ok = True
            bad: list[tuple[int, int, int, int]] = []
            for i in range(p.nstripes):
                want = data[i * stripe:(i + 1) * stripe]
                for s in p.replicas_of(i):
                    host, port = cluster.addresses[s].rsplit(":", 1)
                    got = await read_copy(host, int(port), parts[s], p.offset_on(s, i), len(want))
                    if got != want.tobytes():
                        ok = False
                        bad.append((i, s, len(got), int(np.count_nonzero(np.frombuffer(got, np.uint8) != want))
                                    if len(got) == len(want) else -1))
    held = p.stripes_on(1) * stripe
    return {"size": size, "repair_rate": args.repair_rate, "bytes_copied_to_rejoiner": held,
            "catch_up_s_median": round(statistics.median(times), 3), "catch_up_s_worst": round(max(times), 3),
            "implied_MiB_per_s": round(held / MiB / statistics.median(times), 1),
            "rtt_64B_us_median": round(statistics.median(rtts), 1), "copies_equal_data": ok,
            "differing (stripe, server, bytes read, bytes wrong)": bad[:10]}


async def read_copy(host: str, port: int, segment: int, offset: int, n: int) -> bytes:
    """One raw READ (the client reads primaries only; this reads a given copy)."""
    from smb2.protocol import VERSION, Op, pack, unpack
    reader, writer = await asyncio.open_connection(host, port)
    try:
        hello = pack({"cmd": "hello", "version": VERSION, "transports": ["tcp"]})
        writer.write(_core.encode_header(VERSION, Op.CONTROL, 0, 0, 1, 0, 0, len(hello)) + hello)
        hdr = _core.decode_header(await reader.readexactly(32))
        unpack(await reader.readexactly(hdr[8]))
        writer.write(_core.encode_header(VERSION, Op.READ, 0, 0, 2, segment, offset, n))
        hdr = _core.decode_header(await reader.readexactly(32))
        return await reader.readexactly(hdr[8])
    finally:
        writer.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="256MiB")
    p.add_argument("--repair-rate", default="256MiB")
    p.add_argument("--kills", type=int, default=3)
    print(json.dumps(asyncio.run(main_async(p.parse_args())), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
