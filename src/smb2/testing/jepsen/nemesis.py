"""The nemesis: faults on one server at a time (kill, restart, pause, partition) of a
LocalCluster or a netns cluster, healed after a random while, each noted in the history; and two
attacks on a replicated LocalCluster: ``forge`` (a view written into etcd with the servers'
stolen credentials, keeping server i alone as a member and dropping the others or moving them to
joining: the servers must write it back or take their copies back by rule) and ``flood`` (an
authenticated client sending replicated fetch_adds to server i under a fresh client id each, to
push the others' records out of its duplicate table: a retry must still never apply twice)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import time
from collections.abc import Sequence
from typing import Any

import smb2
from smb2 import _core
from smb2.errors import ErrorCode
from smb2.membership import open_membership
from smb2.protocol import FLAG_REPLICATED, Op
from smb2.server.replication import prefix

from ..replicas import Raw
from .history import History

log = logging.getLogger("smb2.testing.jepsen.nemesis")


# The nemesis

class Target:
    """What the nemesis can do to server ``i`` of a cluster."""

    nservers: int

    async def kill(self, i: int) -> None: ...
    async def restart(self, i: int) -> None: ...
    async def pause(self, i: int) -> None: ...
    async def resume(self, i: int) -> None: ...
    async def cut(self, i: int) -> None: ...
    async def mend(self, i: int) -> None: ...


class LocalTarget(Target):
    """A :class:`smb2.LocalCluster` of server processes on this host (no partitions)."""

    def __init__(self, cluster: smb2.LocalCluster) -> None:
        self.cluster = cluster
        self.nservers = cluster.nservers

    async def kill(self, i: int) -> None:
        await self.cluster.kill(i)

    async def restart(self, i: int) -> None:
        await self.cluster.restart(i)

    async def pause(self, i: int) -> None:
        os.kill(self.cluster.pid(i), signal.SIGSTOP)

    async def resume(self, i: int) -> None:
        os.kill(self.cluster.pid(i), signal.SIGCONT)

    async def forge(self, i: int, moved: bool) -> str:
        async with open_membership(str(self.cluster.membership_url), self.cluster.etcd_credentials()) as m:
            view = await m.view()
            keep = self.cluster.addresses[i]
            others = [a for a in view.members if a != keep]
            forged = await m.change(view, members=[keep], joining=others if moved else [])
        return (f"epoch {forged.epoch}: members {keep}, "
                f"{'the others joining' if moved else 'the others dropped'}")

    async def flood(self, i: int, seconds: float) -> str:
        async with await self.cluster.connect(transport="tcp") as client:
            name = "jepsen-flood"
            try:
                buf = await client.create(name, 4096 * self.nservers, stripe=4096, replicas=2)
            except smb2.BufferConflict:
                buf = await client.attach(name)
            p = buf.placement
            assert p is not None
            # a stripe whose primary is server i while every server is a member
            stripe = next(s for s in range(p.nstripes) if p.replicas_of(s)[0] == i)
            views = await client.views()
            raw = await Raw.open(self.cluster.addresses[i])
            sent = refused = 0
            try:
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    view = await views.current()
                    fresh = int.from_bytes(os.urandom(8), "little")
                    status, _ = await raw.op(Op.FETCH_ADD, buf.segments[i], p.offset_on(i, stripe),
                                             prefix(view.epoch, fresh, 1) + _core.pack_u64(1), FLAG_REPLICATED)
                    sent += 1
                    refused += status == ErrorCode.CONFLICT
            finally:
                raw.close()
        return f"{sent} fetch_adds under fresh client ids, {refused} refused"


class NetnsTarget(Target):
    """A cluster of smb2.testing.netns: every server and client its own host.  ``cut(i)``
    partitions server i together with the first client host ("c") from every other host (the
    other servers, the other clients, etcd): the old primary and a client of it on a minority side."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.nservers = cluster.n

    async def kill(self, i: int) -> None:
        await asyncio.to_thread(self.cluster.kill_server, i)

    async def restart(self, i: int) -> None:
        # in this thread, which outlives the run: a server dies with the thread that started it
        # (PR_SET_PDEATHSIG), and asyncio.to_thread's threads end with the loop
        self.cluster.restart_server(i)

    async def pause(self, i: int) -> None:
        self.cluster.signal_server(i, signal.SIGSTOP)

    async def resume(self, i: int) -> None:
        self.cluster.signal_server(i, signal.SIGCONT)

    async def cut(self, i: int) -> None:
        minority = {f"s{i}", "c"}
        for side in minority:
            for other in self.cluster.hosts:
                if other not in minority:
                    await asyncio.to_thread(self.cluster.cut, side, other)

    async def mend(self, i: int) -> None:
        await asyncio.to_thread(self.cluster.heal)


class Nemesis:
    """Every ``interval`` seconds (jittered), one fault on one random server, healed after a random
    while; at most one server is faulty at a time (what replicas=2 promises to survive)."""

    def __init__(self, target: Target, choices: Sequence[str], history: History, *, interval: float,
                 fault_time: tuple[float, float] = (1.0, 5.0), first: int | None = None) -> None:
        self.target = target
        self.first = first      # the server the first fault, a kill, hits (else a random one)
        self.choices = list(choices)
        self.history = history
        self.interval = interval
        self.fault_time = fault_time
        self.rng = random.Random(history.seed + 1)

    def note(self, what: str) -> None:
        self.history.nemesis.append((time.monotonic(), what))
        log.info("nemesis: %s", what)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set() and self.choices:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.rng.uniform(0.5, 1.5) * self.interval)
                return
            what, i = self.rng.choice(self.choices), self.rng.randrange(self.target.nservers)
            if self.first is not None:
                what, i, self.first = "kill", self.first, None
            await self.fault(what, i, self.rng.uniform(*self.fault_time))

    async def fault(self, what: str, i: int, hold: float) -> None:
        t = self.target
        if what in ("forge", "flood"):
            # run_netns refuses them: they need a LocalCluster's etcd credentials and client
            assert isinstance(t, LocalTarget), what
            self.note(f"{what} server {i}")
            said = await (t.forge(i, self.rng.random() < 0.5) if what == "forge" else t.flood(i, hold))
            self.note(f"{what} server {i} done: {said}")
            return
        start, heal = {"kill": (t.kill, t.restart), "restart": (t.kill, t.restart),
                       "pause": (t.pause, t.resume), "partition": (t.cut, t.mend)}[what]
        self.note(f"{what} server {i}")
        await start(i)
        try:
            if what != "restart":           # restart: killed and started again at once
                await asyncio.sleep(hold)
        finally:
            await heal(i)
            self.note(f"healed server {i} ({what})")
