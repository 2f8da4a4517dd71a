"""The lock and notifications on shared memory (issue 15, items 1 and 2):
futex waits on the mapped words, wakes from every path that moves them,
one lock for shm, TCP-parked and polling clients, and a dead shm holder
passed on by the server that watched its connection."""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import signal
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import smb2
from smb2 import _core
from smb2.protocol import LOCK_SEGMENT
from smb2.testing.waits import until
from smb2.testing.workers import reap, spawn, start_holder
from smb2.transport import ShmTransport, TcpTransport


def _loop_name() -> str:
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"


# -- the futex primitives -------------------------------------------------------

def test_futex_wait_returns_at_once_when_the_word_differs_and_times_out_otherwise() -> None:
    mem = memoryview(mmap.mmap(-1, 4096))
    _core.atomic_store(mem, 8, (1 << 40) + 5)
    assert _core.futex_wait_u64(mem, 8, 5, 1.0) == _core.FUTEX_CHANGED      # high half differs
    t0 = time.monotonic()
    assert _core.futex_wait_u64(mem, 8, (1 << 40) + 5, 0.02) == _core.FUTEX_TIMED_OUT
    assert time.monotonic() - t0 > 0.015           # not before its timeout (load only adds)
    assert _core.futex_wake(mem, 8) == 0          # nobody sleeps there
    with pytest.raises(ValueError, match="aligned"):
        _core.futex_wake(mem, 12)


def test_a_wake_from_another_process_ends_a_shared_futex_sleep() -> None:
    # MAP_SHARED across a fork: a FUTEX_*_PRIVATE wait would never see it
    mem = memoryview(mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED))
    woke: list[int] = []
    sleeper = threading.Thread(target=lambda: woke.append(_core.futex_wait_u64(mem, 0, 0, 5.0)))
    sleeper.start()
    time.sleep(0.05)
    pid = os.fork()
    if pid == 0:        # the child: move the word and wake, nothing else
        _core.atomic_fetch_add(mem, 0, 1)
        os._exit(0 if _core.futex_wake(mem, 0) == 1 else 1)
    _, status = os.waitpid(pid, 0)
    sleeper.join(5.0)
    assert os.waitstatus_to_exitcode(status) == 0       # it woke exactly our sleeper
    assert woke == [_core.FUTEX_WOKEN]


def test_a_ticket_sleeper_wakes_for_its_own_ticket_only() -> None:
    mem = memoryview(mmap.mmap(-1, 4096))
    base = (1 << 33) - 2           # the low 32 bits wrap on the way
    _core.atomic_store(mem, 8, base)
    got: list[int] = []
    sleeper = threading.Thread(target=lambda: got.append(_core.futex_wait_ticket(mem, 8, base + 2, 5.0)))
    sleeper.start()
    time.sleep(0.05)
    _core.atomic_store(mem, 8, base + 1)
    # ticket base+1's wake: not ours (its bit differs), the sleeper stays asleep
    assert _core.futex_wake_ticket(mem, 8, base + 1) == 0
    time.sleep(0.05)
    assert sleeper.is_alive() and not got
    _core.atomic_store(mem, 8, base + 2)
    assert _core.futex_wake_ticket(mem, 8, base + 2) == 1
    sleeper.join(5.0)
    assert got == [_core.FUTEX_WOKEN]
    # reached already: at once; short of it: the timeout
    assert _core.futex_wait_ticket(mem, 8, base + 1, 5.0) == _core.FUTEX_WOKEN
    t0 = time.monotonic()
    assert _core.futex_wait_ticket(mem, 8, base + 3, 0.02) == _core.FUTEX_TIMED_OUT
    assert time.monotonic() - t0 > 0.015           # not before its timeout (load only adds)


def test_ticket_records_name_outstanding_tickets_only() -> None:
    base = (1 << 60) + 12345
    rec = _core.ticket_record(7, base + 3)
    assert _core.record_slot(rec) == 7 and _core.record_slot(0) == -1
    assert _core.recorded_ticket(rec, base + 10, base) == base + 3       # waiting
    assert _core.recorded_ticket(rec, base + 10, base + 3) == base + 3   # holding
    assert _core.recorded_ticket(rec, base + 10, base + 4) is None       # passed
    assert _core.recorded_ticket(rec, base + 3, base) is None            # never issued
    with pytest.raises(ValueError):
        _core.ticket_record(1 << 20, 0)


def _slot_words() -> tuple[memoryview, _core.LiveFlag, _core.MappedLock]:
    mem = memoryview(mmap.mmap(-1, 4096))
    alive = _core.LiveFlag()
    return mem, alive, _core.MappedLock(mem, 2 * _core.LOCK_SLOT_SIZE, alive)


def test_a_mapped_lock_draws_records_and_releases_on_the_words() -> None:
    mem, alive, ml = _slot_words()
    off = 2 * _core.LOCK_SLOT_SIZE
    ml.use_record(1024, 0)
    st = _core.TicketState(10.0)
    assert ml.take(st, 0.0) == _core.OBSERVE_GRANTED and st.ticket == 0
    # the record word names (slot 2, ticket 0) for the server to pass on
    assert _core.record_slot(_core.atomic_load(mem, 1024)) == 2
    assert _core.recorded_ticket(_core.atomic_load(mem, 1024), 1, 0) == 0
    second = _core.TicketState(10.0)
    assert ml.take(second, 0.0) == _core.OBSERVE_WAIT and second.ticket == 1
    assert ml.release(0) == _core.RELEASE_DONE
    assert _core.atomic_load(mem, off + _core.LOCK_SERVING) == 1
    # not ours any more: nothing changes
    assert ml.release(0) == _core.RELEASE_LOST
    assert _core.atomic_load(mem, off + _core.LOCK_SERVING) == 1
    # TCP acquires parked at the server: it must release, so that it grants them
    _core.atomic_store(mem, off + _core.LOCK_PARKED, 1)
    assert ml.release(1) == _core.RELEASE_BY_SERVER
    assert _core.atomic_load(mem, off + _core.LOCK_SERVING) == 1
    # the server's connection gone: every call says so, nothing is touched
    alive.live = False
    for call in (lambda: ml.release(1), ml.serving, lambda: ml.take(_core.TicketState(1.0), 0.0)):
        with pytest.raises(ConnectionError):
            call()
    assert _core.atomic_load(mem, off + _core.LOCK_NEXT) == 2


def _sleeps(mem: memoryview, offset: int, ticket: int) -> bool:
    """True if a ticket sleeper for ``ticket`` waits on the word (a wake of
    that ticket finds it; it then sleeps again, short of its turn)."""
    return _core.futex_wake_ticket(mem, offset, ticket) > 0


def test_the_next_in_line_spins_and_asks_to_be_woken_one_ticket_early() -> None:
    mem, _, ml = _slot_words()
    at = 2 * _core.LOCK_SLOT_SIZE + _core.LOCK_SERVING
    for _ in range(3):
        ml.draw()                       # tickets 0 (the holder), 1 and 2
    got: list[int] = []

    def wait(ticket: int) -> None:
        got.append(ml.wait(ticket, 5.0))

    # spin 0: ticket 2 sleeps on its own bit; ticket 1's wake does not reach it
    ml.spin = 0.0
    sleeper = threading.Thread(target=wait, args=(2,))
    sleeper.start()
    time.sleep(0.05)
    assert not _sleeps(mem, at, 1) and _sleeps(mem, at, 2)
    _core.atomic_store(mem, at, 2)
    _core.futex_wake_ticket(mem, at, 2)
    sleeper.join(5.0)
    assert got == [2]
    # spinning: ticket 4 (two away) sleeps on its bit and ticket 3's, so the
    # release that serves 3 wakes it; next in line, it spins, not sleeping
    ml.draw(), ml.draw()                # tickets 3 and 4
    ml.spin = 0.3
    sleeper = threading.Thread(target=wait, args=(4,))
    sleeper.start()
    time.sleep(0.05)
    assert _sleeps(mem, at, 3)          # woken one early... but 3 is not served: asleep again
    time.sleep(0.05)
    _core.atomic_store(mem, at, 3)
    assert _sleeps(mem, at, 3)          # served: it wakes, and spins
    time.sleep(0.05)
    assert not _sleeps(mem, at, 4) and sleeper.is_alive()
    time.sleep(0.4)                     # past its spin: asleep on its own bit only
    assert _sleeps(mem, at, 4) and not _sleeps(mem, at, 3)
    _core.atomic_store(mem, at, 4)
    _core.futex_wake_ticket(mem, at, 4)
    sleeper.join(5.0)
    assert got == [2, 4]


# -- in one process: who sleeps, who wakes ---------------------------------------

async def _has_sleeper(view: memoryview, offset: int) -> bool:
    """True if a futex sleeper waits on the word at ``offset`` of ``view``
    (a wake finds one; it looks at the word and sleeps again).  A sleeper
    is awake for a moment every MAX_SLEEP, longer on a loaded machine: a
    few tries."""
    for _ in range(20):
        if _core.futex_wake(view, offset):
            return True
        await asyncio.sleep(0.005)
    return False


async def test_a_shm_waiter_sleeps_on_the_futex_and_every_release_path_wakes_it() -> None:
    async with smb2.LocalCluster(servers=1, capacity="16MiB") as cluster:
        server = cluster.servers[0]
        shm, tcp = await cluster.connect(transport="shm"), await cluster.connect(transport="tcp")
        holder_tcp, waiter = tcp.lock("w"), shm.lock("w")
        await holder_tcp.acquire()
        task = asyncio.ensure_future(waiter.acquire())
        slot = server.locks.by_name["w"]
        serving = slot * _core.LOCK_SLOT_SIZE + _core.LOCK_SERVING
        # it sleeps in the kernel (a thread), not polling: a wake finds it
        await asyncio.sleep(0.1)
        assert not task.done()
        assert await _has_sleeper(server.segments[LOCK_SEGMENT].view, serving)
        ops_before = sum(sum(c.values()) for c in server.stat()["ops"].values())
        await asyncio.sleep(0.2)
        # and it costs the server nothing while it sleeps
        assert sum(sum(c.values()) for c in server.stat()["ops"].values()) == ops_before
        # a release over TCP (the server moves now_serving) wakes it
        await holder_tcp.release(wait=True)
        await asyncio.wait_for(task, 2)
        assert waiter.path == "futex" and holder_tcp.path == "park"
        # a parked TCP waiter behind a shm holder is granted when the shm
        # holder releases (through the server, which it sees parked waiters at)
        parked = asyncio.ensure_future(holder_tcp.acquire())
        await until(lambda: server.locks.table.parked_count(slot) == 1, "the TCP waiter parked")
        released = server.stat()["ops"].get("shm", {}).get("lock_release", 0)
        await waiter.release()
        await asyncio.wait_for(parked, 2)
        # the shm holder saw the parked waiter (LOCK_PARKED) and released
        # through the server, which granted it at once (not at its next sweep)
        assert server.stat()["ops"]["shm"]["lock_release"] == released + 1
        await holder_tcp.release(wait=True)
        # with none parked, a shm release is its own atomic: the server sees no frame
        async with waiter:
            pass
        assert server.stat()["ops"]["shm"]["lock_release"] == released + 1


async def _longest_stall(done: asyncio.Future[Any]) -> float:
    """The longest the loop went without running this coroutine (it asks
    every millisecond) until ``done`` is done."""
    longest, last = 0.0, time.monotonic()
    while not done.done():
        await asyncio.sleep(0.001)
        now = time.monotonic()
        longest, last = max(longest, now - last), now
    return longest



def _hold_on_another_loop(address: str, name: str, held: threading.Event,
                          release: threading.Event) -> threading.Thread:
    """A holder of lock ``name`` in a thread with a loop of its own (a
    process of its own, as far as the lock knows): holds until ``release``
    is set (60 s at most: a hang guard)."""
    async def run() -> None:
        client = await smb2.connect([address], transport="shm")
        lock = client.lock(name)
        await lock.acquire()
        held.set()
        await asyncio.to_thread(release.wait, 60)
        await lock.release()
        await client.close()
    thread = threading.Thread(target=asyncio.run, args=(run(),))
    thread.start()
    return thread


def _when_queued(words: Callable[[], tuple[int, int, int]], n: int, then: threading.Event) -> threading.Thread:
    """A thread that sets ``then`` once ``n`` tickets are out on the lock
    whose words ``words`` reads (it reads shared memory: no loop needed)."""
    def run() -> None:
        deadline = time.monotonic() + 60        # a hang guard
        while time.monotonic() < deadline and not then.is_set():
            nxt, serving, _ = words()
            if nxt - serving >= n:
                break
            time.sleep(0.001)
        then.set()
    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("block", [0.1, 0.0])
async def test_a_lone_futex_waiter_sleeps_on_its_loops_thread_within_its_budget(block: float) -> None:
    # the hand-off's fastest path: the releaser's wake lands in the loop's
    # own thread, which runs nothing else meanwhile (for at most `block` s);
    # with no budget the waiter sleeps in a helper thread and the loop runs
    # on.  Told apart by order, not time: a callback that runs again and
    # again until the waiter's ticket is out finds it granted (the loop slept
    # from the draw to the grant) or still waiting (it did not)
    async with smb2.LocalCluster(servers=1, capacity="16MiB") as cluster:
        server = cluster.servers[0]
        client = await cluster.connect(transport="shm")
        waiter = client.lock("b", futex_block=block)
        await waiter.acquire()          # maps the words: the next acquire is the fast path
        await waiter.release()
        slot = server.locks.by_name["b"]
        held, release = threading.Event(), threading.Event()
        holder = _hold_on_another_loop(cluster.addresses[0], "b", held, release)
        assert await asyncio.to_thread(held.wait, 60)
        # sleeping on the loop's thread, nothing on the loop can release: a
        # thread does once the waiter's ticket is out
        watcher = _when_queued(lambda: server.locks.table.words(slot), 2, release) if block else None
        seen: list[tuple[bool, float]] = []
        loop, last = asyncio.get_running_loop(), time.monotonic()

        def look() -> None:
            nonlocal last
            now = time.monotonic()
            if not waiter.locked() and server.locks.stat()["locks"]["b"]["queued"] < 2:
                last = now
                loop.call_soon(look)        # the ticket is not out yet
                return
            # how long the loop ran nothing else, up to this look
            seen.append((waiter.locked(), now - last))
            release.set()
        acquired = asyncio.ensure_future(waiter.acquire())
        loop.call_soon(look)
        await asyncio.wait_for(acquired, 120)       # hang guard
        await waiter.release()
        await asyncio.to_thread(holder.join, 60)
        if watcher is not None:
            await asyncio.to_thread(watcher.join, 60)
        assert waiter.path == "futex"
        ((granted, after),) = seen
        if block:
            # asleep on the loop's thread until the release; or, where the
            # release came later than the budget (a loaded machine), for the
            # whole budget (a lower bound: load only adds)
            assert granted or after >= 0.9 * block, seen
        else:
            assert not granted, seen        # asleep in a helper thread, the loop free


# alone: it measures the loop's stall, a latency: a waiter blocking the loop
# would stall it for its budget, capped at 0.1 s (Lock's futex_block), so only
# time tells "not blocked" from "blocked for the budget"; the scheduler of a
# loaded machine adds stalls of that size
@pytest.mark.alone
async def test_a_futex_waiter_leaves_the_loop_free_while_a_lock_on_it_is_held() -> None:
    # a holder on the same loop must run to release: a waiter blocking the
    # loop would stall it for its whole budget (0.1 s here)
    async with smb2.LocalCluster(servers=1, capacity="16MiB") as cluster:
        client = await cluster.connect(transport="shm")
        holder, waiter = client.lock("same"), client.lock("same", futex_block=0.1)
        await waiter.acquire()
        await waiter.release()
        await holder.acquire()

        async def release_soon() -> None:
            await asyncio.sleep(0.03)
            await holder.release()
        releasing = asyncio.ensure_future(release_soon())
        t0 = time.monotonic()
        acquired = asyncio.ensure_future(waiter.acquire())
        stall = await _longest_stall(acquired)
        await acquired
        await releasing
        assert time.monotonic() - t0 < 0.09 and stall < 0.02
        await waiter.release()


async def test_a_cancelled_shm_waiter_gives_its_ticket_up() -> None:
    async with smb2.LocalCluster(servers=1, capacity="16MiB") as cluster:
        a, b = await cluster.connect(transport="shm"), await cluster.connect(transport="shm")
        holder, quitter, after = a.lock("q"), b.lock("q"), b.lock("q")
        await holder.acquire()
        with pytest.raises(smb2.LockTimeout):
            await quitter.acquire(timeout=0.1)
        nxt = asyncio.ensure_future(after.acquire())
        server = cluster.servers[0]
        # holder, the quitter's given-up ticket and `after`'s: all drawn
        await until(lambda: server.locks.stat()["locks"]["q"]["queued"] == 3, "after's ticket drawn")
        skipped, expired = server.locks.table.abandoned_skips, server.locks.table.expired
        await holder.release()
        await asyncio.wait_for(nxt, 60)           # hang guard
        # the quitter's ticket was skipped as given up, not waited out as a dead holder's lease
        assert server.locks.table.abandoned_skips == skipped + 1
        assert server.locks.table.expired == expired
        await after.release()


async def test_wait_notify_over_shm_sleeps_on_the_futex_and_writers_wake_it() -> None:
    async with smb2.LocalCluster(servers=1, capacity="16MiB") as cluster:
        server = cluster.servers[0]
        waiter_c = await cluster.connect(transport="shm")
        shm_w, tcp_w = await cluster.connect(transport="shm"), await cluster.connect(transport="tcp")
        buf = (await waiter_c.create("n", 4096)).set_notify_area(0, 8)
        tr, seg_id, _ = buf.word_transport(0)
        assert isinstance(tr, ShmTransport)
        view = server.segments[seg_id].view
        for writer, how in ((shm_w, "notify"), (tcp_w, "notify_add"), (shm_w, "notify_add"),
                            (tcp_w, "write")):
            wb = (await writer.attach("n")).set_notify_area(0, 8)
            target = await buf.read_notify(3) + 1
            task = asyncio.ensure_future(buf.wait_notify(3, target, timeout=5))
            await asyncio.sleep(0.1)
            assert not task.done()
            # a sleeper in the kernel on the slot's word (3 * 8)
            assert await _has_sleeper(view, 24), how
            if how == "notify":
                await wb.notify(3, target)
            elif how == "notify_add":
                await wb.notify_add(3)
            else:
                await wb.write(64, b"data", notify=(3, target))
            assert await asyncio.wait_for(task, 2) == target
        with pytest.raises(smb2.NotifyTimeout):
            await buf.wait_notify(5, 1, timeout=0.1)


# -- processes: one lock, every fabric; a SIGKILLed holder ---------------------------

@pytest.mark.slow
async def test_shm_futex_tcp_parked_and_polling_processes_count_exactly_in_ticket_order() -> None:
    m = 40
    kinds = [("shm", "auto"), ("shm", "auto"), ("tcp", "park"), ("tcp", "poll"), ("shm", "poll")]
    async with smb2.LocalCluster(servers=2, processes=True, capacity="16MiB") as cluster:
        client = await cluster.connect()
        await client.create("counter", 128, stripe=64)
        cfg = {"servers": cluster.addresses, "buffer": "counter", "lock": "counter", "m": m,
               "action": "count", "loop": _loop_name()}
        procs = [await spawn({**cfg, "transport": t, "mode": mode}) for t, mode in kinds]
        outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 120)
        assert all(p.returncode == 0 for p in procs)
        seen = [tuple(x) for out, _ in outs for x in json.loads(out)["seen"]]
        buf = await client.attach("counter")
        (total,) = struct.unpack("<q", (await buf.read(0, 8)).tobytes())
        n = len(kinds) * m
        assert total == n
        # mutual exclusion: every increment saw a distinct value; FIFO: the
        # values were handed out in ticket order
        seen.sort()
        assert [v for v, _ in seen] == list(range(n))
        tokens = [t for _, t in seen]
        assert tokens == sorted(tokens) and len(set(tokens)) == n


async def test_a_shm_release_through_the_server_leaves_before_the_loop_runs_again() -> None:
    # a shm holder with TCP acquires parked behind it releases through the
    # server; its next acquire may sleep on the loop's own thread, so the
    # release must not wait in the connection's cork for the loop to run
    # (it did: 1 ms per hand-off, 0.17x the TCP lock with mixed clients)
    async with smb2.LocalCluster(servers=1, processes=True, capacity="16MiB") as cluster:
        shm = await cluster.connect(transport="shm")
        await shm.create("m", 64)
        holder = shm.lock("m")
        await holder.acquire()
        tr, slot = await shm.links[0].lock_slot("m")
        mapping = tr.mapping_of(slot.segment) if isinstance(tr, ShmTransport) else None
        assert mapping is not None
        parked_at = slot.offset + _core.LOCK_PARKED
        proc = await spawn({"servers": cluster.addresses, "buffer": "m", "lock": "m", "action": "hold",
                            "transport": "tcp", "mode": "park", "loop": _loop_name()})
        try:
            await until(lambda: _core.atomic_load(mapping[0], parked_at) == 1, "LOCK_PARKED set")
            await holder.release()
            # the loop held (as a futex sleep on its thread holds it) until the
            # server had the release and granted the parked acquire: a release
            # left in the cork would never leave (60 s: a hang guard)
            deadline = time.monotonic() + 60
            while _core.atomic_load(mapping[0], parked_at) != 0 and time.monotonic() < deadline:
                time.sleep(0.001)  # noqa: ASYNC251 (holding the loop is the point)
            assert _core.atomic_load(mapping[0], parked_at) == 0
            assert proc.stdout is not None
            assert (await asyncio.wait_for(proc.stdout.readline(), 10)).startswith(b"HELD ")
        finally:
            await reap(proc)


async def _expired(client: smb2.Client) -> int:
    """Holders the servers moved past when their lease ran out, so far."""
    return sum(int(st["locks"]["expired"]) for st in await client.stat())


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("waiter", ["shm", "tcp"])
async def test_a_dead_shm_holder_is_passed_on(waiter: str, sig: int) -> None:
    # SIGKILL: the server sees the connection die and passes the recorded
    # ticket on at once.  SIGSTOP: the connection lives, the renewals stop,
    # and the lease's expiry passes it on (and wakes the futex sleepers).
    lease = 2.0
    async with smb2.LocalCluster(servers=1, processes=True, capacity="16MiB",
                                 server_args=["--lock-lease", str(lease)]) as cluster:
        client = await cluster.connect(transport=waiter)
        buf = await client.create("dead", 128)
        cfg = {"servers": cluster.addresses, "buffer": "dead", "lock": "dead",
               "loop": _loop_name(), "transport": "shm"}
        proc, dead_token = await start_holder(cfg)
        try:
            lock = client.lock("dead")
            task = asyncio.ensure_future(lock.acquire())
            await asyncio.sleep(0.3)
            assert not task.done()
            expired = await _expired(client)
            os.kill(proc.pid, sig)
            await asyncio.wait_for(task, 30 * lease)       # hang guard
            if sig == signal.SIGKILL:
                # its ticket record named the dead process's ticket: passed on
                # when its connection closed, no lease waited out
                assert await _expired(client) == expired
            else:
                # stopped, it keeps its connection: passed on by the lease (no lower
                # bound on the time: a loaded holder's last renewal may have come late)
                assert await _expired(client) == expired + 1
            assert lock.token is not None and lock.token > dead_token
            with pytest.raises(smb2.StaleFence):
                await buf.write(0, b"dead holder", fence=smb2.Fence("dead", dead_token))
            await lock.release()
        finally:
            await reap(proc)


async def test_ticket_records_are_for_shm_clients_and_bounded_server_wide() -> None:
    """Record slots come from the lock table: a TCP connection gets none, one
    connection at most MAX_RECORD_SLOTS, all together a quarter of the
    slots, so borrowing records never leaves a lock without a slot."""
    server = await smb2.start_server("127.0.0.1", 0, lock_slots=16)
    opened: list[TcpTransport] = []
    try:
        tcp = await TcpTransport.connect(server.address)
        opened.append(tcp)
        with pytest.raises(smb2.BadRequest, match="shm clients"):
            await tcp.control({"cmd": "lock_records"})
        shms = []
        for _ in range(2):
            control = await TcpTransport.connect(server.address)
            opened.append(control)
            shms.append(await ShmTransport.upgrade(control))
        for _ in range(16 // 4):
            got = await shms[0].control({"cmd": "lock_records"})
            assert got["segment"] == LOCK_SEGMENT
        for shm in shms:
            with pytest.raises(smb2.OutOfMemory, match="at most 4"):
                await shm.control({"cmd": "lock_records"})
        # the other 12 slots still serve locks, and a closed borrower gives its 4 back
        client = await smb2.connect([server.address], transport="tcp")
        locks = [client.lock(f"l{i}") for i in range(12)]
        for lock in locks:
            await lock.acquire()
            await lock.release()
        await shms[0].close()
        for _ in range(100):
            try:
                await shms[1].control({"cmd": "lock_records"})
                break
            except smb2.OutOfMemory:
                await asyncio.sleep(0.02)
        else:
            raise AssertionError("the closed connection's record slots never came back")
        await client.close()
    finally:
        for t in opened:
            await t.close()
        await server.close()
