"""Notifications (GPI-2 style): write(..., notify=(slot, value)), wait_notify."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import smb2
from smb2.testing.cluster import thread_options


@pytest.fixture(params=[1, 2], ids=["threads1", "threads2"])
def server_threads(request: pytest.FixtureRequest) -> int:
    # notify after data holds however many threads a server adds with
    return int(request.param)


async def test_notify_area_must_be_designated(client: smb2.Client) -> None:
    buf = await client.create("n-area", 4096)
    with pytest.raises(smb2.InterfaceError, match="no notification area"):
        await buf.write(0, b"x" * 8, notify=(0, 1))
    with pytest.raises(smb2.InvalidArgumentError):
        buf.set_notify_area(4, 2)            # not 8-byte aligned
    with pytest.raises(smb2.InvalidArgumentError):
        buf.set_notify_area(4096 - 8, 2)     # runs past the end
    buf.set_notify_area(4096 - 64, 8)
    with pytest.raises(smb2.InvalidArgumentError, match="outside"):
        await buf.notify(8, 1)
    with pytest.raises(smb2.InvalidArgumentError, match="tuple"):
        await buf.write(0, b"x", notify=3)  # type: ignore[arg-type]
    assert (await buf.read_notify()).tolist() == [0] * 8


async def test_notify_values_only_grow(client: smb2.Client) -> None:
    buf = (await client.create("n-grow", 4096)).set_notify_area(0, 4)
    await buf.write(64, np.arange(8, dtype=np.int64), notify=(1, 5))
    assert await buf.read_notify(1) == 5
    assert await buf.notify(1, 3) == 5        # a smaller value never lowers it
    assert await buf.read_notify(1) == 5
    assert await buf.notify_add(2, 2) == 0
    assert await buf.notify_add(2, 2) == 2
    await buf.accumulate(64, np.ones(8, dtype=np.int64), notify=(3, 1))
    assert (await buf.read_notify()).tolist() == [0, 5, 4, 1]
    assert await buf.wait_notify(1, at_least=5, timeout=1) == 5
    with pytest.raises(smb2.NotifyTimeout):
        await buf.wait_notify(0, at_least=1, timeout=0.05)


async def test_wait_notify_wakes_on_notify(cluster: smb2.LocalCluster, transport: str) -> None:
    a = await cluster.connect(transport=transport)
    b = await cluster.connect(transport=transport)
    ba = (await a.create("n-wake", 1 << 16)).set_notify_area(0, 1)
    bb = (await b.attach("n-wake")).set_notify_area(0, 1)
    waiter = asyncio.ensure_future(bb.wait_notify(0, at_least=7, timeout=10))
    await asyncio.sleep(0.02)
    assert not waiter.done()
    await ba.write(4096, b"payload!", notify=(0, 7))
    assert await waiter == 7
    assert bytes(await bb.read(4096, 8)) == b"payload!"


@pytest.mark.parametrize("how", ["write", "accumulate", "accumulate_sparse"])
async def test_notification_never_visible_before_its_data(transport: str, server_threads: int, how: str) -> None:
    """Stress: a writer rewrites a block striped over 4 server processes
    (streamed into their memory) with the value i, or adds 1 to each of its
    words, then notifies i.  Readers on other connections wait for each new
    value and read the block: every word must already be >= the value they
    were notified of.  (With the order reversed, notify then write, this
    loop sees stale words in most runs.)  With server threads, each server
    cuts every accumulate of the block among them (never a sparse one, which
    adds 1.0 to every float32 word of the block by index)."""
    # server processes make the race real (their own CPU); other transports
    # are tested against the in-process servers their tier sets up
    async with smb2.LocalCluster(servers=4, processes=transport == "tcp",
                                 options=thread_options(server_threads)) as cluster:
        await _stress(cluster, transport, how)
        if how != "write":
            cut = sum(s["threads"]["accumulates_cut"] for s in await (await cluster.connect()).stat())
            assert (cut > 0) == (server_threads > 1 and how == "accumulate"), cut


async def _stress(cluster: smb2.LocalCluster, transport: str, how: str) -> None:
    block = 1 << 20
    rounds = 48
    writer = await cluster.connect(transport=transport)
    wbuf = (await writer.create("n-stress", block + 4096, stripe=1 << 14)).set_notify_area(block, 1)
    readers = [await cluster.connect(transport=transport) for _ in range(2)]
    rbufs = [(await r.attach("n-stress")).set_notify_area(block, 1) for r in readers]
    checks = [0, 0]

    async def read_loop(k: int) -> None:
        buf = rbufs[k]
        seen = 0
        out = np.empty(block // 4, dtype=np.float32) if how == "accumulate_sparse" \
            else np.empty(block // 8, dtype=np.int64)
        while seen < rounds:
            seen = await buf.wait_notify(0, at_least=seen + 1, timeout=30)
            await buf.read_into(out, 0)
            low = int(out.min())
            assert low >= seen, f"saw notification {seen} but the data still holds {low}"
            checks[k] += 1

    async def write_loop() -> None:
        data = np.empty(block // 8, dtype=np.int64)
        ones = np.ones(block // 8, dtype=np.int64)
        every_word = np.arange(block // 4)
        for i in range(1, rounds + 1):
            if how == "write":
                data.fill(i)
                await wbuf.write(0, data, notify=(0, i))
            elif how == "accumulate_sparse":
                await wbuf.accumulate_sparse(every_word, np.ones(block // 4, np.float32), notify=(0, i))
            else:
                await wbuf.accumulate(0, ones, notify=(0, i))
            await asyncio.sleep(0)

    await asyncio.gather(write_loop(), read_loop(0), read_loop(1))
    assert min(checks) >= 1
