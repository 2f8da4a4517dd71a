"""The ``smb2-server`` command: options, signals, exit codes."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any

from .. import auth
from ..errors import InvalidArgumentError, PersistenceError, TransportError
from ..protocol import DEFAULT_PORT, VERSION
from ..version import __version__
from .memory import start_server
from .options import ServerOptions
from .sizing import size

log = logging.getLogger("smb2.server")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smb2-server",
        description="Serve this machine's memory as smb2 segments.")
    p.add_argument("--version", action="version", version=f"smb2-server {__version__} (protocol {VERSION})")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0 = any free)")
    p.add_argument("--auth-token-file", metavar="FILE",
                   help=f"require clients to prove they know the token in FILE "
                        f"(default: ${auth.ENV} if set, else no authentication)")
    p.add_argument("--peer-token-file", metavar="FILE",
                   help=f"replicated clusters: the secret the servers share and clients do not, which a "
                        f"server proves to forward updates to another (default: ${auth.PEER_ENV} if set, "
                        f"else a forward is taken by its source address)")
    # the server's own options: one flag per ServerOptions field; a cap sized
    # from the machine says what this machine gives it
    defaults: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(ServerOptions)}
    machine = size(capacity=defaults["capacity"], max_receive_memory=defaults["max_receive_memory"],
                   max_reply_bytes=defaults["max_reply_bytes"], max_inflight=defaults["max_inflight"],
                   memfd_segments=hasattr(os, "memfd_create"))
    for f in dataclasses.fields(ServerOptions):
        meta = f.metadata
        if not meta["flag"]:
            continue
        extra = {k: meta[k] for k in ("type", "metavar", "choices") if meta[k] is not None}
        text = meta["help"]
        if meta["machine"]:
            text += (f"; here, with the other options at their defaults: {getattr(machine, meta['machine'])} (file "
                     f"limit {machine.fd_limit}, memory {machine.memory >> 20} MiB)")
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=f.default, help=text, **extra)
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop (default uvloop)")
    p.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")
    return p


def _options(args: argparse.Namespace) -> ServerOptions:
    """The ServerOptions the flags ask for (InvalidArgumentError, OSError)."""
    token = auth.token_from_file(args.auth_token_file) if args.auth_token_file else auth.token_from_env()
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerOptions) if f.metadata["flag"]}
    peer_token = (auth.token_from_file(args.peer_token_file) if args.peer_token_file
                  else auth.as_token(os.environ.get(auth.PEER_ENV) or None))
    return ServerOptions(**flags, token=token, peer_token=peer_token)


async def _serve(args: argparse.Namespace, options: ServerOptions) -> None:
    server = await start_server(args.host, args.port, options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    host, port = server.address
    print(f"smb2-server listening on {host}:{port}", flush=True)
    if server.metrics is not None:
        print("smb2-server metrics on http://{}:{}/metrics".format(*server.metrics.address), flush=True)
    closed = False
    try:
        while not closed:
            await stop.wait()
            try:
                await server.close()
                closed = True
            except PersistenceError as exc:
                # the segments are still in memory and served: say so, and
                # let the operator free space and stop again
                stop.clear()
                log.error("%s; still serving: free space and send SIGTERM again "
                          "(SIGKILL drops the segments)", exc)
                print(f"smb2-server: {exc}; still serving", file=sys.stderr, flush=True)
    finally:
        if not closed:      # cancelled or failed: close, saving if it can
            await server.close()
        log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        options = _options(args)
    except InvalidArgumentError as exc:     # an option out of range
        print(f"smb2-server: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"smb2-server: cannot read the token file: {exc}", file=sys.stderr)
        return 2
    return run_service(_serve(args, options), loop=args.loop, command="smb2-server",
                       listen=f"{args.host}:{args.port}", fails=(PersistenceError, TransportError))


def run_service(service: Coroutine[Any, Any, None], *, loop: str, command: str, listen: str,
                fails: tuple[type[Exception], ...]) -> int:
    """Run a serving command's coroutine until it stops, on the event loop
    its ``--loop`` names ("uvloop" or "asyncio"): its exit code, 0, or 1
    with the reason on stderr where it failed with one of ``fails`` or
    could not listen on ``listen`` (smb2-server's and smb2-agent's)."""
    try:
        if loop == "uvloop":
            import uvloop
            uvloop.run(service)
        else:
            asyncio.run(service)
    except fails as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{command}: cannot listen on {listen}: {exc}", file=sys.stderr)
        return 1
    return 0

