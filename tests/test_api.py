"""The public client API, on every loop and transport (see conftest)."""

from __future__ import annotations

import asyncio
import gc
import sys

import numpy as np
import pytest

import smb2

MiB = 1 << 20


def _pattern(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


async def test_write_read_roundtrip(client: smb2.Client) -> None:
    buf = await client.create("roundtrip", 3 * MiB + 17, stripe=64 << 10)
    data = _pattern(buf.nbytes)
    await buf.write(0, data)
    assert np.array_equal(await buf.read(0, buf.nbytes), data)
    assert bytes(await buf.read(100, 5)) == data[100:105].tobytes()


async def test_write_accepts_bytes_like_and_arrays(client: smb2.Client) -> None:
    buf = await client.create("kinds", 4096, stripe=64)
    await buf.write(0, b"bytes")
    await buf.write(5, bytearray(b"array"))
    await buf.write(10, memoryview(b"view!"))
    await buf.write(16, np.arange(4, dtype=np.float64))
    await buf.write(48, np.arange(6, dtype=np.int16).reshape(2, 3))
    raw = await buf.read(0, 60)
    assert raw[:15].tobytes() == b"bytesarrayview!"
    assert np.array_equal(raw[16:48].view(np.float64), np.arange(4, dtype=np.float64))
    assert np.array_equal(raw[48:60].view(np.int16), np.arange(6, dtype=np.int16))


async def test_read_into_typed_array_in_place(client: smb2.Client) -> None:
    buf = await client.create("typed", 1 << 16, stripe=1024)
    src = np.linspace(-1, 1, 1000, dtype=np.float32)
    await buf.write(400, src)
    out = np.zeros((10, 100), dtype=np.float32)
    await buf.read_into(out, 400)
    assert np.array_equal(out.ravel(), src)


@pytest.mark.parametrize("offset,length", [
    (0, 1),                 # one byte
    (4095, 2),              # straddles a stripe boundary
    (1000, 4096 * 9 + 5),   # not aligned, spans every server more than once
    (0, 4096 * 4),          # exactly one stripe per server
    (4096 * 30 - 1, 1),     # the last byte
])
async def test_stripe_edge_cases(client: smb2.Client, offset: int, length: int) -> None:
    buf = await client.create("edges", 4096 * 30, stripe=4096)
    whole = _pattern(buf.nbytes, 1)
    await buf.write(0, whole)
    assert np.array_equal(await buf.read(offset, length), whole[offset:offset + length])
    patch = _pattern(length, 2)
    await buf.write(offset, patch)
    expect = whole.copy()
    expect[offset:offset + length] = patch
    assert np.array_equal(await buf.read(0, buf.nbytes), expect)


async def test_whole_buffer_larger_than_a_request(client: smb2.Client) -> None:
    # 4 servers * more than one 4 MiB request each, odd stripe
    buf = await client.create("big", 40 * MiB + 3, stripe=MiB + 8)
    data = _pattern(buf.nbytes, 3)
    await buf.write(0, data)
    out = np.empty_like(data)
    await buf.read_into(out, 0)
    assert np.array_equal(out, data)


async def test_placement_is_the_documented_pure_function(cluster: smb2.LocalCluster,
                                                         client: smb2.Client) -> None:
    stripe = 4096
    buf = await client.create("placed", stripe * 13, stripe=stripe)
    data = _pattern(buf.nbytes, 4)
    await buf.write(0, data)
    first = smb2._core.name_hash("placed") % 4
    assert buf.first == first
    for i in range(13):
        server = cluster.servers[(first + i) % 4]
        seg = server.by_name["placed"]
        at = (i // 4) * stripe
        assert np.array_equal(seg.mem[at:at + stripe], data[i * stripe:(i + 1) * stripe])


async def test_accumulate_each_dtype(client: smb2.Client) -> None:
    buf = await client.create("acc", 1 << 16, stripe=1024)
    for dtype in ("float32", "float64", "int32", "int64"):
        base = np.arange(3000 // np.dtype(dtype).itemsize, dtype=dtype)
        await buf.write(8, base)
        await buf.accumulate(8, base)
        await buf.accumulate(8, np.ones_like(base))
        out = np.empty_like(base)
        await buf.read_into(out, 8)
        assert np.array_equal(out, base * 2 + 1), dtype


async def test_concurrent_accumulates_give_the_exact_sum(cluster: smb2.LocalCluster,
                                                         transport: str) -> None:
    clients = [await cluster.connect(transport=transport) for _ in range(4)]
    buf0 = await clients[0].create("sum", 6 * 4096, stripe=4096)
    bufs = [await c.attach("sum") for c in clients]
    n = buf0.nbytes // 8

    async def worker(k: int, buf: smb2.Buffer) -> None:
        for j in range(25):
            await buf.accumulate(0, np.full(n, k * 100 + j, dtype=np.int64))

    await asyncio.gather(*(worker(k, b) for k, b in enumerate(bufs)))
    total = sum(k * 100 + j for k in range(4) for j in range(25))
    out = (await buf0.read(0, buf0.nbytes)).view(np.int64)
    assert (out == total).all()


async def test_accumulate_and_writes_interleave_atomically(client: smb2.Client) -> None:
    # concurrent big writes of zeros and accumulates of ones on the same range:
    # every element ends as (number of accumulates after the last write), the
    # same for all elements of a request (no torn accumulate)
    if client.transports[0] == "rdma":
        pytest.skip("one-sided RDMA WRITEs bypass the server's CPU: accumulate is atomic only "
                    "against other accumulates there (serialize with the lock)")
    n = (2 * MiB) // 8
    buf = await client.create("atomic", n * 8, stripe=n * 8)   # one server holds it all
    zeros = np.zeros(n, dtype=np.int64)
    ones = np.ones(n, dtype=np.int64)
    await asyncio.gather(*[buf.write(0, zeros) if k % 3 == 0 else buf.accumulate(0, ones)
                           for k in range(30)])
    out = (await buf.read(0, n * 8)).view(np.int64)
    assert len(np.unique(out)) == 1, np.unique(out)


async def test_fetch_add_and_compare_swap(client: smb2.Client) -> None:
    buf = await client.create("atomics", 4096 * 8, stripe=4096)
    for off in (0, 8, 4096 * 5 + 8):
        assert await buf.fetch_add(off) == 0
        assert await buf.fetch_add(off, 41) == 1
        assert await buf.fetch_add(off, -50) == 42
        assert await buf.fetch_add(off, 0) == -8
        assert await buf.compare_swap(off, -8, 7) == -8       # hit
        assert await buf.compare_swap(off, -8, 9) == 7        # miss: unchanged
        assert (await buf.read(off, 8)).view(np.int64)[0] == 7
    # 64-bit wrap-around, and unsigned inputs
    await buf.write(64, np.array([2**63 - 1], dtype=np.int64))
    assert await buf.fetch_add(64, 1) == 2**63 - 1
    assert await buf.fetch_add(64, 0) == -(2**63)
    assert await buf.compare_swap(64, 2**63, 5) == -(2**63)    # 2**63 as u64 == -2**63
    assert await buf.fetch_add(64, 0) == 5


async def test_concurrent_fetch_adds_are_atomic(cluster: smb2.LocalCluster, transport: str) -> None:
    clients = [await cluster.connect(transport=transport) for _ in range(3)]
    await clients[0].create("counter", 64)
    bufs = [await c.attach("counter") for c in clients]
    olds = await asyncio.gather(*(b.fetch_add(0) for b in bufs for _ in range(50)))
    assert sorted(olds) == list(range(150))


async def test_create_is_idempotent_and_conflicts_fail(client: smb2.Client) -> None:
    a = await client.create("idem", 10000, stripe=512)
    await a.write(0, b"keep")
    b = await client.create("idem", 10000, stripe=512)
    assert b.segments == a.segments
    assert bytes(await b.read(0, 4)) == b"keep"
    with pytest.raises(smb2.BufferConflict, match="exists with"):
        await client.create("idem", 20000, stripe=512)
    with pytest.raises(smb2.BufferConflict):
        await client.create("idem", 10000, stripe=1024)


async def test_two_clients_see_each_others_writes(cluster: smb2.LocalCluster, transport: str) -> None:
    c1 = await cluster.connect(transport=transport)
    c2 = await cluster.connect(transport=transport)
    b1 = await c1.create("shared", 100000, stripe=4096)
    b2 = await c2.attach("shared")
    assert (b2.nbytes, b2.stripe, b2.segments) == (b1.nbytes, b1.stripe, b1.segments)
    await b1.write(5000, b"from one")
    assert bytes(await b2.read(5000, 8)) == b"from one"
    await b2.write(90000, b"from two")
    assert bytes(await b1.read(90000, 8)) == b"from two"


async def test_buffers_and_destroy(client: smb2.Client) -> None:
    await client.create("a", 100)
    await client.create("b", 100)
    assert {"a", "b"} <= set(await client.buffers())
    assert await client.destroy("a") is True
    assert await client.destroy("a") is False
    assert "a" not in await client.buffers()
    with pytest.raises(smb2.NoSuchBuffer):
        await client.attach("a")


async def test_ops_on_a_destroyed_buffer_fail_clearly(client: smb2.Client) -> None:
    buf = await client.create("gone", 4096)
    await client.destroy("gone")
    with pytest.raises(smb2.NoSuchBuffer):
        await buf.read(0, 10)
    with pytest.raises(smb2.NoSuchBuffer):
        await buf.write(0, b"x" * 4096)
    with pytest.raises(smb2.NoSuchBuffer):
        await buf.fetch_add(0)
    # the connection is still good
    again = await client.create("gone", 4096)
    await again.write(0, b"ok")
    assert bytes(await again.read(0, 2)) == b"ok"


async def test_bad_arguments(client: smb2.Client) -> None:
    buf = await client.create("args", 4096, stripe=1024)
    with pytest.raises(smb2.InvalidArgumentError):
        await buf.read(-1, 4)
    with pytest.raises(ValueError):                      # also a ValueError
        await buf.read(4090, 7)
    with pytest.raises(smb2.InvalidArgumentError):
        await buf.write(4095, b"ab")
    with pytest.raises(smb2.InvalidArgumentError):
        await buf.write(0, "a str")                      # type: ignore[arg-type]
    with pytest.raises(smb2.InvalidArgumentError):
        await buf.write(0, np.zeros((4, 4))[:, 1])       # not contiguous
    with pytest.raises(smb2.InvalidArgumentError):
        await buf.read_into(np.zeros(4)[::2], 0)
    with pytest.raises(smb2.InvalidArgumentError):
        await buf.read_into(b"immutable", 0)
    with pytest.raises(smb2.InvalidArgumentError):
        await buf.fetch_add(4)                           # unaligned
    with pytest.raises(smb2.InvalidArgumentError):
        await buf.fetch_add(4096)                        # past the end
    with pytest.raises(smb2.InvalidArgumentError):
        await buf.fetch_add(0, 2**64)
    with pytest.raises(smb2.InvalidArgumentError):
        await buf.accumulate(0, np.zeros(4, dtype=np.int16))
    with pytest.raises(smb2.InvalidArgumentError):
        await buf.accumulate(4, np.zeros(4, dtype=np.float64))
    with pytest.raises(smb2.InvalidArgumentError):
        await buf.accumulate(0, [1.0, 2.0])              # type: ignore[arg-type]
    with pytest.raises(smb2.InvalidArgumentError):
        await client.create("", 10)
    with pytest.raises(smb2.InvalidArgumentError):
        await client.create("x" * 300, 10)
    with pytest.raises(smb2.InvalidArgumentError):
        await client.create("neg", -5)
    with pytest.raises(smb2.InvalidArgumentError):
        await client.create("odd", 100, stripe=12)
    with pytest.raises(smb2.NoSuchBuffer):
        await client.attach("never-made")
    # nothing of the above broke the connection
    await buf.write(0, b"still fine")
    assert bytes(await buf.read(0, 10)) == b"still fine"


async def test_closed_client_refuses_use(cluster: smb2.LocalCluster, transport: str) -> None:
    c = await cluster.connect(transport=transport)
    buf = await c.create("closed", 100)
    async with c:
        pass
    assert c.closed
    with pytest.raises(smb2.InterfaceError):
        await buf.read(0, 1)
    with pytest.raises(smb2.InterfaceError):
        await c.buffers()


async def test_repr_and_the_unclosed_warning_say_what_and_where(cluster: smb2.LocalCluster,
                                                                 transport: str) -> None:
    here = sys._getframe().f_lineno
    c = await smb2.connect(cluster.addresses, transport=transport)     # here + 1: the warning names it
    assert repr(c) == f"<smb2.Client open, 4 servers: {', '.join(cluster.addresses)}>"
    reg = c.register(np.zeros(64, dtype=np.uint8))
    assert repr(reg).startswith("<smb2.Registration of 64 bytes, registered with ")
    reg.close()
    assert repr(reg) == "<smb2.Registration of 64 bytes, closed>"
    links = c.links
    with pytest.warns(ResourceWarning, match="unclosed smb2 client") as caught:
        del c
        gc.collect()
    assert f"connected at {__file__}:{here + 1}" in str(caught[0].message)
    for link in links:          # what the dropped client would have closed
        await link.close()
    closed = await smb2.connect(cluster.addresses, transport=transport)
    await closed.close()
    assert repr(closed).startswith("<smb2.Client closed, 4 servers: ")


async def test_connect_errors(transport: str) -> None:
    with pytest.raises(smb2.TransportError) as info:
        await smb2.connect(["127.0.0.1:1"], transport=transport, timeout=5)
    assert info.value.errno is not None
    with pytest.raises(smb2.InvalidArgumentError):
        await smb2.connect(["127.0.0.1:7420", "127.0.0.1:7420"])
    with pytest.raises(smb2.InvalidArgumentError):
        await smb2.connect(["127.0.0.1:x"])
    with pytest.raises(smb2.InvalidArgumentError):
        await smb2.connect(["127.0.0.1:1"], transport="carrier-pigeon")


async def test_servers_from_environment(cluster: smb2.LocalCluster, transport: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMB2_SERVERS", ",".join(cluster.addresses))
    async with await smb2.connect(transport=transport) as c:
        assert c.servers == cluster.addresses
        await c.create("env", 10)
    monkeypatch.delenv("SMB2_SERVERS")
    with pytest.raises(smb2.InterfaceError, match="SMB2_SERVERS"):
        await smb2.connect()


async def test_attach_with_servers_in_another_order_fails(cluster: smb2.LocalCluster,
                                                          transport: str) -> None:
    c1 = await cluster.connect(transport=transport)
    await c1.create("order", 4096 * 4, stripe=4096)
    c2 = await smb2.connect(list(reversed(cluster.addresses)), transport=transport)
    try:
        with pytest.raises(smb2.InterfaceError, match="same order"):
            await c2.attach("order")
    finally:
        await c2.close()


async def test_explicit_rdma_never_falls_back_silently(cluster: smb2.LocalCluster,
                                                       transport: str) -> None:
    if transport == "rdma":
        pytest.skip("this machine has RDMA")
    with pytest.raises(smb2.TransportError, match="rdma"):
        await cluster.connect(transport="rdma")


async def test_stat_counts_what_the_server_did(client: smb2.Client) -> None:
    buf = await client.create("stats", 4096 * 4, stripe=4096)
    await buf.write(0, b"x" * 4096 * 4)
    stats = await client.stat()
    assert len(stats) == 4
    assert all("stats" in s["buffers"] for s in stats)
    assert all(s["connections"] >= 1 for s in stats)
    assert sum(s["used"] for s in stats) == 4096 * 4
