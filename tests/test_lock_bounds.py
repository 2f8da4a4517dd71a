"""Lock state that cleans itself (issue 14, items 3, 6, 9, 10): thousands of
parked waiters dropped without freezing the server's loop, a cap on parked
waiters per connection, slots freed so a job can use any number of lock
names, leases renewable only by the holder (who learns it lost the lock),
the lease fixed at creation, and a bounded fence table that never lets a
stale token through."""

from __future__ import annotations

import asyncio
import mmap
import os
import signal
import time

import msgpack
import pytest

import smb2
from smb2 import _core
from smb2.errors import ErrorCode
from smb2.protocol import LOCK_SEGMENT, Op
from smb2.server import locks as server_locks
from smb2.testing.hostile import (
    LoopWatch,
    SlowestRead,
)
from smb2.testing.launch import ServerProcess
from smb2.testing.waits import until
from smb2.testing.wire import control, frame, hello, reply
from smb2.testing.workers import spawn


async def _pipeline_acquires(server: smb2.Server | ServerProcess, holder: smb2.Lock, n: int, *,
                             acquire: bool = True) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """``holder`` takes its lock (unless not ``acquire``); then a raw
    connection sends ``n`` acquires of it in one burst (request ids 100, 101, ...)."""
    if acquire:
        await holder.acquire()
    reader, writer = await asyncio.open_connection(*server.address)
    writer.write(hello())
    await reply(reader)
    writer.write(control({"cmd": "lock_open", "name": holder.name}, rid=2))
    hdr, body = await reply(reader)
    assert hdr[4] == 0, body
    offset = int(msgpack.unpackb(body)["offset"])
    writer.write(b"".join(frame(Op.LOCK_ACQUIRE, rid=100 + i, segment=LOCK_SEGMENT, offset=offset)
                          for i in range(n)))
    await writer.drain()
    return reader, writer


# -- item 3: many parked waiters ---------------------------------------------------

def test_table_cancels_20k_parked_waiters_and_skips_20k_abandoned_tickets() -> None:
    # how fast is a benchmark's figure (smb2 bench attacks, row 3: a server
    # dropping 20k parked waiters, and the slowest read meanwhile), not this test's
    mem = mmap.mmap(-1, 4096)
    table = _core.LockTable(memoryview(mem), 2)
    table.open(0, 1000, 5.0, 0.0)
    table.acquire(0, 0, 1, 0.0)                      # the holder, owner 1
    for w in range(1, 20001):
        table.acquire(0, w, 2, 0.0)                  # 20k parked, owner 2
    table.acquire(0, 99999, 3, 0.0)                  # one more behind them, owner 3
    t0 = time.perf_counter()
    assert table.drop_owner(2, 0.0) == []            # 20k cancelled while the holder holds
    assert table.release(0, 1000, 0.0) == (True, [99999])   # one pass skips all 20k
    dropped = time.perf_counter() - t0
    assert table.abandoned_skips == 20000 and table.parked_count(0) == 0
    # 20k tickets drawn with one fetch_add by a polling client, given up one by one
    table.open(1, 5000, 5.0, 0.0)
    mem[32:40] = (5000 + 20000).to_bytes(8, "little")
    t0 = time.perf_counter()
    for t in range(5000 + 19999, 5000, -1):
        assert table.abandon(1, t, 0.0) == []
    table.abandon(1, 5000, 0.0)
    abandoned = time.perf_counter() - t0
    assert table.words(1)[:2] == (25000, 25000) and table.abandoned(1) == []
    print(f"\n20k parked waiters dropped in {dropped * 1e3:.1f} ms; 20k abandoned tickets in "
          f"{abandoned * 1e3:.1f} ms")


async def test_server_drops_20k_parked_waiters_when_their_connection_closes() -> None:
    # the loop's longest stall meanwhile is printed, not asserted: a latency is
    # a benchmark's (smb2 bench attacks, row 3), and a loaded machine's scheduler adds to it
    server = await smb2.start_server("127.0.0.1", 0, max_inflight=30000)
    server.locks.max_parked = 20000          # this test measures the table, not the caps
    try:
        async with await smb2.connect([server.address]) as client:
            holder = client.lock("busy")
            reader, writer = await _pipeline_acquires(server, holder, 20000)
            def parked() -> int:
                return int(server.locks.stat()["locks"]["busy"]["parked"])
            await until(lambda: parked() == 20000, "20k waiters parked", every=0.05)
            skipped = server.locks.table.abandoned_skips
            watch = LoopWatch()
            writer.close()
            await until(lambda: parked() == 0, "the 20k parked waiters dropped")
            worst = watch.stop()
            print(f"\nloop's longest stall while 20k parked waiters were dropped: {worst * 1e3:.1f} ms")
            # the queue is clean: released, the next contender is granted, the
            # 20k dropped tickets skipped on the way (no lease waited out)
            await holder.release(wait=True)
            other = client.lock("busy")
            await other.acquire(timeout=60)       # hang guard
            assert server.locks.table.abandoned_skips - skipped == 20000
            assert server.locks.table.expired == 0
            await other.release()
    finally:
        await server.close()


@pytest.mark.server_process_only
async def test_smb2_server_process_answers_while_40_connections_drop_20k_parked_waiters() -> None:
    """The same with the default caps, on a real smb2-server process: 40
    connections x 500 parked acquires, all closed at once, while another
    client measures how long its small reads wait."""
    server = ServerProcess("--capacity", "16MiB")
    try:
        client = await smb2.connect([server.address], timeout=5)
        buf = await client.create("ping", 64, stripe=64)
        holder = client.lock("busy")
        rss_before = server.rss
        conns = [await _pipeline_acquires(server, holder, 500, acquire=i == 0) for i in range(40)]

        async def parked() -> int:
            return int((await client.stat())[0]["locks"]["locks"]["busy"]["parked"])

        async def parked_is(n: int) -> bool:
            return await parked() == n
        await until(lambda: parked_is(20000), "20k waiters parked", every=0.05)
        rss_parked = server.rss
        pinger = SlowestRead(buf)
        await asyncio.sleep(0.1)
        for _, writer in conns:
            writer.close()
        await until(lambda: parked_is(0), "the 20k parked waiters dropped")
        worst = await pinger.stop()
        print(f"\nsmb2-server: slowest 8-byte read while 20k parked waiters were dropped: "
              f"{worst * 1e3:.1f} ms; RSS {rss_before >> 20} MiB before, {rss_parked >> 20} MiB "
              f"with 20k parked, {server.rss >> 20} MiB after")
        assert rss_parked - rss_before < 64 << 20
        assert await parked() == 0
        # the slowest read is printed, not asserted: smb2 bench attacks (row 3)
        # reports it; here, the reads meanwhile succeeded (an error surfaces at
        # the pinger's stop) and the queue is clean afterwards
        await holder.release(wait=True)
        assert (await client.lock("busy").acquire(timeout=60)) is True
        await client.close()
    finally:
        server.stop()


async def test_parked_waiters_per_connection_are_capped() -> None:
    server = await smb2.start_server("127.0.0.1", 0)
    try:
        async with await smb2.connect([server.address]) as client:
            holder = client.lock("capped")
            cap = server_locks.DEFAULT_MAX_PARKED
            reader, writer = await _pipeline_acquires(server, holder, cap + 10)
            refused = []
            for _ in range(10):
                hdr, body = await reply(reader)
                refused.append((hdr[4], body))
            assert all(status == ErrorCode.OUT_OF_MEMORY for status, _ in refused)
            assert b"lock acquires waiting" in refused[0][1]
            assert server.locks.stat()["locks"]["capped"]["parked"] == cap
            writer.close()
            await holder.release(wait=True)
            assert (await client.lock("capped").acquire(timeout=5)) is True
    finally:
        await server.close()


# -- item 6: unbounded distinct names over time --------------------------------

@pytest.mark.server_process_only
async def test_ten_thousand_distinct_lock_names_on_the_default_slot_count() -> None:
    server = await smb2.start_server("127.0.0.1", 0)
    assert server.locks.nslots == server_locks.DEFAULT_SLOTS == 4096
    try:
        async with await smb2.connect([server.address]) as client:
            most_open = 0

            async def task(i: int) -> None:
                nonlocal most_open
                lock = client.lock(f"task-{i}")
                async with lock:
                    most_open = max(most_open, server.locks.stat()["open"])
                if i % 2:
                    await lock.close()          # explicitly; the even ones are dropped

            for start in range(0, 10000, 50):
                await asyncio.gather(*(task(i) for i in range(start, start + 50)))
            for _ in range(100):                 # the dropped Locks' lock_close land
                if server.locks.stat()["open"] == 0:
                    break
                await asyncio.sleep(0.02)
            stat = server.locks.stat()
            print(f"\n10k names: at most {most_open} slots open at once, {stat['reclaimed']} freed")
            assert stat["open"] == 0 and stat["reclaimed"] == 10000
            # 50 in use at a time, plus dropped Locks whose lock_close is on its way
            assert most_open < server_locks.DEFAULT_SLOTS // 2
            # a name's slot stays bound while some Lock of the client uses it
            kept = client.lock("kept")
            again = client.lock("kept")
            for lock in (kept, again):
                await lock.acquire()
                await lock.release()
            await kept.close()
            assert "kept" in server.locks.stat()["locks"]     # `again` still uses it
            await again.acquire()
            await again.release()
            await again.close()
            assert "kept" not in server.locks.stat()["locks"]
    finally:
        await server.close()


async def test_a_freed_slot_is_not_freed_while_held_and_its_tokens_stay_stale() -> None:
    server = await smb2.start_server("127.0.0.1", 0)
    try:
        async with await smb2.connect([server.address]) as a, await smb2.connect([server.address]) as b:
            buf = await a.create("data", 64, stripe=64)
            lock = a.lock("x")
            await lock.acquire()
            old = lock.fence
            await lock.release()
            held = b.lock("x")
            await held.acquire()
            await lock.close()                   # a lets go of the name; b still holds it
            assert "x" in server.locks.stat()["locks"]
            await held.release()
            await held.close()
            assert "x" not in server.locks.stat()["locks"]
            with pytest.raises(smb2.StaleFence):
                await buf.write(0, b"late", fence=old)          # the freed lock's token
            fresh = a.lock("x")
            await fresh.acquire()
            assert fresh.token is not None and fresh.token > old.token
            await buf.write(0, b"ok", fence=fresh)
            await fresh.release()
    finally:
        await server.close()


# -- item 9: leases tied to the holder's ticket ----------------------------------

async def _line(proc: asyncio.subprocess.Process, timeout: float = 20) -> str:
    assert proc.stdout is not None
    return (await asyncio.wait_for(proc.stdout.readline(), timeout)).decode().strip()


@pytest.mark.parametrize("mode", ["park", "poll"])
async def test_a_stale_holder_cannot_keep_the_lease_alive_and_learns_it_lost_the_lock(mode: str) -> None:
    lease = 0.6
    async with smb2.LocalCluster(servers=1, capacity="16MiB") as cluster:
        client = await cluster.connect()
        await client.create("b", 64, stripe=64)
        cfg = {"servers": cluster.addresses, "buffer": "b", "lock": "L", "action": "hold",
               "mode": mode, "lease": lease}
        table = cluster.servers[0].locks.table
        expired_before = table.expired
        a = await spawn(cfg)
        b = None
        try:
            assert (await _line(a)).startswith("HELD")
            b = await spawn(cfg)
            os.kill(a.pid, signal.SIGSTOP)                   # A freezes holding the lock
            assert (await _line(b)).startswith("HELD")      # B gets it after A's lease
            os.kill(a.pid, signal.SIGCONT)                   # A resumes, renews ...
            lost = await _line(a, 10)
            assert lost.startswith("LOST") and "lease" in lost     # ... and learns it lost
            assert table.expired >= expired_before + 1           # A's expiry counted (B got it)
            # C takes the lock (after B's lease, or at once where a loaded
            # machine starved B of its renewals) and stops renewing it: an
            # in-process holder, which no load can make lose the lock early
            os.kill(b.pid, signal.SIGSTOP)
            c = client.lock("L")
            await c.acquire(timeout=60)                     # hang guard
            c._renew.cancel()            # type: ignore[union-attr]  # a holder that stopped
            expired = table.expired
            # An old-style stale holder renewing as fast as it likes (the
            # heartbeat tagged with a ticket that no longer holds the lock)
            # extends nothing: D gets the lock one lease after C stopped.
            server = cluster.servers[0]
            slot = server.locks.by_name["L"]
            serving = table.words(slot)[1]
            t = await client.links[0].get()
            off = slot * _core.LOCK_SLOT_SIZE + _core.LOCK_HEARTBEAT
            stop = False

            async def stale_renewals() -> None:
                hb = 0
                while not stop:
                    hb = await t.compare_swap(LOCK_SEGMENT, off, hb, _core.renewal_word(serving - 1, hb))
                    await asyncio.sleep(0.01)
            renewer = asyncio.ensure_future(stale_renewals())
            t0 = time.monotonic()
            d = client.lock("L")
            # the stale renewals go on until D is granted: had they extended the
            # lease, it would never be (60 s: a hang guard)
            await d.acquire(timeout=60)
            waited = time.monotonic() - t0
            stop = True
            await renewer
            print(f"\nD got the lock {waited:.2f} s after C stopped renewing (lease {lease} s)")
            # C's lease ran out, once, and the renewals credited nothing
            assert table.expired == expired + 1
            assert server.locks.stat()["stale_renewals"] > 0
            await d.release()
        finally:
            for p in (a, b):
                if p is not None and p.returncode is None:
                    os.kill(p.pid, signal.SIGCONT)
                    p.kill()
                    await p.wait()


async def test_the_lease_is_fixed_when_the_lock_is_created(cluster: smb2.LocalCluster) -> None:
    a = await cluster.connect()
    b = await cluster.connect()
    first = a.lock("leased", lease=2.0)
    await first.acquire()
    with pytest.raises(smb2.BufferConflict, match="lease of 2.0 s"):
        await b.lock("leased", lease=4.0).acquire(timeout=1)
    with pytest.raises(smb2.BufferConflict, match="lease of 2.0 s"):
        await a.lock("leased", lease=4.0).acquire(timeout=1)
    same = b.lock("leased", lease=2.0)         # the same lease, or none, is fine
    await first.release()
    await same.acquire(timeout=5)
    await same.release()
    await b.lock("leased").acquire(timeout=5)


# -- item 10: the fence table's bound ---------------------------------------------

async def test_the_fence_table_never_accepts_a_stale_token_after_forgetting_its_key() -> None:
    server = await smb2.start_server("127.0.0.1", 0)
    try:
        async with await smb2.connect([server.address]) as client:
            buf = await client.create("f", 64, stripe=64)
            # tokens of a lock that lives on another server ("elsewhere")
            await buf.write(0, b"new", fence=smb2.Fence("elsewhere", 1000))
            with pytest.raises(smb2.StaleFence):
                await buf.write(0, b"old", fence=smb2.Fence("elsewhere", 999))
            # push it out of the table with more keys than it keeps
            locks = server.locks
            for i in range(server_locks.MAX_FENCE_KEYS + 10):
                assert locks.check_fence(_core.name_hash(f"k{i}"), 5)
            assert _core.name_hash("elsewhere") not in locks.fences
            assert len(locks.fences) == server_locks.MAX_FENCE_KEYS
            with pytest.raises(smb2.StaleFence):
                await buf.write(0, b"old", fence=smb2.Fence("elsewhere", 999))
            await buf.write(0, b"new", fence=smb2.Fence("elsewhere", 1000))
    finally:
        await server.close()
