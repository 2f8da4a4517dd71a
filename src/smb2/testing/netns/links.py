"""The network: namespaces as hosts, their addresses (198.18.0.0/15, reserved for
benchmarking: RFC 2544), veth links and ``tc`` token buckets, ``ip``/``tc`` runs, and
:func:`can_run`, which tries all of it once in a scratch namespace."""

from __future__ import annotations

import ctypes
import ipaddress
import itertools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from ..launch import server_command
from .errors import NetnsError, NotSupported

BENCH_RANGE = ipaddress.IPv4Network("198.18.0.0/15")  # RFC 2544 benchmarking range: the only one
SUBNET = ipaddress.IPv4Network("198.18.0.0/24")
assert SUBNET.subnet_of(BENCH_RANGE)
CLIENT_ADDR = str(SUBNET[1])  # 198.18.0.1; more client hosts are .2, .3, ...
MAX_CLIENTS = 8
ETCD_ADDR = str(SUBNET[10])  # 198.18.0.10
ETCD_PORTS = (2379, 2380)
FIRST_SERVER_HOST = 11  # servers are 198.18.0.11, .12, ...
MAX_SERVERS = 254 - FIRST_SERVER_HOST  # 243
DEFAULT_PORT = 7420
DEFAULT_RATE = "1gbit"
DEFAULT_CAPACITY = "512MiB"  # per server; smb2-server takes 512MiB, 8GiB, or bytes
# --shm off: each namespace stands in for another host, whose memory a client could not map
# (the namespaces share this kernel and file system, so shm would bypass the rate-limited links)
DEFAULT_SERVER_CMD = tuple(server_command("--port", "{port}", "--capacity", "{capacity}", "--shm", "off",
                                          host="{host}", port=None))


NAME_PREFIX = "smb2-"
NAME_RE = re.compile(r"^smb2-(\d+)-(\d+)-(br|c\d*|e|s\d+)$")
LOGDIR_RE = re.compile(r"^smb2-(\d+)-(\d+)-logs")
NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000

_runs = itertools.count()


def next_run() -> int:
    """The number of this process's next run (its names' prefix is ``smb2-<pid>-<n>``)."""
    return next(_runs)


_RATE_UNITS = {
    # tc semantics: "bit" suffixes are bits/s, "bps" suffixes are BYTES/s; k = 1000
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
}


def parse_rate(rate: str | int | float | None) -> int | None:
    """``"1gbit"`` -> 1_000_000_000 (bits/s); ``None``/``"none"``/``"unlimited"``/0 -> None.

    Units follow tc: kbit/mbit/gbit are bits per second, kbps/mbps/gbps BYTES per second,
    a bare number is bits per second.
    """
    if rate is None:
        return None
    if isinstance(rate, (int, float)):
        return int(rate) if rate > 0 else None
    s = rate.strip().lower()
    if s in ("", "none", "unlimited", "off", "0"):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", s)
    if not m or (m.group(2) or "bit") not in _RATE_UNITS:
        raise ValueError(f"bad rate {rate!r}: use e.g. 1gbit, 200mbit, 500kbit (bits/s) or 100mbps (bytes/s)")
    bits = float(m.group(1)) * _RATE_UNITS[m.group(2) or "bit"]
    if bits < 8000:
        raise ValueError(f"rate {rate!r} is below 8 kbit/s")
    return int(bits)


def format_rate(bits: int | None) -> str:
    if bits is None:
        return "unlimited"
    for unit, f in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= f:
            return f"{bits / f:g} {unit}"
    return f"{bits} bit/s"


def tbf_params(rate_bits: int, burst: int | None = None, latency_ms: float | None = None) -> tuple[int, float]:
    """Burst (bytes) and queue latency (ms) for a token bucket at ``rate_bits``.

    burst: 2 ms worth of tokens, at least 128 KiB.  veth does TSO/GSO, so packets reach the qdisc
    as up to 64 KiB super-packets; a bucket smaller than one of them would make tbf segment every
    packet in software (CPU the benchmark must not spend) -- 128 KiB holds two.  At 1 Gbit/s
    that is 250 kB, i.e. a start-up burst that is 0.5 % of a 50 MB transfer.
    latency: 5 ms of queue (the qdisc limit is rate*latency + burst; at 1 Gbit/s about 875 kB),
    which is a few switch-port buffers -- deep enough that several TCP flows into one port
    keep it busy without drops, shallow enough not to be bufferbloat.
    """
    bps = rate_bits / 8
    if burst is None:
        burst = max(int(bps * 0.002), 128 * 1024)
    if latency_ms is None:
        latency_ms = 5.0
    return int(burst), float(latency_ms)



def enter_netns(netns_name: str) -> None:
    """Move the calling *thread* into network namespace ``netns_name`` (sockets made after this
    by this thread live there).  Allowed in a multi-threaded process for CLONE_NEWNET."""
    fd = os.open(NETNS_DIR / netns_name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if hasattr(os, "setns"):  # Python >= 3.12
            os.setns(fd, CLONE_NEWNET)
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns({netns_name}): {os.strerror(err)}")
    finally:
        os.close(fd)


def run_tool(
    args: Sequence[str], *, check: bool = True, input: str | None = None, timeout: float = 30
) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(list(args), capture_output=True, text=True, input=input, timeout=timeout)
    except FileNotFoundError as e:
        raise NotSupported(f"{args[0]} not found: {e}") from None
    if check and r.returncode != 0:
        detail = (r.stderr or r.stdout).strip().replace("\n", " | ")
        cmd = " ".join(args[:6]) + (" ..." if len(args) > 6 else "")
        raise NetnsError(f"`{cmd}` failed (exit {r.returncode}): {detail}")
    return r


def list_netns() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    r = run_tool(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]



_can_run_cache: tuple[bool, str] | None = None


def can_run(refresh: bool = False) -> tuple[bool, str]:
    """``(True, "ok")`` if this process can build a cluster, else ``(False, reason)``.

    Not just "am I root": it really creates a namespace with a veth pair and a tbf qdisc (about
    30 ms) and removes it again, so containers without CAP_NET_ADMIN or without the veth/tbf
    kernel modules are detected too.  Cached per process.
    """
    global _can_run_cache
    if _can_run_cache is not None and not refresh:
        return _can_run_cache
    _can_run_cache = _can_run()
    return _can_run_cache


def _can_run() -> tuple[bool, str]:
    if sys.platform != "linux":
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, f"needs root to create network namespaces (running as uid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) not found on PATH"
    name = f"{NAME_PREFIX}{os.getpid()}-{next_run()}-br"
    try:
        r = run_tool(["ip", "netns", "add", name], check=False)
        if r.returncode != 0:
            return False, f"`ip netns add` failed: {r.stderr.strip() or r.returncode}"
        try:
            for args in (
                ["ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
                ["ip", "-n", name, "link", "add", "b0", "type", "bridge"],
                ["tc", "-n", name, "qdisc", "add", "dev", "p0", "root",
                 "tbf", "rate", "1gbit", "burst", "131072", "latency", "5ms"],
            ):
                r = run_tool(args, check=False)
                if r.returncode != 0:
                    return False, f"`{' '.join(args[3:6])}` failed in a test namespace: {r.stderr.strip()}"
        finally:
            run_tool(["ip", "netns", "del", name], check=False)
    except NotSupported as e:
        return False, str(e)
    return True, "ok"
