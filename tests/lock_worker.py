"""A lock client in its own process, for tests/test_lock.py.

    python lock_worker.py '{"servers": [...], "action": "count", ...}'

Actions:
  count  M times: acquire, read the u64 counter at offset 0 of the buffer,
         write it + 1 fenced by the lock, release.  Prints one JSON line:
         {"seen": [[value, token], ...]}
  hold   acquire, print "HELD <token>", then hold (renewing) until killed,
         or until a renewal finds the lock lost: then print "LOST <why>"
         and exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import struct
import sys

import smb2


async def spawn(cfg: dict) -> asyncio.subprocess.Process:
    """This worker in a process of its own, with ``cfg``; stdout piped."""
    return await asyncio.create_subprocess_exec(
        sys.executable, __file__, json.dumps(cfg), stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


async def start_holder(cfg: dict) -> tuple[asyncio.subprocess.Process, int]:
    """A worker that holds the lock (action "hold"): the process and its token."""
    proc = await spawn({**cfg, "action": "hold"})
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.startswith(b"HELD "), line
        return proc, int(line.split()[1])
    except BaseException:
        await reap(proc)
        raise


async def reap(proc: asyncio.subprocess.Process) -> None:
    """End a worker, stopped or not, and wait for it."""
    if proc.returncode is None:
        proc.kill()
        # (SIGKILL ends a stopped process too; it may be reaped already)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
    await proc.wait()


async def main(cfg: dict) -> None:
    client = await smb2.connect(cfg["servers"], transport=cfg.get("transport", "auto"))
    try:
        buf = await client.attach(cfg["buffer"])
        lock = client.lock(cfg["lock"], mode=cfg.get("mode", "auto"), lease=cfg.get("lease"))
        if cfg["action"] == "hold":
            await lock.acquire()
            print(f"HELD {lock.token}", flush=True)
            while lock.locked():  # noqa: ASYNC110 (a loss shows only here; no event says it)
                await asyncio.sleep(0.02)
            try:
                await lock.release()
            except smb2.StaleFence as exc:
                print(f"LOST {exc}", flush=True)
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
