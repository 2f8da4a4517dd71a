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

A worker restarted on its own (one launcher per worker, as the Slurm recipe
and the Kubernetes Job run them) **asks to be taken back**: it writes a token
of its own into its request word and waits. Its old self is gone: the first
two members of a round blocked on it (one of them is not the restarted rank)
read the request words at most once a second and declare the next epoch
without it at once, as for a silent worker, but without waiting out its
``dead_after``. Once the survivors have left its old self out, the leader (the
epoch's first member), at the start of a round that begins a step, writes
everything the rank needs to train on in step (the weights, the optimizer
state, the schedules and the step, as after the step before that round) into
the rank's own state buffer, then declares the next epoch as above with the
rank among its members, the record carrying the token where the flag would be,
so that the rank knows the epoch that took it in (and not one that only kept
it), and finally clears the request. The others redo that round in the new
epoch, as after a removal; the rank starts there. Records sit in a ring of
:data:`RING` (an epoch now adds members as well as removing them, and a record
is a word a worker: a ring keeps the roster O(W) bytes on its one server, 1.3
MB at 10,000 workers, where a record for each of W - 1 epochs took O(W²), 800
MB): a reader that finds the epoch word moved a whole ring on while it read a
record reads again, and one that asks for a record the ring has gone past is
refused, never misread.
"""

from __future__ import annotations

import dataclasses
import secrets
import time

import numpy as np

from ..client import Buffer
from ..errors import InterfaceError

MEMBERS = "members"
#: subtracted from a blocked round's counters by the worker that declares a
#: new epoch: far below any count a run reaches, so a poisoned counter stays
#: negative whoever counts into it afterwards
POISON = 1 << 48

# the roster's int64 words: the claim (0: free, else the declaring rank + 1),
# the epoch, one request word a worker (0, or the token of a restarted worker
# that asks to be taken back), then a ring of records, one for each epoch
# after 0: its first round, its number of members, then one word a worker (0:
# not a member, 1: a member, else the token of a worker the epoch took back).
# A record is written before the epoch word names it; its slot is written
# again only ``RING`` epochs later, which a reader notices (Roster.read)
_CLAIM, _EPOCH, _REQUESTS = 0, 1, 2
#: records kept: far more memberships than can change while a worker reads
#: one (each change is a claim, new sums and a round redone by every member)
RING = 16
#: a member's word in a record (a worker taken back holds its token instead: >= 2)
MEMBER = 1


def sums_name(epoch: int, gradients: str) -> str:
    """The side buffer that holds epoch ``epoch``'s sums (``gradients``: epoch 0's)."""
    return gradients if epoch == 0 else f"{gradients}.{epoch}"


def new_token() -> int:
    """A restarted worker's request token (>= 2: not a member's flag)."""
    return secrets.randbits(62) | 2


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


@dataclasses.dataclass(frozen=True)
class Record:
    """An epoch as the roster holds it."""

    number: int
    base: int
    members: tuple[int, ...]
    #: the workers this epoch took back, and the token each asked with
    taken_back: dict[int, int]


class Roster:
    """The roster's words in their side buffer (one stripe: one server)."""

    def __init__(self, buf: Buffer, workers: int) -> None:
        self.buf = buf
        self.workers = workers
        self.ring = RING

    @staticmethod
    def nbytes(workers: int) -> int:
        return -(-8 * (_REQUESTS + workers + RING * (2 + workers)) // 64) * 64

    def _record(self, epoch: int) -> int:
        return 8 * (_REQUESTS + self.workers + (epoch - 1) % self.ring * (2 + self.workers))

    async def epoch(self) -> int:
        return await self.buf.fetch_add(8 * _EPOCH, 0)

    async def read(self, epoch: int | None = None) -> Record:
        """The record of ``epoch`` (None: the current one)."""
        now = await self.epoch()
        while True:
            number = now if epoch is None else epoch
            if number == 0:
                return Record(0, 0, tuple(range(self.workers)), {})
            if number > now:
                raise AssertionError(f"epoch {number} is not declared yet (the roster is at {now})")
            words = np.empty(2 + self.workers, np.int64)
            await self.buf.read_into(words, self._record(number))
            now = await self.epoch()
            if now - number < self.ring:
                break
            if epoch is not None:
                raise InterfaceError(f"the membership record {number} of {self.buf.name!r} was replaced by "
                                     f"epoch {now}'s while it was read",
                                     hint="the job's workers changed too often to follow; restart the job "
                                          "(resume=True)")
        flags = words[2:]
        members = tuple(int(r) for r in np.flatnonzero(flags))
        if len(members) != int(words[1]) or not members:
            raise InterfaceError(f"the membership record {number} of {self.buf.name!r} names {len(members)} "
                                 f"workers where it counts {int(words[1])}: it was overwritten",
                                 hint="restart the job (resume=True); only smb2's own workers write it")
        return Record(number, int(words[0]), members,
                      {int(r): int(flags[r]) for r in np.flatnonzero(flags > MEMBER)})

    async def claim(self, rank: int) -> int:
        """Take the claim for ``rank``: 0 if taken, else the rank + 1 that holds it."""
        return await self.buf.compare_swap(8 * _CLAIM, 0, rank + 1)

    async def take_over(self, rank: int, holder: int) -> bool:
        """Take the claim from a silent ``holder`` (its rank + 1); True if taken."""
        return await self.buf.compare_swap(8 * _CLAIM, holder, rank + 1) == holder

    async def release(self, rank: int) -> None:
        await self.buf.compare_swap(8 * _CLAIM, rank + 1, 0)

    async def publish(self, epoch: int, base: int, members: tuple[int, ...],
                      taken_back: dict[int, int] | None = None) -> None:
        """Write the record of ``epoch`` (the claim held), then the epoch word."""
        flags = np.zeros(self.workers, np.int64)
        flags[list(members)] = MEMBER
        for rank, token in (taken_back or {}).items():
            flags[rank] = token
        await self.buf.write(self._record(epoch), np.array([base, len(members), *flags], np.int64))
        await self.buf.write(8 * _EPOCH, np.array([epoch], np.int64))

    # -- restarted workers asking to be taken back -----------------------------------
    async def ask(self, rank: int, token: int) -> None:
        await self.buf.write(8 * (_REQUESTS + rank), np.array([token], np.int64))

    async def asking(self) -> dict[int, int]:
        """The ranks asking to be taken back, with their tokens."""
        words = np.empty(self.workers, np.int64)
        await self.buf.read_into(words, 8 * _REQUESTS)
        return {int(r): int(words[r]) for r in np.flatnonzero(words)}

    async def answered(self, rank: int, token: int) -> None:
        """Clear ``rank``'s request, if it is still the one with ``token``."""
        await self.buf.compare_swap(8 * (_REQUESTS + rank), token, 0)

    async def taken_back_since(self, epoch: int, rank: int, token: int) -> Record | None:
        """The first epoch after ``epoch`` that took ``rank`` back on ``token``, if one did."""
        now = await self.epoch()
        for number in range(max(epoch + 1, now - self.ring + 1), now + 1):
            record = await self.read(number)
            if record.taken_back.get(rank) == token:
                return record
        return None


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

    def forget(self, rank: int) -> None:
        """``rank`` is a new worker (taken back after a restart): its silence
        counts from when it is next seen, not from its old self's last beat."""
        self._seen.pop(rank, None)

    def quiet_for(self, rank: int, now: float | None = None) -> float:
        last = self._seen.get(rank)
        return 0.0 if last is None else (time.monotonic() if now is None else now) - last[1]
