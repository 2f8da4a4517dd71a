"""``smb2 bench`` (and ``python -m smb2.bench``): which benchmark a command
line asks for.

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


def main(argv: list[str] | None = None) -> int:
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


__all__ = ["main"]
