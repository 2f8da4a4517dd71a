"""Replicated buffers, the client's side: which server each operation goes
to, and what the client does when one fails (docs/design.md, "Replication").

A buffer made with ``replicas=R > 1`` keeps R copies of every stripe
(:mod:`smb2.placement`).  Of the copies whose servers are members of the
cluster's current membership view (:class:`~smb2.membership.View`, kept in
etcd), the first is the stripe's **primary**:

* mutations (write, accumulate, fetch_add, compare_swap, fenced writes) go
  to the primary over its TCP connection with ``FLAG_REPLICATED`` and the
  24-byte prefix (view epoch, client id, sequence number); the primary
  applies them, forwards them to the stripe's backups, and answers once
  every member copy has them.  One request per stripe (the server resolves
  it to one replica group), each with its own sequence number;
* reads go one-sided to the primary, on whatever fabric the link uses.

When the primary refuses the connection, loses it or does not answer within
:data:`FAILOVER_AFTER` s (plus the time its bytes need), or answers
``BACKUP_FAILED`` naming a backup, the client removes that server from the
view (a compare-and-set in etcd, made by a server on the client's behalf:
:class:`ServedMembership`, :meth:`Views.stop_using`), logs
``stopped using server X (epoch e): why`` on ``smb2.client`` once, and sends
the SAME request (same client id and sequence number: the servers apply it
once) to the stripe's primary in the new view.  ``STALE_EPOCH`` and
``NOT_MEMBER`` make it read the view again first.  A request is tried at
most :data:`MAX_ATTEMPTS` times.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import struct
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

from . import _core, sparse
from .errors import (
    BackupFailed,
    BufferConflict,
    InterfaceError,
    MembershipError,
    NotMember,
    OperationTimeout,
    Smb2Error,
    StaleEpoch,
    StaleHandle,
    TransportError,
)
from .membership import PATIENCE, REQUEST_TIMEOUT, Membership, Substitute, View
from .placement import Placement
from .protocol import DEFAULT_MAX_REQUEST, FENCE_SIZE, FLAG_FENCED, MASK64, REPL_PREFIX_SIZE, Op
from .transport import Link, Transport

log = logging.getLogger("smb2.client")

#: seconds one attempt waits for a primary before the client stops using it
#: (a crashed server refuses or resets at once; this bounds a stopped or cut
#: off one).  Above the primaries' own wait for a backup (1 s), so a slow
#: backup is named by its primary rather than blamed on the primary.
FAILOVER_AFTER = 1.5
#: the time an attempt is given on top, per byte it sends (50 MB/s): a large
#: write on a busy host is not mistaken for a dead server
SECONDS_PER_BYTE = 1 / 50e6
#: attempts of one request before the error is raised
MAX_ATTEMPTS = 6
#: seconds after its first send past which a mutation is not sent again (it
#: fails, "may or may not have been applied"): the servers forget a client
#: only after it was silent far longer (smb2.server.replication.DEDUP_IDLE),
#: so a retry always finds the record of its first send
RETRY_SPAN = 120.0
#: requests of replicated buffers a client has in flight to one server: an
#: attempt's wait starts when it is sent, so a large operation's later
#: pieces do not run out of time queued behind its earlier ones (which would
#: look like a dead server)
WINDOW = 4
#: the view lease, seconds (docs/design.md, "Replication: the client"): a
#: client uses a view only within this of the start of its last confirmation
#: with etcd (else it reads the view again, and a client cut off from etcd
#: stops), and uses a view of a new epoch only this long after it learned it
#: (so every client still on the old view has stopped using it by then)
VIEW_LEASE = 1.0
#: seconds a read of the view may take before etcd counts as slow: a primary
#: that did not answer meanwhile is asked again rather than taken out of the
#: view (its own lease on the view waits for etcd too)
SLOW_ETCD = 0.5
#: the largest request of a replicated mutation: a TCP frame, with room
#: for the prefix and a fence
_PREFIX = struct.Struct("<QQQ")


class ServedMembership(Membership):
    """The view, read and changed through the cluster's servers: only they
    hold etcd credentials (docs/reliability.md, "Who can change the view"),
    and they refuse a change that would leave a stripe of any buffer without
    a member copy, which a client, knowing only its own buffers, cannot
    check.  Each request goes to the server that answered last, then to the
    others: first with :data:`FAILOVER_AFTER` s each (a stopped server is
    passed over quickly), then with etcd's whole patience (etcd is slow)."""

    def __init__(self, url: str, links: Callable[[], Sequence[Link]]) -> None:
        self.url = url
        self._links = links
        self._preferred = 0

    async def view(self) -> View:
        return await self._ask({"cmd": "view"}, "reading the membership view")

    async def change(self, expected: View, *, members: Sequence[str],
                     joining: Sequence[str] = (), replaced: Sequence[Substitute] | None = None) -> View:
        if replaced is not None:
            raise InterfaceError("clients never move copies: the servers do (smb2-server --replace-after)")
        away = set(expected.members + expected.joining) - set(members) - set(joining)
        try:
            return await self._ask({"cmd": "view_change", "epoch": expected.epoch, "members": list(members),
                                    "joining": list(joining)}, "changing the membership view", avoid=away)
        except BufferConflict as exc:
            # a server found a buffer (maybe one this client never opened) whose last copy that is
            raise TransportError(exc.message, server=", ".join(sorted(away)),
                                 hint="restart the lost servers (with their --data-dir): the buffers go on "
                                      "once they are back") from None

    async def _ask(self, msg: dict[str, Any], what: str, avoid: Collection[str] = ()) -> View:
        links = list(self._links())
        order = [(self._preferred + k) % len(links) for k in range(len(links))]
        order = [i for i in order if links[i].label not in avoid] + [i for i in order if links[i].label in avoid]
        failures: list[str] = []
        for timeout in (FAILOVER_AFTER, PATIENCE + REQUEST_TIMEOUT):
            for i in order:
                link = links[i]
                try:
                    reply = await link.call(lambda t: t.control(msg), timeout, idempotent=True, what=what)
                    view = View.from_json(reply["view"], where=f"server {link.label}")
                except BufferConflict:
                    raise
                except (Smb2Error, KeyError, TypeError) as exc:
                    failures.append(f"{link.label}: {exc}")
                    continue
                self._preferred = i
                return view
        raise MembershipError(f"no server answered for the membership view ({what})", detail="; ".join(failures),
                              hint="check that the servers and their membership service (etcd) are up "
                                   "(smb2 doctor)")

    async def close(self) -> None:
        pass                        # the links are the client's


class ReplicatedBuffer(Protocol):
    """What the routing needs of a buffer (:class:`smb2.Buffer` has it)."""

    name: str
    nbytes: int
    buffer_id: str | None
    replicas: int                   # 1: an unreplicated buffer, never routed here
    placement: Placement
    segments: list[int]

    @property
    def links(self) -> tuple[Link, ...]: ...

    async def views(self) -> Views: ...

    async def check_incarnation(self, server: int, t: Transport, /) -> None: ...

    def checked(self, server: int, /) -> Transport | None: ...


class Views:
    """The membership view one client routes its replicated buffers by, and
    the identity its mutations carry (a random client id, a sequence)."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        #: random per client: with ``seq``, an op's identity at the servers
        self.client_id = int.from_bytes(os.urandom(8), "little")
        self._seq = 0
        self.view: View | None = None
        # time.monotonic() at the start of the last confirmation of the view,
        # and when ops may use it (VIEW_LEASE after its epoch was learned)
        self._confirmed_at = 0.0
        self._usable_at = 0.0
        self._lock = asyncio.Lock()
        self._windows: dict[str, asyncio.Semaphore] = {}
        # segment ids of copies servers hold for lost servers, by (server
        # process, buffer, lost server)
        self._copies: dict[tuple[Any, str, str, str], int] = {}

    @classmethod
    def of_servers(cls, infos: Sequence[dict[str, Any]], labels: Sequence[str],
                   links: Callable[[], Sequence[Link]]) -> Views:
        """The views of the cluster whose servers said ``infos`` at hello,
        read and changed through ``links`` (:class:`ServedMembership`)."""
        urls = {info.get("membership") for info in infos}
        if None in urls or len(urls) != 1:
            told = ", ".join(f"{label}: {info.get('membership') or 'none'}" for label, info in zip(labels, infos))
            raise InterfaceError(
                f"replicated buffers need every server to name the same membership service, and they "
                f"name {told}",
                hint="start every smb2-server with the same --membership etcd://HOST:PORT/CLUSTER "
                     "(LocalCluster(..., replicated=True) does), or use replicas=1")
        return cls(ServedMembership(str(urls.pop()), links))

    def window(self, server: str) -> asyncio.Semaphore:
        """The :data:`WINDOW` of requests in flight to ``server``."""
        w = self._windows.get(server)
        if w is None:
            w = self._windows[server] = asyncio.Semaphore(WINDOW)
        return w

    async def copy_segment(self, buf: ReplicatedBuffer, t: Transport, part: int) -> int:
        """The segment id under which the server ``t`` reaches holds its copy
        of part ``part`` of ``buf`` (moved there off a lost server)."""
        slot = buf.links[part].label
        key = (t.server_info.get("server_id"), buf.name, buf.buffer_id or "", slot)
        sid = self._copies.get(key)
        if sid is None:
            info = await t.control({"cmd": "lookup", "name": buf.name, "copy_of": slot})
            if info.get("buffer_id") != key[2] or info.get("index") != part:
                raise StaleHandle(f"buffer {buf.name!r}: the copy of server {slot}'s part there is another "
                                  "buffer's", server=slot, hint=f"attach it again: await client.attach({buf.name!r})")
            sid = self._copies[key] = int(info["segment"])
        return sid

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def prefix(self, view: View, seq: int) -> bytes:
        return _PREFIX.pack(view.epoch & MASK64, self.client_id, seq)

    async def current(self) -> View:
        """The view ops may use now: confirmed with etcd within
        :data:`VIEW_LEASE` (read again otherwise), and learned at least
        VIEW_LEASE ago (waited for otherwise)."""
        while True:
            now = time.monotonic()
            if self.view is None or now - self._confirmed_at >= VIEW_LEASE:
                await self.refresh()
            elif now < self._usable_at:
                await asyncio.sleep(self._usable_at - now)
            else:
                return self.view

    def confirmed_within_lease(self) -> bool:
        return time.monotonic() - self._confirmed_at < VIEW_LEASE

    async def refresh(self) -> View:
        """Read the view again (after STALE_EPOCH or NOT_MEMBER; use
        :meth:`current` for a view ops may use)."""
        started = time.monotonic()
        view = await self.membership.view()
        self._confirmed_at = max(self._confirmed_at, started)
        return self._adopt(view, "it is not a member of the current view")

    async def stop_using(self, server: str, seen: View, why: str,
                         keeping: Callable[[View], object] | None = None) -> View:
        """Remove ``server`` from the view ``seen`` (compare-and-set): the
        view current afterwards.  Concurrent callers wait for each other,
        and one that finds the server already gone changes nothing.
        ``keeping(view)`` raises where removing it from the view it is
        removed from (``seen`` or a newer one) would lose a last copy."""
        async with self._lock:
            base = self.view if self.view is not None and self.view.epoch > seen.epoch else seen
            if server not in base.members and server not in base.joining:
                return base
            if keeping is not None:
                keeping(base)
            members = tuple(m for m in base.members if m != server)
            if not members:
                raise TransportError(
                    f"server {server} failed ({why}) and it is the last member of the view",
                    server=server, hint="restart the servers (with their --data-dir) and run again")
            started = time.monotonic()
            new = await self.membership.change(
                base, members=members, joining=tuple(m for m in base.joining if m != server))
            self._confirmed_at = max(self._confirmed_at, started)
            return self._adopt(new, why, removing=server)

    def _adopt(self, view: View, why: str, removing: str | None = None) -> View:
        old = self.view
        if old is None or view.epoch >= old.epoch:
            if old is None or view.epoch > old.epoch:
                # learned now, written at most now: usable once every client still on the older view
                # (confirmed before it was written) is past its lease
                self._usable_at = time.monotonic() + VIEW_LEASE
            self.view = view
            for gone in (old.members if old is not None else ()):
                if gone not in view.members:
                    reason = why if gone == removing or removing is None else "removed by another client"
                    log.warning("stopped using server %s (epoch %d): %s", gone, view.epoch, reason)
            return view
        return old

    async def close(self) -> None:
        await self.membership.close()


def primary(buf: ReplicatedBuffer, i: int, view: View) -> tuple[int, int]:
    """Where stripe ``i``'s operations go in ``view``: (the server, the part
    whose copy it holds), the server of its first member copy; the part is
    the server's own unless the copy was moved there off a lost server
    (``View.holders``)."""
    group = _layout(buf).replicas_of(i)
    labels = [link.label for link in buf.links]
    first = view.primary([labels[s] for s in group])
    if first is not None and first.server in labels:
        return labels.index(first.server), labels.index(first.slot)
    lost = ", ".join(buf.links[s].label for s in group)
    stripe = _layout(buf).stripe
    raise TransportError(
        f"buffer {buf.name!r}: every copy of bytes {i * stripe}-{min((i + 1) * stripe, buf.nbytes)} is lost: "
        f"its servers {lost} are all out of the view (epoch {view.epoch})",
        hint="restart those servers with their --data-dir so they rejoin; if their data is gone, restore the "
             "buffer from a checkpoint")


def degraded(placement: Placement, labels: Sequence[str], view: View) -> bool:
    """Whether some stripe has fewer member copies than its replicas in
    ``view`` (a copy moved off a lost server counts once it is ready)."""
    return any(sum(h.state == "member" for h in view.holders([labels[s] for s in placement.replicas_of(i)]))
               < placement.replicas for i in range(min(placement.nstripes, placement.nservers)))


def without_copy(placement: Placement, labels: Sequence[str], view: View, away: Collection[str], *,
                 moved: bool = True) -> int | None:
    """The first stripe with no member copy in ``view`` on a server not in
    ``away`` (None: every stripe has one).  ``moved``: a copy moved off a
    lost server counts (a new buffer has none: only its own parts are made)."""
    for i in range(min(placement.nstripes, placement.nservers)):
        if not any(h.state == "member" and h.server not in away and (moved or h.server == h.slot)
                   for h in view.holders([labels[s] for s in placement.replicas_of(i)])):
            return i
    return None


def check_creatable(name: str, placement: Placement, labels: Sequence[str], view: View,
                    away: Collection[int]) -> None:
    """Refuse to create the buffer ``name`` when a stripe would have no copy
    on a member server once the servers ``away`` (indices: out of ``view``,
    or not answering) are left out; their parts are made when they rejoin."""
    i = without_copy(placement, labels, view, {labels[k] for k in away}, moved=False)
    if i is None:
        return
    down = ", ".join(labels[k] for k in sorted(away))
    raise TransportError(
        f"buffer {name!r} cannot be created with replicas={placement.replicas} now: servers {down} are down or "
        f"out of the membership view (epoch {view.epoch}), and they would hold every copy of bytes "
        f"{i * placement.stripe}-{min((i + 1) * placement.stripe, placement.nbytes)}",
        server=labels[min(away)] if away else None,
        hint="restart those servers (they rejoin by themselves: `smb2 stat` shows them as members again), "
             "then create it; or create it with more replicas")


def _pieces(placement: Placement, offset: int, length: int, limit: int) -> list[tuple[int, int, int]]:
    """``(stripe, buffer offset, bytes)`` of ``[offset, offset+length)``,
    each within one stripe and at most ``limit`` bytes."""
    out = []
    end = offset + length
    at = offset
    while at < end:
        i = at // placement.stripe
        hi = min(end, (i + 1) * placement.stripe, at + limit)
        out.append((i, at, hi - at))
        at = hi
    return out


async def _attempts(buf: ReplicatedBuffer, i: int, within: int, nbytes: int, what: str,
                    send: Any) -> Any:
    """``send(transport, segment, segment offset, view)`` on stripe ``i``'s
    primary, failing over as the module docstring says."""
    views = await buf.views()
    view = await views.current()
    patience = FAILOVER_AFTER + nbytes * SECONDS_PER_BYTE
    last: BaseException | None = None
    started = time.monotonic()
    for attempt in range(MAX_ATTEMPTS):
        if attempt and what != "read" and time.monotonic() - started > RETRY_SPAN:
            raise TransportError(
                f"{what} of buffer {buf.name!r} was sent {RETRY_SPAN:g} s ago and not acknowledged ({last}): it may "
                "or may not have been applied, and it is not sent again", server=getattr(last, "server", None),
                hint="check that the servers and the membership service (etcd) are up: `smb2 stat`")
        server, part = primary(buf, i, view)
        link = buf.links[server]
        seg_off = _layout(buf).offset_on(part, i) + within
        seen = view

        async def request(t: Transport, server: int = server, part: int = part, seg_off: int = seg_off,
                          seen: View = seen) -> Any:
            await buf.check_incarnation(server, t)
            seg = buf.segments[server] if part == server else await views.copy_segment(buf, t, part)
            return await send(t, seg, seg_off, seen)
        try:
            async with views.window(link.label):
                return await link.call(request, patience, idempotent=False, what=f"{what} of buffer {buf.name!r}")
        except BackupFailed as exc:
            last = exc
            backup = next((other.label for other in buf.links
                           if other is not link and other.label in exc.message), None)
            if backup is not None:
                await views.stop_using(backup, seen, exc.message,
                                       functools.partial(_keeping_a_copy, buf, backup, exc=exc))
            else:
                await views.refresh()
        except (StaleEpoch, NotMember) as exc:
            last = exc
            await views.refresh()
        except StaleHandle as exc:
            if attempt == 0 or what == "read":
                raise
            # an earlier attempt was sent: it may have been applied, so never say "nothing was sent"
            raise TransportError(
                f"{what} of buffer {buf.name!r} was sent to server {last and getattr(last, 'server', None)}, which "
                f"failed ({last}); its retry found no copy to send it to ({exc.message}): it may or may not have "
                "been applied", server=exc.server, hint=exc.hint) from None
        except TransportError as exc:       # refused, reset, timed out (OperationTimeout)
            last = exc
            if isinstance(exc, OperationTimeout):
                # a primary holds its answers while it cannot confirm its view with etcd: where etcd is
                # slow for this client too, the silence is etcd's, so the same primary is asked again
                t0 = time.monotonic()
                await views.refresh()
                if time.monotonic() - t0 > SLOW_ETCD:
                    log.info("%s of buffer %r: server %s did not answer while etcd was slow (%.1f s): "
                             "asking it again", what, buf.name, link.label, time.monotonic() - t0)
                    view = await views.current()
                    continue
            await views.stop_using(link.label, seen, exc.message,
                                   functools.partial(_keeping_a_copy, buf, link.label, exc=exc))
        view = await views.current()
    raise TransportError(f"{what} of buffer {buf.name!r} failed {MAX_ATTEMPTS} times on the primaries of its "
                         f"stripe {i}; the last: {last}", server=getattr(last, "server", None),
                         hint="check that the servers and the membership service (etcd) are up: "
                              "`smb2 stat`, `smb2 ls`")


def _keeping_a_copy(buf: ReplicatedBuffer, server: str, view: View, exc: Smb2Error) -> str:
    """``server``, if taking it out of ``view`` leaves every stripe of the
    buffer a member copy; else the error is raised (a stripe without a
    member copy could never be caught up again)."""
    p = _layout(buf)
    i = without_copy(p, [link.label for link in buf.links], view, {server})
    if i is not None:
        raise TransportError(
            f"buffer {buf.name!r}: server {server} failed ({exc.message}), and it holds the last member copy "
            f"of bytes {i * p.stripe}-{min((i + 1) * p.stripe, buf.nbytes)}: it stays in the view",
            server=server, hint="restart the lost servers (with their --data-dir): the buffer goes on once "
                                "they are back") from None
    return server


async def _bounded(deadline: float | None, what: str, coro: Any) -> Any:
    if deadline is None:
        return await coro
    try:
        async with asyncio.timeout(deadline):
            return await coro
    except TimeoutError:
        raise OperationTimeout(f"{what} did not complete within {deadline} s (replicated: failing over "
                               "included)", hint="give it a longer timeout=, or check the servers") from None


async def run(buf: ReplicatedBuffer, what: str, view: memoryview, offset: int, length: int, widen: int,
              dtype_code: int, fence: tuple[int, int] | None, deadline: float | None) -> None:
    """A read, write or accumulate of ``[offset, offset+length)`` (the
    payload ``view`` is ``widen`` times shorter for a widening accumulate)."""
    if what == "read":
        limit = DEFAULT_MAX_REQUEST
    else:
        limit = _frame(buf) - REPL_PREFIX_SIZE - FENCE_SIZE
        limit -= limit % 8
    pieces = _pieces(_layout(buf), offset, length, limit)

    async def one(i: int, at: int, n: int) -> None:
        part = view[(at - offset) // widen:(at - offset + n) // widen]
        within = at - i * _layout(buf).stripe
        views = await buf.views()
        if what == "read":
            while True:
                before = await views.current()
                await _read(buf, views, i, within, part, n)
                # served by a primary of a view still within its lease when it was served: current
                if views.confirmed_within_lease() or (await views.current()).epoch == before.epoch:
                    return
        if what == "write":
            op, flags = Op.WRITE, 0
            body: list[memoryview | bytes] = [part]
            if fence is not None:
                flags = FLAG_FENCED
                body.insert(0, _core.pack_u64x2(fence[0] & MASK64, fence[1] & MASK64))
        else:
            op, flags, body = Op.ACCUMULATE, dtype_code << 4, [part]
        seq = views.next_seq()

        async def mutate(t: Transport, seg: int, seg_off: int, seen: View) -> None:
            await t.replicated(op, flags, seg, seg_off, [views.prefix(seen, seq), *body])
        await _attempts(buf, i, within, n, what, mutate)

    await _bounded(deadline, f"{what} of buffer {buf.name!r}",
                   asyncio.gather(*(one(*p) for p in pieces)) if len(pieces) > 1 else one(*pieces[0]))


async def run_sparse(buf: ReplicatedBuffer, requests: Sequence[sparse.Request], deadline: float | None) -> None:
    """A sparse accumulate planned per stripe (``sparse.plan``): each
    request to its stripe's primary, which forwards it to the backups."""
    views = await buf.views()

    async def one(r: sparse.Request) -> None:
        seq = views.next_seq()

        async def mutate(t: Transport, seg: int, seg_off: int, seen: View) -> None:
            t.require_sparse()
            await t.replicated(Op.ACCUMULATE_SPARSE, r.flags, seg, seg_off, [views.prefix(seen, seq), *r.payload])
        await _attempts(buf, r.target, r.base, r.nbytes, "sparse accumulate", mutate)

    await _bounded(deadline, f"sparse accumulate of buffer {buf.name!r}",
                   asyncio.gather(*(one(r) for r in requests)) if len(requests) > 1 else one(requests[0]))


async def _read(buf: ReplicatedBuffer, views: Views, i: int, within: int, part: memoryview, n: int) -> None:
    server, held = primary(buf, i, await views.current())
    t = buf.links[server].open
    if t is not None and t.name == "shm" and buf.checked(server) is t and held == server:
        # a copy from the mapped segment never waits: no deadline, no window
        try:
            return await t.read_into([part], buf.segments[server], _layout(buf).offset_on(server, i) + within, n)
        except TransportError:
            pass        # failed over below

    async def read(t: Transport, seg: int, seg_off: int, seen: View) -> None:
        await t.read_into([part], seg, seg_off, n)
    await _attempts(buf, i, within, n, "read", read)


async def atomic(buf: ReplicatedBuffer, what: str, offset: int, operands: bytes,
                 deadline: float | None) -> int:
    """fetch_add (``operands``: the u64 value) or compare_swap (expected,
    new) on the word at ``offset``: the word's old value, as a u64."""
    op = Op.FETCH_ADD if what == "fetch_add" else Op.COMPARE_SWAP
    i, within = divmod(offset, _layout(buf).stripe)
    views = await buf.views()
    seq = views.next_seq()

    async def send(t: Transport, seg: int, seg_off: int, seen: View) -> int:
        old = await t.replicated(op, 0, seg, seg_off, [views.prefix(seen, seq), operands])
        assert old is not None
        return old
    return int(await _bounded(deadline, f"{what} on buffer {buf.name!r}",
                              _attempts(buf, i, within, 8, what, send)))


def _layout(buf: ReplicatedBuffer) -> Placement:
    if buf.replicas < 2:
        raise InterfaceError(f"buffer {buf.name!r} is not replicated")
    return buf.placement


def _frame(buf: ReplicatedBuffer) -> int:
    """The largest frame every server of the buffer takes."""
    frames = [f for link in buf.links if (t := link.transport) is not None
              and isinstance(f := t.server_info.get("max_frame"), int) and f > 0]
    return min([DEFAULT_MAX_REQUEST, *frames])
