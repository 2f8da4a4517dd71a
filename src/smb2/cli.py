"""The ``smb2`` command: ``smb2 stat``, ``smb2 doctor``, ``smb2 bench``, ``smb2 demo``.

(``smb2-server`` lives in :mod:`smb2.server`.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from .client import connect
from .errors import Smb2Error


async def _stat(servers: list[str], transport: str) -> list[dict[str, object]]:
    async with await connect(servers, transport=transport) as client:
        return await client.stat()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="smb2", description="smb2 tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("stat", help="print servers' statistics as JSON")
    st.add_argument("servers", nargs="+", help="HOST:PORT of each server")
    st.add_argument("--transport", default="tcp", help="transport for the query (default tcp)")
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
    try:
        stats = asyncio.run(_stat(args.servers, args.transport))
    except Smb2Error as exc:
        print(f"smb2 stat: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(stats if len(stats) > 1 else stats[0], indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
