"""Persistence: a server's data directory (saved on a planned stop, restored at
start under the same segment ids) and client checkpoints of whole buffers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import smb2
from smb2 import checkpoint

MiB = 1 << 20


def _rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


async def test_restart_with_data_dir_keeps_bytes_and_handles(tmp_path: Path) -> None:
    s = await smb2.start_server("127.0.0.1", 0, capacity="64MiB", data_dir=tmp_path)
    port = s.address[1]
    client = await smb2.connect([s.address])
    try:
        a = await client.create("a", 3 * MiB + 5, stripe=MiB)
        b = await client.create("b", 100)
        await client.create("gone", 10)
        await client.destroy("gone")
        da, db = _rand(a.nbytes, 1), _rand(b.nbytes, 2)
        await a.write(0, da)
        await b.write(0, db)
        ids = (a.segments, b.segments)
        await s.close()
        # let the client see its connection close (a real restart takes longer
        # than this; an op sent before the client noticed fails with
        # TransportError, and the next one reconnects)
        await asyncio.sleep(0.1)
        m = json.loads((tmp_path / "manifest.json").read_text())
        assert [e["name"] for e in m["segments"]] == ["a", "b"] and m["generation"] == 1
        # the same port: the client's handles reconnect on their next operation
        s = await smb2.start_server("127.0.0.1", port, capacity="64MiB", data_dir=tmp_path)
        assert np.array_equal(await a.read(0, a.nbytes), da)
        assert np.array_equal(await b.read(0, b.nbytes), db)
        assert (a.segments, b.segments) == ids
        # new buffers get fresh ids, never a restored one's
        c = await client.create("c", 10)
        assert c.segments[0] > max(ids[0] + ids[1])
        await a.write(0, b"second generation")
        await s.close()
        await asyncio.sleep(0.1)
        files = sorted(os.listdir(tmp_path))
        assert files == [".lock", "manifest.json"] + sorted(
            f"seg-{i}.2.bin" for i in (a.segments[0], b.segments[0], c.segments[0]))
        s = await smb2.start_server("127.0.0.1", port, capacity="64MiB", data_dir=tmp_path)
        assert bytes(await a.read(0, 17)) == b"second generation"
        assert sorted(await client.buffers()) == ["a", "b", "c"]
    finally:
        await client.close()
        await s.close()


async def test_data_dir_is_locked_and_corruption_is_refused(tmp_path: Path) -> None:
    s = await smb2.start_server("127.0.0.1", 0, capacity="16MiB", data_dir=tmp_path)
    with pytest.raises(smb2.PersistenceError, match="in use"):
        await smb2.start_server("127.0.0.1", 0, capacity="16MiB", data_dir=tmp_path)
    async with await smb2.connect([s.address]) as c:
        buf = await c.create("x", MiB)
        await buf.write(1000, b"precious")
    await s.close()
    seg = tmp_path / next(n for n in os.listdir(tmp_path) if n.startswith("seg-"))
    raw = bytearray(seg.read_bytes())
    raw[1003] ^= 0x40
    seg.write_bytes(raw)
    with pytest.raises(smb2.PersistenceError, match="checksum"):
        await smb2.start_server("127.0.0.1", 0, capacity="16MiB", data_dir=tmp_path)
    raw[1003] ^= 0x40
    seg.write_bytes(raw[:-1])
    with pytest.raises(smb2.PersistenceError, match="truncated"):
        await smb2.start_server("127.0.0.1", 0, capacity="16MiB", data_dir=tmp_path)
    seg.write_bytes(raw)
    # more than this server's capacity
    with pytest.raises(smb2.PersistenceError, match="capacity"):
        await smb2.start_server("127.0.0.1", 0, capacity="64k", data_dir=tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(smb2.PersistenceError, match="unreadable"):
        await smb2.start_server("127.0.0.1", 0, capacity="16MiB", data_dir=tmp_path)


async def test_a_save_that_fails_leaves_the_previous_state(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    s = await smb2.start_server("127.0.0.1", 0, capacity="16MiB", data_dir=tmp_path)
    async with await smb2.connect([s.address]) as c:
        buf = await c.create("x", 4096)
        await buf.write(0, b"old")
    await s.close()
    s = await smb2.start_server("127.0.0.1", 0, capacity="16MiB", data_dir=tmp_path)
    async with await smb2.connect([s.address]) as c:
        buf = await c.attach("x")
        await buf.write(0, b"new")
        await c.create("y", 4096)
    real = os.replace

    def crash_on_manifest(src: str, dst: str) -> None:
        if str(dst).endswith("manifest.json"):
            raise OSError(28, "No space left on device")
        real(src, dst)
    monkeypatch.setattr(os, "replace", crash_on_manifest)
    with pytest.raises(smb2.PersistenceError, match="No space"):
        await s.close()
    monkeypatch.undo()
    # the failed save removed its own files; the server still serves (it
    # stops only once a save succeeds, or when told not to save)
    gen1 = json.loads((tmp_path / "manifest.json").read_text())
    # ("running": the run goes on, so a crash now would restart from an older save)
    assert sorted(os.listdir(tmp_path)) == sorted([".lock", "manifest.json", "running"]
                                                  + [e["file"] for e in gen1["segments"]])
    async with await smb2.connect([s.address]) as c:
        assert bytes(await (await c.attach("x")).read(0, 3)) == b"new"
    await s.close(save=False)
    # the manifest on disk is still generation 1
    s = await smb2.start_server("127.0.0.1", 0, capacity="16MiB", data_dir=tmp_path)
    try:
        async with await smb2.connect([s.address]) as c:
            assert await c.buffers() == ["x"]
            assert bytes(await (await c.attach("x")).read(0, 3)) == b"old"
    finally:
        await s.close()
    # the next save cleaned up: only what its manifest names is left
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["generation"] == 2
    assert sorted(os.listdir(tmp_path)) == sorted(
        [".lock", "manifest.json"] + [e["file"] for e in m["segments"]])


def test_large_segments_are_streamed_and_sparse(tmp_path: Path) -> None:
    async def run() -> int:
        s = await smb2.start_server("127.0.0.1", 0, capacity="1GiB", data_dir=tmp_path)
        async with await smb2.connect([s.address]) as c:
            buf = await c.create("big", 512 * MiB)
            await buf.write(300 * MiB, b"needle")
        tracemalloc.start()
        await s.close()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        s = await smb2.start_server("127.0.0.1", 0, capacity="1GiB", data_dir=tmp_path)
        async with await smb2.connect([s.address]) as c:
            assert bytes(await (await c.attach("big")).read(300 * MiB, 6)) == b"needle"
        await s.close()
        return peak
    peak = asyncio.run(run())
    assert peak < 4 * MiB, f"saving 512 MiB allocated {peak} bytes"
    seg = next(tmp_path.glob("seg-*.bin"))
    assert seg.stat().st_size == 512 * MiB
    assert seg.stat().st_blocks * 512 < 8 * MiB          # a hole, not 512 MiB of zeros


async def test_planned_restart_of_server_processes_loses_no_byte(tmp_path: Path) -> None:
    async with smb2.LocalCluster(servers=3, processes=True, capacity="64MiB",
                                 data_dir=tmp_path) as cluster:
        client = await cluster.connect(timeout=5)
        buf = await client.create("params", 20 * MiB + 3, stripe=MiB)
        data = _rand(buf.nbytes, 7)
        await buf.write(0, data)
        await buf.accumulate(8, np.arange(1000, dtype=np.int64))
        expect = data.copy()
        expect[8:8008].view(np.int64)[:] += np.arange(1000, dtype=np.int64)
        # one server, then all of them, each stopped with SIGTERM and started again
        for which in ([1], [0, 1, 2]):
            for i in which:
                await cluster.kill(i, signal.SIGTERM)
            for i in which:
                await cluster.restart(i)
            assert np.array_equal(await buf.read(0, buf.nbytes), expect)
        assert sorted(os.listdir(tmp_path)) == ["server-0", "server-1", "server-2"]


def test_smb2_server_refuses_a_corrupt_data_dir(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"format": 1, "generation": 1, "segments": [
            {"segment": 1, "name": "x", "nbytes": 8, "stripe": 8, "nservers": 1, "index": 0,
             "size": 8, "file": "seg-1.1.bin", "sha256": "00"}]}))
    (tmp_path / "seg-1.1.bin").write_bytes(b"\0" * 8)
    proc = subprocess.run([sys.executable, "-m", "smb2.server", "--port", "0", "--data-dir",
                           str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and "checksum mismatch" in proc.stderr


# -- client checkpoints ------------------------------------------------------------

async def test_checkpoint_and_restore(cluster: smb2.LocalCluster, tmp_path: Path) -> None:
    client = await cluster.connect()
    buf = await client.create("w", 10 * MiB + 12345, stripe=256 << 10)
    data = _rand(buf.nbytes, 4)
    await buf.write(0, data)
    path = tmp_path / "w.ckpt"
    info = await client.checkpoint("w", path)
    assert info["nbytes"] == buf.nbytes and len(info["sha256"]) == 64
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    # into a fresh cluster's missing buffer: created with the checkpoint's geometry
    await client.destroy("w")
    got = await client.restore("w", path)
    assert got["sha256"] == info["sha256"]
    again = await client.attach("w")
    assert again.stripe == 256 << 10
    assert np.array_equal(await again.read(0, again.nbytes), data)
    # into an existing buffer of the same size: overwritten
    await again.write(0, b"\0" * 100)
    await client.restore("w", path)
    assert np.array_equal(await again.read(0, 100), data[:100])


async def test_restore_refuses_mismatches_and_corruption(cluster: smb2.LocalCluster,
                                                         tmp_path: Path) -> None:
    client = await cluster.connect()
    buf = await client.create("m", MiB)
    await buf.write(0, _rand(MiB, 5))
    path = tmp_path / "m.ckpt"
    await client.checkpoint("m", path)
    await client.create("small", MiB - 8)
    with pytest.raises(smb2.InvalidArgumentError, match="checkpoint of buffer 'm'"):
        await client.restore("small", path)
    await client.destroy("m")
    await client.create("m", 2 * MiB)
    with pytest.raises(smb2.InvalidArgumentError, match="has 2097152 bytes"):
        await client.restore("m", path)
    raw = bytearray(path.read_bytes())
    bad = tmp_path / "bad.ckpt"
    raw[-10] ^= 1
    bad.write_bytes(raw)
    target = await client.create("victim", MiB)
    await target.write(0, b"untouched")
    with pytest.raises(smb2.PersistenceError, match="checksum"):
        await client.restore("m", bad)
    bad.write_bytes(raw[:-1])
    with pytest.raises(smb2.PersistenceError, match="header says"):
        await client.restore("m", bad)
    bad.write_bytes(b"PK\x03\x04" + bytes(raw[4:]))
    with pytest.raises(smb2.PersistenceError, match="not an smb2 checkpoint"):
        await client.restore("m", bad)
    with pytest.raises(smb2.PersistenceError, match="cannot open"):
        await client.restore("m", tmp_path / "missing")
    with pytest.raises(smb2.NoSuchBuffer):
        await client.checkpoint("nope", tmp_path / "nope.ckpt")
    assert not (tmp_path / "nope.ckpt").exists()
    assert bytes(await target.read(0, 9)) == b"untouched"


async def test_checkpoint_memory_is_two_chunks(cluster: smb2.LocalCluster, tmp_path: Path) -> None:
    client = await cluster.connect()
    buf = await client.create("huge", 96 * MiB)
    await buf.write(50 * MiB, b"mark")
    tracemalloc.start()
    try:
        await client.checkpoint("huge", tmp_path / "h.ckpt")
        await client.restore("huge", tmp_path / "h.ckpt")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the in-process servers are in this process too: they allocate nothing per byte either
    assert peak < 3 * checkpoint.CHUNK + 4 * MiB, peak
    assert bytes(await buf.read(50 * MiB, 4)) == b"mark"


async def test_a_start_after_a_crash_knows_its_save_is_older_than_the_last_run(tmp_path) -> None:
    """What recovery by rule reads (docs/reliability.md): restored segments
    are the state the last run ended with only when that run ended with a save."""
    s = await smb2.start_server("127.0.0.1", 0, capacity="16MiB", data_dir=tmp_path)
    async with await smb2.connect([s.address]) as c:
        await c.create("x", 10)
    await s.close()
    s = await smb2.start_server("127.0.0.1", 0, capacity="16MiB", data_dir=tmp_path)
    assert s.restored_clean                     # a planned stop saved it
    # a crash: the run ends without a save (close(save=False) leaves it as a kill does)
    await s.close(save=False)
    s = await smb2.start_server("127.0.0.1", 0, capacity="16MiB", data_dir=tmp_path)
    try:
        assert s.restored and not s.restored_clean
    finally:
        await s.close()
