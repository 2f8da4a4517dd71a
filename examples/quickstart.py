"""The smallest useful smb2 program: a striped buffer shared by two clients.

Run it against your own servers:
    smb2-server --port 7420 &  smb2-server --port 7421 &
    SMB2_SERVERS=127.0.0.1:7420,127.0.0.1:7421 python examples/quickstart.py
or without any (it then starts a LocalCluster of 2 servers in-process):
    python examples/quickstart.py
"""

from __future__ import annotations

import asyncio
import os

import numpy as np

import smb2


async def share(servers: list[str]) -> None:
    async with await smb2.connect(servers) as alice, await smb2.connect(servers) as bob:
        weights = await alice.create("weights", 1 << 20, stripe=64 << 10)   # 1 MiB over all servers
        await weights.write(0, np.arange(1000, dtype=np.float32))

        seen = await bob.attach("weights")                                   # by name only
        await seen.accumulate(0, np.full(1000, 0.5, dtype=np.float32))       # server-side +=
        step = await seen.fetch_add(1 << 19)                                 # a shared counter

        out = np.empty(1000, dtype=np.float32)
        await weights.read_into(out, 0)
        print(f"alice sees {out[:3]} ... {out[-1]} after bob's accumulate; bob took step {step}")
        await alice.destroy("weights")


async def main() -> None:
    servers = [s for s in os.environ.get("SMB2_SERVERS", "").split(",") if s]
    if servers:
        await share(servers)
        return
    async with smb2.LocalCluster(servers=2) as cluster:
        await share(cluster.addresses)


if __name__ == "__main__":
    asyncio.run(main())
