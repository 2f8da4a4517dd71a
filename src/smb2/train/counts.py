"""The stability counts of every rank, kept beside a store for ``smb2 ls``.

The divergence guard, the lag scaling and the collapse watch
(:mod:`smb2.train.stability`) count on each worker; a user looking at the
servers (``smb2 ls``), or rank 0 at the end of the run, must see them too.
So each rank publishes its counts into a small buffer beside the store,
``<store>/counts``: one row of int64 words per rank::

    run | skipped | refused | lag_scaled | max_version_lag | collapses | last_step

``run`` is the run (generation) the counts belong to: a row of an older run
is not counted in the current one.  A rank writes only its own row, at most
every :data:`PUBLISH_EVERY` seconds and only when a count changed (plus once
when it finishes and at once when a push is refused), so the cost is one
small write every few seconds at most.  The buffer is made by rank 0 as its
run opens; the other ranks only find it (a create reaches every server,
which a worker that connects on first use would then hold), and a rank
with no row of the current run counted nothing.  It is removed with the store
(``smb2 rm``: it is one of the store's ``name/...`` buffers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..client import Buffer, Client
from ..errors import BufferConflict, NoSuchBuffer, Smb2Error
from . import beside

log = logging.getLogger("smb2.train")

__all__ = ["FIELDS", "PUBLISH_EVERY", "CountsBoard", "counts_name", "read_counts"]

FIELDS = ("run", "skipped", "refused", "lag_scaled", "max_version_lag", "collapses",
          "last_step")
#: the counts that add up over the ranks (max_version_lag is the largest; last_step not shown)
SUMMED = ("skipped", "refused", "lag_scaled", "collapses")
#: a rank publishes its counts at most this often (seconds) unless forced
PUBLISH_EVERY = 2.0


def counts_name(store: str) -> str:
    """The buffer beside ``store`` that holds every rank's counts."""
    return beside.name_of(store, COUNTS)


#: the counts' side buffer (smb2.train.beside)
COUNTS = "counts"


class CountsBoard:
    """This rank's row of ``<store>/counts``."""

    def __init__(self, client: Client, store: str, rank: int, workers: int, replicas: int = 1) -> None:
        self.client = client
        self.store = store
        self.replicas = replicas
        self.name = counts_name(store)
        self.rank = rank
        self.nbytes = 8 * len(FIELDS) * workers
        self._buf: Buffer | None = None
        self._usable = True
        self._last: tuple[int, ...] | None = None
        self._at = 0.0

    async def publish(self, run: int, counts: Mapping[str, int], step: int, *, force: bool = False) -> None:
        """Write this rank's row if a count changed (at most every
        :data:`PUBLISH_EVERY` s unless ``force``).  Never raises for the
        board itself: the counts are a report, not the training."""
        if not self._usable:
            return
        row = tuple([run] + [int(counts.get(f, 0)) for f in FIELDS[1:-1]])
        now = time.monotonic()
        if row == self._last or (not force and now - self._at < PUBLISH_EVERY):
            return
        if self._buf is None and not any(row[1:]):
            return          # nothing counted yet: no board (no board reads as all zero)
        try:
            if self._buf is None:
                if self.rank != 0:
                    # rank 0 makes it (:meth:`make`): a create would reach every server, and a worker
                    # of a lazy client would hold connections it does not otherwise use
                    try:
                        buf = await beside.find(self.client, self.store, COUNTS)
                    except NoSuchBuffer:
                        return      # (not made yet: the next publish looks again)
                    if buf.nbytes != self.nbytes:
                        raise BufferConflict(f"{self.name!r} holds {buf.nbytes} bytes")
                    self._buf = buf
                else:
                    await self.make()
                    if self._buf is None:
                        return
            await self._buf.write(self.rank * 8 * len(FIELDS), np.array([*row, step], dtype=np.int64))
        except BufferConflict:
            # a board of another job's shape (another world size): leave it, count locally only
            self._usable = False
            log.debug("store counts %r has another size than %d bytes: not published", self.name, self.nbytes)
            return
        self._last, self._at = row, now

    async def make(self) -> None:
        """Rank 0, as its run opens: make the board, so that the other ranks
        only find it (an earlier job's of another shape is left, and this
        job counts locally only)."""
        if self._buf is not None or not self._usable:
            return
        try:
            # (one stripe of its own size: every server reserves a stripe of a buffer, so a board with
            # the store's stripe would take a stripe's room on each for a few words)
            self._buf = await beside.make(self.client, self.store, COUNTS, self.nbytes, replicas=self.replicas,
                                          stripe=-(-self.nbytes // 64) * 64, replace=False)
        except BufferConflict:
            self._usable = False
            log.debug("store counts %r has another size than %d bytes: not published", self.name, self.nbytes)
        except Smb2Error as exc:
            # (the counts are a report: the training goes on without the board)
            self._usable = False
            log.warning("store %r: its counts board %r is not made (%s): each rank keeps its counts to itself, "
                        "and smb2 ls shows none", self.store, self.name, exc)


async def read_counts(client: Client, store: str, run: int) -> dict[str, Any] | None:
    """The counts of run ``run`` of ``store``: the sums over the ranks (the
    largest ``max_version_lag``) and ``per_rank`` (rank -> its counts, for the ranks
    that published any); None if no rank published (or the board is gone)."""
    try:
        buf = await beside.find(client, store, COUNTS)
        words = np.empty(buf.nbytes // 8, dtype=np.int64)
        await buf.read_into(words, 0)
    except Smb2Error:         # no board (no rank published yet), or gone
        return None
    rows = words[:len(words) - len(words) % len(FIELDS)].reshape(-1, len(FIELDS))
    per_rank = {r: dict(zip(FIELDS[1:], map(int, row[1:]))) for r, row in enumerate(rows) if run and row[0] == run}
    if not per_rank:
        return None
    out: dict[str, Any] = {f: sum(c[f] for c in per_rank.values()) for f in SUMMED}
    out["max_version_lag"] = max(c["max_version_lag"] for c in per_rank.values())
    out["per_rank"] = per_rank
    return out
