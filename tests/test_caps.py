"""The caps of a memory server are sized from the machine and said (--help,
the log, stat, the metrics, smb2 doctor), a cap reached is refused in words
and counted, and a job's workers connecting at once all get in: real
``smb2-server`` processes, real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import re
import resource
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

import smb2
from smb2 import doctor
from smb2.protocol import H_STATUS
from smb2.server.memory import LISTEN_BACKLOG, listen_backlog_cap
from smb2.server.options import ServerOptions
from smb2.server.sizing import MIN_PER_HOST, PER_HOST_SHARE, size
from smb2.testing.hostile import TOKEN
from smb2.testing.launch import server_process
from smb2.testing.ports import dead_address
from smb2.testing.proxy import FaultProxy
from smb2.testing.wire import hello, reply

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
# a connect storm of this many clients: more than the old default's 1,024
STORM = 1100
# spread over these loopback source addresses, as a job's workers come from several hosts
SOURCES = ("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4")


@contextlib.contextmanager
def soft_file_limit(n: int) -> Iterator[None]:
    """This process's soft file limit lowered to ``n`` (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(n, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def stat_of(address: tuple[str, int], token: bytes | None = None) -> dict:
    async with await smb2.connect([address], transport="tcp", token=token) as c:
        return (await c.stat())[0]


def test_help_states_the_machine_sized_caps() -> None:
    out = subprocess.run([sys.executable, "-m", "smb2.server", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    defaults = ServerOptions()
    sized = size(capacity=defaults.capacity, max_receive_memory=defaults.max_receive_memory,
                 max_reply_bytes=defaults.max_reply_bytes, max_inflight=defaults.max_inflight,
                 memfd_segments=True)
    words = " ".join(out.split())       # argparse wraps the help
    for flag, value in (("max-connections", sized.max_connections),
                        ("max-connections-per-host", sized.max_connections_per_host),
                        ("max-rdma-connections", sized.max_rdma_connections),
                        ("rdma-staging-memory", sized.rdma_staging_memory),
                        ("max-buffers", sized.buffers_fit)):
        # its entry under "options:", not the usage line
        at = words.index(f"--{flag} {flag.upper().replace('-', '_')} ", words.index("options:"))
        said = re.search(r"defaults: (\S+) \(file limit (\d+)", words[at:])
        assert said is not None and said.groups() == (str(value), str(sized.fd_limit)), flag
    assert sized.max_connections_per_host == max(MIN_PER_HOST, sized.max_connections // PER_HOST_SHARE)


def test_the_caps_follow_the_file_limit_and_the_memory() -> None:
    defaults = {"max_receive_memory": "256MiB", "max_reply_bytes": "1MiB", "max_inflight": 1024,
                "memfd_segments": True}
    per_conn = 256 * KiB + 64 * KiB + 4 * KiB + MiB + 1024 * KiB
    # a pod of 5 GiB serving 4 GiB: the memory left binds (half of it over a busy connection)
    pod = size(capacity="4GiB", fds=20000, memory=5 * GiB, **defaults)
    assert pod.connection_bytes == per_conn
    assert pod.max_connections == (GiB - 256 * MiB) // 2 // per_conn == 165
    assert pod.connections_bound_by == "memory"
    assert pod.max_connections_per_host == 128 and pod.max_rdma_connections == 165
    assert pod.rdma_staging_memory == "256MiB"       # the floor of 64 areas: a quarter of 768 MiB is less
    # a 64 GiB host with few files: the file limit binds, half of it for connections, the rest for buffers
    host = size(capacity="8GiB", fds=3000, memory=64 * GiB, **defaults)
    assert host.max_connections == (3000 - 64) // 2 and host.connections_bound_by == "file limit"
    assert host.max_connections_per_host == 367
    assert host.buffers_fit == (3000 - host.max_connections - 64) // 2 - 1
    assert host.rdma_staging_memory == "4096MiB"      # a sixteenth of 64 GiB: 1,024 peers' areas
    # without memfds the buffers hold no files: connections take the file limit
    assert size(capacity="8GiB", fds=3000, memory=64 * GiB, **{**defaults, "memfd_segments": False}
                ).max_connections == 3000 - 64


async def test_the_server_raises_its_file_limit_and_reports_its_caps() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= 1024:
        pytest.skip(f"the hard file limit ({hard}) leaves nothing to raise")
    with soft_file_limit(1024), server_process("--capacity", "64MiB", "--log-level", "INFO") as srv:
        stat = await stat_of(srv.address)
        report = await doctor.diagnose([srv.endpoint])
    text = srv.stderr()         # all of it, now that it stopped
    assert f"raised this process's file limit (ulimit -n) from 1024 to its hard limit {hard}" in text
    limits = stat["limits"]
    assert limits["fd_limit"] == hard
    opts = ServerOptions(capacity="64MiB")
    assert limits["max_connections"] == opts.max_connections
    assert limits["max_rdma_connections"] == opts.max_rdma_connections
    assert limits["listen_backlog"] == LISTEN_BACKLOG
    assert f"--max-connections {opts.max_connections}" in text        # the start-up log says them
    # smb2 doctor reads them from stat
    assert report.servers[0].limits == limits
    line = doctor.limits_line(report.servers[0])
    assert f"/{opts.max_connections} connections" in line and f"file limit {hard}" in line


def listen_backlog(port: int) -> int:
    """The backlog of the socket listening on ``port``: ss shows it as Send-Q."""
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return int(out.split()[2])


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read the listen backlog")
def test_the_listen_backlog_takes_a_job_connecting_at_once() -> None:
    with server_process("--capacity", "16MiB") as srv:
        cap = listen_backlog_cap()
        assert listen_backlog(srv.port) == min(LISTEN_BACKLOG, cap if cap is not None else LISTEN_BACKLOG)


async def test_a_full_server_refuses_in_words_and_counts_it(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client.parser", reason="the metrics need prometheus-client")
    from smb2.testing.metrics import MetricsServer, value
    token = tmp_path / "token"
    token.write_bytes(TOKEN)
    token.chmod(0o600)
    srv = MetricsServer("--capacity", "16MiB", "--auth-token-file", str(token), "--max-connections", "3")
    try:
        clients = [await smb2.connect([srv.address], transport="tcp", token=TOKEN) for _ in range(3)]
        try:
            with pytest.raises(smb2.OutOfMemory) as err:
                await smb2.connect([srv.address], transport="tcp", token=TOKEN)
            # the server, the cap, the option that raises it
            assert "maximum of 3 connections" in err.value.message
            assert "raise --max-connections on the server" in err.value.message
            assert err.value.server == f"{srv.address[0]}:{srv.address[1]}"
        finally:
            for c in clients:
                await c.close()
        samples = await srv.scrape()
        assert value(samples, "smb2_refused_total", reason="connection_limit") == 1
        assert value(samples, "smb2_limit", limit="max_connections") == 3
    finally:
        srv.stop()


async def _hello(address: tuple[str, int], source: str) -> tuple[int, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(*address, local_addr=(source, 0))
    writer.write(hello())
    hdr, body = await reply(reader)
    assert hdr[H_STATUS] != 0 or msgpack.unpackb(body)["version"]
    return hdr[H_STATUS], writer


async def test_a_connect_storm_beyond_the_old_default_is_admitted_whole() -> None:
    """1,100 clients connect at once (the old default took 1,024): with the
    machine-sized default every one says hello and is answered."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < STORM + 200:
        pytest.skip(f"the hard file limit ({hard}) cannot hold {STORM} client sockets")
    with server_process("--capacity", "16MiB") as srv:
        limits = (await stat_of(srv.address))["limits"]
        if limits["max_connections"] <= STORM or limits["max_connections_per_host"] * len(SOURCES) <= STORM:
            pytest.skip(f"this machine sizes the server to {limits['max_connections']} connections")
        with soft_file_limit(hard if hard != resource.RLIM_INFINITY else 1 << 16):
            got = await asyncio.wait_for(asyncio.gather(
                *(_hello(srv.address, SOURCES[i % len(SOURCES)]) for i in range(STORM))), 120)
            try:
                assert [status for status, _ in got] == [0] * STORM
                stat = await stat_of(srv.address)
                assert stat["connections"] == STORM + 1         # and the one asking
                assert stat["connections_refused"] == 0 and stat["refused"] == 0
            finally:
                for _, w in got:
                    w.close()


async def test_a_connection_reset_while_connecting_is_tried_again() -> None:
    """A connection the crowded path resets before hello is answered is
    tried again (after a jittered pause, within the connect timeout); the
    client connects and works.  A refused port is still said at once."""
    with server_process("--capacity", "16MiB") as srv, FaultProxy(srv.address) as proxy:
        proxy.cut_after(up=0)           # the first connection is reset at its hello
        async with await smb2.connect([proxy.address], transport="tcp", timeout=30) as c:
            buf = await c.create("b", 64)
            await buf.write(0, b"after a reset")
            assert bytes(await buf.read(0, 13)) == b"after a reset"
        assert proxy.cuts == 1 and proxy.connections == 2
    nobody = dead_address()
    with pytest.raises(smb2.TransportError) as err:
        await smb2.connect([nobody], transport="tcp", timeout=30)
    assert err.value.errno == errno.ECONNREFUSED
