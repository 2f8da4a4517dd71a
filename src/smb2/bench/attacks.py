"""Attacks 1-11 on a server's bounds, 12-16 (what a same-host client can
do through shared memory) against real ``smb2-server`` processes: the bound
each one meets now, and the server's memory and time while it runs.

    python tools/bench_attacks.py [--only 1,4,7] [--quick] [--json PATH]

Each attack starts its own server process on loopback, reads its RSS from
``/proc/PID/status`` before, every 50 ms during (the peak) and after the
attack, times the attack, says what the server did (cut, refused, bounded),
and checks that a well-behaved client is still served correctly afterwards.
It prints the table of the issue's closing note (attack -> bound -> measured
memory and time) and writes every row to JSON (``--json``, default
``bench-results/attacks.json``).  Not a test: the tests that assert these
bounds are tests/test_hardening_server.py, test_hardening_shm.py,
test_lock_bounds.py, test_stale.py; this uses the same hostile clients (smb2.testing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import resource
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

import smb2
from smb2.protocol import LOCK_SEGMENT, VERSION, Op
from smb2.server.locks import MAX_TICKETS_PER_CONNECTION
from smb2.testing import wire
from smb2.testing.hostile import (
    REGION,
    TOKEN,
    SlowestRead,
    acquire_within,
    claim_fds,
    closed_by_server,
    guess,
    keep_guessing,
    lock_offset,
    lock_words,
    open_sockets,
    shm_of,
    start_writers,
    trickle,
    unread_reads,
    well_behaved,
)
from smb2.testing.launch import ServerProcess
from smb2.testing.waits import until
from smb2.testing.workers import reap, spawn

from . import report

MiB = 1 << 20


@dataclasses.dataclass
class Row:
    attack: int
    what: str
    bound: str
    result: str = ""
    rss_before: int = 0
    rss_peak: int = 0
    rss_after: int = 0
    seconds: float = 0.0
    served_after: bool = False


class Watch:
    """The server's RSS before, at its peak during, and after a block, and
    the block's time, into ``row``."""

    def __init__(self, server: ServerProcess, row: Row) -> None:
        self.server = server
        self.row = row
        self._sampler: asyncio.Task[None] | None = None
        self._t0 = 0.0

    async def __aenter__(self) -> Watch:
        self.row.rss_before = self.row.rss_peak = self.server.rss
        self._sampler = asyncio.ensure_future(self._sample())
        self._t0 = time.monotonic()
        return self

    async def _sample(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            with contextlib.suppress(OSError, AssertionError):   # the process may be gone
                self.row.rss_peak = max(self.row.rss_peak, self.server.rss)

    async def __aexit__(self, *exc: object) -> None:
        self.row.seconds = time.monotonic() - self._t0
        assert self._sampler is not None
        self._sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._sampler
        with contextlib.suppress(OSError, AssertionError):
            self.row.rss_after = self.server.rss
            self.row.rss_peak = max(self.row.rss_peak, self.row.rss_after)


@contextlib.asynccontextmanager
async def serving(row: Row, *flags: str, token: bytes | None = None) -> Any:
    """A server process for one attack; afterwards a well-behaved client
    must still be served correctly (``row.served_after``)."""
    srv = ServerProcess(*flags)
    try:
        yield srv
        await asyncio.wait_for(well_behaved(srv.address, token), 60)
        row.served_after = True
    finally:
        srv.stop()


async def raw_session(address: tuple[str, int]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection that said hello (servers without a token)."""
    reader, writer = await asyncio.open_connection(*address)
    writer.write(wire.hello())
    await wire.reply(reader)
    return reader, writer


async def is_(value: Awaitable[object], want: object) -> bool:
    return await value == want


async def connections(client: smb2.Client) -> int:
    return int((await client.stat())[0]["connections"])


async def all_closed(socks: list[socket.socket]) -> bool:
    return all(await asyncio.to_thread(lambda: [closed_by_server(s, 30) for s in socks]))


# -- the attacks -------------------------------------------------------------

async def silent_connections(quick: bool) -> Row:
    n = 500 if quick else 2000
    row = Row(1, f"{n} connections that never say hello, then {n} announcing a 1 MiB control message",
              "no inbox until a byte arrives; over 4 KiB before auth refused at the header; "
              "cut at --hello-timeout (4 s here)")
    async with serving(row, "--capacity", "64MiB", "--max-connections", "5000", "--max-connections-per-host",
                       "5000", "--hello-timeout", "4") as srv:
        async with Watch(srv, row):
            silent = await asyncio.to_thread(open_sockets, srv.address, n)
            opened = time.monotonic()

            async def cut_after(s: socket.socket) -> float:
                await asyncio.to_thread(closed_by_server, s, 60)
                return time.monotonic() - opened
            # the last one opened is cut at the hello deadline (which the
            # server counts from its accept) plus at most a sweep period
            last_cut = asyncio.ensure_future(cut_after(silent[-1]))
            loud = await asyncio.to_thread(open_sockets, srv.address, n, wire.frame(Op.CONTROL, length=MiB))
            refused = await all_closed(loud)
            last = await last_cut
            cut = await all_closed(silent)
        for s in silent + loud:
            s.close()
        row.result = (f"all {n} loud ones refused unread: {refused}; all silent ones cut: {cut}, the last "
                      f"one opened {last:.1f} s after its connect")
    return row


async def trickling_write(quick: bool) -> Row:
    row = Row(2, "a 1 MiB WRITE trickling 1 byte per 0.1 s, an accumulate waiting behind it",
              "less than --write-min-rate x --write-timeout (4 KiB x 1 s here) per window: cut")
    async with serving(row, "--capacity", "16MiB", "--write-timeout", "1", "--write-min-rate", "4KiB") as srv:
        async with await smb2.connect([srv.address]) as c:
            buf = await c.create("w", MiB)
            reader, writer = await raw_session(srv.address)
            writer.write(wire.frame(Op.WRITE, rid=2, segment=buf.segments[0], length=MiB))
            trickler = asyncio.ensure_future(trickle(writer))
            async with Watch(srv, row):
                await asyncio.wait_for(buf.accumulate(0, np.ones(8, np.int64)), 30)
            trickler.cancel()
            _, body = await wire.reply(reader)
            writer.close()
        why = msgpack.unpackb(body)["message"]
        row.result = f"cut after {row.seconds:.2f} s ({why!r}); the accumulate behind it ran"
    return row


async def park_acquires(address: tuple[str, int], name: str, n: int) -> asyncio.StreamWriter:
    """A raw connection that sends ``n`` LOCK_ACQUIREs of ``name`` in one burst."""
    reader, writer = await raw_session(address)
    writer.write(wire.control({"cmd": "lock_open", "name": name}, rid=2))
    _, body = await wire.reply(reader)
    offset = int(msgpack.unpackb(body)["offset"])
    writer.write(b"".join(wire.frame(Op.LOCK_ACQUIRE, rid=100 + i, segment=LOCK_SEGMENT, offset=offset)
                          for i in range(n)))
    await writer.drain()
    return writer


async def parked_acquires(quick: bool) -> Row:
    conns = 10 if quick else 40
    row = Row(3, f"{conns} connections x 500 pipelined lock acquires parked, then all closed at once",
              "512 parked per connection (--max-inflight 1024 in all); O(log n) cancellation and skipping")
    async with serving(row, "--capacity", "16MiB") as srv:
        async with await smb2.connect([srv.address], timeout=10) as client:
            buf = await client.create("ping", 64, stripe=64)
            holder = client.lock("busy")
            await holder.acquire()

            async def parked() -> int:
                return int((await client.stat())[0]["locks"]["locks"]["busy"]["parked"])
            async with Watch(srv, row):
                writers = [await park_acquires(srv.address, "busy", 500) for _ in range(conns)]
                await until(lambda: is_(parked(), conns * 500), "every acquire parked", guard=120, every=0.05)
                pinger = SlowestRead(buf)
                await asyncio.sleep(0.1)
                t0 = time.monotonic()
                for w in writers:
                    w.close()
                await until(lambda: is_(parked(), 0), "the parked acquires dropped", guard=120)
                dropped = time.monotonic() - t0
                worst = await pinger.stop()
            await holder.release(wait=True)
            assert await client.lock("busy").acquire(timeout=10)
        row.result = (f"{conns * 500} parked waiters dropped in {dropped:.2f} s; slowest 8-byte read "
                      f"meanwhile {worst * 1e3:.0f} ms")
    return row


async def unread_replies(quick: bool) -> Row:
    conns = 2 if quick else 8
    row = Row(4, f"{conns} connections x 8,000 pipelined 64 KiB READs, replies never read",
              "--max-reply-bytes (1 MiB) queued per connection, corked replies included; cut after "
              "--write-timeout (3 s here) without draining")
    async with serving(row, "--capacity", "64MiB", "--write-timeout", "3") as srv:
        async with await smb2.connect([srv.address]) as c:
            buf = await c.create("src", 4 * MiB)
            await buf.write(0, np.ones(buf.nbytes, np.uint8))
            seg = buf.segments[0]
        async with Watch(srv, row):
            socks = [await asyncio.to_thread(unread_reads, srv.address, seg) for _ in range(conns)]
            async with await smb2.connect([srv.address]) as c:
                await until(lambda: is_(connections(c), 1), "the other connections closed", guard=120, every=0.1)
        for s in socks:
            s.close()
        row.result = f"all {conns} cut {row.seconds:.1f} s after they started"
    return row


async def accumulate_scratch(quick: bool) -> Row:
    n = 30 if quick else 100
    row = Row(5, f"{n} connections x one 4 MiB accumulate",
              "--max-receive-memory over all connections (16 MiB here); idle scratch given back")
    async with serving(row, "--capacity", "64MiB", "--max-receive-memory", "16MiB") as srv:
        async with await smb2.connect([srv.address]) as c:
            seg = (await c.create("acc", 4 * MiB)).segments[0]
        one = wire.hello() + wire.frame(Op.ACCUMULATE, np.ones(MiB // 2, np.int64).tobytes(), rid=2,
                                        segment=seg, flags=4 << 4)

        async def send() -> None:
            reader, writer = await asyncio.open_connection(*srv.address)
            writer.write(one)
            await wire.reply(reader)
            await wire.reply(reader)
            writer.close()
        async with Watch(srv, row):
            await asyncio.gather(*(send() for _ in range(n)))
        async with await smb2.connect([srv.address]) as c:
            got = (await (await c.attach("acc")).read(0, 4 * MiB)).view(np.int64)
            pool = (await c.stat())[0]["receive_memory"]
        row.result = (f"every accumulate applied: {bool((got == n).all())}; pool peak "
                      f"{pool['peak'] >> 20} of {pool['limit'] >> 20} MiB")
    return row


async def distinct_lock_names(quick: bool) -> Row:
    n = 2000 if quick else 10_000
    row = Row(6, f"{n:,} distinct lock names, each acquired, released and closed",
              "idle slots (no holder, no waiter, closed) reclaimed; 4096 slots")
    async with serving(row, "--capacity", "16MiB") as srv:
        async with await smb2.connect([srv.address]) as c:
            async with Watch(srv, row):
                for i in range(n):
                    lock = c.lock(f"task-{i}")
                    async with lock:
                        pass
                    await lock.close()
            locks = (await c.stat())[0]["locks"]
        row.result = f"all {n:,} served; {locks['open']} open, {locks['reclaimed']:,} slots reclaimed"
    return row


async def wrong_tokens(quick: bool) -> Row:
    row = Row(7, "wrong-token guesses for 2 s from one address",
              "one proof per connection, every proof checked (no back-off per address: it would hit the "
              "token holder beside the guesser); one WARNING per 10 s")
    with tempfile.TemporaryDirectory() as tmp:
        tok = Path(tmp) / "token"
        tok.write_bytes(TOKEN)
        tok.chmod(0o600)
        async with serving(row, "--capacity", "4MiB", "--auth-token-file", str(tok), token=TOKEN) as srv:
            checked = 0
            async with Watch(srv, row):
                end = time.monotonic() + 2.0
                while time.monotonic() < end:
                    checked += b"authentication failed" in await guess(srv.address, "127.0.0.1", b"guess")
            right = await guess(srv.address, "127.0.0.1", TOKEN) == b""
        warnings = sum("authentication failed" in ln for ln in srv.stderr().splitlines())
    row.result = (f"{checked} proofs checked and refused ({checked / row.seconds:.0f}/s, one connection "
                  f"each); the right token from there next: {'accepted' if right else 'REFUSED'}; "
                  f"{warnings} warning line(s)")
    return row


async def stale_handle(quick: bool) -> Row:
    row = Row(8, "a buffer handle from before a restart (no data directory), its segment id reused",
              "every data operation names the server incarnation: refused with StaleHandle, nothing sent")
    srv = ServerProcess("--capacity", "16MiB")
    try:
        client = await smb2.connect([srv.address], timeout=10)
        old = await client.create("job-a", MiB)
        await old.write(0, np.full(MiB, 0xAA, np.uint8))
        port = srv.port
        srv.stop()
        srv = ServerProcess("--capacity", "16MiB", "--port", str(port))
        async with await smb2.connect([srv.address], timeout=10) as second:
            other = await second.create("job-b", MiB)
            assert other.segments == old.segments      # the same segment id, another job's
            await other.write(0, np.full(MiB, 0xBB, np.uint8))
            async with Watch(srv, row):
                try:
                    await old.write(0, np.full(MiB, 0xEE, np.uint8))
                    outcome = "the old handle wrote"
                except smb2.StaleHandle as exc:
                    outcome = f"{type(exc).__name__}: {str(exc)[:130]}"
            intact = bool((await other.read(0, MiB) == 0xBB).all())
        row.result = f"{outcome}; the other job's buffer intact: {intact}"
        await client.close()
        await asyncio.wait_for(well_behaved(srv.address), 60)
        row.served_after = True
    finally:
        srv.stop()
    return row


async def stale_holder(quick: bool) -> Row:
    lease = 0.6
    row = Row(9, "a lock holder frozen (SIGSTOP) past its lease, then resumed and renewing",
              "leases tied to the holder's ticket: the next waiter gets the lock after the lease; "
              "the stale holder learns it lost at its next renewal")
    async with serving(row, "--capacity", "16MiB") as srv:
        address = f"{srv.address[0]}:{srv.address[1]}"
        async with await smb2.connect([address]) as c:
            await c.create("b", 64, stripe=64)
            a = await spawn({"servers": [address], "buffer": "b", "lock": "L", "action": "hold",
                             "mode": "park", "lease": lease, "transport": "tcp"})
            assert a.stdout is not None
            try:
                assert (await asyncio.wait_for(a.stdout.readline(), 30)).startswith(b"HELD")
                waiter = c.lock("L", lease=lease)
                async with Watch(srv, row):
                    os.kill(a.pid, signal.SIGSTOP)
                    await waiter.acquire(timeout=30)
                os.kill(a.pid, signal.SIGCONT)
                lost = (await asyncio.wait_for(a.stdout.readline(), 30)).decode().strip()
                await waiter.release()
            finally:
                if a.returncode is None:
                    os.kill(a.pid, signal.SIGCONT)
                    a.kill()
                await a.wait()
        row.result = f"the waiter got the lock {row.seconds:.2f} s after the freeze (lease {lease} s); " \
                     f"the resumed holder: {lost[:60]!r}"
    return row


async def fence_table(quick: bool) -> Row:
    keys = (1 << 16) + 100
    row = Row(10, f"fenced writes with {keys:,} distinct lock keys, then a stale token of the first",
              "a forgotten key raises its bucket's floor: a stale token is never accepted")
    async with serving(row, "--capacity", "16MiB") as srv:
        async with await smb2.connect([srv.address]) as c:
            buf = await c.create("f", 64, stripe=64)
            await buf.write(0, b"new", fence=smb2.Fence("elsewhere", 1000))
            async with Watch(srv, row):
                for first in range(0, keys, 256):
                    await asyncio.gather(*(buf.write(8, b"x", fence=smb2.Fence(f"k{i}", 5))
                                           for i in range(first, min(keys, first + 256))))
                try:
                    await buf.write(0, b"old", fence=smb2.Fence("elsewhere", 999))
                    outcome = "the stale token was ACCEPTED"
                except smb2.StaleFence:
                    outcome = "the stale token was refused"
        row.result = f"{outcome} after {keys:,} keys"
    return row


async def failed_save(quick: bool) -> Row:
    row = Row(11, "a save that fails at SIGTERM (a 1 MiB file size limit: disk full)",
              "reported on stderr; the server keeps serving what it held; no stray files")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        async with serving(row, "--capacity", "16MiB", "--data-dir", str(data)) as srv:
            async with await smb2.connect([srv.address]) as c:
                buf = await c.create("keep", 4 * MiB)
                want = np.random.default_rng(1).integers(0, 255, 4 * MiB, dtype=np.uint8)
                await buf.write(0, want)
            resource.prlimit(srv.proc.pid, resource.RLIMIT_FSIZE, (MiB, resource.RLIM_INFINITY))
            assert srv.proc.stderr is not None
            async with Watch(srv, row):
                srv.proc.send_signal(signal.SIGTERM)
                line = ""
                while "still serving" not in line:
                    line = await asyncio.wait_for(asyncio.to_thread(srv.proc.stderr.readline), 60)
            async with await smb2.connect([srv.address]) as c:
                kept = bool((await (await c.attach("keep")).read(0, 4 * MiB) == want).all())
            stray = sorted(p.name for p in data.iterdir() if p.name != ".lock")
            resource.prlimit(srv.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
            said = line.split("ERROR", 1)[-1].strip()
            row.result = f"said {said[:70]!r}; data kept: {kept}; stray files: {stray or 'none'}"
    return row


ATTACKS: dict[int, Callable[[bool], Awaitable[Row]]] = {
    1: silent_connections, 2: trickling_write, 3: parked_acquires, 4: unread_replies, 5: accumulate_scratch,
    6: distinct_lock_names, 7: wrong_tokens, 8: stale_handle, 9: stale_holder, 10: fence_table,
    11: failed_save}


# -- guards aimed at others, hoarded shm tickets, a client's
# lease, a flood of scrapes (attacks 20-24)

def token_file(tmp: str) -> str:
    tok = Path(tmp) / "token"
    tok.write_bytes(TOKEN)
    tok.chmod(0o600)
    return str(tok)


async def guesser_beside_token_holder(quick: bool) -> Row:
    seconds = 4.0 if quick else 20.0
    row = Row(20, f"a client with no token sends a wrong proof every 50 ms for {seconds:g} s from 127.0.0.1; "
              "the token holder on the same address connects every 0.5 s",
              "every proof of a connection is checked: a wrong one closes that connection only")
    with tempfile.TemporaryDirectory() as tmp:
        flags = ("--capacity", "8MiB", "--auth-token-file", token_file(tmp))
        async with serving(row, *flags, token=TOKEN) as srv:
            stop = asyncio.Event()
            served = tries = 0
            async with Watch(srv, row):
                task = asyncio.create_task(keep_guessing(srv.address, stop, 0.05))
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    tries += 1
                    with contextlib.suppress(smb2.Smb2Error):
                        async with await smb2.connect([srv.address], token=TOKEN, transport="tcp") as c:
                            served += bool(await c.stat())
                    await asyncio.sleep(0.5)
                stop.set()
                wrong = await task
    row.result = f"token holder served {served}/{tries} (was 0/40) beside {wrong} wrong proofs refused"
    return row


async def unauthenticated_crowd(quick: bool) -> Row:
    held_n, tries = 128, (10 if quick else 30)
    row = Row(21, f"{held_n} unauthenticated sockets held from 127.0.0.1, and more opened all along; "
              f"the token holder connects {tries} times from the same address",
              "--max-connections(-per-host): the oldest unauthenticated connection makes room; "
              "only authenticated ones fill a cap")
    with tempfile.TemporaryDirectory() as tmp:
        # the per-address cap at the number held, so that each new socket meets it
        flags = ("--capacity", "8MiB", "--auth-token-file", token_file(tmp), "--max-connections-per-host",
                 str(held_n))
        async with serving(row, *flags, token=TOKEN) as srv:
            held = await asyncio.to_thread(open_sockets, srv.address, held_n, wire.hello())
            stop = False
            opened = 0

            def churn() -> None:
                # as fast as one thread can: each new one makes the server
                # close an older one, which is then closed here too
                nonlocal opened
                mine: list[socket.socket] = []
                while not stop:
                    with contextlib.suppress(OSError):
                        mine.append(socket.create_connection(srv.address))
                        opened += 1
                    if len(mine) > 256:
                        mine.pop(0).close()
                for s in mine:
                    s.close()
            served, st = 0, {"unauthenticated_evicted": "?"}
            async with Watch(srv, row):
                churner = asyncio.create_task(asyncio.to_thread(churn))
                for _ in range(tries):
                    await asyncio.sleep(0.1)        # the churn goes on between tries
                    with contextlib.suppress(smb2.Smb2Error):
                        async with await smb2.connect([srv.address], token=TOKEN, transport="tcp") as c:
                            st = (await c.stat())[0]
                            served += 1
                stop = True
                await churner
            for s in held:
                s.close()
    row.result = (f"token holder served {served}/{tries} (was 3/30) while {opened} more were opened; "
                  f"{st['unauthenticated_evicted']} unauthenticated connections closed to make room")
    return row


async def hoarded_shm_tickets(quick: bool) -> Row:
    from smb2.server.shm import MAX_PENDING, MAX_PENDING_PER_OWNER
    from smb2.transport.tcp import TcpTransport
    conns, tries = MAX_PENDING // MAX_PENDING_PER_OWNER, (4 if quick else 10)
    row = Row(22, f"{conns} connections x {MAX_PENDING_PER_OWNER} shm tickets never claimed; then other "
              f"clients connect {tries} times each with shm and auto",
              f"at {MAX_PENDING} unclaimed tickets the connection holding the most loses its oldest; "
              "auto takes TCP when shm is refused")
    async with serving(row, "--capacity", "32MiB") as srv:
        hoard = [await TcpTransport.connect(srv.address) for _ in range(conns)]
        try:
            async with Watch(srv, row):
                for t in hoard:
                    for _ in range(MAX_PENDING_PER_OWNER):
                        await t.control({"cmd": "shm_grant", "segments": [LOCK_SEGMENT]})
                got: dict[str, int] = {"shm": 0, "auto": 0}
                for kind in ("shm", "auto") * tries:
                    with contextlib.suppress(smb2.Smb2Error):
                        async with await smb2.connect([srv.address], transport=kind) as c:
                            buf = await c.create(f"b{kind}{time.monotonic_ns()}", 4096)
                            await buf.write(0, b"ok")
                            got[kind] += c.transports == ["shm"] and bytes(await buf.read(0, 2)) == b"ok"
            async with await smb2.connect([srv.address], transport="tcp") as c:
                shm = (await c.stat())[0]["shm"]
        finally:
            for t in hoard:
                await t.close()
    row.result = (f"shm {got['shm']}/{tries} and auto {got['auto']}/{tries} mapped over shm (were 0); "
                  f"{shm['tickets_withdrawn']} hoarded ticket(s) withdrawn")
    return row


async def client_chosen_lease(quick: bool) -> Row:
    lease = 1.0
    row = Row(23, "the first opener of a lock asks for lease=3600; a holder with the lock's lease is "
              "frozen (SIGSTOP)",
              f"a client's lease at most --lock-max-lease (default the server's --lock-lease, {lease:g} s here)")
    async with serving(row, "--capacity", "16MiB", "--lock-lease", str(lease)) as srv:
        address = f"{srv.address[0]}:{srv.address[1]}"
        async with await smb2.connect([address]) as c:
            await c.create("b", 64, stripe=64)
            first = c.lock("L", lease=3600)
            try:
                await first.acquire(timeout=5)
                await first.release()
                said = "ACCEPTED"
            except smb2.BadRequest as exc:
                said = str(exc).split(": ", 1)[-1]
            a = await spawn({"servers": [address], "buffer": "b", "lock": "L", "action": "hold",
                             "mode": "park", "transport": "tcp"})
            assert a.stdout is not None
            try:
                assert (await asyncio.wait_for(a.stdout.readline(), 30)).startswith(b"HELD")
                waiter = c.lock("L")
                async with Watch(srv, row):
                    os.kill(a.pid, signal.SIGSTOP)
                    await waiter.acquire(timeout=30)
                await waiter.release()
            finally:
                await reap(a)       # stopped or not
    row.result = (f"lease=3600 refused ({said[:60]!r}); the waiter got the lock {row.seconds:.2f} s after "
                  "the freeze (was >= 15 s)")
    return row


async def scrape_flood(quick: bool) -> Row:
    # the flood the test runs: raw HTTP connections, scraping without pause
    from smb2.testing.metrics import FLOOD
    seconds, locks = (3.0 if quick else 10.0), 2000
    row = Row(24, f"32 connections scraping /metrics without pause for {seconds:g} s, {locks:,} locks open",
              "the numbers read on the loop at most every 0.25 s (waiting scrapes share a reading), rendered "
              "in a thread; 16 scrape connections at once; ':PORT' binds loopback")
    async with serving(row, "--capacity", "16MiB", "--metrics", ":0") as srv:
        assert srv.proc.stdout is not None
        url = srv.proc.stdout.readline().split()[-1]
        async with await smb2.connect([srv.address], transport="tcp") as c:
            for first in range(0, locks, 250):
                held = [c.lock(f"L{k}", mode="park") for k in range(first, first + 250)]
                await asyncio.gather(*(lock.acquire() for lock in held))
                await asyncio.gather(*(lock.release() for lock in held))
            buf = await c.create("data", 4096)

            async def p50(n: int = 500) -> float:
                times = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    await buf.read(0, 64)
                    times.append(time.perf_counter() - t0)
                return sorted(times)[n // 2]
            quiet = await p50()
            cpu0 = cpu_seconds(srv.proc.pid)
            async with Watch(srv, row):
                flood = await asyncio.create_subprocess_exec(sys.executable, "-c", FLOOD, url, "32", str(seconds),
                                                             stdout=asyncio.subprocess.PIPE)
                await asyncio.sleep(1.0)
                busy = await p50()
                out, _ = await flood.communicate()
            cpu = cpu_seconds(srv.proc.pid) - cpu0
    served, readings = map(int, out.split())
    row.result = (f"bound to {url.split('/')[2]}; {served} scrapes from {readings} readings, {cpu:.2f} s of "
                  f"server CPU in {row.seconds:.1f} s; 64-byte read p50 {quiet * 1e6:.0f} us quiet, "
                  f"{busy * 1e6:.0f} us during the flood (was 29 us -> 4.5 ms)")
    return row


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


ISSUE_22_GUARDS: dict[int, Callable[[bool], Awaitable[Row]]] = {
    20: guesser_beside_token_holder, 21: unauthenticated_crowd, 22: hoarded_shm_tickets,
    23: client_chosen_lease, 24: scrape_flood}
ATTACKS.update(ISSUE_22_GUARDS)

# -- what a same-host client does through shm --

async def sigterm_under_shm_writers(quick: bool) -> Row:
    writers, tries = 4, 2 if quick else 3
    row = Row(12, f"SIGTERM with {writers} shm clients writing 4 MiB regions, then a restart ({tries} tries)",
              "segments frozen before the save, each chunk hashed and written from a copy: the restart "
              "starts, every acknowledged write present")
    with tempfile.TemporaryDirectory() as tmp:
        flags = ("--data-dir", tmp, "--capacity", "256MiB")
        outcomes: list[str] = []
        stops: list[float] = []
        for attempt in range(tries):
            srv = ServerProcess(*flags)
            try:
                if attempt == 0:
                    async with await smb2.connect([srv.address], transport="tcp") as c:
                        await c.create("shared", writers * REGION)
                acked = [0] * writers
                stop = threading.Event()
                threads = await asyncio.to_thread(start_writers, srv.address, "shared", writers, acked, stop)
                t0 = time.monotonic()
                async with Watch(srv, row):
                    code = srv.stop()
                stops.append(time.monotonic() - t0)
                stop.set()
                for t in threads:
                    t.join(10)
            finally:
                srv.stop()
            srv = ServerProcess(*flags)       # fails the attack if the save was torn
            try:
                async with await smb2.connect([srv.address], transport="tcp") as c:
                    buf = await c.attach("shared")
                    present = 0
                    for r in range(writers):
                        got = (await buf.read(r * REGION, REGION)).view(np.int64)
                        present += int(got.min() >= acked[r])
                outcomes.append(f"exit {code}, restarted, {present}/{writers} acknowledged")
                if attempt == tries - 1:
                    await asyncio.wait_for(well_behaved(srv.address), 60)
                    row.served_after = True
            finally:
                srv.stop()
    row.result = "; ".join(outcomes) + \
        f" (SIGTERM to exit, the save of {writers * REGION >> 20} MiB included: " + \
        ", ".join(f"{t:.2f}" for t in stops) + " s)"
    return row


async def resize_memfds(quick: bool) -> Row:
    row = Row(13, "ftruncate (to 0, to half, +256 MiB) on every handed-out memory file, lock table included",
              "memfds sealed F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL: EPERM; no SIGBUS, no memory outside --capacity")
    async with serving(row, "--capacity", "16MiB") as srv:
        async with await smb2.connect([srv.address], transport="shm") as c:
            buf = await c.create("sealed", 4 * MiB)
            await buf.write(0, np.ones(MiB, np.uint8))
            grant = await shm_of(c).control({"cmd": "shm_grant", "segments": [LOCK_SEGMENT, buf.segments[0]]})
            fds = claim_fds(grant["path"], grant["ticket"])
            refused = tried = 0
            async with Watch(srv, row):
                for fd in fds:
                    for new in (0, os.fstat(fd).st_size // 2, os.fstat(fd).st_size + (256 << 20)):
                        tried += 1
                        try:
                            os.ftruncate(fd, new)
                        except PermissionError:
                            refused += 1
                for fd in fds:
                    os.close(fd)
                async with c.lock("after"):     # the lock sweep and the table: still there
                    await asyncio.sleep(0.2)
            alive = srv.proc.poll() is None
        row.result = f"{refused} of {tried} ftruncates refused (EPERM); server alive: {alive}"
    return row


async def now_serving_past_next(quick: bool) -> Row:
    row = Row(14, "one compare-and-swap over shm: a lock's now_serving 2^30 past next_ticket; "
                  "then a shm and a TCP waiter with acquire(timeout=3)",
              "waiters yield and back off, the sweep (<= 50 ms) sees the impossible words, logs and resets "
              "the lock with higher tickets")
    async with serving(row, "--capacity", "16MiB") as srv:
        async with await smb2.connect([srv.address], transport="shm") as attacker, \
                await smb2.connect([srv.address], transport="shm") as shm_user, \
                await smb2.connect([srv.address], transport="tcp") as tcp_user:
            off = await lock_offset(attacker, "L")
            tr = shm_of(attacker)
            nxt = await tr.fetch_add(LOCK_SEGMENT, off, 0)
            async with Watch(srv, row):
                await tr.compare_swap(LOCK_SEGMENT, off + 8, nxt, nxt + (1 << 30))
                took = await asyncio.gather(acquire_within(shm_user.lock("L"), 3.0),
                                            acquire_within(tcp_user.lock("L"), 3.0))
            nxt, serving_now = await lock_words(tcp_user, "L")
            resets = (await tcp_user.stat())[0]["locks"]["resets"]
    logged = any("impossible words" in ln for ln in srv.stderr().splitlines())    # once it stopped
    row.result = (f"shm waiter returned in {took[0]:.3f} s, TCP waiter in {took[1]:.3f} s; "
                  f"{resets} reset(s), logged: {logged}; queued after: {nxt - serving_now}")
    return row


async def next_ticket_plus_2_40(quick: bool) -> Row:
    row = Row(15, "2^40 added to a held lock's next_ticket over TCP, then a new acquire(timeout=3)",
              f"more queued than (connections + 1) x {MAX_TICKETS_PER_CONNECTION:,}: reset at once, "
              "the sender named, the holder's token fenced off")
    async with serving(row, "--capacity", "16MiB") as srv:
        async with await smb2.connect([srv.address], transport="tcp") as attacker, \
                await smb2.connect([srv.address], transport="shm") as user:
            held = user.lock("L")
            await held.acquire()
            off = await lock_offset(attacker, "L")
            t = attacker.links[0].open
            assert t is not None
            async with Watch(srv, row):
                await t.fetch_add(LOCK_SEGMENT, off, 1 << 40)
                other = user.lock("L")
                await other.acquire(timeout=3.0)
            try:
                await held.release(wait=True)
                holder = "the old holder released as if nothing happened"
            except smb2.StaleFence:
                holder = "the old holder's release: StaleFence"
            await other.release()
    named = [ln for ln in srv.stderr().splitlines() if "impossible words" in ln]     # once it stopped
    row.result = (f"next acquire in {row.seconds:.3f} s; {holder}; "
                  f"logged: {named[0].split('); ')[-1][:40] if named else 'nothing'!r}")
    return row


async def dropped_shm_lock_names(quick: bool) -> Row:
    n = 5000
    row = Row(16, f"{n:,} distinct lock names over one shm connection, each Lock acquired, released and "
                  "dropped (no close)", "renewal timers hold a Lock weakly: a dropped Lock frees its "
                  "slot and its ticket record at once; 4096 slots")
    async with serving(row, "--capacity", "16MiB") as srv:
        async with await smb2.connect([srv.address], transport="shm") as c:
            async def task(i: int) -> None:
                lock = c.lock(f"task-{i}")
                await lock.acquire()
                await lock.release()
            async with Watch(srv, row):
                for i in range(n):
                    await asyncio.create_task(task(i))
            locks = (await c.stat())[0]["locks"]
        row.result = f"all {n:,} served; {locks['open']} open, {locks['reclaimed']:,} slots reclaimed"
    return row


ATTACKS.update({12: sigterm_under_shm_writers, 13: resize_memfds, 14: now_serving_past_next,
                15: next_ticket_plus_2_40, 16: dropped_shm_lock_names})


def table(rows: list[Row]) -> str:
    return report.table(
        ["#", "attack", "bound", "server RSS MiB (before / peak / after)", "time", "measured", "served after"],
        [[r.attack, r.what, r.bound, f"{r.rss_before >> 20} / {r.rss_peak >> 20} / {r.rss_after >> 20}",
          r.seconds, r.result, "yes" if r.served_after else "NO"] for r in rows],
        formats=[None, None, None, None, "{:.2f} s"], markdown=True)


async def quiet_round_trip() -> float:
    """The 64-byte round trip of a server no one attacks: what the rows'
    times are read against."""
    srv = ServerProcess()
    try:
        return await report.round_trip_us([srv.endpoint])
    finally:
        srv.stop()


async def run(which: list[int], quick: bool) -> list[Row]:
    rows = []
    for i, n in enumerate(which):
        report.progress("attacks", i, len(which), f"{n}: {ATTACKS[n].__name__} ...")
        try:
            rows.append(await ATTACKS[n](quick))
        except Exception as exc:     # one attack's failure is a row, not the end of the run
            rows.append(Row(n, ATTACKS[n].__name__, "?", result=f"FAILED: {type(exc).__name__}: {exc}"))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--only", help="attacks to run, e.g. 1,4,7 (default all)")
    ap.add_argument("--quick", action="store_true", help="smaller attacks (fewer connections, names)")
    ap.add_argument("--json", default="bench-results/attacks.json", help="where to write the rows ('' for none)")
    args = ap.parse_args(argv)
    which = sorted(ATTACKS) if not args.only else [int(x) for x in args.only.split(",")]
    unknown = [n for n in which if n not in ATTACKS]
    if unknown:
        ap.error(f"no attack {unknown}: they are {', '.join(map(str, sorted(ATTACKS)))}")
    rows = asyncio.run(run(which, args.quick))
    print(table(rows))
    if args.json:
        report.write_json(args.json, {"version": VERSION, "quick": args.quick,
                                      "rows": [dataclasses.asdict(r) for r in rows]},
                          round_trip_64B_us=asyncio.run(quiet_round_trip()))
    return 0 if all(r.served_after for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
