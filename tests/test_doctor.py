"""``smb2 doctor`` against real smb2-server processes: a live one, a dead
one, one that wants a token; the exit status and the JSON fields; and
against a real smb2-agent (``--agent``, ``SMB2_AGENT``)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import smb2
from smb2 import auth
from smb2.protocol import VERSION
from smb2.testing import ports
from smb2.testing.hostile import TOKEN
from smb2.testing.launch import AgentProcess, ServerProcess
from smb2.transport.choose import rdma_unavailable_reason


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != auth.ENV}
    return subprocess.run([sys.executable, "-m", "smb2.cli", "doctor", *args], capture_output=True, text=True,
                          timeout=90, env={**base, **(env or {})})


def dead_address() -> str:
    """A loopback port nothing listens on, as ``smb2 doctor`` takes it."""
    host, port = ports.dead_address()
    return f"{host}:{port}"


@pytest.fixture
def live() -> Iterator[ServerProcess]:
    s = ServerProcess("--capacity", "16MiB")
    yield s
    s.stop()


def test_a_live_server_passes_with_its_transport_clock_and_versions(live: ServerProcess) -> None:
    address = f"127.0.0.1:{live.port}"
    t0 = time.time()
    run = doctor(address, "--json")
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert report["problems"] == []
    (server,) = report["servers"]
    assert server["address"] == address and server["reachable"] and server["error"] is None
    assert server["capacity"] == 16 << 20 and server["used"] == 0
    assert server["protocol_version"] == VERSION and server["version"] == report["versions"]["smb2"]
    # same machine, same clock: the offset is within the round trip
    assert abs(server["clock_offset_s"]) <= server["round_trip_s"] + 0.05
    # the round trip is a part of the run (containment, not speed: load lengthens both)
    assert 0 < server["round_trip_s"] < time.time() - t0
    # what auto would take here, and why, as the client itself decides
    # a server on this host: a client's auto takes shm, and the doctor says so
    assert server["transport"] == "shm" and server["why"].startswith("same host: segments mapped from ")
    # a job that asks for TCP (SMB2_TRANSPORT, as a client reads it) gets TCP
    asked = json.loads(doctor(address, "--json", env={"SMB2_TRANSPORT": "tcp"}).stdout)
    assert asked["servers"][0]["transport"] == "tcp" and asked["problems"] == []
    local = rdma_unavailable_reason()
    if local is not None:
        assert report["rdma"]["usable"] is False
        assert report["rdma"]["reason"] == f"no RDMA device: {local}"
        assert report["memlock"]["note"] == "not needed: no RDMA here"
    assert report["memlock"]["to_register"] == 16 << 20
    assert report["token"].startswith("none")

    table = doctor(address)
    assert table.returncode == 0
    assert address in table.stdout and "no problems found" in table.stdout


def test_a_dead_server_is_a_problem_named(live: ServerProcess) -> None:
    dead = dead_address()
    run = doctor(f"127.0.0.1:{live.port}", dead, "--json", "--timeout", "5")
    assert run.returncode == 1, run.stdout + run.stderr
    report = json.loads(run.stdout)
    by_address = {s["address"]: s for s in report["servers"]}
    assert by_address[f"127.0.0.1:{live.port}"]["reachable"] is True
    assert by_address[dead]["reachable"] is False
    assert "cannot connect" in by_address[dead]["error"]
    assert len(report["problems"]) == 1 and report["problems"][0].startswith(f"{dead}: cannot connect")
    table = doctor(dead)
    assert table.returncode == 1
    assert "UNREACHABLE" in table.stdout and f"PROBLEM: {dead}" in table.stdout


def test_the_token_found_or_missing(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_bytes(TOKEN)
    token_file.chmod(0o600)
    server = ServerProcess("--auth-token-file", str(token_file))
    try:
        address = f"127.0.0.1:{server.port}"
        missing = doctor(address, "--json")
        assert missing.returncode == 1
        report = json.loads(missing.stdout)
        assert report["token"].startswith("none")
        assert "requires authentication" in report["problems"][0]

        wrong = doctor(address, "--json", env={auth.ENV: "not the token"})
        assert wrong.returncode == 1
        assert json.loads(wrong.stdout)["token"] == f"found in ${auth.ENV}"
        assert "wrong token" in json.loads(wrong.stdout)["problems"][0]

        right = doctor(address, "--json", "--auth-token-file", str(token_file))
        assert right.returncode == 0, right.stdout
        report = json.loads(right.stdout)
        assert report["token"] == f"found in {token_file}"
        assert report["servers"][0]["auth"] == auth.MECH
    finally:
        server.stop()


def test_asking_for_rdma_where_there_is_none_is_a_problem(live: ServerProcess) -> None:
    local = rdma_unavailable_reason()
    if local is None:
        pytest.skip("this machine has RDMA: the server's side decides (tested in the RDMA VM tier)")
    run = doctor(f"127.0.0.1:{live.port}", "--transport", "rdma", "--json")
    assert run.returncode == 1
    problems = json.loads(run.stdout)["problems"]
    assert f"--transport rdma, but no RDMA device: {local}" in problems
    assert any("would get TCP" in p for p in problems)


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    assert doctor("--capacity", "lots").returncode == 2
    run = doctor("--auth-token-file", str(tmp_path / "absent"))
    assert run.returncode == 2 and "smb2 doctor:" in run.stderr


def test_wait_keeps_trying_a_server_still_starting_but_not_a_wrong_token(tmp_path: Path) -> None:
    """A job's servers start beside it (Slurm, Kubernetes): ``--wait`` retries
    one that refuses connections until it is up; a wrong token is an answer,
    not a server still starting, and is reported at once."""
    address = dead_address()
    port = address.rsplit(":", 1)[1]
    base = {k: v for k, v in os.environ.items() if k != auth.ENV}
    waiting = subprocess.Popen([sys.executable, "-m", "smb2.cli", "doctor", "--wait", "60", "--json", address],
                               stdout=subprocess.PIPE, text=True, env=base)
    token_file = tmp_path / "token"
    token_file.write_bytes(TOKEN)
    token_file.chmod(0o600)
    time.sleep(1.5)             # refused meanwhile: doctor is still trying
    assert waiting.poll() is None
    server = ServerProcess("--port", port, "--auth-token-file", str(token_file))
    try:
        out, _ = waiting.communicate(timeout=60)
        report = json.loads(out)
        # the server came up and answered (the missing token is its answer)
        assert report["servers"][0]["error"] is not None and "authentication" in report["servers"][0]["error"]
        # a wrong token is an answer, not a server still coming up: doctor
        # reports it rather than waiting out --wait (an hour here, past the
        # 90 s that doctor() lets a run take: waiting would fail this test)
        wrong = doctor(address, "--wait", "3600", "--json", env={auth.ENV: "not the token"})
        assert wrong.returncode == 1 and "wrong token" in json.loads(wrong.stdout)["problems"][0]
    finally:
        server.stop()
    assert doctor(address, "--wait", "1").returncode == 1      # gone again: reported after the wait


def test_the_servers_come_from_where_every_command_reads_them(live: ServerProcess) -> None:
    """SMB2_SERVERS (as `smb2 ls` and smb2.connect read it), --servers, and a
    Slurm allocation's hosts (--from-slurm): the same list as everywhere."""
    address = f"127.0.0.1:{live.port}"
    for args, env in (((), {"SMB2_SERVERS": address}), (("--servers", address), {}),
                      (("--from-slurm", "--port", str(live.port)), {"SLURM_JOB_NODELIST": "127.0.0.1"})):
        run = doctor(*args, "--json", env=env)
        assert run.returncode == 0, (args, run.stdout + run.stderr)
        (server,) = json.loads(run.stdout)["servers"]
        assert server["address"] == address and server["reachable"], args


def test_a_doctor_that_checked_no_server_fails() -> None:
    base = {k: v for k, v in os.environ.items() if k not in ("SMB2_SERVERS", "SLURM_JOB_NODELIST")}
    run = subprocess.run([sys.executable, "-m", "smb2.cli", "doctor"], capture_output=True, text=True,
                         timeout=90, env=base)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "no server to check" in run.stderr and "no server was checked" in run.stdout
    assert "HINT: give the servers" in run.stderr


def test_one_server_under_two_names_is_refused(live: ServerProcess) -> None:
    """Two names that reach one process (two nodes' names where one server
    listens on every interface) would count its stripes twice: the doctor
    and connect refuse the list, naming both."""
    one, other = f"127.0.0.1:{live.port}", f"localhost:{live.port}"
    run = doctor(one, other)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"PROBLEM: server listed twice: {one} and {other} are the same process" in run.stdout, run.stdout

    async def connect() -> None:
        client = await smb2.connect([one, other], transport="tcp")
        await client.close()
    with pytest.raises(smb2.InvalidArgumentError, match=f"server listed twice: {one} and {other} are the same"):
        asyncio.run(connect())


async def test_an_etcd_open_to_all_is_a_problem_and_one_with_authentication_is_not() -> None:
    import uuid

    import smb2
    from smb2 import doctor as doctor_module
    from smb2.membership import NO_VIEW, open_membership
    from smb2.testing.etcd import LocalEtcd

    async with LocalEtcd() as etcd:
        url = etcd.url(f"d-{uuid.uuid4().hex[:6]}")
        server = await smb2.start_server("127.0.0.1", 0, membership=url, shm="off", rdma="off")
        try:
            async with open_membership(url) as m:
                await m.change(NO_VIEW, members=[f"127.0.0.1:{server.address[1]}"])
            report = await doctor_module.diagnose([f"127.0.0.1:{server.address[1]}"], transport="tcp")
        finally:
            await server.close()
    assert any("answers without credentials" in p and url in p for p in report.problems), report.problems
    async with smb2.LocalCluster(servers=1, processes=True, replicated=True) as guarded:
        report = await doctor_module.diagnose(guarded.addresses, transport="tcp")
    assert not any("etcd" in p for p in report.problems), report.problems


# ---------------------------------------------------------------------------
# the host agent (--agent, SMB2_AGENT)


def test_a_host_agent_is_checked_with_the_token_and_its_memory_servers(tmp_path: Path) -> None:
    """SMB2_AGENT, as a worker reads it: the agent answers with the token,
    says it is an agent, reaches its servers, and they are the job's; a
    memory server named as the agent, a wrong token and an agent of other
    servers are each a problem named."""
    token_file = tmp_path / "token"
    token_file.write_bytes(TOKEN)
    token_file.chmod(0o600)
    socket = tmp_path / "agent" / "agent.sock"
    with ServerProcess("--capacity", "16MiB", token=TOKEN) as server, \
            ServerProcess("--capacity", "16MiB", token=TOKEN) as other, \
            AgentProcess("--servers", server.endpoint, "--capacity", "16MiB", "--shm-socket", str(socket),
                         token=TOKEN) as agent:
        env = {"SMB2_SERVERS": server.endpoint, "SMB2_AGENT": agent.endpoint, auth.ENV: TOKEN.decode()}
        run = doctor("--json", env=env)
        assert run.returncode == 0, run.stdout + run.stderr
        report = json.loads(run.stdout)
        assert report["problems"] == []
        said = report["agent"]
        assert said["address"] == agent.endpoint and said["reachable"] and said["auth"] == auth.MECH
        # on this host, as a worker reaches it: through the socket it was told (--shm-socket)
        assert said["transport"] == "shm" and said["why"] == f"same host: segments mapped from {socket}"
        assert said["agent"]["servers"] == [server.endpoint] and said["agent"]["trouble"] is None
        assert said["agent"]["server_ids"] == [report["servers"][0]["server_id"]]
        table = doctor(env=env)
        assert table.returncode == 0, table.stdout
        assert (f"agent {agent.endpoint}" in table.stdout
                and f"host agent for the memory servers {server.endpoint} (connected to 1 of 1)" in table.stdout)
        # the agent alone (--agent): checked, no server needed
        alone = doctor("--agent", agent.endpoint, "--auth-token-file", str(token_file),
                       env={"SMB2_SERVERS": ""})
        assert alone.returncode == 0 and "no problems found" in alone.stdout, alone.stdout + alone.stderr
        # a memory server is not an agent
        wrong = doctor("--agent", server.endpoint, env=env)
        assert wrong.returncode == 1
        assert f"PROBLEM: agent {server.endpoint} answers, but is not a host agent" in wrong.stdout, wrong.stdout
        # the agent refuses a wrong token
        refused = json.loads(doctor("--json", env={**env, auth.ENV: "not the token"}).stdout)
        assert any(p.startswith(f"agent {agent.endpoint}: ") and "wrong token" in p for p in refused["problems"])
        # the job's servers are not the agent's: its pushes would land elsewhere
        elsewhere = doctor(env={**env, "SMB2_SERVERS": other.endpoint})
        assert elsewhere.returncode == 1
        assert (f"PROBLEM: agent {agent.endpoint} forwards to other memory servers than this job's: its "
                f"{server.endpoint}; this job's {other.endpoint}") in elsewhere.stdout, elsewhere.stdout


def test_an_agent_that_cannot_reach_its_servers_is_a_problem_and_waited_for(tmp_path: Path) -> None:
    """An agent started before its servers answers and says why it waits:
    a problem at once, and with --wait the doctor waits until the agent
    reached them (a job's agents and servers start together)."""
    address = dead_address()
    port = address.rsplit(":", 1)[1]
    with AgentProcess("--servers", address, "--capacity", "16MiB") as agent:
        run = doctor("--agent", agent.endpoint, "--json", env={"SMB2_SERVERS": ""})
        assert run.returncode == 1, run.stdout + run.stderr
        (problem,) = json.loads(run.stdout)["problems"]
        assert problem.startswith(f"agent {agent.endpoint} cannot reach its memory servers {address}: "), problem
        base = {k: v for k, v in os.environ.items() if k not in (auth.ENV, "SMB2_SERVERS")}
        waiting = subprocess.Popen([sys.executable, "-m", "smb2.cli", "doctor", "--wait", "120", "--json",
                                    "--agent", agent.endpoint, address], stdout=subprocess.PIPE, text=True, env=base)
        try:
            with ServerProcess("--port", port, "--capacity", "16MiB"):
                out, _ = waiting.communicate(timeout=150)
        finally:
            if waiting.poll() is None:
                waiting.kill()
                waiting.wait()
        report = json.loads(out)
        assert waiting.returncode == 0 and report["problems"] == [], out
        assert report["agent"]["agent"]["trouble"] is None
