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

import pytest

import smb2
from lock_worker import reap, spawn, start_holder
from smb2 import _core
from smb2.protocol import LOCK_SEGMENT
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
    assert 0.015 < time.monotonic() - t0 < 1.0
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
    assert 0.015 < time.monotonic() - t0 < 1.0


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


async def _wait_until(cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


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
        await _wait_until(lambda: server.locks.table.parked_count(slot) == 1)
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


async def test_a_cancelled_shm_waiter_gives_its_ticket_up() -> None:
    async with smb2.LocalCluster(servers=1, capacity="16MiB") as cluster:
        a, b = await cluster.connect(transport="shm"), await cluster.connect(transport="shm")
        holder, quitter, after = a.lock("q"), b.lock("q"), b.lock("q")
        await holder.acquire()
        with pytest.raises(smb2.LockTimeout):
            await quitter.acquire(timeout=0.1)
        nxt = asyncio.ensure_future(after.acquire())
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        await holder.release()
        await asyncio.wait_for(nxt, 2)           # the quitter's ticket was skipped
        assert time.monotonic() - t0 < 0.5
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
            os.kill(proc.pid, sig)
            t0 = time.monotonic()
            await asyncio.wait_for(task, lease + 1.0)
            took = time.monotonic() - t0
            if sig == signal.SIGKILL:
                assert took < 1.0           # well inside the lease
            else:
                assert lease - 2 * lease / 3 <= took <= lease + 1.0
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
