"""Deadlines (issue 14): every client operation takes ``timeout=``, the
client a default (``connect(..., op_timeout=)``).  A real smb2-server
process that is alive but silent (SIGSTOP) costs an operation its deadline,
not forever; the connection is reset and the next operation reconnects."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest

import smb2


@asynccontextmanager
async def _stopped(cluster: smb2.LocalCluster, index: int) -> AsyncIterator[None]:
    os.kill(cluster.pid(index), signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(cluster.pid(index), signal.SIGCONT)


async def _times_out(op: Callable[[], Awaitable[Any]], deadline: float) -> float:
    """``op`` fails by its deadline: OperationTimeout naming the deadline, not
    before it; or, when it shares a reconnection attempt that gives up first,
    TransportError.  Its own deadline is what ends it: the 30 s around it is a
    hang guard (a deadline that never fires meets it as a plain TimeoutError)."""
    t0 = time.monotonic()
    with pytest.raises(smb2.TransportError) as err:
        await asyncio.wait_for(op(), 30)
    took = time.monotonic() - t0
    if isinstance(err.value, smb2.OperationTimeout):
        assert isinstance(err.value, TimeoutError) and "reset" in str(err.value)
        assert f"did not complete within {deadline} s" in str(err.value), err.value
        # a loaded machine only makes it later (the allowance is the loop clock's resolution)
        assert took > deadline - 0.01, f"{took:.3f} s for a deadline of {deadline} s"
    else:
        assert "did not answer hello" in str(err.value)
    return took


async def test_a_stopped_server_costs_each_operation_its_deadline_then_it_reconnects() -> None:
    async with smb2.LocalCluster(servers=2, processes=True, capacity="16MiB") as cluster:
        # over TCP: a shm client reads and writes the mapped memory itself, so
        # a stopped server costs its reads nothing (test_shm covers shm's deaths)
        client = await smb2.connect(cluster.addresses, timeout=2, op_timeout=0.5, transport="tcp")
        try:
            buf = await client.create("p", 1 << 20, stripe=64 << 10)
            await buf.write(0, b"before")
            link = client.links[1]
            first = link.open
            async with _stopped(cluster, 1):
                # the client's default deadline, and one given per call
                with pytest.raises(smb2.OperationTimeout):
                    await buf.read(0, buf.nbytes)
                took = await _times_out(lambda: buf.read(0, buf.nbytes), 0.5)
                print(f"\nread of a stopped server: OperationTimeout after {took:.2f} s (deadline 0.5 s)")
                assert link.open is None                      # reset
                await _times_out(lambda: buf.write(0, b"x" * buf.nbytes, timeout=0.3), 0.3)
                await _times_out(lambda: buf.accumulate(0, np.ones(buf.nbytes // 4, np.float32)), 0.5)
                await _times_out(lambda: client.stat(timeout=0.3), 0.3)
                await _times_out(lambda: client.attach("p"), 0.5)
                await _times_out(lambda: client.create("q", 64, stripe=64), 0.5)
                # the server that is alive answers within its deadline meanwhile
                on_0 = next(o for o in range(0, buf.nbytes, buf.stripe)
                            if (buf.first + o // buf.stripe) % 2 == 0)
                await buf.fetch_add(on_0, 1, timeout=2)
            # the next operation reconnects and works
            assert bytes(await buf.read(0, 6)) == b"before"
            assert link.open is not None and link.open is not first
            assert (await client.stat())[1]["connections"] >= 1
        finally:
            await client.close()


async def test_timeouts_are_checked(cluster: smb2.LocalCluster) -> None:
    client = await cluster.connect()
    buf = await client.create("t", 64, stripe=64)
    for bad in (0, -1, "1", True):
        with pytest.raises(smb2.InvalidArgumentError, match="timeout"):
            await buf.read(0, 8, timeout=bad)
    with pytest.raises(smb2.InvalidArgumentError, match="timeout"):
        await smb2.connect(cluster.addresses, op_timeout=-1)
    # a generous deadline changes nothing for a healthy server
    await buf.write(0, b"12345678", timeout=5)
    assert bytes(await buf.read(0, 8, timeout=5)) == b"12345678"
    assert await buf.fetch_add(8, 2, timeout=5) == 0
    assert await buf.compare_swap(8, 2, 3, timeout=5) == 2
