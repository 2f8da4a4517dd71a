"""Rule ``allreduce``'s roster: the workers whose gradients a round waits
for, and how the survivors of a dead worker agree to go on without it.

A run starts in **epoch 0** with every worker.  The roster (a side buffer,
``<store>/members``) holds the current epoch's number, its first round and
its members; each epoch has sums of its own (``<store>/gradients`` for epoch
0, ``<store>/gradients.<epoch>`` after), so a new epoch's rounds start from
zero sums and zero counters whatever the old ones held.  The first member of
an epoch removes the older epochs' sums once a round after the epoch's first
has come back (every member is then past them); a left-out worker that
still sends to them finds them gone and stops as left out.

A worker waiting for a round's gradients watches the others' heartbeats (the
store's control rows; every worker beats in the background while it
computes, :meth:`~smb2.train.store.ParameterStore.keep_beating`).  A member
whose heartbeat word has not changed for ``dead_after`` seconds of the
waiting worker's own clock (no clock is compared across hosts) is taken for
dead, and the waiting worker **declares** the next epoch:

1. it takes the roster's claim word (compare-and-swap 0 -> its rank + 1),
   so that one survivor declares at a time (a claim whose holder went silent
   too is taken over);
2. it **poisons** the blocked round's counters: it subtracts
   :data:`POISON` from each part's counter and reads what each held.  A
   worker that counts itself in afterwards, or waits on one, sees a negative
   value, and a slow worker that was taken for dead can no longer complete
   the round: no one finishes the round in the old epoch once the
   declaration started.  If every part had already been counted in by every
   member (the "dead" worker was slow and came back before the poison), the
   round went through for everyone: the counters are restored and nothing
   changes;
3. it makes the new epoch's zeroed sums, writes the new epoch's record (first
   round = the blocked round, members = the old ones less the silent ones)
   and only then raises the epoch word; then it releases the claim.

Every member blocks in the same round (a round ends for anyone only once
every member counted itself into every part of it, and no one starts the
next one before), so every survivor moves to the new epoch in that round:
each adopts it on seeing a poisoned counter or a newer epoch, starts its
sums afresh and sends that round's gradients again.  The optimizer steps only
on a complete round, so no step is taken on a partial mean, and no worker
steps on a mean that another did not get.  A worker that finds itself left
out (it was silent for ``dead_after`` s, then came back) stops with an error
in training terms: its steps are no longer the others'.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ..client import Buffer
from ..errors import InterfaceError

MEMBERS = "members"
#: subtracted from a blocked round's counters by the worker that declares a
#: new epoch: far below any count a run reaches, so a poisoned counter stays
#: negative whoever counts into it afterwards
POISON = 1 << 48

# the roster's int64 words: the claim (0: free, else the declaring rank + 1)
# and the epoch, then a record for each epoch after 0: its first round, its
# number of members, then one flag a worker.  A record is written once, before
# the epoch word names it, and never again: a reader that saw the epoch word
# reads a whole record (each epoch leaves out at least one worker: at most
# W - 1 of them)
_CLAIM, _EPOCH, _RECORDS = 0, 1, 2


def sums_name(epoch: int, gradients: str) -> str:
    """The side buffer that holds epoch ``epoch``'s sums (``gradients``: epoch 0's)."""
    return gradients if epoch == 0 else f"{gradients}.{epoch}"


@dataclasses.dataclass
class Epoch:
    """One membership of a run: who takes part from which round on, and its sums."""

    number: int
    #: the first round this epoch counts (its rounds count from 0 there)
    base: int
    members: tuple[int, ...]
    #: the sums and their counters
    buf: Buffer
    #: what this worker added to each of the epoch's sums so far (float32, exact)
    sent: np.ndarray
    #: what this worker added to each of the epoch's marks so far (:attr:`AllReduce.marks`)
    marks_sent: np.ndarray

    @property
    def workers(self) -> int:
        return len(self.members)


class Roster:
    """The roster's words in their side buffer (one stripe: one server)."""

    def __init__(self, buf: Buffer, workers: int) -> None:
        self.buf = buf
        self.workers = workers

    @staticmethod
    def nbytes(workers: int) -> int:
        return -(-8 * (_RECORDS + (workers - 1) * (2 + workers)) // 64) * 64

    def _record(self, epoch: int) -> int:
        return 8 * (_RECORDS + (epoch - 1) * (2 + self.workers))

    async def read(self) -> tuple[int, int, tuple[int, ...]]:
        """(epoch, its first round, its members)."""
        epoch = await self.buf.fetch_add(8 * _EPOCH, 0)
        if epoch == 0:
            return 0, 0, tuple(range(self.workers))
        words = np.empty(2 + self.workers, np.int64)
        await self.buf.read_into(words, self._record(epoch))
        members = tuple(int(r) for r in np.flatnonzero(words[2:]))
        if len(members) != int(words[1]) or not members:
            raise InterfaceError(f"the membership record {epoch} of {self.buf.name!r} names {len(members)} "
                                 f"workers where it counts {int(words[1])}: it was overwritten",
                                 hint="restart the job (resume=True); only smb2's own workers write it")
        return epoch, int(words[0]), members

    async def claim(self, rank: int) -> int:
        """Take the claim for ``rank``: 0 if taken, else the rank + 1 that holds it."""
        return await self.buf.compare_swap(8 * _CLAIM, 0, rank + 1)

    async def take_over(self, rank: int, holder: int) -> bool:
        """Take the claim from a silent ``holder`` (its rank + 1); True if taken."""
        return await self.buf.compare_swap(8 * _CLAIM, holder, rank + 1) == holder

    async def release(self, rank: int) -> None:
        await self.buf.compare_swap(8 * _CLAIM, rank + 1, 0)

    async def publish(self, epoch: int, base: int, members: tuple[int, ...]) -> None:
        """Write the record of ``epoch`` (the claim held), then the epoch word."""
        if not 0 < epoch < self.workers:
            raise AssertionError(f"epoch {epoch} of {self.workers} workers")
        flags = np.zeros(self.workers, np.int64)
        flags[list(members)] = 1
        await self.buf.write(self._record(epoch), np.array([base, len(members), *flags], np.int64))
        await self.buf.write(8 * _EPOCH, np.array([epoch], np.int64))


class Silence:
    """How long each rank's heartbeat word has stayed the same, by this
    worker's own clock (a rank first seen counts from then)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[int, float]] = {}

    def saw(self, beats: np.ndarray, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for rank, beat in enumerate(beats.tolist()):
            last = self._seen.get(rank)
            if last is None or last[0] != beat:
                self._seen[rank] = (beat, now)

    def quiet_for(self, rank: int, now: float | None = None) -> float:
        last = self._seen.get(rank)
        return 0.0 if last is None else (time.monotonic() if now is None else now) - last[1]
