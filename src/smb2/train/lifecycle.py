"""The control words of a parameter store and the decisions a job's ranks
take from them: which run (generation) a rank belongs to, whether a run
starts fresh or resumes, who is missing, who stalled.  Pure: no I/O here
(:mod:`smb2.train.store` reads and writes the words).

The control words (int64), in their logical order (a :class:`Control` holds
them so; :class:`ControlMap` says where each one lies in the buffer)::

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
    words 6-7     JOINS       the start barrier's counters, one for even and
                              one for odd runs: ``G << 32 | ranks counted in``
                              (the opener of run G sets G's to ``G << 32 | 1``)
    8 + 4r + 0    JOINED[r]   the last run rank r joined
    8 + 4r + 1    STEP[r]     rank r's step (kept on resume, 0 when fresh)
    8 + 4r + 2    BEAT[r]     wall clock (ms) of rank r's last heartbeat
    8 + 4r + 3    FINISHED[r] the last run rank r finished

Every per-rank word holds a generation number instead of a flag, so opening
run G+1 resets all of them at once (nobody has joined, finished or stopped
G+1) and a straggler of an old run can never count towards the new one.
Each rank writes only its own four words.  The start barrier counts with
``fetch_add`` on the run's JOINS word, so a waiting rank reads one 64-byte
line per poll, whatever the number of workers; a rank that finds the word
tagged with another run took no part in it and takes its count back.

Where the words lie (:class:`ControlMap`): the version word, which every
push raises, on the store's first stripe right after the layout table; the
run's head line (words 1-7) and the ranks' rows spread over the following
stripes, one page of rows per stripe, on as many servers as the rows need
(at most ``ROWS_PER_PAGE`` ranks per page, at most one page per other
server).  A heartbeat writes its rank's row and reads the head line and one
``ROTATION``-rank chunk of the others' rows, in turn, so a rank silent for
``threshold`` seconds shows in :meth:`Control.stalled` within ``threshold +
chunks * BEAT_INTERVAL`` (store) of a heartbeating rank, with at most ``2 *
ceil(workers / ROTATION) + 1`` chunks (:meth:`ControlMap.chunks`).

Heartbeat ages compare wall clocks of different hosts: they are meant for
thresholds of tens of seconds (``stale_after``), which NTP-synchronized
hosts meet.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError

log = logging.getLogger("smb2.train")

VERSION, GENERATION, STOP, OPENED_MS, RESUMED, ORIGIN_MS, JOINS_EVEN, JOINS_ODD = range(8)
RANK_BASE = 8
RANK_WORDS = 4
JOINED, STEP, BEAT, FINISHED = range(RANK_WORDS)
RESUME_CHOICES = ("auto", True, False)

#: a rank whose heartbeat is older than this (seconds) counts as dead when
#: ranks decide which run to join
STALE_AFTER = 60.0


#: the head line's word 0 (the version word lies apart): the end barrier's
#: counter, ``G << 32 | ranks finished``, set to ``G << 32`` by run G's opener
FINISHES_AT = 0
#: ranks per page of rows: pages beyond this many ranks go to other servers
ROWS_PER_PAGE = 128
#: ranks' rows a heartbeat reads besides its own (one contiguous read)
ROTATION = 256
#: bytes of a rank's row and of a line of run words
ROW_BYTES = 8 * RANK_WORDS
LINE = 64


def slots_for(workers: int) -> int:
    return RANK_BASE + RANK_WORDS * workers


def rank_word(rank: int, which: int) -> int:
    """The control word (slot) ``which`` (JOINED, STEP, BEAT, FINISHED) of ``rank``."""
    return RANK_BASE + RANK_WORDS * rank + which


def joins_word(generation: int) -> int:
    """The JOINS word that counts run ``generation``'s start barrier."""
    return JOINS_ODD if generation % 2 else JOINS_EVEN


def joins_counted(words: np.ndarray, generation: int) -> int:
    """How many ranks the JOINS word of run ``generation`` counts in (0 while
    it holds another run's count)."""
    return tagged_count(int(words[joins_word(generation)]), generation)


def tagged_count(value: int, generation: int) -> int:
    """The count of a counter word ``G << 32 | count`` if it is run
    ``generation``'s, else 0."""
    return value & 0xFFFFFFFF if generation > 0 and value >> 32 == generation else 0


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class ControlMap:
    """Where the control words of a store of ``workers`` ranks lie, for its
    buffer's ``stripe`` and ``nservers`` (pure).  ``start`` (8-aligned):
    the byte after the layout table.

    The version word's line is at ``start``, on the first stripe; page 0
    (the run's head line, then rows) begins at the next stripe boundary and
    each further page of rows one ``stride`` (whole stripes) on, so the
    pages lie on consecutive servers after the first stripe's (with one
    server all lie together).  Rank ``r``'s row is on page ``r % pages``.
    The notification area runs from ``start`` to :attr:`end`; the bytes
    between the pages are unused: that costs ``pages`` stripes of memory
    (at most one per server) to put the heartbeats and the barrier beside
    the version word instead of on its server."""

    def __init__(self, start: int, workers: int, stripe: int, nservers: int) -> None:
        self.start = start
        self.workers = workers
        spread = nservers > 1
        self.pages = max(1, min(max(1, nservers - 1), -(-workers // ROWS_PER_PAGE)))
        #: ranks on each page (page p holds ranks p, p + pages, ...)
        self.per_page = -(-workers // self.pages)
        page_bytes = LINE + ROW_BYTES * self.per_page
        self.first = _round_up(start + LINE, stripe) if spread else start + LINE
        self.stride = _round_up(page_bytes, stripe) if spread else page_bytes
        self.head = self.first
        #: the byte after the last word
        self.end = self.page_offset(self.pages - 1) + LINE + ROW_BYTES * self.ranks_on(self.pages - 1)
        #: the notification area's words (from ``start``)
        self.slots = (self.end - start) // 8

    def page_offset(self, page: int) -> int:
        return self.first + page * self.stride

    def ranks_on(self, page: int) -> int:
        return len(range(page, self.workers, self.pages))

    def rows_offset(self, page: int) -> int:
        """The first row of ``page`` (after its line: the head line on page
        0, unused elsewhere, so every page is laid out alike)."""
        return self.page_offset(page) + LINE

    def row_offset(self, rank: int) -> int:
        return self.rows_offset(rank % self.pages) + ROW_BYTES * (rank // self.pages)

    def offset(self, word: int) -> int:
        """The byte of logical word ``word`` (see the module's table)."""
        if word == VERSION:
            return self.start
        if word < RANK_BASE:
            return self.head + 8 * word
        rank, which = divmod(word - RANK_BASE, RANK_WORDS)
        return self.row_offset(rank) + 8 * which

    def slot(self, word: int) -> int:
        """The notification slot of logical word ``word``."""
        return (self.offset(word) - self.start) // 8

    def extents(self) -> list[tuple[int, int]]:
        """The byte ranges that hold words: the version's line and each page."""
        return [(self.start, self.start + LINE)] + [
            (self.page_offset(p), self.rows_offset(p) + ROW_BYTES * self.ranks_on(p)) for p in range(self.pages)]

    def chunks(self, size: int = ROTATION) -> list[list[tuple[int, int, int]]]:
        """Chunks of at most ``size`` rows that cover every rank once: a
        heartbeat reads one per beat, in turn.  A chunk is one or more
        (page, first row, rows) pieces, one read each; consecutive pieces
        share a chunk while they fit, so there are at most ``2 * ceil(workers
        / size) + 1`` chunks however many pages there are."""
        pieces = []
        for p in range(self.pages):
            n = self.ranks_on(p)
            pieces += [(p, i, min(size, n - i)) for i in range(0, n, size)]
        out: list[list[tuple[int, int, int]]] = []
        for piece in pieces:
            if out and sum(rows for _p, _f, rows in out[-1]) + piece[2] <= size:
                out[-1].append(piece)
            else:
                out.append([piece])
        return out

    def ranks_of(self, page: int, first: int, rows: int) -> range:
        """The ranks of rows ``first .. first + rows`` of ``page``."""
        return range(page + first * self.pages, page + (first + rows) * self.pages, self.pages)

    def gather(self, raw: np.ndarray) -> np.ndarray:
        """The logical words out of ``raw``, the int64 words of the whole
        notification area (a checkpoint's bytes; a store's words read whole)."""
        words = np.zeros(slots_for(self.workers), np.int64)
        self.put_head(words, raw[(self.head - self.start) // 8:(self.head - self.start) // 8 + RANK_BASE])
        words[VERSION] = raw[0]
        for p in range(self.pages):
            at = (self.rows_offset(p) - self.start) // 8
            self.put_rows(words, p, 0, raw[at:at + RANK_WORDS * self.ranks_on(p)])
        return words

    @staticmethod
    def put_head(words: np.ndarray, line: np.ndarray) -> None:
        """The head line (words 1-7; its word 0 is unused) into ``words``."""
        words[GENERATION:RANK_BASE] = line[GENERATION:RANK_BASE]

    def put_rows(self, words: np.ndarray, page: int, first: int, rows: np.ndarray) -> range:
        """Rows read from ``page`` (from its row ``first``) into ``words``;
        returns their ranks."""
        ranks = self.ranks_of(page, first, len(rows) // RANK_WORDS)
        grid = words[RANK_BASE:].reshape(self.workers, RANK_WORDS)
        grid[ranks.start:ranks.stop:ranks.step] = np.asarray(rows, np.int64).reshape(-1, RANK_WORDS)
        return ranks


def ranks_list(ranks: list[int], limit: int = 20) -> str:
    """"1, 5, 7" for a message; the first ``limit`` and how many more."""
    more = len(ranks) - limit
    return ", ".join(map(str, ranks[:limit])) + (f" and {more} more" if more > 0 else "")


def now_ms() -> int:
    return int(time.time() * 1000)


def resolve_rank(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world size): explicit arguments, else ``SMB2_RANK`` /
    ``SMB2_WORLD_SIZE`` (one torchrun per worker, see docs/training.md), else
    torchrun's ``RANK`` / ``WORLD_SIZE``, else 0 / 1."""
    if rank is None:
        found = _env_int("SMB2_RANK", "RANK")
        rank = found[1] if found else 0
    if world_size is None:
        found = _env_int("SMB2_WORLD_SIZE", "WORLD_SIZE")
        world_size = found[1] if found else 1
    check_rank(rank, world_size)
    return int(rank), int(world_size)


def restarts_alone(world: int) -> bool:
    """Is a restart of this worker its own alone?  torchrun restarts its
    whole worker group (with every node's, under one rendezvous), so only a
    launcher of one worker (torchrun's ``WORLD_SIZE`` unset or 1, the job's
    rank in ``SMB2_RANK`` / ``SMB2_WORLD_SIZE``, as the Slurm recipe and the
    Kubernetes Job run workers) restarts a worker of a job of ``world`` on
    its own."""
    launched = _env_int("WORLD_SIZE")
    return world > 1 and (launched is None or launched[1] == 1)


def host_workers() -> int:
    """How many workers of the job this one's host runs: ``SMB2_HOST_WORKERS``
    (one torchrun per worker, as the Slurm recipe runs them), else torchrun's
    ``LOCAL_WORLD_SIZE``, else 1."""
    found = _env_int("SMB2_HOST_WORKERS", "LOCAL_WORLD_SIZE")
    if found is None:
        return 1
    name, value = found
    if value < 1:
        raise InvalidArgumentError(f"{name}={os.environ[name]!r} is not a positive integer")
    return value


def _env_int(*names: str) -> tuple[str, int] | None:
    """The first of the environment variables ``names`` that is set: (its
    name, its value as an int); InvalidArgumentError naming it if it is not
    an integer."""
    for n in names:
        v = os.environ.get(n)
        if v is not None and v.strip():
            try:
                return n, int(v)
            except ValueError:
                raise InvalidArgumentError(f"{n}={v!r} is not an integer") from None
    return None


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
    #: wall clock (ms) when each rank's row was read (a heartbeat reads a
    #: chunk of them at a time; 0: not read yet); None: all at ``at_ms``
    seen_ms: np.ndarray | None = None

    @classmethod
    def parse(cls, words: np.ndarray, workers: int, at_ms: int | None = None) -> Control:
        return cls(np.asarray(words, dtype=np.int64).copy(), workers, now_ms() if at_ms is None else at_ms)

    def updated(self, head: np.ndarray, pieces: list[tuple[int, int, np.ndarray]], cmap: ControlMap) -> Control:
        """This read with a newer head line and newer rows, read as (page,
        first row, rows) pieces (a heartbeat's read); the other rows as
        they were seen before."""
        words = self.words.copy()
        cmap.put_head(words, head)
        at = now_ms()
        seen = np.full(self.workers, self.at_ms, np.int64) if self.seen_ms is None else self.seen_ms.copy()
        for page, first, rows in pieces:
            got = cmap.put_rows(words, page, first, rows)
            seen[got.start:got.stop:got.step] = at
        return Control(words, self.workers, at, seen)

    def joins_counted(self) -> int:
        """How many ranks the start barrier of the current run counted in."""
        return joins_counted(self.words, self.generation)

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
        at = self.at_ms if self.seen_ms is None else int(self.seen_ms[rank])
        return float("inf") if beat <= 0 else max(0.0, (at - beat) / 1000)

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
                if not self.has_finished(r) and self.age(r) >= threshold and self.read(r)]

    def read(self, rank: int) -> bool:
        """Was ``rank``'s row read (not only known as 0)?"""
        return self.seen_ms is None or int(self.seen_ms[rank]) > 0

    def only(self, ranks: list[int] | range) -> Control:
        """This read with the rows of ``ranks`` only: the others count as not read."""
        seen = np.zeros(self.workers, np.int64)
        at = np.full(self.workers, self.at_ms, np.int64) if self.seen_ms is None else self.seen_ms
        seen[list(ranks)] = at[list(ranks)]
        return Control(self.words, self.workers, self.at_ms, seen)

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
    #: rule allreduce: this worker's tensors whose weights differ from the leader's at the end (every rank
    #: steps on the same mean, so they end the same unless a rank did something alone)
    drifted: list[str] = dataclasses.field(default_factory=list)
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


def may_rejoin(c: Control, rank: int, restarted: bool, stale_after: float, rejoinable: bool = True) -> bool:
    """A restarted worker goes back into the run it was in, if that run is
    still going on without it (also when it had finished its part: it
    then finishes again at once, instead of opening a new run under the
    others' feet), and the rule lets a worker rejoin (``rejoinable``:
    not one whose workers move in lockstep, whose group torchrun restarts
    whole: rank 0 then opens a new run)."""
    return (rejoinable and restarted and c.in_run(rank) and c.workers > 1
            and others_alive(c, rank, stale_after))


def decide_rank0(c: Control, *, resume: str | bool, restarted: bool, stale_after: float,
                 rejoinable: bool = True) -> Decision:
    if c.generation == 0:
        return Decision("fresh", "the store is new")
    if may_rejoin(c, 0, restarted, stale_after, rejoinable):
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


def decide_other(c: Control, rank: int, *, restarted: bool, stale_after: float,
                 rejoinable: bool = True) -> Decision:
    """A rank > 0 never opens a run: it joins the one rank 0 opened, goes
    back into the one it was restarted out of, or waits."""
    if c.generation == 0:
        return Decision("wait", "rank 0 has not opened a run yet")
    if c.in_run(rank):
        if may_rejoin(c, rank, restarted, stale_after, rejoinable):
            return Decision("rejoin", f"rank {rank} was restarted and the run goes on")
        return Decision("wait", f"run {c.generation} is one this rank was in before; waiting for a new one")
    if c.live(0, stale_after) and not c.stopped:
        return Decision("join", f"rank 0 opened run {c.generation}")
    return Decision("wait", f"run {c.generation} is not open (rank 0 is not in it or silent)")


class Waiting:
    """A wait that says what it waits for (WARNING), after ``after`` s and
    every ``every`` s after, with the time waited and the time left before
    ``deadline`` (monotonic; None: none): a rank that waits minutes for
    another is not silent."""

    def __init__(self, deadline: float | None, after: float, every: float) -> None:
        self.since = time.monotonic()
        self.deadline = deadline
        self.every = every
        self.next = self.since + after
        #: it has said so at least once
        self.said = False

    def due(self) -> bool:
        return time.monotonic() >= self.next

    def say(self, what: str) -> None:
        now = time.monotonic()
        self.next = now + self.every
        self.said = True
        left = "" if self.deadline is None else f", {max(0.0, self.deadline - now):.0f} s before it gives up"
        log.warning("%s (%.0f s so far%s)", what, now - self.since, left)
