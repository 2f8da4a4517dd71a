"""Every async test body runs on both event loops (asyncio, uvloop) and, through
the ``transport`` fixture, on every transport this machine offers.

``SMB2_TEST_TRANSPORTS`` (default ``tcp,shm``: the two every Linux host
offers) lists the transports to test, e.g. ``rdma`` inside the soft-RoCE VM.  A test fails if its loop logged an
unhandled exception (asyncpg's ``_testbase`` habit).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import pytest
import pytest_asyncio
import uvloop

import smb2
from smb2.torch.loop_thread import LoopThread

TRANSPORTS = [t for t in os.environ.get("SMB2_TEST_TRANSPORTS", "tcp,shm").split(",") if t]

# The soft-RoCE tier (tools/rdma_tier.sh) runs this suite again in a VM under
# TCG with SMB2_TEST_TRANSPORTS=rdma.  What it adds is the transport: so it
# runs the tests parametrized over transports (and the RDMA-only modules);
# the rest would only repeat the host run, many times slower.
RDMA_TIER = os.environ.get("SMB2_RDMA_TIER") == "1"
_RDMA_MODULES = {"test_rdma.py", "test_verbs.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not RDMA_TIER:
        return
    skip = pytest.mark.skip(reason="RDMA tier: not parametrized over transports (the host run covers it)")
    for item in items:
        if item.path.name not in _RDMA_MODULES and "transport" not in getattr(item, "fixturenames", ()):
            item.add_marker(skip)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item
                                  ) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    # a test of what a server *process* does under an attack gains nothing
    # from a second client loop, and such tests are the suite's slowest
    if item.get_closest_marker("server_process_only") is not None:
        return {"uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest_asyncio.fixture(autouse=True)
async def _fail_on_loop_errors() -> AsyncIterator[None]:
    """Fail the test if its loop's exception handler saw anything (an
    exception in a callback, a task whose error nobody retrieved)."""
    loop = asyncio.get_running_loop()
    errors: list[str] = []

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        errors.append(context.get("message", "") + (f": {exc!r}" if exc else ""))
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    yield
    await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert not errors, f"the event loop logged unhandled errors: {errors}"


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[smb2.LocalCluster]:
    async with smb2.LocalCluster(servers=4) as c:
        yield c


@pytest.fixture(scope="module")
def servers() -> Iterator[str]:
    """Two smb2-server processes for a module of ordinary (not async) tests,
    such as the torch ones ("h:p,h:p")."""
    loop = LoopThread("test-cluster")
    cluster = smb2.LocalCluster(servers=2, processes=True)
    loop.run(cluster.start())
    try:
        yield ",".join(cluster.addresses)
    finally:
        loop.run(cluster.close())
        loop.stop()


@pytest_asyncio.fixture
async def client(cluster: smb2.LocalCluster, transport: str) -> AsyncIterator[smb2.Client]:
    c = await cluster.connect(transport=transport)
    try:
        yield c
    finally:
        await c.close()
