"""Rule ``allreduce``: every worker steps its own optimizer on the mean of
the workers' gradients, the sum made by the servers (docs/training.md,
"Update rules"), against real memory servers and real torch."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import smb2
from smb2.errors import InterfaceError, InvalidArgumentError, NotifyTimeout
from smb2.testing.proxy import FaultProxy
from smb2.testing.waits import until
from smb2.testing.workers import json_objects, torchrun, torchrun_failure
from smb2.train import ParameterStore, beside, roster, rules
from smb2.train.rules import AllReduce

torch = pytest.importorskip("torch", reason="PyTorch is not installed here (pip install 'smb2[torch]')")

import smb2.torch as st  # noqa: E402
from smb2.testing.torch_models import (  # noqa: E402
    all_at,
    allreduce_workers,
    async_optimizer,
    in_threads,
    mean_step_reference,
    rank_batches,
    small_model,
)
from smb2.torch.loop_thread import LoopThread  # noqa: E402

N = 1000        # gradient values a round
CLIP = 0.5


async def _stores(cluster: smb2.LocalCluster, transport: str, name: str, workers: int, n: int = N,
                  **rule: object) -> list[ParameterStore]:
    clients = [await cluster.connect(transport=transport) for _ in range(workers)]
    # four tensors of n / 4 values (250 by default, which parts of 1 KiB take one by one)
    init = {f"w{i}": np.zeros(n // 4, np.float32) for i in range(4)}
    return [await ParameterStore.open(c, name, init, rule="allreduce", workers=workers, rank=r, **rule)
            for r, c in enumerate(clients)]


def _grads(rank: int, rounds: int, exact: bool, n: int = N) -> list[np.ndarray]:
    """``rounds`` gradients of ``n`` values (a store's flat region: its tensors and their padding)."""
    rng = np.random.default_rng(rank)
    if exact:       # small integers: exact in bfloat16, and their sums exact in float32
        return [rng.integers(-64, 64, n).astype(np.float32) for _ in range(rounds)]
    return [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3)).astype(np.float32) for _ in range(rounds)]


async def _run(stores: list[ParameterStore], grads: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
    """Every worker reduces its gradients round after round."""
    async def worker(r: int) -> list[np.ndarray]:
        rule = stores[r].rule
        assert isinstance(rule, AllReduce)
        outs = [np.zeros_like(g) for g in grads[r]]
        for g, out in zip(grads[r], outs):
            await rule.reduce(g, out)
            await asyncio.sleep(0.001 * r)      # (the workers out of step: a fast one goes on to the next)
        return outs
    return list(await asyncio.gather(*(worker(r) for r in range(len(stores)))))


async def _every_worker_gets_the_exact_means(stores: list[ParameterStore], rounds: int) -> None:
    """Every worker reduces ``rounds`` gradients exact in bfloat16 (small
    integers), and gets their exact mean, the same bytes, every round."""
    grads = [_grads(r, rounds, exact=True, n=stores[0].flat().size) for r in range(len(stores))]
    outs = await _run(stores, grads)
    for k in range(rounds):
        want = grads[0][k].copy()
        for g in grads[1:]:
            want += g[k]
        want /= np.float32(len(stores))
        for r in range(len(stores)):
            np.testing.assert_array_equal(outs[r][k], want)


async def test_every_worker_gets_the_exact_mean_of_each_round(cluster: smb2.LocalCluster, transport: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # three workers, 9 rounds (each of the two sums used 4-5 times), the gradients in parts of 1 KiB
    # (PART_BYTES made small): the mean of each round's gradients, the same bytes for every worker,
    # although a fast worker adds its next round while others still read
    monkeypatch.setattr(rules, "PART_BYTES", 1024)
    stores = await _stores(cluster, transport, "ar-exact", 3)
    assert len(stores[0].rule.parts) == 4           # type: ignore[attr-defined]
    await _every_worker_gets_the_exact_means(stores, 9)


async def test_a_tensor_larger_than_a_part_is_cut_into_parts(cluster: smb2.LocalCluster, transport: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # tensors of 250 values, parts of 256 B (64 values): each tensor is cut into parts of its own,
    # the means of its first parts coming down while its last go up; every worker still gets the
    # exact mean, and every element is in exactly one part
    monkeypatch.setattr(rules, "PART_BYTES", 256)
    stores = await _stores(cluster, transport, "ar-cut", 3)
    rule = stores[0].rule
    assert isinstance(rule, AllReduce)
    n = stores[0].flat().size
    assert sorted(rule.parts)[0][0] == 0 and sorted(rule.parts)[-1][1] == n
    assert all(b - a <= 64 for a, b in rule.parts) and len(rule.parts) >= 16
    assert sum(b - a for a, b in rule.parts) == n
    first = stores[0].flat_offset("w1")
    assert len(rule.parts_over(first, first + 250)) == 4        # 250 values: 64 + 64 + 64 + 58
    assert sum(len(names) for names in rule.part_tensors) == 4   # (each tensor's marks: in its first part)
    await _every_worker_gets_the_exact_means(stores, 5)


async def test_over_tcp_a_part_goes_in_slices_one_in_flight_each_way(cluster: smb2.LocalCluster, transport: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # parts of 16 Ki values in stripes of 2 Ki, sliced at 4 KiB on the wire (2 Ki bf16 values): over
    # TCP each worker has one slice in flight each way and starts a stripe further on than the rank
    # before (the next server), and every worker still gets the exact mean; over shm and RDMA a part
    # goes at once
    monkeypatch.setattr(rules, "PART_BYTES", 64 << 10)
    stores = await _stores(cluster, transport, "ar-sliced", 3, n=64 << 10, stripe=8192, slice_bytes=4096)
    flying = {id(s.client): {"up": 0, "down": 0} for s in stores}
    most = {"up": 0, "down": 0}
    uploads: dict[int, list[int]] = {id(s.client): [] for s in stores}     # (each worker's slices' offsets)

    def counted(way: str, method: Any) -> Any:
        async def wrapper(buf: smb2.Buffer, *args: Any, **kwargs: Any) -> Any:
            offset = args[0] if way == "up" else args[1]
            # (a waiting worker's look at the heartbeats; a part's marks, a few words beside the sums)
            if not buf.name.endswith("/gradients") or offset >= stores[0].rule.marks_start:  # type: ignore[attr-defined]
                return await method(buf, *args, **kwargs)
            now = flying[id(buf.client)]
            if way == "up":
                uploads[id(buf.client)].append(offset)
            now[way] += 1
            most[way] = max(most[way], now[way])
            try:
                return await method(buf, *args, **kwargs)
            finally:
                now[way] -= 1
        return wrapper
    monkeypatch.setattr(smb2.Buffer, "accumulate", counted("up", smb2.Buffer.accumulate))
    monkeypatch.setattr(smb2.Buffer, "read_into", counted("down", smb2.Buffer.read_into))
    await _every_worker_gets_the_exact_means(stores, 5)
    rule = [s.rule for s in stores]
    assert all(isinstance(x, AllReduce) for x in rule)
    parts = rule[0].parts                               # type: ignore[attr-defined]
    assert len(parts) == 4
    n = parts[0][1] - parts[0][0]
    slices = [x._slices(s.buf, n) for x, s in zip(rule, stores)]     # type: ignore[attr-defined]
    assert all(x.epoch.buf.name == "ar-sliced/gradients" for x in rule)     # type: ignore[attr-defined]
    if transport == "tcp":
        assert most == {"up": 1, "down": 1}
        assert all(len(sl) == 8 and sorted(sl) == [(a, a + 2048) for a in range(0, n, 2048)] for sl in slices)
        # the parts of a round, all sent at once (the numpy API's reduce), go whole, one after another:
        # taken a slice each in turn, every part would finish near the last, and no mean could come
        # down while the other parts still go up
        counters, span = rule[0]._counters, rule[0]._span                # type: ignore[attr-defined]
        for offsets in uploads.values():
            seq = [((o - counters) % span) // 4 // n for o in offsets]      # (each slice's part)
            runs = [p for i, p in enumerate(seq) if i == 0 or seq[i - 1] != p]
            assert len(runs) == 5 * 4 and all(seq.count(p) == 5 * 8 for p in range(4)), seq
        assert [sl[0][0] for sl in slices] == [0, 2048, 4096]         # stripes 0, 1, 2 of the part
    else:
        assert slices == [[(0, n)]] * 3


async def test_bfloat16_rounding_does_not_build_up(cluster: smb2.LocalCluster, transport: str) -> None:
    # a sum is never cleared: each worker adds the change from what it added to that sum last time,
    # rounded for the wire, and keeps what the rounding made of it, so the next change carries the
    # rounding back: round 40's error is bounded by its own change's rounding, as round 1's
    stores = await _stores(cluster, transport, "ar-bf16", 2, wire="bfloat16")
    rule = stores[0].rule
    assert isinstance(rule, AllReduce)
    grads = [_grads(r, 40, exact=False, n=stores[0].flat().size) for r in range(2)]
    outs = await _run(stores, grads)
    zero = np.zeros(stores[0].flat().size)
    # each worker's error in a sum: its last change rounded to bfloat16 (8 bits: within 2^-8 of it),
    # where the change is the new gradient less what the worker kept, the last gradient less its error
    errors = [[zero] * rule.sums for _ in range(2)]
    for k in range(40):
        want = (grads[0][k].astype(np.float64) + grads[1][k]) / 2
        bound = np.zeros_like(zero)
        for r in range(2):
            before = grads[r][k - rule.sums] if k >= rule.sums else zero
            e = errors[r][k % rule.sums] = 2.0 ** -8 * (np.abs(grads[r][k] - before) + errors[r][k % rule.sums])
            bound += (e + 1e-6 * (np.abs(grads[r][k]) + np.abs(before))) / 2     # (+ float32's sums)
        # and the sum read back rounded to bfloat16, once: within 2^-8 of it, no build-up either
        bound += 2.0 ** -8 * (np.abs(want) + bound)
        assert np.all(np.abs(outs[0][k] - want) <= bound), k
        np.testing.assert_array_equal(outs[0][k], outs[1][k])


async def test_a_missing_worker_is_named_in_the_timeout(cluster: smb2.LocalCluster, transport: str,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    # a live worker that sends nothing (its heartbeats go on): the other says so at WARNING after
    # SAY_WAITING_AFTER (30 s by default), once for all its parts, and gives up after round_timeout
    monkeypatch.setattr(rules, "SAY_WAITING_AFTER", 0.05)
    monkeypatch.setattr(rules, "PART_BYTES", 1024)
    assert AllReduce().round_timeout == 1800        # (torch's default timeout of a collective)
    stores = await _stores(cluster, transport, "ar-missing", 2, round_timeout=0.5)
    rule = stores[0].rule
    assert isinstance(rule, AllReduce) and len(rule.parts) == 4
    with caplog.at_level(logging.WARNING, logger="smb2.train"), \
            pytest.raises(NotifyTimeout, match="1 of the 2 workers of store 'ar-missing' sent no gradient for step 7"):
        await rule.reduce(np.ones_like(stores[0].flat()), np.zeros_like(stores[0].flat()), step=7)
    said = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith("store 'ar-missing': rank 0 has waited ") and \
        "for the gradients of step 7 from 1 of the 2 workers, which still send heartbeats" in said[0], said


@pytest.mark.parametrize("bad,wire", [(np.inf, "bfloat16"), (np.nan, "bfloat16"), (1e5, "float16")],
                         ids=["inf", "nan", "past-float16"])
async def test_a_gradient_that_is_not_finite_makes_its_parts_mean_nan_once(
        cluster: smb2.LocalCluster, transport: str, monkeypatch: pytest.MonkeyPatch, bad: float, wire: str) -> None:
    # mixed precision's first steps overflow: in round 1 worker 0's gradient holds a value the wire
    # cannot carry in one part.  Both workers get NaN for that part's mean (torch's GradScaler then
    # skips the step on both, as under DDP) and the exact mean elsewhere; the sums stay finite, so
    # rounds 2 and 3 (3 on round 1's sum again) are exact everywhere
    monkeypatch.setattr(rules, "PART_BYTES", 1024)
    stores = await _stores(cluster, transport, f"ar-overflow-{transport}-{wire}", 2, wire=wire)
    rule = stores[0].rule
    assert isinstance(rule, AllReduce) and len(rule.parts) == 4
    grads = [_grads(r, 4, exact=True, n=stores[0].flat().size) for r in range(2)]
    grads[0][1][5] = bad
    outs = await _run(stores, grads)
    [part] = rule.parts_over(5, 6)
    first, end = rule.parts[part]
    for k in range(4):
        want = (grads[0][k] + grads[1][k]) / np.float32(2)
        if k == 1:
            want[first:end] = np.nan
        for r in range(2):
            np.testing.assert_array_equal(outs[r][k], want, err_msg=f"worker {r}, round {k}")


async def test_a_worker_that_closed_its_run_is_named_at_once(cluster: smb2.LocalCluster, transport: str) -> None:
    # worker 1 takes 2 steps and closes its run (its loader had fewer batches); worker 0's third
    # round can never complete: it says so, naming the rank and its steps, rather than waiting out
    # round_timeout (long here: the test would fail on its NotifyTimeout) as for a live, silent one
    stores = await _stores(cluster, transport, "ar-fewer", 2, round_timeout=600)
    await _run(stores, [_grads(r, 2, exact=True, n=stores[0].flat().size) for r in range(2)])
    await stores[1].heartbeat(2, force=True)
    await stores[1].finish()
    rule = stores[0].rule
    assert isinstance(rule, AllReduce)
    with pytest.raises(InterfaceError, match=r"rank 0 of store 'ar-fewer' waits for the gradients of step 3 from "
                                             r"workers that closed their training \(rank 1 after 2 steps\).*"
                                             r"every rank must take the same number of steps") as caught:
        await rule.reduce(np.ones_like(stores[0].flat()), np.zeros_like(stores[0].flat()), step=3)
    assert "DistributedSampler" in str(caught.value.hint)


@pytest.mark.parametrize("removal", ["removes", "fails"])
async def test_the_survivors_of_a_dead_worker_go_on_with_their_own_mean(cluster: smb2.LocalCluster, transport: str,
                                                                      removal: str, monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    # three workers; in round 2 worker 2 sends the first of its four parts (which then goes through
    # for everyone) and dies (its client closes: no more heartbeats); the two others take it for dead
    # after dead_after, agree on a membership of their own and redo round 2 whole among themselves:
    # round 2 and the later ones are exactly the mean of the two, the same for both.  "fails": the
    # removal of the old membership's sums fails (a server that cannot take it then), which is
    # housekeeping: a warning, and the training goes on
    monkeypatch.setattr(rules, "PART_BYTES", 1024)
    if removal == "fails":
        async def refused(client: smb2.Client, parent: str, what: str) -> bool:
            raise smb2.TransportError(f"cannot remove {parent}/{what} now")
        monkeypatch.setattr(beside, "discard", refused)
    stores = await _stores(cluster, transport, "ar-dead", 3, dead_after=0.3)
    rule = [s.rule for s in stores]
    assert all(isinstance(x, AllReduce) for x in rule) and len(stores[0].rule.parts) == 4   # type: ignore[attr-defined]
    grads = [_grads(r, 5, exact=True, n=stores[0].flat().size) for r in range(3)]
    outs = [[np.zeros_like(g) for g in grads[r]] for r in range(3)]
    for k in range(2):
        await asyncio.gather(*(rule[r].reduce(grads[r][k], outs[r][k]) for r in range(3)))    # type: ignore[attr-defined]

    async def dies() -> None:
        r = rule[2].next_round()                                            # type: ignore[attr-defined]
        await rule[2].reduce_part(r, 0, grads[2][2], outs[2][2])             # type: ignore[attr-defined]
        await stores[2].client.close()

    async def survives(w: int) -> None:
        for k in range(2, 5):
            await rule[w].reduce(grads[w][k], outs[w][k], step=k)            # type: ignore[attr-defined]

    await asyncio.wait_for(asyncio.gather(dies(), survives(0), survives(1)), 60)       # (a hang guard)
    for k in range(5):
        n = 3 if k < 2 else 2
        want = sum(grads[r][k] for r in range(n)) / np.float32(n)
        np.testing.assert_array_equal(outs[0][k], want, err_msg=f"round {k}")
        np.testing.assert_array_equal(outs[1][k], want, err_msg=f"round {k}")
    for w in (0, 1):
        ep = rule[w].epoch                                                  # type: ignore[attr-defined]
        assert (ep.number, ep.base, ep.members) == (1, 2, (0, 1))
    assert rule[1].leader == 0                                              # type: ignore[attr-defined]
    # the first membership's sums were removed by the new one's leader once round 3 came back (two
    # model sizes of float32 on the servers that no one uses any more); the new membership's are kept
    names = await stores[0].client.buffers()
    assert ("ar-dead/gradients" in names) == (removal == "fails") and "ar-dead/gradients.1" in names, names
    warned = [r.getMessage() for r in caplog.records if "were not removed" in r.getMessage()]
    assert len(warned) == (removal == "fails"), warned
    if warned:
        assert "cannot remove ar-dead/gradients now" in warned[0] and "smb2 rm" in warned[0], warned


async def test_a_survivor_that_dies_while_it_declares_is_taken_over(cluster: smb2.LocalCluster) -> None:
    # worker 2 dies; worker 1 takes the roster's claim and poisons round 2's counters, as a declaring
    # survivor does first, and dies before it publishes the membership; worker 0, waiting on the
    # poisoned counters, takes the silent holder's claim over and goes on alone: round 2 is its own
    stores = await _stores(cluster, "tcp", "ar-claim", 3, dead_after=0.3)
    rule = [s.rule for s in stores]
    grads = [_grads(r, 3, exact=True, n=stores[0].flat().size) for r in range(3)]
    outs = [[np.zeros_like(g) for g in grads[r]] for r in range(3)]
    for k in range(2):
        await asyncio.gather(*(rule[r].reduce(grads[r][k], outs[r][k]) for r in range(3)))    # type: ignore[attr-defined]
    await stores[2].client.close()
    client1 = stores[1].client
    members = roster.Roster(await beside.find(client1, "ar-claim", roster.MEMBERS), 3)
    assert await members.claim(1) == 0
    sums = (await beside.find(client1, "ar-claim", rules.GRADIENTS)).set_notify_area(
        0, 2 * len(rule[1].parts))                                          # type: ignore[attr-defined]
    for slot in range(len(rule[1].parts)):                                  # type: ignore[attr-defined]
        await sums.notify_add(slot, -roster.POISON)                         # (round 2: the first sum's slots)
    await client1.close()
    await asyncio.wait_for(rule[0].reduce(grads[0][2], outs[0][2], step=2), 60)     # type: ignore[attr-defined]
    np.testing.assert_array_equal(outs[0][2], grads[0][2])
    ep = rule[0].epoch                                                      # type: ignore[attr-defined]
    assert (ep.number, ep.base, ep.members) == (1, 2, (0,))


async def test_a_worker_left_out_while_silent_stops_in_words(cluster: smb2.LocalCluster) -> None:
    # worker 2's requests (its heartbeats with them) wait in proxies: the others go on without it; once
    # they flow again, its round meets the new membership and it stops, saying why, never stepping on
    # a mean the others did not get.  A worker restarted into the run is refused as before.
    proxies = [FaultProxy(a).start() for a in cluster.addresses]
    try:
        clients = [await cluster.connect(transport="tcp") for _ in range(2)]
        clients.append(await smb2.connect([p.address for p in proxies], transport="tcp", timeout=10))
        init = {"w": np.zeros(64, np.float32)}
        stores = [await ParameterStore.open(c, "ar-left", init, rule="allreduce", workers=3, rank=r, dead_after=0.3)
                  for r, c in enumerate(clients)]
        rule = [s.rule for s in stores]
        g = np.ones(stores[0].flat().size, np.float32)
        outs = [np.zeros_like(g) for _ in range(3)]
        await asyncio.gather(*(rule[r].reduce(g * r, outs[r]) for r in range(3)))   # type: ignore[attr-defined]
        np.testing.assert_array_equal(outs[0], g)
        for p in proxies:
            p.hold()
        late = asyncio.ensure_future(rule[2].reduce(g * 2, outs[2], step=2))        # type: ignore[attr-defined]
        await asyncio.wait_for(asyncio.gather(*(rule[r].reduce(g * (r + 1), outs[r], step=2)   # type: ignore[attr-defined]
                                                for r in range(2))), 60)
        np.testing.assert_array_equal(outs[0], g * 1.5)     # (1 + 2) / 2: worker 2's never in it
        np.testing.assert_array_equal(outs[1], g * 1.5)
        # one more round: its leader, worker 0, then removes the first membership's sums, where worker
        # 2's held requests are bound: they find them gone
        await asyncio.wait_for(asyncio.gather(*(rule[r].reduce(g, outs[r], step=3)     # type: ignore[attr-defined]
                                                for r in range(2))), 60)
        assert "ar-left/gradients" not in await clients[0].buffers()
        await until(lambda: any(p.held > 0 for p in proxies), "worker 2's requests held")
        for p in proxies:
            p.release()
        with pytest.raises(InterfaceError, match="rank 2 was left out of the training of store 'ar-left'.*"
                                                 "went on without it"):
            await asyncio.wait_for(late, 60)
        again = await ParameterStore.attach(await cluster.connect(transport="tcp"), "ar-left", rank=2)
        with pytest.raises(InterfaceError, match="rank 2 cannot join the running training"):
            await again.rule.reduce(g, np.zeros_like(g))                    # type: ignore[attr-defined]
        for c in [*clients, again.client]:
            await c.close()
    finally:
        for p in proxies:
            p.stop()


async def test_a_worker_cannot_join_a_run_past_its_first_round(cluster: smb2.LocalCluster, transport: str) -> None:
    stores = await _stores(cluster, transport, "ar-rejoin", 2)
    await _run(stores, [_grads(r, 2, exact=True, n=stores[0].flat().size) for r in range(2)])
    late = await ParameterStore.attach(await cluster.connect(transport=transport), "ar-rejoin", rank=1)
    rule = late.rule
    assert isinstance(rule, AllReduce)
    with pytest.raises(InterfaceError, match="rank 1 cannot join the running training"):
        await rule.reduce(np.ones_like(late.flat()), np.zeros_like(late.flat()))


async def test_a_restarted_worker_is_taken_back_at_the_start_of_a_step(cluster: smb2.LocalCluster) -> None:
    # three workers launched one by one (rejoin=True); worker 2 dies after round 1; the two others go
    # on alone once it is silent for dead_after.  Worker 2, restarted, opens the store again (it
    # rejoins the run), asks to be taken back and waits; the leader, worker 0, hands it its state at
    # the start of a round (here every round is a step) through its hand_over hook, then declares a
    # membership of three from that round, which the restarted worker starts at: every mean from
    # there is over the three again, exactly, the same for all
    stores = await _stores(cluster, "tcp", "ar-back", 3, dead_after=0.3, rejoin=True)
    await asyncio.gather(*(s.join() for s in stores))       # (in the run: a restart rejoins it)
    rule = [s.rule for s in stores]
    assert all(isinstance(x, AllReduce) for x in rule)
    n = stores[0].flat().size
    grads = [_grads(r, 8, exact=True, n=n) for r in range(3)]
    for k in range(2):
        await asyncio.gather(*(rule[r].reduce(grads[r][k], np.zeros(n, np.float32)) for r in range(3)))  # type: ignore[attr-defined]
    await stores[2].client.close()
    handed: list[tuple[list[int], int]] = []

    async def hand_over(restarted: dict[int, int], round_: int) -> int:
        handed.append((sorted(restarted), round_))
        return round_
    rule[0].hand_over = hand_over                                           # type: ignore[attr-defined]
    init = {f"w{i}": np.zeros(N // 4, np.float32) for i in range(4)}
    again = await ParameterStore.open(await cluster.connect(transport="tcp"), "ar-back", init, rule="allreduce",
                                      workers=3, rank=2, dead_after=0.3, rejoin=True, restarted=True)
    assert again.rejoined
    back = asyncio.ensure_future(again.rule.rejoin(timeout=60))             # type: ignore[attr-defined]

    every = [*rule[:2], again.rule]
    outs: list[dict[int, np.ndarray]] = [{}, {}, {}]

    async def worker(r: int) -> None:
        # the survivors go on round after round (without worker 2 once it is out) until 3 rounds after
        # it came back; worker 2 from the round it was taken back at
        k = (await back) if r == 2 else 2
        while not (back.done() and k == back.result() + 3):
            out = outs[r][k] = np.zeros(n, np.float32)
            await every[r].reduce(grads[r][k % 8], out)                     # type: ignore[attr-defined]
            k += 1
            await asyncio.sleep(0.01)
    await asyncio.wait_for(asyncio.gather(*(worker(r) for r in range(3))), 60)
    base = back.result()
    assert handed == [([2], base)] and sorted(outs[2]) == list(range(base, base + 3))
    for k, out in outs[0].items():
        assert out.tobytes() == outs[1][k].tobytes()
        if k >= base:
            want = (grads[0][k % 8] + grads[1][k % 8] + grads[2][k % 8]) / 3
            np.testing.assert_array_equal(out, want)
            np.testing.assert_array_equal(outs[2][k], want)
        elif k >= 3:        # (round 2 went through for the first parts before worker 2 was out)
            np.testing.assert_array_equal(out, (grads[0][k % 8] + grads[1][k % 8]) / 2)
    # the restarted worker takes a step more than the others (its loop did not skip the steps before
    # it was taken back): its last round is named, with what its loop must do
    await asyncio.gather(stores[0].finish(), stores[1].finish())
    again.rule.taken_back_at = base - 1                                     # type: ignore[attr-defined]
    with pytest.raises(InterfaceError, match="workers that closed their training") as info:
        await asyncio.wait_for(again.rule.reduce(grads[2][0], np.zeros(n, np.float32)), 60)  # type: ignore[attr-defined]
    assert f"taken back at step {base}: its loop must go on from there" in (info.value.hint or ""), info.value.hint
    assert [r.epoch.members for r in every] == [(0, 1, 2)] * 3              # type: ignore[attr-defined]


async def test_a_worker_restarted_after_the_others_finished_has_nothing_to_train(cluster: smb2.LocalCluster) -> None:
    stores = await _stores(cluster, "tcp", "ar-late", 2, rejoin=True)
    await asyncio.gather(*(s.join() for s in stores))
    await _run(stores, [_grads(r, 2, exact=True, n=stores[0].flat().size) for r in range(2)])
    await stores[0].finish()
    init = {f"w{i}": np.zeros(N // 4, np.float32) for i in range(4)}
    again = await ParameterStore.open(await cluster.connect(transport="tcp"), "ar-late", init, rule="allreduce",
                                      workers=2, rank=1, rejoin=True, restarted=True)
    # nothing left to train: no membership takes it in, and it is told the run is over (the torch layer
    # then loads rank 0's last save, the run's end, and the loop has no step left)
    assert await asyncio.wait_for(again.rule.rejoin(timeout=60), 60) is None      # type: ignore[attr-defined]
    assert again.rule.run_over and again.rule.epoch is None                 # type: ignore[attr-defined]


async def test_the_roster_keeps_a_ring_of_records(client: smb2.Client) -> None:
    # an epoch now adds workers as well as removing them: records go round a ring, and a record read
    # after the ring came round again is refused, never misread
    ring = roster.RING
    buf = await client.create("roster-ring", roster.Roster.nbytes(3))
    rst = roster.Roster(buf, 3)
    assert (await rst.read()) == roster.Record(0, 0, (0, 1, 2), {})
    await rst.ask(2, 77)
    assert await rst.asking() == {2: 77}
    last, back = ring + 5, ring + 4
    for epoch in range(1, last + 1):
        taken = {2: 77} if epoch == back else {}
        await rst.publish(epoch, 10 * epoch, (0, 1, 2) if epoch == back else (0, 1), taken)
    assert await rst.read() == roster.Record(last, 10 * last, (0, 1), {})
    assert await rst.read(back) == roster.Record(back, 10 * back, (0, 1, 2), {2: 77})
    assert (await rst.taken_back_since(back - 3, 2, 77)) == await rst.read(back)
    assert await rst.taken_back_since(back, 2, 77) is None and await rst.taken_back_since(3, 2, 78) is None
    with pytest.raises(InterfaceError, match=f"membership record 5 .* was replaced by epoch {last}'s"):
        await rst.read(5)
    # (O(W) bytes: the ring's records, not one for each of W - 1 epochs)
    assert roster.Roster.nbytes(10_000) < 2 << 20
    await rst.answered(2, 78)       # (another token: not this request's answer)
    assert await rst.asking() == {2: 77}
    await rst.answered(2, 77)
    assert await rst.asking() == {}


async def test_push_says_what_to_call(client: smb2.Client) -> None:
    store = await ParameterStore.open(client, "ar-push", {"w": np.zeros(4, np.float32)}, rule="allreduce")
    with pytest.raises(InterfaceError, match="steps on the gradients' mean"):
        await store.push({"w": np.ones(4, np.float32)})


def test_bad_options_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="round_timeout"):
        AllReduce(round_timeout=0)
    with pytest.raises(InvalidArgumentError, match="dead_after"):
        AllReduce(dead_after=-1)
    with pytest.raises(InvalidArgumentError, match="wire"):
        AllReduce(wire="int8")
    for bad in (100, True, 4096.0):
        with pytest.raises(InvalidArgumentError, match="slice_bytes must be None"):
            AllReduce(slice_bytes=bad)       # type: ignore[arg-type]


def test_rank_0_saves_the_optimizer_state_every_rank_resumes(servers: str) -> None:
    # every rank's AdamW state is the same one: rank 0 alone saves it (no <store>/optim/1), and a
    # resumed run gives every rank rank 0's
    workers, name = 2, "ar-resume"
    models = [small_model() for _ in range(workers)]
    states: dict[int, dict[str, Any]] = {}

    def train(r: int, resume: bool) -> None:
        opt = st.AsyncOptimizer(torch.optim.AdamW(models[r].parameters(), lr=0.01), models[r], name=name,
                                servers=servers, rank=r, world_size=workers, rule="allreduce", resume=resume,
                                state_every=1e-9)
        for x, y in rank_batches(0 if resume else 4, r):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(models[r](x), y).backward()
            opt.step()
        states[r] = opt.optimizer.state_dict()["state"]
        opt.close(wait_all=30)

    in_threads(workers, lambda r: train(r, resume=False))
    trained = states[0]

    async def names() -> list[str]:
        async with await smb2.connect(servers) as c:
            return await c.buffers()
    loop = LoopThread("test-ls")
    try:
        buffers = loop.run(names())
    finally:
        loop.stop()
    assert f"{name}/optim/0" in buffers and f"{name}/optim/1" not in buffers, buffers
    states.clear()
    in_threads(workers, lambda r: train(r, resume=True))
    for r in range(workers):
        for k, v in trained.items():
            for field in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(states[r][k][field], v[field]), (r, k, field)


def test_a_job_launched_again_with_fewer_workers_goes_on_from_rank_0s_last_save(servers: str) -> None:
    # a job of 3 dies (no close: its run did not finish); launched again with 2 (torchrun's
    # --nnodes=MIN:MAX after a host was lost), rank 0 makes the store again for 2, and both ranks go on
    # from rank 0's last save, the weights and AdamW's moments of one step, in step with each other
    name, first, steps = "ar-fewer", 3, 6
    models = [small_model() for _ in range(first)]
    saved: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}

    def crash(r: int) -> None:
        opt = st.AsyncOptimizer(torch.optim.AdamW(models[r].parameters(), lr=0.01), models[r], name=name,
                                servers=servers, rank=r, world_size=first, resume=False, state_every=1e-9,
                                state_share=None)
        for x, y in rank_batches(steps, r):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(models[r](x), y).backward()
            opt.step()
            if r == 0:
                if opt._saved._writing is not None:     # (each save written before the next: none skipped)
                    opt._saved._writing.result()
                saved[opt.steps] = ({n: p.detach().clone() for n, p in models[r].named_parameters()},
                                    copy.deepcopy(opt.optimizer.state_dict()["state"]))
        opt.flush()
        opt._loop.run(opt._close_client())     # the worker dies: no close(), no finish()
        opt._loop.stop()

    in_threads(first, crash)
    again = [small_model() for _ in range(2)]
    opened: dict[int, tuple[int, dict[str, Any], dict[str, torch.Tensor]]] = {}
    ends: dict[int, dict[str, torch.Tensor]] = {}

    def resume(r: int) -> None:
        opt = st.AsyncOptimizer(torch.optim.AdamW(again[r].parameters(), lr=0.01), again[r], name=name,
                                servers=servers, rank=r, world_size=2)
        assert opt.resumed and opt.store.workers == 2
        opened[r] = (opt.start_step, copy.deepcopy(opt.optimizer.state_dict()["state"]),
                     {n: p.detach().clone() for n, p in again[r].named_parameters()})
        for x, y in rank_batches(steps, r)[opt.start_step:]:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(again[r](x), y).backward()
            opt.step()
        opt.close(wait_all=30)
        ends[r] = {n: p.detach() for n, p in again[r].named_parameters()}

    in_threads(2, resume)
    at = opened[0][0]
    assert 1 <= at <= steps and opened[1][0] == at, (at, opened[1][0])
    weights, state = saved[at]
    for r in range(2):
        for n, w in weights.items():
            assert torch.equal(opened[r][2][n], w), (r, n)
        for k, v in state.items():
            for field in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opened[r][1][k][field], v[field]), (r, k, field)
    for n, w in ends[0].items():
        assert torch.equal(w, ends[1][n]), n


@pytest.mark.parametrize("part_bytes", [None, 64], ids=["parts", "tensors-cut"])
def test_backward_leaves_the_mean_and_workers_keep_the_same_weights(servers: str, part_bytes: int | None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # two workers in threads, float32 on the wire, the gradients clipped after backward: each ends at
    # the weights of one AdamW stepping on the clipped mean of their gradients (DDP's arithmetic), and
    # both at the same weights, bit for bit; with parts of 64 B, every tensor larger than 16 values
    # goes as several parts, each sent once the tensor's gradient is there
    if part_bytes is not None:
        monkeypatch.setattr(rules, "PART_BYTES", part_bytes)
    steps, workers = 12, 2

    def loop(opt: st.AsyncOptimizer, model: Any, r: int) -> None:
        for x, y in rank_batches(steps, r):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()

    models, opts = allreduce_workers(servers, f"ar-torch-{part_bytes}", workers, loop)
    all_at(models, mean_step_reference(steps, workers, CLIP))
    assert all(o.stats()["bytes_pushed"] > 0 and o.stats()["exchanges"] == steps for o in opts)
    if part_bytes is not None:
        rule = opts[0].store.rule
        assert isinstance(rule, AllReduce)
        sizes = [p.numel() for p in models[0].parameters()]
        assert len(rule.parts) > len(sizes) and max(b - a for a, b in rule.parts) <= part_bytes // 4


def test_a_rank_whose_weights_drifted_alone_says_so_at_the_end(servers: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    # every rank steps on the same mean, so the ranks end bit-identical, unless one did something alone:
    # here rank 1 halves its learning rate after 3 of 6 steps (as ReduceLROnPlateau fed its own loss
    # would).  At close(wait_all=...) rank 1 names the tensors whose weights differ from rank 0's;
    # rank 0 says nothing
    def loop(opt: st.AsyncOptimizer, model: Any, r: int) -> None:
        for s, (x, y) in enumerate(rank_batches(6, r)):
            if r == 1 and s == 3:
                for group in opt.param_groups:
                    group["lr"] *= 0.5
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    allreduce_workers(servers, "ar-drifted", 2, loop)
    said = [r.getMessage() for r in caplog.records if "ends with weights that differ" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("rank 1 ends with weights that differ from rank 0's (0.weight, "
                                                 "0.bias, 2.weight, 2.bias)"), said
    caplog.clear()
    allreduce_workers(servers, "ar-not-drifted", 2, lambda opt, model, r: loop(opt, model, 0 if r else 2))
    assert not [r for r in caplog.records if "ends with weights that differ" in r.getMessage()]


def test_a_step_without_a_backward_is_refused(servers: str) -> None:
    # a rank that leaves a batch's backward out but steps would take its rounds out of line with the
    # others' (each would then add another step's gradients into a round): refused at that step.  A
    # backward whose step the rank leaves out (GradScaler's skipped steps) is not
    model = small_model()
    (x, y), = rank_batches(1, 0)
    with async_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), servers, "ar-no-backward") as opt:
        for backward_only in (True, False):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if not backward_only:
                opt.step()
        opt.zero_grad()
        with pytest.raises(InterfaceError, match=r"rank 0 step 2: step\(\) with no backward since the last step"):
            opt.step()
        assert opt.steps == 1


def test_no_sync_accumulates_micro_batches_into_one_round_a_step(servers: str) -> None:
    # gradient accumulation as under DDP: two of a step's three micro-batches run backward inside
    # opt.no_sync(), the third outside sends their sum; each worker ends at the weights of one AdamW
    # stepping on the mean of the workers' accumulated gradients, both the same, after one round a
    # step.  A step whose last backward ran inside no_sync() is refused (its gradients are its own)
    steps, workers, micro = 6, 2, 3

    def loop(opt: st.AsyncOptimizer, model: Any, r: int) -> None:
        batches = rank_batches(steps * micro, r)
        for s in range(steps):
            opt.zero_grad()
            for m, (x, y) in enumerate(batches[s * micro:(s + 1) * micro]):
                with opt.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    (torch.nn.functional.cross_entropy(model(x), y) / micro).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
        assert opt.stats()["exchanges"] == steps
        opt.zero_grad()
        x, y = batches[0]
        with opt.no_sync():
            torch.nn.functional.cross_entropy(model(x), y).backward()
        with pytest.raises(InterfaceError, match=rf"rank {r} steps on gradients that only it has: the last backward "
                                                 rf"before step {steps + 1} ran inside opt.no_sync\(\)"):
            opt.step()

    models, _ = allreduce_workers(servers, "ar-no-sync", workers, loop)
    all_at(models, mean_step_reference(steps, workers, CLIP, micro))


@pytest.mark.parametrize("part_bytes", [None, 256], ids=["parts", "tensors-cut"])
def test_sparse_gradients_get_the_mean_and_stay_sparse(servers: str, part_bytes: int | None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # nn.EmbeddingBag(sparse=True): each worker's gradient touches the rows of its own batch; backward
    # leaves the mean of both (the rows either touched), sparse as it came (SparseAdam takes no other),
    # and SGD on it gives both workers the weights of one process stepping on that mean; with parts
    # of 256 B the embedding's 400 values go as 7 parts, from one gradient made dense once a round
    if part_bytes is not None:
        monkeypatch.setattr(rules, "PART_BYTES", part_bytes)
    steps, workers = 5, 2

    def make_model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.EmbeddingBag(50, 8, mode="mean", sparse=True), torch.nn.Linear(8, 2))

    def batches(r: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(r)
        xs = [torch.randint(0, 50, (8, 4), generator=g) for _ in range(steps)]
        return [(x, (x[:, 0] < 25).long()) for x in xs]

    def sgd(model: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.5)

    def loop(opt: st.AsyncOptimizer, model: Any, r: int) -> None:
        for x, y in batches(r):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            assert model[0].weight.grad.is_sparse
            opt.step()

    ref = make_model()
    ref_opt = sgd(ref)
    for s in range(steps):
        means = [torch.zeros_like(p) for p in ref.parameters()]
        for r in range(workers):
            ref.zero_grad()
            x, y = batches(r)[s]
            torch.nn.functional.cross_entropy(ref(x), y).backward()
            means = [m + (p.grad.to_dense() if p.grad.is_sparse else p.grad) / workers
                     for m, p in zip(means, ref.parameters())]
        for p, m in zip(ref.parameters(), means):
            p.grad = m
        ref_opt.step()
    models, opts = allreduce_workers(servers, f"ar-sparse-{part_bytes}", workers, loop, make_model, sgd)
    all_at(models, {n: p.detach() for n, p in ref.named_parameters()})
    if part_bytes is not None:
        rule = opts[0].store.rule
        assert isinstance(rule, AllReduce)
        embedding = opts[0].store.flat_offset("0.weight")
        assert len(rule.parts_over(embedding, embedding + 400)) == 7


class _SomeUnused(torch.nn.Module):
    """A layer no worker uses, one frozen after a few steps, one that only
    worker 1 uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.head = torch.nn.Linear(10, 16), torch.nn.Linear(16, 3)
        self.unused, self.only_one = torch.nn.Linear(10, 3), torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        return self.head(h) + (self.only_one(h) if rank == 1 else 0)


def test_a_parameter_no_worker_has_a_gradient_for_is_left_alone(servers: str) -> None:
    # as DDP leaves a parameter that no rank used: the unused layer, and the first one once frozen
    # (after 3 of 6 steps), keep .grad None and their weights under AdamW's weight decay; the layer
    # only worker 1 uses gets the mean (worker 0 counting zeros) on both, which end the same
    steps = 6

    def loop(opt: st.AsyncOptimizer, model: Any, r: int) -> None:
        for s, (x, y) in enumerate(rank_batches(steps, r)):
            if s == 3:
                model.first.requires_grad_(False)
                frozen = model.first.weight.detach().clone()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x, r), y).backward()
            assert model.unused.weight.grad is None and (s < 3 or model.first.weight.grad is None)
            assert model.only_one.weight.grad is not None
            opt.step()
        assert torch.equal(model.first.weight.detach(), frozen)

    def adamw(model: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)

    models, _ = allreduce_workers(servers, "ar-unused", 2, loop, _SomeUnused, adamw)
    untouched = _SomeUnused()
    assert torch.equal(models[0].unused.weight.detach(), untouched.unused.weight.detach())
    assert not torch.equal(models[0].only_one.weight.detach(), untouched.only_one.weight.detach())
    for n, p in models[0].named_parameters():
        assert torch.equal(p.detach(), dict(models[1].named_parameters())[n].detach()), n


_RESTARTED = textwrap.dedent('''
    import json, os, sys, time
    import torch
    import smb2.torch as st
    from smb2.testing.torch_models import rank_batches, small_model

    steps, die_after, clip, every = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    model = small_model()
    opt = st.AsyncOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model, name=sys.argv[1],
                            rule="allreduce", push_dtype="float32", state_every=every, timeout=60)
    print(json.dumps({"event": "open", "rank": opt.rank, "attempt": attempt, "start_step": opt.start_step,
                      "run": opt.store.generation}), flush=True)
    for x, y in rank_batches(steps, opt.rank)[opt.start_step:]:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        time.sleep(0.05)        # (heartbeats, every 0.25 s, then publish steps past 0 before the crash)
        if opt.rank == 1 and attempt == 0 and opt.steps == die_after:
            os._exit(3)         # a crash, in the first attempt only
    opt.close(wait_all=60)
    print(json.dumps({"event": "done", "rank": opt.rank, "steps": opt.steps,
                      "weights": {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}}),
          flush=True)
''')


@pytest.mark.slow
@pytest.mark.timeout(240)      # two torch processes start twice; a loaded 2-core machine needs a minute
@pytest.mark.parametrize("saves", ["every step", "none yet"])
def test_a_torchrun_restart_goes_on_from_rank_0s_last_save(servers: str, tmp_path: Path, saves: str) -> None:
    # rank 1 crashes after step 8; torchrun --max-restarts=1 restarts the group; rank 0 opens a new run
    # from its last save (weights, AdamW moments, step), rank 1 joins it, and both end where one AdamW
    # on the clipped mean of their gradients ends: the crash cost time, not a step counted twice or lost.
    # With no save made yet, both start again at step 0 from the weights the run started from (not
    # each at the step its heartbeat last said, which left them out of step)
    steps, workers, die_after = 16, 2, 8
    every = 1e-9 if saves == "every step" else 1e9
    script = tmp_path / "train.py"
    script.write_text(_RESTARTED)
    env = dict(os.environ, SMB2_SERVERS=servers, OMP_NUM_THREADS="1")
    name = f"ar-restart-{every:g}"
    out = subprocess.run(torchrun(str(script), name, str(steps), str(die_after), str(CLIP), str(every),
                                  nproc=workers, max_restarts=1, monitor_interval=0.2),
                         env=env, capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, torchrun_failure(out.stderr)
    events = json_objects(out.stdout)
    opened = sorted((e["attempt"], e["rank"], e["run"], e["start_step"]) for e in events if e["event"] == "open")
    assert [o[:2] for o in opened] == [(0, 0), (0, 1), (1, 0), (1, 1)], opened
    (_, _, run0, at0), (_, _, run1, at1) = opened[2:]
    # a new run (not a rejoin of the old one), both ranks from the same save, made at step 1..8
    assert run0 == run1 == opened[0][2] + 1 and at0 == at1, opened
    assert 1 <= at0 <= die_after if saves == "every step" else at0 == 0, opened
    assert f"resuming store {name!r}" in out.stderr and "rank 0 was restarted" in out.stderr, out.stderr[-4000:]
    ends = {e["rank"]: e for e in events if e["event"] == "done"}
    assert sorted(ends) == [0, 1] and ends[0]["steps"] == ends[1]["steps"] == steps
    assert ends[0]["weights"] == ends[1]["weights"]
    ref = mean_step_reference(steps, workers, CLIP)
    for n, want in ref.items():
        torch.testing.assert_close(torch.tensor(ends[0]["weights"][n]), want.flatten(), rtol=1e-5, atol=1e-6)


_RESIZED = textwrap.dedent('''
    import json, os, sys, time
    import torch
    import smb2.torch as st
    from smb2.testing.torch_models import rank_batches, small_model

    steps, die_after = int(sys.argv[2]), int(sys.argv[3])
    model = small_model()
    opt = st.AsyncOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model, name=sys.argv[1],
                            state_every=1e-9, state_share=None, timeout=60)
    print(json.dumps({"event": "open", "rank": opt.rank, "world": opt.world, "start_step": opt.start_step,
                      "resumed": opt.resumed}), flush=True)
    for x, y in rank_batches(steps, opt.rank)[opt.start_step:]:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        time.sleep(0.05)
        if opt.world == 3 and opt.steps == die_after:
            os._exit(3)         # the whole job dies (its host lost), before it finished
    opt.close(wait_all=60)
    print(json.dumps({"event": "done", "rank": opt.rank, "steps": opt.steps,
                      "weights": {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}}),
          flush=True)
''')


@pytest.mark.slow
@pytest.mark.timeout(240)      # five torch processes start; a loaded 2-core machine needs a minute
def test_a_job_launched_again_with_fewer_torchrun_workers_goes_on(servers: str, tmp_path: Path) -> None:
    # a job of 3 torchrun workers dies after step 6; launched again with 2 (torchrun --nnodes=MIN:MAX
    # after a host was lost), its rank 0 makes the store again for 2 and both go on from rank 0's last
    # save, in step, to the end
    steps, die_after, name = 12, 6, "ar-fewer-torchrun"
    script = tmp_path / "train.py"
    script.write_text(_RESIZED)
    env = dict(os.environ, SMB2_SERVERS=servers, OMP_NUM_THREADS="1")
    first = subprocess.run(torchrun(str(script), name, str(steps), str(die_after), nproc=3, max_restarts=0),
                           env=env, capture_output=True, text=True, timeout=110)
    assert first.returncode != 0 and not [e for e in json_objects(first.stdout) if e["event"] == "done"]
    again = subprocess.run(torchrun(str(script), name, str(steps), str(die_after), nproc=2, max_restarts=0),
                           env=env, capture_output=True, text=True, timeout=110)
    assert again.returncode == 0, torchrun_failure(again.stderr)
    assert f"store {name!r} was made for 3 workers and this job has 2 (WORLD_SIZE): rank 0 made it again for 2; " \
           "the run resumes" in again.stderr, again.stderr[-4000:]
    events = json_objects(again.stdout)
    opened = sorted((e["rank"], e["world"], e["resumed"], e["start_step"]) for e in events if e["event"] == "open")
    assert [o[:3] for o in opened] == [(0, 2, True), (1, 2, True)], opened
    assert 1 <= opened[0][3] == opened[1][3] <= die_after, opened
    ends = {e["rank"]: e for e in events if e["event"] == "done"}
    assert sorted(ends) == [0, 1] and ends[0]["steps"] == ends[1]["steps"] == steps
    assert ends[0]["weights"] == ends[1]["weights"]


_TAKEN_BACK = textwrap.dedent('''
    import json, os, sys, time
    from pathlib import Path
    import torch
    import smb2.torch as st
    from smb2.testing.torch_models import rank_batches, small_model

    name, die_after, cycle, after_back, clip = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
        float(sys.argv[5])
    back, victim, scaled, dead_after = Path(sys.argv[6]), sys.argv[7], sys.argv[8] == "scaled", float(sys.argv[9])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    model = small_model()
    # mixed precision's loss scale, made to grow every 3 steps (powers of 2: unscaled exactly), so
    # that the one a restarted rank starts with is not the others'
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=3) if scaled else None
    opt = st.AsyncOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model, name=name,
                            push_dtype="float32", timeout=120, dead_after=dead_after)
    if attempt > 0:     # taken back: the step it continues after, for the others to end with it
        Path(f"{back}.{opt.rank}").write_text(str(opt.start_step))
        Path(f"{back}.{opt.rank}").rename(back)
    print(json.dumps({"event": "open", "rank": opt.rank, "attempt": attempt, "start_step": opt.start_step,
                      "run": opt.store.generation}), flush=True)
    batches = rank_batches(cycle, opt.rank)
    members = []
    s = opt.start_step
    # every rank ends after_back steps after the restarted one came back; until it does, the other
    # trains alone (its batches repeat) as slowly as heartbeats need to publish its steps
    while not (back.exists() and s == int(back.read_text()) + after_back):
        x, y = batches[s % cycle]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(opt)
            scaler.update()
        members.append(list(opt.store.rule.epoch.members))
        s += 1
        if victim in ("both", str(opt.rank)) and attempt == 0 and s == die_after:
            os._exit(3)         # a crash, in the first attempt only
        if not back.exists():
            time.sleep(0.05)
    opt.close(wait_all=60)
    print(json.dumps({"event": "done", "rank": opt.rank, "steps": opt.steps, "members": members,
                      "scale": None if scaler is None else scaler.get_scale(),
                      "weights": {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}}),
          flush=True)
''')


def _one_torchrun_per_worker(servers: str, tmp_path: Path, name: str, die_after: int, cycle: int,
                             after_back: int, victim: str, scaled: bool = False, dead_after: float = 5.0
                             ) -> tuple[list[tuple[str, str]], list[dict[str, Any]]]:
    """_TAKEN_BACK run by one torchrun per worker (2 workers, --max-restarts=1), ``victim`` ("0", "1"
    or "both") crashing after step ``die_after`` (``scaled``: the loop scales its loss with a
    GradScaler; ``dead_after``: the rule's): each torchrun's (stdout, stderr), every JSON event."""
    script = tmp_path / "train.py"
    script.write_text(_TAKEN_BACK)
    procs = []
    for rank in range(2):
        env = dict(os.environ, SMB2_SERVERS=servers, SMB2_RANK=str(rank), SMB2_WORLD_SIZE="2", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            torchrun(str(script), name, str(die_after), str(cycle), str(after_back), str(CLIP),
                     str(tmp_path / "back"), victim, "scaled" if scaled else "plain", str(dead_after), max_restarts=1,
                     monitor_interval=0.2),
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=280) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, torchrun_failure(err)
    return outs, [e for out, _ in outs for e in json_objects(out)]


@pytest.mark.slow
@pytest.mark.timeout(300)      # three torch processes start, one twice; a loaded 2-core machine needs a minute
@pytest.mark.parametrize("victim, scaled, dead_after", [(1, True, 600.0), (0, False, 5.0)],
                         ids=["rank-1-loss-scaled-restart-seen", "rank-0"])
def test_a_worker_restarted_on_its_own_is_taken_back(servers: str, tmp_path: Path, victim: int,
                                                     scaled: bool, dead_after: float) -> None:
    # one torchrun per worker (as the Slurm recipe and the Kubernetes Job launch them), each with
    # --max-restarts=1: the victim crashes after step 8; torchrun restarts it, and it asks to be taken back; the
    # other, blocked in a round that waits for the victim's old self, sees the request and goes on alone without
    # waiting out its silence (dead_after=600 s: only so; with 5 s, either comes first); the other (its leader
    # now) hands it the weights, AdamW's moments and the step at the start of a step and both go on in step:
    # each ends where one AdamW on the clipped mean of the members' gradients of each step ends (one alone in
    # between), the crash costing the lost rank's batches of those steps, nothing counted twice.  Rank 0 taken
    # back leads again (it writes the store's weights at close).  With a GradScaler, the restarted rank's scale
    # starts afresh, below the others' (it grew): it is handed the leader's, also for the backward it made
    # before it could load it, else the mean of gradients scaled unlike would be unscaled unlike, and the ranks'
    # weights part
    die_after, cycle, after_back = 8, 40, 6
    name = f"ar-taken-back-{victim}"
    outs, events = _one_torchrun_per_worker(servers, tmp_path, name, die_after, cycle, after_back, str(victim),
                                            scaled, dead_after)
    opened = sorted((e["rank"], e["attempt"], e["run"], e["start_step"]) for e in events if e["event"] == "open")
    assert [o[:2] for o in opened] == sorted([(0, 0), (1, 0), (victim, 1)]), opened
    back_at = [o for o in opened if o[1] == 1][0][3]
    # the same run (taken back, not a new one), after the other trained alone for a step at least
    assert len({o[2] for o in opened}) == 1 and back_at > die_after, opened
    said = outs[0][1] + outs[1][1]
    assert f"restarted rank {victim} is taken back into the training at step {back_at + 1}" in said, said[-4000:]
    if dead_after > 60:
        assert (f"rank {victim} was restarted (it asks to be taken back): the 1 other workers go on without it "
                f"from step {die_after + 1}") in said, said[-4000:]
    ends = {e["rank"]: e for e in events if e["event"] == "done"}
    assert ends[0]["steps"] == ends[1]["steps"] == back_at + after_back
    assert ends[0]["scale"] == ends[1]["scale"] == (16.0 * 2 ** ((back_at + after_back) // 3) if scaled else None)
    assert ends[0]["weights"] == ends[1]["weights"]
    members = ends[1 - victim]["members"]
    assert members[:die_after] == [[0, 1]] * die_after and members[back_at:] == [[0, 1]] * after_back, members
    assert members[die_after:back_at] == [[1 - victim]] * (back_at - die_after), members
    assert ends[victim]["members"] == members[back_at:]
    ref = mean_step_reference(back_at + after_back, 2, CLIP, members=members, cycle=cycle)
    for n, want in ref.items():
        torch.testing.assert_close(torch.tensor(ends[0]["weights"][n]), want.flatten(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)      # four torch processes start and train; a loaded 2-core machine needs a minute
def test_workers_restarted_on_their_own_all_at_once_restart_the_job(servers: str, tmp_path: Path) -> None:
    # one torchrun per worker, and both crash after step 8 (a memory server's restart takes every
    # worker down at once): each restarted rank asks to be taken back, finds no one alive to do it,
    # and the job restarts as a whole, rank 0 opening a resumed run from its last save (or step 0),
    # rank 1 joining it; both end where one AdamW on the mean of both ranks' gradients of every
    # step ends, the steps after the save trained again, none counted twice
    die_after, cycle, after_back = 8, 40, 6
    name = "ar-all-restarted"
    outs, events = _one_torchrun_per_worker(servers, tmp_path, name, die_after, cycle, after_back, "both")
    opened = sorted((e["rank"], e["attempt"], e["run"], e["start_step"]) for e in events if e["event"] == "open")
    assert [o[:2] for o in opened] == [(0, 0), (0, 1), (1, 0), (1, 1)], opened
    (_, _, run0, at0), (_, _, run1, at1) = opened[1], opened[3]
    # a new run, resumed by both from the same save
    assert run0 == run1 == opened[0][2] + 1 and at0 == at1 <= die_after, opened
    said = outs[0][1] + outs[1][1]
    assert f"resuming store {name!r}" in said, said[-4000:]
    ends = {e["rank"]: e for e in events if e["event"] == "done"}
    assert ends[0]["steps"] == ends[1]["steps"] == at0 + after_back
    assert ends[0]["weights"] == ends[1]["weights"]
    ref = mean_step_reference(at0 + after_back, 2, CLIP, cycle=cycle)
    for n, want in ref.items():
        torch.testing.assert_close(torch.tensor(ends[0]["weights"][n]), want.flatten(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)      # four torch processes start and train; a loaded 2-core machine needs minutes
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_torchrun_workers_learn_as_ddp_does(servers: str, kind: str) -> None:
    # the example under torchrun, 4 ranks, no --rule (the porting recipe's one line: AsyncOptimizer's
    # default, allreduce), 12 epochs, against the same script under torch DDP (examples/
    # torch_train_ddp.py: the same seed, data, order and loop), and against one shard trained alone,
    # which the bar must tell apart. Digits has 539 test images: one point is 5.4 images. The two
    # differ only by the bf16 rounding of the gradients and of their mean: on seeds 0-4 they ended
    # 0-1 image apart (smb2 bench classifier, docs/training.md)
    pytest.importorskip("sklearn", reason="the digits data set needs scikit-learn")
    from smb2.testing.torch_models import ddp_accuracy, example_run, single_process_accuracy

    epochs, within = 12, 0.5
    ranks, _ = example_run(servers, kind, epochs, "--name", f"t-run-allreduce-{kind}")
    ddp = ddp_accuracy(kind, epochs)
    alone = single_process_accuracy(kind, epochs, shard=slice(0, None, 4))
    print(f"{kind}: {ranks[0]['accuracy']:.2f} % vs DDP's {ddp:.2f} %, one shard alone {alone:.2f} %")
    assert all(r["rule"] == "allreduce" for r in ranks), ranks
    assert len({r["accuracy"] for r in ranks}) == 1         # every rank holds the same weights
    assert len({r["steps"] for r in ranks}) == 1
    assert alone < ddp - within, (alone, ddp)
    assert abs(ranks[0]["accuracy"] - ddp) <= within, (ranks[0], ddp, alone)
