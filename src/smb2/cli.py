"""The ``smb2`` command: ``smb2 stat``, ``smb2 ls``, ``smb2 rm``, ``smb2 doctor``,
``smb2 bench``, ``smb2 demo``.

Servers are given as arguments or, where none are, by ``SMB2_SERVERS``.
(``smb2-server`` lives in :mod:`smb2.server`.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from .client import connect
from .errors import NoSuchBuffer, Smb2Error


async def _stat(client: Any, args: argparse.Namespace) -> int:
    stats = await client.stat()
    print(json.dumps(stats if len(stats) > 1 else stats[0], indent=2, sort_keys=True))
    return 0


async def _ls(client: Any, args: argparse.Namespace) -> int:
    from .train.store import describe

    rows = []
    for name in await client.buffers():
        try:
            rows.append(await describe(client, name))
        except Smb2Error as exc:        # removed meanwhile, or not on every server
            rows.append({"name": name, "error": str(exc)})
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print("no buffers")
    else:
        print(f"{'NAME':24} {'BYTES':>12} {'STRIPE':>8}  WHAT")
        for r in rows:
            print(f"{r['name']:24} {r.get('bytes', '-'):>12} {r.get('stripe', '-'):>8}  {_what(r)}")
    return 0


def _what(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"unreadable: {r['error']}"
    if not r["store"]:
        return "buffer"
    if "tensors" not in r:
        return f"parameter store of format {r['format']} (remove it with `smb2 rm {r['name']}`)"
    state = "finished" if r["finished"] else "not finished"
    beat = r["last_heartbeat_s"]
    heard = "" if beat is None else f", last heartbeat {beat:.0f} s ago"
    return (f"parameter store: {r['tensors']} tensors ({r['data_bytes']} bytes of {r['dtype']}), rule {r['rule']}, "
            f"{r['workers']} workers; run {r['run']} {state}, {r['joined']} joined, version {r['version']}, "
            f"steps {r['steps']}{heard}")


async def _rm(client: Any, args: argparse.Namespace) -> int:
    from .train.store import remove

    if not await remove(client, args.name):     # a store goes with its ranks' optimizer states
        raise NoSuchBuffer(f"no buffer {args.name!r} on {', '.join(client.servers)}")
    print(f"removed {args.name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="smb2", description="smb2 tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    servers_help = "HOST:PORT of each server (default: SMB2_SERVERS)"
    st = sub.add_parser("stat", help="print servers' statistics as JSON")
    st.add_argument("servers", nargs="*", help=servers_help)
    ls = sub.add_parser("ls", help="list buffers and parameter stores (runs, steps, finished or not)")
    ls.add_argument("servers", nargs="*", help=servers_help)
    ls.add_argument("--json", action="store_true", help="print JSON")
    rm = sub.add_parser("rm", help="remove a buffer or parameter store")
    rm.add_argument("name", help="the buffer's name")
    rm.add_argument("servers", nargs="*", help=servers_help)
    for cmd in (st, ls, rm):
        cmd.add_argument("--transport", default="tcp", help="transport for the query (default tcp)")
    sub.add_parser("doctor", help="preflight: RDMA, memlock, token, each server's transport and clock "
                   "(smb2 doctor --help)", add_help=False)
    sub.add_parser("bench", help="bandwidth benchmark (smb2 bench --help)", add_help=False)
    sub.add_parser("demo", help="a local cluster, clients and what they measured", add_help=False)
    if argv and argv[0] in ("bench", "demo", "doctor"):
        # these own their flags
        if argv[0] == "doctor":
            from . import doctor
            return doctor.main(argv[1:])
        if argv[0] == "bench":
            from . import bench
            return bench.main(argv[1:])
        from . import demo
        return demo.main(argv[1:])
    args = p.parse_args(argv)
    run = {"stat": _stat, "ls": _ls, "rm": _rm}[args.cmd]

    async def go() -> int:
        async with await connect(args.servers or None, transport=args.transport) as client:
            return await run(client, args)
    try:
        return asyncio.run(go())
    except Smb2Error as exc:
        print(f"smb2 {args.cmd}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
