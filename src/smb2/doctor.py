"""``smb2 doctor [SERVERS]``: the preflight a user runs before a job.

It looks at this machine (RDMA devices and their ports, the RoCE v2 GID a
queue pair would use, the memlock limit against the memory RDMA must
register, the token, versions) and at each server (reachable, the transport
``auto`` would take and why, its clock against ours, its version), and names
every problem it finds: the exit status is 1 when it found one, and 2 when
it was given no server to check (a preflight that checked nothing must not
pass).  It is the place that says why RDMA is not used, where a job would
fall back quietly.  It reads its servers as every command does
(:func:`smb2.serverlist.from_args`), and refuses a list that names one
server process twice (two names reaching one process).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import platform
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from . import auth, rdma_device, serverlist
from .errors import Smb2Error, TransportError
from .membership import answers_without_credentials
from .protocol import VERSION, parse_address, parse_size
from .transport.choose import rdma_unavailable_reason, why_tcp
from .transport.shm import ShmTransport
from .transport.tcp import TcpTransport

SYSFS = "/sys/class/infiniband"
# a server clock further off than this confuses the logs of a job, and
# lock leases are measured on each server's own clock: say so
CLOCK_TOLERANCE = 1.0
# --wait: seconds between tries at a server not reachable yet
WAIT_RETRY = 0.5


@dataclass
class ServerReport:
    address: str
    reachable: bool = False
    error: str | None = None
    transport: str | None = None
    why: str | None = None
    version: str | None = None
    protocol_version: int | None = None
    server_id: str | None = None
    capacity: int | None = None
    used: int | None = None
    auth: str | None = None
    clock_offset_s: float | None = None
    round_trip_s: float | None = None
    membership: str | None = None
    # the server's caps and what it sized them from (stat's "limits"), and
    # its RDMA peers: held now and refused so far
    limits: dict[str, Any] = field(default_factory=dict)
    connections: int | None = None
    rdma_connections: int | None = None
    rdma_refused: int | None = None
    rdma_staging_lent: int | None = None


@dataclass
class Report:
    versions: dict[str, str] = field(default_factory=dict)
    rdma: dict[str, Any] = field(default_factory=dict)
    memlock: dict[str, Any] = field(default_factory=dict)
    token: str = "none"
    servers: list[ServerReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def rdma_devices() -> list[dict[str, Any]]:
    """Every RDMA device's ports as the kernel lists them (sysfs): state,
    link layer and the RoCE v2 GIDs that carry an address."""
    try:
        names = sorted(os.listdir(SYSFS))
    except OSError:
        return []
    devices = []
    for name in names:
        ports = []
        for port in sorted(os.listdir(f"{SYSFS}/{name}/ports")):
            base = f"{SYSFS}/{name}/ports/{port}"
            v2 = []
            for index in sorted(os.listdir(f"{base}/gids"), key=int) if os.path.isdir(f"{base}/gids") else []:
                gid = _read(f"{base}/gids/{index}")
                if gid and gid.strip("0:") and "v2" in _read(f"{base}/gid_attrs/types/{index}").lower():
                    v2.append({"index": int(index), "gid": gid})
            ports.append({"port": int(port), "state": _read(f"{base}/state"),
                          "link_layer": _read(f"{base}/link_layer"), "roce_v2_gids": v2})
        devices.append({"device": name, "ports": ports})
    return devices


def check_rdma(report: Report, want_rdma: bool) -> str | None:
    """Fill report.rdma; returns why this process cannot use RDMA, or None."""
    reason = rdma_unavailable_reason()
    report.rdma = {"devices": rdma_devices(), "usable": reason is None}
    if reason is not None:
        report.rdma["reason"] = f"no RDMA device: {reason}"
        if want_rdma:
            report.problems.append(f"--transport rdma, but no RDMA device: {reason}")
        return reason
    dev = rdma_device.get_device()
    chosen = dev.describe()
    report.rdma["chosen"] = chosen
    if dev.ethernet:
        gid_type = _read(f"{SYSFS}/{dev.name}/ports/{dev.port}/gid_attrs/types/{dev.gid_index}")
        chosen["gid_type"] = gid_type
        if "v2" not in gid_type.lower():
            report.problems.append(
                f"{dev.name} port {dev.port} uses GID {dev.gid_index} ({gid_type or 'type unknown'}), not a "
                "RoCE v2 GID: RoCE v1 does not cross IP routers (configure an IP address on the netdev, "
                "or set SMB2_RDMA_GID_INDEX)")
    return None


def check_memlock(report: Report, capacity: int | None, rdma_reason: str | None) -> None:
    """The memlock limit against the memory RDMA would register."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = soft == resource.RLIM_INFINITY
    report.memlock = {"limit": "unlimited" if unlimited else soft, "to_register": capacity}
    if rdma_reason is not None:
        report.memlock["note"] = "not needed: no RDMA here"
    elif capacity is not None and not unlimited and soft < capacity:
        report.problems.append(
            f"memlock limit {soft} bytes is below the {capacity} bytes RDMA must register: "
            "raise it (ulimit -l unlimited, or LimitMEMLOCK=infinity in a systemd unit)")


async def check_server(address: str, token: bytes | None, rdma_reason: str | None,
                       timeout: float, wait: float = 0.0, kind: str = "auto") -> ServerReport:
    """Connect over TCP, say which transport ``kind`` would take, read the
    server's stat and its clock.  A server that cannot be reached yet is
    tried again for up to ``wait`` seconds (a job's servers still starting);
    one that refuses the token is not."""
    rep = ServerReport(address)
    deadline = time.monotonic() + wait
    while True:
        try:
            transport = await TcpTransport.connect(parse_address(address), timeout=timeout, token=token)
            break
        except TransportError as exc:
            if time.monotonic() >= deadline:
                rep.error = exc.message
                return rep
            await asyncio.sleep(min(WAIT_RETRY, max(0.0, deadline - time.monotonic())))
        except Smb2Error as exc:
            rep.error = exc.message
            return rep
    try:
        rep.reachable = True
        info = transport.server_info
        t0 = time.time()
        stat = await asyncio.wait_for(transport.control({"cmd": "stat"}), timeout)
        t1 = time.time()
        rep.transport, rep.why = await transport_taken(transport, kind, rdma_reason, timeout)
    except (Smb2Error, TimeoutError) as exc:
        rep.error = f"stat failed: {exc.message if isinstance(exc, Smb2Error) else exc}"
        return rep
    finally:
        await transport.close()
    rep.round_trip_s = round(t1 - t0, 6)
    if isinstance(stat.get("time"), float):
        # the server read its clock somewhere in the round trip: the middle
        rep.clock_offset_s = round(stat["time"] - (t0 + t1) / 2, 6)
    rep.version = stat.get("package_version")
    rep.protocol_version = info.get("version")
    rep.server_id = stat.get("server_id")
    rep.capacity = stat.get("capacity")
    rep.used = stat.get("used")
    rep.auth = stat.get("auth")
    rep.membership = info.get("membership")
    rep.limits = stat.get("limits") or {}
    rep.connections = stat.get("connections")
    rep.rdma_connections = stat.get("rdma_connections")
    rep.rdma_refused = stat.get("rdma_refused")
    rep.rdma_staging_lent = stat.get("rdma_staging_lent")
    return rep


def limits_line(s: ServerReport) -> str:
    """A server's caps in words: connections held of the most it takes,
    RDMA peers likewise (and how many were sent to TCP), what the defaults
    were sized from."""
    lim = s.limits
    if not lim:
        return "limits: not reported (a server older than this client)"
    text = (f"limits: {s.connections}/{lim.get('max_connections')} connections "
            f"({lim.get('max_connections_per_host')} per host), {s.rdma_connections}/"
            f"{lim.get('max_rdma_connections')} RDMA peers ({s.rdma_staging_lent}/{lim.get('rdma_staging_areas')} "
            "staging areas lent)")
    if s.rdma_refused:
        text += f" ({s.rdma_refused} refused RDMA, on TCP instead: raise --max-rdma-connections)"
    text += f", {lim.get('max_buffers')} buffers, listen backlog {lim.get('listen_backlog')}"
    if "fd_limit" in lim:
        text += (f"; sized from file limit {lim['fd_limit']} and memory {int(lim['memory']) >> 20} MiB "
                 f"(connections bound by the {lim.get('connections_bound_by')})")
    return text


async def check_etcd(report: Report, timeout: float) -> None:
    """A replicated cluster's etcd must refuse whoever lacks the servers'
    credentials (docs/reliability.md, "Who can change the view").  One that
    this host cannot reach is not a problem: only the servers talk to it."""
    for url in sorted({r.membership for r in report.servers if r.membership}):
        try:
            open_to_all = await asyncio.wait_for(answers_without_credentials(url), timeout)
        except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError, Smb2Error):
            continue
        if open_to_all:
            report.problems.append(
                f"the cluster's etcd ({url}) answers without credentials: anyone who reaches it can change "
                "the membership view and make replicated buffers unreadable; turn its authentication on with "
                "`smb2 etcd-setup URL --peer-token-file FILE` (the servers' peer token) before the servers start")


async def transport_taken(transport: TcpTransport, kind: str, rdma_reason: str | None,
                          timeout: float) -> tuple[str, str | None]:
    """The transport a client asking for ``kind`` would take to this
    server, as open_transport chooses it (``auto``: shm where the server is
    on this host and hands us its segments, else RDMA, else TCP), and why
    not a faster one (None: nothing to say)."""
    if kind == "tcp":
        return "tcp", "asked for"
    if kind == "rdma":
        why = why_tcp(rdma_reason, transport.server_info)
        return ("tcp", why) if why is not None else ("rdma", None)
    try:
        shm = await ShmTransport.upgrade(transport, timeout=timeout)
    except TransportError as exc:
        shm_reason = exc.message
        if kind == "shm":
            return "none", f"no shm: {shm_reason}"
    else:
        # the hand-out worked; the caller closes the connection under it
        return "shm", f"same host: segments mapped from {shm.socket_path}"
    why = why_tcp(rdma_reason, transport.server_info)
    if why is None:
        return "rdma", None
    return "tcp", f"no shm: {shm_reason}; no RDMA: {why}"


async def diagnose(servers: list[str], *, transport: str = "auto", token: bytes | None = None,
                   token_source: str = "none", capacity: int | None = None,
                   timeout: float = 5.0, wait: float = 0.0) -> Report:
    """Everything ``smb2 doctor`` checks, as a Report (``problems`` empty: all well).
    ``wait``: seconds to keep trying servers not reachable yet."""
    report = Report(token=token_source)
    report.versions = {"smb2": _version("smb2"), "protocol": str(VERSION), "python": platform.python_version(),
                       **{p: _version(p) for p in ("numpy", "uvloop", "msgpack", "torch")}}
    rdma_reason = check_rdma(report, want_rdma=transport == "rdma")
    report.servers = list(await asyncio.gather(
        *(check_server(s, token, rdma_reason, timeout, wait, transport) for s in servers)))
    twice = serverlist.listed_twice((r.address, r.server_id) for r in report.servers if r.reachable)
    if twice is not None:
        report.problems.append(twice.message)
    for rep in report.servers:
        if not rep.reachable or rep.error:
            report.problems.append(f"{rep.address}: {rep.error}")
            continue
        if transport == "rdma" and rep.transport == "tcp":
            report.problems.append(f"{rep.address}: --transport rdma, but it would get TCP: {rep.why}")
        if transport == "shm" and rep.transport != "shm":
            report.problems.append(f"{rep.address}: --transport shm, but {rep.why}")
        if rep.clock_offset_s is not None and abs(rep.clock_offset_s) > CLOCK_TOLERANCE:
            report.problems.append(f"{rep.address}: its clock is {rep.clock_offset_s:+.3f} s off this "
                                   "machine's (run NTP/chrony on both)")
        if rep.protocol_version != VERSION:
            report.problems.append(f"{rep.address}: speaks protocol {rep.protocol_version}, this smb2 {VERSION}")
        if rep.rdma_refused:
            report.problems.append(
                f"{rep.address}: refused RDMA to {rep.rdma_refused} clients at its maximum of "
                f"{rep.limits.get('max_rdma_connections')} RDMA connections; they run over TCP, several times "
                "slower: raise --max-rdma-connections on that server where its memory allows")
    await check_etcd(report, timeout)
    if capacity is None:
        # a server on this machine registers its capacity; a client what it
        # reads into: the largest server is the bound to check
        capacity = max((r.capacity for r in report.servers if r.capacity), default=None)
    check_memlock(report, capacity, rdma_reason)
    return report


def as_table(report: Report) -> str:
    rows = [("smb2", ", ".join(f"{k} {v}" for k, v in report.versions.items()))]
    rdma = report.rdma
    for dev in rdma.get("devices", []):
        for port in dev["ports"]:
            gids = ", ".join(f"{g['index']}={g['gid']}" for g in port["roce_v2_gids"]) or "none"
            rows.append((f"rdma {dev['device']}/{port['port']}",
                         f"{port['state']} ({port['link_layer']}), RoCE v2 GIDs: {gids}"))
    if "chosen" in rdma:
        c = rdma["chosen"]
        rows.append(("rdma", f"usable: {c['device']} port {c['port']}, GID {c['gid_index']} {c['gid']} "
                             f"{c.get('gid_type', '')}".rstrip()))
    else:
        rows.append(("rdma", rdma.get("reason", "?")))
    ml = report.memlock
    rows.append(("memlock", f"{ml['limit']} (to register: {ml['to_register'] or 'unknown'})"
                            + (f"; {ml['note']}" if "note" in ml else "")))
    rows.append(("token", report.token))
    for s in report.servers:
        if not s.reachable or s.error:
            rows.append((s.address, f"UNREACHABLE: {s.error}"))
            continue
        clock = f"{s.clock_offset_s:+.3f} s" if s.clock_offset_s is not None else "unknown"
        rows.append((s.address, f"{s.transport}" + (f" ({s.why})" if s.why else "")
                     + f"; clock {clock}; smb2 {s.version}, protocol {s.protocol_version}; "
                       f"{s.used}/{s.capacity} bytes used; auth {s.auth or 'none'}"))
        rows.append(("", limits_line(s)))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines += [f"PROBLEM: {p}" for p in report.problems] or [
        "no problems found on this machine; no server was checked" if not report.servers else "no problems found"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="smb2 doctor", description="check this machine and the servers "
                                "before a job; exit 1 on a problem it can name")
    serverlist.add_arguments(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--transport", choices=("auto", "tcp", "rdma", "shm"),
                   default=os.environ.get("SMB2_TRANSPORT", "").strip() or "auto",
                   help="what the job will ask for: with rdma (or shm), a server it cannot be had with is a "
                   "problem (default: $SMB2_TRANSPORT, as a client reads it, else auto)")
    p.add_argument("--auth-token-file", metavar="FILE", help=f"the token (default: ${auth.ENV})")
    p.add_argument("--capacity", help="memory RDMA will register here, e.g. 8GiB (default: the "
                   "largest server's capacity)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per server (default 5)")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="keep trying servers not reachable yet for up to SECONDS: a job's servers still "
                   "starting (default 0: try once)")
    args = p.parse_args(argv)
    try:
        if args.auth_token_file:
            token: bytes | None = auth.token_from_file(args.auth_token_file)
            source = f"found in {args.auth_token_file}"
        else:
            token = auth.token_from_env()
            source = f"found in ${auth.ENV}" if token else f"none (${auth.ENV} unset)"
        capacity = parse_size(args.capacity) if args.capacity else None
        servers = serverlist.from_args(args)
    except (Smb2Error, OSError) as exc:
        print(f"smb2 doctor: {exc}", file=sys.stderr)
        return 2
    report = asyncio.run(diagnose(servers, transport=args.transport, token=token, token_source=source,
                                  capacity=capacity, timeout=args.timeout, wait=args.wait))
    if args.json:
        print(json.dumps(asdict(report), indent=2, sort_keys=True))
    else:
        print(as_table(report))
    if not servers:
        print("smb2 doctor: no server to check: checked this machine only\n"
              "HINT: give the servers (HOST:PORT ..., --servers, --from-slurm, --from-statefulset) or set "
              "SMB2_SERVERS", file=sys.stderr)
        return 2
    return 1 if report.problems else 0
