"""``smb2 repair``: what a replicated cluster cannot serve, and serving it
on the operator's word.

A restarted server holding a stripe's last member copy is a member again at
once when its copy provably holds every acknowledged update
(docs/reliability.md, "Who can change the view"); where it cannot be
vouched for, the server says why (``stuck`` in its statistics) and serves
nothing of it.  This command
reads that from every server that answers and prints, per buffer, the
servers of the stuck stripes and why each copy cannot be vouched for.
``--accept HOST:PORT`` tells that server to take its copies as they are
(``repl_accept``): the stripes come back with what it holds, and updates
acknowledged after its copy was last whole are lost -- the operator's
choice, said in the output before it is made.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from . import serverlist
from .client import connect
from .errors import Smb2Error


async def _stat(server: str, transport: str, timeout: float) -> dict[str, Any]:
    async with await connect([server], transport=transport, timeout=timeout) as c:
        return dict((await c.stat(timeout=timeout))[0])


async def _accept(server: str, transport: str, timeout: float) -> dict[str, Any]:
    async with await connect([server], transport=transport, timeout=timeout) as c:
        return await c.links[0].call(lambda t: t.control({"cmd": "repl_accept"}), timeout, idempotent=True,
                                     what="smb2 repair --accept")


def report(servers: list[str], answers: list[dict[str, Any] | BaseException]) -> tuple[list[str], int]:
    """The lines ``smb2 repair`` prints, and how many stuck stripe groups there are."""
    lines, stuck = [], 0
    for server, said in zip(servers, answers):
        if isinstance(said, BaseException):
            why = said.message if isinstance(said, Smb2Error) else str(said)
            lines.append(f"{server}: unreachable ({why})")
            continue
        repl = said.get("replication")
        if not repl:
            lines.append(f"{server}: not part of a replicated cluster")
            continue
        lines.append(f"{server}: {repl['state']} (view epoch {repl['epoch']})"
                     + (", told to take its copies as they are" if repl.get("accept_as_is") else ""))
        for s in repl.get("stuck", []):
            stuck += 1
            lines.append(f"  buffer {s['buffer']!r}: {len(s['stripes'])} stripe(s) on {'+'.join(s['servers'])} "
                         f"have no member copy; this server's copy cannot be vouched for: {s['why']}")
            lines.append(f"    to serve this server's copy as it is (updates acknowledged after it was last "
                         f"whole are lost): smb2 repair --accept {server}")
    if not stuck and not all(isinstance(a, BaseException) for a in answers):
        lines.append("nothing to repair: every stripe the servers that answered hold has a member copy, "
                     "or is catching up")
    return lines, stuck


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="smb2 repair", description=__doc__.split("\n\n")[0] if __doc__ else None)
    serverlist.add_arguments(p)
    p.add_argument("--accept", metavar="HOST:PORT",
                   help="take this server's copies of stripes no member holds as they are")
    p.add_argument("--transport", default="tcp")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to reach each server")
    args = p.parse_args(argv)
    try:
        servers = serverlist.from_args(args)
    except Smb2Error as exc:
        print(f"smb2 repair: {exc}", file=sys.stderr)
        return 2
    if not servers and not args.accept:
        print("smb2 repair: no server to check: give HOST:PORT,... or set SMB2_SERVERS", file=sys.stderr)
        return 2

    async def go() -> int:
        if args.accept:
            said = await _accept(args.accept, args.transport, args.timeout)
            print(f"{args.accept}: takes its copies of {len(said.get('stuck', []))} stuck stripe group(s) as "
                  "they are, at its next try to rejoin (within a few seconds)")
            return 0
        answers = await asyncio.gather(*(_stat(s, args.transport, args.timeout) for s in servers),
                                       return_exceptions=True)
        lines, stuck = report(servers, list(answers))
        print("\n".join(lines))
        if all(isinstance(a, BaseException) for a in answers):
            print("smb2 repair: no server answered: nothing was checked", file=sys.stderr)
            return 2
        return 1 if stuck else 0
    try:
        return asyncio.run(go())
    except Smb2Error as exc:
        print(f"smb2 repair: {exc}", file=sys.stderr)
        return 1
