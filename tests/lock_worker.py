"""A lock client in its own process, for tests/test_lock.py.

    python lock_worker.py '{"servers": [...], "action": "count", ...}'

Actions:
  count  M times: acquire, read the u64 counter at offset 0 of the buffer,
         write it + 1 fenced by the lock, release.  Prints one JSON line:
         {"seen": [[value, token], ...]}
  hold   acquire, print "HELD <token>", then hold (renewing) until killed.
"""

from __future__ import annotations

import asyncio
import json
import struct
import sys

import smb2


async def main(cfg: dict) -> None:
    client = await smb2.connect(cfg["servers"], transport=cfg.get("transport", "auto"))
    try:
        buf = await client.attach(cfg["buffer"])
        lock = client.lock(cfg["lock"], mode=cfg.get("mode", "auto"))
        if cfg["action"] == "hold":
            await lock.acquire()
            print(f"HELD {lock.token}", flush=True)
            await asyncio.sleep(3600)
            return
        seen = []
        for _ in range(cfg["m"]):
            async with lock:
                raw = await buf.read(0, 8)
                (value,) = struct.unpack("<q", raw.tobytes())
                await buf.write(0, struct.pack("<q", value + 1), fence=lock)
                seen.append((value, lock.token))
        print(json.dumps({"seen": seen}), flush=True)
    finally:
        await client.close()


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    if config.get("loop") == "uvloop":
        import uvloop
        uvloop.run(main(config))
    else:
        asyncio.run(main(config))
