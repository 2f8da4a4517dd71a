"""The ``smb2`` command: ``smb2 stat``, ``smb2 ls``, ``smb2 rm``, ``smb2 doctor``,
``smb2 servers``, ``smb2 bench``, ``smb2 demo``.

Servers are given with ``--servers HOST:PORT,...`` (``stat`` and ``ls`` also
take them as arguments; ``rm``'s arguments are names) or, where none are,
by ``SMB2_SERVERS``.  An error is printed as its message and hint, one
``HINT:`` line, with no traceback; the exit status is then 1.
(``smb2-server`` lives in :mod:`smb2.server`.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import traceback
from typing import Any

from . import serverlist
from .client import connect
from .errors import InterfaceError, InvalidArgumentError, NoSuchBuffer, Smb2Error, TransportError, debug_wanted
from .protocol import DEFAULT_PORT
from .version import __version__

# etcd's root password for smb2 etcd-setup, where no --root-password-file is given
ROOT_PASSWORD_ENV = "SMB2_ETCD_ROOT_PASSWORD"


async def _stat(client: Any, args: argparse.Namespace) -> int:
    stats = await client.stat()
    await _add_replication(client, stats)
    print(json.dumps(stats if len(stats) > 1 else stats[0], indent=2, sort_keys=True))
    return 0


async def _stat_partial(servers: list[str], args: argparse.Namespace) -> int:
    """``smb2 stat`` while some server cannot be reached: the others' statistics,
    and ``{"server": ..., "unreachable": why}`` in the place of each lost one."""
    async def one(server: str) -> dict[str, Any]:
        async with await connect([server], transport=args.transport, timeout=args.connect_timeout) as c:
            stats = await c.stat()
            await _add_replication(c, stats)
            return dict(stats[0])
    answers = await asyncio.gather(*(one(s) for s in servers), return_exceptions=True)
    print(json.dumps([a if isinstance(a, dict) else
                      {"server": s, "unreachable": a.message if isinstance(a, Smb2Error) else str(a)}
                      for s, a in zip(servers, answers)], indent=2, sort_keys=True))
    return 1


async def _add_replication(client: Any, stats: list[dict[str, Any]]) -> None:
    """Where replicated buffers are, ``replication`` beside each server's
    statistics: the membership view, and the buffers that are degraded (a
    stripe with fewer copies on member servers than its replicas)."""
    from .placement import Placement
    from .replication import degraded

    infos = {name: info for s in stats for name, info in s.get("buffers", {}).items()
             if info.get("replicas", 1) > 1}
    if not infos:
        return
    view = await (await client.views()).refresh()
    out: dict[str, Any] = {"epoch": view.epoch, "members": list(view.members), "joining": list(view.joining),
                           "replaced": [r.to_obj() for r in view.replaced], "degraded": []}
    for name, info in sorted(infos.items()):
        n = info["nservers"]
        placement = Placement.of(name, n, info["nbytes"], info["stripe"], info["replicas"], info.get("zones"))
        if degraded(placement, info.get("servers") or client.servers, view):
            out["degraded"].append(name)
    for s in stats:
        s["replication"] = out


async def _ls(client: Any, args: argparse.Namespace) -> int:
    from .train.store import describe_all

    _print_rows(await describe_all(client), args.json)
    return 0


def _print_rows(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print("no buffers")
    else:
        print(f"{'NAME':24} {'BYTES':>12} {'STRIPE':>8}  WHAT")
        for r in rows:
            print(f"{r['name']:24} {r.get('bytes', '-'):>12} {r.get('stripe', '-'):>8}  {_what(r)}{_copies(r)}")


def _copies(r: dict[str, Any]) -> str:
    if r.get("replicas", 1) <= 1:
        return ""
    if r.get("degraded"):
        return (f"; {r['replicas']} replicas, DEGRADED: some stripes have fewer copies (a server was lost; they "
                "are whole again once it rejoins, or once other servers made new copies: smb2-server "
                "--replace-after)")
    return f"; {r['replicas']} replicas"


def _what(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"unreadable: {r['error']}"
    if r.get("whole"):
        return (f"readable: every stripe has a copy on a reachable server (unreachable: "
                f"{', '.join(r['unreachable'])})")
    if "unreachable" in r:
        return (f"unknown: server{'s' if len(r['unreachable']) > 1 else ''} {', '.join(r['unreachable'])} "
                f"unreachable (parts seen: {r['parts_seen']} of {r['parts']})")
    if "damaged" in r:
        return f"DAMAGED: {r['damaged']} (`smb2 rm {r['name']}` removes it)"
    if r.get("set_aside_of"):
        return (f"store {r['set_aside_of']!r} set aside while a rank 0 made it again for another number of "
                "workers: the job's next rank 0 goes on from it, then removes it (do not remove it while "
                f"{r['set_aside_of']!r} is not a whole store: it holds the run)")
    if not r["store"]:
        return "buffer"
    if "tensors" not in r:
        return f"parameter store of format {r['format']} (remove it with `smb2 rm {r['name']}`)"
    state = "finished" if r["finished"] else "not finished"
    beat = r["last_heartbeat_s"]
    heard = "" if beat is None else f", last heartbeat {beat:.0f} s ago"
    return (f"parameter store: {r['tensors']} tensors ({r['data_bytes']} bytes of {r['dtype']}), rule {r['rule']}, "
            f"{r['workers']} workers; run {r['run']} {state}, {r['joined']} joined, version {r['version']}, "
            f"steps {r['steps']}{heard}{_counts(r.get('counts'))}")


def _counts(c: dict[str, Any] | None) -> str:
    """The run's stability counts (smb2.train.counts), in words."""
    if not c:
        return ""
    collapse = f"; THE SHARED MODEL COLLAPSED ({c['collapses']} warnings)" if c["collapses"] else ""
    return (f"; guard: {c['skipped']} skipped, {c['refused']} refused (NaN/Inf), {c['lag_scaled']} lag-scaled, "
            f"max lag {c['max_version_lag']}{collapse}")


async def _ls_partial(servers: list[str], args: argparse.Namespace) -> int:
    """``smb2 ls`` while some server cannot be reached: what each reachable
    server holds (from its ``stat``), each buffer marked as not readable."""
    async def one(server: str) -> Any:
        async with await connect([server], transport=args.transport, timeout=args.connect_timeout) as c:
            return (await c.stat())[0]
    answers = await asyncio.gather(*(one(s) for s in servers), return_exceptions=True)
    down = [s for s, a in zip(servers, answers) if isinstance(a, BaseException)]
    for s, a in zip(servers, answers):
        if isinstance(a, BaseException):
            print(f"smb2 ls: server {s} is unreachable: "
                  f"{a.message if isinstance(a, Smb2Error) else a}", file=sys.stderr)
    if len(down) == len(servers):
        print("HINT: check the addresses (--servers or SMB2_SERVERS) and that the servers run", file=sys.stderr)
        return 1
    seen: dict[str, dict[str, Any]] = {}
    for a in answers:
        if isinstance(a, BaseException):
            continue
        for name, info in a.get("buffers", {}).items():
            row = seen.setdefault(name, {"name": name, "bytes": info["nbytes"], "stripe": info["stripe"],
                                         "parts": info["nservers"], "parts_seen": 0, "unreachable": down})
            row["parts_seen"] += 1
            if info.get("replicas", 1) > 1:
                # whole without the servers down where every reachable server's view says so
                # (their copies were made again on the others: smb2-server --replace-after)
                moved = info.get("degraded") is False and row.get("degraded") is not True
                row.update(replicas=info["replicas"], degraded=not moved,
                           whole=moved or _whole_without(name, info, down))
    _print_rows([seen[n] for n in sorted(seen)], args.json)
    if not all(row.get("whole") for row in seen.values()):
        print(f"HINT: buffers with a part on {', '.join(down)} cannot be read until it is back", file=sys.stderr)
    elif not any(row.get("degraded") for row in seen.values()):
        print(f"HINT: every buffer is whole on the servers left (the copies {', '.join(down)} held were made "
              "again on the others); it can be restarted or left out", file=sys.stderr)
    else:
        print(f"HINT: every buffer has a copy of each stripe on the servers left; restart {', '.join(down)} "
              "(with its --data-dir) so that it rejoins and the buffers are whole again", file=sys.stderr)
    return 1


def _whole_without(name: str, info: dict[str, Any], down: list[str]) -> bool:
    """Whether every stripe of the replicated buffer ``name`` has a copy on
    a server not ``down`` (its part ``info`` names the servers)."""
    from .placement import Placement

    servers = info.get("servers") or []
    n = info["nservers"]
    if len(servers) != n:
        return False
    p = Placement.of(name, n, info["nbytes"], info["stripe"], info["replicas"], info.get("zones"))
    return all(any(servers[s] not in down for s in p.replicas_of(i)) for i in range(min(p.nstripes, n)))


async def _rm(client: Any, args: argparse.Namespace) -> int:
    from .train.lifecycle import STALE_AFTER
    from .train.store import describe, remove

    failed = 0
    for name in args.names:
        try:
            if not args.force:
                try:
                    info = await describe(client, name)
                except Smb2Error:
                    info = {}       # gone, or unreadable: nothing to protect
                _refuse_live(info, name, STALE_AFTER)
                await _refuse_set_aside(client, info, name)
            if not await remove(client, name):     # a store goes with the buffers beside it
                raise NoSuchBuffer(f"no buffer {name!r} on {', '.join(client.servers)}",
                                   hint="see the names with `smb2 ls`" + (
                                       "; servers are given with --servers or SMB2_SERVERS, not after the names"
                                       if _looks_like_address(name) else ""))
        except Smb2Error as exc:
            print(f"smb2 rm: {exc}", file=sys.stderr)
            failed += 1
        else:
            print(f"removed {name}")
    return 1 if failed else 0


def _refuse_live(info: dict[str, Any], name: str, stale_after: float) -> None:
    """Raise if ``name`` (``info``: its description) is a store whose run is
    live: not finished, and a worker's heartbeat younger than
    ``stale_after`` s."""
    beat = info.get("last_heartbeat_s")
    if info.get("tensors") and not info["finished"] and beat is not None and beat < stale_after:
        raise InterfaceError(
            f"store {name!r} is in use: run {info['run']} has not finished and a worker's heartbeat "
            f"is {beat:.0f} s old (a run is live while one is younger than {stale_after:.0f} s)",
            hint=f"stop the job first, or remove the store anyway with `smb2 rm --force {name}`")


async def _refuse_set_aside(client: Any, info: dict[str, Any], name: str) -> None:
    """Raise if ``name`` (``info``: its description) holds a store set aside
    while a rank 0 made it again for another number of workers, and that
    store is not whole: the set-aside is then all there is of its run."""
    from .train.store import describe
    store = info.get("set_aside_of")
    if not store:
        return
    try:
        whole = await describe(client, store)
    except NoSuchBuffer:
        whole = None
    except Smb2Error:
        return
    if whole is not None and whole.get("tensors") and not whole.get("damaged"):
        return
    raise InterfaceError(
        f"{name!r} holds store {store!r}, set aside while a rank 0 made it again for another number of workers, "
        f"and {store!r} {'is gone' if whole is None else 'is not a whole store'}: the set-aside is all there is "
        "of its run (the job's next rank 0 goes on from it)",
        hint=f"launch the job again to go on, or remove it anyway with `smb2 rm --force {name}`")


def _looks_like_address(name: str) -> bool:
    host, sep, port = name.rpartition(":")
    return bool(sep and host and port.isdigit())


def _servers(args: argparse.Namespace) -> int:
    print(",".join(serverlist.from_args(args)))
    return 0


def _add_servers_parser(sub: Any) -> None:
    sv = sub.add_parser("servers", help="print the server list (HOST:PORT,...) of a Slurm job or a "
                        "Kubernetes StatefulSet, in the one order every worker must use",
                        description="Print HOST:PORT,... for SMB2_SERVERS, in the one order every worker uses "
                        "(hosts sorted naturally: node2 before node10; a StatefulSet's pods by ordinal).")
    where = sv.add_mutually_exclusive_group(required=True)
    where.add_argument("--from-slurm", action="store_true",
                       help="the hosts of this Slurm job (SLURM_JOB_NODELIST): one server per node")
    where.add_argument("--from-statefulset", metavar="NAME",
                       help="the pods NAME-0, NAME-1, ... of a StatefulSet behind a headless Service")
    sv.add_argument("--replicas", type=int, help="--from-statefulset: the StatefulSet's replicas")
    sv.add_argument("--service", help="--from-statefulset: its headless Service (default: NAME)")
    sv.add_argument("--namespace", help="--from-statefulset: its namespace, where the client runs in "
                    "another one (default: the client's own)")
    sv.add_argument("--port", type=int, default=DEFAULT_PORT,
                    help=f"the servers' port (default {DEFAULT_PORT})")


def _etcd_setup(args: argparse.Namespace) -> int:
    from . import auth, membership

    peer_token = (auth.token_from_file(args.peer_token_file) if args.peer_token_file
                  else auth.as_token(os.environ.get(auth.PEER_ENV) or None))
    if peer_token is None:
        raise InvalidArgumentError("smb2 etcd-setup needs the servers' peer token: --peer-token-file FILE "
                                   f"(the file the servers get) or {auth.PEER_ENV}")
    root = (auth.token_from_file(args.root_password_file) if args.root_password_file
            else auth.as_token(os.environ.get(ROOT_PASSWORD_ENV) or None))
    if root is None:
        raise InvalidArgumentError(f"smb2 etcd-setup needs a password for etcd's root user: "
                                   f"--root-password-file FILE or {ROOT_PASSWORD_ENV} (keep it: only an operator "
                                   "needs it, to change etcd's users)")
    cluster = membership.parse_url(args.url)[1]
    asyncio.run(membership.setup_auth(args.url, auth.etcd_password(peer_token, cluster), root.decode()))
    print(f"etcd {args.url}: authentication on; the servers of cluster {cluster!r} use etcd user "
          f"{membership.etcd_user(cluster)} (password from their peer token)")
    return 0


def _add_etcd_setup_parser(sub: Any) -> None:
    es = sub.add_parser("etcd-setup", help="turn on etcd's authentication for a replicated cluster: only its "
                        "servers may then read or change the view",
                        description="Make the etcd user and role of a replicated cluster (read and write under "
                        "smb2/NAME/ only; password derived from the servers' peer token), a root user, and turn "
                        "etcd's authentication on.  Run once per etcd, before the servers start.")
    es.add_argument("url", help="the servers' --membership URL, etcd://HOST:PORT[,HOST:PORT]/NAME")
    es.add_argument("--peer-token-file", help="the servers' peer token (default: SMB2_PEER_TOKEN)")
    es.add_argument("--root-password-file", help=f"etcd's root password (default: {ROOT_PASSWORD_ENV})")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="smb2", description="smb2 tools")
    p.add_argument("--version", action="version", version=f"smb2 {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("stat", help="print servers' statistics as JSON")
    serverlist.add_arguments(st)
    ls = sub.add_parser("ls", help="list buffers and parameter stores (runs, steps, finished or not, damaged)")
    serverlist.add_arguments(ls)
    ls.add_argument("--json", action="store_true", help="print JSON")
    rm = sub.add_parser("rm", help="remove buffers or parameter stores (not a store in use, unless --force)")
    rm.add_argument("names", nargs="+", metavar="NAME", help="the buffers' names")
    serverlist.add_arguments(rm, positional=False)
    rm.add_argument("--force", action="store_true",
                    help="remove a store even while its run is live (a worker's heartbeat is recent)")
    for cmd in (st, ls, rm):
        cmd.add_argument("--transport", default="tcp", help="transport for the query (default tcp)")
        cmd.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to reach a server")
    _add_servers_parser(sub)
    _add_etcd_setup_parser(sub)
    sub.add_parser("doctor", help="preflight: RDMA, memlock, token, each server's transport and clock "
                   "(smb2 doctor --help)", add_help=False)
    sub.add_parser("repair", help="what a replicated cluster cannot serve, and serving a server's copies on "
                   "your word (smb2 repair --help)", add_help=False)
    sub.add_parser("bench", help="the benchmarks (smb2 bench --help lists them)", add_help=False)
    sub.add_parser("demo", help="a local cluster, clients and what they measured", add_help=False)
    if argv and argv[0] in ("bench", "demo", "doctor", "repair"):
        # these own their flags
        if argv[0] == "doctor":
            from . import doctor
            return doctor.main(argv[1:])
        if argv[0] == "repair":
            from . import repair
            return repair.main(argv[1:])
        if argv[0] == "bench":
            from . import bench
            return bench.main(argv[1:])
        from . import demo
        return demo.main(argv[1:])
    args = p.parse_args(argv)
    if args.cmd in ("servers", "etcd-setup"):
        if args.cmd == "servers" and args.from_statefulset and args.replicas is None:
            p.error("smb2 servers --from-statefulset needs --replicas N")
        try:
            return _servers(args) if args.cmd == "servers" else _etcd_setup(args)
        except Smb2Error as exc:
            return _failed(args.cmd, exc)
        except OSError as exc:          # a token or password file that cannot be read
            print(f"smb2 {args.cmd}: {exc}", file=sys.stderr)
            return 1
    run = {"stat": _stat, "ls": _ls, "rm": _rm}[args.cmd]

    async def go() -> int:
        servers = serverlist.from_args(args)
        try:
            client = await connect(servers or None, transport=args.transport, timeout=args.connect_timeout)
        except TransportError:
            if args.cmd == "stat":
                return await _stat_partial(servers, args)
            if args.cmd != "ls":
                raise
            return await _ls_partial(servers, args)
        if args.cmd in ("stat", "ls") and "-" in client.transports:
            # a replicated cluster's client went on without a server: say
            # server by server what is there and what is not
            await client.close()
            partial = _stat_partial if args.cmd == "stat" else _ls_partial
            return await partial(servers, args)
        async with client:
            return await run(client, args)
    try:
        return asyncio.run(go())
    except Smb2Error as exc:
        return _failed(args.cmd, exc)


def _failed(cmd: str, exc: Smb2Error) -> int:
    """The message and its hint, as the library words them; the traceback
    only for who asked for it (SMB2_DEBUG=1, or the smb2 logger at DEBUG)."""
    if debug_wanted():
        traceback.print_exception(exc)
    print(f"smb2 {cmd}: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
