"""Ports a test may name before anything listens on them.

A port the kernel hands out for ``bind(("", 0))`` comes from the ephemeral
range, the same range every outgoing connection on the host draws its local
port from: closed and bound again a moment later, it can already be some
client's (CI saw ``address already in use`` that way).  So these ports come
from below the ephemeral range, where the kernel never assigns one, in a
block of its own for each pytest-xdist worker (and one chosen by process id
otherwise), each checked free by binding it before it is handed out.
"""

from __future__ import annotations

import functools
import itertools
import os
import socket
import threading

LOWEST = 10_000
BLOCK = 600
_lock = threading.Lock()
_next: itertools.count[int] | None = None


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


@functools.cache
def _block_start() -> int:
    """The first port of this process's block (read once: the range and the worker do not change)."""
    blocks = max(1, (_ephemeral_low() - LOWEST) // BLOCK)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        index = int(worker[2:])
    else:
        # not an xdist worker: a block apart from the first sixteen workers' when there is room
        spare = max(1, blocks - 16)
        index = blocks - spare + os.getpid() % spare
    return LOWEST + (index % blocks) * BLOCK


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now and that the kernel will not
    give to anyone else's connection or ``bind(0)`` meanwhile."""
    global _next
    with _lock:
        if _next is None:
            # processes sharing a block (an xdist worker's children) start apart in it
            _next = itertools.count(os.getpid() * 101)
        for _ in range(BLOCK):
            port = _block_start() + next(_next) % BLOCK
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    raise OSError(f"no free port on {host} in this process's block below the ephemeral range")


def dead_address(host: str = "127.0.0.1") -> tuple[str, int]:
    """An address nothing listens on (a free port of this process's block)."""
    return (host, free_port(host))
