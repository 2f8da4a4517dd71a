"""Worker processes for tests and benchmarks: a lock client in its own
process, and torchrun's command line and output.

    python -m smb2.testing.workers '{"servers": [...], "action": "count", ...}'

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
import re
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import smb2


def torchrun(script: str, *args: str, nproc: int = 1, max_restarts: int | None = None,
             monitor_interval: float | None = None) -> list[str]:
    """The argv of one single-node torchrun job of ``nproc`` workers running
    ``script`` (torch.distributed.run of this interpreter, so the workers
    import this smb2)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={nproc}"]
    if max_restarts is not None:
        cmd.append(f"--max-restarts={max_restarts}")
    if monitor_interval is not None:
        cmd.append(f"--monitor-interval={monitor_interval:g}")
    return [*cmd, script, *args]


# torchrun's own log lines ("W1129 11:14:26.852000 25984 .../api.py:1028] ...")
_TORCHRUN_LOG = re.compile(r"^[DIWE]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ ")
# where torchrun's closing report starts: its own traceback, run through runpy
_TORCHRUN_REPORT = 'Traceback (most recent call last):\n  File "<frozen runpy>"'


#: the repository's examples (the torchrun tests and ``smb2 bench classifier`` run them from a checkout)
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def torchrun_ranks(script: str | Path, *args: str, nproc: int, env: dict[str, str],
                   timeout: float) -> tuple[list[dict[str, Any]], str]:
    """Run ``script`` with ``args`` under :func:`torchrun` (``nproc`` ranks,
    ``env``): every rank's JSON line, in rank order, and torchrun's stderr.
    A failed job, or one where a rank printed none, raises RuntimeError
    with the ranks' tracebacks (:func:`torchrun_failure`)."""
    out = subprocess.run(torchrun(str(script), *args, nproc=nproc), env=env, capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{Path(script).name} {' '.join(args)} failed:\n{torchrun_failure(out.stderr)}")
    ranks = sorted(json_objects(out.stdout), key=lambda r: r["rank"])
    if [r["rank"] for r in ranks] != list(range(nproc)):
        raise RuntimeError(f"{Path(script).name}: ranks {[r['rank'] for r in ranks]} reported, not all {nproc}:\n"
                           f"{torchrun_failure(out.stderr)}")
    return ranks, out.stderr


def torchrun_failure(stderr: str, limit: int = 4000) -> str:
    """Why a torchrun job failed, for an assertion message: its workers'
    stderr (their tracebacks) without torchrun's own log lines, then the
    lines of torchrun's report that name the first failed rank.  The plain
    end of stderr is torchrun's report alone, which hides the cause."""
    lines = [line for line in stderr.splitlines() if not _TORCHRUN_LOG.match(line)]
    text = "\n".join(lines)
    at = text.find(_TORCHRUN_REPORT)
    workers, report = (text, "") if at < 0 else (text[:at], text[at:])
    cause = report[report.find("Root Cause"):] if "Root Cause" in report else report[-600:]
    return f"{workers[-limit:]}\n[torchrun] {cause.strip()}"


def json_objects(text: str) -> list[dict[str, Any]]:
    """Every JSON object in ``text`` (the ranks' lines, however torchrun interleaved them)."""
    decoder = json.JSONDecoder()
    out, i = [], text.find("{")
    while i >= 0:
        obj, end = decoder.raw_decode(text, i)
        out.append(obj)
        i = text.find("{", end)
    return out


async def spawn(cfg: dict[str, Any]) -> asyncio.subprocess.Process:
    """The lock worker in a process of its own, with ``cfg``; stdout piped.
    It inherits this process's environment (PYTHONPATH included)."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", __name__, json.dumps(cfg), stdout=asyncio.subprocess.PIPE)


async def start_holder(cfg: dict[str, Any]) -> tuple[asyncio.subprocess.Process, int]:
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


async def main(cfg: dict[str, Any]) -> None:
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
