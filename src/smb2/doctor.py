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

With ``--agent HOST:PORT`` (default: ``SMB2_AGENT``, as a worker reads
it) it checks the host agent too: it answers with the token, it is an
agent (its server's stat carries what ``smb2-agent`` says of itself, under
``"agent"``), it reaches its memory servers by its own word, and they are
the servers this doctor was given, in the same order.
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
from .mirror import AGENT_ENV, DEFAULT_AGENT_PORT, agent_address
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
    # what a host agent says of itself (its stat's "agent"; None: not an agent)
    agent: dict[str, Any] | None = None


@dataclass
class Report:
    versions: dict[str, str] = field(default_factory=dict)
    rdma: dict[str, Any] = field(default_factory=dict)
    memlock: dict[str, Any] = field(default_factory=dict)
    token: str = "none"
    servers: list[ServerReport] = field(default_factory=list)
    # the host agent checked (--agent, SMB2_AGENT), if any
    agent: ServerReport | None = None
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
    rep.agent = stat.get("agent") if isinstance(stat.get("agent"), dict) else None
    return rep


async def check_agent(address: str, token: bytes | None, rdma_reason: str | None,
                      timeout: float, wait: float = 0.0, kind: str = "auto") -> ServerReport:
    """The host agent at ``address``, as :func:`check_server` checks a
    server; with ``wait``, also until it says it reaches its memory servers
    (an agent started beside its servers connects to them in the background)."""
    deadline = time.monotonic() + wait
    while True:
        rep = await check_server(address, token, rdma_reason, timeout, max(0.0, deadline - time.monotonic()), kind)
        if (not rep.reachable or rep.error or rep.agent is None or rep.agent.get("trouble") is None
                or time.monotonic() >= deadline):
            return rep
        await asyncio.sleep(min(WAIT_RETRY, max(0.0, deadline - time.monotonic())))


def connection_problems(rep: ServerReport, transport: str, what: str) -> list[str]:
    """What is wrong with a server (or the agent) that answered, as seen from here."""
    problems = []
    if transport == "rdma" and rep.transport == "tcp":
        problems.append(f"{what}: --transport rdma, but it would get TCP: {rep.why}")
    if transport == "shm" and rep.transport != "shm":
        problems.append(f"{what}: --transport shm, but {rep.why}")
    if rep.clock_offset_s is not None and abs(rep.clock_offset_s) > CLOCK_TOLERANCE:
        problems.append(f"{what}: its clock is {rep.clock_offset_s:+.3f} s off this "
                        "machine's (run NTP/chrony on both)")
    if rep.protocol_version != VERSION:
        problems.append(f"{what}: speaks protocol {rep.protocol_version}, this smb2 {VERSION}")
    return problems


def agent_problems(agent: ServerReport, servers: list[ServerReport], transport: str) -> list[str]:
    """What is wrong with the host agent: not reachable, not an agent, not
    reaching its memory servers, or forwarding to other servers than this
    job's (compared by the server ids both reached, so that two names of one
    server agree)."""
    what = f"agent {agent.address}"
    if not agent.reachable or agent.error:
        return [f"{what}: {agent.error} (start smb2-agent there, or unset {AGENT_ENV} to reach the memory "
                "servers directly)"]
    if agent.agent is None:
        return [f"{what} answers, but is not a host agent (an smb2-server?): {AGENT_ENV} names where smb2-agent "
                f"listens (its --listen, default 127.0.0.1:{DEFAULT_AGENT_PORT})"]
    problems = connection_problems(agent, transport, what)
    theirs = [str(s) for s in agent.agent.get("servers") or []]
    if agent.agent.get("trouble") is not None:
        problems.append(f"{what} cannot reach its memory servers {', '.join(theirs)}: {agent.agent['trouble']}")
    their_ids = agent.agent.get("server_ids") or []
    ours = [s.server_id for s in servers]
    if servers and all(ours) and their_ids and all(their_ids) and their_ids != ours:
        problems.append(f"{what} forwards to other memory servers than this job's: its {', '.join(theirs)}; "
                        f"this job's {', '.join(s.address for s in servers)} (give the agent the job's --servers, "
                        "in the same order)")
    return problems


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
                   timeout: float = 5.0, wait: float = 0.0, agent: str | None = None) -> Report:
    """Everything ``smb2 doctor`` checks, as a Report (``problems`` empty: all well).
    ``wait``: seconds to keep trying servers (and the agent) not reachable
    yet; ``agent``: the host agent's ``host:port`` to check as well."""
    report = Report(token=token_source)
    report.versions = {"smb2": _version("smb2"), "protocol": str(VERSION), "python": platform.python_version(),
                       **{p: _version(p) for p in ("numpy", "uvloop", "msgpack", "torch")}}
    rdma_reason = check_rdma(report, want_rdma=transport == "rdma")
    checks = [check_server(s, token, rdma_reason, timeout, wait, transport) for s in servers]
    if agent is not None:
        checks.append(check_agent(agent, token, rdma_reason, timeout, wait, transport))
    reports = list(await asyncio.gather(*checks))
    report.servers = reports[:len(servers)]
    report.agent = reports[len(servers)] if agent is not None else None
    twice = serverlist.listed_twice((r.address, r.server_id) for r in report.servers if r.reachable)
    if twice is not None:
        report.problems.append(twice.message)
    for rep in report.servers:
        if not rep.reachable or rep.error:
            report.problems.append(f"{rep.address}: {rep.error}")
            continue
        report.problems += connection_problems(rep, transport, rep.address)
        if rep.rdma_refused:
            report.problems.append(
                f"{rep.address}: refused RDMA to {rep.rdma_refused} clients at its maximum of "
                f"{rep.limits.get('max_rdma_connections')} RDMA connections; they run over TCP, several times "
                "slower: raise --max-rdma-connections on that server where its memory allows")
    if report.agent is not None:
        report.problems += agent_problems(report.agent, report.servers, transport)
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
        rows.append((s.address, connection_line(s)))
        rows.append(("", limits_line(s)))
    if (a := report.agent) is not None:
        label = f"agent {a.address}"
        if not a.reachable or a.error:
            rows.append((label, f"UNREACHABLE: {a.error}"))
        else:
            rows.append((label, connection_line(a)))
            rows.append(("", agent_line(a)))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines += [f"PROBLEM: {p}" for p in report.problems] or [
        "no problems found on this machine; no server was checked" if not report.servers and report.agent is None
        else "no problems found"]
    return "\n".join(lines)


def connection_line(s: ServerReport) -> str:
    clock = f"{s.clock_offset_s:+.3f} s" if s.clock_offset_s is not None else "unknown"
    return (f"{s.transport}" + (f" ({s.why})" if s.why else "")
            + f"; clock {clock}; smb2 {s.version}, protocol {s.protocol_version}; "
              f"{s.used}/{s.capacity} bytes used; auth {s.auth or 'none'}")


def agent_line(a: ServerReport) -> str:
    """What the agent says of itself: its memory servers, whether it reaches them, its mirrors."""
    said = a.agent
    if said is None:
        return "not a host agent"
    servers = [str(s) for s in said.get("servers") or []]
    connected = sum(1 for sid in said.get("server_ids") or [] if sid)
    mirrors = ", ".join(f"{n} {state}" for state, n in sorted((said.get("mirrors") or {}).items())) or "none"
    reach = (f"connected to {connected} of {len(servers)}" if said.get("trouble") is None
             else f"cannot reach them: {said['trouble']}")
    return f"host agent for the memory servers {', '.join(servers)} ({reach}); mirrors: {mirrors}"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="smb2 doctor", description="check this machine and the servers "
                                "before a job; exit 1 on a problem it can name")
    serverlist.add_arguments(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--agent", metavar="HOST:PORT", default=agent_address(),
                   help=f"the host agent (smb2-agent) to check as well: it answers with the token, is an agent, "
                        f"and reaches its memory servers, the ones given here (default: ${AGENT_ENV}, as a "
                        "worker reads it; unset: no agent)")
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
                                  capacity=capacity, timeout=args.timeout, wait=args.wait, agent=args.agent))
    if args.json:
        print(json.dumps(asdict(report), indent=2, sort_keys=True))
    else:
        print(as_table(report))
    if not servers and args.agent is None:
        print("smb2 doctor: no server to check: checked this machine only\n"
              "HINT: give the servers (HOST:PORT ..., --servers, --from-slurm, --from-statefulset) or set "
              "SMB2_SERVERS", file=sys.stderr)
        return 2
    return 1 if report.problems else 0
