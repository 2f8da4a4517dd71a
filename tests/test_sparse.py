"""Sparse accumulate end to end: ``Buffer.accumulate_sparse(indices, values)``
adds each value into the float32 word at its index, every duplicate adding,
on real servers (a LocalCluster over every transport this machine tests,
in-process servers with a small frame limit, raw frames for what a client
would never send, and replicated server processes beside a real etcd)."""

from __future__ import annotations

import asyncio
import functools

import msgpack
import numpy as np
import pytest

import smb2
from smb2 import _core
from smb2.errors import ErrorCode, InvalidArgumentError, Unsupported
from smb2.protocol import DTYPE_SHIFT, FLAG_REPLICATED, FLAG_STAGED, FLAG_WIDE_INDEX, Op
from smb2.sparse import plan
from smb2.testing import wire as raw
from smb2.testing.floats import NARROW, widen
from smb2.testing.replicas import Raw, segment_bytes

STRIPE = 4096
F32, BF16, F16 = _core.DTYPE_FLOAT32, _core.DTYPE_BFLOAT16_INTO_FLOAT32, _core.DTYPE_FLOAT16_INTO_FLOAT32


def _sent(values: np.ndarray, wire: str | None) -> np.ndarray:
    """The float32 values the servers add: as given, or rounded to ``wire``."""
    return values if wire is None else widen(NARROW[wire](values), wire)


def _sparse_requests(servers: list[smb2.Server]) -> int:
    return sum(counts.time[Op.ACCUMULATE_SPARSE].count for s in servers for counts in s.requests.values())


@pytest.mark.parametrize("wire", [None, "bfloat16", "float16"])
async def test_sparse_push_matches_numpy_with_duplicates(cluster: smb2.LocalCluster, client: smb2.Client,
                                                         wire: str | None) -> None:
    rng = np.random.default_rng(1)
    buf = await client.create("sp", 9 * 4 * STRIPE + 400, stripe=STRIPE)
    base = (rng.standard_normal(buf.nbytes // 4) * 100).astype(np.float32)
    await buf.write(0, base)
    offset = STRIPE + 1000
    words = (buf.nbytes - offset) // 4
    # many duplicates (a few hot words, each named dozens of times), spread
    # over every server, in no order; values spread over many binades, so
    # that the order of the adds shows in the result
    idx = np.concatenate([rng.integers(0, words, 3000), rng.integers(0, 8, 600), [words - 1] * 5])
    rng.shuffle(idx)
    values = (rng.standard_normal(len(idx)) * 2.0 ** rng.integers(-10, 10, len(idx))).astype(np.float32)
    before = _sparse_requests(cluster.servers)
    await buf.accumulate_sparse(idx, values, offset=offset, wire=wire)
    expected = base.copy()
    # numpy.add.at adds in the arrays' order: each server adds its items in
    # the caller's order too, so even the rounding of duplicates agrees
    np.add.at(expected[offset // 4:], idx, _sent(values, wire))
    got = (await buf.read(0, buf.nbytes)).view(np.float32)
    assert np.array_equal(got, expected)
    # one request per server
    assert _sparse_requests(cluster.servers) - before == 4


async def test_overlapping_sparse_pushes_from_several_clients_all_land(cluster: smb2.LocalCluster,
                                                                      transport: str) -> None:
    clients = [await cluster.connect(transport=transport) for _ in range(4)]
    try:
        bufs = [await clients[0].create("shared", 4 * 2 * STRIPE, stripe=STRIPE)]
        bufs += [await c.attach("shared") for c in clients[1:]]
        words = bufs[0].nbytes // 4
        rng = np.random.default_rng(2)
        # small integers: exact whatever order the servers add them in
        pushes = [[(rng.integers(0, words, 1500), rng.integers(-4, 5, 1500).astype(np.float32))
                   for _ in range(6)] for _ in clients]

        async def worker(buf: smb2.Buffer, mine: list[tuple[np.ndarray, np.ndarray]]) -> None:
            for idx, vals in mine:
                await buf.accumulate_sparse(idx, vals)
        await asyncio.gather(*(worker(b, p) for b, p in zip(bufs, pushes)))
        expected = np.zeros(words, np.float32)
        for mine in pushes:
            for idx, vals in mine:
                np.add.at(expected, idx, vals)
        assert np.array_equal((await bufs[0].read(0, bufs[0].nbytes)).view(np.float32), expected)
    finally:
        for c in clients:
            await c.close()


async def test_sparse_push_cut_into_many_requests(small_frames: list[smb2.Server], transport: str) -> None:
    rng = np.random.default_rng(3)
    async with await smb2.connect([s.address for s in small_frames], transport=transport) as c:
        buf = await c.create("cut", 3 * 8 * 16384, stripe=16384)
        words = buf.nbytes // 4
        idx = rng.integers(0, words, 40000)
        vals = rng.integers(-100, 100, len(idx)).astype(np.float32)
        await buf.accumulate_sparse(idx, vals, wire="bfloat16")     # integers below 256: exact in bf16
        expected = np.zeros(words, np.float32)
        np.add.at(expected, idx, vals)
        assert np.array_equal((await buf.read(0, buf.nbytes)).view(np.float32), expected)
        # 40,000 items of 6 bytes need at least 15 frames of 16 KiB
        assert _sparse_requests(small_frames) > 40000 * 6 // (16 << 10)


async def test_sparse_argument_errors_name_the_buffer_and_send_nothing(client: smb2.Client) -> None:
    buf = await client.create("args", 2 * 4 * STRIPE, stripe=STRIPE)
    words = buf.nbytes // 4
    one = np.ones(3, np.float32)
    bad = [
        (dict(indices=[0, 1, words], values=one), "outside the buffer"),
        (dict(indices=[0, -1, 2], values=one), "index -1"),
        (dict(indices=[0, 1, 2], values=one, offset=8 * 4 * STRIPE - 8), "outside the buffer"),
        (dict(indices=[0, 1], values=one), "disagree in length"),
        (dict(indices=[0, 1, 2], values=one.astype(np.float64)), "float32"),
        (dict(indices=[[0, 1, 2]], values=one), "1-D"),
        (dict(indices=[0.0, 1.0, 2.0], values=one), "integers"),
        (dict(indices=[0, 1, 2], values=one, offset=2), "aligned"),
        (dict(indices=[0, 1, 2], values=one, wire="int8"), "wire must be"),
    ]
    for kwargs, message in bad:
        with pytest.raises(InvalidArgumentError, match=message) as err:
            await buf.accumulate_sparse(**kwargs)
        if message != "wire must be":
            assert "'args'" in str(err.value)
    assert not (await buf.read(0, buf.nbytes)).any()
    await buf.accumulate_sparse(np.array([], np.int64), np.array([], np.float32))     # nothing to add: fine


def _payload(idx: list[int], vals: np.ndarray, *, wide: bool = False, count: int | None = None) -> bytes:
    index = np.array(idx, np.uint64 if wide else np.uint32)
    return np.uint64(len(idx) if count is None else count).tobytes() + index.tobytes() + vals.tobytes()


_sparse = functools.partial(raw.typed, Op.ACCUMULATE_SPARSE)


async def test_bad_sparse_requests_are_refused_whole_and_add_nothing(server: smb2.Server) -> None:
    async with await smb2.connect([server.address]) as c:
        await c.create("victim", 2 * STRIPE)
    seg = server.by_name["victim"]
    words = seg.size // 4
    ones = np.ones(4, np.float32)
    bad = [
        # the count says 5, the payload holds 4 indices and 4 values
        (_sparse(F32, _payload([0, 1, 2, 3], ones, count=5), segment=seg.id, offset=0, rid=2),
         ErrorCode.BAD_REQUEST, "disagree in length"),
        # three good indices and one past the part: none of them is added
        (_sparse(F32, _payload([0, 5, 9, words], ones), segment=seg.id, offset=0, rid=3),
         ErrorCode.OUT_OF_BOUNDS, "buffer 'victim'"),
        (_sparse(F32, _payload([0, 1, 2, words - 1], ones), segment=seg.id, offset=4, rid=4),
         ErrorCode.OUT_OF_BOUNDS, "nothing was added"),
        (_sparse(F32, _payload([0, 1, 2, 1 << 40], ones, wide=True), segment=seg.id, offset=0, rid=5,
                 flags=FLAG_WIDE_INDEX), ErrorCode.OUT_OF_BOUNDS, "buffer 'victim'"),
        (_sparse(3, _payload([0, 1, 2, 3], ones), segment=seg.id, offset=0, rid=6),
         ErrorCode.BAD_REQUEST, "not dtype code 3"),
        (_sparse(F32, _payload([0, 1, 2, 3], ones), segment=seg.id, offset=2, rid=7),
         ErrorCode.BAD_REQUEST, "base offset 2"),
        (_sparse(F32, _payload([0], ones[:1]), segment=seg.id, offset=seg.size + 4, rid=8),
         ErrorCode.OUT_OF_BOUNDS, "base offset"),
        (_sparse(F32, b"\x01\x00", segment=seg.id, offset=0, rid=9), ErrorCode.BAD_REQUEST, "u64 count"),
        (_sparse(F32, _payload([0, 1], np.ones(2, np.uint16)), segment=seg.id, offset=0, rid=10),
         ErrorCode.BAD_REQUEST, "disagree in length"),       # two bf16 where two float32 are asked
        (_sparse(F32, _payload([0], ones[:1]), segment=0, offset=0, rid=11), ErrorCode.ACCESS_DENIED,
         "lock segment"),
        (_sparse(F32, bytes(16), segment=seg.id, offset=0, rid=12, flags=FLAG_STAGED), ErrorCode.BAD_REQUEST,
         "needs rdma_connect"),
        (_sparse(F32, _payload([0], ones[:1]), segment=seg.id + 100, offset=0, rid=13), ErrorCode.NO_SUCH_BUFFER,
         "no segment"),
    ]
    locks_before = bytes(server.segments[0].mem)
    reader, writer = await asyncio.open_connection(*server.address)
    try:
        await raw.expect_refusals(reader, writer, bad)
        assert not seg.mem.any() and bytes(server.segments[0].mem) == locks_before
        # the connection is still good, and a request done right adds, its
        # duplicates each once: bf16 1.0 three times into the last word
        bf16_ones = np.full(4, 0x3F80, np.uint16)
        writer.write(_sparse(BF16, _payload([words - 1, 0, words - 1, words - 1], bf16_ones), segment=seg.id,
                             offset=0, rid=14))
        hdr, _ = await raw.reply(reader)
        assert hdr[4] == 0 and hdr[5] == 14
        got = seg.mem.view(np.float32)
        assert got[-1] == 3 and got[0] == 1 and not got[1:-1].any()
    finally:
        writer.close()


async def test_a_sparse_request_over_the_accumulate_limit_closes_the_connection(server: smb2.Server) -> None:
    async with await smb2.connect([server.address]) as c:
        await c.create("big", 2 * STRIPE)
    seg = server.by_name["big"]
    reader, writer = await asyncio.open_connection(*server.address)
    try:
        # only the header: the server refuses the announced length before any payload
        writer.write(raw.hello() + raw.frame(Op.ACCUMULATE_SPARSE, b"", rid=2, segment=seg.id,
                                             length=(4 << 20) + 8, flags=F32 << DTYPE_SHIFT))
        await raw.reply(reader)
        hdr, body = await raw.reply(reader)
        assert hdr[4] == ErrorCode.TOO_LARGE and "exceeds the limit" in msgpack.unpackb(body)["message"]
        assert await raw.closed(reader)
    finally:
        writer.close()


async def test_sparse_push_waits_for_a_write_it_overlaps(server: smb2.Server) -> None:
    """A sparse accumulate is atomic against writes as a dense one is: it
    waits for a write still being received into the words it reaches."""
    async with await smb2.connect([server.address]) as c:
        buf = await c.create("held", 4 * STRIPE, stripe=4 * STRIPE)
        # [3072, 4096): words 768..1023 of float32 2.0
        await raw.held_by_half_a_write(server, "held", 3072, np.full(256, 2.0, np.float32).tobytes(),
                                       buf.accumulate_sparse(np.array([0, 900, 5]), np.ones(3, np.float32)))
        got = (await buf.read(0, 4096)).view(np.float32)
    assert got[0] == 1 and got[5] == 1 and got[900] == 3 and (got[768:900] == 2).all()


async def _copies(cluster: smb2.LocalCluster, buf: smb2.Buffer) -> list[np.ndarray]:
    """Every copy of the buffer, each put together from its servers' segments
    (one array per replica rank: the primaries' bytes, the backups', ...)."""
    p = buf.placement
    assert p is not None
    segs = [(await segment_bytes(a, buf.name))[1] for a in cluster.addresses]
    out = []
    for j in range(buf.replicas):
        whole = bytearray(p.nstripes * p.stripe)
        for i in range(p.nstripes):
            s = p.replicas_of(i)[j]
            whole[i * p.stripe:(i + 1) * p.stripe] = segs[s][p.offset_on(s, i):p.offset_on(s, i) + p.stripe]
        out.append(np.frombuffer(bytes(whole[:buf.nbytes]), np.float32))
    return out


async def test_replicated_sparse_push_lands_once_on_every_copy_and_a_retry_adds_nothing(
        replicated_cluster: smb2.LocalCluster) -> None:
    cluster = replicated_cluster
    async with await cluster.connect() as c:
        buf = await c.create("rsp", 6 * STRIPE, stripe=STRIPE, replicas=2)
        words = buf.nbytes // 4
        rng = np.random.default_rng(4)
        idx = np.concatenate([rng.integers(0, words, 2000), [3] * 7])
        vals = rng.integers(-50, 50, len(idx)).astype(np.float32)
        await buf.accumulate_sparse(idx, vals)
        expected = np.zeros(words, np.float32)
        np.add.at(expected, idx, vals)
        for copy in await _copies(cluster, buf):
            assert np.array_equal(copy, expected)
        # a request retried by its client (same client id and sequence) is
        # answered from the duplicate table; the next sequence adds again
        assert buf.placement is not None
        primary = buf.placement.replicas_of(0)[0]
        base = buf.placement.offset_on(primary, 0)
        raw_conn = await Raw.open(cluster.addresses[primary])
        try:
            epoch = (await raw_conn.control({"cmd": "stat"}))["replication"]["epoch"]
            body = _payload([1, 2, 2], np.array([1.0, 2.0, 4.0], np.float32))
            for seq in (1, 1, 1, 2):
                head = _core.pack_u64(epoch) + _core.pack_u64(0x5A5E) + _core.pack_u64(seq)
                st, msg = await raw_conn.op(Op.ACCUMULATE_SPARSE, buf.segments[primary], base, head + body,
                                            FLAG_REPLICATED | F32 << DTYPE_SHIFT)
                assert st == 0, msg
            # past the stripe the base lies in: refused, nothing applied anywhere
            head = _core.pack_u64(epoch) + _core.pack_u64(0x5A5E) + _core.pack_u64(3)
            st, msg = await raw_conn.op(Op.ACCUMULATE_SPARSE, buf.segments[primary], base,
                                        head + _payload([0, STRIPE // 4], np.ones(2, np.float32)),
                                        FLAG_REPLICATED | F32 << DTYPE_SHIFT)
            assert st == ErrorCode.OUT_OF_BOUNDS and "stripe" in msg["message"]
        finally:
            raw_conn.close()
        expected[1] += 2
        expected[2] += 12
        for copy in await _copies(cluster, buf):
            assert np.array_equal(copy, expected)


async def test_a_server_that_does_not_say_sparse_at_hello_is_sent_nothing(server: smb2.Server) -> None:
    # an older smb2-server closes the connection on an op it does not know: the client asks first
    async with await smb2.connect([server.address]) as c:
        buf = await c.create("old", 2 * STRIPE)
        t = c.links[0].transport
        assert t is not None and t.server_info.pop("sparse") is True
        with pytest.raises(Unsupported, match=f"server {server.address[0]}:{server.address[1]} does not take") as err:
            await buf.accumulate_sparse([0, 1], np.ones(2, np.float32))
        assert "upgrade smb2-server" in str(err.value)
        await buf.accumulate(0, np.ones(2, np.float32))     # the connection is as it was
    assert _sparse_requests([server]) == 0


def test_the_plan_rebases_each_servers_indices_and_widens_them_only_past_u32() -> None:
    # pure arithmetic (no buffer of 16 GiB is made): one server, a stripe larger than the indices reach
    far = 1 << 32
    vals = np.ones(2, np.float32)
    [near] = plan(np.array([far + 5, far + 1]), vals, F32, 0, stripe=1 << 40, nservers=1, first=0,
                  per_stripe=False, limit=1 << 20)
    assert near.base == 4 * (far + 1) and not near.flags & FLAG_WIDE_INDEX      # rebased to its lowest word
    assert np.frombuffer(near.payload[1], np.uint32).tolist() == [4, 0]        # the caller's order kept
    [wide] = plan(np.array([0, far + 3]), vals, F32, 0, stripe=1 << 40, nservers=1, first=0, per_stripe=False,
                  limit=1 << 20)
    assert wide.base == 0 and wide.flags & FLAG_WIDE_INDEX
    assert np.frombuffer(wide.payload[1], np.uint64).tolist() == [0, far + 3]
    # four servers, stripes of 16 words: word 17 is server 1's word 1, word 70 server 0's word 22 (19 past
    # its lowest, word 3)
    reqs = plan(np.array([17, 70, 3]), np.ones(3, np.float32), F32, 0, stripe=64, nservers=4, first=0,
                per_stripe=False, limit=1 << 20)
    assert [(r.target, r.base, np.frombuffer(r.payload[1], np.uint32).tolist()) for r in reqs] == [
        (0, 12, [19, 0]), (1, 4, [0])]


async def test_wide_indices_add_where_they_point(server: smb2.Server) -> None:
    async with await smb2.connect([server.address]) as c:
        await c.create("wide", 2 * STRIPE)
    seg = server.by_name["wide"]
    raw_conn = await Raw.open(f"{server.address[0]}:{server.address[1]}")
    try:
        st, msg = await raw_conn.op(Op.ACCUMULATE_SPARSE, seg.id, 8,
                                    _payload([0, 5, 5], np.array([1, 2, 4], np.float32), wide=True),
                                    F32 << DTYPE_SHIFT | FLAG_WIDE_INDEX)
        assert st == 0, msg
    finally:
        raw_conn.close()
    got = seg.mem.view(np.float32)
    assert got[2] == 1 and got[7] == 6 and np.count_nonzero(got) == 2
