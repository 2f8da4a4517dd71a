#!/usr/bin/env python3
"""A Jepsen-style test of smb2 under faults: a history of concurrent operations, a nemesis, a checker.

Concurrent client processes (each its own :class:`smb2.Client`) issue, against one buffer:

* ``accumulate``: add a known positive int64 increment to one of several counters (one counter
  per stripe, so every server holds some);
* ``fetch_add``: add 1 to one word, whose old values must all differ;
* ``read``: read a counter;
* ``lock_rmw``: take the lock, read a ``[value, token]`` record, write ``[value + 1, token]`` back
  with a *fenced* write, release.  With ``--replicas`` above 1 the lock is a replicated one
  (``client.replicated_lock``), kept on that many servers, and ``--aim-lock`` makes the nemesis's
  first fault a SIGKILL of the lock's server.

Every invocation and its outcome -- ``ok``, ``fail`` (the error proves it was not applied) or
``unknown`` (a timeout, a lost connection: it may or may not have been applied) -- is recorded
with ``time.monotonic()`` timestamps.  Meanwhile a seeded nemesis kills (SIGKILL) and restarts
servers, pauses them (SIGSTOP/SIGCONT) and -- in the netns harness (``--netns``), where every
server is its own host behind a link -- cuts a server's link.  At the end everything is healed,
and a fresh client reads the final state.

The checker (plain functions over the history: :func:`check`) then asserts:

* every counter's final value == the sum of its acknowledged increments plus a subset of its
  unknown ones (an exact subset-sum check);
* every read of a counter lies between the acknowledged increments completed before it began
  and all increments (acknowledged or unknown) begun before it ended;
* fetch_add results are unique and the final word accounts for every acknowledged one;
* no two lock holders whose fenced writes were acknowledged held the lock at overlapping times,
  their fencing tokens grow with time, and every read inside the lock saw every acknowledged
  write of the holders before it (no lost update).

Usage::

    python tools/jepsen.py --seed 7 --duration 60 --servers 3 --replicas 2 --nemesis kill,pause
    python tools/jepsen.py --netns --nemesis kill,pause,partition --duration 120
    python tools/jepsen.py --replicas 1 --nemesis kill --no-data-dir      # today's replicas=1 picture

Prints the violations (and the seed) and exits 1 if there are any; ``--history FILE`` keeps the
history as JSON lines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import smb2
from smb2 import _core

sys.path.insert(0, str(Path(__file__).resolve().parent))     # netns_cluster beside this file

log = logging.getLogger("smb2.jepsen")

OK, FAIL, UNKNOWN = "ok", "fail", "unknown"
NEMESES = ("kill", "pause", "restart", "partition")
BUFFER = "jepsen"
LOCK = "jepsen-lock"
STRIPE = 4096
# errors that prove an operation was not applied: a refused fence, a buffer or handle the server
# does not know (restarted empty), a lock not granted in time
_NOT_APPLIED = (smb2.StaleFence, smb2.NoSuchBuffer, smb2.BufferDamaged, smb2.LockTimeout,
                smb2.InvalidArgumentError)


@dataclass
class Op:
    """One invocation and its outcome."""

    process: int
    kind: str                       # accumulate | fetch_add | read | lock_rmw | final
    key: int = 0                    # the counter (accumulate, read)
    value: int = 0                  # the increment (accumulate, fetch_add)
    invoke: float = 0.0             # time.monotonic() when it was invoked
    complete: float = 0.0           # ... when its outcome was known
    outcome: str = UNKNOWN
    result: Any = None              # read: the value; fetch_add: the old value; lock_rmw: see below
    error: str = ""
    # lock_rmw: the token, when the lock was held (acquired .. about to release), the value read,
    # and the outcome of the fenced write (the op's outcome; unknown where the write was
    # acknowledged after the holder learned it had lost the lock: it landed, unprotected)
    token: int | None = None
    held: tuple[float, float] | None = None


@dataclass
class Layout:
    """Where each kind of word lives in the buffer (one stripe each, so every server holds some)."""

    counters: int

    @property
    def nbytes(self) -> int:
        return (self.counters + 2) * STRIPE

    def counter(self, k: int) -> int:
        return k * STRIPE

    @property
    def fetch_add_word(self) -> int:
        return self.counters * STRIPE

    @property
    def record(self) -> int:        # [value, token] of the lock-protected read-modify-write
        return (self.counters + 1) * STRIPE


@dataclass
class Final:
    """The state read after the run (None: it could not be read, and why)."""

    counters: list[int] | None = None
    fetch_add: int | None = None
    record: int | None = None
    error: str = ""


@dataclass
class History:
    seed: int
    ops: list[Op] = field(default_factory=list)
    final: Final = field(default_factory=Final)
    nemesis: list[tuple[float, str]] = field(default_factory=list)

    def dump(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            f.write(json.dumps({"seed": self.seed, "final": asdict(self.final), "nemesis": self.nemesis}) + "\n")
            for op in self.ops:
                f.write(json.dumps(asdict(op)) + "\n")


# ---------------------------------------------------------------------------------------------
# The checker: plain functions over a history, each returning its violations in words

def _subset_sums(values: Sequence[int]) -> int:
    """A bitset (a Python int) whose bit s is set if some subset of ``values`` sums to s."""
    sums = 1
    for v in values:
        sums |= sums << v
    return sums


def check_counters(ops: Sequence[Op], final: Final) -> list[str]:
    """Each counter's final value == its acknowledged increments + a subset of its unknown ones."""
    if final.counters is None:
        return [f"the counters could not be read after the run: {final.error}"]
    out = []
    for k, got in enumerate(final.counters):
        incs = [op for op in ops if op.kind == "accumulate" and op.key == k]
        acked = sum(op.value for op in incs if op.outcome == OK)
        unknown = [op.value for op in incs if op.outcome == UNKNOWN]
        extra = got - acked
        if extra < 0:
            out.append(f"counter {k}: final {got}, but {acked} was acknowledged: "
                       f"{-extra} of acknowledged increments lost")
        elif not (_subset_sums(unknown) >> extra) & 1:
            out.append(f"counter {k}: final {got} = acknowledged {acked} + {extra}, which no subset of the "
                       f"{len(unknown)} unknown increments (sum {sum(unknown)}) makes: applied twice or invented")
    return out


def check_reads(ops: Sequence[Op]) -> list[str]:
    """A read of a counter returns acknowledged data: at least every increment acknowledged before
    it began, at most every increment (not refused) begun before it ended."""
    out = []
    incs: dict[int, list[Op]] = {}
    for op in ops:
        if op.kind == "accumulate" and op.outcome != FAIL:
            incs.setdefault(op.key, []).append(op)
    for op in ops:
        if op.kind != "read" or op.outcome != OK:
            continue
        mine = incs.get(op.key, [])
        low = sum(i.value for i in mine if i.outcome == OK and i.complete < op.invoke)
        high = sum(i.value for i in mine if i.invoke < op.complete)
        if not low <= op.result <= high:
            what = "lost acknowledged increments" if op.result < low else "returned data never written"
            out.append(f"read of counter {op.key} by process {op.process} at {op.invoke:.3f}: {op.result}, "
                       f"outside [{low}, {high}]: {what}")
    return out


def check_fetch_adds(ops: Sequence[Op], final: Final) -> list[str]:
    """fetch_add results are unique; the final word counts every acknowledged one."""
    out = []
    adds = [op for op in ops if op.kind == "fetch_add"]
    results = Counter(op.result for op in adds if op.outcome == OK)
    dups = sorted(r for r, n in results.items() if n > 1)
    if dups:
        out.append(f"fetch_add returned the same old value more than once: {dups[:10]}"
                   f"{' ...' if len(dups) > 10 else ''} ({len(dups)} values)")
    acked = sum(results.values())
    unknown = sum(1 for op in adds if op.outcome == UNKNOWN)
    if final.fetch_add is None:
        out.append(f"the fetch_add word could not be read after the run: {final.error}")
    elif not acked <= final.fetch_add <= acked + unknown:
        out.append(f"fetch_add word: final {final.fetch_add}, outside [{acked}, {acked + unknown}] "
                   f"({acked} acknowledged, {unknown} unknown)")
    elif results and max(results) >= final.fetch_add:
        out.append(f"fetch_add returned {max(results)}, but the final word is {final.fetch_add}")
    return out


def check_lock(ops: Sequence[Op], final: Final) -> list[str]:
    """Holders whose fenced writes were acknowledged never overlap, their tokens grow with time,
    and each read under the lock saw every acknowledged write before it (no lost update)."""
    out = []
    sections = sorted((op for op in ops if op.kind == "lock_rmw" and op.held is not None),
                      key=lambda op: op.held[0])  # type: ignore[index]
    acked = [op for op in sections if op.outcome == OK]
    for a, b in zip(acked, acked[1:]):
        assert a.held is not None and b.held is not None
        if b.held[0] < a.held[1]:
            out.append(f"lock held by process {a.process} (token {a.token}) over [{a.held[0]:.3f}, "
                       f"{a.held[1]:.3f}] and by process {b.process} (token {b.token}) from {b.held[0]:.3f}: "
                       "overlapping critical sections")
        elif a.token is not None and b.token is not None and not a.token < b.token:
            out.append(f"fencing tokens went backwards: {a.token} then {b.token}")
    by_token = sorted((op for op in sections if op.token is not None), key=lambda op: op.token)  # type: ignore
    ok_before = unknown_before = 0
    # after one lost (or phantom) update every later read is off by it too: count each once
    shift = 0
    for op in by_token:
        low, high = ok_before + shift, ok_before + unknown_before + shift
        if op.result is not None and not low <= op.result <= high:
            out.append(f"process {op.process} (token {op.token}, held from {op.held[0]:.3f}) read {op.result} "  # type: ignore
                       f"under the lock, outside [{low}, {high}]: "
                       + ("an acknowledged update was lost" if op.result < low else "a phantom update"))
            shift += op.result - (low if op.result < low else high)
        ok_before += op.outcome == OK
        unknown_before += op.outcome == UNKNOWN
    if final.record is None:
        out.append(f"the lock-protected record could not be read after the run: {final.error}")
    elif not ok_before <= final.record <= ok_before + unknown_before:
        out.append(f"lock-protected record: final {final.record}, outside [{ok_before}, "
                   f"{ok_before + unknown_before}] ({ok_before} acknowledged read-modify-writes)")
    return out


def check(history: History) -> list[str]:
    """Every violation the history shows (empty: it is consistent)."""
    return (check_counters(history.ops, history.final) + check_reads(history.ops)
            + check_fetch_adds(history.ops, history.final) + check_lock(history.ops, history.final))


def summary(history: History) -> str:
    outcomes = Counter((op.kind, op.outcome) for op in history.ops)
    kinds = sorted({k for k, _ in outcomes})
    return "; ".join(f"{k}: " + ", ".join(f"{outcomes[k, o]} {o}" for o in (OK, FAIL, UNKNOWN) if outcomes[k, o])
                     for k in kinds)


# ---------------------------------------------------------------------------------------------
# The clients

def _outcome(exc: BaseException) -> str:
    return FAIL if isinstance(exc, _NOT_APPLIED) else UNKNOWN


class Workload:
    """``processes`` clients issuing random operations until ``stop`` is set."""

    def __init__(self, connect: Callable[[], Awaitable[smb2.Client]], history: History, *, processes: int,
                 layout: Layout, replicas: int, op_timeout: float, lock_lease: float | None = None) -> None:
        self.connect = connect
        self.history = history
        self.processes = processes
        self.layout = layout
        self.replicas = replicas
        self.op_timeout = op_timeout
        self.lock_lease = lock_lease
        self.stop = asyncio.Event()

    async def create(self, client: smb2.Client) -> smb2.Buffer:
        # replicas= only where asked: replicas=1 runs against a client without the option too
        extra: dict[str, Any] = {"replicas": self.replicas} if self.replicas > 1 else {}
        buf = await client.create(BUFFER, self.layout.nbytes, stripe=STRIPE, timeout=self.op_timeout, **extra)
        if self.replicas > 1:
            # the replicated lock's words are a replicated buffer, made (like any) while every
            # server is up: its first use makes it
            lock = client.replicated_lock(LOCK, self.replicas, lease=self.lock_lease)
            await lock.acquire(timeout=self.op_timeout)
            await lock.release()
        return buf

    async def setup(self) -> None:
        """Make the buffer (and the replicated lock), before any fault."""
        setup = await self.connect()
        try:
            await self.create(setup)
        finally:
            await setup.close()

    async def run(self) -> None:
        await asyncio.gather(*(self.process(p) for p in range(self.processes)))

    async def process(self, p: int) -> None:
        rng = random.Random(self.history.seed * 1000 + p)
        while True:     # a server may be down right now: go on trying until the end
            try:
                client = await self.connect()
            except smb2.Smb2Error:
                if self.stop.is_set():
                    return
                await asyncio.sleep(0.2)
                continue
            try:
                buf = await client.attach(BUFFER, timeout=self.op_timeout)
                break
            except smb2.Smb2Error:
                await client.close()
                if self.stop.is_set():
                    return
                await asyncio.sleep(0.2)
        try:
            # a lock that outlives its server where the buffer does
            lock: smb2.Lock | smb2.ReplicatedLock = (
                client.replicated_lock(LOCK, self.replicas, lease=self.lock_lease) if self.replicas > 1
                else client.lock(LOCK))
            while not self.stop.is_set():
                kind = rng.choices(("accumulate", "fetch_add", "read", "lock_rmw"), (4, 2, 2, 2))[0]
                if kind == "lock_rmw":
                    await self.lock_rmw(p, buf, lock)
                else:
                    await self.one(p, kind, buf, rng)
                if self.history.ops[-1].error.startswith("StaleHandle"):
                    # a server came back with new segments: look the buffer up again, as a user would
                    with contextlib.suppress(smb2.Smb2Error):
                        buf = await client.attach(BUFFER, timeout=self.op_timeout)
                await asyncio.sleep(rng.uniform(0, 0.005))
        finally:
            with contextlib.suppress(Exception):
                await client.close()

    async def one(self, p: int, kind: str, buf: smb2.Buffer, rng: random.Random) -> None:
        op = Op(p, kind)
        t = self.op_timeout
        call: Awaitable[Any]
        if kind == "accumulate":
            op.key, op.value = rng.randrange(self.layout.counters), rng.randint(1, 1000)
            call = buf.accumulate(self.layout.counter(op.key), np.array([op.value], np.int64), timeout=t)
        elif kind == "fetch_add":
            op.value = 1
            call = buf.fetch_add(self.layout.fetch_add_word, 1, timeout=t)
        else:
            op.key = rng.randrange(self.layout.counters)
            call = buf.read(self.layout.counter(op.key), 8, timeout=t)
        self.history.ops.append(op)
        op.invoke = time.monotonic()
        try:
            result: Any = await call
        except Exception as exc:        # every failure is an outcome to record, not a crash
            op.outcome, op.error = _outcome(exc), f"{type(exc).__name__}: {exc}".splitlines()[0]
        else:
            op.outcome = OK
            op.result = int(result.view(np.int64)[0]) if kind == "read" else result
        op.complete = time.monotonic()

    async def lock_rmw(self, p: int, buf: smb2.Buffer, lock: smb2.Lock | smb2.ReplicatedLock) -> None:
        op = Op(p, "lock_rmw")
        self.history.ops.append(op)
        op.invoke = time.monotonic()
        try:
            await lock.acquire(timeout=self.op_timeout)
        except Exception as exc:        # not held: nothing was written
            op.outcome, op.error = FAIL, f"acquire: {type(exc).__name__}: {exc}".splitlines()[0]
            op.complete = time.monotonic()
            return
        start = time.monotonic()
        op.token = lock.token
        try:
            record = await buf.read(self.layout.record, 16, timeout=self.op_timeout)
            op.result = int(record.view(np.int64)[0])
            op.outcome = UNKNOWN          # from here on the write may land
            await buf.write(self.layout.record, np.array([op.result + 1, op.token or 0], np.int64), fence=lock,
                            timeout=self.op_timeout)
            if lock.locked():
                op.outcome = OK
            else:
                op.error = "the lock was lost before the fenced write was acknowledged"
        except Exception as exc:
            op.outcome = UNKNOWN if op.outcome == UNKNOWN and not isinstance(exc, _NOT_APPLIED) else FAIL
            op.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        finally:
            op.held = (start, time.monotonic())
            with contextlib.suppress(Exception):
                await asyncio.wait_for(lock.release(), self.op_timeout)
            op.complete = time.monotonic()

    async def read_final(self, settle: float) -> Final:
        """The state after the run, read by a fresh client (retrying for ``settle`` seconds)."""
        deadline = time.monotonic() + settle
        error = ""
        while True:
            try:
                client = await self.connect()
                try:
                    return await self._read_final(client)
                finally:
                    await client.close()
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, smb2.BufferDamaged) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
        # what is left: the parts that survived, the lost ones as zeros (the user's recovery)
        final = Final(error=error)
        with contextlib.suppress(Exception):
            client = await self.connect()
            try:
                buf = await client.create(BUFFER, self.layout.nbytes, stripe=STRIPE, recreate_lost=True,
                                          timeout=self.op_timeout)
                final = await self._read_final(client, buf)
                final.error = error
            finally:
                await client.close()
        return final

    async def _read_final(self, client: smb2.Client, buf: smb2.Buffer | None = None) -> Final:
        buf = buf or await client.attach(BUFFER, timeout=self.op_timeout)
        words = (await buf.read(0, self.layout.nbytes, timeout=self.op_timeout)).view(np.int64)
        per = STRIPE // 8
        return Final(counters=[int(words[k * per]) for k in range(self.layout.counters)],
                     fetch_add=int(words[self.layout.fetch_add_word // 8]),
                     record=int(words[self.layout.record // 8]))


# ---------------------------------------------------------------------------------------------
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


class NetnsTarget(Target):
    """A cluster of tools/netns_cluster.py: every server and client its own host.  ``cut(i)``
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


# ---------------------------------------------------------------------------------------------
# One run

@dataclass
class Settings:
    seed: int = 1
    clients: int = 2                # netns: client hosts (processes are spread over them)
    duration: float = 10.0
    servers: int = 3
    replicas: int = 1
    processes: int = 4
    nemesis: tuple[str, ...] = ("kill", "pause")
    interval: float = 2.0
    fault_time: tuple[float, float] = (1.0, 5.0)    # how long a fault lasts (longer than op_timeout: some bite)
    op_timeout: float = 3.0
    settle: float = 10.0
    data_dir: bool = True
    transport: str = "tcp"
    aim_lock: bool = False          # the first fault kills the lock's server (replicas > 1)
    lock_lease: float | None = None     # the replicated lock's lease (None: its default)


def lock_server(servers: int) -> int:
    """The server that holds the replicated lock's words first (replica 0 of its buffer's only
    stripe, the primary while every server is a member)."""
    return _core.name_hash("lock:" + LOCK) % servers


async def run_local(s: Settings) -> History:
    """One run against a LocalCluster of server processes on this host."""
    if "partition" in s.nemesis:
        raise SystemExit("partitions need the netns harness: add --netns")
    history = History(s.seed)
    with tempfile.TemporaryDirectory(prefix="smb2-jepsen-") as tmp:
        cluster = smb2.LocalCluster(servers=s.servers, processes=True, replicated=s.replicas > 1,
                                    data_dir=tmp if s.data_dir else None, capacity="64MiB")
        async with cluster:
            async def connect() -> smb2.Client:
                return await cluster.connect(transport=s.transport, timeout=s.op_timeout)
            await _run(s, history, connect, LocalTarget(cluster))
    return history


async def _run(s: Settings, history: History, connect: Callable[[], Awaitable[smb2.Client]],
               target: Target) -> None:
    work = Workload(connect, history, processes=s.processes, layout=Layout(counters=2 * s.servers),
                    replicas=s.replicas, op_timeout=s.op_timeout, lock_lease=s.lock_lease)
    nemesis = Nemesis(target, s.nemesis, history, interval=s.interval, fault_time=s.fault_time,
                      first=lock_server(s.servers) if s.aim_lock else None)
    await work.setup()
    clients = asyncio.ensure_future(work.run())
    faults = asyncio.ensure_future(nemesis.run(work.stop))
    try:
        await asyncio.wait([clients], timeout=s.duration)
    finally:
        work.stop.set()
        await asyncio.gather(faults, return_exceptions=True)
    await clients
    history.final = await work.read_final(s.settle)


def run_netns(s: Settings) -> History:
    """One run in the netns harness: every server, every client host and etcd its own host; the
    client processes run as workers (``--worker``) on the client hosts, the nemesis here."""
    import netns_cluster

    ok, why = netns_cluster.can_run()
    if not ok:
        raise netns_cluster.NotSupported(why)
    history = History(s.seed)
    cmd = list(netns_cluster.DEFAULT_SERVER_CMD)
    with contextlib.ExitStack() as stack:
        if s.data_dir:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="smb2-jepsen-"))
            cmd += ["--data-dir", os.path.join(tmp, "s{index}")]
        cluster = stack.enter_context(netns_cluster.NetnsCluster(
            servers=s.servers, rate=None, capacity="64MiB", server_cmd=cmd, quiet=True, handle_signals=False,
            ready_timeout=20, clients=s.clients, etcd=s.replicas > 1))
        worker = [sys.executable, str(Path(__file__).resolve()), "--worker"]

        def start_worker(host: str, role: str, processes: Sequence[int] = ()) -> subprocess.Popen:
            job = json.dumps({"role": role, "processes": list(processes), "settings": asdict(s)})
            p = cluster.popen_client(worker + [job], host=host, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
            return p

        def ready(p: subprocess.Popen) -> None:
            assert p.stdout is not None
            if p.stdout.readline().strip() != b"ready":     # smb2 imported, the buffer made: the slow part
                p.kill()            # finish_worker says why

        def go(p: subprocess.Popen) -> None:
            assert p.stdin is not None
            with contextlib.suppress(OSError):
                p.stdin.write(b"go\n")
                p.stdin.flush()

        def finish_worker(p: subprocess.Popen) -> list[Any]:
            out, err = p.communicate(timeout=s.duration + 10 * s.op_timeout + s.settle + 60)
            if p.returncode != 0:
                raise RuntimeError(f"jepsen worker {p.pid} failed ({p.returncode}): "
                                   f"{err.decode(errors='replace')[-3000:]}")
            return [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]

        def run_worker(host: str, role: str) -> list[Any]:
            p = start_worker(host, role)
            ready(p)
            go(p)
            return finish_worker(p)

        hosts = cluster.client_hosts
        workers = [start_worker(h, "process", range(k, s.processes, len(hosts))) for k, h in enumerate(hosts)]
        for p in workers:
            ready(p)
        for p in workers:       # all at once, with the nemesis
            go(p)

        async def clients_and_nemesis() -> list[list[Any]]:
            stop = asyncio.Event()
            nemesis = asyncio.ensure_future(
                Nemesis(NetnsTarget(cluster), s.nemesis, history, interval=s.interval, fault_time=s.fault_time,
                        first=lock_server(s.servers) if s.aim_lock else None).run(stop))
            try:
                return list(await asyncio.gather(*(asyncio.to_thread(finish_worker, p) for p in workers)))
            finally:
                stop.set()
                await nemesis

        for records in asyncio.run(clients_and_nemesis()):
            history.ops += [Op(**{**r, "held": tuple(r["held"]) if r["held"] else None}) for r in records]
        cluster.heal()
        (final,) = run_worker(hosts[-1], "final")
        history.final = Final(**final)
    return history


async def worker(job: dict[str, Any]) -> None:
    """A client host's part of a netns run: make the buffer (every client host: create is
    idempotent), say "ready", wait for "go", then print what it did as JSON lines."""
    s = Settings(**{**job["settings"], "nemesis": tuple(job["settings"]["nemesis"]),
                    "fault_time": tuple(job["settings"]["fault_time"])})
    history = History(s.seed)

    async def connect() -> smb2.Client:
        return await smb2.connect(transport=s.transport, timeout=s.op_timeout)

    work = Workload(connect, history, processes=s.processes, layout=Layout(counters=2 * s.servers),
                    replicas=s.replicas, op_timeout=s.op_timeout, lock_lease=s.lock_lease)
    if job["role"] == "process":
        client = await connect()
        try:
            await work.create(client)
        finally:
            await client.close()
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)         # "go"
    if job["role"] == "final":
        print(json.dumps(asdict(await work.read_final(s.settle))), flush=True)
    else:
        asyncio.get_running_loop().call_later(s.duration, work.stop.set)
        await asyncio.gather(*(work.process(p) for p in job["processes"]))
        for op in history.ops:
            print(json.dumps(asdict(op)), flush=True)


def report(history: History, violations: list[str]) -> str:
    lines = [f"jepsen seed {history.seed}: {len(history.ops)} operations ({summary(history)}); "
             f"{sum(1 for _, w in history.nemesis if not w.startswith('healed'))} faults"]
    lines += [f"  nemesis {w}" for _, w in history.nemesis]
    errors = Counter(f"{op.kind} {op.outcome}: {op.error[:100]}" for op in history.ops if op.outcome != OK)
    lines += [f"  {n} x {what}" for what, n in errors.most_common(5)]
    if history.final.error:
        lines.append(f"  the final read first failed: {history.final.error.splitlines()[0]}")
    if violations:
        lines.append(f"{len(violations)} violation(s) (seed {history.seed}):")
        lines += [f"  {v}" for v in violations]
    else:
        lines.append("no violation")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of operations (default 60)")
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--processes", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--nemesis", default="kill,pause",
                   help=f"comma-separated faults among {','.join(NEMESES)}, or none (default kill,pause)")
    p.add_argument("--interval", type=float, default=3.0, help="mean seconds between faults (default 3)")
    p.add_argument("--op-timeout", type=float, default=3.0)
    p.add_argument("--fault-time", default="1,5", metavar="MIN,MAX",
                   help="seconds a fault lasts, uniformly drawn (default 1,5)")
    p.add_argument("--no-data-dir", action="store_true", help="servers restart empty (no --data-dir)")
    p.add_argument("--transport", default="tcp")
    p.add_argument("--netns", action="store_true",
                   help="every server its own host (tools/netns_cluster.py; needs root); allows partition")
    p.add_argument("--clients", type=int, default=2, help="netns: client hosts (default 2)")
    p.add_argument("--aim-lock", action="store_true",
                   help="the first fault is a SIGKILL of the replicated lock's server (with --replicas 2+)")
    p.add_argument("--history", metavar="FILE", help="write the history as JSON lines")
    p.add_argument("--worker", metavar="JOB", help=argparse.SUPPRESS)
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if a.worker:
        asyncio.run(worker(json.loads(a.worker)))
        return 0
    choices = () if a.nemesis == "none" else tuple(a.nemesis.split(","))
    bad = [c for c in choices if c not in NEMESES]
    if bad:
        p.error(f"unknown nemesis {bad}: choose among {','.join(NEMESES)}")
    s = Settings(seed=a.seed, duration=a.duration, servers=a.servers, replicas=a.replicas,
                 processes=a.processes, nemesis=choices, interval=a.interval, op_timeout=a.op_timeout,
                 data_dir=not a.no_data_dir, transport=a.transport, clients=a.clients, aim_lock=a.aim_lock,
                 fault_time=tuple(float(x) for x in a.fault_time.split(",", 1)))  # type: ignore[arg-type]
    if a.netns:
        history = run_netns(s)
    else:
        history = asyncio.run(run_local(s))
    if a.history:
        history.dump(a.history)
    violations = check(history)
    print(report(history, violations), flush=True)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
