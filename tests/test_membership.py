"""The membership view of a replicated cluster, in a private etcd
(smb2.membership, smb2.testing.etcd, LocalCluster(replicated=True))."""

from __future__ import annotations

import asyncio
import os

import pytest

import smb2
from smb2.errors import InvalidArgumentError, MembershipError
from smb2.membership import NO_VIEW, View, open_membership
from smb2.server.cli import main as server_main
from smb2.testing.etcd import LocalEtcd
from smb2.testing.ports import free_port

pytestmark = [pytest.mark.server_process_only,
              pytest.mark.skipif(not any(os.access(os.path.join(d, "etcd"), os.X_OK)
                                         for d in os.environ.get("PATH", "").split(os.pathsep)),
                                 reason="no etcd on PATH (tools/host_deps.sh installs Debian's etcd-server)")]


def _argv(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")


def _exists(path: str) -> bool:
    return os.path.exists(path)


async def test_first_view_then_racing_changes_one_wins() -> None:
    async with LocalEtcd() as etcd:
        url = etcd.url("race")
        async with open_membership(url) as a, open_membership(url) as b:
            assert await a.view() == NO_VIEW
            first = await a.change(NO_VIEW, members=["s0:1", "s1:1", "s2:1"])
            assert first == View(1, ("s0:1", "s1:1", "s2:1"))
            # creating the first view again loses: the key exists now
            assert await b.change(NO_VIEW, members=["x:1"]) == first
            current = first
            for _ in range(10):
                # two clients remove different servers from the same view at once
                got_a, got_b = await asyncio.gather(
                    a.change(current, members=current.members[1:], joining=("a:1",)),
                    b.change(current, members=current.members[:-1], joining=("b:1",)))
                # both see the same view afterwards, of epoch + 1, and it is one of theirs
                assert got_a == got_b == await a.view() == await b.view()
                assert got_a.epoch == current.epoch + 1
                assert got_a.joining in (("a:1",), ("b:1",))
                current = await a.change(got_a, members=first.members)
            assert current.epoch == 21
            # a stale expected view changes nothing
            assert await b.change(first, members=["y:1"]) == current


async def test_etcd_unreachable_is_a_clear_error() -> None:
    port = free_port()
    membership = open_membership(f"etcd://127.0.0.1:{port}/nowhere")
    with pytest.raises(MembershipError) as err:
        await membership.view()
    text = str(err.value)
    assert f"etcd://127.0.0.1:{port}/nowhere" in text and "etcd unreachable" in text
    assert "HINT:" in text and "endpoint health" in text


async def test_second_endpoint_answers_when_the_first_is_down() -> None:
    async with LocalEtcd() as etcd:
        url = f"etcd://127.0.0.1:{free_port()},{etcd.endpoint}/two"
        async with open_membership(url) as m:
            assert (await m.change(NO_VIEW, members=["s:1"])).epoch == 1
            assert (await m.view()).members == ("s:1",)


async def test_view_survives_an_etcd_restart() -> None:
    async with LocalEtcd() as etcd:
        url = etcd.url("durable")
        async with open_membership(url) as m:
            view = await m.change(NO_VIEW, members=["s0:1", "s1:1"], joining=["s2:1"])
            await etcd.stop()
            with pytest.raises(MembershipError):
                await m.view()
            await etcd.start()
            assert await m.view() == view
            assert (await m.change(view, members=view.members)).epoch == 2


@pytest.mark.parametrize("url", ["http://127.0.0.1:2379/c", "etcd://127.0.0.1:2379", "etcd://127.0.0.1/c",
                                 "etcd://127.0.0.1:0/c", "etcd://h:1/a/b"])
def test_bad_membership_url(url: str) -> None:
    with pytest.raises(InvalidArgumentError, match="etcd://127.0.0.1:2379/my-cluster"):
        open_membership(url)


def test_server_refuses_a_bad_membership_url(capsys: pytest.CaptureFixture[str]) -> None:
    assert server_main(["--port", "0", "--membership", "etcd://x/c"]) == 2     # before it listens
    err = capsys.readouterr().err
    assert "membership URL" in err and "etcd://127.0.0.1:2379/my-cluster" in err


async def test_replicated_local_cluster(replicated_cluster: smb2.LocalCluster) -> None:
    cluster = replicated_cluster
    assert cluster.etcd is not None and cluster.membership_url is not None
    async with cluster.membership() as m:
        assert await m.view() == View(1, tuple(cluster.addresses))
    for i in range(cluster.nservers):
        argv = _argv(cluster.pid(i))
        assert argv[argv.index(b"--membership") + 1].decode() == cluster.membership_url
    client = await cluster.connect()
    buf = await client.create("m", 4096)
    await buf.write(0, b"x" * 4096)
    assert bytes(await buf.read(0, 4096)) == b"x" * 4096
    # kill/restart keep the address the view names
    before = list(cluster.addresses)
    await cluster.kill(1)
    await cluster.restart(1)
    assert cluster.addresses == before


async def test_replicated_cluster_stops_its_etcd() -> None:
    cluster = smb2.LocalCluster(servers=1, processes=True, replicated=True)
    await cluster.start()
    etcd = cluster.etcd
    assert etcd is not None and _exists(etcd.data_dir)
    url = cluster.membership_url
    await cluster.close()
    assert not _exists(etcd.data_dir)
    with pytest.raises(MembershipError):
        await open_membership(str(url)).view()
