"""LocalCluster in both modes, and the shipped pytest fixture."""

from __future__ import annotations

import os

import numpy as np
import pytest

import smb2


async def test_process_cluster_serves_and_tears_down() -> None:
    async with smb2.LocalCluster(servers=3, processes=True, capacity="64MiB") as cluster:
        pids = [cluster.pid(i) for i in range(3)]
        client = await cluster.connect()
        buf = await client.create("procs", 10 << 20, stripe=1 << 20)
        data = np.random.default_rng(5).integers(0, 256, buf.nbytes, dtype=np.uint8)
        await buf.write(0, data)
        assert np.array_equal(await buf.read(0, buf.nbytes), data)
        stats = await client.stat()
        assert sorted(s["address"] for s in stats) == sorted(cluster.addresses)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_killed_server_fails_fast_and_comes_back() -> None:
    async with smb2.LocalCluster(servers=2, processes=True, capacity="64MiB") as cluster:
        client = await cluster.connect()
        buf = await client.create("faulty", 4 << 20, stripe=1 << 20)
        await buf.write(0, b"x" * buf.nbytes)
        await cluster.kill(1)
        # the killed server's stripes fail with a TransportError ...
        with pytest.raises(smb2.TransportError):
            await buf.read(0, buf.nbytes)
        # ... the other server's stripes still work
        other = next(i for i in range(4) if (buf.first + i) % 2 == 0)
        assert bytes(await buf.read(other << 20, 3)) == b"xxx"
        await cluster.restart(1)
        # the next operation reconnects; the restarted server lost its memory
        with pytest.raises(smb2.NoSuchBuffer):
            await buf.read(0, buf.nbytes)
        await client.destroy("faulty")
        again = await client.create("faulty", 4 << 20, stripe=1 << 20)
        await again.write(0, b"y" * again.nbytes)
        assert bytes(await again.read(0, 4)) == b"yyyy"


async def test_kill_needs_process_mode(cluster: smb2.LocalCluster) -> None:
    with pytest.raises(smb2.InterfaceError, match="processes=True"):
        await cluster.kill(0)


async def test_shipped_fixture(smb2_cluster: smb2.LocalCluster) -> None:
    client = await smb2_cluster.connect()
    buf = await client.create("fixture", 1000)
    await buf.write(0, b"plugin")
    assert bytes(await buf.read(0, 6)) == b"plugin"
    assert len(client.servers) == smb2_cluster.nservers


def test_ports_named_ahead_are_outside_the_kernel_s_ephemeral_range_and_distinct():
    """A port a test names before its server binds it must not be one the
    kernel could give a connection meanwhile (CI once lost a bind that way)."""
    import socket

    from smb2.testing.ports import free_port
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(1024 < p < low for p in ports), ports
    with socket.socket() as s:          # handed out free: it binds
        s.bind(("127.0.0.1", ports[-1]))
