"""Rule ``diloco`` with ``compress="topk:F"``: each round sends the top-k
of its pseudo-gradient (plus the residual) by sparse accumulate, and the
worker keeps what it did not send for the next round (error feedback);
with ``compress="sparseloco:F"`` the residual decays first and there is no
outer momentum step.  Real memory servers, the numpy API
(docs/training.md, "Compressed exchange")."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import smb2
from smb2.client import as_wire
from smb2.train import ParameterStore
from smb2.train.compress import TopK
from smb2.train.rules import outer_momentum_name
from smb2.train.stability import LagScaling

N = 64


def _options(workers: int, **more: Any) -> dict[str, Any]:
    return {"rule": "diloco", "workers": workers, "local_steps": 1, "lr": 1.0, "resume": False,
            "compress": "topk:0.25", **more}


async def _round(store: ParameterStore, d: np.ndarray) -> None:
    """A round whose pseudo-gradient is ``d`` (dyadic values: ``start - (start - d)`` is ``d``)."""
    store.params["w"] -= d
    await store.rule.exchange()


def _residual(store: ParameterStore) -> np.ndarray:
    cut = store.rule.compress
    assert isinstance(cut, TopK)
    return cut.residual.copy()


@pytest.mark.parametrize("wire", [None, "bfloat16"])
async def test_sent_updates_plus_the_residual_are_the_sum_of_pseudo_gradients(
        cluster: smb2.LocalCluster, wire: str | None) -> None:
    # one worker, outer lr 1 and no outer momentum: the shared weights move by exactly minus what was
    # sent, so (w0 - w) + residual must be the sum of the pseudo-gradients, bit for bit (eighths below
    # 2**10: exact in float32; bf16 rounds the larger sums, and its rounding error stays in the residual)
    rng = np.random.default_rng(0)
    ds = [rng.integers(-64, 65, N).astype(np.float32) / 8 for _ in range(12)]
    async with await cluster.connect() as c:
        store = await ParameterStore.open(c, "t-topk-ef", {"w": np.zeros(N, np.float32)}, outer_lr=1.0,
                                          outer_momentum=0.0, wire=wire, **_options(1))
        for i, d in enumerate(ds):
            before = _residual(store)
            await _round(store, d)
            shared = (await store.buf.read(store.data_off, 4 * N)).view(np.float32)
            total = np.sum(ds[:i + 1], axis=0, dtype=np.float32)
            np.testing.assert_array_equal(-shared + _residual(store), total, err_msg=f"round {i}")
            sent = d + before - _residual(store)
            assert np.count_nonzero(sent) <= N // 4          # a quarter of the entries, at most
            if wire is not None:
                np.testing.assert_array_equal(as_wire(sent, wire), sent)   # bf16 values, as they travelled
        # each round put 16 entries of 4-byte index and 2- or 4-byte value on the wire, no more
        assert store.stats["bytes_pushed"] == len(ds) * (N // 4) * (6 if wire else 8)
        # no outer momentum, no buffer beside the store for it
        assert outer_momentum_name("t-topk-ef") not in await c.buffers()


async def test_compressed_groups_make_the_dense_outer_nesterov_step_of_what_was_sent(
        cluster: smb2.LocalCluster) -> None:
    # W = 2 workers take turns (lag W - 1: no lag scaling): each push adds -lr s S to the weights and
    # s S to B by sparse accumulate, the push completing a group makes the dense momentum step: after
    # each group the weights and the momentum are Nesterov's step on the group's mean sent update
    # (S = D + r_before - r_after), exactly (dyadic values, lr and momentum 1/2)
    rng = np.random.default_rng(1)
    ds = [rng.integers(-16, 17, N).astype(np.float32) / 8 for _ in range(8)]
    lr, mu = 0.5, 0.5
    ref_w, ref_m = np.zeros(N, np.float32), np.zeros(N, np.float32)
    async with await cluster.connect() as c:
        ranks = [await ParameterStore.open(c, "t-topk-nesterov", {"w": np.zeros(N, np.float32)}, rank=r,
                                           outer_lr=lr, outer_momentum=mu, wire=None, **_options(2))
                 for r in range(2)]
        momentum = await c.attach(outer_momentum_name("t-topk-nesterov"))
        both = np.empty(2 * N, np.float32)
        for group in range(4):
            sent = []
            for r in range(2):
                before = _residual(ranks[r])
                await _round(ranks[r], ds[2 * group + r])
                sent.append(ds[2 * group + r] + before - _residual(ranks[r]))
            g = (sent[0] + sent[1]) / 2
            ref_m = mu * ref_m + g
            ref_w = ref_w - lr * (g + mu * ref_m)
            shared = (await ranks[1].buf.read(ranks[1].data_off, 4 * N)).view(np.float32)
            await momentum.read_into(both, 0)
            np.testing.assert_array_equal(shared, ref_w, err_msg=f"group {group}")
            np.testing.assert_array_equal(both[:N], ref_m)
            np.testing.assert_array_equal(both[N:], np.zeros(N, np.float32))


async def test_one_compressed_worker_is_torchs_nesterov_step_on_what_it_sent(cluster: smb2.LocalCluster) -> None:
    # one worker with outer momentum: every push completes its group, so the step is the dense one in
    # one accumulate, m = mu M + S, w -= lr (S + mu m), on the sent entries S (exact: dyadic values)
    rng = np.random.default_rng(2)
    lr, mu = 0.5, 0.5
    ref_w, ref_m = np.zeros(N, np.float32), np.zeros(N, np.float32)
    async with await cluster.connect() as c:
        store = await ParameterStore.open(c, "t-topk-one", {"w": np.zeros(N, np.float32)}, outer_lr=lr,
                                          outer_momentum=mu, wire=None, **_options(1))
        for i in range(5):
            d = rng.integers(-16, 17, N).astype(np.float32) / 8
            before = _residual(store)
            await _round(store, d)
            sent = d + before - _residual(store)
            assert np.count_nonzero(sent) <= N // 4
            ref_m = mu * ref_m + sent
            ref_w = ref_w - lr * (sent + mu * ref_m)
            shared = (await store.buf.read(store.data_off, 4 * N)).view(np.float32)
            np.testing.assert_array_equal(shared, ref_w, err_msg=f"round {i}")
            np.testing.assert_array_equal(store.params["w"], shared)      # the next round starts there


async def _shared(store: ParameterStore) -> np.ndarray:
    return (await store.buf.read(store.data_off, 4 * N)).view(np.float32).copy()


@pytest.mark.parametrize(("decay", "wire"), [(0.5, None), (1.0, None), (0.95, None), (0.95, "bfloat16")],
                         ids=["half", "one", "paper", "paper-bf16"])
async def test_the_sparseloco_residual_decays_then_takes_the_round(
        cluster: smb2.LocalCluster, decay: float, wire: str | None) -> None:
    # one worker, sparseloco's outer lr 1 and no momentum: the servers move the weights by minus exactly
    # what was sent, so after each round the residual must be decay * (the residual before) + D - sent,
    # bit for bit, where sent is what the servers received, the top quarter of decay * r + D.  Eighths:
    # with decay 1/2 or 1 every sum is exact in float32; with 0.95 the expected values round as the
    # worker's do (D = w_start - w_local, decay * r rounded to float32, then + D)
    rng = np.random.default_rng(3)
    ds = [rng.integers(-64, 65, N).astype(np.float32) / 8 for _ in range(12)]
    spec = "sparseloco:0.25" if decay == 0.95 else f"sparseloco:0.25,decay={decay}"
    async with await cluster.connect() as c:
        store = await ParameterStore.open(c, "t-sparseloco-ef", {"w": np.zeros(N, np.float32)}, wire=wire,
                                          **_options(1, compress=spec))
        assert (store.rule.outer_lr, store.rule.outer_momentum) == (1.0, 0.0)     # its defaults
        for i, d in enumerate(ds):
            before, w_before = _residual(store), await _shared(store)
            await _round(store, d)
            w_after = await _shared(store)
            pseudo = w_before - (w_before - d)          # D = w_start - w_local (d itself where w is dyadic)
            carried = before * np.float32(decay) + pseudo               # the accumulator the cut saw
            took = w_after != w_before                                # the entries the servers took
            sent = np.where(took, as_wire(carried, wire), np.float32(0.0))
            assert took.sum() == N // 4, f"round {i}"
            assert np.abs(carried[took]).min() >= np.abs(carried[~took]).max()      # the top quarter
            np.testing.assert_array_equal(w_after, w_before - sent, err_msg=f"round {i}")
            np.testing.assert_array_equal(_residual(store), carried - sent, err_msg=f"round {i}")
            if decay == 1.0:        # the plain error feedback's invariant: nothing lost, only delayed
                total = np.sum(ds[:i + 1], axis=0, dtype=np.float32)
                np.testing.assert_array_equal(-w_after + _residual(store), total, err_msg=f"round {i}")
        assert store.stats["bytes_pushed"] == len(ds) * (N // 4) * (6 if wire else 8)
        assert outer_momentum_name("t-sparseloco-ef") not in await c.buffers()


@pytest.mark.parametrize("outer_lr", [None, 0.5], ids=["its-default", "given"])
async def test_sparseloco_servers_add_the_sent_entries_times_outer_lr_and_lag_scale(
        cluster: smb2.LocalCluster, outer_lr: float | None) -> None:
    # W = 2 workers, float32 pushes, decay 1/2 (exact on eighths): taking turns (lag 1, the expected
    # W - 1: no lag scaling) each push moves the weights by exactly -lr * S / W on the sent entries S
    # and nowhere else; then rank 1 pushes 3 more while rank 0 trains, so rank 0's lands 4 late and
    # counts a quarter: -lr * S / 4 / W.  No momentum step, no buffer beside the store
    rng = np.random.default_rng(4)
    lr = 1.0 if outer_lr is None else outer_lr
    more = {} if outer_lr is None else {"outer_lr": outer_lr}
    async with await cluster.connect() as c:
        ranks = [await ParameterStore.open(c, "t-sparseloco-w2", {"w": np.zeros(N, np.float32)}, rank=r,
                                           wire=None, **_options(2, compress="sparseloco:0.25,decay=0.5", **more))
                 for r in range(2)]
        for store in ranks:
            store.lag = LagScaling(2, 0)

        async def push(r: int, scale: float) -> None:
            d = rng.integers(-16, 17, N).astype(np.float32) / 8
            before, w_before = _residual(ranks[r]), await _shared(ranks[r])
            await _round(ranks[r], d)
            sent = d + before * np.float32(0.5) - _residual(ranks[r])
            assert np.count_nonzero(sent) == N // 4
            np.testing.assert_array_equal(await _shared(ranks[r]) - w_before, -lr * scale / 2 * sent)

        for _ in range(3):
            await push(0, 1.0)
            await push(1, 1.0)
        for _ in range(3):
            await push(1, 1.0)
        await push(0, 1 / 4)                  # pulled at version 5, lands at 10: lag 4, expected 1
        assert ranks[0].lag.scaled == 1 and ranks[0].lag.max_lag == 4 and ranks[1].lag.scaled == 0
        assert [await s.read_version() for s in ranks] == [10, 10]
        assert outer_momentum_name("t-sparseloco-w2") not in await c.buffers()


async def test_the_compress_option_is_checked_and_recorded(cluster: smb2.LocalCluster) -> None:
    async with await cluster.connect() as c:
        for bad in ("topk", "topk:0", "topk:1.5", "int8:0.1", "topk:x", 0.01, "topk:0.1,decay=0.5", "sparseloco",
                    "sparseloco:0", "sparseloco:0.02,decay=0", "sparseloco:0.02,decay=1.5", "sparseloco:0.02,",
                    "sparseloco:0.02,beta=0.9"):
            with pytest.raises(smb2.InvalidArgumentError, match="compress must be 'topk:F'"):
                await ParameterStore.open(c, "t-topk-bad", {"w": np.zeros(N, np.float32)}, compress=bad,
                                          **{k: v for k, v in _options(1).items() if k != "compress"})
        store = await ParameterStore.open(c, "t-topk-rec", {"w": np.zeros(N, np.float32)}, **_options(1))
        observer = await ParameterStore.attach(c, "t-topk-rec")
        assert observer.rule.settings()["compress"] == "topk:0.25"
        await store.finish()
        with pytest.raises(smb2.InvalidArgumentError, match="no outer momentum step.*not 0.5"):
            await ParameterStore.open(c, "t-sparseloco-bad", {"w": np.zeros(N, np.float32)}, outer_momentum=0.5,
                                      **_options(1, compress="sparseloco:0.02"))
        store = await ParameterStore.open(c, "t-sparseloco-rec", {"w": np.zeros(N, np.float32)},
                                          **_options(1, compress="sparseloco:0.02,decay=0.9"))
        observer = await ParameterStore.attach(c, "t-sparseloco-rec")
        assert {k: observer.rule.settings()[k] for k in ("compress", "outer_lr", "outer_momentum")} == {
            "compress": "sparseloco:0.02,decay=0.9", "outer_lr": 1.0, "outer_momentum": 0.0}
        await store.finish()
