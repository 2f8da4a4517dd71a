"""AsyncOptimizer under faults, as a torch user meets them: frozen layers
that every rank must share, two launch recipes that must shard alike, a
worker that dies while the others train, a memory server lost and a store
removed mid-run, and checkpoints.  Real smb2-server processes; the dead
worker runs under real torchrun."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import smb2
from smb2.testing.waits import until
from smb2.testing.workers import torchrun
from smb2.torch.loop_thread import LoopThread
from smb2.train import faults
from smb2.train.store import StoreImage, describe

torch = pytest.importorskip("torch", reason="PyTorch is not installed here (pip install 'smb2[torch]')")

import smb2.torch as st  # noqa: E402

# ``servers``: two smb2-server processes for the module (tests/conftest.py)

@pytest.fixture
def own_cluster(threaded_cluster: Callable[..., Any]) -> Iterator[tuple[LoopThread, smb2.LocalCluster]]:
    """Two server processes of this test's own, to kill."""
    with threaded_cluster("test-own-cluster", servers=2) as own:
        yield own


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(16, 10, generator=g)
        y = (x[:, 0] > 0).long()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def test_frozen_parameters_are_rank_0s_on_every_rank(servers: str) -> None:
    # per-rank seeds: without the hand-out each rank trained against its own frozen layer
    models = [_model(seed=10 + r) for r in range(2)]
    for m in models:
        m[0].requires_grad_(False)
    rank0_frozen = models[0][0].weight.detach().clone()
    ends: dict[int, Any] = {}
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            m = models[rank]
            opt = st.AsyncOptimizer(torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1), m,
                                    name="t-frozen-ranks", servers=servers, rank=rank, world_size=2, resume=False)
            assert torch.equal(m[0].weight.detach(), rank0_frozen)
            assert torch.equal(m[0].bias.detach(), models[0][0].bias.detach())
            _steps(m, opt, 5, seed=rank)
            if rank == 1:
                with torch.no_grad():
                    m[0].weight[0, 0] += 1.0        # changed by hand: this rank now trains another model
            ends[rank] = opt.close(wait_all=60)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, [str(e) for e in errors]     # str: the message, DETAIL (which buffer) and HINT
    assert ends[0].frozen_changed == [] and ends[1].frozen_changed == ["0.weight"]
    assert ends[0].complete and ends[0].finished == [0, 1]


def test_both_launch_recipes_shard_alike(servers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # one torchrun per worker: torchrun says RANK=0 WORLD_SIZE=1 to each, smb2 is told the job's ranks
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("SMB2_RANK", "0")
    monkeypatch.setenv("SMB2_WORLD_SIZE", "2")
    assert st.resolve_rank() == (0, 2)

    async def open_module() -> tuple[int, int, int]:
        async with await smb2.connect(servers) as client:
            dm = await st.DistributedModule.open(client, "t-recipes", _model(0), rule="accumulate", lr=0.1)
            return dm.rank, dm.world, dm.store.workers

    loop = LoopThread("test-recipes")
    try:
        assert loop.run(open_module()) == (0, 2, 2)
    finally:
        loop.stop()


_WORKER = textwrap.dedent('''
    import json, os, sys, torch
    import smb2.torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    rule = dict(rule="delta", staleness=1) if sys.argv[3] == "delta" else {}      # (else: the default)
    opt = smb2.torch.AsyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, name=sys.argv[1], **rule)
    g = torch.Generator().manual_seed(opt.rank)
    for step in range(40):
        if opt.rank == 2 and step == 10 and sys.argv[4] == "dies":
            os._exit(3)                                  # this worker dies
        x = torch.randn(16, 10, generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()
        opt.step()
    if opt.rank == 2 and sys.argv[4] == "raises":
        raise RuntimeError("an error after the loop, outside any with: this rank never closes")
    end = opt.close(wait_all=float(sys.argv[5]), strict=opt.rank == 1)
    x = torch.randn(256, 10, generator=torch.Generator().manual_seed(99))
    acc = (model(x).argmax(1) == (x[:, 0] > 0).long()).float().mean().item()
    torch.save(model.state_dict(), sys.argv[2] + f"/model-{opt.rank}.pt")
    print(json.dumps({"rank": opt.rank, "accuracy": acc, "missing": [m[0] for m in end.missing],
                      "report": str(end)}), flush=True)
''')


# a script without ``if __name__ == "__main__":`` whose DataLoader starts its workers by "spawn": each
# worker runs the script again, which makes an AsyncOptimizer there
_UNGUARDED = textwrap.dedent('''
    import sys, torch
    import smb2.torch
    from torch.utils.data import DataLoader, TensorDataset
    model = torch.nn.Linear(4, 2)
    opt = smb2.torch.AsyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, name=sys.argv[1], rank=0,
                                    world_size=1)
    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    for x, y in DataLoader(data, batch_size=4, num_workers=1, multiprocessing_context="spawn"):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.close()
''')


@pytest.mark.timeout(180)
def test_a_dataloader_worker_that_runs_the_script_again_leaves_the_store_alone(servers: str, tmp_path: Path) -> None:
    # the spawned worker would open the store as rank 0 and open a new run, which ends the job's own:
    # it is refused in words before it reaches the servers, and the job's run is still its first
    script = tmp_path / "train.py"
    script.write_text(_UNGUARDED)
    out = subprocess.run([sys.executable, str(script), "t-unguarded"], env=dict(os.environ, SMB2_SERVERS=servers),
                         capture_output=True, text=True, timeout=150)
    assert out.returncode != 0
    assert ("an AsyncOptimizer of store 't-unguarded' is being made in a child process, while multiprocessing runs "
            "the main script again to start it") in out.stderr, out.stderr[-3000:]
    assert 'put the script\'s training under `if __name__ == "__main__":`' in out.stderr

    async def run_of_the_store() -> int:
        async with await smb2.connect(servers) as client:
            return int((await describe(client, "t-unguarded"))["run"])
    assert asyncio.run(run_of_the_store()) == 1


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("rule, death, wait_all", [("delta", "dies", 3), ("default", "dies", 3),
                                                   ("default", "raises", 600)])
def test_a_dead_worker_does_not_fail_the_survivors(servers: str, tmp_path: Path, rule: str, death: str,
                                                   wait_all: int) -> None:
    # rule delta: its survivors train on without the dead one; the default (allreduce), whose
    # rounds wait for every worker as DDP's do, goes on with the other two once the dead one has
    # sent no heartbeat for dead_after (5 s), each step then on the mean of their two gradients.
    # "raises": rank 2 trains every step, then stops on an error outside any ``with`` and never
    # closes: the default's others stop waiting for it at close(wait_all=600) once it has been
    # silent for dead_after (every live rank of the default beats until it closes), not after 600 s
    # (this test's timeout)
    script = tmp_path / "train.py"
    script.write_text(_WORKER)
    procs = []
    store = f"t-survivors-{rule}-{death}"
    for rank in range(3):
        env = dict(os.environ, SMB2_SERVERS=servers, SMB2_RANK=str(rank), SMB2_WORLD_SIZE="3", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            torchrun(str(script), store, str(tmp_path), rule, death, str(wait_all), max_restarts=0),
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=200) for p in procs]
    codes = [p.returncode for p in procs]
    assert codes[2] != 0                                 # the dead one
    # rank 0 (the default, strict=False): exit 0, evaluated and saved the shared model
    assert codes[0] == 0, outs[0][1][-3000:]
    report = json.loads(outs[0][0].strip().splitlines()[-1])
    assert report["missing"] == [2] and report["accuracy"] > 0.6, report
    assert f"2 of 3 workers finished store '{store}'" in report["report"]
    if rule == "default" and death == "dies":
        said = outs[0][1] + outs[1][1]
        assert "rank 2 sent no heartbeat for 5 s: the 2 other workers go on without it from step 11" in said, \
            said[-3000:]
    assert "rank 2 last reported step" in report["report"]
    if death == "raises":
        assert "an error after the loop" in outs[2][1]
        assert ("(silent for 5 s: rule 'allreduce' takes it for dead, so this rank stopped waiting for it)"
                in report["report"]), report
    assert (tmp_path / "model-0.pt").exists()
    # rank 1 asked for strict=True: the report is raised, in words
    assert codes[1] != 0
    assert f"NotifyTimeout: 2 of 3 workers finished store '{store}'" in outs[1][1], outs[1][1][-3000:]


def test_a_lost_server_is_reported_in_training_terms(own_cluster: tuple[LoopThread, smb2.LocalCluster]) -> None:
    loop, cluster = own_cluster
    model = _model(0)
    opt = st.AsyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, name="t-lost",
                            servers=cluster.addresses, rank=0, world_size=1, resume=False, rule="delta")
    _steps(model, opt, 3)
    # the server that holds the weights (this small model's fit in one stripe), which rule delta
    # pushes to and pulls from every step
    buf = opt.store.buf
    held = (buf.first + opt.store.data_off // buf.stripe) % buf.nservers
    lost = cluster.addresses[held]
    loop.run(cluster.kill(held))
    with pytest.raises(smb2.TransportError) as info:
        _steps(model, opt, 5)
    msg = str(info.value)
    assert f"rank 0 lost memory server {lost} at step" in msg and "of store 't-lost'" in msg, msg
    assert "restart that smb2-server" in (info.value.hint or "")
    assert info.value.__cause__ is None and info.value.__suppress_context__
    with pytest.raises(smb2.TransportError, match="rank 0 lost memory server"):
        opt.close()


def test_a_server_of_the_list_that_is_not_up_is_named_before_the_first_step(servers: str) -> None:
    # a listed server that never answered is not "lost at step 0": the worker says it cannot reach it
    # and what to do with the list
    model = _model(0)
    listed = f"{servers},127.0.0.1:1"
    with pytest.raises(smb2.TransportError, match=r"rank 0 cannot reach memory server 127.0.0.1:1 to train store "
                                                  r"'t-not-up'") as info:
        st.AsyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, name="t-not-up", servers=listed,
                          rank=0, world_size=1, resume=False, timeout=10)
    assert "start that smb2-server, or leave it out of the job's server list" in (info.value.hint or "")


def test_a_paused_server_is_named_while_the_step_waits_and_the_step_goes_on_after(
        own_cluster: tuple[LoopThread, smb2.LocalCluster], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # a stopped server raises nothing: its requests wait as long as their connection lives.  While a
    # step's round waits for it, the worker names it at WARNING (asked on a connection of its own, it
    # does not answer; the other server does); once it runs again the step completes and training goes on
    monkeypatch.setattr(faults, "SAY_SILENT_AFTER", 0.2)        # (the servers get PING_TIMEOUT's 5 s to answer)
    loop, cluster = own_cluster
    model = _model(0)
    opt = st.AsyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, name="t-paused",
                            servers=",".join(cluster.addresses), rank=0, world_size=1, resume=False)
    _steps(model, opt, 2)
    paused = cluster.addresses[0]            # (the small store's every stripe is on the first)
    os.kill(cluster.pid(0), signal.SIGSTOP)
    stepping = threading.Thread(target=_steps, args=(model, opt, 1))
    try:
        stepping.start()
        loop.run(until(lambda: any("does not answer" in r.getMessage() for r in caplog.records),
                       "the paused server named"))
        assert stepping.is_alive()          # (the step waits for it)
    finally:
        os.kill(cluster.pid(0), signal.SIGCONT)
    stepping.join()
    said = [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()]
    assert said[0].startswith("store 't-paused': rank 0 has waited ") and \
        f"for step 3's exchange: memory server {paused} does not answer" in said[0], said
    assert cluster.addresses[1] not in said[0]
    _steps(model, opt, 2)
    opt.close()
    assert opt.steps == 5


def test_exchanges_as_long_as_the_ordinary_ones_do_not_make_the_servers_asked(
        own_cluster: tuple[LoopThread, smb2.LocalCluster], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # a slow link's exchanges are long every time: the servers are asked (and the silent ones named)
    # only once an exchange waits three times the longest before it, here 3 x 2 s.  The first server is
    # stopped before the third exchange, so once asked it is named
    monkeypatch.setattr(faults, "SAY_SILENT_AFTER", 0.05)
    _, cluster = own_cluster

    def named() -> list[str]:
        return [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()]

    async def exchanges() -> float:
        async with await smb2.connect(cluster.addresses) as client:
            watch = faults.ExchangeWatch(client, "t-slow-link", 0)
            with watch.running(1):
                await asyncio.sleep(2.0)              # the longest so far, before the watch
            watching = asyncio.get_running_loop().create_task(watch.watch())
            try:
                with watch.running(2):
                    await asyncio.sleep(0.1)
                assert not named()
                os.kill(cluster.pid(0), signal.SIGSTOP)
                start = time.monotonic()
                with watch.running(3):
                    await until(lambda: bool(named()), "the silent server named")
                return time.monotonic() - start
            finally:
                os.kill(cluster.pid(0), signal.SIGCONT)
                watching.cancel()
                watch.close()

    waited = asyncio.run(exchanges())
    assert waited >= 6.0                              # (a lower bound: three times the longest)
    assert f"for step 3's exchange: memory server {cluster.addresses[0]} does not answer" in named()[0], named()
    assert cluster.addresses[1] not in named()[0]


def test_a_worker_connected_to_no_server_has_none_to_ask(servers: str, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    # a lazy client that reached no server (its exchanges go through its host's agent) asks nothing:
    # the watch names no one and goes on watching
    monkeypatch.setattr(faults, "SAY_SILENT_AFTER", 0.05)

    async def long_exchange() -> bool:
        async with await smb2.connect(servers, lazy=True) as client:
            watch = faults.ExchangeWatch(client, "t-lazy-watch", 0)
            watching = asyncio.get_running_loop().create_task(watch.watch())
            with watch.running(1):
                await asyncio.sleep(0.5)
            alive = not watching.done()
            watching.cancel()
            return alive

    assert asyncio.run(long_exchange())
    assert not [r for r in caplog.records if "does not answer" in r.getMessage()]


def test_servers_without_room_for_the_store_say_what_holds_it_and_what_to_do(
        threaded_cluster: Callable[..., Any]) -> None:
    # servers of 1 MiB, half of it held by an earlier job's store: the next job's store does not fit,
    # and the worker says so in a job's words (what to list, remove or restart), the bytes beside
    with threaded_cluster("test-small-cluster", servers=2, capacity="1MiB") as (_, cluster):
        addresses = ",".join(cluster.addresses)
        earlier = torch.nn.Linear(400, 400)      # 626 KiB of float32
        st.AsyncOptimizer(torch.optim.SGD(earlier.parameters(), lr=0.1), earlier, name="t-earlier", rule="delta",
                          servers=addresses, rank=0, world_size=1, resume=False).close()
        model = torch.nn.Linear(500, 500)        # 978 KiB: it would fit alone (beside the earlier one, not)
        with pytest.raises(smb2.OutOfMemory, match=r"memory server 127.0.0.1:\d+ has no room for store 't-big' "
                                                   r"\(rank 0, before the first step\)") as info:
            st.AsyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, name="t-big", rule="delta",
                              servers=addresses, rank=0, world_size=1, resume=False)
    assert "smb2 ls" in (info.value.hint or "") and "--capacity" in (info.value.hint or "")
    assert "free" in (info.value.detail or "")          # (the server's own words, with the bytes)


def test_a_removed_store_is_reported_in_training_terms(servers: str) -> None:
    model = _model(0)
    # rule delta: every step's exchange meets the missing store (allreduce's rounds go through the
    # gradient sums beside it: it would see the loss at its next heartbeat, or at close)
    opt = st.AsyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, name="t-removed",
                            servers=servers, rank=0, world_size=1, resume=False, rule="delta")
    _steps(model, opt, 3)

    async def remove() -> None:
        async with await smb2.connect(servers) as c:
            assert await c.destroy("t-removed")

    loop = LoopThread("test-remove")
    try:
        loop.run(remove())
    finally:
        loop.stop()
    with pytest.raises(smb2.NoSuchBuffer) as info:
        _steps(model, opt, 5)
    assert "store 't-removed' is gone from memory server" in str(info.value)
    assert "rank 0 was at step" in str(info.value) and "smb2 ls" in (info.value.hint or "")
    with pytest.raises(smb2.NoSuchBuffer):
        opt.close()


def test_checkpoints_every_k_steps_and_at_close(servers: str, tmp_path: Path) -> None:
    # the directory does not exist yet: made at construction, not at the first save
    path = tmp_path / "new" / "dir" / "ck-{step}.smb2"
    model = _model(0)
    # rule delta: the store holds the shared weights at every step (under allreduce, the default, the
    # store's weights are written at close only)
    opt = st.AsyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, name="t-ckpt", servers=servers,
                            rank=0, world_size=1, resume=False, rule="delta", checkpoint_every=40,
                            checkpoint_path=str(path))
    assert path.parent.is_dir()
    _steps(model, opt, 99)
    opt.close()
    assert sorted(p.name for p in path.parent.glob("*.smb2")) == ["ck-40.smb2", "ck-80.smb2", "ck-99.smb2"]
    # the last one with the optimizer's state saved at close() beside it (test_torch_resume tests those)
    assert (path.parent / "ck-99.smb2.optim" / "0").is_file()


def test_a_checkpoint_under_allreduce_holds_the_weights_of_the_step_it_is_named_after(servers: str,
                                                                                   tmp_path: Path) -> None:
    # under allreduce (the default) the weights live on the workers: rank 0 writes them into the store
    # before each checkpoint and at close, so no checkpoint holds the starting weights; the last weights
    # written at close wait for a save still running (a loaded CI machine caught close overwriting step 10's)
    path = tmp_path / "ck-{step}.smb2"
    model = _model(0)
    opt = st.AsyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, name="t-ckpt-ar", servers=servers,
                            rank=0, world_size=1, resume=False, checkpoint_every=5, checkpoint_path=str(path))
    assert opt.rule_name == "allreduce"
    # the save of step 10 is held until close() has begun: close must not write the last weights under it
    class SavesStep10AfterCloseBegan:
        def __init__(self, client: Any) -> None:
            self.client = client

        def __getattr__(self, attr: str) -> Any:
            return getattr(self.client, attr)

        async def checkpoint(self, name: str, to: str | Path) -> None:
            if "ck-10." in str(to):
                while not opt.closed:  # noqa: ASYNC110 (set by the training thread, not on this loop)
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)   # room for a write that does not wait for the save
            await self.client.checkpoint(name, to)

    opt.store.client = SavesStep10AfterCloseBegan(opt.store.client)
    after = {}
    for step in range(1, 13):
        _steps(model, opt, 1, seed=step)
        after[step] = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    offsets = {n: opt.store.flat_offset(n) for n in after[1]}
    opt.close()
    assert sorted(p.name for p in tmp_path.glob("*.smb2")) == ["ck-10.smb2", "ck-12.smb2", "ck-5.smb2"]
    for step in (5, 10, 12):
        flat = asyncio.run(StoreImage.load(tmp_path / f"ck-{step}.smb2")).data.view(np.float32)
        for n, want in after[step].items():
            assert np.array_equal(flat[offsets[n]:offsets[n] + want.size], want.ravel()), (step, n)
        assert not np.array_equal(flat[offsets["0.weight"]:offsets["0.weight"] + after[1]["0.weight"].size],
                                  _model(0)[0].weight.detach().numpy().ravel())


def test_a_checkpoint_directory_that_cannot_be_made_is_refused_at_once(servers: str, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    model = _model(0)
    with pytest.raises(smb2.PersistenceError, match="checkpoint directory .*a-file/sub cannot be made"):
        st.AsyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, name="t-ckpt-bad", servers=servers,
                          rank=0, world_size=1, resume=False, checkpoint_every=5,
                          checkpoint_path=str(tmp_path / "a-file" / "sub" / "ck-{step}.smb2"))
