"""Starting ``smb2-server`` processes (and ``smb2-agent``, the host agent):
the one place that builds the command, hands the tokens over and reads the
ready line.

``smb2-server`` prints ``smb2-server listening on HOST:PORT`` on stdout once
it accepts connections (server/cli.py); everything that starts one -- tests,
LocalCluster(processes=True), the netns harness, benchmarks -- waits for that
line here.  :class:`ServerProcess` is the blocking launcher (a test's or a
tool's own process); :class:`AsyncServerProcess` is the one an event loop
awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from .. import auth
from ..errors import InterfaceError

#: the server's ready line (bytes: asyncio and the netns harness read raw pipes)
READY = re.compile(rb"smb2-server listening on (\S+):(\d+)")
#: the host agent's (smb2.agent), in the same form
AGENT_READY = re.compile(rb"smb2-agent listening on (\S+):(\d+)")


def ready_address(line: bytes | str) -> tuple[str, int] | None:
    """``(host, port)`` from a ``smb2-server listening on HOST:PORT`` line, or None."""
    m = READY.search(line.encode() if isinstance(line, str) else line)
    return None if m is None else (m.group(1).decode(), int(m.group(2)))


def server_command(*flags: str, python: str = sys.executable, host: str | None = None,
                   port: int | None = 0) -> list[str]:
    """The argv of one ``smb2-server`` (as ``python -m smb2.server``, so it is
    the server of the interpreter given)."""
    where = ([] if host is None else ["--host", host]) + ([] if port is None else ["--port", str(port)])
    return [python, "-m", "smb2.server", *where, *flags]


def server_env(env: Mapping[str, str] | None = None, token: bytes | None = None,
               peer_token: bytes | None = None) -> dict[str, str]:
    """The server's environment: ``env`` (default this process's) without the
    callers' tokens, plus the ones given.  Tokens go by environment, not argv:
    argv is visible to every user in ps."""
    out = {k: v for k, v in (os.environ if env is None else env).items() if k not in (auth.ENV, auth.PEER_ENV)}
    if token is not None:
        out[auth.ENV] = token.decode("utf-8", "surrogateescape")
    if peer_token is not None:
        out[auth.PEER_ENV] = peer_token.decode("utf-8", "surrogateescape")
    return out


class ServerProcess:
    """One ``smb2-server`` process on loopback (``--port 0``: the port it
    chose is ``self.port``); blocks until its ready line (InterfaceError,
    with the server's stderr, if it exits first)."""

    def __init__(self, *flags: str, env: Mapping[str, str] | None = None, python: str = sys.executable,
                 token: bytes | None = None, host: str | None = None,
                 stderr: int | IO[Any] = subprocess.PIPE) -> None:
        cmd = self.command(*flags, python=python, host=host)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                     env=server_env(env, token))
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        found = self.ready(line)
        if found is None:
            self.proc.kill()
            self.proc.wait()
            raise InterfaceError(f"{self.what} did not start ({' '.join(cmd)}): "
                                 f"{line.strip() or 'no ready line'}\n{self.stderr()[-2000:]}")
        self.host, self.port = found
        self.address = ("127.0.0.1" if self.host in ("0.0.0.0", "") else self.host, self.port)

    @property
    def endpoint(self) -> str:
        """``host:port`` as ``smb2.connect`` takes it."""
        return f"{self.address[0]}:{self.port}"

    what = "smb2-server"

    @staticmethod
    def command(*flags: str, python: str, host: str | None) -> list[str]:
        return server_command(*flags, python=python, host=host)

    @staticmethod
    def ready(line: str) -> tuple[str, int] | None:
        return ready_address(line)

    @property
    def rss(self) -> int:
        """The server process's resident memory in bytes (/proc/PID/status)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
        raise AssertionError("no VmRSS")

    def stderr(self) -> str:
        """What the server wrote on stderr, once it has exited ("" before, or
        when stderr went elsewhere)."""
        if self.proc.poll() is None or self.proc.stderr is None:
            return ""
        return self.proc.stderr.read()

    def stop(self, timeout: float = 30, sig: int = signal.SIGTERM) -> int:
        """Signal the server (SIGTERM: a clean stop) and wait; SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class AgentProcess(ServerProcess):
    """One ``smb2-agent`` process (the host agent), on loopback on a port of
    its choosing, for the memory servers its flags name (``--servers``);
    blocks until its ready line."""

    what = "smb2-agent"

    @staticmethod
    def command(*flags: str, python: str, host: str | None) -> list[str]:
        return agent_command(*flags, python=python, listen=f"{host or '127.0.0.1'}:0")

    @staticmethod
    def ready(line: str) -> tuple[str, int] | None:
        return agent_ready_address(line)


@contextlib.contextmanager
def server_process(*flags: str, **kwargs: Any) -> Iterator[ServerProcess]:
    """``with server_process("--capacity", "64MiB") as s:`` a server, stopped after."""
    with ServerProcess(*flags, **kwargs) as s:
        yield s


class AsyncServerProcess:
    """One ``smb2-server`` subprocess of an event loop (LocalCluster's processes mode)."""

    def __init__(self, proc: asyncio.subprocess.Process, host: str, port: int) -> None:
        self.proc = proc
        self.host = host
        self.port = port

    @classmethod
    async def spawn(cls, host: str, port: int, args: list[str], timeout: float,
                    token: bytes | None = None, peer_token: bytes | None = None) -> AsyncServerProcess:
        """Start it, wait up to ``timeout`` for its ready line; InterfaceError
        with its stderr if it did not come."""
        cmd = server_command(*args, host=host, port=port)
        return cls(*await _spawn_ready(cmd, server_env(None, token, peer_token), timeout, READY, "smb2-server"))

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        """Signal it and wait; SIGKILL after ``timeout``.  Its exit status."""
        if self.proc.returncode is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        return self.proc.returncode


class AsyncAgentProcess(AsyncServerProcess):
    """One ``smb2-agent`` subprocess of an event loop (the host agent,
    smb2.agent), for the memory servers ``servers``."""

    @classmethod
    async def spawn_agent(cls, servers: list[str], *flags: str, listen: str = "127.0.0.1:0",
                          timeout: float = 30.0, token: bytes | None = None) -> AsyncAgentProcess:
        """Start it (``--listen 127.0.0.1:0``: any free port, read from its
        ready line), wait up to ``timeout`` for its ready line; InterfaceError
        with its stderr if it did not come."""
        cmd = agent_command("--servers", ",".join(servers), *flags, listen=listen)
        return cls(*await _spawn_ready(cmd, server_env(None, token), timeout, AGENT_READY, "smb2-agent"))

    @property
    def endpoint(self) -> str:
        """``host:port`` as ``smb2.connect`` (and ``SMB2_AGENT``) take it."""
        return f"{'127.0.0.1' if self.host in ('0.0.0.0', '') else self.host}:{self.port}"


def agent_command(*flags: str, python: str = sys.executable, listen: str = "127.0.0.1:0") -> list[str]:
    """The argv of one ``smb2-agent`` (as ``python -m smb2.agent``)."""
    return [python, "-m", "smb2.agent", "--listen", listen, *flags]


def agent_ready_address(line: bytes | str) -> tuple[str, int] | None:
    """``(host, port)`` from a ``smb2-agent listening on HOST:PORT`` line, or None."""
    m = AGENT_READY.search(line.encode() if isinstance(line, str) else line)
    return None if m is None else (m.group(1).decode(), int(m.group(2)))


async def _spawn_ready(cmd: list[str], env: dict[str, str], timeout: float, ready: re.Pattern[bytes],
                       what: str) -> tuple[asyncio.subprocess.Process, str, int]:
    """Start ``cmd`` in a session of its own and wait up to ``timeout`` for
    its ready line: the process, and the host and port the line names;
    InterfaceError with its stderr if the line did not come."""
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout)
    except TimeoutError:
        line = b""
    m = ready.search(line)
    if m is None:
        if proc.returncode is None:
            proc.kill()
        err = (await proc.stderr.read())[-2000:].decode(errors="replace")
        await proc.wait()
        raise InterfaceError(f"{what} did not start ({' '.join(cmd)}): "
                             f"{line.decode(errors='replace').strip() or 'no ready line'}\n{err}")
    # stderr keeps flowing; drain it so the child never blocks on a full pipe
    asyncio.ensure_future(drain(proc.stderr))
    return proc, m.group(1).decode(), int(m.group(2))


async def drain(stream: asyncio.StreamReader) -> None:
    """Read ``stream`` to its end (a child never blocks on a full pipe)."""
    while await stream.read(65536):
        pass
