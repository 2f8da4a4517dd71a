"""smb2-server --metrics: a real server process, scraped over HTTP while a
client works on it, and the numbers that should move do, by exactly what
was done."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest

import smb2
from smb2.protocol import H_STATUS, Op
from smb2.server.options import ServerOptions
from smb2.testing.hostile import (
    TOKEN,
    closed_by_server,
)
from smb2.testing.launch import ServerProcess
from smb2.testing.metrics import FLOOD, MetricsServer, Samples, bucket_counts, moved, scrape, value
from smb2.testing.wire import closed, frame, hello, reply
from smb2.testing.workers import spawn

# the soft-RoCE guest has no prometheus-client (tools/rxe_vm_requirements.txt): the
# metrics are not about a transport, the host runs them
pytest.importorskip(
    "prometheus_client.parser", reason="smb2-server --metrics needs prometheus-client (pip install 'smb2[metrics]')")

MiB = 1 << 20


@pytest.fixture
def server_process_with_token(tmp_path):  # type: ignore[no-untyped-def]
    path = tmp_path / "token"
    path.write_bytes(TOKEN)
    path.chmod(0o600)
    s = MetricsServer("--capacity", "64MiB", "--auth-token-file", str(path))
    yield s
    s.stop()


async def test_the_numbers_move_with_the_work(server_process_with_token: MetricsServer) -> None:
    srv = server_process_with_token
    before = await srv.scrape()
    assert value(before, "smb2_capacity_bytes") == 64 * MiB
    assert value(before, "smb2_used_bytes") == 0
    assert value(before, "smb2_connections") == 0
    assert value(before, "process_resident_memory_bytes") > 0
    info = [k for k in before if k[0] == "smb2_server_info"]
    assert len(info) == 1 and dict(info[0][1])["rdma"] in ("on", "off")

    async with await smb2.connect([srv.address], token=TOKEN, transport="tcp") as client:
        buf = await client.create("watched", 1 * MiB, stripe=64 << 10)
        data = np.arange(MiB // 8, dtype=np.int64)
        await buf.write(0, data)
        for _ in range(3):
            assert np.array_equal(np.frombuffer(await buf.read(0, MiB), dtype=np.int64), data)
        with pytest.raises(smb2.Smb2Error):
            await buf.read(MiB - 8, 64)      # past the end: refused by the client or the server
        lock = client.lock("watched-lock")
        await lock.acquire()
        during = await srv.scrape()
        await lock.release()

    assert value(during, "smb2_connections") >= 1
    assert value(during, "smb2_used_bytes") == MiB
    assert value(during, "smb2_buffers") == 1
    # one server: each buffer operation is one request to it
    assert value(during, "smb2_ops_total", transport="tcp", op="write") == 1
    assert value(during, "smb2_ops_total", transport="tcp", op="read") == 3
    assert value(during, "smb2_op_bytes_total", transport="tcp", op="write", direction="in") == MiB
    assert value(during, "smb2_op_bytes_total", transport="tcp", op="read", direction="out") == 3 * MiB
    assert value(during, "smb2_op_seconds_count", transport="tcp", op="read") == 3
    assert value(during, "smb2_locks_open") >= 1
    assert value(during, "smb2_locks_held") == 1
    assert value(during, "smb2_lock_grants_total") >= 1

    # a wrong token is counted, by why
    with pytest.raises(smb2.AccessDenied):
        await smb2.connect([srv.address], token=b"a wrong guess", transport="tcp")
    after = await srv.scrape()
    assert value(after, "smb2_refused_total", reason="auth_failed") == 1
    assert value(after, "smb2_locks_held") == 0
    assert value(after, "smb2_uptime_seconds") > value(before, "smb2_uptime_seconds")


async def test_lock_waiters_and_connection_refusals() -> None:
    srv = MetricsServer("--max-connections-per-host", "2")
    try:
        async with await smb2.connect([srv.address], transport="tcp") as a, \
                await smb2.connect([srv.address], transport="tcp") as b:
            holder, waiter = a.lock("queue"), b.lock("queue")
            await holder.acquire()
            waiting = asyncio.create_task(waiter.acquire())
            for _ in range(100):
                samples = await srv.scrape()
                if value(samples, "smb2_lock_waiters") == 1:
                    break
                await asyncio.sleep(0.05)
            assert value(samples, "smb2_locks_held") == 1
            assert value(samples, "smb2_lock_waiters") == 1
            with pytest.raises(smb2.Smb2Error):
                await smb2.connect([srv.address], transport="tcp", timeout=5)   # the third from 127.0.0.1
            await holder.release()
            assert await waiting
            await waiter.release()
        samples = await srv.scrape()
        assert value(samples, "smb2_refused_total", reason="connection_limit") >= 1
        assert value(samples, "smb2_lock_waiters") == 0
    finally:
        srv.stop()


def test_only_get_metrics_is_served() -> None:
    srv = MetricsServer()
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(srv.url.replace("/metrics", "/other"), timeout=10)
        assert err.value.code == 404
        assert value(scrape(srv.url), "smb2_connections") == 0
    finally:
        srv.stop()


def test_metrics_is_off_by_default_and_a_bad_address_is_refused() -> None:
    assert ServerOptions().metrics is None
    with pytest.raises(smb2.InvalidArgumentError, match="HOST:PORT"):
        ServerOptions(metrics="9100")
    proc = subprocess.run([sys.executable, "-m", "smb2.server", "--port", "0", "--metrics", "localhost"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "metrics address must be HOST:PORT" in proc.stderr


def test_a_taken_port_or_a_missing_prometheus_client_is_said_before_serving() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "smb2.server", "--port", "0", "--metrics",
                               f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in proc.stderr
    assert "metrics on" not in proc.stdout
    # prometheus-client not installed: an import of it fails (sys.modules[...] = None)
    without = ("import sys; sys.modules['prometheus_client'] = None; from smb2.server import main; "
               "sys.exit(main(['--port', '0', '--metrics', '127.0.0.1:0']))")
    proc = subprocess.run([sys.executable, "-c", without], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "pip install 'smb2[metrics]'" in proc.stderr
    assert "listening" not in proc.stdout


async def test_ops_bytes_and_handling_times_move_by_exactly_what_was_done() -> None:
    srv = MetricsServer("--capacity", "16MiB")
    try:
        async with await smb2.connect([srv.address], transport="tcp") as client:
            buf = await client.create("counted", 64 << 10)
            page = np.full(4096, 7, dtype=np.uint8)
            await buf.write(0, page)        # the connection is warm before the first scrape
            before = await srv.scrape()
            for i in range(3):
                await buf.write(i * 4096, page)
            for i in range(2):
                assert bytes(await buf.read(i * 4096, 4096)) == page.tobytes()
            await buf.accumulate(0, np.ones(256, dtype=np.float32))
            after = await srv.scrape()
    finally:
        srv.stop()
    tcp = {"transport": "tcp"}
    assert moved(before, after, "smb2_ops_total", **tcp, op="write") == 3
    assert moved(before, after, "smb2_ops_total", **tcp, op="read") == 2
    assert moved(before, after, "smb2_ops_total", **tcp, op="accumulate") == 1
    assert moved(before, after, "smb2_op_bytes_total", **tcp, op="write", direction="in") == 3 * 4096
    assert moved(before, after, "smb2_op_bytes_total", **tcp, op="read", direction="out") == 2 * 4096
    assert moved(before, after, "smb2_op_bytes_total", **tcp, op="accumulate", direction="in") == 1024
    assert moved(before, after, "smb2_op_bytes_total", **tcp, op="read", direction="in") == 0
    for op, n in (("write", 3), ("read", 2), ("accumulate", 1)):
        assert moved(before, after, "smb2_op_seconds_count", **tcp, op=op) == n
        took = moved(before, after, "smb2_op_seconds_sum", **tcp, op=op)
        assert 0 < took < n * 5.0, (op, took)    # the server's own time: microseconds, seconds on a stalled box
        buckets = bucket_counts(after, "smb2_op_seconds", **tcp, op=op)
        assert buckets["+Inf"] == value(after, "smb2_op_seconds_count", **tcp, op=op)
        counts = [buckets[le] for le in sorted(buckets, key=float)]
        assert counts == sorted(counts)          # cumulative
    assert "smb2_ops_total" not in {k[0] for k in after if dict(k[1]).get("transport") == "rdma"}


async def test_accumulates_cut_among_threads_are_counted_with_their_parts() -> None:
    srv = MetricsServer("--capacity", "16MiB", "--threads", "2", "--thread-part", "4KiB")
    try:
        async with await smb2.connect([srv.address], transport="tcp") as client:
            buf = await client.create("cut", 64 << 10)
            await buf.accumulate(0, np.ones(256, dtype=np.float32))     # 1 KiB: one part
            before = await srv.scrape()
            await buf.accumulate(0, np.ones(4096, dtype=np.float32))    # 16 KiB: two parts of 8
            await buf.accumulate(0, np.ones(1024, dtype=np.float32))    # 4 KiB: one part
            after = await srv.scrape()
            assert (await buf.read(0, 4)).view(np.float32)[0] == 3.0
    finally:
        srv.stop()
    assert value(after, "smb2_threads") == 2
    assert moved(before, after, "smb2_accumulates_cut_total") == 1
    assert moved(before, after, "smb2_accumulate_parts_total") == 2


async def test_lock_hand_offs_after_a_release_and_after_a_lease_expiry() -> None:
    lease = 0.5
    srv = MetricsServer("--capacity", "16MiB")
    proc = None
    try:
        async with await smb2.connect([srv.address], transport="tcp") as a, \
                await smb2.connect([srv.address], transport="tcp") as b:
            await a.create("handed", 128)
            holder, waiter = a.lock("handed", mode="park", lease=lease), b.lock("handed", mode="park")
            await holder.acquire()
            before = await srv.scrape()
            waiting = asyncio.ensure_future(waiter.acquire())
            await wait_for_metric(srv, "smb2_lock_waiters", 1)
            await holder.release()
            assert await waiting
            released = await srv.scrape()
            assert moved(before, released, "smb2_lock_handoff_seconds_count") == 1
            assert moved(before, released, "smb2_lock_grants_total") == 1
            assert 0 < moved(before, released, "smb2_lock_handoff_seconds_sum") < 1.0
            await waiter.release()

            # a holder in another process stops (SIGSTOP) and renews no more:
            # the lease runs out and the parked waiter gets the lock
            proc = await spawn({"servers": [f"{srv.address[0]}:{srv.address[1]}"], "buffer": "handed", "lock": "handed",
                                "mode": "park", "lease": lease, "action": "hold", "transport": "tcp"})
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert line.startswith(b"HELD "), line
            waiting = asyncio.ensure_future(waiter.acquire())
            await wait_for_metric(srv, "smb2_lock_waiters", 1)
            os.kill(proc.pid, signal.SIGSTOP)
            assert await asyncio.wait_for(waiting, 30)
            expired = await srv.scrape()
            await waiter.release()
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            await proc.wait()
        srv.stop()
    assert moved(released, expired, "smb2_lock_lease_expiries_total") == 1
    assert moved(released, expired, "smb2_lock_handoff_seconds_count") == 1
    # timed from when the lease ran out: the sweep's lag (its period here is
    # lease/20 = 25 ms), not the lease
    lag = moved(released, expired, "smb2_lock_handoff_seconds_sum")
    assert 0 < lag < lease, lag


async def wait_for_metric(srv: MetricsServer, name: str, want: float) -> Samples:
    for _ in range(200):
        samples = await srv.scrape()
        if value(samples, name) == want:
            return samples
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} never reached {want}: {value(samples, name)}")


async def test_refusals_by_reason_and_cuts_by_deadline() -> None:
    srv = MetricsServer("--hello-timeout", "1")
    try:
        before = await srv.scrape()
        reader, writer = await asyncio.open_connection(*srv.address)
        writer.write(hello())
        await reply(reader)
        # a READ of a segment that does not exist: refused, the connection stays
        writer.write(frame(Op.READ, segment=99, length=8, rid=2))
        hdr, _ = await reply(reader)
        assert hdr[H_STATUS] == smb2.ErrorCode.NO_SUCH_BUFFER
        # an op that does not exist: the connection is closed with the reason
        writer.write(frame(200, rid=3))
        assert await closed(reader)
        writer.close()
        # one that never says hello is cut at --hello-timeout
        silent_reader, silent = await asyncio.open_connection(*srv.address)
        assert await closed(silent_reader)
        silent.close()
        after = await srv.scrape()
    finally:
        srv.stop()
    assert moved(before, after, "smb2_refused_total", reason="no_such_buffer") == 1
    assert moved(before, after, "smb2_refused_total", reason="bad_request") == 1
    assert moved(before, after, "smb2_connections_cut_total", reason="hello_timeout") == 1
    # a refused request is not an executed op
    assert value(after, "smb2_ops_total", transport="tcp", op="read") == 0


def server_cpu(pid: int) -> float:
    """Seconds of CPU the process has used (user + system, all its threads)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.server_process_only
async def test_a_flood_of_scrapes_does_not_take_the_servers_time() -> None:
    """Issue 22 #7: 178 unauthenticated scrapes per second, each rendered on
    the server's loop (14 ms with 2,000 locks), took the data path's p50
    from 29 us to 4.5 ms (tools/bench_attacks.py, attack 24, measures it).
    The server's numbers are read at most every 0.25 s (scrapes meanwhile
    wait and share the reading), rendered in a thread, and at most 16
    scrapes are served at once."""
    srv = MetricsServer("--capacity", "16MiB")
    try:
        async with await smb2.connect([srv.address], transport="tcp") as c:
            for first in range(0, 500, 250):       # 500 locks open: a reading takes some ms
                locks = [c.lock(f"L{k}", mode="park") for k in range(first, first + 250)]
                await asyncio.gather(*(lock.acquire() for lock in locks))
                await asyncio.gather(*(lock.release() for lock in locks))
            buf = await c.create("data", 4096)
            await buf.write(0, b"12345678")

            async def p50(n: int = 200) -> float:
                times = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    assert bytes(await buf.read(0, 8)) == b"12345678"
                    times.append(time.perf_counter() - t0)
                return sorted(times)[n // 2]
            quiet = await p50()
            # the flood from another process (threads here would take this
            # process's time, not the server's)
            cpu0, t0 = server_cpu(srv.proc.pid), time.monotonic()
            flood = await asyncio.create_subprocess_exec(
                sys.executable, "-c", FLOOD, srv.url, "32", "1.5", stdout=asyncio.subprocess.PIPE)
            await asyncio.sleep(0.5)
            busy = await p50()
            out, _ = await flood.communicate()
            cpu, wall = server_cpu(srv.proc.pid) - cpu0, time.monotonic() - t0
            served, readings = map(int, out.split())
        print(f"{served} scrapes from {readings} readings in {wall:.1f} s took {cpu:.2f} s of the server's "
              f"CPU; 8-byte read p50 {quiet * 1e6:.0f} us quiet, {busy * 1e6:.0f} us during the flood")
        # one reading per 0.25 s, shared by the scrapes waiting for it (each
        # scrape was a reading of its own before: a few ms of the loop each).
        # A bound safe on a loaded machine: readings are at least 0.25 s
        # apart, and load only lengthens `wall`; the p50s are printed only
        assert readings <= wall / 0.25 + 2 and served >= 2 * readings, (served, readings, wall)
    finally:
        srv.stop()


def test_metrics_bind_loopback_unless_a_host_is_given() -> None:
    """Issue 22 #7: ``--metrics :PORT`` bound every interface."""
    srv = ServerProcess("--capacity", "1MiB", "--metrics", ":0")
    try:
        assert srv.proc.stdout is not None
        line = srv.proc.stdout.readline()
        assert line.startswith("smb2-server metrics on http://127.0.0.1:"), line
        assert scrape(line.split()[-1])
    finally:
        srv.stop()


@pytest.mark.server_process_only
async def test_scrapers_past_the_cap_wait_in_the_backlog() -> None:
    """At most 16 connections to the metrics port are accepted at once, each
    for at most 2 s without a request: the next scrape waits in the kernel's
    backlog (taking none of the server's time) and is served when one goes."""
    srv = MetricsServer("--capacity", "1MiB")
    try:
        host, port = urllib.parse.urlsplit(srv.url).netloc.rsplit(":", 1)
        # from before the idle ones came: the 2 s they are given counts from then
        t0 = time.monotonic()
        idle = [socket.create_connection((host, int(port))) for _ in range(16)]
        await asyncio.sleep(0.2)
        samples = await srv.scrape()
        waited = time.monotonic() - t0
        assert value(samples, "smb2_connections") == 0
        # served once the idle ones were closed, not before (load only adds)
        assert waited > 1.9, waited
        for s in idle:
            assert closed_by_server(s, 60)      # a hang guard
            s.close()
    finally:
        srv.stop()
