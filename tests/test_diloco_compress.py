"""Rule ``diloco`` with ``compress="topk:F"``: each round sends the top-k
of its pseudo-gradient (plus the residual) by sparse accumulate, and the
worker keeps what it did not send for the next round (error feedback).
Real memory servers, the numpy API (docs/training.md, "Compressed
exchange")."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import smb2
from smb2.client import as_wire
from smb2.train import ParameterStore
from smb2.train.compress import TopK
from smb2.train.rules import outer_momentum_name

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


async def test_the_compress_option_is_checked_and_recorded(cluster: smb2.LocalCluster) -> None:
    async with await cluster.connect() as c:
        for bad in ("topk", "topk:0", "topk:1.5", "int8:0.1", "topk:x", 0.01):
            with pytest.raises(smb2.InvalidArgumentError, match="compress must be 'topk:F'"):
                await ParameterStore.open(c, "t-topk-bad", {"w": np.zeros(N, np.float32)}, compress=bad,
                                          **{k: v for k, v in _options(1).items() if k != "compress"})
        store = await ParameterStore.open(c, "t-topk-rec", {"w": np.zeros(N, np.float32)}, **_options(1))
        observer = await ParameterStore.attach(c, "t-topk-rec")
        assert observer.rule.settings()["compress"] == "topk:0.25"
        await store.finish()
