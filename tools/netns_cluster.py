#!/usr/bin/env python3
"""A multi-host smb2 cluster on one machine: every host is a Linux network namespace.

N memory-server hosts and one client host, each its own network namespace with its own
address from 198.18.0.0/15 (the range reserved for benchmarking, RFC 2544), joined by veth
links to one bridge.  Every server's link is rate limited with a ``tc`` token bucket (tbf) in
*both* directions, so that -- as on a real cluster -- each server's NIC, not the shared CPU,
is the bottleneck.  ``smb2-server`` runs in every server namespace; a command (or a Python
function/coroutine) runs in the client namespace with ``SMB2_SERVERS="addr:port,..."``.
Everything is torn down afterwards: on success, on error, on Ctrl-C and on SIGTERM.

Topology (one run, prefix ``smb2-<pid>-<n>``)::

    netns <prefix>-c    eth0 198.18.0.1/24  ── veth ──┐                      (unlimited)
    netns <prefix>-c1.. eth0 198.18.0.2.. (clients=K: more client hosts)
    netns <prefix>-e    eth0 198.18.0.10/24 (etcd=True: the membership service's host)
    netns <prefix>-s0   eth0 198.18.0.11/24 ── veth ──┤  br0 in netns <prefix>-br
    netns <prefix>-s1   eth0 198.18.0.12/24 ── veth ──┤  (ports c, s0, s1, ...)
    ...                                               ┘
    tbf on s<i>'s eth0 (server -> anyone: reads)  and on br's port s<i> (anyone -> server: writes)

Why the bridge lives in its own namespace rather than in the root namespace: then *no*
interface of ours ever exists in the root namespace -- every veth pair is created directly
between the bridge namespace and a host namespace -- so a run cannot collide with the
machine's own interfaces, firewall or sysctls (we switch bridge netfilter off in the bridge
namespace only), two runs cannot collide on link names (only namespace names are global, and
those carry the pid), and deleting the namespaces deletes every link and the bridge with
them: teardown is "kill the processes in our namespaces, delete our namespaces".

Library::

    from netns_cluster import NetnsCluster, can_run
    ok, why = can_run()
    with NetnsCluster(servers=4, rate="1gbit") as c:
        c.servers                                   # ["198.18.0.11:7420", ...]
        c.run_client([sys.executable, "bench.py"])  # CompletedProcess, SMB2_SERVERS set
        p = c.popen_client([...])                   # Popen in the client namespace
        c.run_coroutine(main, c.servers)            # asyncio.run(main(c.servers)) in the client netns

Faults (tools/jepsen.py's nemesis)::

    c.signal_server(i, signal.SIGSTOP)             # pause (SIGCONT resumes)
    c.kill_server(i); c.restart_server(i)          # SIGKILL, then the same command again
    c.cut("s0", "c1"); c.heal()                    # drop all traffic between two hosts (blackhole routes)

With ``etcd=True`` a private etcd runs on its own host and every server gets
``--membership c.membership_url`` (the first view, epoch 1 with every server, written before they start).
        await c.run_coroutine_async(main, c.servers)  # same, awaited from a running loop

CLI::

    python tools/netns_cluster.py --servers 4 --rate 1gbit -- python my_client.py
    python tools/netns_cluster.py --selftest          # 2 stand-in servers: connectivity + rate
    python tools/netns_cluster.py --stand-in --probe --servers 8   # measure the links
    python tools/netns_cluster.py --cleanup           # remove leftovers of dead runs

Needs root, ``ip`` (iproute2 with ``ip netns``) and ``tc``.  Otherwise the CLI says so in one
line and exits 2; the library raises :class:`NotSupported`; :func:`can_run` tells tests why.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import collections
import ctypes
import ipaddress
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "NetnsCluster",
    "NetnsError",
    "NotSupported",
    "ServerStartError",
    "can_run",
    "cleanup",
    "parse_rate",
    "DEFAULT_PORT",
]

# ---------------------------------------------------------------------------------------------
# Constants

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
DEFAULT_SERVER_CMD = ("{smb2_server}", "--host", "{host}", "--port", "{port}", "--capacity", "{capacity}",
                      "--shm", "off")
READY_RE = re.compile(rb"smb2-server listening on (\S+):(\d+)")
NAME_PREFIX = "smb2-"
NAME_RE = re.compile(r"^smb2-(\d+)-(\d+)-(br|c\d*|e|s\d+)$")
LOGDIR_RE = re.compile(r"^smb2-(\d+)-(\d+)-logs")
NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
REPO_ROOT = Path(__file__).resolve().parents[1]
THIS_FILE = Path(__file__).resolve()

_seq = itertools.count()


class NetnsError(RuntimeError):
    """Building, using or tearing down the namespace cluster failed."""


class NotSupported(NetnsError):
    """This machine/user cannot build network namespaces (not root, no ``ip netns``, ...)."""


class ServerStartError(NetnsError):
    """A server did not print its ``smb2-server listening on HOST:PORT`` line in time."""


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM/SIGHUP while a cluster is up (like KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by signal {signal.Signals(signum).name}")
        self.signum = signum


# ---------------------------------------------------------------------------------------------
# Small helpers

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


def _fmt_rate(bits: int | None) -> str:
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _setns_current_thread(netns_name: str) -> None:
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


def _run(
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
    r = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _netns_pids(name: str) -> list[int]:
    r = _run(["ip", "netns", "pids", name], check=False)
    return [int(x) for x in r.stdout.split() if x.isdigit()]


def _kill_netns_processes(name: str, grace: float = 2.0) -> list[int]:
    """SIGTERM every process in netns ``name``, SIGKILL what is left after ``grace`` seconds."""
    me = {os.getpid(), os.getppid()}
    pids = [p for p in _netns_pids(name) if p not in me]
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _pid_alive(p) and p in _netns_pids(name)]
        if pids:
            time.sleep(0.05)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


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
    name = f"{NAME_PREFIX}{os.getpid()}-{next(_seq)}-br"
    try:
        r = _run(["ip", "netns", "add", name], check=False)
        if r.returncode != 0:
            return False, f"`ip netns add` failed: {r.stderr.strip() or r.returncode}"
        try:
            for args in (
                ["ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
                ["ip", "-n", name, "link", "add", "b0", "type", "bridge"],
                ["tc", "-n", name, "qdisc", "add", "dev", "p0", "root",
                 "tbf", "rate", "1gbit", "burst", "131072", "latency", "5ms"],
            ):
                r = _run(args, check=False)
                if r.returncode != 0:
                    return False, f"`{' '.join(args[3:6])}` failed in a test namespace: {r.stderr.strip()}"
        finally:
            _run(["ip", "netns", "del", name], check=False)
    except NotSupported as e:
        return False, str(e)
    return True, "ok"


def default_server_binary() -> str | None:
    """The ``smb2-server`` to run: the repo's ``.venv/bin/smb2-server``, else one on PATH."""
    cand = REPO_ROOT / ".venv" / "bin" / "smb2-server"
    if cand.exists():
        return str(cand)
    return shutil.which("smb2-server")


def stand_in_server_cmd() -> list[str]:
    """A stand-in for ``smb2-server`` built into this file (a TCP sink/source that prints the same
    ready line); used by ``--selftest``/``--stand-in`` and until the real server exists."""
    return [sys.executable, str(THIS_FILE), "_standin",
            "--host", "{host}", "--port", "{port}", "--capacity", "{capacity}"]


# ---------------------------------------------------------------------------------------------
# The cluster


class _Server:
    def __init__(self, index: int, netns: str, addr: str, port: int):
        self.index = index
        self.netns = netns
        self.addr = addr
        self.port = port
        self.proc: subprocess.Popen | None = None
        self.ready = threading.Event()
        self.stdout_tail: collections.deque[bytes] = collections.deque(maxlen=50)
        self.reader: threading.Thread | None = None
        self.stderr_path: Path | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.addr}:{self.port}"

    def stderr_tail(self, limit: int = 2000) -> str:
        try:
            data = self.stderr_path.read_bytes() if self.stderr_path else b""
        except OSError:
            data = b""
        text = data[-limit:].decode(errors="replace").strip()
        return text or "(empty)"


class NetnsCluster:
    """N server hosts + 1 client host as network namespaces with rate-limited links.

    Parameters
    ----------
    servers:       number of memory-server hosts (1..243).
    rate:          per-server link rate, both directions (tc syntax: "1gbit", "200mbit"; None = unlimited).
    client_rate:   client link rate (default None = unlimited; the client link is never the bottleneck).
    burst, latency_ms: tbf bucket size in bytes / queue in ms (default: see :func:`tbf_params`).
    mtu:           link MTU (default 1500; veth still uses 64 KiB TSO super-packets).
    port:          server port (default 7420).
    capacity:      passed to the server as ``--capacity`` (default 512 MiB in bytes).
    server_cmd:    argv list or shell-like string; ``{host} {port} {capacity} {index} {smb2_server}``
                   are substituted.  Default: ``smb2-server --host {host} --port {port} --capacity {capacity}``.
    stand_in:      use the stand-in server built into this file instead of smb2-server.
    server_env:    extra environment for the servers.
    ready_timeout: seconds to wait for every server's ready line.
    start_servers: False builds only the network (no server processes; ``servers`` still lists endpoints).
    quiet:         no progress lines on stderr.
    handle_signals: while up, turn SIGTERM/SIGHUP in the main thread into :class:`Terminated` so
                   ``with`` blocks unwind and tear down (only if no other handler is installed).
    die_with_parent: servers and clients get SIGKILL if the thread that started them dies
                   (PR_SET_PDEATHSIG), so even a SIGKILLed harness leaves no process running (its
                   namespaces stay until ``cleanup()`` / ``--cleanup``).
                   Start the cluster from a thread that outlives it (normally the main thread).
    """

    def __init__(
        self,
        servers: int = 4,
        rate: str | int | None = DEFAULT_RATE,
        *,
        client_rate: str | int | None = None,
        burst: int | None = None,
        latency_ms: float | None = None,
        mtu: int = 1500,
        port: int = DEFAULT_PORT,
        capacity: str | int = DEFAULT_CAPACITY,
        server_cmd: Sequence[str] | str | None = None,
        stand_in: bool = False,
        server_env: Mapping[str, str] | None = None,
        ready_timeout: float = 30.0,
        start_servers: bool = True,
        quiet: bool = False,
        handle_signals: bool = True,
        die_with_parent: bool = True,
        clients: int = 1,
        etcd: bool = False,
    ):
        if not 1 <= servers <= MAX_SERVERS:
            raise ValueError(f"servers must be 1..{MAX_SERVERS}, not {servers}")
        if not 1 <= clients <= MAX_CLIENTS:
            raise ValueError(f"clients must be 1..{MAX_CLIENTS}, not {clients}")
        self.n = servers
        self.rate_bits = parse_rate(rate)
        self.client_rate_bits = parse_rate(client_rate)
        self._burst = burst
        self._latency_ms = latency_ms
        self.mtu = int(mtu)
        self.port = int(port)
        self.capacity = str(capacity)
        if stand_in:
            server_cmd = stand_in_server_cmd()
        elif server_cmd is None:
            server_cmd = list(DEFAULT_SERVER_CMD)
        elif isinstance(server_cmd, str):
            server_cmd = shlex.split(server_cmd)
        self._server_cmd_template = list(server_cmd)
        self.server_env = dict(server_env or {})
        self.ready_timeout = float(ready_timeout)
        self.start_servers = start_servers
        self.quiet = quiet
        self.handle_signals = handle_signals
        self.die_with_parent = die_with_parent

        self.prefix = f"{NAME_PREFIX}{os.getpid()}-{next(_seq)}"
        self.bridge_netns = f"{self.prefix}-br"
        self.client_netns = f"{self.prefix}-c"
        self.client_addr = CLIENT_ADDR
        # host name -> (netns, address): "c", "c1", ..., "e", "s0", ... (what cut() takes)
        self.hosts: dict[str, tuple[str, str]] = {"c": (self.client_netns, CLIENT_ADDR)}
        for k in range(1, clients):
            self.hosts[f"c{k}"] = (f"{self.prefix}-c{k}", str(SUBNET[1 + k]))
        self.etcd = etcd
        if etcd:
            self.hosts["e"] = (f"{self.prefix}-e", ETCD_ADDR)
        self._cuts: set[tuple[str, str]] = set()
        self._servers = [
            _Server(i, f"{self.prefix}-s{i}", str(SUBNET[FIRST_SERVER_HOST + i]), self.port) for i in range(servers)
        ]
        for s in self._servers:
            assert ipaddress.IPv4Address(s.addr) in BENCH_RANGE
            self.hosts[f"s{s.index}"] = (s.netns, s.addr)
        self._created_netns: list[str] = []
        self._clients: list[subprocess.Popen] = []
        self._logdir: Path | None = None
        self._started = False
        self._closed = False
        self._close_lock = threading.Lock()
        self._old_handlers: dict[int, Any] = {}
        self.setup_seconds: float | None = None

    # -- public properties ------------------------------------------------------------------

    @property
    def servers(self) -> list[str]:
        """``["198.18.0.11:7420", ...]`` -- what ``SMB2_SERVERS`` holds, comma-joined."""
        return [s.endpoint for s in self._servers]

    @property
    def server_addrs(self) -> list[str]:
        return [s.addr for s in self._servers]

    @property
    def server_netns(self) -> list[str]:
        return [s.netns for s in self._servers]

    @property
    def client_hosts(self) -> list[str]:
        """The client hosts' names, for ``popen_client(host=...)``: ["c", "c1", ...]."""
        return [h for h in self.hosts if h.startswith("c")]

    @property
    def membership_url(self) -> str | None:
        """The servers' ``--membership`` (None without ``etcd=True``)."""
        return f"etcd://{ETCD_ADDR}:{ETCD_PORTS[0]}/{self.prefix}" if self.etcd else None

    @property
    def netns_names(self) -> list[str]:
        """Every namespace this cluster owns (bridge, clients, etcd, servers)."""
        return [self.bridge_netns, *(netns for netns, _ in self.hosts.values())]

    @property
    def env(self) -> dict[str, str]:
        """``{"SMB2_SERVERS": "addr:port,..."}``."""
        return {"SMB2_SERVERS": ",".join(self.servers)}

    def server_process(self, i: int) -> subprocess.Popen | None:
        """The Popen of server ``i`` (e.g. to kill it in a failure test)."""
        return self._servers[i].proc

    def exec_prefix(self, netns: str | None = None) -> list[str]:
        """``["ip", "netns", "exec", <netns>]`` (default: the client's) to prepend to a command."""
        return ["ip", "netns", "exec", netns or self.client_netns]

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> NetnsCluster:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _log(self, msg: str) -> None:
        if not self.quiet:
            print(f"netns_cluster: {msg}", file=sys.stderr, flush=True)

    def start(self) -> NetnsCluster:
        """Build the network, start the servers and wait until every one is ready.
        On any failure (or Ctrl-C) everything created so far is removed before re-raising."""
        if self._started:
            raise NetnsError("cluster already started")
        ok, why = can_run()
        if not ok:
            raise NotSupported(why)
        self._started = True
        t0 = time.monotonic()
        self._install_signal_handlers()
        atexit.register(self.close)
        try:
            cmd = self._server_argv(0)  # resolve the command before building anything
            self._build_network()
            if self.etcd:
                self._start_etcd()
            if self.start_servers:
                self._start_servers(cmd)
        except BaseException:
            self.close()
            raise
        self.setup_seconds = time.monotonic() - t0
        self._log(f"up in {self.setup_seconds:.2f}s: SMB2_SERVERS={','.join(self.servers)}")
        return self

    def _server_argv(self, i: int) -> list[str]:
        s = self._servers[i]
        binary = ""
        if any("{smb2_server}" in a for a in self._server_cmd_template):
            binary = default_server_binary() or ""
            if not binary:
                raise NetnsError(
                    f"smb2-server not found (neither {REPO_ROOT}/.venv/bin/smb2-server nor on PATH); "
                    "build the project first, or pass server_cmd= / --server-cmd, or stand_in=True / --stand-in"
                )
        fields = dict(host=s.addr, port=s.port, capacity=self.capacity, index=i, smb2_server=binary)
        try:
            argv = [a.format(**fields) for a in self._server_cmd_template]
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"bad server command template {self._server_cmd_template!r}: {e!r}") from None
        if self.membership_url is not None:
            argv += ["--membership", self.membership_url]
        return argv

    def _netns_add(self, name: str) -> None:
        if (NETNS_DIR / name).exists():
            raise NetnsError(f"network namespace {name} already exists (leftover? run --cleanup)")
        _run(["ip", "netns", "add", name])
        self._created_netns.append(name)

    def _batch(self, tool: str, netns: str, lines: list[str]) -> None:
        # one process per namespace and tool instead of one per command: setup stays well under a
        # second even for many servers
        _run([tool, "-n", netns, "-batch", "-"], input="\n".join(lines) + "\n")

    def _tbf(self, dev: str, rate_bits: int) -> str:
        burst, latency = tbf_params(rate_bits, self._burst, self._latency_ms)
        return f"qdisc replace dev {dev} root tbf rate {rate_bits}bit burst {burst} latency {latency:g}ms"

    def _build_network(self) -> None:
        hosts = [(name, netns, addr, None if name.startswith("s") or name == "e" else self.client_rate_bits)
                 for name, (netns, addr) in self.hosts.items() if not name.startswith("s")] + [
            (f"s{s.index}", s.netns, s.addr, self.rate_bits) for s in self._servers
        ]
        self._log(
            f"creating namespaces {self.prefix}-{{br,c,s0..s{self.n - 1}}}: bridge br0, client {self.client_addr} "
            f"({_fmt_rate(self.client_rate_bits)}), {self.n} server(s) "
            f"{self._servers[0].addr}..{self._servers[-1].addr} port {self.port}"
        )
        for name in self.netns_names:
            self._netns_add(name)

        # bridge namespace: the bridge, one veth per host (peer created straight in the host netns)
        br = [
            "link set lo up",
            f"link add br0 mtu {self.mtu} type bridge forward_delay 0 stp_state 0",
            "link set br0 up",
        ]
        for port, netns, _addr, _rate in hosts:
            br += [
                f"link add {port} mtu {self.mtu} type veth peer name eth0 mtu {self.mtu} netns {netns}",
                f"link set {port} master br0",
                f"link set {port} up",
            ]
        self._batch("ip", self.bridge_netns, br)
        # bridged frames need no netfilter; these sysctls are per network namespace (best effort)
        _run(["ip", "netns", "exec", self.bridge_netns, "sysctl", "-q", "-w",
              "net.bridge.bridge-nf-call-iptables=0", "net.bridge.bridge-nf-call-ip6tables=0",
              "net.bridge.bridge-nf-call-arptables=0"], check=False)

        # host namespaces: address, links up; tbf on both ends of each limited link
        br_tc: list[str] = []
        for port, netns, addr, rate in hosts:
            self._batch("ip", netns, ["link set lo up", f"addr add {addr}/{SUBNET.prefixlen} dev eth0",
                                      "link set eth0 up"])
            if rate is not None:
                self._batch("tc", netns, [self._tbf("eth0", rate)])  # host -> network (server: reads)
                br_tc.append(self._tbf(port, rate))  # network -> host (server: writes)
        if br_tc:
            self._batch("tc", self.bridge_netns, br_tc)
        if self.rate_bits is not None:
            burst, latency = tbf_params(self.rate_bits, self._burst, self._latency_ms)
            self._log(
                f"server links: tbf {_fmt_rate(self.rate_bits)} in both directions "
                f"(burst {burst} B, latency {latency:g} ms, mtu {self.mtu})"
            )
        else:
            self._log("server links: unlimited")

    def _spawn_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(stdin=subprocess.DEVNULL, start_new_session=True)
        if self.die_with_parent:
            kw["preexec_fn"] = _pdeathsig_kill
        return kw

    def _start_servers(self, argv0: list[str]) -> None:
        self._logdir = self._logdir or Path(tempfile.mkdtemp(prefix=f"{self.prefix}-logs-"))
        env = dict(os.environ)
        env.update(self.server_env)
        self._log(f"starting {self.n} server(s): {shlex.join(argv0)}")
        for s in self._servers:
            self._spawn_server(s, env)
        self._wait_ready(self._servers)
        self._log(f"{self.n} server(s) ready")

    def _spawn_server(self, s: _Server, env: Mapping[str, str]) -> None:
        assert self._logdir is not None
        argv = self._server_argv(s.index)
        s.stderr_path = self._logdir / f"s{s.index}.stderr"
        s.ready = threading.Event()
        with open(s.stderr_path, "ab") as err:
            s.proc = subprocess.Popen(
                self.exec_prefix(s.netns) + argv, stdout=subprocess.PIPE, stderr=err, env=dict(env),
                **self._spawn_kwargs(),
            )
        s.reader = threading.Thread(target=_drain_stdout, args=(s,), name=f"{s.netns}-stdout", daemon=True)
        s.reader.start()

    def _wait_ready(self, servers: list[_Server]) -> None:
        deadline = time.monotonic() + self.ready_timeout
        for s in servers:
            while not s.ready.wait(0.05):
                rc = s.proc.poll() if s.proc else None
                if rc is not None:
                    if s.reader is not None:
                        s.reader.join(1)  # the ready line may still be in the pipe
                    if s.ready.is_set():
                        break
                    raise ServerStartError(
                        f"server s{s.index} ({s.endpoint}, netns {s.netns}) exited with code {rc} before printing "
                        f"'smb2-server listening on HOST:PORT'; stderr: {s.stderr_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"server s{s.index} ({s.endpoint}, netns {s.netns}) did not print "
                        f"'smb2-server listening on HOST:PORT' within {self.ready_timeout:g}s; "
                        f"stdout: {b''.join(s.stdout_tail).decode(errors='replace').strip() or '(empty)'}; "
                        f"stderr: {s.stderr_tail()}"
                    )
        for s in servers:
            rc = s.proc.poll() if s.proc else None
            if rc is not None:
                raise ServerStartError(
                    f"server s{s.index} ({s.endpoint}, netns {s.netns}) exited with code {rc} right after "
                    f"starting; stderr: {s.stderr_tail()}"
                )

    # -- faults ---------------------------------------------------------------------------------

    def signal_server(self, i: int, sig: int) -> None:
        """Send ``sig`` to server ``i`` (SIGSTOP pauses it, SIGCONT resumes it)."""
        p = self._servers[i].proc
        if p is not None and p.poll() is None:
            p.send_signal(sig)

    def kill_server(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Stop server ``i`` with ``sig`` (default SIGKILL) and wait for it to exit."""
        p = self._servers[i].proc
        if p is not None and p.poll() is None:
            p.send_signal(sig)
            if sig not in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
                p.kill()
            p.wait(10)

    def restart_server(self, i: int) -> None:
        """Start server ``i`` again with its command (after ``kill_server``), wait until ready."""
        self._check_up()
        s = self._servers[i]
        if s.proc is not None and s.proc.poll() is None:
            self.kill_server(i, signal.SIGTERM)
        env = dict(os.environ)
        env.update(self.server_env)
        self._spawn_server(s, env)
        self._wait_ready([s])

    def cut(self, a: str, b: str) -> None:
        """Drop every packet between hosts ``a`` and ``b`` ("c", "c1", "e", "s0", ...): a blackhole
        route to the other on each side (a partition; :meth:`heal` ends it)."""
        if a == b or (min(a, b), max(a, b)) in self._cuts:
            return
        (na, aa), (nb, ab) = self.hosts[a], self.hosts[b]
        _run(["ip", "-n", na, "route", "add", "blackhole", f"{ab}/32"])
        _run(["ip", "-n", nb, "route", "add", "blackhole", f"{aa}/32"])
        self._cuts.add((min(a, b), max(a, b)))

    def heal(self) -> None:
        """End every partition :meth:`cut` made."""
        for a, b in sorted(self._cuts):
            (na, aa), (nb, ab) = self.hosts[a], self.hosts[b]
            _run(["ip", "-n", na, "route", "del", "blackhole", f"{ab}/32"], check=False)
            _run(["ip", "-n", nb, "route", "del", "blackhole", f"{aa}/32"], check=False)
        self._cuts.clear()

    # -- the membership service (etcd=True) -------------------------------------------------------

    def _start_etcd(self) -> None:
        """etcd on host "e"; the first view (every server a member) written before any server starts."""
        from smb2.local_etcd import LocalEtcd
        from smb2.membership import NO_VIEW, MembershipError, open_membership

        self._logdir = self._logdir or Path(tempfile.mkdtemp(prefix=f"{self.prefix}-logs-"))
        netns, addr = self.hosts["e"]
        etcd = LocalEtcd(addr, data_dir=str(self._logdir), client_port=ETCD_PORTS[0], peer_port=ETCD_PORTS[1])
        with open(self._logdir / "etcd.log", "ab") as out:
            self._clients.append(subprocess.Popen(self.exec_prefix(netns) + etcd.command(), stdout=out, stderr=out,
                                                  **self._spawn_kwargs()))
        url = self.membership_url
        assert url is not None

        async def seed() -> None:
            deadline = time.monotonic() + self.ready_timeout
            async with open_membership(url) as m:
                while True:
                    try:
                        await m.change(NO_VIEW, members=self.servers)
                        return
                    except MembershipError:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.1)

        self.run_coroutine(seed)
        self._log(f"etcd on {addr}:{ETCD_PORTS[0]}: {url}, epoch 1")

    def _install_signal_handlers(self) -> None:
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            raise Terminated(signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                if signal.getsignal(sig) in (signal.SIG_DFL, None):
                    self._old_handlers[sig] = signal.signal(sig, handler)
            except (ValueError, OSError):
                pass

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old)
            except (ValueError, OSError):
                pass
        self._old_handlers.clear()

    def close(self) -> None:
        """Stop every process and delete every namespace (with it every link and the bridge).
        Idempotent; safe to call from ``finally``, atexit, or after a failed start."""
        with self._close_lock:
            if self._closed or not self._started:
                return
            self._closed = True
        # A second Ctrl-C during teardown must not leave things half-removed; nor may a second
        # SIGTERM/SIGHUP (`timeout` and `kill -- -PGID` send one to the process AND one to its
        # group, so the second lands while the first is unwinding through this teardown): they are
        # held back and the first of them is raised once everything is gone.
        held: dict[int, Any] = {}
        pending: list[int] = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                try:
                    held[sig] = signal.signal(sig, lambda signum, frame: pending.append(signum))
                except (ValueError, OSError):
                    pass
        try:
            self._teardown()
        finally:
            for signum, old in held.items():
                signal.signal(signum, old)
            self._restore_signal_handlers()
            try:
                atexit.unregister(self.close)
            except Exception:
                pass
        terminations = [s for s in pending if s != signal.SIGINT]
        if terminations and sys.exc_info()[0] is None:
            raise Terminated(terminations[0])

    def _teardown(self) -> None:
        t0 = time.monotonic()
        if self._created_netns:
            self._log(f"tearing down {self.prefix}")
        problems: list[str] = []
        procs = [p for p in self._clients + [s.proc for s in self._servers if s.proc] if p.poll() is None]
        for p in procs:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 3.0
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                try:
                    p.wait(2)
                except subprocess.TimeoutExpired:
                    problems.append(f"pid {p.pid} survived SIGKILL")
        for p in self._clients + [s.proc for s in self._servers if s.proc]:
            for f in (p.stdout, p.stderr, p.stdin):
                if f is not None:
                    try:
                        f.close()
                    except OSError:
                        pass
        # anything else still running inside our namespaces (children of servers, clients started
        # by hand with exec_prefix(), ...)
        for name in reversed(self._created_netns):
            left = _kill_netns_processes(name, grace=1.0)
            if left:
                problems.append(f"SIGKILLed {left} in {name}")
        for name in reversed(self._created_netns):
            r = _run(["ip", "netns", "del", name], check=False)
            if r.returncode != 0 and (NETNS_DIR / name).exists():
                problems.append(f"ip netns del {name}: {r.stderr.strip()}")
        for s in self._servers:
            if s.reader is not None:
                s.reader.join(1)
        if self._logdir is not None:
            shutil.rmtree(self._logdir, ignore_errors=True)
        left_ns = [n for n in self._created_netns if (NETNS_DIR / n).exists()]
        if left_ns:
            problems.append(f"namespaces still present: {left_ns}")
        self._created_netns = [n for n in self._created_netns if n in left_ns]
        for msg in problems:
            print(f"netns_cluster: teardown: {msg}", file=sys.stderr, flush=True)
        self._log(f"torn down in {time.monotonic() - t0:.2f}s" + (" (with problems, see above)" if problems else ""))

    # -- running things in the client namespace ---------------------------------------------

    def _client_env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        e = dict(os.environ)
        e.update(self.env)
        if env:
            e.update(env)
        return e

    def _check_up(self) -> None:
        if not self._started or self._closed:
            raise NetnsError("cluster is not running (use `with NetnsCluster(...) as c:` or c.start())")

    def popen_client(
        self, cmd: Sequence[str], *, env: Mapping[str, str] | None = None, host: str = "c", **popen_kwargs: Any
    ) -> subprocess.Popen:
        """Start ``cmd`` in the client namespace (``host``: another client host, "c1", ...) with
        ``SMB2_SERVERS`` set (plus ``env``).
        The process is terminated at teardown if still running (and, with ``die_with_parent``,
        killed if this thread dies)."""
        self._check_up()
        if self.die_with_parent:
            popen_kwargs.setdefault("preexec_fn", _pdeathsig_kill)
        p = subprocess.Popen(self.exec_prefix(self.hosts[host][0]) + list(cmd), env=self._client_env(env),
                             **popen_kwargs)
        self._clients.append(p)
        return p

    def run_client(
        self, cmd: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None,
        check: bool = False, **run_kwargs: Any,
    ) -> subprocess.CompletedProcess:
        """Run ``cmd`` in the client namespace to completion (``subprocess.run`` semantics:
        ``capture_output=True, text=True`` etc. pass through).  Its exit code is ``.returncode``."""
        self._check_up()
        if run_kwargs.pop("capture_output", False):
            run_kwargs["stdout"] = run_kwargs["stderr"] = subprocess.PIPE
        p = self.popen_client(cmd, env=env, **run_kwargs)
        try:
            out, err = p.communicate(timeout=timeout)
        except BaseException:
            _terminate(p)
            raise
        finally:
            if p in self._clients and p.poll() is not None:
                self._clients.remove(p)
        r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check:
            r.check_returncode()
        return r

    async def start_client_async(
        self, cmd: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> asyncio.subprocess.Process:
        """``asyncio.create_subprocess_exec`` of ``cmd`` in the client namespace."""
        self._check_up()
        return await asyncio.create_subprocess_exec(*self.exec_prefix(), *cmd, env=self._client_env(env), **kwargs)

    async def run_client_async(
        self, cmd: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None, **kwargs: Any
    ) -> int:
        """Run ``cmd`` in the client namespace from a running event loop; returns its exit code.
        On timeout/cancellation the process is terminated and the exception propagates."""
        p = await self.start_client_async(cmd, env=env, **kwargs)
        try:
            return await asyncio.wait_for(p.wait(), timeout)
        except BaseException:
            if p.returncode is None:
                p.terminate()
                try:
                    await asyncio.wait_for(p.wait(), 3)
                except BaseException:
                    p.kill()
            raise

    def call_in_client(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(*args, **kwargs)`` in a fresh thread whose network namespace is the client's
        and return its result (exceptions propagate).  Every socket that thread creates -- e.g.
        by a ``smb2.connect()`` inside ``fn`` -- lives on the client host.  In-process: no
        subprocess, objects go in and out directly.  Only the network namespace changes; the
        process's files, mounts and environment are shared, so ``SMB2_SERVERS`` is *not* set
        here: pass ``c.servers`` explicitly (e.g. ``smb2.connect(c.servers)``)."""
        self._check_up()
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                _setns_current_thread(self.client_netns)
                box["value"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                box["error"] = e

        t = threading.Thread(target=target, name=f"{self.client_netns}-call", daemon=True)
        t.start()
        t.join()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def run_coroutine(
        self, coro_fn: Callable[..., Any], *args: Any, runner: Callable[[Any], Any] = asyncio.run, **kwargs: Any
    ) -> Any:
        """``runner(coro_fn(*args, **kwargs))`` (default ``asyncio.run``; pass ``uvloop.run`` for
        uvloop) on a new event loop in a thread in the client namespace; returns the result.

        For anything measured, pass ``runner=uvloop.run``: on Python 3.11 the stdlib loop's socket
        transport copies every unsent write payload into one growing bytearray, which made smb2
        writes over 8 rate-limited links CPU-bound at 4.9x one server (1.4 client CPU-s/GB)
        where uvloop reaches 7.5x at 0.2 CPU-s/GB (tools/bench_scaleout.py --loop asyncio)."""
        return self.call_in_client(lambda: runner(coro_fn(*args, **kwargs)))

    async def run_coroutine_async(
        self, coro_fn: Callable[..., Any], *args: Any, runner: Callable[[Any], Any] = asyncio.run, **kwargs: Any
    ) -> Any:
        """Await ``coro_fn(*args, **kwargs)`` run on its own loop in the client namespace, from
        a running loop of the caller (which stays in its own namespace and keeps running)."""
        self._check_up()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def done(ok: bool, value: Any) -> None:
            if not fut.done():
                fut.set_result(value) if ok else fut.set_exception(value)

        def target() -> None:
            try:
                _setns_current_thread(self.client_netns)
                v = runner(coro_fn(*args, **kwargs))
                loop.call_soon_threadsafe(done, True, v)
            except BaseException as e:  # noqa: BLE001
                try:
                    loop.call_soon_threadsafe(done, False, e)
                except RuntimeError:
                    pass  # caller's loop is gone

        threading.Thread(target=target, name=f"{self.client_netns}-async", daemon=True).start()
        return await fut

    def leftovers(self) -> dict[str, list]:
        """What of this cluster still exists (empty lists after a clean teardown): namespaces,
        live server/client processes."""
        ns = [n for n in self.netns_names if (NETNS_DIR / n).exists()]
        procs = [p.pid for p in self._clients + [s.proc for s in self._servers if s.proc] if p.poll() is None]
        return {"netns": ns, "processes": procs}


def _pdeathsig_kill() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _drain_stdout(s: _Server) -> None:
    """Read a server's stdout for its whole life (so it can never block on a full pipe); set
    ``ready`` on the ``smb2-server listening on HOST:PORT`` line."""
    assert s.proc is not None and s.proc.stdout is not None
    try:
        for line in s.proc.stdout:
            s.stdout_tail.append(line)
            if not s.ready.is_set() and READY_RE.search(line):
                s.ready.set()
    except (OSError, ValueError):
        pass


def _terminate(p: subprocess.Popen, grace: float = 3.0) -> None:
    if p.poll() is not None:
        return
    try:
        p.terminate()
        p.wait(grace)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    except ProcessLookupError:
        pass


def cleanup(all_runs: bool = False, quiet: bool = False) -> list[str]:
    """Remove namespaces (and the processes in them) and log dirs left behind by runs whose
    process is dead (``all_runs=True``: of every run, also live ones).  Returns what was removed."""
    removed: list[str] = []
    for name in list_netns():
        m = NAME_RE.match(name)
        if not m:
            continue
        pid = int(m.group(1))
        if not all_runs and (pid == os.getpid() or _pid_alive(pid)):
            continue
        killed = _kill_netns_processes(name, grace=1.0)
        _run(["ip", "netns", "del", name], check=False)
        removed.append(name)
        if not quiet:
            extra = f" (killed {len(killed)} process(es) that ignored SIGTERM)" if killed else ""
            print(f"netns_cluster: removed netns {name}{extra}", file=sys.stderr)
    tmp = Path(tempfile.gettempdir())
    for d in tmp.glob(f"{NAME_PREFIX}*-logs-*"):
        m = LOGDIR_RE.match(d.name)
        if m and (all_runs or not _pid_alive(int(m.group(1)))) and int(m.group(1)) != os.getpid():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    return removed


# ---------------------------------------------------------------------------------------------
# Stand-in server and probe client (plain sockets; used by --selftest / --probe)
#
# Wire: 9-byte request op + u64 big-endian n.  b"W": the client sends n bytes, the server answers
# b"K" once it has all of them.  b"R": the server sends n bytes.  b"P": answers b"P" (ping).

CHUNK = 1 << 20


def _standin_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="netns_cluster.py _standin")
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--capacity", default="0")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((a.host, a.port))
    ls.listen(128)
    host, port = ls.getsockname()[:2]
    print(f"smb2-server listening on {host}:{port}", flush=True)
    payload = memoryview(bytearray(os.urandom(64)) * (CHUNK // 64))

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sink = memoryview(bytearray(CHUNK))
        try:
            while True:
                hdr = _recv_exact(conn, 9)
                if hdr is None:
                    return
                op, n = hdr[:1], int.from_bytes(hdr[1:], "big")
                if op == b"P":
                    conn.sendall(b"P")
                elif op == b"W":
                    while n:
                        k = conn.recv_into(sink, min(n, CHUNK))
                        if not k:
                            return
                        n -= k
                    conn.sendall(b"K")
                elif op == b"R":
                    while n:
                        k = min(n, CHUNK)
                        conn.sendall(payload[:k])
                        n -= k
                else:
                    return
        except OSError:
            pass
        finally:
            conn.close()

    while True:
        c, _ = ls.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        b = sock.recv(n - len(buf))
        if not b:
            return None
        buf += b
    return bytes(buf)


def _cpu_times() -> tuple[float, float]:
    with open("/proc/stat") as f:
        v = [float(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v), idle


class _ProbeConn:
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


def _probe_main(argv: list[str]) -> int:
    """Runs in the client namespace: ping every server of $SMB2_SERVERS, then write and read
    ``--mb`` MB to/from each server alone, then to/from all at once.  JSON on stdout."""
    ap = argparse.ArgumentParser(prog="netns_cluster.py _probe")
    ap.add_argument("--mb", type=float, default=50.0)
    ap.add_argument("--no-single", action="store_true")
    ap.add_argument("--no-aggregate", action="store_true")
    a = ap.parse_args(argv)
    endpoints = [e for e in os.environ.get("SMB2_SERVERS", "").split(",") if e]
    if not endpoints:
        print("SMB2_SERVERS is not set", file=sys.stderr)
        return 2
    n = int(a.mb * 1e6)
    conns = [_ProbeConn(e) for e in endpoints]
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

            def worker(c: _ProbeConn, op: str, barrier: threading.Barrier, errors: list[BaseException]) -> None:
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


def _probe(cluster: NetnsCluster, mb: float, single: bool = True, aggregate: bool = True) -> dict[str, Any]:
    cmd = [sys.executable, str(THIS_FILE), "_probe", "--mb", str(mb)]
    if not single:
        cmd.append("--no-single")
    if not aggregate:
        cmd.append("--no-aggregate")
    r = cluster.run_client(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise NetnsError(f"probe client failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout)


def _print_probe(res: dict[str, Any], rate_bits: int | None) -> None:
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


def _selftest(args: argparse.Namespace) -> int:
    """2 stand-in servers: connectivity, per-link rate in both directions, aggregate, teardown."""
    n = args.servers if args.servers_given else 2
    rate = parse_rate(args.rate)
    if rate is None:
        print("netns_cluster: --selftest needs a finite --rate", file=sys.stderr)
        return 2
    mb = args.probe_mb if args.probe_mb_given else max(5.0, min(50.0, rate / 8e6 * 0.4))  # ~0.4 s per transfer
    failures: list[str] = []
    cluster = NetnsCluster(servers=n, rate=args.rate, stand_in=True, quiet=args.quiet, mtu=args.mtu,
                           burst=args.burst, latency_ms=args.latency, port=args.port)
    with cluster as c:
        res = _probe(c, mb)
    _print_probe(res, rate)
    # tbf counts Ethernet+IP+TCP headers (66 B per 1448 B of payload at MTU 1500): ~95.6 % goodput
    lo, hi = 0.80, 1.03
    for s in res["single"]:
        for d in ("write", "read"):
            frac = s[f"{d}_bps"] / rate
            if not lo <= frac <= hi:
                failures.append(f"{s['server']} {d} at {frac:.1%} of the link rate (want {lo:.0%}..{hi:.0%})")
    agg = res["aggregate"]
    for d in ("write", "read"):
        frac = agg[f"{d}_bps"] / (n * rate)
        if frac > hi:
            failures.append(f"aggregate {d} at {frac:.1%} of {n} links: the limit is not applied")
        elif frac < 0.75:
            failures.append(f"aggregate {d} only {frac:.1%} of {n} links (cpu {agg[f'{d}_cpu_busy']:.0%} busy)")
    left = cluster.leftovers()
    ns_left = [x for x in list_netns() if x.startswith(cluster.prefix + "-")]
    if left["netns"] or left["processes"] or ns_left:
        failures.append(f"teardown left {left} {ns_left}")
    if failures:
        for f in failures:
            print(f"netns_cluster: selftest FAILED: {f}", file=sys.stderr)
        return 1
    print(f"netns_cluster: selftest ok ({n} servers at {_fmt_rate(rate)}, {mb:g} MB per transfer; nothing left behind)",
          file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_standin"]:
        return _standin_main(argv[1:])
    if argv[:1] == ["_probe"]:
        return _probe_main(argv[1:])

    ap = argparse.ArgumentParser(
        prog="netns_cluster.py",
        description="Run a command on the client host of an N-server smb2 cluster built from network "
                    "namespaces with rate-limited links (root only). The command sees SMB2_SERVERS.",
        epilog="examples:  netns_cluster.py --servers 4 --rate 1gbit -- python my_client.py\n"
               "           netns_cluster.py --selftest\n"
               "           netns_cluster.py --stand-in --probe --servers 8 --rate 1gbit\n"
               "           netns_cluster.py --cleanup",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--servers", "-n", type=int, default=None, help="number of server hosts (default 4; --selftest: 2)")
    ap.add_argument("--rate", default=DEFAULT_RATE,
                    help="per-server link rate, both directions, tc syntax (default 1gbit; 'none' = unlimited)")
    ap.add_argument("--client-rate", default=None, help="client link rate (default unlimited)")
    ap.add_argument("--burst", type=int, default=None, help="tbf bucket in bytes (default: 2 ms of rate, >= 128 KiB)")
    ap.add_argument("--latency", type=float, default=None, help="tbf queue in ms (default 5)")
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--port", type=int, default=DEFAULT_PORT)
    ap.add_argument("--capacity", default=DEFAULT_CAPACITY,
                    help="passed to every server as --capacity (default %(default)s)")
    ap.add_argument("--server-cmd", default=None,
                    help="server command; {host} {port} {capacity} {index} {smb2_server} are substituted "
                         "(default: '{smb2_server} --host {host} --port {port} --capacity {capacity}')")
    ap.add_argument("--stand-in", action="store_true", help="use the built-in stand-in server (TCP sink/source)")
    ap.add_argument("--ready-timeout", type=float, default=30.0, help="seconds to wait for every server's ready line")
    ap.add_argument("--probe", action="store_true", help="instead of a command, measure every link (needs --stand-in)")
    ap.add_argument("--probe-mb", type=float, default=None,
                    help="MB per transfer for --probe (default 50) / --selftest (default: 0.4 s worth)")
    ap.add_argument("--selftest", action="store_true", help="2 stand-in servers: check connectivity, rate and teardown")
    ap.add_argument("--cleanup", action="store_true", help="remove namespaces/processes left by dead runs, then exit")
    ap.add_argument("--all", action="store_true", help="with --cleanup: also of runs that are still alive")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command to run in the client namespace")
    args = ap.parse_args(argv)
    args.servers_given = args.servers is not None
    args.probe_mb_given = args.probe_mb is not None
    if args.probe_mb is None:
        args.probe_mb = 50.0
    if args.servers is None:
        args.servers = 4
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    try:
        parse_rate(args.rate)
        parse_rate(args.client_rate)
    except ValueError as e:
        ap.error(str(e))

    ok, why = can_run()
    if not ok:
        print(f"netns_cluster: cannot build a namespace cluster here: {why}", file=sys.stderr)
        return 2
    if args.cleanup:
        removed = cleanup(all_runs=args.all, quiet=args.quiet)
        if not args.quiet:
            print(f"netns_cluster: cleanup removed {len(removed)} item(s)", file=sys.stderr)
        return 0
    if args.selftest:
        return _selftest(args)
    if args.probe:
        if not args.stand_in and args.server_cmd is None:
            ap.error("--probe speaks the stand-in server's protocol: add --stand-in")
    elif not cmd:
        ap.error("give a command after --, or --probe / --selftest / --cleanup")

    cluster = NetnsCluster(
        servers=args.servers, rate=args.rate, client_rate=args.client_rate, burst=args.burst,
        latency_ms=args.latency, mtu=args.mtu, port=args.port, capacity=args.capacity,
        server_cmd=args.server_cmd, stand_in=args.stand_in, ready_timeout=args.ready_timeout, quiet=args.quiet,
    )
    proc: subprocess.Popen | None = None
    try:
        with cluster as c:
            if args.probe:
                res = _probe(c, args.probe_mb)
                _print_probe(res, c.rate_bits)
                json.dump(res, sys.stdout)
                print()
                return 0
            c._log(f"running in {c.client_netns}: {shlex.join(cmd)}")
            # the client stays in our process group: Ctrl-C reaches it as it would without us
            proc = c.popen_client(cmd)
            rc = proc.wait()
            c._log(f"client exited with code {rc}")
            return rc
    except KeyboardInterrupt:
        print("netns_cluster: interrupted; torn down", file=sys.stderr)
        return 130
    except Terminated as e:
        print(f"netns_cluster: {e}; torn down", file=sys.stderr)
        return 128 + e.signum
    except NotSupported as e:
        print(f"netns_cluster: cannot build a namespace cluster here: {e}", file=sys.stderr)
        return 2
    except (NetnsError, ValueError) as e:
        print(f"netns_cluster: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
