"""Authentication: HMAC-SHA256 challenge–response at hello, the gate that
refuses everything else before it, and the smb2-server options."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgpack
import pytest

import smb2
from smb2 import _core, auth
from smb2.errors import ErrorCode
from smb2.protocol import FLAG_REPLY, VERSION, Op
from smb2.testing import wire
from smb2.testing.launch import ServerProcess

TOKEN = b"correct horse battery staple"


async def _reply(reader: asyncio.StreamReader) -> tuple[tuple[int, ...], dict]:
    hdr, body = await wire.reply(reader)
    return hdr, (msgpack.unpackb(body) if body else {})


@pytest.fixture
async def server() -> AsyncIterator[smb2.Server]:
    s = await smb2.start_server("127.0.0.1", 0, capacity="16MiB", token=TOKEN)
    yield s
    await s.close()


async def test_right_token_works_and_wrong_or_missing_is_denied(
        server: smb2.Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.ENV, raising=False)
    async with await smb2.connect([server.address], token=TOKEN.decode()) as c:
        buf = await c.create("secret", 4096)
        await buf.write(0, b"mine")
    with pytest.raises(smb2.AccessDenied, match="requires authentication"):
        await smb2.connect([server.address])
    with pytest.raises(smb2.AccessDenied, match="wrong token"):
        await smb2.connect([server.address], token="guess")
    assert server.auth_failures == 1
    # the environment variable is the default
    monkeypatch.setenv(auth.ENV, TOKEN.decode() + "\n")
    async with await smb2.connect([server.address]) as c:
        assert bytes(await (await c.attach("secret")).read(0, 4)) == b"mine"
        assert (await c.stat())[0]["auth"] == auth.MECH


async def test_a_token_client_talks_to_an_open_server() -> None:
    s = await smb2.start_server("127.0.0.1", 0, capacity="1MiB")
    try:
        async with await smb2.connect([s.address], token=TOKEN) as c:
            assert await c.buffers() == []
    finally:
        await s.close()


async def test_everything_but_hello_and_auth_is_refused_before_auth(server: smb2.Server) -> None:
    async with await smb2.connect([server.address], token=TOKEN) as c:
        seg = (await c.create("target", 4096)).segments[0]
    reader, writer = await asyncio.open_connection(*server.address)
    writer.write(wire.control({"cmd": "hello", "version": VERSION}, 1))
    hdr, hello = await _reply(reader)
    assert hdr[4] == 0 and hello["auth"] == auth.MECH and len(hello["nonce"]) == auth.NONCE_SIZE
    assert "segment" not in hello and "buffers" not in hello
    # control commands: refused one by one, the connection stays (it may still authenticate)
    for rid, cmd in enumerate(["list", "stat", "lookup", "create", "destroy", "rdma_connect"], 2):
        writer.write(wire.control({"cmd": cmd, "name": "target", "nbytes": 8, "stripe": 8,
                               "nservers": 1, "index": 0}, rid))
        hdr, body = await _reply(reader)
        assert (hdr[4], hdr[5]) == (ErrorCode.ACCESS_DENIED, rid), (cmd, body)
        assert "authentication" in body["message"]
    assert list(server.by_name) == ["target"]
    # a data op: refused and the connection closed, nothing touched
    writer.write(wire.frame(Op.WRITE, b"evil", rid=20, segment=seg))
    hdr, body = await _reply(reader)
    assert (hdr[4], hdr[5]) == (ErrorCode.ACCESS_DENIED, 20)
    assert await wire.closed(reader)
    writer.close()
    assert not server.segments[seg].mem[:4].any()
    assert not server.ops


@pytest.mark.parametrize("make_auth", [
    lambda sn: {"cmd": "auth"},                                          # missing fields
    lambda sn: {"cmd": "auth", "nonce": 5, "proof": "x"},                 # wrong types
    lambda sn: {"cmd": "auth", "nonce": b"n" * 32, "proof": b"p" * 32},   # wrong proof
    lambda sn: {"cmd": "auth", "nonce": b"n" * 3,
                "proof": auth.client_proof(TOKEN, sn, b"n" * 3)},           # short nonce
    # a proof that was valid for another challenge (a replay)
    lambda sn: {"cmd": "auth", "nonce": b"n" * 32,
                "proof": auth.client_proof(TOKEN, b"\0" * 32, b"n" * 32)},
    # the server's own proof reflected back
    lambda sn: {"cmd": "auth", "nonce": b"n" * 32,
                "proof": auth.server_proof(TOKEN, sn, b"n" * 32)},
    # (a huge one is refused unread: test_hardening_server.py)
])
async def test_bad_auth_messages_close_the_connection(server: smb2.Server, make_auth) -> None:
    reader, writer = await asyncio.open_connection(*server.address)
    writer.write(wire.control({"cmd": "hello", "version": VERSION}, 1))
    _, hello = await _reply(reader)
    writer.write(wire.control(make_auth(hello["nonce"]), 2))
    hdr, body = await _reply(reader)
    assert (hdr[4], hdr[5]) == (ErrorCode.ACCESS_DENIED, 2)
    assert await wire.closed(reader)
    writer.close()
    assert server.auth_failures == 1


async def test_valid_raw_handshake_then_ops(server: smb2.Server) -> None:
    reader, writer = await asyncio.open_connection(*server.address)
    writer.write(wire.control({"cmd": "hello", "version": VERSION}, 1))
    _, hello = await _reply(reader)
    cn = os.urandom(32)
    writer.write(wire.control({"cmd": "auth", "nonce": cn,
                           "proof": auth.client_proof(TOKEN, hello["nonce"], cn)}, 2))
    hdr, body = await _reply(reader)
    assert hdr[4] == 0 and body["proof"] == auth.server_proof(TOKEN, hello["nonce"], cn)
    writer.write(wire.control({"cmd": "auth", "nonce": cn, "proof": b""}, 3))   # twice: refused
    hdr, _ = await _reply(reader)
    assert hdr[4] == ErrorCode.BAD_REQUEST
    writer.write(wire.control({"cmd": "list"}, 4))
    hdr, body = await _reply(reader)
    assert hdr[4] == 0 and body == {"buffers": []}
    writer.close()


async def test_client_refuses_a_server_that_cannot_prove_the_token() -> None:
    """Mutual authentication: an impostor that accepts any proof is caught."""

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for reply in ({"version": VERSION, "max_frame": 1 << 20, "auth": auth.MECH,
                           "nonce": b"z" * 32}, {"proof": b"q" * 32}):
                hdr = _core.decode_header(await reader.readexactly(32))
                await reader.readexactly(hdr[8])
                body = msgpack.packb(reply, use_bin_type=True)
                writer.write(_core.encode_header(VERSION, Op.CONTROL, FLAG_REPLY, 0, hdr[5], 0, 0,
                                                 len(body)) + body)
            await reader.read()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    srv = await asyncio.start_server(impostor, "127.0.0.1", 0)
    try:
        port = srv.sockets[0].getsockname()[1]
        with pytest.raises(smb2.AccessDenied, match="could not prove"):
            await smb2.connect([f"127.0.0.1:{port}"], token=TOKEN)
        # and a token-less client does not even try
        with pytest.raises(smb2.AccessDenied, match="requires authentication"):
            await smb2.connect([f"127.0.0.1:{port}"], token=None)
    finally:
        srv.close()
        await srv.wait_closed()


def test_check_is_constant_time_and_type_safe() -> None:
    good = auth.client_proof(TOKEN, b"s" * 32, b"c" * 32)
    assert auth.check(good, bytes(good))
    for bad in (None, 5, "x", good[:-1], good + b"\0", bytearray(good)):
        assert not auth.check(good, bad)
    with pytest.raises(smb2.InvalidArgumentError):
        auth.as_token("  \n")


async def test_local_cluster_with_token_in_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.ENV, raising=False)
    async with smb2.LocalCluster(servers=2, processes=True, capacity="16MiB",
                                 token="s3cret") as cluster:
        client = await cluster.connect()
        buf = await client.create("t", 3 << 20, stripe=1 << 20)
        await buf.write(0, b"ok")
        assert bytes(await buf.read(0, 2)) == b"ok"
        with pytest.raises(smb2.AccessDenied):
            await smb2.connect(cluster.addresses)
        # after a server restart the client reconnects, and authenticates again
        await cluster.kill(1)
        await cluster.restart(1)
        with pytest.raises((smb2.TransportError, smb2.NoSuchBuffer)):
            await buf.read(0, buf.nbytes)
        await client.destroy("t")
        buf = await client.create("t", 3 << 20, stripe=1 << 20)
        await buf.write(0, b"again")
        assert bytes(await buf.read(0, 5)) == b"again"
        # the token is not on the servers' command lines
        for i in range(2):
            cmdline = await asyncio.to_thread(Path(f"/proc/{cluster.pid(i)}/cmdline").read_bytes)
            assert b"s3cret" not in cmdline


def test_smb2_server_token_file_and_exposed_bind_warning(tmp_path: Path) -> None:
    tok = tmp_path / "token"
    tok.write_bytes(TOKEN + b"\n")
    env = {k: v for k, v in os.environ.items() if k != auth.ENV}
    with ServerProcess("--capacity", "4MiB", "--auth-token-file", str(tok)) as srv:
        port = srv.port

        async def use() -> None:
            async with await smb2.connect([f"127.0.0.1:{port}"], token=TOKEN) as c:
                await c.create("x", 100)
            with pytest.raises(smb2.AccessDenied):
                await smb2.connect([f"127.0.0.1:{port}"], token=None)
        asyncio.run(use())
    # binding beyond loopback without a token: a warning on stderr
    with ServerProcess("--capacity", "1MiB", host="0.0.0.0") as exposed:
        assert exposed.host == "0.0.0.0"
        exposed.stop()
        assert "without an authentication token" in exposed.stderr()
    # an unreadable token file is a usage error
    proc = subprocess.Popen([sys.executable, "-m", "smb2.server", "--auth-token-file",
                             str(tmp_path / "missing")], stderr=subprocess.PIPE, text=True, env=env)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "token file" in err
