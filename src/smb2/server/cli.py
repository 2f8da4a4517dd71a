"""The ``smb2-server`` command: options, signals, exit codes."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from .. import auth
from ..errors import InvalidArgumentError, PersistenceError, TransportError
from ..protocol import DEFAULT_MAX_FRAME, DEFAULT_PORT, parse_size
from .locks import DEFAULT_LEASE, DEFAULT_SLOTS, DEFAULT_SPIN, MAX_SPIN
from .memory import DEFAULT_WRITE_TIMEOUT, start_server

log = logging.getLogger("smb2.server")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smb2-server",
        description="Serve this machine's memory as smb2 segments.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0 = any free)")
    p.add_argument("--capacity", default="1GiB", help="memory to serve, e.g. 512MiB, 8GiB (default 1GiB)")
    p.add_argument("--max-frame", default=str(DEFAULT_MAX_FRAME),
                   help="largest payload of one request (default 64MiB)")
    p.add_argument("--auth-token-file", metavar="FILE",
                   help=f"require clients to prove they know the token in FILE "
                        f"(default: ${auth.ENV} if set, else no authentication)")
    p.add_argument("--max-buffers", type=int, default=4096, help="buffers this server holds at most (default 4096)")
    p.add_argument("--write-timeout", type=float, default=DEFAULT_WRITE_TIMEOUT,
                   help="close a connection silent this many seconds in the middle of a write "
                        f"(default {DEFAULT_WRITE_TIMEOUT:g}; 0 = never)")
    p.add_argument("--data-dir", metavar="DIR",
                   help="save the segments to DIR on SIGTERM/SIGINT and restore them at start")
    p.add_argument("--lock-lease", type=float, default=DEFAULT_LEASE,
                   help=f"seconds a lock holder may go without renewing (default {DEFAULT_LEASE:g})")
    p.add_argument("--lock-slots", type=int, default=DEFAULT_SLOTS,
                   help=f"locks this server can hold (default {DEFAULT_SLOTS})")
    p.add_argument("--lock-spin", type=float, default=DEFAULT_SPIN,
                   help="while lock waiters are parked, poll instead of sleeping for up to this many "
                        f"seconds after each grant (default {DEFAULT_SPIN:g}; 0 = never, at most {MAX_SPIN:g})")
    p.add_argument("--rdma", choices=("auto", "on", "off"), default="auto",
                   help="serve RDMA: auto (where a device is usable; default), on, off")
    p.add_argument("--rdma-device", default=None, help="RDMA device name (default: the first ACTIVE one)")
    p.add_argument("--rdma-gid-index", type=int, default=None,
                   help="GID index (default: the port's IPv4 RoCE v2 GID)")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop (default uvloop)")
    p.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")
    return p


async def _serve(args: argparse.Namespace) -> None:
    server = await start_server(args.host, args.port, capacity=args.capacity,
                                max_frame=parse_size(args.max_frame), max_buffers=args.max_buffers,
                                token=args.token, write_timeout=args.write_timeout,
                                data_dir=args.data_dir, lock_lease=args.lock_lease,
                                lock_slots=args.lock_slots, lock_spin=args.lock_spin, rdma=args.rdma,
                                rdma_device=args.rdma_device, rdma_gid_index=args.rdma_gid_index)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    host, port = server.address
    print(f"smb2-server listening on {host}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()
        log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        parse_size(args.capacity)
        parse_size(args.max_frame)
        args.token = (auth.token_from_file(args.auth_token_file) if args.auth_token_file
                      else auth.token_from_env())
    except InvalidArgumentError as exc:
        print(f"smb2-server: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"smb2-server: cannot read the token file: {exc}", file=sys.stderr)
        return 2
    try:
        if args.loop == "uvloop":
            import uvloop
            uvloop.run(_serve(args))
        else:
            asyncio.run(_serve(args))
    except InvalidArgumentError as exc:     # an option out of range
        print(f"smb2-server: {exc}", file=sys.stderr)
        return 2
    except (PersistenceError, TransportError) as exc:
        print(f"smb2-server: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"smb2-server: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0

