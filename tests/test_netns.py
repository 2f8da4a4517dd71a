"""Across hosts: smb2 between network namespaces (tools/netns_cluster.py), the quick
correctness mode of issue 5 -- not speed.

Every memory server is its own host (a network namespace with a 1 Gbit/s tbf link); the
clients are separate processes in the client namespace, never this process (it lives in the
root namespace, whose default route leads off the machine).  Skipped, with the reason, where
namespaces cannot be built (not root, no ``ip netns``, no veth/tbf).

These are plain sync tests that drive subprocesses, so they run once, not once per event loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import smb2
import smb2.testing.netns as netns_cluster

pytestmark = pytest.mark.timeout(60)

NSERVERS = 4
NBYTES = 5 * (1 << 20) + 4321  # a few MiB, not a multiple of anything
STRIPE = 100_008  # an odd stripe: not a power of two, stripes straddle every request boundary
SEED = 20260522
INCREMENTS = 50  # per client process, for the lock test


def _cluster() -> netns_cluster.NetnsCluster:
    ok, why = netns_cluster.can_run()
    if not ok:
        pytest.skip(f"no network namespaces here: {why}")
    return netns_cluster.NetnsCluster(servers=NSERVERS, rate="1gbit", capacity="64MiB", quiet=True,
                                      handle_signals=False, ready_timeout=20)


def _client(cluster: netns_cluster.NetnsCluster, code: str, *args: object) -> subprocess.Popen:
    """A Python client process in the client namespace (``SMB2_SERVERS`` set), talking on pipes."""
    return cluster.popen_client([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen, what: str, timeout: float = 30) -> str:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"{what} did not finish within {timeout} s; stdout: {out!r} stderr: {err[-3000:]}")
    assert p.returncode == 0, f"{what} failed (exit {p.returncode}): {err[-3000:]}"
    return out


def _assert_gone(cluster: netns_cluster.NetnsCluster, pids: list[int]) -> None:
    assert cluster.leftovers() == {"netns": [], "processes": []}
    assert not [n for n in netns_cluster.list_netns() if n.startswith(cluster.prefix + "-")]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# The writer creates the buffer and fills it from 3 concurrent tasks in irregular pieces; it
# stays connected until told to go, so that the reader attaches while another client is live.
WRITER = """
import asyncio, hashlib, sys
import numpy as np
import smb2

async def main(name, nbytes, stripe, seed):
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    async with await smb2.connect() as client:
        buf = await client.create(name, nbytes, stripe=stripe)
        cuts = np.unique(np.r_[0, np.random.default_rng(seed + 1).integers(1, nbytes, 40), nbytes])
        pieces = list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))

        async def task(k):
            for a, b in pieces[k::3]:
                await buf.write(a, data[a:b])

        await asyncio.gather(*(task(k) for k in range(3)))
        print("written", hashlib.sha256(data).hexdigest(), flush=True)
        assert sys.stdin.readline().strip() == "done"

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
"""

# The reader attaches by name (another process, another connection to every server), checks
# every byte and odd sub-ranges, that each of the servers -- each its own host -- holds a part
# and received bytes, then destroys the buffer.
READER = """
import asyncio, hashlib, json, sys
import numpy as np
import smb2

async def main(name, nbytes, stripe, seed):
    want = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    async with await smb2.connect() as client:
        buf = await client.attach(name)
        assert (buf.nbytes, buf.stripe, buf.nservers) == (nbytes, stripe, len(client.servers)), buf
        got = np.zeros(nbytes, dtype=np.uint8)
        await buf.read_into(got)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, f"{bad.size} bytes differ, first at {bad[:5].tolist()}"
        rng = np.random.default_rng(seed + 2)
        for _ in range(25):
            a = int(rng.integers(0, nbytes - 1))
            b = int(rng.integers(a + 1, min(nbytes, a + 3 * stripe) + 1))
            assert np.array_equal(await buf.read(a, b - a), want[a:b]), (a, b)
        stats = await client.stat()
        parts = sorted(s["buffers"][name]["index"] for s in stats)
        assert parts == list(range(len(stats))), parts
        assert all(s["bytes_in"] > 0 and s["bytes_out"] > 0 for s in stats), stats
        print(json.dumps({"sha256": hashlib.sha256(got).hexdigest(),
                          "addresses": [s["address"] for s in stats]}), flush=True)
        assert await client.destroy(name)
        assert name not in await client.buffers()

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
"""


def test_striped_data_reads_back_identical_across_hosts() -> None:
    """Written through 4 servers in 4 namespaces by one client process, read back identical by
    another that attaches by name; then teardown leaves no namespace and no process."""
    with _cluster() as cluster:
        server_pids = [cluster.server_process(i).pid for i in range(NSERVERS)]  # type: ignore[union-attr]
        writer = _client(cluster, WRITER, "netns-data", NBYTES, STRIPE, SEED)
        try:
            line = writer.stdout.readline()  # type: ignore[union-attr]
            if not line.startswith("written "):
                writer.kill()
                _, err = writer.communicate()
                pytest.fail(f"writer failed: {line!r} {err[-3000:]}")
            reader = _client(cluster, READER, "netns-data", NBYTES, STRIPE, SEED)
            result = _finish(reader, "reader")
        finally:
            if writer.poll() is None:
                writer.stdin.write("done\n")  # type: ignore[union-attr]
                writer.stdin.flush()  # type: ignore[union-attr]
        _finish(writer, "writer")
        got = json.loads(result.strip().splitlines()[-1])
        assert got["sha256"] == line.split()[1]
        assert sorted(got["addresses"]) == sorted(cluster.servers)
        client_pids = [writer.pid, reader.pid]
    _assert_gone(cluster, server_pids + client_pids)


# Each process takes the named lock 50 times and does a read-modify-write of an int64 counter
# striped like any buffer data (the buffer's other stripes on other hosts).  Both start on "go".
LOCKER = """
import asyncio, inspect, sys
import numpy as np
import smb2

async def main(name, increments):
    async with await smb2.connect() as client:
        buf = await client.create(name, 4096, stripe=1024)   # idempotent: both processes call it
        print("ready", flush=True)
        assert sys.stdin.readline().strip() == "go"
        lock = client.lock(name)
        # a fenced write where the API has it: refused if this process lost the lock meanwhile
        fenced = {"fence": lock} if "fence" in inspect.signature(buf.write).parameters else {}
        tokens = []
        for _ in range(increments):
            await lock.acquire(timeout=30)
            try:
                tokens.append(lock.token)
                v = int(np.frombuffer(await buf.read(2048, 8), dtype=np.int64)[0])
                await asyncio.sleep(0)       # widen the window a lost update would need
                await buf.write(2048, np.array([v + 1], dtype=np.int64), **fenced)
            finally:
                await lock.release()
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), tokens
        print("done", flush=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""

COUNTER = """
import asyncio, sys
import numpy as np
import smb2

async def main(name):
    async with await smb2.connect() as client:
        buf = await client.attach(name)
        print(int(np.frombuffer(await buf.read(2048, 8), dtype=np.int64)[0]), flush=True)
        await client.destroy(name)

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.skipif(not hasattr(smb2.Client, "lock"), reason="lock API not available")
def test_lock_works_across_hosts() -> None:
    """2 client processes x 50 locked read-modify-write increments -> exactly 100."""
    with _cluster() as cluster:
        server_pids = [cluster.server_process(i).pid for i in range(NSERVERS)]  # type: ignore[union-attr]
        procs = [_client(cluster, LOCKER, "netns-lock", INCREMENTS) for _ in range(2)]
        try:
            for p in procs:
                line = p.stdout.readline()  # type: ignore[union-attr]
                if line.strip() != "ready":
                    p.kill()
                    pytest.fail(f"lock client failed to start: {line!r} {p.communicate()[1][-3000:]}")
            for p in procs:
                p.stdin.write("go\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
            for i, p in enumerate(procs):
                _finish(p, f"lock client {i}", timeout=40)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        counter = _client(cluster, COUNTER, "netns-lock")
        total = int(_finish(counter, "counter reader").split()[-1])
        assert total == 2 * INCREMENTS
        client_pids = [p.pid for p in procs] + [counter.pid]
    _assert_gone(cluster, server_pids + client_pids)


def test_faults_cut_heal_kill_restart_and_etcd() -> None:
    """The nemesis' tools (tools/jepsen.py): a cut drops traffic between two hosts until healed,
    a killed server restarts on its address, and etcd=True runs etcd on its own host with the first
    view written and every server told where it is."""
    ok, why = netns_cluster.can_run()
    if not ok:
        pytest.skip(f"no network namespaces here: {why}")
    probe = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1)"
    with netns_cluster.NetnsCluster(servers=2, rate=None, capacity="16MiB", quiet=True, handle_signals=False,
                                    ready_timeout=20, clients=2, etcd=True) as cluster:
        def reaches(host: str, server: int) -> bool:
            p = cluster.popen_client([sys.executable, "-c", probe, cluster.server_addrs[server], "7420"], host=host)
            return p.wait(10) == 0

        assert reaches("c1", 0) and reaches("c", 0)
        cluster.cut("c1", "s0")
        assert not reaches("c1", 0) and reaches("c", 0) and reaches("c1", 1)
        cluster.heal()
        assert reaches("c1", 0)
        old = cluster.server_process(1).pid  # type: ignore[union-attr]
        cluster.kill_server(1)
        assert not reaches("c", 1)
        cluster.restart_server(1)
        assert cluster.server_process(1).pid != old and reaches("c", 1)  # type: ignore[union-attr]
        view = cluster.run_client([sys.executable, "-c", "import asyncio, sys, smb2.membership as m; "
                                   "print(asyncio.run(m.open_membership(sys.argv[1]).view()))",
                                   str(cluster.membership_url)], capture_output=True, text=True, timeout=30)
        assert view.stdout.strip() == f"View(epoch=1, members=({cluster.servers[0]!r}, {cluster.servers[1]!r}), " \
                                      "joining=())", view.stderr
        argv = (Path("/proc") / str(cluster.server_process(0).pid) / "cmdline").read_bytes().split(b"\0")  # type: ignore
        assert argv[argv.index(b"--membership") + 1].decode() == cluster.membership_url


@pytest.mark.slow
def test_replicated_failover_across_hosts_loses_nothing(tmp_path: Path) -> None:
    """``smb2 bench replicas-netns``'s quick failover phase: a primary SIGKILLed under accumulate
    and fetch_add loops on every stripe (3 servers, etcd and the client each its own host); the
    client goes on within the target (3 s) and the Jepsen checker finds every acknowledged update
    on the copies, none applied twice."""
    ok, why = netns_cluster.can_run()
    if not ok:
        pytest.skip(f"no network namespaces here: {why}")
    out = tmp_path / "failover.json"
    r = subprocess.run([sys.executable, "-m", "smb2.bench", "replicas-netns", "--quick", "--phases", "failover",
                        "--kills", "1", "--json", str(out)], capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    fo = json.loads(out.read_text())["failover"]
    assert fo["violations"] == [] and len(fo["kills"]) == 1, fo
    assert 0 < fo["failover_s_worst"] <= 3.0, fo
    assert "accumulate" in fo["operations"] and "fetch_add" in fo["operations"], fo
