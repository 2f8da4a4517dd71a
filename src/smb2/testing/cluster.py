"""LocalCluster: N memory servers on this machine, for tests, demos and
benchmarks.

In-process (default) the servers run in the caller's event loop on free
ports.  With ``processes=True`` each server is a real ``smb2-server``
subprocess, started and torn down by the cluster; ``kill(i)`` and
``restart(i)`` inject faults.

With ``replicated=True`` the cluster also starts a private etcd (its own
data directory and free ports, stopped with the cluster), writes the first
membership view (epoch 1: every server a member) before any server starts,
and gives every server ``--membership etcd://127.0.0.1:PORT/<name>``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import uuid
from typing import Any

from .. import auth
from ..client import Client, connect
from ..errors import InterfaceError
from ..membership import NO_VIEW, Credentials, Membership, etcd_user, open_membership, setup_auth
from ..server import MemoryServer, start_server
from ..server.options import MIN_THREAD_PART
from .etcd import LocalEtcd
from .launch import AsyncServerProcess
from .ports import free_port

log = logging.getLogger("smb2.testing.cluster")


def thread_options(threads: int) -> dict[str, Any]:
    """Server options (``LocalCluster(options=...)``, ``start_server(**...)``)
    for ``threads`` server threads, each taking parts as small as a server
    allows: a test's small accumulates are then cut among the threads too,
    not only the large ones a job pushes."""
    return {"threads": threads, **({"thread_part": MIN_THREAD_PART} if threads > 1 else {})}


class LocalCluster:
    """``async with LocalCluster(servers=4) as cluster: client = await cluster.connect()``"""

    def __init__(self, servers: int = 4, *, processes: bool = False, capacity: int | str = "256MiB",
                 host: str = "127.0.0.1", server_args: list[str] | None = None,
                 start_timeout: float = 30.0, token: str | bytes | None = None,
                 data_dir: str | os.PathLike[str] | None = None, replicated: bool = False,
                 zones: list[str] | None = None, options: dict[str, Any] | None = None) -> None:
        if servers < 1:
            raise InterfaceError("a cluster needs at least one server")
        self.nservers = servers
        self.processes = processes
        self.capacity = capacity
        self.host = host
        self.server_args = list(server_args or [])
        # more server options (ServerOptions' fields, such as threads=2): the
        # in-process servers take them as they are, the processes as flags
        self.options = dict(options or {})
        self.start_timeout = start_timeout
        # servers require it; clients from ``connect`` present it
        self.token = auth.as_token(token)
        # server i saves and restores its segments in data_dir/server-<i>
        self.data_dir = data_dir
        # replicated: a private etcd holds the view of the cluster named self.name
        self.replicated = replicated
        # ... whose servers share a secret of their own to forward updates
        # to each other (auth.peer_proof): its clients cannot forge a forward
        self.peer_token = os.urandom(32).hex().encode() if replicated else None
        self.name = f"local-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.etcd: LocalEtcd | None = None
        # etcd's root user, which only this object knows
        self.etcd_root_password = os.urandom(16).hex()
        # server i says it is in zones[i] (smb2-server --zone)
        if zones is not None and len(zones) != servers:
            raise InterfaceError(f"zones names {len(zones)} zones for {servers} servers: name one per server")
        self.zones = zones
        self.servers: list[MemoryServer] = []          # in-process mode
        self.procs: list[AsyncServerProcess | None] = []           # processes mode
        self._addresses: list[tuple[str, int]] = []
        self._clients: list[Client] = []

    @property
    def addresses(self) -> list[str]:
        return [f"{h}:{p}" for h, p in self._addresses]

    @property
    def membership_url(self) -> str | None:
        """The servers' ``--membership`` URL (None unless replicated)."""
        return None if self.etcd is None else self.etcd.url(self.name)

    async def start(self) -> LocalCluster:
        try:
            ports = [0] * self.nservers
            if self.replicated:
                # the first view names the servers, so their ports are chosen first
                ports = [free_port(self.host) for _ in range(self.nservers)]
                await self._start_etcd([f"{self.host}:{p}" for p in ports])
            if self.processes:
                self.procs = list(await asyncio.gather(
                    *(self._spawn(self.host, ports[i], i) for i in range(self.nservers))))
                self._addresses = [(p.host, p.port) for p in self.procs if p is not None]
            else:
                for i in range(self.nservers):
                    s = await start_server(self.host, ports[i], capacity=self.capacity, token=self.token,
                                           peer_token=self.peer_token,
                                           data_dir=self._data_dir(i), membership=self.membership_url,
                                           zone=None if self.zones is None else self.zones[i],
                                           **self.options)
                    self.servers.append(s)
                self._addresses = [s.address for s in self.servers]
        except BaseException:
            await self.close()
            raise
        log.info("local cluster of %d servers: %s", self.nservers, ", ".join(self.addresses))
        return self

    async def _start_etcd(self, members: list[str]) -> None:
        self.etcd = await LocalEtcd(self.host).start()
        url = self.etcd.url(self.name)
        async with open_membership(url) as membership:
            view = await membership.change(NO_VIEW, members=members)
        if view.epoch != 1 or list(view.members) != members:
            raise InterfaceError(f"a fresh etcd at {url} already held a view: {view}")
        # only the servers may read or change the view from now on (docs/reliability.md)
        assert self.peer_token is not None
        await setup_auth(url, auth.etcd_password(self.peer_token, self.name), self.etcd_root_password)

    def etcd_credentials(self) -> Credentials:
        """The servers' etcd user (a test may play a thief of it)."""
        assert self.peer_token is not None
        return Credentials(etcd_user(self.name), auth.etcd_password(self.peer_token, self.name))

    def membership(self) -> Membership:
        """The cluster's view in its private etcd, as the servers' etcd user."""
        if self.membership_url is None:
            raise InterfaceError("only a LocalCluster(replicated=True) has a membership view")
        return open_membership(self.membership_url, self.etcd_credentials())

    def _data_dir(self, index: int) -> str | None:
        return None if self.data_dir is None else os.path.join(self.data_dir, f"server-{index}")

    async def _spawn(self, host: str, port: int, index: int) -> AsyncServerProcess:
        args = ["--capacity", str(self.capacity), *self.server_args]
        for name, value in self.options.items():
            args += ["--" + name.replace("_", "-"), str(value)]
        if self.data_dir is not None:
            args += ["--data-dir", str(self._data_dir(index))]
        if self.membership_url is not None:
            args += ["--membership", self.membership_url]
        if self.zones is not None:
            args += ["--zone", self.zones[index]]
        return await AsyncServerProcess.spawn(host, port, args, self.start_timeout, self.token, self.peer_token)

    async def connect(self, **kwargs: Any) -> Client:
        """A client of all servers (closed with the cluster if still open)."""
        if self.token is not None:
            kwargs.setdefault("token", self.token)
        client = await connect(self.addresses, **kwargs)
        self._clients.append(client)
        return client

    # -- faults (processes mode) ------------------------------------------
    async def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Kill server ``index`` with ``sig`` (default SIGKILL)."""
        proc = self._proc(index)
        await proc.stop(sig)

    async def restart(self, index: int) -> None:
        """Start server ``index`` again on its old port (after ``kill``)."""
        old = self._proc(index)
        if old.proc.returncode is None:
            await old.stop()
        self.procs[index] = await self._spawn(old.host, old.port, index)

    def _proc(self, index: int) -> AsyncServerProcess:
        if not self.processes:
            raise InterfaceError("kill/restart need LocalCluster(processes=True)")
        proc = self.procs[index]
        assert proc is not None
        return proc

    def pid(self, index: int) -> int:
        return self._proc(index).proc.pid

    # -- teardown -------------------------------------------------------------
    async def close(self) -> None:
        for c in self._clients:
            await c.close()
        self._clients.clear()
        for s in self.servers:
            await s.close()
        self.servers.clear()
        await asyncio.gather(*(p.stop() for p in self.procs if p is not None),
                             return_exceptions=True)
        self.procs.clear()
        if self.etcd is not None:
            await self.etcd.close()
            self.etcd = None

    async def __aenter__(self) -> LocalCluster:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class ExternalCluster:
    """A stand-in for LocalCluster naming servers that run elsewhere
    (``SMB2_SERVERS``), so the same tests and demos can target them."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.nservers = len(addresses)
        self._clients: list[Client] = []

    async def connect(self, **kwargs: Any) -> Client:
        client = await connect(self.addresses, **kwargs)
        self._clients.append(client)
        return client

    async def close(self) -> None:
        for c in self._clients:
            await c.close()
        self._clients.clear()


def external_servers() -> list[str]:
    return [s for s in (p.strip() for p in os.environ.get("SMB2_SERVERS", "").split(",")) if s]
