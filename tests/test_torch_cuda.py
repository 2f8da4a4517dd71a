"""smb2.torch on a CUDA GPU: the staging path (pinned host mirrors, a side
stream, device<->host copies) against the CPU path every other torch test
takes.  Each training here runs twice, on the CPU and on the GPU, from the
same weights and batches: what reaches the store and the model must agree
to float32 rounding.  Then the example script, run with torchrun on the GPU,
and a resume whose optimizer moments live on the GPU.  Skipped where there
is no GPU (CI has none)."""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import subprocess
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed here (pip install 'smb2[torch]')")

import smb2.torch as st  # noqa: E402
from smb2.errors import InvalidArgumentError, NotifyTimeout  # noqa: E402
from smb2.testing.torch_models import (  # noqa: E402
    EXAMPLE,
    async_optimizer,
    mean_step_reference,
    rank_batches,
    shared_values,
    single_process_accuracy,
    small_model,
    sparse_model,
    sparse_steps,
)
from smb2.testing.workers import json_objects, torchrun, torchrun_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA GPU on this machine: the staging path runs on CPU tensors in the other torch tests")


def _data(device: str, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 10, generator=g)
    return x.to(device), ((x[:, 0] > 0).long() + (x[:, 1] > 0).long()).to(device)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, device: str,
           clip: float | None = None, flush_every: int = 0) -> None:
    x, y = _data(device)
    g = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        idx = torch.randint(0, len(x), (32,), generator=g).to(device)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if flush_every and step % flush_every == 0:
            opt.flush()         # the round's exchange is in before the next round starts


def test_a_cuda_model_trains_through_pinned_mirrors(servers: str) -> None:
    model = small_model().cuda()
    x, y = _data("cuda")
    with async_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), servers, "t-cuda",
                         rule="delta", staleness=1) as opt:
        assert opt.staging.cuda and opt.staging.stream is not None
        first = torch.nn.functional.cross_entropy(model(x), y).item()
        _train(model, opt, 50, "cuda")
        opt.flush()
        assert torch.nn.functional.cross_entropy(model(x), y).item() < first * 0.7
        shared = shared_values(opt)
    for name, p in model.named_parameters():
        assert p.device.type == "cuda", name
        np.testing.assert_allclose(shared[name], p.detach().cpu().numpy(), rtol=1e-4, atol=1e-5)


# (name, the torch optimizer, AsyncOptimizer's options, gradient clipping, a flush every so many steps,
# BatchNorm).  Each is one whose single worker does not depend on when its pushes land: staleness 0, and the
# rounds of diloco and easgd flushed (with pushes in flight a late push is scaled by its lag, a matter of
# timing).  The Adam family trains the model without BatchNorm: the bias before a BatchNorm has a gradient
# that is zero but for rounding, which Adam's normalized step turns into whole +-lr steps that differ between
# a CPU's and a GPU's rounding (on an H200: 0.065 apart after 24 steps, every other parameter within 2e-3)
RUNS: list[tuple[str, Callable[[Any], torch.optim.Optimizer], dict[str, Any], float | None, int, bool]] = [
    # the default rule (allreduce): the mean of one worker is its gradient, sent as float32 to come back the same
    ("allreduce-adamw-clipped", lambda p: torch.optim.AdamW(p, lr=0.01), {"push_dtype": "float32"}, 1.0, 0, False),
    ("allreduce-sgd-momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), {}, None, 0, True),
    ("delta-sgd-momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), {"rule": "delta", "staleness": 0},
     None, 0, True),
    ("delta-adamw-clipped", lambda p: torch.optim.AdamW(p, lr=0.01), {"rule": "delta", "staleness": 0}, 1.0, 0,
     False),
    # pushed after step() on both devices (on the CPU it could push during backward: other bytes, same sums)
    ("accumulate", lambda p: torch.optim.SGD(p, lr=0.1),
     {"rule": "accumulate", "staleness": 0, "push_in_backward": False}, 0.5, 0, True),
    ("diloco", lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
     {"rule": "diloco", "local_steps": 4, "push_dtype": "float32"}, None, 4, True),
    ("diloco-adamw-bf16", lambda p: torch.optim.AdamW(p, lr=0.01), {"rule": "diloco", "local_steps": 4}, None, 4,
     False),
    ("easgd", lambda p: torch.optim.SGD(p, lr=0.1), {"rule": "easgd", "tau": 2, "alpha": 0.5}, None, 2, True),
]


@pytest.mark.parametrize(("label", "make", "options", "clip", "flush_every", "bn"), RUNS, ids=[r[0] for r in RUNS])
def test_the_gpu_path_trains_as_the_cpu_path(servers: str, label: str, make: Callable[[Any], torch.optim.Optimizer],
                                             options: dict[str, Any], clip: float | None, flush_every: int,
                                             bn: bool) -> None:
    # one worker, the same weights, batches and rule on both devices: the store and the model end the
    # same (to float32 rounding: the GPU's kernels sum in another order), so the staging path (pinned
    # mirrors, the side stream, the copies back) neither loses nor repeats a change
    ends = {}
    for device in ("cpu", "cuda"):
        model = small_model(bn=bn).to(device)
        with async_optimizer(model, make(model.parameters()), servers, f"t-gpu-{label}-{device}", **options) as opt:
            assert opt.staging.cuda == (device == "cuda")
            _train(model, opt, 24, device, clip, flush_every)
            opt.flush()
            shared = shared_values(opt)
            pushed = opt.stats()["bytes_pushed"]
        local = {n: v.detach().cpu().numpy() for n, v in model.state_dict().items()}
        ends[device] = (shared, local, pushed)
    (cpu_shared, cpu_local, cpu_pushed), (gpu_shared, gpu_local, gpu_pushed) = ends["cpu"], ends["cuda"]
    assert gpu_pushed == cpu_pushed > 0
    trains_locally = options.get("rule", "allreduce") == "allreduce"
    assert {n for n, _ in small_model(bn=bn).named_parameters()} <= cpu_shared.keys()
    for name in cpu_shared:
        np.testing.assert_allclose(gpu_shared[name], cpu_shared[name], rtol=2e-3, atol=2e-5, err_msg=name)
        np.testing.assert_allclose(gpu_local[name], cpu_local[name], rtol=2e-3, atol=2e-5, err_msg=name)
        # something was trained (allreduce's store gets rank 0's weights at close only: the model's)
        assert np.abs((cpu_local if trains_locally else cpu_shared)[name]).max() > 0, name


def test_pushes_in_backward_are_refused_for_a_gpu_model_and_skipped_where_possible(servers: str) -> None:
    # a GPU model's gradients are staged after step(), on the side stream: "where possible" (None) is
    # not here, and True says why
    model = small_model().cuda()
    with pytest.raises(InvalidArgumentError, match="not on the CPU"):
        async_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), servers, "t-gpu-bw-refused",
                        rule="accumulate", push_in_backward=True)
    with async_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), servers, "t-gpu-bw",
                         rule="accumulate", staleness=0) as opt:
        _train(model, opt, 4, "cuda")
        opt.flush()
        assert opt.stats()["pushes_in_backward"] == 0


def test_a_resumed_run_on_the_gpu_gets_its_moments_back_on_the_gpu(servers: str) -> None:
    model = small_model().cuda()
    opt = async_optimizer(model, torch.optim.AdamW(model.parameters(), lr=0.01), servers, "t-gpu-resume",
                          rule="delta", staleness=0, state_every=60.0)     # saved at close()
    _train(model, opt, 12, "cuda")
    opt.flush()
    saved = copy.deepcopy(opt.state_dict())
    opt.close()
    model2 = small_model().cuda()
    opt2 = st.AsyncOptimizer(torch.optim.AdamW(model2.parameters(), lr=0.01), model2, name="t-gpu-resume",
                             servers=servers, rank=0, world_size=1, rule="delta", staleness=0, resume=True)
    try:
        assert opt2.resumed
        state = opt2.state_dict()["state"]
        assert state.keys() == saved["state"].keys() and state
        for i, moments in state.items():
            for key, value in moments.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    assert value.device.type == "cuda", (i, key, value.device)
                torch.testing.assert_close(torch.as_tensor(value).cpu(),
                                           torch.as_tensor(saved["state"][i][key]).cpu())
        _train(model2, opt2, 3, "cuda")           # and it steps on from them
    finally:
        opt2.close()


def _alone_and_through_smb2(servers: str, make_model: Callable[[], torch.nn.Module],
                            make_opt: Callable[[torch.nn.Module], torch.optim.Optimizer],
                            loop: Callable[[torch.optim.Optimizer, torch.nn.Module], Any], name: str,
                            **options: Any) -> tuple[torch.nn.Module, torch.nn.Module, Any, Any]:
    """``loop`` on the GPU twice from the same weights: with the plain
    optimizer, then with it wrapped as the one worker of store ``name`` on
    ``servers``
    (float32 on the wire unless ``options`` say otherwise).  Both models and
    what each loop returned."""
    alone = make_model().cuda()
    got_alone = loop(make_opt(alone), alone)
    model = make_model().cuda()
    options.setdefault("push_dtype", "float32")
    with async_optimizer(model, make_opt(model), servers, name, **options) as opt:
        assert opt.staging.cuda
        got = loop(opt, model)
        opt.flush()
    return alone, model, got_alone, got


def _same_weights(alone: torch.nn.Module, model: torch.nn.Module) -> None:
    # the same kernels on the same device and the mean of one worker, float32 both ways: equal but for
    # the order of the optimizer's additions
    for (name, a), (_, b) in zip(alone.named_parameters(), model.named_parameters()):
        assert b.device.type == "cuda", name
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("rule", ["allreduce", "accumulate"])
def test_mixed_precision_on_the_gpu_skips_the_steps_plain_torch_skips(servers: str, rule: str) -> None:
    # autocast to float16 and torch's GradScaler on the GPU, a first scale that overflows: the steps the
    # scaler skips (its inf/nan check reads the GPU's gradients) are the ones it skips without smb2,
    # and the weights end the same; no overflow reaches the store
    x, y = _data("cuda")

    def loop(opt: torch.optim.Optimizer, model: torch.nn.Module) -> list[float]:
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 24)
        scales = []
        for i in range(8):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x[i * 32:i * 32 + 32]), y[i * 32:i * 32 + 32])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales

    alone, model, scales_alone, scales = _alone_and_through_smb2(
        servers, small_model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), loop, f"t-gpu-scaler-{rule}",
        rule=rule, staleness=0)
    skipped = sum(b < a for a, b in zip([2.0 ** 24] + scales_alone, scales_alone))
    assert 0 < skipped < 8, scales_alone
    assert scales == scales_alone
    _same_weights(alone, model)
    for p in model.parameters():
        assert torch.isfinite(p).all()


class _WithUnused(torch.nn.Module):
    """A layer the loss never uses, beside a small model."""

    def __init__(self) -> None:
        super().__init__()
        self.body = small_model()
        self.unused = torch.nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_no_sync_and_an_unused_layer_on_the_gpu_as_plain_torch(servers: str) -> None:
    # the default rule on a GPU model: two micro-batches a step, the first inside no_sync(), one round a
    # step; the unused layer keeps .grad None (AdamW's weight decay leaves it alone, as under DDP); the
    # weights end as plain torch's accumulation
    batches = [(x.cuda(), y.cuda()) for x, y in rank_batches(12, 0)]

    def loop(opt: torch.optim.Optimizer, model: torch.nn.Module) -> int:
        plain = not isinstance(opt, st.AsyncOptimizer)
        for s in range(6):
            opt.zero_grad()
            for m, (x, y) in enumerate(batches[2 * s:2 * s + 2]):
                with contextlib.nullcontext() if plain or m else opt.no_sync():
                    (torch.nn.functional.cross_entropy(model(x), y) / 2).backward()
            assert model.unused.weight.grad is None
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
        return 0 if plain else opt.stats()["exchanges"]

    untouched = _WithUnused().unused.weight.detach().cuda()
    alone, model, _, exchanges = _alone_and_through_smb2(
        servers, _WithUnused, lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1), loop,
        "t-gpu-no-sync")
    assert exchanges == 6
    assert torch.equal(model.unused.weight.detach(), untouched)
    _same_weights(alone, model)


def test_sparse_gradients_on_the_gpu_come_back_sparse(servers: str) -> None:
    # nn.EmbeddingBag(sparse=True) on the GPU under the default rule: the mean comes back sparse and on
    # the GPU (SparseAdam takes no other), and the weights end as plain torch's
    alone, model, _, _ = _alone_and_through_smb2(
        servers, sparse_model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        lambda opt, m: sparse_steps(opt, m, "cuda"), "t-gpu-sparse")
    _same_weights(alone, model)


_TWO_RANKS = textwrap.dedent('''
    import json, sys
    import torch
    import smb2.torch as st
    from smb2.testing.torch_models import rank_batches, small_model

    steps, clip = int(sys.argv[2]), float(sys.argv[3])
    model = small_model().cuda()
    opt = st.AsyncOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model, name=sys.argv[1],
                            push_dtype="float32", resume=False)
    for x, y in rank_batches(steps, opt.rank):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    exchanges = opt.stats()["exchanges"]
    opt.close(wait_all=60)
    print(json.dumps({"rank": opt.rank, "exchanges": exchanges,
                      "weights": {n: p.detach().cpu().flatten().tolist() for n, p in model.named_parameters()}}),
          flush=True)
''')


def test_two_torchrun_ranks_on_the_gpu_end_at_the_weights_of_the_mean_step(servers: str, tmp_path: Path) -> None:
    # two torchrun ranks, each its model on the GPU, the default rule with float32 on the wire and the
    # gradients clipped after backward: both end at the same weights, bit for bit, those of one AdamW on
    # the CPU stepping on the clipped mean (to float32 rounding: the GPU sums in another order)
    steps, workers, clip = 12, 2, 0.5
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS)
    env = dict(os.environ, SMB2_SERVERS=servers, OMP_NUM_THREADS="1")
    ranks, _ = torchrun_ranks(script, "t-gpu-two", str(steps), str(clip), nproc=workers, env=env, timeout=300)
    assert [r["exchanges"] for r in ranks] == [steps] * workers
    ref = mean_step_reference(steps, workers, clip)
    for name, want in ref.items():
        got = [torch.tensor(r["weights"][name]) for r in ranks]
        assert torch.equal(got[0], got[1]), name
        torch.testing.assert_close(got[0], want.flatten(), rtol=2e-3, atol=2e-5, msg=name)


def test_two_ranks_of_one_process_on_one_gpu_are_refused(servers: str) -> None:
    # ranks as threads of one process, on one GPU: autograd runs both backward passes on that GPU's one
    # thread, where one rank's end of backward would wait forever for the other's gradients.  Whichever
    # rank comes second is refused in words; the first waits for it to join until its timeout.  Both
    # give the GPU back
    errors: dict[int, Exception] = {}

    def open_rank(rank: int) -> None:
        model = small_model().cuda()
        try:
            async_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), servers, "t-gpu-threads", rank=rank,
                            world_size=2, timeout=3).close()
        except Exception as e:      # noqa: BLE001 (the test looks at each)
            errors[rank] = e

    threads = [threading.Thread(target=open_rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [r for r, e in errors.items() if isinstance(e, InvalidArgumentError)]
    assert len(refused) == 1 and sorted(errors) == [0, 1], errors
    second = refused[0]
    assert f"rank {second} of store 't-gpu-threads' would train on cuda:0 beside rank {1 - second}, in this " \
           f"same process" in str(errors[second])
    assert isinstance(errors[1 - second], NotifyTimeout), errors
    model = small_model().cuda()
    with pytest.raises(NotifyTimeout):      # (not refused: the GPU was given back)
        async_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), servers, "t-gpu-threads-again",
                        rank=second, world_size=2, timeout=1)


@pytest.mark.parametrize("rule", ["allreduce", "delta", "diloco"])
def test_torchrun_workers_on_the_gpu_match_ddp_accuracy(servers: str, rule: str) -> None:
    # the example as a user runs it on a GPU host: 4 ranks sharing the host's GPU (--device's default)
    pytest.importorskip("sklearn", reason="the digits data set needs scikit-learn")
    env = dict(os.environ, SMB2_SERVERS=servers, OMP_NUM_THREADS="1")
    # (the asynchronous rules at the staleness the recipe gives them; allreduce's rounds have none)
    staleness = [] if rule == "allreduce" else ["--staleness", "1"]
    out = subprocess.run(torchrun(str(EXAMPLE), "--epochs", "12", *staleness, "--rule", rule,
                                  "--name", f"t-gpu-run-{rule}", nproc=4),
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = json_objects(out.stdout)
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    assert all(r["device"].startswith("cuda") for r in ranks), ranks
    assert len({r["accuracy"] for r in ranks}) == 1           # one shared model, evaluated by each
    ddp = statistics.median(single_process_accuracy("sgd", 12, seed, world=4) for seed in range(3))
    print(f"{rule} on the GPU: {ranks[0]['accuracy']:.2f} % against DDP's arithmetic {ddp:.2f} %")
    assert ranks[0]["accuracy"] >= ddp - 2.5, (ranks[0], ddp)
