"""smb2.torch on a CUDA GPU: the staging path (pinned host mirrors, a side
stream, device<->host copies) against the CPU path every other torch test
takes.  Each training here runs twice, on the CPU and on the GPU, from the
same weights and batches: what reaches the store and the model must agree
to float32 rounding.  Then the example script, run with torchrun on the GPU,
and a resume whose optimizer moments live on the GPU.  Skipped where there
is no GPU (CI has none)."""

from __future__ import annotations

import copy
import os
import statistics
import subprocess
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed here (pip install 'smb2[torch]')")

import smb2.torch as st  # noqa: E402
from smb2.errors import InvalidArgumentError  # noqa: E402
from smb2.testing.torch_models import (  # noqa: E402
    EXAMPLE,
    async_optimizer,
    shared_values,
    single_process_accuracy,
    small_model,
)
from smb2.testing.workers import json_objects, torchrun  # noqa: E402

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
    assert {n for n, _ in small_model(bn=bn).named_parameters()} <= cpu_shared.keys()
    for name in cpu_shared:
        np.testing.assert_allclose(gpu_shared[name], cpu_shared[name], rtol=2e-3, atol=2e-5, err_msg=name)
        np.testing.assert_allclose(gpu_local[name], cpu_local[name], rtol=2e-3, atol=2e-5, err_msg=name)
        assert np.abs(cpu_shared[name]).max() > 0, name        # something was trained


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


@pytest.mark.parametrize("rule", ["delta", "diloco"])
def test_torchrun_workers_on_the_gpu_match_ddp_accuracy(servers: str, rule: str) -> None:
    # the example as a user runs it on a GPU host: 4 ranks sharing the host's GPU (--device's default)
    pytest.importorskip("sklearn", reason="the digits data set needs scikit-learn")
    env = dict(os.environ, SMB2_SERVERS=servers, OMP_NUM_THREADS="1")
    out = subprocess.run(torchrun(str(EXAMPLE), "--epochs", "12", "--staleness", "1", "--rule", rule,
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
