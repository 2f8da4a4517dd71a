"""Who can change a replicated cluster's view (docs/reliability.md, "Who can
change the view"), against real ``smb2-server`` processes and a real etcd
with its authentication on (``LocalCluster(replicated=True)`` sets it up):

* hello says nothing of the cluster's internals before authentication;
* etcd refuses a view written without the servers' credentials;
* a view written with stolen credentials that would leave stripes without a
  member copy (dropping their servers, or moving them to joining) is refused
  by the servers and written back, and no byte is lost;
* a server restarted from its data directory holding a stripe's last member
  copy is a member again at once when its save ended its last run, and is
  held back, reported by ``smb2 repair``, when it did not;
* a client cannot take out of the view the last copy of a buffer it never
  opened (the servers check every buffer they hold)."""

from __future__ import annotations

import asyncio
import base64
import os
import signal

import msgpack
import numpy as np
import pytest

import smb2
from smb2.membership import View, http_post, open_membership, parse_url
from smb2.protocol import VERSION, Op
from smb2.testing.wire import frame, reply

TOKEN = "view-guard-token"
# generous: the servers read the view every 0.5 s, on a loaded machine
SETTLE = 30.0


@pytest.fixture
async def guarded() -> smb2.LocalCluster:
    async with smb2.LocalCluster(servers=3, processes=True, replicated=True, token=TOKEN) as c:
        yield c


async def _filled(client: smb2.Client, n: int) -> list[tuple[smb2.Buffer, np.ndarray]]:
    """``n`` replicas=2 buffers of 3 stripes or more (every replica group holds some), each with its own bytes."""
    bufs = []
    for k in range(n):
        buf = await client.create(f"g{k}", 3 * 64 << 10, stripe=64 << 10, replicas=2)
        data = np.full(buf.nbytes, k + 1, np.uint8)
        await buf.write(0, data)
        bufs.append((buf, data))
    return bufs


async def _raw_hello(address: str) -> dict:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        msg = {"cmd": "hello", "version": VERSION, "transports": ["tcp"]}
        writer.write(frame(Op.CONTROL, msgpack.packb(msg, use_bin_type=True)))
        _, body = await reply(reader)
        return msgpack.unpackb(body, raw=False)
    finally:
        writer.close()


async def test_hello_names_no_cluster_internals_before_authentication(guarded: smb2.LocalCluster) -> None:
    said = await _raw_hello(guarded.addresses[0])
    assert said.get("auth") == "hmac-sha256"
    for internal in ("membership", "server", "epoch", "zone"):
        assert internal not in said, f"hello told an unauthenticated peer {internal}={said[internal]!r}"
    async with await smb2.connect(guarded.addresses, transport="tcp", token=TOKEN) as client:
        info = client.links[0].transport.server_info
        assert info["membership"] == guarded.membership_url and info["server"] == guarded.addresses[0]


async def test_etcd_refuses_a_view_written_without_credentials(guarded: smb2.LocalCluster) -> None:
    async with await smb2.connect(guarded.addresses, transport="tcp", token=TOKEN) as client:
        bufs = await _filled(client, 4)
        async with guarded.membership() as m:
            before = await m.view()
        (host, port), name = parse_url(guarded.membership_url)[0][0], parse_url(guarded.membership_url)[1]
        forged = View(before.epoch + 1, (guarded.addresses[0],)).to_json()
        key = base64.b64encode(f"smb2/{name}/view".encode()).decode()
        value = base64.b64encode(forged).decode()
        status, said = await http_post(host, port, "/v3/kv/put", {"key": key, "value": value})
        assert status != 200, f"etcd took a view from a writer without credentials: {said}"
        status, _ = await http_post(host, port, "/v3/kv/range", {"key": key})
        assert status != 200, "etcd showed the view to a reader without credentials"
        async with guarded.membership() as m:
            assert await m.view() == before
        for buf, data in bufs:
            assert np.array_equal(await buf.read(0, buf.nbytes), data)


async def test_the_servers_write_back_a_forged_view_and_nothing_is_lost(guarded: smb2.LocalCluster) -> None:
    async with await smb2.connect(guarded.addresses, transport="tcp", token=TOKEN) as client:
        bufs = await _filled(client, 10)
        # a thief of the servers' etcd credentials keeps one server and drops the others
        async with open_membership(guarded.membership_url, guarded.etcd_credentials()) as stolen:
            before = await stolen.view()
            forged = await stolen.change(before, members=[guarded.addresses[0]])
            assert forged.epoch == before.epoch + 1 and forged.members == (guarded.addresses[0],)
        async with guarded.membership() as m:
            for _ in range(int(SETTLE / 0.2)):
                if (now := await m.view()).epoch > forged.epoch:
                    break
                await asyncio.sleep(0.2)
        assert now.epoch == forged.epoch + 1, f"the forged view was not written back: {now}"
        assert set(now.members) == set(before.members) and not now.joining
        stats = await client.stat()
        assert sum(s["replication"]["refused_views"] for s in stats) >= 1
        for buf, data in bufs:
            assert np.array_equal(await buf.read(0, buf.nbytes), data), f"buffer {buf.name} lost bytes"
            await buf.accumulate(0, np.ones(2, np.int32))
            assert np.array_equal((await buf.read(0, 8)).view(np.int32), (data[:8].view(np.int32) + 1))


async def test_a_client_cannot_take_out_the_last_copy_of_a_buffer_it_never_opened(
        guarded: smb2.LocalCluster) -> None:
    a, b, c = guarded.addresses
    async with await smb2.connect(guarded.addresses, transport="tcp", token=TOKEN) as owner:
        [(buf, data)] = await _filled(owner, 1)
        # two other clients, each sure of a failed server, neither knowing buffer g0
        async with await smb2.connect(guarded.addresses, transport="tcp", token=TOKEN) as one, \
                await smb2.connect(guarded.addresses, transport="tcp", token=TOKEN) as two:
            views_one, views_two = await one.views(), await two.views()
            seen = await views_two.current()
            # b is paused while it is out: a running b would ask to join again at once, and on a loaded
            # machine did so between the two clients' calls (the view moved on under the test)
            os.kill(guarded.pid(1), signal.SIGSTOP)
            try:
                first = await views_one.stop_using(b, seen, "a test says so")
                assert b not in first.members
                # the second finds the view changed (the compare-and-set lost), then tries on the new one
                newer = await views_two.stop_using(c, seen, "a test says so too")
                assert newer.epoch == first.epoch and c in newer.members
                with pytest.raises(smb2.TransportError, match="without a member copy") as err:
                    await views_two.stop_using(c, newer, "a test says so too")
                assert "g0" in str(err.value) and err.value.hint
            finally:
                os.kill(guarded.pid(1), signal.SIGCONT)
        async with guarded.membership() as m:
            assert c in (await m.view()).members
        # the server taken out catches up and comes back; the buffer never stopped
        assert np.array_equal(await buf.read(0, buf.nbytes), data)
        await buf.write(0, np.zeros(16, np.uint8))
        assert not (await buf.read(0, 16)).any()


async def test_etcd_setup_turns_on_etcds_authentication(tmp_path, capsys) -> None:
    from smb2 import auth, cli
    from smb2.membership import NO_VIEW, Credentials, answers_without_credentials, etcd_user
    from smb2.testing.etcd import LocalEtcd

    peer, root = tmp_path / "peer", tmp_path / "root"
    peer.write_text("peer-secret\n")
    root.write_text("root-secret\n")
    peer.chmod(0o600)
    root.chmod(0o600)
    async with LocalEtcd() as etcd:
        url = etcd.url("c1")
        assert await answers_without_credentials(url)
        # without the peer token it says what it needs, and changes nothing
        rc = await asyncio.to_thread(cli.main, ["etcd-setup", url, "--root-password-file", str(root)])
        assert rc == 1 and "peer token" in capsys.readouterr().err
        assert await answers_without_credentials(url)
        rc = await asyncio.to_thread(cli.main, ["etcd-setup", url, "--peer-token-file", str(peer),
                                                "--root-password-file", str(root)])
        assert rc == 0 and "authentication on" in capsys.readouterr().out
        assert not await answers_without_credentials(url)
        servers = Credentials(etcd_user("c1"), auth.etcd_password(b"peer-secret", "c1"))
        async with open_membership(url, servers) as m:
            assert (await m.change(NO_VIEW, members=["h:1"])).epoch == 1
        # the user of cluster c1 cannot touch another cluster's view
        async with open_membership(etcd.url("c2"), servers) as other:
            with pytest.raises(smb2.MembershipError, match="refused etcd user smb2-c1"):
                await other.view()


async def _wait(what: str, check, seconds: float = SETTLE):
    """``await check()`` until it returns something true (that value)."""
    for _ in range(int(seconds / 0.2)):
        if said := await check():
            return said
        await asyncio.sleep(0.2)
    raise AssertionError(f"not within {seconds} s: {what}")


async def _replication(address: str) -> dict:
    async with await smb2.connect([address], transport="tcp", token=TOKEN) as one:
        return (await one.stat(timeout=10))[0]["replication"]


async def test_a_forged_view_that_moves_the_copies_to_joining_is_written_back_too(guarded: smb2.LocalCluster) -> None:
    async with await smb2.connect(guarded.addresses, transport="tcp", token=TOKEN) as client:
        bufs = await _filled(client, 6)
        async with open_membership(guarded.membership_url, guarded.etcd_credentials()) as stolen:
            before = await stolen.view()
            forged = await stolen.change(before, members=[guarded.addresses[0]], joining=guarded.addresses[1:])

        async def written_back():
            async with guarded.membership() as m:
                v = await m.view()
            return v if v.epoch > forged.epoch else None
        now = await _wait("the forged view written back", written_back)
        assert set(now.members) == set(before.members) and not now.joining, now
        said = [await _replication(a) for a in guarded.addresses]
        assert sum(s["restored_views"] for s in said) >= 1
        for buf, data in bufs:
            assert np.array_equal(await buf.read(0, buf.nbytes), data), f"buffer {buf.name} lost bytes"


async def test_a_restarted_last_copy_is_a_member_again_after_a_save_and_held_back_after_a_crash(
        tmp_path, capsys, monkeypatch) -> None:
    import signal

    from smb2 import cli

    monkeypatch.setenv("SMB2_AUTH_TOKEN", TOKEN)        # for smb2 repair

    async with smb2.LocalCluster(servers=3, processes=True, replicated=True, data_dir=tmp_path,
                                 token=TOKEN) as cluster:
        addrs = cluster.addresses
        async with await smb2.connect(addrs, transport="tcp", token=TOKEN) as client:
            [(buf, v1)] = await _filled(client, 1)
            p = buf.placement
            first, second = p.replicas_of(0)
            views = await client.views()
            await cluster.kill(second)
            await views.stop_using(addrs[second], await views.current(), "a test killed it")
            # a planned stop and start of the stripe's last member: its save holds all it acknowledged
            await cluster.kill(first, signal.SIGTERM)
            await cluster.restart(first)
            await _wait("the cleanly restarted server a member", lambda: _member(addrs[first]))
            assert np.array_equal(await buf.read(0, buf.nbytes), v1)
            v2 = np.full(buf.nbytes, 200, np.uint8)
            await buf.write(0, v2)
            # a crash: its data directory holds the save from before v2
            await cluster.kill(first)
            await cluster.restart(first)
            said = await _wait("the crashed server's copy reported stuck",
                               lambda: _stuck(addrs[first]))
            assert said[0]["buffer"] == "g0" and "older than its last run" in said[0]["why"]
            others = [a for k, a in enumerate(addrs) if k != second]
            rc = await asyncio.to_thread(cli.main, ["repair", *others])
            out = capsys.readouterr().out
            assert rc == 1 and "'g0'" in out and "older than its last run" in out, out
            # the operator's word cannot serve it here: the server also holds stripes the live
            # third server has newer copies of, and says so instead of serving them stale
            rc = await asyncio.to_thread(cli.main, ["repair", "--accept", addrs[first]])
            assert rc == 0

            async def refused():
                stuck = await _stuck(addrs[first])
                return stuck if stuck and "not built" in stuck[0]["why"] else None
            said = await _wait("the accept refused, with why", refused)
            assert "--data-dir" in said[0]["why"]
            async with cluster.membership() as m:
                assert addrs[first] in (await m.view()).members


async def _member(address: str) -> bool:
    return (await _replication(address))["state"] == "member"


async def _stuck(address: str) -> list:
    return (await _replication(address))["stuck"]
