#!/usr/bin/env python3
"""Soak: many clients doing random writes, reads, accumulates, fetch-adds (and
locked updates, when this smb2 has a lock) against memory-server processes
for a bounded time, verifying every byte.

Every expected value is known, so every read is checked exactly:

* each client owns a disjoint region of the buffer and is its only writer; it
  keeps a mirror of it, and every read of it (random ranges crossing stripes
  and servers) is compared with the mirror byte for byte;
* a shared int64 region only receives accumulates: each client sums what it
  added, and at the end the region must equal the sum over all clients;
* a shared counter word only receives fetch-adds: likewise;
* with a lock, a shared record (counter, client id, checksum) is updated under
  the lock: read, check its checksum, increment, write; at the end its
  counter must equal the number of locked updates.

Clients run in several processes (``--procs``), several clients per process
(``--clients``), the servers are ``smb2-server`` processes.  Reports ops/s per
kind, bytes verified, errors (must be 0), and the servers' RSS at the start
(after the buffer was written once) and at the end.  Exit status 1 on any
error or mismatch.

    python tools/soak.py --seconds 60
    python tools/soak.py --seconds 600 --servers 4 --procs 2 --clients 8 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import smb2

MiB = 1 << 20
NAME = "soak"
SELF = os.path.abspath(__file__)
RECORD = struct.Struct("<QQ32s")     # counter, last client, sha256(counter, client)


def layout(a: argparse.Namespace) -> dict[str, int]:
    nclients = a.procs * a.clients
    region = a.region_kib << 10
    acc_off = nclients * region
    counter_off = acc_off + a.acc_words * 8
    record_off = counter_off + 8
    return {"region": region, "nclients": nclients, "acc_off": acc_off, "acc_words": a.acc_words,
            "counter_off": counter_off, "record_off": record_off,
            "nbytes": record_off + RECORD.size + 8, "stripe": a.stripe_kib << 10}


def _record(counter: int, client: int) -> bytes:
    return RECORD.pack(counter, client, hashlib.sha256(struct.pack("<QQ", counter, client)).digest())


# --------------------------------------------------------------------------
# one worker process: several clients


class Stats:
    def __init__(self) -> None:
        self.ops: dict[str, int] = {}
        self.bytes_verified = 0
        self.bytes_moved = 0
        self.errors: list[str] = []

    def op(self, kind: str, nbytes: int = 0) -> None:
        self.ops[kind] = self.ops.get(kind, 0) + 1
        self.bytes_moved += nbytes


async def one_client(cid: int, servers: list[str], lay: dict[str, int], deadline: float,
                     seed: int, stats: Stats, acc: np.ndarray, totals: dict[str, int]) -> None:
    rng = random.Random(seed * 1000 + cid)
    nrng = np.random.default_rng(seed * 1000 + cid)
    region = lay["region"]
    base = cid * region
    mirror = np.zeros(region, np.uint8)
    client = await smb2.connect(servers)
    try:
        buf = await client.attach(NAME)
        lock = client.lock("soak-record") if hasattr(client, "lock") else None
        max_len = min(region, 512 << 10)
        while time.monotonic() < deadline:
            r = rng.random()
            try:
                if r < 0.35:                               # write into own region
                    n = rng.randrange(1, max_len + 1)
                    off = rng.randrange(0, region - n + 1)
                    data = nrng.integers(0, 256, n, dtype=np.uint8)
                    await buf.write(base + off, data)
                    mirror[off:off + n] = data
                    stats.op("write", n)
                elif r < 0.7:                              # read own region, verify
                    n = rng.randrange(1, max_len + 1)
                    off = rng.randrange(0, region - n + 1)
                    got = await buf.read(base + off, n)
                    stats.op("read", n)
                    if not np.array_equal(got, mirror[off:off + n]):
                        bad = int(np.flatnonzero(got != mirror[off:off + n])[0])
                        stats.errors.append(f"client {cid}: read mismatch at region offset {off + bad}")
                    else:
                        stats.bytes_verified += n
                elif r < 0.88:                             # accumulate into the shared region
                    k = rng.randrange(1, min(lay["acc_words"], 32768) + 1)
                    w = rng.randrange(0, lay["acc_words"] - k + 1)
                    delta = nrng.integers(-1000, 1000, k, dtype=np.int64)
                    await buf.accumulate(lay["acc_off"] + 8 * w, delta)
                    acc[w:w + k] += delta
                    stats.op("accumulate", 8 * k)
                elif r < 0.97 or lock is None:             # fetch-add the shared counter
                    v = rng.randrange(1, 1000)
                    await buf.fetch_add(lay["counter_off"], v)
                    totals["counter"] += v
                    stats.op("fetch_add", 8)
                else:                                      # locked read-check-modify-write
                    async with lock:
                        raw = bytes(await buf.read(lay["record_off"], RECORD.size))
                        counter, last, digest = RECORD.unpack(raw)
                        if raw != bytes(RECORD.size) and raw != _record(counter, last):
                            stats.errors.append(f"client {cid}: locked record torn: {raw.hex()}")
                        # fenced: a holder that lost its lease cannot write
                        await buf.write(lay["record_off"], _record(counter + 1, cid), fence=lock)
                    totals["locked"] += 1
                    stats.op("locked_update", RECORD.size)
            except smb2.Smb2Error as exc:
                stats.errors.append(f"client {cid}: {type(exc).__name__}: {exc}")
                if len(stats.errors) > 100:
                    return
        # the whole region, once more
        got = await buf.read(base, region)
        if np.array_equal(got, mirror):
            stats.bytes_verified += region
        else:
            stats.errors.append(f"client {cid}: final read of its region differs")
    finally:
        await client.close()


async def worker(a: argparse.Namespace) -> dict[str, Any]:
    lay = layout(a)
    stats = Stats()
    acc = np.zeros(lay["acc_words"], np.int64)
    totals = {"counter": 0, "locked": 0}
    deadline = time.monotonic() + a.seconds
    first = a.worker * a.clients
    await asyncio.gather(*(one_client(first + i, a.server, lay, deadline, a.seed, stats, acc, totals)
                           for i in range(a.clients)))
    return {"ops": stats.ops, "bytes_verified": stats.bytes_verified, "bytes_moved": stats.bytes_moved,
            "errors": stats.errors, "acc": acc.tobytes().hex(), **totals}


# --------------------------------------------------------------------------
# the driver


def _load(path: str) -> Any:
    return json.loads(Path(path).read_text())


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    return 0


async def drive(a: argparse.Namespace) -> dict[str, Any]:
    lay = layout(a)
    async with smb2.LocalCluster(servers=a.servers, processes=True,
                                 capacity=max(64 * MiB, 2 * lay["nbytes"] // a.servers)) as cluster:
        client = await cluster.connect()
        buf = await client.create(NAME, lay["nbytes"], stripe=lay["stripe"])
        # touch every page once so the start RSS includes the buffer itself
        await buf.write(0, np.zeros(lay["nbytes"], np.uint8))
        pids = [cluster.pid(i) for i in range(a.servers)]
        rss_start = [rss(p) for p in pids]
        t0 = time.monotonic()
        cmd = [sys.executable, SELF, "--seconds", str(a.seconds),
               "--procs", str(a.procs), "--clients", str(a.clients), "--region-kib", str(a.region_kib),
               "--acc-words", str(a.acc_words), "--stripe-kib", str(a.stripe_kib), "--seed", str(a.seed)]
        for addr in cluster.addresses:
            cmd += ["--server", addr]
        # results come back in files: a megabyte on a pipe is at the mercy of
        # the pipe's blocking mode, which event loops change
        with tempfile.TemporaryDirectory(prefix="smb2-soak-") as tmp:
            files = [os.path.join(tmp, f"worker-{w}.json") for w in range(a.procs)]
            procs = [await asyncio.create_subprocess_exec(*cmd, "--worker", str(w), "--result", files[w])
                     for w in range(a.procs)]
            codes = [await p.wait() for p in procs]
            elapsed = time.monotonic() - t0
            results = []
            errors: list[str] = []
            for w, f in enumerate(files):
                try:
                    results.append(_load(f))
                except (OSError, ValueError) as exc:
                    errors.append(f"worker {w} exited with {codes[w]} and no result: {exc}")
        ops: dict[str, int] = {}
        verified = moved = 0
        acc = np.zeros(lay["acc_words"], np.int64)
        counter = locked = 0
        for r in results:
            for k, v in r["ops"].items():
                ops[k] = ops.get(k, 0) + v
            verified += r["bytes_verified"]
            moved += r["bytes_moved"]
            errors += r["errors"]
            acc += np.frombuffer(bytes.fromhex(r["acc"]), np.int64)
            counter += r["counter"]
            locked += r["locked"]
        # the shared parts, against the sums of what every client did
        got = (await buf.read(lay["acc_off"], 8 * lay["acc_words"])).view(np.int64)
        if np.array_equal(got, acc):
            verified += acc.nbytes
        else:
            errors.append(f"shared accumulate region: {int((got != acc).sum())} words differ from the sum")
        if (c := await buf.fetch_add(lay["counter_off"], 0)) != counter:
            errors.append(f"shared counter is {c}, the clients added {counter}")
        else:
            verified += 8
        raw = bytes(await buf.read(lay["record_off"], RECORD.size))
        rec = RECORD.unpack(raw)[0]
        if rec != locked or (locked and raw != _record(rec, RECORD.unpack(raw)[1])):
            errors.append(f"locked record says {rec} updates, the clients made {locked}")
        rss_end = [rss(p) for p in pids]
        for i in range(a.servers):
            if cluster.procs[i] is None or cluster.procs[i].proc.returncode is not None:  # type: ignore[union-attr]
                errors.append(f"server {i} died")
    total = sum(ops.values())
    return {"seconds": round(elapsed, 2), "servers": a.servers, "clients": lay["nclients"],
            "client_processes": a.procs, "buffer_bytes": lay["nbytes"], "ops": ops, "ops_total": total,
            "ops_per_s": round(total / elapsed, 1), "bytes_verified": verified, "bytes_moved": moved,
            "lock": locked > 0 or ops.get("locked_update", 0) > 0,
            "errors": len(errors), "error_samples": errors[:20],
            "server_rss_start": rss_start, "server_rss_end": rss_end}


def report(r: dict[str, Any]) -> None:
    print(f"soak: {r['servers']} servers, {r['clients']} clients in {r['client_processes']} processes, "
          f"{r['buffer_bytes'] / MiB:.1f} MiB buffer, {r['seconds']} s")
    print(f"{'op':<16}{'count':>12}{'per s':>12}")
    for k, v in sorted(r["ops"].items()):
        print(f"{k:<16}{v:>12}{v / r['seconds']:>12.1f}")
    print(f"{'total':<16}{r['ops_total']:>12}{r['ops_per_s']:>12.1f}")
    print(f"bytes verified {r['bytes_verified']:,}  moved {r['bytes_moved']:,}  "
          f"locked updates: {'yes' if r['lock'] else 'no lock in this build'}")
    for i, (s, e) in enumerate(zip(r["server_rss_start"], r["server_rss_end"])):
        print(f"server {i} RSS {s / MiB:.1f} MiB -> {e / MiB:.1f} MiB ({(e - s) / MiB:+.1f})")
    print(f"errors: {r['errors']}")
    for e in r["error_samples"]:
        print(f"  {e}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--procs", type=int, default=2, help="client processes")
    p.add_argument("--clients", type=int, default=4, help="clients per process")
    p.add_argument("--region-kib", type=int, default=2048, help="each client's own region")
    p.add_argument("--acc-words", type=int, default=1 << 16, help="int64 words of the shared region")
    p.add_argument("--stripe-kib", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the result here")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--server", action="append", default=[], help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    import uvloop
    if a.worker is not None:
        Path(a.result).write_text(json.dumps(uvloop.run(worker(a))))
        return 0
    r = uvloop.run(drive(a))
    report(r)
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=2))
    return 1 if r["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
