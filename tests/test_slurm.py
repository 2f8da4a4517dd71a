"""examples/slurm/smb2_train.sbatch on a real Slurm: Debian's slurmctld,
slurmd and munge, installed and started by tools/slurm_cluster.sh (a
single-host cluster of two nodes, each with a loopback address of its own:
two servers on one host, as two GPUs' worth of memory or a packed job meet
it).  The job starts a memory server per node, derives the server list with
``smb2 servers --from-slurm``, waits with ``smb2 doctor --wait``, trains
examples/torch_train.py with one torchrun per worker and a token from a
file, and stops the servers; the tests check the accuracy it reached with
the script's default settings, that no server is left, that a server that
could not listen stops the job before the training, and that a worker
killed mid-run is restarted alone while the others train on; with
SMB2_AGENTS=1, that every rank exchanged through its node's host agent and
that agents which do not start stop the job before the training.  Where
Slurm cannot be had (not root, no apt) it skips and says why."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from smb2.serverlist import expand_hostlist
from smb2.testing.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "tools" / "slurm_cluster.sh"
SBATCH = ROOT / "examples" / "slurm" / "smb2_train.sbatch"
# digits, a rank per node, 3 epochs: they reached 93-95 % when every change counted whole (DDP arithmetic,
# the default now: 89.8 % in one process for the example's seed)
TARGET_ACCURACY = 85.0

# the first test pays for installing Slurm where make has not (about 40 s)
# and starting it (2-10 s); the job takes 20-75 s (torch's start, on a busy machine)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.alone]      # one Slurm cluster per machine: no other worker beside (see conftest)


@pytest.fixture(scope="module")
def slurm_env() -> Iterator[dict[str, str]]:
    """The environment of a user of the cluster (SLURM_CONF set).  A cluster
    this script already runs is used and left running; one started here is
    stopped at the end."""
    start = subprocess.run([str(CLUSTER), "start"], capture_output=True, text=True, timeout=600)
    if start.returncode == 3:
        pytest.skip(start.stderr.strip())
    assert start.returncode == 0, start.stdout + start.stderr
    conf = start.stdout.strip().splitlines()[-1].removeprefix("SLURM_CONF=")
    try:
        yield {**os.environ, "SLURM_CONF": conf}
    finally:
        if "already running" not in start.stdout:
            subprocess.run([str(CLUSTER), "stop"], timeout=120, check=True)


def command_lines() -> Iterator[list[str]]:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            yield Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue


def servers_on(port: int) -> list[str]:
    """The command lines of smb2-server processes serving ``port``."""
    return [" ".join(argv) for argv in command_lines()
            if any(a.endswith("smb2-server") for a in argv) and str(port) in argv]


def agents_on(port: int) -> list[str]:
    """The command lines of smb2-agent processes listening on ``port`` (the
    console script, or ``python -m smb2.agent``)."""
    return [" ".join(argv) for argv in command_lines()
            if any(a.endswith("smb2-agent") or a == "smb2.agent" for a in argv)
            and any(a.endswith(f":{port}") for a in argv)]


def agent_on_path(tmp_path: Path) -> str:
    """A PATH entry holding ``smb2-agent``: none where this venv has the
    console script (pip install -e . makes it, as make and CI do), else a
    folder with a wrapper that runs this interpreter's ``python -m
    smb2.agent`` (a venv installed before the agent was declared)."""
    if shutil.which("smb2-agent", path=str(Path(sys.executable).parent)) is not None:
        return ""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    wrapper = folder / "smb2-agent"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m smb2.agent "$@"\n')
    wrapper.chmod(0o755)
    return f"{folder}:"


def test_host_lists_expand_as_scontrol_expands_them(slurm_env: dict[str, str]) -> None:
    for text in ("node[01-03,7],gpu5", "a[1-2]b[8-9]", "n[9-11]", "x[008-010],y"):
        run = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True, text=True,
                             env=slurm_env, timeout=30, check=True)
        assert expand_hostlist(text) == run.stdout.split(), text


def submit(slurm_env: dict[str, str], tmp_path: Path, *args: str, nodes: int = 1,
           meanwhile: threading.Thread | None = None, **settings: str) -> tuple[int, str, int]:
    """Submit the script on ``nodes`` nodes with a fresh token file and a
    free port (written to tmp_path/port before the job starts: ``meanwhile``,
    a thread started once the job is submitted, reads it), wait for the job;
    its exit status, its output and the servers' port.  The agents' port,
    where the job starts agents, is ``settings["SMB2_AGENT_PORT"]``."""
    token = tmp_path / "token"
    token.write_text(os.urandom(16).hex() + "\n")
    token.chmod(0o600)
    port = free_port()
    (tmp_path / "port").write_text(str(port))
    out = tmp_path / "job.out"
    env = {**slurm_env,
           # the job finds smb2, smb2-server, smb2-agent and torchrun of this venv (sbatch passes the
           # environment on)
           "PATH": f"{Path(sys.executable).parent}:{agent_on_path(tmp_path)}{slurm_env['PATH']}",
           "SMB2_TOKEN_FILE": str(token), "SMB2_PORT": str(port), "SMB2_CAPACITY": "64MiB", **settings}
    for name in ("SMB2_SERVERS", "SMB2_AUTH_TOKEN", "SMB2_BIND", "SMB2_WORKERS_PER_NODE", "SMB2_MAX_RESTARTS",
                 "SMB2_AGENT", "SMB2_AGENTS", "SMB2_AGENT_PORT", "SMB2_AGENT_BIND", "SMB2_AGENT_CAPACITY",
                 "SMB2_AGENT_ARGS"):
        if name not in settings:
            env.pop(name, None)     # the script's defaults, unless the test sets them
    job = subprocess.run(["sbatch", "--parsable", f"--nodes={nodes}", f"--output={out}", f"--chdir={ROOT}", "--time=10",
                          str(SBATCH), *args], capture_output=True, text=True, env=env, timeout=60, check=True)
    if meanwhile is not None:
        meanwhile.start()
    state, code = wait_for_job(job.stdout.strip().split(";")[0], env)
    if meanwhile is not None:
        meanwhile.join(timeout=60)
    log = out.read_text() if out.exists() else "(no job output)"
    return code, f"job {state}, exit {code}\n{log}", port


def wait_for_job(job_id: str, env: dict[str, str], timeout: float = 280) -> tuple[str, int]:
    """The job's final state and exit status.  (Polled every 0.25 s: `sbatch
    --wait` polls at growing intervals and found jobs ended 12 s late.)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        show = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=env,
                              timeout=30, check=True).stdout
        fields = dict(f.split("=", 1) for f in show.split() if "=" in f)
        if fields["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return fields["JobState"], int(fields["ExitCode"].split(":")[0])
        time.sleep(0.25)
    subprocess.run(["scancel", job_id], env=env, timeout=30)
    raise AssertionError(f"Slurm job {job_id} still running after {timeout} s: cancelled")


def need_torchrun() -> None:
    if shutil.which("torchrun", path=f"{Path(sys.executable).parent}") is None:
        pytest.skip("torchrun is not installed (make installs torch into .venv where it can)")


def node_names(slurm_env: dict[str, str]) -> list[str]:
    return subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, env=slurm_env,
                          timeout=30, check=True).stdout.split()


def test_sbatch_starts_servers_trains_to_target_and_stops_them(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """The script's defaults (its bind, one worker per node) on two nodes of
    one host: both servers listen on the one port, each on its node's address."""
    need_torchrun()
    nodes = node_names(slurm_env)
    code, log, port = submit(slurm_env, tmp_path, "examples/torch_train.py", "--epochs", "3", "--name", "slurm-test",
                             nodes=len(nodes), SMB2_WAIT="60")
    assert code == 0, log
    # the list came from the allocation, one server per node in the natural order,
    # and the doctor saw each one answer with our token
    assert f"smb2: servers {','.join(f'{n}:{port}' for n in nodes)}\n" in log, log
    assert log.count("auth hmac-sha256") == len(nodes) and "no problems found" in log, log
    reports = [json.loads(line) for line in log.splitlines() if line.startswith('{"rank"')]
    assert sorted(r["rank"] for r in reports) == list(range(len(nodes))), log
    for r in reports:
        assert r["world"] == len(nodes) and r["steps"] > 0
        assert r["accuracy"] >= TARGET_ACCURACY, log
    # the script stopped the servers (SIGTERM, exit 0) before the job ended
    assert "smb2: training exit 0" in log and "smb2: servers stopped (exit 0)" in log, log
    assert servers_on(port) == []


def test_a_server_that_does_not_start_fails_the_job_named(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """No training on a partial server list: the doctor names the server and
    the job fails (the training is never started)."""
    code, log, port = submit(slurm_env, tmp_path, SMB2_SERVER_ARGS="--capacity lots", SMB2_WAIT="30")
    assert code != 0
    assert "smb2-server: not a size: 'lots'" in log, log
    # the servers' step ended: the job stops at once, not after the doctor's wait
    assert "smb2: the memory servers stopped before the training started" in log, log
    assert "smb2: training exit" not in log, log
    assert servers_on(port) == []


def test_a_server_that_cannot_listen_stops_the_job_before_the_training(slurm_env: dict[str, str],
                                                                      tmp_path: Path) -> None:
    """SMB2_BIND=all on two nodes of one host: the second server cannot
    listen, and the first answers for both names.  The doctor sees one
    process under two names and the job stops with the server's message."""
    nodes = node_names(slurm_env)
    code, log, port = submit(slurm_env, tmp_path, nodes=len(nodes), SMB2_BIND="all", SMB2_WAIT="60")
    assert code != 0, log
    assert f"cannot listen on 0.0.0.0:{port}" in log, log
    assert f"PROBLEM: server listed twice: {nodes[0]}:{port} and {nodes[1]}:{port} are the same process" in log, log
    assert "smb2: the memory servers are not all up" in log, log
    assert "smb2: training exit" not in log, log
    assert servers_on(port) == []


def test_sbatch_with_host_agents_trains_through_them_to_target(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """SMB2_AGENTS=1: an agent per node, each checked on its node by the
    doctor, every rank's exchange through its node's agent (rule diloco),
    the same bar as without; the agents stop before the servers.  The two
    nodes share this host's loopback, so each agent listens on its node's
    own address (SMB2_AGENT_BIND=node)."""
    need_torchrun()
    nodes = node_names(slurm_env)
    agent_port = free_port()
    code, log, port = submit(slurm_env, tmp_path, "examples/torch_train.py", "--epochs", "3", "--name",
                             "slurm-agents", "--rule", "diloco", nodes=len(nodes), SMB2_WAIT="60", SMB2_AGENTS="1",
                             SMB2_AGENT_PORT=str(agent_port), SMB2_AGENT_BIND="node", SMB2_AGENT_CAPACITY="64MiB")
    assert code == 0, log
    # an agent listened on each node, and the doctor there found it up, with our token, reaching the servers
    ready = [ln for ln in log.splitlines() if ln.startswith("smb2-agent listening on ")]
    assert len(ready) == len(nodes) and all(ln.endswith(f":{agent_port}") for ln in ready), log
    servers = ",".join(f"{n}:{port}" for n in nodes).replace(",", ", ")
    assert log.count(f"host agent for the memory servers {servers} (connected to {len(nodes)} of {len(nodes)})") \
        == len(nodes), log
    assert "smb2: host agents up on every node" in log, log
    reports = [json.loads(line) for line in log.splitlines() if line.startswith('{"rank"')]
    assert sorted(r["rank"] for r in reports) == list(range(len(nodes))), log
    for r in reports:
        assert r["world"] == len(nodes) and r["steps"] > 0 and r["rule"] == "diloco", log
        assert r["via"] == "agent", log
        assert r["accuracy"] >= TARGET_ACCURACY, log
    # the agents stopped (SIGTERM, exit 0) before the servers, and neither is left
    assert "smb2: training exit 0" in log, log
    stopped = log.index("smb2: host agents stopped (exit 0)")
    assert stopped < log.index("smb2: servers stopped (exit 0)"), log
    assert agents_on(agent_port) == [] and servers_on(port) == []


def test_host_agents_that_do_not_start_stop_the_job_before_the_training(slurm_env: dict[str, str],
                                                                       tmp_path: Path) -> None:
    """No training without the agents asked for: their own message, then the
    job's, and neither agents nor servers are left."""
    agent_port = free_port()
    code, log, port = submit(slurm_env, tmp_path, SMB2_AGENTS="1", SMB2_AGENT_PORT=str(agent_port),
                             SMB2_AGENT_CAPACITY="lots", SMB2_WAIT="30")
    assert code != 0, log
    assert "smb2-agent: not a size: 'lots'" in log, log
    assert "smb2: the host agents stopped before the training started" in log, log
    assert "smb2: training exit" not in log, log
    assert agents_on(agent_port) == [] and servers_on(port) == []


def workers_of_rank(rank: int) -> list[int]:
    """The pids of training processes (not their torchrun) told SMB2_RANK=rank."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (any(a.endswith(b"torch_train.py") for a in argv) and not any(a.endswith(b"torchrun") for a in argv)
                and f"SMB2_RANK={rank}".encode() in environ):
            found.append(int(pid))
    return found


@pytest.mark.parametrize("rule", ["delta", "default"])
def test_a_worker_killed_is_restarted_alone_while_the_others_train_on(slurm_env: dict[str, str],
                                                                      tmp_path: Path, rule: str) -> None:
    """Two workers per node, one torchrun each: rank 1 is killed (SIGKILL)
    once it has trained some steps.  Only its torchrun restarts it; it
    rejoins the run, and every rank finishes and reports (one torchrun for
    all workers would have ended them all).  Rule delta's ranks train on
    without a lost one and let it pull the shared weights; the default's
    (allreduce, in lockstep as DDP) go on without it after dead_after and
    take it back at the start of a step with their weights and optimizer
    state, or, where they finished first, it ends with the trained weights."""
    need_torchrun()
    nodes = node_names(slurm_env)
    killed: list[int] = []
    errors: list[str] = []

    def kill_rank_1_midway() -> None:
        port = (tmp_path / "port").read_text()
        token = (tmp_path / "token").read_text().strip()
        env = {**os.environ, "SMB2_AUTH_TOKEN": token,
               "SMB2_SERVERS": ",".join(f"{n}:{port}" for n in nodes)}
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and not killed:
            ls = subprocess.run([sys.executable, "-m", "smb2.cli", "ls", "--json"], capture_output=True, text=True,
                                env=env, timeout=60)
            rows = json.loads(ls.stdout) if ls.returncode == 0 else []
            steps = next((r.get("steps") for r in rows if r["name"] == name), None)
            if steps and len(steps) == 4 and steps[1] >= 20:
                for pid in workers_of_rank(1):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.2)
        if not killed:
            errors.append("rank 1 was never seen training")

    name = f"slurm-kill-{rule}"
    args = ["--rule", "delta"] if rule == "delta" else []       # (the default: the porting recipe's one line)
    code, log, port = submit(slurm_env, tmp_path, "examples/torch_train.py", "--epochs", "40", "--name", name,
                             *args, nodes=len(nodes), meanwhile=threading.Thread(target=kill_rank_1_midway),
                             SMB2_WORKERS_PER_NODE="2", SMB2_WAIT="60")
    assert killed and not errors, errors + [log]
    assert code == 0, log
    reports = [json.loads(line) for line in log.splitlines() if line.startswith('{"rank"')]
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3], log
    for r in reports:
        assert r["world"] == 4 and r["steps"] > 0 and r["accuracy"] >= TARGET_ACCURACY, log
    # rank 1 alone was restarted (the others' steps went on) and rejoined the run
    assert "rank 1 rejoins run 1" in log, log
    if rule == "default":
        assert ("restarted rank 1 is taken back into the training at step" in log
                or "restarted rank 1 comes back after the other workers finished" in log), log
    assert "smb2: training exit 0" in log and servers_on(port) == [], log
