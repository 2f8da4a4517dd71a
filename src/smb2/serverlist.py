"""Server lists from a scheduler: one order for every worker.

Every client of a buffer must list the servers in the same order (stripe i
lives on the i-th server).  On Slurm the hosts come from the job's
allocation (``SLURM_JOB_NODELIST``), on Kubernetes from a StatefulSet's pods
(``name-0.service``, ``name-1.service``, ...).  Both pass through
:func:`server_list`, the one place that orders hosts: naturally (``node2``
before ``node10``, ``pod-9`` before ``pod-10``), whatever order they were
given in, so that every process that asks gets the same list.
``smb2 servers`` prints it.
"""

from __future__ import annotations

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
