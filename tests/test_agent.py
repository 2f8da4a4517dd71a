"""The host agent (smb2-agent, smb2.agent) and the worker's mirror
(smb2.mirror.AgentMirror), against real processes: two smb2-server
processes and one smb2-agent; the workers are clients in this process.

The sums are checked exactly: every push is integer-valued, so the float
sums have no rounding and each push counts once or the arrays differ."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import smb2
from smb2 import AgentLost, AgentTimeout, NoSuchBuffer, OutOfBounds, OutOfMemory, Unsupported
from smb2.mirror import OLD_MAGIC, PUSHED_SLOT, SLOTS, STATE, AgentMirror, Spec, buffer_size
from smb2.testing.cluster import LocalCluster
from smb2.testing.launch import AsyncAgentProcess
from smb2.testing.waits import until
from smb2.train import ParameterStore
from smb2.train.rules import outer_momentum_name

TOKEN = os.urandom(16).hex().encode()
STRIPE = 8192


@contextlib.asynccontextmanager
async def agent_of(cluster: LocalCluster, *flags: str) -> AsyncIterator[AsyncAgentProcess]:
    agent = await AsyncAgentProcess.spawn_agent(cluster.addresses, *flags, token=cluster.token)
    try:
        yield agent
    finally:
        await agent.stop()


async def test_host_pushes_reach_the_servers_exactly_once() -> None:
    """Four workers push through the agent while a fifth client pushes to the
    servers directly: the remote region ends as its start plus every push,
    exactly, and the mirror then reads what the servers hold.  A clean stop
    (SIGTERM) forwards what was pushed before it."""
    rng = np.random.default_rng(7)
    async with LocalCluster(2, processes=True, capacity="64MiB", token=TOKEN) as cluster, \
            agent_of(cluster) as agent:
        direct = await cluster.connect()
        remote = await direct.create("weights", 64 << 10, stripe=STRIPE)
        offset, n = 4096, 10240                 # float32 elements over stripes of both servers
        start = rng.integers(-1000, 1000, n).astype(np.float32)
        await remote.write(offset, start)
        expected = start.astype(np.float64)
        workers = [await smb2.connect([agent.endpoint], token=TOKEN) for _ in range(4)]
        mirrors = await asyncio.gather(*(AgentMirror.open(w, remote, offset, n * 4, np.float32, timeout=30)
                                         for w in workers))
        assert len({m.buffer.name for m in mirrors}) == 1, "host-mates share one mirror"
        assert np.array_equal(await mirrors[0].read(), start)

        def pushes(count: int) -> list[tuple[int, np.ndarray]]:
            out = []
            for _ in range(count):
                lo = int(rng.integers(0, n - 1))
                hi = int(rng.integers(lo + 1, n + 1))
                out.append((lo, rng.integers(-8, 9, hi - lo).astype(np.float32)))
            return out

        plans = [pushes(60) for _ in range(5)]
        sparse = [(np.sort(rng.choice(n, 50)), rng.integers(-8, 9, 50).astype(np.float32)) for _ in range(4)]
        for plan in plans:
            for lo, values in plan:
                expected[lo:lo + len(values)] += values
        for idx, values in sparse:
            np.add.at(expected, idx, values)

        async def worker(k: int) -> None:
            m = mirrors[k]
            for j, (lo, values) in enumerate(plans[k]):
                # half of them sent narrower: small integers are exact in bfloat16
                await m.accumulate(lo * 4, values, wire="bfloat16" if j % 2 else None)
                if j % 7 == 0:
                    await asyncio.sleep(0.001)
            await m.accumulate_sparse(*sparse[k])

        async def direct_pushes() -> None:
            for lo, values in plans[4]:
                await remote.accumulate(offset + lo * 4, values)
                await asyncio.sleep(0)

        await asyncio.gather(*(worker(k) for k in range(4)), direct_pushes())
        for m in mirrors:
            await m.wait_forwarded(timeout=60)
            assert m.confirmed == m.pushes == 61 and m.uncertain == 0
        got = np.empty(n, np.float32)
        await remote.read_into(got, offset)
        assert np.array_equal(got, expected.astype(np.float32))
        # a pull that began after every push: the mirror reads what the servers hold
        await mirrors[0].wait_cycle(mirrors[0].cycle + 2, timeout=60)
        assert np.array_equal(await mirrors[0].read(), got)
        seen = np.empty(n, np.float32)
        await mirrors[1].read_into(seen)
        assert np.array_equal(seen, got)

        # a clean stop forwards what was pushed before it
        last = rng.integers(-8, 9, n).astype(np.float32)
        await mirrors[2].accumulate(0, last)
        assert await agent.stop(signal.SIGTERM) == 0
        await remote.read_into(got, offset)
        assert np.array_equal(got, (expected + last).astype(np.float32))
        for w in workers:
            await w.close()


async def test_the_agent_gathers_its_host_workers_pushes_and_asks_into_one() -> None:
    """A mirror of three host workers (host_workers=3): the agent forwards
    once each of them pushed and pulls once each asked.  Two pushes stay on
    the host while the agent cycles on (the servers hold neither, and the
    workers' confirmation counter does not move), the third sends all three
    in one forward; three reads are served by one pull, the first two
    waiting for the third ask.  The time bound (--gather) is an hour here:
    only the count decides.  Then a push of one worker alone goes once the
    bound passes (a second agent, --gather 0.05)."""
    n = 8192                                    # float32: over stripes of both servers
    async with LocalCluster(2, processes=True, capacity="64MiB", token=TOKEN) as cluster:
        direct = await cluster.connect()
        remote = await direct.create("weights", 64 << 10, stripe=STRIPE)
        got = np.empty(n, np.float32)
        async with agent_of(cluster, "--gather", "3600") as agent:
            workers = [await smb2.connect([agent.endpoint], token=TOKEN) for _ in range(3)]
            mirrors = [await AgentMirror.open(w, remote, 0, n * 4, np.float32, timeout=30, host_workers=3)
                       for w in workers]

            async def said() -> dict[str, Any]:
                (stat,) = await workers[0].stat()
                return dict(stat["agent"])

            start = await said()
            for k in range(2):
                await mirrors[k].accumulate(0, np.full(n, k + 1, np.float32))
            await until(lambda: _cycled(said, start["cycles"] + 5), "the agent cycles with two pushes held")
            cycle = await mirrors[0].wait_cycle(0)
            await until(lambda: _cycled(said, start["cycles"] + 10), "the agent cycles with two pushes held")
            await remote.read_into(got, 0)
            assert not got.any(), "the first two pushes waited for the third"
            assert (await said())["forwards"] == start["forwards"]
            assert await mirrors[0].wait_cycle(0) == cycle, "no cycle that held a push back raised the counter"
            await mirrors[2].accumulate(0, np.full(n, 3, np.float32))
            for m in mirrors:
                await m.wait_forwarded(timeout=60)
            await remote.read_into(got, 0)
            assert np.array_equal(got, np.full(n, 6, np.float32))
            assert (await said())["forwards"] == start["forwards"] + 1, "three pushes, one forward"

            # reads: the first two wait for the third ask, then one pull serves all three
            pulls = (await said())["pulls"]
            await remote.accumulate(0, np.full(n, 10, np.float32))
            first = [asyncio.ensure_future(m.read()) for m in mirrors[:2]]
            cycles = (await said())["cycles"]
            await until(lambda: _cycled(said, cycles + 5), "the agent cycles with two asks held")
            assert not any(f.done() for f in first), "a read was served before the host's third ask"
            views = await asyncio.gather(*first, mirrors[2].read())
            for view in views:
                assert np.array_equal(view, np.full(n, 16, np.float32))
            assert (await said())["pulls"] == pulls + 1, "three reads, one pull"
            for w in workers:
                await w.close()

        # the bound: one worker of three pushes, and the push goes all the same
        async with agent_of(cluster, "--gather", "0.05") as agent:
            alone = await smb2.connect([agent.endpoint], token=TOKEN)
            mirror = await AgentMirror.open(alone, remote, 0, n * 4, np.float32, timeout=30, host_workers=3)
            await mirror.accumulate(0, np.full(n, 1, np.float32))
            await mirror.wait_forwarded(timeout=60)
            await remote.read_into(got, 0)
            assert np.array_equal(got, np.full(n, 17, np.float32))
            assert np.array_equal(await mirror.read(), got)
            await alone.close()


async def _cycled(said: Callable[[], Awaitable[dict[str, Any]]], at_least: int) -> bool:
    return int((await said())["cycles"]) >= at_least


async def test_a_killed_agent_is_reported_and_nothing_counts_twice() -> None:
    """Workers push without pause; the agent is SIGKILLed.  Each worker gets
    AgentLost stating how many of its pushes are uncertain, and the servers
    hold, per worker, at least its confirmed pushes and at most those plus
    the uncertain ones: none twice.  Worker w adds 4096**w per push, so
    each worker's count is read back from the sum (float64, exact)."""
    async with LocalCluster(2, processes=True, capacity="64MiB") as cluster:
        direct = await cluster.connect()
        remote = await direct.create("weights", 64 << 10, stripe=STRIPE)
        n = 4096                                # float64 elements: 32 KiB over both servers
        agent = await AsyncAgentProcess.spawn_agent(cluster.addresses)
        try:
            workers = [await smb2.connect([agent.endpoint]) for _ in range(4)]
            mirrors = [await AgentMirror.open(w, "weights", 0, n * 8, "float64", timeout=30) for w in workers]
            lost: list[AgentLost | None] = [None] * 4

            async def push(k: int) -> None:
                one = np.full(n, 4096.0 ** k)
                for _ in range(4000):           # counts must stay below 4096
                    try:
                        await mirrors[k].accumulate(0, one)
                    except AgentLost as exc:
                        lost[k] = exc
                        return
                    await asyncio.sleep(0.001)

            pushing = [asyncio.ensure_future(push(k)) for k in range(4)]
            # and one that waits for a cycle that never comes
            waiter = await smb2.connect([agent.endpoint])
            workers.append(waiter)
            waiting = asyncio.ensure_future(
                (await AgentMirror.open(waiter, "weights", 0, n * 8, "float64", timeout=30)).wait_cycle(1 << 40))
            await until(lambda: all(m.confirmed >= 5 for m in mirrors), "every worker has confirmed pushes")
            await agent.stop(signal.SIGKILL)
            await asyncio.gather(*pushing)
            with pytest.raises(AgentLost, match="stopped"):
                await waiting
        finally:
            await agent.stop()
        for k, exc in enumerate(lost):
            assert exc is not None, f"worker {k} pushed 4000 times without noticing the agent's death"
            assert exc.pushes == mirrors[k].pushes and exc.confirmed + exc.uncertain == exc.pushes
            assert exc.confirmed >= 5
            assert f"{exc.uncertain} of this worker's {exc.pushes} pushes" in exc.message
            assert "smb2-agent" in str(exc) and "SMB2_AGENT" in str(exc) and "intact" in str(exc)
        # the servers took everything the dead agent's connections delivered
        await until(lambda: _only_direct(direct), "the servers dropped the agent's connections")
        total = np.empty(n, np.float64)
        await remote.read_into(total, 0)
        assert np.array_equal(total, np.round(total))
        counts = total.astype(np.int64)
        for k, exc in enumerate(lost):
            assert exc is not None
            applied = (counts >> (12 * k)) & 4095
            assert (applied >= exc.confirmed).all(), (k, exc.confirmed, applied.min())
            assert (applied <= exc.confirmed + exc.uncertain).all(), (k, exc.pushes, applied.max())
        for w in workers:
            await w.close()


async def test_a_restarting_memory_server_holds_up_the_forwards_and_loses_none(tmp_path: Any) -> None:
    """A memory server stops (saving its memory) and comes back while the
    host pushes: the agent keeps the pushes, retries, and forwards each one
    once the server is back."""
    async with LocalCluster(2, processes=True, capacity="64MiB", data_dir=tmp_path) as cluster, \
            agent_of(cluster, "--period", "0.002") as agent:
        direct = await cluster.connect()
        remote = await direct.create("weights", 64 << 10, stripe=STRIPE)
        w = await smb2.connect([agent.endpoint])
        m = await AgentMirror.open(w, remote, 0, 64 << 10, "float32", timeout=30)
        ones = np.ones(16 << 10, np.float32)
        for _ in range(5):
            await m.accumulate(0, ones)
        await m.wait_forwarded(timeout=60)
        await cluster.kill(1, signal.SIGTERM)
        for _ in range(5):
            await m.accumulate(0, ones)         # kept on the host meanwhile
        stalled = m.cycle
        await asyncio.sleep(0.05)
        assert await m.wait_cycle(0) == stalled, "no cycle completes while a server is down"
        await cluster.restart(1)
        await m.wait_forwarded(timeout=60)
        got = np.empty(16 << 10, np.float32)
        await remote.read_into(got, 0)
        assert np.array_equal(got, np.full(16 << 10, 10.0, np.float32))
        await w.close()


async def test_a_narrow_wire_keeps_what_rounding_left_on_the_host() -> None:
    """Forwarded as bfloat16, the host's pushes reach the servers rounded,
    and what the rounding left out stays in the mirror for the next forward
    (error feedback): the mirror holds the exact sum, the servers' copy that
    sum within one bfloat16 rounding, and the next push carries the rest."""
    async with LocalCluster(2, processes=True, capacity="64MiB", token=TOKEN) as cluster, \
            agent_of(cluster) as agent:
        direct = await cluster.connect()
        remote = await direct.create("weights", 64 << 10, stripe=STRIPE)
        w = await smb2.connect([agent.endpoint], token=TOKEN)
        m = await AgentMirror.open(w, remote, 0, 64 << 10, np.float32, timeout=30, wire="bfloat16")
        assert "bfloat16" in m.buffer.name
        # not a bfloat16 value, and neither is what rounding leaves of any run of its sums: a cycle can
        # read the data after a push landed but before the push counted, and forward that rest once
        # more in the next cycle (with 1 + 2**-10 the rest, a multiple of 2**-10, can be a bfloat16
        # value, and the servers then held the exact sum).  Every partial sum is exact in float32.
        value = 1 + 2.0 ** -10 + 2.0 ** -20
        step = np.full(16 << 10, value, np.float32)
        for _ in range(10):
            await m.accumulate(0, step)
        await m.wait_forwarded(timeout=60)
        exact = np.float32(10 * value)
        assert np.array_equal(await m.read(), np.full(16 << 10, exact, np.float32))
        got = np.empty(16 << 10, np.float32)
        await remote.read_into(got, 0)
        assert not np.array_equal(got, np.full(16 << 10, exact, np.float32)), "the servers got rounded pushes"
        assert np.abs(got - exact).max() <= 2.0 ** -4        # one bfloat16 rounding at 10 (8 bits)
        await w.close()


async def test_a_finished_rank_has_its_pushes_on_the_servers() -> None:
    """finish() returns once the agent forwarded the rank's pushes: whoever
    sees the rank finished (rank 0 taking the final weights) has them.  The
    agent cycles only every 0.5 s here, so a finish that did not wait would
    leave the last push on the host."""
    params = {"w": np.zeros(1024, np.float32)}
    async with LocalCluster(2, processes=True, capacity="64MiB") as cluster:
        agent = await AsyncAgentProcess.spawn_agent(cluster.addresses, "--period", "0.5")
        try:
            client = await cluster.connect()
            on_host = await smb2.connect([agent.endpoint])
            store = await ParameterStore.open(client, "t-agent-finish", params, rule="delta", workers=1, rank=0)
            await store.join()
            assert await store.use_agent(on_host)
            ones = {"w": np.ones(1024, np.float32)}
            for _ in range(3):
                assert await store.push(ones)
            await store.finish()
            got = np.empty(1024, np.float32)
            await store.buf.read_into(got, store.data_off)
            assert np.array_equal(got, np.full(1024, 3.0, np.float32))
            assert store.weights.via == "agent"
            await on_host.close()
            await client.close()
        finally:
            await agent.stop()


async def test_workers_through_the_agent_connect_only_to_the_servers_they_reach_themselves() -> None:
    """With lazy clients (what AsyncOptimizer does with an agent), a rank
    other than 0 opens the store without its pull (``pull=False``), pulls
    and pushes through the agent, and connects only to the servers of the
    store's control words: the agent holds the host's connection to the
    others.  The pushes land exactly, and a server no worker reaches itself
    sees rank 0 (which wrote the first weights) and the agent only."""
    n = 256 << 10
    params = {"w": np.zeros(n, np.float32)}
    async with LocalCluster(6, processes=True, capacity="64MiB") as cluster, agent_of(cluster) as agent:
        async def worker(rank: int) -> tuple[ParameterStore, smb2.Client, smb2.Client]:
            client = await smb2.connect(cluster.addresses, lazy=True)
            store = await ParameterStore.open(client, "t-agent-lazy", params, rule="delta", workers=4, rank=rank,
                                              pull=False, timeout=60)
            await store.join(60)
            on_host = await smb2.connect([agent.endpoint])
            assert await store.use_agent(on_host, host_workers=4)
            await store.pull()
            for step in range(3):
                assert await store.push({"w": np.full(n, rank + 1, np.float32)}, step=step)
                await store.pull()
                await store.heartbeat(step)
            await store.finish()
            return store, client, on_host
        done = await asyncio.gather(*(worker(r) for r in range(4)))
        got = np.empty(n, np.float32)
        await done[0][0].buf.read_into(got, done[0][0].data_off)
        assert np.array_equal(got, np.full(n, 3 * (1 + 2 + 3 + 4), np.float32))     # every push, once
        assert [store.weights.via for store, _, _ in done] == ["agent"] * 4
        reached = [{k for k, t in enumerate(client.transports) if t != "-"} for _, client, _ in done]
        assert reached[0] == set(range(6))
        assert all(len(r) < 6 for r in reached[1:]), reached
        control = set.union(*reached[1:])
        assert len(control) < 6, reached
        stats = await (await cluster.connect()).stat()
        for k in set(range(6)) - control:
            # rank 0, the agent and the stat client just made: no other worker
            assert stats[k]["connections"] == 3, (k, stats[k])
        for _, client, on_host in done:
            await on_host.close()
            await client.close()


async def test_diloco_sends_its_momentum_shares_through_the_agent_too(caplog: pytest.LogCaptureFixture) -> None:
    """Rule diloco through the agent sends both halves of a pseudo-gradient
    through it: the plain part into the weights' mirror, the share of the
    next momentum step into a mirror of ``B``.  Three of four workers
    exchange once (no momentum step yet): ``B`` on the servers is then
    exactly the sum of their shares (``D / 4``; D integer-valued, so exact
    through the bfloat16 wire), the weights their start minus ``outer_lr``
    times it, and the agent's mirror of ``B`` counted three pushes.  The
    agent SIGKILLed, a worker says so once for both regions, and its next
    share lands in ``B`` on the servers, directly."""
    rng = np.random.default_rng(11)
    n = 4096
    start = rng.integers(-1000, 1000, n).astype(np.float32)
    async with LocalCluster(2, processes=True, capacity="64MiB") as cluster:
        agent = await AsyncAgentProcess.spawn_agent(cluster.addresses)
        try:
            client = await cluster.connect()
            on_host = [await smb2.connect([agent.endpoint]) for _ in range(4)]
            stores = [await ParameterStore.open(client, "t-agent-outer", {"w": start}, rule="diloco", lr=1.0,
                                                local_steps=1, outer_lr=0.5, workers=4, rank=r, resume=False)
                      for r in range(4)]
            for store, agent_client in zip(stores, on_host):
                assert await store.use_agent(agent_client, host_workers=4)
            grads = [rng.integers(-8, 9, n).astype(np.float32) for _ in range(3)]
            for store, g in zip(stores, grads):
                assert await store.push({"w": g})            # one inner step with lr 1: D = g
            for store in stores:
                await store.weights.flushed()               # both regions' pushes are on the servers
            shares = sum(grads) / 4
            outer = await client.attach(outer_momentum_name("t-agent-outer"))
            nbytes = stores[0].flat().nbytes
            pending = np.empty(n, np.float32)
            await outer.read_into(pending, nbytes)
            assert np.array_equal(pending, shares)
            weights = np.empty(n, np.float32)
            await stores[3].buf.read_into(weights, stores[3].data_off)
            assert np.array_equal(weights, start - 0.5 * shares)
            mirror = await on_host[0].attach(Spec(outer.name, nbytes, nbytes, "float32", "bfloat16").name)
            counters = np.empty(SLOTS, np.int64)
            await mirror.read_into(counters, STATE)
            assert counters[PUSHED_SLOT] == 3, counters

            await agent.stop(signal.SIGKILL)
            lone = stores[0]
            lone.guard.enabled = False      # (pushes of nothing, then one of g: not out of line here)
            zero = {"w": np.zeros(n, np.float32)}
            with caplog.at_level("WARNING", logger="smb2.train"):
                for _ in range(1000):                       # pushes of nothing, until the loss is seen
                    assert await lone.push(zero)
                    if lone.weights.via != "agent":
                        break
                    await asyncio.sleep(0.01)
            assert lone.weights.via == "servers (agent lost)"
            assert caplog.text.count("directly (restart smb2-agent") == 1, caplog.text
            if await lone.read_version() % 4 == 3:
                assert await lone.push(zero)                # (not the push that makes a momentum step)
            await outer.read_into(pending, nbytes)
            g = rng.integers(-8, 9, n).astype(np.float32)
            assert await lone.push({"w": g})
            after = np.empty(n, np.float32)
            await outer.read_into(after, nbytes)
            assert np.array_equal(after - pending, g / 4)
            for c in on_host:
                await c.close()
            await client.close()
        finally:
            await agent.stop()


async def _only_direct(client: smb2.Client) -> bool:
    return all(s["connections"] == 1 for s in await client.stat())


async def test_bad_mirrors_are_refused_in_the_workers_terms_and_the_agent_goes_on() -> None:
    """A missing remote buffer, a region past its end, an unsupported dtype
    and a region larger than the agent holds are each refused with an error
    that names the buffer; a remote buffer destroyed under its mirror fails
    the mirror; the agent serves a good mirror after all of them, and one of
    a buffer made after a first refusal."""
    async with LocalCluster(2, processes=True, capacity="64MiB") as cluster, \
            agent_of(cluster, "--capacity", "4MiB") as agent:
        direct = await cluster.connect()
        remote = await direct.create("weights", 4 << 20, stripe=STRIPE)
        w = await smb2.connect([agent.endpoint])
        with pytest.raises(NoSuchBuffer, match="no buffer 'late' on the memory servers"):
            await AgentMirror.open(w, "late", 0, 4096, "float32", timeout=30)
        with pytest.raises(OutOfBounds, match="runs past the end of buffer 'weights'"):
            await AgentMirror.open(w, remote, (4 << 20) - 1024, 4096, "float32", timeout=30)
        with pytest.raises(Unsupported, match="cannot mirror buffer 'weights' as float16"):
            await AgentMirror.open(w, remote, 0, 4096, "float16", timeout=30)
        with pytest.raises(OutOfMemory, match="(?s)no room for a mirror of 'weights'.*--capacity"):
            await AgentMirror.open(w, remote, 0, 3 << 20, "float32", timeout=30)

        # a mirror an older smb2 made (its header says no host workers) is refused, not misread
        old = Spec("weights", 0, 4096, "float32")
        made = await w.create(old.name, buffer_size(4096), stripe=buffer_size(4096))
        await made.write(8 * (1 + SLOTS), old.encode())
        await made.write(0, np.array([OLD_MAGIC], np.uint64))
        with pytest.raises(Unsupported, match="(?s)made by an older smb2.*same smb2 version"):
            await AgentMirror.open(w, remote, 0, 4096, "float32", timeout=30)
        await w.destroy(old.name)

        # a plain memory server takes the mirror buffer and never readies it
        plain = await cluster.connect()
        with pytest.raises(AgentTimeout, match="(?s)did not make the mirror of 'weights'.*start smb2-agent"):
            await AgentMirror.open(plain, remote, 0, 4096, "float32", timeout=0.2)

        good = await AgentMirror.open(w, remote, 8192, 4096, "float64", timeout=30)
        await good.accumulate(0, np.full(512, 3.0))
        await good.wait_forwarded(timeout=60)
        got = np.empty(512)
        await remote.read_into(got, 8192)
        assert np.array_equal(got, np.full(512, 3.0))

        # the buffer refused above, made now: the failed mirror is made again
        await direct.create("late", 4096)
        late = await AgentMirror.open(w, "late", 0, 4096, "float32", timeout=30)
        await late.accumulate(0, np.ones(1024, np.float32))
        await late.wait_forwarded(timeout=60)
        await direct.destroy("late")

        async def pushes_fail() -> bool:
            try:
                await late.accumulate(0, np.ones(1024, np.float32))
            except NoSuchBuffer as exc:
                assert "'late' is gone from the memory servers" in exc.message
                return True
            return False
        await until(pushes_fail, "a push into the mirror of a destroyed buffer fails")

        # a buffer destroyed and made again under a mirror that nobody used since (the agent finds the
        # remote buffer gone only when it next pulls or forwards): a worker that opens the mirror and pulls
        # (open_pulled, as a store does) gets one of the new buffer, not the failure of the old one
        await direct.create("again", 4096)
        kept = await AgentMirror.open(w, "again", 0, 4096, "float32", timeout=30)
        await direct.destroy("again")
        made = await direct.create("again", 4096)
        await made.write(0, np.full(1024, 5.0, np.float32))
        other = await smb2.connect([agent.endpoint])
        fresh = await AgentMirror.open_pulled(other, "again", 0, 4096, "float32", timeout=30)
        assert fresh.buffer.name == kept.buffer.name
        assert np.array_equal(await fresh.read(), np.full(1024, 5.0, np.float32))
        await fresh.accumulate(0, np.ones(1024, np.float32))
        await fresh.wait_forwarded(timeout=60)
        got = np.empty(1024, np.float32)
        await made.read_into(got, 0)
        assert np.array_equal(got, np.full(1024, 6.0, np.float32))
        await other.close()
        await w.close()


def test_help_explains_the_agent() -> None:
    done = subprocess.run([sys.executable, "-m", "smb2.agent", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    for word in ("--listen", "--servers", "--capacity", "--period", "--gather", "--auth-token-file", "SMB2_AGENT",
                 "SMB2_AUTH_TOKEN", "exactly once"):
        assert word in done.stdout, word
