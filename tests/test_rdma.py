"""What only the RDMA transport must show (the soft-RoCE VM tier runs these
with SMB2_TEST_TRANSPORTS=rdma), and how ``auto`` chooses (everywhere)."""

from __future__ import annotations

import asyncio
import logging
import os

import numpy as np
import pytest

import smb2
from smb2 import doctor
from smb2.rdma_device import _verbs
from smb2.transport import rdma_unavailable_reason
from smb2.transport.rdma import RdmaTransport

TRANSPORTS = os.environ.get("SMB2_TEST_TRANSPORTS", "tcp").split(",")
MiB = 1 << 20
REASON = rdma_unavailable_reason()
needs_rdma = pytest.mark.skipif(
    "rdma" not in TRANSPORTS or REASON is not None,
    reason=f"the RDMA tier runs these (SMB2_TEST_TRANSPORTS=rdma on a device); here: {REASON or 'not asked'}")

ONE_SIDED = {"read", "write", "fetch_add", "compare_swap"}


@needs_rdma
async def test_64_mib_over_two_servers_is_one_sided() -> None:
    async with smb2.LocalCluster(servers=2, capacity="64MiB") as cluster:
        client = await cluster.connect(transport="rdma")
        assert client.transports == ["rdma", "rdma"]
        buf = await client.create("big", 64 * MiB, stripe=MiB)
        src = np.random.default_rng(7).integers(0, 256, buf.nbytes, dtype=np.uint8)
        with client.register(src):
            await buf.write(0, src)                 # zero copy, from registered memory
        out = np.zeros_like(src)
        await buf.read_into(out, 0)                 # through the bounce pool
        assert np.array_equal(out, src)
        reg = np.zeros(4 * MiB, dtype=np.uint8)
        with client.register(reg):
            await buf.read_into(reg, 30 * MiB)      # zero copy, into registered memory
        assert np.array_equal(reg, src[30 * MiB:34 * MiB])
        await buf.write(0, np.zeros(8, dtype=np.uint8))
        olds = await asyncio.gather(*(buf.fetch_add(0, 1) for _ in range(64)))
        assert sorted(olds) == list(range(64))
        assert await buf.compare_swap(0, 64, -1) == 64
        stats = await client.stat()
        for s in stats:
            handled = {op for per in s["ops"].values() for op, n in per.items() if n}
            assert not handled & ONE_SIDED, s["ops"]
            assert "rdma" in s["transports"]
        # whereas accumulate is server-assisted, and counted as such
        await buf.accumulate(0, np.ones(4, dtype=np.int64))
        stats = await client.stat()
        assert sum(s["ops"].get("rdma", {}).get("accumulate", 0) for s in stats) == 1


@needs_rdma
async def test_killed_server_gives_a_transport_error_not_a_hang() -> None:
    async with smb2.LocalCluster(servers=2, processes=True, capacity="64MiB") as cluster:
        client = await cluster.connect(transport="rdma")
        assert client.transports == ["rdma", "rdma"]
        buf = await client.create("dies", 4 * MiB, stripe=MiB)
        await buf.write(0, b"x" * buf.nbytes)
        await cluster.kill(1)
        # an error, not a hang: wait_for's TimeoutError would fail the test (about a second on real
        # hardware; how long under TCG is the machine's load, so no bound on it is asserted)
        with pytest.raises(smb2.TransportError):
            await asyncio.wait_for(buf.read(0, buf.nbytes), 60)
        await cluster.restart(1)
        # a new queue pair on the next use; the restarted server lost its memory
        with pytest.raises(smb2.NoSuchBuffer):
            await buf.read(0, buf.nbytes)
        assert client.transports == ["rdma", "rdma"]


@needs_rdma
async def test_mr_without_remote_write_gives_a_clear_error() -> None:
    assert _verbs is not None
    async with smb2.LocalCluster(servers=1) as cluster:
        rdma = cluster.servers[0].rdma
        assert rdma is not None
        rdma.segment_access = (_verbs.ACCESS_LOCAL_WRITE | _verbs.ACCESS_REMOTE_READ |
                               _verbs.ACCESS_REMOTE_ATOMIC)
        client = await cluster.connect(transport="rdma")
        buf = await client.create("readonly", 4096)
        with pytest.raises(smb2.TransportError, match="remote access error") as info:
            await buf.write(0, b"nope")
        assert info.value.status == 10                # IBV_WC_REM_ACCESS_ERR
        assert "does not allow" in str(info.value)
        # the queue pair is recreated on the next use: reads are allowed
        assert bytes(await buf.read(0, 4)) == b"\0" * 4
        assert await buf.fetch_add(0, 5) == 0


@needs_rdma
@pytest.mark.server_process_only     # about the servers' registration: one client loop is enough
async def test_a_replicated_buffer_is_registered_without_remote_write_or_atomics() -> None:
    """A replicated buffer's copies change only through its primary: a
    client of its own that RDMA-writes or does a one-sided atomic on one copy
    gets a remote access error from the NIC, and the copies stay as written;
    RDMA READs of it work."""
    from smb2.testing.etcd import etcd_binary
    try:
        etcd_binary()
    except Exception:
        # the soft-RoCE VM's image carries etcd-server (tools/rxe_vm.sh)
        pytest.skip("needs etcd (tools/host_deps.sh installs etcd-server)")
    async with smb2.LocalCluster(servers=2, replicated=True, capacity="64MiB") as cluster:
        client = await cluster.connect(transport="rdma")
        buf = await client.create("copies", 2 * MiB, stripe=MiB, replicas=2)
        await buf.write(0, np.ones(buf.nbytes, np.uint8))         # through the primaries
        assert (await buf.read(0, buf.nbytes) == 1).all()           # RDMA READs
        t = client.links[0].open
        seg = buf.segments[0]
        with pytest.raises(smb2.TransportError, match="remote access error"):
            await t.write([memoryview(b"one copy")], seg, 0, 8)
        with pytest.raises(smb2.TransportError, match="remote access error"):
            await t.fetch_add(seg, 0, 1)
        assert (await buf.read(0, buf.nbytes) == 1).all()
        for server in cluster.servers:
            assert server.rdma is not None
            assert server.rdma.access_of(server.by_name["copies"]) == server.rdma.replica_access


@needs_rdma
@pytest.mark.parametrize("poll", ["event", "busy"])
async def test_poll_modes(poll: str) -> None:
    async with smb2.LocalCluster(servers=2) as cluster:
        client = await cluster.connect(transport="rdma", poll=poll)
        buf = await client.create("poll", 3 * MiB + 5, stripe=64 << 10)
        data = np.random.default_rng(3).integers(0, 256, buf.nbytes, dtype=np.uint8)
        await buf.write(0, data)
        assert np.array_equal(await buf.read(0, buf.nbytes), data)
        assert await buf.fetch_add(8, 3) == int(data[8:16].view(np.int64)[0])


@needs_rdma
async def test_an_operation_whose_completion_event_never_comes_is_found_by_the_sweep() -> None:
    # the completion channel's events are taken away (as if the device lost them): the operations
    # still finish, found by the transport's periodic drain of the CQ, and none hangs
    async with smb2.LocalCluster(servers=1) as cluster:
        client = await cluster.connect(transport="rdma")
        buf = await client.create("sweep", MiB)
        await buf.write(0, b"\x05" * buf.nbytes)
        tr = client.links[0].transport
        assert isinstance(tr, RdmaTransport)
        asyncio.get_running_loop().remove_reader(tr._cq.fd)
        assert (await asyncio.wait_for(buf.read(0, buf.nbytes), 60) == 5).all()
        assert await asyncio.wait_for(buf.fetch_add(0, 1), 60) == 0x0505050505050505
        assert tr.swept >= 2


@needs_rdma
async def test_cancelled_reads_do_not_break_the_transport() -> None:
    async with smb2.LocalCluster(servers=1) as cluster:
        client = await cluster.connect(transport="rdma")
        buf = await client.create("cancel", 4 * MiB)
        await buf.write(0, b"\x07" * buf.nbytes)
        tasks = [asyncio.ensure_future(buf.read(0, buf.nbytes)) for _ in range(6)]
        await asyncio.sleep(0)
        for t in tasks[::2]:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # every bounce chunk comes back once the NIC is done with it
        for _ in range(3):
            assert (await buf.read(0, buf.nbytes) == 7).all()


@needs_rdma
async def test_auto_picks_rdma_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="smb2.transport")
    # shm off: on the server's own host auto would prefer shm
    server = await smb2.start_server("127.0.0.1", 0, shm="off")
    tcp_only = await smb2.start_server("127.0.0.1", 0, rdma="off", shm="off")
    try:
        client = await smb2.connect([server.address])
        assert client.transports == ["rdma"]
        await client.close()
        c2 = await smb2.connect([tcp_only.address])
        assert c2.transports == ["tcp"]
        await c2.close()
    finally:
        await tcp_only.close()
        await server.close()
    assert any("using rdma" in r.getMessage() and "shm off" in r.getMessage() for r in caplog.records)
    assert any("using tcp" in r.getMessage() and "rdma off" in r.getMessage()
               for r in caplog.records)


@needs_rdma
async def test_rdma_connections_are_capped_and_the_next_is_told_to_use_tcp(
        caplog: pytest.LogCaptureFixture) -> None:
    """Each RDMA connection pins a staging area on the server: past
    --max-rdma-connections a client is refused RDMA (auto takes TCP and says
    why), and a slot frees when its connection closes."""
    caplog.set_level(logging.INFO, logger="smb2.transport")
    server = await smb2.start_server("127.0.0.1", 0, shm="off", max_rdma_connections=1)
    try:
        first = await smb2.connect([server.address], transport="rdma")
        with pytest.raises(smb2.TransportError, match="max-rdma-connections") as info:
            await smb2.connect([server.address], transport="rdma")
        assert info.value.hint is not None and "tcp" in info.value.hint
        assert server.rdma_refused == 1
        second = await smb2.connect([server.address])
        assert second.transports == ["tcp"]
        # said loudly: a WARNING naming the server, the cap and what to raise; counted by the server
        loud = [r for r in caplog.records if r.levelno == logging.WARNING and "using tcp" in r.getMessage()]
        assert len(loud) == 1
        said = loud[0].getMessage()
        assert f"{server.address[0]}:{server.address[1]}" in said and "maximum of 1 RDMA connections" in said
        assert "raise --max-rdma-connections" in said
        stat = server.stat()
        assert stat["rdma_refused"] == 2 and stat["limits"]["max_rdma_connections"] == 1
        # smb2 doctor says it as a problem, with the option to raise
        report = await doctor.diagnose([f"{server.address[0]}:{server.address[1]}"])
        assert any("refused RDMA to 2 clients" in p and "--max-rdma-connections" in p for p in report.problems)
        buf = await second.create("b", 4096)
        await buf.write(0, b"served")
        assert bytes(await buf.read(0, 6)) == b"served"
        await first.close()
        for _ in range(100):            # the server sees the close
            if not server.rdma.peers:
                break
            await asyncio.sleep(0.02)
        third = await smb2.connect([server.address], transport="rdma")
        assert third.transports == ["rdma"]
        await third.close()
        await second.close()
    finally:
        await server.close()


async def _sum_from_each(clients: list[smb2.Client], nbytes: int) -> np.ndarray:
    """Client k adds k + 1 to every int64 of one buffer (at once); the sum read back."""
    bufs = [await clients[0].create("sum", nbytes)] + [await c.attach("sum") for c in clients[1:]]
    ones = np.ones(nbytes // 8, np.int64)
    await asyncio.gather(*(b.accumulate(0, ones * (k + 1)) for k, b in enumerate(bufs)))
    return np.frombuffer(await bufs[-1].read(0, nbytes), np.int64)


@needs_rdma
async def test_more_rdma_peers_than_the_old_cap_of_64_from_one_process() -> None:
    """72 RDMA connections (queue pairs) from this one process to a server
    with the default caps: every one is RDMA, none is sent to TCP, and the
    staged accumulates of all add up exact."""
    peers = 72
    server = await smb2.start_server("127.0.0.1", 0, capacity="16MiB", shm="off")
    clients: list[smb2.Client] = []
    try:
        for _ in range(peers):
            clients.append(await smb2.connect([server.address], transport="auto"))
        assert [c.transports for c in clients] == [["rdma"]] * peers
        stat = server.stat()
        assert stat["rdma_connections"] == peers and stat["rdma_refused"] == 0
        areas = stat["limits"]["rdma_staging_areas"]
        assert stat["rdma_staging_lent"] == min(peers, areas)
        assert stat["rdma_unstaged"] == max(0, peers - areas)
        assert (await _sum_from_each(clients, 64 * 1024) == peers * (peers + 1) // 2).all()
    finally:
        for c in clients:
            await c.close()
        await server.close()


@needs_rdma
async def test_rdma_peers_past_the_staging_pool_accumulate_in_band_exact(
        caplog: pytest.LogCaptureFixture) -> None:
    """A pool of two staging areas and five RDMA peers: two stage their
    deltas, three send them in-band over TCP (each client warns, the server
    counts them); the sum is exact, the pinned staging stays two areas, and
    an area given back is lent to the next peer."""
    caplog.set_level(logging.WARNING, logger="smb2.transport")
    server = await smb2.start_server("127.0.0.1", 0, capacity="16MiB", shm="off", rdma_staging_memory="8MiB")
    clients: list[smb2.Client] = []
    try:
        for _ in range(5):
            clients.append(await smb2.connect([server.address], transport="rdma"))
        assert server.rdma is not None and server.rdma.staging_lent == 2
        assert server.rdma_unstaged == 3
        said = [r.getMessage() for r in caplog.records if "no RDMA staging area free" in r.getMessage()]
        assert len(said) == 3 and all("--rdma-staging-memory" in m for m in said)
        # 3 MiB each: more than one 1 MiB slot, so the staged ones cycle their slots
        assert (await _sum_from_each(clients, 3 << 20) == 15).all()
        assert server.rdma.staging_lent == 2        # still two areas pinned
        await clients.pop(0).close()                # a staged one leaves ...
        for _ in range(100):
            if server.rdma.staging_lent < 2:
                break
            await asyncio.sleep(0.02)
        clients.append(await smb2.connect([server.address], transport="rdma"))
        assert server.rdma.staging_lent == 2 and server.rdma_unstaged == 3      # ... its area is lent again
    finally:
        for c in clients:
            await c.close()
        await server.close()


@needs_rdma
async def test_sparse_pushes_staged_and_in_band_add_up_exact() -> None:
    """A pool of two staging areas and four RDMA peers: two send their
    sparse accumulates through a staging slot (the server copies each out
    before it checks it), two in-band; every peer names the same words,
    each several times, and every add lands once."""
    server = await smb2.start_server("127.0.0.1", 0, capacity="16MiB", shm="off", rdma_staging_memory="8MiB")
    clients: list[smb2.Client] = []
    try:
        for _ in range(4):
            clients.append(await smb2.connect([server.address], transport="rdma"))
        assert server.rdma is not None and server.rdma.staging_lent == 2 and server.rdma_unstaged == 2
        bufs = [await clients[0].create("sparse", 1 << 20)] + [await c.attach("sparse") for c in clients[1:]]
        idx = np.tile(np.arange(0, 1 << 18, 7), 3)             # every 7th word, three times each
        await asyncio.gather(*(b.accumulate_sparse(idx, np.full(idx.size, k + 1, np.float32), wire="bfloat16")
                               for k, b in enumerate(bufs)))
        got = np.frombuffer(await bufs[0].read(0, 1 << 20), np.float32)
        expected = np.zeros(1 << 18, np.float32)
        expected[::7] = 3 * (1 + 2 + 3 + 4)
        assert np.array_equal(got, expected)
    finally:
        for c in clients:
            await c.close()
        await server.close()


@pytest.mark.skipif(REASON is None, reason="this machine has RDMA")
async def test_auto_falls_back_to_tcp_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="smb2.transport")
    # shm off: on the server's own host auto would prefer shm (test_shm.py)
    server = await smb2.start_server("127.0.0.1", 0, shm="off")
    try:
        client = await smb2.connect([server.address])
        assert client.transports == ["tcp"]
        stats = await client.stat()
        assert stats[0]["transports"] == ["tcp"]
        await client.close()
    finally:
        await server.close()
    assert any("using tcp" in r.getMessage() and "no shm: " in r.getMessage() and "shm off" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(smb2.TransportError, match="rdma"):
        await smb2.start_server("127.0.0.1", 0, rdma="on")


async def test_register_is_harmless_without_rdma(cluster: smb2.LocalCluster, transport: str) -> None:
    client = await cluster.connect(transport=transport)
    buf = await client.create("reg", 100000, stripe=4096)
    arr = np.arange(100000, dtype=np.uint8)
    reg = client.register(arr)
    await buf.write(0, arr)
    out = np.zeros_like(arr)
    with client.register(out):
        await buf.read_into(out, 0)
    assert np.array_equal(out, arr)
    reg.close()
    reg.close()
    with pytest.raises(smb2.InvalidArgumentError):
        client.register(b"read-only")


@pytest.mark.skipif(REASON is None, reason="this machine has RDMA")
def test_server_command_with_rdma_on_says_what_is_missing() -> None:
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "smb2.server", "--port", "0", "--rdma", "on"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "rdma=on, but RDMA is not available" in proc.stderr, proc.stderr


@needs_rdma
async def test_nothing_native_leaks() -> None:
    import gc
    assert _verbs is not None
    gc.collect()
    before = _verbs.live_resources()
    async with smb2.LocalCluster(servers=2) as cluster:
        client = await cluster.connect(transport="rdma")
        buf = await client.create("leak", 2 * MiB, stripe=64 << 10)
        arr = np.ones(2 * MiB, dtype=np.uint8)
        with client.register(arr):
            await buf.write(0, arr)
        await buf.accumulate(0, np.ones(16, dtype=np.int64))
        assert await buf.fetch_add(0, 1) == 0x0101010101010102
        during = _verbs.live_resources()
        # per connection: a QP on each side; the client's CQ; segment MRs, staging,
        # bounce and atomic-word MRs
        assert during["qp"] - before["qp"] == 4
        await client.destroy("leak")
        await client.close()
    gc.collect()
    after = _verbs.live_resources()
    assert {k: after[k] for k in ("qp", "mr", "cq")} == {k: before[k] for k in ("qp", "mr", "cq")}


@needs_rdma
async def test_a_dead_queue_pair_surfaces_by_retry_timeout_and_is_recreated() -> None:
    # The server's QP vanishes while its TCP connection stays up: only the
    # RC retry timeout can tell (what a hung or unreachable server looks like).
    async with smb2.LocalCluster(servers=1) as cluster:
        client = await cluster.connect(transport="rdma")
        buf = await client.create("retry", 8192)
        await buf.write(0, b"before")
        for conn in cluster.servers[0].connections:
            if conn.rdma_peer is not None:
                conn.rdma_peer.qp.close()
        # an atomic, not a read: reads are retried once on a fresh connection
        # (test_deadlines), an atomic never is, so its failure is what surfaces
        with pytest.raises(smb2.TransportError) as info:
            await asyncio.wait_for(buf.fetch_add(8, 1), 60)
        # 8 tries of 67 ms: about half a second (TCG and host load stretch it: no bound asserted)
        assert info.value.status == 12, info.value          # IBV_WC_RETRY_EXC_ERR
        assert bytes(await buf.read(0, 6)) == b"before"      # a new QP on the next use
