"""ParameterStore: a model's named tensors laid out in one striped buffer,
and the life of the training runs that share it.

The buffer describes itself, so a worker that knows only its name can attach
(ETRI's design: a mapping table of named parameters inside the shared memory)::

    byte 0      preamble, eight int64 words
                  magic "SMB2PSTR" | format (3) | state | table bytes |
                  data offset | data bytes | control offset | control words
    byte 64     the layout table, msgpack: tensors [name, dtype, shape, offset],
                  the update rule and its settings (of the run that created
                  the store), the number of workers
    (8-aligned) the control area (see smb2.train.lifecycle): the parameter
                  version's line; then, from the next stripe on, the run's
                  head line (generation, stop, when the run opened, whether
                  it resumed, the start barrier's counters) and the ranks'
                  rows (run joined, step, heartbeat, run finished) in pages
                  of whole stripes, spread over the servers
    (4 KiB)     the data: every tensor at a 64-byte aligned offset

Format 2 (smb2 0.1.0 before the counted barrier) kept every control word in
one block after the table; a store of another format is refused with what
to do, never read with this layout.

``state`` is 0 (empty), 1 (being initialized) or 2 (ready).  The data region
is one contiguous range, so ``pull`` is a single read that the client splits
over every server and runs concurrently.  ``stripe=None`` picks a stripe from
the buffer's size and the server count so that every server holds a share
(``round_up(bytes / servers, 4 KiB)``, at most the client's default stripe).

Runs (generations)
------------------
Every job that opens the store is one run, numbered G = 1, 2, ... in the
GENERATION word.  Only rank 0 opens a run, under the buffer's lock:

* the store is new, or ``resume=False``, or (``resume="auto"``) the previous
  run finished: a **fresh** run: the weights are written again (from
  ``params`` or ``init_from``), the version and every rank's step go to 0;
* ``resume=True``, or ("auto") the previous run did not finish, or this
  process was restarted by torchrun (``TORCHELASTIC_RESTART_COUNT > 0``,
  whatever ``resume`` says): a **resumed** run: weights, version and steps
  stay, each rank continues from its step;
* a restarted rank 0 whose run goes on without it (another rank's heartbeat
  is fresh, or it finished) **rejoins** that run: it writes nothing but its
  own heartbeat, so it never re-initializes a ready store.

Opening run G+1 writes the data and the other control words first and the
GENERATION word last (all fenced by the lock): whoever reads G+1 reads the
reset words with it.  Every per-run word (joined, finished, stop) holds a
run number, not a count, so a new run starts with none of them set, and an
old run's straggler cannot count towards it.

Ranks > 0 never open a run.  They join run G when rank 0 is in it and its
heartbeat is fresh, and they have not been in G before; a rank restarted by
torchrun rejoins the run it was in while that run goes on.  Otherwise they
wait for rank 0 (up to ``timeout``).

Races, and why they are harmless:

* a rank > 0 arrives before rank 0 and finds the old run: it was in it, so
  it waits; or it was not (the old run lacked it) and the old rank 0 is
  silent, so it waits; or the old rank 0 was heard from within
  ``stale_after`` and the rank joins the old run: its ``join()`` barrier
  sees rank 0's newer run appear and moves it there (and pulls again)
  before any step was taken;
* two processes think they are rank 0: the lock orders them, the second
  opens G+2 and the first one's ranks hear of it at their next heartbeat
  (``InterfaceError``: the store was re-opened by a newer run);
* a straggler of the old run still running when a fresh run resets the
  steps may write its own step word once more before its next heartbeat
  stops it (its joined/finished words carry the old run's number and do
  not count);
* a whole torchrun group restarts just as the old heartbeats go stale:
  rank 0 may open a resumed run while a rank that still saw a fresh
  heartbeat rejoins the old one; that rank's next heartbeat raises, and its
  next restart joins rank 0's run;
* heartbeat ages compare the hosts' wall clocks (``stale_after`` defaults
  to 60 s: synchronized hosts are well within that).

Each worker keeps a local mirror of the data region; ``store.params[name]`` are
numpy views into it (a torch module's parameters can be bound to them without
copies, see :mod:`smb2.torch`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from ..checkpoint import read_checkpoint_header
from ..checkpoint import restore as checkpoint_restore
from ..client import DEFAULT_STRIPE, Buffer, Client
from ..errors import (
    BufferConflict,
    BufferDamaged,
    InterfaceError,
    InvalidArgumentError,
    NoSuchBuffer,
    NotifyTimeout,
    PersistenceError,
    Smb2Error,
)
from ..lock import Lock, ReplicatedLock
from ..mirror import AgentMirror
from ..placement import Placement
from . import beside, roster
from . import lifecycle as lc
from .counts import COUNTS, CountsBoard, read_counts
from .dropping import LayerDropping
from .lifecycle import Control, check_rank, resolve_rank
from .rules import UpdateRule, make_rule
from .stability import CollapseWatch, DivergenceGuard, LagScaling, TrainingDiverged
from .weights import AgentWeights, ServerWeights, SharedWeights

log = logging.getLogger("smb2.train")

__all__ = ["FORMAT", "FROZEN", "Layout", "ParameterStore", "StoreImage", "choose_stripe", "describe", "describe_all",
           "frozen_state_name", "optimizer_state_name", "optimizer_state_what", "remove", "resolve_rank",
           "store_damage"]

MAGIC = int.from_bytes(b"SMB2PSTR", "little")
FORMAT = 3
PREAMBLE = 64
# byte offsets of the preamble's words
_MAGIC, _FORMAT, _STATE, _TABLE, _DATA_OFF, _DATA_LEN, _NOTE_OFF, _NOTE_SLOTS = range(0, 64, 8)
EMPTY, INITIALIZING, READY = 0, 1, 2

POLICIES = ("first", "slowest", "average")
DTYPES = ("float32", "float64")

ALIGN = 64              # tensors start on cache-line boundaries
DATA_ALIGN = 4096
#: a rank's heartbeat() sends at most this often (seconds) unless forced
BEAT_INTERVAL = 0.25
#: polls of a barrier (start or end) with its count standing still before a
#: waiting rank reads every rank's row (about 10 s at the longest poll delay)
RECONCILE_POLLS = 100
#: seconds a worker that finds itself in a run it did not finish, with no restart count from its
#: launcher, watches the others' heartbeats to tell a restart (they move) from a job launched again
RESTART_LOOK = 2.0
#: where the rule takes a silent worker for dead, the end barrier looks at the heartbeats of the
#: ranks still out once its count stood still for this many polls, then every SILENCE_LOOK_EVERY s
SILENCE_AFTER_POLLS = 10
SILENCE_LOOK_EVERY = 1.0
#: seconds a rank waits at the start (for rank 0's store, for the others to join) before it says
#: at WARNING what it waits for, and between two such reports
SAY_WAITING_AFTER = 10.0
SAY_WAITING_EVERY = 30.0
#: the start barrier's longest poll delay (seconds) up to CROWD workers;
#: beyond, it grows with the workers, as does the heartbeat's read of the
#: head line's period, so the one server of the head line sees a bounded rate
BARRIER_POLL = 0.1
CROWD = 1000


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def choose_stripe(nbytes: int, nservers: int, limit: int = DEFAULT_STRIPE) -> int:
    """A stripe that gives each of ``nservers`` a share of ``nbytes``:
    ``round_up(nbytes / nservers, 4 KiB)``, at most ``limit``."""
    return max(DATA_ALIGN, min(limit, _round_up(math.ceil(nbytes / max(1, nservers)), DATA_ALIGN)))


class Layout:
    """Names, dtype, shapes and offsets of the tensors; pure, no I/O."""

    def __init__(self, tensors: list[tuple[str, str, tuple[int, ...], int]], workers: int,
                 rule: dict[str, Any]) -> None:
        self.tensors = tensors
        self.workers = workers
        self.rule = rule
        self.dtype = np.dtype(tensors[0][1])
        self.data_len = _round_up(max(off + self.nbytes_of(shape) for _, _, shape, off in tensors), 8)

    def nbytes_of(self, shape: tuple[int, ...]) -> int:
        return math.prod(shape) * self.dtype.itemsize

    @classmethod
    def plan(cls, params: Mapping[str, np.ndarray], workers: int, rule: dict[str, Any]) -> Layout:
        if not isinstance(params, Mapping) or not params:
            raise InvalidArgumentError("params must be a non-empty mapping of name -> numpy array")
        dtypes = set()
        tensors = []
        off = 0
        for name, arr in params.items():
            if not isinstance(name, str) or not name:
                raise InvalidArgumentError(f"tensor names are non-empty strings, not {name!r}")
            if not isinstance(arr, np.ndarray):
                raise InvalidArgumentError(f"tensor {name!r} is a {type(arr).__name__}, not a numpy array")
            if arr.dtype.name not in DTYPES:
                raise InvalidArgumentError(f"tensor {name!r} is {arr.dtype}; the store holds {' or '.join(DTYPES)}")
            dtypes.add(arr.dtype.name)
            tensors.append((name, arr.dtype.name, tuple(int(d) for d in arr.shape), off))
            off = _round_up(off + arr.nbytes, ALIGN)
        if len(dtypes) > 1:
            raise InvalidArgumentError(f"all tensors of a store share one dtype, not {sorted(dtypes)}")
        return cls(tensors, workers, rule)

    def table(self) -> bytes:
        return msgpack.packb({"tensors": [[n, d, list(s), o] for n, d, s, o in self.tensors],
                              "workers": self.workers, "rule": self.rule})

    @classmethod
    def from_table(cls, raw: bytes) -> Layout:
        t = msgpack.unpackb(raw)
        return cls([(n, d, tuple(s), o) for n, d, s, o in t["tensors"]], int(t["workers"]), dict(t["rule"]))

    def geometry(self, stripe: int, nservers: int) -> tuple[lc.ControlMap, int, int]:
        """(where the control words lie, data offset, total bytes) in a
        buffer of this ``stripe`` over ``nservers``."""
        cmap = lc.ControlMap(_round_up(PREAMBLE + len(self.table()), 8), self.workers, stripe, nservers)
        data_off = _round_up(cmap.end, DATA_ALIGN)
        return cmap, data_off, data_off + self.data_len

    def stripe_for(self, nservers: int) -> int:
        """:func:`choose_stripe` for a new store of this layout: from its
        data and its words, over ``nservers``."""
        return choose_stripe(self.data_len + _round_up(PREAMBLE + len(self.table()), DATA_ALIGN), nservers)

    def same_as(self, other: Layout) -> bool:
        return self.tensors == other.tensors

    def summary(self, limit: int = 6) -> str:
        """"w0 (7, 5), b0 (5,), ..." for messages."""
        parts = [f"{n} {tuple(s)}" for n, _d, s, _o in self.tensors[:limit]]
        more = len(self.tensors) - limit
        return ", ".join(parts) + (f", and {more} more" if more > 0 else "")


def _another_model(name: str, theirs: Layout | None, ours: Layout, nbytes: int | None = None) -> InvalidArgumentError:
    what = (f"another model (its tensors: {theirs.summary()})" if theirs is not None
            else f"other contents ({nbytes} bytes, not a parameter store of this model)")
    return InvalidArgumentError(
        f"store {name!r} exists with {what}; remove it with `smb2 rm {name}` or pick another name",
        detail=f"this job's tensors: {ours.summary()}")


#: the rules whose exchange is accumulates into, and reads of, the shared
#: weights: those a host agent serves (:meth:`ParameterStore.use_agent`)
AGENT_RULES = ("accumulate", "delta", "diloco", "easgd")


class ParameterStore:
    """Named tensors in one shared buffer, a local mirror, an update rule, and
    this rank's place in the current run.

    Make it with :meth:`open` (every rank of a job) or :meth:`attach` (an
    observer that knows only the name)."""

    def __init__(self, client: Client, buf: Buffer, layout: Layout, data_off: int, *,
                 rank: int, rule: UpdateRule, dropping: LayerDropping | None) -> None:
        self.client = client
        self.buf = buf
        self.name = buf.name
        self.layout = layout
        self.data_off = data_off
        #: where the shared weights are read and accumulated: the data region on
        #: the servers, or a host agent's mirror of it (:meth:`use_agent`)
        self.weights: SharedWeights = ServerWeights(buf, data_off)
        self.rank = rank
        self.workers = layout.workers
        #: where the control words lie in this buffer
        self.cmap = layout.geometry(buf.stripe, buf.nservers)[0]
        # the heartbeat reads one chunk of the ranks' rows in turn (each rank
        # starts at another, so that the reads spread over the pages)
        self._chunks = self.cmap.chunks(lc.ROTATION)
        self._next_chunk = rank % len(self._chunks)
        self._beats = 0
        #: the local mirror of the whole data region (bytes)
        self.mirror = np.zeros(layout.data_len, dtype=np.uint8)
        #: name -> numpy view of the mirror
        self.params: dict[str, np.ndarray] = {}
        #: name -> (byte offset in the buffer, nbytes)
        self.ranges: dict[str, tuple[int, int]] = {}
        for name, _dt, shape, off in layout.tensors:
            n = layout.nbytes_of(shape)
            self.params[name] = self.mirror[off:off + n].view(layout.dtype).reshape(shape)
            self.ranges[name] = (data_off + off, n)
        self.rule = rule
        self.dropping = dropping
        if dropping is not None and not rule.gradient_rule:
            raise InvalidArgumentError(f"layer dropping applies to gradient rules, not {rule.name!r}")
        #: the last parameter version this worker saw
        self.version = 0
        self.iteration = 0
        self.stats = {"pulls": 0, "pushes": 0, "bytes_pulled": 0, "bytes_pushed": 0, "skipped": 0, "refused": 0,
                      "barrier_polls": 0, "barrier_full_reads": 0}
        #: the store's version when the weights in the mirror were pulled,
        #: and this worker's updates since (already in its weights)
        self.pulled_version = 0
        self.pushed_since_pull = 0
        #: how a push is scaled by its lag (see smb2.train.stability): off for
        #: this numpy API's own loops, on in smb2.torch.AsyncOptimizer (which
        #: sets one that knows its staleness)
        self.lag = LagScaling(layout.workers, enabled=False)
        #: refuses non-finite pushes, skips pushes far out of line
        self.guard = DivergenceGuard(rank)
        #: watches the shared weights this rank pulls for a collapse (reported, not delivered)
        self.watch = CollapseWatch(rank, buf.name)
        #: this rank's row of the counts beside the store (``smb2 ls`` shows them)
        self.board = CountsBoard(client, buf.name, rank, layout.workers, buf.replicas)
        #: the run (generation) this rank is in; 0 for an observer
        self.generation = 0
        #: did this rank's run continue an earlier one's weights and steps?
        self.resumed = False
        #: the step this rank continues from (0 in a fresh run)
        self.start_step = 0
        #: the last read of the control area (heartbeat, join, refresh)
        self.control: Control | None = None
        self.stale_after = lc.STALE_AFTER
        self.restarted = False
        self.checkpoint_every: int | None = None
        self.checkpoint_path: str | None = None
        self._checkpoint_step = 0
        self._checkpointing: asyncio.Future[Any] | None = None
        #: where the weights live on the workers, not in the store (rule
        #: allreduce): rank 0's writer of them, called before a checkpoint
        self.publish_weights: Callable[[], Awaitable[None]] | None = None
        self._last_beat = 0.0
        self._beating: asyncio.Future[None] | None = None
        self._step = 0
        self._joined = False
        # rank 0 of a fresh run wrote the mirror itself: no pull needed
        self._mirror_current = False
        #: False for an observer (attach): it takes no part in a run
        self.member = False
        self.rejoined = False
        rule.bind(self)

    # -- opening ----------------------------------------------------------------
    @classmethod
    async def open(cls, client: Client, name: str, params: Mapping[str, np.ndarray], *,
                   rule: str | UpdateRule = "accumulate", workers: int | None = None, rank: int | None = None,
                   resume: str | bool = "auto", dropping: LayerDropping | None = None,
                   stripe: int | None = None, replicas: int = 1, timeout: float = 60.0,
                   stale_after: float = lc.STALE_AFTER, checkpoint_every: int | None = None,
                   checkpoint_path: str | Path | None = None,
                   init_from: str | Path | None = None, restarted: bool | None = None,
                   pull: bool = True, **rule_options: Any) -> ParameterStore:
        """Open the store ``name`` for one rank of a job whose model's
        tensors are ``params`` (every rank passes the same names, shapes and
        dtype; only rank 0's values are used).

        Rank 0 creates the store if needed and opens a run: fresh or resumed
        by ``resume`` ("auto": resume a run that did not finish, else fresh;
        True; False), always resumed when torchrun restarted this process
        (``restarted``, default ``TORCHELASTIC_RESTART_COUNT > 0``).  The
        other ranks wait (up to ``timeout`` s) for rank 0's run and join it.
        ``rank``/``workers`` default to :func:`resolve_rank`.  Then call
        :meth:`join` (the start barrier), :meth:`heartbeat` as steps go by,
        and :meth:`finish` at the end.

        ``stripe=None`` spreads the buffer over all servers whatever its
        size; ``replicas=2`` keeps two copies of every stripe, so the job
        trains on through a lost server (:meth:`smb2.Client.create`; a
        store that exists keeps the replicas it was made with); ``checkpoint_every=K`` makes rank 0 save the store to
        ``checkpoint_path`` (``{step}`` is replaced) every K of its steps;
        ``init_from=PATH`` makes a fresh run start from such a checkpoint's
        weights, version and steps.  ``pull=False`` leaves the first
        :meth:`pull` of the weights to the caller (a worker that reads them
        through its host agent, :meth:`use_agent`, before it pulls).  Other
        keywords go to the update rule."""
        rank, workers = resolve_rank(rank, workers)
        resume = lc.check_resume(resume)
        if not isinstance(timeout, (int, float)) or timeout < 0:
            raise InvalidArgumentError(f"timeout must be a non-negative number of seconds, not {timeout!r}")
        if checkpoint_every is not None:
            if not isinstance(checkpoint_every, int) or isinstance(checkpoint_every, bool) or checkpoint_every < 1:
                raise InvalidArgumentError(f"checkpoint_every must be a positive int, not {checkpoint_every!r}")
            if checkpoint_path is None:
                raise InvalidArgumentError("checkpoint_every needs checkpoint_path= (a file; '{step}' is replaced)")
            if rank == 0:
                checkpoint_dir(checkpoint_path)
        rule_obj = make_rule(rule, **rule_options)
        layout = Layout.plan(params, workers, rule_obj.settings())
        infer = restarted is None and lc.restart_count() == 0 and lc.restarts_alone(workers)
        restarted = lc.restart_count() > 0 if restarted is None else bool(restarted)
        deadline = time.monotonic() + timeout
        try:
            if rank == 0:
                store = await cls._open_rank0(client, name, params, layout, rule_obj, dropping, stripe, replicas,
                                              resume, restarted, stale_after, deadline, init_from, infer)
            else:
                store = await cls._open_other(client, name, layout, rank, rule_obj, dropping, restarted,
                                              stale_after, deadline, infer)
        except BufferDamaged as err:
            raise store_damage(err, layout, await _last_progress(err, layout)) from None
        store.checkpoint_every = checkpoint_every
        store.checkpoint_path = None if checkpoint_path is None else str(checkpoint_path)
        store._checkpoint_step = store.start_step
        if pull and not store._mirror_current:
            await store.pull()
        elif pull:
            rule_obj.pulled()       # (rank 0 wrote the mirror itself)
        return store

    @classmethod
    async def _open_rank0(cls, client: Client, name: str, params: Mapping[str, np.ndarray], layout: Layout,
                          rule: UpdateRule, dropping: LayerDropping | None, stripe: int | None,
                          replicas: int, resume: str | bool, restarted: bool, stale_after: float, deadline: float,
                          init_from: str | Path | None, infer: bool = False) -> ParameterStore:
        image = None if init_from is None else await StoreImage.load(init_from)
        if image is not None and not image.layout.same_as(layout):
            raise InvalidArgumentError(f"checkpoint {init_from} holds another model "
                                       f"(its tensors: {image.layout.summary()})",
                                       detail=f"this job's tensors: {layout.summary()}")
        # a damaged store is resumed never; started over only when asked to
        start_over = resume is False or image is not None
        chosen = layout.stripe_for(len(client.servers)) if stripe is None else stripe
        buf = await _attach_or_create(client, name, layout.geometry(chosen, len(client.servers))[2], chosen,
                                      replicas, layout, start_over)
        _cmap, data_off, total = layout.geometry(buf.stripe, buf.nservers)
        lock = beside.lock(client, buf)       # the buffer's own lock, replicated with it
        await lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
        try:
            # where the store is made again for this job's number of workers: the store as it was
            # (set aside), and the words the new one carries from it
            carried: Control | None = None
            aside = await _kept_aside(client, name)     # (a store that a rank 0 died making again)
            state = await buf.fetch_add(_STATE, 0)
            made_for = None
            if state == READY:
                theirs, data_off = await _read_layout(buf)
                made_for = theirs.workers
                if aside is not None and await _made_again_already(buf, theirs, aside):
                    aside = None
                if aside is None:
                    if not theirs.same_as(layout):
                        raise _another_model(name, theirs, layout)
                    _say_rule_change(name, theirs.rule, rule.settings())
                    if theirs.workers != layout.workers:
                        aside = await _set_aside(client, buf, theirs)
                    else:
                        layout = theirs
            if aside is not None:
                if not aside.layout.same_as(layout):
                    raise _another_model(name, aside.layout, layout)
                # (a buffer of another number of workers is made anew: its old ranks' rows lie elsewhere)
                in_place = buf.nbytes == total and made_for in (None, layout.workers)
                buf, carried = await _made_again(client, buf, aside, layout, lock, in_place)
                _cmap, data_off, _total = layout.geometry(buf.stripe, buf.nservers)
            elif state != READY:
                if buf.nbytes != total:
                    raise _another_model(name, None, layout, buf.nbytes)
                await _initialize(buf, layout, lock)
            store = cls(client, buf, layout, data_off, rank=0, rule=rule, dropping=dropping)
            store.stale_after, store.restarted = stale_after, restarted
            if aside is None and infer and await store._restarted_unsaid():
                restarted = True
            control = aside.control if aside is not None else await store.refresh()
            # (no rank goes back into a run of another number of workers)
            decision = lc.decide_rank0(control, resume=resume, restarted=restarted, stale_after=stale_after,
                                       rejoinable=rule.rejoinable and aside is None)
            if aside is not None:
                _say_made_again(name, aside, layout.workers, decision, stale_after)
            if decision.action == "rejoin":
                store._enter(control, joined=True, rejoined=True)
                await store._write_own(joined=control.generation)
                store._say_rejoined(decision.why)
            else:
                if image is not None and decision.action != "fresh":
                    log.warning("store %r: init_from=%s is not used: the run resumes (%s)", name, init_from,
                                decision.why)
                await store._open_run(control if carried is None else carried, decision, params, image, lock)
            if aside is not None:
                await beside.discard(client, name, REMAKING)     # (the run is open: the store is whole)
        finally:
            await lock.release()
        return store

    async def _open_run(self, old: Control, decision: lc.Decision, params: Mapping[str, np.ndarray],
                        image: StoreImage | None, lock: Lock | ReplicatedLock) -> None:
        """Rank 0, under the lock: open run G+1, fresh or resumed."""
        gen = old.generation + 1
        words = old.words.copy()
        fresh = decision.action == "fresh"
        restored = 0
        own = lc.rank_word(0, 0)
        if fresh:
            # every control word starts over; the steps from the checkpoint, if any
            words[:] = 0
            steps = words[lc.RANK_BASE + lc.STEP::lc.RANK_WORDS]
            if image is not None:
                # (of a job of another size: the ranks both have keep their steps and states, as a store
                # made again for this job's size does)
                restored = await image.restore_optimizer_states(self.client, self.name, self.buf.replicas,
                                                                self.workers)
                kept = min(image.control.workers, self.workers)
                if image.control.workers != self.workers:
                    log.warning("store %r: checkpoint %s is of %d workers, this job has %d: ranks 0-%d take their "
                                "steps and optimizer states from it, and any other starts at step 0 with a fresh "
                                "optimizer state", self.name, image.path, image.control.workers, self.workers,
                                kept - 1)
                self.mirror[...] = image.data
                words[lc.VERSION] = image.control.version
                steps[:kept] = image.control.steps[:kept]
            else:
                for tname, arr in params.items():
                    self.params[tname][...] = arr
            await self.buf.write(self.data_off, self.mirror, fence=lock)
            self._mirror_current = True
        await self.rule.open_run(fresh)
        await self.board.make()
        words[lc.RESUMED] = int(not fresh or image is not None)
        words[lc.OPENED_MS] = lc.now_ms()
        if fresh and image is not None and restored and image.control.origin:
            # the checkpoint's weights and the optimizer states saved beside
            # them are of its lineage: the ranks load those states
            words[lc.ORIGIN_MS] = image.control.origin
        elif fresh:
            words[lc.ORIGIN_MS] = words[lc.OPENED_MS]     # a new lineage of weights
        words[own + lc.JOINED] = gen
        words[own + lc.BEAT] = lc.now_ms()
        # the start barrier of run G+1 counts rank 0 in already
        words[lc.joins_word(gen)] = gen << 32 | 1
        cmap = self.cmap
        # A resumed run rewrites only rank 0's words and the run's own (the
        # other ranks may still be writing theirs); a fresh one all of them.
        # The generation goes last: whoever reads G+1 reads the rest with it.
        writes = [self.buf.write(cmap.offset(lc.STOP), words[lc.STOP:lc.JOINS_EVEN], fence=lock),
                  # nobody has finished run G+1
                  self.buf.write(cmap.head + 8 * lc.FINISHES_AT, np.array([gen << 32], np.int64), fence=lock),
                  self.buf.write(cmap.offset(lc.joins_word(gen)), words[lc.joins_word(gen):][:1], fence=lock)]
        if fresh:
            grid = words[lc.RANK_BASE:].reshape(self.workers, lc.RANK_WORDS)
            writes += [self.buf.write(cmap.start, words[lc.VERSION:lc.GENERATION], fence=lock),
                       self.buf.write(cmap.offset(lc.joins_word(gen + 1)), np.zeros(1, np.int64), fence=lock)]
            writes += [self.buf.write(cmap.rows_offset(p), grid[p::cmap.pages].copy(), fence=lock)
                       for p in range(cmap.pages)]
        else:
            writes.append(self.buf.write(cmap.row_offset(0), words[own:own + lc.RANK_WORDS], fence=lock))
        await asyncio.gather(*writes)
        await self.buf.write(cmap.offset(lc.GENERATION), np.array([gen], np.int64), fence=lock)
        words[lc.GENERATION] = gen
        # a fresh run's rows are known to be zero, not read: no rank counts as stalled before it was seen
        opened = Control.parse(words, self.workers)
        self._enter(opened.only([0]) if fresh else opened, joined=True)
        if fresh and image is not None:
            log.info("store %r: run %d starts from checkpoint (version %d, step %d)",
                     self.name, gen, self.control.version, self.start_step)  # type: ignore[union-attr]
        elif fresh:
            log.info("store %r: run %d starts fresh (%s)", self.name, gen, decision.why)
        else:
            log.warning("resuming store %r at version %d, step %d (%s); pass resume=False to start over",
                        self.name, old.version, self.start_step, decision.why)

    @classmethod
    async def _open_other(cls, client: Client, name: str, layout: Layout, rank: int, rule: UpdateRule,
                          dropping: LayerDropping | None, restarted: bool, stale_after: float,
                          deadline: float, infer: bool = False) -> ParameterStore:
        while True:
            buf = await _wait_for_buffer(client, name, deadline, rank)
            try:
                await _wait_ready(buf, max(0.0, deadline - time.monotonic()))
                theirs, data_off = await _read_layout(buf)
                break
            except NotifyTimeout:
                raise NotifyTimeout(f"store {name!r} was not initialized by rank 0 in time (did it die?); "
                                    f"rank {rank} gives up") from None
            except NoSuchBuffer:
                # destroyed while this rank read it: rank 0 makes it again for another number of
                # workers (_made_again); look again (_wait_for_buffer gives up at the deadline)
                await asyncio.sleep(0.01)
        if not theirs.same_as(layout):
            raise _another_model(name, theirs, layout)
        if theirs.workers != layout.workers:
            buf, theirs, data_off = await _wait_made_again(client, name, theirs.workers, layout, rank, deadline)
        store = cls(client, buf, theirs, data_off, rank=rank, rule=rule, dropping=dropping)
        store.stale_after, store.restarted = stale_after, restarted
        if infer:
            await store._restarted_unsaid()
        decision = await store._await_run(deadline)
        if decision.action == "rejoin":
            store._say_rejoined(decision.why)
        return store

    async def _restarted_unsaid(self) -> bool:
        """Was this worker restarted, though its launcher did not say so (no
        torchrun restart count: a container its kubelet restarted, a pod
        made again for its index on another node, a rank launched again by
        hand)?  Asked at open, where its restart would be its own: it was in
        the current run and did not finish it (its own row says; only then
        is every row read), and another rank of the run beats (its
        heartbeat moves within :data:`RESTART_LOOK` s): the run goes on, so
        this is a restart (a job launched again after the whole job died
        finds no heartbeat moving: a new run, as before).  Sets
        :attr:`restarted`.  Where this rank's own heartbeat moves, another
        process trains as this rank: that is refused, in words."""
        mine = await self._read_control((self.rank,))
        if not mine.in_run(self.rank) or mine.has_finished(self.rank) or mine.stopped:
            return False
        control = await self.refresh()
        await asyncio.sleep(RESTART_LOOK)
        later = await self.refresh()
        if later.generation != control.generation:
            return False
        if int(later.beats[self.rank]) != int(control.beats[self.rank]):
            raise InterfaceError(f"rank {self.rank} of store {self.name!r} is training in run {control.generation} "
                                 f"already: its heartbeat moves, so another process holds this rank",
                                 hint="give every worker its own rank (SMB2_RANK, or torchrun's RANK): two were "
                                      f"launched as rank {self.rank}")
        moving = [r for r in range(self.workers) if r != self.rank and later.in_run(r)
                  and not later.has_finished(r) and int(later.beats[r]) != int(control.beats[r])]
        if not moving:
            return False
        log.warning("store %r: rank %d was in run %d and did not finish it, and rank %s still beat in it: it was "
                    "restarted, though its launcher did not say so (no torchrun restart count: a container "
                    "restarted by its kubelet, a pod made again on another node, a rank launched again by hand)",
                    self.name, self.rank, control.generation, ", ".join(map(str, moving[:8])))
        self.restarted = True
        return True

    def _say_rejoined(self, why: str) -> None:
        if self.rule.watches_heartbeats:
            # (lockstep: the step it goes on from is the one its leader hands it, not its old self's last)
            log.warning("store %r: rank %d rejoins run %d, to be taken back in step with the others (%s)",
                        self.name, self.rank, self.generation, why)
        else:
            log.warning("store %r: rank %d rejoins run %d at step %d (%s)", self.name, self.rank, self.generation,
                        self.start_step, why)

    async def _await_run(self, deadline: float, newer_than: int = 0) -> lc.Decision:
        """A rank > 0: wait until there is a run to join or rejoin (newer
        than ``newer_than``), and take its place in it."""
        delay = 0.005
        while True:
            # rank 0's row and this rank's decide, unless this restarted rank
            # was in the run: whether it goes on without it takes every row
            control = await self._read_control((0, self.rank))
            if self.restarted and control.in_run(self.rank):
                control = await self.refresh()
            else:
                self.control = control
            decision = lc.decide_other(control, self.rank, restarted=self.restarted, stale_after=self.stale_after,
                                       rejoinable=self.rule.rejoinable)
            if decision.action != "wait" and control.generation > newer_than:
                rejoined = decision.action == "rejoin"
                self._enter(control, joined=rejoined, rejoined=rejoined)
                await self._write_own(joined=control.generation if self._joined else None)
                return decision
            if time.monotonic() >= deadline:
                raise NotifyTimeout(
                    f"rank 0 did not open a run of store {self.name!r} for rank {self.rank} in time "
                    f"({decision.why}; {control.describe_rank(0)}): start rank 0 with the same store name "
                    "and SMB2_SERVERS, or raise timeout=")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    def _enter(self, control: Control, *, joined: bool, rejoined: bool = False) -> None:
        self.member = True
        self.control = control
        self.generation = control.generation
        # a rank that rejoins a run continues where it was, like a resumed one
        self.resumed = control.resumed or rejoined
        self.start_step = self._step = self.iteration = int(control.steps[self.rank])
        self.version = self.pulled_version = control.version
        self._joined = joined
        #: this rank came back into a run that went on without it (it opened nothing)
        self.rejoined = rejoined

    @classmethod
    async def attach(cls, client: Client, name: str, *, rank: int = 0, rule: str | UpdateRule | None = None,
                     dropping: LayerDropping | None = None, timeout: float = 60.0,
                     **rule_options: Any) -> ParameterStore:
        """Attach to the store ``name`` knowing nothing but its name, as an
        observer (it joins no run): waits (up to ``timeout`` s) for the
        buffer to exist and be initialized, reads the layout table from it and
        pulls the parameters.  The update rule defaults to the one recorded
        by the creator."""
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            try:
                buf = await client.attach(name)
                break
            except BufferDamaged as err:
                raise store_damage(err, None) from None
            except NoSuchBuffer:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.25)
        await _wait_ready(buf, max(0.0, deadline - time.monotonic()))
        layout, data_off = await _read_layout(buf)
        if rule is None:
            settings = dict(layout.rule)
            rule = settings.pop("name")
            settings.update(rule_options)
            rule_options = settings
        rule_obj = make_rule(rule, **rule_options)
        check_rank(rank, layout.workers)
        store = cls(client, buf, layout, data_off, rank=rank, rule=rule_obj, dropping=dropping)
        await store.refresh()
        await store.pull()
        return store

    # -- data -------------------------------------------------------------------
    def agent_serves_rule(self) -> bool:
        """Whether a host agent serves this store's rule (:meth:`use_agent`);
        where it does not, that is said at WARNING: the store exchanges
        through the servers directly."""
        if self.rule.name in AGENT_RULES:
            return True
        log.warning("rank %d of store %r: the host agent serves rules %s; rule %r exchanges through the "
                    "servers directly", self.rank, self.name, ", ".join(AGENT_RULES), self.rule.name)
        return False

    async def use_agent(self, agent: Client, *, timeout: float = 30.0, host_workers: int = 1) -> bool:
        """Read and accumulate the shared weights through the host agent
        that ``agent`` is connected to (``smb2-agent``, :mod:`smb2.agent`):
        this host's workers push into one mirror of the data region on their
        host, and the agent forwards their combined pushes and pulls for
        them all, every few milliseconds.  A pull then holds the servers'
        weights as of the agent's last pull (one cycle older than a direct
        read) and this host's pushes since; the agent forwards in the rule's
        wire type (``wire``), what its rounding leaves out staying on the host
        for the next forward.  The control words (the
        version, the barrier, heartbeats), locks and side buffers still go to
        the servers, but for the pushes a rule sends into a side buffer through
        the agent too (``diloco``'s pending pseudo-gradients:
        :meth:`smb2.train.rules.DiLoCo.through_agent`).

        Rules that exchange by other means than accumulates into the
        weights (``allreduce``: its gradient sums each step; ``locked``:
        read-modify-write under the lock) are not served: said at WARNING,
        False returned, and the store keeps reaching the servers.  Call it
        after :meth:`join`, when the run's first weights are on the servers:
        it returns once the mirror holds what the servers hold now.  The
        agent's loss later is survived (:class:`AgentWeights`).
        ``host_workers``: this host's workers of the job, whose pushes (and
        reads) the agent gathers into one (:mod:`smb2.mirror`)."""
        if not self.agent_serves_rule():
            return False
        # the agent forwards as the rule pushes (diloco: bfloat16 by default), what
        # that rounding leaves out staying on the host for the next forward
        wire = getattr(self.rule, "wire", None) if self.layout.dtype == np.float32 else None
        # (pulled once opened: it holds what the servers hold now)
        mirror = await AgentMirror.open_pulled(agent, self.buf, self.data_off, self.layout.data_len,
                                               self.layout.dtype, timeout=timeout, wire=wire,
                                               host_workers=host_workers)
        self.weights = AgentWeights(mirror, ServerWeights(self.buf, self.data_off), self.name, self.rank)
        await self.rule.through_agent(agent, self.weights, timeout=timeout, host_workers=host_workers)
        log.info("rank %d of store %r exchanges through the host agent at %s", self.rank, self.name, mirror.agent)
        return True

    async def pull(self) -> None:
        """Read every parameter into the mirror (one read over all servers)."""
        await self.pull_into(self.mirror)
        self.rule.pulled()

    async def pull_into(self, out: np.ndarray) -> int:
        """Read the data region into ``out`` (the mirror, or a host array
        laid out like it) and the version it holds at least; returns it."""
        version = await self.read_version()     # first: the data read after holds at least these updates
        await self.weights.read_into(out)
        self.guard.check_pulled(self.iteration, self.tensors_of(out.view(self.layout.dtype)))
        self.watch.see(self.iteration, out.view(self.layout.dtype))
        self.pulled_version, self.pushed_since_pull = version, 0
        self.stats["pulls"] += 1
        self.count_pull(out.nbytes)
        return version

    async def push(self, grads: Mapping[str, np.ndarray], *, step: int | None = None, lr: float | None = None,
                   based_on: tuple[int, int] | None = None) -> bool:
        """Apply one step's gradients (rule ``delta``: changes) with the
        update rule, then count the update in the version.

        The divergence guard sees the step first (a non-finite value raises
        :class:`~smb2.train.stability.TrainingDiverged`; a step far out of
        line with the recent ones is skipped: False is returned).  Then the
        push is scaled by its lag (rules that push every step):
        ``based_on=(version, own)`` is the version of the pull the step was
        computed on and this worker's pushes since (default: the last
        :meth:`pull`'s, and the pushes since).  ``lr``: this push's learning rate (gradient
        rules; default the rule's).  ``step`` names the step in messages."""
        self._check_grads(grads)
        scale = await self._admit(grads, step, based_on)
        if scale is None:
            return False
        sent = await self.rule.push(grads, scale=scale, lr=lr)
        await self.count_push(sent, update=sent > 0)     # (nothing sent: all kept home, or a local step)
        return True

    async def push_region(self, region: np.ndarray, *, step: int | None = None,
                          based_on: tuple[int, int] | None = None) -> bool:
        """:meth:`push` of every tensor's change at once, ``region`` laid
        out like :meth:`flat` (padding zero): rule ``delta`` sends it as it
        is (scaled in place), without a copy."""
        # (an elastic round's pseudo-gradient: the guard compares it per inner step)
        scale = await self._admit(self.tensors_of(region), step, based_on, steps=self.rule.round_steps)
        if scale is None:
            return False
        sent = await self.rule.push_region(region, scale=scale)
        await self.count_push(sent, update=sent > 0)
        return True

    async def _admit(self, changes: Mapping[str, np.ndarray], step: int | None,
                     based_on: tuple[int, int] | None, steps: int = 1) -> float | None:
        """The guard's verdict on a push of ``steps`` inner steps' changes
        (None: skipped), else its lag's scale."""
        step = self.iteration if step is None else step
        try:
            admitted = self.guard.check(step, changes, steps=steps)
        except TrainingDiverged:
            self.stats["refused"] += 1
            if self.member:         # the worker stops here: its count reaches the servers first
                await self.publish_counts(force=True)
            raise
        if not admitted:
            self.stats["skipped"] += 1
            return None
        if not (self.rule.lag_scaled and self.lag.enabled):
            return 1.0
        version, own = (self.pulled_version, self.pushed_since_pull) if based_on is None else based_on
        return self.lag.factor(max(0, await self.read_version() - version - own))

    def counts(self) -> dict[str, int]:
        """What kept this rank's updates in bounds, so far: pushes the guard
        skipped (far out of line) and refused (not finite), pushes scaled by
        their lag, the largest lag, and collapses of the shared model seen."""
        return {"skipped": self.stats["skipped"], "refused": self.stats["refused"], "lag_scaled": self.lag.scaled,
                "max_version_lag": self.lag.max_lag, "collapses": self.watch.collapses}

    async def publish_counts(self, *, force: bool = False) -> None:
        """:meth:`counts` into the store's counts board (at a low rate unless ``force``)."""
        await self.board.publish(self.generation, self.counts(), self._step, force=force)

    def count_pull(self, nbytes: int) -> None:
        """Count the bytes a read of the shared weights brought in (a pull,
        a locked read-modify-write, an elastic exchange's read of the center)."""
        self.stats["bytes_pulled"] += nbytes

    async def count_push(self, nbytes: int, *, update: bool = True) -> None:
        """Count what a push sent (``nbytes`` on the wire) once its data
        landed, and (``update``) one update in the version.  A layer pushed
        during backward is a part of a step: ``update=False``; the step
        counts once, when its last part went out."""
        self.stats["bytes_pushed"] += nbytes
        if update:
            self.stats["pushes"] += 1
            self.pushed_since_pull += 1
            await self.bump_version()

    def _check_grads(self, grads: Mapping[str, np.ndarray]) -> None:
        if not isinstance(grads, Mapping):
            raise InvalidArgumentError(f"grads must map tensor names to arrays, not {type(grads).__name__}")
        for name, g in grads.items():
            p = self.params.get(name)
            if p is None:
                raise InvalidArgumentError(f"no tensor {name!r} in the store (it has {list(self.params)})")
            if not isinstance(g, np.ndarray) or g.shape != p.shape:
                raise InvalidArgumentError(
                    f"gradient of {name!r} must be an array of shape {p.shape}, "
                    f"not {getattr(g, 'shape', type(g).__name__)}")

    def flat(self) -> np.ndarray:
        """The whole data region as one array of the store's dtype (a view)."""
        return self.mirror.view(self.layout.dtype)

    def flat_offset(self, name: str) -> int:
        """Where tensor ``name`` starts in :meth:`flat` (elements)."""
        return (self.ranges[name][0] - self.data_off) // self.layout.dtype.itemsize

    def tensors_of(self, region: np.ndarray) -> dict[str, np.ndarray]:
        """Tensor name -> its view (shaped) in ``region``, a flat array laid
        out like :meth:`flat`."""
        out = {}
        for name, p in self.params.items():
            o = self.flat_offset(name)
            out[name] = region[o:o + p.size].reshape(p.shape)
        return out

    # -- version ----------------------------------------------------------------
    async def bump_version(self) -> int:
        """Count one applied update; called by the rules after their data."""
        self.version = await self.buf.notify_add(lc.VERSION, 1) + 1
        return self.version

    async def read_version(self) -> int:
        self.version = await self.buf.read_notify(lc.VERSION)
        return self.version

    async def wait_version(self, at_least: int, timeout: float | None = None) -> int:
        """Wait until at least ``at_least`` updates were applied in all."""
        try:
            self.version = await self.buf.wait_notify(lc.VERSION, at_least, timeout=timeout)
        except NotifyTimeout:
            raise NotifyTimeout(f"store {self.name!r} got {await self.read_version()} updates, still fewer than "
                                f"{at_least} after {timeout} s") from None
        return self.version

    # -- the run: control words ------------------------------------------------------
    async def refresh(self) -> Control:
        """Read every control word (one read per page of rows) into :attr:`control`."""
        self.control = await self._read_control()
        return self.control

    async def _read_control(self, ranks: tuple[int, ...] | None = None) -> Control:
        """The control words: the version, the head line and every rank's
        row, or (``ranks``) only those ranks' rows (the others read as 0)."""
        return await _read_control(self.buf, self.cmap, ranks)

    async def _read_head(self) -> np.ndarray:
        """The run's head line (64 bytes: generation, stop, the barrier's counters)."""
        line = np.empty(lc.RANK_BASE, np.int64)
        await self.buf.read_into(line, self.cmap.head)
        return line

    async def _write_own(self, *, joined: int | None = None, finished: int | None = None) -> None:
        """This rank's words: step and heartbeat, and joined / finished if given."""
        base = self.cmap.row_offset(self.rank)
        step_beat = [self._step, lc.now_ms()]
        if joined is not None:
            await self.buf.write(base, np.array([joined, *step_beat], np.int64))
        elif finished is not None:
            await self.buf.write(base + 8 * lc.STEP, np.array([*step_beat, finished], np.int64))
        else:
            await self.buf.write(base + 8 * lc.STEP, np.array(step_beat, np.int64))
        self._last_beat = time.monotonic()

    def _check_member(self) -> None:
        if not self.member:
            raise InterfaceError(f"this handle of store {self.name!r} is an observer (attach); "
                                 "only ranks that open() the store take part in a run")

    def _check_current(self, control: Control) -> None:
        self._check_run(control.generation)

    def _check_run(self, generation: int) -> None:
        if generation != self.generation:
            raise InterfaceError(
                f"store {self.name!r} was re-opened by a newer run ({generation}) while rank "
                f"{self.rank} was in run {self.generation}: this worker stops (two jobs use the same store "
                "name, or rank 0 of a new job started while this one ran)")

    async def join(self, timeout: float | None = 60.0) -> None:
        """The start barrier of this run: count this rank in and wait until
        every rank has joined.  Its timeout says how many joined and which
        ranks are missing.  A rank that rejoined a running run passes.

        A waiting rank reads the run's 64-byte head line per poll (its
        counter of joined ranks), whatever the number of workers; only
        after ``RECONCILE_POLLS`` polls in which the count stood still, and
        at the timeout, does it read every rank's row (a rank that died
        between its row and its count and came back into the run is
        counted so).  Past it, a rule that takes a silent worker for dead
        (``allreduce``) has this rank beat in the background
        (:meth:`keep_beating`), but a restarted one, which beats once it is
        taken back (its beats would keep its old self, which the others
        wait for, alive)."""
        self._check_member()
        await self._await_joins(None if timeout is None else time.monotonic() + timeout, timeout)
        if self.rule.watches_heartbeats and not self.rejoined:
            self.keep_beating()

    async def _await_joins(self, deadline: float | None, timeout: float | None) -> None:
        if not self._joined:
            if self.rank:
                # rank 0 may have opened a newer run since open() chose this one
                if int((await self._read_head())[lc.GENERATION]) != self.generation:
                    await self._move_to_newer(deadline)
            await self._count_in()
        delay = 0.005
        last, still = -1, 0
        waiting = lc.Waiting(deadline, SAY_WAITING_AFTER, SAY_WAITING_EVERY)
        while True:
            head = await self._read_head()
            self.stats["barrier_polls"] += 1
            if int(head[lc.GENERATION]) != self.generation:
                if self.rank == 0:
                    self._check_run(int(head[lc.GENERATION]))
                await self._move_to_newer(deadline)
                await self._count_in()
                continue
            counted = lc.joins_counted(head, self.generation)
            if counted >= self.workers:
                return
            still = still + 1 if counted == last else 0
            last = counted
            now = time.monotonic()
            timed_out = deadline is not None and now >= deadline
            if timed_out or still >= RECONCILE_POLLS:
                still = 0
                self.stats["barrier_full_reads"] += 1
                control = await self.refresh()
                missing = control.missing()
                if control.generation != self.generation:
                    continue
                if not missing:
                    return
                if timed_out:
                    raise NotifyTimeout(
                        f"{self.workers - len(missing)} of {self.workers} workers joined store {self.name!r} "
                        f"within {timeout} s (missing ranks: {lc.ranks_list(missing)}); check WORLD_SIZE "
                        f"({self.workers}) and that every rank is running")
            if waiting.due():
                # rank 0 names the missing ranks (one read of every row); the others say the count
                # they polled, so that a slow start of many ranks adds no read of the table per rank
                if self.rank == 0 and (missing := (await self.refresh()).missing()):
                    whom = f"rank{'s' if len(missing) > 1 else ''} {lc.ranks_list(missing)}"
                else:
                    whom = f"{self.workers - counted} of the {self.workers} ranks"
                waiting.say(f"store {self.name!r}: rank {self.rank} waits for {whom} to join ({counted} of "
                            f"{self.workers} joined; every rank starts with the same store name, SMB2_SERVERS "
                            "and WORLD_SIZE)")
            if now - self._last_beat >= 1.0:
                await self._write_own()     # stay visibly alive while waiting
            await asyncio.sleep(delay)
            # the head line is one server's: its polls stay near 10,000 a second in all
            delay = min(delay * 2, BARRIER_POLL * max(1.0, self.workers / CROWD))

    async def _count_in(self) -> None:
        """Join this rank's run: its row says so, then the run's counter
        counts it.  A counter tagged with another run (one opened since this
        rank chose its run) did not count it: the count is taken back, and
        the next poll of the barrier finds the newer run.  The row's joined
        word is set by compare-and-swap: one that holds this run already was
        set by another process launched as this rank (a restart rejoins,
        and never comes here), which is refused, in words, before it
        counts: the mean of a round would count that rank twice."""
        joined = self.cmap.row_offset(self.rank) + 8 * lc.JOINED
        before = await self.buf.fetch_add(joined, 0)
        while before != self.generation and (now := await self.buf.compare_swap(joined, before,
                                                                                  self.generation)) != before:
            before = now        # (rank 0 opened a newer run meanwhile and wrote the row: as it is now)
        if before == self.generation:
            raise InterfaceError(f"rank {self.rank} of store {self.name!r} joined run {self.generation} already: "
                                 f"another process was launched as rank {self.rank}",
                                 hint="give every worker its own rank (SMB2_RANK, or torchrun's RANK); this one "
                                      "stops, and the job goes on with the one that joined first")
        await self._write_own()
        await self._count(self.cmap.offset(lc.joins_word(self.generation)))
        self._joined = True

    async def _count(self, offset: int) -> None:
        """Add this rank to the run's counter word at ``offset`` (``G << 32 |
        count``); a word tagged with another run gets its count back."""
        if await self.buf.fetch_add(offset, 1) >> 32 != self.generation:
            await self.buf.fetch_add(offset, -1)

    async def _move_to_newer(self, deadline: float | None) -> None:
        """A rank > 0 still at the barrier follows rank 0 into its newer run."""
        old = self.generation
        await self._await_run(float("inf") if deadline is None else deadline, newer_than=old)
        self._joined = False
        await self.pull()
        log.info("store %r: rank %d moved from run %d to rank 0's run %d", self.name, self.rank, old,
                 self.generation)

    async def heartbeat(self, step: int, *, force: bool = False) -> None:
        """Publish this rank's ``step`` and that it is alive (at most every
        0.25 s unless ``force``; cheap: one small write and one small read).
        Raises :class:`InterfaceError` if a newer run took the store over;
        re-raises a failed background checkpoint."""
        self._check_member()
        self._step = self.iteration = int(step)
        self._raise_checkpoint_error()
        # a checkpoint is due by steps, not by time: checked at every step
        await self._maybe_checkpoint()
        if not force and time.monotonic() - self._last_beat < BEAT_INTERVAL:
            if self.control is not None:
                self._check_current(self.control)     # (as the background beat last saw it)
            return
        self._check_current(await self._beat())

    async def _beat(self) -> Control:
        """One beat: this rank's words out, a chunk of the others' in, the counts published."""
        _, control, _ = await asyncio.gather(self._write_own(), self._look_around(), self.publish_counts())
        return control

    async def _look_around(self) -> Control:
        """A heartbeat's read: the head line and the next chunk of the ranks'
        rows (at most ``lc.ROTATION`` of them), merged into :attr:`control`
        (two small reads, whatever the number of workers).  Beyond ``CROWD``
        workers a rank reads the head line (one server's) only every
        ``workers / CROWD``-th beat, so that server sees about ``CROWD /
        BEAT_INTERVAL`` of these reads a second whatever the job's size (a
        newer run is then noticed within ``workers / CROWD`` beats)."""
        chunk = self._chunks[self._next_chunk]
        self._next_chunk = (self._next_chunk + 1) % len(self._chunks)
        got = [(page, first, np.empty(lc.RANK_WORDS * rows, np.int64)) for page, first, rows in chunk]
        self._beats += 1
        base = self.control if self.control is not None else await self.refresh()
        reads: list[Coroutine[Any, Any, Any]] = [
            self.buf.read_into(out, self.cmap.rows_offset(page) + lc.ROW_BYTES * first) for page, first, out in got]
        if (self._beats + self.rank) % max(1, -(-self.workers // CROWD)) == 0:
            reads.append(self._read_head())
        done: list[Any] = await asyncio.gather(*reads)
        head: np.ndarray = done[-1] if len(done) > len(got) else base.words[:lc.RANK_BASE]
        self.control = base.updated(head, got, self.cmap)
        return self.control

    def keep_beating(self) -> None:
        """Beat every ``BEAT_INTERVAL`` in the background (this loop's task)
        until :meth:`finish`, whatever the training loop does meanwhile: a
        rule whose rounds wait for every worker (``allreduce``) takes a
        worker silent for a few seconds for dead, and a long step is not
        silence."""
        if self.member and (self._beating is None or self._beating.done()):
            self._beating = asyncio.ensure_future(self._beat_on())

    async def _beat_on(self) -> None:
        try:
            while True:
                await asyncio.sleep(BEAT_INTERVAL)
                if time.monotonic() - self._last_beat >= BEAT_INTERVAL:
                    await self._beat()      # (a newer run it sees is raised by the next heartbeat)
        except Smb2Error as exc:
            # (the client closed, or the server went: the rounds meet it and say so)
            log.debug("store %r: rank %d's background heartbeat stopped: %s", self.name, self.rank, exc)

    def stalled(self, threshold: float) -> list[tuple[int, int, float]]:
        """(rank, last step, seconds since its heartbeat) of every rank that
        has not finished and has been silent for ``threshold`` s, as of the
        last :meth:`heartbeat` / :meth:`refresh`.  A heartbeat reads the
        others' rows a chunk at a time, so a rank silent for ``threshold``
        shows here within ``threshold + chunks * BEAT_INTERVAL`` s of
        heartbeats (chunks: ``len(self.cmap.chunks(lc.ROTATION))``, at most
        ``2 * ceil(workers / lc.ROTATION) + 1``; at once after a :meth:`refresh`)."""
        return [] if self.control is None else self.control.stalled(threshold)

    async def finish(self) -> None:
        """This rank is done with the run (its last step is published).
        Nothing is destroyed: the store stays for the slower ranks, for
        evaluation and for the next run."""
        self._check_member()
        if self._beating is not None:
            self._beating.cancel()
        # this rank's pushes on the servers (through a host agent: forwarded)
        # before it counts as finished: whoever takes the weights then has them
        await self.weights.flushed()
        # the counts first: whoever sees this rank finished reads them complete
        await self.publish_counts(force=True)
        await self._write_own(finished=self.generation)
        await self._count(self.cmap.head + 8 * lc.FINISHES_AT)
        # the last step's checkpoint (unless it was just saved), and the one in flight
        await self._maybe_checkpoint(final=True)
        await self.checkpoint_saved()

    async def wait_finished(self, timeout: float | None = None) -> None:
        """The end barrier (optional): wait until every rank of this run has
        finished.  Its timeout names the ranks still out and when each was
        last heard from."""
        end = await self.await_finished(timeout)
        if not end.complete:
            raise NotifyTimeout(str(end),
                                hint="a missing rank died or hangs: its work so far is in the shared weights; "
                                     "restart it (it rejoins the run) or accept the model as it is")

    async def await_finished(self, timeout: float | None = None) -> lc.RunEnd:
        """Wait up to ``timeout`` s until every rank of this run finished,
        then say who did and who is missing (never raises for a missing
        rank: the survivors go on to evaluate and save).

        Like :meth:`join`, a waiting rank reads the 64-byte head line per
        poll (the run's counter of finished ranks); every rank's row is read
        when the count reaches the workers (a rank that finished twice, once
        before and once after a restart, is counted twice: the rows decide),
        after ``RECONCILE_POLLS`` polls without progress, and at the timeout.

        Under a rule that takes a silent worker for dead (``allreduce``:
        every live rank beats in the background until it finishes, through
        an evaluation or a save too) it stops waiting once every rank still
        out has been silent for the rule's ``dead_after``: such a rank died
        (or stopped on an error without closing) or was left out of the
        training, and a restart of it finds the run over.  It looks only
        once the count has stood still for ``SILENCE_AFTER_POLLS`` polls
        (a healthy end moves it), then once a second, reading every row
        once and after that only the rows of the ranks still out: the wait
        stays O(1) words per poll, as the count's."""
        self._check_member()
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        delay = 0.005
        last, still, checked = -1, 0, -1
        dead_after = self.rule.dead_after
        silence, looked, out = roster.Silence(), -math.inf, None
        while True:
            head = await self._read_head()
            self.stats["barrier_polls"] += 1
            self._check_run(int(head[lc.GENERATION]))
            done = lc.tagged_count(int(head[lc.FINISHES_AT]), self.generation)
            still = still + 1 if done == last else 0
            last = done
            now = time.monotonic()
            given_up = False
            if dead_after is not None and still >= SILENCE_AFTER_POLLS and now - looked >= SILENCE_LOOK_EVERY:
                looked = now
                rows = await (self.refresh() if out is None else self._read_control(out))
                self._check_current(rows)
                out = tuple(r for r in (rows.unfinished() if out is None else out) if not rows.has_finished(r))
                silence.saw(rows.beats, now)
                given_up = bool(out) and all(silence.quiet_for(r, now) >= dead_after for r in out)
            timed_out = deadline is not None and now >= deadline
            if given_up or timed_out or still >= RECONCILE_POLLS or (done >= self.workers and done != checked):
                still, checked = 0, done
                self.stats["barrier_full_reads"] += 1
                control = await self.refresh()
                self._check_current(control)
                # (a rank the looks did not follow is not known silent: given up only where none is left)
                given_up = given_up and set(control.unfinished()) <= set(out or ())
                if not control.unfinished() or timed_out or given_up:
                    end = lc.RunEnd.of(self.name, control, round(now - started, 1) if given_up else timeout)
                    if given_up:
                        end.notes = [f"{note} (silent for {dead_after:g} s: rule {self.rule.name!r} takes it for "
                                     f"dead, so this rank stopped waiting for it)" for note in end.notes]
                    counts = await read_counts(self.client, self.name, self.generation)
                    seen = {r for r, c in (counts or {}).get("per_rank", {}).items() if c["collapses"]}
                    end.collapsed = sorted(seen | ({self.rank} if self.watch.collapses else set()))
                    return end
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2 * BARRIER_POLL * max(1.0, self.workers / CROWD))

    # -- progress and the end policy --------------------------------------------------
    async def report(self, iteration: int, target: int, policy: str = "average") -> bool:
        """Publish this worker's iteration count and tell whether the job is
        over: by ``policy`` "first" (some worker reached ``target``), "slowest"
        (all did) or "average" (the mean did).  When it is, the run's stop
        flag is raised so that every worker ends at its next report."""
        if policy not in POLICIES:
            raise InvalidArgumentError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        await self.heartbeat(iteration, force=True)
        # the policy weighs every worker's step: this read takes all rows
        control = await self.refresh()
        self._check_current(control)
        if control.stopped:
            return True
        progress = control.steps.copy()
        progress[self.rank] = iteration     # the read ran beside our write
        level = {"first": progress.max(), "slowest": progress.min(), "average": progress.mean()}[policy]
        if level >= target:
            await self.buf.notify(self.cmap.slot(lc.STOP), self.generation)
            log.info("worker %d: the %s worker reached %d iterations: stopping all", self.rank, policy, target)
            return True
        return False

    async def progress(self) -> np.ndarray:
        """Every worker's step (the progress table)."""
        return (await self.refresh()).steps.copy()

    async def stopped(self) -> bool:
        return (await self.refresh()).stopped

    async def wait_stopped(self, timeout: float | None = None) -> None:
        """Wait until the run's end policy fired."""
        try:
            await self.buf.wait_notify(self.cmap.slot(lc.STOP), max(1, self.generation), timeout=timeout)
        except NotifyTimeout:
            steps = (await self.refresh()).steps.tolist()
            raise NotifyTimeout(f"the end policy of store {self.name!r} did not fire within {timeout} s "
                                f"(the ranks' steps: {steps})") from None

    async def destroy(self) -> None:
        """Remove the store and its ranks' saved optimizer states from the
        servers (``smb2 rm NAME`` does the same).  Only when no rank of any
        run still uses it."""
        await remove(self.client, self.buf.name)

    # -- checkpoints --------------------------------------------------------------------
    async def _maybe_checkpoint(self, *, final: bool = False) -> None:
        """Rank 0: save the store when its step crossed a multiple of
        ``checkpoint_every`` (and, ``final``, at the end of its run).  One save
        at a time: a save that comes due while the last one runs waits for it,
        so none is skipped."""
        every = self.checkpoint_every
        if self.rank != 0 or every is None or self.checkpoint_path is None:
            return
        last = self._checkpoint_step
        if not (self._step // every > last // every or (final and self._step != last)):
            return
        await self.checkpoint_saved()
        self._checkpoint_step = self._step
        if self.publish_weights is not None:
            await self.publish_weights()
        # its own step word first (heartbeats write it at most every 0.25 s):
        # the checkpoint holds the step it is named after
        await self._write_own()
        path = self.checkpoint_path.replace("{step}", str(self._step))
        self._checkpointing = asyncio.ensure_future(self._save_checkpoint(path))
        log.info("store %r: checkpoint at step %d to %s", self.name, self._step, path)

    async def _save_checkpoint(self, path: str) -> None:
        """The ranks' optimizer states (best effort: a rank without one is
        left out), then the store.  States first: each is as of its rank's
        last save, so it is not newer than the weights saved after it."""
        sidecars = optimizer_states_dir(path)
        prefix = _optim_prefix(self.name)
        ranks = sorted(int(b[len(prefix):]) for b in await self.client.buffers()
                       if b.startswith(prefix) and b[len(prefix):].isdigit())
        await asyncio.to_thread(_empty_dir, sidecars, bool(ranks))
        for r in ranks:
            try:
                await self.client.checkpoint(optimizer_state_name(self.name, r), sidecars / str(r))
            except Smb2Error as exc:
                log.warning("store %r: rank %d's optimizer state is not in the checkpoint %s (%s): a run started "
                            "from it gives that rank a fresh optimizer state", self.name, r, path, exc)
        await self.client.checkpoint(self.name, path)

    async def checkpoint_saved(self) -> None:
        """Wait for the checkpoint being saved in the background, if any, and
        re-raise its failure.  Whoever writes the store's weights outside a
        step (``publish_weights``, a worker's last weights at close) waits
        for this first: the save reads the store as it goes, and a write
        under it would put another step's weights in a checkpoint named
        after this one."""
        if self._checkpointing is not None:
            await asyncio.gather(self._checkpointing, return_exceptions=True)
            self._raise_checkpoint_error()

    def _raise_checkpoint_error(self) -> None:
        task = self._checkpointing
        if task is not None and task.done():
            self._checkpointing = None
            exc = None if task.cancelled() else task.exception()
            if exc is not None:
                raise exc


def checkpoint_dir(path: str | Path) -> Path:
    """The directory of rank 0's checkpoints, made now (at the store's
    opening, not at the first save many steps later) or refused."""
    parent = Path(str(path)).parent
    if "{step}" in str(parent):
        raise InvalidArgumentError(f"checkpoint_path {path}: '{{step}}' belongs in the file name, not the directory")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PersistenceError(f"the checkpoint directory {parent} cannot be made: {e.strerror}",
                               hint="pass a checkpoint_path= in a directory this process can make and write") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PersistenceError(f"the checkpoint directory {parent} is not writable by this process",
                               hint="pass a checkpoint_path= in a directory this process may write")
    return parent


def optimizer_states_dir(path: str | Path) -> Path:
    """Where a checkpoint's optimizer states lie: ``<path>.optim/<rank>``,
    each a checkpoint of that rank's :func:`optimizer_state_name` buffer."""
    return Path(f"{path}.optim")


def _empty_dir(folder: Path, keep: bool) -> None:
    """Empty ``folder`` of an earlier checkpoint's files; then remove it, or
    (``keep``) make it."""
    if folder.is_dir():
        for old in folder.iterdir():
            if old.is_file():
                old.unlink()
        if not keep:
            folder.rmdir()
    if keep:
        folder.mkdir(exist_ok=True)


class StoreImage:
    """A store as saved by ``client.checkpoint`` (``checkpoint_every``): its
    layout, its data region and its control words, read from the file."""

    def __init__(self, layout: Layout, data: np.ndarray, control: Control, path: str = "", name: str = "") -> None:
        self.layout = layout
        self.data = data
        self.control = control
        #: the file, and the store it was saved from
        self.path = path
        self.name = name

    async def restore_optimizer_states(self, client: Client, name: str, replicas: int = 1,
                                       workers: int | None = None) -> int:
        """Rank 0 of a fresh run from this image: put the optimizer states
        saved beside it into store ``name``'s state buffers (side buffers
        with the store's ``replicas``), in place of any there (an earlier
        run's, which must not be loaded with these weights); those of ranks
        below ``workers`` only (None: every one).  Returns how many ranks'
        states were restored."""
        prefix = _optim_prefix(name)
        await asyncio.gather(*(client.destroy(b) for b in await client.buffers() if b.startswith(prefix)))
        saved_prefix = _optim_prefix(self.name)
        folder = optimizer_states_dir(self.path)
        files = sorted(f for f in (folder.iterdir() if folder.is_dir() else ())
                       if f.name.isdigit() and (workers is None or int(f.name) < workers))
        restored = 0
        for f in files:
            try:
                header = await asyncio.to_thread(_checkpoint_header, f)
                # made here, like every side buffer; the restore fills it
                await beside.make(client, name, optimizer_state_what(int(f.name)), header["nbytes"],
                                  replicas=replicas, stripe=header["stripe"])
                await checkpoint_restore(client, optimizer_state_name(name, int(f.name)), f,
                                         saved_as=saved_prefix + f.name)
                restored += 1
            except Smb2Error as exc:
                log.warning("store %r: rank %s's optimizer state in %s is not restored (%s): that rank starts "
                            "with a fresh optimizer state", name, f.name, f, exc)
        if not files:       # (smb2.torch says so per rank, as a WARNING)
            log.info("store %r: checkpoint %s carries no optimizer states (no %s/): every rank starts with a "
                        "fresh optimizer state (momentum and moments from zero, LR schedules from their start)",
                        name, self.path, folder)
        return restored

    @classmethod
    async def load(cls, path: str | Path) -> StoreImage:
        return await asyncio.to_thread(cls._load, str(path))

    @classmethod
    def _load(cls, path: str) -> StoreImage:
        try:
            f = open(path, "rb")
        except OSError as exc:
            raise InvalidArgumentError(f"cannot open checkpoint {path}: {exc}") from None
        with f:
            header, digest, _start = read_checkpoint_header(f, path)
            raw = f.read()
        if len(raw) != header["nbytes"] or hashlib.sha256(raw).digest() != digest:
            raise PersistenceError(f"{path}: checksum mismatch or truncated (the file is corrupt)")
        pre = np.frombuffer(raw, np.int64, PREAMBLE // 8)
        if int(pre[_MAGIC // 8]) != MAGIC:
            raise InvalidArgumentError(f"{path} is a checkpoint of buffer {header['name']!r}, "
                                       "which is not a parameter store")
        if int(pre[_FORMAT // 8]) != FORMAT:
            raise InvalidArgumentError(f"{path} holds a store of format {int(pre[_FORMAT // 8])}; this smb2 reads "
                                       f"{FORMAT}", hint="start from a checkpoint saved by this smb2, or load this "
                                       "one with the smb2 that saved it")
        layout = Layout.from_table(raw[PREAMBLE:PREAMBLE + int(pre[_TABLE // 8])])
        cmap, data_off, _total = layout.geometry(int(header["stripe"]), int(header.get("nservers", 1)))
        if (int(pre[_NOTE_OFF // 8]), int(pre[_NOTE_SLOTS // 8]), int(pre[_DATA_OFF // 8])) != \
                (cmap.start, cmap.slots, data_off):
            raise PersistenceError(f"{path}: the store's header does not match its layout table (the file is corrupt)")
        control = Control.parse(cmap.gather(np.frombuffer(raw, np.int64, cmap.slots, cmap.start)), layout.workers)
        data = np.frombuffer(raw, np.uint8, layout.data_len, data_off).copy()
        return cls(layout, data, control, path, header["name"])


def _checkpoint_header(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return read_checkpoint_header(f, str(path))[0]
    except OSError as exc:
        raise PersistenceError(f"cannot read {path}: {exc}") from None


def store_damage(err: BufferDamaged, layout: Layout | None, progress: str = "") -> BufferDamaged:
    """A damaged store's :class:`BufferDamaged` in training terms: which
    tensors (of ``layout``, the job's model, when known) lost bytes, whether
    the store's header and run state went with them, where its run was
    (``progress``, from :func:`_last_progress`), and what to do."""
    lost = []
    data_off = 0
    if layout is not None:
        cmap, data_off, _total = layout.geometry(err.geometry[1], err.geometry[2])
        version_line, *pages = cmap.extents()
        header = any(err.ranges(0, version_line[1]))
        state = any(any(err.ranges(lo, hi)) for lo, hi in pages)
        if header and state:
            lost.append("the store's header and run state (its layout, version, runs and steps)")
        elif header or state:
            lost.append("the store's header (its layout and version)" if header
                        else "the store's run state (its runs and steps)")
        for tname, _dt, shape, off in layout.tensors:
            start = data_off + off
            gone = sum(hi - lo for lo, hi in err.ranges(start, start + layout.nbytes_of(shape)))
            if gone:
                lost.append(f"{tname} ({100 * gone / layout.nbytes_of(shape):.0f} %)")
    what = (f"{', '.join(lost[:8])}{f' and {len(lost) - 8} more' if len(lost) > 8 else ''} "
            f"{'are' if len(lost) > 1 else 'is'} lost" if lost
            else f"{err.lost_bytes} of its {err.geometry[0]} bytes are lost")
    name = err.name
    out = BufferDamaged(
        f"store {name!r} is damaged: its part on server{'s' if len(err.servers) > 1 else ''} "
        f"{', '.join(err.servers)} is gone (a restart without its data), so {what}"
        f"{progress}; resuming would train from zeros there, so this job stops",
        name=name, servers=err.servers, parts=err.parts, geometry=err.geometry, detail=err.message,
        hint=("if the server keeps a --data-dir, restart it from there to get the part back and run again; "
              "else start over: resume=False (from the job's own initial weights) or init_from=CHECKPOINT "
              f"(from a saved checkpoint) removes the damaged store and makes it anew; `smb2 rm {name}` "
              "removes it by hand"))
    setattr(out, "in_training_terms", True)     # noqa: B010 (a rank that ends with it says it in its lines)
    return out


async def _last_progress(err: BufferDamaged, layout: Layout) -> str:
    """"; its run G was at step S (version V)" read from what remains of a
    damaged store, as far as its header (with the version) and its run
    state (the pages of the ranks' rows, on other servers) survived; else ""."""
    cmap = layout.geometry(err.geometry[1], err.geometry[2])[0]
    version_line, *pages = cmap.extents()
    if err.remains is None or any(err.ranges(0, version_line[1])):
        return ""
    buf = err.remains
    try:
        pre = np.empty(PREAMBLE // 8, dtype=np.int64)
        await buf.read_into(pre, 0)
        if (int(pre[_MAGIC // 8]), int(pre[_FORMAT // 8]), int(pre[_NOTE_OFF // 8]),
                int(pre[_NOTE_SLOTS // 8])) != (MAGIC, FORMAT, cmap.start, cmap.slots):
            return ""       # another layout: its words are elsewhere
        if any(any(err.ranges(lo, hi)) for lo, hi in pages):
            version = np.empty(1, np.int64)
            await buf.read_into(version, cmap.start)
            return f"; it was at version {int(version[0])}"
        c = await _read_control(buf, cmap)
    except Smb2Error:
        return ""
    return f"; its run {c.generation} was at step {int(c.steps.max())} (version {c.version})"


async def describe(client: Client, name: str) -> dict[str, Any]:
    """What ``smb2 ls`` shows of one buffer: its size, stripe and replicas
    (``degraded``: some stripe has fewer copies on member servers), and for a
    parameter store its tensors, workers, rule, run, version, steps,
    whether the run finished, and the run's stability counts (``counts``:
    see :func:`smb2.train.counts.read_counts`; None before any rank
    published).  A damaged buffer (a part lost) or store (its
    table unreadable) has ``damaged``, saying how; ``store`` is None where
    that cannot be told.  A store set aside while a rank 0 made it again
    for another number of workers (:func:`_set_aside`) has
    ``set_aside_of``, the store's name."""
    try:
        buf = await client.attach(name)
    except BufferDamaged as err:
        return {"name": name, "bytes": err.geometry[0], "stripe": err.geometry[1], "store": None,
                "damaged": err.message, "lost_on": err.servers}
    out: dict[str, Any] = {"name": name, "bytes": buf.nbytes, "stripe": buf.stripe, "store": False,
                           "replicas": buf.replicas}
    if buf.replicas > 1:
        out["degraded"] = await buf.degraded()
    if buf.nbytes < PREAMBLE:
        return out
    pre = np.empty(PREAMBLE // 8, dtype=np.int64)
    await buf.read_into(pre, 0)
    if of := _set_aside_of(name, int(pre[0])):
        return {**out, "set_aside_of": of}
    if int(pre[_MAGIC // 8]) != MAGIC or int(pre[_STATE // 8]) != READY:
        return out
    out["store"] = True
    out["format"] = int(pre[_FORMAT // 8])
    if out["format"] != FORMAT:
        refused = _other_format(name, out["format"])
        return {**out, "note": f"{refused.message}: {refused.hint}"}
    try:
        layout, _ = await _read_layout(buf)
    except InterfaceError as err:
        return {**out, "damaged": err.message}
    control = await _read_control(buf, layout.geometry(buf.stripe, buf.nservers)[0])
    out.update(tensors=len(layout.tensors), data_bytes=layout.data_len, dtype=layout.dtype.name,
               workers=layout.workers, rule=layout.rule.get("name"), run=control.generation,
               version=control.version, steps=control.steps.tolist(), finished=control.run_finished(),
               joined=layout.workers - len(control.missing()),
               last_heartbeat_s=_finite(min(control.age(r) for r in range(layout.workers))),
               counts=await read_counts(client, name, control.generation))
    return out


async def describe_all(client: Client) -> list[dict[str, Any]]:
    """:func:`describe` of every buffer, by name, in a number of requests
    that grows with the servers, not the buffers: each server's ``stat``
    (sizes, parts, replicas), then one ``peek`` per server at the first
    bytes of every buffer whose first stripe it holds, which tells the
    parameter stores; only those, and a buffer whose parts do not add up (a
    lost or foreign part, a replicated one that is degraded), are described
    one by one."""
    stats = await client.stat()
    parts: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for s, st in enumerate(stats):
        for name, info in st.get("buffers", {}).items():
            parts.setdefault(name, []).append((s, info))
    reads: list[list[tuple[str, int, int]]] = [[] for _ in stats]
    at: dict[str, tuple[int, int]] = {}         # name -> (server, position in its reads)
    rows: dict[str, dict[str, Any]] = {}
    one_by_one: list[str] = []
    for name, held in parts.items():
        info = held[0][1]
        n, replicas = int(info["nservers"]), int(info.get("replicas", 1))
        if (n != len(stats) or len({i["buffer_id"] for _, i in held}) != 1
                or sorted(i["index"] for _, i in held) != list(range(n)) or any(i.get("degraded") for _, i in held)):
            one_by_one.append(name)
            continue
        rows[name] = {"name": name, "bytes": info["nbytes"], "stripe": info["stripe"], "store": False,
                      "replicas": replicas, **({"degraded": False} if replicas > 1 else {})}
        if info["nbytes"] < PREAMBLE:
            continue
        if info["stripe"] < PREAMBLE:
            one_by_one.append(name)             # the preamble spans stripes: read it whole
            continue
        placement = Placement.of(name, n, info["nbytes"], info["stripe"], replicas, info.get("zones"))
        first = placement.replicas_of(0)[0]
        server = next(s for s, i in held if i["index"] == first)
        at[name] = (server, len(reads[server]))
        reads[server].append((name, placement.offset_on(first, 0), PREAMBLE))
    seen = await client.peek(reads)
    for name, (server, k) in at.items():
        head = seen[server][k]
        if head is None:
            one_by_one.append(name)             # destroyed or made again meanwhile
            continue
        pre = np.frombuffer(head, np.int64)
        if int(pre[_MAGIC // 8]) == MAGIC and int(pre[_STATE // 8]) == READY:
            one_by_one.append(name)
        elif of := _set_aside_of(name, int(pre[0])):
            rows[name]["set_aside_of"] = of
    for name in one_by_one:
        try:
            rows[name] = await describe(client, name)
        except Smb2Error as exc:        # removed meanwhile, or not on every server
            rows[name] = {"name": name, "error": exc.message}
        except Exception as exc:        # whatever one buffer holds, the others are listed
            rows[name] = {"name": name, "error": f"{type(exc).__name__}: {exc}"}
    return [rows[n] for n in sorted(rows)]


def _set_aside_of(name: str, first_word: int) -> str | None:
    """The store whose set-aside (:func:`_set_aside`) buffer ``name`` is,
    by its name and the first word it holds; else None."""
    store, _, what = name.rpartition("/")
    return store if store and what == REMAKING and first_word == _ASIDE_MAGIC else None


def _finite(x: float) -> float | None:
    return None if math.isinf(x) else round(x, 3)


def optimizer_state_name(store: str, rank: int) -> str:
    """The buffer where ``rank`` keeps its optimizer's state, step and LR
    schedules for ``store`` (written and read by :mod:`smb2.torch.resume`)."""
    return beside.name_of(store, optimizer_state_what(rank))


def optimizer_state_what(rank: int) -> str:
    """:func:`optimizer_state_name` as a side buffer of the store (smb2.train.beside)."""
    return f"optim/{rank}"


def _optim_prefix(store: str) -> str:
    return beside.name_of(store, "optim/")


def frozen_state_name(store: str) -> str:
    """The buffer where rank 0 hands its frozen parameters and unaveraged
    buffers to the other ranks (:mod:`smb2.torch.frozen`)."""
    return beside.name_of(store, FROZEN)


#: rank 0's frozen tensors' side buffer (smb2.train.beside)
FROZEN = "frozen"


async def remove(client: Client, name: str) -> bool:
    """Destroy buffer ``name`` and the buffers kept beside it (a store's
    optimizer states, frozen tensors, outer momentum, counts and the words
    of its replicated locks: :func:`smb2.train.beside.remove`); True if
    ``name`` existed."""
    return await beside.remove(client, name)


# -- the buffer ---------------------------------------------------------------------

async def _attach_or_create(client: Client, name: str, total: int, stripe: int, replicas: int,
                            layout: Layout, start_over: bool) -> Buffer:
    """Rank 0: the existing buffer (whatever its stripe), or a new one.  A
    damaged one (:class:`BufferDamaged`) is removed and made anew where
    nothing in it is needed: the run starts over (``start_over``), or a
    rank 0 that died making the store again left it half made beside a
    whole set-aside, which holds the store (:func:`_set_aside`); else
    refused.  ``layout``: the job's."""
    try:
        buf = await client.attach(name)
        if buf.replicas != replicas:
            log.warning("store %r exists with replicas=%d and keeps them (this job asked for %d; to change them, "
                        "remove the store with `smb2 rm %s` or start over from a checkpoint)",
                        name, buf.replicas, replicas, name)
        return buf
    except NoSuchBuffer:
        pass
    except BufferDamaged as err:
        if start_over:
            why = "this run starts over (resume=False or init_from=)"
        elif await _set_aside_whole(client, name):
            why = f"the store set aside in {beside.name_of(name, REMAKING)!r} holds its weights and words"
        else:
            raise
        log.warning("%s; %s, so the store is made anew", store_damage(err, layout).message, why)
        await client.destroy(name)
    try:
        return await client.create(name, total, stripe=stripe, replicas=replicas)
    except BufferConflict:
        return await client.attach(name)        # made by someone else in between


#: the side buffer that keeps a store while rank 0 makes it again for
#: another number of workers (:func:`_set_aside`)
REMAKING = "remaking"
_ASIDE_MAGIC = int.from_bytes(b"SMB2RMKG", "little")


class _Aside:
    """A store set aside while it is made again (:func:`_set_aside`): its
    layout, control words and data region.  Packed as a 64-byte header
    (magic, table bytes, data bytes), the layout table (padded to 8), the
    control words and the data."""

    def __init__(self, layout: Layout, control: Control, data: np.ndarray) -> None:
        self.layout = layout
        self.control = control
        self.data = data

    def packed(self) -> tuple[np.ndarray, bytes]:
        """(header, words): the header, then the table and the control
        words, which the data follow (at ``PREAMBLE + len(words)``; written
        from :attr:`data` itself, not copied: it is the model's size).  The
        header (its magic) is written last."""
        table = self.layout.table()
        header = np.zeros(PREAMBLE // 8, np.int64)
        header[:3] = _ASIDE_MAGIC, len(table), self.data.nbytes
        return header, table.ljust(_round_up(len(table), 8), b"\0") + self.control.words.tobytes()

    @classmethod
    def unpacked(cls, raw: np.ndarray, name: str) -> _Aside | None:
        """The store a whole set-aside (side buffer ``name``) holds (None:
        the set-aside did not finish, so the store itself was never
        touched); what is not a store set aside is refused in words."""
        if raw.nbytes < PREAMBLE or int(raw[:PREAMBLE].view(np.int64)[0]) != _ASIDE_MAGIC:
            return None
        table_len, data_len = (int(w) for w in raw[8:24].view(np.int64))
        try:
            # (the header's lengths are checked before they slice: garbage there must not become a read)
            if not 0 < table_len <= raw.nbytes - PREAMBLE:
                raise ValueError(f"its table of {table_len} bytes is not within its {raw.nbytes}")
            layout = Layout.from_table(raw[PREAMBLE:PREAMBLE + table_len].tobytes())
            if layout.workers < 1:
                raise ValueError(f"its table says {layout.workers} workers")
            at = PREAMBLE + _round_up(table_len, 8)
            words_end = at + 8 * lc.slots_for(layout.workers)
            if data_len != layout.data_len or words_end + data_len > raw.nbytes:
                raise ValueError(f"{raw.nbytes} bytes do not hold the {data_len} of data its header says, "
                                 f"nor the {layout.data_len} its table says")
        except (ValueError, KeyError, TypeError, IndexError, msgpack.UnpackException) as exc:
            raise InterfaceError(f"side buffer {name!r} should hold a store set aside while it is made again for "
                                 f"another number of workers, and does not ({exc})",
                                 hint=f"if no job is making the store again, remove it with `smb2 rm {name}`; "
                                      "the store itself is not touched") from None
        return cls(layout, Control.parse(raw[at:words_end].view(np.int64), layout.workers),
                   raw[words_end:words_end + data_len])


async def _set_aside(client: Client, buf: Buffer, theirs: Layout) -> _Aside:
    """Rank 0, under the store's lock, before it makes the store ``buf``
    (made for ``theirs.workers`` workers) again for another number: its
    control words and data region, read and kept whole in the side buffer
    :data:`REMAKING` (the header last) before the store is touched, so that
    a rank 0 that dies while it makes the store again loses nothing: the
    next one finds them there and makes it again from them."""
    cmap, data_off, _total = theirs.geometry(buf.stripe, buf.nservers)
    data = np.empty(theirs.data_len, np.uint8)
    control, _ = await asyncio.gather(_read_control(buf, cmap), buf.read_into(data, data_off))
    aside = _Aside(theirs, control, data)
    header, words = aside.packed()
    side = await beside.make(client, buf.name, REMAKING, PREAMBLE + len(words) + data.nbytes, replicas=buf.replicas)
    await side.write(0, np.zeros(PREAMBLE, np.uint8))       # (an earlier, whole one is whole no more)
    await asyncio.gather(side.write(PREAMBLE, words), side.write(PREAMBLE + len(words), data))
    await side.write(0, header)
    return aside


async def _made_again_already(buf: Buffer, theirs: Layout, aside: _Aside) -> bool:
    """Is the store ``buf`` (ready, of layout ``theirs``) the one made again
    from ``aside``, with its run opened (a rank 0 that died after it opened
    the run, before it removed the set-aside)?  Then the set-aside is
    removed: the store has trained past it, and must never be made again
    from it."""
    # (the old store itself, a buffer made for the new one, or the new one: the run it opened says which)
    now = await _read_control(buf, theirs.geometry(buf.stripe, buf.nservers)[0], ())
    if now.generation <= aside.control.generation:
        return False
    await beside.discard(buf.client, buf.name, REMAKING)
    log.info("store %r: the set-aside %r of a store made again for %d workers is removed (run %d was opened "
             "in the store made from it)", buf.name, beside.name_of(buf.name, REMAKING), theirs.workers,
             now.generation)
    return True


async def _set_aside_whole(client: Client, name: str) -> bool:
    """Is there a whole set-aside (:func:`_set_aside`) beside store ``name``:
    one whose store a rank 0 may have started to make again?"""
    try:
        side = await beside.find(client, name, REMAKING)
    except NoSuchBuffer:
        return False
    magic = np.zeros(1, np.int64)
    if side.nbytes >= PREAMBLE:
        await side.read_into(magic, 0)
    return int(magic[0]) == _ASIDE_MAGIC


async def _kept_aside(client: Client, name: str) -> _Aside | None:
    """The store set aside by a rank 0 that died while it made the store
    again (:func:`_set_aside`), if there is one."""
    try:
        side = await beside.find(client, name, REMAKING)
    except NoSuchBuffer:
        return None
    raw = np.empty(side.nbytes, np.uint8)
    await side.read_into(raw, 0)
    return _Aside.unpacked(raw, side.name)


def _say_made_again(name: str, aside: _Aside, workers: int, decision: lc.Decision, stale_after: float) -> None:
    """Rank 0 made the store ``name`` again for ``workers`` (:func:`_made_again`):
    say so, with what the new run takes from the old one, and the old job's
    ranks that may still run (they stop with an error)."""
    before, made_for = aside.control, aside.layout.workers
    beating = [r for r in range(made_for) if before.live(r, stale_after) and not before.has_finished(r)]
    kept = min(made_for, workers)
    taken = (f"the run resumes with its weights and version, and ranks 0-{kept - 1} with their steps"
             if decision.action == "resume" else f"the new run starts fresh ({decision.why})")
    still = ("" if not beating else
             f" (rank{'s' if len(beating) > 1 else ''} {lc.ranks_list(beating)} of the job before beat within the "
             f"last {stale_after:.0f} s: if that job still runs, its ranks stop with an error)")
    log.log(logging.WARNING if decision.action == "resume" or beating else logging.INFO,
            "store %r was made for %d workers and this job has %d (WORLD_SIZE): rank 0 made it again for %d; "
            "%s%s", name, made_for, workers, workers, taken, still)


async def _made_again(client: Client, buf: Buffer, aside: _Aside, layout: Layout, lock: Lock | ReplicatedLock,
                      in_place: bool) -> tuple[Buffer, Control]:
    """Rank 0, under the store's lock: the store set aside (made for
    ``aside.layout.workers`` workers) made again for this job's
    ``layout.workers`` (a job launched again with another WORLD_SIZE:
    torchrun's ``--nnodes=MIN:MAX`` after a host was lost or came back, a
    job moved to fewer or more GPUs).  The control words are sized by the
    workers, so the buffer is made anew (``in_place``: it has this job's
    size and geometry already, and is initialized again), with its stripe
    and replicas, and carries what a resumed run continues from: the
    weights, the version, their lineage (``ORIGIN_MS``, which the saved
    optimizer states are matched against) and the steps of the ranks both
    jobs have (a rank the old job did not have starts at step 0).  Returns
    the buffer and the words it carries (the set-aside's own words decide,
    as for any store, whether the new run resumes).  Side buffers sized by, or
    kept for, the old job's workers go: the counts board, and the saved
    optimizer states of ranks this job does not have."""
    before, made_for = aside.control, aside.layout.workers
    cmap, data_off, total = layout.geometry(buf.stripe, buf.nservers)
    name = buf.name
    if not in_place:
        stripe, replicas = buf.stripe, buf.replicas
        await client.destroy(name)
        buf = await client.create(name, total, stripe=stripe, replicas=replicas)
    await asyncio.gather(beside.discard(client, name, COUNTS),
                         *(beside.discard(client, name, optimizer_state_what(r))
                           for r in range(layout.workers, made_for)))
    await _initialize(buf, layout, lock)
    words = np.zeros(lc.slots_for(layout.workers), np.int64)
    words[:lc.JOINS_EVEN] = before.words[:lc.JOINS_EVEN]
    kept = min(made_for, layout.workers)
    words[lc.RANK_BASE + lc.STEP:][:lc.RANK_WORDS * kept:lc.RANK_WORDS] = before.steps[:kept]
    grid = words[lc.RANK_BASE:].reshape(layout.workers, lc.RANK_WORDS)
    await asyncio.gather(buf.write(data_off, aside.data, fence=lock),
                         buf.write(cmap.start, words[lc.VERSION:lc.GENERATION], fence=lock),
                         *(buf.write(cmap.rows_offset(p), grid[p::cmap.pages].copy(), fence=lock)
                           for p in range(cmap.pages)))
    return buf, Control.parse(words, layout.workers)


async def _wait_for_buffer(client: Client, name: str, deadline: float, rank: int) -> Buffer:
    delay = 0.01
    waiting = lc.Waiting(deadline, SAY_WAITING_AFTER, SAY_WAITING_EVERY)
    while True:
        if waiting.due():
            waiting.say(f"rank {rank} waits for rank 0 to create store {name!r} (every rank starts with the same "
                        "store name and SMB2_SERVERS)")
        try:
            return await client.attach(name)
        except BufferDamaged:
            # rank 0 may be making it anew (resume=False, init_from=): wait for it
            if time.monotonic() >= deadline:
                raise
        except NoSuchBuffer:
            if time.monotonic() >= deadline:
                raise NotifyTimeout(
                    f"rank 0 did not create store {name!r} in time; rank {rank} gives up: start rank 0 "
                    "with the same store name and SMB2_SERVERS, or raise timeout=") from None
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.25)


async def _wait_made_again(client: Client, name: str, made_for: int, layout: Layout, rank: int,
                           deadline: float) -> tuple[Buffer, Layout, int]:
    """A rank > 0 that found the store made for ``made_for`` workers, not
    this job's: rank 0 makes it again for this job (:func:`_made_again`)
    where it resumes or starts over; wait for that store (its buffer, layout
    and data offset), or give up at ``deadline`` in words."""
    delay = 0.01
    waiting = lc.Waiting(deadline, SAY_WAITING_AFTER, SAY_WAITING_EVERY)
    while True:
        if waiting.due():
            waiting.say(f"rank {rank} waits for rank 0 to make store {name!r} again for {layout.workers} workers "
                        f"(it was made for {made_for}; every rank has the same WORLD_SIZE)")
        try:
            buf = await client.attach(name)
            await _wait_ready(buf, max(0.0, deadline - time.monotonic()))
            theirs, data_off = await _read_layout(buf)
            if theirs.workers == layout.workers:
                if not theirs.same_as(layout):
                    raise _another_model(name, theirs, layout)
                return buf, theirs, data_off
            made_for = theirs.workers
        except (NoSuchBuffer, BufferDamaged, NotifyTimeout):
            pass        # (being made again)
        if time.monotonic() >= deadline:
            raise InvalidArgumentError(
                f"store {name!r} was made for {made_for} workers, this job has WORLD_SIZE={layout.workers}, and "
                f"rank 0 did not make it again for {layout.workers} workers in time (rank {rank} gives up)",
                hint=f"rank 0 makes the store again for its own WORLD_SIZE: check that it runs, and that every "
                     f"rank of the job has WORLD_SIZE={layout.workers}") from None
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.25)


def _say_rule_change(name: str, made_for: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """Log that a job opens a store made for another rule or other settings
    (a changed script, or a library whose default rule changed since the
    store was made): the weights go on, the arithmetic that moves them
    changes, and ``smb2 ls`` still names the rule the store was made for."""
    if made_for.get("name") != now.get("name"):
        log.warning("store %r was made for rule %r and this job updates it with rule %r: the weights and the "
                    "optimizer states go on, with the new rule's arithmetic (pass rule=%r to keep the old one)",
                    name, made_for.get("name"), now.get("name"), made_for.get("name"))
    elif dict(made_for) != dict(now):
        log.info("store %r: rule %r with settings %s (the store was made with %s)", name, now.get("name"),
                 dict(now), dict(made_for))


async def _initialize(buf: Buffer, layout: Layout, lock: Lock | ReplicatedLock) -> None:
    """Rank 0, under the lock: preamble, table, zeroed control words, ready.
    The weights come with the first run (``_open_run``)."""
    cmap, data_off, _total = layout.geometry(buf.stripe, buf.nservers)
    await buf.write(_STATE, np.array([INITIALIZING], dtype=np.int64), fence=lock)
    await _write_words(buf, {_MAGIC: MAGIC, _FORMAT: FORMAT, _TABLE: len(layout.table()),
                             _DATA_OFF: data_off, _DATA_LEN: layout.data_len,
                             _NOTE_OFF: cmap.start, _NOTE_SLOTS: cmap.slots}, fence=lock)
    await buf.write(PREAMBLE, layout.table(), fence=lock)
    # the words in use (the bytes between the pages are never read)
    await asyncio.gather(buf.write(cmap.start, np.zeros(lc.LINE // 8, np.int64), fence=lock),
                         *(buf.write(cmap.page_offset(p), np.zeros((cmap.rows_offset(p) - cmap.page_offset(p)) // 8
                                                                   + lc.RANK_WORDS * cmap.ranks_on(p), np.int64),
                                     fence=lock) for p in range(cmap.pages)))
    await buf.write(_STATE, np.array([READY], dtype=np.int64), fence=lock)
    buf.set_notify_area(cmap.start, cmap.slots)
    log.info("store %r created: %d tensors, %d bytes of %s, %d workers, stripe %d over %d servers",
             buf.name, len(layout.tensors), layout.data_len, layout.dtype, layout.workers, buf.stripe,
             buf.nservers)


async def _write_words(buf: Buffer, words: dict[int, int], fence: Lock | ReplicatedLock) -> None:
    """Write int64 words, one write per run of adjacent words (never
    touching the words in between, such as the state word)."""
    runs: list[list[int]] = []
    for off in sorted(words):
        if runs and runs[-1][-1] + 8 == off:
            runs[-1].append(off)
        else:
            runs.append([off])
    await asyncio.gather(*(buf.write(run[0], np.array([words[o] for o in run], dtype=np.int64), fence=fence)
                           for run in runs))


async def _wait_ready(buf: Buffer, timeout: float) -> None:
    from ..notify import wait_word
    try:
        await wait_word(buf, _STATE, READY, timeout, what="the store's ready state")
    except NotifyTimeout:
        raise NotifyTimeout(f"store {buf.name!r} was not initialized within {timeout:.0f} s "
                            "(did its creator die?)") from None


async def _read_layout(buf: Buffer) -> tuple[Layout, int]:
    """Read a ready store's preamble and table; designate its control area."""
    pre = np.empty(PREAMBLE // 8, dtype=np.int64)
    await buf.read_into(pre, 0)
    if int(pre[_MAGIC // 8]) != MAGIC:
        raise InterfaceError(f"buffer {buf.name!r} is not a parameter store (bad magic); pick another name, "
                             f"or remove it with `smb2 rm {buf.name}`")
    if int(pre[_FORMAT // 8]) != FORMAT:
        raise _other_format(buf.name, int(pre[_FORMAT // 8]))
    hint = (f"remove it with `smb2 rm {buf.name}` and start again (from a checkpoint with init_from=, if there "
            "is one)")
    # the header's words are checked before they size a read: garbage there
    # must not become a read (an allocation) of terabytes
    table_len = int(pre[_TABLE // 8])
    if not 0 < table_len <= buf.nbytes - PREAMBLE:
        raise InterfaceError(f"store {buf.name!r} is damaged: its header says its layout table is {table_len} "
                             f"bytes long, and the store is {buf.nbytes} bytes", hint=hint)
    table = await buf.read(PREAMBLE, table_len)
    try:
        layout = Layout.from_table(table.tobytes())
    except (ValueError, KeyError, TypeError, IndexError, msgpack.UnpackException) as exc:
        raise InterfaceError(f"store {buf.name!r} is damaged: its layout table is unreadable ({exc})",
                             hint=hint) from None
    cmap, data_off, total = layout.geometry(buf.stripe, buf.nservers)
    said = (int(pre[_NOTE_OFF // 8]), int(pre[_NOTE_SLOTS // 8]), int(pre[_DATA_OFF // 8]))
    if said != (cmap.start, cmap.slots, data_off) or total > buf.nbytes:
        raise InterfaceError(f"store {buf.name!r} is damaged: its header places the control words and data at "
                             f"{said[0]}, {said[1]} words, {said[2]} where its layout table puts them at "
                             f"{cmap.start}, {cmap.slots} words, {data_off} (of {total} bytes; the store is "
                             f"{buf.nbytes})", hint=hint)
    buf.set_notify_area(cmap.start, cmap.slots)
    return layout, data_off


def _other_format(name: str, found: int) -> InterfaceError:
    """A store written in another format than this smb2's: refused, never read."""
    made_by = ("an older smb2 (0.1.0 before the counted start barrier)" if found < FORMAT
               else "a newer smb2")
    return InterfaceError(
        f"store {name!r} was written by {made_by} in store format {found}; this smb2 reads format {FORMAT} "
        "and does not read it",
        hint=f"remove it with `smb2 rm {name}` and start again (from a checkpoint with init_from=, if one was saved "
             "by this smb2), or run the smb2 that wrote it to finish or save that job")


async def _read_control(buf: Buffer, cmap: lc.ControlMap, ranks: tuple[int, ...] | None = None) -> Control:
    """A store's control words as one :class:`Control`: the version, the head
    line and every rank's row (one read per page), or (``ranks``) only
    those ranks' rows, the others read as 0."""
    words = np.zeros(lc.slots_for(cmap.workers), np.int64)
    head = np.empty(lc.RANK_BASE, np.int64)
    version = np.empty(1, np.int64)
    wanted = ([(p, 0, cmap.ranks_on(p)) for p in range(cmap.pages)] if ranks is None
              else [(r % cmap.pages, r // cmap.pages, 1) for r in sorted(set(ranks))])
    rows = [np.empty(lc.RANK_WORDS * n, np.int64) for _p, _first, n in wanted]
    await asyncio.gather(buf.read_into(head, cmap.head), buf.read_into(version, cmap.start),
                         *(buf.read_into(out, cmap.rows_offset(p) + lc.ROW_BYTES * first)
                           for out, (p, first, _n) in zip(rows, wanted)))
    words[lc.VERSION] = version[0]
    cmap.put_head(words, head)
    for out, (p, first, _n) in zip(rows, wanted):
        cmap.put_rows(words, p, first, out)
    control = Control.parse(words, cmap.workers)
    return control if ranks is None else control.only(sorted(set(ranks)))

