"""Training through the host agent (smb2-agent): the ordinary example
script (examples/torch_train.py) under torchrun, with ``SMB2_AGENT`` set and
nothing else changed, against two real smb2-server processes and a real
agent; then the agent SIGKILLed under the running job.

The bar is the one the direct runs meet (tests/test_torch_diloco.py):
within GAP_POINTS of one process trained on the same samples."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
from typing import Any

import pytest

import smb2
from smb2.testing.launch import AgentProcess
from smb2.testing.waits import until
from smb2.testing.workers import json_objects, torchrun, torchrun_failure
from smb2.train import ParameterStore, faults
from smb2.train.rules import outer_momentum_name

# (the soft-RoCE VM's python has no torch: nothing that imports it before these)
torch = pytest.importorskip("torch", reason="PyTorch is not installed here (pip install 'smb2[torch]')")
pytest.importorskip("sklearn", reason="the digits data set needs scikit-learn")

from smb2.testing.torch_models import (  # noqa: E402
    EXAMPLE,
    async_optimizer,
    single_process_accuracy,
    torchrun_beside_single,
)
from smb2.torch.loop_thread import LoopThread  # noqa: E402

#: accuracy points the 4 workers may end below one process on the same samples
GAP_POINTS = 2.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_diloco_workers_train_through_the_host_agent(servers: str, monkeypatch: pytest.MonkeyPatch,
                                                     record_property: Any) -> None:
    with tempfile.TemporaryFile("w+") as log, AgentProcess("--servers", servers, stderr=log) as agent:
        monkeypatch.setenv("SMB2_AGENT", agent.endpoint)
        ranks, single = torchrun_beside_single(servers, "--rule", "diloco", "--name", "t-agent-diloco")
        agent.stop()
        log.seek(0)
        said = log.read()
    record_property("accuracy", {"workers": ranks[0]["accuracy"], "single": single})
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    assert {r["via"] for r in ranks} == {"agent"}, ranks
    assert "t-agent-diloco" in said, said[-2000:]          # the agent mirrored the store
    # and the shares of the outer momentum step, beside it
    assert f"{outer_momentum_name('t-agent-diloco')!r}" in said, said[-2000:]
    assert single > 95.0, single
    assert ranks[0]["accuracy"] >= single - GAP_POINTS, (ranks[0], single)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_agent_leaves_the_workers_training_on_the_servers(servers: str) -> None:
    """SIGKILL the agent once the run has pushes through it: every rank says
    so at WARNING with its pushes that may be lost, goes on against the
    servers, and the run ends at the same bar."""
    name = "t-agent-killed"
    agent = AgentProcess("--servers", servers)
    env = dict(os.environ, SMB2_SERVERS=servers, SMB2_AGENT=agent.endpoint, OMP_NUM_THREADS="1")
    with tempfile.TemporaryFile("w+") as err:
        run = subprocess.Popen(torchrun(str(EXAMPLE), "--optimizer", "sgd", "--epochs", "12", "--rule", "diloco",
                                        "--name", name, nproc=4),
                               env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            loop = LoopThread("watch")
            try:
                loop.run(_until_rounds(servers, name, 8))
            finally:
                loop.stop()
            agent.stop(sig=signal.SIGKILL)
            single = single_process_accuracy("sgd", 12)
            stdout, _ = run.communicate(timeout=240)
        finally:
            if run.poll() is None:
                run.kill()
                run.communicate()
            agent.stop()
        err.seek(0)
        stderr = err.read()
    assert run.returncode == 0, torchrun_failure(stderr)
    ranks = json_objects(stdout)
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    assert {r["via"] for r in ranks} == {"servers (agent lost)"}, ranks
    assert stderr.count("directly (restart smb2-agent") == 4, stderr[-3000:]
    assert stderr.count("may not have reached the memory servers") == 4, stderr[-3000:]
    assert ranks[0]["accuracy"] >= single - GAP_POINTS, (ranks[0], single)


def test_a_rule_the_agent_does_not_serve_leaves_the_agent_alone(servers: str, caplog: pytest.LogCaptureFixture) -> None:
    """rule allreduce (the default) sums gradients, not weights: an agent
    named for it is said at WARNING and never dialed (here nothing listens
    at its address, so a dial would fail the open)."""
    model = torch.nn.Linear(4, 2)
    with caplog.at_level("WARNING", logger="smb2"), \
            async_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), servers, "t-agent-unserved",
                            agent="127.0.0.1:1") as opt:
        assert opt.stats()["via"] == "servers"
    assert "rule 'allreduce' exchanges through the servers directly" in caplog.text, caplog.text


async def _until_rounds(servers: str, name: str, pushes: int) -> None:
    """Wait (on the servers, not the clock) until store ``name`` counted ``pushes`` pushes."""
    client = await smb2.connect(servers)
    try:
        async def counted() -> bool:
            try:
                store = await ParameterStore.attach(client, name)
            except smb2.NoSuchBuffer:
                return False
            return await store.read_version() >= pushes

        await until(counted, f"{pushes} pushes to store {name!r}", guard=180, every=0.2)
    finally:
        await client.close()


def test_a_paused_agent_is_named_while_the_step_waits_and_the_step_goes_on_after(
        servers: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A stopped agent raises nothing: the host's exchanges wait on it as
    they would on a paused server.  While a step's exchange waits, the
    worker asks the agent as it asks the servers, and names it at WARNING
    (the servers answer); once it runs again the step completes."""
    monkeypatch.setattr(faults, "SAY_SILENT_AFTER", 0.2)        # (PING_TIMEOUT's 5 s to answer)
    model = torch.nn.Linear(4, 2)
    g = torch.Generator().manual_seed(0)

    def steps(opt: Any, n: int) -> None:
        for _ in range(n):
            x = torch.randn(8, 4, generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()
            opt.step()

    with AgentProcess("--servers", servers) as agent, caplog.at_level("WARNING", logger="smb2"), \
            async_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), servers, "t-agent-paused",
                            rule="delta", agent=agent.endpoint) as opt:
        assert opt.stats()["via"] == "agent"
        steps(opt, 2)
        agent.proc.send_signal(signal.SIGSTOP)
        stepping = threading.Thread(target=steps, args=(opt, 1))
        try:
            stepping.start()
            loop = LoopThread("test-wait")
            try:
                loop.run(until(lambda: any("does not answer" in r.getMessage() for r in caplog.records),
                               "the paused agent named"))
            finally:
                loop.stop()
            assert stepping.is_alive()          # (the step waits for it)
        finally:
            agent.proc.send_signal(signal.SIGCONT)
        stepping.join()
        steps(opt, 2)
    said = [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()]
    assert f"the host agent {agent.endpoint} (smb2-agent) does not answer" in said[0], said
    assert "memory server" not in said[0], said
    assert opt.steps == 5
