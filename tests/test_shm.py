"""What only the shm transport must show (the rest of the suite runs over shm
too, see conftest): its one-sided operations cost the servers nothing, it
stays exact beside TCP clients, a dead server is a TransportError, and only
an authenticated client ever gets a segment's file descriptor."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat

import msgpack
import numpy as np
import pytest

import smb2
from smb2.errors import ErrorCode
from smb2.server.shm import MAX_PENDING_PER_OWNER
from smb2.testing import wire
from smb2.testing.waits import until
from smb2.transport import ShmTransport, TcpTransport

MiB = 1 << 20
ONE_SIDED = {"read", "write", "fetch_add", "compare_swap"}
TOKEN = "shm-secret"


async def test_64_mib_striped_over_two_servers_costs_them_no_data_operation() -> None:
    async with smb2.LocalCluster(servers=2, capacity="80MiB") as cluster:
        client = await cluster.connect(transport="shm")
        assert client.transports == ["shm", "shm"]
        buf = await client.create("big", 64 * MiB, stripe=MiB)
        src = np.random.default_rng(15).integers(0, 256, buf.nbytes, dtype=np.uint8)
        await buf.write(0, src)
        out = np.zeros_like(src)
        await buf.read_into(out, 0)
        assert np.array_equal(out, src)
        words = await client.create("words", 2 * 4096, stripe=4096)     # a word on each server
        for off in (0, 4096):
            assert await words.fetch_add(off, 5) == 0
            assert await words.compare_swap(off, 5, 7) == 5
        stats = await client.stat()
        assert {s["address"] for s in stats} == set(cluster.addresses)
        for s in stats:
            for transport, ops in s["ops"].items():
                assert not ONE_SIDED & set(ops), (s["address"], transport, ops)
        # the bytes are in the servers' memory: a TCP client reads them there
        tcp = await cluster.connect(transport="tcp")
        assert np.array_equal(await (await tcp.attach("big")).read(0, buf.nbytes), src)
        assert [await (await tcp.attach("words")).fetch_add(off, 0) for off in (0, 4096)] == [7, 7]


@pytest.mark.parametrize("shm_mode,tcp_mode", [("park", "poll"), ("poll", "park")])
async def test_shm_and_tcp_clients_on_one_lock_and_one_accumulate_range_stay_exact(
        shm_mode: str, tcp_mode: str) -> None:
    rounds = 25
    async with smb2.LocalCluster(servers=2) as cluster:
        clients = [await cluster.connect(transport=t) for t in ("shm", "shm", "tcp", "tcp")]
        assert [c.transports[0] for c in clients] == ["shm", "shm", "tcp", "tcp"]
        buf = await clients[0].create("mixed", 64 * 1024, stripe=4096)
        ones = np.ones(4096, np.float64)          # 32 KiB: stripes on both servers
        modes = [shm_mode, "auto", tcp_mode, "auto"]

        async def worker(c: smb2.Client, mode: str) -> None:
            b = await c.attach("mixed")
            lock = c.lock("mixed", mode=mode)
            for _ in range(rounds):
                async with lock:
                    # a read-modify-write that only the lock makes exact
                    v = int((await b.read(0, 8)).view(np.int64)[0])
                    await asyncio.sleep(0)
                    await b.write(0, np.int64(v + 1).tobytes())
                await b.accumulate(8192, ones)
                await b.fetch_add(4096, 1)

        await asyncio.wait_for(asyncio.gather(*(worker(c, m) for c, m in zip(clients, modes))), 60)
        total = rounds * len(clients)
        assert int((await buf.read(0, 8)).view(np.int64)[0]) == total
        assert await buf.fetch_add(4096, 0) == total
        assert ((await buf.read(8192, ones.nbytes)).view(np.float64) == total).all()
        for c in clients:
            await c.close()


@pytest.mark.timeout(30)
async def test_a_coroutine_polling_over_shm_lets_the_rest_of_the_loop_run() -> None:
    """A shm read finishes without suspending: a loop of them must still let
    the writer it waits for, and the timers, run (else it spins forever)."""
    async with smb2.LocalCluster(servers=1, capacity="16MiB") as cluster:
        poller, writer = await cluster.connect(transport="shm"), await cluster.connect(transport="shm")
        flag = await poller.create("flag", 64)
        late = await writer.attach("flag")

        async def set_flag_later() -> None:
            await asyncio.sleep(0.05)
            await late.write(0, np.array([1], np.uint64))
        setter = asyncio.ensure_future(set_flag_later())
        polls = 0
        while (await flag.read(0, 8)).view(np.uint64)[0] != 1:
            polls += 1
            if setter.done():       # it failed: say how, rather than poll on
                setter.result()
                break
        await setter
        assert (await flag.read(0, 8)).view(np.uint64)[0] == 1
        assert polls > 0
        words = 0
        while not setter.done() or words < 10:
            words += 1
            await flag.fetch_add(8, 1)
        assert await flag.fetch_add(8, 0) == words


@pytest.mark.timeout(120)
async def test_a_sigkilled_server_is_a_transport_error_not_a_crash() -> None:
    async with smb2.LocalCluster(servers=1, processes=True, capacity="64MiB") as cluster:
        client = await cluster.connect(transport="shm")
        buf = await client.create("victim", 4 * MiB)
        await buf.write(0, np.full(buf.nbytes, 3, np.uint8))
        await cluster.kill(0)
        # the client learns of the death from the connection (not a deadline: it
        # set none); until then its mapping stays valid (the pages live as long
        # as it maps them)
        async def death_noticed() -> bool:
            try:
                assert (await buf.read(0, 4096) == 3).all()
            except smb2.TransportError as err:
                assert not isinstance(err, smb2.OperationTimeout), err
                return True
            return False
        await until(death_noticed, "the client noticed the server's death")
        for op in (buf.read(0, 8), buf.write(0, b"12345678"), buf.fetch_add(0, 1)):
            with pytest.raises(smb2.TransportError):
                await op


async def test_only_an_authenticated_client_gets_file_descriptors() -> None:
    server = await smb2.start_server("127.0.0.1", 0, token=TOKEN)
    try:
        assert server.shm is not None
        path = server.shm.path
        # the socket: only this user reaches it
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        reader, writer = await asyncio.open_connection(*server.address)
        writer.write(wire.hello())
        hdr, body = await wire.reply(reader)
        assert hdr[4] == 0 and "ticket" not in msgpack.unpackb(body)
        writer.write(wire.control({"cmd": "shm_grant", "segments": [0]}, rid=2))
        hdr, body = await wire.reply(reader)
        assert (hdr[4], hdr[5]) == (ErrorCode.ACCESS_DENIED, 2)
        writer.close()
        # a guessed ticket gets a refusal and not one fd
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            await asyncio.to_thread(s.connect, path)
            s.sendall(os.urandom(16))
            msg, fds, _, _ = await asyncio.to_thread(socket.recv_fds, s, 4096, 8)
        assert fds == [] and b"unknown or expired ticket" in msg
        assert server.shm.handed_out == 0
        with pytest.raises(smb2.AccessDenied):
            await smb2.connect([server.address], transport="shm", token="wrong")
        assert server.shm.handed_out == 0
        # the token holder maps the lock segment at once, then each buffer
        async with await smb2.connect([server.address], transport="shm", token=TOKEN) as c:
            assert c.transports == ["shm"]
            await (await c.create("b", 4096)).write(0, b"mapped")
        assert server.shm.handed_out == 2
    finally:
        await server.close()
    assert not await asyncio.to_thread(os.path.exists, path)


async def test_shm_never_falls_back_and_says_why(caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.INFO, logger="smb2.transport")
    off = await smb2.start_server("127.0.0.1", 0, shm="off")
    on = await smb2.start_server("127.0.0.1", 0)
    try:
        with pytest.raises(smb2.TransportError, match="shm off"):
            await smb2.connect([off.address], transport="shm")
        async with await smb2.connect([off.address, on.address]) as c:
            assert c.transports == ["tcp", "shm"]          # auto: per server
        assert any("using tcp (no shm: " in r.getMessage() for r in caplog.records)
        assert any("using shm (same host" in r.getMessage() for r in caplog.records)
        # another host: a different kernel boot id (the one condition a single
        # machine cannot produce, so the transport is told a different one)
        monkeypatch.setattr("smb2.transport.shm.boot_id", lambda: "another-host")
        with pytest.raises(smb2.TransportError, match="another host") as info:
            await smb2.connect([on.address], transport="shm")
        assert info.value.hint is not None and "tcp" in info.value.hint
        async with await smb2.connect([on.address]) as c:
            assert c.transports == ["tcp"]
    finally:
        await off.close()
        await on.close()


async def test_the_choice_is_said_again_for_a_new_server_on_the_same_port(
        caplog: pytest.LogCaptureFixture) -> None:
    """Said once per server, not once per address: a server restarted on the
    port of an earlier one (a supervisor's restart) is a new server."""
    caplog.set_level(logging.INFO, logger="smb2.transport")
    first = await smb2.start_server("127.0.0.1", 0)
    port = first.address[1]
    for server in (first, None):
        if server is None:
            server = await smb2.start_server("127.0.0.1", port)
        try:
            for _ in range(2):          # the second connection to one server says nothing
                async with await smb2.connect([server.address]):
                    pass
        finally:
            await server.close()
    said = [r for r in caplog.records if f"127.0.0.1:{port}: using shm" in r.getMessage()]
    assert len(said) == 2


async def test_a_buffer_destroyed_under_a_mapping_frees_nothing_under_it() -> None:
    async with smb2.LocalCluster(servers=1, processes=True, capacity="16MiB") as cluster:
        mapper, other = await cluster.connect(transport="shm"), await cluster.connect(transport="tcp")
        buf = await mapper.create("doomed", 8 * MiB)
        await buf.write(0, np.full(buf.nbytes, 9, np.uint8))
        assert await other.destroy("doomed")
        (st,) = await other.stat()
        assert st["used"] == 0                  # the server gave the segment up...
        # ...and the mapper, whose mapping keeps the pages alive, is told it is gone
        with pytest.raises(smb2.NoSuchBuffer):
            await buf.read(0, 8)
        with pytest.raises(smb2.NoSuchBuffer):
            await buf.write(0, b"late")
        # a buffer of the same name is a new segment, mapped afresh
        again = await other.create("doomed", 8 * MiB)
        await again.write(0, b"fresh")
        assert bytes(await (await mapper.attach("doomed")).read(0, 5)) == b"fresh"


async def test_mappings_of_destroyed_buffers_are_let_go() -> None:
    # a mapping keeps its pages alive: a client that goes through many
    # short-lived buffers must not keep all of their memory
    server = await smb2.start_server("127.0.0.1", 0, capacity="16MiB")
    try:
        async with await smb2.connect([server.address], transport="shm") as c:
            tr = c.links[0].transport
            assert isinstance(tr, smb2.transport.ShmTransport)
            for i in range(20):
                buf = await c.create(f"tmp{i}", 4 * MiB)
                await buf.write(0, b"x")
                await c.destroy(f"tmp{i}")
            assert len(tr.mapped) <= 2, tr.mapped     # the lock segment and the last buffer
    finally:
        await server.close()


async def test_smb2_transport_in_the_environment_picks_the_fabric_of_a_program_that_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a training script connects without choosing; its operator chooses
    server = await smb2.start_server("127.0.0.1", 0, capacity="16MiB")
    try:
        for env, expected in (("tcp", smb2.transport.TcpTransport), ("shm", smb2.transport.ShmTransport),
                              ("", smb2.transport.ShmTransport)):
            monkeypatch.setenv("SMB2_TRANSPORT", env)
            async with await smb2.connect([server.address]) as c:
                assert type(c.links[0].transport) is expected, env
        # an explicit choice wins over the environment
        monkeypatch.setenv("SMB2_TRANSPORT", "shm")
        async with await smb2.connect([server.address], transport="tcp") as c:
            assert type(c.links[0].transport) is smb2.transport.TcpTransport
        monkeypatch.setenv("SMB2_TRANSPORT", "carrier-pigeon")
        with pytest.raises(smb2.InvalidArgumentError, match="SMB2_TRANSPORT must be one of"):
            await smb2.connect([server.address])
    finally:
        await server.close()


@pytest.mark.parametrize("threads", [1, 2])
async def test_accumulates_and_fenced_writes_larger_than_a_frame_are_cut_for_the_connection(threads: int) -> None:
    # shm copies are not cut (one server: one 12 MiB request), but what goes
    # over TCP must fit the connection's frames (each 1 MiB delta the server
    # cuts among its threads, in 256 KiB parts)
    server = await smb2.start_server("127.0.0.1", 0, capacity="64MiB", max_frame="1MiB", threads=threads)
    try:
        async with await smb2.connect([server.address], transport="shm") as c:
            buf = await c.create("big", 12 * MiB, stripe=12 * MiB)
            delta = np.arange(buf.nbytes // 4, dtype=np.float32) % 1000
            await buf.accumulate(0, delta)
            await buf.accumulate(0, delta)
            assert np.array_equal((await buf.read(0, buf.nbytes)).view(np.float32), 2 * delta)
            data = np.random.default_rng(3).integers(0, 256, buf.nbytes, dtype=np.uint8)
            async with buf.lock() as lk:
                await buf.write(0, data, fence=lk)
            assert np.array_equal(await buf.read(0, buf.nbytes), data)
            (st,) = await c.stat()
            # frames of 1 MiB: whole MiB of deltas; a fenced write's data leaves room for its fence
            assert st["ops"]["shm"]["accumulate"] == 2 * 12
            assert st["ops"]["shm"]["write"] == -(-buf.nbytes // (MiB - 16))
            assert st["threads"]["accumulates_cut"] == (2 * 12 if threads > 1 else 0)
    finally:
        await server.close()


async def test_unclaimed_tickets_are_bounded_per_connection_and_cost_other_clients_nothing() -> None:
    """A client that asks for segment hand-outs and never claims them holds
    a few tickets (their fds), not the server's fd table, and other clients
    still get theirs."""
    server = await smb2.start_server("127.0.0.1", 0)
    hoarder = await TcpTransport.connect(server.address)
    try:
        with pytest.raises(smb2.BadRequest, match="twice"):
            await hoarder.control({"cmd": "shm_grant", "segments": [0, 0]})
        for _ in range(MAX_PENDING_PER_OWNER):
            await hoarder.control({"cmd": "shm_grant", "segments": [0]})
        with pytest.raises(smb2.OutOfMemory, match="claim them first"):
            await hoarder.control({"cmd": "shm_grant", "segments": [0]})
        assert server.shm is not None and server.shm.max_pending_fds >= 64
        honest = await ShmTransport.upgrade(await TcpTransport.connect(server.address))
        assert honest.mapped == [0]
        await honest.close()
        async with await smb2.connect([server.address]) as c:
            assert c.transports == ["shm"]
    finally:
        await hoarder.close()
        await server.close()
