"""Bad input: thousands of random and mutated frames and malformed control
messages thrown at a real ``smb2-server`` process over many connections.

Afterwards the server must still serve a well-behaved client correctly, must
have logged no internal error, every byte it sent must have been a whole
well-formed reply, and its memory (RSS, measured after a warm-up round, with
all buffers destroyed) must not have grown beyond a small bound.  A second
server with a token is fuzzed too: nothing may get past its authentication
gate.  ``SMB2_FUZZ_SCALE`` multiplies the example counts (default 1: a few
thousand frames, a few seconds).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import smb2
from smb2 import _core
from smb2.errors import ErrorCode
from smb2.protocol import DTYPE_SHIFT, FLAG_STAGED, WIRE_CODES, Op
from smb2.testing.floats import same_floats, widen
from smb2.testing.fuzzing import (
    Harness,
    check_replies,
    control,
    control_payload,
    exchange,
    frame,
    hello,
    mutate,
    stream,
)
from smb2.testing.launch import ServerProcess

SCALE = float(os.environ.get("SMB2_FUZZ_SCALE", "1"))
TOKEN = b"fuzz-token-0123456789"
SEG_SIZE = 64 << 10

# what the fuzzers did, for the closing report (written to $SMB2_FUZZ_STATS if set)
STATS = {"frames": 0, "connections": 0, "control_messages": 0, "random_bytes": 0,
         "gate_frames": 0}


def _n(k: int) -> int:
    return max(1, int(k * SCALE))


_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Proc(ServerProcess):
    """A fuzzed server: its log in a file, the segment aimed at, its RSS once warmed up."""

    def __init__(self, tmp: Path, name: str, token: bytes | None) -> None:
        self.log_path = tmp / f"{name}.stderr"
        super().__init__("--capacity", "32MiB", "--log-level", "WARNING", token=token,
                         stderr=self.log_path.open("w"))
        self.segment = 0
        self.baseline = 0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


async def _target(p: Proc, token: bytes | None = None) -> int:
    async with await smb2.connect([p.address], token=token) as c:
        return (await c.create("fuzz", SEG_SIZE, stripe=1024)).segments[0]


@pytest.fixture(scope="module")
def tmpdir_module() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="smb2-fuzz-") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def srv(tmpdir_module: Path) -> Iterator[Proc]:
    p = Proc(tmpdir_module, "open", None)
    try:
        p.segment = asyncio.run(_target(p))
        # warm up: the allocator's arenas and the server's caches reach their
        # working size, so growth measured later is growth, not start-up
        rng = random.Random(1)
        for _ in range(100):
            exchange(p.address, stream(rng, p.segment, SEG_SIZE)[0])
        p.baseline = p.rss
        yield p
    finally:
        p.stop(10)
        out = os.environ.get("SMB2_FUZZ_STATS")
        if out:
            Path(out).write_text(json.dumps(STATS, indent=2))


@pytest.fixture(scope="module")
def gated(tmpdir_module: Path) -> Iterator[Proc]:
    p = Proc(tmpdir_module, "gated", TOKEN)
    try:
        p.segment = asyncio.run(_target(p, TOKEN))
        yield p
    finally:
        p.stop(10)


def _run(p: Proc, data: bytes, nframes: int) -> None:
    check_replies(exchange(p.address, data))
    STATS["frames"] += nframes
    STATS["connections"] += 1


def test_mutated_frames(srv: Proc) -> None:
    @settings(max_examples=_n(400), **_SETTINGS)
    @given(st.randoms(use_true_random=False))
    def one(rng: random.Random) -> None:
        data, n = stream(rng, srv.segment, SEG_SIZE)
        _run(srv, data, n)
    one()


def test_random_bytes(srv: Proc) -> None:
    @settings(max_examples=_n(150), **_SETTINGS)
    @given(st.booleans(), st.binary(min_size=1, max_size=512))
    def one(greet: bool, data: bytes) -> None:
        _run(srv, (hello() if greet else b"") + data, 1 + greet)
        STATS["random_bytes"] += len(data)
    one()


def test_malformed_control_messages(srv: Proc) -> None:
    """Each gets an error reply (or, over 1 MiB, a close), and the connection
    goes on serving: the last ``list`` is answered."""
    @settings(max_examples=_n(250), **_SETTINGS)
    @given(st.randoms(use_true_random=False), st.integers(1, 6))
    def one(rng: random.Random, k: int) -> None:
        bodies = [control_payload(rng) for _ in range(k)]
        data = hello() + b"".join(frame(Op.CONTROL, b, rid=10 + i) for i, b in enumerate(bodies))
        data += control({"cmd": "list"}, rid=99)
        r = check_replies(exchange(srv.address, data))
        answered = {h[5]: h[4] for h in r.frames}
        # a hello with another version breaks the stream (the server closes)
        codes = list(answered.values())
        if ErrorCode.VERSION_MISMATCH in codes:
            assert codes[-1] == ErrorCode.VERSION_MISMATCH
        else:
            assert answered.get(99) == 0, (answered, bodies)
            assert all(10 + i in answered for i in range(k))
        STATS["control_messages"] += k
        STATS["frames"] += k + 2
        STATS["connections"] += 1
    one()


def test_many_connections_at_once(srv: Proc) -> None:
    rng = random.Random(7)
    streams = [stream(rng, srv.segment, SEG_SIZE, max_frames=30) for _ in range(_n(200))]
    with ThreadPoolExecutor(32) as pool:
        for r in pool.map(lambda s: check_replies(exchange(srv.address, s[0])), streams):
            assert r.trailing == 0
    STATS["frames"] += sum(n for _, n in streams)
    STATS["connections"] += len(streams)


def test_nothing_gets_past_the_auth_gate(gated: Proc) -> None:
    """Fuzz a server that has a token: no data op may ever execute, no buffer
    appear, no segment id be revealed."""
    prefixes = [hello(), hello() + control({"cmd": "auth", "nonce": b"n" * 32, "proof": b"p" * 32}, 2)]

    @settings(max_examples=_n(250), **_SETTINGS)
    @given(st.randoms(use_true_random=False))
    def one(rng: random.Random) -> None:
        data, n = stream(rng, gated.segment, SEG_SIZE, prefix=rng.choice(prefixes))
        if rng.random() < 0.3:
            data = mutate(data, rng)
        raw = exchange(gated.address, data)
        r = check_replies(raw)
        for hdr in r.frames:
            # only hello (status 0) or refusals: never a successful data reply
            assert hdr[4] != 0 or hdr[2] == Op.CONTROL, hdr
        assert b"segment" not in raw
        STATS["gate_frames"] += n
        STATS["frames"] += n
        STATS["connections"] += 1
    one()

    async def check() -> None:
        # the wrong guesses above cost the token holder from that address nothing
        async with await smb2.connect([gated.address], token=TOKEN) as c:
            st_ = (await c.stat())[0]
            assert st_["ops"] == {}, st_["ops"]
            assert list(st_["buffers"]) == ["fuzz"]
            assert st_["auth_failures"] > 0
            buf = await c.attach("fuzz")
            assert not (await buf.read(0, buf.nbytes)).any()
    asyncio.run(check())
    assert "Traceback" not in gated.log() and "internal error" not in gated.log()


def test_after_fuzzing_the_server_serves_and_did_not_grow(srv: Proc) -> None:
    async def well_behaved() -> None:
        async with await smb2.connect([srv.address]) as c:
            for name in await c.buffers():
                await c.destroy(name)
            buf = await c.create("after", 4 << 20, stripe=1 << 16)
            data = np.random.default_rng(3).integers(0, 256, buf.nbytes, dtype=np.uint8)
            await buf.write(0, data)
            assert np.array_equal(await buf.read(0, buf.nbytes), data)
            await buf.accumulate(0, np.ones(1024, dtype=np.int64))
            got = (await buf.read(0, 8192)).view(np.int64)
            assert np.array_equal(got, data[:8192].view(np.int64) + 1)
            assert await buf.fetch_add(8192, 5) == int(data[8192:8200].view(np.int64)[0])
            st_ = (await c.stat())[0]
            assert st_["connections"] == 1          # no connection object outlived its socket
            STATS["server_ops_executed"] = sum(st_["ops"].get("tcp", {}).values())
            STATS["server_refused"] = st_["refused"]
            await c.destroy("after")
            assert (await c.stat())[0]["used"] == 0
    asyncio.run(well_behaved())
    log = srv.log()
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]
    grown = srv.rss - srv.baseline
    print(f"\nfuzz: {STATS}; server RSS {srv.baseline >> 10} KiB -> {srv.rss >> 10} KiB")
    assert grown < 8 << 20, f"server RSS grew by {grown >> 10} KiB over the fuzzing"


async def test_in_process_with_every_recv_boundary() -> None:
    """The same frames without sockets, delivered in arbitrary pieces: a header
    split anywhere, a payload arriving byte by byte, many frames in one recv."""
    h = Harness()

    @settings(max_examples=_n(300), **_SETTINGS)
    @given(st.randoms(use_true_random=False), st.lists(st.integers(0, 4096), max_size=8))
    def one(rng: random.Random, cuts: list[int]) -> None:
        data, n = stream(rng, h.segment, 1 << 16)
        h.feed(data, cuts)
        STATS["frames"] += n
        STATS["in_process_frames"] = STATS.get("in_process_frames", 0) + n
    one()
    assert h.server.segments


_WIDENING = {code: wire for wire, code in WIRE_CODES.items()}


@st.composite
def _widening_frames(draw: st.DrawFn, segment: int, rid: int) -> tuple[bytes, int, int, int, int]:
    """A widening ACCUMULATE, often subtly wrong: (frame, code, flags, offset, payload length)."""
    code = draw(st.sampled_from([*_WIDENING] * 3 + [0, 7, 15]))
    flags = code << DTYPE_SHIFT | (FLAG_STAGED if draw(st.integers(0, 9)) == 0 else 0)
    items = draw(st.integers(0, 600))
    payload = draw(st.binary(min_size=2 * items, max_size=2 * items))  # bf16/fp16 bit patterns
    if items and not draw(st.integers(0, 4)):
        payload = payload[:-1]                   # half an item
    offset = draw(st.one_of(
        st.integers(0, SEG_SIZE // 4 - items).map(lambda k: 4 * k),
        # the payload would fit before the end, the float32 range it covers not
        st.integers(items // 2 + 1, max(items, items // 2 + 1)).map(lambda k: SEG_SIZE - 4 * k),
        st.integers(0, SEG_SIZE + 64)))
    return (frame(Op.ACCUMULATE, payload, rid=rid, segment=segment, offset=offset, flags=flags),
            code, flags, offset, len(payload))


async def test_widening_accumulates_never_write_outside_their_range() -> None:
    """Widening accumulates (a bf16/fp16 payload covering twice its length of
    float32) with every field a little off, in arbitrary pieces: each one is
    answered; the ones that are right add exactly upcast(payload) into
    exactly their range; the others are refused with the reason and change
    no byte anywhere."""
    h = Harness()
    applied: list[int] = []

    @settings(max_examples=_n(150), **_SETTINGS)
    @given(st.data(), st.lists(st.integers(0, 4096), max_size=6))
    def one(data: st.DataObject, cuts: list[int]) -> None:
        seg = h.server.by_name["fuzz"]
        frames = [data.draw(_widening_frames(h.segment, rid), label=f"frame {rid}")
                  for rid in range(2, 2 + data.draw(st.integers(1, 4)))]
        stream = hello() + b"".join(f for f, *_ in frames)
        before = seg.mem.copy()
        replies = h.feed(stream, cuts)
        STATS["frames"] += len(frames)
        assert [hdr[5] for hdr in replies.frames] == [1] + [2 + i for i in range(len(frames))]
        expect = before.view(np.float32).copy()
        for (raw, code, flags, offset, length), hdr in zip(frames, replies.frames[1:], strict=True):
            rid = hdr[5]
            span = 2 * length
            if code not in _WIDENING or offset % 4 or length % 2:
                assert hdr[4] == ErrorCode.BAD_REQUEST, hdr
            elif flags & FLAG_STAGED:
                assert hdr[4] == ErrorCode.BAD_REQUEST, hdr          # no rdma_connect here
            elif offset + span > seg.size:
                assert hdr[4] == ErrorCode.OUT_OF_BOUNDS, hdr
            else:
                assert hdr[4] == 0, hdr
                applied.append(rid)
                bits = np.frombuffer(raw, np.uint16, offset=32)
                with np.errstate(invalid="ignore", over="ignore"):
                    expect[offset // 4:(offset + span) // 4] += widen(bits, _WIDENING[code])
        assert same_floats(seg.mem.view(np.float32), expect)
    one()
    # the draws reach the adding path, not only the refusals
    assert len(applied) > _n(150) // 4, len(applied)


async def test_client_survives_a_hostile_server() -> None:
    """The other direction: a server (an impostor, or a broken one) answers
    with mutated replies.  Every client call must end in an Smb2Error or a
    result, within a few seconds: no hang, no other exception, no huge
    allocation for an announced length."""
    from smb2.protocol import FLAG_REPLY, VERSION
    from smb2.transport.tcp import TcpTransport

    rng = random.Random(11)
    outcomes: dict[str, int] = {}

    async def hostile(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hdr = _core.decode_header(await reader.readexactly(32))
            await reader.readexactly(hdr[8])
            body = msgpack.packb({"version": VERSION, "max_frame": 1 << 20}, use_bin_type=True)
            writer.write(_core.encode_header(VERSION, Op.CONTROL, FLAG_REPLY, 0, hdr[5], 0, 0, len(body)) + body)
            hdr = _core.decode_header(await reader.readexactly(32))
            if hdr[2] != Op.READ:
                await reader.readexactly(hdr[8])
            size = rng.choice([0, 8, 16, 100, hdr[8], 1 << 20, 1 << 40, 2**63])
            reply = _core.encode_header(VERSION, hdr[2], FLAG_REPLY, rng.choice([0, 0, 1, 4, 99]), hdr[5],
                                        hdr[6], hdr[7], size)
            reply += rng.randbytes(min(size, 4096))
            if rng.random() < 0.6:
                reply = mutate(reply, rng)
            writer.write(reply)
            await writer.drain()
            await asyncio.sleep(0.05)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    srv = await asyncio.start_server(hostile, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        for _ in range(_n(150)):
            t = await TcpTransport.connect(("127.0.0.1", port), timeout=5)
            out = bytearray(64)
            k = rng.randrange(4)
            call = (t.read_into([memoryview(out)], 1, 0, 64) if k == 0 else t.fetch_add(1, 0, 1) if k == 1
                    else t.write([memoryview(b"x" * 64)], 1, 0, 64) if k == 2 else t.control({"cmd": "list"}))
            try:
                await asyncio.wait_for(call, 5)
                outcome = "ok"
            except smb2.Smb2Error as exc:
                outcome = type(exc).__name__
            finally:
                await t.close()
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            STATS["frames"] += 1
    finally:
        srv.close()
        await srv.wait_closed()
    print(f"\nhostile server: {outcomes}")
    assert outcomes.get("TransportError", 0) + outcomes.get("ProtocolError", 0) > 0, outcomes
