"""Whole resume (smb2.torch.resume): a resumed run continues with its
optimizer's moments, its LR schedule's position and its step, with no lines
beyond the one-line port; a fresh run never loads a stale state.  Real
memory-server processes, real torch."""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest

import smb2
from smb2.torch.loop_thread import LoopThread

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed here (pip install 'smb2[torch]')")

import smb2.torch as st  # noqa: E402
from smb2.testing.torch_models import in_threads, rank_batches, small_model  # noqa: E402
from smb2.torch import resume  # noqa: E402
from smb2.train.store import optimizer_state_name, remove  # noqa: E402

EPOCH = 10          # steps per epoch: StepLR steps once per epoch
RUN1_STEPS = 45     # the first run dies here (mid-epoch)
TOTAL = 60


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread, as the example's workers (faster on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _client_do(servers: str, fn: Any) -> Any:
    async def go() -> Any:
        async with await smb2.connect(servers) as c:
            return await fn(c)
    loop = LoopThread("test-client")
    try:
        return loop.run(go())
    finally:
        loop.stop()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))


LR, GAMMA = 0.1, 0.5
X = torch.randn(512, 10, generator=torch.Generator().manual_seed(0))
X[:, :2] += torch.sign(X[:, :2])        # a margin: the loss goes to about 0.001 (as in the run)
Y = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch: the data position is the loop's (a function of the step)."""
    idx = torch.randint(0, len(X), (64,), generator=torch.Generator().manual_seed(1000 + step))
    return X[idx], Y[idx]


def _port(model: torch.nn.Module, servers: str, name: str, **kw: Any
          ) -> tuple[st.AsyncOptimizer, torch.optim.lr_scheduler.StepLR]:
    """The asynchronous port (rule delta, staleness 1): the torch optimizer, the one smb2 line, a
    scheduler built on it.  (Rule allreduce, the default, saves and resumes otherwise: rank 0's
    saves carry the weights; test_torch_allreduce tests it.)"""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=1e-4)
    opt = st.AsyncOptimizer(opt, model, name=name, servers=servers, rule="delta", staleness=1, rank=0, world_size=1,
                            **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)
    return opt, sched


def _loop(model: torch.nn.Module, opt: st.AsyncOptimizer, sched: Any, first: int, last: int,
          record: dict[int, Any] | None = None, pause: float = 0.0) -> dict[int, float]:
    """An ordinary loop over steps first..last-1 (``record``: the optimizer's
    state, the schedule's position and the lr as each step finds them;
    ``pause``: seconds slept before each step, so that steps are at least
    that far apart however fast the machine is)."""
    losses = {}
    for t in range(first, last):
        time.sleep(pause)
        if record is not None:
            record[t] = (copy.deepcopy(opt.state_dict()), sched.last_epoch, opt.param_groups[0]["lr"])
        x, y = _batch(t)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses[t] = loss.item()
        if (t + 1) % EPOCH == 0:
            sched.step()
    if record is not None:
        record[last] = (copy.deepcopy(opt.state_dict()), sched.last_epoch, opt.param_groups[0]["lr"])
    return losses


def _crash(opt: st.AsyncOptimizer) -> None:
    """The worker dies: no close(), no finish(); its connections drop."""
    opt._loop.run(opt._close_client())
    opt._loop.stop()


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["state"].keys() == b["state"].keys() and a["state"]
    for i in a["state"]:
        for k, v in a["state"][i].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][i][k])), (i, k)
    assert [g["lr"] for g in a["param_groups"]] == [g["lr"] for g in b["param_groups"]]


def test_saves_add_at_most_their_share_to_the_exchange(servers: str) -> None:
    # a save (the moments and the schedule) waits until the exchange moved 1 / state_share times the last
    # save's bytes, whatever state_every allows: saves never crowd the link the training needs
    model = _model()
    opt, sched = _port(model, servers, "t-share", resume=False, state_every=1e-9, state_share=0.25)
    saved = opt._saved
    for t in range(TOTAL):
        _loop(model, opt, sched, t, t + 1)
        # a save that comes due while the one before is still being written is skipped: each is
        # waited for here, so that how many are made depends on the bytes moved, not on how fast a
        # busy machine writes them
        if saved._writing is not None:
            saved._writing.result()
    opt.flush()
    moved = opt.store.stats["bytes_pushed"] + opt.store.stats["bytes_pulled"]
    assert saved._save_bytes is not None and saved.saves >= 1
    # the first save is due by time alone; every later one after 4 times a save's bytes of exchange
    assert 2 <= saved.saves <= 1 + moved * 0.25 / saved._save_bytes * 1.01, (saved.saves, moved, saved._save_bytes)
    opt.close()
    with pytest.raises(smb2.InvalidArgumentError, match=r"state_share must be a fraction in \(0, 1\] or None"):
        _port(_model(), servers, "t-share-bad", state_share=0)


def test_a_resumed_run_continues_its_moments_schedule_and_loss(servers: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    model = _model()
    opt, sched = _port(model, servers, "t-resume", resume=False, state_every=0.02, state_share=None)
    record: dict[int, Any] = {}
    # (steps 25 ms apart at least: saves due every 20 ms come at many steps, the last ones near the end,
    # on a fast machine as on a slow one)
    before = _loop(model, opt, sched, 0, RUN1_STEPS, record, pause=0.025)
    opt.flush()
    saved_at = opt._saved.saves
    assert saved_at >= 2, "saves every 20 ms, steps 25 ms apart: a 45-step run made several"
    _crash(opt)

    # the job runs again: the same script, nothing added ("auto": the run did not finish)
    model2 = _model()
    with caplog.at_level(logging.INFO, logger="smb2.torch"):
        opt2, sched2 = _port(model2, servers, "t-resume", state_every=0.02, state_share=None)
    try:
        assert opt2.resumed
        start = opt2.start_step
        assert 0 < start <= RUN1_STEPS
        assert "resumes its AdamW state and 1 LR schedule" in caplog.text
        # the moments are the ones the first run had after step `start`
        _same_state(opt2.state_dict(), record[start][0])
        after = _loop(model2, opt2, sched2, start, TOTAL)
        # at its first step the schedule took its saved position and lr
        assert sched2.last_epoch == TOTAL // EPOCH
        assert opt2.param_groups[0]["lr"] == pytest.approx(LR * GAMMA ** (TOTAL // EPOCH))
    finally:
        opt2.close()
    # the loss curve continues: the first steps after the resume are as low as the last ones before
    # (with Adam's moments from zero and the lr back at its start, they jump from ~0.001 to 0.06-0.11)
    last_before = max(before[t] for t in range(RUN1_STEPS - 10, RUN1_STEPS))
    first_after = max(after[t] for t in range(start, start + 10))
    assert first_after < 3 * last_before + 0.01, (last_before, first_after)


def test_resume_loads_the_schedule_at_the_first_step(servers: str) -> None:
    """The saved position is exact: the scheduler after resume equals the one
    the first run had when it made the save (saves at every step here)."""
    model = _model()
    opt, sched = _port(model, servers, "t-resume-exact", resume=False, state_every=1e-9)
    record: dict[int, Any] = {}
    _loop(model, opt, sched, 0, 25, record)
    opt.flush()
    opt._saved.close(opt.steps)     # what close() saves, without finishing the run
    _crash(opt)
    model2 = _model()
    opt2, sched2 = _port(model2, servers, "t-resume-exact", resume=True, state_every=1e-9)
    try:
        start = opt2.start_step
        assert start == 25
        state, epoch, lr = record[start]
        _same_state(opt2.state_dict(), state)
        assert sched2.last_epoch == 0          # built on the optimizer: its start, until the first step
        _loop(model2, opt2, sched2, start, start + 1)
        assert sched2.last_epoch == epoch == 2 and opt2.param_groups[0]["lr"] == pytest.approx(lr)
    finally:
        opt2.close()


def test_without_saved_state_a_resume_says_so(servers: str, caplog: pytest.LogCaptureFixture) -> None:
    model = _model()
    opt, sched = _port(model, servers, "t-resume-none", resume=False, state_every=None)
    _loop(model, opt, sched, 0, 10)
    opt.flush()
    _crash(opt)
    with caplog.at_level(logging.WARNING, logger="smb2.torch"):
        opt2, _ = _port(_model(), servers, "t-resume-none", resume=True)
    try:
        # the store's step word (its heartbeat, at most every 0.25 s), a fresh state
        assert 1 <= opt2.start_step <= 10 and not opt2.state
        assert "no saved optimizer state" in caplog.text and "fresh AdamW state" in caplog.text
    finally:
        opt2.close()


@pytest.mark.parametrize("how", ["resume=False", "finished", "recreated"])
def test_a_fresh_run_never_loads_a_stale_state(servers: str, how: str) -> None:
    name = f"t-stale-{how[:5]}"
    model = _model()
    opt, sched = _port(model, servers, name, resume=False, state_every=0.01)
    _loop(model, opt, sched, 0, 12)
    if how == "finished":
        opt.close()          # the run finished: "auto" starts the next one fresh
    else:
        opt.flush()
        opt.close() if how == "recreated" else _crash(opt)
    if how == "recreated":   # the store alone is removed; its state buffers stay behind
        _client_do(servers, lambda c: c.destroy(name))
    assert _client_do(servers, lambda c: c.buffers()).count(optimizer_state_name(name, 0)) == 1
    opt2, sched2 = _port(_model(), servers, name, resume=False if how == "resume=False" else "auto")
    try:
        assert not opt2.resumed and opt2.start_step == 0 and not opt2.state
        _loop(opt2.model, opt2, sched2, 0, 1)
        assert sched2.last_epoch == 0 and opt2.param_groups[0]["lr"] == pytest.approx(LR)
        assert int(next(iter(opt2.state.values()))["step"]) == 1
    finally:
        opt2.close()


def test_two_slots_keep_the_last_whole_save(servers: str) -> None:
    """A save torn by a crash (its data half written) leaves the previous one;
    a save larger than the buffer makes it again."""
    name = "t-slots/optim/0"
    store, what = name.split("/", 1)

    async def go(c: smb2.Client) -> tuple[Any, ...]:
        slots = await resume.StateSlots.open(c, store, what)
        assert await slots.newest(7) is None
        await slots.write(b"a" * 100, step=1, origin=7, run=1)
        await slots.write(b"b" * 100, step=2, origin=7, run=1)
        first = await slots.newest(7)
        # a third save dies halfway through its data: it overwrites the older slot (a's)
        assert slots.buf is not None
        await slots.buf.write(resume.HEADER, b"c" * 50)
        halfway = await (await resume.StateSlots.open(c, store, what)).newest(7)
        # a whole third save, then its data is damaged: the reader falls back to b
        await slots.write(b"c" * 100, step=3, origin=7, run=1)
        await slots.buf.write(resume.HEADER, b"x" * 50)
        reopened = await resume.StateSlots.open(c, store, what)
        torn = await reopened.newest(7)
        other_lineage = await reopened.newest(8)
        await reopened.write(b"d" * (reopened.capacity + 1), step=4, origin=7, run=2)
        grown = await (await resume.StateSlots.open(c, store, what)).newest(7)
        await c.destroy(name)
        return first, halfway, torn, other_lineage, grown

    first, halfway, torn, other_lineage, grown = _client_do(servers, go)
    assert first[1] == b"b" * 100 and int(first[0][resume._STEP]) == 2
    assert halfway[1] == b"b" * 100
    assert torn[1] == b"b" * 100 and int(torn[0][resume._STEP]) == 2
    assert other_lineage is None
    assert int(grown[0][resume._STEP]) == 4 and len(grown[1]) > 100


def test_removing_a_store_removes_its_state_buffers(servers: str) -> None:
    model = _model()
    opt, sched = _port(model, servers, "t-rm", resume=False, state_every=0.01)
    _loop(model, opt, sched, 0, 5)
    opt.close()

    async def go(c: smb2.Client) -> tuple[list[str], bool, list[str]]:
        names = await c.buffers()
        existed = await remove(c, "t-rm")
        return names, existed, await c.buffers()

    names, existed, after = _client_do(servers, go)
    assert "t-rm" in names and optimizer_state_name("t-rm", 0) in names
    assert existed and "t-rm" not in after and optimizer_state_name("t-rm", 0) not in after


def test_schedulers_are_found_on_either_optimizer() -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.1)
    a = torch.optim.lr_scheduler.StepLR(inner, step_size=2)
    warm = torch.optim.lr_scheduler.LinearLR(outer, start_factor=0.5, total_iters=2)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(outer, T_max=5)
    seq = torch.optim.lr_scheduler.SequentialLR(outer, [warm, cos], milestones=[2])
    other = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1), 1)
    found = resume.schedulers_on(inner, outer)
    assert {id(s) for s in found} == {id(a), id(seq)}       # the parts go with SequentialLR
    assert other not in found


def test_servers_without_room_for_the_state_train_on_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    """The store fits, two saves of AdamW's state (4x the weights) do not:
    the worker trains on without saves and says what to do."""
    loop = LoopThread("test-small-cluster")
    cluster = smb2.LocalCluster(servers=2, processes=True, capacity="2MiB")
    loop.run(cluster.start())
    try:
        model = torch.nn.Sequential(torch.nn.Linear(500, 400))          # 200,400 floats: 0.8 MB
        opt = st.AsyncOptimizer(torch.optim.AdamW(model.parameters()), model, name="t-room",
                                servers=",".join(cluster.addresses), rank=0, world_size=1, state_every=1e-9)
        x = torch.randn(8, 500)
        with caplog.at_level(logging.WARNING, logger="smb2.torch"):
            for _ in range(4):
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
            opt.close()
        assert opt.steps == 4
        assert "no room for rank 0's optimizer state" in caplog.text and "state_every=None" in caplog.text
    finally:
        loop.run(cluster.close())
        loop.stop()


def test_a_save_of_another_optimizer_is_not_loaded(servers: str, caplog: pytest.LogCaptureFixture) -> None:
    model = _model()
    opt, sched = _port(model, servers, "t-other-opt", resume=False, state_every=1e-9)
    _loop(model, opt, sched, 0, 5)
    opt.flush()
    opt._saved.close(opt.steps)
    _crash(opt)
    model2 = _model()
    with caplog.at_level(logging.WARNING, logger="smb2.torch"):
        opt2 = st.AsyncOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9), model2,
                                 name="t-other-opt", servers=servers, rank=0, world_size=1, resume=True, rule="delta")
    try:
        assert "is not loaded (it is AdamW's, this job's optimizer is SGD)" in caplog.text
        assert not opt2.state and opt2.resumed
        _loop(model2, opt2, torch.optim.lr_scheduler.StepLR(opt2, 1), opt2.start_step, opt2.start_step + 2)
    finally:
        opt2.close()


# alone: the background copy beside the step-40 checkpoint must run before step 45
# (it ran after, once, under the parallel pass)
@pytest.mark.alone
@pytest.mark.parametrize("into", ["another store", "the same store"])
def test_a_run_from_a_checkpoint_continues_its_moments_schedule_and_loss(
        servers: str, tmp_path: Any, caplog: pytest.LogCaptureFixture, into: str) -> None:
    """checkpoint_every saves each rank's optimizer state beside the store
    (``<path>.optim/<rank>``); a fresh job with init_from= loads it."""
    model = _model()
    path = tmp_path / "ck" / "step-{step}.smb2"
    opt, sched = _port(model, servers, "t-ckpt", resume=False, state_every=0.02, state_share=None, checkpoint_every=20,
                       checkpoint_path=path)
    record: dict[int, Any] = {}
    before = _loop(model, opt, sched, 0, RUN1_STEPS, record)
    opt.close()              # its last save and the checkpoint at step 45
    final = tmp_path / "ck" / f"step-{RUN1_STEPS}.smb2"
    for step in (20, 40, RUN1_STEPS):
        assert (tmp_path / "ck" / f"step-{step}.smb2.optim" / "0").is_file(), step
    # the same store again (its state buffer holds step 45) from the checkpoint at 40; or another store from 45
    name, ckpt = ("t-ckpt", tmp_path / "ck" / "step-40.smb2") if into == "the same store" else ("t-ckpt2", final)
    with caplog.at_level(logging.INFO, logger="smb2.torch"):
        opt2, sched2 = _port(_model(), servers, name, init_from=ckpt, state_every=0.02, state_share=None)
    try:
        start = opt2.start_step
        assert "resumes its AdamW state and 1 LR schedule" in caplog.text
        if into == "another store":
            assert start == RUN1_STEPS            # close() saved the state of the last step
        else:
            # the state copied beside the step-40 checkpoint: the rank's last save when the copy ran
            # (a save every 0.02 s, the copy in the background: a step or two past 40), never the
            # step-45 state the store's own buffer held
            assert 20 < start < RUN1_STEPS
        _same_state(opt2.state_dict(), record[start][0])
        after = _loop(opt2.model, opt2, sched2, start, TOTAL)
        assert sched2.last_epoch == TOTAL // EPOCH
        assert opt2.param_groups[0]["lr"] == pytest.approx(LR * GAMMA ** (TOTAL // EPOCH))
    finally:
        opt2.close()
    last_before = max(before[t] for t in range(start - 10, start))
    first_after = max(after[t] for t in range(start, start + 10))
    assert first_after < 3 * last_before + 0.01, (last_before, first_after)


def test_a_checkpoint_without_optimizer_states_starts_them_fresh_and_says_so(
        servers: str, tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    model = _model()
    path = tmp_path / "old.smb2"
    opt, sched = _port(model, servers, "t-ckpt-old", resume=False, checkpoint_every=10, checkpoint_path=path)
    _loop(model, opt, sched, 0, 12)
    opt.close()              # the checkpoint at step 12, with the state close() saved
    # a checkpoint as saved before the states went beside it
    (tmp_path / "old.smb2.optim" / "0").unlink()
    (tmp_path / "old.smb2.optim").rmdir()
    with caplog.at_level(logging.INFO):
        opt2, sched2 = _port(_model(), servers, "t-ckpt-old2", init_from=path)
    try:
        assert "carries no optimizer states" in caplog.text
        assert "rank 0 has no saved optimizer state" in caplog.text and "fresh AdamW state" in caplog.text
        assert opt2.start_step == 12 and not opt2.state
        _loop(opt2.model, opt2, sched2, 12, 13)
        assert sched2.last_epoch == 0 and int(next(iter(opt2.state.values()))["step"]) == 1
    finally:
        opt2.close()


def _tamper(servers: str, name: str, how: str) -> None:
    """Rewrite rank 0's newest save in ``<name>/optim/0`` as a well-formed
    save whose content is wrong: ``how`` is "shape" (the first momentum
    tensor of another shape), "nan" (NaN second moments) or "lr" (lr=1e6)."""
    async def go(c: smb2.Client) -> None:
        slots = await resume.StateSlots.open(c, name, "optim/0")
        header = next(h for h in slots.headers if h[resume._STEP] == slots.headers[:, resume._STEP].max())
        found = await slots.newest(int(header[resume._ORIGIN]))
        assert found is not None
        header, data = found
        light, tensors = resume._unframe(data)
        first = tensors[0]
        if how == "shape":
            first["exp_avg"] = torch.zeros(3, 3)
        elif how == "nan":
            first["exp_avg_sq"] = torch.full_like(first["exp_avg_sq"], float("nan"))
        else:
            for g in light["param_groups"]:
                g["lr"] = 1e6
        await slots.write(*resume._frame(resume._save(light), resume._save(tensors)), step=int(header[resume._STEP]),
                          origin=int(header[resume._ORIGIN]), run=int(header[resume._RUN]))
    _client_do(servers, go)


@pytest.mark.parametrize("how", ["shape", "nan"])
def test_a_tampered_optimizer_state_is_refused_by_name_and_training_goes_on(
        servers: str, caplog: pytest.LogCaptureFixture, how: str) -> None:
    name = f"t-tamper-{how}"
    model = _model()
    opt, sched = _port(model, servers, name, resume=False, state_every=1e-9)
    _loop(model, opt, sched, 0, 5)
    opt.flush()
    opt._saved.close(opt.steps)
    _crash(opt)
    _tamper(servers, name, how)
    model2 = _model()
    with caplog.at_level(logging.WARNING, logger="smb2.torch"):
        opt2, sched2 = _port(model2, servers, name, resume=True)
    try:
        said = {"shape": "exp_avg of parameter 0 (shape (32, 10)) has shape (3, 3)",
                "nan": "exp_avg_sq of parameter 0 (shape (32, 10)) holds non-finite values"}[how]
        assert f"store '{name}': rank 0's saved optimizer state" in caplog.text, caplog.text
        assert f"side buffer '{optimizer_state_name(name, 0)}') is not loaded" in caplog.text, caplog.text
        assert said in caplog.text, caplog.text
        assert not opt2.state           # fresh state, as for any save it cannot use
        losses = _loop(model2, opt2, sched2, opt2.start_step, opt2.start_step + 3)
        assert all(torch.isfinite(torch.tensor(list(losses.values()))))
    finally:
        opt2.close()


def test_a_diverging_step_after_a_loaded_state_names_it_as_a_suspect(servers: str) -> None:
    """A save with lr=1e6 is well-formed and loads; the step that goes
    wrong names the loaded state, not only the learning rate."""
    name = "t-tamper-lr"
    model = _model()
    opt, sched = _port(model, servers, name, resume=False, state_every=1e-9)
    _loop(model, opt, sched, 0, 5)
    opt.flush()
    opt._saved.close(opt.steps)
    _crash(opt)
    _tamper(servers, name, "lr")
    model2 = _model()
    # staleness 0: each step's push lands before the next pull, so the step that goes wrong
    # is the same on a loaded machine (8 steps after the load, measured)
    opt2 = st.AsyncOptimizer(torch.optim.AdamW(model2.parameters(), lr=LR, weight_decay=1e-4), model2, name=name,
                             servers=servers, rule="delta", staleness=0, rank=0, world_size=1, resume=True)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=GAMMA)
    try:
        with pytest.raises(smb2.Smb2Error) as info:
            _loop(model2, opt2, sched2, opt2.start_step, opt2.start_step + 10)
        text = str(info.value)
        assert f"rank 0's optimizer state from side buffer '{optimizer_state_name(name, 0)}'" in text, text
        assert "a suspect" in text and f"smb2 rm {optimizer_state_name(name, 0)}" in text, text
    finally:
        with contextlib.suppress(smb2.Smb2Error):      # close() says the step's error again
            opt2.close()


def test_a_save_of_another_job_size_says_its_scaling_of_the_learning_rate(servers: str,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    # diloco's recipe with SGD multiplies the lr by the number of workers; a job of 2 dies, one of 3 resumes:
    # ranks 0 and 1 restore the lr their saves hold (the old scaling), rank 2 has none and keeps the new
    # one, and ranks 0 and 1 say so with the rate the recipe gives for 3
    name, seen = "t-lr-world", {}

    def job(world: int, crash: bool) -> None:
        def run(r: int) -> None:
            m = small_model()
            opt = st.AsyncOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), m, name=name,
                                    servers=servers, rank=r, world_size=world, rule="diloco", state_every=1e-9,
                                    state_share=None, resume=not crash)
            for g in opt.param_groups:
                g["lr"] *= opt.world
            for x, y in rank_batches(4, r)[opt.start_step:]:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(m(x), y).backward()
                opt.step()
                seen[world, r] = opt.param_groups[0]["lr"]
                if opt._saved._writing is not None:     # (each save written before the next)
                    opt._saved._writing.result()
            if crash:
                _crash(opt)
            else:
                opt.close(wait_all=30)
        in_threads(world, run)

    job(2, crash=True)
    with caplog.at_level(logging.WARNING, logger="smb2.torch"):
        job(3, crash=False)
    assert seen[2, 0] == seen[3, 0] == seen[3, 1] == pytest.approx(0.2) and seen[3, 2] == pytest.approx(0.3)
    said = sorted(r.getMessage() for r in caplog.records if "restores the learning rates" in r.getMessage())
    assert said == [f"store {name!r}: rank {r} restores the learning rates saved by a job of 2 workers (0.2), "
                    "which this script scaled by the number of workers: that job's scaling, where a rank without "
                    "a save keeps this job's; for 3 workers the script's scaling gives 0.3: set the rates again "
                    "after the first step() to take it" for r in (0, 1)], said
