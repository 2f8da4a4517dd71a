"""The clients: ``processes`` clients issuing random accumulates, fetch-adds, reads and
lock-protected read-modify-writes against one buffer, each recorded with its outcome."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

import smb2

from .history import BUFFER, FAIL, LOCK, OK, STRIPE, UNKNOWN, Final, History, Layout, Op

log = logging.getLogger("smb2.testing.jepsen.workloads")


# errors that prove an operation was not applied: a refused fence, a buffer or handle the server
# does not know (restarted empty), a lock not granted in time
_NOT_APPLIED = (smb2.StaleFence, smb2.NoSuchBuffer, smb2.BufferDamaged, smb2.LockTimeout,
                smb2.InvalidArgumentError)



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
