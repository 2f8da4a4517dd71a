"""Stale handles (issue 14, item 8): a Buffer handle from before a server
restarted never reaches another buffer's memory.  Real smb2-server
processes restarted in the middle of a job, without and with a data
directory."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest

import smb2
from smb2 import _core

MiB = 1 << 20


async def _write_everywhere(buf: smb2.Buffer, byte: int) -> None:
    await buf.write(0, bytes([byte]) * buf.nbytes)


async def test_restart_without_data_dir_refuses_the_old_handle() -> None:
    async with smb2.LocalCluster(servers=2, processes=True, capacity="16MiB") as cluster:
        a = await cluster.connect(timeout=5)
        job = await a.create("job-a", 2 * MiB, stripe=MiB)       # segment 1 on each server
        # a one-word buffer on the server that restarts
        step = next(f"job-a-step{i}" for i in range(100) if _core.name_hash(f"job-a-step{i}") % 2 == 1)
        counter = await a.create(step, 64, stripe=64)
        await _write_everywhere(job, 0xAA)
        await counter.fetch_add(0, 1)
        # server 1 dies and comes back empty, mid-job
        await cluster.kill(1, signal.SIGKILL)
        await cluster.restart(1)
        b = await cluster.connect(timeout=5)
        # another job's buffer gets the same segment id on the new server
        other = await b.create("job-b", 2 * MiB, stripe=MiB)
        assert other.segments[1] == job.segments[1]
        await _write_everywhere(other, 0xBB)
        # every data operation of the old handle is refused, nothing is sent
        with pytest.raises(smb2.StaleHandle, match="restarted") as err:
            await _write_everywhere(job, 0xEE)
        assert "job-a" in str(err.value) and "client.attach('job-a')" in (err.value.hint or "")
        with pytest.raises(smb2.StaleHandle):
            await job.accumulate(0, np.ones(job.nbytes // 4, dtype=np.float32))
        with pytest.raises(smb2.StaleHandle):
            await job.read(0, job.nbytes)
        with pytest.raises(smb2.StaleHandle):
            await counter.fetch_add(0, 1)
        assert np.all(await other.read(0, other.nbytes) == 0xBB)      # untouched
        # job-a lost its part on server 1: made again only when asked, and
        # then the old handle stays refused
        with pytest.raises(smb2.BufferDamaged):
            await b.create("job-a", 2 * MiB, stripe=MiB)
        await b.create("job-a", 2 * MiB, stripe=MiB, recreate_lost=True)
        with pytest.raises(smb2.StaleHandle):
            await _write_everywhere(job, 0xEE)
        assert np.all(await other.read(0, other.nbytes) == 0xBB)
        # attaching again gives a working handle
        fresh = await a.attach("job-a")
        await _write_everywhere(fresh, 0x11)
        assert np.all(await fresh.read(0, fresh.nbytes) == 0x11)
        assert np.all(await other.read(0, other.nbytes) == 0xBB)


async def test_restart_with_data_dir_keeps_handles_of_restored_buffers_only(tmp_path: Path) -> None:
    async with smb2.LocalCluster(servers=2, processes=True, capacity="16MiB",
                                 data_dir=tmp_path) as cluster:
        a = await cluster.connect(timeout=5)
        kept = await a.create("kept", 2 * MiB, stripe=MiB)
        gone = await a.create("gone", 2 * MiB, stripe=MiB)     # the highest segment id
        await _write_everywhere(kept, 0x55)
        await a.destroy("gone")
        # a planned restart of every server, mid-job
        for i in range(2):
            await cluster.kill(i, signal.SIGTERM)
        for i in range(2):
            await cluster.restart(i)
        b = await cluster.connect(timeout=5)
        other = await b.create("other", 2 * MiB, stripe=MiB)
        # the destroyed buffer's ids are not handed out again
        assert set(other.segments).isdisjoint(gone.segments)
        await _write_everywhere(other, 0xBB)
        # the restored buffer's handle goes on working (docs/reliability.md)
        assert np.all(await kept.read(0, kept.nbytes) == 0x55)
        await kept.write(0, b"still mine")
        # the destroyed one's is refused, and nothing lands anywhere
        with pytest.raises(smb2.StaleHandle):
            await _write_everywhere(gone, 0xEE)
        assert np.all(await other.read(0, other.nbytes) == 0xBB)
        assert bytes(await kept.read(0, 10)) == b"still mine"
