"""Where each replica of each stripe of a buffer lives: pure arithmetic,
the same on every client and every server (docs/design.md, "Replication").

A buffer on ``N`` servers (in cluster order), stripe size ``S``,
``h = name_hash(name) % N`` and ``R`` replicas: replica ``j`` of stripe ``i``
lives on server ``(h + i + j) % N``.  When every server declares a zone,
replica ``j`` is instead the next server in ring order from ``(h + i)`` whose
zone differs from those of replicas ``0..j-1`` (ring order again once the
zones run out).  Replica 0 is always ``(h + i) % N``, so ``R = 1`` is the
placement of an unreplicated buffer (``_core.plan``), whatever the zones.

A server's segment holds its stripes in increasing stripe order, densely:
stripe ``i`` sits at (its rank among the stripes the server holds) * ``S``.
For ``R = 1`` that is ``(i // N) * S``.  Every server's segment has the same
size (that of the server holding the most stripes), as for unreplicated
buffers, so any one part tells a buffer's geometry.

The replica set of stripe ``i`` depends only on ``(h + i) % N``: the layout
repeats every ``N`` stripes, which keeps every question here O(N) whatever
the buffer's size.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from . import _core
from .errors import InvalidArgumentError


def first_server(name: str, nservers: int) -> int:
    """``h``: the server of stripe 0 of buffer ``name`` on ``nservers`` servers."""
    return _core.name_hash(name) % nservers


class Placement:
    """The replica layout of one buffer (see the module docstring)."""

    __slots__ = ("nservers", "nbytes", "stripe", "first", "replicas", "nstripes",
                 "_groups", "_residues")

    def __init__(self, nservers: int, nbytes: int, stripe: int, h: int, replicas: int = 1,
                 zones: Sequence[str | None] | None = None) -> None:
        if nservers < 1 or nbytes < 0 or stripe < 1 or h < 0:
            raise ValueError(f"a placement needs nservers >= 1, nbytes >= 0, stripe >= 1 and h >= 0, not "
                             f"{nservers}, {nbytes}, {stripe}, {h}")
        self.nservers, self.nbytes, self.stripe = int(nservers), int(nbytes), int(stripe)
        self.first = int(h) % self.nservers
        self.replicas = check_replicas(replicas, self.nservers)
        if zones is not None and len(zones) != self.nservers:
            raise InvalidArgumentError(f"zones names {len(zones)} servers, the buffer has {self.nservers}")
        self.nstripes = -(-self.nbytes // self.stripe)
        n = self.nservers
        # _groups[p]: the replica servers of every stripe i with (h + i) % N == p
        use_zones = zones is not None and all(zones)
        self._groups = tuple(_group(p, n, self.replicas, zones if use_zones else None) for p in range(n))
        # _residues[s]: the values of i % N of the stripes server s holds, ascending
        held: list[list[int]] = [[] for _ in range(n)]
        for p, group in enumerate(self._groups):
            for s in group:
                held[s].append((p - self.first) % n)
        self._residues = tuple(tuple(sorted(r)) for r in held)

    @classmethod
    def of(cls, name: str, nservers: int, nbytes: int, stripe: int, replicas: int = 1,
           zones: Sequence[str | None] | None = None) -> Placement:
        """The placement of buffer ``name`` (``h`` from its name)."""
        return cls(nservers, nbytes, stripe, first_server(name, nservers), replicas, zones)

    def __repr__(self) -> str:
        return (f"Placement(nservers={self.nservers}, nbytes={self.nbytes}, stripe={self.stripe}, "
                f"h={self.first}, replicas={self.replicas})")

    def replicas_of(self, i: int) -> tuple[int, ...]:
        """The servers of stripe ``i``'s replicas, replica 0 first."""
        self._check_stripe(i)
        return self._groups[(self.first + i) % self.nservers]

    def server_of(self, i: int) -> int:
        """The server of stripe ``i``'s replica 0 (its only copy, unreplicated)."""
        return self.replicas_of(i)[0]

    def locate(self, offset: int) -> tuple[int, int]:
        """``(server, segment offset)``: where replica 0 of the buffer's byte
        ``offset`` lies (the byte itself, unreplicated)."""
        i = offset // self.stripe
        server = self.server_of(i)
        return server, self.offset_on(server, i) + offset % self.stripe

    def offset_on(self, server: int, i: int) -> int:
        """Where stripe ``i`` starts in ``server``'s segment (ValueError if
        that server holds no replica of it)."""
        self._check_stripe(i)
        residues = self._residues[self._check_server(server)]
        q, r = divmod(i, self.nservers)
        k = bisect_left(residues, r)
        if k == len(residues) or residues[k] != r:
            raise ValueError(f"server {server} holds no replica of stripe {i}")
        return (q * len(residues) + k) * self.stripe

    def stripe_at(self, server: int, offset: int) -> tuple[int, int]:
        """``(i, j)``: the stripe whose replica ``j`` holds byte ``offset`` of
        ``server``'s segment (ValueError where it holds none)."""
        residues = self._residues[self._check_server(server)]
        if offset < 0 or not residues:
            raise ValueError(f"offset {offset} of server {server} holds no stripe")
        q, k = divmod(offset // self.stripe, len(residues))
        i = q * self.nservers + residues[k]
        if i >= self.nstripes:
            raise ValueError(f"offset {offset} of server {server} is past its last stripe")
        return i, self._groups[(self.first + i) % self.nservers].index(server)

    def stripes_on(self, server: int) -> int:
        """How many stripes ``server`` holds a replica of."""
        residues = self._residues[self._check_server(server)]
        q, r = divmod(self.nstripes, self.nservers)
        return q * len(residues) + bisect_left(residues, r)

    def segment_size(self, server: int | None = None) -> int:
        """Bytes of every server's segment (the same on all of them; the
        argument is accepted for symmetry and checked)."""
        if server is not None:
            self._check_server(server)
        return max(self.stripes_on(s) for s in range(self.nservers)) * self.stripe

    def _check_stripe(self, i: int) -> None:
        if not 0 <= i < self.nstripes:
            raise ValueError(f"stripe {i} is outside 0..{self.nstripes - 1}")

    def _check_server(self, server: int) -> int:
        if not 0 <= server < self.nservers:
            raise ValueError(f"server {server} is outside 0..{self.nservers - 1}")
        return server


def check_replicas(replicas: object, nservers: int) -> int:
    """``replicas`` checked against a cluster of ``nservers`` servers."""
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise InvalidArgumentError(f"replicas must be an int, not {type(replicas).__name__}")
    if not 1 <= replicas <= nservers:
        raise InvalidArgumentError(
            f"replicas={replicas} needs 1 to {nservers} servers' copies, and the client has {nservers} servers",
            hint="each replica of a stripe lives on a different server: connect to at least as many servers "
                 "as replicas, or ask for fewer (replicas=1 keeps one copy)")
    return replicas


def _group(p: int, n: int, replicas: int, zones: Sequence[str | None] | None) -> tuple[int, ...]:
    """The replica servers of the stripes that start at server ``p``."""
    ring = [(p + d) % n for d in range(n)]
    if zones is None:
        return tuple(ring[:replicas])
    chosen = [p]
    for _ in range(1, replicas):
        used = {zones[s] for s in chosen}
        rest = [s for s in ring if s not in chosen]
        chosen.append(next((s for s in rest if zones[s] not in used), rest[0]))
    return tuple(chosen)
