"""Which event loops and transports each async test runs on, and how the
suite runs in parallel.

**Transports.**  The ``transport`` fixture runs a test on every transport
this machine offers: ``SMB2_TEST_TRANSPORTS`` (default ``tcp,shm``, the two
every Linux host offers), e.g. ``rdma`` inside the soft-RoCE VM.

**Event loops.**  uvloop, the loop smb2 runs on (``smb2-server``, the
training layer's loop thread, the demo), runs every async test.  The plain
asyncio loop, which a user's own program may run, behaves differently only
in code that talks to the loop: the transports (asyncio protocols,
``add_reader``, ``sock_*``, flow control), the client's links and deadlines,
the in-process server's connections (``server/memory.py`` has a uvloop
branch), the lock's timers and parked waits, notifications.  So asyncio runs
the modules of ``BOTH_LOOPS_MODULES``, which test exactly that code, and
over the tcp transport only there, because what the shm transport does on
the loop (claiming segment fds on the server's Unix socket, futex waits,
the fast path) is the subject of ``test_shm*.py``, which run on both loops.
The other modules (the training layer, persistence, authentication, metrics,
server processes under attack) use the client as any program would: a
second loop would repeat them without reaching loop-specific code.  A test
elsewhere that does reach it takes ``@pytest.mark.both_loops``; one in a
listed module that is about a server process takes
``@pytest.mark.server_process_only`` (uvloop only).  The soft-RoCE tier
(``SMB2_RDMA_TIER=1``) keeps both loops everywhere: the rdma transport
waits for completions through ``loop.add_reader``.  ``SMB2_TEST_ALL_LOOPS=1``
runs every async test on both loops and every transport, as before.

**The soft-RoCE tier** (tools/rdma_tier.sh) runs this suite again in a VM
under TCG with ``SMB2_TEST_TRANSPORTS=rdma``.  What it adds is the
transport: it runs the tests parametrized over transports (and the
RDMA-only modules); the rest would only repeat the host run, many times
slower.

**In parallel.**  ``make pytest`` runs the host suite on pytest-xdist
workers (``-n auto --dist load``).  Every test makes its own servers on
free ports, network namespaces named after its process, memfds and sockets
named after its process, so tests do not collide.  A module whose tests
share a module-scoped fixture that is shared state (test_wheel: one built
and installed wheel; test_slurm: the machine's one Slurm cluster, which one
worker's teardown would stop under another's job) is marked ``alone``:
pytest-xdist's ``--dist loadgroup`` cannot keep a module on one worker under
pytest 9 (its ``xdist_group`` suffix no longer changes a test's id;
measured: a group's tests ran on both workers).  The
multi-process trainings of ``TRAININGS`` come first.  Tests
marked ``alone`` (a CPU share or a loop's stall measured, bench_tta's time
budget, trainings whose accuracy depends on being scheduled alike; each says
why beside its mark) run after the parallel pass with nothing beside them
(``make pytest``'s second command).  No other test depends on wall-clock
speed: a clock read is a hang guard or a lower bound only.

A test fails if its loop logged an unhandled exception (asyncpg's
``_testbase`` habit).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import pytest
import pytest_asyncio
import uvloop
from hypothesis import HealthCheck, settings

import smb2
from smb2.testing.cluster import thread_options
from smb2.torch.loop_thread import LoopThread

# No hypothesis check is tied to wall time (the suite runs on loaded
# machines): no deadline, and no "input generation is slow" health check.
# A test's own @settings keeps these unless it says otherwise
# (test_core.test_no_hypothesis_check_is_tied_to_wall_time looks).
settings.register_profile("smb2", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("smb2")

TRANSPORTS = [t for t in os.environ.get("SMB2_TEST_TRANSPORTS", "tcp,shm").split(",") if t]

RDMA_TIER = os.environ.get("SMB2_RDMA_TIER") == "1"
_RDMA_MODULES = {"test_rdma.py", "test_verbs.py"}

ALL_LOOPS = RDMA_TIER or os.environ.get("SMB2_TEST_ALL_LOOPS") == "1"
# the modules whose tests reach code that talks to the event loop (see above)
BOTH_LOOPS_MODULES = {
    "test_api.py", "test_lock.py", "test_server.py", "test_limits.py", "test_faults.py",
    "test_deadlines.py", "test_notify.py", "test_accumulate.py", "test_cluster.py",
    "test_shm.py", "test_shm_lock.py", "test_shm_fast.py", "test_rdma.py", "test_verbs.py",
}
# Trainings of several processes, each wanting every core and each within a
# time budget: one worker runs them one after another, and they come first, so that the
# other workers' short tests fill the time beside them rather than leaving
# them to run alone at the end.
TRAININGS = {"test_train_accuracy.py"}
# the shm transport's own modules: on both loops over every transport
SHM_MODULES = {"test_shm.py", "test_shm_lock.py", "test_shm_fast.py"}


def _uvloop_only(item: pytest.Item) -> bool:
    if item.get_closest_marker("server_process_only") is not None:
        return True
    if ALL_LOOPS or item.get_closest_marker("both_loops") is not None:
        return False
    return item.path.name not in BOTH_LOOPS_MODULES


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item
                                  ) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    if _uvloop_only(item):
        return {"uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def _repeats_the_tcp_case(item: pytest.Item) -> bool:
    """An asyncio-loop case over shm outside the shm modules (see above)."""
    callspec = getattr(item, "callspec", None)
    if ALL_LOOPS or callspec is None or item.path.name in SHM_MODULES:
        return False
    return callspec.params.get("transport") == "shm" and asyncio.new_event_loop in callspec.params.values()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in TRAININGS)     # stable: otherwise in order
    repeats = [item for item in items if _repeats_the_tcp_case(item)]
    if repeats:
        config.hook.pytest_deselected(items=repeats)
        items[:] = [item for item in items if not _repeats_the_tcp_case(item)]
    if HANG_GUARD:
        for item in items:
            if isinstance(item, pytest.Function) and asyncio.iscoroutinefunction(item.obj):
                item.obj = _bounded(item.obj, HANG_GUARD)
    if not RDMA_TIER:
        return
    skip = pytest.mark.skip(reason="RDMA tier: not parametrized over transports (the host run covers it)")
    for item in items:
        if item.path.name not in _RDMA_MODULES and "transport" not in getattr(item, "fixturenames", ()):
            item.add_marker(skip)


# SMB2_TEST_HANG_GUARD=S (the soft-RoCE tier sets it): an async test still
# running after S seconds is cancelled, so it fails by name with the line it
# waited on and the run goes on.  pytest-timeout cannot do that for a test on
# uvloop: its SIGALRM is handled inside uvloop's C loop and fails nothing.
HANG_GUARD = float(os.environ.get("SMB2_TEST_HANG_GUARD", "0"))


def _bounded(test: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    @functools.wraps(test)
    async def bounded(*args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.wait_for(test(*args, **kwargs), seconds)
        except TimeoutError:
            pytest.fail(f"the test was still running after {seconds:g} s (SMB2_TEST_HANG_GUARD): a hang; "
                        "the traceback above its TimeoutError shows where it waited")
    return bounded
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


@pytest.fixture
def server_threads() -> int:
    """The ``cluster`` servers' --threads: 1 here; a test that must hold with
    an accumulate cut among threads parametrizes it
    (``@pytest.mark.parametrize("server_threads", [1, 2])``, or a module's
    own parametrized fixture of this name)."""
    return 1


@pytest_asyncio.fixture
async def cluster(server_threads: int) -> AsyncIterator[smb2.LocalCluster]:
    async with smb2.LocalCluster(servers=4, options=thread_options(server_threads)) as c:
        yield c


@pytest_asyncio.fixture
async def small_frames(server_threads: int) -> AsyncIterator[list[smb2.Server]]:
    """Three in-process servers whose 16 KiB frame limit makes clients cut
    requests into many pieces per server."""
    servers = [await smb2.start_server("127.0.0.1", 0, capacity="16MiB", max_frame=16 << 10,
                                       **thread_options(server_threads)) for _ in range(3)]
    yield servers
    for s in servers:
        await s.close()


@pytest_asyncio.fixture
async def server(server_threads: int) -> AsyncIterator[smb2.Server]:
    """One in-process server of 16 MiB (a test sends it raw frames)."""
    s = await smb2.start_server("127.0.0.1", 0, capacity="16MiB", **thread_options(server_threads))
    yield s
    await s.close()


@contextlib.contextmanager
def _cluster_on_a_thread(name: str, **options: Any) -> Iterator[tuple[LoopThread, smb2.LocalCluster]]:
    """A LocalCluster of server processes (``options`` as LocalCluster's)
    started and closed on a loop thread of its own: for ordinary (not async)
    tests, such as the torch ones, which may also kill and restart them."""
    loop = LoopThread(name)
    cluster = smb2.LocalCluster(processes=True, **options)
    loop.run(cluster.start())
    try:
        yield loop, cluster
    finally:
        loop.run(cluster.close())
        loop.stop()


@pytest.fixture(scope="session")
def threaded_cluster() -> Callable[..., contextlib.AbstractContextManager[tuple[LoopThread, smb2.LocalCluster]]]:
    """``with threaded_cluster(name, servers=N, ...) as (loop, cluster):``
    a cluster of this test's own (see _cluster_on_a_thread)."""
    return _cluster_on_a_thread


@pytest.fixture(scope="module")
def servers() -> Iterator[str]:
    """Two smb2-server processes for a module of ordinary (not async) tests,
    such as the torch ones ("h:p,h:p")."""
    with _cluster_on_a_thread("test-cluster", servers=2) as (_, cluster):
        yield ",".join(cluster.addresses)


@pytest_asyncio.fixture
async def client(cluster: smb2.LocalCluster, transport: str) -> AsyncIterator[smb2.Client]:
    c = await cluster.connect(transport=transport)
    try:
        yield c
    finally:
        await c.close()


@pytest_asyncio.fixture
async def replicated_cluster() -> AsyncIterator[smb2.LocalCluster]:
    """Three smb2-server processes with a private etcd holding their view
    (``LocalCluster(replicated=True)``; epoch 1: all three members)."""
    async with smb2.LocalCluster(servers=3, processes=True, replicated=True) as c:
        yield c
