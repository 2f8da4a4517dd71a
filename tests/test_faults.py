"""Faults: connections cut mid-request by a proxy, servers SIGKILLed mid-transfer,
clients SIGKILLed mid-write.  The rule everywhere: the operations that touched
the fault fail promptly with a TransportError (never hang), everything else
goes on, and the next operation reconnects."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest

import smb2
from smb2.testing.proxy import FaultProxy
from smb2.testing.waits import until

MiB = 1 << 20
# counted for the closing report
FAULTS = {"proxy_cuts": 0, "server_kills": 0, "client_kills": 0}


@pytest.fixture
async def server() -> AsyncIterator[smb2.Server]:
    s = await smb2.start_server("127.0.0.1", 0, capacity="128MiB")
    yield s
    await s.close()


@pytest.fixture
def proxy(server: smb2.Server) -> Iterator[FaultProxy]:
    with FaultProxy(server.address) as p:
        yield p


async def _settle(server: smb2.Server, connections: int) -> None:
    await until(lambda: len(server.connections) == connections, f"{connections} connections")


def _noticed_not_timed_out(err: pytest.ExceptionInfo[smb2.TransportError]) -> None:
    """The client noticed the connection was gone (a reset, a close): not an
    operation deadline that ran out (the clients here set none, so a hang
    meets the test's hang guard instead)."""
    assert not isinstance(err.value, smb2.OperationTimeout), err.value


@pytest.mark.parametrize("where", ["header", "payload", "late"])
async def test_cut_in_the_middle_of_a_write(server: smb2.Server, proxy: FaultProxy,
                                            where: str) -> None:
    # transport="tcp" here and below: the proxy cuts a TCP connection, and
    # over shm (auto's choice on this host) the data would not cross it
    client = await smb2.connect([proxy.address], timeout=5, transport="tcp")
    try:
        buf = await client.create("cut", 16 * MiB, stripe=MiB)
        seg = server.segments[buf.segments[0]]
        data = np.random.default_rng(1).integers(0, 256, buf.nbytes, dtype=np.uint8)
        # cut inside a request header, inside the first request's payload, or
        # several requests in (the client pipelines 4 MiB requests)
        proxy.cut_after(up={"header": 10, "payload": 100_000, "late": 9 * MiB + 17}[where])
        with pytest.raises(smb2.TransportError) as err:
            await asyncio.wait_for(buf.write(0, data), 60)     # hang guard
        _noticed_not_timed_out(err)
        FAULTS["proxy_cuts"] += 1
        # the server forgot the half-received write
        await _settle(server, 0)
        assert not seg.inflight and not seg.deferred
        # the next operation reconnects and works
        await buf.write(0, data)
        assert np.array_equal(await buf.read(0, buf.nbytes), data)
        # an accumulate over the whole range is not held up by a leftover write
        await asyncio.wait_for(buf.accumulate(0, np.zeros(buf.nbytes // 8, np.int64)), 5)
    finally:
        await client.close()
    assert proxy.connections == 2


async def test_cut_in_the_middle_of_a_read_reply(server: smb2.Server, proxy: FaultProxy) -> None:
    async with await smb2.connect([proxy.address], timeout=5, transport="tcp") as client:
        buf = await client.create("cutread", 8 * MiB, stripe=MiB)
        await buf.write(0, b"\x07" * buf.nbytes)
        proxy.cut_after(down=3 * MiB + 5)
        out = np.zeros(buf.nbytes, np.uint8)
        # a read is idempotent: the requests the cut broke are sent again,
        # once, on a fresh connection (a write would raise instead)
        await asyncio.wait_for(buf.read_into(out), 10)
        FAULTS["proxy_cuts"] += 1
        assert (out == 7).all()
        proxy.cut_after(up=3 * MiB + 5)
        with pytest.raises(smb2.TransportError):
            await asyncio.wait_for(buf.write(0, b"\x08" * buf.nbytes), 10)
        FAULTS["proxy_cuts"] += 1


async def test_cut_while_many_ops_are_in_flight(server: smb2.Server, proxy: FaultProxy) -> None:
    """Every pending op fails (none hangs), whatever kind it was."""
    async with await smb2.connect([proxy.address], timeout=5, transport="tcp") as client:
        buf = await client.create("mix", 4 * MiB, stripe=64 << 10)
        ops = []
        for k in range(50):
            off = (k * 64 << 10) % buf.nbytes
            ops += [buf.write(off, b"w" * 4096), buf.read(off, 4096),
                    buf.accumulate(off, np.ones(512, np.int64)), buf.fetch_add(off)]
        proxy.cut_after(up=20_000)
        results = await asyncio.wait_for(asyncio.gather(*ops, return_exceptions=True), 10)
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed and all(isinstance(r, smb2.TransportError) for r in failed)
        FAULTS["proxy_cuts"] += 1
        assert await buf.fetch_add(0, 0) is not None
    await _settle(server, 0)


async def test_cut_during_connect_and_auth() -> None:
    # a connection reset while it connects is tried again (TcpTransport.connect):
    # the client gets in on a fresh connection, the cut one counted by the proxy
    s = await smb2.start_server("127.0.0.1", 0, capacity="1MiB", token="t0ken")
    try:
        with FaultProxy(s.address) as p:
            for k, up in enumerate((5, 40, 100)):       # inside hello, after hello, inside auth
                p.cut_after(up=up)
                async with await asyncio.wait_for(smb2.connect([p.address], token="t0ken", timeout=5), 10) as c:
                    assert await c.buffers() == []
                assert p.cuts == k + 1 and p.connections == 2 * (k + 1)
                FAULTS["proxy_cuts"] += 1
            async with await smb2.connect([p.address], token="t0ken") as c:
                assert await c.buffers() == []
    finally:
        await s.close()


async def test_server_sigkilled_mid_transfer() -> None:
    async with smb2.LocalCluster(servers=2, processes=True, capacity="96MiB") as cluster:
        client = await cluster.connect(timeout=5)
        buf = await client.create("big", 64 * MiB, stripe=MiB)
        data = np.random.default_rng(2).integers(0, 256, buf.nbytes, dtype=np.uint8)
        await buf.write(0, data)
        # offsets of whole stripes on each server
        on = {s: [i * MiB for i in range(64) if (buf.first + i) % 2 == s] for s in (0, 1)}

        async def hammer() -> None:
            while True:
                await buf.write(0, data)
                await buf.read(0, buf.nbytes)

        task = asyncio.create_task(hammer())
        await asyncio.sleep(0.3)
        assert not task.done()
        os.kill(cluster.pid(1), signal.SIGKILL)
        # a dead server fails its operations: noticed, not waited out
        with pytest.raises(smb2.TransportError) as err:
            await asyncio.wait_for(task, 60)       # hang guard
        _noticed_not_timed_out(err)
        FAULTS["server_kills"] += 1
        # the survivor's stripes go on (and hold what the last write left there)
        for off in on[0][:8]:
            assert np.array_equal(await buf.read(off, MiB), data[off:off + MiB])
            await buf.write(off, data[off:off + MiB])
        # the dead one's stripes fail fast, every time
        for off in on[1][:3]:
            with pytest.raises(smb2.TransportError) as err:
                await asyncio.wait_for(buf.read(off, 8), 60)   # hang guard
            _noticed_not_timed_out(err)
        await cluster.restart(1)
        # the client reconnects on its next operation; the memory did not survive a
        # SIGKILL, and the handle is refused before anything is sent (issue 14, item 8)
        with pytest.raises(smb2.StaleHandle):
            await buf.read(on[1][0], 8)
        await client.destroy("big")
        again = await client.create("big", 64 * MiB, stripe=MiB)
        await again.write(0, data)
        assert np.array_equal(await again.read(0, again.nbytes), data)


_WRITER = """
import asyncio, sys, numpy as np, smb2
async def main():
    c = await smb2.connect(sys.argv[1].split(","))
    buf = await c.create("victim", 32 << 20, stripe=1 << 20)
    data = np.full(buf.nbytes, 0xAB, np.uint8)
    print("writing", flush=True)
    while True:
        await asyncio.gather(*(buf.write(0, data) for _ in range(4)))
asyncio.run(main())
"""


async def test_client_sigkilled_mid_write_leaves_server_healthy() -> None:
    async with smb2.LocalCluster(servers=2, processes=True, capacity="64MiB") as cluster:
        client = await cluster.connect()
        for round_ in range(2):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _WRITER, ",".join(cluster.addresses),
                stdout=asyncio.subprocess.PIPE)
            assert proc.stdout is not None
            assert (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() == b"writing"
            await asyncio.sleep(0.2 + 0.1 * round_)
            proc.kill()
            await proc.wait()
            FAULTS["client_kills"] += 1
            buf = await client.attach("victim")
            # a half-received write must not block an accumulate over its range forever
            await asyncio.wait_for(buf.accumulate(0, np.zeros(buf.nbytes // 8, np.int64)), 10)
            await buf.write(0, b"\x01" * buf.nbytes)
            assert (await buf.read(0, buf.nbytes) == 1).all()
            async def only_ours() -> bool:
                return all(s["connections"] == 1 for s in await client.stat())
            await until(only_ours, "the dead writer's connections closed")
            await client.destroy("victim")


_LOCKED_WRITER = """
import asyncio, sys, numpy as np, smb2
async def main():
    c = await smb2.connect(sys.argv[1].split(","))
    buf = await c.attach("guarded")
    lock = c.lock("guard")
    await lock.acquire()
    data = np.full(buf.nbytes, 0xEE, np.uint8)
    print("holding", flush=True)
    while True:
        await buf.write(0, data, fence=lock)
asyncio.run(main())
"""


async def test_client_sigkilled_mid_fenced_write_while_holding_the_lock() -> None:
    """The holder dies in the middle of a fenced write: the lock passes on, the
    server drops the half write, and the next holder's writes and everyone's
    accumulates go through."""
    lease = 1.0
    async with smb2.LocalCluster(servers=2, processes=True, capacity="64MiB",
                                 server_args=["--lock-lease", str(lease)]) as cluster:
        client = await cluster.connect()
        buf = await client.create("guarded", 16 * MiB, stripe=MiB)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _LOCKED_WRITER, ",".join(cluster.addresses),
            stdout=asyncio.subprocess.PIPE)
        assert proc.stdout is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() == b"holding"
        lock = client.lock("guard")
        waiter = asyncio.ensure_future(lock.acquire())
        await asyncio.sleep(0.3)
        assert not waiter.done()
        proc.kill()
        # passed on (on the holder's disconnect, or its lease at the latest)
        await asyncio.wait_for(waiter, 30 * lease)     # hang guard
        await proc.wait()
        FAULTS["client_kills"] += 1
        await buf.write(0, b"\x01" * buf.nbytes, fence=lock)
        await lock.release()
        await asyncio.wait_for(buf.accumulate(0, np.ones(buf.nbytes // 8, np.int64)), 10)
        got = (await buf.read(0, buf.nbytes)).view(np.int64)
        assert (got == 0x0101010101010101 + 1).all()
