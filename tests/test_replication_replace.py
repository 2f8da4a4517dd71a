"""A server lost for good: its copies are made again on the other servers
(docs/design.md, "Replication": "Copies moved off a lost server"), against
real ``smb2-server`` processes and a real etcd."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import smb2
from smb2 import _core, cli
from smb2.membership import Holder, Substitute, View
from smb2.placement import Placement
from smb2.testing.replicas import Increments, Raw, server_stat
from smb2.testing.waits import HANG_GUARD, until

MiB = 1 << 20
# --replace-after in these tests
REPLACE_AFTER = 1.0


async def copy_bytes(address: str, name: str, slot: str, nbytes: int) -> bytes:
    """Server ``address``'s copy of ``slot``'s part of buffer ``name`` (its own
    part, or one it holds for a lost server): the first ``nbytes``."""
    raw = await Raw.open(address)
    try:
        msg = {"cmd": "lookup", "name": name, **({} if slot == address else {"copy_of": slot})}
        info = await raw.control(msg)
        return await raw.read(info["segment"], 0, min(nbytes, info["size"]))
    finally:
        raw.close()


async def copies_of(view: View, p: Placement, servers: list[str], name: str, i: int) -> list[tuple[str, bytes]]:
    """(server, bytes) of every member copy of stripe ``i``."""
    out = []
    for h in view.holders([servers[s] for s in p.replicas_of(i)]):
        if h.state == "member":
            off = p.offset_on(servers.index(h.slot), i)
            part = await copy_bytes(h.server, name, h.slot, off + p.stripe)
            out.append((h.server, part[off:off + p.stripe]))
    return out


def test_the_view_says_where_each_copy_is_after_a_move() -> None:
    """View.holders: copies on their own servers first, a moved copy counts
    only when its entry is ready and its server a member; the map survives
    the JSON in etcd."""
    group = ("a:1", "b:1")
    moving = View(5, ("a:1", "c:1"), (), (Substitute("b:1", group, "c:1"),))
    assert moving.holders(group) == [Holder("a:1", "a:1", "member"), Holder("b:1", "c:1", "joining")]
    assert moving.primary(group) == Holder("a:1", "a:1", "member")
    moved = View(6, ("c:1",), ("a:1",), (Substitute("b:1", group, "c:1", ready=True),))
    # a moved copy is the primary once the own copies are out (here: catching up)
    assert moved.primary(["b:1", "a:1"]) == Holder("b:1", "c:1", "member")
    assert moved.holders(["c:1", "a:1"]) == [Holder("c:1", "c:1", "member"), Holder("a:1", "a:1", "joining")]
    assert View.from_json(moved.to_json(), where="test") == moved
    assert b"replaced" not in View(1, ("a:1",)).to_json()     # the format without moves is unchanged
    assert View(6, ("a:1",), (), moved.replaced).primary(group) == Holder("a:1", "a:1", "member")
    assert View(6, (), (), moved.replaced).primary(group) is None


@pytest.mark.slow
async def test_a_server_lost_for_good_has_its_copies_made_on_the_others(capsys: pytest.CaptureFixture[str]) -> None:
    """SIGKILL one server of three (replicas=2) under a stream of
    accumulates and never restart it: in the end every stripe has
    two member copies on live servers again, byte-equal, holding every
    acknowledged increment, and ``degraded()`` is False.  Then the second
    copy of some stripes is lost too: the client reads and writes them on
    the copies the first repair made (a moved copy as the primary).  Then
    the first server comes back empty: it serves nothing of its old part,
    and the copies are made again on it (its own part, and the second lost
    server's)."""
    n_stripes = 6
    async with smb2.LocalCluster(servers=3, processes=True, replicated=True, capacity="64MiB",
                                 server_args=["--replace-after", str(REPLACE_AFTER)]) as cluster:
        servers = list(cluster.addresses)
        async with await smb2.connect(servers, transport="tcp") as client:
            buf = await client.create("moved", n_stripes * MiB, stripe=MiB, replicas=2)
            n = buf.nbytes // 8
            writes = Increments(buf, most=4096)
            await asyncio.sleep(0.3)
            assert not await buf.degraded()
            lost = servers[1]
            t0 = time.monotonic()
            await cluster.kill(1)
            took = await whole_again(buf, t0)
            await asyncio.sleep(0.3)        # updates go on reaching the new copies
            whole = await writes.stop()

            view = await check_copies(cluster, servers, "moved", whole, [0, 2])
            assert all(r.slot == lost and r.by != lost and r.ready for r in view.replaced), view.replaced
            # with 3 servers each survivor takes the stripes it shared no copy of
            for k in (0, 2):
                assert (await server_stat(servers[k]))["replication"]["copies_held"] == [f"moved ({lost})"]
            capsys.readouterr()
            assert await asyncio.to_thread(cli.main, ["ls", *servers]) == 1      # a server is unreachable
            out = capsys.readouterr()
            row = next(line for line in out.out.splitlines() if line.startswith("moved "))
            assert "2 replicas" in row and "DEGRADED" not in row and "readable" in row, row
            assert "whole on the servers left" in out.err, out.err
            print(f"whole again on two live servers {took:.2f} s after the kill")

            # the copies of the lost server are now on 0 and 2; lose 2 too: the
            # stripes it shared with 1 are served from the copy 0 holds for 1
            await cluster.kill(2)
            await buf.accumulate(0, np.ones(n, np.int64))
            whole = whole + 1
            assert np.array_equal(np.frombuffer(await buf.read(0, buf.nbytes), np.int64), whole)

            # 1 comes back empty: it serves none of its old (stale) part, and
            # takes 2's copies and its own back once they are caught up
            t0 = time.monotonic()
            await cluster.restart(1)
            await whole_again(buf, t0)
            await check_copies(cluster, servers, "moved", whole, [0, 1])
            await buf.accumulate(0, np.ones(n, np.int64))
            assert np.array_equal(np.frombuffer(await buf.read(0, buf.nbytes), np.int64), whole + 1)


async def whole_again(buf: smb2.Buffer, t0: float) -> float:
    """Seconds from ``t0`` until ``buf`` is degraded and then whole again."""
    seen_degraded = False
    while True:
        if await buf.degraded():
            seen_degraded = True
        elif seen_degraded:
            return time.monotonic() - t0
        # a hang guard: how soon it is whole is smb2 bench repair's figure
        assert time.monotonic() - t0 < HANG_GUARD, "the buffer is still degraded"
        await asyncio.sleep(0.1)


async def check_copies(cluster: smb2.LocalCluster, servers: list[str], name: str, whole: np.ndarray,
                       live: list[int]) -> View:
    """Every stripe of ``name`` has two member copies, on servers ``live``,
    equal to ``whole``; those servers say it is not degraded.  The view."""
    assert cluster.membership_url is not None
    async with cluster.membership() as m:
        view = await m.view()
    p = Placement(3, whole.nbytes, MiB, _core.name_hash(name) % 3, 2)
    for i in range(p.nstripes):
        copies = await copies_of(view, p, servers, name, i)
        assert len(copies) == 2 and {s for s, _ in copies} <= {servers[k] for k in live}, (i, copies, view)
        assert copies[0][1] == copies[1][1], f"stripe {i}: the copies differ"
        assert copies[0][1] == whole[i * MiB // 8:(i + 1) * MiB // 8].tobytes(), f"stripe {i}"
    for k in live:
        # a server reads the view every 0.5 s: it may not know the last change yet
        async def not_degraded(address: str = servers[k]) -> bool:
            st = await server_stat(address)
            return bool(st["buffers"][name]["degraded"] is False and not st["replication"]["degraded"])
        await until(not_degraded, f"server {servers[k]} no longer degraded", every=0.1)
    return view
