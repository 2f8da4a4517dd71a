"""Server lists from a scheduler: one order for every worker.

Every client of a buffer must list the servers in the same order (stripe i
lives on the i-th server).  On Slurm the hosts come from the job's
allocation (``SLURM_JOB_NODELIST``), on Kubernetes from a StatefulSet's pods
(``name-0.service``, ``name-1.service``, ...).  Both pass through
:func:`server_list`, the one place that orders hosts: naturally (``node2``
before ``node10``, ``pod-9`` before ``pod-10``), whatever order they were
given in, so that every process that asks gets the same list.
``smb2 servers`` prints it.

It is also where a command reads the list it was given (:func:`from_args`:
the same sources and precedence for ``smb2 ls``, ``stat``, ``rm``,
``doctor`` and ``servers``; :func:`from_environment` for ``connect``), and
where a list that names one server process twice is refused
(:func:`listed_twice`, by the ``server_id`` each server says at hello).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable, Mapping

from .errors import InvalidArgumentError
from .protocol import DEFAULT_PORT

SLURM_VARIABLES = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
_DIGITS = re.compile(r"(\d+)")
# a host name or address as a server list may carry it: no separators, no brackets
_HOST = re.compile(r"[A-Za-z0-9._:%-]+")


def natural_key(host: str) -> tuple[list[str | int], str]:
    """``node2`` before ``node10``: digit runs compare as numbers (the text
    breaks ties: ``n01`` and ``n1``)."""
    # re.split with a group alternates text, digits, text...: the types of
    # two keys agree position by position
    parts: list[str | int] = [int(p) if i % 2 else p for i, p in enumerate(_DIGITS.split(host))]
    return parts, host


def server_list(hosts: Iterable[str], port: int = DEFAULT_PORT) -> list[str]:
    """``HOST:PORT`` of one server on each host, in the one order every
    worker uses.  A host given twice is an error (it would be two stripes'
    server named once), and so is an empty list."""
    if not 0 < port < 65536:
        raise InvalidArgumentError(f"port {port} is not in 1..65535")
    seen: set[str] = set()
    for host in hosts:
        if not _HOST.fullmatch(host):
            raise InvalidArgumentError(f"{host!r} is not a host name or address")
        if host in seen:
            raise InvalidArgumentError(f"host {host} is listed twice: one memory server per host",
                                       hint="list each host once")
        seen.add(host)
    if not seen:
        raise InvalidArgumentError("no hosts: a server list needs at least one")
    return [f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in sorted(seen, key=natural_key)]


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets (``a[1,2],b`` -> ``a[1,2]``, ``b``)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                break
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise InvalidArgumentError(f"unbalanced brackets in host list {text!r}")
    items.append(text[start:])
    return items


def _expand(item: str, whole: str) -> list[str]:
    head, bracket, rest = item.partition("[")
    if not bracket:
        return [item]
    inner, _, tail = rest.partition("]")
    names = []
    for part in inner.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise InvalidArgumentError(f"bad range [{inner}] in host list {whole!r}")
        if not dash:
            names.append(low)
            continue
        if int(high) < int(low):
            raise InvalidArgumentError(f"range {part} runs backwards in host list {whole!r}")
        names += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return [head + n + t for n in names for t in _expand(tail, whole)]


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list (``node[01-03,7],gpu5``) as host names,
    in the order written (as ``scontrol show hostnames`` gives them)."""
    hosts = [h for item in _split_top(text.strip()) if item for h in _expand(item, text)]
    if not hosts:
        raise InvalidArgumentError(f"host list {text!r} names no host")
    return hosts


def slurm_hosts(environ: Mapping[str, str] | None = None) -> list[str]:
    """The hosts of the Slurm allocation this process runs in."""
    env = os.environ if environ is None else environ
    for name in SLURM_VARIABLES:
        if env.get(name):
            return expand_hostlist(env[name])
    raise InvalidArgumentError(
        f"no Slurm allocation here: {' and '.join(SLURM_VARIABLES)} are unset",
        hint="run it inside a job (sbatch, salloc, srun), or give the servers yourself")


def statefulset_hosts(name: str, replicas: int, service: str, namespace: str | None = None) -> list[str]:
    """The DNS names of a StatefulSet's pods behind its headless Service:
    ``name-0.service[.namespace.svc]`` ... (ordinal order: the server order)."""
    if replicas < 1:
        raise InvalidArgumentError(f"a StatefulSet of memory servers needs at least 1 replica, not {replicas}")
    domain = f".{namespace}.svc" if namespace else ""
    return [f"{name}-{i}.{service}{domain}" for i in range(replicas)]


def add_arguments(parser: argparse.ArgumentParser, *, positional: bool = True) -> None:
    """The ways a command is told its servers, the same for every command
    (``smb2 ls``, ``stat``, ``rm``, ``doctor``): resolved by :func:`from_args`."""
    if positional:
        parser.add_argument("servers", nargs="*", help="HOST:PORT of each server (or --servers; default: "
                            "SMB2_SERVERS)")
    parser.add_argument("--servers", "-s", dest="server_list", action="append", default=[],
                        metavar="HOST:PORT,...", help="the servers, comma-separated (default: SMB2_SERVERS)")
    parser.add_argument("--from-slurm", action="store_true",
                        help="one server on each host of this Slurm job (as `smb2 servers --from-slurm`)")
    parser.add_argument("--from-statefulset", metavar="NAME",
                        help="the pods of a StatefulSet (as `smb2 servers --from-statefulset`; "
                        "with --replicas, --service, --namespace)")
    parser.add_argument("--replicas", type=int, help="--from-statefulset: the StatefulSet's replicas")
    parser.add_argument("--service", help="--from-statefulset: its headless Service (default: NAME)")
    parser.add_argument("--namespace", help="--from-statefulset: its namespace (default: the client's own)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"--from-slurm, --from-statefulset: the servers' port (default {DEFAULT_PORT})")


def from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> list[str]:
    """The servers a command was given (see :func:`add_arguments`), in this
    order of precedence: listed (arguments and ``--servers``), derived
    (``--from-slurm``, ``--from-statefulset``), else ``SMB2_SERVERS``; an
    empty list where none of them names a server."""
    listed = [s.strip() for group in getattr(args, "server_list", []) for s in group.split(",") if s.strip()]
    listed += getattr(args, "servers", None) or []
    derived = bool(getattr(args, "from_slurm", False)) + bool(getattr(args, "from_statefulset", None))
    if derived + bool(listed) > 1:
        raise InvalidArgumentError("give the servers one way: a list, --from-slurm or --from-statefulset")
    if listed:
        return listed
    port = getattr(args, "port", DEFAULT_PORT)
    if getattr(args, "from_slurm", False):
        return server_list(slurm_hosts(environ), port)
    if getattr(args, "from_statefulset", None):
        name = args.from_statefulset
        if args.replicas is None:
            raise InvalidArgumentError("--from-statefulset needs --replicas N")
        return server_list(statefulset_hosts(name, args.replicas, args.service or name, args.namespace), port)
    return from_environment(environ)


def from_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """``SMB2_SERVERS`` as a list (empty where it is unset)."""
    env = os.environ if environ is None else environ
    return [s.strip() for s in env.get("SMB2_SERVERS", "").split(",") if s.strip()]


def listed_twice(identities: Iterable[tuple[str, str | None]]) -> InvalidArgumentError | None:
    """The error for a list that names one server process twice, or None.
    ``identities``: (address, server_id) of each server reached, in list
    order.  Two names of one host (``node1`` and its address, or two nodes'
    names where a server on all interfaces answers for both) reach the same
    process: its stripes would be counted twice, so the list is refused."""
    first: dict[str, str] = {}
    for address, server_id in identities:
        if not server_id:
            continue
        if server_id in first:
            return InvalidArgumentError(
                f"server listed twice: {first[server_id]} and {address} are the same process",
                hint="list each memory server once; where servers share a host, give each its own port or "
                     "address (smb2-server --host)")
        first[server_id] = address
    return None
