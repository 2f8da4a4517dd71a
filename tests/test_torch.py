"""smb2.torch: a torch.nn.Module trained through the parameter store."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import smb2

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed here (make test installs torch==2.13.0 where pip can get it; "
                    "pip install 'smb2[torch]')")

import smb2.torch as st  # noqa: E402


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(3, 10, generator=torch.Generator().manual_seed(99)) * 2
    y = torch.randint(0, 3, (n,), generator=g)
    return centers[y] + torch.randn(n, 10, generator=g), y


async def test_parameters_are_bound_without_copies(client: smb2.Client) -> None:
    model = _model(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    dm = await st.DistributedModule.open(client, "t-bind", model, rank=0, world_size=1, lr=0.1)
    for name, p in model.named_parameters():
        view = dm.store.params[name]
        assert p.data_ptr() == view.ctypes.data          # the mirror's memory itself
        assert torch.equal(p.detach(), before[name])
        assert p.requires_grad
    # a pull changes the module in place
    buf = dm.store.buf
    off, n = dm.store.ranges["0.bias"]
    await buf.write(off, np.full(n // 4, 7.0, np.float32))
    await dm.pull()
    assert torch.equal(model[0].bias.detach(), torch.full((32,), 7.0))


async def test_push_applies_the_gradients(client: smb2.Client) -> None:
    model = _model(1)
    w0 = model[2].weight.detach().clone()
    dm = await st.DistributedModule.open(client, "t-push", model, rank=0, world_size=1, lr=0.5)
    x, y = _data(8, 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    g = model[2].weight.grad.detach().clone()
    await dm.step()
    assert model[2].weight.grad is None
    torch.testing.assert_close(model[2].weight.detach(), w0 - 0.5 * g)


async def test_two_ranks_train_together(cluster: smb2.LocalCluster, transport: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    x, y = _data(512, 1)
    xt, yt = _data(256, 2)
    models = [_model(10), _model(11)]          # rank 1's own init is replaced by rank 0's
    clients = [await cluster.connect(transport=transport) for _ in range(2)]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    dm0 = await st.DistributedModule.open(clients[0], "t-two", models[0], lr=0.05)
    monkeypatch.setenv("RANK", "1")
    dm1 = await st.DistributedModule.open(clients[1], "t-two", models[1], lr=0.05)
    assert dm1.store.rank == 1 and dm1.store.workers == 2
    for (_, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.equal(a.detach(), b.detach())

    def acc() -> float:
        with torch.no_grad():
            return float((models[0](xt).argmax(1) == yt).float().mean())

    start = acc()

    async def work(r: int, dm: st.DistributedModule) -> None:
        for _epoch in range(3):
            for s in range(r * 16, len(x), 32):
                loss = torch.nn.functional.cross_entropy(models[r](x[s:s + 16]), y[s:s + 16])
                loss.backward()
                await dm.step()
                await asyncio.sleep(0)

    await asyncio.gather(work(0, dm0), work(1, dm1))
    await dm0.pull()
    assert acc() > max(0.9, start + 0.2)
    assert await dm0.store.read_version() == 2 * 3 * 16


async def test_mismatched_module_is_refused(client: smb2.Client) -> None:
    await st.DistributedModule.open(client, "t-mis", _model(0), rank=0, world_size=2)
    other = torch.nn.Sequential(torch.nn.Linear(10, 3))
    # every rank opens the store with its module: another model is refused, naming the store's
    with pytest.raises(smb2.InvalidArgumentError, match="another model"):
        await st.DistributedModule.open(client, "t-mis", other, rank=1, world_size=2)
    # (a rank > 0 of another WORLD_SIZE waits for its rank 0 to make the store again for it, then gives up)
    with pytest.raises(smb2.InvalidArgumentError, match="made for 2 workers, this job has WORLD_SIZE=3"):
        await st.DistributedModule.open(client, "t-mis", _model(0), rank=1, world_size=3, timeout=0.3)


async def test_stripe_reaches_the_store_on_every_rank(client: smb2.Client) -> None:
    # stripe is the store's option: rank 1 passing it must not hand it to the rule
    dm0 = await st.DistributedModule.open(client, "t-stripe", _model(0), rank=0, world_size=2, stripe=512, lr=0.1)
    dm1 = await st.DistributedModule.open(client, "t-stripe", _model(1), rank=1, world_size=2, stripe=512, lr=0.1)
    assert dm0.store.buf.stripe == dm1.store.buf.stripe == 512
    assert dm1.store.rule.lr == 0.1
