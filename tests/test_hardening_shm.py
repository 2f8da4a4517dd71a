"""What a same-host client can do to a memory server through shared memory
(planned restarts, sealed memory, lock words, lock slots), tried on real ``smb2-server`` processes:
a planned restart while shm clients write, ``ftruncate`` on a handed-out
memory file, lock words written by hand (over shm and over TCP), and many
lock names over one shm connection.  After each, well-behaved clients are
served.  docs/reliability.md states the bounds these check."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import smb2
from smb2 import _core
from smb2.errors import TransportError
from smb2.protocol import LOCK_SEGMENT
from smb2.testing.etcd import etcd_binary
from smb2.testing.hostile import (
    REGION,
    WARM_UP,
    acquire_within,
    claim_fds,
    lock_offset,
    lock_words,
    shm_of,
    start_writers,
    well_behaved,
)
from smb2.testing.launch import server_process
from smb2.testing.waits import until

MiB = 1 << 20


# -- 1. a planned restart under shm writers ------------------------------------


@pytest.mark.server_process_only
async def test_a_sigterm_under_shm_writers_saves_every_acknowledged_write(tmp_path: Path) -> None:
    # before: the restart refused to start (checksum mismatch) 3 times of 3
    writers = 3
    flags = ("--data-dir", str(tmp_path), "--capacity", "256MiB")
    with server_process(*flags) as s:
        async with await smb2.connect([s.address], transport="tcp") as c:
            await c.create("shared", writers * REGION)
        acked = [0] * writers
        stop = threading.Event()
        threads = await asyncio.to_thread(start_writers, s.address, "shared", writers, acked, stop)
        assert min(acked) >= WARM_UP, acked
        assert s.stop() == 0, s.stderr()     # SIGTERM: save, then exit
        stop.set()
        for t in threads:
            t.join(10)
    # it starts, and every acknowledged write is there
    with server_process(*flags) as s:
        async with await smb2.connect([s.address], transport="tcp") as c:
            buf = await c.attach("shared")
            for r in range(writers):
                got = (await buf.read(r * REGION, REGION)).view(np.int64)
                # the write in flight at the stop may have landed in part
                assert got.min() >= acked[r] and got.max() <= acked[r] + 1, (r, acked)
        await well_behaved(s.address)


async def test_a_frozen_segment_refuses_shm_writes_and_atomics_and_a_failed_save_thaws_it(
        tmp_path: Path) -> None:
    server = await smb2.start_server("127.0.0.1", 0, data_dir=tmp_path / "data")
    try:
        async with await smb2.connect([server.address], transport="shm") as c:
            buf = await c.create("f", MiB)
            await buf.write(0, np.ones(4, np.int64))       # mapped: the fast path serves it now
            assert await buf.fetch_add(0, 1) == 1
            # a save that fails (a file where the directory should be written)
            (tmp_path / "data" / "seg-1.1.bin.tmp").mkdir()
            with pytest.raises(smb2.PersistenceError):
                server.save()
            assert await buf.fetch_add(0, 1) == 2          # thawed: served again
            (tmp_path / "data" / "seg-1.1.bin.tmp").rmdir()
            server.save()                                 # frozen for good, as at a stop
            for op in (buf.write(0, np.zeros(4, np.int64)), buf.fetch_add(0, 1),
                       buf.compare_swap(0, 3, 4)):
                with pytest.raises(TransportError, match="stopping"):
                    await op
    finally:
        await server.close(save=False)
    # what was saved is what was acknowledged before the freeze
    again = await smb2.start_server("127.0.0.1", 0, data_dir=tmp_path / "data")
    try:
        async with await smb2.connect([again.address], transport="tcp") as c:
            assert (await (await c.attach("f")).read(0, 8)).view(np.int64)[0] == 3
    finally:
        await again.close(save=False)


# -- 2. sealed memory -------------------------------------------------------------


@pytest.mark.server_process_only
async def test_a_client_cannot_resize_handed_out_memory() -> None:
    with server_process() as s:
        async with await smb2.connect([s.address], transport="shm") as c:
            buf = await c.create("sealed", 4 * MiB)
            await buf.write(0, np.arange(MiB // 8, dtype=np.int64))
            lock = c.lock("sealed")
            await lock.acquire()
            await lock.release()
            grant = await shm_of(c).control({"cmd": "shm_grant", "segments": [LOCK_SEGMENT, buf.segments[0]]})
            fds = claim_fds(grant["path"], grant["ticket"])
            try:
                for fd in fds:
                    size = os.fstat(fd).st_size
                    for new in (0, size // 2, size + (256 << 20)):
                        with pytest.raises(PermissionError) as e:
                            os.ftruncate(fd, new)
                        assert e.value.errno == errno.EPERM
                    assert os.fstat(fd).st_size == size
            finally:
                for fd in fds:
                    os.close(fd)
            # the lock sweep and a TCP read of both segments go on
            await asyncio.sleep(0.2)
            async with await smb2.connect([s.address], transport="tcp") as t:
                tbuf = await t.attach("sealed")
                assert ((await tbuf.read(0, MiB)).view(np.int64) == np.arange(MiB // 8)).all()
                async with t.lock("sealed"):
                    pass
        assert s.proc.poll() is None, s.stderr()
        await well_behaved(s.address)


# what a hostile same-host client does with a read-only mapping: make it
# writable (mprotect), then store through it anyway
_STORE_THROUGH_A_READ_ONLY_MAPPING = r"""
import ctypes, mmap, sys
import numpy as np
fd, size = int(sys.argv[1]), int(sys.argv[2])
mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
addr = np.frombuffer(mm, np.uint8).ctypes.data
libc = ctypes.CDLL(None, use_errno=True)
if libc.mprotect(ctypes.c_void_p(addr), ctypes.c_size_t(mmap.PAGESIZE), 3) != 0:
    print("mprotect refused", ctypes.get_errno(), flush=True)
ctypes.memset(addr, 0x41, 8)
print("stored", flush=True)
"""


@pytest.mark.server_process_only
async def test_a_same_host_client_cannot_write_one_copy_of_a_replicated_buffer() -> None:
    """A replicated buffer's copies change only through its primary: a shm
    client that claims the segment's memfd itself can map it only read-only
    (mmap with PROT_WRITE, write(), a reopen through /proc and mprotect are
    refused; a store through the mapping dies of SIGSEGV), and every copy
    stays as written.  An unreplicated buffer's memfd still maps writable."""
    try:
        etcd_binary()
    except Exception:
        pytest.skip("needs etcd (tools/host_deps.sh installs etcd-server)")
    async with smb2.LocalCluster(servers=2, processes=True, replicated=True, capacity="64MiB") as cluster:
        async with await smb2.connect(cluster.addresses, transport="shm") as c:
            buf = await c.create("two", 2 * MiB, stripe=MiB, replicas=2)
            plain = await c.create("one", MiB)
            await buf.write(0, np.ones(buf.nbytes, np.uint8))
            # one-sided reads from the client's (read-only) mapping of each primary
            assert (await buf.read(0, buf.nbytes) == 1).all()
            grant = await shm_of(c).control({"cmd": "shm_grant", "segments": [buf.segments[0], plain.segments[0]]})
            rep, unrep = claim_fds(grant["path"], grant["ticket"])
            try:
                mmap.mmap(unrep, os.fstat(unrep).st_size, flags=mmap.MAP_SHARED).close()
                size = os.fstat(rep).st_size
                with pytest.raises(PermissionError):
                    mmap.mmap(rep, size, flags=mmap.MAP_SHARED)
                with pytest.raises(PermissionError):
                    os.pwrite(rep, b"x", 0)
                reopened = os.open(f"/proc/self/fd/{rep}", os.O_RDWR)
                try:
                    with pytest.raises(PermissionError):
                        mmap.mmap(reopened, size, flags=mmap.MAP_SHARED)
                    with pytest.raises(PermissionError):
                        os.pwrite(reopened, b"x", 0)
                finally:
                    os.close(reopened)
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", _STORE_THROUGH_A_READ_ONLY_MAPPING, str(rep), str(size),
                    pass_fds=(rep,), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                out, err = (b.decode() for b in await asyncio.wait_for(proc.communicate(), 60))
                assert proc.returncode == -signal.SIGSEGV, (proc.returncode, out, err)
                assert f"mprotect refused {errno.EACCES}" in out and "stored" not in out
                mm = mmap.mmap(rep, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                assert bytes(mm[:MiB]) == b"\x01" * MiB      # this server's copy is as written
                mm.close()
            finally:
                os.close(rep)
                os.close(unrep)
            assert (await buf.read(0, buf.nbytes) == 1).all()
            await plain.write(0, b"p" * 8)           # the unreplicated fast path writes its mapping
            assert bytes(await plain.read(0, 8)) == b"p" * 8


# -- 3. lock words a client cannot wedge --------------------------------------------


@pytest.mark.server_process_only
async def test_now_serving_moved_past_next_ticket_over_shm_wedges_nobody() -> None:
    with server_process() as s:
        async with await smb2.connect([s.address], transport="shm") as attacker, \
                await smb2.connect([s.address], transport="shm") as shm_user, \
                await smb2.connect([s.address], transport="tcp") as tcp_user:
            off = await lock_offset(attacker, "L")
            tr = shm_of(attacker)
            nxt = await tr.fetch_add(LOCK_SEGMENT, off, 0)
            # one compare-and-swap on our own mapping: now_serving far past next_ticket
            await tr.compare_swap(LOCK_SEGMENT, off + _core.LOCK_SERVING, nxt, nxt + (1 << 30))
            took = await asyncio.gather(acquire_within(shm_user.lock("L"), 2.0),
                                        acquire_within(tcp_user.lock("L"), 2.0))
            assert max(took) < 3.0, took
            # the server put the lock right: both acquire again at once
            for c in (shm_user, tcp_user):
                async with c.lock("L"):
                    pass
            nxt, serving = await lock_words(tcp_user, "L")
            assert 0 <= nxt - serving <= 1
            assert (await tcp_user.stat())[0]["locks"]["resets"] >= 1
    assert "impossible words" in s.stderr()


@pytest.mark.server_process_only
async def test_a_huge_next_ticket_over_tcp_is_reset_and_the_sender_named() -> None:
    with server_process() as s:
        async with await smb2.connect([s.address], transport="tcp") as attacker, \
                await smb2.connect([s.address], transport="shm") as user:
            held = user.lock("L")
            await held.acquire()
            token = held.token
            off = await lock_offset(attacker, "L")
            await attacker.links[0].open.fetch_add(LOCK_SEGMENT, off, 1 << 40)  # type: ignore[union-attr]
            # the holder lost the lock to the reset, and the next acquire is served
            with pytest.raises(smb2.StaleFence):
                await held.release(wait=True)
            other = user.lock("L")
            await other.acquire(timeout=2.0)
            assert other.token is not None and token is not None and other.token > token
            await other.release()
            nxt, serving = await lock_words(user, "L")
            assert 0 <= nxt - serving <= 1
    err = s.stderr()
    assert "impossible words" in err and "(tcp) changed them" in err, err


@pytest.mark.server_process_only
@pytest.mark.parametrize("moved_by", [1 << 40, 100_000])
async def test_next_ticket_moved_and_put_back_strands_no_shm_waiter(moved_by: int) -> None:
    """A client adds to next_ticket over shm and subtracts it again, and a
    shm waiter drew its ticket in between: that ticket is of a numbering no
    one serves.  The shm waiter draws again and is served like the TCP
    waiter (before, it slept until its timeout).  2^40 is reset by the
    server if its sweep sees it; 100,000 is within what the connected
    clients could queue, so only the waiter can tell."""
    with server_process("--lock-lease", "1") as s:
        async with await smb2.connect([s.address], transport="shm") as attacker, \
                await smb2.connect([s.address], transport="shm") as shm_user, \
                await smb2.connect([s.address], transport="tcp") as tcp_user:
            off = await lock_offset(attacker, "L")
            tr = shm_of(attacker)
            shm_lock, tcp_lock = shm_user.lock("L"), tcp_user.lock("L")
            for lock in (shm_lock, tcp_lock):       # both know the lock: the shm one has its mapping
                await lock.acquire(timeout=30)
                await lock.release()
            before = await tr.fetch_add(LOCK_SEGMENT, off, moved_by)
            # LockTimeout would fail the test: 60 s is far more than the 1 s
            # lease the TCP waiter waits for the one ticket nobody holds
            shm_waiter = asyncio.ensure_future(shm_lock.acquire(timeout=60))
            for _ in range(1_000_000):         # until the shm waiter drew
                if await tr.fetch_add(LOCK_SEGMENT, off, 0) != before + moved_by:
                    break
                await asyncio.sleep(0)
            await tr.fetch_add(LOCK_SEGMENT, off, (1 << 64) - moved_by)
            await tcp_lock.acquire(timeout=60)
            await tcp_lock.release()
            await shm_waiter
            assert shm_lock.path == "futex"
            await shm_lock.release()
            # both are served again at once
            for lock in (shm_lock, tcp_lock):
                await lock.acquire(timeout=30)
                await lock.release()


@pytest.mark.server_process_only
async def test_a_parked_waiter_passed_by_hand_queues_again_instead_of_failing() -> None:
    with server_process() as s:
        async with await smb2.connect([s.address], transport="tcp") as holder, \
                await smb2.connect([s.address], transport="tcp") as waiter:
            lock = holder.lock("L")
            await lock.acquire()
            pending = asyncio.ensure_future(waiter.lock("L").acquire(timeout=60))    # hang guard

            async def waiter_queued() -> bool:
                return bool((await holder.stat())[0]["locks"]["locks"]["L"]["queued"] == 2)
            await until(waiter_queued, "the waiter's ticket drawn")
            off = await lock_offset(holder, "L")
            tr = holder.links[0].open
            assert tr is not None
            serving = lock.token
            assert serving is not None
            # skip the holder and the waiter's ticket: within bounds, but by hand
            await tr.compare_swap(LOCK_SEGMENT, off + _core.LOCK_SERVING, serving, serving + 2)
            await pending           # granted (queued again), not StaleFence
            assert (await waiter.stat())[0]["locks"]["requeued"] >= 1


# -- 6. lock slots over shm are reclaimed --------------------------------------------

async def test_a_shm_client_uses_more_lock_names_than_the_server_has_slots() -> None:
    # a fresh lock name per task, each Lock dropped once its task is done
    async def task(c: smb2.Client, i: int) -> None:
        lock = c.lock(f"task-{i}")
        await lock.acquire()
        await lock.release()

    with server_process("--lock-slots", "256") as s:
        async with await smb2.connect([s.address], transport="shm") as c:
            for i in range(400):
                await asyncio.create_task(task(c, i))
            stat = (await c.stat())[0]["locks"]
            assert stat["open"] <= 2, stat["open"]
            assert stat["reclaimed"] >= 398
