"""A private single-node etcd for a replicated test cluster on this machine.

``LocalCluster(replicated=True)`` starts one (its own data directory, free
ports) and stops it with the cluster; the netns harness (``smb2.testing.netns``) starts one
inside a namespace host through :meth:`LocalEtcd.command`.  In production
run a real etcd cluster (three nodes; docs/reliability.md "Replication").
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import tempfile
import time
from typing import IO, Any

from ..errors import InterfaceError, MembershipError
from ..membership import http_post
from .ports import free_port

log = logging.getLogger("smb2.testing.etcd")

ETCD = "etcd"


def etcd_binary() -> str:
    """The etcd executable on PATH (InterfaceError saying how to get it)."""
    path = shutil.which(ETCD)
    if path is None:
        raise InterfaceError("a replicated cluster needs etcd, and there is no etcd on PATH",
                             hint="install Debian's etcd-server (apt-get install etcd-server; "
                                  "tools/host_deps.sh does it) or put an etcd 3.4+ binary on PATH")
    return path


class LocalEtcd:
    """``async with LocalEtcd() as etcd: etcd.endpoint`` -> "127.0.0.1:PORT".

    ``stop()`` then ``start()`` again keeps the data directory and the ports,
    so what was written survives (an etcd restart)."""

    def __init__(self, host: str = "127.0.0.1", *, data_dir: str | None = None,
                 client_port: int = 0, peer_port: int = 0, start_timeout: float = 30.0) -> None:
        self.host = host
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="smb2-etcd-")
        self.start_timeout = start_timeout
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def url(self, cluster: str) -> str:
        """The membership URL of ``cluster`` in this etcd."""
        return f"etcd://{self.endpoint}/{cluster}"

    def command(self) -> list[str]:
        """The etcd command line (one member, its own cluster, data in data_dir)."""
        client = f"http://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        return [etcd_binary(), "--name", "smb2", "--data-dir", os.path.join(self.data_dir, "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"smb2={peer}", "--initial-cluster-token", f"smb2-{self.peer_port}",
                "--log-level", "error", "--logger", "zap"]

    def _log_file(self, mode: str) -> IO[Any]:
        # etcd's own log (errors only), beside its data
        return open(os.path.join(self.data_dir, "etcd.log"), mode)  # the caller closes it

    async def start(self) -> LocalEtcd:
        with self._log_file("ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                *self.command(), stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
                start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                status, _ = await asyncio.wait_for(
                    http_post(self.host, self.client_port, "/v3/kv/range", {"key": "AA=="}), 2.0)
                if status == 200:
                    break
            except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError):
                pass
            if self.proc.returncode is not None or time.monotonic() > deadline:
                await self.stop()
                with self._log_file("rb") as f:
                    tail = f.read()[-2000:].decode(errors="replace")
                raise MembershipError(f"etcd did not start at {self.endpoint}", detail=tail,
                                      hint=f"see {f.name}; is the port taken or the disk full?")
            await asyncio.sleep(0.05)
        log.info("etcd at %s (data in %s)", self.endpoint, self.data_dir)
        return self

    async def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop etcd (the data directory stays, for a later ``start``)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.returncode is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            await asyncio.wait_for(proc.wait(), 10.0)
        except TimeoutError:
            proc.kill()
            await proc.wait()

    async def close(self) -> None:
        """Stop etcd and remove a data directory it made itself."""
        await self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    async def __aenter__(self) -> LocalEtcd:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
