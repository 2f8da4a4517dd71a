"""``python -m smb2.testing.jepsen``: one run, checked (see the package's docstring)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time

from . import __doc__ as PACKAGE_DOC
from .checker import check, report
from .history import NEMESES
from .run import Settings, run_local, run_netns, worker


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m smb2.testing.jepsen", description=(PACKAGE_DOC or "").split("\n\n")[0])
    p.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of operations (default 60)")
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--processes", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--nemesis", default="kill,pause",
                   help=f"comma-separated faults among {','.join(NEMESES)}, or none (default kill,pause)")
    p.add_argument("--interval", type=float, default=3.0, help="mean seconds between faults (default 3)")
    p.add_argument("--op-timeout", type=float, default=3.0)
    p.add_argument("--fault-time", default="1,5", metavar="MIN,MAX",
                   help="seconds a fault lasts, uniformly drawn (default 1,5)")
    p.add_argument("--no-data-dir", action="store_true", help="servers restart empty (no --data-dir)")
    p.add_argument("--transport", default="tcp")
    p.add_argument("--netns", action="store_true",
                   help="every server its own host (smb2.testing.netns; needs root); allows partition")
    p.add_argument("--clients", type=int, default=2, help="netns: client hosts (default 2)")
    p.add_argument("--aim-lock", action="store_true",
                   help="the first fault is a SIGKILL of the replicated lock's server (with --replicas 2+)")
    p.add_argument("--history", metavar="FILE", help="write the history as JSON lines")
    p.add_argument("--worker", metavar="JOB", help=argparse.SUPPRESS)
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if a.worker:
        asyncio.run(worker(json.loads(a.worker)))
        return 0
    choices = () if a.nemesis == "none" else tuple(a.nemesis.split(","))
    bad = [c for c in choices if c not in NEMESES]
    if bad:
        p.error(f"unknown nemesis {bad}: choose among {','.join(NEMESES)}")
    s = Settings(seed=a.seed, duration=a.duration, servers=a.servers, replicas=a.replicas,
                 processes=a.processes, nemesis=choices, interval=a.interval, op_timeout=a.op_timeout,
                 data_dir=not a.no_data_dir, transport=a.transport, clients=a.clients, aim_lock=a.aim_lock,
                 fault_time=tuple(float(x) for x in a.fault_time.split(",", 1)))  # type: ignore[arg-type]
    if a.netns:
        history = run_netns(s)
    else:
        history = asyncio.run(run_local(s))
    if a.history:
        history.dump(a.history)
    violations = check(history)
    print(report(history, violations), flush=True)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
