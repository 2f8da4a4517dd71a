"""``smb2 demo``: four memory servers, a few clients, and what they measured.

Starts a LocalCluster of real ``smb2-server`` processes, lets several clients
create one striped buffer and write, read, accumulate and fetch-add it
concurrently, checks every result, and prints the bandwidth it saw.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np

from .client import Buffer, Client

MiB = 1 << 20


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


async def _run(servers: int, clients: int, mib: int) -> int:
    # the lab (smb2.testing) is imported by the command that uses it, never by the library's import
    from .testing.cluster import LocalCluster

    say = print
    say(f"smb2 demo: starting {servers} memory servers (smb2-server processes) ...")
    async with LocalCluster(servers=servers, processes=True, capacity=f"{2 * mib}MiB") as cluster:
        say("  " + ", ".join(cluster.addresses))
        conns: list[Client] = [await cluster.connect() for _ in range(clients)]
        nbytes = mib * MiB
        buf = await conns[0].create("demo", nbytes, stripe=MiB)
        bufs: list[Buffer] = [buf] + [await c.attach("demo") for c in conns[1:]]
        # auto: shm here, where the servers share this host (else RDMA, else TCP)
        say(f"clients reach the servers over {', '.join(sorted(set(conns[0].transports)))} "
            "(transport='auto': shm on the same host, else RDMA, else TCP)")
        say(f"client 0 created buffer 'demo': {mib} MiB striped over {servers} servers "
            f"in 1 MiB stripes (first stripe on server {buf.first}); "
            f"{clients - 1} other clients attached by name")

        # 1. each client writes its share concurrently
        share = nbytes // clients
        data = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)
        t0 = time.perf_counter()
        await asyncio.gather(*(b.write(k * share, data[k * share:(k + 1) * share])
                               for k, b in enumerate(bufs)))
        dt = time.perf_counter() - t0
        say(f"write:      {clients} clients wrote {clients} x {share // MiB} MiB concurrently "
            f"in {dt * 1e3:.0f} ms  ({_gbps(nbytes, dt)})")

        # 2. every client reads the whole buffer back and checks it
        outs = [np.empty(nbytes, dtype=np.uint8) for _ in bufs]
        t0 = time.perf_counter()
        await asyncio.gather(*(b.read_into(o, 0) for b, o in zip(bufs, outs)))
        dt = time.perf_counter() - t0
        ok = all(np.array_equal(o, data) for o in outs)
        say(f"read:       {clients} clients read all {mib} MiB each in {dt * 1e3:.0f} ms "
            f"({_gbps(nbytes * clients, dt)}); every byte matches: {'yes' if ok else 'NO'}")

        # 3. concurrent server-side accumulates into the same float32 range
        rounds = 5
        n = 4 * MiB // 4
        await buf.write(0, np.zeros(n, dtype=np.float32))
        ones = np.ones(n, dtype=np.float32)
        t0 = time.perf_counter()
        await asyncio.gather(*(b.accumulate(0, ones) for b in bufs for _ in range(rounds)))
        dt = time.perf_counter() - t0
        acc = np.empty(n, dtype=np.float32)
        await buf.read_into(acc, 0)
        want = float(clients * rounds)
        ok_acc = bool((acc == want).all())
        say(f"accumulate: {clients} clients added 1.0 to the same 4 MiB of float32 {rounds} times "
            f"each in {dt * 1e3:.0f} ms ({_gbps(4 * MiB * clients * rounds, dt)}); "
            f"every element is {acc[0]:g} (expected {want:g}): {'yes' if ok_acc else 'NO'}")

        # 4. a shared counter: fetch_add from all clients at once
        per = 500
        await buf.write(8 * MiB, np.zeros(1, dtype=np.int64))
        t0 = time.perf_counter()
        olds = await asyncio.gather(*(b.fetch_add(8 * MiB) for b in bufs for _ in range(per)))
        dt = time.perf_counter() - t0
        final = await buf.fetch_add(8 * MiB, 0)
        ok_cnt = final == clients * per and sorted(olds) == list(range(clients * per))
        say(f"fetch_add:  {clients} clients x {per} increments of one counter in {dt * 1e3:.0f} ms "
            f"({clients * per / dt:,.0f} ops/s); counter = {final}, every ticket unique: "
            f"{'yes' if ok_cnt else 'NO'}")

        stats = await conns[0].stat()
        # what each server's CPU executed, per transport: over shm only the
        # accumulates (reads, writes and atomics were the clients' own copies)
        said = "; ".join(f"{s['address']}: " + (", ".join(
            f"{t} {', '.join(f'{n} {op}' for op, n in sorted(ops.items()))}" for t, ops in sorted(s["ops"].items()))
            or "nothing") for s in stats)
        say(f"servers:    data ops they executed: {said}")
        await conns[0].destroy("demo")
        good = ok and ok_acc and ok_cnt
        say("demo finished: all checks passed" if good else "demo finished: A CHECK FAILED")
        return 0 if good else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="smb2 demo", description=__doc__)
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--mib", type=int, default=64, help="buffer size in MiB (default 64)")
    args = p.parse_args(argv)
    import uvloop
    return uvloop.run(_run(args.servers, args.clients, args.mib))


if __name__ == "__main__":
    sys.exit(main())
