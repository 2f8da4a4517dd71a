"""The life of a training job on a parameter store: runs (generations) that
start fresh or resume, the start and end barriers, heartbeats and stalled
ranks, workers killed and restarted, a restarted rank 0, placement over all
servers, checkpoints, ``smb2 ls`` / ``smb2 rm``.

Real servers (LocalCluster); where a process must die, a real worker process
is killed with SIGKILL."""

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
from typing import Any

import numpy as np
import pytest

import smb2
from smb2 import cli
from smb2.testing.workers import torchrun as torchrun_command
from smb2.train import ParameterStore, beside
from smb2.train import lifecycle as lc
from smb2.train import store as store_module
from smb2.train.store import choose_stripe, resolve_rank


def _params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((16, 8)).astype(np.float32), "b": rng.standard_normal(8).astype(np.float32)}


def _ones() -> dict[str, np.ndarray]:
    return {k: np.ones_like(v) for k, v in _params().items()}


async def _open_all(cluster: smb2.LocalCluster, name: str, workers: int, *, first: int = 0,
                    **kw: Any) -> list[ParameterStore]:
    """Every rank of a job opens the store, each with its own client; rank
    ``first`` starts first (the others open while it waits)."""
    clients = [await cluster.connect() for _ in range(workers)]
    order = [first] + [r for r in range(workers) if r != first]
    tasks = {}
    for r in order:
        tasks[r] = asyncio.ensure_future(
            ParameterStore.open(clients[r], name, _params(r), workers=workers, rank=r, timeout=20, **kw))
        await asyncio.sleep(0.05)
    return [await tasks[r] for r in range(workers)]


async def test_a_rank_says_what_it_waits_for_at_the_start(cluster: smb2.LocalCluster, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    # a rank waiting at the start says at WARNING whom it waits for, after SAY_WAITING_AFTER s (10 s by
    # default; a rank never started would otherwise leave it silent until its timeout, 2 minutes under
    # AsyncOptimizer): rank 1 waiting for rank 0's store, rank 0 waiting for rank 1 to join
    monkeypatch.setattr(store_module, "SAY_WAITING_AFTER", 0.05)
    client = await cluster.connect()
    with caplog.at_level(logging.WARNING, logger="smb2.train"):
        with pytest.raises(smb2.NotifyTimeout, match="rank 0 did not create store 'lc-wait-alone'"):
            await ParameterStore.open(client, "lc-wait-alone", _params(), workers=2, rank=1, timeout=0.5)
        alone = await ParameterStore.open(client, "lc-wait", _params(), workers=2, rank=0)
        with pytest.raises(smb2.NotifyTimeout, match="1 of 2 workers joined store 'lc-wait'"):
            await alone.join(timeout=0.5)
        # rank 1 says the count it polls (rank 0 alone reads every rank's row to name them)
        late = await ParameterStore.open(await cluster.connect(), "lc-wait-late", _params(), workers=3, rank=0)
        other = await ParameterStore.open(await cluster.connect(), "lc-wait-late", _params(), workers=3, rank=1)
        ends = await asyncio.gather(late.join(timeout=0.5), other.join(timeout=0.5), return_exceptions=True)
        assert all(isinstance(e, smb2.NotifyTimeout) and "2 of 3 workers joined store 'lc-wait-late'" in str(e)
                   for e in ends), ends
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("rank 1 waits for rank 0 to create store 'lc-wait-alone'") for m in said), said
    assert any(m.startswith("store 'lc-wait': rank 0 waits for rank 1 to join (1 of 2 joined;") for m in said), said
    assert any(m.startswith("store 'lc-wait-late': rank 1 waits for 1 of the 3 ranks to join (2 of 3 joined;")
               for m in said), said


async def _train(store: ParameterStore, steps: int) -> None:
    for s in range(store.start_step + 1, store.start_step + steps + 1):
        await store.push(_ones())
        await store.heartbeat(s)
    await store.heartbeat(store.start_step + steps, force=True)


async def _smb2(*args: str) -> tuple[int, str, str]:
    """``smb2 ARGS`` in a thread of this process: its exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return cli.main(list(args))
    rc = await asyncio.to_thread(run)
    return rc, out.getvalue(), err.getvalue()


def _words(store: ParameterStore) -> lc.Control:
    assert store.control is not None
    return store.control


# -- re-runs ----------------------------------------------------------------------

async def test_rerun_after_a_crash_resumes_then_starts_fresh_when_asked(cluster: smb2.LocalCluster,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    # run 1: two ranks train 5 and 7 steps, then "crash" (never finish)
    run1 = await _open_all(cluster, "lc-rerun", 2)
    await asyncio.gather(*(s.join(timeout=10) for s in run1))
    await asyncio.gather(_train(run1[0], 5), _train(run1[1], 7))
    await run1[0].pull()
    weights1 = run1[0].flat().copy()
    assert await run1[0].read_version() == 12

    # run 2, default resume="auto": rank 1 arrives first and sees run 1 (it
    # was in it: it waits for rank 0's new run instead of rejoining)
    with caplog.at_level(logging.WARNING, logger="smb2.train"):
        run2 = await _open_all(cluster, "lc-rerun", 2, first=1)
    assert "resuming store 'lc-rerun' at version 12, step 5 (an earlier run did not finish); " \
           "pass resume=False to start over" in caplog.text
    for s, step in zip(run2, (5, 7)):
        assert (s.generation, s.resumed, s.start_step) == (2, True, step)
        assert np.array_equal(s.flat(), weights1)          # the old weights, with their steps
    c = await run2[0].refresh()
    assert c.generation == 2 and c.version == 12 and c.steps.tolist() == [5, 7]
    # the new run's start barrier does not pass on run 1's joins
    assert c.joined.tolist() == [2, 1] and c.missing() == [1] and c.finished.tolist() == [0, 0]
    with pytest.raises(smb2.NotifyTimeout, match=r"1 of 2 workers joined store 'lc-rerun' within 0.3 s "
                                                 r"\(missing ranks: 1\); check WORLD_SIZE \(2\)"):
        await run2[0].join(timeout=0.3)
    await asyncio.gather(*(s.join(timeout=10) for s in run2))

    # run 3, resume=False: every control word starts over, and the weights
    run3 = await _open_all(cluster, "lc-rerun", 2, resume=False)
    for s in run3:
        assert (s.generation, s.resumed, s.start_step) == (3, False, 0)
        assert np.array_equal(s.params["w"], _params(0)["w"])    # rank 0's initial values
    c = await run3[0].refresh()
    assert c.generation == 3 and c.version == 0 and not c.stopped
    assert c.steps.tolist() == [0, 0] and c.joined.tolist() == [3, 0] and c.finished.tolist() == [0, 0]
    assert c.age(0) < 5 and c.age(1) < 5        # both heard from in this run
    # ... and the old run's ranks are told at their next heartbeat
    for old in run1 + run2:
        with pytest.raises(smb2.InterfaceError, match="re-opened by a newer run"):
            await old.heartbeat(99, force=True)


async def test_rerun_after_a_finished_run_starts_fresh(cluster: smb2.LocalCluster,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    run1 = await _open_all(cluster, "lc-done", 3)
    await asyncio.gather(*(s.join(timeout=10) for s in run1))
    await asyncio.gather(*(_train(s, 3) for s in run1))
    await asyncio.gather(*(s.finish() for s in run1))
    await asyncio.gather(*(s.wait_finished(timeout=10) for s in run1))
    assert (await run1[0].refresh()).run_finished()

    with caplog.at_level(logging.INFO, logger="smb2.train"):
        run2 = await _open_all(cluster, "lc-done", 3, first=2)
    assert "run 2 starts fresh (the earlier run finished)" in caplog.text
    for s in run2:
        assert (s.generation, s.resumed, s.start_step) == (2, False, 0)
        assert np.array_equal(s.params["b"], _params(0)["b"])
    c = await run2[0].refresh()
    assert c.version == 0 and c.steps.tolist() == [0, 0, 0] and not c.run_finished()
    # the end barrier of the new run does not pass on the old run's finish
    await run2[0].finish()
    with pytest.raises(smb2.NotifyTimeout, match=r"1 of 3 workers finished store 'lc-done' within 0.2 s; "
                                                 r"rank 1 has not joined; rank 2 has not joined"):
        await run2[0].wait_finished(timeout=0.2)


async def test_resume_true_keeps_a_finished_runs_weights(cluster: smb2.LocalCluster) -> None:
    (s,) = await _open_all(cluster, "lc-resume", 1)
    await s.join()
    await _train(s, 4)
    await s.finish()
    (again,) = await _open_all(cluster, "lc-resume", 1, resume=True)
    assert (again.generation, again.resumed, again.start_step) == (2, True, 4)
    assert np.array_equal(again.flat(), s.flat())


async def test_a_run_that_changes_the_rule_says_so(cluster: smb2.LocalCluster,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    # as a script resumed after the library's default rule changed: the weights go on, the log says
    # which rule the store was made for and how to keep it
    (s,) = await _open_all(cluster, "lc-rule", 1)
    await s.join()
    await _train(s, 2)
    with caplog.at_level(logging.WARNING, logger="smb2.train"):
        (again,) = await _open_all(cluster, "lc-rule", 1, rule="delta")
    assert again.resumed and np.array_equal(again.flat(), s.flat())
    assert ("store 'lc-rule' was made for rule 'accumulate' and this job updates it with rule 'delta': the "
            "weights and the optimizer states go on, with the new rule's arithmetic (pass rule='accumulate' to "
            "keep the old one)") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="smb2.train"):
        await _open_all(cluster, "lc-rule", 1)
    assert "was made for rule" not in caplog.text      # the rule it was made for: nothing to say


async def test_a_late_rank_follows_rank_0_into_its_new_run(cluster: smb2.LocalCluster) -> None:
    """Rank 2 of a new job arrives while the old run (which never had a
    rank 2) still looks open, and joins it; rank 0 of the new job then
    opens a fresh run: rank 2's barrier moves it there, with the new weights."""
    c = await cluster.connect()
    old0 = await ParameterStore.open(c, "lc-late", _params(7), workers=3, rank=0)
    c1 = await cluster.connect()
    old1 = await ParameterStore.open(c1, "lc-late", _params(7), workers=3, rank=1)
    await old1.heartbeat(3, force=True)
    # the new job's rank 2 comes first and picks the old, open run
    c2 = await cluster.connect()
    late = await ParameterStore.open(c2, "lc-late", _params(2), workers=3, rank=2)
    assert late.generation == 1
    new0 = await ParameterStore.open(await cluster.connect(), "lc-late", _params(0), workers=3, rank=0,
                                     resume=False)
    barrier = asyncio.ensure_future(late.join(timeout=10))
    new1 = await ParameterStore.open(await cluster.connect(), "lc-late", _params(1), workers=3, rank=1)
    await asyncio.gather(barrier, new0.join(timeout=10), new1.join(timeout=10))
    assert late.generation == new0.generation == new1.generation == 2
    assert np.array_equal(late.params["w"], _params(0)["w"])
    with pytest.raises(smb2.InterfaceError, match="re-opened by a newer run"):
        await old0.join(timeout=1)


async def test_a_second_process_launched_as_a_rank_is_refused_at_the_barrier(cluster: smb2.LocalCluster) -> None:
    """Two processes of a new job given rank 1 (a launch script's mistake):
    both find the run rank 0 opened, the first joins it, and the second is
    refused at the start barrier, in words, before it counts (a round's mean
    would count rank 1 twice); the job goes on with the first."""
    rank0 = await ParameterStore.open(await cluster.connect(), "lc-dup", _params(0), workers=2, rank=0)
    first, second = [await ParameterStore.open(await cluster.connect(), "lc-dup", _params(1), workers=2, rank=1)
                     for _ in range(2)]
    await asyncio.gather(rank0.join(timeout=10), first.join(timeout=10))
    with pytest.raises(smb2.InterfaceError, match="rank 1 of store 'lc-dup' joined run 1 already: another process "
                                                  "was launched as rank 1"):
        await second.join(timeout=10)
    assert lc.joins_counted((await rank0.refresh()).words, 1) == 2     # (counted once)
    await asyncio.gather(rank0.finish(), first.finish())
    assert (await rank0.await_finished(timeout=10)).complete


# -- heartbeats, stalls, the end -----------------------------------------------------

async def test_a_stalled_rank_is_named(cluster: smb2.LocalCluster) -> None:
    stores = await _open_all(cluster, "lc-stall", 2)
    await asyncio.gather(*(s.join(timeout=10) for s in stores))
    await stores[1].heartbeat(340, force=True)     # ... and then nothing
    await _train(stores[0], 3)
    await stores[0].finish()
    await asyncio.sleep(1.1)
    with pytest.raises(smb2.NotifyTimeout, match=r"1 of 2 workers finished store 'lc-stall' within 0.2 s; "
                                                 r"rank 1 last reported step 340, [12] s ago"):
        await stores[0].wait_finished(timeout=0.2)
    stalled = stores[0].stalled(1.0)
    assert [(r, step) for r, step, _age in stalled] == [(1, 340)] and stalled[0][2] >= 1.0
    assert stores[0].stalled(30) == []
    # the other waits speak of updates and steps too, not of bytes
    with pytest.raises(smb2.NotifyTimeout, match=r"store 'lc-stall' got 3 updates, still fewer than 5 after 0.1 s"):
        await stores[0].wait_version(5, timeout=0.1)
    with pytest.raises(smb2.NotifyTimeout, match=r"end policy of store 'lc-stall' did not fire within 0.1 s "
                                                 r"\(the ranks' steps: \[3, 340\]\)"):
        await stores[0].wait_stopped(timeout=0.1)
    await stores[1].finish()
    await stores[0].wait_finished(timeout=5)
    # finishing destroys nothing: the store is still there for evaluation
    assert "lc-stall" in await stores[0].client.buffers()


async def test_rank_world_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("SMB2_RANK", "SMB2_WORLD_SIZE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert resolve_rank() == (0, 1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")          # one torchrun per worker: torchrun's own view ...
    monkeypatch.setenv("SMB2_RANK", "2")
    monkeypatch.setenv("SMB2_WORLD_SIZE", "4")     # ... and the job's
    assert resolve_rank() == (2, 4)
    assert resolve_rank(1, 3) == (1, 3)
    monkeypatch.setenv("SMB2_RANK", "x")
    with pytest.raises(smb2.InvalidArgumentError, match="SMB2_RANK='x' is not an integer"):
        resolve_rank()
    with pytest.raises(smb2.InvalidArgumentError, match="WORLD_SIZE=4"):
        resolve_rank(4, 4)


def test_host_workers_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    # how many pushes a host agent gathers into one: the recipe's count, else torchrun's, else 1
    for k in ("SMB2_HOST_WORKERS", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert lc.host_workers() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert lc.host_workers() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")        # one torchrun per worker (the Slurm recipe) ...
    monkeypatch.setenv("SMB2_HOST_WORKERS", "4")       # ... which says the node's count
    assert lc.host_workers() == 4
    monkeypatch.setenv("SMB2_HOST_WORKERS", "0")
    with pytest.raises(smb2.InvalidArgumentError, match="SMB2_HOST_WORKERS='0' is not a positive integer"):
        lc.host_workers()


Ranks = dict[int, tuple[int, int, float, int]]


def _control(workers: int, gen: int, ranks: Ranks, now: int = 10_000_000) -> lc.Control:
    """Control words: run ``gen``; per rank (joined run, step, heartbeat age s, finished run)."""
    words = np.zeros(lc.slots_for(workers), np.int64)
    words[lc.GENERATION] = gen
    for r, (joined, step, age, finished) in ranks.items():
        base = lc.rank_word(r, 0)
        words[base:base + 4] = [joined, step, now - int(age * 1000), finished]
    return lc.Control.parse(words, workers, at_ms=now)


@pytest.mark.parametrize("ranks,resume,restarted,action", [
    ({}, "auto", False, "fresh"),                                                   # (run 0: a new store)
    ({0: (1, 5, 1, 0), 1: (1, 7, 1, 0)}, "auto", False, "resume"),                  # crashed (or running)
    ({0: (1, 5, 1, 1), 1: (1, 7, 1, 1)}, "auto", False, "fresh"),                   # finished
    ({0: (1, 5, 1, 1), 1: (1, 7, 1, 1)}, True, False, "resume"),
    ({0: (1, 5, 1, 0), 1: (1, 7, 1, 0)}, False, False, "fresh"),
    ({0: (1, 5, 1, 0), 1: (1, 7, 1, 0)}, False, True, "rejoin"),                    # the run goes on
    ({0: (1, 5, 90, 0), 1: (1, 7, 90, 0)}, False, True, "resume"),                  # all silent: a new run
    ({0: (1, 5, 90, 1), 1: (1, 7, 90, 1)}, "auto", True, "rejoin"),                 # crashed after finishing
])
def test_rank0_decides(ranks: Ranks, resume: str | bool, restarted: bool,
                       action: str) -> None:
    c = _control(2, 1 if ranks else 0, ranks)
    assert lc.decide_rank0(c, resume=resume, restarted=restarted, stale_after=60).action == action


@pytest.mark.parametrize("ranks,restarted,action", [
    ({}, False, "wait"),                                                            # no run yet
    ({0: (2, 0, 1, 0), 1: (1, 7, 1, 0)}, False, "join"),                            # rank 0 opened run 2
    ({0: (2, 0, 1, 0), 1: (2, 7, 1, 0)}, False, "wait"),                            # ... we were in it: old
    ({0: (2, 0, 1, 0), 1: (2, 7, 1, 0)}, True, "rejoin"),                           # restarted: back in
    ({0: (2, 0, 90, 0), 1: (1, 7, 1, 0)}, False, "wait"),                           # rank 0 silent
    ({0: (2, 0, 1, 2), 1: (1, 7, 1, 0)}, False, "wait"),                            # rank 0 finished run 2
    ({0: (2, 0, 90, 0), 1: (2, 7, 90, 0)}, True, "wait"),                           # all silent: wait for rank 0
])
def test_other_ranks_decide(ranks: Ranks, restarted: bool, action: str) -> None:
    c = _control(2, 2 if ranks else 0, ranks)
    assert lc.decide_other(c, 1, restarted=restarted, stale_after=60).action == action



def test_a_lockstep_group_restarted_by_torchrun_opens_a_new_run() -> None:
    # rule allreduce launched by one torchrun for the group (rejoinable=False: torchrun restarts the
    # whole group, so no one is left to take a rank back): where another rule's restarted rank goes back into the run
    # that goes on, a restarted rank 0 opens a new, resumed run and the others wait for it, then join
    alive = {0: (2, 5, 1, 0), 1: (2, 7, 1, 0)}
    c = _control(2, 2, alive)
    assert lc.decide_rank0(c, resume=False, restarted=True, stale_after=60).action == "rejoin"
    assert lc.decide_rank0(c, resume=False, restarted=True, stale_after=60, rejoinable=False).action == "resume"
    assert lc.decide_other(c, 1, restarted=True, stale_after=60).action == "rejoin"
    assert lc.decide_other(c, 1, restarted=True, stale_after=60, rejoinable=False).action == "wait"
    opened = _control(2, 3, {0: (3, 0, 1, 0), 1: (2, 7, 1, 0)})
    assert lc.decide_other(opened, 1, restarted=True, stale_after=60, rejoinable=False).action == "join"

@pytest.mark.parametrize(("launcher_world", "world", "alone"), [
    (None, 4, True),        # one process per worker (SMB2_RANK / SMB2_WORLD_SIZE, or rank= / world_size=)
    ("1", 4, True),         # one torchrun per worker: its restart is this worker's alone
    ("4", 4, False),        # one torchrun for the job: a restart restarts the whole group
    (None, 1, False),       # a job of one: nothing to rejoin
])
def test_a_restart_is_a_workers_own_only_under_a_launcher_of_one(monkeypatch: pytest.MonkeyPatch,
                                                                  launcher_world: str | None, world: int,
                                                                  alone: bool) -> None:
    if launcher_world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", launcher_world)
    assert lc.restarts_alone(world) is alone


# -- placement -------------------------------------------------------------------------

async def test_a_small_store_uses_every_server(cluster: smb2.LocalCluster) -> None:
    """A 40 KB model on 4 servers, far below one default stripe (1 MiB):
    each server holds a share of it and serves a share of each pull (over
    TCP, where the servers count what they send)."""
    client = await cluster.connect(transport="tcp")
    params = {"w": np.ones((100, 100), np.float32)}
    store = await ParameterStore.open(client, "lc-place", params)
    assert store.buf.stripe == store.layout.stripe_for(4) < smb2.client.DEFAULT_STRIPE
    before = [s["bytes_out"] for s in await client.stat()]
    await store.pull()
    stats = await client.stat()
    sizes = [s["buffers"]["lc-place"]["size"] for s in stats]
    served = [s["bytes_out"] - b for s, b in zip(stats, before)]
    share = store.layout.data_len / 4
    assert all(size >= 0.5 * share for size in sizes), sizes
    assert all(n >= 0.5 * share for n in served), served
    assert choose_stripe(10 << 30, 4) == smb2.client.DEFAULT_STRIPE      # a big model: the default
    assert choose_stripe(1, 8) == 4096


# -- checkpoints -------------------------------------------------------------------------

async def test_checkpoint_every_k_steps_and_start_from_one(cluster: smb2.LocalCluster, tmp_path: Path) -> None:
    (s,) = await _open_all(cluster, "lc-ckpt", 1, checkpoint_every=3, checkpoint_path=tmp_path / "c-{step}.ckpt")
    await s.join()
    for step in range(1, 7):
        if step == 4:       # (rank 0's optimizer state, as smb2.torch saves it: copied beside the checkpoint)
            state = await beside.make(s.client, "lc-ckpt", store_module.optimizer_state_what(0), 4096, replicas=1)
            await state.write(0, np.arange(4096, dtype=np.uint8))
        await s.push(_ones())
        await s.heartbeat(step, force=True)
    await s.finish()        # waits for the checkpoint of step 6
    assert sorted(await asyncio.to_thread(os.listdir, tmp_path)) == ["c-3.ckpt", "c-6.ckpt", "c-6.ckpt.optim"]
    # a new job (another store name) starts from the checkpoint of step 6
    (t,) = await _open_all(cluster, "lc-ckpt-2", 1, init_from=tmp_path / "c-6.ckpt")
    assert (t.generation, t.resumed, t.start_step) == (1, True, 6)
    assert await t.read_version() == 6
    await s.pull()
    assert np.array_equal(t.flat(), s.flat())                        # the weights of step 6
    np.testing.assert_allclose(t.params["b"], _params(0)["b"] - 0.01 * 6, atol=1e-6)
    # a job of another size: the ranks both have keep their steps and optimizer states (rank 0's here)
    two = await _open_all(cluster, "lc-ckpt-5", 2, init_from=tmp_path / "c-6.ckpt")
    assert [(u.resumed, u.start_step) for u in two] == [(True, 6), (True, 0)]
    assert np.array_equal(two[0].flat(), s.flat()) and np.array_equal(two[1].flat(), s.flat())
    restored = await two[0].client.attach(store_module.optimizer_state_name("lc-ckpt-5", 0))
    assert np.array_equal(await restored.read(0, 4096), np.arange(4096, dtype=np.uint8))
    assert _words(two[0]).origin == _words(s).origin        # the lineage the restored state is of
    with pytest.raises(smb2.InvalidArgumentError, match="another model"):
        await ParameterStore.open(await cluster.connect(), "lc-ckpt-3", {"x": np.zeros(3, np.float32)},
                                  init_from=tmp_path / "c-6.ckpt")
    with pytest.raises(smb2.InvalidArgumentError, match="checkpoint_path"):
        await ParameterStore.open(await cluster.connect(), "lc-ckpt-4", _params(), checkpoint_every=2)


# -- real processes: killed and restarted ---------------------------------------------------

WORKER = """
import asyncio, json, os, sys, time
import numpy as np
import smb2
from smb2.train import ParameterStore

def params(seed):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((16, 8)).astype(np.float32), "b": rng.standard_normal(8).astype(np.float32)}

async def main(servers, name, steps, pause, die_at):
    rank, world = int(os.environ["SMB2_RANK"]), int(os.environ["SMB2_WORLD_SIZE"])
    async with await smb2.connect(servers) as c:
        s = await ParameterStore.open(c, name, params(100 + rank), timeout=30, stale_after=5)
        await s.join(timeout=30)
        print(json.dumps({"event": "open", "generation": s.generation, "resumed": s.resumed,
                          "start_step": s.start_step, "b": s.params["b"].tolist()}), flush=True)
        ones = {k: np.ones_like(v) for k, v in s.params.items()}
        for step in range(s.start_step + 1, steps + 1):
            if s.rule.pull_each_step:
                await s.pull()
            await s.push(ones)
            await s.heartbeat(step, force=True)
            print(json.dumps({"event": "step", "step": step}), flush=True)
            if step == die_at and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                os._exit(3)         # a crash, in the first attempt only
            await asyncio.sleep(pause)
        await s.finish()
        await s.wait_finished(timeout=60)
        print(json.dumps({"event": "done", "version": await s.read_version()}), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]),
                 int(sys.argv[5]) if len(sys.argv) > 5 else 0))
"""


class Worker:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.events: list[dict[str, Any]] = []

    @classmethod
    async def start(cls, cluster: smb2.LocalCluster, name: str, rank: int, world: int, steps: int,
                    pause: float, restart: int = 0, torchrun: Path | None = None, die_at: int = 0) -> Worker:
        """A worker process; with ``torchrun`` (the script's path), launched
        as one torchrun per worker that restarts it once."""
        env = {**os.environ, "SMB2_RANK": str(rank), "SMB2_WORLD_SIZE": str(world),
               "TORCHELASTIC_RESTART_COUNT": str(restart)}
        args = [",".join(cluster.addresses), name, str(steps), str(pause), str(die_at)]
        if torchrun is None:
            cmd = [sys.executable, "-c", WORKER, *args]
        else:
            del env["TORCHELASTIC_RESTART_COUNT"]
            cmd = torchrun_command(str(torchrun), *args, max_restarts=1, monitor_interval=0.2)
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE, env=env)
        return cls(proc)

    async def until(self, event: str, at_least: int = 0, timeout: float = 60) -> dict[str, Any]:
        """Read events until ``event`` (a step >= at_least)."""
        assert self.proc.stdout is not None
        async def read() -> dict[str, Any]:
            while True:
                line = await self.proc.stdout.readline()       # type: ignore[union-attr]
                if not line:
                    err = await self.proc.stderr.read()         # type: ignore[union-attr]
                    raise AssertionError(f"worker ended before {event}: {err.decode()[-2000:]}")
                e = json.loads(line)
                self.events.append(e)
                if e["event"] == event and e.get("step", 0) >= at_least:
                    return e
        return await asyncio.wait_for(read(), timeout)

    async def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()

    async def done(self) -> dict[str, Any]:
        e = await self.until("done")
        assert await self.proc.wait() == 0
        return e


@pytest.mark.slow
async def test_a_killed_worker_restarted_resumes_from_the_shared_weights(cluster: smb2.LocalCluster) -> None:
    workers = [await Worker.start(cluster, "lc-kill", r, 2, steps=40, pause=0.05) for r in range(2)]
    opened = [await w.until("open") for w in workers]
    assert [o["generation"] for o in opened] == [1, 1]
    await workers[1].until("step", 10)
    await workers[1].kill()                                    # kill -9, mid-run
    # torchrun --max-restarts would start it again with the restart count set
    again = await Worker.start(cluster, "lc-kill", 1, 2, steps=40, pause=0.05, restart=1)
    back = await again.until("open")
    # it rejoined the same run, from its last published step, with the shared
    # weights (not its own initial values)
    assert back["generation"] == 1 and back["resumed"] is True and back["start_step"] >= 10
    assert back["b"] != _params(101)["b"].tolist()
    done = [await workers[0].done(), await again.done()]
    assert all(d["version"] >= 80 - 1 for d in done)         # 40 steps each (a killed push may be lost)
    c = await cluster.connect()
    store = await ParameterStore.attach(c, "lc-kill")
    ctl = await store.refresh()
    assert ctl.generation == 1 and ctl.steps.tolist() == [40, 40] and ctl.run_finished()


@pytest.mark.parametrize("victim", [1, 0])
async def test_a_worker_started_again_without_a_restart_count_rejoins(cluster: smb2.LocalCluster,
                                                                      victim: int) -> None:
    # a container its kubelet restarted, or a pod made again for its index on another node: the
    # worker starts with no torchrun restart count, but it was in the run, which goes on (the other
    # beats): it takes itself for restarted and goes back in, where it waited for a new run (rank 1)
    # or opened one under the other's feet (rank 0)
    name = f"lc-unsaid-{victim}"
    workers = [await Worker.start(cluster, name, r, 2, steps=200, pause=0.05) for r in range(2)]
    await asyncio.gather(*(w.until("open") for w in workers))
    await workers[victim].until("step", 10)
    await workers[victim].kill()
    again = await Worker.start(cluster, name, victim, 2, steps=200, pause=0.05, restart=0)
    back = await again.until("open")
    assert back["generation"] == 1 and back["resumed"] is True and back["start_step"] >= 10, back
    await asyncio.gather(again.done(), workers[1 - victim].done())
    c = await cluster.connect()
    ctl = await (await ParameterStore.attach(c, name)).refresh()
    assert ctl.generation == 1 and ctl.run_finished() and ctl.steps.tolist() == [200, 200]


async def test_a_rank_launched_twice_is_refused(cluster: smb2.LocalCluster) -> None:
    # a second process given a rank that trains already (a launch script's mistake) is not taken for
    # that rank's restart, which would take the live one's place: its heartbeat moves, and it is said
    workers = [await Worker.start(cluster, "lc-twice", r, 2, steps=200, pause=0.05) for r in range(2)]
    await asyncio.gather(*(w.until("step", 5) for w in workers))
    twice = await Worker.start(cluster, "lc-twice", 1, 2, steps=200, pause=0.05, restart=0)
    with pytest.raises(AssertionError, match="another process holds this rank"):
        await twice.until("open")
    assert await twice.proc.wait() != 0
    await asyncio.gather(*(w.done() for w in workers))


@pytest.mark.slow
async def test_a_restarted_rank_0_leaves_a_ready_store_untouched(cluster: smb2.LocalCluster) -> None:
    workers = [await Worker.start(cluster, "lc-r0", r, 2, steps=30, pause=0.05) for r in range(2)]
    await asyncio.gather(*(w.until("open") for w in workers))
    await workers[0].until("step", 8)
    await workers[0].kill()
    c = await cluster.connect()
    observer = await ParameterStore.attach(c, "lc-r0")
    version_before = await observer.read_version()
    again = await Worker.start(cluster, "lc-r0", 0, 2, steps=30, pause=0.05, restart=1)
    back = await again.until("open")
    assert back["generation"] == 1 and back["start_step"] >= 8
    # its own initial values were not written: the shared weights moved on
    assert back["b"] != _params(100)["b"].tolist()
    assert await observer.read_version() >= version_before
    await asyncio.gather(again.done(), workers[1].done())
    ctl = await observer.refresh()
    assert ctl.generation == 1 and ctl.run_finished()


@pytest.mark.slow
async def test_a_whole_job_rerun_in_processes_after_kill(cluster: smb2.LocalCluster) -> None:
    """Both workers killed; the job launched again (no restart count): a new
    run resumes the old one's weights and steps and finishes."""
    workers = [await Worker.start(cluster, "lc-all", r, 2, steps=20, pause=0.05) for r in range(2)]
    await asyncio.gather(*(w.until("step", 5) for w in workers))
    for w in workers:
        await w.kill()
    rerun = [await Worker.start(cluster, "lc-all", r, 2, steps=20, pause=0.02) for r in (1, 0)]
    opened = [await w.until("open") for w in rerun]
    assert all(o["generation"] == 2 and o["resumed"] and o["start_step"] >= 5 for o in opened)
    await asyncio.gather(*(w.done() for w in rerun))


@pytest.mark.slow
def test_one_torchrun_per_worker_restarts_only_the_failed_one(tmp_path: Path) -> None:
    """What docs/training.md tells a user to run: one torchrun per worker
    (SMB2_RANK / SMB2_WORLD_SIZE, --max-restarts).  Rank 1 crashes at step
    8; its torchrun restarts it, it rejoins the run from its step, and rank
    0 never stops.  (One event loop is enough: the workers are processes.)"""
    pytest.importorskip("torch", reason="torchrun comes with PyTorch (pip install 'smb2[torch]')")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)

    async def main() -> None:
        async with smb2.LocalCluster(servers=2) as cluster:
            workers = [await Worker.start(cluster, "lc-torchrun", r, 2, steps=40, pause=0.1, torchrun=script,
                                          die_at=8 if r == 1 else 0) for r in range(2)]
            await asyncio.gather(*(w.until("open", timeout=100) for w in workers))
            back = await workers[1].until("open", timeout=100)       # the second attempt
            assert back["generation"] == 1 and back["resumed"] is True and back["start_step"] >= 8
            await asyncio.gather(*(w.done() for w in workers))
            assert [e["event"] for e in workers[0].events].count("open") == 1
            steps0 = [e["step"] for e in workers[0].events if e["event"] == "step"]
            assert steps0 == list(range(1, 41))
    asyncio.run(main())


# -- smb2 ls / smb2 rm ----------------------------------------------------------------------

async def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "smb2.cli", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, **(env or {})})
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_smb2_ls_and_rm(cluster: smb2.LocalCluster) -> None:
    client = await cluster.connect()
    stores = await _open_all(cluster, "lc-ls", 2)
    await asyncio.gather(*(s.join(timeout=10) for s in stores))
    await asyncio.gather(_train(stores[0], 3), _train(stores[1], 4))
    await stores[0].finish()
    await client.create("lc-raw", 1000)
    servers = cluster.addresses
    rc, out, err = await _cli("ls", *servers)
    assert rc == 0, err
    line = next(ln for ln in out.splitlines() if ln.startswith("lc-ls "))
    assert "parameter store: 2 tensors" in line and "rule accumulate" in line and "2 workers" in line
    assert "run 1 not finished, 2 joined, version 7, steps [3, 4]" in line
    assert any(ln.startswith("lc-raw ") and ln.endswith("buffer") for ln in out.splitlines())
    rc, out, _ = await _cli("ls", "--json", env={"SMB2_SERVERS": ",".join(servers)})
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["lc-ls"]["steps"] == [3, 4] and rows["lc-raw"]["store"] is False

    # its run is live (heartbeats just now): removed only with --force (tests/test_damage.py)
    rc, out, err = await _cli("rm", "--force", "lc-ls", "--servers", ",".join(servers))
    assert rc == 0 and out.strip() == "removed lc-ls"
    assert "lc-ls" not in await client.buffers()
    rc, out, err = await _cli("rm", "lc-ls", env={"SMB2_SERVERS": ",".join(servers)})
    assert rc == 1 and err.startswith("smb2 rm: no buffer 'lc-ls'") and err.splitlines()[1:] == [
        "HINT: see the names with `smb2 ls`"]
    rc, out, err = await _cli("ls", env={"SMB2_SERVERS": ""})
    assert rc == 1 and "SMB2_SERVERS" in err and err.count("\n") == 1


async def test_smb2_ls_shows_the_stability_counts() -> None:
    # what kept the updates in bounds reaches the servers: rank 1's push at 1000x (skipped), rank 0's
    # NaN (refused) and a shared model blown up to 9x its norm (a collapse, seen by rank 0's watch);
    # `smb2 ls` shows the run's counts, its --json each rank's, and `smb2 rm` removes them with the store
    from smb2.train.stability import TrainingDiverged

    async with smb2.LocalCluster(servers=2, processes=True) as cluster:
        client = await cluster.connect()
        stores = await _open_all(cluster, "lc-counts", 2)
        await asyncio.gather(*(s.join(timeout=10) for s in stores))
        await asyncio.gather(_train(stores[0], 10), _train(stores[1], 10))
        assert await stores[1].push({k: 1000 * v for k, v in _ones().items()}, step=11) is False
        with pytest.raises(TrainingDiverged, match="rank 0 produced a non-finite update at step 11"):
            await stores[0].push({k: np.full_like(v, np.nan) for k, v in _ones().items()}, step=11)
        # the shared model grows by 20 % a push (the guard, which judges gradients against the last
        # ones, set aside: the watch is what sees a model that blows up step by step): 9x in 12
        watch = stores[0].watch
        watch.every, watch.settle = 0.0, 1        # every pull looked at; the base at the first
        stores[0].guard.enabled = False
        grow = -0.2 / stores[0].rule.lr         # a gradient whose step -lr * g adds 20 % of the weights
        for s in range(12, 24):
            await stores[0].pull()
            await stores[0].push({k: grow * v for k, v in stores[0].params.items()}, step=s)
        await stores[0].pull()
        assert watch.collapses == 1 and watch.norm > 8 * (watch.base or 0), (watch.norm, watch.base)
        assert stores[0].counts() == {"skipped": 0, "refused": 1, "lag_scaled": 0, "max_version_lag": 0,
                                      "collapses": 1}
        await asyncio.gather(*(s.finish() for s in stores))
        end = await stores[1].await_finished(10)
        assert end.complete and end.collapsed == [0] and not end.healthy and "collapsed" in str(end)

        servers = cluster.addresses
        rc, out, err = await _cli("ls", *servers)
        assert rc == 0, err
        line = next(ln for ln in out.splitlines() if ln.startswith("lc-counts "))
        assert line.endswith("guard: 1 skipped, 1 refused (NaN/Inf), 0 lag-scaled, max lag 0; THE SHARED MODEL "
                             "COLLAPSED (1 warnings)"), line
        rc, out, _ = await _cli("ls", "--json", *servers)
        counts = {r["name"]: r for r in json.loads(out)}["lc-counts"]["counts"]
        assert counts["per_rank"]["0"]["refused"] == 1 and counts["per_rank"]["1"]["skipped"] == 1, counts
        rc, out, err = await _cli("rm", "--force", "lc-counts", "--servers", ",".join(servers))
        assert rc == 0, err
        assert not [b for b in await client.buffers() if b.startswith("lc-counts")]
        for s in stores:
            await s.client.close()
        await client.close()


# -- another number of workers ------------------------------------------------------

async def test_a_job_launched_again_with_another_world_size_resumes(cluster: smb2.LocalCluster,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    # torchrun --nnodes=MIN:MAX after a host was lost (or came back), a job moved to fewer GPUs: the store
    # is made again for the new number of workers and its unfinished run resumes from the weights,
    # version, lineage and the steps of the ranks both jobs have; a finished run starts over
    run1 = await _open_all(cluster, "lc-world", 3)
    await asyncio.gather(*(s.join(timeout=10) for s in run1))
    await asyncio.gather(_train(run1[0], 4), _train(run1[1], 6), _train(run1[2], 5))
    await run1[0].pull()
    weights1, origin1 = run1[0].flat().copy(), _words(run1[0]).origin
    assert await run1[0].read_version() == 15
    # what is kept beside the store for its 3 workers: the counts board (made as the run opened), rank 2's save
    await beside.make(run1[2].client, "lc-world", store_module.optimizer_state_what(2), 4096, replicas=1)
    assert {"lc-world/counts", "lc-world/optim/2"} <= set(await run1[0].client.buffers())

    # fewer workers; rank 1 first: it finds the store made for 3 and waits for rank 0 to make it again
    with caplog.at_level(logging.WARNING, logger="smb2.train"):
        run2 = await _open_all(cluster, "lc-world", 2, first=1)
    assert ("store 'lc-world' was made for 3 workers and this job has 2 (WORLD_SIZE): rank 0 made it again "
            "for 2; the run resumes with its weights and version, and ranks 0-1 with their steps (ranks 0, 1, 2 "
            "of the job before beat within the last 60 s: if that job still runs, its ranks stop with an error)"
            ) in caplog.text
    assert "resuming store 'lc-world' at version 15, step 4 (an earlier run did not finish)" in caplog.text
    for s, step in zip(run2, (4, 6)):
        assert (s.workers, s.generation, s.resumed, s.start_step) == (2, 2, True, step)
        assert np.array_equal(s.flat(), weights1)
    c = await run2[0].refresh()
    assert (c.version, c.origin, c.steps.tolist(), c.joined.tolist()) == (15, origin1, [4, 6], [2, 0])
    await asyncio.gather(*(s.join(timeout=10) for s in run2))
    await asyncio.gather(_train(run2[0], 2), _train(run2[1], 2))
    # the counts board is made again for 2 workers, and rank 2's save went with the old store
    assert "lc-world/optim/2" not in await run2[0].client.buffers()
    board = await run2[0].client.attach("lc-world/counts")
    assert board.nbytes == run2[0].board.nbytes and 3 * board.nbytes == 2 * run1[0].board.nbytes
    # the old job's ranks fail at their next heartbeat (the torch layer says it in training terms)
    with pytest.raises(smb2.NoSuchBuffer, match="its buffer was destroyed"):
        await run1[2].heartbeat(99, force=True)

    # more workers again: ranks 0 and 1 keep their steps, rank 2 starts at step 0
    run3 = await _open_all(cluster, "lc-world", 4, first=3)
    assert [(s.workers, s.generation, s.resumed, s.start_step) for s in run3] == \
        [(4, 3, True, 6), (4, 3, True, 8), (4, 3, True, 0), (4, 3, True, 0)]
    await asyncio.gather(*(s.join(timeout=10) for s in run3))
    await asyncio.gather(*(s.finish() for s in run3))
    await asyncio.gather(*(s.wait_finished(timeout=10) for s in run3))
    assert await run3[0].read_version() == 19

    # a finished run, launched again with another number of workers, starts over from the job's weights
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="smb2.train"):
        run4 = await _open_all(cluster, "lc-world", 2)
    assert [(r.levelname, r.getMessage()) for r in caplog.records if "made it again" in r.getMessage()] == [
        ("INFO", "store 'lc-world' was made for 4 workers and this job has 2 (WORLD_SIZE): rank 0 made it again "
                 "for 2; the new run starts fresh (the earlier run finished)")]
    for s in run4:
        assert (s.workers, s.generation, s.resumed, s.start_step) == (2, 4, False, 0)
        assert np.array_equal(s.params["w"], _params(0)["w"])
    assert (await run4[0].refresh()).version == 0


async def test_a_rank_of_another_world_size_gives_up_in_words(cluster: smb2.LocalCluster) -> None:
    # a rank whose WORLD_SIZE differs from its rank 0's waits for a store made for its number and says so
    (zero,) = [await ParameterStore.open(await cluster.connect(), "lc-world-odd", _params(), workers=2, rank=0)]
    with pytest.raises(smb2.InvalidArgumentError, match=r"store 'lc-world-odd' was made for 2 workers, this job "
                                                        r"has WORLD_SIZE=3.*rank 0 did not make it again for 3 "
                                                        r"workers in time \(rank 1 gives up\)"):
        await ParameterStore.open(await cluster.connect(), "lc-world-odd", _params(), workers=3, rank=1, timeout=0.5)
    assert zero.workers == 2


@pytest.mark.parametrize("before, after", [(2, 3), (3, 2)])
async def test_a_rank_reading_the_store_as_rank_0_makes_it_again_looks_again(cluster: smb2.LocalCluster,
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           before: int, after: int) -> None:
    # rank 1 of the new job found the old store and reads it while rank 0 makes it again for the new number
    # of workers (destroys it, makes a new buffer): rank 1 looks again, and opens the new store
    name = f"lc-world-race-{before}-{after}"
    run1 = await _open_all(cluster, name, before)
    await asyncio.gather(*(s.join(timeout=10) for s in run1))
    await asyncio.gather(*(_train(s, 2 + r) for r, s in enumerate(run1)))
    clients = [await cluster.connect() for _ in range(after)]
    made_again: list[ParameterStore] = []
    find = store_module._wait_for_buffer

    async def found_as_rank_0_makes_it_again(client: Any, name: str, deadline: float, rank: int) -> Any:
        buf = await find(client, name, deadline, rank)
        if not made_again:      # (rank 1's handle is of the store as it was; rank 0 makes it again now)
            made_again.append(await ParameterStore.open(clients[0], name, _params(), workers=after, rank=0,
                                                        timeout=20))
        return buf
    monkeypatch.setattr(store_module, "_wait_for_buffer", found_as_rank_0_makes_it_again)
    one = await ParameterStore.open(clients[1], name, _params(1), workers=after, rank=1, timeout=20)
    monkeypatch.setattr(store_module, "_wait_for_buffer", find)
    others = [await ParameterStore.open(clients[r], name, _params(r), workers=after, rank=r, timeout=20)
              for r in range(2, after)]
    run2 = [*made_again, one, *others]
    assert [(s.workers, s.generation, s.resumed, s.start_step) for s in run2] == \
        [(after, 2, True, 2 + r if r < before else 0) for r in range(after)]
    await asyncio.gather(*(s.join(timeout=10) for s in run2))


async def test_a_rank_0_that_dies_making_the_store_again_loses_nothing(cluster: smb2.LocalCluster,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    # rank 0 sets the store aside whole (weights and words) before it makes it again for another number of
    # workers; one that dies after the old store is gone leaves it there, and the next rank 0 goes on from it
    run1 = await _open_all(cluster, "lc-world-die", 2)
    await asyncio.gather(*(s.join(timeout=10) for s in run1))
    await asyncio.gather(_train(run1[0], 3), _train(run1[1], 4))
    await run1[0].pull()
    weights1 = run1[0].flat().copy()
    client = await cluster.connect()

    async def dies(*_: Any) -> None:
        raise RuntimeError("rank 0 died here")
    initialize = store_module._initialize
    monkeypatch.setattr(store_module, "_initialize", dies)
    with pytest.raises(RuntimeError, match="rank 0 died here"):
        await ParameterStore.open(client, "lc-world-die", _params(9), workers=3, rank=0, timeout=10)
    # (the old store is gone: a buffer of the new size, never initialized, stands in its place)
    assert "lc-world-die/remaking" in await client.buffers()
    assert await (await client.attach("lc-world-die")).fetch_add(store_module._STATE, 0) != store_module.READY
    # `smb2 ls` says what the set-aside holds, and `smb2 rm` keeps it, so that nobody removes the run with it
    servers = ",".join(cluster.addresses)
    rc, listed, _ = await _smb2("ls", "-s", servers)
    assert rc == 0 and "lc-world-die/remaking" in listed and (
        "store 'lc-world-die' set aside while a rank 0 made it again for another number of workers: the job's next "
        "rank 0 goes on from it, then removes it (do not remove it while 'lc-world-die' is not a whole store: it "
        "holds the run)") in listed, listed
    rc, _, said = await _smb2("rm", "-s", servers, "lc-world-die/remaking")
    assert rc == 1 and ("smb2 rm: 'lc-world-die/remaking' holds store 'lc-world-die', set aside while a rank 0 made "
                        "it again for another number of workers, and 'lc-world-die' is not a whole store: the "
                        "set-aside is all there is of its run") in said, said
    assert "lc-world-die/remaking" in await client.buffers()
    monkeypatch.setattr(store_module, "_initialize", initialize)

    # ... and one that died while it made the new buffer left it half made: its part on one server gone
    async with await smb2.connect([cluster.addresses[1]]) as one_server:
        await one_server.destroy("lc-world-die")
    with pytest.raises(smb2.BufferDamaged):
        await client.attach("lc-world-die")
    rc, _, said = await _smb2("rm", "-s", servers, "lc-world-die/remaking")
    assert rc == 1 and "and 'lc-world-die' is not a whole store" in said, said

    with caplog.at_level(logging.WARNING, logger="smb2.train"):
        run2 = await _open_all(cluster, "lc-world-die", 3)
    assert ("the store set aside in 'lc-world-die/remaking' holds its weights and words, so the store is made "
            "anew") in caplog.text
    for s, step in zip(run2, (3, 4, 0)):
        assert (s.workers, s.generation, s.resumed, s.start_step) == (3, 2, True, step)
        assert np.array_equal(s.flat(), weights1)
    assert (await run2[0].refresh()).version == 7
    assert "lc-world-die/remaking" not in await client.buffers()


@pytest.mark.parametrize("garbage", ["table", "sizes"])
async def test_a_set_aside_that_is_not_one_is_refused_in_words(cluster: smb2.LocalCluster, garbage: str) -> None:
    # whatever a client left in <store>/remaking, rank 0 names it and what to do, and the store is not touched
    (s,) = await _open_all(cluster, "lc-aside-bad", 1)
    await s.join()
    await _train(s, 2)
    client = await cluster.connect()
    header = np.zeros(8, np.int64)
    header[:3] = int.from_bytes(b"SMB2RMKG", "little"), 40, 12
    body = b"\xc1" * 40 if garbage == "table" else store_module.Layout.plan(_params(), 1, {}).table()
    header[1] = len(body)
    side = await beside.make(client, "lc-aside-bad", "remaking", 64 + len(body) + 64, replicas=1)
    await side.write(0, header.tobytes() + body)
    with pytest.raises(smb2.InterfaceError, match=r"side buffer 'lc-aside-bad/remaking' should hold a store set "
                                                  r"aside .* and does not") as told:
        await ParameterStore.open(client, "lc-aside-bad", _params(), workers=2, rank=0, timeout=5)
    assert "smb2 rm lc-aside-bad/remaking" in str(told.value)
    await beside.discard(client, "lc-aside-bad", "remaking")
    (again,) = await _open_all(cluster, "lc-aside-bad", 1)
    assert (again.resumed, again.start_step) == (True, 2) and np.array_equal(again.flat(), s.flat())


async def test_servers_without_room_for_the_set_aside_leave_the_store_untouched() -> None:
    # the set-aside is a second copy of the weights: where the servers have no room for it, the open
    # fails before the store is touched, and the job of the old size still resumes it
    big = {"w": np.arange(160 << 10, dtype=np.float32)}        # 640 KiB of weights on 1 MiB of servers
    async with smb2.LocalCluster(servers=2, capacity="1MiB") as small:
        clients = [await small.connect() for _ in range(2)]
        run1 = await asyncio.gather(*(ParameterStore.open(clients[r], "lc-no-room", big, workers=2, rank=r,
                                                          timeout=10) for r in range(2)))
        await asyncio.gather(*(s.join(timeout=10) for s in run1))
        await run1[0].push({"w": np.ones(160 << 10, np.float32)})
        await run1[0].pull()
        weights = run1[0].flat().copy()
        with pytest.raises(smb2.OutOfMemory):
            await ParameterStore.open(await small.connect(), "lc-no-room", big, workers=3, rank=0, timeout=5)
        names = await clients[0].buffers()
        assert "lc-no-room" in names and "lc-no-room/remaking" not in names, names
        again = await ParameterStore.open(await small.connect(), "lc-no-room", big, workers=2, rank=0, timeout=5)
        assert again.resumed and again.workers == 2 and np.array_equal(again.flat(), weights)


async def test_a_set_aside_left_after_the_new_run_opened_is_never_made_again(cluster: smb2.LocalCluster,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # rank 0 dies after it opened the run in the store made again, before it removed the set-aside; the
    # others joined that run and train on: restarted, rank 0 removes the set-aside and goes back into the
    # run, where making the store again from it would throw their steps away
    run1 = await _open_all(cluster, "lc-world-late", 2)
    await asyncio.gather(*(s.join(timeout=10) for s in run1))
    await asyncio.gather(_train(run1[0], 2), _train(run1[1], 2))
    discard = beside.discard

    async def dies(client: smb2.Client, parent: str, what: str) -> bool:
        if what == "remaking":
            raise RuntimeError("rank 0 died here")
        return await discard(client, parent, what)
    monkeypatch.setattr(beside, "discard", dies)
    clients = [await cluster.connect() for _ in range(3)]
    with pytest.raises(RuntimeError, match="rank 0 died here"):
        await ParameterStore.open(clients[0], "lc-world-late", _params(0), workers=3, rank=0, timeout=10)
    monkeypatch.setattr(beside, "discard", discard)
    others = await asyncio.gather(*(ParameterStore.open(clients[r], "lc-world-late", _params(r), workers=3, rank=r,
                                                        timeout=10) for r in (1, 2)))
    await asyncio.gather(*(s.join(timeout=10) for s in others))
    await asyncio.gather(*(_train(s, 3) for s in others))
    assert "lc-world-late/remaking" in await clients[0].buffers()

    zero = await ParameterStore.open(await cluster.connect(), "lc-world-late", _params(0), workers=3, rank=0,
                                     timeout=10, restarted=True)
    assert "lc-world-late/remaking" not in await clients[0].buffers()
    assert (zero.workers, zero.rejoined, zero.generation) == (3, True, 2)
    await others[0].pull()
    assert np.array_equal(zero.flat(), others[0].flat()) and await zero.read_version() == 4 + 6
