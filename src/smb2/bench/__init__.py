"""``smb2 bench NAME`` (and ``python -m smb2.bench NAME``): the benchmarks,
one subcommand each (``smb2 bench --help`` lists them), each dispatching to
its module here; ``tools/bench_NAME.py`` runs the same.

``bandwidth`` (also what ``smb2 bench`` runs without a name) picks its
program by transport:

* ``--transport tcp`` / ``auto`` (the default): smb2 against a raw uvloop TCP
  baseline (:mod:`smb2.bench.tcp`);
* ``--transport rdma``: the RDMA transport against a bare pyverbs
  post-and-poll loop (:mod:`smb2.bench.rdma`);
* ``--transport shm``: the shm transport against ``np.copyto`` of the same
  size (:mod:`smb2.bench.shm`);
* ``--raw-peer``: the baseline's peer process (:mod:`smb2.bench.common`),
  started by the benchmarks themselves.

The helpers every benchmark shares live in :mod:`smb2.bench.common`.
"""

from __future__ import annotations

import argparse
import sys

from .common import MiB, run_raw_peer


def _dispatch_parser() -> argparse.ArgumentParser:
    # only what picks the benchmark; each benchmark parses (and documents) the rest
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--transport", default="tcp")
    p.add_argument("--raw-peer", action="store_true")
    p.add_argument("--raw-peer-bytes", type=int, default=64 * MiB)
    return p


#: the benchmarks: name -> (module, its entry point, what it measures)
BENCHMARKS = {
    "bandwidth": ("", "bandwidth", "read/write/accumulate bandwidth and latency against a raw baseline, "
                  "per transport"),
    "lock": ("lock", "main", "the ticket lock's hand-off and throughput against raw baselines"),
    "replicated-lock": ("replicated_lock", "main", "the replicated lock against the plain one, kills included"),
    "scaleout": ("scaleout", "main", "bandwidth over 1, 2, 4, 8 server hosts behind rate-limited links (netns)"),
    "replicas": ("replicas", "main", "what replication costs, on this machine"),
    "replicas-netns": ("replicas_netns", "main", "replication across hosts: throughput, failover, repair (netns)"),
    "repair": ("repair", "main", "how fast a restarted or replaced server is whole again"),
    "resume": ("resume", "main", "how long a training job takes to resume"),
    "training": ("training", "cli", "samples/s of asynchronous training over the parameter store"),
    "tta": ("tta", "main", "time to accuracy against DDP across hosts (netns)"),
    "classifier": ("classifier", "main", "the porting recipe's one line against DDP on a plain classifier at equal "
                   "epochs, seed by seed"),
    "agents": ("agents", "main", "one smb2-agent per worker host against none: the servers' link bytes per step "
               "and time to accuracy (netns)"),
    "attacks": ("attacks", "main", "what each hostile client costs a server, and that it still serves"),
    "accumulate": ("accumulate", "main", "server-side accumulate throughput with 1 and more server threads"),
    "scale": ("scale", "main", "W simulated workers against N servers: connect storm, join barrier, heartbeats, "
              "one exchange; server CPU per operation"),
}


def _usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = ["usage: smb2 bench NAME [options]   (smb2 bench NAME --help: its options)", "", "benchmarks:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, _, what) in BENCHMARKS.items()]
    lines += ["", "Without a NAME, smb2 bench [options] is smb2 bench bandwidth [options]."]
    return "\n".join(lines)


def bandwidth(argv: list[str] | None = None) -> int:
    """``smb2 bench bandwidth``: the transport's benchmark (tcp, rdma or shm) or the raw peer."""
    argv = list(sys.argv[1:] if argv is None else argv)
    picked, _ = _dispatch_parser().parse_known_args(argv)
    if picked.raw_peer:
        return run_raw_peer(picked.raw_peer_bytes)
    if picked.transport == "rdma":
        from . import rdma
        return rdma.main(argv)
    if picked.transport == "shm":
        from . import shm
        return shm.main(argv)
    from . import tcp
    return tcp.main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(_usage())
        return 0
    if not argv or argv[0].startswith("-"):
        return bandwidth(argv)
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"smb2 bench: no benchmark {name!r}\n{_usage()}", file=sys.stderr)
        return 2
    module, entry, _ = BENCHMARKS[name]
    if not module:
        return bandwidth(rest)
    import importlib
    run = getattr(importlib.import_module(f".{module}", __name__), entry)
    # each benchmark parses sys.argv (some take no argv argument): its own command line
    sys.argv = [f"smb2 bench {name}", *rest]
    code = run()
    return 0 if code is None else int(code)


__all__ = ["BENCHMARKS", "bandwidth", "main"]
