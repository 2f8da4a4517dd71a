"""smb2.train: the parameter store, its update rules' arithmetic, notifications
for version and progress, layer dropping.  (Accuracy: test_train_accuracy.py.)"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest

import smb2
from smb2.train import LayerDropping, ParameterStore
from smb2.train.example import MLP
from smb2.train.rules import EASGD
from smb2.train.stability import LagScaling


def _params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w0": rng.standard_normal((7, 5)).astype(np.float32),
            "b0": rng.standard_normal(5).astype(np.float32),
            "w1": rng.standard_normal((5, 3)).astype(np.float32)}


async def test_open_lays_out_and_mirrors(client: smb2.Client) -> None:
    init = _params()
    store = await ParameterStore.open(client, "st-basic", init, lr=0.5)
    assert list(store.params) == ["w0", "b0", "w1"]
    for name, arr in init.items():
        assert store.params[name].shape == arr.shape
        assert np.array_equal(store.params[name], arr)
        # views of one mirror: no copies
        assert np.shares_memory(store.params[name], store.mirror)
        off, n = store.ranges[name]
        assert off % 64 == 0 and n == arr.nbytes
    # what is in the buffer is what the mirror shows
    store.params["w0"][...] = 0
    await store.pull()
    assert np.array_equal(store.params["w0"], init["w0"])
    assert store.stats["pulls"] == 1


async def test_attach_by_name_only(client: smb2.Client, cluster: smb2.LocalCluster, transport: str) -> None:
    init = _params(3)
    await ParameterStore.open(client, "st-attach", init, rule="easgd", lr=0.25, tau=3, workers=2)
    other = await cluster.connect(transport=transport)
    seen = await ParameterStore.attach(other, "st-attach", rank=1)
    assert {k: v.tolist() for k, v in seen.params.items()} == {k: v.tolist() for k, v in init.items()}
    # the creator's rule and its settings come with the table
    assert isinstance(seen.rule, EASGD) and seen.rule.lr == 0.25 and seen.rule.tau == 3
    assert seen.workers == 2


async def test_a_second_process_attaches_by_name_only(client: smb2.Client, cluster: smb2.LocalCluster) -> None:
    init = _params(5)
    await ParameterStore.open(client, "st-proc", init)
    script = (
        "import asyncio, json, sys, smb2\n"
        "from smb2.train import ParameterStore\n"
        "async def main():\n"
        "    async with await smb2.connect(sys.argv[1]) as c:\n"
        "        s = await ParameterStore.attach(c, 'st-proc', timeout=20)\n"
        "        print(json.dumps({k: v.tolist() for k, v in s.params.items()}))\n"
        "asyncio.run(main())\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, ",".join(cluster.addresses),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    got = json.loads(out)
    assert list(got) == list(init)
    for k, v in init.items():
        assert np.array_equal(np.asarray(got[k], dtype=np.float32), v)


async def test_attach_waits_for_the_creator(client: smb2.Client, cluster: smb2.LocalCluster, transport: str) -> None:
    other = await cluster.connect(transport=transport)
    waiter = asyncio.ensure_future(ParameterStore.attach(other, "st-late", timeout=20))
    await asyncio.sleep(0.1)
    assert not waiter.done()
    await ParameterStore.open(client, "st-late", _params(1))
    seen = await waiter
    assert np.array_equal(seen.params["b0"], _params(1)["b0"])


async def test_attach_to_something_else_fails(client: smb2.Client) -> None:
    with pytest.raises(smb2.NoSuchBuffer):
        await ParameterStore.attach(client, "st-none", timeout=0.1)
    buf = await client.create("st-raw", 1 << 16)
    await buf.write(16, np.array([2], dtype=np.int64))     # "ready", but no magic
    with pytest.raises(smb2.InterfaceError, match="not a parameter store"):
        await ParameterStore.attach(client, "st-raw", timeout=1)


async def test_rank0_initializes_the_others_get_its_values(cluster: smb2.LocalCluster, transport: str) -> None:
    """Four workers open the same store at once, each with its own initial
    values, the others before rank 0: rank 0's values are what all see."""
    clients = [await cluster.connect(transport=transport) for _ in range(4)]
    stores = await asyncio.gather(*(ParameterStore.open(c, "st-race", _params(10 + r), workers=4, rank=r)
                                    for r, c in reversed(list(enumerate(clients)))))
    stores = stores[::-1]
    assert np.array_equal(stores[0].flat(), ParameterStore_flat(_params(10), stores[0]))
    for s in stores[1:]:
        assert np.array_equal(s.flat(), stores[0].flat())
        assert s.generation == stores[0].generation == 1 and not s.resumed and s.start_step == 0


def ParameterStore_flat(params: dict[str, np.ndarray], like: ParameterStore) -> np.ndarray:  # noqa: N802
    out = np.zeros_like(like.flat())
    for k, v in params.items():
        o = like.flat_offset(k)
        out[o:o + v.size] = v.ravel()
    return out


async def test_open_checks_its_arguments(client: smb2.Client) -> None:
    p = _params()
    with pytest.raises(smb2.InvalidArgumentError, match="unknown update rule"):
        await ParameterStore.open(client, "st-bad", p, rule="sgd-ish")
    with pytest.raises(smb2.InvalidArgumentError, match="bad options"):
        await ParameterStore.open(client, "st-bad", p, rule="accumulate", tau=3)
    with pytest.raises(smb2.InvalidArgumentError, match="lr"):
        await ParameterStore.open(client, "st-bad", p, lr=-1)
    with pytest.raises(smb2.InvalidArgumentError, match="rank"):
        await ParameterStore.open(client, "st-bad", p, workers=2, rank=2)
    with pytest.raises(smb2.InvalidArgumentError, match="float32 or float64"):
        await ParameterStore.open(client, "st-bad", {"w": np.zeros(3, dtype=np.int32)})
    with pytest.raises(smb2.InvalidArgumentError, match="one dtype"):
        await ParameterStore.open(client, "st-bad", {"a": np.zeros(3, np.float32), "b": np.zeros(3)})
    with pytest.raises(smb2.InvalidArgumentError, match="non-empty"):
        await ParameterStore.open(client, "st-bad", {})
    with pytest.raises(smb2.InvalidArgumentError, match="gradient rules"):
        await ParameterStore.open(client, "st-bad", p, rule="easgd", dropping=LayerDropping())
    store = await ParameterStore.open(client, "st-ok", p)
    with pytest.raises(smb2.InvalidArgumentError,
                       match=r"store 'st-ok' exists with another model \(its tensors: w0 \(7, 5\), b0 \(5,\), "
                             r"w1 \(5, 3\)\); remove it with `smb2 rm st-ok` or pick another name"):
        await ParameterStore.open(client, "st-ok", {"w0": np.zeros((2, 2), np.float32)})
    # (rank 0 of a job of another size makes the store again for it: test_lifecycle; a rank > 0 waits for that)
    with pytest.raises(smb2.InvalidArgumentError, match="made for 1 workers, this job has WORLD_SIZE=2"):
        await ParameterStore.open(client, "st-ok", p, workers=2, rank=1, timeout=0.2)
    with pytest.raises(smb2.InvalidArgumentError, match="resume must be"):
        await ParameterStore.open(client, "st-ok", p, resume="yes")
    with pytest.raises(smb2.InvalidArgumentError, match="shape"):
        await store.push({"w0": np.zeros(3, np.float32)})
    with pytest.raises(smb2.InvalidArgumentError, match="no tensor"):
        await store.push({"nope": np.zeros(3, np.float32)})
    with pytest.raises(smb2.InvalidArgumentError, match="policy"):
        await store.report(1, 10, policy="fastest")


@pytest.mark.parametrize("rule", ["accumulate", "locked", "locked-per-layer"])
async def test_gradient_rules_lose_no_update(cluster: smb2.LocalCluster, transport: str, rule: str) -> None:
    """Three workers push 5 steps each, concurrently: the shared weights end
    exactly at init - lr * (sum of all gradients)."""
    opts = {"per_layer": True} if rule == "locked-per-layer" else {}
    name = rule.split("-")[0]
    lr = 0.5
    init = {k: np.round(v * 4) / 4 for k, v in _params().items()}        # exact in float32
    clients = [await cluster.connect(transport=transport) for _ in range(3)]
    stores = [await ParameterStore.open(c, "st-" + rule, init, rule=name, lr=lr, workers=3, rank=r, **opts)
              for r, c in enumerate(clients)]
    total = {k: np.zeros_like(v) for k, v in init.items()}

    async def work(r: int) -> None:
        for step in range(5):
            g = {k: np.full(v.shape, (r + 1) * 0.25 + step * 0.125, np.float32) for k, v in init.items()}
            for k in g:
                total[k] += g[k]
            await stores[r].push(g)
            await asyncio.sleep(0)

    await asyncio.gather(*(work(r) for r in range(3)))
    await stores[0].pull()
    for k, v in init.items():
        np.testing.assert_array_equal(stores[0].params[k], v - lr * total[k])
    assert await stores[1].read_version() == 15


async def test_easgd_exchanges_with_the_center(client: smb2.Client) -> None:
    init = {"w": np.zeros(4, np.float32)}
    store = await ParameterStore.open(client, "st-easgd", init, rule="easgd", lr=1.0, alpha=0.5, tau=2)
    await store.push({"w": np.full(4, -2.0, np.float32)})       # local only: w = 2
    assert store.params["w"].tolist() == [2.0] * 4
    assert await store.read_version() == 0
    await store.push({"w": np.full(4, -2.0, np.float32)})       # w = 4, then exchange: d = 2
    assert store.params["w"].tolist() == [2.0] * 4               # w - d
    center = await store.rule.center()                           # type: ignore[attr-defined]
    assert center[:4].tolist() == [2.0] * 4                      # c + d
    assert await store.read_version() == 1


async def test_a_late_push_moves_the_model_by_its_lag_share(cluster: smb2.LocalCluster, transport: str) -> None:
    """Three workers, staleness 0: the expected lag is L0 = 2 other updates.
    A push k versions late moves the model by min(1, 2 / k) of its step."""
    init = {"w": np.zeros(4, np.float32)}
    clients = [await cluster.connect(transport=transport) for _ in range(3)]
    stores = [await ParameterStore.open(c, "st-lag", init, rule="accumulate", lr=1.0, workers=3, rank=r)
              for r, c in enumerate(clients)]
    for s in stores:
        s.lag = LagScaling(3, staleness=0)
    one = {"w": np.ones(4, np.float32)}

    async def fresh_push(r: int) -> None:       # pull, then push: lag 0
        await stores[r].pull()
        await stores[r].push(one)

    async def shared() -> float:
        await stores[1].pull()
        return float(stores[1].params["w"][0])

    await stores[0].pull()                      # rank 0 computes on version 0 ...
    for r in (1, 2, 1, 2):
        await fresh_push(r)
    assert await shared() == -4.0
    await stores[0].push(one)                   # ... and lands 4 versions late: half its step
    assert await shared() == -4.5
    await stores[0].push(one)                   # its own push is in its weights: still 4 others, half
    assert await shared() == -5.0
    for _ in range(2):
        await fresh_push(1)
    await stores[0].push(one)                   # 6 others since its pull: a third
    assert await shared() == pytest.approx(-7.0 - 1 / 3, abs=1e-6)
    await fresh_push(0)                         # fresh: whole
    assert await shared() == pytest.approx(-8.0 - 1 / 3, abs=1e-6)
    assert stores[0].lag.scaled == 3 and stores[0].lag.max_lag == 6
    assert stores[1].lag.scaled == 0


async def test_version_and_progress_notifications(cluster: smb2.LocalCluster, transport: str) -> None:
    clients = [await cluster.connect(transport=transport) for _ in range(3)]
    stores = [await ParameterStore.open(c, "st-prog", _params(), workers=3, rank=r)
              for r, c in enumerate(clients)]
    # a worker can wait for fresher parameters
    waiter = asyncio.ensure_future(stores[2].wait_version(2, timeout=10))
    g = {k: np.ones_like(v) for k, v in _params().items()}
    await stores[0].push(g)
    await asyncio.sleep(0.01)
    assert not waiter.done()
    await stores[1].push(g)
    assert await waiter >= 2
    # the start barrier lets nobody through before everybody came
    joins = [asyncio.ensure_future(s.join(timeout=10)) for s in stores[:2]]
    await asyncio.sleep(0.05)
    assert not any(j.done() for j in joins)
    await stores[2].join(timeout=10)
    await asyncio.gather(*joins)
    # progress table and end policies
    assert not await stores[0].report(4, 10, "first")
    assert not await stores[1].report(9, 10, "average")
    assert (await stores[2].progress()).tolist() == [4, 9, 0]
    assert not await stores[2].report(10, 10, "slowest")        # others are not there yet
    assert await stores[2].report(10, 10, "first")              # the first one is done: all stop
    assert await stores[0].report(5, 10, "slowest")             # ... even by another policy
    assert await stores[1].stopped()
    await stores[0].wait_stopped(timeout=1)


async def test_average_policy(cluster: smb2.LocalCluster, transport: str) -> None:
    clients = [await cluster.connect(transport=transport) for _ in range(2)]
    stores = [await ParameterStore.open(c, "st-avg", _params(), workers=2, rank=r) for r, c in enumerate(clients)]
    assert not await stores[0].report(15, 10, "average")           # (15 + 0) / 2 < 10
    assert await stores[1].report(5, 10, "average")                # (15 + 5) / 2 >= 10


def test_layer_dropping_keeps_what_it_does_not_send() -> None:
    rng = np.random.default_rng(0)
    shapes = {f"l{i}": (20 * (i + 1),) for i in range(10)}
    drop = LayerDropping(0.7, max_skips=None)
    sent_sum = {k: np.zeros(s) for k, s in shapes.items()}
    grad_sum = {k: np.zeros(s) for k, s in shapes.items()}
    counts = []
    for _ in range(50):
        g = {k: rng.standard_normal(s) * (1 + int(k[1:])) for k, s in shapes.items()}
        for k in g:
            grad_sum[k] += g[k]
        out = drop.select(g)
        counts.append(len(out))
        for k, v in out.items():
            sent_sum[k] += v
    # about 30 % of the layers go out per step ...
    assert 2 <= np.mean(counts) <= 4
    # ... and nothing is lost: sent + residual == everything
    for k in shapes:
        np.testing.assert_allclose(sent_sum[k] + drop.residual[k], grad_sum[k], rtol=1e-9, atol=1e-9)
    st = drop.stats()
    assert st["bytes_sent"] + st["bytes_saved"] == 50 * sum(8 * s[0] for s in shapes.values())
    assert 0.5 < drop.saved_fraction < 0.9


def test_layer_dropping_bounds_the_delay() -> None:
    drop = LayerDropping(0.5, max_skips=3)
    for _ in range(8):
        out = drop.select({"big": np.full(4, 10.0), "tiny": np.full(4, 1e-6)})
        assert "big" in out
    assert drop.layers_sent >= 8 + 2        # "tiny" went out at least every 4th step


def test_layer_dropping_arguments() -> None:
    for bad in (-0.1, 1.0, "0.5", True):
        with pytest.raises(smb2.InvalidArgumentError):
            LayerDropping(bad)  # type: ignore[arg-type]
    with pytest.raises(smb2.InvalidArgumentError):
        LayerDropping(0.5, max_skips=0)


def test_mlp_gradients_match_finite_differences() -> None:
    model = MLP([6, 5, 3])
    params = {k: v.astype(np.float64) for k, v in model.init(1).items()}
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((4, 6)), rng.integers(0, 3, 4)
    _, grads = model.grads(params, x, y)
    eps = 1e-6
    for k in params:
        idx = (0,) * params[k].ndim
        params[k][idx] += eps
        up, _ = model.grads(params, x, y)
        params[k][idx] -= 2 * eps
        down, _ = model.grads(params, x, y)
        params[k][idx] += eps
        assert abs((up - down) / (2 * eps) - grads[k][idx]) < 1e-5
    with pytest.raises(smb2.InvalidArgumentError):
        MLP([3])


def test_smb2_torch_imports_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """smb2.torch imports torch lazily: without torch it imports, and says
    what to install when used."""
    import importlib
    monkeypatch.setitem(sys.modules, "torch", None)        # "import torch" now fails
    monkeypatch.delitem(sys.modules, "smb2.torch", raising=False)
    mod = importlib.import_module("smb2.torch")
    with pytest.raises(smb2.InterfaceError, match="needs PyTorch"):
        mod._torch()
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert mod.resolve_rank() == (3, 4)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(smb2.InvalidArgumentError):
        mod.resolve_rank()


def test_a_training_worker_imports_no_server_code() -> None:
    """``import smb2`` and the training front ends load the client side only;
    the server and the test cluster (the lab's, smb2.testing) load when first named."""
    code = ("import sys, smb2, smb2.train, smb2.torch\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[:2] in (['smb2', 'server'], ['smb2', 'testing']))\n"
            "assert not loaded, loaded\n"
            "assert smb2.LocalCluster.__module__ == 'smb2.testing.cluster' and smb2.Server.__name__ == 'MemoryServer'\n"
            "assert smb2.LocalCluster is __import__('smb2.testing').testing.LocalCluster\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
