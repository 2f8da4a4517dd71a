"""One Jepsen run: its settings, a LocalCluster or a netns cluster, the clients (in this
process, or as workers on the netns client hosts) and the nemesis, and the history they make."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import smb2
from smb2 import _core

from .. import netns
from .history import LOCK, Final, History, Layout, Op
from .nemesis import LocalTarget, Nemesis, NetnsTarget, Target
from .workloads import Workload


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
    dedup_clients: int | None = None    # smb2-server --dedup-clients (small: the flood fills it)


def lock_server(servers: int) -> int:
    """The server that holds the replicated lock's words first (replica 0 of its buffer's only
    stripe, the primary while every server is a member)."""
    return _core.name_hash("lock:" + LOCK) % servers


async def run_local(s: Settings) -> History:
    """One run against a LocalCluster of server processes on this host."""
    if "partition" in s.nemesis:
        raise SystemExit("partitions need the netns harness: add --netns")
    if {"forge", "flood"} & set(s.nemesis) and s.replicas < 2:
        raise SystemExit("forge and flood attack replicated buffers: add --replicas 2")
    history = History(s.seed)
    with tempfile.TemporaryDirectory(prefix="smb2-jepsen-") as tmp:
        args = ["--dedup-clients", str(s.dedup_clients)] if s.dedup_clients else []
        cluster = smb2.LocalCluster(servers=s.servers, processes=True, replicated=s.replicas > 1,
                                    data_dir=tmp if s.data_dir else None, capacity="64MiB", server_args=args)
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
    if {"forge", "flood"} & set(s.nemesis):
        raise SystemExit("forge and flood attack a replicated LocalCluster: run them without --netns")
    ok, why = netns.can_run()
    if not ok:
        raise netns.NotSupported(why)
    history = History(s.seed)
    cmd = list(netns.DEFAULT_SERVER_CMD)
    with contextlib.ExitStack() as stack:
        if s.data_dir:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="smb2-jepsen-"))
            cmd += ["--data-dir", os.path.join(tmp, "s{index}")]
        cluster = stack.enter_context(netns.NetnsCluster(
            servers=s.servers, rate=None, capacity="64MiB", server_cmd=cmd, quiet=True, handle_signals=False,
            ready_timeout=20, clients=s.clients, etcd=s.replicas > 1))
        worker = [sys.executable, "-m", "smb2.testing.jepsen", "--worker"]

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
