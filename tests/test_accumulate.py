"""bf16/fp16 pushes end to end: ``Buffer.accumulate(offset, delta, wire=...)``
sends a float32 delta as half-width floats and each server upcasts it into
its float32 words; and the other way, ``read_into(out, offset, wire=...)``
gets float32 words rounded to half width (by the server, over TCP).  Real servers: a LocalCluster (every transport this
machine tests), in-process servers with a small frame limit, and raw frames
for what a client would never send."""

from __future__ import annotations

import asyncio
import functools

import numpy as np
import pytest

import smb2
from smb2.client import as_wire
from smb2.errors import ErrorCode
from smb2.protocol import DTYPE_CODES, DTYPE_SHIFT, FLAG_STAGED, WIRE_CODES, Op
from smb2.testing import wire as raw
from smb2.testing.floats import NARROW, same_floats, widen

WIRES = sorted(WIRE_CODES)
STRIPE = 4096


@pytest.fixture(params=[1, 2], ids=["threads1", "threads2"])
def server_threads(request: pytest.FixtureRequest) -> int:
    # every test here holds however many threads a server cuts an accumulate among
    return int(request.param)


def _expected(base: np.ndarray, delta: np.ndarray, wire: str) -> np.ndarray:
    """fp32 += upcast(round(delta)), in numpy."""
    with np.errstate(invalid="ignore", over="ignore"):
        return base + widen(NARROW[wire](delta), wire)


def _values(rng: np.random.Generator, n: int) -> np.ndarray:
    # spread over many binades, so that rounding to 8 (bf16) or 11 (fp16)
    # mantissa bits loses something almost everywhere
    return (rng.standard_normal(n) * 2.0 ** rng.integers(-12, 12, n)).astype(np.float32)


@pytest.mark.parametrize("wire", WIRES)
async def test_push_across_stripes_and_servers(client: smb2.Client, wire: str) -> None:
    rng = np.random.default_rng(1)
    buf = await client.create("acc-" + wire, 9 * 4 * STRIPE, stripe=STRIPE)
    base = _values(rng, buf.nbytes // 4)
    await buf.write(0, base)
    # from the middle of a stripe, across all four servers twice, to the
    # middle of another
    offset, n = STRIPE + 1000, (7 * 4 * STRIPE) // 4 + 333
    delta = _values(rng, n)
    await buf.accumulate(offset, delta, wire=wire)
    got = (await buf.read(0, buf.nbytes)).view(np.float32)
    lo, hi = offset // 4, offset // 4 + n
    assert np.array_equal(got[:lo], base[:lo]) and np.array_equal(got[hi:], base[hi:])
    assert same_floats(got[lo:hi], _expected(base[lo:hi], delta, wire))
    # the delta really travelled narrower: a float32 push lands elsewhere
    assert not same_floats(got[lo:hi], base[lo:hi] + delta)


@pytest.mark.parametrize("wire", WIRES)
async def test_push_cut_into_many_requests(small_frames: list[smb2.Server], transport: str,
                                          wire: str) -> None:
    rng = np.random.default_rng(2)
    async with await smb2.connect([s.address for s in small_frames], transport=transport) as c:
        buf = await c.create("cut", 3 * 8 * 16384, stripe=16384)
        base = _values(rng, buf.nbytes // 4)
        await buf.write(0, base)
        delta = _values(rng, base.size - 3)
        await buf.accumulate(8, delta, wire=wire)
        got = (await buf.read(0, buf.nbytes)).view(np.float32)
    assert same_floats(got[2:-1], _expected(base[2:-1], delta, wire))
    assert got[:2].tobytes() == base[:2].tobytes() and got[-1:].tobytes() == base[-1:].tobytes()
    if transport == "tcp":
        # every server did its share in several requests, each at most 16 KiB
        # of float32 (over RDMA the frames carry only the staging slot's name)
        for s in small_frames:
            assert s.ops["tcp"]["accumulate"] >= 8


async def test_concurrent_pushes_from_several_clients_all_land(cluster: smb2.LocalCluster,
                                                               transport: str) -> None:
    clients = [await cluster.connect(transport=transport) for _ in range(4)]
    try:
        buf0 = await clients[0].create("sum", 5 * 4 * STRIPE + 96, stripe=STRIPE)
        bufs = [await c.attach("sum") for c in clients]
        n = buf0.nbytes // 4
        rounds = 12

        async def worker(k: int, buf: smb2.Buffer) -> None:
            # small integers are exact in both narrow types: the sum is exact
            # whatever order the servers apply the pushes in
            for j in range(rounds):
                await buf.accumulate(0, np.full(n, k + 1 + j % 3, np.float32),
                                     wire=(None, "bfloat16", "float16")[(k + j) % 3])

        await asyncio.gather(*(worker(k, b) for k, b in enumerate(bufs)))
        total = sum(k + 1 + j % 3 for k in range(4) for j in range(rounds))
        out = (await buf0.read(0, buf0.nbytes)).view(np.float32)
        assert (out == total).all(), np.unique(out)
    finally:
        for c in clients:
            await c.close()


async def test_wire_argument_errors(client: smb2.Client) -> None:
    buf = await client.create("args", 4 * STRIPE, stripe=STRIPE)
    ones = np.ones(16, np.float32)
    with pytest.raises(smb2.InvalidArgumentError, match=r"float32 delta .* float64"):
        await buf.accumulate(0, ones.astype(np.float64), wire="bfloat16")
    with pytest.raises(smb2.InvalidArgumentError, match="float32 delta"):
        await buf.accumulate(0, ones.astype(">f4"), wire="float16")
    with pytest.raises(smb2.InvalidArgumentError, match="wire must be None, 'bfloat16' or 'float16'"):
        await buf.accumulate(0, ones, wire="int8")
    with pytest.raises(smb2.InvalidArgumentError, match="wire must be"):
        await buf.accumulate(0, ones, wire=np.float16)             # type: ignore[arg-type]
    with pytest.raises(smb2.InvalidArgumentError, match="aligned to 4 bytes"):
        await buf.accumulate(2, ones, wire="bfloat16")
    # the range is the float32 one: 64 bytes here, though only 32 travel
    with pytest.raises(smb2.InvalidArgumentError, match="runs past the end"):
        await buf.accumulate(buf.nbytes - 48, ones, wire="bfloat16")
    assert not (await buf.read(0, buf.nbytes)).any()

async def test_overlapping_pushes_cut_among_threads_add_every_part_once(
        cluster: smb2.LocalCluster, transport: str, server_threads: int) -> None:
    """Clients push at once, in every element kind, to windows that overlap
    each other and cross stripes and servers; each push carries a value of
    its own (a power of two per client and round), so that a part a server
    thread lost, added twice or added into its neighbour's range shows in
    the sum.  Every value and sum is an integer exact in its type: the
    result is exact whatever order the servers apply the pushes in."""
    kinds = [("float32", None), ("float32", "bfloat16"), ("float32", "float16"),
             ("float64", None), ("int32", None), ("int64", None)]
    clients = [await cluster.connect(transport=transport) for _ in range(3)]
    rounds, items = 4, 6 * STRIPE       # 24 or 48 KiB a buffer: 6-12 stripes, 1-3 a server
    rng = np.random.default_rng(7)
    # (client, round) -> (dtype index, first item, count): windows of 1/3 to all of a buffer
    pushes = {(k, j): (int(rng.integers(len(kinds))), int(rng.integers(items // 2)),
                       int(rng.integers(items // 3, items // 2 + 1)))
              for k in range(len(clients)) for j in range(rounds)}
    try:
        bufs = [[await c.create(f"acc-{i}", items * np.dtype(dt).itemsize, stripe=STRIPE)
                 if k == 0 else await c.attach(f"acc-{i}")
                 for i, (dt, _) in enumerate(kinds)] for k, c in enumerate(clients)]
        expected = [np.zeros(items, np.float64) for _ in kinds]

        async def push(k: int) -> None:
            for j in range(rounds):
                i, first, count = pushes[k, j]
                dt, wire = kinds[i]
                # 2**(k * rounds + j): exact in bfloat16 (8 mantissa bits) and
                # float16 (up to 2**15) and distinct per push
                value = 2 ** (k * rounds + j)
                await bufs[k][i].accumulate(first * np.dtype(dt).itemsize, np.full(count, value, dt), wire=wire)
                expected[i][first:first + count] += value

        await asyncio.gather(*(push(k) for k in range(len(clients))))
        for i, (dt, _) in enumerate(kinds):
            got = (await bufs[0][i].read(0, items * np.dtype(dt).itemsize)).view(dt)
            assert (got.astype(np.float64) == expected[i]).all(), (kinds[i], np.flatnonzero(got != expected[i])[:8])
        cut = sum(s["threads"]["accumulates_cut"] for s in await clients[0].stat())
        # with threads, the servers cut pushes among them; with one, never
        assert (cut > 0) == (server_threads > 1), cut
    finally:
        for c in clients:
            await c.close()


# -- the server's checks, with frames no client would send ----------------

_acc = functools.partial(raw.typed, Op.ACCUMULATE)


async def test_bad_widening_requests_are_refused_and_write_nothing(server: smb2.Server) -> None:
    async with await smb2.connect([server.address]) as c:
        await c.create("victim", 2 * STRIPE)
    seg = server.by_name["victim"]
    bf16, f16 = WIRE_CODES["bfloat16"], WIRE_CODES["float16"]
    one = np.full(4, 0x3F80, np.uint16).tobytes()        # four bf16 1.0: 16 bytes of float32
    bad = [
        (_acc(bf16, one, segment=seg.id, offset=2, rid=2), ErrorCode.BAD_REQUEST,
         "bfloat16 into float32 needs an offset aligned to 4 bytes"),
        (_acc(f16, one[:7], segment=seg.id, offset=0, rid=3), ErrorCode.BAD_REQUEST,
         "whole 2-byte items"),
        # 8 bytes of payload would fit before the end; the 16 bytes it covers do not
        (_acc(f16, one, segment=seg.id, offset=seg.size - 8, rid=4), ErrorCode.OUT_OF_BOUNDS,
         "outside segment"),
        (_acc(7, one, segment=seg.id, offset=0, rid=5), ErrorCode.BAD_REQUEST,
         "unknown accumulate dtype code 7"),
        (_acc(bf16, one, segment=0, offset=0, rid=6), ErrorCode.ACCESS_DENIED, "lock segment"),
        (_acc(bf16, one, segment=0, offset=0, rid=7, flags=FLAG_STAGED), ErrorCode.ACCESS_DENIED,
         "lock segment"),
        (_acc(bf16, bytes(16), segment=seg.id, offset=0, rid=8, flags=FLAG_STAGED),
         ErrorCode.BAD_REQUEST, "needs rdma_connect"),
    ]
    locks_before = bytes(server.segments[0].mem)
    reader, writer = await asyncio.open_connection(*server.address)
    try:
        await raw.expect_refusals(reader, writer, bad)
        assert not seg.mem.any() and bytes(server.segments[0].mem) == locks_before
        # the connection is still good, and the same frame done right adds
        writer.write(_acc(bf16, one, segment=seg.id, offset=seg.size - 16, rid=9))
        hdr, _ = await raw.reply(reader)
        assert hdr[4] == 0 and hdr[5] == 9
        assert (seg.mem[-16:].view(np.float32) == 1).all() and not seg.mem[:-16].any()
    finally:
        writer.close()


async def test_widening_push_waits_for_a_write_into_its_upper_half(server: smb2.Server) -> None:
    """An accumulate is atomic against writes: it waits for a write still
    being received into any part of the float32 range it covers, including
    the half beyond its own payload's length."""
    async with await smb2.connect([server.address]) as c:
        buf = await c.create("held", 4 * STRIPE, stripe=4 * STRIPE)
        # a write of [3072, 4096) of float32 2.0 arrives half way, then stalls;
        # 1024 bf16 ones: 2048 bytes of payload, covering [0, 4096) of float32
        await raw.held_by_half_a_write(server, "held", 3072, np.full(256, 2.0, np.float32).tobytes(),
                                       buf.accumulate(0, np.ones(1024, np.float32), wire="bfloat16"))
        got = (await buf.read(0, 4096)).view(np.float32)
    assert (got[:768] == 1).all() and (got[768:] == 3).all()


# -- narrowing reads: read_into(out, offset, wire=...) --------------------

@pytest.mark.parametrize("wire", WIRES)
async def test_narrow_read_across_stripes_and_servers(cluster: smb2.LocalCluster, client: smb2.Client,
                                                      transport: str, wire: str) -> None:
    rng = np.random.default_rng(3)
    buf = await client.create("narrow-" + wire, 9 * 4 * STRIPE, stripe=STRIPE)
    base = _values(rng, buf.nbytes // 4)
    base[[5, 77, 4099]] = [np.nan, np.inf, 3.0e38]          # NaN stays NaN, too large becomes inf
    await buf.write(0, base)
    offset, n = STRIPE + 1000, (7 * 4 * STRIPE) // 4 + 333
    out = np.full(n, -1.0, np.float32)
    sent = sum(s.bytes_out for s in cluster.servers)
    await buf.read_into(out, offset, wire=wire)
    lo = offset // 4
    # the words rounded as accumulate(wire=) rounds a delta, on every transport
    assert same_floats(out, widen(NARROW[wire](base[lo:lo + n]), wire))
    assert same_floats(out, as_wire(base[lo:lo + n], wire))
    assert not same_floats(out, base[lo:lo + n])
    if transport == "tcp":
        # the servers rounded them: half the float32 bytes crossed the link
        assert sum(s.bytes_out for s in cluster.servers) - sent == 2 * n


async def test_narrow_read_cut_into_many_requests(small_frames: list[smb2.Server], transport: str) -> None:
    rng = np.random.default_rng(4)
    async with await smb2.connect([s.address for s in small_frames], transport=transport) as c:
        buf = await c.create("cut", 3 * 8 * 16384, stripe=16384)
        base = _values(rng, buf.nbytes // 4)
        await buf.write(0, base)
        out = np.empty(base.size - 3, np.float32)
        reads = [s.ops.get("tcp", {}).get("read", 0) for s in small_frames]
        await buf.read_into(out, 8, wire="bfloat16")
    assert same_floats(out, as_wire(base[2:-1], "bfloat16"))
    if transport == "tcp":
        # each server's share went in several narrowing requests (16 KiB frames)
        assert all(s.ops["tcp"]["read"] - r >= 4 for s, r in zip(small_frames, reads, strict=True))


async def test_narrow_read_argument_errors(client: smb2.Client) -> None:
    buf = await client.create("args", 4 * STRIPE, stripe=STRIPE)
    await buf.write(0, np.ones(buf.nbytes // 4, np.float32))
    out = np.zeros(16, np.float32)
    with pytest.raises(smb2.InvalidArgumentError, match=r"float32 out .* float64"):
        await buf.read_into(np.zeros(16), 0, wire="bfloat16")
    with pytest.raises(smb2.InvalidArgumentError, match="wire must be None, 'bfloat16' or 'float16'"):
        await buf.read_into(out, 0, wire="int8")
    with pytest.raises(smb2.InvalidArgumentError, match="not a multiple of 4"):
        await buf.read_into(out, 2, wire="bfloat16")
    with pytest.raises(smb2.InvalidArgumentError, match="runs past the end"):
        await buf.read_into(out, buf.nbytes - 48, wire="bfloat16")
    assert not out.any()
    await buf.read_into(out, buf.nbytes - 64, wire="float16")
    assert (out == 1).all()


async def test_bad_narrowing_reads_are_refused(server: smb2.Server) -> None:
    async with await smb2.connect([server.address]) as c:
        buf = await c.create("victim", 2 * STRIPE)
        words = np.arange(buf.nbytes // 4, dtype=np.float32) + 0.5
        await buf.write(0, words)
    seg = server.by_name["victim"]

    def read(code: int, *, offset: int, length: int, rid: int) -> bytes:
        return raw.frame(Op.READ, segment=seg.id, offset=offset, length=length, rid=rid, flags=code << DTYPE_SHIFT)
    bf16 = WIRE_CODES["bfloat16"]
    bad = [
        (read(bf16, offset=2, length=8, rid=2), ErrorCode.BAD_REQUEST, "aligned to 4 bytes"),
        (read(bf16, offset=0, length=7, rid=3), ErrorCode.BAD_REQUEST, "whole 2-byte items"),
        # 8 bytes wanted would fit before the end; the 16 bytes of float32 they cover do not
        (read(bf16, offset=seg.size - 8, length=8, rid=4), ErrorCode.OUT_OF_BOUNDS, "outside segment"),
        (read(DTYPE_CODES["int32"], offset=0, length=8, rid=5), ErrorCode.BAD_REQUEST,
         "narrows float32 to"),
        (read(7, offset=0, length=8, rid=6), ErrorCode.BAD_REQUEST, "not to dtype code 7"),
    ]
    reader, writer = await asyncio.open_connection(*server.address)
    try:
        await raw.expect_refusals(reader, writer, bad)
        # the connection is still good, and the same read done right narrows four words
        writer.write(read(bf16, offset=16, length=8, rid=9))
        hdr, body = await raw.reply(reader)
        assert hdr[4] == 0 and hdr[5] == 9
        assert body == NARROW["bfloat16"](words[4:8]).tobytes()
    finally:
        writer.close()
