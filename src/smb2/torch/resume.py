"""Whole resume: each rank's optimizer state, step and LR schedules, kept on
the memory servers beside the store, so that a resumed run continues with
its momentum or Adam moments and its schedule's position, with no lines in
the training script beyond the one-line port::

    opt = smb2.torch.AsyncOptimizer(torch.optim.AdamW(...), model, name="run-17")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

**What a save holds.**  Rank ``r`` keeps, in its own buffer
``<store>/optim/<r>`` (:func:`smb2.train.store.optimizer_state_name`), the
wrapped optimizer's ``state_dict()`` (moments, momentum buffers; the param
groups with their learning rates), the ``state_dict()`` of every LR
scheduler built on the optimizer, and the step they belong to.

**When.**  Every ``every`` seconds (``state_every=`` of AsyncOptimizer, 5 s
by default) and at ``close()``, but no sooner than the rank's exchange has
moved ``1 / share`` times the last save's bytes since it (``state_share=``,
:data:`SAVE_SHARE`: saves add at most 2 % to what the rank's link carries).
Without that bound, on the language model of ``smb2 bench tta`` (5.1 M
parameters, AdamW, 4 workers, 1 Gbit/s links) rank 0's saves of the
weights and moments, 62 MB every 5 s, nearly doubled its link's bytes per
step, and under ``allreduce`` every rank waits for the slowest: there a save
now comes every 150 steps or so (a save is 12 bytes a parameter, a step
moves 4), and a restart trains again at most that many.  ``share=None``
saves by time alone.  The training thread pays little: after
an optimizer step that makes a save due, a background thread serializes the
optimizer's tensors while the next step's forward and backward compute (the
optimizer changes its state only in its own ``step()``, which waits for
that serialization: it has finished unless a step is shorter than one
copy of the state).  The schedulers and learning rates are taken at the
start of the next ``step()``, after the loop's ``sched.step()`` calls, so a
save is the state "after step N" as step N + 1 finds it.  The bytes go out
through the background loop; a save that comes due while the previous one
is still being written is skipped, never queued.

**The buffer.**  Two slots, each a 64-byte header (magic, format, sequence
number, step, lineage, byte count, CRC-32 of the data, run) and the data.  A
save goes to the slot of the older one, data first and header last, so a
crash in the middle of a save leaves the previous save whole; a reader takes
the newest slot whose header and checksum are whole.  The buffer is sized
with a quarter of headroom and made again, larger, when a save outgrows it.

**What is loaded.**  On a resumed run (``store.resumed``: a run that did not
finish, ``resume=True``, a torchrun restart) each rank loads the newest
whole save of its own rank whose lineage is the store's
(:attr:`smb2.train.lifecycle.Control.origin`: when the fresh run that the
weights descend from was opened).  A fresh run never loads a save made
before it, nor one left by an earlier store of the same name; a fresh run
from a checkpoint (``init_from=``) loads the states saved beside it, which
rank 0 restored into these buffers under the checkpoint's lineage
(:meth:`smb2.train.store.StoreImage.restore_optimizer_states`).  The
optimizer's state is loaded when the AsyncOptimizer is made; the
schedulers, which are built on it afterwards, at its first ``step()`` (and
the saved learning rates with them, since building a scheduler rewrites
them).  The rank continues from the save's step (``opt.start_step``), not
from the store's step word: under the asynchronous rules the weights hold
up to a few seconds of this rank's later steps, which it trains again like
a stale asynchronous step, and in exchange the data position, the optimizer
state and the schedules agree (under ``allreduce``, the default, the save
holds the weights too: below).  A resumed run with no save (it died before its first, or the
servers lost the buffer) continues at the store's step with a fresh
optimizer state and says so (WARNING).

**Rule allreduce: rank 0's saves hold the weights.**  Under ``allreduce``
every rank holds the same weights and the same optimizer state, and the
store's weights are written only at ``close()``.  Rank 0 alone saves, for
every rank (``shared``), and its saves carry the model's weights as they
were at the save's step (``weights``): a resumed run, such as the new run a
torchrun restart of the group opens, continues from one consistent point,
weights, moments, schedules and step of the same save, at most
``state_every`` seconds behind the failure.

**A worker taken back.**  Under ``allreduce``, a worker restarted on its own
(one launcher per worker) is taken back into the running run
(:mod:`smb2.train.roster`): its leader writes a save into the restarted
rank's own buffer at the start of a step (:meth:`SavedState.hand_over`:
the weights and the optimizer state as after the step before, the
schedules, the step, and the round it starts at), and the rank loads that
one save, or stops (it could not train in step with anything else).
The save carries the mixed-precision ``GradScaler``'s state too (its scale
and growth count): every rank's gradients are scaled by its own scaler
and the mean is unscaled by each rank's own, so ranks whose scales differ
would step on different means and their weights would part.  The
restarted rank's loop scaled its first loss before it could load the
handed-over scale (it loads at its first backward): that backward's
gradients are rescaled by the ratio of the two (powers of 2: exactly)
before they go (:meth:`SavedState.take_loss_scale`).  A scaler holds no
reference to its optimizer, so it is found among the interpreter's
objects (``gc.get_objects``: one pass, on the leader when it hands over
and on the restarted rank once); with several enabled scalers in one
process none is handed over (WARNING: their scales may then differ).

**Finding the schedulers.**  A torch ``LRScheduler`` holds its optimizer;
the optimizer holds nothing of it.  At the first ``step()`` the objects
that refer to the AsyncOptimizer or to the wrapped optimizer are looked up
once (``gc.get_referrers``: one pass over the interpreter's objects,
milliseconds) and the LR schedulers among them kept, by weak reference.
Limits: a scheduler built after the first ``step()`` is not saved; two
top-level schedulers of the same class cannot be told apart between runs,
so their positions are not restored (WARNING); the composite ones
(``SequentialLR``, ``ChainedScheduler``) carry their parts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import io
import logging
import math
import struct
import time
import weakref
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from ..client import Buffer, Client
from ..errors import InterfaceError, InvalidArgumentError, NoSuchBuffer, OutOfMemory
from ..train import beside
from ..train.store import ParameterStore, choose_stripe, optimizer_state_name, optimizer_state_what
from .loop_thread import LoopThread

log = logging.getLogger("smb2.torch")

__all__ = ["SAVE_EVERY", "SAVE_SHARE", "SavedState", "StateSlots", "schedulers_on"]

#: seconds between saves of a rank's optimizer state (``state_every=``)
SAVE_EVERY = 5.0
#: the most that saves add to a rank's exchange bytes (``state_share=``): a
#: save waits until the exchange moved ``1 / SAVE_SHARE`` times the last one
SAVE_SHARE = 0.02
MAGIC = int.from_bytes(b"SMB2OPTS", "little")
FORMAT = 1
HEADER = 64
# the header's int64 words
_MAGIC, _FORMAT, _SEQ, _STEP, _ORIGIN, _NBYTES, _CRC, _RUN = range(8)
SLOT_ALIGN = 4096
#: a buffer holds this much more than the save that made it
HEADROOM = 1.25
_LIGHT_LEN = struct.Struct("<Q")
SCHEDULERS = (LRScheduler, ReduceLROnPlateau)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


# -- the buffer: two slots --------------------------------------------------------

class StateSlots:
    """One rank's buffer of saves: two slots, the newer whole one wins."""

    def __init__(self, client: Client, parent: str, what: str, buf: Buffer | None, headers: np.ndarray,
                 replicas: int = 1) -> None:
        self.client = client
        self.parent, self.what = parent, what
        self.name = beside.name_of(parent, what)
        self.buf = buf
        #: the copies a buffer made again gets (the store's)
        self.replicas = replicas
        #: the two slots' headers as last read or written (int64 words)
        self.headers = headers

    @classmethod
    async def open(cls, client: Client, parent: str, what: str, replicas: int = 1) -> StateSlots:
        """The side buffer ``what`` of store ``parent`` (made with the
        store's ``replicas`` at the first save)."""
        try:
            buf = await beside.find(client, parent, what)
        except NoSuchBuffer:
            return cls(client, parent, what, None, np.zeros((2, HEADER // 8), np.int64), replicas)
        headers = np.zeros((2, HEADER // 8), np.int64)
        if buf.nbytes >= 2 * HEADER and buf.nbytes % 2 == 0:
            for k in range(2):
                await buf.read_into(headers[k], k * (buf.nbytes // 2))
        return cls(client, parent, what, buf, headers, replicas)

    @property
    def capacity(self) -> int:
        """Data bytes one slot holds (0: no buffer yet)."""
        return 0 if self.buf is None else self.buf.nbytes // 2 - HEADER

    def _whole_header(self, k: int, origin: int) -> bool:
        h = self.headers[k]
        return (int(h[_MAGIC]) == MAGIC and int(h[_FORMAT]) == FORMAT and int(h[_ORIGIN]) == origin
                and 0 <= int(h[_NBYTES]) <= self.capacity)

    async def newest(self, origin: int) -> tuple[np.ndarray, bytes] | None:
        """(header, data) of the newest whole save of lineage ``origin``."""
        if self.buf is None or origin == 0:
            return None
        order = sorted((k for k in range(2) if self._whole_header(k, origin)),
                       key=lambda k: -int(self.headers[k][_SEQ]))
        for k in order:
            h = self.headers[k]
            data = (await self.buf.read(k * (self.buf.nbytes // 2) + HEADER, int(h[_NBYTES]))).tobytes()
            if zlib.crc32(data) == int(h[_CRC]):
                return h.copy(), data
            log.warning("buffer %r: slot %d (step %d) is torn (checksum mismatch): using the older save",
                        self.name, k, int(h[_STEP]))
        return None

    async def write(self, *pieces: bytes | memoryview, step: int, origin: int, run: int) -> None:
        """Write the data (``pieces``, one after the other: no copy joins
        them) into the older slot, data first, header last."""
        nbytes = sum(len(p) for p in pieces)
        if nbytes > self.capacity:
            await self._grow(nbytes)
        assert self.buf is not None
        seqs = [int(h[_SEQ]) if int(h[_MAGIC]) == MAGIC else -1 for h in self.headers]
        k = int(np.argmin(seqs))
        slot = k * (self.buf.nbytes // 2)
        header = np.array([MAGIC, FORMAT, max(seqs) + 1, step, origin, nbytes,
                           await asyncio.to_thread(_crc32, pieces), run], np.int64)
        starts = np.cumsum([0] + [len(p) for p in pieces[:-1]])
        await asyncio.gather(*(self.buf.write(slot + HEADER + int(at), p) for at, p in zip(starts, pieces) if len(p)))
        await self.buf.write(slot, header)
        self.headers[k] = header

    async def _grow(self, need: int) -> None:
        """Make the buffer again with room for ``need`` bytes per slot (the
        saves it held go: this one replaces them)."""
        slot = _round_up(HEADER + math.ceil(need * HEADROOM), SLOT_ALIGN)
        self.buf = await beside.make(self.client, self.parent, self.what, 2 * slot, replicas=self.replicas,
                                     stripe=choose_stripe(2 * slot, len(self.client.servers)))
        self.headers[...] = 0
        log.debug("buffer %r: %d bytes per slot", self.name, slot)


# -- what a save holds ------------------------------------------------------------

def _save(obj: Any) -> memoryview:
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getbuffer()


def _crc32(pieces: tuple[bytes | memoryview, ...]) -> int:
    crc = 0
    for p in pieces:
        crc = zlib.crc32(p, crc)
    return crc


def _load(raw: bytes | memoryview) -> Any:
    return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)


def _frame(light: memoryview, heavy: memoryview) -> tuple[bytes | memoryview, ...]:
    """A save's data: the light part's length, the light part (step, param
    groups, schedulers), the optimizer's tensors."""
    return _LIGHT_LEN.pack(len(light)), light, heavy


def _unframe(data: bytes) -> tuple[dict[str, Any], dict[Any, Any]]:
    """The light part and the heavy one: the optimizer's tensors, or (a
    save that says ``weights``) those and the model's weights."""
    (n,) = _LIGHT_LEN.unpack_from(data)
    start = _LIGHT_LEN.size
    return _load(data[start:start + n]), _load(data[start + n:])


def _heavy(tensors: dict[Any, Any], weights: np.ndarray | None) -> dict[Any, Any]:
    """What a save's heavy part holds: the optimizer's tensors, and the
    model's flat weights where the save carries them."""
    return tensors if weights is None else {"state": tensors, "weights": torch.from_numpy(weights)}


def check_state(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]], state: dict[Any, Any]) -> None:
    """Raise ValueError, saying what, unless a saved state fits
    ``optimizer``'s parameters: as many groups and parameters, every
    per-parameter tensor of its parameter's shape and of a floating dtype
    (a step count may be an integer), every value and learning rate
    finite.  Torch would load a wrong shape and fail only at the first
    step, naming neither the store nor the save; a NaN moment or an
    infinite learning rate would load silently."""
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"it has {len(groups)} parameter group(s), this optimizer {len(optimizer.param_groups)}")
    params: dict[Any, torch.Tensor] = {}
    for g, (saved, live) in enumerate(zip(groups, optimizer.param_groups)):
        if len(saved["params"]) != len(live["params"]):
            raise ValueError(f"its parameter group {g} has {len(saved['params'])} parameters, this optimizer's "
                             f"{len(live['params'])}")
        lr = saved.get("lr")
        lr = float(lr) if isinstance(lr, (int, float, torch.Tensor)) else None
        if lr is not None and not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"its learning rate in group {g} is {lr}")
        params.update(zip(saved["params"], live["params"]))
    for index, entries in state.items():
        p = params.get(index)
        if p is None:
            raise ValueError(f"it holds state for parameter {index!r}, which no group names")
        for key, t in entries.items():
            if not isinstance(t, torch.Tensor):
                continue
            what = f"{key} of parameter {index} (shape {tuple(p.shape)})"
            if t.dim() > 0 and t.shape != p.shape:
                raise ValueError(f"its {what} has shape {tuple(t.shape)}")
            if not (t.is_floating_point() or (key == "step" and not t.is_complex() and t.dtype != torch.bool)):
                raise ValueError(f"its {what} is of dtype {t.dtype}")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"its {what} holds non-finite values (NaN or infinity)")


def schedulers_on(*optimizers: object) -> list[Any]:
    """The LR schedulers that hold one of ``optimizers`` (found through the
    garbage collector's referrers: a scheduler refers to its optimizer,
    directly or through its instance dict)."""
    targets = {id(o) for o in optimizers}

    def on_ours(x: object) -> bool:
        return isinstance(x, SCHEDULERS) and id(getattr(x, "optimizer", None)) in targets

    referrers = gc.get_referrers(*optimizers)
    found = {id(r): r for r in referrers if on_ours(r)}
    dicts = [r for r in referrers if isinstance(r, dict) and id(r.get("optimizer")) in targets]
    if dicts:
        ids = {id(d) for d in dicts}
        found.update((id(o), o) for o in gc.get_referrers(*dicts)
                     if on_ours(o) and id(getattr(o, "__dict__", None)) in ids)
    # the parts of SequentialLR / ChainedScheduler go with their whole
    parts = {id(p) for s in found.values() for p in getattr(s, "_schedulers", ())}
    return [s for i, s in found.items() if i not in parts]


def loss_scaler(store: ParameterStore) -> Any | None:
    """This process's one enabled mixed-precision loss scaler
    (``torch.amp.GradScaler`` or its kinds); None where there are none, or
    several (WARNING: which one scales ``store``'s loss is not known).  A
    scaler holds no reference to the optimizer it scales for, so the
    garbage collector's objects are looked through (one pass)."""
    kind = torch.amp.GradScaler
    scalers = [o for o in gc.get_objects() if issubclass(type(o), kind) and o.is_enabled()]
    if len(scalers) > 1:
        log.warning("store %r: %d enabled GradScalers in this process: the loss scale of a restarted rank is not "
                    "handed over, and its gradients may be scaled unlike the other ranks' (their weights then "
                    "part); use one GradScaler for the model of rule 'allreduce'", store.name, len(scalers))
        return None
    return scalers[0] if scalers else None


def _key(scheduler: object) -> str:
    return f"{type(scheduler).__module__}.{type(scheduler).__qualname__}"


# -- the training thread's side ---------------------------------------------------

class SavedState:
    """A rank's optimizer state, step and schedules, saved and loaded (see
    the module's doc).  The AsyncOptimizer calls :meth:`before_step`,
    :meth:`after_step` and :meth:`close`; its start step is
    :attr:`start_step`."""

    def __init__(self, optimizer: torch.optim.Optimizer, owners: tuple[object, ...], store: ParameterStore,
                 loop: LoopThread, slots: StateSlots | None, every: float | None, keeper: int | None = None,
                 weights: Callable[[], np.ndarray] | None = None, share: float | None = SAVE_SHARE) -> None:
        self.optimizer = optimizer
        #: the most saves add to this rank's exchange bytes (None: saves by time alone)
        self.share = share
        #: the exchange's bytes when the last save began, and that save's size (None: none yet)
        self._moved_at_save = 0
        self._save_bytes: int | None = None
        #: the model's flat weights now (a copy), which each save carries (rule allreduce)
        self.weights_now = weights
        #: the weights the loaded save carried (None: the store's are this rank's)
        self.weights: np.ndarray | None = None
        #: the rank whose saves this rank loads (and writes, if it is that rank)
        self.keeper = store.rank if keeper is None else keeper
        self.owners = owners
        self.store = store
        self.loop = loop
        self.slots = slots
        self.every = every
        #: the step this rank continues from (a resumed save's, else the store's)
        self.start_step = store.start_step
        #: the lineage of the store's weights (saves carry it; see the module's doc)
        self.origin = 0 if store.control is None else store.control.origin
        #: what the save being loaded holds for the schedulers (until the first step)
        self._to_restore: dict[str, Any] | None = None
        #: the loss scaler's state a leader handed this rank (until its first backward)
        self._loss_scale: dict[str, Any] | None = None
        self._schedulers: list[weakref.ref[Any]] | None = None
        self._last = time.monotonic()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        #: (step, future of the optimizer tensors' bytes) of the save being made
        self._serializing: tuple[int, concurrent.futures.Future[memoryview]] | None = None
        self._writing: concurrent.futures.Future[None] | None = None
        #: saves written (stats)
        self.saves = 0

    @classmethod
    def open(cls, optimizer: torch.optim.Optimizer, owners: tuple[object, ...], store: ParameterStore,
             loop: LoopThread, every: float | None, *, shared: bool = False,
             weights: Callable[[], np.ndarray] | None = None, share: float | None = SAVE_SHARE,
             handed_over: int | None = None) -> SavedState:
        """Open rank ``store.rank``'s saves; on a resumed run load the newest
        of the store's lineage into ``optimizer``.  ``shared``: every rank's
        optimizer state is the same (rule allreduce): rank 0 alone saves it,
        and every rank loads rank 0's.  ``weights``: the model's flat weights
        now, which each save then carries (and :attr:`weights` holds the
        loaded save's).  ``share``: the most saves add to this rank's
        exchange bytes (see the module's doc; None: by time alone).
        ``handed_over``: this rank was taken back at that round, and loads
        the save its leader handed it (:meth:`hand_over`) whatever ``every``
        says."""
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not 0 < share <= 1):
            raise InvalidArgumentError(f"state_share must be a fraction in (0, 1] or None, not {share!r}",
                                       hint="state_share=None saves every state_every seconds whatever the "
                                            "exchange moves")
        if every is not None and (isinstance(every, bool) or not isinstance(every, (int, float)) or every <= 0):
            raise InvalidArgumentError(f"state_every must be a positive number of seconds or None, not {every!r}",
                                       hint="state_every=None neither saves nor loads the optimizer's state")
        if every is None:
            saved = cls(optimizer, owners, store, loop, None, None, weights=weights)
            if handed_over is not None:
                saved._load_handed_over(handed_over)
            return saved
        keeper = 0 if shared else store.rank
        slots = loop.run(StateSlots.open(store.client, store.name, optimizer_state_what(keeper),
                                         store.buf.replicas))
        saved = cls(optimizer, owners, store, loop, slots, float(every), keeper, weights,
                    None if share is None else float(share))
        if handed_over is not None:
            saved._load_handed_over(handed_over)
        elif store.resumed:
            saved._load()
        return saved

    def _load_handed_over(self, round_: int) -> None:
        """The save this rank's leader handed it when it took it back at
        round ``round_``: loaded, or an error (nothing else trains in step)."""
        st = self.store
        side = optimizer_state_name(st.name, st.rank)
        own = self.loop.run(StateSlots.open(st.client, st.name, optimizer_state_what(st.rank), st.buf.replicas))
        found = self.loop.run(own.newest(self.origin))
        why = "it is not there"
        if found is not None:
            header, data = found
            try:
                light, tensors = _unframe(data)
                if light.get("round") != round_:
                    raise InvalidArgumentError(f"the newest one is for round {light.get('round')}")
                self._apply(light, tensors)
            except Exception as exc:
                why = str(exc)
            else:
                self._to_restore = light
                self._loss_scale = light.get("scaler")
                self.start_step = int(header[_STEP])
                log.info("store %r: rank %d loaded the %s state, weights and %d LR schedule(s) of step %d that "
                         "its leader handed it%s", st.name, st.rank, light["optimizer"], len(light["schedulers"]),
                         self.start_step, "" if self._loss_scale is None else
                         f" (loss scale {self._loss_scale['scale']:g} at its first backward)")
                return
        raise InterfaceError(f"rank {st.rank} was taken back into the training of store {st.name!r} at round "
                             f"{round_}, but the state its leader handed it (side buffer {side!r}) cannot be "
                             f"loaded: {why}",
                             hint="restart the whole job (resume=True continues from rank 0's last save)")

    def _apply(self, light: dict[str, Any], tensors: dict[Any, Any]) -> None:
        """Load a save's optimizer state (and weights, where it holds them);
        raises what makes it unusable for this job."""
        weights = None
        if light.get("weights"):
            weights = tensors["weights"].numpy()
            tensors = tensors["state"]
            if weights.shape != self.store.flat().shape or weights.dtype != self.store.flat().dtype:
                raise InvalidArgumentError(f"its weights are {weights.size} {weights.dtype} values, this "
                                           f"model has {self.store.flat().size} {self.store.flat().dtype}")
            if not np.isfinite(weights).all():
                raise InvalidArgumentError("its weights are not all finite")
        if light["optimizer"] != type(self.optimizer).__name__:
            raise InvalidArgumentError(f"it is {light['optimizer']}'s, this job's optimizer is "
                                       f"{type(self.optimizer).__name__}")
        check_state(self.optimizer, light["param_groups"], tensors)
        self.optimizer.load_state_dict({"state": tensors, "param_groups": light["param_groups"]})
        self.weights = weights

    async def hand_over(self, restarted: dict[int, int], round_: int, step: int) -> None:
        """Rule allreduce, this rank leading at the start of round
        ``round_`` (backward of step ``step + 1`` under way, so nothing here
        changes): write into each restarted rank's own buffer a save of the
        weights, optimizer state and schedules as after step ``step``, for
        it to start at that round."""
        st = self.store
        if self._schedulers is None:
            self._find_schedulers()
        # (the scale of the backward under way: the scaler updates it only after the step)
        scaler = loss_scaler(st)
        light = self._light(step, round=round_, scaler=None if scaler is None else scaler.state_dict())
        # (serialized on a thread: this loop beats for this rank meanwhile, and the others wait on it)
        heavy = await asyncio.to_thread(lambda: _save(_heavy(self.optimizer.state_dict()["state"], self._weights())))
        for rank in restarted:
            own = await StateSlots.open(st.client, st.name, optimizer_state_what(rank), st.buf.replicas)
            await own.write(*_frame(light, heavy), step=step, origin=self.origin, run=st.generation)

    def take_loss_scale(self) -> float:
        """A rank taken back, at the start of its first backward (its loss
        scaled already): load the loss scale its leader handed it into
        this process's scaler; the factor that turns the gradients of this
        backward into gradients at that scale (1.0: nothing handed over)."""
        state, self._loss_scale = self._loss_scale, None
        if state is None:
            return 1.0
        scaler = loss_scaler(self.store)
        if scaler is None:
            log.warning("store %r: rank %d was handed its leader's loss scale (%g), but this process has no enabled "
                        "GradScaler: its gradients are not scaled as the other ranks' are (their weights part); "
                        "scale the loss on every rank or on none", self.store.name, self.store.rank,
                        state["scale"])
            return 1.0
        fresh = scaler.get_scale()
        scaler.load_state_dict(state)
        return float(state["scale"]) / fresh

    def _load(self) -> None:
        assert self.slots is not None
        st, rank = self.store, self.keeper
        found = self.loop.run(self.slots.newest(self.origin))
        if found is None:
            self._start_afresh()
            log.warning("store %r: rank %d has no saved optimizer state of this run's lineage: it continues at "
                        "step %d with a fresh %s state (momentum and moments from zero, LR schedules from their "
                        "start)%s", st.name, rank, self.start_step, type(self.optimizer).__name__, self._from())
            return
        header, data = found
        try:
            light, tensors = _unframe(data)
            self._apply(light, tensors)
        except Exception as exc:        # a save this job cannot use: say so, train on
            self._start_afresh()
            log.warning("store %r: rank %d's saved optimizer state (step %d, in side buffer %r) is not loaded "
                        "(%s): it continues at step %d with a fresh %s state%s", st.name, rank, int(header[_STEP]),
                        optimizer_state_name(st.name, rank), exc, self.start_step, type(self.optimizer).__name__,
                        self._from())
            return
        # the guard names a state loaded just before an update went wrong
        side = optimizer_state_name(st.name, rank)
        st.guard.loaded(int(header[_STEP]), f"rank {rank}'s optimizer state from side buffer {side!r} of store "
                        f"{st.name!r}", side)
        self._to_restore = light
        self.start_step = int(header[_STEP])
        log.info("store %r: rank %d resumes its %s state and %d LR schedule(s) at step %d (the store's step "
                 "word says %d)", st.name, rank, light["optimizer"], len(light["schedulers"]), self.start_step,
                 st.start_step)

    def _start_afresh(self) -> None:
        """No save to load.  Where saves carry the weights (allreduce), the
        store's are those its run started from (rank 0 writes them only at
        close, with a save): every rank starts again at step 0, in step,
        not at the step its own heartbeat last said."""
        if self.weights_now is not None:
            self.start_step = 0

    def _from(self) -> str:
        return "" if self.weights_now is None else ", from the weights the run started from, as every rank"

    # -- hooks of AsyncOptimizer ------------------------------------------------------
    def before_step(self) -> None:
        """Before the wrapped optimizer's step: raise a failed save's error,
        find (and restore) the schedulers once, finish a save whose tensors
        are serialized."""
        if self.slots is None:
            if self._to_restore is not None:
                self._find_schedulers()     # (a save handed over: this rank saves none of its own)
            return
        if self._writing is not None and self._writing.done():
            self._collect()
        if self._schedulers is None:
            self._find_schedulers()
        if self._serializing is not None:
            step, heavy = self._serializing
            self._serializing = None
            if self.slots is not None:
                self._write(step, heavy.result())

    def after_step(self, step: int) -> None:
        """After the wrapped optimizer's step ``step``: when a save is due,
        serialize the optimizer's tensors in the background."""
        if (self.slots is None or self.every is None or self.keeper != self.store.rank
                or time.monotonic() - self._last < self.every or not self._exchange_moved_enough()
                or self._serializing is not None or (self._writing is not None and not self._writing.done())):
            return
        self._last = time.monotonic()
        self._moved_at_save = self._moved()
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="smb2-state")
        heavy = _heavy(self.optimizer.state_dict()["state"], self._weights())
        self._serializing = (step, self._executor.submit(_save, heavy))

    def close(self, step: int) -> None:
        """The last save (after the loop's last ``sched.step()``), written
        before this returns; raises what a save met."""
        if self.slots is None or self.keeper != self.store.rank:
            return
        try:
            if self._serializing is not None:
                self._serializing[1].result()
                self._serializing = None
            self._collect()
            if self._schedulers is None:
                self._find_schedulers()
            if self.slots is not None:
                self._write(step, _save(_heavy(self.optimizer.state_dict()["state"], self._weights())))
                self._collect()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    # -- inside ---------------------------------------------------------------------------
    def _moved(self) -> int:
        """The bytes this rank's exchange has moved so far (pushed and pulled)."""
        stats = self.store.stats
        return int(stats["bytes_pushed"]) + int(stats["bytes_pulled"])

    def _exchange_moved_enough(self) -> bool:
        """Has the exchange moved ``1 / share`` times the last save's bytes
        since that save began (always, before the first or without a share)?"""
        if self.share is None or self._save_bytes is None:
            return True
        return self._moved() - self._moved_at_save >= self._save_bytes / self.share

    def _collect(self) -> None:
        """Wait for the save being written; raise what it met, but for
        servers without room for it: then say so once and save no more."""
        writing, self._writing = self._writing, None
        if writing is None:
            return
        try:
            writing.result()
        except OutOfMemory as exc:
            log.warning("store %r: the servers have no room for rank %d's optimizer state (%s): it trains on "
                        "without saving it, and a resume would start its optimizer afresh; give the servers more "
                        "memory (each rank keeps two saves: for Adam about 4x the model's float32 bytes) or pass "
                        "state_every=None", self.store.name, self.store.rank, exc)
            self.slots = None

    def _weights(self) -> np.ndarray | None:
        return None if self.weights_now is None else self.weights_now()

    def _write(self, step: int, heavy: memoryview) -> None:
        assert self.slots is not None
        light = self._light(step)
        self._writing = self.loop.submit(self.slots.write(*_frame(light, heavy), step=step, origin=self.origin,
                                                          run=self.store.generation))
        self._save_bytes = len(light) + len(heavy)
        self.saves += 1

    def _light(self, step: int, **extra: Any) -> memoryview:
        """A save's light part, as after step ``step``: the optimizer's class,
        whether the weights come with it, its param groups, the schedulers'
        positions (and ``extra``)."""
        return _save({"optimizer": type(self.optimizer).__name__, "step": step, "workers": self.store.workers,
                      "weights": self.weights_now is not None,
                      "param_groups": self.optimizer.state_dict()["param_groups"],
                      "schedulers": {k: s.state_dict() for k, s in self._live_schedulers().items()}, **extra})

    def _live_schedulers(self) -> dict[str, Any]:
        live = [s for s in (r() for r in self._schedulers or []) if s is not None]
        return {_key(s): s for s in live}

    def _find_schedulers(self) -> None:
        found = schedulers_on(*self.owners)
        keys = [_key(s) for s in found]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            log.warning("several LR schedulers of the same class (%s) are built on the optimizer: their positions "
                        "are neither saved nor restored (a run cannot tell them apart)", ", ".join(twice))
        kept = []
        for s, k in zip(found, keys):
            try:
                _load(_save(s.state_dict()))
            except Exception as exc:     # its state does not survive torch.save / load(weights_only=True)
                log.warning("LR scheduler %s cannot be saved (%s): its position is not kept for a resume", k, exc)
                continue
            if k not in twice:
                kept.append(weakref.ref(s))
        self._schedulers = kept
        if self._to_restore is not None:
            self._restore(self._to_restore)
            self._to_restore = None

    def _say_other_scaling(self, light: dict[str, Any]) -> None:
        """A save made by a job of another number of workers, whose learning
        rates the script multiplied by this job's number before the first
        step (``diloco``'s recipe with SGD): they are restored as saved,
        scaled for the old job, while a rank without a save keeps the new
        scaling.  Said at WARNING, with the rates the recipe gives here."""
        made_by, workers = light.get("workers"), self.store.workers
        if made_by in (None, workers) or workers == 1:
            return
        now = [float(g["lr"]) for g in self.optimizer.param_groups]
        saved = [float(g["lr"]) for g in light["param_groups"]]
        if len(now) != len(saved) or not all(math.isclose(n, s * workers, rel_tol=1e-9) for n, s in zip(now, saved)):
            return
        log.warning("store %r: rank %d restores the learning rates saved by a job of %d workers (%s), which this "
                    "script scaled by the number of workers: that job's scaling, where a rank without a save keeps "
                    "this job's; for %d workers the script's scaling gives %s: set the rates again after the first "
                    "step() to take it", self.store.name, self.store.rank, made_by, ", ".join(f"{x:g}" for x in saved),
                    workers, ", ".join(f"{x * workers / made_by:g}" for x in saved))

    def _restore(self, light: dict[str, Any]) -> None:
        """The saved schedulers' positions, then the saved learning rates
        (building a scheduler rewrote them)."""
        live = self._live_schedulers()
        saved: dict[str, Any] = light["schedulers"]
        for key, state in saved.items():
            if key in live:
                live[key].load_state_dict(state)
        lost = sorted(set(saved) - set(live))
        unsaved = sorted(set(live) - set(saved))
        if lost:
            log.warning("store %r: rank %d saved the position of LR schedule(s) %s, but none such is built on "
                        "the optimizer before its first step(): not restored", self.store.name, self.store.rank,
                        ", ".join(lost))
        if unsaved:
            log.warning("store %r: LR schedule(s) %s had no saved position: they start from their beginning",
                        self.store.name, ", ".join(unsaved))
        self._say_other_scaling(light)
        for group, saved_group in zip(self.optimizer.param_groups, light["param_groups"]):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(float(saved_group["lr"]))
            else:
                group["lr"] = saved_group["lr"]
