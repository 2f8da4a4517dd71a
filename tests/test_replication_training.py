"""Training goes on through a lost memory server: a 4-worker AsyncOptimizer
job under real torchrun, over 3 real smb2-server processes and a real etcd,
one server SIGKILLed mid-run.  With replicas=2 it reaches its target and no
worker is restarted; with replicas=1 it ends with an error naming the store,
the lost server and what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import smb2
from smb2.torch.loop_thread import LoopThread
from smb2.train.store import describe

pytest.importorskip("torch", reason="PyTorch is not installed here (pip install 'smb2[torch]')")

WORKERS = 4
EPOCHS = 12
# the server is killed once every worker is this far in (of about 250 steps each)
KILL_AT_STEP = 40

_WORKER = textwrap.dedent('''
    import json, sys
    import torch
    import torch.nn.functional as F
    import smb2.torch
    from smb2.train.example import data

    name, replicas, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = (torch.from_numpy(v) for v in data.digits())
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = smb2.torch.AsyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                    name=name, replicas=replicas, resume=False, state_every=None)
    shard = torch.arange(opt.rank, len(xtr), opt.world)
    for epoch in range(epochs):
        order = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(epoch))]
        for i in range(0, len(order), 16):
            idx = order[i:i + 16]
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    opt.close(wait_all=120)
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item() * 100
    print(json.dumps({"rank": opt.rank, "accuracy": acc}) + "\\n", end="", flush=True)
''')


@pytest.fixture
def cluster() -> Iterator[tuple[LoopThread, smb2.LocalCluster]]:
    loop = LoopThread("test-replicated-training")
    cluster = smb2.LocalCluster(servers=3, processes=True, replicated=True, capacity="128MiB")
    loop.run(cluster.start())
    try:
        yield loop, cluster
    finally:
        loop.run(cluster.close())
        loop.stop()


def _run_with_a_kill(loop: LoopThread, cluster: smb2.LocalCluster, tmp_path: Path, name: str,
                     replicas: int) -> tuple[subprocess.CompletedProcess[str], list[int], str]:
    """The job under torchrun; server 1 is SIGKILLed once every worker
    reached KILL_AT_STEP.  Returns the job, the steps at the kill, the victim."""
    script = tmp_path / "train.py"
    script.write_text(_WORKER)
    env = dict(os.environ, SMB2_SERVERS=",".join(cluster.addresses), OMP_NUM_THREADS="1")
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
         f"--nproc-per-node={WORKERS}", "--max-restarts=0", str(script), name, str(replicas), str(EPOCHS)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim = cluster.addresses[1]

    async def steps() -> list[int]:
        async with await smb2.connect(cluster.addresses) as client:
            try:
                info = await describe(client, name)
            except smb2.NoSuchBuffer:
                return []
            return list(info.get("steps") or [])

    at: list[int] = []
    deadline = time.monotonic() + 150
    while job.poll() is None and time.monotonic() < deadline:
        at = loop.run(steps())
        if len(at) == WORKERS and min(at) >= KILL_AT_STEP:
            loop.run(cluster.kill(1))
            break
        time.sleep(0.2)
    out, err = job.communicate(timeout=200)
    return subprocess.CompletedProcess(job.args, job.returncode, out, err), at, victim


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_training_goes_on_through_a_lost_server_with_two_replicas(
        cluster: tuple[LoopThread, smb2.LocalCluster], tmp_path: Path) -> None:
    loop, c = cluster
    job, at, victim = _run_with_a_kill(loop, c, tmp_path, "t-replicated", replicas=2)
    assert len(at) == WORKERS and min(at) >= KILL_AT_STEP, (at, job.stderr[-3000:])
    assert job.returncode == 0, job.stderr[-5000:]
    reports = [json.loads(line) for line in job.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in reports) == list(range(WORKERS)), job.stdout
    assert min(r["accuracy"] for r in reports) >= 90, reports
    assert "restart" not in job.stderr.lower() or "Restarting" not in job.stderr
    assert f"stopped using server {victim}" in job.stderr, job.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_one_replica_ends_the_job_with_what_to_do(cluster: tuple[LoopThread, smb2.LocalCluster],
                                                  tmp_path: Path) -> None:
    loop, c = cluster
    job, at, victim = _run_with_a_kill(loop, c, tmp_path, "t-single", replicas=1)
    assert len(at) == WORKERS and min(at) >= KILL_AT_STEP, (at, job.stderr[-3000:])
    assert job.returncode != 0
    assert f"lost memory server {victim} at step" in job.stderr, job.stderr[-5000:]
    assert "of store 't-single'" in job.stderr and "replicas=2" in job.stderr, job.stderr[-5000:]
