"""The replicated lock (``client.replicated_lock``) against real ``smb2-server``
processes and a real etcd: mutual exclusion, FIFO and monotonic fencing tokens
across a SIGKILL of the lock's primary, a holder that keeps its lock on the new
primary, and one that is told in plain words that it lost it.  Fenced writes to
a replicated buffer go on refusing stale tokens after its primary is lost."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

import smb2
from smb2.testing.waits import until

pytestmark = pytest.mark.server_process_only


@pytest.fixture
async def replicated() -> AsyncIterator[smb2.LocalCluster]:
    async with smb2.LocalCluster(servers=3, processes=True, replicated=True, capacity="64MiB") as cluster:
        yield cluster


async def _primary_index(cluster: smb2.LocalCluster, client: smb2.Client, name: str) -> int:
    words = await client.attach("lock:" + name)
    return cluster.addresses.index(await words.primary_server(0))


@pytest.mark.slow
async def test_the_holder_keeps_its_lock_across_a_sigkill_of_the_locks_server(
        replicated: smb2.LocalCluster, caplog: pytest.LogCaptureFixture) -> None:
    """The holder renews on the new primary and releases there; the waiters queued before the
    kill are served after it in FIFO order, each once, tokens growing; no two sections overlap."""
    caplog.set_level(logging.WARNING, "smb2")
    async with await smb2.connect(replicated.addresses, transport="tcp") as a, \
            await smb2.connect(replicated.addresses, transport="tcp") as b:
        holder = a.replicated_lock("jobs", lease=4.0)
        await holder.acquire()
        first = holder.token
        assert first is not None and holder.locked()
        lost = await _primary_index(replicated, a, "jobs")
        order: list[int] = []
        sections: list[tuple[float, float, int]] = []

        async def wait(i: int) -> None:
            lock = b.replicated_lock("jobs", lease=4.0)
            async with lock:
                t0 = time.monotonic()
                order.append(i)
                assert lock.token is not None
                await asyncio.sleep(0.02)
                sections.append((t0, time.monotonic(), lock.token))
        words = await a.attach("lock:jobs")
        waiters = []
        for i in range(3):          # queued one after the other (each has drawn its ticket): FIFO is their order
            waiters.append(asyncio.ensure_future(wait(i)))

            async def drawn(i: int = i) -> bool:     # the lock's next ticket (its second word) moved past it
                return int((await words.read(8, 8)).view(np.int64)[0]) == first + 2 + i
            await until(drawn, f"waiter {i}'s ticket drawn")
        await replicated.kill(lost)
        t_kill = time.monotonic()

        # failover (about 1-2 s) within the lease: the holder renewed on the new primary (it logs
        # so), rather than a time after which it should have
        def kept() -> bool:
            return any("kept by this holder" in r.getMessage() for r in caplog.records)
        await until(kept, "the holder's renewal on the new primary")
        assert holder.locked(), "the holder lost its lock across the failover"
        assert not any(w.done() for w in waiters), "a waiter got the lock while its holder held it"
        now_on = await words.primary_server(0)
        assert now_on != replicated.addresses[lost]
        held_until = time.monotonic()
        await holder.release()
        await asyncio.wait_for(asyncio.gather(*waiters), 30)
        assert order == [0, 1, 2]
        assert all(s[0] >= held_until for s in sections)
        spans = sorted(sections)
        assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:])), spans
        tokens = [s[2] for s in spans]
        assert tokens == sorted(tokens) and tokens[0] > first and len(set(tokens)) == 3
        assert any("kept by this holder" in r.getMessage() and replicated.addresses[lost] in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        print(f"failover of the lock: the holder kept it; waiters served {time.monotonic() - t_kill:.2f} s "
              "after the kill")


@pytest.mark.slow
async def test_a_holder_whose_lease_ran_out_during_the_failover_is_told_it_lost_the_lock(
        replicated: smb2.LocalCluster) -> None:
    """A lease shorter than the failover: the waiter passes the silent holder over on the new
    primary, the old holder's release says what happened in plain words, and its token is refused
    by the new primary of a stripe whose old primary let it through (the token went to the backups
    with the write)."""
    async with await smb2.connect(replicated.addresses, transport="tcp") as a, \
            await smb2.connect(replicated.addresses, transport="tcp") as b:
        data = await a.create("guarded", 3 * 4096, stripe=4096, replicas=2)
        holder = a.replicated_lock("short", lease=0.5)
        await holder.acquire()
        old = holder.fence
        lost = await _primary_index(replicated, a, "short")
        # the stripe of `data` whose primary is the server about to be killed
        primaries = [await data.primary_server(i * 4096) for i in range(3)]
        at = primaries.index(replicated.addresses[lost]) * 4096
        await data.write(at, np.full(8, 1, np.uint8), fence=holder)
        await replicated.kill(lost)
        with pytest.raises(smb2.StaleFence):        # older than what the lost primary let through
            await data.write(at, np.full(8, 9, np.uint8), fence=smb2.Fence("short", old.token - 1))
        assert await data.primary_server(at) != replicated.addresses[lost]
        other = b.replicated_lock("short", lease=0.5)
        await asyncio.wait_for(other.acquire(), 20)
        assert other.token is not None and other.token > old.token
        await (await b.attach("guarded")).write(at, np.full(8, 2, np.uint8), fence=other)
        assert not holder.locked()
        with pytest.raises(smb2.LockLost) as err:
            await holder.release()
        msg = str(err.value)
        assert "'short'" in msg and "was lost" in msg and "lease of 0.5 s" in msg, msg
        assert replicated.addresses[lost] in msg or "passed it on" in msg, msg
        assert err.value.hint is not None and "acquire it again" in err.value.hint
        assert isinstance(err.value, smb2.StaleFence)       # code that catches StaleFence still does
        with pytest.raises(smb2.StaleFence):        # where the new holder wrote, the old token is refused
            await data.write(at, np.full(8, 3, np.uint8), fence=old)
        assert bytes(await data.read(at, 8)) == b"\x02" * 8
        # a holder that goes silent (its client closed without releasing) is passed over, even by
        # waiters whose timeouts are shorter than the lease: their given-up tickets keep watching
        taken = other.token
        assert taken is not None
        await b.close()
        late = a.replicated_lock("short", lease=0.5)

        async def tried() -> bool:
            try:
                await late.acquire(timeout=0.2)
            except smb2.LockTimeout:
                return False
            return True
        await until(tried, "the silent holder passed over", every=0)
        assert late.locked() and (late.token or 0) > taken
        await late.release()


async def test_a_timed_out_and_a_cancelled_waiter_give_their_tickets_up(replicated: smb2.LocalCluster) -> None:
    """The ticket engine's promise on the replicated lock: a waiter that times out or is
    cancelled after it drew its ticket leaves nothing for the queue to wait on.  The lease is
    600 s, so a ticket not given up would hold the next waiter for 10 minutes, far past the
    guard."""
    async with await smb2.connect(replicated.addresses, transport="tcp") as a, \
            await smb2.connect(replicated.addresses, transport="tcp") as b:
        holder, timed_out, cancelled, last = (c.replicated_lock("queue", lease=600) for c in (a, b, b, b))
        async with timed_out:           # its words open: a timeout now falls while it waits
            pass
        await holder.acquire()
        words = await a.attach("lock:queue")

        async def next_ticket() -> int:
            return int(np.frombuffer(bytes(await words.read(8, 8)), "<u8")[0])

        async def timed_out_after_drawing() -> bool:
            before = await next_ticket()
            with pytest.raises(smb2.LockTimeout, match="'queue' not acquired within 0.2 s"):
                await timed_out.acquire(timeout=0.2)
            return await next_ticket() > before
        await until(timed_out_after_drawing, "a timed-out waiter that drew its ticket", every=0)
        drawn = await next_ticket()
        task = asyncio.ensure_future(cancelled.acquire())

        async def drew(n: int) -> bool:
            return await next_ticket() == n
        await until(lambda: drew(drawn + 1), "the cancelled waiter drew its ticket")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        waiting = asyncio.ensure_future(last.acquire())
        await until(lambda: drew(drawn + 2), "the last waiter drew its ticket")
        await holder.release()
        await asyncio.wait_for(waiting, 60)
        assert last.locked() and last.token == drawn + 1
        assert not timed_out.locked() and not cancelled.locked()
        with pytest.raises(smb2.InterfaceError, match="reentrant"):
            await last.acquire()
        await last.release()
        async with timed_out:           # an object that gave up is usable again
            assert timed_out.token == drawn + 2


@pytest.mark.slow
async def test_the_locked_rule_of_a_replicated_store_loses_no_update_across_a_kill_of_its_lock_server(
        replicated: smb2.LocalCluster) -> None:
    """A store made with replicas=2 takes its locks replicated too: three workers pushing with the
    "locked" rule (read-modify-write under the store's lock) go on through a SIGKILL of the
    lock's server, and the weights end exactly at init - lr * (sum of every gradient)."""
    from smb2.train.store import ParameterStore

    lr = 0.5
    init = {"w": np.zeros(64, np.float32), "b": np.zeros(8, np.float32)}
    clients = [await smb2.connect(replicated.addresses, transport="tcp") for _ in range(3)]
    try:
        stores = [await ParameterStore.open(c, "st-r", init, rule="locked", lr=lr, workers=3, rank=r, replicas=2)
                  for r, c in enumerate(clients)]
        lost = await _primary_index(replicated, clients[0], "buffer:st-r")
        total = {k: np.zeros_like(v) for k, v in init.items()}

        async def work(r: int) -> None:
            for step in range(6):
                if r == 0 and step == 2:
                    await replicated.kill(lost)
                g = {k: np.full(v.shape, (r + 1) * 0.25 + step * 0.125, np.float32) for k, v in init.items()}
                await stores[r].push(g)
                for k in g:
                    total[k] += g[k]
        await asyncio.wait_for(asyncio.gather(*(work(r) for r in range(3))), 60)
        await stores[1].pull()
        for k, v in init.items():
            np.testing.assert_array_equal(stores[1].params[k], v - lr * total[k])
        assert await stores[2].read_version() == 18
    finally:
        for c in clients:
            await c.close()
