"""``connect(lazy=True)``: servers connected, and a buffer's parts looked up,
on first use, so that a worker that never touches a server never connects
to it.  Real servers: in-process ones, and server processes where one is
killed or restarted."""

from __future__ import annotations

import asyncio
import signal

import numpy as np
import pytest

import smb2
from smb2.train.counts import counts_name, read_counts
from smb2.train.store import ParameterStore

MiB = 1 << 20


def _stripe_on(buf: smb2.Buffer, server: int) -> int:
    """The first stripe of ``buf`` that lies on ``server``."""
    return next(i for i in range(buf.nbytes // buf.stripe) if buf.placement.server_of(i) == server)


def _connected(client: smb2.Client) -> set[int]:
    return {k for k, name in enumerate(client.transports) if name != "-"}


async def test_a_lazy_client_connects_only_the_servers_it_uses(cluster: smb2.LocalCluster,
                                                                transport: str) -> None:
    eager = await cluster.connect(transport=transport)
    made = await eager.create("lazy-w", 8 * MiB, stripe=MiB)
    q = MiB // 4                # float32 values a stripe
    start = np.arange(made.nbytes // 4, dtype=np.float32)
    for k in range(8):
        start[k * q + q - 16:k * q + q] = 0       # each stripe's last 64 bytes: words (notification slots)
    await made.write(0, start)
    served = [len(srv.connections) for srv in cluster.servers]

    lazy = await cluster.connect(transport=transport, lazy=True)
    assert _connected(lazy) == set()
    buf = await lazy.attach("lazy-w")
    assert _connected(lazy) == {0}           # part 0's server, which attach asked
    s = 2 if buf.placement.server_of(0) != 2 else 3
    i = _stripe_on(buf, s)
    lo = i * q
    got = np.empty(q, np.float32)
    await buf.read_into(got, i * MiB)
    assert np.array_equal(got, start[lo:lo + q])
    # dense and sparse accumulates, an atomic and a notification in that stripe: exact, with no
    # connection to the servers this worker never touched
    await buf.accumulate(i * MiB, np.ones(q // 2, np.float32))
    await buf.accumulate_sparse(np.array([0, 5, 5, 9]), np.array([1, 2, 3, 4], np.float32), offset=i * MiB)
    assert await buf.fetch_add(i * MiB + MiB - 8, 3) == 0
    buf.set_notify_area(i * MiB + MiB - 64, 4)
    waiter = asyncio.ensure_future(buf.wait_notify(1, 7, timeout=30))
    other = await eager.attach("lazy-w")
    other.set_notify_area(i * MiB + MiB - 64, 4)
    await other.notify(1, 7)
    assert await waiter == 7
    assert _connected(lazy) == {0, s}
    now = [len(srv.connections) for srv in cluster.servers]
    assert [now[k] for k in range(4) if k not in (0, s)] == [served[k] for k in range(4) if k not in (0, s)]
    # the whole buffer: every server now, and every byte as the updates left it
    whole = (await buf.read(0, buf.nbytes)).view(np.float32)
    assert _connected(lazy) == {0, 1, 2, 3}
    expect = start.copy()
    expect[lo:lo + q // 2] += 1
    np.add.at(expect, lo + np.array([0, 5, 5, 9]), np.array([1, 2, 3, 4], np.float32))
    words = expect.view(np.int64)
    words[(lo + q - 14) // 2] = 7           # slot 1
    words[(lo + q - 2) // 2] = 3            # the fetch_add
    assert np.array_equal(whole, expect)
    assert np.array_equal(whole, (await other.read(0, other.nbytes)).view(np.float32))


async def test_a_lazy_client_goes_on_without_a_server_it_does_not_use() -> None:
    servers = [await smb2.start_server("127.0.0.1", 0, capacity="16MiB") for _ in range(2)]
    try:
        addresses = [f"{h}:{p}" for h, p in (s.address for s in servers)]
        async with await smb2.connect(addresses) as eager:
            await (await eager.create("lazy-down", 2 * MiB, stripe=MiB)).write(0, b"\x07" * 2 * MiB)
        await servers[1].close()
        async with await smb2.connect(addresses, lazy=True, timeout=2) as lazy:
            buf = await lazy.attach("lazy-down")
            on_0 = _stripe_on(buf, 0)
            assert bytes(await buf.read(on_0 * MiB, MiB)) == b"\x07" * MiB
            with pytest.raises(smb2.TransportError, match="lazy-down") as err:
                await buf.read((1 - on_0) * MiB, MiB)
            assert err.value.server == addresses[1]
    finally:
        for s in servers:
            await s.close()


async def test_a_lazy_client_finds_a_lost_part_on_first_use() -> None:
    async with smb2.LocalCluster(servers=2, processes=True, capacity="16MiB") as cluster:
        eager = await cluster.connect(timeout=5)
        await eager.create("lazy-lost", 2 * MiB, stripe=MiB)
        lazy = await cluster.connect(timeout=5, lazy=True)
        buf = await lazy.attach("lazy-lost")
        # server 1 restarts without its data, and another buffer takes the same segment there
        await cluster.kill(1, signal.SIGKILL)
        await cluster.restart(1)
        other = await (await cluster.connect(timeout=5)).create("lazy-other", 2 * MiB, stripe=MiB)
        on_1 = _stripe_on(buf, 1)
        with pytest.raises(smb2.BufferDamaged, match="part 1 on server .* is missing") as err:
            await buf.write(on_1 * MiB, b"\xee" * MiB)
        assert err.value.parts == [1]
        assert not np.any(await other.read(0, other.nbytes))      # nothing reached the other buffer
        # the part of server 0 is still served
        await buf.write((1 - on_1) * MiB, b"\x01" * MiB)
        assert bytes(await buf.read((1 - on_1) * MiB, MiB)) == b"\x01" * MiB


async def test_a_lazy_client_refuses_a_server_listed_twice(cluster: smb2.LocalCluster) -> None:
    host, port = cluster.servers[0].address
    lazy = await smb2.connect([f"{host}:{port}", f"localhost:{port}"], lazy=True)
    try:
        with pytest.raises(smb2.InvalidArgumentError, match="listed twice"):
            await lazy.create("lazy-twice", MiB)
    finally:
        await lazy.close()


async def _settled(cluster: smb2.LocalCluster, want: list[int]) -> list[int]:
    """The servers' connection counts once they are ``want`` (a closed
    connection leaves its server's table when the server reads its end)."""
    for _ in range(3000):
        now = [len(srv.connections) for srv in cluster.servers]
        if now == want:
            break
        await asyncio.sleep(0.01)
    return now


async def test_a_lazy_client_keeps_no_connection_from_a_create_or_destroy(cluster: smb2.LocalCluster,
                                                                          transport: str) -> None:
    lazy = await cluster.connect(transport=transport, lazy=True)
    served = [len(srv.connections) for srv in cluster.servers]
    # a part on every server, each made over a connection that is closed after it
    buf = await lazy.create("lazy-c", 4 * MiB, stripe=MiB)
    assert _connected(lazy) == set()
    assert await _settled(cluster, served) == served
    s = buf.placement.server_of(2)
    data = np.arange(MiB // 4, dtype=np.float32)
    await buf.write(2 * MiB, data)
    assert _connected(lazy) == {s}
    eager = await cluster.connect(transport=transport)
    seen = await eager.attach("lazy-c")
    assert np.array_equal((await seen.read(2 * MiB, MiB)).view(np.float32), data)
    assert not np.any(await seen.read(0, 2 * MiB))
    # destroyed everywhere, and still held only where it was used
    assert await lazy.destroy("lazy-c")
    assert _connected(lazy) == {s}
    with pytest.raises(smb2.NoSuchBuffer):
        await eager.attach("lazy-c")
    want = [n + 1 + (k == s) for k, n in enumerate(served)]      # the eager client's, and the lazy one's on s
    assert await _settled(cluster, want) == want


async def test_a_lazy_worker_publishes_its_counts_where_rank_0_made_the_board(cluster: smb2.LocalCluster) -> None:
    """Rank 0 makes the store's counts board as its run opens; another rank
    only finds it, so a lazy worker's first counts reach the board's server
    alone, not every server through a create."""
    params = {"w": np.zeros(MiB // 4, np.float32)}
    c0 = await cluster.connect()
    c1 = await cluster.connect(lazy=True)
    st0 = await ParameterStore.open(c0, "lazy-counts", params, rule="delta", workers=2, rank=0)
    st1 = await ParameterStore.open(c1, "lazy-counts", params, rule="delta", workers=2, rank=1,
                                      pull=False)      # (a pull reads every server)
    await asyncio.gather(st0.join(), st1.join())
    board = (await c0.attach(counts_name("lazy-counts"))).placement.server_of(0)
    before = _connected(c1)
    assert len(before) < len(cluster.servers)
    await st1.board.publish(st1.generation, {"skipped": 2}, 7, force=True)
    assert _connected(c1) - before <= {board}
    got = await read_counts(c0, "lazy-counts", st0.generation)
    assert got is not None and got["per_rank"][1]["skipped"] == 2
