"""Moved copies: the copies of a server out of the view for longer than
``--replace-after`` are claimed (CAS) by the member chosen for each replica
group, kept in a segment laid out as the lost server's part, caught up like
a rejoin, and marked ready (CAS)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from ...errors import ErrorCode
from ...membership import Substitute, View
from ...placement import Placement
from ..segment import Refused, Segment
from ..viewcheck import stripe_groups
from .needs import Server

log = logging.getLogger("smb2.server.replication")


class Mover(Protocol):
    """What the moved copies need of their replication (cluster.Replication):
    its view, its changes of the view, and its catching up."""

    me: str
    view: View
    server: Server
    catch_up_seconds: float

    def spawn(self, work: Any) -> asyncio.Task[Any]: ...
    def placement(self, seg: Segment) -> Placement: ...
    async def refresh(self) -> View: ...
    async def change(self, expected: View, members: Sequence[str], joining: Sequence[str],
                     replaced: Sequence[Substitute] | None = None) -> View: ...
    async def catch_up(self, view: View, names: Iterable[str]) -> bool: ...


class MovedCopies:
    """The copies of lost servers' parts this server holds in their stead."""

    def __init__(self, repl: Mover) -> None:
        self.repl = repl
        # segments holding lost servers' parts, by (buffer name, lost server)
        self.copies: dict[tuple[str, str], Segment] = {}
        # when this server first saw each copy out of the view, by
        # (lost server, group, server that held it); copies it claimed
        self._out_since: dict[tuple[str, tuple[str, ...], str], float] = {}
        self.replacements = 0
        self._replacing: asyncio.Task[None] | None = None

    def next_round(self) -> None:
        """Run :meth:`replace` again, unless its last round still runs."""
        if self._replacing is None or self._replacing.done():
            self._replacing = self.repl.spawn(self.replace())

    async def replace(self) -> None:
        """Move the copies of servers out of the view for longer than
        ``--replace-after`` to other servers: this server claims (CAS) those
        it is the chosen substitute for, catches them up like a joining
        server (through each primary's ordered link), then marks them ready
        (CAS, if the view did not change meanwhile).  Every server runs this
        on the view it read; etcd's CAS decides between any that race."""
        try:
            view = self.repl.view
            claims = self._claims(view)
            if claims:
                keys = {(c.slot, c.group) for c in claims}
                # the segments first: primaries forward to them once the claim is in the view
                self.copies_for(dataclasses.replace(view, replaced=(*view.replaced, *claims)))
                new = await self.repl.change(view, view.members, view.joining,
                                        [r for r in view.replaced if (r.slot, r.group) not in keys] + claims)
                if not all(c in new.replaced for c in claims):
                    self.copies_for(new)
                    return          # another server or view change came first: the next round sees it
                self.replacements += len(claims)
                for c in claims:
                    log.warning("server %s is out of the view for more than %g s: this server takes over its "
                                "copies of the stripes on %s (catching up at --repair-rate)",
                                c.slot, self.repl.server.replace_after, "+".join(c.group))
                # caught up from the next round's view: the other servers' claims for the same lost
                # server (their clocks started within one view read of ours) are in it by then, so
                # they do not change the view under the copy and make it start again
                return
            if not any(r.by == self.repl.me and not r.ready for r in view.replaced):
                return
            t0 = time.monotonic()
            if not await self.repl.catch_up(view, [n for n, s in self.repl.server.by_name.items() if s.replicas > 1]):
                return
            current = await self.repl.refresh()
            if current.epoch != view.epoch and not self._only_others_moved(view, current):
                return              # catch up again under the new view (next round)
            done = await self.repl.change(current, current.members, current.joining,
                                     [dataclasses.replace(r, ready=True) if r.by == self.repl.me else r
                                      for r in current.replaced])
            if done.epoch == current.epoch + 1:
                self.repl.catch_up_seconds = time.monotonic() - t0
                log.info("copies taken over from lost servers are whole (%.2f s): epoch %d",
                         self.repl.catch_up_seconds, done.epoch)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("taking over a lost server's copies failed (retrying): %s", exc)

    def _only_others_moved(self, old: View, new: View) -> bool:
        """Whether ``new`` differs from ``old`` only by other servers' claims
        and ready marks, one per epoch, with the primary of every stripe this
        server catches up the same: then its copies, taken under ``old``, are
        as good under ``new`` (no primary changed, nobody joined or left),
        and another substitute finishing first does not make it start again."""
        if (new.members, new.joining) != (old.members, old.joining):
            return False
        if {r for r in new.replaced if r.by == self.repl.me} != {r for r in old.replaced if r.by == self.repl.me}:
            return False
        others = {r for r in new.replaced if r.by != self.repl.me} - set(old.replaced)
        if new.epoch - old.epoch > len(others):
            return False
        for seg in [s for s in self.repl.server.by_name.values() if s.replicas > 1]:
            p = self.repl.placement(seg)
            for i in range(min(p.nstripes, p.nservers)):
                group = [seg.servers[s] for s in p.replicas_of(i)]
                if any(h.server == self.repl.me and h.state == "joining" for h in old.holders(group)) and \
                        old.primary(group) != new.primary(group):
                    return False
        return True

    def _claims(self, view: View) -> list[Substitute]:
        """The copies out of ``view`` for longer than --replace-after that
        this server is the substitute for: of the members that hold no copy
        of the stripe, the first by (a zone no live copy has, fewest copies
        taken over, ring order after the lost server)."""
        now = time.monotonic()
        seen: dict[tuple[str, tuple[str, ...], str], float] = {}
        claims: dict[tuple[str, tuple[str, ...]], Substitute] = {}
        load = collections.Counter(r.by for r in view.replaced)
        for seg in [s for s in self.repl.server.by_name.values() if s.replicas > 1]:
            p = self.repl.placement(seg)
            zone = dict(zip(seg.servers, seg.zones or [None] * len(seg.servers)))
            for i in range(min(p.nstripes, p.nservers)):
                group = [seg.servers[s] for s in p.replicas_of(i)]
                holders = view.holders(group)
                if not any(h.state == "member" for h in holders):
                    continue        # every copy lost: nothing to copy from
                for h in holders:
                    if h.state != "out":
                        continue
                    key = (h.slot, tuple(sorted(group)), h.server)
                    seen[key] = since = self._out_since.get(key, now)
                    if now - since < self.repl.server.replace_after or key[:2] in claims:
                        continue
                    taken = {x.server for x in holders}
                    zones = {zone[x.server] for x in holders if x.state != "out" and x.server in zone}
                    at = seg.servers.index(h.slot)
                    n = len(seg.servers)
                    candidates = sorted(
                        (s for s in seg.servers if s in view.members and s not in taken),
                        key=lambda s: (zone.get(s) is not None and zone.get(s) in zones, load[s],
                                       (seg.servers.index(s) - at) % n))
                    if candidates and candidates[0] == self.repl.me:
                        claims[key[:2]] = Substitute(h.slot, key[1], self.repl.me)
        self._out_since = seen
        return list(claims.values())

    def copy_of(self, name: str, slot: str) -> Segment | None:
        """This server's segment holding server ``slot``'s part of buffer
        ``name``: its own part, or one it holds in a lost server's stead."""
        return self.repl.server.by_name.get(name) if slot == self.repl.me else self.copies.get((name, slot))

    def lookup_copy(self, name: str, slot: str) -> Segment:
        seg = self.copy_of(name, slot)
        if seg is None:
            raise Refused(ErrorCode.NO_SUCH_BUFFER, f"server {self.repl.me} holds no copy of server {slot}'s part "
                          f"of buffer {name!r}")
        return seg

    def forget(self, name: str) -> None:
        """Buffer ``name`` is destroyed here: so are the copies held for it."""
        for key in [k for k in self.copies if k[0] == name]:
            self.repl.server.drop_copy(self.copies.pop(key))

    def _copy_segment(self, seg: Segment, slot: str) -> None:
        """Make the segment for ``slot``'s part of ``seg``'s buffer here (before
        this server claims it: forwards to it then find it)."""
        if slot == self.repl.me:
            return
        have = self.copies.get((seg.name, slot))
        if have is not None and have.buffer_id == seg.buffer_id and have.servers == seg.servers:
            return
        if have is not None:
            self.repl.server.drop_copy(have)
        self.copies[(seg.name, slot)] = self.repl.server.add_copy(seg, seg.servers.index(slot))

    def copies_for(self, view: View) -> None:
        """Make the segments of every copy the view moves here; drop those it
        no longer does (their data is not served: nothing routes to them)."""
        wanted = set()
        for seg in [s for s in self.repl.server.by_name.values() if s.replicas > 1]:
            groups = _groups(seg)
            for sub in view.replaced:
                if sub.by == self.repl.me and sub.slot != self.repl.me and sub.group in groups:
                    self._copy_segment(seg, sub.slot)
                    wanted.add((seg.name, sub.slot))
        for key in [k for k in self.copies if k not in wanted]:
            self.repl.server.drop_copy(self.copies.pop(key))


def _groups(seg: Segment) -> set[tuple[str, ...]]:
    """The replica groups (sorted server names) of ``seg``'s buffer's stripes."""
    return {tuple(sorted(group)) for group in stripe_groups(seg)}
