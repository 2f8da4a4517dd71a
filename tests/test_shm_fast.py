"""The shm fast path (issue 15): once a buffer's segments are mapped, each
read, write and atomic is one call of ``_core.MappedStripes`` on the
mapping, without the transport.  These tests show that it serves what it
should (proved by transports whose one-sided operations fail), gets the
bytes right across stripes and servers, and hands every case it cannot
serve to the general path, which raises the proper error: a destroyed
buffer, a lost connection, a restarted server, bad arguments."""

from __future__ import annotations

import asyncio
import mmap
import signal
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

import smb2
from smb2 import _core
from smb2.transport import ShmTransport

MiB = 1 << 20
STRIPE = 4096


@pytest_asyncio.fixture
async def two_servers() -> AsyncIterator[smb2.LocalCluster]:
    async with smb2.LocalCluster(servers=2, capacity="64MiB") as cluster:
        yield cluster


def _transport_never_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the shm transport's own one-sided operations fail: whatever
    still succeeds was served by the fast path."""
    async def refuse(self: ShmTransport, *args: Any) -> Any:
        raise AssertionError("the shm transport was asked for a one-sided operation")
    for op in ("read_into", "write", "fetch_add", "compare_swap"):
        monkeypatch.setattr(ShmTransport, op, refuse)


async def test_reads_writes_and_atomics_across_stripes_skip_the_transport(
        two_servers: smb2.LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    shm = await two_servers.connect(transport="shm")
    tcp = await two_servers.connect(transport="tcp")
    buf = await shm.create("striped", 16 * STRIPE, stripe=STRIPE)
    # the first operation on each server maps its segment (general path)
    await buf.write(0, np.zeros(buf.nbytes, np.uint8))
    _transport_never_copies(monkeypatch)
    rng = np.random.default_rng(15)
    data = rng.integers(0, 256, 3 * STRIPE + 20, dtype=np.uint8)
    start = STRIPE - 10          # crosses 4 stripe boundaries, both servers
    await buf.write(start, data)
    assert np.array_equal(await buf.read(start, len(data)), data)
    whole = np.zeros(buf.nbytes, np.uint8)
    whole[start:start + len(data)] = data
    assert np.array_equal(await (await tcp.attach("striped")).read(0, buf.nbytes), whole)
    # a read into a float64 array (any C-contiguous buffer), and an empty one
    floats = np.empty(STRIPE // 8 * 3, np.float64)
    await buf.read_into(floats, STRIPE)
    assert floats.tobytes() == whole[STRIPE:4 * STRIPE].tobytes()
    await buf.read_into(bytearray(), buf.nbytes)
    # atomics on a word of each server: signed results, u64 operands
    for off in (8 * STRIPE, 9 * STRIPE + 8):
        await buf.write(off, np.zeros(1, np.int64))
        assert await buf.fetch_add(off, -5) == 0
        assert await buf.fetch_add(off, 2**64 - 1) == -5
        assert await buf.compare_swap(off, -6, 2**63) == -6
        assert await buf.fetch_add(off, 0) == -2**63
    await shm.close()
    await tcp.close()


async def test_large_striped_copies_stream_every_stripe_exactly(two_servers: smb2.LocalCluster) -> None:
    """From 4 MiB a copy streams past the cache: odd offsets and lengths,
    stripes of both servers, in both directions."""
    shm = await two_servers.connect(transport="shm")
    buf = await shm.create("big", 24 * MiB, stripe=MiB)
    await buf.write(0, np.zeros(8, np.uint8))
    data = np.random.default_rng(2).integers(0, 256, 9 * MiB + 13, dtype=np.uint8)
    await buf.write(MiB - 7, data)
    out = np.empty(len(data) + 2, np.uint8)
    await buf.read_into(out[1:-1], MiB - 7)      # a destination not 16-byte aligned
    assert np.array_equal(out[1:-1], data)
    tcp = await two_servers.connect(transport="tcp")
    assert np.array_equal(await (await tcp.attach("big")).read(MiB - 7, len(data)), data)
    await shm.close()
    await tcp.close()


async def test_bad_arguments_get_the_general_paths_errors(two_servers: smb2.LocalCluster) -> None:
    shm = await two_servers.connect(transport="shm")
    buf = await shm.create("args", 4 * STRIPE, stripe=STRIPE)
    await buf.write(0, np.arange(buf.nbytes, dtype=np.uint32).view(np.uint8)[:buf.nbytes])
    await buf.fetch_add(STRIPE, 0)           # both servers mapped
    with pytest.raises(smb2.InvalidArgumentError, match="runs past the end"):
        await buf.read(buf.nbytes - 4, 8)
    with pytest.raises(smb2.InvalidArgumentError, match="runs past the end"):
        await buf.write(buf.nbytes, b"x")
    with pytest.raises(smb2.InvalidArgumentError, match="offset must be at least 0"):
        await buf.read_into(np.empty(8, np.uint8), -8)
    with pytest.raises(smb2.InvalidArgumentError, match="offset must be an integer"):
        await buf.read_into(np.empty(8, np.uint8), True)
    with pytest.raises(smb2.InvalidArgumentError, match="C-contiguous"):
        await buf.read_into(np.empty((8, 8), np.uint8)[:, ::2], 0)
    with pytest.raises(smb2.InvalidArgumentError, match="read-only"):
        await buf.read_into(b"12345678", 0)
    with pytest.raises(smb2.InvalidArgumentError, match="bytes-like"):
        await buf.write(0, "text")
    with pytest.raises(smb2.InvalidArgumentError, match="aligned"):
        await buf.fetch_add(4, 1)
    with pytest.raises(smb2.InvalidArgumentError, match="does not fit in 64 bits"):
        await buf.fetch_add(0, 2**64)
    with pytest.raises(smb2.InvalidArgumentError, match="does not fit in 64 bits"):
        await buf.compare_swap(0, -2**63 - 1, 0)
    with pytest.raises(smb2.InvalidArgumentError, match="timeout"):
        await buf.read(0, 8, timeout=-1)
    # what the fast path leaves to the general path still works there
    assert (await buf.read(np.int64(4), 4)).view(np.uint32)[0] == 1
    assert await buf.fetch_add(np.uint64(8), np.int64(0)) == 2 + (3 << 32)
    assert (await buf.read(0, 4, timeout=5)).view(np.uint32)[0] == 0
    await shm.close()
    with pytest.raises(smb2.InterfaceError, match="closed"):
        await buf.read(0, 8)
    with pytest.raises(smb2.InterfaceError, match="closed"):
        await buf.fetch_add(0, 1)


async def test_a_destroyed_buffer_is_no_such_buffer_for_a_client_that_mapped_it(
        two_servers: smb2.LocalCluster) -> None:
    mapper = await two_servers.connect(transport="shm")
    other = await two_servers.connect(transport="tcp")
    buf = await mapper.create("doomed", 2 * STRIPE, stripe=STRIPE)
    await buf.write(0, np.ones(buf.nbytes, np.uint8))
    assert await buf.fetch_add(STRIPE, 1) == 0x0101010101010101
    assert await other.destroy("doomed")
    for op in (buf.read(0, 8), buf.read(STRIPE, 8), buf.write(0, b"12345678"),
               buf.fetch_add(0, 1), buf.compare_swap(STRIPE, 0, 1)):
        with pytest.raises(smb2.NoSuchBuffer):
            await op
    # a new buffer of the same name is not reached through the old handle
    fresh = await other.create("doomed", 2 * STRIPE, stripe=STRIPE)
    await fresh.write(0, np.full(fresh.nbytes, 7, np.uint8))
    with pytest.raises(smb2.NoSuchBuffer):
        await buf.write(0, b"12345678")
    assert (await fresh.read(0, fresh.nbytes) == 7).all()
    await mapper.close()
    await other.close()


async def test_a_restarted_server_makes_the_mapped_handle_stale() -> None:
    async with smb2.LocalCluster(servers=2, processes=True, capacity="16MiB") as cluster:
        client = await cluster.connect(transport="shm", timeout=5)
        buf = await client.create("job", 4 * STRIPE, stripe=STRIPE)
        await buf.write(0, np.full(buf.nbytes, 1, np.uint8))
        assert await buf.fetch_add(0, 0) == 0x0101010101010101
        await cluster.kill(0, signal.SIGKILL)
        await cluster.restart(0)
        replacement = await (await cluster.connect(transport="shm", timeout=5)).create(
            "other", 4 * STRIPE, stripe=STRIPE)
        await replacement.write(0, np.full(replacement.nbytes, 9, np.uint8))
        # whichever the server that restarted answers first, the handle is refused
        for op in (buf.read(0, buf.nbytes), buf.write(0, b"\0" * buf.nbytes)):
            with pytest.raises((smb2.StaleHandle, smb2.TransportError)):
                await op
        with pytest.raises(smb2.StaleHandle):
            await buf.read(0, buf.nbytes)
        assert (await replacement.read(0, replacement.nbytes) == 9).all()
        fresh = await client.attach("other")
        assert (await fresh.read(0, fresh.nbytes) == 9).all()
        await replacement.client.close()
        await client.close()


def _mapped_segment(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    """Process memory shaped like a server's segment: data, then a LIVE state word."""
    mm = mmap.mmap(-1, nbytes + 8)
    whole = memoryview(mm)
    _core.atomic_store(whole, nbytes, 1)
    return mm, whole


@pytest.mark.parametrize("threads", [1, 2, 3, _core.MAX_COPY_THREADS])
def test_large_copies_cut_among_threads_land_byte_for_byte(threads: int) -> None:
    # the parts are cut at page boundaries of the request, not of a stripe
    # or a segment: odd offsets and lengths put every cut inside a stripe
    seg = 12 * MiB
    segments = [_mapped_segment(seg) for _ in range(3)]
    stripes = _core.MappedStripes(3 * seg, 1 * MiB + 4096, 3, 1, 1.0)
    live = _core.LiveFlag()
    for i, (_, whole) in enumerate(segments):
        stripes.attach(i, whole, seg, seg, live)
    stripes.copy_threads = threads
    rng = np.random.default_rng(threads)
    for offset, n in ((4097, 17 * MiB + 13), (0, 4 * MiB * threads), (3, 8 * MiB - 5)):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        assert stripes.write(data, offset) in (_core.COPY_DONE, _core.COPY_DONE_PAUSE)
        out = np.zeros(n + 2, np.uint8)
        assert stripes.read_into(out[1:-1], offset) in (_core.COPY_DONE, _core.COPY_DONE_PAUSE)
        assert np.array_equal(out[1:-1], data) and out[0] == 0 and out[-1] == 0
        # and the bytes are where the stripe plan puts them, nowhere else
        stripe, k = 1 * MiB + 4096, offset
        for i in range(offset // stripe, (offset + n - 1) // stripe + 1):
            lo, hi = max(offset, i * stripe), min(offset + n, (i + 1) * stripe)
            server = (1 + i) % 3
            at = (i // 3) * stripe + lo - i * stripe
            assert bytes(segments[server][1][at:at + hi - lo]) == data[lo - k:hi - k].tobytes()
    for mm, whole in segments:
        whole.release()
        mm.close()


def test_mapped_stripes_pause_once_per_interval_and_then_go_through() -> None:
    mm, whole = _mapped_segment(4096)
    stripes = _core.MappedStripes(4096, 4096, 1, 0, 1e-9)
    live = _core.LiveFlag()
    stripes.attach(0, whole, 4096, 4096, live)
    results = [stripes.fetch_add(0, 1) for _ in range(40)]
    pauses = [i for i, r in enumerate(results) if r is _core.PAUSE]
    # the clock is read every 16th operation; the call after a pause goes through
    assert pauses and all(results[i + 1] is not _core.PAUSE for i in pauses if i + 1 < len(results))
    done = [r for r in results if r is not _core.PAUSE]
    assert done == list(range(len(done)))
    # a copy is done first, then says to pause
    codes = {stripes.read_into(bytearray(8), 0) for _ in range(40)}
    assert codes == {_core.COPY_DONE, _core.COPY_DONE_PAUSE}
    # a lost connection or a segment no longer LIVE: nothing is done, for good
    live.live = False
    assert stripes.read_into(bytearray(8), 0) == _core.COPY_NOT_DONE
    assert not stripes.attached(0, live)
    del whole
    mm.close()


async def test_a_polling_loop_over_the_fast_path_lets_other_tasks_run(two_servers: smb2.LocalCluster) -> None:
    client = await two_servers.connect(transport="shm")
    buf = await client.create("poll", 2 * STRIPE, stripe=STRIPE)
    await buf.write(0, np.zeros(buf.nbytes, np.uint8))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)
    task = asyncio.ensure_future(ticker())
    # the loop stops on the ticks it waits for, never on the clock: a busy
    # machine that takes this process off the CPU only makes the yields (one
    # per 0.5 ms of the monotonic clock) come sooner in operations.  A million
    # operations take far more than the 5 ms that 10 yields need, so a loop
    # that never yields ends there, with the ticker not run
    ops = 0
    while ticks < 10 and ops < 1_000_000:     # never suspends by itself
        await buf.fetch_add(0, 1)
        ops += 1
    task.cancel()
    assert ticks >= 10, f"the ticker ran {ticks} times in {ops} operations over the fast path"
    assert np.frombuffer(await buf.read(0, 8), np.uint64)[0] == ops
    await client.close()
