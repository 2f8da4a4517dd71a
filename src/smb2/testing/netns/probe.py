"""The probe: from the client host, ping every stand-in server of ``$SMB2_SERVERS``, then
write and read to and from each alone and all at once (JSON on stdout); :func:`probe` runs it
in a cluster and :func:`print_probe` says it against the link rate."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from typing import Any

from .errors import NetnsError
from .hosts import NetnsCluster
from .standin import CHUNK


def _cpu_times() -> tuple[float, float]:
    with open("/proc/stat") as f:
        v = [float(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v), idle


class ProbeConn:
    """One connection to a stand-in server: ``ping()`` (seconds), ``write(n)``, ``read(n)``."""

    def __init__(self, endpoint: str):
        host, port = endpoint.rsplit(":", 1)
        self.endpoint = endpoint
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.out = memoryview(bytearray(CHUNK))
        self.inb = memoryview(bytearray(CHUNK))

    def ping(self) -> float:
        t = time.perf_counter()
        self.sock.sendall(b"P" + (0).to_bytes(8, "big"))
        if self.sock.recv(1) != b"P":
            raise RuntimeError(f"{self.endpoint}: bad ping reply")
        return time.perf_counter() - t

    def write(self, n: int) -> None:
        self.sock.sendall(b"W" + n.to_bytes(8, "big"))
        left = n
        while left:
            k = min(left, CHUNK)
            self.sock.sendall(self.out[:k])
            left -= k
        if self.sock.recv(1) != b"K":
            raise RuntimeError(f"{self.endpoint}: bad write ack")

    def read(self, n: int) -> None:
        self.sock.sendall(b"R" + n.to_bytes(8, "big"))
        left = n
        while left:
            k = self.sock.recv_into(self.inb, min(left, CHUNK))
            if not k:
                raise RuntimeError(f"{self.endpoint}: connection closed during read")
            left -= k


def main(argv: list[str] | None = None) -> int:
    """Runs in the client namespace: ping every server of $SMB2_SERVERS, then write and read
    ``--mb`` MB to/from each server alone, then to/from all at once.  JSON on stdout."""
    ap = argparse.ArgumentParser(prog="python -m smb2.testing.netns.probe")
    ap.add_argument("--mb", type=float, default=50.0)
    ap.add_argument("--no-single", action="store_true")
    ap.add_argument("--no-aggregate", action="store_true")
    a = ap.parse_args(argv)
    endpoints = [e for e in os.environ.get("SMB2_SERVERS", "").split(",") if e]
    if not endpoints:
        print("SMB2_SERVERS is not set", file=sys.stderr)
        return 2
    n = int(a.mb * 1e6)
    conns = [ProbeConn(e) for e in endpoints]
    out: dict[str, Any] = {"servers": endpoints, "bytes": n}
    out["rtt_us"] = [round(sorted(c.ping() for _ in range(21))[10] * 1e6, 1) for c in conns]
    for c in conns:  # warm up: ARP, TCP windows
        c.write(1 << 20)
        c.read(1 << 20)
    if not a.no_single:
        single = []
        for c in conns:
            t = time.perf_counter()
            c.write(n)
            tw = time.perf_counter() - t
            t = time.perf_counter()
            c.read(n)
            tr = time.perf_counter() - t
            single.append({"server": c.endpoint, "write_bps": 8 * n / tw, "read_bps": 8 * n / tr})
        out["single"] = single
    if not a.no_aggregate:
        agg: dict[str, Any] = {}
        for op in ("write", "read"):
            barrier = threading.Barrier(len(conns) + 1)
            errors: list[BaseException] = []

            def worker(c: ProbeConn, op: str, barrier: threading.Barrier, errors: list[BaseException]) -> None:
                barrier.wait()
                try:
                    getattr(c, op)(n)
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

            threads = [threading.Thread(target=worker, args=(c, op, barrier, errors)) for c in conns]
            for th in threads:
                th.start()
            cpu0 = _cpu_times()
            pt = time.process_time()
            t = time.perf_counter()
            barrier.wait()
            for th in threads:
                th.join()
            dt = time.perf_counter() - t
            pt = time.process_time() - pt
            cpu1 = _cpu_times()
            if errors:
                raise errors[0]
            total, idle = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
            agg[f"{op}_bps"] = 8 * n * len(conns) / dt
            agg[f"{op}_cpu_busy"] = round(1 - idle / total, 3) if total > 0 else None  # whole machine
            agg[f"{op}_client_cpu_s_per_GB"] = round(pt / (n * len(conns) / 1e9), 3)  # this process
        out["aggregate"] = agg
    json.dump(out, sys.stdout)
    print()
    return 0


def probe(cluster: NetnsCluster, mb: float, single: bool = True, aggregate: bool = True) -> dict[str, Any]:
    cmd = [sys.executable, "-m", __name__, "--mb", str(mb)]
    if not single:
        cmd.append("--no-single")
    if not aggregate:
        cmd.append("--no-aggregate")
    r = cluster.run_client(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise NetnsError(f"probe client failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout)


def print_probe(res: dict[str, Any], rate_bits: int | None) -> None:
    def g(x: float) -> str:
        s = f"{x / 1e6:8.1f} Mbit/s"
        if rate_bits:
            s += f" ({x / rate_bits:5.1%} of link)"
        return s

    p = lambda *a: print(*a, file=sys.stderr)  # noqa: E731
    p(f"  rtt (median of 21 pings): {', '.join(f'{x:g} us' for x in res['rtt_us'])}")
    for s in res.get("single", []):
        p(f"  {s['server']:>19}  client->server (write) {g(s['write_bps'])}   server->client (read) {g(s['read_bps'])}")
    agg = res.get("aggregate")
    if agg:
        k = len(res["servers"])
        ideal = k * rate_bits if rate_bits else None

        def ga(x: float) -> str:
            s = f"{x / 1e6:8.1f} Mbit/s"
            if ideal:
                s += f" ({x / ideal:5.1%} of {k} links)"
            return s

        for d in ("write", "read"):
            p(f"  aggregate over {k} server(s): {d:5} {ga(agg[f'{d}_bps'])}   "
              f"[machine cpu {agg[f'{d}_cpu_busy']:.0%} busy, client {agg[f'{d}_client_cpu_s_per_GB']:.2f} cpu-s/GB]")


if __name__ == "__main__":
    sys.exit(main())
