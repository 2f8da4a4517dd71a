"""A buffer that lost a part is never handed out as zeros: every
part carries the buffer's identity, ``create``/``attach`` on a buffer with a
part missing or foreign raise :class:`BufferDamaged` (servers, byte ranges),
a parameter store refuses to resume one (naming its tensors), a data
directory keeps the identity, and ``smb2 ls`` / ``smb2 rm`` show and handle
damage, live stores and a server that is down.  Real smb2-server processes,
killed and restarted."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

import smb2
from smb2 import _core, cli
from smb2.parts import damaged
from smb2.testing.proxy import FaultProxy
from smb2.testing.waits import until
from smb2.train.store import PREAMBLE, ParameterStore

MiB = 1 << 20
pytestmark = pytest.mark.server_process_only


def _lost_ranges(name: str, nbytes: int, stripe: int, part: int, nservers: int = 2) -> list[tuple[int, int]]:
    """The byte ranges of ``name`` that live on ``part`` (computed here from
    the striping rule, not by the code under test)."""
    first = _core.name_hash(name) % nservers
    return [(k * stripe, min(nbytes, (k + 1) * stripe)) for k in range(-(-nbytes // stripe))
            if (first + k) % nservers == part]


async def _restart_empty(cluster: smb2.LocalCluster, index: int) -> None:
    await cluster.kill(index, signal.SIGKILL)
    await cluster.restart(index)


async def test_a_restarted_server_makes_the_buffer_damaged_not_zeros() -> None:
    async with smb2.LocalCluster(servers=2, processes=True, capacity="16MiB") as cluster:
        a = await cluster.connect(timeout=5)
        nbytes, stripe = 4 * MiB + 100, MiB
        buf = await a.create("dmg", nbytes, stripe=stripe)
        data = np.random.default_rng(1).integers(1, 255, nbytes, dtype=np.uint8)
        await buf.write(0, data)
        await _restart_empty(cluster, 1)
        b = await cluster.connect(timeout=5)
        lost = _lost_ranges("dmg", nbytes, stripe, 1)
        for attempt in (b.create("dmg", nbytes, stripe=stripe), b.attach("dmg")):
            with pytest.raises(smb2.BufferDamaged) as err:
                await attempt
            e = err.value
            assert e.name == "dmg" and e.servers == [cluster.addresses[1]] and e.parts == [1]
            assert list(e.ranges()) == lost and e.lost_bytes == sum(hi - lo for lo, hi in lost)
            assert f"part 1 on server {cluster.addresses[1]} is missing" in e.message
            assert f"bytes {lost[0][0]}-{lost[0][1]}" in e.message
            assert "--data-dir" in (e.hint or "") and "recreate_lost=True" in (e.hint or "")
            assert isinstance(e, smb2.Smb2Error) and not isinstance(e, smb2.NoSuchBuffer)
        # what remains can be read; a lost range is refused, never zeros
        keep = _lost_ranges("dmg", nbytes, stripe, 0)[0]
        assert np.array_equal(await e.remains.read(keep[0], keep[1] - keep[0]), data[keep[0]:keep[1]])
        with pytest.raises(smb2.NoSuchBuffer):
            await e.remains.read(lost[0][0], 8)
        # the refused create left nothing behind on the empty server
        assert "dmg" not in (await b.stat())[1]["buffers"]
        # asked explicitly: the lost part comes back as zeros, the rest is kept
        again = await b.create("dmg", nbytes, stripe=stripe, recreate_lost=True)
        got = await again.read(0, nbytes)
        expect = data.copy()
        for lo, hi in lost:
            expect[lo:hi] = 0
        assert np.array_equal(got, expect) and again.buffer_id == buf.buffer_id
        assert (await b.attach("dmg")).buffer_id == buf.buffer_id       # whole again

        # part 0 (made first, sealed last) lost: named the same way
        await _restart_empty(cluster, 0)
        c = await cluster.connect(timeout=5)
        with pytest.raises(smb2.BufferDamaged) as err:
            await c.create("dmg", nbytes, stripe=stripe)
        assert err.value.servers == [cluster.addresses[0]]
        assert list(err.value.ranges()) == _lost_ranges("dmg", nbytes, stripe, 0)
        assert "dmg" not in (await c.stat())[0]["buffers"]
        with pytest.raises(smb2.BufferDamaged):
            await c.attach("dmg")
        # a fresh create elsewhere is unaffected (two parts, both new)
        fresh = await c.create("dmg-new", 1000, stripe=64)
        assert fresh.buffer_id is not None and (await c.attach("dmg-new")).buffer_id == fresh.buffer_id


async def test_a_data_dir_restart_keeps_the_identity(tmp_path: Path) -> None:
    async with smb2.LocalCluster(servers=2, processes=True, capacity="16MiB", data_dir=tmp_path) as cluster:
        a = await cluster.connect(timeout=5)
        buf = await a.create("kept", 2 * MiB, stripe=MiB)
        await buf.write(0, b"\x5a" * buf.nbytes)
        await cluster.kill(1, signal.SIGTERM)       # a planned stop: saved
        await cluster.restart(1)
        b = await cluster.connect(timeout=5)
        again = await b.create("kept", 2 * MiB, stripe=MiB)
        assert again.buffer_id == buf.buffer_id
        assert np.all(await again.read(0, again.nbytes) == 0x5A)
        assert np.all(await buf.read(0, buf.nbytes) == 0x5A)       # the old handle goes on too
        manifest = json.loads((tmp_path / "server-1" / "manifest.json").read_text())
        assert [e["buffer_id"] for e in manifest["segments"]] == [buf.buffer_id]


def _model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"conv.weight": rng.standard_normal((256, 64)).astype(np.float32),
            "fc.bias": rng.standard_normal(64).astype(np.float32)}


async def test_a_damaged_store_is_not_resumed(caplog: pytest.LogCaptureFixture) -> None:
    # two stores: byte 0 (the header) of one on server 0, of the other on server 1
    name = {h: next(f"st-dmg{i}" for i in range(100) if _core.name_hash(f"st-dmg{i}") % 2 == h) for h in (0, 1)}
    async with smb2.LocalCluster(servers=2, processes=True, capacity="16MiB") as cluster:
        client = await cluster.connect(timeout=5)
        for n in name.values():
            store = await ParameterStore.open(client, n, _model(), workers=1, rank=0, timeout=10)
            await store.join(timeout=5)
            await store.push({k: np.ones_like(v) for k, v in _model().items()})
            await store.heartbeat(1, force=True)
        await _restart_empty(cluster, 1)
        c2 = await cluster.connect(timeout=5)
        # the store whose header (and version word) survived: its run state
        # (on the next stripe, another server's) and half of conv.weight were there
        with pytest.raises(smb2.BufferDamaged) as err:
            await ParameterStore.open(c2, name[0], _model(), workers=1, rank=0, timeout=5)
        msg = err.value.message
        assert msg.startswith(f"store {name[0]!r} is damaged: its part on server {cluster.addresses[1]} is gone")
        assert "so the store's run state (its runs and steps), conv.weight (50 %) are lost; it was at version 1; " \
               "resuming would train from zeros there" in msg and "header" not in msg
        assert "init_from=" in (err.value.hint or "") and "resume=False" in (err.value.hint or "")
        assert name[0] in await c2.buffers()       # nothing was removed or made
        # another rank waits for rank 0 (which may be making it anew), then says the same
        with pytest.raises(smb2.BufferDamaged, match=f"store {name[0]!r} is damaged: its part on server"):
            await ParameterStore.open(c2, name[0], _model(), workers=2, rank=1, timeout=0.3)
        with pytest.raises(smb2.BufferDamaged, match=f"store {name[0]!r} is damaged"):
            await ParameterStore.attach(c2, name[0], timeout=5)
        # the store whose header was lost: an error too, not a fresh start
        with pytest.raises(smb2.BufferDamaged) as err:
            await ParameterStore.open(c2, name[1], _model(), workers=1, rank=0, timeout=5)
        assert "so the store's header (its layout and version), conv.weight (50 %), fc.bias (100 %) are lost; " \
               "resuming" in err.value.message
        # resume=False is an explicit start over: the store is made anew
        with caplog.at_level(logging.WARNING, logger="smb2.train"):
            fresh = await ParameterStore.open(c2, name[1], _model(), workers=1, rank=0, timeout=5,
                                              resume=False)
        assert "is damaged" in caplog.text and "made anew" in caplog.text
        assert fresh.generation == 1 and not fresh.resumed
        await fresh.pull()
        assert np.array_equal(fresh.params["conv.weight"], _model()["conv.weight"])


# -- str() and the CLI ------------------------------------------------------------------------

def test_str_of_an_error_shows_its_hint() -> None:
    err = smb2.InvalidArgumentError("bad size", detail="asked 0", hint="pass a positive size")
    assert str(err) == "bad size\nDETAIL: asked 0\nHINT: pass a positive size"
    assert err.message == "bad size" and err.args == ("bad size",)
    assert str(smb2.NoSuchBuffer("gone")) == "gone"


async def test_a_closed_client_says_what_to_do(cluster: smb2.LocalCluster) -> None:
    client = await cluster.connect()
    await client.close()
    with pytest.raises(smb2.InterfaceError) as err:
        await client.create("x", 64)
    assert str(err.value) == "the client is closed\nHINT: connect again with smb2.connect(...)"


async def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``smb2 ARGS`` as a process (what a user runs: the entry point, the
    environment, no traceback)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "smb2.cli", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "SMB2_SERVERS": "", **(env or {})})
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def _cli_here(*args: str) -> tuple[int, str, str]:
    """``smb2 ARGS`` in a thread of this process (the same ``main``, without
    a Python start each time); servers given with ``--servers``."""
    def run() -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(list(args))
        return rc, out.getvalue(), err.getvalue()
    return await asyncio.to_thread(run)


async def test_smb2_rm_refuses_a_live_store_and_takes_several_names(cluster: smb2.LocalCluster) -> None:
    client = await cluster.connect()
    servers = ",".join(cluster.addresses)
    store = await ParameterStore.open(client, "rm-live", _model(), workers=1, rank=0, timeout=10)
    await store.join(timeout=5)
    await store.heartbeat(3, force=True)
    rc, out, err = await _cli("rm", "rm-live", "--servers", servers)
    assert rc == 1 and out == "" and "Traceback" not in err
    assert err.startswith("smb2 rm: store 'rm-live' is in use: run 1 has not finished")
    assert err.splitlines()[-1] == "HINT: stop the job first, or remove the store anyway with " \
                                   "`smb2 rm --force rm-live`"
    assert "rm-live" in await client.buffers()
    rc, out, err = await _cli("rm", "--force", "rm-live", env={"SMB2_SERVERS": servers})
    assert rc == 0 and out == "removed rm-live\n"
    # several names at once; a server address among them is a name, and the hint says so
    await client.create("rm-a", 64)
    await client.create("rm-b", 64)
    rc, out, err = await _cli_here("rm", "rm-a", "rm-b", "-s", servers)
    assert rc == 0 and out.splitlines() == ["removed rm-a", "removed rm-b"]
    assert not {"rm-a", "rm-b"} & set(await client.buffers())
    await client.create("rm-c", 64)
    rc, out, err = await _cli_here("rm", "rm-c", cluster.addresses[0], "-s", servers)
    assert rc == 1 and out == "removed rm-c\n"
    assert err.startswith(f"smb2 rm: no buffer '{cluster.addresses[0]}'")
    assert "servers are given with --servers or SMB2_SERVERS, not after the names" in err


async def test_smb2_ls_with_a_server_down_and_with_damage() -> None:
    async with smb2.LocalCluster(servers=2, processes=True, capacity="16MiB") as cluster:
        client = await cluster.connect(timeout=5)
        await client.create("ls-raw", 3 * MiB, stripe=MiB)
        store = await ParameterStore.open(client, "ls-store", _model(), workers=1, rank=0, timeout=10)
        await store.finish()
        await cluster.kill(1, signal.SIGKILL)
        rc, out, err = await _cli("ls", *cluster.addresses, "--connect-timeout", "3")
        assert rc == 1 and "Traceback" not in err
        assert f"server {cluster.addresses[1]} is unreachable" in err
        rows = {ln.split()[0]: ln for ln in out.splitlines()[1:]}
        # (the store's counts board beside it: rank 0 makes it as its run opens)
        assert set(rows) == {"ls-raw", "ls-store", "ls-store/counts"}
        assert f"unknown: server {cluster.addresses[1]} unreachable (parts seen: 1 of 2)" in rows["ls-raw"]
        assert rows["ls-raw"].split()[1:3] == [str(3 * MiB), str(MiB)]
        # back, but empty: both are shown damaged
        await cluster.restart(1)
        rc, out, err = await _cli_here("ls", "--json", "-s", ",".join(cluster.addresses))
        assert rc == 0, err
        rows = {r["name"]: r for r in json.loads(out)}
        assert f"part 1 on server {cluster.addresses[1]} is missing" in rows["ls-raw"]["damaged"]
        assert rows["ls-store"]["lost_on"] == [cluster.addresses[1]]
        rc, out, err = await _cli_here("ls", *cluster.addresses)
        assert all("DAMAGED: buffer" in ln for ln in out.splitlines()[1:]), out


async def test_smb2_ls_lists_the_rest_when_a_store_table_is_corrupt(cluster: smb2.LocalCluster) -> None:
    client = await cluster.connect()
    store = await ParameterStore.open(client, "ls-corrupt", _model(), workers=1, rank=0, timeout=10)
    await store.finish()
    await ParameterStore.open(client, "ls-healthy", _model(), workers=1, rank=0, timeout=10)
    await store.buf.write(PREAMBLE, b"\xc1" * 32)        # 0xc1: never valid msgpack
    rc, out, err = await _cli_here("ls", *cluster.addresses)
    assert rc == 0 and "Traceback" not in err, err
    rows = {ln.split()[0]: ln for ln in out.splitlines()[1:]}
    assert "DAMAGED: store 'ls-corrupt' is damaged: its layout table is unreadable" in rows["ls-corrupt"]
    assert "parameter store: 2 tensors" in rows["ls-healthy"]


@pytest.mark.parametrize("word", ["table length", "control area"])
async def test_smb2_ls_lists_the_rest_when_a_store_header_word_is_garbage(cluster: smb2.LocalCluster,
                                                                          word: str) -> None:
    """A header word that says where the table ends, or where the control
    words are, holding garbage (2^40): the store is reported damaged, the
    healthy one listed, and nothing of that size is read."""
    client = await cluster.connect()
    store = await ParameterStore.open(client, "ls-garbage", _model(), workers=1, rank=0, timeout=10)
    await store.finish()
    await ParameterStore.open(client, "ls-fine", _model(), workers=1, rank=0, timeout=10)
    # the preamble's words (smb2.train.store's docstring): 3 is the table's
    # bytes, 7 the control words'
    at = {"table length": 3 * 8, "control area": 7 * 8}[word]
    await store.buf.write(at, np.array([1 << 40], np.int64))
    rc, out, err = await _cli_here("ls", *cluster.addresses)
    assert rc == 0 and "Traceback" not in err, err
    rows = {ln.split()[0]: ln for ln in out.splitlines()[1:]}
    assert "DAMAGED: store 'ls-garbage' is damaged: its header" in rows["ls-garbage"], out
    assert "parameter store: 2 tensors" in rows["ls-fine"]


async def _requests(client: smb2.Client) -> int:
    """Control commands and data operations the servers answered so far."""
    return sum(sum(st.get("controls", {}).values()) + sum(sum(ops.values()) for ops in st["ops"].values())
               for st in await client.stat())


async def test_smb2_ls_asks_each_server_a_few_times_whatever_the_number_of_buffers(
        cluster: smb2.LocalCluster) -> None:
    """200 plain buffers and 2 stores on 4 servers: the listing's requests
    grow with the servers and the stores, not the buffers (each buffer
    described one by one took one lookup per server and a read: 1,000 here)."""
    client = await cluster.connect()
    plain = 200
    await asyncio.gather(*(client.create(f"plain-{i:03}", 4096 + 8 * i, stripe=1024) for i in range(plain)))
    for name in ("store-a", "store-b"):
        await ParameterStore.open(client, name, _model(), workers=1, rank=0, timeout=10)
    before = await _requests(client)
    rc, out, err = await _cli_here("ls", "--json", *cluster.addresses)
    asked = await _requests(client) - before
    assert rc == 0, err
    rows = {r["name"]: r for r in json.loads(out)}
    assert len(rows) == plain + 2 * 2          # each store and its counts board
    assert rows["plain-007"] == {"name": "plain-007", "bytes": 4096 + 56, "stripe": 1024, "store": False,
                                 "replicas": 1}
    assert rows["store-a"]["store"] and rows["store-b"]["tensors"] == 2
    servers = len(cluster.addresses)
    # per server: hello, stat, peek, and our own stat; per store: its description (lookups, reads)
    assert asked <= 6 * servers + 2 * 8 * servers, asked


async def test_clients_creating_one_buffer_at_once_agree(cluster: smb2.LocalCluster) -> None:
    """Part 0 is made first and its identity taken by every creator, so a
    race of creators is never mistaken for damage."""
    clients = [await cluster.connect() for _ in range(6)]
    for round_ in range(5):
        name = f"race-{round_}"
        # creators, and readers attaching while it is being made
        got = await asyncio.gather(*(c.create(name, 5000, stripe=64) for c in clients[:4]),
                                   *(c.attach(name) for c in clients[4:] for _ in range(3)),
                                   return_exceptions=True)
        bufs = [b for b in got if isinstance(b, smb2.Buffer)]
        assert len(bufs) >= 4 and len({b.buffer_id for b in bufs}) == 1
        # a reader too early finds no buffer, never a damaged one
        assert all(isinstance(e, smb2.NoSuchBuffer) for e in got if not isinstance(e, smb2.Buffer))
        assert (await clients[0].stat())[0]["buffers"][name]["sealed"]


@pytest.mark.parametrize("late", [1, 0], ids=["part 1 seen late", "part 0 seen late"])
async def test_a_reader_that_looked_while_the_buffer_was_made_finds_it_not_damaged(late: int) -> None:
    """attach asks every server at once, and they answer at different
    moments.  The reader's ask of server ``late`` waits in a proxy until a
    creator made the buffer (part 0, part 1, part 0 sealed), the other server
    having answered before: it saw no part 0 and then part 1, or no part 1
    and then part 0 sealed.  That is a buffer made meanwhile, not one that
    lost a part: a loaded machine's training job once failed so on a side
    buffer its ranks made and attached at once."""
    async with smb2.LocalCluster(servers=2, processes=True, capacity="16MiB") as cluster:
        with FaultProxy(cluster.addresses[0]) as to0, FaultProxy(cluster.addresses[1]) as to1:
            held, early = (to1, to0) if late == 1 else (to0, to1)
            reader = await smb2.connect([to0.address, to1.address], timeout=10, transport="tcp")
            creator = await cluster.connect(timeout=5)
            answered = early.bytes_down
            held.hold()
            looking = asyncio.ensure_future(reader.attach("made-meanwhile"))
            await until(lambda: held.held > 0 and early.bytes_down > answered, "one answer in, the other ask held")
            made = await creator.create("made-meanwhile", 5000, stripe=64)
            held.release()
            got = await asyncio.wait_for(looking, 30)       # (a hang guard)
            assert got.buffer_id == made.buffer_id and got.nbytes == 5000
            await reader.close()
            await creator.close()


async def test_async_optimizer_refuses_a_damaged_store() -> None:
    torch = pytest.importorskip("torch")
    import smb2.torch as st
    name = next(f"opt-dmg{i}" for i in range(100) if _core.name_hash(f"opt-dmg{i}") % 2 == 0)

    def run(servers: str) -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 4))
        # rule delta: its step's push makes the store's version 1, which the report gives
        with st.AsyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, name=name,
                               servers=servers, rank=0, world_size=1, timeout=10, rule="delta") as opt:
            model(torch.ones(2, 64)).sum().backward()
            opt.step()

    async with smb2.LocalCluster(servers=2, processes=True, capacity="16MiB") as cluster:
        servers = ",".join(cluster.addresses)
        await asyncio.to_thread(run, servers)
        await _restart_empty(cluster, 1)         # the header (byte 0) was on server 0
        with pytest.raises(smb2.BufferDamaged) as err:
            await asyncio.to_thread(run, servers)
        msg = err.value.message
        assert msg.startswith(f"store {name!r} is damaged: its part on server {cluster.addresses[1]} is gone")
        assert "the store's run state (its runs and steps), 0.weight (56 %) are lost; it was at version 1" in msg, msg


def test_a_damage_report_names_figures_also_for_a_part_that_held_nothing() -> None:
    """A buffer smaller than one stripe lives on one server: losing the other
    server's part loses no data, and the report says so in words (not
    "bytes  of it are lost (0 of 224 bytes)")."""
    messages = [damaged("side", {k: "missing"}, ["a:1", "b:2"], 224, 4096).message for k in (0, 1)]
    for m in messages:
        assert "bytes  " not in m and " 0 of " not in m, m
    assert sorted("so no data is lost" in m for m in messages) == [False, True], messages
    assert sum("of it are lost (224 of 224 bytes)" in m for m in messages) == 1, messages
    assert any("which held none of its 224 bytes" in m for m in messages), messages
