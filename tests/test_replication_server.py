"""Replicated buffers, the server side: raw frames against memory servers that
share a view in a real etcd (docs/design.md, "Replication").

What each test shows: a replicated op lands on every replica of its stripe;
a retried op (same client id and sequence) is applied once; a backup refuses
an op forwarded under an older epoch, and one a client forges; a primary cut
off from the membership service acknowledges nothing once its backup knows the
newer view; a server that comes back catches up and holds the primary's bytes.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import msgpack
import numpy as np
import pytest

from smb2 import _core
from smb2.errors import ErrorCode, MembershipError
from smb2.membership import NO_VIEW, View, open_membership
from smb2.placement import Placement
from smb2.protocol import DTYPE_SHIFT, FLAG_FORWARDED, FLAG_REPLICATED, VERSION, Op
from smb2.server import start_server
from smb2.server.replication import DEDUP_PER_CLIENT, Dedup, Entry, TooManyClients
from smb2.testing.cluster import thread_options
from smb2.testing.etcd import LocalEtcd, etcd_binary
from smb2.testing.ports import free_port
from smb2.testing.replicas import Increments, Raw, segment_bytes, server_stat
from smb2.testing.waits import until
from smb2.testing.wire import control, frame, reply

try:
    etcd_binary()
    HAVE_ETCD = True
except Exception:
    HAVE_ETCD = False

pytestmark = [pytest.mark.skipif(not HAVE_ETCD, reason="needs etcd (tools/host_deps.sh installs etcd-server)"),
              pytest.mark.server_process_only]

STRIPE = 4096
NBYTES = 6 * STRIPE


def prefix(epoch: int, client: int, seq: int) -> bytes:
    return _core.pack_u64(epoch) + _core.pack_u64(client) + _core.pack_u64(seq)


class Cluster:
    """Memory servers in this process sharing one view in a private etcd."""

    def __init__(self, etcd: LocalEtcd, n: int) -> None:
        self.etcd = etcd
        self.url = etcd.url(f"t-{uuid.uuid4().hex[:8]}")
        self.ports = [free_port() for _ in range(n)]
        self.addresses = [f"127.0.0.1:{p}" for p in self.ports]
        self.servers: list = [None] * n

    async def start(self) -> Cluster:
        async with open_membership(self.url) as m:
            await m.change(NO_VIEW, members=self.addresses)
        self.servers = list(await asyncio.gather(*(self.start_one(i) for i in range(len(self.ports)))))
        return self

    async def start_one(self, i: int, **kw):
        return await start_server("127.0.0.1", self.ports[i], membership=self.url, shm="off", rdma="off", **kw)

    async def view(self) -> View:
        async with open_membership(self.url) as m:
            return await m.view()

    async def change(self, members: list[str], joining: list[str] = ()) -> View:
        async with open_membership(self.url) as m:
            v = await m.view()
            return await m.change(v, members=members, joining=joining)

    async def close(self) -> None:
        for s in self.servers:
            if s is not None:
                await s.close()


@pytest.fixture
async def etcd():
    e = await LocalEtcd("127.0.0.1").start()
    yield e
    await e.close()


@pytest.fixture
async def cluster(etcd):
    c = await Cluster(etcd, 3).start()
    yield c
    await c.close()


async def create(c: Cluster, name: str, replicas: int = 2) -> tuple[Placement, list[int]]:
    """The buffer on every server; its placement and each server's segment id."""
    segs = []
    for i, a in enumerate(c.addresses):
        raw = await Raw.open(a)
        info = await raw.control({"cmd": "create", "name": name, "nbytes": NBYTES, "stripe": STRIPE,
                                  "nservers": len(c.addresses), "index": i, "buffer_id": "b" * 16,
                                  "seal": i == 0, "replicas": replicas, "servers": c.addresses})
        segs.append(info["segment"])
        raw.close()
    n = len(c.addresses)
    return Placement(n, NBYTES, STRIPE, _core.name_hash(name) % n, replicas), segs


async def replica_bytes(c: Cluster, p: Placement, segs: list[int], stripe: int) -> list[bytes]:
    out = []
    for s in p.replicas_of(stripe):
        raw = await Raw.open(c.addresses[s])
        out.append(await raw.read(segs[s], p.offset_on(s, stripe), STRIPE))
        raw.close()
    return out


async def test_replicated_ops_land_on_every_replica(cluster):
    c = cluster
    p, segs = await create(c, "r1")
    for i in range(p.nstripes):
        primary = p.replicas_of(i)[0]
        raw = await Raw.open(c.addresses[primary])
        base = p.offset_on(primary, i)
        data = bytes([i + 1]) * 64
        st, _ = await raw.op(Op.WRITE, segs[primary], base, prefix(1, 7, 10 * i) + data, FLAG_REPLICATED)
        assert st == 0
        delta = np.full(4, 2.5, np.float32).tobytes()
        st, _ = await raw.op(Op.ACCUMULATE, segs[primary], base + 64, prefix(1, 7, 10 * i + 1) + delta,
                             FLAG_REPLICATED | (1 << DTYPE_SHIFT))
        assert st == 0
        st, old = await raw.op(Op.FETCH_ADD, segs[primary], base + 128, prefix(1, 7, 10 * i + 2) +
                               _core.pack_u64(5), FLAG_REPLICATED)
        assert st == 0 and _core.unpack_u64(old) == 0
        raw.close()
        copies = await replica_bytes(c, p, segs, i)
        assert copies[0] == copies[1]
        assert copies[0][:64] == data
        assert np.frombuffer(copies[0][64:80], np.float32).tolist() == [2.5] * 4
        assert _core.unpack_u64(copies[0][128:136]) == 5
    # a plain (unreplicated) write to a replicated buffer would change one copy: refused
    raw = await Raw.open(c.addresses[0])
    st, msg = await raw.op(Op.WRITE, segs[0], 0, b"x" * 8, 0)
    assert st == ErrorCode.BAD_REQUEST and "replicated" in msg["message"]
    raw.close()


async def test_retried_op_is_applied_once(cluster):
    c = cluster
    p, segs = await create(c, "r2")
    primary = p.replicas_of(0)[0]
    raw = await Raw.open(c.addresses[primary])
    base = p.offset_on(primary, 0)
    delta = np.full(2, 1.0, np.float64).tobytes()
    for _ in range(3):      # the same op three times: a client retrying after a lost reply
        st, _ = await raw.op(Op.ACCUMULATE, segs[primary], base, prefix(1, 99, 1) + delta,
                             FLAG_REPLICATED | (2 << DTYPE_SHIFT))
        assert st == 0
    olds = []
    for _ in range(2):
        st, old = await raw.op(Op.FETCH_ADD, segs[primary], base + 64, prefix(1, 99, 2) + _core.pack_u64(3),
                               FLAG_REPLICATED)
        assert st == 0
        olds.append(_core.unpack_u64(old))
    assert olds == [0, 0]       # the retry gets the first result, not 3
    raw.close()
    for copy in await replica_bytes(c, p, segs, 0):
        assert np.frombuffer(copy[:16], np.float64).tolist() == [1.0, 1.0]
        assert _core.unpack_u64(copy[64:72]) == 3


async def test_backup_refuses_older_epoch_and_forged_forwards(cluster):
    c = cluster
    p, segs = await create(c, "r3")
    primary, backup = p.replicas_of(0)
    off = p.offset_on(backup, 0)
    # a client (no peer hello) that sends FORWARDED to skip the primary: refused
    raw = await Raw.open(c.addresses[backup])
    st, msg = await raw.op(Op.WRITE, segs[backup], off, prefix(1, 5, 1) + b"y" * 8, FLAG_FORWARDED)
    assert st == ErrorCode.ACCESS_DENIED, msg
    raw.close()
    # ... and one that claims to be a server that is not the stripe's primary
    third = next(a for k, a in enumerate(c.addresses) if k not in (primary, backup))
    raw = await Raw.open(c.addresses[backup], peer=third)
    st, msg = await raw.op(Op.WRITE, segs[backup], off, prefix(1, 5, 2) + b"y" * 8, FLAG_FORWARDED)
    assert st == ErrorCode.ACCESS_DENIED, msg
    raw.close()
    # the view moves on (same members, epoch 2); the backup learns it
    v = await c.change(list(c.addresses))
    assert v.epoch == 2
    await c.servers[backup].replication.refresh()
    raw = await Raw.open(c.addresses[backup], peer=c.addresses[primary])
    st, msg = await raw.op(Op.WRITE, segs[backup], off, prefix(1, 5, 3) + b"z" * 8, FLAG_FORWARDED)
    assert st == ErrorCode.STALE_EPOCH and msg["epoch"] == 2, msg
    raw.close()
    copies = await replica_bytes(c, p, segs, 0)
    assert copies[1][:8] == bytes(8)        # nothing landed


class Unreachable:
    """A membership service this server cannot reach (a partition)."""

    async def view(self) -> View:
        raise MembershipError("etcd unreachable (partitioned in this test)")

    async def change(self, *a, **k) -> View:
        raise MembershipError("etcd unreachable (partitioned in this test)")

    async def close(self) -> None:
        pass


async def test_partitioned_primary_acknowledges_nothing(cluster):
    c = cluster
    p, segs = await create(c, "r4")
    primary, backup = p.replicas_of(0)
    old = c.servers[primary].replication
    old.membership = Unreachable()          # the primary is cut off from etcd
    # the cluster removes it (epoch 2); its backup learns that first
    await c.change([a for k, a in enumerate(c.addresses) if k != primary])
    await c.servers[backup].replication.refresh()
    assert old.view.epoch == 1 and old.state == "member"
    raw = await Raw.open(c.addresses[primary])
    base = p.offset_on(primary, 0)
    delta = np.full(2, 1.0, np.float64).tobytes()
    for seq in range(5):
        # a client that still has epoch 1 (refused, not held: the wait_for is a hang guard)
        st, msg = await asyncio.wait_for(raw.op(Op.ACCUMULATE, segs[primary], base, prefix(1, 11, seq) + delta,
                                                FLAG_REPLICATED | (2 << DTYPE_SHIFT)), 60)
        assert st != 0, "a primary cut off from the view acknowledged an op"
        assert st in (ErrorCode.NOT_MEMBER, ErrorCode.STALE_EPOCH), msg
    raw.close()
    # the new primary (the old backup) holds none of them
    raw = await Raw.open(c.addresses[backup])
    assert await raw.read(segs[backup], p.offset_on(backup, 0), 16) == bytes(16)
    raw.close()


def metric(server, name: str) -> float:
    """One sample of the server's Prometheus metrics (read as a scrape does)."""
    pytest.importorskip("prometheus_client")
    from smb2.server.metrics import ServerCollector
    for family in ServerCollector(server).collect():
        for sample in family.samples:
            if sample.name in (name, name + "_total"):
                return sample.value
    raise KeyError(name)


async def wait_member(server) -> None:
    await until(lambda: server.replication.state == "member", "caught up (a member)", every=0.05)


@pytest.mark.parametrize("data_dir", [False, True], ids=["empty", "data_dir"])
async def test_restarted_server_catches_up(cluster, data_dir, tmp_path):
    """A server that comes back (empty, or with its stale --data-dir) catches
    up instead of serving what it had: all copies hold every update."""
    c = cluster
    victim = 1
    kw = {"data_dir": str(tmp_path / "victim")} if data_dir else {}
    if data_dir:
        # the victim keeps a data directory from the start
        await c.servers[victim].close()
        c.servers[victim] = await c.start_one(victim, **kw)
        await wait_member(c.servers[victim])
    p, segs = await create(c, "r5")
    delta = np.ones(STRIPE // 8, np.float64).tobytes()
    client = int.from_bytes(os.urandom(8), "little")
    seq = 0

    async def push(rounds: int) -> None:
        """Accumulate 1.0 into every stripe, ``rounds`` times, at its primary."""
        nonlocal seq
        v = await c.view()
        for _ in range(rounds):
            for i in range(p.nstripes):
                prim = next(s for s in p.replicas_of(i) if c.addresses[s] in v.members)
                raw = await Raw.open(c.addresses[prim])
                seq += 1
                st, msg = await raw.op(Op.ACCUMULATE, segs[prim], p.offset_on(prim, i),
                                       prefix(v.epoch, client, seq) + delta, FLAG_REPLICATED | (2 << DTYPE_SHIFT))
                raw.close()
                assert st == 0, msg

    await push(2)
    assert metric(c.servers[victim], "smb2_replication_member") == 1
    assert metric(c.servers[victim], "smb2_replication_degraded_buffers") == 0
    await c.servers[victim].close()
    c.servers[victim] = None
    # what a client does when the server stops answering: out of the view
    await c.change([a for k, a in enumerate(c.addresses) if k != victim])
    await push(3)
    survivor = c.servers[0]
    await survivor.replication.refresh()
    # a stripe of the buffer is short of a copy: shown in stat and the metric
    assert metric(survivor, "smb2_replication_degraded_buffers") == 1
    assert survivor.stat()["buffers"]["r5"]["degraded"] is True
    t0 = time.monotonic()
    c.servers[victim] = await c.start_one(victim, **kw)
    if data_dir:
        assert c.servers[victim].restored, "the data directory was not restored"
    await wait_member(c.servers[victim])
    took = time.monotonic() - t0
    assert metric(c.servers[victim], "smb2_replication_member") == 1
    assert metric(c.servers[0 if victim else 1], "smb2_replication_copied_bytes") > 0 or \
        metric(c.servers[2], "smb2_replication_copied_bytes") > 0
    await push(1)
    # every replica of every stripe holds 6.0 in every word, the restarted one too
    info = await (await Raw.open(c.addresses[victim])).control({"cmd": "lookup", "name": "r5"})
    segs[victim] = info["segment"]
    for i in range(p.nstripes):
        for copy in await replica_bytes(c, p, segs, i):
            assert np.all(np.frombuffer(copy, np.float64) == 6.0), i
    print(f"caught up in {took:.2f} s")        # smb2 bench repair measures it


# how soon a server is whole again is smb2 bench repair's figure; the tests
# wait for it under a hang guard


@pytest.mark.slow
async def test_killed_server_rejoins_and_is_whole_again_while_writes_go_on() -> None:
    """SIGKILL a server of three (replicas=2) under a stream of accumulates,
    restart it (no data directory: it comes back empty), and it catches up
    while the writes go on: it is a member again, and
    every stripe's two copies are equal bytes, holding every acknowledged
    increment."""
    import smb2
    MiB = 1 << 20
    async with smb2.LocalCluster(servers=3, processes=True, replicated=True, capacity="64MiB") as cluster:
        async with await smb2.connect(cluster.addresses) as client:
            buf = await client.create("heal", 4 * MiB, stripe=MiB, replicas=2)
            writes = Increments(buf)
            await asyncio.sleep(0.5)
            await cluster.kill(1)
            await asyncio.sleep(1.0)
            t0 = time.monotonic()
            await cluster.restart(1)
            async def whole() -> bool:
                st = (await server_stat(cluster.addresses[1]))["replication"]
                return bool(st["state"] == "member" and not st["degraded"])
            await until(whole, "server 1 a whole member again", every=0.1)
            took = time.monotonic() - t0
            # updates flow to the rejoined copy too: some more are acknowledged
            acked = int(writes.acked.sum())
            await until(lambda: int(writes.acked.sum()) > acked, "an increment acknowledged after the rejoin")
            whole = await writes.stop()
            p = Placement(3, buf.nbytes, MiB, _core.name_hash("heal") % 3, 2)
            parts = [await segment_bytes(a, "heal") for a in cluster.addresses]
            for i in range(p.nstripes):
                copies = [parts[s][1][p.offset_on(s, i):p.offset_on(s, i) + MiB] for s in p.replicas_of(i)]
                assert copies[0] == copies[1], f"stripe {i}: the copies differ"
                assert copies[0] == whole[i * MiB // 8:(i + 1) * MiB // 8].tobytes()
            print(f"restarted server was a member again {took:.2f} s after its restart")


async def test_servers_forward_to_each_other_with_the_clusters_token(etcd, monkeypatch):
    """With a token, server-to-server links authenticate like clients."""
    token = b"k" * 32
    monkeypatch.setattr(Raw, "token", token)
    c = Cluster(etcd, 3)

    async def start_one(i: int, **kw):
        return await start_server("127.0.0.1", c.ports[i], membership=c.url, shm="off", rdma="off",
                                  token=token, **kw)
    c.start_one = start_one
    await c.start()
    try:
        p, segs = await create(c, "tok")
        primary = p.replicas_of(0)[0]
        raw = await Raw.open(c.addresses[primary])
        st, msg = await raw.op(Op.WRITE, segs[primary], p.offset_on(primary, 0),
                               prefix(1, 3, 1) + b"t" * 32, FLAG_REPLICATED)
        raw.close()
        assert st == 0, msg
        copies = await replica_bytes(c, p, segs, 0)
        assert copies[0][:32] == copies[1][:32] == b"t" * 32
    finally:
        await c.close()


@pytest.mark.slow
async def test_pipelined_large_writes_reach_the_backups_intact() -> None:
    """A 32 MiB write of a replicas=2 buffer (1 MiB requests, pipelined) on
    server processes, then a server lost and caught up: every copy holds the
    bytes written.  The primary's receive buffer is reused for each request
    while a backup's socket may still hold earlier ones, so what it forwards
    must be a copy (a view made copies differ in tools/bench_repair.py)."""
    import smb2
    mib = 1 << 20
    nbytes = 32 * mib
    async with smb2.LocalCluster(servers=3, processes=True, replicated=True, capacity="64MiB") as cluster:
        async with await smb2.connect(cluster.addresses, transport="tcp", op_timeout=60) as client:
            buf = await client.create("big", nbytes, stripe=mib, replicas=2)
            data = np.random.default_rng(3).integers(0, 256, nbytes, dtype=np.uint8)
            await buf.write(0, data)
            # and server 1 lost and caught up again from copies of its stripes
            await cluster.kill(1)
            async with cluster.membership() as m:
                v = await m.view()
                await m.change(v, members=[a for a in v.members if a != cluster.addresses[1]])
            await cluster.restart(1)

            async def member() -> bool:
                return bool((await server_stat(cluster.addresses[1]))["replication"]["state"] == "member")
            await until(member, "server 1 a member again", every=0.05)
            p = Placement(3, nbytes, mib, _core.name_hash("big") % 3, 2)
            parts = [await segment_bytes(a, "big") for a in cluster.addresses]
            for i in range(p.nstripes):
                for s in p.replicas_of(i):
                    copy = parts[s][1][p.offset_on(s, i):p.offset_on(s, i) + mib]
                    assert copy == data[i * mib:(i + 1) * mib].tobytes(), f"stripe {i} on server {s}"


async def _epoch_known(address: str, epoch: int) -> None:
    """Wait until the server at ``address`` holds view ``epoch`` and is a member."""
    async def known() -> bool:
        st = (await server_stat(address))["replication"]
        return bool(st["epoch"] >= epoch and st["state"] == "member")
    await until(known, f"{address} a member at epoch {epoch}", every=0.05)


async def _paused_primary_answers(cluster, primary: int, seg: int, offset: int, epoch: int,
                                  during_pause) -> tuple[int, dict | bytes]:
    """SIGSTOP ``primary`` with a replicated accumulate under ``epoch`` queued
    on its socket, run ``during_pause()`` (the failover), SIGCONT it past its
    lease, and return its late answer."""
    import signal
    raw = await Raw.open(cluster.addresses[primary])
    try:
        os.kill(cluster.pid(primary), signal.SIGSTOP)
        try:
            raw.rid += 1
            client = int.from_bytes(os.urandom(8), "little")
            raw.writer.write(frame(Op.ACCUMULATE, prefix(epoch, client, 1) + np.ones(2, np.float64).tobytes(),
                                   rid=raw.rid, segment=seg, offset=offset,
                                   flags=FLAG_REPLICATED | (2 << DTYPE_SHIFT)))
            await raw.writer.drain()
            await during_pause()
            # the clients' view lease: nobody acts on the new view before this
            await asyncio.sleep(1.0)
        finally:
            os.kill(cluster.pid(primary), signal.SIGCONT)
        hdr, body = await asyncio.wait_for(reply(raw.reader), 10)
        return hdr[4], (msgpack.unpackb(body) if hdr[4] else body)
    finally:
        raw.close()


@pytest.mark.slow
async def test_a_paused_old_primary_acknowledges_nothing_after_the_failover() -> None:
    """A primary SIGSTOPped with an op queued, removed from the view while it
    sleeps, and resumed: its late answer is a refusal, never an ack (its
    backup, on the new view, refuses the forward); the acknowledged write of
    the new primary is kept.  Then a stripe whose only live copy is the paused
    primary (its backup was lost before): the servers refuse to take it out of
    the view, so its late answer is an acknowledgement, and kept."""
    import smb2
    async with smb2.LocalCluster(servers=3, processes=True, replicated=True, capacity="64MiB") as cluster:
        addrs = cluster.addresses
        p, segs = await create(cluster, "paused")
        prim, backup = p.replicas_of(0)
        other = next(k for k in range(3) if k not in (prim, backup))
        await _epoch_known(addrs[prim], 1)

        async def fail_over_to_backup() -> None:
            # what a client does when the primary stops answering
            v = await cluster_change(cluster, [a for k, a in enumerate(addrs) if k != prim])
            # ... and its next write, on the new primary, acknowledged
            raw = await Raw.open(addrs[backup])
            st, msg = await raw.op(Op.WRITE, segs[backup], p.offset_on(backup, 0) + 64,
                                   prefix(v.epoch, 78, 1) + b"N" * 8, FLAG_REPLICATED)
            raw.close()
            assert st == 0, msg

        st, msg = await _paused_primary_answers(cluster, prim, segs[prim], p.offset_on(prim, 0), 1,
                                                fail_over_to_backup)
        assert st in (ErrorCode.NOT_MEMBER, ErrorCode.STALE_EPOCH), (st, msg)
        raw = await Raw.open(addrs[backup])
        kept = await raw.read(segs[backup], p.offset_on(backup, 0), 72)
        raw.close()
        assert kept[64:72] == b"N" * 8 and kept[:16] == bytes(16)

        # the old primary rejoins; then the stripe's backup is lost for good
        async def rejoined() -> bool:
            return addrs[prim] in (await _view(cluster)).members
        await until(rejoined, "the old primary back in the view", every=0.1)
        await cluster.kill(backup)
        v = await cluster_change(cluster, [a for k, a in enumerate(addrs) if k != backup])
        await _epoch_known(addrs[prim], v.epoch)
        refused = []

        async def remove_primary() -> None:
            # a client of another buffer asks the other server to remove the
            # paused one: the stripe it holds alone would have no member copy,
            # so the server refuses (a client cannot know every buffer)
            async with await smb2.connect([addrs[other]], transport="tcp") as c:
                views = await c.views()
                with pytest.raises(smb2.TransportError, match="without a member copy") as err:
                    await views.membership.change(v, members=[addrs[other]])
                refused.append(err.value)
        st, msg = await _paused_primary_answers(cluster, prim, segs[prim], p.offset_on(prim, 0), v.epoch,
                                                remove_primary)
        assert refused and (await _view(cluster)).epoch == v.epoch
        # the old primary stayed the stripe's member copy: its late answer is
        # an acknowledgement, and the update is in the copy that counts
        assert st == 0, (st, msg)
        raw = await Raw.open(addrs[prim])
        kept = await raw.read(segs[prim], p.offset_on(prim, 0), 16)
        raw.close()
        assert np.array_equal(np.frombuffer(kept, np.float64), [1.0, 1.0])


async def _view(cluster) -> View:
    async with cluster.membership() as m:
        return await m.view()


async def cluster_change(cluster, members: list[str]) -> View:
    async with cluster.membership() as m:
        v = await m.view()
        new = await m.change(v, members=members)
        assert new.epoch == v.epoch + 1, (v, new)
        return new


async def test_a_client_cannot_forge_a_forward_when_the_servers_share_a_peer_token(etcd):
    """A client on the primary's own host that says it is the primary (the
    source address check passes) is not taken as a peer: it cannot prove the
    servers' peer token, so its forwarded write is refused and a wrong proof
    closes the connection; the servers' own forwards still land."""
    peer_token = b"p" * 32
    c = Cluster(etcd, 3)

    async def start_one(i: int, **kw):
        return await start_server("127.0.0.1", c.ports[i], membership=c.url, shm="off", rdma="off",
                                  peer_token=peer_token, **kw)
    c.start_one = start_one
    await c.start()
    try:
        p, segs = await create(c, "forge")
        primary, backup = p.replicas_of(0)
        off = p.offset_on(backup, 0)
        for proof in (None, b"\0" * 32):
            host, port = c.addresses[backup].rsplit(":", 1)
            raw = Raw(*await asyncio.open_connection(host, int(port)))
            hdr, body = await raw.call_frame(control({"cmd": "hello", "version": VERSION, "transports": ["tcp"],
                                                      "peer": c.addresses[primary]}))
            assert hdr[4] == 0 and isinstance(msgpack.unpackb(body).get("peer_nonce"), bytes)
            if proof is None:
                st, msg = await raw.op(Op.WRITE, segs[backup], off, prefix(1, 5, 1) + b"f" * 8, FLAG_FORWARDED)
                assert st == ErrorCode.ACCESS_DENIED, msg
            else:
                raw.rid += 1
                hdr, body = await raw.call_frame(control({"cmd": "peer_auth", "nonce": os.urandom(32),
                                                          "proof": proof}, raw.rid))
                assert hdr[4] == ErrorCode.ACCESS_DENIED, msgpack.unpackb(body)
                assert await raw.reader.read() == b""       # closed
            raw.close()
        raw = await Raw.open(c.addresses[primary])
        st, msg = await raw.op(Op.WRITE, segs[primary], p.offset_on(primary, 0), prefix(1, 3, 1) + b"t" * 8,
                               FLAG_REPLICATED)
        raw.close()
        assert st == 0, msg
        copies = await replica_bytes(c, p, segs, 0)
        assert copies[0][:8] == copies[1][:8] == b"t" * 8
    finally:
        await c.close()


# the duplicate table's size in the flood tests: small, so that a flood a
# few times its size is quick; the bound's logic is the same at any size
FLOOD_CLIENTS = 16


async def flood_cluster(etcd) -> Cluster:
    c = Cluster(etcd, 3)
    one = c.start_one
    c.start_one = lambda i, **kw: one(i, dedup_clients=FLOOD_CLIENTS, **kw)    # type: ignore[method-assign]
    return await c.start()


def victim_op(kind: str, seq: int) -> tuple[int, bytes, int]:
    """(op, payload after the prefix, flags) of the victim's op of ``kind``
    at its word: +1, +1.0, 0 -> 7, or a ticket drawn (+1 on the lock
    words' next-ticket word)."""
    if kind == "accumulate":
        return Op.ACCUMULATE, np.ones(1, np.float64).tobytes(), FLAG_REPLICATED | (2 << DTYPE_SHIFT)
    if kind == "compare_swap":
        return Op.COMPARE_SWAP, _core.pack_u64(0) + _core.pack_u64(7), FLAG_REPLICATED
    return Op.FETCH_ADD, _core.pack_u64(1), FLAG_REPLICATED


@pytest.mark.parametrize("kind", ["fetch_add", "accumulate", "compare_swap", "lock_ticket"])
async def test_a_flood_under_fresh_client_ids_cannot_make_a_retry_apply_twice(etcd, kind):
    """The victim's op is applied and acknowledged; another authenticated
    client then sends fetch_adds to its own buffer under many fresh client
    ids (ten times the servers' table); the victim's retry, same client id
    and sequence as after a lost reply, is answered with the first result
    and leaves the word as one application made it."""
    c = await flood_cluster(etcd)
    try:
        p, segs = await create(c, "lock:t" if kind == "lock_ticket" else "victim")
        _, flood_segs = await create(c, "flood")
        primary = p.replicas_of(0)[0]
        # the lock words: next_ticket is the second word
        word = p.offset_on(primary, 0) + (8 if kind == "lock_ticket" else 0)
        raw = await Raw.open(c.addresses[primary])
        op, body, flags = victim_op(kind, 1)
        st, first = await raw.op(op, segs[primary], word, prefix(1, 0x51C71, 1) + body, flags)
        assert st == 0
        if kind == "compare_swap":
            # another client puts the word back: a second application would set it again
            st, old = await raw.op(Op.COMPARE_SWAP, segs[primary], word,
                                   prefix(1, 0xB0B, 1) + _core.pack_u64(7) + _core.pack_u64(0), FLAG_REPLICATED)
            assert st == 0 and _core.unpack_u64(old) == 7
        fp = Placement(3, NBYTES, STRIPE, _core.name_hash("flood") % 3, 2)
        at = next(i for i in range(fp.nstripes) if fp.replicas_of(i)[0] == primary)
        refused = 0
        for fresh in range(10 * FLOOD_CLIENTS):
            st, _ = await raw.op(Op.FETCH_ADD, flood_segs[primary], fp.offset_on(primary, at),
                                 prefix(1, 1 << 40 | fresh, 1) + _core.pack_u64(1), FLAG_REPLICATED)
            refused += st == ErrorCode.CONFLICT
        assert refused > 0      # the flood found the table full and was refused, not the victim forgotten
        st, again = await raw.op(op, segs[primary], word, prefix(1, 0x51C71, 1) + body, flags)
        raw.close()
        assert st == 0 and again == first
        expected = {"fetch_add": 1, "lock_ticket": 1, "compare_swap": 0}
        for copy in await replica_bytes(c, p, segs, 0):
            at_word = copy[word - p.offset_on(primary, 0):][:8]
            if kind == "accumulate":
                assert np.frombuffer(at_word, np.float64).tolist() == [1.0]
            else:
                assert _core.unpack_u64(at_word) == expected[kind]
    finally:
        await c.close()


async def test_a_replicated_accumulate_cut_among_threads_lands_once_on_every_copy(etcd):
    """Servers of two threads: a replicated accumulate of a whole stripe is
    cut in two on the primary and on the backup it is forwarded to; its
    retry (same client id and sequence) is answered from the duplicate
    table, not added again, and the next one adds once more."""
    c = Cluster(etcd, 3)
    one = c.start_one
    c.start_one = lambda i, **kw: one(i, **thread_options(2), **kw)    # type: ignore[method-assign]
    await c.start()
    try:
        p, segs = await create(c, "cut")
        primary = p.replicas_of(0)[0]
        delta = np.arange(STRIPE // 4, dtype=np.float32)       # integers: exact sums
        raw = await Raw.open(c.addresses[primary])
        for seq in (1, 1, 2):
            st, msg = await raw.op(Op.ACCUMULATE, segs[primary], p.offset_on(primary, 0),
                                   prefix(1, 0xACC, seq) + delta.tobytes(), FLAG_REPLICATED | (1 << DTYPE_SHIFT))
            assert st == 0, msg
        raw.close()
        for copy in await replica_bytes(c, p, segs, 0):
            assert np.array_equal(np.frombuffer(copy, np.float32), 2 * delta)
        # two adds on each copy, each cut among both threads; the retry none
        assert [c.servers[s].accumulates_cut for s in p.replicas_of(0)] == [2, 2]
    finally:
        await c.close()


async def test_a_retry_older_than_its_clients_remembered_ops_is_refused(etcd):
    """A client alone fills the whole table (its share and what the others
    leave): its next op pushes its own oldest out, and a retry of that one is
    refused (CONFLICT, "may have been applied"), not applied."""
    c = await flood_cluster(etcd)
    try:
        p, segs = await create(c, "own")
        primary = p.replicas_of(0)[0]
        word = p.offset_on(primary, 0)
        raw = await Raw.open(c.addresses[primary])
        ops = FLOOD_CLIENTS * DEDUP_PER_CLIENT + 1
        for seq in range(1, ops + 1):
            st, _ = await raw.op(Op.FETCH_ADD, segs[primary], word, prefix(1, 42, seq) + _core.pack_u64(1),
                                 FLAG_REPLICATED)
            assert st == 0
        st, again = await raw.op(Op.FETCH_ADD, segs[primary], word, prefix(1, 42, 2) + _core.pack_u64(1),
                                 FLAG_REPLICATED)
        assert st == 0 and _core.unpack_u64(again) == 1     # still remembered: answered, not applied
        st, msg = await raw.op(Op.FETCH_ADD, segs[primary], word, prefix(1, 42, 1) + _core.pack_u64(1),
                               FLAG_REPLICATED)
        raw.close()
        assert st == ErrorCode.CONFLICT and "not applied again" in msg["message"]
        for copy in await replica_bytes(c, p, segs, 0):
            assert _core.unpack_u64(copy[:8]) == ops
    finally:
        await c.close()


def test_a_busy_client_uses_the_room_others_leave_but_never_their_share():
    d = Dedup(clients=4, per_client=2, idle=600.0)
    a = d.record(1, now=0.0)
    for seq in range(1, 7):
        d.put(a, seq, Entry(b""))            # 6: over its share of 2, while the table (8) has room
    others = [d.record(c, now=1.0) for c in (2, 3, 4)]
    for rec in others:
        d.put(rec, 1, Entry(b""))            # the table is over: the busy client gives up its oldest
    assert list(a.entries) == [2, 3, 4, 5, 6] and a.floor == 1
    for seq in range(2, 6):
        d.put(others[0], seq, Entry(b""))    # client 2 grows: first from the busy client, then itself
    assert len(a.entries) >= 2 and all(len(r.entries) >= 1 for r in others)
    assert d.entries <= 8 and others[0].floor >= 1


def test_a_clients_record_goes_only_after_it_was_idle():
    d = Dedup(clients=2, idle=600.0)
    d.record(1, now=0.0)
    d.record(2, now=10.0)
    with pytest.raises(TooManyClients):
        d.record(3, now=599.0)          # both heard of within 600 s: neither is forgotten
    d.record(3, now=601.0)              # client 1 was silent 601 s: its record goes
    assert sorted(d.records) == [2, 3]
    d.record(4, now=602.0, overfull=True)   # a forwarded op's client: taken over the limit
    assert len(d.records) == 3
