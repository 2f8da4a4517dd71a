"""A server's part in its replicated cluster: the view and its lease, the
replicated ops (checked, applied once, forwarded: see ``forwarding``),
rejoin and sync, and the moved copies of a lost server's part."""


from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any, Final

from ... import _core, auth
from ...errors import ErrorCode
from ...membership import Credentials, Holder, Membership, Substitute, View, etcd_user, open_membership, parse_url
from ...placement import Placement
from ...protocol import (
    FENCE_SIZE,
    FLAG_FENCED,
    FLAG_FORWARDED,
    FLAG_REPLICATED,
    H_FLAGS,
    H_OFFSET,
    H_OP,
    H_SEGMENT,
    REPL_PREFIX_SIZE,
    Header,
    Op,
)
from .. import sparse
from ..peers import LINK_FAILED, PeerLink, error_message
from ..segment import Refused, Segment
from ..viewcheck import lost_copies, lost_groups, placement, stripe_groups
from .dedup import Dedup, Entry, TooManyClients, prefix
from .forwarding import FORWARD_TIMEOUT, BufferKey, Outbox, Pending, Stripe, apply_op, resolver
from .moved import MovedCopies
from .needs import Client, Server

log = logging.getLogger("smb2.server.replication")

# how often the view is read from the membership service in the background
# (a request that carries a newer epoch reads it at once)
REFRESH_EVERY: Final = 0.5
# the server's lease on its view (docs/design.md, "Why no acknowledged update
# is lost"): a primary acknowledges an op only within this of the start of
# its last read of the view from the membership service that returned the
# epoch it holds, on the monotonic clock; past it, it reads the view first.
# Below the clients' view lease (smb2.replication.VIEW_LEASE, 1 s) by the
# clock-rate margin stated there, and above REFRESH_EVERY, so the background
# read keeps it fresh and an acknowledgement waits for no read of its own.
SERVER_LEASE: Final = 0.8
# views followed after a server was taken out of the members before it can no
# longer vouch for its restored copies (Replication._held_back)
MAX_VOUCH_CHAIN: Final = 1000
# start() waits this long for the server to be a member before it lets
# clients in (it goes on catching up in the background)
START_WAIT: Final = 3.0
# a stripe copy goes out in pieces of this size (and so paced)
COPY_CHUNK: Final = 1 << 20


class Replication:
    """This server's part in its replicated cluster (one per MemoryServer
    started with ``--membership``)."""

    def __init__(self, server: Server, url: str, me: str) -> None:
        self.server = server
        self.url = url
        # this server's name in the view ("host:port")
        self.me = me
        self.membership: Membership | None = None
        self.view = View(epoch=0, members=())
        # time.monotonic() at the start of the last read (or compare-and-set)
        # of the view in the membership service that returned self.view's
        # epoch: the start of the server's lease (SERVER_LEASE)
        self.confirmed_at = -SERVER_LEASE
        # acknowledgements held back for a read of the view (the lease had run out)
        self.lease_waits = 0
        # random per process: the client id of the stripe copies this server sends
        self.copy_id = int.from_bytes(os.urandom(8), "little")
        self._copy_seq = 0
        self.dedup = Dedup(server.dedup_clients)
        self.outboxes: dict[str, Outbox] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._refreshing: asyncio.Future[View] | None = None
        # "starting" (not yet read the view), "joining" (catching up), "member"
        self.state = "starting"
        self.caught_up_at: float | None = None
        self.catch_up_seconds = 0.0
        self.started = 0.0
        self.copied_bytes = 0
        self.copy_rate = 0
        self.diverged = 0
        self.joins = 0
        # the copies of lost servers' parts this server holds in their stead
        self.moved = MovedCopies(self)
        # views read from etcd that would have left a stripe without a member
        # copy, refused (viewcheck.py); and how many of them this server undid
        self.refused_views = 0
        self.restored_views = 0
        # What a restarted server can vouch for (_held_back): the last epoch at which this server's
        # own copies held every acknowledged update (it was a member then, or
        # restarted from the save that ended its last run, never taken out),
        # the views it installed since (None: a gap, some epoch unseen)
        self.vouch_epoch: int | None = None
        self.since_vouch: list[View] | None = []
        # the operator's word (smb2 repair --accept): take this server's copies
        # of stripes no member holds as they are
        self.accept_as_is = False
        # stripes without a member copy this server could not recover, in
        # the words of smb2 repair; and the stripes it took back on the operator's word
        self.stuck: list[dict[str, Any]] = []
        self.recovered = 0

    # -- lifecycle --------------------------------------------------------
    async def start(self) -> None:
        self.membership = open_membership(self.url, self.credentials())
        self.started = time.monotonic()
        self.spawn(self._refresh_loop())
        joined = self.spawn(self.join())
        # a new cluster's servers start side by side: wait a little for the
        # others, so that clients find this one a member at once
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(joined), START_WAIT)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for box in self.outboxes.values():
            await box.close()
        if self.membership is not None:
            await self.membership.close()

    def credentials(self) -> Credentials | None:
        """The servers' etcd user (None: a cluster without a peer token, whose
        etcd must then run without authentication)."""
        if self.server.peer_token is None:
            return None
        cluster = parse_url(self.url)[1]
        return Credentials(etcd_user(cluster), auth.etcd_password(self.server.peer_token, cluster))

    def spawn(self, work: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def outbox(self, address: str) -> Outbox:
        box = self.outboxes.get(address)
        if box is None:
            box = self.outboxes[address] = Outbox(self, address)
        return box

    # -- the view ---------------------------------------------------------
    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_EVERY)
            try:
                await self.refresh()
            except Exception as exc:
                log.warning("cannot read the membership view from %s: %s", self.url, exc)
                continue
            if self.state == "member" and self.me not in self.view.members:
                log.warning("this server was removed from the view (epoch %d): it catches up and rejoins",
                            self.view.epoch)
                self.state = "joining"
                self.spawn(self.join())
            elif self.state == "member" and self.server.replace_after > 0:
                self.moved.next_round()

    async def refresh(self) -> View:
        """Read the view now (one read for all who ask at once) and install
        it if it is newer."""
        if self._refreshing is None:
            self._refreshing = asyncio.get_running_loop().create_future()
            try:
                assert self.membership is not None
                started = time.monotonic()
                view = await self.membership.view()
                self.install(view, started)
                self._refreshing.set_result(self.view)
            except BaseException as exc:
                self._refreshing.set_exception(exc)
                self._refreshing.exception()      # retrieved: the callers re-raise it
                raise
            finally:
                self._refreshing = None
            return self.view
        return await asyncio.shield(self._refreshing)

    def install(self, view: View, started: float) -> None:
        """Take ``view``, read from the membership service by a request that
        started at ``started`` (monotonic), if it is newer; a read that
        returns the epoch held renews the lease.  A newer view that would
        leave a stripe without a member copy is refused (viewcheck.py)."""
        if view.epoch > self.view.epoch and self.view.epoch > 0:
            lost = lost_copies(list(self.server.by_name.values()), self.view, view)
            if lost:
                self._refuse(view, lost)
                return
        if view.epoch > self.view.epoch:
            log.info("view epoch %d: members %s, joining %s", view.epoch, ",".join(view.members),
                     ",".join(view.joining) or "none")
            self._follow(self.view, view)
            self.view = view
        if view.epoch == self.view.epoch:
            # the view was current at some moment after ``started``: no newer
            # one was written before then
            self.confirmed_at = max(self.confirmed_at, started)

    def _follow(self, held: View, view: View) -> None:
        """Keep what _held_back needs to know of ``view``, installed after ``held``."""
        if held.epoch == 0:
            # the first view after a start: the restored copies are whole if the
            # last run ended with a save and nobody took this server out since
            # (an update acknowledged without it needed it out of the members)
            if self.server.restored_clean and self.me in view.members:
                self._vouch(view.epoch)
        elif self.state == "member" and self.me in view.members:
            self._vouch(view.epoch)
        elif self.since_vouch is not None:
            if view.epoch != held.epoch + 1 or len(self.since_vouch) >= MAX_VOUCH_CHAIN:
                self.since_vouch = None
            else:
                self.since_vouch.append(view)

    def _vouch(self, epoch: int) -> None:
        self.vouch_epoch, self.since_vouch = epoch, []

    def vouches_for(self, group: Sequence[str]) -> str | None:
        """None where this server may take its own copy of the stripe on
        ``group``, which has no member copy, as the stripe's: only on the
        operator's word (``smb2 repair --accept``); else why not, in words."""
        if self.accept_as_is:
            return None
        if self.vouch_epoch is None and self.server.restored:
            return ("it restarted from a save older than its last run (that run ended without one): "
                    "updates acknowledged after the save may be missing")
        return "no member copy is left to catch up from, and whether this copy holds every update is not known"

    def _refuse(self, view: View, lost: list[str]) -> None:
        self.refused_views += 1
        held = self.view
        log.error("refused view epoch %d (members %s, joining %s), written outside the servers: it would leave "
                  "%s without a member copy; this server keeps epoch %d%s", view.epoch, ",".join(view.members),
                  ",".join(view.joining) or "none", "; ".join(lost), held.epoch,
                  ", and writes it back" if view.epoch == held.epoch + 1 else
                  "; epochs between were missed here, so it cannot tell what the others saw: put the view back "
                  "by hand (docs/reliability.md)")
        if view.epoch == held.epoch + 1:
            self.spawn(self._restore(held, view))

    async def _restore(self, held: View, refused: View) -> None:
        """Write ``held`` again, as the epoch after ``refused``: nobody used
        ``refused`` (module doc of viewcheck.py), so its servers missed nothing."""
        assert self.membership is not None
        started = time.monotonic()
        try:
            view = await self.membership.change(refused, members=held.members, joining=held.joining,
                                                replaced=held.replaced)
        except Exception as exc:
            log.error("could not write back the view of epoch %d: %s", held.epoch, exc)
            return
        if view.epoch == refused.epoch + 1 and view.members == held.members:
            self.restored_views += 1
            log.warning("wrote back the view of epoch %d as epoch %d", held.epoch, view.epoch)
        self.install(view, started)

    async def serve_view(self) -> View:
        """A client's read of the view (clients hold no etcd credentials): read
        from etcd now, so the client's lease may count from its request."""
        return await self.refresh()

    async def serve_change(self, epoch: int, members: Sequence[str], joining: Sequence[str]) -> View:
        """A client's change of the view from ``epoch`` (it takes out servers it
        found failed): refused (CONFLICT) where it would leave a stripe of a
        buffer this server knows without a member copy; else a compare-and-set
        whose result, ours or another writer's, is returned."""
        current = await self.refresh()
        if current.epoch != epoch:
            return current
        new = View(epoch + 1, tuple(members), tuple(joining), current.replaced)
        if not new.members:
            raise Refused(ErrorCode.BAD_REQUEST, "a view needs at least one member")
        lost = lost_copies(list(self.server.by_name.values()), current, new)
        if lost:
            away = sorted(set(current.members + current.joining) - set(new.members + new.joining))
            raise Refused(ErrorCode.CONFLICT, f"taking {', '.join(away)} out of the view would leave "
                          f"{'; '.join(lost)} without a member copy: they stay in the view")
        return await self.change(current, new.members, new.joining)

    def leased(self) -> bool:
        """Whether this server's view was confirmed within SERVER_LEASE."""
        return time.monotonic() - self.confirmed_at < SERVER_LEASE

    async def change(self, expected: View, members: Sequence[str], joining: Sequence[str],
                     replaced: Sequence[Substitute] | None = None) -> View:
        assert self.membership is not None
        started = time.monotonic()
        view = await self.membership.change(expected, members=tuple(members), joining=tuple(joining),
                                            replaced=replaced)
        self.install(view, started)
        return self.view

    # -- placement ----------------------------------------------------------
    @staticmethod
    def placement(seg: Segment) -> Placement:
        return placement(seg)

    def holders_of(self, seg: Segment, replicas: Sequence[int]) -> list[Holder]:
        """Where the copies of a stripe (placed on ``replicas``) are in the
        view: on their own servers, or moved (View.holders)."""
        return self.view.holders([seg.servers[s] for s in replicas])

    def backups_of(self, seg: Segment, replicas: Sequence[int], primary: str) -> list[Holder]:
        """The stripe's other copies that are members or joining."""
        return [h for h in self.holders_of(seg, replicas) if h.server != primary and h.state != "out"]

    # -- ops ---------------------------------------------------------------
    def on_frame(self, conn: Client, hdr: Header, payload: memoryview) -> None:
        """A replicated or forwarded op, whole (its header was checked)."""
        epoch = _core.unpack_u64(payload, 0)
        if epoch > self.view.epoch:
            # read the view first; this connection's later frames wait (order)
            data = memoryview(bytes(payload))
            conn.hold_input("epoch")
            self.spawn(self._after_refresh(conn, hdr, data))
            return
        self.handle(conn, hdr, payload)

    async def _after_refresh(self, conn: Client, hdr: Header, payload: memoryview) -> None:
        try:
            try:
                await self.refresh()
            except Exception as exc:
                log.warning("cannot read the membership view from %s: %s", self.url, exc)
            self.handle(conn, hdr, payload)
        except Refused as exc:
            conn.refuse(hdr, exc.code, str(exc), **exc.extra)
        except Exception as exc:
            log.exception("internal error in a replicated op")
            conn.refuse(hdr, ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            conn.unhold_input("epoch")

    def handle(self, conn: Client, hdr: Header, payload: memoryview) -> None:
        op, flags, offset = hdr[H_OP], hdr[H_FLAGS], hdr[H_OFFSET]
        forwarded = bool(flags & FLAG_FORWARDED)
        epoch, client, seq = (_core.unpack_u64(payload, 0), _core.unpack_u64(payload, 8),
                              _core.unpack_u64(payload, 16))
        view = self.view
        if epoch < view.epoch:
            raise Refused(ErrorCode.STALE_EPOCH, f"the op carries view epoch {epoch}; this server "
                           f"knows epoch {view.epoch}", epoch=view.epoch)
        if epoch > view.epoch:
            raise Refused(ErrorCode.NOT_MEMBER, f"this server cannot read view epoch {epoch} from the "
                           f"membership service (it knows {view.epoch})", epoch=view.epoch)
        if self.state != "member" and not (forwarded and self.me in view.joining):
            raise Refused(ErrorCode.NOT_MEMBER, f"server {self.me} is not a member of view epoch "
                           f"{view.epoch} ({'catching up' if self.me in view.joining else self.state})",
                           epoch=view.epoch)
        seg = self.server.segments.get(hdr[H_SEGMENT])
        if seg is None:
            raise Refused(ErrorCode.NO_SUCH_BUFFER, f"no segment {hdr[H_SEGMENT]} (destroyed while the "
                          "request was being received)")
        placement = self.placement(seg)
        stripe, _ = placement.stripe_at(seg.index, offset)
        replicas = placement.replicas_of(stripe)
        first = view.primary([seg.servers[s] for s in replicas])
        primary = None if first is None else first.server
        where = Stripe(seg, placement, stripe)
        if forwarded:
            if conn.peer_server is None or conn.peer_server != primary:
                raise Refused(ErrorCode.ACCESS_DENIED, f"forwarded ops of stripe {stripe} of {seg.name!r} are "
                              f"taken only from its primary {primary} (this connection is "
                              f"{conn.peer_server or 'a client'})")
        elif first is None or (first.server, first.slot) != (self.me, seg.servers[seg.index]):
            # (the primary's copy may be one it holds for a lost server: the op
            # must name that segment, not this server's own part)
            raise Refused(ErrorCode.NOT_MEMBER, f"server {self.me} is not the primary of stripe {stripe} of "
                           f"{seg.name!r} in view epoch {view.epoch} ({primary} is)", epoch=view.epoch)
        try:
            # a client's first op at this server as its primary makes its
            # record; a forwarded op always does (its primary took it)
            rec = self.dedup.record(client, overfull=forwarded)
        except TooManyClients:
            raise Refused(ErrorCode.CONFLICT, f"server {self.me} already remembers the recent ops of "
                          f"{self.dedup.clients} clients, each heard of within {self.dedup.idle:g} s: a new "
                          "client is refused rather than forget another's (its retry could be applied twice); "
                          "retry later, or raise --dedup-clients") from None
        entry = rec.entries.get(seq)
        if entry is not None:
            if forwarded or entry.waiters is not None:
                self._wait_or_answer(entry, conn, hdr)
            else:
                # a retry: answer it once every backup of the view now holds the op
                entry.waiters = [(conn, hdr)]
                self.spawn(self.settle(where, entry, {}))
            return
        if seq <= rec.floor:
            raise Refused(ErrorCode.CONFLICT, f"op {seq} of client {client:016x} is older than the ops of "
                          "that client this server remembers: it may have been applied; not applied again")
        body = REPL_PREFIX_SIZE
        fence = b""
        if flags & FLAG_FENCED:
            key, token = _core.unpack_u64(payload, body), _core.unpack_u64(payload, body + 8)
            fence = bytes(payload[body:body + FENCE_SIZE])
            if forwarded:
                # the primary checked it; a backup only learns the token, so that
                # as the stripe's next primary it refuses the older ones too
                self.server.locks.note_fence(key, token)
            elif not self.server.locks.check_fence(key, token):
                raise Refused(ErrorCode.STALE_FENCE, f"write fenced with token {token} refused: the lock was "
                              "lost (lease expired, released, or a newer holder wrote here)")
            body += FENCE_SIZE
        data = payload[body:]
        if op == Op.ACCUMULATE_SPARSE:
            # every index within the op's stripe (a copy holds whole stripes,
            # each at a multiple of the stripe), checked before anything is
            # applied or remembered: a refused op leaves every copy as it was
            lo = offset - offset % placement.stripe
            sparse.span(seg, flags, offset, data, within=(lo, lo + placement.stripe))
        result = apply_op(seg, op, flags, offset, data, self.server.add)
        self.server.bytes_in += len(data)
        entry = Entry(result)
        self.dedup.put(rec, seq, entry)
        if forwarded:
            conn.reply(hdr, result)
            return
        entry.waiters = [(conn, hdr)]
        backups = self.backups_of(seg, replicas, self.me)
        if not backups:
            self.acknowledge(where, entry)
            return
        pending = Pending(self, where, entry, [b.server for b in backups])
        fwd_flags = (flags & ~FLAG_REPLICATED) | FLAG_FORWARDED
        head = prefix(view.epoch, client, seq) + fence
        # a copy: the payload is a view of this connection's inbox, reused by
        # the next frame, and a socket keeps what it could not send yet by
        # reference (uvloop)
        copied = bytes(data)
        full = None
        within = offset - placement.offset_on(seg.index, stripe)
        for b in backups:
            box = self.outbox(b.server)
            off = placement.offset_on(seg.servers.index(b.slot), stripe) + within
            box.forward(_key(seg, b), op, fwd_flags, off, (head, copied), pending.callback(b.server))
            if box.full:
                full = box
        if full is not None:
            full.block(conn)

    def _wait_or_answer(self, entry: Entry, conn: Client, hdr: Header) -> None:
        if entry.waiters is not None:
            entry.waiters.append((conn, hdr))
        else:
            conn.reply(hdr, entry.result)

    def acknowledge(self, where: Stripe, entry: Entry) -> None:
        """Answer a primary's op that every backup holds: at once within the
        lease; else once a read of the view confirmed this server is still
        the stripe's primary (settle), so that a primary paused or cut off
        past its lease acknowledges nothing under a view already replaced."""
        if self.leased():
            self.answer(entry)
        else:
            self.lease_waits += 1
            self.spawn(self.settle(where, entry, {}))

    def answer(self, entry: Entry, code: ErrorCode | None = None, message: str = "",
               **extra: Any) -> None:
        waiters, entry.waiters = entry.waiters or [], None
        for conn, hdr in waiters:
            if code is None:
                conn.reply(hdr, entry.result)
            else:
                conn.refuse(hdr, code, message, **extra)

    async def settle(self, where: Stripe, entry: Entry, failed: dict[str, str]) -> None:
        """Answer an op whose backups did not all take it under the view its
        forwards carried: a failed member backup is reported
        (BACKUP_FAILED: the client removes it from the view and retries);
        otherwise read the view, copy the stripe to every live backup that
        does not hold the op yet, then answer, within the lease of that read
        (else read it again)."""
        try:
            members = set(self.view.members)
            dead = [b for b in failed if b in members]
            joining = [b for b in failed if b not in members]
            for b in joining:
                # a joining server that missed an update must start over
                self.spawn(self.kick(b))
            if dead:
                self.answer(entry, ErrorCode.BACKUP_FAILED, f"backup {dead[0]} of buffer {where.seg.name!r} "
                            f"failed ({failed[dead[0]]})", backup=dead[0])
                return
            while True:
                await self.refresh()
                if self.me not in self.view.members:
                    self.answer(entry, ErrorCode.NOT_MEMBER, f"server {self.me} was removed from the view "
                                f"(epoch {self.view.epoch})", epoch=self.view.epoch)
                    return
                replicas = where.placement.replicas_of(where.index)
                first = self.view.primary([where.seg.servers[s] for s in replicas])
                if first is None or (first.server, first.slot) != (self.me, where.seg.servers[where.seg.index]):
                    self.answer(entry, ErrorCode.STALE_EPOCH, f"server {self.me} is no longer the primary of "
                                f"the stripe (epoch {self.view.epoch})", epoch=self.view.epoch)
                    return
                missing = [b for b in self.backups_of(where.seg, replicas, self.me) if b.server not in entry.acked]
                failed = await self.push_stripes(where.seg, [where.index], missing, pace=False) if missing else {}
                dead = [b for b in failed if b in self.view.members]
                if dead:
                    self.answer(entry, ErrorCode.BACKUP_FAILED, f"backup {dead[0]} of buffer "
                                f"{where.seg.name!r} failed ({failed[dead[0]]})", backup=dead[0])
                    return
                entry.acked = entry.acked | frozenset(b.server for b in missing if b.server not in failed)
                if self.leased():
                    # still within the lease of the read above (the copies
                    # may have taken longer: then read the view again)
                    self.answer(entry)
                    return
        except Exception as exc:
            self.answer(entry, ErrorCode.NOT_MEMBER, f"server {self.me} cannot confirm the op under the "
                        f"current view: {exc}", epoch=self.view.epoch)

    async def kick(self, backup: str) -> None:
        """Take a joining server out of ``joining`` (it missed an update):
        it notices and starts its catch-up again."""
        with contextlib.suppress(Exception):
            view = await self.refresh()
            if backup in view.joining:
                await self.change(view, view.members, [j for j in view.joining if j != backup])
                log.warning("removed joining server %s from the view: it missed a forwarded update", backup)

    # -- stripe copies (repair, rejoin) -------------------------------------
    async def push_stripes(self, seg: Segment, stripes: Sequence[int], targets: Sequence[Holder],
                           *, pace: bool = True) -> dict[str, str]:
        """Copy stripes of ``seg`` (this server's copy) to the copies
        ``targets`` through their servers' ordered outboxes (each piece is
        copied when it is queued, so no update that follows it is
        overwritten); paced at ``--repair-rate`` when ``pace``.  Returns the
        target servers that failed, with why."""
        placement = self.placement(seg)
        loop = asyncio.get_running_loop()
        futures: list[tuple[str, asyncio.Future[tuple[int, bytes]]]] = []
        failed: dict[str, str] = {}
        t0, sent = loop.time(), 0
        for i in stripes:
            base = placement.offset_on(seg.index, i)
            for lo in range(0, seg.stripe, COPY_CHUNK):
                n = min(COPY_CHUNK, seg.stripe - lo)
                # taken now (later updates to the stripe follow it on the link),
                # and copied: the socket may hold it by reference while they land
                piece = bytes(seg.view[base + lo:base + lo + n])
                for t in targets:
                    if t.server in failed:
                        continue
                    fut: asyncio.Future[tuple[int, bytes]] = loop.create_future()
                    self._copy_seq += 1
                    off = placement.offset_on(seg.servers.index(t.slot), i) + lo
                    self.outbox(t.server).forward(
                        _key(seg, t), Op.WRITE, FLAG_FORWARDED, off,
                        (prefix(self.view.epoch, self.copy_id, self._copy_seq), piece),
                        resolver(fut))
                    futures.append((t.server, fut))
                    sent += n
                self.copied_bytes += n * len(targets)
                for t in targets:
                    # a slow link: no more than OUTBOX_HIGH queued for it
                    await self.outbox(t.server).room()
                rate = self.server.repair_rate
                if pace and rate:
                    ahead = t0 + sent / rate - loop.time()
                    if ahead > 0:
                        await asyncio.sleep(ahead)
        for addr, fut in futures:
            try:
                status, payload = await asyncio.wait_for(fut, FORWARD_TIMEOUT + 1)
            except TimeoutError:
                status, payload = LINK_FAILED, b"no answer"
            if status and addr not in failed:
                failed[addr] = error_message(payload) or payload.decode(errors="replace")
                self.outbox(addr).fail(failed[addr])
        return failed

    async def serve_sync(self, joiner: str, name: str, epoch: int) -> dict[str, Any]:
        """A server catching up (joining, or holding copies moved to it that
        are not ready yet) asks for its copies of the stripes of ``name``
        that this server is the primary of."""
        if epoch > self.view.epoch:
            await self.refresh()
        view = self.view
        if joiner not in view.joining and not any(s.by == joiner and not s.ready for s in view.replaced):
            raise Refused(ErrorCode.NOT_MEMBER, f"server {joiner} is not catching up in view epoch "
                          f"{view.epoch}: add it to joining (or claim a lost server's copies) first")
        if self.state != "member":
            raise Refused(ErrorCode.NOT_MEMBER, f"server {self.me} is not a member: ask a member")
        own = self.server.by_name.get(name)
        if own is None or own.replicas < 2:
            raise Refused(ErrorCode.NO_SUCH_BUFFER, f"no replicated buffer named {name!r} here")
        placement = self.placement(own)
        # (this server's copy, the joiner's copy) -> stripes
        plan: dict[tuple[str, Holder], list[int]] = {}
        for i in range(placement.nstripes):
            holders = self.holders_of(own, placement.replicas_of(i))
            first = next((h for h in holders if h.state == "member"), None)
            if first is None or first.server != self.me:
                continue
            for h in holders:
                if h.server == joiner and h.state == "joining":
                    plan.setdefault((first.slot, h), []).append(i)
        t0 = time.monotonic()
        for (slot, target), stripes in plan.items():
            seg = self.moved.lookup_copy(name, slot)
            failed = await self.push_stripes(seg, stripes, [target])
            if failed:
                raise Refused(ErrorCode.BACKUP_FAILED, f"copying to {joiner} failed: {failed[joiner]}")
        took = time.monotonic() - t0
        n = sum(len(v) for v in plan.values())
        return {"stripes": n, "bytes": n * own.stripe, "seconds": round(took, 3)}

    # -- joining ------------------------------------------------------------
    async def join(self) -> None:
        """Catch up and become a member (at start, and after a removal)."""
        self.joins += 1
        self.state = "joining" if self.state != "starting" else "starting"
        delay = 0.2
        while True:
            try:
                if await self._join_once():
                    return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("catching up failed (retrying in %.1f s): %s", delay, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _join_once(self) -> bool:
        view = await self.refresh()
        if not view.members:
            # the first server of a cluster nobody set up: nothing to catch up on
            view = await self.change(view, [self.me], [])
            return self._became_member(view, 0)
        others = [m for m in view.members if m != self.me]
        # 1. make (or check) every segment this server should hold, before
        #    joining: a primary's forwards to us then find them
        buffers, unreachable = await self._buffers_of(others)
        # and the copies of lost servers' parts this server holds in their stead
        self.moved.copies_for(view)
        if self.me in view.members and not buffers and not unreachable:
            # every other member answered and none places a stripe here:
            # nothing can be stale (a new cluster)
            return self._became_member(view, 0)
        if self.me in view.members and unreachable and not buffers and time.monotonic() - self.started < START_WAIT:
            # the servers of a new cluster start side by side: ask again
            # before taking this one out of the members to catch up
            return False
        if self.me in view.members and not others:
            log.warning("this server is the only member of the view: it serves what it holds")
            return self._became_member(view, 0)
        if self.me not in view.joining:
            # a restarted member may hold stale data: out of members first --
            # unless that takes some stripe's last member copy (the servers
            # refuse such a view: the stripe could never be caught up)
            out = View(view.epoch + 1, tuple(m for m in view.members if m != self.me),
                       (*view.joining, self.me), view.replaced)
            held = lost_groups(list(self.server.by_name.values()), view, out)
            if held:
                return self._held_back(view, held)
            view = await self.change(view, [m for m in view.members if m != self.me], [*view.joining, self.me])
            if self.me not in view.joining:
                return False
        self.state = "joining"
        t0 = time.monotonic()
        # 2. a copy of each stripe from its primary (in the ordered stream)
        if not await self.catch_up(view, buffers):
            return False
        # 3. a member again, if nothing changed meanwhile (with the copies it
        #    holds for lost servers, caught up too, ready)
        current = await self.refresh()
        if current.epoch != view.epoch or self.me not in current.joining:
            return False
        members = [*current.members, self.me]
        view = await self.change(current, members, [j for j in current.joining if j != self.me],
                                 [dataclasses.replace(r, ready=True) if r.by == self.me else r
                                  for r in current.replaced])
        return self._became_member(view, len(buffers), time.monotonic() - t0)

    async def catch_up(self, view: View, names: Iterable[str]) -> bool:
        """Ask the primaries for a copy of every stripe of buffers ``names``
        this server holds a catching-up copy of in ``view`` (its own part
        while it joins, or a lost server's part it claimed); False where a
        buffer is gone or a stripe has no member copy left."""
        for name in names:
            seg = self.server.by_name.get(name)
            if seg is None:
                return False
            placement = self.placement(seg)
            primaries: dict[int, str | None] = {}
            for i in range(placement.nstripes):
                holders = view.holders([seg.servers[s] for s in placement.replicas_of(i)])
                if any(h.server == self.me and h.state == "joining" for h in holders):
                    primaries[i] = next((h.server for h in holders if h.state == "member"), None)
            lost = [i for i, p in primaries.items() if p is None]
            if lost:
                # no member holds a copy: becoming a member with ours serves
                # it as the stripe's, which only the operator may say
                # (smb2 repair --accept: updates it misses are lost)
                stuck = self._recoverable(seg, view, lost)
                if stuck:
                    if stuck != self.stuck:
                        for s in stuck:
                            log.error("buffer %r: the stripes on %s have no member copy; this server's copy "
                                      "cannot be vouched for (%s): it stays out of the members (smb2 repair "
                                      "shows what is recoverable)", s["buffer"], "+".join(s["servers"]), s["why"])
                    self.stuck = stuck
                    return False
            for p in sorted({p for p in primaries.values() if p is not None and p != self.me}):
                link = await PeerLink.open(p, self.me, self.server.token, self.server.peer_token)
                try:
                    await link.control({"cmd": "repl_sync", "name": name, "epoch": view.epoch})
                finally:
                    link.close("done")
        return True

    def _held_back(self, view: View, held: list[tuple[Segment, list[list[str]]]]) -> bool:
        """A restarted server still a member, holding the last member copy of
        the stripes ``held``: a member again at once when its restored copies
        provably hold every acknowledged update (all of them: restored from the
        save that ended its last run, and a member ever since, for an update
        acknowledged without it needed it out of the members); else it serves
        none of them and says why (smb2 repair)."""
        if self.server.restored_clean and self.vouch_epoch is not None and self.since_vouch is not None:
            log.warning("restarted from the save that ended its last run and a member ever since: its copies "
                        "hold every acknowledged update, and it holds the last member copy of %s: a member "
                        "again at once", "; ".join(f"buffer {seg.name!r}" for seg, _ in held))
            return self._became_member(view, len(held))
        why = self.vouches_for(held[0][1][0]) or "the operator's word is not enough here"
        shared = self._shares_with_members(view)
        if self.accept_as_is and not shared:
            return self._became_member(view, len(held))
        if self.accept_as_is:
            why = (f"it also holds stripes that live members have newer copies of ({shared}), which it would "
                   "serve stale: catching those up in place is not built; restart the other servers of its "
                   "lost stripes from their --data-dir instead")
        stuck = [{"buffer": seg.name, "servers": g, "stripes": [], "why": why} for seg, groups in held for g in groups]
        if stuck != self.stuck:
            log.error("this server restarted holding the last member copy of %s, which it cannot vouch for "
                      "(%s): it serves none of it (smb2 repair)", "; ".join(
                          f"buffer {seg.name!r}" for seg, _ in held), why)
        self.stuck = stuck
        return False

    def _shares_with_members(self, view: View) -> str:
        """The buffers of which this server holds a stripe that another member also holds."""
        names = sorted({seg.name for seg in self.server.by_name.values() if seg.replicas > 1
                        for g in stripe_groups(seg) if self.me in g
                        and any(h.state == "member" and h.server != self.me for h in view.holders(g))})
        return ", ".join(names)

    def _recoverable(self, seg: Segment, view: View, lost: Sequence[int]) -> list[dict[str, Any]]:
        """Of the stripes ``lost`` of ``seg``'s buffer (no member copy in
        ``view``), those this server cannot take its own copy of as the
        stripe's, each with why; the first joining copy in replica order
        recovers a stripe (the others then catch up from it)."""
        placement = self.placement(seg)
        stuck: dict[tuple[str, ...], dict[str, Any]] = {}
        for i in lost:
            group = [seg.servers[s] for s in placement.replicas_of(i)]
            holders = view.holders(group)
            first = next((h for h in holders if h.state == "joining"), None)
            if first is not None and first.server == self.me and first.slot == self.me:
                why = self.vouches_for(group)
            else:
                why = f"its copy comes after {first.server}'s, which recovers it" if first is not None \
                    else "no copy is held"
            if why is not None:
                entry = stuck.setdefault(tuple(group), {"buffer": seg.name, "servers": group, "stripes": [],
                                                         "why": why})
                entry["stripes"].append(i)
        if not stuck:
            self.recovered += len(lost)
            log.warning("buffer %r: took this server's copy of stripes %s, which no member held, as theirs "
                        "(%s)", seg.name, list(lost)[:8], "the operator's word" if self.accept_as_is else
                        "it holds every acknowledged update")
        return list(stuck.values())

    def _became_member(self, view: View, buffers: int, took: float = 0.0) -> bool:
        if self.me not in view.members:
            return False
        self.stuck = []
        self.accept_as_is = False
        self._vouch(view.epoch)
        self.state = "member"
        self.caught_up_at = time.time()
        self.catch_up_seconds = took
        log.info("caught up on %d buffers in %.2f s: member of view epoch %d", buffers, took, view.epoch)
        return True

    async def _buffers_of(self, others: Sequence[str]) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """The replicated buffers that place stripes on this server, as the
        members know them; made here where missing (or of another identity),
        and those the members no longer have dropped.  Also the members that
        did not answer."""
        found: dict[str, dict[str, Any]] = {}
        unreachable = []
        for m in others:
            try:
                link = await PeerLink.open(m, self.me, self.server.token, self.server.peer_token)
            except Exception as exc:
                log.info("member %s is not reachable: %s", m, exc)
                unreachable.append(m)
                continue
            try:
                names = (await link.control({"cmd": "list"})).get("buffers", [])
                for name in names:
                    if name in found:
                        continue
                    info = await link.control({"cmd": "lookup", "name": name})
                    if int(info.get("replicas", 1)) > 1 and self.me in info.get("servers", ()):
                        found[name] = info
            finally:
                link.close("done")
        srv = self.server
        for name, info in found.items():
            seg = srv.by_name.get(name)
            servers = list(info["servers"])
            same = seg is not None and (seg.buffer_id, seg.nbytes, seg.stripe, seg.nservers, seg.replicas,
                                        list(seg.servers)) == (info["buffer_id"], info["nbytes"], info["stripe"],
                                                               info["nservers"], info["replicas"], servers)
            if seg is not None and not same:
                srv.destroy(name)
            if not same:
                made = srv.create(name, info["nbytes"], info["stripe"], info["nservers"], servers.index(self.me),
                                  info["buffer_id"], True, replicas=info["replicas"], servers=servers,
                                  zones=info.get("zones"))
                # it will hold the buffer's data (a copy from the primaries) before
                # it serves anything: to a client's lookup it is the buffer as it was
                srv.restored.add(made["segment"])
        if not unreachable:
            for seg in [s for s in srv.by_name.values() if s.replicas > 1 and s.name not in found]:
                log.warning("dropping buffer %r: no member holds it any more (destroyed while this server "
                            "was away)", seg.name)
                srv.destroy(seg.name)
        return found, unreachable

    # -- reporting ------------------------------------------------------------
    def degraded(self, seg: Segment) -> bool:
        """Some stripe of ``seg`` has fewer member copies than it should
        (counting copies moved off lost servers once they are ready)."""
        if self.state != "member":
            return True
        p = self.placement(seg)
        return any(sum(h.state == "member" for h in self.holders_of(seg, p.replicas_of(i))) < seg.replicas
                   for i in range(min(p.nstripes, p.nservers)))

    def stat(self) -> dict[str, Any]:
        return {"membership": self.url, "server": self.me, "state": self.state, "epoch": self.view.epoch,
                "members": list(self.view.members), "joining": list(self.view.joining),
                "degraded": sorted(s.name for s in self.server.by_name.values()
                                   if s.replicas > 1 and self.degraded(s)),
                "replaced": [r.to_obj() for r in self.view.replaced],
                "copies_held": sorted(f"{name} ({slot})" for name, slot in self.moved.copies),
                "replacements": self.moved.replacements, "refused_views": self.refused_views,
                "restored_views": self.restored_views, "stuck": self.stuck, "recovered": self.recovered,
                "accept_as_is": self.accept_as_is,
                "copied_bytes": self.copied_bytes, "diverged": self.diverged,
                "dedup_entries": self.dedup.entries, "dedup_clients": len(self.dedup.records), "joins": self.joins,
                "lease_age": round(time.monotonic() - self.confirmed_at, 3), "lease_waits": self.lease_waits}


def _key(seg: Segment, copy: Holder) -> BufferKey:
    """Where a forward to ``copy`` of ``seg``'s buffer lands on its server."""
    return (seg.name, seg.buffer_id, "" if copy.slot == copy.server else copy.slot)
