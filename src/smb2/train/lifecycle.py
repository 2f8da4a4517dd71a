"""The control words of a parameter store and the decisions a job's ranks
take from them: which run (generation) a rank belongs to, whether a run
starts fresh or resumes, who is missing, who stalled.  Pure: no I/O here
(:mod:`smb2.train.store` reads and writes the words).

The control area (int64 words, the store's notification area)::

    word 0        VERSION     updates applied to the weights (kept on resume)
    word 1        GENERATION  the current run, G (0: none opened yet)
    word 2        STOP        the run whose end policy fired (stop iff == G)
    word 3        OPENED_MS   wall clock (ms) when run G was opened
    word 4        RESUMED     1 if run G resumed the previous one's weights
    word 5        ORIGIN_MS   OPENED_MS of the last fresh run, kept by resumed
                              runs: names the weights' lineage (saved
                              optimizer states carry it, smb2.torch.resume);
                              a run from a checkpoint whose optimizer states
                              were restored takes the checkpoint's
    words 6-7     reserved
    8 + 4r + 0    JOINED[r]   the last run rank r joined
    8 + 4r + 1    STEP[r]     rank r's step (kept on resume, 0 when fresh)
    8 + 4r + 2    BEAT[r]     wall clock (ms) of rank r's last heartbeat
    8 + 4r + 3    FINISHED[r] the last run rank r finished

Every per-run word holds a generation number instead of a flag or a count,
so opening run G+1 resets all of them at once (nobody has joined, finished
or stopped G+1) and a straggler of an old run can never count towards the
new one.  Each rank writes only its own four words.

Heartbeat ages compare wall clocks of different hosts: they are meant for
thresholds of tens of seconds (``stale_after``), which NTP-synchronized
hosts meet.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError

VERSION, GENERATION, STOP, OPENED_MS, RESUMED, ORIGIN_MS = range(6)
RANK_BASE = 8
RANK_WORDS = 4
JOINED, STEP, BEAT, FINISHED = range(RANK_WORDS)
RESUME_CHOICES = ("auto", True, False)

#: a rank whose heartbeat is older than this (seconds) counts as dead when
#: ranks decide which run to join
STALE_AFTER = 60.0


def slots_for(workers: int) -> int:
    return RANK_BASE + RANK_WORDS * workers


def rank_word(rank: int, which: int) -> int:
    """The control word (slot) ``which`` (JOINED, STEP, BEAT, FINISHED) of ``rank``."""
    return RANK_BASE + RANK_WORDS * rank + which


def now_ms() -> int:
    return int(time.time() * 1000)


def resolve_rank(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world size): explicit arguments, else ``SMB2_RANK`` /
    ``SMB2_WORLD_SIZE`` (one torchrun per worker, see docs/training.md), else
    torchrun's ``RANK`` / ``WORLD_SIZE``, else 0 / 1."""
    def env(*names: str) -> tuple[str, int] | None:
        for n in names:
            v = os.environ.get(n)
            if v is not None and v.strip():
                try:
                    return n, int(v)
                except ValueError:
                    raise InvalidArgumentError(f"{n}={v!r} is not an integer") from None
        return None

    if rank is None:
        found = env("SMB2_RANK", "RANK")
        rank = found[1] if found else 0
    if world_size is None:
        found = env("SMB2_WORLD_SIZE", "WORLD_SIZE")
        world_size = found[1] if found else 1
    check_rank(rank, world_size)
    return int(rank), int(world_size)


def check_rank(rank: Any, workers: Any) -> int:
    for what, v in (("rank", rank), ("workers", workers)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise InvalidArgumentError(f"{what} must be an int, not {type(v).__name__}")
    if workers < 1 or not 0 <= rank < workers:
        raise InvalidArgumentError(f"rank {rank} is not in range for WORLD_SIZE={workers}",
                                   hint="ranks run from 0 to WORLD_SIZE - 1")
    return int(workers)


def restart_count() -> int:
    """How often torchrun restarted this worker (``TORCHELASTIC_RESTART_COUNT``)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def check_resume(resume: Any) -> str | bool:
    if not any(resume is c or (isinstance(c, str) and resume == c) for c in RESUME_CHOICES):
        raise InvalidArgumentError(f"resume must be 'auto', True or False, not {resume!r}")
    return resume


@dataclasses.dataclass
class Control:
    """One read of the control area."""

    words: np.ndarray
    workers: int
    #: wall clock (ms) of the read
    at_ms: int

    @classmethod
    def parse(cls, words: np.ndarray, workers: int, at_ms: int | None = None) -> Control:
        return cls(np.asarray(words, dtype=np.int64).copy(), workers, now_ms() if at_ms is None else at_ms)

    def _col(self, which: int) -> np.ndarray:
        return self.words[RANK_BASE + which:RANK_BASE + RANK_WORDS * self.workers:RANK_WORDS]

    @property
    def version(self) -> int:
        return int(self.words[VERSION])

    @property
    def generation(self) -> int:
        return int(self.words[GENERATION])

    @property
    def stopped(self) -> bool:
        return self.generation > 0 and int(self.words[STOP]) == self.generation

    @property
    def resumed(self) -> bool:
        return bool(self.words[RESUMED])

    @property
    def origin(self) -> int:
        """When the fresh run that this run's weights descend from was opened
        (wall clock ms; 0 for a store written before the word existed)."""
        return int(self.words[ORIGIN_MS])

    @property
    def joined(self) -> np.ndarray:
        return self._col(JOINED)

    @property
    def steps(self) -> np.ndarray:
        return self._col(STEP)

    @property
    def beats(self) -> np.ndarray:
        return self._col(BEAT)

    @property
    def finished(self) -> np.ndarray:
        return self._col(FINISHED)

    def age(self, rank: int) -> float:
        """Seconds since ``rank``'s last heartbeat (inf if it never beat)."""
        beat = int(self.beats[rank])
        return float("inf") if beat <= 0 else max(0.0, (self.at_ms - beat) / 1000)

    def in_run(self, rank: int) -> bool:
        return self.generation > 0 and int(self.joined[rank]) == self.generation

    def has_finished(self, rank: int) -> bool:
        return self.generation > 0 and int(self.finished[rank]) == self.generation

    def live(self, rank: int, stale_after: float) -> bool:
        """In the current run, not finished, and heard from recently."""
        return self.in_run(rank) and not self.has_finished(rank) and self.age(rank) < stale_after

    def missing(self) -> list[int]:
        """Ranks that have not joined the current run."""
        return [r for r in range(self.workers) if not self.in_run(r)]

    def unfinished(self) -> list[int]:
        return [r for r in range(self.workers) if not self.has_finished(r)]

    def run_finished(self) -> bool:
        return self.generation > 0 and not self.unfinished()

    def stalled(self, threshold: float) -> list[tuple[int, int, float]]:
        """(rank, last step, seconds since its heartbeat) of every rank of
        the run that has not finished and was silent for ``threshold`` s."""
        return [(r, int(self.steps[r]), self.age(r)) for r in range(self.workers)
                if not self.has_finished(r) and self.age(r) >= threshold]

    def describe_rank(self, rank: int) -> str:
        age = self.age(rank)
        if not self.in_run(rank):
            return f"rank {rank} has not joined"
        when = "never" if age == float("inf") else f"{age:.0f} s ago"
        return f"rank {rank} last reported step {int(self.steps[rank])}, {when}"


@dataclasses.dataclass
class RunEnd:
    """How a run stood when a worker stopped waiting for the others
    (``AsyncOptimizer.close(wait_all=...)``, ``ParameterStore.wait_finished``):
    who finished, and who is missing with their last step and silence."""

    store: str
    workers: int
    #: seconds this worker waited for the others
    waited: float | None
    finished: list[int]
    #: (rank, last step it reported, seconds since it was last heard from)
    missing: list[tuple[int, int, float]]
    #: one phrase per missing rank (has not joined / last reported step S, T s ago)
    notes: list[str]
    #: this worker's frozen parameters that differ from rank 0's at start
    frozen_changed: list[str] = dataclasses.field(default_factory=list)
    #: the ranks whose collapse watch saw the shared model collapse (smb2.train.stability)
    collapsed: list[int] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, store: str, control: Control, waited: float | None) -> RunEnd:
        out = control.unfinished()
        return cls(store, control.workers, waited, [r for r in range(control.workers) if control.has_finished(r)],
                   [(r, int(control.steps[r]), control.age(r)) for r in out],
                   [control.describe_rank(r) for r in out])

    @property
    def complete(self) -> bool:
        return not self.missing

    @property
    def healthy(self) -> bool:
        """Every worker finished and none saw the shared model collapse."""
        return self.complete and not self.collapsed

    def __str__(self) -> str:
        within = "" if self.waited is None else f" within {self.waited:g} s"
        head = f"{len(self.finished)} of {self.workers} workers finished store {self.store!r}{within}"
        collapse = [] if not self.collapsed else [
            f"the shared model collapsed during the run (seen by rank{'s' if len(self.collapsed) > 1 else ''} "
            f"{', '.join(map(str, self.collapsed))}; see their warnings): it is not a trained model"]
        return "; ".join([head, *self.notes, *collapse])


# -- decisions -------------------------------------------------------------------

@dataclasses.dataclass
class Decision:
    """What a rank does with the store: ``"fresh"`` or ``"resume"`` (rank 0
    opens run G+1), ``"rejoin"`` (continue in the live run G), ``"join"``
    (enter run G that rank 0 opened) or ``"wait"`` (for rank 0 to open one)."""

    action: str
    why: str


def others_alive(c: Control, rank: int, stale_after: float) -> bool:
    """Is the run still going without ``rank``: some other rank live or
    finished in it (a run whose every other rank is silent is dead)."""
    return any(c.live(r, stale_after) or c.has_finished(r) for r in range(c.workers) if r != rank)


def may_rejoin(c: Control, rank: int, restarted: bool, stale_after: float) -> bool:
    """A restarted worker goes back into the run it was in, if that run is
    still going on without it (also when it had finished its part: it
    then finishes again at once, instead of opening a new run under the
    others' feet)."""
    return restarted and c.in_run(rank) and c.workers > 1 and others_alive(c, rank, stale_after)


def decide_rank0(c: Control, *, resume: str | bool, restarted: bool, stale_after: float) -> Decision:
    if c.generation == 0:
        return Decision("fresh", "the store is new")
    if may_rejoin(c, 0, restarted, stale_after):
        return Decision("rejoin", "rank 0 was restarted and the run goes on")
    if restarted:
        return Decision("resume", "rank 0 was restarted (TORCHELASTIC_RESTART_COUNT > 0)")
    if resume is True:
        return Decision("resume", "resume=True")
    if resume is False:
        return Decision("fresh", "resume=False")
    if c.run_finished():
        return Decision("fresh", "the earlier run finished")
    return Decision("resume", "an earlier run did not finish")


def decide_other(c: Control, rank: int, *, restarted: bool, stale_after: float) -> Decision:
    """A rank > 0 never opens a run: it joins the one rank 0 opened, goes
    back into the one it was restarted out of, or waits."""
    if c.generation == 0:
        return Decision("wait", "rank 0 has not opened a run yet")
    if c.in_run(rank):
        if may_rejoin(c, rank, restarted, stale_after):
            return Decision("rejoin", f"rank {rank} was restarted and the run goes on")
        return Decision("wait", f"run {c.generation} is one this rank was in before; waiting for a new one")
    if c.live(0, stale_after) and not c.stopped:
        return Decision("join", f"rank 0 opened run {c.generation}")
    return Decision("wait", f"run {c.generation} is not open (rank 0 is not in it or silent)")
