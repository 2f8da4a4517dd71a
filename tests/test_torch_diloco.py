"""Rule ``diloco``: inner optimizer for a round, then an outer Nesterov step
per pseudo-gradient on the shared weights, against real memory servers and
real torch (docs/training.md, "Update rules")."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import smb2
from smb2.train import ParameterStore
from smb2.train.rules import outer_momentum_name
from smb2.train.stability import LagScaling, TrainingDiverged

torch = pytest.importorskip("torch", reason="PyTorch is not installed here (pip install 'smb2[torch]')")

import smb2.torch as st  # noqa: E402
from smb2.testing.torch_models import (  # noqa: E402
    GRAD,
    LR,
    TwoHeads,
    async_optimizer,
    constant_steps,
    shared_values,
    small_model,
    torchrun_beside_single,
)


def _batches(rounds: int, h: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rounds * h, 16, 10, generator=g)
    return [(xb, (xb[:, 0] > 0).long() + (xb[:, 1] > 0).long()) for xb in x]


def _inner_steps(model: torch.nn.Module, opt: torch.optim.Optimizer,
                 batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _reference(rounds: int, h: int, outer_lr: float, outer_momentum: float) -> dict[str, torch.Tensor]:
    """One process: the inner SGD for ``h`` steps, then torch's outer
    ``SGD(nesterov=True)`` with grad = w_start - w_local; ``rounds`` times."""
    model = small_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    shared = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    outer = torch.optim.SGD(shared, lr=outer_lr, momentum=outer_momentum, nesterov=True)
    batches = _batches(rounds, h)
    for r in range(rounds):
        _inner_steps(model, inner, batches[r * h:(r + 1) * h])
        for s, p in zip(shared, model.parameters()):
            s.grad = s.detach() - p.detach()
        outer.step()
        with torch.no_grad():
            for s, p in zip(shared, model.parameters()):
                p.copy_(s)          # the next round starts from the shared weights
    return {n: s.detach() for (n, _), s in zip(model.named_parameters(), shared)}


@pytest.mark.parametrize(("outer_lr", "outer_momentum", "exact"), [(0.5, 0.5, True), (0.7, 0.9, False)],
                         ids=["powers-of-two", "paper-defaults"])
def test_one_worker_is_the_inner_optimizer_then_torch_nesterov(servers: str, outer_lr: float,
                                                              outer_momentum: float, exact: bool) -> None:
    # float32 pushes.  The first round bit for bit where the outer step's products are exact (lr and
    # momentum powers of two: torch's SGD fuses its multiply-adds, numpy and the servers round each
    # product); with the paper's 0.7 / 0.9 within float32 rounding.  Later rounds within rounding: the
    # servers hold the momentum as M + (m - M).  Rounds end with a flush, so the next round's first
    # step sees the new shared weights (in training it may start on the old ones, see docs)
    h, rounds = 4, 3
    ref = _reference(rounds, h, outer_lr, outer_momentum)
    model = small_model()
    batches = _batches(rounds, h)
    with async_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), servers,
                f"t-diloco-one-{exact}", rule="diloco", local_steps=h, outer_lr=outer_lr,
                outer_momentum=outer_momentum, push_dtype="float32") as opt:
        for r in range(rounds):
            _inner_steps(model, opt, batches[r * h:(r + 1) * h])
            opt.flush()
            if r == 0:
                first = shared_values(opt)
        shared = shared_values(opt)
        stats = opt.stats()
    one = _reference(1, h, outer_lr, outer_momentum)
    for n, p in model.named_parameters():
        if exact:
            np.testing.assert_array_equal(first[n], one[n].numpy(), err_msg=n)     # round 1: bit for bit
        np.testing.assert_allclose(first[n], one[n].numpy(), rtol=1e-6, atol=1e-7, err_msg=n)
        # later rounds: the momentum is M + (m - M) on the servers, m in torch (rounding apart)
        np.testing.assert_allclose(shared[n], ref[n].numpy(), rtol=1e-5, atol=1e-7, err_msg=n)
        # it continues from them (it moves by shared - local: the steps made meanwhile stay, to rounding)
        np.testing.assert_allclose(p.detach().numpy(), shared[n], rtol=1e-6, atol=1e-8, err_msg=n)
    nbytes = opt.store.flat().nbytes
    # per round: the momentum read and the weights pulled, the momentum's and the weights' changes pushed
    assert stats["bytes_pushed"] == rounds * 2 * nbytes
    assert stats["bytes_pulled"] == rounds * 2 * nbytes     # (rank 0 of a fresh run wrote the weights: no pull)


def test_the_pseudo_gradient_travels_as_bfloat16_by_default(servers: str) -> None:
    model = TwoHeads()
    with async_optimizer(model, torch.optim.SGD(model.parameters(), lr=LR), servers, "t-diloco-bf16", rule="diloco",
                local_steps=2, outer_lr=0.5, outer_momentum=0.5) as opt:
        assert opt.push_dtype == "bfloat16"
        constant_steps(opt, model, 4)
        opt.flush()
        shared = shared_values(opt)
        assert opt.stats()["bytes_pushed"] == 2 * opt.store.flat().nbytes      # two rounds, 2 bytes x 2
    for n, g in GRAD.items():
        # D = 2 LR g each round (dyadic: exact in bf16); m1 = D, m2 = D/2 + D; w = -(0.5)(D + m1/2) - 0.5(D + m2/2)
        d = 2 * LR * g
        m1, m2 = d, 0.5 * d + d
        w = -0.5 * (d + 0.5 * m1) - 0.5 * (d + 0.5 * m2)
        np.testing.assert_array_equal(shared[n], np.full(shared[n].shape, w, np.float32), err_msg=n)


def test_close_pushes_the_last_shorter_round(servers: str) -> None:
    model = TwoHeads()
    opt = async_optimizer(model, torch.optim.SGD(model.parameters(), lr=LR), servers, "t-diloco-close", rule="diloco",
                 local_steps=4, outer_lr=0.5, outer_momentum=0.0, push_dtype="float32")
    constant_steps(opt, model, 6)      # a round of 4, then 2 steps
    opt.close(wait_all=30)
    for n, p in model.named_parameters():
        # each round's pseudo-gradient moves the shared model by outer_lr times it: 4 + 2 steps
        np.testing.assert_array_equal(p.detach().numpy(), np.full(p.shape, -0.5 * 6 * LR * GRAD[n], np.float32))


def _diloco_options(workers: int) -> dict[str, Any]:
    return {"rule": "diloco", "workers": workers, "local_steps": 1, "outer_lr": 0.5, "outer_momentum": 0.5,
            "wire": None, "resume": False}


async def _round(store: ParameterStore, d: np.ndarray) -> None:
    """A round whose pseudo-gradient is ``d`` (dyadic values: ``start - (start - d)`` is ``d``)."""
    store.params["w"] -= d
    await store.rule.exchange()


async def test_w_pseudo_gradients_then_one_momentum_step_are_torch_nesterov_on_their_mean(
        cluster: smb2.LocalCluster) -> None:
    # W = 2 workers take turns (each lag 1 = W - 1: no lag scaling): each push moves the weights by
    # -lr D / W and the push that completes a group of 2 makes the momentum step, so after each
    # group the shared weights and momentum are torch's SGD(nesterov=True) on the group's mean
    # pseudo-gradient (exact: dyadic values); between the groups' momentum steps nothing is lost
    rng = np.random.default_rng(0)
    ds = [rng.integers(-8, 9, 8).astype(np.float32) / 8 for _ in range(6)]
    params = {"w": np.zeros(8, np.float32)}
    ref = torch.zeros(8, requires_grad=True)
    outer = torch.optim.SGD([ref], lr=0.5, momentum=0.5, nesterov=True)
    async with await cluster.connect() as c:
        ranks = [await ParameterStore.open(c, "t-diloco-delayed", params, rank=r, **_diloco_options(2))
                 for r in range(2)]
        momentum = await c.attach(outer_momentum_name("t-diloco-delayed"))
        both = np.empty(16, np.float32)
        for group in range(3):
            a, b = ds[2 * group], ds[2 * group + 1]
            before = (await ranks[0].buf.read(ranks[0].data_off, 32)).view(np.float32).copy()
            await _round(ranks[0], a)
            half = (await ranks[0].buf.read(ranks[0].data_off, 32)).view(np.float32).copy()
            await momentum.read_into(both, 0)
            np.testing.assert_array_equal(half - before, -0.5 * a / 2)      # the plain part alone
            np.testing.assert_array_equal(both[8:], a / 2)                  # waiting in B
            await _round(ranks[1], b)
            ref.grad = torch.from_numpy((a + b) / 2)
            outer.step()
            shared = (await ranks[1].buf.read(ranks[1].data_off, 32)).view(np.float32)
            await momentum.read_into(both, 0)
            np.testing.assert_array_equal(shared, ref.detach().numpy(), err_msg=f"group {group}")
            np.testing.assert_array_equal(both[:8], outer.state[ref]["momentum_buffer"].numpy())
            np.testing.assert_array_equal(both[8:], np.zeros(8, np.float32))
        assert [await s.read_version() for s in ranks] == [6, 6]
        assert ranks[0].lag.scaled == ranks[1].lag.scaled == 0


async def test_a_late_pseudo_gradient_moves_the_model_by_its_lag_share(cluster: smb2.LocalCluster) -> None:
    # W = 2 workers, so the expected lag is W - 1 = 1 pseudo-gradient; rank 1 pushes 4 (two groups,
    # two momentum steps) while rank 0 trains a round: rank 0's pseudo-gradient lands 4 late, 5th,
    # and counts 1/4 (and 1/W): it moves the weights by exactly -lr s D, s = 1/8, and waits in B
    # for the next momentum step (M unchanged)
    params = {"w": np.zeros(8, np.float32)}
    async with await cluster.connect() as c:
        zero = await ParameterStore.open(c, "t-diloco-lag", params, rank=0, **_diloco_options(2))
        one = await ParameterStore.open(c, "t-diloco-lag", params, rank=1, **_diloco_options(2))
        for store in (zero, one):
            store.lag = LagScaling(2, 0)
        for _ in range(4):
            await _round(one, np.ones(8, np.float32))       # D = 1
        assert one.lag.scaled == 0              # each of its own saw the one before: lag 0
        momentum = await c.attach(outer_momentum_name("t-diloco-lag"))
        before, after = np.empty(16, np.float32), np.empty(16, np.float32)
        await momentum.read_into(before, 0)
        shared_before = (await zero.buf.read(zero.data_off, 32)).view(np.float32).copy()
        await _round(zero, np.full(8, 2.0, np.float32))     # D = 2, pulled at version 0, lands at 5
        shared = (await zero.buf.read(zero.data_off, 32)).view(np.float32)
        await momentum.read_into(after, 0)
    s = (1 / 4) / 2
    np.testing.assert_array_equal(shared - shared_before, np.full(8, -0.5 * s * 2.0, np.float32))
    np.testing.assert_array_equal(after[:8], before[:8])                  # M: no momentum step yet
    np.testing.assert_array_equal(after[8:] - before[8:], np.full(8, s * 2.0, np.float32))
    assert zero.lag.scaled == 1 and zero.lag.max_lag == 4
    np.testing.assert_array_equal(zero.params["w"], shared)      # its next round starts from them


async def test_the_numpy_api_takes_inner_steps_then_a_round(cluster: smb2.LocalCluster) -> None:
    # ParameterStore.push with rule diloco: an SGD step on the worker's copy (nothing sent), and at
    # the round's end the outer step: D = 1, m = D, w = -0.5 (D + 0.5 m) = -0.75
    async with await cluster.connect() as c:
        store = await ParameterStore.open(c, "t-diloco-numpy", {"w": np.zeros(4, np.float32)}, rule="diloco",
                                          lr=0.5, local_steps=2, outer_lr=0.5, outer_momentum=0.5, wire=None,
                                          workers=1, rank=0, resume=False)
        await store.push({"w": np.ones(4, np.float32)})
        first = (await store.buf.read(store.data_off, 16)).view(np.float32).copy()
        local = store.params["w"].copy()
        await store.push({"w": np.ones(4, np.float32)})
        shared = (await store.buf.read(store.data_off, 16)).view(np.float32).copy()
        version = await store.read_version()
    np.testing.assert_array_equal(first, np.zeros(4, np.float32))      # a local step sends nothing
    np.testing.assert_array_equal(local, np.full(4, -0.5, np.float32))
    np.testing.assert_array_equal(shared, np.full(4, -0.75, np.float32))
    np.testing.assert_array_equal(store.params["w"], shared)            # the next round starts there
    assert version == 1


def test_a_nan_pseudo_gradient_is_refused_in_training_terms(servers: str) -> None:
    # rank 0's weights turn NaN in its second round (step 6): the round's push at step 8 is refused
    # with the rank and the step; the shared model stays round 1's, finite
    model = TwoHeads()
    opt = async_optimizer(model, torch.optim.SGD(model.parameters(), lr=LR), servers, "t-diloco-nan", rule="diloco",
                 local_steps=4)
    constant_steps(opt, model, 4)
    opt.flush()
    before = shared_values(opt)
    constant_steps(opt, model, 1)
    with torch.no_grad():
        model.a.weight[0, 0] = float("nan")
    with pytest.raises(TrainingDiverged) as err:
        constant_steps(opt, model, 3)
        opt.flush()
    msg = str(err.value)
    assert "rank 0" in msg and "step 8" in msg and "'a.weight'" in msg and "not pushed" in msg, msg
    after = shared_values(opt)
    for n, v in after.items():
        np.testing.assert_array_equal(v, before[n], err_msg=n)
    with pytest.raises(TrainingDiverged):
        opt.close()
    assert opt.closed


def test_a_resumed_run_keeps_the_outer_momentum(servers: str) -> None:
    # run 1: two rounds and close; run 2 resumes the store and trains a third: the shared weights are
    # those of three outer steps with one momentum (exact: dyadic values)
    def run(rounds: int, resume: bool, name: str) -> dict[str, np.ndarray]:
        model = TwoHeads()
        opt = st.AsyncOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model, name=name, servers=servers,
                                rank=0, world_size=1, resume=resume, rule="diloco", local_steps=2,
                                outer_lr=0.5, outer_momentum=0.5, push_dtype="float32")
        assert opt.resumed == resume
        constant_steps(opt, model, 2 * rounds)
        opt.close(wait_all=30)
        return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}

    run(2, False, "t-diloco-resume")
    resumed = run(1, True, "t-diloco-resume")
    for n, g in GRAD.items():
        d, w, m = 2 * LR * g, 0.0, 0.0
        for _ in range(3):
            m = 0.5 * m + d
            w -= 0.5 * (d + 0.5 * m)
        # (a momentum started over would give -0.5 (d + 0.5 d) for the third step)
        np.testing.assert_array_equal(resumed[n], np.full(resumed[n].shape, w, np.float32), err_msg=n)


def test_rm_removes_the_outer_momentum(servers: str) -> None:
    model = TwoHeads()
    with async_optimizer(model, torch.optim.SGD(model.parameters(), lr=LR), servers, "t-diloco-rm", rule="diloco",
                local_steps=2) as opt:
        constant_steps(opt, model, 2)
        opt.flush()
    out = subprocess.run([sys.executable, "-m", "smb2.cli", "rm", "t-diloco-rm", "--servers", servers],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    ls = subprocess.run([sys.executable, "-m", "smb2.cli", "ls", "--json", servers], capture_output=True, text=True,
                        timeout=60)
    assert "t-diloco-rm" not in ls.stdout, ls.stdout


@pytest.mark.parametrize(("options", "match"), [
    ({"local_steps": 0}, "local_steps must be a positive int"),
    ({"local_steps": 2.5}, "local_steps must be a positive int"),
    ({"outer_lr": 0}, "outer_lr must be a number > 0"),
    ({"outer_lr": "0.7"}, "outer_lr must be a number > 0"),
    ({"outer_momentum": 1.0}, r"outer_momentum must be a number in \[0, 1\)"),
    ({"outer_momentum": -0.1}, r"outer_momentum must be a number in \[0, 1\)"),
    ({"compress": "sparseloco:0.02", "outer_momentum": 0.5}, "'sparseloco:0.02' makes no outer momentum step"),
    ({"compress": "sparseloco:0.02,decay=2"}, "compress must be 'topk:F' or 'sparseloco:F'"),
    ({"push_dtype": "int8"}, "push_dtype must be one of"),
    ({"local_steps": 4, "rule": "delta"}, "bad options for rule 'delta'.*local_steps"),
])
def test_bad_options_are_refused(servers: str, options: dict[str, Any], match: str) -> None:
    model = TwoHeads()
    options = {"rule": "diloco", **options}
    with pytest.raises(smb2.InvalidArgumentError, match=match):
        async_optimizer(model, torch.optim.SGD(model.parameters(), lr=LR), servers, "t-diloco-bad", **options)


#: how far below the single process 4 diloco workers may end (points): the 2 asked of it.  Each round
#: counts 1/W, so the shared model learns as DDP does at W times the batch; the example scales its
#: inner lr by W for diloco, as DDP users scale theirs (the linear scaling rule).  Measured: 96.47-
#: 97.77 % in seven runs against the single process's 97.22 %; unscaled, 90.9-94.6 %, where DDP's own
#: arithmetic ends 0.4-1.9 points below (docs/training.md, "Measurements", "DiLoCo on digits").  It fails on
#: a collapse (the paper's outer momentum 0.9 at every pseudo-gradient: 39-46 %), a regression of
#: the outer step, or the example losing its lr scaling
GAP_POINTS = 2.0


#: the compressed exchange: 5 % of the entries a round, error feedback keeping the rest (96.66-96.85 %
#: measured on a quiet machine; 1 % reached 94.99 %: 15 rounds a worker are too few to carry this
#: model at 1 %, 96.1 % with rounds of 2 steps; docs/training.md, "Compressed exchange")
COMPRESS = "topk:0.05"
#: its bar, wider than the dense exchange's: beside two busy loops (half the runs beside a make test
#: too) it ended at 95.92-97.40 % in 14 runs and once in 12 more at 95.18 % (2.04 points below the
#: single process), the dense one at 96.47-97.40 % (docs/training.md, "Compressed exchange").  The
#: compression's own criterion is bench tta's (the final loss against dense diloco's); this bar fails on a collapse
#: (39-46 %) or a regression that costs the compressed run more than 3 points
COMPRESSED_GAP_POINTS = 3.0


#: SparseLoCo's form: 2 % of the entries a round, the residual decaying by 0.95, no outer momentum step,
#: outer lr 1 (docs/training.md, "Compressed exchange")
SPARSELOCO = "sparseloco:0.02"
#: its bar, the top-k one's: on a busy 2-core machine (load 3-4 from other work) it ended at 95.55-96.85 %
#: in 6 runs (median 96.57, at most 1.67 points below the single process's 97.22 %), dense diloco at
#: 96.47-97.59 % in 5 runs, the same cut without the decay at 95.55-96.47 % in 5 (docs/training.md,
#: "Compressed exchange").  It fails on a collapse or a regression that costs the run more than 3 points
SPARSELOCO_GAP_POINTS = 3.0
#: and its bytes: a worker's uploads per exchange at least this many times fewer than dense diloco's (bf16,
#: its momentum steps included), from both runs' own counters (about 46x by the docs' table)
SPARSELOCO_FEWER_BYTES = 10.0


def _diloco_run(servers: str, compress: str | None) -> tuple[list[dict[str, Any]], float]:
    """4 torchrun workers of rule diloco on digits beside the single process: every rank's JSON line and
    the single process's accuracy.  The same samples in all: 12 epochs of all the data at batch 32,
    while the workers start up."""
    pytest.importorskip("sklearn", reason="the digits data set needs scikit-learn")
    more = [] if compress is None else ["--compress", compress]
    ranks, single = torchrun_beside_single(servers, "--rule", "diloco", "--name",
                                           f"t-run-diloco-{(compress or 'dense').partition(':')[0]}", *more)
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    return ranks, single


@pytest.fixture(scope="module")
def dense_diloco(servers: str) -> tuple[list[dict[str, Any]], float]:
    """The dense exchange's run, once a module: its own test and the byte count SparseLoCo's is held to."""
    return _diloco_run(servers, None)


def _bytes_per_exchange(ranks: list[dict[str, Any]]) -> float:
    """What a worker uploaded per exchange, over all ranks (their own counters; dense: its momentum steps
    included, made by one worker in W)."""
    return sum(r["bytes_pushed"] for r in ranks) / sum(r["exchanges"] for r in ranks)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("compress", [None, COMPRESS], ids=["dense", "topk"])
def test_torchrun_diloco_workers_train_the_shared_model(servers: str, record_property: Any,
                                                        request: pytest.FixtureRequest, compress: str | None) -> None:
    ranks, single = request.getfixturevalue("dense_diloco") if compress is None else _diloco_run(servers, compress)
    assert len({r["accuracy"] for r in ranks}) == 1        # every rank evaluated the same shared model
    record_property("accuracy", {"workers": ranks[0]["accuracy"], "single": single,  # --junitxml (legacy family)
                                 "bytes_pushed": sum(r["bytes_pushed"] for r in ranks)})
    assert single > 95.0, single                           # the reference itself trained (97.2 % measured)
    gap = GAP_POINTS if compress is None else COMPRESSED_GAP_POINTS
    assert ranks[0]["accuracy"] >= single - gap, (ranks[0], single)


@pytest.mark.slow
@pytest.mark.timeout(600)      # (the dense run too, where this test runs alone)
def test_torchrun_sparseloco_workers_train_with_ten_times_fewer_bytes(
        servers: str, record_property: Any, dense_diloco: tuple[list[dict[str, Any]], float]) -> None:
    ranks, single = _diloco_run(servers, SPARSELOCO)
    assert len({r["accuracy"] for r in ranks}) == 1        # every rank evaluated the same shared model
    dense = _bytes_per_exchange(dense_diloco[0])
    sparse = _bytes_per_exchange(ranks)
    record_property("accuracy", {"workers": ranks[0]["accuracy"], "single": single,  # --junitxml (legacy family)
                                 "bytes_per_exchange": sparse, "dense_bytes_per_exchange": dense})
    assert single > 95.0, single                           # the reference itself trained (97.2 % measured)
    assert ranks[0]["accuracy"] >= single - SPARSELOCO_GAP_POINTS, (ranks[0], single)
    assert dense >= SPARSELOCO_FEWER_BYTES * sparse, (dense, sparse)
