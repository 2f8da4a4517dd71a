"""The ``smb2-agent`` command: options, the ready line, signals, exit codes."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from .. import auth, serverlist
from ..errors import InvalidArgumentError, Smb2Error
from ..mirror import AGENT_ENV, DEFAULT_AGENT_PORT, DTYPES
from ..protocol import parse_size
from ..server.cli import run_service
from ..transport import KINDS
from ..version import __version__
from .forward import DEFAULT_GATHER, DEFAULT_PERIOD
from .service import Agent

log = logging.getLogger("smb2.agent")

DESCRIPTION = f"""\
The host agent: run one per worker host.  It serves a local smb2 memory
server, which the host's workers reach over shm, and is the host's one
client of the memory servers.  A worker mirrors a region of a remote buffer
through it (smb2.mirror.AgentMirror: {' or '.join(DTYPES)}) and pushes into
the mirror on this host; at most every --period the agent forwards the
host's combined pushes as one accumulate to the memory servers and pulls
the region once for all the host's workers, gathering a push (an ask for
a pull) from each of the host's workers first, for at most --gather.  Each push reaches the servers
exactly once.  If the agent stops, the workers' next operation says how
many of their pushes may not have reached the servers; the servers' copy
stays intact."""

EPILOG = f"""\
a worker sets {AGENT_ENV}=HOST:PORT (this agent's --listen; default
127.0.0.1:{DEFAULT_AGENT_PORT}) and the cluster's {auth.ENV}, as it does
for the servers.  Unset {AGENT_ENV} to reach the servers directly."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="smb2-agent", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"smb2-agent {__version__}")
    p.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_AGENT_PORT}", metavar="HOST:PORT",
                   help=f"where the agent's own server listens for the host's workers (default "
                        f"127.0.0.1:{DEFAULT_AGENT_PORT}; port 0: any free, printed on the ready line)")
    serverlist.add_arguments(p, positional=False)
    p.add_argument("--capacity", default="1GiB",
                   help="memory of the agent's server; a mirror takes twice its region (the data and the "
                        "agent's copy of the servers' region) (default 1GiB)")
    p.add_argument("--period", type=float, default=DEFAULT_PERIOD, metavar="SECONDS",
                   help=f"the shortest time between two forward cycles of a mirror (default {DEFAULT_PERIOD:g})")
    p.add_argument("--gather", type=float, default=DEFAULT_GATHER, metavar="SECONDS",
                   help=f"the longest a forward waits for a push from each of the host's workers, and a pull for an "
                        f"ask from each, after the first (how many: the mirror's host_workers, torchrun's "
                        f"LOCAL_WORLD_SIZE for AsyncOptimizer); what it adds to a worker's read and to how long a "
                        f"push stays on the host; 0: each cycle forwards and pulls what came (default "
                        f"{DEFAULT_GATHER:g})")
    p.add_argument("--auth-token-file", metavar="FILE",
                   help=f"the cluster's secret, which the workers prove to the agent and the agent to the "
                        f"servers (default: ${auth.ENV} if set, else no authentication)")
    p.add_argument("--shm-socket", metavar="PATH",
                   help="the Unix socket the host's workers map the mirrors through (default: "
                        "$XDG_RUNTIME_DIR/smb2/PORT-PID.sock, else under /tmp, per user; its directory must "
                        "belong to this user, mode 0700).  A worker in another container reaches it only where "
                        "that directory is mounted at the same path; one that cannot reaches the agent over TCP")
    p.add_argument("--transport", choices=KINDS, default=None,
                   help="how the agent reaches the memory servers (default: $SMB2_TRANSPORT, else auto)")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop (default uvloop)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO (default: mirrors started and stopped), "
                                                       "WARNING, ERROR")
    return p


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, str(DEFAULT_AGENT_PORT)
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidArgumentError(f"--listen takes HOST:PORT, not {text!r}")
    return host, int(port)


async def _serve(agent: Agent) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await agent.start()
    try:
        host, port = agent.address
        print(f"smb2-agent listening on {host}:{port}", flush=True)
        await stop.wait()
        log.info("stopping: the mirrors forward what was pushed to them, then the agent closes")
    finally:
        await agent.close()
    log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        host, port = _listen(args.listen)
        servers = serverlist.from_args(args)
        if not servers:
            raise InvalidArgumentError("no memory servers given: --servers HOST:PORT,... or SMB2_SERVERS")
        parse_size(args.capacity)
        if not args.period > 0:
            raise InvalidArgumentError(f"--period must be a positive number of seconds, not {args.period}")
        if not args.gather >= 0:
            raise InvalidArgumentError(f"--gather must be 0 or a positive number of seconds, not {args.gather}")
        token = auth.token_from_file(args.auth_token_file) if args.auth_token_file else auth.token_from_env()
        agent = Agent(servers, host=host, port=port, capacity=args.capacity, token=token, period=args.period,
                      gather=args.gather, transport=args.transport,
                      server_options={"shm_socket": args.shm_socket} if args.shm_socket else None)
    except InvalidArgumentError as exc:
        print(f"smb2-agent: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"smb2-agent: cannot read the token file: {exc}", file=sys.stderr)
        return 2
    return run_service(_serve(agent), loop=args.loop, command="smb2-agent", listen=args.listen, fails=(Smb2Error,))
