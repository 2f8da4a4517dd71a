"""The agent: its own memory server, its one client of the memory servers,
and the mirrors it finds on its server.

The workers of the host reach the agent's server over shm (it is an
ordinary ``smb2-server`` in the agent's event loop, shm on), and make
their mirror buffers there (``smb2.mirror``).  The agent finds them by
looking at its server's buffer names every ``DISCOVER_EVERY`` seconds: the
server runs in this process, so the look reads a dict, with no request or
reply; a new mirror waits at most that long (once per mirror per job)
before the agent takes it up.  The agent itself reaches its server through
an ordinary client (shm in this process), so its reads, accumulates and
atomics on the mirrors are the same operations, with the same atomicity,
as the workers'.

The agent is one client of the memory servers for the whole host: one
connection per server, shared by every mirror.  Where they cannot be
reached at start, or later, it retries with backoff and logs (WARNING); it
does not stop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

from ..client import Client, connect
from ..errors import InterfaceError, Smb2Error, TransportError
from ..mirror import PREFIX
from ..server import MemoryServer
from .forward import DEFAULT_GATHER, DEFAULT_PERIOD, LOG_EVERY, MAX_BACKOFF, Mirror

log = logging.getLogger("smb2.agent")

#: how often the agent looks for new mirror buffers on its server (seconds)
DISCOVER_EVERY = 0.05
#: how long a stopping agent lets its mirrors forward what was pushed
FLUSH_TIMEOUT = 10.0


class Agent:
    """One host's agent: ``await Agent(servers, ...).start()``, then
    ``await agent.close()``.  ``host``/``port``: where its own server
    listens (port 0: any free, see :attr:`address`); ``capacity``: that
    server's memory (every mirror's data and the agent's copy of its remote
    region live there); ``token``: the cluster's secret, which the workers
    present to the agent and the agent to the memory servers."""

    def __init__(self, servers: list[str], *, host: str = "127.0.0.1", port: int = 0,
                 capacity: int | str = "1GiB", token: str | bytes | None = None,
                 period: float = DEFAULT_PERIOD, gather: float = DEFAULT_GATHER, transport: str | None = None,
                 connect_timeout: float = 10.0, server_options: dict[str, Any] | None = None) -> None:
        if not servers:
            raise InterfaceError("the agent needs the memory servers: --servers or SMB2_SERVERS")
        self._servers = list(servers)
        self.host = host
        self.port = port
        self.capacity = capacity
        self.token = token
        self.period = period
        self.gather = gather
        self.transport = transport
        self.connect_timeout = connect_timeout
        self.server_options = dict(server_options or {})
        self.server: MemoryServer | None = None
        self.local: Client | None = None
        self._remote: Client | None = None
        self._connected = asyncio.Event()
        self._trouble: str | None = "not connected yet"
        self.mirrors: dict[str, tuple[Mirror, asyncio.Task[None]]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    # -- what a mirror needs of the agent (forward.Remote) -----------------------------
    @property
    def servers(self) -> list[str]:
        return self._servers

    @property
    def trouble(self) -> str | None:
        return self._trouble

    async def client(self) -> Client:
        await self._connected.wait()
        assert self._remote is not None
        return self._remote

    # -- life -----------------------------------------------------------------------
    @property
    def address(self) -> tuple[str, int]:
        """Where the agent's server listens."""
        assert self.server is not None
        return self.server.address

    async def start(self) -> Agent:
        """Start the server, connect to it and to the memory servers (the
        first attempt now: a refused token is raised; servers that do not
        answer are retried in the background), and look for mirrors."""
        server = MemoryServer(capacity=self.capacity, token=self.token, **self.server_options)
        # said from the first connection on: a doctor that reaches the agent
        # while it still connects learns it is one, and why it waits
        server.stat_extra["agent"] = self.describe
        await server.start(self.host, self.port)
        self.server = server
        try:
            host, port = self.server.address
            near = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
            self.local = await connect([f"{near}:{port}"], token=self.token, timeout=self.connect_timeout)
            try:
                await self._connect_once()
            except TransportError as exc:
                self._note_trouble(exc)
                self._tasks.append(asyncio.ensure_future(self._connect_loop()))
            self._tasks.append(asyncio.ensure_future(self._discover()))
        except BaseException:
            await self.close(flush=False)
            raise
        log.info("agent serving on %s:%d for the memory servers %s, a mirror cycle at most every %g s, gathering "
                 "the host's workers' pushes and asks for at most %g s", *self.server.address,
                 ", ".join(self._servers), self.period, self.gather)
        return self

    async def close(self, *, flush: bool = True) -> None:
        """Stop: each ready mirror forwards what was pushed to it so far
        (``flush``, for up to FLUSH_TIMEOUT seconds), then everything closes."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        running = [(m, t) for m, t in self.mirrors.values() if not t.done()]
        for mirror, task in running:
            if flush and mirror.state == "ready":
                mirror.stop()
            else:
                task.cancel()
        if running:
            _, late = await asyncio.wait([t for _, t in running], timeout=FLUSH_TIMEOUT)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        self.mirrors.clear()
        for client in (self.local, self._remote):
            if client is not None:
                await client.close()
        if self.server is not None:
            await self.server.close(save=False)

    def describe(self) -> dict[str, Any]:
        """What the agent's server says of it in its stat (``"agent"``):
        that it is a host agent, its memory servers in their order, the
        server id each of its connections reached (None: not connected now),
        why it cannot reach them (None: it can; a mirror's trouble counts),
        its mirrors by state, and how many cycles, forwards and pulls its
        mirrors made (those it holds now).  ``smb2 doctor`` checks it."""
        links = self._remote.links if self._remote is not None else ()
        ids = [t.server_info.get("server_id") if (t := link.open) is not None else None for link in links]
        mirrors = [m for m, _ in self.mirrors.values()]
        # a failed or stopped mirror's last trouble is history, not the servers' state now
        trouble = self._trouble or next((m.trouble for m in mirrors if m.trouble is not None
                                         and m.state in ("waiting", "starting", "ready")), None)
        return {"servers": list(self._servers), "server_ids": ids or [None] * len(self._servers),
                "trouble": trouble, "period": self.period, "gather": self.gather,
                "mirrors": dict(collections.Counter(m.state for m in mirrors)),
                **{what: sum(getattr(m, what) for m in mirrors) for what in ("cycles", "forwards", "pulls")}}

    # -- the memory servers ----------------------------------------------------------
    async def _connect_once(self) -> None:
        self._remote = await connect(self._servers, token=self.token, transport=self.transport,
                                     timeout=self.connect_timeout)
        self._trouble = None
        self._connected.set()

    async def _connect_loop(self) -> None:
        delay = 0.1
        logged = time.monotonic()
        while True:
            await asyncio.sleep(delay)
            try:
                await self._connect_once()
            except (TransportError, Smb2Error, OSError) as exc:
                self._trouble = getattr(exc, "message", None) or str(exc)
                if time.monotonic() - logged >= LOG_EVERY:
                    logged = time.monotonic()
                    self._note_trouble(exc)
                delay = min(2 * delay, MAX_BACKOFF * 2)
                continue
            log.warning("agent: connected to the memory servers %s", ", ".join(self._servers))
            return

    def _note_trouble(self, exc: BaseException) -> None:
        self._trouble = getattr(exc, "message", None) or str(exc)
        log.warning("agent: cannot reach the memory servers %s (%s); retrying with backoff",
                    ", ".join(self._servers), self._trouble)

    # -- the mirrors -------------------------------------------------------------------
    async def _discover(self) -> None:
        while True:
            self._scan()
            await asyncio.sleep(DISCOVER_EVERY)

    def _scan(self) -> None:
        """Start a task for each new mirror buffer on the server; forget the
        ones whose buffer is gone (or was made again)."""
        assert self.server is not None and self.local is not None
        present = {name: seg.id for name, seg in self.server.by_name.items() if name.startswith(PREFIX)}
        for name, (mirror, task) in list(self.mirrors.items()):
            if present.get(name) != mirror.segment:
                task.cancel()
                del self.mirrors[name]
        for name, segment in present.items():
            if name not in self.mirrors:
                mirror = Mirror(self.local, name, segment, self, self.period, self.gather)
                self.mirrors[name] = (mirror, asyncio.ensure_future(mirror.run()))
